"""``gemma-export bench`` on a tiny export: the figures it reports are the ones it measured."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
import time
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from gemma_export import bench as bench_module
from gemma_export.bench import WARMUP_STEPS, run_bench
from gemma_export.cli import app

runner = CliRunner()


def test_bench_reports_every_prompt_and_step(tiny_int8_export, text_file):
    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=(8, 4), new_tokens=7, text=text_file)
    assert list(r.prefill_ms) == [4, 8]
    assert all(ms > 0 for ms in r.prefill_ms.values())
    # every decode step after warm-up, with the context length it ran at
    expected = [n + step + 1 for n in (4, 8) for step in range(WARMUP_STEPS, 7)]
    assert [ctx for ctx, _ in r.decode_curve] == expected
    times = sorted(ms for _, ms in r.decode_curve)
    assert r.decode_ms_median == pytest.approx(times[len(times) // 2] if len(times) % 2 else
                                               (times[len(times) // 2 - 1] + times[len(times) // 2]) / 2)
    assert r.decode_ms_p90 == pytest.approx(float(np.percentile(times, 90)))
    import statistics

    steps = 7 - WARMUP_STEPS  # the curve lists the 4-token prompt's steps, then the 8-token one's
    assert list(r.decode_ms_median_by_prompt) == [4, 8]
    assert r.decode_ms_median_by_prompt[4] == statistics.median(ms for _, ms in r.decode_curve[:steps])
    assert r.decode_ms_median_by_prompt[8] == statistics.median(ms for _, ms in r.decode_curve[steps:])
    assert r.tokens_per_s == pytest.approx(1e3 / r.decode_ms_median)
    files = [p for p in tiny_int8_export.iterdir() if p.name.startswith("model.onnx")]
    assert r.archive_bytes == sum(p.stat().st_size for p in files)
    assert r.peak_rss_bytes >= r.rss_growth_bytes > 0
    assert r.text_source == str(text_file)


def test_bench_tokenizes_only_the_prefix_its_prompts_need(tiny_int8_export, tmp_path, monkeypatch):
    """A huge --text is not tokenized whole (a 300 MB file ran the machine out of memory): bench
    encodes a prefix, and its prompts are the whole text's first tokens."""
    from gemma_export.runtime import load_tokenizer

    sentence = "the quick brown fox jumps over the lazy dog; many hands make light work. "
    big = tmp_path / "big.txt"
    big.write_text(sentence * 40_000)  # ~3 MB
    encoded: list[int] = []

    class Recording:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def encode(self, text):
            encoded.append(len(text))
            return self.tokenizer.encode(text)

    monkeypatch.setattr("gemma_export.runtime.load_tokenizer", lambda folder: Recording(load_tokenizer(folder)))
    prompts: list[list[int]] = []
    from gemma_export.runtime import OnnxDecoder

    real_greedy = OnnxDecoder.greedy
    monkeypatch.setattr(OnnxDecoder, "greedy", lambda self, ids, *a, **k: (prompts.append(list(ids)), real_greedy(self, ids, *a, **k))[1])
    run_bench(tiny_int8_export, threads=1, prompt_tokens=(4, 8), new_tokens=WARMUP_STEPS + 1, text=big)
    assert encoded and max(encoded) <= 8192, encoded  # a prefix, not the 3 MB
    whole = load_tokenizer(tiny_int8_export).encode(sentence * 40).ids
    assert prompts == [whole[:4], whole[:8]]


def test_a_text_prefix_drops_a_character_cut_at_its_end(tmp_path):
    from gemma_export.errors import FormatError
    from gemma_export.text_files import read_text_file

    path = tmp_path / "t.txt"
    path.write_text("\ufeff" + "é" * 10, encoding="utf-8")  # BOM (3 bytes), then 2 bytes per character
    assert read_text_file(path, "text file", 8) == "éé"  # 3 + 2 + 2, and the 8th byte starts a cut 'é'
    assert read_text_file(path, "text file", 9) == "ééé"
    assert read_text_file(path, "text file", 10 ** 6) == read_text_file(path, "text file") == "é" * 10
    path.write_bytes(b"ab\xffcdef")  # not UTF-8 inside the prefix: still named
    with pytest.raises(FormatError, match="expected UTF-8 text, found byte 0xff at offset 2"):
        read_text_file(path, "text file", 4)


def test_a_file_that_itself_ends_inside_a_character_is_refused_even_at_exactly_max_bytes(tmp_path):
    # only a character cut by max_bytes is dropped; a file of exactly max_bytes whose own last
    # character is incomplete is not UTF-8, as without max_bytes
    from gemma_export.errors import FormatError
    from gemma_export.text_files import read_text_file

    path = tmp_path / "t.txt"
    path.write_bytes(b"ab\xc3")  # 'a', 'b', and the first byte of a two-byte character
    for max_bytes in (None, 3, 10):
        with pytest.raises(FormatError, match="expected UTF-8 text, found byte 0xc3 at offset 2"):
            read_text_file(path, "text file", max_bytes)
    assert read_text_file(path, "text file", 2) == "ab"  # a prefix that stops before it is fine


def test_threads_come_from_the_option_then_the_board_then_the_default(tiny_int8_export, text_file, monkeypatch):
    """--threads given wins over --board's (it ran the board's 2 silently); without it the board's,
    without both the default 2. Checked on the sessions bench creates."""
    from gemma_export import runtime

    made = []
    create = runtime.create_session
    monkeypatch.setattr(runtime, "create_session",
                        lambda path, threads=None, *a, **k: made.append(threads) or create(path, threads, *a, **k))
    for threads, board, expected in ((1, "sl2610", 1), (None, "sl2610", 2), (None, None, 2), (3, None, 3)):
        r = run_bench(tiny_int8_export, threads=threads, board=board, prompt_tokens=(4,), new_tokens=WARMUP_STEPS + 1,
                      text=text_file)
        assert r.threads == expected and made[-1] == expected, (threads, board, made)


def test_bench_prefill_in_chunks(tiny_int8_export, text_file, monkeypatch):
    from gemma_export.runtime import KVCache

    sizes = []
    step = KVCache.step
    monkeypatch.setattr(KVCache, "step", lambda self, ids, *a: sizes.append(ids.shape[1]) or step(self, ids, *a))
    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=(8,), new_tokens=6, text=text_file, prefill_chunk=3)
    assert sizes == [3, 3, 2] + [1] * 6  # the 8-token prompt in steps of 3, then one token per step
    assert r.prefill_chunk == 3 and "(steps of 3)" in bench_module.format_result(r)


def test_bench_cli_json_and_board(tiny_int8_export, text_file, tmp_path, monkeypatch):
    # the in-process peak (VmHWM) includes whatever ran before in this pytest process: pin it
    monkeypatch.setattr(bench_module, "peak_rss_bytes", lambda: 700_000_000)
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "5", "--new-tokens", "6",
                                 "--board", "sl2610", "--text", str(text_file), "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    assert figures["threads"] == 2 and figures["board"] == "sl2610"
    assert list(figures["prefill_ms"]) == ["5"]
    assert "board sl2610: fits: peak leaves 1,200 MB of its 1.9 GB (at least 300 MB must stay free)" in result.stdout
    assert (figures["board_headroom_bytes"], figures["board_fits"]) == (300_000_000, True)
    # the board sets threads and the budget; the times are this machine's, and the report says so
    import dataclasses
    import os
    import platform
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} CPUs"
    assert figures["machine"] == machine
    assert f"the times above were measured on this machine ({machine}), with 2 threads" in result.stdout
    # --threads wins over the board's count, and the line names the count used (review finding)
    fields = {f.name for f in dataclasses.fields(bench_module.BenchResult)}
    one = bench_module.BenchResult(**{**{k: v for k, v in figures.items() if k in fields}, "threads": 1,
                                      "prefill_ms": {5: 1.0}})
    assert "measured on this machine" in bench_module.format_result(one)
    assert bench_module.format_result(one).endswith(f"({machine}), with 1 thread")
    # prepack is named for an export of this toolkit only (a helper: on onnxruntime-genai's folder it
    # pointed at prepack, which refuses that folder)
    heap = dataclasses.replace(one, prepacked=None, prepacked_note="")
    assert "; `gemma-export prepack` maps them from disk" in bench_module.format_result(heap)
    other = tmp_path / "genai-int4"
    other.mkdir()
    assert "gemma-export prepack" not in bench_module.format_result(dataclasses.replace(heap, model=str(other)))
    assert figures["new_tokens"] == 6
    assert "after the 5-token prompt and its 6 decode steps, the KV cache freed: Anonymous" in result.stdout  # what the growth covers


