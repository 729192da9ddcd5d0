"""Export a checkpoint to an ONNX folder: build, write to a staging folder beside the destination,
verify, write the manifest last, then move the folder into place.

A failure at any step leaves no partial output and an existing destination unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import time
from pathlib import Path
from typing import Callable

from quant.scales import SCALE_DTYPES, SCALE_METHODS

from . import __version__
from .builder import build_model
from .calibration import DEFAULT_CALIBRATION_TOKENS, MAX_CALIBRATION_TOKENS, MIN_CALIBRATION_TOKENS, Calibration, collect
from .calibration import calibration_text as read_calibration_text
from .checkpoint import EMBED, LM_HEAD, Checkpoint, largest_weight
from .config import DTYPES, QUANTIZED_DTYPES, TABLE_BITS, TABLE_DTYPES, export_variant
from .errors import (ConfigError, FormatError, GemmaExportError, OutputError, ResourceError, SourceNotFoundError,
                     VerificationError, check_arguments, printable_path, reworded)
from .onnx_files import ALIGNMENT_BYTES, DATA_FILE, MANIFEST_FILE, MODEL_FILE
from .prepack import LEFTOVER_PREFIXES, PREPACKED_DIR
from .prepack import busy as prepack_busy, derived_copy
from .manifest import export_description, read_manifest
from .memory import peak_rss_bytes
from .sources import BUNDLED_PACKAGE, bundled_gguf_note, default_output_name, open_source
from .text_files import first_tokens, non_regular
from .staging import check_free_space, check_replaceable, file_sha256, folder_state, reported_as_written, staged_folder
from .verify import NonFiniteLogits, count_table_initializers, verify_folder
from .weights import (DEFAULT_HADAMARD_SIZE, DEFAULT_INT8_BLOCK_SIZE, DEFAULT_TABLE_BLOCK_SIZE, WEIGHT_FORMATS, Int4Format,
                      weight_format)

GENAI_CONFIG_FILE = "genai_config.json"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What :func:`export` wrote.

    Attributes:
        out_dir: the final folder.
        files: file name → size in bytes.
        dtype: the weights' precision, ``fp32``, ``bf16``, ``int8`` or ``int4``.
        tied: whether the export has one table for the lookup and the LM head: the source stores no
            ``lm_head.weight`` of its own, or one equal to the embedding (``Checkpoint.tied``; a
            source that says ``tie_word_embeddings`` but stores a different head gets two tables).
        table_initializers: initializers holding a ``[vocab, hidden]``-sized table (1 when tied).
        elapsed_s: wall time of the export, seconds.
        peak_rss_bytes: the process's peak resident memory (VmHWM) at the end.
        tokenizer_from: the ``tokenizer.json`` given with ``tokenizer`` (its files are in the
            export), or None when the tokenizer is the source's own (or there is none).
        quantization: the manifest's ``quantization`` record (block sizes, rotation, scale dtype,
            activation residual, calibration, …; int8 and int4), or None. :attr:`calibration`,
            :attr:`activation_residual` and :attr:`scale_dtype` are read from it.
    """

    out_dir: Path
    files: dict[str, int]
    dtype: str
    tied: bool
    table_initializers: int
    elapsed_s: float
    peak_rss_bytes: int
    tokenizer_from: Path | None = None
    quantization: dict | None = None

    @property
    def calibration(self) -> dict | None:
        """The manifest's record of the GPTQ calibration (method, text, tokens), or None (rounded to
        nearest, or fp32 / bf16)."""
        return (self.quantization or {}).get("calibration")

    @property
    def activation_residual(self) -> bool:
        """Whether every ``MatMulNBits`` also multiplies the residual of its input's int8 rounding
        (``activation_residual`` of :func:`export`)."""
        return (self.quantization or {}).get("activation_residual", False)

    @property
    def scale_dtype(self) -> str | None:
        """``float32`` or ``float16``, how the block scales are stored (int8 and int4), or None (fp32, bf16)."""
        return (self.quantization or {}).get("scale_dtype")

    @property
    def total_bytes(self) -> int:
        """Bytes of every file in :attr:`files`, the manifest included."""
        return sum(self.files.values())


def _refuse_options(options: list[str], dtypes: str, dtype: str) -> None:
    """ConfigError naming the given ``options`` (``a``, ``a and b``, ``a, b and c``) when any was
    given for a dtype they do not apply to."""
    if options:
        listed = options[0] if len(options) == 1 else f"{', '.join(options[:-1])} and {options[-1]}"
        raise ConfigError(f"{listed} {'applies' if len(options) == 1 else 'apply'} to --dtype {dtypes}, not {dtype}")


def _is_block_size(value: int) -> bool:
    # MatMulNBits: a power of two >= 16
    return value >= 16 and not value & (value - 1)


def block_size_for(checkpoint: Checkpoint, requested: int | None, dims: tuple[int, ...] | None = None,
                    default: int = DEFAULT_INT8_BLOCK_SIZE, option: str = "--block-size") -> int:
    """A block size (int8 or int4 weights, the table, or the Hadamard rotation): ``requested``, or the
    largest power of two ≤ ``default`` dividing every in_features in ``dims`` (default:
    hidden_size, heads × head_dim, intermediate_size). MatMulNBits needs a power of two ≥ 16.

    Args:
        checkpoint: the model whose config gives the default ``dims``.
        requested: the user's size (weights per scale, or features per Hadamard block), or None.
        dims: the in_features the size must divide.
        default: the largest size tried when ``requested`` is None.
        option: the command-line option, named in messages.

    Returns:
        The block size, a power of two between 16 and ``max(default, requested)``.

    Raises:
        ConfigError: the requested size is invalid (naming ``option``), or no valid size divides the
            dimensions (naming the config's fields that do not).
    """
    c = checkpoint.config
    fields = {"hidden_size": c.hidden_size, "num_attention_heads × head_dim": c.num_attention_heads * c.head_dim,
              "intermediate_size": c.intermediate_size}
    if dims is None:
        dims = tuple(fields.values())
    else:
        fields = {name: d for name, d in fields.items() if d in dims}
    if requested is not None:
        if not _is_block_size(requested) or any(d % requested for d in dims):
            raise ConfigError(
                f"{option} {requested}: must be a power of two >= 16 dividing each of {', '.join(map(str, dict.fromkeys(dims)))}")
        return requested
    block = default
    while block >= 16 and any(d % block for d in dims):
        block //= 2
    if block < 16:  # no option was given: the model's own sizes are what does not fit
        odd = [f"{name} {d}" for name, d in fields.items() if d % 16]
        raise ConfigError(f"{checkpoint.path}: the model's {' and '.join(odd) or ', '.join(map(str, dims))} "
                          f"{'is not a multiple' if len(odd) == 1 else 'are not multiples'} of 16, which int8 and int4 "
                          "weights need (MatMulNBits blocks of at least 16 inputs); --dtype fp32 or bf16 exports it")
    return block


