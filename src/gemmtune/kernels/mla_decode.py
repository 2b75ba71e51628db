"""Multi-head latent attention (DeepSeek-V2/V3) in decode: every query head against one shared latent cache.

out[b, l, h] = softmax_j((q_lat[b, h, l] . c[b, j] + q_rot[b, h, l] . r[b, j]) * scale + mask) @ c[b]

with c the latent cache [B, S, R] (kv_a_layernorm of the compressed KV) and r the roped shared key
[B, S, dr]; q_lat is the query with kv_b_proj's key rows absorbed (models/mla.py). The values are the
latents themselves, so the output stays in the latent space (R wide) until the caller applies the
value rows. For L <= MAX_Q query tokens, with transformers' boolean [B|1, 1, L, >=S] mask or, for one
token, none.

A program takes one batch row, a block of ROWS (head, query token) rows and a run of key blocks, with
an online softmax (fp32 scores, max, sum and accumulator; the probabilities meet the latents in the model
dtype, as flash attention's do). The last program of a (batch, head block) to arrive
merges the splits (decode_attention.py's scheme: an int32 counter, zero between calls, re-armed by
that program; decode_attention.merge_splits). No host sync: CUDA-graph capturable.

`mla_decode_ref` is the same function in plain PyTorch with fp32 math.
"""

from __future__ import annotations

import torch

from ._common import HAS_TRITON, tl, triton
from ._common import empty_out as _empty
from .launch import Plans, cached_launch, tensor_signature

if HAS_TRITON:
    from .decode_attention import merge_splits, softmax_step

MAX_Q = 16  # query tokens a call may have
MAX_LATENT = 512  # R the kernel's accumulator holds
MAX_ROPE = 128
ROWS = 16  # (head, token) rows of one program
BLOCK_S = 32  # keys per block
NUM_WARPS = 4
TARGET_PROGRAMS = 132  # one per SM of an H100: how far a call is split over its keys
MAX_SPLITS = 8  # the merging program reads every split's partial in turn
_PLANS = Plans()


def mla_decode_ref(q_lat, q_rot, latent, k_rot, mask, scale: float) -> torch.Tensor:
    """q_lat [B, H, L, R], q_rot [B, H, L, dr], latent [B, S, R], k_rot [B, S, dr], mask None or bool
    [B|1, 1, L, >=S] (True: seen) -> [B, L, H, R] in q_lat's dtype; fp32 math; a row that sees no key
    gives 0."""
    S = latent.shape[1]
    c = latent.float()
    s = (q_lat.float() @ c[:, None].transpose(2, 3) + q_rot.float() @ k_rot.float()[:, None].transpose(2, 3)) * scale
    if mask is not None:
        s = s.masked_fill(~mask[..., :S], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ c[:, None]).transpose(1, 2).contiguous().to(q_lat.dtype)


def takes(q_lat, q_rot, latent, k_rot, mask) -> str:
    """Why mla_decode cannot compute this call ("" when it can)."""
    return takes_shape(tuple(q_lat.shape), q_lat.dtype, q_rot, latent, k_rot, mask)


