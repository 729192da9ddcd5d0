"""Scripts in tools/: bench_breakdown.py (the graph surgery behind docs/benchmarks.md's time breakdown)
and aarch64/check_wheels.py (the board's Python gets binary wheels)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

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


def _check_wheels():
    path = Path(__file__).resolve().parents[1] / "tools" / "aarch64" / "check_wheels.py"
    spec = importlib.util.spec_from_file_location("check_wheels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("wheel, glibc", [
    ("onnxruntime-1.32.0-cp312-cp312-manylinux_2_28_aarch64.whl", (2, 28)),
    ("numpy-2.5.5-cp312-cp312-manylinux_2_27_aarch64.manylinux_2_28_aarch64.whl", (2, 27)),
    ("protobuf-7.36.2-cp310-abi3-manylinux2014_aarch64.whl", (2, 17)),
    ("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", (2, 17)),
    ("tqdm-4.70.1-py3-none-any.whl", None),
])
def test_check_wheels_reads_the_glibc_a_wheel_needs(wheel, glibc):
    assert _check_wheels().glibc_needed(wheel) == glibc


def test_check_wheels_asks_for_exactly_the_runtime_dependencies():
    deps = _check_wheels().runtime_dependencies()
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in deps]
    # the board installs exactly the toolkit's runtime dependencies: none missing, no test-only package
    assert sorted(names) == ["gguf", "ml_dtypes", "numpy", "onnx", "onnx-ir", "onnxruntime", "safetensors",
                             "tokenizers", "tqdm", "typer"]


def test_check_wheels_refuses_a_bad_python_version(capsys):
    assert _check_wheels().main(["--python", "3.9x"]) == 2
    assert "--python '3.9x': expected a version like 3.12" in capsys.readouterr().err


def test_check_wheels_refuses_an_unknown_arch(capsys):
    assert _check_wheels().main(["--arch", "nonsense"]) == 2
    assert "--arch 'nonsense': expected one of aarch64, x86_64" in capsys.readouterr().err


TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.mark.parametrize("script, args, message", [
    ("bench_genai.py", ["--pair", "x"], "argument --pair: expected NAME=PATH,PATH, found 'x'"),
    ("bench_genai.py", ["--pair", "x=/nonexistent,/nonexistent"], "argument --pair: /nonexistent: no such folder"),
    ("bench_genai.py", ["--pair", "x={tmp}/genai,{model}", "--steps", "0"], "argument --steps: expected 4 to 4,096, found 0"),
    ("bench_genai.py", ["--pair", "x={tmp},{model}"], "no genai_config.json; expected a folder onnxruntime-genai's"),
    # the two folders swapped, or genai's twice: each is checked for what it must be
    ("bench_genai.py", ["--pair", "x={model},{tmp}/genai"], "an export of gemma-export (it has our manifest.json), not a"),
    ("bench_genai.py", ["--pair", "x={tmp}/genai,{tmp}/genai"], "genai: not an export of gemma-export"),
    ("bench_genai.py", ["--pair", "x={tmp}/genai,{model}", "--pair", "x={tmp}/genai,{model}"],
     "--pair: the name 'x' is given twice"),
    ("bench_side_by_side.py", ["--models", "x={tmp}/genai"], "genai: not an export of gemma-export"),
    ("bench_side_by_side.py", ["--models", "x={model}", "--reference", "{tmp}/a-file"],
     "a-file: expected a reference export's .mlir file, found no suffix"),
    ("bench_side_by_side.py", ["--models", "x={model}", "--plot", "/proc/p.png"], "p.png: cannot write in /proc"),
    ("bench_breakdown.py", ["--model", "{tmp}"], "not an export of gemma-export"),
    ("bench_breakdown.py", ["--model", "{model}", "--rounds", "0"], "argument --rounds: expected 1 to 1,000, found 0"),
    ("bench_breakdown.py", ["--model", "{model}", "--new-tokens", "0"], "argument --new-tokens: expected 1 to 4,096, found 0"),
    ("bench_breakdown.py", ["--model", "{model}", "--prompt-tokens", "20000"], "expected 1 to 4,096, found 20000"),
    ("bench_breakdown.py", ["--model", "{model}", "--prompt-tokens", "300"], "exceeds the model's max_position_embeddings 256"),
    ("quality_anchor.py", ["--models", "x={model}", "--gguf", "{tmp}/a-file"], "a-file: not a GGUF file (first bytes b'not '"),
    ("quality_anchor.py", ["--models", "x={model}", "--gguf"], "argument --gguf: expected at least one argument"),
    ("bench_side_by_side.py", ["--models", "x"], "argument --models: expected NAME=PATH, found 'x'"),
    ("bench_side_by_side.py", ["--models", "x={model}", "--contexts", "-1"], "argument --contexts: expected 1 to 8,192, found -1"),
    ("bench_side_by_side.py", ["--models", "x={model}", "--plot", "/nonexistent/p.png"], "its folder /nonexistent does not exist"),
    ("quality_anchor.py", [], "the following arguments are required: --models"),
    ("quality_anchor.py", ["--models", "x={model}", "--tokens", "0"], "argument --tokens: expected 16 to 32,768, found 0"),
    ("quality_anchor.py", ["--models", "x={model}", "--gguf", "/nonexistent.gguf"], "/nonexistent.gguf: no such file"),
    ("bench_export.py", ["--dtypes", "bogus"], "expected comma-separated dtypes from fp32, bf16, int8, int4, found 'bogus'"),
    ("bench_export.py", ["--workdir", "{tmp}/a-file"], "a-file: is a file, expected a folder"),
    # what `gemma-export bench` would refuse only after the export: the short prompt's length, too few
    # steps to time after the warm-up, more threads than the runtime accepts
    ("bench_export.py", ["--prompt-tokens", "16"], "argument --prompt-tokens: expected 17 to 8,192, found 16"),
    ("bench_export.py", ["--new-tokens", "4"], "argument --new-tokens: expected 5 to 4,096, found 4"),
    ("bench_export.py", ["--threads", str(4 * (os.cpu_count() or 1) + 1)],
     f"argument --threads: expected 1 to {4 * (os.cpu_count() or 1)}, found"),
    ("bench_side_by_side.py", ["--models", "x={model}", "--threads", "0"], "argument --threads: expected 1 to"),
    ("bench_inspect.py", ["--runs", "0"], "argument --runs: expected 1 to 100, found 0"),
    ("make_reference_export.py", ["--out", ""], "argument --out: empty path"),
    ("genai_anchor.py", ["--python", "/nonexistent/python", "--out", "{tmp}/g"], "/nonexistent/python: no such file"),
    # a program that exits 0 passed the import probe, and the script ended 0 with no output (helper-found)
    ("genai_anchor.py", ["--python", "/usr/bin/true", "--out", "{tmp}/g"],
     "--python /usr/bin/true: not a Python that imports onnxruntime_genai's builder: it printed '', exit status 0"),
    ("genai_anchor.py", ["--python", "/usr/bin/true", "--out", "{model}"],
     "an export of gemma-export (it has our manifest.json), not a folder onnxruntime-genai's builder wrote"),
    ("genai_anchor.py", ["--python", "/usr/bin/true", "--out", "{tmp}"], "no genai_config.json; expected a folder "
                                                                           "onnxruntime-genai's builder wrote"),
    ("bench_export.py", ["--dtypes", "int8,int8"], "int8 is given twice in 'int8,int8'; give each dtype once"),
    ("aarch64/parity.py", ["prepare", "--model", "{model}", "--out", "{tmp}"], "is a folder, expected a file name"),
    ("aarch64/parity.py", ["dump", "--model", "{model}", "--ids", "{tmp}/a-file", "--out", "{tmp}/x86"],
     "expected a file name ending in .npz"),
    ("aarch64/parity.py", ["dump", "--model", "{model}", "--ids", "{tmp}/a-file", "--out", "{tmp}/x86.npz"],
     "a-file: not an ids file written by `parity.py prepare`"),
    ("aarch64/parity.py", ["compare", "{tmp}/a-file", "{tmp}/a-file"], "a-file: not a dump written by `parity.py dump`"),
    ("aarch64/parity.py", ["prepare", "--model", "{model}", "--out", "{tmp}/ids.json", "--new-tokens", "1"],
     "argument --new-tokens: expected 2 to 4,096, found 1"),
    ("aarch64/parity.py", ["dump", "--model", "{model}", "--ids", "{tmp}/genai/genai_config.json", "--out", "{tmp}/x.npz"],
     "not an ids file written by `parity.py prepare`"),
    ("aarch64/parity.py", ["compare", "{tmp}/a-file", "{tmp}/a-file", "--min-top1", "5"], "expected 0.0 to 1.0, found 5.0"),
])
def test_tools_refuse_bad_arguments_in_one_line(tiny_int8_export, tmp_path, script, args, message):
    """Every script: bad input is an `error:` line and exit status 2, before any slow work, no traceback
    and nothing written."""
    import subprocess
    import sys

    (tmp_path / "a-file").write_text("not what the script reads\n")
    (tmp_path / "genai").mkdir()  # what onnxruntime-genai's builder writes, as far as the checks look
    (tmp_path / "genai" / "genai_config.json").write_text("{}")
    argv = [a.format(model=tiny_int8_export, tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, str(TOOLS / script), *argv], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "genai"]
    assert os.listdir(tmp_path / "genai") == ["genai_config.json"]


def test_a_plot_without_matplotlib_is_refused_before_the_run(tmp_path, monkeypatch):
    import argparse
    import importlib.util

    import _args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(argparse.ArgumentTypeError, match=r"needs matplotlib \(pip install matplotlib\)"):
        _args.plot_file(str(tmp_path / "p.png"))


def test_a_missing_optional_module_is_one_line_not_a_traceback(capsys):
    import _args

    def main():  # the module stands for llama_cpp, onnxruntime_genai or jax
        import importlib

        importlib.import_module("gemma_export_absent_comparison_tool")

    with pytest.raises(SystemExit) as stop:
        _args.run(main)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: this script needs the Python module 'gemma_export_absent_comparison_tool'")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("skip", [None, "before", "after"])
def test_try_bundle_runs_the_readme_lines_and_can_leave_out_bench(tmp_path, skip):
    """try_bundle.sh hands run.sh every indented README line (bench left out with --skip-bench, given
    before or after the folder: docs/sl2610.md writes it after, where the script once refused it)."""
    import shutil
    import subprocess

    here = tmp_path / "aarch64"
    here.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "tools" / "aarch64" / "try_bundle.sh", here)
    # a stand-in for the emulated board: prints the script it was asked to run
    (here / "run.sh").write_text('#!/bin/sh\nfor last; do :; done\nprintf "%s\\n" "$last"\n')
    (here / "run.sh").chmod(0o755)
    bundle = tmp_path / "board"
    bundle.mkdir()
    (bundle / "BUNDLE.json").write_text("{}")
    (bundle / "README.md").write_text("# b\n\n    pip install ./w.whl\n\ntext\n\n    gx verify model\n"
                                      "    gx/bin/gemma-export bench --model model --board sl2610\n")
    args = ["bash", str(here / "try_bundle.sh"), str(bundle)]
    if skip:
        args.insert(2 if skip == "before" else 3, "--skip-bench")
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    expected = ["pip install ./w.whl", "gx verify model"]
    if not skip:
        expected.append("gx/bin/gemma-export bench --model model --board sl2610")
    assert done.stdout.splitlines() == expected
    for bad, line in (([str(bundle), "--skip-bnech"], "error: --skip-bnech: unknown option (expected --skip-bench; a "
                                                      "folder named so: -- --skip-bnech or ./--skip-bnech)"),
                      ([str(bundle), "-s"], "error: -s: unknown option (expected --skip-bench; a folder named so: -- -s "
                                            "or ./-s)"),
                      ([str(bundle), str(bundle)], "error: expected one BOARD_DIR, found 2"),
                      (["--skip-bench"], "error: expected one BOARD_DIR, found 0")):
        refused = subprocess.run(["bash", str(here / "try_bundle.sh"), *bad], capture_output=True, text=True)
        assert refused.returncode == 2 and refused.stdout == "" and refused.stderr.splitlines()[0] == line
    shown = subprocess.run(["bash", str(here / "try_bundle.sh"), str(bundle), "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("Install a `gemma-export bundle` folder")
    dashed = tmp_path / "-board"
    bundle.rename(dashed)  # a folder whose name starts with a dash, after --
    done = subprocess.run(["bash", str(here / "try_bundle.sh"), "--skip-bench", "--", "-board"], capture_output=True,
                          text=True, check=True, cwd=tmp_path)
    assert done.stdout.splitlines() == ["pip install ./w.whl", "gx verify model"]


@pytest.mark.parametrize("fails", [False, True])
def test_make_reference_export_replaces_both_files_or_neither(tmp_path, monkeypatch, fails):
    # the slow parts (transformers model, JAX lowering) replaced by a writer of the two files that
    # may stop between them, as Ctrl-C did: the old pair must stay a pair
    import sys

    import jax_reference
    import make_reference_export

    import gemma_export.quality
    import gemma_export.sources

    out = tmp_path / "ref"
    out.mkdir()
    (out / "gemma.mlir").write_text("old mlir")
    (out / "gemma.safetensors").write_text("old archive")

    def write(model, folder, dtype):
        (folder / "gemma.mlir").write_text("new mlir")
        if fails:
            raise KeyboardInterrupt
        (folder / "gemma.safetensors").write_text("new archive")
        return folder / "gemma.mlir"

    monkeypatch.setattr(gemma_export.sources, "open_source", lambda source: None)
    monkeypatch.setattr(gemma_export.quality, "transformers_model", lambda checkpoint: None)
    monkeypatch.setattr(jax_reference, "write_jax_reference", write)
    monkeypatch.setattr(sys, "argv", ["make_reference_export.py", "--out", str(out)])
    if fails:
        with pytest.raises(KeyboardInterrupt):
            make_reference_export.main()
    else:
        make_reference_export.main()
    expected = "old" if fails else "new"
    assert (out / "gemma.mlir").read_text() == f"{expected} mlir"
    assert (out / "gemma.safetensors").read_text() == f"{expected} archive"
    assert sorted(os.listdir(out)) == ["gemma.mlir", "gemma.safetensors"]  # no scratch folder left


def test_bench_inspect_names_a_damaged_cached_archive(tmp_path):
    import subprocess
    import sys

    cached = tmp_path / "table-three-times.safetensors"
    cached.write_text("junk\n")  # what an interrupted or foreign run may leave in --workdir
    proc = subprocess.run([sys.executable, str(TOOLS / "bench_inspect.py"), "--workdir", str(tmp_path), "--runs", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == (f"error: {cached}: gemma-export inspect failed on it (error: {cached}: 5 bytes, too "
                                   "short for a safetensors header (8-byte length)); delete it to write it again")


def test_genai_anchor_marks_its_transformers_folder_complete_only_at_the_end(tiny_dir, tmp_path, monkeypatch):
    # an interrupted write (Ctrl-C in the 1 GB model.safetensors) must not be reused by the next run
    import genai_anchor
    import safetensors.numpy

    import gemma_export.sources as sources

    real_open, real_save = sources.open_source, safetensors.numpy.save_file
    monkeypatch.setattr(sources, "open_source", lambda source: real_open(tiny_dir))
    folder = tmp_path / "g-hf"
    folder.mkdir()
    (folder / genai_anchor.COMPLETE_MARKER).write_text("")  # an earlier run's, now being rewritten

    def interrupted(tensors, path):
        real_save(tensors, path)
        raise KeyboardInterrupt

    monkeypatch.setattr(safetensors.numpy, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        genai_anchor.write_hf_folder(folder)
    assert (folder / "model.safetensors").is_file() and not (folder / genai_anchor.COMPLETE_MARKER).exists()
    monkeypatch.setattr(safetensors.numpy, "save_file", real_save)
    assert genai_anchor.write_hf_folder(folder) == folder
    assert (folder / genai_anchor.COMPLETE_MARKER).is_file()
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("payload, message", [
    ({"prompts": "abc", "text": [1, 2], "new_tokens": 4}, "'prompts' must be a non-empty list of non-empty token id lists"),
    ({"prompts": [[2, 5]], "text": [], "new_tokens": 4}, "'text' must be a list of at least 2 token ids, found []"),
    ({"prompts": [[2, 5]], "text": [2, 5, 6], "new_tokens": -3}, "'new_tokens' must be 2 to 4,096"),
])
def test_parity_dump_refuses_a_hand_edited_ids_file(tiny_int8_export, tmp_path, payload, message):
    import subprocess
    import sys

    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(payload))
    proc = subprocess.run([sys.executable, str(TOOLS / "aarch64" / "parity.py"), "dump", "--model", str(tiny_int8_export),
                           "--ids", str(ids), "--out", str(tmp_path / "x.npz")], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith(f"error: {ids}: {message}"), proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["ids.json"]


def test_a_llama_build_that_crashes_is_one_error_line_before_any_timing(monkeypatch, tmp_path):
    import bench_side_by_side

    # the probe runs in a child process; this process only imports llama_cpp first, so a stand-in
    # module lets the test run where llama-cpp-python is not installed (CI's fresh machine)
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(bench_side_by_side, "LLAMA_PROBE",
                        "import os, signal, sys; os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(SystemExit, match=r"^error: llama.cpp \(llama-cpp-python\) died of SIGSEGV evaluating two "
                                         r"tokens of .*m.gguf; on a CPU that reports AMX, rebuild it"):
        bench_side_by_side.check_llama_runs(tmp_path / "m.gguf")
    monkeypatch.setattr(bench_side_by_side, "LLAMA_PROBE", "raise SystemExit('no such model')")
    with pytest.raises(SystemExit, match=r"failed \(no such model\)"):
        bench_side_by_side.check_llama_runs(tmp_path / "m.gguf")
    monkeypatch.setattr(bench_side_by_side, "LLAMA_PROBE", "pass")
    bench_side_by_side.check_llama_runs(tmp_path / "m.gguf")  # a build that runs: nothing said
    # not installed at all: ImportError, which main() turns into skipped llama.cpp rows, not an error
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(ImportError):
        bench_side_by_side.check_llama_runs(tmp_path / "m.gguf")


def _gguf(path, architecture="gemma3", cut=0):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tensor("token_embd.weight", np.zeros((96, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if cut:
        path.write_bytes(path.read_bytes()[:-cut])
    return path


def test_comparison_scripts_refuse_models_that_cannot_run_before_any_timing(tiny_int8_export, tmp_path):
    """bench_side_by_side ran llama.cpp first and then died in onnxruntime's Gather (ids of the
    270M's tokenizer in a 96-row table), or timed a 256-position model at 304 positions;
    quality_anchor scored everything, then failed on a truncated or llama GGUF with a traceback."""
    import shutil

    from _args import check_exports_fit, check_gguf_model
    from conftest import make_tiny_model
    from gemma_export.errors import ConfigError, FormatError, GemmaExportError
    from test_gguf_tiny import write_tiny_gguf

    models = {"x": tiny_int8_export}
    assert check_exports_fit(models, [2, 95], 256) == 96
    with pytest.raises(GemmaExportError, match="its vocabulary has 96 ids"):
        check_exports_fit(models, [2, 96], 16)  # an id equal to the size is outside
    with pytest.raises(GemmaExportError, match=r"its vocabulary has 96 ids, and the text's ids .* reach 236,819"):
        check_exports_fit(models, [2, 236_819], 16)
    with pytest.raises(GemmaExportError, match="max_position_embeddings is 256, and this run needs 304 positions"):
        check_exports_fit(models, [2, 5], 304)
    other = tmp_path / "other"
    shutil.copytree(tiny_int8_export, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["config"]["vocab_size"] = 128
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemmaExportError, match=r"--models have different vocabularies \(x 96, y 128\)"):
        check_exports_fit({"x": tiny_int8_export, "y": other}, [2, 5], 16)
    write_tiny_gguf(make_tiny_model(), tmp_path / "ok.gguf")
    check_gguf_model(tmp_path / "ok.gguf", 96)
    with pytest.raises(ConfigError, match="general.architecture is 'llama', expected 'gemma3'"):
        check_gguf_model(_gguf(tmp_path / "llama.gguf", "llama"), 96)
    write_tiny_gguf(make_tiny_model(vocab_size=50), tmp_path / "small.gguf")
    with pytest.raises(FormatError, match="token_embd.weight has 50 rows; the exports' vocabulary has 96"):
        check_gguf_model(tmp_path / "small.gguf", 96)
    with pytest.raises(FormatError, match="truncated"):
        check_gguf_model(_gguf(tmp_path / "cut.gguf", cut=100), 96)


@pytest.mark.parametrize("builder_status", [1, 0])
def test_genai_anchor_says_when_the_builder_fails_or_writes_nothing(tmp_path, builder_status):
    """A failed builder ended the script with its status and no line of ours, and one that wrote
    nothing ended it with 0 (a mutation audit's gap)."""
    import subprocess
    import sys

    import genai_anchor

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = -c ]; then echo '{genai_anchor.PROBE_OK}'; exit 0; fi\n"
                    f"exit {builder_status}\n")
    fake.chmod(0o755)
    _complete_hf(tmp_path / "g-hf")  # an earlier run's: not written again
    done = subprocess.run([sys.executable, str(TOOLS / "genai_anchor.py"), "--python", str(fake), "--out",
                           str(tmp_path / "g")], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    expected = (f"error: onnxruntime-genai's builder failed (exit status 1; its output is above); {tmp_path / 'g-hf'} "
                "is kept for the next try" if builder_status else
                f"error: onnxruntime-genai's builder exited 0 but wrote no {tmp_path / 'g' / 'genai_config.json'}")
    assert done.stderr.strip().splitlines()[-1] == expected and "wrote " not in done.stdout


def test_the_side_by_side_summary_gives_each_export_its_ratios_to_q8_0_the_floor_and_the_reference():
    import bench_side_by_side

    rows = {"llama.cpp Q8_0": {"prefill_ms": 800.0, "decode_ms": {16: 10.0, 128: 12.0}},
            "ours int8": {"prefill_ms": 400.0, "decode_ms": {16: 8.0, 128: 9.0}, "archive_bytes": 300_000_000},
            bench_side_by_side.REFERENCE_ROW: {"prefill_ms": float("nan"), "decode_ms": {24: 64.0}, "fixed_length": 24}}
    lines = bench_side_by_side.summary_lines(rows, [16, 128], bandwidth_gbps=30.0)
    assert lines[2] == "| llama.cpp Q8_0 | 10.0 | 1.000 | 12.0 | 1.000 | 800 | 1.00 |"
    assert lines[3] == "| ours int8 | 8.0 | 0.800 | 9.0 | 0.750 | 400 | 0.50 |"
    # the reference runs one fixed-length graph per token: the same time in every context column
    assert lines[4] == "| reference (IREE, re-decode) | 64.0 | 6.400 | 64.0 | 5.333 | – | – |"  # no prompt step of its own
    # floor: 300 MB at 30 GB/s is 10 ms; 8 ms is 0.8 of it and 0.125 of the reference's 64 ms
    assert lines[5:] == ["ours int8: bandwidth floor 10.0 ms/token; decode @16 = 0.80 x floor, 0.125 x the reference's "
                         "64.0 ms/token"]
    without = bench_side_by_side.summary_lines({k: v for k, v in rows.items() if k != "llama.cpp Q8_0"}, [16, 128], 30.0)
    assert without[2] == "| ours int8 | 8.0 | – | 9.0 | – | 400 | – |"


def test_the_side_by_side_run_ends_with_other_processes_cpu_use_per_system(monkeypatch, tmp_path):
    """The last line names each system's ``other_cpus`` (measured around its timed steps by
    ``gemma_export.bench.OtherWork``; — where its window was too short), or says it could not be
    measured; systems timed beside other work are named in a note (a helper's llama.cpp ran at 2.5 s
    a token beside a test suite, 0.006 x ours, without a word)."""
    import bench_side_by_side

    import gemma_export.bench as bench_module

    rows = {"llama.cpp Q8_0": {"decode_ms": {16: 3.0}, "other_cpus": 2.5}, "ours int8": {"decode_ms": {16: 9.0}, "other_cpus": 0.1},
            "reference (IREE, re-decode)": {"decode_ms": {64: 70.0}, "other_cpus": None}}
    assert bench_side_by_side.other_work_line(rows).splitlines() == [
        "other processes' CPU use while each system was timed (CPUs; — too short to tell): llama.cpp Q8_0 2.50, "
        "ours int8 0.10, reference (IREE, re-decode) —",
        "note: other processes used 0.2 CPUs or more while llama.cpp Q8_0 was timed: those times, and the ratios built "
        "on them, are not the systems' own; run again on an idle machine"]
    rows["ours int8"]["other_cpus"] = 0.2
    assert "while llama.cpp Q8_0, ours int8 were timed" in bench_side_by_side.other_work_line(rows)
    rows["llama.cpp Q8_0"]["other_cpus"] = rows["ours int8"]["other_cpus"] = 0.0
    assert "note:" not in bench_side_by_side.other_work_line(rows)
    monkeypatch.setattr(bench_module, "PROC_STAT", tmp_path / "no-stat")
    assert bench_side_by_side.other_work_line({"x": {"other_cpus": None}}) == \
        "other processes' CPU use: not measured here (no /proc/stat)"


# tools, part A (nineteenth session) ------------------------------------------------------------------
# make_reference_export.py, bench_export.py, bench_inspect.py, genai_anchor.py and jax_reference.py:
# bad output paths refused up front naming the option, both reference files or neither, the child's
# own error line, and genai_anchor's derived folders, cleanup, damaged kept folder and versions.


def _slow_work_refused(*_args, **_kwargs):
    raise AssertionError("the slow work started")


def _main_refuses(module, monkeypatch, capsys, argv: list[str]) -> str:
    """Run ``module.main()`` with ``argv``; it must stop with argparse's status 2, before any work.
    Returns its last stderr line."""
    monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *argv])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _no_reference_work(monkeypatch):
    import jax_reference

    import gemma_export.quality
    import gemma_export.sources

    monkeypatch.setattr(gemma_export.sources, "open_source", _slow_work_refused)
    monkeypatch.setattr(gemma_export.quality, "transformers_model", _slow_work_refused)
    monkeypatch.setattr(jax_reference, "write_jax_reference", _slow_work_refused)


