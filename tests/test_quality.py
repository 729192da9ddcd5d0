"""Teacher-forced metrics (gemma_export.quality) on hand-computed cases."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

from gemma_export.errors import GemmaExportError
from gemma_export.quality import compare_logits


def test_metrics_match_hand_computed_values():
    # reference rows: uniform over 2 words; model rows: softmax([ln 3, 0]) = [0.75, 0.25]
    reference = np.zeros((3, 2), np.float32)
    reference[2] = [0.0, 1.0]  # row 2: the reference prefers word 1, the model word 0
    model = np.tile(np.array([math.log(3.0), 0.0], np.float32), (3, 1))
    ids = [0, 1, 0]  # row 0 predicts 1, row 1 predicts 0
    m = compare_logits(reference, model, ids, chunk=2)  # two chunks
    kl_uniform = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    p2 = np.exp([0.0, 1.0]) / np.exp([0.0, 1.0]).sum()
    kl_row2 = p2[0] * math.log(p2[0] / 0.75) + p2[1] * math.log(p2[1] / 0.25)
    assert m.tokens == 3
    assert m.top1_agreement == pytest.approx(2 / 3)
    assert m.first_disagreement == 2
    assert m.sliding_window == 512 and m.top1_agreement_past_window is None
    assert m.kl_mean == pytest.approx((2 * kl_uniform + kl_row2) / 3, rel=1e-6)
    assert m.max_abs_logit_diff == pytest.approx(math.log(3.0), rel=1e-6)
    # perplexity over rows 0 and 1: targets 1 (q = 0.25) and 0 (q = 0.75)
    assert m.perplexity == pytest.approx(math.exp(-(math.log(0.25) + math.log(0.75)) / 2), rel=1e-6)
    assert m.reference_perplexity == pytest.approx(2.0, rel=1e-6)
    # row 2 is the one miss: the reference preferred word 1 by 1.0 over the model's word 0
    assert m.disagreements == 1 and m.disagreement_margin_max == pytest.approx(1.0)
    # top-1 − top-2 gap: rows 0, 1 move from 0 to ln 3; row 2 from 1 to -ln 3
    assert m.top2_gap_change_median == pytest.approx(math.log(3.0), rel=1e-6)


def test_identical_logits_agree_fully():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(600, 50)).astype(np.float32)
    m = compare_logits(logits, logits.copy(), rng.integers(0, 50, 600).tolist())
    assert m.top1_agreement == 1.0 and m.top1_agreement_past_window == 1.0
    assert m.kl_mean == pytest.approx(0.0, abs=1e-12) and m.max_abs_logit_diff == 0.0
    assert m.first_disagreement is None
    assert m.disagreements == 0 and m.disagreement_margin_max is None and m.top2_gap_change_median == 0.0


def test_near_tie_figures_name_the_closest_call_the_export_overturned():
    reference = np.array([[5.0, 4.9, 0.0], [3.0, 0.0, 2.0], [1.0, 0.0, 0.5]], np.float32)
    model = np.array([[4.0, 4.5, 0.0], [2.0, 0.0, 2.5], [1.0, 0.0, 0.5]], np.float32)
    m = compare_logits(reference, model, [0, 1, 2])
    # rows 0 and 1 flip: the reference preferred its word by 0.1 and by 1.0 over the model's pick
    assert m.disagreements == 2 and m.disagreement_margin_max == pytest.approx(1.0)
    # gap changes: row 0 (0 vs 1) 0.1 → -0.5: 0.6; row 1 (0 vs 2) 1 → -0.5: 1.5; row 2 (0 vs 2): 0
    assert m.top2_gap_change_median == pytest.approx(0.6, rel=1e-6)


@pytest.mark.parametrize("lead, label", [(0.4, "(close calls)"), (1.0, "(not all close calls)")])
def test_misses_are_called_close_only_when_every_lead_lost_was_small(lead, label):
    from gemma_export.quality import QualityReport, format_report

    reference = np.array([[5.0, 5.0 - lead, 0.0], [3.0, 0.0, 2.9], [1.0, 0.0, 0.5]], np.float32)
    model = np.array([[4.0, 4.5, 0.0], [3.0, 0.0, 2.0], [1.0, 0.0, 0.5]], np.float32)
    text = format_report(QualityReport("m", "r", "t", compare_logits(reference, model, [0, 1, 2])))
    assert f"by at most {lead:.3f} logits {label}" in text


def test_top1_past_the_window_counts_rows_from_the_window_on():
    reference = np.zeros((10, 3), np.float32)
    reference[:, 0] = 1.0
    model = reference.copy()
    model[[2, 3, 8]] = [0.0, 2.0, 0.0]  # rows 2, 3 (before the window) and 8 (after it) disagree
    m = compare_logits(reference, model, [0] * 10, sliding_window=5)
    assert m.sliding_window == 5
    assert m.top1_agreement == pytest.approx(0.7)
    assert m.top1_agreement_past_window == pytest.approx(0.8)  # rows 5-9: one of five differs
    assert compare_logits(reference, model, [0] * 10, sliding_window=10).top1_agreement_past_window is None


def test_shape_mismatch_is_refused():
    with pytest.raises(GemmaExportError, match=r"expected two \[T, V\] matrices with T = 3 tokens"):
        compare_logits(np.zeros((3, 4), np.float32), np.zeros((3, 5), np.float32), [0, 1, 2])


# ---- gemma-export quality on the tiny export -------------------------------------------------------

from typer.testing import CliRunner  # noqa: E402

from gemma_export.cli import app  # noqa: E402

runner = CliRunner()


def test_quality_command_reports_what_compare_logits_computes(tiny_int8_export, tiny_model, text_file, tmp_path):
    from conftest import reference_logits
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    out = tmp_path / "q.json"
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--text", str(text_file),
                                 "--tokens", "250", "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    ids = load_tokenizer(tiny_int8_export).encode(text_file.read_text()).ids[:250]
    expected = compare_logits(reference_logits(tiny_model, np.asarray([ids]))[0],
                              OnnxDecoder(tiny_int8_export).teacher_forced_logits(ids), ids, sliding_window=6)
    assert figures["tokens"] == 250 and figures["reference"] == "transformers"
    assert figures["top1_agreement"] == pytest.approx(expected.top1_agreement)
    assert figures["kl_mean"] == pytest.approx(expected.kl_mean, rel=1e-3)
    # the split follows the model's own sliding_window (6 in the tiny config), not Gemma 3 270M's 512
    assert figures["sliding_window"] == 6
    assert figures["top1_agreement_past_window"] == pytest.approx(expected.top1_agreement_past_window)
    # int8 of the tiny model: close, not identical (0.00052 measured; a table zero point off by one
    # gives 0.0049, a different model far more)
    assert 0 < figures["kl_mean"] < 0.002
    assert "KL" in result.stdout and f"({expected.top1_agreement_past_window:.2%} past the sliding window of 6)" in result.stdout
    misses = round((1 - expected.top1_agreement) * 250)
    assert f"misses       {misses} position(s), first at position {expected.first_disagreement} (counting from 0); " \
           f"at each, the reference preferred its word to the export's by at most" in result.stdout


def test_quality_against_itself_is_perfect(tiny_int8_export, text_file):
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", str(tiny_int8_export),
                                 "--text", str(text_file), "--tokens", "40"])
    assert result.exit_code == 0, result.output
    assert "top-1        100.00% of positions pick the reference's top word" in result.stdout
    assert "misses       0 position(s), none\n" in result.stdout
    assert re.search(r"max \|dlogit\| 0(\s|$)", result.stdout), result.stdout  # exactly 0, not 0.5 or 0.001
    # said, so that nobody takes it for a quality figure
    assert "note: --reference is the export being measured: 100% and KL 0 say only that its runs repeat" in result.stderr


def test_a_reference_of_another_source_or_tokenizer_is_noted(tiny_int8_export, text_file, tmp_path):
    """Figures against an export of other weights are allowed (a GGUF against a transformers folder
    of the same model) but said; an export against itself gets no note about its source or
    tokenizer (only the one that it is itself)."""
    other = tmp_path / "other"
    shutil.copytree(tiny_int8_export, other)
    manifest = json.loads((other / "manifest.json").read_text())
    ours = manifest["source"]["sha256"]
    manifest["source"]["sha256"] = "0" * 64
    manifest["files"]["tokenizer.json"]["sha256"] = "1" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    command = ["quality", "--model", str(tiny_int8_export), "--text", str(text_file), "--tokens", "20", "--reference"]
    result = runner.invoke(app, command + [str(other)])
    assert result.exit_code == 0, result.output
    assert (f"note: --reference {other} was exported from another source than {tiny_int8_export} (sha256 000000000000… "
            f"against {ours[:12]}…)") in result.stderr
    assert f"note: --reference {other} has another tokenizer.json than {tiny_int8_export}" in result.stderr
    result = runner.invoke(app, command + [str(tiny_int8_export)])
    assert result.exit_code == 0 and "another source" not in result.output and "another tokenizer" not in result.output
    assert [line for line in result.output.splitlines() if line.startswith("note:")] == [
        "note: --reference is the export being measured: 100% and KL 0 say only that its runs repeat exactly; "
        "compare with fp32, transformers or another export to measure quality"]


def test_reference_notes_skip_what_a_hand_edited_manifest_garbles(tmp_path):
    from gemma_export.quality import other_model_notes

    for name, digest in (("a", 12345), ("b", 67890)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({"source": {"sha256": digest}, "files": []}))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text("{oops")
    assert other_model_notes(tmp_path / "a", tmp_path / "b") == []
    assert other_model_notes(tmp_path / "a", tmp_path / "c") == []


def test_a_long_quality_run_says_where_it_is(tiny_int8_export, text_file, monkeypatch):
    """Every 15 s of scoring gives a 'N of T positions' line (here the clock jumps 20 s per look)."""
    from gemma_export import quality

    clock = iter(range(0, 10**6, 20))
    monkeypatch.setattr(quality.time, "monotonic", lambda: float(next(clock)))
    lines = []
    report = quality.run_quality(tiny_int8_export, str(tiny_int8_export), text=text_file, tokens=250,
                                 progress=lines.append)
    assert report.metrics.tokens == 250
    assert [line for line in lines if line.endswith(" of 250 positions")] == ["128 of 250 positions"]


def test_the_fp32_reference_export_says_where_it_is(tiny_int8_export, text_file, monkeypatch):
    """--reference fp32 exports the source first: a line every 15 s of it (the clock jumps 20 s
    per look) and its time at the end, so a long export is not silent."""
    from gemma_export import quality

    clock = iter(range(0, 10**6, 20))
    monkeypatch.setattr(quality.time, "monotonic", lambda: float(next(clock)))
    lines = []
    quality.run_quality(tiny_int8_export, "fp32", text=text_file, tokens=40, progress=lines.append)
    written = [line for line in lines if line.startswith("reference: ") and "tensors written" in line]
    assert written and all(re.fullmatch(r"reference: \d+ of \d+ tensors written", line) for line in written)
    assert any(re.fullmatch(r"reference: fp32 export written in \d+ s", line) for line in lines), lines


@pytest.mark.parametrize("args, message", [
    (["--tokens", "1"], "--tokens: expected at least 2, found 1"),
    (["--reference", "/nonexistent/export"], "/nonexistent/export: no such export folder"),
    # a mistyped keyword is a missing folder too: the message names the keywords
    (["--reference", "fp23"], "fp23: no such export folder; --reference takes transformers, fp32 or an export folder"),
    (["--text", "/nonexistent/text.txt"], "/nonexistent/text.txt: no such text file"),
])
def test_quality_bad_arguments(tiny_int8_export, args, message):
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--tokens", "40", *args])
    assert result.exit_code == 2 and message in result.output
    assert len(result.output.strip().splitlines()) <= 4  # progress lines (graph, text, reference), then one error line
    assert result.output.strip().splitlines()[-1].startswith("error: ")
    if args[0] == "--reference":  # a missing reference folder is named before the text is read or the model loaded
        assert result.output.strip().splitlines() == [result.output.strip().splitlines()[-1]]


@pytest.mark.parametrize("command", [["quality"], ["parity", "--against", "transformers"]])
def test_missing_transformers_fails_before_loading_anything(command, monkeypatch, tmp_path):
    """Without the test extra, the transformers reference is refused at once (the model folder
    does not even exist here), and the message says what works without it."""
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "torch" else real_find_spec(name, *a, **k))
    result = runner.invoke(app, [*command, "--model", str(tmp_path / "not-an-export")])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: the transformers reference needs torch and transformers")
    assert "not installed: torch" in line and "not-an-export" not in result.output
    assert ("--reference fp32" if command == ["quality"] else "--golden") in line


def test_teacher_forced_chunks_are_the_rows_of_teacher_forced_logits(tiny_int8_export):
    from gemma_export.runtime import OnnxDecoder

    decoder = OnnxDecoder(tiny_int8_export)
    ids = [2, *range(10, 40)]
    whole = decoder.teacher_forced_logits(ids)
    starts, rows = [], []
    for start, chunk in decoder.teacher_forced_chunks(ids, 8):
        starts.append(start)
        rows.append(chunk.copy())  # the generator reuses its array
    assert starts == [0, 8, 16, 24] and [len(r) for r in rows] == [8, 8, 8, 7]
    np.testing.assert_array_equal(np.concatenate(rows), whole)


def test_quality_never_builds_a_whole_logit_matrix(tiny_int8_export, text_file, monkeypatch):
    """The reference and the export advance together a chunk at a time (a 3,400-token text is
    3.6 GB of logits per model): the whole-matrix helpers must not be called."""
    from gemma_export import quality
    from gemma_export.runtime import OnnxDecoder

    def whole(*args, **kwargs):
        raise AssertionError("a whole [T, V] logit matrix was built")

    monkeypatch.setattr(OnnxDecoder, "teacher_forced_logits", whole)
    monkeypatch.setattr(quality, "transformers_logits", whole)
    monkeypatch.setattr(quality, "compare_logits", whole)
    monkeypatch.setattr(quality, "CHUNK_ROWS", 16)
    for reference in ("transformers", str(tiny_int8_export)):
        report = quality.run_quality(tiny_int8_export, reference, text=text_file, tokens=70)
        assert report.metrics.tokens == 70
        if reference != "transformers":
            assert report.metrics.top1_agreement == 1.0 and report.metrics.max_abs_logit_diff == 0.0


def test_quality_against_transformers_says_where_transformers_reads_the_config_otherwise(tiny_int8_export, text_file,
                                                                                        monkeypatch):
    """The transformers reference is built from this toolkit's reading of the config; the fields
    transformers reads otherwise (quality.config_differences) are said before the figures."""
    from gemma_export import quality

    seen = []
    monkeypatch.setattr(quality, "config_differences", lambda source: seen.append(source.path) or ["note: the difference"])
    said = []
    quality.run_quality(tiny_int8_export, "transformers", text=text_file, tokens=20, progress=said.append)
    assert "note: the difference" in said and len(seen) == 1
    said.clear()
    quality.run_quality(tiny_int8_export, str(tiny_int8_export), text=text_file, tokens=20, progress=said.append)
    assert "note: the difference" not in said and len(seen) == 1  # another export as the reference: no transformers


def test_a_reference_given_as_a_path_stays_json_ready(tiny_int8_export, text_file):
    """``reference`` may be a Path; the report kept it as one, and ``to_dict()`` (documented as
    JSON-ready) then failed in ``json.dumps``."""
    from pathlib import Path

    from gemma_export import quality

    report = quality.run_quality(tiny_int8_export, reference=Path(tiny_int8_export), text=text_file, tokens=20)
    assert json.loads(json.dumps(report.to_dict()))["reference"] == str(tiny_int8_export)


@pytest.mark.parametrize("side", ["reference", "export"])
def test_non_finite_logits_are_named_not_scored(side):
    """NaN logits made KL and perplexity NaN and max |dlogit| 0 (max(0.0, nan)), with exit 0."""
    from gemma_export.errors import NumericError

    good = np.zeros((4, 5), np.float32)
    bad = good.copy()
    bad[2, 3] = np.nan
    reference, logits = (bad, good) if side == "reference" else (good, bad)
    with pytest.raises(NumericError, match=f"logits: the {side}'s row 2 holds NaN or Inf"):
        compare_logits(reference, logits, [0, 1, 2, 3])


def test_a_source_path_that_is_not_text_is_named(tiny_int8_export, tmp_path):
    import shutil

    from gemma_export.errors import SourceNotFoundError
    from gemma_export.quality import manifest_source

    model = tmp_path / "m"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    for value, found in ((7, "7"), (None, "null"), (["a"], '["a"]'), ("", '""')):
        manifest["source"]["path"] = value
        (model / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(SourceNotFoundError, match=re.escape(
                f"manifest.json: field 'source.path' must be the export's source path (a non-empty string), found "
                f"{found}; the reference needs that source")):  # "missing or without source.path" for a 7 (break-it run)
            manifest_source(model)
    del manifest["source"]["path"]
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SourceNotFoundError, match=r"manifest\.json: no field 'source\.path' \(the export's source\)"):
        manifest_source(model)


def test_a_source_path_that_does_not_open_names_the_manifest_field(tiny_int8_export, tmp_path):
    """A source.path naming a folder that is no model: parity said only "<folder>/config.json:
    missing; ... give one of them as the source", though the user gave no source (helper-found)."""
    import shutil

    from gemma_export.errors import GemmaExportError
    from gemma_export.quality import manifest_checkpoint

    model = tmp_path / "m"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["source"]["path"] = str(tmp_path)  # a folder, without config.json
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemmaExportError) as caught:
        manifest_checkpoint(model)
    assert str(caught.value).startswith(f"{model / 'manifest.json'}: field 'source.path' names {tmp_path}, which does "
                                        f"not open as the export's source ({tmp_path}")


