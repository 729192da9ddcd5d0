"""The Gemma 3 decoder as an ONNX graph, built from a config and lazy weights (no tracing).

Read it beside transformers' ``modeling_gemma3.py``: one function per block, in forward order —
embedding, decoder layer (attention, MLP, sandwich norms), final norm, LM head. Weight storage is
delegated to a :class:`~gemma_export.weights.WeightFormat`, so this file is the same for every dtype.

I/O contract (onnxruntime-genai / Optimum convention), one graph for prefill (past = 0) and decode:

* inputs: ``input_ids`` int64 ``[batch, sequence_length]``; ``attention_mask`` int64
  ``[batch, total_sequence_length]`` (1 = real token, 0 = padding; total = past + sequence);
  ``position_ids`` int64 ``[batch, sequence_length]``; ``past_key_values.{i}.key|value`` float32
  ``[batch, num_key_value_heads, past_sequence_length, head_dim]``.
* optional input (an overridable initializer, default 0; runtimes that do not know it, such as
  onnxruntime-genai, leave it out): ``sliding_cache_start`` int64 scalar, the cache position of the
  first row the sliding layers' ``past_key_values`` hold. A runtime may drop the rows of positions
  that no longer fall in the window from the sliding layers' caches (``runtime.KVCache`` does);
  those layers then read ``attention_mask[:, sliding_cache_start:]`` and
  ``total_sequence_length − sliding_cache_start`` rows. Their caches' lengths are therefore named
  apart: ``sliding_past_sequence_length`` and ``sliding_total_sequence_length`` (equal to the full
  layers' lengths while ``sliding_cache_start`` is 0).
* outputs: ``logits`` float32 ``[batch, 1, vocab]`` (last position; all positions with
  ``all_logits``), ``present.{i}.key|value`` ``[batch, num_key_value_heads, total_sequence_length, head_dim]``
  (``sliding_total_sequence_length`` for a sliding layer).
* batch > 1 with a non-empty cache takes one new token per call: onnxruntime's
  ``GroupQueryAttention`` refuses ``sequence_length`` > 1 with a past at batch > 1 (prefill a batch
  in one call from an empty cache, then decode, as ``runtime.OnnxDecoder.greedy_batch`` does).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .checkpoint import EMBED, FINAL_NORM, LM_HEAD, Checkpoint, TensorRef
from .config import (DEBUG_BLOCKS, FULL, SLIDING, SLIDING_CACHE_START, SLIDING_LAYERS_KEY, SLIDING_WINDOW_KEY, GemmaConfig,
                     debug_output_name)
from .graph import MS_DOMAIN, GraphBuilder
from .weights import Table, WeightFormat

F32, I64 = ir.DataType.FLOAT, ir.DataType.INT64
#: Additive mask value: transformers' eager attention fills masked scores with finfo(float32).min.
MASK_VALUE = float(np.finfo(np.float32).min)


@dataclasses.dataclass
class _Shared:
    """Values computed once and used by every layer."""

    mask: dict[str, ir.Value]   # layer type → additive mask [batch, 1, seq, rows held + seq]
    cos: dict[str, ir.Value]    # layer type → [batch · seq, head_dim / 2]
    sin: dict[str, ir.Value]
    rope_index: ir.Value        # [batch, seq]: row of cos/sin for each token
    seqlens_k: dict[str, ir.Value]  # layer type → int32 [batch]: total − 1 (GroupQueryAttention's "seqlens_k")
    total_sequence_length: dict[str, ir.Value]  # layer type → int32 scalar: rows held + seq


def _weight(checkpoint: Checkpoint, name: str) -> TensorRef:
    return checkpoint.tensors[name]


def rms_norm(g: GraphBuilder, x: ir.Value, ref: TensorRef, eps: float) -> ir.Value:
    """Gemma RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * (1 + w)``, in float32.

    ``(1 + w)`` is folded into the stored gain at export (transformers ``Gemma3RMSNorm`` computes
    ``1.0 + weight`` at run time; the sum is exact in float32 for the weights seen in practice).
    Written as Pow/ReduceMean/Add/Sqrt/Div/Mul so that onnxruntime fuses it into
    SimplifiedLayerNormalization. RMSNorm: Zhang & Sennrich 2019 (arXiv:1910.07467).

    Args:
        x: float32 ``[..., n]``.
        ref: the norm's weight ``w``, ``[n]``; read now (not lazily) to store ``1 + w`` as a float32
            initializer under ``ref.name``.
        eps: added to the mean square.

    Returns:
        float32, the shape of ``x``.

    Raises:
        FormatError, NumericError: ``ref`` cannot be read, or holds NaN or Inf (:meth:`TensorRef.load`).
    """
    gain = g.initializer(ir.tensor((ref.load() + np.float32(1.0)).astype(np.float32), name=ref.name))
    mean_square = g.op("ReduceMean", g.op("Pow", x, g.const_f32(2.0)), g.const_i64([-1]), keepdims=1)
    normed = g.op("Div", x, g.op("Sqrt", g.op("Add", mean_square, g.const_f32(eps))))
    return g.op("Mul", normed, gain)


def rotary_embedding(g: GraphBuilder, position_ids: ir.Value, config: GemmaConfig, layer_type: str):
    """cos/sin ``[batch · seq, head_dim / 2]`` of each token's own position.

    ``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)`` (divided by ``factor`` for linear
    scaling), ``angle = position_ids * inv_freq`` (transformers ``Gemma3RotaryEmbedding``; its
    ``emb = concat(freqs, freqs)`` is the rotate-half layout :func:`apply_rotary` applies).
    Computed from the positions at run time: no position-table constant. RoPE: Su et al. 2021,
    "RoFormer" (arXiv:2104.09864).

    Args:
        position_ids: int64 ``[batch, seq]`` (cast to float32, exact below 2**24).
        layer_type: ``sliding_attention`` or ``full_attention``, selecting the base and factor.

    Returns:
        ``(cos, sin)``, float32 ``[batch · seq, head_dim / 2]`` each.

    Raises:
        KeyError: ``layer_type`` has no entry in ``config.rope_parameters`` (a validated config has both).
    """
    inv_freq = config.rope_parameters[layer_type].inv_freq(config.head_dim)
    positions = g.op("Reshape", g.op("Cast", position_ids, to=F32), g.const_i64([-1, 1]))  # [B·S, 1]
    angles = g.op("Mul", positions, g.const(inv_freq))                                     # [B·S, D/2]
    return g.op("Cos", angles), g.op("Sin", angles)


def rope_index(g: GraphBuilder, position_ids: ir.Value) -> ir.Value:
    """``[batch, seq]`` int64 ``0 … batch·seq − 1``: which row of the per-token cos/sin each token reads."""
    count = g.op("Squeeze", g.op("ReduceProd", g.op("Shape", position_ids), keepdims=1), g.const_i64([0]))
    index = g.op("Range", g.const(np.int64(0)), count, g.const(np.int64(1)))
    return g.op("Reshape", index, g.op("Shape", position_ids))


def apply_rotary(g: GraphBuilder, x: ir.Value, cos: ir.Value, sin: ir.Value, index: ir.Value) -> ir.Value:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]`` over each head's
    ``head_dim`` values of ``x`` ``[batch, seq, heads · head_dim]``: one onnxruntime
    ``RotaryEmbedding`` (com.microsoft, ``interleaved`` 0; the head size is read from ``cos``), reading
    the cos/sin row ``index[b, s]`` for token ``(b, s)`` (operator spec: onnxruntime
    docs/ContribOperators.md, ``com.microsoft.RotaryEmbedding``, whose ``position_ids`` input here
    carries :func:`rope_index`). Returns float32, the shape of ``x``."""
    return g.op("RotaryEmbedding", x, index, cos, sin, domain=MS_DOMAIN, interleaved=0)


