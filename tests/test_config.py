"""config.json in both transformers forms, and contradicting configs."""


import pytest

from gemma_export.config import FULL, SLIDING, config_from_hf_dict
from gemma_export.errors import ConfigError, FormatError

V4 = {  # transformers 4.x form, as on the Hub for google/gemma-3-270m
    "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
    "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
    "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
}


def test_v4_pattern_gives_global_layers_5_11_17():
    c = config_from_hf_dict(V4, "config.json")
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == [5, 11, 17]
    assert c.rope_parameters[FULL].rope_theta == 1e6 and c.rope_parameters[SLIDING].rope_theta == 1e4
    assert c.attention_scale == 1 / 16 and c.embed_scale == pytest.approx(25.2982, abs=1e-4)


def test_v4_linear_scaling_applies_to_global_only():
    c = config_from_hf_dict({**V4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "c")
    assert c.rope_parameters[FULL].factor == 8.0 and c.rope_parameters[SLIDING].factor == 1.0


def test_v5_form_and_multimodal_nesting():
    text = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern")}
    text["layer_types"] = [SLIDING] * 17 + [FULL]
    text["rope_parameters"] = {FULL: {"rope_type": "default", "rope_theta": 5e5}, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}
    c = config_from_hf_dict({"model_type": "gemma3", "text_config": {**text, "model_type": "gemma3_text"}}, "c")
    assert c.layer_types[-1] == FULL and c.layer_types.count(FULL) == 1
    assert c.rope_parameters[FULL].rope_theta == 5e5
    # hostile-found: without text_config the fields at the top were said to be missing
    with pytest.raises(ConfigError, match=r"^c: model_type 'gemma3' \(the multimodal model\) needs 'text_config'"):
        config_from_hf_dict({**text, "model_type": "gemma3"}, "c")
    # the nested config of another model (probe finding: text_config.model_type "gemma2" was exported)
    with pytest.raises(ConfigError, match=r"^c: text_config.model_type is 'gemma2', expected 'gemma3_text'"):
        config_from_hf_dict({"model_type": "gemma3", "text_config": {**text, "model_type": "gemma2"}}, "c")
    for absent in ({}, {"model_type": None}):  # none or null: fine
        config = config_from_hf_dict({"model_type": "gemma3", "text_config": {**text, **absent}}, "c")
        assert config.layer_types[-1] == FULL
    for bad, found in (([], r"\[\]"), ({}, None)):
        if found is None:  # an empty object: its fields are missing, and that is what is said
            with pytest.raises(ConfigError, match="missing required field"):
                config_from_hf_dict({"model_type": "gemma3", "text_config": bad}, "c")
        else:
            with pytest.raises(ConfigError, match=f"^c: 'text_config' must be an object, found {found}$"):
                config_from_hf_dict({"model_type": "gemma3", "text_config": bad}, "c")


@pytest.mark.parametrize("change, words", [
    ({"model_type": "llama"}, "model_type is 'llama'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ({"layer_types": [SLIDING] * 5}, "layer_types has 5 entries but num_hidden_layers is 18"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"hidden_size": None}, "missing required field 'hidden_size'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"layer_types": ["sliding_attention"] * 17 + ["chunked"]}, "chunked"),
    # finite and positive in JSON, but 0 or inf once the float32 graph uses them: NaN logits (found by a helper)
    ({"rope_theta": 1e-300}, "rope_theta 1e-300 and factor 1.0 for full_attention give inverse frequencies float32 cannot hold"),
    ({"query_pre_attn_scalar": 1e-300}, "query_pre_attn_scalar 1e-300 is outside what float32 can use"),
    ({"rms_norm_eps": 1e-300}, "rms_norm_eps 1e-300 is outside what float32 can use"),
])
def test_bad_configs_name_the_field(change, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        config_from_hf_dict({**V4, **change}, "some/config.json")


def test_default_output_names(tmp_path):
    """The name a user gave (not a link's target), without a GGUF's llama.cpp type tag."""
    from gemma_export.sources import default_output_name

    blob = tmp_path / "blobs" / "3f1a9c0e"
    blob.parent.mkdir()
    blob.write_bytes(b"GGUF")
    link = tmp_path / "gemma-3-270m-it-Q8_0.gguf"
    link.symlink_to(blob)
    assert default_output_name(link, "fp32") == "gemma-3-270m-it-onnx-fp32"
    assert default_output_name(None, "int8") == "gemma-3-270m-onnx-int8"
    for given, expected in (("x-q4_k_m.gguf", "x"), ("model.GGUF", "model"), ("m-IQ4_XS.gguf", "m"),
                            ("m.f16.gguf", "m"), (".gguf", "model"), ("ref.mlir", "ref"), ("REF.MLIR", "REF"),
                            ("my-gemma", "my-gemma")):
        assert default_output_name(tmp_path / given, "int4") == f"{expected}-onnx-int4"


def test_the_dtype_names_are_the_weight_formats_and_their_facts():
    """config.DTYPES (what the CLI and the manifest check accept, without importing onnx_ir) names
    exactly the registered weight formats, and QUANTIZED_DTYPES exactly the block-wise ones."""
    from gemma_export.config import DTYPES, QUANTIZED_DTYPES
    from gemma_export.weights import WEIGHT_FORMATS, Int4Format, weight_format

    assert tuple(WEIGHT_FORMATS) == DTYPES == ("fp32", "bf16", "int8", "int4")
    assert tuple(n for n, cls in WEIGHT_FORMATS.items() if cls.quantized) == QUANTIZED_DTYPES
    assert [WEIGHT_FORMATS[n].bits for n in DTYPES] == [32, 16, 8, 4]
    # defaults come from the format, the CLI's (export() lowers a table block the hidden size does not allow)
    int8, int4, int4_int8 = weight_format("int8"), weight_format("int4"), weight_format("int4", table_dtype="int8")
    assert (int8.block_size, int8.table_block_size, int8.table_bits) == (32, 128, 8)
    assert (int4.block_size, int4.table_block_size, int4.table_bits) == (32, 32, 4)
    assert (int4_int8.block_size, int4_int8.table_block_size, int4_int8.table_bits) == (32, 128, 8)
    with pytest.raises(ValueError, match="table_dtype 'int2': expected int4 or int8"):
        Int4Format(table_dtype="int2")


def test_v4_local_base_and_gemma3_defaults_are_read():
    """rope_local_base_freq sets the sliding layers' base; an omitted head_dim is transformers' 256
    (not hidden_size / heads, 160 for the 270M)."""
    c = config_from_hf_dict({**V4, "rope_local_base_freq": 20000.0}, "c")
    assert c.rope_parameters[SLIDING].rope_theta == 20000.0 and c.rope_parameters[FULL].rope_theta == 1e6
    bare = {k: v for k, v in V4.items() if k not in ("head_dim", "rope_theta", "rope_local_base_freq")}
    c = config_from_hf_dict(bare, "c")
    assert c.head_dim == 256 and c.query_pre_attn_scalar == 256
    assert c.rope_parameters[FULL].rope_theta == 1e6 and c.rope_parameters[SLIDING].rope_theta == 1e4


def test_a_factor_applies_only_to_linear_rope():
    """transformers' default RoPE ignores a factor; only rope_type linear divides by it."""
    c = config_from_hf_dict({**V4, "rope_scaling": {"rope_type": "default", "factor": 8.0}}, "c")
    assert c.rope_parameters[FULL].factor == 1.0
    text = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    text["rope_parameters"] = {FULL: {"rope_type": "default", "factor": 4.0}, SLIDING: {"rope_type": "linear", "factor": 2.0}}
    c = config_from_hf_dict(text, "c")
    assert (c.rope_parameters[FULL].factor, c.rope_parameters[SLIDING].factor) == (1.0, 2.0)


def test_v5_entries_without_a_base_take_their_layer_types_default():
    text = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    text["rope_parameters"] = {FULL: {"rope_type": "default"}, SLIDING: {"rope_type": "default"}}
    c = config_from_hf_dict(text, "c")
    assert c.rope_parameters[FULL].rope_theta == 1e6 and c.rope_parameters[SLIDING].rope_theta == 1e4


@pytest.mark.parametrize("field", ["eos_token_id", "bos_token_id", "pad_token_id"])
def test_a_token_id_equal_to_vocab_size_is_refused(field):
    with pytest.raises(ConfigError, match=f"{field} 262144 is not below vocab_size 262144"):
        config_from_hf_dict({**V4, field: 262144}, "c")
    assert config_from_hf_dict({**V4, field: 262143}, "c").vocab_size == 262144


GGUF_META = {"general.architecture": "gemma3", "gemma3.context_length": 64, "gemma3.embedding_length": 32,
             "gemma3.block_count": 1, "gemma3.feed_forward_length": 64, "gemma3.attention.head_count": 2,
             "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 16,
             "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.attention.sliding_window": 8}


@pytest.mark.parametrize("key", ["gemma3.attention.head_count_kv", "gemma3.context_length",
                                 "gemma3.attention.head_count", "gemma3.attention.sliding_window"])
def test_gguf_metadata_without_a_required_key_is_refused(key):
    from gemma_export.config import config_from_gguf_metadata

    meta = {k: v for k, v in GGUF_META.items() if k != key}
    with pytest.raises(ConfigError, match=f"missing required field '{key}'"):
        config_from_gguf_metadata(meta, 16, True, "m.gguf")


@pytest.mark.parametrize("edit, message", [
    ({"gemma3.attention.head_count": 3, "gemma3.attention.head_count_kv": 2},
     "m.gguf: gemma3.attention.head_count (3) is not a multiple of gemma3.attention.head_count_kv (2)"),
    ({"gemma3.attention.key_length": 12, "gemma3.attention.value_length": 12},
     "m.gguf: gemma3.attention.key_length must be a multiple of 8"),
])
def test_gguf_field_contradictions_name_the_gguf_keys(edit, message):
    """A GGUF's header holds no num_attention_heads: its messages named transformers' fields."""
    from gemma_export.config import config_from_gguf_metadata

    with pytest.raises(ConfigError) as caught:
        config_from_gguf_metadata({**GGUF_META, **edit}, 16, True, "m.gguf")
    assert str(caught.value).startswith(message)


def test_gguf_attention_scale_follows_llama_cpp_by_model_size():
    # llama.cpp scales Gemma 3 27B (62 layers) by hidden / heads (5376 / 32 = 168, transformers'
    # query_pre_attn_scalar for it) and every other size by head_dim
    from gemma_export.config import config_from_gguf_metadata

    c = config_from_gguf_metadata(GGUF_META, 16, True, "m.gguf")
    assert c.query_pre_attn_scalar == GGUF_META["gemma3.attention.key_length"]
    big = {**GGUF_META, "gemma3.block_count": 62, "gemma3.embedding_length": 5376, "gemma3.attention.head_count": 32,
           "gemma3.attention.head_count_kv": 16, "gemma3.attention.key_length": 128, "gemma3.attention.value_length": 128,
           "gemma3.feed_forward_length": 21504}
    c = config_from_gguf_metadata(big, 16, True, "m.gguf")
    assert c.query_pre_attn_scalar == 168.0 and c.head_dim == 128
    assert config_from_gguf_metadata({**big, "gemma3.block_count": 48}, 16, True, "m.gguf").query_pre_attn_scalar == 128.0


def test_gguf_rope_factor_applies_only_with_linear_scaling():
    from gemma_export.config import config_from_gguf_metadata

    c = config_from_gguf_metadata({**GGUF_META, "gemma3.rope.scaling.factor": 8.0}, 16, True, "m.gguf")
    assert c.rope_parameters[FULL].rope_type == "default" and c.rope_parameters[FULL].factor == 1.0
    c = config_from_gguf_metadata({**GGUF_META, "gemma3.rope.scaling.factor": 8.0, "gemma3.rope.scaling.type": "linear"},
                                  16, True, "m.gguf")
    assert c.rope_parameters[FULL].rope_type == "linear" and c.rope_parameters[FULL].factor == 8.0
    assert c.rope_parameters[SLIDING].factor == 1.0
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window) == (2, 1, 16, 8)


