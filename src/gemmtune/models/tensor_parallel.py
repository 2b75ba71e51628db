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
- a change is kept only where every rank planned it, the cached-path check's verdicts are decided
  together (a layer put back on every rank or none), and the tuned tables in effect must agree.

An optimized tensor-parallel model runs inference (no_grad, as generate() does): the fused projections
hold plain local shards, which autograd would not reduce.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

import torch
from torch import nn

# parallel styles whose wrapper gemmtune re-installs around a routed nn.Linear
LINEAR_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "rowwise_split_input")
FUSABLE_STYLE = "colwise"  # replicated input, this rank's slice of the output features
NORM_STYLE = "replicated_with_grad_allreduce"  # identity forward; the wrapper only reduces gradients
MOE_STYLES = {"": "moe_tp_experts", "gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
# changes whose forward calls the (still wrapped) submodules and touches no shard itself
CONTAINER_KINDS = ("attn", "mlp", "layer", "positions", "router", "attention")


def _dist():
    return torch.distributed if torch.distributed.is_available() and torch.distributed.is_initialized() else None


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no transformers tensor parallelism either
        return None
    return DTensor


def _generic(path: str) -> str:
    """model.layers.3.mlp -> model.layers.*.mlp, as transformers writes its plan's keys."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), path)


@dataclass
class Sharding:
    """What transformers did to a tensor-parallel model: its plan and TP mesh."""

    plan: dict
    mesh: object  # the TP DeviceMesh (None when the model is sharded but names no mesh)
    hooked: set = field(default_factory=set)  # module paths with a TP wrapper or DTensor parameters

    @property
    def group(self):
        return self.mesh.get_group() if self.mesh is not None else None

    def style(self, path: str) -> str | None:
        return self.plan.get(_generic(path))


def detect(model: nn.Module) -> Sharding | None:
    """The model's tensor-parallel sharding, or None for a model transformers did not shard."""
    dtensor = _dtensor_type()
    mesh = getattr(model, "_device_mesh", None)
    # the plan a model carries applies only where transformers set up a mesh (a class plan is always there)
    plan = dict(getattr(model, "tp_plan", None) or {}) if mesh is not None else {}
    hooked = set()
    for path, mod in model.named_modules():
        sharded = dtensor is not None and any(isinstance(p, dtensor) for p in mod._parameters.values())
        if sharded or _generic(path) in plan:
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
    dtensor = _dtensor_type()
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
@dataclass
class ShardedChange:
    """Change.data["tp"]: what to do around one planned change of a sharded module. `local`: the
    submodules (fusion parts) whose DTensor parameters become plain local shards; `rewrap`: the
    parallel style whose wrapper goes back around the module's new forward."""

    sharding: Sharding
    local: tuple[str, ...] = ()
    rewrap: str | None = None
    _forward: object = None  # transformers' wrapper, put back at undo
    _meta: dict = field(default_factory=dict)  # local path -> {param: (placements, shape, stride)}

    def apply(self, model: nn.Module, path: str, run) -> None:
        mod = model.get_submodule(path) if path else model
        dtensor = _dtensor_type()
        widths = []
        for name in self.local:
            part = mod.get_submodule(name)
            meta = {}
            for n, p in list(part._parameters.items()):
                if dtensor is not None and isinstance(p, dtensor):
                    meta[n] = (p.placements, tuple(p.shape), p.stride())
                    part._parameters[n] = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
            self._meta[name] = meta
            widths.append((part, part.out_features, part.in_features))
            part.out_features, part.in_features = part.weight.shape  # the fused parts' sizes: this rank's
        try:
            self._forward = mod.__dict__.pop("forward", None) if self.rewrap else None
            run()
        finally:
            for part, out_f, in_f in widths:
                part.out_features, part.in_features = out_f, in_f
        if self.rewrap:
            from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

            ALL_PARALLEL_STYLES[self.rewrap].install_forward(mod, self.sharding.mesh)

    def undo(self, model: nn.Module, path: str, run):
        why = run()
        try:
            mod = model.get_submodule(path) if path else model
        except AttributeError:
            return why
        if self.rewrap and self._forward is not None and "forward" not in mod.__dict__:
            mod.forward = self._forward
        from torch.distributed.tensor import DTensor

        for name, meta in self._meta.items():
            part = mod.get_submodule(name)
            for n, (placements, shape, stride) in meta.items():
                p = part._parameters.get(n)
                if p is not None and not isinstance(p, DTensor):
                    full = DTensor.from_local(p.data, self.sharding.mesh, placements, run_check=False,
                                              shape=torch.Size(shape), stride=stride)  # fmt: skip
                    part._parameters[n] = nn.Parameter(full, requires_grad=p.requires_grad)
        return why


def _why_not(model: nn.Module, sharding: Sharding, a) -> tuple[str | None, ShardedChange | None]:
    """(why this change cannot run on the sharded model, the ShardedChange it needs); (None, None) when it
    touches nothing sharded."""
    path, kind = a.path, a.kind
    style = sharding.style(path)
    inside = [p for p in sharding.hooked if p == path or p.startswith(path + ".") or not path]
    if kind == "fuse":
        parts = [f"{path}.{n}" for n in a.data["names"]]
        styles = [sharding.style(p) if p in sharding.hooked else None for p in parts]
        if all(s is None for s in styles):
            return None, None
        if any(s != FUSABLE_STYLE for s in styles):
            shown = ", ".join(f"{n} {s!r}" for n, s in zip(a.data["names"], styles))
            return f"tensor parallel: fusing needs every part {FUSABLE_STYLE!r}, the plan has {shown}", None
        return None, ShardedChange(sharding, local=tuple(a.data["names"]))
    if kind == "route":
        if path not in sharding.hooked:
            return None, None
        if style in LINEAR_STYLES:
            return None, ShardedChange(sharding, rewrap=style)
        return f"tensor parallel: plan entry {style!r} is not a linear style gemmtune routes", None
    if kind == "norm":
        if path not in sharding.hooked:
            return None, None
        if style == NORM_STYLE:
            return None, ShardedChange(sharding, rewrap=style if "forward" in _get(model, path).__dict__ else None)
        return f"tensor parallel: plan entry {style!r} on a norm", None
    if kind == "moe":
        if not inside:
            return None, None
        if _holds_some_experts(_get(model, path)):
            return "expert parallel: each rank holds only some experts (their routing stays transformers')", None
        found = {n: sharding.style(f"{path}.{n}" if n else path) for n in MOE_STYLES}
        if found != MOE_STYLES:
            return f"tensor parallel: experts planned {found}, gemmtune swaps only {MOE_STYLES}", None
        return None, ShardedChange(sharding, rewrap=MOE_STYLES[""])
    if kind in CONTAINER_KINDS:
        if path and path in sharding.hooked:
            return f"tensor parallel: the module itself is planned {style!r}", None
        return None, None
    if inside:
        return (
            f"tensor parallel: a {kind} change over sharded modules ({inside[0]} {sharding.style(inside[0])!r})",
            None,
        )
    return None, None


def _holds_some_experts(experts: nn.Module) -> bool:
    """Whether the experts' weights are split over the expert dimension (expert parallel) rather than
    each expert's width (tensor parallel)."""
    dtensor = _dtensor_type()
    for p in experts._parameters.values():
        if dtensor is not None and isinstance(p, dtensor) and p.ndim == 3:
            if any(getattr(pl, "dim", None) == 0 for pl in p.placements):
                return True
    return False


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path) if path else model


