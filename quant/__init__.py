"""Weight quantizers: pure numpy functions on arrays. No file I/O, no ONNX.

Each scheme is a small frozen dataclass holding its arrays, with a ``quantize`` constructor and a
``dequantize`` method. The exporter chooses one per weight through ``gemma_export.weights``
(``weight_format``: bf16, or block-wise int8 / int4 run by onnxruntime's ``MatMulNBits``).
"""

#: public name → submodule: imported on first use (PEP 562), so that ``quant.scales``' constants (the
#: CLI's choices) load without the quantizers and ml_dtypes: ``gemma-export --help`` imports neither
_PUBLIC = {
    "BF16Weights": "bf16", "bfloat16_bits_to_float32": "bf16", "float32_to_bfloat16_bits": "bf16",
    "truncate_to_bfloat16_bits": "bf16",
    "hadamard_matrix": "hadamard", "rotate_blocks": "hadamard",
    "BlockInt4Weights": "int4",
    "BlockInt8Weights": "int8",
}

__all__ = sorted(_PUBLIC)


#: the submodules, reachable as attributes (``quant.int8.ZERO_POINT``) as when this package imported them all
_SUBMODULES = ("bf16", "gptq", "hadamard", "int4", "int8", "rows", "scales")


def __getattr__(name):
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    if name not in _PUBLIC:
        raise AttributeError(f"module 'quant' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)


def __dir__():
    return sorted({*globals(), *_PUBLIC, *_SUBMODULES})
