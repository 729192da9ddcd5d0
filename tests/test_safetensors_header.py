"""Hostile safetensors headers: each gets a FormatError naming the file and the tensor."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from gemma_export.errors import FormatError
from gemma_export.sources.safetensors_header import read_header


def _write(path, header: dict | bytes, data: bytes, length: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}


@pytest.mark.parametrize("header, data, length, words", [
    (GOOD, b"\0" * 23, None, "tensor 'b' data [16, 24) lies outside the 23 data bytes"),
    (GOOD, b"\0" * 25, None, "tensors cover 24 of the 25 data bytes"),
    (GOOD, b"\0" * 24, 10**6, "not a safetensors file: its first 8 bytes give a header length of 1,000,000, beyond the file"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}',
     b"\0" * 8, None, "duplicate tensor name 'a'"),
    ({**GOOD, "b": {"dtype": "F32", "shape": [3], "data_offsets": [16, 24]}}, b"\0" * 24, None,
     "tensor 'b' holds 8 bytes, shape [3] × F32 needs 12"),
    ({"a": GOOD["a"], "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}, b"\0" * 20, None, "tensor 'b' at offset 12 overlaps"),
    ({"a": GOOD["a"], "b": {"dtype": "F32", "shape": [2], "data_offsets": [20, 28]}}, b"\0" * 28, None, "tensor 'b' at offset 20 leaves a gap of 4 bytes"),
    ({**GOOD, "b": {"dtype": "Q4X", "shape": [2], "data_offsets": [16, 24]}}, b"\0" * 24, None, "tensor 'b' has unknown dtype 'Q4X'"),
    ({**GOOD, "b": {"dtype": "F32", "shape": [-2], "data_offsets": [16, 24]}}, b"\0" * 24, None, "negative dimension"),
    ({**GOOD, "b": {"dtype": "F32", "shape": "2", "data_offsets": [16, 24]}}, b"\0" * 24, None, "tensor 'b' lacks an integer shape"),
    (b"{not json", b"", None, "header is not JSON"),
    (b"[1, 2]", b"", None, "not a JSON object"),
])
def test_bad_header(tmp_path, header, data, length, words):
    path = _write(tmp_path / "x.safetensors", header, data, length)
    with pytest.raises(FormatError) as info:
        read_header(path)
    assert str(path) in str(info.value) and words in str(info.value)


def test_valid_file_and_truncations(tmp_path):
    path = tmp_path / "ok.safetensors"
    save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "n": np.ones(5, np.float32)}, str(path))
    entries = {e.name: e for e in read_header(path)}
    assert entries["w"].shape == (3, 4) and entries["w"].nbytes == 48 and entries["n"].nbytes == 20
    raw = path.read_bytes()
    cut_path = tmp_path / "cut.safetensors"
    for cut, words in ((0, "0 bytes, too short for a safetensors header"), (4, "4 bytes, too short"),
                       (9, "beyond the file (9 bytes)"), (len(raw) - 1, "lies outside the")):
        cut_path.write_bytes(raw[:cut])
        with pytest.raises(FormatError) as info:
            read_header(cut_path)
        assert str(info.value).startswith(f"{cut_path}: ") and words in str(info.value), (cut, str(info.value))


def test_a_header_length_a_few_bytes_past_the_end_is_named_as_such(tmp_path):
    """The length field is checked against the bytes after it (size - 8), not the whole file: a
    header that ends 3 bytes past the end of the file (the JSON itself complete) is "beyond the file",
    not "data [0, 16) lies outside the -3 data bytes"."""
    raw = json.dumps(GOOD).encode()
    path = _write(tmp_path / "x.safetensors", raw, b"", length=len(raw) + 3)
    with pytest.raises(FormatError, match=rf"its first 8 bytes give a header length of {len(raw) + 3:,}, beyond the file "
                                          rf"\({len(raw) + 8:,} bytes\)"):
        read_header(path)
