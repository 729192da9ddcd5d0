"""Read a llama.cpp GGUF of architecture ``gemma3`` lazily.

The header is read and checked by :mod:`.gguf_header`; the file is memory-mapped and each tensor is
dequantized to float32 with gguf-py's ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, ...) only when the exporter asks for it. Names are mapped to
transformers names and llama.cpp's ``+1`` on every RMSNorm weight (``convert_hf_to_gguf.py``,
``Gemma3Model.modify_tensors``) is undone, so the checkpoint follows transformers' convention
(gain = ``1 + w``).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path

import numpy as np

from ..checkpoint import EMBED, LM_HEAD, Checkpoint, Tokenizer, TensorRef, resolve_lm_head, validate_tensors
from ..config import UNK_TOKEN_ID, config_from_gguf_metadata
from ..errors import FormatError
from ..tokenizer import tokenizer_config_json, tokenizer_from_gguf
from .gguf_header import PLAIN_GGML_TYPES, GGUFTensorInfo, read_gguf_header

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


def _hf_name(gguf_name: str, path: Path) -> tuple[str, bool] | None:
    """transformers name and is-norm flag of a GGUF tensor name; None for a name of no part of the
    text decoder (left out, and the export notes it, as for a transformers folder).

    Raises:
        FormatError: a ``blk.*`` name that is not ``blk.<layer>.<known block tensor>.weight`` with
            the layer in plain ASCII digits (``blk.00.…`` would be a second name for ``blk.0.…``); a
            tensor of the embedding, the final norm or the output head other than their ``.weight``
            (``output_norm.bias``): leaving it out would change the model's output.
    """
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] in ("token_embd", "output_norm", "output"):
        raise FormatError(f"{path}: unexpected tensor '{gguf_name}': not a weight of the Gemma 3 text decoder "
                          f"(expected {', '.join(_TOP_NAMES)} and blk.*); leaving it out would change the model's "
                          "output")
    if parts[0] != "blk":
        return None
    index = parts[1] if len(parts) > 1 else ""
    if (len(parts) == 4 and index.isascii() and index.isdigit() and str(int(index)) == index
            and parts[3] == "weight" and parts[2] in _BLOCK_NAMES):
        suffix, is_norm = _BLOCK_NAMES[parts[2]]
        return f"model.layers.{int(index)}.{suffix}.weight", is_norm
    raise FormatError(f"{path}: unexpected tensor '{gguf_name}': expected blk.<layer>.<name>.weight with <name> one "
                      f"of {', '.join(_BLOCK_NAMES)}")


def _in_gguf_names(message: str) -> str:
    """``message`` with each quoted transformers tensor name followed by the GGUF's name for it
    (``'model.layers.2.mlp.up_proj.weight' (blk.2.ffn_up.weight in the GGUF)``), unless the
    message shows that name already."""
    top = {hf: gguf_name for gguf_name, (hf, _) in _TOP_NAMES.items()}
    block = {suffix: gguf_name for gguf_name, (suffix, _) in _BLOCK_NAMES.items()}

    def named(match: re.Match) -> str:
        hf = match[1]
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf)
        gguf_name = top.get(hf) or (f"blk.{layer[1]}.{block[layer[2]]}.weight" if layer and layer[2] in block else None)
        shown_already = gguf_name is None or gguf_name in message  # e.g. as the tensor's origin "file:blk.0.…"
        return match[0] if shown_already else f"{match[0]} ({gguf_name} in the GGUF)"
    return re.sub(r"'((?:model|lm_head)\.[\w.]+)'", named, message)


def _check_dequantizable(path: Path, info: GGUFTensorInfo, data, qtype) -> None:
    """Refuse, at open, a tensor type gguf-py cannot turn into floats (I8, I32, F64, Q8_1, ...)."""
    import gguf

    if data.size == 0:  # nothing to decode; validate_tensors names the shape
        return
    first = 1 if data.ndim > 1 or qtype.name in PLAIN_GGML_TYPES else gguf.GGML_QUANT_SIZES[qtype][1]
    try:
        gguf.quants.dequantize(data[:first], qtype)  # one row, element or block
    except NotImplementedError:
        raise FormatError(f"{path}: tensor '{info.name}' has ggml type {qtype.name}, which gguf-py cannot "
                          "dequantize; expected F32, F16, BF16 or a llama.cpp quantized type") from None


def _tensor_data(file_bytes: np.ndarray, info: GGUFTensorInfo):
    """A tensor's data as a view of the memory-mapped file, in gguf-py's ``GGUFReader`` layout: the
    numpy shape (``dims`` reversed) for plain types, ``[..., rows, bytes per row]`` for block types
    (whose rows dequantize independently). Returns ``(data, ggml type)``."""
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    shape = tuple(reversed(info.dims))
    raw = file_bytes[info.offset:info.offset + info.n_bytes]
    if qtype.name in PLAIN_GGML_TYPES:
        return raw.view(PLAIN_GGML_TYPES[qtype.name]).reshape(shape), qtype
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


def _described(value) -> str:
    """A metadata value's kind for messages: ``a string``, ``an array of int32``, ``a bool``, ..."""
    if isinstance(value, (str, bytes)):
        return f"a string {value[:40]!r}"
    if isinstance(value, (bool, np.bool_)):
        return f"a bool {value}"
    if isinstance(value, (int, float, np.number)):
        return f"a number {value}"
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype}"
    if isinstance(value, list):
        kinds = sorted({type(v).__name__ for v in value})
        return f"an array of {', '.join(kinds)}" if kinds else "an empty array"
    return type(value).__name__


