"""The tiny int8 export on emulated aarch64 (tools/aarch64/run.sh) gives the tokens it gives on the host.

Runs only where the emulated board can run: root, qemu-aarch64-static, debootstrap and binfmt_misc
(``apt-get install qemu-user-static debootstrap binfmt-support``). The first run builds the arm64
root filesystem (about 15 minutes, cached in ~/.cache/gemma-export).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "tools" / "aarch64" / "run.sh"
PARITY = ROOT / "tools" / "aarch64" / "parity.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="emulates aarch64 on an x86-64 host"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the emulated board needs root (chroot)"),
    pytest.mark.skipif(not (shutil.which("qemu-aarch64-static") and shutil.which("debootstrap")),
                       reason="qemu-user-static / debootstrap not installed"),
    # run.sh registers qemu-aarch64 with binfmt_misc through binfmt-support's update-binfmts
    pytest.mark.skipif(not (Path("/proc/sys/fs/binfmt_misc/qemu-aarch64").exists() or shutil.which("update-binfmts")),
                       reason="binfmt-support not installed (no qemu-aarch64 binfmt_misc entry to run aarch64 programs)"),
]


def _run(*args, emulated=False, cwd=None, allowed=(0,), env=None):
    cmd = [str(RUN), "python", *map(str, args)] if emulated else [sys.executable, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=None if env is None else {**os.environ, **env})
    assert proc.returncode in allowed, proc.stderr[-2000:]
    return proc


#: The tiny random model's next-word distributions are flat, so some of its 200 positions are
#: near-ties that int8 activation rounding in another float order may flip (docs/sl2610.md). A
#: wrong kernel moves logits by far more than this.
NEAR_TIE = 0.05


def _assert_only_near_ties(report: dict) -> None:
    """The two runs' top-1 differ only where the first run's best word led by less than NEAR_TIE."""
    assert report["top1_agreement"] >= 0.98, report
    assert report["disagreements"] == 0 or report["disagreement_margin_max"] < NEAR_TIE, report
    assert report["max_abs_logit_diff"] < 0.5, report


@pytest.fixture(scope="module")
def emulated_dump(tiny_int8_export, tmp_path_factory):
    """200 token ids of a text, and the tiny int8 export's logits and greedy tokens for them on the
    emulated board (from the heap: the export has no pre-packed copy). One emulated run serves both
    tests below."""
    # tmp paths live under /tmp, which run.sh binds at the same path inside the emulated board
    work = tmp_path_factory.mktemp("aarch64")
    text = work / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog, again and again. " * 8)
    ids = work / "ids.json"
    _run(PARITY, "prepare", "--model", tiny_int8_export, "--out", ids, "--tokens", 200, "--text", text)
    arm = _run(PARITY, "dump", "--model", tiny_int8_export, "--ids", ids, "--out", work / "arm.npz", emulated=True, cwd=work)
    assert "aarch64: wrote" in arm.stdout
    return ids, work / "arm.npz"


def test_tiny_int8_tokens_equal_on_emulated_aarch64(tiny_int8_export, emulated_dump, tmp_path):
    ids, arm = emulated_dump
    _run(PARITY, "dump", "--model", tiny_int8_export, "--ids", ids, "--out", tmp_path / "x86.npz")
    result = _run(PARITY, "compare", tmp_path / "x86.npz", arm, "--json", tmp_path / "report.json", allowed=(0, 1))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machines"] == ["x86_64", "aarch64"]
    assert all(report["greedy_identical"]), report
    _assert_only_near_ties(report)
    assert result.returncode in (0, 1)  # 1: below parity.py's 99.5% by near-ties


def test_prepack_on_emulated_aarch64_gives_the_same_logits(tiny_int8_export, emulated_dump, tmp_path):
    import numpy as np

    from gemma_export.runtime import OnnxDecoder

    ids, arm = emulated_dump
    model = tmp_path / "int8"  # a copy, so the shared export gets no pre-packed folder
    shutil.copytree(tiny_int8_export, model)
    packed = _run("-m", "gemma_export.cli", "prepack", "--model", model, emulated=True, cwd=tmp_path)
    assert "identical to the export's" in packed.stdout
    assert json.loads((model / "prepacked" / "prepacked.json").read_text())["machine"]["machine"] == "aarch64"
    _run(PARITY, "dump", "--model", model, "--ids", ids, "--out", tmp_path / "mapped.npz", emulated=True, cwd=tmp_path)
    heap, mapped = np.load(arm), np.load(tmp_path / "mapped.npz")
    assert str(heap["prepacked"]) == "" and str(mapped["prepacked"]).endswith("prepacked/model.onnx")
    assert np.array_equal(heap["logits"], mapped["logits"]) and np.array_equal(heap["greedy"], mapped["greedy"])
    host = OnnxDecoder(model)  # the aarch64 copy is not used on x86-64
    assert host.prepacked_path is None and "made for machine 'aarch64'" in host.prepacked_note


def test_tiny_int8_runs_on_an_emulated_cortex_a72(tiny_int8_export, emulated_dump, tmp_path):
    # the plain NEON kernels (no dotprod, no fp16 arithmetic): the board's A55 lies between this and
    # qemu's "max". run.sh's /proc/cpuinfo must then claim no dotprod, or onnxruntime runs dotprod
    # instructions and the process dies of SIGILL.
    ids, arm = emulated_dump
    a72 = _run(PARITY, "dump", "--model", tiny_int8_export, "--ids", ids, "--out", tmp_path / "a72.npz",
               emulated=True, cwd=tmp_path, env={"GX_AARCH64_CPU": "cortex-a72"})
    assert "aarch64: wrote" in a72.stdout
    _run(PARITY, "compare", arm, tmp_path / "a72.npz", "--json", tmp_path / "report.json", allowed=(0, 1))
    report = json.loads((tmp_path / "report.json").read_text())
    assert all(report["greedy_identical"]), report
    _assert_only_near_ties(report)


@pytest.mark.parametrize("scale_dtype", ["float32", "float16"])
def test_activation_residual_gives_the_same_logits_on_emulated_aarch64(tiny_dir, emulated_dump, tmp_path, scale_dtype):
    """With --activation-residual the int8 kernels' activation rounding no longer decides anything:
    x86-64 and aarch64 agree to float32 order (the plain export differs by up to NEAR_TIE-sized
    amounts, docs/sl2610.md), every top-1 and every greedy token the same; also with float16 scales,
    which onnxruntime on aarch64 widens at load as on x86-64 (--scale-dtype float16)."""
    from conftest import write_char_tokenizer
    from gemma_export.exporter import export

    ids, _ = emulated_dump
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    model = export(src, tmp_path / "int8-residual", "int8", block_size=16, activation_residual=True,
                   scale_dtype=scale_dtype).out_dir
    _run(PARITY, "dump", "--model", model, "--ids", ids, "--out", tmp_path / "x86.npz")
    _run(PARITY, "dump", "--model", model, "--ids", ids, "--out", tmp_path / "arm.npz", emulated=True, cwd=tmp_path)
    _run(PARITY, "compare", tmp_path / "x86.npz", tmp_path / "arm.npz", "--json", tmp_path / "report.json")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["machines"] == ["x86_64", "aarch64"]
    assert all(report["greedy_identical"]) and report["top1_agreement"] == 1.0, report
    assert report["max_abs_logit_diff"] < 1e-3, report
