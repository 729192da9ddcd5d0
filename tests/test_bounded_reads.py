"""Files read whole are refused first when they are not regular files (a FIFO's read blocks for
ever) or larger than any such file could be (an 8 GB manifest.json was a MemoryError traceback):
probe findings of 2026-12-06. Sparse files stand in for large ones: they cost no disk."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gemma_export.cli import app
from gemma_export.errors import ConfigError, FormatError
from gemma_export.staging import output_changes
from gemma_export.text_files import SMALL_FILE_BYTES, TEXT_BYTES_READ, read_bounded

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@contextlib.contextmanager
def _no_hang(seconds: int = 60):
    """Fail the test instead of blocking for ever (a FIFO read would)."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: blocked on a FIFO?")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _sparse(path: Path, size: int) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
    return path


@pytest.fixture
def export_copy(tiny_int8_export, tmp_path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(tiny_int8_export, folder)
    return folder


def test_read_bounded_refuses_a_fifo_a_folder_and_a_file_over_the_limit(tmp_path):
    (tmp_path / "ok.json").write_bytes(b"{}")
    assert read_bounded(tmp_path / "ok.json", "a manifest") == b"{}"
    os.mkfifo(tmp_path / "fifo.json")
    with _no_hang(), pytest.raises(FormatError, match=r"fifo.json: is not a regular file \(a FIFO, socket or device\); "
                                                      "expected a manifest$"):
        read_bounded(tmp_path / "fifo.json", "a manifest")
    with pytest.raises(FormatError, match=rf"^{tmp_path}: is a folder; expected a manifest$"):
        read_bounded(tmp_path, "a manifest")
    big = _sparse(tmp_path / "big.json", 1001)
    with pytest.raises(FormatError, match=rf"^{big}: 1,001 bytes; expected a manifest of at most 1,000$"):
        read_bounded(big, "a manifest", 1000)
    with pytest.raises(FileNotFoundError):
        read_bounded(tmp_path / "absent.json", "a manifest")


def test_an_oversized_manifest_is_one_line_for_generate_and_verify(export_copy):
    size = SMALL_FILE_BYTES + 1
    _sparse(export_copy / "manifest.json", size)
    for args in (["generate", "--model", export_copy, "--prompt", "hi", "--max-new-tokens", 1], ["verify", export_copy]):
        result = _run(*args)
        assert result.exit_code != 0 and "Traceback" not in result.output, result.output
        assert (f"{export_copy / 'manifest.json'}: unreadable manifest: {size:,} bytes; expected a manifest of at most "
                f"{SMALL_FILE_BYTES:,}") in result.output


def test_an_export_over_a_folder_whose_manifest_is_a_fifo_is_refused_not_blocked(tiny_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "manifest.json")
    with _no_hang():
        result = _run("--source", tiny_dir, "--dtype", "fp32", "--out", out)
    assert result.exit_code != 0 and "manifest.json is not a regular file (a FIFO, socket or device)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]  # nothing added, nothing replaced


def test_a_listed_file_that_became_a_fifo_or_a_link_makes_the_folder_foreign(export_copy):
    assert output_changes(export_copy, "manifest.json") == ""
    tokenizer = export_copy / "tokenizer.json"
    kept = tokenizer.read_bytes()
    tokenizer.unlink()
    os.mkfifo(tokenizer)
    with _no_hang():
        assert output_changes(export_copy, "manifest.json") == ("tokenizer.json is not a regular file (a FIFO, socket "
                                                                 "or device), not the file manifest.json lists")
    tokenizer.unlink()
    (export_copy.parent / "elsewhere.json").write_bytes(kept)
    tokenizer.symlink_to(export_copy.parent / "elsewhere.json")  # the same bytes, but not a file of the folder
    assert output_changes(export_copy, "manifest.json") == "tokenizer.json is a link, not the file manifest.json lists"
    manifest = export_copy / "manifest.json"
    manifest.rename(export_copy.parent / "manifest.json")
    manifest.symlink_to(export_copy.parent / "manifest.json")
    assert output_changes(export_copy, "manifest.json") == "manifest.json is a link"


def test_a_listed_file_that_became_a_folder_is_named_as_one(export_copy):
    tokenizer = export_copy / "tokenizer.json"
    tokenizer.unlink()
    (tokenizer / "inside").mkdir(parents=True)  # its contents are not what is wrong: it is
    assert output_changes(export_copy, "manifest.json") == "tokenizer.json is a folder, not the file manifest.json lists"


@pytest.mark.parametrize("kind", ["folder", "fifo", "broken link"])
def test_a_graph_that_is_not_a_file_is_named_for_generate(export_copy, kind):
    graph = export_copy / "model.onnx"
    graph.unlink()
    {"folder": graph.mkdir, "fifo": lambda: os.mkfifo(graph),
     "broken link": lambda: graph.symlink_to(export_copy / "absent.onnx")}[kind]()
    with _no_hang():
        result = _run("generate", "--model", export_copy, "--prompt", "hi", "--max-new-tokens", 1)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{graph}: is {'a folder' if kind == 'folder' else 'a broken link' if kind == 'broken link' else 'not a regular file'}" \
        in result.output


def test_a_huge_file_in_the_graphs_place_is_refused_before_it_is_read(export_copy):
    graph = export_copy / "model.onnx"
    graph.unlink()
    _sparse(graph, 3 << 30)  # onnx.load would read all of it
    result = _run("generate", "--model", export_copy, "--prompt", "hi", "--max-new-tokens", 1)
    assert result.exit_code == 2 and f"{graph}: {3 << 30:,} bytes, but" in result.output  # the manifest's size
    from gemma_export.errors import FormatError as Refused
    from gemma_export.onnx_files import read_graph
    with pytest.raises(Refused, match=r"bytes; not an ONNX model, which protobuf limits to 2,147,483,647"):
        read_graph(graph)  # inspect and dedupe, with no manifest to compare with


def test_a_huge_reference_mlir_or_one_long_line_is_refused_without_reading_it(tmp_path):
    from gemma_export.sources.mlir import MAX_MLIR_BYTES, parse_mlir

    huge = _sparse(tmp_path / "huge.mlir", MAX_MLIR_BYTES + 1)
    with pytest.raises(FormatError, match=rf"huge.mlir: {MAX_MLIR_BYTES + 1:,} bytes; expected reference MLIR text"):
        parse_mlir(huge)
    long = tmp_path / "long.mlir"
    long.write_bytes(b"module {\n" + b"x" * (2 << 20) + b"\n}\n")
    with pytest.raises(FormatError, match=r"long.mlir:2: a line of more than 1 MiB; not reference MLIR text"):
        parse_mlir(long)


def test_a_bundle_listing_that_is_a_folder_is_named(tmp_path):
    folder = tmp_path / "bundle"
    (folder / "BUNDLE.json").mkdir(parents=True)
    result = _run("verify", folder)
    assert result.exit_code != 0
    assert f"{folder / 'BUNDLE.json'}: is a folder; a board folder's listing is a JSON file" in result.output


def test_a_prepacked_record_that_is_a_fifo_is_named(export_copy):
    copy = export_copy / "prepacked"
    copy.mkdir()
    os.mkfifo(copy / "prepacked.json")
    with _no_hang():
        result = _run("prepack", "--model", export_copy)
    assert result.exit_code != 0
    assert "has a prepacked.json that is not a regular file (a FIFO, socket or device)" in result.output


@pytest.mark.parametrize("option", ["--prompts", "--golden"])
def test_an_oversized_prompts_or_golden_file_is_refused_before_it_is_read(export_copy, tmp_path, option):
    big = _sparse(tmp_path / "big.json", SMALL_FILE_BYTES + 1)
    golden = tmp_path / "golden.json"
    golden.write_text("[5, 6]")
    args = ["--golden", big] if option == "--golden" else ["--golden", golden, "--prompts", big]
    result = _run("parity", "--model", export_copy, *args)
    assert result.exit_code == 2 and "Traceback" not in result.output
    what = "golden file" if option == "--golden" else "prompts file"
    assert f"{big}: {SMALL_FILE_BYTES + 1:,} bytes; expected a {what} of at most {SMALL_FILE_BYTES:,}" in result.output


def test_an_oversized_config_json_is_named(tmp_path):
    from gemma_export.config import load_hf_config

    config = _sparse(tmp_path / "config.json", SMALL_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match=rf"config.json: {SMALL_FILE_BYTES + 1:,} bytes; expected a config.json of "
                                          rf"at most {SMALL_FILE_BYTES:,}$"):
        load_hf_config(config)


def test_a_calibration_text_is_read_only_as_far_as_its_tokens_need(tmp_path):
    from gemma_export.calibration import calibration_text

    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.write(b"real words " * 200_000)  # 2.2 MB
    text, where = calibration_text(path, 4096)
    assert where == str(path) and len(text) == max(TEXT_BYTES_READ, 64 * 4097) == 1 << 20
    assert len(calibration_text(path, 20_000)[0]) == 64 * 20_001  # past the floor: 64 bytes a token
    assert len(calibration_text(path, None)[0]) == 2_200_000  # the Python API's default: the whole file


def test_the_export_reads_its_calibration_text_as_far_as_its_tokens(tiny_dir, tmp_path, monkeypatch):
    from conftest import write_char_tokenizer
    from gemma_export import calibration, exporter

    seen = []

    def recorded(path, tokens=None):
        seen.append(tokens)
        return real(path, tokens)
    real = calibration.calibration_text
    monkeypatch.setattr(exporter, "read_calibration_text", recorded)
    text = tmp_path / "calib.txt"
    text.write_text("the quick brown fox " * 200)
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    exporter.export(src, tmp_path / "out", "int8", block_size=16, calibration_text=text, calibration_tokens=64)
    assert seen == [64]


def test_running_out_of_memory_is_one_line(export_copy, monkeypatch):
    import gemma_export.inspect as inspect_module

    def exhausted(*_args, **_kwargs):
        raise MemoryError
    monkeypatch.setattr(inspect_module, "inspect_path", exhausted)
    result = _run("inspect", export_copy)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert result.output.strip() == ("error: out of memory: a step needed more memory than "
                                     "this machine, or a limit on this process (ulimit -v), gives; rerun with --debug "
                                     "to see which step ran out")
    assert isinstance(_run("inspect", export_copy, "--debug").exception, MemoryError)  # --debug: the real one
    assert json.loads((export_copy / "manifest.json").read_text())["files"]  # the input is untouched


def test_a_file_of_zeros_is_not_taken_for_text(tmp_path):
    """UTF-8 allows NUL, so 2 MB of zeros passed as 'real text' for bench and calibration (second probe)."""
    from gemma_export.calibration import calibration_text

    zeros = tmp_path / "zeros.txt"
    zeros.write_bytes(b"some words, then " + bytes(1 << 20))
    with pytest.raises(FormatError, match=r"zeros.txt: holds a NUL character at offset 17; expected text, not binary"):
        calibration_text(zeros, 4096)


def test_a_huge_array_in_a_message_is_cut_before_it_is_written():
    """A GGUF metadata array may hold 2**26 items: only what the 60 characters can show is converted
    (the whole 4M-item array took 248 MB to write; review finding)."""
    import numpy as np

    from gemma_export.errors import shown

    assert shown(np.arange(1 << 22, dtype=np.uint32)) == "[" + ", ".join(map(str, range(17))) + "..."
    assert shown(list(range(1 << 22))) == shown(np.arange(1 << 22))
    assert shown(np.array([1, 2], dtype=np.int32)) == "[1, 2]" and shown(np.float32(0.5)) == "0.5"


@pytest.mark.parametrize("command, expected", [
    (lambda link, model: ["parity", "--model", model, "--golden", link], "a golden file"),
    (lambda link, model: ["inspect", link], "a .onnx, .safetensors, .gguf or .mlir file"),
    (lambda link, model: ["generate", "--model", link, "--prompt", "hi"], "an export folder"),
    (lambda link, model: ["verify", link], "an export folder"),
    (lambda link, model: ["quality", "--model", model, "--reference", link], "an export folder"),
    (lambda link, model: ["--source", link, "--out", link.parent / "out"],
     "a transformers folder, a .gguf or a reference .mlir file"),
], ids=["golden", "inspect", "generate", "verify", "quality-reference", "source"])
def test_a_broken_link_is_named_as_one_not_as_a_missing_file(export_copy, tmp_path, command, expected):
    """A fresh user's finding: a link to nothing read "no such golden file", which sent them looking
    for a file they could see in the folder."""
    link = tmp_path / "gone.json"
    link.symlink_to(tmp_path / "moved" / "golden.json")
    result = _run(*command(link, export_copy))
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{link}: a broken link (to {tmp_path / 'moved' / 'golden.json'}); expected {expected}" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.jinja"])
def test_an_oversized_tokenizer_side_file_of_a_source_is_one_line(tiny_dir, tmp_path, name):
    """A break-it run: the refusal (``text_files.FileRefused``) was re-raised as ``type(exc)(message)``,
    which that class's constructor does not take: a TypeError traceback, exit 1."""
    from conftest import write_char_tokenizer

    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    size = SMALL_FILE_BYTES + 1
    _sparse(source / name, size)
    result = _run("--source", source, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert (f"{source / name}: {size:,} bytes; expected a tokenizer side file of at most {SMALL_FILE_BYTES:,}"
            in result.output)
    assert not (tmp_path / "out").exists()


def test_reworded_keeps_the_toolkit_class_of_a_subclass_with_its_own_constructor(tmp_path):
    from gemma_export.errors import FormatError, SourceNotFoundError, reworded
    from gemma_export.text_files import FileRefused

    again = reworded(FileRefused(tmp_path / "a.json", "too big"), "a.json: too big (--tokenizer)")
    assert type(again) is FormatError and str(again) == "a.json: too big (--tokenizer)"
    assert type(reworded(SourceNotFoundError("x"), "y")) is SourceNotFoundError


def test_broken_link_reads_the_link_itself_and_lets_other_errors_through(tmp_path, monkeypatch):
    """broken_link calls os.lstat itself: Path.is_symlink returns False on every OSError from Python
    3.13, which would hide a name too long; an error that is neither "no such path" nor a name too
    long (permissions) still reaches the caller, as pathlib raised it before."""
    import errno
    import os

    from gemma_export.staging import max_name_bytes
    from gemma_export.text_files import broken_link

    limit = max_name_bytes(tmp_path)
    assert broken_link(tmp_path / ("x" * (limit + 1))) == (
        f"File name too long (a name of {limit + 1} bytes in it; this file system takes at most {limit})")
    assert broken_link(tmp_path / "absent") is None and broken_link(tmp_path / "absent" / "below") is None
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    assert broken_link(tmp_path / "loop") == "a loop of symbolic links"
    monkeypatch.setattr(pathlib.Path, "is_symlink", lambda self: False)  # Python 3.13's answer to any OSError
    assert broken_link(tmp_path / ("x" * (limit + 1))).startswith("File name too long")

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "lstat", denied)
    with pytest.raises(PermissionError):
        broken_link(tmp_path / "secret")