def test_make_reference_export_refuses_a_folder_named_like_its_output_before_the_work(tmp_path, monkeypatch):
    # it ran ~19 s, then failed on a temporary path with the new archive already moved in
    import make_reference_export

    from gemma_export.errors import GemmaExportError

    out = tmp_path / "R"
    (out / "gemma.mlir").mkdir(parents=True)
    (out / "gemma.mlir" / "inner").write_text("keep")
    (out / "gemma.safetensors").write_text("OLD")
    _no_reference_work(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["make_reference_export.py", "--out", str(out), "--dtype", "int8"])
    with pytest.raises(GemmaExportError, match=f"^--out {out}: {out / 'gemma.mlir'} is a folder; expected a file"):
        make_reference_export.main()
    assert (out / "gemma.safetensors").read_text() == "OLD" and (out / "gemma.mlir" / "inner").read_text() == "keep"
    assert sorted(os.listdir(out)) == ["gemma.mlir", "gemma.safetensors"]


@pytest.mark.parametrize("old", [True, False])
def test_make_reference_export_keeps_the_old_pair_when_the_second_file_cannot_move_in(tmp_path, monkeypatch, old):
    import jax_reference
    import make_reference_export

    import gemma_export.quality
    import gemma_export.sources

    out = tmp_path / "ref"
    if old:
        out.mkdir()
        (out / "gemma.mlir").write_text("old mlir")
        (out / "gemma.safetensors").write_text("old archive")

    def write(model, folder, dtype):
        (folder / "gemma.mlir").write_text("new mlir")
        (folder / "gemma.safetensors").write_text("new archive")
        return folder / "gemma.mlir"

    def refused(move):  # the .mlir's move from the scratch folder fails (as a folder of its name made it)
        def moved(src, dst, *a, **k):
            if Path(src).name == "gemma.mlir" and Path(src).parent.name.startswith(".reference-export-"):
                raise OSError(5, "Input/output error", str(dst))
            return move(src, dst, *a, **k)
        return moved

    monkeypatch.setattr(gemma_export.sources, "open_source", lambda source: None)
    monkeypatch.setattr(gemma_export.quality, "transformers_model", lambda checkpoint: None)
    monkeypatch.setattr(jax_reference, "write_jax_reference", write)
    monkeypatch.setattr(os, "replace", refused(os.replace))
    monkeypatch.setattr(os, "rename", refused(os.rename))
    monkeypatch.setattr(sys, "argv", ["make_reference_export.py", "--out", str(out)])
    with pytest.raises(OSError, match="Input/output error"):
        make_reference_export.main()
    if old:  # the old pair, nothing else: no new archive beside the old .mlir
        assert (out / "gemma.mlir").read_text() == "old mlir"
        assert (out / "gemma.safetensors").read_text() == "old archive"
        assert sorted(os.listdir(out)) == ["gemma.mlir", "gemma.safetensors"]
    else:  # the folder this run made goes, with no new archive alone in it
        assert not out.exists()


