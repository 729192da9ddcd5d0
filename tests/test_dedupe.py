"""`gemma-export dedupe`: one table after rewriting other exporters' models, outputs unchanged."""

from __future__ import annotations

import importlib
import json
import math
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from gemma_export.cli import app

V, H = 1024, 64


def _optimized_tables(path, tmp_path, elements):
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    graph = onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph
    return sum(1 for t in graph.initializer if math.prod(t.dims) == elements)


def _save(graph, path):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=1024)
    return path


def _lm(table_for_head, head_op="Gemm", transpose_node=False):
    table = np.random.default_rng(0).standard_normal((V, H)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["emb"]),
             helper.make_node("ReduceMean", ["emb"], ["x"], axes=[1], keepdims=0)]
    inits = [numpy_helper.from_array(table, "table")]
    if transpose_node:
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["x", "table_t"], ["logits"])]
    elif head_op == "MatMul":
        inits.append(numpy_helper.from_array(table_for_head(table), "head_t"))
        nodes.append(helper.make_node("MatMul", ["x", "head_t"], ["logits"]))
    else:
        inits.append(numpy_helper.from_array(table_for_head(table), "head"))
        nodes.append(helper.make_node("Gemm", ["x", "head"], ["logits"], transB=1))
    return helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                             [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], inits)


@pytest.mark.parametrize("case, graph", [
    ("identical copy", _lm(lambda t: t.copy())),
    ("pre-transposed copy", _lm(lambda t: t.T.copy(), head_op="MatMul")),
    ("shared through Transpose", _lm(None, transpose_node=True)),
])
def test_dedupe_leaves_one_table(tmp_path, case, graph):
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    before_bytes = (tmp_path / "in" / "model.onnx.data").stat().st_size
    assert _optimized_tables(src, tmp_path, V * H) == 2  # onnxruntime holds two copies
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "max |diff| 0" in result.stdout
    assert _optimized_tables(out / "model.onnx", tmp_path, V * H) == 1
    after_bytes = (out / "model.onnx.data").stat().st_size
    if case == "shared through Transpose":  # nothing removed from disk: the message says what changed
        assert ("removed 0 initializer(s) (-), 0 bytes; rewrote 1 MatMul(s) as Gemm(transB=1) (the file stored the "
                "table once, but onnxruntime kept a second, transposed copy for the MatMul: now it keeps one)"
                in result.stdout)
    else:
        assert before_bytes - after_bytes >= V * H * 4  # the copy is gone from disk
        # the lookup's copy is kept, the head's removed, and the report counts its bytes
        assert f"removed 1 initializer(s) ({'head' if case == 'identical copy' else 'head_t'}), {V * H * 4:,} bytes" \
            in result.stdout
    ids = np.array([[1, 5, 1000]], dtype=np.int64)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]  # noqa: E731
    assert np.array_equal(run(src), run(out / "model.onnx"))


def test_inspect_takes_the_output_folder_whose_one_graph_keeps_the_input_s_name(tmp_path):
    """A fresh user's finding: `inspect deduped/` failed, the folder holding other.onnx, not model.onnx."""
    (tmp_path / "in").mkdir()
    src = _save(_lm(lambda t: t.copy()), tmp_path / "in" / "other.onnx")
    out = tmp_path / "deduped"
    assert CliRunner().invoke(app, ["dedupe", str(src), "--out", str(out)]).exit_code == 0
    report = CliRunner().invoke(app, ["inspect", str(out), "--json"])
    assert report.exit_code == 0, report.output
    assert json.loads(report.stdout)["path"] == str(out / "other.onnx") and json.loads(report.stdout)["duplicates"] == []
    (out / "second.onnx").write_bytes((out / "other.onnx").read_bytes())  # two graphs: which one is not guessed
    refused = CliRunner().invoke(app, ["inspect", str(out)])
    assert refused.exit_code == 2 and f"{out}: is a folder; expected a .onnx" in refused.output


