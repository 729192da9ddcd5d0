"""GPTQ rounding (quant/gptq.py) and the calibration pass that feeds it (gemma_export/calibration.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from quant import BlockInt4Weights, BlockInt8Weights, hadamard_matrix
from quant import gptq
from quant.gptq import gptq_codes, inverse_cholesky, rotate_hessian
from quant.int4 import unpack_nibbles


def _correlated(rng, tokens: int, k: int) -> np.ndarray:
    """Calibration-like inputs: correlated channels and a few large ones."""
    x = rng.standard_normal((tokens, k)).astype(np.float32) @ rng.standard_normal((k, k)).astype(np.float32)
    x[:, :3] *= 8.0
    return x / np.sqrt(k)


def _output_error(w, w_hat, x) -> float:
    return float(np.linalg.norm((w - w_hat) @ x.T))


def test_identity_hessian_gives_round_to_nearest_int8_and_int4():
    # with uncorrelated inputs there is no error to move: GPTQ must reduce to round-to-nearest
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    eye = np.eye(128)
    assert np.array_equal(BlockInt8Weights.quantize(w, 32, hessian=eye).data, BlockInt8Weights.quantize(w, 32).data)
    for symmetric in (True, False):
        plain = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method="mse")
        with_eye = BlockInt4Weights.quantize(w, 32, symmetric=symmetric, method="mse", hessian=eye)
        assert np.array_equal(plain.data, with_eye.data) and np.array_equal(plain.scales, with_eye.scales)
    # exact halves (scale 2^-4: each block's largest value is 127 / 16) round to even, as round to
    # nearest does; GPTQ rounding them up went unseen (mutation audit)
    halves = np.tile(np.r_[127.0, np.arange(31) - 15.5], (4, 4)).astype(np.float32) / 16
    codes = BlockInt8Weights.quantize(halves, 32, hessian=eye).data
    assert np.array_equal(codes, BlockInt8Weights.quantize(halves, 32).data)
    assert np.array_equal(np.asarray(codes)[0, 0, 1:5], [128 - 16, 128 - 14, 128 - 14, 128 - 12])  # -15.5, -14.5, ...


@pytest.mark.parametrize("scheme", ["int8", "int4-sym", "int4-asym"])
def test_gptq_cuts_the_output_error_on_correlated_inputs(scheme):
    rng = np.random.default_rng(1)
    k = 256
    x = _correlated(rng, 1024, k)
    w = rng.standard_normal((96, k)).astype(np.float32)
    hessian = x.T.astype(np.float64) @ x
    if scheme == "int8":
        rtn, gq = BlockInt8Weights.quantize(w, 32), BlockInt8Weights.quantize(w, 32, hessian=hessian)
    else:
        sym = scheme == "int4-sym"
        rtn = BlockInt4Weights.quantize(w, 32, symmetric=sym, method="mse", channel_weights=np.diagonal(hessian))
        gq = BlockInt4Weights.quantize(w, 32, symmetric=sym, method="mse", hessian=hessian)
    assert np.array_equal(rtn.scales, gq.scales)  # same scales, other codes
    before, after = _output_error(w, rtn.dequantize(), x), _output_error(w, gq.dequantize(), x)
    assert after < 0.8 * before, (before, after)


def _gptq_by_the_paper(w, hessian, scales, zero_points, block_size, qmin, qmax, order):
    """Algorithm 1 of Frantar et al. (arXiv:2210.17323) written out one column at a time in float64,
    with no lazy batch updates and no row chunks: the reference :func:`gptq_codes` must reproduce.
    ``order`` is the column order (GPTQ's act order permutes H and W alike; scales stay per block)."""
    h = np.asarray(hessian, np.float64)[np.ix_(order, order)].copy()
    dead = np.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += np.eye(len(h)) * 0.01 * np.mean(np.diagonal(h))   # the paper's 1% damping
    u = np.linalg.cholesky(np.linalg.inv(h)).T            # upper factor of H^-1
    cols = np.asarray(w, np.float64)[:, order].copy()
    codes = np.empty(w.shape, np.int64)
    for j, column in enumerate(order):
        s, z = scales[:, column // block_size], zero_points[:, column // block_size]
        q = np.clip(np.rint(cols[:, j] / s) + z, qmin, qmax)
        codes[:, column] = q
        error = (cols[:, j] - (q - z) * s) / u[j, j]
        cols[:, j + 1:] -= np.outer(error, u[j, j + 1:])
    return codes


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k, block", [(128, 32), (48, 16)])  # 48: not a multiple of the 32-column lazy batch
def test_gptq_codes_follow_the_papers_algorithm(act_order, k, block):
    # the batched, chunked float32 implementation against the plain float64 one: the same codes
    # except where a value lies within float32 noise of a rounding boundary
    assert gptq._LAZY == 32
    rng = np.random.default_rng(7)
    n = 40
    x = _correlated(rng, 512, k)
    hessian = x.T.astype(np.float64) @ x
    w = rng.standard_normal((n, k)).astype(np.float32)
    scales = (np.abs(w).reshape(n, k // block, block).max(axis=2) / 7).astype(np.float32)
    zero_points = np.full_like(scales, 8.0)
    order = np.argsort(-np.diagonal(hessian), kind="stable") if act_order else np.arange(k)
    expected = _gptq_by_the_paper(w, hessian, scales, zero_points, block, 0, 15, order)
    got = gptq_codes(w, hessian, scales, zero_points, block, 0, 15, act_order=act_order)
    assert np.mean(got == expected) > 0.99 and np.abs(got.astype(np.int64) - expected).max() <= 1
    plain = np.clip(np.rint(w / np.repeat(scales, block, axis=1)) + 8, 0, 15)
    assert np.mean(got != plain) > 0.2  # and the error feedback did change many codes


def test_gptq_gain_holds_on_held_out_tokens():
    rng = np.random.default_rng(2)
    k = 128
    mix = rng.standard_normal((k, k)).astype(np.float32) / np.sqrt(k)
    fit, held_out = (rng.standard_normal((n, k)).astype(np.float32) @ mix for n in (1024, 1024))
    w = rng.standard_normal((64, k)).astype(np.float32)
    gq = BlockInt8Weights.quantize(w, 32, hessian=fit.T.astype(np.float64) @ fit).dequantize()
    rtn = BlockInt8Weights.quantize(w, 32).dequantize()
    assert _output_error(w, gq, held_out) < 0.8 * _output_error(w, rtn, held_out)


def test_codes_stay_in_range_and_a_dead_channel_is_rounded_to_nearest():
    rng = np.random.default_rng(3)
    k = 64
    x = _correlated(rng, 256, k)
    x[:, 5] = 0.0                       # a channel no calibration token uses
    w = rng.standard_normal((32, k)).astype(np.float32) * 3
    hessian = x.T.astype(np.float64) @ x
    q8 = BlockInt8Weights.quantize(w, 32, hessian=hessian)
    assert q8.data.min() >= 1  # symmetric int8 around 128 never uses code 0
    assert np.isfinite(q8.dequantize()).all()
    # the unused channel neither receives nor passes on errors: it is rounded to nearest
    u = inverse_cholesky(hessian)
    assert np.allclose(u[5, 6:], 0.0) and np.allclose(u[:5, 5], 0.0)
    assert np.array_equal(q8.data[:, 0, 5], BlockInt8Weights.quantize(w, 32).data[:, 0, 5])
    assert not np.array_equal(q8.data[:, 0, 6:], BlockInt8Weights.quantize(w, 32).data[:, 0, 6:])
    # int4: the dead channel again gets its nearest code under the block's (activation-weighted) scale
    q4 = BlockInt4Weights.quantize(w, 16, symmetric=True, hessian=hessian)
    codes4 = unpack_nibbles(q4.data).reshape(32, k)
    nearest = np.clip(np.rint(w / np.repeat(q4.scales, 16, axis=1)) + 8, 0, 15)
    assert np.array_equal(codes4[:, 5], nearest[:, 5]) and not np.array_equal(codes4[:, 6:16], nearest[:, 6:16])
    # gptq_codes itself clips to the range it is given, even where error feedback pushes past it
    big = np.full((4, 32), 7.9, np.float32)  # every weight at the top of the range: errors accumulate upward
    codes = gptq_codes(big, np.eye(32) + 0.9, np.ones((4, 1), np.float32), np.full((4, 1), 8.0, np.float32),
                       32, 0, 15)
    assert codes.min() >= 0 and codes.max() == 15


def test_damping_is_taken_after_a_dead_channels_diagonal_is_set_to_one():
    # GPTQ's reference: H[dead, dead] = 1, then lambda = 1% of the mean diagonal, this 1 included.
    # With small activations (diagonal ~0.2) the 1 moves lambda by ~60%: the factor shows it.
    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 8)) * 0.1
    x[:, 3] = 0.0
    h = x.T @ x
    fixed = h.copy()
    fixed[3, 3] = 1.0
    damped = fixed + np.eye(8) * 0.01 * np.mean(np.diagonal(fixed))
    expected = np.linalg.cholesky(np.linalg.inv(damped)).T
    u = inverse_cholesky(h)
    assert np.allclose(u, expected, rtol=1e-4, atol=1e-5)
    assert u[3, 3] == pytest.approx(1 / np.sqrt(damped[3, 3]), rel=1e-5)


def test_row_chunks_give_the_same_codes(monkeypatch):
    rng = np.random.default_rng(4)
    x = _correlated(rng, 512, 64)
    w = rng.standard_normal((50, 64)).astype(np.float32)
    hessian = x.T.astype(np.float64) @ x
    whole = BlockInt8Weights.quantize(w, 32, hessian=hessian).data
    monkeypatch.setattr(gptq, "_ROWS_PER_CHUNK", 7)
    assert np.array_equal(BlockInt8Weights.quantize(w, 32, hessian=hessian).data, whole)


def test_rotate_hessian_is_hd_h_hd():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((100, 128))
    h = x.T @ x
    hd = np.kron(np.eye(2), hadamard_matrix(64).astype(np.float64))
    assert np.allclose(rotate_hessian(h, 64), hd @ h @ hd)
    with pytest.raises(ValueError, match="multiple of the Hadamard size 64"):
        rotate_hessian(h[:96, :96], 64)
    with pytest.raises(ValueError, match="power of two"):
        rotate_hessian(h, 48)


@pytest.mark.parametrize("hessian, message", [
    (np.ones((3, 4)), "square"),
    (np.full((4, 4), np.nan), "NaN"),
    (np.array([[1.0, 2.0], [2.0, 1.0]]), "positive definite"),   # indefinite, positive diagonal
])
def test_bad_hessians_are_named(hessian, message):
    with pytest.raises(ValueError, match=message):
        inverse_cholesky(hessian)


@pytest.mark.parametrize("damp", [0.0, -0.01, float("nan"), float("inf"), "0.01", True])
def test_a_damping_that_is_not_positive_is_refused(damp):
    # λ = damp · mean(diag H) must be > 0: with 0 a rank-deficient H would not be invertible. A string
    # raised TypeError, and Inf was reported as a Hessian that is not positive definite.
    with pytest.raises(ValueError, match=rf"^damp must be a finite number > 0, found {re.escape(repr(damp))}$"):
        inverse_cholesky(np.eye(4), damp=damp)


def test_mismatched_shapes_are_refused():
    w = np.ones((4, 64), np.float32)
    with pytest.raises(ValueError, match="disagree"):
        gptq_codes(w, np.eye(32), np.ones((4, 2), np.float32), np.zeros((4, 2)), 32, 0, 255)
    with pytest.raises(ValueError, match="disagree"):
        BlockInt8Weights.quantize(w, 32, hessian=np.eye(63))


# --- calibration pass --------------------------------------------------------------------------

def test_calibration_forward_matches_transformers(tiny_dir, tiny_model):
    import torch

    from gemma_export.calibration import collect
    from gemma_export.sources import open_source

    ids = list(np.random.default_rng(0).integers(3, 96, 20))  # longer than the sliding window (6)
    cal = collect(open_source(tiny_dir), ids, "test")
    c = tiny_model.config
    names = [f"model.layers.{i}.{n}.weight" for i in range(c.num_hidden_layers) for n in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    seen = {}  # what transformers feeds each linear layer, by weight name
    hooks = [module.register_forward_pre_hook(lambda m, args, name=f"{name}.weight": seen.__setitem__(name, args[0][0].numpy()))
             for name, module in tiny_model.named_modules() if f"{name}.weight" in names]
    try:
        with torch.no_grad():
            out = tiny_model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for hook in hooks:
            hook.remove()
    final = out.hidden_states[-1][0].numpy()
    got = cal.inputs["model.embed_tokens.weight"].astype(np.float32)
    assert np.abs(got - final).max() < 2e-2 * np.abs(final).max()   # stored as float16
    # every projection's recorded input, o_proj's (heads and tokens laid out) and down_proj's included
    assert set(seen) == set(names)
    for name in names:
        expected, recorded = seen[name], cal.inputs[name].astype(np.float32)
        assert recorded.shape == expected.shape, name
        assert np.abs(recorded - expected).max() < 2e-2 * np.abs(expected).max(), name
    assert set(cal.inputs) == set(names) | {"model.embed_tokens.weight"}
    assert cal.inputs[names[0]] is cal.inputs[names[1]]                     # q/k/v share one array
    assert cal.hessian(names[3]).shape == (c.num_attention_heads * c.head_dim,) * 2
    assert cal.hessian(names[6]).shape == (c.intermediate_size,) * 2
    assert cal.hessian("nothing") is None


def test_calibration_forward_matches_transformers_away_from_the_neutral_config(tmp_path):
    """The tiny model's rms_norm_eps (1e-6) and query_pre_attn_scalar (== head_dim) hide an eps
    outside the square root or a 1/sqrt(head_dim) score scale; here both are moved."""
    import torch

    from conftest import make_tiny_model, save_tiny
    from gemma_export.calibration import collect
    from gemma_export.sources import open_source

    model = make_tiny_model(seed=3, rms_norm_eps=0.1, query_pre_attn_scalar=64)
    ids = list(np.random.default_rng(0).integers(3, 96, 20))
    cal = collect(open_source(save_tiny(model, tmp_path / "src")), ids, "test")
    with torch.no_grad():
        final = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    got = cal.inputs["model.embed_tokens.weight"].astype(np.float32)
    assert np.abs(got - final).max() < 2e-2 * np.abs(final).max()   # stored as float16


def test_calibration_rejects_ids_outside_the_vocabulary(tiny_dir):
    from gemma_export.calibration import collect
    from gemma_export.errors import GemmaExportError
    from gemma_export.sources import open_source

    with pytest.raises(GemmaExportError, match=r"\[0, 96\)"):
        collect(open_source(tiny_dir), [3, 96], "test")
    with pytest.raises(GemmaExportError, match="calibration needs at least 2 tokens, found 1"):
        collect(open_source(tiny_dir), [3], "test")


def test_an_untied_head_gets_the_final_hidden_state_under_its_own_name(tmp_path):
    """Untied, the LM head is its own weight (lm_head.weight): the final normed hidden state is its
    input, and the embedding table (read by Gather only) gets no statistics."""
    import torch

    from conftest import make_tiny_model, save_tiny
    from gemma_export.calibration import collect
    from gemma_export.sources import open_source

    model = make_tiny_model(seed=4, tie_word_embeddings=False)
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 96, 20)]
    cal = collect(open_source(save_tiny(model, tmp_path / "src")), ids, "test")
    assert "lm_head.weight" in cal.inputs and "model.embed_tokens.weight" not in cal.inputs
    with torch.no_grad():
        final = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    got = cal.inputs["lm_head.weight"].astype(np.float32)
    assert np.abs(got - final).max() < 2e-2 * np.abs(final).max()   # stored as float16



def test_inputs_beyond_float16s_range_are_kept_in_float32(tiny_dir, tmp_path):
    """Activations are kept as float16 only below its largest value (65,504): an input reaching
    ~67,000 (layer 0's q/k/v, from a large input_layernorm gain) is kept exactly, in float32."""
    from conftest import broken_copy
    from gemma_export.calibration import collect
    from gemma_export.sources import open_source

    ids = [int(i) for i in np.random.default_rng(0).integers(3, 96, 20)]
    gain = "model.layers.0.input_layernorm.weight"

    def edit(tensors):
        x = tensors["model.embed_tokens.weight"][ids].astype(np.float64) * np.sqrt(64)  # embed_scale
        normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        tensors[gain] = np.full(64, 67_000.0 / np.abs(normed).max() - 1.0, np.float32)

    cal = collect(open_source(broken_copy(tiny_dir, tmp_path / "src", edit_tensors=edit)), ids, "test")
    q = cal.inputs["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == np.float32 and np.isfinite(q).all()
    assert 65_504 < np.abs(q).max() == pytest.approx(67_000, rel=1e-3)
    assert cal.inputs["model.layers.0.mlp.gate_proj.weight"].dtype == np.float16  # the others stay small


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_dir, tmp_path_factory):
    import shutil

    from conftest import write_char_tokenizer

    src = tmp_path_factory.mktemp("gptq") / "src"
    shutil.copytree(tiny_dir, src)
    write_char_tokenizer(src)
    return src


def test_export_calibrates_by_default_and_records_it(tiny_int8_export):
    # the shared fixture is an export with no calibration option and a source with a tokenizer
    from gemma_export.calibration import DEFAULT_CALIBRATION_TOKENS

    record = json.loads((tiny_int8_export / "manifest.json").read_text())["quantization"]["calibration"]
    # the default 4,096 tokens, capped by the tiny model's max_position_embeddings (one sequence)
    assert DEFAULT_CALIBRATION_TOKENS == 4096 and record["method"] == "gptq" and record["tokens"] == 256
    assert "pydoc_data" in record["text"]


def test_a_default_export_stores_gptq_codes_not_round_to_nearest(tiny_int8_export, tmp_path):
    """What the manifest records is what was done: the same source and options with --no-calibrate
    give other codes, and re-running the default gives the same bytes."""
    from gemma_export.exporter import export

    source = Path(json.loads((tiny_int8_export / "manifest.json").read_text())["source"]["path"])
    plain = export(source, tmp_path / "rtn", "int8", block_size=16, calibrate=False).out_dir
    again = export(source, tmp_path / "again", "int8", block_size=16).out_dir
    data = (tiny_int8_export / "model.onnx.data").read_bytes()
    assert (again / "model.onnx.data").read_bytes() == data
    rtn = (plain / "model.onnx.data").read_bytes()
    assert len(rtn) == len(data)
    differing = np.count_nonzero(np.frombuffer(rtn, np.uint8) != np.frombuffer(data, np.uint8))
    assert differing > 0.05 * len(data), differing  # GPTQ moves many codes, not a few bytes


def test_calibrated_codes_are_closer_to_fp32_than_round_to_nearest(tiny_with_tokenizer, tiny_model, text_file, tmp_path):
    from conftest import reference_logits
    from gemma_export.exporter import export
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    calibrated = export(tiny_with_tokenizer, tmp_path / "gptq", "int8", block_size=16, table_block_size=16,
                        calibration_text=text_file, calibration_tokens=250).out_dir
    plain = export(tiny_with_tokenizer, tmp_path / "rtn", "int8", block_size=16, table_block_size=16, calibrate=False).out_dir
    record = json.loads((calibrated / "manifest.json").read_text())["quantization"]["calibration"]
    assert record["method"] == "gptq" and record["tokens"] == 250 and str(text_file) in record["text"]
    assert json.loads((plain / "manifest.json").read_text())["quantization"]["calibration"] is None
    # the point of GPTQ: logits nearer transformers fp32 on text like the calibration text
    ids = load_tokenizer(calibrated).encode(text_file.read_text()).ids[:120]
    expected = reference_logits(tiny_model, np.asarray([ids]))[0]
    error = {name: float(np.mean((OnnxDecoder(folder).teacher_forced_logits(ids) - expected) ** 2))
             for name, folder in (("gptq", calibrated), ("rtn", plain))}
    assert error["gptq"] < 0.95 * error["rtn"], error  # 0.92 x measured (tiny random model, 250 tokens)


def test_a_folder_source_parses_its_tokenizer_once(tiny_with_tokenizer, text_file, tmp_path, monkeypatch):
    # the folder reader validates tokenizer.json; calibration reuses that parse instead of a second one
    import tokenizers

    import gemma_export.tokenizer as tokenizer_module
    from gemma_export.exporter import export

    real, parses = tokenizers.Tokenizer, []

    class Counting:
        @staticmethod
        def from_str(text):
            parses.append(len(text))
            return real.from_str(text)

    monkeypatch.setattr(tokenizers, "Tokenizer", Counting)
    monkeypatch.setattr(tokenizer_module, "Tokenizer", Counting)
    export(tiny_with_tokenizer, tmp_path / "once", "int8", block_size=16, table_block_size=16,
           calibration_text=text_file, calibration_tokens=64)
    assert parses == [(tiny_with_tokenizer / "tokenizer.json").stat().st_size]


def test_calibrated_int8_and_int4_track_transformers(tiny_with_tokenizer, tiny_model, text_file, tmp_path):
    # GPTQ moves rounding errors around; the export must still compute the same model
    from conftest import reference_logits
    from gemma_export.exporter import export
    from gemma_export.runtime import OnnxDecoder

    ids = np.random.default_rng(3).integers(3, 96, (1, 12))
    expected = reference_logits(tiny_model, ids)[0, -1]
    # measured: int8 0.019, int4 0.23 of the largest logit; a scale off by a factor (int4 at 0.5 x:
    # 0.58) or a zero point off by one (int8: 0.04) must fail
    for dtype, tolerance in (("int8", 0.03), ("int4", 0.35)):
        out = export(tiny_with_tokenizer, tmp_path / dtype, dtype, block_size=16, table_block_size=16,
                     calibration_text=text_file).out_dir
        decoder = OnnxDecoder(out)
        logits, _ = decoder.forward(ids, np.ones_like(ids), np.arange(12)[None], decoder.empty_cache(1))
        assert np.abs(logits[0, -1] - expected).max() < tolerance * np.abs(expected).max(), dtype


def test_a_short_calibration_text_is_refused_or_recorded(tiny_with_tokenizer, tmp_path):
    from gemma_export.errors import ConfigError
    from gemma_export.exporter import export

    short = tmp_path / "short.txt"
    short.write_text("tiny text")          # 9 characters + <bos>: 10 tokens with the character tokenizer
    # the text, the tokenizer and the three ways out are named (a GGUF whose tokenizer gave 2 tokens of the
    # default text blamed Python's documentation alone)
    with pytest.raises(ConfigError, match=r"short\.txt: 10 token\(s\) after tokenizing with .*'s tokenizer; calibration "
                                          r"needs at least 16: give a longer --calibration-text, the model's own "
                                          r"tokenizer with --tokenizer, or --no-calibrate for round-to-nearest codes$"):
        export(tiny_with_tokenizer, tmp_path / "a", "int8", block_size=16, table_block_size=16, calibration_text=short)
    short.write_text("a text of forty characters, give or take")   # 40 characters + <bos>
    notes = []
    result = export(tiny_with_tokenizer, tmp_path / "b", "int8", block_size=16, table_block_size=16,
                    calibration_text=short, calibration_tokens=500, status=notes.append)
    assert result.calibration["tokens"] == 41 and "(the whole text; 500 asked)" in result.calibration["text"]
    # (the character tokenizer's 51 tokens for 96 rows have their own note)
    assert [n for n in notes if n.startswith("note:") and "calibration" in n] == [
        f"note: {short} gives only 41 calibration tokens; GPTQ's statistics are thin below 1,024 (the default "
        "text gives 4,096): give a longer --calibration-text, or --no-calibrate for round-to-nearest codes"]
    # a short length asked for on purpose gets no note
    notes.clear()
    export(tiny_with_tokenizer, tmp_path / "c", "int8", block_size=16, table_block_size=16,
           calibration_text=short, calibration_tokens=20, status=notes.append)
    assert not [n for n in notes if n.startswith("note:") and "calibration" in n]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "c", "short.txt"]