@pytest.mark.parametrize("out, found", [
    ("/proc", "/proc: expected a folder that takes new files; it refuses them"),
    ("/proc/x", "/proc/x: expected a folder that can be created; /proc refuses new entries"),
    ("{tmp}/a-file/sub", "a-file/sub: expected a folder that can be created, but {tmp}/a-file is a file"),
])
def test_make_reference_export_checks_that_out_takes_new_files_first(tmp_path, monkeypatch, capsys, out, found):
    # --out /proc ran 10.9 s and named a temporary path; /sys/kernel blamed /sys, "written beside it"
    import make_reference_export

    (tmp_path / "a-file").write_text("x")
    _no_reference_work(monkeypatch)
    line = _main_refuses(make_reference_export, monkeypatch, capsys, ["--out", out.format(tmp=tmp_path)])
    assert line.startswith("make_reference_export.py: error: argument --out: ") and found.format(tmp=tmp_path) in line
    assert os.listdir(tmp_path) == ["a-file"]


@pytest.mark.skipif(not Path("/usr/bin/time").exists(), reason="needs GNU time")
def test_bench_export_reports_the_exports_own_error_not_gnu_times_figure(tmp_path, monkeypatch):
    # the last stderr line was GNU time's %M (a number), not the child's `error: ...`
    import bench_export

    from gemma_export.errors import GemmaExportError

    (tmp_path / "int4").write_text("a file where the export's folder goes")
    monkeypatch.setattr(sys, "argv", ["bench_export.py", "--dtypes", "int4", "--workdir", str(tmp_path)])
    with pytest.raises(GemmaExportError) as failed:
        bench_export.main()
    assert str(failed.value).endswith(f"failed (exit 2): error: {tmp_path / 'int4' / 'model'}: cannot create the "
                                      f"export folder: {tmp_path / 'int4'} is a file, not a folder"), failed.value
    assert os.listdir(tmp_path) == ["int4"]


