"""Small-M ("skinny", decode-time) fp8 block-scale GEMMs: y[M, N] = sum over 128-wide K groups g of
(xq[:, g] @ wq[:, g]^T) * x_scale[m, g] * w_scale[n // 128, g].

The kernel is kernels/skinny.py's (split-K with the in-kernel FIXUP reduction, PDL prologue,
evict-first weight stream) with BLOCK_SCALES: every BLOCK_K step scales its partial product by its
group's scales before the fp32 accumulation, so split-K partials are already scaled and the fixed-
order reduction only sums them. Configs need block_k dividing 128 (a step inside one group) and
block_n <= 128 (a tile inside one N block). The scale grids may have any strides: M-major x_scale
and row-padded w_scale (quant/layouts.py) included. This module holds the operand checks, the
checked entry and the plain-PyTorch reference; the launch is kernels.skinny.launch.
"""

from __future__ import annotations

import torch

from ..quant.formats import BLOCK, FP8_DTYPES, SCALE_DTYPE
from ..quant.quantize import dequantize_1x128, dequantize_128x128
from . import skinny as ks
from .gemm_ref import gemm_ref
from .skinny_a8w8 import DOT_MIN_BLOCK_K


def config_ok(cfg: ks.SkinnyConfig) -> bool:
    """Can `cfg` run block scales (one K group per step, one N block per tile, an 8-bit dot step)?"""
    return (cfg.block_n <= BLOCK and BLOCK % cfg.block_k == 0 and cfg.reduce != ks.REDUCE_ATOMIC
            and not (cfg.uses_dot and cfg.block_k < DOT_MIN_BLOCK_K))  # fmt: skip


def check_operands(xq, wq, xs, ws, cfg: ks.SkinnyConfig | None = None) -> None:
    """ValueError naming the shapes/dtypes when (xq, wq, xs, ws) is not a skinny block-scale GEMM."""
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"skinny blockscale: xq {tuple(xq.shape)} and wq {tuple(wq.shape)} need xq[M, K], wq[N, K]")
    if xq.dtype != wq.dtype or xq.dtype not in FP8_DTYPES:
        raise ValueError(f"skinny blockscale: xq {xq.dtype} and wq {wq.dtype} must both be one fp8 dtype")
    (m, k), n = xq.shape, wq.shape[0]
    if k % BLOCK:
        raise ValueError(f"skinny blockscale: K={k} is not a multiple of {BLOCK}")
    for name, s, shape in (("x_scale", xs, (m, k // BLOCK)), ("w_scale", ws, (-(-n // BLOCK), k // BLOCK))):
        if s.dtype != SCALE_DTYPE or tuple(s.shape) != shape:
            raise ValueError(f"skinny blockscale: {name} {tuple(s.shape)} {s.dtype} must be float32 {list(shape)}")
    if wq.stride(1) != 1:
        raise ValueError(f"skinny blockscale: wq strides {wq.stride()} need unit stride along K")
    if n * k >= 2**31:
        raise ValueError(f"skinny blockscale: wq {tuple(wq.shape)} too large for 32-bit offsets")
    if cfg is not None and not config_ok(cfg):
        raise ValueError(f"skinny blockscale: {cfg.name} needs block_n <= {BLOCK}, block_k dividing {BLOCK} "
                         f"(>= {DOT_MIN_BLOCK_K} for a dot) and a deterministic reduction")  # fmt: skip


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """Output allocation like `like` (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


def skinny_blockscale(xq, wq, xs, ws, out_dtype=torch.bfloat16, cfg: ks.SkinnyConfig | None = None):
    """The checked entry: y[M, N] in out_dtype with one skinny config (runners call ks.launch)."""
    cfg = cfg or ks.SkinnyConfig(block_k=128)
    check_operands(xq, wq, xs, ws, cfg)
    m, n = xq.shape[0], wq.shape[0]
    y = _empty((m, n), torch.empty(0, device=xq.device, dtype=out_dtype))
    counters = ks.new_counters(cfg, n, m, xq.device)
    return ks.launch(cfg, xq, wq, None, y, counters, scales=(xs, ws), block_scales=True)


def skinny_blockscale_ref(xq, wq, xs, ws, out_dtype=torch.float32) -> torch.Tensor:
    """The plain-PyTorch reference: dequantize both operands per group / block in fp32, fp32 matmul, cast."""
    return gemm_ref(dequantize_1x128(xq, xs), dequantize_128x128(wq, ws), None, out_dtype)
