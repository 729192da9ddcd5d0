"""Symmetric block-wise int8 weights in the layout onnxruntime's ``MatMulNBits`` (bits=8) reads
(``GatherBlockQuantized`` with bits=8 accepts it too).

For a weight ``W[N, K]`` (PyTorch ``[out_features, in_features]``, or the ``[vocab, hidden]``
embedding table) and a block size ``B`` dividing ``K``:

    scale[n, j] = max(|W[n, jB:(j+1)B]|) / 127          (0 → 1, so an all-zero block stays zero)
    q[n, j, i]  = clip(round_half_even(W[n, jB+i] / scale[n, j]), -127, 127)
    stored      = q + 128 as uint8                       (onnxruntime's default zero point for
                                                          8 bits is 2 ** (bits - 1) = 128)

This is the per-row symmetric scheme of the reference archives (scale = max|row| / 127, clamp to
[-127, 127], round half to even) applied per block; with ``B == K`` it is exactly per-row.

Given the Hessian ``Xᵀ X`` of calibration inputs, the codes are chosen by GPTQ instead
(``quant/gptq.py``) with the same scales: same layout, less output error.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .gptq import gptq_codes
from .rows import as_weight, block_count, block_rows, check_layout, row_chunks
from .scales import Float16RangeError, check_scale_dtype, on_float16_grid

ZERO_POINT = 128
QMAX = 127
#: rows converted to float32 at a time: 8,192 rows of the 270M's 640-wide table are 21 MB, so the
#: 262,144-row table is never held in float32 whole (a bound on memory, not a tuned speed)
_ROWS_PER_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class BlockInt8Weights:
    """Block-quantized int8 weights.

    Attributes:
        data: uint8 ``[N, K // block_size, block_size]`` — ``q + 128``, MatMulNBits' ``B`` layout.
        scales: float32 ``[N, K // block_size]``.
        block_size: elements per block along K.

    Raises:
        ValueError: when built, a field of another dtype or shape than these (the arrays' shapes
            must agree with each other and with ``block_size``).
    """

    data: np.ndarray
    scales: np.ndarray
    block_size: int

    def __post_init__(self) -> None:
        """Raises ValueError unless the fields have the layout above (:func:`quant.rows.check_layout`)."""
        n, nb = block_rows("BlockInt8Weights", self.data, "[N, K // block_size, block_size]")
        check_layout("BlockInt8Weights", {"data": (self.data, np.uint8, (n, nb, self.block_size)),
                                          "scales": (self.scales, np.float32, (n, nb))}, self.block_size)

    @classmethod
    def quantize(cls, w: np.ndarray, block_size: int, hessian=None, scale_dtype: str = "float32") -> "BlockInt8Weights":
        """Quantize a float ``[N, K]`` matrix, row chunk by row chunk.

        ``w`` is a numpy array or any object with ``shape`` and row slicing (``w[a:b]`` returning an
        array), so a lazily dequantized source never needs to exist whole in float32. With
        ``hessian`` (``[K, K]``, ``Xᵀ X`` of calibration inputs, or a :class:`quant.gptq.Hessian`)
        the codes come from
        :func:`quant.gptq.gptq_codes` with the round-to-nearest scales.

        The formulas are in the module docstring (the reference archives' per-row symmetric scheme,
        per block); the layout and the zero point 128 are ``MatMulNBits``' with ``bits=8``
        (onnxruntime docs/ContribOperators.md, ``com.microsoft.MatMulNBits``).

        Args:
            w: float ``[N, K]``, any float dtype; read as float32 8,192 rows at a time.
            block_size: elements per scale along K; > 0 and dividing K. onnxruntime's ``MatMulNBits``
                runs powers of two >= 16 only; the exporter refuses others (``--block-size``), the
                round trip here takes any.
            hessian: None (round to nearest), or float ``[K, K]`` / :class:`quant.gptq.Hessian` (GPTQ codes,
                codes limited to [1, 255], i.e. q in [-127, 127]).
            scale_dtype: ``"float32"``, or ``"float16"``: each scale is first moved to float16's grid,
                magnitude rounded up (``quant/scales.py``), and the codes are chosen for that value,
                so ``scales.astype(float16)`` stores it exactly.

        Returns:
            A :class:`BlockInt8Weights`: ``data`` uint8 ``[N, K // block_size, block_size]``, ``scales``
            float32 ``[N, K // block_size]``.

        Raises:
            ValueError: ``w`` is not 2-D or has no rows or columns, ``block_size`` is not an integer or ``K``
                is not a multiple of it, ``w`` holds NaN or Inf, a float64 beyond float32's range or
                values that are not real numbers (:func:`quant.rows.float_rows`; callers name the
                tensor), an unknown ``scale_dtype``, a scale beyond
                float16's range with ``"float16"``, or an unusable ``hessian`` (not ``[K, K]``, not
                finite, or not factorable after damping: :func:`quant.gptq.inverse_cholesky`).
        """
        w = as_weight(w)
        nb = block_count(w.shape, block_size)
        check_scale_dtype(scale_dtype)
        n = w.shape[0]
        # With a Hessian only the scales come from this pass; GPTQ writes the codes.
        data = np.empty((n, nb, block_size), dtype=np.uint8) if hessian is None else None
        scales = np.empty((n, nb), dtype=np.float32)
        # Row chunks keep the float temporaries small (the 262,144-row table would need ~2 GB at once).
        for start, rows in row_chunks(w, _ROWS_PER_CHUNK):
            blocks = rows.reshape(-1, nb, block_size)
            s = np.abs(blocks).max(axis=2) / np.float32(QMAX)
            s[s == 0] = 1.0  # an all-zero block (or one whose scale underflows) quantizes to zeros
            if scale_dtype == "float16":
                try:
                    s = on_float16_grid(s)
                except Float16RangeError as exc:  # the index in the whole weight, not in the chunk
                    raise exc.at_row(start) from None
            scales[start : start + len(s)] = s
            if data is not None:
                q = np.rint(blocks / s[:, :, None])
                np.clip(q, -QMAX, QMAX, out=q)
                q += ZERO_POINT
                data[start : start + len(s)] = q
        if hessian is not None:
            codes = gptq_codes(w, hessian, scales, np.full(scales.shape, ZERO_POINT, np.float32), block_size,
                               ZERO_POINT - QMAX, ZERO_POINT + QMAX)
            data = codes.reshape(n, nb, block_size)
        return cls(data=data, scales=scales, block_size=block_size)

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``: ``(data - 128) * scale`` per block."""
        n, nb, b = self.data.shape
        q = self.data.astype(np.float32) - ZERO_POINT
        return (q * self.scales[:, :, None]).reshape(n, nb * b)
