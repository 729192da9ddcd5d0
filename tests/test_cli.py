"""The command line: bad input gets one line, exit code 2, and leaves nothing behind."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from conftest import broken_copy, refuse_listing
from gemma_export.cli import app

runner = CliRunner()
#: this process's SIGTERM handling before any test ran: a command run in process must leave it so
SIGTERM_AT_IMPORT = signal.getsignal(signal.SIGTERM)


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _broken_copy(tiny_dir, tmp_path, edit_config=None, edit_tensors=None):
    return broken_copy(tiny_dir, tmp_path / "src", edit_config, edit_tensors)


def _drop(name):
    return lambda t: t.pop(name)


def _reshape(name):
    def edit(t):
        t[name] = np.zeros((t[name].shape[0] + 1, *t[name].shape[1:]), t[name].dtype)
    return edit


def _nan(name):
    def edit(t):
        t[name] = t[name].copy()
        t[name].flat[3] = np.nan
    return edit


CASES = {
    "missing tensor": (None, _drop("model.layers.1.mlp.up_proj.weight"),
                       ["missing tensor 'model.layers.1.mlp.up_proj.weight'"]),
    "wrong shape": (None, _reshape("model.layers.0.self_attn.k_proj.weight"),
                    ["k_proj.weight", "has shape [33, 64]", "expected [32, 64]"]),
    "unknown architecture": (lambda c: c.update(model_type="llama"), None, ["model_type is 'llama'"]),
    "contradicting config": (lambda c: c.update(layer_types=c["layer_types"][:3]), None,
                             ["layer_types has 3 entries but num_hidden_layers is 4"]),
    "vocab vs table rows": (lambda c: c.update(vocab_size=100), None, ["embed_tokens.weight", "expected [100, 64]"]),
    "nan weight": (None, _nan("model.layers.0.mlp.gate_proj.weight"), ["gate_proj.weight", "nan", "index (0, 3)"]),
    "rope_theta string": (lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta="x"), None,
                          ["'rope_theta' must be a positive number, found \"x\""]),
    "rope_parameters list": (lambda c: c.update(rope_parameters=[1, 2]), None, ["'rope_parameters' must be an object"]),
    "huge layer count": (lambda c: (c.update(num_hidden_layers=10**9), c.pop("layer_types")), None,
                         ["'num_hidden_layers' must be an integer in [1, 1024], found 1000000000"]),
    "tie as string": (lambda c: c.update(tie_word_embeddings="no"), None, ["'tie_word_embeddings' must be true or false"]),
    "head_dim zero": (lambda c: c.update(head_dim=0), None, ["'head_dim' must be an integer"]),
    "eos outside vocab": (lambda c: c.update(eos_token_id=10**6), None, ["eos_token_id 1000000 is not below vocab_size 96"]),
    "softcap string": (lambda c: c.update(final_logit_softcapping="30"), None, ["'final_logit_softcapping' must be a positive number"]),
    "integer weight": (None, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.int32)}),
                       ["model.norm.weight", "dtype I32"]),
    "extra layer": (None, lambda t: t.update({"model.layers.7.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"]}),
                    ["unexpected tensor 'model.layers.7.mlp.up_proj.weight'", "4 layers"]),
    "unknown layer tensor": (None, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
                             ["unexpected tensor 'model.layers.0.self_attn.q_proj.bias': not a Gemma 3 decoder layer weight"]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_bad_source_one_line_exit_2_nothing_left(tiny_dir, tmp_path, case, dtype):
    edit_config, edit_tensors, words = CASES[case]
    src = _broken_copy(tiny_dir, tmp_path, edit_config, edit_tensors)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "out"
    result = _run("--format", "onnx", "--dtype", dtype, "--source", src, "--out", out,
                  *(["--block-size", 16] if dtype == "int8" else []))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.output
    for word in words:
        assert word in lines[0]
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # no staging left
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before  # input untouched


def test_output_under_a_file_and_created_parents_removed(tiny_dir, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    result = _run("--source", tiny_dir, "--out", blocker / "sub", "--dtype", "fp32")
    assert result.exit_code == 2 and f"cannot create the export folder: {blocker} is a file" in result.stderr
    src = _broken_copy(tiny_dir, tmp_path, None, _nan("model.layers.0.mlp.up_proj.weight"))
    created = []
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # records the folders the export creates for --out
        real_mkdir(self, *args, **kwargs)
        created.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Path, "mkdir", mkdir)
        result = _run("--source", src, "--out", tmp_path / "new" / "a" / "out", "--dtype", "int8", "--block-size", 16)
    # the NaN is found while tensors are written, after the parents and the staging folder exist
    assert result.exit_code == 2 and "model.layers.0.mlp.up_proj.weight" in result.stderr, result.output
    assert "NaN" in result.stderr or "nan" in result.stderr
    assert any(p == tmp_path / "new" or tmp_path / "new" in p.parents for p in created)
    assert not (tmp_path / "new").exists()


def test_missing_source_path(tmp_path):
    result = _run("--source", tmp_path / "nope", "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "nope: no such file or folder" in result.stderr
    assert "reading" not in result.output  # no progress line for a source that is not there


def test_output_inside_source_is_refused(tiny_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    result = _run("--source", src, "--out", src / "export", "--dtype", "fp32")
    assert result.exit_code == 2 and "inside the source" in result.stderr
    assert not (src / "export").exists()


def test_failed_export_keeps_existing_output(tiny_dir, tmp_path):
    out = tmp_path / "out"
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "fp32").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    src = _broken_copy(tiny_dir, tmp_path, None, _drop("model.norm.weight"))
    result = _run("--source", src, "--out", out, "--dtype", "fp32")
    assert result.exit_code == 2 and "model.norm.weight" in result.stderr, result.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_an_unchanged_export_is_replaced_by_a_new_one(tiny_dir, tmp_path):
    out = tmp_path / "out"
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "fp32").exit_code == 0
    fp32_size = (out / "model.onnx.data").stat().st_size
    result = _run("--source", tiny_dir, "--out", out, "--dtype", "int8", "--block-size", 16)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "int8"
    assert (out / "model.onnx.data").stat().st_size < fp32_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old folder left


def test_exporting_again_into_an_export_says_it_replaces_it(tiny_dir, tmp_path):
    """A second export into the same folder ran in full without a word about the first (a fresh
    user's run): it now says so before the work, and says nothing for an empty or new folder."""
    out = tmp_path / "out"
    first = _run("--source", tiny_dir, "--out", out, "--dtype", "fp32")
    assert first.exit_code == 0 and "holds an earlier export" not in first.stderr
    again = _run("--source", tiny_dir, "--out", out, "--dtype", "fp32")
    assert again.exit_code == 0, again.output
    # once (it was said twice with --out: before the read and again after it)
    told = (f"note: {out} holds an earlier fp32 export; it is replaced once this one is written and checked "
            "(another --out keeps both)")
    assert again.stderr.count(told) == 1
    lines = again.stderr.splitlines()  # and before the (slow) read of the source, where --out is known
    assert lines.index(told) < next(n for n, line in enumerate(lines) if line.startswith("reading "))
    # what is replaced is named from its manifest: options such as --block-size do not change the
    # default folder (a fresh user replaced a calibrated export by an uncalibrated one unawares)
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "int8", "--block-size", "16",
                "--scale-dtype", "float16").exit_code == 0
    replaced = _run("--source", tiny_dir, "--out", out, "--dtype", "int4")
    assert replaced.exit_code == 0, replaced.output
    assert (f"note: {out} holds an earlier int8 export (16 weights per scale in the layers, 64 in the table, Hadamard 64, "
            "float16 scales, codes rounded to nearest); it is replaced once this one is written and checked"
            in replaced.stderr)
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run("--source", tiny_dir, "--out", empty, "--dtype", "fp32")
    assert result.exit_code == 0 and "holds an earlier export" not in result.stderr
    # another model into the same folder: the note names the earlier one's source, from its manifest,
    # once --out is known before the read and again after it (the sources are compared once both are known)
    from conftest import make_tiny_model, save_tiny

    other = save_tiny(make_tiny_model(seed=5, intermediate_size=96), tmp_path / "other-src")
    result = _run("--source", other, "--out", empty, "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    assert (f"note: the export being replaced in {empty} was made from another source ({tiny_dir.resolve()})"
            in result.stderr)
    same = tmp_path / "same-src"  # a copy of a model is the same source under another path: no note
    shutil.copytree(other, same)
    result = _run("--source", same, "--out", empty, "--dtype", "fp32")
    assert result.exit_code == 0 and "another source" not in result.stderr, result.output


@pytest.mark.parametrize("edit", ["flip a byte", "truncate"])
def test_an_export_whose_files_were_edited_is_not_replaced(tiny_dir, tmp_path, edit):
    """"Unchanged" means the listed files still hold the sizes and sha256 the manifest records (a
    byte edited in model.onnx.data was replaced silently: only the file names were compared)."""
    out = tmp_path / "out"
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "fp32").exit_code == 0
    data = bytearray((out / "model.onnx.data").read_bytes())
    if edit == "flip a byte":
        data[10] ^= 0xFF
    else:
        del data[-100:]
    (out / "model.onnx.data").write_bytes(bytes(data))
    result = _run("--source", tiny_dir, "--out", out, "--dtype", "int8", "--block-size", 16)
    assert result.exit_code == 2 and "not an unchanged export of gemma-export" in result.stderr, result.stderr
    assert (out / "model.onnx.data").read_bytes() == bytes(data)


@pytest.mark.parametrize("target", ["empty folder", "missing"])
def test_an_out_that_is_a_symbolic_link_is_refused(tiny_dir, tmp_path, target):
    """The rename that puts the export in place replaced the link with a folder (the link's target
    kept its old content): a link is refused, naming its target."""
    folder = tmp_path / "real"
    if target == "empty folder":
        folder.mkdir()
    link = tmp_path / "link"
    link.symlink_to(folder)
    result = _run("--source", tiny_dir, "--out", link, "--dtype", "fp32")
    assert result.exit_code == 2 and f"{link}: is a symbolic link (to {folder}); give the folder itself" in result.stderr
    assert link.is_symlink() and (not folder.exists() or list(folder.iterdir()) == [])


