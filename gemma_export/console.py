"""The ``gemma-export`` command's entry point (``[project.scripts]``, and ``python -m gemma_export``).

It wraps :data:`gemma_export.cli.app` for what happens outside any one command, and imports nothing
heavy itself:

- Ctrl-C, SIGTERM or SIGHUP while the libraries load (numpy, ml_dtypes, onnx, and each command's own
  imports: about half a second, before any file is written) ends with ``error: interrupted`` and
  exit status 130, 143 or 129, not a traceback or numpy's "ImportError: ... failed to import" that
  the interrupted import turns into. Each command's body (``cli._reported``) takes the signals back
  (:func:`interrupts_raised`) before it writes anything, and cleans up as before.
- Standard output or standard error that cannot be written (``> /dev/full``, a full disk, a closed
  descriptor) ends the command with ``error: cannot write to standard output: <reason>`` (shown
  when standard error still works) and exit status 2. What the command wrote to disk is whole or
  absent: writers stage their output, and one stopped this way cleans up as on any error.
- A reader that goes away (``| head``, ``2>&1 | head``) ends the command quietly with exit status
  141 (128 + SIGPIPE, as a shell tool killed by the signal) when a write finds it gone. Output that
  the reader stopped taking in the middle of one large write can end with status 0 instead: Python
  reports that write as complete.
- Once the command has ended, Ctrl-C, SIGTERM and SIGHUP are ignored: the exit status is the command's
  (a signal while Python unwound the command's exit gave a traceback and status 1).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from typing import Iterator

from .errors import GemmaExportError, out_of_memory_line

#: exit status when the reader of standard output or error has gone (128 + SIGPIPE), as for a shell tool
PIPE_CLOSED_EXIT = 128 + 13


#: signals that end a command as Ctrl-C does, with the same clean-up: SIGTERM (``kill``, a timeout)
#: and SIGHUP (the terminal or SSH session closed); an export stopped by either left its staging
#: folder when SIGHUP kept its default
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (:data:`TERMINATING_SIGNALS`), raised where Ctrl-C would be so that the
    same clean-up runs; exits 128 + the signal's number (143, 129)."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


def interrupt_exit_status(exc: KeyboardInterrupt) -> int:
    """The shell's exit status for an interrupt: 128 + the signal's number (130 for Ctrl-C)."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else signal.SIGINT)


class StreamError(GemmaExportError):
    """Standard output or error cannot be written (disk full, device error, closed); exits 2."""


class StreamClosed(GemmaExportError):
    """The reader of standard output or error has gone (EPIPE); ends the command without a message,
    exit 141."""

    exit_code = PIPE_CLOSED_EXIT


_NAMES = {1: "standard output", 2: "standard error"}


