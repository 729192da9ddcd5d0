"""An export folder's ``manifest.json`` and the figures it must share with the graph beside it.

The checks every command makes before it loads anything slow: the folder is an export (not a
bundle, not a pre-packed copy), the manifest's fields have the types the toolkit reads, the data
files have the sizes the manifest records, and the manifest's figures (vocabulary, layers, KV
dimensions, dtype, the quantization record, the extra outputs) are the graph's. Nothing here loads
onnxruntime; ``runtime.py`` and ``exporter.py`` both use it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path

from .config import DTYPES, FULL, QUANTIZED_DTYPES, SLIDING, variant_options
from .errors import FormatError, GemmaExportError, SourceNotFoundError, VerificationError, check_utf8_path, is_whole_number, shown
from .onnx_files import (BUNDLE_MANIFEST, BUNDLE_MODEL_DIR, MANIFEST_FILE, MODEL_FILE, PREPACKED_DIR, PREPACKED_MANIFEST,
                         graph_dtype, graph_quantization, logits_dims, logits_vocab, traced_initializer)
from .staging import leftovers, listed_files, nothing_listed
from .text_files import SMALL_FILE_BYTES, FileRefused, broken_link, non_regular, read_bounded


def read_manifest(model_dir: Path) -> dict:
    """The JSON object in ``model_dir/manifest.json``; ``{}`` when the folder has none (a folder of
    another tool, e.g. onnxruntime-genai's builder).

    Raises:
        FormatError: ``"…/manifest.json: unreadable manifest: …"`` when it is a folder, a FIFO,
            larger than :data:`~gemma_export.text_files.SMALL_FILE_BYTES`, not UTF-8 JSON, or not a
            JSON object.
    """

    manifest = Path(model_dir) / MANIFEST_FILE
    try:
        if (what := non_regular(manifest)) is not None:
            raise ValueError(f"it is {what}")
        if not manifest.is_file():
            return {}
        text = read_bounded(manifest, "a manifest").decode("utf-8")
    except FileRefused as exc:  # larger than any manifest
        raise FormatError(f"{manifest}: unreadable manifest: {exc.reason}") from None
    except UnicodeDecodeError as exc:
        raise FormatError(f"{manifest}: unreadable manifest: expected UTF-8 text, found byte "
                          f"0x{exc.object[exc.start]:02x} at offset {exc.start}") from None
    except (OSError, ValueError) as exc:
        raise FormatError(f"{manifest}: unreadable manifest: {exc}") from None
    try:
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, found {shown(value)}")
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{manifest}: unreadable manifest: {exc}") from None
    return value


def manifest_figure(model_dir: Path, key: str) -> int | None:
    """A positive whole number from the ``config`` object of an export's ``manifest.json`` (e.g.
    ``vocab_size``, ``max_position_embeddings``), for checks made before the (slow) session load.

    Returns ``None`` when the manifest is missing or unreadable, has no ``config`` object, or the
    value is absent or not a positive whole number: the session load that follows names a damaged
    manifest, and checks made after it use the loaded graph's figures. Never raises.
    """
    try:
        config = read_manifest(model_dir).get("config")
    except FormatError:
        return None
    value = config.get(key) if isinstance(config, dict) else None
    return value if is_whole_number(value) and value > 0 else None


def is_bundle(folder: str | Path) -> bool:
    """Whether ``folder`` is a board folder written by ``gemma-export bundle``: ``BUNDLE.json`` at its
    top (the export in ``model/``). That file alone decides, so a bundle whose ``model/`` was damaged
    is still named as one (``verify`` then names what is missing)."""
    try:
        return (Path(folder) / BUNDLE_MANIFEST).is_file()
    except PermissionError:  # a folder this user may not search: not known as a bundle (require_folder names it)
        return False


def is_prepacked_copy(folder: str | Path) -> bool:
    """Whether ``folder`` is an export's pre-packed copy (``gemma-export prepack``): a folder named
    ``prepacked`` that holds ``prepacked.json``."""
    return Path(folder).resolve().name == PREPACKED_DIR and (Path(folder) / PREPACKED_MANIFEST).is_file()


def check_readable_folder(folder: str | Path) -> None:
    """Refuse a folder this user may not list or enter: every name in it would otherwise be reported
    as "Permission denied" (a ``BUNDLE.json`` that does not exist, named first). Nothing happens for
    a path that is no folder (the caller names it).

    Raises:
        SourceNotFoundError: naming the folder.
    """
    if os.path.isdir(folder) and not os.access(folder, os.R_OK | os.X_OK):
        raise SourceNotFoundError(f"{folder}: this user may not read the folder (permission denied); its owner can "
                                  "make it readable")


def _export_command_hint(folder: Path) -> str:
    """For a missing folder named as the main command names the bundled model's export
    (``gemma-3-270m-onnx-int4``, ``gemma-3-270m-onnx-int4-table-int8``), the command that writes it;
    otherwise nothing (a typo of another name is not told to export)."""
    from .sources import BUNDLED_NAME  # only here: the board's commands do not import the sources' readers

    variant = folder.name.removeprefix(f"{BUNDLED_NAME}-onnx-")
    options = None if variant == folder.name else variant_options(variant)
    if options is None:
        return ""
    here = Path(folder).parent == Path(".") or Path(folder).parent.resolve() == Path.cwd()
    out = "" if here else f" --out {shlex.quote(str(folder))}"
    return f"; `gemma-export {' '.join(options)}{out}` writes it"


def require_folder(folder: Path, holding: str) -> None:
    """``folder`` exists and is a folder (an export, which holds ``holding``), not a bundle.

    Args:
        folder: the path given by the user.
        holding: the file the folder should hold, named in the message (e.g. ``model.onnx``).

    Raises:
        GemmaExportError: the path is not valid UTF-8 (:func:`~gemma_export.errors.check_utf8_path`).
        SourceNotFoundError: no such folder, something else by that name, a bundle folder (naming
            the export inside it), or an export's pre-packed copy (naming the export it belongs to).
    """
    check_utf8_path(folder, "export folder")
    if (link := broken_link(folder)) is not None:
        raise SourceNotFoundError(f"{folder}: {link}; expected an export folder")
    if not folder.exists():
        # a writer killed between its two renames leaves the previous output whole in .NAME.old-*/NAME
        aside = [p / folder.name for p in leftovers(folder) if (p / folder.name).is_dir()]
        hint = (f"; a gemma-export killed while replacing it left the previous one in {aside[-1]}: move that back "
                f"to {folder}, or write it again" if aside else _export_command_hint(folder))
        raise SourceNotFoundError(f"{folder}: no such export folder{hint}")
    if not folder.is_dir():
        what = "a file" if folder.is_file() else "not a regular file (a FIFO, socket or device)"
        raise SourceNotFoundError(f"{folder}: is {what}; expected an export folder (the one holding {holding})")
    check_readable_folder(folder)
    if is_bundle(folder):
        raise SourceNotFoundError(f"{folder}: a bundle folder; its export is {folder / BUNDLE_MODEL_DIR} (give that)")
    if is_prepacked_copy(folder):
        raise SourceNotFoundError(f"{folder}: an export's pre-packed copy (gemma-export prepack), used through its "
                                  f"export; give the export folder {folder.resolve().parent}")


def check_listed_files(manifest: dict, model_dir: Path) -> None:
    """The graph and weight data files an export's manifest lists (``model.onnx``,
    ``model.onnx.data``) have the sizes it records and can be read: a cheap check (one ``stat`` and
    ``open`` per file) against a folder changed after the export, e.g. the data file of another
    export copied in, which onnxruntime would run without a word, or a file in the graph's place over
    16 times its recorded size (and over 64 MiB), which onnx would read whole. The ``files`` record itself is read by
    :func:`~gemma_export.staging.listed_files`, as ``gemma-export verify`` reads it. The tokenizer has
    checks of its own; a missing file is left to the step that reads it; ``gemma-export verify``
    compares every byte of every file.

    Args:
        manifest: the parsed ``manifest.json`` (:func:`read_manifest`); without ``files`` nothing is
            checked, unless its ``tool`` field says gemma-export wrote it (every export of it lists its
            files: one without is a damaged manifest, refused).
        model_dir: the export folder; sizes are compared in bytes.

    Raises:
        FormatError: naming the first file whose size differs from the manifest's, or a ``files``
            field that ``verify`` would refuse (not a non-empty object of ``{"bytes": integer >= 0,
            "sha256": 64 hex digits}`` entries under plain file names): a damaged manifest would
            otherwise pass this check unseen.
        OSError: a listed file cannot be opened for reading (permissions, I/O error).
    """
    if nothing_listed(manifest):  # another tool's manifest
        return
    try:
        files = listed_files(manifest.get("files"), model_dir / MANIFEST_FILE, nested=False)
    except VerificationError as exc:
        raise FormatError(str(exc)) from None
    for name, (recorded, _) in files.items():
        path = model_dir / name
        if not (name == MODEL_FILE or name.startswith(f"{MODEL_FILE}.")) or not path.is_file():
            continue
        size = path.stat().st_size
        # the graph is checked against the manifest once loaded (an edited graph is named by what it
        # changed); only a size no edit of it explains is refused first, since onnx.load reads it whole
        # (a 2 GB file in its place would be read whole before it was refused)
        if name == MODEL_FILE and size <= max(16 * recorded, SMALL_FILE_BYTES):
            continue
        if size != recorded:
            raise FormatError(f"{path}: {size:,} bytes, but {model_dir / MANIFEST_FILE} records {recorded:,}: the "
                              f"folder changed after the export (export it again; gemma-export verify checks every file)")
        with open(path, "rb"):
            pass


def resized_files(model_dir: Path) -> list[str]:
    """Names of the files ``model_dir``'s ``manifest.json`` lists, other than the graph and its data
    (:func:`check_listed_files` refuses those), whose size now differs from the recorded one: a
    tokenizer or config edited after the export, which ``generate`` runs with. One ``stat`` each;
    ``gemma-export verify`` compares every byte. Empty when there is no readable listing."""
    try:
        files = listed_files(read_manifest(model_dir)["files"], model_dir / MANIFEST_FILE, nested=False)
    except (GemmaExportError, KeyError, TypeError, OSError):
        return []
    changed = []
    for name, (recorded, _) in files.items():
        if name == MODEL_FILE or name.startswith(f"{MODEL_FILE}."):
            continue
        try:
            if (model_dir / name).stat().st_size != recorded:
                changed.append(name)
        except (OSError, ValueError):  # missing, or a NUL in the name: named by the step that reads it, if any does
            continue
    return changed


#: what a stop-id field holds (the manifest's ``config.eos_token_id``, genai_config.json's ``model.eos_token_id``)
TOKEN_IDS = "a token id or a list of them (integers >= 0)"


def is_token_ids(value) -> bool:
    """Whether ``value`` is :data:`TOKEN_IDS`: a JSON integer >= 0, or a non-empty list of them."""
    return ((is_whole_number(value) and value >= 0)
            or (isinstance(value, list) and value != [] and all(is_whole_number(i) and i >= 0 for i in value)))


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


#: manifest fields the runtime reads or records: (where, name) → (what is expected, test)
_MANIFEST_FIELDS = {
    (None, "dtype"): ("one of " + ", ".join(DTYPES), lambda v: v in DTYPES),
    ("config", "max_position_embeddings"): ("a positive integer below 2**31 (int32 positions)",
                                            lambda v: is_whole_number(v) and 0 < v < 2 ** 31),
    ("config", "vocab_size"): ("a positive integer", lambda v: is_whole_number(v) and v > 0),
    ("config", "num_hidden_layers"): ("a positive integer", lambda v: is_whole_number(v) and v > 0),
    ("config", "sliding_window"): ("a positive integer (positions)", lambda v: is_whole_number(v) and v > 0),
    ("config", "bos_token_id"): ("a token id (integer >= 0)", lambda v: is_whole_number(v) and v >= 0),
    ("config", "pad_token_id"): ("a token id (integer >= 0) or null", lambda v: v is None or (is_whole_number(v) and v >= 0)),
    **{("config", name): ("a positive integer", lambda v: is_whole_number(v) and v > 0)
       for name in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")},
    ("config", "rms_norm_eps"): ("a positive finite number", _positive_number),
    **{(None, name): ("true or false", lambda v: isinstance(v, bool))
       for name in ("all_logits", "debug_outputs", "tie_word_embeddings")},
    ("config", "eos_token_id"): (TOKEN_IDS, is_token_ids),
    # the sliding-window metadata the runtime checks against the graph's is read from these
    ("config", "layer_types"): ("a list of 'sliding_attention' and 'full_attention'",
                                lambda v: isinstance(v, list) and all(t in LAYER_TYPES for t in v)),
    ("config", "rope_parameters"): ("an object", lambda v: isinstance(v, dict)),  # its entries: below
    # the graph's constants came from these; the exporter refuses the same values in a source's config
    ("config", "query_pre_attn_scalar"): ("a positive finite number", _positive_number),
    **{("config", name): ("a positive finite number or null", lambda v: v is None or _positive_number(v))
       for name in ("final_logit_softcapping", "attn_logit_softcapping")},
    **{("config", name): ("a positive finite number", _positive_number) for name in ("rope_theta", "rope_local_base_freq")},
    ("kv_cache", "past_present_share_buffer"): ("true or false", lambda v: isinstance(v, bool)),
    # what the bundle README and `verify` report from these; the graph does not show them
    (None, "format"): ("'onnx'", lambda v: v == "onnx"),
    ("kv_cache", "layout"): ("'BNSH' (the caches' [batch, kv heads, positions, head_dim])", lambda v: v == "BNSH"),
    ("quantization", "calibration"): ("an object (GPTQ's record) or null (round to nearest)",
                                      lambda v: v is None or isinstance(v, dict)),
}

#: what ``config.layer_types`` may hold (transformers' Gemma 3 names)
LAYER_TYPES = (SLIDING, FULL)


def check_manifest_fields(manifest: dict, path: str | Path, config_required: bool = False) -> None:
    """Check the fields of an export's ``manifest.json`` that the runtime reads (absent ones are
    allowed: folders of other exporters carry none).

    Args:
        manifest: the parsed manifest (a dict).
        path: the manifest's path, for the message.
        config_required: refuse a manifest without ``config`` whoever wrote it (``verify``, which
            checks exports of this toolkit only); otherwise only one whose ``tool`` names gemma-export.

    Raises:
        FormatError: ``config`` or ``quantization`` is not an object, ``config`` is absent (see
            ``config_required``), or naming the first field whose value is not what the runtime
            expects.
    """
    if not isinstance(manifest.get("config", {}), dict):
        raise FormatError(f"{path}: field 'config' must be an object, found {shown(manifest['config'])}")
    tool = manifest.get("tool")
    if "config" not in manifest and (config_required or isinstance(tool, dict) and "gemma-export" in tool):
        raise FormatError(f"{path}: no field 'config' (an object); every export of gemma-export records its model "
                          "config there")
    if not isinstance(manifest.get("kv_cache", {}), dict):
        raise FormatError(f"{path}: field 'kv_cache' must be an object, found {shown(manifest['kv_cache'])}")
    if manifest.get("quantization") is not None and not isinstance(manifest["quantization"], dict):  # fp32, bf16: none
        raise FormatError(f"{path}: field 'quantization' must be an object or null, found "
                          f"{shown(manifest['quantization'])}")
    for (section, name), (expected, ok) in _MANIFEST_FIELDS.items():
        scope = manifest.get(section) if section else manifest
        if isinstance(scope, dict) and name in scope and not ok(scope[name]):  # a null quantization: no fields
            field = f"{section}.{name}" if section else name
            raise FormatError(f"{path}: field {field!r} must be {expected}, found {shown(scope[name])}")
    # each layer type's RoPE record (transformers 5): an object whose rope_theta, if any, is positive
    for kind, entry in manifest.get("config", {}).get("rope_parameters", {}).items():
        field = f"config.rope_parameters.{kind}"
        if not isinstance(entry, dict):
            raise FormatError(f"{path}: field {field!r} must be an object, found {shown(entry)}")
        if "rope_theta" in entry and not _positive_number(entry["rope_theta"]):
            raise FormatError(f"{path}: field '{field}.rope_theta' must be a positive finite number, found "
                              f"{shown(entry['rope_theta'])}")


def table_codes_word(quantization: dict, dtype: str | None) -> str:
    """``"int8 "`` when a quantization record's ``table_dtype`` (int4/int8) differs from the export's
    ``dtype`` (an int4 export with ``--table-dtype int8``), else ``""``: the word that the export
    summary's ``blocks:`` line and :func:`quantization_text` put before "table"."""
    table_dtype = quantization.get("table_dtype")
    return f"{table_dtype} " if table_dtype in ("int4", "int8") and table_dtype != dtype else ""