def attention_bias(g: GraphBuilder, attention_mask: ir.Value, input_ids: ir.Value,
                   sliding_window: int | None) -> ir.Value:
    """Additive mask ``[batch, 1, seq, total]`` (0 = attend, finfo.min = masked) over the keys a
    layer's cache holds plus this call's: ``attention_mask`` int64 ``[batch, total]`` covers exactly
    those keys, in cache order.

    Query ``i`` of this call sits at row ``q = total − seq + i``; key row ``k`` is allowed when
    ``k <= q`` (causal), ``attention_mask[b, k] == 1`` (padding), and with a ``sliding_window`` also
    ``q - k < sliding_window`` (transformers ``sliding_window_overlay``: ``kv_idx > q_idx - window``).
    Rows are cache positions, not ``position_ids``, as in transformers; a cache that dropped its
    first rows shifts ``q`` and ``k`` alike, so the distances, and the mask, are the same.
    """
    # past = total − seq from the mask, not from past_key's shape: with a shared KV buffer
    # (GroupQueryAttention's past_present_share_buffer) past_key is longer than the past.
    total = g.op("Gather", g.op("Shape", attention_mask), g.const_i64([1]))   # [1]
    seq = g.op("Gather", g.op("Shape", input_ids), g.const_i64([1]))         # [1]
    past = g.op("Sub", total, seq)
    scalar = lambda v: g.op("Squeeze", v, g.const_i64([0]))  # noqa: E731
    query_index = g.op("Range", scalar(past), scalar(total), g.const(np.int64(1)))
    key_index = g.op("Range", g.const(np.int64(0)), scalar(total), g.const(np.int64(1)))
    distance = g.op("Sub", g.op("Unsqueeze", query_index, g.const_i64([1])), key_index)  # [S, T]: q - k
    causal = g.op("GreaterOrEqual", distance, g.const(np.int64(0)))
    not_padding = g.op("Unsqueeze", g.op("Cast", attention_mask, to=ir.DataType.BOOL), g.const_i64([1, 2]))
    allowed = g.op("And", causal, not_padding)                               # [B, 1, S, T]
    if sliding_window is not None:
        allowed = g.op("And", allowed, g.op("Less", distance, g.const(np.int64(sliding_window))))
    return g.op("Where", allowed, g.const_f32(0.0), g.const_f32(MASK_VALUE))