def test_too_little_free_space_is_refused_before_the_rewrite(tmp_path, monkeypatch):
    """Probe finding: dedupe found a full disk only after the whole rewrite; export, bundle and
    prepack refuse first. What it needs is the tensors that remain: one table, not two."""
    import shutil as shutil_module

    from gemma_export import dedupe

    (tmp_path / "in").mkdir()
    src = _save(_lm(lambda t: t.copy()), tmp_path / "in" / "model.onnx")
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda _p: usage._replace(free=V * H * 4 - 1))
    monkeypatch.setattr(dedupe, "_compare", lambda *a: pytest.fail("the model was rewritten before the check"))
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "the deduplicated model needs about" in result.output, result.output
    assert not (tmp_path / "out").exists()
    # room for the one table that remains (plus the small rest) is enough: the copy does not count
    monkeypatch.undo()
    monkeypatch.setattr(shutil_module, "disk_usage", lambda _p: usage._replace(free=V * H * 4 + (1 << 20)))
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("graph", [_lm(lambda t: t + np.float32(1e-3)),
                                   _lm(lambda t: (t + np.float32(1e-3)).T.copy(), head_op="MatMul")],
                         ids=["same layout", "transposed"])
@pytest.mark.parametrize("chunk_bytes", [8 << 20, 4096], ids=["one block", "many blocks"])
def test_near_duplicate_is_refused(tmp_path, monkeypatch, graph, chunk_bytes):
    from gemma_export import dedupe

    monkeypatch.setattr(dedupe, "CHUNK_BYTES", chunk_bytes)  # the tables are compared a block of rows at a time
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "close but not identical" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_different_table_of_the_same_shape_is_not_a_near_duplicate(tmp_path, monkeypatch):
    from gemma_export import dedupe

    monkeypatch.setattr(dedupe, "CHUNK_BYTES", 4096)
    # one value off by 2% of the range, in the last block: not "close", so not refused (and not merged)
    graph = _lm(lambda t: np.where(np.arange(t.size).reshape(t.shape) == t.size - 1,
                                   t + np.float32(0.02 * np.abs(t).max()), t).astype(np.float32))
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "no duplicated table and no Transpose-shared table found" in result.stderr


def test_torch_onnx_export_of_tiny_gemma(tmp_path):
    importlib.import_module("onnxscript")  # test extra: fail, do not skip, when missing
    import torch

    from conftest import make_tiny_model

    model = make_tiny_model(vocab_size=512)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids, use_cache=False).logits

    src = tmp_path / "torch" / "model.onnx"
    src.parent.mkdir()
    ids = torch.randint(3, 512, (1, 8))
    torch.onnx.export(Logits(model).eval(), (ids,), str(src), input_names=["input_ids"], output_names=["logits"], dynamo=True)
    assert _optimized_tables(src, tmp_path, 512 * 64) == 2
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert _optimized_tables(out / "model.onnx", tmp_path, 512 * 64) == 1
    feeds = {"input_ids": ids.numpy()}
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    b = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    assert np.abs(a - b).max() <= 1e-4


def _graph(nodes, tables, outputs=("logits",)):
    return helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
                             [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                             [numpy_helper.from_array(t, n) for n, t in tables.items()])


def _dedupe(tmp_path, graph):
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    return src, CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])


def _same_outputs(src, out, rows):
    """The input and the rewritten model give the same outputs (NaN where NaN), run here with
    onnxruntime on ids of the table's own ``rows``: not only dedupe's own report."""
    feeds = {"input_ids": np.random.default_rng(5).integers(0, rows, (2, 3))}
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    b = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feeds)
    assert len(a) == len(b) and all(np.array_equal(x, y, equal_nan=True) for x, y in zip(a, b))


def test_unnamed_matmuls_sharing_one_transposed_copy_are_each_rewritten(tmp_path):
    # helper-found: the rewrites of two MatMuls without names gave their constants one name (a traceback)
    table = np.random.default_rng(1).standard_normal((V, H)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("MatMul", ["x", "L"], ["a"]),
             helper.make_node("MatMul", ["x", "L"], ["b"]), helper.make_node("Add", ["a", "b"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "L": table.T.copy()}))
    assert result.exit_code == 0, result.output
    assert "rewrote 2 MatMul(s)" in result.stdout and "max |diff| 0" in result.stdout
    assert _optimized_tables(tmp_path / "out" / "model.onnx", tmp_path, V * H) == 1
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


