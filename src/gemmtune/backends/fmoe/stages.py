"""Fused-MoE stage plumbing shared by the fmoe backends (fmoe/pytorch.py, fmoe/triton.py). A runner
computes one fused_moe call: runner(hidden (T, H), w1 (E, 2I, H), w2 (E, H, I), topk_weights (T, topk),
topk_ids (T, topk), expert_map (G,) or None) -> (T, H), bound to one MoeKey (activation,
doweight_stage1, shared experts).

A solution is two stages, named apart as aiter's table names them (kernelName1 | kernelName2):
  stage 1  gate+up GEMM and the gated activation (times the routing weight with doweight_stage1),
           into one intermediate row per slot (slot s = t * TK + j, kernels/fused_moe.py); a Triton
           stage 1 may split H (its last split of each tile finishes the rows), whatever stage 2 is;
  stage 2  down GEMM and the routing-weight combine into (T, H).
A stage is a Triton config (kernels/fused_moe.py: `moe1_...` / `moe2_...`) or `grouped_mm`
(torch._grouped_mm over the slots sorted by expert on the device). Any stage 1 runs with any
stage 2, and the two stages of a call share its routing work (local ids, sort, aligned blocks); the
tuner times the stages apart, then the best pairs whole (tuner/stages.py). What runs around
torch._grouped_mm (the sort by expert, gated activation, combine) is torch ops, or gemmtune's Triton
kernels with `triton_glue`: the torch backend runs the former, the triton backend the latter.

torch._grouped_mm runs without a host sync only on CUDA sm90/sm100 in bf16 (elsewhere on CUDA it
falls back to a loop that copies the group offsets to the host: not capturable) and on the CPU
(fp32/fp16/bf16, a loop). Its operands' row strides must be multiples of 16 bytes, so a grouped_mm
stage takes only keys whose hidden and intermediate sizes are multiples of 16 / itemsize; the rows it
multiplies are gathered into fresh (aligned) buffers, and rows past the last expert's group (slots
with no local expert, sorted last) are never written by it and never read after it.
"""

from __future__ import annotations

import torch

from ...device import NVIDIA, capability, triton_installed, triton_runs_on, vendor
from ...families.fmoe import MoeKey, StageOut, act_name
from ...kernels import fused_moe as kmoe
from ...kernels import moe_route
from ...kernels._common import pdl_enabled
from ...kernels.activations import ACTIVATIONS as ACT_MUL_ACTS
from ...kernels.activations import act_mul
from ...kernels.moe_align import moe_align
from ..base import Runner

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
GM = "grouped_mm"  # the name of a torch._grouped_mm stage (either stage)
# Programmatic dependent launch of the direct kernels (kernels/fused_moe.py moe_gemm's pdl), where the
# device runs it and a call has at most PDL_MAX_SLOTS slots: stage 1 waits for the router; stage 2 starts
# while stage 1 finishes and pulls its first PDL_STAGE2 - 1 weight tiles (2 x BLOCK_K x BLOCK_N a
# program) into L2 meanwhile. Measured on an H100 (default configs, top 8, CUDA graphs): at 1 and 2
# tokens 64 -> 69% / 76 -> 78% of the read roof (E=256 I=256 H=7168) and 48 -> 50% / 60 -> 64% (E=128
# I=384 H=2048); at 4 and 16 tokens it cost 8 points or more (stage 2's early programs hold SM slots
# stage 1 still needs), so those keep the plain launch.
PDL_STAGE1, PDL_STAGE2 = 1, 3
PDL_MAX_SLOTS = 16
Stage = kmoe.MoeGemmConfig | str  # a Triton config or GM


def _routing(key: MoeKey, topk_ids, expert_map) -> kmoe.Routing:
    local_routed = key.expert - key.shared_expert
    num_routed = expert_map.shape[0] if expert_map is not None else local_routed
    return kmoe.Routing(topk_ids, key.topk, key.shared_expert, num_routed, local_routed, expert_map)


