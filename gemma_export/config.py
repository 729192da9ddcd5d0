"""Gemma 3 text-model configuration, read from a transformers ``config.json`` (4.x or 5.x form) or
from GGUF metadata, validated once so that the graph builder can trust it.

Field names follow transformers' ``Gemma3TextConfig``.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .errors import ConfigError, is_whole_number, shown

SLIDING = "sliding_attention"
FULL = "full_attention"

#: the exported graph's optional input naming the first cache position the sliding layers hold
#: (``builder.py``'s I/O contract), and the model metadata naming those layers' indices ("0,1,2,3,4,6,…")
#: and their window (positions). Here, not in ``builder``, so the runtime reads them without
#: importing the graph builder (onnx_ir: ~30 MB of resident memory on a board with 1.9 GB).
SLIDING_CACHE_START = "sliding_cache_start"
SLIDING_LAYERS_KEY, SLIDING_WINDOW_KEY = "gemma_export.sliding_layers", "gemma_export.sliding_window"

#: extra outputs of a ``debug_outputs`` export: ``debug.layers.{i}.{block}`` float32 [batch, sequence_length, hidden]
#: (``builder.py``; ``parity`` compares them, and needs no graph builder for that)
DEBUG_BLOCKS = ("attention", "mlp")


def debug_output_name(layer: int, block: str) -> str:
    """The graph output name ``debug.layers.{layer}.{block}`` (``block``: one of :data:`DEBUG_BLOCKS`)."""
    return f"debug.layers.{layer}.{block}"


#: Defaults of transformers' ``Gemma3TextConfig`` (used only where a source omits a field that
#: transformers itself would default).
DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_SUPPORTED_ROPE_TYPES = ("default", "linear")
#: transformers' names for GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
#: (Hendrycks & Gimpel 2016; transformers.activations: GELUTanh, NewGELUActivation, FastGELUActivation,
#: AccurateGELUActivation), the formula the graph builds; Gemma 3 writes the first
_SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new", "gelu_fast", "gelu_accurate")
_TEXT_MODEL_TYPES = ("gemma3_text", "gemma3")

#: ``--dtype`` choices (``weights.WEIGHT_FORMATS`` implements each, widest first) and those stored
#: as block-wise integer codes with scales
DTYPES = ("fp32", "bf16", "int8", "int4")
QUANTIZED_DTYPES = ("int8", "int4")
#: ``--table-dtype`` choices of an int4 export → the bits of the shared table's codes
TABLE_BITS = {"int4": 4, "int8": 8}
TABLE_DTYPES = tuple(TABLE_BITS)


def export_variant(dtype: str, *, table_dtype: str | None = None, activation_residual: bool = False,
                   all_logits: bool = False, debug_outputs: bool = False) -> str:
    """The part of an export's default folder name after ``-onnx-``: the dtype, then ``-table-int8``
    (int4 with an int8 table), ``-activation-residual``, ``-all-logits`` and ``-debug-outputs`` for
    the options that change the graph, so that such an export does not replace the plain one
    (``gemma-3-270m-onnx-int4-table-int8``).

    Args:
        dtype: one of :data:`DTYPES`; the flags are the export's options of the same names.

    Returns:
        e.g. ``"int8"``, ``"int4-table-int8-all-logits"``. The combination is not checked here
        (:func:`~gemma_export.exporter.export` refuses the invalid ones first).
    """
    name = f"{dtype}-table-int8" if dtype == "int4" and table_dtype == "int8" else dtype
    return name + "-activation-residual" * activation_residual + "-all-logits" * all_logits + "-debug-outputs" * debug_outputs


def variant_options(variant: str) -> list[str] | None:
    """The main command's options whose default folder ends in ``-onnx-{variant}``
    (:func:`export_variant` inverted over the combinations ``export`` accepts), or None when no
    export is named so.

    Example: ``"int4-table-int8"`` -> ``["--dtype", "int4", "--table-dtype", "int8"]``.
    """
    for dtype, table, residual, all_logits, debug in itertools.product(DTYPES, (None, "int8"), *[(False, True)] * 3):
        if (table and dtype != "int4") or (residual and dtype != "int8"):  # options export refuses
            continue
        if export_variant(dtype, table_dtype=table, activation_residual=residual, all_logits=all_logits,
                          debug_outputs=debug) == variant:
            return (["--dtype", dtype] + ["--table-dtype", "int8"] * bool(table) + ["--activation-residual"] * residual
                    + ["--all-logits"] * all_logits + ["--debug-outputs"] * debug)
    return None

#: Gemma's special token ids (its tokenizer): <pad>, <eos>, <bos>, <unk>, and <end_of_turn>, which
#: also stops generation; used where a source does not name them
PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID, UNK_TOKEN_ID, END_OF_TURN_TOKEN_ID = 0, 1, 2, 3, 106
#: the ids that stop generation where a source names none: <eos> and <end_of_turn>
DEFAULT_STOP_TOKEN_IDS = (EOS_TOKEN_ID, END_OF_TURN_TOKEN_ID)
#: ``sliding_window`` of Gemma 3 270M and FunctionGemma-270M (their ``config.json``), for what
#: carries no config: the board team's reference exports, and metrics given no config
GEMMA3_270M_SLIDING_WINDOW = 512


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """RoPE for one layer type: ``inv_freq = 1 / rope_theta ** (arange(0, head_dim, 2) / head_dim)``,
    divided by ``factor`` for ``rope_type == "linear"`` (transformers ``_compute_linear_scaling_rope_parameters``)."""

    rope_theta: float
    rope_type: str = "default"
    factor: float = 1.0

    def inv_freq(self, head_dim: int, dtype=np.float32) -> np.ndarray:
        """``[head_dim / 2]`` in ``dtype`` (float32 for the graph's constant; computed in that precision),
        radians per position; formula and source in the class docstring.

        Args:
            head_dim: the rotated size per head (Gemma 3 rotates all of it).
            dtype: a numpy float type (``np.float32``, ``np.float64``).
        """
        exponent = np.arange(0, head_dim, 2, dtype=dtype) / dtype(head_dim)
        return ((dtype(1.0) / np.power(dtype(self.rope_theta), exponent)) / dtype(self.factor)).astype(dtype)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    """Shape and numerics of a Gemma 3 text decoder.

    Attributes mirror transformers' ``Gemma3TextConfig``. ``layer_types[i]`` is ``"sliding_attention"``
    or ``"full_attention"``; ``rope_parameters`` is keyed by layer type. ``vocab_size`` is the number of
    rows of the token-embedding table (262,144 for stock Gemma 3, 262,153 for the board's fine-tune).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_parameters: Mapping[str, RopeParameters]
    query_pre_attn_scalar: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # read, not applied: transformers' Gemma3Attention ignores it
    bos_token_id: int = BOS_TOKEN_ID
    eos_token_id: tuple[int, ...] = DEFAULT_STOP_TOKEN_IDS
    pad_token_id: int = PAD_TOKEN_ID
    #: what the export should tell about how the source's config was read (one line each, naming the
    #: file); not part of the model, so neither compared nor written to the manifest
    notes: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    #: the fields the source did not give, taken from transformers' ``Gemma3TextConfig`` defaults
    #: (named in the errors they lead to); not part of the model either
    defaulted: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def defaults_taken(self, *fields: str) -> str:
        """`` (num_attention_heads 8 is transformers' default: the config gives none)`` for those of
        ``fields`` (all when none are named) in :attr:`defaulted`, for the end of an error message; ""
        when the config gave them all."""
        taken = [f for f in (fields or self.defaulted) if f in self.defaulted]
        if not taken:
            return ""
        values = " and ".join(f"{f} {getattr(self, f)}" for f in taken)
        gives = {1: "none", 2: "neither"}.get(len(taken), "none of them")
        return f" ({values} {'is' if len(taken) == 1 else 'are'} transformers' default: the config gives {gives})"

    @staticmethod
    def default_eos_token_ids(vocab_size: int) -> tuple[int, ...]:
        """Gemma's stop ids, <eos> (1) and <end_of_turn> (106), those inside a ``vocab_size`` vocabulary
        (for sources that do not name them: a reference MLIR export)."""
        return tuple(i for i in GemmaConfig.eos_token_id if i < vocab_size)

    # ---- derived values -------------------------------------------------------------------------
    @property
    def num_key_value_groups(self) -> int:
        """Query heads per KV head (4 for the 270M: 4 query heads share 1 KV head)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def embed_scale(self) -> float:
        """``sqrt(hidden_size)``, the factor Gemma multiplies token embeddings by (25.2982 for 640;
        transformers ``Gemma3TextScaledWordEmbedding``'s ``embed_scale``)."""
        return math.sqrt(self.hidden_size)

    @property
    def attention_scale(self) -> float:
        """``query_pre_attn_scalar ** -0.5`` (1/16 for the 270M), the scores' factor
        (transformers ``Gemma3Attention.scaling``)."""
        return self.query_pre_attn_scalar**-0.5

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (used in manifests)."""
        d = dataclasses.asdict(self)
        del d["notes"], d["defaulted"]
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["rope_parameters"] = {k: dataclasses.asdict(v) for k, v in self.rope_parameters.items()}
        return d

    # ---- validation -----------------------------------------------------------------------------
    def validate(self, where: str, names: Mapping[str, str] | None = None) -> "GemmaConfig":
        """Check that the fields agree with each other.

        Args:
            where: the source file, named in messages.
            names: field → the key the source file holds it under (a GGUF's
                ``gemma3.attention.head_count`` for ``num_attention_heads``), for the messages; a
                field not in it is named as transformers names it.

        Returns:
            ``self``, so a constructor call can end with ``.validate(where)``.

        Raises:
            ConfigError: naming ``where`` (the file) and the contradicting fields.
        """
        def named(field: str) -> str:
            return (names or {}).get(field, field)

        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: field '{named(name)}' must be a positive integer, found {shown(value)}")
        for name, ids in (("eos_token_id", self.eos_token_id), ("bos_token_id", (self.bos_token_id,)),
                          ("pad_token_id", (self.pad_token_id,))):
            if max(ids) >= self.vocab_size:
                raise ConfigError(f"{where}: {name} {max(ids)} is not below vocab_size {self.vocab_size}"
                                  f"{self.defaults_taken('vocab_size')}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: {named('num_attention_heads')} ({self.num_attention_heads}) is not a multiple of "
                f"{named('num_key_value_heads')} ({self.num_key_value_heads})"
                f"{self.defaults_taken('num_attention_heads', 'num_key_value_heads')}"
            )
        if self.head_dim % 8:  # onnxruntime refuses it only when the graph first runs, after the slow work
            raise ConfigError(f"{where}: {named('head_dim')} must be a multiple of 8 (even for rotate-half RoPE, and a multiple "
                              f"of 8 for onnxruntime's GroupQueryAttention, which the graph uses); found {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"{where}: layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ConfigError(f"{where}: layer_types holds {unknown}, expected only '{SLIDING}' and '{FULL}'")
        for layer_type in set(self.layer_types):
            rope = self.rope_parameters.get(layer_type)
            if rope is None:
                raise ConfigError(f"{where}: rope_parameters has no entry for layer type '{layer_type}'")
            if rope.rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ConfigError(
                    f"{where}: rope_type '{rope.rope_type}' for {layer_type} is not supported "
                    f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})"
                )
            if not rope.rope_theta > 0 or not rope.factor > 0:
                raise ConfigError(f"{where}: rope_theta and factor for {layer_type} must be > 0, found {rope}")
            with np.errstate(all="ignore"):
                inv_freq = rope.inv_freq(self.head_dim, np.float32)
            if not (np.isfinite(inv_freq).all() and (inv_freq > 0).all()):
                raise ConfigError(f"{where}: rope_theta {rope.rope_theta} and factor {rope.factor} for {layer_type} give "
                                  f"inverse frequencies float32 cannot hold (expected finite and > 0; the graph "
                                  f"computes RoPE in float32)")
        # the graph computes in float32: a positive value that float32 rounds to 0 or inf would make NaN
        # logits. name → (value, what the graph uses of it, Gemma's usual value)
        for name, value, used, usual in (("rms_norm_eps", self.rms_norm_eps, lambda v: v, "1e-6"),
                                         ("query_pre_attn_scalar", self.query_pre_attn_scalar, lambda v: v ** -0.5,
                                          "head_dim, e.g. 256")):
            if not value > 0:
                raise ConfigError(f"{where}: {name} must be > 0, found {value}")
            with np.errstate(all="ignore"):
                in_graph = np.float32(used(value))
            if not (np.isfinite(in_graph) and in_graph > 0):
                raise ConfigError(f"{where}: {name} {value} is outside what float32 can use "
                                  f"(the graph computes in float32; Gemma uses {usual})")
        return self


_MISSING = object()
#: Upper bounds checked before anything is allocated from a size (Gemma 3 27B is far below them).
_CAPS = {
    "vocab_size": 1 << 22, "hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1024,
    "num_attention_heads": 1024, "num_key_value_heads": 1024, "head_dim": 4096, "sliding_window": 1 << 24,
    "max_position_embeddings": 1 << 24, "sliding_window_pattern": 1024,
    # the same limits under GGUF's key names
    "block_count": 1024, "embedding_length": 1 << 16, "feed_forward_length": 1 << 18, "attention.head_count": 1024,
    "attention.head_count_kv": 1024, "attention.key_length": 4096, "attention.value_length": 4096,
    "attention.sliding_window": 1 << 24, "context_length": 1 << 24,
}


def _no_ids(value) -> bool:
    """A token-id field that names none: absent, null or ``[]`` (transformers loads all three); a GGUF's
    array value is no list and is judged by its ids."""
    return value is None or isinstance(value, list) and not value


class _Fields:
    """Typed access to a config mapping: every wrong type or range is a ConfigError naming the field."""

    def __init__(self, cfg: Mapping[str, Any], where: str, prefix: str = ""):
        self.cfg, self.where, self.prefix = cfg, where, prefix

    def _get(self, key: str, default: Any) -> Any:
        value = self.cfg.get(self.prefix + key, default)
        if value is _MISSING or (value is None and default is _MISSING):
            raise ConfigError(f"{self.where}: missing required field '{self.prefix + key}'")
        return value

    def int(self, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
        value = self._get(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        cap = _CAPS.get(key, 1 << 31)
        if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= cap:
            raise ConfigError(f"{self.where}: field '{self.prefix + key}' must be an integer in [{minimum}, {cap}], "
                              f"found {shown(value)}")
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.where}: field '{self.prefix + key}' must be a positive number, found {shown(value)}")
        return float(value)

    def optional_number(self, key: str) -> float | None:
        return None if self.cfg.get(self.prefix + key) is None else self.number(key)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.cfg.get(self.prefix + key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.where}: field '{self.prefix + key}' must be true or false, found {shown(value)}")
        return value

    def token_ids(self, key: str, default: Any, below: int | None = None) -> tuple[int, ...]:
        """Token ids (one or a list) under ``key``; ``below``: the vocabulary rows they must index."""
        value = self.cfg.get(self.prefix + key)
        value = default if _no_ids(value) else value
        values = value if isinstance(value, (list, tuple)) else [value]
        if not values or not all(is_whole_number(v) and v >= 0 for v in values):
            raise ConfigError(f"{self.where}: field '{self.prefix + key}' must be token ids, found {shown(value)}")
        if below is not None and max(values) >= below:
            raise ConfigError(f"{self.where}: field '{self.prefix + key}' is {max(values)}, "
                              f"expected a token id below the vocabulary's {below} rows")
        return tuple(values)


def gemma3_layer_types(num_layers: int, pattern: int = _DEFAULT_SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """Gemma 3's layer pattern: layer i is global iff ``(i + 1) % pattern == 0`` (transformers'
    ``Gemma3TextConfig``; llama.cpp's ``i % 6 == 5`` for the default 6)."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _rope_from_dict(d: Any, default_theta: float, where: str, name: str) -> RopeParameters:
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: field '{name}' must be an object, found {shown(d)}")
    fields = _Fields(d, where, "")
    rope_type = d.get("rope_type", d.get("type", "default"))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type {rope_type!r} in '{name}' is not supported "
                          f"(supported: {', '.join(_SUPPORTED_ROPE_TYPES)})")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor {d['partial_rotary_factor']!r} in '{name}' is not supported "
                          "(Gemma 3 rotates the whole head_dim: expected 1.0 or none)")
    return RopeParameters(
        rope_theta=fields.number("rope_theta", default_theta),
        rope_type=rope_type,
        factor=fields.number("factor", 1.0) if rope_type == "linear" else 1.0,
    )


def config_from_hf_dict(raw: Mapping[str, Any], where: str) -> GemmaConfig:
    """Build a :class:`GemmaConfig` from a parsed ``config.json``.

    Accepts the transformers 4.x form (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern``) and the 5.x form (``rope_parameters`` keyed by layer type), for
    ``model_type`` ``gemma3_text`` or a multimodal ``gemma3`` whose ``text_config`` holds the decoder.
    RoPE is resolved as transformers 5's ``Gemma3TextConfig`` does (``rope_scaling`` merged into the
    full-attention entry; an entry without ``rope_theta`` takes the top-level ``rope_theta`` or
    ``rope_local_base_freq``), with one difference: a 4.x ``rope_scaling`` that spells its type
    ``"type": "linear"`` is applied, as transformers 4.x did (5.x keeps the default there).

    Raises:
        ConfigError: unknown architecture, a missing or contradicting field; ``rope_parameters`` not
            keyed by layer type; an unsupported ``rope_type`` or ``partial_rotary_factor``.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, found {shown(raw)}")
    model_type = raw.get("model_type")
    if model_type not in _TEXT_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type is {model_type!r}, expected one of {', '.join(_TEXT_MODEL_TYPES)} (Gemma 3)"
        )
    cfg: Mapping[str, Any] = raw
    if model_type == "gemma3":  # the multimodal model: its language model's config is nested
        cfg = raw.get("text_config")
        if cfg is None:
            raise ConfigError(f"{where}: model_type 'gemma3' (the multimodal model) needs 'text_config', the "
                              "language model's fields; found none (a text-only config says 'gemma3_text')")
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: 'text_config' must be an object, found {shown(cfg)}")
        if cfg.get("model_type") not in (None, "gemma3_text"):  # transformers writes gemma3_text there
            raise ConfigError(f"{where}: text_config.model_type is {cfg['model_type']!r}, expected 'gemma3_text' "
                              "(Gemma 3's language model)")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in _SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"{where}: hidden_activation is {cfg.get('hidden_activation')!r}, expected GELU's tanh approximation "
            f"({', '.join(repr(a) for a in _SUPPORTED_ACTIVATIONS)})"
        )
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is true; Gemma 3 projections have no bias")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention is true; only causal decoders export")

    f = _Fields(cfg, where)
    num_layers = f.int("num_hidden_layers")
    if cfg.get("layer_types") is not None:
        layer_types = cfg["layer_types"]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ConfigError(f"{where}: field 'layer_types' must be a list of strings, found {layer_types!r:.80}")
        layer_types = tuple(layer_types)
    else:
        layer_types = gemma3_layer_types(num_layers, f.int("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN))

    # RoPE per layer type as transformers 5's Gemma3TextConfig.convert_rope_params_to_dict resolves it:
    # rope_parameters keyed by layer type (5.x), rope_scaling merged into the full-attention entry
    # (4.x, and a leftover beside 5.x's), each entry's rope_theta defaulting to the top-level
    # rope_theta (full) or rope_local_base_freq (sliding), then to Gemma 3's 1e6 / 1e4.
    rope_parameters_raw = cfg.get("rope_parameters")
    if rope_parameters_raw is not None and not isinstance(rope_parameters_raw, Mapping):
        raise ConfigError(f"{where}: field 'rope_parameters' must be an object, found {shown(rope_parameters_raw)}")
    rope_parameters_raw = rope_parameters_raw or {}
    if rope_parameters_raw and not (FULL in rope_parameters_raw or SLIDING in rope_parameters_raw):
        # transformers ignores such a dict for Gemma 3 (its layers read only the per-type entries), so
        # its values would be lost either way: a config that means them has to say which layers they are for
        raise ConfigError(f"{where}: field 'rope_parameters' must be keyed by layer type ('{FULL}', '{SLIDING}') "
                          f"for Gemma 3, found keys {sorted(map(str, rope_parameters_raw))}")
    entries = {}
    for lt in (FULL, SLIDING):
        entry = rope_parameters_raw.get(lt)
        if entry is not None and not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: field 'rope_parameters.{lt}' must be an object, found {shown(entry)}")
        entries[lt] = dict(entry or {})
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ConfigError(f"{where}: field 'rope_scaling' must be an object, found {shown(scaling)}")
    entries[FULL].update(scaling or {})
    entries[FULL].setdefault("rope_theta", f.number("rope_theta", DEFAULT_ROPE_THETA[FULL]))
    entries[SLIDING].setdefault("rope_theta", f.number("rope_local_base_freq", DEFAULT_ROPE_THETA[SLIDING]))
    names = {lt: f"rope_parameters.{lt}" for lt in (FULL, SLIDING)}
    if scaling:  # the field the user wrote: 4.x's alone, or both
        names[FULL] = f"{names[FULL]}' and 'rope_scaling" if FULL in rope_parameters_raw else "rope_scaling"
    rope = {lt: _rope_from_dict(entries[lt], DEFAULT_ROPE_THETA[lt], where, names[lt]) for lt in (FULL, SLIDING)}
    notes = []
    if scaling and "rope_type" not in entries[FULL] and "type" in scaling and rope[FULL].factor != 1.0:
        notes.append(f"{where}: 'rope_scaling' gives 'type': {scaling['type']!r} (transformers 4's key), applied to the "
                     "full-attention layers as transformers 4 does; transformers 5 keeps their default RoPE, so its "
                     "logits for this checkpoint differ (write 'rope_type' to say which is meant)")

    top = _Fields(raw, where)
    # transformers' Gemma3TextConfig defaults for what Gemma 3's multimodal configs on the Hub leave out of
    # their text_config (the 4B, 12B and 27B: vocab_size and the head counts); the weights' shapes are
    # checked against them, and an error they lead to says they were taken (GemmaConfig.defaults_taken)
    defaulted = tuple(k for k in ("vocab_size", "num_attention_heads", "num_key_value_heads") if k not in cfg)
    vocab_size = f.int("vocab_size", 262_208)

    def given(key: str, default):  # the top level's value (a multimodal config's), or the default
        return default if _no_ids(raw.get(key)) else raw[key]

    # Gemma's stop ids where the config names none, those the vocabulary holds (a default is not named
    # as the file's own in an error)
    eos = f.token_ids("eos_token_id", given("eos_token_id", list(GemmaConfig.default_eos_token_ids(vocab_size))
                                           or list(DEFAULT_STOP_TOKEN_IDS)))
    bos = f.token_ids("bos_token_id", given("bos_token_id", BOS_TOKEN_ID))[0]
    pad = f.token_ids("pad_token_id", given("pad_token_id", PAD_TOKEN_ID))[0]
    config = GemmaConfig(
        vocab_size=vocab_size,
        hidden_size=f.int("hidden_size"),
        intermediate_size=f.int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=f.int("num_attention_heads", 8),
        num_key_value_heads=f.int("num_key_value_heads", 4),
        head_dim=f.int("head_dim", 256),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6),
        sliding_window=f.int("sliding_window", 4096),
        layer_types=layer_types,
        rope_parameters=rope,
        query_pre_attn_scalar=f.number("query_pre_attn_scalar", 256),
        max_position_embeddings=f.int("max_position_embeddings", 131072),
        tie_word_embeddings=top.boolean("tie_word_embeddings", f.boolean("tie_word_embeddings", True)),
        final_logit_softcapping=f.optional_number("final_logit_softcapping"),
        attn_logit_softcapping=f.optional_number("attn_logit_softcapping"),
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        notes=tuple(notes),
        defaulted=defaulted,
    )
    return config.validate(where)


def load_hf_config(path: Path) -> GemmaConfig:
    """Read and validate ``config.json``.

    Raises:
        ConfigError: unreadable JSON or an invalid configuration (see :func:`config_from_hf_dict`).
    """
    from .text_files import non_regular

    if (what := non_regular(Path(path))) is not None:
        raise ConfigError(f"{path}: is {what}; a transformers model folder needs its config.json file")
    if not Path(path).is_file():
        raise ConfigError(f"{path}: missing; a transformers model folder needs its config.json")
    return config_from_hf_dict(_read_json(Path(path), "a config.json"), str(path))


def _read_json(path: Path, what: str) -> Any:
    """The JSON value of a small file (a byte-order mark allowed, as other text files).

    Raises:
        ConfigError: larger than any config, unreadable, not UTF-8 or not JSON (named).
    """
    from .errors import FormatError
    from .text_files import read_bounded

    try:
        return json.loads(read_bounded(path, what).decode("utf-8").removeprefix("\ufeff"))
    except FormatError as exc:  # larger than any config
        raise ConfigError(str(exc)) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {str(exc)[:200]}") from None


def with_generation_config(config: GemmaConfig, path: Path) -> GemmaConfig:
    """``config`` with the ``eos_token_id`` of a transformers ``generation_config.json`` added to its
    stop ids (config.json's first), when that file exists. transformers' ``generate`` stops at the
    generation config's ids: Gemma 3 270M's and FunctionGemma's ``config.json`` name ``<eos>`` (1)
    alone, their ``generation_config.json`` ``<eos>`` and ``<end_of_turn>`` (1 and 106).

    Raises:
        ConfigError: the file is not a readable JSON object, or its ``eos_token_id`` is not token ids
            within the vocabulary (named).
    """
    from .text_files import non_regular

    path = Path(path)
    if (what := non_regular(path)) is not None:
        raise ConfigError(f"{path}: is {what}; expected a transformers generation config file or none")
    if not path.is_file():
        return config
    raw = _read_json(path, "a generation_config.json")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: expected a JSON object, found {shown(raw)}")
    if raw.get("eos_token_id") in (None, []):  # none given (transformers accepts an empty list)
        return config
    eos = _Fields(raw, str(path)).token_ids("eos_token_id", None, below=config.vocab_size)
    return dataclasses.replace(config, eos_token_id=tuple(dict.fromkeys((*config.eos_token_id, *eos))))


def config_from_gguf_metadata(meta: Mapping[str, Any], vocab_rows: int, tied: bool, where: str) -> GemmaConfig:
    """Build a :class:`GemmaConfig` from the ``gemma3.*`` keys of a llama.cpp GGUF.

    GGUF carries no layer pattern, no local RoPE base and no ``query_pre_attn_scalar``: these follow
    llama.cpp's ``llama-model.cpp`` for ``LLM_ARCH_GEMMA3`` (global iff ``i % 6 == 5``, local base
    10,000, attention scale ``key_length ** -0.5``, except for the 62-layer 27B model, whose scale is
    ``(embedding_length / head_count) ** -0.5``: llama.cpp picks it by model size, as Google's
    gemma_pytorch config does). ``vocab_size`` is the number of rows of
    ``token_embd`` (may be 262,153, not 262,144).

    Raises:
        ConfigError: wrong architecture, a missing key or an unsupported RoPE scaling type.
    """
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ConfigError(f"{where}: general.architecture is {arch!r}, expected 'gemma3'")

    f = _Fields(meta, where, "gemma3.")
    num_layers = f.int("block_count")
    head_dim = f.int("attention.key_length")
    value_length = f.int("attention.value_length", head_dim)
    if value_length != head_dim:
        raise ConfigError(f"{where}: attention.value_length is {value_length}, expected key_length {head_dim} "
                          "(Gemma 3 attends with one head_dim)")
    scaling_type = meta.get("gemma3.rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):  # as the transformers path: default and linear only
        found = repr(scaling_type) if isinstance(scaling_type, str) else f"{shown(scaling_type)}, not a string"
        raise ConfigError(f"{where}: gemma3.rope.scaling.type is {found}, expected 'none' or 'linear'")
    factor = f.number("rope.scaling.factor", 1.0)
    linear = scaling_type == "linear" and factor != 1.0
    full_rope = RopeParameters(rope_theta=f.number("rope.freq_base", DEFAULT_ROPE_THETA[FULL]),
                               rope_type="linear" if linear else "default", factor=factor if linear else 1.0)
    tokens = _Fields(meta, where, "tokenizer.ggml.")
    eos = tokens.token_ids("eos_token_id", EOS_TOKEN_ID, below=vocab_rows)[0]
    # Gemma's <end_of_turn> (106) also stops generation; llama.cpp's Gemma 3 files may not say so
    eot = tokens.token_ids("eot_token_id", END_OF_TURN_TOKEN_ID if vocab_rows > END_OF_TURN_TOKEN_ID else eos,
                           below=vocab_rows)[0]
    return GemmaConfig(
        vocab_size=int(vocab_rows),
        hidden_size=f.int("embedding_length"),
        intermediate_size=f.int("feed_forward_length"),
        num_hidden_layers=num_layers,
        num_attention_heads=f.int("attention.head_count"),
        num_key_value_heads=f.int("attention.head_count_kv"),
        head_dim=head_dim,
        rms_norm_eps=f.number("attention.layer_norm_rms_epsilon"),
        sliding_window=f.int("attention.sliding_window"),
        layer_types=gemma3_layer_types(num_layers),
        rope_parameters={FULL: full_rope, SLIDING: RopeParameters(DEFAULT_ROPE_THETA[SLIDING])},
        # llama.cpp: f_attention_scale = 1/sqrt(n_embd / n_head) for LLM_TYPE_27B (62 layers), else 1/sqrt(head_dim)
        query_pre_attn_scalar=(f.int("embedding_length") / f.int("attention.head_count") if num_layers == 62
                               else float(head_dim)),
        max_position_embeddings=f.int("context_length"),
        tie_word_embeddings=tied,
        bos_token_id=tokens.token_ids("bos_token_id", BOS_TOKEN_ID, below=vocab_rows)[0],
        eos_token_id=tuple(dict.fromkeys((eos, eot))),
        pad_token_id=tokens.token_ids("padding_token_id", PAD_TOKEN_ID, below=vocab_rows)[0],
    ).validate(where, names={field: "gemma3." + key for field, key in (
        ("num_attention_heads", "attention.head_count"), ("num_key_value_heads", "attention.head_count_kv"),
        ("head_dim", "attention.key_length"), ("hidden_size", "embedding_length"),
        ("intermediate_size", "feed_forward_length"), ("num_hidden_layers", "block_count"),
        ("max_position_embeddings", "context_length"), ("sliding_window", "attention.sliding_window"))})