def test_bench_fails_when_the_board_budget_is_exceeded(tiny_int8_export, text_file, monkeypatch):
    from gemma_export import boards

    monkeypatch.setitem(boards.BOARDS, "tinyboard", boards.Board(
        title="tiny", threads=1, memory_bytes=100_000_000, headroom_bytes=50_000_000, python="3.12", platforms=()))
    monkeypatch.setattr(bench_module, "peak_rss_bytes", lambda: 108_000_000)  # beyond the whole budget
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "4", "--new-tokens", "5",
                                 "--board", "tinyboard", "--text", str(text_file)])
    assert result.exit_code == 1  # a verdict, as parity's FAIL; 2 stays for bad input
    assert "board tinyboard: does NOT fit: peak exceeds its 0.1 GB by 8 MB" in result.stdout  # not "-8 MB left"
    assert ("peak resident memory 108 MB exceeds the tinyboard's 0.1 GB by 8 MB; at least 50 MB must stay free, so the "
            "model may use 50 MB: 58 MB over" in result.output), result.output
    monkeypatch.setattr(bench_module, "peak_rss_bytes", lambda: 70_000_000)  # inside it, but not 50 MB under
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "4", "--new-tokens", "5",
                                 "--board", "tinyboard", "--text", str(text_file)])
    assert result.exit_code == 1
    assert ("peak resident memory 70 MB leaves 30 MB of the tinyboard's 0.1 GB; at least 50 MB must stay free, so the "
            "model may use 50 MB: 20 MB over" in result.output)  # a break-it run: "by 8 MB" read as the overshoot
    assert "decode           median" in result.output  # the figures are shown before the verdict


def test_run_bench_takes_a_range_and_names_bad_values_as_config_errors(tiny_int8_export, text_file):
    """``prompt_tokens: Sequence[int]`` refused a range; range and conflict errors are ConfigError,
    as the type errors are (they were the base class)."""
    from gemma_export.errors import ConfigError

    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=range(4, 9, 4), new_tokens=WARMUP_STEPS + 1,
                  text=text_file)
    assert list(r.prefill_ms) == [4, 8]
    for kwargs, message in [(dict(prompt_tokens=range(0, 2)), "--prompt-tokens: expected positive lengths, found [0, 1]"),
                            (dict(new_tokens=WARMUP_STEPS), f"--new-tokens: expected more than {WARMUP_STEPS}"),
                            (dict(board="pi5"), "--board: unknown board 'pi5'"),
                            (dict(threads=0), "--threads 0: expected 1 to ")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            run_bench(tiny_int8_export, **{"threads": 1, "text": text_file, "prompt_tokens": (4,),
                                           "new_tokens": WARMUP_STEPS + 1, **kwargs})


@pytest.mark.parametrize("args, message", [
    (["--prompt-tokens", "4,x"], "--prompt-tokens: expected comma-separated integers, found '4,x'"),
    (["--prompt-tokens", "8,,9"], "--prompt-tokens: expected comma-separated integers, found '8,,9'"),
    (["--prompt-tokens", "\u0663"], "--prompt-tokens: expected comma-separated integers, found '\u0663'"),  # an Arabic-Indic 3
    (["--prompt-tokens", "16_0"], "--prompt-tokens: expected comma-separated integers, found '16_0'"),  # int() reads 160
    (["--prompt-tokens", "0"], "--prompt-tokens: expected positive lengths"),
    (["--prompt-tokens", "8,4,8"], "--prompt-tokens: each length once; 8 given more than once"),
    (["--new-tokens", "2"], f"--new-tokens: expected more than {WARMUP_STEPS}"),
    (["--board", "pi5"], "--board: unknown board 'pi5'; known: sl2610"),
    (["--prompt-tokens", "4000"], "need 4128 positions; the model's max_position_embeddings is 256"),
    (["--json", "/nonexistent/dir/b.json"], "--json /nonexistent/dir/b.json: folder /nonexistent/dir does not exist"),
    (["--plot", "curve.txt"], "--plot curve.txt: expected a .png file name"),
    (["--json", "/proc/b.json"], "--json /proc/b.json: cannot write a file in /proc"),
    (["--reference", "/nonexistent/gemma.mlir"], "/nonexistent/gemma.mlir: no such reference MLIR file (--reference)"),
    (["--reference", "/tmp"], "/tmp: is a folder; expected a reference MLIR file (--reference)"),
    (["--reference-weights", "/tmp/x.safetensors"], "--reference-weights applies to --reference, which is not given"),
])
def test_bench_bad_arguments(tiny_int8_export, text_file, args, message):
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--text", str(text_file), *args])
    assert result.exit_code == 2
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bench_times_the_reference_export_under_iree(tiny_int8_export, tiny_model, text_file, tmp_path):
    importlib.import_module("iree.runtime")  # test extra: fail, do not skip, when missing
    from jax_reference import SEQ, write_jax_reference

    mlir = write_jax_reference(tiny_model, tmp_path / "ref", "bf16")  # the same tiny model as the export
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "6", "--new-tokens", "6",
                                 "--text", str(text_file), "--reference", str(mlir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    figures = json.loads(out.read_text())
    ref = figures["reference"]
    # the export's side of the ratio is its own measured decode median for the 6-token prompt
    assert ref["export_decode_ms_median"] == figures["decode_ms_median_by_prompt"]["6"]
    assert ref["sequence_length"] == SEQ and ref["prompt_tokens"] == 16 and ref["new_tokens"] == SEQ - 16
    assert ref["ms_per_token_median"] > 0
    assert ref["export_vs_reference"] == pytest.approx(ref["export_decode_ms_median"] / ref["ms_per_token_median"])
    assert f"{ref['export_vs_reference']:.3f}x the reference" in result.stdout
    assert result.stderr.endswith(f"wrote {out}\n")  # where the report went, as generate --json says
    assert ref["compile_and_load_s"] > 0 and "in a child process" in result.stderr


def test_drop_page_cache_writes_1_after_sync_or_names_the_file(tmp_path, monkeypatch):
    from gemma_export import bench
    from gemma_export.errors import GemmaExportError

    switch = tmp_path / "drop_caches"
    switch.write_text("0\n")
    monkeypatch.setattr(bench, "DROP_CACHES", switch)
    bench.drop_page_cache()
    assert switch.read_text() == "1\n"  # 1: the clean page cache only (not dentries and inodes)
    missing = tmp_path / "no-proc" / "drop_caches"
    monkeypatch.setattr(bench, "DROP_CACHES", missing)
    with pytest.raises(GemmaExportError, match=f"{missing}: cannot drop the page cache .*need root on Linux"):
        bench.drop_page_cache()


@pytest.mark.parametrize("flag, moved", [([], 5 << 20), (["--no-huge-pages"], 0)])
def test_bench_reports_the_heap_moved_onto_huge_pages(tiny_int8_export, text_file, tmp_path, monkeypatch, flag, moved):
    from gemma_export import memory

    calls = []
    monkeypatch.setattr(memory, "collapse_to_huge_pages", lambda: calls.append(1) or 5 << 20)
    out = tmp_path / "bench.json"
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "5", "--new-tokens", "6",
                                 "--text", str(text_file), "--json", str(out), "--no-prepacked", *flag])
    assert result.exit_code == 0, result.output
    assert len(calls) == (1 if moved else 0)
    assert json.loads(out.read_text())["huge_page_bytes"] == moved
    assert ("(5 MB of the process's heap moved onto huge pages" in result.stdout) == bool(moved)  # 5 MiB = 5.24 MB


