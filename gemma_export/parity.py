"""`gemma-export parity`: does an ONNX export agree with (a) an independent implementation of the
math (transformers, fp32, on the export's source weights), (b) the board team's reference MLIR
export run by IREE, (c) a golden token file — and where does it first depart?

Per prompt:

* transformers: the prompt plus the export's greedy continuation is fed to both; over every
  position: max |Δlogit|, mean cosine of the logit rows, top-1 agreement, mean KL(reference ‖
  export) in nats/token (``quality.compare_logits``), first position whose top-1 differs. With a
  ``--debug-outputs`` export, the first layer and sub-block (attention or MLP) whose output departs
  from transformers' beyond the tolerance (relative max error ``max|Δ| / max|reference|``).
* reference (IREE): the prompt padded with 0 to the reference's fixed length; the reference's
  argmax token at every position against the export's (teacher-forced through the KV cache), scored
  over the prompt's positions (the board never reads the padding's: reported apart); its
  greedy tokens by re-decoding (the board's loop) against the export's; with ``logits`` (argmax tail
  stripped) also max |Δlogit| over the prompt's positions.
* golden: the export's greedy ids against the expected ids: exact match or first mismatch.

The verdict applies per-dtype thresholds (``THRESHOLDS``) to the figures pooled over all prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import numpy as np

from .config import DTYPES
from .errors import ConfigError, FormatError, GemmaExportError, VerificationError, check_arguments, is_whole_number, shown
from .manifest import check_manifest_matches_graph, manifest_figure
from .runtime import DEFAULT_PREFILL_CHUNK, encode_prompt, limit_name, max_positions, positions_needed
from .text_files import SMALL_FILE_BYTES, not_unicode_at, read_text_file

#: greedy tokens generated after each prompt for the comparison with transformers
DEFAULT_NEW_TOKENS = 16
#: prompts used when none are given: short real requests of the kinds the board runs
DEFAULT_PROMPTS = (
    "The capital of France is",
    "Turn the light on in the kitchen.",
    "def fibonacci(n):",
    "Water boils at a temperature of",
)

#: A position where the export's two best logits are closer than this (absolute logit units) is a
#: near-tie: a reference that rounds differently (its bf16/int8 RoPE tables) may pick either token,
#: so a mismatch there is reported but not counted against the export.
NEAR_TIE = 0.01

#: Pass/fail thresholds by export dtype: pooled top-1 agreement and mean KL (nats/token) against
#: transformers, share of positions whose token equals the reference export's, and the relative
#: sub-block error beyond which a layer is named as the first departure. fp32 must match exactly
#: (its KL on real text is ~1e-10, docs/parity.md; a limit of 1e-4 passed a damaged weight at 1.9e-5);
#: quantized exports are held to what docs/quality.md measured on real text, with margin for short
#: prompts (one token of 30 is 3%).
THRESHOLDS = {
    "fp32": {"top1": 1.0, "kl": 1e-6, "reference_tokens": 1.0, "sub_block": 1e-3},
    "bf16": {"top1": 0.95, "kl": 0.01, "reference_tokens": 0.95, "sub_block": 0.05},
    "int8": {"top1": 0.90, "kl": 0.02, "reference_tokens": 0.90, "sub_block": 0.2},
    "int4": {"top1": 0.60, "kl": 0.5, "reference_tokens": 0.60, "sub_block": 0.6},
}


@dataclasses.dataclass
class PromptParity:
    """Figures for one prompt; a section is None when that comparison was not asked for.

    Attributes:
        prompt: the prompt's text, or None when given as ids.
        prompt_ids: its token ids (with ``<bos>`` when tokenized).
        transformers: ``positions``, ``max_abs_logit_diff`` (logits), ``cosine`` (mean over rows),
            ``top1_agreement`` (a share), ``kl_mean`` (nats/token), ``first_top1_difference``.
        reference: see ``_against_reference``: agreement over the prompt's positions (scored) and the
            padding's, agreement by position, near-tie mismatches (positions),
            greedy ids of both, and ``max_abs_logit_diff`` when the reference returns logits.
        golden: ``entry``, ``expected_ids``, ``export_ids``, ``match``, ``first_mismatch``, ``dtype`` (of
            the export that wrote the entry, when the golden file says; else None).
        divergence: :func:`first_divergence`'s result.
    """

    prompt: str | None
    prompt_ids: list[int]
    transformers: dict | None = None
    reference: dict | None = None
    golden: dict | None = None
    divergence: dict | None = None


@dataclasses.dataclass
class Check:
    """One verdict line: ``measured`` (a share, nats/token, or text such as "match") against
    ``threshold`` (its condition as text, e.g. ``">= 0.99"``)."""

    name: str
    measured: float | str
    threshold: str
    passed: bool


@dataclasses.dataclass
class ParityReport:
    """What ``gemma-export parity`` found: per-prompt figures and the pooled checks; :attr:`passed`
    is every check's verdict (``--json`` writes :meth:`to_dict`)."""

    model: str
    dtype: str
    prompts: list[PromptParity]
    checks: list[Check]

    @property
    def passed(self) -> bool:
        """Every check passed, and there was at least one (a run that compared nothing fails)."""
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict, ``passed`` included (``--json``)."""
        return {"model": self.model, "dtype": self.dtype, "passed": self.passed,
                "checks": [dataclasses.asdict(c) for c in self.checks],
                "prompts": [dataclasses.asdict(p) for p in self.prompts]}


# ---- inputs -------------------------------------------------------------------------------------
def read_prompts(path: str | Path | None, tokenizer, max_tokens: int | None = None,
                 limit: str = "the model's max_position_embeddings") -> list[tuple[str | None, list[int]]]:
    """``(text, ids)`` per prompt. ``path``: a text file (one prompt per non-empty line) or a JSON
    list of strings and/or id lists (a ``.json`` file, or any file that holds a JSON list, such as
    ``/dev/stdin``); None: :data:`DEFAULT_PROMPTS`. Text is tokenized with the export's tokenizer
    (``<bos>`` prepended).

    Args:
        path: the prompts file, or None.
        tokenizer: the export's ``tokenizers.Tokenizer``, or None (then only id lists are accepted).
        max_tokens: the model's ``max_position_embeddings``, or None: a text prompt of more tokens is
            refused without being tokenized whole (:func:`~gemma_export.runtime.encode_prompt`).
        limit: how that refusal names ``max_tokens`` (:func:`~gemma_export.runtime.limit_name`).

    Returns:
        ``(text or None, ids)`` per prompt, in file order; never empty.

    Raises:
        GemmaExportError: a text prompt of more than ``max_tokens + 1`` tokens
            (:func:`~gemma_export.runtime.encode_prompt`; the exact length is checked later).
        SourceNotFoundError: no such file, or unreadable.
        FormatError: not UTF-8, unreadable JSON, entries of another kind (a text prompt without a
            tokenizer, a lone surrogate, an empty or negative id list), or no prompts.
    """
    if path is None:
        items: list = list(DEFAULT_PROMPTS)
    else:
        path = Path(path)
        raw = read_text_file(path, "prompts file", whole_limit=SMALL_FILE_BYTES)
        items = None
        if path.suffix.lower() == ".json":
            try:
                items = json.loads(raw)
            except (ValueError, RecursionError) as exc:
                raise FormatError(f"{path}: not JSON ({exc}); expected a JSON list of prompts (texts or id "
                                  "lists); a file of another name is read as one prompt per line") from None
            if not isinstance(items, list):
                raise FormatError(f"{path}: expected a JSON list of prompts, found {shown(items)}")
        elif raw.lstrip().startswith("["):  # a JSON list under another name (ids.txt, /dev/stdin)
            with contextlib.suppress(ValueError, RecursionError):
                items = json.loads(raw)  # a list: the text starts with '['
        if items is None:
            items = [line for line in raw.splitlines() if line.strip()]
    prompts = []
    for n, item in enumerate(items):
        if isinstance(item, str):
            if tokenizer is None:
                raise FormatError(f"{path or 'the default prompts'}: prompt #{n} is text, but the export has no "
                                  "tokenizer.json; give --prompts with token ids (a JSON list of id lists)")
            if not_unicode_at(item) is not None:
                raise FormatError(f"{path}: prompt #{n} is not valid Unicode text (a lone surrogate such as "
                                  f"\\ud800); found {item!r:.60}")
            prompts.append((item, encode_prompt(tokenizer, item, max_tokens, f"{path or 'the default prompts'}: prompt #{n}",
                                                limit)))
        elif isinstance(item, list) and item and all(is_whole_number(i) and i >= 0 for i in item):
            prompts.append((None, list(item)))
        else:
            # one prompt's ids given as the whole list: each id read as a prompt
            bare = items and all(is_whole_number(i) for i in items)
            hint = (f"; the file holds one list of {len(items)} numbers: for one prompt of ids, wrap it in a list "
                    f"([{shown(items)}])" if bare else "")
            raise FormatError(f"{path}: prompt #{n} is neither text nor a non-empty list of token ids: "
                              f"{shown(item)}{hint}")
    if not prompts:
        raise FormatError(f"{path}: no prompts")
    return prompts


#: keys of a golden entry (``generate --json`` writes them all; ``text`` is informative)
GOLDEN_KEYS = ("prompt", "prompt_ids", "expected_ids", "text", "prefill_chunk", "dtype")


class GoldenEntry(NamedTuple):
    """One golden entry (:func:`read_golden`): ids (Python ints), the prompt's step in tokens (None:
    the whole prompt in one step), and, when the file gives them, the prompt's text and the dtype of
    the export that wrote it."""

    prompt_ids: list[int]
    expected_ids: list[int]
    prefill_chunk: int | None
    prompt: str | None = None
    dtype: str | None = None


def read_golden(path: str | Path, prompts: list[tuple[str | None, list[int]]], tokenizer,
                prompts_file: str | Path | None = None, max_tokens: int | None = None) -> list[GoldenEntry]:
    """The entries of a golden file.

    Accepted JSON: the board team's bare list of expected greedy ids (the generated tokens only,
    for the first prompt), an object ``{"prompt" | "prompt_ids": ..., "expected_ids": [...]}``, or a
    list of such objects. An entry with both ``prompt`` and ``prompt_ids`` must have them agree under
    the export's tokenizer (when it has one). An optional ``prefill_chunk`` (written by ``generate
    --json``: the prompt's step in tokens, 0 = one step; default ``runtime.DEFAULT_PREFILL_CHUNK``)
    is how the prompt is fed again: an int8 export's logits move by up to ~0.7 with the step (its
    activations are rounded to 8 bits, which magnifies float-order differences), enough to flip a
    near-tied greedy token. An optional ``dtype`` (also written by ``generate --json``) names the
    export that wrote the entry, so that a mismatch on an export of another dtype says so.

    ``prompts_file``: the ``--prompts`` file that ``prompts`` came from, when only the golden check
    uses it; only a bare list of ids takes its prompt from there, and that is one prompt.

    Args:
        path: the golden file.
        prompts: :func:`read_prompts`' result; a bare list of ids uses its first prompt.
        tokenizer: the export's tokenizer, or None.
        prompts_file: see above.
        max_tokens: the model's ``max_position_embeddings``, or None: a text ``prompt`` of more
            tokens is refused without being tokenized whole.

    Returns:
        One :class:`GoldenEntry` per entry, prompts tokenized by :func:`~gemma_export.runtime.encode_prompt`.

    Raises:
        SourceNotFoundError, FormatError: naming the file and the entry.
        GemmaExportError: ``prompts_file`` given for a golden file that carries its own prompts, or
            with more than one prompt for a bare list of ids; a text prompt of more than
            ``max_tokens + 1`` tokens (the exact length is checked later).
    """
    path = Path(path)
    text = read_text_file(path, "golden file", whole_limit=SMALL_FILE_BYTES)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"{path}: not JSON ({exc}); expected a golden file: a JSON list of ids, or of "
                          "entries with 'prompt_ids' or 'prompt' and 'expected_ids'") from None

    def ids(value, what: str) -> list[int]:
        if not isinstance(value, list) or not value or not all(is_whole_number(i) and i >= 0 for i in value):
            raise FormatError(f"{path}: {what} must be a non-empty list of token ids, found {shown(value)}")
        return value

    bare = isinstance(data, list) and data and all(is_whole_number(i) for i in data)
    if prompts_file is not None and not bare:
        raise ConfigError(f"--prompts: with --golden alone the golden entries carry their own prompts ({path}); "
                               "--prompts applies to --against transformers and --reference")
    if bare:
        if not prompts:
            raise FormatError(f"{path}: a bare list of expected ids continues the first prompt, and the export has no "
                              "tokenizer.json for the default prompts; give --prompts with token ids (a JSON list of "
                              "id lists), or write the golden file as objects with prompt_ids and expected_ids")
        if prompts_file is not None and len(prompts) > 1:
            raise ConfigError(f"--prompts: {path} is a bare list of expected ids, which belongs to one prompt; "
                              f"{prompts_file} gives {len(prompts)}: give a --prompts file holding that prompt "
                              "alone, or write the golden file as objects with prompt_ids and expected_ids")
        return [GoldenEntry(prompts[0][1], ids(data, "the expected ids"), DEFAULT_PREFILL_CHUNK, prompts[0][0])]
    entries = [data] if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise FormatError(f"{path}: expected a list of token ids, an object or a list of objects; found {shown(data)}")
    pairs = []
    for n, entry in enumerate(entries):
        if not isinstance(entry, dict) or "expected_ids" not in entry or not ({"prompt", "prompt_ids"} & set(entry)):
            raise FormatError(f"{path}: entry #{n} needs 'expected_ids' and 'prompt' or 'prompt_ids'")
        unknown = [key for key in entry if key not in GOLDEN_KEYS]
        if unknown:
            raise FormatError(f"{path}: entry #{n} has key {shown(unknown[0])}; expected only "
                              f"{', '.join(GOLDEN_KEYS)}")
        if "prompt" in entry and not isinstance(entry["prompt"], str):
            raise FormatError(f"{path}: entry #{n} 'prompt' must be text, found {shown(entry['prompt'])}")
        if isinstance(entry.get("prompt"), str) and not_unicode_at(entry["prompt"]) is not None:
            raise FormatError(f"{path}: entry #{n} 'prompt' is not valid Unicode text (a lone surrogate such as "
                              f"\\ud800); found {entry['prompt']!r:.60}")
        if "prompt_ids" in entry:
            prompt_ids = ids(entry["prompt_ids"], f"entry #{n} 'prompt_ids'")
            if "prompt" in entry and tokenizer is not None and isinstance(entry["prompt"], str):
                encoded = encode_prompt(tokenizer, entry["prompt"], max_tokens, f"{path}: entry #{n} 'prompt'")
                # both given: they must be the same prompt (a file written before encode_prompt may
                # hold a text's own leading <bos> twice, as transformers encodes it)
                if prompt_ids not in (encoded, tokenizer.encode(entry["prompt"]).ids):
                    # shortened lists can look alike: the lengths and the first difference say where
                    first = next((i for i, (a, b) in enumerate(zip(encoded, prompt_ids)) if a != b),
                                 min(len(encoded), len(prompt_ids)))
                    raise FormatError(f"{path}: entry #{n} 'prompt' tokenizes to {shown(encoded)}, "
                                      f"not to its 'prompt_ids' {shown(prompt_ids)} ({len(encoded)} ids against "
                                      f"{len(prompt_ids)}, first different at position {first})")
        elif isinstance(entry["prompt"], str) and tokenizer is not None:
            prompt_ids = encode_prompt(tokenizer, entry["prompt"], max_tokens, f"{path}: entry #{n} 'prompt'")
        else:
            raise FormatError(f"{path}: entry #{n} has a text 'prompt' and no 'prompt_ids', and the export has no "
                              "tokenizer.json to encode it; give the entry its prompt_ids")
        chunk = entry.get("prefill_chunk", DEFAULT_PREFILL_CHUNK)
        if not is_whole_number(chunk) or chunk < 0:
            raise FormatError(f"{path}: entry #{n} 'prefill_chunk' must be a whole number of tokens >= 0 (0: the "
                              f"prompt in one step), found {shown(chunk)}")
        if "text" in entry and not isinstance(entry["text"], str):  # informative, but `generate --json` writes text
            raise FormatError(f"{path}: entry #{n} 'text' must be text, found {shown(entry['text'])}")
        dtype = entry.get("dtype")
        if dtype is not None and dtype not in DTYPES:  # the weights of the export that wrote it
            raise FormatError(f"{path}: entry #{n} 'dtype' must be one of {', '.join(DTYPES)}, found {shown(dtype)}")
        prompt = entry["prompt"] if isinstance(entry.get("prompt"), str) else None
        pairs.append(GoldenEntry(prompt_ids, ids(entry["expected_ids"], f"entry #{n} 'expected_ids'"), chunk or None,
                                 prompt, dtype))
    return pairs


# ---- comparisons --------------------------------------------------------------------------------
def _cosine_rows(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    denominator = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float(np.mean(np.sum(a * b, axis=-1) / np.where(denominator == 0, 1, denominator)))


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def sub_block_outputs(model, token_ids: Sequence[int]) -> dict[str, np.ndarray]:
    """What each layer's attention and MLP add to the residual stream in transformers: the
    outputs of ``post_attention_layernorm`` and ``post_feedforward_layernorm`` (forward hooks),
    keyed like the export's ``debug.layers.{i}.attention|mlp`` outputs, float32 ``[1, T, hidden]``.

    Args:
        model: a :func:`~gemma_export.quality.transformers_model`.
        token_ids: the ``T`` ids (not checked against the vocabulary: torch raises its own error).
    """
    import torch

    from .config import debug_output_name

    captured: dict[str, np.ndarray] = {}
    handles = []
    for i, layer in enumerate(model.model.layers):
        for block, module in (("attention", layer.post_attention_layernorm), ("mlp", layer.post_feedforward_layernorm)):
            name = debug_output_name(i, block)
            handles.append(module.register_forward_hook(
                lambda _m, _in, out, name=name: captured.__setitem__(name, out.detach().float().numpy())))
    try:
        with torch.no_grad():
            model(torch.tensor([list(token_ids)]))
    finally:
        for h in handles:
            h.remove()
    return captured


def first_divergence(export_outputs: dict[str, np.ndarray], reference_outputs: dict[str, np.ndarray],
                     num_layers: int, tolerance: float) -> dict:
    """The first ``(layer, block)`` in forward order whose relative error ``max|Δ| / max|reference|``
    exceeds ``tolerance``, with every sub-block's error.

    Args:
        export_outputs, reference_outputs: ``debug.layers.{i}.attention|mlp`` → float ``[1, T, hidden]``
            (:meth:`~gemma_export.runtime.OnnxDecoder.prefill_outputs`, :func:`sub_block_outputs`).
        num_layers: layers to compare, from 0.
        tolerance: the relative error (a ratio, no unit) beyond which a sub-block departs.

    Returns:
        ``{"tolerance", "first": {"layer", "block", "relative_error"} or None, "sub_blocks": [...]}``.

    Raises:
        KeyError: an output of a compared layer is missing from either dict.
    """
    from .config import DEBUG_BLOCKS, debug_output_name

    errors = []
    first = None
    for layer in range(num_layers):
        for block in DEBUG_BLOCKS:
            name = debug_output_name(layer, block)
            ours, theirs = export_outputs[name], reference_outputs[name]
            relative = float(np.abs(ours - theirs).max() / max(float(np.abs(theirs).max()), 1e-30))
            errors.append({"layer": layer, "block": block, "relative_error": relative})
            if first is None and relative > tolerance:
                first = {"layer": layer, "block": block, "relative_error": relative}
    return {"tolerance": tolerance, "first": first, "sub_blocks": errors}


# ---- the command --------------------------------------------------------------------------------
#: the sizes a reference's shapes give (:func:`~gemma_export.sources.mlir.map_globals`) that an export
#: compared with it must share (the vocabulary is compared with the graph's, below)
ARCHITECTURE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                       "intermediate_size")


def check_same_architecture(config, reference: str | Path, model_dir: Path) -> None:
    """Refuse a reference whose shapes give another architecture than the export's manifest: its
    verdict would be a FAIL of figures, not what it is, a comparison of two different models.
    Sizes the manifest lacks, or a reference the reader cannot map to Gemma weights (``config``
    None, :class:`~gemma_export.reference_iree.ReferenceInfo`), are not compared: IREE may still
    run it, and the comparison itself then decides.

    Raises:
        FormatError: a size differs (named, with both values).
    """
    if config is None:
        return
    for field in ARCHITECTURE_FIELDS:
        ours = manifest_figure(model_dir, field)
        if ours is not None and getattr(config, field) != ours:
            raise FormatError(f"{reference}: {field} {getattr(config, field)} (from its globals' shapes) differs from "
                              f"the export's {ours} ({model_dir}); not the same model")


def _listed_names(model_dir: Path) -> set[str]:
    """The file names ``model_dir``'s manifest lists (empty when it has no readable listing)."""
    from .manifest import read_manifest

    try:
        files = read_manifest(model_dir).get("files")
    except GemmaExportError:
        return set()
    return set(files) if isinstance(files, dict) else set()


