"""Validate a safetensors header before any tensor is read, with errors that name the tensor.

Format (safetensors' README): an unsigned little-endian 64-bit header length ``N``, ``N`` bytes of
JSON mapping each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the byte after the header), optional ``"__metadata__"``, then the data. Every check is
done with Python integers against the real file size before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from pathlib import Path

import numpy as np

from ..errors import FormatError, is_whole_number

#: numpy element type of each safetensors dtype (BF16 as its raw bits: plain numpy has no bfloat16)
NUMPY_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64,
    "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
#: bytes per element of each safetensors dtype
DTYPE_BYTES = {name: np.dtype(t).itemsize for name, t in NUMPY_DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


def looks_like_safetensors(first_bytes: bytes) -> bool:
    """Whether a file's first 9 bytes open a safetensors file: a little-endian u64 header length,
    then the header's ``{``. A header length below 2**56 has a zero top byte, which text (an MLIR
    file whose ninth character is ``{``) never has."""
    return len(first_bytes) >= 9 and first_bytes[8:9] == b"{" and b"\x00" in first_bytes[:8]



@dataclasses.dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: absolute byte ``offset`` of its data and ``nbytes``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _no_duplicates(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise FormatError(f"duplicate tensor name '{key}' in the header")
        seen[key] = value
    return seen


def read_header(path: Path, layout: bool = True) -> list[HeaderEntry]:
    """Parse and validate the header of ``path``.

    Args:
        layout: also check that the tensors tile the data section (no overlap, no gap, all of it);
            False leaves that to a later call, for a caller that first checks the names.

    Raises:
        FormatError: too short, header length beyond the file or 100 MiB, not JSON, a duplicate
            name, a missing field, an unknown dtype, a negative dim, offsets that disagree with
            shape × dtype, overlap, leave gaps or do not cover the data exactly.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FormatError(f"{path}: {size} bytes, too short for a safetensors header (8-byte length)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise FormatError(f"{path}: not a safetensors file: its first 8 bytes give a header length of "
                              f"{header_len:,}, beyond the file ({size:,} bytes) or 100 MiB")
        raw = f.read(header_len)
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except FormatError as exc:
        raise FormatError(f"{path}: {exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: safetensors header is not JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    data_bytes = size - 8 - header_len
    entries = []
    for name, info in header.items():
        if name == "__metadata__":  # the format allows a string → string map only
            if not isinstance(info, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in info.items()):
                raise FormatError(f"{path}: '__metadata__' must map strings to strings, found {str(info)[:80]}")
            continue
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
            if not all(is_whole_number(d) for d in [*shape, *offsets]) or len(offsets) != 2:
                raise TypeError
        except (KeyError, TypeError):
            raise FormatError(f"{path}: tensor '{name}' lacks an integer shape, data_offsets or a dtype") from None
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise FormatError(f"{path}: tensor '{name}' has unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise FormatError(f"{path}: tensor '{name}' has a negative dimension in {shape}")
        begin, end = offsets
        expected = math.prod(shape) * DTYPE_BYTES[dtype]
        if not 0 <= begin <= end <= data_bytes:
            raise FormatError(f"{path}: tensor '{name}' data [{begin}, {end}) lies outside the {data_bytes} data bytes")
        if end - begin != expected:
            raise FormatError(f"{path}: tensor '{name}' holds {end - begin} bytes, shape {shape} × {dtype} needs {expected}")
        entries.append(HeaderEntry(name, dtype, tuple(shape), 8 + header_len + begin, end - begin))
    if not layout:
        return entries
    position = 0
    for e in sorted(entries, key=lambda e: e.offset):
        begin = e.offset - 8 - header_len
        if begin != position:
            what = "overlaps the previous tensor" if begin < position else f"leaves a gap of {begin - position} bytes"
            raise FormatError(f"{path}: tensor '{e.name}' at offset {begin} {what}")
        position = begin + e.nbytes
    if position != data_bytes:
        raise FormatError(f"{path}: tensors cover {position} of the {data_bytes} data bytes (truncated or trailing data)")
    return entries