def test_a_tokenizer_of_another_vocabulary_is_named_when_calibrating(tiny_with_tokenizer, text_file, tmp_path):
    """A tokenizer.json whose ids pass the weights' vocab_size: named with its largest id and the
    vocab_size (it said only "calibration token ids must lie in [0, 96)"), when the source is opened,
    for every dtype, before any text is tokenized."""
    import json
    import shutil

    from gemma_export.errors import ConfigError
    from gemma_export.exporter import export

    src = tmp_path / "src"
    shutil.copytree(tiny_with_tokenizer, src)
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"].update({t: i + 200 for t, i in tokenizer["model"]["vocab"].items() if i >= 4})
    (src / "tokenizer.json").write_text(json.dumps(tokenizer))
    for dtype in ("int8", "fp32"):
        with pytest.raises(ConfigError, match=r"src/tokenizer.json: token id 2\d\d \('.+'\) is outside the model's "
                                              r"vocab_size 96 \(ids 0 to 95\); the tokenizer does not belong to these "
                                              r"weights"):
            export(src, tmp_path / "out", dtype, **({"block_size": 16, "table_block_size": 16,
                                                     "calibration_text": text_file} if dtype == "int8" else {}))
        assert not (tmp_path / "out").exists()


def test_calibrate_needs_a_tokenizer_and_a_quantized_dtype(tiny_dir, tmp_path):
    from gemma_export.errors import ConfigError, SourceNotFoundError
    from gemma_export.exporter import export

    with pytest.raises(ConfigError, match="needs a tokenizer"):
        export(tiny_dir, tmp_path / "a", "int8", block_size=16, table_block_size=16, calibrate=True)
    with pytest.raises(ConfigError, match="int8 and int4, not fp32"):
        export(tiny_dir, tmp_path / "b", "fp32", calibrate=True)
    with pytest.raises(SourceNotFoundError, match="no such calibration text"):
        export(tiny_dir, tmp_path / "c", "int8", calibrate=True, calibration_text=tmp_path / "missing.txt")
    assert not any(tmp_path.iterdir())


