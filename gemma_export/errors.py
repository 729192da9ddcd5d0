"""The toolkit's error hierarchy.

Every error raised on bad input is a :class:`GemmaExportError`; the CLI prints its message on one
line and exits with status 2. Messages name the file, the tensor or field, what was expected and
what was found.
"""

from __future__ import annotations

import json


def shown(value, limit: int = 60) -> str:
    """A value from a user's JSON file for an error message, as JSON writes it (``true``, ``null``,
    ``"text"``), cut to ``limit`` characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def is_whole_number(value) -> bool:
    """A JSON number read as a Python ``int``, not ``true``/``false`` (which Python's ``bool`` also is)."""
    return isinstance(value, int) and not isinstance(value, bool)


class GemmaExportError(Exception):
    """Base class of every error this toolkit raises on bad input or a failed check."""

    exit_code = 2


class FormatError(GemmaExportError):
    """A file is malformed: wrong magic, truncated data, a missing tensor, a wrong shape or dtype."""


class ConfigError(GemmaExportError):
    """A model configuration is missing a field, contradicts itself or names an unsupported model."""


class NumericError(GemmaExportError):
    """A tensor holds values that cannot be exported (NaN, Inf)."""


class SourceNotFoundError(GemmaExportError):
    """The model source (a path or the bundled weights package) does not exist."""


class OutputError(GemmaExportError):
    """The output location cannot be written safely (inside the source, not a folder, ...)."""


class VerificationError(GemmaExportError):
    """A written artifact failed its check (ONNX checker, onnxruntime load, checksums)."""


class ResourceError(GemmaExportError):
    """A measured resource (memory, disk) exceeds the budget the user asked for."""


class BudgetExceeded(ResourceError):
    """A measured model does not fit the board it was measured for: a verdict on the model, like
    parity's FAIL, so the CLI exits 1 (2 stays for bad input)."""

    exit_code = 1
