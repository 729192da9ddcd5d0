"""Side-by-side decode and prefill latency, in one run with the same threads and the same real text:
our ONNX exports (onnxruntime) against llama.cpp (``llama-cpp-python``) on the same weights, plus the
memory-bandwidth floor measured on this machine.

Usage:
    pip install llama-cpp-python==0.3.36   # optional; builds llama.cpp from source (~15 min on 2 cores)
    # on CPUs that report AMX, build without it: gcc 12 stops on its intrinsics on some machines, and on
    # others the default build compiles but its first evaluation dies of a general protection fault
    # (this whole script then ends with a segmentation fault):
    #   CMAKE_ARGS="-DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \\
    #   -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" \\
    #   pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
    python tools/bench_side_by_side.py --models int8=DIR fp32=DIR [--threads 2] [--contexts 16,128,512] \\
        [--new-tokens 64] [--prefill 512] [--reference REF.mlir] [--plot docs/decode.png] [--prepacked both] [--cold]

llama.cpp runs the bundled Q4_K_M GGUF and a Q8_0 GGUF requantized from it (written once next to
the bundled file); ``--reference`` adds the board team's reference export under IREE (e.g. the one
``tools/make_reference_export.py`` writes), timed the board's way (its 24-position graph once per
token). Prints a Markdown table of medians and ratios against llama.cpp Q8_0 at each context, then
each export's decode time at the first context ÷ its bandwidth floor and ÷ the reference's time per
token, and with ``--plot`` draws decode ms/token against context length.
``--cold`` (root) drops the page cache before each system, so each reads its files from disk as
after a reboot: timings otherwise depend on how long each file has sat in the cache.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import (add_ranges, check_exports_fit, check_gguf_model, DROPPED_STEPS, busy_note, few_steps_note, int_list, int_range, named, our_export,  # noqa: E402
                   plot_file, reference_mlir, run, thread_count, unique_names)


#: the reference export's row in the table
REFERENCE_ROW = "reference (IREE, re-decode)"


def real_text_ids(tokenizer_dir: Path, count: int) -> list[int]:
    from gemma_export.runtime import load_tokenizer

    from gemma_export.bench import real_text

    text, _ = real_text(None)  # the Python license, or numpy's where the interpreter ships none
    ids = load_tokenizer(tokenizer_dir).encode(text * 4).ids
    return ids[:count]


def read_bandwidth_gbps(size_bytes: int = 1 << 30, repeats: int = 5, threads: int = 2) -> float:
    """Read bandwidth (GB/s): median over numpy sums of a 1 GiB array, split across ``threads``
    threads (numpy releases the GIL while summing), the same thread count as the decode runs."""
    from concurrent.futures import ThreadPoolExecutor

    parts = np.array_split(np.ones(size_bytes // 8, dtype=np.float64), threads)
    times = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            times.append(time.perf_counter() - start)
    return size_bytes / statistics.median(times) / 1e9


def bench_onnx(model_dir: Path, ids: list[int], contexts: list[int], new_tokens: int, prefill: int, threads: int,
               prepacked: bool | None = None) -> dict:
    from gemma_export.bench import OtherWork
    from gemma_export.runtime import KVCache, OnnxDecoder

    dec = OnnxDecoder(model_dir, threads=threads, prepacked=prepacked)
    with OtherWork() as other:  # from the first timed step on, not the load
        prompt = np.asarray([ids[:prefill]], np.int64)
        cache = KVCache(dec, 1, prefill)
        start = time.perf_counter()
        cache.step(prompt, np.ones_like(prompt), np.arange(prefill)[None])
        prefill_ms = (time.perf_counter() - start) * 1e3
        decode = {}
        for context in contexts:
            prompt = np.asarray([ids[:context]], np.int64)
            cache = KVCache(dec, 1, context + new_tokens)  # shared past/present buffers for our exports
            cache.step(prompt, np.ones_like(prompt), np.arange(context)[None])
            steps = []
            for i in range(new_tokens):
                pos = context + i
                start = time.perf_counter()
                cache.step(np.asarray([[ids[pos]]]), np.ones((1, pos + 1), np.int64), np.asarray([[pos]]))
                steps.append((time.perf_counter() - start) * 1e3)
            decode[context] = statistics.median(steps[DROPPED_STEPS:])
    return {"prefill_ms": prefill_ms, "decode_ms": decode, "other_cpus": other.cpus}


def bench_llama(gguf: Path, ids: list[int], contexts: list[int], new_tokens: int, prefill: int, threads: int) -> dict:
    from llama_cpp import Llama

    from gemma_export.bench import OtherWork

    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                n_ctx=max(prefill, max(contexts) + new_tokens) + 8, n_batch=512, verbose=False)
    with OtherWork() as other:  # from the first timed step on, not the load
        start = time.perf_counter()
        llm.eval(ids[:prefill])
        prefill_ms = (time.perf_counter() - start) * 1e3
        decode = {}
        for context in contexts:
            llm.reset()
            llm.eval(ids[:context])
            steps = []
            for i in range(new_tokens):
                start = time.perf_counter()
                llm.eval([ids[context + i]])
                steps.append((time.perf_counter() - start) * 1e3)
            decode[context] = statistics.median(steps[DROPPED_STEPS:])
    return {"prefill_ms": prefill_ms, "decode_ms": decode, "other_cpus": other.cpus}


def bench_reference(mlir: Path, ids: list[int]) -> dict:
    """The reference export under IREE, re-decoding its fixed-length graph once per token."""
    from gemma_export.bench import time_reference

    figures = time_reference(mlir, None, ids, float("nan"), lambda _msg: None)
    return {"prefill_ms": float("nan"), "decode_ms": {figures["sequence_length"]: figures["ms_per_token_median"]},
            "fixed_length": figures["sequence_length"], "other_cpus": figures["other_cpus"]}


def write_plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, r in rows.items():
        points = sorted(r["decode_ms"].items())
        if "fixed_length" in r:  # one graph for every context up to its fixed length
            ax.axhline(points[0][1], linestyle=":", color="grey", label=f"{name} (any context <= {r['fixed_length']})")
        else:
            ax.plot([c for c, _ in points], [ms for _, ms in points], marker="o", label=name)
    from matplotlib.ticker import LogLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for r in rows.values() for c in r["decode_ms"]}))  # the contexts measured
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.tick_params(axis="x", labelsize=8, labelrotation=45)
    times = [ms for r in rows.values() for ms in r["decode_ms"].values() if ms > 0]
    if times and max(times) > 4 * min(times):  # the reference beside the exports: a log axis, labelled in ms
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode ms/token (median)")
    ax.set_title("Gemma 3 270M decode on this machine, 2 threads")
    ax.grid(True, which="both", alpha=0.3)
    # beside the axes: inside, it hid the points of some contexts
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary_lines(rows: dict, contexts: list[int], bandwidth_gbps: float) -> list[str]:
    """The run's table (decode ms/token per context and prefill ms, each also ÷ llama.cpp Q8_0 where
    it ran), then for each of our exports its decode time ÷ its bandwidth floor (archive bytes ÷
    ``bandwidth_gbps``, the time to read every weight once) and, where the reference ran, ÷ the
    reference's time per token, both at the first context."""
    anchor = rows.get("llama.cpp Q8_0")
    reference = rows.get(REFERENCE_ROW)
    lines = ["| system | " + " | ".join(f"decode ms @{c} | × Q8_0" for c in contexts) + " | prefill ms | × Q8_0 |",
             "|---|" + "---|---|" * len(contexts) + "---|---|"]
    for name, r in rows.items():
        cells = []
        for c in contexts:
            ms = r["decode_ms"].get(c, next(iter(r["decode_ms"].values())) if "fixed_length" in r else float("nan"))
            cells += [f"{ms:.1f}", f"{ms / anchor['decode_ms'][c]:.3f}" if anchor else "–"]
        if math.isnan(r["prefill_ms"]):  # the reference: no prompt step of its own
            prefill, pratio = "–", "–"
        else:
            prefill = f"{r['prefill_ms']:.0f}"
            pratio = f"{r['prefill_ms'] / anchor['prefill_ms']:.2f}" if anchor else "–"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {prefill} | {pratio} |")
    first = contexts[0]
    for name, r in rows.items():
        if "archive_bytes" in r:
            floor = r["archive_bytes"] / bandwidth_gbps / 1e6
            line = f"{name}: bandwidth floor {floor:.1f} ms/token; decode @{first} = {r['decode_ms'][first] / floor:.2f} x floor"
            if reference is not None:
                per_token = next(iter(reference["decode_ms"].values()))  # one fixed-length graph per token
                line += f", {r['decode_ms'][first] / per_token:.3f} x the reference's {per_token:.1f} ms/token"
            lines.append(line)
    return lines