def test_logit_comparison_refuses_rows_out_of_order_and_an_incomplete_result():
    from gemma_export.errors import GemmaExportError
    from gemma_export.quality import LogitComparison

    rows = np.zeros((2, 5), np.float32)
    comparison = LogitComparison([1, 2, 3, 4])
    with pytest.raises(GemmaExportError, match=r"expected rows 0"):
        comparison.add(2, rows, rows)
    comparison.add(0, rows, rows)
    with pytest.raises(GemmaExportError, match="2 of 4 rows compared"):
        comparison.result()
    with pytest.raises(GemmaExportError, match="found rows 2"):
        comparison.add(2, rows, np.zeros((2, 6), np.float32))


def test_json_may_not_overwrite_an_input(tiny_int8_export, text_file, tmp_path):
    """--json pointing into the export (its manifest, its model) or at the text is refused before
    anything runs, and the file is left as it was."""
    manifest = tiny_int8_export / "manifest.json"
    before = manifest.read_bytes()
    for target, words in ((manifest, "would overwrite a file in the input"), (text_file, "would overwrite the input")):
        result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", str(tiny_int8_export),
                                     "--text", str(text_file), "--tokens", "20", "--json", str(target)])
        assert result.exit_code == 2 and words in result.stderr and result.stdout == ""
    assert manifest.read_bytes() == before