def _check_tokenizer_fields(path: Path, tokens, token_types, add_bos, rows: int) -> None:
    """The ``tokenizer.ggml.*`` values the tokenizer is rebuilt from, checked before anything is written.

    Raises:
        FormatError: tokens not a list of distinct strings or more of them than table rows,
            token_type not an integer array, add_bos_token not a bool.
    """
    if not (isinstance(tokens, list) and all(isinstance(t, str) for t in tokens)):
        raise FormatError(f"{path}: tokenizer.ggml.tokens is not an array of strings (found {_described(tokens)})")
    if len(tokens) > rows:
        raise FormatError(f"{path}: tokenizer.ggml.tokens has {len(tokens):,} tokens, more than the "
                          f"{rows:,} rows of token_embd.weight")
    if len(set(tokens)) != len(tokens):
        twice = next(t for t, n in collections.Counter(tokens).items() if n > 1)
        raise FormatError(f"{path}: tokenizer.ggml.tokens holds {twice!r} more than once; expected distinct pieces")
    if not (isinstance(token_types, np.ndarray) and token_types.dtype.kind in "iu"):
        raise FormatError(f"{path}: tokenizer.ggml.token_type is not an array of integers "
                          f"(found {getattr(token_types, 'dtype', type(token_types).__name__)})")
    if not isinstance(add_bos, bool):
        raise FormatError(f"{path}: tokenizer.ggml.add_bos_token is {add_bos!r}, expected a bool")


