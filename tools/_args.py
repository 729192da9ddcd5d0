"""Argument checks shared by the scripts in tools/: bad input ends in argparse's usage line and one
``error:`` line with exit status 2, before any slow work starts; errors the toolkit raises later
(``GemmaExportError``) and file-system errors are one ``error:`` line with exit status 2 too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable


def _path(value: str) -> Path:
    if not value.strip():
        raise argparse.ArgumentTypeError("empty path")
    return Path(value)


def existing_dir(value: str) -> Path:
    """A folder that exists."""
    path = _path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: {'is a file, expected a folder' if path.exists() else 'no such folder'}")
    return path


def existing_file(value: str) -> Path:
    """A file that exists."""
    path = _path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path}: {'is a folder, expected a file' if path.is_dir() else 'no such file'}")
    return path


def new_file(value: str) -> Path:
    """A file to write: not a folder, in a folder that exists."""
    path = _path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: is a folder, expected a file name")
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError):  # a loop of symbolic links (RuntimeError before Python 3.13)
        raise argparse.ArgumentTypeError(f"{path}: a loop of symbolic links, expected a file name") from None
    if not resolved.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: its folder {path.parent} does not exist")
    return path


def our_export(value: str) -> Path:
    """An export folder of this toolkit: it holds ``model.onnx`` and our ``manifest.json``, and its
    ``model.onnx`` is the graph the manifest records (:func:`graph_changed`)."""
    path = existing_dir(value)
    if not (path / "model.onnx").is_file() or not (path / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{path}: not an export of gemma-export (expected model.onnx and manifest.json "
                                         "in it)")
    reason = graph_changed(path)
    if reason is not None:
        raise argparse.ArgumentTypeError(reason)
    return path


def graph_changed(folder: Path) -> str | None:
    """Why ``folder/model.onnx`` is not the graph its manifest records (size and sha256), or None.

    The graph is small (under a megabyte for the 270M), so its hash costs nothing, and a graph
    copied from another export of the same model loads and runs: it reads its own layout out of
    this folder's data file, and a script scored that without a word. The data file is checked by
    size when the runtime loads it; ``gemma-export verify`` compares every byte. A manifest
    without a ``files`` listing has nothing to compare when another tool wrote it; one of
    gemma-export without it is damaged (``gemma_export.staging.nothing_listed``).
    """
    from gemma_export.errors import GemmaExportError
    from gemma_export.manifest import read_manifest
    from gemma_export.onnx_files import MANIFEST_FILE, MODEL_FILE
    from gemma_export.staging import check_listed_file, listed_files, nothing_listed

    try:
        manifest = read_manifest(folder)
        if nothing_listed(manifest):
            return None
        entry = listed_files(manifest.get("files"), folder / MANIFEST_FILE, nested=False).get(MODEL_FILE)
        if entry is not None:
            check_listed_file(folder / MODEL_FILE, *entry, "the manifest", "an export folder")
    except GemmaExportError as exc:
        return f"{exc} (the folder changed after the export: export it again; gemma-export verify checks every file)"
    return None


def genai_folder(value: str) -> Path:
    """A folder onnxruntime-genai's model builder wrote: ``genai_config.json`` and no manifest of ours."""
    path = existing_dir(value)
    if (path / "manifest.json").is_file():
        raise argparse.ArgumentTypeError(f"{path}: an export of gemma-export (it has our manifest.json), not a folder "
                                         "onnxruntime-genai's builder wrote")
    if not (path / "genai_config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path}: no genai_config.json; expected a folder onnxruntime-genai's builder "
                                         "wrote (tools/genai_anchor.py)")
    return path


def gguf_file(value: str) -> Path:
    """A file that starts with the GGUF magic bytes."""
    path = existing_file(value)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise argparse.ArgumentTypeError(f"{path}: not a GGUF file (first bytes {magic!r}, expected b'GGUF')")
    return path


def genai_output(value: str) -> Path:
    """A folder for onnxruntime-genai's builder to write: a new path, an empty folder, or an earlier
    output of it (:func:`genai_folder`), never an export of ours or a folder of other files."""
    path = new_dir(value)
    if path.is_dir() and any(path.iterdir()):
        genai_folder(value)
    return path


