"""Quantization: the format table, codecs (GGML types and Inferflow's own) and QuantTensor."""

from inferflow.quant import ggml as _ggml  # noqa: F401  (registers the GGML formats)
from inferflow.quant.formats import FORMATS, QuantFormat, get_format
from inferflow.quant.tensor import QuantTensor

__all__ = ["FORMATS", "QuantFormat", "QuantTensor", "get_format"]