def test_json_dash_is_stdout_and_a_failed_write_is_one_line(tiny_int8_export, text_file):
    args = ["quality", "--model", str(tiny_int8_export), "--reference", str(tiny_int8_export), "--text", str(text_file),
            "--tokens", "20"]
    result = runner.invoke(app, [*args, "--json", "-"])
    assert result.exit_code == 0
    figures = json.loads(result.stdout)  # the JSON alone: the text report went to stderr
    assert figures["tokens"] == 20 and figures["top1_agreement"] == 1.0 and "top-1" in result.stderr
    result = runner.invoke(app, [*args, "--json", "/dev/full"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].startswith("error: --json /dev/full: cannot write")


def test_a_reference_of_another_vocabulary_or_too_long_a_text_is_named_before_running(tiny_dir, tiny_int8_export,
                                                                                       text_file, tmp_path):
    from conftest import make_tiny_model, save_tiny, write_char_tokenizer
    from gemma_export.exporter import export

    src = save_tiny(make_tiny_model(vocab_size=128), tmp_path / "src128")
    write_char_tokenizer(src)
    other = export(src, tmp_path / "v128", "int8", block_size=16).out_dir
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", str(other),
                                 "--text", str(text_file), "--tokens", "20"])
    assert result.exit_code == 2
    assert f"--reference {other}: its vocabulary has 128 tokens, the export's 96" in result.stderr
    assert "running the export" not in result.stderr
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", str(tiny_int8_export),
                                 "--text", str(text_file)])
    assert result.exit_code == 2 and "has more than 256 tokens, its max_position_embeddings; pass --tokens 256 or fewer" in result.stderr


