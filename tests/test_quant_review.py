"""Tests that kill the surviving mutants of the mutation review of quant/int4.py, quant/gptq.py,
quant/rows.py, gemma_export/weights.py and gemma_export/calibration.py (each test names its mutant).

Found by the mutation review of 2026-12-06 (fourteenth session): 95 mutations, 22 survived, 15 of
them real gaps, each killed by a test here."""

from __future__ import annotations

import conftest
import numpy as np
import pytest

from quant import BlockInt4Weights, BlockInt8Weights, rotate_blocks
from quant.gptq import gptq_codes, inverse_cholesky, rotate_hessian
from quant.int4 import CLIP_RATIOS, unpack_nibbles


# ---- quant/int4.py -------------------------------------------------------------------------------

@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_all_zero_block_gets_the_scale_one(symmetric):
    """Mutant i08 (an all-zero symmetric block's scale 1 -> 1e-30): the codes are the same, only the
    stored scale tells them apart (as tests/test_quant.py checks for int8); with GPTQ a tiny scale
    also turns the error fed into that block into full-range codes."""
    w = np.zeros((2, 64), np.float32)
    w[1, 32:] = np.linspace(-1.0, 1.0, 32)
    for method in ("rtn", "mse"):
        q = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method=method)
        assert q.scales[0].tolist() == [1.0, 1.0] and q.scales[1, 0] == 1.0, method
        assert (q.dequantize()[0] == 0).all() and (q.dequantize()[1, :32] == 0).all()
    # GPTQ: errors of the non-zero block move into the zero block's columns; with scale 1 they round to 0
    x = np.random.default_rng(0).standard_normal((256, 64)) @ np.random.default_rng(1).standard_normal((64, 64))
    q = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, hessian=x.T @ x)
    assert np.abs(q.dequantize()[1, :32]).max() <= 1.0


def test_int4_rounds_exact_halves_to_even():
    """Mutants i17/i18 (np.rint -> floor(x + 0.5), round half up, ggml's rule): the module's
    docstring says round half to even. Blocks whose scale is a power of two (1/8) make every other
    value an exact half step."""
    k = np.arange(-7, 7)  # halves -6.5 ... 6.5
    # symmetric: the largest magnitude is 1.0 (positive), so scale = 1 / -8 = -0.125
    block = np.r_[1.0, (k + 0.5) * 0.125, np.zeros(17)].astype(np.float32)
    q = BlockInt4Weights.quantize(block[None], 32, symmetric=True, method="rtn")
    assert q.scales[0, 0] == -0.125
    codes = unpack_nibbles(q.data).reshape(32).astype(int) - 8
    assert codes[1:15].tolist() == (-np.rint(k + 0.5)).astype(int).tolist()  # numpy's rint: half to even
    assert codes[1:15].tolist() == [6, 6, 4, 4, 2, 2, 0, 0, -2, -2, -4, -4, -6, -6]
    # asymmetric: lo = -0.875, hi = 1.0, scale = 1.875 / 15 = 0.125, zero point 7
    block = np.r_[-0.875, 1.0, (k + 0.5) * 0.125, np.zeros(16)].astype(np.float32)
    q = BlockInt4Weights.quantize(block[None], 32, symmetric=False, method="rtn")
    assert q.scales[0, 0] == 0.125 and q.unpacked_zero_points()[0, 0] == 7
    codes = unpack_nibbles(q.data).reshape(32).astype(int)
    assert codes[2:16].tolist() == (np.rint(k + 0.5) + 7).astype(int).tolist()
    assert codes[2:16].tolist() == [1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13]


@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_asymmetric_float16_zero_points_are_chosen_for_the_stored_scale(method):
    """Mutants i33 (zero point from the float32 scale, then the scale moved to float16's grid) and
    i24 (the search keeps the winning ratio's scale but the first ratio's zero point): the docstring
    says each candidate scale is moved to the grid "before its zero point". The existing test reads
    the zero points back from the result, so it checked the codes, not the zero points. Each block's
    (scale, zero point) must be one candidate's pair: ``s = grid(c (hi - lo) / 15)``,
    ``z = clip(rint(-c lo / s), 0, 15)``."""
    from quant.scales import on_float16_grid

    rng = np.random.default_rng(11)
    w = (rng.standard_normal((1024, 64)) * 10.0 ** rng.uniform(-3, 1, (1024, 1))).astype(np.float32)
    q = BlockInt4Weights.quantize(w, 16, symmetric=False, method=method, scale_dtype="float16")
    blocks = w.reshape(1024, 4, 16)
    lo = np.minimum(blocks.min(axis=2), 0.0).astype(np.float64)
    hi = np.maximum(blocks.max(axis=2), 0.0).astype(np.float64)
    zero_points = q.unpacked_zero_points()
    found = np.zeros(q.scales.shape, bool)
    for c in CLIP_RATIOS if method == "mse" else CLIP_RATIOS[:1]:
        scale = on_float16_grid(((c * hi - c * lo) / 15.0).astype(np.float32))
        found |= (scale == q.scales) & (np.clip(np.rint(-(c * lo) / scale), 0, 15) == zero_points)
    assert found.all(), np.argwhere(~found)[:5]


