"""Teacher-forced quality of an export against a reference on real text.

Row ``i`` of a logits matrix ``[T, V]`` predicts token ``i + 1``. For two such matrices on the same
token ids this module computes, row chunk by row chunk (:class:`LogitComparison`; a 3,400-token text
over a 262,144-word vocabulary is 3.6 GB of float32 per model, so ``gemma-export quality`` runs the
reference and the export side by side and holds only a chunk of each):

- top-1 agreement: share of rows whose argmax is equal (overall and past position ``sliding_window``,
  512 in Gemma 3 270M, where the local layers start to drop tokens: the window the graph was built
  with, :func:`model_sliding_window`);
- mean KL(reference ‖ model) in nats per token, ``sum_v p_v (log p_v - log q_v)`` with
  ``p``/``q`` the softmax of the reference/model row;
- max |Δlogit|;
- how close the reference's calls were where the two disagree: the largest reference margin
  ``r[argmax r] - r[argmax q]`` over the disagreeing rows (small: every miss was a near-tie), and
  the median absolute change of the reference's top-1 − top-2 logit gap, ``|(q_a - q_b) - (r_a - r_b)|``
  with ``a``/``b`` the reference's two best words (how far the export moves close calls);
- perplexity of each on the text, ``exp(mean_i -log q(ids[i+1] | row i))`` (None when it exceeds
  float64's range, so that ``--json`` stays JSON).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from .checkpoint import EMBED, LM_HEAD
from .config import GEMMA3_270M_SLIDING_WINDOW, SLIDING
from .errors import (ConfigError, FormatError, GemmaExportError, NumericError, OutputError, SourceNotFoundError,
                     check_arguments, is_whole_number, reworded, shown)
from .runtime import CHUNK_ROWS, limit_name, max_positions
from .text_files import first_tokens



@dataclasses.dataclass(frozen=True)
class QualityMetrics:
    """Teacher-forced comparison of a model against a reference on ``tokens`` positions.

    Shares are fractions in [0, 1]; logit figures are in logits (natural-log units of the softmax);
    KL is in nats per token: ``mean_i sum_v p_v (log p_v - log q_v)`` (Kullback & Leibler 1951),
    ``p``/``q`` the softmax of the reference's/model's row ``i``. Perplexity is ``exp`` of the mean
    negative log-likelihood of the next token over the ``tokens - 1`` rows that have one, as in
    transformers' guide "Perplexity of fixed-length models" (``tokens`` ≥ 2: :class:`LogitComparison`
    refuses fewer); None when that ``exp`` exceeds float64's range (a mean above ~709.8 nats/token,
    logits in the thousands): a number JSON has (``null``) rather than ``Infinity``, which strict
    parsers refuse.
    """

    tokens: int
    top1_agreement: float
    sliding_window: int | None  # positions; the split below; None: not known for this model
    top1_agreement_past_window: float | None  # rows from ``sliding_window`` on; None when there are none
    kl_mean: float  # nats/token
    max_abs_logit_diff: float
    perplexity: float | None  # None: beyond float64 (above ~1.8e308)
    reference_perplexity: float | None
    first_disagreement: int | None  # first row whose argmax differs
    disagreements: int = 0  # rows whose argmax differs
    disagreement_margin_max: float | None = None  # logits; max over those rows of r[argmax r] - r[argmax q]
    top2_gap_change_median: float = 0.0  # logits; median over rows of |(q_a - q_b) - (r_a - r_b)|

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (``--json``)."""
        return dataclasses.asdict(self)


def _perplexity(nll: np.ndarray) -> float | None:
    """``exp`` of the mean of float64 ``nll`` (nats), or None when it exceeds float64's range (a mean
    above ``log(1.8e308)`` ≈ 709.8): ``math.exp`` raises there, where ``np.exp`` warns and gives inf."""
    try:
        return math.exp(float(nll.mean()))
    except OverflowError:
        return None


def _described(value) -> str:
    """A value a function refuses, for its message: an array as its type, dtype and shape, anything
    else as its type and its ``reprlib`` repr (a few items of each level: a logit row is 262,144 wide)."""
    import reprlib

    if isinstance(value, np.ndarray):
        return f"{type(value).__name__} {value.dtype} {list(value.shape)}"
    text = reprlib.repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _token_ids(function: str, token_ids, vocab_size: int | None = None) -> np.ndarray:
    """``token_ids`` as int64 ``[T]``, each id checked to lie in ``0 … vocab_size - 1`` (only ``>= 0``
    when ``vocab_size`` is None): a negative id would index the logits from the end and score the
    wrong word. O(T), not O(T·V).

    Raises:
        ConfigError: not a sequence or 1-D array of ints (a nested list, floats, bools), or an id
            outside the vocabulary, naming ``function``, the position and the id.
    """
    check_arguments(function, token_ids=(token_ids, "ids"))
    try:
        given = np.asarray(token_ids)
    except (ValueError, TypeError):  # a ragged nested list
        given = None
    if given is None or given.ndim != 1 or (given.size and given.dtype.kind not in "iu"):
        raise ConfigError(f"{function}(): token_ids must be a sequence (list, tuple, 1-D array) of ints, found "
                          f"{_described(token_ids)}")
    ids = given.astype(np.int64)  # a uint64 beyond int64 wraps negative: refused below with the id given
    if ids.size:
        limit = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
        bad = np.flatnonzero((ids < 0) | (ids >= limit))
        if len(bad):
            words = f"0 to {vocab_size - 1}, the logits' {vocab_size:,} words" if vocab_size is not None else "0 or more"
            raise ConfigError(f"{function}(): token_ids[{bad[0]}] must be a word of the vocabulary ({words}), found "
                              f"{given[bad[0]]}")
    return ids


