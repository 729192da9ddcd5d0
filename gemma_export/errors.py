"""The toolkit's error hierarchy.

Every error raised on bad input is a :class:`GemmaExportError`; the CLI prints its message on one
line and exits with status 2. Messages name the file, the tensor or field, what was expected and
what was found.
"""

from __future__ import annotations

import errno
import json
import numbers
import os
import re
from pathlib import Path


def shown(value, limit: int = 60) -> str:
    """A value from a user's JSON file (or a GGUF's metadata) for an error message, as JSON writes it
    (``true``, ``null``, ``"text"``, ``[1, 2]``), cut to ``limit`` characters."""
    if isinstance(value, (list, tuple)) and len(value) > limit:  # a GGUF array may hold 2**26 items: only
        value = list(value[:limit])  # what the cut text can show is written (each item takes >= 3 characters)
    text = json.dumps(value, default=lambda v: _json_plain(v, limit))
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _json_plain(value, limit: int):
    """A value JSON cannot write, as it would be written: numpy arrays (their first ``limit`` items)
    and scalars (GGUF metadata) as lists and numbers (``[1, 2]``, not ``"[1 2]"``), anything else as
    its text."""
    if hasattr(value, "ravel") and getattr(value, "ndim", 0) > 0:
        return value.ravel()[:limit].tolist()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def is_whole_number(value) -> bool:
    """A JSON number read as a Python ``int``, not ``true``/``false`` (which Python's ``bool`` also is)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_sha256(value) -> bool:
    """A sha256 as the manifests record it: a string of 64 lowercase hex digits (``sha256sum``'s form)."""
    return isinstance(value, str) and re.fullmatch("[0-9a-f]{64}", value) is not None


def shown_folder(folder: Path) -> Path:
    """``folder`` for a message: its full path when it is the current folder, whose files would
    otherwise be named bare ("manifest.json: missing")."""
    return folder.resolve() if str(folder) in (".", "") else folder


def printable_path(path) -> str:
    """A path for a message: bytes that are not UTF-8 (kept by Python as surrogates) shown as ``\\xNN``."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def check_utf8_path(path, what: str) -> None:
    """Refuse a path that is not valid UTF-8: the onnx checker and onnxruntime take UTF-8 paths only,
    so such a folder would fail deep inside them with a misleading message.

    Raises:
        GemmaExportError: naming the path (bytes shown as ``\\xNN``) and ``what`` it is.
    """
    try:
        os.fspath(path).encode("utf-8")
    except UnicodeEncodeError:
        raise GemmaExportError(f"{printable_path(path)}: the {what} path is not valid UTF-8, which onnx and onnxruntime "
                               "need; rename it") from None


#: the argument kinds of :func:`check_arguments`: kind → (test, what the message says is expected);
#: a kind ending in ``?`` also takes None
_ARGUMENT_KINDS = {
    "int": (is_whole_number, "an int"),
    "bool": (lambda v: isinstance(v, bool), "True or False"),
    "str": (lambda v: isinstance(v, str), "a str"),
    # an os.PathLike must give a str: pathlib refuses the bytes some give (TypeError deep inside)
    "path": (lambda v: (isinstance(v, str) and v != "" or isinstance(v, os.PathLike) and _fspath_is_str(v))
             and not _holds_nul(v), "a path (str or os.PathLike)"),
    "ints": (lambda v: isinstance(v, (list, tuple, range)) and all(map(is_whole_number, v)),
             "a list, tuple or range of ints"),
    # token ids: each id is checked against the vocabulary later (runtime.check_token_ids); a set or a
    # dict would be iterated in an order of its own, a generator used up
    "ids": (lambda v: _is_sequence(v, 1), "a sequence (list, tuple, 1-D array) of token ids"),
    # prompts of token ids (each row checked as "ids")
    "prompts": (lambda v: _is_sequence(v, 2), "a sequence (list, tuple, 2-D array) of prompts"),
    "callable": (callable, "a callable"),
}


def _fspath_is_str(value) -> bool:
    """Whether ``os.fspath(value)`` gives a str (an os.PathLike may give bytes, or raise)."""
    try:
        return isinstance(os.fspath(value), str)
    except TypeError:
        return False


def _is_sequence(value, ndim: int) -> bool:
    """A ``Sequence`` (list, tuple, range …; not a str or bytes) or an array (numpy, torch) of
    ``ndim`` dimensions: what an id list, or a list of them, may be."""
    import collections.abc

    if hasattr(value, "ndim") and hasattr(value, "__len__"):
        return value.ndim == ndim
    return isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes, bytearray))


def _found(value) -> str:
    """How :func:`check_arguments` shows a value it refuses: its type and a one-line, bounded repr
    (an array as its dtype and shape: numpy's repr spans lines)."""
    if isinstance(value, str) and value == "":
        return "an empty str"
    if hasattr(value, "dtype") and getattr(value, "ndim", 0) >= 1:  # an array, not a numpy scalar
        return f"{type(value).__name__} {value.dtype} {list(value.shape)}"
    return f"{type(value).__name__} {' '.join(repr(value).split()):.40}"


def _holds_nul(path) -> bool:
    """A path holding a NUL character, which no file system takes (``open`` raises ``ValueError``)."""
    name = os.fspath(path)
    return (b"\0" if isinstance(name, bytes) else "\0") in name


def _is_other_integer(value) -> bool:
    """An integer that is not a Python ``int`` (e.g. ``numpy.int64``)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (int, bool))


def check_arguments(function: str, **arguments: tuple[object, str]) -> None:
    """Refuse a Python caller's argument of the wrong type before it reaches a comparison or pathlib
    deep inside (``'>=' not supported between 'str' and 'int'``), or is taken for another value
    (``calibrate="no"`` is true, ``""`` is the current folder).

    Args:
        function: the API function, for the message (e.g. ``export``).
        arguments: name → ``(value, kind)``, kind one of ``int``, ``bool``, ``str``, ``path`` (not
            empty, no NUL character), ``ints`` (a list, tuple or range of ints), ``ids`` (a sequence or 1-D
            array; its ids are checked elsewhere), ``prompts`` (a sequence or 2-D array of them),
            ``callable``, each with a trailing ``?`` to allow None.

    Raises:
        ConfigError: ``"export(): block_size must be an int, found str '32'"``, the first that fails.
    """
    for name, (value, kind) in arguments.items():
        optional = kind.endswith("?")
        if optional and value is None:
            continue
        base = kind.rstrip("?")
        test, expected = _ARGUMENT_KINDS[base]
        if not test(value):
            found = _found(value)
            if base == "path" and isinstance(value, (str, os.PathLike)) and _holds_nul(value):
                found += " (a NUL character, which no path can hold)"
            elif base == "path" and isinstance(getattr(value, "out_dir", None), os.PathLike):
                found = f"{type(value).__name__} (pass its out_dir)"  # export()'s result for its folder
            if base == "bool" and type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
                # numpy's scalar bool (named bool in numpy 2), which is no Python bool
                found += f" (a numpy bool: pass bool({name}))"
            if base == "int" and _is_other_integer(value):
                found += f" (a numpy integer: pass int({name}))"  # it would reach the manifest's JSON as is
            elif base == "ints" and isinstance(value, (list, tuple)) and any(map(_is_other_integer, value)):
                found += f" (numpy integers: pass [int(i) for i in {name}])"
            elif base == "ints" and type(value).__name__ == "ndarray":
                found += f" (a numpy array: pass {name}.tolist())"
            if optional:
                expected = "True, False or None" if expected == "True or False" else f"{expected} or None"
            raise ConfigError(f"{function}(): {name} must be {expected}, found {found}")


def reworded(exc: "GemmaExportError", message: str) -> "GemmaExportError":
    """An error of ``exc``'s kind with ``message`` (e.g. ``exc``'s own with the option that gave the
    file added): the first class among ``exc``'s bases that this module defines, whose constructor
    takes the message alone (a subclass elsewhere, such as ``text_files.FileRefused``, takes more)."""
    kind = next(cls for cls in type(exc).__mro__ if cls.__module__ == __name__)
    return kind(message)


def out_of_memory(detail: str | None = None) -> str:
    """The one line for memory that ran out (Python's MemoryError, ENOMEM, onnxruntime's failed
    allocation): a step needed more than the machine, or a limit on the process, gives; ``detail``
    (the library's or the system's own words) in parentheses before the advice."""
    told = f" ({detail})" if detail else ""
    return (f"out of memory: a step needed more memory than this machine, or a limit on this process (ulimit -v), "
            f"gives{told}; rerun with --debug to see which step ran out")


#: what onnxruntime says when an allocation fails: ``std::bad_alloc`` (C++), or its CPU arena's
#: "Failed to allocate memory for requested buffer of size N" (BFCArena, onnxruntime 1.32)
_ALLOCATION_FAILED = ("std::bad_alloc", "failed to allocate memory for requested buffer")


def out_of_memory_line(exc: BaseException) -> str | None:
    """The one line for an exception that says memory ran out, or None for any other: Python's
    MemoryError (:func:`out_of_memory`), onnxruntime's failed allocations (that line with its first
    message line), and a shared library that could not be mapped while importing ("failed to map
    segment from shared object": an address-space limit, or a file system mounted ``noexec``,
    which glibc words alike). Only these phrases count: a message that merely holds "memory" (a
    path, glibc's "cannot allocate memory in static TLS block") is not taken for one."""
    if isinstance(exc, MemoryError):
        return out_of_memory()
    text = first_line(exc)
    if any(sign in text.lower() for sign in _ALLOCATION_FAILED):
        return out_of_memory(shown_error(exc))
    if isinstance(exc, ImportError) and "failed to map segment from shared object" in text:
        return (f"cannot load a library ({shown_error(exc)}): the process is out of address space (a limit set by "
                "ulimit -v), or the library's file system is mounted noexec")
    return None


def shown_error(exc: BaseException, limit: int = 200) -> str:
    """:func:`first_line` of ``exc``, cut to ``limit`` characters: a library's message quoted inside one of ours."""
    line = first_line(exc)
    return line if len(line) <= limit else line[:limit - 1] + "…"


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (onnxruntime's run a page long), or its type's name when
    it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def os_error_line(exc: OSError) -> str:
    """One line for an ``OSError`` that reached the command line (an input that cannot be read:
    permissions, an I/O error): the file and the system's reason."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.EACCES, errno.EPERM):
        reason += " (check the file's permissions)"
    named = isinstance(exc.filename, (str, bytes, os.PathLike))
    if exc.errno == errno.ENAMETOOLONG and named:  # the OS's bare reason names no limit
        reason += long_name_reason(os.fsdecode(exc.filename))
    return f"{printable_path(exc.filename)}: {reason}" if named else reason


def long_name_reason(path: str) -> str:
    """`` (a name of N bytes in it; this file system takes at most M)`` for the first name in
    ``path`` longer than its file system takes; `` (a path of N bytes)`` when every name fits (the
    whole path is then over ``PATH_MAX``)."""
    from .staging import too_long_name  # staging builds on this module

    if (found := too_long_name(path)) is None:
        return f" (a path of {len(os.fsencode(path)):,} bytes)"
    return f" (a name of {found[0]} bytes in it; this file system takes at most {found[1]})"


class GemmaExportError(Exception):
    """Base class of every error this toolkit raises on bad input or a failed check."""

    exit_code = 2


class FormatError(GemmaExportError):
    """A file is malformed: wrong magic, truncated data, a missing tensor, a wrong shape or dtype."""


class ConfigError(GemmaExportError):
    """A model configuration is missing a field, contradicts itself or names an unsupported model; or
    an argument (a command-line option, or its keyword in the Python API) has the wrong type, is out
    of range or conflicts with another."""


class NumericError(GemmaExportError):
    """A tensor holds values that cannot be exported (NaN, Inf)."""


class SourceNotFoundError(GemmaExportError):
    """The model source (a path or the bundled weights package) does not exist."""


class OutputError(GemmaExportError):
    """The output location cannot be written safely (inside the source, not a folder, ...)."""


class VerificationError(GemmaExportError):
    """A written artifact failed its check (ONNX checker, onnxruntime load, checksums)."""


class ResourceError(GemmaExportError):
    """Memory does not suffice: a measured figure exceeds the budget the user asked for, or what a
    step needs exceeds what the machine has (``MemAvailable``). Too little free disk is an
    :class:`OutputError`, raised before anything is written."""


class BudgetExceeded(ResourceError):
    """A measured model does not fit the board it was measured for: a verdict on the model, like
    parity's FAIL, so the CLI exits 1 (2 stays for bad input)."""

    exit_code = 1


class OutputWritten(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP (the ``__cause__``) once an output was moved into place: the output is
    complete, so the command must not say that nothing was written.

    Attributes:
        path: the output folder.
        what: what it is ("export", "bundle", ...).
    """

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(f"interrupted once the {what} {path} was in place")
        self.path = path
        self.what = what
