"""tools/bench_side_by_side.py, tools/bench_genai.py and tools/quality_anchor.py on input a tester got
wrong (nineteenth session): labels that collide, a damaged llama.cpp file or pre-packed copy, a
source changed since the export. Each case gave a wrong table or a traceback before."""

from __future__ import annotations

import argparse
import shutil
import sys
import types
from pathlib import Path

import pytest

import bench_genai
import bench_side_by_side
import quality_anchor
from conftest import write_char_tokenizer
from gemma_export.errors import FormatError, GemmaExportError
from gemma_export.prepack import PrepackStatus


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tool")
    parser.exit = lambda status=0, message=None: (_ for _ in ()).throw(SystemExit(message))  # keep the message
    return parser


def test_a_label_that_is_another_exports_pre_packed_row_is_refused(tmp_path):
    """`a=X "a pre-packed=Y"`: Y's heap timing replaced X's pre-packed row in the table."""
    usable = lambda folder: PrepackStatus(folder / "prepacked" / "model.onnx", "", folder / "prepacked")  # noqa: E731
    models = {"a": tmp_path / "x", "a pre-packed": tmp_path / "y"}
    with pytest.raises(SystemExit, match="two timings would both be labelled 'ours a pre-packed'"):
        bench_side_by_side.planned_runs(_parser(), models, "both", usable)
    # without copies, or with the heap only, the same names do not collide
    assert [label for label, _, _ in bench_side_by_side.planned_runs(_parser(), models, "off", usable)] == \
        ["ours a", "ours a pre-packed"]


def test_a_pre_packed_copy_that_cannot_be_used_is_named_not_skipped(tmp_path, capsys):
    def damaged(folder):
        return PrepackStatus(None, f"{folder}/prepacked/prepacked.json: field 'machine' missing", folder / "prepacked")

    def absent(folder):
        return PrepackStatus(None, "", folder / "prepacked")

    runs = bench_side_by_side.planned_runs(_parser(), {"a": tmp_path}, "both", damaged)
    assert runs == [("ours a", tmp_path, False)]
    assert capsys.readouterr().out == (f"ours a: its pre-packed copy is not timed: {tmp_path}/prepacked/prepacked.json: "
                                       "field 'machine' missing\n")
    assert bench_side_by_side.planned_runs(_parser(), {"a": tmp_path}, "both", absent) == [("ours a", tmp_path, False)]
    assert capsys.readouterr().out == ""  # no copy at all: nothing to say


def _fake_llama_cpp(monkeypatch, writes: bytes | None):
    """llama_cpp with a quantizer that writes ``writes`` to its output (None: it fails)."""
    calls = []

    def quantize(source, target, params):
        calls.append(Path(target.decode()))
        if writes is None:
            Path(target.decode()).write_bytes(b"half")
            return 1
        Path(target.decode()).write_bytes(writes)
        return 0

    module = types.SimpleNamespace(llama_model_quantize_default_params=lambda: types.SimpleNamespace(),
                                   LLAMA_FTYPE_MOSTLY_Q8_0=7, llama_model_quantize=quantize)
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    return calls


def _fake_check(path: Path, vocab):
    if path.read_bytes() != b"good":
        raise FormatError(f"{path}: not a whole GGUF")


def _q4_source(folder: Path, monkeypatch) -> Path:
    """A stand-in for the bundled Q4_K_M GGUF in ``folder``, with the GGUF check faked (:func:`_fake_check`)."""
    monkeypatch.setattr(bench_side_by_side, "check_gguf_model", _fake_check)
    source = folder / "gemma-3-270m-q4_k_m.gguf"
    source.write_bytes(b"q4")
    return source


def test_a_damaged_q8_0_file_is_made_again_and_a_new_one_never_half_written(tmp_path, monkeypatch):
    """A Q8_0 GGUF cut short (an interrupted run) was reused by every later run, each ending in a
    llama.cpp traceback."""
    source = _q4_source(tmp_path, monkeypatch)
    target = tmp_path / "gemma-3-270m-q8_0.gguf"
    target.write_bytes(b"goo")  # cut short
    calls = _fake_llama_cpp(monkeypatch, b"good")
    assert bench_side_by_side.q8_0_gguf(source, 262144) == target and target.read_bytes() == b"good"
    assert len(calls) == 1 and calls[0].parent == tmp_path and calls[0] != target  # written under another name
    assert bench_side_by_side.q8_0_gguf(source, 262144) == target and len(calls) == 1  # a good one is kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name, target.name]


