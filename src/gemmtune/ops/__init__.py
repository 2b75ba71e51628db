"""Public GEMM ops, one module per family."""

from .batched import batched_gemm
from .gemm import gemm, key_of, validate

__all__ = ["batched_gemm", "gemm", "key_of", "validate"]