def run_parity(model_dir: str | Path, *, against_transformers: bool = False, reference: str | Path | None = None,
               reference_weights: str | Path | None = None, reference_logits: bool = False,
               golden: str | Path | None = None, prompts: str | Path | None = None, new_tokens: int | None = None,
               threads: int | None = None, progress: Callable[[str], None] | None = None,
               prepacked: bool | None = None) -> ParityReport:
    """Compare an export with transformers, the reference export and/or a golden file.

    Args:
        model_dir: an export folder (``--debug-outputs`` exports also get the divergence report).
        against_transformers: compare logits with transformers fp32 on the export's source weights.
        reference, reference_weights: the reference ``.mlir`` and its archive (default: beside it).
        reference_logits: strip the reference's argmax tail to compare logits as well.
        golden: a golden file (see :func:`read_golden`).
        prompts: a prompts file (see :func:`read_prompts`); default :data:`DEFAULT_PROMPTS`.
        new_tokens: greedy tokens generated after each prompt for the comparison with transformers
            (default :data:`DEFAULT_NEW_TOKENS`); a golden entry generates as many as it expects.
        prepacked: the export's pre-packed copy, as in :class:`~gemma_export.runtime.OnnxDecoder`
            (the graph used is reported through ``progress``).

    Returns:
        A :class:`ParityReport`; a failed check is a verdict in it, not an exception.

    Raises:
        ConfigError: nothing to compare, unusable inputs, an option that no comparison asked for
            uses (``reference_weights``/``reference_logits`` without ``reference``, ``new_tokens``
            without ``against_transformers``, ``prompts`` with a golden file alone), a missing
            optional dependency; ``new_tokens`` < 1; a prompt as long as the reference's fixed
            length.
        GemmaExportError: a prompt and its new tokens (or a golden entry's ids) beyond
            ``max_position_embeddings`` (:func:`~gemma_export.runtime.check_positions`).
        SourceNotFoundError, FormatError: a reference whose files are missing or contradict each
            other (checked before the session, ``reference_iree.check_reference_options``); an unusable export folder, prompts or golden file (see
            :func:`read_prompts`, :func:`read_golden`); an id outside the vocabulary; a manifest that
            contradicts its graph; a reference of another vocabulary size or architecture
            (:func:`check_same_architecture`).
        VerificationError: a file the export's manifest lists differs from it (size or sha256:
            :func:`~gemma_export.verify.check_export_checksums`), or is missing (the tokenizer is
            named first, before the prompts that would need it).
        NumericError: the export computes NaN or +Inf logits.
        ResourceError: a KV cache would not fit in available memory.
    """
    check_arguments("run_parity", model_dir=(model_dir, "path"), against_transformers=(against_transformers, "bool"),
                    reference=(reference, "path?"), reference_weights=(reference_weights, "path?"),
                    reference_logits=(reference_logits, "bool"), golden=(golden, "path?"), prompts=(prompts, "path?"),
                    new_tokens=(new_tokens, "int?"), threads=(threads, "int?"), prepacked=(prepacked, "bool?"),
                    progress=(progress, "callable?"))
    from .quality import (compare_logits, config_differences, graph_line, manifest_checkpoint, require_transformers,
                          transformers_model)
    from .runtime import OnnxDecoder, check_export_folder, check_token_ids, load_tokenizer

    say = progress or (lambda _msg: None)
    if not (against_transformers or reference or golden):
        raise ConfigError("parity: nothing to compare; give --against transformers, --reference or --golden "
                          "(in Python: against_transformers=True, reference= or golden=)")
    if not reference and (reference_weights or reference_logits):
        option = "--reference-weights" if reference_weights else "--reference-logits"
        raise ConfigError(f"{option} applies to --reference, which is not given")
    if new_tokens is not None and not against_transformers:
        raise ConfigError("--new-tokens applies to --against transformers; a golden entry generates as many "
                          "tokens as it expects, and --reference runs its fixed length")
    new_tokens = DEFAULT_NEW_TOKENS if new_tokens is None else new_tokens
    if new_tokens < 1:
        raise ConfigError(f"--new-tokens must be >= 1, found {new_tokens}")
    if against_transformers:
        require_transformers("; or compare with --golden FILE or --reference REF.mlir only")
    ref_vocab = ref_length = None
    model_dir = Path(model_dir)
    if reference:  # its files, their contents and IREE before the session and the other comparisons
        from .reference_iree import check_reference_options

        info = check_reference_options(reference, reference_weights)
        ref_vocab, ref_length = info.vocab_size, info.sequence_length
        check_same_architecture(info.config, reference, model_dir)
    check_export_folder(model_dir)
    # no tokenizer is allowed (prompts and golden files as ids); a broken one is named
    tokenizer_path = model_dir / "tokenizer.json"
    tokenizer = load_tokenizer(model_dir) if tokenizer_path.exists() or tokenizer_path.is_symlink() else None
    if tokenizer is None and tokenizer_path.name in _listed_names(model_dir):
        # removed after the export: not an export without a tokenizer, whose advice (prompts as ids)
        # would then fail on the checksum pass (a break-it run)
        raise VerificationError(f"{tokenizer_path}: listed in the manifest but missing (the folder changed after "
                                "the export: export it again; gemma-export verify checks every file)")
    # the prompt and golden files are read before the (slow) session, so their errors come first
    golden_only = not (against_transformers or reference)
    # the default prompts are text: an export without a tokenizer runs a golden file's own prompt ids
    # a text longer than the model's positions is refused before it is tokenized whole (the default
    # prompts, which a golden file alone never runs, are short and checked later if they run)
    positions = max_positions(model_dir)  # a genai folder: its genai_config.json
    prompt_list = [] if golden_only and prompts is None and tokenizer is None else read_prompts(
        prompts, tokenizer, positions if prompts is not None else None, limit_name(model_dir))
    golden_pairs = read_golden(golden, prompt_list, tokenizer, prompts if golden_only else None,
                               positions) if golden else []

    def check_inputs(vocab: int | None, limit: int | None) -> None:
        """Every prompt and golden id inside the vocabulary, every sequence inside the positions, and
        the reference (its vocabulary, its fixed length) able to run the prompts."""
        if vocab and ref_vocab is not None and ref_vocab != vocab:
            raise FormatError(f"{reference}: vocabulary {ref_vocab} differs from the export's {vocab}")
        for n, (_, ids) in enumerate(prompt_list if ref_length is not None else []):  # every prompt is compared
            if len(ids) >= ref_length:
                raise GemmaExportError(f"{prompts or 'the default prompts'}: prompt #{n} has {len(ids)} tokens; "
                                       f"{reference} runs a fixed {ref_length} tokens, so a prompt may have at most "
                                       f"{ref_length - 1} (room to generate)")
        if vocab:
            run = [g.prompt_ids for g in golden_pairs]  # golden only: the prompts a golden entry runs (a bare list's)
            for n, (_, ids) in enumerate(prompt_list):
                if against_transformers or reference or ids in run:
                    check_token_ids(ids, vocab, f"{prompts or 'the default prompts'}: prompt #{n}")
            for n, g in enumerate(golden_pairs):
                check_token_ids(g.prompt_ids + g.expected_ids, vocab, f"{golden}: entry #{n}")
        generated = new_tokens if against_transformers else 0  # the reference runs its own fixed length
        # (what, its positions, where they come from)
        checked = [(f"{prompts or 'the default prompts'}: prompt #{n}", positions_needed(len(ids), generated),
                    f"{len(ids)} prompt tokens and --new-tokens {generated}")
                   for n, (_, ids) in enumerate(prompt_list) if against_transformers or reference]
        checked += [(f"{golden}: entry #{n}", positions_needed(len(g.prompt_ids), len(g.expected_ids)),
                     f"{len(g.prompt_ids)} prompt tokens and {len(g.expected_ids)} expected ids")
                    for n, g in enumerate(golden_pairs)]
        for what, total, parts in checked:
            if limit and total > limit:
                raise GemmaExportError(f"{what}: {total} tokens (the prompt and the new tokens fed back) exceed "
                                       f"{limit_name(model_dir)} {limit} ({model_dir}): {parts}, less the last")

    # with the manifest's figures, before the (slow) session; the session checks that they are the
    # graph's, so the loaded graph's are needed only where the manifest lacks them
    vocab, limit = manifest_figure(model_dir, "vocab_size"), positions
    try:
        check_inputs(vocab, limit)
    except GemmaExportError:
        # the manifest's figures may be the wrong ones: a manifest that contradicts its graph is
        # named (from the graph alone, no session); if it does not, the inputs are at fault after all
        check_manifest_matches_graph(model_dir)
        raise
    # the export's source (moved, changed) before the (slow) session; transformers reads it later
    source_checkpoint = manifest_checkpoint(model_dir) if against_transformers else None
    # the verdict rests on the numbers: a weight damaged after the export gave logits close enough to
    # pass (a break-it run: a changed down_proj passed against transformers, KL 1.9e-5); after every
    # check of the inputs, whose errors come first, right before the session
    from .verify import check_export_checksums

    if check_export_checksums(model_dir):
        say("the export's files match its manifest (sha256)")
    from .prepack import status, verify as verify_prepacked

    # the pre-packed copy the session will load instead of the files above, against its own record (a
    # copy damaged at the same size and time loads: onnxruntime checks only some of its bytes); one the
    # session skips (stale, foreign, unreadable: it says so) is not the verdict's business
    if prepacked is True or (prepacked is None and status(model_dir).path is not None):
        if note := verify_prepacked(model_dir):
            say(note)
    decoder = OnnxDecoder(model_dir, threads=threads, prepacked=prepacked)
    say(graph_line(decoder))
    dtype = decoder.dtype  # the graph's weights (a manifest that says otherwise was refused)
    limits = THRESHOLDS.get(dtype, THRESHOLDS["int4"])
    if vocab is None or limit is None:  # before any prompt runs
        check_inputs(decoder.vocab_size, decoder.max_position_embeddings)
    debug_names = [o.name for o in decoder.session.get_outputs() if o.name.startswith("debug.layers.")]

    hf_model = None
    if against_transformers:
        say("reference: transformers fp32 on the export's source weights")
        for line in config_differences(source_checkpoint):
            say(line)
        hf_model = transformers_model(source_checkpoint)
    ref_model = None
    if reference:
        from .reference_iree import load_reference

        say(f"reference: compiling {reference} with IREE for this CPU")
        ref_model = load_reference(reference, reference_weights, logits=reference_logits)

    results: list[PromptParity] = []
    pooled: list = []  # each prompt's QualityMetrics against transformers, pooled over positions below
    pooled_ref: list[np.ndarray] = []
    if hf_model is None and ref_model is None:  # golden only: its entries carry their own prompts
        prompt_list = []
    for text, ids in prompt_list:
        n = len(results)  # numbered from 0, as the errors and golden entries number them
        say(f"prompt #{n} ({n + 1} of {len(prompt_list)}): {_count(len(ids), 'token')}")
        entry = PromptParity(text, ids)
        if hf_model is not None:
            from .quality import transformers_logits

            continuation, _, _ = decoder.greedy(ids, new_tokens, stop_ids=())  # the sequence compared
            sequence = ids + continuation[:-1]
            ours = decoder.teacher_forced_logits(sequence)
            theirs = transformers_logits(None, sequence, model=hf_model)
            metrics = compare_logits(theirs, ours, sequence)
            pooled.append(metrics)
            entry.transformers = {
                "positions": len(sequence), "max_abs_logit_diff": metrics.max_abs_logit_diff,
                "cosine": _cosine_rows(ours, theirs), "top1_agreement": metrics.top1_agreement,
                "kl_mean": metrics.kl_mean, "first_top1_difference": metrics.first_disagreement}
            if debug_names:
                outputs = decoder.prefill_outputs(sequence, debug_names)
                entry.divergence = first_divergence(outputs, sub_block_outputs(hf_model, sequence),
                                                    len(debug_names) // 2, limits["sub_block"])
        if ref_model is not None:
            entry.reference = _against_reference(decoder, ref_model, ids)
            if entry.reference.get("positions"):
                pooled_ref.append(scored_reference_agreement(entry.reference))
        results.append(entry)
    for n, g in enumerate(golden_pairs):
        expected = g.expected_ids
        say(f"golden entry #{n} ({n + 1} of {len(golden_pairs)}): {_count(len(g.prompt_ids), 'prompt token')}, "
            f"{len(expected)} expected")
        got, _, _ = decoder.greedy(g.prompt_ids, len(expected), stop_ids=(), prefill_chunk=g.prefill_chunk)
        # a prompt given twice (or also in --prompts) gets each golden entry checked, none overwritten
        entry = next((r for r in results if r.prompt_ids == g.prompt_ids and r.golden is None), None)
        if entry is None:
            entry = PromptParity(g.prompt, g.prompt_ids)
            results.append(entry)
        entry.golden = {"entry": n, "expected_ids": expected, "export_ids": got, "match": got == expected,
                        "first_mismatch": _first_difference(got, expected), "dtype": g.dtype}

    return ParityReport(str(model_dir), dtype, results, _checks(pooled, pooled_ref, results, limits))


def _checks(pooled: list, pooled_ref: list[np.ndarray], results: list[PromptParity], limits: dict) -> list[Check]:
    """The verdicts of a run: top-1 agreement and mean KL against transformers, pooled over every
    position of every prompt (``pooled``: each prompt's ``QualityMetrics``), the share of tokens
    equal to the reference's (``pooled_ref``: each prompt's per-position agreement, near-ties
    counted as agreeing), and each golden entry's exact match, against ``limits`` (:data:`THRESHOLDS`
    of the export's dtype)."""
    checks = []
    if pooled:
        positions = sum(m.tokens for m in pooled)
        top1 = sum(m.tokens - m.disagreements for m in pooled) / positions
        kl = sum(m.kl_mean * m.tokens for m in pooled) / positions
        checks.append(Check("top-1 agreement with transformers", top1, f">= {limits['top1']:g}", top1 >= limits["top1"]))
        checks.append(Check("mean KL(transformers || export), nats/token", kl, f"<= {limits['kl']:g}", kl <= limits["kl"]))
    if pooled_ref:
        share = float(np.concatenate(pooled_ref).mean())
        checks.append(Check("tokens equal to the reference's (near-ties excepted)", share,
                            f">= {limits['reference_tokens']:g}", share >= limits["reference_tokens"]))
    for r in results:
        if r.golden is not None:
            count = len(r.golden['expected_ids'])
            checks.append(Check(f"golden entry #{r.golden['entry']} ({count} token{'' if count == 1 else 's'})",
                                "match" if r.golden["match"] else f"differs at {r.golden['first_mismatch']}",
                                "exact", r.golden["match"]))
    return checks


def scored_reference_agreement(reference: dict) -> np.ndarray:
    """The positions of one prompt that count towards the reference check: bool, shape
    ``(prompt_positions,)``, True where the export's token equals the reference's or the two
    differ at a near-tie (a tie either way is no departure). The padding's positions are left out:
    the board never reads them. ``reference`` is :func:`_against_reference`'s result."""
    agree = np.asarray(reference["agreement_by_position"], bool)
    agree[reference["near_tie_mismatches"]] = True
    return agree[:reference["prompt_positions"]]


def _against_reference(decoder, ref_model, ids: list[int]) -> dict:
    length = ref_model.sequence_length  # prompts are shorter (checked in run_parity)
    padded = ids + [0] * (length - len(ids))
    ours = decoder.teacher_forced_logits(padded)
    out = ref_model.run(ids)
    theirs_tokens = out.argmax(-1) if ref_model.returns_logits else out
    agree = ours.argmax(-1) == theirs_tokens
    top2 = np.sort(ours, axis=-1)[:, -2:]
    near_tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    greedy_ref = ref_model.greedy(ids, length - len(ids))
    greedy_ours, _, _ = decoder.greedy(ids, len(greedy_ref), stop_ids=())
    # the board reads the positions whose inputs are the prompt (the last one gives the first new
    # token); after them come padding ids it never reads (its loop writes each new token over the
    # padding and re-runs): those are reported, not scored
    scored = agree[:len(ids)]
    result = {"positions": length, "prompt_positions": len(ids), "agreement": float(scored.mean()),
              "padding_agreement": float(agree[len(ids):].mean()) if length > len(ids) else None,
              "agreement_by_position": agree.tolist(),
              "near_tie_mismatches": np.flatnonzero(~agree & near_tie).tolist(),
              "first_mismatch": int(np.flatnonzero(~scored)[0]) if not scored.all() else None,
              "reference_greedy_ids": greedy_ref, "export_greedy_ids": greedy_ours,
              "greedy_match": greedy_ref == greedy_ours,
              # the first generated token (counting from 0) where the two greedy runs part, None when equal
              "greedy_first_difference": _first_difference(greedy_ref, greedy_ours)}
    if ref_model.returns_logits:  # over the scored positions, as the agreement (the padding's logits are not read)
        result["max_abs_logit_diff"] = float(np.abs(ours[:len(ids)] - out[:len(ids)]).max())
    return result


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def format_report(report: ParityReport) -> str:
    """The table ``gemma-export parity`` prints (KL in nats/token, logit differences in logits),
    joined by newlines, ending with the ``verdict:`` line."""
    lines = [f"parity of {report.model} ({report.dtype})"]
    for n, p in enumerate(report.prompts, start=1):
        label = repr(p.prompt) if p.prompt is not None else f"ids {p.prompt_ids[:8]}{'...' if len(p.prompt_ids) > 8 else ''}"
        lines.append(f"prompt {n}: {label} ({_count(len(p.prompt_ids), 'token')})")
        if p.transformers:
            t = p.transformers
            first = "none" if t["first_top1_difference"] is None else str(t["first_top1_difference"])
            lines.append(f"  transformers: {t['positions']} positions, top-1 {100 * t['top1_agreement']:.1f}%, "
                         f"KL {t['kl_mean']:.2e}, max|dlogit| {t['max_abs_logit_diff']:.3g}, cosine {t['cosine']:.6f}, "
                         f"first top-1 difference: {first}")
        if p.divergence:
            first = p.divergence["first"]
            where = (f"layer {first['layer']} {first['block']} (relative error {first['relative_error']:.3g})"
                     if first else "none")
            lines.append(f"  first sub-block beyond {p.divergence['tolerance']:g}: {where}")
        if p.reference:
            r = p.reference
            first = "none" if r["first_mismatch"] is None else str(r["first_mismatch"])
            extra = f", max|dlogit| {r['max_abs_logit_diff']:.3g}" if "max_abs_logit_diff" in r else ""
            scored = r["prompt_positions"]
            ties = sum(1 for i in r["near_tie_mismatches"] if i < scored)
            ties = f" ({ties} at near-ties)" if ties else ""
            padding = r["agreement_by_position"][scored:]
            padding = f"; padding {sum(padding)}/{len(padding)} (not scored)" if padding else ""
            lines.append(f"  reference (IREE): tokens equal at {sum(r['agreement_by_position'][:scored])}/{scored} "
                         f"prompt positions, first mismatch: {first}{ties}{padding}; greedy "
                         + ("identical" if r["greedy_match"] else
                            f"differs from generated token {r['greedy_first_difference']} (counting from 0)")
                         + f" ({len(r['reference_greedy_ids'])} tokens){extra}")
        if p.golden:
            g = p.golden
            first = f"first mismatch at generated token {g['first_mismatch']} (counting from 0)"
            # a failing entry written by an export of another dtype: the likely reason
            other = not g["match"] and g.get("dtype") not in (None, report.dtype)
            lines.append(f"  golden entry #{g['entry']}: {'match' if g['match'] else first} "
                         f"(expected {g['expected_ids']}, export {g['export_ids']})"
                         + (f"; written with {g['dtype']} weights, this export has {report.dtype}" if other else ""))
    lines.append("")
    lines.append(f"{'check':<52} {'measured':>14} {'threshold':>10}  result")
    for c in report.checks:
        measured = f"{c.measured:.6g}" if isinstance(c.measured, float) else str(c.measured)
        lines.append(f"{c.name:<52} {measured:>14} {c.threshold:>10}  {'pass' if c.passed else 'FAIL'}")
    lines.append(f"verdict: {'PASS' if report.passed else 'FAIL'}"
                 + ("" if report.checks else " (nothing was compared)"))
    return "\n".join(lines)
