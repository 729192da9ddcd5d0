"""Write an output folder atomically: build it in a staging folder beside the destination, then
move it into place; on any failure (a check, a full disk, Ctrl-C) remove the staging folder and any
parent folders this call created, and leave an existing destination unchanged."""

from __future__ import annotations

import contextlib
import contextvars
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

from .console import TERMINATING_SIGNALS
from .errors import FormatError, OutputError, OutputWritten, VerificationError, check_utf8_path, is_sha256, shown
from .onnx_files import BUNDLE_MANIFEST, MANIFEST_FILE
from .text_files import non_regular, read_bounded


@contextlib.contextmanager
def interrupts_held(deferred: bool = False) -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP (:data:`~gemma_export.console.TERMINATING_SIGNALS`) off for a
    block that must not stop halfway (two renames); a signal that
    arrives meanwhile is dropped, since the block completes the output anyway, or, ``deferred``,
    raised once the block has ended (for a block that precedes the work, such as a probe: the
    command still stops). An ignored signal stays ignored. Each handler is restored even when a
    signal lands between two of the changes (the one it raises is raised after all are restored).
    Outside the main thread (where handlers cannot be set) the block runs unprotected."""
    if threading.current_thread() is not threading.main_thread():  # Python refuses handlers there
        yield
        return
    previous: dict[int, object] = {}
    caught: list[int] = []
    holder = (lambda signum, _frame: caught.append(signum)) if deferred else signal.SIG_IGN
    try:
        for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
            # recorded before it is changed: a signal that lands right after the change (its handler
            # runs between two bytecodes) must not find it changed and unrecorded
            previous[sig] = signal.getsignal(sig)
            if previous[sig] != signal.SIG_IGN:
                signal.signal(sig, holder)
        yield
    finally:
        pending: BaseException | None = None
        for sig, handler in previous.items():
            for _ in range(100):  # a signal raised mid-restore: restore again (it is idempotent)
                try:
                    # None: a handler installed from C, which Python cannot reinstall
                    signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
                    break
                except KeyboardInterrupt as exc:
                    pending = pending or exc
        if pending is not None:
            raise pending
    if caught:  # now met by the handler it would have met during the block
        signal.raise_signal(caught[0])


#: the output :func:`move_into_place` moved in last, and what it is (``(path, "export")``), for a
#: command whose interrupt lands after that but before the command reports it, wherever the stack
#: then is (a progress bar closed, a frame returning): the output is complete, and the command must
#: say so (``cli._reported``, for the commands that write an output of their own). Set inside the
#: block that holds interrupts off, with the rename. :class:`~gemma_export.errors.OutputWritten`
#: stays the signal to a Python caller of a writer (raised by :func:`staged_folder` and
#: :func:`reported_as_written` inside it); this is the command line's for the frames outside it.
MOVED_IN: contextvars.ContextVar[tuple[Path, str] | None] = contextvars.ContextVar("moved_in", default=None)


@contextlib.contextmanager
def reported_as_written(path: Path, what: str) -> Iterator[None]:
    """For work done after :func:`staged_folder` moved ``path`` in: an interrupt there raises
    :class:`OutputWritten` instead."""
    try:
        yield
    except OutputWritten:
        raise
    except KeyboardInterrupt as exc:
        raise OutputWritten(path, what) from exc


#: how long :func:`staged_folder` waits for another process's lock on the output's parent, seconds
#: (a writer holds it only from its final check to its rename; ``prepack`` holds its export
#: folder's while it works)
PARENT_LOCK_WAIT_S = 60


@contextlib.contextmanager
def flocked(folder: Path, exclusive: bool = True, wait_s: float | None = 0.0) -> Iterator[bool | None]:
    """An advisory ``flock`` on ``folder`` itself (no file is written), held while the block runs;
    the kernel drops it when the process ends, however it ends. The one place this package locks.

    Args:
        exclusive: an exclusive lock (writers) or a shared one (readers asking whether a writer runs).
        wait_s: how long another holder is waited for: 0 not at all, None as long as it takes.

    Yields:
        True: held. False: another process held it for ``wait_s``. None: no lock can be taken here
        (no ``fcntl``, a file system without locks, a folder that cannot be opened for reading such
        as mode 0333); the block runs unheld, and the caller decides what that means.
    """
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield None
        return
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield None
        return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if wait_s is None else time.monotonic() + wait_s
        state: bool | None = True
        while True:
            try:
                fcntl.flock(fd, mode | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    state = False
                    break
                time.sleep(0.05)
            except OSError:  # a file system without locks (ENOLCK)
                state = None
                break
        yield state
    finally:
        os.close(fd)


@contextlib.contextmanager
def held_folder(folder: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive :func:`flocked` lock on ``folder`` while the block runs, so
    :func:`remove_stale` can tell a folder that is still being written from one a killed process
    left behind, and two writers of one destination take turns (:func:`staged_folder`). Where no
    lock can be taken the block runs unheld.

    Args:
        wait_s: give up after this many seconds of another holder (None: wait as long as it takes).

    Raises:
        TimeoutError: another process held it for ``wait_s``.
    """
    with flocked(folder, wait_s=wait_s) as held:
        if held is False:
            raise TimeoutError(f"{folder}: held by another process for {wait_s} s")
        yield


