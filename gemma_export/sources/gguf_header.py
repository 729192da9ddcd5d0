"""Walk a GGUF header, check every count, length, offset and size against the file and hard caps,
and return its metadata and tensor infos (gguf-py's ``GGUFReader`` trusts the header, where a forged
count makes it allocate or fail with numpy internals, and it keeps every element of the 262,144-token
vocabulary as a numpy view: 20–35 s to open Gemma 3 270M against under 1 s here). The tensors'
bytes are then dequantized by gguf-py (``gemma_export.sources.gguf``).

Layout (ggml's ``docs/gguf.md``, versions 2 and 3): magic ``GGUF``, uint32 version, uint64 tensor
count, uint64 metadata count; metadata ``(string key, uint32 type, value)``; tensor infos
``(string name, uint32 n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset)``; padding to
``general.alignment`` (default 32); tensor data, each tensor at an aligned offset from there.
Strings are a uint64 length then UTF-8 bytes. All integers are little-endian.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np

from ..errors import FormatError

#: ggml types stored as plain numpy elements (every other type is blocks of bytes; BF16 too, which
#: gguf-py dequantizes like a block type)
PLAIN_GGML_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                    "I32": np.int32, "I64": np.int64}

MAX_TENSORS = 1 << 20
MAX_METADATA = 1 << 20
MAX_STRING_BYTES = 1 << 24
MAX_ARRAY_ITEMS = 1 << 26
#: dimensions of a tensor: GGUF's spec and ggml's GGML_MAX_DIMS allow at most 4 (a 5 read from a damaged
#: file shifted every later field, and the message then named a type read from a dim's bytes)
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
#: metadata value type → struct format of a scalar (8 = string, 9 = array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4


class _Cursor:
    def __init__(self, data, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise FormatError(f"{self.path}: truncated: {what} needs {n} bytes at offset {self.pos}, "
                              f"the file has {len(self.data)}")
        chunk = self.data[self.pos:self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} length")
        if n > MAX_STRING_BYTES:
            raise FormatError(f"{self.path}: {what} is {n} bytes long, limit {MAX_STRING_BYTES}")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {what} at offset {self.pos - n} is not UTF-8") from None

    def value(self, kind: int, what: str) -> object:
        """A metadata value: a Python scalar, a str, a list of str, or a 1-D numpy array of numbers
        (not a list: a list of 2^25 floats would take 1.6 GB)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind], what)
        if kind == _STRING:
            return self.string(what)
        if kind == _ARRAY:
            item_kind = self.unpack("<I", f"{what} item type")
            count = self.unpack("<Q", f"{what} item count")
            if count > MAX_ARRAY_ITEMS:
                raise FormatError(f"{self.path}: {what} has {count} items, limit {MAX_ARRAY_ITEMS}")
            if item_kind in _SCALARS:
                fmt = _SCALARS[item_kind]
                return np.frombuffer(self.take(count * struct.calcsize(fmt), what), dtype=np.dtype(fmt))
            if item_kind == _STRING:
                return [self.string(f"{what}[{i}]") for i in range(count)]
            raise FormatError(f"{self.path}: {what} has unsupported array item type {item_kind}")
        raise FormatError(f"{self.path}: {what} has unknown value type {kind}")


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor info of a GGUF header.

    Attributes:
        name: the GGUF tensor name (``token_embd.weight``, ``blk.0.attn_q.weight``, ...).
        dims: GGUF order, fastest-varying (``ne0``) first; the numpy shape is ``dims`` reversed.
        ggml_type: the ``gguf.GGMLQuantizationType`` of the data.
        offset: byte offset of the data in the file (the header's offset plus the data section's start).
        n_bytes: bytes of data.
    """

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int
    n_bytes: int


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    """A checked GGUF header: ``metadata`` (key → value, as :meth:`_Cursor.value` returns them:
    numeric arrays as numpy) and ``tensors`` in file order."""

    metadata: dict[str, object]
    tensors: list[GGUFTensorInfo]


def read_gguf_header(path: Path) -> GGUFHeader:
    """Read and check a GGUF file's header and tensor layout.

    Raises:
        FormatError: bad magic or version, counts or lengths beyond the caps or the file, an unknown
            value or ggml type, a string that is not UTF-8, a tensor whose data is misaligned,
            overlaps another or runs past the end.
    """
    import gguf

    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise FormatError(f"{path}: {size} bytes, too short for a GGUF header (24)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        c = _Cursor(data, path)
        if c.take(4, "magic") != b"GGUF":
            raise FormatError(f"{path}: bad magic {bytes(data[:4])!r}, expected b'GGUF'")
        version = c.unpack("<I", "version")
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            other_order = (f" (read the other way round it is {swapped}: a big-endian GGUF, which this reader does "
                           "not take; llama.cpp's gguf-py writes little-endian by default)") if swapped in (2, 3) else ""
            raise FormatError(f"{path}: GGUF version {version}, expected 2 or 3{other_order}")
        n_tensors, n_meta = c.unpack("<Q", "tensor count"), c.unpack("<Q", "metadata count")
        if n_tensors > MAX_TENSORS or n_meta > MAX_METADATA:
            raise FormatError(f"{path}: {n_tensors} tensors / {n_meta} metadata entries, limits {MAX_TENSORS} / {MAX_METADATA}")
        alignment = DEFAULT_ALIGNMENT
        metadata: dict[str, object] = {}
        for i in range(n_meta):
            key = c.string(f"metadata key #{i}")
            kind = c.unpack("<I", f"type of '{key}'")
            if key in metadata:
                raise FormatError(f"{path}: metadata key '{key}' appears twice")
            value = metadata[key] = c.value(kind, f"metadata '{key}'")
            if key == "general.alignment":
                if kind != _UINT32:
                    raise FormatError(f"{path}: general.alignment has value type {kind}, expected {_UINT32} (uint32)")
                if value <= 0 or value & (value - 1):
                    raise FormatError(f"{path}: general.alignment {value!r} is not a power of two")
                alignment = value
        tensors, names = [], set()
        for i in range(n_tensors):
            name = c.string(f"tensor name #{i}")
            if name in names:
                raise FormatError(f"{path}: tensor '{name}' appears twice")
            names.add(name)
            n_dims = c.unpack("<I", f"dims of '{name}'")
            if not 1 <= n_dims <= MAX_DIMS:
                raise FormatError(f"{path}: tensor '{name}' has n_dims {n_dims}, expected 1 to {MAX_DIMS} (ggml's limit)")
            dims = [c.unpack("<Q", f"dim of '{name}'") for _ in range(n_dims)]
            kind = c.unpack("<I", f"type of '{name}'")
            offset = c.unpack("<Q", f"offset of '{name}'")
            try:
                block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            except (ValueError, KeyError):
                raise FormatError(f"{path}: tensor '{name}' has unknown ggml type {kind}") from None
            elements = 1
            for d in dims:
                elements *= d
            if elements > 1 << 40:
                raise FormatError(f"{path}: tensor '{name}' dims {dims} hold {elements:,} elements, limit {1 << 40:,}")
            if dims[0] % block:
                raise FormatError(f"{path}: tensor '{name}' first dim {dims[0]} is not a multiple of ggml type {kind}'s block of {block}")
            tensors.append((offset, elements // block * type_bytes, name, tuple(dims), kind))
        data_start = -(-c.pos // alignment) * alignment
        position = 0
        for offset, nbytes, name, _, _ in sorted(tensors):
            if offset % alignment:
                raise FormatError(f"{path}: tensor '{name}' offset {offset} is not a multiple of {alignment}")
            if offset < position:
                raise FormatError(f"{path}: tensor '{name}' at offset {offset} overlaps the previous tensor")
            if data_start + offset + nbytes > size:
                raise FormatError(f"{path}: tensor '{name}' ends at byte {data_start + offset + nbytes}, "
                                  f"past the end of the file ({size} bytes): truncated")
            position = offset + nbytes
    return GGUFHeader(metadata, [GGUFTensorInfo(name, dims, kind, data_start + offset, nbytes)
                                 for offset, nbytes, name, dims, kind in tensors])

