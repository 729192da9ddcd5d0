"""quant/: round trips and edge cases (zero rows, outliers, NaN)."""

import re

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


def test_int8_rounds_exact_halves_to_even_on_both_sides_of_zero():
    # max 127 makes the scale exactly 1.0, so w / scale is w: exact halves of either sign. Half to
    # even gives these codes; half up (floor(x + 0.5)) would give 0, -1, 3, 1, -126 for the halves,
    # half away from zero -1, -2, 3, -3, 1, -127.
    w = np.array([[127.0, -0.5, -1.5, 2.5, -2.5, 0.5, 1.5, -126.5]], dtype=np.float32)
    q = BlockInt8Weights.quantize(w, 8)
    assert q.scales[0, 0] == np.float32(1.0)
    assert (q.data[0, 0].astype(int) - 128).tolist() == [127, 0, -2, 2, -2, 0, 2, -126]


def test_int8_zero_block_and_outlier():
    w = np.zeros((3, 32), np.float32)
    w[1, 5] = 3e38  # near float32 max: must not overflow the scale
    w[2] = 1e-42    # subnormal
    q = BlockInt8Weights.quantize(w, 32)
    d = q.dequantize()
    assert np.isfinite(q.scales).all() and (q.scales > 0).all()
    assert (d[0] == 0).all()
    assert d[1, 5] == pytest.approx(3e38, rel=1e-6) and (np.delete(d[1], 5) == 0).all()
    # a subnormal block round-trips exactly (its one value is the block's largest: code 127)
    assert np.array_equal(d[2], w[2]) and (q.scales[2] > 0).all()


def test_int8_rejects_nan_with_index():
    w = np.ones((4, 32), np.float32)
    w[2, 7] = np.nan
    with pytest.raises(ValueError, match=r"nan at index \(2, 7\)"):
        BlockInt8Weights.quantize(w, 32)


def test_int8_rejects_bad_block_size():
    with pytest.raises(ValueError, match="multiple of block_size"):
        BlockInt8Weights.quantize(np.ones((2, 48), np.float32), 32)
    for size in (0, -16):  # a clear ValueError, not a ZeroDivisionError or numpy's negative dimensions
        with pytest.raises(ValueError, match=f"in_features 48 is not a multiple of block_size {size}"):
            BlockInt8Weights.quantize(np.ones((2, 48), np.float32), size)


def test_int8_codes_stay_symmetric_when_the_scale_of_a_subnormal_block_rounds_down():
    # max|w| = 190 * 2**-149 (subnormal): max / 127 rounds to the smallest subnormal, so w / scale
    # reaches ±190 and must clip to ±127 (stored 1 .. 255: code 0 would be an asymmetric -128)
    tiny = np.float32(2.0 ** -149)
    w = np.array([[-190 * tiny, 190 * tiny, 0.0, -tiny]], np.float32)
    q = BlockInt8Weights.quantize(w, 4)
    assert q.scales[0, 0] == tiny
    assert (q.data[0, 0].astype(int) - 128).tolist() == [-127, 127, 0, -1]


def test_bf16_round_to_nearest_even_and_nan():
    # 1 + 2**-8 is exactly halfway between two bf16 values: ties go to the even mantissa (1.0)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan, -np.inf, 3.0e38], dtype=np.float32)
    bits = float32_to_bfloat16_bits(x)
    back = BF16Weights(bits).dequantize()
    assert back[0] == 1.0
    assert back[1] == np.float32(1 + 4 * 2**-8)
    assert np.isnan(back[2]) and back[3] == -np.inf
    # 3.0e38 is 0x7F61_B1E6: its low half is above 0x8000, so it rounds up to 0x7F62 (3.0040553e38)
    assert bits[4] == 0x7F62 and back[4] == np.float32(3.0040553e38)
    # truncation would have given 1 + 2 * 2**-8 for x[1]: round-to-nearest differs
    assert (x.view(np.uint32)[1] >> 16) != bits[1]


def test_bf16_refuses_a_finite_value_that_would_round_to_inf():
    x = np.array([[1.0, 2.0], [-3.4e38, 5.0]], np.float32)  # beyond bf16's largest finite 3.3895e38
    with pytest.raises(ValueError, match=r"-3\.4e\+38 at index \[1, 0\] overflows bfloat16 \(largest finite 3\.38953e\+38\)"):
        BF16Weights.quantize(x)
    kept = np.array([np.inf, -np.inf, np.nan, 3.3e38], np.float32)  # already infinite or in range: stored as is
    out = BF16Weights.quantize(kept).dequantize()
    assert out[0] == np.inf and out[1] == -np.inf and np.isnan(out[2])
    # 3.3e38 is 0x7F78_43B0: its low half is below 0x8000, so it rounds down to 0x7F78 (3.2964854e38), not to inf
    assert out[3] == np.float32(3.2964854e38)


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
    for size in (0, 48):  # a clear ValueError, not a ZeroDivisionError or a reshape error
        with pytest.raises(ValueError, match="power of two"):
            rotate_blocks(np.ones((2, 96), np.float32), size)


def test_hadamard_spreads_an_outlier_so_int8_error_drops():
    from quant import rotate_blocks

    x = np.random.default_rng(3).standard_normal((64, 64)).astype(np.float32) * 0.1
    x[:, 5] = 50.0  # one huge channel, as after Gemma's RMSNorm gains

    def int8_error(v):
        return np.abs(BlockInt8Weights.quantize(v, 32).dequantize() - v)

    plain = np.delete(int8_error(x), 5, axis=1).mean()
    rotated = np.abs(rotate_blocks(BlockInt8Weights.quantize(rotate_blocks(x, 64), 32).dequantize(), 64) - x)
    assert np.delete(rotated, 5, axis=1).mean() < plain / 2


# ---- int4 -----------------------------------------------------------------------------------------