#: a leftover folder younger than this is never judged stale (see :func:`remove_stale`)
STALE_AFTER_SECONDS = 10


#: bytes of an output's name kept in the hidden folders beside it (``.NAME.staging-XXXXXXXX``): a
#: file name has at most 255 bytes, and the suffix takes 18 of them with the two dots
_HIDDEN_NAME_BYTES = 255 - 18


#: what follows :func:`hidden_prefix` in the names of a writer's staging folder and of the old
#: output it moves aside (``tempfile`` adds random characters after them)
STAGING_TAG, OLD_TAG = "staging-", "old-"


def hidden_prefix(out_dir: Path) -> str:
    """``".NAME."``, the start of the hidden folders (staging, the old folder being replaced) kept
    beside ``out_dir``. A name longer than 237 bytes, which is legal itself, is shortened to 228
    bytes plus ``~`` and 8 hex digits of its sha256 (unique to it), so that those folders' names
    stay within the 255 bytes a file name may have (18 bytes fewer than the file system's
    :func:`max_name_bytes` where that is smaller)."""
    name = out_dir.name
    raw = os.fsencode(name)
    # the file system's own limit where it is smaller than Linux's 255 (eCryptfs: 143)
    budget = min(_HIDDEN_NAME_BYTES, max_name_bytes(out_dir.parent) - (255 - _HIDDEN_NAME_BYTES))
    if len(raw) <= budget:
        return f".{name}."
    short = os.fsdecode(raw[:budget - 9].decode("utf-8", "ignore").encode())
    return f".{short}~{hashlib.sha256(raw).hexdigest()[:8]}."


def leftovers(out_dir: Path) -> list[Path]:
    """The staging and old-copy folders beside ``out_dir`` (``.{name}.staging-*``, ``.{name}.old-*``),
    sorted; :func:`remove_stale` removes those no writer holds any more."""
    if not out_dir.parent.is_dir():
        return []
    # the whole name, as tempfile.mkdtemp makes it (8 characters of [a-z0-9_] after the tag): a
    # prefix alone matched the leftovers of an output named "model.old-1" as those of "model"
    name = re.compile(re.escape(hidden_prefix(out_dir)) + f"(?:{STAGING_TAG}|{OLD_TAG})" + r"[a-z0-9_]{8}")
    try:
        entries = sorted(out_dir.parent.iterdir())
    except OSError:  # a parent one may write in but not list (mode 0333): no leftovers can be seen
        return []
    return [path for path in entries if name.fullmatch(path.name) and path.is_dir() and not path.is_symlink()]


def writer_running(out_dir: Path) -> Path | None:
    """The first of :func:`leftovers` beside ``out_dir`` that a running writer holds (its lock; the
    lock is asked for, not kept), else None. Nothing is removed."""
    for path in leftovers(out_dir):
        with flocked(path) as held:
            if held is False:
                return path
    return None


def _writer_running_error(out_dir: Path, what: str, held: Path) -> OutputError:
    return OutputError(f"{out_dir}: another gemma-export is writing this {what} now ({held.name} beside it is in "
                       "use); nothing was written: run again when it has finished, or choose another folder")


class Stale(NamedTuple):
    """What :func:`remove_stale` did with the leftovers beside an output."""

    #: folders deleted
    removed: list[Path]
    #: folders it tried to delete but could not, each with the first error (e.g. a read-only file)
    stuck: list[tuple[Path, str]]
    #: folders it left alone: too young to judge, or held by a running writer
    kept: list[Path]
    #: those of ``kept`` that a running writer holds now: another gemma-export is writing the output
    held: list[Path]


def remove_stale(out_dir: Path) -> Stale:
    """Delete the staging and old-copy folders that killed writers of ``out_dir`` left beside it
    (``.{name}.staging-*``, ``.{name}.old-*``), skipping any another process still holds and any
    modified in the last :data:`STALE_AFTER_SECONDS` (a writer locks its folder just after creating
    it). Where no lock can be taken (a file system without locks) none can be judged, and each is
    reported as stuck; so is an old-copy folder with something in it while ``out_dir`` is missing,
    which may hold the only copy of the previous output. Returns what was removed, what could not
    be, and what was left alone."""
    result = Stale([], [], [], [])
    now = time.time()
    for path in leftovers(out_dir):
        try:  # a writer creates its folder, then locks it: a folder this young may be between the two
            young = now - path.stat().st_mtime < STALE_AFTER_SECONDS
        except OSError:  # gone meanwhile (another run removed it)
            continue
        if young:
            result.kept.append(path)
            with flocked(path) as held:  # asked, not taken for long: a writer waits for its own lock
                if held is False:
                    result.held.append(path)
            continue
        if path.name.startswith(hidden_prefix(out_dir) + OLD_TAG) and not (out_dir.exists() or out_dir.is_symlink()) \
                and not _empty_folder(path):
            # the folder a replaced output waits in, with no output in place: the only copy of it
            result.stuck.append((path, f"it holds the previous {out_dir.name} and {out_dir} is missing (a writer "
                                       "stopped between its two renames): move it back by hand to keep it; a later run removes it "
                                       f"once {out_dir.name} is there again"))
            continue
        with flocked(path) as held:
            if held is False:  # a live writer holds it
                result.kept.append(path)
                result.held.append(path)
            elif held is None:
                if path.is_dir():  # else removed meanwhile by another run, between the listing and here
                    result.stuck.append((path, "no lock can be taken on it here, so whether a running gemma-export "
                                               "still writes it cannot be told"))
            else:
                problem = remove_tree(path)
                if problem is None:
                    result.removed.append(path)
                else:
                    result.stuck.append((path, problem))
    return result


