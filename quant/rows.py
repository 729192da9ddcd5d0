"""Row chunks of a weight as float32, with the one finiteness check every quantizer needs."""

from __future__ import annotations

import numpy as np


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
    finite = np.isfinite(rows)
    if not finite.all():
        r, c = np.unravel_index(int(np.argmin(finite)), rows.shape)
        raise ValueError(f"holds {rows[r, c]} at index ({start + int(r)}, {int(c)})")
    return rows
