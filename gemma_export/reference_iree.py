"""Run the board team's reference export (StableHLO MLIR + flat 1-D safetensors archive) with IREE
on this machine's CPU, the way the board runs it: one call of the fixed-length re-decode function per
step, prompt padded with token id 0.

The reference graph ends in an in-graph argmax, so it returns one token per position
(``tensor<{S}xi32>``). :func:`strip_argmax_tail` rewrites the function to return the logits that
feed that argmax instead, so logits can be compared too.

Needs the optional ``iree`` extra (``iree-base-compiler``, ``iree-base-runtime``). Compiled modules
are cached under ``~/.cache/gemma-export/iree`` keyed by the MLIR text, the flags and the IREE
version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np

from .config import GemmaConfig
from .errors import FormatError, GemmaExportError
from .sources.mlir import Archive, MlirModule, find_archive, map_globals, parse_mlir

PAD_TOKEN_ID = 0
#: the host CPU: the reference is compiled for the machine that runs the comparison
COMPILE_FLAGS = ("--iree-llvmcpu-target-cpu=host",)

_FUNC_START = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w$.-]+)\s*\(")
_RETURN = re.compile(r"^(\s*)(?:func\.)?return\s+(%[\w#.$-]+)\s*:\s*(tensor<[^>]*>)\s*$")
_DEFINES = re.compile(r"^\s*(%[\w.$-]+)(?::\d+)?\s*=")
_VALUE = re.compile(r"%[\w#.$-]+")
_ARGMAX_INPUT = re.compile(r"(?:stablehlo\.reduce\(|call\s+@[\w$.-]+\()\s*(%[\w#.$-]+)")


def _iree():
    try:
        import iree.compiler
        import iree.runtime
    except ImportError:
        raise GemmaExportError("running the reference export needs IREE: pip install 'gemma-export[iree]' "
                               "(iree-base-compiler and iree-base-runtime)") from None
    return iree.compiler, iree.runtime


def _function_lines(lines: list[str], name: str) -> tuple[int, int]:
    """[start, end) line range of function ``@name`` (up to the next ``func.func`` or the end)."""
    start = next((i for i, line in enumerate(lines) if (m := _FUNC_START.match(line)) and m.group(1) == name), None)
    if start is None:
        raise FormatError(f"no function @{name} in the MLIR")
    end = next((i for i in range(start + 1, len(lines)) if _FUNC_START.match(lines[i])), len(lines))
    return start, end


def strip_argmax_tail(text: str, function: str, vocab_size: int) -> str:
    """Rewrite ``@function`` to return the float32 logits that feed its argmax.

    The argmax is the ``stablehlo.reduce(`` or ``call @f(`` nearest to the returned value, going back
    through the operations that compute it (breadth first), whose first operand is a
    ``tensor<...x{vocab_size}xf32>``; the function's ``return`` and result type are replaced by that
    operand and its type (the compiler then drops the dead argmax ops). Following the returned value
    keeps another reduction over a dimension of the same size (attention's, when the fixed length
    equals the vocabulary) from being taken for it.

    Raises:
        FormatError: no such function, no argmax over the vocabulary feeding the return, or no
            single ``return``.
    """
    lines = text.splitlines()
    start, end = _function_lines(lines, function)
    vocab_type = re.compile(rf"tensor<((?:\d+x)*{vocab_size})xf32>")
    returns = [i for i in range(start + 1, end) if _RETURN.match(lines[i])]
    if len(returns) != 1:
        raise FormatError(f"@{function}: expected one return of a single tensor, found {len(returns)}")
    defined = {}  # SSA value -> the line that defines it (``%5:2 = ...`` defines %5, used as %5#1)
    for line in lines[start + 1:end]:
        if (m := _DEFINES.match(line)) is not None:
            defined.setdefault(m.group(1), line)
    logits = None
    queue, seen = [_RETURN.match(lines[returns[0]]).group(2).split("#")[0]], set()
    while queue and logits is None:
        value = queue.pop(0)
        if value in seen or value not in defined:
            continue
        seen.add(value)
        line = defined[value]
        m = _ARGMAX_INPUT.search(line)
        if m and ":" in line:
            operand_types = line.rsplit(":", 1)[1]
            t = vocab_type.search(operand_types)
            if t and operand_types.lstrip().startswith(("(" + t.group(0), t.group(0))):
                logits = (m.group(1), t.group(0))
                break
        queue += [used.split("#")[0] for used in _VALUE.findall(line.split("=", 1)[1])]
    if logits is None:
        raise FormatError(f"@{function}: no argmax over a tensor<...x{vocab_size}xf32> found; cannot expose the logits")
    indent = _RETURN.match(lines[returns[0]]).group(1)
    lines[returns[0]] = f"{indent}return {logits[0]} : {logits[1]}"
    head = lines[start]
    arrow = head.rfind("->")
    brace = head.rfind("{")
    if arrow < 0 or brace < arrow:
        raise FormatError(f"@{function}: cannot read its result type in {head.strip()[:120]!r}")
    lines[start] = f"{head[:arrow]}-> {logits[1]} {head[brace:]}"
    return "\n".join(lines) + "\n"


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "gemma-export" / "iree"


def _host_cpu() -> tuple[str, str]:
    """The machine and its CPU's feature flags (``/proc/cpuinfo``; empty where there is none): what
    ``--iree-llvmcpu-target-cpu=host`` compiles for."""
    import platform

    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    flags = next((line.split(":", 1)[1].strip() for line in lines if line.split(":")[0].strip() in ("flags", "Features")), "")
    return platform.machine(), flags


def compile_reference(text: str, cache_dir: Path | None = None, source: str | Path | None = None,
                      refresh: bool = False) -> bytes:
    """Compile StableHLO MLIR text for the host CPU (llvm-cpu) to an IREE module; cached.
    ``source``: the file the text came from, named in IREE's messages in place of ``<stdin>``;
    ``refresh``: compile again and replace the cached module (one that would not load).

    Raises:
        GemmaExportError: IREE is missing or rejects the MLIR (first line of its message).
    """
    compiler, _ = _iree()
    from importlib.metadata import PackageNotFoundError, version

    try:
        iree_version = version("iree-base-compiler")
    except PackageNotFoundError:
        iree_version = "unknown"
    # the flags say "host": a module built on another CPU (a cache shared between machines) may not run here
    key = hashlib.sha256("\n".join([text, iree_version, *COMPILE_FLAGS, *_host_cpu()]).encode()).hexdigest()[:32]
    folder = cache_dir or _cache_dir()
    cached = folder / f"{key}.vmfb"
    if cached.is_file() and not refresh:
        return cached.read_bytes()
    try:
        vmfb = compiler.compile_str(text, target_backends=["llvm-cpu"], input_type="stablehlo", extra_args=list(COMPILE_FLAGS))
    except Exception as exc:
        first = next((line for line in str(exc).splitlines() if "error" in line), str(exc).splitlines()[0] if str(exc) else "")
        if source is not None:  # IREE read the text from its stdin; its line numbers are the file's
            first = first.replace("<stdin>", str(source))
        raise GemmaExportError(f"IREE cannot compile the reference MLIR: {first.strip()[:300]}") from None
    partial = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, delete=False, suffix=".partial") as f:
            partial = f.name
            f.write(vmfb)
            f.flush()
            os.fsync(f.fileno())  # on disk before it is named: a power cut leaves no empty module
        os.replace(partial, cached)
    except OSError:  # a cache that cannot be written only costs a recompile; leave no partial file
        if partial is not None:
            with contextlib.suppress(OSError):
                os.unlink(partial)
    return vmfb


def compile_in_child(mlir_path: str | Path) -> None:
    """Compile a reference export's MLIR into the cache of :func:`compile_reference` in a child
    process, so that a command finds an MLIR IREE refuses before its own slow work, and the
    compiler's memory (hundreds of MB for the 270M, freed but kept by the allocator) is never this
    process's. A later :func:`load_reference` of the same file reads the cached module (where the
    cache cannot be written it compiles again).

    Raises:
        GemmaExportError: IREE is missing or refuses the MLIR (its message, naming the file and line).
    """
    code = "import sys; from gemma_export.reference_iree import _compile_file; _compile_file(sys.argv[1])"
    # run from the folder that holds this package, so the child imports this very code (not a
    # gemma_export folder in the caller's working directory); an interrupt kills the child (run())
    package_parent = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code, str(Path(mlir_path).resolve())], capture_output=True,
                          text=True, errors="replace", cwd=package_parent)
    if done.returncode:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        if done.returncode < 0:  # a signal, e.g. SIGKILL from the kernel's out-of-memory killer
            raise GemmaExportError(f"{mlir_path}: IREE's compiler (a child process) was killed by signal "
                                   f"{-done.returncode}; out of memory?")
        raise GemmaExportError(lines[-1] if lines else f"{mlir_path}: IREE's compiler exited with {done.returncode}")


def _compile_file(path: str) -> None:
    """The child process of :func:`compile_in_child`: its error, naming the file, on the last line of
    stderr; exit 2."""
    try:
        compile_reference(Path(path).read_text(encoding="utf-8", errors="replace"), source=path)
    except GemmaExportError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # IREE's own failures (e.g. MemoryError), named with the file
        print(f"{path}: IREE cannot compile it: {type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)
        sys.exit(2)


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, at most 200 characters ("" when it has none)."""
    return str(exc).splitlines()[0][:200] if str(exc) else ""


@dataclasses.dataclass
class ReferenceModel:
    """A compiled reference export, ready to run.

    Attributes:
        mlir_path, archive_path: the files.
        function: the re-decode function (``@gemma``: ``tensor<1x{S}xi32> -> tensor<{S}xi32>``).
        sequence_length: its fixed length ``S``.
        vocab_size: rows of the embedding table (the first global).
        returns_logits: True after :func:`strip_argmax_tail` (outputs ``[S, vocab]`` float32).
    """

    mlir_path: Path
    archive_path: Path
    function: str
    sequence_length: int
    vocab_size: int
    returns_logits: bool
    _call: object = dataclasses.field(repr=False, default=None)

    def run(self, token_ids: Sequence[int]) -> np.ndarray:
        """One call on ``token_ids`` padded with 0 to the fixed length.

        Returns:
            int32 ``[S]`` (argmax token per position), or float32 ``[S, vocab]`` with ``returns_logits``.

        Raises:
            GemmaExportError: more tokens than the fixed length, or an id outside the vocabulary.
        """
        ids = list(token_ids)
        self._check_length(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise GemmaExportError(f"{self.mlir_path}: token id {bad[0]} is outside the vocabulary ({self.vocab_size})")
        tokens = np.full((1, self.sequence_length), PAD_TOKEN_ID, np.int32)
        tokens[0, :len(ids)] = ids
        out = np.asarray(self._call(tokens))
        if self.returns_logits:
            return out.reshape(self.sequence_length, self.vocab_size).astype(np.float32)
        return out.reshape(self.sequence_length).astype(np.int64)

    def _check_length(self, ids: list[int]) -> None:
        if not 0 < len(ids) <= self.sequence_length:
            raise GemmaExportError(f"{self.mlir_path}: @{self.function} takes 1 to {self.sequence_length} tokens, "
                                   f"found {len(ids)}")

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] = ()) -> list[int]:
        """The board's re-decode loop: run the whole graph once per new token and read position
        ``len(ids) - 1``; stops at a stop id (included), at ``max_new_tokens`` or at the fixed length
        (a prompt of exactly the fixed length gets none).

        Raises:
            GemmaExportError: an empty prompt or one longer than the fixed length (as :meth:`run`).
        """
        ids, new = list(prompt_ids), []
        self._check_length(ids)
        while len(new) < max_new_tokens and len(ids) < self.sequence_length:
            out = self.run(ids)
            token = int(np.argmax(out[len(ids) - 1])) if self.returns_logits else int(out[len(ids) - 1])
            ids.append(token)
            new.append(token)
            if token in stop_ids:
                break
        return new


