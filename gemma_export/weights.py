"""How each ``--dtype`` stores weights in the ONNX graph and reads them back: the quantization plan.

One small class per dtype, registered in :data:`WEIGHT_FORMATS`; each knows three things — a
linear projection, the embedding lookup and the LM head — and the tied table is created once by
:meth:`WeightFormat.table` and handed to both of the last two. The choices come from onnxruntime's
CPU provider (the board team's notes on it, and docs/benchmarks.md):

* ``fp32``: ``MatMul`` on ``[in, out]`` weights; the table ``[vocab, hidden]`` feeds ``Gather`` and
  ``Gemm(transB=1)`` directly, so no Transpose of it exists to be folded into a second copy.
* ``bf16``: storage only (the CPU provider has no bf16 arithmetic): every weight matrix and the
  table are bf16 on disk (the norms' ``1 + w`` stay float32, as for every dtype, :func:`~gemma_export.builder.rms_norm`),
  each read through one ``Cast`` to float32, which onnxruntime folds at session creation. The
  table's single Cast feeds both consumers, so memory holds one float32 table.
* ``int8``: symmetric block-wise int8 (``quant.BlockInt8Weights``) read by ``MatMulNBits`` (bits 8,
  ``accuracy_level`` 4 — the only level fast enough for the head) for projections and the head.
  The lookup gathers rows of the same uint8 ``[vocab, hidden / B, B]`` initializer and of the same
  ``[vocab, hidden / B]`` scales and dequantizes only those rows, so table and scales exist once.
  Every int8 matmul input is rotated by a block-diagonal Hadamard folded into the weights
  (``quant/hadamard.py``): level 4 also quantizes activations per block, and the rotation spreads
  their outliers. With ``activation_residual`` every such matmul also multiplies the residual of
  that rounding, as a second batch row (:meth:`Int8Format._residual_rows`): activations at about
  float precision, and the same logits on x86-64 and on Arm with or without dotprod, for twice the
  arithmetic. int8 only: onnxruntime's 4-bit kernel on Arm with dotprod (KleidiAI) rounds a whole
  row of activations at once, a grid the residual cannot match.
* ``int4``: the same plan with 4-bit codes (``quant.BlockInt4Weights``: two per byte, symmetric by
  default, scales chosen by a clipping search) for the projections and, unless ``table_dtype`` is
  ``int8``, the table; the lookup unpacks the gathered rows' nibbles with ``BitwiseAnd``/``BitShift``.
* Projections that read the same input (q/k/v, gate/up) are stored stacked along the output axis
  and run as one ``MatMulNBits`` (``MatMul`` for fp32/bf16) followed by ``Split``.
* With a :class:`~gemma_export.calibration.Calibration`, int8 and int4 codes are chosen by GPTQ
  (``quant/gptq.py``) on the calibration inputs; scales and layout stay those of the plain scheme.
  The tied table's codes are chosen for the LM head (its Hessian is that of the final norm's
  output), which makes each row's own error, the one the lookup sees, larger than rounding to
  nearest would: the head reads every row each token, the lookup one per token, and the trade
  lowered the KL on real text (docs/quality.md, "GPTQ calibration").

Tensors are :class:`onnx_ir.LazyTensor` s: each is read, converted and written one at a time when
the model is saved, so the exporter never holds the whole model in memory.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, ClassVar

import ml_dtypes
import numpy as np
import onnx_ir as ir

from quant import BF16Weights, BlockInt4Weights, BlockInt8Weights, hadamard_matrix, rotate_blocks
from quant import int4 as int4_scheme
from quant.gptq import Hessian
from quant.rows import first_non_finite
from quant.int8 import ZERO_POINT
from quant.scales import SCALE_METHODS, Float16RangeError, check_scale_dtype

from .calibration import Calibration
from .checkpoint import TensorRef
from .config import TABLE_BITS
from .errors import ConfigError, NumericError
from .graph import MS_DOMAIN, GraphBuilder

#: Default int8 block sizes. MatMulNBits at accuracy_level 4 also quantizes its *activations* to
#: int8 per block of this size, so small blocks matter for quality: on the real 270M, block 128
#: everywhere gave 95.6% teacher-forced top-1 agreement with fp32, block 32 everywhere 97.3%
#: (docs/benchmarks-history.md). The table keeps 128: its float32 scales (one array, read by the lookup and
#: the head) take 5.2 MB at 128 and 21 MB at 32, and the 16 MB more would put the 270M's archive over
#: issue #2's 290 MB (docs/quality.md, "How the int8 error splits").
DEFAULT_INT8_BLOCK_SIZE = 32
DEFAULT_INT8_TABLE_BLOCK_SIZE = 128
#: int4: block 32 everywhere (the table too: 4-bit codes need small blocks, and the scales of a
#: block-32 table, 21 MB, still fit issue #7's 175 MB budget for the 270M's int4 archive).
DEFAULT_INT4_BLOCK_SIZE = 32
#: Hadamard rotation of every int8 matmul input (``quant/hadamard.py``): 64 measured best on the
#: real 270M (KL vs fp32 0.0014 against 0.0034 unrotated; 32 and 128 were worse).
DEFAULT_HADAMARD_SIZE = 64
#: default table block size by the table's bits
DEFAULT_TABLE_BLOCK_SIZE = {8: DEFAULT_INT8_TABLE_BLOCK_SIZE, 4: DEFAULT_INT4_BLOCK_SIZE}


def _lazy(name: str, dtype: ir.DataType, shape: tuple[int, ...], make: Callable[[], np.ndarray]) -> ir.LazyTensor:
    return ir.LazyTensor(lambda: ir.tensor(make(), dtype=dtype, name=name), dtype=dtype, shape=ir.Shape(shape), name=name)


class _Memo:
    """Remembers the last few quantized tensors by ``(tensor name, block size, …)``, so that a tensor
    written as several initializers (data, scales) is read and quantized once. Saving is
    sequential, so the entries are used back to back."""

    def __init__(self, size: int = 2):
        self._size = size
        self._entries: dict[tuple, BlockInt8Weights | BlockInt4Weights] = {}

    def __call__(self, ref: TensorRef, block_size: int, hadamard_size: int, bits: int, symmetric: bool, method: str,
                 hessian: Callable[[], Hessian | None] | None, scale_dtype: str) -> BlockInt8Weights | BlockInt4Weights:
        key = (ref.name, block_size, hadamard_size, bits, symmetric, method, scale_dtype)
        if key not in self._entries:
            rows = _RotatedRows(ref.rows(), hadamard_size) if hadamard_size else ref.rows()
            h = hessian() if hessian is not None else None
            try:
                if bits == 8:
                    value = BlockInt8Weights.quantize(rows, block_size, hessian=h, scale_dtype=scale_dtype)
                else:
                    value = BlockInt4Weights.quantize(rows, block_size, symmetric=symmetric, method=method, hessian=h,
                                                      scale_dtype=scale_dtype)
            except Float16RangeError as exc:  # (row, block) of the stored, rotated weight
                row, block = exc.index
                rotated = f", after the {hadamard_size}-wide Hadamard rotation" if hadamard_size else ""
                raise NumericError(f"{ref.origin}: its block scales cannot be float16: row {row}, block {block} "
                                   f"(inputs {block * block_size} to {(block + 1) * block_size - 1}{rotated}) needs "
                                   f"{abs(exc.value):.4g}, above float16's largest, 65504; --scale-dtype float32 "
                                   "(the default) stores it") from None
            except ValueError as exc:
                raise NumericError(f"{ref.origin}: cannot quantize '{ref.name}': {exc}") from None
            while len(self._entries) >= self._size:
                self._entries.pop(next(iter(self._entries)))
            self._entries[key] = value
        return self._entries[key]


@dataclasses.dataclass(frozen=True)
class _Stacked:
    data: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None


@dataclasses.dataclass
class Table:
    """The tied (or untied) ``[vocab, hidden]`` table as graph values, created once.

    Attributes:
        ref: the source tensor (``model.embed_tokens.weight`` or ``lm_head.weight``), ``[vocab, hidden]``.
        values: the format's initializers by role: ``"float"`` (fp32/bf16: float32 ``[vocab, hidden]``,
            after the bf16 Cast), or ``"data"``, ``"scales"`` and, for asymmetric int4,
            ``"zero_points"`` (with the ints ``"bits"`` and ``"block_size"``) for int8/int4.
    """

    ref: TensorRef
    values: dict[str, ir.Value | int]


class WeightFormat:
    """Base class: how one dtype stores and reads weights. Subclasses register themselves by ``name``
    and state their facts as class attributes: ``bits`` per stored weight (before scales),
    ``quantized`` (block-wise codes with scales) and ``default_block_size`` (None: no blocks)."""

    name: ClassVar[str]
    bits: ClassVar[int]
    quantized: ClassVar[bool] = False
    default_block_size: ClassVar[int | None] = None
    registry: ClassVar[dict[str, type["WeightFormat"]]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        WeightFormat.registry[cls.name] = cls

    @classmethod
    def from_options(cls, block_size: int | None = None, table_block_size: int | None = None,
                     hadamard_size: int | None = None, table_dtype: str | None = None, symmetric: bool = True,
                     method: str = "mse", calibration: Calibration | None = None,
                     activation_residual: bool = False, scale_dtype: str = "float32") -> "WeightFormat":
        """The format for ``--dtype`` with the export's options (None: the format's default); a
        float format takes none and ignores them (the CLI refuses them before this).

        The arguments are :func:`weight_format`'s (block sizes in weights per scale,
        ``hadamard_size`` in features, 0: no rotation).

        Raises:
            ValueError: (int4) ``table_dtype`` not ``int4``/``int8``, or ``method`` not ``mse``/``rtn``;
                (int8, int4) ``scale_dtype`` not ``float32``/``float16``.
        """
        return cls()

    def linear(self, g: GraphBuilder, x: ir.Value, ref: TensorRef) -> ir.Value:
        """``x @ W.T`` for ``W = ref`` of shape ``[out, in]``; ``x`` float32 ``[..., in]`` → ``[..., out]``.

        Only adds nodes and lazy initializers: the weight is read and converted when the model is
        saved, and a weight that cannot be stored (NaN/Inf, bf16 overflow) raises
        :class:`~gemma_export.errors.NumericError` then, naming the source tensor.
        """
        raise NotImplementedError

    def linears(self, g: GraphBuilder, x: ir.Value, refs: list[TensorRef], name: str) -> list[ir.Value]:
        """``x @ W.T`` for each ``W`` in ``refs`` (same ``in``): one :meth:`stacked_linear` over the
        weights stacked along ``out`` as one weight called ``name``, then ``Split`` (fewer, larger
        kernel calls than one per weight)."""
        if len(refs) == 1:
            return [self.linear(g, x, refs[0])]
        sizes = [r.shape[0] for r in refs]
        y = self.stacked_linear(g, x, refs, name)
        return list(g.op("Split", y, g.const_i64(sizes), axis=-1, num_outputs=len(sizes)))

    def stacked_linear(self, g: GraphBuilder, x: ir.Value, refs: list[TensorRef], name: str) -> ir.Value:
        """``x @ concat(W_1, W_2, ...).T``: ``[..., in]`` → ``[..., sum of out]``."""
        raise NotImplementedError

    def table(self, g: GraphBuilder, ref: TensorRef) -> Table:
        """Create the ``[vocab, hidden]`` table's initializers (once per table); lazy, as :meth:`linear`."""
        raise NotImplementedError

    def embedding(self, g: GraphBuilder, table: Table, input_ids: ir.Value) -> ir.Value:
        """Rows of the table: int64 ``[batch, seq]`` → float32 ``[batch, seq, hidden]``."""
        raise NotImplementedError

    def lm_head(self, g: GraphBuilder, table: Table, hidden: ir.Value) -> ir.Value:
        """Logits ``hidden @ table.T``: float32 ``[batch, seq, hidden]`` → ``[batch, seq, vocab]``."""
        raise NotImplementedError


