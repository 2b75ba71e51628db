"""Dynamic activation quantization kernels: per-token (one scale per row) and 1x128 groups.

One pass over x instead of torch's four (abs, amax, divide, cast): at decode the 8-bit GEMM after
it takes a few microseconds, so a chain of small torch kernels before it would eat the gain. The
math is the plain-PyTorch quantizers' (quant/quantize.py): scale = max(amax, 1e-12) / qmax,
q = clamp(x / scale) cast to the format (int8: rounded half away from zero; torch rounds half to
even, so an exact tie may differ by one step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..quant.formats import SCALE_DTYPE, is_fp8, qmax
from ..quant.quantize import quantize_1x128, quantize_per_token


@triton.jit
def _to_q(y, QMAX: tl.constexpr, IS_INT: tl.constexpr, q_ty: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_INT:
        y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
    return y.to(q_ty)


@triton.jit(do_not_specialize=["K"])
def _per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK):
        x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
        q = _to_q(x / scale, QMAX, IS_INT, q_ptr.dtype.element_ty)
        tl.store(q_ptr + row * K + k + offs, q, mask=k + offs < K)


@triton.jit
def _group_kernel(x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                  GROUP: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    ok = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / QMAX
    tl.store(s_ptr + row * n_groups + g, scale)
    tl.store(q_ptr + row * K + offs, _to_q(x / scale, QMAX, IS_INT, q_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K], scale [..., 1] fp32): quantize_per_token in one kernel (CUDA; CPU: the reference)."""
    if x.device.type != "cuda":
        return quantize_per_token(x, dtype)
    x2 = _rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), device=x.device, dtype=dtype)
    s = torch.empty((m, 1), device=x.device, dtype=SCALE_DTYPE)
    if m:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _per_token_kernel[(m,)](x2, q, s, k, x2.stride(0), QMAX=qmax(dtype), IS_INT=not is_fp8(dtype),
                                BLOCK=block, num_warps=4 if block <= 2048 else 8)  # fmt: skip
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def quantize_1x128_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K], scale [..., ceil(K/128)] fp32): quantize_1x128 in one kernel (CUDA; CPU: the reference)."""
    if x.device.type != "cuda":
        return quantize_1x128(x, dtype)
    x2 = _rows(x)
    m, k = x2.shape
    groups = triton.cdiv(k, 128)
    q = torch.empty((m, k), device=x.device, dtype=dtype)
    s = torch.empty((m, groups), device=x.device, dtype=SCALE_DTYPE)
    if m:
        _group_kernel[(m, groups)](x2, q, s, k, groups, x2.stride(0), QMAX=qmax(dtype), IS_INT=not is_fp8(dtype),
                                   GROUP=128, num_warps=1)  # fmt: skip
    return q.view(x.shape), s.view(*x.shape[:-1], groups)


quantize_per_token_ref = quantize_per_token
quantize_1x128_ref = quantize_1x128