@pytest.mark.parametrize("script", ["bench_export", "bench_inspect"])
@pytest.mark.parametrize("workdir, found", [
    ("/proc", "/proc: expected a folder that takes new files; it refuses them (No such file or directory)"),
    ("/proc/x", "/proc/x: expected a folder that can be created; /proc refuses new entries (No such file or "
                "directory)"),
])
def test_bench_scripts_check_their_workdir_first(monkeypatch, capsys, script, workdir, found):
    # bench_export: "error: /proc/x: No such file or directory"; bench_inspect wrote "writing
    # /proc/table-three-times.safetensors ..." and a traceback after building 1.18 GB of arrays
    import importlib

    module = importlib.import_module(script)
    if script == "bench_inspect":
        monkeypatch.setattr(module, "write_archive", _slow_work_refused)
    else:
        monkeypatch.setattr(module, "_run", _slow_work_refused)
    line = _main_refuses(module, monkeypatch, capsys, ["--workdir", workdir])
    assert line == f"{script}.py: error: argument --workdir: {found}"


def _fake_genai_python(folder: Path, versions: str = "0.15.2 4.57.1", builder: str = "exit 1") -> Path:
    """A stand-in for the venv's python: the probe prints PROBE_OK and ``versions``; the builder
    (``-m builder -i HF -o OUT -p P -e cpu -c CACHE``) logs its arguments, then runs ``builder``."""
    import genai_anchor

    fake = folder / "python"
    fake.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = -c ]; then touch '{folder}/probed'; echo '{genai_anchor.PROBE_OK} {versions}'; "
                    "exit 0; fi\n"
                    f"echo \"$@\" > '{folder}/builder-args'\n"
                    f"{builder}\n")
    fake.chmod(0o755)
    return fake


