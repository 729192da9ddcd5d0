"""tools/genai_anchor.py on what a tester found with a stand-in for the venv's python whose builder
writes half a model and exits 1: an OUT-hf of the user's own files was written over, a failed or
interrupted build damaged the earlier output given as --out, an --out inside an export of ours was
accepted (a 1 GB OUT-hf in it), and the kept model.safetensors was 0600 whatever the umask."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import genai_anchor

TOOLS = Path(__file__).resolve().parent.parent / "tools"

#: the tester's builder: half a model and a broken genai_config.json in its -o folder ($6), exit 1
HALF_BUILD = ("mkdir -p \"$6\"; printf half > \"$6/model.onnx\"; printf '{\"broken\":' > \"$6/genai_config.json\"; "
              "exit 1")

#: a builder that completes: a model and a genai_config.json in its -o folder
WHOLE_BUILD = "mkdir -p \"$6\"; printf new > \"$6/model.onnx\"; printf '{}' > \"$6/genai_config.json\""


def _stand_in(folder: Path, builder: str) -> Path:
    """A stand-in for the venv's python: the probe (``-c``) touches ``probed`` and prints PROBE_OK
    with onnxruntime-genai 0.15.2 and transformers 4.55.0; run as the builder (``-m builder -i HF
    -o OUT -p P -e cpu -c CACHE``) it writes its arguments to ``builder-args``, then runs ``builder``."""
    folder.mkdir(exist_ok=True)
    fake = folder / "python"
    fake.write_text("#!/bin/sh\n"
                    f"if [ \"$1\" = -c ]; then touch '{folder}/probed'; echo '{genai_anchor.PROBE_OK} 0.15.2 4.55.0'; "
                    "exit 0; fi\n"
                    f"echo \"$@\" > '{folder}/builder-args'\n"
                    f"{builder}\n")
    fake.chmod(0o755)
    return fake


def _complete_hf(folder: Path) -> Path:
    """A transformers folder an earlier run completed (reused: no 1 GB written)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    save_file({"w": np.arange(64, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / genai_anchor.COMPLETE_MARKER).write_text("")
    return folder


def _earlier_output(folder: Path) -> Path:
    """A folder an earlier, successful run wrote (with an external-data file a new build may not write)."""
    folder.mkdir()
    (folder / "genai_config.json").write_text('{"model": {"type": "gemma3_text"}}')
    (folder / "model.onnx").write_bytes(b"the earlier whole model")
    (folder / "model.onnx.data").write_bytes(b"its weights")
    return folder


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _main_refuses(monkeypatch, capsys, argv: list[str]) -> str:
    """Run ``main()`` with ``argv``; it must stop with argparse's status 2. Returns its last stderr line."""
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", *argv])
    with pytest.raises(SystemExit) as stop:
        genai_anchor.main()
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _slow_work_refused(*_args, **_kwargs):
    raise AssertionError("the 1 GB transformers folder was written")


def test_an_out_hf_of_the_users_own_files_is_refused_before_the_probe(tmp_path, monkeypatch, capsys):
    """The user's own g-hf/ (no marker of ours) was written over; the run said only that it was
    kept for the next try. A folder this script left incomplete, or an empty one, is still written."""
    fake = _stand_in(tmp_path / "tools", WHOLE_BUILD)
    mine = tmp_path / "g-hf"
    mine.mkdir()
    (mine / "config.json").write_text('{"model_type": "my own"}')
    (mine / "model.safetensors").write_bytes(b"my own weights")
    before = _contents(mine)
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    line = _main_refuses(monkeypatch, capsys, ["--python", str(fake), "--out", str(tmp_path / "g")])
    assert line == (f"genai_anchor.py: error: argument --out: {tmp_path / 'g'}: the transformers folder written "
                    f"beside it would replace the files in {mine} (config.json, model.safetensors), which this script "
                    "did not write (neither .genai_anchor nor .complete there): move that folder away or give another --out")
    assert not (tmp_path / "tools" / "probed").exists()
    assert _contents(mine) == before and sorted(os.listdir(tmp_path)) == ["g-hf", "tools"]

    # ours, cut short by a killed run (the marker written first, no .complete), and an empty one
    left = tmp_path / "left-hf"
    left.mkdir()
    (left / genai_anchor.WRITER_MARKER).write_text("")
    (left / "model.safetensors").write_bytes(b"part of 1 GB")
    (tmp_path / "empty-hf").mkdir()
    written = []
    monkeypatch.setattr(genai_anchor, "write_hf_folder", lambda folder: written.append(folder) or folder)
    for name in ("left", "empty"):
        monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(tmp_path / name)])
        genai_anchor.main()
    assert written == [left, tmp_path / "empty-hf"]
    assert f"{left} was left incomplete by an earlier run; writing it again" in capsys.readouterr().err


