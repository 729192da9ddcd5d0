"""The Python API on input a break-it round got wrong (twenty-third session): each case raised an
exception from deep inside numpy, pathlib or tokenizers, gave NaN figures or a false message, or
took a value it should refuse."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from gemma_export.errors import ConfigError, FormatError, GemmaExportError, NumericError, OutputError
from gemma_export.runtime import KVCache, OnnxDecoder, TextStream, load_tokenizer


def test_an_output_below_a_loop_of_links_is_an_output_error(tiny_dir, tmp_path):
    """export() raised pathlib's RuntimeError("Symlink loop ...") from its check of enclosing outputs."""
    from gemma_export.exporter import export

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(OutputError, match=r"a/x: cannot be resolved \(a loop of symbolic links\)"):
        export(tiny_dir, tmp_path / "a" / "x", "fp32")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_logits_beyond_float32_are_a_numeric_error_and_an_empty_chunk_is_refused():
    """compare_logits gave KL NaN for float64 logits of 1e39 (finite as float64, Inf as the float32
    the figures use); a chunk of no rows fixed the vocabulary at its width, and numpy failed on it."""
    from gemma_export.quality import LogitComparison, compare_logits

    rows = np.random.default_rng(0).standard_normal((5, 10))
    with pytest.raises(NumericError, match=r"the reference's row 0 holds NaN or Inf \(as float32\)"):
        compare_logits(rows * 1e39, rows, [1, 2, 3, 4, 5])
    comparison = LogitComparison([1, 2, 3, 4, 5])
    with pytest.raises(ConfigError, match=r"expected rows of logits, found \[0, 3\] and \[0, 3\]"):
        comparison.add(0, rows[:0, :3], rows[:0, :3])
    comparison.add(0, rows, rows)  # the real rows are still taken, at their own width
    assert comparison.result().top1_agreement == 1.0


def test_a_bool_tensor_is_no_token_id(tiny_int8_export):
    """torch.tensor([True, False]) ran as ids 1 and 0, where Python's and numpy's bools are refused."""
    torch = pytest.importorskip("torch")
    from gemma_export.errors import FormatError

    decoder = OnnxDecoder(tiny_int8_export, prepacked=False)
    with pytest.raises(FormatError, match="token id #0 is tensor.True.; expected an integer"):
        decoder.greedy(torch.tensor([True, False]), 2)
    assert len(decoder.greedy(torch.tensor([2, 5]), 2)[0]) == 2  # an integer tensor still runs


@pytest.mark.parametrize("bad", ["a", -1, 5.0, None, True])
def test_text_stream_refuses_what_is_no_token_id_and_keeps_working(tiny_int8_export, bad):
    """TextStream.add("a") raised the tokenizer's TypeError, and the id stayed stored: every later
    add and finish failed the same way."""
    shown = []
    stream = TextStream(load_tokenizer(tiny_int8_export), shown.append)
    with pytest.raises(ConfigError, match=f"TextStream.add: token_id must be an integer >= 0, found {bad!r}"):
        stream.add(bad)
    stream.add(5)
    stream.add(np.int64(6))
    assert stream.finish() == load_tokenizer(tiny_int8_export).decode([5, 6], skip_special_tokens=False)


def test_text_stream_takes_ids_beyond_32_bits_as_ids_the_vocabulary_lacks(tiny_int8_export):
    """An API user: add(2**32) raised tokenizers' OverflowError, and every later add and finish
    failed the same way; now it adds nothing, as 2**32 - 1 (also outside the vocabulary) does."""
    tokenizer = load_tokenizer(tiny_int8_export)
    shown = []
    stream = TextStream(tokenizer, shown.append)
    for token_id in (5, 2**32, 2**32 - 1, 2**70, 6):
        stream.add(token_id)
    assert stream.finish() == "".join(shown) == tokenizer.decode([5, 6], skip_special_tokens=False) != ""


@pytest.mark.parametrize("tokenizer, emit, message", [
    ("x", print, "TextStream: tokenizer must be a tokenizers.Tokenizer (with decode), found str"),
    (SimpleNamespace(decode="not a method"), print,
     "TextStream: tokenizer must be a tokenizers.Tokenizer (with decode), found SimpleNamespace"),
    (None, None, "TextStream: emit must be callable (it is called with each piece), found None"),
])
def test_text_stream_checks_what_it_is_given_when_made(tiny_int8_export, tokenizer, emit, message):
    """An API user: TextStream("x", print) and TextStream(tokenizer, None) failed only at the first
    add, as an AttributeError and a TypeError."""
    with pytest.raises(ConfigError) as refused:
        TextStream(tokenizer or load_tokenizer(tiny_int8_export), emit)
    assert str(refused.value) == message