def _dependents(actions: list, dropped: list) -> list:
    """The changes that only work with a dropped one: a fused forward without its fusion (and the other
    way round), a fused layer without its norms."""
    gone = {(a.kind, a.path) for a in dropped}
    out = []
    for a in actions:
        if a in dropped:
            continue
        if a.kind in ("attn", "mlp") and ("fuse", a.path) in gone:
            out.append(a)
        elif a.kind == "fuse" and ({("attn", a.path), ("mlp", a.path)} & gone):  # the stock forward reads the parts
            out.append(a)
        elif a.kind == "layer" and any(k == "norm" and p.startswith(a.path + ".") for k, p in gone):
            out.append(a)
    return out


def plan(model: nn.Module, report, make_plan, *, check_tables: bool = True) -> list:
    """optimize()'s planning step: make_plan() as it is for a model transformers did not shard; for a
    tensor-parallel one, make_plan() over the local view, each change checked against the plan (and
    given what it needs around it, Change.data["tp"]), only the changes every rank planned kept, and the
    tables in effect checked identical on every rank. A collective: every rank calls it."""
    sharding = detect(model)
    if sharding is None:
        model.__dict__.pop(_SHARDING, None)
        return make_plan()
    dist = _dist()
    if dist is None or sharding.mesh is None:
        with local_view(model, sharding):
            actions = make_plan()
        kept = [a for a in actions if not _touches(sharding, a)]
        for a in actions:
            if a not in kept:
                report.retract(a.kind, a.path)
                report.skip(a.kind, a.path, "", "sharded by transformers but no torch.distributed TP mesh")
        return kept
    if check_tables:
        from ..dispatch import get_dispatcher

        get_dispatcher().check_tables_agree(sharding.group)
    with local_view(model, sharding):
        actions = make_plan()
    dropped, why = [], {}
    for a in actions:
        reason, change = _why_not(model, sharding, a)
        if reason is not None:
            dropped.append(a)
            why[id(a)] = reason
        elif change is not None:
            a.data["tp"] = change
    more = _dependents(actions, dropped)
    while more:
        for a in more:
            why[id(a)] = "tensor parallel: the change it builds on was left out"
        dropped += more
        more = _dependents(actions, dropped)
    mine = [(a.kind, a.path) for a in actions if a not in dropped]
    everyone: list = [None] * dist.get_world_size(sharding.group)
    dist.all_gather_object(everyone, mine, group=sharding.group)
    agreed = set.intersection(*(set(map(tuple, e)) for e in everyone))
    for a in actions:
        if a not in dropped and (a.kind, a.path) not in agreed:
            dropped.append(a)
            why[id(a)] = "tensor parallel: not planned on every rank"
    for a in dropped:
        report.retract(a.kind, a.path)
        report.skip(a.kind, a.path, type(_get(model, a.path)).__name__, why[id(a)])
    ranks = dist.get_world_size(sharding.group)
    report.notes.append(
        f"tensor parallel over {ranks} ranks: planned on this rank's shards, changes kept only where every "
        "rank planned them; transformers' all-reduces and gathers left in place"
    )
    model.__dict__[_SHARDING] = sharding
    return [a for a in actions if a not in dropped]


def _touches(sharding: Sharding, a) -> bool:
    path = a.path
    if a.kind == "fuse":
        return any(f"{path}.{n}" in sharding.hooked for n in a.data["names"])
    return any(p == path or p.startswith(path + ".") or not path for p in sharding.hooked)


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
