"""Teacher-forced quality against transformers fp32 on real text (the Python license shipped with
the interpreter): top-1 agreement and mean KL(fp32 ‖ model) per token, for our exports and, when
``llama-cpp-python`` is installed, for llama.cpp on the Q8_0 / Q4_K_M GGUFs — same text, same run.

Usage:
    python tools/quality_anchor.py --models int8=DIR [fp32=DIR] [--tokens 640] [--gguf Q8_0.gguf ...]
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_logits(ids: list[int]) -> np.ndarray:
    """transformers' Gemma3ForCausalLM (eager, fp32) on the bundled weights, all positions."""
    import torch
    import transformers

    from gemma_export.sources import open_source

    ckpt = open_source(None)
    c = ckpt.config
    config = transformers.Gemma3TextConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
        sliding_window=c.sliding_window, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        layer_types=list(c.layer_types), attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(config).eval()
    state = {k: torch.from_numpy(v.load()) for k, v in ckpt.tensors.items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def llama_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=2, n_ctx=len(ids) + 8, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[], help="NAME=EXPORT_DIR pairs")
    parser.add_argument("--gguf", nargs="*", default=[], type=Path, help="GGUF files to run with llama.cpp")
    parser.add_argument("--tokens", type=int, default=640)
    args = parser.parse_args()
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    models = dict(m.split("=", 1) for m in args.models)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(next(iter(models.values()))).encode(text).ids[: args.tokens]
    ref = _log_softmax(reference_logits(ids))
    rows = {f"ours {n}": OnnxDecoder(d).teacher_forced_logits(ids) for n, d in models.items()}
    for path in args.gguf:
        rows[f"llama.cpp {path.name}"] = llama_logits(path, ids)
    print(f"\n{len(ids)} tokens of the Python license text, reference transformers fp32\n")
    print("| model | top-1 agreement | top-1 past 512 | mean KL (nats/token) |")
    print("|---|---|---|---|")
    for name, logits in rows.items():
        lp = _log_softmax(logits)
        agree = lp.argmax(-1) == ref.argmax(-1)
        kl = float((np.exp(ref) * (ref - lp)).sum(-1).mean())
        print(f"| {name} | {agree.mean():.2%} | {agree[512:].mean():.2%} | {kl:.4f} |")


if __name__ == "__main__":
    main()
