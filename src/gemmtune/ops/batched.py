"""`gemmtune.batched_gemm`: y[b] = op(a[b]) @ op(b[b]), dispatched per (B, M, N, K, dtypes, layout) to
the tuned solution of the batched family (families/batched.py), default torch.bmm.

a is (B, M, K), or (B, K, M) with transpose_a; b is (B, K, N), or (B, N, K) with transpose_b (the
weight stored in nn.Linear layout per batch, as aiter's batched kernels read it). Runners get the
logical (B, M, K) and (B, K, N) views, whatever their strides. Under torch.compile the call goes
through the custom op `torch.ops.gemmtune.batched_gemm` (fake impl, nothing mutated).
"""

from __future__ import annotations

import torch

from ..checks import FLOAT_DTYPES, check_bool, check_dtype, check_tensor
from ..dispatch import get_dispatcher
from ..families.batched import BatchedKey
from .hot_path import OpCache, custom_op, public_op

FAMILY = "batched"
_FLOATS = FLOAT_DTYPES
_dispatcher = get_dispatcher()


def _error(msg: str, a, b) -> ValueError:
    def d(t):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__

    return ValueError(f"gemmtune.batched_gemm: {msg} (a {d(a)}, b {d(b)})")


def validate(a, b, transpose_a: bool, transpose_b: bool, out_dtype) -> None:
    """Raise naming the shapes for anything batched_gemm cannot compute."""
    op = "batched_gemm"
    check_tensor(op, "a", a)
    check_tensor(op, "b", b)
    check_bool(op, "transpose_a", transpose_a)
    check_bool(op, "transpose_b", transpose_b)
    check_dtype(op, "out_dtype", out_dtype, optional=True)  # which ones: below, with the shapes
    if a.dim() != 3 or b.dim() != 3:
        raise _error("a and b must be 3-D (batch, rows, cols)", a, b)
    if a.shape[0] != b.shape[0]:
        raise _error(f"batch sizes differ: {a.shape[0]} vs {b.shape[0]}", a, b)
    ka = a.shape[1] if transpose_a else a.shape[2]
    kb = b.shape[2] if transpose_b else b.shape[1]
    if ka != kb:
        raise _error(f"inner dimensions differ: K={ka} (a) vs K={kb} (b)", a, b)
    if a.dtype != b.dtype:
        raise _error(f"dtype mismatch: a is {a.dtype}, b is {b.dtype}", a, b)
    if a.dtype not in _FLOATS:
        raise _error(f"unsupported dtype {a.dtype} (batched_gemm takes float16/bfloat16/float32)", a, b)
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise _error(f"unsupported out_dtype {out_dtype} (float16/bfloat16/float32)", a, b)
    if a.device != b.device:
        raise _error(f"device mismatch: a on {a.device}, b on {b.device}", a, b)


def key_of(a, b, transpose_a: bool, transpose_b: bool, out_dtype) -> BatchedKey:
    B = a.shape[0]
    M, K = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
    N = b.shape[1] if transpose_b else b.shape[2]
    return BatchedKey(B, M, N, K, a.dtype, out_dtype or a.dtype, bool(transpose_a), bool(transpose_b))


def _signature(a, b, transpose_a, transpose_b, out_dtype) -> tuple:
    # The flags' classes too: 1 equals True in a dict key, and validate refuses it.
    return (a.shape, b.shape, a.dtype, b.dtype, a.device, b.device, transpose_a, transpose_a.__class__, transpose_b,
            transpose_b.__class__, out_dtype)  # fmt: skip


def _bind(a, b, transpose_a, transpose_b, out_dtype):
    key = key_of(a, b, transpose_a, transpose_b, out_dtype)
    if 0 in (key.B, key.M, key.N):
        return lambda a, b: a.new_empty((key.B, key.M, key.N), dtype=key.outdtype)
    if key.K == 0:
        return lambda a, b: a.new_zeros((key.B, key.M, key.N), dtype=key.outdtype)
    run = _dispatcher.runner_for(key, a.device, family=FAMILY)
    if not (transpose_a or transpose_b):
        return run

    def call(a, b):  # runners take the logical (B, M, K) and (B, K, N) views
        return run(a.transpose(-1, -2) if transpose_a else a, b.transpose(-1, -2) if transpose_b else b)

    return call


def _fake(a, b, transpose_a, transpose_b, out_dtype):
    validate(a, b, transpose_a, transpose_b, out_dtype)
    key = key_of(a, b, transpose_a, transpose_b, out_dtype)
    return a.new_empty((key.B, key.M, key.N), dtype=key.outdtype)


def _setup_context(ctx, inputs, output):
    a, b, ta, tb, _ = inputs
    ctx.save_for_backward(a, b)
    ctx.trans = (ta, tb)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    ta, tb = ctx.trans
    la = a.transpose(-1, -2) if ta else a
    lb = b.transpose(-1, -2) if tb else b
    g = grad.to(a.dtype)
    ga = g @ lb.transpose(-1, -2)  # (B, M, K)
    gb = la.transpose(-1, -2) @ g  # (B, K, N)
    return (ga.transpose(-1, -2) if ta else ga), (gb.transpose(-1, -2) if tb else gb), None, None, None


_cache = OpCache("batched_gemm", family=FAMILY, validate=validate, bind=_bind)
_is_compiling = torch.compiler.is_compiling


@public_op(_cache)
def batched_gemm(a: torch.Tensor, b: torch.Tensor, transpose_a: bool = False, transpose_b: bool = False,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """(B, M, N) = op(a) @ op(b) per batch, in `out_dtype` (default a's dtype); the tuned solution for
    this (B, M, N, K, dtype, layout), else torch.bmm. Same result as torch.bmm within the dtype's tolerance."""
    if _is_compiling():
        return torch.ops.gemmtune.batched_gemm(a, b, transpose_a, transpose_b, out_dtype)
    try:
        call = _cache.get(sig := _signature(a, b, transpose_a, transpose_b, out_dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _cache.reject(a, b, transpose_a, transpose_b, out_dtype)
        raise
    if call is None:
        call = _cache.miss(sig, a, b, transpose_a, transpose_b, out_dtype)
    return call(a, b)


@custom_op(_cache, fake=_fake, autograd=(_backward, _setup_context))
def _batched_gemm_op(a: torch.Tensor, b: torch.Tensor, transpose_a: bool, transpose_b: bool,
                     out_dtype: torch.dtype | None) -> torch.Tensor:  # fmt: skip
    return batched_gemm(a, b, transpose_a, transpose_b, out_dtype)