def test_a_calibration_text_for_a_source_without_tokenizer_is_refused_not_ignored(tiny_dir, text_file, tmp_path):
    from gemma_export.errors import ConfigError
    from gemma_export.exporter import export

    with pytest.raises(ConfigError, match="needs a tokenizer"):
        export(tiny_dir, tmp_path / "a", "int8", block_size=16, table_block_size=16, calibration_text=text_file)
    assert not (tmp_path / "a").exists()


def test_the_default_text_is_read_only_when_the_source_calibrates(tiny_dir, tmp_path, monkeypatch):
    """A tokenizer-less source is rounded to nearest by default: the default calibration text
    (pydoc_data, missing from some Pythons) is never needed, so never read."""
    import gemma_export.exporter as exporter

    monkeypatch.setattr(exporter, "read_calibration_text", lambda *a: pytest.fail("read the calibration text"))
    result = exporter.export(tiny_dir, tmp_path / "out", "int8", block_size=16, table_block_size=16)
    assert result.calibration is None


def test_calibration_forward_ignores_attention_softcapping_like_the_graph(tmp_path):
    """The calibration pass runs the exported graph's math: transformers' Gemma3Attention (and our
    builder) ignore attn_logit_softcapping, so a config that sets it changes nothing here either."""
    import torch
    from conftest import make_tiny_model, save_tiny

    from gemma_export.calibration import forward
    from gemma_export.sources import open_source

    model = make_tiny_model(attn_logit_softcapping=0.05)  # would flatten every score if applied
    ids = list(np.random.default_rng(1).integers(3, 96, 20))
    final = forward(open_source(save_tiny(model, tmp_path / "src")), ids)
    with torch.no_grad():
        expected = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    assert np.abs(final - expected).max() <= 1e-4 * np.abs(expected).max()


