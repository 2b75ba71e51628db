"""A static KV cache's update in one launch: what transformers' StaticLayer.update does in five
(arange + the cache length, the length's in-place add, two index_copy_).

static_write(keys, values, k, v, length, arrivals): keys / values (B, H, S, D) are the cache, k / v
(B, H, L, D) the new states (any strides), length a one-element int64 tensor holding how many positions
are filled. Positions length .. length + L - 1 get k and v, and length grows by L. Every program reads
the length first; the last one to arrive (counted on `arrivals`, an int32 tensor that is zero between
calls) writes the new length, so no program can read it already moved on. Positions at or past S are not
written (where index_copy_ would fail with a device-side assert). Nothing is synchronized with the host:
the launch can be captured in a CUDA graph and replayed.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, tl, triton
from .launch import Plans, cached_launch, tensor_signature

BLOCK_T = 16  # new positions a program writes
_PLANS = Plans()  # the kernel's launches, per signature


def static_write_ref(keys, values, k, v, length) -> None:
    """What transformers' StaticLayer.update does (the reference)."""
    pos = torch.arange(k.shape[2], device=keys.device) + length
    length.add_(k.shape[2])
    keys.index_copy_(2, pos, k)
    values.index_copy_(2, pos, v)


if HAS_TRITON:

    @triton.jit
    def _static_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, len_ptr, arrivals_ptr, H, L, S, DK, DV,
                             sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, skc_b, skc_h, skc_t, skc_d,
                             svc_b, svc_h, svc_t, svc_d, BLOCK_T: tl.constexpr,
                             BLOCK_D: tl.constexpr):  # fmt: skip
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        pos = tl.load(len_ptr)
        dst = pos + t
        rows = ((t < L) & (dst < S))[:, None]
        t64 = t.to(tl.int64)[:, None]
        d64 = d.to(tl.int64)[None, :]
        ok = rows & (d < DK)[None, :]
        x = tl.load(k_ptr + b * sk_b + h * sk_h + t64 * sk_t + d64 * sk_d, mask=ok)
        tl.store(kc_ptr + b * skc_b + h * skc_h + dst[:, None] * skc_t + d64 * skc_d, x, mask=ok)
        ok = rows & (d < DV)[None, :]
        y = tl.load(v_ptr + b * sv_b + h * sv_h + t64 * sv_t + d64 * sv_d, mask=ok)
        tl.store(vc_ptr + b * svc_b + h * svc_h + dst[:, None] * svc_t + d64 * svc_d, y, mask=ok)
        tl.debug_barrier()  # every thread has read the length before the program counts itself in
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.store(len_ptr, pos + L)
            tl.atomic_xchg(arrivals_ptr, 0, sem="relaxed", scope="gpu")  # re-armed for the next call


def write_reason(keys, values, k, v, length) -> str:
    """Why static_write cannot take these tensors ("" when it can): shapes, dtypes, devices."""

    def shapes() -> str:
        return f"cache {tuple(keys.shape)} / {tuple(values.shape)}, states {tuple(k.shape)} / {tuple(v.shape)}"

    if keys.dim() != 4 or values.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"{shapes()}: all must be 4-D"
    B, H, S, _ = keys.shape
    if tuple(values.shape[:3]) != (B, H, S) or tuple(k.shape[:2]) != (B, H) or v.shape[:3] != k.shape[:3]:
        return f"{shapes()}: the states do not fit the cache"
    if k.shape[3] != keys.shape[3] or v.shape[3] != values.shape[3]:
        return f"head sizes differ: cache {keys.shape[3]}/{values.shape[3]}, states {k.shape[3]}/{v.shape[3]}"
    if k.dtype != keys.dtype or v.dtype != values.dtype:
        return f"dtypes differ: cache {keys.dtype}/{values.dtype}, states {k.dtype}/{v.dtype}"
    if length.dtype != torch.int64 or length.numel() != 1:
        return f"length must be one int64, got {length.dtype} with {length.numel()} elements"
    if len({t.device for t in (keys, values, k, v, length)}) != 1:
        return "the tensors are on different devices"
    return ""


def static_write(keys, values, k, v, length, arrivals, check: bool = True) -> None:
    """static_write_ref in one Triton launch (module doc); `arrivals` int32, zero, at least one element.
    check=False: the caller has had write_reason say "" for these tensors."""
    if check:
        reason = write_reason(keys, values, k, v, length)
        if reason:
            raise ValueError(f"static_write: {reason}")
    B, H, S, DK = keys.shape
    L, DV = k.shape[2], values.shape[3]
    if L == 0 or B * H == 0:
        return
    grid = (B * H, triton.cdiv(L, BLOCK_T))
    signature = tuple(tensor_signature(t) for t in (keys, values, k, v))
    cached_launch(_PLANS, signature, _static_write_kernel, grid, k, v, keys, values, length, arrivals, H, L, S, DK,
                  DV, *k.stride(), *v.stride(), *keys.stride(), *values.stride(), BLOCK_T=BLOCK_T,
                  BLOCK_D=triton.next_power_of_2(max(DK, DV)), num_warps=1)  # fmt: skip
