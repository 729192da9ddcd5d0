"""tools/plain_onnxruntime.py, the I/O contract of docs/integration.md as code without this toolkit:
its two cache modes give `gemma-export generate`'s tokens on tiny exports whose sliding window (6)
makes the sliding layers drop rows, in prompt steps and in decode steps."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import plain_onnxruntime as plain
from conftest import write_char_tokenizer
from gemma_export.exporter import export
from gemma_export.runtime import KVCache, OnnxDecoder

#: 97 characters, so the prompt alone passes the sliding layers' window - 1 + SLIDING_ROOM = 69 rows
PROMPT = "the quick brown fox jumps over the lazy dog; many hands make light work. one, two, three; (four)"


@pytest.fixture(scope="module")
def tiny_fp32_export(tiny_dir, tmp_path_factory):
    src = tmp_path_factory.mktemp("plain_src")
    shutil.copytree(tiny_dir, src, dirs_exist_ok=True)
    write_char_tokenizer(src)
    return export(src, tmp_path_factory.mktemp("plain_fp32") / "fp32", "fp32").out_dir


def _recorded(step_fn, record):
    def step(input_ids, attention_mask, position_ids, past):
        logits = step_fn(input_ids, attention_mask, position_ids, past)
        record.append(np.array(logits))
        return logits
    return step


def _toolkit(folder, ids, new_tokens, chunk):
    """The toolkit's own greedy run (`generate`'s path): its ids, each step's logits, and the
    position its sliding buffers' first row held at the end (> 0: rows were dropped)."""
    decoder = OnnxDecoder(folder, threads=1, prepacked=False)
    record = []
    cache = KVCache(decoder, 1, len(ids) + new_tokens - 1, max_step=chunk)
    original = cache.step
    cache_step = _recorded(lambda i, m, p, past: original(i, m, p), record)
    new_ids = plain.steps(ids, new_tokens, chunk, cache_step, set())
    assert new_ids == decoder.greedy(ids, new_tokens, stop_ids=(), prefill_chunk=chunk)[0]
    return new_ids, record, cache.sliding_start


@pytest.mark.parametrize("export_name", ["tiny_fp32_export", "tiny_int8_export"])
@pytest.mark.parametrize("prompt, new_tokens, chunk", [(PROMPT, 40, 512), (PROMPT, 40, 16), ("the fox", 120, 512)])
def test_shared_buffers_give_the_toolkits_logits_exactly(export_name, prompt, new_tokens, chunk, request):
    """Each step's logits bit for bit: a long prompt in one step or in steps of 16, and a prompt
    shorter than the room of 64 rows whose drops all come in decode steps (review finding: the
    buffers were sized by the prompt's length, not the step's, and dropped a step early)."""
    folder = request.getfixturevalue(export_name)
    model = plain.Model(folder, threads=1)
    ids = model.encode(prompt)
    assert ids[0] == 2 and ids.count(2) == 1 and len(ids) == len(prompt) + 1
    want_ids, want, dropped_to = _toolkit(folder, ids, new_tokens, chunk)
    assert dropped_to > 0 and model.sliding
    record = []
    step = plain.shared_step(model, len(ids) + new_tokens - 1, chunk)
    got_ids = plain.steps(ids, new_tokens, chunk, _recorded(step, record), set())
    assert got_ids == want_ids
    assert len(record) == len(want) and all(np.array_equal(a, b) for a, b in zip(record, want))
    assert plain.generate(model, ids, new_tokens, "shared", chunk) == want_ids


def test_arrays_mode_gives_the_same_tokens_on_fp32(tiny_fp32_export):
    model = plain.Model(tiny_fp32_export, threads=1)
    ids = model.encode(PROMPT)
    want_ids, want, _ = _toolkit(tiny_fp32_export, ids, 40, 16)
    record = []
    got_ids = plain.steps(ids, 40, 16, _recorded(plain.arrays_step(model), record), set())
    assert got_ids == want_ids
    assert max(float(np.abs(a - b).max()) for a, b in zip(record, want)) < 1e-4