def test_tokens_limits_how_much_of_a_long_text_is_tokenized(tiny_int8_export):
    """--tokens 50 on a long text encodes a prefix only (a 10 MB text took 28 s and 4 GB in full)."""
    from gemma_export.text_files import first_tokens
    from gemma_export.runtime import load_tokenizer

    tokenizer = load_tokenizer(tiny_int8_export)
    text = "the quick brown fox jumps over the lazy dog. " * 20000
    encoded = []
    real_encode = tokenizer.encode

    class Counting:
        def encode(self, part):
            encoded.append(len(part))
            return real_encode(part)

    assert first_tokens(Counting(), text, 50) == real_encode(text).ids[:50]
    assert max(encoded) < len(text) // 50
    assert first_tokens(tokenizer, "short text", None) == real_encode("short text").ids
    assert first_tokens(tokenizer, "short text", 5) == real_encode("short text").ids[:5]


@pytest.mark.parametrize("tokens, read", [(20, 1 << 20), (30_000, 1 << 20), (None, 1 << 20), (10 ** 23, 1 << 20)])
def test_quality_reads_only_the_start_of_a_long_text(tiny_int8_export, tmp_path, monkeypatch, tokens, read):
    """As bench: at most max(1 MiB, 64 bytes per token needed) of --text (probe finding: a 1 GB
    file held 2 GB to score 20 tokens); a byte that is no UTF-8 beyond that part goes unread. Without
    --tokens, the model's 256 positions + 1 are read, to refuse a longer text by name."""
    from gemma_export import bench, quality

    big = tmp_path / "big.txt"
    big.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 50_000 + b"\xff")  # 2.25 MB
    asked = []
    real_text = bench.real_text
    monkeypatch.setattr(bench, "real_text", lambda path, max_bytes=None: asked.append(max_bytes) or real_text(path, max_bytes))
    try:
        report = quality.run_quality(tiny_int8_export, reference=str(tiny_int8_export), text=big, tokens=tokens)
    except GemmaExportError as e:  # more than the model's 256 positions
        assert tokens != 20 and f"{big} has more than 256 tokens" in str(e), e
    else:
        assert report.metrics.tokens == tokens == 20
    assert asked == [read]


