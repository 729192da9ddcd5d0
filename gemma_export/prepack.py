"""A machine-specific copy of an export whose pre-packed weights onnxruntime maps from disk.

When onnxruntime creates a session it re-lays the weights of ``MatMulNBits`` (and of ``MatMul`` /
``Gemm`` with constant weights) into its kernels' blocked layout. Those packed buffers are heap
memory: for the int8 export about 1.13 × the archive of *Anonymous* memory, which the kernel
cannot reclaim. onnxruntime can instead write them into the external data file of its optimized
model (session option ``session.save_external_prepacked_constant_initializers``, documented in
``onnxruntime_session_options_config_keys.h``) and map them from there when that model is loaded.
They then count as clean file pages (``Rss``), not ``Anonymous``.

The packed layout depends on the onnxruntime version and the CPU's instruction set (AVX-512 VNNI,
AVX2, NEON dot product, …), so the copy is made on the machine that runs it, kept in
``<export>/prepacked/``, and used only while ``prepacked.json`` names this machine, this
onnxruntime and the export's current files (:func:`status`). :func:`prepack` checks before it
keeps the copy that its logits equal the export's, bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .errors import (FormatError, GemmaExportError, OutputError, SourceNotFoundError, VerificationError,
                     check_arguments)
from .onnx_files import DATA_FILE, MANIFEST_FILE, MODEL_FILE, PREPACKED_DIR, PREPACKED_MANIFEST
from .manifest import read_manifest
from .text_files import FileRefused, non_regular, read_bounded
from .staging import (OLD_TAG, STAGING_TAG, check_free_space, entry_refused, file_sha256, flocked, hidden_prefix,
                      interrupts_held, no_free_inodes, remove_tree, staged_folder)
FORMAT = "gemma-export-prepacked/1"
#: token ids of the bit-exactness check (batch 1, empty cache): <bos> and five ordinary ids of
#: Gemma's vocabulary (what they spell does not matter; a smaller vocabulary keeps those it has). A
#: short prompt is enough to run every packed weight once.
CHECK_TOKENS = (2, 651, 6037, 529, 7001, 563)


def _cpu_flags() -> str:
    """The CPU's feature list from ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``), sorted."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return " ".join(sorted(value.split()))
    return platform.processor()


def machine_key() -> dict:
    """What the packed layout depends on: onnxruntime's version, the architecture and the CPU's
    feature flags (sha256 of the sorted list)."""
    import onnxruntime as ort

    return {"onnxruntime": ort.__version__, "machine": platform.machine(), "system": platform.system(),
            "cpu_flags_sha256": hashlib.sha256(_cpu_flags().encode()).hexdigest()}


