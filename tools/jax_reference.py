"""A reference export in the board pipeline's format, with its forward math written in JAX.

``write_jax_reference(model, folder, dtype)`` writes ``gemma.mlir`` + ``gemma.safetensors`` for a tiny
transformers Gemma 3 the way the board team describes their tracer's
output: a ``@gemma`` function ``tensor<1x24xi32> -> tensor<24xi32>`` (per-position greedy argmax),
weights as ``util.global`` bound to ``#flow.parameter.named<"model"::"tN">`` (sparse names in trace
order; bf16 globals converted to f32 at each load, or i8 + ``_scale`` per row dequantized in the
graph), RoPE tables and sliding-window masks as extra globals, the tied table stored twice, a flat
1-D archive with bf16 by truncation, norms holding ``1 + w``.

It scales to the real config: ``tools/make_reference_export.py`` runs it on the bundled 270M
weights. The forward is Gemma 3 written here in ``jax.numpy`` from the model card's equations (not from this
toolkit's ONNX builder, and not from transformers' code), lowered with ``jax.jit(f).lower``; the
weight arguments of the lowered ``main`` are then rewritten into parameter globals. IREE compiles it
like the board's files.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from quant.bf16 import truncate_to_bfloat16_bits

SEQ = 24
MASK_VALUE = -1e30  # the reference's additive mask




def _rope_tables(theta: float, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(SEQ, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)  # [SEQ, head_dim / 2]


def trace(model) -> list[tuple[str, np.ndarray]]:
    """(role, array) in the tracer's order; roles name how the JAX forward uses each argument."""
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    c = model.config
    items = [("embed", sd["model.embed_tokens.weight"])]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        kind = c.layer_types[i]
        cos, sin = _rope_tables(c.rope_parameters[kind]["rope_theta"], c.head_dim)
        items += [("input_norm", sd[p + "input_layernorm.weight"] + 1), ("q", sd[p + "self_attn.q_proj.weight"]),
                  ("q_norm", sd[p + "self_attn.q_norm.weight"] + 1), ("k", sd[p + "self_attn.k_proj.weight"]),
                  ("k_norm", sd[p + "self_attn.k_norm.weight"] + 1), ("v", sd[p + "self_attn.v_proj.weight"]),
                  ("cos", cos), ("sin", sin), ("o", sd[p + "self_attn.o_proj.weight"]),
                  ("post_attention_norm", sd[p + "post_attention_layernorm.weight"] + 1),
                  ("pre_feedforward_norm", sd[p + "pre_feedforward_layernorm.weight"] + 1),
                  ("gate", sd[p + "mlp.gate_proj.weight"]), ("up", sd[p + "mlp.up_proj.weight"]),
                  ("down", sd[p + "mlp.down_proj.weight"]),
                  ("post_feedforward_norm", sd[p + "post_feedforward_layernorm.weight"] + 1)]
        if kind == "sliding_attention":
            q, k = np.arange(SEQ)[:, None], np.arange(SEQ)[None, :]
            allowed = (k <= q) & (q - k < c.sliding_window)
            items.append(("mask", np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)))
    items += [("final_norm", sd["model.norm.weight"] + 1), ("head", sd["lm_head.weight"])]
    return items



def global_name(n: int) -> str:
    """The name (and archive key) of the ``n``-th global in trace order: sparse, increasing ``tN``,
    like the tracer's ids."""
    return f"t{n * 7 + (n % 3)}"


def global_of(model, role: str, nth: int = 0) -> str:
    """The name of the ``nth`` global of ``role`` (one of :func:`trace`'s roles, e.g. ``"gate"``) in
    the reference :func:`write_jax_reference` writes for ``model``."""
    return global_name([i for i, (r, _) in enumerate(trace(model)) if r == role][nth])


