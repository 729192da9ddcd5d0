"""Load an ONNX model's graph and check where its external data lives before anything reads it.

ONNX stores large initializers outside the model file (``external_data`` entries ``location``,
``offset``, ``length``; onnx/docs/ExternalData.md). A model from elsewhere can point those at any
path: this module accepts only plain file names in the model's own folder, regular files (no links),
and byte ranges inside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .errors import FormatError

#: the graph and its external data, in every export folder (and the pre-packed copy)
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
#: the export's own record of its files, source and config (``gemma-export verify`` checks it)
MANIFEST_FILE = "manifest.json"
#: the file ``gemma-export bundle`` writes at the top of a board folder; the export is in ``model/``
BUNDLE_MANIFEST = "BUNDLE.json"
#: the folder of a board folder (``gemma-export bundle``) that holds its export
BUNDLE_MODEL_DIR = "model"
#: ``gemma-export prepack``'s machine-specific copy inside an export folder, and its record
PREPACKED_DIR = "prepacked"
PREPACKED_MANIFEST = "prepacked.json"
#: External tensors larger than 1 MiB (onnx_ir's ``align_threshold``) start on 64 KiB boundaries so
#: that onnxruntime can memory-map them on x86-64 and on aarch64 kernels with 64 KiB pages; smaller
#: ones are packed without padding (aligning every tensor to 4 KiB instead left onnxruntime's memory
#: after session creation unchanged: int8, 302 MB Anonymous either way, 2026-12-03).
ALIGNMENT_BYTES = 65536


#: protobuf's limit on a serialized message, so on an ONNX file without its external data: 2 GiB
MAX_PROTOBUF_BYTES = (2 << 30) - 1


def read_graph(model_path: str | Path):
    """The ``onnx.ModelProto`` of ``model_path`` without its external data, unchecked (pass it to
    :func:`check_external_data`, or use :func:`load_graph`).

    Raises:
        FormatError: the file is not a readable ONNX model.
    """
    import onnx

    if (size := Path(model_path).stat().st_size) > MAX_PROTOBUF_BYTES:  # read whole by onnx.load
        raise FormatError(f"{model_path}: {size:,} bytes; not an ONNX model, which protobuf limits to "
                          f"{MAX_PROTOBUF_BYTES:,} (larger weights go in external data files)")
    try:
        model = onnx.load(str(model_path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends: not our user's concern which
        raise FormatError(f"{model_path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.HasField("graph"):  # protobuf parses an empty (or graph-less) file as a default model
        empty = Path(model_path).stat().st_size == 0
        raise FormatError(f"{model_path}: not an ONNX model: {'the file is empty' if empty else 'it has no graph'}")
    return model


def load_graph(model_path: str | Path):
    """The ``onnx.ModelProto`` of ``model_path`` without its external data, after
    :func:`check_external_data`.

    Raises:
        FormatError: the file is not a readable ONNX model, or an initializer's external data is not
            a regular file of the model's folder, or lies outside that file.
    """
    model = read_graph(model_path)
    check_external_data(model, Path(model_path))
    return model


def check_external_data(model, model_path: Path) -> dict[str, int]:
    """Check every external-data reference of ``model`` (loaded from ``model_path``): of its
    initializers, sparse initializers and tensors in node attributes (``Constant``'s ``value``),
    in the main graph, its subgraphs (``If``, ``Loop``, ``Scan``) and its functions.

    Returns:
        location → size in bytes of each data file.

    Inline initializers are checked too: their data must hold what their dims and data type need.

    Raises:
        FormatError: naming the initializer (or node attribute): a negative dimension; inline data of another size than
            its dims and data type need; for external data, a location that is absolute, has a
            folder part (``..`` included), is missing, is a link or not a regular file, a ``length``
            that differs from what the dims and data type need, or ``offset + length`` past the
            file's end. An absent ``length`` (optional in ONNX) is added to ``model`` from the dims
            and data type, so readers of the entries see it.
    """
    import onnx

    folder = Path(model_path).parent
    sizes: dict[str, int] = {}
    for label, t in _all_tensors(model):
        if any(d < 0 for d in t.dims):
            raise FormatError(f"{model_path}: {label} has shape {list(t.dims)}; dimensions must "
                              "not be negative")
        if t.data_location != onnx.TensorProto.EXTERNAL:
            _check_inline_data(t, model_path, label)
            continue
        info = {e.key: e.value for e in t.external_data}
        location = info.get("location", "")
        if not location or Path(location).name != location or location in (".", ".."):
            raise FormatError(f"{model_path}: {label} keeps its data at {location!r}; "
                              "expected a file name in the model's own folder")
        path = folder / location
        if path.is_symlink() or not path.is_file():
            what = "a link" if path.is_symlink() else "missing or not a regular file"
            raise FormatError(f"{path}: external data of {label} is {what}")
        size = sizes.setdefault(location, path.stat().st_size)
        try:
            offset, length = int(info.get("offset", 0) or 0), int(info.get("length", 0) or 0)
        except ValueError:
            raise FormatError(f"{model_path}: {label} has a non-integer offset/length "
                              f"({info.get('offset')!r}, {info.get('length')!r})") from None
        expected = tensor_bytes(t)
        if "length" not in info and expected is not None:  # optional in ONNX: the dims and dtype give it
            length = expected
            entry = t.external_data.add()
            entry.key, entry.value = "length", str(expected)
        elif expected is not None and length != expected:
            raise FormatError(f"{model_path}: {label} declares {length:,} bytes of external data; "
                              f"its shape {list(t.dims)} and data type need {expected:,}")
        if offset < 0 or length < 0 or offset + length > size:
            raise FormatError(f"{path}: {label} data [{offset}, {offset + length}) lies outside "
                              f"the file's {size} bytes")
    return sizes


def _all_tensors(model) -> Iterator[tuple[str, object]]:
    """Every ``TensorProto`` of ``model`` with a label for messages ("initializer 'w'"): initializers,
    the parts of sparse initializers, and tensors held by node attributes, in the main graph, every
    subgraph and every function (onnx/onnx.proto3: ``GraphProto``, ``AttributeProto``)."""

    def of_sparse(sparse, label: str):
        yield f"{label} values", sparse.values
        yield f"{label} indices", sparse.indices

    def of_nodes(nodes):
        for node in nodes:
            for attr in node.attribute:
                where = f"tensor of node '{node.name or node.op_type}' attribute '{attr.name}'"
                if attr.HasField("t"):
                    yield where, attr.t
                for tensor in attr.tensors:
                    yield where, tensor
                if attr.HasField("sparse_tensor"):
                    yield from of_sparse(attr.sparse_tensor, where)
                for sparse in attr.sparse_tensors:
                    yield from of_sparse(sparse, where)
                if attr.HasField("g"):
                    yield from of_graph(attr.g)
                for graph in attr.graphs:
                    yield from of_graph(graph)

    def of_graph(graph):
        for t in graph.initializer:
            yield f"initializer '{t.name}'", t
        for sparse in graph.sparse_initializer:
            yield from of_sparse(sparse, f"sparse initializer '{sparse.values.name}'")
        yield from of_nodes(graph.node)

    yield from of_graph(model.graph)
    for function in model.functions:
        yield from of_nodes(function.node)


def _check_inline_data(tensor, model_path: Path, label: str) -> None:
    """Raises FormatError, naming ``label``, when an inline tensor's data does not fill its dims and data type."""
    import onnx

    if tensor.HasField("raw_data"):
        expected = tensor_bytes(tensor)
        if expected is not None and len(tensor.raw_data) != expected:
            raise FormatError(f"{model_path}: {label} holds {len(tensor.raw_data):,} bytes of data; "
                              f"its shape {list(tensor.dims)} and data type need {expected:,}")
        return
    try:  # data in the typed fields (float_data, int32_data, ...): onnx reads them into the shape
        onnx.numpy_helper.to_array(tensor)
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{model_path}: {label} data does not fit its shape {list(tensor.dims)} "
                          f"({exc})") from None


