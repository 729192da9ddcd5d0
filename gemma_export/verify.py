"""Checks of a written export folder: the tied table stored once (:func:`count_table_initializers`),
the ONNX checker, an onnxruntime load and a first step with finite logits (:func:`verify_folder`),
and every file against ``manifest.json`` (:func:`verify_manifest`).

Apart from the exporter so that ``verify``, ``prepack`` and a bundle's check on the board load no
graph builder, quantizer or calibration code (about 49 MB of Anonymous memory with ``onnx_ir``).
"""

from __future__ import annotations

import math
from pathlib import Path

from .config import SLIDING_CACHE_START
from .errors import FormatError, SourceNotFoundError, VerificationError, check_arguments, shown_folder
from .manifest import (check_manifest_against_model, check_manifest_fields, graph_vocab_and_layers, manifest_figure,
                       read_manifest, require_folder)
from .onnx_files import (BUNDLE_MANIFEST, BUNDLE_MODEL_DIR, MANIFEST_FILE, MODEL_FILE, check_external_data, graph_dtype,
                         read_graph)
from .prepack import PREPACKED_DIR
from .prepack import check_no_leftovers as check_no_prepack_leftovers
from .prepack import owned_problem as prepack_owned_problem
from .prepack import unreadable_or
from .runtime import check_decoder_contract, create_session, genai_model_config, max_positions, sliding_layers_from
from .staging import check_listed_file, listed_files, nothing_listed
from .text_files import non_regular
from .tokenizer import read_tokenizer_json


def count_table_initializers(model_path: Path, vocab_size: int, hidden_size: int) -> int:
    """Initializers in an ONNX file that hold a whole ``vocab × hidden`` table in any layout: first
    or last dimension ``vocab`` (a transposed ``[hidden, vocab]`` copy, as folding a ``Transpose``
    makes, counts too) and ``vocab × hidden`` elements, or half as many bytes (4-bit codes packed
    two per uint8). Read without loading external data.

    Raises:
        Whatever ``onnx.load`` raises on an unreadable file (OSError, protobuf's DecodeError),
        unwrapped: callers pass a model this toolkit just wrote.
    """
    import onnx

    return tables_in(onnx.load(str(model_path), load_external_data=False), vocab_size, hidden_size)


def tables_in(model, vocab_size: int, hidden_size: int) -> int:
    """How many of ``model``'s initializers (an ``onnx.ModelProto``) are table-shaped
    (:func:`is_table_shaped`)."""
    return sum(1 for t in model.graph.initializer if is_table_shaped(t.dims, t.data_type, vocab_size, hidden_size))


def is_table_shaped(dims, data_type: int, vocab_size: int, hidden_size: int) -> bool:
    """True for an initializer of ``dims`` that can hold a whole ``[vocab, hidden]`` table (see
    :func:`count_table_initializers`).

    Args:
        dims: the initializer's shape.
        data_type: its ``onnx.TensorProto`` data type (``UINT8`` may hold packed 4-bit codes).
        vocab_size, hidden_size: the table's shape.
    """
    import onnx

    n = math.prod(dims)
    packed = data_type == onnx.TensorProto.UINT8 and 2 * n == vocab_size * hidden_size
    return len(dims) >= 1 and vocab_size in (dims[0], dims[-1]) and (n == vocab_size * hidden_size or packed)


#: tokens of :func:`verify_folder`'s step: ``<bos>``, then ids spread over the vocabulary (:func:`probe_ids`)
PROBE_TOKENS = 8


def probe_ids(vocab_size: int | None, positions: int | None, bos_token_id: int | None = None) -> list[int]:
    """The token ids :func:`verify_folder` runs in one step from an empty cache, as a prompt: its
    ``bos_token_id`` (which every prompt starts with; id 0 when unknown or outside the vocabulary),
    then ids spread evenly over ``0 … vocab_size - 1``, :data:`PROBE_TOKENS` in all, fewer when the
    graph takes fewer ``positions``; ``[bos_token_id]`` alone when the positions are unknown, ``[0]``
    when the vocabulary is (the id cannot be checked against it). A weight that
    overflows for some tokens only (one ``down_proj`` entry of 3e38 on a tiny model: NaN from
    ``<bos>``, finite from id 0) makes the step's last logits NaN through the attention over all."""
    first = bos_token_id if isinstance(bos_token_id, int) and vocab_size and 0 <= bos_token_id < vocab_size else 0
    if not vocab_size or not positions:
        return [first]
    count = min(PROBE_TOKENS, positions)
    spread = [round(k * (vocab_size - 1) / (count - 2)) for k in range(count - 1)] if count > 2 else [0][:count - 1]
    return [first] + spread


