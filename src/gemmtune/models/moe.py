"""optimize() for sparse MoE blocks: the experts module's forward becomes one gemmtune.fused_moe call.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GraniteMoE, GLM-4-MoE and DeepSeek-V3 blocks in transformers
5.x route with their own router and call `self.experts(hidden (T, H), top_k_index (T, k),
top_k_weights (T, k))`, whose weights are gate_up_proj (E, 2I, H) (gate rows first) and down_proj
(E, H, I): fused_moe's own layout, so no weight is copied. The router's scaling (DeepSeek's
routed_scaling_factor) is already in top_k_weights. Qwen2-MoE's sigmoid-gated shared expert joins the
experts' call where the router's kernel runs (models/moe_shared.py folds the whole block); other
shared experts (DeepSeek's, GLM's; Qwen2-MoE's elsewhere) are dense MLPs to optimize() (api.py: fused
gate/up, the act*mul kernel); everything else in the block stays as it is.

The softmax top-k routers (Mixtral's, Qwen2/3-MoE's, OLMoE's: linear, softmax, top k, optional
renormalization) keep their linear and do the rest in one Triton kernel (kernels/moe_route.py) where
Triton runs; whether one renormalizes and the dtype of its weights are read off a probe of its own
forward. DeepSeek-V3's and GLM-4-MoE's grouped sigmoid routers (e_score_correction_bias, group-limited
top k, routed_scaling_factor) keep their fp32 linear and do the rest in another (about 15 small ops
stock). GraniteMoE's top-k-then-softmax router stays stock.

An experts module is taken only if its layout is the one above (checked per instance), its
activation is one fused_moe computes (probed), and fused_moe matches the module's own forward on a
probe routing (run on the module's device and dtype) within the dtype's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..device import triton_reason
from ..kernels.moe_route import group_scores, grouped_router_topk, grouping_reason, router_topk
from ..ops.moe import fused_moe
from .architectures import detect_act
from .bind import bind

_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class MoeSpec:
    activation: str
    experts: int
    inter: int
    probe_err: float

    def describe(self) -> str:
        return f"E={self.experts} I={self.inter} {self.activation}, probe err {self.probe_err:.1e}"


def _layout_reason(experts: nn.Module) -> str | None:
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor) or gu.dim() != 3 or down.dim() != 3:
        return "no 3-D gate_up_proj / down_proj expert weights"
    # transformers' own layout flags first: they name the reason (gpt-oss: biases, transposed, interleaved)
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}  # fmt: skip
    odd = [f"{k}={getattr(experts, k)}" for k, v in flags.items() if getattr(experts, k, v) != v]
    if odd:
        return f"experts layout not handled: {', '.join(odd)}"
    E, two_i, H = gu.shape
    if down.shape != (E, H, two_i // 2) or two_i % 2:
        return f"gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} are not (E, 2I, H) / (E, H, I)"
    if "forward" in experts.__dict__:
        return "its forward is already overridden on the instance"
    if gu.device.type == "meta":
        return "weights are not materialized (meta device)"
    if gu.dtype not in _TOL or down.dtype != gu.dtype:
        return f"expert weights are {gu.dtype}/{down.dtype}"
    return None


def _probe_inputs(experts: nn.Module, tokens: int = 6):
    gu = experts.gate_up_proj
    E, _, H = gu.shape
    g = torch.Generator(device="cpu").manual_seed(1234)
    k = min(2, E)
    x = torch.randn(tokens, H, generator=g).to(device=gu.device, dtype=gu.dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]).to(gu.device)
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1).to(gu.device)
    return x, ids, w


def plan_experts(experts: nn.Module) -> MoeSpec | str:
    """A MoeSpec when fused_moe can stand in for `experts`, else the reason it cannot."""
    why = _layout_reason(experts)
    if why is not None:
        return why
    gu = experts.gate_up_proj
    act = detect_act(getattr(experts, "act_fn", None), gu.device, gu.dtype)
    if act is None:
        return f"activation {type(getattr(experts, 'act_fn', None)).__name__} is not SiLU or GELU-tanh"
    x, ids, w = _probe_inputs(experts)
    with torch.no_grad():
        try:
            want = type(experts).forward(experts, x, ids, w)
            got = fused_moe(x, gu, experts.down_proj, w, ids, act)
        except Exception as exc:  # noqa: BLE001 - a block the probe cannot run is left alone
            return f"probe failed: {type(exc).__name__}: {exc}"
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
    if not err <= _TOL[gu.dtype]:
        return f"fused_moe differs from the module's forward on a probe (rel err {err:.2e})"
    return MoeSpec(act, gu.shape[0], gu.shape[1] // 2, err)


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    # The router's ids are in range by construction: no host-side id check on the hot path.
    out = fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index,
                    self._gemmtune_moe.activation, check_ids=False)  # fmt: skip
    return out


def apply(experts: nn.Module, spec: MoeSpec) -> None:
    experts._gemmtune_moe = spec
    experts.forward = bind(_experts_forward, experts)


def undo(experts: nn.Module) -> None:
    for attr in ("forward", "_gemmtune_moe"):
        experts.__dict__.pop(attr, None)


# ---- the top-k router -----------------------------------------------------------------------------
# linear -> softmax -> top k (-> renorm) routers
ROUTERS = ("Qwen3MoeTopKRouter", "MixtralTopKRouter", "Qwen2MoeTopKRouter", "OlmoeTopKRouter")
# fp32 linear -> sigmoid (+ correction bias) -> top groups -> top k -> (renorm) * scaling routers
GROUPED_ROUTERS = ("DeepseekV3TopkRouter", "Glm4MoeTopkRouter")


def router_name(block: nn.Module) -> str | None:
    """The attribute holding an MoE block's router ("gate" in most families, "router" in GraniteMoE)."""
    for name in ("gate", "router"):
        if isinstance(getattr(block, name, None), nn.Module):
            return name
    return None


