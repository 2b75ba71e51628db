"""RMSNorm (+ residual add) and act(gate) * up that emit the 8-bit GEMM's activation directly: int8 or
fp8 e4m3 values and fp32 scales, one per token or one per 1x128 group.

The op before an 8-bit GEMM writes its 16-bit output only for the quantizer to read it back; doing
both in one kernel saves that round trip and a launch per GEMM. The math is the unfused chain's: the
norm / act*mul value is rounded to the input dtype as the model rounds it (norms.py, activations.py),
then quantized as quant/quantize.py does (scale = max(amax, 1e-12) / qmax; the kernels round int8
ties away from zero, torch to even, so an exact tie may differ by one step, as in kernels/quant.py).

Scales come in the layout the GEMMs read without a copy: per token [..., 1]; per 1x128 group the 2-D
[M, ceil(K/128)] grid stored M-major (quant/layouts.py), M the product of the leading dims.

Where they run, as in norms.py: the Triton kernel where Triton compiles for the device
(device.triton_on_gpu), the PyTorch reference otherwise; impl="triton" forces the kernel (the
interpreter tests). Under torch.compile the custom ops gemmtune::rmsnorm_quant, ::add_rmsnorm_quant
and ::act_mul_quant (fake impls, fresh outputs, nothing mutated: CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from ..device import triton_installed, triton_on_gpu
from ..quant.formats import BLOCK, SCALE_DTYPE, is_fp8, is_quant_dtype, qmax
from ..quant.quantize import quantize_1x128, quantize_per_token
from . import activations, norms
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401
from ._common import KERNEL_DTYPES as _KERNEL_DTYPES
from ._common import pdl_kwargs as _pdl_kwargs
from .launch import Plans, bind, tensor_signature
from .quant import ONE_PASS_MAX

_is_compiling = torch.compiler.is_compiling

SCALINGS = ("per_token", "1x128")
_NORM_PLANS, _ACT_PLANS = Plans(), Plans()  # the kernels' launches, per signature


# ---- outputs ------------------------------------------------------------------------------------
def _alloc(shape, dtype, device, strides=None) -> torch.Tensor:
    """Output allocation (the tests swap in a poisoned one to prove every element is written)."""
    if strides is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, strides, dtype=dtype, device=device)


def _scales(lead, k: int, scaling: str, device) -> torch.Tensor:
    """Empty scales of a [*lead, K] activation: [*lead, 1] per token, [M, ceil(K/128)] M-major per 1x128 group."""
    if scaling == "per_token":
        return _alloc((*lead, 1), SCALE_DTYPE, device)
    m = 1
    for d in lead:
        m *= d
    return _alloc((m, -(-k // BLOCK)), SCALE_DTYPE, device, strides=(1, m))


def _outputs(lead, k: int, qdtype, scaling: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    return _alloc((*lead, k), qdtype, device), _scales(lead, k, scaling, device)


def _check_format(qdtype, scaling: str, who: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"{who}: scaling must be one of {SCALINGS}, got {scaling!r}")
    if not is_quant_dtype(qdtype):
        raise ValueError(f"{who}: {qdtype} is not an 8-bit dtype (int8 or float8_e4m3fn/fnuz)")


# ---- references ---------------------------------------------------------------------------------
def quantize_ref(y: torch.Tensor, qdtype, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:
    """y quantized by quant/quantize.py, the scales in the producers' layout."""
    if scaling == "per_token":
        q, s = quantize_per_token(y, qdtype)
        return q.contiguous(), s.contiguous()
    q, s = quantize_1x128(y, qdtype)
    grid = _scales(y.shape[:-1], y.shape[-1], scaling, y.device)
    return q.contiguous(), grid.copy_(s.reshape(grid.shape))


def rmsnorm_quant_ref(x, weight, eps, qdtype, scaling, *, offset=0.0, cast_before_weight=True):
    """(q, scale) of rmsnorm_ref(x): norms.rmsnorm_ref, then the quantizer."""
    y = norms.rmsnorm_ref(x, weight, eps, offset=offset, cast_before_weight=cast_before_weight)
    return quantize_ref(y, qdtype, scaling)


