"""minisgl.quant: weights kept in their checkpoint's formats (GGUF's block formats, 16-bit floats):
the formats and their reference dequantization (`formats`), and the weight type that the ops
backends take in place of a tensor (`QuantizedWeight`)."""

from .formats import GGMLType, dequantize
from .weight import QuantizedWeight, QuantPart, as_quantized

__all__ = ["GGMLType", "QuantPart", "QuantizedWeight", "as_quantized", "dequantize"]