def q8_0_gguf(source: Path, vocab: int | None = None) -> Path:
    """A Q8_0 GGUF requantized from ``source`` with llama.cpp's quantizer, made once next to it. A
    file already there is checked as ``--gguf`` files are (:func:`check_gguf_model`) and made again
    when it is damaged (e.g. cut short by an interrupted run); the new one is written under a
    hidden, locked ``.NAME.*.partial`` name and renamed once it checks, so no half-written file takes
    the name, and partial files no process holds (a killed run's) are removed first.

    Raises:
        GemmaExportError: llama.cpp could not requantize ``source``, or its output does not check.
    """
    import os
    import tempfile

    import llama_cpp

    from gemma_export.errors import GemmaExportError
    from gemma_export.sources import PARTIAL_SUFFIX, current_umask, remove_unheld_partials
    from gemma_export.staging import flocked

    target = source.with_name(source.stem.replace("q4_k_m", "q8_0") + ".gguf")
    if target.exists():
        try:
            check_gguf_model(target, vocab)
            return target
        except GemmaExportError as exc:
            print(f"{target}: made again, the one there does not check ({exc})", flush=True)
    remove_unheld_partials(target)  # what a killed run left (one still writing holds its lock)
    handle, scratch = tempfile.mkstemp(prefix=f".{target.name}.", suffix=PARTIAL_SUFFIX, dir=target.parent)
    os.close(handle)
    try:
        with flocked(Path(scratch)):
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
            params.allow_requantize = True
            if llama_cpp.llama_model_quantize(str(source).encode(), scratch.encode(), params) != 0:
                raise GemmaExportError(f"llama.cpp could not requantize {source} to Q8_0 ({target})")
            check_gguf_model(Path(scratch), vocab)
            os.chmod(scratch, 0o666 & ~current_umask())  # mkstemp made it 0600; an ordinary file, as llama.cpp writes
            os.replace(scratch, target)
    finally:
        Path(scratch).unlink(missing_ok=True)
    return target