def quantization_text(model_manifest: dict) -> tuple[str, str]:
    """From an int8/int4 export's manifest ``quantization`` record: a parenthesis that says how its
    weights were quantized (block sizes, table codes, rotation, scales, activation residual,
    calibration; "" without a record), for the bundle README's model line and the export's note
    about an earlier export it replaces, and a sentence for the bundle README about float16 scales
    ("" otherwise). Fields of an unexpected type are left out (a hand-edited manifest)."""
    q = model_manifest.get("quantization")
    if not isinstance(q, dict):
        return "", ""

    def number(field):
        value = q.get(field)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    parts = []
    if number("block_size"):
        parts.append(f"{q['block_size']} weights per scale in the layers")
    if number("table_block_size"):
        parts.append(f"{q['table_block_size']} in the {table_codes_word(q, model_manifest.get('dtype'))}table")
    if number("hadamard_size") is not None:
        parts.append(f"Hadamard {q['hadamard_size']}" if q["hadamard_size"] else "no rotation")
    if q.get("scale_dtype") in ("float32", "float16"):
        parts.append(f"{q['scale_dtype']} scales")
    if q.get("activation_residual") is True:
        parts.append("activation residual")
    if q.get("symmetric") is False:
        parts.append("4-bit zero points")
    if q.get("scale_method") in ("mse", "rtn"):
        parts.append("clipping-search scales" if q["scale_method"] == "mse" else "largest-magnitude scales")
    if "calibration" in q:
        parts.append("GPTQ codes" if isinstance(q["calibration"], dict) else "codes rounded to nearest")
    float16 = ("Its block scales are stored as float16 and widened to float32 once, by onnxruntime's graph\n"
               "optimizations when the model loads: keep them on (the default, as `generate` and `bench` do);\n"
               "with them off onnxruntime computes wrong products.\n\n" if q.get("scale_dtype") == "float16" else "")
    return (f" ({', '.join(parts)})" if parts else ""), float16