from quant import BlockInt4Weights  # noqa: E402
from quant.int4 import CLIP_RATIOS, pack_nibbles, unpack_nibbles  # noqa: E402


def test_nibble_packing_is_low_first_and_invertible():
    codes = np.array([[1, 2, 15, 0]], np.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    rng = np.random.default_rng(0)
    many = rng.integers(0, 16, (7, 5, 32)).astype(np.uint8)
    assert np.array_equal(unpack_nibbles(pack_nibbles(many)), many)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_rtn_round_trip_error_is_bounded_by_half_a_step(symmetric):
    rng = np.random.default_rng(1)
    w = rng.normal(size=(64, 128)).astype(np.float32)
    q = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method="rtn")
    assert q.data.shape == (64, 4, 16) and q.data.dtype == np.uint8
    assert (q.zero_points is None) == symmetric
    err = np.abs(q.dequantize() - w).reshape(64, 4, 32)
    step = np.abs(q.scales[..., None])  # symmetric scales are m / -8, negative when m > 0
    inside = (w.reshape(64, 4, 32) / q.scales[..., None] <= 7.5) if symmetric else np.ones(err.shape, bool)
    assert (err[inside] <= np.broadcast_to(step, err.shape)[inside] / 2 + 1e-6).all()
    assert (err <= step + 1e-6).all()  # code 7 clips the far side of the largest magnitude by < 1 step
    codes = unpack_nibbles(q.data)
    if symmetric:  # the largest-magnitude element of each block lands exactly on code 0 (-8 * scale)
        assert (codes.reshape(64, 4, 32).min(axis=2) == 0).all()


def test_int4_asymmetric_zero_points_are_packed_with_an_odd_block_count():
    rng = np.random.default_rng(2)
    w = (rng.normal(size=(8, 48)) + 3.0).astype(np.float32)  # 3 blocks of 16, all positive
    q = BlockInt4Weights.quantize(w, 16, symmetric=False, method="rtn")
    assert q.zero_points.shape == (8, 2)
    zp = q.unpacked_zero_points()
    assert zp.shape == (8, 3) and (zp == 0).all()  # positive blocks: min clipped to 0 → zero point 0
    assert np.abs(q.dequantize() - w).max() <= q.scales.max() / 2 + 1e-6
    sym = BlockInt4Weights.quantize(w, 16, symmetric=True, method="rtn")
    assert np.abs(q.dequantize() - w).mean() < np.abs(sym.dequantize() - w).mean()


def test_int4_mse_search_never_loses_to_round_to_nearest():
    rng = np.random.default_rng(3)
    w = (rng.standard_t(3, size=(256, 256)) * 0.02).astype(np.float32)  # heavy tails: clipping pays
    rtn = BlockInt4Weights.quantize(w, 32, method="rtn")
    mse = BlockInt4Weights.quantize(w, 32, method="mse")
    block_err = lambda q: ((q.dequantize() - w) ** 2).reshape(256, 8, 32).sum(axis=2)  # noqa: E731
    assert (block_err(mse) <= block_err(rtn) + 1e-12).all()
    assert block_err(mse).sum() < 0.97 * block_err(rtn).sum()
    assert 1.0 in CLIP_RATIOS  # round to nearest is one of the candidates


def _block_candidates(block: np.ndarray, symmetric: bool) -> list[np.ndarray]:
    """Every clipping ratio's dequantized block, one block at a time, from the formulas of
    quant/int4.py's docstring (float64; written independently of the vectorised search)."""
    out = []
    for c in CLIP_RATIOS:
        if symmetric:
            m = block[np.argmax(np.abs(block))]
            scale = c * m / -8 or 1.0
            out.append(np.clip(np.round(block / scale), -8, 7) * scale)
        else:
            lo, hi = c * min(block.min(), 0.0), c * max(block.max(), 0.0)
            scale = (hi - lo) / 15 or 1.0
            zp = np.clip(np.round(-lo / scale), 0, 15)
            out.append((np.clip(np.round(block / scale) + zp, 0, 15) - zp) * scale)
    return out


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("weighted", [False, True])
def test_int4_mse_search_picks_each_blocks_least_error_ratio(symmetric, weighted):
    rng = np.random.default_rng(5)
    w = (rng.standard_t(3, size=(24, 64)) * 0.02).astype(np.float32)
    w[0, :16] = 0.0        # an all-zero block
    w[1, 16:32] = 0.3      # a constant block
    w[2, 40] = 5.0         # an outlier
    h = rng.random(64).astype(np.float32) * 10 if weighted else np.ones(64, np.float32)
    q = BlockInt4Weights.quantize(w, 16, symmetric=symmetric, channel_weights=h if weighted else None)
    got = q.dequantize().astype(np.float64)
    for r in range(w.shape[0]):
        for b in range(4):
            cols = slice(16 * b, 16 * b + 16)
            block, hb = w[r, cols].astype(np.float64), h[cols].astype(np.float64)
            errors = [float((hb * (block - d) ** 2).sum()) for d in _block_candidates(block, symmetric)]
            chosen = float((hb * (block - got[r, cols]) ** 2).sum())
            assert chosen <= min(errors) * (1 + 1e-4) + 1e-12, (r, b, chosen, min(errors))
            assert any(np.allclose(got[r, cols], d, rtol=1e-5, atol=1e-9)
                       for d in _block_candidates(block, symmetric))  # one of the candidates, as stored