def takes_shape(q_lat_shape: tuple, dtype: torch.dtype, q_rot, latent, k_rot, mask) -> str:
    """takes() for a q_lat of this shape and dtype, before it is computed."""
    if len(q_lat_shape) != 4 or q_rot.dim() != 4 or latent.dim() != 3 or k_rot.dim() != 3:
        return (f"q_lat {tuple(q_lat_shape)}, q_rot {tuple(q_rot.shape)}, latent {tuple(latent.shape)}, k_rot "
                f"{tuple(k_rot.shape)} are not [B, H, L, R], [B, H, L, dr], [B, S, R], [B, S, dr]")  # fmt: skip
    B, H, L, R = q_lat_shape
    S, dr = latent.shape[1], k_rot.shape[2]
    if q_rot.shape[:3] != (B, H, L) or latent.shape != (B, S, R) or k_rot.shape[:2] != (B, S) or q_rot.shape[3] != dr:
        return (f"q_lat {tuple(q_lat_shape)}, q_rot {tuple(q_rot.shape)}, latent {tuple(latent.shape)} and k_rot "
                f"{tuple(k_rot.shape)} do not fit together")  # fmt: skip
    if not 1 <= L <= MAX_Q or R > MAX_LATENT or dr > MAX_ROPE:
        return f"{L} query tokens, latent {R}, rope {dr}: beyond the MLA decode kernel"
    if len({dtype, q_rot.dtype, latent.dtype, k_rot.dtype}) != 1:
        return f"dtypes differ: {dtype}, {q_rot.dtype}, {latent.dtype}, {k_rot.dtype}"
    if mask is None and L != 1:
        return f"{L} query tokens and no mask"
    if mask is not None:
        shape_ok = mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1 and mask.shape[2] == L
        if mask.dtype != torch.bool or not shape_ok or mask.shape[3] < S:
            return f"mask {mask.dtype} {tuple(mask.shape)} is not a boolean [B|1, 1, {L}, >={S}] mask"
    return ""


def head_blocks(heads: int, tokens: int) -> int:
    return triton.cdiv(heads * tokens, ROWS)


def counters_needed(batch: int, heads: int, tokens: int) -> int:
    """int32 arrival counters a call needs: one per (batch, head block)."""
    return batch * head_blocks(heads, tokens)


