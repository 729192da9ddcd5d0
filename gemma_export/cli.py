"""Export Gemma 3 / FunctionGemma 270M to ONNX (fp32, bf16, int8, int4) with the tied table stored once,
then run, verify, measure and bundle it for the board.

\b
    # the bundled Gemma 3 270M -> ./gemma-3-270m-onnx-int8, then text from it
    gemma-export --format onnx --dtype int8
    gemma-export generate --model gemma-3-270m-onnx-int8 --prompt "The sky is"
    # a transformers folder or a .gguf
    gemma-export --source ./my-gemma --dtype bf16 --out out/
    # 4-bit layers, int8 table -> ./gemma-3-270m-onnx-int4-table-int8
    gemma-export --dtype int4 --table-dtype int8
    # the board team's reference export (archive beside it), own tokenizer
    gemma-export --source ref/gemma.mlir --tokenizer tok/tokenizer.json
    # round to nearest, no calibration pass, in a folder of its own
    gemma-export --dtype int8 --no-calibrate --out gemma-3-270m-onnx-int8-rtn
    # near-float activations, the same logits on x86-64 and aarch64 (slower)
    # -> ./gemma-3-270m-onnx-int8-activation-residual
    gemma-export --dtype int8 --activation-residual
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import typer
from typer.core import TyperGroup

try:  # typer >= 0.29 carries its own copy of click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # older typer runs on click itself
    from click.exceptions import ClickException, UsageError
try:  # click >= 8.2 raises it for a bare command; older click prints the usage and exits 0 itself
    from typer._click.exceptions import NoArgsIsHelpError
except ImportError:
    try:
        from click.exceptions import NoArgsIsHelpError
    except ImportError:
        class NoArgsIsHelpError(UsageError):  # never raised by such a click
            pass

from quant.scales import SCALE_DTYPES, SCALE_METHODS

from .boards import BOARDS, DEFAULT_BOARD, DEFAULT_THREADS
from .config import DTYPES, QUANTIZED_DTYPES, TABLE_DTYPES
from .console import StreamClosed, StreamError, interrupt_exit_status, interrupts_raised
from .errors import ConfigError, GemmaExportError, OutputWritten, os_error_line, out_of_memory, out_of_memory_line

#: bench --board's help: each board's threads and memory budget, from ``boards.BOARDS``
BENCH_BOARD_HELP = "; ".join(
    f"{name}: {b.threads} threads and a {b.memory_bytes / 1e9:.1f} GB budget that must keep "
    f"{b.headroom_bytes / 1e6:.0f} MB free" for name, b in BOARDS.items()) + "."


def _path(value: str | Path) -> Path:
    """Parse a path option or argument: an empty value is refused (``Path("")`` would silently mean
    the current folder)."""
    if isinstance(value, Path):
        return value
    if not value.strip():
        raise typer.BadParameter("empty path")
    return Path(value)


def _file_path(value: str | Path) -> Path:
    """Parse an output file option (``--json``, ``--plot``): as :func:`_path`, and a name ending in
    ``/`` is refused (``Path`` would drop the slash and write a file where a folder was meant)."""
    last = value.replace(os.sep, "/").rstrip("/").rsplit("/", 1)[-1] if isinstance(value, str) else ""
    if isinstance(value, str) and value.strip() and (value.endswith(("/", os.sep)) or last in (".", "..")):
        raise typer.BadParameter(f"{value} names a folder (it ends in '/', '.' or '..'); expected a file name")
    return _path(value)


def _quality_reference(value: str) -> str:
    """``quality --reference``: a reference name, or an export folder (refused when empty, as :func:`_path`)."""
    if value in ("transformers", "fp32"):
        return value
    path = str(_path(value))
    return f"./{path}" if path in ("transformers", "fp32") else path  # "./fp32" stays a folder, not the keyword


#: the arguments the command group was invoked with (:meth:`_Group.make_context`)
_COMMAND_LINE: list[str] = []


def _given_value(param) -> str | None:
    """The text given for option ``param`` in this invocation's arguments (``--opt VALUE`` or
    ``--opt=VALUE``, the last one given, as click takes it), or None."""
    opts = getattr(param, "opts", None) or ()
    found = None
    args = _COMMAND_LINE
    for i, arg in enumerate(args):
        if arg in opts and i + 1 < len(args):
            found = args[i + 1]
        elif any(arg.startswith(f"{opt}=") for opt in opts if opt.startswith("--")):
            found = arg.split("=", 1)[1]
    return found


class _OneLineUsageError(ClickException):
    """A usage error (bad option value, missing option, unknown command) shown as this toolkit
    shows every error: one ``error:`` line on stderr, exit status 2."""

    exit_code = 2

    def __init__(self, error: UsageError, command_path: str = "gemma-export") -> None:
        # click's parser raises some errors ("Option '--prompt' requires an argument.") without a
        # context: ``command_path`` is then the command being parsed
        where = f" (see '{error.ctx.command_path if error.ctx is not None else command_path} --help')"
        # typer's choice check words its message like a pydantic error ("Value error, 'int9' is not one of ...")
        message = error.format_message().replace(": Value error, ", ": ")
        # ... and its integer check like one that names no value (fresh user: "--max-new-tokens abc")
        wrong_int = "Input should be a valid integer, unable to parse string as an integer"
        if wrong_int in message:
            given = _given_value(getattr(error, "param", None))
            message = message.replace(wrong_int, "expected a whole number" + (f", found {given!r}" if given else ""))
        if getattr(getattr(error, "param", None), "name", None) == "model" and message.startswith("Missing option"):
            message += " Give the export folder as --model DIR."  # `generate DIR` takes no positional folder
        super().__init__(f"{message}{where}")

    def show(self, file=None) -> None:
        _say_error(f"error: {self.format_message()}")


#: the commands that write an output folder or file (None: the export itself, the group's callback);
#: the others' Ctrl-C message says only "interrupted" (each passes ``writes`` to :func:`_reported`)
WRITING_COMMANDS = (None, "prepack", "dedupe", "bench", "bundle")


class _Group(TyperGroup):
    """The command group, with usage errors of the group and of every subcommand on one line."""

    def make_context(self, info_name, args, *rest, **kwargs):
        _COMMAND_LINE[:] = list(args)  # what this invocation was given (not sys.argv: CliRunner, wrappers)
        try:
            return super().make_context(info_name, args, *rest, **kwargs)
        except NoArgsIsHelpError as exc:  # bare `gemma-export`: the usage, as --help shows it
            typer.echo(exc.ctx.get_help())
            raise typer.Exit(0) from None
        except UsageError as exc:
            raise _OneLineUsageError(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            command = " ".join(filter(None, (ctx.command_path, ctx.invoked_subcommand)))
            raise _OneLineUsageError(exc, command) from None
        except ImportError as exc:
            # Ctrl-C while a lazily imported library (onnxruntime, torch) initialises reaches us as
            # "ImportError: initialization failed" raised from the KeyboardInterrupt
            interrupt = exc.__cause__ or exc.__context__
            if isinstance(interrupt, KeyboardInterrupt):
                _interrupted(ctx.invoked_subcommand in WRITING_COMMANDS,
                             signal_exit=interrupt_exit_status(interrupt))
            raise
        except KeyboardInterrupt as exc:  # outside a command's body, while it prints what it did: its
            # work is finished (or never began); typer would exit 130 without a word, 143 included
            _say_error("error: interrupted")
            raise typer.Exit(interrupt_exit_status(exc)) from None


app = typer.Typer(
    cls=_Group,
    add_completion=False,
    no_args_is_help=True,  # bare `gemma-export` shows the usage; any option (e.g. --dtype int8) exports
    help=__doc__,
    subcommand_metavar="[COMMAND] [ARGS]...",  # no command: the options export
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


class Format(str, enum.Enum):
    onnx = "onnx"


DType = enum.Enum("DType", [(name, name) for name in DTYPES], type=str)  # --dtype (config.DTYPES)


TableDType = enum.Enum("TableDType", [(name, name) for name in TABLE_DTYPES], type=str)  # --table-dtype
ScaleMethod = enum.Enum("ScaleMethod", [(name, name) for name in SCALE_METHODS], type=str)  # --scale-method
ScaleDType = enum.Enum("ScaleDType", [(name, name) for name in SCALE_DTYPES], type=str)  # --scale-dtype


def _fail(exc: GemmaExportError, debug: bool) -> None:
    if debug:
        raise exc
    if isinstance(exc, StreamClosed):  # `| head` has what it wanted: no message, the shell's status
        raise typer.Exit(exc.exit_code)
    # control characters from a file (a NUL in a tensor's location, an escape sequence) are shown
    # escaped: they would end the line early or drive the terminal
    message = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in str(exc))
    if len(message) > MAX_ERROR_CHARS:  # a value pasted into the message must not flood the terminal;
        # the middle goes, so that a long path at the start does not push the reason (the end) out
        head, tail = MAX_ERROR_CHARS * 3 // 5, MAX_ERROR_CHARS * 2 // 5
        message = (f"{message[:head]}... ({len(message) - head - tail:,} characters left out) ..."
                   f"{message[-tail:]}")
    _say_error(f"error: {message}")
    raise typer.Exit(exc.exit_code)


def _say_error(line: str) -> None:
    """Write an error line to standard error; when that fails too (closed, full, its reader gone:
    :mod:`~gemma_export.console`), the exit status alone tells, so the failure is not raised."""
    try:
        typer.echo(line, err=True)
    except (StreamError, StreamClosed):
        pass


#: an error line longer than this is cut
MAX_ERROR_CHARS = 500


@contextlib.contextmanager
def _reported(debug: bool, writes: bool = True) -> Iterator[None]:
    """A command's body: the toolkit's errors as one ``error:`` line (:func:`_fail`), Ctrl-C,
    SIGTERM and SIGHUP as :func:`_interrupted`; both end the command. Inside it Ctrl-C raises
    KeyboardInterrupt and SIGTERM or SIGHUP :class:`~gemma_export.console.Terminated`
    (:func:`~gemma_export.console.interrupts_raised`), so that writers clean up."""
    from .staging import MOVED_IN

    moved_in = MOVED_IN.set(None)
    with interrupts_raised():
        try:
            yield
        except GemmaExportError as exc:
            _fail(exc, debug)
        except OSError as exc:  # an input that cannot be read (writes fail as OutputError inside the writers)
            if debug:
                raise
            line = os_error_line(exc)
            # ENOMEM, e.g. mapping a GGUF under ulimit -v: "Cannot allocate memory" named nothing
            _fail(GemmaExportError(out_of_memory(line) if exc.errno == errno.ENOMEM else line), debug)
        except Exception as exc:  # Python's MemoryError, onnxruntime's failed allocation in a step: one line
            if debug or (line := out_of_memory_line(exc)) is None:
                raise
            _fail(GemmaExportError(line), debug)
        except OutputWritten as exc:
            _interrupted_once_written(exc.path, exc.what, exc.__cause__)
        except KeyboardInterrupt as exc:
            # after the rename of the command's own output (e.g. while its progress bars closed or its
            # frames returned); a command that does not write one (quality's scratch fp32 export) is not asked
            if writes and (written := MOVED_IN.get()) is not None:
                _interrupted_once_written(*written, exc)
            _interrupted(writes, interrupt_exit_status(exc))
        finally:
            MOVED_IN.reset(moved_in)


def _checked_threads(ctx: typer.Context, value: Optional[int]) -> Optional[int]:
    """``--threads`` checked while the command line is parsed, before any work, in the commands' own
    one-line wording for 0 and for too many alike (``runtime.check_threads``); with ``--debug``
    (parsed first: it is eager) the error is raised with its traceback, as in the commands."""
    from .runtime import check_threads

    try:
        check_threads(value)
    except GemmaExportError as exc:
        _fail(exc, bool(ctx.params.get("debug")))
    return value


def _checked_top(ctx: typer.Context, value: int) -> int:
    """``inspect --top`` checked while the command line is parsed (``inspect.check_top``), before the
    file is read, in the commands' one-line wording rather than click's range message."""
    from .inspect import check_top

    try:
        check_top("inspect", value)
    except GemmaExportError as exc:
        _fail(exc, bool(ctx.params.get("debug")))
    return value


def _interrupted(writes: bool = True, signal_exit: int = 130) -> None:
    """Ctrl-C, SIGTERM or SIGHUP: one line and the shell's exit status for the signal (130 for
    SIGINT, 143 for SIGTERM, 129 for SIGHUP); writers have cleaned up. ``writes``: the command
    writes output (its message then says that nothing was written)."""
    _say_error("error: interrupted; nothing was written (an existing output is unchanged)" if writes
               else "error: interrupted")
    raise typer.Exit(signal_exit)


@contextlib.contextmanager
def _reporting_written(path: Path, what: str) -> Iterator[None]:
    """Around what a writing command prints once its output is in place: an interrupt there says
    that the output is written and complete (:func:`_interrupted_once_written`)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        _interrupted_once_written(path, what, exc)