def test_check_board_budget_names_what_it_was_given():
    """check_board_budget(None): AttributeError; a result naming an unknown board: KeyError."""
    import dataclasses

    from gemma_export.bench import BenchResult, check_board_budget

    with pytest.raises(ConfigError, match="result must be a BenchResult .*found NoneType"):
        check_board_budget(None)
    fields = {f.name: None for f in dataclasses.fields(BenchResult)}
    result = BenchResult(**{**fields, "board": "nope", "peak_rss_bytes": 1, "model": "m"})
    with pytest.raises(ConfigError, match="result.board is 'nope'; expected one of sl2610 or None"):
        check_board_budget(result)


def test_kv_cache_names_a_uint64_value_as_given_and_a_restart_truly(tiny_int8_export):
    """A uint64 2**64-1 was reported as "-1" (wrapped to int64); an attention_mask of it was taken
    as -1. A step from position 0 after the sliding layers dropped rows was refused with "needs the
    sliding layers' rows from position 0", which a new sequence does not need."""
    decoder = OnnxDecoder(tiny_int8_export, prepacked=False)
    cache = KVCache(decoder, 1, 64)
    huge = np.array([[2**64 - 1]], np.uint64)
    for name, args in (("input_ids", (huge, np.ones((1, 1)), [[0]])), ("position_ids", ([[2]], np.ones((1, 1)), huge)),
                       ("attention_mask", ([[2]], huge, [[0]]))):
        with pytest.raises(GemmaExportError, match=f"KV cache: {name} must hold int64 values, found "
                                                   f"18446744073709551615 \\(uint64\\) at \\[0, 0\\]"):
            cache.step(*args)
    window = decoder.sliding_window
    steps = window + 70  # past the window and the room beyond it: the sliding layers drop rows
    cache = KVCache(decoder, 1, steps + 1, max_step=1)
    for position in range(steps):
        cache.step([[2 + position % 7]], np.ones((1, position + 1)), [[position]])
    assert cache.sliding_start > 0
    with pytest.raises(GemmaExportError, match="a step from position 0 starts a new sequence, but this cache's "
                                               "sliding layers have dropped rows .*use a new KVCache for it"):
        cache.step([[2]], np.ones((1, 1)), [[0]])


def test_wrong_kinds_of_arguments_are_config_errors(tiny_int8_export):
    """check_length("300") raised "'>' not supported"; an os.PathLike giving bytes passed the check
    and failed in pathlib; a Hadamard size of 2**40 built gigabytes before numpy's MemoryError."""
    from quant.hadamard import MAX_HADAMARD_SIZE, hadamard_matrix

    decoder = OnnxDecoder(tiny_int8_export, prepacked=False)
    with pytest.raises(ConfigError, match="total_tokens"):
        decoder.check_length("300")

    class BytesPath(os.PathLike):
        def __fspath__(self):
            return os.fsencode(str(tiny_int8_export))

    with pytest.raises(ConfigError, match=r"must be a path \(str or os.PathLike\)"):
        OnnxDecoder(BytesPath())
    with pytest.raises(ValueError, match=f"Hadamard size must be at most {MAX_HADAMARD_SIZE:,}, found 8,192"):
        hadamard_matrix(2 * MAX_HADAMARD_SIZE)
    largest = hadamard_matrix(MAX_HADAMARD_SIZE)  # the documented limit is taken (a mutation refused it)
    assert largest.shape == (4096, 4096) and largest[0, 0] == np.float32(1 / 64) and largest[1, 1] == -largest[0, 0]
    assert Path(tiny_int8_export).is_dir()