def test_read_bounded_allocates_the_file_not_the_limit(tmp_path):
    """A helper under `ulimit -v 1000000`: every export failed with "out of memory", as reading a
    1,775-byte tokenizer.json allocated its 1 GiB limit first (read(n) reserves n bytes). Under an
    address-space limit 256 MiB above the process's size, a small file is read with a 1 GiB limit."""
    small = tmp_path / "tokenizer.json"
    small.write_text('{"model": {}}')
    script = textwrap.dedent(f"""
        import resource
        from gemma_export.text_files import read_bounded
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
        print(read_bounded({str(small)!r}, "a tokenizer", 1 << 30).decode())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == '{"model": {}}', done.stderr[-500:]


def test_read_bounded_reads_past_a_stale_size_up_to_the_limit(tmp_path, monkeypatch):
    """The size from fstat sizes the first read; a file longer than that (it grew) is read on, in
    steps, whole when it stays within the limit and refused once it passes it."""
    import gemma_export.text_files as text_files

    data = bytes(range(256)) * 12_000  # 3,072,000 bytes: three steps of 1 MiB past the stale size
    grown = tmp_path / "grown.json"
    grown.write_bytes(data)
    real_fstat = os.fstat
    monkeypatch.setattr(text_files.os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 10, *real_fstat(fd)[7:])))
    assert read_bounded(grown, "a manifest", 4_000_000) == data
    with pytest.raises(FormatError, match=r"grown.json: more than 3,000,000 bytes; expected a manifest of at most 3,000,000$"):
        read_bounded(grown, "a manifest", 3_000_000)
    limit = len(data) - 5  # the size one byte under the limit, the file past it (a reviewer's surviving mutation)
    monkeypatch.setattr(text_files.os, "fstat",
                        lambda fd: os.stat_result((*real_fstat(fd)[:6], limit - 1, *real_fstat(fd)[7:])))
    with pytest.raises(FormatError, match=rf"more than {limit:,} bytes"):
        read_bounded(grown, "a manifest", limit)


def test_onnxruntime_out_of_memory_is_named_as_such(export_copy, monkeypatch):
    """A helper under `ulimit -v`: onnxruntime's std::bad_alloc at load read "model.onnx: onnxruntime
    cannot load the model: ... std::bad_alloc", as if the model were damaged; in a step it was a
    traceback."""
    import onnxruntime as ort

    import gemma_export.runtime as runtime

    class Exhausted(Exception):
        pass

    def no_memory(*_args, **_kwargs):
        raise Exhausted("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Exception during initialization: std::bad_alloc")
    monkeypatch.setattr(ort, "InferenceSession", no_memory)
    result = _run("generate", "--model", export_copy, "--prompt", "ab", "--no-prepacked")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().startswith(f"error: {export_copy / 'model.onnx'}: onnxruntime ran out of memory loading "
                                            "it ([ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION")
    assert "a limit on this process (ulimit -v)" in result.output and "cannot load the model" not in result.output
    monkeypatch.undo()

    def step_without_memory(*_args, **_kwargs):
        raise Exhausted("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running "
                        "MatMulNBits node. std::bad_alloc")
    monkeypatch.setattr(runtime, "generate", step_without_memory)
    result = _run("generate", "--model", export_copy, "--prompt", "ab")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip() == (
        "error: out of memory: a step needed more memory than this machine, or a limit on this process (ulimit -v), "
        "gives ([ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running MatMulNBits "
        "node. std::bad_alloc); rerun with --debug to see which step ran out")
    # onnxruntime's own arena words it otherwise (a reviewer, onnxruntime 1.32 under RLIMIT_AS)
    arena = ("[ONNXRuntimeError] : 1 : FAIL : onnxruntime/core/framework/bfc_arena.cc:359 void* onnxruntime::BFCArena::"
             "AllocateRawInternal(size_t, bool, onnxruntime::Stream*) Failed to allocate memory for requested buffer "
             "of size 4294967296")
    monkeypatch.setattr(runtime, "generate", lambda *a, **k: (_ for _ in ()).throw(Exhausted(arena)))
    result = _run("generate", "--model", export_copy, "--prompt", "ab")
    assert result.exit_code == 2 and result.output.strip().startswith("error: out of memory: a step needed more memory")
    assert isinstance(_run("generate", "--model", export_copy, "--prompt", "ab", "--debug").exception, Exhausted)
    # other failures are not reworded: a bug; glibc's static TLS error; "memory" in a path (a reviewer)
    for other in (ValueError("a bug"), ImportError("libgomp.so.1: cannot allocate memory in static TLS block"),
                  Exhausted("[ONNXRuntimeError] : 7 : INVALID_PROTOBUF : Load model from /x/cannot allocate memory/"
                            "model.onnx failed:Protobuf parsing failed.")):
        monkeypatch.setattr(runtime, "generate", lambda *a, e=other, **k: (_ for _ in ()).throw(e))
        assert _run("generate", "--model", export_copy, "--prompt", "ab").exception is other


def test_the_note_after_a_run_cannot_fail_the_run(export_copy, monkeypatch):
    """A helper under `ulimit -v 300000`: generate printed its text and timing, then a traceback from
    the after-run check of the files' sizes against the manifest, and exited 1."""
    import gemma_export.manifest as manifest

    def exhausted(*_args):
        raise MemoryError
    monkeypatch.setattr(manifest, "resized_files", exhausted)
    result = _run("generate", "--model", export_copy, "--prompt", "ab", "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    assert f"note: {export_copy}'s files were not compared with its manifest.json (out of memory)" in result.output


def test_out_of_memory_outside_a_command_is_one_line(tmp_path):
    """A helper under `ulimit -v 150000`: importing a library failed ("failed to map segment from
    shared object") with a 55-line traceback and status 1. The entry point says it in one line."""
    script = textwrap.dedent("""
        import sys
        import gemma_export.cli
        def no_room():
            raise ImportError("libfoo.so: failed to map segment from shared object")
        gemma_export.cli.app = no_room
        from gemma_export.console import main
        sys.argv = ["gemma-export", *sys.argv[1:]]
        main()
    """)
    done = subprocess.run([sys.executable, "-c", script, "verify", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == (  # glibc words a noexec mount alike (a reviewer): both named
        "error: cannot load a library (libfoo.so: failed to map segment from shared object): the process is out of "
        "address space (a limit set by ulimit -v), or the library's file system is mounted noexec\n"), done.stderr
    done = subprocess.run([sys.executable, "-c", script, "verify", "x", "--debug"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" in done.stderr and "ImportError" in done.stderr


def test_the_system_out_of_memory_is_named_as_such(export_copy, monkeypatch):
    """A fresh user under `ulimit -v 300000`: mapping the GGUF failed with "error: Cannot allocate
    memory" (ENOMEM), which named neither memory running out nor what to do."""
    import errno

    import gemma_export.inspect as inspect_module

    def no_room(*_args, **_kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")
    monkeypatch.setattr(inspect_module, "inspect_path", no_room)
    result = _run("inspect", export_copy)
    assert result.exit_code == 2 and result.output.strip() == (
        "error: out of memory: a step needed more memory than this machine, or a limit on this process (ulimit -v), "
        "gives (Cannot allocate memory); rerun with --debug to see which step ran out")


def test_an_export_whose_check_runs_out_of_memory_names_the_output(tiny_dir, tmp_path, monkeypatch):
    """A fresh user under `ulimit -v 1200000`: the export's final check load ran out of memory and the
    line named the hidden staging folder, already deleted, as the model."""
    from gemma_export import exporter
    from gemma_export.errors import ResourceError

    def no_room(folder):
        raise ResourceError(f"{folder / 'model.onnx'}: onnxruntime ran out of memory loading it (std::bad_alloc): the "
                            "model needs more memory than this machine, or a limit on this process (ulimit -v), gives")
    monkeypatch.setattr(exporter, "verify_folder", no_room)
    out = tmp_path / "out"
    result = runner.invoke(app, ["--source", str(tiny_dir), "--out", str(out), "--dtype", "fp32"])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {out / 'model.onnx'}: onnxruntime ran out of memory loading it (std::bad_alloc): the model needs more "
        "memory than this machine, or a limit on this process (ulimit -v), gives (the new export's check, onnxruntime "
        "loading it); nothing was written")
    assert list(tmp_path.iterdir()) == []
