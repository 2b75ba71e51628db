"""Fused-MoE backends (family fmoe). A runner computes one fused_moe call:
runner(hidden (T, H), w1 (E, 2I, H), w2 (E, H, I), topk_weights (T, topk), topk_ids (T, topk),
expert_map (G,) or None) -> (T, H), bound to one MoeKey (activation, doweight_stage1, shared experts).

- torch: `grouped_mm` (torch._grouped_mm over slots sorted on the device: no host sync, capturable),
  `dense` (every expert on every token, masked: capturable anywhere, E times the FLOPs) and `loop`
  (a Python loop over the experts that were hit: eager only, the plain reference formulation).
- triton: kernels/fused_moe.py, one config per stage (kernelName1 / kernelName2).

An untuned key resolves to the torch backend's default_solution: the Triton heuristic config where
Triton runs (CUDA/ROCm, 16-bit), else grouped_mm where torch._grouped_mm runs, else the loop.
"""

from __future__ import annotations

import functools

import torch

from ..device import facts
from ..families.fmoe import MoeKey, act_name, join_name, split_name
from ..kernels import fused_moe as kmoe
from ..kernels.moe_align import moe_align
from .base import Backend, Runner, Solution

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _routing(key: MoeKey, topk_ids, expert_map) -> kmoe.Routing:
    local_routed = key.expert - key.shared_expert
    num_routed = expert_map.shape[0] if expert_map is not None else local_routed
    return kmoe.Routing(topk_ids, key.topk, key.shared_expert, num_routed, local_routed, expert_map)


def _gated(key: MoeKey) -> bool:
    return bool(key.use_g1u1)


# ---- torch --------------------------------------------------------------------------------------
def _slots(key: MoeKey, topk_weights, topk_ids, expert_map):
    r = _routing(key, topk_ids, expert_map)
    ids = kmoe.local_expert_ids(topk_ids, r.num_routed, expert_map, key.shared_expert, r.num_local_routed)
    return ids, kmoe.slot_weights(topk_weights, key.shared_expert)


def _expert_mlp(key: MoeKey, act: str, x, w1e, w2e, scale=None):
    """One expert on rows x (any batch dims): act(gate) * up, then down; `scale` per row if given."""
    inter = key.inter_dim
    gu = torch.matmul(x, w1e.transpose(-1, -2))
    h = kmoe.act_ref(gu[..., :inter], act) * gu[..., inter:] if _gated(key) else kmoe.act_ref(gu, act)
    if scale is not None:
        h = h * scale.unsqueeze(-1).to(h.dtype)
    return torch.matmul(h, w2e.transpose(-1, -2))


def _finish(key: MoeKey, contrib, ids, weights, out_dtype):
    """contrib (T, TK, H) fp32 per-slot results (unweighted unless doweight_stage1) -> (T, H)."""
    live = (ids >= 0).unsqueeze(-1)
    w = torch.where(ids >= 0, 1.0 if key.doweight_stage1 else weights, 0.0).unsqueeze(-1)
    out = torch.where(live, contrib * w, 0.0).sum(1)
    bad = (ids == kmoe.BAD_ID).any(1, keepdim=True)
    return torch.where(bad, float("nan"), out).to(out_dtype)


def _loop_runner(key: MoeKey) -> Runner:
    act = act_name(key.act_type)

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        ids, weights = _slots(key, topk_weights, topk_ids, expert_map)
        T, TK = ids.shape
        contrib = torch.zeros(T, TK, w2.shape[1], dtype=torch.float32, device=hidden.device)
        for e in torch.unique(ids[ids >= 0]).tolist():  # host sync: eager only
            t, j = torch.nonzero(ids == e, as_tuple=True)
            scale = weights[t, j] if key.doweight_stage1 else None
            contrib[t, j] = _expert_mlp(key, act, hidden[t], w1[e], w2[e], scale).float()
        return _finish(key, contrib, ids, weights, hidden.dtype)

    return run


def _dense_runner(key: MoeKey) -> Runner:
    act = act_name(key.act_type)

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        ids, weights = _slots(key, topk_weights, topk_ids, expert_map)
        T, TK = ids.shape
        x = hidden.unsqueeze(0).expand(w1.shape[0], T, hidden.shape[1])
        scale = None
        if key.doweight_stage1:  # the weight each expert's row gets (0 where the token did not pick it)
            hit = ids.unsqueeze(0) == torch.arange(w1.shape[0], device=ids.device).view(-1, 1, 1)
            scale = (hit * weights.unsqueeze(0)).sum(-1)
        y = _expert_mlp(key, act, x, w1, w2, scale).float()  # (E, T, H)
        contrib = y[ids.clamp(min=0).long(), torch.arange(T, device=ids.device).unsqueeze(1)]  # (T, TK, H)
        return _finish(key, contrib, ids, weights, hidden.dtype)

    return run


