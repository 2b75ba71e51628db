"""Rotary position embedding for q and k in one Triton launch, with the plain-PyTorch reference.

Layout is the fused-projection one: q [B, S, Hq, D] and k [B, S, Hkv, D] (views into the qkv GEMM
output are read in place), cos/sin [B or 1, S, R] with R <= D (partial rotary: the last D - R
features pass through). Outputs are contiguous [B, S, H, D]. Rounding follows transformers'
`(x * cos) + (rotate_half(x) * sin)`: each product and the sum are rounded to the input dtype.
Under torch.compile `rope` follows compile_mode: the reference (fused by inductor) or the custom op
`gemmtune::rope`.
"""

from __future__ import annotations

import torch

from ..device import triton_installed, triton_on_gpu
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401 - re-exported, kernels
from ._common import KERNEL_DTYPES as _KERNEL_DTYPES
from ._common import empty_out as _empty
from ._common import pdl_kwargs as _pdl_kwargs
from .compile_mode import compile_impl
from .launch import Plans, cached_launch, tensor_signature

_is_compiling = torch.compiler.is_compiling
_PLANS = Plans()  # the kernel's launches, per signature


def _rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The last dimension's pairs (x0, x1), (x2, x3), ... as [x0, x2, ..., x1, x3, ...]: what transformers'
    apply_rotary_pos_emb_interleave (DeepSeek's rope_interleave) does before the plain rotation."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False):
    """transformers' apply_rotary_pos_emb on [B, S, H, D] tensors (partial rotary included); interleaved:
    its apply_rotary_pos_emb_interleave (full rotary), the output in the de-interleaved order it returns."""
    if interleaved:
        q, k = deinterleave(q), deinterleave(k)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    r = cos.shape[-1]
    out = []
    for x in (q, k):
        if r == x.shape[-1]:
            out.append((x * cos) + (_rotate_half(x) * sin))
        else:
            xr, xp = x[..., :r], x[..., r:]
            out.append(torch.cat([(xr * cos) + (_rotate_half(xr) * sin), xp], dim=-1))
    return out[0], out[1]


if HAS_TRITON:

    @triton.jit
    def head_rows(S, HQ, HKV, D, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, BLOCK_H: tl.constexpr):
        """Program (b * S + s, head block)'s rows: a block may mix q heads and k heads, so each row
        says which it is, where it is read (strided views) and written (contiguous [B, S, H, D])."""
        tok = tl.program_id(0).to(tl.int64)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        b = tok // S
        s = tok % S
        is_q = heads < HQ
        is_k = (heads >= HQ) & (heads < HQ + HKV)
        kh = tl.where(is_q, 0, heads - HQ)
        src = tl.where(is_q, b * sq_b + s * sq_s + heads * sq_h, b * sk_b + s * sk_s + kh * sk_h)
        dst = tl.where(is_q, (tok * HQ + heads) * D, (tok * HKV + kh) * D)
        return b, s, is_q, is_k, src, dst

    @triton.jit
    def _rope_kernel(
        Q, K, COS, SIN, QO, KO,
        S, HQ, HKV, D, R,
        sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sc_b, sc_s, soq_b, soq_s, soq_h,
        BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False,
        INTERLEAVED: tl.constexpr = False,
    ):  # fmt: skip
        if PDL:  # the next kernel may start now; q and k come from the GEMM before this one
            gdc_launch_dependents()
            gdc_wait()
        b, s, is_q, is_k, src, dst = head_rows(S, HQ, HKV, D, sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, BLOCK_H)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        qdst = b * soq_b + s * soq_s + tl.where(is_q, heads, 0) * soq_h  # q's output may be any [B, S, H, D] view
        half = R // 2
        j = tl.arange(0, HALF)
        jm = j < half
        c1 = tl.load(COS + b * sc_b + s * sc_s + j, mask=jm, other=0.0).to(tl.float32)
        c2 = tl.load(COS + b * sc_b + s * sc_s + half + j, mask=jm, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + b * sc_b + s * sc_s + j, mask=jm, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + b * sc_b + s * sc_s + half + j, mask=jm, other=0.0).to(tl.float32)
        mq = is_q[:, None] & jm[None, :]
        mk = is_k[:, None] & jm[None, :]
        # a block mixes q heads and k heads: each element comes from exactly one of the two loads;
        # interleaved, the halves are the even and the odd features (deinterleave)
        i1 = 2 * j if INTERLEAVED else j
        i2 = 2 * j + 1 if INTERLEAVED else half + j
        x1 = tl.load(Q + src[:, None] + i1[None, :], mask=mq, other=0.0).to(tl.float32)
        x1 += tl.load(K + src[:, None] + i1[None, :], mask=mk, other=0.0).to(tl.float32)
        x2 = tl.load(Q + src[:, None] + i2[None, :], mask=mq, other=0.0).to(tl.float32)
        x2 += tl.load(K + src[:, None] + i2[None, :], mask=mk, other=0.0).to(tl.float32)
        dt = QO.dtype.element_ty
        # (x * cos) + (rotate_half(x) * sin), each op rounded to the model dtype like torch does
        o1 = (x1 * c1[None, :]).to(dt).to(tl.float32) + (-x2 * s1[None, :]).to(dt).to(tl.float32)
        o2 = (x2 * c2[None, :]).to(dt).to(tl.float32) + (x1 * s2[None, :]).to(dt).to(tl.float32)
        tl.store(QO + qdst[:, None] + j[None, :], o1.to(dt), mask=mq)
        tl.store(QO + qdst[:, None] + half + j[None, :], o2.to(dt), mask=mq)
        tl.store(KO + dst[:, None] + j[None, :], o1.to(dt), mask=mk)
        tl.store(KO + dst[:, None] + half + j[None, :], o2.to(dt), mask=mk)
        if BLOCK_P > 0:  # partial rotary: copy the features past R
            p = R + tl.arange(0, BLOCK_P)
            pm = p < D
            xq = tl.load(Q + src[:, None] + p[None, :], mask=is_q[:, None] & pm[None, :], other=0.0)
            xk = tl.load(K + src[:, None] + p[None, :], mask=is_k[:, None] & pm[None, :], other=0.0)
            tl.store(QO + qdst[:, None] + p[None, :], xq, mask=is_q[:, None] & pm[None, :])
            tl.store(KO + dst[:, None] + p[None, :], xk, mask=is_k[:, None] & pm[None, :])


def _heads_view_ok(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.stride(-1) == 1


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "auto",
         interleaved: bool = False, out_q: torch.Tensor | None = None):  # fmt: skip
    """(q_rot, k_rot), contiguous [B, S, H, D]; q [B, S, Hq, D], k [B, S, Hkv, D], cos/sin [b, S, R].
    interleaved: rope_ref's interleaved form (full rotary only; not under torch.compile's custom op).
    out_q: a [B, S, Hq, D] view (unit last stride) q_rot is written to and returned as; it may be q itself."""
    B, S, HQ, D = q.shape
    if k.shape[0] != B or k.shape[1] != S or k.shape[3] != D or cos.shape != sin.shape or cos.dim() != 3:
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} do not fit")
    R = cos.shape[-1]
    if R > D or R % 2 or cos.shape[1] != S or cos.shape[0] not in (1, B):
        raise ValueError(f"rope: cos/sin {tuple(cos.shape)} do not fit q {tuple(q.shape)} (need [1|B, S, R<=D])")
    if interleaved and R != D:
        raise ValueError(f"rope: interleaved rotary needs R == D, got cos {tuple(cos.shape)}, q {tuple(q.shape)}")
    if out_q is not None and (out_q.shape != q.shape or out_q.dtype != q.dtype or out_q.stride(-1) != 1):
        raise ValueError(f"rope: out_q {out_q.dtype} {tuple(out_q.shape)} is not a {q.dtype} {tuple(q.shape)} view "
                         "with a unit last stride")  # fmt: skip
    ok = triton_installed() and kernel_fits(q, k, cos, sin)
    if impl == "auto" and _is_compiling():
        qo, ko = rope_ref(q, k, cos, sin, interleaved) if interleaved or out_q is not None else _traced(q, k, cos, sin)
    elif impl == "ref" or (impl == "auto" and not (ok and triton_on_gpu(q.device))):
        qo, ko = rope_ref(q, k, cos, sin, interleaved)
    elif not ok:
        raise ValueError(f"rope: the Triton kernel cannot run q {q.dtype} {tuple(q.stride())}, cos {cos.dtype}")
    else:
        return _launch(q, k, cos, sin, interleaved, out_q)
    return (qo if out_q is None else out_q.copy_(qo)), ko