def test_bench_json_dash_goes_to_stdout_and_a_file_as_folder_is_named(tiny_int8_export, text_file, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--text", str(text_file),
                                 "--prompt-tokens", "4", "--new-tokens", "6", "--json", "-"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "-").exists()
    figures = json.loads(result.stdout)  # the JSON alone: the text report went to stderr
    assert list(figures["prefill_ms"]) == ["4"] and figures["model"] == str(tiny_int8_export)
    assert "decode           median" in result.stderr
    (tmp_path / "afile").write_text("x")
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--json", "afile/b.json"])
    assert result.exit_code == 2 and f"--json afile/b.json: {tmp_path / 'afile'} is a file, not a folder" in result.output


def test_json_and_plot_overwrite_a_previous_report_but_no_other_file(tiny_int8_export, tmp_path):
    """--json named the export's source weights by mistake: refused, the file kept; an earlier
    report (JSON) or an empty file is replaced."""
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    before = weights.read_bytes()
    generate = ["generate", "--model", str(tiny_int8_export), "--prompt", "the", "--max-new-tokens", "2"]
    result = runner.invoke(app, generate + ["--json", str(weights)])
    assert result.exit_code == 2, result.output
    assert f"--json {weights}: exists and is not a JSON report; refusing to overwrite it" in result.output
    assert weights.read_bytes() == before
    config = tmp_path / "config.json"  # JSON, but a model folder's own file
    config.write_text('{"model_type": "gemma3_text"}')
    result = runner.invoke(app, generate + ["--json", str(config)])
    assert result.exit_code == 2 and "exists and is a model folder's config.json, not a JSON report" in result.output
    assert config.read_text() == '{"model_type": "gemma3_text"}'
    report = tmp_path / "golden.json"
    for old in ('{"expected_ids": [5], "old": 1}', ""):  # an earlier golden entry, or an empty file
        report.write_text(old)
        result = runner.invoke(app, generate + ["--json", str(report)])
        assert result.exit_code == 0, result.output
        assert len(json.loads(report.read_text())["expected_ids"]) == 2
    # JSON, but another command's or someone's: a prompts list, a bench report given to generate
    prompts = tmp_path / "prompts.json"
    for other in ('["a prompt", [2, 5, 7]]', '{"decode_ms_median": 12.5}'):
        prompts.write_text(other)
        result = runner.invoke(app, generate + ["--json", str(prompts)])
        assert result.exit_code == 2, result.output
        assert (f"--json {prompts}: exists and is JSON but not an earlier report of this command (no top-level key "
                "'expected_ids'); refusing to overwrite it") in result.output
        assert prompts.read_text() == other
    # an earlier report made read-only: the rename replaced it (mode 644 after), whatever its mode
    report.write_text('{"expected_ids": [5], "old": 1}')
    report.chmod(0o444)
    result = runner.invoke(app, generate + ["--json", str(report)])
    assert result.exit_code == 2, result.output
    assert f"--json {report}: exists and is write-protected (mode 444); refusing to overwrite it" in result.output
    assert report.read_text() == '{"expected_ids": [5], "old": 1}' and report.stat().st_mode & 0o777 == 0o444
    picture = tmp_path / "notes.png"
    picture.write_text("my notes")
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--plot", str(picture)])
    assert result.exit_code == 2 and "exists and is not a PNG image" in result.output
    assert picture.read_text() == "my notes"


def test_json_to_a_descriptor_is_written_in_place_even_when_it_leads_to_a_file(tmp_path):
    """`--json /dev/stderr 2>>log`: /dev and /proc paths are streams, checked as such, not as the file
    they lead to (a log with earlier lines in it)."""
    import subprocess
    import sys

    log = tmp_path / "err.log"
    log.write_text("earlier lines\n")
    code = ("from gemma_export.bench import check_outputs, write_json; check_outputs('/dev/stderr', None); "
            "write_json({'x': 1}, '/dev/stderr')")
    with open(log, "a") as err:
        subprocess.run([sys.executable, "-c", code], stderr=err, check=True)
    text = log.read_text()
    assert text.startswith("earlier lines\n") and json.loads(text.split("\n", 1)[1]) == {"x": 1}


def test_json_to_a_descriptor_that_is_a_pipe_is_written_in_place():
    """`--json /dev/stderr 2>&1 | ...` and a shell's `--json >(...)`: the descriptor is a pipe, whose
    resolved path (/proc/PID/fd/pipe:[N]) is no file in a folder; it is written, not refused."""
    import subprocess
    import sys

    code = ("from gemma_export.bench import check_outputs, write_json; check_outputs('/dev/stderr', None); "
            "check_outputs('/dev/fd/2', None); write_json({'x': 2}, '/dev/stderr')")
    proc = subprocess.run([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    assert proc.returncode == 0 and json.loads(proc.stderr) == {"x": 2}, proc.stderr


@pytest.mark.parametrize("option, expected", [([], [4, 4, 1]), (["--prefill-chunk", "0"], [9]),
                                               (["--prefill-chunk", "5"], [5, 4])])
def test_generate_and_bench_feed_prompts_in_default_steps(tiny_int8_export, text_file, monkeypatch, option, expected):
    """Without --prefill-chunk a prompt goes in steps of runtime.DEFAULT_PREFILL_CHUNK (patched to 4
    here: the tiny model holds 256 positions, the real default is 512); 0 feeds it in one step."""
    from gemma_export import runtime
    from gemma_export.cli import PREFILL_CHUNK_HELP

    assert f"default {runtime.DEFAULT_PREFILL_CHUNK}," in PREFILL_CHUNK_HELP  # the help names the real default
    monkeypatch.setattr(runtime, "DEFAULT_PREFILL_CHUNK", 4)
    sizes = []
    step = runtime.KVCache.step
    monkeypatch.setattr(runtime.KVCache, "step", lambda self, ids, *a: sizes.append(ids.shape[1]) or step(self, ids, *a))
    prompt = "hello wo"  # <bos> + 8 characters of the tiny character-level tokenizer
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", prompt,
                                      "--max-new-tokens", "3", *option])
    assert result.exit_code == 0, result.output
    assert sizes == expected + [1, 1]
    sizes.clear()
    result = CliRunner().invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "9", "--new-tokens",
                                      str(WARMUP_STEPS + 1), "--text", str(text_file), "--threads", "1", *option])
    assert result.exit_code == 0, result.output
    assert sizes[:len(expected)] == expected and set(sizes[len(expected):]) == {1}
    assert ("(steps of" in result.stdout) == (len(expected) > 1)


def test_generate_writes_a_golden_entry_that_parity_checks(tiny_int8_export, tmp_path):
    """`generate --json` writes the prompt's and the new tokens' ids in the golden format: `parity
    --golden` on the same export matches, and fails at the first id changed; `--json -` keeps
    stdout for the JSON alone; an output inside the export is refused before any work."""
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    golden = tmp_path / "golden.json"
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox",
                                      "--max-new-tokens", "6", "--json", str(golden)])
    assert result.exit_code == 0, result.output
    entry = json.loads(golden.read_text())
    prompt_ids = load_tokenizer(tiny_int8_export).encode("the fox").ids
    assert entry["prompt_ids"] == prompt_ids and entry["prompt"] == "the fox" and entry["prefill_chunk"] == 512
    assert entry["dtype"] == "int8"
    assert entry["expected_ids"] == OnnxDecoder(tiny_int8_export).greedy(prompt_ids, 6)[0]
    assert result.stdout.startswith("the fox" + entry["text"])
    checked = CliRunner().invoke(app, ["parity", "--model", str(tiny_int8_export), "--golden", str(golden)])
    assert checked.exit_code == 0, checked.output
    assert "golden entry #0: match" in checked.stdout
    entry["expected_ids"][2] = (entry["expected_ids"][2] + 1) % 96
    golden.write_text(json.dumps(entry))
    checked = CliRunner().invoke(app, ["parity", "--model", str(tiny_int8_export), "--golden", str(golden)])
    assert checked.exit_code == 1 and "first mismatch at generated token 2" in checked.stdout

    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox",
                                      "--max-new-tokens", "6", "--json", "-"])
    assert result.exit_code == 0 and json.loads(result.stdout)["prompt_ids"] == prompt_ids
    inside = tiny_int8_export / "golden.json"
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox",
                                      "--json", str(inside)])
    assert result.exit_code != 0 and "would write into the input folder" in result.output and not inside.exists()


