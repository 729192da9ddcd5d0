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
    from gemma_export.quality import compare_logits, transformers_logits
    from gemma_export.runtime import OnnxDecoder, load_tokenizer
    from gemma_export.sources import open_source

    models = dict(m.split("=", 1) for m in args.models)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(next(iter(models.values()))).encode(text).ids[: args.tokens]
    ref = transformers_logits(open_source(None), ids)
    rows = {}
    for name, folder in models.items():
        rows[f"ours {name}"] = compare_logits(ref, OnnxDecoder(folder).teacher_forced_logits(ids), ids)
        print(name, rows[f"ours {name}"], flush=True)
    for path in args.gguf:
        rows[f"llama.cpp {path.name}"] = compare_logits(ref, llama_logits(path, ids), ids)
        print(path.name, rows[f"llama.cpp {path.name}"], flush=True)
    print(f"\n{len(ids)} tokens of the Python license text, reference transformers fp32\n")
    print("| model | top-1 agreement | top-1 past 512 | mean KL (nats/token) | perplexity (reference "
          f"{next(iter(rows.values())).reference_perplexity:.2f}) |")
    print("|---|---|---|---|---|")
    for name, m in rows.items():
        past = f"{m.top1_agreement_past_512:.2%}" if m.top1_agreement_past_512 is not None else "-"
        print(f"| {name} | {m.top1_agreement:.2%} | {past} | {m.kl_mean:.4f} | {m.perplexity:.3f} |")

if __name__ == "__main__":
    main()