def genai_config(checkpoint: Checkpoint) -> dict:
    """``genai_config.json`` so that onnxruntime-genai can run the folder (model type ``gemma3_text``).

    Returns:
        The JSON object as a dict: the config's token ids, sizes and context length (positions),
        the decoder's I/O names, and greedy search settings (``max_length`` at most 4,096 tokens).
    """
    c = checkpoint.config
    return {
        "model": {
            "bos_token_id": c.bos_token_id,
            "context_length": c.max_position_embeddings,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": MODEL_FILE,
                "head_size": c.head_dim,
                "hidden_size": c.hidden_size,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": c.num_attention_heads,
                "num_hidden_layers": c.num_hidden_layers,
                "num_key_value_heads": c.num_key_value_heads,
            },
            "eos_token_id": list(c.eos_token_id),
            "pad_token_id": c.pad_token_id,
            "type": "gemma3_text",
            "vocab_size": c.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
            "max_length": min(c.max_position_embeddings, 4096), "min_length": 0, "no_repeat_ngram_size": 0,
            "num_beams": 1, "num_return_sequences": 1, "past_present_share_buffer": False,
            "repetition_penalty": 1.0, "temperature": 1.0, "top_k": 1, "top_p": 1.0,
        },
    }


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it: by name, and by file identity for the parts
    that exist (a bind mount shows the same folder under another name)."""
    if path == folder or folder in path.parents:
        return True
    for part in (path, *path.parents):
        with contextlib.suppress(OSError):
            if os.path.samefile(part, folder):
                return True
    return False


def _check_destination(out_dir: Path, checkpoint: Checkpoint, replaceable_checked: bool = False) -> None:
    out = out_dir.resolve()
    src = checkpoint.path.resolve()
    src_dir = src if src.is_dir() else src.parent
    if src.is_dir() and _within(out, src_dir):
        raise OutputError(f"{out_dir}: output folder is inside the source {src_dir}; choose another --out")
    if out == src:
        raise OutputError(f"{out_dir}: is the source itself, which the export would replace; choose another --out")
    if out in src.parents:
        raise OutputError(f"{out_dir}: the source {checkpoint.path} lies inside this folder, which the export would "
                          "replace; choose another --out")
    if not replaceable_checked:
        _check_replaceable(out_dir)


def _related(a: Path, b: Path) -> bool:
    """Whether one path is, contains or lies inside the other (after resolving links; False when a
    link loops, which the source's own check then names)."""
    try:
        a, b = a.resolve(), b.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symbolic link loop (Python 3.11 and 3.12)
        return False
    return a == b or a in b.parents or b in a.parents


def _check_replaceable(out_dir: Path) -> None:
    """The destination's own checks, which need no source: with --out given they run before the
    (slow) source is read."""
    def not_busy(out: Path) -> None:
        if prepack_busy(out):
            raise OutputError(f"{out_dir}: a gemma-export prepack is working on this folder; export again when it has "
                              "finished")

    check_replaceable(out_dir, "export", MANIFEST_FILE, before=not_busy, required={"format": "onnx"}, derived=derived_copy,
                      leftovers=LEFTOVER_PREFIXES)


#: tensors of more than this many bytes go to the data file (onnx_ir's ``size_threshold_bytes``
#: compares ``nbytes > threshold``); smaller constants stay in model.onnx
SIZE_THRESHOLD_BYTES = 256


def _check_options(dtype: str, block_size: int | None, table_block_size: int | None, hadamard_size: int | None,
                   table_dtype: str | None, symmetric: bool, scale_method: str | None, calibrate: bool | None,
                   calibration_text, calibration_tokens: int | None, activation_residual: bool = False,
                   scale_dtype: str | None = None) -> None:
    """:func:`export`'s options against each other and their ranges, before any file is read. A
    choice outside its set is named as the Python argument (the command line's own choices refuse it
    first); the rest are named as the command line's flags, which both reach.

    Raises:
        ConfigError: naming the option, what it applies to or expects, and what was given.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"export(): dtype must be one of {', '.join(DTYPES)}, found {dtype!r}")
    if table_dtype is not None and table_dtype not in TABLE_DTYPES:
        raise ConfigError(f"export(): table_dtype must be {' or '.join(TABLE_DTYPES)}, found {table_dtype!r}")
    int4_only = [option for option, given in (("--table-dtype", table_dtype is not None), ("--asymmetric", not symmetric),
                                               ("--scale-method", scale_method is not None)) if given]
    if dtype != "int4":
        _refuse_options(int4_only, "int4", dtype)
    quantized_only = [option for option, value in (("--block-size", block_size), ("--table-block-size", table_block_size),
                                                   ("--hadamard", hadamard_size), ("--scale-dtype", scale_dtype))
                      if value is not None]
    if dtype not in QUANTIZED_DTYPES:
        _refuse_options(quantized_only, " and ".join(QUANTIZED_DTYPES), dtype)
    if activation_residual and dtype != "int8":
        why = (": on Arm with dotprod onnxruntime's 4-bit kernel rounds whole rows of activations, which the "
               "residual cannot match, and int4's error is its weights' (docs/quality.md)") if dtype == "int4" else ""
        raise ConfigError(f"--activation-residual applies to --dtype int8, not {dtype}{why}")
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        raise ConfigError(f"export(): scale_dtype must be {' or '.join(SCALE_DTYPES)}, found {scale_dtype!r}")
    if scale_method is not None and scale_method not in SCALE_METHODS:
        raise ConfigError(f"export(): scale_method must be {' or '.join(SCALE_METHODS)}, found {scale_method!r}")
    for option, value in (("--block-size", block_size), ("--table-block-size", table_block_size),
                          ("--hadamard", hadamard_size or None)):
        if value is not None and not _is_block_size(value):  # before the (slow) source is read
            raise ConfigError(f"{option} {value}: must be a power of two >= 16{' (or 0: no rotation)' if option == '--hadamard' else ''}")
    quantized = dtype in QUANTIZED_DTYPES
    if calibrate is False and not quantized:  # as --calibrate is: an option that would do nothing
        raise ConfigError(f"--no-calibrate applies to --dtype int8 and int4, not {dtype} (nothing is calibrated)")
    for option in _calibration_options(calibrate, calibration_text, calibration_tokens):
        if not quantized:
            raise ConfigError(f"{option} applies to --dtype int8 and int4, not {dtype}")
        if calibrate is False:  # only the two value options can meet --no-calibrate
            raise ConfigError(f"{option} is used only when calibrating; drop --no-calibrate")
    if calibration_tokens is not None and not MIN_CALIBRATION_TOKENS <= calibration_tokens <= MAX_CALIBRATION_TOKENS:
        raise ConfigError(f"--calibration-tokens {calibration_tokens}: expected {MIN_CALIBRATION_TOKENS} to "
                          f"{MAX_CALIBRATION_TOKENS:,}")


def _calibration_options(calibrate: bool | None, calibration_text, calibration_tokens: int | None) -> list[str]:
    """The calibration options the user gave, by name (``--no-calibrate`` is not one of them)."""
    return [option for option, given in (("--calibrate", bool(calibrate)),
                                         ("--calibration-text", calibration_text is not None),
                                         ("--calibration-tokens", calibration_tokens is not None)) if given]


def _estimated_bytes(ckpt: Checkpoint, dtype: str, layer_block: int = 0, table_block: int = 0,
                     table_bits: int = 8, scale_bytes: int = 4) -> int:
    """About how many bytes an export of ``ckpt`` writes: every weight at ``dtype`` (quantized ones
    with one scale of ``scale_bytes`` per block), the tokenizer files, and the graph (about 10–13 kB
    per layer: 184 kB for the real 270M's 18, 51 kB for a 4-layer test model) with the manifest and
    genai_config.json (under 8 kB together). Within 1% on the real 270M (every dtype); the graph's
    share matters for small models (a 4-layer test export: 262 kB, 192 kB of it outside the graph)."""
    table_numel = sum(math.prod(ref.shape) for name, ref in ckpt.tensors.items() if name in (EMBED, LM_HEAD))
    other_numel = sum(math.prod(ref.shape) for name, ref in ckpt.tensors.items() if name not in (EMBED, LM_HEAD))
    fmt = WEIGHT_FORMATS[dtype]
    if not fmt.quantized:
        weights = (table_numel + other_numel) * fmt.bits / 8
    else:
        weights = (table_numel * (table_bits / 8 + scale_bytes / table_block)
                   + other_numel * (fmt.bits / 8 + scale_bytes / layer_block))
    tokenizer = sum(len(content) for content in ckpt.tokenizer.files.values()) if ckpt.tokenizer is not None else 0
    graph_and_records = 12_000 * (ckpt.config.num_hidden_layers + 1) + 8_000
    return int(weights) + tokenizer + graph_and_records


def _quantization_record(fmt, calibration: Calibration | None) -> dict:
    """The manifest's ``quantization`` object of an int8/int4 export: block sizes, rotation, the
    activation residual, the scales' storage dtype, (int4) table dtype, zero points and scale method,
    and the calibration (None: rounded to nearest)."""
    record = {"block_size": fmt.block_size, "table_block_size": fmt.table_block_size, "hadamard_size": fmt.hadamard_size,
              "activation_residual": fmt.activation_residual, "scale_dtype": fmt.scale_dtype}
    if fmt.name == "int4":
        record.update(table_dtype=f"int{fmt.table_bits}", symmetric=fmt.symmetric, scale_method=fmt.method)
    record["calibration"] = ({"method": "gptq", "text": calibration.source, "tokens": calibration.tokens}
                             if calibration is not None else None)
    return record


def export(
    source: str | Path | None = None,
    out_dir: str | Path | None = None,
    dtype: str = "int8",
    *,
    block_size: int | None = None,
    table_block_size: int | None = None,
    hadamard_size: int | None = None,
    table_dtype: str | None = None,
    symmetric: bool = True,
    scale_method: str | None = None,
    calibrate: bool | None = None,
    calibration_text: str | Path | None = None,
    calibration_tokens: int | None = None,
    all_logits: bool = False,
    debug_outputs: bool = False,
    activation_residual: bool = False,
    scale_dtype: str | None = None,
    progress: Callable[[int, int, str], None] | None = None,
    checkpoint: Checkpoint | None = None,
    status: Callable[[str], None] | None = None,
    tokenizer: str | Path | None = None,
) -> ExportResult:
    """Export a Gemma 3 checkpoint to an ONNX folder.

    Args:
        source: a transformers folder, a ``.gguf`` file, a reference export's ``.mlir`` (its archive
            beside it; ``sources/mlir.py``), or None for the bundled real Gemma 3 270M.
        out_dir: destination folder; default ``./{name}-onnx-{dtype}`` (``…-onnx-int4-table-int8`` for
            int4 with ``table_dtype`` int8; ``-activation-residual``, ``-all-logits`` and
            ``-debug-outputs`` added for those options).
        dtype: ``fp32``, ``bf16``, ``int8`` or ``int4`` (block-wise weights, see ``weights.py``).
        block_size: int8/int4 block size of the layer projections (default 32, or the largest power
            of two that divides the dims).
        table_block_size: block size of the embedding table / LM head (default: 128 for an int8
            table, 32 for an int4 table; for a model whose hidden_size it does not divide, the
            largest smaller power of two that does, as for ``block_size``: :func:`block_size_for`).
        hadamard_size: int8/int4: size of the block-diagonal Hadamard rotation applied to every
            matmul input and folded into the weights (default 64, or the largest smaller power of
            two that divides every matmul's input width; 0 disables; ``quant/hadamard.py``).
        table_dtype: int4 only: ``int4`` (default) or ``int8`` for the shared table.
        symmetric: int4 only: fixed zero point 8 (default) or a 4-bit zero point per block.
        scale_method: int4 only: ``mse`` (clipping search; None means mse) or ``rtn`` (round to nearest).
        calibrate: int8/int4: choose the codes by GPTQ on activation statistics of a calibration text
            (``calibration.py``, ``quant/gptq.py``). None (default): on when the source carries a
            tokenizer, off otherwise (a reference MLIR export has none); True requires a tokenizer.
        calibration_text: UTF-8 text file (default: Python's documentation, ``pydoc_data``).
        calibration_tokens: tokens of it to run (default ``DEFAULT_CALIBRATION_TOKENS``, 4,096; 16 to
            ``MAX_CALIBRATION_TOKENS``, 16,384).
        all_logits: return logits for every position (default: last position only).
        debug_outputs: add per-layer sub-block outputs (``debug.layers.{i}.attention|mlp``) for
            ``gemma-export parity``'s divergence report.
        activation_residual: int8 only: every ``MatMulNBits`` also multiplies the residual of the
            kernel's int8 rounding of its input (``Int8Format._residual_rows``): activations at
            about float precision, the same logits on x86-64 and aarch64 to ~0.01, for slower decode
            (1.3–1.6 ×) and prefill (~2 ×) on the 270M (docs/quality.md, "Activation residual").
        scale_dtype: int8/int4: ``float32`` (None: the default) or ``float16``, the block scales
            stored at half the bytes (``quant/scales.py``: each scale rounded up to float16's grid
            before its codes are chosen) and cast to float32 in the graph, which onnxruntime folds
            when the session is created (docs/quality.md, "float16 scales").
        progress: called as ``progress(done_tensors, total_tensors, name)`` as each weight is started
            (``name``; ``done_tensors`` written before it) and once all are written,
            and before that as ``progress(done_layers, total_layers, "calibration")`` while calibrating.
        checkpoint: an already opened source (skips opening ``source``).
        status: called with a one-line message (``reading SOURCE ...``) once the options are checked,
            right before the source is read, and with notes (``note: the replaced export's
            pre-packed copy went with it ...``) after the export is in place. An exception it raises
            propagates as it is; from a note, the new export is already in place (a KeyboardInterrupt
            there comes as :class:`~gemma_export.errors.OutputWritten`).
        tokenizer: a ``tokenizer.json``, or a folder holding one (its ``tokenizer_config.json``,
            ``special_tokens_map.json`` and ``chat_template.jinja`` come along), to place in the
            export instead of the source's: for a source without one (a reference ``.mlir``) or with
            another (FunctionGemma's own tokenizer beside the bundled Gemma 3 weights). It also
            calibrates.

    Returns:
        An :class:`ExportResult`. The folder holds ``model.onnx``, ``model.onnx.data``, the tokenizer
        files, ``genai_config.json`` and ``manifest.json`` (sha256 and size of every other file).

    Raises:
        SourceNotFoundError, FormatError, ConfigError, NumericError: bad source, or (FormatError,
            SourceNotFoundError) an unreadable calibration text.
        ConfigError: an argument of the wrong type (``block_size="32"``, ``calibrate="no"``, an empty
            path: :func:`~gemma_export.errors.check_arguments`); options that contradict each other
            or their ranges, before any file is read;
            a block size that divides no dimension of the model (:func:`block_size_for`); a source
            without tokenizer with a calibration option, a tokenizer whose ids exceed the vocabulary,
            or a calibration text of fewer than ``MIN_CALIBRATION_TOKENS`` tokens.
        NumericError: a weight that cannot be stored or quantized (NaN/Inf, bf16 overflow), raised
            while the weights are written; calibration activations that overflow float32.
        OutputError: the destination is inside the source or is a foreign non-empty folder, or its
            file system lacks the free space the export needs (``staging.check_free_space``), or it
            changed during the export, or writing failed (``staging.staged_folder``).
        VerificationError: the written model failed the ONNX checker, the onnxruntime load or its
            first step's finite logits (:func:`verify_folder`); nothing is written.
    """
    check_arguments("export", source=(source, "path?"), out_dir=(out_dir, "path?"), dtype=(dtype, "str"),
                    block_size=(block_size, "int?"), table_block_size=(table_block_size, "int?"),
                    hadamard_size=(hadamard_size, "int?"), table_dtype=(table_dtype, "str?"), symmetric=(symmetric, "bool"),
                    scale_method=(scale_method, "str?"), calibrate=(calibrate, "bool?"),
                    calibration_text=(calibration_text, "path?"), calibration_tokens=(calibration_tokens, "int?"),
                    all_logits=(all_logits, "bool"), debug_outputs=(debug_outputs, "bool"), tokenizer=(tokenizer, "path?"),
                    activation_residual=(activation_residual, "bool"), scale_dtype=(scale_dtype, "str?"),
                    progress=(progress, "callable?"), status=(status, "callable?"))
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise ConfigError(f"export(): checkpoint must be a Checkpoint (open_source's) or None, found "
                          f"{type(checkpoint).__name__} {checkpoint!r:.40}")
    if checkpoint is not None and source is not None and Path(source).resolve() != checkpoint.path.resolve():
        raise ConfigError(f"export(): source {printable_path(source)} and checkpoint (opened from "
                          f"{printable_path(checkpoint.path)}) are two models; give one of them")
    _check_options(dtype, block_size, table_block_size, hadamard_size, table_dtype, symmetric, scale_method, calibrate,
                   calibration_text, calibration_tokens, activation_residual, scale_dtype)
    scale_method = scale_method or "mse"
    quantized = dtype in QUANTIZED_DTYPES
    # the calibration option the user gave, if any: on a source without a tokenizer it is refused
    # under its own name rather than ignored
    asked = next(iter(_calibration_options(calibrate, calibration_text, calibration_tokens)), None)
    calibration_tokens = calibration_tokens or DEFAULT_CALIBRATION_TOKENS
    # a text the user asked for is read (and refused) before the slow source; the default text only
    # once the source is known to calibrate (a tokenizer-less source never needs it)
    wants_text = quantized and (calibrate or calibration_text is not None)
    text = read_calibration_text(calibration_text, calibration_tokens) if wants_text else None
    given_tokenizer = None
    if tokenizer is not None:  # read and parsed before the (slow) source; checked against it once it is open
        from .sources.hf import read_tokenizer_folder

        tokenizer_dir = _tokenizer_folder(tokenizer)
        given_tokenizer = read_tokenizer_folder(tokenizer_dir, None, "--tokenizer")
    started = time.perf_counter()
    # refuse a foreign --out before the (slow) source is read, unless the source lies in or around it
    # (then _check_destination's message about the source says more)
    early = out_dir is not None and (source is None or not _related(Path(out_dir), Path(source)))
    if early:
        _check_replaceable(Path(out_dir))
    # an earlier export being replaced is said once: before the slow read when --out was checked early
    replacing_told = False
    if status is not None and checkpoint is None and (source is None or Path(source).exists()):  # else open_source says so
        if early:
            replacing_told = _tell_replacing(Path(out_dir), folder_state(Path(out_dir)), status)
        status(f"reading {source or f'bundled Gemma 3 270M ({BUNDLED_PACKAGE}{bundled_gguf_note()})'} ...")
    ckpt = checkpoint or open_source(source, tokenizer=given_tokenizer is None)
    for note in ckpt.config.notes if status is not None else ():
        status(f"note: {note}")
    if ckpt.ignored and status is not None:
        shown_names = ", ".join(ckpt.ignored[:3]) + (", …" if len(ckpt.ignored) > 3 else "")
        status(f"note: {ckpt.path}: {len(ckpt.ignored)} tensor(s) of no part of Gemma 3 were left out ({shown_names})")
    if given_tokenizer is not None:
        beyond = _check_given_tokenizer(given_tokenizer, tokenizer_dir / "tokenizer.json", ckpt.config)
        if beyond and status is not None:
            piece, token_id = beyond[0]
            status(f"note: {len(beyond)} added token(s) of {tokenizer_dir / 'tokenizer.json'} lie beyond the model's "
                   f"{ckpt.config.vocab_size:,} rows ({piece!r} = {token_id:,}); a prompt that uses one is refused")
        ckpt = dataclasses.replace(ckpt, tokenizer=given_tokenizer)
    if status is not None and ckpt.tokenizer is not None:
        _note_small_tokenizer(ckpt, tokenizer_dir if given_tokenizer is not None else Path(ckpt.path), status)
        if given_tokenizer is None and "tokenizer.json" in ckpt.tokenizer.files:  # the source's own: told, not refused
            is_folder = Path(ckpt.path).is_dir()  # else a GGUF, whose tokenizer is built from its metadata
            own = Path(ckpt.path) if is_folder else Path(ckpt.path).parent
            named = own / "tokenizer.json" if is_folder else f"{ckpt.path}'s tokenizer"
            if (wrong := _bos_mismatch(ckpt.tokenizer.parsed(own), ckpt.config, named)) is not None:
                status(f"note: {wrong}; calibration, generate and the board's prompts get these ids")
    # an int4 export with an int8 table gets its own default folder, so that it does not replace the plain int4
    # one; so do the graphs with extra outputs, which `generate` and `bench` do not take as the plain one, and
    # the activation residual's graph, which a user compares with the plain int8 one
    name = export_variant(dtype, table_dtype=table_dtype, activation_residual=activation_residual,
                          all_logits=all_logits, debug_outputs=debug_outputs)
    # the default folder is named after the model exported: a checkpoint given opened, its own source
    named = ckpt.path if checkpoint is not None and source is None else source
    out = Path(out_dir) if out_dir is not None else Path.cwd() / default_output_name(named, name)
    _check_destination(out, ckpt, replaceable_checked=early)
    checked_state = folder_state(out)  # what was checked: a change during the slow work stops the move
    if status is not None and not replacing_told:
        _tell_replacing(out, checked_state, status, ckpt.identity)
    elif status is not None and (other := _other_source(_earlier_manifest(out), ckpt.identity)) is not None:
        # "holds an earlier export" was told before the read, when the source was not yet known
        status(f"note: the export being replaced in {out} was made from another source ({other})")
    if quantized:  # block sizes against the model's dims before the (slow) calibration pass
        rotation = 0 if hadamard_size == 0 else block_size_for(ckpt, hadamard_size, None, DEFAULT_HADAMARD_SIZE, "--hadamard")
        layer_block = block_size_for(ckpt, block_size, default=WEIGHT_FORMATS[dtype].default_block_size)
        table_bits = TABLE_BITS[table_dtype or "int4"] if dtype == Int4Format.name else WEIGHT_FORMATS[dtype].bits
        table_block = block_size_for(ckpt, table_block_size, (ckpt.config.hidden_size,), DEFAULT_TABLE_BLOCK_SIZE[table_bits],
                                      "--table-block-size")
        estimate = _estimated_bytes(ckpt, dtype, layer_block, table_block, table_bits,
                                    2 if scale_dtype == "float16" else 4)
    else:
        estimate = _estimated_bytes(ckpt, dtype)
    # the estimate is within 1% on the real 270M: less its 1%, so a folder that fits is never refused
    # and one that does not is refused before the work, not at the end (0.95 let a 280 MiB disk pass)
    check_free_space(out, int(0.99 * estimate), "export")
    replaced_copy = (out / PREPACKED_DIR).is_dir()  # made from the files this export replaces
    # entered before the calibration, the slow part: its locked staging folder tells a second export
    # into the same folder that this one is writing it, before the second calibrates in full only to
    # be refused at the move
    with staged_folder(out, "export", checked_state, notify=status) as staging:
        calibration = None
        if asked or (quantized and calibrate is None and ckpt.tokenizer is not None):
            calibration = _calibrate(ckpt, text or read_calibration_text(None), calibration_tokens, progress, status,
                                     asked or "--calibrate")
        if quantized:
            fmt = weight_format(dtype, layer_block, table_block, rotation, table_dtype, symmetric, scale_method, calibration,
                                activation_residual, scale_dtype or "float32")
        else:
            fmt = weight_format(dtype)
        quantization = _quantization_record(fmt, calibration) if quantized else None
        model = build_model(ckpt, fmt, all_logits=all_logits, debug_outputs=debug_outputs)

        _save_graph(model, staging / MODEL_FILE, progress)
        del model, fmt, calibration  # frees the quantization memo (the int8 table) before onnxruntime loads the model
        gc.collect()
        if ckpt.tokenizer is not None:
            for name, content in sorted(ckpt.tokenizer.files.items()):
                (staging / name).write_bytes(content)
        (staging / GENAI_CONFIG_FILE).write_text(json.dumps(genai_config(ckpt), indent=2, sort_keys=True) + "\n")
        try:
            verify_folder(staging)
        except NonFiniteLogits as exc:  # the source's weights, not the output, are at fault: the suspect named
            raise VerificationError(f"{ckpt.path}: {exc.finding}: a weight overflows float32; the source's largest "
                                    f"weight is {largest_weight(ckpt.tensors)}; nothing was written") from None
        except VerificationError as exc:  # named as the output it would have been, not the hidden staging folder
            raise VerificationError(f"{str(exc).replace(str(staging), str(out))}; nothing was written") from None
        except ResourceError as exc:  # onnxruntime out of memory in the check's load: named likewise
            raise ResourceError(f"{str(exc).replace(str(staging), str(out))} (the new export's check, onnxruntime "
                                "loading it); nothing was written") from None
        tables = count_table_initializers(staging / MODEL_FILE, ckpt.config.vocab_size, ckpt.config.hidden_size)
        files = _write_manifest(staging, ckpt, dtype, quantization, all_logits, debug_outputs,
                                tokenizer_dir if given_tokenizer is not None else None)
        result = ExportResult(out, files, dtype, ckpt.tied, tables, time.perf_counter() - started, peak_rss_bytes(),
                              tokenizer_dir / "tokenizer.json" if given_tokenizer is not None else None, quantization)
    with reported_as_written(out, "export"):  # in place: an interrupt now must not say "nothing was written"
        if replaced_copy and status is not None:
            status(f"note: the replaced export's pre-packed copy went with it; `gemma-export prepack --model {out}` "
                   "makes one for the new files")
    return result


def _save_graph(model, path: Path, progress: Callable[[int, int, str], None] | None) -> None:
    """Write ``model`` (an ``onnx_ir.Model`` with lazy weights) to ``path``, its tensors over
    ``SIZE_THRESHOLD_BYTES`` in ``DATA_FILE`` beside it, reporting ``progress(done, total, name)``
    as each tensor there is started (``done`` tensors written before it; onnx_ir calls back before it
    computes and writes one, the GPTQ rounding of the table taking several seconds) and once more,
    ``(total, total, last name)``, when all are written. One tensor in flight at a time: the
    exporter's memory stays near one dequantized tensor."""
    import onnx_ir as ir

    total = sum(1 for v in model.graph.initializers.values()
                if v.const_value is not None and v.const_value.nbytes > SIZE_THRESHOLD_BYTES)
    started, last = 0, ""

    def on_tensor(tensor, info) -> None:  # before the tensor is computed and written
        nonlocal started, last
        if progress is not None:
            progress(started, total, tensor.name)
        started, last = started + 1, tensor.name

    ir.save(model, path, external_data=DATA_FILE, callback=on_tensor, max_workers=1, max_in_flight_bytes=1,
            alignment=ALIGNMENT_BYTES, size_threshold_bytes=SIZE_THRESHOLD_BYTES)
    if progress is not None and started:
        progress(started, total, last)  # every tensor written


def _write_manifest(folder: Path, ckpt: Checkpoint, dtype: str, quantization: dict | None, all_logits: bool,
                    debug_outputs: bool, tokenizer_dir: Path | None) -> dict[str, int]:
    """Write ``manifest.json`` into ``folder``: what the export is (dtype, quantization, outputs,
    cache layout, config), where it came from (the source's identity and sha256s, the folder of a
    ``--tokenizer``), the tools' versions, and the size and sha256 of every other file there.

    Returns:
        file name → size in bytes, the manifest included.

    Raises:
        FormatError: a source file changed since the checkpoint was opened (:meth:`Checkpoint.check_unchanged`).
    """
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir())}
    source_digests = ckpt.file_sha256s()
    ckpt.check_unchanged()  # the digests are of the files the export read: none changed since they were opened
    manifest = {
        "format": "onnx",
        "dtype": dtype,
        **({"quantization": quantization} if quantization is not None else {}),
        "all_logits": all_logits,
        "debug_outputs": debug_outputs,
        "tie_word_embeddings": ckpt.tied,
        # GroupQueryAttention reads past + sequence from attention_mask, so one [batch, kv_heads,
        # capacity, head_dim] buffer per cache tensor can be both past and present (runtime.KVCache).
        "kv_cache": {"layout": "BNSH", "past_present_share_buffer": True},
        # sha256: quality and parity re-open the source by path and refuse other contents there
        # (one digest over the files, Checkpoint.content_sha256); file_sha256: each file's own
        "source": {**ckpt.identity, "sha256": ckpt.content_sha256(source_digests), "file_sha256": source_digests,
                   # where the tokenizer came from when it is not the source's own (--tokenizer)
                   **({"tokenizer": str(tokenizer_dir.resolve())} if tokenizer_dir is not None else {})},
        # what the export is: a source that claims tie_word_embeddings but stores a different
        # lm_head (or a GGUF with its own output.weight) is exported with two tables
        "config": {**ckpt.config.to_dict(), "tie_word_embeddings": ckpt.tied},
        "tool": {"gemma-export": __version__, **_tool_versions()},
        "files": {name: {"bytes": size, "sha256": file_sha256(folder / name)} for name, size in files.items()},
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    files[MANIFEST_FILE] = (folder / MANIFEST_FILE).stat().st_size
    return files


#: a tokenizer with fewer tokens than this share of the model's rows gets a note (Gemma's has
#: 262,144 for 262,144 rows; the board team's reference archive has 9 rows more than its tokens)
SMALL_TOKENIZER_SHARE = 0.9


def _note_small_tokenizer(ckpt: Checkpoint, where: Path, status: Callable[[str], None]) -> None:
    """Tell ``status`` when the export's tokenizer has far fewer tokens than the model has rows
    (:data:`SMALL_TOKENIZER_SHARE`): the ids it lacks, when generated, decode to nothing; likely a
    tokenizer of another model (a larger one is refused by the source readers)."""
    parsed = ckpt.tokenizer.parsed(where if where.is_dir() else where.parent)
    size, rows = parsed.get_vocab_size(with_added_tokens=True), ckpt.config.vocab_size
    if size < SMALL_TOKENIZER_SHARE * rows:
        status(f"note: the tokenizer has {size:,} tokens for the model's {rows:,} rows: generated ids beyond them "
               "decode to nothing (a tokenizer of another model?)")


def _tell_replacing(out: Path, state: tuple | None, status: Callable[[str], None], identity: dict | None = None) -> bool:
    """Tell ``status`` that ``out`` holds an earlier export, when its :func:`folder_state` ``state``
    has entries (a non-empty folder that the checks accepted is an export), and what its manifest
    says it holds (``"an earlier int8 export (32 weights per scale …, GPTQ codes)"``: options
    such as ``--block-size`` or ``--no-calibrate`` do not change the default folder), and its source
    when :func:`_other_source` finds it another than ``identity``'s (the source being exported,
    ``Checkpoint.identity``; None before it is read); whether it told."""
    if not state or len(state) <= 1:
        return False
    try:
        manifest = read_manifest(out)
    except FormatError:  # unreadable: the export's own checks name it if it matters; here it is only replaced
        manifest = {}
    other = _other_source(manifest, identity) if identity is not None else None
    status(f"note: {out} holds an earlier {export_description(manifest) or 'export'}"
           f"{f' of another source ({other})' if other else ''}; it is replaced once this one is written and checked "
           "(another --out keeps both)")
    return True


def _earlier_manifest(out: Path) -> dict:
    """The manifest of the export ``out`` holds; ``{}`` when there is none or it cannot be read
    (nothing to compare)."""
    try:
        return read_manifest(out)
    except (GemmaExportError, OSError):
        return {}


def _other_source(manifest: dict, identity: dict) -> str | None:
    """The source path an earlier export's ``manifest`` records, when it is another model than
    ``identity``'s (the source being exported, ``Checkpoint.identity``): another path and another
    size or kind. The default folder is named after the source's file name, which two models may
    share (two ``model.gguf``); the same file under another path (the bundled GGUF in another user's
    cache) is the same source. None when not another, or when the manifest records none."""
    recorded = manifest.get("source")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("path"), str):
        return None
    same_path = os.path.realpath(recorded["path"]) == os.path.realpath(str(identity.get("path", "")))
    same_file = recorded.get("bytes") == identity.get("bytes") and recorded.get("kind") == identity.get("kind")
    return None if same_path or same_file else recorded["path"]


#: Below this many calibration tokens an export notes that GPTQ's statistics are thin: on the real
#: 270M, 1,024 tokens already gave int8 a 13% higher KL than 4,096 (docs/quality.md).
FEW_CALIBRATION_TOKENS = 1024


def _tokenizer_folder(path: str | Path) -> Path:
    """The folder of ``--tokenizer``: the path itself when it is a folder holding ``tokenizer.json``,
    or the folder of a file named ``tokenizer.json``.

    Raises:
        SourceNotFoundError: nothing at ``path``, or a folder without ``tokenizer.json``.
        FormatError: a file of another name, or one that is not a regular file.
    """
    path = Path(path)
    if (what := non_regular(path)) is not None and not path.is_dir():
        raise FormatError(f"{path}: is {what}; expected a tokenizer.json file or a folder holding one (--tokenizer)")
    if not path.exists():
        raise SourceNotFoundError(f"{path}: no such file or folder (--tokenizer)")
    if path.is_dir():
        if (what := non_regular(path / "tokenizer.json")) is not None:
            raise FormatError(f"{path / 'tokenizer.json'}: is {what}; expected the tokenizer file (--tokenizer)")
        if not (path / "tokenizer.json").is_file():
            raise SourceNotFoundError(f"{path}: holds no tokenizer.json (--tokenizer)")
        return path
    if path.name != "tokenizer.json":
        raise FormatError(f"{path}: expected a file named tokenizer.json (its side files are read beside it) or a "
                          f"folder holding one, found '{path.name}' (--tokenizer)")
    return path.parent


def _check_given_tokenizer(tokenizer, path: Path, config) -> list[tuple[str, int]]:
    """``--tokenizer``'s ids fit the model's vocabulary, and the token it puts before a prompt is
    the model's ``bos_token_id``: a tokenizer of another model is refused before the export.

    Returns:
        ``(piece, id)`` of its added tokens beyond the vocabulary, by id: allowed (a tokenizer may
        name more special tokens than a model has rows), but the caller says so.

    Raises:
        FormatError: naming ``path``, the id found and the one expected.
    """
    from .tokenizer import check_tokenizer_vocab

    parsed = tokenizer.parsed(path.parent)
    try:
        check_tokenizer_vocab(parsed, config.vocab_size, path)
    except (FormatError, ConfigError) as exc:
        raise reworded(exc, f"{exc} (--tokenizer)") from None
    if (wrong := _bos_mismatch(parsed, config, path)) is not None:
        raise FormatError(f"{wrong} (--tokenizer)")
    added = parsed.get_added_tokens_decoder()
    return sorted(((token.content, i) for i, token in added.items() if i >= config.vocab_size), key=lambda item: item[1])


def _bos_mismatch(parsed, config, path: Path) -> str | None:
    """None when ``parsed`` (a ``tokenizers.Tokenizer``) puts exactly the model's ``<bos>`` before a
    prompt, as Gemma's own tokenizer does (generate and calibration rely on it); else what it does
    instead, naming ``path``."""
    plain = parsed.encode("a", add_special_tokens=False).ids
    got = parsed.encode("a").ids
    if got == [config.bos_token_id, *plain]:
        return None
    return (f"{path}: turns the prompt 'a' into ids {got}; expected the model's <bos> (bos_token_id "
            f"{config.bos_token_id}) and then {plain}, as Gemma's own tokenizer does")


def _calibrate(ckpt: Checkpoint, text: tuple[str, str], tokens: int, progress,
               status: Callable[[str], None] | None = None, option: str = "--calibrate") -> Calibration:
    """Activation statistics of the first ``tokens`` tokens of ``text`` (``calibration.collect``);
    ``status`` gets a note when the text gives fewer than :data:`FEW_CALIBRATION_TOKENS`.

    ``option`` is the calibration option the user gave (named in the error when the source has no
    tokenizer).

    The tokens run as one sequence from position 0, so at most ``max_position_embeddings`` of them
    are used (a note says so).

    Raises:
        ConfigError: the source has no tokenizer, the text is shorter than MIN_CALIBRATION_TOKENS, or
            the model takes fewer positions than that.
    """
    body, where = text
    files = ckpt.tokenizer.files if ckpt.tokenizer is not None else {}
    if "tokenizer.json" not in files:
        raise ConfigError(f"{ckpt.path}: {option} needs a tokenizer (calibration tokenizes a text) and this source "
                          f"has none; give the model's own with --tokenizer TOKENIZER.json, or export without "
                          f"{option} (round-to-nearest codes)")
    # only a prefix of a long text is tokenized (encoding 10 MB of text took ~0.7 GB and 15 s)
    ids = first_tokens(ckpt.tokenizer.parsed(Path(ckpt.path)), body, tokens)
    if ids and max(ids) >= ckpt.config.vocab_size:
        raise ConfigError(f"{ckpt.path}: its tokenizer.json gives token id {max(ids)} on {where}, outside the "
                          f"model's vocab_size {ckpt.config.vocab_size}; the tokenizer does not belong to these weights")
    limit = ckpt.config.max_position_embeddings  # calibration runs the text as one sequence from position 0
    if limit < MIN_CALIBRATION_TOKENS:  # no text helps
        raise ConfigError(f"{ckpt.path}: max_position_embeddings is {limit}; calibration runs its text as one "
                          f"sequence and needs at least {MIN_CALIBRATION_TOKENS} positions: export with --no-calibrate "
                          "for round-to-nearest codes")
    capped = len(ids) > limit
    if capped:
        if status is not None:
            status(f"note: calibration runs its text as one sequence, and the model takes {limit:,} positions "
                   f"(max_position_embeddings): the first {limit:,} of the {len(ids):,} tokens are used")
        ids = ids[:limit]
    if len(ids) < MIN_CALIBRATION_TOKENS:
        raise ConfigError(f"{where}: {len(ids)} token(s) after tokenizing with {ckpt.path}'s tokenizer; calibration "
                          f"needs at least {MIN_CALIBRATION_TOKENS}: give a longer --calibration-text, the model's own "
                          "tokenizer with --tokenizer, or --no-calibrate for round-to-nearest codes")
    say = (lambda done, total: progress(done, total, "calibration")) if progress else None
    shortfall = (f" (max_position_embeddings; {tokens} asked)" if capped and len(ids) < tokens else
                 f" (the whole text; {tokens} asked)" if len(ids) < tokens else "")
    if status is not None and not capped and len(ids) < min(tokens, FEW_CALIBRATION_TOKENS):
        status(f"note: {where} gives only {len(ids)} calibration tokens; GPTQ's statistics are thin below "
               f"{FEW_CALIBRATION_TOKENS:,} (the default text gives {DEFAULT_CALIBRATION_TOKENS:,}): give a longer "
               "--calibration-text, or --no-calibrate for round-to-nearest codes")
    return collect(ckpt, ids, f"{where}, first {len(ids)} tokens{shortfall}", say)


def _tool_versions() -> dict[str, str]:
    versions = {}
    for module in ("onnx", "onnx_ir", "onnxruntime", "numpy", "gguf", "safetensors"):
        with contextlib.suppress(Exception):
            versions[module] = __import__(module).__version__
    return versions