def test_a_failed_q8_0_requantization_leaves_no_file(tmp_path, monkeypatch):
    source = _q4_source(tmp_path, monkeypatch)
    _fake_llama_cpp(monkeypatch, None)
    with pytest.raises(GemmaExportError, match="llama.cpp could not requantize"):
        bench_side_by_side.q8_0_gguf(source, 262144)
    assert [p.name for p in tmp_path.iterdir()] == [source.name]


def test_gguf_files_of_one_name_get_a_row_each_and_one_file_twice_is_refused(tmp_path):
    """Two files named gemma-3-270m-q8_0.gguf made one row, with the second file's figures."""
    (tmp_path / "sub").mkdir()
    first, second = tmp_path / "m.gguf", tmp_path / "sub" / "m.gguf"
    first.write_bytes(b"GGUF1")
    second.write_bytes(b"GGUF2")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF3")
    labels = quality_anchor.gguf_labels(_parser(), [first, second, other])
    assert labels == {first: f"llama.cpp {first}", second: f"llama.cpp {second}", other: "llama.cpp other.gguf"}
    (tmp_path / "link.gguf").symlink_to(first)
    with pytest.raises(SystemExit, match=f"--gguf: {tmp_path / 'link.gguf'} is {first} again"):
        quality_anchor.gguf_labels(_parser(), [first, tmp_path / "link.gguf"])


def test_quality_anchor_refuses_a_source_changed_since_the_export(tiny_dir, tmp_path, monkeypatch, capsys):
    """The source the manifest names had been replaced: the table came out against other weights."""
    from gemma_export.exporter import export

    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    model = export(source, tmp_path / "int8", "int8", block_size=16).out_dir
    (source / "config.json").write_text((source / "config.json").read_text() + "\n")  # same values, other bytes
    monkeypatch.setattr(sys, "argv", ["quality_anchor.py", "--models", f"a={model}", "--tokens", "16"])
    with pytest.raises(GemmaExportError, match="it changed since the export"):
        quality_anchor.main()


def test_bench_genai_names_an_unusable_copy_and_prints_no_table_before_a_failure(tiny_int8_export, tmp_path,
                                                                                 monkeypatch, capsys):
    genai = tmp_path / "genai"
    genai.mkdir()
    (genai / "genai_config.json").write_text("{}")
    shutil.copy(tiny_int8_export / "model.onnx", genai)  # int8 weights, as ours (the pair's precision is checked)
    ours = tmp_path / "ours"
    shutil.copytree(tiny_int8_export, ours)
    (ours / "prepacked").mkdir()
    (ours / "prepacked" / "prepacked.json").write_text("{")  # damaged
    monkeypatch.setattr(bench_genai, "our_decode_ms", lambda *a, **k: (4.0, None))
    monkeypatch.setattr(bench_genai, "genai_decode_ms", lambda *a: (5.0, None))
    monkeypatch.setattr(sys, "argv", ["bench_genai.py", "--pair", f"a={genai},{ours}", "--contexts", "4", "--steps", "4"])
    bench_genai.main()
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"a: the pre-packed copy of {ours} is not timed: {ours / 'prepacked'}")
    assert out[3] == "| a | 4 | 5.0 | 4.0 | 0.80 | copy not usable (see above) | — |"
    # --steps 4 times one step: said (a helper's run printed it as any other); nothing busy, no note
    assert out[-1] == "note: only 1 timed step per measurement (--steps 19 or more for steadier figures)"
    assert not any("other processes used" in line for line in out)
    monkeypatch.setattr(bench_genai, "genai_decode_ms", lambda *a: (5.0, 0.2))  # beside other work, at the threshold
    bench_genai.main()
    assert ("note: other processes used 0.2 CPUs or more while a @4 was timed: those rows' times and ratios are not the "
            "systems' own; run again on an idle machine") in capsys.readouterr().out.splitlines()

    def failing(*a):
        raise RuntimeError("Exception during initialization: file_length out of bounds\n" + "detail " * 200)

    monkeypatch.setattr(bench_genai, "genai_decode_ms", failing)
    with pytest.raises(GemmaExportError) as error:
        bench_genai.main()
    assert str(error.value) == f"onnxruntime-genai on {genai}: Exception during initialization: file_length out of bounds"
    assert "| precision" not in capsys.readouterr().out  # no table header left without rows


# From a review of the fixes above

