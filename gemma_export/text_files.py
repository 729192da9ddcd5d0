"""Reading the text files users pass (``--text``, ``--calibration-text``, ``--prompts``, ``--golden``)
with one set of one-line errors."""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path

from .errors import FormatError, SourceNotFoundError, long_name_reason

#: bytes of a --text or --calibration-text read at least (64 per token needed beyond that: real text
#: has ~4 per token), so that a huge file is not read whole for a prefix
TEXT_BYTES_READ = 1 << 20


def text_bytes_for(tokens: int) -> int:
    """How many bytes of a text file to read for its first ``tokens`` tokens:
    max(:data:`TEXT_BYTES_READ`, 64 × ``tokens``), ~16 times what real text needs."""
    return max(TEXT_BYTES_READ, 64 * tokens)


class FileRefused(FormatError):
    """:func:`read_bounded`'s refusal; ``reason`` is its message without the path, for callers that
    word it as part of their own ("unreadable manifest: ...")."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.reason = reason
#: the most bytes of a JSON file this toolkit reads whole: manifests, listings, configs, tokenizer side
#: files (the 270M's largest, tokenizer_config.json, is 1.2 MB; an export's manifest.json a few kB)
SMALL_FILE_BYTES = 64 << 20
#: the most bytes of a tokenizer file (tokenizer.json, tokenizer.model; Gemma 3's tokenizer.json is 33 MB)
TOKENIZER_FILE_BYTES = 1 << 30


def read_bounded(path: str | Path, what: str, max_bytes: int = SMALL_FILE_BYTES) -> bytes:
    """The bytes of a file that is read whole, refused first when it is not a regular file (a FIFO
    would block the read) or is larger than ``max_bytes`` (a damaged or foreign file would otherwise
    be read into memory: an 8 GB manifest.json was a MemoryError traceback). ``what`` names the
    expected file in errors (e.g. ``"a manifest"``).

    Raises:
        FileRefused: ``"{path}: is a folder; expected {what}"`` (a FIFO, a broken link likewise),
            ``"{path}: 8,589,934,592 bytes; expected {what} of at most 67,108,864"``.
        OSError: it cannot be read (permissions, an I/O error), or nothing is there.
    """
    p = Path(path)
    if (kind := non_regular(p)) is not None:
        raise FileRefused(p, f"is {kind}; expected {what}")
    with open(p, "rb") as f:  # the size read from the open file: no window for a swap in between
        size = os.fstat(f.fileno()).st_size
        check_size(p, size, what, max_bytes)
        # read(n) allocates n bytes first: the file's own size, not the limit (a 1 GiB buffer for a
        # 2 kB tokenizer.json was a MemoryError under a 1 GB address-space limit), then in steps
        # while it grows, up to one byte past the limit
        parts = [f.read(size + 1)]
        received = len(parts[0])
        while received > size and received <= max_bytes and (more := f.read(min(1 << 20, max_bytes + 1 - received))):
            parts.append(more)
            received += len(more)
        data = b"".join(parts)  # one part: that bytes object itself, no copy
    if len(data) > max_bytes:  # it grew while being read
        raise FileRefused(p, f"more than {max_bytes:,} bytes; expected {what} of at most {max_bytes:,}")
    return data


def check_size(path: Path, size: int, what: str, max_bytes: int) -> None:
    """Raises :class:`FileRefused` (``"{path}: N bytes; expected {what} of at most M"``) when ``size``
    is over ``max_bytes``: for files read whole by another library (tokenizers) as by :func:`read_bounded`."""
    if size > max_bytes:
        raise FileRefused(path, f"{size:,} bytes; expected {what} of at most {max_bytes:,}")


def non_regular(path: Path) -> str | None:
    """What ``path`` is when something other than a regular file (or a link to one) is there: ``"a
    folder"``, :func:`broken_link`'s words or ``"not a regular file (a FIFO, socket or device)"``; None when
    it is a regular file or nothing is there. A file a command reads only when present must not be
    taken for absent when it is one of these."""
    if path.is_file():
        return None
    if path.is_dir():
        return "a folder"
    if (link := broken_link(path)) is not None:
        return link
    return "not a regular file (a FIFO, socket or device)" if path.exists() else None


def broken_link(path: Path) -> str | None:
    """``"a broken link (to TARGET)"`` when ``path`` is a symbolic link to nothing, ``"a loop of
    symbolic links"`` when following it never ends, else None: named as such in errors, since "no
    such file" sends the user looking for a file they can see. A path the file system cannot even
    look up for its length (ENAMETOOLONG) gets its reason too, ``"File name too long (a name of N
    bytes in it; this file system takes at most M)"``, where pathlib would raise its OSError from
    every later check."""
    try:  # os.lstat, not Path.is_symlink: from Python 3.13 that returns False on every OSError
        if not stat.S_ISLNK(os.lstat(path).st_mode):
            return None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            return os.strerror(errno.ENAMETOOLONG) + long_name_reason(os.fsdecode(path))
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP):  # what pathlib took as "no"
            return None
        raise
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a loop of symbolic links"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"a broken link (to {os.readlink(path)})"
    return None


def require_file(path: str | Path, what: str) -> Path:
    """``path`` as a :class:`Path` when it is an existing regular file; ``what`` names it in errors
    (e.g. ``"MLIR file"``).

    Raises:
        SourceNotFoundError: ``"{path}: no such {what}"``, ``"{path}: is a folder; expected a
            {what}"``, ``"{path}: a broken link (to {target}); expected a {what}"`` or ``"{path}: not
            a regular file; expected a {what}"``.
    """
    p = Path(path)
    if (link := broken_link(p)) is not None:
        raise SourceNotFoundError(f"{p}: {link}; expected a {what}")
    if p.is_dir():
        raise SourceNotFoundError(f"{p}: is a folder; expected a {what}")
    if p.exists() and not p.is_file():
        raise SourceNotFoundError(f"{p}: not a regular file; expected a {what}")
    if not p.is_file():
        raise SourceNotFoundError(f"{p}: no such {what}")
    return p


def read_text_file(path: str | Path, what: str, max_bytes: int | None = None,
                   whole_limit: int | None = None) -> str:
    """A UTF-8 text file, without a leading byte-order mark (editors on Windows write one; it would
    otherwise become part of the first prompt); ``what`` names it in errors (e.g. ``"golden file"``).
    ``max_bytes``: read only that many bytes of a longer file (a character cut at the end is dropped),
    for callers that use only the text's first tokens; None: the whole file, refused first when it is
    larger than ``whole_limit`` (a JSON file of prompts or ids that cannot be read in part).

    Raises:
        SourceNotFoundError: as :func:`require_file`, or an OS error while reading (its reason).
        FormatError: ``"{path}: expected UTF-8 text, found byte 0x.. at offset N"``, a NUL
            character (binary data), or larger than ``whole_limit``.
    """
    p = require_file(path, what)
    return _without_nul(_read_text(p, what, max_bytes, whole_limit), p)


def _without_nul(text: str, name: str | Path) -> str:
    """``text``, refused (FormatError naming ``name``) when it holds a NUL: UTF-8, but binary data (a
    file of zeros passed for real text)."""
    if (at := text.find("\0")) != -1:
        raise FormatError(f"{name}: holds a NUL character at offset {at:,}; expected text, not binary data")
    return text


def read_standard_input(what: str, max_bytes: int = SMALL_FILE_BYTES) -> str:
    """Standard input, read to its end as UTF-8 text (a leading byte-order mark dropped), for a file
    option given as ``-``; ``what`` names it in errors (e.g. ``"prompt"``).

    Raises:
        FormatError: ``"standard input: expected UTF-8 text, found byte 0x.. at offset N"``, a NUL
            character, or more than ``max_bytes`` bytes.
        SourceNotFoundError: standard input is closed or cannot be read (its reason).
    """
    if sys.stdin is None:  # the process was started with standard input closed (`<&-`): no text, not ""
        raise SourceNotFoundError(f"standard input: closed, so there is no {what} to read (`-` reads the {what} from "
                                  "standard input: pipe or redirect it in)")
    try:
        data = sys.stdin.buffer.read(max_bytes + 1)
    except (OSError, ValueError) as exc:  # ValueError: a closed stream
        reason = getattr(exc, "strerror", None) or exc
        raise SourceNotFoundError(f"standard input: cannot read the {what}: {reason}") from None
    if len(data) > max_bytes:
        raise FormatError(f"standard input: more than {max_bytes:,} bytes; expected a {what} of at most {max_bytes:,}")
    return _without_nul(_decoded(data, "standard input"), "standard input")


def _decoded(data: bytes, name: str | Path) -> str:
    """``data`` as UTF-8 text without a leading byte-order mark; :func:`_not_utf8` naming ``name``."""
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise _not_utf8(name, exc) from None


def _not_utf8(name: str | Path, exc: UnicodeDecodeError) -> FormatError:
    return FormatError(f"{name}: expected UTF-8 text, found byte 0x{exc.object[exc.start]:02x} at offset {exc.start}")


def _read_text(p: Path, what: str, max_bytes: int | None, whole_limit: int | None) -> str:
    try:
        if max_bytes is None:
            if whole_limit is not None:
                return _decoded(read_bounded(p, f"a {what}", whole_limit), p)
            return p.read_text(encoding="utf-8").removeprefix("\ufeff")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
        if len(data) > max_bytes:  # a prefix: a multi-byte character cut at its end is dropped
            data = data[:max_bytes]
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as exc:
                if exc.reason == "unexpected end of data":
                    data = data[:exc.start]
        return _decoded(data, p)
    except UnicodeDecodeError as exc:  # read_text's
        raise _not_utf8(p, exc) from None
    except OSError as exc:
        raise SourceNotFoundError(f"{p}: cannot read the {what}: {exc.strerror or exc}") from None


def not_unicode_at(text: str) -> int | None:
    """The index of the first character of ``text`` that UTF-8 (and so a tokenizer) cannot encode, or
    None. Such characters are lone surrogates: bytes that were not UTF-8 arriving from argv, or
    JSON's ``\\uXXXX`` escapes (``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


#: characters left out at the end of a tokenized prefix: the last tokens of a cut text may differ
#: from the whole text's (a word cut in two), never those this far before the cut
PREFIX_MARGIN = 256


def first_tokens(tokenizer, text: str, count: int | None) -> list[int]:
    """The first ``count`` ids of ``tokenizer.encode(text)`` (all of them when ``count`` is None),
    tokenizing only as much of a long text as needed: prefixes of 8 characters per token, doubled
    until enough tokens end ``PREFIX_MARGIN`` characters before the cut."""
    size = max(8 * (count or 0), 4096)
    while count is not None and size < len(text):
        encoding = tokenizer.encode(text[:size])
        limit = size - PREFIX_MARGIN
        stable = next((i for i, (_, end) in enumerate(encoding.offsets) if end > limit), len(encoding.ids))
        if stable >= count:
            return list(encoding.ids[:count])
        size *= 2
    ids = tokenizer.encode(text).ids
    return list(ids if count is None else ids[:count])
