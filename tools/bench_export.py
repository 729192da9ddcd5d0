"""Benchmark exports of the bundled real Gemma 3 270M: archive size, export time and peak memory,
onnxruntime memory growth (Anonymous and Rss from /proc/self/smaps_rollup) and latency, the last two
with `gemma-export bench` (real-text prompts of 16 and --prompt-tokens tokens).

Usage:
    python tools/bench_export.py --dtypes fp32,bf16,int8 --workdir /tmp/gx-bench [--threads 2]

Needs GNU time (``/usr/bin/time``, Debian package ``time``) for the exports' peak memory. Each dtype
is a full export of the real model (1–4 minutes, the int4 one the longest) plus a benchmark (a few minutes).

Each export and each measurement runs in its own process so that memory figures do not mix.
Prints a Markdown table (paste into docs/benchmarks.md) and writes bench.json in the workdir; per
dtype, WORKDIR/DTYPE/ holds the export (model/), its bench.json and optimized.onnx (onnxruntime's
optimized graph, read to count the table initializers after its optimizations).
Figures are machine-dependent: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import shutil
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import add_ranges, int_range, kept_report, run, thread_count, writable_dir  # noqa: E402

from gemma_export.bench import WARMUP_STEPS  # noqa: E402
from gemma_export.config import DTYPES  # noqa: E402

#: the short prompt every dtype is measured with (tokens), before --prompt-tokens
SHORT_PROMPT = 16

#: how GNU time's line with the peak resident memory (KiB) starts (``-f``), told apart from the step's own
PEAK_LINE = "gnu-time-peak-kib="

#: GNU time's own lines about a step that failed (``Command exited with non-zero status 2``)
GNU_TIME_LINES = ("Command exited with non-zero status", "Command terminated by signal")


def _dtypes(value: str) -> list[str]:
    names = [d.strip() for d in value.split(",")]
    unknown = [d for d in names if d not in DTYPES]
    if unknown or not value.strip():
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes from {', '.join(DTYPES)}, found {value!r}")
    repeated = next((d for i, d in enumerate(names) if d in names[:i]), None)
    if repeated:  # each dtype is exported into WORKDIR/<dtype>: a second one would time the first's folder again
        raise argparse.ArgumentTypeError(f"{repeated} is given twice in {value!r}; give each dtype once")
    return names


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a step; its own last line on stderr (the toolkit's ``error: ...``; GNU time's lines left
    out) is what a failure reports.

    Raises:
        GemmaExportError: naming the command, its exit status and that line.
    """
    from gemma_export.errors import GemmaExportError

    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        own = [line for line in proc.stderr.strip().splitlines()
               if not line.startswith(PEAK_LINE) and not line.startswith(GNU_TIME_LINES)]
        last = (own or ["no output"])[-1]
        raise GemmaExportError(f"{' '.join(cmd[:6])} ... failed (exit {proc.returncode}): {last}")
    return proc


def _optimized_tables(model_dir: Path) -> int:
    """V x H initializers in onnxruntime's optimized graph of an export (must be 1 when tied)."""
    code = (
        "import json, sys, onnx; from gemma_export.runtime import OnnxDecoder; "
        "from gemma_export.verify import is_table_shaped; d = sys.argv[1]; "
        "OnnxDecoder(d, threads=1, optimized_model_path=d + '/../optimized.onnx'); "
        "g = onnx.load(d + '/../optimized.onnx', load_external_data=False).graph; "
        "c = json.load(open(d + '/manifest.json'))['config']; "
        "print(sum(is_table_shaped(t.dims, t.data_type, c['vocab_size'], c['hidden_size']) for t in g.initializer))")
    return int(subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True,
                              check=True).stdout.split()[-1])


