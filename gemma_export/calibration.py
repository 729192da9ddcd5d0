"""Calibration statistics for GPTQ: the inputs of every projection and of the LM head on real text.

:func:`collect` runs the fp32 model over a calibration text with numpy, one layer at a time (only
that layer's weights are read), and keeps the activations each weight consumes:

* ``q_proj``/``k_proj``/``v_proj``: the output of ``input_layernorm`` (one array shared by three);
* ``o_proj``: the attention context ``[T, heads · head_dim]``;
* ``gate_proj``/``up_proj``: the output of ``pre_feedforward_layernorm``;
* ``down_proj``: ``gelu_tanh(gate) · up``;
* the embedding table (as LM head): the output of the final norm.

:meth:`Calibration.hessian` turns them into ``Xᵀ X`` on demand. Each input is kept in whichever
form is smaller: the activations ``[T, K]`` as float16 where they fit (for the 270M and 1,024
tokens: 9 MB per layer), or, when ``T > 2 K``, ``Xᵀ X`` itself as float32 ``[K, K]`` (4,096 tokens:
24 MB per layer instead of 36 MB).

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
from .config import SLIDING
from .errors import ConfigError, GemmaExportError, NumericError, SourceNotFoundError
from .text_files import read_text_file, text_bytes_for

#: calibration tokens by default. On the real 270M (int8, teacher-forced over the Python license,
#: docs/quality.md): GPTQ statistics from 1,024 tokens gave top-1 98.37% and KL 0.00131, from 4,096
#: tokens (GPTQ in act order) 98.66% and 0.00105, for ~25 s more export time and a peak still near
#: 1.3 GB; 8,192 tokens gave no lower KL.
DEFAULT_CALIBRATION_TOKENS = 4096
#: fewer tokens than this give GPTQ no statistics worth the name: refused
MIN_CALIBRATION_TOKENS = 16
#: more are refused: the numpy pass's time grows with ``T`` (``T²`` on the full-attention layers)
#: while the kept statistics stop growing at ``T = 2 K`` per input (~0.44 GB for the 270M)
MAX_CALIBRATION_TOKENS = 16384
#: queries per attention block of the numpy pass (memory: heads × block × T scores)
_QUERY_BLOCK = 256


def default_calibration_text() -> tuple[str, str]:
    """``(text, source)``: Python's own documentation topics (``pydoc_data.topics``, shipped with
    CPython): real English by other authors, and a different text from the quality benchmark's
    Python license.

    Returns:
        ``(text, source)``: the topics joined by blank lines in key order, and a description of
        where the text comes from, for the manifest.

    Raises:
        SourceNotFoundError: this Python was built without ``pydoc_data``.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise SourceNotFoundError("--calibration-text: this Python has no pydoc_data (its documentation topics); pass a text file") from None
    return "\n\n".join(topics[key] for key in sorted(topics)), "pydoc_data.topics (Python documentation)"


def calibration_text(path: str | Path | None, tokens: int | None = None) -> tuple[str, str]:
    """``(text, source)`` from a UTF-8 file, or the default text when ``path`` is None.

    Args:
        path: a UTF-8 text file (a leading byte-order mark is dropped), or None for
            :func:`default_calibration_text`.
        tokens: the calibration tokens that will be taken from it: only the file's first
            max(:data:`~gemma_export.text_files.TEXT_BYTES_READ`, 64 × (tokens + 1)) bytes are read
            (real text has ~4 bytes a token); None: the whole file.

    Returns:
        ``(text, source)``: the text read and the path as given (or the default's description).

    Raises:
        SourceNotFoundError: no such file, or unreadable (or, default text, no ``pydoc_data``).
        FormatError: not UTF-8.
        ConfigError: empty or whitespace only.
    """
    if path is None:
        return default_calibration_text()
    path = Path(path)
    # a prefix of a huge file is enough: the first `tokens` tokens are all that calibration runs
    max_bytes = None if tokens is None else text_bytes_for(tokens + 1)
    text = read_text_file(path, "calibration text file", max_bytes)
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
    """Inputs of each weight on the calibration text, or their ``Xᵀ X`` where that is smaller.

    Attributes:
        inputs: weight name → float16 (or float32) ``[T, in_features]`` (arrays shared by weights
            that read the same input), for inputs with ``T ≤ 2 · in_features``.
        hessians: weight name → float32 ``Xᵀ X`` ``[in_features, in_features]`` (shared likewise),
            for longer calibration texts, whose activations would take more memory than the matrix.
        tokens: number of calibration tokens ``T``.
        source: where the text came from, for the manifest.
    """

    inputs: dict[str, np.ndarray]
    tokens: int
    source: str
    hessians: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def statistics(self, name: str) -> np.ndarray | None:
        """What is kept for weight ``name`` (its inputs or their ``Xᵀ X``; the same object for
        weights that read the same input); None when not collected.

        Args:
            name: a transformers weight name, e.g. ``model.layers.0.self_attn.q_proj.weight``.

        Returns:
            float16 or float32 ``[T, K]`` (from :attr:`inputs`), float32 ``[K, K]`` (from
            :attr:`hessians`), or None; ``K`` the weight's in_features.
        """
        x = self.inputs.get(name)
        return self.hessians.get(name) if x is None else x

    def hessian(self, name: str) -> np.ndarray | None:
        """``Xᵀ X`` (float64 ``[K, K]``, a new array) of the inputs of weight ``name``; None when not
        collected. ``name`` as in :meth:`statistics`."""
        if name in self.hessians:
            return self.hessians[name].astype(np.float64)
        x = self.inputs.get(name)
        return None if x is None else gram(x)


