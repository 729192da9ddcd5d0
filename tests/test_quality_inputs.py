"""gemma_export.quality on inputs a tester found mishandled: the sliding window a graph was built
with (not a made-up 512), a perplexity beyond float64 (no warning, JSON null), and arguments
refused by name (negative or out-of-vocabulary ids, chunk, sliding_window, nested lists)."""

from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from gemma_export.cli import app
from gemma_export.errors import ConfigError, FormatError, GemmaExportError
from gemma_export.quality import LogitComparison, QualityReport, compare_logits, format_report, run_quality

runner = CliRunner()


def _strict_json(text: str) -> dict:
    """``text`` parsed as strict JSON: ``NaN``, ``Infinity`` and ``-Infinity`` are refused."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- the sliding window ----------------------------------------------------------------------------

def test_the_window_comes_from_the_graph_when_the_manifest_has_none(tiny_int8_export, text_file, tmp_path):
    """A manifest without config.sliding_window (verify passes it) gave "the text ends within the
    sliding window of 512" for a graph built with a window of 6."""
    model = tmp_path / "no-window"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    del manifest["config"]["sliding_window"]
    (model / "manifest.json").write_text(json.dumps(manifest))
    report = run_quality(model, str(tiny_int8_export), text=text_file, tokens=40)
    assert report.metrics.sliding_window == 6
    assert report.metrics.top1_agreement_past_window == 1.0  # rows 6 … 39 of the same graph
    assert "(100.00% past the sliding window of 6)" in format_report(report)


def _genai_folder(export, folder, decoder_sliding_window=None):
    """A folder as onnxruntime-genai's builder leaves it: no manifest.json, a graph that does not take
    ``sliding_cache_start`` (so its metadata is not read), and a genai_config.json, with
    ``model.decoder.sliding_window`` set to ``decoder_sliding_window`` unless None."""
    import onnx

    shutil.copytree(export, folder)
    (folder / "manifest.json").unlink()
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    (start,) = [i for i in graph.graph.input if i.name == "sliding_cache_start"]
    graph.graph.input.remove(start)  # a plain initializer now: the constant 0
    onnx.save(graph, str(folder / "model.onnx"))
    config = json.loads((folder / "genai_config.json").read_text())
    if decoder_sliding_window is not None:
        config["model"]["decoder"]["sliding_window"] = decoder_sliding_window
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder


def test_an_onnxruntime_genai_folder_gives_its_configs_window_or_none(tiny_int8_export, text_file, tmp_path):
    """It printed "within the sliding window of 512" whatever the folder's window."""
    window = {"window_size": 6, "slide_key_value_cache": False, "slide_inputs": False, "layers": [0, 2]}
    folder = _genai_folder(tiny_int8_export, tmp_path / "genai", window)
    report = run_quality(folder, str(tiny_int8_export), text=text_file, tokens=40)
    assert report.metrics.sliding_window == 6 and report.metrics.top1_agreement_past_window == 1.0
    assert report.metrics.top1_agreement == 1.0  # the same weights: the edited graph computes the same logits

    folder = _genai_folder(tiny_int8_export, tmp_path / "genai-no-window")
    report = run_quality(folder, str(tiny_int8_export), text=text_file, tokens=40)
    assert report.metrics.sliding_window is None and report.metrics.top1_agreement_past_window is None
    assert "(the graph and its configuration record no sliding window)" in format_report(report)
    figures = _strict_json(json.dumps(report.to_dict()))
    assert figures["sliding_window"] is None and figures["top1_agreement"] == 1.0


def test_an_onnxruntime_genai_graph_gives_its_window_where_its_config_has_none(tiny_int8_export, text_file, tmp_path):
    """A review: genai's builder records the window for the CPU in its GroupQueryAttention nodes'
    local_window_size (512 and -1 in the real int4 anchor), not in genai_config.json: quality said the
    folder records no window."""
    import onnx
    from onnx import helper

    folder = _genai_folder(tiny_int8_export, tmp_path / "genai")
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    attention = [n for n in graph.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attention) >= 2
    for node, window in zip(attention, [7, -1] * len(attention)):
        node.attribute.append(helper.make_attribute("local_window_size", window))
    onnx.save(graph, str(folder / "model.onnx"))
    report = run_quality(folder, str(tiny_int8_export), text=text_file, tokens=40)
    assert report.metrics.sliding_window == 7 and report.metrics.top1_agreement_past_window is not None