def test_long_calibration_keeps_the_gram_matrix_not_the_activations(tiny_dir):
    """Past T = 2 K an input is kept as Xᵀ X (float32 [K, K]); it equals the Gram matrix of the
    activations the forward pass produced, and weights that read one input share one matrix."""
    from gemma_export.calibration import collect, forward, gram
    from gemma_export.sources import open_source

    checkpoint = open_source(tiny_dir)
    c = checkpoint.config
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 96, 2 * c.hidden_size + 5)]
    seen = {}
    forward(checkpoint, ids, lambda name, x: seen.setdefault(name, x.copy()))
    cal = collect(checkpoint, ids, "test")
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    down = "model.layers.0.mlp.down_proj.weight"
    assert q in cal.hessians and q not in cal.inputs and cal.hessians[q].dtype == np.float32
    assert cal.statistics(q) is cal.statistics(k)
    expected = gram(seen[q])
    assert np.abs(cal.hessian(q) - expected).max() <= 1e-5 * np.abs(expected).max()
    # the MLP's wider input stays as activations while T <= 2 K
    assert c.intermediate_size * 2 >= len(ids) and down in cal.inputs
    assert np.abs(cal.hessian(down) - gram(seen[down])).max() <= 2e-2 * np.abs(gram(seen[down])).max()


