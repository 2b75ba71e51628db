"""Public GEMM ops, one module per family."""

from .batched import batched_gemm
from .gemm import gemm, key_of, validate
from .quantized import (
    gemm_a8w8,
    gemm_a8w8_blockscale,
    gemm_a8w8_blockscale_bpreshuffle,
    gemm_a8w8_bpreshuffle,
    int8_gemm,
)

__all__ = [
    "batched_gemm",
    "gemm",
    "gemm_a8w8",
    "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle",
    "gemm_a8w8_bpreshuffle",
    "int8_gemm",
    "key_of",
    "validate",
]
