"""Hostile GGUF files: each gets a FormatError naming the file and the field or tensor, before
gguf-py parses anything."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from gemma_export.errors import FormatError
from gemma_export.sources.gguf_header import read_gguf_header


def _written(path, add) -> bytes:
    """The bytes of a GGUF file gguf-py writes at ``path`` after ``add(writer)`` adds its fields."""
    w = gguf.GGUFWriter(str(path), "gemma3")
    add(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _good_fields(w) -> None:
    w.add_uint32("gemma3.block_count", 1)
    w.add_token_list(["<pad>", "<eos>", "a", "b"])
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    q = gguf.quants.quantize(np.ones((8, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return _written(tmp_path_factory.mktemp("gguf") / "good.gguf", _good_fields)


def _check(tmp_path, data: bytes, words: str):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(FormatError) as info:
        read_gguf_header(path)
    assert str(path) in str(info.value) and words in str(info.value), str(info.value)


def test_good_file_is_read_as_gguf_py_reads_it(tmp_path, good):
    """Metadata, tensor names, dims, types and data offsets equal gguf-py's own reader's."""
    path = tmp_path / "ok.gguf"
    path.write_bytes(good)
    header = read_gguf_header(path)
    reader = gguf.GGUFReader(str(path), "r")
    assert header.metadata["gemma3.block_count"] == 1
    assert header.metadata["tokenizer.ggml.tokens"] == ["<pad>", "<eos>", "a", "b"]
    assert header.metadata["general.architecture"] == "gemma3"
    assert {k: reader.fields[k].contents() for k in reader.fields if not k.startswith("GGUF.")} == header.metadata
    assert [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
            for t in reader.tensors] == [(t.name, t.dims, t.ggml_type, t.offset, t.n_bytes) for t in header.tensors]
    assert header.tensors[1].dims == (64, 8) and header.tensors[1].n_bytes == 8 * 2 * 34  # two Q8_0 blocks a row


def test_duplicated_names(tmp_path):
    """gguf-py refuses a tensor name or a metadata key that appears twice; so does the walk, by name."""
    def add(w):
        w.add_uint32("dup.key.one", 1)
        w.add_uint32("dup.key.two", 2)
        w.add_tensor("dup.tensor.one", np.ones((2, 32), np.float32))
        w.add_tensor("dup.tensor.two", np.ones((2, 32), np.float32))

    data = _written(tmp_path / "dup.gguf", add)
    assert data.count(b"dup.key.two") == 1 and data.count(b"dup.tensor.two") == 1
    _check(tmp_path, data.replace(b"dup.key.two", b"dup.key.one"), "metadata key 'dup.key.one' appears twice")
    _check(tmp_path, data.replace(b"dup.tensor.two", b"dup.tensor.one"), "tensor 'dup.tensor.one' appears twice")


@pytest.mark.parametrize("cut", [0, 10, 23, 40, 120, -1, -300])
def test_truncated(tmp_path, good, cut):
    _check(tmp_path, good[:cut], "too short" if 0 <= cut < 24 else "truncated")


@pytest.mark.parametrize("patch, words", [
    (lambda b: b"GGUX" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "GGUF version 7, expected 2 or 3"),
    # a break-it run: big-endian (gguf-py's --bigendian) read as "version 50331648" and nothing more
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], "GGUF version 50331648, expected 2 or 3 (read the other way round "
                                                     "it is 3: a big-endian GGUF"),
    (lambda b: b[:8] + struct.pack("<Q", 2**62) + b[16:], "tensors / "),
    (lambda b: b[:16] + struct.pack("<Q", 2**62) + b[24:], "metadata entries"),
    (lambda b: b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40), "limit"),
    (lambda b: b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99), "unknown value type 99"),
    (lambda b: b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2) + b"\xff\xfe", "is not UTF-8"),
])
def test_forged_headers(tmp_path, good, patch, words):
    _check(tmp_path, patch(good), words)


def test_unknown_ggml_type_and_misaligned_offset(tmp_path, good):
    name = b"blk.0.attn_q.weight"
    at = good.index(name) + len(name)
    # tensor info after the name: n_dims u32, 2 × u64 dims, type u32, offset u64
    type_at = at + 4 + 16
    _check(tmp_path, good[:type_at] + struct.pack("<I", 4242) + good[type_at + 4:], "unknown ggml type 4242")
    offset_at = type_at + 4
    offset = struct.unpack("<Q", good[offset_at:offset_at + 8])[0]
    _check(tmp_path, good[:offset_at] + struct.pack("<Q", offset + 1) + good[offset_at + 8:], "is not a multiple of 32")
    # n_dims beyond ggml's 4 is named as such, not as the type read from the shifted bytes (probe finding)
    for n_dims in (0, 5, 8):
        _check(tmp_path, good[:at] + struct.pack("<I", n_dims) + good[at + 4:],
               f"tensor 'blk.0.attn_q.weight' has n_dims {n_dims}, expected 1 to 4 (ggml's limit)")


def test_export_reports_truncated_gguf(tmp_path, good):
    from typer.testing import CliRunner

    from gemma_export.cli import app

    (tmp_path / "t.gguf").write_bytes(good[:-100])
    result = CliRunner().invoke(app, ["--source", str(tmp_path / "t.gguf"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "truncated" in result.stderr and not (tmp_path / "out").exists()


def test_a_tensor_that_overlaps_the_previous_one_is_refused(tmp_path):
    """Offsets must not make two tensors share bytes, not even one: an int8 tensor of 33 bytes at
    offset 0 and the next one moved from offset 64 to 32 (aligned, but inside the first's last byte)."""
    path = tmp_path / "overlap.gguf"
    data = _written(path, lambda w: (w.add_tensor("first", np.ones(33, np.int8)),
                                     w.add_tensor("second", np.ones(8, np.float32))))
    at = data.index(b"second") + len(b"second") + 4 + 8 + 4  # n_dims, one dim, type: then the offset
    assert struct.unpack("<Q", data[at:at + 8])[0] == 64
    read_gguf_header(path)  # as written: no overlap
    _check(tmp_path, data[:at] + struct.pack("<Q", 32) + data[at + 8:],
           "tensor 'second' at offset 32 overlaps the previous tensor")


def test_an_alignment_that_is_no_power_of_two_is_refused(tmp_path):
    """general.alignment must be a power of two (ggml's gguf.md); it was only tested as another value
    type, never as a uint32 that is no power of two (gguf-py will not write one: patched in)."""
    path = tmp_path / "a64.gguf"
    data = _written(path, lambda w: (w.add_custom_alignment(64), w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))))
    at = data.index(b"general.alignment") + len(b"general.alignment")
    assert struct.unpack("<II", data[at:at + 8]) == (4, 64)  # uint32 64
    read_gguf_header(path)
    for value in (48, 96):  # a tensor offset of 0 is a multiple of either: only the rule refuses them
        _check(tmp_path, data[:at + 4] + struct.pack("<I", value) + data[at + 8:],
               f"general.alignment {value} is not a power of two")