def _complete_hf(folder: Path, cut: int = 0) -> Path:
    import genai_anchor
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    save_file({"w": np.arange(64, dtype=np.float32)}, str(folder / "model.safetensors"))
    if cut:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[:-cut])
    (folder / genai_anchor.COMPLETE_MARKER).write_text("")
    return folder


def test_genai_anchor_resolves_out_so_its_derived_folders_are_siblings(tmp_path, monkeypatch):
    # --out . made the names "-hf" and "-cache" (args.out.name was ""): a 1.1 GB "-hf/" inside
    import genai_anchor

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools, builder='mkdir -p "$6" && echo {} > "$6/genai_config.json"')
    (tmp_path / "work").mkdir()
    _complete_hf(tmp_path / "work-hf")
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", "."])
    genai_anchor.main()
    args = (tools / "builder-args").read_text().split()
    assert args[args.index("-i") + 1] == str(tmp_path / "work-hf")
    built = Path(args[args.index("-o") + 1])  # a staging folder beside it, which replaces it once complete
    assert built.parent == tmp_path and built.name.startswith(".work.staging-")
    assert args[args.index("-c") + 1] == str(tmp_path / "work-cache")
    assert os.listdir(tmp_path / "work") == ["genai_config.json"]


@pytest.mark.parametrize("out, found", [
    ("/proc/x", "/proc/x: expected a folder that can be created; /proc refuses new entries"),
    ("{tmp}/emptyfile/sub", "emptyfile/sub: expected a folder that can be created, but {tmp}/emptyfile is a file"),
    ("{tmp}/o2", "o2: the transformers folder is written beside it, and {tmp}/o2-hf: is a file, expected a folder"),
    ("{tmp}/o3", "o3: the builder's cache is written beside it, and {tmp}/o3-cache: is a file, expected a folder"),
])
def test_genai_anchor_checks_out_and_its_derived_folders_before_the_probe(tmp_path, monkeypatch, capsys, out, found):
    # the errors named the derived "-hf" path, after the ~4 s probe (and /proc/x-hf after writing nothing)
    import genai_anchor

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools)
    for name in ("emptyfile", "o2-hf", "o3-cache"):
        (tmp_path / name).write_text("")
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    line = _main_refuses(genai_anchor, monkeypatch, capsys, ["--python", str(fake), "--out", out.format(tmp=tmp_path)])
    assert line.startswith("genai_anchor.py: error: argument --out: ") and found.format(tmp=tmp_path) in line, line
    assert not (tools / "probed").exists()
    assert sorted(os.listdir(tmp_path)) == ["emptyfile", "o2-hf", "o3-cache", "tools"]