def test_export_summary_and_manifest(tiny_dir, tmp_path):
    out = tmp_path / "out"
    result = _run("--source", tiny_dir, "--out", out, "--dtype", "int8", "--block-size", 16)
    assert result.exit_code == 0, result.output
    assert "tied table: 1 vocab x hidden initializer(s)" in result.stdout
    assert "peak memory" in result.stdout
    archive = (out / "model.onnx").stat().st_size + (out / "model.onnx.data").stat().st_size
    assert f"archive (model.onnx + model.onnx.data, as `bench` reports it): {archive / 1e6:.1f} MB" in result.stdout
    total = sum(p.stat().st_size for p in out.iterdir())  # the files listed above it, in the archive's unit
    assert f"  total {total:,} bytes ({total / 1e6:,.1f} MB)" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dtype"] == "int8" and manifest["quantization"]["block_size"] == 16
    import hashlib
    for name, entry in manifest["files"].items():
        data = (out / name).read_bytes()
        assert entry["bytes"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert set(manifest["files"]) == {"model.onnx", "model.onnx.data", "genai_config.json"}
    # each source file's own sha256 (what sha256sum prints), and one content digest over them all
    source_files = {"config.json", "generation_config.json", "model.safetensors"}  # the stop ids come from both configs
    assert set(manifest["source"]["file_sha256"]) == source_files
    lines = "".join(f"{name} {digest}\n" for name, digest in manifest["source"]["file_sha256"].items())
    assert manifest["source"]["sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert all(manifest["source"]["file_sha256"][name] == hashlib.sha256((tiny_dir / name).read_bytes()).hexdigest()
               for name in source_files)


@pytest.mark.parametrize("flag, recorded", [
    (["--asymmetric"], {"symmetric": False}),
    (["--table-dtype", "int8"], {"table_dtype": "int8"}),
    (["--scale-method", "rtn"], {"scale_method": "rtn"}),
])
def test_int4_options_reach_the_export(tiny_dir, tmp_path, flag, recorded):
    """Each int4 option given on the command line is the one the export used: the manifest records
    it, and the other two keep their defaults (symmetric, an int4 table, the mse clipping search)."""
    out = tmp_path / "out"
    result = _run("--source", tiny_dir, "--out", out, "--dtype", "int4", "--block-size", 16, "--no-calibrate", *flag)
    assert result.exit_code == 0, result.output
    quantization = json.loads((out / "manifest.json").read_text())["quantization"]
    expected = {"symmetric": True, "table_dtype": "int4", "scale_method": "mse", **recorded}
    assert {key: quantization[key] for key in expected} == expected
    assert quantization["calibration"] is None  # --no-calibrate: the codes are rounded, not GPTQ's
    # asymmetric: one 4-bit zero point per block is stored beside each weight's scales (none otherwise)
    names = {t.name for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer}
    assert ("model.layers.0.self_attn.o_proj.weight_zero_points" in names) == (not expected["symmetric"])


def test_same_input_gives_byte_identical_files(tiny_dir, tmp_path):
    for name in ("a", "b"):
        assert _run("--source", tiny_dir, "--out", tmp_path / name, "--dtype", "int8", "--block-size", 16).exit_code == 0
    for name in ("model.onnx", "model.onnx.data"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_generate_refuses_missing_model(tmp_path):
    result = _run("generate", "--model", tmp_path, "--prompt", "hi")
    assert result.exit_code == 2 and "no exported model here" in result.stderr
    assert f"run `gemma-export --out {tmp_path}` first" in result.stderr  # an empty folder can take an export
    (tmp_path / "notes.txt").write_text("x")
    result = _run("generate", "--model", tmp_path, "--prompt", "hi")
    assert result.exit_code == 2 and "give the folder an export wrote" in result.stderr
    assert "--out " + str(tmp_path) not in result.stderr  # that export would be refused: the folder is not empty
    result = _run("generate", "--model", tmp_path / "typo", "--prompt", "hi")
    assert result.exit_code == 2 and f"{tmp_path / 'typo'}: no such export folder" in result.stderr
    assert "writes it" not in result.stderr  # a name the main command does not write gets no command


def test_missing_default_export_names_its_command(tmp_path, monkeypatch):
    """A missing folder named as the main command names the bundled model's export is told the
    command that writes it (a new user's `generate --model gemma-3-270m-onnx-int4` before that export)."""
    monkeypatch.chdir(tmp_path)
    result = _run("generate", "--model", "gemma-3-270m-onnx-int4", "--prompt", "hi")
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: gemma-3-270m-onnx-int4: no such export folder; "
                                     "`gemma-export --dtype int4` writes it")
    result = _run("generate", "--model", tmp_path / "gemma-3-270m-onnx-int4", "--prompt", "hi")  # here, named whole
    assert result.stderr.strip().endswith("; `gemma-export --dtype int4` writes it")
    elsewhere = tmp_path / "sub dir" / "gemma-3-270m-onnx-bf16"  # quoted, so that the command can be pasted
    result = _run("bench", "--model", elsewhere)
    assert result.exit_code == 2 and f"`gemma-export --dtype bf16 --out '{elsewhere}'` writes it" in result.stderr
    for variant, options in (("int4-table-int8", "--dtype int4 --table-dtype int8"),  # the other default names
                             ("int8-activation-residual-all-logits", "--dtype int8 --activation-residual --all-logits"),
                             ("fp32-debug-outputs", "--dtype fp32 --debug-outputs")):
        result = _run("verify", f"gemma-3-270m-onnx-{variant}")
        assert result.exit_code == 2 and result.stderr.strip().endswith(f"; `gemma-export {options}` writes it")
    for name in ("gemma-3-270m-onnx-int9", "other-onnx-int8",  # no such dtype; another source's name
                 "gemma-3-270m-onnx-int8-table-int8", "gemma-3-270m-onnx-bf16-activation-residual",  # options export refuses
                 "gemma-3-270m-onnx-int8-all-logits-activation-residual"):  # not the order the name is built in
        result = _run("verify", name)
        assert result.exit_code == 2 and "no such export folder" in result.stderr and "writes it" not in result.stderr


def test_a_folder_that_cannot_be_listed_still_gets_the_no_export_error(tmp_path, monkeypatch):
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.runtime import check_export_folder

    refuse_listing(monkeypatch, tmp_path)
    with pytest.raises(SourceNotFoundError, match="no exported model here"):
        check_export_folder(tmp_path)


def test_generate_checks_the_tokenizer_before_creating_the_session(tiny_int8_export, tmp_path, monkeypatch):
    import shutil

    from gemma_export import runtime

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    (model / "tokenizer.json").unlink()

    def no_session(*args, **kwargs):
        raise AssertionError("the session was created before the tokenizer was checked")

    monkeypatch.setattr(runtime, "OnnxDecoder", no_session)
    # the export wrote it (its manifest lists it): a board engineer was told to export again, where
    # the folder had lost the file on the way
    result = _run("generate", "--model", model, "--prompt", "hi")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: {model / 'tokenizer.json'}: missing, though manifest.json lists it (the folder "
                             "lost it, or was copied without it); copy the export again, and check it with "
                             "gemma-export verify\n")
    manifest = json.loads((model / "manifest.json").read_text())
    del manifest["files"]["tokenizer.json"]  # an export of a source without a tokenizer
    (model / "manifest.json").write_text(json.dumps(manifest))
    result = _run("generate", "--model", model, "--prompt", "hi")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: {model / 'tokenizer.json'}: missing; export again with the model's tokenizer "
                             "(--tokenizer TOKENIZER.json), or from a source that carries one\n")


def test_a_prompt_file_is_the_prompt_to_its_last_newline(tiny_int8_export, tmp_path):
    """A board integrator's chat turn: `--prompt "$(cat turn.txt)"` drops the file's trailing
    newline, which ends the turn, and gave one id fewer than the file holds."""
    turn = tmp_path / "turn.txt"
    turn.write_bytes("\ufeffab c\n\n".encode())  # a byte-order mark (dropped) and two trailing newlines
    from_file = _run("generate", "--model", tiny_int8_export, "--prompt-file", turn, "--max-new-tokens", "3",
                     "--json", tmp_path / "file.json")
    given = _run("generate", "--model", tiny_int8_export, "--prompt", "ab c\n\n", "--max-new-tokens", "3",
                 "--json", tmp_path / "given.json")
    assert from_file.exit_code == 0 and given.exit_code == 0, from_file.output + given.output
    golden = json.loads((tmp_path / "file.json").read_text())
    assert golden["prompt"] == "ab c\n\n" and golden == json.loads((tmp_path / "given.json").read_text())
    stripped = _run("generate", "--model", tiny_int8_export, "--prompt", "ab c", "--max-new-tokens", "3", "--json",
                    tmp_path / "stripped.json")
    assert stripped.exit_code == 0
    assert json.loads((tmp_path / "stripped.json").read_text())["prompt_ids"] == golden["prompt_ids"][:-1]  # no "\n\n"
    # '-' reads standard input, as --json - writes standard output (a fresh user's expectation)
    piped = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt-file", "-",
                                "--max-new-tokens", "3", "--json", str(tmp_path / "piped.json")], input="ab c\n\n")
    assert piped.exit_code == 0, piped.output
    assert json.loads((tmp_path / "piped.json").read_text()) == golden
    piped = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt-file", "-"], input=b"ab \xff")
    assert (piped.exit_code, piped.stderr) == (2, "error: standard input: expected UTF-8 text, found byte 0xff at "
                                                  "offset 3\n")
    turn.write_bytes(b"ab \xff")
    result = _run("generate", "--model", tiny_int8_export, "--prompt-file", turn)
    assert (result.exit_code, result.stderr) == (2, f"error: {turn}: expected UTF-8 text, found byte 0xff at offset 3\n")
    result = _run("generate", "--model", tiny_int8_export, "--prompt-file", tmp_path / "nosuch.txt")
    assert (result.exit_code, result.stderr) == (2, f"error: {tmp_path / 'nosuch.txt'}: no such prompt file\n")


def test_a_prompt_file_is_no_json_output_and_a_closed_standard_input_is_no_empty_prompt(tiny_int8_export, tmp_path,
                                                                                           monkeypatch):
    """A tester: `--prompt-file F --json F` replaced the prompt with a golden entry; `--prompt-file -`
    with standard input closed (`<&-`) generated from <bos> alone, exit 0."""
    prompt = tmp_path / "p.json"
    prompt.write_text('{"prompt": "the fox"}')
    result = _run("generate", "--model", tiny_int8_export, "--prompt-file", prompt, "--json", prompt)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --json {prompt}: would overwrite the input {prompt}; write it elsewhere\n"
    assert prompt.read_text() == '{"prompt": "the fox"}'
    monkeypatch.setattr("sys.stdin", None)  # what Python gives a process started with file descriptor 0 closed
    from gemma_export.errors import SourceNotFoundError
    from gemma_export.text_files import read_standard_input

    with pytest.raises(SourceNotFoundError, match=r"^standard input: closed, so there is no prompt to read"):
        read_standard_input("prompt")


def test_onnxruntime_telemetry_is_off_unless_the_user_turned_it_on(tiny_int8_export, tmp_path):
    """onnxruntime 1.29+ on Linux uploads usage telemetry and writes a device id and a 3 MB event
    cache into ~/.cache/Microsoft (found while a helper ran the commands with a read-only HOME:
    onnxruntime warned that it could not write there). The toolkit sets ORT_DISABLE_TELEMETRY=1
    before onnxruntime loads, and keeps the user's own value."""
    code = ("import os, sys\nfrom gemma_export.runtime import OnnxDecoder\n"
            "decoder = OnnxDecoder(sys.argv[1])\nprint(os.environ['ORT_DISABLE_TELEMETRY'])\n")
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    for given, expected in ((None, "1"), ("0", "0")):
        home = tmp_path / f"home-{given}"
        home.mkdir()
        run_env = {**env, "HOME": str(home), **({"ORT_DISABLE_TELEMETRY": given} if given else {})}
        done = subprocess.run([sys.executable, "-c", code, str(tiny_int8_export)], capture_output=True, text=True,
                              env=run_env, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, expected), done.stderr
        if given is None:
            assert not (home / ".cache" / "Microsoft").exists(), sorted(home.rglob("*"))


def test_verify_names_a_missing_folder_and_a_file(tmp_path):
    result = _run("verify", tmp_path / "typo")
    assert result.exit_code == 2 and f"{tmp_path / 'typo'}: no such export folder" in result.stderr
    (tmp_path / "notes.txt").write_text("x")
    result = _run("verify", tmp_path / "notes.txt")
    assert result.exit_code == 2 and "notes.txt: is a file; expected an export folder" in result.stderr


def test_verify_detects_changed_missing_and_extra_files(tiny_dir, tmp_path):
    out = tmp_path / "out"
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "int8", "--block-size", 16).exit_code == 0
    result = _run("verify", out)
    assert result.exit_code == 0 and "matches its manifest" in result.stdout
    assert "its figures (vocabulary, layers, dtype, quantization) match the graph" in result.stdout
    data = out / "model.onnx.data"
    original = data.read_bytes()
    data.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    result = _run("verify", out)
    assert result.exit_code == 2 and "model.onnx.data: sha256 differs" in result.stderr
    data.write_bytes(original)
    (out / "stray.bin").write_bytes(b"x")
    result = _run("verify", out)
    assert result.exit_code == 2 and "files not in the manifest: stray.bin" in result.stderr
    assert "--tokenizer" not in result.stderr
    (out / "stray.bin").unlink()
    (out / "tokenizer.json").write_text("{}")  # a tokenizer copied in by hand: the fix is named
    result = _run("verify", out)
    assert result.exit_code == 2 and ("files not in the manifest: tokenizer.json; a tokenizer belongs in the export "
                                      "through --tokenizer (export again with it)") in result.stderr
    (out / "tokenizer.json").unlink()
    (out / "genai_config.json").unlink()
    result = _run("verify", out)
    assert result.exit_code == 2 and "genai_config.json: listed in the manifest but missing" in result.stderr
    (out / "genai_config.json").mkdir()
    result = _run("verify", out)
    assert result.exit_code == 2 and "genai_config.json: is a folder; the manifest lists it as a file" in result.stderr
    (out / "genai_config.json").rmdir()
    import os
    os.mkfifo(out / "genai_config.json")  # never opened: reading it would block
    result = _run("verify", out)
    assert result.exit_code == 2 and "genai_config.json: not a regular file (a FIFO" in result.stderr


def test_a_listed_name_holding_nul_does_not_end_generate_in_a_traceback(tiny_int8_export, tmp_path):
    """A break-it run: ``generate`` printed its text, then failed in ``resized_files``' stat
    (ValueError: embedded null byte); verify names such a file as missing."""
    import json
    import shutil

    from gemma_export.manifest import resized_files

    folder = tmp_path / "m"
    shutil.copytree(tiny_int8_export, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["a\u0000b"] = {"bytes": 10, "sha256": "0" * 64}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with open(folder / "genai_config.json", "a") as f:
        f.write(" ")
    assert resized_files(folder) == ["genai_config.json"]
    result = _run("generate", "--model", folder, "--prompt", "the", "--max-new-tokens", "2")
    assert result.exit_code == 0 and "note: genai_config.json in " in result.stderr, result.output


def test_python_api_from_readme(tiny_dir, tiny_int8_export, tmp_path):
    # the README's snippet: `from gemma_export import export, generate` gives the functions, and they work
    import importlib

    import gemma_export

    importlib.reload(gemma_export)
    from gemma_export import export, generate

    assert callable(export) and callable(generate)
    from gemma_export import export as again

    assert again is export
    result = export(tiny_dir, tmp_path / "api", "fp32")
    assert result.table_initializers == 1 and (result.out_dir / "model.onnx").is_file()
    # generate(...) wires prompt, greedy ids and tokenizer together (greedy itself is checked against
    # transformers in test_export_tiny.py): the ids of OnnxDecoder.greedy, decoded
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    generated = generate(tiny_int8_export, "ab", max_new_tokens=3)
    tokenizer = load_tokenizer(tiny_int8_export)
    prompt_ids = tokenizer.encode("ab").ids
    expected, _, _ = OnnxDecoder(tiny_int8_export).greedy(prompt_ids, 3)
    assert list(generated.prompt_ids) == prompt_ids and list(generated.new_ids) == list(expected)
    assert len(generated.new_ids) == 3 and generated.text == tokenizer.decode(expected, skip_special_tokens=True)


def test_ctrl_c_in_a_command_that_writes_nothing_says_only_interrupted(tmp_path, monkeypatch):
    import gemma_export.runtime as runtime

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "generate", interrupted)
    result = _run("generate", "--model", tmp_path, "--prompt", "hi")
    assert result.exit_code == 130 and result.stderr.strip() == "error: interrupted"


