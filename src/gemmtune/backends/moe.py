"""Fused-MoE backends (family fmoe). A runner computes one fused_moe call:
runner(hidden (T, H), w1 (E, 2I, H), w2 (E, H, I), topk_weights (T, topk), topk_ids (T, topk),
expert_map (G,) or None) -> (T, H), bound to one MoeKey (activation, doweight_stage1, shared experts).

A solution is two stages, named apart as aiter's table names them (kernelName1 | kernelName2):
  stage 1  gate+up GEMM and the gated activation (times the routing weight with doweight_stage1),
           into one intermediate row per slot (slot s = t * TK + j, kernels/fused_moe.py);
  stage 2  down GEMM and the routing-weight combine into (T, H).
A stage is a Triton config (kernels/fused_moe.py: `moe1_...` / `moe2_...`) or `grouped_mm`
(torch._grouped_mm over the slots sorted by expert on the device). Any stage 1 runs with any
stage 2, and the two stages of a call share its routing work (local ids, sort, aligned blocks); the
tuner times the stages apart, then the best pairs whole (tuner/stages.py).
- torch backend: `grouped_mm|grouped_mm`, `dense|dense` (every expert on every token, masked:
  capturable anywhere, E times the FLOPs) and `loop|loop` (a Python loop over the experts hit: eager
  only, the plain reference formulation).
- triton backend: every pair with a Triton stage (the other one may be `grouped_mm`).

torch._grouped_mm runs without a host sync only on CUDA sm90/sm100 in bf16 (elsewhere on CUDA it
falls back to a loop that copies the group offsets to the host: not capturable) and on the CPU
(fp32/fp16/bf16, a loop). Its operands' row strides must be multiples of 16 bytes, so a grouped_mm
stage takes only keys whose hidden and intermediate sizes are multiples of 16 / itemsize; the rows it
multiplies are gathered into fresh (aligned) buffers, and rows past the last expert's group (slots
with no local expert, sorted last) are never written by it and never read after it.

An untuned key resolves to the torch backend's default_solution: on a CUDA GPU in 16-bit the grouped_mm
pair for many tokens per expert (prefers_grouped_mm) and the Triton heuristic pair otherwise, else
grouped_mm where it runs, else the loop (CPU) or dense.
"""

from __future__ import annotations

import functools
import os

import torch

from ..device import facts
from ..families.fmoe import MoeKey, StageOut, act_name, join_name, split_name
from ..kernels import fused_moe as kmoe
from ..kernels import moe_route
from ..kernels.activations import ACTIVATIONS as ACT_MUL_ACTS
from ..kernels.activations import act_mul
from ..kernels.moe_align import moe_align
from .base import Backend, Runner, Solution

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GM = "grouped_mm"  # the name of a torch._grouped_mm stage (either stage)
Stage = kmoe.MoeGemmConfig | str  # a Triton config or GM


def _routing(key: MoeKey, topk_ids, expert_map) -> kmoe.Routing:
    local_routed = key.expert - key.shared_expert
    num_routed = expert_map.shape[0] if expert_map is not None else local_routed
    return kmoe.Routing(topk_ids, key.topk, key.shared_expert, num_routed, local_routed, expert_map)


def _gated(key: MoeKey) -> bool:
    return bool(key.use_g1u1)


def _triton_runs_on(t: torch.Tensor) -> bool:
    """Triton kernels run on this tensor's device (the interpreter runs them on CPU tensors)."""
    return kmoe.HAS_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