def table_lines(rows: list[dict], prompt_tokens: int) -> list[str]:
    """The Markdown table of ``rows`` (one per dtype: the export's figures and its ``bench`` JSON):
    sizes, export time and peak, memory growth after the generations (their KV caches freed) and in
    use at the long prompt's last step (the cache live; "—" where bench could not read it), the
    optimized graph's table initializers, prefill and decode times."""
    def grew(value, archive):
        return "—" if value is None else f"{value / 1e6:.0f} MB ({value / archive:.3f}×)"

    lines = ["| dtype | archive MB | export s | export peak RSS MB | Anonymous growth, session + 16-token prompt + "
             "decode, cache freed (× archive) | Rss growth, same (× archive) | Anonymous growth after the long "
             "prompt too, cache freed | Anonymous in use at the long prompt's last step, cache live "
             "| V×H initializers after ORT optimization | prefill ms (long prompt) | decode ms/token (median) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = r["archive_bytes"]
        lines.append(f"| {r['dtype']} | {a / 1e6:.1f} | {r['export_s']:.0f} | {r['export_peak_rss_bytes'] / 1e6:.0f} "
                     f"| {grew(r['anon_growth_short_bytes'], a)} | {grew(r['rss_growth_short_bytes'], a)} "
                     f"| {grew(r['anon_growth_bytes'], a)} | {grew(r.get('anon_in_use_bytes'), a)} "
                     f"| {r['optimized_table_initializers']} | {r['prefill_ms'][str(prompt_tokens)]:.0f} "
                     f"| {r['decode_ms_median']:.1f} |")
    return lines


def check_text_length(prompt_tokens: int) -> None:
    """Refuse, before any export, a ``--prompt-tokens`` longer than the real text the bench step
    prompts with (the Python license: 3,439 tokens with the bundled tokenizer), which that step
    would refuse after the export.

    Raises:
        GemmaExportError: naming the text, its tokens and the option.
    """
    from tokenizers import Tokenizer

    from gemma_export.bench import real_text
    from gemma_export.errors import GemmaExportError
    from gemma_export.sources import open_source

    text, source = real_text(None)
    checkpoint = open_source(None)  # the bundled model's tokenizer, as the exports will carry it
    if checkpoint.tokenizer is None or "tokenizer.json" not in checkpoint.tokenizer.files:
        return  # the bench step checks it
    tokens = len(Tokenizer.from_str(checkpoint.tokenizer.files["tokenizer.json"].decode("utf-8")).encode(text).ids)
    if tokens < prompt_tokens:
        raise GemmaExportError(f"--prompt-tokens {prompt_tokens}: the bench step prompts with {source}, which has "
                               f"{tokens:,} tokens (with <bos>); give at most {tokens:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", type=_dtypes, default=["fp32", "bf16", "int8"],
                        help="comma-separated: fp32, bf16, int8, int4 (default fp32,bf16,int8)")
    parser.add_argument("--workdir", type=writable_dir, default="/tmp/gx-bench",  # a str: checked as given ones are
                        help="where the exports and bench.json go (default /tmp/gx-bench)")
    parser.add_argument("--threads", type=thread_count, default=2, help="intra-op threads (default 2)")
    parser.add_argument("--prompt-tokens", type=int_range(SHORT_PROMPT + 1, 8192), default=512,
                        help=f"the long prompt, after the {SHORT_PROMPT}-token one (default 512)")
    parser.add_argument("--new-tokens", type=int_range(WARMUP_STEPS + 1, 4096), default=128,
                        help=f"decode steps per prompt, the first {WARMUP_STEPS} untimed (default 128)")
    add_ranges(parser)
    args = parser.parse_args()
    from gemma_export.errors import GemmaExportError

    if shutil.which("/usr/bin/time") is None:
        raise GemmaExportError("/usr/bin/time: not found; install GNU time (Debian: apt-get install time)")
    # what each step writes, before the first export (a folder there failed the run after minutes)
    for report in (args.workdir / "bench.json", *(args.workdir / dtype / "bench.json" for dtype in args.dtypes)):
        if report.is_dir():
            raise GemmaExportError(f"{report}: is a folder, where this script writes a report")
        try:  # someone's own bench.json there was replaced after the exports, without a word
            kept_report(report, "--json", None if report.parent == args.workdir else "decode_ms_median")
        except argparse.ArgumentTypeError as exc:
            raise GemmaExportError(str(exc)) from None
    check_text_length(args.prompt_tokens)
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in args.dtypes:
        out = args.workdir / dtype / "model"
        t0 = time.perf_counter()
        proc = _run(["/usr/bin/time", "-f", f"{PEAK_LINE}%M", sys.executable, "-m", "gemma_export.cli", "--dtype", dtype, "--out", str(out)])
        export_s = time.perf_counter() - t0
        peak_kb = int(proc.stderr.strip().splitlines()[-1].removeprefix(PEAK_LINE))
        time.sleep(5)  # let the kernel write back the fresh data file (dirty pages skew Rss)
        subprocess.run(["sync"], check=False)
        archive = (out / "model.onnx").stat().st_size + (out / "model.onnx.data").stat().st_size
        figures = args.workdir / dtype / "bench.json"
        _run([sys.executable, "-m", "gemma_export.cli", "bench", "--model", str(out), "--threads", str(args.threads),
              "--prompt-tokens", f"{SHORT_PROMPT},{args.prompt_tokens}", "--new-tokens", str(args.new_tokens), "--json", str(figures)])
        measured = json.loads(figures.read_text())
        measured["optimized_table_initializers"] = _optimized_tables(out)
        rows.append({"dtype": dtype, "archive_bytes": archive, "export_s": export_s,
                     "export_peak_rss_bytes": peak_kb * 1024, **measured})
        print(json.dumps(rows[-1]), flush=True)
    (args.workdir / "bench.json").write_text(json.dumps(rows, indent=2))
    print("\n" + "\n".join(table_lines(rows, args.prompt_tokens)))


if __name__ == "__main__":
    run(main)
