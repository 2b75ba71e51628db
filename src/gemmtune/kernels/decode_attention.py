"""Decode attention in one launch: a few query tokens against a long KV cache, split over the keys.

out[b, l, h] = softmax_j(q[b, h, l] . k[b, h // n_rep, j] * scale + mask) @ v[b, h // n_rep]

for L <= MAX_Q query tokens, the keys j a boolean [B|1, 1, L, >=S] mask (transformers') lets query l see,
or every key without a mask. A program takes one (batch, KV head) and a run of key blocks: the n_rep
query heads of the KV group and their L tokens are the rows of one tile (each key block is read once
for all of them), with an online softmax (fp32 row max, sum and accumulator). Each program stores its
partial (accumulator, max, sum); the last program of a (batch, KV head) to arrive (counted on an int32
counter that is zero between calls and re-armed by that program) merges the splits and writes the
output rows, [B, L, Hq, D] contiguous (the layout transformers' attention functions return). One launch
where SDPA with a boolean mask makes four or five (the mask turned additive: two fills and a where; the
attention; cuDNN's split reduction). A row that sees no key gives 0. No host sync: CUDA-graph capturable.

`decode_attention_ref` is the same function in plain PyTorch with fp32 math.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, tl, triton
from ._common import empty_out as _empty
from .launch import Plans, cached_launch, tensor_signature

MAX_Q = 16  # query tokens a call may have (decode, speculative decoding)
MAX_HEAD_DIM = 256
MAX_ROWS = 128  # n_rep * L rows of one program's tile
BLOCK_S = 64  # keys per block
_PLANS = Plans()  # the kernel's launches, per signature
TARGET_PROGRAMS = 132  # one per SM of an H100: how far a call is split over its keys
MAX_SPLITS = 8  # the merging program reads every split's partial in turn


def decode_attention_ref(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [B, Hq, L, D], k / v [B, Hkv, S, D] (Hq a multiple of Hkv), mask None or bool [B|1, 1, L, >=S]
    (True: seen) -> [B, L, Hq, D] in q's dtype; fp32 math; a row that sees no key gives 0."""
    B, Hq, L, _ = q.shape
    n_rep = Hq // k.shape[1]
    kk = k.float().repeat_interleave(n_rep, dim=1)
    vv = v.float().repeat_interleave(n_rep, dim=1)
    s = torch.matmul(q.float(), kk.transpose(2, 3)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[..., : k.shape[2]], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, vv).transpose(1, 2).contiguous().to(q.dtype)


