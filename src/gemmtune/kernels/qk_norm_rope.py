"""Per-head RMSNorm of q and k followed by rotary embedding, all in one Triton launch (Qwen3, Gemma-3).

Replaces `rope(rmsnorm(q), rmsnorm(k))` (three launches) with the same arithmetic: q [B, S, Hq, D] and
k [B, S, Hkv, D] are read in place (views into the qkv GEMM output), each head row is normalized over
D exactly as kernels/norms.py does (fp32 statistics; Llama or Gemma weight convention, rounded to
the input dtype), then rotated exactly as kernels/rope.py does (cos/sin [B or 1, S, R], R <= D, the
last D - R features pass through). Outputs are contiguous [B, S, H, D].
Off the GPU, and under torch.compile, `qk_norm_rope` runs the unfused public ops instead (each then
follows its own compile_mode), so results equal today's two-step path.
"""

from __future__ import annotations

import torch

from ..device import triton_installed, triton_on_gpu
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401
from ._common import empty_out as _empty
from ._common import pdl_kwargs as _pdl_kwargs
from .launch import Plans, cached_launch, tensor_signature
from .norms import kernel_dtypes_ok as norm_dtypes_ok
from .norms import rmsnorm, rmsnorm_ref
from .rope import kernel_fits as rope_fits
from .rope import rope, rope_ref

_is_compiling = torch.compiler.is_compiling
_PLANS = Plans()  # the kernel's launches, per signature


def qk_norm_rope_ref(q, k, wq, wk, cos, sin, eps_q: float, eps_k: float, *, offset=0.0, cast_before_weight=True):
    """rmsnorm_ref per head of q and of k, then rope_ref."""
    kw = {"offset": offset, "cast_before_weight": cast_before_weight}
    return rope_ref(rmsnorm_ref(q, wq, eps_q, **kw), rmsnorm_ref(k, wk, eps_k, **kw), cos, sin)