def test_write_json_replaces_the_file_a_link_names_and_writes_devices_in_place(tmp_path, capsys):
    import stat

    from gemma_export.bench import to_stdout, write_json

    target = tmp_path / "target.json"
    target.write_text('{"old": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_json({"new": 2}, link)
    assert link.is_symlink() and json.loads(target.read_text()) == {"new": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "target.json"]  # no temporary left
    # /dev/stdout (a link to a descriptor) is standard output, never replaced by a regular file
    assert to_stdout("/dev/stdout") and to_stdout("-") and not to_stdout(target) and not to_stdout(None)
    write_json({"x": 3}, "/dev/stdout")
    assert json.loads(capsys.readouterr().out) == {"x": 3}
    write_json({"x": 4}, "/dev/null")  # a device: written in place
    assert stat.S_ISCHR(Path("/dev/null").stat().st_mode) and Path("/dev/stdout").is_symlink()


def test_parity_feeds_a_golden_prompt_in_the_steps_generate_used(tiny_int8_export, tmp_path, monkeypatch):
    """int8 logits depend on how the prompt is stepped (activation rounding): the golden entry
    records generate's --prefill-chunk and parity --golden replays it (0: one step)."""
    from gemma_export.runtime import OnnxDecoder

    golden = tmp_path / "g.json"
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the quick fox",
                                      "--max-new-tokens", "4", "--prefill-chunk", "3", "--json", str(golden)])
    assert result.exit_code == 0, result.output
    entry = json.loads(golden.read_text())
    assert entry["prefill_chunk"] == 3
    used = []
    greedy = OnnxDecoder.greedy

    def spy(self, prompt_ids, max_new_tokens, stop_ids=None, prefill_chunk=512):
        used.append(prefill_chunk)
        return greedy(self, prompt_ids, max_new_tokens, stop_ids, prefill_chunk)

    monkeypatch.setattr(OnnxDecoder, "greedy", spy)
    one_step, default = dict(entry, prefill_chunk=0), {k: v for k, v in entry.items() if k != "prefill_chunk"}
    golden.write_text(json.dumps([entry, one_step, default]))
    checked = CliRunner().invoke(app, ["parity", "--model", str(tiny_int8_export), "--golden", str(golden)])
    assert checked.exit_code == 0, checked.output
    assert used == [3, None, 512]


def test_bench_checks_the_positions_before_creating_the_session(tiny_int8_export, text_file, tmp_path, monkeypatch):
    """The longest prompt, its first token and new_tokens steps: prompt + new_tokens positions (the
    last token is never fed back), checked against the manifest before the session is created."""
    from conftest import export_with_config
    from gemma_export import runtime

    model = export_with_config(tiny_int8_export, tmp_path / "model", max_position_embeddings=16)
    fits = run_bench(model, prompt_tokens=[8], new_tokens=8, text=text_file)  # 8 + 8 = 16 positions
    assert fits.new_tokens == 8

    def no_session(*args, **kwargs):
        raise AssertionError("the session was created before the length check")

    monkeypatch.setattr(runtime, "OnnxDecoder", no_session)
    # the longest prompt of several, not the first given (a mutation checked the first: the 4-token
    # prompt was then timed in vain before the 8-token one failed)
    for lengths in ("8", "4,8"):
        result = runner.invoke(app, ["bench", "--model", str(model), "--prompt-tokens", lengths, "--new-tokens", "9",
                                     "--text", str(text_file)])
        assert result.exit_code == 2
        assert result.stderr == (f"error: {model}: the longest prompt (8 tokens) and 9 decode steps need 17 positions; "
                                 "the model's max_position_embeddings is 16\n")
    # a length the model allows but the text does not have
    (tmp_path / "few.txt").write_text("the fox")
    result = runner.invoke(app, ["bench", "--model", str(model), "--prompt-tokens", "10", "--new-tokens", "6",
                                 "--text", str(tmp_path / "few.txt")])
    assert result.exit_code == 2 and result.stderr == (
        f"error: {tmp_path / 'few.txt'}: 8 tokens (with <bos>), fewer than the longest prompt (10); give a longer "
        "--text or shorter --prompt-tokens\n"), result.stderr
    # hostile-found: a length no text could fit was answered "give a longer --text"; the model's limit comes first
    short = tmp_path / "short.txt"
    short.write_text("A few words of real text.")
    result = runner.invoke(app, ["bench", "--model", str(model), "--prompt-tokens", "99999999", "--text", str(short)])
    assert result.exit_code == 2
    assert result.stderr == (f"error: {model}: the longest prompt (99999999 tokens) and 128 decode steps need "
                             "100000127 positions; the model's max_position_embeddings is 16\n")


def test_bench_refuses_a_bad_reference_and_out_of_vocabulary_prompts_before_timing(tiny_int8_export, tiny_model,
                                                                                    text_file, tmp_path):
    """What would fail only after minutes of measuring is refused before the first prompt is timed:
    a reference whose function is not the re-decode signature (found when it was compiled, after the
    bench), and a tokenizer that gives ids beyond the graph's vocabulary in a later prompt only."""
    from jax_reference import write_jax_reference

    mlir = write_jax_reference(tiny_model, tmp_path / "ref", "bf16")
    text = mlir.read_text()
    assert "-> tensor<" in text
    wrong = tmp_path / "ref" / "wrong.mlir"
    wrong.write_text(text.replace("xi32>) -> tensor<", "xi32>) -> tensor<1x", 1))
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "6", "--new-tokens", "6",
                                 "--text", str(text_file), "--reference", str(wrong),
                                 "--reference-weights", str(mlir.with_suffix(".safetensors"))])
    assert result.exit_code == 2, result.output
    assert "no public re-decode function tensor<1xSxi32> -> tensor<Sxi32>" in result.stderr
    assert "prompt 6 tokens" not in result.output  # nothing was timed

    model = tmp_path / "m"
    shutil.copytree(tiny_int8_export, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    late = text_file.read_text()[12]  # a character of the second prompt only (the first has 6 tokens)
    assert late not in text_file.read_text()[:5]
    vocab[late] = 500  # beyond the graph's 96 rows
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = runner.invoke(app, ["bench", "--model", str(model), "--prompt-tokens", "6,20", "--new-tokens", "6",
                                 "--text", str(text_file)])
    assert result.exit_code == 2, result.output
    assert "500" in result.stderr and "does not match its graph" in result.stderr
    assert "prompt 6 tokens" not in result.output


@pytest.mark.parametrize("case", ["iree_refuses", "short_length", "smaller_vocabulary"])
def test_bench_finds_what_the_reference_cannot_run_before_it_measures(tiny_int8_export, tiny_model, text_file,
                                                                      tmp_path, case):
    """A helper's findings: a reference IREE refuses (here an unknown operation; the helper's was a
    byte-order mark), one of a fixed length under 5, or one whose vocabulary lacks the text's ids
    failed only after the whole measurement, its figures lost."""
    from conftest import make_tiny_model
    from jax_reference import SEQ, write_jax_reference

    source = make_tiny_model(vocab_size=40) if case == "smaller_vocabulary" else tiny_model
    mlir = write_jax_reference(source, tmp_path / "ref", "bf16")
    text = mlir.read_text()
    if case == "iree_refuses":
        body = next(i for i, line in enumerate(text.splitlines()) if line.strip().startswith("func.func @gemma")) + 1
        lines = text.splitlines()
        lines.insert(body, "    %bogus = stablehlo.no_such_op : tensor<f32>")
        text = "\n".join(lines) + "\n"
        expected = [f"{mlir}:{body + 1}:", "no_such_op"]
    elif case == "short_length":
        text = text.replace(f"1x{SEQ}xi32", "1x4xi32").replace(f"tensor<{SEQ}xi32>", "tensor<4xi32>")
        expected = [f"{mlir}: fixed length 4 leaves no room to time a re-decode loop"]
    else:
        expected = [f"{mlir}: token id", "outside the reference's vocabulary (40 rows)"]
    mlir.write_text(text)
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "6", "--new-tokens", "6",
                                 "--text", str(text_file), "--reference", str(mlir), "--json", str(tmp_path / "b.json")],
                           env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.exit_code == 2, result.output
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and all(part in error[0] for part in expected), result.stderr
    assert "prompt 6 tokens" not in result.output and "session created" not in result.output  # nothing measured
    assert not (tmp_path / "b.json").exists()