def test_genai_anchor_removes_what_it_created_when_the_builder_fails(tmp_path, monkeypatch):
    # empty g/ and g-cache/ were left behind; a complete g-hf/ stays for the next try
    import genai_anchor

    from gemma_export.errors import GemmaExportError

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools, builder='mkdir -p "$6" "${12}"; exit 1')
    _complete_hf(tmp_path / "g-hf")
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(tmp_path / "g")])
    with pytest.raises(GemmaExportError, match="builder failed"):
        genai_anchor.main()
    assert sorted(os.listdir(tmp_path)) == ["g-hf", "tools"]


def test_genai_anchor_removes_the_transformers_folder_it_did_not_complete(tmp_path, monkeypatch):
    import genai_anchor

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools)

    def interrupted(folder):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"part of 1 GB")
        raise KeyboardInterrupt

    monkeypatch.setattr(genai_anchor, "write_hf_folder", interrupted)
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(tmp_path / "g")])
    with pytest.raises(KeyboardInterrupt):
        genai_anchor.main()
    assert os.listdir(tmp_path) == ["tools"]


@pytest.mark.parametrize("cut", [0, 40, "missing"])
def test_genai_anchor_writes_a_damaged_kept_folder_again(tmp_path, monkeypatch, capsys, cut):
    # a g-hf/ marked complete with a truncated (or, since a review, a missing) model.safetensors was
    # reused, and every retry failed alike
    import genai_anchor

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools, builder='mkdir -p "$6" && echo {} > "$6/genai_config.json"')
    hf = _complete_hf(tmp_path / "g-hf", cut=0 if cut == "missing" else cut)
    if cut == "missing":
        (hf / "model.safetensors").unlink()
    rewritten = []
    monkeypatch.setattr(genai_anchor, "write_hf_folder", lambda folder: rewritten.append(folder) or folder)
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(tmp_path / "g")])
    genai_anchor.main()
    assert rewritten == ([hf] if cut else [])
    assert ("is damaged" in capsys.readouterr().err) == bool(cut)