def check_exports_fit(models: dict[str, Path], ids: list[int], positions: int,
                      shorten: str = "give shorter --contexts, --new-tokens or --prefill") -> int | None:
    """Refuse, before any timing or scoring, exports that cannot run this comparison: a graph or data
    file whose size differs from its ``manifest.json`` (``gemma_export.manifest.check_listed_files``;
    a data file cut short was found only after llama.cpp's runs), an id of the text outside an
    export's vocabulary, more positions than its ``max_position_embeddings``, or exports of different
    vocabularies (figures from each ``manifest.json``).

    Args:
        shorten: the advice when the run needs more positions than an export has, naming the
            script's options that set its length.

    Returns:
        The exports' common vocabulary size (None when no manifest gives one).

    Raises:
        GemmaExportError: naming the export folder, the figure and what the run needs (FormatError, a
            subclass, for a file whose size differs from the manifest).
    """
    from gemma_export.errors import GemmaExportError
    from gemma_export.manifest import check_listed_files, manifest_figure, read_manifest

    vocabs = {}
    for name, folder in models.items():
        check_listed_files(read_manifest(Path(folder)), Path(folder))
        vocab, limit = manifest_figure(folder, "vocab_size"), manifest_figure(folder, "max_position_embeddings")
        if vocab is not None and ids and max(ids) >= vocab:
            raise GemmaExportError(f"{folder}: its vocabulary has {vocab:,} ids, and the text's ids (from the first "
                                   f"export's tokenizer) reach {max(ids):,}; compare exports of one model")
        if limit is not None and positions > limit:
            raise GemmaExportError(f"{folder}: max_position_embeddings is {limit:,}, and this run needs {positions:,} "
                                   f"positions; {shorten}")
        if vocab is not None:
            vocabs[name] = vocab
    if len(set(vocabs.values())) > 1:
        found = ", ".join(f"{name} {vocab:,}" for name, vocab in vocabs.items())
        raise GemmaExportError(f"--models have different vocabularies ({found}); compare exports of one model")
    return next(iter(vocabs.values()), None)


def check_gguf_model(path: Path, vocab: int | None) -> None:
    """Refuse, before any slow work, a GGUF that llama.cpp would fail on or that is another model:
    read as the toolkit reads a GGUF source (:func:`~gemma_export.sources.gguf.read_gguf`, lazily:
    its header and data layout, architecture ``gemma3``, metadata and tensor shapes), then its
    vocabulary against ``vocab``.

    Raises:
        FormatError, ConfigError: naming the file and what was found.
    """
    from gemma_export.errors import FormatError
    from gemma_export.sources.gguf import read_gguf

    rows = read_gguf(path, tokenizer=False).config.vocab_size  # the rows of token_embd.weight
    if vocab is not None and rows != vocab:
        raise FormatError(f"{path}: token_embd.weight has {rows:,} rows; the exports' vocabulary has {vocab:,}")


def reference_mlir(value: str) -> Path:
    """A reference export's ``.mlir`` with its ``.safetensors`` archive beside it."""
    path = existing_file(value)
    if path.suffix != ".mlir":
        raise argparse.ArgumentTypeError(f"{path}: expected a reference export's .mlir file, found {path.suffix or 'no'} "
                                         "suffix")
    if not path.with_suffix(".safetensors").is_file():
        raise argparse.ArgumentTypeError(f"{path}: its archive {path.with_suffix('.safetensors').name} is not beside it")
    return path


def writable_file(value: str, outside_outputs: bool = True) -> Path:
    """A file to write (:func:`new_file`) in a folder that accepts new files, and not inside a folder
    gemma-export wrote (:func:`_outside_outputs`; ``outside_outputs=False`` for a script that checks
    that itself, naming the folder's role), checked before any work."""
    from gemma_export.staging import entry_refused

    path = new_file(value)
    if outside_outputs:
        _outside_outputs(path)
    reason = entry_refused(path.resolve().parent)
    if reason is not None:
        raise argparse.ArgumentTypeError(f"{path}: cannot write in {path.parent}: {reason}")
    return path


def _outside_outputs(path: Path) -> None:
    """Refuse ``path`` when it is, or lies inside, a folder gemma-export wrote (an export, a board
    folder): the file would be one its manifest does not list, and ``verify`` and ``bundle`` would
    refuse the folder afterwards (``gemma_export.staging.enclosing_output``)."""
    from gemma_export.errors import GemmaExportError
    from gemma_export.staging import enclosing_output

    try:
        enclosing = enclosing_output(path / "_") if path.is_dir() else enclosing_output(path)
    except GemmaExportError as exc:  # a loop of symbolic links
        raise argparse.ArgumentTypeError(str(exc)) from None
    if enclosing is not None:
        raise argparse.ArgumentTypeError(f"{path}: inside {enclosing}, an output of gemma-export whose manifest would "
                                         "no longer list every file in it; write elsewhere")


def plot_file(value: str) -> Path:
    """A ``--plot`` file (:func:`writable_file`) named ``.png``, as ``gemma-export bench --plot``
    takes it (another suffix failed in matplotlib after the whole run, and none wrote ``NAME.png``
    under a name the run did not print), with matplotlib importable."""
    path = writable_file(value)
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"{path}: expected a .png file name, found {path.suffix or 'no'} suffix")
    kept_report(path, "--plot")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise argparse.ArgumentTypeError("needs matplotlib (pip install matplotlib)")
    return path