def verify_folder(folder: str | Path) -> None:
    """Check an export folder: the ONNX checker on the path, an onnxruntime session load, and one
    step of a few token ids (:func:`probe_ids`: ``<bos>`` and ids spread over the vocabulary, at
    positions 0, 1, ...) whose logits must be finite (weights that are finite but overflow float32
    inside the graph, e.g. a norm weight of 3e38, would otherwise export and verify, and fail every
    later generation). The positions are capped by the folder's ``max_position_embeddings``
    (:func:`~gemma_export.runtime.max_positions`: its manifest, or the ``genai_config.json`` an export
    writes first), ``<bos>`` read from the same files; the vocabulary is the graph's ``logits`` width.

    Args:
        folder: a folder holding ``model.onnx`` (and its external data), with this toolkit's
            decoder inputs (``input_ids``, ``attention_mask``, ``position_ids``,
            ``past_key_values.{i}.key|value``).

    Raises:
        VerificationError: naming the file and the failure (a file with several hard links named as
            such: the checker refuses them); :class:`NonFiniteLogits` for the first step's NaN or Inf.
    """
    import numpy as np
    import onnx

    check_arguments("verify_folder", folder=(folder, "path"))
    folder = Path(folder)  # a str too, as verify_manifest takes
    model_path = folder / MODEL_FILE
    try:
        onnx.checker.check_model(str(model_path), full_check=False)
    except Exception as exc:
        linked = [p for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink() and p.stat().st_nlink > 1]
        if "hard links" in str(exc) and linked:  # e.g. a backup made with cp -al: the checker's own guard
            raise VerificationError(f"{linked[0]}: has {linked[0].stat().st_nlink} hard links, which the ONNX checker "
                                    "refuses (its guard against hard-link attacks); keep a plain copy (cp, not ln) "
                                    "and verify again") from None
        raise VerificationError(f"{model_path}: ONNX checker failed: {exc}") from None
    try:
        session = create_session(model_path)
        # the inputs and outputs generate, bench, quality and parity feed and read: a graph that loads
        # but breaks them would pass here and fail on the board
        check_decoder_contract(model_path, {i.name: i for i in session.get_inputs()}, session.get_outputs())
        vocab = next(o.shape[-1] for o in session.get_outputs() if o.name == "logits")  # check_decoder_contract: there
        ids = probe_ids(vocab if isinstance(vocab, int) else None, max_positions(folder), _bos_token_id(folder))
        feeds = _first_step_feeds(model_path, session, ids)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    logits = session.run(["logits"], feeds)[0]
    if not np.isfinite(logits).all():
        bad = logits[~np.isfinite(logits)]
        what = (f"token id {ids[0]} at position 0" if len(ids) == 1 else
                f"token ids {', '.join(map(str, ids))} at positions 0-{len(ids) - 1}")
        raise NonFiniteLogits(model_path, f"the first step ({what}) computes {bad.size:,} "
                                          f"non-finite logits (e.g. {bad.flat[0]})")


class NonFiniteLogits(VerificationError):
    """:func:`verify_folder`'s one-step check found NaN or Inf logits: weights that are finite but
    overflow float32 in the graph's arithmetic.

    Attributes:
        path: the graph that computed them; finding: what the step computed.
    """

    def __init__(self, path: Path, finding: str):
        super().__init__(f"{path}: {finding}: a weight overflows float32 in the graph")
        self.path, self.finding = path, finding


def _bos_token_id(folder: Path) -> int | None:
    # genai_config.json's (every export writes it first), else the manifest's; None: unknown (id 0 then)
    try:
        bos = genai_model_config(folder).get("bos_token_id")
    except FormatError:
        bos = None
    if bos is None:
        bos = manifest_figure(folder, "bos_token_id")
    return bos if isinstance(bos, int) and not isinstance(bos, bool) else None


