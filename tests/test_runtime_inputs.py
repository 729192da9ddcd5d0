"""OnnxDecoder and generate on what a tester gave them: a folder of onnxruntime-genai run past its
context (a 55-line onnxruntime traceback, and a 5 MB prompt tokenized whole), an
``optimized_model_path`` that replaced an export's graph or wrote into another export, and API
arguments that ended in a raw ValueError, KeyError or a wrong output name."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from gemma_export import runtime
from gemma_export.errors import ConfigError, FormatError, GemmaExportError, OutputError
from gemma_export.runtime import OnnxDecoder

#: the context genai_config.json gives the folders below: not the tiny model's 256, so a limit of
#: 64 can only have come from that file
CONTEXT = 64


def _genai_folder(export: Path, dest: Path, **model) -> Path:
    """A folder as onnxruntime-genai's builder leaves one: an export's graph, tokenizer and
    ``genai_config.json``, no ``manifest.json``; ``model`` edits the config's ``model`` object (a
    value of None removes the field)."""
    shutil.copytree(export, dest)
    (dest / "manifest.json").unlink()
    config = json.loads((dest / "genai_config.json").read_text())
    config["model"].update(model)
    config["model"] = {key: value for key, value in config["model"].items() if value is not None}
    (dest / "genai_config.json").write_text(json.dumps(config))
    return dest


@pytest.fixture(scope="module")
def genai_dir(tiny_int8_export, tmp_path_factory) -> Path:
    return _genai_folder(tiny_int8_export, tmp_path_factory.mktemp("genai") / "genai", context_length=CONTEXT)


def _digests(folder: Path) -> dict[str, str]:
    """name → sha256 of every file under ``folder``: what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _no_session(monkeypatch) -> None:
    def no_session(*args, **kwargs):
        raise AssertionError("the session was created")

    monkeypatch.setattr(runtime, "create_session", no_session)


# 1. an onnxruntime-genai folder's context length


def test_a_genai_folder_takes_its_context_length_from_genai_config(genai_dir):
    """Its graph's cos_cache ends there: a longer run failed mid-step in GroupQueryAttention."""
    decoder = OnnxDecoder(genai_dir)
    assert decoder.manifest == {} and decoder.max_position_embeddings == CONTEXT
    new_ids, _, _ = decoder.greedy([2] * 60, CONTEXT - 60 + 1, stop_ids=[])  # 64 positions: the whole context
    assert len(new_ids) == 5
    # the limit named as the folder holds it (a tester: "max_position_embeddings", a field it has not)
    config = re.escape(f"{genai_dir / 'genai_config.json'}'s model.context_length")
    with pytest.raises(GemmaExportError, match=rf"^{re.escape(str(genai_dir))}: a sequence of 65 tokens \(the prompt "
                                               rf"and the new tokens fed back\) exceeds {config} {CONTEXT}$"):
        decoder.greedy([2] * 60, 6)
    with pytest.raises(GemmaExportError, match=rf"^{re.escape(str(genai_dir))}: a sequence of 65 teacher-forced ids"):
        decoder.teacher_forced_logits([2] * 65)


def test_generate_on_a_genai_folder_refuses_a_long_prompt_after_tokenizing_a_prefix(genai_dir, encoded_lengths,
                                                                                    monkeypatch):
    """The tester's 5 MB prompt was tokenized whole (15 s, 2 GB) and then failed in onnxruntime."""
    _no_session(monkeypatch)  # refused before the (slow) session, as for an export with a manifest
    config = re.escape(f"{genai_dir / 'genai_config.json'}'s model.context_length")
    with pytest.raises(GemmaExportError, match=rf"^{re.escape(str(genai_dir))}: the prompt: more than {CONTEXT} "
                                               rf"tokens, {config}; give a shorter prompt$"):
        runtime.generate(genai_dir, "the quick brown fox " * 50_000, 4)
    assert encoded_lengths and max(encoded_lengths) <= 2 * 4096, encoded_lengths  # prefixes of a 1 MB prompt