def embed_tokens(g: GraphBuilder, fmt: WeightFormat, ckpt: Checkpoint, input_ids: ir.Value) -> tuple[Table, ir.Value]:
    """The token embedding (transformers ``Gemma3TextScaledWordEmbedding``): the table row of each id
    times ``sqrt(hidden_size)``.

    ``input_ids``: int64 ``[B, S]``. Returns ``(table, hidden)``: the stored table (the format's
    one copy, which the LM head reads too when ``tie_word_embeddings``) and float32
    ``[B, S, hidden]``. The factor is rounded to float32 (25.298222 for 640), as transformers does
    in float32 and the reference export does; transformers in bf16 would round it to the weights'
    dtype (25.25).

    Raises:
        ConfigError: the table's shape does not fit the format's blocks or rotation
            (:meth:`WeightFormat.table`).
    """
    table = fmt.table(g, _weight(ckpt, EMBED))
    return table, g.op("Mul", fmt.embedding(g, table, input_ids), g.const_f32(np.float32(ckpt.config.embed_scale)))


def self_attention(g: GraphBuilder, fmt: WeightFormat, ckpt: Checkpoint, layer: int, x: ir.Value,
                   past_key: ir.Value, past_value: ir.Value, shared: _Shared):
    """Gemma 3 attention (transformers ``Gemma3Attention``, eager path).

    q/k/v projections, per-head RMSNorm on q and k, RoPE (local base on sliding layers, global base on
    full layers), keys/values appended to the cache, ``softmax(q k^T * query_pre_attn_scalar**-0.5 +
    mask) v`` with ``num_key_value_groups`` query heads per KV head, then ``o_proj``.

    The cache append and the attention itself are one onnxruntime ``GroupQueryAttention``
    (com.microsoft; BNSH cache, ``kv_num_heads`` KV heads shared by ``num_key_value_groups`` query
    heads each) fed the additive mask of :func:`attention_bias` as ``attention_bias``, so padding
    and the sliding window are exactly transformers' whatever the batch layout.

    ``x``: float32 ``[B, S, hidden]`` (after ``input_layernorm``); ``past_key``/``past_value``: float32
    ``[B, num_key_value_heads, past, head_dim]`` (BNSH). Returns ``(output [B, S, hidden],
    present_key, present_value)``, the presents ``[B, num_key_value_heads, past + S, head_dim]`` (or the
    shared buffer's capacity when the runtime binds one buffer as past and present).

    Raises:
        FormatError, NumericError: the q/k norm weights cannot be read, or hold NaN or Inf
            (:func:`rms_norm` reads them now; the projections are read when the model is saved).
        ConfigError: a projection's shape does not fit the format's blocks or rotation
            (:meth:`~gemma_export.weights.WeightFormat.linears`).
    """
    c = ckpt.config
    p = f"model.layers.{layer}.self_attn."
    layer_type = c.layer_types[layer]
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def normed(t: ir.Value, n: int, norm: str) -> ir.Value:
        # [B, S, n·D] → RMSNorm over each head's D values → [B, S, n·D]
        if n == 1:
            return rms_norm(g, t, _weight(ckpt, p + norm), c.rms_norm_eps)
        t = rms_norm(g, g.op("Reshape", t, g.const_i64([0, 0, n, d])), _weight(ckpt, p + norm), c.rms_norm_eps)
        return g.op("Reshape", t, g.const_i64([0, 0, n * d]))

    rope = shared.cos[layer_type], shared.sin[layer_type], shared.rope_index
    q, k, v = fmt.linears(g, x, [_weight(ckpt, p + f"{n}_proj.weight") for n in "qkv"], p + "qkv_proj.weight")
    q = apply_rotary(g, normed(q, heads, "q_norm.weight"), *rope)
    k = apply_rotary(g, normed(k, kv_heads, "k_norm.weight"), *rope)
    context, present_key, present_value = g.op(
        "GroupQueryAttention", q, k, v, past_key, past_value, shared.seqlens_k[layer_type],
        shared.total_sequence_length[layer_type], None, None, None, shared.mask[layer_type], domain=MS_DOMAIN, num_outputs=3,
        num_heads=heads, kv_num_heads=kv_heads, scale=float(c.attention_scale))
    # No attention soft-capping: transformers' Gemma3Attention reads attn_logit_softcapping from the
    # config but never applies it (Gemma 3 checkpoints set it to null), and it is the reference.
    return fmt.linear(g, context, _weight(ckpt, p + "o_proj.weight")), present_key, present_value