def gemma_forward(config, roles: list[str]):
    """The Gemma 3 forward over arguments in trace order (``roles``), in jax.numpy, float32."""
    import jax
    import jax.numpy as jnp

    eps = config.rms_norm_eps
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    scale = config.query_pre_attn_scalar ** -0.5
    full_mask = jnp.where(jnp.arange(SEQ)[None, :] <= jnp.arange(SEQ)[:, None], 0.0, MASK_VALUE).astype(jnp.float32)

    def rms(x, gain):  # gain holds 1 + w
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gain

    def rotate(x, cos, sin):  # x [n, SEQ, head_dim]; rotate-half over the full head_dim
        c = jnp.concatenate([cos, cos], axis=-1)[None]
        s = jnp.concatenate([sin, sin], axis=-1)[None]
        half = head_dim // 2
        rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return x * c + rotated * s

    def forward(tokens, *weights):
        queue = list(zip(roles, weights))

        def take(role):  # the next argument, which must play ``role``
            found, weight = queue.pop(0)
            if found != role:
                raise ValueError(f"trace order: expected {role}, found {found}")
            return weight

        embed = take("embed")
        x = embed[tokens[0]] * jnp.float32(np.sqrt(config.hidden_size))
        for kind in config.layer_types:
            h = rms(x, take("input_norm"))
            q = (h @ take("q").T).reshape(SEQ, heads, head_dim).transpose(1, 0, 2)
            q = rms(q, take("q_norm"))
            k = (h @ take("k").T).reshape(SEQ, kv_heads, head_dim).transpose(1, 0, 2)
            k = rms(k, take("k_norm"))
            v = (h @ take("v").T).reshape(SEQ, kv_heads, head_dim).transpose(1, 0, 2)
            cos, sin = take("cos"), take("sin")
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k = jnp.repeat(k, heads // kv_heads, axis=0)
            v = jnp.repeat(v, heads // kv_heads, axis=0)
            o_proj = take("o")
            post_attention, pre_feedforward = take("post_attention_norm"), take("pre_feedforward_norm")
            gate, up, down, post_feedforward = take("gate"), take("up"), take("down"), take("post_feedforward_norm")
            mask = take("mask") if kind == "sliding_attention" else full_mask
            scores = jnp.einsum("hqd,hkd->hqk", q, k) * scale + mask[None]
            attn = jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(scores, axis=-1), v)
            attn = attn.transpose(1, 0, 2).reshape(SEQ, heads * head_dim) @ o_proj.T
            x = x + rms(attn, post_attention)
            h = rms(x, pre_feedforward)
            mlp = (jax.nn.gelu(h @ gate.T, approximate=True) * (h @ up.T)) @ down.T
            x = x + rms(mlp, post_feedforward)
        x = rms(x, take("final_norm"))
        logits = x @ take("head").T
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    return forward


def _quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference's int8: per row, symmetric, scale = max|row| / 127, round half to even."""
    scale = np.abs(x).max(axis=1) / 127
    scale[scale == 0] = 1
    return np.clip(np.rint(x / scale[:, None]), -127, 127).astype(np.int8), scale.astype(np.float32)


def _type(shape, element: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{element}>"


def write_jax_reference(model, folder: Path, dtype: str = "bf16") -> Path:
    """Lower the JAX forward, bind its weights to parameter globals, and write the archive.
    Returns the ``gemma.mlir`` path."""
    import jax
    import jax.numpy as jnp

    items = trace(model)
    roles = [role for role, _ in items]
    specs = [jax.ShapeDtypeStruct((1, SEQ), jnp.int32)] + [jax.ShapeDtypeStruct(a.shape, jnp.float32) for _, a in items]
    text = jax.jit(gemma_forward(model.config, roles)).lower(*specs).as_text()

    lines = text.splitlines()
    main = next(i for i, line in enumerate(lines) if "func.func public @main(" in line)
    args = re.findall(r"%(arg\d+): (tensor<[^>]*>)", lines[main].split(") ->")[0])
    assert len(args) == len(items) + 1, "lowering changed the argument list"
    globals_, loads, archive = [], [], {}
    for n, ((arg, arg_type), (_, array)) in enumerate(zip(args[1:], items)):
        name = global_name(n)
        if dtype == "int8" and array.ndim == 2:
            q, scale = _quantize_rows(array)
            archive[name], archive[name + "_scale"] = q.reshape(-1), scale
            globals_ += [f'  util.global private @{name} = #flow.parameter.named<"model"::"{name}"> : {_type(array.shape, "i8")}',
                         f'  util.global private @{name}_scale = #flow.parameter.named<"model"::"{name}_scale"> : '
                         f'{_type(array.shape[:1], "f32")}']
            loads += [f"    %{name}_q = util.global.load @{name} : {_type(array.shape, 'i8')}",
                      f"    %{name}_s = util.global.load @{name}_scale : {_type(array.shape[:1], 'f32')}",
                      f"    %{name}_f = stablehlo.convert %{name}_q : ({_type(array.shape, 'i8')}) -> {arg_type}",
                      f"    %{name}_b = stablehlo.broadcast_in_dim %{name}_s, dims = [0] : "
                      f"({_type(array.shape[:1], 'f32')}) -> {arg_type}",
                      f"    %{arg} = stablehlo.multiply %{name}_f, %{name}_b : {arg_type}"]
        else:
            archive[name] = truncate_to_bfloat16_bits(array).reshape(-1)
            bf16 = _type(array.shape, "bf16")
            globals_.append(f'  util.global private @{name} = #flow.parameter.named<"model"::"{name}"> : {bf16}')
            loads += [f"    %{name}_raw = util.global.load @{name} : {bf16}",
                      f"    %{arg} = stablehlo.convert %{name}_raw : ({bf16}) -> {arg_type}"]
    head = f"  func.func @gemma(%{args[0][0]}: {args[0][1]}) -> tensor<{SEQ}xi32> {{"
    out = lines[:main] + globals_ + [head] + loads + lines[main + 1:]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gemma.mlir").write_text("\n".join(out) + "\n")
    save_flat_archive(archive, folder / "gemma.safetensors")
    return folder / "gemma.mlir"


def save_flat_archive(archive: dict[str, np.ndarray], path: Path) -> None:
    """Write the archive; ``uint16`` arrays are bf16 bit patterns and are stored as ``BF16``."""
    import ml_dtypes

    save_file({k: v.view(ml_dtypes.bfloat16) if v.dtype == np.uint16 else v for k, v in archive.items()}, str(path))
    umask = os.umask(0)  # save_file creates the file 0600; give it the mode any other file written here gets
    os.umask(umask)
    path.chmod(0o666 & ~umask)


if __name__ == "__main__":
    import sys

    NOTE = ("tools/jax_reference.py is a module (the tests and tools/make_reference_export.py import it); "
            "run tools/make_reference_export.py --help")
    if sys.argv[1:] in (["--help"], ["-h"]):  # help: the note, status 0
        print(NOTE)
        sys.exit(0)
    print(f"error: {NOTE}", file=sys.stderr)  # not a script: bad input, status 2 as the scripts'
    sys.exit(2)
