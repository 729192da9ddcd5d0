"""Reference exports (StableHLO MLIR globals + a flat 1-D safetensors archive) as a --source.

The fixtures are written here in the board pipeline's format (the board team's StableHLO/IREE export)
from a tiny transformers model: globals in trace order with sparse ``tN`` names, values flat,
bf16 by truncation or int8 per row with ``tN_scale``, norms holding ``1 + w``, RoPE tables and
sliding-window masks between the weights, and the tied table stored a second time for the head.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import make_tiny_model, reference_logits, write_char_tokenizer
from jax_reference import global_name, save_flat_archive
from gemma_export.cli import app
from gemma_export.errors import FormatError
from gemma_export.exporter import export
from gemma_export.runtime import OnnxDecoder
from gemma_export.sources import open_source
from gemma_export.sources.mlir import parse_mlir

SEQ = 24


def _truncate_bf16(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _trace(model):
    """(kind, array) in the tracer's order: embedding, per layer (norms as 1 + w), final norm, head."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    c = model.config
    half = c.head_dim // 2
    items = [("weight", sd["model.embed_tokens.weight"])]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        norm = lambda n: ("weight", sd[p + n] + 1.0)  # noqa: E731
        items += [norm("input_layernorm.weight"), ("weight", sd[p + "self_attn.q_proj.weight"]),
                  norm("self_attn.q_norm.weight"), ("weight", sd[p + "self_attn.k_proj.weight"]),
                  norm("self_attn.k_norm.weight"), ("weight", sd[p + "self_attn.v_proj.weight"])]
        angles = np.outer(np.arange(SEQ), np.linspace(0.1, 1.0, half)).astype(np.float32)
        items += [("const", np.cos(angles)), ("const", np.sin(angles))]  # RoPE tables [seq, head_dim/2]
        items += [("weight", sd[p + "self_attn.o_proj.weight"]), norm("post_attention_layernorm.weight"),
                  norm("pre_feedforward_layernorm.weight"), ("weight", sd[p + "mlp.gate_proj.weight"]),
                  ("weight", sd[p + "mlp.up_proj.weight"]), ("weight", sd[p + "mlp.down_proj.weight"]),
                  norm("post_feedforward_layernorm.weight")]
        if c.layer_types[i] == "sliding_attention":
            items.append(("const", np.tril(np.ones((SEQ, SEQ), np.float32))))  # a mask [seq, seq]
    items.append(("weight", sd["model.norm.weight"] + 1.0))
    items.append(("weight", sd["lm_head.weight"]))  # the tied table a second time
    return items


def write_reference(model, folder, dtype="bf16", drop_head=False, edit=None):
    """Write ``gemma.mlir`` + ``gemma.safetensors``; returns the MLIR path."""
    folder.mkdir(parents=True, exist_ok=True)
    items = _trace(model)[:-1] if drop_head else _trace(model)
    lines, archive = ["module @gemma {"], {}
    for n, (_, array) in enumerate(items):
        name = global_name(n)  # sparse, increasing
        if dtype == "int8" and array.ndim == 2:
            scale = np.abs(array).max(axis=1) / 127
            scale[scale == 0] = 1
            q = np.clip(np.rint(array / scale[:, None]), -127, 127).astype(np.int8)
            archive[name], archive[name + "_scale"] = q.reshape(-1), scale.astype(np.float32)
            lines.append(f'  util.global private @{name} = #flow.parameter.named<"model"::"{name}"> : '
                         f'tensor<{"x".join(map(str, array.shape))}xi8>')
            lines.append(f'  util.global private @{name}_scale = #flow.parameter.named<"model"::"{name}_scale"> : '
                         f'tensor<{array.shape[0]}xf32>')
        else:
            archive[name] = _truncate_bf16(array).reshape(-1)
            lines.append(f'  util.global private @{name} = #flow.parameter.named<"model"::"{name}"> : '
                         f'tensor<{"x".join(map(str, array.shape))}xbf16>')
    # the program loads every global, in trace order, as a traced export's does
    loads = [f"    %{m.group(1)} = util.global.load @{m.group(1)} : tensor<{m.group(2)}>"
             for m in (re.search(r"@(\w+) = .*: tensor<([^>]*)>", line) for line in lines[1:])]
    lines += [f"  func.func @gemma(%arg0: tensor<1x{SEQ}xi32>) -> tensor<{SEQ}xi32> {{", *loads,
              "    return %r : tensor<24xi32>", "  }", "}"]
    if edit:
        edit(lines, archive)
    (folder / "gemma.mlir").write_text("\n".join(lines) + "\n")
    save_flat_archive(archive, folder / "gemma.safetensors")
    return folder / "gemma.mlir"


def _dequantized_model(model, dtype):
    """transformers model holding exactly the values the reference archive carries."""
    import copy

    import torch

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in out.named_parameters():
            w = p.detach().numpy().astype(np.float32)
            stored = w + 1.0 if "norm" in name else w
            if dtype == "int8" and w.ndim == 2:
                scale = np.abs(stored).max(axis=1) / 127
                scale[scale == 0] = 1
                stored = np.clip(np.rint(stored / scale[:, None]), -127, 127) * scale[:, None]
            else:
                stored = (_truncate_bf16(stored).astype(np.uint32) << 16).view(np.float32)
            p.copy_(torch.from_numpy((stored - 1.0 if "norm" in name else stored).astype(np.float32)))
    return out


@pytest.fixture(scope="module")
def ref_model():
    # The MLIR carries no configuration: the reader assumes Gemma 3's (window 512, global layers
    # i % 6 == 5, RoPE bases 10,000 / 1,000,000), so the tiny model follows them.
    return make_tiny_model(seed=3, sliding_window=512, layer_types=["sliding_attention"] * 4)


