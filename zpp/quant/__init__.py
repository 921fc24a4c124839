"""Block int8/int4 quantization, the qgZ building blocks and 1-bit sign packing.

>>> import torch, zpp.quant as zq
>>> q = zq.quantize(torch.randn(1000), bits=4, group_size=256)
>>> x = zq.dequantize(q)
"""
from zpp.quant.api import (
    dequantize,
    dequantize_sum,
    onebit_compress,
    pack_signs,
    quantize,
    reduce_scatter_chunk,
    requantize_sum,
    signs_weighted_sum,
    swizzle_quantize,
    unpack_scaled,
    unpack_signs,
)
from zpp.quant.dispatch import fallback_counts
from zpp.quant.types import DEFAULT_GROUP_SIZE, QuantizedTensor, quantized_nbytes

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QuantizedTensor",
    "dequantize",
    "dequantize_sum",
    "fallback_counts",
    "onebit_compress",
    "pack_signs",
    "quantize",
    "quantized_nbytes",
    "reduce_scatter_chunk",
    "requantize_sum",
    "signs_weighted_sum",
    "swizzle_quantize",
    "unpack_scaled",
    "unpack_signs",
]