def test_int4_channel_weights_steer_the_error():
    rng = np.random.default_rng(4)
    w = (rng.standard_t(3, size=(128, 64)) * 0.02).astype(np.float32)
    h = np.ones(64, np.float32)
    h[:8] = 100.0  # the first 8 input channels matter 100x
    plain = BlockInt4Weights.quantize(w, 32)
    weighted = BlockInt4Weights.quantize(w, 32, channel_weights=h)
    first = lambda q: ((q.dequantize() - w)[:, :8] ** 2).sum()  # noqa: E731
    assert first(weighted) < first(plain)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_mse_search_keeps_ratio_one_where_every_ratio_ties(symmetric):
    # a block whose channel weights are all zero (inputs no calibration token used) has error 0 under
    # every clipping ratio: the tie keeps the first candidate, c = 1 (round to nearest), not the last
    rng = np.random.default_rng(6)
    w = (rng.standard_t(3, size=(32, 64)) * 0.02).astype(np.float32)
    h = np.ones(64, np.float32)
    h[:32] = 0.0
    searched = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method="mse", channel_weights=h)
    rtn = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method="rtn")
    assert np.array_equal(searched.scales[:, 0], rtn.scales[:, 0])
    assert np.array_equal(searched.unpacked_zero_points()[:, 0], rtn.unpacked_zero_points()[:, 0])
    assert np.array_equal(unpack_nibbles(searched.data)[:, 0], unpack_nibbles(rtn.data)[:, 0])
    assert not np.array_equal(searched.scales[:, 1], rtn.scales[:, 1])  # the weighted block still searches


def test_asymmetric_int4_of_a_block_spanning_float32s_range_keeps_finite_scales():
    # hi - lo = 6e38 is beyond float32's largest value: the scale is formed in float64, as
    # (3e38 + 3e38) / 15 = 4e37, and both extremes come back to within half a step
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = -3e38, 3e38
    for method in ("rtn", "mse"):
        q = BlockInt4Weights.quantize(w, 32, symmetric=False, method=method)
        out = q.dequantize()
        assert np.isfinite(q.scales).all() and np.isfinite(out).all(), method
        assert abs(out[0, 1] - 3e38) <= q.scales[0, 0] / 2 and abs(out[0, 0] + 3e38) <= q.scales[0, 0] / 2, method
    assert q.scales[0, 0] == pytest.approx(4e37, rel=1e-6)


@pytest.mark.parametrize("codes, message", [
    (np.zeros((2, 3), np.uint8), r"even number of 4-bit codes .* found shape \(2, 3\)"),
    (np.array([[0, 16]], np.uint8), r"4-bit codes in \[0, 15\], found values from 0 to 16"),
    (np.array([[-1, 3]]), r"found values from -1 to 3"),
])
def test_nibble_packing_refuses_codes_it_cannot_pack(codes, message):
    with pytest.raises(ValueError, match=message):
        pack_nibbles(codes)


@pytest.mark.parametrize("quantize", [lambda w: BlockInt8Weights.quantize(w, 4), lambda w: BlockInt4Weights.quantize(w, 4)])
def test_block_quantizers_refuse_a_weight_that_is_not_2d(quantize):
    with pytest.raises(ValueError, match=r"expected a 2-D weight, found shape \(2, 4, 4\)"):
        quantize(np.ones((2, 4, 4), np.float32))


def test_bfloat16_conversions_keep_a_0d_array_0d():
    from quant.bf16 import truncate_to_bfloat16_bits

    assert truncate_to_bfloat16_bits(np.float32(1.5)).shape == () and int(truncate_to_bfloat16_bits(np.float32(1.5))) == 0x3FC0
    assert float32_to_bfloat16_bits(np.float32(-2.0)).shape == () and int(float32_to_bfloat16_bits(np.float32(-2.0))) == 0xC000
    assert BF16Weights(np.uint16(0x3FC0)).dequantize().shape == ()


def test_int4_zero_and_constant_blocks_and_outliers():
    w = np.zeros((3, 32), np.float32)
    w[1] = 0.5
    w[2, 5] = 1e30
    q = BlockInt4Weights.quantize(w, 32, method="rtn")
    out = q.dequantize()
    assert np.isfinite(q.scales).all() and (out[0] == 0).all()
    assert np.allclose(out[1], 0.5, rtol=1e-6)  # a constant block is its own extreme: exact
    assert out[2, 5] == pytest.approx(1e30, rel=1e-6) and (out[2, :5] == 0).all()


@pytest.mark.parametrize("bad, message", [
    (np.array([[0.0, np.nan] * 16]), r"holds nan at index \(0, 1\)"),
    (np.array([[0.0, np.inf] * 16]), r"holds inf at index \(0, 1\)"),
])
def test_int4_rejects_non_finite_with_index(bad, message):
    with pytest.raises(ValueError, match=message):
        BlockInt4Weights.quantize(bad.astype(np.float32), 32)


@pytest.mark.parametrize("kwargs, message", [
    ({"block_size": 24}, "in_features 64 is not a multiple of the even block_size 24"),
    ({"block_size": 2 * 9 + 1}, "not a multiple of the even block_size 19"),
    ({"block_size": 32, "method": "gptq"}, "method must be one of mse, rtn, found 'gptq'"),
    ({"block_size": 32, "channel_weights": np.ones(3)}, "channel_weights must be 64 finite values"),
    ({"block_size": 32, "channel_weights": np.r_[np.ones(63), -1.0]}, "channel_weights must be 64 finite values >= 0, found -1.0 at index 63"),
    ({"block_size": 32, "channel_weights": np.r_[np.ones(63), np.nan]}, "channel_weights must be 64 finite values >= 0, found nan at index 63"),
    ({"block_size": 32, "channel_weights": np.r_[np.ones(5), np.nan, np.ones(34), -1.0, np.ones(23)]},
     "found nan at index 5"),  # the first bad value
])
def test_int4_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockInt4Weights.quantize(np.ones((2, 64), np.float32), **kwargs)


