"""See what an archive carries: tensor counts, sizes by dtype, the largest tensors, and tensors
stored more than once.

Works on ONNX models (inline or external data), safetensors files (including the reference
export's flat 1-D archives) and GGUF files. Tensor data is never loaded whole: hashes stream the
bytes in 8 MiB chunks, and transposed copies are compared block by block through memory maps, so
inspecting a 1 GB archive stays far below its size in resident memory.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .errors import FormatError, SourceNotFoundError

CHUNK_BYTES = 8 << 20
#: Tensors smaller than this are counted but not checked for duplicates (norm weights and the like
#: are often legitimately equal).
MIN_DUPLICATE_BYTES = 1 << 16

#: numpy view of each safetensors dtype (BF16 as its bits); sizes live in safetensors_header
_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One stored tensor.

    Attributes:
        name: the key in the file.
        shape: stored shape (a flat reference archive stores ``[count]``).
        dtype: the file's type name (``F32``, ``BF16``, ``Q8_0``, ``UINT8``, ...).
        nbytes: bytes on disk.
        elements: number of values (after unpacking block formats).
        path, offset: where the bytes live (``path`` None: inline ONNX data, see ``inline``).
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    elements: int
    path: Path | None
    offset: int
    item_dtype: np.dtype | None = None
    inline: bytes | None = dataclasses.field(default=None, repr=False)

    def chunks(self) -> Iterator[bytes]:
        if self.inline is not None:
            yield self.inline
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            remaining = self.nbytes
            while remaining:
                data = f.read(min(CHUNK_BYTES, remaining))
                if not data:
                    raise FormatError(f"{self.path}: tensor '{self.name}' ends past the end of the file")
                remaining -= len(data)
                yield data

    def array(self) -> np.ndarray | None:
        """A read-only memory map of the values in their stored shape, when they are plain numbers."""
        if self.item_dtype is None:
            return None
        if self.inline is not None:
            return np.frombuffer(self.inline, dtype=self.item_dtype).reshape(self.shape)
        return np.memmap(self.path, dtype=self.item_dtype, mode="r", offset=self.offset, shape=self.shape or (1,))


@dataclasses.dataclass(frozen=True)
class DuplicateGroup:
    """Tensors holding the same values: ``kind`` is ``identical bytes`` or ``transposed``."""

    kind: str
    names: tuple[str, ...]
    nbytes_each: int

    @property
    def wasted_bytes(self) -> int:
        return self.nbytes_each * (len(self.names) - 1)


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`inspect_path` found."""

    path: str
    format: str
    tensors: list[TensorEntry]
    duplicates: list[DuplicateGroup]
    consumers: dict[str, list[str]]  # ONNX: initializer → consumer op types

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_elements(self) -> int:
        return sum(t.elements for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        out: dict[str, int] = collections.Counter()
        for t in self.tensors:
            out[t.dtype] += t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self, top: int) -> dict:
        largest = sorted(self.tensors, key=lambda t: -t.nbytes)[:top]
        return {
            "path": self.path, "format": self.format, "tensors": len(self.tensors),
            "total_elements": self.total_elements, "total_bytes": self.total_bytes,
            "fp32_equivalent_bytes": 4 * self.total_elements, "bytes_by_dtype": self.bytes_by_dtype(),
            "largest": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "bytes": t.nbytes,
                         "share": t.nbytes / max(self.total_bytes, 1)} for t in largest],
            "duplicates": [{"kind": d.kind, "names": list(d.names), "bytes_each": d.nbytes_each,
                            "wasted_bytes": d.wasted_bytes} for d in self.duplicates],
            "consumers": self.consumers,
        }


# ---- readers ------------------------------------------------------------------------------------
def _safetensors_entries(path: Path) -> list[TensorEntry]:
    from .sources.safetensors_header import read_header

    entries = []
    for t in read_header(path):
        entries.append(TensorEntry(t.name, t.shape, t.dtype, t.nbytes, math.prod(t.shape), path, t.offset,
                                   np.dtype(_SAFETENSORS_DTYPES[t.dtype])))
    return entries


