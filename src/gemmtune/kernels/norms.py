"""RMSNorm and residual-add + RMSNorm as single Triton kernels, with the plain-PyTorch references.

Two weight conventions cover the Hugging Face families:
- Llama style (`cast_before_weight=True`): y = w * to_dtype(x * rsqrt(mean(x^2) + eps)); the product is
  rounded once more in the input dtype (LlamaRMSNorm and the Mistral/Qwen/Phi3/Mixtral copies).
- Gemma style (`cast_before_weight=False`, `offset=1.0`): y = to_dtype(x_hat * (1 + w)) with the product
  in fp32 (GemmaRMSNorm, Gemma2/3).
Statistics are always computed in fp32. The residual add rounds its sum to the input dtype before the
norm reads it, as `residual + hidden_states` does in the model.

`rmsnorm` / `add_rmsnorm` pick the Triton kernel where Triton compiles for the tensor's device (a GPU:
device.triton_on_gpu) and the reference otherwise (CPU, or dtype mixes the kernel does not reproduce
exactly); `impl="triton"` forces the kernel (used by the interpreter tests on CPU). Under torch.compile
they follow compile_mode: the reference (fused by inductor) or the custom ops `gemmtune::rmsnorm` /
`gemmtune::add_rmsnorm`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..device import triton_installed, triton_on_gpu
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401
from ._common import KERNEL_DTYPES as _KERNEL_DTYPES
from ._common import empty_out as _empty
from ._common import pdl_kwargs as _pdl_kwargs
from .compile_mode import compile_impl
from .launch import Plans, cached_launch, tensor_signature

_is_compiling = torch.compiler.is_compiling
_PLANS = Plans()  # the kernel's launches, per signature


# ---- references ---------------------------------------------------------------------------------
def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: float = 0.0, cast_before_weight: bool = True
) -> torch.Tensor:
    """The Hugging Face formulas, op for op (so results match the stock modules bit for bit)."""
    xf = x.float()
    xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if cast_before_weight:
        w = weight if offset == 0.0 else weight + offset
        return w * xh.to(x.dtype)
    return (xh * (offset + weight.float())).type_as(x)


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x): the decoder layer's add then its next norm."""
    s = residual + x
    return rmsnorm_ref(s, weight, eps, offset=offset, cast_before_weight=cast_before_weight), s


