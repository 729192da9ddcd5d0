"""A checkpoint: a validated :class:`GemmaConfig` plus lazy tensors under transformers' names.

Readers (``gemma_export.sources``) produce it; the graph builder consumes it and never learns where
the weights came from. Tensor values follow transformers' convention: RMSNorm weights hold ``w``
(the gain is ``1 + w``), linear weights are ``[out_features, in_features]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from quant.rows import first_non_finite

from .config import GemmaConfig
from .errors import FormatError, NumericError

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"


def largest_weight(tensors: Mapping[str, "TensorRef"]) -> str:
    """``NAME[i, j] = value (ORIGIN)`` of the largest magnitude among ``tensors`` (each read once, in
    float32): the first suspect when finite weights overflow float32 in a graph.

    Raises:
        NumericError: a tensor holds NaN or Inf (as :meth:`TensorRef.load`).
    """
    best = ("", 0.0, (), "")
    for name, ref in tensors.items():
        array = ref.load()
        if array.size:  # the largest and the smallest, no |array| copy (the table's is 671 MB)
            low, high = int(np.argmin(array)), int(np.argmax(array))
            flat = high if abs(float(array.flat[high])) >= abs(float(array.flat[low])) else low
            at = np.unravel_index(flat, array.shape)
            if abs(float(array[at])) > abs(best[1]):
                best = (name, float(array[at]), tuple(int(i) for i in at), ref.origin)
    name, value, at, origin = best
    return f"{name}[{', '.join(map(str, at))}] = {value:.3g} ({origin})"


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One tensor of a source, read on demand.

    Attributes:
        name: transformers name, e.g. ``model.layers.0.self_attn.q_proj.weight``.
        shape: shape in PyTorch order.
        origin: where it lives, for messages (``FILE:KEY``).
        reader: returns the values in the source's float dtype (float32, float16, bfloat16 or
            float64; memory-mapped where the source allows); :meth:`load` and :class:`RowView` give
            float32 (:meth:`as_float32`).
        row_reader: for a 2-D tensor, ``(start, stop)`` → ``[stop - start, K]`` in the same dtype,
            read without the rest (None: rows are sliced from :attr:`reader`'s whole tensor).
    """

    name: str
    shape: tuple[int, ...]
    origin: str
    reader: Callable[[], np.ndarray] = dataclasses.field(repr=False)
    row_reader: Callable[[int, int], np.ndarray] | None = dataclasses.field(default=None, repr=False, compare=False)

    def rows(self) -> "RowView":
        """A lazy view with ``shape`` and row slicing, read chunk by chunk (2-D tensors); falls
        back to one full :meth:`load` when the source cannot read row ranges."""
        return RowView(self)

    def load(self, allow_non_finite: bool = False) -> np.ndarray:
        """The tensor as float32, shape :attr:`shape`.

        Raises:
            FormatError: the reader returned another shape.
            NumericError: the tensor holds NaN or Inf (names the first index), unless allowed, or a
                float64 value beyond float32's range (:meth:`as_float32`).
        """
        array = self.as_float32(self.reader())
        if tuple(array.shape) != self.shape:
            raise FormatError(f"{self.origin}: read shape {tuple(array.shape)}, declared {self.shape}")
        if not allow_non_finite:
            self.check_finite(array)
        return array

    def as_float32(self, values, first_row: int = 0) -> np.ndarray:
        """``values`` (rows from ``first_row`` on) as float32; a finite float64 value beyond float32's
        range (an F64 1e300) is refused by name, instead of becoming an Inf that :meth:`check_finite`
        would report as if the file held one.

        Raises:
            NumericError: naming the first such value and its index.
        """
        values = np.asarray(values)
        if values.dtype != np.float64:
            return np.asarray(values, dtype=np.float32)
        with np.errstate(over="ignore"):
            cast = values.astype(np.float32)
        # only where the cast made an inf is the float64 looked at again (no float64-sized temporaries)
        for flat in np.flatnonzero(np.isinf(cast)):
            index = tuple(int(i) for i in np.unravel_index(int(flat), values.shape))
            if np.isfinite(values[index]):
                where = (first_row + index[0], *index[1:]) if index else index
                raise NumericError(f"{self.origin}: tensor '{self.name}' holds {values[index]:.6g} at index {where}, "
                                   "beyond float32's range (3.4e38); weights must fit float32")
        return cast

    def check_finite(self, values: np.ndarray, first_row: int = 0) -> None:
        """Raises NumericError naming the first NaN/Inf of ``values`` (rows from ``first_row`` on)."""
        if (index := first_non_finite(values)) is not None:
            where = (first_row + index[0], *index[1:])
            raise NumericError(f"{self.origin}: tensor '{self.name}' holds {values[index]} at index "
                               f"{where}; weights must be finite")