def test_one_bos_whatever_the_text_starts_with(tiny_int8_export):
    """tokenizer.json adds <bos>; text starting with "<bos>" gets a second one, which is dropped (one
    only, as generate's encode_prompt); a tokenizer that adds none gets one."""
    model = plain.Model(tiny_int8_export)
    assert model.encode("ab") == [2, 4, 5]
    for given, want in (([2, 2, 4, 5], [2, 4, 5]), ([4, 5], [2, 4, 5]), ([2, 2, 2, 4], [2, 2, 4])):
        model.tokenizer = type("Stub", (), {"encode": lambda self, text, ids=given: type("E", (), {"ids": ids})()})()
        assert model.encode("ab") == want  # "<bos><bos>a": two, as generate feeds it


def test_main_writes_a_golden_entry_that_parity_passes(tiny_int8_export, tmp_path, capsys):
    """The script's command line, with a stop id: its --json is a golden entry (generate's keys),
    and `gemma-export parity --golden` finds the toolkit gives the same ids."""
    from typer.testing import CliRunner

    from gemma_export.cli import app

    golden = tmp_path / "golden.json"
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", PROMPT, "--max-new-tokens", "30",
                       "--chunk", "16", "--json", str(golden)]) == 0
    record = json.loads(golden.read_text())
    assert sorted(record) == ["expected_ids", "prefill_chunk", "prompt", "prompt_ids"] and record["prefill_chunk"] == 16
    assert record["prompt"] == PROMPT  # a fresh user: parity named the entry by its ids alone
    decoder = OnnxDecoder(tiny_int8_export, threads=1, prepacked=False)
    assert record["expected_ids"] == decoder.greedy(record["prompt_ids"], 30, prefill_chunk=16)[0]
    checked = CliRunner().invoke(app, ["parity", "--model", str(tiny_int8_export), "--golden", str(golden)])
    assert checked.exit_code == 0 and "verdict: PASS" in checked.stdout, checked.output
    # written again over its own earlier record
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", "ab", "--max-new-tokens", "2", "--json", str(golden)]) == 0


def test_a_prompt_file_gives_the_ids_generate_gives_it(tiny_int8_export, tmp_path):
    """A reviewer: the script read --prompt-file with read_text, whose universal newlines turned CRLF
    into "\\n", and kept a byte-order mark that `generate --prompt-file` drops: the same file, other
    ids."""
    from typer.testing import CliRunner

    from gemma_export.cli import app

    turn = tmp_path / "turn.txt"
    turn.write_bytes("\ufeffab\r\nc\r\n".encode())
    assert plain.main(["--model", str(tiny_int8_export), "--prompt-file", str(turn), "--max-new-tokens", "2",
                       "--json", str(tmp_path / "plain.json")]) == 0
    done = CliRunner().invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt-file", str(turn),
                                    "--max-new-tokens", "2", "--json", str(tmp_path / "toolkit.json")])
    assert done.exit_code == 0, done.output
    ours = json.loads((tmp_path / "plain.json").read_text())
    toolkit = json.loads((tmp_path / "toolkit.json").read_text())
    assert toolkit["prompt"] == "ab\r\nc\r\n" and ours["prompt_ids"] == toolkit["prompt_ids"]


