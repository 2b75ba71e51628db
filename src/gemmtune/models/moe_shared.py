"""optimize() for MoE blocks with a gated shared expert (Qwen2-MoE): the routed experts and the shared
expert in one fused_moe call.

Qwen2-MoE's block computes experts(x, top-k routing) + sigmoid(shared_expert_gate(x)) * shared_expert(x),
its shared expert a gated MLP of intermediate size Is. A gated MLP is a sum over its intermediate
columns, so the shared expert is c = ceil(Is / I) experts of the routed experts' size I (the last one
padded with zero rows and columns, which add nothing: act(0) * 0 = 0), and every token goes to all c
with the weight sigmoid(gate). The folded block runs the router's linear with the gate's row appended
(one GEMV), the top-k kernel writing the k routed and c shared slots of each token
(kernels/moe_route.router_topk's `shared`), and one
fused_moe over E + c experts. That replaces the shared expert's two GEMMs and act*mul, the gate's N=1
GEMV, the sigmoid, the product and the sum (7 launches a layer) with c more experts in the call the
block makes anyway.

Memory: the folded tensors hold the routed experts, and the experts module's parameters become views of
their first E experts (same values, nothing held twice); the shared expert's weights are held a second
time (c experts' worth), the router's with one more row.

A block is folded only when its parts are what the fold assumes (bias-free Linears of the right shapes,
the shared expert's activation the experts'), the experts and router swaps themselves are possible
(models/moe.py plans them), and the folded computation matches the block's own forward on probe tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.moe_route import router_topk
from ..ops.moe import fused_moe
from .architectures import detect_act
from .bind import bind
from .moe import _TOL, MoeSpec, RouterSpec, router_name

UNDO_ATTRS = ("forward", "_gemmtune_moe_fold")
ROW_MULTIPLE = 8  # rows of the router's weight as the folded block stores it (aligned logits)
# The probe's tolerance, times the experts' (models/moe.py _TOL): the stock block rounds the shared expert's
# GEMMs, its act*mul, the sigmoid, the product and the sum to the model dtype, the folded call accumulates in
# fp32 (a bf16 Qwen2-MoE layer probed at 1.6e-2 on an H100, others at 5e-3); a fold that is wrong (a chunk,
# the gate, the activation) is off by order 1.
PROBE_TOL_FACTOR = 2.5
_SHARED_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class FoldPlan:
    """What plan() found: the experts' and router's specs, and the shared expert's chunk count."""

    experts: MoeSpec
    router: RouterSpec
    shared_inter: int
    chunks: int
    probe_err: float

    def describe(self) -> str:
        return (f"routed + shared experts -> one gemmtune.fused_moe (E={self.experts.experts} + shared "
                f"I={self.shared_inter} as {self.chunks} experts, {self.experts.activation}, sigmoid-gated; router "
                f"{self.router.describe()}; probe err {self.probe_err:.1e})")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Folded:
    """A folded block's tensors: w1 (E + c, 2I, H), w2 (E + c, H, I), router (E + 1, H)."""

    plan: FoldPlan
    w1: torch.Tensor
    w2: torch.Tensor
    router_weight: torch.Tensor


def _parts_reason(block: nn.Module, spec: MoeSpec) -> str | None:
    shared, gate = getattr(block, "shared_expert", None), getattr(block, "shared_expert_gate", None)
    if not isinstance(shared, nn.Module) or not isinstance(gate, nn.Module):
        return "no shared_expert / shared_expert_gate"
    if "forward" in block.__dict__ or "forward" in shared.__dict__:
        return "its forward is already overridden on the instance"
    lin = [getattr(shared, n, None) for n in _SHARED_MLP]
    if not all(type(m) is nn.Linear and m.bias is None for m in lin + [gate]):
        return "the shared expert or its gate is not bias-free nn.Linear gate_proj / up_proj / down_proj"
    w1 = block.experts.gate_up_proj
    H, dtype = w1.shape[2], w1.dtype
    Is = lin[0].out_features
    shapes = [tuple(m.weight.shape) for m in lin + [gate]]
    if shapes != [(Is, H), (Is, H), (H, Is), (1, H)]:
        return f"shared expert / gate weights {shapes} do not fit hidden size {H}"
    if any(m.weight.dtype != dtype or m.weight.device != w1.device for m in lin + [gate]):
        return "the shared expert's weights differ from the experts' in dtype or device"
    act = detect_act(getattr(shared, "act_fn", None), w1.device, dtype)
    if act != spec.activation:
        return f"the shared expert's activation ({act}) is not the experts' ({spec.activation})"
    return None


def _router_weight(block: nn.Module) -> torch.Tensor:
    """The router's E rows and the gate's, padded with zero rows to a multiple of ROW_MULTIPLE: the logits'
    rows stay 16-byte aligned (cuBLAS took 13.3 us for N=61 at 8 tokens, 4.9 us for N=64; H100, H=2048:
    benchmarks/experiments/exp_qwen2_moe_fold.py)."""
    w = torch.cat([getattr(block, router_name(block)).weight, block.shared_expert_gate.weight], dim=0)
    return F.pad(w, (0, 0, 0, -w.shape[0] % ROW_MULTIPLE))