def test_a_requantized_file_that_does_not_check_is_refused_and_not_kept(tmp_path, monkeypatch):
    source = _q4_source(tmp_path, monkeypatch)
    _fake_llama_cpp(monkeypatch, b"bad")
    with pytest.raises(FormatError, match="not a whole GGUF"):
        bench_side_by_side.q8_0_gguf(source, 262144)
    assert [p.name for p in tmp_path.iterdir()] == [source.name]


def test_a_killed_runs_partial_q8_0_file_is_removed_and_the_new_file_is_an_ordinary_one(tmp_path, monkeypatch):
    """A killed run left a hidden 0600 temporary of up to 290 MB per run; the file it made was 0600."""
    import os

    from gemma_export.sources import current_umask

    source = _q4_source(tmp_path, monkeypatch)
    leftover = tmp_path / ".gemma-3-270m-q8_0.gguf.abc123.partial"
    leftover.write_bytes(b"half")
    _fake_llama_cpp(monkeypatch, b"good")
    target = bench_side_by_side.q8_0_gguf(source, 262144)
    assert sorted(p.name for p in tmp_path.iterdir()) == [source.name, target.name]
    assert os.stat(target).st_mode & 0o777 == 0o666 & ~current_umask()


def test_a_workdir_through_a_link_to_nothing_is_refused_first(tmp_path):
    """mkdir failed on it after the work ("File exists")."""
    import _args

    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for value in (tmp_path / "dangling", tmp_path / "dangling" / "sub"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{tmp_path / 'dangling'} is a link to "
                                                             f"{tmp_path / 'nowhere'}, which does not exist"):
            _args.writable_dir(str(value))
    (tmp_path / "nowhere").mkdir()
    assert _args.writable_dir(str(tmp_path / "dangling" / "sub")) == tmp_path / "dangling" / "sub"


def test_genai_anchor_keeps_a_linked_out_and_its_folders_beside_the_link(tmp_path):
    """Resolving --out followed a link, and the kept OUT-hf beside the link was written again elsewhere."""
    import genai_anchor

    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "g").mkdir()
    (tmp_path / "g").symlink_to(tmp_path / "disk" / "g")
    out = genai_anchor.output_folder(str(tmp_path / "g"))
    assert out == tmp_path / "g"
    assert genai_anchor.siblings(out) == (tmp_path / "g-hf", tmp_path / "g-cache")


def test_bench_inspect_reads_a_kept_archive_in_a_folder_that_takes_no_new_files(tmp_path, monkeypatch, capsys):
    """A read-only --workdir holding the archive was refused, though the archive is only read."""
    import bench_inspect

    (tmp_path / "table-three-times.safetensors").write_bytes(b"kept")
    monkeypatch.setattr(bench_inspect, "writable_dir", lambda value: pytest.fail("the kept archive's folder was checked"))
    monkeypatch.setattr(bench_inspect, "write_archive", lambda path: pytest.fail("the kept archive was written again"))
    monkeypatch.setattr(sys, "argv", ["bench_inspect.py", "--workdir", str(tmp_path), "--runs", "1"])
    with pytest.raises(GemmaExportError, match="gemma-export inspect failed on it"):  # a 4-byte stand-in
        bench_inspect.main()


def test_bench_exports_default_workdir_is_checked_as_a_given_one(monkeypatch, capsys):
    """Only a --workdir given was checked up front; the default (/tmp/gx-bench) went unchecked."""
    import bench_export

    def refused(value):
        raise argparse.ArgumentTypeError(f"{value}: checked")

    monkeypatch.setattr(bench_export, "writable_dir", refused)
    monkeypatch.setattr(bench_export, "_run", lambda *a, **k: pytest.fail("the slow work started"))
    monkeypatch.setattr(sys, "argv", ["bench_export.py", "--dtypes", "int8"])
    with pytest.raises(SystemExit) as stop:
        bench_export.main()
    assert stop.value.code == 2 and "argument --workdir: /tmp/gx-bench: checked" in capsys.readouterr().err


# From a review of the last fixes

def test_genai_anchor_finds_the_folder_of_link_dot_dot_as_the_kernel_does(tmp_path):
    import genai_anchor

    (tmp_path / "work").mkdir()
    (tmp_path / "elsewhere" / "sub").mkdir(parents=True)
    (tmp_path / "work" / "lnk").symlink_to(tmp_path / "elsewhere" / "sub")
    out = genai_anchor.output_folder(str(tmp_path / "work" / "lnk" / ".." / "g"))
    assert out == tmp_path / "elsewhere" / "g"  # not work/g: "lnk/.." is the link target's parent