def test_truncation_to_bfloat16_keeps_every_nan_a_nan():
    # dropping the low 16 bits of a NaN whose payload lies only there leaves the exponent of an Inf:
    # such a NaN must stay NaN (quiet), the other values truncate (1 + 2**-9 -> 1, -2.75 exact)
    from quant.bf16 import truncate_to_bfloat16_bits

    x = np.array([0x7F800001, 0xFF800001, 0x7FC00000, 0x3F800000 | 0x4000, 0xC0300000, 0x7F800000],
                 np.uint32).view(np.float32)
    bits = truncate_to_bfloat16_bits(x)
    back = bits.astype(np.uint32) << 16
    assert np.isnan(back[:3].view(np.float32)).all()
    # the NaNs are quiet ones with their sign: the quiet bit (0x0040) set, not any other payload bit
    assert bits[:3].tolist() == [0x7FC0, 0xFFC0, 0x7FC0]
    assert bits[3:].tolist() == [0x3F80, 0xC030, 0x7F80]  # 1.0, -2.75, +Inf stays +Inf


def test_a_non_finite_value_is_named_by_its_index_in_the_whole_weight_not_the_chunk():
    # quantizers read row chunks (float_rows(w, start, count)); the message must give the row in w,
    # not the row within the chunk
    from quant.rows import float_rows

    w = np.ones((10, 4), np.float32)
    w[7, 2] = -np.inf
    assert np.array_equal(float_rows(w, 2, 3), w[2:5])
    assert float_rows(w, 8, 5).shape == (2, 4)  # fewer rows at the end
    with pytest.raises(ValueError, match=r"holds -inf at index \(7, 2\)"):
        float_rows(w, 5, 4)


@pytest.mark.parametrize("scheme", ["int8", "int4-sym", "int4-asym"])
def test_row_chunks_of_the_quantizers_give_what_one_pass_gives(monkeypatch, scheme):
    # the quantizers read a tall weight a chunk of rows at a time; the chunk size must not matter,
    # a short last chunk included (10 rows in chunks of 3: 3, 3, 3, 1)
    from quant import int4, int8

    w = np.random.default_rng(7).standard_normal((10, 64)).astype(np.float32)

    def quantize(v):
        if scheme == "int8":
            return BlockInt8Weights.quantize(v, 32)
        return BlockInt4Weights.quantize(v, 32, symmetric=scheme == "int4-sym")

    whole = quantize(w)
    quantize(w[::-1] * 3)  # another weight of the same shape first: a row left unwritten cannot match by chance
    monkeypatch.setattr(int8, "_ROWS_PER_CHUNK", 3)
    monkeypatch.setattr(int4, "_ROWS_PER_CHUNK", 3)
    chunked = quantize(w)
    assert np.array_equal(chunked.data, whole.data) and np.array_equal(chunked.scales, whole.scales)
    if scheme == "int4-asym":
        assert np.array_equal(chunked.zero_points, whole.zero_points)
    # and each row is its own: row r dequantizes close to w[r] (within a step of its blocks' scales)
    step = np.repeat(np.abs(chunked.scales), 32, axis=1)
    assert (np.abs(chunked.dequantize() - w) <= step + 1e-6).all()


def test_nibble_packing_refuses_codes_that_are_not_integers():
    with pytest.raises(ValueError, match="expected integer 4-bit codes, found dtype float64"):
        pack_nibbles(np.array([[1.5, 2.0]]))


def test_nibble_unpacking_refuses_what_is_not_uint8():
    assert unpack_nibbles(np.array([[0x21]], np.uint8)).tolist() == [[1, 2]]
    # 0x121 as int64 would lose its 0x100 and unpack as [1, 2]
    with pytest.raises(ValueError, match=r"expected packed 4-bit codes as a uint8 array .*found dtype int64"):
        unpack_nibbles(np.array([[0x121]], np.int64))
    with pytest.raises(ValueError, match=r"found dtype uint8 and shape \(\)"):
        unpack_nibbles(np.uint8(3))


def test_nibble_packing_refuses_timedelta_codes():
    with pytest.raises(ValueError, match="expected integer 4-bit codes, found dtype timedelta64"):
        pack_nibbles(np.array([[1, 2]], "timedelta64[s]"))


def test_int4_refuses_an_odd_block_that_divides_the_row():
    """21 divides 63, so only the evenness check (two codes share a byte) can refuse it."""
    with pytest.raises(ValueError, match=r"^in_features 63 is not a multiple of the even block_size 21$"):
        BlockInt4Weights.quantize(np.ones((2, 63), np.float32), 21)


def test_hadamard_rotates_each_contiguous_run_of_n_values_on_its_own():
    """A unit vector at index n + 1 (the second value of the second block) becomes column 1 of H,
    in the second block only: pins the block layout, which properties of H alone do not."""
    from quant import hadamard_matrix, rotate_blocks

    n = 4
    x = np.zeros((1, 3 * n), np.float32)
    x[0, n + 1] = 1.0
    expected = np.zeros((1, 3 * n), np.float32)
    expected[0, n:2 * n] = hadamard_matrix(n)[1]
    assert np.allclose(rotate_blocks(x, n), expected, atol=1e-7)
    assert np.allclose(hadamard_matrix(2), np.array([[1, 1], [1, -1]]) / np.sqrt(2))  # Sylvester's, orthonormal


# --- float16 scales (quant/scales.py, --scale-dtype float16) ---

from quant.gptq import gptq_codes  # noqa: E402
from quant.scales import on_float16_grid  # noqa: E402


def _is_float16(values: np.ndarray) -> bool:
    return bool((values.astype(np.float16).astype(np.float32) == values).all())


def test_float16_grid_rounds_each_scale_away_from_zero_to_the_nearest_float16():
    rng = np.random.default_rng(7)
    magnitudes = 10.0 ** rng.uniform(-9, 4.8, 4000)
    s = (magnitudes * rng.choice([-1.0, 1.0], 4000)).astype(np.float32)
    s[:3] = [0.0, 65504.0, -1.0]
    r = on_float16_grid(s)
    assert r.dtype == np.float32 and r.shape == s.shape and _is_float16(r)
    assert (np.abs(r) >= np.abs(s)).all() and (np.sign(r) == np.sign(s)).all()
    # nearest: the float16 next towards zero is already below the scale's magnitude
    below = np.nextafter(np.abs(r).astype(np.float16), np.float16(0)).astype(np.float32)
    assert (below[s != 0] < np.abs(s[s != 0])).all()
    assert r[0] == 0.0 and r[1] == 65504.0 and r[2] == -1.0
    assert on_float16_grid(np.float32([1e-30]))[0] == np.float32(2.0 ** -24)  # below every float16: the smallest