class _CheckedStream:
    """``sys.stdout`` / ``sys.stderr`` with write errors raised as :class:`StreamError` /
    :class:`StreamClosed` (toolkit errors, so each command ends through its usual path and writers
    clean up). ``stream`` None stands for a descriptor closed when the process started."""

    def __init__(self, stream, fd: int) -> None:
        self._stream = stream
        self._fd = fd
        self.failed = False

    def _error(self, exc: OSError | None) -> GemmaExportError:
        self.failed = True
        if exc is not None and exc.errno == errno.EPIPE:
            return StreamClosed(f"{_NAMES[self._fd]} closed by its reader")
        reason = "it is closed" if exc is None else exc.strerror or str(exc)
        return StreamError(f"cannot write to {_NAMES[self._fd]}: {reason}")

    def write(self, text):
        if self._stream is None:
            if not text:
                return 0
            raise self._error(None)
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._error(exc) from None

    def flush(self) -> None:
        if self._stream is None:
            return
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._error(exc) from None

    def isatty(self) -> bool:
        return self._stream is not None and self._stream.isatty()

    def discard(self) -> None:
        """Point the descriptor at ``/dev/null``, so that what is still buffered goes there when
        Python flushes at exit instead of failing again with a traceback."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._fd)
            os.close(devnull)
        except OSError:
            pass

    def __getattr__(self, name):  # encoding, errors, fileno, buffer, ... as the stream has them
        if self._stream is None:
            if name in ("encoding", "errors"):
                return "utf-8" if name == "encoding" else "strict"
            raise AttributeError(name)
        return getattr(self._stream, name)


def _say_interrupted() -> None:
    """``error: interrupted`` on descriptor 2 directly (no Python stream, which may be mid-write);
    a failure to write it is left to the exit status."""
    try:
        os.write(2, b"error: interrupted\n")
    except OSError:
        pass


def _interrupted_while_loading(signum, _frame) -> None:
    # nothing has been written yet: say so and leave at once (a KeyboardInterrupt here would
    # surface as a traceback or as the ImportError of whichever library was loading)
    _say_interrupted()
    os._exit(128 + signum)


def _raise_terminated(signum, _frame) -> None:
    raise Terminated(signum)


def _ignore_interrupts() -> None:
    """SIGINT, SIGTERM and SIGHUP ignored from here on (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
            signal.signal(sig, signal.SIG_IGN)


def main() -> None:
    """Run the command line (``sys.argv``); see the module docstring for what it adds.

    Raises:
        SystemExit: always, with the command's exit status (0 success, 2 a reported error, 130
            Ctrl-C, 143 SIGTERM, 141 standard output or error closed by its reader).
    """
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored one stays ignored
            signal.signal(signal.SIGINT, _interrupted_while_loading)
        for sig in TERMINATING_SIGNALS:
            if signal.getsignal(sig) == signal.SIG_DFL:  # nohup's ignored SIGHUP stays ignored
                signal.signal(sig, _interrupted_while_loading)
    streams = [_CheckedStream(sys.stdout, 1), _CheckedStream(sys.stderr, 2)]
    sys.stdout, sys.stderr = streams
    try:
        try:
            from .cli import app

            app()
        finally:
            _ignore_interrupts()  # the command has ended, however it ended
    except KeyboardInterrupt as exc:  # one that landed as the command ended, before they were ignored
        _ignore_interrupts()  # a second one (a double press) as this process ends is ignored too
        _say_interrupted()
        raise SystemExit(interrupt_exit_status(exc)) from None
    except StreamClosed:
        raise SystemExit(PIPE_CLOSED_EXIT) from None
    except StreamError as exc:  # raised outside a command's body (e.g. --version, verify's result line)
        try:
            sys.stderr.write(f"error: {exc}\n")
            sys.stderr.flush()
        except GemmaExportError:  # standard error is the one that failed
            pass
        raise SystemExit(exc.exit_code) from None
    except Exception as exc:  # out of memory outside a command's body (importing a library, a note after the work)
        if "--debug" in sys.argv[1:] or (line := out_of_memory_line(exc)) is None:
            raise
        with contextlib.suppress(GemmaExportError):
            sys.stderr.write(f"error: {line}\n")
            sys.stderr.flush()
        raise SystemExit(2) from None
    finally:
        for stream in streams:
            if stream.failed:
                stream.discard()


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """Inside, Ctrl-C raises KeyboardInterrupt and SIGTERM :class:`Terminated` (a command's body
    handles both and cleans up what it was writing); :func:`main` made them end the process at once
    while the libraries loaded, and the command's last lines keep the raising handlers. Where no
    :func:`main` ran (the Python API, ``CliRunner``), SIGTERM's default comes back on leaving: the
    host process keeps its own handling. A signal the caller ignores (``nohup``, ``trap '' INT``)
    stays ignored. Only in the main thread (elsewhere Python refuses handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGINT) is _interrupted_while_loading:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    embedded = [sig for sig in TERMINATING_SIGNALS if signal.getsignal(sig) == signal.SIG_DFL]
    for sig in TERMINATING_SIGNALS:
        if sig in embedded or signal.getsignal(sig) is _interrupted_while_loading:
            signal.signal(sig, _raise_terminated)
    try:
        yield
    finally:
        for sig in embedded:
            if signal.getsignal(sig) is _raise_terminated:
                signal.signal(sig, signal.SIG_DFL)