def source_identity(model_dir: Path) -> dict:
    """The export's graph and data files as the copy was made from them: size, modification time
    and, from the export's ``manifest.json``, sha256."""
    try:
        listed = read_manifest(model_dir).get("files", {})
    except FormatError:
        listed = {}
    if not isinstance(listed, dict):
        listed = {}
    identity = {}
    for path in sorted(model_dir.iterdir()):
        if path.name.startswith(MODEL_FILE) and path.is_file():
            stat = path.stat()
            entry = listed.get(path.name)
            digest = entry.get("sha256") if isinstance(entry, dict) else None
            identity[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    return identity


#: the hidden folders a prepack leaves in the export while it works: :func:`staged_folder`'s staging
#: folder and the old copy it moves aside (named by :func:`hidden_prefix`), and a copy :func:`remove` deletes
LEFTOVER_PREFIXES = tuple(hidden_prefix(Path(PREPACKED_DIR)) + tag for tag in (STAGING_TAG, OLD_TAG, "removing-"))


def leftovers(model_dir: str | Path) -> list[Path]:
    """Hidden folders an interrupted or killed ``prepack`` left in ``model_dir`` (its staging folder,
    the copy it was replacing, a copy being removed). ``prepack`` and ``prepack --remove`` delete them.

    Raises:
        ConfigError: ``model_dir`` is no path."""
    check_arguments("leftovers", model_dir=(model_dir, "path"))
    folder = Path(model_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.name.startswith(LEFTOVER_PREFIXES) and p.is_dir() and not p.is_symlink())


def check_no_leftovers(model_dir: Path) -> None:
    """Raises when ``model_dir`` holds :func:`leftovers` of a ``prepack``: the staging folder of one
    running now (named as such), or what an interrupted one left.

    Raises:
        VerificationError: naming the folder or the leftover, and what to do.
    """
    stale = leftovers(model_dir)
    running = busy(model_dir) if stale else False
    if running:  # a running prepack's staging folder, not an interrupted one's
        raise VerificationError(f"{model_dir}: a gemma-export prepack is working on this folder (writing "
                                f"{stale[0].name}); try again when it has finished")
    if stale and running is None:
        raise VerificationError(f"{stale[0]}: {_UNDECIDABLE.format(folder=model_dir)}")
    if stale:
        raise VerificationError(f"{stale[0]}: left by an earlier gemma-export prepack (interrupted, or unable to "
                                f"delete it); run gemma-export prepack --model {model_dir} again, or with --remove, "
                                "to clean it up")


#: how a copy this user cannot read (a stat or read refused, e.g. EACCES) is described
UNREADABLE = "cannot be read"


def _ownership(folder: Path) -> tuple[str, dict | None]:
    """``(problem, record)``: problem is "" when ``folder`` (``<export>/prepacked``) is absent or a
    copy this module wrote (a real folder holding our ``prepacked.json`` and nothing but the copy's
    files), else what is wrong; record is the parsed ``prepacked.json`` of such a copy."""
    if not folder.exists() and not folder.is_symlink():
        return "", None
    if folder.is_symlink() or not folder.is_dir():
        return f"is {'a link' if folder.is_symlink() else 'not a folder'}", None
    try:  # a folder another user made without read or search rights for this one (EACCES on every stat)
        if (what := non_regular(folder / PREPACKED_MANIFEST)) is not None:  # a FIFO would block the read
            return f"has a {PREPACKED_MANIFEST} that is {what}", None
        if not (folder / PREPACKED_MANIFEST).is_file():
            return f"has no {PREPACKED_MANIFEST}", None
        try:
            record = json.loads(read_bounded(folder / PREPACKED_MANIFEST, "a pre-packed copy's record").decode("utf-8"))
        except FileRefused as exc:  # larger than any record
            return f"has a {PREPACKED_MANIFEST} that cannot be read ({exc.reason})", None
        except (ValueError, UnicodeDecodeError, RecursionError):
            return f"has a {PREPACKED_MANIFEST} that cannot be read (not UTF-8 JSON)", None
        if not (isinstance(record, dict) and record.get("format") == FORMAT):
            return f"has a {PREPACKED_MANIFEST} without \"format\": \"{FORMAT}\"", None
        foreign = sorted(p.name for p in folder.iterdir()
                         if p.name not in (MODEL_FILE, DATA_FILE, PREPACKED_MANIFEST) or p.is_symlink() or not p.is_file())
    except OSError as exc:
        return f"{UNREADABLE} ({exc.strerror or exc})", None
    return (f"holds files gemma-export did not write ({', '.join(foreign)})", None) if foreign else ("", record)


def unreadable_or(problem: str, refusal: str) -> str:
    """The end of a message about a ``prepacked`` folder's ``problem`` (:func:`owned_problem`):
    ``refusal`` (e.g. "; not a copy gemma-export wrote (move it away)"), or, for a copy this user
    cannot read (:data:`UNREADABLE`: whose it is cannot be told), what its owner can do."""
    if problem.startswith(UNREADABLE):
        return "; this user cannot read the copy: its owner can make it readable, or remove it"
    return refusal


def owned_problem(folder: Path) -> str:
    """"" when ``folder`` (``<export>/prepacked``) is absent or a copy this module wrote; else what is wrong."""
    return _ownership(folder)[0]


def derived_copy(out: Path, copy: str = PREPACKED_DIR) -> tuple[tuple[str, str], ...]:
    """The pre-packed copy at ``out / copy`` as a derived sub-folder of an output being replaced
    (:func:`~gemma_export.staging.check_replaceable`): it goes with the export it was made from,
    but only when one prepack of ours wrote it (:func:`owned_problem`)."""
    return ((copy, PREPACKED_MANIFEST),) if not owned_problem(out / copy) else ()


@dataclasses.dataclass(frozen=True)
class PrepackStatus:
    """Whether ``<export>/prepacked/`` can be used here.

    Attributes:
        path: the copy's ``model.onnx`` when usable, else None.
        problem: why it cannot be used ("" when usable or absent): the file or folder, then ``detail``.
        folder: the copy's folder, ``<export>/prepacked``.
        detail: ``problem`` without the path in front.
        damaged_record: the problem is ``prepacked.json`` itself (a field missing or malformed), not
            a copy made elsewhere or from other files.
    """

    path: Path | None
    problem: str
    folder: Path
    detail: str = ""
    damaged_record: bool = False

    @property
    def reason(self) -> str:
        """One line for people: which copy is used, or why the folder's copy is not ("" when none)."""
        if self.path is not None:
            return f"pre-packed copy {self.folder} (made on this machine)"
        if self.problem:
            if self.detail.startswith(UNREADABLE):  # another user's copy: neither prepack nor this user can fix it
                return f"{self.problem}; not used (its owner can make it readable to this user, or remove it)"
            if owned_problem(self.folder):  # not a copy prepack wrote: prepack will not replace it either
                return (f"{self.problem}; not used (it is not a copy gemma-export wrote: move {self.folder} away, "
                        f"then `gemma-export prepack --model {self.folder.parent}` makes a new one)")
            return f"{self.problem}; not used (`gemma-export prepack --model {self.folder.parent}` makes a new one)"
        return ""


def status(model_dir: str | Path) -> PrepackStatus:
    """Check ``<model_dir>/prepacked/`` against this machine and the export's files (cheap: sizes and
    modification times; ``verify`` checks the sha256 of every file).

    Raises:
        ConfigError: ``model_dir`` is no path.
        SourceNotFoundError: ``model_dir`` is missing or a file (a graph folder without a manifest,
            another exporter's, is checked: it has no copy).
    """
    _export_folder(model_dir, "status")
    folder = Path(model_dir) / PREPACKED_DIR

    def unusable(where: Path, detail: str, damaged_record: bool = False) -> PrepackStatus:
        return PrepackStatus(None, f"{where}: {detail}", folder, detail, damaged_record)

    record_path = folder / PREPACKED_MANIFEST
    if not folder.exists() and not folder.is_symlink():
        return PrepackStatus(None, "", folder)
    wrong, record = _ownership(folder)  # a readable JSON object with our format, or a problem
    if wrong:
        return unusable(folder, wrong)
    for field in ("machine", "source", "files"):
        if not isinstance(record.get(field), dict):
            return unusable(record_path, f"field '{field}' missing or not an object", True)
    here, key = machine_key(), record["machine"]
    for field in ("onnxruntime", "machine", "system", "cpu_flags_sha256"):
        if not isinstance(key.get(field), str):  # a damaged record, not a copy made elsewhere
            return unusable(record_path, f"field 'machine.{field}' must be a string, found "
                                         f"{json.dumps(key.get(field))[:40]}", True)
        if key.get(field) != here[field]:
            what = "CPU features" if field == "cpu_flags_sha256" else field
            return unusable(folder, f"made for {what} {key.get(field)!r}, this machine has {here[field]!r}")
    if record["source"] != source_identity(Path(model_dir)):
        return unusable(folder, "made from other model files than the export's current ones (size, time or "
                                "checksum changed; a copy of the folder that did not keep the files' times, as "
                                "cp -r does, counts as changed: copy with cp -a, or run gemma-export prepack again)")
    files = record["files"]
    if not {MODEL_FILE, DATA_FILE} <= set(files):
        return unusable(record_path, f"'files' does not record {MODEL_FILE} and {DATA_FILE}", True)
    for name, entry in files.items():
        path = folder / str(name)
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
                and type(entry.get("mtime_ns")) is int):
            return unusable(record_path, f"files[{name!r}] needs integer 'bytes' (>= 0) and 'mtime_ns'", True)
        try:
            if name not in (MODEL_FILE, DATA_FILE) or not path.is_file():
                return unusable(path, f"recorded in {PREPACKED_MANIFEST} but missing or not part of a copy")
            stat = path.stat()
        except OSError as exc:  # no search right on the folder for this user
            return unusable(path, f"{UNREADABLE} ({exc.strerror or exc})")
        if not os.access(path, os.R_OK):  # onnxruntime's load said only "SystemError : 13"
            return unusable(path, f"{UNREADABLE} (Permission denied)")
        if stat.st_size != entry["bytes"]:
            return unusable(path, f"{stat.st_size:,} bytes, {PREPACKED_MANIFEST} recorded {entry['bytes']:,}")
        if stat.st_mtime_ns != entry["mtime_ns"]:
            return unusable(path, f"modified since {PREPACKED_MANIFEST} was written (its time differs)")
    return PrepackStatus(folder / MODEL_FILE, "", folder)


