"""Public GEMM ops, one module per family."""

from .batched import batched_gemm
from .epilogue import cutlass_gemm, gemm_bias, gemm_epilogue, gemm_gelu, gemm_relu
from .gemm import gemm, key_of, validate
from .sparse import prune_2_4, sparse_gemm

__all__ = ["batched_gemm", "cutlass_gemm", "gemm", "gemm_bias", "gemm_epilogue", "gemm_gelu", "gemm_relu", "key_of",
           "prune_2_4", "sparse_gemm", "validate"]  # fmt: skip