def test_a_transposed_table_that_is_a_graph_output_is_left_alone(tmp_path):
    table = np.random.default_rng(2).standard_normal((V, H)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("Transpose", ["E"], ["Et"]),
             helper.make_node("MatMul", ["x", "Et"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table}, outputs=("logits", "Et")))
    assert result.exit_code == 2 and "nothing to do" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_a_wide_table_is_checked_with_ids_of_its_own_rows(tmp_path):
    # the random ids came from the longest first axis of any table (the transposed copy's 40,000):
    # outside the 4-row table the Gather reads, so onnxruntime refused the original model too
    table = np.random.default_rng(3).standard_normal((4, 40_000)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("MatMul", ["x", "L"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "L": table.T.copy()}))
    assert result.exit_code == 0, result.output
    assert "max |diff| 0" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", 4)


def test_a_small_weight_read_through_a_transpose_is_left_alone(tmp_path):
    # below inspect's MIN_DUPLICATE_BYTES (64 KiB) a Transpose is no duplicated table worth a
    # rewrite: a 96 x 64 float32 weight (24 KiB) stays as it is, and there is nothing to do
    table = np.random.default_rng(6).standard_normal((96, 64)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("Transpose", ["E"], ["Et"]),
             helper.make_node("MatMul", ["x", "Et"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table}))
    assert result.exit_code == 2 and "nothing to do" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_an_exact_transposed_copy_holding_nan_is_merged_not_called_close(tmp_path):
    table = np.random.default_rng(4).standard_normal((V, H)).astype(np.float32)
    table[0, 0] = np.nan
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("MatMul", ["x", "L"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "L": table.T.copy()}))
    assert result.exit_code == 0, result.output
    assert "rewrote 1 MatMul(s)" in result.stdout and "max |diff| 0" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


@pytest.mark.parametrize("out, message", [
    # the finished output replaces --out by a rename: of a link that would replace the link itself
    # (it did, silently), and the current folder cannot be renamed away (it failed after the work)
    ("link", "link: is a symbolic link (to target); give the folder itself"),
    ("dangling", "dangling: is a symbolic link (to nowhere); give the folder itself"),
    (".", ".: is the current folder, which the deduplicated model cannot replace"),
])
def test_dedupe_refuses_an_output_it_cannot_replace_before_the_work(tmp_path, monkeypatch, out, message):
    (tmp_path / "in").mkdir()
    src = _save(_lm(lambda t: t.copy()), tmp_path / "in" / "model.onnx")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here" if out == "." else tmp_path)
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", out])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: {message}" + result.stderr.strip().split(message, 1)[1]]
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()
    assert os.listdir(tmp_path / "target") == [] and os.listdir(tmp_path / "here") == []


def test_outputs_compare_nan_as_equal_only_where_both_are_nan():
    # the check after a rewrite: a NaN the original did not give (or lost one) is infinitely far
    from gemma_export.dedupe import _max_difference

    a = np.array([[1.0, np.nan, 3.0]], np.float32)
    assert _max_difference(a, a.copy()) == 0.0
    assert _max_difference(a, np.array([[1.5, np.nan, 3.0]], np.float32)) == 0.5
    assert _max_difference(a, np.array([[1.0, 2.0, 3.0]], np.float32)) == np.inf
    assert _max_difference(np.array([[1.0, 2.0, 3.0]], np.float32), a) == np.inf
    assert _max_difference(np.zeros((0, 3), np.float32), np.zeros((0, 3), np.float32)) == 0.0


def test_a_copy_a_tenth_of_the_limit_away_is_still_refused_as_close(tmp_path):
    # "close": every value within 1% of the table's range; 0.5% is close, not a different table
    graph = _lm(lambda t: (t + np.float32(0.005) * np.abs(t).max()).astype(np.float32))
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and "close but not identical" in result.stderr


