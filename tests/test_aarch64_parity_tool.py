"""tools/aarch64/parity.py on the host alone: each output is checked before the work (its folder, the
inputs, the export folder, an existing file of another kind) and written whole or not at all, and a
damaged dump is one error line with exit status 2 (1 means "greedy tokens differ"). The runs on the
emulated board are tests/test_aarch64.py's."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

PARITY = Path(__file__).resolve().parents[1] / "tools" / "aarch64" / "parity.py"
DUMP_EXPECTED = "expected .npz with logits, greedy, text, machine, decode_ms_median"


def _run(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PARITY), *map(str, args)], capture_output=True, text=True, cwd=cwd)


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def made(tiny_int8_export, tmp_path_factory) -> Path:
    """A folder with text.txt, and the ids file (40 text ids), a dump and a report parity.py made of it."""
    work = tmp_path_factory.mktemp("parity")
    (work / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 4)
    for args in (("prepare", "--model", tiny_int8_export, "--out", "ids.json", "--tokens", 40, "--text", "text.txt"),
                 ("dump", "--model", tiny_int8_export, "--ids", "ids.json", "--out", "x86.npz"),
                 ("compare", "x86.npz", "x86.npz", "--json", "report.json")):
        proc = _run(*args, cwd=work)
        assert proc.returncode == 0, proc.stderr
    return work


@pytest.fixture
def work(made, tmp_path) -> Path:
    """A copy of :func:`made`'s files, for a test to write into."""
    for path in made.iterdir():
        shutil.copy(path, tmp_path)
    return tmp_path


#: per command: its arguments writing OUT, what it writes, and files it must not replace (the
#: "precious" notes, another kind's output) with what the error says each holds
COMMANDS = {
    "prepare": (["prepare", "--model", "{model}", "--out", "OUT", "--tokens", "30", "--text", "text.txt"],
                "an ids file `parity.py prepare` wrote (JSON with prompts, text and new_tokens)",
                {"precious": "a file that is not JSON", "report.json": "JSON without 'prompts'"}),
    "dump": (["dump", "--model", "{model}", "--ids", "ids.json", "--out", "OUT"],
             "a dump `parity.py dump` wrote (.npz with logits, greedy and text)",
             {"precious": "a file that is not a .npz archive", "weights.npz": "a .npz without 'logits'"}),
    "compare": (["compare", "x86.npz", "x86.npz", "--json", "OUT"],
                "a report `parity.py compare` wrote (JSON with machines and greedy_identical)",
                {"precious": "a file that is not JSON", "ids.json": "JSON without 'machines'"}),
}


def _earlier(command: str, path: Path) -> None:
    """An earlier output of ``command`` at ``path``, whose figures a new run replaces."""
    if command == "prepare":
        path.write_text(json.dumps({"prompts": [[2, 5]], "text": [2, 5], "new_tokens": 2}))
    elif command == "dump":
        with open(path, "wb") as f:
            np.savez(f, logits=np.zeros((2, 96), np.float32), greedy=np.zeros((1, 2), np.int64),
                     text=np.zeros(2, np.int64))
    else:
        path.write_text(json.dumps({"machines": ["x", "y"], "greedy_identical": [False]}))