def mlp(g: GraphBuilder, fmt: WeightFormat, ckpt: Checkpoint, layer: int, x: ir.Value) -> ir.Value:
    """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))`` (transformers ``Gemma3MLP``), float32
    ``x [B, S, hidden]`` → ``[B, S, hidden]`` through ``[B, S, intermediate_size]``. ONNX ``Gelu``
    (opset 20) with ``approximate="tanh"`` is ``0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))``, the
    formula of transformers' ``gelu_pytorch_tanh`` (``hidden_activation`` of Gemma 3) and of the
    GELU paper's approximation (Hendrycks & Gimpel 2016, arXiv:1606.08415). GeGLU: Shazeer 2020
    (arXiv:2002.05202).

    Raises:
        ConfigError: a projection's shape does not fit the format's blocks or rotation
            (:meth:`~gemma_export.weights.WeightFormat.linears`); the weights are read when the model is saved.
    """
    p = f"model.layers.{layer}.mlp."
    gate, up = fmt.linears(g, x, [_weight(ckpt, p + "gate_proj.weight"), _weight(ckpt, p + "up_proj.weight")],
                           p + "gate_up_proj.weight")
    return fmt.linear(g, g.op("Mul", g.op("Gelu", gate, approximate="tanh"), up), _weight(ckpt, p + "down_proj.weight"))


