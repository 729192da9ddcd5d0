"""Run an exported folder with onnxruntime: one forward step, greedy decoding, text generation.

Inputs follow the export's I/O contract (see ``builder.py``). Generation keeps the KV cache in a
:class:`KVCache`: for this toolkit's exports one onnxruntime buffer per cache tensor, bound as both
``past_key_values.*`` and ``present.*`` (GroupQueryAttention appends in place), the sliding layers'
buffers holding their window − 1 rows plus up to :data:`SLIDING_ROOM` (the graph's optional
``sliding_cache_start`` input says where their rows start); for other
graphs numpy arrays fed back step by step (``present.*`` of one step become ``past_key_values.*`` of
the next), which is also what :meth:`OnnxDecoder.forward` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import mmap
import operator
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .config import (DEFAULT_STOP_TOKEN_IDS, SLIDING, SLIDING_CACHE_START, SLIDING_LAYERS_KEY,
                     SLIDING_WINDOW_KEY)
from .errors import (ConfigError, FormatError, GemmaExportError, NumericError, OutputError, ResourceError,
                     SourceNotFoundError, check_arguments, first_line, is_whole_number, out_of_memory_line, shown, shown_error,
                     shown_folder)
from .manifest import (TOKEN_IDS, check_listed_files, check_manifest_against_graph, check_manifest_against_model,
                       check_manifest_fields, graph_table_rows, is_prepacked_copy, is_token_ids, manifest_figure,
                       read_manifest, require_folder)
from .onnx_files import MANIFEST_FILE, MODEL_FILE, PREPACKED_DIR, PREPACKED_MANIFEST, graph_dtype, load_graph
from .staging import check_outside_outputs
from . import memory
from .memory import release_free_heap
from .text_files import non_regular, not_unicode_at, read_bounded


#: Prompt tokens per prefill step unless told otherwise (``generate``, ``bench``, :meth:`OnnxDecoder.greedy`).
#: onnxruntime's CPU ``GroupQueryAttention`` holds a step's attention scores, heads × step × context
#: float32, so the step sets the peak: a 3,072-token prompt in one step peaked at 1,289 MB, in steps
#: of 512 tokens at 815 MB (``docs/benchmarks.md``, int8, 2026-12-06; :class:`KVCache` gives the
#: arena's prompt buffers back at the first decode step). fp32 logits are the same to float rounding (≤ 4e-5); int8 ones
#: move by up to ~0.7 with the step (activations rounded to 8 bits). llama.cpp's default batch is 512 tokens too.
DEFAULT_PREFILL_CHUNK = 512

#: Room a sliding layer's cache keeps beyond its window - 1 rows when it drops the rows that left
#: the window (:class:`KVCache`): one drop per this many decode steps. Each step reads window + up
#: to this many rows instead of the whole past; each drop moves window - 1 rows. 64 bounds both:
#: for Gemma 3's window of 512, at most 12.5% more rows read than the window's, and the drop's
#: 511-row move spread over 64 steps (8 rows a step, against the 512 or more each step reads).
SLIDING_ROOM = 64

#: onnxruntime run option (``RunOptions.add_run_config_entry``): at the end of the run, the CPU
#: arena gives the regions no live tensor uses back to the allocator (:class:`KVCache` after a prompt)
ARENA_SHRINKAGE = ("memory.enable_memory_arena_shrinkage", "cpu:0")


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Greedy generation output.

    Attributes:
        prompt_ids: token ids of the prompt (with ``<bos>``).
        new_ids: generated ids (stops after an end-of-turn / eos id, which is included).
        text: the new tokens' text as :class:`TextStream` gives it (the tokenizer's decode, except
            where that decode turns characters before a cut-off byte run into U+FFFD), special
            tokens included unless :func:`generate` was told otherwise, never the stop id that
            ended the generation.
        prefill_ms: time of the prompt's steps (all its chunks) and the pick of the first new token,
            milliseconds.
        decode_ms: time of each following step, milliseconds (the first also gives the prompt's
            activation memory back: ``KVCache``).
        prepacked: whether the session loaded the folder's pre-packed copy.
        prepacked_note: why the copy was or was not used ("" when there is none).
        dtype: the graph's weights (``fp32``, ``bf16``, ``int8``, ``int4``).
        unknown_tokens: control-token-like text of the prompt (``<start_of_turn>``, …) that this
            tokenizer reads as plain text (:func:`unknown_control_tokens`).
        other_cpus: CPUs' worth of work other processes did while the prompt and the steps ran
            (:func:`gemma_export.bench.other_cpus`; the session's creation left out), None where it
            cannot be measured: the times are this model's alone only when it is near 0.
    """

    prompt_ids: list[int]
    new_ids: list[int]
    text: str
    prefill_ms: float
    decode_ms: list[float]
    prepacked: bool = False
    prepacked_note: str = ""
    dtype: str = ""
    unknown_tokens: list[str] = dataclasses.field(default_factory=list)
    other_cpus: float | None = None


#: text that looks like a Gemma / FunctionGemma control token: <start_of_turn>, <end_function_call>, <escape>
CONTROL_TOKEN_TEXT = re.compile(r"<(?:start|end)_[a-z_]+>|<escape>")
#: FunctionGemma's function-calling tokens (its chat template), which Gemma 3's tokenizer lacks
FUNCTION_GEMMA_TOKENS = frozenset(f"<{edge}_function_{kind}>" for edge in ("start", "end")
                                  for kind in ("declaration", "call", "response")) | {"<escape>"}


def encode_prompt(tokenizer, text: str, max_tokens: int | None = None, what: str = "the prompt",
                  limit: str = "the model's max_position_embeddings") -> list[int]:
    """The prompt's token ids as ``generate`` and ``parity`` feed them: ``<bos>`` (what the
    tokenizer's post-processor prepends) once, also when the text already starts with it, as a chat
    template's output does (transformers would then give two).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (the export's ``tokenizer.json``).
        text: the prompt.
        max_tokens: when given (the model's ``max_position_embeddings``), a text of more than
            ``max_tokens + 1`` tokens (more than ``max_tokens`` even if a doubled ``<bos>`` is
            dropped) is refused after tokenizing only a prefix of it
            (:func:`~gemma_export.text_files.first_tokens`): a tokenizer holds about 100–400 bytes
            per character of the text it encodes whole. The caller's exact length check does the rest.
        what: names the prompt in that error, e.g. ``"prompts.txt: prompt #3"``.
        limit: names ``max_tokens`` in it (:func:`limit_name`).

    Returns:
        The ids (Python ints).

    Raises:
        GemmaExportError: more than ``max_tokens + 1`` tokens.
    """
    ids = None
    if max_tokens is not None:
        from .text_files import first_tokens

        # max_tokens + 2 ids: still more than max_tokens once a text's own leading <bos> is not doubled
        ids = first_tokens(tokenizer, text, max_tokens + 2)
        if len(ids) > max_tokens + 1:
            raise GemmaExportError(f"{what}: more than {max_tokens:,} tokens, {limit}; give a shorter prompt")
        # fewer ids than first_tokens was asked for: they are the whole text's (it encoded all of it)
    if ids is None:
        ids = tokenizer.encode(text).ids
    own = tokenizer.encode(text, add_special_tokens=False).ids
    if own and len(ids) == len(own) + 1 and ids[1:] == own and ids[0] == own[0]:
        return own  # the text's own leading <bos>, not a second one
    return ids


def unknown_control_tokens(tokenizer, text: str) -> list[str]:
    """Pieces of ``text`` that look like control tokens (:data:`CONTROL_TOKEN_TEXT`) but are not
    tokens of ``tokenizer``, which reads them as plain text: FunctionGemma's function-calling tokens
    (``<start_function_declaration>`` …) with another Gemma 3 tokenizer, or a misspelt one. In order
    of first appearance, each once."""
    found = dict.fromkeys(m.group(0) for m in CONTROL_TOKEN_TEXT.finditer(text))
    return [piece for piece in found if tokenizer.token_to_id(piece) is None]


#: rows of logits per chunk of :meth:`OnnxDecoder.teacher_forced_chunks` (and compared at a time by
#: ``quality``, which holds one chunk per model): 128 × 262,144 float32 = 134 MB
CHUNK_ROWS = 128


def positions_needed(prompt_tokens: int, new_tokens: int) -> int:
    """Cache positions a greedy run of ``new_tokens`` after ``prompt_tokens`` occupies: every prompt
    token and every new token but the last, which is returned and never fed back (both counts in
    tokens; ``new_tokens`` ≤ 0 counts as 0)."""
    return prompt_tokens + max(new_tokens - 1, 0)


#: how :func:`check_positions` names a generation's sequence (the prompt and the new tokens fed back)
GENERATED = "tokens (the prompt and the new tokens fed back)"


def check_positions(model_dir: str | Path, total_tokens: int, max_position_embeddings: int | None,
                    what: str = GENERATED) -> None:
    """Raises GemmaExportError when a sequence of ``total_tokens`` positions (by default the prompt and
    the new tokens fed back, :func:`positions_needed`; ``what`` names other sequences, e.g.
    "teacher-forced ids") exceeds ``max_position_embeddings`` (None: no check).

    Raises:
        GemmaExportError: naming ``model_dir``, the length and the limit.
    """
    if max_position_embeddings and total_tokens > max_position_embeddings:
        raise GemmaExportError(f"{model_dir}: a sequence of {total_tokens} {what} exceeds {limit_name(model_dir)} "
                               f"{max_position_embeddings}")


def check_new_tokens(max_new_tokens: int, where: str) -> None:
    """Raises ConfigError ``"{where}: max_new_tokens must be >= 0, found N"`` for a negative count
    (ConfigError for one that is no int, :func:`~gemma_export.errors.check_arguments`).

    Raises:
        ConfigError: as above.
    """
    check_arguments(where, max_new_tokens=(max_new_tokens, "int"))
    if max_new_tokens < 0:
        raise ConfigError(f"{where}: max_new_tokens must be >= 0, found {max_new_tokens}")


