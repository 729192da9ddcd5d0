"""Memory and time of `gemma-export inspect` on a 1 GB archive holding one table three times.

Writes (once, into --workdir) a safetensors archive with Gemma 3 270M's table shape
(262,144 x 640): float32 (671 MB), a flat 1-D bf16 copy made by truncation as the reference
archives do (336 MB), and an int8 copy with per-row float32 scales (168 MB): 1.18 GB in all. Then
runs `gemma-export inspect` on it in a fresh process and reports that process's peak resident
memory (VmHWM), its final Rss and Anonymous (/proc/self/smaps_rollup), the wall time, and whether
both copies were found. The duplicate search streams the file in chunks, so the peak should stay far
below the archive size (issue #5: under 300 MB). Writing the archive the first time is another
matter: this script builds the three copies in memory and peaks at about 2.5 GB while it does
(a fresh user's run, 2026-12-07); later runs read the kept archive.

Usage:
    python tools/bench_inspect.py [--workdir /tmp/gx-inspect] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import add_ranges, int_range, make_folders, new_dir, remove_folders, run, writable_dir  # noqa: E402

VOCAB, HIDDEN = 262_144, 640

_MEASURE = """
import json, sys, time
from typer.testing import CliRunner
from gemma_export.cli import app
from gemma_export.memory import _kb_fields, peak_rss_bytes, snapshot
start = time.perf_counter()
result = CliRunner().invoke(app, ["inspect", sys.argv[1], "--json"])
elapsed = time.perf_counter() - start
if result.exit_code != 0:  # its error line, for the caller's message
    sys.exit((result.output.strip().splitlines() or ["exit status %d" % result.exit_code])[-1])
now = snapshot()
report = json.loads(result.stdout)
print(json.dumps({"exit_code": result.exit_code, "seconds": elapsed, "peak_rss": peak_rss_bytes(),
                  "rss": now.rss_bytes, "anonymous": now.anonymous_bytes,
                  "duplicates": [(d["kind"], d["names"]) for d in report["duplicates"]],
                  "total_bytes": report["total_bytes"]}))
"""

_BASELINE = """
import json
import gemma_export.cli, gemma_export.inspect, onnx, gguf, typer.testing
from gemma_export.memory import peak_rss_bytes
print(json.dumps({"peak_rss": peak_rss_bytes()}))
"""


def write_archive(path: Path) -> None:
    import ml_dtypes
    from safetensors.numpy import save_file

    from quant import BlockInt8Weights
    from quant.bf16 import truncate_to_bfloat16_bits
    from quant.int8 import ZERO_POINT

    rng = np.random.default_rng(0)
    table = (rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.05)
    bf16 = truncate_to_bfloat16_bits(table).view(ml_dtypes.bfloat16).reshape(-1)  # the reference's bf16
    rows = BlockInt8Weights.quantize(table, HIDDEN)  # one block per row: the reference's per-row int8
    q = (rows.data.reshape(VOCAB, HIDDEN).astype(np.int16) - ZERO_POINT).astype(np.int8)
    scale = rows.scales.reshape(-1)
    from gemma_export.sources import current_umask

    tmp = path.with_suffix(".partial")
    try:
        save_file({"t0": table, "t2044": bf16, "t2051": q, "t2051_scale": scale}, str(tmp))
        tmp.chmod(0o666 & ~current_umask())  # save_file creates it 0600; a kept file gets the umask's mode
        tmp.rename(path)
    except BaseException:  # Ctrl-C, a full disk: no 1.18 GB partial file left behind
        tmp.unlink(missing_ok=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=new_dir, default=Path("/tmp/gx-inspect"),
                        help="where the 1.18 GB archive is written once and kept (default /tmp/gx-inspect)")
    parser.add_argument("--runs", type=int_range(1, 100), default=3, help="inspect runs; medians are reported (default 3)")
    add_ranges(parser)
    args = parser.parse_args()
    from gemma_export.errors import GemmaExportError

    archive = args.workdir / "table-three-times.safetensors"
    if not archive.exists():
        try:  # before the 1.18 GB table is built: a kept archive is only read, so a read-only folder may hold one
            writable_dir(str(args.workdir))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"argument --workdir: {exc}")
        made = make_folders(args.workdir)
        print(f"writing {archive} ...", file=sys.stderr)
        try:
            write_archive(archive)
        except BaseException:
            remove_folders(made)
            raise
    size = archive.stat().st_size
    baseline = json.loads(subprocess.run([sys.executable, "-c", _BASELINE], capture_output=True, text=True,
                                         check=True).stdout)["peak_rss"]
    runs = []
    for i in range(args.runs):
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(archive)], capture_output=True, text=True)
        if out.returncode != 0:  # e.g. a damaged archive kept from an interrupted earlier run
            last = (out.stderr.strip().splitlines() or ["no output"])[-1]
            raise GemmaExportError(f"{archive}: gemma-export inspect failed on it ({last}); delete it to write it again")
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"run {i + 1}: {runs[-1]['seconds']:.1f} s, peak {runs[-1]['peak_rss'] / 2**20:.0f} MiB", file=sys.stderr)
    mib = lambda n: f"{n / 2**20:,.0f} MiB"  # noqa: E731
    peak = statistics.median(r["peak_rss"] for r in runs)
    print(f"| archive | {size / 1e9:.2f} GB ({size:,} bytes) |")
    print(f"| peak resident memory (VmHWM), median of {args.runs} | {mib(peak)} ({peak / size:.3f} x archive) |")
    print(f"| of which the Python process with the toolkit imported | {mib(baseline)} |")
    print(f"| Rss / Anonymous at the end | {mib(statistics.median(r['rss'] for r in runs))} / "
          f"{mib(statistics.median(r['anonymous'] for r in runs))} |")
    print(f"| wall time, median | {statistics.median(r['seconds'] for r in runs):.1f} s |")
    print(f"| duplicates found | {runs[0]['duplicates']} |")


if __name__ == "__main__":
    run(main)