def test_the_flat_archive_gets_the_umask_mode_not_0600(tmp_path):
    """safetensors' save_file creates its file 0600: a reference archive written on a shared build
    host could be read by its owner only, while the .mlir beside it got the umask's 0644."""
    import os

    umask = os.umask(0o022)
    try:
        save_flat_archive({"t0": np.zeros(4, np.float32)}, tmp_path / "a.safetensors")
        os.umask(0o027)
        save_flat_archive({"t0": np.zeros(4, np.float32)}, tmp_path / "b.safetensors")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.safetensors").stat().st_mode & 0o777 == 0o640


def test_parse_reads_globals_and_signatures(ref_model, tmp_path):
    module = parse_mlir(write_reference(ref_model, tmp_path / "ref"))
    assert module.globals[0].name == "t0" and module.globals[0].shape == (96, 64)
    assert module.globals[0].element_type == "bf16" and module.globals[0].scope == "model"
    assert module.functions[0].name == "gemma"
    assert module.functions[0].arguments == ("1x24xi32",) and module.functions[0].results == ("24xi32",)


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_reference_source_exports_the_archive_weights(ref_model, tmp_path, dtype):
    mlir = write_reference(ref_model, tmp_path / "ref", dtype)
    ckpt = open_source(mlir)
    assert ckpt.config.num_hidden_layers == 4 and ckpt.config.head_dim == 16
    assert ckpt.config.num_key_value_heads == 2 and ckpt.config.intermediate_size == 128
    assert ckpt.tied  # the second table equals the first: collapsed
    assert ckpt.identity["skipped_constants"] == 4 * 2 + 4  # RoPE tables + masks of the 4 sliding layers
    result = export(mlir, tmp_path / "out", "fp32", all_logits=True)
    assert result.table_initializers == 1
    ids = np.random.default_rng(1).integers(3, 96, (1, 20)).astype(np.int64)
    dec = OnnxDecoder(result.out_dir)
    logits, _ = dec.forward(ids, np.ones_like(ids), np.arange(20)[None], dec.empty_cache(1))
    expected = reference_logits(_dequantized_model(ref_model, dtype), ids)
    assert np.abs(logits - expected).max() <= 1e-4
    assert np.abs(logits - reference_logits(ref_model, ids)).max() > 1e-3  # the archive's rounding is seen


def test_different_head_is_kept_untied(ref_model, tmp_path):
    def edit(lines, archive):
        last = [k for k in archive if not k.endswith("_scale")][-1]
        archive[last] = archive[last].copy()
        archive[last][5] ^= 0x0100  # one value differs
    ckpt = open_source(write_reference(ref_model, tmp_path / "ref", edit=edit))
    assert not ckpt.tied and "lm_head.weight" in ckpt.tensors


@pytest.mark.parametrize("edit, message", [
    (lambda lines, archive: archive.pop("t8"), "global @t8 is bound to key 't8', which"),
    (lambda lines, archive: archive.update(extra=np.zeros(3, np.uint16)), "key 'extra' has no util.global"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "32xbf16")),
     "key 't8' holds BF16 [64] (128 bytes); gemma.mlir:3 declares tensor<32xbf16> (64 bytes of BF16)"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "?xbf16")), "dimension '?'"),
    (lambda lines, archive: lines.append(lines[1]), "global @t0 declared twice"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace('"model"::', '"weights"::')),
     "global @t8 is bound to scope 'weights', expected 'model'"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "0xbf16")), "not a static size > 0"),
    # digits of other scripts: a superscript (int() refuses it) and full-width ones (int() reads 64)
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "6\u00b2xbf16")), "not a static size > 0"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "\uff16\uff14xbf16")), "not a static size > 0"),
    # element counts past int64 (a traceback) or wrapping around it (64 elements) are refused
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "64x99999999999999999999xbf16")),
     "tensor<64x99999999999999999999xbf16> has 6.4e"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("64xbf16", "64x288230376151711745xbf16")),
     "tensor<64x288230376151711745xbf16> has 1.84e"),
    # a parameter global in a form the reader does not know is named on its line, not later as a
    # "key without util.global"
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("@t8 =", "@t8 {inlining_policy} =")),
     "gemma.mlir:3: cannot read this util.global"),
    (lambda lines, archive: lines.__setitem__(2, lines[2].replace("#flow.parameter", "#stream.parameter")),
     "gemma.mlir:3: cannot read this util.global"),
    # k_proj declared transposed (same bytes): it was taken for down_proj, and only a correct later
    # global was named; the message now says which globals gave the sizes, @t29 among them
    (lambda lines, archive: lines.__setitem__(5, lines[5].replace("32x64xbf16", "64x32xbf16")),
     "gemma.mlir:14: global @t84 tensor<128x64> fits no Gemma 3 weight after 10 mapped (0 whole layers); the sizes "
     "were read from the first globals' shapes (hidden 64 from @t0, 4 heads and 2 KV heads of 16 from @t16 and @t42, "
     "intermediate 32 from @t29), so check those declarations too"),
])
def test_bad_reference_exports_are_named(ref_model, tmp_path, edit, message):
    mlir = write_reference(ref_model, tmp_path / "ref", edit=edit)
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]").replace("?", r"\?")):
        open_source(mlir)


def test_truncated_trace_is_refused_and_cli_leaves_nothing(ref_model, tmp_path):
    def edit(lines, archive):  # drop the final norm and the head: the trace ends inside a layer
        for _ in range(2):
            last = max(i for i, line in enumerate(lines) if "util.global private" in line)
            name = lines.pop(last).split("@")[1].split(" ")[0]
            archive.pop(name)
            lines[:] = [line for line in lines if f"util.global.load @{name} " not in line]
    mlir = write_reference(ref_model, tmp_path / "ref", edit=edit)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--source", str(mlir), "--dtype", "fp32", "--out", str(out)])
    assert result.exit_code == 2 and "without a final norm" in result.output
    assert not out.exists()


