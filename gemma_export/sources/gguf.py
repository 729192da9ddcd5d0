"""Read a llama.cpp GGUF of architecture ``gemma3`` lazily.

The header is read and checked by :mod:`.gguf_header`; the file is memory-mapped and each tensor is
dequantized to float32 with gguf-py's ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ...) only when the exporter asks for it. Names are mapped to transformers names and llama.cpp's ``+1`` on
every RMSNorm weight (``convert_hf_to_gguf.py``, ``Gemma3Model.modify_tensors``) is undone, so the
checkpoint follows transformers' convention (gain = ``1 + w``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..checkpoint import EMBED, LM_HEAD, Checkpoint, Tokenizer, TensorRef, resolve_lm_head, validate_tensors
from ..config import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, UNK_TOKEN_ID, config_from_gguf_metadata
from ..errors import FormatError
from ..tokenizer import tokenizer_config_json, tokenizer_from_gguf
from .gguf_header import GGUFTensorInfo, read_gguf_header

#: GGUF block tensor name → transformers name suffix; ``True`` marks RMSNorm weights (+1 undone).
_BLOCK_NAMES: dict[str, tuple[str, bool]] = {
    "attn_norm": ("input_layernorm", True),
    "attn_q": ("self_attn.q_proj", False),
    "attn_k": ("self_attn.k_proj", False),
    "attn_v": ("self_attn.v_proj", False),
    "attn_output": ("self_attn.o_proj", False),
    "attn_q_norm": ("self_attn.q_norm", True),
    "attn_k_norm": ("self_attn.k_norm", True),
    "post_attention_norm": ("post_attention_layernorm", True),
    "ffn_norm": ("pre_feedforward_layernorm", True),
    "ffn_gate": ("mlp.gate_proj", False),
    "ffn_up": ("mlp.up_proj", False),
    "ffn_down": ("mlp.down_proj", False),
    "post_ffw_norm": ("post_feedforward_layernorm", True),
}
_TOP_NAMES: dict[str, tuple[str, bool]] = {
    "token_embd.weight": (EMBED, False),
    "output_norm.weight": ("model.norm.weight", True),
    "output.weight": (LM_HEAD, False),
}


def _hf_name(gguf_name: str) -> tuple[str, bool] | None:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" and parts[2] in _BLOCK_NAMES:
        suffix, is_norm = _BLOCK_NAMES[parts[2]]
        return f"model.layers.{int(parts[1])}.{suffix}.weight", is_norm
    return None


#: ggml types stored as plain numpy elements; every other type is blocks of bytes.
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


def _tensor_data(file_bytes: np.ndarray, info: GGUFTensorInfo):
    """A tensor's data as a view of the memory-mapped file, in gguf-py's ``GGUFReader`` layout: the
    numpy shape (``dims`` reversed) for plain types, ``[..., rows, bytes per row]`` for block types
    (whose rows dequantize independently). Returns ``(data, ggml type)``."""
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    shape = tuple(reversed(info.dims))
    raw = file_bytes[info.offset:info.offset + info.n_bytes]
    if qtype.name in _PLAIN_TYPES:
        return raw.view(_PLAIN_TYPES[qtype.name]).reshape(shape), qtype
    return raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape, qtype)), qtype


def _tensor_reader(data, qtype, is_norm: bool, dequantize):
    def read() -> np.ndarray:
        values = dequantize(data, qtype).astype(np.float32, copy=False)
        if is_norm:
            values = values - np.float32(1.0)
        return values
    return read


def _tensor_row_reader(data, qtype, is_norm: bool, dequantize):
    if is_norm or data.ndim != 2:
        return None

    def read_rows(start: int, stop: int) -> np.ndarray:
        return dequantize(data[start:stop], qtype).astype(np.float32, copy=False)
    return read_rows


def read_gguf(path: Path) -> Checkpoint:
    """Open a Gemma 3 GGUF lazily.

    Raises:
        FormatError: not a readable GGUF, a missing or misshapen tensor.
        ConfigError: not a ``gemma3`` model or missing metadata.
    """
    import gguf  # imported here: gguf-py takes ~0.3 s to import

    path = Path(path)
    header = read_gguf_header(path)  # named errors for forged counts, truncation and bad offsets
    # a plain ndarray view of the mapping: gguf-py's dequantization makes many small arrays, and as
    # np.memmap subclasses each would cost a finalizer call (dequantizing 30% slower)
    file_bytes = np.asarray(np.memmap(path, dtype=np.uint8, mode="r"))

    tensors: dict[str, TensorRef] = {}
    for t in header.tensors:
        mapped = _hf_name(t.name)
        if mapped is None:
            continue
        name, is_norm = mapped
        data, qtype = _tensor_data(file_bytes, t)
        shape = tuple(reversed(t.dims))  # GGUF lists ne0 (fastest) first
        tensors[name] = TensorRef(name, shape, f"{path}:{t.name}", _tensor_reader(data, qtype, is_norm, gguf.quants.dequantize),
                                  _tensor_row_reader(data, qtype, is_norm, gguf.quants.dequantize))

    if EMBED not in tensors:
        raise FormatError(f"{path}: missing tensor 'token_embd.weight'")
    fields = header.metadata
    meta = {k: v for k, v in fields.items() if k.startswith(("general.", "gemma3.", "tokenizer.ggml.")) and k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")}
    config = config_from_gguf_metadata(meta, vocab_rows=tensors[EMBED].shape[0], tied=True, where=str(path))
    validate_tensors(config, tensors, str(path))
    resolve_lm_head(config, tensors, str(path))

    has_tokenizer = fields.get("tokenizer.ggml.model") == "llama" and "tokenizer.ggml.tokens" in fields
    tokens = fields["tokenizer.ggml.tokens"] if has_tokenizer else []
    token_types = fields.get("tokenizer.ggml.token_type", []) if has_tokenizer else []
    for key, value, kind in (("tokens", tokens, str), ("token_type", token_types, int)):
        if not (isinstance(value, list) and all(isinstance(v, kind) for v in value)):
            raise FormatError(f"{path}: tokenizer.ggml.{key} is not an array of {kind.__name__} "
                              f"(found {type(value).__name__})")
    defaults = {"bos": BOS_TOKEN_ID, "eos": EOS_TOKEN_ID, "unknown": UNK_TOKEN_ID, "padding": PAD_TOKEN_ID}
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id", v) for k, v in defaults.items()}
    if has_tokenizer:  # checked here, before anything is written, not when the tokenizer is built
        if len(token_types) not in (0, len(tokens)):
            raise FormatError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries, "
                              f"expected one per token ({len(tokens)})")
        for k, value in ids.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
                raise FormatError(f"{path}: tokenizer.ggml.{k}_token_id is {value}, expected an id below the "
                                  f"{len(tokens)} tokens of tokenizer.ggml.tokens")

    def build_tokenizer() -> dict[str, bytes]:
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        tok = tokenizer_from_gguf(tokens, token_types, ids["bos"], ids["eos"], ids["unknown"], add_bos)
        cfg = tokenizer_config_json(tokens, ids["bos"], ids["eos"], ids["padding"], ids["unknown"], add_bos)
        return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": cfg.encode()}

    return Checkpoint(
        config=config,
        tensors=tensors,
        tokenizer=Tokenizer(build_tokenizer) if has_tokenizer else None,
        identity={"kind": "gguf", "path": str(path.resolve()), "bytes": path.stat().st_size,
                  "name": meta.get("general.name"), "file_type": meta.get("general.file_type")},
        path=path,
        files=(path,),
    )
