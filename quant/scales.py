"""Block scales stored as float16: values on float16's grid, rounded away from zero.

A block quantizer (``quant/int8.py``, ``quant/int4.py``) picks each block's scale in float32. To
store it as float16 (half the scales' bytes), the scale is first moved to a float16 value and the
codes are then chosen for that value, so the stored scale is exactly the one the codes were made
with. Rounding the magnitude up, never down, keeps every code inside its range: the block's largest
weight divided by a larger scale is still at most 127 (int8) or 8 (int4) steps.

float16 (IEEE 754 binary16): largest finite value 65504, smallest subnormal 2⁻²⁴ ≈ 6.0e-8, 11
significant bits, so a rounded scale is at most 2⁻¹⁰ (0.1%) larger than the chosen one for normal
values; a scale below float16's normal range (6.1e-5) is rounded up to a subnormal, coarser but
still no smaller than chosen.
"""

from __future__ import annotations

import numpy as np

#: ``--scale-dtype`` choices: how block scales are stored on disk
SCALE_DTYPES = ("float32", "float16")
#: ``--scale-method`` choices, how a block's scale is chosen (the ``method`` of
#: :meth:`quant.int4.BlockInt4Weights.quantize`): the clipping search (the default) and round to
#: nearest (clipping ratio 1). Here, beside ``SCALE_DTYPES``, because this module imports numpy only:
#: the CLI reads both without loading the quantizers or ml_dtypes
SCALE_METHODS = ("mse", "rtn")
FLOAT16_MAX = float(np.finfo(np.float16).max)


def check_scale_dtype(scale_dtype: str) -> None:
    """Raise ValueError unless ``scale_dtype`` is one of :data:`SCALE_DTYPES`."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, found {scale_dtype!r}")


class Float16RangeError(ValueError):
    """A block scale beyond float16's range: its value and its index ``(row, block)`` in the array given."""

    def __init__(self, value: float, index: tuple[int, ...]):
        self.value, self.index = value, index
        # 9 digits: a float32 just above 65504 (65504.004) must not read as 65504
        super().__init__(f"block scale {value:.9g} at {index} does not fit float16 (largest {FLOAT16_MAX:g})")

    def at_row(self, start: int) -> "Float16RangeError":
        """The same error for scales that were rows ``start`` on of a larger array (a row chunk)."""
        return Float16RangeError(self.value, (self.index[0] + start, *self.index[1:]))


def on_float16_grid(scales: np.ndarray) -> np.ndarray:
    """Each scale moved to the float16 value of equal or larger magnitude nearest to it.

    Args:
        scales: float32 array of any shape; finite (a block quantizer's scales).

    Returns:
        float32 array of the same shape whose values are all exactly representable in float16,
        with ``|result| >= |scales|`` and the same signs (a zero stays zero).

    Raises:
        Float16RangeError: (a ValueError) a scale's magnitude exceeds float16's largest value, 65504
            (weights beyond about 8.3 million at int8); the message gives the first such scale and
            its index.
    """
    s = np.asarray(scales, dtype=np.float32)
    too_large = ~(np.abs(s) <= FLOAT16_MAX)
    if too_large.any():
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(too_large)), s.shape))
        raise Float16RangeError(float(s[index]), index)
    half = s.astype(np.float16)
    short = np.abs(half.astype(np.float32)) < np.abs(s)
    half[short] = np.nextafter(half[short], np.copysign(np.float16(np.inf), s[short]).astype(np.float16))
    return half.astype(np.float32)