def check_reference(mlir_path: str | Path, archive_path: str | Path | None = None):
    """Read a reference export without compiling it: its MLIR, its archive against the MLIR's
    globals, and its re-decode function. Cheap next to :func:`load_reference`'s compilation, so a
    command can refuse bad reference input before slow work of its own.

    Returns:
        ``(module, archive, function)``: the parsed MLIR, the bound archive, the function
        ``tensor<1xSxi32> -> tensor<Sxi32>``.

    Raises:
        SourceNotFoundError, FormatError: missing files, an archive that contradicts the MLIR, no
            public re-decode function or more than one.
    """
    mlir_path = Path(mlir_path)
    module = parse_mlir(mlir_path)  # the files first: a missing file is named before a missing IREE
    archive = Archive(module, Path(archive_path) if archive_path else find_archive(mlir_path))
    # a private function cannot be called from outside the module (IREE exports only the public ones)
    candidates = [f for f in module.functions
                  if f.public and len(f.arguments) == 1 and re.fullmatch(r"1x(\d+)xi32", f.arguments[0])
                  and len(f.results) == 1 and f.results[0] == f"{f.arguments[0].split('x')[1]}xi32"]
    if not candidates:
        found = ", ".join(("private " if not f.public else "") + "@" + f.name for f in module.functions)
        raise FormatError(f"{mlir_path}: no public re-decode function tensor<1xSxi32> -> tensor<Sxi32> "
                          f"(found {found or 'no functions'})")
    if len(candidates) > 1:
        raise FormatError(f"{mlir_path}: {len(candidates)} public re-decode functions tensor<1xSxi32> -> "
                          f"tensor<Sxi32> ({', '.join(f'@{f.name} (line {f.line})' for f in candidates)}); expected "
                          "one, the reference's (e.g. @gemma): cannot tell which the board runs")
    return module, archive, candidates[0]


