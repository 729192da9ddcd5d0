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
or top-1 agreement is below ``--min-top1`` (default 0.995); 2 for bad input.

Each output (``prepare --out``, ``dump --out``, ``compare --json``) is checked before the work: a
folder that takes new files, not one of the command's inputs, not inside the export folder or any
other output of gemma-export, and either new or an earlier output of the same kind (:data:`OUTPUTS`;
anything else is not replaced). It is written whole or not at all: a temporary file beside it is
renamed over it, and an interrupt or a full disk leaves the earlier file as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _args import add_ranges, existing_dir, existing_file, float_range, int_range, run, thread_count, writable_file  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "<start_of_turn>user\nTurn on the kitchen lights and set them to 40 percent.<end_of_turn>\n<start_of_turn>model\n",
    "Python is a programming language that",
    "The license grants permission to",
]


def prepare(args: argparse.Namespace) -> None:
    from gemma_export.bench import real_text, write_whole_file
    from gemma_export.runtime import load_tokenizer

    check_output(args.out, "--out", "ids", inputs=(args.text,), model=args.model)
    tokenizer = load_tokenizer(args.model)
    text, source = real_text(args.text)
    ids = tokenizer.encode(text).ids[: args.tokens]
    if len(ids) < args.tokens:
        print(f"error: {source}: {len(ids)} tokens, fewer than --tokens {args.tokens}", file=sys.stderr)
        sys.exit(2)
    payload = {"prompts": [tokenizer.encode(p).ids for p in PROMPTS], "prompt_texts": PROMPTS,
               "text": ids, "text_source": source, "new_tokens": args.new_tokens}
    write_whole_file(args.out, lambda temporary: temporary.write_text(json.dumps(payload)), "--out")
    print(f"wrote {args.out}: {len(PROMPTS)} prompts, {len(ids)} text tokens from {source}")


def dump(args: argparse.Namespace) -> None:
    from gemma_export.bench import write_whole_file
    from gemma_export.runtime import OnnxDecoder, create_session

    from gemma_export.errors import FormatError, is_whole_number, shown

    def id_list(value) -> bool:
        return isinstance(value, list) and len(value) > 0 and all(is_whole_number(i) and i >= 0 for i in value)

    check_output(args.out, "--out", "dump", inputs=(args.ids,), model=args.model)
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
    from gemma_export.quality import model_sliding_window

    # the window the graph was built with (0: none), for compare's split of top-1 agreement
    arrays = dict(logits=logits, greedy=np.asarray(greedy, np.int64), text=np.asarray(payload["text"], np.int64),
                  machine=platform.machine(), decode_ms_median=float(np.median(times)),
                  prepacked=str(decoder.prepacked_path or ""), teacher_forced_s=time.perf_counter() - t0,
                  sliding_window=model_sliding_window(decoder) or 0, export=export_identity(Path(args.model)))

    def write(temporary: Path) -> None:
        with open(temporary, "wb") as f:  # a file object: given a name, numpy would append .npz to the temporary one
            np.savez(f, **arrays)

    write_whole_file(args.out, write, "--out")
    graph = f"; pre-packed copy {decoder.prepacked_path}" if decoder.prepacked_path else ""
    print(f"{platform.machine()}: wrote {args.out} (decode median {np.median(times):.1f} ms/token{graph})")


