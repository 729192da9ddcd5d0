"""A thin helper over onnx-ir for building graphs: ops, small constants and initializers with
deterministic names. It knows nothing about Gemma."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

OPSET = 21  # Gelu(approximate="tanh") needs 20; onnxruntime's CPU provider runs 21 on x86-64 and aarch64
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    """Collects nodes and initializers for one :class:`onnx_ir.Graph`."""

    def __init__(self) -> None:
        self.nodes: list[ir.Node] = []
        self.initializers: dict[str, ir.Value] = {}
        self.inputs: list[ir.Value] = []
        self.outputs: list[ir.Value] = []
        self._counter = 0
        self._scope: list[str] = []

    # ---- naming ---------------------------------------------------------------------------------
    def _name(self, op_type: str) -> str:
        self._counter += 1
        return "/".join([*self._scope, f"{op_type}_{self._counter}"])

    def scope(self, name: str) -> "_Scope":
        """``with g.scope("layers.3/attn"):`` prefixes node names (readable optimized graphs)."""
        return _Scope(self, name)

    # ---- values ---------------------------------------------------------------------------------
    def input(self, name: str, dtype: ir.DataType, shape: list[int | str]) -> ir.Value:
        """A graph input; ``shape`` mixes fixed sizes and symbolic dimension names."""
        value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
        self.inputs.append(value)
        return value

    def output(self, value: ir.Value, name: str, dtype: ir.DataType, shape: list[int | str]) -> None:
        """Declare ``value`` (a node's output) a graph output, renamed ``name``, with its type and shape."""
        value.name = name
        value.type = ir.TensorType(dtype)
        value.shape = ir.Shape(shape)
        self.outputs.append(value)

    def initializer(self, tensor: ir.TensorProtocol) -> ir.Value:
        """Register a (lazy) tensor as an initializer named ``tensor.name``.

        Raises:
            ValueError: the name is registered already (a builder bug: two weights under one name).
        """
        if tensor.name in self.initializers:
            raise ValueError(f"initializer '{tensor.name}' defined twice")
        value = ir.Value(name=tensor.name, type=ir.TensorType(tensor.dtype), shape=tensor.shape, const_value=tensor)
        self.initializers[tensor.name] = value
        return value

    def const(self, array: np.ndarray, name: str | None = None) -> ir.Value:
        """A small constant initializer (masks' fill values, shapes, RoPE frequencies)."""
        name = name or f"const_{len(self.initializers)}"
        return self.initializer(ir.tensor(np.asarray(array), name=name))

    def const_i64(self, values: list[int]) -> ir.Value:
        """An int64 1-D constant (shapes, axes, slice bounds)."""
        return self.const(np.asarray(values, dtype=np.int64))

    def const_f32(self, value: float) -> ir.Value:
        """A float32 scalar constant."""
        return self.const(np.asarray(value, dtype=np.float32))

    # ---- nodes ----------------------------------------------------------------------------------
    def op(self, op_type: str, *inputs: ir.Value | None, domain: str = "", num_outputs: int = 1, **attributes):
        """Append a node; returns its output value (or a tuple when ``num_outputs > 1``)."""
        node = ir.node(op_type, list(inputs), attributes=attributes, domain=domain,
                       num_outputs=num_outputs, name=self._name(op_type))
        self.nodes.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)

    def model(self, name: str, doc_string: str) -> ir.Model:
        """The :class:`onnx_ir.Model` of everything added so far (opset ``OPSET`` and ``com.microsoft`` 1)."""
        graph = ir.Graph(
            self.inputs, self.outputs, nodes=self.nodes, initializers=list(self.initializers.values()),
            opset_imports={"": OPSET, MS_DOMAIN: 1}, name=name,
        )
        # IR version 10 goes with opset 21 (ONNX 1.16, onnx/helper.py VERSION_TABLE), which onnxruntime
        # reads since 1.18; a newer IR would shut out older runtimes on a board for nothing
        return ir.Model(graph, ir_version=10, producer_name="gemma-export", doc_string=doc_string)


class _Scope:
    def __init__(self, builder: GraphBuilder, name: str):
        self.builder, self.name = builder, name

    def __enter__(self):
        self.builder._scope.append(self.name)

    def __exit__(self, *exc):
        self.builder._scope.pop()