@dataclass(frozen=True)
class RouterSpec:
    hidden: int
    top_k: int
    renorm: bool
    out_dtype: torch.dtype

    def describe(self) -> str:
        return f"top {self.top_k}{' renormalized' if self.renorm else ''} -> {str(self.out_dtype).split('.')[-1]}"

    def summary(self) -> str:
        return f"softmax/top-k in one kernel ({self.describe()})"


@dataclass(frozen=True)
class GroupedRouterSpec:
    hidden: int
    top_k: int
    n_group: int
    topk_group: int
    renorm: bool
    scale: float

    def describe(self) -> str:
        return (f"top {self.top_k} of the best {self.topk_group} of {self.n_group} groups"
                f"{', renormalized' if self.renorm else ''}, x{self.scale:g}")  # fmt: skip

    def summary(self) -> str:
        return f"sigmoid/grouped top-k in one kernel ({self.describe()})"


def _router_forward(self, hidden_states: torch.Tensor):
    spec = self._gemmtune_router
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
        return type(self).forward(self, hidden_states)  # the kernel has no backward
    logits = F.linear(hidden_states.reshape(-1, spec.hidden), self.weight)
    scores, ids = router_topk(logits, spec.top_k, spec.renorm, spec.out_dtype)
    return logits, scores, ids


def _grouped_router_forward(self, hidden_states: torch.Tensor):
    spec = self._gemmtune_router
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
        return type(self).forward(self, hidden_states)  # the kernel has no backward
    logits = F.linear(hidden_states.reshape(-1, spec.hidden).float(), self.weight.float())  # fp32, as the module
    scores, ids = grouped_router_topk(logits, self.e_score_correction_bias, spec.top_k, spec.n_group,
                                      spec.topk_group, spec.renorm, spec.scale)  # fmt: skip
    return logits, scores, ids


