"""Calibration statistics for GPTQ: the inputs of every projection and of the LM head on real text.

:func:`collect` runs the fp32 model over a calibration text with numpy, one layer at a time (only
that layer's weights are read), and keeps the activations each weight consumes:

* ``q_proj``/``k_proj``/``v_proj``: the output of ``input_layernorm`` (one array shared by three);
* ``o_proj``: the attention context ``[T, heads · head_dim]``;
* ``gate_proj``/``up_proj``: the output of ``pre_feedforward_layernorm``;
* ``down_proj``: ``gelu_tanh(gate) · up``;
* the embedding table (as LM head): the output of the final norm.

:meth:`Calibration.hessian` turns them into ``Xᵀ X`` on demand, so memory holds ``T × (hidden +
heads·head_dim + hidden + intermediate)`` values per layer, stored as float16 where they fit (for
the 270M and 1,024 tokens: 9 MB per layer), rather than ``K × K`` per weight.

The math follows transformers' ``Gemma3ForCausalLM`` (eager attention), as the ONNX graph does
(``builder.py``): scaled embedding, sandwich RMSNorm ``x / sqrt(mean(x²) + eps) · (1 + w)``,
per-head q/k RMSNorm, rotate-half RoPE with the layer type's base and linear factor, causal
attention limited to ``sliding_window`` on sliding layers, ``query_pre_attn_scalar ** -0.5``,
GeGLU with tanh GELU. Tests compare :func:`collect`'s final hidden state with transformers.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .checkpoint import EMBED, FINAL_NORM, LM_HEAD, Checkpoint
from .errors import ConfigError, GemmaExportError, SourceNotFoundError
from .text_files import read_text_file

#: calibration tokens by default. On the real 270M (int8, teacher-forced over the Python license),
#: GPTQ statistics from 512 tokens gave KL 0.00079, from 2,048 tokens 0.00067 (docs/quality.md).
DEFAULT_CALIBRATION_TOKENS = 1024
#: fewer tokens than this give GPTQ no statistics worth the name: refused
MIN_CALIBRATION_TOKENS = 16
#: more are refused: the numpy pass holds a ``T × T`` attention matrix per head and ``T`` activations
#: per layer (4,096 tokens of the 270M: ~0.3 GB and ~0.6 GB on top of the export's own peak)
MAX_CALIBRATION_TOKENS = 4096


def default_calibration_text() -> tuple[str, str]:
    """``(text, source)``: Python's own documentation topics (``pydoc_data.topics``, shipped with
    CPython): real English by other authors, and a different text from the quality benchmark's
    Python license.

    Raises:
        SourceNotFoundError: this Python was built without ``pydoc_data``.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise SourceNotFoundError("--calibration-text: this Python has no pydoc_data (its documentation topics); pass a text file") from None
    return "\n\n".join(topics[key] for key in sorted(topics)), "pydoc_data.topics (Python documentation)"


def calibration_text(path: str | Path | None) -> tuple[str, str]:
    """``(text, source)`` from a UTF-8 file, or the default text when ``path`` is None.

    Raises:
        SourceNotFoundError: no such file, or unreadable; FormatError: not UTF-8; ConfigError: empty.
    """
    if path is None:
        return default_calibration_text()
    path = Path(path)
    text = read_text_file(path, "calibration text file")
    if not text.strip():
        raise ConfigError(f"{path}: the calibration text is empty")
    return text, str(path)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * (np.float32(1.0) + weight)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.float32(np.sqrt(2.0 / np.pi)) * (x + np.float32(0.044715) * x * x * x)))


