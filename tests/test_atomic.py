"""Writes are all-or-nothing: a full disk, a file-size limit, an exception or Ctrl-C in the middle of
an export leaves no partial output and an existing output folder byte-for-byte unchanged."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from gemma_export import exporter, staging, verify
from gemma_export.cli import app
from gemma_export.errors import OutputError
from gemma_export.staging import STALE_AFTER_SECONDS

from conftest import deletable, refuse_listing, undeletable


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(folder.rglob("*"))}


def _export(source, out, dtype="int8", *extra):
    quantized = ["--block-size", "16"] if dtype in ("int8", "int4") else []
    return CliRunner().invoke(app, ["--source", str(source), "--out", str(out), "--dtype", dtype, *quantized, *extra])


def _can_mount() -> bool:
    """Whether this process has CAP_SYS_ADMIN (bit 21 of CapEff): root in an unprivileged container
    has uid 0 and still cannot mount."""
    for line in open("/proc/self/status"):
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 21 & 1)
    return False


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: room for the tiny int8 export (~280 KB), not for the fp32 one (~690 KB)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        if _can_mount():  # a failure here is a real problem, not a reason to skip
            pytest.fail(f"cannot mount a tmpfs with CAP_SYS_ADMIN: {done.stderr.decode().strip()}")
        pytest.skip(f"mounting a tmpfs needs CAP_SYS_ADMIN: {done.stderr.decode().strip()}")
    yield mount
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:  # busy: never leave it mounted
        subprocess.run(["umount", "--lazy", str(mount)], check=False)


@pytest.fixture
def bind_mounted(tmp_path):
    """A folder of tmp_path's own file system bind-mounted on itself: same device as its parent, so
    ``os.path.ismount`` calls it an ordinary folder, yet no rename can replace it."""
    folder = tmp_path / "bound here"
    folder.mkdir()
    with _bind_mount(folder, folder):
        yield folder


@contextlib.contextmanager
def _bind_mount(folder: Path, at: Path) -> Iterator[None]:
    """``folder`` bind-mounted at ``at`` while inside (skipped without CAP_SYS_ADMIN)."""
    done = subprocess.run(["mount", "--bind", str(folder), str(at)], capture_output=True)
    if done.returncode != 0:
        if _can_mount():  # a failure here is a real problem, not a reason to skip
            pytest.fail(f"cannot bind-mount with CAP_SYS_ADMIN: {done.stderr.decode().strip()}")
        pytest.skip(f"a bind mount needs CAP_SYS_ADMIN: {done.stderr.decode().strip()}")
    try:
        yield
    finally:
        if subprocess.run(["umount", str(at)], capture_output=True).returncode != 0:  # busy: never leave it mounted
            subprocess.run(["umount", "--lazy", str(at)], check=False)


@pytest.mark.parametrize("command", ["export", "dedupe"])
def test_a_bind_mount_as_the_output_is_refused_before_any_work(tiny_dir, bind_mounted, monkeypatch, command):
    assert not os.path.ismount(bind_mounted)  # the case the device test alone misses
    read = []
    monkeypatch.setattr(exporter, "open_source", lambda *a, **k: read.append(a) or pytest.fail("source read"))
    if command == "export":
        result = _export(tiny_dir, bind_mounted)
    else:
        # the destination is checked before the model is read: this model does not exist
        result = CliRunner().invoke(app, ["dedupe", str(bind_mounted.parent / "absent.onnx"), "--out", str(bind_mounted)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {bind_mounted}: is a mount point, which the "), line
    assert list(bind_mounted.iterdir()) == [] and not read


def test_mount_points_are_read_from_the_kernels_table_with_its_escapes(tmp_path, monkeypatch):
    listed = tmp_path / "a b\\c"
    plain = tmp_path / "plain"
    for folder in (listed, plain):
        folder.mkdir()
    escaped = str(listed).replace("\\", "\\134").replace(" ", "\\040")
    table = tmp_path / "mountinfo"
    table.write_text(f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n45 22 8:1 /x {escaped} rw,relatime - ext4 /dev/sda1 rw\n")
    monkeypatch.setattr(staging, "MOUNTINFO", table)
    assert staging.is_mount_point(listed)
    assert not staging.is_mount_point(plain)
    assert staging.is_mount_point(Path("/"))  # the device test still decides where the table is silent
    monkeypatch.setattr(staging, "MOUNTINFO", tmp_path / "missing")
    assert not staging.is_mount_point(listed)


def test_full_disk_leaves_nothing_and_keeps_the_existing_output(tiny_dir, small_disk, monkeypatch):
    out = small_disk / "model"
    assert _export(tiny_dir, out).exit_code == 0
    before = _tree(small_disk)
    # the estimate of the archive's size refuses first ...
    result = _export(tiny_dir, out, "fp32")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: the export needs about 0.") and "MB free; free some space" in line, line
    assert _tree(small_disk) == before
    # ... and where it is too low, the write itself fails cleanly
    monkeypatch.setattr(exporter, "check_free_space", lambda *args: None)
    result = _export(tiny_dir, out, "fp32")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {out}: writing the export failed ("), line
    assert "the disk (or its inodes) is full, or a file-size limit was reached" in line and "bytes free there once the partial output was removed" in line
    assert "existing folder is unchanged" in line and "Traceback" not in result.output
    assert _tree(small_disk) == before  # the old export intact, no staging folder left
    assert CliRunner().invoke(app, ["verify", str(out)]).exit_code == 0


def test_a_file_system_out_of_inodes_is_named_as_such(tiny_dir, tmp_path, monkeypatch):
    """A helper's tmpfs out of inodes: "the disk is full or a file-size limit was reached" beside
    629 MB free. With inodes counted and none left the reason says so (asked before the partial
    output is removed, which gives inodes back); a file system that counts none (btrfs: f_files 0)
    keeps the general reason."""
    import errno

    full = OSError(errno.ENOSPC, "No space left on device")
    real = os.statvfs(tmp_path)
    fields = {name: getattr(real, name) for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                                      "f_ffree", "f_favail", "f_flag", "f_namemax")}
    for files, favail, expected in ((5, 0, True), (0, 0, False), (5, 1, False)):
        monkeypatch.setattr(staging.os, "statvfs", lambda _path, f=files, a=favail: type(
            "Statvfs", (), {**fields, "f_files": f, "f_favail": a})())
        assert staging.out_of_inodes(full, tmp_path) is expected
    monkeypatch.undo()
    assert staging._describe(full, tmp_path, no_inodes=True) == (
        "No space left on device: the file system has no free inodes left (`df -i` shows them), whatever space it has")
    assert staging._describe(full, tmp_path).startswith("No space left on device: the disk (or its inodes) is full, or a "
                                                        "file-size limit was reached; ")
    if not _can_mount():
        return
    # a real one: 4 inodes, the root folder taking one, an export needing six
    disk = tmp_path / "few-inodes"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=4", "tmpfs", str(disk)], capture_output=True)
    assert done.returncode == 0, done.stderr
    try:
        result = _export(tiny_dir, disk / "out", "fp32")
        assert result.exit_code == 2, result.output
        assert "the file system has no free inodes left (`df -i` shows them)" in result.stderr, result.stderr
        assert os.listdir(disk) == []
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_file_size_limit_in_a_fresh_process(tiny_dir, tmp_path):
    # RLIMIT_FSIZE makes every write past 100 KB fail with EFBIG (SIGXFSZ ignored): a full disk
    # without privileges, in the real command-line entry point.
    script = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
        from gemma_export.cli import app
        sys.argv = ["gemma-export", *sys.argv[1:]]
        app()
    """)
    out = tmp_path / "deep" / "er" / "out"
    done = subprocess.run([sys.executable, "-c", script, "--source", str(tiny_dir), "--out", str(out), "--dtype", "fp32"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "writing the export failed (" in done.stderr and "the disk (or its inodes) is full, or a file-size limit was reached" in done.stderr
    assert "); nothing was written\n" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "deep").exists()  # the parents this run created are gone too


def _unprivileged() -> list[str]:
    """argv prefix that runs a command without root's right to write anywhere (CAP_DAC_OVERRIDE):
    root ignores a folder's mode otherwise."""
    if os.geteuid() != 0:
        return []
    import shutil

    command = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    if shutil.which("setpriv") is None or subprocess.run([*command, "true"], capture_output=True).returncode != 0:
        pytest.skip("root cannot be denied a write here (no setpriv, or it may not drop capabilities)")
    return command


@pytest.mark.parametrize("blocked", ["the folder", "its parent"])
def test_an_existing_output_folder_that_cannot_be_replaced_is_refused_before_the_source_is_read(tiny_dir, tmp_path,
                                                                                                 blocked):
    """Replacing an existing folder stages beside it and moves it aside: both need write permission,
    on the parent and on the folder itself. Found late before, after the export's work (calibration
    of the real 270M: a minute)."""
    out = tmp_path / "parent" / "out"
    out.mkdir(parents=True)
    locked = out if blocked == "the folder" else out.parent
    script = "import sys\nfrom gemma_export.cli import app\nsys.argv = ['gemma-export', *sys.argv[1:]]\napp()\n"
    locked.chmod(0o555)
    try:
        done = subprocess.run([*_unprivileged(), sys.executable, "-c", script, "--source", str(tiny_dir), "--out", str(out),
                               "--dtype", "fp32"], capture_output=True, text=True, timeout=300)
    finally:
        locked.chmod(0o755)
    assert done.returncode == 2, done.stderr
    expected = ("it is not writable (replacing it moves it aside, which needs write permission on it)"
                if blocked == "the folder" else f"its parent {out.parent} refuses new entries (Permission denied)")
    assert done.stderr == f"error: {out}: cannot replace the export folder: {expected}" + (
        "" if blocked == "the folder" else ", and the export is written beside it first") + "\n"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "parent"]  # nothing written, nothing left


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_interrupt_or_crash_after_writing_keeps_the_existing_output(tiny_dir, tmp_path, monkeypatch, failure):
    out = tmp_path / "model"
    assert _export(tiny_dir, out).exit_code == 0
    before = _tree(tmp_path)
    seen = []

    def fail(folder):
        seen.append(sorted(p.name for p in folder.iterdir()))  # the staging folder, fully written
        raise failure("stop")

    monkeypatch.setattr(exporter, "verify_folder", fail)
    if failure is KeyboardInterrupt:
        result = _export(tiny_dir, out, "fp32")
        assert result.exit_code == 130
        assert result.stderr.strip().splitlines()[-1] == (
            "error: interrupted; nothing was written (an existing output is unchanged)")
    else:
        with pytest.raises(RuntimeError):
            exporter.export(tiny_dir, out, "fp32")
    assert seen and "model.onnx.data" in seen[0]
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_signal_during_an_export(tiny_dir, tmp_path, signum):
    """A real SIGINT (Ctrl-C), SIGTERM (timeout, kill) or SIGHUP (the terminal closed; it left the
    staging folder until the twentieth session) delivered while the export process is between
    writing and verifying; SIGKILL cannot be caught and leaves the staging folder, which the next
    export to the same place removes."""
    marker = tmp_path / "written"
    script = textwrap.dedent(f"""
        import pathlib, sys, time
        from gemma_export import exporter
        from gemma_export.console import main  # the command's entry point, as installed
        def slow_verify(folder):
            pathlib.Path({str(marker)!r}).write_text(str(folder))
            time.sleep(120)
        exporter.verify_folder = slow_verify
        sys.argv = ["gemma-export", *sys.argv[1:]]
        main()
    """)
    out = tmp_path / "out"
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored:
    # give the child the default disposition, as a terminal's foreground process has.
    proc = subprocess.Popen([sys.executable, "-c", script, "--source", str(tiny_dir), "--out", str(out), "--dtype", "fp32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: [signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGHUP)])
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        staging = Path(marker.read_text())
        assert (staging / "model.onnx.data").is_file()
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    if signum == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL and staging.is_dir() and not out.exists()
        said = []
        exporter.export(tiny_dir, out, "fp32", status=said.append)  # too soon: it may be a live writer's
        assert staging.is_dir()
        assert f"kept {staging}: less than {STALE_AFTER_SECONDS} s old or in use by a running gemma-export; a later " \
               "run tries to remove it once it is neither" in said
        old = time.time() - 2 * STALE_AFTER_SECONDS
        os.utime(staging, (old, old))  # as when the user comes back later
        said = []
        exporter.export(tiny_dir, out, "fp32", status=said.append)
        assert sorted(os.listdir(tmp_path)) == ["out", "written"]  # the killed run's staging folder is gone
        assert f"removed {staging}, left by an earlier gemma-export" in said  # and the user is told
        return
    assert proc.returncode == 128 + signum, stderr  # the shell's status for that signal: 130, 143 or 129
    assert "error: interrupted; nothing was written" in stderr and "Traceback" not in stderr
    assert sorted(os.listdir(tmp_path)) == ["written"]  # no output, no staging folder


def test_a_staging_folder_still_being_written_is_not_removed(tmp_path):
    from gemma_export.staging import held_folder, remove_stale

    live, dead, young = (tmp_path / f".out.staging-{name}" for name in ("live_123", "dead_123", "young_12"))
    old = time.time() - 2 * STALE_AFTER_SECONDS
    for folder in (live, dead, young):
        folder.mkdir()
        (folder / "model.onnx.data").write_bytes(b"x" * 10)
        if folder is not young:  # young: just created, perhaps not yet locked by its writer
            os.utime(folder, (old, old))
    (tmp_path / ".other.staging-x").mkdir()  # another destination's: not ours to judge
    with held_folder(live):
        assert remove_stale(tmp_path / "out") == ([dead], [], [live, young], [live])
    assert sorted(os.listdir(tmp_path)) == [".other.staging-x", ".out.staging-live_123", ".out.staging-young_12"]


@pytest.mark.parametrize("age", ["young", "old"])
def test_an_export_into_a_folder_another_export_is_writing_is_refused_before_it_starts(tiny_dir, tmp_path, age):
    """A fresh user's finding: the second of two exports into one --out noted the first's staging
    folder as "kept", exported in full, and was refused only when it came to move in."""
    from gemma_export.errors import OutputError
    from gemma_export.staging import held_folder

    out = tmp_path / "out"
    live = tmp_path / ".out.staging-live_123"
    live.mkdir()
    if age == "old":  # the other writer has been at it for a while
        then = time.time() - 2 * STALE_AFTER_SECONDS
        os.utime(live, (then, then))
    said = []
    with held_folder(live), pytest.raises(OutputError) as info:
        exporter.export(tiny_dir, out, "fp32", status=said.append)
    assert str(info.value) == (f"{out}: another gemma-export is writing this export now (.out.staging-live_123 beside it "
                               "is in use); nothing was written: run again when it has finished, or choose another folder")
    assert sorted(os.listdir(tmp_path)) == [".out.staging-live_123"]  # nothing written, the other's folder kept
    assert not any("kept" in line for line in said)  # the error says it; no note before it as well
    exporter.export(tiny_dir, out, "fp32")  # once the other has finished (its lock gone), the export runs
    assert (out / "model.onnx").is_file()


def test_a_quantized_export_into_a_folder_being_written_is_refused_before_calibrating(tiny_dir, tmp_path, monkeypatch):
    """Review finding: the refusal came when the staging folder was made, after the calibration that
    is most of an int8 or int4 export's time."""
    from gemma_export.errors import OutputError
    from gemma_export.staging import held_folder

    live = tmp_path / ".out.staging-live_123"
    live.mkdir()
    monkeypatch.setattr(exporter, "open_source", lambda *a, **k: pytest.fail("the source was read first"))
    with held_folder(live), pytest.raises(OutputError, match="another gemma-export is writing this export now"):
        exporter.export(tiny_dir, tmp_path / "out", "int8")


def test_a_second_export_while_the_first_calibrates_is_refused_before_its_own_calibration(tiny_dir, tmp_path,
                                                                                          monkeypatch):
    """A fresh user's finding: the first export made its staging folder only after calibrating, so a
    second one into the same folder, started meanwhile, calibrated in full (146 s on the real 270M)
    and was refused at the move. The first now holds its staging folder from before it calibrates."""
    from conftest import write_char_tokenizer

    from gemma_export.errors import OutputError

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "out"
    calibrate = exporter._calibrate
    second = {}

    def calibrate_while_another_starts(*args, **kwargs):
        if not second:  # the first export's calibration: a second export starts now
            second["started"] = True
            with pytest.raises(OutputError) as info:
                exporter.export(src, out, "int8", block_size=16, calibration_text=text)
            second["error"] = str(info.value)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(exporter, "_calibrate", calibrate_while_another_starts)
    exporter.export(src, out, "int8", block_size=16, calibration_text=text)
    assert second["error"].startswith(f"{out}: another gemma-export is writing this export now (.out.staging-")
    assert (out / "model.onnx").is_file() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "text.txt"]


def test_the_leftovers_of_an_output_are_told_by_their_whole_name(tmp_path):
    """Review finding: "model"'s leftovers were matched by prefix, so a writer of "model" took the
    staging folder of "model.old-1" (being written now) for its own."""
    from gemma_export.staging import held_folder, leftovers, writer_running

    other = tmp_path / ".model.old-1.staging-abcd1234"  # the staging folder of an output "model.old-1"
    other.mkdir()
    ours = tmp_path / ".model.staging-abcd1234"
    ours.mkdir()
    assert leftovers(tmp_path / "model") == [ours] and leftovers(tmp_path / "model.old-1") == [other]
    with held_folder(other):
        assert writer_running(tmp_path / "model") is None
        assert writer_running(tmp_path / "model.old-1") == other
        with staging.staged_folder(tmp_path / "model", "export") as folder:
            (folder / "model.onnx").write_text("x")
    assert other.is_dir() and (tmp_path / "model" / "model.onnx").is_file()


def test_on_a_file_system_without_locks_leftovers_are_named_and_prepack_still_runs(tmp_path, monkeypatch):
    """flock failing with ENOLCK (an NFS mount without lock support): remove_stale filed every old
    leftover as 'in use by a running gemma-export' and said a later run would remove it (none
    could); prepack's own lock let the OSError through, so prepack, --remove and verify failed with
    'No locks available' where the staging folders ran unheld."""
    import errno
    import fcntl

    from gemma_export import prepack as prepack_module
    from gemma_export import staging
    from gemma_export.staging import held_folder, remove_stale

    old_leftover = tmp_path / ".out.staging-dead_123"
    old_leftover.mkdir()
    old = time.time() - 2 * STALE_AFTER_SECONDS
    os.utime(old_leftover, (old, old))

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    stale = remove_stale(tmp_path / "out")
    assert stale.removed == [] and stale.kept == []
    assert stale.stuck == [(old_leftover, "no lock can be taken on it here, so whether a running gemma-export "
                                          "still writes it cannot be told")]
    assert old_leftover.is_dir()  # not deleted: a writer may be alive
    with held_folder(tmp_path):  # runs unheld
        pass
    assert prepack_module.busy(tmp_path) is None  # cannot be told
    with prepack_module._folder_lock(tmp_path) as taken:
        assert taken is None  # runs unheld

    @contextlib.contextmanager
    def removed_meanwhile(folder, *args, **kwargs):  # another run deleted it after the listing
        shutil.rmtree(folder)
        yield None

    monkeypatch.setattr(staging, "flocked", removed_meanwhile)
    assert remove_stale(tmp_path / "out") == ([], [], [], [])  # nothing to report for a folder that is gone


@pytest.mark.parametrize("existing", [True, False])
def test_a_file_added_to_the_output_folder_during_an_export_is_kept(tiny_dir, tmp_path, existing):
    # the folder was checked before the slow work; a user's file (or another export's folder) that
    # lands in it meanwhile must stop the move, not be renamed away and deleted with the old output
    out = tmp_path / "model"
    if existing:
        assert _export(tiny_dir, out).exit_code == 0
    before = _tree(out) if existing else {}

    def add_notes(done, total, name):
        if done == 1:
            out.mkdir(exist_ok=True)
            (out / "NOTES.txt").write_text("mine")

    with pytest.raises(exporter.OutputError) as caught:
        exporter.export(tiny_dir, out, "fp32", progress=add_notes)
    message = str(caught.value)
    assert message.startswith(f"{out}: {'changed' if existing else 'appeared'} while the export was being written")
    assert "was not moved in" in message
    assert (out / "NOTES.txt").read_text() == "mine"
    assert {k: v for k, v in _tree(out).items() if k != "NOTES.txt"} == before  # the old export, untouched
    assert sorted(os.listdir(tmp_path)) == ["model"]  # the staging folder is gone


def test_two_writers_of_one_folder_the_second_to_finish_is_refused(tmp_path):
    from gemma_export.staging import OutputError, folder_state, staged_folder

    out = tmp_path / "out"
    first_checked = folder_state(out)  # both checked the folder when it did not exist
    with staged_folder(out, "export") as staging:
        (staging / "a.txt").write_text("first")
    with pytest.raises(OutputError, match="appeared while the export was being written"):
        with staged_folder(out, "export", first_checked) as staging:
            (staging / "a.txt").write_text("second")
    assert (out / "a.txt").read_text() == "first"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_source_that_fails_while_the_export_is_written_is_named_as_the_source(tiny_dir, tmp_path, monkeypatch):
    """A source tensor is read lazily while the output is written: losing the source then is the
    source's error (named, exit 2), not a failed write; the output folder stays as it was."""
    import errno

    out = tmp_path / "model"
    assert _export(tiny_dir, out).exit_code == 0
    before = _tree(tmp_path)
    source = tiny_dir / "model.safetensors"

    def gone(folder):
        (folder / "model.onnx").stat()  # the staging folder was written, as it is when sha256 runs
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(source))

    monkeypatch.setattr(exporter, "verify_folder", gone)
    result = _export(tiny_dir, out, "fp32")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {source}: No such file or directory")
    assert "writing the export failed" not in result.stderr
    assert _tree(tmp_path) == before

    def full(folder):  # the same error about a file of the output stays a failed write
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.onnx.data"))

    monkeypatch.setattr(exporter, "verify_folder", full)
    result = _export(tiny_dir, out, "fp32")
    assert result.exit_code == 2
    assert "writing the export failed (No space left on device: the disk (or its inodes) is full" in result.stderr
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("change", ["deleted", "truncated to its header"])
def test_a_source_changed_after_it_was_opened_is_named_and_nothing_is_written(tiny_dir, tmp_path, change):
    """Tensors are read while the output is written: a safetensors file deleted or cut short by then
    is the source's error, named with the file and tensor (safetensors itself names neither)."""
    import shutil

    from gemma_export.errors import FormatError
    from gemma_export.sources import open_source

    source = tmp_path / "source"
    shutil.copytree(tiny_dir, source)
    out = tmp_path / "model"
    assert _export(tiny_dir, out).exit_code == 0
    before = _tree(out)
    checkpoint = open_source(source)  # header read and checked
    weights = source / "model.safetensors"
    if change == "deleted":
        weights.unlink()
    else:
        with open(weights, "r+b") as f:
            f.truncate(1000)
    with pytest.raises(FormatError, match=rf"^{re.escape(str(weights))}: cannot read tensor '[\w.]+' \(.+\); the file "
                                          "changed or went away after it was opened: export again$"):
        exporter.export(source, out, "fp32", checkpoint=checkpoint)
    assert _tree(out) == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


