"""Build the onnxruntime-genai anchor of the bundled Gemma 3 270M (its model builder, int4 block 32
round-to-nearest by default) so that `gemma-export quality --reference ... ` and the benchmarks can
compare against it on the same machine and text.

onnxruntime-genai's builder 0.18 fails on transformers 5 configs and 0.16–0.18 do not import with
transformers 4.x (as the board team found), so it runs from its own virtual environment:

    python -m venv /tmp/genai-venv
    /tmp/genai-venv/bin/pip install torch==2.13.0 "transformers>=4.50,<5" onnxruntime-genai==0.15.2 onnx onnx_ir
    python tools/genai_anchor.py --python /tmp/genai-venv/bin/python --out /tmp/genai-int4 [--precision int4]

Step 1 (this interpreter): write the bundled weights as a transformers 4.x folder (config.json,
model.safetensors in float32, the tokenizer) beside the output, as OUT-hf/ (1.07 GB; kept, so a
second precision reuses it once its model.safetensors is checked whole; delete it when done). Step 2
(the venv): run the builder on it into a staging folder beside the output (.OUT.staging-*), with
OUT-cache/ beside the output too; only a complete build replaces OUT, so a failed or interrupted one
(Ctrl-C, SIGTERM) leaves an earlier OUT as it was. --out, OUT-hf and OUT-cache are checked first (an
OUT-hf of other files, and any of the three inside an export of gemma-export, are refused), and
--python is refused when it has transformers 5; when the builder fails, the staging folder and the
folders this run created go (OUT-hf stays once complete).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import existing_file, genai_output, run, writable_dir  # noqa: E402

#: what the probe of --python prints when onnxruntime-genai's builder imports, followed by the
#: versions of onnxruntime-genai and transformers there (:data:`PROBE`)
PROBE_OK = "onnxruntime_genai builder ok"

#: the probe of --python: the builder imports; then PROBE_OK and the two versions on one line
PROBE = ("import onnxruntime_genai, onnxruntime_genai.models.builder, transformers; "
         f"print({PROBE_OK!r}, getattr(onnxruntime_genai, '__version__', '?'), transformers.__version__)")

#: the first transformers major version the builder fails on (its configs; see above)
TRANSFORMERS_REFUSED = 5


#: written last into the transformers folder: its absence marks a folder an interrupted run left
COMPLETE_MARKER = ".complete"

#: written first into the transformers folder: it marks the folder as this script's, so that one an
#: interrupted run left is written again; a folder of other files (neither marker) is refused
WRITER_MARKER = ".genai_anchor"


def write_hf_folder(folder: Path) -> Path:
    """The bundled checkpoint as a transformers 4.x ``Gemma3ForCausalLM`` folder (float32), starting
    with :data:`WRITER_MARKER` and ending with :data:`COMPLETE_MARKER` (a folder without it is
    written again); every file has the mode the umask gives."""
    from safetensors.numpy import save_file

    from gemma_export.sources import current_umask, open_source

    ckpt = open_source(None)
    c = ckpt.config
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WRITER_MARKER).write_text("")
    (folder / COMPLETE_MARKER).unlink(missing_ok=True)
    config = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "query_pre_attn_scalar": c.query_pre_attn_scalar, "sliding_window": c.sliding_window,
        "rope_theta": c.rope_parameters["full_attention"].rope_theta,
        "rope_local_base_freq": c.rope_parameters["sliding_attention"].rope_theta, "rope_scaling": None,
        "layer_types": list(c.layer_types), "sliding_window_pattern": 6,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_id), "pad_token_id": c.pad_token_id, "torch_dtype": "float32",
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    model = folder / "model.safetensors"
    save_file({name: ref.load() for name, ref in ckpt.tensors.items()}, str(model))
    model.chmod(0o666 & ~current_umask())  # save_file creates it 0600; an ordinary file, as the others here
    for name, content in (ckpt.tokenizer.files if ckpt.tokenizer else {}).items():
        (folder / name).write_bytes(content)
    (folder / COMPLETE_MARKER).write_text("")
    return folder


def siblings(out: Path) -> tuple[Path, Path]:
    """The transformers folder and the builder's cache written beside ``out`` (resolved):
    ``OUT-hf`` and ``OUT-cache``."""
    return out.parent / (out.name + "-hf"), out.parent / (out.name + "-cache")


def foreign_files(folder: Path) -> list[str]:
    """The names in ``folder`` (sorted) when it holds any and no marker of this script
    (:data:`WRITER_MARKER`, or :data:`COMPLETE_MARKER`, which earlier versions wrote alone): the
    user's own files, which writing the transformers folder there would replace. Else []."""
    if not folder.is_dir() or any((folder / marker).is_file() for marker in (WRITER_MARKER, COMPLETE_MARKER)):
        return []
    return sorted(path.name for path in folder.iterdir())


