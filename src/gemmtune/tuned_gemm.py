"""aiter-compatible entry point: `gemmtune.tuned_gemm.gemm_a16w16(A, B, bias=None, otype=None, ...)`.

Same argument names as aiter's `tuned_gemm.gemm_a16w16` so call sites move over unchanged. B is the
weight in nn.Linear layout [N, K]. aiter's quantization scales are not supported here: pass them as
None (a non-None scale is an error rather than a silently unscaled result). aiter's other GEMM entry
points with the same names and arguments: gemm_bias, gemm_gelu, gemm_relu, cutlass_gemm (ops/epilogue.py)
and sparse_gemm (ops/sparse.py).
"""

from __future__ import annotations

import torch

from .ops.epilogue import cutlass_gemm, gemm_bias, gemm_gelu, gemm_relu
from .ops.gemm import gemm
from .ops.quantized import (  # noqa: F401 - aiter's 8-bit op names, re-exported
    gemm_a8w8,
    gemm_a8w8_blockscale,
    gemm_a8w8_blockscale_bpreshuffle,
    gemm_a8w8_bpreshuffle,
    int8_gemm,
)
from .ops.sparse import sparse_gemm
from .quant.shuffle import shuffle_weight  # noqa: F401


def gemm_a16w16(
    A: torch.Tensor,
    B: torch.Tensor,
    bias: torch.Tensor | None = None,
    otype: torch.dtype | None = None,
    scale_a: torch.Tensor | None = None,
    scale_b: torch.Tensor | None = None,
    scale_c: torch.Tensor | None = None,
) -> torch.Tensor:
    if scale_a is not None or scale_b is not None or scale_c is not None:
        raise ValueError("gemm_a16w16: scale_a/scale_b/scale_c are not supported by gemmtune's a16w16 GEMM")
    return gemm(A, B, bias, otype)


__all__ = [
    "cutlass_gemm",
    "gemm_a16w16",
    "gemm_a8w8",
    "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle",
    "gemm_a8w8_bpreshuffle",
    "gemm_bias",
    "gemm_gelu",
    "gemm_relu",
    "int8_gemm",
    "shuffle_weight",
    "sparse_gemm",
]