def _gemm_lm_head(g: GraphBuilder, table_value: ir.Value, hidden: ir.Value, vocab_size: int, hidden_size: int) -> ir.Value:
    # Gemm(transB=1) reads the [vocab, hidden] table in place: no Transpose for onnxruntime to fold.
    flat = g.op("Reshape", hidden, g.const_i64([-1, hidden_size]))
    logits = g.op("Gemm", flat, table_value, transB=1)
    shape = g.op("Concat", g.op("Slice", g.op("Shape", hidden), g.const_i64([0]), g.const_i64([2])),
                 g.const_i64([vocab_size]), axis=0)
    return g.op("Reshape", logits, shape)


class Float32Format(WeightFormat):
    """``fp32``: float32 initializers, ``MatMul`` on ``[in, out]`` (transposed) weights, the table
    ``[vocab, hidden]`` read by ``Gather`` and ``Gemm(transB=1)``."""

    name = "fp32"
    bits = 32

    def _weight(self, g, name, shape, make, refs=()):
        """A float32 value of ``shape`` read from an initializer written by ``make()`` (from the
        source tensors ``refs``, which errors name)."""
        return g.initializer(_lazy(name, ir.DataType.FLOAT, shape, make))

    def linear(self, g, x, ref):
        """``MatMul(x, W.T)`` with ``W.T`` float32 ``[in, out]`` stored transposed."""
        out_features, in_features = ref.shape
        w = self._weight(g, ref.name, (in_features, out_features), lambda: np.ascontiguousarray(ref.load().T), (ref,))
        return g.op("MatMul", x, w)

    def stacked_linear(self, g, x, refs, name):
        """``MatMul`` with the weights concatenated along ``out`` and transposed: float32 ``[in, sum of out]``."""
        w = self._weight(g, name, (refs[0].shape[1], sum(r.shape[0] for r in refs)),
                         lambda: np.ascontiguousarray(np.concatenate([r.load() for r in refs]).T), refs)
        return g.op("MatMul", x, w)

    def table(self, g, ref):
        """One float32 ``[vocab, hidden]`` value, under ``values["float"]``."""
        return Table(ref, {"float": self._weight(g, ref.name, ref.shape, ref.load, (ref,))})

    def embedding(self, g, table, input_ids):
        """``Gather(table, input_ids, axis=0)``: int64 ``[batch, seq]`` → float32 ``[batch, seq, hidden]``."""
        return g.op("Gather", table.values["float"], input_ids, axis=0)

    def lm_head(self, g, table, hidden):
        """``Gemm(hidden, table, transB=1)`` on ``[batch · seq, hidden]``, reshaped to float32
        ``[batch, seq, vocab]``: the table is read in place, with no Transpose."""
        return _gemm_lm_head(g, table.values["float"], hidden, *table.ref.shape)