def tensor_bytes(tensor) -> int | None:
    """Bytes of an ``onnx.TensorProto``'s data from its dims and data type (4-bit types packed two per
    byte); None for strings and unknown types."""
    import math

    import onnx
    from onnx import helper

    count = math.prod(int(d) for d in tensor.dims)
    packed = {onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
    if hasattr(onnx.TensorProto, "FLOAT4E2M1"):
        packed.add(onnx.TensorProto.FLOAT4E2M1)
    if tensor.data_type in packed:
        return (count + 1) // 2
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    try:
        return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None


def logits_dims(model) -> list:
    """The ``logits`` output's shape dimensions (``onnx.TensorShapeProto.Dimension``) of an
    ``onnx.ModelProto``; [] without such an output."""
    logits = next((o for o in model.graph.output if o.name == "logits"), None)
    return list(logits.type.tensor_type.shape.dim) if logits is not None else []


def logits_vocab(model) -> int | None:
    """The ``logits`` output's last dimension, the vocabulary; None when symbolic or absent."""
    dims = logits_dims(model)
    return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None


def graph_dtype(model) -> str:
    """Which ``--dtype`` an export's graph (an ``onnx.ModelProto``, external data not loaded) stores:
    ``int4`` or ``int8`` from its ``MatMulNBits`` ``bits`` (the layers'; an int4 export may keep an
    int8 table), else ``bf16`` when an initializer is bfloat16, else ``fp32``."""
    import onnx

    bits = {a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    if bits:
        return "int4" if 4 in bits else "int8"
    if any(t.data_type == onnx.TensorProto.BFLOAT16 for t in model.graph.initializer):
        return "bf16"
    return "fp32"


def traced_initializer(name: str, initializers: dict, produced_by: dict):
    """The initializer (an ``onnx.TensorProto`` of ``initializers``, name → tensor) that ``name`` is,
    directly or through ``Cast`` / ``Identity`` nodes (``produced_by``: output name → node), as a bf16
    table or float16 scales reach their readers; None when it is something else. A ``Cast`` /
    ``Identity`` loop (a broken graph, which onnxruntime then names) ends the walk."""
    seen = set()
    while (name not in initializers and name not in seen and name in produced_by
           and produced_by[name].op_type in ("Cast", "Identity") and produced_by[name].input):
        seen.add(name)
        name = produced_by[name].input[0]
    return initializers.get(name)


#: ``manifest.json``'s ``quantization.scale_dtype`` for the data type of a scales initializer
_SCALE_DTYPES = {1: "float32", 10: "float16"}  # onnx.TensorProto.FLOAT, FLOAT16


def graph_quantization(model) -> dict[str, tuple[object, str]]:
    """What an int8/int4 export's graph (an ``onnx.ModelProto``, external data not loaded) shows of
    its quantization, under the names of the manifest's ``quantization`` record, each as
    ``(value, where the graph shows it)``:

    - ``block_size``: the layers' ``MatMulNBits`` ``block_size`` (weights per scale);
    - ``table_block_size`` and ``table_dtype`` (``int4``/``int8``): the head's ``MatMulNBits``,
      the one whose codes the lookup of ``input_ids`` also reads (the tied table), else the one
      whose ``N`` is the logits' width (an untied head); the layers are the other ones;
    - ``scale_dtype`` (``float32``/``float16``): the data type of the initializers that hold the
      scales (read directly, or through ``Cast``/``Identity``);
    - ``symmetric``: True when no layer ``MatMulNBits`` takes zero points;
    - ``activation_residual``: True when every layer ``MatMulNBits`` output is split in two along the
      batch axis (``Split`` axis 0: the doubled rows of ``--activation-residual``);
    - ``hadamard_size``: the size of the square rotation a ``MatMul`` reads from an initializer, 0 when
      no ``MatMul`` does.

    A figure the graph does not show uniformly (e.g. two layer block sizes) is left out, as is
    everything for a graph without ``MatMulNBits`` (fp32, bf16, other tools' graphs)."""
    graph = model.graph
    matmuls = [n for n in graph.node if n.op_type == "MatMulNBits" and len(n.input) >= 3 and len(n.output) >= 1]
    if not matmuls:
        return {}
    initializers = {t.name: t for t in graph.initializer}
    produced_by = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    # the tied table: what the lookup of input_ids reads (Gather of the codes, or GatherBlockQuantized)
    gathered = {n.input[0] for n in graph.node if n.op_type in ("Gather", "GatherBlockQuantized")
                and len(n.input) >= 2 and n.input[1] == "input_ids"}

    def attribute(node, name):
        return next((a.i for a in node.attribute if a.name == name), None)

    def only(values):
        values = set(values)
        return values.pop() if len(values) == 1 else None

    # the head: the MatMulNBits that reads the tied table, else (an untied head) the one whose N is
    # the logits' width
    head = [n for n in matmuls if n.input[1] in gathered]
    if not head:
        vocab = logits_vocab(model)
        head = [n for n in matmuls if vocab is not None and attribute(n, "N") == vocab]
    layers = [n for n in matmuls if n not in head]
    found: dict[str, tuple[object, str]] = {}
    if (block := only(attribute(n, "block_size") for n in layers)) is not None:
        found["block_size"] = (block, f"the layers' MatMulNBits have block_size {block}")
    if len(head) == 1:
        found["table_block_size"] = (attribute(head[0], "block_size"),
                                     f"the head's MatMulNBits has block_size {attribute(head[0], 'block_size')}")
        bits = attribute(head[0], "bits")  # int8 exports record no table_dtype; one that does is checked too
        found["table_dtype"] = (f"int{bits}", f"the head's MatMulNBits has bits {bits}")
    scales = [traced_initializer(n.input[2], initializers, produced_by) for n in matmuls]
    if all(t is not None for t in scales) and (dtype := only(_SCALE_DTYPES.get(t.data_type) for t in scales)):
        found["scale_dtype"] = (dtype, f"the MatMulNBits scales are stored as {dtype}")
    if layers:  # int8 exports are symmetric and record no such field; a hand-edited one is checked
        zero_points = {len(n.input) >= 4 and n.input[3] != "" for n in layers}
        if len(zero_points) == 1:
            symmetric = not zero_points.pop()
            found["symmetric"] = (symmetric, "the layers' MatMulNBits take " + ("no zero points" if symmetric else
                                                                               "zero points"))

    def split_in_two(node) -> bool:  # node has an output (matmuls above)
        return any(c.op_type == "Split" and (attribute(c, "axis") or 0) == 0 for c in consumers.get(node.output[0], []))

    if layers and (residual := only(split_in_two(n) for n in layers)) is not None:
        found["activation_residual"] = (residual, "the layers' MatMulNBits outputs are " +
                                        ("split in two along the batch axis" if residual else "used as they are"))
    rotations = [initializers[n.input[1]] for n in graph.node if n.op_type == "MatMul" and len(n.input) == 2
                 and n.input[1] in initializers]
    square = {int(t.dims[0]) for t in rotations if len(t.dims) == 2 and t.dims[0] == t.dims[1]}
    if not rotations:
        found["hadamard_size"] = (0, "no MatMul reads a rotation")
    elif len(square) == 1:
        size = square.pop()
        found["hadamard_size"] = (size, f"its MatMuls read a {size} x {size} rotation")
    return found
