"""onnxruntime-genai runs an export folder as written (genai_config.json + model), with the same
greedy tokens as our own onnxruntime loop."""

import numpy as np
import pytest

from gemma_export.exporter import export
from gemma_export.runtime import OnnxDecoder

import onnxruntime_genai as og  # test extra: a missing one fails loudly instead of skipping the module


def _genai_greedy(folder, prompt_ids, max_length):
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=max_length, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
    new = []
    while not generator.is_done():
        generator.generate_next_token()
        new.append(int(generator.get_next_tokens()[0]))
    return new


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_genai_greedy_equals_ours(tiny_dir, tmp_path, dtype):
    out = export(tiny_dir, tmp_path / dtype, dtype, block_size=16 if dtype in ("int8", "int4") else None).out_dir
    prompt = [2, 17, 33, 52, 9, 71, 40, 12]
    ours, _, _ = OnnxDecoder(out).greedy(prompt, 16, stop_ids=[])
    theirs = _genai_greedy(out, prompt, len(prompt) + 16)
    # ours runs without stop ids; genai stops at eos, which this model does not emit in these 16 steps
    assert len(ours) == 16 and theirs == ours


def test_genai_config_fields_follow_the_config():
    """head_size is head_dim (256 for the 270M, not hidden / heads = 160); max_length is the context
    capped at 4,096; every stop id is listed."""
    from types import SimpleNamespace

    from gemma_export.config import config_from_hf_dict
    from gemma_export.exporter import genai_config
    from test_config import V4

    c = config_from_hf_dict(V4, "c")
    model = genai_config(SimpleNamespace(config=c))
    decoder = model["model"]["decoder"]
    assert (decoder["head_size"], decoder["hidden_size"]) == (256, 640)
    assert (decoder["num_attention_heads"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (4, 1, 18)
    assert model["model"]["eos_token_id"] == [1, 106] and model["model"]["context_length"] == 32768
    assert model["search"]["max_length"] == 4096
    short = genai_config(SimpleNamespace(config=config_from_hf_dict({**V4, "max_position_embeddings": 1024}, "c")))
    assert short["search"]["max_length"] == 1024
