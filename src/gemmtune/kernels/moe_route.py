"""Routing glue of fused MoE in one Triton launch each: the top-k router, and the slots sorted by expert.

expert_sort: the slots (kernels/fused_moe.py: slot s = t * TK + j) sorted by local expert, stably
(an expert's slots in slot order), with the slots that have no local expert (-1 another rank's, -2 an
id out of range) last, in slot order:
  perm (S,) int64  slot at each sorted row          tok (S,) int64  its token, perm // TK
  inv  (S,) int64  sorted row of each slot          offs (E,) int32 cumulative end of each expert's rows
It reads the raw router ids (+ expert_map, + shared columns) as the Triton MoE kernels do, so no
local-id tensor is built. Each program owns a chunk of slots: it histograms every slot (to know where
each expert starts and how many of its slots come before the chunk), then ranks its own slots with a
one-hot prefix sum. No atomics, so the order is deterministic; sizes depend on (S, E) alone (no host
sync: capturable). expert_sort_torch is the same in torch ops (the fallback and the reference).

router_topk: what Hugging Face's Qwen3-MoE / Mixtral top-k routers compute from their logits:
softmax in fp32, the top k (largest first; among equal values the lower expert ids are picked, as
torch.topk picks them, and listed lowest first, where CUDA's topk lists them highest first: the block
sums its slots, so only which experts are picked matters), optionally renormalized to sum 1, cast to
out_dtype; ids int64. With `shared` > 0 (Qwen2-MoE's shared expert, split into `shared` slots of
fused_moe: models/moe_shared.py) the logits carry one more column, the shared expert's gate: the top k
is taken over the others, and each row gets `shared` more slots, experts E .. E + shared - 1, all
weighing sigmoid(gate logit).

grouped_router_topk: what DeepSeek-V3's and GLM-4-MoE's routers compute from their fp32 logits: sigmoid
scores; for choosing, the scores plus the correction bias; each of n_group groups scored by the sum of
its two best; the topk_group best groups kept, the other experts masked; the top k of what is left; the
weights are the chosen experts' scores without the bias, optionally divided by their sum (+1e-20), times
the routed scaling factor; fp32 weights, int64 ids, largest first (ties: the lower index).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._common import HAS_TRITON, tl, triton
from .fused_moe import Routing

if HAS_TRITON:
    from .fused_moe import slot_expert


class SortedSlots(NamedTuple):
    perm: torch.Tensor  # (S,) int64 slot at each sorted row
    tok: torch.Tensor  # (S,) int64 token of each sorted row (perm // TK)
    offs: torch.Tensor  # (E,) int32 end of each expert's rows
    inv: torch.Tensor  # (S,) int64 sorted row of each slot


def _alloc(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output allocation (tests swap in poisoned ones to prove every element is written)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- references / fallbacks -----------------------------------------------------------------------
def expert_offsets(ids_flat: torch.Tensor, num_experts: int):
    """Slots sorted by expert on the device: (perm, live_sorted (S, 1), offs (E,) int32 cumulative ends).
    Slots with no local expert (id < 0) sort last, past offs[-1], where torch._grouped_mm writes nothing."""
    e = torch.where(ids_flat >= 0, ids_flat.long(), num_experts)
    sorted_e, perm = torch.sort(e, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=e.device)
    counts.scatter_add_(0, e, torch.ones_like(e, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    return perm, (sorted_e < num_experts).unsqueeze(-1), offs


def expert_sort_torch(local_ids: torch.Tensor, num_experts: int) -> SortedSlots:
    """SortedSlots of local ids (T, TK) in [-2, E) (kernels/fused_moe.py), in torch ops."""
    perm, _, offs = expert_offsets(local_ids.reshape(-1), num_experts)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return SortedSlots(perm, perm // local_ids.shape[-1], offs, inv)


def router_topk_ref(logits: torch.Tensor, top_k: int, renorm: bool, out_dtype: torch.dtype, shared: int = 0):
    """(weights (T, k + shared) out_dtype, ids (T, k + shared) int64): the Hugging Face top-k router after
    its linear; with `shared`, logits (T, E + 1) end with the shared expert's gate (module doc)."""
    routed = logits[:, : logits.shape[1] - 1] if shared else logits
    probs = torch.softmax(routed.float(), dim=-1)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    if shared:
        gate = torch.sigmoid(logits[:, -1:].float()).expand(-1, shared)
        extra = torch.arange(routed.shape[1], routed.shape[1] + shared, device=ids.device).expand(ids.shape[0], -1)
        w, ids = torch.cat([w, gate], dim=1), torch.cat([ids, extra], dim=1)
    return w.to(out_dtype), ids