def test_genai_anchor_refuses_a_python_with_transformers_5_before_writing(tmp_path, monkeypatch):
    import genai_anchor

    from gemma_export.errors import GemmaExportError

    tools = tmp_path / "tools"
    tools.mkdir()
    fake = _fake_genai_python(tools, versions="0.18.0 5.0.0")
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(tmp_path / "g")])
    with pytest.raises(GemmaExportError, match=rf"^--python {fake}: has onnxruntime-genai 0.18.0 with transformers "
                                               r"5.0.0; its builder fails on transformers 5 configs"):
        genai_anchor.main()
    assert sorted(os.listdir(tools)) == ["probed", "python"] and os.listdir(tmp_path) == ["tools"]


def test_jax_reference_help_is_help_and_other_arguments_an_error():
    import subprocess

    helped = subprocess.run([sys.executable, str(TOOLS / "jax_reference.py"), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "run tools/make_reference_export.py --help" in helped.stdout, helped
    for argv in (["-h"], ["--out", "x"]):
        done = subprocess.run([sys.executable, str(TOOLS / "jax_reference.py"), *argv], capture_output=True, text=True)
        if argv == ["-h"]:
            assert done.returncode == 0
        else:
            assert done.returncode == 2 and done.stderr.startswith("error: tools/jax_reference.py is a module")


def test_a_median_of_few_decode_steps_gets_a_note():
    """A helper's `--new-tokens 4` printed "decode median of 1 steps" like any other run; as
    `gemma-export bench` does, the tools say when fewer than 16 steps were timed."""
    import _args

    assert _args.few_steps_note("--steps", 4) == "note: only 1 timed step per measurement (--steps 19 or more for steadier figures)"
    assert _args.few_steps_note("--new-tokens", 18) == ("note: only 15 timed steps per measurement (--new-tokens 19 or "
                                                        "more for steadier figures)")
    assert _args.few_steps_note("--steps", 19) == ""