class BF16Format(Float32Format):
    """``bf16``: as :class:`Float32Format`, every weight matrix and the table stored as bfloat16
    (round to nearest even, :func:`quant.bf16.float32_to_bfloat16_bits`) and read through one
    ``Cast`` to float32; the norms' ``1 + w`` stay float32 (:func:`~gemma_export.builder.rms_norm`).
    A value above bfloat16's range raises :class:`~gemma_export.errors.NumericError` when saved."""

    name = "bf16"
    bits = 16

    def _weight(self, g, name, shape, make, refs=()):
        def bits():
            try:
                return BF16Weights.quantize(make()).bits.view(ml_dtypes.bfloat16)
            except ValueError as exc:
                # name the source tensor and its own index, not the stacked/transposed initializer's
                for ref in refs:
                    try:
                        BF16Weights.quantize(ref.load())
                    except ValueError as own:
                        raise NumericError(f"{ref.origin}: cannot store as bf16: {own}") from None
                raise NumericError(f"'{name}': cannot store as bf16: {exc}") from None

        stored = g.initializer(_lazy(name, ir.DataType.BFLOAT16, shape, bits))
        return g.op("Cast", stored, to=ir.DataType.FLOAT)


class _RotatedRows:
    """Rows of a weight with its input dimension rotated by the block-diagonal Hadamard (``W H``)."""

    def __init__(self, rows, size: int):
        self.rows, self.size, self.shape = rows, size, rows.shape

    def __getitem__(self, index: slice) -> np.ndarray:
        rows = self.rows[index]  # finite: the source's rows are checked when read
        with np.errstate(over="ignore", invalid="ignore"):  # checked just below, and named
            rotated = rotate_blocks(rows, self.size)
        if (at := first_non_finite(rotated)) is not None:  # a sum of n values near float32's largest
            r = at[0]
            start = index.indices(self.shape[0])[0]
            raise ValueError(f"row {start + r} overflows float32 in the {self.size}-wide Hadamard rotation "
                             f"(largest |w| in the row: {np.abs(rows[r]).max():.6g}); export with --hadamard 0")
        return rotated