def output_folder(value: str) -> Path:
    """``--out``: a folder for the builder (:func:`genai_output`) that takes new files or can be
    created (:func:`writable_dir`), made absolute (links kept) so that ``OUT-hf`` and ``OUT-cache``
    are names beside it (``.`` has none), and both of them folders that take new files or can be created;
    none of the three inside an output of gemma-export (its manifest lists every file in it), and
    ``OUT-hf`` new, empty or this script's (:func:`foreign_files`): checked before the probe of
    --python and the 1 GB folder.

    Raises:
        argparse.ArgumentTypeError: naming the path, what was expected and what was found.
    """
    from gemma_export.errors import OutputError
    from gemma_export.staging import check_outside_outputs

    path = genai_output(value)
    # a name of its own ("." has none), and the folder it is in as the kernel finds it ("link/.." is the
    # link target's parent); a link named as --out is kept, as the OUT-hf beside it
    out = (Path(os.path.realpath(path)) if path.name in ("", ".", "..")
           else Path(os.path.realpath(path.parent)) / path.name)
    if out == out.parent:
        raise argparse.ArgumentTypeError(f"{path}: expected a folder inside another one (OUT-hf and OUT-cache are "
                                         "written beside it), found the root")
    # before the write probes below, which would change an export's folder before it is refused
    for folder in (out, *siblings(out)):
        try:
            check_outside_outputs(folder, "folders of --out")
        except OutputError as exc:
            raise argparse.ArgumentTypeError(f"{path}: {exc}") from None
    writable_dir(value, outside_outputs=False)  # checked above, for --out and the two folders beside it
    for sibling, what in zip(siblings(out), ("the transformers folder", "the builder's cache")):
        try:
            writable_dir(str(sibling), outside_outputs=False)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{path}: {what} is written beside it, and {exc}") from None
    hf_folder = siblings(out)[0]
    if found := foreign_files(hf_folder):
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise argparse.ArgumentTypeError(f"{path}: the transformers folder written beside it would replace the files "
                                         f"in {hf_folder} ({shown}), which this script did not write (neither "
                                         f"{WRITER_MARKER} nor {COMPLETE_MARKER} there): move that folder away or "
                                         "give another --out")
    return out


def hf_damage(folder: Path) -> str | None:
    """Why a transformers folder marked complete cannot be reused, or None: its ``model.safetensors``
    is missing, or its header does not parse or does not cover the file's size (a file cut short),
    as ``safetensors.safe_open`` reads it (no tensor is loaded)."""
    from safetensors import SafetensorError, safe_open

    model = folder / "model.safetensors"
    if not model.exists():
        return f"{model}: missing"
    try:
        with safe_open(str(model), "numpy"):
            return None
    except (SafetensorError, OSError) as exc:
        return f"{model}: {exc}"


def transformers_folder(folder: Path) -> Path:
    """``folder`` when marked complete and whole (:func:`hf_damage`), else ``folder`` written again
    by :func:`write_hf_folder` (saying why when it was there)."""
    complete = (folder / COMPLETE_MARKER).is_file()
    damage = hf_damage(folder) if complete else None
    if damage is not None:
        print(f"{folder} is damaged ({damage}); writing it again", file=sys.stderr, flush=True)
    elif not complete and (folder / WRITER_MARKER).is_file():
        print(f"{folder} was left incomplete by an earlier run; writing it again", file=sys.stderr, flush=True)
    return folder if complete and damage is None else write_hf_folder(folder)