def test_calibration_forward_in_query_blocks_matches_transformers(tiny_dir, tiny_model):
    """Longer than two query blocks (256 each): later blocks see keys from the window's start on
    sliding layers and from position 0 on full ones, as transformers' eager attention does."""
    import torch

    from gemma_export.calibration import _QUERY_BLOCK, forward
    from gemma_export.sources import open_source

    ids = [int(i) for i in np.random.default_rng(2).integers(3, 96, 2 * _QUERY_BLOCK + 37)]
    final = forward(open_source(tiny_dir), ids)
    with torch.no_grad():
        expected = tiny_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].numpy()
    assert np.abs(final - expected).max() < 1e-4 * np.abs(expected).max()


def test_act_order_puts_each_code_back_in_its_column():
    # a diagonal Hessian with unequal energies: a non-trivial order, but no error to move, so the
    # codes must be round-to-nearest in every column (a wrong un-permutation would scramble them)
    rng = np.random.default_rng(4)
    k = 96
    w = rng.standard_normal((40, k)).astype(np.float32)
    hessian = np.diag(rng.uniform(0.1, 10.0, k))
    scales = np.abs(w).reshape(40, 3, 32).max(axis=2) / 127
    natural = gptq_codes(w, hessian, scales, np.full((40, 3), 128.0), 32, 1, 255, act_order=False)
    ordered = gptq_codes(w, hessian, scales, np.full((40, 3), 128.0), 32, 1, 255)
    assert not np.array_equal(gptq.Hessian(hessian).ordered[0], np.arange(k))
    assert np.array_equal(natural, ordered)
    assert np.array_equal(ordered, BlockInt8Weights.quantize(w, 32).data.reshape(40, k))


