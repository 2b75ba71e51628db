"""act(gate) * up on the fused gate_up GEMM output [..., 2I] (gate first, up second), one Triton pass.

Rounding follows the model's two ops: act(gate) is rounded to the input dtype, then the product is
rounded again, so the fused result matches `act_fn(gate_proj(x)) * up_proj(x)` up to the activation's
own last-bit differences. `silu_mul` / `gelu_tanh_mul` use Triton where it compiles for the tensor's
device (a GPU: device.triton_on_gpu) and the reference otherwise; `impl="triton"` forces the kernel
(interpreter tests on CPU). Under torch.compile `act_mul` follows compile_mode: the reference (fused by
inductor) or the custom op `gemmtune::act_mul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..device import triton_installed, triton_on_gpu
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401
from ._common import KERNEL_DTYPES as _KERNEL_DTYPES
from ._common import empty_out as _empty
from ._common import pdl_kwargs as _pdl_kwargs
from .compile_mode import compile_impl
from .launch import Plans, cached_launch, tensor_signature

_is_compiling = torch.compiler.is_compiling
_PLANS = Plans()  # the kernel's launches, per signature

ACTIVATIONS = ("silu", "gelu_tanh")


def _check_even(gu: torch.Tensor) -> None:
    if gu.shape[-1] % 2:
        raise ValueError(f"act_mul: last dim of the fused gate_up output must be even, got {tuple(gu.shape)}")


def _halves(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check_even(gu)
    return gu.chunk(2, dim=-1)


def silu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    gate, up = _halves(gu)
    return F.silu(gate) * up


def gelu_tanh_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    gate, up = _halves(gu)
    return F.gelu(gate, approximate="tanh") * up


_REFS = {"silu": silu_mul_ref, "gelu_tanh": gelu_tanh_mul_ref}

if HAS_TRITON:

    @triton.jit
    def act_mul_values(gu_row, n_cols, cols, mask, ACT: tl.constexpr, out_ty: tl.constexpr):
        """act(gate) * up at `cols` (any shape) of one gate_up row, rounded as the model's two ops round
        them (to out_ty); 0 where masked. Also the 8-bit producers' front half."""
        g = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if ACT == 0:  # silu
            a = g / (1.0 + tl.exp(-g))
        else:  # gelu, tanh approximation; tanh(z) = 1 - 2 / (1 + exp(2z)) keeps it portable
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
        a = a.to(out_ty).to(tl.float32)
        return (a * u).to(out_ty)

    @triton.jit
    def _act_mul_kernel(GU, Y, n_cols, stride_row, ACT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        if PDL:  # see norms.py: let the next GEMM start prefetching, wait for the one that wrote GU
            gdc_launch_dependents()
            gdc_wait()
        y = act_mul_values(GU + row * stride_row, n_cols, cols, mask, ACT, Y.dtype.element_ty)
        tl.store(Y + row * n_cols + cols, y, mask=mask)


def gate_up_rows(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2I] as [rows, 2I] with unit stride along the features (a copy only where needed)."""
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    try:
        return gu.view(-1, gu.shape[-1])
    except RuntimeError:  # leading dims not mergeable into one row stride
        return gu.contiguous().view(-1, gu.shape[-1])


def _launch(gu: torch.Tensor, act: str) -> torch.Tensor:
    inter = gu.shape[-1] // 2
    rows2d = gate_up_rows(gu)
    n_rows = rows2d.shape[0]
    y = _empty((*gu.shape[:-1], inter), gu)
    if n_rows == 0 or inter == 0:
        return y
    block = min(1024, triton.next_power_of_2(inter))
    grid = (n_rows, triton.cdiv(inter, block))
    cached_launch(
        _PLANS,
        (tensor_signature(gu), act),
        _act_mul_kernel,
        grid,
        rows2d,
        y,
        inter,
        rows2d.stride(0),
        ACT=ACTIVATIONS.index(act),
        BLOCK=block,
        num_warps=4 if block >= 512 else 1,
        **_pdl_kwargs(gu.device),
    )
    return y


def act_mul(gu: torch.Tensor, act: str, *, impl: str = "auto") -> torch.Tensor:
    """act(gu[..., :I]) * gu[..., I:] for act in ACTIVATIONS."""
    if act not in _REFS:
        raise ValueError(f"act_mul: unknown activation {act!r} (expected one of {ACTIVATIONS})")
    _check_even(gu)  # (a shape check only: splitting would be one more op per call)
    if impl == "auto" and _is_compiling():
        return _traced(gu, act)
    ok = triton_installed() and gu.dtype in _KERNEL_DTYPES
    if impl == "ref" or (impl == "auto" and not (ok and triton_on_gpu(gu.device))):
        return _REFS[act](gu)
    if not ok:
        raise ValueError(
            f"act_mul: the Triton kernel cannot run {gu.dtype}"
            f"{'' if triton_installed() else ' (triton is not installed)'}"
        )
    return _launch(gu, act)


def silu_mul(gu: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    return act_mul(gu, "silu", impl=impl)


def gelu_tanh_mul(gu: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    return act_mul(gu, "gelu_tanh", impl=impl)


# ---- torch.compile -------------------------------------------------------------------------------
def _traced(gu: torch.Tensor, act: str) -> torch.Tensor:
    """The custom op (mode "op", kernel dtypes, no gradient needed: it has no backward) or the
    reference for inductor to fuse."""
    if (
        compile_impl("act_mul") == "op"
        and gu.dtype in _KERNEL_DTYPES
        and not (torch.is_grad_enabled() and gu.requires_grad)
    ):
        return torch.ops.gemmtune.act_mul(gu, act)
    return _REFS[act](gu)


@torch.library.custom_op("gemmtune::act_mul", mutates_args=())
def _act_mul_op(gu: torch.Tensor, act: str) -> torch.Tensor:
    if triton_on_gpu(gu.device):
        return _launch(gu, act)
    return _REFS[act](gu).contiguous()


@_act_mul_op.register_fake
def _act_mul_fake(gu, act):
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))
