"""bfloat16 storage: round float32 to nearest even, NaN preserved (as a quiet NaN).

bf16 here is a storage format only: onnxruntime's CPU provider has no bf16 arithmetic, so the graph
casts to float32 before compute.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from .rows import check_real


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16, nearest even.

    Args:
        x: float32 array of any shape (other real dtypes are converted to float32 first; a float64
            beyond float32's range becomes ±Inf there).
    Returns:
        uint16 array of the same shape holding the bfloat16 bit patterns.

    Raises:
        ValueError: ``x`` holds complex numbers or objects (:func:`quant.rows.check_real`).

    Rounding is ml_dtypes' float32 → bfloat16 cast (round half to even, NaN stays NaN, overflow
    to ±Inf like IEEE); :meth:`BF16Weights.quantize` refuses that overflow instead. Note: the board
    team's reference MLIR archives truncate instead (:func:`truncate_to_bfloat16_bits`).
    """
    x = np.asarray(x)
    check_real(x)
    with np.errstate(over="ignore"):  # the documented ±Inf
        x = x.astype(np.float32, copy=False)
    return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def truncate_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 → bfloat16 by dropping the low 16 bits (round toward zero), as the board team's
    reference archives store bf16 (their export's description).

    Args:
        x: array of any shape, converted to float32 first (a float64 beyond float32's range becomes
            ±Inf there).

    Returns:
        uint16 array of the same shape: the high 16 bits of each float32, except that a NaN stays a
        NaN (one whose payload lies only in the low bits would become ±Inf; it gets the quiet bit).

    Raises:
        ValueError: ``x`` holds complex numbers or objects (:func:`quant.rows.check_real`).
    """
    given = np.asarray(x)
    check_real(given)
    with np.errstate(over="ignore"):  # the documented ±Inf
        x = np.array(given, np.float32)  # a copy: 0-d stays 0-d (ascontiguousarray would make it 1-d)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), bits | np.uint16(0x0040), bits)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns → float32, same shape (exact: every bf16 value is a float32).

    Raises:
        ValueError: ``bits`` is not an integer array, or holds a value outside 0..65535 (a pattern
            numpy would wrap or truncate into another number), naming the first one.
    """
    given = np.asarray(bits)
    if given.dtype.kind not in "iu":
        raise ValueError(f"expected bfloat16 bit patterns as uint16, found {given.dtype}")
    if given.dtype != np.uint16 and given.size:
        outside = (given < 0) | (given > 0xFFFF)
        if outside.any():
            index = np.unravel_index(int(np.argmax(outside)), given.shape)
            raise ValueError(f"bfloat16 bit pattern {int(given[index])} at index {list(map(int, index))} "
                             f"is outside 0..65535")
    return given.astype(np.uint16, copy=False).view(ml_dtypes.bfloat16).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class BF16Weights:
    """A float32 tensor stored as bfloat16 bits (uint16, same shape)."""

    bits: np.ndarray

    @classmethod
    def quantize(cls, w: np.ndarray) -> "BF16Weights":
        """Round a float32 array to bfloat16 (:func:`float32_to_bfloat16_bits`).

        Args:
            w: array of any shape, converted to float32 first.

        Returns:
            A :class:`BF16Weights` whose ``bits`` are uint16, same shape as ``w``.

        Raises:
            ValueError: a finite value rounds to ±Inf (|w| above bfloat16's largest finite value,
                ~3.39e38), naming the first such value and its index; values that are not real
                numbers (:func:`quant.rows.check_real`).
        """
        given = np.asarray(w)
        check_real(given)
        with np.errstate(over="ignore"):  # a float64 beyond float32's range: named below
            w = given.astype(np.float32, copy=False)
        bits = float32_to_bfloat16_bits(w)
        overflow = np.isinf(bits.view(ml_dtypes.bfloat16)) & np.isfinite(given)
        if overflow.any():
            index = np.unravel_index(int(np.argmax(overflow)), w.shape)
            raise ValueError(f"{given[index]:.6g} at index {list(map(int, index))} overflows bfloat16 (largest finite "
                             f"{float(ml_dtypes.finfo(ml_dtypes.bfloat16).max):.6g})")
        return cls(bits)

    def dequantize(self) -> np.ndarray:
        """float32 array, same shape: exact widening of each bf16 value."""
        return bfloat16_bits_to_float32(self.bits)
