"""Write a full-size reference export in the board team's format from the bundled real Gemma 3 270M:
``gemma.mlir`` (a JAX-lowered ``@gemma`` re-decode function, ``tensor<1x24xi32> -> tensor<24xi32>``,
weights as ``util.global`` parameters) and ``gemma.safetensors`` (flat 1-D, bf16 by truncation or
int8 per row + ``_scale``, RoPE tables and masks included, the tied table stored twice), exactly as
the tests build their tiny fixtures with ``tools/jax_reference.py``. Use it to run `gemma-export parity
--reference` and `gemma-export bench --reference` at full size without the board team's files.

Usage:
    python tools/make_reference_export.py --out /tmp/gx-ref [--dtype bf16|int8]

Needs the test extra (torch, transformers, jax). Writes about 860 MB (bf16) or 440 MB (int8);
peaks at about 5.7 GB of memory (bf16, 2026-12-05) and prints nothing for the ~25 s it works.
The export carries no tokenizer, as the board team's does not: `gemma-export --source
OUT/gemma.mlir --tokenizer TOKENIZER.json` adds one, and any export of the bundled weights holds
it (`gemma-export --no-calibrate --out gx-tok` writes `gx-tok/tokenizer.json` in 5.7–14 s).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import make_folders, remove_folders, run, writable_dir  # noqa: E402

#: the two files written into --out (``write_jax_reference``'s names), archive first
NAMES = ("gemma.safetensors", "gemma.mlir")


def replace_pair(scratch: Path, out: Path, names: tuple[str, ...] = NAMES) -> None:
    """Move the files ``names`` from ``scratch`` into ``out``, replacing files of those names there:
    all or none (an old file is moved aside into ``scratch`` first, and put back when a later move fails).

    Raises:
        OSError: of the move that failed (IsADirectoryError for a folder of one of those names), with
            ``out`` as it was.
    """
    moved: list[tuple[Path, Path | None]] = []  # (a file moved in, the old file it replaced, kept aside)
    try:
        for name in names:
            target = out / name
            if target.is_dir() and not target.is_symlink():
                raise IsADirectoryError(errno.EISDIR, "is a folder, expected a file to replace", str(target))
            aside = None
            if os.path.lexists(target):
                aside = scratch / f"replaced-{name}"
                os.rename(target, aside)
            try:
                os.rename(scratch / name, target)
            except BaseException:
                if aside is not None:
                    os.rename(aside, target)
                raise
            moved.append((target, aside))
    except BaseException:
        for target, aside in reversed(moved):
            with contextlib.suppress(OSError):
                if aside is None:
                    target.unlink()
                else:
                    os.replace(aside, target)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=writable_dir, required=True,
                        help="folder for gemma.mlir and gemma.safetensors (created; existing files of those names are replaced)")
    parser.add_argument("--dtype", choices=["bf16", "int8"], default="bf16",
                        help="archive values: bf16 by truncation, or int8 per row + _scale (default bf16)")
    args = parser.parse_args()

    from jax_reference import write_jax_reference

    from gemma_export.errors import GemmaExportError, check_utf8_path
    from gemma_export.quality import transformers_model
    from gemma_export.sources import open_source
    from gemma_export.staging import interrupts_held

    check_utf8_path(args.out, "reference export folder")
    for name in NAMES:  # before the slow work (--out itself takes new files: writable_dir)
        if (args.out / name).is_dir() and not (args.out / name).is_symlink():
            raise GemmaExportError(f"--out {args.out}: {args.out / name} is a folder; expected a file to replace "
                                   "or no entry of that name")
    start = time.perf_counter()
    model = transformers_model(open_source(None))  # the bundled GGUF, through this toolkit's reader
    made = make_folders(args.out)
    try:
        # both files are written in a scratch folder and moved in together at the end (replace_pair),
        # so an interrupt or a failure never leaves one new file beside an old (or no) other
        with tempfile.TemporaryDirectory(prefix=".reference-export-", dir=args.out) as scratch:
            written = write_jax_reference(model, Path(scratch), args.dtype)
            names = [written.with_suffix(".safetensors").name, written.name]
            with interrupts_held():
                replace_pair(Path(scratch), args.out, tuple(names))
    except BaseException:
        remove_folders(made)  # only those this run made, and only if empty
        raise
    mlir = args.out / names[1]
    size = sum((args.out / name).stat().st_size for name in names)
    print(f"wrote {mlir} and {names[0]} ({size / 1e6:,.1f} MB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    run(main)