def compare(args: argparse.Namespace) -> None:
    from gemma_export.bench import write_whole_file
    from gemma_export.quality import compare_logits

    from gemma_export.errors import FormatError

    if args.json is not None:
        check_output(args.json, "--json", "report", inputs=(args.a, args.b))
    a, b = load_dump(args.a), load_dump(args.b)
    if not np.array_equal(a["text"], b["text"]) or a["greedy"].shape != b["greedy"].shape:
        print("error: the two dumps were made from different token ids or prompts (run dump with the same --ids)",
              file=sys.stderr)
        sys.exit(2)
    if a["logits"].shape != b["logits"].shape:
        raise FormatError(f"{args.a} and {args.b}: logits over {a['logits'].shape[1]:,} and {b['logits'].shape[1]:,} "
                          "words, the vocabularies of two exports; compare dumps of one export")
    if a["export"] and b["export"] and a["export"] != b["export"]:
        raise FormatError(f"{args.a} and {args.b}: dumps of two exports (their manifests list other graph or data "
                          "files); compare dumps of one export")
    same = [bool(np.array_equal(x, y)) for x, y in zip(a["greedy"], b["greedy"])]
    first_diff = [int(np.flatnonzero(x != y)[0]) if not s else None for x, y, s in zip(a["greedy"], b["greedy"], same)]
    window = _window(args.a, args.b, [a["sliding_window"], b["sliding_window"]])
    m = compare_logits(a["logits"], b["logits"], a["text"].tolist(), sliding_window=window)
    report = {"machines": [str(a["machine"]), str(b["machine"])], "greedy_identical": same,
              "greedy_first_difference": first_diff, "greedy_tokens_per_prompt": int(a["greedy"].shape[1]),
              "decode_ms_median": [_number_or_null(a["decode_ms_median"]), _number_or_null(b["decode_ms_median"])],
              **m.to_dict()}
    print(json.dumps(report, indent=2))
    if args.json is not None:
        write_whole_file(args.json, lambda temporary: temporary.write_text(json.dumps(report, indent=2) + "\n"),
                         "--json")
    failed = verdict_failures(same, first_diff, m.top1_agreement, args.min_top1)
    if failed:
        print(f"FAIL: {'; '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    print(f"PASS: greedy tokens identical in {len(same)} of {len(same)} prompts, top-1 agreement "
          f"{m.top1_agreement:.2%} (at least {args.min_top1:.2%})", file=sys.stderr)


def verdict_failures(same: list[bool], first_diff: list[int | None], top1: float, min_top1: float) -> list[str]:
    """The checks ``compare`` failed, one phrase each (empty: it passes): the greedy tokens of a
    prompt differ (at which token of it), top-1 agreement below ``min_top1`` (fractions, 0 to 1)."""
    failed = []
    differing = [f"prompt {i} from token {first}" for i, first in enumerate(first_diff) if first is not None]
    if differing:
        failed.append(f"greedy tokens differ in {len(differing)} of {len(same)} prompts ({', '.join(differing)})")
    if top1 < min_top1:
        digits = next((d for d in range(2, 7) if f"{top1:.{d}%}" != f"{min_top1:.{d}%}"), 7)  # 99.499% is no 99.50%
        failed.append(f"top-1 agreement {top1:.{digits}%} is below --min-top1 {min_top1:.{digits}%}")
    return failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", description="Tokenize the prompts and the text on this machine into an ids file "
                       "for `dump`. Example: parity.py prepare --model gemma-3-270m-onnx-int8 --out ids.json")
    p.add_argument("--model", required=True, type=existing_dir, help="an export folder (its tokenizer is used)")
    p.add_argument("--out", required=True, type=output_file,
                   help="the ids file to write (JSON; a new file or one prepare wrote)")
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
    p.add_argument("--out", required=True, type=npz_file,
                   help="the dump to write (a .npz file name; a new file or an earlier dump)")
    p.add_argument("--threads", type=thread_count, default=2, help="intra-op threads (default 2)")
    p.add_argument("--optimization", choices=("all", "basic"), default="all",
                   help="onnxruntime graph optimization level; basic leaves the fusions out (a control run)")
    p.set_defaults(run=dump)
    p = sub.add_parser("compare", description="Compare two dumps of the same ids (e.g. x86-64 and aarch64): the report "
                       "(JSON) on stdout, a PASS or FAIL line on stderr; exits 1 when the greedy tokens of a prompt "
                       "differ or top-1 agreement is below --min-top1. Example: parity.py compare x86.npz arm.npz --json report.json")
    p.add_argument("a", type=existing_file, help="a dump (.npz)")
    p.add_argument("b", type=existing_file, help="another dump of the same ids")
    p.add_argument("--json", default=None, type=output_file,
                   help="also write the report here (a new file or an earlier report)")
    p.add_argument("--min-top1", type=float_range(0.0, 1.0), default=0.995,
                   help="top-1 agreement below this exits 1 (default 0.995)")
    p.set_defaults(run=compare)
    add_ranges(parser)
    args = parser.parse_args(argv)
    args.run(args)


def _number_or_null(value) -> float | None:
    """A float for the JSON report; None (JSON null) for a NaN, which strict JSON readers refuse."""
    number = float(value)
    return number if np.isfinite(number) else None


def output_file(value: str) -> Path:
    """An output file (:func:`_args.writable_file`) whose place among the inputs and the outputs of
    gemma-export :func:`check_output` checks, naming the export folder as such."""
    return writable_file(value, outside_outputs=False)


def npz_file(value: str) -> Path:
    """A .npz file name to write (:func:`_args.writable_file`): what `compare` reads is a .npz archive."""
    path = output_file(value)
    if path.suffix != ".npz":
        raise argparse.ArgumentTypeError(f"{path}: expected a file name ending in .npz")
    return path


