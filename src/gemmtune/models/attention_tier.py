"""The attention-tier rewrite: the model's config names gemmtune's tier in transformers' AttentionInterface
(models/attention.py describes the tiers)."""

from __future__ import annotations

import copy

from torch import nn

from . import attention
from .rewrite import Change, PlanContext, Rewrite


def _swap_config(model: nn.Module, old, new) -> None:
    for m in model.modules():
        if getattr(m, "config", None) is old:
            m.config = new


class AttentionTier(Rewrite):
    kind = "attention"
    # the tier is judged with the layers it runs in: a disagreement of the logits alone does not undo it
    kept_by_check = True

    def applies(self, arch, opts) -> bool:
        return arch is not None

    def plan(self, ctx: PlanContext) -> None:
        if ctx.stack is not None and ctx.tier is not None:
            ctx.add(self, "", ctx.model, f"{attention.NAMES[ctx.tier]} ({ctx.tier} tier) via AttentionInterface",
                    tier=ctx.tier)  # fmt: skip

    def apply(self, model: nn.Module, change: Change, report) -> None:
        change.data["registration"] = attention.registration()  # a torch.load'ed copy registers the tiers too
        old = model.config
        new = copy.deepcopy(old)  # private copy: models sharing the config object stay untouched
        new._attn_implementation = attention.NAMES[change.data["tier"]]
        _swap_config(model, old, new)
        change.data["old"] = old

    def undo(self, model: nn.Module, change: Change) -> str | None:
        _swap_config(model, model.config, change.data["old"])
        return None

    def on_sharded(self, model, sharding, change: Change):
        return sharding.calls_wrapped(change.path)  # a config every attention forward reads