@pytest.mark.parametrize("head_dim", [255, 17, 4, 12, 18])
def test_a_head_dim_rope_or_groupqueryattention_cannot_take_is_refused_before_the_work(head_dim):
    """Odd: rotate-half RoPE cannot split it. Even but no multiple of 8 (a break-it run): the export
    (and calibration) ran in full, then onnxruntime's GroupQueryAttention refused the graph's first
    step with a traceback."""
    with pytest.raises(ConfigError, match=rf"^c: head_dim must be a multiple of 8 \(even for rotate-half RoPE, and a "
                                          rf"multiple of 8 for onnxruntime's GroupQueryAttention, which the graph "
                                          rf"uses\); found {head_dim}$"):
        config_from_hf_dict({**V4, "head_dim": head_dim}, "c")
    assert config_from_hf_dict({**V4, "head_dim": 24}, "c").head_dim == 24


def test_a_config_json_with_a_byte_order_mark_is_read(tmp_path):
    # hostile-found: refused with Python's "decode using utf-8-sig" while other text files strip the mark
    import json

    from gemma_export.config import load_hf_config

    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(V4).encode())
    assert load_hf_config(path).hidden_size == V4["hidden_size"]


def test_a_config_json_with_an_integer_of_5000_digits_is_a_config_error(tmp_path):
    # API probe: Python's JSON reader refuses integers over 4,300 digits with a plain ValueError,
    # which escaped as it was (the manifest and golden readers already named it)
    import json

    from gemma_export.config import load_hf_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(V4).replace(f'"hidden_size": {V4["hidden_size"]}', '"hidden_size": ' + "9" * 5000))
    with pytest.raises(ConfigError, match=rf"^{path}: cannot read JSON: Exceeds the limit \(4300 digits\)"):
        load_hf_config(path)