# ---- quant/gptq.py -------------------------------------------------------------------------------

def test_inverse_cholesky_falls_back_to_float64_when_float32_cannot_factor():
    """Mutant g07 (no float64 fallback): a Hessian beyond float32's range factors in float64 only
    (low practical weight: calibration refuses statistics that overflow float32)."""
    h = np.eye(4) * 1e39
    with np.errstate(over="ignore"):  # float32's attempt overflows
        u = inverse_cholesky(h)
    assert u.dtype == np.float32 and np.isfinite(u).all()
    assert np.allclose(u, np.eye(4) / np.sqrt(1.01e39), rtol=1e-5, atol=0)


def test_an_all_negative_asymmetric_block_has_its_zero_at_the_top_code():
    """Mutants i14 (zero point clipped to 14) and g16 (GPTQ refuses a zero point equal to qmax): an
    asymmetric int4 block of negative values only has its zero at code 15 (no test had an
    all-negative block; the existing one is all positive, zero point 0)."""
    rng = np.random.default_rng(2)
    w = -np.abs(rng.standard_normal((8, 64))).astype(np.float32)
    for method in ("rtn", "mse"):
        q = BlockInt4Weights.quantize(w, 32, symmetric=False, method=method)
        assert (q.unpacked_zero_points() == 15).all(), method
    # round to nearest: every value within half a step (zero point 14 puts the block's minimum a step off)
    q = BlockInt4Weights.quantize(w, 32, symmetric=False, method="rtn")
    err = np.abs(q.dequantize() - w).reshape(8, 2, 32)
    assert (err <= q.scales[..., None] / 2 * (1 + 1e-6)).all()
    x = rng.standard_normal((256, 64))
    q = BlockInt4Weights.quantize(w, 32, symmetric=False, hessian=x.T @ x)
    assert (q.unpacked_zero_points() == 15).all()
    assert np.abs(q.dequantize() - w).mean() <= np.abs(q.scales).max()


def test_gptq_refuses_a_zero_scale():
    """Mutant g17 (a zero scale accepted): the docstring promises a ValueError; with 0 every code is
    NaN / inf cast to uint8."""
    w = np.ones((2, 32), np.float32)
    scales = np.array([[1.0, 0.0], [1.0, 1.0]], np.float32)
    with pytest.raises(ValueError, match=r"^GPTQ: scales must be finite and nonzero, found 0\.0$"):
        gptq_codes(w, np.eye(32), scales, np.full((2, 2), 8.0), 16, 0, 15)


# ---- quant/rows.py -------------------------------------------------------------------------------

def test_boolean_weights_are_read_as_zeros_and_ones():
    """Mutant r01 (bool dropped from the real kinds): check_real's docstring accepts bools."""
    w = np.eye(2, 16, dtype=bool)
    assert np.array_equal(BlockInt8Weights.quantize(w, 16).dequantize(), w.astype(np.float32))
    assert np.array_equal(BlockInt4Weights.quantize(w, 16).dequantize(), w.astype(np.float32))


# ---- gemma_export/weights.py ---------------------------------------------------------------------