def add_rmsnorm_quant_ref(x, residual, weight, eps, qdtype, scaling, *, offset=0.0, cast_before_weight=True):
    """(q, scale, residual + x): norms.add_rmsnorm_ref, then the quantizer on its normalized output."""
    y, s = norms.add_rmsnorm_ref(x, residual, weight, eps, offset=offset, cast_before_weight=cast_before_weight)
    return (*quantize_ref(y, qdtype, scaling), s)


def act_mul_quant_ref(gu, act: str, qdtype, scaling):
    """(q, scale) of act(gate) * up: activations' reference, then the quantizer."""
    return quantize_ref(activations.act_mul(gu, act, impl="ref"), qdtype, scaling)


# ---- kernels ------------------------------------------------------------------------------------
if HAS_TRITON:
    from .activations import act_mul_values
    from .norms import rmsnorm_tile
    from .quant import _to_q, group_launch, quantize_rows, row_launch, store_piece

    @triton.jit
    def _store_rows(y, rows, cols, mask, Q, QS, n_rows, C, stride_sm, stride_sg,
                    QMAX: tl.constexpr, IS_INT: tl.constexpr, GROUP: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
        """Quantize the fp32 tile y [BLOCK_R, BLOCK_C] of whole rows (zero past C) and store q [n_rows, C]
        and the scales: one a row (GROUP == 0) or one per GROUP columns."""
        if GROUP == 0:
            q, scale = quantize_rows(y, QMAX, IS_INT, Q.dtype.element_ty)
            tl.store(QS + rows * stride_sm, scale, mask=rows < n_rows)
        else:
            NG: tl.constexpr = BLOCK_C // GROUP
            qg, scale = quantize_rows(tl.reshape(y, (BLOCK_R * NG, GROUP)), QMAX, IS_INT, Q.dtype.element_ty)
            q = tl.reshape(qg, (BLOCK_R, BLOCK_C))
            gs = tl.arange(0, NG)
            smask = (rows < n_rows)[:, None] & (gs * GROUP < C)[None, :]
            s_off = rows[:, None] * stride_sm + gs[None, :] * stride_sg
            tl.store(QS + s_off, tl.reshape(scale, (BLOCK_R, NG)), mask=smask)
        tl.store(Q + rows[:, None] * C + cols[None, :], q, mask=mask)

    @triton.jit
    def _rmsnorm_quant_kernel(
        X, R, W, S, Q, QS,
        n_rows, inner, sx_outer, sx_inner, sr_outer, sr_inner, C, eps, offset, stride_sm, stride_sg,
        HAS_RES: tl.constexpr, CAST_BEFORE_W: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
        GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        rows, cols, mask, y = rmsnorm_tile(
            X, R, W, S, n_rows, inner, sx_outer, sx_inner, sr_outer, sr_inner, C, eps, offset,
            HAS_RES, CAST_BEFORE_W, BLOCK_R, BLOCK_C, PDL,
        )  # fmt: skip
        _store_rows(y.to(tl.float32), rows, cols, mask, Q, QS, n_rows, C, stride_sm, stride_sg,
                    QMAX, IS_INT, GROUP, BLOCK_R, BLOCK_C)  # fmt: skip

    @triton.jit
    def _act_piece(gu_row, START: tl.constexpr, SIZE: tl.constexpr, n_cols, ACT: tl.constexpr, DT: tl.constexpr):
        """(offsets, fp32 act(gate) * up) of the SIZE-wide piece of a row from START (zero past n_cols)."""
        offs = START + tl.arange(0, SIZE)
        return offs, act_mul_values(gu_row, n_cols, offs, offs < n_cols, ACT, DT).to(tl.float32)

    @triton.jit(do_not_specialize=["n_cols"])
    def _act_mul_quant_token_kernel(GU, Q, QS, n_cols, stride_row, ACT: tl.constexpr, QMAX: tl.constexpr,
                                    IS_INT: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                                    TAIL: tl.constexpr = 0, PDL: tl.constexpr = False):  # fmt: skip
        """One row a program. ONE_PASS: read once, as one BLOCK-wide piece and a TAIL-wide one after it
        (quant.row_launch; 0: none), kept in registers for the amax and the values; else two passes over
        BLOCK-wide chunks: the amax, then the values (recomputed, never stored)."""
        row = tl.program_id(0).to(tl.int64)
        if PDL:  # see norms.py
            gdc_launch_dependents()
            gdc_wait()
        gu_row = GU + row * stride_row
        q_row = Q + row * n_cols
        if ONE_PASS:
            o0, y0 = _act_piece(gu_row, 0, BLOCK, n_cols, ACT, GU.dtype.element_ty)
            amax = tl.max(tl.abs(y0), axis=0)
            if TAIL > 0:
                o1, y1 = _act_piece(gu_row, BLOCK, TAIL, n_cols, ACT, GU.dtype.element_ty)
                amax = tl.maximum(amax, tl.max(tl.abs(y1), axis=0))
            scale = tl.maximum(amax, 1e-12) / QMAX
            tl.store(QS + row, scale)
            store_piece(q_row, o0, y0, scale, n_cols, QMAX, IS_INT)
            if TAIL > 0:
                store_piece(q_row, o1, y1, scale, n_cols, QMAX, IS_INT)
        else:
            offs = tl.arange(0, BLOCK)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(0, n_cols, BLOCK):
                y = act_mul_values(gu_row, n_cols, k + offs, k + offs < n_cols, ACT, GU.dtype.element_ty)
                amax = tl.maximum(amax, tl.abs(y.to(tl.float32)))
            scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
            tl.store(QS + row, scale)
            for k in range(0, n_cols, BLOCK):
                y = act_mul_values(gu_row, n_cols, k + offs, k + offs < n_cols, ACT, GU.dtype.element_ty)
                q = _to_q(y.to(tl.float32) / scale, QMAX, IS_INT, Q.dtype.element_ty)
                tl.store(q_row + k + offs, q, mask=k + offs < n_cols)

    @triton.jit
    def _act_mul_quant_group_kernel(GU, Q, QS, n_cols, n_groups, stride_row, stride_sm, stride_sg,
                                    ACT: tl.constexpr, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                                    GROUP: tl.constexpr, GROUPS: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
        """GROUPS consecutive GROUP-wide groups of one row: a [GROUPS, GROUP] tile, one scale per tile row."""
        row = tl.program_id(0).to(tl.int64)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        ok = offs < n_cols  # also masks groups past the last one
        y = act_mul_values(GU + row * stride_row, n_cols, offs, ok, ACT, GU.dtype.element_ty)
        q, scale = quantize_rows(y.to(tl.float32), QMAX, IS_INT, Q.dtype.element_ty)
        tl.store(QS + row * stride_sm + gs * stride_sg, scale, mask=gs < n_groups)
        tl.store(Q + row * n_cols + offs, q, mask=ok)


def _format_args(qdtype) -> dict:
    return {"QMAX": qmax(qdtype), "IS_INT": not is_fp8(qdtype)}


def _norm_signature(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling):
    """What fixes a norm producer's launch (and its checks' verdict), or None for a non-tensor argument."""
    try:
        return (tensor_signature(x), tensor_signature(residual), tensor_signature(weight), eps, offset,
                cast_before_weight, qdtype, scaling)  # fmt: skip
    except AttributeError:
        return None


def _launch_norm(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling, signature, kept):
    C = x.shape[-1]
    rows = norms.norm_rows(x, residual)
    q, s = _outputs(x.shape[:-1], C, qdtype, scaling, x.device)
    total = None if residual is None else _alloc(rows.x.shape, x.dtype, x.device)
    if rows.n_rows:
        tensors = (rows.x, rows.r, weight, q if total is None else total, q, s)
        if kept is not None:
            kept(*tensors)
            return (q, s) if residual is None else (q, s, total)
        group = 0 if scaling == "per_token" else BLOCK
        block_r, block_c, warps = norms.norm_blocks(max(C, group))  # a 1x128 tile holds whole groups
        s2 = s.view(-1, s.shape[-1])
        _NORM_PLANS.put(signature, bind(
            _rmsnorm_quant_kernel, (triton.cdiv(rows.n_rows, block_r),), *tensors,
            rows.n_rows, rows.inner, *rows.strides, C, float(eps), float(offset), s2.stride(0), s2.stride(1),
            HAS_RES=residual is not None, CAST_BEFORE_W=cast_before_weight, GROUP=group,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps, **_format_args(qdtype), **_pdl_kwargs(x.device),
        ))  # fmt: skip
    return (q, s) if residual is None else (q, s, total)


def _launch_act(gu, act: str, qdtype, scaling, signature, kept):
    inter = gu.shape[-1] // 2
    rows2d = activations.gate_up_rows(gu)
    m = rows2d.shape[0]
    q, s = _outputs(gu.shape[:-1], inter, qdtype, scaling, gu.device)
    if m == 0 or inter == 0:
        return q, s
    if kept is not None:
        kept(rows2d, q, s)
        return q, s
    common = {"ACT": activations.ACTIVATIONS.index(act), **_format_args(qdtype), **_pdl_kwargs(gu.device)}
    if scaling == "per_token":
        # a row up to ONE_PASS_MAX wide is read once, kept on chip; wider ones read gate_up twice
        _ACT_PLANS.put(signature, bind(_act_mul_quant_token_kernel, (m,), rows2d, q, s, inter, rows2d.stride(0),
                                       **row_launch(inter, m, ONE_PASS_MAX), **common))  # fmt: skip
    else:
        groups = s.shape[1]
        grid, per = group_launch(m, groups)
        _ACT_PLANS.put(signature, bind(
            _act_mul_quant_group_kernel, grid, rows2d, q, s, inter, groups,
            rows2d.stride(0), s.stride(0), s.stride(1), GROUP=BLOCK, **per, **common,
        ))  # fmt: skip
    return q, s


# ---- public -------------------------------------------------------------------------------------
def _use_kernel(ok: bool, device, impl: str, who: str) -> bool:
    if impl == "ref" or (impl == "auto" and not triton_on_gpu(device)):
        return False
    ok = ok and triton_installed()
    if impl == "triton" and not ok:
        raise ValueError(f"{who}: the Triton kernel cannot run these dtypes"
                         f"{'' if triton_installed() else ' (triton is not installed)'}")  # fmt: skip
    return ok


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _norm_quant(x, residual, weight, eps, qdtype, scaling, offset, cast_before_weight, impl):
    signature = _norm_signature(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling)
    kept = _NORM_PLANS.get(signature)
    if kept is not None and impl != "ref" and x.device.type != "cpu" and not _is_compiling():
        # this signature passed the checks below and launched the kernel before
        return _launch_norm(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling, signature, kept)
    who = "rmsnorm_quant" if residual is None else "add_rmsnorm_quant"
    _check_format(qdtype, scaling, who)
    norms._check(x, weight, residual)
    ok = norms.kernel_dtypes_ok(x, weight, residual, cast_before_weight)
    args = (float(eps), float(offset), bool(cast_before_weight), qdtype, scaling)
    if impl == "auto" and _is_compiling():
        if ok and not _needs_grad(x, residual, weight):
            if residual is None:
                return torch.ops.gemmtune.rmsnorm_quant(x, weight, *args)
            return torch.ops.gemmtune.add_rmsnorm_quant(x, residual, weight, *args)
    elif _use_kernel(ok, x.device, impl, who):
        return _launch_norm(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling, signature, kept)
    kw = {"offset": offset, "cast_before_weight": cast_before_weight}
    if residual is None:
        return rmsnorm_quant_ref(x, weight, eps, qdtype, scaling, **kw)
    return add_rmsnorm_quant_ref(x, residual, weight, eps, qdtype, scaling, **kw)


def rmsnorm_quant(x, weight, eps, qdtype, scaling="per_token", *, offset=0.0, cast_before_weight=True, impl="auto"):
    """(q, scale): rmsnorm(x) quantized to `qdtype` per token or per 1x128 group (`scaling`)."""
    return _norm_quant(x, None, weight, eps, qdtype, scaling, offset, cast_before_weight, impl)


def add_rmsnorm_quant(
    x, residual, weight, eps, qdtype, scaling="per_token", *, offset=0.0, cast_before_weight=True, impl="auto"
):
    """(q, scale, residual + x): add_rmsnorm with its normalized output quantized (the sum stays 16-bit)."""
    return _norm_quant(x, residual, weight, eps, qdtype, scaling, offset, cast_before_weight, impl)


def act_mul_quant(gu, act: str, qdtype, scaling="per_token", *, impl="auto"):
    """(q, scale): act(gu[..., :I]) * gu[..., I:] quantized to `qdtype` per token or per 1x128 group."""
    # ONE_PASS_MAX too: it picks the per-token launch (tests lower it to reach the two-pass kernel)
    signature = (
        (tensor_signature(gu), act, qdtype, scaling, ONE_PASS_MAX)
        if isinstance(gu, torch.Tensor) and isinstance(act, str)
        else None
    )
    kept = _ACT_PLANS.get(signature)
    if kept is not None and impl != "ref" and gu.device.type != "cpu" and not _is_compiling():
        return _launch_act(gu, act, qdtype, scaling, signature, kept)  # it passed the checks below before
    _check_format(qdtype, scaling, "act_mul_quant")
    if act not in activations.ACTIVATIONS:
        raise ValueError(f"act_mul_quant: unknown activation {act!r} (expected one of {activations.ACTIVATIONS})")
    activations._check_even(gu)
    ok = gu.dtype in _KERNEL_DTYPES
    if impl == "auto" and _is_compiling():
        if ok and not _needs_grad(gu):
            return torch.ops.gemmtune.act_mul_quant(gu, act, qdtype, scaling)
    elif _use_kernel(ok, gu.device, impl, "act_mul_quant"):
        return _launch_act(gu, act, qdtype, scaling, signature, kept)
    return act_mul_quant_ref(gu, act, qdtype, scaling)


# ---- custom ops (torch.compile) ------------------------------------------------------------------
@torch.library.custom_op("gemmtune::rmsnorm_quant", mutates_args=())
def _rmsnorm_quant_op(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float, cast_before_weight: bool,
                      qdtype: torch.dtype, scaling: str) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    impl = "triton" if triton_on_gpu(x.device) else "ref"
    return _norm_quant(x, None, weight, eps, qdtype, scaling, offset, cast_before_weight, impl)


@_rmsnorm_quant_op.register_fake
def _rmsnorm_quant_fake(x, weight, eps, offset, cast_before_weight, qdtype, scaling):
    return _outputs(x.shape[:-1], x.shape[-1], qdtype, scaling, x.device)


@torch.library.custom_op("gemmtune::add_rmsnorm_quant", mutates_args=())
def _add_rmsnorm_quant_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                          cast_before_weight: bool, qdtype: torch.dtype,
                          scaling: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    impl = "triton" if triton_on_gpu(x.device) else "ref"
    q, s, total = _norm_quant(x, residual, weight, eps, qdtype, scaling, offset, cast_before_weight, impl)
    return q, s, total.contiguous()


@_add_rmsnorm_quant_op.register_fake
def _add_rmsnorm_quant_fake(x, residual, weight, eps, offset, cast_before_weight, qdtype, scaling):
    return (*_outputs(x.shape[:-1], x.shape[-1], qdtype, scaling, x.device), x.new_empty(x.shape))


@torch.library.custom_op("gemmtune::act_mul_quant", mutates_args=())
def _act_mul_quant_op(
    gu: torch.Tensor, act: str, qdtype: torch.dtype, scaling: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return act_mul_quant(gu, act, qdtype, scaling, impl="triton" if triton_on_gpu(gu.device) else "ref")


@_act_mul_quant_op.register_fake
def _act_mul_quant_fake(gu, act, qdtype, scaling):
    return _outputs(gu.shape[:-1], gu.shape[-1] // 2, qdtype, scaling, gu.device)
