"""optimize() on a tensor-parallel transformers model (from_pretrained(..., distributed_config=
DistributedConfig(tp_size=N)) under torchrun).

transformers shards the planned modules' parameters as DTensors and replaces each one's forward by a
wrapper of its parallel style (ColwiseParallel, RowwiseParallel, MoeExpertsParallel ...): the inputs
are laid out before the module's own forward, the outputs reduced or gathered after it. gemmtune keeps
those wrappers and changes only what runs inside them:

- planning sees each rank's local shards (a planning view: local parameters, local in/out widths, the
  wrappers hidden), so fused widths, routed GEMM keys and MoE probes are the rank's own shapes;
- a routed linear, a swapped MoE experts block or a replicated q/k norm gets transformers' own wrapper
  installed again around gemmtune's forward, so every all-reduce / gather stays where transformers put it;
- q/k/v and gate/up fuse only when every part is plain `colwise` (replicated input, this rank's slice
  of the output): then the rank's local parts concatenated are the rank's shard of the fused weight and
  the fused output is what the parts gave together. Any other plan entry on a module a change touches
  is reported and the change left out;
- each rewrite says which of these holds for its change (Rewrite.on_sharded: by default a change over
  sharded modules is left out, never guessed) and which changes it builds on (Rewrite.needs: those go
  together);
- a change is kept only where every rank planned it, the cached-path check's verdicts are decided
  together (a layer put back on every rank or none), and the tuned tables in effect must agree.

An optimized tensor-parallel model runs inference (no_grad, as generate() does): the fused projections
hold plain local shards, which autograd would not reduce.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .sharding import ShardedChange, Sharding, dtensor_type, generic

NO_MESH = "sharded by transformers but no torch.distributed TP mesh"


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def detect(model: nn.Module) -> Sharding | None:
    """The model's tensor-parallel sharding, or None for a model transformers did not shard."""
    dtensor = dtensor_type()
    mesh = getattr(model, "_device_mesh", None)
    # the plan a model carries applies only where transformers set up a mesh (a class plan is always there)
    plan = dict(getattr(model, "tp_plan", None) or {}) if mesh is not None else {}
    hooked = set()
    for path, mod in model.named_modules():
        sharded = dtensor is not None and any(isinstance(p, dtensor) for p in mod._parameters.values())
        if sharded or generic(path) in plan:
            hooked.add(path)
    if not hooked:
        return None
    if mesh is not None and mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names and mesh.ndim > 1:
        mesh = mesh["tp"]
    return Sharding(plan, mesh, hooked)


def group_of(model: nn.Module):
    """The TP process group optimize() decides with (None: not a tensor-parallel model)."""
    sharding = model.__dict__.get(_SHARDING)
    return sharding.group if sharding is not None else None


_SHARDING = "_gemmtune_tp"


# ---- the planning view --------------------------------------------------------------------------
@contextlib.contextmanager
def local_view(model: nn.Module, sharding: Sharding):
    """Every sharded module as a plain one of this rank's shards while the planner looks: local
    parameters and widths, transformers' forward wrapper hidden; all put back exactly on exit."""
    dtensor = dtensor_type()
    saved = []
    try:
        for path in sharding.hooked:
            mod = model.get_submodule(path)
            params = {n: p for n, p in mod._parameters.items() if dtensor is not None and isinstance(p, dtensor)}
            widths = {n: getattr(mod, n) for n in ("in_features", "out_features") if hasattr(mod, n)}
            saved.append((mod, params, widths, mod.__dict__.pop("forward", None)))
            for n, p in params.items():
                mod._parameters[n] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
            if isinstance(mod, nn.Linear) and isinstance(mod.weight, torch.Tensor):
                mod.out_features, mod.in_features = mod.weight.shape
        yield
    finally:
        for mod, params, widths, forward in reversed(saved):
            mod._parameters.update(params)
            for n, v in widths.items():
                setattr(mod, n, v)
            if forward is not None:
                mod.forward = forward


# ---- the changes on sharded modules -------------------------------------------------------------
def _why_not(model: nn.Module, sharding: Sharding, change) -> tuple[str | None, ShardedChange | None]:
    """(why this change cannot run on the sharded model, the ShardedChange it needs): its rewrite's answer."""
    return change.rewrite.on_sharded(model, sharding, change)


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _dependents(changes: list, dropped: list) -> list:
    """The changes that only work with a dropped one (Rewrite.needs: a fused forward and its fusion, a
    fused layer and its norms)."""
    return [c for c in changes if c not in dropped and any(c.rewrite.needs(c, d) for d in dropped)]


def plan(model: nn.Module, report, make_plan, *, check_tables: bool = True) -> list:
    """optimize()'s planning step: make_plan() as it is for a model transformers did not shard; for a
    tensor-parallel one, make_plan() over the local view, each change checked by its rewrite against the
    plan (Rewrite.on_sharded, and given what it needs around it, Change.data["tp"]), only the changes
    every rank planned kept, and the tables in effect checked identical on every rank. A collective:
    every rank calls it."""
    sharding = detect(model)
    if sharding is None:
        model.__dict__.pop(_SHARDING, None)
        return make_plan()
    dist = _dist()
    alone = dist is None or sharding.mesh is None  # nothing can be re-wrapped or re-sharded without a mesh
    if check_tables and not alone:
        from ..dispatch import get_dispatcher

        get_dispatcher().check_tables_agree(sharding.group)
    with local_view(model, sharding):
        changes = make_plan()
    dropped, why = [], {}
    for c in changes:
        if alone:
            reason, around = (NO_MESH if sharding.under(c.path) else None), None
        else:
            reason, around = _why_not(model, sharding, c)
        if reason is not None:
            dropped.append(c)
            why[id(c)] = reason
        elif around is not None:
            c.data["tp"] = around
    more = _dependents(changes, dropped)
    while more:
        for c in more:
            why[id(c)] = "tensor parallel: the change it builds on was left out"
        dropped += more
        more = _dependents(changes, dropped)
    if not alone:
        mine = [(c.kind, c.path) for c in changes if c not in dropped]
        everyone: list = [None] * dist.get_world_size(sharding.group)
        dist.all_gather_object(everyone, mine, group=sharding.group)
        agreed = set.intersection(*(set(map(tuple, e)) for e in everyone))
        for c in changes:
            if c not in dropped and (c.kind, c.path) not in agreed:
                dropped.append(c)
                why[id(c)] = "tensor parallel: not planned on every rank"
    for c in dropped:
        report.retract(c.kind, c.path)
        report.skip(c.kind, c.path, type(_get(model, c.path)).__name__, why[id(c)])
    if alone:
        return [c for c in changes if c not in dropped]
    ranks = dist.get_world_size(sharding.group)
    report.notes.append(
        f"tensor parallel over {ranks} ranks: planned on this rank's shards, changes kept only where every "
        "rank planned them; transformers' all-reduces and gathers left in place"
    )
    model.__dict__[_SHARDING] = sharding
    return [c for c in changes if c not in dropped]


def decide_together(verdict, group):
    """The cached-path check's verdict of every rank of `group`, combined: a layer (or the logits) any
    rank found wrong is wrong on all of them (None: this process alone)."""
    dist = _dist()
    if group is None or dist is None:
        return verdict
    from .verify import combine

    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, verdict, group=group)
    return combine(everyone)