def decoder_layer(g: GraphBuilder, fmt: WeightFormat, ckpt: Checkpoint, layer: int, x: ir.Value,
                  past_key: ir.Value, past_value: ir.Value, shared: _Shared):
    """Sandwich-norm block (transformers ``Gemma3DecoderLayer``): input norm → attention →
    post-attention norm → residual; pre-feedforward norm → MLP → post-feedforward norm → residual.

    ``x``: float32 ``[B, S, hidden]``; caches as :func:`self_attention`.
    Returns ``(hidden [B, S, hidden], present_key, present_value, sub_blocks)``; ``sub_blocks`` maps ``attention``
    and ``mlp`` to what each adds to the residual stream (the outputs of ``post_attention_layernorm``
    and ``post_feedforward_layernorm``, as transformers' modules of those names return them).

    Raises:
        FormatError, NumericError: a norm weight of the layer cannot be read, or holds NaN or Inf.
        ConfigError: a projection does not fit the format's blocks or rotation (:func:`self_attention`, :func:`mlp`)."""
    p = f"model.layers.{layer}."
    eps = ckpt.config.rms_norm_eps
    attn, present_key, present_value = self_attention(
        g, fmt, ckpt, layer, rms_norm(g, x, _weight(ckpt, p + "input_layernorm.weight"), eps), past_key, past_value, shared)
    attn = rms_norm(g, attn, _weight(ckpt, p + "post_attention_layernorm.weight"), eps)
    x = g.op("Add", x, attn)
    ff = mlp(g, fmt, ckpt, layer, rms_norm(g, x, _weight(ckpt, p + "pre_feedforward_layernorm.weight"), eps))
    ff = rms_norm(g, ff, _weight(ckpt, p + "post_feedforward_layernorm.weight"), eps)
    x = g.op("Add", x, ff)
    return x, present_key, present_value, {"attention": attn, "mlp": ff}


def lm_head(g: GraphBuilder, fmt: WeightFormat, ckpt: Checkpoint, table: Table, x: ir.Value,
            all_logits: bool) -> ir.Value:
    """The model's end (transformers ``Gemma3TextModel.norm``, then ``Gemma3ForCausalLM.lm_head``):
    the final RMSNorm, the LM head (the embedding ``table`` itself when ``tie_word_embeddings``,
    else ``lm_head.weight`` stored by the format), and Gemma 2-style soft-capping
    ``tanh(logits / cap) * cap`` when ``final_logit_softcapping`` is set (null for Gemma 3).

    ``x``: float32 ``[B, S, hidden]``, the last decoder layer's output. Returns float32 logits
    ``[B, S, vocab_size]``, or ``[B, 1, vocab_size]`` for the last position only unless
    ``all_logits`` (a 512-token prefill would otherwise write 512 MB of logits).

    Raises:
        FormatError, NumericError: the final norm weight cannot be read, or holds NaN or Inf.
        ConfigError: an untied ``lm_head.weight`` does not fit the format's blocks or rotation.
    """
    c = ckpt.config
    if not all_logits:
        x = g.op("Slice", x, g.const_i64([-1]), g.const_i64([np.iinfo(np.int64).max]), g.const_i64([1]))
    x = rms_norm(g, x, _weight(ckpt, FINAL_NORM), c.rms_norm_eps)
    head: Table = table if ckpt.tied else fmt.table(g, _weight(ckpt, LM_HEAD))
    logits = fmt.lm_head(g, head, x)
    cap = c.final_logit_softcapping
    if cap is None:
        return logits
    return g.op("Mul", g.op("Tanh", g.op("Div", logits, g.const_f32(cap))), g.const_f32(cap))