def test_act_order_rounds_the_strongest_inputs_first_and_is_within_2_percent():
    rng = np.random.default_rng(5)
    k = 128
    x = _correlated(rng, 1024, k)
    x[:, 64:67] *= 6.0  # strong channels away from the front: the natural order reaches them late
    w = rng.standard_normal((64, k)).astype(np.float32)
    hessian = x.T.astype(np.float64) @ x
    scales = np.abs(w).reshape(64, 4, 32).max(axis=2) / 127
    zero = np.full((64, 4), 128.0)
    order = gptq.Hessian(hessian).ordered[0]
    assert set(order[:6]) == {0, 1, 2, 64, 65, 66}
    errors = {}
    for act_order in (False, True):
        codes = gptq_codes(w, hessian, scales, zero, 32, 1, 255, act_order=act_order)
        w_hat = (codes.astype(np.float32) - 128).reshape(64, 4, 32) * scales[:, :, None]
        errors[act_order] = _output_error(w, w_hat.reshape(64, k), x)
    rtn = _output_error(w, BlockInt8Weights.quantize(w, 32).dequantize(), x)
    assert errors[True] < 0.8 * rtn and errors[False] < 0.8 * rtn
    # act order may lose a little on a given matrix (it wins on the real model, docs/quality.md): 2% at most
    assert errors[True] <= 1.02 * errors[False], errors