def _router_reason(router: nn.Module) -> str | None:
    if type(router).__name__ not in ROUTERS + GROUPED_ROUTERS:
        return f"{type(router).__name__} is not a router the kernels compute ({', '.join(ROUTERS + GROUPED_ROUTERS)})"
    w = getattr(router, "weight", None)
    k = getattr(router, "top_k", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not isinstance(k, int) or not 1 <= k <= w.shape[0]:
        return "no (experts, hidden) weight / top_k"
    if "forward" in router.__dict__:
        return "its forward is already overridden on the instance"
    if w.device.type == "meta":
        return "weights are not materialized (meta device)"
    why = triton_reason(w.device)
    if why:
        return f"the Triton top-k kernel cannot run: {why}"
    if w.dtype not in _TOL:
        return f"router weight is {w.dtype}"
    return None


def _distinct_rows(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Rows whose k + 1 largest probabilities all differ: their top k does not depend on tie order."""
    top = torch.topk(torch.softmax(logits.float(), -1), min(k + 1, logits.shape[1]), dim=-1).values
    return (top[:, :-1] > top[:, 1:]).all(1)


def plan_router(router: nn.Module) -> RouterSpec | GroupedRouterSpec | str:
    """A RouterSpec (GroupedRouterSpec) when the top-k kernel reproduces `router` (probed: same ids and
    dtypes, weights within the dtype's tolerance, on the probe tokens without ties), else the reason it
    cannot."""
    why = _router_reason(router)
    if why is not None:
        return why
    if type(router).__name__ in GROUPED_ROUTERS:
        return _plan_grouped_router(router)
    w, k = router.weight, router.top_k
    want = _probe(router)
    if isinstance(want, str):
        return want
    with torch.no_grad():
        rows = _distinct_rows(want[0], k)
        if not bool(rows.any()):
            return "every probe token has tied router probabilities"
        first = bool(getattr(router, "norm_topk_prob", True))
        for renorm in (first, not first):  # the attribute first; Mixtral renormalizes without one
            spec = RouterSpec(w.shape[1], k, renorm, want[1].dtype)
            scores, ids = router_topk(want[0], k, renorm, spec.out_dtype)
            if not torch.equal(ids[rows], want[2][rows]) or scores.dtype != want[1].dtype:
                continue
            if torch.allclose(scores[rows].float(), want[1][rows].float(), rtol=_TOL[w.dtype], atol=1e-6):
                return spec
    return "the top-k kernel differs from its forward on a probe"


def _probe(router: nn.Module) -> tuple | str:
    """(logits, weights, ids) of the router's own forward on 64 seeded probe tokens, or why it cannot give
    them as (T, E), (T, k), (T, k) int64."""
    w, k = router.weight, router.top_k
    g = torch.Generator(device="cpu").manual_seed(4321)
    x = torch.randn(4, 16, w.shape[1], generator=g).to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        try:
            want = type(router).forward(router, x)
        except Exception as exc:  # noqa: BLE001 - a router the probe cannot run is left alone
            return f"probe failed: {type(exc).__name__}: {exc}"
    T, E = 64, w.shape[0]
    ok = isinstance(want, tuple) and len(want) == 3 and want[0].shape == (T, E) and want[1].shape == (T, k)
    if not ok or want[2].shape != (T, k) or want[2].dtype != torch.int64:
        return "its forward does not return (logits (T, E), weights (T, k), ids (T, k) int64)"
    return want


def apply_router(router: nn.Module, spec: RouterSpec | GroupedRouterSpec) -> None:
    router._gemmtune_router = spec
    forward = _grouped_router_forward if isinstance(spec, GroupedRouterSpec) else _router_forward
    router.forward = bind(forward, router)


def _grouped_attrs(router: nn.Module) -> tuple | str:
    names = ("top_k", "n_group" if hasattr(router, "n_group") else "num_group", "topk_group", "norm_topk_prob",
             "routed_scaling_factor", "e_score_correction_bias")  # fmt: skip
    k, groups, topk_group, renorm, scale, bias = (getattr(router, n, None) for n in names)
    E = router.weight.shape[0]
    if not all(isinstance(v, int) for v in (k, groups, topk_group)) or not isinstance(renorm, bool):
        return "no top_k / group counts / norm_topk_prob"
    if not isinstance(scale, (int, float)) or not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (E,):
        return "no routed_scaling_factor / (experts,) e_score_correction_bias"
    why = grouping_reason(E, groups, topk_group, k)
    if why:
        return f"its grouping is not a grouping the kernel takes ({why})"
    return k, groups, topk_group, renorm, float(scale)


def _tie_free(choice: torch.Tensor, n_group: int, gap: float = 1e-5) -> torch.Tensor:
    """Rows whose expert choices, and the group scores built from them, are all apart by more than
    `gap`: their picks do not depend on rounding or on tie order."""

    def apart(v: torch.Tensor) -> torch.Tensor:
        s = v.sort(dim=-1, descending=True).values
        return ((s[:, :-1] - s[:, 1:]) > gap * s[:, :-1].abs().clamp_min(1)).all(1)

    return apart(choice) & apart(group_scores(choice, n_group))


def _plan_grouped_router(router: nn.Module) -> GroupedRouterSpec | str:
    attrs = _grouped_attrs(router)
    if isinstance(attrs, str):
        return attrs
    k, groups, topk_group, renorm, scale = attrs
    want = _probe(router)
    if isinstance(want, str):
        return want
    if want[0].dtype != torch.float32 or want[1].dtype != torch.float32:
        return "its forward does not return fp32 logits and weights"
    spec = GroupedRouterSpec(router.weight.shape[1], k, groups, topk_group, renorm, scale)
    bias = router.e_score_correction_bias
    with torch.no_grad():
        try:
            scores, ids = grouped_router_topk(want[0], bias, k, groups, topk_group, renorm, scale)
        except Exception as exc:  # noqa: BLE001 - a kernel the probe cannot run leaves the router alone
            return f"probe failed: {type(exc).__name__}: {exc}"
        rows = _tie_free(want[0].sigmoid() + bias.float(), groups)
        if not bool(rows.any()):
            return "every probe token has near-tied router scores"
        mine, order = ids[rows].sort(dim=1)
        theirs, their_order = want[2][rows].sort(dim=1)
        if not torch.equal(mine, theirs):
            return "the grouped top-k kernel picks other experts than its forward on a probe"
        if not torch.allclose(scores[rows].gather(1, order), want[1][rows].gather(1, their_order), rtol=1e-5,
                              atol=1e-7):  # fmt: skip
            return "the grouped top-k kernel's weights differ from its forward on a probe"
    return spec
