"""Benchmark exports of the bundled real Gemma 3 270M: archive size, export time and peak memory,
onnxruntime memory growth (Anonymous and Rss from /proc/self/smaps_rollup) and decode latency.

Usage:
    python tools/bench_export.py --dtypes fp32,bf16,int8 --workdir /tmp/gx-bench [--threads 2]

Each export and each measurement runs in its own process so that memory figures do not mix.
Prints a Markdown table (paste into docs/benchmarks.md) and writes bench.json in the workdir.
Figures are machine-dependent: compare ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

MEASURE = r'''
import json, math, sys, time
import numpy as np, onnx
from gemma_export.memory import snapshot
from gemma_export.runtime import OnnxDecoder
model_dir, threads, prompt_tokens, new_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
before = snapshot()
t0 = time.perf_counter()
dec = OnnxDecoder(model_dir, threads=threads, optimized_model_path=model_dir + "/../optimized.onnx")
create_s = time.perf_counter() - t0
ids = np.random.default_rng(0).integers(1000, 200000, size=(1, prompt_tokens)).astype(np.int64)
t0 = time.perf_counter()
logits, past = dec.forward(ids, np.ones_like(ids), np.arange(prompt_tokens)[None], dec.empty_cache(1))
prefill_ms = (time.perf_counter() - t0) * 1e3
steps = []
token = int(logits[0, -1].argmax())
for i in range(new_tokens):
    pos = prompt_tokens + i
    t0 = time.perf_counter()
    logits, past = dec.forward(np.array([[token]]), np.ones((1, pos + 1), np.int64), np.array([[pos]]), past)
    steps.append((time.perf_counter() - t0) * 1e3)
    token = int(logits[0, -1].argmax())
after = snapshot()
g = onnx.load(model_dir + "/../optimized.onnx", load_external_data=False).graph
manifest = json.load(open(model_dir + "/manifest.json"))
c = manifest["config"]
tables = sum(1 for t in g.initializer if math.prod(t.dims) == c["vocab_size"] * c["hidden_size"])
print(json.dumps({"anon_growth": after.anonymous_bytes - before.anonymous_bytes,
                  "rss_growth": after.rss_bytes - before.rss_bytes, "session_create_s": create_s,
                  "prefill_ms": prefill_ms, "decode_ms_median": float(np.median(steps[4:])),
                  "optimized_table_initializers": tables}))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="fp32,bf16,int8")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gx-bench"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for dtype in args.dtypes.split(","):
        out = args.workdir / dtype / "model"
        t0 = time.perf_counter()
        proc = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-m", "gemma_export.cli",
                               "--dtype", dtype, "--out", str(out)], capture_output=True, text=True, check=True)
        export_s = time.perf_counter() - t0
        peak_kb = int(proc.stderr.strip().splitlines()[-1])
        time.sleep(5)  # let the kernel write back the fresh data file (dirty pages skew Rss)
        subprocess.run(["sync"], check=False)
        archive = (out / "model.onnx").stat().st_size + (out / "model.onnx.data").stat().st_size
        measured = json.loads(subprocess.run(
            [sys.executable, "-c", MEASURE, str(out), str(args.threads), str(args.prompt_tokens), str(args.new_tokens)],
            capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])
        rows.append({"dtype": dtype, "archive_bytes": archive, "export_s": export_s,
                     "export_peak_rss_bytes": peak_kb * 1024, **measured})
        print(json.dumps(rows[-1]), flush=True)
    (args.workdir / "bench.json").write_text(json.dumps(rows, indent=2))
    print("\n| dtype | archive MB | export s | export peak RSS MB | anon growth (× archive) | Rss growth (× archive) "
          "| V×H initializers after ORT optimization | prefill ms | decode ms/token (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a = r["archive_bytes"]
        print(f"| {r['dtype']} | {a / 1e6:.1f} | {r['export_s']:.0f} | {r['export_peak_rss_bytes'] / 1e6:.0f} "
              f"| {r['anon_growth'] / 1e6:.0f} MB ({r['anon_growth'] / a:.2f}×) | {r['rss_growth'] / 1e6:.0f} MB "
              f"({r['rss_growth'] / a:.2f}×) | {r['optimized_table_initializers']} | {r['prefill_ms']:.0f} "
              f"| {r['decode_ms_median']:.1f} |")


if __name__ == "__main__":
    main()