@pytest.mark.parametrize("weight, value, dtype, message", [
    # finite but huge: the activations after it overflow float32 further on (in another tensor's
    # input); the error names the input where it shows and the weight that caused it
    ("model.layers.1.mlp.gate_proj.weight", 1e30, "int8",
     "statistics (sums of squares) of model.layers.1.mlp.down_proj.weight's input would overflow float32"),
    ("model.layers.1.self_attn.o_proj.weight", 3.4e38, "int4",
     "the input of model.layers.1.mlp.gate_proj.weight is not finite (float32 overflow)"),
])
def test_a_huge_weight_is_named_when_calibration_overflows(tiny_with_tokenizer, tmp_path, weight, value, dtype, message):
    import shutil

    from safetensors.numpy import load_file, save_file
    from typer.testing import CliRunner

    from gemma_export.cli import app

    src = tmp_path / "src"
    shutil.copytree(tiny_with_tokenizer, src)
    tensors = load_file(src / "model.safetensors")
    tensors[weight][3, 5] = value
    save_file(tensors, src / "model.safetensors")
    before = (src / "model.safetensors").read_bytes()
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--source", str(src), "--dtype", dtype, "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert message in line and f"the largest weight read before it is {weight}[3, 5] = {value:.3g}" in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert (src / "model.safetensors").read_bytes() == before



