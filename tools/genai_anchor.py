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
second precision reuses it; delete it when done). Step 2 (the venv): run the builder on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _args import existing_file, genai_output, run  # noqa: E402

#: what the probe of --python prints when onnxruntime-genai's builder imports
PROBE_OK = "onnxruntime_genai builder ok"


#: written last into the transformers folder: its absence marks a folder an interrupted run left
COMPLETE_MARKER = ".complete"


def write_hf_folder(folder: Path) -> Path:
    """The bundled checkpoint as a transformers 4.x ``Gemma3ForCausalLM`` folder (float32), ending
    with :data:`COMPLETE_MARKER` (a folder without it is written again)."""
    from safetensors.numpy import save_file

    from gemma_export.sources import open_source

    ckpt = open_source(None)
    c = ckpt.config
    folder.mkdir(parents=True, exist_ok=True)
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
    save_file({name: ref.load() for name, ref in ckpt.tensors.items()}, str(folder / "model.safetensors"))
    for name, content in (ckpt.tokenizer.files if ckpt.tokenizer else {}).items():
        (folder / name).write_bytes(content)
    (folder / COMPLETE_MARKER).write_text("")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", required=True, type=existing_file,
                        help="the venv's python with onnxruntime-genai 0.15.2 (see above)")
    parser.add_argument("--out", type=genai_output, required=True,
                        help="folder for genai's model: new, empty, or an earlier output of this script")
    parser.add_argument("--precision", default="int4", choices=["int4", "fp32"],
                        help="int4 (block 32, round to nearest) or fp32 (default int4)")
    args = parser.parse_args()
    from gemma_export.errors import GemmaExportError

    if not os.access(args.python, os.X_OK):
        raise GemmaExportError(f"--python {args.python}: not executable")
    probe = subprocess.run([str(args.python), "-c", f"import onnxruntime_genai.models.builder; print({PROBE_OK!r})"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != PROBE_OK:  # before the 1 GB folder is written
        last = (probe.stderr.strip().splitlines() or [f"it printed {probe.stdout.strip()[:60]!r}, exit status "
                                                       f"{probe.returncode}"])[-1]
        raise GemmaExportError(f"--python {args.python}: not a Python that imports onnxruntime_genai's builder: {last}")
    hf_folder = args.out.parent / (args.out.name + "-hf")
    hf = hf_folder if (hf_folder / COMPLETE_MARKER).is_file() else write_hf_folder(hf_folder)
    cmd = [str(args.python), "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(args.out),
           "-p", args.precision, "-e", "cpu", "-c", str(args.out.parent / (args.out.name + "-cache"))]
    print(" ".join(cmd), flush=True)
    status = subprocess.run(cmd).returncode
    if status != 0:
        raise GemmaExportError(f"onnxruntime-genai's builder failed (exit status {status}; its output is above); "
                               f"{hf} is kept for the next try")
    if not (args.out / "genai_config.json").is_file():
        raise GemmaExportError(f"onnxruntime-genai's builder exited 0 but wrote no {args.out / 'genai_config.json'}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run(main)