@dataclasses.dataclass(frozen=True)
class PrepackResult:
    """What :func:`prepack` wrote.

    Attributes:
        out_dir: ``<export>/prepacked``.
        files: file name → bytes.
        seconds: wall time, seconds.
        checked_tokens: tokens whose logits were compared with the export's (all equal).
    """

    out_dir: Path
    files: dict[str, int]
    seconds: float
    checked_tokens: int

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())


#: session config entries that make onnxruntime save its optimized graph with the packed weights
#: in one external data file (onnxruntime_session_options_config_keys.h)
SAVE_PREPACKED = {
    "session.optimized_model_external_initializers_file_name": DATA_FILE,
    "session.optimized_model_external_initializers_min_size_in_bytes": "1024",
    "session.save_external_prepacked_constant_initializers": "1",
}


def _export_folder(model_dir: Path, function: str | None = None, manifest: bool = False) -> None:
    """Refuse a ``model_dir`` that is no folder or a bundle folder; with ``function`` (the caller's
    name, for the message) also one that is no path, and with ``manifest`` one without
    ``manifest.json``."""
    from .manifest import require_folder

    if function is not None:
        check_arguments(function, model_dir=(model_dir, "path"))
    require_folder(Path(model_dir), MODEL_FILE)
    if manifest and not (Path(model_dir) / MANIFEST_FILE).is_file():
        raise SourceNotFoundError(f"{Path(model_dir) / MANIFEST_FILE}: missing; not a gemma-export folder")


