"""tools/bench_breakdown.py: the graph surgery behind docs/benchmarks.md's time breakdown."""

from __future__ import annotations

import numpy as np
import onnx

import bench_breakdown
from gemma_export.runtime import KVCache, OnnxDecoder


def _logits(folder, ids):
    decoder = OnnxDecoder(folder, threads=1, prepacked=False)
    cache = KVCache(decoder, 1, len(ids))
    x = np.asarray([ids], np.int64)
    return cache.step(x, np.ones_like(x), np.arange(len(ids))[None])


def test_variants_replace_the_head_or_every_matmulnbits(tiny_int8_export, tmp_path):
    graph = onnx.load(str(tiny_int8_export / "model.onnx"), load_external_data=False).graph
    total = sum(n.op_type == "MatMulNBits" for n in graph.node)
    vocab = OnnxDecoder(tiny_int8_export, threads=1, prepacked=False).vocab_size
    assert bench_breakdown.make_variant(tiny_int8_export, tmp_path / "head", "head", vocab) == 1
    assert bench_breakdown.make_variant(tiny_int8_export, tmp_path / "all", "all", vocab) == total > 1
    for name, left in (("head", total - 1), ("all", 0)):
        variant = onnx.load(str(tmp_path / name / "model.onnx"), load_external_data=False).graph
        assert sum(n.op_type == "MatMulNBits" for n in variant.node) == left
    ids = [2, 10, 11, 12, 13]
    exported = _logits(tiny_int8_export, ids)
    for name in ("head", "all"):
        out = _logits(tmp_path / name, ids)
        # same shape, other numbers: the replaced nodes no longer compute the product
        assert out.shape == exported.shape and not np.allclose(out, exported)
    # the original folder is untouched
    assert sum(n.op_type == "MatMulNBits" for n in onnx.load(str(tiny_int8_export / "model.onnx"),
                                                              load_external_data=False).graph.node) == total


def test_main_prints_the_three_rows(tiny_int8_export, capsys):
    graph = onnx.load(str(tiny_int8_export / "model.onnx"), load_external_data=False).graph
    total = sum(n.op_type == "MatMulNBits" for n in graph.node)
    assert bench_breakdown.main(["--model", str(tiny_int8_export), "--rounds", "1", "--prompt-tokens", "8",
                                 "--new-tokens", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "ms/token" not in line]
    assert [r.split(" | ")[0] for r in rows] == ["| the export", "| LM head replaced", f"| all {total} MatMulNBits replaced"]
    assert "head ≈" in out and "layer projections ≈" in out


def test_an_export_without_matmulnbits_is_refused(tiny_dir, tmp_path, capsys):
    from gemma_export.exporter import export

    fp32 = export(tiny_dir, tmp_path / "fp32", "fp32").out_dir
    assert bench_breakdown.main(["--model", str(fp32)]) == 2
    assert "has no MatMulNBits to replace" in capsys.readouterr().err