def _shared_chunks(block: nn.Module, inter: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared expert as `chunks` experts of intermediate size `inter`: (c, 2I, H) gate rows first, (c, H, I)."""
    shared = block.shared_expert
    g, u, d = (getattr(shared, n).weight for n in _SHARED_MLP)
    Is, H = g.shape
    pad = chunks * inter - Is
    g, u = F.pad(g, (0, 0, 0, pad)), F.pad(u, (0, 0, 0, pad))  # zero rows: act(0) * 0 adds nothing
    d = F.pad(d, (0, pad))
    w1 = torch.cat([g.view(chunks, inter, H), u.view(chunks, inter, H)], dim=1)
    w2 = d.view(H, chunks, inter).transpose(0, 1)
    return w1, w2


def _route(logits: torch.Tensor, plan: FoldPlan):
    """(weights, ids) of the k routed and `chunks` shared slots from the padded logits (_router_weight)."""
    r = plan.router  # planned where the top-k kernel runs (models/moe.plan_router)
    return router_topk(logits[:, : plan.experts.experts + 1], r.top_k, r.renorm, r.out_dtype, plan.chunks)


def plan(block: nn.Module, spec: MoeSpec | str, rspec) -> FoldPlan | str:
    """A FoldPlan when the block's shared expert can join its experts' fused_moe call, else why not."""
    if isinstance(spec, str) or not isinstance(rspec, RouterSpec):
        return "the experts or the softmax top-k router stay stock"
    why = _parts_reason(block, spec)
    if why is not None:
        return why
    Is = block.shared_expert.gate_proj.out_features
    fold = FoldPlan(spec, rspec, Is, math.ceil(Is / spec.inter), 0.0)
    err = _probe(block, fold)
    if isinstance(err, str):
        return err
    if not err <= PROBE_TOL_FACTOR * _TOL[block.experts.gate_up_proj.dtype]:
        return f"the folded block differs from its forward on a probe (rel err {err:.2e})"
    return dataclasses.replace(fold, probe_err=err)


def _probe(block: nn.Module, fold: FoldPlan) -> float | str:
    """Relative error of the folded computation against the block's own forward on 12 seeded tokens. Only
    the experts those tokens pick are stacked (ids renumbered): the probe holds no copy of every expert."""
    experts = block.experts
    E, _, H = experts.gate_up_proj.shape
    p = experts.gate_up_proj
    g = torch.Generator(device="cpu").manual_seed(2468)
    x = torch.randn(1, 12, H, generator=g).to(device=p.device, dtype=p.dtype)
    with torch.no_grad():
        try:
            want = type(block).forward(block, x)
            w, ids = _route(F.linear(x[0], _router_weight(block)), fold)
            used, local = torch.unique(ids[:, : fold.router.top_k], return_inverse=True)
            s1, s2 = _shared_chunks(block, fold.experts.inter, fold.chunks)
            w1 = torch.cat([experts.gate_up_proj[used], s1])
            w2 = torch.cat([experts.down_proj[used], s2])
            shared_ids = ids[:, fold.router.top_k :] - E + used.numel()
            got = fused_moe(x[0], w1, w2, w, torch.cat([local, shared_ids], dim=1), fold.experts.activation)
        except Exception as exc:  # noqa: BLE001 - a block the probe cannot run is left alone
            return f"probe failed: {type(exc).__name__}: {exc}"
    if not isinstance(want, torch.Tensor) or want.shape != x.shape:
        return "its forward does not return the hidden states' shape"
    return ((got.float() - want[0].float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def apply(block: nn.Module, fold: FoldPlan) -> None:
    """Build the folded tensors (the experts' parameters become views of them) and swap the block's forward."""
    experts = block.experts
    E = experts.gate_up_proj.shape[0]
    with torch.no_grad():
        s1, s2 = _shared_chunks(block, fold.experts.inter, fold.chunks)
        w1 = torch.cat([experts.gate_up_proj, s1])
        w2 = torch.cat([experts.down_proj, s2])
        for name, big in (("gate_up_proj", w1), ("down_proj", w2)):
            old = getattr(experts, name)
            setattr(experts, name, nn.Parameter(big[:E], requires_grad=old.requires_grad))
    block._gemmtune_moe_fold = Folded(fold, w1, w2, _router_weight(block).detach())
    block.forward = bind(_folded_forward, block)


def _folded_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    f: Folded = self._gemmtune_moe_fold
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        return type(self).forward(self, hidden_states)  # the kernels have no backward
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    w, ids = _route(F.linear(x, f.router_weight), f.plan)
    # The router's ids are in range by construction: no host-side id check on the hot path.
    out = fused_moe(x, f.w1, f.w2, w, ids, f.plan.experts.activation, check_ids=False)
    return out.view(hidden_states.shape)
