"""The ``gemma-export`` command's entry point (``[project.scripts]``, and ``python -m gemma_export``).

It wraps :data:`gemma_export.cli.app` for what happens outside any one command, and imports nothing
heavy itself:

- Ctrl-C while the libraries load (numpy, ml_dtypes, onnx: about half a second, before any file is
  written) ends with ``error: interrupted`` and exit status 130, not a traceback or numpy's
  "ImportError: ... failed to import" that the interrupted import turns into. Each command's body
  (``cli._reported``) takes Ctrl-C back before it writes anything, and cleans up as before.
- Standard output that cannot be written (``> /dev/full``, a full disk, a closed terminal) ends with
  one line, ``error: cannot write to standard output: <reason>``, and exit status 2. What the command
  wrote to disk is unaffected: writers stage their output and either finish or leave nothing.
- A reader that stops early (``gemma-export inspect DIR | head``) ends the command quietly with exit
  status 141 (128 + SIGPIPE, as a shell tool killed by the signal), without the text that could not
  be delivered.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading

from .errors import GemmaExportError

#: exit status when the reader of standard output has gone (128 + SIGPIPE), as for a shell tool
PIPE_CLOSED_EXIT = 128 + 13


class StdoutError(GemmaExportError):
    """Standard output cannot be written (disk full, device error); exits 2 with one line."""


class StdoutClosed(GemmaExportError):
    """The reader of standard output has gone (EPIPE); ends the command without a message, exit 141."""

    exit_code = PIPE_CLOSED_EXIT


class _CheckedStdout:
    """``sys.stdout`` with its write errors raised as :class:`StdoutError` / :class:`StdoutClosed`
    (toolkit errors, so each command ends through its usual path and writers clean up)."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self.failed = False

    def _error(self, exc: OSError) -> GemmaExportError:
        self.failed = True
        if exc.errno == errno.EPIPE:
            return StdoutClosed("standard output closed by its reader")
        return StdoutError(f"cannot write to standard output: {exc.strerror or exc}")

    def write(self, text):
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise self._error(exc) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise self._error(exc) from None

    def discard(self) -> None:
        """Point fd 1 at ``/dev/null``, so that what is still buffered goes there when Python flushes
        at exit instead of failing again with a traceback."""
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer, ... as the stream has them
        return getattr(self._stream, name)


def _interrupted_while_loading(signum, _frame) -> None:
    # nothing has been written yet: say so and leave at once (a KeyboardInterrupt here would
    # surface as a traceback or as the ImportError of whichever library was loading)
    os.write(2, b"error: interrupted\n")
    os._exit(128 + signum)


def main() -> None:
    """Run the command line (``sys.argv``); see the module docstring for what it adds.

    Raises:
        SystemExit: always, with the command's exit status (0 success, 2 a reported error, 130
            Ctrl-C, 141 standard output closed by its reader).
    """
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not when ignored
        signal.signal(signal.SIGINT, _interrupted_while_loading)
    stdout = sys.stdout = _CheckedStdout(sys.stdout) if sys.stdout is not None else None
    try:
        from .cli import app

        app()
    except StdoutClosed:
        raise SystemExit(PIPE_CLOSED_EXIT) from None
    except StdoutError as exc:  # raised outside a command's body (e.g. --version, verify's result line)
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    finally:
        if stdout is not None and stdout.failed:
            stdout.discard()


def take_back_interrupts() -> None:
    """From here on Ctrl-C raises KeyboardInterrupt again (the command's body handles it and cleans
    up what it was writing); :func:`main` made it end the process at once while the libraries loaded."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is _interrupted_while_loading):
        signal.signal(signal.SIGINT, signal.default_int_handler)