class RowView:
    """Rows of a 2-D :class:`TensorRef`, read on slicing (``view[a:b]`` → float32 ``[b - a, K]``)."""

    def __init__(self, ref: TensorRef):
        self.ref = ref
        self.shape = ref.shape
        self._full: np.ndarray | None = None

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError("RowView supports contiguous row slices only")
        if self.ref.row_reader is None:
            if self._full is None:
                self._full = self.ref.load()
            return self._full[start:stop]
        rows = self.ref.as_float32(self.ref.row_reader(start, stop), first_row=start)
        self.ref.check_finite(rows, first_row=start)
        return rows


class Tokenizer:
    """Tokenizer files to place beside an export, built on first use (rebuilding one from GGUF
    metadata takes seconds), and the ``tokenizers.Tokenizer`` they hold, parsed once."""

    def __init__(self, build: Callable[[], Mapping[str, bytes]], parsed=None):
        self._build = build
        self._files: Mapping[str, bytes] | None = None
        self._parsed = parsed

    @property
    def files(self) -> Mapping[str, bytes]:
        """File name (``tokenizer.json``, ``tokenizer_config.json``, ...) → content."""
        if self._files is None:
            self._files = dict(self._build())
        return self._files

    def parsed(self, where: Path):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json`` (parsed on first use; a source that
        already parsed it to validate it passes it in). ``where`` names the source in errors.

        Raises:
            FormatError: ``tokenizer.json`` is missing or unreadable.
        """
        if self._parsed is None:
            from .tokenizer import read_tokenizer_json

            if "tokenizer.json" not in self.files:
                raise FormatError(f"{where}: the source's tokenizer has no tokenizer.json")
            self._parsed = read_tokenizer_json(where / "tokenizer.json", self.files["tokenizer.json"])
        return self._parsed


def _fingerprint(path: Path) -> tuple[int, int, int] | None:
    """``(size, st_mtime_ns, st_ino)`` of a file, or None when it cannot be read (gone)."""
    try:
        st = Path(path).stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A model ready to export.

    Attributes:
        config: the validated configuration.
        tensors: every weight the graph needs, by transformers name (``lm_head.weight`` only when
            the LM head is a separate table, see :attr:`tied`).
        tokenizer: tokenizer files, or None when the source carries none.
        identity: what the source was (kind, path, size), recorded in the manifest.
        path: the source path (a folder or a file); outputs may not be written inside it.
        files: the files whose bytes define the weights and the config (see :meth:`content_sha256`).
        ignored: names of the source's tensors that belong to no part of a Gemma 3 model this
            toolkit knows (not the text decoder, not a multimodal checkpoint's vision tower or
            projector), which the export leaves out and notes.
        opened: each of :attr:`files`' ``(size, modification time in ns, inode)`` when the
            checkpoint was made (:meth:`check_unchanged`); taken then unless given.
    """

    config: GemmaConfig
    tensors: Mapping[str, TensorRef]
    tokenizer: Tokenizer | None
    identity: Mapping[str, object]
    path: Path
    files: tuple[Path, ...] = ()
    ignored: tuple[str, ...] = ()
    opened: tuple[tuple[int, int, int] | None, ...] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.opened is None:  # dataclasses.replace keeps the first one
            object.__setattr__(self, "opened", tuple(map(_fingerprint, self.files)))

    def check_unchanged(self) -> None:
        """Raises FormatError when one of :attr:`files` was written, replaced or removed since the
        checkpoint was made (its size, modification time or inode differ): the config and the weights
        read before would then be another model than the one its sha256 describes.

        Raises:
            FormatError: ``"{file}: changed while it was exported (...); export again"``.
        """
        for path, before in zip(self.files, self.opened):
            now = _fingerprint(path)
            if now != before:
                what = "removed" if now is None else "written or replaced"
                raise FormatError(f"{path}: {what} while it was exported (size, modification time or inode changed); "
                                  "the export would not be the model the file holds now, so none was written: export again")

    def file_sha256s(self) -> dict[str, str]:
        """File name → hex sha256 of each of :attr:`files`, in their order (what ``sha256sum``
        prints). Reads every file once (about 0.3 s for the 250 MB GGUF of Gemma 3 270M)."""
        from .staging import file_sha256

        return {p.name: file_sha256(p) for p in self.files}

    def content_sha256(self, file_sha256s: Mapping[str, str] | None = None) -> str | None:
        """One hex sha256 for the source's contents: of the lines ``"<file name> <file sha256>"`` of
        :attr:`files`, in their order (None when the source lists no files). Two sources of the
        same size (e.g. two fine-tunes of one architecture) differ here. For a one-file source it
        is not that file's own sha256 (:meth:`file_sha256s` gives those; pass them to read the
        files only once).
        """
        if not self.files:
            return None
        digests = self.file_sha256s() if file_sha256s is None else file_sha256s
        lines = "".join(f"{name} {digest}\n" for name, digest in digests.items())
        return hashlib.sha256(lines.encode()).hexdigest()

    @property
    def tied(self) -> bool:
        """True when one table serves the embedding lookup and the LM head."""
        return LM_HEAD not in self.tensors