def test_an_input_name_longer_than_the_file_system_takes_is_a_source_error(tmp_path):
    """The API's readers raised pathlib's OSError (errno 36) for an input path with a name longer
    than the file system takes (the command line printed it as one line); each is now a
    SourceNotFoundError naming the limit, as a missing path is."""
    import gemma_export
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.staging import max_name_bytes

    limit = max_name_bytes(tmp_path)
    long = tmp_path / ("n" * (limit + 1))
    calls = {
        "generate": lambda: gemma_export.generate(long, "hi"),
        "verify_manifest": lambda: gemma_export.verify_manifest(long),
        "inspect_path": lambda: gemma_export.inspect_path(long),
        "export": lambda: gemma_export.export(long, tmp_path / "out", "fp32"),
        "run_quality": lambda: gemma_export.run_quality(long),
        "run_bench": lambda: gemma_export.run_bench(long),
        "write_bundle": lambda: gemma_export.write_bundle(long, tmp_path / "bundle"),
    }
    for name, call in calls.items():
        with pytest.raises(SourceNotFoundError) as caught:
            call()
        assert f"File name too long (a name of {limit + 1} bytes in it; this file system takes at most {limit})" \
            in str(caught.value), name
    assert sorted(tmp_path.iterdir()) == []  # nothing begun


def test_forward_refuses_ids_outside_the_vocabulary_and_masks_that_are_not_left_padding(tiny_int8_export):
    """An API user: forward([[2, -1]]) gave the logits of [[2, 95]] without a word (onnxruntime's
    Gather counts a negative index from the end); masks with a 0 after a 1, or a 2, ran and matched
    no sequence. KVCache.step refuses the same masks."""
    from gemma_export.errors import FormatError
    from gemma_export.runtime import KVCache

    decoder = OnnxDecoder(tiny_int8_export, prepacked=False)
    positions = np.arange(3)[None]
    ones = np.ones((1, 3), np.int64)
    for ids, at, value in (([[2, -1, 96]], [0, 1], -1), ([[2, 5, 96]], [0, 2], 96), ([[2, 5, -96]], [0, 2], -96)):
        with pytest.raises(FormatError) as refused:
            decoder.forward(np.array(ids), ones, positions, decoder.empty_cache(1))
        assert str(refused.value) == (f"{tiny_int8_export}: forward(): input_ids{at} is {value}, outside the export's "
                                      "vocabulary (0 to 95)")
    for mask, message in (([[1, 0, 1]], "attention_mask is 0 at [0, 1], after a 1 in its row; 0 marks left padding "
                                         "only (positions before a row's first real token)"),
                          ([[1, 1, 0]], "attention_mask is 0 at [0, 2], after a 1 in its row"),
                          ([[0, 2, 1]], "attention_mask must hold 0 (left padding) and 1 (a real token), found 2 at "
                                        "[0, 1]"),
                          ([[1, -1, 1]], "attention_mask must hold 0 (left padding) and 1 (a real token), found -1 "
                                         "at [0, 1]")):
        with pytest.raises(FormatError, match=re.escape(f"{tiny_int8_export}: forward(): {message}")):
            decoder.forward(np.array([[2, 5, 6]]), np.array(mask), positions, decoder.empty_cache(1))
        with pytest.raises(FormatError, match=re.escape(f"KV cache: {message}")):
            KVCache(decoder, 1, 8).step([[2, 5, 6]], mask, positions)
    # left padding and a row of padding only (a padded prompt fed a token at a time) still run
    logits, _ = decoder.forward(np.array([[0, 2, 5]]), np.array([[0, 1, 1]]), positions, decoder.empty_cache(1))
    alone, _ = decoder.forward(np.array([[2, 5]]), np.ones((1, 2), np.int64), positions[:, :2], decoder.empty_cache(1))
    assert np.abs(logits - alone).max() < 1e-4
    KVCache(decoder, 1, 8).step([[0]], [[0]], [[0]])


