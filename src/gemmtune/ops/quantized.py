"""The 8-bit GEMM ops, aiter's names and argument order, dispatched per key to their family's tuned
solution (families/quantized.py), default the family's torch backend.

- gemm_a8w8(XQ, WQ, x_scale, w_scale, bias=None, dtype=bf16): int8 or fp8 e4m3; scales fp32, either
  per-tensor (1 element each) or per-token [..., 1] x per-channel [1, N] (a 1-element scale beside a
  per-row one is broadcast to it); bias [N] in `dtype`.
- gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype=bf16): x_scale [..., K/128] per 1x128 group,
  w_scale [ceil(N/128), K/128] per 128x128 block; K % 128 == 0.
- gemm_a8w8_bpreshuffle / gemm_a8w8_blockscale_bpreshuffle: the same with WQ from quant.shuffle_weight.
- int8_gemm(input, weight, input_scale, weight_scale, output_dtype=fp16): gemm_a8w8 for int8 only.

XQ is [..., K], WQ [N, K]; the result is [..., N]. Hot path: one signature tuple, one dict lookup,
one call (a cached closure that makes the canonical 2-D views when the caller's shapes are not
already those). Validation runs on a miss only, with ValueErrors naming shapes, dtypes and devices.
No host sync and no data-dependent allocation: CUDA-graph safe. Under torch.compile the calls go
through the custom ops torch.ops.gemmtune.gemm_a8w8* (fake impls give the output's shape).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..checks import FLOAT_DTYPES, check_dtype, check_tensor
from ..dispatch import get_dispatcher
from ..families.quantized import BlockKey, QuantKey
from ..quant.formats import BLOCK, QUANT_DTYPES, SCALE_DTYPE
from ..quant.shuffle import is_shuffled
from .hot_path import OpCache, custom_op, public_op, spelling_of

_OUT = FLOAT_DTYPES
_dispatcher = get_dispatcher()
_is_compiling = torch.compiler.is_compiling


def _d(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def _error(op: str, msg: str, **tensors) -> ValueError:
    parts = ", ".join(f"{n} {_d(t)}" for n, t in tensors.items() if t is not None)
    return ValueError(f"gemmtune.{op}: {msg} ({parts})")


def _check_common(op, XQ, WQ, x_scale, w_scale, bias, dtype) -> tuple[int, int, int]:
    """(M, N, K) after the checks every 8-bit op shares; raises naming the offending argument."""
    named = dict(XQ=XQ, WQ=WQ, x_scale=x_scale, w_scale=w_scale, bias=bias)
    for n, t in named.items():
        check_tensor(op, n, t, optional=n == "bias")
    check_dtype(op, "dtype", dtype)  # which ones: below, with the shapes
    if XQ.dim() < 1 or WQ.dim() != 2:
        raise _error(op, "XQ must be [..., K] and WQ [N, K]", **named)
    k = XQ.shape[-1]
    if WQ.shape[1] != k:
        raise _error(op, f"inner dimensions differ: K={k} (XQ) vs K={WQ.shape[1]} (WQ)", **named)
    if XQ.dtype not in QUANT_DTYPES or WQ.dtype != XQ.dtype:
        names = "/".join(str(d).removeprefix("torch.") for d in QUANT_DTYPES)
        raise _error(op, f"XQ and WQ must share one 8-bit dtype ({names}), got {XQ.dtype} and {WQ.dtype}", **named)
    for n in ("x_scale", "w_scale"):
        if named[n].dtype != SCALE_DTYPE:
            raise _error(op, f"{n} must be float32, got {named[n].dtype}", **named)
    if dtype not in _OUT:
        raise _error(op, f"unsupported output dtype {dtype} (float16/bfloat16/float32)", **named)
    devs = {n: t.device for n, t in named.items() if t is not None}
    if len(set(devs.values())) > 1:
        raise _error(op, "tensors are on different devices: " + ", ".join(f"{n} {d}" for n, d in devs.items()))
    m = XQ.shape[:-1].numel()
    return m, WQ.shape[0], k


def _scale_kind(op, XQ, WQ, x_scale, w_scale, m, n) -> str:
    lead = tuple(XQ.shape[:-1])
    x_rows = x_scale.numel() == m and tuple(x_scale.shape) in ((*lead, 1), lead, (m, 1), (m,))
    w_cols = w_scale.numel() == n and tuple(w_scale.shape) in ((1, n), (n,), (n, 1))
    if x_scale.numel() != 1 and not x_rows:
        raise _error(op, f"x_scale must have 1 element (per-tensor) or be [M={m}, 1] (per-token)",
                     XQ=XQ, x_scale=x_scale)  # fmt: skip
    if w_scale.numel() != 1 and not w_cols:
        raise _error(op, f"w_scale must have 1 element (per-tensor) or be [1, N={n}] (per-channel)",
                     WQ=WQ, w_scale=w_scale)  # fmt: skip
    return "per_tensor" if x_scale.numel() == 1 and w_scale.numel() == 1 else "per_token"


def validate_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype, op="gemm_a8w8") -> QuantKey:
    """The key of a valid gemm_a8w8 call; ValueError/TypeError naming the problem otherwise."""
    m, n, k = _check_common(op, XQ, WQ, x_scale, w_scale, bias, dtype)
    kind = _scale_kind(op, XQ, WQ, x_scale, w_scale, m, n)
    if bias is not None:
        if tuple(bias.shape) not in ((n,), (1, n)):
            raise _error(op, f"bias must be [N={n}]", WQ=WQ, bias=bias)
        if bias.dtype != dtype:
            raise _error(op, f"bias dtype {bias.dtype} must be the output dtype {dtype}", bias=bias)
    return QuantKey(m, n, k, WQ.dtype, kind, bias is not None, dtype)


def validate_blockscale(XQ, WQ, x_scale, w_scale, dtype, op="gemm_a8w8_blockscale") -> BlockKey:
    m, n, k = _check_common(op, XQ, WQ, x_scale, w_scale, None, dtype)
    if k % BLOCK:
        raise _error(op, f"K={k} is not a multiple of {BLOCK}: block scales cover 1x{BLOCK} / {BLOCK}x{BLOCK} "
                     "groups, so K must be a multiple of 128 (pad K, or use gemm_a8w8)", XQ=XQ, WQ=WQ)  # fmt: skip
    kb, nb = k // BLOCK, -(-n // BLOCK)
    if tuple(x_scale.shape) not in ((*XQ.shape[:-1], kb), (m, kb)):
        raise _error(op, f"x_scale must be [M={m}, K/128={kb}] (one scale per 1x128 group)", XQ=XQ, x_scale=x_scale)
    if tuple(w_scale.shape) != (nb, kb):
        raise _error(op, f"w_scale must be [ceil(N/128)={nb}, K/128={kb}] (one scale per 128x128 block)",
                     WQ=WQ, w_scale=w_scale)  # fmt: skip
    return BlockKey(m, n, k, WQ.dtype, dtype)


def _check_shuffled(op, WQ) -> None:
    if not is_shuffled(WQ):
        raise _error(op, f"WQ must be the pre-shuffled weight from gemmtune.quant.shuffle_weight ([N, K] with "
                     f"K contiguous), got strides {tuple(WQ.stride())}", WQ=WQ)  # fmt: skip


# ---- runners with the canonical views ---------------------------------------------------------------
def _rows2d(t: torch.Tensor, k: int) -> torch.Tensor:
    t2 = t.reshape(-1, k)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _a8w8_call(run, key: QuantKey, x_shape, canonical: bool):
    if canonical:
        return run
    m, n, k = key.M, key.N, key.K
    out_shape = (*x_shape[:-1], n)
    per_tensor = key.scale == "per_tensor"

    def call(XQ, WQ, x_scale, w_scale, bias):
        if per_tensor:
            xs, ws = x_scale.reshape(1), w_scale.reshape(1)
        else:  # a 1-element side is broadcast to its per-row / per-channel vector
            xs = x_scale.reshape(-1, 1).expand(m, 1).contiguous()
            ws = w_scale.reshape(1, -1).expand(1, n).contiguous()
        wq = WQ if WQ.stride(1) == 1 else WQ.contiguous()
        b = None if bias is None else bias.reshape(n)
        return run(_rows2d(XQ, k), wq, xs, ws, b).view(out_shape)

    return call


def _is_canonical_a8w8(XQ, WQ, x_scale, w_scale, bias, key: QuantKey) -> bool:
    if XQ.dim() != 2 or not XQ.is_contiguous() or WQ.stride(1) != 1 or (bias is not None and bias.dim() != 1):
        return False
    if key.scale == "per_tensor":
        return tuple(x_scale.shape) == (1,) and tuple(w_scale.shape) == (1,)
    return (tuple(x_scale.shape) == (key.M, 1) and tuple(w_scale.shape) == (1, key.N) and x_scale.is_contiguous()
            and w_scale.is_contiguous())  # fmt: skip


def _block_call(run, key: BlockKey, x_shape, canonical: bool):
    if canonical:
        return run
    k, kb = key.K, key.K // BLOCK
    out_shape = (*x_shape[:-1], key.N)

    def call(XQ, WQ, x_scale, w_scale):
        wq = WQ if WQ.stride(1) == 1 else WQ.contiguous()
        return run(_rows2d(XQ, k), wq, x_scale.reshape(-1, kb), w_scale).view(out_shape)

    return call


def _empty_call(shape, dtype):
    return lambda XQ, *rest: XQ.new_empty(shape, dtype=dtype)


def _zeros_call(shape, dtype):
    return lambda XQ, *rest: XQ.new_zeros(shape, dtype=dtype)


# ---- the hot path's pieces, per op ----------------------------------------------------------------
def _a8w8_signature(XQ, WQ, x_scale, w_scale, bias, dtype) -> tuple:
    b = None if bias is None else (bias.shape, bias.dtype, bias.device, bias.stride())
    return (XQ.shape, WQ.shape, x_scale.shape, w_scale.shape, XQ.dtype, WQ.dtype, x_scale.dtype, w_scale.dtype,
            XQ.device, WQ.device, x_scale.device, w_scale.device, XQ.stride(), WQ.stride(), x_scale.stride(),
            w_scale.stride(), b, dtype)  # fmt: skip


def _block_signature(XQ, WQ, x_scale, w_scale, dtype) -> tuple:
    return (XQ.shape, WQ.shape, x_scale.shape, w_scale.shape, XQ.dtype, WQ.dtype, x_scale.dtype, w_scale.dtype,
            XQ.device, WQ.device, x_scale.device, w_scale.device, XQ.stride(), WQ.stride(), x_scale.stride(),
            w_scale.stride(), dtype)  # fmt: skip


def _a8w8_pieces(family: str, op: str) -> tuple[OpCache, Callable]:
    """The cache (validate, bind) and fake of gemm_a8w8 (family a8w8) or gemm_a8w8_bpreshuffle
    (a8w8_bpreshuffle)."""
    shuffled = family == "a8w8_bpreshuffle"

    def validate(XQ, WQ, x_scale, w_scale, bias, dtype):
        validate_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype, op)
        if shuffled:
            _check_shuffled(op, WQ)

    def bind(XQ, WQ, x_scale, w_scale, bias, dtype):
        key = validate_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype, op)
        shape = (*XQ.shape[:-1], key.N)
        if key.M == 0 or key.N == 0:
            return _empty_call(shape, dtype)
        if key.K == 0:
            return _zeros_call(shape, dtype)
        run = _dispatcher.runner_for(key, XQ.device, family=family)
        return _a8w8_call(run, key, tuple(XQ.shape), _is_canonical_a8w8(XQ, WQ, x_scale, w_scale, bias, key))

    def fake(XQ, WQ, x_scale, w_scale, bias, dtype):
        key = validate_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype, op)
        return XQ.new_empty((*XQ.shape[:-1], key.N), dtype=dtype)

    return OpCache(op, family=family, validate=validate, bind=bind), fake


def _block_pieces(family: str, op: str) -> tuple[OpCache, Callable]:
    """The cache (validate, bind) and fake of gemm_a8w8_blockscale (and its bpreshuffle twin)."""
    shuffled = family == "a8w8_blockscale_bpreshuffle"

    def validate(XQ, WQ, x_scale, w_scale, dtype):
        validate_blockscale(XQ, WQ, x_scale, w_scale, dtype, op)
        if shuffled:
            _check_shuffled(op, WQ)

    def bind(XQ, WQ, x_scale, w_scale, dtype):
        key = validate_blockscale(XQ, WQ, x_scale, w_scale, dtype, op)
        shape = (*XQ.shape[:-1], key.N)
        if key.M == 0 or key.N == 0:
            return _empty_call(shape, dtype)
        if key.K == 0:  # an empty sum, as gemm_a8w8 and torch.mm answer it
            return _zeros_call(shape, dtype)
        run = _dispatcher.runner_for(key, XQ.device, family=family)
        canonical = XQ.dim() == 2 and XQ.is_contiguous() and WQ.stride(1) == 1
        return _block_call(run, key, tuple(XQ.shape), canonical)

    def fake(XQ, WQ, x_scale, w_scale, dtype):
        key = validate_blockscale(XQ, WQ, x_scale, w_scale, dtype, op)
        return XQ.new_empty((*XQ.shape[:-1], key.N), dtype=dtype)

    return OpCache(op, family=family, validate=validate, bind=bind), fake


# ---- the ops ----------------------------------------------------------------------------------------
_a8w8_cache, _a8w8_fake = _a8w8_pieces("a8w8", "gemm_a8w8")


@public_op(_a8w8_cache, aiter_names=("gemm_a8w8",))
def gemm_a8w8(XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """y[..., N] = (XQ[..., K] @ WQ[N, K]^T) * x_scale * w_scale (+ bias), in `dtype`."""
    if _is_compiling():
        return torch.ops.gemmtune.gemm_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype)
    try:
        call = _a8w8_cache.get(sig := _a8w8_signature(XQ, WQ, x_scale, w_scale, bias, dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _a8w8_cache.reject(XQ, WQ, x_scale, w_scale, bias, dtype)
        raise
    if call is None:
        call = _a8w8_cache.miss(sig, XQ, WQ, x_scale, w_scale, bias, dtype)
    return call(XQ, WQ, x_scale, w_scale, bias)


@custom_op(_a8w8_cache, fake=_a8w8_fake)
def _gemm_a8w8_op(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    return gemm_a8w8(XQ, WQ, x_scale, w_scale, bias, dtype)


_a8w8_bpreshuffle_cache, _a8w8_bpreshuffle_fake = _a8w8_pieces("a8w8_bpreshuffle", "gemm_a8w8_bpreshuffle")


@public_op(_a8w8_bpreshuffle_cache, aiter_names=("gemm_a8w8_bpreshuffle",))
def gemm_a8w8_bpreshuffle(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """gemm_a8w8 with WQ from shuffle_weight (its own tuned table, a8w8_bpreshuffle)."""
    if _is_compiling():
        return torch.ops.gemmtune.gemm_a8w8_bpreshuffle(XQ, WQ, x_scale, w_scale, bias, dtype)
    try:
        call = _a8w8_bpreshuffle_cache.get(sig := _a8w8_signature(XQ, WQ, x_scale, w_scale, bias, dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _a8w8_bpreshuffle_cache.reject(XQ, WQ, x_scale, w_scale, bias, dtype)
        raise
    if call is None:
        call = _a8w8_bpreshuffle_cache.miss(sig, XQ, WQ, x_scale, w_scale, bias, dtype)
    return call(XQ, WQ, x_scale, w_scale, bias)


@custom_op(_a8w8_bpreshuffle_cache, fake=_a8w8_bpreshuffle_fake)
def _gemm_a8w8_bpreshuffle_op(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    return gemm_a8w8_bpreshuffle(XQ, WQ, x_scale, w_scale, bias, dtype)


@spelling_of(gemm_a8w8, aiter_names=("int8_gemm",))
def int8_gemm(input: torch.Tensor, weight: torch.Tensor, input_scale: torch.Tensor, weight_scale: torch.Tensor,
              output_dtype: torch.dtype = torch.float16) -> torch.Tensor:  # fmt: skip
    """int8 x int8 -> output_dtype with per-token/per-tensor input and per-channel/per-tensor weight scales."""
    if getattr(input, "dtype", None) != torch.int8 or getattr(weight, "dtype", None) != torch.int8:
        raise ValueError(f"gemmtune.int8_gemm: input and weight must be int8, got {getattr(input, 'dtype', input)} "
                         f"and {getattr(weight, 'dtype', weight)} (gemm_a8w8 takes fp8)")  # fmt: skip
    return gemm_a8w8(input, weight, input_scale, weight_scale, None, output_dtype)


_blockscale_cache, _blockscale_fake = _block_pieces("a8w8_blockscale", "gemm_a8w8_blockscale")


@public_op(_blockscale_cache, aiter_names=("gemm_a8w8_blockscale",))
def gemm_a8w8_blockscale(XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:  # fmt: skip
    """y[..., N] = sum over 128-wide K groups g of (XQ[:, g] @ WQ[:, g]^T) * x_scale[m, g] * w_scale[n // 128, g]."""
    if _is_compiling():
        return torch.ops.gemmtune.gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype)
    try:
        call = _blockscale_cache.get(sig := _block_signature(XQ, WQ, x_scale, w_scale, dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _blockscale_cache.reject(XQ, WQ, x_scale, w_scale, dtype)
        raise
    if call is None:
        call = _blockscale_cache.miss(sig, XQ, WQ, x_scale, w_scale, dtype)
    return call(XQ, WQ, x_scale, w_scale)


@custom_op(_blockscale_cache, fake=_blockscale_fake)
def _gemm_a8w8_blockscale_op(
    XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return gemm_a8w8_blockscale(XQ, WQ, x_scale, w_scale, dtype)


_blockscale_bpreshuffle_cache, _blockscale_bpreshuffle_fake = _block_pieces(
    "a8w8_blockscale_bpreshuffle", "gemm_a8w8_blockscale_bpreshuffle"
)


@public_op(_blockscale_bpreshuffle_cache, aiter_names=("gemm_a8w8_blockscale_bpreshuffle",))
def gemm_a8w8_blockscale_bpreshuffle(
    XQ: torch.Tensor,
    WQ: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """gemm_a8w8_blockscale with WQ from shuffle_weight (its own tuned table)."""
    if _is_compiling():
        return torch.ops.gemmtune.gemm_a8w8_blockscale_bpreshuffle(XQ, WQ, x_scale, w_scale, dtype)
    try:
        call = _blockscale_bpreshuffle_cache.get(sig := _block_signature(XQ, WQ, x_scale, w_scale, dtype))
    except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
        _blockscale_bpreshuffle_cache.reject(XQ, WQ, x_scale, w_scale, dtype)
        raise
    if call is None:
        call = _blockscale_bpreshuffle_cache.miss(sig, XQ, WQ, x_scale, w_scale, dtype)
    return call(XQ, WQ, x_scale, w_scale)


@custom_op(_blockscale_bpreshuffle_cache, fake=_blockscale_bpreshuffle_fake)
def _gemm_a8w8_blockscale_bpreshuffle_op(
    XQ: torch.Tensor, WQ: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    return gemm_a8w8_blockscale_bpreshuffle(XQ, WQ, x_scale, w_scale, dtype)


__all__ = [
    "gemm_a8w8",
    "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle",
    "gemm_a8w8_bpreshuffle",
    "int8_gemm",
    "validate_a8w8",
    "validate_blockscale",
]
