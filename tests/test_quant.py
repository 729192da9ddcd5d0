"""quant/: round trips and edge cases (zero rows, outliers, NaN)."""

import ml_dtypes
import numpy as np
import pytest

from quant import BF16Weights, BlockInt8Weights, float32_to_bfloat16_bits


def test_int8_round_trip_error_is_bounded_by_half_a_step():
    w = np.random.default_rng(0).standard_normal((300, 256)).astype(np.float32)
    q = BlockInt8Weights.quantize(w, 64)
    assert q.data.shape == (300, 4, 64) and q.data.dtype == np.uint8
    assert q.scales.shape == (300, 4) and q.scales.dtype == np.float32
    err = np.abs(q.dequantize() - w).reshape(300, 4, 64)
    assert (err <= q.scales[:, :, None] / 2 * (1 + 1e-6)).all()
    # the largest element of each block is represented exactly as ±127 steps
    stored = q.data.astype(np.int16) - 128
    assert np.abs(stored).max(axis=2).min() == 127


def test_int8_matches_reference_rule_per_row():
    # block == K is the reference archives' per-row rule: scale = max|row| / 127, round half to even
    w = np.array([[0.5, -1.0, 0.25, 127.0 / 254.0]], dtype=np.float32)
    q = BlockInt8Weights.quantize(w, 4)
    assert q.scales[0, 0] == np.float32(1.0 / 127.0)
    # 0.5 / (1/127) = 63.5 → 64 (half to even), -1 → -127, 0.25 → 31.75 → 32, 0.5 → 64
    assert (q.data[0, 0].astype(int) - 128).tolist() == [64, -127, 32, 64]


def test_int8_zero_block_and_outlier():
    w = np.zeros((3, 32), np.float32)
    w[1, 5] = 3e38  # near float32 max: must not overflow the scale
    w[2] = 1e-42    # subnormal
    q = BlockInt8Weights.quantize(w, 32)
    d = q.dequantize()
    assert np.isfinite(q.scales).all() and (q.scales > 0).all()
    assert (d[0] == 0).all()
    assert d[1, 5] == pytest.approx(3e38, rel=1e-6) and (np.delete(d[1], 5) == 0).all()
    assert np.isfinite(d[2]).all()


def test_int8_rejects_nan_with_index():
    w = np.ones((4, 32), np.float32)
    w[2, 7] = np.nan
    with pytest.raises(ValueError, match=r"nan at index \(2, 7\)"):
        BlockInt8Weights.quantize(w, 32)


def test_int8_rejects_bad_block_size():
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockInt8Weights.quantize(np.ones((2, 48), np.float32), 32)


def test_bf16_round_to_nearest_even_and_nan():
    # 1 + 2**-8 is exactly halfway between two bf16 values: ties go to the even mantissa (1.0)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan, -np.inf, 3.0e38], dtype=np.float32)
    bits = float32_to_bfloat16_bits(x)
    back = BF16Weights(bits).dequantize()
    assert back[0] == 1.0
    assert back[1] == np.float32(1 + 4 * 2**-8)
    assert np.isnan(back[2]) and back[3] == -np.inf
    assert back[4] == np.float32(x[4].astype(ml_dtypes.bfloat16))
    # truncation would have given 1 + 2 * 2**-8 for x[1]: round-to-nearest differs
    assert (x.view(np.uint32)[1] >> 16) != bits[1]


def test_hadamard_is_orthogonal_symmetric_and_self_inverse():
    from quant import hadamard_matrix, rotate_blocks

    h = hadamard_matrix(64)
    assert np.allclose(h @ h.T, np.eye(64), atol=1e-6) and np.array_equal(h, h.T)
    x = np.random.default_rng(1).standard_normal((3, 5, 128)).astype(np.float32)
    assert np.allclose(rotate_blocks(rotate_blocks(x, 64), 64), x, atol=1e-5)
    # W x == (W H)(H x): the identity the int8 graph relies on
    w = np.random.default_rng(2).standard_normal((7, 128)).astype(np.float32)
    assert np.allclose(rotate_blocks(x, 64) @ rotate_blocks(w, 64).T, x @ w.T, atol=1e-4)
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(48)
    with pytest.raises(ValueError, match="multiple of the Hadamard size 64"):
        rotate_blocks(np.ones((2, 96), np.float32), 64)


def test_hadamard_spreads_an_outlier_so_int8_error_drops():
    from quant import rotate_blocks

    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32) * 0.1
    x[:, 5] = 50.0  # one huge channel, as after Gemma's RMSNorm gains

    def int8_error(v):
        return np.abs(BlockInt8Weights.quantize(v, 32).dequantize() - v)

    plain = np.delete(int8_error(x), 5, axis=1).mean()
    rotated = np.abs(rotate_blocks(BlockInt8Weights.quantize(rotate_blocks(x, 64), 32).dequantize(), 64) - x)
    assert np.delete(rotated, 5, axis=1).mean() < plain / 2
