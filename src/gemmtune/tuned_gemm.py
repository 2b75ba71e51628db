"""aiter-compatible entry point: `gemmtune.tuned_gemm.gemm_a16w16(A, B, bias=None, otype=None, ...)`.

Same argument names as aiter's `tuned_gemm.gemm_a16w16` so call sites move over unchanged. B is the
weight in nn.Linear layout [N, K]. aiter's quantization scales are not supported here: pass them as
None (a non-None scale is an error rather than a silently unscaled result). aiter's other GEMM entry
points with the same names and arguments (gemm_bias, gemm_gelu, gemm_relu, cutlass_gemm, the 8-bit ops,
sparse_gemm) are the ops that declare those names (`aiter_names` in ops/registry.py).
"""

from __future__ import annotations

import torch

from .ops import gemm
from .ops.registry import aiter_exports as _aiter_exports
from .quant.shuffle import shuffle_weight as shuffle_weight  # aiter has it beside the 8-bit ops

globals().update(_aiter_exports())


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


__all__ = sorted([*_aiter_exports(), "gemm_a16w16", "shuffle_weight"])