def test_the_growth_counts_the_session_not_the_import_of_onnx_and_onnxruntime(tiny_int8_export, text_file):
    # In a fresh process the first run imports onnx and onnxruntime (~20 MB of Anonymous memory on
    # x86-64); that is reported apart, and the growth of that run is no larger than a second run's,
    # which finds them imported.
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from gemma_export.bench import format_result, run_bench\n"
        "assert 'onnxruntime' not in sys.modules and 'onnx' not in sys.modules\n"
        f"runs = [run_bench({str(tiny_int8_export)!r}, threads=1, prompt_tokens=(4,), new_tokens=6, text={str(text_file)!r})"
        " for _ in range(2)]\n"
        "print(json.dumps([[r.anon_growth_short_bytes, r.anon_libraries_bytes, r.rss_libraries_bytes, r.anon_tokenizer_bytes, "
        "r.rss_tokenizer_bytes] for r in runs]))\n"
        "print(json.dumps([format_result(r).splitlines()[-4] for r in runs]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    (first, first_libs, first_rss, tokenizer_anon, tokenizer_rss), (second, second_libs, second_rss, *_) = json.loads(out[0])
    # the tiny character tokenizer alone, not the import of the tokenizers library (0.7 MB / 3.7 MB of its own)
    assert tokenizer_anon < 0.5e6 and tokenizer_rss < 3.5e6, (tokenizer_anon, tokenizer_rss)
    assert first_libs > 5e6 and first_rss > first_libs  # the libraries' own memory, measured
    assert abs(second_libs) < 1e6 and abs(second_rss) < 1e6  # nothing left to import
    assert first < second + 5e6, (first, second)  # not the ~20 MB of the imports on top of the session
    lines = json.loads(out[1])
    assert lines[0].startswith(f"libraries        importing onnx and onnxruntime took Anonymous {first_libs / 1e6:,.0f} MB")
    assert lines[1] == "libraries        onnx and onnxruntime were imported before this run"


def test_a_prompt_that_starts_with_bos_gets_one_and_control_token_text_the_tokenizer_lacks_is_named(tmp_path):
    # what the tokenizer's post-processor prepends is not doubled when the text starts with it (a
    # chat template's output does); <start_...>/<end_...>/<escape> text that is no token of this
    # tokenizer (FunctionGemma's function-calling tokens under Gemma 3's) is named, each once
    from tokenizers import AddedToken

    from conftest import write_char_tokenizer
    from gemma_export.runtime import encode_prompt, load_tokenizer, unknown_control_tokens

    tokenizer = load_tokenizer(write_char_tokenizer(tmp_path))
    tokenizer.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<start_of_turn>", special=True)])
    assert tokenizer.encode("<bos>ab").ids[:2] == [2, 2]  # the premise: two of them without encode_prompt
    assert encode_prompt(tokenizer, "<bos>ab") == encode_prompt(tokenizer, "ab") == tokenizer.encode("ab").ids
    assert encode_prompt(tokenizer, "a<bos>b") == tokenizer.encode("a<bos>b").ids  # only a leading one
    assert encode_prompt(tokenizer, "<bos><bos>ab")[:2] == [2, 2]  # the text's own two are kept
    text = "<start_of_turn>a<start_function_call>b<escape><start_function_call><end_of_turn>"
    assert unknown_control_tokens(tokenizer, text) == ["<start_function_call>", "<escape>", "<end_of_turn>"]
    assert unknown_control_tokens(tokenizer, "<b>plain <tags> and <start_of_turn>") == []


def test_generate_names_control_token_text_read_as_plain_text(tiny_int8_export):
    result = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt",
                                      "the <start_function_call>fox<start_foo>", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    tokenizer = tiny_int8_export / "tokenizer.json"
    assert notes == [f"note: <start_function_call> is not a token of {tokenizer}; it was read as plain text "
                     "(FunctionGemma's function-calling tokens exist in its own tokenizer only)",
                     f"note: <start_foo> is not a token of {tokenizer}; it was read as plain text"]  # not FunctionGemma's
    plain = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox",
                                     "--max-new-tokens", "2"])
    assert plain.exit_code == 0 and "note: " not in plain.stderr


@pytest.mark.parametrize("args", [
    ["generate", "--model", "{model}", "--prompt", "the", "--json", "reports/"],
    ["bench", "--model", "{model}", "--json", "reports/"],
    ["bench", "--model", "{model}", "--plot", "plots/"],
    ["parity", "--model", "{model}", "--json", "reports/"],
    ["quality", "--model", "{model}", "--json", "reports/"],
    ["generate", "--model", "{model}", "--prompt", "the", "--json", "reports/."],
    ["bench", "--model", "{model}", "--json", "reports/.."],
])
def test_an_output_file_name_ending_in_a_slash_is_refused_not_written_as_a_file(tiny_int8_export, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [a.format(model=tiny_int8_export) for a in args])
    assert result.exit_code == 2, result.output
    assert "names a folder (it ends in '/', '.' or '..'); expected a file name" in result.output
    assert list(tmp_path.iterdir()) == []


def test_json_and_plot_on_the_same_file_are_refused_before_measuring(tiny_int8_export, tmp_path):
    same = tmp_path / "out.png"
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--json", str(same), "--plot",
                                 str(tmp_path / "." / "out.png")])
    assert result.exit_code == 2, result.output
    assert f"--json {same} and --plot {tmp_path / '.' / 'out.png'} name the same file; give each its own" in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--huge-pages", "--no-huge-pages"])
def test_huge_pages_with_prepacked_are_refused_as_doing_nothing(tiny_int8_export, flag):
    result = runner.invoke(app, ["bench", "--model", str(tiny_int8_export), "--prepacked", flag])
    assert result.exit_code == 2, result.output
    assert ("applies to weights packed on the heap, and --prepacked maps them from disk; give one or the other"
            in result.output)


def test_a_json_name_in_a_loop_of_links_is_refused_in_one_line(tiny_int8_export, tmp_path):
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    result = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the", "--json",
                                 str(tmp_path / "a.json")])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: --json {tmp_path / 'a.json'}: cannot be resolved (")
    assert result.output.strip().endswith("give a file name that leads to a file")


def test_huge_pages_given_while_the_copy_is_used_by_default_gets_a_note(tiny_int8_export, text_file, tmp_path):
    import shutil

    from gemma_export.prepack import prepack

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    prepack(model)
    result = runner.invoke(app, ["bench", "--model", str(model), "--text", str(text_file), "--prompt-tokens", "4",
                                 "--new-tokens", "6", "--huge-pages"])
    assert result.exit_code == 0, result.output
    assert ("note: --huge-pages did nothing: the folder's pre-packed copy was used (its weights are mapped from disk); "
            "--no-prepacked measures the heap") in result.output
    result = runner.invoke(app, ["bench", "--model", str(model), "--text", str(text_file), "--prompt-tokens", "4",
                                 "--new-tokens", "6"])
    assert result.exit_code == 0 and "did nothing" not in result.output, result.output


def test_a_json_name_whose_folder_passes_through_a_loop_of_links_is_refused_before_the_run(tiny_int8_export, tmp_path):
    (tmp_path / "la").symlink_to(tmp_path / "lb")
    (tmp_path / "lb").symlink_to(tmp_path / "la")
    name = f"{tmp_path / 'la'}/../out.json"
    result = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the", "--json", name])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: --json {name}: its folder {tmp_path / 'la'}/.. cannot be reached (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["la", "lb"]


class _FakeFigure:
    """Stands in for a matplotlib figure: ``savefig`` writes ``data`` to the file it is given, then
    raises ``error`` if one is set (a disk that fills up mid-write)."""

    def __init__(self, data: bytes, error: BaseException | None):
        self.data, self.error, self.saved_to = data, error, []

    def tight_layout(self):
        pass

    def savefig(self, path, **kwargs):
        self.saved_to.append(Path(path))
        Path(path).write_bytes(self.data)
        if self.error is not None:
            raise self.error


def _fake_pyplot(figure):
    import types

    axes = types.SimpleNamespace(**{name: (lambda *a, **k: None) for name in
                                    ("plot", "set_xlabel", "set_ylabel", "set_ylim", "legend", "grid")})
    figure.closed = 0

    def close(fig):
        fig.closed += 1
    return types.SimpleNamespace(subplots=lambda **k: (figure, axes), close=close)


def _result_for_plot():
    return bench_module.BenchResult("m", 2, 1, 0.1, {16: 1.0}, 2.0, 3.0, 500.0, [(17, 2.0), (18, 2.5)],
                                    0, 0, 0, 0, 0, "text")


def test_a_plot_that_fails_mid_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    from gemma_export.errors import OutputError

    picture = tmp_path / "curve.png"
    picture.write_bytes(b"the previous plot")
    figure = _FakeFigure(b"half a pl", OSError(28, "No space left on device"))
    monkeypatch.setattr(bench_module, "_pyplot", lambda: _fake_pyplot(figure))
    with pytest.raises(OutputError, match=rf"^--plot {picture}: cannot write: No space left on device$"):
        bench_module.write_plot([_result_for_plot()], picture)
    assert picture.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]  # the half-written temporary removed
    assert figure.saved_to[0] != picture  # written beside it, not over it


