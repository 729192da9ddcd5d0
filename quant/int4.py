"""Block-wise 4-bit weights in the layout onnxruntime's ``MatMulNBits`` (bits=4) reads.

For a weight ``W[N, K]`` (``[out_features, in_features]``, or the ``[vocab, hidden]`` table) and a
block size ``B`` dividing ``K`` (each block ``w`` = ``W[n, jB:(j+1)B]``):

symmetric (zero point fixed at 8, onnxruntime's default for 4 bits, so none is stored)::

    m      = the element of w with the largest magnitude (signed)
    scale  = c * m / -8            c: clipping ratio, 1 for round-to-nearest
    q      = clip(round_half_even(w / scale), -8, 7);  stored q + 8

asymmetric (a 4-bit zero point per block; the range always includes 0, so zero stays exact)::

    lo, hi = c * min(min(w), 0), c * max(max(w), 0)
    scale  = (hi - lo) / 15
    zp     = clip(round_half_even(-lo / scale), 0, 15)
    q      = clip(round_half_even(w / scale) + zp, 0, 15)

Packing (MatMulNBits ``B``, ``zero_points``): two codes per byte along K, the even index in the low
nibble; ``data`` is uint8 ``[N, K/B, B/2]``, packed zero points uint8 ``[N, ceil((K/B)/2)]``.

Scale choice (``method``): ``"rtn"`` uses c = 1 (round to nearest, the anchors' scheme);
``"mse"`` searches c over ``CLIP_RATIOS`` per block and keeps the one with the least squared
reconstruction error ``sum_i h_i (w_i - dequant(q)_i)^2`` (``h`` = per-input-channel weights such
as the mean squared calibration activation, or ones) — a grid search over clipping ratios, as
AWQ's weight clipping (Lin et al. 2024, arXiv:2306.00978) searches shrink ratios of each group's
maximum; ``llama.cpp``'s ``make_qx_quants`` instead tries scales near the maximum in both
directions and refits each by weighted least squares. With c = 1 the symmetric scale is ggml
``Q4_0``'s (``max / -8``); the codes are rounded half to even, where ggml's
``quantize_row_q4_0_ref`` rounds half up (``(int8_t)(w / scale + 8.5f)``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .gptq import as_hessian, gptq_codes
from .rows import as_weight, block_count, block_rows, check_layout, check_real, is_integer, row_chunks
from .scales import SCALE_METHODS, Float16RangeError, check_scale_dtype, on_float16_grid

ZERO_POINT = 8
#: clipping ratios ``c`` the ``"mse"`` search tries: 1.0 down to 0.6 in 17 steps of 0.025 (its cost
#: grows with their count; on the real 270M the search gives 17% lower KL than round to nearest at the
#: same size, docs/quality.md)
CLIP_RATIOS = tuple(np.round(np.linspace(1.0, 0.6, 17), 4))
#: rows quantized at a time: half int8's, since each ratio of the clipping search forms the
#: chunk's levels and errors beside it in float32 (a bound on memory, not a tuned speed)
_ROWS_PER_CHUNK = 4096


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack two 4-bit codes per byte in ``MatMulNBits``' order: the even index in the low nibble
    (onnxruntime's contrib operator spec, docs/ContribOperators.md, ``com.microsoft.MatMulNBits``).

    Args:
        codes: integers ``[..., M]``, ``M`` even, every value in [0, 15].

    Returns:
        uint8 ``[..., M // 2]``: ``codes[..., 2i] | codes[..., 2i + 1] << 4``.

    Raises:
        ValueError: codes that are not integers, an odd ``M``, or a code outside [0, 15] (it would
            spill into its neighbour's nibble).
    """
    codes = np.asarray(codes)
    if codes.dtype.kind not in "iu":  # not np.integer: numpy counts timedelta64 among those
        raise ValueError(f"expected integer 4-bit codes, found dtype {codes.dtype}")
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"expected an even number of 4-bit codes along the last axis, found shape {codes.shape}")
    if codes.size and (codes.min() < 0 or codes.max() > 15):
        raise ValueError(f"expected 4-bit codes in [0, 15], found values from {codes.min()} to {codes.max()}")
    codes = codes.astype(np.uint8, copy=False)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of :func:`pack_nibbles`: uint8 ``[..., M]`` → uint8 ``[..., 2M]``.

    Raises:
        ValueError: ``packed`` is not uint8 (wider integers would lose their high bits unseen), or is
            a scalar.
    """
    packed = np.asarray(packed)
    if packed.dtype != np.uint8 or packed.ndim == 0:
        raise ValueError(f"expected packed 4-bit codes as a uint8 array [..., M], found dtype {packed.dtype} "
                         f"and shape {packed.shape}")
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def _block_extremes(blocks: np.ndarray, symmetric: bool):
    """What the scale of each block scales with, independent of the clipping ratio: the signed
    element of largest magnitude ``[R, nb]`` (symmetric), or ``(min(w), max(w))`` (asymmetric)."""
    if symmetric:
        idx = np.abs(blocks).argmax(axis=2)[..., None]
        return np.take_along_axis(blocks, idx, axis=2)[..., 0]
    return blocks.min(axis=2), blocks.max(axis=2)


def _scales(extremes, symmetric: bool, ratio: float | np.ndarray, float16: bool = False):
    """Per-block (scale float32 ``[R, nb]``, zero point ``[R, nb]`` as floats) for one clipping ratio;
    with ``float16`` each scale on float16's grid, magnitude rounded up (``quant/scales.py``), and
    the zero point chosen for that scale."""
    if symmetric:
        scale = (ratio * extremes / -8.0).astype(np.float32)
        scale[scale == 0] = 1.0  # an all-zero block quantizes to zeros
        return on_float16_grid(scale) if float16 else scale, np.full(scale.shape, float(ZERO_POINT))
    # in float64: hi - lo of a float32 block can exceed float32's range (e.g. -3e38 and 3e38)
    lo = np.minimum(extremes[0], 0.0).astype(np.float64) * ratio
    hi = np.maximum(extremes[1], 0.0).astype(np.float64) * ratio
    scale = ((hi - lo) / 15.0).astype(np.float32)
    scale[scale == 0] = 1.0
    if float16:
        scale = on_float16_grid(scale)
    return scale, np.clip(np.rint(-lo / scale), 0, 15)


def _levels(blocks: np.ndarray, scale: np.ndarray, zp: np.ndarray, symmetric: bool) -> np.ndarray:
    """Codes minus zero point, float32 ``[R, nb, B]``: ``clip(round(w / scale) + zp, 0, 15) − zp``."""
    if symmetric:
        q = np.rint(blocks / scale[..., None])
        return np.clip(q, -8, 7, out=q)
    zp = zp.astype(np.float32)[..., None]  # small integers: exact in float32, as the codes are
    q = np.rint(blocks / scale[..., None])
    q += zp
    np.clip(q, 0, 15, out=q)
    q -= zp
    return q


def _codes(blocks, scale, zp, symmetric: bool) -> np.ndarray:
    return (_levels(blocks, scale, zp, symmetric) + zp[..., None]).astype(np.uint8)


def _dequantize_codes(codes, scale, zp):
    return (codes.astype(np.float32) - zp[..., None].astype(np.float32)) * scale[..., None]


def _channel_weights(channel_weights, k: int) -> np.ndarray:
    """``channel_weights`` as float32 ``[K]``, refused by name unless ``k`` real values ≥ 0 that are
    finite in float32 (a 1e300 is named as given, not as the Inf it would become)."""
    given = np.asarray(channel_weights)
    try:
        check_real(given)
    except ValueError as error:
        raise ValueError(f"channel_weights: {error}") from None
    if given.shape != (k,):
        raise ValueError(f"channel_weights must be {k} finite values >= 0, found shape {given.shape}")
    with np.errstate(over="ignore"):
        h = given.astype(np.float32)
    bad = ~(np.isfinite(h) & (h >= 0))
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        beyond = " (beyond float32's range)" if np.isfinite(given[index]) and given[index] >= 0 else ""
        raise ValueError(f"channel_weights must be {k} finite values >= 0, found {given[index]} at index "
                         f"{index}{beyond}")
    return h


def _search_scales(blocks: np.ndarray, symmetric: bool, ratios, h, float16: bool = False):
    """The clipping search: per block, the (scale, zero point) of ``ratios`` with the least
    :func:`_error`; ties keep the earlier ratio. The block extremes are found once, and only the
    winning ratio's codes are formed (the error of each candidate comes from its levels). A block
    whose squared error overflows float32 (values near 1e19 and beyond) has an infinite error under
    every ratio, and keeps the first."""
    extremes = _block_extremes(blocks, symmetric)
    best_scale, best_zp = _scales(extremes, symmetric, ratios[0], float16)
    if len(ratios) == 1:
        return best_scale, best_zp
    with np.errstate(over="ignore"):
        best_err = _error(blocks, _levels(blocks, best_scale, best_zp, symmetric), best_scale, h)
        for ratio in ratios[1:]:
            scale, zp = _scales(extremes, symmetric, ratio, float16)
            err = _error(blocks, _levels(blocks, scale, zp, symmetric), scale, h)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_scale = np.where(better, scale, best_scale)
            best_zp = np.where(better, zp, best_zp)
    return best_scale, best_zp


@dataclasses.dataclass(frozen=True)
class BlockInt4Weights:
    """Block-quantized 4-bit weights.

    Attributes:
        data: uint8 ``[N, K // block_size, block_size // 2]`` (two codes per byte, MatMulNBits' ``B``).
        scales: float32 ``[N, K // block_size]``.
        zero_points: uint8 ``[N, ceil((K // block_size) / 2)]`` packed, or None (symmetric: 8).
        block_size: elements per block along K.

    Raises:
        ValueError: when built, a field of another dtype or shape than these (the arrays' shapes
            must agree with each other and with ``block_size``).
    """

    data: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    block_size: int

    def __post_init__(self) -> None:
        """Raises ValueError unless the fields have the layout above (:func:`quant.rows.check_layout`;
        unpacked zero points, one byte a block, dequantized to other values without a word)."""
        n, nb = block_rows("BlockInt4Weights", self.data, "[N, K // block_size, block_size // 2]")
        half = self.block_size // 2 if is_integer(self.block_size) else 0
        arrays = {"data": (self.data, np.uint8, (n, nb, half)), "scales": (self.scales, np.float32, (n, nb))}
        if self.zero_points is not None:
            arrays["zero_points"] = (self.zero_points, np.uint8, (n, (nb + 1) // 2))
        check_layout("BlockInt4Weights", arrays, self.block_size)
        if self.block_size % 2:
            raise ValueError(f"BlockInt4Weights: block_size must be even (two codes a byte), found {self.block_size}")

    @classmethod
    def quantize(cls, w, block_size: int, symmetric: bool = True, method: str = "mse",
                 channel_weights: np.ndarray | None = None, hessian=None,
                 scale_dtype: str = "float32") -> "BlockInt4Weights":
        """Quantize a float ``[N, K]`` matrix (an array or row-sliceable object), row chunk by chunk.

        The formulas (symmetric, asymmetric, the clipping search) are in the module docstring: the
        symmetric scale is ggml ``Q4_0``'s (llama.cpp ``ggml-quants.c``), the search a grid over
        clipping ratios as AWQ's; the layout is ``MatMulNBits``' (onnxruntime
        docs/ContribOperators.md).

        Args:
            w: float ``[N, K]`` (PyTorch ``[out_features, in_features]``, or the ``[vocab, hidden]``
                table), any float dtype; read as float32 4,096 rows at a time.
            block_size: even, divides K. onnxruntime's ``MatMulNBits`` and ``GatherBlockQuantized``
                run powers of two >= 16 only; the exporter refuses others (``--block-size``), the
                round trip here takes any.
            symmetric: fixed zero point 8 (True) or a stored 4-bit zero point per block.
            method: ``"rtn"`` (clipping ratio 1) or ``"mse"`` (least weighted squared error over
                ``CLIP_RATIOS``).
            channel_weights: float ``[K]`` ≥ 0 weighting each input channel's error (``"mse"`` only;
                default: the diagonal of ``hessian`` when given).
            hessian: ``[K, K]``, ``Xᵀ X`` of calibration inputs (or a :class:`quant.gptq.Hessian`): the scales (and zero points) are
                chosen as above, then the codes by :func:`quant.gptq.gptq_codes`.
            scale_dtype: ``"float32"``, or ``"float16"``: every candidate scale is moved to float16's
                grid, magnitude rounded up (``quant/scales.py``), before its zero point, its error in
                the search and the codes are computed, so ``scales.astype(float16)`` stores it exactly.

        Returns:
            A :class:`BlockInt4Weights`: ``data`` uint8 ``[N, K // block_size, block_size // 2]``,
            ``scales`` float32 ``[N, K // block_size]``, ``zero_points`` uint8
            ``[N, ceil((K // block_size) / 2)]`` (None when ``symmetric``).

        Raises:
            ValueError: ``w`` not 2-D or without rows or columns, ``block_size`` not an integer, odd, or not
                dividing K, ``symmetric`` not a bool, unknown ``method`` or ``scale_dtype``, a scale
                beyond float16's range with ``"float16"``, bad ``channel_weights`` (or any with
                ``"rtn"``), NaN/Inf, a
                float64 beyond float32's range or values that are not real numbers in ``w``
                (:func:`quant.rows.float_rows`, index named); with ``hessian``: a shape other than
                ``[K, K]``, NaN or Inf in it, or a matrix :func:`quant.gptq.inverse_cholesky` cannot
                factor.
        """
        w = as_weight(w)
        nb = block_count(w.shape, block_size, even=True)
        if not isinstance(symmetric, (bool, np.bool_)):  # "no" would be true
            raise ValueError(f"symmetric must be True or False, found {symmetric!r}")
        if method not in SCALE_METHODS:
            raise ValueError(f"method must be one of {', '.join(SCALE_METHODS)}, found {method!r}")
        check_scale_dtype(scale_dtype)
        if channel_weights is not None and method == "rtn":  # it would be taken and not used
            raise ValueError("channel_weights weight the error of the clipping search (method 'mse'); method 'rtn' "
                             "searches nothing")
        n, k = w.shape
        h = None
        if hessian is not None:
            hessian = as_hessian(hessian)  # a nested list too; gptq_codes below takes the same object
        if channel_weights is None and hessian is not None and hessian.shape == (k, k):
            if not np.isfinite(hessian.matrix).all():  # named as the Hessian, not as the channel weights taken from it
                raise ValueError("the Hessian holds NaN or Inf")
            channel_weights = np.maximum(np.diagonal(hessian.matrix), 0.0)
        if channel_weights is not None:
            h = _channel_weights(channel_weights, k).reshape(nb, block_size)
        # With a Hessian only the scales (and zero points) come from this pass; GPTQ writes the codes.
        data = np.empty((n, nb, block_size // 2), np.uint8) if hessian is None else None
        scales = np.empty((n, nb), np.float32)
        zps = np.empty((n, nb), np.uint8)
        ratios = CLIP_RATIOS if method == "mse" else CLIP_RATIOS[:1]
        for start, rows in row_chunks(w, _ROWS_PER_CHUNK):
            blocks = rows.reshape(-1, nb, block_size)
            try:
                best_scale, best_zp = _search_scales(blocks, symmetric, ratios, h, scale_dtype == "float16")
            except Float16RangeError as exc:  # the index in the whole weight, not in the chunk
                raise exc.at_row(start) from None
            end = start + len(blocks)
            if data is not None:
                data[start:end] = pack_nibbles(_codes(blocks, best_scale, best_zp, symmetric))
            scales[start:end] = best_scale
            zps[start:end] = best_zp
        if hessian is not None:
            codes = gptq_codes(w, hessian, scales, zps.astype(np.float32), block_size, 0, 15)
            data = pack_nibbles(codes.reshape(n, nb, block_size))
        zero_points = None
        if not symmetric:
            padded = np.zeros((n, nb + nb % 2), np.uint8)
            padded[:, :nb] = zps
            zero_points = pack_nibbles(padded)
        return cls(data=data, scales=scales, zero_points=zero_points, block_size=block_size)

    def unpacked_zero_points(self) -> np.ndarray:
        """uint8 ``[N, K // block_size]`` (8 everywhere when symmetric)."""
        if self.zero_points is None:
            return np.full(self.scales.shape, ZERO_POINT, np.uint8)
        return unpack_nibbles(self.zero_points)[:, : self.scales.shape[1]]

    def dequantize(self) -> np.ndarray:
        """float32 ``[N, K]``: ``(code - zero_point) * scale`` per block."""
        n, nb, _ = self.data.shape
        return _dequantize_codes(unpack_nibbles(self.data), self.scales, self.unpacked_zero_points()).reshape(n, -1)


def _error(blocks, levels, scale, h):
    """Per block ``sum_i h_i (w_i − level_i · scale)²`` ``[R, nb]`` (``h`` None: ones)."""
    diff = blocks - levels * scale[..., None]
    diff *= diff
    if h is not None:
        diff *= h
    return diff.sum(axis=2)