class Int8Format(WeightFormat):
    """Block-wise symmetric int8 projections and table (``MatMulNBits`` 8 bits, one float32 scale per
    block of ``block_size`` inputs), every matmul input rotated by a ``hadamard_size`` block-diagonal
    Hadamard folded into the weights, codes by GPTQ when ``calibration`` is given.

    ``table_block_size`` defaults to :data:`DEFAULT_INT8_TABLE_BLOCK_SIZE` (128), as on the command
    line; :func:`gemma_export.exporter.export` passes a smaller one when the model's hidden size does
    not allow it.

    Args:
        block_size: elements per scale along the input of every layer projection (default 32);
            must divide the hidden and intermediate sizes (a ConfigError when the graph is built;
            :func:`gemma_export.exporter.export` checks the sizes before reading any weight).
        table_block_size: elements per scale along ``hidden_size`` in the table; None: 128.
        hadamard_size: width of the block-diagonal Hadamard rotation (a power of two dividing every
            matmul's input size; 0: none).
        calibration: GPTQ's statistics (None: round to nearest).
        activation_residual: feed every ``MatMulNBits`` its input twice over, as the rows of a doubled
            batch: the input rounded to the kernel's own int8 activation grid, and the residual of that
            rounding; the two outputs are added (:meth:`_residual_rows`).
        scale_dtype: how the block scales are stored: ``"float32"`` (default), or ``"float16"``, half
            the scales' bytes on disk: each scale on float16's grid (``quant/scales.py``), cast to
            float32 in the graph, a ``Cast`` of a constant that onnxruntime folds once when the
            session is created, so ``MatMulNBits`` and the lookup read float32 as before.
    """

    name = "int8"
    quantized = True
    default_block_size = DEFAULT_INT8_BLOCK_SIZE

    @classmethod
    def from_options(cls, block_size=None, table_block_size=None, hadamard_size=None, table_dtype=None,
                     symmetric=True, method="mse", calibration=None, activation_residual=False,
                     scale_dtype="float32"):
        """An :class:`Int8Format`; ``table_dtype``, ``symmetric`` and ``method`` are ignored (int4 only)."""
        return cls(block_size or cls.default_block_size, table_block_size,
                   DEFAULT_HADAMARD_SIZE if hadamard_size is None else hadamard_size, calibration,
                   activation_residual, scale_dtype)

    def __init__(self, block_size: int = DEFAULT_INT8_BLOCK_SIZE, table_block_size: int | None = None,
                 hadamard_size: int = DEFAULT_HADAMARD_SIZE, calibration: Calibration | None = None,
                 activation_residual: bool = False, scale_dtype: str = "float32"):
        check_scale_dtype(scale_dtype)
        self.scale_dtype = scale_dtype
        self.activation_residual = activation_residual
        self._memo = _Memo()
        self._stack: tuple = (None, None)
        self._hessian_of: tuple = (None, None)  # (calibration input, its Hessian): q/k/v, gate/up share
        self.calibration = calibration
        self.block_size = block_size
        # the CLI's default (export() passes its own, fitted to the hidden size by exporter.block_size_for)
        self.table_block_size = table_block_size or DEFAULT_TABLE_BLOCK_SIZE[self.table_bits]
        self.hadamard_size = hadamard_size
        self._rotated: dict[int, tuple[ir.Value, ir.Value]] = {}
        self._hadamard: ir.Value | None = None
        self._rotation_graph: GraphBuilder | None = None  # the graph _rotated and _hadamard belong to

    #: bits of the projections and of the table (``Int4Format`` changes them)
    bits = 8
    table_bits = 8
    symmetric = True
    method = "rtn"  # int8 scales are max|block| / 127: no clipping search (part of the memo key)

    def _hessian(self, name: str) -> Hessian | None:
        """The GPTQ Hessian of weight ``name``'s input, rotated as its weight is; one object (and one
        factorisation) for the weights that read the same input, which are quantized back to back."""
        x = self.calibration.statistics(name) if self.calibration is not None else None
        if x is None:
            return None
        if self._hessian_of[0] is not x:
            h = Hessian(self.calibration.hessian(name))
            self._hessian_of = (x, h.rotated(self.hadamard_size) if self.hadamard_size else h)
        return self._hessian_of[1]

    def _quantized(self, ref: TensorRef, block_size: int, bits: int):
        hessian = functools.partial(self._hessian, ref.name)
        return self._memo(ref, block_size, self.hadamard_size, bits, self.symmetric, self.method, hessian,
                          self.scale_dtype)

    def _stacked(self, refs: tuple[TensorRef, ...], block_size: int, bits: int):
        """The quantized weights of ``refs`` stacked along the output axis (one entry remembered:
        the data, scales and zero points of one stack are written back to back)."""
        key = (tuple(r.name for r in refs), block_size, bits)
        if self._stack[0] != key:
            parts = [self._quantized(r, block_size, bits) for r in refs]
            zero_points = [getattr(q, "zero_points", None) for q in parts]
            self._stack = (key, _Stacked(np.concatenate([q.data for q in parts]), np.concatenate([q.scales for q in parts]),
                                         None if zero_points[0] is None else np.concatenate(zero_points)))
        return self._stack[1]

    def _initializers(self, g: GraphBuilder, refs: TensorRef | tuple[TensorRef, ...], block_size: int, bits: int,
                      name: str | None = None) -> dict:
        """Initializers (data, scales, zero points) of one weight, or of several weights that read the
        same input stacked along the output axis under ``name`` (one MatMulNBits for q/k/v)."""
        if isinstance(refs, TensorRef):
            name, quantized = refs.name, functools.partial(self._quantized, refs, block_size, bits)
            n, k = refs.shape
        else:
            quantized = functools.partial(self._stacked, refs, block_size, bits)
            n, k = sum(r.shape[0] for r in refs), refs[0].shape[1]
        if k % block_size:
            raise ConfigError(f"{name}: in_features {k} is not a multiple of the block size {block_size} "
                              "(--block-size, --table-block-size)")
        nb = k // block_size
        values = {
            "block_size": block_size,
            "bits": bits,
            "data": g.initializer(_lazy(name, ir.DataType.UINT8, (n, nb, block_size * bits // 8),
                                        lambda: quantized().data)),
        }
        if self.scale_dtype == "float16":  # exact: the scales were chosen on float16's grid
            stored = g.initializer(_lazy(name + "_scales", ir.DataType.FLOAT16, (n, nb),
                                         lambda: quantized().scales.astype(np.float16)))
            values["scales"] = g.op("Cast", stored, to=ir.DataType.FLOAT)  # folded by onnxruntime at load
        else:
            values["scales"] = g.initializer(_lazy(name + "_scales", ir.DataType.FLOAT, (n, nb),
                                                   lambda: quantized().scales))
        if bits == 4 and not self.symmetric:
            values["zero_points"] = g.initializer(_lazy(name + "_zero_points", ir.DataType.UINT8,
                                                        (n, (nb + 1) // 2), lambda: quantized().zero_points))
        return values

    def _rotate(self, g: GraphBuilder, x: ir.Value, features: int) -> ir.Value:
        """``x`` ``[B, S, K]`` with each run of ``hadamard_size`` features multiplied by H (float
        MatMul with an n × n constant). H is its own inverse, so this also undoes the rotation.
        Memoized per input value: q, k and v (gate and up) share one rotation."""
        if not self.hadamard_size:
            return x
        if self._rotation_graph is not g:  # a second build_model with this format: its own constant and memo
            self._rotation_graph, self._rotated, self._hadamard = g, {}, None
        if id(x) not in self._rotated:
            n = self.hadamard_size
            if features % n:
                raise ConfigError(f"a matmul input of {features} features is not a multiple of the Hadamard size "
                                  f"{n} (--hadamard)")
            if self._hadamard is None:
                self._hadamard = g.const(hadamard_matrix(n), name=f"hadamard_{n}")
            blocks = g.op("Reshape", x, g.const_i64([0, 0, features // n, n]))
            rotated = g.op("Reshape", g.op("MatMul", blocks, self._hadamard), g.const_i64([0, 0, features]))
            self._rotated[id(x)] = (x, rotated)  # keep x alive so its id stays unique
        return self._rotated[id(x)][1]

    @staticmethod
    def _residual_rows(g: GraphBuilder, x: ir.Value, k: int, block_size: int) -> ir.Value:
        """float32 ``[B, S, K]`` → ``[2B, S, K]``: ``x`` rounded to the grid on which ``MatMulNBits``
        at ``accuracy_level`` 4 quantizes its input, over the residual of that rounding.

        The 8-bit kernel rounds each block of ``block_size`` input features to int8 with the scale
        ``max|block| / 127`` (onnxruntime's MLAS, ``QuantizeARow_CompInt8``: the same grid on x86-64
        and on Arm with dotprod; Arm without dotprod computes in float32 and rounds nothing, so
        there the second row is only extra work). The first half holds
        ``round(x · 127 / max) · max / 127``: values already on that grid, which the kernel
        re-quantizes without loss (to a float32 ulp of the scale). The second half holds ``x`` minus
        that, at most half a step; its own rounding loses 1/254 of its block's largest value. Their products, added, carry about 1/250 of the activation rounding error of
        one pass, and change little when float32 order changes (fused against unfused graphs, one
        CPU's kernels against another's). The weights are read once per call; the arithmetic doubles.
        """
        blocks = g.op("Reshape", x, g.const_i64([0, 0, k // block_size, block_size]))
        # an all-zero block (a padded position's attention output, a zero embedding row) must give 0:
        # 127 / 1e-30 is finite, so 0 · 127 / 1e-30 = 0 (127 / float32's tiny is inf, and 0 · inf NaN)
        largest = g.op("Max", g.op("ReduceMax", g.op("Abs", blocks), g.const_i64([-1]), keepdims=1),
                       g.const_f32(1e-30))
        steps = g.op("Round", g.op("Mul", blocks, g.op("Div", g.const_f32(127.0), largest)))
        on_grid = g.op("Mul", steps, g.op("Div", largest, g.const_f32(127.0)))
        both = g.op("Concat", on_grid, g.op("Sub", blocks, on_grid), axis=0)
        return g.op("Reshape", both, g.const_i64([0, 0, k]))

    def _matmul_nbits(self, g, x, values, n, k):
        if self.activation_residual:
            x = self._residual_rows(g, x, k, values["block_size"])
        inputs = [x, values["data"], values["scales"]]
        if "zero_points" in values:
            inputs.append(values["zero_points"])
        y = g.op("MatMulNBits", *inputs, domain=MS_DOMAIN,
                 K=k, N=n, bits=values["bits"], block_size=values["block_size"], accuracy_level=4)
        if self.activation_residual:
            y = g.op("Add", *g.op("Split", y, axis=0, num_outputs=2))
        return y

    def linear(self, g, x, ref):
        """``MatMulNBits`` (``accuracy_level`` 4) on the rotated ``x``: data uint8
        ``[out, in / B, B · bits / 8]``, scales float32 ``[out, in / B]``, ``B`` = ``block_size``.
        A weight that cannot be quantized raises :class:`~gemma_export.errors.NumericError` when saved;
        ``in`` not a multiple of ``B`` or of the rotation's size raises
        :class:`~gemma_export.errors.ConfigError` now."""
        n, k = ref.shape
        return self._matmul_nbits(g, self._rotate(g, x, k), self._initializers(g, ref, self.block_size, self.bits), n, k)

    def stacked_linear(self, g, x, refs, name):
        """One ``MatMulNBits`` over the weights' codes and scales concatenated along ``out``; errors as
        :meth:`linear`."""
        n, k = sum(r.shape[0] for r in refs), refs[0].shape[1]
        values = self._initializers(g, tuple(refs), self.block_size, self.bits, name)
        return self._matmul_nbits(g, self._rotate(g, x, k), values, n, k)

    def table(self, g, ref):
        """The table's data uint8 ``[vocab, hidden / B, B · bits / 8]``, scales float32 ``[vocab, hidden / B]``
        (and, asymmetric int4, zero points uint8 ``[vocab, ceil((hidden / B) / 2)]``), ``B`` =
        ``table_block_size``, bits = ``table_bits``; stored rotated (``T H``). ``hidden`` not a multiple
        of ``B`` raises :class:`~gemma_export.errors.ConfigError` now."""
        return Table(ref, self._initializers(g, ref, self.table_block_size, self.table_bits))

    @staticmethod
    def _unpack_nibbles(g, packed):
        """uint8 ``[B, S, X, M]`` → uint8 ``[B, S, X, 2M]`` (rank 4: gathered rows of blocks), the low
        nibble first (MatMulNBits' order)."""
        low = g.op("BitwiseAnd", packed, g.const(np.array(15, np.uint8)))
        high = g.op("BitShift", packed, g.const(np.array(4, np.uint8)), direction="RIGHT")
        pairs = g.op("Concat", g.op("Unsqueeze", low, g.const_i64([-1])), g.op("Unsqueeze", high, g.const_i64([-1])), axis=-1)
        return g.op("Reshape", pairs, g.const_i64([0, 0, 0, -1]))  # [B, S, X, M, 2] → [B, S, X, 2M]

    def embedding(self, g, table, input_ids):
        """``Gather`` of the selected rows of the table's codes, scales (and zero points), then
        ``(code - zero_point) · scale`` and the inverse rotation: int64 ``[batch, seq]`` → float32
        ``[batch, seq, hidden]``."""
        # Plain Gathers on the very initializers MatMulNBits reads (data, scales, zero points),
        # then (q - zero_point) * scale for the selected rows only: no second copy of anything.
        _, hidden = table.ref.shape
        values = table.values
        codes = g.op("Gather", values["data"], input_ids, axis=0)                  # [B, S, H/B, B*bits/8]
        if values["bits"] == 4:
            codes = self._unpack_nibbles(g, codes)                                  # [B, S, H/B, B]
            if "zero_points" in values:
                nb = hidden // values["block_size"]
                zp = self._unpack_nibbles(g, g.op("Unsqueeze", g.op("Gather", values["zero_points"], input_ids, axis=0),
                                                  g.const_i64([-1])))               # [B, S, ceil(nb/2), 2]
                zp = g.op("Reshape", zp, g.const_i64([0, 0, -1, 1]))
                zero_point = g.op("Cast", g.op("Slice", zp, g.const_i64([0]), g.const_i64([nb]), g.const_i64([2])),
                                  to=ir.DataType.FLOAT)                             # [B, S, nb, 1]
            else:
                zero_point = g.const_f32(int4_scheme.ZERO_POINT)
        else:
            zero_point = g.const_f32(ZERO_POINT)
        rows = g.op("Cast", codes, to=ir.DataType.FLOAT)
        scales = g.op("Unsqueeze", g.op("Gather", values["scales"], input_ids, axis=0), g.const_i64([-1]))
        rows = g.op("Mul", g.op("Sub", rows, zero_point), scales)                   # [B, S, H/B, B]
        rows = g.op("Reshape", rows, g.const_i64([0, 0, hidden]))                   # [B, S, H]
        return self._rotate(g, rows, hidden)  # stored rows are T H; (T H) H = T

    def lm_head(self, g, table, hidden):
        """``MatMulNBits`` on the table's initializers: float32 ``[batch, seq, hidden]`` →
        ``[batch, seq, vocab]``; ``hidden`` not a multiple of the rotation's size raises
        :class:`~gemma_export.errors.ConfigError`."""
        n, k = table.ref.shape
        return self._matmul_nbits(g, self._rotate(g, hidden, k), table.values, n, k)


class Int4Format(Int8Format):
    """4-bit projections and table (or an int8 table with ``table_dtype="int8"``).

    Args:
        block_size: weights per scale in the layers (default :data:`DEFAULT_INT4_BLOCK_SIZE`).
        table_block_size: weights per scale in the table (default: :data:`DEFAULT_TABLE_BLOCK_SIZE`
            of the table's bits: 32 for an int4 table, 128 for an int8 one).
        hadamard_size: width of the block-diagonal rotation folded into the weights (0: none).
        table_dtype: ``"int4"`` or ``"int8"``.
        symmetric: False stores a 4-bit zero point per block (``quant/int4.py``).
        method: ``"mse"`` (clipping search) or ``"rtn"`` (round to nearest).
        calibration: activation statistics; set, every weight's codes are GPTQ's.
        scale_dtype: ``"float32"`` or ``"float16"`` scales on disk (as :class:`Int8Format`).

    Raises:
        ValueError: ``table_dtype``, ``method`` or ``scale_dtype`` is not one of those above.
    """

    name = "int4"
    bits = 4
    default_block_size = DEFAULT_INT4_BLOCK_SIZE

    @classmethod
    def from_options(cls, block_size=None, table_block_size=None, hadamard_size=None, table_dtype=None,
                     symmetric=True, method="mse", calibration=None, activation_residual=False,
                     scale_dtype="float32"):
        """An :class:`Int4Format` (``table_dtype`` None: ``int4``).

        Raises:
            ValueError: as :class:`Int4Format`, or ``activation_residual`` (int8 only, see
                :meth:`Int8Format._residual_rows`).
        """
        if activation_residual:  # the exporter refuses it first, naming the option
            raise ValueError("activation_residual applies to int8 only")
        return cls(block_size or cls.default_block_size, table_block_size,
                   DEFAULT_HADAMARD_SIZE if hadamard_size is None else hadamard_size,
                   table_dtype or "int4", symmetric, method, calibration, scale_dtype)

    def __init__(self, block_size: int = DEFAULT_INT4_BLOCK_SIZE, table_block_size: int | None = None,
                 hadamard_size: int = DEFAULT_HADAMARD_SIZE, table_dtype: str = "int4", symmetric: bool = True,
                 method: str = "mse", calibration: Calibration | None = None, scale_dtype: str = "float32"):
        if table_dtype not in TABLE_BITS:
            raise ValueError(f"table_dtype {table_dtype!r}: expected {' or '.join(TABLE_BITS)}")
        if method not in SCALE_METHODS:
            raise ValueError(f"method {method!r}: expected {' or '.join(SCALE_METHODS)}")
        self.table_bits = TABLE_BITS[table_dtype]
        super().__init__(block_size, table_block_size, hadamard_size, calibration, scale_dtype=scale_dtype)
        self.symmetric = symmetric
        self.method = method


WEIGHT_FORMATS = WeightFormat.registry


def weight_format(dtype: str, block_size: int | None = None, table_block_size: int | None = None,
                  hadamard_size: int | None = None, table_dtype: str | None = None, symmetric: bool = True,
                  method: str = "mse", calibration: Calibration | None = None,
                  activation_residual: bool = False, scale_dtype: str = "float32") -> WeightFormat:
    """The :class:`WeightFormat` for ``--dtype`` (``fp32``, ``bf16``, ``int8``, ``int4``).

    ``table_dtype`` (``int4`` or ``int8``), ``symmetric`` and ``method`` (``mse`` or ``rtn``) apply
    to int4 only; ``calibration`` (int8 and int4) makes every quantized weight's codes GPTQ's
    (``quant/gptq.py``) on those activation statistics. fp32 and bf16 take no option: every
    argument but ``dtype`` is ignored for them (the CLI refuses such options before this).

    Args:
        dtype: the format's name.
        block_size: weights per scale in the layers (None: the format's default, 32).
        table_block_size: weights per scale in the table (None: see :class:`Int8Format` / :class:`Int4Format`).
        hadamard_size: features per Hadamard block (None: :data:`DEFAULT_HADAMARD_SIZE`, 64; 0: no rotation).
        calibration: GPTQ statistics (None: round-to-nearest / clipping-search codes).
        activation_residual: (int8) every matmul also gets the residual of its input's int8
            rounding (:meth:`Int8Format._residual_rows`); int4 refuses it (ValueError).
        scale_dtype: (int8, int4) ``"float32"`` or ``"float16"`` block scales on disk (:class:`Int8Format`).

    Block sizes are not checked here (:func:`gemma_export.exporter.block_size_for` does it); one
    that does not divide a weight's in_features raises :class:`~gemma_export.errors.ConfigError`,
    naming the weight, when the graph is built.

    Raises:
        KeyError: unknown dtype (the CLI restricts choices before this).
        ValueError: (int4) ``table_dtype`` or ``method`` not one of those above; (int8, int4) an
            unknown ``scale_dtype``.
    """
    return WEIGHT_FORMATS[dtype].from_options(block_size, table_block_size, hadamard_size, table_dtype, symmetric,
                                              method, calibration, activation_residual, scale_dtype)