def test_float16_inputs_of_a_kv_cache_step_raise_no_numpy_warning(tiny_int8_export):
    """An API user: float16 input_ids set off numpy's "overflow encountered in cast" (an exception
    under -W error) before the documented error, and a float16 mask the same before it was taken."""
    import warnings

    from gemma_export.runtime import KVCache

    cache = KVCache(OnnxDecoder(tiny_int8_export, prepacked=False), 1, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(GemmaExportError, match=r"input_ids must hold integers \(int64\), found float16 2\.0"):
            cache.step(np.array([[2, 5, 6]], np.float16), np.ones((1, 3)), np.arange(3)[None])
        cache.step(np.array([[2, 5, 6]]), np.ones((1, 3), np.float16), np.arange(3)[None])


@pytest.mark.parametrize("logits, found", [(np.zeros((2, 5), np.float32), "float32 [2, 5]"),
                                           (np.zeros(0, np.float32), "float32 [0]"), ([[0.5, 1.0]], "float64 [1, 2]"),
                                           (["a", "b"], "<U1 [2]")])
def test_picked_token_names_logits_that_are_not_one_position_s(logits, found):
    """An API user: 2-D logits raised numpy's IndexError, empty ones its "argmax of an empty
    sequence"; a row of -Inf only is a broken export, as NaN is."""
    from gemma_export.errors import NumericError
    from gemma_export.runtime import picked_token

    with pytest.raises(ConfigError) as refused:
        picked_token(logits, 0)
    assert str(refused.value) == f"picked_token: logits must be one position's logits, a 1-D array [vocab], found {found}"
    with pytest.raises(NumericError, match="step 3 picked token 0 whose logit is -inf"):
        picked_token(np.full(4, -np.inf, np.float32), 3)
    assert picked_token(np.array([0.5, 2.0, 2.0, -1.0], np.float32), 0) == 1  # ties: the lowest id
    assert picked_token([0.5, 3.0], 0) == 1  # a list, as numpy takes it


def test_a_graph_without_position_ids_takes_right_padding_and_batches_of_several_lengths_run_alone(
        tiny_int8_export, monkeypatch):
    """A reviewer: onnxruntime-genai's graphs count a row's positions from its mask (the sum of it),
    so right padding is their batch layout; the left-padding rule refused it, and greedy_batch's
    left padding gave another row's tokens on them (genai int4: [2098, 718, 718, ...] for a
    prompt that alone gives [236888, 564, 236789, ...]). Here the rule is kept for graphs that take
    position_ids, values other than 0 and 1 are refused for both, and greedy_batch runs a genai
    graph's prompts of several lengths one at a time."""
    from gemma_export.runtime import check_left_padding

    right = np.array([[1, 1, 1, 1], [1, 1, 0, 0]])
    check_left_padding(right, "genai", left_padding=False)
    with pytest.raises(FormatError, match=r"^ours: attention_mask is 0 at \[1, 2\], after a 1 in its row"):
        check_left_padding(right, "ours")
    with pytest.raises(FormatError, match=r"^genai: attention_mask must hold 0 \(padding\) and 1 \(a real token\), "
                                          r"found 2 at \[1, 1\]$"):
        check_left_padding(np.array([[1, 1], [1, 2]]), "genai", left_padding=False)
    with pytest.raises(FormatError, match=r"^ours: attention_mask must hold .*found 2 at \[0, 1\]$"):
        check_left_padding(np.array([[1, 2, 3]]), "ours")  # the first of several
    with pytest.raises(FormatError, match=r"^ours: attention_mask is 0 at \[1, 2\], after"):
        check_left_padding(np.array([[0, 1, 1, 1], [0, 1, 0, 0]]), "ours")
    big = np.array([[1, 2**64 - 1]], np.uint64)  # named as it is, not as int64's -1
    with pytest.raises(FormatError, match=r"found 18446744073709551615 at \[0, 1\]$"):
        check_left_padding(big, "ours")
    check_left_padding(np.array([[False, True, True]]), "ours")

    decoder = OnnxDecoder(tiny_int8_export, prepacked=False)
    prompts = [[2, 5, 6, 7, 8], [2, 9]]
    alone = [decoder.greedy(p, 4, stop_ids=())[0] for p in prompts]
    assert decoder.takes_position_ids and decoder.greedy_batch(prompts, 4) == alone
    monkeypatch.setattr(decoder, "takes_position_ids", False)
    ran = []
    real_greedy = decoder.greedy
    monkeypatch.setattr(decoder, "greedy", lambda prompt, *args, **kwargs: ran.append(list(prompt))
                        or real_greedy(prompt, *args, **kwargs))
    assert decoder.greedy_batch(prompts, 4) == alone and ran == prompts
    ran.clear()
    decoder.greedy_batch([[2, 5], [2, 9]], 4)  # one length: no padding, one batch
    assert ran == []


def test_a_folder_whose_manifest_cannot_be_read_gets_the_plain_missing_tokenizer_line(tmp_path):
    """A reviewer's mutation: an unreadable manifest taken as listing tokenizer.json survived."""
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError) as refused:
        load_tokenizer(tmp_path)
    assert str(refused.value) == (f"{tmp_path / 'tokenizer.json'}: missing; export again with the model's tokenizer "
                                  "(--tokenizer TOKENIZER.json), or from a source that carries one")