def test_a_text_read_in_part_is_not_called_the_whole_text(tiny_int8_export, tmp_path, monkeypatch):
    """Fewer tokens than --tokens asks: "the whole text" only when the whole file was read; a text
    of more than 64 bytes per token is read in part (the tokenizer stands in for one whose tokens
    are that long: it gives 10 tokens of whatever it reads)."""
    from gemma_export import quality

    real_first = quality.first_tokens
    monkeypatch.setattr(quality, "first_tokens", lambda tokenizer, body, count: real_first(tokenizer, body, 10))
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text("the fox " * 200_000)  # 1.6 MB: more than max(1 MiB, 64 x 200 bytes)
    small.write_text("the fox " * 10)
    for text, part in ((big, f"its first {1 << 20:,} bytes"), (small, "the whole text")):
        said = []
        quality.run_quality(tiny_int8_export, reference=str(tiny_int8_export), text=text, tokens=200, progress=said.append)
        assert f"10 tokens of {text} ({part}; 200 asked)" in said, said


def test_first_tokens_never_keeps_a_token_cut_at_the_prefix_end():
    """A word cut by the prefix tokenizes differently from the whole word: tokens that close to the
    cut are not taken from the prefix, whose first 4,096 characters end inside the 373rd word."""
    import re
    import types

    from gemma_export.text_files import first_tokens

    class Words:  # one token per word, its id the word's length
        def encode(self, text):
            spans = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
            return types.SimpleNamespace(ids=[end - start for start, end in spans], offsets=spans)

    text = "abcdefghij " * 1000  # 11 characters a word: character 4,096 falls inside word 373
    assert first_tokens(Words(), text, 373) == Words().encode(text).ids[:373] == [10] * 373


