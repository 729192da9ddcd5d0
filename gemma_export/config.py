"""Gemma 3 text-model configuration, read from a transformers ``config.json`` (4.x or 5.x form) or
from GGUF metadata, validated once so that the graph builder can trust it.

Field names follow transformers' ``Gemma3TextConfig``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError

SLIDING = "sliding_attention"
FULL = "full_attention"

#: Defaults of transformers' ``Gemma3TextConfig`` (used only where a source omits a field that
#: transformers itself would default).
_DEFAULT_ROPE_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_SUPPORTED_ROPE_TYPES = ("default", "linear")
_SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
_TEXT_MODEL_TYPES = ("gemma3_text", "gemma3")


@dataclasses.dataclass(frozen=True)
class RopeParameters:
    """RoPE for one layer type: ``inv_freq = 1 / rope_theta ** (arange(0, head_dim, 2) / head_dim)``,
    divided by ``factor`` for ``rope_type == "linear"`` (transformers ``_compute_linear_scaling_rope_parameters``)."""

    rope_theta: float
    rope_type: str = "default"
    factor: float = 1.0


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
    attn_logit_softcapping: float | None = None
    bos_token_id: int = 2
    eos_token_id: tuple[int, ...] = (1, 106)
    pad_token_id: int = 0

    # ---- derived values -------------------------------------------------------------------------
    @property
    def num_key_value_groups(self) -> int:
        """Query heads per KV head (4 for the 270M: 4 query heads share 1 KV head)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def embed_scale(self) -> float:
        """``sqrt(hidden_size)``, the factor Gemma multiplies token embeddings by (25.2982 for 640)."""
        return math.sqrt(self.hidden_size)

    @property
    def attention_scale(self) -> float:
        """``query_pre_attn_scalar ** -0.5`` (1/16 for the 270M)."""
        return self.query_pre_attn_scalar**-0.5

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (used in manifests)."""
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["eos_token_id"] = list(self.eos_token_id)
        d["rope_parameters"] = {k: dataclasses.asdict(v) for k, v in self.rope_parameters.items()}
        return d

    # ---- validation -----------------------------------------------------------------------------
    def validate(self, where: str) -> "GemmaConfig":
        """Check that the fields agree with each other.

        Raises:
            ConfigError: naming ``where`` (the file) and the contradicting fields.
        """
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: field '{name}' must be a positive integer, found {value!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ConfigError(f"{where}: field 'sliding_window' must be a positive integer, found {self.sliding_window!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"{where}: num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"{where}: head_dim must be even for rotate-half RoPE, found {self.head_dim}")
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
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"{where}: rms_norm_eps must be > 0, found {self.rms_norm_eps}")
        if not self.query_pre_attn_scalar > 0:
            raise ConfigError(f"{where}: query_pre_attn_scalar must be > 0, found {self.query_pre_attn_scalar}")
        return self


def _require(cfg: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: missing required field '{key}'")
    return cfg[key]


def _layer_types_from_pattern(num_layers: int, pattern: int) -> tuple[str, ...]:
    # transformers Gemma3TextConfig: layer i is global iff (i + 1) % sliding_window_pattern == 0.
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _rope_from_dict(d: Mapping[str, Any], default_theta: float, where: str) -> RopeParameters:
    rope_type = d.get("rope_type", d.get("type", "default"))
    return RopeParameters(
        rope_theta=float(d.get("rope_theta", default_theta)),
        rope_type=str(rope_type),
        factor=float(d.get("factor", 1.0)) if rope_type == "linear" else 1.0,
    )


def config_from_hf_dict(raw: Mapping[str, Any], where: str) -> GemmaConfig:
    """Build a :class:`GemmaConfig` from a parsed ``config.json``.

    Accepts the transformers 4.x form (``rope_theta``, ``rope_local_base_freq``, ``rope_scaling``,
    ``sliding_window_pattern``) and the 5.x form (``rope_parameters`` keyed by layer type), for
    ``model_type`` ``gemma3_text`` or a multimodal ``gemma3`` whose ``text_config`` holds the decoder.

    Raises:
        ConfigError: unknown architecture, a missing or contradicting field.
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in _TEXT_MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type is {model_type!r}, expected one of {', '.join(_TEXT_MODEL_TYPES)} (Gemma 3)"
        )
    cfg: Mapping[str, Any] = raw
    if model_type == "gemma3":
        cfg = raw.get("text_config") or {}
        if not isinstance(cfg, Mapping):
            raise ConfigError(f"{where}: 'text_config' must be an object")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in _SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"{where}: hidden_activation is {cfg.get('hidden_activation')!r}, expected 'gelu_pytorch_tanh'"
        )
    if cfg.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is true; Gemma 3 projections have no bias")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError(f"{where}: use_bidirectional_attention is true; only causal decoders export")

    num_layers = _require(cfg, "num_hidden_layers", where)
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        layer_types = tuple(cfg["layer_types"])
    else:
        pattern = cfg.get("sliding_window_pattern", _DEFAULT_SLIDING_WINDOW_PATTERN)
        if not isinstance(pattern, int) or pattern <= 0:
            raise ConfigError(f"{where}: sliding_window_pattern must be a positive integer, found {pattern!r}")
        layer_types = _layer_types_from_pattern(int(num_layers), pattern)

    rope_parameters_raw = cfg.get("rope_parameters")
    if isinstance(rope_parameters_raw, Mapping) and (FULL in rope_parameters_raw or SLIDING in rope_parameters_raw):
        # transformers 5.x: one entry per layer type.
        rope = {
            lt: _rope_from_dict(rope_parameters_raw.get(lt) or {}, _DEFAULT_ROPE_THETA[lt], where)
            for lt in (FULL, SLIDING)
        }
    else:
        # transformers 4.x: global base + scaling, local base separately (local is never scaled).
        scaling = cfg.get("rope_scaling") or rope_parameters_raw or {}
        full = dict(scaling)
        full.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA[FULL]))
        rope = {
            FULL: _rope_from_dict(full, _DEFAULT_ROPE_THETA[FULL], where),
            SLIDING: RopeParameters(float(cfg.get("rope_local_base_freq", _DEFAULT_ROPE_THETA[SLIDING]))),
        }

    hidden = _require(cfg, "hidden_size", where)
    heads = _require(cfg, "num_attention_heads", where)
    head_dim = cfg.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) else None)
    eos = cfg.get("eos_token_id", raw.get("eos_token_id", [1, 106]))
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    try:
        config = GemmaConfig(
            vocab_size=_require(cfg, "vocab_size", where),
            hidden_size=hidden,
            intermediate_size=_require(cfg, "intermediate_size", where),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=_require(cfg, "num_key_value_heads", where),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            sliding_window=cfg.get("sliding_window", 4096),
            layer_types=layer_types,
            rope_parameters=rope,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            max_position_embeddings=cfg.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            attn_logit_softcapping=cfg.get("attn_logit_softcapping"),
            bos_token_id=int(cfg.get("bos_token_id", raw.get("bos_token_id", 2))),
            eos_token_id=tuple(int(e) for e in eos_ids),
            pad_token_id=int(cfg.get("pad_token_id", raw.get("pad_token_id", 0)) or 0),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: a field has the wrong type: {exc}") from None
    return config.validate(where)


def load_hf_config(path: Path) -> GemmaConfig:
    """Read and validate ``config.json``.

    Raises:
        ConfigError: unreadable JSON or an invalid configuration (see :func:`config_from_hf_dict`).
    """
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read JSON: {exc}") from None
    return config_from_hf_dict(raw, str(path))


def config_from_gguf_metadata(meta: Mapping[str, Any], vocab_rows: int, tied: bool, where: str) -> GemmaConfig:
    """Build a :class:`GemmaConfig` from the ``gemma3.*`` keys of a llama.cpp GGUF.

    GGUF carries no layer pattern, no local RoPE base and no ``query_pre_attn_scalar``: these follow
    llama.cpp's ``llama-model.cpp`` for ``LLM_ARCH_GEMMA3`` (global iff ``i % 6 == 5``, local base
    10,000, attention scale ``key_length ** -0.5``). ``vocab_size`` is the number of rows of
    ``token_embd`` (may be 262,153, not 262,144).

    Raises:
        ConfigError: wrong architecture or a missing key.
    """
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ConfigError(f"{where}: general.architecture is {arch!r}, expected 'gemma3'")

    def get(key: str) -> Any:
        full = f"gemma3.{key}"
        if full not in meta:
            raise ConfigError(f"{where}: missing GGUF metadata key '{full}'")
        return meta[full]

    num_layers = int(get("block_count"))
    head_dim = int(get("attention.key_length"))
    value_dim = int(meta.get("gemma3.attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ConfigError(f"{where}: attention.value_length {value_dim} differs from key_length {head_dim}")
    scaling_type = meta.get("gemma3.rope.scaling.type", "none")
    factor = float(meta.get("gemma3.rope.scaling.factor", 1.0))
    full_rope = RopeParameters(
        rope_theta=float(meta.get("gemma3.rope.freq_base", _DEFAULT_ROPE_THETA[FULL])),
        rope_type="linear" if scaling_type == "linear" and factor != 1.0 else "default",
        factor=factor if scaling_type == "linear" else 1.0,
    )
    eos = meta.get("tokenizer.ggml.eos_token_id", 1)
    eot = meta.get("tokenizer.ggml.eot_token_id", 106)
    return GemmaConfig(
        vocab_size=int(vocab_rows),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=num_layers,
        num_attention_heads=int(get("attention.head_count")),
        num_key_value_heads=int(get("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        sliding_window=int(get("attention.sliding_window")),
        layer_types=tuple(FULL if i % 6 == 5 else SLIDING for i in range(num_layers)),
        rope_parameters={FULL: full_rope, SLIDING: RopeParameters(_DEFAULT_ROPE_THETA[SLIDING])},
        query_pre_attn_scalar=float(head_dim),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=tied,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 2)),
        eos_token_id=tuple(dict.fromkeys((int(eos), int(eot)))),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    ).validate(where)
