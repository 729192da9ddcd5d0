"""Decode latency against onnxruntime-genai in one run: genai's own generation loop on the folders its
model builder wrote (`tools/genai_anchor.py`), and our exports through `OnnxDecoder.greedy`, after
the same real-text prompts, with the same threads.

Usage:
    python tools/bench_genai.py --pair fp32=/tmp/genai-fp32,/tmp/gx/fp32 --pair int4=/tmp/genai-int4,/tmp/gx/int4 \\
        [--contexts 16,128] [--steps 64] [--threads 2] [--cold]

Needs onnxruntime-genai in this interpreter (the test extra has it). Prints medians (ms/token,
first 3 steps dropped) and our time as a ratio of genai's: with the weights packed on the heap, and
from the export's pre-packed copy when `gemma-export prepack` made one on this machine.
``--cold`` (root) drops the page cache before each measurement: every file is read from disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import DROPPED_STEPS, add_ranges, busy_note, few_steps_note, genai_folder, int_list, int_range, named, our_export, run, thread_count, unique_names  # noqa: E402
from gemma_export.bench import BUSY_OTHER_CPUS, OtherWork  # noqa: E402


def genai_decode_ms(folder: str, ids: list[int], context: int, steps: int, threads: int) -> float:
    import onnxruntime_genai as og

    config = og.Config(folder)
    config.clear_providers()  # CPU
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + steps + 8, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids[:context])
    times = []
    with OtherWork() as other:
        for _ in range(steps):
            start = time.perf_counter()
            generator.generate_next_token()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[DROPPED_STEPS:]), other.cpus


def our_decode_ms(folder: str, ids: list[int], context: int, steps: int, threads: int, prepacked: bool = False) -> float:
    from gemma_export.runtime import OnnxDecoder

    decoder = OnnxDecoder(folder, threads=threads, prepacked=prepacked)
    with OtherWork() as other:
        _, _, decode = decoder.greedy(ids[:context], steps + 1, stop_ids=[])
    return statistics.median(decode[DROPPED_STEPS:]), other.cpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", action="append", required=True, type=named((genai_folder, our_export), 2),
                        metavar="NAME=GENAI_DIR,OUR_EXPORT_DIR",
                        help="a folder genai's builder wrote (tools/genai_anchor.py) and one of our exports; repeatable")
    parser.add_argument("--contexts", type=int_list(1, 8192), default=[16, 128],
                        help="decode is timed after prompts of these lengths (default 16,128)")
    parser.add_argument("--steps", type=int_range(4, 4096), default=64,
                        help="decode steps per measurement; the first 3 are dropped (default 64)")
    parser.add_argument("--threads", type=thread_count, default=2, help="intra-op threads of both (default 2)")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each measurement (needs root): every file read from disk")
    add_ranges(parser)
    args = parser.parse_args()
    from gemma_export.bench import drop_page_cache

    cold = drop_page_cache if args.cold else (lambda: None)
    cold()  # fails early when not permitted

    from gemma_export.bench import real_text
    from gemma_export.runtime import load_tokenizer

    from gemma_export.errors import GemmaExportError, first_line

    pairs = [(name, str(genai_dir), str(our_dir))
             for name, (genai_dir, our_dir) in unique_names(parser, "--pair", args.pair).items()]
    from gemma_export.onnx_files import graph_dtype, read_graph

    for name, genai_dir, our_dir in pairs:  # genai fp32 against our int4 gave a row of 0.11, no word
        theirs, ours = (graph_dtype(read_graph(Path(d) / "model.onnx")) for d in (genai_dir, our_dir))
        if theirs != ours:
            parser.error(f"--pair {name}: {genai_dir} holds {theirs} weights and {our_dir} {ours}; a pair compares "
                         "one precision")
    contexts = args.contexts
    ids = load_tokenizer(pairs[0][2]).encode(real_text(None)[0]).ids
    if max(contexts) > len(ids):
        raise GemmaExportError(f"--contexts {max(contexts)}: the prompt text has only {len(ids)} tokens")
    from gemma_export.prepack import status

    copies = {our_dir: status(our_dir) for _, _, our_dir in pairs}  # copies made here by `gemma-export prepack`
    for name, _, our_dir in pairs:  # a copy that cannot be used is named, not passed over in silence
        if copies[our_dir].path is None and copies[our_dir].problem:
            print(f"{name}: the pre-packed copy of {our_dir} is not timed: {copies[our_dir].problem}", flush=True)
    others: list[str] = []  # other processes' CPU use per row
    busy: list[str] = []  # the rows timed beside BUSY_OTHER_CPUS or more of it
    header = ["| precision | context | onnxruntime-genai ms/token | ours ms/token | ours ÷ genai "
              "| ours pre-packed ms/token | pre-packed ÷ genai |", "|---|---|---|---|---|---|---|"]
    for name, genai_dir, our_dir in pairs:
        packed = copies[our_dir].path is not None
        for context in contexts:
            cold()
            try:
                theirs, genai_other = genai_decode_ms(genai_dir, ids, context, args.steps, args.threads)
            except RuntimeError as exc:  # onnxruntime-genai's own errors (e.g. the model's max length), a page long
                raise GemmaExportError(f"onnxruntime-genai on {genai_dir}: {first_line(exc)[:300]}") from None
            cold()
            ours, our_other = our_decode_ms(our_dir, ids, context, args.steps, args.threads)
            figures = [genai_other, our_other]
            cold()
            if packed:
                mapped, mapped_other = our_decode_ms(our_dir, ids, context, args.steps, args.threads, True)
                figures.append(mapped_other)
                copy = f"{mapped:.1f} | {mapped / theirs:.2f}"
            elif copies[our_dir].problem:  # named above the table
                copy = "copy not usable (see above) | —"
            else:  # no copy to time: say so instead of a nan
                copy = "no copy (`gemma-export prepack`) | —"
            if header:  # printed with the first row: a first pair that fails leaves no table behind
                print("\n".join(header))
                header = []
            print(f"| {name} | {context} | {theirs:.1f} | {ours:.1f} | {ours / theirs:.2f} | {copy} |", flush=True)
            others.append(f"{name} @{context} " + " / ".join("—" if f is None else f"{f:.2f}" for f in figures))
            if any(f is not None and f >= BUSY_OTHER_CPUS for f in figures):
                busy.append(f"{name} @{context}")
    print("\nother processes' CPU use while each was timed (CPUs; genai / ours / ours pre-packed): " + ", ".join(others))
    if note := busy_note(busy, "those rows' times and ratios are"):  # as gemma-export bench and bench_side_by_side.py warn
        print(note)
    if note := few_steps_note("--steps", args.steps):
        print(note)


if __name__ == "__main__":
    run(main)
