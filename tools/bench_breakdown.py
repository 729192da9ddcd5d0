"""Where a decode step's time goes: the LM head, the layer projections, and everything else.

Times an export's decode steps against copies of its graph in which ``MatMulNBits`` nodes are
replaced by a ``Tile`` + ``Slice`` that gives the same output shape (the logits are then wrong; only
the timing is used). The differences are the in-situ cost of the replaced operators, measured
without onnxruntime's profiler (which adds a fixed cost to every node and so overstates small ones).

Usage:
    python tools/bench_breakdown.py --model gemma-3-270m-onnx-int8 [--threads 2] [--prompt-tokens 128] \\
        [--new-tokens 48] [--rounds 6]

Each round prefills the same real-text prompt (the Python license) into a fresh KV cache and then
feeds the text's next tokens one at a time (teacher-forced, so every variant does the same steps);
the variants alternate round by round in one process. Prints a Markdown table of the medians over
rounds of each round's median step time. The weights are packed on the heap (no pre-packed copy).
Works for int8 and int4 exports (fp32 and bf16 have no ``MatMulNBits``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _args import add_ranges, int_range, our_export, run, thread_count  # noqa: E402
from bench_side_by_side import real_text_ids  # noqa: E402  (the same real text as the side-by-side tables)
from gemma_export.config import QUANTIZED_DTYPES
from gemma_export.onnx_files import graph_dtype

#: the prompt is prefilled in one step; longer ones only measure attention's memory, not decode
MAX_PROMPT_TOKENS = 4096
#: variant name → which MatMulNBits nodes it replaces: "head" (the one whose N is the vocabulary) or "all"
VARIANTS = {"the export": None, "LM head replaced": "head", "all MatMulNBits replaced": "all"}


def _attribute(node, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def replace_matmulnbits(model, which: str, vocab_size: int) -> int:
    """Replace ``MatMulNBits`` nodes of ``model`` (an ``onnx.ModelProto``, edited in place) by ``Tile`` +
    ``Slice`` of their input to the node's output width N. ``which``: ``"head"`` (N == vocab_size) or
    ``"all"``. Returns how many nodes were replaced."""
    from onnx import helper, numpy_helper

    graph, kept, replaced = model.graph, [], 0
    for node in graph.node:
        if node.op_type != "MatMulNBits" or (which == "head" and _attribute(node, "N") != vocab_size):
            kept.append(node)
            continue
        k, n = _attribute(node, "K"), _attribute(node, "N")
        stem = f"breakdown_{replaced}"
        graph.initializer.extend([
            numpy_helper.from_array(np.array([1] * 2 + [-(-n // k)], np.int64), f"{stem}_repeats"),
            numpy_helper.from_array(np.array([0], np.int64), f"{stem}_start"),
            numpy_helper.from_array(np.array([n], np.int64), f"{stem}_end"),
            numpy_helper.from_array(np.array([-1], np.int64), f"{stem}_axis")])
        kept.append(helper.make_node("Tile", [node.input[0], f"{stem}_repeats"], [f"{stem}_tiled"], name=f"{stem}_tile"))
        kept.append(helper.make_node("Slice", [f"{stem}_tiled", f"{stem}_start", f"{stem}_end", f"{stem}_axis"],
                                     [node.output[0]], name=f"{stem}_slice"))
        replaced += 1
    del graph.node[:]
    graph.node.extend(kept)
    return replaced


def make_variant(model_dir: Path, out_dir: Path, which: str, vocab_size: int) -> int:
    """Copy the export folder (without its pre-packed copy) to ``out_dir`` with the variant graph."""
    import onnx

    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("prepacked", "model.onnx"))
    model = onnx.load(str(model_dir / "model.onnx"), load_external_data=False)
    count = replace_matmulnbits(model, which, vocab_size)
    onnx.save(model, str(out_dir / "model.onnx"))
    # the manifest's dtype must be what the graph stores, and its quantization record null for a
    # float graph (runtime checks both): with every MatMulNBits replaced, the variant holds no
    # quantized weights
    manifest_path = out_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["dtype"] = graph_dtype(model)
    if manifest["dtype"] not in QUANTIZED_DTYPES and "quantization" in manifest:
        manifest["quantization"] = None
    manifest_path.write_text(json.dumps(manifest, indent=2))
    return count


def round_ms(decoder, ids: list[int], prompt_tokens: int, new_tokens: int) -> float:
    """One round: prefill ``ids[:prompt_tokens]``, then ``new_tokens`` teacher-forced steps; the median
    step time in ms."""
    from gemma_export.runtime import KVCache

    cache = KVCache(decoder, 1, prompt_tokens + new_tokens)
    prompt = np.asarray([ids[:prompt_tokens]], np.int64)
    cache.step(prompt, np.ones_like(prompt), np.arange(prompt_tokens)[None])
    steps = []
    for position in range(prompt_tokens, prompt_tokens + new_tokens):
        start = time.perf_counter()
        cache.step(np.asarray([[ids[position]]], np.int64), np.ones((1, position + 1), np.int64),
                   np.asarray([[position]], np.int64))
        steps.append((time.perf_counter() - start) * 1e3)
    return statistics.median(steps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=our_export, required=True, help="an int8 or int4 export folder of gemma-export")
    parser.add_argument("--threads", type=thread_count, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--prompt-tokens", type=int_range(1, MAX_PROMPT_TOKENS), default=128,
                        help="real-text prompt prefilled before the timed steps (default 128)")
    parser.add_argument("--new-tokens", type=int_range(1, 4096), default=48,
                        help="teacher-forced decode steps per round (default 48)")
    parser.add_argument("--rounds", type=int_range(1, 1000), default=6,
                        help="alternating rounds of the three variants (default 6)")
    add_ranges(parser)
    return _run(parser.parse_args(argv))


def _run(args) -> int:
    import onnx

    from gemma_export.runtime import OnnxDecoder

    exported = OnnxDecoder(args.model, threads=args.threads, prepacked=False)
    vocab_size = exported.vocab_size
    graph = onnx.load(str(args.model / "model.onnx"), load_external_data=False).graph
    if not any(node.op_type == "MatMulNBits" for node in graph.node):
        print(f"error: {args.model / 'model.onnx'} has no MatMulNBits to replace (an int8 or int4 export is needed)",
              file=sys.stderr)
        return 2
    exported.check_length(args.prompt_tokens + args.new_tokens)
    ids = real_text_ids(args.model, args.prompt_tokens + args.new_tokens)
    if len(ids) < args.prompt_tokens + args.new_tokens:
        print(f"error: the text gives {len(ids)} tokens, fewer than --prompt-tokens + --new-tokens", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-breakdown-") as scratch:
        decoders, counts = {}, {}
        for name, which in VARIANTS.items():
            if which is None:
                decoders[name] = exported
                continue
            folder = Path(scratch) / which
            counts[name] = make_variant(args.model, folder, which, vocab_size)
            decoders[name] = OnnxDecoder(folder, threads=args.threads, prepacked=False)
        results = {name: [] for name in decoders}
        for _ in range(args.rounds):
            for name, decoder in decoders.items():
                results[name].append(round_ms(decoder, ids, args.prompt_tokens, args.new_tokens))
    ms = {name: statistics.median(values) for name, values in results.items()}
    total, no_head, bare = ms["the export"], ms["LM head replaced"], ms["all MatMulNBits replaced"]
    print(f"\n{args.model}: threads {args.threads}, {args.prompt_tokens}-token prompt, median of {args.new_tokens} "
          f"teacher-forced steps per round, median of {args.rounds} alternating rounds (heap)\n")
    print("| graph | ms/token | rounds | share |")
    print("|---|---|---|---|")
    print(f"| the export | {total:.2f} | {' '.join(f'{v:.2f}' for v in results['the export'])} | |")
    print(f"| LM head replaced | {no_head:.2f} | {' '.join(f'{v:.2f}' for v in results['LM head replaced'])} | "
          f"head ≈ {total - no_head:.2f} ms ({(total - no_head) / total:.0%}) |")
    print(f"| all {counts['all MatMulNBits replaced']} MatMulNBits replaced | {bare:.2f} | "
          f"{' '.join(f'{v:.2f}' for v in results['all MatMulNBits replaced'])} | layer projections ≈ "
          f"{no_head - bare:.2f} ms ({(no_head - bare) / total:.0%}); the rest ≈ {bare:.2f} ms ({bare / total:.0%}) |")
    if total < no_head or no_head < bare:
        print("note: a negative difference: the replaced operators cost less than the run-to-run noise here "
              "(more --rounds or --new-tokens, or a larger model)")
    return 0


if __name__ == "__main__":
    run(main)