def kernel_fits(q, k, cos, sin) -> bool:
    return (
        q.dtype in _KERNEL_DTYPES
        and k.dtype == q.dtype
        and cos.dtype == q.dtype
        and sin.dtype == q.dtype
        and _heads_view_ok(q)
        and _heads_view_ok(k)
    )


def _launch(q, k, cos, sin, interleaved: bool = False, out_q: torch.Tensor | None = None):
    signature = (tuple(tensor_signature(t) for t in (q, k, cos, sin, out_q)), interleaved)
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    R = cos.shape[-1]
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride() != cos.stride():
        sin = sin.contiguous()
        cos = cos.contiguous()
    qo = _empty((B, S, HQ, D), q) if out_q is None else out_q
    ko = _empty((B, S, HKV, D), k)
    if B * S == 0:
        return qo, ko
    block_h = min(16, triton.next_power_of_2(HQ + HKV))
    half = max(1, triton.next_power_of_2(R // 2))
    block_p = 0 if R == D else triton.next_power_of_2(D - R)
    grid = (B * S, triton.cdiv(HQ + HKV, block_h))
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    cached_launch(
        _PLANS, signature, _rope_kernel, grid,
        q, k, cos, sin, qo, ko,
        S, HQ, HKV, D, R,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), sc_b, cos.stride(1),
        qo.stride(0), qo.stride(1), qo.stride(2), BLOCK_H=block_h, HALF=half, BLOCK_P=block_p, INTERLEAVED=interleaved,
        num_warps=4 if block_h * half >= 512 else 2,
        enable_fp_fusion=False,  # every product rounded, as torch rounds it (qk_norm_rope.py)
        **_pdl_kwargs(q.device),
    )  # fmt: skip
    return qo, ko


# ---- torch.compile -------------------------------------------------------------------------------
def _traced(q, k, cos, sin):
    """The custom op (mode "op", kernel layouts, no gradient needed: it has no backward) or the
    reference for inductor to fuse."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin))
    if compile_impl("rope") == "op" and kernel_fits(q, k, cos, sin) and not grad:
        return torch.ops.gemmtune.rope(q, k, cos, sin)
    return rope_ref(q, k, cos, sin)


@torch.library.custom_op("gemmtune::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_on_gpu(q.device):
        return _launch(q, k, cos, sin)
    qo, ko = rope_ref(q, k, cos, sin)
    return qo.contiguous(), ko.contiguous()


@_rope_op.register_fake
def _rope_fake(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)
