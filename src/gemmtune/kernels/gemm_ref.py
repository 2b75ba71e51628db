"""The references GEMM kernels must match, in plain PyTorch: the GEMM (fp32 product + fp32 bias, one
rounding; skinny and triton kernels) and the fused epilogue (triton's epilogue kernels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTS = ("none", "relu", "gelu", "gelu_tanh")


def gemm_ref(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype)


def fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 with TF32 off (the reference every family's check compares against)."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def apply_act(y: torch.Tensor, act: str) -> torch.Tensor:
    """The activation by name (out of place: the unfused path a model runs)."""
    if act == "none":
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"unknown act {act!r} (expected one of {', '.join(ACTS)})")


def epilogue_ref(x, w, bias, c, alpha: float, beta: float, act: str) -> torch.Tensor:
    """act(alpha * x @ w^T + beta * c + bias) in fp32 (TF32 off); x [M, K], w [N, K], c [M, N] view."""
    y = fp32_matmul(x, w.t())
    if alpha != 1.0:
        y = y * alpha
    if c is not None and beta != 0.0:
        y = y + beta * c.float()
    if bias is not None:
        y = y + bias.float()
    return apply_act(y, act)
