"""Quantization for the a8w8 GEMMs: formats (fp8 e4m3 fn/fnuz, int8), quantizers / dequantizers for
every scale layout the ops take, and the weight layout of the *_bpreshuffle ops."""

from .formats import BLOCK, FP8, FP8_FNUZ, QUANT_DTYPES, is_fp8, native_fp8, qmax, quant_dtype
from .quantize import (
    dequantize,
    dequantize_1x128,
    dequantize_128x128,
    quantize_1x128,
    quantize_128x128,
    quantize_per_channel,
    quantize_per_tensor,
    quantize_per_token,
)
from .shuffle import is_shuffled, shuffle_weight

__all__ = [
    "BLOCK",
    "FP8",
    "FP8_FNUZ",
    "QUANT_DTYPES",
    "dequantize",
    "dequantize_128x128",
    "dequantize_1x128",
    "is_fp8",
    "is_shuffled",
    "native_fp8",
    "qmax",
    "quant_dtype",
    "quantize_128x128",
    "quantize_1x128",
    "quantize_per_channel",
    "quantize_per_tensor",
    "quantize_per_token",
    "shuffle_weight",
]