def export_description(manifest: dict) -> str:
    """``"int8 export (32 weights per scale in the layers, …)"`` from an export's manifest: its
    dtype and :func:`quantization_text`; "" when ``dtype`` is none of ``DTYPES`` (a hand-edited or
    foreign manifest). For the notes about an earlier export or bundle being replaced."""
    dtype = manifest.get("dtype")
    return f"{dtype} export{quantization_text(manifest)[0]}" if dtype in DTYPES else ""


def check_manifest_against_graph(manifest: dict, path: str | Path, vocab_size: int, num_hidden_layers: int,
                                 dtype: str | None = None, kv_dims: tuple[int | None, int | None] = (None, None),
                                 quantization: dict | None = None, outputs: dict | None = None,
                                 sizes: tuple[int | None, int | None] = (None, None),
                                 attention_heads: int | None = None) -> None:
    """Check that the manifest describes the graph beside it: ``config.vocab_size`` and
    ``config.num_hidden_layers`` equal the graph's (logits width, ``past_key_values.{i}.key`` inputs),
    ``config.num_key_value_heads`` and ``config.head_dim`` the cache's dimensions (``kv_dims``,
    :func:`graph_kv_dims`; None: not checked), ``config.hidden_size`` and ``config.intermediate_size``
    the weights' (``sizes``, :func:`graph_sizes`; ``verify``'s tie check and ``parity --reference``'s
    architecture check read them), ``config.num_attention_heads`` the attention's (``attention_heads``,
    :func:`graph_attention_heads`), ``config.layer_types`` one entry per layer,
    ``config.bos_token_id`` and ``config.pad_token_id``
    lie inside the vocabulary, and ``dtype`` is the weights the graph stores
    (``onnx_files.graph_dtype``; ``parity`` picks its thresholds by it), and each figure of the
    ``quantization`` record that the graph shows (``quantization``: :func:`~gemma_export.onnx_files.graph_quantization`;
    block sizes, table dtype, scale dtype, zero points, activation residual, rotation; ``prepack``
    sizes its room by the scale dtype), and ``all_logits`` / ``debug_outputs`` the graph's outputs
    (``outputs``: :func:`graph_output_options`). Call :func:`check_manifest_fields` first.
    Absent fields are not checked. (A stop id outside the vocabulary is allowed: it never fires,
    and small test configs keep Gemma's default ids.)

    Raises:
        FormatError: naming the first field that contradicts the graph.
    """
    config = manifest.get("config", {})  # an object: check_manifest_fields comes first
    for field, actual in (("vocab_size", vocab_size), ("num_hidden_layers", num_hidden_layers),
                          ("num_key_value_heads", kv_dims[0]), ("head_dim", kv_dims[1]),
                          ("hidden_size", sizes[0]), ("intermediate_size", sizes[1]),
                          ("num_attention_heads", attention_heads)):
        if isinstance(actual, int) and field in config and config[field] != actual:
            raise FormatError(f"{path}: field 'config.{field}' is {shown(config[field])}, but the graph has {actual:,}")
    types = config.get("layer_types")
    if isinstance(types, list) and isinstance(num_hidden_layers, int) and len(types) != num_hidden_layers:
        raise FormatError(f"{path}: field 'config.layer_types' has {len(types)} entries, but the graph has "
                          f"{num_hidden_layers:,} layers")
    for field in ("bos_token_id", "pad_token_id"):
        if isinstance(vocab_size, int) and is_whole_number(config.get(field)) and config[field] >= vocab_size:
            raise FormatError(f"{path}: field 'config.{field}' is {config[field]:,}, outside the graph's vocabulary "
                              f"(ids 0 to {vocab_size - 1:,})")
    if dtype is not None and "dtype" in manifest and manifest["dtype"] != dtype:
        raise FormatError(f"{path}: field 'dtype' is {shown(manifest['dtype'])}, but the graph stores {dtype} weights")
    if dtype is not None and "quantization" in manifest:  # the bundle README and export notes describe it
        blockwise = dtype in QUANTIZED_DTYPES
        if blockwise != isinstance(manifest["quantization"], dict):
            expected = "an object (its block sizes, scales, calibration)" if blockwise else "null"
            raise FormatError(f"{path}: field 'quantization' is {shown(manifest['quantization'])}, but the graph "
                              f"stores {dtype} weights: expected {expected}")

    def differs(recorded, actual) -> bool:  # JSON 0 is not false, nor 32.0 a block size
        return type(recorded) is not type(actual) or recorded != actual

    for field, (actual, where) in (outputs or {}).items():
        if field in manifest and differs(manifest[field], actual):
            raise FormatError(f"{path}: field {field!r} is {shown(manifest[field])}, but {where}")
    recorded = manifest.get("quantization")
    for field, (actual, where) in (quantization or {}).items():
        if isinstance(recorded, dict) and field in recorded and differs(recorded[field], actual):
            raise FormatError(f"{path}: field 'quantization.{field}' is {shown(recorded[field])}, but {where}")