def gram(x: np.ndarray) -> np.ndarray:
    """``Xᵀ X`` in float64 of ``x`` ``[T, K]`` (any float dtype): float64 ``[K, K]``, GPTQ's Hessian
    up to a constant factor (Frantar et al. 2022 use ``2 X Xᵀ`` with X as ``[K, T]``; the factor
    cancels in :func:`quant.gptq.gptq_codes`)."""
    x64 = x.astype(np.float64)
    return x64.T @ x64


def forward(checkpoint: Checkpoint, token_ids: Sequence[int],
            record: Callable[[str, np.ndarray], None] | None = None,
            progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """fp32 forward of ``token_ids`` (one sequence, positions 0…T−1); returns the final normed
    hidden state ``[T, hidden]`` (the LM head's input) and calls ``record(weight_name, input)``
    for each projection input.

    The math is transformers' ``Gemma3ForCausalLM`` with eager attention (``modeling_gemma3.py``):
    ``Gemma3RMSNorm`` (RMSNorm, Zhang & Sennrich 2019, with the gain ``1 + w``) in float32,
    rotate-half RoPE (Su et al. 2021, arXiv:2104.09864; transformers' ``apply_rotary_pos_emb``) with
    angles in float64, the tanh approximation of GELU (Hendrycks & Gimpel 2016, arXiv:1606.08415;
    transformers' ``gelu_pytorch_tanh``), and softmax attention in blocks of 256 queries. There is
    no attention soft-capping, as in the exported graph.

    Args:
        checkpoint: the model; its weights are read one layer at a time.
        token_ids: ``T`` ids, each in ``[0, vocab_size)``.
        record: called as ``record(weight_name, x)`` with ``x`` float32 ``[T, in_features]``, the
            same array for the weights that read one input (q/k/v, gate/up), and finally for the
            table (``lm_head.weight`` when untied) with the final hidden state.
        progress: called as ``progress(layers_done, num_hidden_layers)`` after each layer.

    Returns:
        float32 ``[T, hidden_size]``.

    Raises:
        GemmaExportError: no token ids, or a token id outside the vocabulary.
        FormatError: a weight read with another shape than its source declares (:meth:`TensorRef.load`).
        NumericError: a projection's input is not finite (float32 overflow), or ``record`` raised
            NumericError (e.g. its statistics overflow); the message names that input and the
            weight of largest magnitude read before it, the likely culprit; or a weight holds NaN
            or Inf (:meth:`TensorRef.load`).
    """
    # overflow shows as inf/nan in a projection's input, which record() below turns into one error
    # naming it (numpy's RuntimeWarnings would only add lines without the tensor's name)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _forward(checkpoint, token_ids, record, progress)


def _forward(checkpoint: Checkpoint, token_ids: Sequence[int],
             record: Callable[[str, np.ndarray], None] | None,
             progress: Callable[[int, int], None] | None) -> np.ndarray:
    c = checkpoint.config
    ids = np.asarray(token_ids, np.int64)
    if ids.size == 0 or ids.min() < 0 or ids.max() >= c.vocab_size:
        raise GemmaExportError(f"calibration token ids must lie in [0, {c.vocab_size}), found "
                               f"{'none' if ids.size == 0 else f'{ids.min()}..{ids.max()}'}")
    user_record = record or (lambda _name, _x: None)
    largest = ["", 0.0, ()]  # the weight of largest magnitude read so far: name, value, index

    def load(name: str) -> np.ndarray:
        array = checkpoint.tensors[name].load()
        if array.size:
            at = np.unravel_index(int(np.argmax(np.abs(array))), array.shape)
            if abs(float(array[at])) > abs(largest[1]):
                largest[:] = [name, float(array[at]), tuple(int(i) for i in at)]
        return array

    checked: list = [None]  # the last input found finite: q/k/v and gate/up share one

    def culprit() -> str:
        return (f"the largest weight read before it is {largest[0]}[{', '.join(map(str, largest[2]))}] = "
                f"{largest[1]:.3g}; the source's weights are out of range")

    def record(name: str, x: np.ndarray) -> None:
        if checked[0] is not x:
            if not np.isfinite(x).all():
                raise NumericError(f"calibration: the input of {name} is not finite (float32 overflow) on the "
                                   f"calibration text; {culprit()}")
            checked[0] = x
        try:
            user_record(name, x)
        except NumericError as exc:
            raise NumericError(f"{exc}; {culprit()}") from None

    t = len(ids)
    table = checkpoint.tensors[EMBED].rows()
    x = np.stack([table[int(i):int(i) + 1][0] for i in ids]).astype(np.float32) * np.float32(c.embed_scale)
    positions = np.arange(t)

    def mask(layer_type: str, first: int, start: int, end: int) -> np.ndarray:
        distance = positions[first:end, None] - positions[None, start:end]   # q - k, [block, keys]
        allowed = distance >= 0
        return allowed & (distance < c.sliding_window) if layer_type == SLIDING else allowed

    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    groups = c.num_key_value_groups
    eps = c.rms_norm_eps
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        w = lambda name: load(p + name)  # noqa: E731
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
        context = np.empty((heads, t, d), np.float32)
        # queries in blocks, each against the keys up to its last position (causal) and no further
        # back than the window on sliding layers: [H, block, ≤ end] instead of [H, T, T] scores,
        # whose temporaries took ~1 GB at 4,096 tokens
        for first in range(0, t, _QUERY_BLOCK):
            end = min(first + _QUERY_BLOCK, t)
            # keys a query of this block may see: from the window's start on sliding layers
            start = max(0, first - c.sliding_window + 1) if layer_type == SLIDING else 0
            # no attention soft-capping, as in the exported graph (transformers' Gemma3Attention ignores it)
            scores = (q[:, first:end] @ k[:, start:end].transpose(0, 2, 1)) * np.float32(c.attention_scale)
            scores = np.where(mask(layer_type, first, start, end)[None], scores, np.float32(-np.inf))
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            context[:, first:end] = (scores / scores.sum(axis=-1, keepdims=True)) @ v[:, start:end]
        context = context.transpose(1, 0, 2).reshape(t, heads * d)
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
    final = _rms_norm(x, load(FINAL_NORM), eps)
    record(LM_HEAD if not checkpoint.tied else EMBED, final)
    return final


def collect(checkpoint: Checkpoint, token_ids: Sequence[int], source: str = "",
            progress: Callable[[int, int], None] | None = None) -> Calibration:
    """Run :func:`forward` over ``token_ids`` and keep every weight's input (see the module doc).

    Args:
        checkpoint: the fp32 source.
        token_ids: ``T`` ids (``T ≥ 2``); the callers limit ``T`` to ``MAX_CALIBRATION_TOKENS``.
        source: where the text came from, stored as :attr:`Calibration.source`.
        progress: as in :func:`forward`.

    Returns:
        A :class:`Calibration`: per weight, float16 ``[T, K]`` inputs (float32 where a value
        reaches 6e4) when ``T ≤ 2 K``, else float32 ``Xᵀ X`` ``[K, K]``.

    Raises:
        GemmaExportError: fewer than 2 tokens, or a token id outside the vocabulary.
        NumericError: a weight's input or its statistics overflow float32 (:func:`forward`), or a
            weight holds NaN or Inf.
        FormatError: as :func:`forward`.
    """
    if len(token_ids) < 2:
        raise GemmaExportError(f"calibration needs at least 2 tokens, found {len(token_ids)}")
    inputs: dict[str, np.ndarray] = {}
    hessians: dict[str, np.ndarray] = {}
    last: list = [None, None]  # (array, what is kept of it): q/k/v and gate/up are recorded back to back
    t = len(token_ids)

    def record(name: str, x: np.ndarray) -> None:
        as_gram = t > 2 * x.shape[1]  # K × K float32 takes less than T × K float16
        if last[0] is not x:
            reach = float(np.abs(x).max())
            if t * reach ** 2 >= float(np.finfo(np.float32).max):  # sums of squares over the tokens
                raise NumericError(f"calibration: the statistics (sums of squares) of {name}'s input would "
                                   f"overflow float32: its values reach {reach:.3g}")
            if as_gram:
                kept = gram(x).astype(np.float32)
            else:  # float16 halves the memory (the statistics need ~3 digits); float32 beyond its range
                kept = x.astype(np.float16) if reach < 6e4 else np.ascontiguousarray(x, np.float32)
            last[:] = [x, kept]
        (hessians if as_gram else inputs)[name] = last[1]

    forward(checkpoint, token_ids, record, progress)
    return Calibration(inputs=inputs, tokens=t, source=source, hessians=hessians)
