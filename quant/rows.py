"""Row chunks of a weight as float32, and the checks every block quantizer makes first."""

from __future__ import annotations

from typing import Iterator

import numpy as np


def first_non_finite(values: np.ndarray) -> tuple[int, ...] | None:
    """The index (C order) of the first NaN or ±Inf in ``values``, or None when all are finite."""
    finite = np.isfinite(values)
    if finite.all():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), finite.shape))


def block_count(shape: tuple[int, ...], block_size: int, even: bool = False) -> int:
    """Blocks per row, ``K // block_size``, of a weight ``[N, K]`` quantized in blocks along K.

    Args:
        shape: the weight's shape.
        block_size: elements per block; > 0, dividing K (and even when ``even``: two 4-bit codes
            share a byte).

    Raises:
        ValueError: ``shape`` is not 2-D, or ``block_size`` does not divide K (or is odd when ``even``).
    """
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D weight, found shape {tuple(shape)}")
    k = shape[1]
    if block_size <= 0 or k % block_size or (even and block_size % 2):
        raise ValueError(f"in_features {k} is not a multiple of {'the even ' if even else ''}block_size {block_size}")
    return k // block_size


def float_rows(w, start: int, count: int) -> np.ndarray:
    """``w[start:start + count]`` as float32 (``w``: an array or any row-sliceable object).

    Args:
        w: ``[N, K]``; the message's index assumes 2-D rows.
        start: first row.
        count: rows wanted; fewer come back at the end of ``w``.

    Returns:
        float32 ``[min(count, N - start), K]``.

    Raises:
        ValueError: a NaN or Inf, naming its value and ``(row, column)`` index in ``w``.
    """
    rows = np.asarray(w[start : start + count], dtype=np.float32)
    if (index := first_non_finite(rows)) is not None:
        r, c = index
        raise ValueError(f"holds {rows[r, c]} at index ({start + r}, {c})")
    return rows


def row_chunks(w, rows_per_chunk: int) -> Iterator[tuple[int, np.ndarray]]:
    """``(start, float_rows(w, start, rows_per_chunk))`` for every chunk of rows of ``w`` ``[N, K]``,
    in order: the float32 temporaries of a quantizer stay that small (the 262,144-row table in
    float32 is 671 MB for a hidden size of 640). Raises as :func:`float_rows`."""
    for start in range(0, w.shape[0], rows_per_chunk):
        yield start, float_rows(w, start, rows_per_chunk)
