"""Error-compensating rounding (GPTQ) for block-quantized weights with fixed scales.

Round-to-nearest minimises each weight's own error; what matters is the error of the layer's
*output* on real inputs, ``‖(W − Ŵ) X‖²``. GPTQ (Frantar et al. 2022, arXiv:2210.17323, Algorithm 1)
rounds the input columns of ``W [N, K]`` one at a time and moves each column's rounding error onto
the columns not yet rounded, weighted by the inverse of the input Hessian ``H = Xᵀ X [K, K]``
(``X``: calibration activations, one row per token). Rows are independent, so a weight of any height
is processed in row chunks with one shared factor.

With ``U`` the upper Cholesky factor of ``(H + λ I)⁻¹`` (``λ = damp · mean(diag H)``), for column
``j`` in order::

    q_j    = clip(round_half_even(w_j / s_j) + z_j, qmin, qmax)      codes, as the scheme stores them
    e_j    = (w_j − (q_j − z_j) s_j) / U[j, j]
    w_{>j} −= e_j · U[j, >j]

Scales ``s`` and zero points ``z`` are chosen beforehand per block (by the scheme's own rule) and
kept: the codes change, the layout does not. Updates are applied lazily per group of ``lazy``
columns (the paper's block update), so the inner loop touches ``[rows, lazy]`` only.

"In order" is by decreasing ``diag H`` by default (the reference implementation's ``act_order``,
with its "static groups": since the scales are fixed, each column keeps its own block's scale).
On the real 270M it lowered the int8 KL from 0.00114 to 0.00105 and the int4 KL from 0.1103 to
0.1080 (docs/quality.md).
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .rows import as_weight, check_real, float_rows

#: λ as a share of the mean diagonal of H (the paper's 1%): keeps H invertible when calibration
#: activations leave some directions unexercised.
DEFAULT_DAMP = 0.01
#: rows rounded at a time: the chunk is held transposed in float32 beside its codes and error
#: buffers (4,096 × 2,048 × 4 B = 34 MB for the widest input, down_proj's; a bound on memory)
_ROWS_PER_CHUNK = 4096
#: columns per lazy batch update (the paper's B; its reference code uses 128). In numpy the
#: inner loop's [rows, lazy] updates cost more as lazy grows, the outer ones less: for a [2048, 640]
#: weight, lazy 8 / 16 / 32 / 64 / 128 took 0.16 / 0.083 / 0.083 / 0.092 / 0.54 s (2026-12-06)
_LAZY = 32


def inverse_cholesky(hessian: np.ndarray, damp: float = DEFAULT_DAMP) -> np.ndarray:
    """Upper Cholesky factor ``U`` of ``(H + λ I)⁻¹``, float32 ``[K, K]`` (``U`` with ``Uᵀ U = (H + λI)⁻¹``).

    A channel no calibration token used (zero diagonal; ``≤ 0``, as rounding can leave it, counts
    as zero) gets a unit diagonal, so its weights are rounded to nearest and receive no error from
    the others. ``H`` is taken as given (a ``Xᵀ X`` is symmetric; one that is not is not refused,
    its inverse is made symmetric, ``(A + Aᵀ) / 2``, before the factorization). Damping and the
    Cholesky factor of the inverse follow the reference implementation of GPTQ (Frantar et al.
    2022, arXiv:2210.17323, ``gptq.py``'s ``fasterquant``), ``λ`` taken after the dead channels'
    diagonal is set to 1 as there; unlike there, a dead channel's weights are kept (the reference
    zeroes them).

    Args:
        hessian: ``[K, K]``, ``Xᵀ X`` of the calibration inputs, any float dtype (computed in
            float64, factored in float32 first, float64 if that fails).
        damp: ``λ`` as a share of the mean of ``diag H``.

    Returns:
        float32 ``[K, K]``, upper triangular, positive diagonal.

    Raises:
        ValueError: ``hessian`` is not square, not real numbers, not finite, or not positive
            semi-definite enough to factor after damping; scaled beyond float32's range for its
            factor (about 1e-30 to 1e30 on the diagonal); ``damp`` not a finite number > 0.
    """
    h = _real_matrix(hessian).copy()  # dead channels are edited below
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"expected a square Hessian, found shape {h.shape}")
    if not np.isfinite(h).all():
        raise ValueError("the Hessian holds NaN or Inf")
    if not (isinstance(damp, numbers.Real) and not isinstance(damp, (bool, np.bool_))
            and math.isfinite(damp) and damp > 0):
        raise ValueError(f"damp must be a finite number > 0, found {damp!r}")
    diag = np.diagonal(h).copy()
    dead = diag <= 0
    h[dead, :] = 0
    h[:, dead] = 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diagonal(h)))
    # float32 first (GPTQ's reference code factors in float32), float64 if that fails
    beyond = False
    for dtype in (np.float32, np.float64):
        try:
            with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # judged below
                inverse = np.linalg.inv(h.astype(dtype))
                inverse = (inverse + inverse.T) * 0.5
                factor = np.linalg.cholesky(inverse).T.astype(np.float32)  # upper factor of H⁻¹
        except np.linalg.LinAlgError:
            continue
        if np.isfinite(factor).all() and (np.diagonal(factor) > 0).all():
            return factor
        beyond = beyond or not np.isfinite(factor).all() or not np.isfinite(h.astype(np.float32)).all()
    if beyond:  # e.g. a Hessian scaled by 1e100: positive definite, but its inverse factor is no float32
        raise ValueError(f"the Hessian's scale is beyond float32's range for its factor (largest diagonal "
                         f"{float(np.max(diag)):.3g}); scale it towards 1")
    raise ValueError("the Hessian is not positive definite after damping")


class Hessian:
    """``Xᵀ X`` of one input ``[K, K]`` with its GPTQ factor (:func:`inverse_cholesky`) computed on
    first use, so weights that read the same input (q/k/v, gate/up) share one factorisation.

    Args:
        matrix: ``[K, K]``, stored as float64 (:attr:`matrix`).
        damp: ``λ`` as a share of the mean diagonal (:func:`inverse_cholesky`).

    Errors of the factorisation (ValueError, see :func:`inverse_cholesky`) are raised on first use
    of :attr:`ordered` or :attr:`factor`, not here.
    """

    def __init__(self, matrix: np.ndarray, damp: float = DEFAULT_DAMP):
        self.matrix = _real_matrix(matrix)
        self.damp = damp
        self._factor: np.ndarray | None = None
        self._ordered: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def ordered(self) -> tuple[np.ndarray, np.ndarray]:
        """``(order, factor)``: the columns by decreasing ``diag H`` (GPTQ's "act order": the inputs
        with the most energy are rounded first, while the most columns remain to take their error)
        and the :func:`inverse_cholesky` factor of ``H`` permuted that way; computed once.
        ``order`` is int64 ``[K]``, ``factor`` float32 ``[K, K]``.

        Raises:
            ValueError: as :func:`inverse_cholesky`.
        """
        if self._ordered is None:
            order = np.argsort(-np.diagonal(self.matrix), kind="stable")
            self._ordered = (order, inverse_cholesky(self.matrix[np.ix_(order, order)], self.damp))
        return self._ordered

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's shape, ``(K, K)`` (so a :class:`Hessian` is checked like an array)."""
        return self.matrix.shape

    @property
    def factor(self) -> np.ndarray:
        """:func:`inverse_cholesky` of the matrix in column order, float32 ``[K, K]``; computed once.

        Raises:
            ValueError: as :func:`inverse_cholesky`.
        """
        if self._factor is None:
            self._factor = inverse_cholesky(self.matrix, self.damp)
        return self._factor

    def rotated(self, size: int) -> "Hessian":
        """The Hessian of the Hadamard-rotated inputs (:func:`rotate_hessian`), same ``damp``.

        Args:
            size: the Hadamard block size (a power of two dividing K).

        Raises:
            ValueError: as :func:`rotate_hessian`.
        """
        return Hessian(rotate_hessian(self.matrix, size), self.damp)


