"""Triton grouped GEMM over token slots routed to experts, and the routing-weight combine.

A *slot* is one (token, k) pair: slot s = t * TK + j for token t and routing column j < TK, where
TK = topk + shared (shared experts are extra columns every token takes, weight 1, experts
E_routed .. E_routed + shared - 1 of the weight tensors). Each slot has a local expert id:
  e >= 0  the expert of the weight tensors it multiplies,
  e == -1 routed to an expert another rank holds (expert parallelism): contributes nothing,
  e == -2 an id out of range: the token's combined output is NaN (never a plausible wrong value).

`moe_gemm` computes C[s] = A[s] @ B[e(s)] for every slot with e(s) >= 0 (other rows of C are never
written). B is (E, K, N) logically, with any strides (the (E, N, K) storage of Hugging Face's and
aiter's expert weights is B.transpose(1, 2)). With `gated`, B has 2N columns, gate first, and the
kernel writes act(A @ B_gate) * (A @ B_up). Rows of A: slot s reads A at
(s // TK) * stride_at + (s % TK) * stride_aj, so stage 1 reads the token's hidden state (stride_aj =
0) and stage 2 the slot's own intermediate row.

Two ways to find a program's rows:
- direct (few slots): the grid is (expert, N tiles, K splits); each program reads every slot's id
  and gathers the rows routed to its expert, chunk by chunk. No preparation kernel at all, which is
  what decode needs; experts nobody routed to exit at once. With fewer slots than experts the first
  grid axis runs over slots instead: program p takes slot p's expert unless an earlier slot has it, so
  at decode the grid holds the experts hit rather than every expert.
- sorted (many slots): moe_align.py sorts slots by expert into BLOCK_M-padded blocks on the device;
  the grid is (block, N tiles, K splits) and a block's padding rows (slot id == n_slots) are masked.
Stage 2 has a third form at decode, by token (`moe_down_by_token`, `moe2_token_...` configs): a program
per (token, N tile) walks the token's routing columns and their K steps as one loop and sums the
weighted results itself, so no combine kernel runs after it. Its split divides the token's columns
over programs (the last to arrive sums the fp32 partials in split order).

Split-K: each split's fp32 partial sum is stored without the epilogue (the activation is not linear).
Stage 2's splits go to C[split] and the combine kernel sums them with the topk columns:
out[t] = sum_j w[t, j] * C[t * TK + j]. Stage 1's (gate and up halves) go to a scratch buffer, and the
split of a tile that arrives last (an atomic counter per tile) sums them in split order and stores the
epilogue, so stage 1 still leaves finished rows: the sum does not depend on arrival order, and no
kernel is added. Decode with fine-grained experts has too few stage-1 programs to stream the weights
at full bandwidth unless H is split. (Summing stage 1's partials in stage 2's A load instead would keep
2 x split fp32 tiles per K step in flight, which the software pipeline multi-buffers in shared memory:
over 200 KB at split 8.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._common import HAS_TRITON, ArrivalCounters, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401 - gdc_*
from .gemm_ref import fp32_matmul

ACTS = {"none": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}
NOT_LOCAL = -1  # routed to an expert of another rank
BAD_ID = -2  # expert id out of range: poisons the token's output
DIRECT_MAX_SLOTS = 256  # beyond this the per-program id scan costs more than sorting once
# A stage 1 split over H runs only up to this many slots: the splits the default was measured with
# (benchmarks/results/h100/fused_moe_op/grid_default.md). Larger splits are not timed yet.
SPLIT1_MAX_SLOTS = 16


def _empty(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output allocation (tests swap in NaN-filled ones to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


# ---- configs ------------------------------------------------------------------------------------
_NAME = re.compile(r"^moe([12])_(direct|sorted|token)_bm(\d+)_bn(\d+)_bk(\d+)_sk(\d+)_w(\d+)_s(\d+)$")


@dataclass(frozen=True)
class MoeGemmConfig:
    """One stage's tile config; its name is what a tuned row's kernelName1/kernelName2 holds."""

    stage: int  # 1: gate+up (+ activation), 2: down
    direct: bool
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 3
    # stage 2 only: a program per (token, N tile) walks the token's experts and sums them itself (no
    # combine kernel; moe_down_by_token). Direct: it reads the router's ids, nothing sorted.
    by_token: bool = False

    @property
    def name(self) -> str:
        mode = "token" if self.by_token else "direct" if self.direct else "sorted"
        return (f"moe{self.stage}_{mode}_bm{self.block_m}_bn{self.block_n}_bk{self.block_k}_sk{self.split_k}"
                f"_w{self.warps}_s{self.stages}")  # fmt: skip

    @classmethod
    def parse(cls, name: str) -> MoeGemmConfig | None:
        m = _NAME.match(name.strip())
        if not m:
            return None
        st, mode, bm, bn, bk, sk, w, s = m.groups()
        cfg = cls(int(st), mode != "sorted", int(bm), int(bn), int(bk), int(sk), int(w), int(s), mode == "token")
        return cfg if cfg.valid() else None

    def valid(self) -> bool:
        pow2 = all(v > 0 and v & (v - 1) == 0 for v in (self.block_m, self.block_n, self.block_k, self.warps))
        return (pow2 and self.block_m >= 16 and self.block_n >= 16 and self.block_k >= 16 and self.split_k >= 1
                and self.stages >= 1 and self.stage in (1, 2)
                and (not self.by_token or (self.stage == 2 and self.direct and self.block_m == 16)))  # fmt: skip

    def fits(self, n_slots: int) -> bool:
        split_ok = self.stage != 1 or self.split_k == 1 or n_slots <= SPLIT1_MAX_SLOTS
        return split_ok and (not self.direct or n_slots <= DIRECT_MAX_SLOTS)


# ---- references -----------------------------------------------------------------------------------
def act_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "silu":
        return F.silu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "none":
        return x
    raise ValueError(f"unknown activation {activation!r} (silu, gelu, gelu_tanh)")


def local_expert_ids(topk_ids: torch.Tensor, num_routed: int, expert_map: torch.Tensor | None = None,
                     shared: int = 0, num_local_routed: int | None = None) -> torch.Tensor:  # fmt: skip
    """(T, topk + shared) int32 local expert id of every slot (see the module doc for -1 / -2).

    topk_ids hold router ids in [0, num_routed); expert_map (num_routed,) maps them to local ids
    (-1: another rank's expert). Shared experts follow the local routed ones in the weight tensors.
    """
    if expert_map is None and not shared:  # the common case in fewer ops: ids are local ids
        ok = (topk_ids >= 0) & (topk_ids < num_routed)
        return torch.where(ok, topk_ids, BAD_ID).to(torch.int32)
    ids = topk_ids.to(torch.int64)
    ok = (ids >= 0) & (ids < num_routed)
    safe = torch.where(ok, ids, 0)
    local = expert_map.to(torch.int64)[safe] if expert_map is not None else safe
    local = torch.where(ok, local, BAD_ID)
    if shared:
        n_local = num_local_routed if num_local_routed is not None else num_routed
        extra = torch.arange(n_local, n_local + shared, device=ids.device, dtype=torch.int64)
        local = torch.cat([local, extra.expand(ids.shape[0], shared)], dim=1)
    return local.to(torch.int32)


def slot_weights(topk_weights: torch.Tensor, shared: int = 0) -> torch.Tensor:
    """(T, topk + shared) fp32 routing weight of every slot (shared experts weigh 1)."""
    w = topk_weights.float()
    if shared:
        w = torch.cat([w, w.new_ones(w.shape[0], shared)], dim=1)
    return w


def moe_gemm_ref(a_rows: torch.Tensor, b: torch.Tensor, local_ids: torch.Tensor, activation: str = "none",
                 gated: bool = False, weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """fp32 loop reference of moe_gemm: a_rows (S, K) one row per slot, b (E, K, N or 2N), local_ids (S,).
    Rows of slots with no local expert are NaN (moe_gemm leaves them unwritten)."""
    n = b.shape[2] // 2 if gated else b.shape[2]
    out = torch.full((a_rows.shape[0], n), float("nan"), dtype=torch.float32, device=a_rows.device)
    for e in range(b.shape[0]):
        rows = (local_ids == e).nonzero().flatten()
        if rows.numel() == 0:
            continue
        y = fp32_matmul(a_rows[rows], b[e])
        y = act_ref(y[:, :n], activation) * y[:, n:] if gated else act_ref(y, activation)
        out[rows] = y if weights is None else y * weights[rows].float().unsqueeze(1)
    return out


def _ref_slots(w1: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None, shared: int):
    local_routed = w1.shape[0] - shared
    num_routed = expert_map.shape[0] if expert_map is not None else local_routed
    return local_expert_ids(topk_ids, num_routed, expert_map, shared, local_routed)


def stage1_ref(hidden: torch.Tensor, w1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               activation: str = "silu", expert_map: torch.Tensor | None = None, shared: int = 0,
               inter: int | None = None, doweight: bool = False) -> torch.Tensor:  # fmt: skip
    """fp32 stage 1 of fused_moe: (T * TK, I) per slot act(gate) * up (times the routing weight with
    doweight), slot s = t * TK + j; NaN rows for slots with no local expert. `inter` tells a gated w1
    (2I rows) from an ungated one (defaults to gated)."""
    ids = _ref_slots(w1, topk_ids, expert_map, shared)
    T, TK = ids.shape
    gated = inter is None or w1.shape[1] == 2 * inter
    rows = hidden.unsqueeze(1).expand(T, TK, hidden.shape[1]).reshape(T * TK, -1)
    w = slot_weights(topk_weights, shared).reshape(-1) if doweight else None
    return moe_gemm_ref(rows, w1.transpose(1, 2), ids.reshape(-1), activation, gated, w)


def stage2_ref(h: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               expert_map: torch.Tensor | None = None, shared: int = 0,
               doweight: bool = False) -> torch.Tensor:  # fmt: skip
    """fp32 stage 2 of fused_moe from the slots' intermediate rows h (T * TK, I): down GEMM, then the
    routing-weight combine (weights already applied in stage 1 with doweight) into (T, H). Rows of
    slots with no local expert are never read; a token with an out-of-range id gets NaN."""
    ids = _ref_slots(w2, topk_ids, expert_map, shared)
    T, TK = ids.shape
    live = (ids >= 0).reshape(-1, 1)
    y = moe_gemm_ref(torch.where(live, h.float(), 0.0), w2.transpose(1, 2), ids.reshape(-1))
    w = slot_weights(topk_weights, shared).reshape(-1, 1)
    y = torch.where(live, y if doweight else y * w, 0.0).view(T, TK, -1).sum(1)
    return torch.where((ids == BAD_ID).any(1, keepdim=True), float("nan"), y)


def fused_moe_ref(hidden: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                  shared: int = 0) -> torch.Tensor:  # fmt: skip
    """fp32 loop-over-experts reference of fused_moe: w1 (E, 2I, H) gate rows first (or (E, I, H) for
    an ungated MLP), w2 (E, H, I); out (T, H) fp32. A token with an out-of-range expert id gets NaN."""
    h = stage1_ref(hidden, w1, topk_weights, topk_ids, activation, expert_map, shared, w2.shape[2])
    return stage2_ref(h, w2, topk_weights, topk_ids, expert_map, shared)


# ---- kernels --------------------------------------------------------------------------------------
if HAS_TRITON:
    from .triton_gemm import store_partial_arrive, sum_partials

    @triton.jit
    def slot_expert(slots, valid, ids_ptr, stride_it, stride_ij, map_ptr, TK, TOPK, num_routed,
                     num_local_routed, HAS_MAP: tl.constexpr, FLAT: tl.constexpr = False):  # fmt: skip
        """Local expert id of each slot (-1 other rank / -2 bad id), as local_expert_ids computes it.
        FLAT: no shared experts and the ids' rows contiguous (stride_it == TK * stride_ij), so slot s's id
        is at s * stride_ij: no division on the way to it (a direct program's weights wait for it)."""
        if FLAT:  # every valid slot is a routed column
            routed = valid
            raw = tl.load(ids_ptr + slots * stride_ij, mask=routed, other=0).to(tl.int32)
        else:
            t = slots // TK
            j = slots % TK
            routed = valid & (j < TOPK)
            raw = tl.load(ids_ptr + t * stride_it + j * stride_ij, mask=routed, other=0).to(tl.int32)
        ok = (raw >= 0) & (raw < num_routed)
        if HAS_MAP:
            mapped = tl.load(map_ptr + raw, mask=routed & ok, other=-1).to(tl.int32)
        else:
            mapped = raw
        e = tl.where(ok, mapped, -2)
        if not FLAT:  # shared experts' columns
            e = tl.where(routed, e, num_local_routed + (j - TOPK))
        return tl.where(valid, e, -1)

    @triton.jit
    def _act(x, ACT: tl.constexpr):
        if ACT == 1:  # silu
            x = x / (1.0 + tl.exp(-x))
        elif ACT == 2:  # gelu (erf)
            x = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
        elif ACT == 3:  # gelu, tanh approximation; tanh(z) = 1 - 2 / (1 + exp(2z))
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = 0.5 * x * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
        return x

    @triton.jit
    def _epilogue(acc, acc_up, w_ptr, slot, row_ok, TK, TOPK, stride_wt, stride_wj, GATED: tl.constexpr,
                  ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr):  # fmt: skip
        """act(gate) * up (or act(x) ungated), times each slot's routing weight with MUL_WEIGHT (shared
        experts' columns, j >= TOPK, weigh 1)."""
        if GATED:
            acc = _act(acc, ACT) * acc_up
        else:
            acc = _act(acc, ACT)
        if MUL_WEIGHT:
            t = slot // TK
            j = slot % TK
            w = tl.load(w_ptr + t * stride_wt + j * stride_wj, mask=row_ok & (j < TOPK), other=1.0)
            acc = acc * w.to(tl.float32)[:, None]
        return acc

    @triton.jit
    def _tile(a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr, lock, slot, row_ok, e, pid_n, pid_k, N, K, TK, TOPK,
              stride_at, stride_aj, stride_ak, stride_be, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn,
              stride_wt, stride_wj, stride_ps, stride_pm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, GATED: tl.constexpr,
              ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
        """C[slot] = epilogue(A[slot] @ B[e][:, n tile]) for BLOCK_M slots of one expert. Split (SPLIT_K > 1)
        without FIXUP: split pid_k's fp32 partial into C[pid_k], no epilogue. With FIXUP: the partial (gate,
        then up at column N + n) into part[pid_k]; the split that arrives last at lock_ptr[lock] sums all
        of them in split order, so the result does not depend on arrival order, and stores the epilogue."""
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        slot64 = slot.to(tl.int64)
        a_row = (slot // TK).to(tl.int64) * stride_at + (slot % TK).to(tl.int64) * stride_aj
        a_ptrs = a_ptr + a_row[:, None] + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + e.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, SPLIT_K * BLOCK_K):
            k_ok = (offs_k + (k0 - pid_k * BLOCK_K)) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                acc_up = tl.dot(a, b_up, acc_up, input_precision=PREC)
            a_ptrs += SPLIT_K * BLOCK_K * stride_ak
            b_ptrs += SPLIT_K * BLOCK_K * stride_bk
        c_ptrs = c_ptr + slot64[:, None] * stride_cm + offs_n[None, :] * stride_cn
        mask = row_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            acc = _epilogue(acc, acc_up, w_ptr, slot, row_ok, TK, TOPK, stride_wt, stride_wj, GATED, ACT, MUL_WEIGHT)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
        elif not FIXUP:  # the combine kernel sums the splits
            tl.store(c_ptrs + pid_k * stride_cs, acc, mask=mask)
        else:
            p_ptrs = part_ptr + slot64[:, None] * stride_pm + offs_n[None, :]
            tl.store(p_ptrs + pid_k * stride_ps, acc, mask=mask, cache_modifier=".cg")
            if GATED:
                tl.store(p_ptrs + pid_k * stride_ps + N, acc_up, mask=mask, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's partial is stored before one thread publishes the arrival
            arrived = tl.atomic_add(lock_ptr + lock, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(0, SPLIT_K):
                    acc += tl.load(p_ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(p_ptrs + s * stride_ps + N, mask=mask, other=0.0, cache_modifier=".cg")
                acc = _epilogue(acc, acc_up, w_ptr, slot, row_ok, TK, TOPK, stride_wt, stride_wj, GATED, ACT,
                                MUL_WEIGHT)  # fmt: skip
                tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + lock, 0, sem="relaxed", scope="gpu")  # re-armed for the next call

    @triton.jit
    def _prefetch(b_ptr, e, pid_n, pid_k, N, K, stride_be, stride_bk, stride_bn, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
        """Touch the first TILES weight tiles program (e, pid_n, pid_k) will read, discarding them: they
        land in L2, and the loop re-reads them after gdc_wait (the weights are not written in between)."""
        if e >= 0:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            base = b_ptr + e.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
            for i in tl.static_range(TILES):
                offs_k = (pid_k + i * SPLIT_K) * BLOCK_K + tl.arange(0, BLOCK_K)
                tl.load(base + offs_k[:, None] * stride_bk, mask=(offs_k[:, None] < K) & (offs_n[None, :] < N),
                        volatile=True)  # fmt: skip

    @triton.jit
    def _direct_chunk(r0, hit, rank, slots, count, pid, pid_n, pid_k, e, a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr,
                      N, K, TK, TOPK, stride_at, stride_aj, stride_ak, stride_be, stride_bk, stride_bn, stride_cs,
                      stride_cm, stride_cn, stride_wt, stride_wj, stride_ps, stride_pm, SLOTS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                      FIXUP: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                      PREC: tl.constexpr):  # fmt: skip
        """Rows r0 .. r0 + BLOCK_M of expert e's slots (row r: the slot whose rank among them is r), one _tile."""
        r = r0 + tl.arange(0, BLOCK_M)
        match = (hit[None, :] > 0) & (rank[None, :] == r[:, None])
        slot = tl.sum(tl.where(match, slots[None, :], 0), axis=1)
        lock = (pid * tl.num_programs(1) + pid_n) * ((SLOTS + BLOCK_M - 1) // BLOCK_M) + r0 // BLOCK_M
        _tile(a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr, lock, slot, r < count, e, pid_n, pid_k, N, K, TK, TOPK,
              stride_at, stride_aj, stride_ak, stride_be, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn,
              stride_wt, stride_wj, stride_ps, stride_pm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, GATED, ACT,
              MUL_WEIGHT, PREC)  # fmt: skip

    # n_slots is never specialized: Triton 3.6 miscompiles this kernel when it specializes n_slots = 32
    # (divisible by 16) with SLOTS = 32 at 4 warps. On an H100 at 4 tokens of top 8 with H, I multiples
    # of 16, stage 1 split over H, stage 2 split over I and stage 2 with BLOCK_N 128 gave wrong rows
    # (rel err ~0.9) or a misaligned-address fault; at 3 or 5 tokens, at 8 warps and at odd sizes they
    # were right.
    @triton.jit(do_not_specialize=["n_slots"])
    def _moe_gemm_direct(a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr, ids_ptr, map_ptr, n_slots, N, K, TK, TOPK,
                         num_routed, num_local_routed, stride_it, stride_ij, stride_at, stride_aj, stride_ak,
                         stride_be, stride_bk, stride_bn, stride_cs, stride_cm, stride_cn, stride_wt, stride_wj,
                         stride_ps, stride_pm, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, BY_SLOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                         FIXUP: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         PREC: tl.constexpr, FLAT_IDS: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
        pid = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        if PDL == 1:  # stage 1: the routing and the hidden state may come from the kernel just before
            gdc_wait()
            gdc_launch_dependents()
        slots = tl.arange(0, SLOTS)
        ids = slot_expert(slots, slots < n_slots, ids_ptr, stride_it, stride_ij, map_ptr, TK, TOPK, num_routed,
                           num_local_routed, HAS_MAP, FLAT_IDS)  # fmt: skip
        if BY_SLOT:  # program p: slot p's expert, unless an earlier slot has it (then that slot's program does)
            e = tl.sum(tl.where(slots == pid, ids, 0), axis=0)
            earlier = tl.sum(((ids == e) & (slots < pid)).to(tl.int32), axis=0)
            e = tl.where(earlier == 0, e, -1)
        else:
            e = pid
        if PDL > 1:  # stage 2 (moe_gemm's pdl): pull its first weight tiles into L2 while stage 1 finishes
            _prefetch(b_ptr, e, pid_n, pid_k, N, K, stride_be, stride_bk, stride_bn, BLOCK_N, BLOCK_K, SPLIT_K,
                      PDL - 1)  # fmt: skip
            gdc_wait()
            gdc_launch_dependents()
        hit = ((ids == e) & (e >= 0)).to(tl.int32)
        count = tl.sum(hit, axis=0)
        rank = tl.cumsum(hit, axis=0) - 1
        # Gather this expert's slots BLOCK_M at a time. At decode one chunk holds them (an expert's slots are
        # at most its tokens), and it runs outside the loop: with the flat id load, E=128 I=384 top 8 at
        # T = 4 went 55.3 -> 54.4 us on an H100 (grid_default.md).
        if count > 0:
            if count <= BLOCK_M:
                _direct_chunk(0, hit, rank, slots, count, pid, pid_n, pid_k, e, a_ptr, b_ptr, c_ptr, w_ptr, part_ptr,
                              lock_ptr, N, K, TK, TOPK, stride_at, stride_aj, stride_ak, stride_be, stride_bk,
                              stride_bn, stride_cs, stride_cm, stride_cn, stride_wt, stride_wj, stride_ps, stride_pm,
                              SLOTS, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, GATED, ACT, MUL_WEIGHT,
                              PREC)  # fmt: skip
            else:
                for r0 in range(0, count, BLOCK_M):
                    _direct_chunk(r0, hit, rank, slots, count, pid, pid_n, pid_k, e, a_ptr, b_ptr, c_ptr, w_ptr,
                                  part_ptr, lock_ptr, N, K, TK, TOPK, stride_at, stride_aj, stride_ak, stride_be,
                                  stride_bk, stride_bn, stride_cs, stride_cm, stride_cn, stride_wt, stride_wj,
                                  stride_ps, stride_pm, SLOTS, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP, GATED, ACT,
                                  MUL_WEIGHT, PREC)  # fmt: skip

    @triton.jit
    def _moe_gemm_sorted(a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr, sorted_ptr, block_expert_ptr, n_slots, N, K,
                         TK, TOPK, stride_at, stride_aj, stride_ak, stride_be, stride_bk, stride_bn, stride_cs,
                         stride_cm, stride_cn, stride_wt, stride_wj, stride_ps, stride_pm, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr,
                         GATED: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         PREC: tl.constexpr):  # fmt: skip
        blk = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        e = tl.load(block_expert_ptr + blk)
        if e >= 0:
            slot = tl.load(sorted_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
            lock = blk * tl.num_programs(1) + pid_n
            _tile(a_ptr, b_ptr, c_ptr, w_ptr, part_ptr, lock_ptr, lock, slot, slot < n_slots, e, pid_n, pid_k, N, K,
                  TK, TOPK, stride_at, stride_aj, stride_ak, stride_be, stride_bk, stride_bn, stride_cs, stride_cm,
                  stride_cn, stride_wt, stride_wj, stride_ps, stride_pm, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, FIXUP,
                  GATED, ACT, MUL_WEIGHT, PREC)  # fmt: skip

    @triton.jit(do_not_specialize=["n_tokens"])
    def _moe_down_by_token(a_ptr, b_ptr, w_ptr, out_ptr, part_ptr, lock_ptr, ids_ptr, map_ptr, n_tokens, N, K, TK,
                           TOPK, num_routed, num_local_routed, stride_it, stride_ij, stride_at, stride_aj, stride_ak,
                           stride_be, stride_bk, stride_bn, stride_wt, stride_wj, stride_ot, TK_P2: tl.constexpr,
                           HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, MUL_WEIGHT: tl.constexpr, PREC: tl.constexpr,
                           SPLIT: tl.constexpr, PDL: tl.constexpr = 0):  # fmt: skip
        """out[t, n tile] = sum_j w[t, j] * A[t * TK + j] @ B[e(t, j)][:, n tile]: stage 2 and the combine in
        one program per (token, N tile), walking the token's experts and their K steps as one loop (long
        enough to keep the weight loads pipelined). A's row rides row 0 of a BLOCK_M-row tile (the tensor
        cores' least M); the other rows stay zero."""
        pid = tl.program_id(0)
        t = pid % n_tokens  # tokens fastest: programs of one N tile run together and share their experts in L2
        pid_n = pid // n_tokens
        pid_s = tl.program_id(1)  # split: this program's share of the token's routing columns
        per_split = tl.cdiv(TK, SPLIT)
        j_lo = pid_s * per_split
        j_hi = tl.minimum(TK, j_lo + per_split)
        j = tl.arange(0, TK_P2)
        e_all = slot_expert(t * TK + j, j < TK, ids_ptr, stride_it, stride_ij, map_ptr, TK, TOPK, num_routed,
                            num_local_routed, HAS_MAP)  # fmt: skip
        live = e_all >= 0
        if MUL_WEIGHT:  # shared experts' columns (j >= TOPK) weigh 1
            w_all = tl.load(w_ptr + t * stride_wt + j * stride_wj, mask=live & (j < TOPK), other=1.0).to(tl.float32)
        else:
            w_all = tl.full((TK_P2,), 1.0, tl.float32)
        w_all = tl.where(live, w_all, 0.0)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        rows = tl.arange(0, BLOCK_M)
        k_steps = tl.cdiv(K, BLOCK_K)
        if PDL > 1:  # pull the first expert's first weight tiles into L2 while stage 1 finishes
            e0 = tl.sum(tl.where(j == j_lo, e_all, 0), axis=0)
            _prefetch(b_ptr, e0, pid_n, 0, N, K, stride_be, stride_bk, stride_bn, BLOCK_N, BLOCK_K, 1, PDL - 1)
            gdc_wait()
            gdc_launch_dependents()
        a_base = a_ptr + t.to(tl.int64) * stride_at
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i in range(j_lo * k_steps, j_hi * k_steps):
            jj = i // k_steps
            k0 = (i % k_steps) * BLOCK_K
            e = tl.sum(tl.where(j == jj, e_all, 0), axis=0)
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < tl.where(e >= 0, K, 0)  # a slot with no local expert reads nothing
            a = tl.load(a_base + jj * stride_aj + rows[:, None] * 0 + offs_k[None, :] * stride_ak,
                        mask=(rows[:, None] == 0) & k_ok[None, :], other=0.0)  # fmt: skip
            b_tile = b_ptr + tl.maximum(e, 0).to(tl.int64) * stride_be
            b = tl.load(b_tile + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # fmt: skip
            acc = tl.dot(a, b, acc, input_precision=PREC)
            last = (i % k_steps) == k_steps - 1  # the expert's last K step: weigh its sum into the total
            w = tl.sum(tl.where(j == jj, w_all, 0.0), axis=0)
            total += tl.where(last, acc * w, 0.0)
            acc = tl.where(last, 0.0, acc)
        y = tl.sum(total, axis=0)  # rows past 0 are zero
        out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs_n
        bad = tl.sum((e_all == -2).to(tl.int32), axis=0) > 0
        if SPLIT == 1:
            tl.store(out_ptrs, tl.where(bad, float("nan"), y).to(out_ptr.dtype.element_ty), mask=n_ok)
        else:  # the split that arrives last sums the fp32 partials in split order (arrival order never shows)
            unit_part = part_ptr + pid.to(tl.int64) * (SPLIT * BLOCK_N)  # this program's [SPLIT, BLOCK_N]
            offs = tl.arange(0, BLOCK_N)
            arrived = store_partial_arrive(y, unit_part, offs, pid_s, lock_ptr, pid, 1, BLOCK_N)
            if arrived == SPLIT - 1:
                y = sum_partials(unit_part, offs, SPLIT, 1, BLOCK_N, ".cg")
                tl.store(out_ptrs, tl.where(bad, float("nan"), y).to(out_ptr.dtype.element_ty), mask=n_ok)
                tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")  # re-armed for the next call

    @triton.jit
    def _combine(c_ptr, w_ptr, ids_ptr, map_ptr, row_ptr, out_ptr, N, TK, TOPK, num_routed, num_local_routed,
                 stride_it, stride_ij, stride_wt, stride_wj, stride_cs, stride_cm, stride_ot, SPLITS: tl.constexpr,
                 TK_P2: tl.constexpr, HAS_MAP: tl.constexpr, MUL_WEIGHT: tl.constexpr, HAS_ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs < N
        j = tl.arange(0, TK_P2)
        slots = t * TK + j
        e = slot_expert(slots, j < TK, ids_ptr, stride_it, stride_ij, map_ptr, TK, TOPK, num_routed,
                         num_local_routed, HAS_MAP)  # fmt: skip
        live = e >= 0
        w = tl.load(w_ptr + t * stride_wt + j * stride_wj, mask=live & (j < TOPK), other=1.0).to(tl.float32)
        if not MUL_WEIGHT:
            w = tl.where(live, 1.0, 0.0)
        w = tl.where(live, w, 0.0)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if HAS_ROWS:  # C holds slot s at row rows[s] (sorted by expert: torch._grouped_mm's output)
            rows = tl.load(row_ptr + slots, mask=live, other=0).to(tl.int64) * stride_cm
        else:
            rows = slots.to(tl.int64) * stride_cm
        for s in tl.static_range(SPLITS):
            part = tl.load(c_ptr + s * stride_cs + rows[:, None] + offs[None, :], mask=live[:, None] & n_ok[None, :],
                           other=0.0)  # fmt: skip
            acc += tl.sum(part.to(tl.float32) * w[:, None], axis=0)
        bad = tl.sum((e == -2).to(tl.int32), axis=0) > 0
        acc = tl.where(bad, float("nan"), acc)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ---- launchers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Routing:
    """How slots find their experts: the raw ids (+ map) for direct launches and the combine, and the
    sorted blocks (moe_align) for sorted launches."""

    topk_ids: torch.Tensor  # (T, topk) router ids, int32/int64, any strides
    topk: int
    shared: int
    num_routed: int  # ids range over [0, num_routed)
    num_local_routed: int  # routed experts in the weight tensors (shared ones follow)
    expert_map: torch.Tensor | None = None  # (num_routed,) int32 local id or -1

    @property
    def tk(self) -> int:
        return self.topk + self.shared

    @property
    def n_slots(self) -> int:
        return self.topk_ids.shape[0] * self.tk

    @property
    def map_arg(self) -> torch.Tensor:
        """The expert map as a kernel's pointer argument; the ids stand in without one (never read then)."""
        return self.expert_map if self.expert_map is not None else self.topk_ids


def _weights_arg(weights: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """The routing weights (T, topk) as a kernel's pointer and strides; stand_in and zero strides without
    them (never read then: MUL_WEIGHT off)."""
    if weights is None:
        return stand_in, (0, 0)
    return weights, (weights.stride(0), weights.stride(1))


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def moe_gemm(cfg: MoeGemmConfig, a: torch.Tensor, a_strides: tuple[int, int], b: torch.Tensor, c: torch.Tensor,
             routing: Routing, num_experts: int, gated: bool, activation: str = "none",
             weights: torch.Tensor | None = None, sorted_blocks=None,
             counters: ArrivalCounters | None = None, pdl: int = 0) -> None:  # fmt: skip
    """Launch one stage into c; a is read through (stride_at, stride_aj, a.stride(-1)). c (split, S, N) of a
    split config gets each split's fp32 partial without the epilogue (the combine sums them); c (S, N)
    of a split config gets the finished rows: the splits' partials go to a scratch buffer and the last
    split of each tile sums them and applies the epilogue (`counters` count the arrivals).
    pdl (direct launches; CUDA sm90+ only): a programmatic dependent launch. 1: wait for the previous
    kernel before anything (stage 1). n > 1 (stage 2 after a direct stage 1 launched with pdl 1, or after
    any kernel that finishes before it starts): read the routing, pull the first n - 1 weight tiles into
    L2, then wait: the routing was written before the kernel just before this one, which waited for it."""
    if cfg.by_token:
        raise ValueError(f"{cfg.name} runs through moe_down_by_token, not moe_gemm")
    n = b.shape[2] // 2 if gated else b.shape[2]
    k = b.shape[1]
    fixup = cfg.split_k > 1 and c.dim() == 2
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    w, ws = _weights_arg(weights, c3)
    if cfg.split_k > 1 and not fixup and (weights is not None or activation != "none"):
        raise ValueError("split partials summed by the combine take no activation or routing weights")
    part = _empty((cfg.split_k, routing.n_slots, (2 if gated else 1) * n), c, torch.float32) if fixup else c3
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, FIXUP=fixup,
                  GATED=gated, ACT=ACTS[activation], MUL_WEIGHT=weights is not None, PREC=_prec(a.dtype),
                  num_warps=cfg.warps, num_stages=cfg.stages)  # fmt: skip
    strides = (*a_strides, a.stride(-1), b.stride(0), b.stride(1), b.stride(2), c3.stride(0), c3.stride(1),
               c3.stride(2), *ws, part.stride(0), part.stride(1))  # fmt: skip
    n_tiles = triton.cdiv(n, cfg.block_n)
    if cfg.direct:
        ids, emap = routing.topk_ids, routing.map_arg
        by_slot = routing.n_slots < num_experts  # a program per slot: the grid holds the experts hit, no more
        slots_p2 = max(16, triton.next_power_of_2(routing.n_slots))
        grid = (max(1, routing.n_slots) if by_slot else num_experts, n_tiles, cfg.split_k)
        locks = _locks(counters, grid[0] * n_tiles * triton.cdiv(slots_p2, cfg.block_m), c) if fixup else c3
        _moe_gemm_direct[grid](a, b, c3, w, part, locks, ids, emap, routing.n_slots, n, k, routing.tk, routing.topk,
                               routing.num_routed, routing.num_local_routed, ids.stride(0), ids.stride(1), *strides,
                               SLOTS=slots_p2, HAS_MAP=routing.expert_map is not None, BY_SLOT=by_slot,
                               FLAT_IDS=flat_ids(routing),
                               **common, **({"PDL": pdl, "launch_pdl": True} if pdl else {}))  # fmt: skip
    else:
        sorted_slots, block_expert = sorted_blocks
        grid = (block_expert.shape[0], n_tiles, cfg.split_k)
        locks = _locks(counters, grid[0] * n_tiles, c) if fixup else c3
        _moe_gemm_sorted[grid](a, b, c3, w, part, locks, sorted_slots, block_expert, routing.n_slots, n, k,
                               routing.tk, routing.topk, *strides, **common)  # fmt: skip


def flat_ids(routing: Routing) -> bool:
    """Slot s's router id is at s * stride(1): no shared experts and the ids' rows contiguous (slot_expert's
    FLAT)."""
    ids = routing.topk_ids
    return routing.shared == 0 and (ids.shape[0] <= 1 or ids.stride(0) == routing.topk * ids.stride(1))


def _locks(counters: ArrivalCounters | None, n: int, like: torch.Tensor) -> torch.Tensor:
    if counters is None:
        raise ValueError("a split moe_gemm into finished rows needs ArrivalCounters")
    return counters.get(n, like.device)


def combine(c: torch.Tensor, routing: Routing, topk_weights: torch.Tensor | None, out: torch.Tensor,
            rows: torch.Tensor | None = None) -> None:  # fmt: skip
    """out[t] = sum_j w[t, j] * C[t * TK + j] over the slots with a local expert (summing C's splits);
    NaN for a token with an out-of-range id. topk_weights None: the weights were applied in stage 1.
    rows (S,): C holds slot s at row rows[s] instead of row s (rows of other slots are never read)."""
    c3 = c if c.dim() == 3 else c.unsqueeze(0)
    n = c3.shape[2]
    ids, emap = routing.topk_ids, routing.map_arg
    w, ws = _weights_arg(topk_weights, out)
    block = min(1024, max(64, triton.next_power_of_2(n)))
    grid = (ids.shape[0], triton.cdiv(n, block))
    _combine[grid](c3, w, ids, emap, rows if rows is not None else ids, out, n, routing.tk, routing.topk,
                   routing.num_routed, routing.num_local_routed, ids.stride(0), ids.stride(1), *ws, c3.stride(0),
                   c3.stride(1), out.stride(0), SPLITS=c3.shape[0], TK_P2=max(2, triton.next_power_of_2(routing.tk)),
                   HAS_MAP=routing.expert_map is not None, MUL_WEIGHT=topk_weights is not None,
                   HAS_ROWS=rows is not None, BLOCK_N=block, num_warps=4)  # fmt: skip


def by_token_splits(split_k: int, tk: int) -> int:
    """The programs a by-token launch splits each token's tk routing columns over: at most split_k, each
    with cdiv(tk, split_k) columns, none left without one (tk 5 over 4: 3 splits of 2, 2 and 1)."""
    per = -(-max(1, tk) // max(1, split_k))
    return -(-max(1, tk) // per)


def moe_down_by_token(cfg: MoeGemmConfig, a: torch.Tensor, a_strides: tuple[int, int], b: torch.Tensor,
                      routing: Routing, weights: torch.Tensor | None, out: torch.Tensor,
                      counters: ArrivalCounters | None = None, pdl: int = 0) -> None:  # fmt: skip
    """Stage 2 and the combine in one launch (a `by_token` config): out (T, N) = sum over each token's slots
    of w * A[slot] @ B[e(slot)], B (E, K, N) with any strides, A read as moe_gemm reads it. weights None:
    applied in stage 1. A token with an out-of-range id gets NaN; slots of other ranks add nothing.
    cfg.split_k > 1 splits each token's routing columns over that many programs (`counters` count their
    arrivals; the last sums the partials). pdl > 1 as moe_gemm's (stage 2 after a PDL stage 1)."""
    ids, emap = routing.topk_ids, routing.map_arg
    w, ws = _weights_arg(weights, out)
    n, k = b.shape[2], b.shape[1]
    t = ids.shape[0]
    split = by_token_splits(cfg.split_k, routing.tk)
    grid = (t * triton.cdiv(n, cfg.block_n), split)
    if grid[0] == 0:
        return
    part = _empty((grid[0], split, cfg.block_n), out, torch.float32) if split > 1 else out
    locks = _locks(counters, grid[0], out) if split > 1 else out
    _moe_down_by_token[grid](a, b, w, out, part, locks, ids, emap, t, n, k, routing.tk, routing.topk,
                             routing.num_routed, routing.num_local_routed, ids.stride(0), ids.stride(1), *a_strides,
                             a.stride(-1), b.stride(0), b.stride(1), b.stride(2), *ws, out.stride(0),
                             TK_P2=max(2, triton.next_power_of_2(routing.tk)),
                             HAS_MAP=routing.expert_map is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                             BLOCK_K=cfg.block_k, MUL_WEIGHT=weights is not None, PREC=_prec(a.dtype), SPLIT=split,
                             num_warps=cfg.warps, num_stages=cfg.stages,
                             **({"PDL": pdl, "launch_pdl": True} if pdl else {}))  # fmt: skip
