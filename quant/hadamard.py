"""Block-diagonal Walsh–Hadamard rotations, to spread outliers before int8 and int4 quantization.

onnxruntime's fast int8 kernel (``MatMulNBits`` at ``accuracy_level`` 4) quantizes the
*activations* to int8 per block too; one large channel in a block then costs precision on every
other channel of that block. Rotating the input dimension by an orthogonal Hadamard matrix ``H``
spreads such a channel over the block, and is exact in real arithmetic because
``W x = (W Hᵀ)(H x)`` (QuaRot, Ashkboos et al. 2024, arXiv:2404.00456; QuIP#, Tseng et al. 2024, arXiv:2402.04396).
Here ``H`` is block-diagonal with ``n × n`` Sylvester blocks (``n`` a power of two), so it costs
``K · n`` multiply-adds per token and needs only an ``n × n`` constant. Sylvester's matrix scaled by
``1/sqrt(n)`` is symmetric and orthogonal: ``H = Hᵀ = H⁻¹``.
"""

from __future__ import annotations

import numpy as np

from .rows import check_real, is_integer


#: the largest rotation built: 4,096² float64 is 134 MB while it is built. A rotation must divide
#: every matmul input (the export's block_size_for), and Gemma 3's hidden sizes allow at most 512
#: (2,560 = 2⁹ · 5, the 4B model; 640 and 1,152 allow 128)
MAX_HADAMARD_SIZE = 4096


def hadamard_matrix(n: int) -> np.ndarray:
    """The ``n × n`` Sylvester–Hadamard matrix divided by ``sqrt(n)``, float32.

    Sylvester's construction (J. J. Sylvester 1867): ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``,
    built in float64 and then scaled, so the result is symmetric and orthogonal.

    Args:
        n: the size, a power of two ≥ 1.

    Returns:
        float32 ``[n, n]`` with entries ``±1 / sqrt(n)``.

    Raises:
        ValueError: ``n`` is not an integer power of two (a bool is not one), or is above
            :data:`MAX_HADAMARD_SIZE` (its float64 construction would take gigabytes first).
    """
    if not is_integer(n) or n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, found {n!r}")
    if n > MAX_HADAMARD_SIZE:
        raise ValueError(f"Hadamard size must be at most {MAX_HADAMARD_SIZE:,}, found {n:,}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate_blocks(x: np.ndarray, n: int) -> np.ndarray:
    """Apply the block-diagonal Hadamard along the last axis: each run of ``n`` values ``v`` becomes
    ``H v``. Shapes: ``[..., K]`` → ``[..., K]`` float32, ``K`` a multiple of ``n``.

    For a weight ``W [out, K]``, ``rotate_blocks(W, n)`` is ``W Hᵀ`` (H symmetric), the weight
    that consumes rotated activations ``H x``. Applying it twice is the identity. Each output is a
    sum of ``n`` inputs over ``√n``, so values near float32's largest can become ±Inf: the caller
    checks (the exporter names the tensor, ``gemma_export.weights``).

    Raises:
        ValueError: ``n`` is not a power of two (:func:`hadamard_matrix`), ``x`` is 0-d, holds
            complex numbers or objects (:func:`quant.rows.check_real`), or ``K`` is not a multiple
            of ``n``.
    """
    h = hadamard_matrix(n)
    x = np.asarray(x)
    check_real(x)
    if x.ndim == 0:
        raise ValueError("expected an array with a last axis to rotate, found a 0-d value")
    x = x.astype(np.float32, copy=False)
    k = x.shape[-1]
    if k % n:
        raise ValueError(f"last axis {k} is not a multiple of the Hadamard size {n}")
    blocks = x.reshape(*x.shape[:-1], k // n, n)
    with np.errstate(over="ignore", invalid="ignore"):  # the documented ±Inf (and NaN) stay quiet
        return (blocks @ h).reshape(x.shape)