def test_float16_grid_refuses_a_scale_beyond_float16_with_its_index():
    with pytest.raises(ValueError, match=r"block scale 70000 at \(1, 0\) does not fit float16 \(largest 65504\)"):
        on_float16_grid(np.array([[1.0, 2.0], [70000.0, 3.0]], np.float32))
    with pytest.raises(ValueError, match="does not fit float16"):
        on_float16_grid(np.array([65520.0], np.float32))  # rounds to 65504 < 65520, and up is inf


@pytest.mark.parametrize("quantize, chunk", [(lambda w: BlockInt8Weights.quantize(w, 16, scale_dtype="float16"), 8192),
                                             (lambda w: BlockInt4Weights.quantize(w, 16, method="rtn", scale_dtype="float16"), 4096)],
                         ids=["int8", "int4"])
def test_a_scale_beyond_float16_is_named_by_its_row_in_the_whole_weight(quantize, chunk):
    """The quantizers work in row chunks; the error gives the row in the weight, not in its chunk."""
    w = np.ones((chunk + 16, 32), np.float32)
    w[chunk + 3, 20] = 1e9
    with pytest.raises(ValueError, match=rf"block scale -?[0-9.e+]+ at \({chunk + 3}, 1\) does not fit float16"):
        quantize(w)


@pytest.mark.parametrize("hessian", [False, True], ids=["nearest", "gptq"])
def test_int8_with_float16_scales_chooses_its_codes_for_the_stored_scale(hessian):
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((64, 128)) * 10.0 ** rng.uniform(-3, 1, (64, 1))).astype(np.float32)
    x = rng.standard_normal((512, 128)).astype(np.float32)
    h = x.T @ x if hessian else None
    wide = BlockInt8Weights.quantize(w, 32, hessian=h)
    half = BlockInt8Weights.quantize(w, 32, hessian=h, scale_dtype="float16")
    assert _is_float16(half.scales) and np.array_equal(half.scales, on_float16_grid(wide.scales))
    stored = half.data.astype(np.int16) - 128
    assert np.abs(stored).max() <= 127
    if not hessian:  # round to nearest for the stored scale: within half a step of it
        err = np.abs(half.dequantize() - w).reshape(64, 4, 32)
        assert (err <= half.scales[:, :, None] / 2 * (1 + 1e-6)).all()
        # codes chosen for the float32 scale would miss that bound somewhere
        stale = ((wide.data.astype(np.float32) - 128) * half.scales[:, :, None]).reshape(64, 128)
        assert (np.abs(stale - w).reshape(64, 4, 32) > half.scales[:, :, None] / 2 * (1 + 1e-6)).any()
    else:  # GPTQ's error feedback run with the stored scales, not with the float32 ones
        zero_points = np.full(half.scales.shape, 128, np.float32)
        for_stored = gptq_codes(w, h, half.scales, zero_points, 32, 1, 255)
        assert np.array_equal(half.data.reshape(64, 128), for_stored)
        assert not np.array_equal(for_stored, gptq_codes(w, h, wide.scales, zero_points, 32, 1, 255))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_int4_with_float16_scales_stores_exactly_the_scale_its_codes_were_chosen_for(symmetric, method):
    rng = np.random.default_rng(9)
    w = rng.standard_normal((48, 64)).astype(np.float32)
    w[0, :16] = 0.0  # an all-zero block keeps scale 1 (representable)
    half = BlockInt4Weights.quantize(w, 16, symmetric=symmetric, method=method, scale_dtype="float16")
    assert _is_float16(half.scales)
    wide = BlockInt4Weights.quantize(w, 16, symmetric=symmetric, method=method)
    err_half = np.square(half.dequantize() - w).mean()
    err_wide = np.square(wide.dequantize() - w).mean()
    assert err_half <= err_wide * 1.01  # rounding each scale by at most 2^-10 costs almost nothing
    if method == "rtn":  # the codes are round-to-nearest for the stored scale, not for the float32 one
        codes = unpack_nibbles(half.data).astype(np.float32)
        zero_points = half.unpacked_zero_points()[:, :, None].astype(np.float32)
        want = np.clip(np.rint(w.reshape(48, 4, 16) / half.scales[:, :, None]) + zero_points, 0, 15)
        assert np.array_equal(codes, want)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_gptq_with_float16_scales_chooses_its_codes_for_the_stored_scale(symmetric):
    rng = np.random.default_rng(10)
    w = (rng.standard_normal((48, 64)) * 10.0 ** rng.uniform(-3, 1, (48, 1))).astype(np.float32)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    h = x.T @ x
    half = BlockInt4Weights.quantize(w, 16, symmetric=symmetric, hessian=h, scale_dtype="float16")
    wide = BlockInt4Weights.quantize(w, 16, symmetric=symmetric, hessian=h)
    assert _is_float16(half.scales) and not np.array_equal(half.scales, wide.scales)
    zero_points = half.unpacked_zero_points().astype(np.float32)
    for_stored = gptq_codes(w, h, half.scales, zero_points, 16, 0, 15)
    assert np.array_equal(unpack_nibbles(half.data).reshape(48, 64), for_stored)
    assert not np.array_equal(for_stored, gptq_codes(w, h, wide.scales, zero_points, 16, 0, 15))


@pytest.mark.parametrize("quantize", [lambda w, **kw: BlockInt8Weights.quantize(w, 16, **kw),
                                      lambda w, **kw: BlockInt4Weights.quantize(w, 16, **kw)], ids=["int8", "int4"])
