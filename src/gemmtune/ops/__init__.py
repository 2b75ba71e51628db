"""Public GEMM ops."""

from .gemm import gemm, key_of, validate

__all__ = ["gemm", "key_of", "validate"]