def graph_vocab_and_layers(model) -> tuple[int | None, int]:
    """The vocabulary (the ``logits`` output's last dimension, None when symbolic or absent) and the
    number of layers (``past_key_values.{i}.key`` inputs) of an export's ``onnx.ModelProto``. Never
    raises on a graph of another shape: the figures are then None / 0."""
    vocab = logits_vocab(model)
    layers = sum(1 for i in model.graph.input if i.name.startswith("past_key_values.") and i.name.endswith(".key"))
    return vocab, layers


def graph_output_options(model) -> dict[str, tuple[bool, str]]:
    """The manifest's ``all_logits`` and ``debug_outputs`` as an export's graph (an
    ``onnx.ModelProto``) shows them, each as ``(value, where the graph shows it)``: ``all_logits``
    True unless the ``logits`` output's sequence dimension is a fixed 1 (the last position only),
    ``debug_outputs`` True when an output is named ``debug.…``. {} without a ``logits`` output of
    rank 3."""
    dims = logits_dims(model)
    if len(dims) != 3:
        return {}
    last_only = dims[1].HasField("dim_value") and dims[1].dim_value == 1
    debug = any(o.name.startswith("debug.") for o in model.graph.output)
    return {"all_logits": (not last_only, "the graph's logits are " + ("the last position's only" if last_only else
                                                                        "every position's")),
            "debug_outputs": (debug, "the graph " + ("has" if debug else "has no") + " debug.* outputs")}


