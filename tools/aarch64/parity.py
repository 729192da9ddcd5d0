"""Cross-architecture parity: the same export, the same token ids, on x86-64 and on (emulated) aarch64.

    python tools/aarch64/parity.py prepare --model DIR --out /tmp/gx-ids.json [--tokens 256]
    python tools/aarch64/parity.py dump --model DIR --ids /tmp/gx-ids.json --out /tmp/x86.npz
    sudo tools/aarch64/run.sh python tools/aarch64/parity.py dump --model DIR --ids /tmp/gx-ids.json --out /tmp/arm.npz
    python tools/aarch64/parity.py compare /tmp/x86.npz /tmp/arm.npz [--json OUT]
    python tools/aarch64/parity.py dump ... --optimization basic --out /tmp/x86-basic.npz   # control

``dump --optimization basic`` runs the same export on the same machine without onnxruntime's graph
fusions: the same arithmetic in another float32 order. Comparing it with a normal dump shows how far
an export moves under float32 reordering alone, the yardstick for the cross-architecture figures.

``prepare`` tokenizes on the host (so both sides see identical ids): several real prompts and the
first ``--tokens`` tokens of real text (the Python license). ``dump`` runs greedy decoding of every
prompt and teacher-forced logits over the text through the KV cache. ``compare`` reports, per
prompt, whether the greedy tokens are identical, and over the text: top-1 agreement, max |Δlogit|
and mean KL (``gemma_export.quality.compare_logits``). Exit status 1 when the greedy tokens differ
or top-1 agreement is below ``--min-top1`` (default 0.995).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _args import existing_dir, existing_file, float_range, int_range, new_file, run, thread_count  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nTurn on the kitchen lights and set them to 40 percent.<end_of_turn>\n<start_of_turn>model\n",
    "Python is a programming language that",
    "The license grants permission to",
]


def prepare(args: argparse.Namespace) -> None:
    from gemma_export.bench import real_text
    from gemma_export.runtime import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    text, source = real_text(args.text)
    ids = tokenizer.encode(text).ids[: args.tokens]
    if len(ids) < args.tokens:
        print(f"error: {source}: {len(ids)} tokens, fewer than --tokens {args.tokens}", file=sys.stderr)
        sys.exit(2)
    payload = {"prompts": [tokenizer.encode(p).ids for p in PROMPTS], "prompt_texts": PROMPTS,
               "text": ids, "text_source": source, "new_tokens": args.new_tokens}
    Path(args.out).write_text(json.dumps(payload))
    print(f"wrote {args.out}: {len(PROMPTS)} prompts, {len(ids)} text tokens from {source}")


def dump(args: argparse.Namespace) -> None:
    from gemma_export.runtime import OnnxDecoder, create_session

    from gemma_export.errors import FormatError, is_whole_number, shown

    def id_list(value) -> bool:
        return isinstance(value, list) and len(value) > 0 and all(is_whole_number(i) and i >= 0 for i in value)

    try:
        payload = json.loads(Path(args.ids).read_text(encoding="utf-8"))
        _ = payload["prompts"], payload["text"], payload["new_tokens"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError):
        raise FormatError(f"{args.ids}: not an ids file written by `parity.py prepare` "
                          "(JSON with prompts, text and new_tokens)") from None
    prompts, new_tokens = payload["prompts"], payload["new_tokens"]
    if not (isinstance(prompts, list) and prompts and all(id_list(p) for p in prompts)):
        raise FormatError(f"{args.ids}: 'prompts' must be a non-empty list of non-empty token id lists, found "
                          f"{shown(prompts)}")
    if not id_list(payload["text"]) or len(payload["text"]) < 2:
        raise FormatError(f"{args.ids}: 'text' must be a list of at least 2 token ids, found {shown(payload['text'])}")
    if not (is_whole_number(new_tokens) and 2 <= new_tokens <= 4096):
        raise FormatError(f"{args.ids}: 'new_tokens' must be 2 to 4,096 (one decode step at least), found {shown(new_tokens)}")
    decoder = OnnxDecoder(args.model, threads=args.threads, prepacked=False if args.optimization == "basic" else None)
    if args.optimization == "basic":
        # the same arithmetic in another float32 order: without onnxruntime's fusions (e.g. RMSNorm
        # stays Pow/ReduceMean/Sqrt/Div); a same-machine control for the cross-architecture figures
        decoder.session = create_session(Path(args.model) / "model.onnx", args.threads, optimization="basic")
    greedy, times = [], []
    for prompt in payload["prompts"]:
        new_ids, _, decode_ms = decoder.greedy(prompt, payload["new_tokens"], stop_ids=[])
        greedy.append(new_ids)
        times.extend(decode_ms)
    t0 = time.perf_counter()
    logits = decoder.teacher_forced_logits(payload["text"])
    np.savez(args.out, logits=logits, greedy=np.asarray(greedy, np.int64), text=np.asarray(payload["text"], np.int64),
             machine=platform.machine(), decode_ms_median=float(np.median(times)),
             prepacked=str(decoder.prepacked_path or ""),
             teacher_forced_s=time.perf_counter() - t0)
    graph = f"; pre-packed copy {decoder.prepacked_path}" if decoder.prepacked_path else ""
    print(f"{platform.machine()}: wrote {args.out} (decode median {np.median(times):.1f} ms/token{graph})")


def compare(args: argparse.Namespace) -> None:
    from gemma_export.quality import compare_logits

    from gemma_export.errors import FormatError

    def load(path: Path):
        try:
            dump = np.load(path)
            _ = [dump[key] for key in ("logits", "greedy", "text", "machine", "decode_ms_median")]
            return dump
        except (ValueError, OSError, KeyError):
            raise FormatError(f"{path}: not a dump written by `parity.py dump` (.npz with logits, greedy, text)") from None

    a, b = load(args.a), load(args.b)
    if not np.array_equal(a["text"], b["text"]) or a["greedy"].shape != b["greedy"].shape:
        print("error: the two dumps were made from different token ids or prompts (run dump with the same --ids)",
              file=sys.stderr)
        sys.exit(2)
    same = [bool(np.array_equal(x, y)) for x, y in zip(a["greedy"], b["greedy"])]
    first_diff = [int(np.flatnonzero(x != y)[0]) if not s else None for x, y, s in zip(a["greedy"], b["greedy"], same)]
    m = compare_logits(a["logits"], b["logits"], a["text"].tolist())
    report = {"machines": [str(a["machine"]), str(b["machine"])], "greedy_identical": same,
              "greedy_first_difference": first_diff, "greedy_tokens_per_prompt": int(a["greedy"].shape[1]),
              "decode_ms_median": [_number_or_null(a["decode_ms_median"]), _number_or_null(b["decode_ms_median"])],
              **m.to_dict()}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if not all(same) or m.top1_agreement < args.min_top1:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", description="Tokenize the prompts and the text on this machine into an ids file "
                       "for `dump`. Example: parity.py prepare --model gemma-3-270m-onnx-int8 --out ids.json")
    p.add_argument("--model", required=True, type=existing_dir, help="an export folder (its tokenizer is used)")
    p.add_argument("--out", required=True, type=new_file, help="the ids file to write (JSON)")
    p.add_argument("--tokens", type=int_range(1, 32768), default=256, help="teacher-forced text tokens (default 256)")
    p.add_argument("--new-tokens", type=int_range(2, 4096), default=16,
                   help="greedy tokens per prompt (default 16; at least 2, so that a decode step is timed)")
    p.add_argument("--text", default=None, type=existing_file, help="text file (default: the Python license)")
    p.set_defaults(run=prepare)
    p = sub.add_parser("dump", description="Run the export on this machine over the ids file: greedy tokens and "
                       "teacher-forced logits. Example: parity.py dump --model gemma-3-270m-onnx-int8 --ids ids.json "
                       "--out x86.npz")
    p.add_argument("--model", required=True, type=existing_dir, help="an export folder")
    p.add_argument("--ids", required=True, type=existing_file, help="the file `prepare` wrote")
    p.add_argument("--out", required=True, type=npz_file, help="the dump to write (a .npz file name)")
    p.add_argument("--threads", type=thread_count, default=2, help="intra-op threads (default 2)")
    p.add_argument("--optimization", choices=("all", "basic"), default="all",
                   help="onnxruntime graph optimization level; basic leaves the fusions out (a control run)")
    p.set_defaults(run=dump)
    p = sub.add_parser("compare", description="Compare two dumps of the same ids (e.g. x86-64 and aarch64); exits 1 "
                       "below --min-top1. Example: parity.py compare x86.npz arm.npz --json report.json")
    p.add_argument("a", type=existing_file, help="a dump (.npz)")
    p.add_argument("b", type=existing_file, help="another dump of the same ids")
    p.add_argument("--json", default=None, type=new_file, help="also write the report here")
    p.add_argument("--min-top1", type=float_range(0.0, 1.0), default=0.995,
                   help="top-1 agreement below this exits 1 (default 0.995)")
    p.set_defaults(run=compare)
    args = parser.parse_args()
    args.run(args)


def _number_or_null(value) -> float | None:
    """A float for the JSON report; None (JSON null) for a NaN, which strict JSON readers refuse."""
    number = float(value)
    return number if np.isfinite(number) else None


def npz_file(value: str) -> Path:
    """A .npz file name to write (numpy would append .npz to any other name)."""
    path = new_file(value)
    if path.suffix != ".npz":
        raise argparse.ArgumentTypeError(f"{path}: expected a file name ending in .npz")
    return path


if __name__ == "__main__":
    run(main)
