"""Row chunks of a weight as float32, and the checks every block quantizer makes first."""

from __future__ import annotations

import numbers
from typing import Iterator

import ml_dtypes
import numpy as np


def first_non_finite(values: np.ndarray) -> tuple[int, ...] | None:
    """The index (C order) of the first NaN or ±Inf in ``values``, or None when all are finite."""
    finite = np.isfinite(values)
    if finite.all():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), finite.shape))


def check_real(values: np.ndarray) -> None:
    """Raises ValueError ``"expected real numbers, found complex64"`` unless ``values`` holds bools,
    integers or floats (numpy's, or ml_dtypes' such as bfloat16): numpy would drop complex numbers'
    imaginary parts with only a warning, and read ``None`` as NaN."""
    if values.dtype.kind in "biuf":
        return
    if values.dtype.kind == "V":  # bfloat16 and the float8 types (finfo takes complex too: not asked for it)
        try:
            ml_dtypes.finfo(values.dtype)
            return
        except (TypeError, ValueError):
            pass
    raise ValueError(f"expected real numbers, found {values.dtype}")


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool (sizes given as ``True`` or ``8.0`` are refused)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def block_count(shape: tuple[int, ...], block_size: int, even: bool = False) -> int:
    """Blocks per row, ``K // block_size``, of a weight ``[N, K]`` quantized in blocks along K.

    Args:
        shape: the weight's shape.
        block_size: elements per block; > 0, dividing K (and even when ``even``: two 4-bit codes
            share a byte).

    Raises:
        ValueError: ``shape`` is not 2-D or has no rows or columns, ``block_size`` is not an integer, or it
            does not divide K (or is odd when ``even``).
    """
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D weight, found shape {tuple(shape)}")
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"expected a 2-D weight with at least one row and one column, found shape {tuple(shape)}")
    if not is_integer(block_size):
        raise ValueError(f"block_size must be an integer, found {block_size!r}")
    k = shape[1]
    if block_size <= 0 or k % block_size or (even and block_size % 2):
        raise ValueError(f"in_features {k} is not a multiple of {'the even ' if even else ''}block_size {block_size}")
    return k // block_size


def as_weight(w):
    """``w`` itself when it has a ``shape`` (an array, or a lazy tensor read by row slices), else
    ``np.asarray(w)``: a nested list is a weight too, not an ``AttributeError``."""
    return w if hasattr(w, "shape") else np.asarray(w)


def float_rows(w, start: int, count: int) -> np.ndarray:
    """``w[start:start + count]`` as float32 (``w``: an array or any row-sliceable object).

    Args:
        w: ``[N, K]``; the message's index assumes 2-D rows.
        start: first row.
        count: rows wanted; fewer come back at the end of ``w``.

    Returns:
        float32 ``[min(count, N - start), K]``.

    Raises:
        ValueError: a NaN or Inf, or a finite value beyond float32's range (a float64 weight),
            naming its value and ``(row, column)`` index in ``w``; values that are not real numbers
            (complex, strings, objects).
    """
    given = np.asarray(w[start : start + count])
    check_real(given)
    with np.errstate(over="ignore"):
        rows = given.astype(np.float32, copy=False)
    if (index := first_non_finite(rows)) is not None:
        r, c = index
        beyond = " (beyond float32's range)" if np.isfinite(given[r, c]) else ""
        raise ValueError(f"holds {given[r, c]:.6g} at index ({start + r}, {c}){beyond}")
    return rows


def row_chunks(w, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, float_rows(w, start, rows_per_chunk))`` for every chunk of rows of ``w`` ``[N, K]``,
    in order: the float32 temporaries of a quantizer stay that small (the 262,144-row table in
    float32 is 671 MB for a hidden size of 640). Raises as :func:`float_rows`."""
    for start in range(0, w.shape[0], rows_per_chunk):
        yield start, float_rows(w, start, rows_per_chunk)


def _described(value) -> str:
    """``"uint8 [4, 2, 32]"`` for an array, the type's name for anything else."""
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, np.ndarray) else type(value).__name__


def block_rows(kind: str, data, layout: str) -> tuple[int, int]:
    """``(N, K // block_size)`` of the ``data`` field of a block-quantized weight built by hand, which
    must be a 3-D array (``layout`` names its axes in the message).

    Raises:
        ValueError: ``"BlockInt8Weights: data must be a uint8 array [N, K // block_size, block_size],
            found list"``.
    """
    if not (isinstance(data, np.ndarray) and data.ndim == 3):
        raise ValueError(f"{kind}: data must be a uint8 array {layout}, found {_described(data)}")
    return data.shape[0], data.shape[1]


def check_layout(kind: str, arrays: dict[str, tuple[object, object, tuple[int, ...]]], block_size) -> None:
    """Check the fields of a block-quantized weight built by hand: each of ``arrays`` (``name ->
    (value, dtype, shape)``) must be a numpy array of that dtype and shape; ``block_size`` an
    integer > 0. ``quantize`` builds them so; a hand-built one with a wrong layout dequantized to
    other values without a word.

    Raises:
        ValueError: ``"BlockInt8Weights: scales must be float32 [4, 2], found float64 [4, 2]"``.
    """
    if not is_integer(block_size) or block_size <= 0:
        raise ValueError(f"{kind}: block_size must be an integer > 0, found {block_size!r}")
    for name, (value, dtype, shape) in arrays.items():
        if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != shape:
            raise ValueError(f"{kind}: {name} must be {np.dtype(dtype)} {list(shape)}, found {_described(value)}")