def _new_figures(command: str, path: Path, made: Path):
    if command == "prepare":
        return len(json.loads(path.read_text())["text"])
    if command == "dump":
        return np.array_equal(np.load(path)["text"], np.load(made / "x86.npz")["text"])
    return json.loads(path.read_text())["machines"]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_existing_file_is_replaced_only_when_an_earlier_output_of_its_kind(tiny_int8_export, made, work, command):
    args, what, kept = COMMANDS[command]
    np.savez(work / "weights.npz", weights=np.ones(3))  # a .npz, not a dump
    name = "out.npz" if command == "dump" else "out.json"
    option = "--json" if command == "compare" else "--out"
    argv = [a.format(model=tiny_int8_export).replace("OUT", name) for a in args]
    for source, found in kept.items():
        (work / name).write_bytes(b"precious\n" if source == "precious" else (work / source).read_bytes())
        before = _listing(work)
        proc = _run(*argv, cwd=work)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [f"error: {option} {name}: exists and is not {what}; found {found}; "
                                                    "not replaced"]
        assert _listing(work) == before  # the file, the inputs: nothing changed, nothing added
    _earlier(command, work / name)
    proc = _run(*argv, cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert _new_figures(command, work / name, made) == {"prepare": 30, "dump": True,
                                                        "compare": [platform.machine()] * 2}[command]
    assert sorted(p.name for p in work.iterdir()) == sorted(before)  # no temporary file left beside it


@pytest.mark.parametrize("args, message", [
    (["prepare", "--model", "{model}", "--out", "text.txt", "--text", "text.txt", "--tokens", "8"],
     "--out text.txt: is the input text.txt; write it elsewhere"),
    (["compare", "x86.npz", "x86.npz", "--json", "x86.npz"],
     "--json x86.npz: is the input x86.npz; write it elsewhere"),
    (["dump", "--model", "{model}", "--ids", "ids.json", "--out", "{model}/x.npz"],
     "--out {model}/x.npz: is inside the export folder {model}; write it elsewhere"),
    (["prepare", "--model", "{model}", "--out", "{model}/ids.json", "--text", "text.txt", "--tokens", "8"],
     "--out {model}/ids.json: is inside the export folder {model}; write it elsewhere"),
    # not an input here, but another output of gemma-export: its manifest would stop verifying
    (["compare", "x86.npz", "x86.npz", "--json", "{model}/report.json"],
     "--json {folder}/report.json: is inside {folder}, an output of gemma-export whose manifest would no longer list "
     "every file in it; write the output elsewhere"),
])
def test_an_output_that_is_an_input_or_inside_an_export_is_refused(tiny_int8_export, work, args, message):
    model = shutil.copytree(tiny_int8_export, work / "int8")  # a copy: the old code wrote into the folder
    before, model_before = _listing(work), _listing(model)
    proc = _run(*[a.format(model="int8") for a in args], cwd=work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {message.format(model='int8', folder=model.resolve())}"]
    assert _listing(work) == before and _listing(model) == model_before


@pytest.mark.parametrize("args, option, path", [
    (["dump", "--model", "{model}", "--ids", "ids.json", "--out", "/proc/x.npz"], "--out", "/proc/x.npz"),
    (["compare", "x86.npz", "x86.npz", "--json", "/proc/x.json"], "--json", "/proc/x.json"),
    (["prepare", "--model", "{model}", "--out", "/proc/ids.json", "--text", "text.txt", "--tokens", "8"], "--out",
     "/proc/ids.json"),
])
def test_an_output_folder_that_takes_no_files_is_refused_before_the_work(tiny_int8_export, work, args, option, path):
    before = _listing(work)
    proc = _run(*[a.format(model=tiny_int8_export) for a in args], cwd=work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"parity.py {args[0]}: error: argument {option}: {path}: cannot write in /proc: "), proc.stderr
    assert proc.stdout == ""  # no report printed, no dump made
    assert _listing(work) == before


def _dump_with(made: Path, path: Path, **changed) -> Path:
    """A copy of the dump with arrays ``changed`` (None: left out)."""
    arrays = dict(np.load(made / "x86.npz"))
    arrays.update(changed)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return path


@pytest.mark.parametrize("damage, found", [
    (lambda made, p: p.write_bytes(b""), "an empty file"),
    (lambda made, p: np.save(p.with_suffix(".npy"), np.arange(3.0)) or p.with_suffix(".npy").rename(p),
     "one array (.npy), float64 [3]"),
    (lambda made, p: p.write_bytes((made / "x86.npz").read_bytes()[:300]),
     "a damaged zip archive: File is not a zip file"),
    (lambda made, p: _dump_with(made, p, decode_ms_median=np.asarray("abc")),
     "'decode_ms_median' is \"abc\", expected a number"),
    (lambda made, p: _dump_with(made, p, machine=None), "no 'machine' array"),
    (lambda made, p: _dump_with(made, p, text=np.arange(40.0)), "'text' is float64 [40], expected integer [T]"),
    (lambda made, p: _dump_with(made, p, logits=np.zeros((39, 96), np.float32)), "39 rows of logits for 40 text ids"),
    (lambda made, p: _dump_with(made, p, text=np.full(40, 500)), "text ids 500 to 500, outside the logits' 96 columns"),
])
def test_a_damaged_dump_is_one_error_line_and_exit_2(made, work, damage, found):
    damage(made, work / "bad.npz")
    for args in (("bad.npz", "x86.npz"), ("x86.npz", "bad.npz"), ("bad.npz", "bad.npz")):
        before = _listing(work)
        proc = _run("compare", *args, "--json", "new.json", cwd=work)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: bad.npz: not a dump written by `parity.py dump` ({DUMP_EXPECTED}; found {found})"]
        assert _listing(work) == before  # no report


def test_dumps_of_two_vocabularies_are_one_error_line(made, work):
    _dump_with(made, work / "v50.npz", logits=np.zeros((40, 50), np.float32), text=np.arange(40) % 50)
    np.savez(work / "x86-ids.npz", **{**np.load(work / "x86.npz"), "text": np.arange(40) % 50})
    proc = _run("compare", "x86-ids.npz", "v50.npz", cwd=work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: x86-ids.npz and v50.npz: logits over 96 and 50 words, the "
                                                "vocabularies of two exports; compare dumps of one export"]


def _parity_module():
    spec = importlib.util.spec_from_file_location("aarch64_parity", PARITY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("command", ["prepare", "dump", "compare"])
def test_an_interrupted_write_keeps_the_earlier_output(tiny_int8_export, work, monkeypatch, command):
    """Ctrl-C while the output is written (as a dump of keep.npz, cut at 266 bytes, was) leaves the
    earlier file whole and nothing beside it."""
    parity = _parity_module()
    out = {"prepare": work / "ids.json", "dump": work / "x86.npz", "compare": work / "report.json"}[command]
    argv = {"prepare": ["prepare", "--model", str(tiny_int8_export), "--out", str(out), "--tokens", "30",
                        "--text", str(work / "text.txt")],
            "dump": ["dump", "--model", str(tiny_int8_export), "--ids", str(work / "ids.json"), "--out", str(out)],
            "compare": ["compare", str(work / "x86.npz"), str(work / "x86.npz"), "--json", str(out)]}[command]

    def cut_savez(file, *args, **kwargs):  # the first bytes of the archive, then the interrupt
        f = open(file, "wb") if isinstance(file, (str, os.PathLike)) else file
        f.write(b"PK\x03\x04 a dump cut short")
        f.flush()
        raise KeyboardInterrupt

    def cut_write_text(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
        raise KeyboardInterrupt

    before = _listing(work)
    if command == "dump":
        monkeypatch.setattr(np, "savez", cut_savez)
    else:
        monkeypatch.setattr(Path, "write_text", cut_write_text)
    monkeypatch.setattr(sys, "argv", [str(PARITY), *argv])
    with pytest.raises(KeyboardInterrupt):
        parity.main()
    assert _listing(work) == before


def test_compare_splits_at_the_window_the_dumps_record(made, work):
    """A tester: compare reported "sliding_window": 512 whatever the model's (the tiny one's is 6)."""
    report = json.loads((made / "report.json").read_text())
    dump = np.load(made / "x86.npz")
    assert int(dump["sliding_window"]) == 6 and report["sliding_window"] == 6
    assert report["top1_agreement_past_window"] is not None  # 40 text ids: rows past 6
    _dump_with(made, work / "older.npz", sliding_window=None)  # written before dumps recorded it: 512
    proc = _run("compare", "older.npz", "older.npz", cwd=work)
    assert proc.returncode == 0 and json.loads(proc.stdout)["sliding_window"] == 512, proc.stderr
    _dump_with(made, work / "w7.npz", sliding_window=np.asarray(7))
    proc = _run("compare", "x86.npz", "w7.npz", cwd=work)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: x86.npz and w7.npz: dumps of sliding windows [6, 7]; compare dumps of one export"]


def test_dumps_of_two_exports_of_one_vocabulary_are_bad_input_not_a_parity_failure(made, work, tiny_int8_export):
    """A break-it round: dumps of two exports of the same shapes gave a full report and exit status 1,
    as if one export's logits differed between two machines. Dumps now record which export made them
    (the sha256 its manifest lists for the graph and the data); a dump without it is still compared."""
    recorded = str(np.load(made / "x86.npz")["export"])
    listed = json.loads((tiny_int8_export / "manifest.json").read_text())["files"]
    assert recorded == (f"model.onnx:{listed['model.onnx']['sha256']};"
                        f"model.onnx.data:{listed['model.onnx.data']['sha256']}")
    _dump_with(made, work / "other.npz", export=np.asarray("model.onnx:0;model.onnx.data:1"))
    proc = _run("compare", "x86.npz", "other.npz", cwd=work)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: x86.npz and other.npz: dumps of two exports (their manifests "
                                                "list other graph or data files); compare dumps of one export"]
    _dump_with(made, work / "old.npz", export=None)  # written before dumps recorded it
    assert _run("compare", "x86.npz", "old.npz", cwd=work).returncode == 0
    _dump_with(made, work / "odd.npz", export=np.arange(3))  # a malformed record is refused, not skipped
    proc = _run("compare", "x86.npz", "odd.npz", cwd=work)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: odd.npz: 'export' must be a string (the export's graph and data sha256), found int64 [3]"], proc.stderr


def test_the_verdict_names_each_failed_check_at_its_edges():
    """A reviewer's mutations: a prompt that departs at its first token (index 0) and top-1 exactly at
    the minimum ("at least") were not told apart; a top-1 just below it printed as equal to it."""
    verdict = _parity_module().verdict_failures
    assert verdict([True, True], [None, None], 0.995, 0.995) == []
    assert verdict([True, False], [None, 0], 1.0, 0.995) == ["greedy tokens differ in 1 of 2 prompts (prompt 1 from token 0)"]
    assert verdict([True], [None], 0.99499, 0.995) == ["top-1 agreement 99.499% is below --min-top1 99.500%"]


def test_compare_says_on_stderr_which_check_failed(made, work):
    """A board engineer: compare exited 1 with only the JSON report, the same as a crash to a script
    that reads the status; stderr now ends in one PASS or FAIL line naming the failed checks."""
    proc = _run("compare", "x86.npz", "x86.npz", cwd=work)
    n = len(json.loads(proc.stdout)["greedy_identical"])
    assert proc.returncode == 0 and proc.stderr.strip().splitlines() == [
        f"PASS: greedy tokens identical in {n} of {n} prompts, top-1 agreement 100.00% (at least 99.50%)"]
    dump = np.load(made / "x86.npz")
    greedy = dump["greedy"].copy()
    greedy[1, 3] += 1  # prompt 1 departs at its token 3
    logits = dump["logits"].copy()
    logits[0] = -logits[0]  # the first text row's top-1 moves
    _dump_with(made, work / "arm.npz", greedy=greedy, logits=logits)
    proc = _run("compare", "x86.npz", "arm.npz", "--min-top1", "0.99", cwd=work)
    top1 = json.loads(proc.stdout)["top1_agreement"]
    assert proc.returncode == 1 and 0.9 < top1 < 0.99
    assert proc.stderr.strip().splitlines() == [
        f"FAIL: greedy tokens differ in 1 of {n} prompts (prompt 1 from token 3); "
        f"top-1 agreement {top1:.2%} is below --min-top1 99.00%"]
    proc = _run("compare", "x86.npz", "arm.npz", "--min-top1", "0.5", cwd=work)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"FAIL: greedy tokens differ in 1 of {n} prompts (prompt 1 from token 3)"]