if HAS_TRITON:

    @triton.jit
    def _mla_decode_kernel(ql_ptr, qr_ptr, c_ptr, r_ptr, m_ptr, o_ptr, part_ptr, lock_ptr, HB, H, L, S, R, DR,
                           blocks_per_split, splits, scale, sql_b, sql_h, sql_l, sqr_b, sqr_h, sqr_l, sc_b, sc_s,
                           sr_b, sr_s, sm_b, sm_l, sm_s, so_b, so_l, so_h, HAS_MASK: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                           BLOCK_S: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        bhb = tl.program_id(0)
        split = tl.program_id(1)
        b = (bhb // HB).to(tl.int64)
        hb = bhb % HB
        idx = hb * ROWS + tl.arange(0, ROWS)  # (head, token) rows, token fastest
        row_ok = idx < H * L
        h = (idx // L).to(tl.int64)
        lq = (idx % L).to(tl.int64)
        d = tl.arange(0, BLOCK_R)
        d_ok = d < R
        e = tl.arange(0, BLOCK_DR)
        e_ok = e < DR
        ql = tl.load(ql_ptr + b * sql_b + h[:, None] * sql_h + lq[:, None] * sql_l + d[None, :],
                     mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        qr = tl.load(qr_ptr + b * sqr_b + h[:, None] * sqr_h + lq[:, None] * sqr_l + e[None, :],
                     mask=row_ok[:, None] & e_ok[None, :], other=0.0)  # fmt: skip
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        acc = tl.zeros((ROWS, BLOCK_R), tl.float32)
        start = split * blocks_per_split * BLOCK_S
        end = tl.minimum(S, start + blocks_per_split * BLOCK_S)
        for s0 in range(start, end, BLOCK_S):
            cols = s0 + tl.arange(0, BLOCK_S)
            c_ok = cols < end
            # the operands stay in the model dtype (a [BLOCK_S, R] tile in fp32 would not fit the registers)
            ct = tl.load(c_ptr + b * sc_b + cols[:, None] * sc_s + d[None, :], mask=c_ok[:, None] & d_ok[None, :],
                         other=0.0)  # fmt: skip
            rt = tl.load(r_ptr + b * sr_b + cols[None, :] * sr_s + e[:, None], mask=c_ok[None, :] & e_ok[:, None],
                         other=0.0)  # fmt: skip
            s = (tl.dot(ql, tl.trans(ct), input_precision=PREC) + tl.dot(qr, rt, input_precision=PREC)) * scale
            seen = row_ok[:, None] & c_ok[None, :]
            if HAS_MASK:
                mk = tl.load(m_ptr + b * sm_b + lq[:, None] * sm_l + cols[None, :] * sm_s, mask=seen, other=0)
                seen = seen & (mk != 0)
            p, alpha, m_new, l_i = softmax_step(s, seen, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(ct.dtype), ct, input_precision=PREC)
            m_i = m_new
        last, out = merge_splits(acc, m_i, l_i, part_ptr, lock_ptr, bhb, split, splits, ROWS, BLOCK_R)
        if last:
            o = o_ptr + b * so_b + lq[:, None] * so_l + h[:, None] * so_h + d[None, :]
            tl.store(o, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    """The kernel steps the last dimension by 1 (the cache and the projections' views already do)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def mla_decode(q_lat, q_rot, latent, k_rot, mask, scale: float, counters: torch.Tensor, check: bool = True,
               out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """mla_decode_ref in one Triton launch; `counters`: int32, zero, at least counters_needed(B, H, L)
    elements (its programs count their arrivals there and leave them zero). check=False: the caller has
    had takes() say "" for these tensors. out: a [B, L, H, R] tensor (any strides, the last 1) to write,
    e.g. a view of the [H, B, L, R] buffer the value projection reads per head."""
    B, H, L, R = q_lat.shape
    S, DR = latent.shape[1], k_rot.shape[2]
    if check:
        why = takes(q_lat, q_rot, latent, k_rot, mask)
        if why:
            raise ValueError(f"mla_decode: {why}")
        if counters.dtype != torch.int32 or counters.numel() < counters_needed(B, H, L):
            raise ValueError(f"mla_decode: counters must be int32 with >= {counters_needed(B, H, L)} elements")
        if out is not None and (out.shape != (B, L, H, R) or out.dtype != q_lat.dtype or out.stride(-1) != 1):
            raise ValueError(f"mla_decode: out {out.dtype} {tuple(out.shape)} is not a [B, L, H, R] {q_lat.dtype} "
                             "tensor with a unit last stride")  # fmt: skip
    out = _empty((B, L, H, R), q_lat) if out is None else out
    if B * H * L == 0:
        return out
    q_lat, q_rot, latent, k_rot = (_unit_last(t) for t in (q_lat, q_rot, latent, k_rot))
    hb = head_blocks(H, L)
    blocks = triton.cdiv(max(S, 1), BLOCK_S)
    want = max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, B * hb), MAX_SPLITS))
    blocks_per_split = triton.cdiv(blocks, want)
    splits = triton.cdiv(blocks, blocks_per_split)  # no empty split
    block_r = max(16, triton.next_power_of_2(R))
    block_dr = max(16, triton.next_power_of_2(DR))
    part = torch.empty(B * hb * splits * ROWS * (block_r + 2), device=q_lat.device, dtype=torch.float32)
    ms = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3)) if mask is not None else (0,) * 3
    signature = (tuple(tensor_signature(t) for t in (q_lat, q_rot, latent, k_rot, mask, out)), float(scale))
    cached_launch(
        _PLANS, signature, _mla_decode_kernel, (B * hb, splits),
        q_lat, q_rot, latent, k_rot, q_lat if mask is None else mask, out, part, counters, hb, H, L, S, R, DR,
        blocks_per_split, splits, float(scale), q_lat.stride(0), q_lat.stride(1), q_lat.stride(2), q_rot.stride(0),
        q_rot.stride(1), q_rot.stride(2), latent.stride(0), latent.stride(1), k_rot.stride(0), k_rot.stride(1), *ms,
        out.stride(0), out.stride(1), out.stride(2), HAS_MASK=mask is not None, ROWS=ROWS, BLOCK_R=block_r,
        BLOCK_DR=block_dr, BLOCK_S=BLOCK_S, PREC="ieee" if q_lat.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