def _real_matrix(hessian) -> np.ndarray:
    """``hessian`` as float64 (the same array when it already is), complex numbers and objects
    refused by name: numpy would drop an imaginary part with only a warning."""
    given = np.asarray(hessian)
    try:
        check_real(given)
    except ValueError as error:
        raise ValueError(f"the Hessian: {error}") from None
    return given.astype(np.float64, copy=False)


def as_hessian(hessian: "np.ndarray | Hessian", damp: float = DEFAULT_DAMP) -> Hessian:
    """``hessian`` itself when it is a :class:`Hessian` (its own ``damp`` kept), else a new one
    wrapping the ``[K, K]`` array with ``damp``."""
    return hessian if isinstance(hessian, Hessian) else Hessian(hessian, damp)


def gptq_codes(w, hessian: "np.ndarray | Hessian", scales: np.ndarray, zero_points: np.ndarray, block_size: int,
               qmin: int, qmax: int, damp: float = DEFAULT_DAMP, act_order: bool = True) -> np.ndarray:
    """GPTQ codes for ``w`` with fixed per-block ``scales`` and ``zero_points``.

    The update rule is Algorithm 1 of Frantar et al. 2022 (arXiv:2210.17323) with lazy batch updates
    of 32 columns and, with ``act_order``, the reference implementation's act order with static
    groups (the formulas are in the module docstring). Rows are processed 4,096 at a time.

    Args:
        w: float ``[N, K]`` (an array or any row-sliceable object: read chunk by chunk).
        hessian: ``[K, K]``, ``Xᵀ X`` of the calibration inputs (any positive scale whose factor
            float32 holds: about 1e-30 to 1e30 on the diagonal), or a
            :class:`Hessian` (whose own ``damp`` then applies and whose factor is reused).
        scales: float32 ``[N, K / block_size]``, nonzero and finite.
        zero_points: ``[N, K / block_size]``, the code that dequantizes to 0.
        block_size: elements per scale along K; > 0, dividing K.
        qmin, qmax: the code range (e.g. 1..255 for symmetric int8 around 128, 0..15 for 4 bits).
        damp: added to ``diag H`` as a fraction of its mean before factoring (the paper's λ; ignored
            when ``hessian`` is a :class:`Hessian`, which carries its own).
        act_order: round the columns by decreasing ``diag H`` (True) or left to right.

    Returns:
        uint8 codes ``[N, K]``; ``(code − zero_point) · scale`` per block dequantizes them.

    Raises:
        ValueError: shapes disagree (including ``block_size`` not dividing K, or ≤ 0), or see
            :func:`inverse_cholesky`; NaN/Inf in ``w``; a zero or non-finite scale; a code range
            outside ``0 ≤ qmin < qmax ≤ 255`` (uint8 codes) or a zero point outside it.
    """
    if not 0 <= qmin < qmax <= 255:
        raise ValueError(f"GPTQ: the code range must lie in 0 … 255 with qmin < qmax, found qmin {qmin}, qmax {qmax}")
    w = as_weight(w)
    hessian = as_hessian(hessian, damp)  # a nested list too; the same object when already a Hessian
    n, k = w.shape
    nb = k // block_size if block_size > 0 else 0
    if nb * block_size != k or scales.shape != (n, nb) or zero_points.shape != (n, nb) or hessian.shape != (k, k):
        raise ValueError(f"GPTQ: weight {tuple(w.shape)}, block {block_size}, scales {scales.shape}, "
                         f"zero points {zero_points.shape} and Hessian {hessian.shape} disagree")
    if not (np.isfinite(scales).all() and (scales != 0).all()):
        raise ValueError(f"GPTQ: scales must be finite and nonzero, found {scales[~(np.isfinite(scales) & (scales != 0))][0]}")
    outside = ~((zero_points >= qmin) & (zero_points <= qmax))  # NaN is outside too
    if outside.any():
        raise ValueError(f"GPTQ: zero points must lie in the code range {qmin} … {qmax}, found "
                         f"{zero_points[outside][0]}")
    h = hessian
    if act_order:
        order, u = h.ordered
    else:
        order, u = np.arange(k), h.factor
    block_of = order // block_size  # the (fixed) scale block of each column, in rounding order
    codes = np.empty((n, k), np.uint8)
    for start in range(0, n, _ROWS_PER_CHUNK):
        # column-major chunk in rounding order: column order[j] of W is the contiguous row cols[j]
        cols = np.ascontiguousarray(float_rows(w, start, _ROWS_PER_CHUNK).T[order])  # [K, R]
        end = start + cols.shape[1]
        s = np.ascontiguousarray(scales[start:end].T, dtype=np.float32)            # [K / B, R]
        z = np.ascontiguousarray(zero_points[start:end].T, dtype=np.float32)
        chunk_codes = np.empty((k, end - start), np.uint8)
        for i1 in range(0, k, _LAZY):
            i2 = min(i1 + _LAZY, k)
            errors = np.empty((i2 - i1, end - start), np.float32)
            for j in range(i1, i2):
                sj, zj = s[block_of[j]], z[block_of[j]]
                q = np.clip(np.rint(cols[j] / sj) + zj, qmin, qmax)
                chunk_codes[j] = q
                e = (cols[j] - (q - zj) * sj) / u[j, j]
                cols[j + 1 : i2] -= np.outer(u[j, j + 1 : i2], e)
                errors[j - i1] = e
            cols[i2:] -= u[i1:i2, i2:].T @ errors
        codes[start:end, order] = chunk_codes.T
    return codes