def _check_sliding_window(function: str, sliding_window) -> None:
    """``sliding_window`` is a positive int (positions) or None (not known).

    Raises:
        ConfigError: naming ``function`` and the value.
    """
    check_arguments(function, sliding_window=(sliding_window, "int?"))
    if sliding_window is not None and sliding_window < 1:
        raise ConfigError(f"{function}(): sliding_window must be at least 1 (positions) or None (not known), found "
                          f"{sliding_window}")


def _check_logits(function: str, **matrices) -> None:
    """Each of ``matrices`` (name → value) is a float numpy array ``[rows, V]`` with ``V`` ≥ 1; its
    values are not read here (the NaN/Inf check is :meth:`LogitComparison.add`'s).

    Raises:
        ConfigError: naming ``function``, the argument and what it is.
    """
    for name, value in matrices.items():
        # numpy's floats, and ml_dtypes' (bfloat16: kind 'V', name "bfloat16"), which are used as float32
        floating = isinstance(value, np.ndarray) and (value.dtype.kind == "f" or "float" in value.dtype.name)
        if not (floating and value.ndim == 2 and value.shape[1] >= 1):
            raise ConfigError(f"{function}(): {name} must be a float numpy array [rows, V] with V >= 1 words, found "
                              f"{_described(value)}")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _kl_rows(reference: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Per row of two float32 ``[rows, V]`` logit matrices: KL(p ‖ q) in nats and both log-sum-exps
    (float64 ``[rows]`` each), p/q the softmax of ``reference``/``logits``; and max |Δlogit|.

    With ``d = reference - logits``, ``log p - log q = d + lse_q - lse_r`` and
    ``lse_q - lse_r = log Σ p·e^(-d)``, so ``KL = Σ p·d + log1p(Σ p·expm1(-d))``. Computed that way
    the softmax and the differences stay float32 (half the time of float64 log-softmaxes) and
    the two sums, accumulated in float64, cancel a relative error of ``p`` to first order: KL of
    1e-11 nats keeps three digits. Rows where ``expm1`` overflows (the export above the reference by
    more than ~88 on some word) are recomputed in float64.
    """
    m = reference.max(-1, keepdims=True)
    p = np.exp(reference - m)
    total = p.sum(-1, dtype=np.float64, keepdims=True)
    p *= (1.0 / total).astype(np.float32)
    lse_r = (m.astype(np.float64) + np.log(total))[:, 0]
    d = reference - logits
    with np.errstate(over="ignore", invalid="ignore"):
        shift = np.log1p((p * np.expm1(-d)).sum(-1, dtype=np.float64))
    kl = (p * d).sum(-1, dtype=np.float64) + shift
    lse_q = lse_r + shift
    bad = ~(np.isfinite(kl) & np.isfinite(lse_q))
    if bad.any():
        lp, lq = _log_softmax(reference[bad]), _log_softmax(logits[bad])
        kl[bad] = (np.exp(lp) * (lp - lq)).sum(-1)
        lse_q[bad] = logits[bad, 0] - lq[:, 0]
    return kl, lse_r, lse_q, float(max(d.max(), -d.min()))


class LogitComparison:
    """Accumulates the metrics of :func:`compare_logits` chunk by chunk, so that two long logit
    matrices never have to exist in full.

    Args:
        token_ids: the teacher-forced ids (length T, each ≥ 0; checked against the vocabulary when
            the first rows are added); row ``i`` predicts ``token_ids[i + 1]``.
        sliding_window: the model's ``sliding_window`` (positions, ≥ 1): top-1 agreement is also
            reported over the rows from there on, where the local layers no longer see the whole
            text; None when it is not known (no such split is reported). The default is Gemma 3
            270M's 512 (:data:`GEMMA3_270M_SLIDING_WINDOW`): give another model's own.

    The per-row state is float64 / bool ``[T]`` (a few bytes per token); the formulas are those of
    the module docstring and :class:`QualityMetrics`.

    Raises:
        GemmaExportError: fewer than 2 tokens (no row predicts a next token).
        ConfigError: ``token_ids`` not a sequence of ints ≥ 0, or ``sliding_window`` not an int ≥ 1
            or None.
    """

    def __init__(self, token_ids: Sequence[int], sliding_window: int | None = GEMMA3_270M_SLIDING_WINDOW):
        self.ids = _token_ids("LogitComparison", token_ids)
        _check_sliding_window("LogitComparison", sliding_window)
        self.sliding_window = sliding_window
        self.vocab_size: int | None = None  # V, from the first rows added
        n = len(self.ids)
        if n < 2:  # no row predicts a next token: perplexity would be the mean of nothing (NaN)
            raise GemmaExportError(f"logits: comparing needs at least 2 tokens (a row predicts the next), found {n}")
        self.agree, self.kl = np.zeros(n, bool), np.zeros(n)
        self.margin, self.gap_change = np.zeros(n), np.zeros(n)
        self.nll, self.ref_nll = np.zeros(n - 1), np.zeros(n - 1)
        self.max_diff, self.rows_seen = 0.0, 0

    def add(self, start: int, reference: np.ndarray, logits: np.ndarray) -> None:
        """Add rows ``start … start + len - 1`` of both matrices (float32 ``[rows, V]``, same shape).

        Args:
            start: index of the first row; must be the number of rows added so far.
            reference: the reference's logits ``[rows, V]`` (a numpy array of any float dtype, used as
                float32).
            logits: the model's logits, same shape.

        Raises:
            ConfigError: ``start`` not an int; ``reference`` or ``logits`` not a float numpy array
                ``[rows ≥ 1, V ≥ 1]``; (the first rows) a token id ≥ V.
            GemmaExportError: the shapes differ (from each other, or V from the earlier rows'), or
                the rows are not the next ones expected.
            NumericError: a row of either holds NaN or Inf (naming which and the row; the figures
                would otherwise come out as NaN, or as a max |Δlogit| of 0).
        """
        check_arguments("LogitComparison.add", start=(start, "int"))
        _check_logits("LogitComparison.add", reference=reference, logits=logits)
        if reference.shape[0] == 0 or logits.shape[0] == 0:  # its width would have fixed V for the later rows
            raise ConfigError(f"LogitComparison.add: expected rows of logits, found {list(reference.shape)} and "
                              f"{list(logits.shape)}")
        n = len(self.ids)
        width = self.vocab_size or reference.shape[1]
        if reference.shape != logits.shape or start != self.rows_seen or start + reference.shape[0] > n \
                or reference.shape[1] != width:
            raise GemmaExportError(f"logits: expected rows {self.rows_seen}… of two [T, V] matrices with T = {n} "
                                   f"tokens{f' and V = {width}' if self.vocab_size else ''}, found rows {start}… of "
                                   f"{list(reference.shape)} and {list(logits.shape)}")
        if self.vocab_size is None:  # every id, once: the targets index the rows, the first id is in the text
            _token_ids("LogitComparison.add", self.ids, reference.shape[1])
            self.vocab_size = reference.shape[1]
        # as float32, the type the figures are computed in: a float64 value beyond its range becomes Inf there
        with np.errstate(over="ignore"):  # named just below, as NaN or Inf
            reference, logits = reference.astype(np.float32, copy=False), logits.astype(np.float32, copy=False)
        for side, values in (("reference", reference), ("export", logits)):
            broken = ~np.isfinite(values).all(axis=-1)
            if broken.any():
                raise NumericError(f"logits: the {side}'s row {start + int(np.argmax(broken))} holds NaN or Inf (as "
                                   f"float32); the {side} does not compute finite logits")
        e = start + reference.shape[0]
        at = np.arange(reference.shape[0])
        best, picked = reference.argmax(-1), logits.argmax(-1)
        self.agree[start:e] = best == picked
        self.margin[start:e] = reference[at, best] - reference[at, picked]
        if reference.shape[1] > 1:
            second = np.argpartition(reference, -2, axis=-1)[:, -2:]  # the two best, in either order
            second = np.where(second[:, 0] == best, second[:, 1], second[:, 0])
            self.gap_change[start:e] = np.abs((logits[at, best] - logits[at, second])
                                              - (reference[at, best] - reference[at, second]))
        self.kl[start:e], lse_r, lse_q, max_diff = _kl_rows(reference, logits)
        self.max_diff = max(self.max_diff, max_diff)
        rows = np.arange(start, min(e, n - 1))
        if len(rows):
            targets = self.ids[rows + 1]
            self.nll[rows] = lse_q[rows - start] - logits[rows - start, targets]
            self.ref_nll[rows] = lse_r[rows - start] - reference[rows - start, targets]
        self.rows_seen = e

    def result(self) -> QualityMetrics:
        """The metrics over all rows.

        Returns:
            A :class:`QualityMetrics` with ``tokens`` = T.

        Raises:
            GemmaExportError: not every row was added.
        """
        n = len(self.ids)
        if self.rows_seen != n:
            raise GemmaExportError(f"logits: {self.rows_seen} of {n} rows compared")
        wrong = np.flatnonzero(~self.agree)
        window = self.sliding_window
        return QualityMetrics(
            tokens=n, top1_agreement=float(self.agree.mean()),
            sliding_window=window,
            top1_agreement_past_window=(float(self.agree[window:].mean())
                                        if window is not None and n > window else None),
            kl_mean=float(self.kl.mean()), max_abs_logit_diff=self.max_diff,
            perplexity=_perplexity(self.nll), reference_perplexity=_perplexity(self.ref_nll),
            first_disagreement=int(wrong[0]) if len(wrong) else None,
            disagreements=len(wrong),
            disagreement_margin_max=float(self.margin[wrong].max()) if len(wrong) else None,
            top2_gap_change_median=float(np.median(self.gap_change)))


def compare_logits(reference: np.ndarray, logits: np.ndarray, token_ids: Sequence[int], chunk: int = CHUNK_ROWS,
                   sliding_window: int | None = GEMMA3_270M_SLIDING_WINDOW) -> QualityMetrics:
    """Compare two teacher-forced logit matrices ``[T, V]`` (any float dtype, as float32) on the
    same ``token_ids`` (length T); ``sliding_window`` as in :class:`LogitComparison`.

    Args:
        reference, logits: ``[T, V]`` numpy arrays of any float dtype (float16, bfloat16, float64:
            used as float32), row ``i`` predicting ``token_ids[i + 1]``.
        token_ids: the ``T`` ids, each in ``0 … V - 1``.
        chunk: rows compared at a time (≥ 1).

    Returns:
        A :class:`QualityMetrics` (formulas and units there).

    Raises:
        ConfigError: an argument of the wrong type, ``chunk`` < 1, ``sliding_window`` < 1, or an id
            outside ``0 … V - 1`` (naming its position).
        GemmaExportError: shapes differ or do not match ``token_ids``, or fewer than 2 tokens (no
            row predicts a next token).
        NumericError: a row of either matrix holds NaN or Inf.
    """
    _check_logits("compare_logits", reference=reference, logits=logits)
    check_arguments("compare_logits", chunk=(chunk, "int"))
    if chunk < 1:
        raise ConfigError(f"compare_logits(): chunk must be at least 1 (rows compared at a time), found {chunk}")
    _check_sliding_window("compare_logits", sliding_window)
    token_ids = _token_ids("compare_logits", token_ids, reference.shape[1])
    if reference.shape != logits.shape or reference.shape[0] != len(token_ids):
        raise GemmaExportError(f"logits: expected two [T, V] matrices with T = {len(token_ids)} tokens, found "
                               f"{list(reference.shape)} and {list(logits.shape)}")
    comparison = LogitComparison(token_ids, sliding_window)
    for s in range(0, len(token_ids), chunk):
        comparison.add(s, reference[s:s + chunk], logits[s:s + chunk])
    return comparison.result()


TRANSFORMERS_MISSING = ("the transformers reference needs torch and transformers: "
                        "pip install torch==2.13.0 'transformers>=5,<6' (or the whole test extra: pip install -e '.[test]'; "
                        "where PyPI's torch is the CUDA build, add --extra-index-url https://download.pytorch.org/whl/cpu)")


def require_transformers(hint: str = "") -> None:
    """Fail fast, before any model is loaded, when the transformers reference cannot be built.

    Looks the packages up without importing them (``importlib.util.find_spec``).

    Args:
        hint: appended to the message (e.g. what works without the extra).

    Raises:
        GemmaExportError: torch or transformers is not installed.
    """
    import importlib.util

    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    if missing:
        raise GemmaExportError(f"{TRANSFORMERS_MISSING}; not installed: {', '.join(missing)}{hint}")


def _transformers_fields(c) -> dict:
    """A :class:`~gemma_export.config.GemmaConfig` as transformers' ``Gemma3TextConfig`` keyword
    arguments: the reference's config (:func:`transformers_model`), and what
    :func:`config_differences` compares with transformers' own reading."""
    return {
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "query_pre_attn_scalar": c.query_pre_attn_scalar, "sliding_window": c.sliding_window,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "layer_types": list(c.layer_types),
        "rope_parameters": {kind: {"rope_type": r.rope_type, "rope_theta": r.rope_theta,
                                   **({"factor": r.factor} if r.rope_type == "linear" else {})}
                            for kind, r in c.rope_parameters.items()},
        "final_logit_softcapping": c.final_logit_softcapping, "attn_logit_softcapping": c.attn_logit_softcapping,
    }


#: fields of :func:`_transformers_fields` that do not decide the logits: the position limit (a length
#: check), and attention soft-capping (transformers' Gemma3Attention never applies it)
_NOT_IN_LOGITS = ("max_position_embeddings", "attn_logit_softcapping")


def _inv_freq_terms(entry: dict) -> tuple:
    """``(rope_theta, linear factor)`` of a ``rope_parameters`` entry: what decides its ``inv_freq``."""
    return entry.get("rope_theta"), entry.get("factor", 1.0) if entry.get("rope_type") == "linear" else 1.0


def transformers_model(source):
    """transformers' ``Gemma3ForCausalLM`` (fp32, eager attention) holding a checkpoint's weights:
    the independent reference.

    Args:
        source: a :class:`~gemma_export.checkpoint.Checkpoint` (``open_source(...)``).

    Returns:
        A ``transformers.Gemma3ForCausalLM`` in eval mode, float32, its ``lm_head`` tied to the table
        when the source is tied.

    Raises:
        GemmaExportError: torch or transformers is not installed (they are test extras), the model
            does not take the weights, or ``query_pre_attn_scalar`` is not a whole number (transformers'
            config field is an int).
        FormatError, NumericError: a source tensor cannot be read, or holds NaN or Inf
            (:meth:`~gemma_export.checkpoint.TensorRef.load`).
    """
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise GemmaExportError(TRANSFORMERS_MISSING) from exc
    c = source.config
    if c.query_pre_attn_scalar != int(c.query_pre_attn_scalar):  # transformers' config field is an int
        raise GemmaExportError(f"query_pre_attn_scalar {c.query_pre_attn_scalar:g}: transformers' Gemma3TextConfig "
                               "takes a whole number, so it cannot be the reference for this model")
    config = transformers.Gemma3TextConfig(
        **{**_transformers_fields(c), "query_pre_attn_scalar": int(c.query_pre_attn_scalar)},
        attn_implementation="eager",
        # transformers ties by default: an untied source's lm_head would overwrite its table (or the reverse)
        tie_word_embeddings=source.tied)
    model = transformers.Gemma3ForCausalLM(config).eval()
    state = {name: torch.from_numpy(np.ascontiguousarray(ref.load())) for name, ref in source.tensors.items()}
    state.setdefault(LM_HEAD, state[EMBED])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if [m for m in missing if m != LM_HEAD] or unexpected:
        raise GemmaExportError(f"{source.path}: transformers reference did not take the weights: missing {missing}, "
                               f"unexpected {unexpected}")
    return model


def config_differences(source) -> list[str]:
    """Where transformers' own reading of a transformers folder's ``config.json`` differs from this
    toolkit's, in the fields that decide the logits: one ``note:`` line each, for the progress output.

    :func:`transformers_model` builds the reference from this toolkit's reading (a GGUF or a
    reference export has no ``config.json`` transformers reads), so a field read otherwise than
    transformers reads it would pass parity unseen; these notes show it (the export itself notes
    the one difference it makes on purpose, a 4.x ``rope_scaling`` spelled ``"type"``).

    Args:
        source: a :class:`~gemma_export.checkpoint.Checkpoint`.

    Returns:
        Nothing for a GGUF or a reference export, or when transformers is not installed or does not
        read the file (the reference then fails on its own, with its own message).
    """
    if source.identity.get("kind") != "hf":
        return []
    try:
        import transformers

        theirs = transformers.AutoConfig.from_pretrained(source.path, local_files_only=True).get_text_config()
    except Exception:  # noqa: BLE001 - a reading transformers refuses is reported by the reference itself
        return []
    fields = {k: v for k, v in _transformers_fields(source.config).items() if k not in _NOT_IN_LOGITS}
    rope_ours, rope_theirs = fields.pop("rope_parameters"), getattr(theirs, "rope_parameters", None) or {}
    pairs = {}  # field → (ours, theirs)
    for name, value in fields.items():
        other = getattr(theirs, name, None)
        pairs[name] = (value, list(other) if isinstance(other, (list, tuple)) else other)
    for kind, entry in rope_ours.items():
        pairs[f"rope_parameters.{kind} (rope_theta, linear factor)"] = (
            _inv_freq_terms(entry), _inv_freq_terms(rope_theirs.get(kind) or {}))
    lines = []
    for field, (value, other) in pairs.items():
        if other != value:
            lines.append(f"note: transformers {transformers.__version__} reads {source.path / 'config.json'} "
                         f"otherwise: {field} is {other!r} there, {value!r} here; the reference follows this "
                         "toolkit's reading, so parity with it does not cover that field")
    return lines


def transformers_logits(source, token_ids: Sequence[int], model=None) -> np.ndarray:
    """Logits of :func:`transformers_model` (``model``, or one built from ``source``) for every
    position of ``token_ids``: float32 ``[T, V]`` (the whole matrix at once: 1 MiB per token for
    Gemma's 262,144-word vocabulary).

    Raises:
        As :func:`transformers_model` when ``model`` is None; torch's own errors for ids outside
        the vocabulary (not checked here).
    """
    model = model if model is not None else transformers_model(source)  # raises a clear error without torch
    import torch

    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


def transformers_logit_chunks(model, token_ids: Sequence[int], chunk: int = CHUNK_ROWS):
    """The rows of :func:`transformers_logits`, ``chunk`` at a time: one forward pass of the decoder
    stack over all of ``token_ids`` (its hidden states are ``[T, hidden_size]``), then the LM head and
    the final logit soft-capping (as ``Gemma3ForCausalLM.forward``) per chunk of rows, so the
    ``[T, V]`` matrix is never built.

    Args:
        model: a :func:`transformers_model`.
        token_ids: the ``T`` ids (not checked against the vocabulary: torch raises its own error).
        chunk: rows per yielded array.

    Yields:
        ``(start, rows)``: float32 ``[≤ chunk, V]`` for positions ``start …``.
    """
    import torch

    with torch.no_grad():
        hidden = model.model(torch.tensor([list(token_ids)])).last_hidden_state
        cap = model.config.final_logit_softcapping
        for start in range(0, len(token_ids), chunk):
            logits = model.lm_head(hidden[:, start:start + chunk])
            if cap is not None:
                logits = torch.tanh(logits / cap) * cap
            yield start, logits[0].float().numpy()


@dataclasses.dataclass
class QualityReport:
    """``gemma-export quality`` for one export: metrics against ``reference`` on ``text_source``."""

    model: str
    reference: str
    text_source: str
    metrics: QualityMetrics

    def to_dict(self) -> dict:
        """The report as a JSON-ready dict: the three names and the metrics' fields, flat."""
        return {"model": self.model, "reference": self.reference, "text_source": self.text_source,
                **self.metrics.to_dict()}


def _manifest_source_record(model_dir: Path) -> dict:
    """The manifest's ``source`` object, with a ``path`` that exists.

    Raises:
        SourceNotFoundError: no manifest, no source path in it, or the source is gone.
        FormatError: the manifest is unreadable (:func:`~gemma_export.manifest.read_manifest`), so
            said rather than called missing.
    """
    from .errors import SourceNotFoundError
    from .onnx_files import MANIFEST_FILE
    from .manifest import read_manifest

    manifest = model_dir / MANIFEST_FILE
    loaded = read_manifest(model_dir)
    record = loaded.get("source")
    if not isinstance(record, dict) or "path" not in record:
        raise SourceNotFoundError(f"{manifest}: no field 'source.path' (the export's source); the reference needs "
                                  "that source")
    path = record["path"]
    if not isinstance(path, str) or not path.strip():
        raise SourceNotFoundError(f"{manifest}: field 'source.path' must be the export's source path (a non-empty "
                                  f"string), found {shown(path)}; the reference needs that source")
    if not Path(path).exists():
        raise SourceNotFoundError(f"{manifest}: the export's source {path} no longer exists")
    return record


def manifest_source(model_dir: Path) -> str:
    """The path of the source an export was made from (``manifest.json`` → ``source.path``).

    Raises:
        SourceNotFoundError: no manifest, no source path in it, or the source is gone.
        FormatError: the manifest is unreadable.
    """
    return _manifest_source_record(model_dir)["path"]


#: the file bytes are compared, not the values: a re-saved or re-indented source counts as changed
_CHANGED = ("it changed since the export, so it cannot serve as the export's reference; put the original "
            "back or export again from it")


def manifest_checkpoint(model_dir: Path):
    """The export's source (:func:`manifest_source`), opened, after checking that it still has the
    size (``source.bytes``) and the contents (``source.sha256``, see
    :meth:`~gemma_export.checkpoint.Checkpoint.content_sha256`) the manifest recorded: a different
    model moved to the same path, even one of the same size, would otherwise be blamed on the export.

    Raises:
        SourceNotFoundError: as :func:`manifest_source`, or the size or the contents differ.
        FormatError: ``source.bytes`` or ``source.sha256`` is present but not a size / a sha256 (or null).
        SourceNotFoundError, FormatError, ConfigError: the recorded source does not open
            (:func:`~gemma_export.sources.open_source`'s error, of its class, naming the manifest).
    """
    from .errors import ConfigError, FormatError, SourceNotFoundError, is_sha256, shown
    from .onnx_files import MANIFEST_FILE
    from .sources import open_source

    record = _manifest_source_record(model_dir)
    path, recorded, digest = record["path"], record.get("bytes"), record.get("sha256")
    manifest = model_dir / MANIFEST_FILE
    if "bytes" in record and not (is_whole_number(recorded) and recorded >= 0):
        raise FormatError(f"{manifest}: field 'source.bytes' must be a file size (integer >= 0), found {shown(recorded)}")
    if digest is not None and not is_sha256(digest):
        raise FormatError(f"{manifest}: field 'source.sha256' must be 64 lowercase hex digits (or null), found "
                          f"{shown(digest)}")
    try:
        checkpoint = open_source(path, tokenizer="tokenizer" not in record)  # the export's own tokenizer is used
    except (FormatError, ConfigError, SourceNotFoundError) as exc:  # name the manifest, which gave the path
        raise reworded(exc, f"{manifest}: field 'source.path' names {path}, which does not open as the export's "
                            f"source ({exc})") from None
    where = f"{manifest}: the export's source {path}"
    if isinstance(recorded, int) and checkpoint.identity.get("bytes") != recorded:
        raise SourceNotFoundError(f"{where} has {checkpoint.identity.get('bytes'):,} bytes now and had "
                                  f"{recorded:,} when the export was made; {_CHANGED}")
    if isinstance(digest, str):
        now = checkpoint.content_sha256()
        if now is not None and now != digest:
            raise SourceNotFoundError(f"{where} has other bytes now (sha256 {now[:12]}…, recorded "
                                      f"{digest[:12]}… when the export was made); {_CHANGED}")
    return checkpoint


def graph_line(decoder) -> str:
    """Which graph an :class:`~gemma_export.runtime.OnnxDecoder` loaded, for progress output."""
    if decoder.prepacked_path is not None:
        return f"graph: {decoder.prepacked_path} (pre-packed copy)"
    return f"graph: {decoder.model_dir / 'model.onnx'}" + (f"; {decoder.prepacked_note}" if decoder.prepacked_note else "")


def run_quality(model_dir: str | Path, reference: str = "transformers", text: str | Path | None = None,
                tokens: int | None = None, threads: int | None = None,
                progress=None, prepacked: bool | None = None) -> QualityReport:
    """Teacher-forced quality of an export on real text.

    Args:
        model_dir: an export folder.
        reference: ``transformers`` (fp32, eager, on the export's source weights), ``fp32`` (an fp32
            export of the same source, made in a temporary folder) or the path of an export folder.
        text: a text file (default: the Python license, ``bench.real_text``).
        tokens: use the first ``tokens`` tokens (default: all; at least 2 needed).
        threads: onnxruntime intra-op threads, 1 to 4 × this machine's CPUs (None: onnxruntime's
            default).
        prepacked: the export's pre-packed copy, as in :class:`~gemma_export.runtime.OnnxDecoder`
            (the graph used is reported through ``progress``).
        progress: called with one-line notes as the work goes (the graphs loaded, the reference's
            progress, the tokens scored); None: silent.

    Returns:
        A :class:`QualityReport` (metrics' units in :class:`QualityMetrics`).

    Raises:
        GemmaExportError: unusable folder, source or text; torch/transformers missing for
            ``transformers``; a reference export of another vocabulary size.
        ConfigError: fewer than 2 ``tokens``; ``threads`` out of range; an argument of the wrong type.
        SourceNotFoundError: (``transformers``, ``fp32``) the export's source is gone or changed
            since the export (:func:`manifest_checkpoint`).
        FormatError: a text id outside either model's vocabulary, or a folder :class:`OnnxDecoder`
            refuses.
        NumericError: either side computes NaN or Inf logits.
        ResourceError: a KV cache would not fit in available memory.
        OutputError: (``fp32``) the temporary reference export cannot be written (a full disk:
            the message names the folder and TMPDIR).
    """
    check_arguments("run_quality", model_dir=(model_dir, "path"), reference=(reference, "path"), text=(text, "path?"),
                    tokens=(tokens, "int?"), threads=(threads, "int?"), prepacked=(prepacked, "bool?"),
                    progress=(progress, "callable?"))
    import tempfile

    from .bench import real_text
    from .text_files import text_bytes_for
    from .runtime import OnnxDecoder, check_export_folder, load_tokenizer

    say = progress or (lambda _msg: None)
    if reference == "transformers":
        require_transformers("; or use --reference fp32 (an fp32 export of the same source, no extra needed)")
    elif reference != "fp32":  # a folder: named before the text is read and tokenized
        if not Path(reference).exists() and not Path(reference).is_symlink():  # a mistyped keyword: a missing folder
            raise SourceNotFoundError(f"{reference}: no such export folder; --reference takes transformers, fp32 or "
                                      "an export folder")
        try:
            check_export_folder(Path(reference))
        except SourceNotFoundError:
            try:
                transformers_folder = (Path(reference) / "config.json").is_file()
            except OSError:  # a folder this user may not search: the check's own message says so
                transformers_folder = False
            if not transformers_folder:
                raise
            raise SourceNotFoundError(f"--reference {reference}: a model folder with config.json, not an export; "
                                      "--reference transformers runs transformers on the export's own source, or "
                                      f"give an export of this folder (gemma-export --source {reference} --dtype fp32 "
                                      "--out DIR, then --reference DIR)") from None
    model_dir = Path(model_dir)
    if tokens is not None and tokens < 2:
        raise ConfigError(f"--tokens: expected at least 2, found {tokens}")
    # without --tokens, tokenize no further than one token past what the model can take (a huge
    # --text is refused after a prefix, not after tokenizing all of it), and read no more of the
    # file than those tokens can take up, as bench does (a 1 GB --text held 2 GB to score 20 tokens)
    limit = max_positions(model_dir)  # a genai folder: its genai_config.json (its whole text was tokenized)
    needed = tokens if tokens is not None or not limit else limit + 1
    if limit and needed is not None:  # --tokens beyond the positions (10**12) reads as one past them, not into a MemoryError
        needed = min(needed, limit + 1)
    max_bytes = None if needed is None else text_bytes_for(needed)
    body, source = real_text(text, max_bytes)
    ids = first_tokens(load_tokenizer(model_dir), body, needed)
    if len(ids) < 2:
        raise GemmaExportError(f"{source}: {len(ids)} token(s) after tokenizing; at least 2 are needed")
    # the export's source (moved, changed) before the (slow) session; its weights are read later
    source_checkpoint = manifest_checkpoint(model_dir) if reference in ("fp32", "transformers") else None
    decoder = OnnxDecoder(model_dir, threads=threads, prepacked=prepacked)
    say(graph_line(decoder))
    _check_fits(decoder, ids, source)
    window = model_sliding_window(decoder)  # a malformed genai_config.json refused before the reference is made
    if tokens and tokens > len(ids):  # fewer than asked: all there is, or all that was read (> 64 bytes a token)
        try:
            cut = max_bytes is not None and Path(source).stat().st_size > max_bytes
        except OSError:
            cut = False
        say(f"{len(ids)} tokens of {source} ({f'its first {max_bytes:,} bytes' if cut else 'the whole text'}; "
            f"{tokens} asked)")
    else:
        say(f"{len(ids)} tokens of {source}")
    # The reference and the export advance together, CHUNK_ROWS rows at a time: neither [T, V] logit
    # matrix (3.6 GB each for 3,400 tokens of Gemma's vocabulary) is ever held in full.
    if reference in ("fp32", "transformers") and Path(reference).exists():
        say(f"note: --reference {reference} is the keyword (a {'fresh fp32 export of the source' if reference == 'fp32' else 'transformers model'}), "
            f"not the folder ./{reference} here; give ./{reference} to use the folder")
    with contextlib.ExitStack() as stack:
        if reference == "transformers":
            say("reference: transformers fp32 on the export's source weights")
            for line in config_differences(source_checkpoint):
                say(line)
            ref_chunks = transformers_logit_chunks(transformers_model(source_checkpoint), ids, CHUNK_ROWS)
        else:
            if reference == "fp32":
                from .exporter import export

                if decoder.dtype == "fp32":
                    say("note: the export is fp32 itself: the fp32 reference is the same model made again (100% and "
                        "KL 0 expected); --reference transformers compares it with an independent implementation")

                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gemma-export-fp32-"))
                say("reference: exporting the source at fp32 into a temporary folder")
                started = last_line = time.monotonic()

                def written(done: int, total: int, _name: str) -> None:  # a line every 15 s
                    nonlocal last_line
                    if time.monotonic() - last_line >= 15 and done < total:
                        last_line = time.monotonic()
                        say(f"reference: {done} of {total} tensors written")

                try:
                    ref_dir = export(source_checkpoint.path, Path(tmp) / "fp32", "fp32", checkpoint=source_checkpoint,
                                     progress=written, status=lambda msg: say(f"reference: {msg}")).out_dir
                except OutputError as exc:  # no option names that folder: say which setting does
                    raise OutputError(f"{exc} (the temporary folder of --reference fp32, in {tempfile.gettempdir()}: "
                                      "set TMPDIR to put it on a disk with room)") from None
                say(f"reference: fp32 export written in {time.monotonic() - started:.0f} s")
            else:
                say(f"reference: the export in {reference}")
                if Path(reference).resolve() == model_dir.resolve():
                    say("note: --reference is the export being measured: 100% and KL 0 say only that its runs "
                        "repeat exactly; compare with fp32, transformers or another export to measure quality")
                ref_dir = reference
                for line in other_model_notes(model_dir, Path(reference)):
                    say(line)
            ref_decoder = OnnxDecoder(ref_dir, threads=threads)
            if ref_decoder.vocab_size != decoder.vocab_size:
                raise GemmaExportError(f"--reference {ref_dir}: its vocabulary has {ref_decoder.vocab_size:,} tokens, the "
                                       f"export's {decoder.vocab_size:,} ({model_dir}); compare exports of the same model")
            _check_fits(ref_decoder, ids, source, "--reference ")
            ref_chunks = ref_decoder.teacher_forced_chunks(ids, CHUNK_ROWS)
        say("running the export teacher-forced through its KV cache, beside the reference")
        comparison = LogitComparison(ids, window)
        last = time.monotonic()
        for (start, ref_rows), (_, rows) in zip(ref_chunks, decoder.teacher_forced_chunks(ids, CHUNK_ROWS)):
            try:
                comparison.add(start, ref_rows, rows)
            except NumericError as exc:  # which model: "the export's row 0" named neither
                where = model_dir if "the export's" in str(exc) else f"--reference {reference}"
                raise reworded(exc, f"{where}: {exc}") from None
            done = start + len(rows)
            if time.monotonic() - last >= 15 and done < len(ids):  # a line every 15 s on long texts
                last = time.monotonic()
                say(f"{done:,} of {len(ids):,} positions")
        metrics = comparison.result()
    return QualityReport(str(model_dir), str(reference), source, metrics)  # a Path given stays JSON-ready


def model_sliding_window(decoder) -> int | None:
    """The ``sliding_window`` (positions) an :class:`~gemma_export.runtime.OnnxDecoder`'s graph was
    built with, for the split of top-1 agreement: the graph's own metadata
    (``gemma_export.sliding_window``, read and checked by the decoder: its ``sliding_window``), else
    onnxruntime-genai's ``genai_config.json`` (``model.decoder.sliding_window.window_size``, which
    its builder writes for providers with a windowed cache), else, for a folder without a manifest,
    the largest ``local_window_size`` of its graph's ``GroupQueryAttention`` nodes (what the builder
    sets from ``sliding_window`` for the CPU; :func:`graph_local_window`), else the manifest's
    ``config.sliding_window`` unless its ``layer_types`` has no sliding layer; None when none of them
    records one: no window is made up.

    Raises:
        FormatError: ``genai_config.json`` is unreadable, or its ``model.decoder.sliding_window``
            is there but not an object with a ``window_size`` ≥ 1.
    """
    from .runtime import genai_model_config

    if decoder.sliding_window is not None:
        return decoder.sliding_window
    genai = genai_model_config(decoder.model_dir).get("decoder")
    if isinstance(genai, dict) and "sliding_window" in genai:
        field = genai["sliding_window"]
        window = field.get("window_size") if isinstance(field, dict) else None
        if not (is_whole_number(window) and window >= 1):
            raise FormatError(f"{decoder.model_dir / 'genai_config.json'}: field 'model.decoder.sliding_window' must be "
                              f"an object with a window_size >= 1 (positions), found {shown(field)}")
        return window
    if not decoder.manifest:  # onnxruntime-genai's CPU graph: its windowed GroupQueryAttention nodes
        window = graph_local_window(decoder.model_dir / "model.onnx")
        if window is not None:
            return window
    config = decoder.manifest.get("config", {})  # its fields were checked with the manifest
    if isinstance(config.get("layer_types"), list) and SLIDING not in config["layer_types"]:
        return None  # every layer sees the whole text: no rows past a window
    return config.get("sliding_window")


def graph_local_window(graph_path: Path) -> int | None:
    """The largest ``local_window_size`` (positions) of the ``GroupQueryAttention`` nodes of the ONNX
    graph at ``graph_path`` (its external data not read), None when no node has one above 0 (-1:
    the whole sequence) or the file cannot be read as a graph (the session that loaded it names why)."""
    from .onnx_files import read_graph

    try:
        model = read_graph(graph_path)
    except (GemmaExportError, OSError):
        return None
    windows = [a.i for node in model.graph.node if node.op_type == "GroupQueryAttention"
               for a in node.attribute if a.name == "local_window_size" and a.i > 0]
    return max(windows) if windows else None


def other_model_notes(model_dir: Path, reference_dir: Path) -> list[str]:
    """Notes (``note: ...`` lines) when an export folder given as the reference records another source
    (``source.sha256`` in both manifests) or another tokenizer (``files["tokenizer.json"].sha256``)
    than the export: the figures then compare different weights or different token ids, which is
    allowed (e.g. a GGUF against a transformers folder of the same model) but worth saying. Never raises."""
    from .manifest import read_manifest

    def recorded(folder: Path) -> tuple[str | None, str | None]:
        try:
            manifest = read_manifest(folder)
        except GemmaExportError:
            return None, None
        source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
        files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
        tokenizer = files.get("tokenizer.json") if isinstance(files.get("tokenizer.json"), dict) else {}
        digests = source.get("sha256"), tokenizer.get("sha256")
        return tuple(d if isinstance(d, str) else None for d in digests)

    (ours, our_tok), (theirs, their_tok) = recorded(model_dir), recorded(reference_dir)
    notes = []
    if ours and theirs and ours != theirs:
        notes.append(f"note: --reference {reference_dir} was exported from another source than {model_dir} (sha256 "
                     f"{theirs[:12]}… against {ours[:12]}…): the figures compare different weights")
    if our_tok and their_tok and our_tok != their_tok:
        notes.append(f"note: --reference {reference_dir} has another tokenizer.json than {model_dir}: the text is "
                     "tokenized by the export's, which the reference may read differently")
    return notes


def _check_fits(decoder, ids: Sequence[int], source: str, role: str = "") -> None:
    """The text's ids are inside the decoder's vocabulary and its positions inside its range.

    Raises:
        GemmaExportError: naming the folder, the limit and what to pass instead.
    """
    limit = decoder.max_position_embeddings
    if limit and len(ids) > limit:
        advice = (f"pass --tokens {limit} or fewer" if limit >= 2 else
                  "a model of fewer than 2 positions cannot be measured (at least 2 tokens are needed)")
        named = limit_name(decoder.model_dir).replace("the model's ", "its ")
        raise GemmaExportError(f"{role}{decoder.model_dir}: {source} has more than {limit} tokens, {named}; {advice}")
    decoder.check_ids(ids, source)


#: how a perplexity beyond float64 (:class:`QualityMetrics`' None) is shown
PERPLEXITY_OVERFLOW = "above float64's 1.8e308"

#: a miss where the reference's word led the export's by at most this many logits is a close call
#: (a ratio of e^0.5 ≈ 1.65 between the two words' probabilities); int8 misses on the real 270M lie
#: within 0.29 (docs/quality.md)
CLOSE_CALL_LOGITS = 0.5


def format_report(report: QualityReport) -> str:
    """Human-readable lines for a :class:`QualityReport` (shares as percentages, KL in nats/token,
    logit differences in logits; a perplexity beyond float64 as :data:`PERPLEXITY_OVERFLOW`), joined
    by newlines without a trailing one."""
    m = report.metrics
    if m.sliding_window is None:
        past = "the graph and its configuration record no sliding window"
    elif m.top1_agreement_past_window is None:
        past = f"the text ends within the sliding window of {m.sliding_window}"
    else:
        past = f"{m.top1_agreement_past_window:.2%} past the sliding window of {m.sliding_window}"
    perplexity, reference_perplexity = (PERPLEXITY_OVERFLOW if value is None else f"{value:.3f}"
                                        for value in (m.perplexity, m.reference_perplexity))
    first = (f"first at position {m.first_disagreement} (counting from 0)" if m.first_disagreement is not None
             else "none")
    return "\n".join([
        f"model        {report.model}",
        f"reference    {report.reference}",
        f"text         {m.tokens} tokens of {report.text_source}",
        f"top-1        {m.top1_agreement:.2%} of positions pick the reference's top word ({past})",
        f"misses       {m.disagreements} position(s), {first}"
        + (f"; at each, the reference preferred its word to the export's by at most {m.disagreement_margin_max:.3f} "
           f"logits ({'close calls' if m.disagreement_margin_max <= CLOSE_CALL_LOGITS else 'not all close calls'})"
           if m.disagreements else ""),
        f"top-2 margin the export changes the reference's top-1 minus top-2 logit by {m.top2_gap_change_median:.4f} "
        "(median over positions)",
        f"KL           {m.kl_mean:.5f} nats/token (reference || export)",
        f"perplexity   {perplexity} (reference {reference_perplexity})",
        f"max |dlogit| {m.max_abs_logit_diff:.4g}",
    ])