#: steps a decode timing drops before its median (the tools' --new-tokens / --steps help says so)
DROPPED_STEPS = 3


def few_steps_note(option: str, steps: int) -> str:
    """A note for a median of fewer timed decode steps than ``gemma-export bench`` calls steady
    (``gemma_export.bench.FEW_TIMED_STEPS``), naming the option that gives more; "" otherwise. A
    helper's median of 1 step was printed as any other."""
    from gemma_export.bench import FEW_TIMED_STEPS

    timed = steps - DROPPED_STEPS
    if timed >= FEW_TIMED_STEPS:
        return ""
    return (f"note: only {timed} timed step{'' if timed == 1 else 's'} per measurement ({option} "
            f"{DROPPED_STEPS + FEW_TIMED_STEPS} or more for steadier figures)")


def busy_note(labels: list[str], spoiled: str) -> str:
    """The note naming what was timed beside ``gemma_export.bench.BUSY_OTHER_CPUS`` or more of other
    processes' work (``labels``; "" for none), as ``gemma-export bench`` warns; ``spoiled`` says
    which figures that leaves in doubt (``"those times, and the ratios built on them, are"``)."""
    from gemma_export.bench import BUSY_OTHER_CPUS

    if not labels:
        return ""
    return (f"note: other processes used {BUSY_OTHER_CPUS} CPUs or more while {', '.join(labels)} "
            f"{'was' if len(labels) == 1 else 'were'} timed: {spoiled} not the systems' own; run again on an idle machine")


def kept_report(path: Path, option: str, report_key: str | None = None) -> None:
    """Refuse an existing file at ``path`` that an earlier run did not write (not a PNG for
    ``--plot``; not JSON, or without ``report_key``, for a report), as ``gemma-export bench`` refuses
    it (``gemma_export.bench.kept_file``): a text file named ``notes.png`` was replaced by the plot.

    Raises:
        argparse.ArgumentTypeError: naming the file and why it is kept.
    """
    from gemma_export.bench import kept_file

    if path.is_file() and (why := kept_file(path, option, report_key)) is not None:
        raise argparse.ArgumentTypeError(f"{path}: exists and {why}; refusing to overwrite it; write it elsewhere")


def new_dir(value: str) -> Path:
    """A folder to write into: a new path or an existing folder, not a file."""
    path = _path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: is a file, expected a folder")
    return path


def make_folders(path: Path) -> list[Path]:
    """``path.mkdir(parents=True, exist_ok=True)``, returning the folders it created, outermost first,
    for :func:`remove_folders` to take back after an interrupt or a failure (only the last level
    was removed before, and a Ctrl-C left ``a/`` and ``a/b/`` of ``--out a/b/c`` behind)."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def remove_folders(made: list[Path]) -> None:
    """Remove the folders :func:`make_folders` created, innermost first, each only if it is empty."""
    import contextlib

    for folder in reversed(made):
        with contextlib.suppress(OSError):
            folder.rmdir()


def _number(kind: type, what: str, lo, hi) -> Callable[[str], int | float]:
    def parse(value: str):
        try:
            number = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, found {value!r}") from None
        if not lo <= number <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo:,} to {hi:,}, found {number}")
        return number
    parse.bounds = (lo, hi)  # for --help (add_ranges)
    return parse


def int_range(lo: int, hi: int) -> Callable[[str], int]:
    """An integer from ``lo`` to ``hi``."""
    return _number(int, "an integer", lo, hi)


def thread_count(value: str) -> int:
    """A ``--threads`` value: 1 to 4 × this machine's CPUs, the limit the toolkit's runtime applies
    (``gemma_export.runtime.check_threads``), checked here before any export or measurement starts."""
    return int_range(*thread_count.bounds)(value)


thread_count.bounds = (1, 4 * (os.cpu_count() or 1))  # for --help (add_ranges)


def add_ranges(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Put each numeric option's accepted range into its ``--help`` line, from the bounds of its
    type (:func:`int_range`, :func:`float_range`, :func:`int_list`, :func:`thread_count`): "(default
    64)" becomes "(4 to 4,096; default 64)", so the range is not first seen in an error. Subcommands'
    parsers too. Returns ``parser``."""
    for action in parser._actions:
        bounds = getattr(action.type, "bounds", None)
        if bounds is not None and action.help:
            span = f"{'each ' if getattr(action.type, 'each', False) else ''}{bounds[0]:,} to {bounds[1]:,}"
            action.help = (action.help.replace("(default", f"({span}; default", 1) if "(default" in action.help
                           else f"{action.help} ({span})")
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict) and isinstance(action.choices[sub], argparse.ArgumentParser):
                add_ranges(action.choices[sub])
    return parser