def test_a_malformed_genai_window_is_named_before_the_reference_runs(tiny_int8_export, text_file, tmp_path):
    folder = _genai_folder(tiny_int8_export, tmp_path / "genai", 6)  # a bare number, not the builder's object
    lines = []
    with pytest.raises(FormatError) as caught:
        run_quality(folder, str(tiny_int8_export), text=text_file, tokens=40, progress=lines.append)
    assert str(caught.value) == (f"{folder / 'genai_config.json'}: field 'model.decoder.sliding_window' must be an "
                                 "object with a window_size >= 1 (positions), found 6")
    assert lines and not any(line.startswith("reference:") for line in lines), lines  # refused before the reference is loaded


@pytest.mark.parametrize("decoder_window, genai, manifest_config, expected", [
    (6, {"sliding_window": {"window_size": 9}}, {"sliding_window": 512}, 6),  # the graph's own, first
    (None, {"sliding_window": {"window_size": 9}}, {"sliding_window": 512}, 9),  # then genai_config.json's
    (None, None, {"sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"]}, 512),
    (None, None, {"sliding_window": 512, "layer_types": ["full_attention", "full_attention"]}, None),  # no local layer
    (None, {"head_size": 16}, {}, None),  # nothing records one: not Gemma 3 270M's 512
])
def test_the_window_is_looked_up_graph_then_genai_config_then_manifest(tmp_path, decoder_window, genai,
                                                                        manifest_config, expected):
    from gemma_export.quality import model_sliding_window

    if genai is not None:
        (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": genai}}))
    decoder = SimpleNamespace(sliding_window=decoder_window, model_dir=tmp_path, manifest={"config": manifest_config})
    assert model_sliding_window(decoder) == expected


@pytest.mark.parametrize("field, found", [({"window_size": 0}, '{"window_size": 0}'), ({"size": 6}, '{"size": 6}'),
                                          ({"window_size": True}, '{"window_size": true}'), ("6", '"6"')])
def test_a_genai_window_that_is_no_positive_size_is_refused(tmp_path, field, found):
    from gemma_export.quality import model_sliding_window

    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"sliding_window": field}}}))
    decoder = SimpleNamespace(sliding_window=None, model_dir=tmp_path, manifest={})
    with pytest.raises(FormatError, match=re.escape(f"field 'model.decoder.sliding_window' must be an object with a "
                                                    f"window_size >= 1 (positions), found {found}")):
        model_sliding_window(decoder)


# ---- perplexity beyond float64 ---------------------------------------------------------------------

def _huge(nll: float, rows: int = 4) -> tuple[np.ndarray, list[int]]:
    """Logits over 2 words where every next token (word 0) costs ``nll`` nats (word 1 leads by ``nll``,
    to float32 precision)."""
    logits = np.zeros((rows, 2), np.float32)
    logits[:, 1] = nll
    return logits, [0] * rows