class ReferenceInfo(NamedTuple):
    """What a reference export's files give before it is compiled (:func:`check_reference_options`)."""

    #: rows of its embedding table (the first weight in trace order)
    vocab_size: int
    #: the re-decode function's fixed length ``S``
    sequence_length: int
    #: the Gemma 3 configuration its globals' shapes give; None when the reader cannot map them
    config: GemmaConfig | None


def reference_config(module: MlirModule) -> GemmaConfig | None:
    """The configuration :func:`~gemma_export.sources.mlir.map_globals` reads from the globals'
    shapes, or None when it cannot map them to Gemma 3 weights (IREE may still run the program)."""
    try:
        return map_globals(module).config
    except GemmaExportError:
        return None


def _reference_info(module: MlirModule, function) -> ReferenceInfo:
    """The :class:`ReferenceInfo` of a checked reference (:func:`check_reference`'s module and
    re-decode function): the table's rows from the mapped config, else the first declared global's."""
    config = reference_config(module)
    vocab = config.vocab_size if config is not None else module.globals[0].shape[0]
    return ReferenceInfo(vocab, int(function.arguments[0].split("x")[1]), config)


def check_reference_options(reference: str | Path, reference_weights: str | Path | None) -> ReferenceInfo:
    """What ``--reference`` and ``--reference-weights`` name, checked before a command's slow work:
    both files exist, :func:`check_reference` reads them, and IREE is installed.

    Returns:
        A :class:`ReferenceInfo`: the table's rows, the fixed length, the configuration.

    Raises:
        SourceNotFoundError, FormatError: as :func:`check_reference`, naming the option's file.
        GemmaExportError: IREE (the ``iree`` extra) is not installed.
    """
    from .text_files import require_file

    require_file(reference, "reference MLIR file (--reference)")
    if reference_weights is not None:
        require_file(reference_weights, "reference archive (--reference-weights)")
    module, _, function = check_reference(reference, reference_weights)
    _iree()
    return _reference_info(module, function)