#: a leftover where no lock can be taken: it may be a running prepack's staging folder
_UNDECIDABLE = ("left by a gemma-export prepack that was interrupted or is still running: no lock can be taken "
                "on {folder} (a file system without locks) to tell which; when no prepack runs on it, remove it by "
                "hand")


def _clear_leftovers(model_dir: Path, say: Callable[[str], None], locked: bool | None) -> None:
    """Delete what earlier runs left (:func:`leftovers`), before anything else is changed; ``locked``
    is what :func:`_folder_lock` yielded (None: no lock could be taken, so another prepack may be
    writing them, and none is deleted).

    Raises:
        OutputError: one cannot be deleted (e.g. a read-only file in it): naming it and the first
            error; or one exists and ``locked`` is None.
    """
    from .staging import remove_tree

    for path in leftovers(model_dir):
        if locked is None:
            raise OutputError(f"{path}: {_UNDECIDABLE.format(folder=model_dir)} (nothing was changed)")
        say(f"removing {path} (left by an earlier prepack)")
        problem = remove_tree(path)
        if problem is not None:
            raise OutputError(f"{path}: left by an earlier gemma-export prepack, and it cannot be removed ({problem}); "
                              "remove it by hand (nothing else was changed)")


@contextlib.contextmanager
def _folder_lock(model_dir: Path, exclusive: bool = True) -> Iterator[bool | None]:
    """A :func:`~gemma_export.staging.flocked` lock on the export folder itself: ``prepack`` and
    ``prepack --remove`` hold it exclusively, so two never work on one folder at once. Yields True
    when the lock was taken, False when ``exclusive`` is false and another process holds it, None
    where no lock can be taken (no ``fcntl``, a file system without locks, a folder that cannot be
    opened): the block then runs unheld, and leftovers cannot be told from a running prepack's.

    Raises:
        OutputError: ``exclusive`` and another process holds the lock.
    """
    with flocked(model_dir, exclusive) as held:
        if held is False and exclusive:
            raise OutputError(f"{model_dir}: another gemma-export prepack is working on this folder; try again "
                              "when it has finished (nothing was changed)")
        yield held


def busy(model_dir: str | Path) -> bool | None:
    """Whether a ``prepack`` or ``prepack --remove`` is working on ``model_dir`` right now; None
    when no lock can be taken there, so it cannot be told (a file system without locks).

    Raises:
        ConfigError: ``model_dir`` is no path."""
    check_arguments("busy", model_dir=(model_dir, "path"))
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return False
    with _folder_lock(model_dir, exclusive=False) as free:
        return None if free is None else not free


