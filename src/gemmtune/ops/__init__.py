"""Public GEMM ops, one module per family (and the softcapped attention op)."""

from .attention import softcap_attention
from .batched import batched_gemm
from .batched_a8w8 import batched_gemm_a8w8
from .epilogue import cutlass_gemm, gemm_bias, gemm_epilogue, gemm_gelu, gemm_relu
from .gemm import gemm, key_of, validate
from .moe import fused_moe, grouped_gemm, prepare_expert_weights
from .quantized import (
    gemm_a8w8,
    gemm_a8w8_blockscale,
    gemm_a8w8_blockscale_bpreshuffle,
    gemm_a8w8_bpreshuffle,
    int8_gemm,
)
from .sparse import prune_2_4, sparse_gemm

__all__ = [
    "batched_gemm",
    "batched_gemm_a8w8",
    "cutlass_gemm",
    "fused_moe",
    "gemm",
    "gemm_a8w8",
    "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle",
    "gemm_a8w8_bpreshuffle",
    "gemm_bias",
    "gemm_epilogue",
    "gemm_gelu",
    "gemm_relu",
    "grouped_gemm",
    "int8_gemm",
    "key_of",
    "prepare_expert_weights",
    "prune_2_4",
    "softcap_attention",
    "sparse_gemm",
    "validate",
]
