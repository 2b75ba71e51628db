"""Small-M ("skinny", decode-time) 8-bit GEMMs: y[M, N] = (xq[M, K] @ wq[N, K]^T) * xs * ws (+ bias).

The kernel is kernels/skinny.py's (split-K with the in-kernel FIXUP reduction, PDL prologue,
evict-first weight stream), run on 8-bit operands: xq and wq both fp8 e4m3 or both int8. The `dot`
kind accumulates on tensor cores (int8: int32, exact; fp8: fp32), the `gemv` kind upcasts to fp32
and multiplies. Split-K partials are the unscaled fp32 products; the scales (x per row [M, 1] or one
[1]; w per column [1, N] or one [1]) are applied once, to the summed tile in the epilogue, then the
bias, then the cast to y's dtype. This module holds the operand checks, the checked entry and the
plain-PyTorch reference; the launch is kernels.skinny.launch with `scales`.
"""

from __future__ import annotations

import torch

from ..quant.formats import QUANT_DTYPES, SCALE_DTYPE
from ..quant.quantize import dequantize
from . import skinny as ks
from .gemm_ref import gemm_ref

DOT_MIN_BLOCK_K = 32  # an 8-bit MMA step is 32 deep


def check_operands(xq, wq, xs, ws, bias, cfg: ks.SkinnyConfig | None = None, who: str = "skinny a8w8") -> None:
    """ValueError naming the shapes/dtypes when (xq, wq, xs, ws, bias) is not an 8-bit GEMM (`who` runs it)."""
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"{who}: xq {tuple(xq.shape)} and wq {tuple(wq.shape)} need xq[M, K], wq[N, K]")
    if xq.dtype != wq.dtype or xq.dtype not in QUANT_DTYPES:
        raise ValueError(f"{who}: xq {xq.dtype} and wq {wq.dtype} must be one 8-bit dtype (fp8 e4m3 or int8)")
    m, n = xq.shape[0], wq.shape[0]
    for name, s, rows in (("x_scale", xs, m), ("w_scale", ws, n)):
        if s.dtype != SCALE_DTYPE or not s.is_contiguous() or s.numel() not in (1, rows):
            raise ValueError(f"{who}: {name} {tuple(s.shape)} {s.dtype} must be contiguous float32 with "
                             f"1 or {rows} elements")  # fmt: skip
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"{who}: bias {tuple(bias.shape)} must be [N={n}]")
    if wq.stride(1) != 1:
        raise ValueError(f"{who}: wq strides {wq.stride()} need unit stride along K")
    if n * xq.shape[1] >= 2**31:
        raise ValueError(f"{who}: wq {tuple(wq.shape)} too large for 32-bit offsets")
    if cfg is not None and cfg.uses_dot and cfg.block_k < DOT_MIN_BLOCK_K:
        raise ValueError(f"{who}: {cfg.name} needs block_k >= {DOT_MIN_BLOCK_K} for an 8-bit dot")


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """Output allocation like `like` (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


def skinny_a8w8(xq, wq, xs, ws, bias=None, out_dtype=torch.bfloat16, cfg: ks.SkinnyConfig | None = None):
    """The checked entry: y[M, N] in out_dtype with one skinny config (runners call ks.launch)."""
    cfg = cfg or ks.SkinnyConfig()
    check_operands(xq, wq, xs, ws, bias, cfg)
    m, n = xq.shape[0], wq.shape[0]
    y = _empty((m, n), torch.empty(0, device=xq.device, dtype=out_dtype))
    return ks.launch(cfg, xq, wq, bias, y, ks.new_counters(cfg, n, m, xq.device), scales=(xs, ws))


def skinny_a8w8_ref(xq, wq, xs, ws, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """The plain-PyTorch reference: dequantize both operands in fp32 (ws as a column scales wq's rows,
    whether [1, N] or one element), fp32 matmul, bias, one cast."""
    return gemm_ref(dequantize(xq, xs.reshape(-1, 1)), dequantize(wq, ws.reshape(-1, 1)), bias, out_dtype)