def group_scores(choice: torch.Tensor, n_group: int) -> torch.Tensor:
    """(T, n_group): each group of a (T, E) choice scored by the sum of its two best, as the routers do."""
    T, E = choice.shape
    return choice.reshape(T, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)


def grouping_reason(experts: int, n_group: int, topk_group: int, top_k: int) -> str | None:
    """Why the grouped router cannot pick `top_k` of `experts` from its best `topk_group` of `n_group`
    groups (each of at least two experts), or None."""
    if not (n_group >= 1 and experts % n_group == 0 and experts // n_group >= 2 and 1 <= topk_group <= n_group):
        return (f"{experts} experts must split into n_group={n_group} groups of at least 2, and "
                f"1 <= topk_group={topk_group} <= n_group")  # fmt: skip
    if not 1 <= top_k <= topk_group * (experts // n_group):
        return f"top_k={top_k} must be 1..{topk_group * (experts // n_group)} (the experts of {topk_group} groups)"
    return None


def grouped_router_topk_ref(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                            renorm: bool, scale: float):  # fmt: skip
    """(weights (T, k) fp32, ids (T, k) int64): the DeepSeek-V3 / GLM-4-MoE router after its linear, in
    the order torch.topk lists them (largest first)."""
    scores = logits.float().sigmoid()
    choice = scores + bias
    T, E = choice.shape
    best = group_scores(choice, n_group)
    groups = torch.topk(best, k=topk_group, dim=-1)[1]
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    ids = torch.topk(choice.masked_fill(~keep, float("-inf")), k=top_k, dim=-1)[1]
    w = scores.gather(1, ids)
    if renorm:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, ids


# ---- kernels --------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _bucket(slots, ids_ptr, map_ptr, n_slots, TK, TOPK, num_routed, num_local_routed, num_experts, stride_it,
                stride_ij, HAS_MAP: tl.constexpr, SPARE: tl.constexpr):  # fmt: skip
        """Sort key of each slot: its local expert, num_experts (no local expert), SPARE (past the end)."""
        valid = slots < n_slots
        e = slot_expert(slots, valid, ids_ptr, stride_it, stride_ij, map_ptr, TK, TOPK, num_routed,
                         num_local_routed, HAS_MAP)  # fmt: skip
        e = tl.where((e >= 0) & (e < num_experts), e, num_experts)
        return tl.where(valid, e, SPARE)

    @triton.jit
    def _expert_sort_kernel(ids_ptr, map_ptr, out_ptr, offs_ptr, n_slots, TK, TOPK, num_routed, num_local_routed,
                            num_experts, stride_it, stride_ij, HAS_MAP: tl.constexpr, BINS: tl.constexpr,
                            CHUNK: tl.constexpr, HIST: tl.constexpr, SUB: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        start = pid * CHUNK
        bins = tl.arange(0, BINS)
        # Pass 1: every slot's key; `before` counts the keys of the slots ahead of this chunk (the
        # others counted in the spare bin).
        total = tl.zeros((BINS,), dtype=tl.int32)
        before = tl.zeros((BINS,), dtype=tl.int32)
        for b in range(0, n_slots, HIST):
            slots = b + tl.arange(0, HIST)
            key = _bucket(slots, ids_ptr, map_ptr, n_slots, TK, TOPK, num_routed, num_local_routed, num_experts,
                          stride_it, stride_ij, HAS_MAP, BINS - 1)  # fmt: skip
            total += tl.histogram(key, BINS)
            before += tl.histogram(tl.where(slots < start, key, BINS - 1), BINS)
        ends = tl.cumsum(total, 0)
        if pid == 0:
            tl.store(offs_ptr + bins, ends, mask=bins < num_experts)
        # first sorted row of each key's slots in this chunk
        first = ends - total + before
        # Pass 2: this chunk's slots, SUB at a time: row = first[key] + rank among equal keys so far.
        for s0 in range(start, start + CHUNK, SUB):
            slots = s0 + tl.arange(0, SUB)
            key = _bucket(slots, ids_ptr, map_ptr, n_slots, TK, TOPK, num_routed, num_local_routed, num_experts,
                          stride_it, stride_ij, HAS_MAP, BINS - 1)  # fmt: skip
            hot = (key[:, None] == bins[None, :]).to(tl.int32)
            rank = tl.cumsum(hot, 0) - 1 + first[None, :]
            row = tl.sum(hot * rank, axis=1).to(tl.int64)
            first += tl.sum(hot, axis=0)
            ok = slots < n_slots
            slots64 = slots.to(tl.int64)
            tl.store(out_ptr + row, slots64, mask=ok)  # perm
            tl.store(out_ptr + n_slots + row, slots64 // TK, mask=ok)  # tok
            tl.store(out_ptr + 2 * n_slots + slots64, row, mask=ok)  # inv

    @triton.jit
    def _logit_rows(logits_ptr, T, E, stride_lt, stride_le, E_P2: tl.constexpr, BLOCK_T: tl.constexpr):
        """This program's BLOCK_T rows of logits in fp32 (0 past T and E), with their row / column indices."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, E_P2)
        row_ok = rows < T
        col_ok = cols < E
        rows64 = rows.to(tl.int64)
        x = tl.load(logits_ptr + rows64[:, None] * stride_lt + cols[None, :] * stride_le,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # fmt: skip
        return x, rows64, cols, row_ok, col_ok

    @triton.jit
    def _router_topk_kernel(logits_ptr, w_ptr, ids_ptr, T, E, stride_lt, stride_le, K: tl.constexpr,
                            K_P2: tl.constexpr, E_P2: tl.constexpr, BLOCK_T: tl.constexpr,
                            RENORM: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
        x, rows64, cols, row_ok, col_ok = _logit_rows(logits_ptr, T, E, stride_lt, stride_le, E_P2, BLOCK_T)
        x = tl.where(col_ok[None, :], x, float("-inf"))  # (rows past T stay finite: never stored)
        m = tl.max(x, axis=1)
        p = tl.exp(x - m[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        q = tl.where(col_ok[None, :], p, -1.0)  # padding columns below every probability
        kcol = tl.arange(0, K_P2)
        vals = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
        picks = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.max(q, axis=1)
            pick = tl.min(tl.where(q == best[:, None], cols[None, :], E_P2), axis=1)  # lowest index on ties
            vals = tl.where(kcol[None, :] == i, best[:, None], vals)
            picks = tl.where(kcol[None, :] == i, pick[:, None], picks)
            q = tl.where(cols[None, :] == pick[:, None], -2.0, q)
        if RENORM:
            vals = vals / tl.sum(vals, axis=1)[:, None]
        if SHARED > 0:  # column E: the shared expert's gate logit; its slots weigh sigmoid(gate)
            g = tl.load(logits_ptr + rows64 * stride_lt + E * stride_le, mask=row_ok, other=0.0).to(tl.float32)
            g = 1.0 / (1.0 + tl.exp(-g))
            extra = (kcol >= K)[None, :]
            vals = tl.where(extra, g[:, None], vals)
            picks = tl.where(extra, E + kcol[None, :] - K, picks)
        out = rows64[:, None] * (K + SHARED) + kcol[None, :]
        ok = row_ok[:, None] & (kcol[None, :] < K + SHARED)
        tl.store(w_ptr + out, vals.to(w_ptr.dtype.element_ty), mask=ok)
        tl.store(ids_ptr + out, picks.to(tl.int64), mask=ok)

    @triton.jit
    def _grouped_router_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E, GS, stride_lt, stride_le, scale,
                               K: tl.constexpr, K_P2: tl.constexpr, E_P2: tl.constexpr, NG: tl.constexpr,
                               NG_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
                               RENORM: tl.constexpr):  # fmt: skip
        x, rows64, cols, row_ok, col_ok = _logit_rows(logits_ptr, T, E, stride_lt, stride_le, E_P2, BLOCK_T)
        scores = 1.0 / (1.0 + tl.exp(-x))
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        choice = tl.where(col_ok[None, :], scores + bias[None, :], float("-inf"))
        group = cols // GS
        gcols = tl.arange(0, NG_P2)
        # each group's score: the sum of its two best choices
        gscore = tl.full((BLOCK_T, NG_P2), float("-inf"), tl.float32)
        for g in tl.static_range(NG):
            v = tl.where((group == g)[None, :], choice, float("-inf"))
            m1 = tl.max(v, axis=1)
            i1 = tl.min(tl.where(v == m1[:, None], cols[None, :], E_P2), axis=1)
            m2 = tl.max(tl.where(cols[None, :] == i1[:, None], float("-inf"), v), axis=1)
            gscore = tl.where(gcols[None, :] == g, (m1 + m2)[:, None], gscore)
        # the topk_group best groups; the experts of the others are out of the choice
        keep = tl.zeros((BLOCK_T, E_P2), dtype=tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=1)
            pick = tl.min(tl.where(gscore == best[:, None], gcols[None, :], NG_P2), axis=1)
            keep = tl.where(group[None, :] == pick[:, None], 1, keep)
            gscore = tl.where(gcols[None, :] == pick[:, None], float("-inf"), gscore)
        q = tl.where(keep > 0, choice, float("-inf"))
        kcol = tl.arange(0, K_P2)
        vals = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
        picks = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
        for i in tl.static_range(K):
            best = tl.max(q, axis=1)
            pick = tl.min(tl.where(q == best[:, None], cols[None, :], E_P2), axis=1)
            score = tl.sum(tl.where(cols[None, :] == pick[:, None], scores, 0.0), axis=1)  # without the bias
            vals = tl.where(kcol[None, :] == i, score[:, None], vals)
            picks = tl.where(kcol[None, :] == i, pick[:, None], picks)
            q = tl.where(cols[None, :] == pick[:, None], float("-inf"), q)
        if RENORM:
            vals = vals / (tl.sum(vals, axis=1)[:, None] + 1e-20)
        vals = vals * scale
        out = rows64[:, None] * K + kcol[None, :]
        ok = row_ok[:, None] & (kcol[None, :] < K)
        tl.store(w_ptr + out, vals, mask=ok)
        tl.store(ids_ptr + out, picks.to(tl.int64), mask=ok)


# ---- launchers ------------------------------------------------------------------------------------
_SORT_PROGRAMS = 64  # chunks per sort: each program histograms all S keys, so not many more


def sort_plan(n_slots: int, num_experts: int) -> dict:
    """Launch constants of expert_sort for (S, E): grid size and the kernel's block sizes."""
    bins = triton.next_power_of_2(num_experts + 2)  # experts, "no local expert", a spare bin for padding
    chunk = max(32, triton.next_power_of_2(triton.cdiv(n_slots, _SORT_PROGRAMS)))
    sub = max(1, min(chunk, 8192 // bins))  # one-hot tile SUB x BINS
    hist = min(1024, max(32, triton.next_power_of_2(n_slots)))
    return dict(grid=(triton.cdiv(n_slots, chunk),), BINS=bins, CHUNK=chunk, HIST=hist, SUB=sub,
                num_warps=8 if bins >= 256 else 4)  # fmt: skip


def expert_sort(routing: Routing, num_experts: int, plan: dict | None = None) -> SortedSlots:
    """SortedSlots of a call's routing (see the module doc), in one Triton launch."""
    n = routing.n_slots
    ids = routing.topk_ids
    out = _alloc((3, n), torch.int64, ids.device)
    offs = _alloc((num_experts,), torch.int32, ids.device)
    p = plan or sort_plan(n, num_experts)
    if n:
        _expert_sort_kernel[p["grid"]](ids, routing.map_arg, out, offs, n, routing.tk, routing.topk, routing.num_routed,
                                       routing.num_local_routed, num_experts, ids.stride(0), ids.stride(1),
                                       HAS_MAP=routing.expert_map is not None, BINS=p["BINS"], CHUNK=p["CHUNK"],
                                       HIST=p["HIST"], SUB=p["SUB"], num_warps=p["num_warps"])  # fmt: skip
    else:
        offs.zero_()
    perm, tok, inv = out.unbind(0)
    return SortedSlots(perm, tok, offs, inv)


def _block_t(tokens: int, fit: int, cap: int) -> int:
    """Rows a router program takes: as many as fit its tile (`fit`, at most `cap`), no more than the call's
    tokens rounded up to a power of two (one decode token in a 32-row tile cost ~6 us a call on an H100,
    E=128: each of the top-k passes reduces the whole tile)."""
    return max(1, min(cap, fit, triton.next_power_of_2(tokens)))


def router_topk(logits: torch.Tensor, top_k: int, renorm: bool, out_dtype: torch.dtype, shared: int = 0):
    """router_topk_ref in one Triton launch: logits (T, E) (T, E + 1 with `shared`) any float dtype and
    strides."""
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ValueError(f"router_topk: shared must be an int >= 0, got {shared!r}")
    E = logits.shape[1] - (1 if shared else 0) if logits.dim() == 2 else 0
    if logits.dim() != 2 or not 1 <= top_k <= E:
        raise ValueError(f"router_topk: logits {tuple(logits.shape)} must be (tokens, experts"
                         f"{' + 1 shared gate' if shared else ''}) with 1 <= top_k={top_k} <= experts")  # fmt: skip
    T = logits.shape[0]
    w = _alloc((T, top_k + shared), out_dtype, logits.device)
    ids = _alloc((T, top_k + shared), torch.int64, logits.device)
    if T:
        e_p2 = triton.next_power_of_2(E)
        block_t = _block_t(T, 4096 // e_p2, 64)
        _router_topk_kernel[(triton.cdiv(T, block_t),)](logits, w, ids, T, E, logits.stride(0), logits.stride(1),
                                                        K=top_k, K_P2=triton.next_power_of_2(top_k + shared),
                                                        E_P2=e_p2, BLOCK_T=block_t, RENORM=bool(renorm),
                                                        SHARED=shared, num_warps=4)  # fmt: skip
    return w, ids


def grouped_router_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                        renorm: bool, scale: float):  # fmt: skip
    """grouped_router_topk_ref in one Triton launch: logits (T, E) any float dtype and strides, bias (E,)."""
    T, E = logits.shape if logits.dim() == 2 else (0, 0)
    if logits.dim() != 2 or tuple(bias.shape) != (E,):
        raise ValueError(f"grouped_router_topk: logits {tuple(logits.shape)} must be (tokens, experts) and "
                         f"bias {tuple(bias.shape)} (experts,)")  # fmt: skip
    why = grouping_reason(E, n_group, topk_group, top_k)
    if why:
        raise ValueError(f"grouped_router_topk: {why}")
    w = _alloc((T, top_k), torch.float32, logits.device)
    ids = _alloc((T, top_k), torch.int64, logits.device)
    bias = bias.contiguous()  # the kernel reads it with unit stride
    if T:
        e_p2 = triton.next_power_of_2(E)
        block_t = _block_t(T, 2048 // e_p2, 32)
        _grouped_router_kernel[(triton.cdiv(T, block_t),)](
            logits, bias, w, ids, T, E, E // n_group, logits.stride(0), logits.stride(1), float(scale),
            K=top_k, K_P2=triton.next_power_of_2(top_k), E_P2=e_p2, NG=n_group,
            NG_P2=triton.next_power_of_2(n_group), TOPK_GROUP=topk_group, BLOCK_T=block_t, RENORM=bool(renorm),
            num_warps=4,
        )  # fmt: skip
    return w, ids