def _rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE over the full head_dim: ``x`` ``[heads, T, D]``, ``inv_freq`` ``[D / 2]``."""
    d = x.shape[-1]
    angles = positions[:, None].astype(np.float64) * np.concatenate([inv_freq, inv_freq])[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    half = d // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


@dataclasses.dataclass
class Calibration:
    """Inputs of each weight on the calibration text.

    Attributes:
        inputs: weight name → float16 (or float32) ``[T, in_features]`` (arrays shared by weights
            that read the same input).
        tokens: number of calibration tokens ``T``.
        source: where the text came from, for the manifest.
    """

    inputs: dict[str, np.ndarray]
    tokens: int
    source: str

    def hessian(self, name: str) -> np.ndarray | None:
        """``Xᵀ X`` (float64 ``[K, K]``) of the inputs of weight ``name``; None when not collected."""
        x = self.inputs.get(name)
        if x is None:
            return None
        x64 = x.astype(np.float64)
        return x64.T @ x64


def forward(checkpoint: Checkpoint, token_ids: Sequence[int],
            record: Callable[[str, np.ndarray], None] | None = None,
            progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """fp32 forward of ``token_ids`` (one sequence, positions 0…T−1); returns the final normed
    hidden state ``[T, hidden]`` (the LM head's input) and calls ``record(weight_name, input)``
    for each projection input.

    Raises:
        GemmaExportError: a token id outside the vocabulary.
    """
    c = checkpoint.config
    ids = np.asarray(token_ids, np.int64)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= c.vocab_size:
        raise GemmaExportError(f"calibration token ids must lie in [0, {c.vocab_size}), found "
                               f"{'none' if ids.size == 0 else f'{ids.min()}..{ids.max()}'}")
    record = record or (lambda _name, _x: None)
    t = len(ids)
    table = checkpoint.tensors[EMBED].rows()
    x = np.stack([table[int(i):int(i) + 1][0] for i in ids]).astype(np.float32) * np.float32(c.embed_scale)
    positions = np.arange(t)
    distance = positions[:, None] - positions[None, :]                  # q - k
    masks = {"full_attention": distance >= 0,
             "sliding_attention": (distance >= 0) & (distance < c.sliding_window)}
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    groups = heads // kv_heads
    eps = c.rms_norm_eps
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        w = lambda name: checkpoint.tensors[p + name].load()  # noqa: E731
        layer_type = c.layer_types[layer]
        inv_freq = c.rope_parameters[layer_type].inv_freq(d, np.float64)

        h = _rms_norm(x, w("input_layernorm.weight"), eps)
        for proj in ("q_proj", "k_proj", "v_proj"):
            record(f"{p}self_attn.{proj}.weight", h)
        q = (h @ w("self_attn.q_proj.weight").T).reshape(t, heads, d)
        k = (h @ w("self_attn.k_proj.weight").T).reshape(t, kv_heads, d)
        v = (h @ w("self_attn.v_proj.weight").T).reshape(t, kv_heads, d).transpose(1, 0, 2)
        q = _rope(_rms_norm(q, w("self_attn.q_norm.weight"), eps).transpose(1, 0, 2), positions, inv_freq)
        k = _rope(_rms_norm(k, w("self_attn.k_norm.weight"), eps).transpose(1, 0, 2), positions, inv_freq)
        k, v = np.repeat(k, groups, axis=0), np.repeat(v, groups, axis=0)   # repeat_kv
        # no attention soft-capping, as in the exported graph (transformers' Gemma3Attention ignores it)
        scores = (q @ k.transpose(0, 2, 1)) * np.float32(c.attention_scale)    # [H, T, T]
        scores = np.where(masks[layer_type][None], scores, np.float32(-np.inf))
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        context = ((scores / scores.sum(axis=-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(t, heads * d)
        record(f"{p}self_attn.o_proj.weight", context)
        x = x + _rms_norm(context @ w("self_attn.o_proj.weight").T, w("post_attention_layernorm.weight"), eps)

        h = _rms_norm(x, w("pre_feedforward_layernorm.weight"), eps)
        record(f"{p}mlp.gate_proj.weight", h)
        record(f"{p}mlp.up_proj.weight", h)
        inner = _gelu_tanh(h @ w("mlp.gate_proj.weight").T) * (h @ w("mlp.up_proj.weight").T)
        record(f"{p}mlp.down_proj.weight", inner)
        x = x + _rms_norm(inner @ w("mlp.down_proj.weight").T, w("post_feedforward_layernorm.weight"), eps)
        if progress:
            progress(layer + 1, c.num_hidden_layers)
    final = _rms_norm(x, checkpoint.tensors[FINAL_NORM].load(), eps)
    record(LM_HEAD if not checkpoint.tied else EMBED, final)
    return final


def collect(checkpoint: Checkpoint, token_ids: Sequence[int], source: str = "",
            progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Run :func:`forward` over ``token_ids`` and keep every weight's input (see the module doc).

    Raises:
        GemmaExportError: fewer than 2 tokens, or a token id outside the vocabulary.
    """
    if len(token_ids) < 2:
        raise GemmaExportError(f"calibration needs at least 2 tokens, found {len(token_ids)}")
    inputs: dict[str, np.ndarray] = {}
    last: list = [None, None]  # (array, stored copy): q/k/v and gate/up are recorded back to back

    def record(name: str, x: np.ndarray) -> None:
        # float16 halves the memory (the statistics need ~3 digits); float32 where values exceed its range
        if last[0] is not x:
            last[:] = [x, x.astype(np.float16) if np.abs(x).max() < 6e4 else np.ascontiguousarray(x, np.float32)]
        inputs[name] = last[1]

    forward(checkpoint, token_ids, record, progress)
    return Calibration(inputs=inputs, tokens=len(token_ids), source=source)