@pytest.mark.parametrize("length", [238, 255])
def test_an_output_name_up_to_255_bytes_is_written_and_replaced(tiny_dir, tmp_path, length):
    # its hidden staging and old folders beside it (".NAME.staging-XXXXXXXX") took 18 bytes more
    # than the name and were refused as "File name too long" above 237 bytes; a legal name is usable
    from gemma_export.exporter import export
    from gemma_export.staging import hidden_prefix

    out = tmp_path / ("é" * (length // 2) + "b" * (length % 2))  # two bytes a character in UTF-8
    assert len(os.fsencode(out.name)) == length
    first = export(tiny_dir, out, "fp32").out_dir
    again = export(tiny_dir, out, "fp32").out_dir  # replaces the first: the old folder is renamed away
    assert first == again == out and (out / "model.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]
    prefix = hidden_prefix(out)
    assert len(os.fsencode(prefix + "staging-12345678")) <= 255
    other = tmp_path / ("é" * 118 + "bbb")  # the same first 228 bytes, another name: another prefix
    assert hidden_prefix(other) != prefix and hidden_prefix(other)[:100] == prefix[:100]


def test_hidden_prefix_keeps_a_name_of_237_bytes_whole_and_shortens_one_byte_more():
    # 237 bytes + the two dots + "staging-XXXXXXXX" (16) make exactly 255: no hash needed yet
    from gemma_export.staging import hidden_prefix

    fits = Path("a" * 237)
    assert hidden_prefix(fits) == f".{fits.name}."
    longer = Path("a" * 238)
    shortened = hidden_prefix(longer)
    assert shortened == "." + "a" * 228 + "~" + hashlib.sha256(b"a" * 238).hexdigest()[:8] + "."
    assert len(os.fsencode(shortened + "staging-12345678")) <= 255


def test_an_output_is_replaceable_only_while_every_file_holds_what_its_manifest_records(tmp_path):
    # a file rewritten in place with the same size, or a file beside a derived folder that merely
    # starts with its name, makes the folder someone's work: not an unchanged output
    import json

    from gemma_export.staging import output_changes

    out = tmp_path / "out"
    (out / "model").mkdir(parents=True)
    (out / "model" / "a.txt").write_text("hello")
    files = {"model/a.txt": {"bytes": 5, "sha256": hashlib.sha256(b"hello").hexdigest()}}
    (out / "LIST.json").write_text(json.dumps({"files": files}))
    derived = (("model/prepacked", "prepacked.json"),)
    (out / "model" / "prepacked").mkdir()
    (out / "model" / "prepacked" / "prepacked.json").write_text("{}")
    (out / "model" / "prepacked" / "weights.bin").write_text("anything")
    assert output_changes(out, "LIST.json", derived=derived) == ""
    (out / "model" / "prepacked.bak").write_text("mine")  # not inside model/prepacked/
    # each reason names the file (a bundle over a changed one said only "not an unchanged bundle")
    assert output_changes(out, "LIST.json", derived=derived) == "model/prepacked.bak is not listed in LIST.json"
    (out / "model" / "prepacked.bak").unlink()
    (out / "model" / "a.txt").write_text("jello")  # same size, other bytes
    assert output_changes(out, "LIST.json", derived=derived) == "model/a.txt differs from the sha256 LIST.json records"
    (out / "model" / "a.txt").write_text("hello!")  # another size
    assert output_changes(out, "LIST.json", derived=derived) == "model/a.txt is 6 bytes, LIST.json records 5"
    (out / "model" / "a.txt").unlink()
    assert output_changes(out, "LIST.json", derived=derived) == ""  # a listed file gone: nothing of anyone's is lost
    assert output_changes(out, "LIST.json", required={"format": "onnx"}) == "LIST.json has format None, not 'onnx'"
    (out / "LIST.json").write_text("[]")
    assert output_changes(out, "LIST.json") == "LIST.json is not one of ours"
    (out / "LIST.json").unlink()
    assert output_changes(out, "LIST.json") == "no readable LIST.json"


def test_an_output_folder_any_depth_below_another_output_is_refused(tmp_path):
    # not only the folder right above: every folder above is looked at, up to the root
    from gemma_export.staging import OutputError, check_outside_outputs, enclosing_output

    board = tmp_path / "board"
    board.mkdir()
    (board / "BUNDLE.json").write_text('{"gemma_export_version": "0.1.0", "files": {}}')
    (tmp_path / "manifest.json").write_text('{"name": "a web app"}')  # someone else's manifest: no files map
    assert enclosing_output(board / "a" / "b" / "c") == board.resolve()
    assert enclosing_output(tmp_path / "elsewhere" / "x") is None
    with pytest.raises(OutputError, match=r"c: is inside .*board, an output of gemma-export"):
        check_outside_outputs(board / "a" / "b" / "c", "export")


def test_a_failed_second_rename_puts_the_old_output_back(tmp_path):
    from gemma_export.staging import move_into_place

    out = tmp_path / "out"
    out.mkdir()
    (out / "a.txt").write_text("old")
    with pytest.raises(FileNotFoundError):
        move_into_place(tmp_path / "missing-staging", out, "export")  # the rename of staging onto out fails
    assert (out / "a.txt").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # and the hidden old-copy folder is gone


def test_a_read_only_file_system_is_the_output_s_failure_whatever_file_it_names(tmp_path):
    # EROFS (like ENOSPC) only comes from writing: even naming a file outside the output (shutil.copyfile
    # names its source) it is the output that failed; other errors naming such a file are an input's
    import errno

    from gemma_export.staging import _names_an_input

    out, source = tmp_path / "out", tmp_path / "src" / "model.safetensors"
    assert not _names_an_input(OSError(errno.EROFS, "Read-only file system", str(source)), out)
    assert not _names_an_input(OSError(errno.ENOSPC, "No space left on device", str(source)), out)
    assert _names_an_input(OSError(errno.EIO, "Input/output error", str(source)), out)
    assert not _names_an_input(OSError(errno.EIO, "Input/output error", str(out / "model.onnx")), out)


def test_a_replaced_output_that_cannot_be_deleted_is_named_not_reported_as_removed(tmp_path):
    # hostile-found: its folder stayed behind without a word, and the next runs said they had
    # removed it ("left by an interrupted gemma-export") and then that they kept it
    out, said = tmp_path / "out", []
    for content in (b"first", b"second"):
        with staging.staged_folder(out, "export", notify=said.append) as folder:
            (folder / "sub").mkdir()
            (folder / "sub" / "model.onnx.data").write_bytes(content)
        if content == b"first" and not undeletable(out / "sub" / "model.onnx.data"):
            pytest.skip("no way to make a file undeletable here (chattr +i refused)")
    try:
        assert (out / "sub" / "model.onnx.data").read_bytes() == b"second"  # the new output is in place
        (old,) = staging.leftovers(out)
        stuck = old / "out" / "sub" / "model.onnx.data"
        assert stuck.read_bytes() == b"first"
        assert len(said) == 1 and re.fullmatch(
            rf"the export is in place, but the folder it replaced could not be deleted \(.+: '{re.escape(str(stuck))}'\); "
            rf"it is left in {re.escape(str(old))}: remove it by hand", said[0]), said
        past = time.time() - 2 * STALE_AFTER_SECONDS
        os.utime(old, (past, past))  # as when the next run comes later: stale, and still undeletable
        said.clear()
        with staging.staged_folder(out, "export", notify=said.append) as folder:
            (folder / "model.onnx.data").write_bytes(b"third")
        assert said[0].startswith(f"could not remove {old}, left by an earlier gemma-export (") and \
            said[0].endswith(f": '{stuck}'); remove it by hand"), said
        assert not any(line.startswith((f"removed {old}", f"kept {old}")) for line in said), said
    finally:
        deletable(stuck if "stuck" in locals() else out / "sub" / "model.onnx.data")


def test_two_writers_finishing_at_once_move_in_one_output_and_refuse_the_other(tmp_path, monkeypatch):
    """Both found the destination absent, and no other writer beside it, when they began; the move is
    slowed so that both reach it together. Without a lock from the check to the move both
    'succeeded' and the second deleted the first's output."""
    import threading

    out = tmp_path / "board"
    slow_move = staging.move_into_place

    def move_slowly(source, destination, what):
        time.sleep(0.3)  # the window between the check and the rename, widened
        return slow_move(source, destination, what)

    monkeypatch.setattr(staging, "move_into_place", move_slowly)
    both_checked = threading.Barrier(2)
    check_leftovers = staging.remove_stale

    def check_together(out_dir):  # both past the up-front check before either has a staging folder
        result = check_leftovers(out_dir)
        both_checked.wait(timeout=10)
        return result

    monkeypatch.setattr(staging, "remove_stale", check_together)
    both_written = threading.Barrier(2)
    outcomes: dict[str, object] = {}

    def writer(name: str) -> None:
        try:
            with staging.staged_folder(out, "bundle") as folder:
                (folder / "who").write_text(name)
                both_written.wait(timeout=10)
            outcomes[name] = "moved in"
        except Exception as exc:  # noqa: BLE001 - the refusal is the expected outcome for one of them
            outcomes[name] = exc

    threads = [threading.Thread(target=writer, args=(name,)) for name in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    winners = [name for name, outcome in outcomes.items() if outcome == "moved in"]
    assert len(winners) == 1, outcomes
    loser = next(outcome for outcome in outcomes.values() if outcome != "moved in")
    assert isinstance(loser, staging.OutputError) and "appeared while the bundle was being written" in str(loser)
    assert (out / "who").read_text() == winners[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["board"]  # no staging or old folder left


def test_an_output_folder_in_a_sticky_parent_that_is_not_ours_is_refused_up_front(tmp_path, monkeypatch):
    """In a sticky folder (/tmp) only the owner of the folder or of the parent may move the folder
    aside; the rename failed after the work. Ownership is read from the files, the caller's id is
    patched (the tests run as root, whom stickiness does not stop)."""
    parent = tmp_path / "shared"
    out = parent / "out"
    out.mkdir(parents=True)
    parent.chmod(0o1777)
    owner = out.stat().st_uid
    monkeypatch.setattr(staging.os, "geteuid", lambda: owner + 1000)
    with pytest.raises(staging.OutputError, match=rf"^{out}: cannot replace the export folder: its parent {parent} is "
                                                  r"sticky and neither belongs to you, so it cannot be moved aside$"):
        staging.check_creatable(out, "export")
    monkeypatch.setattr(staging.os, "geteuid", lambda: owner)  # the folder's owner may
    staging.check_creatable(out, "export")
    parent.chmod(0o777)  # not sticky: anyone who may write in the parent may
    monkeypatch.setattr(staging.os, "geteuid", lambda: owner + 1000)
    staging.check_creatable(out, "export")


def test_a_writer_waits_a_bounded_time_for_the_parents_lock_then_leaves_the_destination_alone(tmp_path, monkeypatch):
    import fcntl

    out = tmp_path / "out"
    monkeypatch.setattr(staging, "PARENT_LOCK_WAIT_S", 0.3)
    holder = os.open(tmp_path, os.O_RDONLY)  # another process's writer (a separate open file: flock conflicts)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with pytest.raises(staging.OutputError, match=rf"^{tmp_path}: another process has held it for 0.3 s .*the "
                                                      r"bundle was not moved in"):
            with staging.staged_folder(out, "bundle") as folder:
                (folder / "x").write_text("x")
    finally:
        os.close(holder)
    assert list(tmp_path.iterdir()) == []  # no output, no staging folder
    with staging.staged_folder(out, "bundle") as folder:  # free again: moved in
        (folder / "x").write_text("x")
    assert (out / "x").read_text() == "x"


@pytest.mark.parametrize("entry", ["mine", {"bytes": 5}, {"bytes": "5", "sha256": "0" * 64}, {"bytes": 5, "sha256": "x"}])
def test_a_manifest_whose_entries_are_not_records_of_ours_does_not_make_a_folder_replaceable(tmp_path, entry):
    """A hand-written BUNDLE.json listing notes.txt as "mine": its file went unchecked, and a bundle
    written there deleted it."""
    folder = tmp_path / "board"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    (folder / "BUNDLE.json").write_text(json.dumps({"files": {"notes.txt": entry}}))
    assert staging.output_changes(folder, "BUNDLE.json") == "BUNDLE.json does not list files the way gemma-export writes them"
    digest = hashlib.sha256(b"mine").hexdigest()
    (folder / "BUNDLE.json").write_text(json.dumps({"files": {"notes.txt": {"bytes": 4, "sha256": digest}}}))
    assert staging.output_changes(folder, "BUNDLE.json") == ""  # a true record of what is there: ours


def test_a_folder_a_killed_writer_moved_aside_is_pointed_to_when_it_is_asked_for(tiny_int8_export, tmp_path):
    """SIGKILL between move_into_place's two renames leaves no destination, the previous output
    whole in .NAME.old-*/NAME and the new one in .NAME.staging-*: 'no such export folder' alone
    left the user to find it."""
    import shutil

    from gemma_export.errors import SourceNotFoundError
    from gemma_export.runtime import OnnxDecoder

    out = tmp_path / "int8"
    aside = tmp_path / ".int8.old-abcd1234"
    aside.mkdir()
    shutil.copytree(tiny_int8_export, aside / "int8")
    with pytest.raises(SourceNotFoundError, match=rf"^{out}: no such export folder; a gemma-export killed while "
                                                  rf"replacing it left the previous one in {aside / 'int8'}: move that "
                                                  rf"back to {out}, or write it again$"):
        OnnxDecoder(out)
    (aside / "int8").rename(out)  # as the message says
    assert OnnxDecoder(out).vocab_size > 0


def test_a_parent_that_can_be_written_but_not_read_still_takes_the_output(tmp_path):
    """A drop-box folder (mode 0333) can be written in but not listed or opened for reading: the
    search for leftovers beside the output ended in a PermissionError traceback, and the lock's
    open would too. Both now go on without (no leftovers can be seen there; the move is unlocked)."""
    parent = tmp_path / "dropbox"
    parent.mkdir()
    script = textwrap.dedent(f"""
        from pathlib import Path
        from gemma_export import staging
        with staging.staged_folder(Path({str(parent / 'out')!r}), "bundle") as folder:
            (folder / "x").write_text("x")
    """)
    parent.chmod(0o333)
    try:
        done = subprocess.run([*_unprivileged(), sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120)
    finally:
        parent.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert (parent / "out" / "x").read_text() == "x"


def test_listed_files_refuses_a_sha256_that_is_no_digest():
    from gemma_export.errors import VerificationError

    with pytest.raises(VerificationError, match=r"^BUNDLE.json: files\['a'\] has 'sha256' \"x\"; expected 64 lowercase "
                                                r"hex digits$"):
        staging.listed_files({"a": {"bytes": 1, "sha256": "x"}}, Path("BUNDLE.json"), nested=True)
    assert staging.listed_files({"a": {"bytes": 1, "sha256": "0" * 64}}, Path("BUNDLE.json"), nested=True) == {
        "a": (1, "0" * 64)}
    # sha256sum's form only: an uppercase digest passed the runtime's check and failed verify's compare
    with pytest.raises(VerificationError, match="expected 64 lowercase hex digits"):
        staging.listed_files({"a": {"bytes": 1, "sha256": "A" * 64}}, Path("BUNDLE.json"), nested=True)


def test_a_folder_that_cannot_be_opened_is_never_taken_as_locked(tmp_path, monkeypatch):
    """flocked yields None (no lock possible) for a folder it cannot open (mode 0333 for another
    user), so prepack's busy() says it cannot tell rather than 'no prepack runs' (a mutation audit
    found nothing checking this)."""
    from gemma_export import prepack as prepack_module

    real_open = os.open

    def refused(path, flags, *args, **kwargs):
        if Path(path) == tmp_path:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with staging.flocked(tmp_path) as held:
        assert held is None
    assert prepack_module.busy(tmp_path) is None


def test_a_disk_that_fills_during_prepack_leaves_the_export_as_it_was(tiny_int8_export, small_disk, monkeypatch):
    """Where the space estimate is short of the copy, the copy fails cleanly. Its message gave the
    estimate as what the copy needs beside "0 bytes free" (helper-found, an int4 copy 2.19 x its data
    file against the 2.1 x estimate then): it now says how far the copy got."""
    from gemma_export import prepack as prepack_module

    export = small_disk / "int8"
    shutil.copytree(tiny_int8_export, export)  # ~280 KB of 512 KiB: no room for a copy twice its data
    before = _tree(small_disk)
    monkeypatch.setattr(prepack_module, "check_free_space", lambda *args, **kwargs: None)
    try:
        prepack_module.prepack(export)
    except OutputError as exc:
        message = str(exc)
    else:
        pytest.fail("prepack filled the disk without an error")
    gc.collect()  # the failed run's onnxruntime objects map files of the tmpfs until collected: it must unmount
    assert re.fullmatch(rf"{re.escape(str(export / 'prepacked'))}: onnxruntime could not write the pre-packed copy \(the "
                        r"disk is full or a file-size limit was reached after [\d,]+ bytes of it, of about [\d,]+ "
                        r"expected\); free some space; nothing was written", message), message
    assert _tree(small_disk) == before
    assert CliRunner().invoke(app, ["verify", str(export)]).exit_code == 0


def test_a_second_interrupt_during_the_clean_up_does_not_cut_it_short(tmp_path, monkeypatch):
    """Two Ctrl-C a few ms apart: the second landed in the staging folder's removal and left it
    half deleted (helper-found, 4 of 14 runs). Here the second comes from inside the removal."""
    real_rmtree = staging.shutil.rmtree
    sent = []

    def interrupted_rmtree(path, *args, **kwargs):
        if staging.STAGING_TAG in Path(path).name and not sent:  # the staging folder's removal, not a probe's
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler at its next step: here
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(staging.shutil, "rmtree", interrupted_rmtree)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):  # the first
        with staging.staged_folder(out, "export") as folder:
            (folder / "model.onnx.data").write_bytes(b"\0" * 1024)
            raise KeyboardInterrupt
    assert sent and os.listdir(tmp_path) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Ctrl-C works as before


# --- an interrupt once the output is in place; the renames' own failures --------------------------

@pytest.mark.parametrize("signal_error, status", [(KeyboardInterrupt, 130), ("Terminated", 143)])
def test_an_interrupt_once_the_export_is_in_place_says_it_is_written(tiny_dir, tmp_path, monkeypatch,
                                                                     signal_error, status):
    """A signal after the rename (while the parent's lock was released, or a notice was told) said
    'nothing was written (an existing output folder is unchanged)' about a replaced folder."""
    from gemma_export.console import Terminated

    error = Terminated if signal_error == "Terminated" else signal_error
    moved = staging.move_into_place

    def move_then_interrupt(staged, out_dir, what):
        moved(staged, out_dir, what)
        raise error

    out = tmp_path / "out"
    assert _export(tiny_dir, out, "fp32").exit_code == 0
    before = _tree(out)
    monkeypatch.setattr(staging, "move_into_place", move_then_interrupt)
    result = _export(tiny_dir, out, "bf16")
    assert result.exit_code == status, result.output
    assert result.stderr.strip().splitlines()[-1] == (f"error: interrupted; the export {out} is written and complete "
                                                      f"(`gemma-export verify {out}` checks it)")
    assert _tree(out) != before and json.loads((out / "manifest.json").read_text())["dtype"] == "bf16"
    assert verify.verify_manifest(out)  # complete
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("signal_error, status", [(KeyboardInterrupt, 130), ("Terminated", 143)])
@pytest.mark.parametrize("existing", [False, True])
def test_an_interrupt_as_the_export_returns_says_it_is_written(tiny_dir, tmp_path, monkeypatch, signal_error, status,
                                                               existing):
    """A helper's signal 0.5-100 ms after the old folder was deleted (while the progress bars closed
    and export() returned, outside every block that knew the folder was in place) got "nothing was
    written (an existing output folder is unchanged)", for a new folder and for a replaced one
    whose old export was gone."""
    import gemma_export.exporter as exporter
    from gemma_export.console import Terminated

    error = Terminated if signal_error == "Terminated" else signal_error
    out = tmp_path / "out"
    if existing:
        assert _export(tiny_dir, out, "fp32").exit_code == 0
    export = exporter.export

    def export_then_interrupt(*args, **kwargs):
        export(*args, **kwargs)
        raise error
    monkeypatch.setattr(exporter, "export", export_then_interrupt)
    result = _export(tiny_dir, out, "bf16")
    assert result.exit_code == status, result.output
    assert result.stderr.strip().splitlines()[-1] == (f"error: interrupted; the export {out} is written and complete "
                                                      f"(`gemma-export verify {out}` checks it)")
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "bf16" and verify.verify_manifest(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]
    # the next command in the same process starts afresh: an interrupt before its rename is not "written"
    monkeypatch.setattr(exporter, "export", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt()))
    result = _export(tiny_dir, tmp_path / "other", "bf16")
    assert result.exit_code == 130 and "nothing was written" in result.stderr, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_an_interrupt_after_a_scratch_export_is_no_written_output(tiny_int8_export, tmp_path, monkeypatch):
    """A reviewer: `quality --reference fp32` exports fp32 into a temporary folder, and Ctrl-C during
    its comparison said "the export /tmp/…/fp32 is written and complete" about a folder deleted on
    the way out. Only a command that writes an output of its own reports one."""
    import gemma_export.quality as quality

    def scratch_export_then_interrupt(*_args, **_kwargs):
        scratch = tmp_path / "scratch"
        scratch.mkdir()
        staging.move_into_place(scratch, tmp_path / "fp32", "export")  # sets MOVED_IN, as export() does
        raise KeyboardInterrupt
    monkeypatch.setattr(quality, "run_quality", scratch_export_then_interrupt)
    result = CliRunner().invoke(app, ["quality", "--model", str(tiny_int8_export), "--reference", "fp32"])
    assert result.exit_code == 130, result.output
    assert "written and complete" not in result.stderr and result.stderr.startswith("error: interrupted"), result.stderr


def test_an_interrupt_while_the_summary_prints_says_the_export_is_written(tiny_dir, tmp_path, monkeypatch):
    """Ctrl-C while the summary prints: a helper found exit 130 with 'failed' for a written folder;
    it is an interrupt (130, so that `&&` stops), said with the folder complete."""
    from gemma_export import cli

    def interrupted(*_args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_list_files", interrupted)
    out = tmp_path / "out"
    result = _export(tiny_dir, out, "fp32")
    assert result.exit_code == 130, result.output
    assert result.stderr.endswith(f"error: interrupted; the export {out} is written and complete "
                                  f"(`gemma-export verify {out}` checks it)\n")
    assert verify.verify_manifest(out)


def test_interrupts_held_restores_both_handlers_when_a_signal_lands_mid_restore(monkeypatch):
    """Handlers were changed in one comprehension and restored in a loop: a signal between two
    changes left Ctrl-C ignored; a handler installed from C (None) raised TypeError on restore."""
    real = signal.signal
    restored = []
    calls = {"n": 0}

    def flaky(sig, handler):
        calls["n"] += 1
        previous = real(sig, handler)
        if calls["n"] == 3:  # the first restore: as if SIGTERM landed right after it
            raise KeyboardInterrupt
        if calls["n"] > 2:
            restored.append((sig, handler))
        return None if sig == signal.SIGTERM else previous  # SIGTERM's as a C-installed handler

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(signal, "signal", flaky)
    try:
        with pytest.raises(KeyboardInterrupt):
            with staging.interrupts_held():
                assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) == before[0]
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # not None: put back as the default
        assert (signal.SIGINT, before[0]) in restored and (signal.SIGTERM, signal.SIG_DFL) in restored
    finally:
        real(signal.SIGINT, before[0])
        real(signal.SIGTERM, before[1])


def test_a_staging_folder_that_cannot_be_made_leaves_no_parent_folders(tmp_path, monkeypatch):
    import errno
    import tempfile

    real = tempfile.mkdtemp

    def no_more_files(suffix=None, prefix=None, dir=None):  # the staging folder's (the writability probe's passes)
        if prefix and staging.STAGING_TAG in prefix:
            raise OSError(errno.EMFILE, "Too many open files")
        return real(suffix, prefix, dir)

    monkeypatch.setattr(tempfile, "mkdtemp", no_more_files)
    with pytest.raises(OutputError, match="cannot create the export folder: Too many open files"):
        with staging.staged_folder(tmp_path / "a" / "b" / "out", "export"):
            pass
    assert os.listdir(tmp_path) == []  # a/ and a/b/ were made by this call: gone with it


def test_a_failed_move_whose_undo_fails_names_where_the_previous_output_is(tmp_path, monkeypatch):
    """The second rename failed and putting the old folder back failed too: the second error hid the
    first and the previous output sat in .out.old-* unnamed, where a later run deleted it as stale."""
    import errno

    out, new = tmp_path / "out", tmp_path / ".out.staging-x"
    for folder, text in ((out, "previous"), (new, "new")):
        folder.mkdir()
        (folder / "model.onnx").write_text(text)
    real = os.replace
    calls = {"n": 0}

    def failing(src, dst):
        calls["n"] += 1
        if calls["n"] >= 2:  # the move in, and the move back
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OutputError) as caught:
        staging.move_into_place(new, out, "export")
    monkeypatch.setattr(os, "replace", real)
    old = next(p for p in tmp_path.iterdir() if p.name.startswith(".out.old-"))
    assert str(caught.value) == (f"{out}: moving the new output in failed (Input/output error) and putting the previous "
                                 f"one back failed too (Input/output error); the previous one is in {old / 'out'}: "
                                 "move it back by hand")
    assert (old / "out" / "model.onnx").read_text() == "previous"
    # a later run must not delete it as a killed writer's leftover while out/ is missing
    past = time.time() - 2 * STALE_AFTER_SECONDS
    os.utime(old, (past, past))
    stale = staging.remove_stale(out)
    assert stale.removed == [] and [p for p, _ in stale.stuck] == [old]
    assert "holds the previous out and" in stale.stuck[0][1] and (old / "out" / "model.onnx").is_file()
    real(old / "out", out)  # once it is back, the empty folder goes as before
    os.utime(old, (past, past))
    assert staging.remove_stale(out).removed == [old]


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_the_write_probe_leaves_no_probe_folder_and_still_stops(tmp_path, signal_name):
    """The probe of whether a folder takes new entries (a temporary folder made and removed) holds
    Ctrl-C and SIGTERM off: one between the two left .gemma-export-probe-* behind (inside an export
    for prepack, which verify then refused) with 'nothing was written' (helper-found). The signal
    is acted on once the probe is done (a dropped one let the whole command run on)."""
    script = textwrap.dedent(f"""
        import os, signal, tempfile
        from gemma_export import staging
        real = tempfile.mkdtemp
        def made_then_signalled(*args, **kwargs):
            path = real(*args, **kwargs)
            os.kill(os.getpid(), signal.{signal_name})  # the default action would end the process here
            return path
        tempfile.mkdtemp = made_then_signalled
        try:
            staging.entry_refused(__import__("pathlib").Path({str(tmp_path)!r}))
        except KeyboardInterrupt:
            print("interrupted after the probe:", os.listdir({str(tmp_path)!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    if signal_name == "SIGINT":
        assert (done.returncode, done.stdout) == (0, "interrupted after the probe: []\n"), done.stderr
    else:  # the signal's default action, after the probe (SIGHUP was not held until the twentieth session)
        assert done.returncode == -getattr(signal, signal_name), done.stderr
    assert os.listdir(tmp_path) == []


def test_remove_stale_keeps_an_old_copy_only_when_it_may_be_the_only_one(tmp_path, monkeypatch):
    """An old-copy folder is kept while the output is missing and it holds something (or cannot be
    listed); an empty one, or one beside an output in place (a link counts), goes as before."""
    past = time.time() - 2 * STALE_AFTER_SECONDS
    out = tmp_path / "out"

    def aged(name, holds):
        folder = tmp_path / name
        folder.mkdir()
        if holds:
            (folder / "out").mkdir()
            (folder / "out" / "model.onnx").write_text("previous")
            os.utime(folder / "out", (past, past))
        os.utime(folder, (past, past))
        return folder

    empty = aged(".out.old-empty_12", False)
    assert staging.remove_stale(out) == ([empty], [], [], [])  # nothing of anyone's in it
    full = aged(".out.old-full_123", True)
    out.symlink_to(tmp_path / "nowhere")  # an output in place, though a dangling link
    assert staging.remove_stale(out) == ([full], [], [], [])
    out.unlink()
    unreadable = aged(".out.old-unread12", True)
    refuse_listing(monkeypatch, unreadable)
    stale = staging.remove_stale(out)
    assert stale.removed == [] and [p for p, _ in stale.stuck] == [unreadable] and unreadable.is_dir()


def test_an_error_other_than_an_interrupt_after_the_move_is_raised_as_it_is(tiny_dir, tmp_path, monkeypatch):
    moved = staging.move_into_place

    def move_then_fail(staged, out_dir, what):
        moved(staged, out_dir, what)
        raise RuntimeError("after the move")

    monkeypatch.setattr(staging, "move_into_place", move_then_fail)
    with pytest.raises(RuntimeError, match="after the move"):
        exporter.export(tiny_dir, tmp_path / "out", "fp32")


def test_an_interrupt_at_the_note_on_the_replaced_copy_says_the_export_is_written(tiny_dir, tmp_path):
    """The note that the replaced export's pre-packed copy went with it comes once the new export
    is in place: an interrupt there is OutputWritten, not 'nothing was written'."""
    from gemma_export.errors import OutputWritten
    from gemma_export.prepack import prepack

    out = tmp_path / "out"
    exporter.export(tiny_dir, out, "int8", block_size=16)
    prepack(out)

    def status(line):
        if "pre-packed copy went with it" in line:
            raise KeyboardInterrupt

    with pytest.raises(OutputWritten) as caught:
        exporter.export(tiny_dir, out, "fp32", status=status)
    assert caught.value.path == out and caught.value.what == "export"
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "fp32" and verify.verify_manifest(out)


def test_a_folder_replaced_by_another_export_while_loading_is_named_as_such(tiny_int8_export, tiny_dir, tmp_path,
                                                                            monkeypatch):
    """Probe finding: `generate` while an export replaced the folder read the old manifest and the new
    graph, and said "field 'dtype' is "int8", but the graph stores fp32 weights": a damaged export,
    which it was not."""
    from gemma_export import runtime
    from gemma_export.errors import GemmaExportError

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    replacement = exporter.export(tiny_dir, tmp_path / "new", "fp32").out_dir
    load_graph = runtime.load_graph

    def replaced_first(path):  # the other export's rename lands between the manifest and the graph
        if replacement.exists():
            os.rename(model, tmp_path / "old")
            os.rename(replacement, model)
        return load_graph(path)

    monkeypatch.setattr(runtime, "load_graph", replaced_first)
    with pytest.raises(GemmaExportError) as info:
        runtime.OnnxDecoder(model)
    assert str(info.value) == f"{model}: replaced or moved while it was being loaded (another gemma-export writing it?); run again"
    monkeypatch.setattr(runtime, "load_graph", load_graph)
    assert runtime.OnnxDecoder(model).dtype == "fp32"  # run again: the new export, whole
    # and the check itself still speaks when nothing replaced the folder: the manifest is named
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["dtype"] = "int8"
    (model / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GemmaExportError, match="field 'dtype' is \"int8\""):
        runtime.OnnxDecoder(model)


def test_the_note_on_a_previous_output_left_aside_gives_one_instruction(tmp_path):
    """Probe finding: the note said "move it back by hand" and then "; remove it by hand"."""
    out = tmp_path / "out"
    old = tmp_path / ".out.old-abcd1234"
    (old / "out").mkdir(parents=True)
    (old / "out" / "model.onnx").write_text("previous")
    past = time.time() - 2 * STALE_AFTER_SECONDS
    os.utime(old, (past, past))
    said = []
    with staging.staged_folder(out, "export", notify=said.append) as folder:
        (folder / "model.onnx").write_text("new")
    assert said == [f"could not remove {old}, left by an earlier gemma-export (it holds the previous out and {out} is "
                    "missing (a writer stopped between its two renames): move it back by hand to keep it; a later run "
                    "removes it once out is there again)"]
    assert (old / "out" / "model.onnx").read_text() == "previous" and (out / "model.onnx").read_text() == "new"
    assert staging.remove_stale(out).removed == [old]  # as the note said, once out is there again


@pytest.mark.parametrize("command", ["export", "dedupe"])
def test_an_output_name_longer_than_the_file_system_takes_is_refused_with_the_limit(tiny_dir, tmp_path, command):
    """Probe finding: a 256-byte --out gave the OS's bare "File name too long"."""
    from typer.testing import CliRunner

    from gemma_export.cli import app

    out = tmp_path / ("L" * 256)
    args = (["--source", str(tiny_dir), "--dtype", "fp32", "--out", str(out)] if command == "export"
            else ["dedupe", str(tiny_dir / "model.safetensors"), "--out", str(out)])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert f"error: {out}: a name of 256 bytes in it; this file system takes at most 255" in result.output
    assert list(tmp_path.iterdir()) == []


def test_hidden_names_fit_a_file_system_that_takes_shorter_names(tmp_path, monkeypatch):
    """Review finding: the shortening assumed 255 bytes; on eCryptfs (143) a name 13-18 bytes under
    the limit passed the checks and failed when the staging folder was made."""
    from gemma_export.staging import hidden_prefix

    monkeypatch.setattr(staging, "max_name_bytes", lambda folder: 143)
    name = "n" * 130  # legal there
    prefix = hidden_prefix(tmp_path / name)
    assert len((prefix + "staging-abcd1234").encode()) <= 143 and prefix.startswith(".n") and "~" in prefix
    assert hidden_prefix(tmp_path / ("n" * 100)) == f".{'n' * 100}."  # short enough: unchanged


def test_a_prepack_out_of_inodes_says_so(tiny_int8_export, tmp_path, monkeypatch):
    """A helper's tmpfs with 8 inodes: prepack said "onnxruntime could not write the pre-packed copy
    (SystemError : 28)", naming neither the disk nor its inodes. With inodes counted and none left
    it says so, and the export is left as it was."""
    from gemma_export import prepack as prepack_module
    from gemma_export.errors import FormatError

    export = tmp_path / "int8"
    shutil.copytree(tiny_int8_export, export)
    before = _tree(export)

    import gemma_export.runtime as runtime

    real = runtime.create_session

    def cannot_write(path, threads=None, optimized_model_path=None, *args, **kwargs):
        if optimized_model_path is None:  # the export's own session
            return real(path, threads, optimized_model_path, *args, **kwargs)
        raise FormatError(f"{path}: onnxruntime cannot load the model: SystemError : 28")
    monkeypatch.setattr(runtime, "create_session", cannot_write)  # prepack imports it when it runs
    monkeypatch.setattr(prepack_module, "no_free_inodes", lambda folder: folder.exists())
    with pytest.raises(OutputError) as raised:
        prepack_module.prepack(export)
    assert str(raised.value) == (f"{export / 'prepacked'}: onnxruntime could not write the pre-packed copy: the file "
                                 "system has no free inodes left (`df -i` shows them); free some; nothing was written")
    assert _tree(export) == before
    monkeypatch.setattr(prepack_module, "no_free_inodes", lambda folder: False)  # the other reasons as before
    with pytest.raises(OutputError, match=r"could not write the pre-packed copy \(SystemError : 28\); nothing was written$"):
        prepack_module.prepack(export)


def test_an_output_inside_the_source_under_another_name_is_refused(tiny_dir, tmp_path):
    """A helper: with the source folder bind-mounted elsewhere, `--out ALIAS/z` wrote the export into
    the source folder (the name check saw two folders). Identity is compared too."""
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    alias = tmp_path / "alias"
    alias.mkdir()
    with _bind_mount(src, alias):
        before = _tree(src)
        result = _export(src, alias / "z")
        assert result.exit_code == 2
        assert result.stderr.strip().splitlines()[-1] == f"error: {alias / 'z'}: output folder is inside the source {src}; choose another --out"
        result = _export(alias, src / "z")  # the source named by the alias, the output by the real name
        assert result.exit_code == 2 and f"output folder is inside the source {alias}" in result.stderr
        assert _tree(src) == before
