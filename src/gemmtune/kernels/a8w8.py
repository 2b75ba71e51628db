"""8-bit GEMM with scales in the epilogue: y[M, N] = (xq[M, K] @ wq[N, K]^T) * xs * ws (+ bias).

xq, wq are int8 (int32 accumulation, exact) or fp8 e4m3 (fp32 accumulation); xs is one fp32 scale
per row of x ([M, 1]) or one for all ([1]); ws one per output channel ([1, N]) or one for all. The
scales are applied once, after the K loop (they are constant along K), then bias and the cast.

Tiles: one kernel, a grid of (M tiles x N tiles, grouped so GROUP_M row tiles share weight tiles
in L2) x SPLIT_K. Small-M (decode) configs take 16-32 row tiles and split K so the N tiles times
the splits fill the SMs (the skinny kernels' rule); split programs write fp32 partials and a small
second kernel sums them in a fixed order (deterministic: a graph replay equals eager), then scales.
Ragged M/N tiles re-read valid rows (row % M) instead of masking, so loads stay unmasked and wide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import empty_out as _empty  # tests swap in a NaN-filled allocation
from .launch import Plans, cached_launch, tensor_signature


@triton.jit
def tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program_id(0), GROUP_M row tiles at a time (weight tiles reused from L2)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _scale_store(acc, xs_ptr, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym,
                 XS_ROWS: tl.constexpr, WS_COLS: tl.constexpr, HAS_BIAS: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] fp32 -> * xs[m] * ws[n] (+ bias[n]) -> y's dtype, stored where valid."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    if XS_ROWS:
        xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)
        acc = acc * xs[:, None]
    else:
        acc = acc * tl.load(xs_ptr)
    if WS_COLS:
        ws = tl.load(ws_ptr + offs_n, mask=n_ok, other=0.0)
        acc = acc * ws[None, :]
    else:
        acc = acc * tl.load(ws_ptr)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "iters_per_split"])
def _a8w8_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, p_ptr, M, N, K, iters_per_split,
                 stride_xm, stride_wn, stride_ym,
                 XS_ROWS: tl.constexpr, WS_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN_K: tl.constexpr, IS_INT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
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
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k0 + offs_k)[:, None]  # [BLOCK_K, BLOCK_N], K-major
    if IS_INT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k0, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        # Triton 3.6 asserts acc.dtype == out_dtype (fp32 unless given): int8 must say int32.
        acc = tl.dot(x, w, acc, out_dtype=acc.dtype)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc.to(tl.float32)
    if SPLIT:
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        tl.store(p_ptr + pid_k * M * N + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        _scale_store(acc, xs_ptr, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, XS_ROWS, WS_COLS, HAS_BIAS)


@triton.jit
def _reduce_kernel(p_ptr, xs_ptr, ws_ptr, b_ptr, y_ptr, M, N, split_k, stride_ym,
                   APPLY_SCALES: tl.constexpr, XS_ROWS: tl.constexpr, WS_COLS: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """y = sum_s partials[s] (in order), then the scales (unless already applied), bias and cast."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    p_offs = offs_m[:, None] * N + offs_n[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(0, split_k):
        acc += tl.load(p_ptr + s * M * N + p_offs, mask=mask, other=0.0)
    if APPLY_SCALES:
        _scale_store(acc, xs_ptr, ws_ptr, b_ptr, y_ptr, offs_m, offs_n, M, N, stride_ym, XS_ROWS, WS_COLS, HAS_BIAS)
    else:
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


_NAME_RE = re.compile(r"^(a8w8|blockscale)_bm(\d+)_bn(\d+)_bk(\d+)_g(\d+)_sk(\d+)_w(\d+)_s(\d+)$")


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class TileConfig:
    """One kernel configuration; `name` is its stable solution id (a8w8_bm16_bn64_bk256_g8_sk4_w4_s4)."""

    kind: str = "a8w8"  # "a8w8" (per-row scales) or "blockscale" (1x128 x 128x128 scales)
    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    group_m: int = 8
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __post_init__(self):
        if self.kind not in ("a8w8", "blockscale"):
            raise ValueError(f"tile config kind {self.kind!r} must be 'a8w8' or 'blockscale'")
        if not all(_pow2(v) for v in (self.block_m, self.block_n, self.block_k, self.num_warps)):
            raise ValueError(f"block sizes and num_warps must be powers of two: {self}")
        if min(self.block_m, self.block_n) < 16 or self.block_k < 32:
            raise ValueError(f"8-bit dot tiles need block_m, block_n >= 16 and block_k >= 32: {self}")
        if self.kind == "blockscale" and 128 % self.block_k:
            raise ValueError(f"block-scale tiles need block_k dividing 128 (one scale group per step): {self}")
        if not 1 <= self.split_k <= 64 or not 1 <= self.num_stages <= 8 or not 1 <= self.group_m <= 64:
            raise ValueError(f"split_k / num_stages / group_m out of range: {self}")

    @property
    def name(self) -> str:
        return (f"{self.kind}_bm{self.block_m}_bn{self.block_n}_bk{self.block_k}_g{self.group_m}"
                f"_sk{self.split_k}_w{self.num_warps}_s{self.num_stages}")  # fmt: skip

    @classmethod
    def parse(cls, name: str) -> TileConfig | None:
        m = _NAME_RE.match(name.strip())
        if not m:
            return None
        kind, *vals = m.groups()
        try:
            return cls(kind, *(int(v) for v in vals))
        except ValueError:
            return None

    def effective_split(self, k: int) -> tuple[int, int]:
        """(splits that get work, BLOCK_K iterations per split) for a K-long reduction."""
        iters = triton.cdiv(k, self.block_k)
        per = triton.cdiv(iters, self.split_k)
        return (triton.cdiv(iters, per) if iters else 1), max(per, 1)


