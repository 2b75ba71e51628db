"""`gemmtune.batched_gemm_a8w8`: aiter's batched 8-bit GEMM, y[b] = (XQ[b] @ WQ[b]^T) * x_scale[b] *
w_scale[b], dispatched per (B, M, N, K, 8-bit dtype, out dtype) to the batched_a8w8 family's tuned
solution (families/quantized.py), default dequantize + torch.bmm.

XQ [B, M, K] and WQ [B, N, K] are int8 or fp8 e4m3 (one dtype); x_scale is per token ([B, M, 1] or
[B, M]), w_scale per channel ([B, 1, N] or [B, N]); the output is [B, M, N] in `dtype` (bf16 / fp16 /
fp32). Runners get the scales as fp32 [B, M, 1] and [B, 1, N]. Under torch.compile the call goes
through the custom op `torch.ops.gemmtune.batched_gemm_a8w8` (fake impl, nothing mutated).
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_dtype, check_tensor
from ..dispatch import get_dispatcher
from ..families.quantized import BatchedQuantKey
from ..quant import formats
from .hot_path import OpCache, custom_op, public_op

FAMILY = "batched_a8w8"
OP_NAME = "batched_gemm_a8w8"
OP = f"gemmtune.{OP_NAME}"
_OUT = FLOAT_DTYPES
_dispatcher = get_dispatcher()


def _q_dtypes() -> tuple:
    return tuple(d for d in (torch.int8, formats.FP8, getattr(formats, "FP8_FNUZ", None)) if d is not None)


def _d(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def validate(XQ, WQ, x_scale, w_scale, dtype) -> BatchedQuantKey:
    """The key of a call, or a ValueError / TypeError naming the argument and its value."""
    for name, t in (("XQ", XQ), ("WQ", WQ), ("x_scale", x_scale), ("w_scale", w_scale)):
        check_tensor(OP_NAME, name, t)
    check_dtype(OP_NAME, "dtype", dtype, _OUT)
    if XQ.dim() != 3 or WQ.dim() != 3:
        raise ValueError(f"{OP}: XQ and WQ must be 3-D [B, M, K] / [B, N, K] (XQ {_d(XQ)}, WQ {_d(WQ)})")
    (B, M, K), (Bw, N, Kw) = XQ.shape, WQ.shape
    if (B, K) != (Bw, Kw):
        raise ValueError(f"{OP}: XQ [B, M, K] and WQ [B, N, K] disagree on B or K (XQ {_d(XQ)}, WQ {_d(WQ)})")
    if XQ.dtype != WQ.dtype or XQ.dtype not in _q_dtypes():
        raise ValueError(f"{OP}: XQ and WQ must both be int8 or fp8 e4m3 (XQ {_d(XQ)}, WQ {_d(WQ)})")
    if x_scale.numel() != B * M or x_scale.shape[0] != B:
        raise ValueError(f"{OP}: x_scale must be per token, [B, M, 1] = [{B}, {M}, 1] (got {_d(x_scale)})")
    if w_scale.numel() != B * N or w_scale.shape[0] != B:
        raise ValueError(f"{OP}: w_scale must be per channel, [B, 1, N] = [{B}, 1, {N}] (got {_d(w_scale)})")
    devs = {t.device for t in (XQ, WQ, x_scale, w_scale)}
    if len(devs) > 1:
        raise ValueError(f"{OP}: all tensors must be on one device (got {', '.join(map(str, devs))})")
    return BatchedQuantKey(B, M, N, K, XQ.dtype, dtype)


def _signature(XQ, WQ, x_scale, w_scale, dtype) -> tuple:
    return (XQ.shape, WQ.shape, x_scale.shape, w_scale.shape, XQ.dtype, WQ.dtype, XQ.device, dtype)


def _bind(XQ, WQ, x_scale, w_scale, dtype):
    key = validate(XQ, WQ, x_scale, w_scale, dtype)
    B, M, N, K = key.B, key.M, key.N, key.K
    if 0 in (B, M, N):
        return lambda XQ, *rest: XQ.new_empty((B, M, N), dtype=dtype)
    if K == 0:
        return lambda XQ, *rest: XQ.new_zeros((B, M, N), dtype=dtype)
    inner = _dispatcher.runner_for(key, XQ.device, family=FAMILY)

    def run(XQ, WQ, x_scale, w_scale):
        xs = x_scale.reshape(B, M, 1).to(torch.float32)
        ws = w_scale.reshape(B, 1, N).to(torch.float32)
        # Kernels need unit stride along K; the copy happens only for other layouts.
        return inner(XQ if XQ.stride(-1) == 1 else XQ.contiguous(), WQ if WQ.stride(-1) == 1 else WQ.contiguous(),
                     xs, ws)  # fmt: skip

    return run


def _fake(XQ, WQ, x_scale, w_scale, dtype):
    key = validate(XQ, WQ, x_scale, w_scale, dtype)
    return XQ.new_empty((key.B, key.M, key.N), dtype=dtype)


_cache = OpCache("batched_gemm_a8w8", family=FAMILY, validate=validate, bind=_bind)
_is_compiling = torch.compiler.is_compiling


@public_op(_cache)
def batched_gemm_a8w8(XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """[B, M, N] = (XQ @ WQ^T) * x_scale * w_scale per batch, in `dtype`: the tuned solution for this
    (B, M, N, K, dtype), else dequantize + torch.bmm."""
    if _is_compiling():
        return torch.ops.gemmtune.batched_gemm_a8w8(XQ, WQ, x_scale, w_scale, dtype)
    try:
        call = _cache.get(sig := _signature(XQ, WQ, x_scale, w_scale, dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _cache.reject(XQ, WQ, x_scale, w_scale, dtype)
        raise
    if call is None:
        call = _cache.miss(sig, XQ, WQ, x_scale, w_scale, dtype)
    return call(XQ, WQ, x_scale, w_scale)


@custom_op(_cache, fake=_fake)
def _batched_gemm_a8w8_op(XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    return batched_gemm_a8w8(XQ, WQ, x_scale, w_scale, dtype)