def layer_shapes(hidden_size: int, num_attention_heads: int, num_key_value_heads: int, head_dim: int,
                 intermediate_size: int) -> dict[str, tuple[int, ...]]:
    """The 13 tensors of one Gemma 3 decoder layer, by name inside ``model.layers.{i}.``, with their
    shapes (transformers' layout: projections ``[out, in]``)."""
    h, d, i = hidden_size, head_dim, intermediate_size
    q_out, kv_out = num_attention_heads * d, num_key_value_heads * d
    return {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h),
        "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h),
        "self_attn.o_proj.weight": (h, q_out),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "post_attention_layernorm.weight": (h,),
        "pre_feedforward_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "post_feedforward_layernorm.weight": (h,),
    }


def expected_shapes(config: GemmaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Gemma 3 decoder needs, with its shape (transformers names and layout)."""
    layer = layer_shapes(config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                         config.intermediate_size)
    shapes: dict[str, tuple[int, ...]] = {EMBED: (config.vocab_size, config.hidden_size)}
    for n in range(config.num_hidden_layers):
        shapes.update({f"model.layers.{n}.{name}": shape for name, shape in layer.items()})
    shapes[FINAL_NORM] = (config.hidden_size,)
    return shapes


def resolve_lm_head(config: GemmaConfig, tensors: dict[str, TensorRef], where: str) -> None:
    """Decide, in place, whether the LM head shares the embedding table.

    The table is shared only when ``tie_word_embeddings`` is true **and** the source either has no
    separate head or one whose values equal the embedding; otherwise both tables are kept (never
    tie silently).

    Raises:
        FormatError: ``tie_word_embeddings`` is false and the source has no LM head.
    """
    head = tensors.get(LM_HEAD)
    if head is None:
        if not config.tie_word_embeddings:
            raise FormatError(f"{where}: tie_word_embeddings is false but tensor '{LM_HEAD}' is missing")
        return
    if config.tie_word_embeddings and head.shape == tensors[EMBED].shape and _equal_values(head, tensors[EMBED]):
        del tensors[LM_HEAD]


def _equal_values(a: TensorRef, b: TensorRef, chunk_rows: int = 8192) -> bool:
    """Whether two same-shaped tensors hold equal values (NaN never equals). Row by row in chunks
    where both sources read row ranges, stopping at the first difference: never two whole tables
    in memory (2 × 671 MB as float32 for the 270M)."""
    if a.row_reader is None or b.row_reader is None or len(a.shape) != 2:
        return bool(np.array_equal(a.load(allow_non_finite=True), b.load(allow_non_finite=True)))
    for start in range(0, a.shape[0], chunk_rows):
        stop = min(start + chunk_rows, a.shape[0])
        if not np.array_equal(np.asarray(a.row_reader(start, stop), np.float32),
                              np.asarray(b.row_reader(start, stop), np.float32)):
            return False
    return True


#: the config fields that may be defaulted (GemmaConfig.defaulted) and that set a tensor's shape, by
#: the tensor's last name part: named in a shape error only where they are the cause
_SHAPED_BY = {"embed_tokens": ("vocab_size",), "lm_head": ("vocab_size",),
              **{p: ("num_attention_heads", "num_key_value_heads") for p in ("q_proj", "k_proj", "v_proj", "o_proj")}}


def validate_tensors(config: GemmaConfig, tensors: Mapping[str, TensorRef], where: str) -> None:
    """Check that every expected tensor is present with the expected shape.

    Raises:
        FormatError: naming the first missing tensor or the first wrong shape.
    """
    expected = expected_shapes(config)
    if LM_HEAD in tensors:
        expected[LM_HEAD] = (config.vocab_size, config.hidden_size)
    for name, shape in expected.items():
        ref = tensors.get(name)
        if ref is None:
            raise FormatError(f"{where}: missing tensor '{name}' (expected shape {list(shape)})")
        if ref.shape != shape:
            raise FormatError(
                f"{ref.origin}: tensor '{name}' has shape {list(ref.shape)}, expected {list(shape)} from the config"
                f"{config.defaults_taken(*_SHAPED_BY.get(name.rsplit('.', 2)[-2], ()))}"
            )
