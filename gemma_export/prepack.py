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

import dataclasses
import hashlib
import json
import platform
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import FormatError, GemmaExportError, SourceNotFoundError, VerificationError
from .staging import staged_folder

PREPACKED_DIR = "prepacked"
PREPACKED_MANIFEST = "prepacked.json"
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
FORMAT = "gemma-export-prepacked/1"
#: token ids of the bit-exactness check (batch 1, empty cache): a short prompt is enough to run
#: every packed weight once.
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
    """The export's graph and data files as the copy was made from them: size and, from the
    export's ``manifest.json``, sha256 (folders without a manifest: size and modification time)."""
    try:
        listed = json.loads((model_dir / "manifest.json").read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        listed = {}
    identity = {}
    for path in sorted(model_dir.iterdir()):
        if path.name == MODEL_FILE or (path.name.startswith(MODEL_FILE) and path.is_file()):
            stat = path.stat()
            entry = listed.get(path.name) if isinstance(listed.get(path.name), dict) else {}
            identity[path.name] = {"bytes": stat.st_size, **({"sha256": entry["sha256"]} if "sha256" in entry
                                                               else {"mtime_ns": stat.st_mtime_ns})}
    return identity


@dataclasses.dataclass(frozen=True)
class PrepackStatus:
    """Whether ``<export>/prepacked/`` can be used here.

    Attributes:
        path: the copy's ``model.onnx`` when usable, else None.
        reason: one line for people: why it is used or not ("" when there is no copy).
    """

    path: Path | None
    reason: str


def status(model_dir: str | Path) -> PrepackStatus:
    """Check ``<model_dir>/prepacked/prepacked.json`` against this machine and the export's files."""
    folder = Path(model_dir) / PREPACKED_DIR
    if not folder.exists() and not folder.is_symlink():
        return PrepackStatus(None, "")
    if folder.is_symlink() or not folder.is_dir():
        return PrepackStatus(None, f"{folder}: is {'a link' if folder.is_symlink() else 'not a folder'}; ignored "
                                   "(gemma-export prepack writes a folder there)")
    try:
        record = json.loads((folder / PREPACKED_MANIFEST).read_text())
        key, source = record["machine"], record["source"]
        if not (isinstance(key, dict) and isinstance(source, dict)):
            raise TypeError("'machine' and 'source' must be objects")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return PrepackStatus(None, f"{folder}: no readable {PREPACKED_MANIFEST}; ignored (run gemma-export prepack again)")
    here = machine_key()
    for field in ("onnxruntime", "machine", "system", "cpu_flags_sha256"):
        if key.get(field) != here[field]:
            what = "CPU features" if field == "cpu_flags_sha256" else field
            return PrepackStatus(None, f"{folder}: made for {what} {key.get(field)!r}, this machine has "
                                       f"{here[field]!r}; ignored (run gemma-export prepack here)")
    if source != source_identity(Path(model_dir)):
        return PrepackStatus(None, f"{folder}: made from other model files than the export's current ones; "
                                   "ignored (run gemma-export prepack again)")
    files = record.get("files")
    if not isinstance(files, dict) or not {MODEL_FILE, DATA_FILE} <= set(files):
        return PrepackStatus(None, f"{folder / PREPACKED_MANIFEST}: no 'files' record of {MODEL_FILE} and {DATA_FILE}; "
                                   "ignored (run gemma-export prepack again)")
    for name, entry in files.items():
        path = folder / str(name)
        size = entry.get("bytes") if isinstance(entry, dict) else None
        if Path(str(name)).name != name or path.is_symlink() or not path.is_file() or path.stat().st_size != size:
            return PrepackStatus(None, f"{path}: missing, a link, or not the {size} bytes {PREPACKED_MANIFEST} records; "
                                       "ignored (run gemma-export prepack again)")
    return PrepackStatus(folder / MODEL_FILE, f"pre-packed copy {folder} (onnxruntime {here['onnxruntime']}, this machine)")


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


def _session(path: Path, threads: int | None, save_to: Path | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    if save_to is not None:
        options.optimized_model_filepath = str(save_to / MODEL_FILE)
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", DATA_FILE)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        options.add_session_config_entry("session.save_external_prepacked_constant_initializers", "1")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's Fail / InvalidGraph / NotImplemented ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FormatError(f"{path}: onnxruntime cannot load the model: {first}") from None


def prepack(model_dir: str | Path, threads: int | None = None,
            progress: Callable[[str], None] | None = None) -> PrepackResult:
    """Write ``<model_dir>/prepacked/``: onnxruntime's optimized graph of the export with its
    pre-packed weights in the external data file, made for this machine, plus ``prepacked.json``
    (machine key, source files, sizes). An existing copy is replaced only when the new one passed
    its check.

    The copy holds the export's weights and their packed form (about 2 × the archive on disk).
    Loaded by :class:`~gemma_export.runtime.OnnxDecoder`, its packed weights are file-backed pages.

    Raises:
        SourceNotFoundError: no export in ``model_dir``.
        FormatError: onnxruntime cannot load the export.
        VerificationError: the copy's logits differ from the export's (nothing is kept).
        OutputError: the folder cannot be written (nothing is kept; an older copy stays).
    """
    from .runtime import OnnxDecoder

    say = progress or (lambda _msg: None)
    model_dir = Path(model_dir)
    start = time.perf_counter()
    original = OnnxDecoder(model_dir, threads=threads, prepacked=False)  # checks the folder and its contract
    token_ids = [t for t in CHECK_TOKENS if t < original.vocab_size] or [0]
    ids = np.asarray([token_ids], np.int64)
    feeds = (ids, np.ones_like(ids), np.arange(ids.shape[1])[None])
    expected, _ = original.forward(*feeds, original.empty_cache(1))
    del original
    with staged_folder(model_dir / PREPACKED_DIR, "pre-packed copy") as staging:
        say(f"packing {model_dir / MODEL_FILE} for this machine (onnxruntime writes its optimized graph) …")
        _session(model_dir / MODEL_FILE, threads, save_to=staging)
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
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(staging.iterdir())}
        record = {"format": FORMAT, "machine": machine_key(), "source": source_identity(model_dir), "files": files,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "check": {"token_ids": token_ids, "logits": "identical"}}
        (staging / PREPACKED_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
        sizes = {name: entry["bytes"] for name, entry in files.items()}
        sizes[PREPACKED_MANIFEST] = (staging / PREPACKED_MANIFEST).stat().st_size
    return PrepackResult(model_dir / PREPACKED_DIR, sizes, time.perf_counter() - start, len(token_ids))


def verify(model_dir: str | Path) -> str:
    """Check ``<model_dir>/prepacked/`` (if any) against the sha256 of every file ``prepacked.json``
    records, then :func:`status`. Returns one line for people ("" when there is no copy).

    Raises:
        VerificationError: a recorded file is missing or differs (a copy the runtime could load
            with wrong weights); the message says how to rebuild or remove it.
    """
    folder = Path(model_dir) / PREPACKED_DIR
    found = status(model_dir)
    if found.path is None:
        return found.reason
    files = json.loads((folder / PREPACKED_MANIFEST).read_text())["files"]
    for name, entry in files.items():
        if _sha256(folder / name) != entry.get("sha256"):
            raise VerificationError(f"{folder / name}: sha256 differs from {PREPACKED_MANIFEST}; run gemma-export prepack "
                                    f"--model {model_dir} again, or with --remove")
    return f"pre-packed copy {folder}: {len(files)} files match {PREPACKED_MANIFEST}; made on this machine from these files"


def _sha256(path: Path) -> str:
    from .exporter import _sha256 as sha256_of_file

    return sha256_of_file(path)


def remove(model_dir: str | Path) -> bool:
    """Delete ``<model_dir>/prepacked/`` if it is a copy this module wrote. Returns whether one was removed.

    Raises:
        SourceNotFoundError: ``model_dir`` does not exist.
        GemmaExportError: ``prepacked`` exists but is not such a copy (left untouched).
    """
    import shutil

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise SourceNotFoundError(f"{model_dir}: no such export folder")
    folder = model_dir / PREPACKED_DIR
    if not folder.exists():
        return False
    if not (folder / PREPACKED_MANIFEST).is_file():
        raise GemmaExportError(f"{folder}: has no {PREPACKED_MANIFEST}; not a copy gemma-export wrote, left untouched")
    shutil.rmtree(folder)
    return True