# ---- grouped_mm availability --------------------------------------------------------------------
def grouped_mm_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """torch._grouped_mm runs here without a host sync: CUDA sm90/sm100 in bf16 (its CUTLASS path;
    other CUDA GPUs get a fallback that copies the offsets to the host), or the CPU (torch >= 2.9)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if torch.version.hip or dtype != torch.bfloat16:
            return False
        return facts(device).capability[0] in (9, 10)
    return device.type == "cpu" and dtype in TRITON_DTYPES and _torch_at_least(2, 9)


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


# Untuned keys with many tokens per expert run the grouped_mm pair (with the Triton glue): measured on
# an H100 (benchmarks/results/h100/fused_moe_op/), the tuner picked it for every key with
# >= 64 slots per expert hit and >= 1024 slots (Mixtral-8x7B tp1/tp2 and Qwen3-30B-A3B, T 1024 and
# 4096: 1.07-1.49x over the Triton heuristic pair). Below that the Triton pair won or tied, except on
# Mixtral tp2 at T 64 and 256 (grouped_mm 1.05-1.16x): tuning finds those.
GM_MIN_SLOTS, GM_MIN_PER_EXPERT = 1024, 64


def prefers_grouped_mm(key: MoeKey) -> bool:
    """Does an untuned `key` run the grouped_mm pair rather than the Triton heuristic pair (on a GPU
    where both run)?"""
    slots = key.token * (key.topk + key.shared_expert)
    return slots >= GM_MIN_SLOTS and slots / max(1, min(key.expert, slots)) >= GM_MIN_PER_EXPERT


def grouped_mm_fits(key: MoeKey, device: torch.device) -> bool:
    """A grouped_mm stage can compute `key` here: unquantized, a usable dtype and device, and hidden
    and intermediate sizes whose row strides are multiples of 16 bytes (torch._grouped_mm's rule)."""
    if key.q_type != "QuantType.No" or key.q_dtype_w != key.dtype or not grouped_mm_usable(key.dtype, device):
        return False
    return all(d * key.dtype.itemsize % 16 == 0 for d in (key.model_dim, key.inter_dim))


expert_offsets = moe_route.expert_offsets  # (ops/moe.py's grouped_gemm uses it too)


# ---- one call, two stages -----------------------------------------------------------------------
class _Call:
    """One call's tensors and routing; each derived piece is computed on first use and shared by the
    call's two stages."""

    def __init__(self, key: MoeKey, hidden, w1, w2, topk_weights, topk_ids, expert_map=None,
                 triton_glue: bool | None = None, sort_plan: dict | None = None):  # fmt: skip
        self.key, self.hidden, self.w1, self.w2, self.topk_weights = key, hidden, w1, w2, topk_weights
        self.r = _routing(key, topk_ids, expert_map)
        # Triton kernels for what runs around torch._grouped_mm (the sort by expert, gated activation,
        # combine): they read the router's ids themselves, so the local-id tensor is never built
        self.triton_glue = _triton_runs_on(hidden) if triton_glue is None else triton_glue
        self.sort_plan = sort_plan
        self._ids = self._weights = self._sorted = None
        self._blocks: dict[int, tuple] = {}

    @property
    def ids(self) -> torch.Tensor:
        """(T, TK) int32 local expert id of every slot (-1 other rank, -2 bad id)."""
        if self._ids is None:
            r = self.r
            self._ids = kmoe.local_expert_ids(r.topk_ids, r.num_routed, r.expert_map, r.shared, r.num_local_routed)
        return self._ids

    @property
    def weights(self) -> torch.Tensor:
        """(T, TK) fp32 routing weight of every slot (shared experts weigh 1)."""
        if self._weights is None:
            self._weights = kmoe.slot_weights(self.topk_weights, self.r.shared)
        return self._weights

    @property
    def sorted(self) -> moe_route.SortedSlots:
        """The slots sorted by expert (one Triton launch with triton_glue, else torch ops)."""
        if self._sorted is None:
            if self.triton_glue:
                self._sorted = moe_route.expert_sort(self.r, self.w1.shape[0], self.sort_plan)
            else:
                self._sorted = moe_route.expert_sort_torch(self.ids, self.w1.shape[0])
        return self._sorted

    def blocks(self, block_m: int):
        if block_m not in self._blocks:
            self._blocks[block_m] = moe_align(self.ids, self.w1.shape[0], block_m)
        return self._blocks[block_m]


def _gate(key: MoeKey, gu: torch.Tensor, triton: bool) -> torch.Tensor:
    """act(gate) * up of gate+up rows (one Triton pass with `triton`), or act(x) ungated."""
    act = act_name(key.act_type)
    if not _gated(key):
        return kmoe.act_ref(gu, act)
    if triton and act in ACT_MUL_ACTS:
        return act_mul(gu, act, impl="triton")
    return kmoe.act_ref(gu[:, : key.inter_dim], act) * gu[:, key.inter_dim :]


def _stage1(key: MoeKey, s1: Stage, call: _Call) -> StageOut:
    if s1 == GM:
        srt = call.sorted
        gu = torch._grouped_mm(call.hidden[srt.tok], call.w1.transpose(1, 2), offs=srt.offs)
        h = _gate(key, gu, call.triton_glue)
        if key.doweight_stage1:
            h = h * call.weights.reshape(-1)[srt.perm].unsqueeze(-1).to(h.dtype)
        return StageOut(h, srt.inv)
    hidden, r = call.hidden, call.r
    h = kmoe._empty((r.n_slots, key.inter_dim), hidden)
    kmoe.moe_gemm(s1, hidden, (hidden.stride(0), 0), call.w1.transpose(1, 2), h, r, call.w1.shape[0], _gated(key),
                  act_name(key.act_type), call.topk_weights if key.doweight_stage1 else None,
                  None if s1.direct else call.blocks(s1.block_m))  # fmt: skip
    return StageOut(h)


def _stage2(key: MoeKey, s2: Stage, call: _Call, inter: StageOut) -> torch.Tensor:
    hidden, r = call.hidden, call.r
    weights = None if key.doweight_stage1 else call.topk_weights
    out_shape = (hidden.shape[0], key.model_dim)
    if s2 == GM:
        srt = call.sorted
        # rows given: stage 1 was grouped_mm too, its rows are already in this call's sorted order
        x = inter.h if inter.rows is not None else inter.h[srt.perm]
        y = torch._grouped_mm(x, call.w2.transpose(1, 2), offs=srt.offs)
        if call.triton_glue:
            out = kmoe._empty(out_shape, hidden)
            kmoe.combine(y, r, weights, out, rows=srt.inv)
            return out
        return _finish(key, y[srt.inv].float().view(*call.ids.shape, -1), call.ids, call.weights, hidden.dtype)
    h = inter.slot_order()
    c = kmoe._empty((s2.split_k, r.n_slots, key.model_dim), hidden, torch.float32 if s2.split_k > 1 else hidden.dtype)
    kmoe.moe_gemm(s2, h, (r.tk * h.stride(0), h.stride(0)), call.w2.transpose(1, 2), c, r, call.w2.shape[0], False,
                  "none", None, None if s2.direct else call.blocks(s2.block_m))  # fmt: skip
    out = kmoe._empty(out_shape, hidden)
    kmoe.combine(c, r, weights, out)
    return out


def pair_runner(key: MoeKey, s1: Stage, s2: Stage, triton_glue: bool | None = None) -> Runner:
    """The whole call: stage s1, then stage s2 (Triton configs or GM). triton_glue False keeps the
    grouped_mm stages in plain torch ops (default: Triton's activation and combine where Triton runs)."""

    # launch constants of the Triton sort, fixed by the key (tokens, topk, experts)
    plan = moe_route.sort_plan(key.token * (key.topk + key.shared_expert), key.expert) if kmoe.HAS_TRITON else None

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        call = _Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map, triton_glue, plan)
        return _stage2(key, s2, call, _stage1(key, s1, call))

    return run