def gated(key: MoeKey) -> bool:
    return bool(key.use_g1u1)


# ---- grouped_mm availability --------------------------------------------------------------------
def grouped_mm_usable(dtype: torch.dtype, device: torch.device) -> bool:
    """torch._grouped_mm runs here without a host sync: CUDA sm90/sm100 in bf16 (its CUTLASS path;
    other CUDA GPUs get a fallback that copies the offsets to the host), or the CPU (torch >= 2.9)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cuda":
        if vendor(device) != NVIDIA or dtype != torch.bfloat16:
            return False
        return capability(device)[0] in (9, 10)
    return device.type == "cpu" and dtype in TRITON_DTYPES and _torch_at_least(2, 9)


def _torch_at_least(major: int, minor: int) -> bool:
    v = torch.__version__.split("+")[0].split(".")
    return (int(v[0]), int(v[1])) >= (major, minor)


def grouped_mm_fits(key: MoeKey, device: torch.device) -> bool:
    """A grouped_mm stage can compute `key` here: unquantized, a usable dtype and device, and hidden
    and intermediate sizes whose row strides are multiples of 16 bytes (torch._grouped_mm's rule)."""
    if key.q_type != "QuantType.No" or key.q_dtype_w != key.dtype or not grouped_mm_usable(key.dtype, device):
        return False
    return all(d * key.dtype.itemsize % 16 == 0 for d in (key.model_dim, key.inter_dim))


expert_offsets = moe_route.expert_offsets  # (ops/moe.py's grouped_gemm uses it too)


# ---- one call, two stages -----------------------------------------------------------------------
class Call:
    """One call's tensors and routing; each derived piece is computed on first use and shared by the
    call's two stages."""

    def __init__(self, key: MoeKey, hidden, w1, w2, topk_weights, topk_ids, expert_map=None,
                 triton_glue: bool | None = None, sort_plan: dict | None = None,
                 counters: kmoe.ArrivalCounters | None = None):  # fmt: skip
        self.key, self.hidden, self.w1, self.w2, self.topk_weights = key, hidden, w1, w2, topk_weights
        self.counters = counters  # the runner's: split programs of either stage count their arrivals there
        self.r = _routing(key, topk_ids, expert_map)
        # Triton kernels for what runs around torch._grouped_mm (the sort by expert, gated activation,
        # combine): they read the router's ids themselves, so the local-id tensor is never built
        self.triton_glue = triton_runs_on(hidden.device) if triton_glue is None else triton_glue
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
    if not gated(key):
        return kmoe.act_ref(gu, act)
    if triton and act in ACT_MUL_ACTS:
        return act_mul(gu, act, impl="triton")
    return kmoe.act_ref(gu[:, : key.inter_dim], act) * gu[:, key.inter_dim :]


def _pdl(stage: Stage, r: kmoe.Routing, device: torch.device) -> bool:
    return stage.direct and r.n_slots <= PDL_MAX_SLOTS and pdl_enabled(device)


def _stage1(key: MoeKey, s1: Stage, call: Call) -> StageOut:
    if s1 == GM:
        srt = call.sorted
        gu = torch._grouped_mm(call.hidden[srt.tok], call.w1.transpose(1, 2), offs=srt.offs)
        h = _gate(key, gu, call.triton_glue)
        if key.doweight_stage1:
            h = h * call.weights.reshape(-1)[srt.perm].unsqueeze(-1).to(h.dtype)
        return StageOut(h, srt.inv)
    hidden, r = call.hidden, call.r
    h = kmoe._empty((r.n_slots, key.inter_dim), hidden)
    kmoe.moe_gemm(s1, hidden, (hidden.stride(0), 0), call.w1.transpose(1, 2), h, r, call.w1.shape[0], gated(key),
                  act_name(key.act_type), call.topk_weights if key.doweight_stage1 else None,
                  None if s1.direct else call.blocks(s1.block_m), call.counters,
                  pdl=PDL_STAGE1 if _pdl(s1, r, hidden.device) else 0)  # fmt: skip
    return StageOut(h)


def _stage2(key: MoeKey, s2: Stage, call: Call, inter: StageOut) -> torch.Tensor:
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
        return finish(key, y[srt.inv].float().view(*call.ids.shape, -1), call.ids, call.weights, hidden.dtype)
    h = inter.slot_order()
    pdl = PDL_STAGE2 if _pdl(s2, r, hidden.device) else 0
    if s2.by_token:
        out = kmoe._empty(out_shape, hidden)
        kmoe.moe_down_by_token(s2, h, (r.tk * h.stride(0), h.stride(0)), call.w2.transpose(1, 2), r, weights, out,
                               call.counters, pdl=pdl)  # fmt: skip
        return out
    c = kmoe._empty((s2.split_k, r.n_slots, key.model_dim), hidden, torch.float32 if s2.split_k > 1 else hidden.dtype)
    kmoe.moe_gemm(s2, h, (r.tk * h.stride(0), h.stride(0)), call.w2.transpose(1, 2), c, r, call.w2.shape[0], False,
                  "none", None, None if s2.direct else call.blocks(s2.block_m), pdl=pdl)  # fmt: skip
    out = kmoe._empty(out_shape, hidden)
    kmoe.combine(c, r, weights, out)
    return out


def pair_runner(key: MoeKey, s1: Stage, s2: Stage, triton_glue: bool | None = None) -> Runner:
    """The whole call: stage s1, then stage s2 (Triton configs or GM). triton_glue False keeps what runs
    around the grouped_mm stages in plain torch ops, True runs gemmtune's Triton kernels there (the
    sort, activation and combine); None: Triton's where Triton runs on the call's device."""

    # launch constants of the Triton sort, fixed by the key (tokens, topk, experts)
    plan = moe_route.sort_plan(key.slots, key.expert) if triton_installed() else None
    counters = kmoe.ArrivalCounters()

    def run(hidden, w1, w2, topk_weights, topk_ids, expert_map=None):
        call = Call(key, hidden, w1, w2, topk_weights, topk_ids, expert_map, triton_glue, plan, counters)
        return _stage2(key, s2, call, _stage1(key, s1, call))

    return run


def stage_runner(key: MoeKey, stage: int, s: Stage, triton_glue: bool | None = None) -> Runner:
    """One stage alone, as the tuner times it: stage 1 (*inputs) -> StageOut; stage 2
    (h (slots, I) in slot order, *inputs) -> (T, H). Each does its own routing work; triton_glue as
    pair_runner's."""
    counters = kmoe.ArrivalCounters()
    if stage == 1:
        return lambda *inputs: _stage1(key, s, Call(key, *inputs, triton_glue=triton_glue, counters=counters))
    return lambda h, *inputs: _stage2(key, s, Call(key, *inputs, triton_glue=triton_glue, counters=counters),
                                      StageOut(h))  # fmt: skip


def finish(key: MoeKey, contrib, ids, weights, out_dtype):
    """contrib (T, TK, H) fp32 per-slot results (unweighted unless doweight_stage1) -> (T, H)."""
    live = (ids >= 0).unsqueeze(-1)
    w = torch.where(ids >= 0, 1.0 if key.doweight_stage1 else weights, 0.0).unsqueeze(-1)
    out = torch.where(live, contrib * w, 0.0).sum(1)
    bad = (ids == kmoe.BAD_ID).any(1, keepdim=True)
    return torch.where(bad, float("nan"), out).to(out_dtype)


def stage_name(s: Stage) -> str:
    return s if isinstance(s, str) else s.name


def parse_stage(name: str, stage: int) -> Stage | None:
    """A stage name as a tuned row holds it: GM or a Triton config of that stage (None: neither)."""
    if name.strip() == GM:
        return GM
    cfg = kmoe.MoeGemmConfig.parse(name)
    return cfg if cfg is not None and cfg.stage == stage else None