def _first_step_feeds(model_path: Path, session, ids: list[int]) -> dict:
    """The feeds of one step of ``ids`` at positions 0, 1, ... with an empty cache, for
    ``session``'s declared inputs (:func:`~gemma_export.runtime.check_decoder_contract` passed).

    Raises:
        FormatError: a cache input's kv-heads or ``head_dim`` is symbolic (an export of this toolkit
            declares both), naming the input.
    """
    import numpy as np

    feeds = {}
    for node in session.get_inputs():
        if node.name.startswith("past_key_values."):
            _, heads, _, head_dim = node.shape
            for what, dim in (("kv-heads", heads), ("head_dim", head_dim)):
                if not isinstance(dim, int):
                    raise FormatError(f"{model_path}: input {node.name} has a symbolic {what} dimension {dim!r}; "
                                      "an export of this toolkit declares it as a number")
            feeds[node.name] = np.zeros((1, heads, 0, head_dim), np.float32)
        else:  # input_ids, attention_mask, position_ids: [1, len(ids)]
            feeds[node.name] = np.asarray([{"input_ids": ids, "attention_mask": [1] * len(ids)}.get(
                node.name, list(range(len(ids))))], np.int64)
    return feeds


def _check_tied(manifest: dict, manifest_path: Path, model, vocab_size: int | None) -> None:
    """``tie_word_embeddings`` against the graph: one ``vocab × hidden`` table initializer when tied,
    two when not (:func:`is_table_shaped`, with the manifest's ``config.hidden_size``). Not checked
    without those figures, or for a graph holding neither one nor two tables."""
    tied = manifest.get("tie_word_embeddings")
    hidden = manifest.get("config", {}).get("hidden_size")
    if not isinstance(tied, bool) or not isinstance(vocab_size, int) or not isinstance(hidden, int):
        return
    tables = tables_in(model, vocab_size, hidden)
    if tables in (1, 2) and (tables == 1) != tied:
        raise VerificationError(f"{manifest_path}: field 'tie_word_embeddings' is {str(tied).lower()}, but the graph "
                                f"stores {'one table, shared by the lookup and the head' if tables == 1 else 'two tables'}")


def check_listed_files_against(folder: Path, expected: dict[str, tuple[int, str]]) -> None:
    """Every file ``expected`` lists (name → ``(bytes, sha256)``, :func:`~gemma_export.staging.listed_files`)
    is in ``folder`` with that size and sha256 (about a second per GB).

    Raises:
        VerificationError: naming the first file that differs and how.
    """
    for name, (size, digest) in expected.items():
        check_listed_file(folder / name, size, digest, "the manifest", "an export folder")


def check_export_checksums(folder: Path) -> bool:
    """The sha256 of every file ``folder``'s ``manifest.json`` lists, for a command whose verdict
    rests on the numbers (``parity``): a damaged weight gave logits close enough to pass. No manifest,
    or one without a ``files`` listing that another tool wrote: nothing to check, False; True once
    checked.

    Raises:
        VerificationError: an unreadable manifest, a ``files`` listing that is malformed, or missing
            from a manifest gemma-export wrote (its ``tool`` field names it: every export of it lists
            its files, and parity passed such a folder unchecked), or the first listed file that differs.
    """
    if not (folder / MANIFEST_FILE).is_file():
        return False
    try:
        manifest = read_manifest(folder)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    if nothing_listed(manifest):
        return False
    check_listed_files_against(folder, listed_files(manifest.get("files"), folder / MANIFEST_FILE, nested=False))
    return True