def _mlir_entries(path: Path) -> list[TensorEntry]:
    """The ``util.global`` declarations of a reference MLIR, with their data from the flat archive
    beside it (reshaped to the declared shapes) when there is one; without an archive the entries
    carry no data (sizes only, no duplicate search)."""
    from .sources.mlir import ELEMENT_TYPES, Archive, find_archive, parse_mlir

    module = parse_mlir(path)
    try:
        archive = Archive(module, find_archive(path))
    except SourceNotFoundError:
        archive = None
    entries = []
    for g in module.globals:
        st_dtype, width = ELEMENT_TYPES[g.element_type]
        offset = archive.entries[g.key].offset if archive else 0
        entries.append(TensorEntry(g.name, g.shape, st_dtype, g.count * width, g.count,
                                   archive.path if archive else None, offset,
                                   np.dtype(_SAFETENSORS_DTYPES[st_dtype]) if archive else None))
    return entries


def _gguf_entries(path: Path) -> list[TensorEntry]:
    import gguf

    from .sources.gguf_header import validate_gguf

    validate_gguf(path)
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise FormatError(f"{path}: not a readable GGUF file: {exc}") from None
    entries = []
    plain = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8, "I16": np.int16, "I32": np.int32}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        kind = t.tensor_type.name
        entries.append(TensorEntry(t.name, shape, kind, int(t.n_bytes), int(t.n_elements), path, int(t.data_offset),
                                   np.dtype(plain[kind]) if kind in plain else None))
    return entries


def _onnx_entries(path: Path) -> tuple[list[TensorEntry], dict[str, list[str]]]:
    import onnx
    from onnx import helper

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:
        raise FormatError(f"{path}: not a readable ONNX model: {exc}") from None
    entries = []
    for t in model.graph.initializer:
        shape = tuple(int(d) for d in t.dims)
        dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
        name = onnx.TensorProto.DataType.Name(t.data_type)
        count = math.prod(shape)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            location = Path(info.get("location", ""))
            if location.is_absolute() or ".." in location.parts:
                raise FormatError(f"{path}: initializer '{t.name}' points outside the model folder ({location})")
            entries.append(TensorEntry(t.name, shape, name, int(info.get("length", 0)), count, path.parent / location,
                                       int(info.get("offset", 0)), dtype))
        else:
            raw = t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
            entries.append(TensorEntry(t.name, shape, name, len(raw), count, None, 0, dtype, inline=raw))
    consumers: dict[str, list[str]] = {e.name: [] for e in entries}
    for node in model.graph.node:
        for name in node.input:
            if name in consumers:
                consumers[name].append(node.op_type)
    return entries, consumers


# ---- duplicates ---------------------------------------------------------------------------------
def _digest(entry: TensorEntry) -> str:
    h = hashlib.sha256()
    for chunk in entry.chunks():
        h.update(chunk)
    return h.hexdigest()


def _read_block(entry: TensorEntry, rows: slice, cols: slice) -> np.ndarray:
    """``entry[rows, cols]`` of a 2-D tensor, read with plain file reads (no memory map, so the
    pages read do not stay in this process's resident set)."""
    n_rows, n_cols = entry.shape
    item = entry.item_dtype.itemsize
    r0, r1, _ = rows.indices(n_rows)
    c0, c1, _ = cols.indices(n_cols)
    if entry.inline is not None:
        return np.frombuffer(entry.inline, dtype=entry.item_dtype).reshape(entry.shape)[r0:r1, c0:c1]
    out = np.empty((r1 - r0, c1 - c0), dtype=entry.item_dtype)
    with open(entry.path, "rb") as f:
        if c0 == 0 and c1 == n_cols:
            f.seek(entry.offset + r0 * n_cols * item)
            out[:] = np.frombuffer(f.read((r1 - r0) * n_cols * item), dtype=entry.item_dtype).reshape(out.shape)
        else:
            for i, r in enumerate(range(r0, r1)):
                f.seek(entry.offset + (r * n_cols + c0) * item)
                out[i] = np.frombuffer(f.read((c1 - c0) * item), dtype=entry.item_dtype)
    return out