def test_foreign_output_is_refused_before_the_source_is_read(tiny_dir, tmp_path, monkeypatch):
    import gemma_export.exporter as exporter

    def must_not_run(*args, **kwargs):
        raise AssertionError("the source was opened before --out was checked")

    monkeypatch.setattr(exporter, "open_source", must_not_run)
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    result = _run("--source", tiny_dir, "--out", out, "--dtype", "fp32")
    assert result.exit_code == 2 and "not an unchanged export of gemma-export" in result.stderr
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("args, message", [
    (["--dtype", "int3"], "error: Invalid value for '--dtype': 'int3' is not one of 'fp32', 'bf16', 'int8', 'int4'."),
    (["generate", "--model", "m"], "error: Missing option '--prompt' (or '--prompt-file'). "
                                   "(see 'gemma-export generate --help')"),
    (["generate", "--model", "m", "--prompt", "hi", "--prompt-file", "p.txt"],
     "error: --prompt and --prompt-file: give one of them, not both. (see 'gemma-export generate --help')"),
    # the folder given without --model (a fresh user's slip): the message says how to give it
    (["generate", "m", "--prompt", "hi"], "error: Missing option '--model'. Give the export folder as --model DIR. "
                                          "(see 'gemma-export generate --help')"),
    # 0 and too many in one wording, before the (missing) folder is looked at (fresh-user finding)
    (["generate", "--model", "m", "--prompt", "hi", "--threads", "0"], "error: --threads 0: expected 1 to "),
    (["bench", "--model", "m", "--threads", "-3"], "error: --threads -3: expected 1 to "),
    (["quality", "--model", "m", "--threads", "100000"], "error: --threads 100000: expected 1 to "),
    (["nosuch"], "error: No such command 'nosuch'. (see 'gemma-export --help')"),
    (["inspect", "--top", "-1", "x"], "error: --top -1: expected 0 or more"),  # click's range wording before
    (["--dtype"], "error: Option '--dtype' requires an argument. (see 'gemma-export --help')"),
    # click raises this one without a context: it pointed at the group's help (fresh-user finding)
    (["generate", "--model", "m", "--prompt"], "error: Option '--prompt' requires an argument. "
                                               "(see 'gemma-export generate --help')"),
    (["--scale-dtype", "bfloat16"], "error: Invalid value for '--scale-dtype'"),
])
def test_usage_errors_take_one_line(args, message):
    """Option parsing errors read like every other error: one line on stderr, exit status 2."""
    result = runner.invoke(app, args, prog_name="gemma-export")
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()] and result.stderr.startswith(message)


@pytest.mark.parametrize("out, message", [
    ("/proc/gemma-out", "/proc/gemma-out: cannot create the export folder in /proc"),
    ("{tmp}/a-file/sub", "cannot create the export folder: {tmp}/a-file is a file, not a folder"),
])
def test_an_output_that_cannot_be_created_is_refused_before_the_source_is_read(tiny_dir, tmp_path, monkeypatch, out, message):
    import gemma_export.exporter as exporter

    monkeypatch.setattr(exporter, "open_source", lambda *a, **k: pytest.fail("the source was read first"))
    (tmp_path / "a-file").write_text("x")
    result = _run("--source", tiny_dir, "--out", out.format(tmp=tmp_path), "--dtype", "fp32")
    assert result.exit_code == 2 and message.format(tmp=tmp_path) in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("args, message", [
    (["--dtype", "int8", "--table-dtype", "int8"], "error: --table-dtype applies to --dtype int4, not int8"),
    (["--dtype", "int8", "--asymmetric", "--scale-method", "rtn"],
     "error: --asymmetric and --scale-method apply to --dtype int4, not int8"),
    (["--dtype", "int8", "--scale-method", "mse"], "error: --scale-method applies to --dtype int4, not int8"),
    (["--dtype", "fp32", "--block-size", "64"], "error: --block-size applies to --dtype int8 and int4, not fp32"),
    (["--dtype", "bf16", "--hadamard", "0", "--table-block-size", "64"],
     "error: --table-block-size and --hadamard apply to --dtype int8 and int4, not bf16"),
    (["--dtype", "fp32", "--calibration-tokens", "64"], "--calibration-tokens applies to --dtype int8 and int4"),
    (["--dtype", "bf16", "--activation-residual"], "error: --activation-residual applies to --dtype int8, not bf16"),
    (["--dtype", "int4", "--activation-residual"], "error: --activation-residual applies to --dtype int8, not int4: on Arm"),
    (["--dtype", "int8", "--block-size", "48"], "--block-size 48: must be a power of two >= 16"),
    (["--dtype", "bf16", "--scale-dtype", "float16"], "error: --scale-dtype applies to --dtype int8 and int4, not bf16"),
    (["--dtype", "fp32", "--scale-dtype", "float32"], "error: --scale-dtype applies to --dtype int8 and int4, not fp32"),
])
def test_option_errors_come_before_the_reading_line(tiny_dir, tmp_path, monkeypatch, args, message):
    """Options are checked before the source is announced or read: the error is the only line."""
    import gemma_export.exporter as exporter

    monkeypatch.setattr(exporter, "open_source", lambda *a, **k: pytest.fail("the source was read first"))
    result = _run("--source", tiny_dir, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [f"error: {result.stderr.strip()[7:]}"] and message in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_block_size_the_dims_refuse_is_named_before_calibrating(tiny_dir, tmp_path, monkeypatch):
    """--block-size 1024 is a power of two, but the tiny model's 64-wide inputs refuse it: that is said
    right after the source is read, before the calibration pass (seconds to minutes on real weights)."""
    import gemma_export.exporter as exporter

    monkeypatch.setattr(exporter, "_calibrate", lambda *a, **k: pytest.fail("calibrated before checking the block size"))
    result = _run("--source", tiny_dir, "--out", tmp_path / "out", "--dtype", "int8", "--block-size", "1024",
                  "--calibrate", "--calibration-text", __file__)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"reading {tiny_dir} ..." and len(lines) == 2
    assert lines[1].startswith("error: --block-size 1024: must be a power of two >= 16 dividing each of 64")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, option", [
    (["generate", "--model", "", "--prompt", "hi"], "'--model'"),
    (["quality", "--model", "{model}", "--text", " "], "'--text'"),
    (["quality", "--model", "{model}", "--reference", "fp32", "--json", ""], "'--json'"),
    (["quality", "--model", "{model}", "--reference", ""], "'--reference'"),
    (["bench", "--model", "{model}", "--plot", ""], "'--plot'"),
    (["parity", "--model", "{model}", "--golden", ""], "'--golden'"),
    (["bundle", "--model", "{model}", "--out", ""], "'--out'"),
    (["verify", ""], "'MODEL'"),
    (["inspect", ""], "'PATH'"),
    (["prepack", "--model", ""], "'--model'"),
    (["--dtype", "int8", "--calibration-text", "", "--out", "{tmp}/out"], "'--calibration-text'"),
    (["--dtype", "int8", "--source", "", "--out", "{tmp}/out"], "'--source'"),
    (["--dtype", "int8", "--source", "   ", "--out", "{tmp}/out"], "'--source'"),
    (["--dtype", "int8", "--out", ""], "'--out'"),
])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(tiny_int8_export, tmp_path, monkeypatch, args, option):
    """Path("") is "."; an empty value (a shell variable that was never set) is refused by name before
    anything runs, from any folder."""
    monkeypatch.chdir(tmp_path)
    result = _run(*[a.format(model=tiny_int8_export, tmp=tmp_path) for a in args])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: Invalid value for {option}: empty path"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_progress_without_a_terminal_is_plain_lines(tiny_dir, tmp_path):
    """In a log or CI (stderr not a terminal) tqdm's bars are off; each stage still says where it is,
    at least at its end."""
    result = _run("--source", tiny_dir, "--out", tmp_path / "out", "--dtype", "int8", "--block-size", "16",
                  "--table-block-size", "16")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("writing: ")]
    total = int(lines[-1].split()[1].split("/")[1])
    assert lines[-1].startswith(f"writing: {total}/{total} ") and total > 10, result.stderr
    # the weight is named, not its scales; the seconds since the export started close the line
    assert re.fullmatch(rf"writing: {total}/{total} \S+\.weight \(\d+ s in\)", lines[-1]), lines[-1]


def test_a_tokenizer_that_gives_no_ids_is_blamed_not_the_prompt(tiny_int8_export, tmp_path):
    # without its post-processor the tokenizer adds no <bos>: an empty prompt then has no ids at all
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    assert tokenizer["post_processor"] is not None
    tokenizer["post_processor"] = None
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = _run("generate", "--model", model, "--prompt", "")
    assert result.exit_code == 2
    assert f"error: {model / 'tokenizer.json'}: gives no token ids for the prompt '', not even <bos>" in result.stderr
    assert _run("generate", "--model", model, "--prompt", "the", "--max-new-tokens", 1).exit_code == 0


def test_a_tokenizer_that_does_not_match_the_graph_is_named_not_a_traceback(tiny_int8_export, tmp_path):
    """tokenizer.json gives ids beyond the graph's 96 rows: generate and bench name the folder and
    the id before onnxruntime's Gather fails mid-run (it raised a RuntimeError traceback)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab.update({token: i + 100 for token, i in vocab.items() if i >= 4})  # letters etc. beyond the vocabulary
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    first_id = {"generate": vocab["h"], "bench": None}
    from gemma_export.bench import real_text

    # generate names the prompt; bench the text its prompts come from (all of them checked before timing)
    for args, what in ((["generate", "--model", model, "--prompt", "hello"], "prompt"),
                       (["bench", "--model", model, "--prompt-tokens", "8", "--new-tokens", "8"], real_text(None)[1])):
        result = _run(*args)
        assert result.exit_code == 2, result.stderr
        last = result.stderr.strip().splitlines()[-1]
        assert re.fullmatch(rf"error: {re.escape(str(model))}: {re.escape(str(what))}: token id (\d+)(?: \('\w+'\))? is outside the "
                            r"export's vocabulary \(0 to 95\); the tokenizer beside the export does not match its graph",
                            last), last
        if first_id[args[0]] is not None:  # <bos> (2) is kept; the first letter is the first id out of range (111)
            assert f"token id {first_id[args[0]]} ('h') is" in last


def test_ctrl_c_while_a_library_initialises_is_an_interrupt_not_a_traceback(tiny_int8_export, monkeypatch):
    """onnxruntime turns a KeyboardInterrupt during its first import into "ImportError:
    initialization failed" (a 53-line traceback in 2 of 12 tries at 0.8 s)."""
    import gemma_export.runtime as runtime

    def interrupted_import(*args, **kwargs):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("initialization failed") from exc

    monkeypatch.setattr(runtime, "generate", interrupted_import)
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "a")
    # generate writes nothing, so its message claims nothing about output folders
    assert result.exit_code == 130 and result.stderr.strip() == "error: interrupted", result.output

    def broken_import(*args, **kwargs):
        raise ImportError("no module named x")  # a real import error is not hidden

    monkeypatch.setattr(runtime, "generate", broken_import)
    assert isinstance(_run("generate", "--model", tiny_int8_export, "--prompt", "a").exception, ImportError)


@pytest.mark.parametrize("dtype, rounded", [("fp32", False), ("int8", True)])
def test_the_no_tokenizer_note_speaks_of_rounding_only_for_quantized_exports(tiny_dir, tmp_path, dtype, rounded):
    args = ["--source", str(tiny_dir), "--dtype", dtype, "--out", str(tmp_path / dtype)]
    result = runner.invoke(app, args + (["--block-size", "16"] if dtype == "int8" else []))
    assert result.exit_code == 0, result.output
    assert "note: no tokenizer" in result.stderr
    assert ("rounded to nearest" in result.stderr) is rounded


@pytest.mark.parametrize("args", [
    ["--dtype", "fp32", "inspect", "{model}/model.onnx"],
    ["--out", "{tmp}/x", "generate", "--model", "{model}", "--prompt", "a"],
    ["--format", "onnx", "--debug", "verify", "{model}"],
])
def test_export_options_before_a_subcommand_are_refused(tiny_int8_export, tmp_path, args):
    # `gemma-export --dtype fp32 inspect ...` would run inspect and ignore --dtype without a word
    args = [a.format(model=tiny_int8_export, tmp=tmp_path) for a in args]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    command = next(a for a in args if a in ("inspect", "generate", "verify"))
    given = [a for a in args[:args.index(command)] if a.startswith("--")]
    kind = "is an export option and does" if len(given) == 1 else "are export options and do"
    assert f"error: {', '.join(given)} {kind} nothing before `{command}`" in result.output
    assert not (tmp_path / "x").exists()


def test_outputs_inside_an_export_folder_are_refused(tiny_dir, tiny_int8_export, tmp_path):
    # files the enclosing export's manifest does not list would make `verify` (and bundle) refuse it
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    before = sorted(p.name for p in model.iterdir())
    for args, what in ((["--source", str(tiny_dir), "--dtype", "fp32", "--out", str(model / "sub")], "export"),
                       (["bundle", "--model", str(tiny_int8_export), "--out", str(model / "b")], "bundle"),
                       (["dedupe", str(tiny_int8_export / "model.onnx"), "--out", str(model / "dd")], "deduplicated model")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert f"is inside {model}, an output of gemma-export" in result.output and f"write the {what} elsewhere" in result.output
        assert sorted(p.name for p in model.iterdir()) == before
    for args in (["generate", "--model", str(tiny_int8_export), "--prompt", "a", "--max-new-tokens", "1", "--json", str(model / "g.json")],
                 ["bench", "--model", str(tiny_int8_export), "--prompt-tokens", "4", "--new-tokens", "5", "--json", str(model / "b.json")]):
        result = runner.invoke(app, args)  # a JSON report would also stop the other export from verifying
        assert result.exit_code == 2 and f"would write into {model}, an output of gemma-export" in result.output, result.output
    assert sorted(p.name for p in model.iterdir()) == before
    assert runner.invoke(app, ["verify", str(model)]).exit_code == 0


def test_the_current_folder_cannot_be_the_export_folder(tiny_dir, tiny_int8_export, tmp_path, monkeypatch):
    # renaming the current folder away fails only after the whole export: refused before any work
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    monkeypatch.chdir(model)
    result = runner.invoke(app, ["--source", str(tiny_dir), "--dtype", "fp32", "--out", "."])
    assert result.exit_code == 2 and "is the current folder, which the export cannot replace" in result.output
    (tmp_path / "outer" / "inner").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "outer" / "inner")
    result = runner.invoke(app, ["--source", str(tiny_dir), "--dtype", "fp32", "--out", ".."])
    assert result.exit_code == 2 and "is the current folder or holds it" in result.output