def test_a_partial_q8_0_file_another_run_holds_is_left_alone(tmp_path, monkeypatch):
    from gemma_export.staging import flocked

    source = _q4_source(tmp_path, monkeypatch)
    busy = tmp_path / ".gemma-3-270m-q8_0.gguf.other1.partial"
    busy.write_bytes(b"being written")
    _fake_llama_cpp(monkeypatch, b"good")
    locked_while_written = []
    quantize = sys.modules["llama_cpp"].llama_model_quantize

    def checking(source_path, target, params):  # another run's view of our partial file: held
        status = quantize(source_path, target, params)
        with flocked(Path(target.decode())) as free:
            locked_while_written.append(not free)
        return status

    sys.modules["llama_cpp"].llama_model_quantize = checking
    with flocked(busy) as held:
        assert held
        bench_side_by_side.q8_0_gguf(source, 262144)
    assert busy.read_bytes() == b"being written"  # held by its run: not removed
    assert locked_while_written == [True]  # ours held too, so another run leaves it alone


def test_bench_exports_table_gives_the_growth_after_and_in_use():
    """bench's figures after a generation no longer hold the freed KV cache (nineteenth session):
    the table names them as such and adds the figure in use, the cache live."""
    import bench_export

    row = {"dtype": "int8", "archive_bytes": 286_000_000, "export_s": 55.0, "export_peak_rss_bytes": 1_375_000_000,
           "anon_growth_short_bytes": 308_000_000, "rss_growth_short_bytes": 507_000_000,
           "anon_growth_bytes": 309_000_000, "anon_in_use_bytes": 330_500_000, "optimized_table_initializers": 1,
           "prefill_ms": {"512": 310.0}, "decode_ms_median": 10.2}
    header, rule, line = bench_export.table_lines([row], 512)
    assert "cache freed" in header and "in use at the long prompt's last step, cache live" in header
    assert header.count("|") == rule.count("|") == line.count("|")
    assert line == ("| int8 | 286.0 | 55 | 1375 | 308 MB (1.077×) | 507 MB (1.773×) | 309 MB (1.080×) "
                    "| 330 MB (1.156×) | 1 | 310 | 10.2 |")
    assert "| —" in bench_export.table_lines([{**row, "anon_in_use_bytes": None}], 512)[2]


def test_an_interrupt_llama_cpp_swallows_ends_the_run_after_it():
    """Ctrl-C while llama.cpp requantized: the interrupt was raised in llama-cpp-python's log
    callback, whose exception ctypes drops; the whole benchmark ran on and exited 0."""
    import os
    import signal
    import time

    before = signal.getsignal(signal.SIGINT)
    went_on = []
    with pytest.raises(KeyboardInterrupt):
        with bench_side_by_side.interrupts_after_llama():
            try:  # a callback that runs while the signal arrives: ctypes prints and drops its exception
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)
            except KeyboardInterrupt:
                pass
            went_on.append(True)  # llama.cpp returns normally
    assert went_on and signal.getsignal(signal.SIGINT) is before
    with bench_side_by_side.interrupts_after_llama():  # no interrupt: nothing raised
        pass


@pytest.mark.parametrize("value, message", [
    ("16,128,16", "16 given twice in '16,128,16'"),
    ("1,1,2,2", "1, 2 given twice in '1,1,2,2'"),
])
def test_a_context_given_twice_is_refused(value, message):
    """--contexts 1,1 timed twice, the second figure replacing the first, with duplicate table columns."""
    from _args import int_list

    with pytest.raises(argparse.ArgumentTypeError, match=f"^{message}$"):
        int_list(1, 8192)(value)
    assert int_list(1, 8192)("16,128,512") == [16, 128, 512]


@pytest.mark.parametrize("name, message", [("plot.xyz", "expected a .png file name, found .xyz suffix"),
                                           ("plot", "expected a .png file name, found no suffix")])
def test_a_plot_that_is_no_png_is_refused_before_the_run(tmp_path, name, message):
    """--plot plot.xyz failed in matplotlib after the whole benchmark; --plot plot wrote plot.png
    while the run printed 'plot: plot'."""
    from _args import plot_file

    with pytest.raises(argparse.ArgumentTypeError, match=message):
        plot_file(str(tmp_path / name))