def graph_table_rows(model) -> int | None:
    """Rows of the table the embedding lookup reads: the first dimension of the data of the
    ``Gather`` that takes ``input_ids``, when that is an initializer (or reached from one through
    ``Cast`` or ``Identity`` nodes, as in a bf16 export); None for graphs laid out otherwise
    (onnxruntime-genai's gathers from a Transpose)."""
    initializers = {t.name: t for t in model.graph.initializer}
    produced_by = {out: node for node in model.graph.node for out in node.output}
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] != "input_ids":
            continue
        table = traced_initializer(node.input[0], initializers, produced_by)
        if table is not None and table.dims:
            return int(table.dims[0])
    return None


def graph_kv_dims(model) -> tuple[int | None, int | None]:
    """``(num_key_value_heads, head_dim)`` from the ``past_key_values.0.key`` input of an export's
    ``onnx.ModelProto`` (layout ``[batch, kv_heads, past, head_dim]``); None where absent or symbolic."""
    key = next((i for i in model.graph.input if i.name == "past_key_values.0.key"), None)
    dims = list(key.type.tensor_type.shape.dim) if key is not None else []
    if len(dims) != 4:
        return None, None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in (dims[1], dims[3]))


def graph_sizes(model) -> tuple[int | None, int | None]:
    """``(hidden_size, intermediate_size)`` of an export's ``onnx.ModelProto`` from the initializers
    this toolkit's builder names: ``model.norm.weight`` ``[hidden]``, and layer 0's fused
    ``mlp.gate_up_proj.weight``, ``[hidden, 2 · intermediate]`` in float graphs and
    ``[2 · intermediate, blocks, bytes]`` in block-quantized ones (``MatMulNBits``' ``B``); None
    where a graph has no such initializer (another tool's)."""
    dims = {t.name: list(t.dims) for t in model.graph.initializer
            if t.name in ("model.norm.weight", "model.layers.0.mlp.gate_up_proj.weight")}
    norm = dims.get("model.norm.weight", [])
    gate_up = dims.get("model.layers.0.mlp.gate_up_proj.weight", [])
    hidden = norm[0] if len(norm) == 1 else None
    fused = {2: gate_up[1:2], 3: gate_up[:1]}.get(len(gate_up), [])
    intermediate = fused[0] // 2 if fused and fused[0] % 2 == 0 else None
    return hidden, intermediate