def _writable(folder: Path, what: str) -> None:
    reason = entry_refused(folder)  # the OS's reason: permissions, a read-only file system, ...
    if reason is not None:
        raise OutputError(f"{folder}: cannot write there ({reason}), which {what} needs; nothing was changed")


def _may_replace(model_dir: Path, what: str, refusal: str) -> Path:
    """``<model_dir>/prepacked`` after checking that this module may replace or delete it: absent
    or a copy it wrote, and the folders writable. ``refusal`` ends the message for a foreign one.

    Raises:
        OutputError: a ``prepacked`` gemma-export did not write, or no write permission.
    """
    folder = model_dir / PREPACKED_DIR
    wrong = owned_problem(folder)
    if wrong:
        raise OutputError(f"{folder}: {wrong}{unreadable_or(wrong, refusal)}")
    _writable(model_dir, what)
    if folder.is_dir():
        _writable(folder, what)
    return folder


#: the copy holds the export's initializers and their packed form: 1.99-2.19 x the data file on the
#: real 270M (fp32 1.99, int8 2.06, int4 2.08; int4 2.19 on an AMD EPYC with AVX-512, 2026-12-05: the
#: packed form depends on the machine's kernels); bf16 is widened to float32 when onnxruntime folds
#: its Casts, so its copy is ~4 x; float16 scales (--scale-dtype float16) are widened to float32 the
#: same way: int4 2.44 x, int8 with block 16 2.21 x (2026-12-05, eighth session). Space is checked
#: against these factors before any work starts.
SPACE_FACTOR = 2.3
SPACE_FACTOR_BF16 = 4.1
SPACE_FACTOR_FLOAT16_SCALES = 2.6