#: the arrays of a dump that ``compare`` reads: (numpy dtype kinds, dimensions, what it must hold)
DUMP_ARRAYS = {
    "logits": ("f", 2, "float [T, V]"),
    "greedy": ("iu", 2, "integer [prompts, new tokens]"),
    "text": ("iu", 1, "integer [T]"),
    "machine": ("U", 0, "a string"),
    "decode_ms_median": ("fiu", 0, "a number"),
}


def export_identity(folder: Path) -> str:
    """The sha256 the export's manifest records for its graph and data file, as one string, so that
    ``compare`` can tell dumps of two exports from a parity failure of one; "" when the manifest lists
    no files. Read from the manifest, not hashed: the export is checked when the decoder loads it."""
    from gemma_export.errors import GemmaExportError
    from gemma_export.manifest import read_manifest
    from gemma_export.onnx_files import DATA_FILE, MODEL_FILE

    try:
        files = read_manifest(folder).get("files")
    except GemmaExportError:
        return ""
    if not isinstance(files, dict):
        return ""
    return ";".join(f"{name}:{files[name].get('sha256')}" for name in (MODEL_FILE, DATA_FILE)
                    if isinstance(files.get(name), dict))


def _window(a: Path, b: Path, windows: list[int]) -> int | None:
    """The sliding window two dumps ``a`` and ``b`` record (:func:`load_dump`'s ``sliding_window``,
    0: none), for the split of top-1 agreement.

    Raises:
        FormatError: the dumps record different windows.
    """
    from gemma_export.errors import FormatError

    if len(set(windows)) != 1:
        raise FormatError(f"{a} and {b}: dumps of sliding windows {windows}; compare dumps of one export")
    return windows[0] or None


def load_dump(path: Path) -> dict[str, np.ndarray]:
    """The arrays of a dump (:data:`DUMP_ARRAYS`), each checked for its kind and dimensions, and
    ``logits`` against ``text``: a row per id, and a column for every id; with ``sliding_window``
    (an int: the graph's window, 0 for none, 512 for a dump written before dumps recorded it) and
    ``export`` (:func:`export_identity`; "" for a dump written before dumps recorded it).

    Raises:
        FormatError: ``"{path}: not a dump written by `parity.py dump` (expected ...; found ...)"``,
            or a ``sliding_window`` that is no integer >= 0.
    """
    from gemma_export.config import GEMMA3_270M_SLIDING_WINDOW
    from gemma_export.errors import FormatError, shown

    def refused(found: str) -> FormatError:
        return FormatError(f"{path}: not a dump written by `parity.py dump` (expected .npz with "
                           f"{', '.join(DUMP_ARRAYS)}; found {found})")

    try:
        loaded = np.load(path, mmap_mode="r")  # mapped: a large .npy named by mistake is not read whole
    except EOFError:
        raise refused("an empty file") from None
    except zipfile.BadZipFile as exc:
        raise refused(f"a damaged zip archive: {exc}") from None
    except ValueError:  # pickled data, or bytes numpy does not know
        raise refused("a file numpy does not read") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise refused(f"one array (.npy), {loaded.dtype} {list(loaded.shape)}")
    arrays = {}
    with loaded:
        for name, (kinds, ndim, what) in DUMP_ARRAYS.items():
            if name not in loaded.files:
                raise refused(f"no {name!r} array")
            try:
                array = loaded[name]
            except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:  # a damaged member
                raise refused(f"{name!r} cannot be read: {exc}") from None
            if array.dtype.kind not in kinds or array.ndim != ndim:
                found = shown(array.item()) if array.ndim == 0 and array.dtype.kind != "O" else \
                    f"{array.dtype} {list(array.shape)}"
                raise refused(f"{name!r} is {found}, expected {what}")
            arrays[name] = array
        # the graph's window (dump writes it; 0: none); Gemma 3 270M's 512 for dumps written before that
        window = loaded["sliding_window"] if "sliding_window" in loaded.files else None
        # which export made it (dump writes it; "" for dumps written before that: not compared)
        export = loaded["export"] if "export" in loaded.files else None
    if export is not None and (export.ndim != 0 or export.dtype.kind != "U"):
        raise FormatError(f"{path}: 'export' must be a string (the export's graph and data sha256), found "
                          f"{export.dtype} {list(export.shape)}")
    arrays["export"] = "" if export is None else str(export)
    if window is None:
        arrays["sliding_window"] = GEMMA3_270M_SLIDING_WINDOW
    elif window.ndim != 0 or window.dtype.kind not in "iu" or int(window) < 0:
        raise FormatError(f"{path}: 'sliding_window' must be an integer >= 0 (0: none), found {window!r:.40}")
    else:
        arrays["sliding_window"] = int(window)
    (rows, vocab), text = arrays["logits"].shape, arrays["text"]
    if rows != len(text):
        raise refused(f"{rows:,} rows of logits for {len(text):,} text ids")
    if len(text) and not 0 <= text.min() <= text.max() < vocab:
        raise refused(f"text ids {text.min()} to {text.max()}, outside the logits' {vocab:,} columns")
    return arrays