def test_manifest_records_the_reference(ref_model, tmp_path):
    mlir = write_reference(ref_model, tmp_path / "ref", "int8")
    out = export(mlir, tmp_path / "out", "int8", block_size=16).out_dir
    source = json.loads((out / "manifest.json").read_text())["source"]
    assert source["kind"] == "reference-mlir" and source["duplicate_table_collapsed"] is True


def test_a_reference_export_with_a_tokenizer_given_makes_a_folder_that_verifies_and_generates(ref_model, tmp_path):
    """A reference .mlir carries no tokenizer: --tokenizer puts the model's own in the export, listed in
    its manifest (so verify and bundle accept the folder), and the int8 codes are calibrated with it."""
    mlir = write_reference(ref_model, tmp_path / "ref", "bf16")
    (tmp_path / "tok").mkdir()
    tok = write_char_tokenizer(tmp_path / "tok")
    (tok / "tokenizer_config.json").write_text('{"add_bos_token": true}')
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["--source", str(mlir), "--tokenizer", str(tok / "tokenizer.json"), "--dtype", "int8",
                                 "--block-size", "16", "--table-block-size", "16", "--calibration-tokens", "64",
                                 "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "note: no tokenizer" not in result.output and "calibration: GPTQ on" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest["files"])
    assert manifest["quantization"]["calibration"]["tokens"] == 64
    assert (out / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert runner.invoke(app, ["verify", str(out)]).exit_code == 0
    result = runner.invoke(app, ["generate", "--model", str(out), "--prompt", "the fox", "--max-new-tokens", "3"])
    assert result.exit_code == 0 and result.output.startswith("the fox"), result.output


def test_inspect_reads_the_mlir_and_flags_the_table_stored_twice(tmp_path):
    from gemma_export.inspect import inspect_path

    model = make_tiny_model(seed=4, vocab_size=1024, sliding_window=512, layer_types=["sliding_attention"] * 4)
    mlir = write_reference(model, tmp_path / "ref")
    report = inspect_path(mlir)
    names = [g.name for g in parse_mlir(mlir).globals]
    assert report.format == "mlir" and [t.name for t in report.tensors] == names
    assert report.tensors[0].shape == (1024, 64)  # the declared shape, not the archive's flat [count]
    table = 1024 * 64
    expected = sum(a.size for _, a in _trace(model))  # every global of the fixture, the table twice
    assert report.total_elements == expected and report.total_bytes == 2 * expected  # all bf16
    assert [t.elements for t in report.tensors] == [a.size for _, a in _trace(model)]
    assert [g.names for g in report.duplicates] == [("t0", names[-1])]  # embedding and head, 128 KiB each
    assert report.duplicates[0].wasted_bytes == table * 2
    printed = CliRunner().invoke(app, ["inspect", str(mlir)]).stdout
    assert f"globals: {len(names)}, total elements: {expected:,}" in printed
    assert f"t0, {names[-1]} — one table stored 2 times" in printed
    (tmp_path / "ref" / "gemma.safetensors").unlink()  # declarations only: sizes, no duplicate search
    report = inspect_path(mlir)
    assert len(report.tensors) == len(names) and report.duplicates == []
    assert report.total_elements == expected and report.total_bytes == 2 * expected  # as declared: bf16
    assert "no archive beside it" in report.no_data and report.to_dict(5)["duplicates_searched"] is False
    printed = CliRunner().invoke(app, ["inspect", str(mlir)]).stdout
    assert "duplicates: not searched, no data was read (" in printed and "duplicates: none" not in printed
    assert f"; declared {2 * expected:,} bytes" in printed and "on disk" not in printed


def test_int8_scales_must_be_per_row_f32(ref_model, tmp_path):
    def edit(lines, archive):
        i = next(i for i, line in enumerate(lines) if "_scale = " in line and "@t0_" not in line)
        name = lines[i].split("@")[1].split(" ")[0]
        lines[i] = lines[i].replace("xf32>", "xbf16>")
        archive[name] = archive[name].view(np.uint16)[::2].copy()  # q_proj's 64 scales as bf16
    mlir = write_reference(ref_model, tmp_path / "ref", "int8", edit=edit)
    with pytest.raises(FormatError, match=r"_scale is tensor<64xbf16>; expected per-row f32 scales tensor<64xf32>"):
        open_source(mlir)


def _without_scale(lines, archive):  # the table keeps its i8 codes, loses its scales
    i = next(i for i, line in enumerate(lines) if "_scale = " in line)
    name = lines.pop(i).split("@")[1].split(" ")[0]
    archive.pop(name)


def _orphan_scale(lines, archive):  # scales of a global that does not exist
    lines.insert(2, '  util.global private @t999_scale = #flow.parameter.named<"model"::"t999_scale"> : tensor<64xf32>')
    archive["t999_scale"] = np.ones(64, np.float32)


@pytest.mark.parametrize("edit, message", [
    (_without_scale, r"gemma.mlir:2: int8 global @t0 has no @t0_scale \(expected per-row f32 scales tensor<96xf32>\)"),
    (_orphan_scale, r"gemma.mlir:3: @t999_scale names no global @t999; expected the per-row scales of an int8 global"),
])
def test_int8_scales_without_their_global_or_a_global_without_scales_are_refused_when_opened(ref_model, tmp_path, edit,
                                                                                              message):
    # refused by open_source, before any weight is read (a missing scale was found only when the
    # export reached that weight; an orphan scale was mapped as a weight and shifted every later slot)
    mlir = write_reference(ref_model, tmp_path / "ref", "int8", edit=edit)
    with pytest.raises(FormatError, match=message):
        open_source(mlir)


def test_an_int8_constant_without_scales_is_skipped_like_any_constant(ref_model, tmp_path):
    # layer 0's RoPE cos table (t50): the export never reads it, so its missing scales do not matter
    def edit(lines, archive):
        lines.remove(next(line for line in lines if "@t50_scale = " in line))
        archive.pop("t50_scale")

    ckpt = open_source(write_reference(ref_model, tmp_path / "ref", "int8", edit=edit))
    whole = open_source(write_reference(ref_model, tmp_path / "whole", "int8"))
    assert set(ckpt.tensors) == set(whole.tensors)


def test_a_nan_in_int8_scales_is_named_in_the_scales_not_the_codes(ref_model, tmp_path):
    from gemma_export.errors import NumericError

    def edit(lines, archive):
        archive["t16_scale"] = archive["t16_scale"].copy()
        archive["t16_scale"][3] = np.nan  # layer 0's q_proj: its int8 codes are all finite

    ckpt = open_source(write_reference(ref_model, tmp_path / "ref", "int8", edit=edit))
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(NumericError, match=r"gemma.safetensors:t16_scale: @t16_scale holds nan at row 3; scales must be finite"):
        q.load()
    with pytest.raises(NumericError, match=r"@t16_scale holds nan at row 3;"):
        q.rows()[2:8]


@pytest.mark.parametrize("value, shown", [(-0.5, "-0.5"), (3e38, "3e+38")])
def test_a_negative_or_overflowing_int8_scale_is_named_in_the_scales(ref_model, tmp_path, value, shown):
    """A negative scale would flip the row's sign; 3e38 times a code overflowed to inf and was then
    blamed on the table with a numpy warning (probe finding). A zero scale (an all-zero row) stays."""
    import warnings

    from gemma_export.errors import NumericError

    def edit(lines, archive):
        archive["t16_scale"] = archive["t16_scale"].copy()
        archive["t16_scale"][3] = value
        archive["t16_scale"][0] = 0.0

    ckpt = open_source(write_reference(ref_model, tmp_path / "ref", "int8", edit=edit))
    q = ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no RuntimeWarning on the way
        with pytest.raises(NumericError, match=rf"gemma.safetensors:t16_scale: @t16_scale holds {re.escape(shown)} at row 3; "
                                               r"expected a scale from 0 to 2\.658e\+36"):
            q.load()
    assert not q.rows()[0:1].any()  # row 0's zero scale: a zero row


def test_a_nan_in_a_norm_gain_is_named_as_a_nan_not_as_the_trace_order(ref_model, tmp_path):
    from gemma_export.errors import NumericError

    def edit(lines, archive):
        archive["t8"] = archive["t8"].copy()
        archive["t8"][5] = 0x7FC0  # bf16 NaN in layer 0's input_layernorm

    mlir = write_reference(ref_model, tmp_path / "ref", edit=edit)
    with pytest.raises(NumericError, match=r"tensor 'model.layers.0.input_layernorm.weight' holds nan at index \(5,\); "
                                           r"weights must be finite"):
        open_source(mlir)


def test_reference_greedy_refuses_a_prompt_longer_than_the_fixed_length():
    from gemma_export.errors import GemmaExportError
    from gemma_export.reference_iree import ReferenceModel

    calls = []
    model = ReferenceModel(Path("gemma.mlir"), Path("gemma.safetensors"), "gemma", 4, 10, False,
                           _call=lambda tokens: calls.append(tokens) or np.arange(4, dtype=np.int32))
    with pytest.raises(GemmaExportError, match=r"@gemma takes 1 to 4 tokens, found 5"):
        model.greedy([1, 2, 3, 4, 5], 3)
    with pytest.raises(GemmaExportError, match=r"takes 1 to 4 tokens, found 0"):
        model.greedy([], 3)
    assert calls == []
    assert model.greedy([1, 2, 3, 4], 3) == []  # a prompt that fills every position gets no new token
    assert model.greedy([1, 2], 5) == [1, 2] and len(calls) == 2  # reads position len(ids) - 1 each call


def test_the_compile_cache_is_per_host_cpu(tmp_path, monkeypatch):
    # the flags say "host": a cache shared between machines must not hand one CPU's module to another
    from gemma_export import reference_iree

    compiled = []

    class Compiler:
        @staticmethod
        def compile_str(text, **_):
            compiled.append(text)
            return b"module-%d" % len(compiled)

    monkeypatch.setattr(reference_iree, "_iree", lambda: (Compiler, None))
    monkeypatch.setattr(reference_iree, "_host_cpu", lambda: ("x86_64", "avx2 fma"))
    first = reference_iree.compile_reference("text", cache_dir=tmp_path)
    assert reference_iree.compile_reference("text", cache_dir=tmp_path) == first and len(compiled) == 1
    monkeypatch.setattr(reference_iree, "_host_cpu", lambda: ("x86_64", "avx2 fma avx512f"))
    assert reference_iree.compile_reference("text", cache_dir=tmp_path) != first and len(compiled) == 2
    assert len(list(tmp_path.glob("*.vmfb"))) == 2


def test_six_layer_reference_uses_gemma3_layer_pattern(tmp_path):
    """Layer 5 is global (i % 6 == 5, RoPE base 1,000,000); a model following that pattern exports
    exactly; the reader does not learn the pattern from the MLIR, so this is the assumption tested."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    model = make_tiny_model(seed=5, num_hidden_layers=6, layer_types=types, sliding_window=512)
    mlir = write_reference(model, tmp_path / "ref")
    ckpt = open_source(mlir)
    assert ckpt.config.layer_types == tuple(types)
    assert ckpt.config.rope_parameters["full_attention"].rope_theta == 1_000_000.0
    out = export(mlir, tmp_path / "out", "fp32", all_logits=True).out_dir
    ids = np.random.default_rng(2).integers(3, 96, (1, 16)).astype(np.int64)
    dec = OnnxDecoder(out)
    logits, _ = dec.forward(ids, np.ones_like(ids), np.arange(16)[None], dec.empty_cache(1))
    assert np.abs(logits - reference_logits(_dequantized_model(model, "bf16"), ids)).max() <= 1e-4


def test_a_compile_cache_that_cannot_be_written_leaves_no_partial_file(tmp_path, monkeypatch):
    importlib.import_module("iree.compiler")  # the test extra installs IREE: fail, not skip, without it
    from gemma_export import reference_iree

    text = ("func.func @identity(%x: tensor<2xf32>) -> tensor<2xf32> {\n"
            "  %y = stablehlo.add %x, %x : tensor<2xf32>\n  return %y : tensor<2xf32>\n}\n")

    def refuse(src, dst):
        raise OSError(18, "Invalid cross-device link", src)

    monkeypatch.setattr(reference_iree.os, "replace", refuse)
    vmfb = reference_iree.compile_reference(text, cache_dir=tmp_path / "cache")
    assert len(vmfb) > 0
    assert list((tmp_path / "cache").iterdir()) == []  # neither a .partial nor a .vmfb
    monkeypatch.undo()
    assert reference_iree.compile_reference(text, cache_dir=tmp_path / "cache") == vmfb
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".vmfb"]


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
def test_row_ranges_read_from_the_archive_equal_the_whole_tensors_rows(ref_model, tmp_path, dtype):
    """Row ranges (how the exporter reads a 262,144-row table a chunk at a time) start at their own
    row of the flat archive and take that row's int8 scales, wherever the range starts."""
    def untie(lines, archive):  # a head that differs from the table: read through its own row reader
        last = [k for k in archive if not k.endswith("_scale")][-1]
        archive[last] = archive[last].copy()
        archive[last][5] ^= 0x0100 if dtype == "bf16" else 1
    ckpt = open_source(write_reference(ref_model, tmp_path / "ref", dtype, edit=untie))
    matrices = {name: ref for name, ref in ckpt.tensors.items() if len(ref.shape) == 2}
    assert "lm_head.weight" in matrices and "model.embed_tokens.weight" in matrices
    for name, ref in matrices.items():
        whole, rows = ref.load(), ref.shape[0]
        for start, stop in ((0, 1), (5, 9), (rows - 3, rows)):
            assert np.array_equal(ref.row_reader(start, stop), whole[start:stop]), (name, start, stop)
        assert np.array_equal(ref.rows()[7:rows], whole[7:])


def test_int8_scales_must_be_one_per_row_not_per_column(ref_model, tmp_path):
    """k_proj is [32, 64]: 64 scales (one per column) are refused by name, not broadcast or applied
    to the wrong axis."""
    found = {}

    def edit(lines, archive):
        i = next(i for i, line in enumerate(lines) if line.endswith("tensor<32x64xi8>"))
        name = found["name"] = lines[i].split("@")[1].split(" ")[0]
        j = next(j for j, line in enumerate(lines) if f"@{name}_scale = " in line)
        lines[j] = lines[j].replace("tensor<32xf32>", "tensor<64xf32>")
        archive[f"{name}_scale"] = np.concatenate([archive[f"{name}_scale"]] * 2)
    mlir = write_reference(ref_model, tmp_path / "ref", "int8", edit=edit)
    name = found["name"]
    with pytest.raises(FormatError, match=rf"@{name}_scale is tensor<64xf32>; expected per-row f32 scales "
                                          rf"tensor<32xf32> of an i8 @{name}$"):
        open_source(mlir)


def test_a_baked_mask_as_wide_as_hidden_before_the_projections_is_not_taken_for_q(tmp_path):
    """Head counts come from the first two [*, hidden] globals whose rows are whole heads: a [S, S]
    mask with S = hidden ahead of q_proj (a re-decode length equal to hidden) is skipped, not read
    as q (which made k look like the KV projection and failed the mapping)."""
    from gemma_export.sources.mlir import MlirGlobal, MlirModule, map_globals

    vocab, hidden, heads, kv, d, inter = 96, 40, 2, 1, 16, 64
    shapes = [(vocab, hidden), (hidden, hidden),  # the table, then a baked mask [S, S] with S = hidden
              (hidden,), (heads * d, hidden), (d,), (kv * d, hidden), (d,), (kv * d, hidden), (hidden, heads * d),
              (hidden,), (hidden,), (inter, hidden), (inter, hidden), (hidden, inter), (hidden,),
              (hidden,), (vocab, hidden)]  # final norm, the table again
    module = MlirModule(tmp_path / "gemma.mlir", tuple(
        MlirGlobal(f"t{n}", "model", f"t{n}", shape, "bf16", n + 1) for n, shape in enumerate(shapes)), ())
    mapped = map_globals(module)
    c = mapped.config
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size) == (heads, kv, d, inter)
    assert [g.name for g in mapped.skipped] == ["t1"]
    assert mapped.weights["model.layers.0.self_attn.q_proj.weight"].name == "t3"
    assert mapped.weights["model.layers.0.self_attn.k_proj.weight"].name == "t5"
    assert mapped.duplicate_table.name == "t16"


def test_a_rope_table_of_hidden_positions_is_not_taken_for_the_down_projection(tmp_path):
    """The intermediate size is read from the first [hidden, *] global that is not a projection: a
    RoPE table [S, head_dim / 2] with S = hidden (a re-decode length equal to hidden) comes before
    down_proj and is skipped, not read as [hidden, intermediate] (which failed the mapping at gate_proj)."""
    from gemma_export.sources.mlir import MlirGlobal, MlirModule, map_globals

    vocab, hidden, heads, kv, d, inter = 96, 64, 2, 1, 16, 128
    rope = (hidden, d // 2)  # S = hidden positions
    shapes = [(vocab, hidden), (hidden,), (heads * d, hidden), (d,), (kv * d, hidden), (d,), (kv * d, hidden),
              rope, rope, (hidden, heads * d), (hidden,), (hidden,), (inter, hidden), (inter, hidden),
              (hidden, inter), (hidden,), (hidden,), (vocab, hidden)]
    module = MlirModule(tmp_path / "gemma.mlir", tuple(
        MlirGlobal(f"t{n}", "model", f"t{n}", shape, "bf16", n + 1) for n, shape in enumerate(shapes)), ())
    mapped = map_globals(module)
    assert mapped.config.intermediate_size == inter
    assert [g.name for g in mapped.skipped] == ["t7", "t8"]
    assert mapped.weights["model.layers.0.mlp.down_proj.weight"].name == "t14"


def test_declarations_in_another_order_map_by_the_tracer_ids(ref_model, tmp_path):
    """Globals were mapped in the order the file declares them: two same-shaped declarations
    swapped (k_proj and v_proj of layer 0 here) exported the wrong weights without a word, while
    IREE ran the same model (helper-found). The names tN are the tracer's ids, in trace order."""
    def swap_k_and_v(lines, archive):
        shapes = [line.split("tensor<")[1] if "util.global private" in line else "" for line in lines]
        k = next(i for i, s in enumerate(shapes) if s.startswith("32x64x"))  # the first [kv_heads * head_dim, hidden]
        v = next(i for i, s in enumerate(shapes) if i > k and s.startswith("32x64x"))
        lines[k], lines[v] = lines[v], lines[k]

    plain = export(write_reference(ref_model, tmp_path / "plain"), tmp_path / "a", "fp32").out_dir
    swapped = write_reference(ref_model, tmp_path / "swapped", edit=swap_k_and_v)
    assert swapped.read_text() != (tmp_path / "plain" / "gemma.mlir").read_text()
    out = export(swapped, tmp_path / "b", "fp32").out_dir
    assert (out / "model.onnx.data").read_bytes() == (plain / "model.onnx.data").read_bytes()


@pytest.mark.parametrize("cut, still_open", [("in the function", 2), ("after the globals", 1),
                                              ("the module's brace", 1), ("no module, after the globals", 0)])
def test_a_reference_cut_short_is_refused(ref_model, tmp_path, cut, still_open):
    """An MLIR cut to its first 200 KB exported without a word, and one cut after an inner '}'
    passed a check of its last line (helper-found): the braces must balance."""
    mlir = write_reference(ref_model, tmp_path / "ref")
    lines = mlir.read_text().splitlines()
    keep = {"in the function": len(lines) - 2, "the module's brace": len(lines) - 1,
            "after the globals": next(i for i, l in enumerate(lines) if "func.func" in l)}.get(cut)
    if keep is None:  # operations at the top level (legal MLIR), the file cut between two of them
        lines = [l for l in lines[1:] if "util.global private" in l]
        keep = len(lines)
    mlir.write_text("\n".join(lines[:keep]) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--source", str(mlir), "--dtype", "fp32", "--out", str(out)])
    assert result.exit_code == 2, result.output
    expected = (f"error: {mlir}: ends with {still_open} brace(s) still open; the file is cut short" if still_open
                else f"error: {mlir}: ends with ")
    assert result.stderr.splitlines()[-1].startswith(expected) and "cut short" in result.stderr, result.stderr
    assert not out.exists()


def test_comments_and_braces_in_strings_do_not_count_as_the_module_s_end(ref_model, tmp_path):
    """'} // end of module' was refused as cut short (helper-found)."""
    def edit(lines, archive):
        lines[-1] = '} // end of module {'
        lines.insert(1, '  // a comment with a brace }')
        lines.insert(2, '  util.global private @note = "a string with braces }}" : !util.buffer')
    plain = export(write_reference(ref_model, tmp_path / "plain"), tmp_path / "a", "fp32").out_dir
    out = export(write_reference(ref_model, tmp_path / "commented", edit=edit), tmp_path / "b", "fp32").out_dir
    assert (out / "model.onnx.data").read_bytes() == (plain / "model.onnx.data").read_bytes()


def test_globals_renamed_away_from_tn_map_by_their_archive_keys(ref_model, tmp_path):
    """With one global renamed away from tN the reader fell back to the declarations' order, and two
    same-shaped declarations written the other way round exported the wrong weights (helper-found).
    The archive keys carry the tracer's ids too."""
    def rename_and_reorder(lines, archive):
        decl = [i for i, line in enumerate(lines) if "util.global private @" in line]
        names = [lines[i].split("@")[1].split(" ")[0] for i in decl]
        for n in range(len(lines)):  # every global renamed, in declarations and loads (the keys stay tN)
            for name in names:
                lines[n] = lines[n].replace(f"@{name} ", f"@w_{name} ")
        k = next(i for i in decl if lines[i].split("tensor<")[1].startswith("32x64x"))  # layer 0's k_proj ...
        v = next(i for i in decl if i > k and lines[i].split("tensor<")[1].startswith("32x64x"))  # ... and v_proj
        lines[k], lines[v] = lines[v], lines[k]

    plain = export(write_reference(ref_model, tmp_path / "plain"), tmp_path / "a", "fp32").out_dir
    mlir = write_reference(ref_model, tmp_path / "renamed", edit=rename_and_reorder)
    assert "@w_t0 " in mlir.read_text()
    out = export(mlir, tmp_path / "b", "fp32").out_dir
    assert (out / "model.onnx.data").read_bytes() == (plain / "model.onnx.data").read_bytes()


def test_the_trace_order_is_the_ids_then_the_first_loads_then_the_declarations():
    from gemma_export.sources.mlir import MlirGlobal, _check_load_order, _trace_order

    def g(name, key=None):
        return MlirGlobal(name, "model", key or name, (4,), "bf16", 0)

    declared = [g("t20"), g("t3"), g("t11")]
    loads = {"t11": 5, "t20": 6, "t3": 7}  # e.g. a helper function loads some first: the ids win
    assert [x.name for x in _trace_order(declared, loads)] == ["t3", "t11", "t20"]
    keyed = [g("a", "t20"), g("b", "t3"), g("c", "t11")]  # names of no tracer: the keys' ids
    assert [x.name for x in _trace_order(keyed, {})] == ["b", "c", "a"]
    free = [g("a", "x"), g("b", "y"), g("c", "z")]
    assert [x.name for x in _trace_order(free, {"c": 1, "a": 2, "b": 3})] == ["c", "a", "b"]  # no ids: the loads
    assert [x.name for x in _trace_order(free, {"c": 1, "a": 2})] == ["a", "b", "c"]  # not all loaded: the file's
    # a function that loads every weight must load them in the ids' order; a helper that loads some
    # gives no order to compare
    where, ordered = Path("m.mlir"), _trace_order(declared, loads)
    _check_load_order(ordered, {"helper": ("t11", "t20"), "gemma": ("t3", "t11", "t20")}, where)
    with pytest.raises(FormatError, match=r"^m.mlir: @gemma loads @t20 \(key 't20'\) where the tracer's ids put @t3 "
                                          r"\(key 't3'\), weight 0 in trace order; the ids and the program disagree"):
        _check_load_order(ordered, {"gemma": ("t20", "t11", "t3")}, where)


def test_where_a_constant_is_loaded_does_not_matter_where_a_weight_is_it_does(ref_model, tmp_path):
    """A reviewer's finding: the load-order check also compared RoPE tables and masks, which the
    export skips, so a program that loads one of them first (the same program) was refused."""
    from jax_reference import global_of, write_jax_reference

    def moved_to_the_top(folder, name):
        mlir = write_jax_reference(ref_model, folder, "bf16")
        lines = mlir.read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if f"util.global.load @{name} " in line)
        load = lines.pop(at)
        top = next(i for i, line in enumerate(lines) if "util.global.load" in line)
        lines.insert(top, load)
        mlir.write_text("\n".join(lines) + "\n")
        return mlir

    plain = open_source(write_jax_reference(ref_model, tmp_path / "plain", "bf16"))
    constant = open_source(moved_to_the_top(tmp_path / "rope", global_of(ref_model, "cos", 1)))
    assert sorted(constant.tensors) == sorted(plain.tensors)
    for name, ref in plain.tensors.items():
        np.testing.assert_array_equal(constant.tensors[name].load(), ref.load(), err_msg=name)
    weight = global_of(ref_model, "o", 1)
    with pytest.raises(FormatError, match=rf"@gemma loads @{weight} .* where the tracer's ids put @t0 .key 't0'.,"
                                          r" weight 0 in trace order"):
        open_source(moved_to_the_top(tmp_path / "o", weight))


def test_a_key_missing_from_the_archive_header_is_named_not_the_gap_it_leaves(ref_model, tmp_path):
    """A key deleted from the header (its bytes still there) was reported as 'tensor t15 at offset
    ... leaves a gap of 128 bytes' (helper-found): the MLIR global that lacks it is named now."""
    import json
    import struct

    mlir = write_reference(ref_model, tmp_path / "ref")
    archive = mlir.with_suffix(".safetensors")
    data = archive.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    del header["t8"]
    raw = json.dumps(header).encode()
    archive.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    with pytest.raises(FormatError, match=rf"{mlir}:\d+: global @t8 is bound to key 't8', which {archive} lacks"):
        open_source(mlir)


def test_an_archive_whose_tensors_overlap_is_refused_after_its_names_are_checked(ref_model, tmp_path):
    import json
    import struct

    mlir = write_reference(ref_model, tmp_path / "ref")
    archive = mlir.with_suffix(".safetensors")
    data = archive.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    same = [k for k, v in header.items() if v["shape"] == header["t8"]["shape"] and k != "t8"]
    header["t8"]["data_offsets"] = header[same[0]]["data_offsets"]  # two keys on the same bytes
    raw = json.dumps(header).encode()
    archive.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length:])
    with pytest.raises(FormatError, match=f"{archive}: tensor '.*' at offset \\d+ overlaps the previous tensor"):
        open_source(mlir)