def _interrupted_once_written(path: Path, what: str, signal: BaseException | None) -> None:
    """Ctrl-C, SIGTERM or SIGHUP (``signal``) once the output was in place (while the command
    reported what it did): one line that says the output is complete, and 130, 143 or 129 as for any
    interrupt."""
    check = f" (`gemma-export verify {path}` checks it)" if what in ("export", "bundle") else ""
    _say_error(f"error: interrupted; the {what} {path} is written and complete{check}")
    raise typer.Exit(interrupt_exit_status(signal))


def _list_files(files: dict[str, int], width: int) -> None:
    for name, size in files.items():
        typer.echo(f"  {name:<{width}} {size:>15,} bytes")


def _mb(n: int) -> str:
    """Bytes in MB (10^6), the unit of every size and memory figure the commands print."""
    return f"{n / 1e6:,.1f} MB"


def _elapsed_line(seconds: float, peak_bytes: int) -> str:
    """The last line of `export` and `quality`: wall time and the process's peak resident memory."""
    return f"elapsed {seconds:.1f} s, peak memory {_mb(peak_bytes)}"


def _refuse_export_options(ctx: typer.Context) -> None:
    """Exit 2 when an export option stands before a subcommand (``gemma-export --dtype fp32 generate
    ...``): it would otherwise be ignored without a word."""
    given = [p for p in ctx.command.params
             if getattr(ctx.get_parameter_source(p.name), "name", "DEFAULT") not in ("DEFAULT", "DEFAULT_MAP")]
    if given:
        options = ", ".join(p.opts[0] for p in given)
        kind = "is an export option and does" if len(given) == 1 else "are export options and do"
        typer.echo(f"error: {options} {kind} nothing before `{ctx.invoked_subcommand}`; "
                   f"give `{ctx.invoked_subcommand}`'s own options after it (see `gemma-export {ctx.invoked_subcommand} --help`)",
                   err=True)
        raise typer.Exit(2)