@contextlib.contextmanager
def interrupts_after_llama():
    """Ctrl-C inside llama.cpp's work ends the run once llama.cpp returns. Python raises the
    interrupt in whatever Python code runs next, and during llama.cpp's quantizer or loader that is
    llama-cpp-python's log callback, whose exceptions ctypes prints and drops: the run went on and
    exited 0. The interrupt is noted and raised again after the block; one outside a callback ends
    it at once, as before."""
    noted = []

    def interrupted(signum, frame):
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if noted:
        raise KeyboardInterrupt


#: what the llama.cpp probe runs in its own process: load a GGUF and evaluate two tokens
LLAMA_PROBE = ("import sys; from llama_cpp import Llama; "
               "Llama(model_path=sys.argv[1], n_threads=1, n_ctx=16, verbose=False).eval([2, 2])")


def check_llama_runs(gguf: Path) -> None:
    """Evaluate two tokens with llama.cpp in a child process first, so that a build that crashes (the
    default build on some AMX machines dies of a general protection fault) is one error line, not a
    segmentation fault of this script after the exports' timings.

    Raises:
        ImportError: llama-cpp-python is not installed (the llama.cpp rows are then skipped).
        SystemExit: the child died of a signal or failed.
    """
    import importlib
    import signal
    import subprocess

    importlib.import_module("llama_cpp")  # not installed: ImportError here, and the caller skips the llama.cpp rows

    done = subprocess.run([sys.executable, "-c", LLAMA_PROBE, str(gguf)], capture_output=True, text=True)
    if done.returncode == 0:
        return
    how = (f"died of {signal.Signals(-done.returncode).name}" if done.returncode < 0 else
           f"failed ({(done.stderr.strip().splitlines() or ['no message'])[-1][:200]})")
    raise SystemExit(f"error: llama.cpp (llama-cpp-python) {how} evaluating two tokens of {gguf}; on a CPU that "
                     "reports AMX, rebuild it without AMX as this script's --help shows, or uninstall it to skip "
                     "the llama.cpp rows")


def planned_runs(parser: argparse.ArgumentParser, models: dict[str, Path], mode: str, status) -> list[tuple]:
    """``(row label, export folder, prepacked)`` of every timing of our exports, in order: each export
    from the heap (``mode`` "off" or "both") or as the runtime picks ("auto"), and with "both" again
    from its pre-packed copy when one is usable here. A copy that exists but cannot be used is named
    with its reason (``status``: :func:`gemma_export.prepack.status`), not skipped in silence.

    Raises:
        SystemExit: (``parser.error``) two timings would get the same label, e.g. ``a=X`` and
            ``"a pre-packed=Y"`` (the second would overwrite the first's row).
    """
    runs: list[tuple] = []
    for name, folder in models.items():
        runs.append((f"ours {name}", folder, None if mode == "auto" else False))
        if mode == "both":
            copy = status(folder)
            if copy.path is not None:
                runs.append((f"ours {name} pre-packed", folder, True))
            elif copy.problem:
                print(f"ours {name}: its pre-packed copy is not timed: {copy.problem}", flush=True)
    labels = [label for label, _, _ in runs]
    if clash := next((label for label in labels if labels.count(label) > 1), None):
        parser.error(f"--models: two timings would both be labelled {clash!r} (a name and another name's "
                     "pre-packed copy); rename one")
    return runs