def test_a_load_in_a_comment_or_a_string_is_not_a_load(ref_model, tmp_path):
    from gemma_export.sources.mlir import parse_mlir

    def edit(lines, archive):
        lines.insert(1, "  // util.global.load @t8 : tensor<64xbf16>")
        lines.insert(2, '  util.global private @doc = "util.global.load @t15" : !util.buffer')
    module = parse_mlir(write_reference(ref_model, tmp_path / "ref", edit=edit))
    function = next(f for f in module.functions if f.name == "gemma")
    assert module.first_loads["t8"] > function.line and "t15" not in module.first_loads
    assert list(module.function_loads) == ["gemma"] and module.function_loads["gemma"][:2] == ("t0", "t8")


def test_a_global_the_program_never_loads_is_left_out_as_iree_leaves_it(ref_model, tmp_path):
    """A helper's finding: a global declared and in the archive but never loaded (IREE runs such a
    file) was mapped as a weight, and the export failed blaming the LM head's global."""
    plain = open_source(write_reference(ref_model, tmp_path / "plain"))

    def edit(lines, archive):  # declared first, before the table: the table's rows are still the vocabulary
        lines.insert(1, '  util.global private @t9 = #flow.parameter.named<"model"::"t9"> : tensor<64xbf16>')
        archive["t9"] = archive["t8"].copy()
        lines.insert(2, '  util.global private @spare = #flow.parameter.named<"model"::"t8"> : tensor<64xbf16>')
    mlir = write_reference(ref_model, tmp_path / "extra", edit=edit)
    extra = open_source(mlir)
    assert extra.identity["unused_globals"] == 2 and plain.identity["unused_globals"] == 0
    from gemma_export.reference_iree import check_reference_options

    pytest.importorskip("iree.runtime")
    assert check_reference_options(mlir, None) == (96, SEQ, extra.config)
    assert sorted(extra.tensors) == sorted(plain.tensors)
    for name, ref in plain.tensors.items():
        np.testing.assert_array_equal(extra.tensors[name].load(), ref.load(), err_msg=name)