def test_a_reference_that_is_no_reference_export_is_refused_before_any_timing(tiny_int8_export, tmp_path, monkeypatch,
                                                                              capsys):
    """A .mlir that is no reference export was named only after llama.cpp and every export had been timed."""
    (tmp_path / "fake.mlir").write_text("garbage")
    (tmp_path / "fake.safetensors").write_bytes(b"x")
    timed = []
    monkeypatch.setattr(bench_side_by_side, "bench_onnx", lambda *a, **k: timed.append(a))
    monkeypatch.setattr(bench_side_by_side, "bench_llama", lambda *a, **k: timed.append(a))
    monkeypatch.setattr(sys, "argv", ["bench_side_by_side.py", "--models", f"a={tiny_int8_export}", "--reference",
                                      str(tmp_path / "fake.mlir"), "--contexts", "4", "--new-tokens", "4",
                                      "--prefill", "4", "--prepacked", "off"])
    with pytest.raises(SystemExit) as exited:
        bench_side_by_side.run(bench_side_by_side.main)
    assert exited.value.code == 2 and not timed
    assert "fake.mlir: no util.global bound to a #flow.parameter.named parameter" in capsys.readouterr().err


def test_an_output_that_is_a_loop_of_links_is_refused_in_one_line(tmp_path):
    """new_file() raised RuntimeError on a loop of symbolic links: a traceback and exit 1."""
    from _args import new_file, writable_file

    loop = tmp_path / "loop.json"
    loop.symlink_to(loop)
    for check in (new_file, writable_file):
        with pytest.raises(argparse.ArgumentTypeError, match="loop.json: a loop of symbolic links, expected a file name"):
            check(str(loop))


def test_bench_export_checks_its_reports_and_the_texts_length_before_the_first_export(monkeypatch, tmp_path):
    """A tester: a folder where WORKDIR/bench.json goes failed the run after 4 min 23 s of export and
    bench; --prompt-tokens 8192 (the text has 3,439) failed in the bench step, after the export."""
    import types

    import bench_export

    monkeypatch.setattr(bench_export.shutil, "which", lambda name: name)  # GNU time "installed"
    monkeypatch.setattr(bench_export, "_run", lambda *a, **k: pytest.fail("the slow work started"))
    (tmp_path / "int8" / "bench.json").mkdir(parents=True)
    monkeypatch.setattr(sys, "argv", ["bench_export.py", "--dtypes", "int4,int8", "--workdir", str(tmp_path)])
    with pytest.raises(GemmaExportError, match=f"^{tmp_path / 'int8' / 'bench.json'}: is a folder, where this script "
                                               "writes a report$"):
        bench_export.main()
    (tmp_path / "tok").mkdir()
    tokenizer = write_char_tokenizer(tmp_path / "tok") / "tokenizer.json"
    checkpoint = types.SimpleNamespace(tokenizer=types.SimpleNamespace(files={"tokenizer.json": tokenizer.read_bytes()}))
    monkeypatch.setattr("gemma_export.sources.open_source", lambda path: checkpoint)
    monkeypatch.setattr("gemma_export.bench.real_text", lambda path: ("the fox ran", "LICENSE.txt"))
    bench_export.check_text_length(12)  # <bos> and 11 characters
    with pytest.raises(GemmaExportError, match=r"^--prompt-tokens 13: the bench step prompts with LICENSE.txt, which has "
                                               r"12 tokens \(with <bos>\); give at most 12$"):
        bench_export.check_text_length(13)


def test_bench_genai_refuses_a_pair_of_two_precisions(tiny_dir, tiny_int8_export, tmp_path, monkeypatch, capsys):
    """`--pair fp32=GENAI_FP32,OUR_INT4` printed a row of 0.11 with no word."""
    from gemma_export.exporter import export

    genai = tmp_path / "genai"
    genai.mkdir()
    (genai / "genai_config.json").write_text("{}")
    fp32 = export(tiny_dir, tmp_path / "fp32", "fp32").out_dir
    shutil.copy(fp32 / "model.onnx", genai)  # float32 weights
    monkeypatch.setattr(bench_genai, "our_decode_ms", lambda *a, **k: pytest.fail("timed"))
    monkeypatch.setattr(bench_genai, "genai_decode_ms", lambda *a: pytest.fail("timed"))
    monkeypatch.setattr(sys, "argv", ["bench_genai.py", "--pair", f"fp32={genai},{tiny_int8_export}", "--contexts", "4",
                                      "--steps", "4"])
    with pytest.raises(SystemExit) as stop:
        bench_genai.main()
    assert stop.value.code == 2
    assert (f"--pair fp32: {genai} holds fp32 weights and {tiny_int8_export} int8; a pair compares one precision"
            in capsys.readouterr().err)


