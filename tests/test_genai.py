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