def test_a_perplexity_beyond_float64_is_none_without_a_warning():
    """exp(mean NLL) overflowed: "RuntimeWarning: overflow encountered in exp" and
    "perplexity": Infinity in --json, which strict parsers refuse."""
    reference, ids = _huge(700.0)  # exp(700) = 1.01e304: still a float64
    export, _ = _huge(3000.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = compare_logits(reference, export, ids)
    assert m.perplexity is None
    assert m.reference_perplexity == pytest.approx(math.exp(700.0), rel=1e-6)
    figures = _strict_json(json.dumps(QualityReport("m", "r", "t", m).to_dict()))
    assert figures["perplexity"] is None and figures["reference_perplexity"] == pytest.approx(math.exp(700.0), rel=1e-6)
    assert f"perplexity   above float64's 1.8e308 (reference {math.exp(700.0):.3f})" in \
        format_report(QualityReport("m", "r", "t", m))


def test_the_quality_command_writes_json_null_for_a_perplexity_beyond_float64(tiny_dir, text_file, tmp_path):
    """The tester's fp32 export with model.norm.weight at 3,000: logits in the thousands."""
    from safetensors.numpy import load_file, save_file

    from conftest import write_char_tokenizer
    from gemma_export.exporter import export

    src = tmp_path / "big_src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], 3000.0)
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    model = export(src, tmp_path / "big_fp32", "fp32").out_dir
    out = tmp_path / "q.json"
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=RuntimeWarning, module="gemma_export")
        result = runner.invoke(app, ["quality", "--model", str(model), "--text", str(text_file), "--tokens", "60",
                                     "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = _strict_json(out.read_text())
    assert figures["perplexity"] is None and figures["reference_perplexity"] is None
    assert figures["top1_agreement"] == 1.0  # the figures that do fit are still there
    assert "perplexity   above float64's 1.8e308 (reference above float64's 1.8e308)" in result.stdout
    assert "Warning" not in result.output


# ---- arguments refused by name ---------------------------------------------------------------------

LOGITS = np.random.default_rng(0).normal(size=(5, 10)).astype(np.float32)


@pytest.mark.parametrize("call, message", [
    # a negative id indexed the row from its end: a perplexity of a word that is not in the text
    (lambda: compare_logits(LOGITS, LOGITS, [1, 2, 3, 4, -1]),
     "compare_logits(): token_ids[4] must be a word of the vocabulary (0 to 9, the logits' 10 words), found -1"),
    (lambda: compare_logits(LOGITS, LOGITS, [1, 2, 10, 4, 5]),  # numpy's IndexError
     "compare_logits(): token_ids[2] must be a word of the vocabulary (0 to 9, the logits' 10 words), found 10"),
    (lambda: compare_logits(LOGITS, LOGITS, [1, 2.5, 3, 4, 5]),  # cast to 2 silently
     "compare_logits(): token_ids must be a sequence (list, tuple, 1-D array) of ints, found list [1, 2.5, 3, 4, 5]"),
    (lambda: compare_logits(LOGITS, LOGITS, [1] * 5, chunk=0),  # range() arg 3 must not be zero
     "compare_logits(): chunk must be at least 1 (rows compared at a time), found 0"),
    (lambda: compare_logits(LOGITS, LOGITS, [1] * 5, chunk=-1),  # "logits: 0 of 5 rows compared"
     "compare_logits(): chunk must be at least 1 (rows compared at a time), found -1"),
    (lambda: compare_logits(LOGITS, LOGITS, [1] * 5, sliding_window=-1),  # accepted: every row "past" it
     "compare_logits(): sliding_window must be at least 1 (positions) or None (not known), found -1"),
    (lambda: compare_logits(LOGITS, LOGITS, [1] * 5, sliding_window=0),
     "compare_logits(): sliding_window must be at least 1 (positions) or None (not known), found 0"),
    (lambda: compare_logits(LOGITS.astype(np.int64), LOGITS.astype(np.int64), [1] * 5),
     "compare_logits(): reference must be a float numpy array [rows, V] with V >= 1 words, found ndarray int64 [5, 10]"),
    (lambda: compare_logits(LOGITS, LOGITS[:, :0], [1] * 5),  # argmax of an empty sequence
     "compare_logits(): logits must be a float numpy array [rows, V] with V >= 1 words, found ndarray float32 [5, 0]"),
    (lambda: compare_logits([[0.0, 1.0]] * 2, [[0.0, 1.0]] * 2, [0, 1]),  # 'list' object has no attribute 'shape'
     "compare_logits(): reference must be a float numpy array [rows, V] with V >= 1 words, found list "
     "[[0.0, 1.0], [0.0, 1.0]]"),
    (lambda: LogitComparison([[1, 2], [3, 4]]),
     "LogitComparison(): token_ids must be a sequence (list, tuple, 1-D array) of ints, found list [[1, 2], [3, 4]]"),
    (lambda: LogitComparison([1, 2, -3]),
     "LogitComparison(): token_ids[2] must be a word of the vocabulary (0 or more), found -3"),
    (lambda: LogitComparison([True, False]),
     "LogitComparison(): token_ids must be a sequence (list, tuple, 1-D array) of ints, found list [True, False]"),
    (lambda: LogitComparison([1, 2], sliding_window=-1),
     "LogitComparison(): sliding_window must be at least 1 (positions) or None (not known), found -1"),
    (lambda: LogitComparison([1, 2], sliding_window=True),
     "LogitComparison(): sliding_window must be an int or None, found bool True"),
    (lambda: LogitComparison([1, 2, 30]).add(0, LOGITS[:2], LOGITS[:2]),  # the ids are checked once V is known
     "LogitComparison.add(): token_ids[2] must be a word of the vocabulary (0 to 9, the logits' 10 words), found 30"),
    (lambda: LogitComparison([1, 2, 3]).add(0.0, LOGITS[:2], LOGITS[:2]),
     "LogitComparison.add(): start must be an int, found float 0.0"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    with pytest.raises(ConfigError) as caught:
        call()
    assert str(caught.value) == message


def test_rows_of_another_vocabulary_after_the_first_are_refused():
    comparison = LogitComparison([1, 2, 3, 4])
    comparison.add(0, LOGITS[:2], LOGITS[:2])
    wide = np.zeros((2, 11), np.float32)
    with pytest.raises(GemmaExportError, match=re.escape("expected rows 2… of two [T, V] matrices with T = 4 tokens "
                                                         "and V = 10, found rows 2… of [2, 11] and [2, 11]")):
        comparison.add(2, wide, wide)


def test_valid_ids_of_any_integer_type_give_the_same_figures():
    """The checks turn no valid input away: a tuple, an int32 or uint16 array and a list score alike,
    and the last word of the vocabulary (V - 1) is a valid target."""
    ids = [0, 9, 3, 9, 1]
    expected = compare_logits(LOGITS, LOGITS, ids)
    for given in (tuple(ids), np.asarray(ids, np.int32), np.asarray(ids, np.uint16), range(5)):
        m = compare_logits(LOGITS, LOGITS, given, chunk=2, sliding_window=None)
        if isinstance(given, range):
            assert m.tokens == 5 and m.sliding_window is None
            continue
        assert m.perplexity == expected.perplexity and m.sliding_window is None
    rows = LOGITS - LOGITS.max(-1, keepdims=True)
    log_q = rows - np.log(np.exp(rows.astype(np.float64)).sum(-1, keepdims=True))
    assert expected.perplexity == pytest.approx(math.exp(-np.mean([log_q[i, ids[i + 1]] for i in range(4)])), rel=1e-6)


def test_nan_logits_name_the_model_that_computed_them(tiny_int8_export, tmp_path):
    """'logits: the export's row 0 holds NaN or Inf' named neither folder."""
    from test_hostile import _nan_table
    from gemma_export.errors import NumericError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_int8_export, broken)
    _nan_table(broken)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. ")
    with pytest.raises(NumericError, match=rf"^{re.escape(str(broken))}: logits: the export's row 0 holds NaN or Inf"):
        run_quality(broken, str(tiny_int8_export), text=text)
    with pytest.raises(NumericError, match=rf"^--reference {re.escape(str(broken))}: logits: the reference's row 0 holds"):
        run_quality(tiny_int8_export, str(broken), text=text)


def test_bfloat16_logits_are_compared_as_float32_as_before():
    """A tester: the argument checks refused ml_dtypes' bfloat16 logits, which were scored before
    (the docstring: any float dtype, used as float32)."""
    import ml_dtypes

    rows = np.random.default_rng(0).standard_normal((10, 50)).astype(np.float32)
    narrow = rows.astype(ml_dtypes.bfloat16)
    got = compare_logits(narrow, rows, list(range(10)))
    assert got.max_abs_logit_diff == pytest.approx(float(np.abs(narrow.astype(np.float32) - rows).max()), rel=1e-6)
    assert 0 < got.max_abs_logit_diff < 0.05
    with pytest.raises(ConfigError, match=r"reference must be a float numpy array \[rows, V\]"):
        compare_logits(rows.view("V4"), rows, list(range(10)))