def test_generate_reports_its_timing_without_a_nan(tiny_int8_export):
    # one new token comes from the prefill alone: there is no decode step to take a median of
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "the", "--max-new-tokens", 1)
    assert result.exit_code == 0 and "1 new; prefill" in result.stderr and "no decode step" in result.stderr
    assert "nan" not in result.stderr
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "", "--max-new-tokens", 1)
    assert result.exit_code == 0 and "[1 prompt token, 1 new; prefill" in result.stderr, result.stderr  # <bos> alone
    assert "note: the prompt is empty; the text was generated from <bos> alone" in result.stderr  # fresh user
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "the", "--max-new-tokens", 4)
    assert re.search(r"4 new; prefill \d+ ms, decode median [\d.]+ ms/token; weights packed while loading, "
                     r"no pre-packed copy; peak memory [\d,.]+ MB\]", result.stderr), result.stderr  # which graph ran: this export has no pre-packed copy


def test_an_export_whose_data_file_was_swapped_is_refused_before_running(tiny_int8_export, tiny_dir, tmp_path):
    # onnxruntime runs another export's (larger) data file without a word and prints garbage text;
    # the manifest records every file's size, so the runtime compares them first
    from gemma_export.exporter import export

    fp32 = export(tiny_dir, tmp_path / "fp32", "fp32").out_dir
    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    recorded = json.loads((model / "manifest.json").read_text())["files"]["model.onnx.data"]["bytes"]
    shutil.copyfile(fp32 / "model.onnx.data", model / "model.onnx.data")
    found = (model / "model.onnx.data").stat().st_size
    assert found != recorded
    for command in (["generate", "--model", model, "--prompt", "ab"], ["bench", "--model", model, "--prompt-tokens", "4",
                                                                       "--new-tokens", "8"]):
        result = _run(*command)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip() == (
            f"error: {model / 'model.onnx.data'}: {found:,} bytes, but {model / 'manifest.json'} records {recorded:,}: the "
            "folder changed after the export (export it again; gemma-export verify checks every file)")


def test_an_input_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch):
    # an I/O error from the kernel, not from us: reading /proc/self/mem at offset 0 fails with EIO
    result = _run("inspect", "/proc/self/mem")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == "error: /proc/self/mem: cannot be read (Input/output error)"
    # a file the user may not read (root reads any file, so the refusal is simulated where it happens)
    from gemma_export import runtime

    def refuse(path):
        raise PermissionError(13, "Permission denied", str(tmp_path / "model" / "tokenizer.json"))

    monkeypatch.setattr(runtime, "check_export_folder", refuse)
    result = _run("generate", "--model", tmp_path / "model", "--prompt", "a")
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {tmp_path / 'model' / 'tokenizer.json'}: Permission denied (check the "
                                     "file's permissions)")


def test_a_path_that_is_not_utf8_is_refused_by_name(tiny_dir, tiny_int8_export, tmp_path):
    import os

    bad = Path(os.fsdecode(bytes(tmp_path) + b"/bad\xffname"))
    result = _run("--source", tiny_dir, "--dtype", "fp32", "--out", bad)
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: {tmp_path}/bad\\xffname: the export folder path is not valid UTF-8, which "
                                     "onnx and onnxruntime need; rename it")
    assert os.listdir(tmp_path) == []
    shutil.copytree(tiny_int8_export, bad)
    for command in (["generate", "--model", bad, "--prompt", "ab"], ["verify", bad], ["prepack", "--model", bad],
                    ["bundle", "--model", bad, "--out", tmp_path / "board"]):
        result = _run(*command)
        assert result.exit_code == 2, (command, result.output)
        assert result.stderr.strip().splitlines() == [
            f"error: {tmp_path}/bad\\xffname: the export folder path is not valid UTF-8, which onnx and onnxruntime need; "
            "rename it"], command


def test_an_export_given_as_the_source_is_named_as_such(tiny_int8_export, tmp_path):
    result = _run("--source", tiny_int8_export, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (f"error: {tiny_int8_export}: an ONNX export (model.onnx, no config.json), not a "
                                     "source; give the transformers folder, .gguf or .mlir it was made from")
    assert list(tmp_path.iterdir()) == []


def test_a_bundle_given_as_the_source_is_named_as_such(tmp_path):
    """A fresh user's finding: a bundle folder read "config.json: missing; a transformers model folder
    needs its config.json", as if it were a damaged source."""
    bundle = tmp_path / "sl2610-int8"
    (bundle / "model").mkdir(parents=True)
    (bundle / "BUNDLE.json").write_text("{}")
    result = _run("--source", bundle, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == (f"error: {bundle}: a board bundle (BUNDLE.json), not a source; "
                                                      "give the transformers folder, .gguf or .mlir its export was made from")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sl2610-int8"]


def test_generate_json_names_the_file_it_wrote_and_bench_gives_one_memory_line_per_distinct_figure(tiny_int8_export, tmp_path):
    golden = tmp_path / "golden.json"
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "ab", "--max-new-tokens", "3", "--json", golden)
    assert result.exit_code == 0, result.output
    assert f"wrote {golden} (a golden file: gemma-export parity --model {tiny_int8_export} --golden {golden})" in result.stderr
    assert len(json.loads(golden.read_text())["expected_ids"]) == 3
    one = _run("bench", "--model", tiny_int8_export, "--prompt-tokens", "4", "--new-tokens", "5")
    two = _run("bench", "--model", tiny_int8_export, "--prompt-tokens", "4,8", "--new-tokens", "5")
    assert one.exit_code == two.exit_code == 0, one.output + two.output
    assert "after all prompts" not in one.stdout and "after the 4-token prompt and its 5 decode steps" in one.stdout
    assert "after all prompts and their steps" in two.stdout
    assert "; only 1 timed step per prompt (--new-tokens 20 or more for steadier figures)" in one.stdout
    many = _run("bench", "--model", tiny_int8_export, "--prompt-tokens", "4", "--new-tokens", "20")
    assert many.exit_code == 0 and "timed step" not in many.stdout  # 16 timed steps: no note


def test_bare_command_shows_the_usage_and_exports_nothing(tmp_path, monkeypatch):
    from gemma_export import exporter

    def no_export(*args, **kwargs):
        raise AssertionError("a bare gemma-export started an export")

    monkeypatch.setattr(exporter, "export", no_export)  # should the usage ever be lost, no real export runs
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, [])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Usage: ") and "gemma-export --format onnx --dtype int8" in result.stdout
    assert "[OPTIONS] [COMMAND] [ARGS]..." in result.stdout.splitlines()[0]  # the command is optional: export
    assert "error" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no export started


@pytest.mark.parametrize("command", [[], ["generate"], ["parity"], ["quality"], ["bench"], ["inspect"],
                                     ["verify"], ["bundle"], ["prepack"], ["dedupe"]])
