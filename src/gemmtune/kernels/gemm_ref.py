"""The reference every GEMM kernel (skinny, triton) must match: fp32 product + fp32 bias, one rounding."""

from __future__ import annotations

import torch


def gemm_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)