def test_a_same_size_model_at_the_source_path_is_refused_by_its_contents(tiny_dir, tmp_path):
    """Two fine-tunes of one architecture have the same size: the manifest's source sha256 tells them
    apart; the unchanged source is still accepted."""
    import shutil

    from gemma_export.errors import SourceNotFoundError
    from gemma_export.exporter import export
    from gemma_export.quality import manifest_checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    out = export(src, tmp_path / "out", "fp32").out_dir
    recorded = json.loads((out / "manifest.json").read_text())["source"]
    assert len(recorded["sha256"]) == 64
    assert manifest_checkpoint(out).content_sha256() == recorded["sha256"]
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # another model of the same shapes: the last 16 float32 weights scaled
        f.seek(size - 64)
        values = np.frombuffer(f.read(64), dtype="<f4") * np.float32(1.5)
        f.seek(size - 64)
        f.write(values.astype("<f4").tobytes())
    assert weights.stat().st_size == size
    with pytest.raises(SourceNotFoundError, match=r"the export's source .*src has other bytes now \(sha256 "
                                                  r"[0-9a-f]{12}…, recorded [0-9a-f]{12}… when the export was made\); "
                                                  r"it changed since the export"):
        manifest_checkpoint(out)


def test_a_different_model_at_the_source_path_is_named_not_compared(tiny_dir, tmp_path):
    """quality's and parity's reference re-open the export's source by path: a model of another size
    moved there is refused (it gave parity FAIL, KL 1.43, blamed on the export)."""
    import shutil

    from conftest import make_tiny_model, save_tiny
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.exporter import export
    from gemma_export.quality import manifest_checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    out = export(src, tmp_path / "out", "fp32").out_dir
    assert manifest_checkpoint(out).identity["bytes"] > 0  # the same source: accepted
    shutil.rmtree(src)
    save_tiny(make_tiny_model(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"]), src)
    with pytest.raises(SourceNotFoundError, match=r"the export's source .*src has [\d,]+ bytes now and had [\d,]+ when "
                                                  r"the export was made; it changed since the export"):
        manifest_checkpoint(out)


@pytest.mark.parametrize("scale", [3.0, 1e-2, 1e-5])
def test_kl_and_perplexity_equal_a_float64_computation(scale):
    """The float32 softmax with float64 sums (quality._kl_rows) against float64 log-softmaxes, from
    int4-sized differences down to fp32-vs-fp32 ones (KL ~1e-11 nats)."""
    rng = np.random.default_rng(3)
    reference = (3 * rng.standard_normal((40, 5000))).astype(np.float32)
    logits = (reference + scale * rng.standard_normal(reference.shape)).astype(np.float32)
    ids = rng.integers(0, 5000, 40)
    m = compare_logits(reference, logits, ids.tolist(), chunk=16)

    def log_softmax(x):
        x = x.astype(np.float64)
        return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))

    lp, lq = log_softmax(reference), log_softmax(logits)
    kl = (np.exp(lp) * (lp - lq)).sum(-1).mean()
    assert m.kl_mean == pytest.approx(kl, rel=1e-3) and m.kl_mean > 0
    assert m.perplexity == pytest.approx(np.exp(-lq[np.arange(39), ids[1:]].mean()), rel=1e-6)
    assert m.reference_perplexity == pytest.approx(np.exp(-lp[np.arange(39), ids[1:]].mean()), rel=1e-6)


def test_kl_of_rows_far_apart_falls_back_to_float64():
    """expm1 overflows float32 where the export is ~100 above the reference on a word: such rows are
    recomputed in float64 (a finite KL, not inf or NaN)."""
    reference = np.zeros((3, 4), np.float32)
    logits = reference.copy()
    logits[1, 2] = 120.0  # row 1: the export puts all its mass on word 2
    m = compare_logits(reference, logits, [0, 1, 2])
    kl_row1 = 0.75 * math.log(0.25 / math.exp(-120.0)) + 0.25 * math.log(0.25 / 1.0)  # q(word 2) ~ 1
    assert m.kl_mean == pytest.approx(kl_row1 / 3, rel=1e-6)
    # rows 0 and 1 predict words 1 and 2: q = 1/4 (row 0 is uniform), q ~ 1 (row 1)
    assert m.perplexity == pytest.approx(math.exp((math.log(4) + math.log1p(3 * math.exp(-120.0))) / 2), rel=1e-6)
    assert m.reference_perplexity == pytest.approx(4.0, rel=1e-6)


@pytest.mark.parametrize("field, value, words", [("bytes", "big", "field 'source.bytes' must be a file size"),
                                                 ("sha256", 7, "field 'source.sha256' must be 64 lowercase hex"),
                                                 ("sha256", "abc", 'found "abc"')])
def test_a_wrong_typed_source_record_is_refused_not_skipped(tiny_dir, tmp_path, field, value, words):
    """The size and digest checks of the export's source are not bypassed by a manifest that
    holds something else in their place."""
    import shutil

    from gemma_export.errors import FormatError
    from gemma_export.exporter import export
    from gemma_export.quality import manifest_checkpoint

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    out = export(src, tmp_path / "out", "fp32").out_dir
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["source"][field] = value
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=re.escape(words)):
        manifest_checkpoint(out)


def test_a_folder_named_like_a_reference_keyword_is_reachable_as_a_path(tiny_int8_export, text_file, tmp_path, monkeypatch):
    # `--reference ./fp32` means the folder; `--reference fp32` stays the keyword and says so
    shutil.copytree(tiny_int8_export, tmp_path / "fp32")  # any export folder will do as the reference
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", "./fp32",
                                 "--text", str(text_file), "--tokens", "40"])
    assert result.exit_code == 0, result.output
    assert "reference: the export in ./fp32" in result.output and "top-1        100.00%" in result.output
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", "fp32",
                                 "--text", str(text_file), "--tokens", "40"])
    assert result.exit_code == 0, result.output
    assert "note: --reference fp32 is the keyword" in result.output
    assert "reference: exporting the source at fp32" in result.output