def test_random_ids_fit_the_smallest_gathered_table(tmp_path):
    # two tables read by Gather (the vocabulary and an 8-row one): the check's random ids must be
    # valid rows of both, or onnxruntime refuses to run the original model
    table = np.random.default_rng(7).standard_normal((V, H)).astype(np.float32)
    small = np.random.default_rng(8).standard_normal((8, H)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["a"]), helper.make_node("Gather", ["P", "input_ids"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["x"]), helper.make_node("MatMul", ["x", "L"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "P": small, "L": table.T.copy()}))
    assert result.exit_code == 0, result.output
    assert "rewrote 1 MatMul(s)" in result.stdout and "max |diff| 0" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", 8)


def test_with_no_gather_the_first_of_two_identical_tables_is_kept(tmp_path):
    # neither copy feeds a Gather: every consumer reads the first one, the second is removed
    from gemma_export.dedupe import dedupe

    table = np.random.default_rng(9).standard_normal((H, V)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "A"], ["a"]), helper.make_node("MatMul", ["x", "B"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["logits"])]
    graph = helper.make_graph(nodes, "lm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, H])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(table, "A"), numpy_helper.from_array(table.copy(), "B")])
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = dedupe(src, tmp_path / "out")
    assert result.removed == ["B"] and result.max_abs_diff == 0.0
    kept = [t.name for t in onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.initializer]
    assert kept == ["A"]


def test_an_input_onnxruntime_cannot_run_is_named_not_the_rewritten_model(tmp_path):
    # review-found: any failure while comparing was reported as the rewritten model's
    table = np.random.default_rng(2).standard_normal((V, H)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]),
             helper.make_node("Gemm", ["x", "L"], ["y"], transB=1),
             helper.make_node("NoSuchOp", ["y"], ["logits"], domain="example.missing")]
    graph = _graph(nodes, {"E": table, "L": table.copy()})
    (tmp_path / "in").mkdir()
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.missing", 1)])
    src = tmp_path / "in" / "model.onnx"
    onnx.save(model, str(src), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert f"{src}: onnxruntime cannot load the model" in result.stderr, result.stderr
    assert "rewritten" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_int32_ids_are_fed_as_int32_and_a_failing_run_is_one_line(tmp_path):
    # probe-found: every input that was not int64 got float32 values (an int32 model was blamed), and
    # onnxruntime printed its own error block before the one-line error
    table = np.random.default_rng(3).standard_normal((V, H)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("Gemm", ["x", "L"], ["logits"], transB=1)],
        "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(table.copy(), "L")])
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    ids = np.array([1, 7, V - 1], np.int32)
    run = lambda p: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids})[0]  # noqa: E731
    assert np.array_equal(run(src), run(tmp_path / "out" / "model.onnx"))

    # a model that loads but cannot run on any input: Reshape to 5 values of 7 x V logits
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("Gemm", ["x", "L"], ["y"], transB=1),
         helper.make_node("Reshape", ["y", "five"], ["logits"])],
        "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["n"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(table.copy(), "L"),
         numpy_helper.from_array(np.array([5], np.int64), "five")])
    (tmp_path / "bad").mkdir()
    src = _save(graph, tmp_path / "bad" / "model.onnx")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "from gemma_export.cli import app; app()", "dedupe", str(src),
                           "--out", str(tmp_path / "out2")], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: {src}: onnxruntime cannot run the model on random ids: "), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # onnxruntime's own log stays silent
    assert not (tmp_path / "out2").exists()


def test_dedupe_keeps_the_lookups_copy_when_the_heads_is_declared_first(tmp_path):
    """The head's copy listed before the lookup's in the graph: the copy a Gather reads stays (the
    [vocab, hidden] layout the lookup needs), whatever the order."""
    graph = _lm(lambda t: t.copy())
    head = next(t for t in graph.initializer if t.name == "head")
    ordered = [head] + [t for t in graph.initializer if t.name != "head"]
    del graph.initializer[:]
    graph.initializer.extend(ordered)
    (tmp_path / "in").mkdir()
    src = _save(graph, tmp_path / "in" / "model.onnx")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert "removed 1 initializer(s) (head)," in result.stdout
    kept = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    assert [t.name for t in kept.initializer] == ["table"]