# ---- kernel -------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def rmsnorm_tile(
        X, R, W, S,
        n_rows, inner, sx_outer, sx_inner, sr_outer, sr_inner, C, eps, offset,
        HAS_RES: tl.constexpr, CAST_BEFORE_W: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """(rows, cols, mask, y): program_id(0)'s BLOCK_R rows normalized, y in X's dtype (the output's);
        with HAS_RES the residual sum is written to S first. Also the 8-bit producers' front half."""
        # Rows are (outer, inner) pairs so a head-split view ([tokens, heads, D] out of a fused qkv
        # output) is read in place: row r lives at (r // inner) * s_outer + (r % inner) * s_inner.
        pid = tl.program_id(0)
        rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # no int32 overflow on big inputs
        cols = tl.arange(0, BLOCK_C)
        rmask = rows < n_rows
        cmask = cols < C
        mask = rmask[:, None] & cmask[None, :]
        if PDL:  # the next kernel (a GEMM prefetching its weights) may start now; x comes from the last one
            gdc_launch_dependents()
            gdc_wait()
        o = rows // inner
        i = rows % inner
        x = tl.load(X + (o * sx_outer + i * sx_inner)[:, None] + cols[None, :], mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + (o * sr_outer + i * sr_inner)[:, None] + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(S + rows[:, None] * C + cols[None, :], x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=1) / C
        xh = xf * (1.0 / tl.sqrt(var + eps))[:, None]
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
        if CAST_BEFORE_W:
            # Llama: round the normalized value to the input dtype, then one rounded product.
            y = w[None, :] * xh.to(X.dtype.element_ty).to(tl.float32)
        else:
            y = xh * w[None, :]
        return rows, cols, mask, y.to(X.dtype.element_ty)

    @triton.jit
    def _rmsnorm_kernel(
        X, R, W, Y, S,
        n_rows, inner, sx_outer, sx_inner, sr_outer, sr_inner, C, eps, offset,
        HAS_RES: tl.constexpr, CAST_BEFORE_W: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        rows, cols, mask, y = rmsnorm_tile(
            X, R, W, S, n_rows, inner, sx_outer, sx_inner, sr_outer, sr_inner, C, eps, offset,
            HAS_RES, CAST_BEFORE_W, BLOCK_R, BLOCK_C, PDL,
        )  # fmt: skip
        tl.store(Y + rows[:, None] * C + cols[None, :], y, mask=mask)


def _row_layout(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """(tensor, n_rows, inner, stride_outer, stride_inner) for a [..., C] tensor with unit last stride.

    Leading dims are merged into at most two index levels; anything else is made contiguous.
    """
    C = t.shape[-1]
    if t.is_contiguous():  # the common case, without the loop below
        return t, t.numel() // C if C else 0, 1, C, 0
    if t.stride(-1) != 1:
        t = t.contiguous()
    dims = [(s, st) for s, st in zip(t.shape[:-1], t.stride()[:-1]) if s != 1]
    merged: list[list[int]] = []  # [size, stride], outermost first
    for size, stride in dims:
        if merged and merged[-1][1] == stride * size:
            merged[-1] = [merged[-1][0] * size, stride]
        else:
            merged.append([size, stride])
    if len(merged) > 2:
        t = t.contiguous()
        return t, t.numel() // C if C else 0, 1, C, 0
    if not merged:
        return t, 1, 1, 0, 0
    if len(merged) == 1:
        return t, merged[0][0], 1, merged[0][1], 0
    (so, st_o), (si, st_i) = merged
    return t, so * si, si, st_o, st_i


class NormRows(NamedTuple):
    """x and the residual as the kernel reads them: the row count, the (outer, inner) row split and
    the strides (x outer, x inner, residual outer, residual inner)."""

    x: torch.Tensor
    r: torch.Tensor
    n_rows: int
    inner: int
    strides: tuple[int, int, int, int]


def norm_rows(x: torch.Tensor, residual: torch.Tensor | None) -> NormRows:
    C = x.shape[-1]
    x, n_rows, inner, sxo, sxi = _row_layout(x)
    if residual is None:
        return NormRows(x, x, n_rows, inner, (sxo, sxi, 0, 0))
    r, n_r, inner_r, sro, sri = _row_layout(residual)
    if n_r != n_rows or inner_r != inner:  # differently shaped views: fall back to plain rows
        return NormRows(x.contiguous(), r.contiguous(), n_rows, 1, (C, 0, C, 0))
    return NormRows(x, r, n_rows, inner, (sxo, sxi, sro, sri))


def norm_blocks(C: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_C, num_warps): whole rows of C, several rows a program up to 4096 elements."""
    block_c = triton.next_power_of_2(C)
    block_r = max(1, min(64, 4096 // block_c))
    elems = block_r * block_c
    return block_r, block_c, 1 if elems <= 512 else 4 if elems <= 4096 else 8 if elems <= 16384 else 16


def _launch(x, residual, weight, eps, offset, cast_before_weight):
    C = x.shape[-1]
    rows = norm_rows(x, residual)
    y = _empty(rows.x.shape, rows.x)
    s = None if residual is None else _empty(rows.x.shape, rows.x)
    if rows.n_rows:
        block_r, block_c, warps = norm_blocks(C)
        signature = (tensor_signature(x), tensor_signature(residual), tensor_signature(weight), eps, offset,
                     cast_before_weight)  # fmt: skip
        cached_launch(
            _PLANS, signature, _rmsnorm_kernel, (triton.cdiv(rows.n_rows, block_r),),
            rows.x, rows.r, weight, y, y if s is None else s,
            rows.n_rows, rows.inner, *rows.strides, C, float(eps), float(offset),
            HAS_RES=residual is not None, CAST_BEFORE_W=cast_before_weight,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, **_pdl_kwargs(x.device),
        )  # fmt: skip
    return y if residual is None else (y, s)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm: weight {tuple(weight.shape)} does not match x[..., {x.shape[-1]}] {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"add_rmsnorm: residual {tuple(residual.shape)} != x {tuple(x.shape)}")


def kernel_dtypes_ok(x, weight, residual, cast_before_weight) -> bool:
    """The dtype mixes the kernel reproduces exactly (its output is then x's dtype, like the reference)."""
    return (
        x.dtype in _KERNEL_DTYPES
        and x.shape[-1] > 0
        and (residual is None or residual.dtype == x.dtype)
        # Llama style promotes w * x to w's dtype when they differ; only the equal case is fused.
        and (not cast_before_weight or weight.dtype == x.dtype)
    )


def _use_kernel(x, weight, residual, cast_before_weight, impl: str) -> bool:
    if impl == "ref" or (impl == "auto" and not triton_on_gpu(x.device)):
        return False
    ok = triton_installed() and kernel_dtypes_ok(x, weight, residual, cast_before_weight)
    if impl == "triton":
        if not ok:
            raise ValueError(
                f"rmsnorm: the Triton kernel cannot run x {x.dtype}, weight {weight.dtype}"
                f"{'' if triton_installed() else ' (triton is not installed)'}"
            )
        return True
    return ok


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """RMSNorm over the last dim; returns a contiguous tensor shaped like x."""
    _check(x, weight, None)
    if impl == "auto" and _is_compiling():
        return _traced(x, None, weight, eps, offset, cast_before_weight)
    if _use_kernel(x, weight, None, cast_before_weight, impl):
        return _launch(x, None, weight, eps, offset, cast_before_weight)
    return rmsnorm_ref(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x), residual + x) in one pass over the data."""
    _check(x, weight, residual)
    if impl == "auto" and _is_compiling():
        return _traced(x, residual, weight, eps, offset, cast_before_weight)
    if _use_kernel(x, weight, residual, cast_before_weight, impl):
        return _launch(x, residual, weight, eps, offset, cast_before_weight)
    return add_rmsnorm_ref(x, residual, weight, eps, offset=offset, cast_before_weight=cast_before_weight)


# ---- torch.compile -------------------------------------------------------------------------------
def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _traced(x, residual, weight, eps, offset, cast_before_weight):
    """What torch.compile traces: the custom op (mode "op", when the kernel's dtypes fit and no
    gradient is needed: the op has no backward) or the reference, for inductor to fuse."""
    op = "rmsnorm" if residual is None else "add_rmsnorm"
    if (
        compile_impl(op) == "op"
        and kernel_dtypes_ok(x, weight, residual, cast_before_weight)
        and not _needs_grad(x, residual, weight)
    ):
        args = (weight, float(eps), float(offset), bool(cast_before_weight))
        if residual is None:
            return torch.ops.gemmtune.rmsnorm(x, *args)
        return torch.ops.gemmtune.add_rmsnorm(x, residual, *args)
    if residual is None:
        return rmsnorm_ref(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight)
    return add_rmsnorm_ref(x, residual, weight, eps, offset=offset, cast_before_weight=cast_before_weight)


@torch.library.custom_op("gemmtune::rmsnorm", mutates_args=())
def _rmsnorm_op(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool
) -> torch.Tensor:
    if triton_on_gpu(x.device):
        return _launch(x, None, weight, eps, offset, cast_before_weight)
    return rmsnorm_ref(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight).contiguous()


@_rmsnorm_op.register_fake
def _rmsnorm_fake(x, weight, eps, offset, cast_before_weight):
    return x.new_empty(x.shape)


@torch.library.custom_op("gemmtune::add_rmsnorm", mutates_args=())
def _add_rmsnorm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_on_gpu(x.device):
        return _launch(x, residual, weight, eps, offset, cast_before_weight)
    y, s = add_rmsnorm_ref(x, residual, weight, eps, offset=offset, cast_before_weight=cast_before_weight)
    return y.contiguous(), s.contiguous()


@_add_rmsnorm_op.register_fake
def _add_rmsnorm_fake(x, residual, weight, eps, offset, cast_before_weight):
    return x.new_empty(x.shape), x.new_empty(x.shape)
