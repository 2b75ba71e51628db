"""Public GEMM ops, one module per family."""

from .batched import batched_gemm
from .gemm import gemm, key_of, validate
from .moe import fused_moe, grouped_gemm, prepare_expert_weights

__all__ = ["batched_gemm", "fused_moe", "gemm", "grouped_gemm", "key_of", "prepare_expert_weights", "validate"]
