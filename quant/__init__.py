"""Weight quantizers: pure numpy functions on arrays. No file I/O, no ONNX.

Each scheme is a small frozen dataclass holding its arrays, with a ``quantize`` constructor and a
``dequantize`` method. The exporter chooses one per weight through ``gemma_export.weights``
(``weight_format``: bf16, or block-wise int8 / int4 run by onnxruntime's ``MatMulNBits``).
"""

from .bf16 import BF16Weights, bfloat16_bits_to_float32, float32_to_bfloat16_bits, truncate_to_bfloat16_bits
from .hadamard import hadamard_matrix, rotate_blocks
from .int4 import BlockInt4Weights
from .int8 import BlockInt8Weights

__all__ = ["BF16Weights", "bfloat16_bits_to_float32", "truncate_to_bfloat16_bits", "BlockInt4Weights", "BlockInt8Weights", "float32_to_bfloat16_bits", "hadamard_matrix", "rotate_blocks"]
