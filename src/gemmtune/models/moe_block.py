"""The rewrites of a decoder layer's MoE block: the shared expert folded into the experts' call
(models/moe_shared.py), the experts through gemmtune.fused_moe and the router's top-k kernel (models/moe.py).
The block's experts, router and gate are the block's own: the Linear routing leaves them alone."""

from __future__ import annotations

from torch import nn

from . import moe, moe_shared
from .architectures import is_moe_block
from .rewrite import Change, ForwardSwap, PlanContext, join
from .sharding import ShardedChange, holds_some_experts

SHARED_EXPERTS = ("shared_expert", "shared_experts")  # an MoE block's always-on MLP: Qwen2-MoE's; DeepSeek's, GLM's
# the tensor-parallel plan of an experts module that fused_moe runs on this rank's slice of every expert
MOE_STYLES = {"": "moe_tp_experts", "gate_up_proj": "packed_colwise", "down_proj": "rowwise"}


def moe_blocks(ctx: PlanContext) -> list[tuple[str, nn.Module]]:
    """(path, block) of the decoder layers' MoE blocks."""
    out = []
    for lpath, layer in ctx.layers:
        block = getattr(layer, ctx.arch.mlp)
        if is_moe_block(block):
            out.append((join(lpath, ctx.arch.mlp), block))
    return out


def _experts_spec(ctx: PlanContext, path: str, block: nn.Module):
    return ctx.probe(("experts", path), lambda: moe.plan_experts(block.experts))


def _router(block: nn.Module) -> tuple[str | None, nn.Module | None]:
    name = moe.router_name(block)
    return name, getattr(block, name) if name is not None else None


def _router_spec(ctx: PlanContext, path: str, block: nn.Module):
    """The router's spec or why not; None where there is nothing to plan (no router, fused_ops=False)."""
    _, router = _router(block)
    if not ctx.opts["fused_ops"] or router is None:
        return None
    return ctx.probe(("router", path), lambda: moe.plan_router(router))


class SharedExpertFold(ForwardSwap):
    """Qwen2-MoE's gated shared expert joins the routed experts' fused_moe call: one call for all experts."""

    kind = "moe_fold"
    attrs = moe_shared.UNDO_ATTRS

    def applies(self, arch, opts) -> bool:
        return arch is not None and arch.moe and opts["fused_ops"]

    def plan(self, ctx: PlanContext) -> None:
        for path, block in moe_blocks(ctx):
            if not hasattr(block, "shared_expert_gate"):
                continue
            fold = moe_shared.plan(block, _experts_spec(ctx, path, block), _router_spec(ctx, path, block))
            if isinstance(fold, str):
                ctx.skip("moe_fold", path, block, fold)
                continue
            ctx.leave_subtree(join(path, "shared_expert"))
            ctx.add(self, path, block, fold.describe(), spec=fold)

    def install(self, mod: nn.Module, change: Change) -> None:
        moe_shared.apply(mod, change.data["spec"])

    def new_weights(self, change: Change) -> tuple[str, str] | None:
        return "folding shared experts into the experts", "fused_ops=False"


class MoeExperts(ForwardSwap):
    """The experts module's forward through gemmtune.fused_moe."""

    kind = "moe"
    attrs = ("forward", "_gemmtune_moe")

    def applies(self, arch, opts) -> bool:
        return arch is not None and arch.moe

    def plan(self, ctx: PlanContext) -> None:
        for path, block in moe_blocks(ctx):
            for child in block._modules:  # experts, router, shared-expert gate: left to the block
                if child not in SHARED_EXPERTS:
                    ctx.leave_linear(join(path, child))
                    ctx.leave_subtree(join(path, child))
            if ctx.planned(SharedExpertFold, path) is not None:
                continue
            spec = _experts_spec(ctx, path, block)
            if isinstance(spec, str):
                ctx.skip("moe", path, block, spec)
            else:
                detail = f"experts -> gemmtune.fused_moe ({spec.describe()})"
                ctx.add(self, join(path, "experts"), block.experts, detail, spec=spec)

    def install(self, mod: nn.Module, change: Change) -> None:
        moe.apply(mod, change.data["spec"])

    def on_sharded(self, model, sharding, change: Change):
        path = change.path
        if not sharding.under(path):
            return None, None
        if holds_some_experts(model.get_submodule(path)):
            return "expert parallel: each rank holds only some experts (their routing stays transformers')", None
        found = {n: sharding.style(join(path, n)) for n in MOE_STYLES}
        if found != MOE_STYLES:
            return f"tensor parallel: experts planned {found}, gemmtune swaps only {MOE_STYLES}", None
        return None, ShardedChange(sharding, rewrap=MOE_STYLES[""])


class Router(ForwardSwap):
    """The router's softmax (or grouped sigmoid) top-k in one kernel."""

    kind = "router"
    attrs = ("forward", "_gemmtune_router")

    def applies(self, arch, opts) -> bool:
        return arch is not None and arch.moe and opts["fused_ops"]

    def plan(self, ctx: PlanContext) -> None:
        for path, block in moe_blocks(ctx):
            if ctx.planned(SharedExpertFold, path) is not None:
                continue
            name, router = _router(block)
            rspec = _router_spec(ctx, path, block)
            if isinstance(rspec, str):
                ctx.skip("router", join(path, name), router, rspec)
            elif rspec is not None:
                ctx.add(self, join(path, name), router, rspec.summary(), spec=rspec)

    def install(self, mod: nn.Module, change: Change) -> None:
        moe.apply_router(mod, change.data["spec"])

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)