def test_at_exactly_t_equal_2k_the_activations_are_kept(tiny_dir):
    # the boundary of the rule "Xᵀ X when T > 2 K": at T = 2 K the [T, K] float16 activations take no
    # more memory than the float32 [K, K] matrix, and are kept as activations
    from gemma_export.calibration import collect
    from gemma_export.sources import open_source

    checkpoint = open_source(tiny_dir)
    ids = [int(i) for i in np.random.default_rng(3).integers(3, 96, 2 * checkpoint.config.hidden_size)]
    cal = collect(checkpoint, ids, "test")
    q = "model.layers.0.self_attn.q_proj.weight"
    assert q in cal.inputs and q not in cal.hessians and cal.inputs[q].shape == (len(ids), 64)


def test_a_finite_weight_that_overflows_in_the_hadamard_rotation_is_named_as_such(tiny_dir, tmp_path):
    # each value is finite, but a rotated block sums 64 of them / 8: 3e38 · 8 overflows float32. The
    # error says so, with the row in the source's numbering, instead of "holds inf" at an index that
    # only exists after the rotation
    import shutil

    from safetensors.numpy import load_file, save_file
    from typer.testing import CliRunner

    from gemma_export.cli import app

    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    tensors = load_file(src / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][3, :] = 3e38
    save_file(tensors, src / "model.safetensors")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--source", str(src), "--dtype", "int8", "--hadamard", "64", "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert f"cannot quantize '{name}': row 3 overflows float32 in the 64-wide Hadamard rotation (largest |w| in the " \
           "row: 3e+38); export with --hadamard 0" in line, line
    assert not out.exists()
    # without the rotation the same weight quantizes (int8 scales are max / 127)
    result = CliRunner().invoke(app, ["--source", str(src), "--dtype", "int8", "--hadamard", "0", "--out", str(out)])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("scale", [1e-100, 1e100])
def test_a_hessian_scaled_beyond_float32_is_named_as_such_not_as_indefinite(scale):
    """A positive definite Hessian times 1e100 was refused as "not positive definite after damping"
    (its float32 factor overflowed; a break-it run). Within the documented range it quantizes as at
    scale 1."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 64)).astype(np.float32)
    x = rng.standard_normal((256, 64))
    h = x.T @ x
    import warnings

    with warnings.catch_warnings():  # numpy's overflow warnings stay inside (a review)
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"^the Hessian's scale is beyond float32's range for its factor "
                                             r"\(largest diagonal [0-9.]+e[+-]\d+\); scale it towards 1$"):
            BlockInt8Weights.quantize(w, 16, hessian=h * scale)
    assert np.array_equal(BlockInt8Weights.quantize(w, 16, hessian=h * 1e20).data,
                          BlockInt8Weights.quantize(w, 16, hessian=h).data)


def test_calibration_takes_no_more_tokens_than_the_model_has_positions(tiny_with_tokenizer, text_file, tmp_path):
    """Calibration runs its text as one sequence: a model of 32 positions was calibrated on 4,096 tokens
    (positions it never takes; a break-it run). It uses the first 32, with a note; below 16 positions
    it is refused, naming the field and --no-calibrate."""
    import json
    import shutil

    from gemma_export.errors import ConfigError
    from gemma_export.exporter import export
    from gemma_export.runtime import load_tokenizer

    def with_positions(n):
        src = tmp_path / f"src{n}"
        shutil.copytree(tiny_with_tokenizer, src, dirs_exist_ok=True)
        config = json.loads((src / "config.json").read_text())
        config["max_position_embeddings"] = n
        (src / "config.json").write_text(json.dumps(config))
        return src

    notes = []
    result = export(with_positions(32), tmp_path / "a", "int8", block_size=16, table_block_size=16,
                    calibration_text=text_file, status=notes.append)
    assert result.calibration["tokens"] == 32
    # recorded as what it is (a review: "first 32 tokens (the whole text; 4096 asked)"), and no advice
    # to give a longer text, which cannot help
    assert result.calibration["text"] == f"{text_file}, first 32 tokens (max_position_embeddings; 4096 asked)"
    assert [n for n in notes if n.startswith("note:") and "calibration" in n] == [
        "note: calibration runs its text as one sequence, and the model takes 32 positions (max_position_embeddings): "
        f"the first 32 of the {len(load_tokenizer(tmp_path / 'a').encode(text_file.read_text()).ids):,} tokens are used"]
    with pytest.raises(ConfigError, match=r"src8: max_position_embeddings is 8; calibration runs its text as one "
                                          r"sequence and needs at least 16 positions: export with --no-calibrate"):
        export(with_positions(8), tmp_path / "b", "int8", block_size=16, table_block_size=16, calibration_text=text_file)
    assert not (tmp_path / "b").exists()
    short = tmp_path / "short.txt"
    short.write_text("tiny")  # a text too short as well: the positions are named, since no text helps
    with pytest.raises(ConfigError, match=r"src8: max_position_embeddings is 8; calibration runs its text"):
        export(with_positions(8), tmp_path / "b", "int8", block_size=16, table_block_size=16, calibration_text=short)
    export(with_positions(8), tmp_path / "c", "int8", block_size=16, table_block_size=16, calibrate=False)