@pytest.mark.parametrize("what", ["plot", "json"])
def test_ctrl_c_while_a_report_is_written_leaves_no_temporary(tmp_path, monkeypatch, what):
    """Only an OSError removed the temporary file: Ctrl-C or SIGTERM during savefig (hundreds of ms)
    or the write left .NAME.tmp-PID beside the user's --json or --plot file."""
    from pathlib import Path as _Path

    target = tmp_path / ("curve.png" if what == "plot" else "report.json")
    target.write_bytes(b"the previous report")
    if what == "plot":
        monkeypatch.setattr(bench_module, "_pyplot",
                            lambda: _fake_pyplot(_FakeFigure(b"half a pl", KeyboardInterrupt())))
    else:
        real = _Path.write_text

        def interrupted(self, *args, **kwargs):
            real(self, "{half", encoding="utf-8")
            raise KeyboardInterrupt
        monkeypatch.setattr(_Path, "write_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        if what == "plot":
            bench_module.write_plot([_result_for_plot()], target)
        else:
            bench_module.write_json({"a": 1}, target)
    assert target.read_bytes() == b"the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_bench_writes_its_json_and_plot_both_or_neither(tiny_int8_export, text_file, tmp_path, monkeypatch):
    """A break-it run: the JSON report was written (or an earlier one replaced) before the plot
    failed on a full disk, and the command exited 2 with the new report in place."""
    report, picture = tmp_path / "report.json", tmp_path / "curve.png"
    report.write_text('{"decode_ms_median": 1.0}')
    old_plot = b"\x89PNG\r\n\x1a\nthe previous plot"  # an earlier plot: a PNG's signature
    picture.write_bytes(old_plot)
    args = ["bench", "--model", str(tiny_int8_export), "--threads", "1", "--prompt-tokens", "4",
            "--new-tokens", str(WARMUP_STEPS + 1), "--text", str(text_file), "--json", str(report), "--plot", str(picture)]
    monkeypatch.setattr(bench_module, "_pyplot",
                        lambda: _fake_pyplot(_FakeFigure(b"half a pl", OSError(28, "No space left on device"))))
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and f"--plot {picture}: cannot write: No space left on device" in result.output
    assert f"wrote {report}" not in result.output
    assert report.read_text() == '{"decode_ms_median": 1.0}' and picture.read_bytes() == old_plot
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "report.json"]
    monkeypatch.setattr(bench_module, "_pyplot", lambda: _fake_pyplot(_FakeFigure(b"new plot", None)))
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert list(json.loads(report.read_text())["prefill_ms"]) == ["4"] and picture.read_bytes() == b"new plot"
    assert f"wrote {report}" in result.output and f"plot: {picture}" in result.output


def test_a_plot_whose_companion_write_fails_is_not_renamed_into_place(tmp_path, monkeypatch):
    """``before_rename`` raising (the JSON's own error, named as the JSON's) leaves the old plot."""
    from gemma_export.errors import OutputError

    picture = tmp_path / "curve.png"
    picture.write_bytes(b"the previous plot")
    monkeypatch.setattr(bench_module, "_pyplot", lambda: _fake_pyplot(_FakeFigure(b"new plot", None)))

    def report_fails():
        raise OutputError("--json r.json: cannot write: Read-only file system")
    with pytest.raises(OutputError, match=r"^--json r\.json: cannot write"):
        bench_module.write_plot([_result_for_plot()], picture, before_rename=report_fails)
    assert picture.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]

    def standard_output_fails():  # an OSError of its own (e.g. --json - into a closed pipe): not the plot's
        raise OSError(30, "Read-only file system")
    with pytest.raises(OSError) as raised:
        bench_module.write_plot([_result_for_plot()], picture, before_rename=standard_output_fails)
    assert not isinstance(raised.value, OutputError) and "--plot" not in str(raised.value)
    assert picture.read_bytes() == b"the previous plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]


def test_a_plot_replaces_the_file_a_link_names_and_keeps_the_link(tmp_path, monkeypatch):
    target = tmp_path / "plots" / "curve.png"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "latest.png"
    link.symlink_to(target)
    monkeypatch.setattr(bench_module, "_pyplot", lambda: _fake_pyplot(_FakeFigure(b"new plot", None)))
    bench_module.write_plot([_result_for_plot()], link)
    assert link.is_symlink() and target.read_bytes() == b"new plot"
    assert sorted(p.name for p in target.parent.iterdir()) == ["curve.png"]


def test_the_summary_gives_each_growth_as_a_ratio_of_the_archive_and_the_boards_room():
    r = bench_module.BenchResult("m", 2, 100_000_000, 0.5, {16: 10.0}, 5.0, 6.0, 200.0, [(17, 5.0)],
                                 anon_growth_short_bytes=50_000_000, rss_growth_short_bytes=150_000_000,
                                 anon_growth_bytes=50_000_000, rss_growth_bytes=150_000_000, peak_rss_bytes=1_900_000_000,
                                 text_source="t", board="sl2610", board_memory_bytes=1_900_000_000)
    text = bench_module.format_result(r)
    assert "Anonymous 50 MB (0.50x archive), Rss 150 MB (1.50x)" in text
    assert "in use" not in text  # not measured
    live = bench_module.format_result(dataclasses.replace(r, anon_in_use_bytes=61_000_000, rss_in_use_bytes=172_000_000,
                                                          in_use_prompt_tokens=16))
    assert ("in use           at the last step after the 16-token prompt, its KV cache live: Anonymous 61.0 MB "
            "(0.610x archive), Rss 172.0 MB (1.720x)") in live.splitlines()
    # three decimals: 1.1535 x is not shown as the 1.15 x it exceeds
    over = bench_module.format_result(dataclasses.replace(r, anon_in_use_bytes=115_350_000, rss_in_use_bytes=0,
                                                          in_use_prompt_tokens=16))
    assert "Anonymous 115.3 MB (1.153x archive)" in over
    assert "board sl2610: peak leaves 0 MB of its 1.9 GB" in text  # all of it used: "leaves 0", not "exceeds by 0"