def verify_manifest(folder: str | Path) -> dict[str, int]:
    """Re-check an export folder against its ``manifest.json``: every listed file present with its
    size and sha256, no unlisted file, external data only inside the folder, then
    :func:`verify_folder` (ONNX checker + onnxruntime load).

    Returns:
        file name → size in bytes of the verified files.

    Raises:
        SourceNotFoundError: no such folder (or a file, or a bundle folder), or no manifest in it.
        GemmaExportError: the folder's path is not valid UTF-8.
        VerificationError: naming the first file that differs and how; an unreadable or malformed
            manifest, graph, sliding-window metadata, ``tokenizer.json`` or ``genai_config.json``;
            a ``manifest.json`` that is a link; files the manifest does not list (a
            ``prepacked/`` copy excepted); leftovers of an interrupted ``prepack``, or a ``prepack``
            running on the folder.
        OSError: a listed file cannot be read while hashing it (permissions, I/O error).
    """
    check_arguments("verify_manifest", folder=(folder, "path"))
    folder = Path(folder)
    manifest_path = folder / MANIFEST_FILE
    require_folder(folder, MANIFEST_FILE)
    if (what := non_regular(manifest_path)) is not None:
        raise VerificationError(f"{manifest_path}: is {what}; expected the export's manifest file")
    if manifest_path.is_symlink():  # as every listed file: a link's target can change under the checksums
        raise VerificationError(f"{manifest_path}: is a link; an export folder holds regular files only")
    if not manifest_path.is_file():
        # the folder by its full name when given as "." (the message would otherwise read "manifest.json")
        shown_path = shown_folder(folder) / MANIFEST_FILE
        if (folder / BUNDLE_MODEL_DIR / MANIFEST_FILE).is_file():  # a board folder that lost its listing
            raise SourceNotFoundError(f"{shown_folder(folder) / BUNDLE_MANIFEST}: missing, though "
                                      f"{BUNDLE_MODEL_DIR}/{MANIFEST_FILE} is there as in a board folder of `bundle`; "
                                      f"verify the export alone with `gemma-export verify "
                                      f"{shown_folder(folder) / BUNDLE_MODEL_DIR}`, or write the bundle again")
        raise SourceNotFoundError(f"{shown_path}: missing; not a gemma-export folder")
    try:
        manifest = read_manifest(folder)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    expected = listed_files(manifest.get("files"), manifest_path, nested=False)

    try:
        check_manifest_fields(manifest, manifest_path, config_required=True)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    check_listed_files_against(folder, expected)
    check_no_prepack_leftovers(folder)
    # prepacked/ is a machine-specific copy `gemma-export prepack` derives from these files
    # (gemma_export/prepack.py); it is checked against them when loaded, not listed here, and only
    # a copy prepack wrote is one (nothing but its graph, data and record)
    if problem := prepack_owned_problem(folder / PREPACKED_DIR):  # "" when absent
        raise VerificationError(f"{folder / PREPACKED_DIR}: {problem}" + unreadable_or(
            problem, "; not a copy gemma-export wrote, nor part of the export: move it away"))
    extra = sorted(p.name for p in folder.iterdir() if p.name not in expected and p.name not in (MANIFEST_FILE,
                                                                                                PREPACKED_DIR))
    if extra:
        hint = ("; a tokenizer belongs in the export through --tokenizer (export again with it)"
                if any(name.startswith("tokenizer") or name in ("special_tokens_map.json", "chat_template.jinja")
                       for name in extra) else "")
        raise VerificationError(f"{folder}: files not in the manifest: {', '.join(extra)}{hint}")
    try:
        model = read_graph(folder / MODEL_FILE)  # once, for the manifest's config and the external data
        vocab, layers = graph_vocab_and_layers(model)
        if "dtype" not in manifest:
            raise VerificationError(f"{manifest_path}: no field 'dtype'; expected {graph_dtype(model)}, the weights "
                                    f"{MODEL_FILE} stores")
        check_manifest_against_model(manifest, manifest_path, model)
        _check_tied(manifest, manifest_path, model, vocab)
        # the sliding-window metadata the runtime checks against the manifest before it generates
        takes_start = any(i.name == SLIDING_CACHE_START for i in model.graph.input) and \
            any(t.name == SLIDING_CACHE_START for t in model.graph.initializer)
        sliding_layers_from({m.key: m.value for m in model.metadata_props}, takes_start, folder / MODEL_FILE,
                            layers, manifest.get("config"))
        locations = check_external_data(model, folder / MODEL_FILE)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    unlisted = sorted(set(locations) - set(expected))
    if unlisted:
        raise VerificationError(f"{folder / MODEL_FILE}: external data in {', '.join(unlisted)}, which the manifest does not list")
    try:  # files whose checksums match but that no reader takes: generate's tokenizer, the board's genai config
        if "tokenizer.json" in expected:
            read_tokenizer_json(folder / "tokenizer.json")
        genai_model_config(folder)
    except FormatError as exc:
        raise VerificationError(str(exc)) from None
    verify_folder(folder)
    return {name: size for name, (size, _) in expected.items()}