def test_generate_on_a_genai_folder_refuses_a_run_past_its_context_before_the_session(genai_dir, monkeypatch):
    _no_session(monkeypatch)
    prompt = "the quick brown fox jumps over the lazy dog. "  # 45 characters: 46 ids with <bos>, and 19 fed back
    with pytest.raises(GemmaExportError, match=rf"^{re.escape(str(genai_dir))}: a sequence of 65 tokens .* "
                                               rf"model.context_length {CONTEXT}$"):
        runtime.generate(genai_dir, prompt, 20)


def test_quality_on_a_genai_folder_past_its_context_is_one_line(genai_dir, tiny_int8_export, tmp_path):
    from gemma_export.quality import run_quality

    text_file = tmp_path / "text.txt"  # 91 tokens: more than the folder's 64, fewer than the reference's 256
    text_file.write_text("the quick brown fox jumps over the lazy dog. " * 2)
    config = re.escape(f"{genai_dir / 'genai_config.json'}'s model.context_length")
    with pytest.raises(GemmaExportError, match=rf"^{re.escape(str(genai_dir))}: {re.escape(str(text_file))} has more "
                                               rf"than {CONTEXT} tokens, {config}; pass --tokens {CONTEXT} or fewer$"):
        run_quality(genai_dir, str(tiny_int8_export), text=text_file)


@pytest.mark.parametrize("value", ["64", 0, -1, True, 2 ** 31, 64.0])
def test_a_malformed_genai_context_length_is_named(tiny_int8_export, tmp_path, value):
    folder = _genai_folder(tiny_int8_export, tmp_path / "genai", context_length=value)
    message = (rf"^{re.escape(str(folder / 'genai_config.json'))}: field 'model.context_length' must be a positive "
               rf"integer below 2\*\*31 \(int32 positions\), found {re.escape(json.dumps(value))}$")
    with pytest.raises(FormatError, match=message):
        OnnxDecoder(folder)
    with pytest.raises(FormatError, match=message):
        runtime.generate(folder, "the fox", 2)


def test_max_positions_reads_the_manifest_and_genai_config_only_without_one(tiny_int8_export, tmp_path):
    """The figure generate checks before the session is the one the decoder then checks."""
    from conftest import export_with_config

    folder = export_with_config(tiny_int8_export, tmp_path / "short", max_position_embeddings=40)
    assert json.loads((folder / "genai_config.json").read_text())["model"]["context_length"] == 256
    assert runtime.max_positions(folder) == 40 == OnnxDecoder(folder).max_position_embeddings
    # a manifest without the field: no figure, not the genai_config.json beside it (the exporter wrote both)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["config"]["max_position_embeddings"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert runtime.max_positions(folder) is None and OnnxDecoder(folder).max_position_embeddings is None
    folder = _genai_folder(tiny_int8_export, tmp_path / "genai", context_length=48)
    assert runtime.max_positions(folder) == 48 == OnnxDecoder(folder).max_position_embeddings
    folder = _genai_folder(tiny_int8_export, tmp_path / "genai-without", context_length=None)
    assert runtime.max_positions(folder) is None and OnnxDecoder(folder).max_position_embeddings is None


# 2. optimized_model_path


def test_an_optimized_model_path_that_is_the_exports_own_file_is_refused(tiny_int8_export, tmp_path, monkeypatch):
    """The tester's run with P = the export's model.onnx replaced the graph (verify then failed)."""
    folder = tmp_path / "export"
    shutil.copytree(tiny_int8_export, folder)
    before = _digests(folder)
    _no_session(monkeypatch)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(folder / 'model.onnx'))}: optimized_model_path is "
                                          rf"{re.escape(str(folder / 'model.onnx'))}, a file of the export being "
                                          r"loaded, which onnxruntime would overwrite with its optimized graph; give "
                                          r"a path outside the export$"):
        OnnxDecoder(folder, optimized_model_path=folder / "model.onnx")
    link = tmp_path / "elsewhere.onnx"  # a hard link: another name for the same file, outside every export
    os.link(folder / "model.onnx.data", link)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(link))}: optimized_model_path is "
                                          rf"{re.escape(str(folder / 'model.onnx.data'))}, a file of the export"):
        OnnxDecoder(folder, optimized_model_path=link)
    assert _digests(folder) == before