def test_a_failed_build_leaves_the_earlier_output_as_it_was(tmp_path):
    """The builder wrote into --out itself: after it failed, g/genai_config.json held '{"broken":'."""
    out = _earlier_output(tmp_path / "g")
    before = _contents(out)
    hf = _complete_hf(tmp_path / "g-hf")
    fake = _stand_in(tmp_path / "tools", HALF_BUILD)
    done = subprocess.run([sys.executable, str(TOOLS / "genai_anchor.py"), "--python", str(fake), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"error: onnxruntime-genai's builder failed (exit status 1; its "
                                                    f"output is above); {hf} is kept for the next try")
    assert _contents(out) == before
    # it wrote into a staging folder beside g, which is gone
    args = (tmp_path / "tools" / "builder-args").read_text().split()
    staging = Path(args[args.index("-o") + 1])
    assert staging.parent == tmp_path and staging.name.startswith(".g.staging-")
    assert sorted(os.listdir(tmp_path)) == ["g", "g-hf", "tools"]


def test_a_complete_build_replaces_the_earlier_output_as_a_whole(tmp_path, monkeypatch, capsys):
    """The builder wrote over the earlier output's files and left the others (model.onnx.data of
    another build beside the new model)."""
    out = _earlier_output(tmp_path / "g")
    _complete_hf(tmp_path / "g-hf")
    fake = _stand_in(tmp_path / "tools", WHOLE_BUILD)
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", str(fake), "--out", str(out)])
    genai_anchor.main()
    assert _contents(out) == {"genai_config.json": b"{}", "model.onnx": b"new"}
    assert sorted(os.listdir(tmp_path)) == ["g", "g-hf", "tools"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == f"wrote {out}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_build_leaves_the_earlier_output_as_it_was(tmp_path, sig):
    """Ctrl-C left the half-written model in g/; SIGTERM (kill, a timeout) ended the script at once
    (status -15), leaving it too."""
    out = _earlier_output(tmp_path / "g")
    before = _contents(out)
    _complete_hf(tmp_path / "g-hf")
    building = tmp_path / "tools" / "building"
    # exec: the sleep itself is the builder the script stops (a child of sh would hold the pipes)
    fake = _stand_in(tmp_path / "tools", HALF_BUILD.replace("exit 1", f"touch '{building}'; exec sleep 60"))
    script = subprocess.Popen([sys.executable, str(TOOLS / "genai_anchor.py"), "--python", str(fake), "--out",
                               str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not building.exists() and script.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert building.exists(), script.communicate(timeout=60)
    script.send_signal(sig)
    _, err = script.communicate(timeout=60)
    assert script.returncode == 128 + sig and err.strip().splitlines()[-1] == "error: interrupted", err  # the shell's
    assert _contents(out) == before
    assert sorted(os.listdir(tmp_path)) == ["g", "g-hf", "tools"]


@pytest.mark.parametrize("marker, out", [
    ("manifest.json", "genai"),
    ("manifest.json", "deeper/genai"),
    ("BUNDLE.json", "genai"),
])
def test_an_out_inside_an_output_of_ours_is_refused_before_the_probe(tmp_path, monkeypatch, capsys, marker, out):
    """--out EXPORT/genai was accepted: OUT, the 1 GB OUT-hf and OUT-cache inside the export, whose
    manifest no longer listed every file in it (verify fails)."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.onnx").write_bytes(b"onnx")
    ours = {"tool": {"gemma-export": "0.1.0"}} if marker == "manifest.json" else {"gemma_export_version": "0.1.0"}
    (export / marker).write_text(json.dumps({**ours, "files": {"model.onnx": {"size": 4, "sha256": "0" * 64}}}))
    before = _contents(export)
    os.utime(export, ns=(1_000_000_000, 1_000_000_000))  # a write probe in it would change this (a break-it round)
    fake = _stand_in(tmp_path / "tools", WHOLE_BUILD)
    monkeypatch.setattr(genai_anchor, "write_hf_folder", _slow_work_refused)
    line = _main_refuses(monkeypatch, capsys, ["--python", str(fake), "--out", str(export / out)])
    assert line == (f"genai_anchor.py: error: argument --out: {export / out}: {export / out}: is inside {export}, "
                    "an output of gemma-export whose manifest would no longer list every file in it; write the "
                    "folders of --out elsewhere")
    assert not (tmp_path / "tools" / "probed").exists()
    assert _contents(export) == before and sorted(os.listdir(export)) == sorted(["model.onnx", marker])
    assert export.stat().st_mtime_ns == 1_000_000_000


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)], ids=["umask-022", "umask-027"])
def test_the_kept_model_safetensors_has_the_mode_the_umask_gives(tiny_dir, tmp_path, monkeypatch, umask, mode):
    """safetensors' save_file created OUT-hf/model.safetensors 0600, whatever the umask."""
    import gemma_export.sources as sources

    real_open = sources.open_source
    monkeypatch.setattr(sources, "open_source", lambda source: real_open(tiny_dir))
    previous = os.umask(umask)
    try:
        folder = genai_anchor.write_hf_folder(tmp_path / "g-hf")
    finally:
        os.umask(previous)
    modes = {name: stat.S_IMODE((folder / name).stat().st_mode) for name in ("model.safetensors", "config.json")}
    assert modes == {"model.safetensors": mode, "config.json": mode}


def test_a_python_given_as_a_name_in_the_current_folder_is_run_from_there(tmp_path, monkeypatch):
    """A tester: `--python ./python` reached subprocess as "python", looked up on PATH: "error:
    python: No such file or directory" (or another interpreter ran)."""
    _stand_in(tmp_path / "tools", WHOLE_BUILD)
    _complete_hf(tmp_path / "g-hf")
    monkeypatch.chdir(tmp_path / "tools")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the shell tools; not the stand-in
    monkeypatch.setattr(sys, "argv", ["genai_anchor.py", "--python", "./python", "--out", str(tmp_path / "g")])
    genai_anchor.main()
    assert (tmp_path / "tools" / "probed").exists() and (tmp_path / "g" / "genai_config.json").read_text() == "{}"
