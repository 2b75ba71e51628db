"""`gemmtune.gemm`: y[..., N] = x[..., K] @ w[N, K]^T (+ bias), dispatched to the tuned solution.

Eager calls take the hot path: build a call signature from the tensors' shapes/dtypes/devices, one
dict lookup, one call. A signature found in the cache was validated when first seen. Under
torch.compile the call goes through the custom op `torch.ops.gemmtune.gemm` (fake impl for tracing,
no mutated args), so the compiled graph has no break; inside the op the same dispatch runs.
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_dtype, check_tensor
from ..dispatch import A16W16, get_dispatcher
from ..keys import GemmKey
from .autograd import linear_backward, with_autograd
from .hot_path import OpCache, custom_op, public_op

# The dtypes every backend computes, in and out (float64, fp8 and integer GEMMs are not gemm's job).
DTYPES = FLOAT_DTYPES
_dispatcher = get_dispatcher()
_grad_enabled = torch.is_grad_enabled


def _shape_error(msg: str, x, w, bias) -> ValueError:
    b = "None" if bias is None else f"{tuple(bias.shape)} {bias.dtype} on {bias.device}"
    return ValueError(
        f"gemmtune.gemm: {msg} (x {tuple(x.shape)} {x.dtype} on {x.device}, "
        f"w {tuple(w.shape)} {w.dtype} on {w.device}, bias {b})"
    )


def validate(x, w, bias, out_dtype) -> None:
    """Raise ValueError naming the shapes for anything gemm cannot compute."""
    check_tensor("gemm", "x", x)
    check_tensor("gemm", "w", w)
    check_tensor("gemm", "bias", bias, optional=True)
    check_dtype("gemm", "out_dtype", out_dtype, optional=True)  # which ones: below, with the shapes
    if w.dim() != 2:
        raise _shape_error(f"w must be 2-D [N, K] (nn.Linear layout), got {w.dim()}-D", x, w, bias)
    if x.dim() < 1:
        raise _shape_error("x must have at least 1 dimension [..., K]", x, w, bias)
    if x.shape[-1] != w.shape[1]:
        raise _shape_error(f"x[..., K={x.shape[-1]}] does not match w[N, K={w.shape[1]}]", x, w, bias)
    if x.dtype != w.dtype:
        raise _shape_error(f"dtype mismatch: x is {x.dtype}, w is {w.dtype}", x, w, bias)
    if x.dtype not in DTYPES:
        raise _shape_error(f"unsupported dtype {x.dtype} (gemm takes float16/bfloat16/float32)", x, w, bias)
    if x.device != w.device:
        raise _shape_error(f"device mismatch: x on {x.device}, w on {w.device}", x, w, bias)
    if out_dtype is not None and out_dtype not in DTYPES:
        raise _shape_error(f"unsupported out_dtype {out_dtype} (float16/bfloat16/float32)", x, w, bias)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != w.shape[0]:
            raise _shape_error(f"bias must be 1-D of length N={w.shape[0]}", x, w, bias)
        if bias.device != x.device:
            raise _shape_error(f"device mismatch: bias on {bias.device}, x on {x.device}", x, w, bias)
        if bias.dtype not in (x.dtype, out_dtype or x.dtype):
            raise _shape_error(f"bias dtype {bias.dtype} must be x's ({x.dtype}) or the out dtype", x, w, bias)


def key_of(x, w, bias, out_dtype) -> GemmKey:
    K = w.shape[1]
    M = x.numel() // K if K else (x.numel() and 1)
    return GemmKey(M, w.shape[0], K, bias is not None, x.dtype, out_dtype or x.dtype)


def _signature(x, w, bias, out_dtype) -> tuple:
    # Everything validate() checks, and whether the call needs gradients (then the runner has autograd).
    return (
        x.shape, w.shape, x.dtype, w.dtype, x.device, w.device,
        None if bias is None else (bias.shape, bias.dtype, bias.device), out_dtype,
        _grad_enabled() and (w.requires_grad or x.requires_grad or (bias is not None and bias.requires_grad)),
    )  # fmt: skip


def _bind(x, w, bias, out_dtype):
    wants_grad = _signature(x, w, bias, out_dtype)[-1]
    run = _dispatcher.runner_for(
        key_of(x, w, bias, out_dtype), x.device, autograd=with_autograd if wants_grad else None
    )
    if bias is None or bias.dtype == x.dtype:
        return run
    # A bias in the out dtype is read in x's, as the runners (F.linear) take it: the sum is x's dtype's.
    return lambda x, w, bias: run(x, w, bias.to(x.dtype))


def _fake(x, w, bias, out_dtype):
    validate(x, w, bias, out_dtype)
    return x.new_empty((*x.shape[:-1], w.shape[0]), dtype=out_dtype or x.dtype)


def _setup_context(ctx, inputs, output):
    x, w, bias, _ = inputs
    ctx.save_for_backward(x, w)
    ctx.has_bias = bias is not None


def _backward(ctx, grad):
    x, w = ctx.saved_tensors
    gx, gw, gb = linear_backward(grad, x, w, ctx.has_bias)
    return gx, gw, gb, None


_cache = OpCache("gemm", family=A16W16, validate=validate, bind=_bind)
_is_compiling = torch.compiler.is_compiling


@public_op(_cache)
def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """y[..., N] = x[..., K] @ w[N, K]^T (+ bias), in `out_dtype` (default x's dtype).

    Runs the solution the config table recorded for this (M, N, K, dtype, bias), else the vendor
    default. Same result as F.linear within the dtype's tolerance.
    """
    if _is_compiling():
        return torch.ops.gemmtune.gemm(x, w, bias, out_dtype)
    try:
        call = _cache.get(sig := _signature(x, w, bias, out_dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _cache.reject(x, w, bias, out_dtype)
        raise
    if call is None:
        call = _cache.miss(sig, x, w, bias, out_dtype)
    return call(x, w, bias)


@custom_op(_cache, fake=_fake, autograd=(_backward, _setup_context))
def _gemm_op(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    return gemm(x, w, bias, out_dtype)