def test_check_wheels_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    """Ctrl-C during pip's download printed a traceback (selectors.py ... KeyboardInterrupt)."""
    import runpy
    import subprocess

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "run", interrupted)  # the script's pip download, where Ctrl-C lands
    monkeypatch.setattr(sys, "argv", ["check_wheels.py", "--python", "3.12"])
    script = Path(__file__).resolve().parents[1] / "tools" / "aarch64" / "check_wheels.py"
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(script), run_name="__main__")
    assert stop.value.code == 130 and capsys.readouterr().err == "error: interrupted\n"


def test_bench_inspect_keeps_its_archive_at_the_umasks_mode(tmp_path, monkeypatch):
    """safetensors' save_file makes its file 0600: the kept 1.18 GB archive was unreadable to others."""
    import os

    import bench_inspect

    monkeypatch.setattr(bench_inspect, "VOCAB", 8)
    monkeypatch.setattr(bench_inspect, "HIDDEN", 32)
    old = os.umask(0o022)
    try:
        bench_inspect.write_archive(tmp_path / "table-three-times.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "table-three-times.safetensors").stat().st_mode & 0o777 == 0o644
    assert not list(tmp_path.glob("*.partial"))


# Twenty-third session: a break-it round on the scripts

def test_a_script_refuses_an_output_inside_an_export_folder(tiny_int8_export, tmp_path):
    """make_reference_export --out, bench_inspect --workdir and a --plot inside an export wrote there,
    and `gemma-export verify` then refused the export ("files not in the manifest")."""
    import _args

    copy = tmp_path / "int8"
    shutil.copytree(tiny_int8_export, copy)
    for value in (copy, copy / "sub", copy / "sub" / "deeper"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"inside {copy}, an output of gemma-export"):
            _args.writable_dir(str(value))
    with pytest.raises(argparse.ArgumentTypeError, match=f"inside {copy}, an output of gemma-export"):
        _args.writable_file(str(copy / "decode.png"))
    # beside it, and in a folder holding exports (bench_export's workdir), writing is fine
    assert _args.writable_dir(str(tmp_path / "ref")) == tmp_path / "ref"
    assert _args.writable_dir(str(tmp_path)) == tmp_path
    assert _args.writable_file(str(tmp_path / "decode.png")) == tmp_path / "decode.png"


def test_a_graph_from_another_export_is_refused_by_the_scripts(tiny_int8_export, tiny_dir, tmp_path):
    """quality_anchor, bench_breakdown and the others scored a folder whose model.onnx came from
    another export (`gemma-export parity` and `verify` refused it): one of another size, one of the
    same size with other bytes, and one whose manifest then lost its file listing."""
    import json

    import _args

    from gemma_export.exporter import export

    other = export(tiny_dir, tmp_path / "other", "int8", calibrate=False, hadamard_size=0).out_dir
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_int8_export, swapped)
    assert _args.our_export(str(swapped)) == swapped
    graph = swapped / "model.onnx"
    graph.write_bytes((other / "model.onnx").read_bytes())
    assert graph.stat().st_size != (tiny_int8_export / "model.onnx").stat().st_size
    with pytest.raises(argparse.ArgumentTypeError, match=r"model.onnx: [0-9,]+ bytes, the manifest says"):
        _args.our_export(str(swapped))
    same_size = bytearray((tiny_int8_export / "model.onnx").read_bytes())
    same_size[-1] ^= 0x01
    graph.write_bytes(bytes(same_size))
    with pytest.raises(argparse.ArgumentTypeError, match=r"model.onnx: sha256 differs from the manifest"):
        _args.our_export(str(swapped))
    manifest = json.loads((swapped / "manifest.json").read_text())
    del manifest["files"]
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(argparse.ArgumentTypeError, match="field 'files' must be an object"):
        _args.our_export(str(swapped))
    del manifest["tool"]  # another tool's manifest: nothing to compare
    (swapped / "manifest.json").write_text(json.dumps(manifest))
    assert _args.our_export(str(swapped)) == swapped


def test_quality_anchor_names_its_own_option_for_a_text_too_long(tiny_dir, tmp_path, monkeypatch):
    """It advised "--contexts, --new-tokens or --prefill", options of another script."""
    import _args

    from gemma_export.exporter import export

    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    model = export(source, tmp_path / "int8", "int8", calibrate=False).out_dir
    monkeypatch.setattr("gemma_export.quality.transformers_logits", lambda *a: pytest.fail("the slow work started"))
    monkeypatch.setattr(sys, "argv", ["quality_anchor.py", "--models", f"a={model}", "--tokens", "300"])
    with pytest.raises(GemmaExportError, match="needs 300 positions; give a smaller --tokens$"):
        quality_anchor.main()
    with pytest.raises(GemmaExportError, match="give shorter --contexts, --new-tokens or --prefill$"):
        _args.check_exports_fit({"a": model}, [1, 2], 300)
    # more tokens than the text has: scored over the whole text before, said only in the table's heading
    monkeypatch.setattr(sys, "argv", ["quality_anchor.py", "--models", f"a={model}", "--tokens", "32768"])
    with pytest.raises(GemmaExportError, match=r"^--tokens 32,768: .*LICENSE.txt has [\d,]+ tokens \(with <bos>\); "
                                               r"give at most [\d,]+$"):
        quality_anchor.main()


