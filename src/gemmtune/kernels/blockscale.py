"""fp8 (or int8) block-scale GEMM, DeepSeek-V3's layout: y[M, N] = sum over 128-wide K groups g of
(xq[:, g] @ wq[:, g]^T) * xs[m, g] * ws[n // 128, g].

xs is [M, K/128] (one scale per 1x128 activation group), ws [ceil(N/128), K/128] (one per 128x128
weight block); K must be a multiple of 128 (a group never straddles a K tile), N need not be. Each
K step of BLOCK_K (dividing 128) stays inside one group: its partial product is scaled by that
group's scales and added to the fp32 accumulator (scales vary along K, so unlike the per-row a8w8
kernel they cannot wait for the epilogue); a tile no wider than 128 columns has one weight scale
per group, folded into its row scales. Split-K partials are already scaled; the shared reduce
kernel of kernels/a8w8.py sums them in a fixed order and casts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import empty_out as _empty  # tests swap in a NaN-filled allocation
from .a8w8 import TileConfig, launch_plan, out_like, reduce_partials, tile_ids

GROUP = 128


@triton.jit(do_not_specialize=["M", "iters_per_split"])
def _blockscale_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, p_ptr, M, N, K, iters_per_split,
                       stride_xm, stride_wn, stride_ym, stride_xsm, stride_xsk, stride_wsn, stride_wsk,
                       SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k0 = pid_k * iters_per_split * BLOCK_K
    k_end = tl.minimum(k0 + iters_per_split * BLOCK_K, K)
    rows = offs_m % M
    cols = offs_n % N
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k0 + offs_k)[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + offs_k)[:, None]
    xs_ptrs = xs_ptr + rows * stride_xsm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_N <= 128:
        # The tile lies in one 128-wide N block (BLOCK_N divides 128): its weight scale per K group is
        # one number, folded into the row scales, so the tile takes one multiply-add per step.
        ws_ptrs = ws_ptr + (pid_n * BLOCK_N // 128) * stride_wsn
        for k in range(k0, k_end, BLOCK_K):  # K % 128 == 0 and BLOCK_K | 128: never a ragged step
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
            g = k // 128
            s = tl.load(xs_ptrs + g * stride_xsk) * tl.load(ws_ptrs + g * stride_wsk)
            acc += tl.dot(x, w).to(tl.float32) * s[:, None]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    else:
        ws_ptrs = ws_ptr + (cols // 128) * stride_wsn
        for k in range(k0, k_end, BLOCK_K):
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
            g = k // 128
            xs = tl.load(xs_ptrs + g * stride_xsk)
            ws = tl.load(ws_ptrs + g * stride_wsk)
            acc += tl.dot(x, w).to(tl.float32) * xs[:, None] * ws[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        tl.store(p_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def blockscale_launch(cfg: TileConfig, xq, wq, xs, ws, y) -> torch.Tensor:
    """y[M, N] (preallocated) = block-scaled xq @ wq^T with one config; K % 128 == 0 (the op checks).

    xq [M, K], wq [N, K] with unit stride along K; xs [M, K/128] and ws [ceil(N/128), K/128] fp32,
    any strides (the M-major / row-padded layouts of quant/layouts.py included). Graph-safe: no host
    sync, no data-dependent allocation.
    """
    plan = launch_plan(cfg, xq, wq, y)
    if plan is None:
        return y
    m, n, k, split, per, grid, p = plan
    _blockscale_kernel[grid](
        xq, wq, xs, ws, y, p, m, n, k, per,
        xq.stride(0), wq.stride(0), y.stride(0), xs.stride(0), xs.stride(1), ws.stride(0), ws.stride(1),
        SPLIT=split > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_partials(p, xs, ws, None, y, split, apply_scales=False)
    return y


def gemm_blockscale_triton(xq, wq, xs, ws, out_dtype=torch.bfloat16, cfg: TileConfig | None = None):
    cfg = cfg or TileConfig("blockscale")
    y = _empty((xq.shape[0], wq.shape[0]), out_like(xq, out_dtype))
    return blockscale_launch(cfg, xq, wq, xs, ws, y)


def blockscale_ref(xq, wq, xs, ws, out_dtype=torch.float32) -> torch.Tensor:
    """The plain-PyTorch reference: dequantize both operands per block in fp32, fp32 matmul, cast."""
    n, k = wq.shape
    xd = xq.float() * xs.float().repeat_interleave(GROUP, dim=1)[:, :k]
    wd = wq.float() * ws.float().repeat_interleave(GROUP, 0)[:n].repeat_interleave(GROUP, 1)[:, :k]
    return (xd @ wd.t()).to(out_dtype)