_REDUCE_TILE = (32, 128)
_PLANS = Plans()  # the GEMM kernel's launches, per signature


def out_like(xq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(0, device=xq.device, dtype=dtype)


def reduce_partials(p, xs, ws, bias, y, split, apply_scales: bool) -> None:
    m, n = y.shape
    bm, bn = _REDUCE_TILE
    _reduce_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        p, xs, ws, bias if bias is not None else y, y, m, n, split, y.stride(0),
        APPLY_SCALES=apply_scales, XS_ROWS=xs.numel() > 1, WS_COLS=ws.numel() > 1, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
    )  # fmt: skip


class LaunchPlan(NamedTuple):
    m: int
    n: int
    k: int
    split: int  # splits that get work
    per: int  # BLOCK_K iterations per split
    grid: tuple[int, int]  # (M tiles x N tiles, split)
    partials: torch.Tensor  # [split, M, N] fp32 when K is split, else y (unused)


def launch_plan(cfg: TileConfig, xq: torch.Tensor, wq: torch.Tensor, y: torch.Tensor) -> LaunchPlan | None:
    """Grid, split and partials buffer of one launch of an 8-bit GEMM kernel; None when y is empty."""
    m, k = xq.shape
    n = wq.shape[0]
    if m == 0 or n == 0:
        return None
    split, per = cfg.effective_split(k)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    p = torch.empty((split, m, n), device=y.device, dtype=torch.float32) if split > 1 else y
    return LaunchPlan(m, n, k, split, per, (tiles, split), p)


def a8w8_launch(cfg: TileConfig, xq, wq, xs, ws, bias, y) -> torch.Tensor:
    """y[M, N] (preallocated, any float dtype) = (xq @ wq^T) * xs * ws (+ bias) with one config.

    xq [M, K] and wq [N, K] must have unit stride along K; xs is [M, 1] or 1 element, ws [1, N] or
    1 element, both fp32 and contiguous. No host sync, no data-dependent allocation: graph-safe.
    """
    plan = launch_plan(cfg, xq, wq, y)
    if plan is None:
        return y
    m, n, k, split, per, grid, p = plan
    signature = (cfg, *(tensor_signature(t) for t in (xq, wq, xs, ws, bias, y)))
    cached_launch(
        _PLANS, signature, _a8w8_kernel, grid,
        xq, wq, xs, ws, bias if bias is not None else y, y, p, m, n, k, per,
        xq.stride(0), wq.stride(0), y.stride(0),
        XS_ROWS=xs.numel() > 1, WS_COLS=ws.numel() > 1, HAS_BIAS=bias is not None, SPLIT=split > 1,
        EVEN_K=k % cfg.block_k == 0, IS_INT=xq.dtype == torch.int8,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1:
        reduce_partials(p, xs, ws, bias, y, split, apply_scales=True)
    return y


def gemm_a8w8_triton(xq, wq, xs, ws, bias=None, out_dtype=torch.bfloat16, cfg: TileConfig | None = None):
    """The checked entry: allocate y and run one config (the backend's runners call a8w8_launch)."""
    cfg = cfg or TileConfig()
    y = _empty((xq.shape[0], wq.shape[0]), out_like(xq, out_dtype))
    return a8w8_launch(cfg, xq, wq, xs, ws, bias, y)


def a8w8_ref(xq, wq, xs, ws, bias=None, out_dtype=torch.float32) -> torch.Tensor:
    """The plain-PyTorch reference: dequantize (q * scale in fp32), fp32 matmul, bias, cast."""
    # ws is [1, N] or one element: as a column it scales the weight's rows either way.
    y = (xq.float() * xs.float().reshape(-1, 1)) @ (wq.float() * ws.float().reshape(-1, 1)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)
