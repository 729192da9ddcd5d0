"""See what an archive carries: tensor counts, sizes by dtype, the largest tensors, and tensors
stored more than once.

Works on ONNX models (inline or external data), safetensors files (including the reference
export's flat 1-D archives), GGUF files and reference MLIR files. Tensor data is never loaded whole:
hashes stream the bytes in 8 MiB chunks, and transposed, re-rounded and quantized copies are
compared a few MiB at a time with plain file reads (no memory maps, whose pages would stay in the
resident set), so inspecting a 1 GB archive stays far below its size in resident memory
(``tools/bench_inspect.py``; figures in docs/benchmarks-history.md).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np

from quant.bf16 import bfloat16_bits_to_float32, float32_to_bfloat16_bits, truncate_to_bfloat16_bits
from quant.int4 import unpack_nibbles

from .errors import ConfigError, FormatError, SourceNotFoundError, check_arguments
from .onnx_files import BUNDLE_MODEL_DIR, MODEL_FILE
from .staging import too_long_name
from .text_files import broken_link, require_file

CHUNK_BYTES = 8 << 20
#: Tensors smaller than this are counted but not checked for duplicates (norm weights and the like
#: are often legitimately equal).
MIN_DUPLICATE_BYTES = 1 << 16



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
        item_dtype: the numpy dtype of one stored value (None for block formats such as ``Q8_0``).
        inline: the bytes of a tensor stored inside the ``.onnx`` file itself (None otherwise).
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


@dataclasses.dataclass(frozen=True)
class DuplicateGroup:
    """Tensors holding the same values: ``kind`` is ``identical bytes``, ``transposed``, ``same
    values, two precisions`` (float32 and its bf16/f16 rounding) or ``same values after
    dequantization`` (a float tensor and an int8/uint8 tensor + scales, or a GGUF Q8_0 tensor, that
    quantizes it; ``names`` then lists the float tensor, the quantized tensor and its scales)."""

    kind: str
    names: tuple[str, ...]
    nbytes_each: int
    copies: int = 0  #: how many copies of the table the names hold (default: one per name)

    @property
    def count(self) -> int:
        return self.copies or len(self.names)

    @property
    def wasted_bytes(self) -> int:
        """Bytes freed by keeping one copy (for two precisions: the smaller copy's bytes)."""
        return self.nbytes_each * (self.count - 1)


@dataclasses.dataclass(frozen=True)
class Report:
    """What :func:`inspect_path` found.

    Attributes:
        path: the file read (an export folder's ``model.onnx``).
        format: ``onnx``, ``safetensors``, ``gguf`` or ``mlir``.
        tensors: every stored tensor, in file order.
        duplicates: groups of tensors holding the same values (``[]``: each stored once).
        consumers: ONNX only: initializer name → the op types that read it (the shared table:
            ``Gather``-like and ``MatMul``-like both).
        no_data: why no tensor data was read (a reference ``.mlir`` without its archive): sizes
            are then the declared ones and duplicates were not searched; None when it was read.
        note: what the tensors leave out, "" when nothing: a pre-packed copy's data file also holds
            onnxruntime's packed weights, which the graph does not list.
    """

    path: str
    format: str
    tensors: list[TensorEntry]
    duplicates: list[DuplicateGroup]
    consumers: dict[str, list[str]]
    no_data: str | None = None
    note: str = ""

    @property
    def total_bytes(self) -> int:
        """Bytes of all tensors as stored on disk (:attr:`TensorEntry.nbytes`)."""
        return sum(t.nbytes for t in self.tensors)

    @property
    def total_elements(self) -> int:
        """Values of all tensors, block formats unpacked (two 4-bit codes per byte count as two;
        :attr:`TensorEntry.elements`)."""
        return sum(t.elements for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Stored bytes per dtype, named as the file's format names it (ONNX: ``"UINT8"``,
        ``"FLOAT"``, ...), the largest first."""
        out: dict[str, int] = collections.Counter()
        for t in self.tensors:
            out[t.dtype] += t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def to_dict(self, top: int) -> dict:
        """The report as JSON-ready data (``inspect --json``), with the ``top`` largest tensors.

        Raises:
            ConfigError: ``top`` is no int, or negative (:func:`check_top`).
        """
        check_top("Report.to_dict", top)
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
            "duplicates_searched": self.no_data is None, "no_data": self.no_data, "note": self.note,
        }


# ---- readers ------------------------------------------------------------------------------------
def _safetensors_entries(path: Path) -> list[TensorEntry]:
    from .sources.safetensors_header import NUMPY_DTYPES, read_header

    entries = []
    for t in read_header(path):
        entries.append(TensorEntry(t.name, t.shape, t.dtype, t.nbytes, math.prod(t.shape), path, t.offset,
                                   np.dtype(NUMPY_DTYPES[t.dtype])))
    return entries


def _mlir_entries(path: Path) -> tuple[list[TensorEntry], str | None]:
    """``(entries, no_data)``: the ``util.global`` declarations of a reference MLIR, with their data
    from the flat archive beside it (reshaped to the declared shapes) when there is one; without an
    archive the entries carry no data (sizes only, no duplicate search) and ``no_data`` says why."""
    from .sources.mlir import ELEMENT_TYPES, Archive, find_archive, parse_mlir
    from .sources.safetensors_header import DTYPE_BYTES, NUMPY_DTYPES

    module = parse_mlir(path)
    no_data = None
    try:
        archive = Archive(module, find_archive(path))
    except SourceNotFoundError as exc:
        archive, no_data = None, str(exc)
    entries = []
    for g in module.globals:
        st_dtype = ELEMENT_TYPES[g.element_type]
        offset = archive.entries[g.key].offset if archive else 0
        entries.append(TensorEntry(g.name, g.shape, st_dtype, g.count * DTYPE_BYTES[st_dtype], g.count,
                                   archive.path if archive else None, offset,
                                   np.dtype(NUMPY_DTYPES[st_dtype]) if archive else None))
    return entries, no_data


def _gguf_entries(path: Path) -> list[TensorEntry]:
    import gguf

    from .sources.gguf_header import PLAIN_GGML_TYPES, read_gguf_header

    entries = []
    plain = {**PLAIN_GGML_TYPES, "BF16": np.uint16}  # bf16 as its bits, as in safetensors
    for t in read_gguf_header(path).tensors:
        shape = tuple(reversed(t.dims))
        kind = gguf.GGMLQuantizationType(t.ggml_type).name
        entries.append(TensorEntry(t.name, shape, kind, t.n_bytes, math.prod(shape), path, t.offset,
                                   np.dtype(plain[kind]) if kind in plain else None))
    return entries


def _onnx_entries(path: Path) -> tuple[list[TensorEntry], dict[str, list[str]], list[Dequantize]]:
    import onnx
    from onnx import helper

    from .onnx_files import load_graph

    model = load_graph(path)
    entries = []
    for t in model.graph.initializer:
        shape = tuple(int(d) for d in t.dims)
        try:
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            name = onnx.TensorProto.DataType.Name(t.data_type)
        except (KeyError, ValueError):
            raise FormatError(f"{path}: initializer '{t.name}' has data_type {t.data_type}, not an ONNX "
                              "tensor type") from None
        count = math.prod(shape)
        if t.data_location == onnx.TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            location = Path(info["location"])  # a file of the model's folder (load_graph checked)
            entries.append(TensorEntry(t.name, shape, name, int(info.get("length", 0)), count, path.parent / location,
                                       int(info.get("offset", 0)), dtype))
        else:
            raw = t.raw_data or onnx.numpy_helper.to_array(t).tobytes()
            entries.append(TensorEntry(t.name, shape, name, len(raw), count, None, 0, dtype, inline=raw))
    twice = sorted(n for n, k in collections.Counter(e.name for e in entries).items() if k > 1)
    if twice:  # onnxruntime refuses such a graph; which of the two a node reads is undefined
        raise FormatError(f"{path}: initializer name{'s' if len(twice) > 1 else ''} {', '.join(map(repr, twice[:5]))} "
                          f"defined more than once; a graph names each initializer once")
    consumers: dict[str, list[str]] = {e.name: [] for e in entries}
    dequantize: list[Dequantize] = []
    shapes = {e.name: e.shape for e in entries}
    per_byte: dict[str, int] = {}  # packed codes: values per stored byte (MatMulNBits' bits < 8)
    # a Cast or Identity of an initializer stands for it: float16 scales (--scale-dtype float16)
    # reach MatMulNBits and the lookup through a Cast to float32
    source: dict[str, str] = {}
    for node in model.graph.node:  # nodes are in topological order
        if node.op_type in ("Cast", "Identity") and node.input and node.output:
            origin = source.get(node.input[0], node.input[0])
            if origin in consumers:
                source[node.output[0]] = origin
    for node in model.graph.node:
        if node.output and node.output[0] in source:
            continue  # the alias itself consumes nothing
        inputs = [source.get(name, name) for name in node.input]
        for name in inputs:
            if name in consumers:
                consumers[name].append(node.op_type)
        if node.op_type == "MatMulNBits" and len(inputs) > 2 and inputs[1] in shapes:
            bits = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "bits"), 4)
            if isinstance(bits, int) and bits in (2, 4):
                per_byte[inputs[1]] = 8 // bits
            if bits in (4, 8) and inputs[2] in shapes:
                zero_points = inputs[3] if len(inputs) > 3 and inputs[3] else None
                dequantize.append(Dequantize(inputs[1], inputs[2], zero_points, 2 ** (bits - 1), bits))
        if node.op_type == "DequantizeLinear" and len(node.input) >= 2 and node.input[0] in shapes and node.input[1] in shapes:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            shape, scale_shape = shapes[node.input[0]], shapes[node.input[1]]
            axis = attrs.get("axis", 1) % max(len(shape), 1)
            # one scale per run of consecutive values: per tensor, per row (axis 0), or blocks along the last axis
            if math.prod(scale_shape) == 1 or axis == 0 or (attrs.get("block_size") and axis == len(shape) - 1):
                dequantize.append(Dequantize(node.input[0], node.input[1], node.input[2] if len(node.input) > 2 and node.input[2] else None))
    # a uint8 of packed 4-bit codes holds two weights per element (the fp32-equivalent size counts weights)
    entries = [dataclasses.replace(e, elements=e.elements * per_byte[e.name]) if e.name in per_byte and e.dtype == "UINT8"
               else e for e in entries]
    return entries, consumers, dequantize


# ---- duplicates ---------------------------------------------------------------------------------
def _digest(entry: TensorEntry) -> str:
    h = hashlib.sha256()
    for chunk in entry.chunks():
        h.update(chunk)
    return h.hexdigest()


def read_block(entry: TensorEntry, rows: slice, cols: slice) -> np.ndarray:
    """``entry[rows, cols]`` of a 2-D tensor of plain numbers (``entry.item_dtype`` set), in its
    stored dtype, read with plain file reads (no memory map, so the pages read do not stay in this
    process's resident set)."""
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
            out[:] = np.frombuffer(_read_exactly(f, (r1 - r0) * n_cols * item, entry), dtype=entry.item_dtype).reshape(out.shape)
        else:
            for i, r in enumerate(range(r0, r1)):
                f.seek(entry.offset + (r * n_cols + c0) * item)
                out[i] = np.frombuffer(_read_exactly(f, (c1 - c0) * item, entry), dtype=entry.item_dtype)
    return out


def _read_exactly(f, size: int, entry: TensorEntry) -> bytes:
    """``size`` bytes from ``f``; FormatError naming the entry's file and tensor when it ends first."""
    data = f.read(size)
    if len(data) != size:
        raise FormatError(f"{entry.path}: tensor '{entry.name}' ends past the end of the file")
    return data


def _equal_transposed(a: TensorEntry, b: TensorEntry, block_bytes: int = CHUNK_BYTES) -> bool:
    """``a == b.T`` for ``a [R, C]`` and ``b [C, R]``, compared block by block (a few MiB at a time)."""
    if a.item_dtype is None or b.item_dtype is None:
        return False
    rows, cols = a.shape
    step = max(1, block_bytes // max(1, cols * a.item_dtype.itemsize))
    for start in range(0, rows, step):
        block = slice(start, start + step)
        # NaN equals NaN here: a transposed copy of a table holding NaN is still the same bytes moved
        if not np.array_equal(read_block(a, block, slice(None)), read_block(b, slice(None), block).T, equal_nan=True):
            return False
    return True


#: float storage types by name in each format, widest first: a narrower copy of a wider tensor is
#: "the same values in another precision" when the wide values rounded to it equal it.
_FLOAT_RANK = {"F32": 0, "FLOAT": 0, "F16": 1, "FLOAT16": 1, "BF16": 1, "BFLOAT16": 1}


def _round_like(values: np.ndarray, narrow: TensorEntry) -> list[np.ndarray]:
    """``values`` rounded to ``narrow``'s precision, both ways seen in the wild (nearest even, and
    the reference archives' bf16 truncation)."""
    if narrow.dtype in ("BF16", "BFLOAT16"):
        nearest = bfloat16_bits_to_float32(float32_to_bfloat16_bits(values))
        truncated = bfloat16_bits_to_float32(truncate_to_bfloat16_bits(values))
        return [nearest, truncated]
    return [values.astype(np.float16).astype(np.float32)]


def _same_after_rounding(wide: TensorEntry, narrow: TensorEntry, chunk_values: int = 1 << 20) -> bool:
    """Stream both tensors (``chunk_values`` values at a time) and compare the wide one rounded to
    the narrow one's precision."""
    for start in range(0, narrow.elements, chunk_values):
        count = min(chunk_values, narrow.elements - start)
        narrow_values = _float_flat(narrow, start, count)
        if not any(np.array_equal(r, narrow_values, equal_nan=True) for r in _round_like(_float_flat(wide, start, count), narrow)):
            return False
    return True


#: names under which a quantized tensor ``X`` keeps its scales (safetensors / reference archives)
_SCALE_SUFFIXES = ("_scale", "_scales", ".scale", ".scales")
#: quantized storage types with a separate scale tensor: the largest code magnitude of each
_QUANT_TYPES = {"I8": 127, "INT8": 127, "U8": 255, "UINT8": 255}
#: relative rounding error of each float storage type (truncation for bf16, as the reference archives)
_RELATIVE_PRECISION = {"BF16": 2.0**-8, "BFLOAT16": 2.0**-8, "F16": 2.0**-11, "FLOAT16": 2.0**-11}


class Dequantize(NamedTuple):
    """The initializers a graph node dequantizes: ONNX ``DequantizeLinear`` (zero point 0 when
    absent) or onnxruntime's ``MatMulNBits`` (``B``, ``scales``, ``zero_points``; absent zero points
    mean ``2 ** (bits - 1)``, and 4-bit codes are packed two per byte, the even index in the low
    nibble: docs/ContribOperators.md, ``com.microsoft.MatMulNBits``)."""

    codes: str
    scales: str
    zero_points: str | None = None
    implicit_zero_point: int = 0
    bits: int = 8


@dataclasses.dataclass(frozen=True)
class Quantized:
    """A quantized tensor and its scales (and zero points): ``value = (q - zero_point) * scale``,
    one scale per ``group`` consecutive values in row-major order (per tensor, per row, or block-wise
    along the last axis). ``ggml`` is set for GGUF block types, which carry their scales inline.
    Without a ``zero_point`` tensor every zero point is ``implicit_zero_point``; ``bits`` 4 means
    two codes per stored byte (``values.elements`` counts codes)."""

    values: TensorEntry
    scale: TensorEntry | None = None
    zero_point: TensorEntry | None = None
    group: int = 0
    ggml: str | None = None
    implicit_zero_point: int = 0
    bits: int = 8


def _read_flat(entry: TensorEntry, start: int, count: int) -> np.ndarray:
    """Elements ``[start, start + count)`` of a plain tensor in row-major order (plain file reads)."""
    item = entry.item_dtype.itemsize
    if entry.inline is not None:
        return np.frombuffer(entry.inline, entry.item_dtype, count=count, offset=start * item)
    with open(entry.path, "rb") as f:
        f.seek(entry.offset + start * item)
        return np.frombuffer(_read_exactly(f, count * item, entry), entry.item_dtype)


def _float_flat(entry: TensorEntry, start: int, count: int) -> np.ndarray:
    if entry.dtype in ("BF16", "BFLOAT16"):
        return bfloat16_bits_to_float32(_read_flat(entry, start, count).view(np.uint16))
    return _read_flat(entry, start, count).astype(np.float32)


def _quantized_tensors(entries: list[TensorEntry], dequantize_nodes: list[Dequantize]) -> list[Quantized]:
    """int8/uint8 tensors with a scale companion (``X`` + ``X_scale`` by name, or the inputs of an
    ONNX ``DequantizeLinear`` or ``MatMulNBits``), and GGUF ``Q8_0`` tensors."""
    by_name = {e.name: e for e in entries}
    found = []
    pairs = [Dequantize(*node) for node in dequantize_nodes]
    pairs += [Dequantize(e.name, e.name + suffix) for e in entries if e.dtype in _QUANT_TYPES for suffix in _SCALE_SUFFIXES]
    seen = set()
    for pair in pairs:
        q, s = by_name.get(pair.codes), by_name.get(pair.scales)
        if q is None or s is None or pair.codes in seen or q.item_dtype is None or s.item_dtype is None:
            continue
        if s.dtype not in _FLOAT_RANK or s.elements == 0 or q.elements % s.elements:
            continue  # scales in a layout that is not one per run of consecutive values
        group = q.elements // s.elements
        if pair.bits not in (4, 8) or (pair.bits == 4 and group % 2):
            continue  # codes that do not start each group on a byte
        z = by_name.get(pair.zero_points) if pair.zero_points else None
        if pair.zero_points and z is None:
            continue  # zero points computed in the graph (a Constant node): their values are not known here
        if z is not None and (z.elements != s.elements or z.dtype != q.dtype):
            continue  # e.g. 4-bit zero points, packed two per byte
        seen.add(pair.codes)
        found.append(Quantized(q, s, z, group, implicit_zero_point=pair.implicit_zero_point, bits=pair.bits))
    found += [Quantized(e, ggml=e.dtype) for e in entries if e.dtype == "Q8_0" and e.path is not None]
    return found


def _dequantized_chunks(t: Quantized, chunk_values: int = 1 << 20) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """``(start, q - zero_point, scale per value, scale per group)`` in float32, about
    ``chunk_values`` values (4 MiB per float32 array) at a time."""
    if t.ggml == "Q8_0":  # blocks of 2-byte f16 scale + 32 int8 values (ggml-common.h block_q8_0)
        group_chunk = max(1, chunk_values // 32)
        blocks = t.values.elements // 32
        with open(t.values.path, "rb") as f:
            f.seek(t.values.offset)
            for first in range(0, blocks, group_chunk):
                n = min(group_chunk, blocks - first)
                raw = np.frombuffer(f.read(34 * n), np.uint8).reshape(n, 34)
                scale = raw[:, :2].copy().view(np.float16).astype(np.float32).reshape(n)
                q = raw[:, 2:].copy().view(np.int8).astype(np.float32).reshape(-1)
                yield first * 32, q, np.repeat(scale, 32), scale
        return
    groups = t.scale.elements
    group_chunk = max(1, chunk_values // t.group)
    per_byte = 8 // t.bits
    for first in range(0, groups, group_chunk):
        n = min(group_chunk, groups - first)
        scale = _float_flat(t.scale, first, n)
        q = _read_flat(t.values, first * t.group // per_byte, n * t.group // per_byte)
        q = (unpack_nibbles(q) if t.bits == 4 else q).astype(np.float32)
        if t.zero_point is not None:
            q -= np.repeat(_read_flat(t.zero_point, first, n).astype(np.float32), t.group)
        elif t.implicit_zero_point:
            q -= t.implicit_zero_point
        yield first * t.group, q, np.repeat(scale, t.group), scale


def _same_after_quantization(wide: TensorEntry, t: Quantized) -> bool:
    """True when quantizing ``wide`` with ``t``'s own scales gives ``t``'s values, i.e. ``t`` is
    ``wide`` stored a second time in fewer bits: ``|wide / scale - q| <= 0.5`` everywhere (plus
    slack for ties rounded the other way and for ``wide``'s own rounding when it is bf16/f16), and the scales are not degenerate (every group
    holding a non-zero value uses at least half of the integer range, so an all-zero ``q`` with a
    huge scale does not match everything)."""
    if t.ggml:
        qmax = 127
    elif t.zero_point is None and (t.implicit_zero_point or t.values.dtype in ("I8", "INT8")):
        qmax = 2 ** (t.bits - 1) - 1  # codes centred on zero (MatMulNBits: on 2 ** (bits - 1))
    else:
        qmax = _QUANT_TYPES[t.values.dtype] / 2
    for start, q, scale, group_scale in _dequantized_chunks(t):
        values = _float_flat(wide, start, q.size)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(scale != 0, values / scale, np.where(values == 0, 0.0, np.inf))
        # the float copy may itself be a rounding of what was quantized (bf16 by truncation: 2^-8)
        # and the scale may be stored rounded (GGUF Q8_0 keeps it as f16)
        scale_precision = _RELATIVE_PRECISION["F16"] if t.ggml else _RELATIVE_PRECISION.get(t.scale.dtype, 2.0**-23)
        slack = 1e-3 + np.abs(ratio) * (_RELATIVE_PRECISION.get(wide.dtype, 2.0**-23) + scale_precision)
        if t.implicit_zero_point and t.zero_point is None:
            # MatMulNBits' codes run from -2^(b-1) to 2^(b-1) - 1: ggml Q4_0's scale (largest / -8)
            # puts the opposite end up to +8, clipped to 7, so a value may sit a whole level off there
            if np.any(np.abs(ratio) > t.implicit_zero_point + 0.5 + slack):
                return False
            ratio = np.clip(ratio, -t.implicit_zero_point, t.implicit_zero_point - 1)
        if not np.all(np.abs(ratio - q) <= 0.5 + slack):
            return False
        group = q.size // group_scale.size
        used = np.abs(q).reshape(-1, group).max(axis=1)
        nonzero = np.abs(values).reshape(-1, group).max(axis=1) > 0
        if np.any(nonzero & (used < qmax / 2)):
            return False
    return True


def find_duplicates(entries: list[TensorEntry], dequantize_nodes: list[Dequantize] = ()) -> list[DuplicateGroup]:
    """Groups of tensors stored more than once: identical bytes (any shape, e.g. a flat 1-D copy of a
    2-D table), 2-D tensors equal to another's transpose, and the same values stored in two float
    precisions (float32 and bf16/f16), and a float tensor stored again quantized (int8/uint8 codes
    with a scale tensor, a GGUF Q8_0 tensor, or ``dequantize_nodes``: the :class:`Dequantize`
    inputs of a graph's ``DequantizeLinear`` and 4- or 8-bit ``MatMulNBits`` nodes) whose
    dequantized values equal it (rounded to nearest: codes chosen otherwise, e.g. by GPTQ or a
    clipping search, are not recognised).
    Only tensors ≥ 64 KiB are checked; hashing reads only tensors whose byte size matches another's."""
    # initializers that point at the same bytes of one data file are stored once: not duplicates
    stored: dict[tuple, TensorEntry] = {}
    for e in entries:
        stored.setdefault((e.path, e.offset, e.nbytes) if e.path is not None else (None, id(e), 0), e)
    big = [e for e in stored.values() if e.nbytes >= MIN_DUPLICATE_BYTES]
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
        # transposed copies: compare one member of each identical group (the first) with the rest,
        # so a table stored as T, T and T^T gives both groups
        followers = {n for g in groups for n in g.names[1:]}
        matrices = [e for e in same_size if len(e.shape) == 2 and e.name not in followers]
        for i, a in enumerate(matrices):
            for b in matrices[i + 1:]:
                if a.shape == b.shape[::-1] and a.shape[0] != a.shape[1] and _equal_transposed(a, b):
                    groups.append(DuplicateGroup("transposed", (a.name, b.name), nbytes))
    floats = [e for e in big if e.dtype in _FLOAT_RANK and e.item_dtype is not None]
    for wide in (e for e in floats if _FLOAT_RANK[e.dtype] == 0):
        for narrow in (e for e in floats if _FLOAT_RANK[e.dtype] == 1 and e.elements == wide.elements):
            if _same_after_rounding(wide, narrow):
                groups.append(DuplicateGroup("same values, two precisions", (wide.name, narrow.name), narrow.nbytes))
    for t in _quantized_tensors(entries, list(dequantize_nodes)):
        if t.values.nbytes < MIN_DUPLICATE_BYTES:
            continue
        for wide in (e for e in floats if e.elements == t.values.elements):
            if _same_after_quantization(wide, t):
                names = (wide.name, t.values.name) + ((t.scale.name,) if t.scale is not None else ())
                extra = t.scale.nbytes if t.scale is not None else 0
                groups.append(DuplicateGroup("same values after dequantization", names,
                                             min(wide.nbytes, t.values.nbytes + extra), copies=2))
    return sorted(groups, key=lambda g: -g.wasted_bytes)


# ---- entry point --------------------------------------------------------------------------------
def inspect_path(path: str | Path) -> Report:
    """Inspect an archive (``.onnx``, ``.safetensors``, ``.gguf``, or a reference ``.mlir`` with its
    archive beside it; GGUF and safetensors are told by their first bytes, ONNX and MLIR by the
    suffix). An export folder stands for its ``model.onnx``, a bundle folder for its export's, and
    any other folder holding exactly one ``.onnx`` file (``dedupe``'s output) for that file; a
    transformers folder (no ``.onnx``) for its ``model.safetensors`` or, sharded, for all the shards
    its ``model.safetensors.index.json`` names (the index file itself too), read as one archive.

    Returns:
        A :class:`Report` (:func:`format_report` prints it as the CLI does).

    Raises:
        SourceNotFoundError: no such file, or a folder without ``model.onnx`` or a single ``.onnx``
            (nor a bundle folder, whose export's ``model/model.onnx`` is read).
        FormatError: the file is not one of the supported formats or is malformed.
    """
    check_arguments("inspect_path", path=(path, "path"))
    from .manifest import check_readable_folder, is_bundle
    from .sources.hf import SHARD_INDEX, WEIGHTS_FILE

    check_readable_folder(path)
    what = ".onnx, .safetensors, .gguf or .mlir file (or a folder with model.onnx or one .onnx, or a transformers folder)"
    if (link := broken_link(Path(path))) is not None:  # a name too long as well (pathlib would raise OSError below)
        # for a name too long, the limit ends the line: a long path's middle is cut from the message
        raise SourceNotFoundError(f"{path}: {link}" + ("" if too_long_name(path) else f"; expected a {what}"))

    if Path(path).is_dir() and is_bundle(Path(path)):  # a bundle folder: its export's graph
        path = Path(path) / BUNDLE_MODEL_DIR
    if Path(path).is_dir() and (Path(path) / MODEL_FILE).is_file():  # an export folder: its graph
        path = Path(path) / MODEL_FILE
    elif Path(path).is_dir():  # a folder of one model of another name (dedupe's output keeps its input's)
        graphs = sorted(p for p in Path(path).glob("*.onnx") if p.is_file())
        if len(graphs) == 1:
            path = graphs[0]
        elif not graphs and ((Path(path) / SHARD_INDEX).is_file() or (Path(path) / WEIGHTS_FILE).is_file()):
            return _inspect_transformers_folder(Path(path))
    if Path(path).name == SHARD_INDEX and Path(path).is_file():
        return _inspect_transformers_folder(Path(path).parent)
    path = require_file(path, what)
    try:
        with open(path, "rb") as f:
            magic = f.read(9)
    except OSError as exc:  # a read error carries no file name of its own
        raise FormatError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    from .sources.safetensors_header import looks_like_safetensors

    consumers: dict[str, list[str]] = {}
    dequantize: list[Dequantize] = []
    no_data = None
    if magic[:4] == b"GGUF":
        kind, entries = "gguf", _gguf_entries(path)
    elif path.suffix == ".safetensors" or looks_like_safetensors(magic):
        kind, entries = "safetensors", _safetensors_entries(path)
    elif path.suffix == ".onnx":
        kind = "onnx"
        entries, consumers, dequantize = _onnx_entries(path)
    elif path.suffix.lower() == ".mlir":  # as open_source reads it
        kind = "mlir"
        entries, no_data = _mlir_entries(path)
    else:
        raise FormatError(f"{path}: not an ONNX, safetensors, GGUF or reference MLIR file (first bytes {magic[:4]!r})")
    with_data = [e for e in entries if e.path is not None or e.inline is not None]
    return Report(str(path), kind, entries, find_duplicates(with_data, dequantize), consumers, no_data,
                  _prepacked_note(path, entries) if kind == "onnx" else "")


def _prepacked_note(graph: Path, entries: list[TensorEntry]) -> str:
    """For the graph of a pre-packed copy (``gemma-export prepack``): how many bytes of its data file
    are onnxruntime's packed weights, which no tensor of the graph lists ("" for other graphs)."""
    from .manifest import is_prepacked_copy
    from .onnx_files import DATA_FILE

    data = graph.parent / DATA_FILE
    if not is_prepacked_copy(graph.parent) or not data.is_file():
        return ""
    packed = data.stat().st_size - sum(e.nbytes for e in entries if e.path is not None)
    return (f"a pre-packed copy: {data.name} also holds about {packed:,} bytes of onnxruntime's packed weights for this "
            "machine, which the graph lists as no tensor (inspect the export itself for its weights)")


def _inspect_transformers_folder(folder: Path) -> Report:
    """A transformers folder's weights as one archive: its ``model.safetensors``, or every shard its
    index names (duplicates found across shards too).

    Raises:
        FormatError: an unreadable index, a shard that is not a file of the folder, a malformed shard.
    """
    from .sources.hf import SHARD_INDEX, WEIGHTS_FILE, shard_files

    shards, _ = shard_files(folder)
    if len(shards) == 1 and shards[0].name == WEIGHTS_FILE:
        return inspect_path(shards[0])
    entries = [entry for shard in shards for entry in _safetensors_entries(shard)]
    return Report(str(folder / SHARD_INDEX), "safetensors", entries, find_duplicates(entries), {}, None)


def _is_shared_table(ops: list[str]) -> bool:
    return any(o in ("Gather", "GatherBlockQuantized") for o in ops) and any(o in ("MatMul", "MatMulNBits", "Gemm") for o in ops)


def check_top(function: str, top: int) -> None:
    """Refuse a ``top`` (how many of the largest tensors to list) that is no int or is negative: a
    slice ``[:-1]`` listed every tensor but the smallest.

    Raises:
        ConfigError: ``"--top -1: expected 0 or more"`` (the command line's name: ``inspect --top``).
    """
    check_arguments(function, top=(top, "int"))
    if top < 0:
        raise ConfigError(f"--top {top}: expected 0 or more")


def format_report(report: Report, top: int = 10) -> str:
    """The human-readable report printed by ``gemma-export inspect``; ``top``: the largest tensors listed.

    Raises:
        ConfigError: ``top`` is no int, or negative (:func:`check_top`).
    """
    check_top("format_report", top)

    def gib(n: int) -> str:
        # the unit the value reaches once rounded (1,048,575 B is "1.0 MiB", not "1024.0 KiB"); small
        # tensors (ids, shapes) are not "0.0 MiB"
        if round(n / 2**30, 2) >= 1:
            return f"{n / 2**30:.2f} GiB"
        if round(n / 2**20, 1) >= 1:
            return f"{n / 2**20:.1f} MiB"
        return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n:,} B"

    lines = [
        f"{report.path} ({report.format})",
        f"{'globals' if report.format == 'mlir' else 'tensors'}: {len(report.tensors)}, total elements: {report.total_elements:,} = "
        f"{gib(4 * report.total_elements)} fp32; {'declared' if report.no_data else 'tensor data'} {report.total_bytes:,} bytes "
        f"({gib(report.total_bytes)}{'' if report.no_data else '; the files add headers and alignment'})",
        "bytes by dtype: " + ", ".join(f"{k} {gib(v)}" for k, v in report.bytes_by_dtype().items()),
        *([f"largest {min(top, len(report.tensors))}:"] if top > 0 else []),
    ]
    total = max(report.total_bytes, 1)
    for t in sorted(report.tensors, key=lambda t: -t.nbytes)[:top]:
        lines.append(f"  {t.name:<48} {str(list(t.shape)):<20} {t.dtype:<8} {t.nbytes:>14,} B {100 * t.nbytes / total:5.1f}%")
    if report.duplicates:
        wasted = sum(g.wasted_bytes for g in report.duplicates)
        lines.append(f"duplicates: {len(report.duplicates)} group(s), {wasted:,} bytes wasted ({100 * wasted / total:.1f}%)")
        for g in report.duplicates:
            lines.append(f"  {g.kind}: {', '.join(g.names)} — one table stored {g.count} times "
                         f"({100 * g.nbytes_each / total:.1f}% each)")
    elif report.no_data:
        lines.append(f"duplicates: not searched, no data was read ({report.no_data})")
    else:
        lines.append("duplicates: none")
    if report.note:
        lines.append(f"note: {report.note}")
    if report.consumers and top > 0:  # "--top 0": no list, and no heading over an empty one
        shown_count = min(top, len(report.tensors))
        lines.append(f"consumers of the largest {shown_count} initializer{'' if shown_count == 1 else 's'}:")
        for t in sorted(report.tensors, key=lambda t: -t.nbytes)[:top]:
            if t.name in report.consumers:
                ops = report.consumers[t.name]
                shared = " (shared by a lookup and a matmul)" if _is_shared_table(ops) else ""
                lines.append(f"  {t.name}: {', '.join(ops) or '(unused)'}{shared}")
    return "\n".join(lines)
