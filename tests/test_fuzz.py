"""Property-based fuzzing of the readers: thousands of random mutations of valid safetensors
headers, GGUF files, config.json objects and reference MLIR exports. Every reader either succeeds
or raises one of this toolkit's errors; nothing else (IndexError, KeyError, struct.error, numpy or
json internals, MemoryError from a forged size) may escape. By default the runs are derandomized,
so CI sees the same 1,000 inputs per reader every time; set GEMMA_EXPORT_FUZZ_EXAMPLES=N to search
N random inputs per reader instead.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest

import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_tiny_model
from gemma_export.config import config_from_hf_dict
from gemma_export.errors import GemmaExportError
from gemma_export.sources import open_source
from gemma_export.sources.safetensors_header import read_header
from test_config import V4
from test_gguf_tiny import write_tiny_gguf
from test_reference_mlir import write_reference

EXAMPLES = int(os.environ.get("GEMMA_EXPORT_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="GEMMA_EXPORT_FUZZ_EXAMPLES" not in os.environ, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ---- mutations of a byte string ------------------------------------------------------------------
_INTERESTING = [0, 1, 0x7F, 0x80, 0xFF, ord("{"), ord("}"), ord('"'), ord(","), ord("0"), ord("9"), ord("-")]


@st.composite
def mutated(draw, original: bytes, focus: int | None = None):
    """``original`` with 1–8 edits: byte overwrites (often with boundary values), truncation,
    insertion, deletion, or a little-endian integer planted at a random offset. ``focus`` biases
    offsets into the first ``focus`` bytes (the header, where the checks live)."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 8))):
        if not data:
            break
        limit = min(len(data), focus) if focus and draw(st.booleans()) else len(data)
        at = draw(st.integers(0, max(limit - 1, 0)))
        kind = draw(st.sampled_from(["byte", "byte", "int", "truncate", "insert", "delete"]))
        if kind == "byte":
            data[at] = draw(st.sampled_from(_INTERESTING) | st.integers(0, 255))
        elif kind == "int":
            width = draw(st.sampled_from([4, 8]))
            value = draw(st.sampled_from([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1]) | st.integers(0, 2**(8 * width) - 1))
            data[at:at + width] = (value & ((1 << 8 * width) - 1)).to_bytes(width, "little")
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        else:
            del data[at:at + draw(st.integers(1, 16))]
    return bytes(data)


def _only_our_errors(call) -> None:
    """Run ``call``; only this toolkit's errors may escape it (recorded as events: see
    ``pytest --hypothesis-show-statistics``)."""
    try:
        call()
    except GemmaExportError as exc:
        hypothesis.event(f"{type(exc).__name__}: {str(exc).split(': ', 1)[-1][:40]}")
    else:
        hypothesis.event("accepted")


# ---- safetensors header --------------------------------------------------------------------------
def _valid_safetensors() -> bytes:
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    return save({"a": rng.standard_normal((4, 8)).astype(np.float32), "b": np.arange(6, dtype=np.int32),
                       "c": rng.standard_normal(3).astype(np.float16)}, metadata={"format": "np"})


SAFETENSORS = _valid_safetensors()


@FUZZ
@given(data=mutated(SAFETENSORS, focus=8 + int.from_bytes(SAFETENSORS[:8], "little")))
def test_safetensors_header_mutations(data):
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(data)
        try:
            entries = read_header(path)
        except GemmaExportError:
            hypothesis.event("rejected")
            return
        hypothesis.event("accepted")
        # what we accept, the safetensors library must read without complaint
        with safe_open(str(path), "np") as f:
            assert sorted(f.keys()) == sorted(e.name for e in entries)
            for e in entries:
                assert f.get_tensor(e.name).nbytes == e.nbytes


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)


@FUZZ
@given(name=st.sampled_from(["a", "b", "c", "__metadata__"]), field=st.sampled_from(["dtype", "shape", "data_offsets", None]),
       value=_json_values)
def test_safetensors_header_fields(name, field, value):
    n = int.from_bytes(SAFETENSORS[:8], "little")
    header = json.loads(SAFETENSORS[8:8 + n])
    if field is None or name == "__metadata__":
        header[name] = value
    else:
        header[name][field] = value
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.safetensors"
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + SAFETENSORS[8 + n:])
        _only_our_errors(lambda: read_header(path))


# ---- GGUF ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    model = make_tiny_model(seed=5, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention"] * 5 + ["full_attention"])
    path = tmp_path_factory.mktemp("fuzz_gguf") / "tiny.gguf"
    write_tiny_gguf(model, path)
    return path.read_bytes()


def _read_everything(path: Path) -> None:
    checkpoint = open_source(path)
    for tensor in checkpoint.tensors.values():
        tensor.load()


@FUZZ
@given(data=st.data())
def test_gguf_mutations(gguf_bytes, data):
    mutation = data.draw(mutated(gguf_bytes, focus=gguf_bytes.index(b"token_embd.weight") + 200))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.gguf"
        path.write_bytes(mutation)
        _only_our_errors(lambda: _read_everything(path))


# ---- config.json -----------------------------------------------------------------------------------
_CONFIG_KEYS = sorted(V4) + ["layer_types", "rope_parameters", "text_config", "tie_word_embeddings", "eos_token_id",
                             "final_logit_softcapping", "attn_logit_softcapping", "auto_map"]


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(_CONFIG_KEYS), st.none() | _json_values | st.just("__delete__")),
                      min_size=1, max_size=4))
def test_config_mutations(edits):
    config = dict(V4)
    for key, value in edits:
        if value == "__delete__":
            config.pop(key, None)
        else:
            config[key] = value
    _only_our_errors(lambda: config_from_hf_dict(config, "fuzz/config.json"))


# ---- reference MLIR + archive ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[bytes, bytes]:
    model = make_tiny_model(seed=3, sliding_window=512, layer_types=["sliding_attention"] * 4)
    mlir = write_reference(model, tmp_path_factory.mktemp("fuzz_ref") / "ref", "int8")
    return mlir.read_bytes(), mlir.with_suffix(".safetensors").read_bytes()


_MLIR_TOKENS = ["tensor<", ">", "x", "xbf16", "xi8", "xf32", "@t", "_scale", '"model"::"', "util.global private ",
                "func.func @gemma(", "0", "4294967296", "?", "\n", "#flow.parameter.named<", "  "]


@FUZZ
@given(data=st.data())
def test_mlir_mutations(reference, data):
    text, archive = reference
    lines = text.split(b"\n")
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(lines) - 1))
        kind = data.draw(st.sampled_from(["token", "drop", "dup", "bytes"]))
        if kind == "token":
            line = lines[at]
            pos = data.draw(st.integers(0, len(line)))
            cut = data.draw(st.integers(0, 12))
            lines[at] = line[:pos] + data.draw(st.sampled_from(_MLIR_TOKENS)).encode() + line[pos + cut:]
        elif kind == "drop":
            del lines[at]
        elif kind == "dup":
            lines.insert(at, lines[at])
        else:
            lines[at] = data.draw(st.binary(max_size=40))
        if not lines:
            lines = [b""]
    if data.draw(st.booleans()):
        archive = data.draw(mutated(archive, focus=8 + int.from_bytes(archive[:8], "little")))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gemma.mlir"
        path.write_bytes(b"\n".join(lines))
        path.with_suffix(".safetensors").write_bytes(archive)
        _only_our_errors(lambda: _read_everything(path))