def stage_runner(key: MoeKey, stage: int, s: Stage) -> Runner:
    """One stage alone, as the tuner times it: stage 1 (*inputs) -> StageOut; stage 2
    (h (slots, I) in slot order, *inputs) -> (T, H). Each does its own routing work."""
    if stage == 1:
        return lambda *inputs: _stage1(key, s, _Call(key, *inputs))
    return lambda h, *inputs: _stage2(key, s, _Call(key, *inputs), StageOut(h))


# ---- torch --------------------------------------------------------------------------------------
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
        call = _Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        ids, weights = call.ids, call.weights
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
        call = _Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map)
        ids, weights = call.ids, call.weights
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


def grouped_mm_torch_runner(key: MoeKey) -> Runner:
    """grouped_mm for both stages in plain torch ops (the combine too): a torch._grouped_mm
    implementation of the whole MoE, the baseline benchmarks compare against."""
    return pair_runner(key, GM, GM, triton_glue=False)


LOOP = Solution("torch", join_name("loop", "loop"), 0, 0)
DENSE = Solution("torch", join_name("dense", "dense"), 0, 0)
GROUPED_MM = Solution("torch", join_name(GM, GM), 0, 0)
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
            if prefers_grouped_mm(key) and self.supports(GROUPED_MM, key, device):
                return GROUPED_MM
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
            return grouped_mm_fits(key, device)
        return solution in (LOOP, DENSE)

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        if solution.libtype == "triton":  # the heuristic default on GPUs (default_solution)
            return TritonMoeBackend().make_runner(solution, key, device)
        if solution == GROUPED_MM:
            return pair_runner(key, GM, GM)
        return {LOOP: _loop_runner, DENSE: _dense_runner}[solution](key)

    # stages: grouped_mm for either stage (pairs of two grouped_mm stages are this backend's)
    def stage_candidates(self, key: MoeKey, device: torch.device, stage: int) -> list[str]:
        return [GM] if grouped_mm_fits(key, device) else []

    def make_stage_runner(self, stage: int, name: str, key: MoeKey, device: torch.device) -> Runner:
        if name != GM:
            raise ValueError(f"not a torch fused-MoE stage: {name!r}")
        return stage_runner(key, stage, GM)

    def pair_solution(self, names: tuple[str, ...], key: MoeKey, device: torch.device) -> Solution | None:
        return GROUPED_MM if tuple(names) == (GM, GM) else None


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