if HAS_TRITON:
    from .rope import head_rows

    @triton.jit
    def _qk_norm_rope_kernel(
        Q, K, WQ, WK, COS, SIN, QO, KO,
        S, HQ, HKV, D, R, eps_q, eps_k, offset,
        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s,
        CAST_BEFORE_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
    ):  # fmt: skip
        b, s, is_q, is_k, src, dst = head_rows(S, HQ, HKV, D, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, BLOCK_H)
        c = tl.arange(0, BLOCK_D)
        cm = c < D
        half = R // 2
        rot = c < R
        # rotate_half's partner of feature c (itself past R, where nothing rotates)
        partner = tl.where(c < half, c + half, tl.where(rot, c - half, c))
        mq = is_q[:, None] & cm[None, :]
        mk = is_k[:, None] & cm[None, :]
        if PDL:  # the next kernel may start now; q and k come from the GEMM before this one
            gdc_launch_dependents()
            gdc_wait()
        # a block mixes q heads and k heads: each element comes from exactly one of the two loads
        x = tl.load(Q + src[:, None] + c[None, :], mask=mq, other=0.0).to(tl.float32)
        x += tl.load(K + src[:, None] + c[None, :], mask=mk, other=0.0).to(tl.float32)
        xp = tl.load(Q + src[:, None] + partner[None, :], mask=mq, other=0.0).to(tl.float32)
        xp += tl.load(K + src[:, None] + partner[None, :], mask=mk, other=0.0).to(tl.float32)
        # RMSNorm as kernels/norms.py computes it (same reduction over the whole row)
        var = tl.sum(x * x, axis=1) / D
        rstd = 1.0 / tl.sqrt(var + tl.where(is_q, eps_q, eps_k))
        wq = tl.load(WQ + c, mask=cm, other=0.0).to(tl.float32) + offset
        wk = tl.load(WK + c, mask=cm, other=0.0).to(tl.float32) + offset
        wqp = tl.load(WQ + partner, mask=cm, other=0.0).to(tl.float32) + offset
        wkp = tl.load(WK + partner, mask=cm, other=0.0).to(tl.float32) + offset
        w = tl.where(is_q[:, None], wq[None, :], wk[None, :])
        wp = tl.where(is_q[:, None], wqp[None, :], wkp[None, :])
        dt = QO.dtype.element_ty
        xh = x * rstd[:, None]
        xhp = xp * rstd[:, None]
        if CAST_BEFORE_W:  # Llama: round the normalized value, then one rounded product
            y = (w * xh.to(dt).to(tl.float32)).to(dt).to(tl.float32)
            yp = (wp * xhp.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        else:  # Gemma: product in fp32, rounded once
            y = (xh * w).to(dt).to(tl.float32)
            yp = (xhp * wp).to(dt).to(tl.float32)
        # rope: (y * cos) + (rotate_half(y) * sin), each op rounded to the model dtype like torch does. The
        # launch turns FP contraction off: with it, LLVM fuses one product into the add (fma.rn.f16 / .bf16
        # in the PTX), a rounding torch and the rope kernel do not skip.
        cs = tl.load(COS + b * sc_b + s * sc_s + c, mask=rot, other=0.0).to(tl.float32)
        sn = tl.load(SIN + b * sc_b + s * sc_s + c, mask=rot, other=0.0).to(tl.float32)
        yp = tl.where((c < half)[None, :], -yp, yp)
        o = (y * cs[None, :]).to(dt).to(tl.float32) + (yp * sn[None, :]).to(dt).to(tl.float32)
        o = tl.where(rot[None, :], o, y)
        tl.store(QO + dst[:, None] + c[None, :], o.to(dt), mask=mq)
        tl.store(KO + dst[:, None] + c[None, :], o.to(dt), mask=mk)


def _check(q, k, wq, wk, cos, sin) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must be [B, S, H, D]")
    B, S, _, D = q.shape
    if k.shape[0] != B or k.shape[1] != S or k.shape[3] != D:
        raise ValueError(f"qk_norm_rope: q {tuple(q.shape)} and k {tuple(k.shape)} do not fit")
    if wq.shape != (D,) or wk.shape != (D,):
        raise ValueError(f"qk_norm_rope: norm weights {tuple(wq.shape)}, {tuple(wk.shape)} must be [{D}]")
    if cos.dim() != 3 or cos.shape != sin.shape:
        raise ValueError(f"qk_norm_rope: cos {tuple(cos.shape)}, sin {tuple(sin.shape)} must be one [1|B, S, R]")
    R = cos.shape[-1]
    if R > D or R % 2 or cos.shape[1] != S or cos.shape[0] not in (1, B):
        raise ValueError(f"qk_norm_rope: cos/sin {tuple(cos.shape)} do not fit q {tuple(q.shape)}")


def kernel_fits(q, k, wq, wk, cos, sin, cast_before_weight) -> bool:
    """The dtype mixes and layouts the kernel reproduces exactly: those the rope and rmsnorm kernels take."""
    return (
        triton_installed()
        and rope_fits(q, k, cos, sin)
        and norm_dtypes_ok(q, wq, None, cast_before_weight)
        and norm_dtypes_ok(k, wk, None, cast_before_weight)
    )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps_q: float,
    eps_k: float,
    *,
    offset: float = 0.0,
    cast_before_weight: bool = True,
    impl: str = "auto",
):
    """rope(rmsnorm(q, wq), rmsnorm(k, wk)) as (q_out, k_out), contiguous [B, S, H, D].

    impl: "auto" (the kernel for GPU tensors it fits, else the unfused ops), "ref" (the reference),
    "triton" (the kernel or an error; the interpreter tests use it on the CPU).
    """
    _check(q, k, wq, wk, cos, sin)
    kw = {"offset": offset, "cast_before_weight": cast_before_weight}
    if impl == "ref":
        return qk_norm_rope_ref(q, k, wq, wk, cos, sin, eps_q, eps_k, **kw)
    if impl == "auto" and (_is_compiling() or not triton_on_gpu(q.device)):
        return _unfused(q, k, wq, wk, cos, sin, eps_q, eps_k, kw)
    if kernel_fits(q, k, wq, wk, cos, sin, cast_before_weight):
        return _launch(q, k, wq, wk, cos, sin, eps_q, eps_k, offset, cast_before_weight)
    if impl == "triton":
        raise ValueError(
            f"qk_norm_rope: the Triton kernel cannot run q {q.dtype} {tuple(q.stride())}, k {k.dtype}, "
            f"weights {wq.dtype}/{wk.dtype}, cos {cos.dtype}"
            f"{'' if triton_installed() else ' (triton is not installed)'}"
        )
    return _unfused(q, k, wq, wk, cos, sin, eps_q, eps_k, kw)


def _unfused(q, k, wq, wk, cos, sin, eps_q, eps_k, kw):
    """Today's two steps through the public ops (under torch.compile each follows its own compile_mode,
    so inductor fuses the references by default)."""
    return rope(rmsnorm(q, wq, eps_q, **kw), rmsnorm(k, wk, eps_k, **kw), cos, sin)


def _launch(q, k, wq, wk, cos, sin, eps_q, eps_k, offset, cast_before_weight):
    signature = (*(tensor_signature(t) for t in (q, k, wq, wk, cos, sin)), eps_q, eps_k, offset, cast_before_weight)
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    R = cos.shape[-1]
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    wq, wk = wq.contiguous(), wk.contiguous()
    qo = _empty((B, S, HQ, D), q)
    ko = _empty((B, S, HKV, D), k)
    if B * S == 0:
        return qo, ko
    block_d = triton.next_power_of_2(D)
    block_h = max(1, min(16, triton.next_power_of_2(HQ + HKV), 4096 // block_d))
    grid = (B * S, triton.cdiv(HQ + HKV, block_h))
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    cached_launch(
        _PLANS, signature, _qk_norm_rope_kernel, grid,
        q, k, wq, wk, cos, sin, qo, ko,
        S, HQ, HKV, D, R, float(eps_q), float(eps_k), float(offset),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), sc_b, cos.stride(1),
        CAST_BEFORE_W=bool(cast_before_weight), BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2, enable_fp_fusion=False, **_pdl_kwargs(q.device),
    )  # fmt: skip
    return qo, ko