def test_an_interrupted_archive_leaves_no_partial_file_nor_the_folders_it_made(tmp_path, monkeypatch):
    """Ctrl-C while bench_inspect wrote its archive left a 1.18 GB .partial file and the new --workdir;
    make_reference_export left the parent folders of a nested --out."""
    import _args
    import bench_inspect

    def interrupted(tensors, filename):
        Path(filename).write_bytes(b"half written")
        raise KeyboardInterrupt

    monkeypatch.setattr("safetensors.numpy.save_file", interrupted)
    monkeypatch.setattr(bench_inspect, "VOCAB", 8)
    monkeypatch.setattr(bench_inspect, "HIDDEN", 32)
    workdir = tmp_path / "a" / "b" / "c"
    monkeypatch.setattr(sys, "argv", ["bench_inspect.py", "--workdir", str(workdir), "--runs", "1"])
    with pytest.raises(KeyboardInterrupt):
        bench_inspect.main()
    assert list(tmp_path.iterdir()) == []
    # safetensors' save_file back before make_reference_export imports jax_reference, whose
    # module-level `from safetensors.numpy import save_file` kept the interrupting stand-in for the
    # rest of the session (a later reference test raised this KeyboardInterrupt, in some test orders)
    monkeypatch.undo()

    import make_reference_export

    def interrupted_export(model, scratch, dtype):
        (scratch / "gemma.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr("gemma_export.sources.open_source", lambda source: None)
    monkeypatch.setattr("gemma_export.quality.transformers_model", lambda source: None)
    monkeypatch.setattr("jax_reference.write_jax_reference", interrupted_export)
    monkeypatch.setattr(sys, "argv", ["make_reference_export.py", "--out", str(tmp_path / "r" / "s" / "t")])
    with pytest.raises(KeyboardInterrupt):
        make_reference_export.main()
    assert list(tmp_path.iterdir()) == []

    (tmp_path / "kept").mkdir()
    made = _args.make_folders(tmp_path / "kept" / "x" / "y")
    assert made == [tmp_path / "kept" / "x", tmp_path / "kept" / "x" / "y"]
    (tmp_path / "kept" / "mine.txt").write_text("mine")
    _args.remove_folders(made)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["mine.txt"]


def test_the_scripts_help_gives_each_numeric_options_range():
    """Only the default was shown; the range first appeared in an error."""
    import _args

    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=_args.int_range(4, 4096), default=64, help="steps (default 64)")
    parser.add_argument("--contexts", type=_args.int_list(1, 8192), help="prompt lengths")
    parser.add_argument("--threads", type=_args.thread_count, default=2, help="threads (default 2)")
    sub = parser.add_subparsers().add_parser("compare")
    sub.add_argument("--min-top1", type=_args.float_range(0.0, 1.0), default=0.995, help="limit (default 0.995)")
    _args.add_ranges(parser)
    helps = {a.dest: a.help for a in parser._actions} | {a.dest: a.help for a in sub._actions}
    assert helps["new_tokens"] == "steps (4 to 4,096; default 64)"
    assert helps["contexts"] == "prompt lengths (each 1 to 8,192)"
    assert helps["threads"] == f"threads (1 to {4 * (__import__('os').cpu_count() or 1):,}; default 2)"
    assert helps["min_top1"] == "limit (0.0 to 1.0; default 0.995)"


def test_a_scripts_help_shows_the_ranges():
    """add_ranges is called by each script: its --help gives the range of every numeric option."""
    import subprocess

    tools = Path(__file__).resolve().parents[1] / "tools"
    for script, line in (("bench_side_by_side.py", "(4 to 4,096; default 64)"), ("bench_genai.py", "(each 1 to 8,192"),
                         ("quality_anchor.py", "(16 to 32,768; default 640;"), ("bench_inspect.py", "(1 to 100; default 3)")):
        out = subprocess.run([sys.executable, str(tools / script), "--help"], capture_output=True, text=True).stdout
        assert line in " ".join(out.split()), (script, out)