def test_a_genai_folders_own_graph_is_refused_as_optimized_model_path(genai_dir, monkeypatch):
    """No manifest marks the folder: its files are found by identity."""
    before = _digests(genai_dir)
    _no_session(monkeypatch)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(genai_dir / 'model.onnx'))}: optimized_model_path is "
                                          rf"{re.escape(str(genai_dir / 'model.onnx'))}, a file of the export"):
        OnnxDecoder(genai_dir, optimized_model_path=genai_dir / "model.onnx")
    assert _digests(genai_dir) == before


def test_an_optimized_model_path_inside_another_output_is_refused(tiny_int8_export, genai_dir, tmp_path, monkeypatch):
    """The tester's P inside another export folder added a file its manifest does not list."""
    before = _digests(tiny_int8_export)
    _no_session(monkeypatch)
    inside = tiny_int8_export / "optimized.onnx"
    with pytest.raises(OutputError, match=rf"^{re.escape(str(inside))}: is inside {re.escape(str(tiny_int8_export))}, "
                                          r"an output of gemma-export whose manifest would no longer list every file "
                                          r"in it; write the optimized graph \(optimized_model_path\) elsewhere$"):
        OnnxDecoder(genai_dir, optimized_model_path=inside)
    copy = tmp_path / "moved" / "prepacked"  # a pre-packed copy outside its export
    copy.mkdir(parents=True)
    (copy / "prepacked.json").write_text("{}")
    with pytest.raises(OutputError, match=rf"^{re.escape(str(copy / 'sub' / 'o.onnx'))}: optimized_model_path is "
                                          rf"inside {re.escape(str(copy))}, a pre-packed copy of gemma-export"):
        OnnxDecoder(genai_dir, optimized_model_path=copy / "sub" / "o.onnx")
    assert _digests(tiny_int8_export) == before and not inside.exists()


def test_an_optimized_model_path_through_a_loop_of_links_is_one_line(genai_dir, tmp_path, monkeypatch):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    _no_session(monkeypatch)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(tmp_path / 'a' / 'o.onnx'))}: optimized_model_path "
                                          r"cannot be resolved \(.*\); give a path that leads to a file$"):
        OnnxDecoder(genai_dir, optimized_model_path=tmp_path / "a" / "o.onnx")


def test_an_optimized_model_path_outside_every_output_is_written(genai_dir, tmp_path):
    import onnx

    path = tmp_path / "optimized.onnx"
    OnnxDecoder(genai_dir, optimized_model_path=path)
    assert len(onnx.load(str(path), load_external_data=False).graph.node) > 0


# 3. API arguments


@pytest.fixture(scope="module")
def decoder(genai_dir) -> OnnxDecoder:
    return OnnxDecoder(genai_dir)


def test_empty_cache_of_a_bad_batch_size_is_a_config_error(decoder):
    with pytest.raises(ConfigError, match=r"^empty_cache\(\): batch_size must be >= 1, found -1$"):
        decoder.empty_cache(-1)
    with pytest.raises(ConfigError, match=r"^empty_cache\(\): batch_size must be >= 1, found 0$"):
        decoder.empty_cache(0)
    with pytest.raises(ConfigError, match=r"^empty_cache\(\): batch_size must be an int, found str '2'$"):
        decoder.empty_cache("2")
    assert decoder.empty_cache(3)["past_key_values.3.value"].shape == (3, 2, 0, 16)


@pytest.mark.parametrize("past, found", [({}, "an empty dict"), (None, "NoneType"), ([], "list"),
                                         ("drop 3.value", "a dict of 7 entries without past_key_values.3.value")])
def test_forward_with_a_past_that_lacks_a_layer_is_a_config_error(decoder, past, found):
    ids = np.asarray([[2, 5]], np.int64)
    if past == "drop 3.value":
        past = decoder.empty_cache(1)
        del past["past_key_values.3.value"]
    with pytest.raises(ConfigError, match=rf"^forward\(\): past must be a dict of past_key_values\.\{{i\}}\.key\|value "
                                          rf"for layers 0 to 3 \(empty_cache\(batch_size\) for the first step\), "
                                          rf"found {re.escape(found)}$"):
        decoder.forward(ids, np.ones_like(ids), np.arange(2)[None], past)
    logits, present = decoder.forward(ids, np.ones_like(ids), np.arange(2)[None], decoder.empty_cache(1))
    assert logits.shape[-1] == 96 and present["past_key_values.3.value"].shape == (1, 2, 2, 16)