def _show_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    from . import __version__

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    typer.echo(f"gemma-export {__version__} (onnx {installed('onnx')}, onnxruntime {installed('onnxruntime')})")
    raise typer.Exit()


@app.callback(invoke_without_command=True)
def main(
    ctx: typer.Context,
    format: Format = typer.Option(Format.onnx, "--format", help="Output format."),
    dtype: DType = typer.Option(DType.int8, "--dtype", help="Weight precision: fp32, bf16 (storage), int8 or int4 (block-wise)."),
    source: Optional[Path] = typer.Option(None, "--source", parser=_path, metavar="<path>", help="transformers folder, .gguf file, or a reference export .mlir (archive beside it); default: the bundled real Gemma 3 270M."),
    out: Optional[Path] = typer.Option(None, "--out", parser=_path, metavar="<path>", help="Output folder (default ./<model>-onnx-<dtype>: gemma-3-270m for the bundled weights, else the source's folder or file name without its extension and a GGUF's quantization tag, so the bundled GGUF given as --source lands in the same folder as no --source; int4 with --table-dtype int8: <model>-onnx-int4-table-int8; --activation-residual, --all-logits and --debug-outputs add -activation-residual, -all-logits and -debug-outputs)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="int8/int4 block size of layer weights (power of two >= 16; default 32)."),
    table_block_size: Optional[int] = typer.Option(None, "--table-block-size", help="Block size of the shared embedding table / LM head (default 128 for an int8 table, 32 for int4; int4 with 128: about 7% faster decode, +11% KL, README, Figures)."),
    hadamard: Optional[int] = typer.Option(None, "--hadamard", help="int8/int4: Hadamard rotation size folded into the weights to spread activation outliers (default 64; 0 = off)."),
    table_dtype: Optional[TableDType] = typer.Option(None, "--table-dtype", help="int4 only: the shared table's codes: int4 (the default, like the layers) or int8 (layers stay int4)."),
    asymmetric: bool = typer.Option(False, "--asymmetric", help="int4 only: a 4-bit zero point per block instead of the fixed 8."),
    scale_method: Optional[ScaleMethod] = typer.Option(None, "--scale-method", help="int4 only: how each block's scale is chosen: mse (clipping search, least squared error; the default) or rtn (the block's largest magnitude). The codes are then chosen by GPTQ unless --no-calibrate."),
    calibrate: Optional[bool] = typer.Option(None, "--calibrate/--no-calibrate", help="int8/int4: choose codes by GPTQ on a calibration text's activations (default: on when the source has a tokenizer); --no-calibrate rounds each weight to nearest (int4 scales still follow --scale-method)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", parser=_path, metavar="<path>", help="A tokenizer.json, or a folder holding one (with its tokenizer_config.json, special_tokens_map.json and chat_template.jinja), to put in the export instead of the source's: for a reference .mlir, which carries none, or to give FunctionGemma's own tokenizer. Checked against the model's vocabulary; it also tokenizes the calibration text."),
    calibration_text: Optional[Path] = typer.Option(None, "--calibration-text", parser=_path, metavar="<path>", help="UTF-8 text for --calibrate (default: Python's documentation topics, pydoc_data)."),
    calibration_tokens: Optional[int] = typer.Option(None, "--calibration-tokens", help="Tokens of the calibration text to run (default 4,096; 16 to 16,384; more: better int8/int4 codes, slower export)."),
    all_logits: bool = typer.Option(False, "--all-logits", help="Return logits for every position, not only the last."),
    debug_outputs: bool = typer.Option(False, "--debug-outputs", help="Add per-layer attention/MLP outputs for `gemma-export parity` to locate a divergence."),
    activation_residual: bool = typer.Option(False, "--activation-residual", help="int8 only: give every matmul also the residual of onnxruntime's int8 rounding of its input, so activations keep about float precision: on the real 270M half the KL, and the same logits on x86-64 and aarch64 (to ~0.01 instead of ~1.5), for ~1.3-1.6x the decode time and ~2x the prefill time (docs/quality.md, \"Activation residual\")."),
    scale_dtype: Optional[ScaleDType] = typer.Option(None, "--scale-dtype", help="int8/int4: how block scales are stored: float32 (the default) or float16, half the scales' bytes on disk (each scale rounded up to float16 before its codes are chosen; onnxruntime widens them once when it loads the model, so its graph optimizations, on by default, must stay on). Pays for --block-size 16 within the default's size (docs/quality.md)."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_show_version,
                                 help="Show the version of gemma-export and of its onnx and onnxruntime, and exit."),
) -> None:
    """Export Gemma 3 / FunctionGemma to ONNX with one shared tied-embedding table (the examples
    are in the module docstring, which ``--help`` shows)."""
    try:
        os.getcwd()  # every command resolves paths against it; a deleted one failed as "No such file or directory"
    except FileNotFoundError:
        _say_error("error: the current folder no longer exists (it was removed while the shell stood in it); "
                   "cd into an existing folder and run again")
        raise typer.Exit(2) from None
    if ctx.invoked_subcommand is not None:
        _refuse_export_options(ctx)
        return
    with _reported(debug):  # Ctrl-C, SIGTERM or SIGHUP during the imports (up to a second) is an interrupt too
        from tqdm import tqdm

        from .bench import archive_bytes
        from .exporter import export

    bars: dict = {}  # one bar per stage, created when the stage starts (after the "reading" line)
    # without a terminal (a log, CI) tqdm is off: a plain line every 15 s instead, with the time since the start
    plain = {"last": 0.0, "start": time.monotonic()}

    def progress(done: int, total: int, name: str) -> None:
        stage = "calibrating" if name.startswith("calibration") else "writing"
        if stage not in bars:
            for other in bars.values():
                other.close()
            if stage == "calibrating":
                typer.echo("calibrating: fp32 forward over the calibration text, one layer at a time ...", err=True)
            else:
                gptq = " (GPTQ)" if "calibrating" in bars else ""
                doing = {"fp32": "writing", "bf16": "rounding to bf16 and writing"}.get(dtype.value,
                                                                                     f"quantizing{gptq} and writing")
                typer.echo(f"{doing} {total} tensors ...", err=True)
            bars[stage] = tqdm(total=total, unit="layer" if stage == "calibrating" else "tensor", desc=stage,
                               disable=None, file=sys.stderr)
        bar = bars[stage]
        # layers are counted by the bar itself; a weight's scales and zero points are named as the weight
        label = "" if stage == "calibrating" else name.removesuffix("_scales").removesuffix("_zero_points")[-48:]
        bar.set_postfix_str(label, refresh=False)
        bar.update(done - bar.n)
        if bar.disable and (time.monotonic() - plain["last"] >= 15 or done == total):
            plain["last"] = time.monotonic()
            typer.echo(f"{stage}: {done}/{total} {label or 'layers'} ({plain['last'] - plain['start']:.0f} s in)", err=True)

    def close_bars() -> None:
        for bar in bars.values():
            bar.close()

    with _reported(debug):
        try:
            result = export(source, out, dtype.value, block_size=block_size, table_block_size=table_block_size,
                            hadamard_size=hadamard, table_dtype=table_dtype.value if table_dtype else None,
                            symmetric=not asymmetric, scale_method=scale_method.value if scale_method else None,
                            calibrate=calibrate, calibration_text=calibration_text,
                            calibration_tokens=calibration_tokens, all_logits=all_logits, debug_outputs=debug_outputs,
                            activation_residual=activation_residual,
                            scale_dtype=scale_dtype.value if scale_dtype else None, progress=progress, status=lambda message: typer.echo(message, err=True),
                            tokenizer=tokenizer)
        finally:
            close_bars()  # before any error line
    with _reporting_written(result.out_dir, "export"):  # the folder is already in place: said so
        _export_summary(result, archive_bytes(result.out_dir))


def _export_summary(result, archive: int) -> None:
    """What an export wrote: files, sizes, the shared table, calibration, time and memory."""
    rounded = ", so the weights were rounded to nearest (no calibration)" if result.dtype in QUANTIZED_DTYPES else ""
    typer.echo(f"wrote {result.out_dir}")
    _list_files(result.files, 28)
    typer.echo(f"  total {result.total_bytes:,} bytes ({_mb(result.total_bytes)})")
    typer.echo(f"archive (model.onnx + model.onnx.data, as `bench` reports it): {_mb(archive)}")
    table = "shared by the embedding lookup and the LM head" if result.tied else "two tables (LM head not tied)"
    typer.echo(f"tied table: {result.table_initializers} vocab x hidden initializer(s), {table}")
    if result.tokenizer_from is not None:
        typer.echo(f"tokenizer: from {result.tokenizer_from} (--tokenizer)")
    if result.quantization is not None:
        q = result.quantization
        from .manifest import table_codes_word

        rotation = f"Hadamard {q['hadamard_size']}" if q["hadamard_size"] else "no rotation"
        typer.echo(f"blocks: {q['block_size']} weights per scale in the layers, {q['table_block_size']} in the "
                   f"{table_codes_word(q, result.dtype)}table; {rotation}")
    if result.calibration is not None:
        typer.echo(f"calibration: GPTQ on {result.calibration['text']}")
    elif result.dtype in QUANTIZED_DTYPES:
        typer.echo("calibration: none; codes rounded to nearest")
    if result.activation_residual:
        typer.echo("activations: each matmul also multiplies the residual of its input's int8 rounding "
                   "(--activation-residual): about float precision")
    if result.scale_dtype == "float16":
        typer.echo("scales: float16 on disk (--scale-dtype float16), widened to float32 once when the model loads")
    if "tokenizer.json" not in result.files:
        typer.echo("note: no tokenizer in the export: the source gives none this toolkit reads (a GGUF's is "
                   f"rebuilt only when its tokenizer.ggml.model is 'llama'; a reference export has none){rounded}; `generate`, `bench` "
                   "and `quality` need one: export again with --tokenizer TOKENIZER.json (the model's own; "
                   "a file copied into the folder afterwards is not in its manifest, and `verify`, `bundle` "
                   "and `prepack` refuse the folder)", err=True)
    typer.echo(_elapsed_line(result.elapsed_s, result.peak_rss_bytes))


THREADS_HELP = "onnxruntime intra-op threads, 1 to 4 x this machine's CPUs (default: onnxruntime's, one per core)."
PREFILL_CHUNK_HELP = ("Feed the prompt in steps of at most N tokens (default 512, as llama.cpp's batch; 0: all at "
                      "once). fp32 logits agree to 4e-5 either way; int8 ones move by up to ~0.7 (8-bit activations), "
                      "which can flip a near-tied token (and so the whole text after it); "
                      "a longer step needs more activation memory while the prompt runs (the int8 export, a "
                      "3,072-token prompt in one step: a 1,289 MB peak, in steps of 512: 815 MB); the first decode "
                      "step gives it back.")


def _prefill_chunk(value: int | None) -> int | None:
    """``--prefill-chunk`` for the runtime: not given → ``runtime.DEFAULT_PREFILL_CHUNK`` (the help
    text names it); 0 → None, the whole prompt in one step; < 0 is refused by the runtime."""
    from .runtime import DEFAULT_PREFILL_CHUNK

    return DEFAULT_PREFILL_CHUNK if value is None else (None if value == 0 else value)


PREPACKED_HELP = ("Load the folder's pre-packed copy (written by `gemma-export prepack` on this machine). Default: "
                  "use it when it was made here from these files; --prepacked requires it, --no-prepacked ignores it.")


@app.command()
def generate(
    ctx: typer.Context,
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder."),
    prompt: Optional[str] = typer.Option(None, "--prompt", show_default=False, help="Text to continue (<bos> is added unless the text starts with it). Special-token text such as <start_of_turn> becomes that control token, as in transformers, so a chat turn can be written out (an instruction-tuned model such as FunctionGemma answers it; the bundled pre-trained Gemma 3 270M only continues text); FunctionGemma's function-calling tokens (<start_function_declaration> ...) exist in its own tokenizer only, and a note names any that this export's tokenizer reads as plain text."),
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", parser=_path, metavar="<path>",
        help="Read the prompt (in place of --prompt) from this UTF-8 text file ('-' = stdin), as it is, its last "
             "newline included: --prompt \"$(cat FILE)\" loses a file's trailing newlines, which end a chat turn."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate at most (at least 1)."),
    special_tokens: bool = typer.Option(
        True, "--special-tokens/--no-special-tokens",
        help="Show the special tokens the model generates in the text (e.g. FunctionGemma's function-call markers, "
             "where its tokenizer marks them special), or leave them out as transformers' "
             "decode(skip_special_tokens=True) does. The stop token that ends the generation is never shown."),
    threads: Optional[int] = typer.Option(None, "--threads", callback=_checked_threads, help=THREADS_HELP),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help=PREFILL_CHUNK_HELP, show_default=False),
    prepacked: Optional[bool] = typer.Option(None, "--prepacked/--no-prepacked", help=PREPACKED_HELP, show_default=False),
    json_out: Optional[Path] = typer.Option(
        None, "--json", parser=_file_path, metavar="<path>",
        help="Also write the prompt's and the new tokens' ids as a golden entry for `parity --golden` "
             "(prompt, prompt_ids, expected_ids, text, prefill_chunk, dtype) to this file ('-' = stdout)."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Greedy-decode a prompt with onnxruntime and print the prompt and the new text as it comes,
    then the timings (on stderr).

    \b
    Example:
      gemma-export generate --model gemma-3-270m-onnx-int8 \\
          --prompt "The capital of France is"

    With --json, the ids as a golden file: write it on one machine, and another checks that it
    gives the same greedy tokens:

    \b
      gemma-export generate --model DIR --prompt "..." --json golden.json
      gemma-export parity --model DIR --golden golden.json

    A prompt from a file, e.g. a chat turn ending in a newline:

    \b
      gemma-export generate --model DIR --prompt-file turn.txt
    """
    from .bench import check_outputs, to_stdout, write_json
    from .runtime import FUNCTION_GEMMA_TOKENS, generate as run

    if (prompt is None) == (prompt_file is None):
        raise UsageError("Missing option '--prompt' (or '--prompt-file')." if prompt is None else
                         "--prompt and --prompt-file: give one of them, not both.", ctx)
    with _reported(debug, writes=False):
        if prompt_file is not None:
            from .text_files import SMALL_FILE_BYTES, read_standard_input, read_text_file

            prompt = (read_standard_input("prompt") if str(prompt_file) == "-" else
                      read_text_file(prompt_file, "prompt file", whole_limit=SMALL_FILE_BYTES))
        # the prompt file too: --json over it replaced the prompt with a golden entry
        check_outputs(json_out, None, inputs=(model, *([prompt_file] if prompt_file not in (None, Path("-")) else [])),
                      report_key="expected_ids")
        chunk = _prefill_chunk(prefill_chunk)
        # the text as it is generated: the prompt, then each new piece; with --json -, stdout holds
        # the JSON alone and the text goes to stderr. Written before the --json file, so one that
        # cannot be written (full disk) does not lose the run
        err = to_stdout(json_out)
        started = []

        def show(piece: str) -> None:
            if not started:  # the prompt once the run is under way, not before a refusal
                started.append(True)
                typer.echo(prompt, nl=False, err=err)
            typer.echo(piece, nl=False, err=err)

        try:
            result = run(model, prompt, max_new_tokens=max_new_tokens, threads=threads, prefill_chunk=chunk,
                         prepacked=prepacked, on_text=show, special_tokens=special_tokens)
        finally:
            if started:  # the line ends, also before an error's
                with contextlib.suppress(StreamError, StreamClosed):
                    typer.echo("", err=err)
        if not started:  # no new text (an end-of-turn id first)
            typer.echo(prompt, err=err)
        for piece in result.unknown_tokens:  # what the model was given, after its text
            why = (" (FunctionGemma's function-calling tokens exist in its own tokenizer only)"
                   if piece in FUNCTION_GEMMA_TOKENS else "")
            typer.echo(f"note: {piece} is not a token of {model / 'tokenizer.json'}; it was read as plain text{why}",
                       err=True)
        if prompt == "":  # allowed (text from <bos> alone), but rarely meant (a shell variable that was empty)
            typer.echo("note: the prompt is empty; the text was generated from <bos> alone", err=True)
        if json_out is not None:  # the step too: parity feeds the prompt the same way (int8 logits depend on it)
            write_json({"prompt": prompt, "prompt_ids": result.prompt_ids, "expected_ids": result.new_ids,
                        "text": result.text, "prefill_chunk": chunk or 0, "dtype": result.dtype}, json_out)
    import statistics

    from .memory import peak_rss_bytes

    # the first new token comes from the prefill: with one new token there is no decode step to time;
    # the first decode step also gives the prompt's memory back, so the median leaves it out, as bench does
    decode = result.decode_ms[1:] if len(result.decode_ms) > 1 else result.decode_ms
    timing = f", decode median {statistics.median(decode):.1f} ms/token" if decode else ", no decode step"
    typer.echo(f"[{len(result.prompt_ids)} prompt token{'' if len(result.prompt_ids) == 1 else 's'}, {len(result.new_ids)} new; prefill {result.prefill_ms:.0f} ms"
               f"{timing}; {'pre-packed copy' if result.prepacked else 'weights packed while loading, no pre-packed copy'}; "
               f"peak memory {_mb(peak_rss_bytes())}]", err=True)
    from .bench import BUSY_OTHER_CPUS

    if result.other_cpus is not None and result.other_cpus >= BUSY_OTHER_CPUS:  # as bench warns
        typer.echo(f"note: other processes used {result.other_cpus:.2f} of the machine's {os.cpu_count() or 1} CPUs "
                   "while the prompt and steps ran: these times are not this model's alone (gemma-export bench "
                   "measures them)", err=True)
    if json_out is not None and not to_stdout(json_out):
        typer.echo(f"wrote {json_out} (a golden file: gemma-export parity --model {model} --golden {json_out})", err=True)
    if result.prepacked_note and not result.prepacked and prepacked is not False:  # not for the user's own choice
        typer.echo(f"note: {result.prepacked_note}", err=True)
    _note_changed_files(model)


def _note_changed_files(model: Path) -> None:
    """A note on stderr when files of the export ``model`` differ in size from its manifest: the
    command ran, but not with the files exported (a tokenizer changed moves every figure)."""
    from .manifest import resized_files

    try:
        changed = resized_files(model)  # unreadable listings and files are its own business
    except MemoryError:  # after the command's work: a note, not its failure
        typer.echo(f"note: {model}'s files were not compared with its manifest.json (out of memory)", err=True)
        return
    if changed:
        typer.echo(f"note: {', '.join(changed)} in {model} changed after the export (sizes differ from its "
                   f"manifest.json); gemma-export verify --model {model} checks every file", err=True)


@app.command()
def prepack(
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder."),
    threads: Optional[int] = typer.Option(None, "--threads", callback=_checked_threads, help=THREADS_HELP),
    remove: bool = typer.Option(False, "--remove", help="Delete the folder's pre-packed copy instead."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Pre-pack the weights for this machine: less heap memory.

    Writes MODEL/prepacked/: onnxruntime's optimized graph with the weights already in its kernels'
    packed layout. generate, bench, quality and parity then map the packed weights from disk instead
    of building them on the heap: the same logits, and Anonymous memory (which the kernel cannot
    reclaim) drops by about the archive's size (int8, the growth as bench counts it, after a short
    prompt and 128 steps: about 1.07 x -> 0.01 x the archive; at the last of 128 steps after a
    512-token prompt, the KV cache in use: 1.148 x -> 0.087 x; 2026-12-07). Decode speed stays the same. Peak resident memory rises a little, by clean file pages the kernel can reclaim. Run
    it on the machine that runs the model (the layout depends on the CPU and the onnxruntime
    version; a copy made elsewhere is ignored). Costs 2-2.2 x the data file on disk (4 x for bf16, up to 2.44 x with --scale-dtype float16); refused below 2.3 x (4.1 x, 2.6 x) free.

    \b
    Example:
      gemma-export prepack --model gemma-3-270m-onnx-int8
    """
    from .prepack import PREPACKED_DIR
    from .prepack import prepack as run
    from .prepack import remove as remove_copy

    with _reported(debug):
        if remove and threads is not None:
            raise typer.BadParameter("--threads does nothing with --remove (nothing runs); give one or the other",
                                     param_hint="'--threads'")
        if remove:
            removed = remove_copy(model, progress=lambda msg: typer.echo(msg, err=True))
            typer.echo(f"removed {model / PREPACKED_DIR}" if removed else f"{model}: no pre-packed copy to remove")
            return
        result = run(model, threads=threads, progress=lambda msg: typer.echo(msg, err=True))
    with _reporting_written(result.out_dir, "pre-packed copy"):
        typer.echo(f"wrote {result.out_dir} ({_mb(result.total_bytes)}) in {result.seconds:.1f} s; logits of "
                   f"{result.checked_tokens} token{'' if result.checked_tokens == 1 else 's'} identical to the export's")
        _list_files(result.files, 20)


@app.command(short_help="Re-check an export folder against its manifest.")
def verify(
    model_arg: Optional[Path] = typer.Argument(None, metavar="MODEL", parser=_path, help="An export folder (with manifest.json), or a board folder of `bundle`."),
    model_opt: Optional[Path] = typer.Option(None, "--model", parser=_path, metavar="<path>", help="The same, as the other commands take it."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Re-check an export folder against its manifest (sizes, sha256, no extra or outside files; the
    vocabulary, layers and layer types, attention and cache heads, sizes, dtype and quantization it
    records against the graph's), then run the ONNX checker and an onnxruntime load; a pre-packed
    copy (prepacked/) is checked against the checksums its prepacked.json records. A board folder written by `bundle` is checked
    against its BUNDLE.json (every file, the wheel and README included), then its model folder.

    \b
    Examples:
      gemma-export verify gemma-3-270m-onnx-int8
      gemma-export verify sl2610-int8    # a bundle: BUNDLE.json, then model/
    """
    from .bundle import verify_bundle
    from .verify import verify_manifest
    from .manifest import check_readable_folder, is_bundle
    from .onnx_files import BUNDLE_MANIFEST, BUNDLE_MODEL_DIR
    from .prepack import busy
    from .text_files import non_regular
    from .prepack import verify as verify_prepacked

    model = _one_model("verify", model_arg, model_opt, "export folder", "DIR", debug)
    with _reported(debug, writes=False):
        check_readable_folder(model)  # before its BUNDLE.json is looked for
        # BUNDLE.json alone makes it a board folder: a missing model/ is then named file by file
        # a folder or FIFO where the listing belongs is named by verify_bundle, not taken for an export
        bundled = is_bundle(model) or non_regular(model / BUNDLE_MANIFEST) is not None
        export_dir = model / BUNDLE_MODEL_DIR if bundled else model
        if busy(export_dir):  # its staging folder is not a leftover, and the copy is about to change
            raise GemmaExportError(f"{export_dir}: a gemma-export prepack is working on this folder; verify again when "
                                   "it has finished")
        files = verify_bundle(model) if bundled else verify_manifest(model)
        copy = verify_prepacked(export_dir)
    if bundled:
        typer.echo(f"ok: {model} matches BUNDLE.json ({len(files)} files, {sum(files.values()):,} bytes); its model "
                   "folder matches its manifest, whose figures match the graph, and loads in onnxruntime with finite "
                   "logits")
    else:
        typer.echo(f"ok: {model} matches its manifest ({len(files)} files, {sum(files.values()):,} bytes, "
                   f"manifest.json itself not counted), its figures (vocabulary, layers, dtype, quantization) match "
                   "the graph, and it loads in onnxruntime with finite logits (one step)")
    if copy:
        typer.echo(copy)


def _one_model(command: str, given: Optional[Path], model_opt: Optional[Path], what: str, metavar: str,
               debug: bool) -> Path:
    """The path a command takes either as its argument or as ``--model`` (as the other commands take
    it); refuses two different ones, or none."""
    if given is not None and model_opt is not None and given != model_opt:
        _fail(GemmaExportError(f"{command}: two {what}s given ({given} and --model {model_opt}); give one"), debug)
    if given is None and model_opt is None:
        _fail(GemmaExportError(f"{command}: no {what} given (gemma-export {command} {metavar}, or --model "
                               f"{metavar})"), debug)
    return given if given is not None else model_opt


@app.command(short_help="Show what an archive carries, and tables stored twice.")
def inspect(
    path_arg: Optional[Path] = typer.Argument(None, metavar="PATH", parser=_path, help="An .onnx (with its external data), .safetensors, .gguf, or reference .mlir file (its archive beside it); an export folder means its model.onnx, a bundle folder its export's, a transformers folder (or its model.safetensors.index.json) its weights, all shards as one."),
    model_opt: Optional[Path] = typer.Option(None, "--model", parser=_path, metavar="<path>", help="The same, as the other commands take it."),
    top: int = typer.Option(10, "--top", callback=_checked_top, help="How many of the largest tensors to list (0: none)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Show what an archive carries: tensor count, sizes by dtype, the largest tensors, and tensors
    stored twice (identical bytes or transposed), with the bytes they waste.

    \b
    Example:
      gemma-export inspect gemma-3-270m-onnx-int8/model.onnx --top 5
    """
    import json

    from .inspect import format_report, inspect_path

    path = _one_model("inspect", path_arg, model_opt, "path", "PATH", debug)
    with _reported(debug, writes=False):
        report = inspect_path(path)
    typer.echo(json.dumps(report.to_dict(top), indent=2) if as_json else format_report(report, top))


@app.command(short_help="Store each duplicated table of an ONNX model once.")
def dedupe(
    model: Path = typer.Argument(..., metavar="MODEL", parser=_path, help="An ONNX model (with its external data) that stores a table twice."),
    out: Path = typer.Option(..., "--out", parser=_path, metavar="<path>", help="Folder for the rewritten model (must not exist or be empty)."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Store each duplicated table of an ONNX model once (identical copies, pre-transposed copies,
    or a Transpose that onnxruntime would fold into a copy), and check with onnxruntime that the
    outputs are unchanged.

    \b
    Example:
      gemma-export dedupe exported/model.onnx --out deduped/
    """
    from .dedupe import dedupe as run

    with _reported(debug):
        result = run(model, out, progress=lambda msg: typer.echo(msg, err=True))
    with _reporting_written(result.out_path.parent, "deduplicated model"):
        typer.echo(f"wrote {result.out_path}")
        typer.echo(f"removed {len(result.removed)} initializer(s) ({', '.join(result.removed) or '-'}), "
                   f"{result.saved_bytes:,} bytes; rewrote {result.rewritten_matmuls} MatMul(s) as Gemm(transB=1)"
                   + ("" if result.removed or not result.rewritten_matmuls else
                      " (the file stored the table once, but onnxruntime kept a second, transposed copy for the "
                      "MatMul: now it keeps one)"))
        typer.echo(f"outputs on random inputs: max |diff| {result.max_abs_diff:.3g}")


@app.command(short_help="Time and measure an export with onnxruntime.")
def bench(
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder."),
    threads: Optional[int] = typer.Option(None, "--threads", callback=_checked_threads, help=f"onnxruntime intra-op threads (default {DEFAULT_THREADS}, the {DEFAULT_BOARD}'s cores; 1 to 4 x this machine's CPUs; given with --board, --threads wins over the board's count)."),
    prompt_tokens: str = typer.Option("16,128,512", "--prompt-tokens", help="Comma-separated prompt lengths (tokens of real text)."),
    new_tokens: int = typer.Option(128, "--new-tokens", help="Decode steps after each prompt (more than 4: the first 4 are warm-up and not timed)."),
    board: Optional[str] = typer.Option(None, "--board", help=BENCH_BOARD_HELP),
    text: Optional[Path] = typer.Option(None, "--text", parser=_path, metavar="<path>", help="Text file for prompts (default: the Python license, else numpy's)."),
    json_out: Optional[Path] = typer.Option(None, "--json", parser=_file_path, metavar="<path>", help="Also write the figures as JSON to this file ('-' = stdout)."),
    plot: Optional[Path] = typer.Option(None, "--plot", parser=_file_path, metavar="<path>", help="Write decode ms/token against context length to this PNG (needs matplotlib)."),
    reference: Optional[Path] = typer.Option(None, "--reference", parser=_path, metavar="<path>", help="Also time the board team's reference export (.mlir) under IREE, one re-decode per token (needs the iree extra)."),
    reference_weights: Optional[Path] = typer.Option(None, "--reference-weights", parser=_path, metavar="<path>", help="The reference's safetensors archive (default: beside the .mlir)."),
    prefill_chunk: Optional[int] = typer.Option(None, "--prefill-chunk", help=PREFILL_CHUNK_HELP, show_default=False),
    prepacked: Optional[bool] = typer.Option(None, "--prepacked/--no-prepacked", help=PREPACKED_HELP, show_default=False),
    huge_pages: Optional[bool] = typer.Option(None, "--huge-pages/--no-huge-pages", help="Without a pre-packed copy: move the weights onnxruntime packed on the heap onto transparent huge pages after loading (the default; Linux >= 6.1; 0.79-0.89 x the decode time on x86-64). --no-huge-pages measures without.", show_default=False),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Measure an export with onnxruntime: session creation, prefill per prompt length, decode
    ms/token (median, p90), tokens/s, Anonymous and Rss memory growth (from after loading the
    tokenizer and importing onnx and onnxruntime, whose ~100 MB and 4–11 MB are shown on lines of
    their own) after each generation and in use at its last step (the KV cache live), peak memory,
    archive size.

    \b
    Example:
      gemma-export bench --model gemma-3-270m-onnx-int8 --board sl2610 \\
          --json bench.json
    """
    from .bench import check_board_budget, check_outputs, format_result, run_bench, to_stdout, write_json, write_plot

    with _reported(debug):
        try:
            if not prompt_tokens.isascii() or "_" in prompt_tokens:  # int() also reads other scripts' digits, and 1_6
                raise ValueError
            lengths = [int(x) for x in prompt_tokens.split(",")]  # "8,,9" and "8," are refused, not read as 8,9
        except ValueError:
            raise ConfigError(f"--prompt-tokens: expected comma-separated integers, found {prompt_tokens!r}") from None
        if prepacked and huge_pages is not None:  # the copy's weights are mapped from disk, not packed on the heap
            raise typer.BadParameter("applies to weights packed on the heap, and --prepacked maps them from disk; "
                                     "give one or the other", param_hint="'--huge-pages' / '--no-huge-pages'")
        check_outputs(json_out, plot, inputs=(model, text, reference, reference_weights), report_key="decode_ms_median")
        result = run_bench(model, threads=threads, prompt_tokens=lengths, new_tokens=new_tokens, board=board,
                           text=text, reference=reference, reference_weights=reference_weights,
                           prefill_chunk=_prefill_chunk(prefill_chunk), progress=lambda msg: typer.echo(msg, err=True),
                           prepacked=prepacked, huge_pages=huge_pages is not False)
        typer.echo(format_result(result), err=to_stdout(json_out))  # with --json -, stdout holds the JSON alone
        if huge_pages is not None and result.prepacked:
            typer.echo(f"note: --{'' if huge_pages else 'no-'}huge-pages did nothing: the folder's pre-packed copy was "
                       "used (its weights are mapped from disk); --no-prepacked measures the heap", err=True)
        report = (lambda: write_json(result.to_dict(), json_out)) if json_out is not None else None
        if plot is not None:  # the JSON is written once the image is, before it is renamed into place: both or neither
            write_plot([result], plot, before_rename=report)
        elif report is not None:
            report()
        if json_out is not None:
            _wrote(json_out)
        if plot is not None:
            typer.echo(f"plot: {plot}", err=to_stdout(json_out))
        check_board_budget(result)  # after the figures are shown and saved; exits 1 (BudgetExceeded)


@app.command(short_help="Teacher-forced quality of an export on real text.")
def quality(
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder."),
    reference: str = typer.Option("transformers", "--reference", parser=_quality_reference, metavar="<transformers|fp32|path>", help="transformers (fp32 on the export's source; needs the test extra), fp32 (an fp32 export of the source, made on the fly) or an export folder."),
    text: Optional[Path] = typer.Option(None, "--text", parser=_path, metavar="<path>", help="Real text to score (default: the Python license, ~3,400 tokens)."),
    tokens: Optional[int] = typer.Option(None, "--tokens", help="Use only the first N tokens of the text (at least 2)."),
    threads: Optional[int] = typer.Option(None, "--threads", callback=_checked_threads, help=THREADS_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", parser=_file_path, metavar="<path>", help="Also write the figures as JSON to this file ('-' = stdout)."),
    prepacked: Optional[bool] = typer.Option(None, "--prepacked/--no-prepacked", help=PREPACKED_HELP, show_default=False),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Teacher-forced quality of an export on real text against a reference: top-1 agreement
    (overall and past the model's sliding_window, 512 for Gemma 3 270M), mean KL(reference || export) in nats/token, perplexity, max |dlogit|.

    The reference and the export run side by side, 128 positions at a time: on the default text
    (~3,400 tokens) the 270M peaks near 3.8 GB against transformers (up to ~4.2 GB with --reference
    fp32, while it exports that reference; ~4.5 GB for a bf16 export, held as float32), and takes
    minutes.

    \b
    Examples:
      gemma-export quality --model gemma-3-270m-onnx-int8 --reference fp32
      gemma-export quality --model gemma-3-270m-onnx-int8 \\
          --reference transformers --json q.json

    (fp32: an fp32 export of the same source, made on the fly; transformers needs the test extra.)
    """
    from .bench import check_outputs, to_stdout, write_json
    from .quality import format_report, run_quality

    with _reported(debug, writes=False):
        check_outputs(json_out, None, inputs=(model, text, None if reference in ("transformers", "fp32") else reference),
                      report_key="kl_mean")
        from .memory import peak_rss_bytes

        started = time.monotonic()
        report = run_quality(model, reference=reference, text=text, tokens=tokens, threads=threads,
                             progress=lambda msg: typer.echo(msg, err=True), prepacked=prepacked)
        typer.echo(format_report(report), err=to_stdout(json_out))  # with --json -, stdout holds the JSON alone
        # both models and their logits are held at once: the peak is far above one model's (~3.7 GB, 270M int8 + fp32)
        typer.echo(_elapsed_line(time.monotonic() - started, peak_rss_bytes()), err=True)
        _note_changed_files(model)  # its tokenizer.json tokenized the text (a tester's shuffled one: no word)
        if json_out is not None:
            write_json(report.to_dict(), json_out)
            _wrote(json_out)


def _wrote(json_out: Path) -> None:
    """Say where a --json report went (on stderr; nothing when it went to stdout, which holds it alone)."""
    from .bench import to_stdout

    if not to_stdout(json_out):
        typer.echo(f"wrote {json_out}", err=True)


class Against(str, enum.Enum):
    transformers = "transformers"


@app.command(short_help="Check an export against transformers, the reference, golden ids.")
def parity(
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder (made with --debug-outputs to locate a divergence)."),
    against: Optional[Against] = typer.Option(None, "--against", help="transformers: fp32 on the export's source weights (needs the test extra). Default when no --reference/--golden is given."),
    reference: Optional[Path] = typer.Option(None, "--reference", parser=_path, metavar="<path>", help="The board team's reference export (.mlir), run with IREE (needs the iree extra)."),
    reference_weights: Optional[Path] = typer.Option(None, "--reference-weights", parser=_path, metavar="<path>", help="The reference's safetensors archive (default: beside the .mlir)."),
    reference_logits: bool = typer.Option(False, "--reference-logits", help="Strip the reference's argmax tail and compare logits too."),
    golden: Optional[Path] = typer.Option(None, "--golden", parser=_path, metavar="<path>", help="Golden greedy ids (JSON: {prompt|prompt_ids, expected_ids} objects, or a bare list of ids expected after one prompt: that of a --prompts file holding one, else 'The capital of France is')."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", parser=_path, metavar="<path>", help="Prompts: a text file (one per line) or a JSON list of strings / id lists."),
    new_tokens: Optional[int] = typer.Option(None, "--new-tokens", metavar="<int>", help="With --against transformers: greedy tokens generated after each prompt and compared (at least 1; default 16). A golden entry generates as many as it expects."),
    threads: Optional[int] = typer.Option(None, "--threads", callback=_checked_threads, help=THREADS_HELP),
    json_out: Optional[Path] = typer.Option(None, "--json", parser=_file_path, metavar="<path>", help="Also write the report as JSON to this file ('-' = stdout)."),
    prepacked: Optional[bool] = typer.Option(None, "--prepacked/--no-prepacked", help=PREPACKED_HELP, show_default=False),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Check an export against transformers, the reference MLIR export (IREE) and golden token
    files; print per-prompt figures, the first diverging layer (with --debug-outputs exports) and a
    pass/fail verdict. Exit status: 0 pass, 1 fail, 2 bad input. Without --reference or --golden it
    compares with transformers, which needs torch and transformers (pip install -e '.[test]'); the
    reference needs the iree extra; golden files need neither.

    \b
    Examples (the first two need no extra):
      gemma-export generate --model gemma-3-270m-onnx-int8 --prompt Hi \\
          --json golden.json
      gemma-export parity --model gemma-3-270m-onnx-int8 --golden golden.json \\
          --json parity.json
      gemma-export parity --model gemma-3-270m-onnx-int8   # needs [test]
      gemma-export parity --model gemma-fp32 --reference gemma-gen.mlir \\
          --reference-weights gemma.safetensors --prompts ids.json  # [iree]
    """
    from .bench import check_outputs, to_stdout, write_json
    from .parity import format_report, run_parity

    with _reported(debug, writes=False):
        check_outputs(json_out, None, inputs=(model, reference, reference_weights, golden, prompts), report_key="checks")
        report = run_parity(model, against_transformers=against is not None or not (reference or golden),
                            reference=reference, reference_weights=reference_weights, reference_logits=reference_logits,
                            golden=golden, prompts=prompts, new_tokens=new_tokens, threads=threads,
                            progress=lambda msg: typer.echo(msg, err=True), prepacked=prepacked)
        typer.echo(format_report(report), err=to_stdout(json_out))  # with --json -, stdout holds the JSON alone
        if json_out is not None:
            write_json(report.to_dict(), json_out)
            _wrote(json_out)
    if not report.passed:
        raise typer.Exit(1)


@app.command(short_help="Write the folder the board team copies to the board.")
def bundle(
    model: Path = typer.Option(..., "--model", parser=_path, metavar="<path>", help="An export folder (verified against its manifest first); int8 or int4 for the board (fp32/bf16 weights peak above its memory; a note says so)."),
    out: Path = typer.Option(..., "--out", parser=_path, metavar="<path>", help="The bundle folder to write: a new path, an empty folder, or a previous bundle (replaced whole, with any pre-packed copy the board made in it)."),
    board: str = typer.Option(DEFAULT_BOARD, "--board", help=f"Target board ({', '.join(BOARDS)})."),
    wheel: Optional[Path] = typer.Option(None, "--wheel", parser=_path, metavar="<path>", help="A prebuilt gemma_export wheel (default: built from this source tree)."),
    debug: bool = typer.Option(False, "--debug", is_eager=True, help="Show tracebacks."),
) -> None:
    """Write the folder the board team copies to the board: the verified model, this toolkit's
    wheel, a README with the install line and the verify/prepack/generate/bench commands, and BUNDLE.json
    (sha256 of every file).

    \b
    Example:
      gemma-export bundle --model gemma-3-270m-onnx-int8 --board sl2610 \\
          --out sl2610-int8
    """
    from .bundle import write_bundle as run

    with _reported(debug):
        result = run(model, out, board=board, wheel=wheel, progress=lambda msg: typer.echo(msg, err=True))
    with _reporting_written(result.out_dir, "bundle"):
        _list_files(result.files, 40)
        typer.echo(f"wrote {result.out_dir} ({_mb(result.total_bytes)}); on the board, follow {result.out_dir}/README.md")


if __name__ == "__main__":  # `python -m gemma_export.cli`: the same entry point as the command
    from .console import main as _console_main

    _console_main()