def other_work_line(rows: dict) -> str:
    """How busy other processes kept the machine while each system's steps were timed (``other_cpus``
    of each row, :class:`gemma_export.bench.OtherWork`; ``—`` where its window was too short to
    tell), and a note naming the systems timed beside ``BUSY_OTHER_CPUS`` or more of other work, as
    ``gemma-export bench`` warns: a collapsed llama.cpp under load gave ratios of 0.006 without a word."""
    from gemma_export.bench import BUSY_OTHER_CPUS, PROC_STAT

    if not PROC_STAT.exists():
        return "other processes' CPU use: not measured here (no /proc/stat)"
    figures = [f"{name} {r['other_cpus']:.2f}" if r.get("other_cpus") is not None else f"{name} —"
               for name, r in rows.items()]
    line = "other processes' CPU use while each system was timed (CPUs; — too short to tell): " + ", ".join(figures)
    busy = [name for name, r in rows.items() if (r.get("other_cpus") or 0.0) >= BUSY_OTHER_CPUS]
    if note := busy_note(busy, "those times, and the ratios built on them, are"):
        line += "\n" + note
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", required=True, type=named(our_export), metavar="NAME=EXPORT_DIR",
                        help="our exports to time, each with a label")
    parser.add_argument("--threads", type=thread_count, default=2, help="intra-op threads of every system (default 2)")
    parser.add_argument("--contexts", type=int_list(1, 8192), default=[16, 128, 512],
                        help="decode is timed after prompts of these lengths (default 16,128,512)")
    parser.add_argument("--new-tokens", type=int_range(4, 4096), default=64,
                        help="decode steps after each prompt; the first 3 are dropped (default 64)")
    parser.add_argument("--prefill", type=int_range(1, 8192), default=512, help="prefill prompt length (default 512)")
    parser.add_argument("--reference", type=reference_mlir,
                        help="a reference export (.mlir, archive beside it), timed under IREE (needs the iree extra)")
    parser.add_argument("--plot", type=plot_file, help="write decode ms/token against context length (needs matplotlib)")
    parser.add_argument("--prepacked", choices=("both", "auto", "off"), default="both",
                        help="both: time each export with its weights packed on the heap and, when it has a copy made "
                             "here by `gemma-export prepack`, again from that copy; auto: whichever the runtime picks; "
                             "off: the heap only")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before each system (needs root): every file read from disk")
    add_ranges(parser)
    args = parser.parse_args()
    from gemma_export.bench import drop_page_cache

    cold = drop_page_cache if args.cold else (lambda: None)
    cold()  # fails early, before any timing, when not permitted
    if args.reference:  # a file IREE cannot run, or IREE missing: said now, not after the other systems ran
        from gemma_export.reference_iree import check_reference_options

        check_reference_options(args.reference, None)
    contexts = args.contexts
    models = unique_names(parser, "--models", args.models)
    from gemma_export.prepack import status

    runs = planned_runs(parser, models, args.prepacked, status)
    positions = max(args.prefill, max(contexts) + args.new_tokens)
    ids = real_text_ids(Path(next(iter(models.values()))), positions)
    vocab = check_exports_fit(models, ids, positions)  # before llama.cpp loads anything
    rows = {}
    try:
        from gemma_export.sources import bundled_gguf_path

        q4 = bundled_gguf_path()
        check_gguf_model(q4, vocab)
        check_llama_runs(q4)
        with interrupts_after_llama():
            q8 = q8_0_gguf(q4, vocab)
            cold()
            rows["llama.cpp Q8_0"] = bench_llama(q8, ids, contexts, args.new_tokens, args.prefill, args.threads)
            cold()
            rows["llama.cpp Q4_K_M"] = bench_llama(q4, ids, contexts, args.new_tokens, args.prefill, args.threads)
    except ImportError:
        print("llama-cpp-python not installed: llama.cpp rows skipped")
    for label, folder, prepacked in runs:
        cold()
        rows[label] = bench_onnx(Path(folder), ids, contexts, args.new_tokens, args.prefill, args.threads, prepacked)
        rows[label]["archive_bytes"] = sum((Path(folder) / f).stat().st_size for f in ("model.onnx", "model.onnx.data"))
    if args.reference:
        cold()
        rows[REFERENCE_ROW] = bench_reference(args.reference, ids)
    bandwidth = read_bandwidth_gbps(threads=args.threads)
    print(f"\n{'cold (page cache dropped before each system), ' if args.cold else ''}threads {args.threads}, decode median of {args.new_tokens - DROPPED_STEPS} steps after prompts of {contexts} tokens, "
          f"prefill {args.prefill} tokens; read bandwidth {bandwidth:.1f} GB/s\n")
    print("\n".join(summary_lines(rows, contexts, bandwidth)))
    print(other_work_line(rows))
    if note := few_steps_note("--new-tokens", args.new_tokens):
        print(note)
    if args.plot:
        write_plot(rows, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    run(main)