def test_another_tools_manifest_with_a_file_map_is_no_output_of_gemma_export(tmp_path):
    """A review: a project folder whose manifest.json (another tool's) has a 'files' map was taken
    for an export, and writing beside it into it was refused as "an output of gemma-export"."""
    import json

    import _args

    (tmp_path / "manifest.json").write_text(json.dumps({"name": "my-app", "files": {"app.js": "sha1-abc"}}))
    assert _args.writable_dir(str(tmp_path / "gx-ref")) == tmp_path / "gx-ref"
    (tmp_path / "manifest.json").write_text(json.dumps({"tool": {"gemma-export": "0.1.0"}, "files": {}}))
    with pytest.raises(argparse.ArgumentTypeError, match="an output of gemma-export"):
        _args.writable_dir(str(tmp_path / "gx-ref"))
    (tmp_path / "manifest.json").unlink()
    (tmp_path / "BUNDLE.json").write_text(json.dumps({"gemma_export_version": "0.1.0", "files": {}}))
    with pytest.raises(argparse.ArgumentTypeError, match="an output of gemma-export"):
        _args.writable_dir(str(tmp_path / "gx-ref"))


def test_the_side_by_side_plot_is_a_png_of_its_own_size(tmp_path):
    """The plot's legend sat over the points at 2,048 positions and its log axis had two labels; it
    is now wider (legend beside the axes): 8 x 4.2 inches at 110 dpi."""
    pytest.importorskip("matplotlib")
    import struct

    rows = {"llama.cpp Q8_0": {"decode_ms": {16: 10.2, 2048: 13.2, 3072: 14.0}},
            "ours int8": {"decode_ms": {16: 8.1, 2048: 10.1, 3072: 10.5}},
            "reference (IREE, re-decode)": {"decode_ms": {16: 76.0}, "fixed_length": 24}}
    bench_side_by_side.write_plot(rows, tmp_path / "decode.png")
    data = (tmp_path / "decode.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (880, 462)  # IHDR width, height


def test_the_tools_keep_files_they_did_not_write(tiny_int8_export, tmp_path, monkeypatch):
    """A helper: bench_side_by_side.py --plot replaced a text file named notes.png with its plot, and
    bench_export.py replaced someone's own WORKDIR/bench.json after its exports, both without a word.
    Each is refused before any work, as `gemma-export bench` refuses it; their own earlier files are not."""
    import _args
    import bench_export

    notes = tmp_path / "notes.png"
    notes.write_text("my own notes")
    with pytest.raises(argparse.ArgumentTypeError, match=r"notes.png: exists and is not a PNG image; refusing to overwrite it"):
        _args.plot_file(str(notes))
    earlier = tmp_path / "decode.png"
    earlier.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 16)  # a plot an earlier run wrote
    assert _args.plot_file(str(earlier)) == earlier
    assert notes.read_text() == "my own notes"

    workdir = tmp_path / "bench"
    workdir.mkdir()
    (workdir / "bench.json").write_text("precious: my own notes named bench.json")
    monkeypatch.setattr(sys, "argv", ["bench_export.py", "--dtypes", "int8", "--workdir", str(workdir)])
    monkeypatch.setattr(bench_export, "_run", lambda *a, **k: pytest.fail("an export started"))
    monkeypatch.setattr(bench_export.shutil, "which", lambda name: name)  # GNU time need not be installed here
    with pytest.raises(GemmaExportError, match=r"bench.json: exists and is not a JSON report; refusing to overwrite it"):
        bench_export.main()
    (workdir / "bench.json").write_text("[]")  # an earlier run's rows
    (workdir / "int8").mkdir()
    (workdir / "int8" / "bench.json").write_text('{"notes": 1}')  # JSON, but not gemma-export bench's
    with pytest.raises(GemmaExportError, match=r"int8/bench.json: exists and is JSON but not an earlier report"):
        bench_export.main()


def test_side_by_side_checks_the_data_files_before_llama_cpp(tiny_int8_export, tmp_path):
    """A data file cut short was found only after llama.cpp's runs (minutes at the defaults)."""
    import _args

    model = tmp_path / "int8"
    shutil.copytree(tiny_int8_export, model)
    with open(model / "model.onnx.data", "r+b") as f:
        f.truncate(1000)
    with pytest.raises(FormatError, match=r"model.onnx.data: 1,000 bytes, but .*manifest.json records"):
        _args.check_exports_fit({"a": model}, [1, 2], 4)