def load_reference(mlir_path: str | Path, archive_path: str | Path | None = None, *, logits: bool = False,
                   cache_dir: Path | None = None) -> ReferenceModel:
    """Validate a reference export, compile it with IREE for this CPU and bind its archive.

    Args:
        mlir_path: the ``.mlir`` (e.g. ``gemma-gen.mlir``).
        archive_path: its safetensors archive (default: found beside the MLIR).
        logits: strip the argmax tail and return logits instead of tokens.

    Raises:
        SourceNotFoundError, FormatError: missing files, an archive that contradicts the MLIR, or no
            re-decode function (``tensor<1xSxi32> -> tensor<Sxi32>``).
        GemmaExportError: IREE missing or failing.
    """
    mlir_path = Path(mlir_path)
    module, archive, function = check_reference(mlir_path, archive_path)
    _, runtime = _iree()
    vocab, length, _ = _reference_info(module, function)
    text = mlir_path.read_text(encoding="utf-8", errors="replace")
    if logits:
        try:
            text = strip_argmax_tail(text, function.name, vocab)
        except FormatError as exc:
            raise FormatError(f"{mlir_path}: {exc}") from None
    vmfb = compile_reference(text, cache_dir, mlir_path)
    config = runtime.Config("local-task")
    try:
        main = runtime.VmModule.copy_buffer(config.vm_instance, vmfb)
    except (ValueError, RuntimeError):  # a damaged cached module (a cut write, a full disk): compiled again
        vmfb = compile_reference(text, cache_dir, mlir_path, refresh=True)
        try:
            main = runtime.VmModule.copy_buffer(config.vm_instance, vmfb)
        except (ValueError, RuntimeError) as exc:
            raise GemmaExportError(f"{mlir_path}: IREE compiled it, but cannot load the module it made: "
                                   f"{_first_line(exc) or type(exc).__name__}") from None
    index = runtime.ParameterIndex()
    index.load(str(archive.path))
    parameters = runtime.create_io_parameters_module(config.vm_instance, index.create_provider(scope=module.globals[0].scope))
    hal = runtime.create_hal_module(config.vm_instance, config.device)
    bound = runtime.load_vm_modules(parameters, hal, main, config=config)[-1]
    return ReferenceModel(mlir_path, archive.path, function.name, length, vocab, logits, bound[function.name])