def test_json_never_replaces_another_file_and_is_checked_before_the_run(tiny_int8_export, tmp_path, capsys, monkeypatch):
    """Fresh-user finding: --json naming the export's data file replaced it (the export was lost),
    and a --json in a missing folder failed after the run."""
    data = tmp_path / "model.onnx.data"
    data.write_bytes(b"\x00weights" * 100)
    monkeypatch.setattr(plain, "Model", lambda *a, **k: pytest.fail("the model was loaded before --json was checked"))
    for target, reason in ((data, "exists and is not a record this script wrote; not replaced"),
                           (tmp_path / "no" / "out.json", f"folder {tmp_path / 'no'} does not exist")):
        assert plain.main(["--model", str(tiny_int8_export), "--prompt", "a", "--json", str(target)]) == 2
        assert capsys.readouterr().err == f"error: {target}: {reason}\n"
    assert data.read_bytes() == b"\x00weights" * 100


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.pop("config"), "{manifest}: no 'config' object; is this an export folder?"),
    (lambda m: m.update(config=None), "{manifest}: no 'config' object; is this an export folder?"),
    (lambda m: m["config"].pop("head_dim"), "{manifest}: field 'config.head_dim' is missing"),
    (lambda m: m["config"].update(max_position_embeddings=40),
     "{model}: 97 prompt tokens and 4 new ones take 100 positions, more than the model's max_position_embeddings 40"),
    # a tester's hand edits: a traceback, onnxruntime's own errors, or a message without the field
    (lambda m: m["config"].update(num_hidden_layers="x"),
     "{manifest}: field 'config.num_hidden_layers' must be an integer >= 1, found \"x\""),
    (lambda m: m["config"].update(eos_token_id=None),
     "{manifest}: field 'config.eos_token_id' must be a token id or a non-empty list of them, found null"),
    (lambda m: m["config"].update(num_hidden_layers=3, layer_types=m["config"]["layer_types"][:3]),
     "{manifest}: field 'config.num_hidden_layers' is 3, but {model}/model.onnx has 4 layers' past_key_values inputs"),
    (lambda m: m["config"].update(num_hidden_layers=5),
     "{manifest}: field 'config.layer_types' has 4 entries, 'config.num_hidden_layers' is 5"),
    (lambda m: m["config"].update(max_position_embeddings="x"),
     "{manifest}: field 'config.max_position_embeddings' must be an integer >= 1 (or absent), found \"x\""),
    (lambda m: m["config"].update(head_dim=m["config"]["head_dim"] * 2),
     "{manifest}: field 'config.head_dim' is {head_dim2}, but {model}/model.onnx's past_key_values.0.key has {head_dim}"),
    # a tester's hand edits (twenty-first session): other tokens without a word, or onnxruntime's error mid-run
    (lambda m: m["config"].update(sliding_window=1),
     "{manifest}: field 'config.sliding_window' is 1, but {model}/model.onnx was built with {window}"),
    (lambda m: m["config"].update(layer_types=m["config"]["layer_types"][::-1]),
     "{manifest}: field 'config.layer_types' makes layers [{reversed_sliding}] sliding, but {model}/model.onnx was "
     "built with sliding layers {sliding}"),
    (lambda m: m["config"].update(bos_token_id=999999),
     "{manifest}: field 'config.bos_token_id' holds 999999, outside {model}/model.onnx's vocabulary of 96 ids"),
    (lambda m: m["config"].update(eos_token_id=[1, 96]),
     "{manifest}: field 'config.eos_token_id' holds 96, outside {model}/model.onnx's vocabulary of 96 ids"),
])
def test_a_manifest_it_cannot_use_or_too_long_a_run_is_one_line(tiny_int8_export, tmp_path, capsys, edit, message):
    """Probe findings: a manifest without config printed "error: DIR: 'config'", and a run past
    max_position_embeddings ran (and wrote a golden entry parity refuses)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    edit(manifest)
    (model / "manifest.json").write_text(json.dumps(manifest))
    assert plain.main(["--model", str(model), "--prompt", PROMPT, "--max-new-tokens", "4"]) == 2
    config = json.loads((tiny_int8_export / "manifest.json").read_text())["config"]
    head_dim, types = config["head_dim"], config["layer_types"]
    sliding = [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    reversed_sliding = [i for i, kind in enumerate(types[::-1]) if kind == "sliding_attention"]
    assert sliding != reversed_sliding  # the edit changes which layers slide
    expected = message.format(manifest=model / "manifest.json", model=model, head_dim=head_dim, head_dim2=2 * head_dim,
                              window=config["sliding_window"], sliding=",".join(map(str, sliding)),
                              reversed_sliding=", ".join(map(str, reversed_sliding)))
    assert capsys.readouterr().err == "error: " + expected + "\n"


def test_a_json_path_that_is_a_folder_is_named_as_one(tiny_int8_export, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plain, "Model", lambda *a, **k: pytest.fail("the model was loaded before --json was checked"))
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", "a", "--json", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: is a folder; expected a file to write the ids to\n"


def test_ctrl_c_is_one_line_and_status_130(tiny_int8_export, tmp_path):
    """Ctrl-C printed onnxruntime's (or the read's) traceback, where every other tool says 'interrupted'."""
    import os
    import signal
    import subprocess
    import sys
    import time

    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)  # the script waits in the prompt's read until the test interrupts it
    script = Path(__file__).resolve().parents[1] / "tools" / "plain_onnxruntime.py"
    proc = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_int8_export), "--prompt-file", str(fifo)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wchan = Path(f"/proc/{proc.pid}/wchan")
    deadline = time.monotonic() + 60
    # the kernel function it waits in: opening a FIFO no one writes (wait_for_partner), or reading it
    while time.monotonic() < deadline and not any(
            word in (wchan.read_text() if wchan.exists() else "fifo") for word in ("partner", "fifo", "pipe")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "error: interrupted\n" and out == "", err


def test_one_stop_id_as_a_number_and_threads_beyond_the_machine(tiny_int8_export, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    manifest = json.loads((model / "manifest.json").read_text())
    manifest["config"]["eos_token_id"] = 1  # one id, as transformers' configs may give it
    (model / "manifest.json").write_text(json.dumps(manifest))
    assert plain.Model(model).stop == {1}
    with pytest.raises(SystemExit) as exit_:
        plain.main(["--model", str(model), "--prompt", "a", "--threads", "100000"])
    assert exit_.value.code == 2 and "--threads must be 1 to" in capsys.readouterr().err


def test_the_pre_packed_copy_gives_the_same_ids(tiny_int8_export, tmp_path, capsys):
    from gemma_export.prepack import prepack

    folder = tmp_path / "model"
    shutil.copytree(tiny_int8_export, folder)
    prepack(folder)
    runs = []
    for flag in ([], ["--prepacked"]):
        assert plain.main(["--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "20", "--json", "-", *flag]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1]
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", "a", "--prepacked"]) == 2  # no copy there
    assert capsys.readouterr().err == (f"error: {tiny_int8_export / 'prepacked' / 'model.onnx'}: no pre-packed copy; "
                                       f"`gemma-export prepack --model {tiny_int8_export}` makes one on this machine "
                                       "(or leave out --prepacked)\n")


@pytest.mark.parametrize("case, where, reason", [
    ("no manifest", "{tmp}", "no manifest.json; not an export folder of gemma-export"),
    ("no graph", "{tmp}/model.onnx", "No such file or directory"),
    ("no prompt file", "{tmp}/absent.txt", "No such file or directory"),
    ("json in a missing folder", "{tmp}/no/out.json", "does not exist"),
])
def test_bad_input_is_one_line_naming_the_file(tiny_int8_export, tmp_path, capsys, case, where, reason):
    """Probe of the script: one error line naming the file, status 2 (bad input, as every tool), no traceback."""
    model, text = tmp_path, ["--prompt", "a"]
    if case == "no graph":
        shutil.copy(tiny_int8_export / "manifest.json", tmp_path)
    elif case != "no manifest":
        model = tiny_int8_export
    if case == "no prompt file":
        text = ["--prompt-file", str(tmp_path / "absent.txt")]
    if case == "json in a missing folder":
        text += ["--json", str(tmp_path / "no" / "out.json")]
    assert plain.main(["--model", str(model), *text, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {where.format(tmp=tmp_path)}: ") and reason in err and err.count("\n") == 1, err


def test_the_script_prints_the_text_generate_shows(tiny_int8_export, tmp_path, capsys):
    """The same text as `gemma-export generate`: special tokens included, the stop id that ends the
    generation left out (the script printed tokenizers' default decode, which differs on both)."""
    from conftest import export_with_config
    from gemma_export.runtime import generate

    o = 4 + "abcdefghijklmnopqrstuvwxyz".index("o")  # the character tokenizer's id of "o"
    model = export_with_config(tiny_int8_export, tmp_path / "m", eos_token_id=[1, o])  # "o" stops it
    result = generate(model, "the fox", max_new_tokens=30, threads=1, prepacked=False)
    assert result.new_ids[-1] == o and "o" not in result.text  # a stop came, and is not shown
    capsys.readouterr()
    assert plain.main(["--model", str(model), "--prompt", "the fox", "--max-new-tokens", "30"]) == 0
    assert capsys.readouterr().out == "the fox" + result.text + "\n"


def test_a_tokenizer_it_cannot_read_is_named(tiny_int8_export, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    text = (model / "tokenizer.json").read_text()
    (model / "tokenizer.json").write_text(text[:len(text) // 2])
    assert plain.main(["--model", str(model), "--prompt", "a", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {model / 'tokenizer.json'}: not a tokenizer the tokenizers library reads (")
    assert err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [
    (["--json", "/proc/version"], "error: /proc/version: cannot be written ("),
    (["--json", "/proc/ids.json"], "error: /proc/ids.json: cannot write in /proc ("),
])
def test_a_json_file_its_folder_cannot_take_is_refused_before_the_run(tiny_int8_export, capsys, monkeypatch, args, message):
    """A tester's finding: /proc/version (0 bytes, like an empty record) passed the check and the write
    failed after the generation."""
    if not Path("/proc/version").exists():
        pytest.skip("no /proc here")
    monkeypatch.setattr(plain, "Model", lambda *a, **k: pytest.fail("the model was loaded before --json was checked"))
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", "a", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize("args, message", [(["--json", ""], "--json: empty"), (["--model", ""], "--model: empty"),
                                           (["--prompt-file", ""], "--prompt-file: empty")])
def test_empty_paths_are_refused_not_read_as_the_current_folder(tiny_int8_export, capsys, args, message):
    text = [] if "--prompt-file" in args else ["--prompt", "a"]
    argv = ["--model", str(tiny_int8_export), *text, *args]
    with pytest.raises(SystemExit) as exit_:
        plain.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_help_shows_the_usage_examples(capsys):
    with pytest.raises(SystemExit):
        plain.main(["--help"])
    out = capsys.readouterr().out
    assert "python tools/plain_onnxruntime.py --model gemma-3-270m-onnx-int8 --prompt" in out and "--mode" in out


def test_a_json_file_name_of_up_to_255_bytes_is_written(tiny_int8_export, tmp_path, capsys):
    """The folder's probe file took the record's name plus 10 characters: names of 246-255 bytes failed."""
    out = tmp_path / ("a" * 250 + ".json")
    assert plain.main(["--model", str(tiny_int8_export), "--prompt", "a", "--max-new-tokens", "2", "--json", str(out)]) == 0
    assert set(json.loads(out.read_text())) == {"prompt", "prompt_ids", "expected_ids", "prefill_chunk"}


def test_a_graph_that_declares_no_cache_shape_still_runs(tiny_int8_export, tmp_path, capsys):
    """The heads / head_dim check read shape[1] of an undeclared shape ([]): "list index out of range"."""
    import onnx

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    graph = onnx.load(str(model / "model.onnx"), load_external_data=False)
    for value in graph.graph.input:
        if value.name.startswith("past_key_values."):
            value.type.tensor_type.ClearField("shape")
    onnx.save(graph, str(model / "model.onnx"))
    _record_graph(model)  # an export written so, not a graph changed after the export (refused: below)
    assert plain.main(["--model", str(model), "--prompt", "a", "--max-new-tokens", "2", "--json", "-"]) == 0
    assert len(json.loads(capsys.readouterr().out)["expected_ids"]) == 2


def _record_graph(folder: Path) -> None:
    """Record ``folder/model.onnx``'s size and sha256 in its manifest, as the export does."""
    import hashlib

    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / "model.onnx").read_bytes()
    manifest["files"]["model.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_graph_changed_after_the_export_is_refused(tiny_int8_export, tiny_dir, tmp_path, capsys):
    """A break-it round: a model.onnx copied in from another export ran, reading its own layout out
    of this folder's data file, and its ids were written as a golden entry. Refused whether its size
    differs or only its bytes, and when the manifest then lost its file listing."""
    other = export(tiny_dir, tmp_path / "other", "int8", calibrate=False, hadamard_size=0).out_dir
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    graph, manifest = model / "model.onnx", model / "manifest.json"
    run = ["--model", str(model), "--prompt", "a", "--max-new-tokens", "2", "--json", "-"]
    graph.write_bytes((other / "model.onnx").read_bytes())
    found, recorded = graph.stat().st_size, (tiny_int8_export / "model.onnx").stat().st_size
    assert found != recorded and plain.main(run) == 2
    assert capsys.readouterr().err == (f"error: {graph}: {found:,} bytes, {manifest} records {recorded:,}; the folder "
                                       "changed after the export (export it again; gemma-export verify checks every "
                                       "file)\n")
    same_size = bytearray((tiny_int8_export / "model.onnx").read_bytes())
    same_size[-1] ^= 0x01
    graph.write_bytes(bytes(same_size))
    assert plain.main(run) == 2
    assert capsys.readouterr().err == (f"error: {graph}: sha256 differs from the one {manifest} records; the folder "
                                       "changed after the export (export it again; gemma-export verify checks every "
                                       "file)\n")
    record = json.loads(manifest.read_text())
    del record["files"]
    manifest.write_text(json.dumps(record))
    assert plain.main(run) == 2
    assert capsys.readouterr().err == (f"error: {manifest}: written by gemma-export but lists no files; the folder "
                                       "changed after the export (export it again)\n")


@pytest.mark.parametrize("case", ["no such folder", "a file"])
def test_a_model_that_is_no_folder_says_an_export_folder_was_expected(tmp_path, capsys, case):
    """It said "/nonexist/manifest.json: No such file or directory" and, for a file, "Not a directory"."""
    model = tmp_path / "m"
    if case == "a file":
        model.write_text("x")
    assert plain.main(["--model", str(model), "--prompt", "a"]) == 2
    assert capsys.readouterr().err == (f"error: {model}: {case}; expected an export folder of gemma-export "
                                       "(model.onnx, tokenizer.json, manifest.json)\n")


def test_json_is_neither_the_prompt_file_nor_inside_an_export(tiny_int8_export, tmp_path, capsys):
    """An empty --prompt-file given as --json too was overwritten with the ids; --json inside the
    export folder added a file its manifest does not list (verify then refused the export)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("")
    assert plain.main(["--model", str(model), "--prompt-file", str(prompt), "--json", str(prompt)]) == 2
    assert capsys.readouterr().err == f"error: {prompt}: is the --prompt-file; write the ids elsewhere\n"
    assert prompt.read_text() == ""
    link = tmp_path / "prompt-link.txt"
    os.link(prompt, link)  # the same file under another name
    assert plain.main(["--model", str(model), "--prompt-file", str(prompt), "--json", str(link)]) == 2
    assert capsys.readouterr().err == f"error: {link}: is the --prompt-file; write the ids elsewhere\n"
    assert prompt.read_text() == ""
    board = tmp_path / "board"
    (board / "model").mkdir(parents=True)
    (board / "BUNDLE.json").write_text(json.dumps({"gemma_export_version": "0.1.0", "files": {}}))
    for out in (model / "out.json", model / "prepacked" / "out.json", board / "golden.json"):
        out.parent.mkdir(exist_ok=True)
        assert plain.main(["--model", str(model), "--prompt", "a", "--json", str(out)]) == 2
        enclosing = board if out.parent == board else model
        assert capsys.readouterr().err == (f"error: {out}: inside {enclosing}, an output of gemma-export whose "
                                           "listing would no longer name every file in it; write the ids elsewhere\n")
        assert not out.exists()


def test_shared_mode_runs_an_export_with_every_positions_logits(tiny_dir, tmp_path, capsys):
    """A tester: --mode shared on an --all-logits export ended in onnxruntime's traceback (the
    prompt's [1, 16, V] logits buffer stayed bound for a decode step's [1, 1, V])."""
    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    folder = export(source, tmp_path / "all", "int8", block_size=16, all_logits=True).out_dir
    runs = []
    for mode in ("shared", "arrays"):
        assert plain.main(["--model", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8", "--mode", mode,
                           "--json", "-"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0] == runs[1] and len(runs[0]["expected_ids"]) == 8
    decoder = OnnxDecoder(folder)
    assert runs[0]["expected_ids"] == decoder.greedy(runs[0]["prompt_ids"], 8, stop_ids=())[0]


def test_its_session_keeps_no_memory_pattern_per_step(tiny_int8_export):
    """docs/integration.md asks applications to turn onnxruntime's memory patterns off (one kept per
    decode step's input shapes); the script that shows the contract does so."""
    model = plain.Model(tiny_int8_export, threads=1)
    assert model.session.get_session_options().enable_mem_pattern is False


def test_a_board_folder_names_the_export_inside_it(tiny_int8_export, tmp_path, capsys):
    """A fresh user gave the bundle's folder: "no manifest.json; not an export folder", where
    `gemma-export generate` names the export inside it."""
    board = tmp_path / "board"
    shutil.copytree(tiny_int8_export, board / "model")
    (board / "BUNDLE.json").write_text(json.dumps({"gemma_export_version": "0.1.0", "files": {}}))
    assert plain.main(["--model", str(board), "--prompt", "a"]) == 2
    assert capsys.readouterr().err == (f"error: {board}: a board folder of gemma-export bundle; its export is "
                                       f"{board / 'model'} (give that)\n")