def prepack(model_dir: str | Path, threads: int | None = None,
            progress: Callable[[str], None] | None = None) -> PrepackResult:
    """Write ``<model_dir>/prepacked/``: onnxruntime's optimized graph of the export with its
    pre-packed weights in the external data file, made for this machine, plus ``prepacked.json``
    (machine key, the export's files it was made from, each copy file's size, time and sha256).

    The export is first verified against its ``manifest.json``; the copy is kept only if its logits
    for a short prompt equal the export's bit for bit. An existing copy is replaced only then, and
    only if it is a copy this function wrote. The copy holds the export's weights and their packed
    form (2–2.2 × the data file on disk, :data:`SPACE_FACTOR`). Leftovers of an interrupted run are removed first.

    Raises:
        SourceNotFoundError: ``model_dir`` is missing, a file, or not an export.
        VerificationError: the export does not match its manifest, or the copy's logits differ
            from the export's (nothing is kept).
        FormatError: onnxruntime cannot load the export.
        OutputError: ``prepacked`` holds something else; no permission or too little space; writing
            failed (nothing is kept; an older copy stays); another prepack runs on the folder, or a
            leftover lies there that no lock can tell from a running prepack's.
        GemmaExportError: ``threads`` outside 1 … 4 × this machine's CPUs (before any progress line).
        ConfigError: an argument of the wrong kind (``model_dir`` no path, ``threads`` no int,
            ``progress`` not callable).
    """
    import shutil

    from .verify import verify_manifest
    from .runtime import _CANNOT_LOAD, OnnxDecoder, check_threads, create_session

    check_arguments("prepack", model_dir=(model_dir, "path"), threads=(threads, "int?"), progress=(progress, "callable?"))
    say = progress or (lambda _msg: None)
    model_dir = Path(model_dir)
    start = time.perf_counter()
    check_threads(threads)  # before the manifest check prints its progress line
    # a folder that is no export is refused before the lock and the write probe touch it (a break-it
    # round: a transformers folder given by mistake had its modification time changed)
    _export_folder(model_dir, manifest=True)
    with _folder_lock(model_dir) as locked:
        out = _may_replace(model_dir, "writing the pre-packed copy",
                           ", so it is not a copy gemma-export wrote; move it away first (nothing was changed)")
        _clear_leftovers(model_dir, say, locked)
        say(f"checking {model_dir} against its manifest …")
        verify_manifest(model_dir)
        data = model_dir / DATA_FILE
        manifest = read_manifest(model_dir)  # verify_manifest has read it
        scale_dtype = (manifest.get("quantization") or {}).get("scale_dtype")
        factor = (SPACE_FACTOR_BF16 if manifest.get("dtype") == "bf16"
                  else SPACE_FACTOR_FLOAT16_SCALES if scale_dtype == "float16" else SPACE_FACTOR)
        need = int(factor * data.stat().st_size) if data.is_file() else 0
        # its data file is nearly all of it; the copy has no other place than the export's folder
        check_free_space(out, need, "pre-packed copy", largest_file_bytes=need, elsewhere=False)
        original = OnnxDecoder(model_dir, threads=threads, prepacked=False, huge_pages=False)  # one forward pass
        token_ids = [t for t in CHECK_TOKENS if t < original.vocab_size] or [0]
        ids = np.asarray([token_ids], np.int64)
        feeds = (ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
        expected, _ = original.forward(*feeds, original.empty_cache(1))
        del original
        # the exclusive lock this prepack holds on model_dir is the lock staged_folder takes on the parent
        with staged_folder(out, "pre-packed copy", notify=say, parent_locked=True) as staging:
            say(f"packing {model_dir / MODEL_FILE} for this machine (onnxruntime writes its optimized graph) …")
            try:
                create_session(model_dir / MODEL_FILE, threads, staging / MODEL_FILE, SAVE_PREPACKED)
            except FormatError as exc:
                if no_free_inodes(staging):  # onnxruntime said "SystemError : 28"
                    raise OutputError(f"{out}: onnxruntime could not write the pre-packed copy: the file system has no "
                                      "free inodes left (`df -i` shows them); free some; nothing was written") from None
                free = shutil.disk_usage(model_dir).free
                written = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
                if free + written < need or free == 0:  # the estimate can be short of the copy: say what happened
                    raise OutputError(f"{out}: onnxruntime could not write the pre-packed copy (the disk is full or a "
                                      f"file-size limit was reached after {written:,} bytes of it, of about {need:,} "
                                      "expected); free some space; nothing was written") from None
                raise OutputError(f"{out}: onnxruntime could not write the pre-packed copy "
                                  f"({str(exc).split(_CANNOT_LOAD, 1)[-1][:160]}); nothing was written") from None
            if not (staging / DATA_FILE).is_file():
                raise GemmaExportError(f"{model_dir / MODEL_FILE}: onnxruntime wrote no external data file; "
                                       "the export has no weights to pre-pack")
            say("checking the copy's logits against the export's …")
            copy = OnnxDecoder(model_dir, threads=threads, prepacked=staging / MODEL_FILE)
            got, _ = copy.forward(*feeds, copy.empty_cache(1))
            del copy
            if got.shape != expected.shape or not np.array_equal(got, expected):
                diff = float(np.abs(got - expected).max()) if got.shape == expected.shape else float("nan")
                raise VerificationError(f"{staging / MODEL_FILE}: the pre-packed copy's logits differ from the export's "
                                        f"(max |diff| {diff:.3g}); nothing was kept")
            say("recording checksums …")
            files = {}
            for path in sorted(staging.iterdir()):
                stat = path.stat()
                files[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": file_sha256(path)}
            record = {"format": FORMAT, "machine": machine_key(), "source": source_identity(model_dir), "files": files,
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "check": {"token_ids": token_ids, "logits": "identical"}}
            (staging / PREPACKED_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
            sizes = {name: entry["bytes"] for name, entry in files.items()}
            sizes[PREPACKED_MANIFEST] = (staging / PREPACKED_MANIFEST).stat().st_size
            result = PrepackResult(out, sizes, time.perf_counter() - start, len(token_ids))
        return result


def verify(model_dir: str | Path) -> str:
    """Check ``<model_dir>/prepacked/`` (if any): a copy this toolkit wrote, every recorded file with
    its sha256, then :func:`status`. Returns one line for people ("" when there is no copy). Leftovers
    of an interrupted ``prepack`` are :func:`~gemma_export.verify.verify_manifest`'s to report
    (:func:`check_no_leftovers`), which ``verify`` runs first.

    Raises:
        VerificationError: ``prepacked`` holds something else; a recorded file differs (a copy the
            runtime could load with wrong weights). The message says how to rebuild or remove it.
        ConfigError: ``model_dir`` is no path.
        SourceNotFoundError: ``model_dir`` is missing, a file, or not an export: a mistyped folder
            is not "no copy, nothing to check".
    """
    _export_folder(model_dir, "verify", manifest=True)
    model_dir = Path(model_dir)
    folder = model_dir / PREPACKED_DIR
    fix = f"run gemma-export prepack --model {model_dir} again, or with --remove"
    wrong, record = _ownership(folder)
    if wrong:
        raise VerificationError(f"{folder}: {wrong}{unreadable_or(wrong, '; not a copy gemma-export wrote (move it away)')}")
    if record is None:  # no copy
        return ""
    found = status(model_dir)
    try:
        items = [(str(name), entry["sha256"]) for name, entry in record["files"].items()]
    except (KeyError, TypeError, AttributeError):
        raise VerificationError(f"{folder / PREPACKED_MANIFEST}: unreadable or without checksums; {fix}") from None
    for name, digest in items:
        path = folder / name
        if name not in (MODEL_FILE, DATA_FILE):
            raise VerificationError(f"{folder / PREPACKED_MANIFEST}: records {name!r}, which is not a file of a "
                                    f"pre-packed copy ({MODEL_FILE}, {DATA_FILE}); {fix}")
        if not path.is_file():
            raise VerificationError(f"{path}: recorded in {PREPACKED_MANIFEST} but missing; {fix}")
        if file_sha256(path) != digest:
            raise VerificationError(f"{path}: sha256 differs from {PREPACKED_MANIFEST}; {fix}")
        recorded = record["files"][name].get("bytes") if isinstance(record["files"][name], dict) else None
        if type(recorded) is int and recorded != path.stat().st_size:  # the checksum matches: the record is wrong
            raise VerificationError(f"{folder / PREPACKED_MANIFEST}: records {recorded:,} bytes for {name}, whose "
                                    f"sha256 it matches at {path.stat().st_size:,} bytes: a damaged record; {fix}")
    if found.path is None and found.damaged_record:
        raise VerificationError(f"{found.problem}; {fix}")  # a record the runtime cannot read
    if found.path is None:
        return f"pre-packed copy {folder}: intact, but {found.detail}; not used here"
    return f"pre-packed copy {folder}: {len(items)} files match {PREPACKED_MANIFEST}; made on this machine from these files"


def remove(model_dir: str | Path, progress: Callable[[str], None] | None = None) -> bool:
    """Delete ``<model_dir>/prepacked/`` if it is a copy this module wrote, and any leftovers of an
    interrupted ``prepack`` (each named to ``progress`` as it goes). Returns whether a copy was
    removed. The copy is first renamed aside: if that fails it is whole and in place; if the deletion
    then fails part-way, what is left stays aside (a leftover the next ``prepack`` or ``prepack
    --remove`` deletes) and is named.

    Raises:
        ConfigError: ``model_dir`` is no path, ``progress`` not callable.
        SourceNotFoundError: ``model_dir`` is missing or a file.
        OutputError: ``prepacked`` is not such a copy (left untouched), or no permission, saying
            whether the copy is unchanged or partly deleted, and where its rest is; another prepack
            runs on the folder, or a leftover lies there that no lock can tell from a running one's.
    """
    check_arguments("remove", model_dir=(model_dir, "path"), progress=(progress, "callable?"))
    model_dir = Path(model_dir)
    _export_folder(model_dir)
    with _folder_lock(model_dir) as locked:
        folder = model_dir / PREPACKED_DIR
        if not folder.exists() and not folder.is_symlink() and not leftovers(model_dir):
            return False
        _may_replace(model_dir, "removing the pre-packed copy", "; not a copy gemma-export wrote, left untouched")
        _clear_leftovers(model_dir, progress or (lambda _msg: None), locked)
        if not folder.exists():
            return False
        with interrupts_held():  # the rename and the deletion run to the end once started
            aside = Path(tempfile.mkdtemp(prefix=LEFTOVER_PREFIXES[2], dir=model_dir))
            try:
                os.replace(folder, aside / PREPACKED_DIR)
            except OSError as exc:  # nothing deleted yet: the copy stays as it was
                aside.rmdir()
                raise OutputError(f"{folder}: could not remove it ({exc.strerror or exc}); it is unchanged") from None
            problem = remove_tree(aside)
            if problem is not None:  # part of it is gone: never moved back as if whole
                raise OutputError(f"{folder}: moved out of the export, but deleting it stopped part-way ({problem}); "
                                  f"the rest is in {aside}, which the next gemma-export prepack (or --remove) deletes "
                                  "once it can")
        return True