_V5_TEXT = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}


@pytest.mark.parametrize("rope_fields", [
    # keyed entries without rope_theta: the top-level bases fill them (probe finding: 1e6 / 1e4 were used)
    {"rope_parameters": {FULL: {"rope_type": "default"}, SLIDING: {"rope_type": "default"}},
     "rope_theta": 5000.0, "rope_local_base_freq": 300.0},
    # only the full-attention entry: the sliding one comes from rope_local_base_freq
    {"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 5e5}}, "rope_local_base_freq": 300.0},
    # a leftover rope_scaling beside keyed entries is merged into the full-attention entry
    {"rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 5e5}, SLIDING: {"rope_theta": 2e4}},
     "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "rope_theta": 2e5, "rope_local_base_freq": 3e3},
    {},
])
def test_rope_is_resolved_as_transformers_gemma3_config_resolves_it(rope_fields):
    transformers = pytest.importorskip("transformers")
    import copy

    cfg = {**_V5_TEXT, **copy.deepcopy(rope_fields)}
    ours = config_from_hf_dict(cfg, "c").rope_parameters
    theirs = transformers.Gemma3TextConfig(**copy.deepcopy(cfg)).rope_parameters
    for lt in (FULL, SLIDING):
        expected = theirs[lt]
        assert ours[lt].rope_theta == expected["rope_theta"], lt
        assert ours[lt].rope_type == expected["rope_type"], lt
        assert ours[lt].factor == (expected.get("factor", 1.0) if expected["rope_type"] == "linear" else 1.0), lt


def test_rope_parameters_not_keyed_by_layer_type_are_refused():
    # transformers ignores such a dict for Gemma 3; the export applied it to the full-attention layers
    flat = {**_V5_TEXT, "rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e4}}
    with pytest.raises(ConfigError, match=r"^c: field 'rope_parameters' must be keyed by layer type \('full_attention', "
                                          r"'sliding_attention'\) for Gemma 3, found keys \['factor', 'rope_theta', 'rope_type'\]$"):
        config_from_hf_dict(flat, "c")
    assert config_from_hf_dict({**_V5_TEXT, "rope_parameters": {}}, "c").rope_parameters[FULL].rope_theta == 1e6
    with pytest.raises(ConfigError, match=r"^c: field 'rope_parameters.sliding_attention' must be an object, found 5"):
        config_from_hf_dict({**_V5_TEXT, "rope_parameters": {FULL: {}, SLIDING: 5}}, "c")


def test_partial_rotary_factor_is_refused_not_ignored():
    keyed = {**_V5_TEXT, "rope_parameters": {FULL: {"rope_type": "linear", "factor": 8.0, "partial_rotary_factor": 0.5},
                                             SLIDING: {"rope_type": "default"}}}
    with pytest.raises(ConfigError, match=r"^c: partial_rotary_factor 0.5 in 'rope_parameters.full_attention' is not "
                                          r"supported \(Gemma 3 rotates the whole head_dim: expected 1.0 or none\)$"):
        config_from_hf_dict(keyed, "c")
    keyed["rope_parameters"][FULL]["partial_rotary_factor"] = 1.0
    assert config_from_hf_dict(keyed, "c").rope_parameters[FULL].factor == 8.0


def test_a_v4_rope_scaling_spelled_type_linear_is_applied():
    # transformers 4.x applied {"type": "linear"}; 5.x merges it into a default entry and keeps the
    # default (the one documented difference from its resolution)
    c = config_from_hf_dict({**V4, "rope_scaling": {"type": "linear", "factor": 8.0}}, "c")
    assert (c.rope_parameters[FULL].rope_type, c.rope_parameters[FULL].factor) == ("linear", 8.0)
    # ... and the export says so, since transformers 5 (the reference) gives other logits (a helper's
    # finding: exit 0, no word, parity PASS against a reference built from our reading)
    assert c.notes == ("c: 'rope_scaling' gives 'type': 'linear' (transformers 4's key), applied to the full-attention "
                       "layers as transformers 4 does; transformers 5 keeps their default RoPE, so its logits for this "
                       "checkpoint differ (write 'rope_type' to say which is meant)",)
    assert "notes" not in c.to_dict()  # not part of the model: the manifest's config stays as it was
    for scaling in ({"rope_type": "linear", "factor": 8.0}, {"type": "default"}, None):
        assert config_from_hf_dict({**V4, "rope_scaling": scaling}, "c").notes == ()
    keyed = {**_V5_TEXT, "rope_parameters": {FULL: {"rope_type": "default"}}, "rope_scaling": {"type": "linear", "factor": 8.0}}
    assert config_from_hf_dict(keyed, "c").notes == ()  # the entry's own rope_type decides, as in transformers 5


@pytest.mark.parametrize("value", [None, []])
@pytest.mark.parametrize("field", ["eos_token_id", "bos_token_id", "pad_token_id"])
def test_null_or_empty_token_ids_count_as_none(field, value):
    """transformers loads ``"eos_token_id": null`` (or ``[]``); it was refused as 'must be token ids'."""
    absent = config_from_hf_dict({k: v for k, v in V4.items() if k != field}, "c")
    given = config_from_hf_dict({**V4, field: value}, "c")
    assert getattr(given, field) == getattr(absent, field)
    assert (given.eos_token_id, given.bos_token_id, given.pad_token_id) == ((1, 106), 2, 0)
    nested = config_from_hf_dict({"model_type": "gemma3", field: value, "text_config": {**V4, field: value}}, "c")
    assert getattr(nested, field) == getattr(absent, field)


def test_default_stop_ids_are_those_inside_a_small_vocabulary():
    # a config naming no eos in a 96-word vocabulary: <end_of_turn> (106) is not one of its words, and
    # the error named it as if the file had ("eos_token_id 106 is not below vocab_size 96")
    c = config_from_hf_dict({**V4, "vocab_size": 96}, "c")
    assert c.eos_token_id == (1,)
    with pytest.raises(ConfigError, match=r"^c: eos_token_id 106 is not below vocab_size 96$"):  # the file's own
        config_from_hf_dict({**V4, "vocab_size": 96, "eos_token_id": [1, 106]}, "c")


def test_fields_the_hub_multimodal_configs_leave_out_default_as_transformers_gemma3_text_config():
    """The 4B/12B/27B configs on the Hub give their text_config without vocab_size and the head counts
    (transformers' defaults); such a config was refused for each in turn."""
    transformers = pytest.importorskip("transformers")
    hub_4b = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
              "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}
    c = config_from_hf_dict({"model_type": "gemma3", "text_config": hub_4b}, "c")
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in hub_4b.items() if k != "model_type"})
    for field in ("vocab_size", "num_attention_heads", "num_key_value_heads", "head_dim", "query_pre_attn_scalar",
                  "max_position_embeddings", "rms_norm_eps"):
        assert getattr(c, field) == getattr(theirs, field), field
    assert (c.vocab_size, c.num_attention_heads, c.num_key_value_heads) == (262_208, 8, 4)
    assert c.defaulted == ("vocab_size", "num_attention_heads", "num_key_value_heads")
    assert config_from_hf_dict(V4, "c").defaulted == ()
    assert "defaulted" not in c.to_dict()


def test_an_error_a_default_leads_to_says_it_was_taken(tmp_path):
    """A default the file does not hold is named as such in the error it leads to (a reviewer's
    finding: a 270M-style config without head counts got 'q_proj has shape [64, 64], expected [128, 64]'
    and nothing about the 8 assumed)."""
    from safetensors.numpy import save_file

    from gemma_export.sources.hf import read_hf_folder

    text = {k: v for k, v in V4.items() if k != "num_key_value_heads"}
    with pytest.raises(ConfigError, match=r"^c: num_attention_heads \(2\) is not a multiple of num_key_value_heads "
                                          r"\(4\) \(num_key_value_heads 4 is transformers' default: the config "
                                          r"gives none\)$"):
        config_from_hf_dict({**text, "num_attention_heads": 2}, "c")
    with pytest.raises(ConfigError, match=r"eos_token_id 1 is not below vocab_size 1$"):  # the file's own: no note
        config_from_hf_dict({**V4, "vocab_size": 1, "eos_token_id": 1}, "c")
    import json

    import numpy as np

    tiny = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "head_dim": 16, "sliding_window": 8, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    f = np.zeros
    weights = {"model.embed_tokens.weight": f((128, 32), np.float32), "model.norm.weight": f(32, np.float32)}
    p = "model.layers.0."
    for name, shape in (("self_attn.q_proj", (32, 32)), ("self_attn.k_proj", (16, 32)), ("self_attn.v_proj", (16, 32)),
                        ("self_attn.o_proj", (32, 32)), ("mlp.gate_proj", (64, 32)), ("mlp.up_proj", (64, 32)),
                        ("mlp.down_proj", (32, 64))):
        weights[p + name + ".weight"] = f(shape, np.float32)
    for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"):
        weights[p + name + ".weight"] = f(32, np.float32)
    weights[p + "self_attn.q_norm.weight"] = weights[p + "self_attn.k_norm.weight"] = f(16, np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \[32, 32\], "
                                          r"expected \[128, 32\] from the config \(num_attention_heads 8 and "
                                          r"num_key_value_heads 4 are transformers' default: the config gives neither\)$"):
        read_hf_folder(tmp_path, tokenizer=False)
    # each shape names only the defaults it depends on (a reviewer's finding: a q_proj error named vocab_size)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in tiny.items() if k != "vocab_size"}))
    with pytest.raises(FormatError, match=r"tensor 'model.embed_tokens.weight' has shape \[128, 32\], expected "
                                          r"\[262208, 32\] from the config \(vocab_size 262208 is transformers' default: "
                                          r"the config gives none\)$"):
        read_hf_folder(tmp_path, tokenizer=False)
    (tmp_path / "config.json").write_text(json.dumps({**tiny, "vocab_size": 128, "num_attention_heads": 2,
                                                      "num_key_value_heads": 1}))
    weights[p + "self_attn.q_proj.weight"] = f((16, 32), np.float32)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(FormatError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \[16, 32\], "
                                          r"expected \[32, 32\] from the config$"):  # the file's own head counts
        read_hf_folder(tmp_path, tokenizer=False)
    # an id beyond a defaulted vocabulary: the default named; with all three defaulted, the wording for three
    text = {k: v for k, v in V4.items() if k not in ("vocab_size", "num_attention_heads", "num_key_value_heads")}
    with pytest.raises(ConfigError, match=r"^c: eos_token_id 300000 is not below vocab_size 262208 \(vocab_size 262208 "
                                          r"is transformers' default: the config gives none\)$"):
        config_from_hf_dict({**text, "eos_token_id": 300000}, "c")
    assert config_from_hf_dict(text, "c").defaults_taken() == (
        " (vocab_size 262208 and num_attention_heads 8 and num_key_value_heads 4 are transformers' default: the "
        "config gives none of them)")
    assert config_from_hf_dict(text, "c").defaults_taken("num_key_value_heads") == (
        " (num_key_value_heads 4 is transformers' default: the config gives none)")


def test_a_rope_error_names_the_field_the_config_wrote():
    for cfg, field in (({**V4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'rope_scaling'"),
                       ({**_V5_TEXT, "rope_parameters": {FULL: {"rope_type": "yarn"}}}, "'rope_parameters.full_attention'"),
                       ({**_V5_TEXT, "rope_parameters": {FULL: {}}, "rope_scaling": {"rope_type": "yarn"}},
                        "'rope_parameters.full_attention' and 'rope_scaling'")):
        with pytest.raises(ConfigError, match=f"^c: rope_type 'yarn' in {field} is not supported"):
            config_from_hf_dict(cfg, "c")