def _stored(fmt, ref, k):
    """The arrays ``fmt.linear`` stores for ``ref`` (its lazy initializers evaluated)."""
    import onnx_ir as ir

    from gemma_export.graph import GraphBuilder

    g = GraphBuilder()
    fmt.linear(g, g.input("x", ir.DataType.FLOAT, [1, 1, k]), ref)
    return {name: value.const_value.numpy() for name, value in g.initializers.items() if name.startswith(ref.name)}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_calibrated_codes_use_the_rotated_hessian_with_the_default_damping(dtype):
    """Mutants w01 (the Hessian of the unrotated inputs used for the rotated weight ``W H``) and w13
    (damping 10x): GPTQ codes are still valid codes, so the export tests' logit tolerances pass; here
    the stored codes must be exactly quant's GPTQ with ``Hd H Hd`` and the default damping."""
    from gemma_export.calibration import Calibration
    from gemma_export.checkpoint import TensorRef
    from gemma_export.weights import weight_format

    rng = np.random.default_rng(3)
    k, n, tokens = 128, 48, 200
    x = rng.standard_normal((tokens, k)).astype(np.float32) @ rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    x[:, :3] *= 8.0
    w = rng.standard_normal((n, k)).astype(np.float32)
    name = "model.layers.0.mlp.down_proj.weight"
    ref = TensorRef(name, (n, k), f"test:{name}", lambda: w)
    calibration = Calibration(inputs={name: x.astype(np.float16)}, tokens=tokens, source="test")
    fmt = weight_format(dtype, block_size=32, hadamard_size=64, calibration=calibration)
    stored = _stored(fmt, ref, k)
    h = calibration.hessian(name)
    rotated = rotate_blocks(w, 64)
    scheme = BlockInt8Weights if dtype == "int8" else BlockInt4Weights
    expected = scheme.quantize(rotated, 32, hessian=rotate_hessian(h, 64))
    assert np.array_equal(stored[name], expected.data) and np.array_equal(stored[name + "_scales"], expected.scales)
    assert not np.array_equal(stored[name], scheme.quantize(rotated, 32, hessian=h).data)  # the check can fail


def test_a_rotated_row_that_overflows_is_named_by_its_row_in_the_weight():
    """Mutant w02 (the row within the chunk instead of the row in the weight): the existing CLI test's
    weight has fewer rows than one chunk, so both numbers were 3."""
    from gemma_export.weights import _RotatedRows

    w = np.ones((8, 8), np.float32)
    w[5] = 3e38
    rows = _RotatedRows(w, 4)
    assert np.array_equal(rows[0:4], rotate_blocks(w[:4], 4))
    with pytest.raises(ValueError, match=r"^row 5 overflows float32 in the 4-wide Hadamard rotation"):
        rows[4:8]


# ---- gemma_export/calibration.py -----------------------------------------------------------------

def test_calibration_attention_is_stable_for_large_scores(tmp_path):
    """Mutant c18 (softmax without subtracting the row maximum): scores above ~88 overflow float32's
    exp to inf, and inf / inf is NaN. Large q/k norm gains give such scores; transformers' softmax
    (and the graph's) stays finite, and so must the calibration pass."""
    import torch

    from gemma_export.calibration import forward
    from gemma_export.sources import open_source

    model = conftest.make_tiny_model(seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(14.0)
            layer.self_attn.k_norm.weight.fill_(14.0)
    ids = list(np.random.default_rng(1).integers(3, 96, 20))
    final = forward(open_source(conftest.save_tiny(model, tmp_path / "src")), ids)
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    assert np.isfinite(final).all()
    assert np.abs(final - expected).max() <= 1e-3 * np.abs(expected).max()


def test_statistics_that_would_overflow_over_the_tokens_are_refused(monkeypatch):
    """Mutant c09 (the overflow check ``T · reach² ≥ float32 max`` without ``T``): each square
    (1e38) fits float32, their sum over 40 tokens (4e39) does not, and past T = 2 K the kept
    ``Xᵀ X`` is float32: the mutant stored Inf in it instead of naming the input."""
    import gemma_export.calibration as calibration
    from gemma_export.errors import NumericError

    def fake_forward(value):
        def forward(checkpoint, token_ids, record, progress):
            record("model.layers.0.mlp.down_proj.weight", np.full((len(token_ids), 8), value, np.float32))
        return forward

    monkeypatch.setattr(calibration, "forward", fake_forward(1e18))  # 40 · 1e36: fits
    kept = calibration.collect(None, list(range(40)), "test")
    assert np.isfinite(kept.hessians["model.layers.0.mlp.down_proj.weight"]).all()
    monkeypatch.setattr(calibration, "forward", fake_forward(1e19))
    with pytest.raises(NumericError, match=r"down_proj\.weight's input would overflow float32: its values reach 1e\+19"):
        calibration.collect(None, list(range(40)), "test")


def test_gram_is_computed_in_float64():
    """Mutant c14 (``Xᵀ X`` accumulated in float32): the docstring promises float64; a float32 sum
    of many products drops the small ones (here 1 + 1e-8 per token)."""
    from gemma_export.calibration import gram

    x = np.ones((1000, 2), np.float32)
    x[:, 1] = 1e-4
    g = gram(x)
    assert g.dtype == np.float64
    expected = x.astype(np.float64).T @ x.astype(np.float64)
    assert np.array_equal(g, expected)