def test_a_reference_transformers_cannot_represent_is_refused_not_rounded(tiny_dir):
    """transformers' Gemma3TextConfig takes query_pre_attn_scalar as an int: 16.5 would become 16 and
    the reference would compute another model, so it is refused by name."""
    import dataclasses

    pytest.importorskip("transformers")
    from gemma_export.quality import transformers_model
    from gemma_export.sources import open_source

    checkpoint = open_source(tiny_dir)
    odd = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, query_pre_attn_scalar=16.5))
    with pytest.raises(GemmaExportError, match=r"^query_pre_attn_scalar 16.5: transformers' Gemma3TextConfig takes a whole"):
        transformers_model(odd)
    whole = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, query_pre_attn_scalar=16.0))
    assert transformers_model(whole).config.query_pre_attn_scalar == 16


def test_a_model_of_one_position_is_refused_without_impossible_advice(tiny_int8_export, text_file, tmp_path):
    # --tokens must be at least 2, so "pass --tokens 1 or fewer" would send the user in a circle
    model = tmp_path / "m"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["config"]["max_position_embeddings"] = 1
    (model / "manifest.json").write_text(json.dumps(manifest))
    result = runner.invoke(app, ["quality", "--model", str(model), "--reference", str(model), "--text", str(text_file)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert "has more than 1 tokens, its max_position_embeddings; a model of fewer than 2 positions cannot be measured" in line
    assert "--tokens 1" not in line


def test_comparing_one_token_is_refused_not_a_nan_perplexity():
    # one row predicts no next token: the perplexity would be the mean of nothing
    from gemma_export.errors import GemmaExportError

    with pytest.raises(GemmaExportError, match="comparing needs at least 2 tokens"):
        compare_logits(np.zeros((1, 5), np.float32), np.zeros((1, 5), np.float32), [3])


def test_first_disagreement_is_the_earliest_of_several_misses():
    # rows 1 and 3 flip (the model prefers word 1 where the reference prefers word 0); rows 0, 2 agree
    reference = np.tile(np.array([2.0, 0.0, 0.0], np.float32), (4, 1))
    model = reference.copy()
    model[[1, 3]] = [0.0, 2.0, 0.0]
    m = compare_logits(reference, model, [0, 0, 0, 0], chunk=2)  # the misses fall in different chunks
    assert m.disagreements == 2 and m.first_disagreement == 1
    assert m.top1_agreement == pytest.approx(0.5)


def test_perplexity_of_a_row_recomputed_in_float64_uses_the_models_logits():
    """A row the float64 fallback recomputes (the export ~120 above the reference on a word) gets the
    model's log-sum-exp for its perplexity: where reference and model differ on word 0 too, the
    reference's value would give the row a likelihood above 1."""
    reference = np.zeros((3, 4), np.float32)
    logits = reference.copy()
    logits[1] = [5.0, 0.0, 120.0, 0.0]  # row 1 predicts ids[2] = 2, on which the model puts ~all its mass
    m = compare_logits(reference, logits, [0, 1, 2])
    lq = logits[1].astype(np.float64) - np.log(np.exp(logits[1].astype(np.float64) - 120.0).sum()) - 120.0
    nll = [math.log(4.0), -lq[2]]  # row 0: uniform over 4 words; row 1: -log q(word 2) ~ e^-115
    assert m.perplexity == pytest.approx(math.exp(sum(nll) / 2), rel=1e-9)
    assert m.perplexity >= 2.0 - 1e-9  # sqrt(4 * 1): no row predicts its word with probability above 1
    assert m.reference_perplexity == pytest.approx(4.0, rel=1e-6)


def test_an_fp32_export_measured_against_the_fp32_reference_gets_a_note(tiny_dir, text_file, tmp_path):
    from conftest import write_char_tokenizer
    from gemma_export.exporter import export

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    fp32 = export(src, tmp_path / "fp32", "fp32").out_dir
    result = runner.invoke(app, ["quality", "--model", str(fp32), "--reference", "fp32", "--text", str(text_file),
                                 "--tokens", "40"])
    assert result.exit_code == 0, result.output
    assert "note: the export is fp32 itself: the fp32 reference is the same model made again" in result.output
    assert "top-1        100.00%" in result.output
    int8 = export(src, tmp_path / "int8", "int8", block_size=16, calibrate=False).out_dir
    result = runner.invoke(app, ["quality", "--model", str(int8), "--reference", "fp32", "--text", str(text_file),
                                 "--tokens", "40"])
    assert result.exit_code == 0 and "note: the export is fp32 itself" not in result.output, result.output


@pytest.mark.parametrize("margin, verdict", [(0.5, "close calls"), (0.5001, "not all close calls")])
def test_a_miss_by_exactly_the_close_call_margin_is_a_close_call(margin, verdict):
    from gemma_export.quality import CLOSE_CALL_LOGITS, QualityMetrics, QualityReport, format_report

    assert CLOSE_CALL_LOGITS == 0.5
    metrics = QualityMetrics(tokens=10, top1_agreement=0.9, sliding_window=512, top1_agreement_past_window=None,
                             kl_mean=0.001, max_abs_logit_diff=0.7, perplexity=4.0, reference_perplexity=4.0,
                             first_disagreement=3, disagreements=1, disagreement_margin_max=margin)
    line = next(x for x in format_report(QualityReport("m", "r", "t", metrics)).splitlines() if x.startswith("misses"))
    assert line.endswith(f"by at most {margin:.3f} logits ({verdict})")


@pytest.mark.parametrize("command", ["quality-fp32", "quality-transformers", "parity"])
def test_a_moved_source_is_named_before_the_session_loads(tiny_dir, tmp_path, monkeypatch, command):
    """quality and `parity --against transformers` loaded the export's session first and only then
    said that its source is gone (helper-found)."""
    import shutil

    from gemma_export import runtime
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.exporter import export
    from gemma_export.parity import run_parity
    from gemma_export.quality import run_quality

    from conftest import write_char_tokenizer

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    out = export(src, tmp_path / "out", "fp32").out_dir
    shutil.rmtree(src)

    def not_now(*args, **kwargs):
        raise AssertionError("the session loaded before the source was checked")

    monkeypatch.setattr(runtime.OnnxDecoder, "__init__", not_now)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 4)
    with pytest.raises(SourceNotFoundError, match="the export's source .*src no longer exists"):
        if command == "parity":
            run_parity(out, against_transformers=True)
        else:
            run_quality(out, reference=command.split("-")[1], text=text)


@pytest.mark.parametrize("command", [["quality", "--text", "{text}", "--tokens", "20", "--reference", "fp32"],
                                     ["parity", "--against", "transformers"]])
def test_a_manifest_that_is_no_json_is_called_unreadable_not_missing(tiny_int8_export, text_file, tmp_path, command):
    """Probe finding: quality and parity called a manifest.json holding "{" missing."""
    import shutil

    from typer.testing import CliRunner

    from gemma_export.cli import app

    broken = tmp_path / "broken"
    shutil.copytree(tiny_int8_export, broken)
    (broken / "manifest.json").write_text("{")
    args = [a.replace("{text}", str(text_file)) for a in command]
    result = CliRunner().invoke(app, [args[0], "--model", str(broken), *args[1:]])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {broken / 'manifest.json'}: unreadable manifest: Expecting property name")
    assert result.stderr.count("\n") == 1 and "missing" not in result.stderr


def test_a_full_temporary_folder_for_the_fp32_reference_names_tmpdir(tiny_int8_export, text_file, monkeypatch):
    """A break-it run: the refusal named a temporary folder no option chooses."""
    from gemma_export import exporter, quality
    from gemma_export.errors import OutputError

    def full(folder, needed, what):
        raise OutputError(f"{folder}: the {what} needs {needed:,} bytes and the disk has 0.2 MB free; free some space "
                          "or choose another folder")
    monkeypatch.setattr(exporter, "check_free_space", full)
    with pytest.raises(OutputError, match=r"; free some space or choose another folder \(the temporary folder of "
                                          r"--reference fp32, in .+: set TMPDIR to put it on a disk with room\)$"):
        quality.run_quality(tiny_int8_export, "fp32", text=text_file, tokens=20)


def test_the_graph_line_gives_the_copys_note_without_nested_parentheses():
    """A fresh user's note: "graph: m/model.onnx (pre-packed copy … not used (--no-prepacked))"."""
    import types
    from pathlib import Path

    from gemma_export.quality import graph_line

    decoder = types.SimpleNamespace(prepacked_path=None, model_dir=Path("m"),
                                    prepacked_note="pre-packed copy m/prepacked not used (--no-prepacked)")
    assert graph_line(decoder) == "graph: m/model.onnx; pre-packed copy m/prepacked not used (--no-prepacked)"
    assert graph_line(types.SimpleNamespace(prepacked_path=None, model_dir=Path("m"), prepacked_note="")) == \
        "graph: m/model.onnx"
    copy = types.SimpleNamespace(prepacked_path=Path("m/prepacked/model.onnx"), model_dir=Path("m"), prepacked_note="x")
    assert graph_line(copy) == "graph: m/prepacked/model.onnx (pre-packed copy)"


def test_a_transformers_folder_as_reference_is_named_as_one(tiny_int8_export, tiny_dir):
    """--reference given the source's transformers folder said "…/model.onnx: no exported model here"
    without naming --reference or the keyword that runs transformers (a break-it run)."""
    result = runner.invoke(app, ["quality", "--model", str(tiny_int8_export), "--tokens", "40",
                                 "--reference", str(tiny_dir)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"error: --reference {tiny_dir}: a model folder with config.json, not an export; --reference transformers runs "
        f"transformers on the export's own source, or give an export of this folder (gemma-export --source {tiny_dir} "
        "--dtype fp32 --out DIR, then --reference DIR)"]