def _equal_transposed(a: TensorEntry, b: TensorEntry, block_bytes: int = CHUNK_BYTES) -> bool:
    """``a == b.T`` for ``a [R, C]`` and ``b [C, R]``, compared block by block (a few MiB at a time)."""
    if a.item_dtype is None or b.item_dtype is None:
        return False
    rows, cols = a.shape
    step = max(1, block_bytes // max(1, cols * a.item_dtype.itemsize))
    for start in range(0, rows, step):
        block = slice(start, start + step)
        if not np.array_equal(_read_block(a, block, slice(None)), _read_block(b, slice(None), block).T):
            return False
    return True


#: float storage types by name in each format, widest first: a narrower copy of a wider tensor is
#: "the same values in another precision" when the wide values rounded to it equal it.
_FLOAT_RANK = {"F32": 0, "FLOAT": 0, "F16": 1, "FLOAT16": 1, "BF16": 1, "BFLOAT16": 1}


def _to_float32(entry: TensorEntry, chunk: bytes) -> np.ndarray:
    if entry.dtype in ("BF16", "BFLOAT16"):
        return (np.frombuffer(chunk, np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(chunk, entry.item_dtype).astype(np.float32)


def _round_like(values: np.ndarray, narrow: TensorEntry) -> list[np.ndarray]:
    """``values`` rounded to ``narrow``'s precision, both ways seen in the wild (nearest even, and
    the reference archives' bf16 truncation)."""
    if narrow.dtype in ("BF16", "BFLOAT16"):
        import ml_dtypes

        nearest = values.astype(ml_dtypes.bfloat16).astype(np.float32)
        truncated = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        return [nearest, truncated]
    return [values.astype(np.float16).astype(np.float32)]


def _same_after_dequantization(wide: TensorEntry, narrow: TensorEntry) -> bool:
    """Stream both tensors and compare the wide one rounded to the narrow one's precision."""
    wide_chunks, narrow_chunks = wide.chunks(), narrow.chunks()
    ratio = wide.item_dtype.itemsize // 2  # bytes of wide per byte-pair of narrow
    buffer = b""
    for piece in narrow_chunks:
        narrow_values = _to_float32(narrow, piece)
        need = len(piece) * ratio
        while len(buffer) < need:
            buffer += next(wide_chunks)
        wide_values, buffer = _to_float32(wide, buffer[:need]), buffer[need:]
        if not any(np.array_equal(r, narrow_values, equal_nan=True) for r in _round_like(wide_values, narrow)):
            return False
    return True


def find_duplicates(entries: list[TensorEntry]) -> list[DuplicateGroup]:
    """Groups of tensors stored more than once: identical bytes (any shape, e.g. a flat 1-D copy of a
    2-D table), 2-D tensors equal to another's transpose, and the same values stored in two float
    precisions (float32 and bf16/f16). Only tensors ≥ 64 KiB are checked; hashing reads only
    tensors whose byte size matches another's."""
    big = [e for e in entries if e.nbytes >= MIN_DUPLICATE_BYTES]
    by_size: dict[tuple[int, str], list[TensorEntry]] = collections.defaultdict(list)
    for e in big:
        by_size[(e.nbytes, e.dtype)].append(e)
    groups = []
    for (nbytes, _), same_size in by_size.items():
        if len(same_size) < 2:
            continue
        by_hash: dict[str, list[str]] = collections.defaultdict(list)
        for e in same_size:
            by_hash[_digest(e)].append(e.name)
        groups += [DuplicateGroup("identical bytes", tuple(names), nbytes) for names in by_hash.values() if len(names) > 1]
        in_groups = {n for g in groups for n in g.names}
        matrices = [e for e in same_size if len(e.shape) == 2 and e.name not in in_groups]
        for i, a in enumerate(matrices):
            for b in matrices[i + 1:]:
                if a.shape == b.shape[::-1] and a.shape[0] != a.shape[1] and _equal_transposed(a, b):
                    groups.append(DuplicateGroup("transposed", (a.name, b.name), nbytes))
    floats = [e for e in big if e.dtype in _FLOAT_RANK and e.item_dtype is not None]
    for wide in (e for e in floats if _FLOAT_RANK[e.dtype] == 0):
        for narrow in (e for e in floats if _FLOAT_RANK[e.dtype] == 1 and e.elements == wide.elements):
            if _same_after_dequantization(wide, narrow):
                groups.append(DuplicateGroup("same values, two precisions", (wide.name, narrow.name), narrow.nbytes))
    return sorted(groups, key=lambda g: -g.wasted_bytes)


# ---- entry point --------------------------------------------------------------------------------
def inspect_path(path: str | Path) -> Report:
    """Inspect an archive (``.onnx``, ``.safetensors``, ``.gguf``, or a reference ``.mlir`` with its
    archive beside it; the type is read from the file).

    Raises:
        SourceNotFoundError: no such file.
        FormatError: the file is not one of the supported formats or is malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise SourceNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(9)
    consumers: dict[str, list[str]] = {}
    if magic[:4] == b"GGUF":
        kind, entries = "gguf", _gguf_entries(path)
    elif path.suffix == ".safetensors" or magic[8:9] == b"{":
        kind, entries = "safetensors", _safetensors_entries(path)
    elif path.suffix == ".onnx":
        kind = "onnx"
        entries, consumers = _onnx_entries(path)
    elif path.suffix == ".mlir":
        kind, entries = "mlir", _mlir_entries(path)
    else:
        raise FormatError(f"{path}: not an ONNX, safetensors, GGUF or reference MLIR file (first bytes {magic[:4]!r})")
    with_data = [e for e in entries if e.path is not None or e.inline is not None]
    return Report(str(path), kind, entries, find_duplicates(with_data), consumers)


def _is_shared_table(ops: list[str]) -> bool:
    return any(o in ("Gather", "GatherBlockQuantized") for o in ops) and any(o in ("MatMul", "MatMulNBits", "Gemm") for o in ops)


def format_report(report: Report, top: int = 10) -> str:
    """The human-readable report printed by ``gemma-export inspect``."""
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    lines = [
        f"{report.path} ({report.format})",
        f"tensors: {len(report.tensors)}, total elements: {report.total_elements:,} = "
        f"{gib(4 * report.total_elements)} fp32; on disk {report.total_bytes:,} bytes ({gib(report.total_bytes)})",
        "bytes by dtype: " + ", ".join(f"{k} {gib(v)}" for k, v in report.bytes_by_dtype().items()),
        f"largest {top}:",
    ]
    total = max(report.total_bytes, 1)
    for t in sorted(report.tensors, key=lambda t: -t.nbytes)[:top]:
        lines.append(f"  {t.name:<48} {str(list(t.shape)):<20} {t.dtype:<8} {t.nbytes:>14,} B {100 * t.nbytes / total:5.1f}%")
    if report.duplicates:
        wasted = sum(g.wasted_bytes for g in report.duplicates)
        lines.append(f"duplicates: {len(report.duplicates)} group(s), {wasted:,} bytes wasted ({100 * wasted / total:.1f}%)")
        for g in report.duplicates:
            lines.append(f"  {g.kind}: {', '.join(g.names)} — one table stored {len(g.names)} times "
                         f"({100 * g.nbytes_each / total:.1f}% each)")
    else:
        lines.append("duplicates: none")
    if report.consumers:
        lines.append(f"consumers of the largest {top} initializers:")
        for t in sorted(report.tensors, key=lambda t: -t.nbytes)[:top]:
            if t.name in report.consumers:
                ops = report.consumers[t.name]
                shared = " (shared by a lookup and a matmul)" if _is_shared_table(ops) else ""
                lines.append(f"  {t.name}: {', '.join(ops) or '(unused)'}{shared}")
    return "\n".join(lines)