def _empty_folder(path: Path) -> bool:
    """Whether ``path`` is a folder known to hold nothing (one that cannot be listed is not)."""
    try:
        return not any(path.iterdir())
    except OSError:
        return False


def remove_tree(path: Path) -> str | None:
    """Delete the folder ``path`` with everything in it, as far as possible; None when it is gone,
    else the first error met (``"Permission denied: '…/model.onnx.data'"``): what is left stays."""
    errors: list[str] = []

    def note(where: str, exc: BaseException) -> None:  # `where`: the full path (exc.filename may be a bare name)
        errors.append(f"{exc.strerror}: '{where}'" if isinstance(exc, OSError) and exc.strerror else f"{exc}: '{where}'")

    if sys.version_info >= (3, 12):  # onerror is deprecated there; 3.11 has no onexc
        shutil.rmtree(path, onexc=lambda _function, where, exc: note(where, exc))
    else:
        shutil.rmtree(path, onerror=lambda _function, where, exc_info: note(where, exc_info[1]))
    if not (path.exists() or path.is_symlink()):
        return None
    return errors[0] if errors else "not removed"


def move_into_place(staging: Path, out_dir: Path, what: str) -> tuple[Path, str] | None:
    """Replace ``out_dir`` (if any) by ``staging`` with renames in the same parent folder, then
    delete the old folder. If the second rename fails the old ``out_dir`` is put back; Ctrl-C cannot
    stop it between the renames or during the deletion. Once ``staging`` is in place,
    :data:`MOVED_IN` holds ``(out_dir, what)``.

    Returns:
        None, or ``(folder, first error)`` when the old folder could not be deleted (e.g. a
        read-only file in it): the new output is in place, and the old one waits in ``folder``.
    """
    with interrupts_held():
        if not (out_dir.exists() or out_dir.is_symlink()):
            os.replace(staging, out_dir)
            MOVED_IN.set((out_dir, what))
            return None
        old = Path(tempfile.mkdtemp(prefix=hidden_prefix(out_dir) + OLD_TAG, dir=out_dir.parent))
        with held_folder(old):  # a killed process leaves it unheld, for remove_stale
            try:
                os.replace(out_dir, old / out_dir.name)
            except BaseException:
                old.rmdir()
                raise
            try:
                os.replace(staging, out_dir)
            except BaseException as exc:
                try:
                    os.replace(old / out_dir.name, out_dir)
                    old.rmdir()
                except OSError as again:
                    raise OutputError(f"{out_dir}: moving the new output in failed ({_reason(exc)}) and putting the "
                                      f"previous one back failed too ({_reason(again)}); the previous one is in "
                                      f"{old / out_dir.name}: move it back by hand") from exc
                raise
            MOVED_IN.set((out_dir, what))
            problem = remove_tree(old)  # inside: an interrupt here would leave it behind
        return None if problem is None else (old, problem)


def output_changes(folder: Path, manifest_name: str, required: dict | None = None,
                   derived: tuple[tuple[str, str], ...] = (), leftovers: tuple[str, ...] = ()) -> str:
    """Why ``folder`` is not an unchanged output of this toolkit, or "" when it is one: a manifest
    this toolkit wrote (a JSON object with the ``required`` key/value pairs and a ``files`` map of
    paths relative to ``folder``) and nothing but the files it lists, the folders holding them,
    ``derived`` sub-folders (``(name, marker file)`` pairs: a folder ``name``, a relative path such as
    ``model/prepacked``, holding ``marker``, which the toolkit wrote from the listed files), and
    hidden folders whose names start with one of ``leftovers`` (what an interrupted writer of such a
    sub-folder leaves), each listed file with the size and sha256 recorded for it: only such a folder
    may be replaced by a new output. The reason names the first file found wrong: a listed file
    that is a link, a FIFO or a folder is one (verify refuses each of them)."""
    listing = folder / manifest_name
    if listing.is_symlink():
        return f"{manifest_name} is a link"
    if (what := non_regular(listing)) is not None:  # a FIFO's read would block
        return f"{manifest_name} is {what}"
    try:
        manifest = json.loads(read_bounded(listing, "a manifest").decode("utf-8"))
    except FormatError:
        return f"{manifest_name} is larger than any of ours"
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return f"no readable {manifest_name}"
    if not isinstance(manifest, dict):
        return f"{manifest_name} is not one of ours"
    for key, value in (required or {}).items():
        if manifest.get(key) != value:
            return f"{manifest_name} has {key} {manifest.get(key)!r}, not {value!r}"
    # each entry a record of ours (listed_files); anything else (a hand-written {"notes.txt": "mine"})
    # would let files go unchecked, and be deleted with the folder
    try:
        records = listed_files(manifest.get("files"), folder / manifest_name, nested=True)
    except VerificationError:
        return f"{manifest_name} does not list files the way gemma-export writes them"
    # a listed name that is a link, a FIFO or a folder (before the walk below would call it unlisted)
    for name in sorted(records):
        path = folder / name
        what = "a link" if path.is_symlink() else non_regular(path)
        if what is not None:
            return f"{name} is {what}, not the file {manifest_name} lists"
    listed = set(records) | {manifest_name}
    parents = {str(parent) for name in listed for parent in Path(name).parents if str(parent) != "."}
    skip = {name for name, marker in derived if (folder / name).is_dir() and not (folder / name).is_symlink()
            and (folder / name / marker).is_file()}
    skip |= {p.name for p in folder.iterdir() if leftovers and p.name.startswith(leftovers) and p.is_dir()
             and not p.is_symlink()} if folder.is_dir() else set()
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        if any(relative == name or relative.startswith(name + "/") for name in skip):
            continue
        if not (relative in parents if path.is_dir() and not path.is_symlink() else relative in listed):
            return f"{relative} is not listed in {manifest_name}"
    # and every listed file still holds what the manifest records (sizes first: cheap)
    # (a listed file that is gone holds nothing of anyone's)
    recorded = [(name, folder / name, size, digest) for name, (size, digest) in sorted(records.items())
                if (folder / name).is_file()]
    for name, path, size, _ in recorded:
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {manifest_name} records {size:,}"
    for name, path, _, digest in recorded:
        if file_sha256(path) != digest:
            return f"{name} differs from the sha256 {manifest_name} records"
    return ""