def rotate_hessian(hessian: np.ndarray, size: int) -> np.ndarray:
    """``Hd H Hd`` for the block-diagonal Hadamard ``Hd`` of :mod:`quant.hadamard`: the Hessian of the
    rotated inputs ``Hd x`` that a rotated weight ``W Hd`` consumes. float64 ``[K, K]``.

    Args:
        hessian: ``[K, K]``, any float dtype (computed in float64).
        size: the Hadamard block size ``n`` (:func:`quant.hadamard.hadamard_matrix`).

    Raises:
        ValueError: ``hessian`` is not square or not real numbers, ``size`` is not a power of two,
            or ``K`` is not a multiple of it.
    """
    from .hadamard import hadamard_matrix

    h = _real_matrix(hessian)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"expected a square Hessian, found shape {h.shape}")
    k = h.shape[0]
    blocks = hadamard_matrix(size).astype(np.float64)
    if k % size:
        raise ValueError(f"Hessian of {k} inputs is not a multiple of the Hadamard size {size}")
    left = (h.reshape(k // size, size, k).transpose(1, 0, 2).reshape(size, -1))
    left = (blocks @ left).reshape(size, k // size, k).transpose(1, 0, 2).reshape(k, k)      # Hd H
    return (left.reshape(k, k // size, size) @ blocks).reshape(k, k)                        # (Hd H) Hd
