"""Batched 8-bit GEMM with per-token x per-channel scales (aiter's batched_gemm_a8w8):
y[b] = (xq[b] @ wq[b]^T) * xs[b] * ws[b], xq [B, M, K], wq [B, N, K] int8 (int32 accumulation, exact) or
fp8 e4m3 (fp32 accumulation), xs [B, M, 1] and ws [B, 1, N] fp32, y [B, M, N] in the out dtype.

One program per (M tile x N tile, batch); the scales are applied once after the K loop (they are
constant along K), then the cast. `batched_a8w8_ref` is the plain-PyTorch reference beside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


def batched_a8w8_ref(xq, wq, xs, ws, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Dequantize in fp32 and multiply in fp32: the exact result, rounded once to `out_dtype`."""
    x = xq.to(torch.float32) * xs.reshape(xq.shape[0], -1, 1)
    w = wq.to(torch.float32) * ws.reshape(wq.shape[0], -1, 1)
    return torch.bmm(x, w.transpose(1, 2)).to(out_dtype)


@triton.jit(do_not_specialize=["M"])
def _batched_a8w8_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K,
                         stride_xb, stride_xm, stride_wb, stride_wn, stride_yb, stride_ym,
                         EVEN_K: tl.constexpr, IS_INT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    b = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_m % M  # ragged tiles re-read valid rows instead of masking the loads
    cols = offs_n % N
    x_ptrs = x_ptr + b.to(tl.int64) * stride_xb + rows[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + b.to(tl.int64) * stride_wb + cols[None, :] * stride_wn + offs_k[:, None]
    if IS_INT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_ok = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(x, w, acc, out_dtype=acc.dtype)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    m_ok = offs_m < M
    n_ok = offs_n < N
    xs = tl.load(xs_ptr + b * M + offs_m, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + b * N + offs_n, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    y_ptrs = y_ptr + b.to(tl.int64) * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_NAME_RE = re.compile(r"^ba8w8_bm(\d+)_bn(\d+)_bk(\d+)_w(\d+)_s(\d+)$")


@dataclass(frozen=True)
class BatchedA8W8Config:
    """One kernel configuration; `name` is its stable solution id (ba8w8_bm16_bn64_bk128_w4_s3)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        return (f"ba8w8_bm{self.block_m}_bn{self.block_n}_bk{self.block_k}_w{self.num_warps}"
                f"_s{self.num_stages}")  # fmt: skip


def parse_config(name: str) -> BatchedA8W8Config | None:
    """The config a kernel name spells, or None when it is not one of ours (or not canonical)."""
    m = _NAME_RE.match(name.strip())
    if not m:
        return None
    cfg = BatchedA8W8Config(*(int(v) for v in m.groups()))
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (cfg.block_m, cfg.block_n, cfg.block_k))
    return cfg if pow2 and cfg.block_m >= 16 and cfg.block_k >= 32 and cfg.name == name.strip() else None


def batched_a8w8(xq, wq, xs, ws, out_dtype: torch.dtype, cfg: BatchedA8W8Config, out=None) -> torch.Tensor:
    """y [B, M, N] = (xq @ wq^T) * xs * ws with `cfg` (into `out` when given, rows of unit stride); xq / wq
    need unit stride along K, xs / ws are fp32 with B*M / B*N contiguous values."""
    B, M, K = xq.shape
    N = wq.shape[1]
    y = torch.empty((B, M, N), dtype=out_dtype, device=xq.device) if out is None else out
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n), B)
    _batched_a8w8_kernel[grid](
        xq, wq, xs, ws, y, M, N, K, xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), y.stride(0), y.stride(1),
        EVEN_K=K % cfg.block_k == 0, IS_INT=xq.dtype == torch.int8, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return y