def build_model(ckpt: Checkpoint, fmt: WeightFormat, all_logits: bool = False, debug_outputs: bool = False) -> ir.Model:
    """The whole decoder as an :class:`onnx_ir.Model` whose weights are lazy tensors.

    Args:
        ckpt: a validated checkpoint.
        fmt: the weight format of the chosen ``--dtype``.
        all_logits: return logits for every position instead of the last one only (a 512-token
            prefill would otherwise write 512 MB of logits).
        debug_outputs: also return, per layer, what the attention and the MLP sub-blocks add to the
            residual stream (``debug.layers.{i}.attention|mlp``, float32 ``[batch, sequence_length,
            hidden]``), so ``gemma-export parity`` can name the first sub-block that departs from
            the reference.

    Returns:
        The model (I/O as in the module docstring); its large initializers are lazy, read and
        converted by ``onnx_ir`` when the model is saved, which is when a weight that cannot be
        stored raises :class:`~gemma_export.errors.NumericError`.

    Raises:
        FormatError, NumericError: a norm weight (read now, :func:`rms_norm`) cannot be read or
            holds NaN or Inf.
        ConfigError: a weight's shape does not fit the format's blocks or rotation (a block size that
            does not divide its ``in_features``, features not a multiple of the rotation's size).
    """
    c = ckpt.config
    g = GraphBuilder()
    input_ids = g.input("input_ids", I64, ["batch_size", "sequence_length"])
    attention_mask = g.input("attention_mask", I64, ["batch_size", "total_sequence_length"])
    position_ids = g.input("position_ids", I64, ["batch_size", "sequence_length"])
    def cache_shape(i: int, length: str) -> list:  # a sliding layer's cache may hold fewer rows (sliding_cache_start)
        return ["batch_size", c.num_key_value_heads, ("sliding_" if c.layer_types[i] == SLIDING else "") + length, c.head_dim]

    past = [(g.input(f"past_key_values.{i}.key", F32, cache_shape(i, "past_sequence_length")),
             g.input(f"past_key_values.{i}.value", F32, cache_shape(i, "past_sequence_length")))
            for i in range(c.num_hidden_layers)]

    table, x = embed_tokens(g, fmt, ckpt, input_ids)

    with g.scope("rotary"):
        layer_types = sorted(set(c.layer_types))
        rope = {t: rotary_embedding(g, position_ids, c, t) for t in layer_types}
        index = rope_index(g, position_ids)
    held = {FULL: attention_mask}  # layer type → the mask of the rows its cache holds plus this call's
    if SLIDING in layer_types:
        # an overridable initializer: an optional input, 0 (the whole past) unless the runtime feeds it
        start = g.initializer(ir.tensor(np.int64(0), name=SLIDING_CACHE_START))
        g.inputs.append(start)
        end = g.const_i64([np.iinfo(np.int64).max])
        held[SLIDING] = g.op("Slice", attention_mask, g.op("Unsqueeze", start, g.const_i64([0])), end, g.const_i64([1]))
    masks, seqlens_k, totals = {}, {}, {}
    batch = g.op("Gather", g.op("Shape", input_ids), g.const_i64([0]))
    for kind in layer_types:
        with g.scope(f"mask/{kind}"):
            masks[kind] = attention_bias(g, held[kind], input_ids, c.sliding_window if kind == SLIDING else None)
            totals[kind] = g.op("Cast", g.op("Gather", g.op("Shape", held[kind]), g.const(np.int64(1))),
                                to=ir.DataType.INT32)
            seqlens_k[kind] = g.op("Expand", g.op("Sub", totals[kind], g.const(np.int32(1))), batch)
    shared = _Shared(mask=masks, cos={t: r[0] for t, r in rope.items()}, sin={t: r[1] for t, r in rope.items()},
                     rope_index=index, seqlens_k=seqlens_k, total_sequence_length=totals)

    presents, debug = [], []
    for i in range(c.num_hidden_layers):
        with g.scope(f"layers.{i}"):
            x, present_key, present_value, blocks = decoder_layer(g, fmt, ckpt, i, x, *past[i], shared)
        presents.append((present_key, present_value))
        debug += [(debug_output_name(i, b), blocks[b]) for b in DEBUG_BLOCKS]

    logits = lm_head(g, fmt, ckpt, table, x, all_logits)

    g.output(logits, "logits", F32, ["batch_size", 1 if not all_logits else "sequence_length", c.vocab_size])
    for i, (k, v) in enumerate(presents):
        g.output(k, f"present.{i}.key", F32, cache_shape(i, "total_sequence_length"))
        g.output(v, f"present.{i}.value", F32, cache_shape(i, "total_sequence_length"))
    if debug_outputs:
        for name, value in debug:
            g.output(g.op("Identity", value), name, F32, ["batch_size", "sequence_length", c.hidden_size])
    model = g.model("gemma3_decoder", doc_string=f"Gemma 3 decoder exported by gemma-export ({fmt.name})")
    sliding = [i for i, kind in enumerate(c.layer_types) if kind == SLIDING]
    if sliding:  # what a runtime needs to drop out-of-window rows (runtime.KVCache), read from the graph itself
        model.metadata_props[SLIDING_LAYERS_KEY] = ",".join(map(str, sliding))
        model.metadata_props[SLIDING_WINDOW_KEY] = str(c.sliding_window)
    return model