def test_block_quantizers_refuse_an_unknown_scale_dtype(quantize):
    with pytest.raises(ValueError, match="scale_dtype must be one of float32, float16, found 'bfloat16'"):
        quantize(np.ones((2, 32), np.float32), scale_dtype="bfloat16")


# API probe (2026-12-06, thirteenth session): inputs the quantizers took silently or named wrongly

@pytest.mark.parametrize("quantize", [lambda w: BlockInt8Weights.quantize(w, 16), lambda w: BlockInt4Weights.quantize(w, 16)],
                         ids=["int8", "int4"])
def test_a_float64_weight_beyond_float32_is_named_as_such_not_as_inf(quantize):
    w = np.zeros((2, 32))
    w[1, 3] = -1e300
    with pytest.raises(ValueError, match=r"^holds -1e\+300 at index \(1, 3\) \(beyond float32's range\)$"):
        quantize(w)
    w[1, 3] = np.inf  # a real Inf keeps its own message
    with pytest.raises(ValueError, match=r"^holds inf at index \(1, 3\)$"):
        quantize(w)


def test_bf16_refuses_a_float64_beyond_float32_instead_of_storing_inf():
    with pytest.raises(ValueError, match=r"^1e\+300 at index \[1\] overflows bfloat16"):
        BF16Weights.quantize(np.array([1.0, 1e300]))
    with pytest.raises(ValueError, match=r"^expected real numbers, found complex128$"):
        BF16Weights.quantize(np.array([1 + 2j]))


@pytest.mark.parametrize("w, message", [(np.ones((2, 16), np.complex64), r"^expected real numbers, found complex64$"),
                                        (np.full((2, 16), None), r"^expected real numbers, found object$"),
                                        (np.ones((2, 0), np.float32), r"^expected a 2-D weight with at least one row and "
                                                                      r"one column, found shape \(2, 0\)$"),
                                        # no rows: numpy's own "zero-size array to reduction operation" before
                                        (np.ones((0, 16), np.float32), r"^expected a 2-D weight with at least one row and "
                                                                       r"one column, found shape \(0, 16\)$")])
def test_weights_that_are_not_real_numbers_or_have_no_rows_or_columns_are_refused(w, message):
    with pytest.raises(ValueError, match=message):
        BlockInt8Weights.quantize(w, 16)
    with pytest.raises(ValueError, match=message):
        BlockInt4Weights.quantize(w, 16)


@pytest.mark.parametrize("block_size", [16.0, "16", None, True])
def test_a_block_size_that_is_not_an_integer_is_named(block_size):
    with pytest.raises(ValueError, match=rf"^block_size must be an integer, found {re.escape(repr(block_size))}$"):
        BlockInt8Weights.quantize(np.ones((2, 16), np.float32), block_size)
    assert BlockInt8Weights.quantize(np.ones((2, 16), np.float32), np.int64(16)).scales.shape == (2, 1)


@pytest.mark.parametrize("qmin, qmax", [(255, 1), (0, 1000), (-5, 255), (3, 3)])
def test_gptq_refuses_a_code_range_uint8_codes_cannot_hold(qmin, qmax):
    from quant.gptq import gptq_codes

    w = np.ones((2, 16), np.float32)
    with pytest.raises(ValueError, match=rf"^GPTQ: the code range must lie in 0 … 255 with qmin < qmax, found qmin "
                                         rf"{qmin}, qmax {qmax}$"):
        gptq_codes(w, np.eye(16), np.ones((2, 1), np.float32), np.full((2, 1), 8), 16, qmin, qmax)


def test_gptq_refuses_zero_points_outside_the_code_range():
    from quant.gptq import gptq_codes

    w = np.ones((2, 16), np.float32)
    for zero_point in (np.nan, 16.0, -1.0):
        with pytest.raises(ValueError, match=rf"^GPTQ: zero points must lie in the code range 0 … 15, found {zero_point}$"):
            gptq_codes(w, np.eye(16), np.ones((2, 1), np.float32), np.full((2, 1), zero_point), 16, 0, 15)


def test_int4_names_a_non_finite_hessian_as_the_hessian():
    # it read "channel_weights must be 64 finite values >= 0" when no channel_weights were given
    h = np.eye(16)
    h[3, 3] = np.nan
    with pytest.raises(ValueError, match=r"^the Hessian holds NaN or Inf$"):
        BlockInt4Weights.quantize(np.ones((2, 16), np.float32), 16, hessian=h)


def test_int4_symmetric_must_be_a_bool_and_hadamard_sizes_integers():
    # "no" was taken as symmetric, True as a Hadamard size of 1
    from quant import hadamard_matrix

    with pytest.raises(ValueError, match=r"^symmetric must be True or False, found 'no'$"):
        BlockInt4Weights.quantize(np.ones((2, 16), np.float32), 16, symmetric="no")
    for size in (True, 4.0, "4"):
        with pytest.raises(ValueError, match=rf"^Hadamard size must be a power of two, found {re.escape(repr(size))}$"):
            hadamard_matrix(size)
    assert hadamard_matrix(np.int64(4)).shape == (4, 4)


def test_bfloat16_weights_are_quantized_as_their_float32_values():
    # review: the check for real numbers refused ml_dtypes' bfloat16 (numpy kind "V")
    import ml_dtypes

    w = np.random.default_rng(5).standard_normal((4, 32)).astype(ml_dtypes.bfloat16)
    for quantize in (lambda x: BlockInt8Weights.quantize(x, 16), lambda x: BlockInt4Weights.quantize(x, 16)):
        got, expected = quantize(w), quantize(w.astype(np.float32))
        assert np.array_equal(got.data, expected.data) and np.array_equal(got.scales, expected.scales)
    assert np.array_equal(BF16Weights.quantize(w).dequantize(), w.astype(np.float32))