def stage_configs(key: MoeKey, stage: int) -> list[kmoe.MoeGemmConfig]:
    """The distinct configs of one stage among sweep_configs' pairs, in their order (heuristic first)."""
    return list(dict.fromkeys(pair[stage - 1] for pair in sweep_configs(key)))


def stage_name(s: Stage) -> str:
    return s if isinstance(s, str) else s.name


def parse_stage(name: str, stage: int) -> Stage | None:
    """A stage name as a tuned row holds it: GM or a Triton config of that stage (None: neither)."""
    if name.strip() == GM:
        return GM
    cfg = kmoe.MoeGemmConfig.parse(name)
    return cfg if cfg is not None and cfg.stage == stage else None


def solution_of(s1: Stage, s2: Stage) -> Solution:
    """The Triton backend's solution for a pair with a Triton stage (solidx: its block_m; splitK: stage 2's)."""
    tri = s1 if s1 != GM else s2
    return Solution("triton", join_name(stage_name(s1), stage_name(s2)), tri.block_m, 1 if s2 == GM else s2.split_k)


@functools.cache
def _stages_of(kernel_name: str) -> tuple[Stage, Stage] | None:
    """(stage 1, stage 2) of a pair with at least one Triton stage, else None."""
    n1, n2 = split_name(kernel_name)
    s1, s2 = parse_stage(n1, 1), parse_stage(n2, 2)
    if s1 is None or s2 is None or s1 == s2 == GM:
        return None
    return s1, s2


def _triton_stage_ok(key: MoeKey) -> bool:
    return key.q_type == "QuantType.No" and key.dtype in TRITON_DTYPES and act_name(key.act_type) in kmoe.ACTS


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
        """Only the heuristic pair: the tuner draws every other pair from the stages timed apart."""
        return [self.default_solution(key, device)]

    def default_solution(self, key: MoeKey, device: torch.device) -> Solution:
        return solution_of(*heuristic_configs(key, _sm_count(device)))

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        stages = _stages_of(kernel_name)
        return solution_of(*stages) if stages else None

    def supports(self, solution: Solution, key: MoeKey, device: torch.device) -> bool:
        stages = _stages_of(solution.kernel_name)
        if stages is None or not _triton_stage_ok(key):
            return False
        if GM in stages and not grouped_mm_fits(key, device):
            return False
        slots = key.token * (key.topk + key.shared_expert)
        return all(s.fits(slots) for s in stages if s != GM)

    def make_runner(self, solution: Solution, key: MoeKey, device: torch.device) -> Runner:
        stages = _stages_of(solution.kernel_name)
        if stages is None:
            raise ValueError(f"not a Triton fused-MoE solution: {solution.kernel_name!r}")
        return pair_runner(key, *stages)

    # stages: every Triton config of the sweep, per stage
    def stage_candidates(self, key: MoeKey, device: torch.device, stage: int) -> list[str]:
        if not _triton_stage_ok(key):
            return []
        slots = key.token * (key.topk + key.shared_expert)
        return [c.name for c in stage_configs(key, stage) if c.fits(slots)]

    def make_stage_runner(self, stage: int, name: str, key: MoeKey, device: torch.device) -> Runner:
        s = parse_stage(name, stage)
        if s is None or s == GM:
            raise ValueError(f"not a Triton fused-MoE stage-{stage} config: {name!r}")
        return stage_runner(key, stage, s)

    def pair_solution(self, names: tuple[str, ...], key: MoeKey, device: torch.device) -> Solution | None:
        stages = _stages_of(join_name(*names))
        return solution_of(*stages) if stages else None