def float_range(lo: float, hi: float) -> Callable[[str], float]:
    """A number from ``lo`` to ``hi``."""
    return _number(float, "a number", lo, hi)


def int_list(lo: int, hi: int) -> Callable[[str], list[int]]:
    """Comma-separated integers, each from ``lo`` to ``hi`` (e.g. ``16,128,512``)."""
    one = int_range(lo, hi)

    def parse(value: str) -> list[int]:
        parts = [p.strip() for p in value.split(",")]
        if not value.strip() or not all(parts):
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, found {value!r}")
        numbers = [one(p) for p in parts]
        twice = sorted({n for n in numbers if numbers.count(n) > 1})
        if twice:  # each would be timed twice, the second figure replacing the first
            raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} given twice in {value!r}")
        return numbers
    parse.bounds, parse.each = (lo, hi), True  # for --help (add_ranges)
    return parse


def named(kind: Callable[[str], Path] | tuple[Callable[[str], Path], ...], count: int = 1) -> Callable[[str], tuple]:
    """``NAME=PATH`` (or ``NAME=PATH,PATH`` with ``count`` 2): a label and ``count`` paths of ``kind``
    (one check for every path, or one per path)."""
    kinds = kind if isinstance(kind, tuple) else (kind,) * count

    def parse(value: str) -> tuple:
        name, sep, rest = value.partition("=")
        paths = rest.split(",")
        if not sep or not name.strip() or len(paths) != count:
            form = "NAME=" + ",".join(["PATH"] * count)
            raise argparse.ArgumentTypeError(f"expected {form}, found {value!r}")
        return (name, *(check(p) for check, p in zip(kinds, paths)))
    return parse


def unique_names(parser: argparse.ArgumentParser, option: str, items: list[tuple]) -> dict:
    """``{name: paths}`` of ``NAME=…`` values; a name given twice is an error (the first would be dropped)."""
    seen: dict = {}
    for name, *paths in items:
        if name in seen:
            parser.error(f"{option}: the name {name!r} is given twice")
        seen[name] = paths[0] if len(paths) == 1 else tuple(paths)
    return seen


def run(main: Callable[[], int | None]) -> None:
    """Run a script's ``main`` and exit with its status; the toolkit's errors, file-system errors and a
    missing optional module become one ``error:`` line (status 2), Ctrl-C status 130 (SIGTERM 143 and
    SIGHUP 129 where the script raises them: ``gemma_export.console.interrupts_raised``)."""
    from gemma_export.errors import GemmaExportError, os_error_line

    try:
        status = main()
    except GemmaExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        print(f"error: {os_error_line(exc)}", file=sys.stderr)
        sys.exit(2)
    except ImportError as exc:  # an optional comparison tool (llama-cpp-python, onnxruntime-genai, jax) missing
        missing = getattr(exc, "name", None) or str(exc)
        print(f"error: this script needs the Python module {missing!r}, which cannot be imported here ({exc}); "
              f"see the script's --help for how to install it", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as exc:  # SIGTERM and SIGHUP as well, where the script raises them (interrupts_raised)
        from gemma_export.console import interrupt_exit_status

        print("error: interrupted", file=sys.stderr)
        sys.exit(interrupt_exit_status(exc))
    sys.exit(status or 0)


def writable_dir(value: str, outside_outputs: bool = True) -> Path:
    """A folder to write files into (:func:`new_dir`), checked before any work: an existing folder
    that takes new files, or a new path whose nearest existing parent is a folder that does
    (:func:`~gemma_export.staging.entry_refused`: /proc, a read-only mount, permissions); not a
    folder gemma-export wrote, nor one inside it (:func:`_outside_outputs`; ``outside_outputs=False``
    for a script that checks that itself, naming what it writes there).

    Raises:
        argparse.ArgumentTypeError: naming the path, what was expected and what was found.
    """
    from gemma_export.staging import entry_refused

    path = new_dir(value)
    if outside_outputs:
        _outside_outputs(path)
    for existing in (path.absolute(), *path.absolute().parents):  # up to the nearest that exists ("/" at the latest)
        if existing.exists():
            break
        if existing.is_symlink():  # a link to nothing: mkdir would fail on it after the work
            raise argparse.ArgumentTypeError(f"{path}: expected a folder that can be created; {existing} is a link to "
                                             f"{os.readlink(existing)}, which does not exist")
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: expected a folder that can be created, but {existing} is a file")
    reason = entry_refused(existing)
    if reason is not None:
        if existing == path.absolute():
            raise argparse.ArgumentTypeError(f"{path}: expected a folder that takes new files; it refuses them "
                                             f"({reason})")
        raise argparse.ArgumentTypeError(f"{path}: expected a folder that can be created; {existing} refuses new "
                                         f"entries ({reason})")
    return path