def test_an_all_zero_block_gets_the_scale_one_and_zero_codes():
    # mutation review: a scale of 1e-30 gave the same codes, so only the stored scale told them apart
    w = np.zeros((2, 32), np.float32)
    w[1, 16:] = 1.0
    q = BlockInt8Weights.quantize(w, 16)
    assert q.scales[:, 0].tolist() == [1.0, 1.0] and q.scales[0, 1] == 1.0
    assert np.array_equal(q.dequantize(), w)


def test_the_package_loads_its_modules_on_first_use():
    """``import quant`` loads no quantizer (the CLI reads quant.scales only); every public name and
    every submodule still resolves as when the package imported them all."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, quant\n"
            "print(sorted(m for m in sys.modules if m.startswith(('quant.', 'ml_dtypes'))))\n"
            "print(quant.int8.ZERO_POINT, quant.int4.ZERO_POINT, quant.BlockInt8Weights is quant.int8.BlockInt8Weights)\n"
            "print(all(callable(getattr(quant, n)) for n in quant.__all__))\n"
            "try:\n    quant.nope\nexcept AttributeError as e:\n    print(e)\n")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["[]", "128 8 True", "True", "module 'quant' has no attribute 'nope'"]
    import quant

    files = {p.stem for p in Path(quant.__file__).parent.glob("*.py")} - {"__init__"}
    assert set(quant._SUBMODULES) == files  # a new module is reachable as quant.<name> too
    assert set(quant.__all__) | files <= set(dir(quant))


# ---- the public helpers' inputs (a breaker of the Python API, twentieth session) -----------------

@pytest.mark.parametrize("bits, message", [
    (np.array([-16512]), r"^bfloat16 bit pattern -16512 at index \[0\] is outside 0\.\.65535$"),  # wrapped to -1.0
    (np.array([[1, 0x13F80]]), r"^bfloat16 bit pattern 81792 at index \[0, 1\] is outside 0\.\.65535$"),  # 1.0
    (np.array([16256.9]), r"^expected bfloat16 bit patterns as uint16, found float64$"),  # truncated to 1.0
])
def test_bfloat16_bits_that_are_no_uint16_are_refused(bits, message):
    from quant import bfloat16_bits_to_float32

    with pytest.raises(ValueError, match=message):
        bfloat16_bits_to_float32(bits)


def test_bfloat16_bits_in_a_wider_integer_type_read_as_their_value():
    from quant import bfloat16_bits_to_float32

    out = bfloat16_bits_to_float32(np.array([[0x3F80, 0xBF80]], np.int64))
    assert out.dtype == np.float32 and out.tolist() == [[1.0, -1.0]]
    assert bfloat16_bits_to_float32(np.uint16(0x4000)) == 2.0


@pytest.mark.parametrize("helper", ["float32_to_bfloat16_bits", "truncate_to_bfloat16_bits"])
def test_bf16_helpers_refuse_complex_values_and_keep_float64_overflow_as_inf(helper):
    """numpy would drop the imaginary part with only a warning; a float64 beyond float32's range is
    the documented ±Inf (BF16Weights.quantize refuses it instead)."""
    import quant

    convert = getattr(quant, helper)
    with pytest.raises(ValueError, match=r"^expected real numbers, found complex128$"):
        convert(np.array([1 + 2j]))
    assert convert(np.array([1e300, -1e300])).tolist() == [0x7F80, 0xFF80]
    assert convert(np.float32(1.0)).shape == ()


def test_rotate_blocks_refuses_a_0d_value_and_complex_values():
    with pytest.raises(ValueError, match=r"^expected an array with a last axis to rotate, found a 0-d value$"):
        quant_rotate(np.float32(1.0), 1)
    with pytest.raises(ValueError, match=r"^expected real numbers, found complex128$"):
        quant_rotate(np.ones((1, 16), complex), 16)
    out = quant_rotate([[1.0, 1.0]], 2)  # a list, and float64 in: float32 out
    assert out.dtype == np.float32 and np.allclose(out, [[np.sqrt(2), 0.0]])


def quant_rotate(x, n):
    from quant import rotate_blocks

    return rotate_blocks(x, n)


def test_a_nested_list_is_a_weight_and_a_hessian_too():
    """The docstrings take any object with a shape and row slices; a list raised AttributeError."""
    from quant import BlockInt4Weights

    rng = np.random.default_rng(3)
    w = rng.standard_normal((3, 64)).astype(np.float32)
    x = rng.standard_normal((256, 64))
    h = x.T @ x  # correlated inputs: GPTQ's codes differ from round-to-nearest
    for cls in (BlockInt8Weights, BlockInt4Weights):
        from_list = cls.quantize(w.tolist(), 32)
        from_array = cls.quantize(w, 32)
        assert np.array_equal(from_list.data, from_array.data) and np.array_equal(from_list.scales, from_array.scales)
        with_list = cls.quantize(w, 32, hessian=h.tolist())
        with_array = cls.quantize(w, 32, hessian=h)
        assert np.array_equal(with_list.data, with_array.data), cls.__name__
        assert not np.array_equal(with_array.data, from_array.data), cls.__name__  # the Hessian was used


@pytest.mark.parametrize("channel_weights, message", [
    (np.full(64, 1e300), r"^channel_weights must be 64 finite values >= 0, found 1e\+300 at index 0 "
                         r"\(beyond float32's range\)$"),
    ("abc", r"^channel_weights: expected real numbers, found <U3$"),
    (np.r_[np.ones(63), -2.0], r"^channel_weights must be 64 finite values >= 0, found -2.0 at index 63$"),
    (np.ones(32), r"^channel_weights must be 64 finite values >= 0, found shape \(32,\)$"),
])
def test_bad_channel_weights_are_named_as_given(channel_weights, message):
    from quant import BlockInt4Weights

    with pytest.raises(ValueError, match=message):
        BlockInt4Weights.quantize(np.ones((2, 64), np.float32), 16, channel_weights=channel_weights)


def test_channel_weights_with_round_to_nearest_are_refused_not_ignored():
    """An API user: method "rtn" took channel_weights and used them nowhere (the same codes as
    without them); with "mse" they change the chosen scales."""
    from quant import BlockInt4Weights

    w = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    weights = np.random.default_rng(4).uniform(0.0, 10.0, 64) ** 3  # uneven within each block
    with pytest.raises(ValueError, match=r"^channel_weights weight the error of the clipping search \(method 'mse'\); "
                                         r"method 'rtn' searches nothing$"):
        BlockInt4Weights.quantize(w, 16, method="rtn", channel_weights=weights)
    plain = BlockInt4Weights.quantize(w, 16, method="mse")
    weighted = BlockInt4Weights.quantize(w, 16, method="mse", channel_weights=weights)
    assert not np.array_equal(plain.scales, weighted.scales)


def test_a_complex_hessian_is_refused_not_cast():
    with pytest.raises(ValueError, match=r"^the Hessian: expected real numbers, found complex128$"):
        BlockInt8Weights.quantize(np.ones((2, 64), np.float32), 16, hessian=np.eye(64, dtype=complex))


def test_inverse_cholesky_takes_a_numpy_damp_and_leaves_its_input_alone():
    from quant.gptq import inverse_cholesky

    h = np.diag([4.0, 0.0, 1.0])
    kept = h.copy()
    u = inverse_cholesky(h, damp=np.float32(0.5))
    assert np.array_equal(h, kept)  # the dead channel's edit is made on a copy
    # (H + λ I)⁻¹ with the dead diagonal set to 1 and λ = 0.5 · mean(4, 1, 1) = 1: diag 1/5, 1/2, 1/2
    assert np.allclose(u.T @ u, np.diag([0.2, 0.5, 0.5]), atol=1e-6)


def test_rotate_hessian_refuses_a_matrix_that_is_not_square():
    from quant.gptq import rotate_hessian

    with pytest.raises(ValueError, match=r"^expected a square Hessian, found shape \(4, 8\)$"):
        rotate_hessian(np.ones((4, 8)), 2)


def test_a_float16_overflow_message_shows_the_value_above_the_limit():
    """65504.004 (float32) printed as 65504 read "block scale 65504 ... does not fit float16 (largest
    65504)" (a break-it run): enough digits to show it is above."""
    from quant.scales import on_float16_grid

    with pytest.raises(ValueError, match=r"^block scale 65504\.0039 at \(0,\) does not fit float16 \(largest 65504\)$"):
        on_float16_grid(np.array([65504.004], np.float32))