@pytest.mark.parametrize("names, found", [("logits", "str 'logits'"), (["logits", 3], "list ['logits', 3]"),
                                          (None, "NoneType None")])
def test_prefill_outputs_names_must_be_a_list_of_names(decoder, names, found):
    with pytest.raises(ConfigError, match=rf"^prefill_outputs\(\): names must be a list or tuple of output names "
                                          rf"\(str\), found {re.escape(found)}$"):
        decoder.prefill_outputs([2], names)
    assert decoder.prefill_outputs([2, 5], ("logits",))["logits"].shape == (1, 1, 96)


def test_prefill_outputs_token_ids_must_be_a_sequence(decoder):
    with pytest.raises(ConfigError, match=r"^prefill_outputs\(\): token_ids must be a sequence \(list, tuple, 1-D "
                                          r"array\) of token ids, found int 2$"):
        decoder.prefill_outputs(2, ["logits"])


def test_quality_and_parity_on_a_genai_folder_tokenize_a_prefix_of_a_long_text(genai_dir, tiny_int8_export, tmp_path,
                                                                               encoded_lengths):
    """quality read the limit from the manifest alone: a genai folder's whole 5 MB text was tokenized
    (7.5 s, 2 GB) before the decoder refused it."""
    from gemma_export.parity import run_parity
    from gemma_export.quality import run_quality

    text_file = tmp_path / "long.txt"
    text_file.write_text("the quick brown fox jumps over the lazy dog. " * 25_000)  # 1.1 MB
    with pytest.raises(GemmaExportError, match=f"has more than {CONTEXT} tokens"):
        run_quality(genai_dir, str(tiny_int8_export), text=text_file)
    assert encoded_lengths and max(encoded_lengths) <= 2 * 4096, max(encoded_lengths)
    encoded_lengths.clear()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox " * 50_000)  # one prompt of 1 MB
    golden = tmp_path / "golden.json"
    golden.write_text("[5]")
    with pytest.raises(GemmaExportError, match=f"more than {CONTEXT} tokens"):
        run_parity(genai_dir, golden=golden, prompts=prompts)
    assert encoded_lengths and max(encoded_lengths) <= 2 * 4096, max(encoded_lengths)


def test_an_optimized_model_path_in_no_folder_or_with_other_hard_links_is_refused(tiny_int8_export, tmp_path,
                                                                                  monkeypatch):
    """A tester: a path in a missing folder blamed the model ("onnxruntime cannot load the model:
    SystemError : 2"); a hard link to another export's graph, outside every export, had that graph
    overwritten."""
    _no_session(monkeypatch)
    missing = tmp_path / "nope" / "o.onnx"
    with pytest.raises(OutputError, match=rf"^{re.escape(str(missing))}: optimized_model_path lies in "
                                          rf"{re.escape(str(missing.parent))}, which is no folder"):
        OnnxDecoder(tiny_int8_export, optimized_model_path=missing)
    other = tmp_path / "other"
    shutil.copytree(tiny_int8_export, other)
    link = tmp_path / "o.onnx"
    os.link(other / "model.onnx", link)
    before = _digests(other)
    with pytest.raises(OutputError, match=rf"^{re.escape(str(link))}: optimized_model_path is a file with 2 hard links"):
        OnnxDecoder(tiny_int8_export, optimized_model_path=link)
    assert _digests(other) == before