def test_the_re_decode_function_is_the_one_public_function_of_its_signature(ref_model, tmp_path):
    """A helper's finding: a private function with the re-decode signature before @gemma was picked,
    and IREE (which exports only public functions) then failed with a traceback; two public ones
    were chosen between silently."""
    from gemma_export.reference_iree import check_reference

    def helper(visibility):
        def edit(lines, archive):
            at = next(i for i, line in enumerate(lines) if "func.func @gemma" in line)
            lines[at:at] = [f"  func.func {visibility}@helper(%arg0: tensor<1x{SEQ}xi32>) -> tensor<{SEQ}xi32> {{",
                            f"    %0 = stablehlo.reshape %arg0 : (tensor<1x{SEQ}xi32>) -> tensor<{SEQ}xi32>",
                            f"    return %0 : tensor<{SEQ}xi32>", "  }"]
        return edit
    mlir = write_reference(ref_model, tmp_path / "private", edit=helper("private "))
    assert check_reference(mlir)[2].name == "gemma"
    mlir = write_reference(ref_model, tmp_path / "public", edit=helper(""))
    with pytest.raises(FormatError, match=rf"{mlir}: 2 public re-decode functions tensor<1xSxi32> -> tensor<Sxi32> "
                                          r"\(@helper \(line \d+\), @gemma \(line \d+\)\); expected one"):
        check_reference(mlir)