@pytest.mark.parametrize("peak, refused", [(1_600_000_000, False), (1_600_000_001, True)])
def test_the_board_budget_allows_a_peak_of_exactly_its_memory_less_the_headroom(peak, refused):
    from gemma_export.boards import BOARDS
    from gemma_export.errors import BudgetExceeded

    spec = BOARDS["sl2610"]
    assert spec.memory_bytes - spec.headroom_bytes == 1_600_000_000
    r = bench_module.BenchResult("m", 2, 1, 0.5, {16: 10.0}, 5.0, 6.0, 200.0, [(17, 5.0)], 0, 0, 0, 0, peak, "t",
                                 board="sl2610", board_memory_bytes=spec.memory_bytes,
                                 board_headroom_bytes=spec.headroom_bytes, board_fits=bench_module.fits_board(spec, peak))
    verdict = "does NOT fit" if refused else "fits"
    assert f"board sl2610: {verdict}: peak leaves " in bench_module.format_result(r)
    assert "of its 1.9 GB (at least 300 MB must stay free); the times" in bench_module.format_result(r)
    if refused:
        with pytest.raises(BudgetExceeded, match="peak resident memory 1,600 MB leaves 300 MB of the sl2610's 1.9 GB; "
                                                 "at least 300 MB must stay free, so the model may use 1,600 MB: less "
                                                 "than 1 MB over$"):
            bench_module.check_board_budget(r)
    else:
        bench_module.check_board_budget(r)


