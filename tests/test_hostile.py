"""Broken and hostile inputs, one table: every case goes through the command line and must give
one ``error:`` line with the named words, exit status 2, the named error class (seen with
``--debug``), and leave the work folder exactly as it was (no output, no staging, inputs unchanged).

Each case builds its input inside ``work/`` from the tiny fixtures: transformers folders with forged
safetensors headers or contradicting configs, GGUF files with forged fields, reference MLIR exports
whose declarations contradict their archive, export folders with links or outside paths, and
commands given impossible options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import broken_copy, make_tiny_model, write_char_tokenizer
from gemma_export.cli import app
from gemma_export.errors import (ConfigError, FormatError, GemmaExportError, NumericError, OutputError, ResourceError,
                                 SourceNotFoundError, VerificationError)
from test_gguf_tiny import write_tiny_gguf
from test_reference_mlir import write_reference


@dataclasses.dataclass
class Fixtures:
    tiny_dir: Path
    export_dir: Path
    gguf_bytes: bytes
    ref_model: object


@pytest.fixture(scope="module")
def fx(tiny_dir, tiny_int8_export, tmp_path_factory) -> Fixtures:
    model = make_tiny_model(seed=11, num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    path = tmp_path_factory.mktemp("hostile_gguf") / "tiny.gguf"
    write_tiny_gguf(model, path)
    ref_model = make_tiny_model(seed=3, sliding_window=512, layer_types=["sliding_attention"] * 4)
    return Fixtures(tiny_dir, tiny_int8_export, path.read_bytes(), ref_model)


# ---- builders: each returns the command line; everything lives under `work` -----------------------
def _export_args(source: Path, work: Path, dtype: str = "fp32") -> list:
    return ["--source", source, "--out", work / "out", "--dtype", dtype,
            *(["--block-size", 16] if dtype in ("int8", "int4") else [])]


def hf(edit_config=None, edit_tensors=None, edit_bytes=None, dtype="fp32"):
    """A copy of the tiny transformers folder with its config, tensors or raw safetensors bytes edited."""
    def make(work: Path, fx: Fixtures) -> list:
        src = broken_copy(fx.tiny_dir, work / "src", edit_config, edit_tensors)
        if edit_bytes:
            path = src / "model.safetensors"
            path.write_bytes(edit_bytes(path.read_bytes()))
        return _export_args(src, work, dtype)
    return make


def hf_file(name: str, content: bytes, dtype="fp32"):
    """A copy of the tiny transformers folder with file ``name`` written beside its weights."""
    def make(work: Path, fx: Fixtures) -> list:
        src = broken_copy(fx.tiny_dir, work / "src", None, None)
        (src / name).write_bytes(content)
        return _export_args(src, work, dtype)
    return make


def hf_special(name: str, kind: str, dtype="int8"):
    """A copy of the tiny transformers folder whose ``name`` is replaced by a folder, a FIFO, a link to
    a device or a broken link: there, but not a file to read (helper-found: taken for absent)."""
    def make(work: Path, fx: Fixtures) -> list:
        src = broken_copy(fx.tiny_dir, work / "src", None, None)
        path = src / name
        path.unlink(missing_ok=True)
        {"folder": path.mkdir, "fifo": lambda: os.mkfifo(path), "device": lambda: path.symlink_to("/dev/zero"),
         "broken link": lambda: path.symlink_to(src / "nowhere")}[kind]()
        return _export_args(src, work, dtype)
    return make


def _header(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def forge_header(edit: Callable[[dict], None]):
    """Rewrite the safetensors JSON header (same data bytes)."""
    def change(raw: bytes) -> bytes:
        header, data = _header(raw)
        edit(header)
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data
    return change


def _overlap(header: dict) -> None:
    """UP's range moved onto the first bytes of the table's."""
    start = header[EMBED]["data_offsets"][0]
    header[UP]["data_offsets"] = [start, start + 4 * 128 * 64]


def _entry(name: str, **fields):
    return lambda h: h[name].update(fields)


EMBED = "model.embed_tokens.weight"
UP = "model.layers.0.mlp.up_proj.weight"


def _set(name: str, value: np.ndarray):
    return lambda t: t.update({name: value})


def _with_value(name: str, index: int, value: float):
    def edit(t):
        t[name] = t[name].copy()
        t[name].flat[index] = value
    return edit


def gguf_file(patch: Callable[[bytes], bytes]):
    def make(work: Path, fx: Fixtures) -> list:
        path = work / "model.gguf"
        path.write_bytes(patch(fx.gguf_bytes))
        return _export_args(path, work)
    return make


def _tensor_info_at(raw: bytes, name: bytes) -> int:
    """Offset just after a tensor-info name: n_dims u32, dims u64 × n, type u32, offset u64 follow."""
    return raw.index(name) + len(name)


def _gguf_type(value: int):
    def patch(raw):
        at = _tensor_info_at(raw, b"blk.0.ffn_up.weight") + 4 + 16
        return raw[:at] + struct.pack("<I", value) + raw[at + 4:]
    return patch


def _gguf_offset(delta: int):
    def patch(raw):
        at = _tensor_info_at(raw, b"blk.0.ffn_up.weight") + 4 + 16 + 4
        offset = struct.unpack("<Q", raw[at:at + 8])[0]
        return raw[:at] + struct.pack("<Q", offset + delta) + raw[at + 8:]
    return patch


def _gguf_dim_of(name: bytes, value: int):
    def patch(raw):
        at = _tensor_info_at(raw, name) + 4
        return raw[:at] + struct.pack("<Q", value) + raw[at + 8:]
    return patch


def _gguf_dim(value: int):
    def patch(raw):
        at = _tensor_info_at(raw, b"token_embd.weight") + 4
        return raw[:at] + struct.pack("<Q", value) + raw[at + 8:]
    return patch


def mlir(edit=None, dtype="bf16", remove_archive=False):
    def make(work: Path, fx: Fixtures) -> list:
        path = write_reference(fx.ref_model, work / "ref", dtype, edit=edit)
        if remove_archive:
            (work / "ref" / "gemma.safetensors").unlink()
        return _export_args(path, work)
    return make


def parity_reference(edit_mlir=None, edit_archive=None):
    """`parity --reference` with a reference-format export whose MLIR text or archive bytes are edited."""
    def make(work: Path, fx: Fixtures) -> list:
        path = write_reference(fx.ref_model, work / "ref", "bf16")
        if edit_mlir:
            path.write_text(edit_mlir(path.read_text()))
        if edit_archive:
            archive = path.with_suffix(".safetensors")
            archive.write_bytes(edit_archive(archive.read_bytes()))
        return ["parity", "--model", fx.export_dir, "--reference", path]
    return make


def _line(index: int, old: str, new: str):
    return lambda lines, archive: lines.__setitem__(index, lines[index].replace(old, new))


def export_copy(edit: Callable[[Path], None], command: Callable[[Path], list]):
    """A copy of the tiny int8 export, edited, then given to another command."""
    def make(work: Path, fx: Fixtures) -> list:
        folder = work / "model"
        shutil.copytree(fx.export_dir, folder)
        edit(folder)
        return command(folder)
    return make


def _nan_table(folder: Path) -> None:
    """The table's int8 block scales set to NaN in the data file: the export's logits are NaN."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    scales = next(t for t in model.graph.initializer if "embed_tokens" in t.name and "scale" in t.name)
    place = {e.key: e.value for e in scales.external_data}
    with open(folder / "model.onnx.data", "r+b") as f:
        f.seek(int(place["offset"]))
        f.write(np.full(int(place["length"]) // 4, np.nan, np.float32).tobytes())


def _no_tokenizer(folder: Path) -> None:
    """The export as a tokenizer-less source (a reference .mlir) leaves it: no tokenizer files listed."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
        manifest["files"].pop(name, None)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _char_tokenizer_bytes(extra: dict[str, int]) -> bytes:
    """The tiny models' character tokenizer with ``extra`` pieces added to its vocabulary."""
    import tempfile

    from conftest import write_char_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        data = json.loads((write_char_tokenizer(Path(tmp)) / "tokenizer.json").read_text())
    data["model"]["vocab"].update(extra)
    return json.dumps(data).encode()


def _generate(folder: Path) -> list:
    return ["generate", "--model", folder, "--prompt", "hello", "--max-new-tokens", 2]


def _verify(folder: Path) -> list:
    return ["verify", folder]


def _parity_golden(golden: str, *options: str):
    """`parity --model FOLDER --golden FOLDER/golden [--option FOLDER/file ...]` for an edited export copy."""
    return lambda f: ["parity", "--model", f, "--golden", f / golden,
                      *[f / o if n % 2 else o for n, o in enumerate(options)]]


def _relocate(location: str):
    """Point every initializer's external data at ``location`` (the model file only is edited)."""
    def edit(folder: Path) -> None:
        import onnx

        model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        for t in model.graph.initializer:
            for e in t.external_data:
                if e.key == "location":
                    e.value = location
        onnx.save(model, str(folder / "model.onnx"))
    return edit


def _symlink_data(folder: Path) -> None:
    data = folder / "model.onnx.data"
    real = folder.parent / "elsewhere.data"
    data.rename(real)
    data.symlink_to(real)


def _truncate(name: str, keep: int):
    def edit(folder: Path) -> None:
        path = folder / name
        path.write_bytes(path.read_bytes()[:keep])
    return edit


def _write(name: str, content: bytes):
    return lambda folder: (folder / name).write_bytes(content)


DELETE = object()  # _manifest_field's value that removes the field


def _manifest_field(section: str | None, name: str, value):
    """Set (or, with ``DELETE``, remove) one field of the copy's manifest.json (``section`` None: top level)."""
    def edit(folder: Path) -> None:
        manifest = json.loads((folder / "manifest.json").read_text())
        scope = manifest[section] if section else manifest
        if value is DELETE:
            del scope[name]
        else:
            scope[name] = value
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return edit


def plain(args: Callable[[Path], list], setup: Callable[[Path], None] | None = None):
    def make(work: Path, fx: Fixtures) -> list:
        if setup:
            setup(work)
        return args(work)
    return make


def _file(name: str, content: bytes):
    return lambda work: (work / name).write_bytes(content)


def existing_output(setup: Callable[[Path], None]):
    def make(work: Path, fx: Fixtures) -> list:
        setup(work)
        return _export_args(fx.tiny_dir, work)
    return make


def calibration(dtype: str, *options, setup: Callable[[Path], None] | None = None):
    """An export of the tiny model (no tokenizer) with calibration options; ``*.txt`` names live in work."""
    def make(work: Path, fx: Fixtures) -> list:
        if setup:
            setup(work)
        return [*_export_args(fx.tiny_dir, work, dtype),
                *[work / o if isinstance(o, str) and o.endswith(".txt") else o for o in options]]
    return make


# ---- the table -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    make: Callable[[Path, Fixtures], list]
    error: type
    words: tuple[str, ...]


CASES = {
    # safetensors in a transformers folder
    "st truncated data": Case(hf(edit_bytes=lambda b: b[:-100]), FormatError, ("model.safetensors", "lies outside")),
    "st header length past the end": Case(hf(edit_bytes=lambda b: struct.pack("<Q", 10**9) + b[8:]), FormatError,
                                          ("not a safetensors file: its first 8 bytes give a header length of 1,000,000,000, beyond the file",)),
    "st header not json": Case(hf(edit_bytes=lambda b: b[:8] + b"\x00" + b[9:]), FormatError, ("header is not JSON",)),
    "st overlapping offsets": Case(hf(edit_bytes=forge_header(_overlap)), FormatError, ("overlaps",)),
    "st unknown dtype": Case(hf(edit_bytes=forge_header(_entry(UP, dtype="Q4X"))), FormatError,
                             (f"tensor '{UP}' has unknown dtype 'Q4X'",)),
    "st shape disagrees with bytes": Case(hf(edit_bytes=forge_header(_entry(UP, shape=[128, 65]))), FormatError,
                                          (f"tensor '{UP}' holds 32768 bytes, shape [128, 65] × F32 needs 33280",)),
    "st overflowing dims": Case(hf(edit_bytes=forge_header(_entry(UP, shape=[2**40, 2**40, 2**40]))), FormatError,
                                (f"tensor '{UP}'",)),
    "st negative dim": Case(hf(edit_bytes=forge_header(_entry(UP, shape=[-128, -64]))), FormatError, ("negative dimension",)),
    "st metadata not an object": Case(hf(edit_bytes=forge_header(lambda h: h.update(__metadata__=[1]))), FormatError,
                                      ("'__metadata__' must map strings to strings, found [1]",)),
    "tensor missing": Case(hf(edit_tensors=lambda t: t.pop(UP)), FormatError, (f"missing tensor '{UP}'",)),
    "tensor wrong shape": Case(hf(edit_tensors=_set(UP, np.zeros((128, 63), np.float32))), FormatError,
                               (UP, "has shape [128, 63]", "expected [128, 64]")),
    "nan weight": Case(hf(edit_tensors=_with_value(UP, 70, np.nan)), NumericError, (UP, "nan", "index (1, 6)")),
    # a finite F64 beyond float32: named as what the file holds, not as the inf the cast made (probe finding)
    "f64 beyond float32": Case(hf(edit_tensors=lambda t: (t.__setitem__(UP, t[UP].astype(np.float64)),
                                                         _with_value(UP, 70, 1e300)(t))), NumericError,
                               (UP, "holds 1e+300 at index (1, 6), beyond float32's range")),
    "bf16 overflow": Case(hf(edit_tensors=_with_value(UP, 70, 3.4e38), dtype="bf16"), NumericError,
                          (f"model.safetensors:{UP}: cannot store as bf16", "at index [1, 6]")),
    "inf weight": Case(hf(edit_tensors=_with_value(EMBED, 5, np.inf), dtype="int8"), NumericError, (EMBED, "inf", "index (0, 5)")),
    "integer weight": Case(hf(edit_tensors=_set("model.norm.weight", np.zeros(64, np.int32))), FormatError,
                           ("model.norm.weight", "dtype I32")),
    # tokenizer.json beside the weights: copied into the export, used to calibrate
    "tokenizer_config not json": Case(hf_file("tokenizer_config.json", b"{oops"), FormatError,
                                      ("src/tokenizer_config.json: expected a JSON object, found text that is not JSON",)),
    "chat template not utf-8": Case(hf_file("chat_template.jinja", b"{{ \xff }}"), FormatError,
                                    ("src/chat_template.jinja: not UTF-8 text (byte 3); expected the model's chat template",)),
    "generation_config not json": Case(hf_file("generation_config.json", b"{oops"), ConfigError,
                                       ("src/generation_config.json: cannot read JSON",)),
    "generation_config eos beyond the vocabulary": Case(
        hf_file("generation_config.json", b'{"eos_token_id": [1, 500]}'), ConfigError,
        ("src/generation_config.json: field 'eos_token_id' is 500, expected a token id below the vocabulary's 96 rows",)),
    "special_tokens_map not utf-8": Case(hf_file("special_tokens_map.json", b"\xff\xfe", dtype="int8"), FormatError,
                                         ("src/special_tokens_map.json: expected UTF-8 JSON, found byte 0xff",)),
    "tokenizer_config a list": Case(hf_file("tokenizer_config.json", b"[1]"), FormatError,
                                    ("src/tokenizer_config.json: expected a JSON object, found [1]",)),
    # fields transformers reads with a type: refused by name, not copied for AutoTokenizer to fail on (probe finding)
    "special_tokens_map token a number": Case(hf_file("special_tokens_map.json", b'{"bos_token": {"content": 5}}'),
                                              FormatError, ("src/special_tokens_map.json: field 'bos_token' must be a "
                                                            'token (a string, or an object whose \'content\' is one), '
                                                            'found {"content": 5}',)),
    "special_tokens_map extra tokens not a list": Case(
        hf_file("special_tokens_map.json", b'{"additional_special_tokens": "<x>"}'), FormatError,
        ("field 'additional_special_tokens' must be a list (or an object) of tokens",)),
    # more fields AutoTokenizer fails on (second probe): each refused by name
    "tokenizer_config extra tokens a number": Case(hf_file("tokenizer_config.json", b'{"extra_special_tokens": 5}'),
                                                   FormatError, ("field 'extra_special_tokens' must be a list (or an "
                                                                 "object) of tokens", "found 5")),
    "tokenizer_config named extra token a number": Case(
        hf_file("tokenizer_config.json", b'{"extra_special_tokens": {"image_token": 5}}'), FormatError,
        ('found {"image_token": 5}',)),
    "tokenizer_config added_tokens_decoder a list": Case(
        hf_file("tokenizer_config.json", b'{"added_tokens_decoder": [1, 2]}'), FormatError,
        ("field 'added_tokens_decoder' must map token ids", "found [1, 2]")),
    "tokenizer_config added_tokens_decoder by name": Case(
        hf_file("tokenizer_config.json", b'{"added_tokens_decoder": {"zero": {"content": "<pad>"}}}'), FormatError,
        ("field 'added_tokens_decoder' must map token ids",)),
    "tokenizer_config model_max_length text": Case(hf_file("tokenizer_config.json", b'{"model_max_length": "big"}'),
                                                   FormatError, ("field 'model_max_length' must be a number, found \"big\"",)),
    "tokenizer_config tokenizer_class a number": Case(hf_file("tokenizer_config.json", b'{"tokenizer_class": 5}'),
                                                      FormatError, ("field 'tokenizer_class' must be a class name",)),
    "tokenizer ids beyond the vocabulary": Case(hf_file("tokenizer.json", _char_tokenizer_bytes(extra={"z": 500})), ConfigError,
                                                ("src/tokenizer.json: token id 500 ('z') is outside the model's vocab_size",
                                                 "does not belong to these weights")),
    **{f"tokenizer.json {kind}": Case(hf_special("tokenizer.json", kind), FormatError,
                                      (f"src/tokenizer.json: is {what}; expected the tokenizer file or none",))
       for kind, what in (("folder", "a folder"), ("fifo", "not a regular file (a FIFO, socket or device)"),
                          ("device", "not a regular file (a FIFO, socket or device)"))},
    "tokenizer.json broken link": Case(hf_special("tokenizer.json", "broken link"), FormatError,
                                       ("src/tokenizer.json: is a broken link (to /", "/src/nowhere); expected the "
                                        "tokenizer file or none")),
    "tokenizer_config.json a folder": Case(hf_special("tokenizer_config.json", "folder"), FormatError,
                                           ("src/tokenizer_config.json: is a folder; expected a tokenizer side file or none",)),
    "config.json a link to a device": Case(hf_special("config.json", "device", dtype="fp32"), ConfigError,
                                           ("src/config.json: is not a regular file (a FIFO, socket or device); a "
                                            "transformers model folder needs its config.json file",)),
    "model.safetensors a fifo": Case(hf_special("model.safetensors", "fifo", dtype="fp32"), FormatError,
                                     ("src/model.safetensors: is not a regular file (a FIFO, socket or device); expected "
                                      "the weights",)),
    "tokenizer not json": Case(hf_file("tokenizer.json", b"{oops"), FormatError,
                               ("src/tokenizer.json: not a readable tokenizer",)),
    "tokenizer not utf-8": Case(hf_file("tokenizer.json", b"\xff\xfe{}", dtype="int8"), FormatError,
                                ("src/tokenizer.json: not a readable tokenizer (not UTF-8",)),
    "tokenizer empty": Case(hf_file("tokenizer.json", b"", dtype="int4"), FormatError,
                            ("src/tokenizer.json: not a readable tokenizer",)),
    # config.json
    "config not json": Case(lambda work, fx: _broken_config(work, fx, b"{not json"), ConfigError, ("config.json", "JSON")),
    "config missing field": Case(hf(edit_config=lambda c: c.pop("hidden_size")), ConfigError,
                                 ("missing required field 'hidden_size'",)),
    "heads vs kv heads": Case(hf(edit_config=lambda c: c.update(num_key_value_heads=3)), ConfigError,
                              ("not a multiple of num_key_value_heads",)),
    "layer_types length": Case(hf(edit_config=lambda c: c.update(layer_types=c["layer_types"][:2])), ConfigError,
                               ("layer_types has 2 entries but num_hidden_layers is 4",)),
    "vocab vs table rows": Case(hf(edit_config=lambda c: c.update(vocab_size=100)), FormatError,
                                (EMBED, "expected [100, 64]")),
    "window zero": Case(hf(edit_config=lambda c: c.update(sliding_window=0)), ConfigError, ("sliding_window",)),
    "unknown architecture": Case(hf(edit_config=lambda c: c.update(model_type="llama")), ConfigError, ("model_type is 'llama'",)),
    "config is a list": Case(lambda work, fx: _broken_config(work, fx, b"[1, 2, 3]"), ConfigError, ("config.json: expected a JSON object, found [1, 2, 3]",)),
    "no config": Case(lambda work, fx: _broken_config(work, fx, None), ConfigError, ("config.json: missing",)),
    # GGUF
    "gguf bad magic": Case(gguf_file(lambda b: b"GGUX" + b[4:]), FormatError, ("model.gguf", "bad magic")),
    "gguf version": Case(gguf_file(lambda b: b[:4] + struct.pack("<I", 7) + b[8:]), FormatError, ("GGUF version 7",)),
    "gguf tensor count": Case(gguf_file(lambda b: b[:8] + struct.pack("<Q", 2**62) + b[16:]), FormatError, ("4611686018427387904 tensors", "limits 1048576")),
    "gguf kv count": Case(gguf_file(lambda b: b[:16] + struct.pack("<Q", 2**62) + b[24:]), FormatError, ("metadata entries",)),
    "gguf key length": Case(gguf_file(lambda b: b[:24] + struct.pack("<Q", 2**40) + b[32:]), FormatError, ("metadata key #0 is 1099511627776 bytes long, limit 16777216",)),
    "gguf truncated header": Case(gguf_file(lambda b: b[:20]), FormatError, ("too short",)),
    "gguf truncated data": Case(gguf_file(lambda b: b[:-64]), FormatError, ("truncated",)),
    "gguf unknown type": Case(gguf_file(_gguf_type(4242)), FormatError, ("blk.0.ffn_up.weight", "unknown ggml type 4242")),
    "gguf misaligned data": Case(gguf_file(_gguf_offset(1)), FormatError, ("blk.0.ffn_up.weight", "not a multiple of 32")),
    "gguf dim past the limit": Case(gguf_file(_gguf_dim(2**40)), FormatError, ("token_embd.weight", "elements, limit")),
    "gguf dim not a block multiple": Case(gguf_file(_gguf_dim_of(b"blk.0.ffn_up.weight", 100)), FormatError,
                                          ("blk.0.ffn_up.weight", "first dim 100 is not a multiple")),
    # reference MLIR + archive
    "mlir global without key": Case(mlir(lambda lines, archive: archive.pop("t8")), FormatError,
                                    ("global @t8 is bound to key 't8', which",)),
    "mlir key without global": Case(mlir(lambda lines, archive: archive.update(extra=np.zeros(3, np.uint16))), FormatError,
                                    ("key 'extra' has no util.global",)),
    "mlir shape vs bytes": Case(mlir(_line(2, "64xbf16", "32xbf16")), FormatError, ("key 't8' holds BF16 [64] (128 bytes)",)),
    "mlir dtype vs bytes": Case(mlir(_line(2, "64xbf16", "64xf32")), FormatError, ("key 't8' holds BF16",)),
    "mlir unknown element type": Case(mlir(_line(2, "64xbf16", "64xf64")), FormatError, ("element type 'f64'",)),
    "mlir dynamic dim": Case(mlir(_line(2, "64xbf16", "?xbf16")), FormatError, ("dimension '?'",)),
    "mlir no archive": Case(mlir(remove_archive=True), SourceNotFoundError, ("no archive beside it (expected gemma.safetensors)",)),
    "mlir int8 scale per column": Case(mlir(lambda lines, archive: archive.update(t0_scale=np.ones(64, np.float32)),
                                            dtype="int8"), FormatError, ("key 't0_scale' holds F32 [64]", "declares tensor<96xf32>")),
    # where the output goes
    "output inside the source": Case(lambda work, fx: _inside_source(work, fx), OutputError, ("inside the source",)),
    "output is a file": Case(existing_output(lambda work: (work / "out").write_text("x")), OutputError,
                             ("exists and is not a folder",)),
    "output is a foreign folder": Case(existing_output(lambda work: ((work / "out").mkdir(), (work / "out" / "notes.txt").write_text("mine"))),
                                       OutputError, ("not an unchanged export of gemma-export",)),
    "output has someone else's manifest.json": Case(existing_output(lambda work: ((work / "out").mkdir(),
                                                                           (work / "out" / "manifest.json").write_text('{"name": "my web app"}'),
                                                                           (work / "out" / "index.html").write_text("<html>"))),
                                                    OutputError, ("not an unchanged export of gemma-export",)),
    "output is an export with a user's file added": Case(lambda work, fx: _export_plus_notes(work, fx), OutputError,
                                                         ("not an unchanged export of gemma-export",)),
    "output is the source file": Case(lambda work, fx: _output_is_source(work, fx), OutputError, ("m.gguf: is the source itself",)),
    "source file inside the output folder": Case(lambda work, fx: _source_inside_output(work, fx), OutputError,
                                                 ("lies inside this folder",)),
    # export folders given to generate / verify
    "data outside the folder": Case(export_copy(_relocate("../model.onnx.data"), _generate), FormatError,
                                    ("'../model.onnx.data'", "model's own folder")),
    "data at an absolute path": Case(export_copy(_relocate("/etc/passwd"), _generate), FormatError, ("'/etc/passwd'",)),
    "data file is a link (generate)": Case(export_copy(_symlink_data, _generate), FormatError, ("model.onnx.data", "is a link")),
    "data file is a link (verify)": Case(export_copy(_symlink_data, _verify), VerificationError, ("model.onnx.data: is a link",)),
    "manifest a link to a device": Case(export_copy(lambda f: ((f / "manifest.json").unlink(),
                                                             (f / "manifest.json").symlink_to("/dev/zero")), _verify),
                                        VerificationError, ("manifest.json: is not a regular file", "expected the "
                                                            "export's manifest file")),
    "export tokenizer a link to a device": Case(export_copy(lambda f: ((f / "tokenizer.json").unlink(),
                                                                     (f / "tokenizer.json").symlink_to("/dev/zero")), _generate),
                                                FormatError, ("tokenizer.json: is not a regular file",)),
    "export tokenizer a broken link (parity)": Case(export_copy(lambda f: ((f / "tokenizer.json").unlink(),
                                                                         (f / "tokenizer.json").symlink_to(f / "nope")),
                                                               lambda f: ["parity", "--model", f, "--new-tokens", 2]),
                                                   FormatError, ("tokenizer.json: is a broken link (to ", "nope); expected the tokenizer file",)),
    "data file truncated": Case(export_copy(_truncate("model.onnx.data", 1000), _generate), FormatError,
                                ("model.onnx.data: 1,000 bytes, but", "manifest.json records", "the folder changed after the export")),
    "data file truncated, no manifest": Case(export_copy(lambda f: (_truncate("model.onnx.data", 1000)(f),
                                                                    (f / "manifest.json").unlink()), _generate),
                                             FormatError, ("model.onnx.data", "lies outside the file's 1000 bytes")),
    "model file garbage": Case(export_copy(_write("model.onnx", b"\x08\x07garbage" * 10), _generate), FormatError,
                               ("model.onnx", "not a readable ONNX model")),
    "manifest dtype edited": Case(export_copy(lambda f: (f / "manifest.json").write_text(
                                      (f / "manifest.json").read_text().replace('"dtype": "int8"', '"dtype": "int4"')), _verify),
                                  VerificationError, ('field \'dtype\' is "int4", but the graph stores int8 weights',)),
    "manifest dtype edited (parity)": Case(export_copy(_manifest_field(None, "dtype", "int4"),
                                                       lambda f: ["parity", "--model", f, "--new-tokens", 2]),
                                           FormatError, ('field \'dtype\' is "int4", but the graph stores int8 weights',)),
    "manifest block size not the graph's (verify)": Case(export_copy(_manifest_field("quantization", "block_size", 64), _verify),
                                                        VerificationError, ("field 'quantization.block_size' is 64, but the "
                                                                            "layers' MatMulNBits have block_size 16",)),
    "manifest scale dtype not the graph's (generate)": Case(
        export_copy(_manifest_field("quantization", "scale_dtype", "float16"), _generate),
        FormatError, ("field 'quantization.scale_dtype' is \"float16\", but the MatMulNBits scales are stored as float32",)),
    "manifest residual not the graph's (verify)": Case(
        export_copy(_manifest_field("quantization", "activation_residual", True), _verify),
        VerificationError, ("field 'quantization.activation_residual' is true, but the layers' MatMulNBits outputs are "
                            "used as they are",)),
    "manifest quantization a list (generate)": Case(export_copy(_manifest_field(None, "quantization", [1]), _generate),
                                                    FormatError, ("field 'quantization' must be an object or null, found [1]",)),
    "manifest quantization empty list (verify)": Case(export_copy(_manifest_field(None, "quantization", []), _verify),
                                                      VerificationError, ("field 'quantization' must be an object or null, "
                                                                          "found []",)),
    # JSON 16.0 and false are not the graph's 16 and 0: compared with their types (review finding)
    "manifest block size a float (verify)": Case(export_copy(_manifest_field("quantization", "block_size", 16.0), _verify),
                                                 VerificationError, ("field 'quantization.block_size' is 16.0, but the "
                                                                     "layers' MatMulNBits have block_size 16",)),
    "manifest rotation false (verify)": Case(export_copy(_manifest_field("quantization", "hadamard_size", False), _verify),
                                             VerificationError, ("field 'quantization.hadamard_size' is false, but",)),
    "manifest all_logits not the graph's (verify)": Case(export_copy(_manifest_field(None, "all_logits", True), _verify),
                                                         VerificationError, ("field 'all_logits' is true, but the graph's logits "
                                                                             "are the last position's only",)),
    "manifest debug_outputs not the graph's (generate)": Case(export_copy(_manifest_field(None, "debug_outputs", True), _generate),
                                                              FormatError, ("field 'debug_outputs' is true, but the graph has no "
                                                                            "debug.* outputs",)),
    "manifest shared buffer a string (generate)": Case(
        export_copy(_manifest_field("kv_cache", "past_present_share_buffer", "yes"), _generate),
        FormatError, ("field 'kv_cache.past_present_share_buffer' must be true or false", 'found "yes"')),
    "manifest kv_cache a string (verify)": Case(export_copy(_manifest_field(None, "kv_cache", "x"), _verify),
                                                VerificationError, ('field \'kv_cache\' must be an object, found "x"',)),
    "manifest layer type unknown (verify)": Case(
        export_copy(_manifest_field("config", "layer_types", ["bogus"] * 4), _verify),
        VerificationError, ("field 'config.layer_types' must be a list of 'sliding_attention' and 'full_attention'",
                            'found ["bogus"')),
    "manifest rope parameters a string (verify)": Case(export_copy(_manifest_field("config", "rope_parameters", "x"), _verify),
                                                       VerificationError, ("field 'config.rope_parameters' must be an object",)),
    "manifest untied, graph tied (verify)": Case(export_copy(_manifest_field(None, "tie_word_embeddings", False), _verify),
                                                 VerificationError, ("field 'tie_word_embeddings' is false, but the graph "
                                                                     "stores one table, shared by the lookup and the head",)),
    "manifest without dtype (verify)": Case(export_copy(_manifest_field(None, "dtype", DELETE), _verify), VerificationError, ("no field 'dtype'; expected int8",)),
    "manifest sliding window a string (generate)": Case(export_copy(_manifest_field("config", "sliding_window", "6"), _generate),
                                                        FormatError, ("field 'config.sliding_window' must be a positive "
                                                                      "integer", 'found "6"')),
    "manifest rms_norm_eps a string (verify)": Case(export_copy(_manifest_field("config", "rms_norm_eps", "abc"), _verify),
                                                    VerificationError, ("field 'config.rms_norm_eps' must be a positive "
                                                                        "finite number", 'found "abc"')),
    # probe findings (2026-12-06): values the exporter refuses in a source's config.json passed verify
    "manifest query_pre_attn_scalar negative (verify)": Case(
        export_copy(_manifest_field("config", "query_pre_attn_scalar", -16), _verify),
        VerificationError, ("field 'config.query_pre_attn_scalar' must be a positive finite number", "found -16")),
    "manifest final_logit_softcapping negative (generate)": Case(
        export_copy(_manifest_field("config", "final_logit_softcapping", -3), _generate),
        FormatError, ("field 'config.final_logit_softcapping' must be a positive finite number or null", "found -3")),
    "manifest rope_theta negative (verify)": Case(
        export_copy(_manifest_field("config", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": -5},
                                                                  "sliding_attention": {"rope_type": "default",
                                                                                        "rope_theta": 10000.0}}), _verify),
        VerificationError, ("field 'config.rope_parameters.full_attention.rope_theta' must be a positive finite number, "
                            "found -5",)),
    "manifest rope entry a number (generate)": Case(
        export_copy(_manifest_field("config", "rope_parameters", {"full_attention": 5}), _generate),
        FormatError, ("field 'config.rope_parameters.full_attention' must be an object, found 5",)),
    "manifest config null (generate)": Case(export_copy(_manifest_field(None, "config", None), _generate),
                                            FormatError, ("field 'config' must be an object, found null",)),
    "manifest without config (generate)": Case(
        export_copy(_manifest_field(None, "config", DELETE), _generate),
        FormatError, ("manifest.json: no field 'config' (an object); every export of gemma-export records its model "
                      "config there",)),
    "manifest head_dim 0 (verify)": Case(export_copy(_manifest_field("config", "head_dim", 0), _verify),
                                         VerificationError, ("field 'config.head_dim' must be a positive integer", "found 0")),
    "manifest head_dim not the graph's (verify)": Case(export_copy(_manifest_field("config", "head_dim", 48), _verify),
                                                       VerificationError, ("field 'config.head_dim' is 48, but the graph has 16",)),
    "manifest kv heads not the graph's (verify)": Case(export_copy(_manifest_field("config", "num_key_value_heads", 3), _verify),
                                                       VerificationError, ("config.num_key_value_heads' is 3, but the graph has 2",)),
    "manifest head_dim not the graph's (generate)": Case(export_copy(_manifest_field("config", "head_dim", 48), _generate),
                                                         FormatError, ("field 'config.head_dim' is 48, but the graph has 16",)),
    "manifest bos outside the vocabulary (verify)": Case(export_copy(_manifest_field("config", "bos_token_id", 500), _verify),
                                                         VerificationError, ("field 'config.bos_token_id' is 500, outside the "
                                                                             "graph's vocabulary (ids 0 to 95)",)),
    "manifest all_logits a string (verify)": Case(export_copy(_manifest_field(None, "all_logits", "yes"), _verify),
                                                  VerificationError, ("field 'all_logits' must be true or false", 'found "yes"')),
    "manifest sliding window negative (verify)": Case(export_copy(_manifest_field("config", "sliding_window", -3), _verify),
                                                      VerificationError, ("field 'config.sliding_window'", "found -3")),
    "cache beyond memory, no max positions (generate)": Case(
        export_copy(_manifest_field("config", "max_position_embeddings", DELETE),
                    lambda f: ["generate", "--model", f, "--prompt", "hi", "--max-new-tokens", 10 ** 12]),
        ResourceError, ("KV cache: 1,000,000,000,002 positions", "ask for fewer tokens")),
    # quality reads max_position_embeddings before the session load: an edited value must not crash it
    "manifest config a list (quality)": Case(export_copy(_manifest_field(None, "config", ["x"]),
                                                         lambda f: ["quality", "--model", f, "--reference", f]),
                                             FormatError, ("field 'config'",)),
    "manifest max positions a string (quality)": Case(
        export_copy(_manifest_field("config", "max_position_embeddings", "64"),
                    lambda f: ["quality", "--model", f, "--reference", f]),
        FormatError, ("field 'config.max_position_embeddings'", 'found "64"')),
    "manifest without config (verify)": Case(export_copy(_manifest_field(None, "config", DELETE), _verify),
                                             VerificationError, ("no field 'config' (an object)",)),
    "manifest garbage": Case(export_copy(_write("manifest.json", b"{oops"), _verify), VerificationError, ("unreadable manifest",)),
    "manifest not UTF-8 (generate)": Case(export_copy(_write("manifest.json", b"\xff{}"), _generate), FormatError,
                                          ("manifest.json: unreadable manifest: expected UTF-8 text, found byte 0xff at offset 0",)),
    "manifest files of the wrong kind": Case(export_copy(_write("manifest.json", b'{"files": {"model.onnx": "abc"}}'), _verify),
                                             VerificationError, ("files['model.onnx'] needs an integer 'bytes'",)),
    # JSON true is an int to Python: not a size
    "manifest size true (verify)": Case(export_copy(_manifest_field("files", "model.onnx", {"bytes": True, "sha256": "0" * 64}),
                                                    _verify), VerificationError, ("files['model.onnx'] needs an integer 'bytes'",)),
    "manifest size negative (verify)": Case(export_copy(_manifest_field("files", "model.onnx", {"bytes": -1, "sha256": "0" * 64}),
                                                        _verify), VerificationError, ("files['model.onnx'] needs an integer 'bytes' (>= 0)",)),
    "manifest lists a path (verify)": Case(export_copy(_manifest_field("files", "sub/model.onnx", {"bytes": 1, "sha256": "0" * 64}),
                                                       _verify), VerificationError, ("lists 'sub/model.onnx', which is not a file name in the folder",)),
    "manifest a list (verify)": Case(export_copy(_write("manifest.json", b"[1, 2]"), _verify), VerificationError,
                                     ("expected a JSON object, found [1, 2]",)),
    "prompt not UTF-8": Case(export_copy(lambda f: None, lambda f: ["generate", "--model", f, "--prompt", "ab\udcffc"]),
                             GemmaExportError, ("--prompt: expected UTF-8 text", "at character 2")),
    "text not UTF-8 (quality)": Case(export_copy(_write("bad.txt", b"some text \xff\xfe more"),
                                                 lambda f: ["quality", "--model", f, "--reference", f, "--text", f / "bad.txt"]),
                                     FormatError, ("bad.txt: expected UTF-8 text, found byte 0xff at offset 10",)),
    "threads far above the CPUs": Case(export_copy(lambda f: None, lambda f: [*_generate(f), "--threads", 100000]),
                                       GemmaExportError, ("--threads 100000: expected 1 to", "CPUs")),
    "tokenizer.json a folder (generate)": Case(export_copy(lambda f: ((f / "tokenizer.json").unlink(), (f / "tokenizer.json").mkdir()),
                                                           _generate), FormatError, ("tokenizer.json: is a folder",)),
    "manifest.json a folder (verify)": Case(export_copy(lambda f: ((f / "manifest.json").unlink(), (f / "manifest.json").mkdir()),
                                                        _verify), VerificationError, ("manifest.json: is a folder",)),
    "manifest.json a folder (generate)": Case(export_copy(lambda f: ((f / "manifest.json").unlink(), (f / "manifest.json").mkdir()),
                                                          _generate), FormatError, ("manifest.json: unreadable manifest: it is a folder",)),
    "manifest vocab contradicts the graph (verify)": Case(export_copy(_manifest_field("config", "vocab_size", 1), _verify),
                                                          VerificationError, ("field 'config.vocab_size' is 1, but the graph has",)),
    "manifest layers contradict the graph (generate)": Case(export_copy(_manifest_field("config", "num_hidden_layers", 17), _generate),
                                                            FormatError, ("field 'config.num_hidden_layers' is 17, but the graph has",)),
    "manifest huge max positions (verify)": Case(export_copy(_manifest_field("config", "max_position_embeddings", 10 ** 29), _verify),
                                                 VerificationError, ("below 2**31",)),
    "manifest dtype a megabyte (verify)": Case(export_copy(_manifest_field(None, "dtype", "x" * 1_000_000), _verify),
                                               VerificationError, ("field 'dtype' must be one of", '"xxxx', "...")),
    "text is a folder (quality)": Case(export_copy(lambda f: (f / "adir").mkdir(),
                                                   lambda f: ["quality", "--model", f, "--reference", f, "--text", f / "adir"]),
                                       SourceNotFoundError, ("adir: is a folder; expected a text file",)),
    # a data file larger than the manifest records (another export's copied in) is named, not run
    "data file grown (generate)": Case(export_copy(lambda f: (f / "model.onnx.data").open("ab").write(b"\0" * 4096),
                                                   _generate), FormatError,
                                       ("model.onnx.data:", "bytes, but", "records", "the folder changed after the export")),
    "data file hard-linked (verify)": Case(export_copy(lambda f: os.link(f / "model.onnx.data", f.parent / "backup.data"), _verify),
                                           VerificationError, ("model.onnx.data: has 2 hard links", "cp, not ln")),
    "manifest files a string (verify)": Case(export_copy(_manifest_field(None, "files", "abc"), _verify), VerificationError,
                                             ("field 'files' must be an object", 'found "abc"')),
    # the runtime's cheap size check of the data file reads 'files': a damaged one is named, not skipped
    "manifest files a list (generate)": Case(export_copy(_manifest_field(None, "files", []), _generate), FormatError,
                                             ("field 'files' must be an object", "found []")),
    "manifest data size a string (generate)": Case(export_copy(_manifest_field("files", "model.onnx.data", {"bytes": "12"}),
                                                               _generate), FormatError,
                                                   ("files['model.onnx.data'] needs an integer 'bytes' (>= 0)", '"bytes": "12"')),
    # the runtime accepted what verify refuses: no files at all, an entry without its sha256
    "manifest files empty (generate)": Case(export_copy(_manifest_field(None, "files", {}), _generate), FormatError,
                                            ("field 'files' must be an object of file name -> bytes and sha256", "found {}")),
    "manifest data entry without sha256 (generate)": Case(export_copy(_manifest_field("files", "model.onnx.data", {"bytes": 1}),
                                                                      _generate), FormatError,
                                                          ("files['model.onnx.data'] needs an integer 'bytes' (>= 0) and a "
                                                           "string 'sha256'",)),
    "manifest eos a string (generate)": Case(export_copy(_manifest_field("config", "eos_token_id", "x"), _generate),
                                             FormatError, ("field 'config.eos_token_id' must be a token id", 'found "x"')),
    "manifest max positions a string (generate)": Case(export_copy(_manifest_field("config", "max_position_embeddings", "abc"),
                                                                   _generate), FormatError,
                                                       ("field 'config.max_position_embeddings' must be a positive integer",)),
    "manifest dtype unknown (verify)": Case(export_copy(_manifest_field(None, "dtype", "int3"), _verify), VerificationError,
                                            ("field 'dtype' must be one of fp32, bf16, int8, int4, found \"int3\"",)),
    "manifest negative bos (verify)": Case(export_copy(_manifest_field("config", "bos_token_id", -5), _verify),
                                           VerificationError, ("field 'config.bos_token_id'", "found -5")),
    "inspect an empty .onnx": Case(plain(lambda w: ["inspect", w / "empty.onnx"], _file("empty.onnx", b"")), FormatError,
                                   ("empty.onnx: not an ONNX model: the file is empty",)),
    "dedupe an empty .onnx": Case(plain(lambda w: ["dedupe", w / "empty.onnx", "--out", w / "d"], _file("empty.onnx", b"")),
                                  FormatError, ("empty.onnx: not an ONNX model: the file is empty",)),
    "dedupe a folder": Case(plain(lambda w: ["dedupe", w, "--out", w / "d"]), SourceNotFoundError,
                            ("is a folder; expected a model file (.onnx)",)),
    "dedupe a text file": Case(plain(lambda w: ["dedupe", w / "t.txt", "--out", w / "d"], _file("t.txt", b"hello")), FormatError,
                               ("t.txt: dedupe rewrites ONNX models; expected an .onnx file, found '.txt'",)),
    "inspect a folder": Case(plain(lambda w: ["inspect", w]), SourceNotFoundError,
                             ("is a folder; expected", "or a folder with model.onnx or one .onnx")),
    "manifest not an object (generate)": Case(export_copy(_write("manifest.json", b"[1]"), _generate), FormatError,
                                              ("manifest.json", "unreadable manifest")),
    "prompt past max positions": Case(export_copy(lambda f: None, lambda f: ["generate", "--model", f, "--prompt", "ab" * 115,
                                                                              "--max-new-tokens", "32"]),
                                      GemmaExportError, ("model: a sequence of 262 tokens", "exceeds the model's max_position_embeddings 256")),
    # refused after tokenizing a prefix (a 22.5 MB prompt given to generate() took 47.6 s and 2.2 GB to be refused)
    "prompt longer than max positions": Case(export_copy(lambda f: None, lambda f: ["generate", "--model", f, "--prompt", "ab" * 200]),
                                             GemmaExportError, ("model: the prompt: more than 256 tokens, the model's "
                                                                "max_position_embeddings; give a shorter prompt",)),
    # other commands
    "inspect garbage": Case(plain(lambda w: ["inspect", w / "x.bin"], _file("x.bin", b"\x00" * 64)), FormatError, ("x.bin: not an ONNX, safetensors, GGUF or reference MLIR file",)),
    "inspect onnx garbage": Case(plain(lambda w: ["inspect", w / "m.onnx"], _file("m.onnx", b"\xff" * 64)), FormatError,
                                 ("m.onnx", "not a readable ONNX model")),
    "bad block size": Case(plain(lambda w: ["--source", w, "--out", w / "out", "--dtype", "int8", "--block-size", 24]),
                           ConfigError, ("--block-size 24",)),
    "int4 option on int8": Case(plain(lambda w: ["--source", w, "--out", w / "out", "--dtype", "int8", "--table-dtype", "int8"]),
                                ConfigError, ("--table-dtype",)),
    "calibrate without a tokenizer": Case(calibration("int8", "--calibrate"), ConfigError,
                                          ("--calibrate needs a tokenizer", "this source has none")),
    # the value options alone imply calibration: refused under their own name, not ignored
    "calibration tokens without a tokenizer": Case(calibration("int8", "--calibration-tokens", 512), ConfigError,
                                                   ("--calibration-tokens needs a tokenizer", "export without --calibration-tokens")),
    "calibration text without a tokenizer": Case(calibration("int4", "--calibration-text", "t.txt",
                                                             setup=_file("t.txt", b"some text")), ConfigError,
                                                 ("--calibration-text needs a tokenizer",)),
    "calibrate fp32": Case(calibration("fp32", "--calibrate"), ConfigError, ("--calibrate applies to --dtype int8 and int4, not fp32",)),
    "no-calibrate bf16": Case(calibration("bf16", "--no-calibrate"), ConfigError,
                              ("--no-calibrate applies to --dtype int8 and int4, not bf16",)),
    "calibration text on bf16": Case(calibration("bf16", "--calibration-text", "t.txt", setup=_file("t.txt", b"some text")),
                                     ConfigError, ("--calibration-text applies to --dtype int8 and int4, not bf16",)),
    "calibration text with no-calibrate": Case(calibration("int8", "--no-calibrate", "--calibration-text", "t.txt",
                                                           setup=_file("t.txt", b"some text")),
                                               ConfigError, ("--calibration-text", "--no-calibrate")),
    "calibration tokens on bf16": Case(calibration("bf16", "--calibration-tokens", 512), ConfigError,
                                       ("--calibration-tokens applies to --dtype int8 and int4, not bf16",)),
    "calibration tokens with no-calibrate": Case(calibration("int8", "--no-calibrate", "--calibration-tokens", 512),
                                                 ConfigError, ("--calibration-tokens", "--no-calibrate")),
    "calibration tokens too many": Case(calibration("int8", "--calibration-tokens", 99999999), ConfigError,
                                        ("--calibration-tokens 99999999: expected 16 to 16,384",)),
    "calibration tokens too few": Case(calibration("int8", "--calibration-tokens", 5), ConfigError,
                                       ("--calibration-tokens 5: expected 16 to 16,384",)),
    "calibration text is a folder": Case(calibration("int8", "--calibration-text", "d.txt", setup=lambda w: (w / "d.txt").mkdir()),
                                         SourceNotFoundError, ("d.txt: is a folder; expected a calibration text file",)),
    "calibration text missing": Case(calibration("int8", "--calibration-text", "nope.txt"), SourceNotFoundError,
                                     ("nope.txt: no such calibration text file",)),
    "calibration text empty": Case(calibration("int4", "--calibration-text", "e.txt", setup=_file("e.txt", b" \n\n")),
                                   ConfigError, ("e.txt: the calibration text is empty",)),
    "calibration text not utf-8": Case(calibration("int8", "--calibration-text", "b.txt", setup=_file("b.txt", b"\xff\xfe\x00\xd8")),
                                       FormatError, ("b.txt: expected UTF-8 text, found byte 0xff at offset 0",)),
    "parity golden not json": Case(export_copy(_write("golden.json", b"[1, 2"), _parity_golden("golden.json")),
                                   FormatError, ("golden.json: not JSON",)),
    "parity golden without ids": Case(export_copy(_write("golden.json", b'[{"prompt_ids": [2, 3]}]'),
                                                  _parity_golden("golden.json")),
                                      FormatError, ("entry #0 needs 'expected_ids'",)),
    "parity golden negative id": Case(export_copy(_write("golden.json", b'{"prompt_ids": [2], "expected_ids": [-4]}'),
                                                  _parity_golden("golden.json")),
                                      FormatError, ("'expected_ids' must be a non-empty list of token ids",)),
    "parity prompts of another kind": Case(export_copy(_write("p.json", b'[{"x": 1}]'),
                                                       _parity_golden("p.json", "--prompts", "p.json")),
                                           FormatError, ("p.json: prompt #0 is neither text nor a non-empty list of token ids",)),
    "parity prompts one bare id list": Case(export_copy(_write("p.json", b'[2, 818, 5279]'),
                                                        _parity_golden("p.json", "--prompts", "p.json")),
                                            FormatError, ("p.json: prompt #0 is neither text nor a non-empty list of "
                                                          "token ids: 2; the file holds one list of 3 numbers: for one "
                                                          "prompt of ids, wrap it in a list ([[2, 818, 5279]])",)),
    "parity reference not mlir": Case(export_copy(_write("ref.mlir", b"module {}\n"),
                                                  lambda f: ["parity", "--model", f, "--reference", f / "ref.mlir"]),
                                      FormatError, ("ref.mlir", "no util.global")),
    "parity reference truncated archive": Case(parity_reference(edit_archive=lambda b: b[:-10]), FormatError,
                                               ("gemma.safetensors", "lies outside")),
    "parity reference unknown signature": Case(parity_reference(edit_mlir=lambda t: t.replace("tensor<1x24xi32>", "tensor<1x24xf32>")),
                                               FormatError, ("gemma.mlir: no public re-decode function tensor<1xSxi32> -> tensor<Sxi32> (found @gemma",)),
    "parity reference global without key": Case(parity_reference(edit_mlir=lambda t: t.replace('"model"::"t8"', '"model"::"t8x"')),
                                                FormatError, ("global @t8 is bound to key 't8x', which",)),
    "parity prompt id outside the vocabulary": Case(export_copy(lambda f: ((f / "p.json").write_text("[[2, 300000]]"),
                                                                           (f / "g.json").write_text("[1]")),
                                                                _parity_golden("g.json", "--prompts", "p.json")),
                                                    FormatError, ("p.json: prompt #0: token id 300000 is outside",)),
    "parity huge prompt id": Case(export_copy(_write("g.json", b'{"prompt_ids": [2, 1000000000000000000000000000000], "expected_ids": [1]}'),
                                              _parity_golden("g.json")),
                                  FormatError, ("g.json: entry #0: token id 1000000000000000000000000000000 is outside",)),
    "parity expected id outside the vocabulary": Case(export_copy(_write("g.json", b"[9223372036854775807]"),
                                                                  _parity_golden("g.json")),
                                                      FormatError, ("token id 9223372036854775807 is outside",)),
    "parity broken tokenizer": Case(export_copy(lambda f: ((f / "tokenizer.json").write_bytes(b"{oops"),
                                                           (f / "g.json").write_text("[1]")), _parity_golden("g.json")),
                                    FormatError, ("tokenizer.json: not a readable tokenizer",)),
    "bench on a file": Case(plain(lambda w: ["bench", "--model", w / "afile"], _file("afile", b"x")), SourceNotFoundError,
                            ("afile: is a file; expected an export folder",)),
    "quality on a file": Case(plain(lambda w: ["quality", "--model", w / "afile", "--reference", w / "afile"],
                                    _file("afile", b"x")), SourceNotFoundError, ("afile: is a file; expected an export folder",)),
    "parity golden of strings": Case(export_copy(_write("g.json", b'["a", "b"]'), _parity_golden("g.json")),
                                     FormatError, ("expected a list of token ids, an object or a list of objects",)),
    "parity --json is a folder": Case(export_copy(lambda f: (f / "out.json").mkdir(),
                                                  _parity_golden("manifest.json", "--json", "out.json")),
                                      OutputError, ("--json", "is a folder")),
    "corrupt tokenizer.json": Case(export_copy(_write("tokenizer.json", b"not json"), _generate), FormatError,
                                   ("tokenizer.json: not a readable tokenizer",)),
    "model folder is a file": Case(export_copy(lambda f: None, lambda f: ["generate", "--model", f / "model.onnx", "--prompt", "a"]),
                                   SourceNotFoundError, ("is a file; expected an export folder",)),
    "bench bad lengths": Case(export_copy(lambda f: None, lambda f: ["bench", "--model", f, "--prompt-tokens", "16,x"]),
                              GemmaExportError, ("--prompt-tokens", "'16,x'")),
    "generate prefill chunk -1": Case(export_copy(lambda f: None, lambda f: _generate(f) + ["--prefill-chunk", -1]),
                                      GemmaExportError, ("--prefill-chunk", ">= 1", "0 on the command line", "found -1")),
    "generate NaN logits": Case(export_copy(_nan_table, _generate), NumericError,
                                ("model/model.onnx: logits: step 0 picked token", "nan",
                                 "the export does not compute finite logits")),
    # the reference's rows are checked first; the message named neither model ("logits: the reference's row 0")
    "quality NaN logits": Case(export_copy(_nan_table, lambda f: ["quality", "--model", f, "--reference", f, "--tokens",
                                                                  "20"]),
                               NumericError, ("--reference ", "model: logits: the reference's row 0 holds NaN or Inf")),
    "bench NaN logits": Case(export_copy(_nan_table, lambda f: ["bench", "--model", f, "--prompt-tokens", "4",
                                                                "--new-tokens", "6"]),
                             NumericError, ("logits: step 0", "finite logits")),
    "bundle without a tokenizer": Case(export_copy(_no_tokenizer, lambda f: ["bundle", "--model", f, "--out", f.parent / "board",
                                                                             "--wheel", f.parent / "gemma_export-0.1.0-py3-none-any.whl"]),
                                       FormatError, ("model: no tokenizer.json", "the board could not run")),
    "bench prefill chunk -4": Case(export_copy(lambda f: None, lambda f: ["bench", "--model", f, "--prefill-chunk", -4]),
                                   GemmaExportError, ("--prefill-chunk", "found -4")),
}


def _broken_config(work: Path, fx: Fixtures, content: bytes | None) -> list:
    src = work / "src"
    shutil.copytree(fx.tiny_dir, src)
    if content is None:
        (src / "config.json").unlink()
    else:
        (src / "config.json").write_bytes(content)
    return _export_args(src, work)


def _export_plus_notes(work: Path, fx: Fixtures) -> list:
    shutil.copytree(fx.export_dir, work / "out")
    (work / "out" / "NOTES.txt").write_text("my notes")
    return _export_args(fx.tiny_dir, work)


def _source_inside_output(work: Path, fx: Fixtures) -> list:
    (work / "out").mkdir()
    (work / "out" / "model.gguf").write_bytes(fx.gguf_bytes)
    return _export_args(work / "out" / "model.gguf", work)


def _output_is_source(work: Path, fx: Fixtures) -> list:
    (work / "m.gguf").write_bytes(fx.gguf_bytes)
    return ["--source", work / "m.gguf", "--out", work / "m.gguf", "--dtype", "fp32"]


def _inside_source(work: Path, fx: Fixtures) -> list:
    src = work / "src"
    shutil.copytree(fx.tiny_dir, src)
    return ["--source", src, "--out", src / "out", "--dtype", "fp32"]


def _tree(folder: Path) -> dict[str, str]:
    """Every path under ``folder`` (links and folders included) with a digest of its content."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            if path.is_symlink():
                out[rel] = "link:" + os.readlink(path)
            elif path.is_file():
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input(fx, tmp_path, name):
    case = CASES[name]
    work = tmp_path / "work"
    work.mkdir()
    args = [str(a) for a in case.make(work, fx)]
    before = _tree(tmp_path)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for word in case.words:
        assert word in lines[0], lines[0]
    assert _tree(tmp_path) == before  # nothing written, nothing left, inputs unchanged
    debug = CliRunner().invoke(app, args + ["--debug"])
    assert type(debug.exception) is case.error or (case.error is GemmaExportError and isinstance(debug.exception, GemmaExportError)), \
        repr(debug.exception)
    assert _tree(tmp_path) == before


def test_tokenizer_side_files_as_hugging_face_writes_them_are_accepted(fx, tmp_path):
    """The typed-field checks refuse what breaks AutoTokenizer, not what transformers writes or takes:
    AddedToken objects with "__type", null tokens, named extra tokens, a string flag (review finding)."""
    added = {"__type": "AddedToken", "content": "<bos>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}
    config = {"add_bos_token": "yes", "add_eos_token": None, "bos_token": added, "eos_token": "<eos>",
              "pad_token": None, "unk_token": {"content": "<unk>"}, "extra_special_tokens": {"image_token": "<img>"},
              "additional_special_tokens": {"start_of_turn": "<start_of_turn>"}, "model_max_length": 1e30,
              "added_tokens_decoder": {"0": added, "106": {**added, "content": "<end_of_turn>"}},
              "tokenizer_class": "GemmaTokenizer"}
    special = {"bos_token": added, "additional_special_tokens": [added, "<end_of_turn>"]}
    src = broken_copy(fx.tiny_dir, tmp_path / "src", None, None)
    write_char_tokenizer(src)  # side files come with a tokenizer.json
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "special_tokens_map.json").write_text(json.dumps(special))
    result = CliRunner().invoke(app, [str(a) for a in _export_args(src, tmp_path, "fp32")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "out" / "tokenizer_config.json").read_text()) == config  # copied as it was


def test_code_and_templates_in_a_model_folder_are_never_run(fx, tmp_path):
    """A folder may carry `auto_map` code and a Jinja chat template; exporting it reads neither as
    code: the module that would leave a marker on import is never imported."""
    marker = tmp_path / "executed"
    src = broken_copy(fx.tiny_dir, tmp_path / "src", lambda c: c.update(
        auto_map={"AutoModelForCausalLM": "modeling_evil.EvilModel", "AutoConfig": "modeling_evil.EvilConfig"}))
    (src / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n")
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"}))
    result = CliRunner().invoke(app, [str(a) for a in _export_args(src, tmp_path)])
    assert result.exit_code == 0, result.output
    assert not marker.exists()
    assert "modeling_evil.py" not in os.listdir(tmp_path / "out")


def test_a_single_integer_eos_token_id_stops_generation(tiny_int8_export, tmp_path):
    """transformers configs may give ``eos_token_id`` as one integer: generation stops on it."""
    from gemma_export.runtime import OnnxDecoder

    folder = tmp_path / "model"
    shutil.copytree(tiny_int8_export, folder)
    free = OnnxDecoder(folder).greedy([2, 10, 11], 6, stop_ids=())[0]  # the model's tokens, no stop
    eos = free[2]
    _manifest_field("config", "eos_token_id", eos)(folder)
    decoder = OnnxDecoder(folder)
    assert decoder.eos_token_id == (eos,)
    assert decoder.greedy([2, 10, 11], 6)[0] == free[:free.index(eos) + 1]


@pytest.mark.parametrize("call, message", [
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="int8", block_size="32")),
     "export(): block_size must be an int or None, found str '32'"),
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="int8", block_size=np.int64(32))),
     "export(): block_size must be an int or None, found int64 np.int64(32) (a numpy integer: pass int(block_size))"),
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="int8", hadamard_size=64.0)),
     "export(): hadamard_size must be an int or None, found float 64.0"),
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="int8", calibrate="no")),
     "export(): calibrate must be True, False or None, found str 'no'"),  # a non-empty str is true
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="int4", symmetric=0)),
     "export(): symmetric must be True or False, found int 0"),
    (lambda src, out: ("export", dict(source="", out_dir=out)),
     "export(): source must be a path (str or os.PathLike) or None, found an empty str"),  # not the current folder
    (lambda src, out: ("export", dict(source=src, out_dir=5)),
     "export(): out_dir must be a path (str or os.PathLike) or None, found int 5"),
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype=8)),
     "export(): dtype must be a str, found int 8"),
    (lambda src, out: ("open_source", dict(source=5)),
     "open_source(): source must be a path (str or os.PathLike) or None, found int 5"),
    (lambda src, out: ("open_source", dict(source=src, tokenizer="no")),
     "open_source(): tokenizer must be True or False, found str 'no'"),
    # API probe (thirteenth session): these failed late (progress, after the graph was built) or
    # with Python's own words (a NUL: "embedded null byte", naming no argument)
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="fp32", progress=5)),
     "export(): progress must be a callable or None, found int 5"),
    (lambda src, out: ("export", dict(source=src, out_dir=out, dtype="fp32", checkpoint="x")),
     "export(): checkpoint must be a Checkpoint (open_source's) or None, found str 'x'"),
    (lambda src, out: ("export", dict(source="a\0b", out_dir=out)),
     "export(): source must be a path (str or os.PathLike) or None, found str 'a\\x00b' (a NUL character, which no "
     "path can hold)"),
    (lambda src, out: ("open_source", dict(source=Path("a\0b"))),
     "open_source(): source must be a path (str or os.PathLike) or None, found PosixPath PosixPath('a\\x00b') (a NUL "
     "character, which no path can hold)"),
])
def test_python_arguments_of_the_wrong_type_are_named_before_any_work(tiny_dir, tmp_path, call, message):
    import gemma_export

    name, kwargs = call(tiny_dir, tmp_path / "out")
    with pytest.raises(ConfigError) as raised:
        getattr(gemma_export, name)(**kwargs)
    assert str(raised.value) == message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=None), "generate(): prompt must be a str, found NoneType None"),
    (dict(prompt=b"hi"), "generate(): prompt must be a str, found bytes b'hi'"),
    (dict(prompt="hi", max_new_tokens=2.5), "generate(): max_new_tokens must be an int, found float 2.5"),
    (dict(prompt="hi", threads="2"), "generate(): threads must be an int or None, found str '2'"),
    (dict(prompt="hi", prefill_chunk="512"), "generate(): prefill_chunk must be an int or None, found str '512'"),
    (dict(prompt="hi", on_text=3), "generate(): on_text must be a callable or None, found int 3"),
])
def test_generate_names_an_argument_of_the_wrong_type_before_the_session(tiny_int8_export, monkeypatch, kwargs,
                                                                           message):
    import gemma_export
    from gemma_export import runtime

    monkeypatch.setattr(runtime, "OnnxDecoder", lambda *a, **k: pytest.fail("the session was created first"))
    with pytest.raises(ConfigError) as raised:
        gemma_export.generate(tiny_int8_export, **kwargs)
    assert str(raised.value) == message


def test_an_export_result_given_for_its_folder_is_named_with_the_fix(tiny_int8_export):
    # a fresh user's slip: generate(result, ...) showed the result's repr cut at 40 characters
    import dataclasses

    import gemma_export
    from gemma_export.exporter import ExportResult

    result = ExportResult(**{field.name: None for field in dataclasses.fields(ExportResult)} | {"out_dir": tiny_int8_export})
    with pytest.raises(ConfigError) as raised:
        gemma_export.generate(result, "hi")
    assert str(raised.value) == "generate(): model_dir must be a path (str or os.PathLike), found ExportResult (pass its out_dir)"


@pytest.mark.parametrize("name, args, kwargs, message", [
    ("inspect_path", (5,), {}, "inspect_path(): path must be a path (str or os.PathLike), found int 5"),
    ("run_parity", ("{model}",), dict(against_transformers="yes"),
     "run_parity(): against_transformers must be True or False, found str 'yes'"),
    ("run_quality", ("{model}",), dict(tokens="128"), "run_quality(): tokens must be an int or None, found str '128'"),
    ("run_bench", ("{model}",), dict(prompt_tokens="16,128"),
     "run_bench(): prompt_tokens must be a list, tuple or range of ints, found str '16,128'"),
    ("run_bench", ("{model}",), dict(prompt_tokens=(16, 128.0)),
     "run_bench(): prompt_tokens must be a list, tuple or range of ints, found tuple (16, 128.0)"),
    ("run_bench", ("{model}",), dict(prompt_tokens=[np.int64(16)]),
     "run_bench(): prompt_tokens must be a list, tuple or range of ints, found list [np.int64(16)] "
     "(numpy integers: pass [int(i) for i in prompt_tokens])"),
    ("write_bundle", ("{model}", ""), {}, "write_bundle(): out_dir must be a path (str or os.PathLike), found an empty str"),
    ("verify_manifest", (5,), {}, "verify_manifest(): folder must be a path (str or os.PathLike), found int 5"),
    ("verify_bundle", (None,), {}, "verify_bundle(): folder must be a path (str or os.PathLike), found NoneType None"),
    ("run_parity", ("{model}",), dict(golden="g.json", progress=1),
     "run_parity(): progress must be a callable or None, found int 1"),
    ("run_quality", ("{model}",), dict(progress="yes"), "run_quality(): progress must be a callable or None, found str 'yes'"),
    ("run_bench", ("{model}",), dict(progress=2), "run_bench(): progress must be a callable or None, found int 2"),
    ("write_bundle", ("{model}", "b"), dict(progress=2), "write_bundle(): progress must be a callable or None, found int 2"),
    ("dedupe", ("{model}/model.onnx", "d"), dict(progress=2), "dedupe(): progress must be a callable or None, found int 2"),
    ("dedupe", ("{model}/model.onnx", 5), {}, "dedupe(): out_dir must be a path (str or os.PathLike), found int 5"),
    ("OnnxDecoder", (None,), {}, "OnnxDecoder(): model_dir must be a path (str or os.PathLike), found NoneType None"),
    ("OnnxDecoder", ("{model}",), dict(threads="2"), "OnnxDecoder(): threads must be an int or None, found str '2'"),
    ("OnnxDecoder", ("{model}",), dict(threads=2.0), "OnnxDecoder(): threads must be an int or None, found float 2.0"),
    ("OnnxDecoder", ("{model}",), dict(prepacked=1), "OnnxDecoder(): prepacked must be True, False, None or a path, "
                                                     "found int 1"),
    ("OnnxDecoder", ("{model}",), dict(optimized_model_path="{model}"),
     "OnnxDecoder(): optimized_model_path {model} is a folder; expected the path of a file to write"),
])
def test_the_other_commands_functions_name_an_argument_of_the_wrong_type(tiny_int8_export, name, args, kwargs, message):
    import gemma_export

    def filled(value):
        return value.replace("{model}", str(tiny_int8_export)) if isinstance(value, str) else value

    from gemma_export.dedupe import dedupe
    from gemma_export.runtime import OnnxDecoder

    function = {"dedupe": dedupe, "OnnxDecoder": OnnxDecoder}.get(name) or getattr(gemma_export, name)
    args = tuple(map(filled, args))
    kwargs = {key: filled(value) for key, value in kwargs.items()}
    with pytest.raises(ConfigError) as raised:
        function(*args, **kwargs)
    assert str(raised.value) == filled(message)


def test_run_parity_with_nothing_to_compare_names_the_python_arguments(tiny_int8_export):
    import gemma_export

    with pytest.raises(GemmaExportError, match=r"^parity: nothing to compare; give --against transformers, --reference or "
                                               r"--golden \(in Python: against_transformers=True, reference= or golden=\)$"):
        gemma_export.run_parity(tiny_int8_export)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scale_method="foo"), "export(): scale_method must be mse or rtn, found 'foo'"),
    (dict(table_dtype="int2"), "export(): table_dtype must be int4 or int8, found 'int2'"),
    (dict(scale_dtype="bf16"), "export(): scale_dtype must be float32 or float16, found 'bf16'"),
    # the Python argument, not the command line's --dtype (a fresh user's finding)
    (dict(dtype="int9"), "export(): dtype must be one of fp32, bf16, int8, int4, found 'int9'"),
])
def test_an_unknown_choice_from_python_is_refused_before_the_source_is_read(tiny_dir, tmp_path, monkeypatch, kwargs,
                                                                            message):
    """The command line's choices guard the CLI; a Python caller got a bare ValueError from the
    quantizer after the (slow) source had been read."""
    import gemma_export
    from gemma_export import exporter

    monkeypatch.setattr(exporter, "open_source", lambda *a, **k: pytest.fail("the source was read first"))
    with pytest.raises(ConfigError) as raised:
        gemma_export.export(tiny_dir, tmp_path / "out", **{"dtype": "int4", **kwargs})
    assert str(raised.value) == message
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_folder_beyond_the_vocabulary_names_the_option_that_gave_it(tmp_path):
    """read_tokenizer_folder adds the option to every message, the vocabulary's ConfigError too."""
    from gemma_export.errors import ConfigError
    from gemma_export.sources.hf import read_tokenizer_folder

    (tmp_path / "tokenizer.json").write_bytes(_char_tokenizer_bytes(extra={"z": 500}))
    with pytest.raises(ConfigError, match=r"token id 500 \('z'\) is outside the model's vocab_size 96 .*\(--tokenizer\)$"):
        read_tokenizer_folder(tmp_path, 96, "--tokenizer")
    assert read_tokenizer_folder(tmp_path, 501, "--tokenizer") is not None  # 500 is a row of 501