def read_gguf(path: Path, tokenizer: bool = True) -> Checkpoint:
    """Open a Gemma 3 GGUF lazily; ``tokenizer`` False leaves its tokenizer metadata unread and
    unchecked (the export was given another tokenizer).

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
    ignored: list[str] = []
    for t in header.tensors:
        mapped = _hf_name(t.name, path)  # one transformers name per GGUF name: the header has no repeats
        if mapped is None:
            ignored.append(t.name)
            continue
        name, is_norm = mapped
        data, qtype = _tensor_data(file_bytes, t)
        _check_dequantizable(path, t, data, qtype)
        shape = tuple(reversed(t.dims))  # GGUF lists ne0 (fastest) first
        tensors[name] = TensorRef(name, shape, f"{path}:{t.name}", _tensor_reader(data, qtype, is_norm, gguf.quants.dequantize),
                                  _tensor_row_reader(data, qtype, is_norm, gguf.quants.dequantize))

    if EMBED not in tensors:
        raise FormatError(f"{path}: missing tensor 'token_embd.weight'")
    if len(tensors[EMBED].shape) != 2 or 0 in tensors[EMBED].shape:  # the vocabulary is read from its rows
        raise FormatError(f"{path}: tensor 'token_embd.weight' has shape {list(tensors[EMBED].shape)}; expected "
                          "[vocab, hidden], both above 0")
    fields = header.metadata
    meta = {k: v for k, v in fields.items() if k.startswith(("general.", "gemma3.", "tokenizer.ggml.")) and k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")}
    config = config_from_gguf_metadata(meta, vocab_rows=tensors[EMBED].shape[0], tied=True, where=str(path))
    beyond = sorted(n for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= config.num_hidden_layers)
    if beyond:
        raise FormatError(f"{path}: unexpected tensor {tensors[beyond[0]].origin.rsplit(':', 1)[-1]!r}: "
                          f"gemma3.block_count is {config.num_hidden_layers}")
    try:
        validate_tensors(config, tensors, str(path))
    except FormatError as exc:  # its messages use transformers' names: the user's file has the GGUF's
        raise FormatError(_in_gguf_names(str(exc))) from None
    resolve_lm_head(config, tensors, str(path))

    llama = tokenizer and fields.get("tokenizer.ggml.model") == "llama"
    has_tokenizer = llama and "tokenizer.ggml.tokens" in fields
    pieces = fields.get("tokenizer.ggml.tokens")
    if llama and (isinstance(pieces, (str, bytes)) or not hasattr(pieces, "__len__") or not len(pieces)):
        found = "missing" if pieces is None else _described(pieces)
        raise FormatError(f"{path}: tokenizer.ggml.model is 'llama' but tokenizer.ggml.tokens is {found}; "
                          "expected an array of strings, one piece per row of the table")
    tokens = fields["tokenizer.ggml.tokens"] if has_tokenizer else []
    token_types = fields.get("tokenizer.ggml.token_type", np.zeros(0, np.int32)) if has_tokenizer else []
    if has_tokenizer:
        _check_tokenizer_fields(path, tokens, token_types, fields.get("tokenizer.ggml.add_bos_token", True),
                                tensors[EMBED].shape[0])
        token_types = token_types.tolist()
    # bos, eos and padding as the config read them (checked there against the table's rows)
    ids = {"bos": config.bos_token_id, "eos": config.eos_token_id[0], "padding": config.pad_token_id,
           "unknown": meta.get("tokenizer.ggml.unknown_token_id", UNK_TOKEN_ID)}
    if has_tokenizer:  # checked here, before anything is written, not when the tokenizer is built
        if len(token_types) not in (0, len(tokens)):
            raise FormatError(f"{path}: tokenizer.ggml.token_type has {len(token_types)} entries, "
                              f"expected one per token ({len(tokens)})")
        for k, value in ids.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
                raise FormatError(f"{path}: tokenizer.ggml.{k}_token_id is {value}, expected an id below the "
                                  f"{len(tokens)} tokens of tokenizer.ggml.tokens")
        bos = tokens[ids["bos"]]
        # the template reads "piece:N" as a piece with type id N, and splits at spaces
        if not bos or bos.startswith("$") or ":" in bos or any(c.isspace() for c in bos):
            raise FormatError(f"{path}: the bos token (id {ids['bos']}) is {bos!r}; expected a piece without "
                              "spaces or ':' that does not start with '$' (the tokenizer's template names it)")

    def build_tokenizer() -> dict[str, bytes]:
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        tok = tokenizer_from_gguf(tokens, token_types, ids["bos"], ids["unknown"], add_bos)
        cfg = tokenizer_config_json(tokens, ids["bos"], ids["eos"], ids["padding"], ids["unknown"], add_bos)
        return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": cfg.encode()}

    return Checkpoint(
        config=config,
        tensors=tensors,
        ignored=tuple(ignored),
        tokenizer=Tokenizer(build_tokenizer) if has_tokenizer else None,
        identity={"kind": "gguf", "path": str(path.resolve()), "bytes": path.stat().st_size,
                  # recorded as the file says them when they have their spec's types (string, uint32)
                  "name": meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
                  "file_type": meta.get("general.file_type") if type(meta.get("general.file_type")) is int else None},
        path=path,
        files=(path,),
    )