def test_a_step_refuses_positions_the_graph_does_not_take(tiny_int8_export):
    """position_ids were not checked: -5 and 100,000 (max_position_embeddings 256 on the tiny
    model) gave logits without a word, while an id outside the vocabulary was refused (a break-it
    run). The last position (255) is taken."""
    from gemma_export.runtime import KVCache, OnnxDecoder

    decoder = OnnxDecoder(tiny_int8_export)
    assert decoder.max_position_embeddings == 256
    for position, message in ((-5, r"must be >= 0, found -5 at \[0, 0\]"),
                              (256, r"must be below the model's max_position_embeddings 256, found 256 at \[0, 0\]"),
                              (100_000, r"found 100000 at \[0, 0\]")):
        with pytest.raises(GemmaExportError, match=rf"^KV cache: position_ids {message}" if "must" in message else message):
            KVCache(decoder, 1, 10).step([[2]], [[1]], [[position]])
    assert KVCache(decoder, 1, 10).step([[2]], [[1]], [[255]]).shape == (1, 1, decoder.vocab_size)


def test_teacher_forcing_beyond_the_limit_names_its_ids_not_a_prompt(tiny_int8_export):
    from gemma_export.runtime import OnnxDecoder

    decoder = OnnxDecoder(tiny_int8_export)
    with pytest.raises(GemmaExportError, match=r": a sequence of 257 teacher-forced ids exceeds the model's "
                                               r"max_position_embeddings 256$"):
        decoder.teacher_forced_logits([2] * 257)


def test_a_named_pipe_given_as_the_export_folder_is_not_called_a_file(tmp_path):
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.manifest import require_folder

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(SourceNotFoundError, match=r": is not a regular file \(a FIFO, socket or device\); expected an "
                                                  r"export folder \(the one holding model.onnx\)$"):
        require_folder(fifo, "model.onnx")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SourceNotFoundError, match=r"file: is a file; expected an export folder"):
        require_folder(tmp_path / "file", "model.onnx")


def test_padded_slots_may_hold_any_position(tiny_int8_export):
    """Left padding with position -1 (cumsum(mask) - 1, before a masked fill) ran before the position
    check and must still run (a review): only slots the mask attends are checked, and the logits are
    those of the same batch with the padding's positions at 0."""
    from gemma_export.runtime import KVCache

    decoder = OnnxDecoder(tiny_int8_export)
    mask = np.array([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    ids = np.array([[0, 0, 0, 17, 33], [2, 17, 33, 40, 41]], np.int64)
    positions = np.cumsum(mask, axis=1) - 1
    assert positions.min() == -1
    padded = KVCache(decoder, 2, 8).step(ids, mask, positions)
    clipped = KVCache(decoder, 2, 8).step(ids, mask, np.clip(positions, 0, None))
    np.testing.assert_array_equal(padded, clipped)
    attended = np.clip(positions, 0, None)
    attended[1, 4] = -1  # a slot the mask attends
    with pytest.raises(GemmaExportError, match=r"position_ids must be >= 0, found -1 at \[1, 4\]"):
        KVCache(decoder, 2, 8).step(ids, mask, attended)


def test_a_manifest_of_ours_that_lost_its_file_listing_is_refused_by_the_runtime(tiny_int8_export, tmp_path):
    """A review: the runtime's file check skipped a manifest without 'files' (meant for other tools'
    folders), so a graph swapped in and that field deleted ran in generate, bench and quality. A
    manifest gemma-export wrote names it in 'tool'; another tool's is still read as before."""
    folder = tmp_path / "int8"
    shutil.copytree(tiny_int8_export, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["files"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match="field 'files' must be an object .*found nothing"):
        OnnxDecoder(folder, prepacked=False)
    del manifest["tool"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    assert OnnxDecoder(folder, prepacked=False).vocab_size > 0


def test_an_infinite_picked_logit_is_refused_like_a_nan():
    """picked_token's docstring: +Inf becomes the argmax as NaN does, and is refused the same way
    (only NaN logits were tested: a check of isnan alone passed every test)."""
    from gemma_export.errors import NumericError

    logits = np.array([0.5, np.inf, 3.0, -np.inf], np.float32)
    with pytest.raises(NumericError, match=r"m\.onnx: logits: prompt #1, step 4 picked token 1 whose logit is inf"):
        runtime.picked_token(logits, 4, "prompt #1", "m.onnx")
    # -Inf elsewhere in the row is a word the model rules out, not a broken export
    assert runtime.picked_token(logits[[0, 2, 3]], 0) == 1