def test_a_scale_for_a_global_that_is_not_int8_says_so(ref_model, tmp_path):
    """A helper's finding: '@t8_scale is tensor<64xf32>; expected ... tensor<64xf32> of an i8 @t8'
    named the same type twice and not the fault: @t8 is bf16."""
    def edit(lines, archive):
        lines.insert(2, '  util.global private @t8_scale = #flow.parameter.named<"model"::"t8_scale"> : tensor<64xf32>')
        archive["t8_scale"] = np.ones(64, np.float32)
    mlir = write_reference(ref_model, tmp_path / "ref", edit=edit)
    with pytest.raises(FormatError, match=rf"^{mlir}:3: @t8_scale names @t8 as its int8 weight, but @t8 is "
                                          r"tensor<64xbf16>; only i8 globals have per-row _scale globals$"):
        open_source(mlir)


@pytest.mark.parametrize("edit, message", [
    (lambda text: b"\xef\xbb\xbf" + text, ": starts with a UTF-8 byte-order mark, which IREE's MLIR parser refuses; "
                                          "remove its first 3 bytes"),
    (lambda text: text.replace(b"module", b"mod\0ule", 1), ":1: holds a NUL byte (column 4); not MLIR text"),
    # random bytes read as "closes a brace that was not opened" (a break-it run)
    (lambda text: text.replace(b"module", b"mod\xff\xfeule", 1), ":1: not UTF-8 text (byte 4 of the line's code); "
                                                                 "not reference MLIR text"),
])
def test_what_irees_parser_refuses_is_refused_before_an_export(ref_model, tmp_path, edit, message):
    """A helper's finding: an MLIR with a byte-order mark or a NUL byte exported (exit 0), while
    parity and bench, whose IREE refuses it, failed on the same file (bench after measuring)."""
    mlir = write_reference(ref_model, tmp_path / "ref")
    mlir.write_bytes(edit(mlir.read_bytes()))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["--source", str(mlir), "--dtype", "fp32", "--out", str(out)])
    assert result.exit_code == 2 and f"error: {mlir}{message}" in result.output, result.output
    assert not out.exists()


def test_a_norm_gain_stored_as_w_not_1_plus_w_is_refused_as_the_wrong_trace_order(ref_model, tmp_path):
    """A reference's norm globals hold the gain 1 + w: a global in a norm's slot whose values centre
    on 0 (a raw w, or another weight traced in its place) is refused, not exported with a gain of ~0."""
    from gemma_export.errors import FormatError

    def edit(lines, archive):
        archive["t8"] = np.zeros_like(archive["t8"])  # bf16 0.0 in layer 0's input_layernorm

    mlir = write_reference(ref_model, tmp_path / "ref", edit=edit)
    with pytest.raises(FormatError, match=r"mapped to 'model\.layers\.0\.input_layernorm\.weight' but its median 0 is not a "
                                          r"positive norm gain \(1 \+ w\); the trace order is not the expected one"):
        open_source(mlir)