def check_manifest_against_model(manifest: dict, path: str | Path, model) -> None:
    """:func:`check_manifest_against_graph` with every figure read from ``model``, an export's
    ``onnx.ModelProto`` (external data not loaded): the vocabulary from the logits' width, else the
    embedding table's rows (:func:`graph_table_rows`), the layers, the weights' dtype, the cache's
    dimensions, the quantization and the output options.

    Raises:
        FormatError: naming the first field that contradicts the graph.
        TypeError: a name in the graph that is not UTF-8 (protobuf gives it as bytes).
    """
    vocab, layers = graph_vocab_and_layers(model)
    check_manifest_against_graph(manifest, path, vocab or graph_table_rows(model), layers, graph_dtype(model),
                                 graph_kv_dims(model), graph_quantization(model), graph_output_options(model),
                                 graph_sizes(model), graph_attention_heads(model))


def graph_attention_heads(model) -> int | None:
    """The query heads of an export's ``onnx.ModelProto``: the ``num_heads`` attribute its
    ``GroupQueryAttention`` nodes share; None without such nodes, or when they differ (another
    tool's graph)."""
    heads = {next((a.i for a in node.attribute if a.name == "num_heads"), None)
             for node in model.graph.node if node.op_type == "GroupQueryAttention"}
    return heads.pop() if len(heads) == 1 and None not in heads else None


def check_manifest_matches_graph(model_dir: str | Path) -> None:
    """:func:`check_manifest_fields` and :func:`check_manifest_against_graph` for an export folder,
    reading only its graph (not the weights, no session): a quick way to tell a hand-edited manifest
    from bad inputs before anything slow runs.

    Raises:
        FormatError: an unreadable manifest or graph, or a field that contradicts the graph.
    """
    from .onnx_files import read_graph

    path = Path(model_dir) / MANIFEST_FILE
    manifest = read_manifest(model_dir)
    check_manifest_fields(manifest, path)
    model = read_graph(Path(model_dir) / MODEL_FILE)
    check_manifest_against_model(manifest, path, model)