@pytest.mark.parametrize("error", [None, OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_plot_closes_its_figure_however_the_write_ends(tmp_path, monkeypatch, error):
    figure = _FakeFigure(b"a plot", error)
    monkeypatch.setattr(bench_module, "_pyplot", lambda: _fake_pyplot(figure))
    from gemma_export.errors import OutputError

    picture = tmp_path / "curve.png"
    if error is None:
        bench_module.write_plot([_result_for_plot()], picture)
        assert picture.read_bytes() == b"a plot"
    else:
        with pytest.raises(OutputError if isinstance(error, OSError) else KeyboardInterrupt):
            bench_module.write_plot([_result_for_plot()], picture)
        assert not picture.exists()
    assert figure.closed == 1  # matplotlib keeps every open figure otherwise


def test_json_that_cannot_be_written_is_one_error_naming_the_option_and_no_temporary(tmp_path, monkeypatch):
    from pathlib import Path as _Path

    from gemma_export.errors import OutputError

    target = tmp_path / "report.json"
    real = _Path.write_text

    def full(self, *args, **kwargs):
        real(self, "{ha", encoding="utf-8")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(_Path, "write_text", full)
    with pytest.raises(OutputError, match=rf"^--json {target}: cannot write: No space left on device$"):
        bench_module.write_json({"a": 1}, target)
    assert list(tmp_path.iterdir()) == []


def test_a_report_with_a_long_legal_name_is_written_and_a_name_too_long_is_refused_first(tmp_path):
    """Probe finding: a --json name of 246-255 bytes (legal) failed after the whole benchmark, since
    the temporary file beside it (".NAME.tmp-PID") went over 255 bytes; 256 bytes failed the same
    way, late, with the OS's bare "File name too long"."""
    from gemma_export.errors import OutputError

    longest = tmp_path / ("j" * 250 + ".json")  # 255 bytes
    bench_module.check_outputs(longest, None)
    bench_module.write_json({"decode_ms": 1.5}, longest)
    assert json.loads(longest.read_text()) == {"decode_ms": 1.5}
    assert sorted(p.name for p in tmp_path.iterdir()) == [longest.name]  # no temporary left
    too_long = tmp_path / ("j" * 251 + ".json")
    with pytest.raises(OutputError, match=rf"^--json {too_long}: a file name of 256 bytes; this file system takes at most 255$"):
        bench_module.check_outputs(too_long, None)


def test_a_temporary_report_left_by_a_killed_run_is_removed_by_the_next_write(tmp_path):
    """Probe finding: a run killed between its write and its rename left .b.json.tmp-PID for ever."""
    import subprocess

    def ended_pid() -> int:  # the PID of a process that has ended
        return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout)

    dead_pid, other_dead_pid = ended_pid(), ended_pid()
    dead = tmp_path / f".b.json.tmp-{dead_pid}"
    dead.write_text("{}")
    live = tmp_path / f".b.json.tmp-{os.getppid()}"  # a running process's: perhaps writing it now
    live.write_text("{}")
    other = tmp_path / f".c.json.tmp-{dead_pid}"  # another report's: not this write's to judge
    other.write_text("{}")
    past = time.time() - 60
    for leftover in (dead, live, other):
        os.utime(leftover, (past, past))
    recent = tmp_path / f".b.json.tmp-{other_dead_pid}"  # seconds old: perhaps a writer this host cannot see
    recent.write_text("{}")
    bench_module.write_json({"x": 1}, tmp_path / "b.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["b.json", live.name, other.name, recent.name])


# Mutation review (thirteenth session)

def test_as_many_new_tokens_as_warm_up_steps_are_refused(tiny_int8_export, text_file):
    from gemma_export.errors import GemmaExportError

    with pytest.raises(GemmaExportError, match=f"expected more than {WARMUP_STEPS}"):
        run_bench(tiny_int8_export, threads=1, prompt_tokens=(4,), new_tokens=WARMUP_STEPS, text=text_file)


def test_the_reference_ratio_uses_the_shortest_prompts_decode_median(tiny_int8_export, text_file, monkeypatch):
    import gemma_export.reference_iree as reference_iree

    seen = {}

    def time_reference(mlir, weights, ids, ours_ms, say, compile_s=0.0):
        seen["ms"] = ours_ms
        return {}

    monkeypatch.setattr(reference_iree, "check_reference_options", lambda *a: reference_iree.ReferenceInfo(96, 24, None))
    monkeypatch.setattr(reference_iree, "compile_in_child", lambda mlir: None)
    monkeypatch.setattr(bench_module, "time_reference", time_reference)
    result = run_bench(tiny_int8_export, threads=1, prompt_tokens=(4, 8), new_tokens=9, text=text_file,
                       reference="ref.mlir")
    # the 4-token prompt's median (the reference runs short prompts), not the median over both prompts
    assert seen["ms"] == result.decode_ms_median_by_prompt[4]


def test_the_reference_compile_in_a_child_names_the_file_whatever_stops_it(tmp_path, monkeypatch, capsys):
    """The child's own failures (IREE raising something of its own, the kernel killing it) are named
    with the file, as a refusal of the MLIR is."""
    import subprocess

    from gemma_export import reference_iree
    from gemma_export.errors import GemmaExportError

    mlir = tmp_path / "gemma.mlir"
    mlir.write_text("module {}\n")

    def iree_fails(text, cache_dir=None, source=None, refresh=False):
        raise MemoryError("std::bad_alloc")
    monkeypatch.setattr(reference_iree, "compile_reference", iree_fails)
    with pytest.raises(SystemExit) as stopped:
        reference_iree._compile_file(str(mlir))
    assert stopped.value.code == 2
    assert capsys.readouterr().err == f"{mlir}: IREE cannot compile it: MemoryError: std::bad_alloc\n"

    def killed(*args, **kwargs):
        assert kwargs["cwd"] == Path(reference_iree.__file__).resolve().parents[1]  # imports this very package
        return subprocess.CompletedProcess(args[0], -9, "", "")
    monkeypatch.setattr(reference_iree.subprocess, "run", killed)
    with pytest.raises(GemmaExportError, match=rf"^{mlir}: IREE's compiler \(a child process\) was killed by signal 9; "
                                               "out of memory\\?$"):
        reference_iree.compile_in_child(mlir)


def test_other_processes_cpu_time_is_read_from_proc_stat(tmp_path, monkeypatch):
    """``cpu_seconds`` sums user, nice, system, irq, softirq and steal of /proc/stat's first line (not
    idle, not iowait, not guest and guest_nice, which user and nice already hold) in USER_HZ ticks;
    ``other_cpus`` is the busy time less this process's own, per second of wall time; unreadable or
    malformed files, and counters that saw less than this process used, give None."""
    stat_file = tmp_path / "stat"
    monkeypatch.setattr(bench_module, "PROC_STAT", stat_file)
    ticks = os.sysconf("SC_CLK_TCK")
    stat_file.write_text("cpu  100 5 50 999999 77777 3 2 10 40 4\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    busy, own, wall = bench_module.cpu_seconds()
    assert busy == pytest.approx(170 / ticks)
    assert own == pytest.approx(sum(os.times()[:2]), abs=0.5) and wall > 0
    for broken in ("cpu  1 2 3\n", "intr 5\n", "cpu0 1 2 3 4 5 6 7 8 9 10\n", "cpu  a b c d e f g h\n", ""):
        stat_file.write_text(broken)
        assert bench_module.cpu_seconds() is None, broken
    stat_file.unlink()
    assert bench_module.cpu_seconds() is None
    monkeypatch.undo()
    real = bench_module.cpu_seconds()  # this machine's own /proc/stat, where there is one
    assert real is None or (real[0] > 0 and real[1] > 0)

    other = bench_module.other_cpus
    assert other((10.0, 2.0, 100.0), (13.0, 3.0, 102.0)) == pytest.approx(1.0)  # 3 s busy, 1 s ours, over 2 s
    assert other((10.0, 2.0, 100.0), (14.0, 4.0, 104.0)) == pytest.approx(0.5)
    assert other((10.0, 2.0, 100.0), (11.99, 4.0, 102.0)) == 0.0  # a tick's rounding
    assert other((10.0, 2.0, 100.0), (10.5, 4.0, 102.0)) is None  # /proc/stat missed most of our own time
    assert other(None, (1.0, 1.0, 1.0)) is None and other((1.0, 1.0, 1.0), None) is None
    assert other((1.0, 1.0, 5.0), (2.0, 1.0, 5.0)) is None  # no time between the readings
    # a tester: one 10 ms tick over a 30 ms generate read as 0.33 CPUs, and 5.92 of 2 CPUs was printed
    assert other((10.0, 2.0, 100.0), (10.2, 2.0, 100.03)) is None
    assert other((10.0, 2.0, 100.0), (10.2, 2.0, 100.24)) is None  # under a quarter of a second
    assert other((10.0, 2.0, 100.0), (10.3, 2.0, 100.3)) == pytest.approx(1.0)  # 0.3 s of which other work took all
    assert other((10.0, 2.0, 100.0), (10.0 + 100 * 1.0, 2.0, 101.0)) == float(os.cpu_count() or 1)  # capped


def test_bench_says_when_other_processes_took_cpu_time(tiny_int8_export, text_file, monkeypatch):
    """``bench`` reads the CPU counters around the timed prompts and steps (two readings, after the
    session exists) and reports the other processes' share; from 0.2 CPUs on it says the times are
    not the model's alone, below it only gives the figure."""
    import dataclasses

    readings = []

    def reading():
        readings.append(len(readings))
        return [(50.0, 10.0, 1000.0), (53.5, 11.0, 1005.0)][len(readings) - 1]

    monkeypatch.setattr(bench_module, "cpu_seconds", reading)
    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=(4, 8), new_tokens=6, text=text_file)
    assert readings == [0, 1] and r.other_cpus == pytest.approx(0.5)  # (3.5 − 1) s over 5 s
    assert r.to_dict()["other_cpus"] == r.other_cpus
    text = bench_module.format_result(r).splitlines()
    line = next(x for x in text if x.startswith("other work"))
    assert line == (f"other work       other processes used 0.50 of the machine's {os.cpu_count()} CPUs "
                    "while the prompts and steps were timed: these times are not this model's alone; measure again "
                    "on an idle machine, or compare ratios taken in one run")
    assert text.index(line) == next(i for i, x in enumerate(text) if x.startswith("decode")) + 1
    quiet = bench_module.format_result(dataclasses.replace(r, other_cpus=0.05)).splitlines()
    assert f"other work       other processes used 0.05 of the machine's {os.cpu_count()} CPUs while the prompts and " \
           "steps were timed" in quiet
    assert not any(x.startswith("other work") for x in bench_module.format_result(dataclasses.replace(r, other_cpus=None)).splitlines())


def test_the_memory_in_use_is_read_after_each_prompts_last_step_with_its_cache_live(tiny_int8_export, text_file,
                                                                                  monkeypatch):
    """bench reads the growth in use once per prompt, after its last decode step, while that
    generation's KV cache is alive, and reports the prompt where it was largest; its other growth
    figures come after each cache is freed. Here a fake snapshot counts the bytes of the KV buffers
    alive and the steps run (1 prompt step + 7 decode steps per prompt)."""
    import weakref

    from gemma_export import runtime
    from gemma_export.memory import MemorySnapshot

    buffers: list = []
    make = runtime.kv_buffer

    def recorded(shape):
        array = make(shape)
        buffers.append((weakref.ref(array), array.nbytes))
        return array

    steps = [0]
    step = runtime.KVCache.step

    def counted(self, *args, **kwargs):
        steps[0] += 1
        return step(self, *args, **kwargs)

    def fake_snapshot():
        live = sum(nbytes for ref, nbytes in buffers if ref() is not None)
        return MemorySnapshot(rss_bytes=1 + steps[0], anonymous_bytes=live)

    monkeypatch.setattr(runtime, "kv_buffer", recorded)
    monkeypatch.setattr(runtime.KVCache, "step", counted)
    monkeypatch.setattr(bench_module, "snapshot", fake_snapshot)
    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=(4, 8), new_tokens=7, text=text_file)
    assert steps[0] == 16 and len(buffers) >= 2 * 4  # two generations of 4 layers' key and value buffers
    second = sum(nbytes for _, nbytes in buffers[len(buffers) // 2:])  # the 8-token prompt's cache, no drop here
    assert (r.anon_in_use_bytes, r.rss_in_use_bytes, r.in_use_prompt_tokens) == (second, 16, 8)
    assert r.anon_growth_short_bytes == r.anon_growth_bytes == 0  # each cache freed when its generation ended
    assert "its KV cache live (the largest of the prompts'): Anonymous" in bench_module.format_result(r)


def test_a_figure_bench_could_not_read_is_none_not_zero(tiny_int8_export, text_file, monkeypatch):
    """Without /proc/self/smaps_rollup (snapshots of zeros) the memory in use is not measured: None,
    and no "in use" line."""
    from gemma_export import memory

    monkeypatch.setattr(memory, "_kb_fields", lambda path: {})
    r = run_bench(tiny_int8_export, threads=1, prompt_tokens=(4,), new_tokens=5, text=text_file)
    assert (r.anon_in_use_bytes, r.rss_in_use_bytes, r.in_use_prompt_tokens) == (None, None, None)
    assert "in use" not in bench_module.format_result(r)


def test_a_json_report_to_a_named_pipe_without_a_reader_fails_at_once(tmp_path):
    """A plain open of a FIFO for writing waits for a reader: `generate --json FIFO` with nothing
    reading it hung for ever after the whole run (a break-it run). With a reader it is written."""
    import threading

    from gemma_export.bench import write_json
    from gemma_export.errors import OutputError

    fifo = tmp_path / "report"
    os.mkfifo(fifo)
    done = []
    worker = threading.Thread(target=lambda: done.append(pytest.raises(OutputError, write_json, {"a": 1}, fifo)),
                              daemon=True)
    worker.start()
    worker.join(10)
    assert done, "write_json blocked on a FIFO nobody reads"
    assert re.fullmatch(rf"--json {re.escape(str(fifo))}: a named pipe that no process reads; the report was not "
                        rf"written \(start its reader first, e.g. `cat {re.escape(str(fifo))} &`\)", str(done[0].value))
    received = []

    def slow_reader():  # opens its end, then lets the writer fill the pipe's 64 KiB before it reads
        with open(fifo, encoding="utf-8") as f:
            time.sleep(0.3)
            received.append(f.read())

    reader = threading.Thread(target=slow_reader, daemon=True)
    reader.start()
    report = {"a": "x" * 200_000}  # more than a pipe holds: the writer must wait for the reader, not fail
    deadline = time.monotonic() + 10
    while True:
        try:
            write_json(report, fifo)
            break
        except OutputError as exc:  # the reader has not opened its end yet
            assert "no process reads" in str(exc) and time.monotonic() < deadline, exc
            time.sleep(0.05)
    reader.join(10)
    assert received and json.loads(received[0]) == report

