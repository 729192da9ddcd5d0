"""Remove duplicated tables from an ONNX model made by another exporter.

Handles the three ways a tied embedding ends up twice in memory:

* the same bytes stored under two names → every consumer reads the first;
* a pre-transposed copy ``[hidden, vocab]`` feeding ``MatMul`` (torch.onnx's classic output) →
  ``Gemm(transB=1)`` on the ``[vocab, hidden]`` table;
* one initializer shared through a ``Transpose`` that onnxruntime would constant-fold into a second
  copy → the same ``Gemm(transB=1)`` rewrite, Transpose removed.

Every other initializer is written unchanged. The result is checked with onnxruntime on random
inputs against the original.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import onnx_ir as ir

from .errors import FormatError, OutputError, VerificationError, check_arguments, first_line
from .inspect import CHUNK_BYTES, MIN_DUPLICATE_BYTES, inspect_path, read_block
from .manifest import is_prepacked_copy
from .onnx_files import ALIGNMENT_BYTES
from .staging import check_free_space, check_replaceable, staged_folder
from .text_files import require_file


@dataclasses.dataclass(frozen=True)
class DedupeResult:
    """What :func:`dedupe` changed: removed initializer names, bytes saved on disk, rewritten
    MatMuls, and the largest output difference against the original on random inputs."""

    out_path: Path
    removed: list[str]
    saved_bytes: int
    rewritten_matmuls: int
    max_abs_diff: float


def _gemm_for_matmul(graph: ir.Graph, matmul: ir.Node, table: ir.Value, index: int) -> None:
    """Replace ``MatMul(a, tableᵀ)`` by ``Reshape(Gemm(Reshape(a, [-1, H]), table, transB=1))``; the
    new nodes and constants are named after the MatMul and ``index`` (unique per rewrite: MatMuls
    may have no name). A MatMul inside a subgraph (an ``If`` branch) is rewritten there, reading the
    table from the main graph (ONNX's outer scope). Gemm without a third input and Slice with its
    bounds as inputs need opset 11 (the caller checks).
    """
    a = matmul.inputs[0]
    vocab, hidden = (int(d) for d in table.shape)
    name = f"{matmul.name or 'matmul'}/{index}"

    def const(values, suffix):
        tensor = ir.tensor(np.asarray(values, dtype=np.int64), name=f"{name}/dedupe_{suffix}")
        value = ir.Value(name=tensor.name, type=ir.TensorType(ir.DataType.INT64), shape=tensor.shape, const_value=tensor)
        graph.register_initializer(value)
        return value

    shape = ir.node("Shape", [a], name=f"{name}/dedupe_shape")
    lead = ir.node("Slice", [shape.outputs[0], const([0], "start"), const([-1], "end")], name=f"{name}/dedupe_lead")
    out_shape = ir.node("Concat", [lead.outputs[0], const([vocab], "vocab")], {"axis": 0}, name=f"{name}/dedupe_out_shape")
    flat = ir.node("Reshape", [a, const([-1, hidden], "flat")], name=f"{name}/dedupe_flat")
    gemm = ir.node("Gemm", [flat.outputs[0], table], {"transB": 1}, name=f"{name}/dedupe_gemm")
    result = ir.node("Reshape", [gemm.outputs[0], out_shape.outputs[0]], name=f"{name}/dedupe_unflat")
    new_nodes = [shape, lead, out_shape, flat, gemm, result]
    matmul.graph.insert_before(matmul, new_nodes)  # its own graph: the main one or a subgraph
    old = matmul.outputs[0]
    keep_name = old.name
    old.replace_all_uses_with(result.outputs[0], replace_graph_outputs=True)
    matmul.graph.remove(matmul, safe=True)
    result.outputs[0].name = keep_name
    result.outputs[0].type, result.outputs[0].shape = old.type, old.shape


#: onnxruntime's input type names → the numpy dtype of the random values fed to them
_FEED_DTYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _random_feeds(session, vocab: int) -> dict[str, np.ndarray]:
    """Random inputs for every input of ``session``: integer ids below ``vocab`` for ``*ids``, ones
    for masks, ``0 … n-1`` for positions, small integers for other integer inputs, normal values
    for float ones; symbolic dimensions 1 (batch), 0 (past) or 7.

    Raises:
        FormatError: an input of a type no random value is made for (e.g. a string input).
    """
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else (1 if "batch" in str(d).lower() else (0 if "past" in str(d).lower() else 7))
                 for d in i.shape]
        dtype = _FEED_DTYPES.get(i.type)
        if dtype is None:
            raise FormatError(f"input '{i.name}' is {i.type}; dedupe compares outputs on random integer or float inputs only")
        if np.issubdtype(dtype, np.integer):
            if "mask" in i.name:
                values = np.ones(shape)
            elif "position" in i.name:
                values = np.broadcast_to(np.arange(shape[-1]), shape)
            else:
                values = rng.integers(0, vocab if "ids" in i.name else 2, size=shape)
        else:
            values = rng.standard_normal(shape)
        feeds[i.name] = np.ascontiguousarray(values, dtype=dtype)
    return feeds


def _compare(original: Path, rewritten: Path, vocab: int) -> float:
    """Largest output difference between the two models on the same random inputs (ids below
    ``vocab``), one session at a time.

    Raises:
        FormatError: onnxruntime cannot load or run the ``original`` (the input is at fault).
        VerificationError: it cannot load or run the ``rewritten`` one.
        MemoryError: unwrapped, whichever model needed it.
    """
    from .runtime import create_session

    session = create_session(original)  # FormatError naming the input
    try:
        feeds = _random_feeds(session, vocab)
    except FormatError as exc:
        raise FormatError(f"{original}: {exc}") from None
    expected = _outputs(session, feeds, lambda line: FormatError(
        f"{original}: onnxruntime cannot run the model on random ids: {line}"))
    del session
    try:
        session = create_session(rewritten)
    except FormatError as exc:  # its message names the staging folder, which is deleted next
        raise VerificationError(f"{rewritten.name}: onnxruntime cannot load the rewritten model: "
                                f"{str(exc).removeprefix(f'{rewritten}: ')}") from None
    got = _outputs(session, feeds, lambda line: VerificationError(
        f"{rewritten.name}: onnxruntime cannot run the rewritten model: {line}"))
    return max((_max_difference(x, y) for x, y in zip(expected, got)), default=0.0)


def _outputs(session, feeds: dict[str, np.ndarray], error: Callable[[str], Exception]) -> list:
    """``session.run(None, feeds)``; a failure raises ``error(its first line)`` (MemoryError unwrapped)."""
    try:
        return session.run(None, feeds)
    except MemoryError:
        raise
    except Exception as exc:  # onnxruntime's Fail / InvalidArgument / ... are bare Exceptions
        raise error(first_line(exc)) from None


def _max_difference(x: np.ndarray, y: np.ndarray) -> float:
    """max |x - y|, where NaN in both places counts as equal and NaN in one as infinitely far."""
    if not x.size:
        return 0.0
    x, y = x.astype(np.float64), y.astype(np.float64)
    both = np.isnan(x) & np.isnan(y)
    difference = np.where(both, 0.0, np.abs(x - y))
    return float(np.nan_to_num(difference, nan=np.inf).max())


def _refuse_near_duplicates(report) -> None:
    """Refuse two 2-D float tables (same shape, or one the other's transpose) whose values differ
    by at most 1% of their range without being identical: merging them would change the
    model. Compared in blocks of rows (a few MiB at a time), never whole.

    Raises:
        FormatError: naming the file and both tensors.
    """
    exact = {n for g in report.duplicates for n in g.names}
    floats = [t for t in report.tensors if t.nbytes >= MIN_DUPLICATE_BYTES and t.name not in exact
              and t.dtype in ("FLOAT", "FLOAT16") and len(t.shape) == 2]
    for i, a in enumerate(floats):
        for b in floats[i + 1:]:
            if a.shape not in (b.shape, b.shape[::-1]) or a.shape[0] == a.shape[1]:
                continue
            largest, difference = _largest_and_difference(a, b, transposed=a.shape != b.shape)
            if difference <= 1e-2 * largest:  # two all-zero tables are identical bytes, merged above
                raise FormatError(f"{report.path}: '{a.name}' and '{b.name}' are close but not identical "
                                  "(max difference ≤ 1% of their range); refusing to merge them")


def _largest_and_difference(a, b, transposed: bool) -> tuple[float, float]:
    """``(max(|a|, |b|), max |a - b|)`` (``b.T`` when ``transposed``) for ``a [R, C]``, read in row
    blocks. Both tables' range: an all-zero ``a`` made any small table "close" to it."""
    rows, cols = a.shape
    step = max(1, CHUNK_BYTES // (cols * 8))  # the float64 block is the largest temporary
    largest = difference = 0.0
    for start in range(0, rows, step):
        block = slice(start, start + step)
        x = read_block(a, block, slice(None)).astype(np.float64)
        y = read_block(b, slice(None), block).T if transposed else read_block(b, block, slice(None))
        largest = max(largest, float(np.abs(x).max()), float(np.abs(y).max()))
        difference = max(difference, float(np.abs(x - y).max()))
    return largest, difference


def dedupe(in_path: str | Path, out_dir: str | Path, progress: Callable[[str], None] | None = None) -> DedupeResult:
    """Write a copy of ``in_path`` in ``out_dir`` with each duplicated table stored once.

    Args:
        in_path: an ONNX model file (``.onnx``), its external data beside it.
        out_dir: the folder for the rewritten model (``model.onnx`` and ``model.onnx.data``); it must
            not exist, or be empty.
        progress: told, a line each, of leftovers of killed earlier runs beside ``out_dir`` and of a
            replaced folder that could not be deleted (:func:`~gemma_export.staging.staged_folder`).

    Returns:
        A :class:`DedupeResult`: the written model's path, the removed initializers' names, the bytes
        saved on disk, the number of ``MatMul`` nodes rewritten to read the kept table, and the
        largest absolute output difference against ``in_path`` on random inputs (float, in the
        outputs' units: logits).

    Raises:
        FormatError: not an ONNX model, the graph of a pre-packed copy (``gemma-export prepack``),
            nothing to deduplicate, or two large tensors are close but not identical (merging them
            would change the model).
        OutputError: ``out_dir`` is the input's folder, not an empty folder, inside an export or
            bundle folder of this toolkit, a symbolic link, a mount point or the current folder
            (:func:`~gemma_export.staging.check_replaceable`: the finished output replaces the
            folder by a rename, which none of the last three survives).
        SourceNotFoundError: ``in_path`` is missing or not a file.
        VerificationError: outputs on random inputs changed.
        ConfigError: an argument of the wrong type (:func:`~gemma_export.errors.check_arguments`).
    """
    check_arguments("dedupe", in_path=(in_path, "path"), out_dir=(out_dir, "path"), progress=(progress, "callable?"))
    in_path = Path(in_path)
    out_dir = Path(out_dir)
    if out_dir.resolve() == in_path.resolve().parent:
        raise OutputError(f"{out_dir}: choose a folder other than the input's")

    check_replaceable(out_dir, "deduplicated model", None)  # it writes no listing: only an empty folder is replaced
    require_file(in_path, "model file (.onnx)")
    if in_path.suffix != ".onnx":
        raise FormatError(f"{in_path}: dedupe rewrites ONNX models; expected an .onnx file, found '{in_path.suffix or 'no extension'}'")
    if is_prepacked_copy(in_path.resolve().parent):
        raise FormatError(f"{in_path}: the graph of an export's pre-packed copy (gemma-export prepack), onnxruntime's "
                          "packed weights for one machine, which store the table once already; dedupe rewrites models "
                          "of other tools (give their .onnx)")
    report = inspect_path(in_path)
    if report.format != "onnx":
        raise FormatError(f"{in_path}: dedupe rewrites ONNX models; this is {report.format}")
    _refuse_near_duplicates(report)
    with warnings.catch_warnings():  # onnx_ir warns once per tensor about external-data keys it does not know
        warnings.simplefilter("ignore", UserWarning)
        model = ir.load(in_path)
    graph = model.graph
    inits = graph.initializers
    removed: list[str] = []
    rewritten = 0

    def rewritable(name: str) -> bool:  # a transposed copy only MatMul reads as its right-hand side
        return all(u.node.op_type == "MatMul" and u.idx == 1 for u in inits[name].uses())

    def lookup_first(names, kind):
        # keep the copy a Gather reads (the [vocab, hidden] layout), else the first; of transposed
        # copies, one whose other copies can all be rewritten (the declaration order decided before)
        gathered = [n for n in names if any(u.node.op_type in ("Gather", "GatherBlockQuantized")
                                            for u in inits[n].uses())]
        candidates = gathered + [n for n in names if n not in gathered]
        if kind == "transposed":
            for n in candidates:
                if all(rewritable(other) for other in names if other != n):
                    return n
        return candidates[0]

    opset = model.opset_imports.get("", 0)

    def gemm_for_matmul(matmul: ir.Node, table: ir.Value) -> None:
        nonlocal rewritten
        if opset < 11:  # Gemm's third input optional and Slice's bounds as inputs: opset 11 on
            raise FormatError(f"{in_path}: imports ONNX opset {opset}; dedupe rewrites MatMul into Gemm and Slice as "
                              "opset 11 defines them (convert the model with onnx.version_converter first)")
        _gemm_for_matmul(graph, matmul, table, rewritten)
        rewritten += 1

    merged_into: dict[str, str] = {}  # a copy removed by an earlier group → the table kept for it
    for group in report.duplicates:
        if group.kind not in ("identical bytes", "transposed"):
            raise FormatError(f"{in_path}: {', '.join(group.names)} hold one table in two precisions ({group.kind}); "
                              "merging them would change the model's outputs; refusing")
        # one table three times (A, its copy B, its transpose D) is two groups that share A
        names = list(dict.fromkeys(merged_into.get(n, n) for n in group.names))
        if len(names) < 2:
            continue
        keep_name = lookup_first(names, group.kind)
        keep = inits[keep_name]
        for name in names:
            if name == keep_name:
                continue
            copy = inits[name]
            if copy.is_graph_output():
                raise FormatError(f"{in_path}: '{name}' (a copy of '{keep_name}') is also an output of the graph, "
                                  "which must keep giving it; not rewritten")
            if group.kind == "identical bytes" and copy.shape == keep.shape:
                copy.replace_all_uses_with(keep)
            elif group.kind == "transposed":
                for use in list(copy.uses()):
                    if use.node.op_type != "MatMul" or use.idx != 1:
                        raise FormatError(f"{in_path}: '{name}' (a transposed copy of '{keep_name}') feeds "
                                          f"{use.node.op_type}; only MatMul can be rewritten")
                    gemm_for_matmul(use.node, keep)
            else:
                raise FormatError(f"{in_path}: '{name}' holds the bytes of '{keep_name}' in another shape; not rewritten")
            if copy in graph.inputs:  # an initializer listed as an input too (IR < 4 exporters): both go
                graph.inputs.remove(copy)
            del inits[name]
            removed.append(name)
            merged_into[name] = keep_name

    # one table shared through a Transpose feeding MatMul (folded into a copy by onnxruntime)
    for name, value in list(inits.items()):
        for use in list(value.uses()):
            t = use.node
            if t.op_type != "Transpose" or len(value.shape) != 2 or value.const_value.nbytes < MIN_DUPLICATE_BYTES:
                continue
            perm = t.attributes.get("perm")
            if perm is not None and list(perm.as_ints()) != [1, 0]:  # [0, 1] transposes nothing
                continue
            users = list(t.outputs[0].uses())
            # a transposed table that is also a graph output stays: the graph must still give it
            if users and all(u.node.op_type == "MatMul" and u.idx == 1 for u in users) and not t.outputs[0].is_graph_output():
                for u in users:
                    gemm_for_matmul(u.node, value)
                t.graph.remove(t, safe=True)

    if not removed and not rewritten:
        raise FormatError(f"{in_path}: no duplicated table and no Transpose-shared table found; nothing to do")
    # random ids must be rows of every table a Gather reads (not of a transposed copy's longer axis)
    gathered = [v.shape[0] for v in graph.initializers.values()
                if len(v.shape) == 2 and any(u.node.op_type.startswith("Gather") and u.idx == 0 for u in v.uses())]
    vocab = int(min(gathered, default=2))
    # before the write, as export, bundle and prepack do, so that a full disk is found before the
    # whole rewrite, not after it: the data file is the tensors that remain
    sizes = [v.const_value.nbytes for v in graph.initializers.values() if v.const_value is not None]
    # plus the padding that puts each tensor over 1 MiB on an ALIGNMENT_BYTES boundary (at most one each)
    remaining = sum(sizes) + ALIGNMENT_BYTES * sum(1 for n in sizes if n > 1 << 20)
    check_free_space(out_dir, remaining, "deduplicated model", largest_file_bytes=remaining)
    with staged_folder(out_dir, "deduplicated model", notify=progress) as staging:
        out_path = staging / in_path.name
        ir.save(model, out_path, external_data=in_path.name + ".data", max_workers=1, alignment=ALIGNMENT_BYTES)
        diff = _compare(in_path, out_path, vocab)
        if not diff <= 1e-4:
            raise VerificationError(f"{in_path}: outputs changed by {diff:g} after deduplication; nothing written")
    saved = sum(g.wasted_bytes for g in report.duplicates)
    return DedupeResult(out_dir / in_path.name, removed, saved, rewritten, diff)
