"""The rewrites optimize() makes, in the order they are planned and applied (undone in reverse), and the
planner that runs them. Each rewrite decides from the architecture entry and the options whether it has
anything to plan (Rewrite.applies); models/rewrite.py describes the protocol."""

from __future__ import annotations

from torch import nn

from . import dense, moe_block
from .architectures import Architecture
from .attention_tier import AttentionTier
from .epilogue_mlp import EpilogueMlp
from .fp8_checkpoint import Fp8CheckpointLinears
from .linear import LinearRouting
from .mask_positions import OwnPositions
from .mla import MlaAbsorb
from .quant_feeds import QuantFeeds
from .quantize import QuantizeLinears
from .rewrite import Change, PlanContext, Rewrite

REWRITES: tuple[Rewrite, ...] = (
    AttentionTier(),  # first: the tier is the config every attention forward reads
    MlaAbsorb(),
    dense.QkvFusion(),
    dense.AttentionForward(),  # where q/k/v were fused
    moe_block.SharedExpertFold(),  # before the MLP rewrites: an unfolded block's shared experts are MLPs too
    dense.GateUpFusion(),
    dense.MlpForward(),  # where gate/up were fused (or come fused)
    moe_block.MoeExperts(),
    moe_block.Router(),
    dense.Norms(),
    dense.LayerForward(),  # where the norm after attention was swapped
    OwnPositions(),
    EpilogueMlp(),
    LinearRouting(),  # last of the module rewrites: every Linear the others leave alone
    # after the cached-path check, on the tree the rewrites above made
    QuantizeLinears(),
    QuantFeeds(),
    Fp8CheckpointLinears(),
)


def plan(model: nn.Module, arch: Architecture | None, opts: dict, report, tier: str | None) -> list[Change]:
    """Every Change of REWRITES for `model`, in order; nothing is touched yet."""
    ctx = PlanContext(model, arch, opts, report, tier)
    for rewrite in REWRITES:
        if rewrite.applies(arch, opts):
            rewrite.plan(ctx)
    return ctx.changes