def entry_refused(folder: Path) -> str | None:
    """Why the existing ``folder`` refuses new entries (/proc, a read-only mount, permissions), in
    the OS's words, or None: probed by creating and removing a temporary folder in it, with
    Ctrl-C and SIGTERM held off meanwhile (one between the two left the folder behind, or made the
    removal fail as if the folder refused entries); one that arrives meanwhile is acted on after."""
    with interrupts_held(deferred=True):
        try:
            os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".gemma-export-probe-"))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def max_name_bytes(folder: Path) -> int:
    """The longest file name the file system of ``folder`` (or of its nearest existing parent)
    takes, in bytes (``NAME_MAX``, ``pathconf(3)``); 255, Linux's, where it cannot be asked."""
    existing = next((p for p in (folder, *folder.parents) if _exists(p)), None)
    try:
        return os.pathconf(existing if existing is not None else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a component too long, a loop of links: not a folder to ask
        return False


def check_name_lengths(out_dir: Path) -> None:
    """Refuse an output path with a name longer than its file system takes (:func:`max_name_bytes`),
    before anything asks the OS about it: the OS's bare "File name too long" named no limit.

    Raises:
        OutputError: ``"{out_dir}: a name of N bytes in it; this file system takes at most M"``.
    """
    if (found := too_long_name(out_dir)) is not None:
        raise OutputError(f"{out_dir}: a name of {found[0]} bytes in it; this file system takes at most {found[1]}")


def too_long_name(path: str | Path) -> tuple[int, int] | None:
    """``(bytes, limit)`` for the first name in ``path`` longer than its file system takes
    (:func:`max_name_bytes` of its folder), or None when every name fits."""
    name_max = max_name_bytes(Path(os.path.dirname(os.path.abspath(path))))
    sizes = (len(os.fsencode(part)) for part in Path(path).parts)
    return next(((size, name_max) for size in sizes if size > name_max), None)


def check_creatable(out_dir: Path, what: str) -> None:
    """Refuse, before any work, an output folder that cannot be made: a regular file among its
    parents, or (when ``out_dir`` does not exist yet) a nearest existing parent that refuses new
    entries (:func:`entry_refused`). An existing folder is replaced by :func:`move_into_place`,
    which stages beside it and moves it into another folder of its parent: the parent must take
    new entries and the folder itself must be writable (a folder's ``..`` entry changes when it
    moves; ``rename(2)``, EACCES). ``what`` names the output in the message.

    Raises:
        OutputError: naming the blocking path and the reason.
    """
    check_utf8_path(out_dir, f"{what} folder")
    check_name_lengths(out_dir)
    _check_creatable(out_dir, what)


def _check_creatable(out_dir: Path, what: str) -> None:
    """:func:`check_creatable` once the path's names are checked."""
    blocker = next((p for p in reversed(out_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise OutputError(f"{out_dir}: cannot create the {what} folder: {blocker} is a file, not a folder")
    if out_dir.exists():
        parent = out_dir.absolute().parent
        if (reason := entry_refused(parent)) is not None:
            raise OutputError(f"{out_dir}: cannot replace the {what} folder: its parent {parent} refuses new entries "
                              f"({reason}), and the {what} is written beside it first")
        if out_dir.is_dir() and not out_dir.is_symlink() and not os.access(out_dir, os.W_OK, effective_ids=True):
            raise OutputError(f"{out_dir}: cannot replace the {what} folder: it is not writable (replacing it moves "
                              "it aside, which needs write permission on it)")
        # a sticky parent (/tmp) lets only the folder's or the parent's owner move the folder (root may)
        owners = {parent.stat().st_uid, out_dir.lstat().st_uid}
        if parent.stat().st_mode & stat.S_ISVTX and os.geteuid() != 0 and os.geteuid() not in owners:
            raise OutputError(f"{out_dir}: cannot replace the {what} folder: its parent {parent} is sticky and "
                              "neither belongs to you, so it cannot be moved aside")
        return
    existing = next(p for p in out_dir.parents if p.exists())  # "/" or "." at the latest
    reason = entry_refused(existing)
    if reason is not None:
        raise OutputError(f"{out_dir}: cannot create the {what} folder in {existing}: {reason}")


def check_listed_file(path: Path, size: int, digest: str, listing: str, folder_kind: str) -> None:
    """``path`` is a regular file of ``size`` bytes with sha256 ``digest``, as ``listing`` (e.g.
    "the manifest", "BUNDLE.json") records it; ``folder_kind`` names the folder in the link message.

    Raises:
        VerificationError: naming the file and the first way it differs.
    """
    if path.is_symlink():
        raise VerificationError(f"{path}: is a link; {folder_kind} holds regular files only")
    if path.is_dir():
        raise VerificationError(f"{path}: is a folder; {listing} lists it as a file")
    if path.exists() and not path.is_file():
        raise VerificationError(f"{path}: not a regular file (a FIFO, socket or device); {listing} lists a file")
    if not path.is_file():
        raise VerificationError(f"{path}: listed in {listing} but missing")
    if path.stat().st_size != size:
        raise VerificationError(f"{path}: {path.stat().st_size:,} bytes, {listing} says {size:,}")
    if file_sha256(path) != digest:
        raise VerificationError(f"{path}: sha256 differs from {listing}")


def listed_files(files, listing: Path, nested: bool) -> dict[str, tuple[int, str]]:
    """The ``files`` field of an export's manifest or a board folder's ``BUNDLE.json``
    (``{name: {"bytes": int, "sha256": hex}}``) as ``{name: (bytes, sha256)}``, every entry checked.

    Args:
        files: the field's parsed JSON value (anything: it comes from a file).
        listing: the file it was read from, for the messages.
        nested: whether names may be relative paths below the folder (a board folder's
            ``model/...``); otherwise each must be a plain file name.

    Raises:
        VerificationError: the field is not a non-empty object; a name that is not a file name
            (nested: an absolute path or one with ``..``); an entry without an integer ``bytes``
            (>= 0; JSON ``true`` is not one) and a string ``sha256`` of 64 lowercase hex digits.
    """
    if not isinstance(files, dict) or not files:
        raise VerificationError(f"{listing}: field 'files' must be an object of file name -> bytes and sha256, "
                                f"found {'nothing' if files is None else shown(files)}")
    expected = {}
    for name, entry in files.items():
        parts = Path(name).parts
        if not parts or (Path(name).is_absolute() or ".." in parts if nested else Path(name).name != name):
            raise VerificationError(f"{listing}: lists {name!r}, which is not a "
                                    f"{'path inside' if nested else 'file name in'} the folder")
        if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
                and isinstance(entry.get("sha256"), str)):
            raise VerificationError(f"{listing}: files[{name!r}] needs an integer 'bytes' (>= 0) and a string "
                                    f"'sha256', found {shown(entry)}")
        if not is_sha256(entry["sha256"]):
            raise VerificationError(f"{listing}: files[{name!r}] has 'sha256' {shown(entry['sha256'])}; expected 64 "
                                    "lowercase hex digits")
        expected[Path(name).as_posix() if nested else name] = (entry["bytes"], entry["sha256"])
    return expected


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read 1 MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_free_space(out_dir: Path, need_bytes: int, what: str, largest_file_bytes: int | None = None,
                     elsewhere: bool = True) -> None:
    """Refuse, before the slow work, an output that will not fit: ``need_bytes`` (an estimate of the
    files :func:`staged_folder` writes beside ``out_dir``) against the free space of the nearest
    existing folder on ``out_dir``'s path. The old output is replaced only after the new one is
    complete, so its space does not count. With ``largest_file_bytes`` (bytes of its largest file),
    also against this process's file-size limit (``ulimit -f``, ``RLIMIT_FSIZE``). ``elsewhere``
    False: the output has no other place to go (a pre-packed copy), and the refusal does not advise one.

    Raises:
        OutputError: naming the folder, the bytes needed and free, or the file-size limit.
    """
    if largest_file_bytes is not None:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and largest_file_bytes > limit:
            raise OutputError(f"{out_dir}: the {what} writes a file of about {largest_file_bytes:,} bytes, above this "
                              f"process's file-size limit of {limit:,} bytes (ulimit -f); raise the limit "
                              "(nothing was written)")
    existing = _nearest_folder(out_dir)
    if existing is None:
        return
    try:
        free = shutil.disk_usage(existing).free
    except OSError:
        return
    if free < need_bytes:
        # in bytes when the two would print alike in MB (a small file system)
        need, left = ((f"{need_bytes / 1e6:,.1f} MB", f"{free / 1e6:,.1f} MB") if need_bytes - free >= 100_000
                      else (f"{need_bytes:,} bytes", f"{free:,} bytes"))
        raise OutputError(f"{out_dir}: the {what} needs about {need} and {existing} has {left} free; free some "
                          f"space{' or choose another folder' if elsewhere else ' there'} (nothing was written)")


#: files that mark a folder as one of this toolkit's outputs (an export, a bundle)
OUTPUT_MARKERS = (MANIFEST_FILE, BUNDLE_MANIFEST)


def written_by_gemma_export(listing, marker: str = MANIFEST_FILE) -> bool:
    """Whether a parsed :data:`OUTPUT_MARKERS` file says this toolkit wrote it: an export's
    ``manifest.json`` names it in ``tool`` (``{"gemma-export": version, ...}``), a board folder's
    ``BUNDLE.json`` in ``gemma_export_version``. Another tool's ``manifest.json`` does neither."""
    if not isinstance(listing, dict):
        return False
    if marker == BUNDLE_MANIFEST:
        return "gemma_export_version" in listing
    tool = listing.get("tool")
    return isinstance(tool, dict) and "gemma-export" in tool


def nothing_listed(manifest) -> bool:
    """Whether a parsed ``manifest.json`` has no ``files`` listing to check because another tool wrote
    it; one of gemma-export without the listing is damaged (every export of it lists its files), and
    the checks go on to refuse it."""
    return "files" not in manifest and not written_by_gemma_export(manifest)


def enclosing_output(path: Path) -> Path | None:
    """The nearest folder above ``path`` that is an output of this toolkit (it holds a
    :data:`OUTPUT_MARKERS` file that is a JSON object with a ``files`` map, written by this toolkit:
    :func:`written_by_gemma_export`), or None. Writing into such a folder would add files its
    manifest does not list, and ``verify`` would then refuse it.

    Raises:
        OutputError: ``path`` cannot be resolved (a loop of symbolic links; RuntimeError from
            pathlib before Python 3.13), naming it.
    """
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "a loop of symbolic links"
        raise OutputError(f"{path}: cannot be resolved ({why}); expected a path that leads to a folder") from None
    for parent in resolved.parents:
        for marker in OUTPUT_MARKERS:
            try:  # bounded, and never a FIFO (whose read would block): only a real listing marks an output
                data = json.loads(read_bounded(parent / marker, "a listing").decode("utf-8"))
            except (OSError, ValueError, UnicodeDecodeError, RecursionError, FormatError):
                continue
            if written_by_gemma_export(data, marker) and isinstance(data.get("files"), dict):
                return parent
    return None


def check_outside_outputs(out_dir: Path, what: str) -> None:
    """Refuse an output inside another output of this toolkit (:func:`enclosing_output`).

    Raises:
        OutputError: naming ``out_dir`` and the enclosing folder.
    """
    enclosing = enclosing_output(out_dir)
    if enclosing is not None:
        raise OutputError(f"{out_dir}: is inside {enclosing}, an output of gemma-export whose manifest would no longer "
                          f"list every file in it; write the {what} elsewhere")


#: the kernel's table of this process's mounts (proc(5)): field 5 of each line is a mount point
MOUNTINFO = Path("/proc/self/mountinfo")


def is_mount_point(folder: Path) -> bool:
    """Whether ``folder`` (resolved) is a mount point, which no rename can replace (EBUSY).

    ``os.path.ismount`` compares device numbers with the parent's, so it misses a bind mount of a
    folder of the same file system; the kernel's mount table (:data:`MOUNTINFO`, mount points
    escaped as octal ``\\ooo``) lists those too. Where that table cannot be read (not Linux), the
    device test alone decides.
    """
    if os.path.ismount(folder):
        return True
    try:
        lines = MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape").splitlines()
    except OSError:
        return False
    target = os.fsencode(folder)
    for line in lines:
        fields = line.split(" ")
        if len(fields) > 4 and _unescape_mount_point(fields[4]) == target:
            return True
    return False


def _unescape_mount_point(field: str) -> bytes:
    """A mount point as mountinfo writes it (space, tab, newline and backslash as ``\\ooo``) as bytes."""
    return re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), os.fsencode(field))


def check_replaceable(out_dir: Path, what: str, manifest_name: str | None, before: Callable[[Path], None] | None = None,
                      derived: Callable[[Path], tuple[tuple[str, str], ...]] | None = None, **unchanged) -> None:
    """Refuse, before any work, an output folder :func:`staged_folder` could not or should not
    replace: a symbolic link, one :func:`check_creatable` refuses, one another gemma-export is writing now
    (:func:`writer_running`), a file, a mount point (replaced by renaming, which a
    mount point cannot be), or a non-empty folder that is not an unchanged output of ours
    (:func:`output_changes` with ``manifest_name`` and ``unchanged``; ``manifest_name`` None,
    for outputs that carry no listing: any non-empty folder). ``before(out)`` runs on an existing
    folder first (a check with a more specific message); ``derived(out)`` gives an existing
    folder's derived sub-folders (:func:`output_changes`), asked only once the checks above have
    passed.

    Raises:
        OutputError: naming ``out_dir`` and the reason.
    """
    check_utf8_path(out_dir, f"{what} folder")
    check_name_lengths(out_dir)  # before the OS is asked about it
    if out_dir.is_symlink():  # the rename would replace the link itself, not the folder it names
        raise OutputError(f"{out_dir}: is a symbolic link (to {os.readlink(out_dir)}); give the folder itself")
    _check_creatable(out_dir, what)
    if (held := writer_running(out_dir)) is not None:  # before the slow work (calibration), not after it
        raise _writer_running_error(out_dir, what, held)
    check_outside_outputs(out_dir, what)
    out = out_dir.resolve()
    here = Path.cwd().resolve()
    if out == here or out in here.parents:  # renaming it away fails (EBUSY) after all the work
        raise OutputError(f"{out_dir}: is the current folder{'' if out == here else ' or holds it'}, which the {what} "
                          "cannot replace; run from another folder or choose another --out")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputError(f"{out_dir}: exists and is not a folder")
    if is_mount_point(out):
        raise OutputError(f"{out_dir}: is a mount point, which the {what} cannot replace; choose a folder inside it")
    if before is not None:
        before(out)
    if not any(out.iterdir()):
        return
    if manifest_name is None:
        raise OutputError(f"{out_dir}: exists and is not an empty folder; choose another folder, or move this one "
                          "away first")
    changed = output_changes(out, manifest_name, derived=derived(out) if derived is not None else (), **unchanged)
    if changed:
        raise OutputError(f"{out_dir}: exists, is not empty and is not an unchanged {what} of gemma-export (a "
                          f"{manifest_name} of ours listing every file in it: {changed}); refusing to replace it: "
                          "choose another folder, or move this one away first")


def folder_state(folder: Path) -> tuple | None:
    """What ``folder`` holds, to tell whether it changed: None when nothing is there, else every entry
    below it (relative path, kind, size, modification time in ns, inode), sorted. A folder
    that cannot be listed gives its own entry's state."""
    try:
        top = folder.lstat()
    except OSError:
        return None
    state = [(".", top.st_mode, 0, 0, top.st_ino)]
    if folder.is_dir() and not folder.is_symlink():
        try:
            for path in folder.rglob("*"):
                with contextlib.suppress(OSError):
                    st = path.lstat()
                    state.append((str(path.relative_to(folder)), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino))
        except OSError:
            pass
    return tuple(sorted(state))


#: :func:`staged_folder`'s default ``checked_state``: the folder's state when the block begins
AT_START = object()


@contextlib.contextmanager
def staged_folder(out_dir: Path, what: str, checked_state=AT_START,
                  notify: Callable[[str], None] | None = None, parent_locked: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder beside ``out_dir``; when the block ends without an error, the
    staging folder (made ``0755``) replaces ``out_dir``, unless ``out_dir`` changed since
    ``checked_state`` (its :func:`folder_state` when the caller checked it could be replaced;
    :data:`AT_START`: when this block began): a file a user added, another process's output. Then nothing is
    replaced, since the folder no longer holds what was checked. ``notify`` is told, one line each,
    of the folders a killed earlier writer left beside ``out_dir`` that this call removes
    (:func:`remove_stale`), and of those it keeps (too young to judge, or a running writer's).
    From the check to the move it holds an exclusive ``flock`` on ``out_dir``'s parent
    (:func:`held_folder`), so of two writers that finish at once the second finds the first's output;
    ``parent_locked``: the caller holds that lock already (``prepack`` holds its export folder's).

    Raises:
        OutputError: another gemma-export is writing ``out_dir`` (a leftover beside it is locked),
            the folder cannot be created, it changed meanwhile, another process held the
            parent's lock for :data:`PARENT_LOCK_WAIT_S`, or writing failed with an
            ``OSError`` (no space left, a file-size limit, a read-only file system); ``what`` names
            the output in the message.
        Whatever the block raises, after cleaning up (``KeyboardInterrupt`` included), an
        ``OSError`` that names a file outside the output (a source read while writing) included.
    """
    check_creatable(out_dir, what)
    created = [p for p in reversed(out_dir.parents) if not p.exists()]
    stale = remove_stale(out_dir)  # what a killed earlier run left beside the destination
    if notify is not None:
        for path in stale.removed:
            notify(f"removed {path}, left by an earlier gemma-export")
        for path, problem in stale.stuck:
            # a problem that says what to do with the folder is not followed by "remove it by hand"
            notify(f"could not remove {path}, left by an earlier gemma-export ({problem})"
                   f"{'' if 'by hand' in problem else '; remove it by hand'}")
        for path in stale.kept:
            if path not in stale.held:
                notify(f"kept {path}: less than {STALE_AFTER_SECONDS} s old or in use by a running gemma-export; a "
                       "later run tries to remove it once it is neither")
    if stale.held:  # refused now rather than after the whole export, when the other one has moved in
        raise _writer_running_error(out_dir, what, stale.held[0])

    def remove_created() -> None:
        for folder in reversed(created):  # parents this call created, innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=hidden_prefix(out_dir) + STAGING_TAG, dir=out_dir.parent))
    except OSError as exc:
        _despite_interrupts(remove_created)
        raise OutputError(f"{out_dir}: cannot create the {what} folder: {exc.strerror or exc}") from None
    before = folder_state(out_dir) if checked_state is AT_START else checked_state
    existed = before is not None
    try:
        with held_folder(staging):
            yield staging
            staging.chmod(0o755)  # mkdtemp creates 0700; the output is an ordinary folder
            # one writer at a time from the check to the move: two writers that both found the folder
            # as they checked it would otherwise both move in, the second deleting the first's output
            with contextlib.ExitStack() as parent:
                if not parent_locked:
                    try:
                        parent.enter_context(held_folder(out_dir.parent, PARENT_LOCK_WAIT_S))
                    except TimeoutError:
                        raise OutputError(f"{out_dir.parent}: another process has held it for {PARENT_LOCK_WAIT_S} s "
                                          f"(a gemma-export writing beside it, or a prepack of it); the {what} was not "
                                          "moved in: run again when it has finished") from None
                if folder_state(out_dir) != before:
                    raise OutputError(
                        f"{out_dir}: {'changed' if existed else 'appeared'} while the {what} was being written (a file "
                        f"added, removed or rewritten, or another gemma-export writing to the same folder); the {what} "
                        f"was not moved in and {out_dir} is left as it is now: run again or choose another folder")
                left = move_into_place(staging, out_dir, what)
            if left is not None and notify is not None:
                notify(f"the {what} is in place, but the folder it replaced could not be deleted ({left[1]}); it is "
                       f"left in {left[0]}: remove it by hand")
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, OutputWritten) and not staging.exists():
            # the staging folder is gone only by its rename into place: the output is complete (an
            # interrupt while the lock was released or a notice was told)
            raise OutputWritten(out_dir, what) from exc

        def remove() -> None:
            shutil.rmtree(staging, ignore_errors=True)
            remove_created()

        # asked before the removal, which gives the staging folder's inodes back
        no_inodes = isinstance(exc, OSError) and out_of_inodes(exc, out_dir.parent)
        _despite_interrupts(remove)
        if isinstance(exc, OSError) and not _names_an_input(exc, out_dir):
            reason = _describe(exc, out_dir.parent, no_inodes)
            raise OutputError(f"{out_dir}: writing the {what} failed ({reason}); nothing was "
                              f"written{' and the existing folder is unchanged' if existed else ''}") from None
        raise


def _despite_interrupts(remove: Callable[[], None], attempts: int = 100) -> None:
    """Run ``remove`` (which may run again) to its end: Ctrl-C or SIGTERM during it (a second one,
    a few ms after the one being cleaned up after) starts it again instead of cutting it short,
    which left a staging folder half deleted. After ``attempts`` interrupts in a row it gives up."""
    for _ in range(attempts):
        try:
            remove()
            return
        except KeyboardInterrupt:
            continue


def _names_an_input(exc: OSError, out_dir: Path) -> bool:
    """Whether ``exc`` names a file outside the output: neither ``out_dir`` nor the hidden
    ``.NAME.*`` folders beside it (staging, the old folder being replaced). That is a source tensor
    read lazily while the output is written: an input's error, not a failed write. Errors without a
    file name (a short write), and those only a write gives (:data:`_NO_ROOM`, a read-only file
    system) whatever file they name (``shutil.copyfile`` names its source), count as writes."""
    if exc.errno in (*_NO_ROOM, errno.EROFS):
        return False
    if not exc.filename or not isinstance(exc.filename, (str, bytes, os.PathLike)):
        return False
    name = Path(os.path.abspath(os.fsdecode(exc.filename)))
    out = Path(os.path.abspath(out_dir))
    if name == out or out in name.parents:
        return False
    beside = next((p for p in (name, *name.parents) if p.parent == out.parent), None)
    return beside is None or not beside.name.startswith(hidden_prefix(out))


#: errno values of a write that found no room: a full disk, a file-size limit, a disk quota
_NO_ROOM = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


def _reason(exc: BaseException) -> str:
    """An error's reason in the OS's words, else its text, else its type."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__


def _nearest_folder(path: Path) -> Path | None:
    """``path`` when it is a folder, else its nearest parent that is one (None: none is)."""
    return next((p for p in (path, *path.parents) if p.is_dir()), None)


def out_of_inodes(exc: OSError, folder: Path) -> bool:
    """Whether ``exc`` is ENOSPC on a file system that has no inodes left for ``folder``
    (:func:`no_free_inodes`)."""
    return exc.errno == errno.ENOSPC and no_free_inodes(folder)


def no_free_inodes(folder: Path) -> bool:
    """Whether the file system of ``folder`` (or its nearest existing parent) counts inodes and has
    none left; f_files 0 is one that counts none (btrfs)."""
    existing = _nearest_folder(folder)
    try:
        inodes = os.statvfs(existing)
    except (OSError, TypeError):
        return False
    return inodes.f_files > 0 and inodes.f_favail == 0


def _describe(exc: OSError, folder: Path, no_inodes: bool = False) -> str:
    """The reason of a failed write; for a full disk or a size limit, with the free space left on that
    file system (other reasons, e.g. a folder that refuses changes, say nothing of space);
    ``no_inodes`` (:func:`out_of_inodes`, asked before the partial output was removed): says that
    the file system ran out of inodes instead."""
    reason = exc.strerror or str(exc)
    # ENOSPC / EFBIG / EDQUOT from the OS, or a short write reported without an errno (numpy's
    # tofile: "8192 requested and 6144 written")
    short = isinstance(exc, BlockingIOError) or (exc.errno is None and "written" in reason)
    if no_inodes:
        return reason + ": the file system has no free inodes left (`df -i` shows them), whatever space it has"
    if short or exc.errno in _NO_ROOM:
        existing = _nearest_folder(folder)
        # "or its inodes": a library that removed its own partial file before this was asked gave them back
        reason += ": the disk (or its inodes) is full, or a file-size limit was reached"
        with contextlib.suppress(OSError, TypeError):
            # asked after the partial output was deleted, so that "disk full" beside the free space it
            # reports does not read as a contradiction
            reason += f"; {shutil.disk_usage(existing).free:,} bytes free there once the partial output was removed"
    elif exc.filename:
        reason += f" ({exc.filename})"
    return reason