def test_help_fits_an_80_column_terminal(command):
    # examples sit in click's no-rewrap blocks, so only their own length keeps them on one screen line
    result = runner.invoke(app, [*command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "gemma-export" in result.output
    long_lines = [line for line in result.output.splitlines() if len(line) > 80]
    assert long_lines == []


@pytest.mark.parametrize("damage, message", [
    # a graph input renamed in bytes that are not UTF-8 (every use alike, so the graph holds
    # together): onnxruntime loads it, and decoding the input's name fails
    ("graph input", "a graph input or output name is not UTF-8 text (byte b'\\xb8' at 0 of b'\\xb8nput_ids')"),
    # one node reads a name nobody writes, in bytes that are not UTF-8: onnxruntime's error quotes
    # them, its Python wrapper cannot decode its own message, prints an "EP Error ... Falling back"
    # banner to stdout and retries
    ("node input", "is not a graph input, initializer, or output of a previous node"),
])
def test_a_graph_onnxruntime_refuses_gives_one_line_and_nothing_on_stdout(tiny_int8_export, tmp_path, damage, message):
    import onnx

    model = tmp_path / "m"
    shutil.copytree(tiny_int8_export, model)
    data = (model / "model.onnx").read_bytes()
    if damage == "graph input":
        assert b"input_ids" in data
        data = data.replace(b"input_ids", b"\xb8nput_ids")
    else:  # the last use of a name one node writes and the next reads: a later node's input
        graph = onnx.load(model / "model.onnx", load_external_data=False).graph
        name = next(o for node in graph.node for o in node.output
                    if len(o) > 3 and data.count(o.encode()) == 2).encode()
        at = data.rindex(name)
        data = data[:at] + b"\xb8" + data[at + 1:]
    (model / "model.onnx").write_bytes(data)
    result = runner.invoke(app, ["generate", "--model", str(model), "--prompt", "hi"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "onnxruntime cannot load the model" in result.stderr and message in result.stderr


def test_an_older_onnxruntime_is_refused_by_name_before_it_loads_an_export(tiny_int8_export, monkeypatch):
    # 1.21 refuses the graph with "GroupQueryAttention ... has input size 11 not in range [min=7,
    # max=9]", and 1.22 on aarch64 runs an int8 export until its first step ("Only 4b quantization
    # is supported for unpacked compute"): neither says that a newer runtime is what is missing
    import onnxruntime

    from gemma_export import runtime

    for version in ("1.22.1", "1.9.0"):
        monkeypatch.setattr(onnxruntime, "__version__", version)
        result = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "hi"])
        assert result.exit_code == 2 and result.stdout == ""
        assert result.stderr.strip() == (
            f"error: onnxruntime {version} is installed, and this toolkit's exports need 1.23 or newer (older ones "
            "refuse their GroupQueryAttention, or cannot run 8-bit MatMulNBits on aarch64); install a newer one: "
            "pip install 'onnxruntime>=1.23'"), result.stderr
    for version in ("1.23.0", "1.32.0", "2.0.0", "1.24.0.dev20260101", "dev"):
        runtime.check_onnxruntime_version(version)
    monkeypatch.undo()
    result = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "hi", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.stderr


def test_the_pinned_onnxruntime_is_the_oldest_the_runtime_accepts():
    import tomllib

    from gemma_export.runtime import MIN_ONNXRUNTIME

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if d.split(">=")[0].strip() == "onnxruntime"]
    assert pins == [f"onnxruntime>={'.'.join(map(str, MIN_ONNXRUNTIME))}"]


def test_a_long_error_line_keeps_its_start_and_its_reason(tmp_path):
    # an --out path of 5,000 characters: the line is cut in the middle, not at the end, where the
    # reason ("File name too long") is
    from gemma_export.cli import MAX_ERROR_CHARS

    out = tmp_path.joinpath(*["c" * 200] * 25)
    result = runner.invoke(app, ["--source", str(tmp_path / "nowhere"), "--out", str(out)])
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {str(out)[:100]}")
    assert "characters left out) ..." in line and len(line) < MAX_ERROR_CHARS + 100
    assert line.endswith(f": File name too long (a path of {len(os.fsencode(str(out))):,} bytes)"), line


@pytest.mark.parametrize("command", [["prepack", "--model"], ["verify", "--model"], ["inspect"],
                                     ["--format", "onnx", "--out", "{out}", "--source"]])
def test_an_input_name_longer_than_the_file_system_takes_is_named_with_the_limit(tmp_path, command):
    # review of the twelfth session's notes: the OS's bare "File name too long" named no limit for an
    # input (the outputs' own check covers only outputs)
    from gemma_export.staging import max_name_bytes

    limit = max_name_bytes(tmp_path)
    source = tmp_path / ("m" * (limit + 1))
    result = runner.invoke(app, [*(str(tmp_path / "out") if a == "{out}" else a for a in command), str(source)])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert f": File name too long (a name of {limit + 1} bytes in it; this file system takes at most {limit})" \
        in result.stderr, result.stderr
    assert sorted(tmp_path.iterdir()) == []  # no output begun


def test_control_characters_in_an_error_line_are_shown_escaped(capsys):
    # e.g. a NUL in an external-data location read from a damaged .onnx: printed raw, it cut the
    # line short in a terminal; an escape sequence would drive the terminal
    import typer

    from gemma_export.cli import _fail
    from gemma_export.errors import FormatError

    with pytest.raises(typer.Exit) as caught:
        _fail(FormatError("m.onnx: location 'model.onnx.data\x00x\x1b[2J' é"), debug=False)
    assert caught.value.exit_code == 2
    assert capsys.readouterr().err == "error: m.onnx: location 'model.onnx.data\\x00x\\x1b[2J' é\n"


def test_calibration_tokens_bounds_are_inclusive():
    from gemma_export.calibration import MAX_CALIBRATION_TOKENS, MIN_CALIBRATION_TOKENS
    from gemma_export.errors import ConfigError
    from gemma_export.exporter import _check_options

    def check(tokens):
        _check_options("int8", None, None, None, None, True, None, None, None, tokens)

    check(MIN_CALIBRATION_TOKENS)
    check(MAX_CALIBRATION_TOKENS)
    for tokens in (MIN_CALIBRATION_TOKENS - 1, MAX_CALIBRATION_TOKENS + 1):
        with pytest.raises(ConfigError, match=f"--calibration-tokens {tokens}: expected"):
            check(tokens)


def test_version_names_the_toolkit_and_its_onnx_libraries():
    from importlib.metadata import version

    import gemma_export

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == (f"gemma-export {gemma_export.__version__} (onnx {version('onnx')}, "
                             f"onnxruntime {version('onnxruntime')})\n")


def _tokenizer_folder(path: Path, vocab_size: int = 96) -> Path:
    from conftest import write_char_tokenizer

    path.mkdir()
    return write_char_tokenizer(path, vocab_size)


def test_a_tokenizer_given_replaces_the_sources_and_is_checked_against_the_vocabulary(tiny_dir, tmp_path):
    # tiny_dir has no tokenizer: --tokenizer (a folder) brings one, and the int8 codes are calibrated with it
    tok = _tokenizer_folder(tmp_path / "tok")
    result = _run("--source", tiny_dir, "--tokenizer", tok, "--dtype", "int8", "--block-size", "16",
                  "--table-block-size", "16", "--calibration-tokens", "32", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert "calibration: GPTQ on" in result.stdout and "note: no tokenizer" not in result.stderr
    assert f"tokenizer: from {tok / 'tokenizer.json'} (--tokenizer)" in result.stdout
    # a tokenizer whose ids pass the model's 96 rows is refused before anything is written
    (tmp_path / "big").mkdir()
    big = tmp_path / "big" / "tokenizer.json"
    data = json.loads((tok / "tokenizer.json").read_text())
    data["model"]["vocab"]["zz"] = 500
    big.write_text(json.dumps(data))
    result = _run("--source", tiny_dir, "--tokenizer", big, "--dtype", "fp32", "--out", tmp_path / "out2")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert str(big) in line and "500" in line and "96" in line, line
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize("make, message", [
    (lambda t: t / "missing", "{path}: no such file or folder (--tokenizer)"),
    (lambda t: (t / "empty").mkdir() or t / "empty", "{path}: holds no tokenizer.json (--tokenizer)"),
    (lambda t: (t / "vocab.json").write_text("{}") and t / "vocab.json",
     "{path}: expected a file named tokenizer.json (its side files are read beside it) or a folder holding one, "
     "found 'vocab.json' (--tokenizer)"),
])
def test_a_tokenizer_path_that_is_not_one_is_named_before_the_source_is_read(tiny_dir, tmp_path, make, message):
    path = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = _run("--source", tiny_dir, "--tokenizer", path, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: " + message.format(path=path), result.stderr
    assert "reading" not in result.stderr  # refused before the source was opened
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_int4_with_an_int8_table_has_its_own_default_folder(tiny_dir, tmp_path, monkeypatch):
    from gemma_export.exporter import export

    monkeypatch.chdir(tmp_path)
    plain = export(tiny_dir, None, "int4", block_size=16, table_block_size=16)
    mixed = export(tiny_dir, None, "int4", block_size=16, table_block_size=16, table_dtype="int8")
    assert plain.out_dir.name == f"{tiny_dir.name}-onnx-int4"
    assert mixed.out_dir.name == plain.out_dir.name + "-table-int8"
    assert (plain.out_dir / "manifest.json").is_file() and (mixed.out_dir / "manifest.json").is_file()


def test_generate_reports_the_median_decode_step_after_the_first(tiny_int8_export, monkeypatch):
    # the first decode step gives the prompt's memory back (slower); the median of the others is
    # reported: 11.0 for [50, 10, 12, 11], where the upper middle of all four would say 12.0
    from gemma_export import runtime

    def fake(model, prompt, **kwargs):
        return runtime.GenerationResult(prompt_ids=[2, 5], new_ids=[7, 8, 9, 10, 11], text="abcde", prefill_ms=3.0,
                                        decode_ms=[50.0, 10.0, 12.0, 11.0], dtype="int8")

    monkeypatch.setattr(runtime, "generate", fake)
    monkeypatch.setattr("gemma_export.memory.peak_rss_bytes", lambda: 689_400_000)  # the process's VmHWM
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "x")
    assert result.exit_code == 0, result.output
    assert ("[2 prompt tokens, 5 new; prefill 3 ms, decode median 11.0 ms/token; weights packed while loading, no "
            "pre-packed copy; peak memory 689.4 MB]\n") in result.stderr, result.stderr


@pytest.mark.parametrize("cpus, noted", [(1.37, True), (0.2, True), (0.19, False), (None, False)])
def test_generate_notes_other_work_while_it_ran_as_bench_does(tiny_int8_export, monkeypatch, cpus, noted):
    """A fresh user: generate said 6.2 ms/token, then 25-36 ms/token beside other work, without a
    word; bench said the machine was busy."""
    from gemma_export import bench

    class Busy:  # what OtherWork measured around the prompt and steps
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.cpus = cpus

    monkeypatch.setattr(bench, "OtherWork", Busy)
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "x", "--max-new-tokens", "3")
    assert result.exit_code == 0, result.output
    note = (f"note: other processes used {cpus or 0:.2f} of the machine's {os.cpu_count() or 1} CPUs while the prompt "
            "and steps ran: these times are not this model's alone (gemma-export bench measures them)")
    assert (note in result.stderr) is noted, result.stderr


def test_generate_measures_other_work_around_its_steps(tiny_int8_export, monkeypatch):
    from gemma_export import bench, generate

    # a few milliseconds of steps: no figure (one 10 ms tick read as 5.92 of 2 CPUs for a tester)
    assert generate(tiny_int8_export, "the fox", max_new_tokens=3).other_cpus is None
    monkeypatch.setattr(bench, "OTHER_CPUS_MIN_SECONDS", 0.0)
    result = generate(tiny_int8_export, "the fox", max_new_tokens=3)
    assert isinstance(result.other_cpus, float) and 0.0 <= result.other_cpus <= (os.cpu_count() or 1)  # Linux


def test_a_tokenizer_of_another_model_is_refused_and_added_tokens_beyond_the_table_are_named(tiny_dir, tmp_path):
    tok = _tokenizer_folder(tmp_path / "tok")
    data = json.loads((tok / "tokenizer.json").read_text())
    # another model's <bos>: the post-processor puts id 5 before every prompt; the model's bos_token_id is 2
    other = tmp_path / "other"
    other.mkdir()
    swapped = json.loads(json.dumps(data))
    swapped["post_processor"]["special_tokens"]["<bos>"]["ids"] = [5]
    (other / "tokenizer.json").write_text(json.dumps(swapped))
    result = _run("--source", tiny_dir, "--tokenizer", other, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().endswith(f"error: {other / 'tokenizer.json'}: turns the prompt 'a' into ids [5, 4]; "
                                          "expected the model's <bos> (bos_token_id 2) and then [4], as Gemma's own "
                                          "tokenizer does (--tokenizer)")
    assert not (tmp_path / "out").exists()
    # no <bos> at all (no post-processor), or <bos> after the text: refused the same way
    for name, post in (("none", None), ("after", {"type": "TemplateProcessing", "single": [
            {"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "<bos>", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": data["post_processor"]["special_tokens"]})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({**data, "post_processor": post}))
        result = _run("--source", tiny_dir, "--tokenizer", folder, "--dtype", "fp32", "--out", tmp_path / "out")
        assert result.exit_code == 2, result.output
        assert f"turns the prompt 'a' into ids {[4] if post is None else [4, 2]}; expected the model's <bos>" in result.stderr
        assert not (tmp_path / "out").exists()
    # an added token beyond the model's 96 rows: exported, with a note; the manifest names the tokenizer's folder
    extra = tmp_path / "extra"
    extra.mkdir()
    vocab = data["model"]["vocab"]
    vocab.update({f"<unused{i}>": i for i in range(len(vocab), 96)})  # the pieces fill the 96 rows
    data["added_tokens"].append({"id": 96, "content": "<tool>", "single_word": False, "lstrip": False,
                                 "rstrip": False, "normalized": False, "special": True})
    (extra / "tokenizer.json").write_text(json.dumps(data))
    result = _run("--source", tiny_dir, "--tokenizer", extra, "--dtype", "int8", "--no-calibrate", "--block-size", "16",
                  "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (f"note: 1 added token(s) of {extra / 'tokenizer.json'} lie beyond the model's 96 rows ('<tool>' = 96); "
            "a prompt that uses one is refused") in result.stderr
    assert "calibration: none; codes rounded to nearest" in result.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["source"]["tokenizer"] == str(extra.resolve())
    # as the note said: a prompt that uses it is refused, naming the piece
    result = _run("generate", "--model", tmp_path / "out", "--prompt", "ab<tool>")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {tmp_path / 'out'}: prompt: token id 96 ('<tool>') is outside the "
                                     "export's vocabulary (0 to 95); the tokenizer beside the export does not match its "
                                     "graph"), result.stderr


def test_a_damaged_tokenizer_named_by_its_folder_is_refused_before_the_source_is_read(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").symlink_to(tmp_path / "nowhere.json")
    result = _run("--source", tiny_dir, "--tokenizer", broken, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {broken / 'tokenizer.json'}: is a broken link (to {tmp_path / 'nowhere.json'}); "
                                     "expected the tokenizer file (--tokenizer)")
    side = _tokenizer_folder(tmp_path / "side")
    (side / "tokenizer_config.json").write_text("[1, 2]")
    result = _run("--source", tiny_dir, "--tokenizer", side, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "reading" not in result.stderr, result.output
    assert result.stderr.strip().startswith(f"error: {side / 'tokenizer_config.json'}:") and \
        result.stderr.strip().endswith("(--tokenizer)"), result.stderr
    assert not (tmp_path / "out").exists()


def test_the_sources_own_damaged_tokenizer_does_not_stop_an_export_given_another(tiny_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    (src / "tokenizer.json").write_text("{not json")
    result = _run("--source", src, "--dtype", "fp32", "--out", tmp_path / "plain")
    assert result.exit_code == 2 and "tokenizer.json" in result.stderr  # alone, it is refused
    tok = _tokenizer_folder(tmp_path / "tok")
    result = _run("--source", src, "--tokenizer", tok, "--dtype", "fp32", "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()


def test_calibrating_a_source_without_a_tokenizer_suggests_giving_one(tiny_dir, tmp_path):
    result = _run("--source", tiny_dir, "--dtype", "int8", "--calibrate", "--block-size", "16", "--out", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert "needs a tokenizer (calibration tokenizes a text) and this source has none; give the model's own with " \
           "--tokenizer TOKENIZER.json, or export without --calibrate" in result.stderr


def test_quality_of_an_export_given_a_tokenizer_does_not_read_the_sources_own(tiny_dir, text_file, tmp_path):
    # the source's tokenizer.json is damaged, which is why --tokenizer was given: the export and the
    # transformers reference of quality both leave it unread
    src = tmp_path / "src"
    shutil.copytree(tiny_dir, src)
    (src / "tokenizer.json").write_text("{not json")
    tok = _tokenizer_folder(tmp_path / "tok")
    assert _run("--source", src, "--tokenizer", tok, "--dtype", "int8", "--block-size", "16", "--no-calibrate",
                "--out", tmp_path / "out").exit_code == 0
    result = _run("quality", "--model", tmp_path / "out", "--reference", "transformers", "--text", text_file,
                  "--tokens", "40")
    assert result.exit_code == 0, result.output
    assert "top-1" in result.output and "tokenizer.json" not in result.stderr
    assert re.search(r"\nelapsed [\d.]+ s, peak memory [\d,.]+ MB\n$", result.stderr), result.stderr



def test_the_export_help_names_the_defaults_the_code_uses():
    """The help texts spell their defaults out (importing the quantizers to format them would cost
    `gemma-export --help` most of a second), so each is checked against the constant it names."""
    from typer.main import get_command

    from gemma_export import calibration, weights

    helps = {param.opts[0]: param.help for param in get_command(app).params}
    assert weights.DEFAULT_INT8_BLOCK_SIZE == weights.DEFAULT_INT4_BLOCK_SIZE  # one default for both dtypes
    assert f"default {weights.DEFAULT_INT8_BLOCK_SIZE})" in helps["--block-size"]
    assert (f"default {weights.DEFAULT_TABLE_BLOCK_SIZE[8]} for an int8 table, {weights.DEFAULT_TABLE_BLOCK_SIZE[4]} "
            "for int4;") in helps["--table-block-size"]
    assert f"(default {weights.DEFAULT_HADAMARD_SIZE}; 0 = off)" in helps["--hadamard"]
    assert (f"(default {calibration.DEFAULT_CALIBRATION_TOKENS:,}; {calibration.MIN_CALIBRATION_TOKENS} to "
            f"{calibration.MAX_CALIBRATION_TOKENS:,};") in helps["--calibration-tokens"]


def test_the_python_api_names_every_command_result_and_error_at_the_top_level(tiny_int8_export):
    import importlib
    import subprocess
    import sys

    import gemma_export

    for name in gemma_export.__all__:
        assert getattr(gemma_export, name) is not None, name
    assert set(gemma_export.__all__) <= set(dir(gemma_export))  # help() and completion see them
    assert gemma_export.write_bundle is importlib.import_module("gemma_export.bundle").write_bundle
    assert issubclass(gemma_export.ConfigError, gemma_export.GemmaExportError)
    # a submodule keeps its name: no public function shadows one (or stands for one, depending on import order)
    from gemma_export import bundle, inspect, parity
    assert all(type(m).__name__ == "module" for m in (bundle, inspect, parity))
    assert gemma_export.inspect_path(tiny_int8_export).duplicates == []  # the docstring's example: one table
    with pytest.raises(AttributeError, match="module 'gemma_export' has no attribute 'exportt'"):
        gemma_export.exportt
    # importing the package loads none of the heavy modules (--help stays fast)
    code = "import sys, gemma_export; print(sorted(m for m in ('numpy', 'onnx', 'onnxruntime') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"
    # nor does the command line: ml_dtypes, which the quantizers and onnx load (0.7 s to import in
    # ml_dtypes 0.7, which pyproject.toml excludes for it)
    code = ("import sys, gemma_export.cli, quant; print(sorted(m for m in ('ml_dtypes', 'onnx', 'onnxruntime', "
            "'quant.int4', 'quant.int8', 'quant.bf16', 'quant.gptq') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_sigterm_while_the_export_command_imports_is_an_interrupt_with_its_status(tiny_dir, tmp_path, monkeypatch):
    """The export's imports take up to a second before its body runs: a SIGTERM there exited 130
    with nothing on stderr (143 and the interrupt's line expected)."""
    import sys
    import types

    from gemma_export.console import Terminated

    class Stopping(types.ModuleType):
        def __getattr__(self, name):
            raise Terminated  # what the SIGTERM handler raises, here inside `from tqdm import tqdm`

    monkeypatch.setitem(sys.modules, "tqdm", Stopping("tqdm"))
    result = _run("--source", tiny_dir, "--out", tmp_path / "out", "--dtype", "fp32")
    assert result.exit_code == 143
    assert result.stderr.strip() == "error: interrupted; nothing was written (an existing output is unchanged)"
    assert not (tmp_path / "out").exists()


def test_a_reference_export_given_the_wrong_way_names_the_file_to_give(tmp_path):
    """From a board-team walkthrough: the folder holding the .mlir was read as a transformers folder
    ("config.json: missing"), its archive as an unknown file (first bytes ...), and the archive as
    --reference as MLIR text with no util.global."""
    from safetensors.numpy import save_file

    from gemma_export.errors import FormatError
    from gemma_export.sources.mlir import parse_mlir

    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "gemma.mlir").write_text("module {}\n")
    save_file({"t0": np.zeros(4, np.float32)}, str(ref / "gemma.safetensors"))
    result = _run("--source", ref, "--out", tmp_path / "out")
    assert result.exit_code == 2 and (f"{ref}: a folder without config.json, so no transformers model; it holds "
                                      "gemma.mlir: give that file as the source") in result.stderr, result.output
    result = _run("--source", ref / "gemma.safetensors", "--out", tmp_path / "out")
    assert result.exit_code == 2 and (f"{ref / 'gemma.safetensors'}: a .safetensors file, which is no source on its own; give the reference export's "
                                      ".mlir beside it (gemma.mlir), which reads it") in result.stderr, result.output
    (ref / "gemma.mlir").unlink()
    result = _run("--source", ref / "gemma.safetensors", "--out", tmp_path / "out")
    assert result.exit_code == 2 and "give the transformers folder holding it (with its config.json)" in result.stderr
    assert not (tmp_path / "out").exists()
    (ref / "other.mlir").write_text("module {}\n")
    (ref / "gemma.mlir").write_text("module {}\n")
    result = _run("--source", ref, "--out", tmp_path / "out")  # several: which one is the user's to say
    assert result.exit_code == 2 and "it holds gemma.mlir, other.mlir: give one of them as the source" in result.stderr
    # MLIR text whose ninth byte is "{" (a blank line, then `module {`) is no safetensors archive
    (ref / "gemma.mlir").write_text("\nmodule {\n}\n")
    with pytest.raises(FormatError, match="no util.global bound to a #flow.parameter.named parameter"):
        parse_mlir(ref / "gemma.mlir")
    from gemma_export.inspect import inspect_path
    with pytest.raises(FormatError, match="no util.global bound"):  # read as MLIR, not as a safetensors header
        inspect_path(ref / "gemma.mlir")
    renamed = ref / "archive.bin"  # recognised by its header, whatever its name
    (ref / "gemma.safetensors").rename(renamed)
    with pytest.raises(FormatError, match=r"archive\.bin: a safetensors archive, not reference MLIR text; give the "
                                          r"export's \.mlir file \(its archive is read from beside it\)$"):
        parse_mlir(renamed)


def test_the_cli_choices_are_the_formats_own_tables():
    """--dtype, --table-dtype and --scale-method list what config, weights and quant.int4 implement
    (two of them were enums of their own, a third copy of the names beside exporter's checks)."""
    from gemma_export import cli
    from gemma_export.config import DTYPES, TABLE_DTYPES
    from gemma_export.weights import WEIGHT_FORMATS
    from quant.scales import SCALE_METHODS

    assert tuple(m.value for m in cli.DType) == DTYPES == tuple(WEIGHT_FORMATS)
    assert tuple(m.value for m in cli.TableDType) == TABLE_DTYPES
    assert tuple(m.value for m in cli.ScaleMethod) == SCALE_METHODS == ("mse", "rtn")


def test_the_export_total_is_in_decimal_megabytes(capsys):
    """The total line said MiB beside the archive's MB, and the peak memory MiB beside `bench`'s MB;
    a tiny export cannot tell the two apart (both round to 0.3), so a real export's sizes are given here."""
    from gemma_export.cli import _export_summary
    from gemma_export.exporter import ExportResult

    files = {"model.onnx": 183_711, "model.onnx.data": 286_299_136, "tokenizer.json": 14_379_875,
             "genai_config.json": 1_290, "tokenizer_config.json": 188, "manifest.json": 3_064}
    result = ExportResult(Path("gemma-3-270m-onnx-int8"), files, "int8", True, 1, 38.2, 1_348_173_824, None, None)
    _export_summary(result, 183_711 + 286_299_136)
    out = capsys.readouterr().out
    assert "  total 300,867,264 bytes (300.9 MB)" in out  # 286.9 in MiB
    assert "archive (model.onnx + model.onnx.data, as `bench` reports it): 286.5 MB" in out
    assert "peak memory 1,348.2 MB" in out and "MiB" not in out  # 1,285.7 in MiB


# --- the installed entry point (gemma_export.console): outside any one command ---------------------

def _tree_digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def _command(*args: str, stdout=None, code: str = "", shell: str = 'exec "$@"') -> subprocess.CompletedProcess:
    """``gemma-export ARGS`` through the installed entry point, ``code`` run first in the process,
    with standard output buffered as a user's is (PYTHONUNBUFFERED, set on some machines, hid an
    unflushed write). ``shell`` starts it from ``sh`` (``trap '' INT; exec "$@"``, ``exec "$@" >&-``),
    not from a ``preexec_fn``, which forks this multithreaded process (JAX) to run Python code."""
    script = f"import sys\n{code}\nfrom gemma_export.console import main\nsys.argv = ['gemma-export', *sys.argv[1:]]\nmain()\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run(["sh", "-c", shell, "sh", sys.executable, "-c", script, *args],
                          stdout=stdout if stdout is not None else subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          timeout=300, env=env)


def _signal_on_import(condition: str, signal_name: str) -> str:
    """Code for :func:`_command` that sends this process ``signal_name`` when an import's
    ``(name, *args)`` meets ``condition``: a signal at a chosen point of the loading."""
    return ("import builtins, os, signal\n"
            "real = builtins.__import__\n"
            "def load(name, *args, **kwargs):\n"
            f"    if {condition}:\n"
            f"        os.kill(os.getpid(), signal.{signal_name})\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = load\n")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [["verify", "{model}"], ["inspect", "{model}", "--json"], ["--version"]])
def test_a_standard_output_that_cannot_be_written_is_one_line(tiny_int8_export, args):
    """`> /dev/full` gave a 39-line traceback and exit 1 (helper-found), for `--version` too."""
    before = _tree_digest(tiny_int8_export)
    with open("/dev/full", "w") as full:
        done = _command(*[a.format(model=tiny_int8_export) for a in args], stdout=full)
    assert done.returncode == 2, done.stderr
    assert done.stderr == "error: cannot write to standard output: No space left on device\n"
    assert _tree_digest(tiny_int8_export) == before


def test_a_reader_that_has_gone_ends_the_command_quietly(tiny_int8_export):
    """`gemma-export verify DIR | true`: the reader is gone before the result line; exit 141 as a
    shell tool killed by SIGPIPE, no traceback, no message."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as closed:
        done = _command("verify", str(tiny_int8_export), stdout=closed)
    assert (done.returncode, done.stderr) == (141, "")


@pytest.mark.parametrize("library", ["numpy", "ml_dtypes"])
def test_ctrl_c_while_the_libraries_load_is_one_line(tiny_int8_export, library):
    """Ctrl-C in the first half second (numpy, ml_dtypes, onnx loading) gave a KeyboardInterrupt
    traceback, or numpy's "ImportError: ... failed to import" (helper-found); the signal is sent
    here when the library starts to load (numpy with the command line, ml_dtypes with onnx)."""
    done = _command("verify", str(tiny_int8_export), code=_signal_on_import(f"name == {library!r}", "SIGINT"))
    assert (done.returncode, done.stderr) == (130, "error: interrupted\n")


def test_a_closed_standard_output_or_error_is_not_taken_for_success(tiny_int8_export, tiny_dir, tmp_path):
    """`>&-` printed nothing and exited 0 (the result line went nowhere); `2>&1 | head -1` on an
    export exited 1 (helper-found): a reader gone from standard error ends the command as one gone
    from standard output does, and the writer cleans up."""
    closed = _command("verify", str(tiny_int8_export), stdout=subprocess.DEVNULL, shell='exec "$@" >&-')
    assert (closed.returncode, closed.stderr) == (2, "error: cannot write to standard output: it is closed\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader of standard error is gone before the export's first progress line
    with os.fdopen(write_end, "w") as gone:
        done = subprocess.run([sys.executable, "-c", "import sys\nfrom gemma_export.console import main\n"
                               "sys.argv = ['gemma-export', *sys.argv[1:]]\nmain()\n", "--source", str(tiny_dir),
                               "--out", str(tmp_path / "out"), "--dtype", "fp32"], stdout=subprocess.PIPE, stderr=gone,
                              text=True, timeout=300)
    assert (done.returncode, done.stdout) == (141, "")
    assert os.listdir(tmp_path) == []  # no export, no staging folder


def test_sigterm_while_a_command_loads_its_modules_is_one_line():
    """A subcommand's own imports run before its body: a SIGTERM there exited 130 with nothing on
    stderr (helper-found; 143 and the interrupt's line expected). Sent here when `verify` imports
    gemma_export.bundle."""
    # `from .bundle import ...`: name "bundle", level 1
    done = _command("verify", "nowhere", code=_signal_on_import("name == 'bundle' and args[-1:] == (1,)", "SIGTERM"))
    assert (done.returncode, done.stderr) == (143, "error: interrupted\n")


# --- generate shows its text as it comes ----------------------------------------------------------

class _ScriptedTokenizer:
    """decode() gives the scripted text for exactly the ids it is given (a tuple of ids as key)."""

    def __init__(self, texts):
        self.texts = texts

    def decode(self, ids, skip_special_tokens=True):
        return self.texts[tuple(ids)]


def _byte_fallback_tokenizer():
    """A word-level tokenizer with Gemma's byte fallback (``<0xNN>`` ids for bytes) and a decoder
    that, like Llama's and early Gemma's, strips the leading space of what it decodes: the decode
    of a window of ids differs from its part of the whole decode, which the stream must not show."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("\u2581the", "\u2581fox", "\u2581sushi", "\u2581jumps", ".", "\u2581\u00fcber"):
        vocab[word] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tokenizer, vocab


class _Recording:
    """A tokenizer's decode that records the length of each window it is given; ids in ``special``
    stand for special tokens and are skipped, as ``skip_special_tokens`` skips them."""

    def __init__(self, tokenizer, special=()):
        self.tokenizer, self.special, self.windows = tokenizer, set(special), []

    def decode(self, window, skip_special_tokens=True):
        self.windows.append(len(window))
        return self.tokenizer.decode([i for i in window if i not in self.special],
                                     skip_special_tokens=skip_special_tokens)


def test_the_text_stream_gives_the_whole_decode_over_split_characters_and_a_stripped_space():
    from gemma_export.runtime import TextStream

    tokenizer, vocab = _byte_fallback_tokenizer()
    words = ["\u2581the", "\u2581\u00fcber", "\u2581fox", "\u2581jumps", "\u2581sushi", "."]
    emoji = [vocab[f"<0x{b:02X}>"] for b in " 🍣".encode()]  # a space and 4 bytes, one id each
    ids = [vocab[w] for w in words[:3]] + emoji + [vocab[w] for w in words[3:]] + emoji
    recording = _Recording(tokenizer)
    pieces = []
    stream = TextStream(recording, pieces.append)
    for token_id in ids:
        stream.add(token_id)
    whole = tokenizer.decode(ids)
    assert whole == "the über fox 🍣 jumps sushi. 🍣"
    assert "".join(pieces) == whole  # each word's space kept, though a window's first one is stripped
    assert not any("\ufffd" in piece for piece in pieces)  # the emoji waits for its fourth byte
    assert "🍣" in pieces  # shown once whole
    assert stream.finish() == whole and "".join(pieces) == whole  # nothing left over, nothing repeated
    assert max(recording.windows) <= 6  # the last shown id(s) and what is new, not every id so far


def test_the_text_stream_decodes_a_long_generation_a_few_ids_at_a_time():
    """Decoding every id so far at each step made a long generation quadratic: 9 ms a token at
    16,000 tokens with the real tokenizer, as long as the model's step."""
    from gemma_export.runtime import TextStream

    tokenizer, vocab = _byte_fallback_tokenizer()
    recording = _Recording(tokenizer)
    pieces = []
    stream = TextStream(recording, pieces.append)
    ids = [vocab["\u2581the"], vocab["\u2581fox"], vocab["."]] * 700
    for token_id in ids:
        stream.add(token_id)
    assert "".join(pieces) == tokenizer.decode(ids) and max(recording.windows) <= 2


def test_the_text_stream_stays_short_over_special_tokens_and_bytes_that_never_complete():
    """An id that added no text (a skipped special token) or a U+FFFD that never completed kept the
    decode window growing: quadratic again, and nothing shown until the end."""
    from gemma_export.runtime import TextStream

    tokenizer, vocab = _byte_fallback_tokenizer()
    recording = _Recording(tokenizer, special=[0])  # id 0 (<unk>) stands for a special token
    pieces = []
    stream = TextStream(recording, pieces.append)
    ids = [vocab["\u2581the"]] + [0] * 300 + [vocab["\u2581fox"]] + [vocab["<0xF0>"]] * 300 + [vocab["."]]
    for token_id in ids:
        stream.add(token_id)
    assert max(recording.windows) <= TextStream.WINDOW + TextStream.MAX_CHARACTER_IDS
    whole = recording.decode(ids)
    assert whole.startswith("the fox\ufffd") and whole.endswith("\ufffd.")
    assert "".join(pieces) == whole  # the lone bytes shown as U+FFFD, as the whole decode shows them
    assert pieces[:2] == ["the", " fox"]  # the space after 300 skipped ids kept


def test_a_decode_that_rewrites_what_was_shown_shows_the_new_ids_decoded_alone():
    from gemma_export.runtime import TextStream

    pieces = []
    # nothing can be taken back: what was shown stays, and the new id's own text follows it
    stream = TextStream(_ScriptedTokenizer({(): "", (0,): "ab", (0, 1): "xyz", (1,): "z"}), pieces.append)
    stream.add(0)
    stream.add(1)
    assert stream.finish() == "abz" and pieces == ["ab", "z"]
    pieces.clear()
    # a decode that ends in U+FFFD waits, then is shown whole with the id that completes it
    stream = TextStream(_ScriptedTokenizer({(): "", (0,): "ab", (0, 1): "ab\ufffd", (1,): "\ufffd",
                                            (0, 1, 2): "ab🍣", (1, 2): "🍣", (1, 2, 3): "🍣 c"}), pieces.append)
    for token_id in range(4):
        stream.add(token_id)
    assert stream.finish() == "ab🍣 c" and pieces == ["ab", "🍣", " c"]


def test_a_special_token_between_a_character_s_bytes_does_not_count_against_them():
    """A skipped special token between the bytes of one character counted as one of its 4 ids,
    and the character came out as U+FFFD (a review's finding)."""
    from gemma_export.runtime import TextStream

    tokenizer, vocab = _byte_fallback_tokenizer()
    emoji = [vocab[f"<0x{b:02X}>"] for b in "😀".encode()]
    stream = TextStream(_Recording(tokenizer, special=[0]), lambda _piece: None)  # id 0: a special token
    for token_id in emoji[:1] + [0] + emoji[1:]:
        stream.add(token_id)
    assert stream.finish() == "😀"


def test_the_text_stream_window_stays_short_when_every_decode_rewrites():
    from gemma_export.runtime import TextStream

    longest = []

    class Rewriting:  # a decode that never extends the one before it
        def decode(self, window, skip_special_tokens=True):
            longest.append(len(window))
            return str(len(window))[::-1] + "x" if window else ""

    stream = TextStream(Rewriting(), lambda _piece: None)
    for token_id in range(200):
        stream.add(token_id)
    assert max(longest) <= 12  # WINDOW + MAX_CHARACTER_IDS, not the 200 ids


def test_a_generation_that_ends_inside_a_character_keeps_the_characters_before_it():
    """tokenizers decodes a run of byte pieces whose end is not UTF-8 as U+FFFD throughout, the
    whole characters before it included: the stream showed them and --json's text had 30 U+FFFD
    instead (helper-found, with the real tokenizer). Both are the stream's text now."""
    from gemma_export.runtime import TextStream

    tokenizer, vocab = _byte_fallback_tokenizer()
    data = "🍣🍣".encode() + "🍣".encode()[:2]
    ids = [vocab[f"<0x{b:02X}>"] for b in data]
    assert tokenizer.decode(ids) == "\ufffd" * 10  # the whole decode loses both whole characters
    pieces = []
    stream = TextStream(tokenizer, pieces.append)
    for token_id in ids:
        stream.add(token_id)
    assert pieces == ["🍣", "🍣"]  # the last two bytes wait for the rest of their character
    assert stream.finish() == "🍣🍣\ufffd\ufffd" and pieces == ["🍣", "🍣", "\ufffd\ufffd"]
    # and a character that never completes in the middle is shown after its 4th id, not lost
    pieces.clear()
    stream = TextStream(tokenizer, pieces.append)
    for token_id in [vocab[f"<0x{b:02X}>"] for b in "🍣".encode()[:2] * 3] + [vocab["."]]:
        stream.add(token_id)
    assert stream.finish() == "\ufffd" * 6 + "." and "".join(pieces) == stream.shown


def test_generate_gives_its_text_piece_by_piece_and_no_prompt_before_a_refusal(tiny_int8_export):
    from gemma_export.runtime import generate

    pieces = []
    result = generate(tiny_int8_export, "the fox", max_new_tokens=6, on_text=pieces.append)
    assert len(pieces) > 1 and "".join(pieces) == result.text  # as the ids came, not at the end
    shown = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox", "--max-new-tokens", "6"])
    assert shown.exit_code == 0 and shown.stdout == "the fox" + result.text + "\n"
    refused = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox",
                                  "--max-new-tokens", "300"])  # more positions than the tiny model's 256
    assert refused.exit_code == 2 and refused.stdout == "", refused.output


def test_an_interrupt_while_a_command_prints_its_result_is_one_line(tiny_int8_export):
    """Outside a command's body, where it prints what it did, SIGTERM exited 130 without a word
    (helper-found); sent here while `inspect --json` turns its report into JSON."""
    code = ("import os, signal\n"
            "from gemma_export import inspect as module\n"
            "def to_dict(self, top):\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "module.Report.to_dict = to_dict\n")
    done = _command("inspect", str(tiny_int8_export), "--json", code=code)
    assert (done.returncode, done.stderr, done.stdout) == (143, "error: interrupted\n", "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_json_on_a_standard_output_that_cannot_be_written_is_one_line(tiny_int8_export):
    """`--json -` was written without a flush, so its failure came at exit as a traceback and
    status 120 (helper-found)."""
    with open("/dev/full", "w") as full:
        done = _command("generate", "--model", str(tiny_int8_export), "--prompt", "ab", "--max-new-tokens", "2",
                        "--json", "-", stdout=full)
    assert (done.returncode, done.stderr.splitlines()[-1]) == (2, "error: cannot write to standard output: No space "
                                                                  "left on device"), done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


def test_a_command_run_in_process_leaves_sigterm_as_it_found_it(tiny_int8_export):
    """Run through the Python API or CliRunner (no entry point), a command made SIGTERM raise in
    the host process for good (helper-found); it now does so only while a command's body runs."""
    from gemma_export import console, verify

    assert signal.getsignal(signal.SIGTERM) == SIGTERM_AT_IMPORT  # nor did the tests before this one
    # from the default (a test runner may handle SIGTERM itself, and then the command leaves it alone)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    during = []
    real = verify.verify_manifest

    def watched(folder):
        during.append(signal.getsignal(signal.SIGTERM))
        return real(folder)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(verify, "verify_manifest", watched)
            assert runner.invoke(app, ["verify", str(tiny_int8_export)]).exit_code == 0
        assert during == [console._raise_terminated]  # raising while the body ran, so writers clean up
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # and the default again after it
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_importing_the_package_s_main_module_runs_nothing():
    """`import gemma_export.__main__` (pydoc, autodoc) ran the command line and raised SystemExit."""
    import importlib

    import gemma_export.__main__ as module

    importlib.reload(module)  # a second import in this process too
    done = subprocess.run([sys.executable, "-m", "gemma_export.cli", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("gemma-export "), done.stderr


def test_an_ignored_ctrl_c_stays_ignored_while_the_libraries_load():
    """Under nohup, `trap '' INT` or as a background job Ctrl-C is ignored, and must stay so: the
    command goes on (here to its refusal of a missing folder)."""
    done = _command("verify", "nowhere", code=_signal_on_import("name == 'ml_dtypes'", "SIGINT"),
                    shell="trap '' INT; exec \"$@\"")
    assert done.returncode == 2 and done.stderr.startswith("error: nowhere"), done.stderr


def test_a_reader_gone_while_generate_shows_its_text_ends_it_without_a_word(tiny_int8_export):
    """Inside a command's body too: no "closed by its reader" line, status 141."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as gone:
        done = _command("generate", "--model", str(tiny_int8_export), "--prompt", "the fox", "--max-new-tokens", "4",
                        stdout=gone)
    assert (done.returncode, done.stderr) == (141, "")


def test_generate_prints_the_prompt_when_there_is_no_new_text(tiny_int8_export, monkeypatch):
    """An end-of-turn id first gives no piece of text: the prompt and the line's end still come."""
    from gemma_export import runtime

    real = runtime.generate

    def without_text(*args, on_text=None, **kwargs):
        result = real(*args, **kwargs)
        return runtime.GenerationResult(result.prompt_ids, result.new_ids[:1], "", result.prefill_ms, [])

    monkeypatch.setattr(runtime, "generate", without_text)
    shown = runner.invoke(app, ["generate", "--model", str(tiny_int8_export), "--prompt", "the fox", "--max-new-tokens", "2"])
    assert shown.exit_code == 0 and shown.stdout == "the fox\n", shown.output


def test_generate_shows_a_last_character_whose_decode_never_completed(tiny_int8_export, monkeypatch):
    """Pieces that end in U+FFFD wait for the next id; at the end the rest is shown all the same."""
    from gemma_export import runtime

    real_load = runtime.load_tokenizer

    class Unfinished:
        def __init__(self, tokenizer):
            self._tokenizer = tokenizer

        def decode(self, ids, skip_special_tokens=True):
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) + "\ufffd"

        def __getattr__(self, name):
            return getattr(self._tokenizer, name)

    monkeypatch.setattr(runtime, "load_tokenizer", lambda model_dir: Unfinished(real_load(model_dir)))
    pieces = []
    result = runtime.generate(tiny_int8_export, "the fox", max_new_tokens=4, on_text=pieces.append)
    assert result.text.endswith("\ufffd") and "".join(pieces) == result.text and len(pieces) == 1


@pytest.mark.parametrize("args", [["--version"], ["verify", "{model}"]])
def test_a_signal_once_the_command_has_ended_leaves_its_exit_status(tiny_int8_export, args):
    """A signal while Python unwound the command's exit gave a traceback and status 1 (SIGTERM) or
    a death by SIGINT (helper-found); after the command's end both are ignored now."""
    code = ("import atexit, os, signal, time\n"
            "def late():\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.2)\n"
            "atexit.register(late)\n")
    done = _command(*[a.format(model=tiny_int8_export) for a in args], code=code)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "interrupted" not in done.stderr and "Exception" not in done.stderr


def test_a_signal_as_the_command_ends_is_one_line_not_a_traceback():
    """The signal lands after the command's end, before the handlers are set aside."""
    code = ("import os, signal\n"
            "from gemma_export import console\n"
            "real = console._ignore_interrupts\n"
            "def late():\n"
            "    console._ignore_interrupts = real\n"
            "    raise console.Terminated\n"
            "console._ignore_interrupts = late\n")
    done = _command("--version", code=code)
    assert (done.returncode, done.stderr) == (143, "error: interrupted\n")


def test_float16_scales_export_says_so(tiny_dir, tmp_path):
    """--scale-dtype float16 reaches the files (every scale initializer float16, the manifest) and the
    summary; its data file is smaller than the float32-scale export's by half the scales' bytes (the
    real model's also by some 64 KiB alignment padding of its larger tensors)."""
    sizes, scale_bytes = {}, {}
    for flag, out in ((["--scale-dtype", "float16"], tmp_path / "half"), ([], tmp_path / "wide")):
        result = _run("--source", tiny_dir, "--dtype", "int4", "--block-size", "16", "--no-calibrate", *flag, "--out", out)
        assert result.exit_code == 0, result.output
        said = "scales: float16 on disk (--scale-dtype float16)" in result.stdout
        assert said == bool(flag)
        assert "blocks: 16 weights per scale in the layers, 32 in the table; Hadamard 64\n" in result.stdout
        want = "float16" if flag else "float32"
        assert json.loads((out / "manifest.json").read_text())["quantization"]["scale_dtype"] == want
        model = onnx.load(str(out / "model.onnx"), load_external_data=False)
        scales = [t for t in model.graph.initializer if t.name.endswith("_scales")]
        assert {t.data_type for t in scales} == {onnx.TensorProto.FLOAT16 if flag else onnx.TensorProto.FLOAT}
        scale_bytes[want] = sum(math.prod(t.dims) for t in scales) * (2 if flag else 4)
        sizes[want] = (out / "model.onnx.data").stat().st_size
    assert scale_bytes["float16"] * 2 == scale_bytes["float32"]
    saved = sizes["float32"] - sizes["float16"]
    assert saved == scale_bytes["float16"], (saved, scale_bytes)  # the tiny tensors are packed without padding


def test_activation_residual_export_says_so(tiny_dir, tmp_path):
    """--activation-residual reaches the graph (every MatMulNBits reads a batch doubled by a Concat on
    axis 0), the manifest and the summary; without it none of them shows it."""
    for flag, out in ((["--activation-residual"], tmp_path / "residual"), ([], tmp_path / "plain")):
        result = _run("--source", tiny_dir, "--dtype", "int8", "--block-size", "16", *flag, "--out", out)
        assert result.exit_code == 0, result.output
        said = "activations: each matmul also multiplies the residual of its input's int8 rounding" in result.stdout
        assert said == bool(flag)
        assert json.loads((out / "manifest.json").read_text())["quantization"]["activation_residual"] is bool(flag)
        model = onnx.load(str(out / "model.onnx"), load_external_data=False)
        producer = {o: n for n in model.graph.node for o in n.output}

        def doubled(node) -> bool:  # its input: the batch of rounded rows over residual rows
            reshape = producer[node.input[0]]
            concat = producer.get(reshape.input[0]) if reshape.op_type == "Reshape" else None
            return concat is not None and concat.op_type == "Concat" and concat.attribute[0].i == 0

        nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
        assert len(nodes) == 17 and [doubled(n) for n in nodes] == [bool(flag)] * 17


def test_summary_names_the_int8_table_of_an_int4_export(tiny_dir, tmp_path):
    """The export summary's ``blocks:`` line names the table's codes only when they differ from the
    layers' (int4 with --table-dtype int8), in the words the bundle README uses for the same record."""
    from gemma_export.manifest import quantization_text

    for flag, table in ((["--table-dtype", "int8"], "int8 table"), ([], "table")):
        out = tmp_path / ("mixed" if flag else "plain")
        result = _run("--source", tiny_dir, "--dtype", "int4", "--no-calibrate", *flag, "--out", out)
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "manifest.json").read_text())
        rows = manifest["quantization"]["table_block_size"]
        assert f"blocks: 32 weights per scale in the layers, {rows} in the {table}; Hadamard 64\n" in result.stdout
        assert f"{rows} in the {table}, Hadamard 64" in quantization_text(manifest)[0]


@pytest.mark.parametrize("args, option, value", [(["generate", "--model", "m", "--max-new-tokens", "abc"], "--max-new-tokens", "abc"),
                                                 (["--block-size=1.5"], "--block-size", "1.5")])
def test_a_number_option_given_text_names_the_value(monkeypatch, args, option, value):
    """A fresh user's finding: typer's message ("Input should be a valid integer, unable to parse
    string as an integer") named neither the expectation plainly nor the value given. The value is
    this invocation's, not the process's command line (review finding)."""
    monkeypatch.setattr(sys, "argv", ["gemma-export", option, "7"])
    result = _run(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: Invalid value for '{option}': expected a whole number, found '{value}' (see '"), lines


def test_generate_notes_listed_files_changed_after_the_export(tiny_int8_export, tmp_path):
    """A fresh user's finding: with tokenizer_config.json overwritten by "{}", verify refused the
    folder and generate ran without a word."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_int8_export, model)
    clean = _run("generate", "--model", model, "--prompt", "ab", "--max-new-tokens", "2")
    assert clean.exit_code == 0 and "changed after the export" not in clean.stderr
    config = model / "genai_config.json"
    config.write_text(config.read_text() + "\n")  # still valid, one byte longer
    edited = _run("generate", "--model", model, "--prompt", "ab", "--max-new-tokens", "2")
    assert edited.exit_code == 0, edited.output
    assert edited.stderr.strip().splitlines()[-1] == (
        f"note: genai_config.json in {model} changed after the export (sizes differ from its manifest.json); "
        f"gemma-export verify --model {model} checks every file")


@pytest.mark.parametrize("flag", [None, "--special-tokens", "--no-special-tokens"])
def test_generate_shows_the_special_tokens_the_model_generates_but_not_the_stop(tiny_int8_export, monkeypatch, flag):
    """A helper's finding: generate's text (and --json's "text") left out every special token, so a
    FunctionGemma function call printed without its <start_function_call> and <escape> markers, where
    its tokenizer marks them special, could not be parsed. Now they are shown unless
    --no-special-tokens; the stop id that ends the generation never is."""
    from tokenizers import AddedToken

    from gemma_export import runtime

    real = runtime.load_tokenizer

    def with_a_special_marker(model_dir):
        tokenizer = real(model_dir)
        tokenizer.add_special_tokens([AddedToken("<unk>", special=True)])  # id 3 marked special
        return tokenizer
    monkeypatch.setattr(runtime, "load_tokenizer", with_a_special_marker)
    scripted = [4, 3, 5, 3, 1]  # "a", the special, "b", the special, <eos> (a stop id)

    def greedy(self, prompt_ids, max_new_tokens, stop_ids=None, prefill_chunk=None, on_token=None):
        for token_id in scripted:
            on_token(token_id)
        return list(scripted), 1.0, [1.0] * (len(scripted) - 1)
    monkeypatch.setattr(runtime.OnnxDecoder, "greedy", greedy)
    result = _run("generate", "--model", tiny_int8_export, "--prompt", "x", *([flag] if flag else []),
                  "--json", "-")
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)
    assert record["expected_ids"] == scripted
    tokenizer = with_a_special_marker(tiny_int8_export)
    shown = tokenizer.decode(scripted[:-1], skip_special_tokens=flag == "--no-special-tokens")
    assert shown == ("a b" if flag == "--no-special-tokens" else "a <unk> b <unk>")  # this tokenizer joins with spaces
    assert record["text"] == shown and result.stderr.startswith("x" + shown + "\n")


@pytest.mark.parametrize("command", [["verify"], ["--dtype", "fp32", "--out"]])
def test_a_deleted_current_folder_is_named_not_a_bare_no_such_file(tiny_int8_export, tmp_path, monkeypatch, command):
    """A break-it run: from a folder removed under the shell, an export with absolute paths failed
    with "error: No such file or directory", naming nothing."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    target = tiny_int8_export if command == ["verify"] else tmp_path / "out"
    result = _run(*command, target)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("error: the current folder no longer exists (it was removed while the shell stood "
                                     "in it); cd into an existing folder and run again")
    assert not (tmp_path / "out").exists()


def test_a_sources_own_tokenizer_without_the_models_bos_is_noted(tiny_dir, tmp_path):
    """A break-it run: a source whose tokenizer.json adds no <bos> exported and calibrated without a
    word, while the same file given as --tokenizer is refused."""
    import json

    from conftest import write_char_tokenizer

    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    result = _run("--source", source, "--out", tmp_path / "good", "--dtype", "fp32")
    assert result.exit_code == 0 and "<bos>" not in result.stderr, result.output
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    tokenizer["post_processor"] = None
    (source / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = _run("--source", source, "--out", tmp_path / "out", "--dtype", "fp32")
    assert result.exit_code == 0, result.output
    assert (f"note: {source / 'tokenizer.json'}: turns the prompt 'a' into ids [4]; expected the model's <bos> "
            "(bos_token_id 2) and then [4], as Gemma's own tokenizer does; calibration, generate and the board's "
            "prompts get these ids") in result.stderr
    result = _run("--source", tiny_dir, "--tokenizer", source / "tokenizer.json", "--out", tmp_path / "t", "--dtype", "fp32")
    assert result.exit_code == 2 and "as Gemma's own tokenizer does (--tokenizer)" in result.stderr


def _relisted(folder, name, content: bytes):
    """``name`` in ``folder`` rewritten with ``content``, and its manifest entry made to match."""
    import hashlib
    import json

    (folder / name).write_bytes(content)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(quantization=None), "{manifest}: field 'quantization' is null, but the graph stores int8 weights: "
                                            "expected an object (its block sizes, scales, calibration)"),
    (lambda m: m["quantization"].update(calibration=5), "{manifest}: field 'quantization.calibration' must be an object "
                                                        "(GPTQ's record) or null (round to nearest), found 5"),
    (lambda m: m.update(format="gguf"), "{manifest}: field 'format' must be 'onnx', found \"gguf\""),
    (lambda m: m["kv_cache"].update(layout="BSNH"), "{manifest}: field 'kv_cache.layout' must be 'BNSH' (the caches' "
                                                    "[batch, kv heads, positions, head_dim]), found \"BSNH\""),
    # verify's tie check and parity --reference's architecture check read these two
    (lambda m: m["config"].update(hidden_size=32), "{manifest}: field 'config.hidden_size' is 32, but the graph has 64"),
    (lambda m: m["config"].update(intermediate_size=4), "{manifest}: field 'config.intermediate_size' is 4, but the graph "
                                                        "has 128"),
    # a tester (twenty-first session): parity --reference then blamed the right reference for 8 heads
    (lambda m: m["config"].update(num_attention_heads=8), "{manifest}: field 'config.num_attention_heads' is 8, but the "
                                                          "graph has 4"),
    (lambda m: m["config"].update(layer_types=m["config"]["layer_types"][:3]),
     "{manifest}: field 'config.layer_types' has 3 entries, but the graph has 4 layers"),
    # the bundle README's line reads these: "4-bit zero points" on an int8 export
    (lambda m: m["quantization"].update(symmetric=False), "{manifest}: field 'quantization.symmetric' is false, but the "
                                                          "layers' MatMulNBits take no zero points"),
    (lambda m: m["quantization"].update(table_dtype="int4"), "{manifest}: field 'quantization.table_dtype' is \"int4\", "
                                                             "but the head's MatMulNBits has bits 8"),
    ("tokenizer.json", "{folder}/tokenizer.json: not a readable tokenizer ("),
    ("genai_config.json", "{folder}/genai_config.json: unreadable onnxruntime-genai configuration ("),
    ("link", "{manifest}: is a link; an export folder holds regular files only"),
])
def test_verify_refuses_what_its_checksums_let_through(tiny_int8_export, tmp_path, edit, message):
    """A break-it run: each of these passed verify (and went into a bundle) while the bundle README
    described it wrongly or generate and the board's onnxruntime-genai could not read it."""
    import json

    folder = tmp_path / "m"
    shutil.copytree(tiny_int8_export, folder)
    manifest = folder / "manifest.json"
    if edit == "link":
        kept = tmp_path / "kept-manifest.json"
        manifest.rename(kept)
        manifest.symlink_to(kept)
    elif isinstance(edit, str):
        _relisted(folder, edit, b"{not json")
    else:
        fields = json.loads(manifest.read_text())
        edit(fields)
        manifest.write_text(json.dumps(fields))
    result = _run("verify", folder)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: " + message.format(manifest=manifest, folder=folder)), result.stderr


def test_an_fp32_export_whose_manifest_records_quantization_is_refused(tmp_path, tiny_dir):
    import json

    out = tmp_path / "fp32"
    assert _run("--source", tiny_dir, "--out", out, "--dtype", "fp32").exit_code == 0
    fields = json.loads((out / "manifest.json").read_text())
    assert "quantization" not in fields and _run("verify", out).exit_code == 0
    fields["quantization"] = {"block_size": 32}
    (out / "manifest.json").write_text(json.dumps(fields))
    result = _run("verify", out)
    assert result.exit_code == 2 and (f"{out / 'manifest.json'}: field 'quantization' is {{\"block_size\": 32}}, but the "
                                      "graph stores fp32 weights: expected null") in result.stderr


def test_quality_notes_a_tokenizer_changed_after_the_export(tiny_int8_export, tmp_path):
    """A tester shuffled an export's tokenizer.json: quality scored the text it tokenized (perplexity
    404.7 against 230.7) without a word, where generate notes files changed since the export."""
    changed = tmp_path / "tk"
    shutil.copytree(tiny_int8_export, changed)
    (changed / "tokenizer.json").write_text((changed / "tokenizer.json").read_text() + "\n")  # the same tokens, resized
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4)
    args = ["--reference", str(tiny_int8_export), "--text", str(text), "--tokens", "40"]
    result = _run("quality", "--model", changed, *args)
    assert result.exit_code == 0, result.output
    assert (f"note: tokenizer.json in {changed} changed after the export (sizes differ from its manifest.json); "
            f"gemma-export verify --model {changed} checks every file") in result.stderr
    assert "changed after the export" not in _run("quality", "--model", tiny_int8_export, *args).stderr


def test_a_folder_this_user_may_not_read_is_named_as_such(tiny_int8_export, monkeypatch):
    """A tester (chmod 000, capabilities dropped): every command said 'DIR/BUNDLE.json: Permission
    denied (check the file's permissions)', a file that does not exist."""
    import gemma_export.manifest as manifest_module

    folder = str(tiny_int8_export)
    real = os.access
    monkeypatch.setattr(manifest_module.os, "access", lambda path, mode: False if str(path) == folder else real(path, mode))
    is_file = Path.is_file

    def searched(path):  # what stat gives in a folder without search rights (EACCES, not "missing")
        if str(path.parent) == folder:
            raise PermissionError(13, "Permission denied", str(path))
        return is_file(path)

    monkeypatch.setattr(Path, "is_file", searched)
    for args in (["generate", "--model", folder, "--prompt", "a"], ["verify", folder], ["inspect", folder],
                 ["prepack", "--model", folder], ["quality", "--model", folder, "--reference", folder],
                 ["bench", "--model", folder]):
        result = _run(*args)
        assert result.exit_code == 2, result.output
        assert result.stderr == (f"error: {folder}: this user may not read the folder (permission denied); its owner "
                                 "can make it readable\n"), result.stderr


def test_readme_python_export_reports_its_steps_and_tensors(tiny_dir, tmp_path, capsys):
    """The README's Python example passes status=print and a one-line progress callback: without the
    callback the export printed nothing for minutes after its first steps (a fresh user, 2026-12-07).
    Its exact callback and keywords, on the tiny model with a tokenizer (so it calibrates)."""
    import re
    import shutil

    from conftest import write_char_tokenizer

    from gemma_export import export

    source = tmp_path / "src"
    shutil.copytree(tiny_dir, source)
    write_char_tokenizer(source)
    result = export(source, out_dir=tmp_path / "int8-from-python", dtype="int8", block_size=16, status=print,
                    progress=lambda done, total, what: print(f"\r{what[:40]:40} {done}/{total}", end=""))
    printed = capsys.readouterr().out
    assert printed.startswith("reading "), printed[:200]
    counts = [(int(a), int(b)) for a, b in re.findall(r" (\d+)/(\d+)", printed)]
    assert ("calibration" in printed) and counts and counts[-1][0] == counts[-1][1] > 1, printed[-300:]
    assert (result.out_dir / "model.onnx").is_file()
