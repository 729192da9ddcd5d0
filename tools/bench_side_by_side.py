"""Side-by-side decode and prefill latency, in one run with the same threads and the same real text:
our ONNX exports (onnxruntime) against llama.cpp (``llama-cpp-python``) on the same weights, plus the
memory-bandwidth floor measured on this machine.

Usage:
    pip install llama-cpp-python   # optional; on x86 with gcc 12 build it with -mno-amx-* (see docs)
    python tools/bench_side_by_side.py --models int8=/tmp/gx-bench3/int8/model fp32=/tmp/gx-bench3/fp32/model \\
        [--threads 2] [--context 128] [--new-tokens 64] [--prefill 512]

llama.cpp runs the bundled Q4_K_M GGUF and a Q8_0 GGUF requantized from it (written once next to
the bundled file). Prints a Markdown table of medians and ratios against llama.cpp Q8_0.
"""

from __future__ import annotations

import argparse
import statistics
import sysconfig
import time
from pathlib import Path

import numpy as np


def real_text_ids(tokenizer_dir: Path, count: int) -> list[int]:
    from gemma_export.runtime import load_tokenizer

    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(tokenizer_dir).encode(text * 4).ids
    return ids[:count]


def read_bandwidth_gbps(size_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Single-thread read bandwidth: median over sums of a 1 GiB array (GB/s)."""
    data = np.ones(size_bytes // 8, dtype=np.float64)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - start)
    return size_bytes / statistics.median(times) / 1e9


def bench_onnx(model_dir: Path, ids: list[int], context: int, new_tokens: int, prefill: int, threads: int) -> dict:
    from gemma_export.runtime import OnnxDecoder

    dec = OnnxDecoder(model_dir, threads=threads)
    prompt = np.asarray([ids[:prefill]], np.int64)
    start = time.perf_counter()
    dec.forward(prompt, np.ones_like(prompt), np.arange(prefill)[None], dec.empty_cache(1))
    prefill_ms = (time.perf_counter() - start) * 1e3
    prompt = np.asarray([ids[:context]], np.int64)
    _, past = dec.forward(prompt, np.ones_like(prompt), np.arange(context)[None], dec.empty_cache(1))
    steps = []
    for i in range(new_tokens):
        pos = context + i
        start = time.perf_counter()
        _, past = dec.forward(np.asarray([[ids[pos]]]), np.ones((1, pos + 1), np.int64), np.asarray([[pos]]), past)
        steps.append((time.perf_counter() - start) * 1e3)
    return {"prefill_ms": prefill_ms, "decode_ms": statistics.median(steps[3:])}


def bench_llama(gguf: Path, ids: list[int], context: int, new_tokens: int, prefill: int, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=max(prefill, context + new_tokens) + 8,
                n_batch=512, verbose=False)
    start = time.perf_counter()
    llm.eval(ids[:prefill])
    prefill_ms = (time.perf_counter() - start) * 1e3
    llm.reset()
    llm.eval(ids[:context])
    steps = []
    for i in range(new_tokens):
        start = time.perf_counter()
        llm.eval([ids[context + i]])
        steps.append((time.perf_counter() - start) * 1e3)
    return {"prefill_ms": prefill_ms, "decode_ms": statistics.median(steps[3:])}


def q8_0_gguf(source: Path) -> Path:
    """A Q8_0 GGUF requantized from ``source`` with llama.cpp's quantizer (made once)."""
    import llama_cpp

    target = source.with_name(source.stem.replace("q4_k_m", "q8_0") + ".gguf")
    if not target.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        params.allow_requantize = True
        if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not requantize {source} to Q8_0")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, help="NAME=EXPORT_DIR pairs")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    args = parser.parse_args()
    models = dict(m.split("=", 1) for m in args.models)
    ids = real_text_ids(Path(next(iter(models.values()))), max(args.prefill, args.context + args.new_tokens))
    rows = {}
    try:
        from gemma_export.sources import bundled_gguf_path

        q4 = bundled_gguf_path()
        rows["llama.cpp Q8_0"] = bench_llama(q8_0_gguf(q4), ids, args.context, args.new_tokens, args.prefill, args.threads)
        rows["llama.cpp Q4_K_M"] = bench_llama(q4, ids, args.context, args.new_tokens, args.prefill, args.threads)
    except ImportError:
        print("llama-cpp-python not installed: llama.cpp rows skipped")
    for name, folder in models.items():
        rows[f"ours {name}"] = bench_onnx(Path(folder), ids, args.context, args.new_tokens, args.prefill, args.threads)
        archive = sum((Path(folder) / f).stat().st_size for f in ("model.onnx", "model.onnx.data"))
        rows[f"ours {name}"]["archive_bytes"] = archive
    bandwidth = read_bandwidth_gbps()
    anchor = rows.get("llama.cpp Q8_0")
    print(f"\nthreads {args.threads}, decode at context {args.context} (median of {args.new_tokens - 3} steps), "
          f"prefill {args.prefill} tokens; read bandwidth {bandwidth:.1f} GB/s\n")
    print("| system | decode ms/token | × llama.cpp Q8_0 | × bandwidth floor | prefill ms | × llama.cpp Q8_0 |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        floor = f"{r['decode_ms'] / (r['archive_bytes'] / bandwidth / 1e6):.2f}" if "archive_bytes" in r else "–"
        ratio = f"{r['decode_ms'] / anchor['decode_ms']:.2f}" if anchor else "–"
        pratio = f"{r['prefill_ms'] / anchor['prefill_ms']:.2f}" if anchor else "–"
        print(f"| {name} | {r['decode_ms']:.1f} | {ratio} | {floor} | {r['prefill_ms']:.0f} | {pratio} |")


if __name__ == "__main__":
    main()
