"""Hostile GGUF files: each gets a FormatError naming the file and the field or tensor, before
gguf-py parses anything."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest

from gemma_export.errors import FormatError
from gemma_export.sources.gguf_header import validate_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "good.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_uint32("gemma3.block_count", 1)
    w.add_token_list(["<pad>", "<eos>", "a", "b"])
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    q = gguf.quants.quantize(np.ones((8, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def _check(tmp_path, data: bytes, words: str):
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(FormatError) as info:
        validate_gguf(path)
    assert str(path) in str(info.value) and words in str(info.value), str(info.value)


def test_good_file_passes(tmp_path, good):
    (tmp_path / "ok.gguf").write_bytes(good)
    validate_gguf(tmp_path / "ok.gguf")


@pytest.mark.parametrize("cut", [0, 10, 23, 40, 120, -1, -300])
def test_truncated(tmp_path, good, cut):
    _check(tmp_path, good[:cut], "too short" if 0 <= cut < 24 else "truncated")


@pytest.mark.parametrize("patch, words", [
    (lambda b: b"GGUX" + b[4:], "bad magic"),
    (lambda b: b[:4] + struct.pack("<I", 7) + b[8:], "GGUF version 7"),
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


def test_export_reports_truncated_gguf(tmp_path, good):
    from typer.testing import CliRunner

    from gemma_export.cli import app

    (tmp_path / "t.gguf").write_bytes(good[:-100])
    result = CliRunner().invoke(app, ["--source", str(tmp_path / "t.gguf"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "truncated" in result.stderr and not (tmp_path / "out").exists()