def test_dedupe_replaces_only_an_empty_folder(tmp_path):
    """dedupe writes no listing, so no earlier output of it can be told from a user's folder: a
    non-empty --out is refused with the way out, and left as it was."""
    (tmp_path / "in").mkdir()
    src = _save(_lm(lambda t: t.copy()), tmp_path / "in" / "model.onnx")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {out}: exists and is not an empty folder; choose another folder, or move "
                                     "this one away first")
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    (out / "notes.txt").unlink()  # an empty folder is replaced
    assert CliRunner().invoke(app, ["dedupe", str(src), "--out", str(out)]).exit_code == 0
    assert (out / "model.onnx").is_file()


# ---- a break-it run of the twentieth session -------------------------------------------------------

def _mean(rows: str, out: str):
    """``out [b, H]``: the mean over positions of ``rows [b, s, H]`` (Gemm takes rank 2)."""
    return helper.make_node("ReduceMean", [rows], [out], axes=[1], keepdims=0)


def _table(seed=3):
    return np.random.default_rng(seed).standard_normal((V, H)).astype(np.float32)


def test_one_table_three_times_is_stored_once(tmp_path):
    """A, its copy B (read by the lookup) and D = Aᵀ: the copies' group removed A, and the transposed
    group then looked A up (KeyError)."""
    table = _table()
    nodes = [helper.make_node("Gather", ["B", "input_ids"], ["emb"]), _mean("emb", "x"),
             helper.make_node("Gemm", ["x", "A"], ["a"], transB=1),
             helper.make_node("MatMul", ["x", "D"], ["d"]), helper.make_node("Add", ["a", "d"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"A": table, "B": table.copy(), "D": table.T.copy()}))
    assert result.exit_code == 0, result.output
    assert "removed 2 initializer(s) (A, D)" in result.stdout and "rewrote 1 MatMul(s)" in result.stdout
    assert _optimized_tables(tmp_path / "out" / "model.onnx", tmp_path, V * H) == 1
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


def test_a_copy_that_is_a_graph_output_is_refused_in_one_line(tmp_path):
    table = _table()
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"]), _mean("emb", "x"),
             helper.make_node("Gemm", ["x", "L"], ["logits"], transB=1)]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "L": table.copy()}, outputs=("logits", "L")))
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {src}: 'L' (a copy of 'E') is also an output of the graph, which must "
                                     "keep giving it; not rewritten")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shared", ["transposed copy", "Transpose"])
def test_a_head_inside_an_if_branch_is_rewritten_there(tmp_path, shared):
    """Merged decoders put the head in If branches: the rewrite inserted its nodes into the main
    graph beside a MatMul of the subgraph (ValueError)."""
    table = _table()
    branch_nodes = ([helper.make_node("MatMul", ["x", "Lt"], ["y"])] if shared == "transposed copy" else
                    [helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Et"], ["y"])])
    branch = helper.make_graph(branch_nodes, "head", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "none", [],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]),
             helper.make_node("ReduceSum", ["input_ids"], ["total"], keepdims=0),
             helper.make_node("Cast", ["total"], ["cond"], to=TensorProto.BOOL),
             helper.make_node("If", ["cond"], ["logits"], then_branch=branch, else_branch=other)]
    tables = {"E": table} | ({"Lt": table.T.copy()} if shared == "transposed copy" else {})
    src, result = _dedupe(tmp_path, _graph(nodes, tables))
    assert result.exit_code == 0, result.output
    assert "rewrote 1 MatMul(s)" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


def test_an_initializer_listed_as_an_input_too_is_removed_from_both(tmp_path):
    """IR-3 style models list initializers as graph inputs: the copy's input stayed, and onnxruntime
    asked for it ("Required inputs (['L']) are missing")."""
    table = _table()
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"]), _mean("emb", "x"),
             helper.make_node("Gemm", ["x", "L"], ["logits"], transB=1)]
    graph = _graph(nodes, {"E": table, "L": table.copy()})
    graph.input.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, [V, H]) for n in ("E", "L")])
    src, result = _dedupe(tmp_path, graph)
    assert result.exit_code == 0, result.output
    kept = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in kept.input] == ["input_ids", "E"]
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