def _json_with(*keys: str) -> Callable[[Path], str | None]:
    """What a file holds instead of a JSON object with ``keys`` (None when it is one)."""
    def other(path: Path) -> str | None:
        size = path.stat().st_size
        if size > JSON_OUTPUT_LIMIT_BYTES:
            return f"{size:,} bytes, more than this script writes"
        try:
            value = json.loads(path.read_bytes())
        except (ValueError, RecursionError):  # not UTF-8 (a ValueError too), not JSON
            return "a file that is not JSON"
        missing = [key for key in keys if not (isinstance(value, dict) and key in value)]
        return f"JSON without {missing[0]!r}" if missing else None
    return other


def _npz_with(*names: str) -> Callable[[Path], str | None]:
    """What a file holds instead of a .npz archive with arrays ``names`` (None when it is one); only
    its zip directory is read."""
    def other(path: Path) -> str | None:
        try:
            with zipfile.ZipFile(path) as archive:
                members = set(archive.namelist())
        except (zipfile.BadZipFile, EOFError):
            return "a file that is not a .npz archive"
        missing = [name for name in names if f"{name}.npy" not in members]
        return f"a .npz without {missing[0]!r}" if missing else None
    return other


#: an ids file or a report larger than this is not one this script wrote (32,768 ids take ~200 KB)
JSON_OUTPUT_LIMIT_BYTES = 64 << 20
#: what each command writes, and what an existing file holds instead of an earlier one (None: it
#: is one, and may be replaced); an empty file counts as one too, as tools/plain_onnxruntime.py's
OUTPUTS: dict[str, tuple[str, Callable[[Path], str | None]]] = {
    "ids": ("an ids file `parity.py prepare` wrote (JSON with prompts, text and new_tokens)",
            _json_with("prompts", "text", "new_tokens")),
    "dump": ("a dump `parity.py dump` wrote (.npz with logits, greedy and text)",
             _npz_with("logits", "greedy", "text")),
    "report": ("a report `parity.py compare` wrote (JSON with machines and greedy_identical)",
               _json_with("machines", "greedy_identical")),
}


def check_output(path: Path, option: str, kind: str, inputs=(), model: Path | None = None) -> None:
    """Refuse, before any work, an output ``path`` (given as ``option``) that would lose something:
    one of ``inputs`` itself, a file inside the export folder ``model`` or inside any other output of
    gemma-export (its manifest would no longer list every file in it), or an existing file that is
    not an earlier output of ``kind`` (:data:`OUTPUTS`). Whether its folder takes new files is
    checked at parsing (``_args.writable_file``).

    Raises:
        OutputError: ``"{option} {path}: ..."``, naming the input, the folder or what the file holds.
    """
    from gemma_export.errors import OutputError
    from gemma_export.staging import check_outside_outputs
    from gemma_export.text_files import non_regular

    target = path.resolve()
    for given in inputs:
        if given is not None and (target == given.resolve() or _same_file(path, given)):
            raise OutputError(f"{option} {path}: is the input {given}; write it elsewhere")
    if model is not None and model.resolve() in target.parents:
        raise OutputError(f"{option} {path}: is inside the export folder {model}; write it elsewhere")
    try:
        check_outside_outputs(target, "output")
    except OutputError as exc:
        raise OutputError(f"{option} {exc}") from None
    if not (path.exists() or path.is_symlink()):
        return
    what, other = OUTPUTS[kind]
    try:
        found = non_regular(path) or (None if path.stat().st_size == 0 else other(path))
    except OSError as exc:
        found = f"a file that cannot be read ({exc.strerror or exc})"
    if found is not None:
        raise OutputError(f"{option} {path}: exists and is not {what}; found {found}; not replaced")


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file (a hard link too); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


if __name__ == "__main__":
    run(main)