def genai_model_config(model_dir: Path) -> dict:
    """The ``model`` object of an onnxruntime-genai ``genai_config.json`` (``vocab_size``,
    ``eos_token_id``, ``decoder``); ``{}`` when the folder has none. Read only for what a folder of
    another tool lacks in a manifest.

    Raises:
        FormatError: the file is not a regular file (a FIFO would block the read), not UTF-8 JSON,
            or has no ``model`` object.
    """
    path = model_dir / "genai_config.json"
    if (what := non_regular(path)) is not None:
        raise FormatError(f"{path}: is {what}; expected onnxruntime-genai's JSON configuration")
    if not path.exists():
        return {}
    try:
        config = json.loads(read_bounded(path, "onnxruntime-genai's JSON configuration").decode("utf-8"))["model"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise FormatError(f"{path}: unreadable onnxruntime-genai configuration "
                          f"({'no model object' if isinstance(exc, (KeyError, TypeError)) else exc})") from None
    if not isinstance(config, dict):
        raise FormatError(f"{path}: field 'model' must be an object, found {shown(config)}")
    return config


def _genai_decoder_config(model_dir: Path) -> dict:
    decoder = genai_model_config(model_dir).get("decoder")
    return decoder if isinstance(decoder, dict) else {}


def genai_context_length(model_dir: Path) -> int | None:
    """``model.context_length`` of an onnxruntime-genai ``genai_config.json``: the positions its
    graph takes (its GroupQueryAttention's ``cos_cache`` rows; a longer sequence fails mid-run in
    onnxruntime). None when the folder has no such file or the file no such field.

    Raises:
        FormatError: the field is not a positive integer below 2**31 (int32 positions), or the file
            is unreadable (:func:`genai_model_config`).
    """
    config = genai_model_config(model_dir)
    if "context_length" not in config:
        return None
    value = config["context_length"]
    if not (is_whole_number(value) and 0 < value < 2 ** 31):
        raise FormatError(f"{model_dir / 'genai_config.json'}: field 'model.context_length' must be a positive integer "
                          f"below 2**31 (int32 positions), found {shown(value)}")
    return value


def limit_name(model_dir: str | Path) -> str:
    """How messages name the positions limit of an export folder: "the model's
    max_position_embeddings" (its manifest's ``config``), or for a folder of onnxruntime-genai (no
    ``manifest.json``) its ``genai_config.json``'s ``model.context_length`` (:func:`max_positions`)."""
    model_dir = Path(model_dir)
    if (model_dir / MANIFEST_FILE).exists() or not (model_dir / "genai_config.json").is_file():
        return "the model's max_position_embeddings"
    return f"{model_dir / 'genai_config.json'}'s model.context_length"


def max_positions(model_dir: str | Path) -> int | None:
    """The positions an export takes, read before its (slow) session load as
    :class:`OnnxDecoder` takes its ``max_position_embeddings``: the manifest's
    (:func:`~gemma_export.manifest.manifest_figure`: None when it lacks the field or the manifest is
    damaged, which the session load names), or, for a folder of onnxruntime-genai (no
    ``manifest.json``), ``genai_config.json``'s ``model.context_length`` (:func:`genai_context_length`).

    Raises:
        FormatError: a folder without a manifest whose ``genai_config.json`` is unreadable or gives
            a malformed ``context_length``.
    """
    model_dir = Path(model_dir)
    try:
        manifested = read_manifest(model_dir) != {}
    except FormatError:
        return None
    return manifest_figure(model_dir, "max_position_embeddings") if manifested else genai_context_length(model_dir)


def _folder_identity(folder: Path) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``folder``, None when it is gone: a writer's output moved in by a
    rename is another inode."""
    try:
        st = folder.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_export_folder(model_dir: str | Path) -> Path:
    """The path of ``model_dir``'s ``model.onnx``, after checking that the folder exists and holds one.

    Raises:
        SourceNotFoundError: no such folder, a file instead of a folder, a bundle folder, or no
            ``model.onnx`` in it.
        FormatError: ``model.onnx`` is a folder, a FIFO or a broken link.
        GemmaExportError: the path is not valid UTF-8.
    """
    model_dir = Path(model_dir)
    path = model_dir / MODEL_FILE
    require_folder(model_dir, MODEL_FILE)
    if (what := non_regular(path)) is not None:  # there, but not a file: named, not taken for absent
        raise FormatError(f"{path}: is {what}; expected the export's ONNX graph")
    if not path.is_file():
        try:  # an export may be written into an empty folder, not a full one
            empty = not any(model_dir.iterdir())
        except OSError:  # a folder that cannot be listed: the plain hint
            empty = True
        hint = (f"run `gemma-export --out {model_dir}` first" if empty else
                "give the folder an export wrote, e.g. ./gemma-3-270m-onnx-int8, or export into a new folder "
                "with `gemma-export --out DIR`")
        raise SourceNotFoundError(f"{shown_folder(model_dir) / MODEL_FILE}: no exported model here ({hint})")
    return path


class OnnxDecoder:
    """An exported model loaded in onnxruntime (``CPUExecutionProvider``).

    Args:
        model_dir: an export folder (``model.onnx`` + ``model.onnx.data``).
        threads: intra-op threads, 1 to 4 × this machine's CPUs (None: onnxruntime's default).
        optimized_model_path: if set, onnxruntime writes its optimized graph there (used to prove
            that one table remains after its constant folding and pre-packing): a path outside
            every output of this toolkit (:func:`check_optimized_model_path`).
        prepacked: which graph onnxruntime loads. ``None`` (default): the folder's pre-packed copy
            (``prepacked/``, :mod:`gemma_export.prepack`) when it was made on this machine from
            these files, else ``model.onnx``; ``False``: always ``model.onnx``; ``True``: the copy,
            or an error saying why it cannot be used; a path: the ``model.onnx`` of a copy in a
            folder of ``model_dir`` (``prepacked/``, or :func:`gemma_export.prepack.prepack`'s
            staging folder), used as it is.
            ``optimized_model_path`` implies ``False``. The logits are the same either way; the copy
            maps the packed weights from disk instead of building them on the heap.
        huge_pages: when the weights are packed on the heap, move them onto transparent huge
            pages after session creation (:func:`gemma_export.memory.collapse_to_huge_pages`;
            Linux ≥ 6.1, else nothing happens). Same logits; fewer TLB misses per decode step.

    Attributes:
        session: the ``onnxruntime.InferenceSession``.
        manifest: the folder's ``manifest.json`` (``{}`` for a folder of another tool).
        dtype: the graph's weights: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        vocab_size, num_hidden_layers, num_key_value_heads, head_dim: read from the graph's inputs
            and outputs (a symbolic one from the manifest or ``genai_config.json``).
        max_position_embeddings: the manifest's; for a folder of onnxruntime-genai (no manifest),
            its ``genai_config.json``'s ``model.context_length``; None when neither gives it (no
            length check).
        sliding_layers, sliding_window: the layers whose caches may drop rows outside the window,
            and the window in positions (``()`` and None for graphs without ``sliding_cache_start``).
        shares_kv_buffer: the graph reads and writes one KV buffer per layer (``KVCache``).
        eos_token_id: the ids that stop generation (tuple): the manifest's, else a
            ``genai_config.json``'s ``model.eos_token_id``, else Gemma's (``DEFAULT_STOP_TOKEN_IDS``).
        prepacked_path: the pre-packed ``model.onnx`` in use, or None.
        prepacked_note: why the folder's copy is or is not used ("" when there is none).
        huge_page_bytes: bytes moved onto huge pages after session creation (0: none).

    Raises:
        SourceNotFoundError: no such folder, or no ``model.onnx`` in it (:func:`check_export_folder`).
        GemmaExportError: ``prepacked=True`` and the copy cannot be used here; ``threads`` out of
            range (:func:`check_threads`).
        ConfigError: ``prepacked`` a path that is not a ``model.onnx`` in a folder of ``model_dir``;
            an argument of the wrong type (:func:`~gemma_export.errors.check_arguments`), or an
            ``optimized_model_path`` that is a folder.
        OutputError: ``optimized_model_path`` is a file of the export, or lies inside an export,
            bundle or pre-packed copy (:func:`check_optimized_model_path`), refused before the session
            writes it.
        FormatError: onnxruntime cannot load the model, or (``prepacked`` True or a path) the copy;
            with the default, a copy that fails to load is skipped with a note instead. Also: an
            unreadable graph or manifest, a data file whose size differs from the manifest's
            (:func:`~gemma_export.manifest.check_listed_files`), inputs that are not the decoder contract, a symbolic
            ``head_dim`` no ``genai_config.json`` gives, a manifest field that is malformed or
            contradicts the graph (:func:`~gemma_export.manifest.check_manifest_fields`, :func:`~gemma_export.manifest.check_manifest_against_graph`),
            sliding-window metadata that is malformed or disagrees with the manifest, or a
            ``genai_config.json`` ``context_length`` that is no positive integer (:func:`genai_context_length`).
        OSError: a data file listed in the manifest cannot be opened (:func:`~gemma_export.manifest.check_listed_files`).
        GemmaExportError: in place of any of these, when the folder was replaced (by another
            export's rename) while it was being loaded.
    """

    def __init__(self, model_dir: str | Path, threads: int | None = None, optimized_model_path: str | Path | None = None,
                 prepacked: bool | str | Path | None = None, huge_pages: bool = True):
        check_arguments("OnnxDecoder", model_dir=(model_dir, "path"), threads=(threads, "int?"),
                        optimized_model_path=(optimized_model_path, "path?"), huge_pages=(huge_pages, "bool"))
        if not (prepacked is None or isinstance(prepacked, (bool, str, os.PathLike))):
            raise ConfigError(f"OnnxDecoder(): prepacked must be True, False, None or a path, found "
                              f"{type(prepacked).__name__} {prepacked!r:.40}")
        if not (prepacked is None or isinstance(prepacked, bool)):
            check_arguments("OnnxDecoder", prepacked=(prepacked, "path"))  # not empty, no NUL
        if optimized_model_path is not None and Path(optimized_model_path).is_dir():
            raise ConfigError(f"OnnxDecoder(): optimized_model_path {optimized_model_path} is a folder; expected the "
                              "path of a file to write")
        self.model_dir = Path(model_dir)
        path = check_export_folder(self.model_dir)
        if optimized_model_path is not None:  # onnxruntime writes it as the session is created, unchecked
            check_optimized_model_path(self.model_dir, Path(optimized_model_path))
        before = _folder_identity(self.model_dir)
        try:
            self._load(path, threads, optimized_model_path, prepacked, huge_pages)
        except (GemmaExportError, OSError):
            # an export that replaced the folder meanwhile (its rename is atomic, this reading of several
            # files is not) mixes two exports' files: "dtype is int8, but the graph stores int4" would
            # send the user looking for a damaged export
            if _folder_identity(self.model_dir) != before:
                raise GemmaExportError(f"{self.model_dir}: replaced or moved while it was being loaded (another "
                                       "gemma-export writing it?); run again") from None
            raise

    def _load(self, path: Path, threads, optimized_model_path, prepacked, huge_pages) -> None:
        """:meth:`__init__`'s reading of the folder, graph and session (its arguments, as given)."""
        from . import prepack as prepack_copy

        self.manifest = read_manifest(self.model_dir)
        check_listed_files(self.manifest, self.model_dir)  # first: "the folder changed after the export" says most
        graph = load_graph(path)  # a readable graph whose external data are files of this folder
        #: the weights the graph stores (fp32, bf16, int8, int4), whatever the manifest says
        self.dtype = graph_dtype(graph)
        # a hand-edited manifest is named before the (slow) session; the session's figures are checked again below
        check_manifest_fields(self.manifest, self.model_dir / MANIFEST_FILE)
        try:
            table_rows = graph_table_rows(graph)  # the vocabulary where the logits' dimension is symbolic
            check_manifest_against_model(self.manifest, self.model_dir / MANIFEST_FILE, graph)
        except TypeError:  # protobuf gives a name that is not UTF-8 as bytes: create_session names it below
            table_rows = None
        del graph
        self.prepacked_path, self.prepacked_note = None, ""
        copy_dir = self.model_dir / prepack_copy.PREPACKED_DIR
        if optimized_model_path is not None or prepacked is False:
            if copy_dir.exists() and optimized_model_path is None:
                self.prepacked_note = f"pre-packed copy {copy_dir} not used (--no-prepacked)"
        elif isinstance(prepacked, (str, os.PathLike)):
            self.prepacked_path = _copy_of(self.model_dir, Path(prepacked))
        else:
            found = prepack_copy.status(self.model_dir)
            self.prepacked_path, self.prepacked_note = found.path, found.reason
            if prepacked is True and found.path is None:
                raise GemmaExportError(f"cannot use the pre-packed copy: {found.problem}" if found.problem else
                                       f"{copy_dir}: no pre-packed copy (run gemma-export prepack --model {self.model_dir})")
        if self.prepacked_path is not None:
            try:
                load_graph(self.prepacked_path)
                self.session = create_session(self.prepacked_path, threads)
            except FormatError as exc:  # a damaged copy: from load_graph, or onnxruntime's own error
                message = str(exc)
                problem = (f"{self.prepacked_path}: onnxruntime cannot load it ({message.split(_CANNOT_LOAD, 1)[1]})"
                           if _CANNOT_LOAD in message else message)  # load_graph's own message names the file
                if prepacked is not None:  # required, or a path given: no silent fallback
                    raise FormatError(f"{problem}; run gemma-export prepack --model {self.model_dir} again, or with "
                                      "--remove") from None
                self.prepacked_path = None
                self.prepacked_note = (f"{problem}; not used (`gemma-export prepack --model {self.model_dir}` makes a "
                                       "new one)")
        #: bytes of heap moved onto transparent huge pages after session creation (memory.collapse_to_huge_pages)
        self.huge_page_bytes = 0
        if self.prepacked_path is None:
            self.session = create_session(path, threads, optimized_model_path)
            if huge_pages:  # the weights onnxruntime just packed on the heap: fewer TLB misses per step
                self.huge_page_bytes = memory.collapse_to_huge_pages()
        else:
            path = self.prepacked_path
        #: the graph the session runs: the export's model.onnx, or its pre-packed copy's
        self.graph_path = path
        release_free_heap()  # what loading freed (graph, tokenizer, onnxruntime's transient buffers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self._input_names = tuple(inputs)
        #: whether the graph takes position_ids (this toolkit's); onnxruntime-genai's count each
        #: row's positions from its attention_mask, so their batches are padded on the right
        self.takes_position_ids = "position_ids" in self._input_names
        self.num_hidden_layers = check_decoder_contract(path, inputs, self.session.get_outputs())
        _, self.num_key_value_heads, _, self.head_dim = inputs["past_key_values.0.key"].shape
        # symbolic in onnxruntime-genai graphs: their config has them (the KV cache's buffers are sized from them)
        if not isinstance(self.head_dim, int):
            self.head_dim = self._genai_dimension(path, "head_size", "head_dim")
        if not isinstance(self.num_key_value_heads, int):
            self.num_key_value_heads = self._genai_dimension(path, "num_key_value_heads", "kv-heads dimension")
        self.vocab_size = next(o for o in self.session.get_outputs() if o.name == "logits").shape[-1]
        if not isinstance(self.vocab_size, int):  # symbolic: the table's rows, else the manifest's or genai's config
            configured = (self.manifest.get("config", {}).get("vocab_size")
                          or genai_model_config(self.model_dir).get("vocab_size"))
            self.vocab_size = table_rows or configured
            if not is_whole_number(self.vocab_size) or self.vocab_size <= 0:
                raise FormatError(f"{path}: the logits output has a symbolic vocabulary dimension and neither "
                                  "manifest.json nor genai_config.json gives vocab_size")
            if table_rows and configured and configured != table_rows:
                raise FormatError(f"{self.model_dir / 'genai_config.json'}: field 'model.vocab_size' is {configured}, "
                                  f"but the graph's embedding table has {table_rows} rows")
        manifest = self.model_dir / MANIFEST_FILE  # its fields were checked before the session
        check_manifest_against_graph(self.manifest, manifest, self.vocab_size, self.num_hidden_layers, self.dtype,
                                     (self.num_key_value_heads, self.head_dim))
        # a folder of onnxruntime-genai has no manifest: its config gives its graph's context (max_positions)
        self.max_position_embeddings = (self.manifest.get("config", {}).get("max_position_embeddings") if self.manifest
                                        else genai_context_length(self.model_dir))
        #: layers whose caches may drop the rows outside their window, and that window (positions):
        #: read from the graph (its metadata and its optional ``sliding_cache_start`` input)
        self.sliding_layers, self.sliding_window = _sliding_layers(self.session, path, self.num_hidden_layers,
                                                                   self.manifest.get("config", {}))
        kv_cache = self.manifest.get("kv_cache")
        self.shares_kv_buffer = isinstance(kv_cache, dict) and kv_cache.get("past_present_share_buffer") is True
        eos = self.manifest.get("config", {}).get("eos_token_id")
        if eos is None:  # a folder of another tool: onnxruntime-genai's config names its stop ids
            genai = genai_model_config(self.model_dir)
            eos = genai.get("eos_token_id", DEFAULT_STOP_TOKEN_IDS)
            if "eos_token_id" in genai and not is_token_ids(eos):
                raise FormatError(f"{self.model_dir / 'genai_config.json'}: field 'model.eos_token_id' must be "
                                  f"{TOKEN_IDS}, found {shown(eos)}")
        self.eos_token_id = (eos,) if isinstance(eos, int) else tuple(eos)

    def _genai_dimension(self, path: Path, key: str, what: str) -> int:
        """A dimension of the cache inputs the graph leaves symbolic (``what``, for the message), from
        ``genai_config.json``'s ``model.decoder.<key>``.

        Raises:
            FormatError: no positive integer there (``true`` is no size).
        """
        value = _genai_decoder_config(self.model_dir).get(key)
        if not is_whole_number(value) or value <= 0:
            raise FormatError(f"{path}: past_key_values.0.key has a symbolic {what} and no genai_config.json says {key}")
        return value

    def empty_cache(self, batch_size: int) -> dict[str, np.ndarray]:
        """Zero-length ``past_key_values.*`` for a prefill step: float32
        ``[batch_size, num_key_value_heads, 0, head_dim]`` for each layer's key and value.

        Raises:
            ConfigError: ``batch_size`` is no int, or < 1.
        """
        check_arguments("empty_cache", batch_size=(batch_size, "int"))
        if batch_size < 1:
            raise ConfigError(f"empty_cache(): batch_size must be >= 1, found {batch_size}")
        shape = (batch_size, self.num_key_value_heads, 0, self.head_dim)
        return {f"past_key_values.{i}.{kind}": np.zeros(shape, np.float32)
                for i in range(self.num_hidden_layers) for kind in ("key", "value")}

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                past: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """One step. Shapes: ``input_ids``/``position_ids`` int64 ``[B, S]``, ``attention_mask`` int64
        ``[B, past + S]``, ``past`` float32 ``[B, kv_heads, past, head_dim]`` per
        ``past_key_values.{i}.key|value`` (:meth:`empty_cache` for the first step). With ``B`` > 1 and
        ``past`` > 0, ``S`` must be 1: onnxruntime's ``GroupQueryAttention`` refuses more
        (``InvalidArgument``; prefill a batch from an empty cache).

        Returns:
            ``(logits, next past)``: logits float32 ``[B, 1, vocab]`` (``[B, S, vocab]`` for an
            ``all_logits`` export or a graph of another exporter that returns every position), and
            the ``present.*`` outputs renamed ``past_key_values.*``,
            float32 ``[B, kv_heads, past + S, head_dim]``.

        Raises:
            ConfigError: ``past`` is no dict, or lacks a ``past_key_values.*`` input of the graph.
            FormatError: an integer array of ``input_ids`` holds an id outside ``0 … vocab_size - 1``
                (onnxruntime's ``Gather`` takes a negative id as counted from the table's end, and
                gave another token's logits without a word); an integer or bool ``attention_mask``
                that is not left padding, or holds values other than 0 and 1 (only those for a graph
                of onnxruntime-genai, padded on the right: :func:`check_left_padding`).
            onnxruntime's own exceptions (e.g. ``InvalidArgument``, ``Fail``), unwrapped: wrong
                shapes or dtypes (a step of no tokens, 1-D arrays).
        """
        self._check_past(past)
        if isinstance(attention_mask, np.ndarray) and attention_mask.dtype.kind in "iub" and attention_mask.ndim == 2:
            check_left_padding(attention_mask, f"{self.model_dir}: forward()", self.takes_position_ids)
        if isinstance(input_ids, np.ndarray) and input_ids.dtype.kind in "iu" and input_ids.size:
            outside = np.argwhere((input_ids < 0) | (input_ids >= self.vocab_size))
            if outside.size:
                at = tuple(int(i) for i in outside[0])
                raise FormatError(f"{self.model_dir}: forward(): input_ids{list(at)} is {int(input_ids[at])}, outside "
                                  f"the export's vocabulary (0 to {self.vocab_size - 1})")
        outputs = self.session.run(None, self._feeds(input_ids, attention_mask, position_ids, past))
        named = dict(zip((o.name for o in self.session.get_outputs()), outputs))
        present = {name.replace("present.", "past_key_values.", 1): value
                   for name, value in named.items() if name.startswith("present.")}
        return named["logits"], present

    def _check_past(self, past) -> None:
        """Raises ConfigError unless ``past`` is a dict holding every ``past_key_values.*`` input of
        the graph (a missing one would be a ``KeyError`` in :meth:`_feeds`)."""
        expected = (f"a dict of past_key_values.{{i}}.key|value for layers 0 to {self.num_hidden_layers - 1} "
                    "(empty_cache(batch_size) for the first step)")
        if not isinstance(past, dict):
            raise ConfigError(f"forward(): past must be {expected}, found {type(past).__name__}")
        missing = next((name for name in self._input_names if name.startswith("past_key_values.") and name not in past),
                       None)
        if missing is not None:
            found = "an empty dict" if not past else f"a dict of {len(past)} entries without {missing}"
            raise ConfigError(f"forward(): past must be {expected}, found {found}")

    def _feeds(self, input_ids, attention_mask, position_ids, past) -> dict[str, np.ndarray]:
        # Models from other exporters (e.g. onnxruntime-genai's GroupQueryAttention graphs) may not
        # take every input: feed the ones the graph declares.
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids, **past}
        return {name: feeds[name] for name in self._input_names}

    def prefill_outputs(self, token_ids: Sequence[int], names: Sequence[str]) -> dict[str, np.ndarray]:
        """Run one prefill step on ``token_ids`` (batch 1, empty cache) and return the named graph
        outputs (e.g. the ``debug.layers.*`` outputs of a ``--debug-outputs`` export).

        Args:
            token_ids: ``T ≥ 1`` ids, positions 0…T−1, each inside the vocabulary.
            names: graph output names.

        Returns:
            name → the output's array (``debug.layers.*``: float32 ``[1, T, hidden_size]``).

        Raises:
            ConfigError: ``token_ids`` that is no sequence or 1-D array, ``names`` that is no list or
                tuple of str (a str alone would be read as its characters).
            FormatError: a name is not an output of the graph; an id that is no integer or lies
                outside the vocabulary (:meth:`check_ids`).
            GemmaExportError: no ids, or ``T`` exceeds ``max_position_embeddings``.
        """
        check_arguments("prefill_outputs", token_ids=(token_ids, "ids"))
        if not (isinstance(names, (list, tuple)) and all(isinstance(name, str) for name in names)):
            raise ConfigError(f"prefill_outputs(): names must be a list or tuple of output names (str), found "
                              f"{type(names).__name__} {' '.join(repr(names).split()):.40}")
        declared = {o.name for o in self.session.get_outputs()}
        missing = [n for n in names if n not in declared]
        if missing:
            raise FormatError(f"{self.model_dir / MODEL_FILE}: no output {missing[0]!r} (export with --debug-outputs)")
        if len(token_ids) == 0:
            raise GemmaExportError("prefill_outputs: no token ids; give at least one (e.g. <bos>, id 2)")
        self.check_length(len(token_ids), "token ids")
        self.check_ids(token_ids, "prefill_outputs", tokenized=False)
        ids = np.asarray([list(token_ids)], np.int64)
        feeds = self._feeds(ids, np.ones_like(ids), np.arange(ids.shape[1], dtype=np.int64)[None], self.empty_cache(1))
        values = self.session.run(list(names), feeds)
        return dict(zip(names, values))

    def check_ids(self, ids: Sequence[int], what: str, tokenizer=None, tokenized: bool = True) -> None:
        """Raises FormatError naming the folder and ``what`` (e.g. ``prompt``) when an id lies outside
        the graph's vocabulary (onnxruntime's Gather would fail with an index error mid-run instead).

        With ``tokenizer``, the message gives the id's piece too. ``tokenized``: the ids came from the
        export's tokenizer, and the message says it does not match the graph (False: the caller's ids).

        Raises:
            FormatError: the first id that is no integer or not in ``0 … vocab_size - 1``
                (:func:`check_token_ids`).
        """
        check_token_ids(ids, self.vocab_size, f"{self.model_dir}: {what}",
                        "; the tokenizer beside the export does not match its graph" if tokenized else "", tokenizer)

    def check_length(self, total_tokens: int, what: str = GENERATED) -> None:
        """Raises GemmaExportError when a sequence of ``total_tokens`` tokens (positions) would exceed
        ``max_position_embeddings`` (no check when the folder does not give it); ``what`` names the
        sequence in the message (:func:`check_positions`).

        Raises:
            GemmaExportError: ``total_tokens`` > ``max_position_embeddings``.
            ConfigError: ``total_tokens`` is not an int, ``what`` not a str.
        """
        check_arguments("OnnxDecoder.check_length", total_tokens=(total_tokens, "int"), what=(what, "str"))
        check_positions(self.model_dir, total_tokens, self.max_position_embeddings, what)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_ids: Sequence[int] | None = None,
               prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, on_token: Callable[[int], None] | None = None):
        """Greedy decoding of one prompt (argmax, ties → lowest id).

        Args:
            prompt_ids: the prompt's ids (with ``<bos>``), at least one.
            max_new_tokens: tokens to generate at most; 0 returns ``([], 0.0, [])``.
            stop_ids: ids after which decoding stops (included in ``new_ids``); None: the manifest's
                ``eos_token_id`` (or Gemma's defaults); ``()``: never stop early.
            prefill_chunk: run the prompt through the cache in steps of at most this many tokens
                (default :data:`DEFAULT_PREFILL_CHUNK`; None: one step). The logits are the same up
                to float rounding, which an int8 export's 8-bit activations magnify (up to ~0.7 on
                the real 270M); the activation memory onnxruntime's arena keeps after a long prompt
                grows with the step (``docs/benchmarks.md``).
            on_token: called with each new id as soon as it is picked (outside the timed steps).

        Returns:
            ``(new_ids, prefill_ms, decode_ms)``: ``list[int]``; the wall time in milliseconds of the
            prompt step(s) plus the first token's pick; a ``list[float]`` of milliseconds, one per
            later step.

        Raises:
            GemmaExportError: an empty prompt, a negative ``max_new_tokens``, ``prefill_chunk`` < 1,
                or the sequence exceeds ``max_position_embeddings``.
            ConfigError: ``prompt_ids`` that is no sequence or 1-D array (a set, a dict, an iterator),
                ``max_new_tokens`` or ``prefill_chunk`` that is no int, ``stop_ids`` that is no list or
                tuple of ints, ``on_token`` that is not callable.
            FormatError: an id that is no integer or lies outside the vocabulary (:meth:`check_ids`).
            NumericError: the export computes NaN or +Inf logits (:func:`picked_token`).
            ResourceError: the KV cache would not fit in available memory (:class:`KVCache`).
        """
        check_arguments("greedy", prompt_ids=(prompt_ids, "ids"))
        if len(prompt_ids) == 0:
            raise GemmaExportError("greedy: the prompt has no token ids; give at least one (e.g. <bos>, id 2)")
        check_new_tokens(max_new_tokens, "greedy")
        check_arguments("greedy", stop_ids=(stop_ids, "ints?"), prefill_chunk=(prefill_chunk, "int?"),
                        on_token=(on_token, "callable?"))
        check_prefill_chunk(prefill_chunk)
        self.check_ids(prompt_ids, "prompt", tokenized=False)
        stop = set(self.eos_token_id if stop_ids is None else stop_ids)
        positions = positions_needed(len(prompt_ids), max_new_tokens)
        self.check_length(positions)
        ids = np.asarray([list(prompt_ids)], dtype=np.int64)
        cache = KVCache(self, 1, positions, max_step=len(prompt_ids) if prefill_chunk is None else prefill_chunk)
        # one logits buffer for every decode step (not a new 1 MB array each; 1–2 MB less held)
        out = np.empty((1, 1, self.vocab_size), np.float32) if isinstance(self.vocab_size, int) else None
        new_ids: list[int] = []
        timings: list[float] = []
        position = 0
        for _ in range(max_new_tokens):
            start = time.perf_counter()
            chunk = ids.shape[1] if prefill_chunk is None else prefill_chunk
            for first in range(0, ids.shape[1], chunk):
                part = ids[:, first:first + chunk]
                end = position + part.shape[1]
                logits = cache.step(part, np.ones((1, end), np.int64), np.arange(position, end, dtype=np.int64)[None], out)
                position = end
            token = picked_token(logits[0, -1], len(new_ids), model=self.graph_path)
            timings.append((time.perf_counter() - start) * 1e3)
            # the prompt step's logits are an array of their own (1 MB, or [1, S, vocab]): freed now,
            # before the next step's heap trim, not after it (glibc kept the freed 1 MB otherwise)
            logits = None
            new_ids.append(token)
            if on_token is not None:
                on_token(token)
            ids = np.asarray([[token]], dtype=np.int64)
            if token in stop:
                break
        return new_ids, timings[0] if timings else 0.0, timings[1:]

    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy decoding of several prompts at once, left-padded with ``attention_mask`` 0 and
        ``position_ids`` counted over real tokens only; each row gives the tokens it would alone, up
        to rounding: a left-padded row's logits differ from its run alone by float rounding on fp32
        (up to 1e-4) and by up to ~0.36 on int8 and int4 exports (their 8-bit activations magnify
        it; 2026-12-06), so a near-tie there can go the other way. Rows keep decoding after their
        own stop token; callers cut each row at its first stop id. A graph without ``position_ids``
        (onnxruntime-genai's, which counts positions from the mask and so cannot take left padding)
        runs prompts of several lengths one at a time.

        Args:
            prompts: one id list per row (with ``<bos>``), each id inside the vocabulary.
            max_new_tokens: tokens generated per row, exactly (no stop id).

        Returns:
            ``max_new_tokens`` ids per prompt, in order; ``[]`` for no prompts.

        Raises:
            GemmaExportError: an empty prompt (nothing to continue; :meth:`greedy` refuses it too), a
                negative ``max_new_tokens``, or the longest prompt plus the new tokens exceed
                ``max_position_embeddings``.
            ConfigError: ``prompts`` that is no sequence or 2-D array, or a prompt that is no
                sequence or 1-D array of ids.
            FormatError: an id that is no integer or lies outside the vocabulary (:meth:`check_ids`;
                onnxruntime's ``Gather`` would read -5 as the fifth row from the end).
            NumericError: a row's picked logit is NaN or +Inf (:func:`picked_token`, naming the prompt).
            ResourceError: the KV cache would not fit in available memory (:class:`KVCache`).
        """
        check_new_tokens(max_new_tokens, "greedy_batch")
        check_arguments("greedy_batch", prompts=(prompts, "prompts"))
        for row, prompt in enumerate(prompts):
            check_arguments("greedy_batch", **{f"prompts[{row}]": (prompt, "ids")})
        batch = len(prompts)
        if batch == 0:
            return []
        if empty := [row for row, prompt in enumerate(prompts) if len(prompt) == 0]:
            raise GemmaExportError(f"greedy_batch: prompt #{empty[0]} of the batch has no tokens; each row needs at least "
                                   "one (its <bos>)")
        for row, prompt in enumerate(prompts):  # onnxruntime's Gather takes -5 as the 5th row from the end
            self.check_ids(prompt, f"greedy_batch: prompt #{row}", tokenized=False)
        longest = max(len(p) for p in prompts)
        capacity = positions_needed(longest, max_new_tokens)
        self.check_length(capacity)
        if not self.takes_position_ids and any(len(p) != longest for p in prompts):
            # onnxruntime-genai's graph counts a row's positions from its mask: left padding shifts
            # them (other tokens, measured), so prompts of several lengths run one at a time
            return [self.greedy(prompt, max_new_tokens, stop_ids=(), prefill_chunk=None)[0] for prompt in prompts]
        ids = np.zeros((batch, longest), np.int64)
        mask = np.zeros((batch, longest), np.int64)
        for row, prompt in enumerate(prompts):
            ids[row, longest - len(prompt):] = prompt
            mask[row, longest - len(prompt):] = 1
        positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
        cache = KVCache(self, batch, capacity, max_step=longest)
        logits = np.empty((batch, 1, self.vocab_size), np.float32) if isinstance(self.vocab_size, int) else None
        out: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            last = cache.step(ids, mask, positions, logits)[:, -1]
            tokens = np.asarray([picked_token(row, len(out[0]), f"prompt #{n}", self.graph_path)
                                 for n, row in enumerate(last)], np.int64)
            last = None  # a view of the prompt step's own logits: freed before the next step's heap trim
            for row, token in enumerate(tokens):
                out[row].append(int(token))
            ids = tokens[:, None].astype(np.int64)
            positions = positions[:, -1:] + 1
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
        return out

    def teacher_forced_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits after each token, fed one at a time through the KV cache: float32 ``[len, vocab]``.

        Row ``i`` predicts token ``i + 1``. Exercises the decode path with caches longer than the
        sliding window. A 3,400-token text over Gemma's 262,144-word vocabulary is 3.6 GB: for long
        texts, :meth:`teacher_forced_chunks` gives the same rows a chunk at a time.

        Raises:
            GemmaExportError, FormatError, ResourceError: as :meth:`teacher_forced_chunks`;
                ResourceError also when the rows would not fit in available memory.
        """
        check_arguments("teacher_forced_logits", token_ids=(token_ids, "ids"))
        if not len(token_ids):
            return np.empty((0, self.vocab_size), np.float32)
        self.check_length(len(token_ids), "teacher-forced ids")
        self.check_ids(token_ids, "teacher-forced ids", tokenized=False)
        need = len(token_ids) * self.vocab_size * 4
        available = memory.available_bytes()
        if available is not None and need > available:  # numpy's MemoryError would come after the KV cache
            raise ResourceError(f"teacher_forced_logits: {len(token_ids):,} rows of {self.vocab_size:,} float32 logits need "
                                f"{need / 1e9:,.1f} GB, more than the {available / 1e9:,.1f} GB this machine has "
                                "available; use teacher_forced_chunks")
        ((_, rows),) = self._teacher_forced_rows(token_ids, len(token_ids))  # one chunk: the whole matrix, ids checked above
        return rows

    def teacher_forced_chunks(self, token_ids: Sequence[int], chunk: int = CHUNK_ROWS):
        """The rows of :meth:`teacher_forced_logits`, ``chunk`` at a time, as they are computed.

        Yields:
            ``(start, rows)``: rows float32 ``[≤ chunk, vocab]`` for positions ``start …``; the array
            is reused for the next chunk, so a caller that keeps rows must copy them.

        Raises (a generator: when iteration starts, before any step):
            ConfigError: ``token_ids`` that is no sequence or 1-D array (a set, an iterator), or a
                ``chunk`` that is no integer or is < 1.
            GemmaExportError: ``token_ids`` exceeds ``max_position_embeddings``.
            FormatError: an id that is no integer or lies outside the vocabulary (:meth:`check_ids`).
            ResourceError: the KV cache would not fit in available memory (:class:`KVCache`).
        """
        check_arguments("teacher_forced_chunks", token_ids=(token_ids, "ids"))
        if not _is_integer(chunk) or chunk < 1:
            raise ConfigError(f"teacher_forced_chunks(): chunk must be a whole number of rows >= 1, found {chunk!r}")
        self.check_length(len(token_ids), "teacher-forced ids")
        self.check_ids(token_ids, "teacher-forced ids", tokenized=False)
        yield from self._teacher_forced_rows(token_ids, chunk)

    def _teacher_forced_rows(self, token_ids: Sequence[int], chunk: int):
        # teacher_forced_chunks' rows, for ids its callers checked
        cache = KVCache(self, 1, max(1, len(token_ids)), max_step=1)
        rows = np.empty((min(chunk, len(token_ids)), self.vocab_size), np.float32)
        for start in range(0, len(token_ids), chunk):
            count = min(chunk, len(token_ids) - start)
            for row, position in enumerate(range(start, start + count)):  # onnxruntime writes each row in place
                cache.step(np.asarray([[token_ids[position]]], np.int64), np.ones((1, position + 1), np.int64),
                           np.asarray([[position]], np.int64), out=rows[row].reshape(1, 1, -1))
            yield start, rows[:count]


def check_optimized_model_path(model_dir: Path, path: Path) -> None:
    """Refuse a path for onnxruntime's optimized graph (``optimized_model_path``) that would damage
    an export: one of ``model_dir``'s files, by any name (a link; its ``model.onnx`` would be
    replaced by the optimized graph), or a path inside an output of this toolkit (an export, a
    bundle, a pre-packed copy), whose listing would no longer name every file in it.

    Raises:
        OutputError: naming ``path`` and the file or folder it would damage (a file with other hard
            links, too), the loop of links it cannot be resolved through, or a folder that is not there.
    """
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:  # a loop of symbolic links (RuntimeError before Python 3.13)
        raise OutputError(f"{path}: optimized_model_path cannot be resolved ({exc}); give a path that leads to a "
                          "file") from None
    own = _same_file_in(model_dir, path)
    if own is not None:
        raise OutputError(f"{path}: optimized_model_path is {own}, a file of the export being loaded, which "
                          "onnxruntime would overwrite with its optimized graph; give a path outside the export")
    copy = next((folder for folder in resolved.parents if is_prepacked_copy(folder)), None)
    if copy is not None:
        raise OutputError(f"{path}: optimized_model_path is inside {copy}, a pre-packed copy of gemma-export whose "
                          f"{PREPACKED_MANIFEST} would no longer list every file in it; write the optimized graph "
                          "elsewhere")
    check_outside_outputs(path, "optimized graph (optimized_model_path)")
    if not resolved.parent.is_dir():  # onnxruntime's own failure said "SystemError : 2" about the model
        raise OutputError(f"{path}: optimized_model_path lies in {path.parent}, which is no folder; give a path in an "
                          "existing folder")
    try:
        links = path.stat().st_nlink
    except OSError:  # a new file
        links = 1
    if links > 1:  # onnxruntime writes through every name: another export's graph, by a hard link
        raise OutputError(f"{path}: optimized_model_path is a file with {links} hard links, which onnxruntime would "
                          "overwrite under every name (another export's graph, perhaps); give a new file name")


def _same_file_in(folder: Path, path: Path) -> Path | None:
    """The file under ``folder`` (its subfolders included) that ``path`` is, whatever the name it is
    reached by (a symbolic or hard link: the same device and inode), or None."""
    try:
        st = path.stat()
    except OSError:  # no such file (yet): it is none of the folder's
        return None
    for root, _, names in os.walk(folder):  # an export's few files, and its pre-packed copy's
        for name in names:
            try:
                other = os.stat(os.path.join(root, name))
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return Path(root) / name
    return None


def _copy_of(model_dir: Path, path: Path) -> Path:
    """``path``, the ``model.onnx`` of a pre-packed copy in a folder of ``model_dir`` (another
    export's graph would run with this one's manifest and checks).

    Raises:
        ConfigError: ``path`` is not so placed.
        FormatError: no such file.
    """
    if path.name != MODEL_FILE or path.absolute().parent.parent.resolve() != model_dir.resolve():
        raise ConfigError(f"OnnxDecoder(): prepacked must be the {MODEL_FILE} of a pre-packed copy in a folder of "
                          f"{model_dir} (its {PREPACKED_DIR}/), found {path}")
    if not path.is_file():
        raise FormatError(f"{path}: no such pre-packed graph")
    return path


def _sliding_layers(session, path: Path, num_hidden_layers: int,
                    config: dict | None = None) -> tuple[tuple[int, ...], int | None]:
    """``(sliding layer indices, sliding_window)`` from a graph that takes ``sliding_cache_start``;
    ``((), None)`` for graphs that do not (other exporters', or before the input existed). When the
    manifest's ``config`` has ``layer_types`` / ``sliding_window``, the metadata must agree with them:
    a wrong window or layer list would silently change the logits once rows are dropped.

    Raises:
        FormatError: the metadata naming them is missing, malformed, or disagrees with the manifest.
    """
    takes_start = SLIDING_CACHE_START in {i.name for i in session.get_overridable_initializers()}
    return sliding_layers_from(session.get_modelmeta().custom_metadata_map, takes_start, path, num_hidden_layers, config)


def sliding_layers_from(meta: dict[str, str], takes_start: bool, path: str | Path, num_hidden_layers: int,
                        config: dict | None = None) -> tuple[tuple[int, ...], int | None]:
    """:func:`_sliding_layers` from a graph's metadata map and whether it takes ``sliding_cache_start``
    (``verify`` reads both from the ONNX file without a session).

    Args:
        meta: the model's metadata (``SLIDING_LAYERS_KEY``: comma-separated layer indices,
            ``SLIDING_WINDOW_KEY``: the window in positions).
        takes_start: whether the graph has the ``sliding_cache_start`` input.
        path: the graph's path, for messages.
        num_hidden_layers: layers of the graph; every index must lie below it.
        config: the manifest's ``config`` object, or None.

    Returns:
        ``(sliding layer indices, sliding_window in positions)``, or ``((), None)`` when
        ``takes_start`` is False.

    Raises:
        FormatError: the metadata naming them is missing, malformed, or disagrees with the manifest.
    """
    if not takes_start:
        return (), None
    found = f"found {meta.get(SLIDING_LAYERS_KEY)!r:.60} / {meta.get(SLIDING_WINDOW_KEY)!r:.20}"
    try:
        text = meta[SLIDING_LAYERS_KEY]
        if not text.isascii():  # int() also reads full-width digits
            raise ValueError
        layers = tuple(int(i) for i in text.split(","))
        window = int(meta[SLIDING_WINDOW_KEY]) if meta[SLIDING_WINDOW_KEY].isascii() else 0
        if window < 1 or not layers or any(not 0 <= i < num_hidden_layers for i in layers) or len(set(layers)) != len(layers):
            raise ValueError
    except (KeyError, ValueError):
        raise FormatError(f"{path}: the graph takes {SLIDING_CACHE_START} but its metadata {SLIDING_LAYERS_KEY!r} / "
                          f"{SLIDING_WINDOW_KEY!r} do not name layers below {num_hidden_layers} and a window >= 1: "
                          f"{found}") from None
    config = config or {}
    types = config.get("layer_types")
    expected = tuple(i for i, kind in enumerate(types) if kind == SLIDING) if isinstance(types, list) else layers
    if layers != expected or config.get("sliding_window", window) != window:
        raise FormatError(f"{path}: its metadata {SLIDING_LAYERS_KEY!r} / {SLIDING_WINDOW_KEY!r} disagree with "
                          f"manifest.json's config: expected {','.join(map(str, expected))!r:.60} / "
                          f"'{config.get('sliding_window', window)}', {found}")
    return layers, window


#: the decoder contract's inputs (``builder.py``) and the element type onnxruntime reports for each;
#: ``past_key_values.{i}.key|value`` are float32 (:meth:`OnnxDecoder.empty_cache`, :class:`KVCache`)
DECODER_INPUT_TYPES = {"input_ids": "tensor(int64)", "attention_mask": "tensor(int64)", "position_ids": "tensor(int64)"}
CACHE_TYPE = "tensor(float)"
_CACHE_NAME = re.compile(r"past_key_values\.(\d+)\.(?:key|value)")


def check_decoder_contract(path: Path, inputs: dict, outputs: Sequence) -> int:
    """Check a session's inputs and outputs against the decoder contract this module feeds and reads:
    ``input_ids`` (and ``attention_mask``, ``position_ids`` where the graph takes them) int64
    ``[batch, sequence]``; ``past_key_values.{i}.key|value`` float32 ``[batch, kv_heads, past,
    head_dim]`` for layers 0…L−1, each with both; the outputs ``logits`` float32 ``[batch,
    sequence, vocab]`` and ``present.{i}.key|value`` float32 of rank 4 for the same layers (others
    may follow, e.g. ``debug.layers.*``).

    Args:
        path: the graph, for the message.
        inputs: input name → ``onnxruntime.NodeArg`` (``session.get_inputs()``).
        outputs: ``session.get_outputs()``.

    Returns:
        L, the number of layers.

    Raises:
        FormatError: naming the first input or output that is unknown, missing, of another element
            type (e.g. the float16 caches of an onnxruntime-genai fp16 model) or of another rank,
            with what was expected.
    """
    contract = "(input_ids, attention_mask, position_ids, past_key_values.{i}.key|value)"
    cache = {}
    for name in inputs:
        match = _CACHE_NAME.fullmatch(name)
        if match and str(int(match[1])) == match[1]:  # "01" is no layer number
            cache[name] = int(match[1])
        elif name not in DECODER_INPUT_TYPES:
            raise FormatError(f"{path}: input {name} is not the decoder contract {contract}")
    if "input_ids" not in inputs or not cache:
        raise FormatError(f"{path}: inputs {sorted(inputs)} are not the decoder contract {contract}")
    layers = max(cache.values()) + 1
    expected = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    if missing := [n for n in expected if n not in inputs]:
        raise FormatError(f"{path}: input {missing[0]} is missing; expected past_key_values.{{i}}.key and .value for "
                          f"layers 0 to {layers - 1}")
    declared = {o.name: o for o in outputs}
    needed = ["logits"] + [n.replace("past_key_values.", "present.", 1) for n in expected]
    if missing := [n for n in needed if n not in declared]:
        raise FormatError(f"{path}: output {missing[0]} is missing; expected logits and present.{{i}}.key|value for "
                          f"layers 0 to {layers - 1}")
    checked = [("input", name, arg, DECODER_INPUT_TYPES.get(name, CACHE_TYPE), 4 if name in cache else 2)
               for name, arg in inputs.items()]
    checked += [("output", name, declared[name], CACHE_TYPE, 3 if name == "logits" else 4) for name in needed]
    for role, name, arg, element, rank in checked:
        if arg.type != element:
            raise FormatError(f"{path}: {role} {name} is {arg.type}; expected {element} (the element type this "
                              "toolkit feeds and reads)")
        if arg.shape is not None and len(arg.shape) != rank:
            raise FormatError(f"{path}: {role} {name} has {len(arg.shape)} dimensions {list(arg.shape)}; expected "
                              f"{rank}")
    return layers


_CANNOT_LOAD = "onnxruntime cannot load the model: "
#: the oldest onnxruntime that runs every export of this toolkit (pyproject.toml pins the same).
#: Checked on 2026-12-06 with the real Gemma 3 270M exports: 1.20.1 and 1.21.0 refuse the graph
#: (GroupQueryAttention takes 11 inputs from 1.22 on); 1.22.0 and 1.22.1 run them on x86-64 but
#: not int8 on aarch64 ("Only 4b quantization is supported for unpacked compute": no 8-bit
#: MatMulNBits kernel there before 1.23); 1.23.0 runs int8 and int4 on both.
MIN_ONNXRUNTIME = (1, 23)


def check_onnxruntime_version(version: str) -> None:
    """Refuse an onnxruntime older than :data:`MIN_ONNXRUNTIME` before it loads an export (its own
    errors name an operator's inputs or kernel, not the version; on aarch64 an int8 export fails
    only at its first step).

    Args:
        version: ``onnxruntime.__version__``; one that does not start with ``MAJOR.MINOR`` passes.

    Raises:
        GemmaExportError: the version is older, naming it and the one needed.
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and tuple(map(int, match.groups())) < MIN_ONNXRUNTIME:
        wanted = ".".join(map(str, MIN_ONNXRUNTIME))
        raise GemmaExportError(f"onnxruntime {version} is installed, and this toolkit's exports need {wanted} or newer "
                               f"(older ones refuse their GroupQueryAttention, or cannot run 8-bit MatMulNBits on "
                               f"aarch64); install a newer one: pip install 'onnxruntime>={wanted}'")


def create_session(path: str | Path, threads: int | None = None, optimized_model_path: str | Path | None = None,
                   config: dict[str, str] | None = None, optimization: str = "all"):
    """An onnxruntime ``InferenceSession`` of ``path`` on the CPU provider, warnings silenced, with
    onnxruntime's memory patterns off (``SessionOptions.enable_mem_pattern``): the session would
    keep one per set of input shapes, a new one every decode step, as long as it lives.

    Args:
        threads: intra-op threads, 1 to 4 × this machine's CPUs (None: onnxruntime's default).
        optimized_model_path: onnxruntime writes its optimized graph there.
        config: session config entries (``SessionOptions.add_session_config_entry``).
        optimization: onnxruntime's graph optimization level, ``all`` (default) or ``basic`` (no
            fusions: the same arithmetic in another float32 order, for control runs).

    Returns:
        An ``onnxruntime.InferenceSession`` on ``CPUExecutionProvider``.

    Raises:
        FormatError: onnxruntime cannot load (or write) the model; its first message line.
        ResourceError: onnxruntime ran out of memory loading it (:func:`~gemma_export.errors.out_of_memory_line`).
        GemmaExportError: ``threads`` out of range (:func:`check_threads`); onnxruntime older than
            :data:`MIN_ONNXRUNTIME` (:func:`check_onnxruntime_version`).
        KeyError: ``optimization`` is neither ``all`` nor ``basic``.
    """
    import onnxruntime as ort

    check_threads(threads)
    check_onnxruntime_version(ort.__version__)
    options = ort.SessionOptions()
    # fatal only: a failing kernel's error comes back as the exception the caller words in one line; at
    # level 3 onnxruntime also printed it to stderr first, as a block of its own
    options.log_severity_level = 4
    # no memory patterns: onnxruntime keeps one per set of input shapes for the session's life, and a
    # decode step's attention_mask is one longer every step, so it kept a new one every token: 3.4 KB
    # of heap a step on the real int8 export (3.4 MB per 1,000 tokens, never given back), for no
    # measurable speed (docs/benchmarks-history.md, 2026-12-07, twenty-second session)
    options.enable_mem_pattern = False
    options.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}[optimization]
    if threads:
        options.intra_op_num_threads = threads
    if optimized_model_path is not None:
        options.optimized_model_filepath = str(optimized_model_path)
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    # onnxruntime's Python wrapper prints an "EP Error ... Falling back" banner to stdout when the
    # first attempt fails, then retries on the same CPU provider: the one error line below says it
    banner = io.StringIO()
    try:
        with contextlib.redirect_stdout(banner):
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except UnicodeDecodeError as exc:  # onnxruntime's own message quotes bytes of the file that are not UTF-8
        text = bytes(exc.object).decode("utf-8", "replace").strip()
        first = text.splitlines()[0] if text else type(exc).__name__
        raise FormatError(f"{path}: {_CANNOT_LOAD}{first}") from None
    except Exception as exc:  # onnxruntime's Fail / InvalidGraph / NotImplemented ...
        if out_of_memory_line(exc) is not None:  # not a damaged model: "onnxruntime cannot load the model: std::bad_alloc"
            raise ResourceError(f"{path}: onnxruntime ran out of memory loading it ({shown_error(exc)}): the model needs "
                                "more memory than this machine, or a limit on this process (ulimit -v), gives") from None
        raise FormatError(f"{path}: {_CANNOT_LOAD}{first_line(exc)}") from None
    for arg in (*session.get_inputs(), *session.get_outputs()):
        try:
            arg.name  # noqa: B018  (decoded here, so a name that is not UTF-8 fails now, not in a caller)
        except UnicodeDecodeError as exc:
            raise FormatError(f"{path}: {_CANNOT_LOAD}a graph input or output name is not UTF-8 text "
                              f"(byte {exc.object[exc.start:exc.start + 1]!r} at {exc.start} of "
                              f"{exc.object!r:.60})") from None
    return session


def picked_token(logits: np.ndarray, step: int, where: str = "", model: str | Path | None = None) -> int:
    """The argmax of one position's logits (``[vocab]``, ties → lowest id), refusing a broken export:
    a NaN anywhere makes the NaN the argmax, and so does +Inf, so checking the picked value alone
    (one element, not the 262,144) catches both.

    Args:
        logits: float ``[vocab]``.
        step: the generation step, for the message (0: the prompt's).
        where: which sequence, for the message.
        model: the graph that computed the logits, named first in the message.

    Returns:
        The token id, an ``int`` in ``0 … vocab - 1``.

    Raises:
        NumericError: ``"{model}: logits: step N picked token T whose logit is nan; the export does not
            compute finite logits"`` (``where``, e.g. ``prompt #1`` of a batch, after ``logits:``): a
            NaN or +Inf anywhere, or -Inf everywhere.
        ConfigError: ``logits`` (as ``np.asarray`` takes it) is not a non-empty 1-D array of numbers
            (numpy's IndexError or "argmax of an empty sequence" came instead).
    """
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0 or logits.dtype.kind not in "iuf":
        raise ConfigError(f"picked_token: logits must be one position's logits, a 1-D array [vocab], found "
                          f"{logits.dtype} {list(logits.shape)}")
    token = int(np.argmax(logits))
    if not np.isfinite(logits[token]):
        raise NumericError(f"{f'{model}: ' if model is not None else ''}logits: {where + ', ' if where else ''}step "
                           f"{step} picked token {token} whose logit is {logits[token]}; the export does not compute "
                           "finite logits")
    return token


def check_token_ids(ids: Sequence[int], vocab_size: int, where: str, hint: str = "", tokenizer=None) -> None:
    """Raises FormatError ``"{where}: token id X is outside the export's vocabulary (0 to V-1){hint}"``
    for the first id of ``ids`` not in ``0 … vocab_size - 1``; with ``tokenizer`` (a
    ``tokenizers.Tokenizer``) the id's piece follows it, ``token id X ('piece')``. An id must be an
    integer as ``operator.index`` takes it (Python's, numpy's, a torch integer; not a bool, a float
    or a list): onnxruntime would be fed ``5.9`` as 5.

    Raises:
        FormatError: as above, or ``"{where}: token id #N is 5.9; expected an integer"``.
    """
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind in "iu":  # checked at once
        outside = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        bad = int(ids[outside[0]]) if outside.size else None
    else:
        if not all(type(i) is int for i in ids) and \
                (at := next((n for n, i in enumerate(ids) if not _is_integer(i)), None)) is not None:
            raise FormatError(f"{where}: token id #{at} is {ids[at]!r}; expected an integer")
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        piece = f" ({tokenizer.id_to_token(bad)!r})" if tokenizer is not None else ""
        raise FormatError(f"{where}: token id {bad}{piece} is outside the export's vocabulary (0 to {vocab_size - 1})"
                          f"{hint}")


def _is_integer(value) -> bool:
    """An integer as ``operator.index`` takes it (Python's, numpy's, a 0-d integer tensor), not a bool
    (Python's, numpy's, or a bool tensor, which ``operator.index`` takes as 0 or 1)."""
    if isinstance(value, (bool, np.bool_)) or str(getattr(value, "dtype", "")).rsplit(".", 1)[-1] == "bool":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_threads(threads: int | None) -> None:
    """Refuse thread counts that cannot help: at most 4 × this machine's CPUs (onnxruntime starts
    every intra-op thread up front, so 100,000 of them exhaust memory before anything runs).

    Raises:
        ConfigError: ``threads`` < 1 or above that limit.
    """
    if threads is None:
        return
    limit = 4 * (os.cpu_count() or 1)
    if not 1 <= threads <= limit:
        raise ConfigError(f"--threads {threads}: expected 1 to {limit} (4 x this machine's "
                          f"{os.cpu_count() or 1} CPUs)")


def check_prefill_chunk(prefill_chunk: int | None) -> None:
    """Raises ConfigError unless ``prefill_chunk`` is None or >= 1 (tokens per prefill step).

    Raises:
        ConfigError: ``prefill_chunk`` < 1.
    """
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ConfigError(f"--prefill-chunk must be >= 1 token (0 on the command line: the whole prompt "
                          f"at once), found {prefill_chunk}")


def kv_buffer(shape: tuple[int, ...]) -> np.ndarray:
    """A zero-filled float32 array of ``shape`` in a private anonymous memory map of its own
    (``mmap.mmap(-1, …)``), for a :class:`KVCache` buffer.

    Its pages are taken from the kernel when first written (per 4 KiB page, or per 2 MiB where
    transparent huge pages are on for all memory) and go back when the array (and every view of it)
    is freed. A heap array of this size (``np.empty``) may stay in glibc's heap once freed: after a
    512-token prompt and 128 steps of the real int8 export, the freed cache's 21.6 MB did, and were
    Anonymous memory of the process until a trim (2026-12-07).

    Raises:
        ResourceError: the buffer is larger than this platform can address, or the kernel refuses
            the map (``ENOMEM``).
    """
    count = math.prod(shape)  # Python ints: no int64 wrap-around
    size = max(count, 1) * 4
    if size > sys.maxsize:
        raise ResourceError(f"KV cache: a buffer of {size:,} bytes is more than this platform can address "
                            f"({sys.maxsize:,}); ask for fewer sequences or tokens")
    # private: a shared map (mmap's default) would be shmem, counted under Rss but not Anonymous
    private = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS} if hasattr(mmap, "MAP_PRIVATE") else {}
    try:
        region = mmap.mmap(-1, size, **private)
    except (OSError, OverflowError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ResourceError(f"KV cache: a buffer of {size:,} bytes cannot be mapped ({reason})") from None
    return np.frombuffer(region, np.float32, count).reshape(shape)


class KVCache:
    """The KV cache of one generation with an :class:`OnnxDecoder`, and the step that uses it.

    For this toolkit's exports (manifest ``kv_cache.past_present_share_buffer``) each
    ``past_key_values.{i}.key|value`` is one float32 buffer ``[batch, kv_heads, rows, head_dim]``
    bound through IO binding as both the input and the matching ``present.{i}.*`` output:
    GroupQueryAttention writes the step's keys and values after the rows held, in place (its
    ``past_present_share_buffer`` mode), so no step copies the cache. Full-attention layers hold
    every position (``capacity`` rows). Sliding layers (graphs with ``sliding_cache_start``) hold at
    most ``sliding_window - 1 + max(step, SLIDING_ROOM)`` rows: when a step would not fit, the rows
    that left the window are dropped (the last ``sliding_window - 1`` move to the front) and the
    graph is told the first position held. Their attention then reads ~``sliding_window`` rows per
    step instead of the whole past, and their memory stops growing with the context (Gemma 3 270M at
    32,768 positions: 3 full layers × 64 MB, 15 sliding × 1.2 MB, against 18 × 64 MB). The logits
    are those of the whole cache: a dropped row is masked out by the window on every later step.
    Every buffer is a memory map of its own (:func:`kv_buffer`): a buffer replaced by a drop, and
    the whole cache when it is freed, go back to the kernel at once, and pages no step wrote yet
    take no memory. The first one-token step after a longer one (a prompt, or its last chunk) runs
    with :data:`ARENA_SHRINKAGE` and then trims the heap, so the prompt's activation buffers, which
    onnxruntime's arena would otherwise keep for the session, go back to the kernel (55 MB after a
    512-token prompt of the real int8 export; 2026-12-04). Other graphs get the numpy round trip of
    :meth:`OnnxDecoder.forward`.

    Args:
        decoder: the loaded export.
        batch_size: rows of every step.
        capacity: the most tokens (past + sequence) any step will hold.
        max_step: the longest step (tokens) expected; sizes the sliding layers' buffers, which grow
            if a step is longer.

    Raises:
        ConfigError: ``decoder`` is no :class:`OnnxDecoder`, or a count is no int.
        GemmaExportError: ``batch_size``, ``capacity`` or ``max_step`` < 1.
        ResourceError: the buffers (``2 · batch · kv_heads · head_dim`` float32 per row, per layer)
            would need more memory than the machine has available (``MemAvailable``): a length the
            model's config does not cap, e.g. ``--max-new-tokens 100000000``.
    """

    def __init__(self, decoder: OnnxDecoder, batch_size: int, capacity: int, max_step: int = DEFAULT_PREFILL_CHUNK):
        if not isinstance(decoder, OnnxDecoder):
            raise ConfigError(f"KVCache(): decoder must be an OnnxDecoder, found {type(decoder).__name__}")
        check_arguments("KVCache", batch_size=(batch_size, "int"), capacity=(capacity, "int"), max_step=(max_step, "int"))
        for name, value in (("batch_size", batch_size), ("capacity", capacity), ("max_step", max_step)):
            if value < 1:
                raise GemmaExportError(f"KV cache: {name} must be >= 1, found {value}")
        self.decoder, self.capacity, self.batch_size = decoder, capacity, batch_size
        #: positions the cache holds (the past of the next step)
        self.positions = 0
        self.shared = decoder.shares_kv_buffer
        #: the last step had more than one token (a prompt, or a chunk of one)
        self._after_prompt = False
        self.sliding_window = decoder.sliding_window
        # other graphs' caches grow by concatenation and hold every position in every layer
        sliding_layers = decoder.sliding_layers if self.shared else ()
        self._sliding = {f"past_key_values.{i}.{kind}" for i in sliding_layers for kind in ("key", "value")}
        #: cache position of the sliding buffers' first row
        self.sliding_start = 0
        sliding_rows = self._rows(max_step) if self._sliding else 0
        full_layers = decoder.num_hidden_layers - len(sliding_layers)
        row_bytes = batch_size * decoder.num_key_value_heads * decoder.head_dim * 4
        need = 2 * row_bytes * (full_layers * capacity + len(sliding_layers) * sliding_rows)
        available = memory.available_bytes()
        if available is not None and need > available:
            rows = f"{batch_size:,} sequences × " if batch_size > 1 else ""
            fewer = "fewer sequences or tokens" if batch_size > 1 else "fewer tokens"
            raise ResourceError(f"KV cache: {rows}{capacity:,} positions (prompt + new tokens) need {need / 1e9:,.1f} GB, "
                                f"more than the {available / 1e9:,.1f} GB this machine has available; ask for {fewer}")
        if not self.shared:
            self._past = decoder.empty_cache(batch_size)
            return

        self._binding = decoder.session.io_binding()
        self._binding.bind_output("logits")  # first bound output: get_outputs()[0]
        self._shape = (batch_size, decoder.num_key_value_heads, decoder.head_dim)
        #: the numpy arrays the bound buffers wrap (onnxruntime reads and writes them in place)
        self.arrays: dict[str, np.ndarray] = {}
        for i in range(decoder.num_hidden_layers):
            for kind in ("key", "value"):
                name = f"past_key_values.{i}.{kind}"
                self._bind(name, sliding_rows if name in self._sliding else capacity)

    def _rows(self, step: int) -> int:
        # rows a sliding buffer needs to take a step of `step` tokens after dropping the out-of-window rows
        return min(self.capacity, self.sliding_window - 1 + max(step, SLIDING_ROOM))

    def _bind(self, name: str, rows: int) -> np.ndarray:
        import onnxruntime as ort

        b, heads, d = self._shape
        array = kv_buffer((b, heads, rows, d))
        buffer = ort.OrtValue.ortvalue_from_numpy(array)  # the same memory, not a copy
        self._binding.bind_ortvalue_input(name, buffer)
        self._binding.bind_ortvalue_output(name.replace("past_key_values.", "present.", 1), buffer)
        self.arrays[name] = array  # our reference keeps the memory alive as long as the binding
        return array

    def _drop_out_of_window_rows(self, past: int, seq: int) -> None:
        # The sliding buffers hold positions sliding_start … past − 1; keep the last window − 1 of them
        # (all a query of this or a later step can see), at the front of a buffer sized for this step
        # (a replaced buffer's map is unmapped when `old` goes: nothing stays in the heap).
        held = past - self.sliding_start
        keep = min(held, self.sliding_window - 1)
        rows = self._rows(seq)
        for name in self._sliding:
            old = self.arrays[name]
            kept = old[:, :, held - keep:held]
            if old.shape[2] == rows:
                old[:, :, :keep] = kept  # numpy copies overlapping ranges correctly
            else:
                self._bind(name, rows)[:, :, :keep] = kept
        self.sliding_start = past - keep

    def step(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
             out: np.ndarray | None = None) -> np.ndarray:
        """Run one step and append its keys/values. Shapes as :meth:`OnnxDecoder.forward` (each step's
        ``attention_mask`` longer than the last by the step's length: past + sequence); returns
        logits float32 ``[B, 1 or S, vocab]`` (an array the caller owns, or ``out``). A step of
        several tokens after a past needs ``B`` = 1 (onnxruntime's GroupQueryAttention refuses it
        otherwise).

        Args:
            input_ids: int64 ``[B, S]``.
            attention_mask: int64 ``[B, past + S]`` (1: a real token, 0: left padding); bools and
                whole-valued floats are taken as 0 and 1 (``np.ones`` is float64).
            position_ids: int64 ``[B, S]``; whole-valued floats taken as well (``input_ids`` must
                be of an integer dtype: a float id is refused however whole).
            out: a writeable C-contiguous float32 ``[B, 1, vocab]`` array that a one-token step's
                logits are written into (by onnxruntime, or copied for graphs without shared KV
                buffers) and that is returned: a decode loop then reuses one buffer instead of a
                new 1 MB array per token. Checked on every step; a longer step returns its own array.

        Raises:
            GemmaExportError: ``attention_mask`` (past + sequence) is longer than ``capacity``, or
                longer than the positions held plus ``S`` (the graph would attend to rows never
                written; a shorter one rewinds: the step's rows replace those from ``past`` on,
                refused where its first query would need rows a sliding layer has dropped, those
                before ``past - sliding_window + 1``); shapes that disagree with each other or with
                ``batch_size``, no token, an ``attention_mask`` shorter than the step, several tokens
                after a past with ``B`` > 1; arrays that do not hold integers (a float would be
                truncated); an ``out`` of another shape or dtype, not C-contiguous or read-only.
            FormatError: an id outside ``0 … vocab_size - 1`` (onnxruntime's Gather would read -1 as
                the last row; :func:`check_token_ids`); an ``attention_mask`` that is not left padding
                (a graph of onnxruntime-genai: values other than 0 and 1; :func:`check_left_padding`).
            GemmaExportError: a ``position_ids`` value below 0 or at ``max_position_embeddings`` or
                beyond, where ``attention_mask`` is 1 (padded slots may hold any value).
            onnxruntime's own exceptions, unwrapped.
        """
        if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.flags.c_contiguous
                                    and out.flags.writeable
                                    and out.shape == (self.batch_size, 1, self.decoder.vocab_size)):
            # onnxruntime writes through the pointer whatever numpy's flags say: a read-only map would crash
            raise GemmaExportError(f"KV cache: out must be a writeable C-contiguous float32 array [{self.batch_size}, 1, "
                                   f"{self.decoder.vocab_size}], found "
                                   + (f"{out.dtype} {list(out.shape)}{'' if out.flags.c_contiguous else ', not C-contiguous'}"
                                      f"{'' if out.flags.writeable else ', read-only'}"
                                      if isinstance(out, np.ndarray) else type(out).__name__))
        input_ids, attention_mask, position_ids = (
            _integer_array(name, value) for name, value in
            (("input_ids", input_ids), ("attention_mask", attention_mask), ("position_ids", position_ids)))
        if input_ids.ndim != 2 or position_ids.shape != input_ids.shape or attention_mask.ndim != 2 or \
                input_ids.shape[0] != self.batch_size or attention_mask.shape[0] != self.batch_size:
            raise GemmaExportError(f"KV cache: expected input_ids and position_ids [{self.batch_size}, S] and "
                                   f"attention_mask [{self.batch_size}, past + S], found {list(input_ids.shape)}, "
                                   f"{list(position_ids.shape)} and {list(attention_mask.shape)}")
        total, seq = attention_mask.shape[1], input_ids.shape[1]
        if seq == 0:
            raise GemmaExportError("KV cache: a step needs at least one token, found input_ids "
                                   f"{list(input_ids.shape)}")
        if total < seq:
            raise GemmaExportError(f"KV cache: attention_mask covers {total} position{'' if total == 1 else 's'} (past + "
                                   f"sequence), fewer than the step's {seq} tokens")
        if seq > 1 and total > seq and self.batch_size > 1:
            raise GemmaExportError(f"KV cache: a step of {seq} tokens after a past needs batch 1 (onnxruntime's "
                                   f"GroupQueryAttention), found batch {self.batch_size}; feed the batch one token a step")
        check_token_ids(input_ids.ravel(), self.decoder.vocab_size, "KV cache: input_ids")
        check_left_padding(attention_mask, "KV cache", self.decoder.takes_position_ids)
        limit = self.decoder.max_position_embeddings
        # positions the model does not take (onnxruntime-genai graphs read a cos_cache of that many rows);
        # padded slots (attention_mask 0) are never attended: any value
        live = np.where(attention_mask[:, total - seq:] != 0, position_ids, 0)
        if live.min() < 0 or (limit and live.max() >= limit):
            bad = live.min() if live.min() < 0 else live.max()
            at = list(map(int, np.argwhere(live == bad)[0]))
            rule = ">= 0" if bad < 0 else f"below {limit_name(self.decoder.model_dir)} {limit}"
            raise GemmaExportError(f"KV cache: position_ids must be {rule}, found {int(bad)} at {at}")
        if total > self.positions + seq:
            raise GemmaExportError(f"KV cache: attention_mask covers {total} positions, but the cache holds "
                                   f"{self.positions} and the step adds {seq}: at most {self.positions + seq}")
        # a rewound step's first query sees the sliding_window - 1 positions before it: they must still be held
        if self.sliding_start > 0 and total == seq:  # no past: a new sequence in a cache whose rows were dropped
            raise GemmaExportError("KV cache: a step from position 0 starts a new sequence, but this cache's sliding "
                                   f"layers have dropped rows (they hold those from {self.sliding_start}); use a new "
                                   "KVCache for it")
        if self.sliding_start > 0 and total - seq - (self.sliding_window - 1) < self.sliding_start:
            raise GemmaExportError(f"KV cache: a step from position {total - seq} needs the sliding layers' rows from "
                                   f"position {max(0, total - seq - (self.sliding_window - 1))}, but they hold only those "
                                   f"from {self.sliding_start} (the earlier ones were dropped)")
        if total > self.capacity:
            raise GemmaExportError(f"KV cache: a step of {total} tokens (past + sequence) exceeds the cache "
                                   f"capacity of {self.capacity}")
        if not self.shared:
            logits, self._past = self.decoder.forward(input_ids, attention_mask, position_ids, self._past)
            self.positions = total
            if out is not None and seq == 1:
                out[...] = logits
                return out
            return logits
        import onnxruntime as ort

        b = self._binding
        if self._sliding:
            past = total - seq
            held = past - self.sliding_start
            # drop when this step would not fit, or when more than SLIDING_ROOM rows beyond the window are
            # held (e.g. after a long prompt in one step, so decode does not read it all again)
            rows = self.arrays[next(iter(self._sliding))].shape[2]
            if held + seq > rows or held > self.sliding_window - 1 + SLIDING_ROOM:
                self._drop_out_of_window_rows(past, seq)
            # an overridable initializer: IO binding takes it as an OrtValue only (bind_cpu_input
            # looks among the required inputs); the array backs the value until the next step
            self._start = np.asarray(self.sliding_start, np.int64)
            b.bind_ortvalue_input(SLIDING_CACHE_START, ort.OrtValue.ortvalue_from_numpy(self._start))
        b.bind_cpu_input("input_ids", input_ids)  # int64 and contiguous (_integer_array)
        b.bind_cpu_input("attention_mask", attention_mask)
        b.bind_cpu_input("position_ids", position_ids)
        logits = None
        if seq == 1 and isinstance(self.decoder.vocab_size, int):  # [B, 1, vocab] for every export: a new array of ours
            logits = np.empty((input_ids.shape[0], 1, self.decoder.vocab_size), np.float32) if out is None else out
            b.bind_ortvalue_output("logits", ort.OrtValue.ortvalue_from_numpy(logits))
        else:  # a prompt's step: [B, 1 or S, vocab] (--all-logits), so onnxruntime allocates it
            b.bind_output("logits")
        release = seq == 1 and self._after_prompt
        self._after_prompt = seq > 1
        if release:  # the first decode step after a prompt: the prompt's activation memory goes back
            self.decoder.session.run_with_iobinding(b, _arena_shrinkage())
            release_free_heap()
        else:
            self.decoder.session.run_with_iobinding(b)
        self.positions = total
        if logits is not None:  # no copy and no get_outputs() (an OrtValue per bound output: 37 here)
            return logits
        # OrtValue.numpy() is a view of onnxruntime's output memory, reused by the next run: copy.
        return np.array(b.get_outputs()[0].numpy(), copy=True)


def check_left_padding(attention_mask: np.ndarray, where: str, left_padding: bool = True) -> None:
    """Refuse an ``attention_mask`` (integer or bool ``[B, past + S]``) that holds values other than
    0 and 1, and with ``left_padding`` one that is not left padding: each row 0 (padding) for its
    first positions, if any, then 1 (a real token) to its end (a row of 0 only is a padded prompt
    fed a token at a time, its logits not used yet). This toolkit's graphs attend to every position
    whose mask is not 0 and take positions from ``position_ids``, so a 2 counted as 1, and a 0
    after a 1 hid that one token from the rest, positions unchanged: a sequence no tokenizer gives.
    onnxruntime-genai's graphs (``left_padding`` False) count a row's length as the sum of its
    mask, so they take right padding (zeros between a prompt and its new tokens) and a 2 as two.

    Raises:
        FormatError: ``"{where}: attention_mask must hold 0 (left padding) and 1 (a real token),
            found 2 at [0, 3]"``; ``"{where}: attention_mask is 0 at [b, k], after a 1 in its row; …"``.
    """
    mask = attention_mask.view(np.uint8) if attention_mask.dtype.kind == "b" else attention_mask
    if mask.size == 0 or (mask == 1).all():  # a decode step's usual mask, checked in one pass
        return
    other = np.argwhere((mask != 0) & (mask != 1))  # in the mask's own dtype: uint64's 2**64 - 1 is not -1
    if other.size:
        at = tuple(int(i) for i in other[0])
        raise FormatError(f"{where}: attention_mask must hold 0 ({'left ' if left_padding else ''}padding) and 1 (a "
                          f"real token), found {int(mask[at])} at {list(at)}")
    if not left_padding:
        return
    started = np.maximum.accumulate(mask, axis=1)  # 1 from a row's first real token on
    gap = np.argwhere((started == 1) & (mask == 0))
    if gap.size:
        row, column = (int(i) for i in gap[0])
        raise FormatError(f"{where}: attention_mask is 0 at [{row}, {column}], after a 1 in its row; 0 marks left "
                          "padding only (positions before a row's first real token)")


def _integer_array(name: str, value) -> np.ndarray:
    """``value`` as a C-contiguous int64 array, refusing what onnxruntime would be fed as another
    number (``np.ascontiguousarray(..., dtype=np.int64)`` truncates 2.9 to 2). ``input_ids`` must hold
    integers, as :func:`check_token_ids` asks of every id list; ``attention_mask`` and
    ``position_ids`` may also be booleans or whole-valued floats (``np.ones((1, n))`` is float64).

    Raises:
        GemmaExportError: e.g. ``"KV cache: position_ids must hold integers (int64), found float64
            2.5 at [0, 1]"``, naming the first value that is not one.
    """
    array = np.asarray(value)
    kind = array.dtype.kind
    if kind == "u" and array.dtype.itemsize == 8 and array.size and array.max() > np.iinfo(np.int64).max:
        # int64 would wrap it to a negative value, and the message would show that instead
        at = np.unravel_index(int(np.argmax(array)), array.shape)
        raise GemmaExportError(f"KV cache: {name} must hold int64 values, found {int(array[at])} (uint64) at "
                               f"{list(map(int, at))}")
    if kind in "iu" or (name != "input_ids" and kind == "b"):
        return np.ascontiguousarray(array, dtype=np.int64)
    if kind == "f":
        with np.errstate(invalid="ignore", over="ignore"):  # over: 2**63 is inf as float16
            # NaN, ±inf and what int64 cannot hold are no whole numbers here (a cast would wrap them)
            fractional = ~np.isfinite(array) | (array != np.trunc(array)) | (np.abs(array) >= 2.0**63)
        if name != "input_ids" and not fractional.any():
            return np.ascontiguousarray(array, dtype=np.int64)
    found = f"{array.dtype}"
    if kind == "f" and array.size:
        at = np.unravel_index(int(np.flatnonzero(fractional)[0]) if name != "input_ids" else 0, array.shape)
        found += f" {array[at].item()!r} at {list(map(int, at))}"
    raise GemmaExportError(f"KV cache: {name} must hold integers (int64), found {found}")


@functools.lru_cache(maxsize=None)
def _arena_shrinkage():
    import onnxruntime as ort

    options = ort.RunOptions()
    options.add_run_config_entry(*ARENA_SHRINKAGE)
    return options


#: what :class:`OnnxDecoder` imports on first use: onnx (graph and file checks), onnxruntime, and
#: this toolkit's prepack module (the pre-packed copy's checks)
RUNTIME_LIBRARIES = ("onnx", "onnxruntime", "gemma_export.prepack")


def import_runtime_libraries() -> None:
    """Import the libraries :class:`OnnxDecoder` loads (:data:`RUNTIME_LIBRARIES`) ahead of it.

    ``bench`` calls it before its memory baseline, so that the growth it reports is the session's
    and the model's, not the libraries' code and data: importing onnx and onnxruntime adds about
    20 MB of Anonymous memory once per process (11.4 + 8.6 MB on x86-64, measured 2026-12-04),
    whatever the model, and about 11 MB after the tokenizer's parse has left heap to reuse (as in
    ``bench``, which loads it first; 2026-12-05). ``bench`` reports that figure on its own line.

    Raises:
        ImportError: a library is not installed.
    """
    import importlib

    for name in RUNTIME_LIBRARIES:
        importlib.import_module(name)


def load_tokenizer(model_dir: str | Path):
    """The ``tokenizers.Tokenizer`` stored beside an export.

    Args:
        model_dir: an export folder.

    Returns:
        A ``tokenizers.Tokenizer``.

    Raises:
        SourceNotFoundError: no such folder (or a file, or a bundle folder).
        GemmaExportError: the path is not valid UTF-8.
        FormatError: the folder has no readable ``tokenizer.json``.
        ConfigError: ``model_dir`` is no path (None, a number, ``""``, which would be the current folder).
    """
    from .tokenizer import read_tokenizer_json

    check_arguments("load_tokenizer", model_dir=(model_dir, "path"))
    model_dir = Path(model_dir)
    require_folder(model_dir, "tokenizer.json")
    path = model_dir / "tokenizer.json"
    if (what := non_regular(path)) is not None:
        raise FormatError(f"{path}: is {what}; expected the tokenizer file")
    if not path.is_file():
        if _manifest_lists(model_dir, "tokenizer.json"):  # the export wrote it: the folder lost it since
            raise FormatError(f"{path}: missing, though manifest.json lists it (the folder lost it, or was copied "
                              f"without it); copy the export again, and check it with gemma-export verify")
        raise FormatError(f"{path}: missing; export again with the model's tokenizer (--tokenizer TOKENIZER.json), "
                          "or from a source that carries one")
    return read_tokenizer_json(path)


def _manifest_lists(model_dir: Path, name: str) -> bool:
    """Whether the folder's ``manifest.json`` lists ``name`` among its files (False when it has no
    readable manifest: what to advise then is decided without it)."""
    try:
        files = read_manifest(model_dir).get("files")
    except FormatError:
        return False
    return isinstance(files, dict) and name in files


#: ids ``tokenizers`` can decode at all are below this (it takes them as unsigned 32-bit integers)
TOKENIZER_ID_LIMIT = 2**32


class TextStream:
    """The text of generated ids, given out piece by piece as the ids come; the pieces joined are
    the text of the generation.

    Each piece is what decoding the newest ids adds, decoded together with the ids of the piece
    before them so that the tokenizer sees their context (a leading space, a character split over
    ids): ``decode(ids[prefix:]) - decode(ids[prefix:read])``, the incremental decode of Hugging
    Face's text-generation-inference. A decode that ends in U+FFFD (a character whose bytes are
    not all generated yet, Gemma's byte fallback) waits for up to 3 more ids (UTF-8 takes at most 4
    bytes a character). An id that adds no text (a special token, when they are skipped) is
    dropped. The context is at most :attr:`WINDOW` ids, so a long generation costs linear time, not
    quadratic.

    Where the decode with context does not extend what was shown, the new ids are decoded alone.
    That happens at a run of byte pieces that ends in bytes that are not UTF-8: ``tokenizers``
    then turns the whole run into U+FFFD, characters already shown included (the whole decode of
    a generation that ends so has U+FFFD where this text keeps the characters shown before).

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        emit: called with each piece (a non-empty ``str``).
        skip_special_tokens: decode as ``tokenizers`` does by default, leaving special tokens out;
            False (the default) shows them, e.g. FunctionGemma's function-call markers where its
            tokenizer marks them special.

    Raises:
        ConfigError: ``tokenizer`` has no ``decode``, or ``emit`` is not callable (they failed at
            the first :meth:`add`, as an AttributeError or TypeError).
    """

    #: most ids of context decoded beside the new ones: room for a character's 4 byte ids and the
    #: piece before them (its leading space), while a decode stays a few ids long
    WINDOW = 8
    #: most ids a character's bytes span (UTF-8)
    MAX_CHARACTER_IDS = 4

    def __init__(self, tokenizer, emit: Callable[[str], None], skip_special_tokens: bool = False) -> None:
        if not callable(getattr(tokenizer, "decode", None)):
            raise ConfigError(f"TextStream: tokenizer must be a tokenizers.Tokenizer (with decode), found "
                              f"{type(tokenizer).__name__}")
        if not callable(emit):
            raise ConfigError(f"TextStream: emit must be callable (it is called with each piece), found {emit!r}")
        self._tokenizer = tokenizer
        self._emit = emit
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read]: context already shown, decoded again beside the new ids
        self._read = 0  # ids before read are shown
        self.shown = ""

    def add(self, token_id: int) -> None:
        """Take one more id; emit what it adds to the text, if anything yet.

        Raises:
            ConfigError: ``token_id`` is not an integer ≥ 0 (a bool, a float, a string, None, a
                negative id): the tokenizer's own error came from its decode, and the id stayed
                stored, so every later call failed too. An id the vocabulary lacks adds nothing, as
                the tokenizer decodes it; so does one of 2**32 or more, which ``tokenizers`` cannot
                take at all (its OverflowError left the id stored, and every later call failed).
        """
        if not _is_integer(token_id) or operator.index(token_id) < 0:
            raise ConfigError(f"TextStream.add: token_id must be an integer >= 0, found {token_id!r}")
        token_id = operator.index(token_id)
        if token_id >= TOKENIZER_ID_LIMIT:
            return
        self._ids.append(token_id)
        after = self._decode(self._prefix, None)
        if after == self._decode(self._prefix, -1):  # an id that adds nothing (a skipped special token),
            del self._ids[-1]  # also between a character's bytes: not kept, and not counted against them
            return
        before = self._decode(self._prefix, self._read)
        if after.endswith("\ufffd") and len(self._ids) - self._read < self.MAX_CHARACTER_IDS:
            return  # the character's next byte may come with the next id
        self._show_new(before, after)

    def finish(self) -> str:
        """Emit what the ids not shown yet add (bytes of a character that never came whole: one
        U+FFFD each, as their decode gives), and return the whole text."""
        if self._read < len(self._ids):
            self._show_new(self._decode(self._prefix, self._read), self._decode(self._prefix, None))
        return self.shown

    def _decode(self, start: int, stop: int | None) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=self._skip_special_tokens)

    def _show_new(self, before: str, after: str) -> None:
        """Show what the ids from ``read`` on add (``after`` minus ``before``, or their decode alone
        where ``after`` rewrites ``before``), and make them the context of the next ones."""
        piece = after[len(before):] if after.startswith(before) else self._decode(self._read, None)
        if piece:
            self.shown += piece
            self._emit(piece)
            self._prefix = self._read
        self._read = len(self._ids)
        self._prefix = max(self._prefix, self._read - self.WINDOW)


def generate(model_dir: str | Path, prompt: str, max_new_tokens: int = 32, threads: int | None = None,
             prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, prepacked: bool | None = None,
             on_text: Callable[[str], None] | None = None, special_tokens: bool = True) -> GenerationResult:
    """Tokenize ``prompt`` (``<bos>`` prepended unless it starts with it, :func:`encode_prompt`),
    greedy-decode with onnxruntime, decode the new tokens.

    Args:
        model_dir: an export folder.
        prompt: the text.
        max_new_tokens: tokens to generate at most (≥ 1); decoding stops after an eos id.
        threads: onnxruntime intra-op threads, 1 to 4 × this machine's CPUs (None: its default).
        prefill_chunk: prompt tokens per prefill step, as in :meth:`OnnxDecoder.greedy`.
        prepacked: the folder's pre-packed copy, as in :class:`OnnxDecoder` (None: used when it
            was made on this machine from these files).
        on_text: called with each new piece of the decoded text while tokens are generated
            (:class:`TextStream`); the pieces joined are the result's ``text``.
        special_tokens: show the special tokens the model generates in the text (True, the
            tokenizer's text of every id), or leave them out (``skip_special_tokens``). The stop id
            that ends the generation is never shown.

    Returns:
        A :class:`GenerationResult` (times in milliseconds).

    Raises:
        SourceNotFoundError, FormatError: the folder is not an export with a tokenizer, or
            :class:`OnnxDecoder` refuses it; FormatError also when the tokenizer gives no ids or an
            id outside the graph's vocabulary, or ``genai_config.json`` is malformed (:func:`max_positions`).
        GemmaExportError: an argument of the wrong type (``ConfigError``,
            :func:`~gemma_export.errors.check_arguments`); ``max_new_tokens`` < 1; the prompt is not UTF-8 text; prompt + new tokens
            exceed ``max_position_embeddings`` (:func:`max_positions`, read before the session);
            ``threads`` or ``prefill_chunk`` out of range.
        NumericError: the export computes NaN or +Inf logits.
        ResourceError: the KV cache would not fit in available memory.
    """
    check_arguments("generate", model_dir=(model_dir, "path"), prompt=(prompt, "str"),
                    max_new_tokens=(max_new_tokens, "int"), threads=(threads, "int?"),
                    prefill_chunk=(prefill_chunk, "int?"), prepacked=(prepacked, "bool?"),
                    on_text=(on_text, "callable?"), special_tokens=(special_tokens, "bool"))
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens must be >= 1, found {max_new_tokens}")
    bad = not_unicode_at(prompt)
    if bad is not None:  # bytes that were not UTF-8 arrive from argv as lone surrogates
        raise GemmaExportError(f"--prompt: expected UTF-8 text, found a byte that is not UTF-8 at character {bad}")
    check_export_folder(model_dir)
    tokenizer = load_tokenizer(model_dir)  # before the (slow, memory-heavy) session
    limit = max_positions(model_dir)
    # a prompt longer than the model takes is refused after tokenizing a prefix, not the whole text
    prompt_ids = encode_prompt(tokenizer, prompt, limit, f"{model_dir}: the prompt", limit_name(model_dir))
    if not prompt_ids:  # a prompt gets <bos> at least, unless the tokenizer cannot give one
        raise FormatError(f"{Path(model_dir) / 'tokenizer.json'}: gives no token ids for the prompt {prompt[:40]!r}, not "
                          "even <bos>; expected a tokenizer whose post-processor adds <bos> (the export's own)")
    needed = positions_needed(len(prompt_ids), max_new_tokens)
    # before the (slow) session, as bench; OnnxDecoder checks the manifest's figure against the graph
    # and greedy checks the length again
    check_positions(model_dir, needed, limit)
    decoder = OnnxDecoder(model_dir, threads=threads, prepacked=prepacked)
    # named by its piece too (e.g. an added token of the tokenizer the table has no row for)
    decoder.check_ids(prompt_ids, "prompt", tokenizer)
    # the text as it is shown, whether or not anyone is shown it (TextStream: a generation that ends
    # inside a character keeps the characters before it, where the tokenizer's whole decode loses them)
    stream = TextStream(tokenizer, on_text if on_text is not None else (lambda _piece: None),
                        skip_special_tokens=not special_tokens)
    stops = set(decoder.eos_token_id)  # a stop id ends the generation: it is the last id, and not text

    def on_token(token_id: int) -> None:
        if token_id not in stops:
            stream.add(token_id)
    from .bench import OtherWork  # bench imports this module

    with OtherWork() as other:  # the timed steps only, as bench measures it
        new_ids, prefill_ms, decode_ms = decoder.greedy(prompt_ids, max_new_tokens, prefill_chunk=prefill_chunk,
                                                        on_token=on_token)
    text = stream.finish()
    return GenerationResult(prompt_ids, new_ids, text, prefill_ms, decode_ms,
                            decoder.prepacked_path is not None, decoder.prepacked_note, decoder.dtype,
                            unknown_control_tokens(tokenizer, prompt), other.cpus)