def test_a_model_below_opset_11_is_refused_before_the_rewrite(tmp_path):
    table = _table()
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("MatMul", ["x", "Lt"], ["logits"])]
    (tmp_path / "in").mkdir()
    src = tmp_path / "in" / "model.onnx"
    model = helper.make_model(_graph(nodes, {"E": table, "Lt": table.T.copy()}), opset_imports=[helper.make_opsetid("", 9)])
    onnx.save(model, str(src), save_as_external_data=True, location="model.onnx.data", size_threshold=1024)
    result = CliRunner().invoke(app, ["dedupe", str(src), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {src}: imports ONNX opset 9; dedupe rewrites MatMul into Gemm and Slice "
                                     "as opset 11 defines them (convert the model with onnx.version_converter first)")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("order", ["zero first", "zero second"])
def test_an_all_zero_table_is_not_close_to_a_small_one(tmp_path, order):
    """A zero table compared against 1% of its own range (0) read as "1% of 1.0": a table of 1e-3
    values was called close to it, and the real duplicate left alone, in one declaration order."""
    table = _table()
    zero, small = np.zeros((V, H), np.float32), np.full((V, H), 1e-3, np.float32)
    pair = {"Z": zero, "S": small} if order == "zero first" else {"S": small, "Z": zero}
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["emb"]), _mean("emb", "x"),
             helper.make_node("Gemm", ["x", "L"], ["logits"], transB=1),
             helper.make_node("Gather", ["Z", "input_ids"], ["z"]), helper.make_node("Gather", ["S", "input_ids"], ["s"]),
             helper.make_node("Add", ["z", "s"], ["zs"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": table, "L": table.copy(), **pair}, outputs=("logits", "zs")))
    assert result.exit_code == 0, result.output
    assert "removed 1 initializer(s) (L)" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)


def test_a_transpose_that_keeps_the_axes_is_not_taken_for_a_shared_head(tmp_path):
    """Transpose(perm=[0, 1]) of a square table was rewritten as a transposition; dedupe's own check
    then refused the result ("outputs changed by 54.2")."""
    square = np.random.default_rng(4).standard_normal((512, 512)).astype(np.float32)  # 1 MiB: large enough to share
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["x"]), helper.make_node("Transpose", ["E"], ["Et"], perm=[0, 1]),
             helper.make_node("MatMul", ["x", "Et"], ["logits"])]
    src, result = _dedupe(tmp_path, _graph(nodes, {"E": square}))
    assert result.exit_code == 2 and "nothing to do" in result.stderr, result.output


@pytest.mark.parametrize("order", ["Gemm's first", "MatMul's first"])
def test_the_copy_kept_is_one_whose_copies_can_be_rewritten_whatever_the_order(tmp_path, order):
    """A review: with no lookup, the first declared table was kept; when that was the transposed one,
    its copy read by Gemm(transB=1) could not be rewritten, and the model was refused."""
    table = _table()
    nodes = [helper.make_node("Gather", ["ids_table", "input_ids"], ["emb"]), _mean("emb", "x"),
             helper.make_node("Gemm", ["x", "A"], ["a"], transB=1), helper.make_node("MatMul", ["x", "D"], ["d"]),
             helper.make_node("Add", ["a", "d"], ["logits"])]
    pair = {"A": table, "D": table.T.copy()} if order == "Gemm's first" else {"D": table.T.copy(), "A": table}
    ids_table = np.random.default_rng(9).standard_normal((V, H)).astype(np.float32)  # another table: no lookup of A
    src, result = _dedupe(tmp_path, _graph(nodes, {"ids_table": ids_table, **pair}))
    assert result.exit_code == 0, result.output
    assert "removed 1 initializer(s) (D)" in result.stdout and "rewrote 1 MatMul(s)" in result.stdout
    _same_outputs(src, tmp_path / "out" / "model.onnx", V)