def test_rotating_a_block_that_overflows_gives_inf_without_a_warning():
    import warnings

    from quant.hadamard import rotate_blocks

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rotated = rotate_blocks(np.full((1, 16), 3e38, np.float32), 16)
    assert np.isposinf(rotated[0, 0])  # the sum of 16 × 3e38, scaled: beyond float32, as documented


def test_hand_built_block_weights_with_another_layout_are_refused():
    """An API user: a BlockInt8Weights of int8 codes, one whose block_size disagrees with its
    arrays, or a BlockInt4Weights with unpacked zero points were taken and dequantized to other
    values without a word. quantize's own results still build."""
    w = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q8 = BlockInt8Weights.quantize(w, 32)
    q4 = BlockInt4Weights.quantize(w, 32, symmetric=False)
    assert q4.zero_points.shape == (4, 1)
    for build, message in [
            (lambda: BlockInt8Weights(q8.data.view(np.int8), q8.scales, 32),
             "BlockInt8Weights: data must be uint8 [4, 2, 32], found int8 [4, 2, 32]"),
            (lambda: BlockInt8Weights(q8.data, q8.scales, 16), "data must be uint8 [4, 2, 16], found uint8 [4, 2, 32]"),
            (lambda: BlockInt8Weights(q8.data, q8.scales.astype(np.float64), 32),
             "BlockInt8Weights: scales must be float32 [4, 2], found float64 [4, 2]"),
            (lambda: BlockInt8Weights(q8.data, q8.scales, 32.0), "BlockInt8Weights: block_size must be an integer > 0, "
                                                                 "found 32.0"),
            (lambda: BlockInt8Weights(q8.data.tolist(), q8.scales, 32),
             "BlockInt8Weights: data must be a uint8 array [N, K // block_size, block_size], found list"),
            (lambda: BlockInt4Weights(q4.data[0], q4.scales, None, 32),
             "BlockInt4Weights: data must be a uint8 array [N, K // block_size, block_size // 2], found uint8 [2, 16]"),
            (lambda: BlockInt4Weights(np.zeros((2, 1, 7), np.uint8), np.ones((2, 1), np.float32), None, 15),
             "BlockInt4Weights: block_size must be even (two codes a byte), found 15"),
            (lambda: BlockInt8Weights(np.zeros((2, 1, 0), np.uint8), np.ones((2, 1), np.float32), 0),
             "BlockInt8Weights: block_size must be an integer > 0, found 0"),
            (lambda: BlockInt4Weights(q4.data, q4.scales, q4.unpacked_zero_points(), 32),
             "BlockInt4Weights: zero_points must be uint8 [4, 1], found uint8 [4, 2]"),
            (lambda: BlockInt4Weights(q4.data, q4.scales, q4.zero_points, 64),
             "BlockInt4Weights: data must be uint8 [4, 2, 32], found uint8 [4, 2, 16]"),
            (lambda: BlockInt4Weights(q4.data, q4.scales[:, :1], None, 32), "scales must be float32 [4, 2], found "
                                                                            "float32 [4, 1]")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            build()
    assert np.array_equal(BlockInt8Weights(q8.data, q8.scales, 32).dequantize(), q8.dequantize())
    assert np.array_equal(BlockInt4Weights(q4.data, q4.scales, q4.zero_points, 32).dequantize(), q4.dequantize())