def takes(q, k, v, mask) -> str:
    """Why decode_attention cannot compute this call ("" when it can)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not [B, H, L|S, D] with k, v alike"
    B, Hq, L, D = q.shape
    if k.shape[0] != B or k.shape[3] != D or Hq % k.shape[1]:
        return f"q {tuple(q.shape)} does not fit k {tuple(k.shape)}"
    if not 1 <= L <= MAX_Q or D > MAX_HEAD_DIM or (Hq // k.shape[1]) * L > MAX_ROWS:
        return f"{L} query tokens x {Hq // k.shape[1]} heads per KV head, head size {D}: beyond the decode kernel"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes differ: q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if mask is not None:
        shape_ok = mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1 and mask.shape[2] == L
        if mask.dtype != torch.bool or not shape_ok or mask.shape[3] < k.shape[2]:
            return f"mask {mask.dtype} {tuple(mask.shape)} is not a boolean [B|1, 1, {L}, >={k.shape[2]}] mask"
    return ""


def splits_for(batch_heads: int, keys: int) -> int:
    """Programs per (batch, KV head): enough for TARGET_PROGRAMS in all, at most one per key block and
    MAX_SPLITS."""
    return max(1, min(triton.cdiv(keys, BLOCK_S), triton.cdiv(TARGET_PROGRAMS, batch_heads), MAX_SPLITS))


if HAS_TRITON:

    @triton.jit
    def softmax_step(s, seen, m_i, l_i):
        """One key block of an online softmax: the scores `s` where `seen`, the running row max `m_i` and sum
        `l_i` -> (probabilities, the factor for what was accumulated, the new max, the new sum). A row with
        nothing seen yet stays at 0."""
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)

    @triton.jit
    def merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, unit, split, splits, ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
        """A split program's end: store its partial ([accumulator, max, sum] per row, in L2 (.cg)) and count
        itself in on `unit`'s counter; the last of the `splits` to arrive merges them in one pass (an online
        softmax over the partials), re-arms the counter and gets (True, the normalized rows), the others
        (False, zeros)."""
        r = tl.arange(0, ROWS)
        d = tl.arange(0, BLOCK_D)
        prow = part_ptr + ((unit * splits + split) * ROWS + r).to(tl.int64) * (BLOCK_D + 2)
        tl.store(prow[:, None] + d[None, :], acc, cache_modifier=".cg")
        tl.store(prow + BLOCK_D, m_i, cache_modifier=".cg")
        tl.store(prow + BLOCK_D + 1, l_i, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is stored before one thread counts the program in
        arrived = tl.atomic_add(lock_ptr + unit, 1, sem="acq_rel", scope="gpu")
        last = arrived == splits - 1
        out = tl.zeros((ROWS, BLOCK_D), tl.float32)
        if last:
            m_all = tl.full((ROWS,), float("-inf"), tl.float32)
            total = tl.zeros((ROWS,), tl.float32)
            for i in range(0, splits):
                pi = part_ptr + ((unit * splits + i) * ROWS + r).to(tl.int64) * (BLOCK_D + 2)
                m_s = tl.load(pi + BLOCK_D, cache_modifier=".cg")
                l_s = tl.load(pi + BLOCK_D + 1, cache_modifier=".cg")
                a_s = tl.load(pi[:, None] + d[None, :], cache_modifier=".cg")
                m_new = tl.maximum(m_all, m_s)
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                old_w = tl.exp(m_all - m_use)
                new_w = tl.exp(m_s - m_use)
                total = total * old_w + l_s * new_w
                out = out * old_w[:, None] + a_s * new_w[:, None]
                m_all = m_new
            out = out / tl.where(total > 0, total, 1.0)[:, None]
            tl.atomic_xchg(lock_ptr + unit, 0, sem="relaxed", scope="gpu")  # re-armed for the next call
        return last, out

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, part_ptr, lock_ptr, Hkv, L, S, D, n_rep,
                                 blocks_per_split, splits, scale, sq_b, sq_h, sq_l, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b,
                                 sv_h, sv_s, sv_d, sm_b, sm_l, sm_s, so_b, so_l, so_h, HAS_MASK: tl.constexpr,
                                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                                 PREC: tl.constexpr):  # fmt: skip
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = (bh // Hkv).to(tl.int64)
        hk = (bh % Hkv).to(tl.int64)
        r = tl.arange(0, ROWS)
        row_ok = r < n_rep * L
        h = hk * n_rep + (r // L)
        lq = r % L
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(q_ptr + b * sq_b + h[:, None] * sq_h + lq[:, None] * sq_l + d[None, :] * sq_d,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, BLOCK_D), tl.float32)
        start = split * blocks_per_split * BLOCK_S
        end = tl.minimum(S, start + blocks_per_split * BLOCK_S)
        k_base = k_ptr + b * sk_b + hk * sk_h
        v_base = v_ptr + b * sv_b + hk * sv_h
        for s0 in range(start, end, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            c_ok = cols < end
            kt = tl.load(k_base + cols[None, :] * sk_s + d[:, None] * sk_d, mask=c_ok[None, :] & d_ok[:, None],
                         other=0.0)  # fmt: skip
            s = tl.dot(q, kt, input_precision=PREC) * scale
            seen = row_ok[:, None] & c_ok[None, :]
            if HAS_MASK:
                mk = tl.load(m_ptr + b * sm_b + lq[:, None] * sm_l + cols[None, :] * sm_s, mask=seen, other=0)
                seen = seen & (mk != 0)
            p, alpha, m_new, l_i = softmax_step(s, seen, m_i, l_i)
            vt = tl.load(v_base + cols[:, None] * sv_s + d[None, :] * sv_d, mask=c_ok[:, None] & d_ok[None, :],
                         other=0.0)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
            m_i = m_new
        last, out = merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, bh, split, splits, ROWS, BLOCK_D)
        if last:
            o = o_ptr + b * so_b + lq[:, None] * so_l + h[:, None] * so_h + d[None, :]
            tl.store(o, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def decode_attention(q, k, v, mask, scale: float, counters: torch.Tensor, check: bool = True) -> torch.Tensor:
    """decode_attention_ref in one Triton launch; `counters`: int32, zero, at least B * Hkv elements (its
    programs count their arrivals there and leave them zero). check=False: the caller has had takes()
    say "" for these tensors."""
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if check:
        why = takes(q, k, v, mask)
        if why:
            raise ValueError(f"decode_attention: {why}")
        if counters.dtype != torch.int32 or counters.numel() < B * Hkv:
            raise ValueError(f"decode_attention: counters must be int32 with >= {B * Hkv} elements")
    out = _empty((B, L, Hq, D), q)
    if B * Hq * L == 0:
        return out
    rows = max(16, triton.next_power_of_2(Hq // Hkv * L))
    block_d = max(16, triton.next_power_of_2(D))
    blocks = triton.cdiv(max(S, 1), BLOCK_S)
    blocks_per_split = triton.cdiv(blocks, splits_for(B * Hkv, max(S, 1)))
    splits = triton.cdiv(blocks, blocks_per_split)  # no empty split
    part = torch.empty(B * Hkv * splits * rows * (block_d + 2), device=q.device, dtype=torch.float32)
    ms = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3)) if mask is not None else (0,) * 3
    signature = (tuple(tensor_signature(t) for t in (q, k, v, mask)), float(scale))
    cached_launch(
        _PLANS, signature, _decode_attention_kernel, (B * Hkv, splits),
        q, k, v, q if mask is None else mask, out, part, counters, Hkv, L, S, D, Hq // Hkv, blocks_per_split,
        splits, float(scale), *q.stride(), *k.stride(), *v.stride(), *ms, out.stride(0), out.stride(1),
        out.stride(2), HAS_MASK=mask is not None, ROWS=rows, BLOCK_D=block_d, BLOCK_S=BLOCK_S,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    return out