def grouped_mm_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """torch._grouped_mm runs here: CUDA sm80+ with bf16 (sm90 only before torch 2.9), or the CPU."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if torch.version.hip or dtype != torch.bfloat16:
            return False
        return facts(device).capability >= (9, 0) or _torch_at_least(2, 9)
    return device.type == "cpu" and _torch_at_least(2, 9)


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


def expert_offsets(ids_flat: torch.Tensor, num_experts: int):
    """Slots sorted by expert on the device: (perm, live_sorted (S, 1), offs (E,) int32 cumulative ends).
    Slots with no local expert sort last, past offs[-1], where torch._grouped_mm writes nothing."""
    e = torch.where(ids_flat >= 0, ids_flat.long(), num_experts)
    sorted_e, perm = torch.sort(e, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=e.device)
    counts.scatter_add_(0, e, torch.ones_like(e, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)
    return perm, (sorted_e < num_experts).unsqueeze(-1), offs


def _grouped_mm_runner(key: MoeKey) -> Runner:
    act = act_name(key.act_type)
    inter = key.inter_dim

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        ids, weights = _slots(key, topk_weights, topk_ids, expert_map)
        T, TK = ids.shape
        perm, live, offs = expert_offsets(ids.reshape(-1), w1.shape[0])
        gu = torch._grouped_mm(hidden[perm // TK], w1.transpose(1, 2), offs=offs)
        h = kmoe.act_ref(gu[:, :inter], act) * gu[:, inter:] if _gated(key) else kmoe.act_ref(gu, act)
        if key.doweight_stage1:
            h = h * weights.reshape(-1)[perm].unsqueeze(-1).to(h.dtype)
        y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
        y = torch.where(live, y.float(), 0.0)  # rows past the last expert are never written by the GEMM
        contrib = torch.zeros_like(y).index_copy_(0, perm, y).view(T, TK, -1)
        return _finish(key, contrib, ids, weights, hidden.dtype)

    return run


LOOP = Solution("torch", join_name("loop", "loop"), 0, 0)
DENSE = Solution("torch", join_name("dense", "dense"), 0, 0)
GROUPED_MM = Solution("torch", join_name("grouped_mm", "grouped_mm"), 0, 0)
_TORCH = {s.kernel_name: s for s in (LOOP, DENSE, GROUPED_MM)}


class TorchMoeBackend(Backend):
    name = "torch"
    family = "fmoe"

    def is_available(self, device: torch.device) -> bool:
        return True

    def candidates(self, key: MoeKey, device: torch.device) -> list[Solution]:
        return [s for s in (GROUPED_MM, DENSE, LOOP) if self.supports(s, key, device)]

    def default_solution(self, key: MoeKey, device: torch.device) -> Solution:
        tri = TritonMoeBackend()
        if tri.is_available(device) and device.type == "cuda" and key.dtype in (torch.float16, torch.bfloat16):
            return tri.default_solution(key, device)
        if self.supports(GROUPED_MM, key, device):
            return GROUPED_MM
        return LOOP if device.type == "cpu" else DENSE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return _TORCH.get(kernel_name)

    def supports(self, solution: Solution, key: MoeKey, device: torch.device) -> bool:
        if key.q_type != "QuantType.No" or key.q_dtype_w != key.dtype:
            return False
        if solution == GROUPED_MM:
            return grouped_mm_usable(key.dtype, device)
        return solution in (LOOP, DENSE)

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        if solution.libtype == "triton":  # the heuristic default on GPUs (default_solution)
            return TritonMoeBackend().make_runner(solution, key, device)
        return {LOOP: _loop_runner, DENSE: _dense_runner, GROUPED_MM: _grouped_mm_runner}[solution](key)


# ---- triton -------------------------------------------------------------------------------------
def _sm_count(device: torch.device) -> int:
    return facts(device).sms


def heuristic_configs(key: MoeKey, sms: int = 132) -> tuple[kmoe.MoeGemmConfig, kmoe.MoeGemmConfig]:
    """A reasonable (stage 1, stage 2) pair for an untuned key."""
    slots = key.token * (key.topk + key.shared_expert)
    hit = max(1, min(key.expert, slots))
    per_expert = slots / hit
    direct = slots <= 128
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 256 else 128
    big = bm >= 64
    bk = 64 if big else 128
    c1 = kmoe.MoeGemmConfig(1, direct, bm, 64 if not big else 128 if bm == 64 else 64, bk, 1, 4 if bm < 128 else 8,
                            3 if not big else 4)  # fmt: skip
    n_tiles = -(-key.model_dim // 64)
    programs = hit * n_tiles * max(1, -(-slots // hit // bm))
    sk = 1
    while sk < 8 and programs * sk * 2 <= 2 * sms and key.inter_dim // (2 * sk * bk) >= 2:
        sk *= 2
    c2 = kmoe.MoeGemmConfig(2, direct, bm, 64 if not big else 128, bk, sk, 4 if bm < 128 else 8, 3 if not big else 4)
    return c1, c2


def sweep_configs(key: MoeKey) -> list[tuple[kmoe.MoeGemmConfig, kmoe.MoeGemmConfig]]:
    """Candidate (stage 1, stage 2) pairs worth timing for `key` (the heuristic first)."""
    slots = key.token * (key.topk + key.shared_expert)
    out = [heuristic_configs(key)]
    modes = [True, False] if slots <= kmoe.DIRECT_MAX_SLOTS else [False]
    for direct in modes:
        for bm in (16, 32, 64, 128):
            if bm > 16 and bm >= 2 * max(16, slots):
                continue
            for bn, bk, w, s in ((64, 128, 4, 3), (128, 64, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3)):
                if bm == 128 and w == 4 and bn == 128:
                    continue
                for sk in (1, 2, 4) if bm <= 32 else (1,):
                    pair = (kmoe.MoeGemmConfig(1, direct, bm, bn, bk, 1, w, s),
                            kmoe.MoeGemmConfig(2, direct, bm, bn, bk, sk, w, s))  # fmt: skip
                    if pair not in out:
                        out.append(pair)
    # Nearest the heuristic first (block_m, then mode), so a short sweep tries the likely winners.
    h1 = out[0][0]
    rest = sorted(out[1:], key=lambda p: (abs(p[0].block_m.bit_length() - h1.block_m.bit_length()),
                                          p[0].direct != h1.direct))  # fmt: skip
    return out[:1] + rest


def solution_of(c1: kmoe.MoeGemmConfig, c2: kmoe.MoeGemmConfig) -> Solution:
    return Solution("triton", join_name(c1.name, c2.name), c1.block_m, c2.split_k)


@functools.cache
def _configs_of(kernel_name: str) -> tuple[kmoe.MoeGemmConfig, kmoe.MoeGemmConfig] | None:
    n1, n2 = split_name(kernel_name)
    c1, c2 = kmoe.MoeGemmConfig.parse(n1), kmoe.MoeGemmConfig.parse(n2)
    if c1 is None or c2 is None or c1.stage != 1 or c2.stage != 2:
        return None
    return c1, c2


def _triton_runner(key: MoeKey, c1: kmoe.MoeGemmConfig, c2: kmoe.MoeGemmConfig) -> Runner:
    act = act_name(key.act_type)
    gated = _gated(key)
    tk = key.topk + key.shared_expert
    inter, hid = key.inter_dim, key.model_dim
    same_blocks = not c1.direct and not c2.direct and c1.block_m == c2.block_m

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        r = _routing(key, topk_ids, expert_map)
        E = w1.shape[0]
        s = r.n_slots
        blocks1 = blocks2 = None
        if not (c1.direct and c2.direct):
            ids = kmoe.local_expert_ids(topk_ids, r.num_routed, expert_map, key.shared_expert, r.num_local_routed)
            blocks1 = None if c1.direct else moe_align(ids, E, c1.block_m)
            blocks2 = blocks1 if same_blocks else None if c2.direct else moe_align(ids, E, c2.block_m)
        h = kmoe._empty((s, inter), hidden)
        kmoe.moe_gemm(c1, hidden, (hidden.stride(0), 0), w1.transpose(1, 2), h, r, E, gated, act,
                      topk_weights if key.doweight_stage1 else None, blocks1)  # fmt: skip
        c = kmoe._empty((c2.split_k, s, hid), hidden, torch.float32 if c2.split_k > 1 else hidden.dtype)
        kmoe.moe_gemm(c2, h, (tk * inter, inter), w2.transpose(1, 2), c, r, E, False, "none", None, blocks2)
        out = kmoe._empty((hidden.shape[0], hid), hidden)
        kmoe.combine(c, r, None if key.doweight_stage1 else topk_weights, out)
        return out

    return run


class TritonMoeBackend(Backend):
    name = "triton"
    family = "fmoe"

    def is_available(self, device: torch.device) -> bool:
        return kmoe.HAS_TRITON and device.type == "cuda"

    def unavailable_reason(self, device: torch.device) -> str:
        if not kmoe.HAS_TRITON:
            return "triton is not installed"
        return "" if device.type == "cuda" else f"the Triton fused-MoE kernels run on CUDA/ROCm, not {device.type}"

    def candidates(self, key: MoeKey, device: torch.device) -> list[Solution]:
        slots = key.token * (key.topk + key.shared_expert)
        return [solution_of(c1, c2) for c1, c2 in sweep_configs(key) if c1.fits(slots) and c2.fits(slots)]

    def default_solution(self, key: MoeKey, device: torch.device) -> Solution:
        return solution_of(*heuristic_configs(key, _sm_count(device)))

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        cfgs = _configs_of(kernel_name)
        return solution_of(*cfgs) if cfgs else None

    def supports(self, solution: Solution, key: MoeKey, device: torch.device) -> bool:
        cfgs = _configs_of(solution.kernel_name)
        if cfgs is None or key.q_type != "QuantType.No" or key.dtype not in TRITON_DTYPES:
            return False
        slots = key.token * (key.topk + key.shared_expert)
        return all(c.fits(slots) for c in cfgs) and act_name(key.act_type) in kmoe.ACTS

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        cfgs = _configs_of(solution.kernel_name)
        if cfgs is None:
            raise ValueError(f"not a Triton fused-MoE solution: {solution.kernel_name!r}")
        return _triton_runner(key, *cfgs)