def check_versions(python: Path, printed: str) -> None:
    """Refuse a --python whose probe printed (after :data:`PROBE_OK`) a transformers version the
    builder fails on (>= :data:`TRANSFORMERS_REFUSED`), and say the versions found otherwise.

    Raises:
        GemmaExportError: naming --python and the versions found.
    """
    from gemma_export.errors import GemmaExportError

    versions = printed.split()
    if len(versions) != 2:  # a stand-in that prints PROBE_OK alone: nothing to check
        return
    genai, transformers = versions
    major = transformers.split(".")[0]
    if major.isdigit() and int(major) >= TRANSFORMERS_REFUSED:
        raise GemmaExportError(f"--python {python}: has onnxruntime-genai {genai} with transformers {transformers}; "
                               f"its builder fails on transformers {TRANSFORMERS_REFUSED} configs: expected "
                               f"transformers>=4.50,<{TRANSFORMERS_REFUSED} there (see --help)")
    print(f"--python {python}: onnxruntime-genai {genai}, transformers {transformers}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, type=existing_file,
                        help="the venv's python with onnxruntime-genai 0.15.2 (see above)")
    parser.add_argument("--out", type=output_folder, required=True,
                        help="folder for genai's model: new, empty, or an earlier output of this script "
                             "(replaced only by a complete build)")
    parser.add_argument("--precision", default="int4", choices=["int4", "fp32"],
                        help="int4 (block 32, round to nearest) or fp32 (default int4)")
    args = parser.parse_args()
    from gemma_export.console import interrupts_raised
    from gemma_export.errors import GemmaExportError
    from gemma_export.staging import staged_folder

    if not os.access(args.python, os.X_OK):
        raise GemmaExportError(f"--python {args.python}: not executable")
    # a name with a folder, kept whole: "./python" reached subprocess as "python", looked up on PATH (an
    # absolute path, links not resolved: a venv's python is a link that must keep its venv)
    python = os.path.abspath(args.python)
    probe = subprocess.run([python, "-c", PROBE], capture_output=True, text=True)
    printed = probe.stdout.strip()
    if probe.returncode != 0 or not (printed == PROBE_OK or printed.startswith(PROBE_OK + " ")):  # before the 1 GB
        last = (probe.stderr.strip().splitlines() or [f"it printed {printed[:60]!r}, exit status "
                                                       f"{probe.returncode}"])[-1]
        raise GemmaExportError(f"--python {args.python}: not a Python that imports onnxruntime_genai's builder: {last}")
    check_versions(args.python, printed[len(PROBE_OK):])
    hf_folder, cache = siblings(args.out)
    created = [folder for folder in (hf_folder, cache) if not folder.exists()]
    # the builder writes a staging folder that replaces OUT (the folder a link names) once it is
    # complete; SIGTERM cleans up as Ctrl-C does
    with interrupts_raised():
        try:
            with staged_folder(Path(os.path.realpath(args.out)), "onnxruntime-genai model",
                               notify=functools.partial(print, file=sys.stderr, flush=True)) as staging:
                hf = transformers_folder(hf_folder)
                cmd = [python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(staging),
                       "-p", args.precision, "-e", "cpu", "-c", str(cache)]
                print(" ".join(cmd), flush=True)
                status = subprocess.run(cmd).returncode
                if status != 0:
                    raise GemmaExportError(f"onnxruntime-genai's builder failed (exit status {status}; its output is "
                                           f"above); {hf} is kept for the next try")
                if not (staging / "genai_config.json").is_file():
                    raise GemmaExportError(f"onnxruntime-genai's builder exited 0 but wrote no "
                                           f"{args.out / 'genai_config.json'}")
        except BaseException:
            # what this run created goes; the transformers folder stays only when complete (it is reused)
            for folder in created:
                if folder != hf_folder or not (hf_folder / COMPLETE_MARKER).is_file():
                    shutil.rmtree(folder, ignore_errors=True)
            raise
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run(main)
