"""The protocol every change optimize() makes follows: a Rewrite plans, applies and undoes.

A Rewrite reads the module tree through a PlanContext and plans Changes (each named by its module's
path, so a deep-copied optimized model restores itself, not the original), reporting what it changes
and why it leaves a part alone; applying and undoing a Change is the Rewrite's job too. The planner
(models/plan.py) runs one ordered list of Rewrites; restore() undoes the applied Changes in reverse.
On a tensor-parallel model a Rewrite also says how its change runs over sharded modules (on_sharded)
and which other changes it works only with (needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ..model_types import REGISTRY
from . import architectures
from .bind import bound_function
from .sharding import ShardedChange, Sharding


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def find(model: nn.Module, path: str) -> nn.Module | None:
    """The module at `path`, or None where the tree no longer has one."""
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


@dataclass
class Change:
    rewrite: Rewrite
    path: str  # the module changed, by path ("" for the model itself)
    data: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.rewrite.kind


class Rewrite(ABC):
    """One kind of change. Subclasses set `kind` (the report's word for it) and implement plan / apply / undo."""

    kind = ""
    # applied after optimize()'s cached-path check, on the tree the other changes made (quantization)
    after_check = False
    # a model-wide setting the check keeps when only the logits disagree (the attention tier)
    kept_by_check = False

    def applies(self, arch: architectures.Architecture | None, opts: dict) -> bool:
        """Whether this rewrite has anything to plan for the architecture entry and optimize()'s options."""
        return True

    @abstractmethod
    def plan(self, ctx: PlanContext) -> None:
        """Add a Change (ctx.add) for each module this rewrite would change, and report each one it
        leaves alone with the reason (ctx.skip). Nothing is touched yet."""

    @abstractmethod
    def apply(self, model: nn.Module, change: Change, report) -> None:
        """Make one planned change."""

    @abstractmethod
    def undo(self, model: nn.Module, change: Change) -> str | None:
        """Undo an applied change; returns why not where the module tree changed since (None: done)."""

    def new_weights(self, change: Change) -> tuple[str, str] | None:
        """(what makes new weight tensors, the option that leaves it out) when applying makes them."""
        return None

    def on_sharded(
        self, model: nn.Module, sharding: Sharding, change: Change
    ) -> tuple[str | None, ShardedChange | None]:
        """On a tensor-parallel model (models/tensor_parallel.py, seen through its local view): (why the
        change cannot run there, what it needs around it); (None, None) where it runs as planned. A change
        over sharded modules is left out unless its rewrite says how it runs on them: never guessed."""
        inside = sharding.under(change.path)
        if not inside:
            return None, None
        where = f"{inside[0]} {sharding.style(inside[0])!r}"
        return f"tensor parallel: a {self.kind} change over sharded modules ({where})", None

    def needs(self, change: Change, other: Change) -> bool:
        """Whether `change` works only with `other` applied too (a fused forward and its fusion, a fused
        layer and its norms): where `other` is left out, `change` is left out with it."""
        return False


class ForwardSwap(Rewrite):
    """A rewrite that installs attributes in a module's __dict__ (its forward first): undone by removing them."""

    attrs: tuple[str, ...] = ("forward",)

    def apply(self, model: nn.Module, change: Change, report) -> None:
        self.install(model.get_submodule(change.path) if change.path else model, change)

    @abstractmethod
    def install(self, mod: nn.Module, change: Change) -> None:
        """Put the change's attributes (its forward first) on the module."""

    def undo(self, model: nn.Module, change: Change) -> str | None:
        mod = find(model, change.path)
        if mod is None:
            return None  # restore() names the missing module once
        if not any(k in mod.__dict__ for k in self.attrs[1:]) and bound_function(mod) is None:
            return None  # a module put there after optimize(): nothing of gemmtune's on it
        for attr in self.attrs:
            mod.__dict__.pop(attr, None)
        return None


class Deferred(Rewrite):
    """A rewrite whose changes are found while applying, on the tree the earlier changes made: its one
    Change names the model, apply() reports what it changes and keeps the callable that undoes it."""

    after_check = True

    def plan(self, ctx: PlanContext) -> None:
        ctx.defer(self, **self.settings(ctx.opts))

    def settings(self, opts: dict) -> dict:
        return {}

    def apply(self, model: nn.Module, change: Change, report) -> None:
        change.data["undo"] = self.run(model, change, report)

    @abstractmethod
    def run(self, model: nn.Module, change: Change, report) -> Callable[[], None]:
        """Make the changes on the current tree, report them, and return what undoes them."""

    def undo(self, model: nn.Module, change: Change) -> str | None:
        change.data["undo"]()
        return None


class PlanContext:
    """What the rewrites plan with: the model, its architecture entry, optimize()'s options, the report,
    the decoder layers of the entry's layout, the Changes planned so far and the probes they share."""

    def __init__(self, model: nn.Module, arch: architectures.Architecture | None, opts: dict, report, tier):
        self.model, self.arch, self.opts, self.report, self.tier = model, arch, opts, report, tier
        stack = architectures.decoder_stack(model)
        self.stack = stack if arch is not None else None  # (path, module) holding `layers`
        self.layers: list[tuple[str, nn.Module]] = []  # (path, layer) of the layers in the entry's layout
        self.changes: list[Change] = []
        self._at: dict[tuple[type, str], Change] = {}
        self._probes: dict = {}
        self.no_route: set[str] = set()  # module paths whose nn.Linear must not be routed
        self.no_route_prefixes: list[str] = []  # subtrees left alone (MoE experts)
        if self.stack is None:
            mt = getattr(getattr(model, "config", None), "model_type", "?")
            entry = REGISTRY.get(mt)
            if arch is None and entry is not None:  # a registry type without a layout says what it gets instead
                why = f"model_type {mt!r} has no optimize() layout: {entry.not_optimized}"
            else:
                why = f"model_type {mt!r} is not a known architecture: plain Linear routing only"
            self.skip("architecture", "", model, why)
            return
        spath, smod = self.stack
        pre = arch.prefix
        for i, layer in enumerate(smod.layers):
            path = join(spath, "layers", str(i))
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, arch.mlp, None)
            if type(layer).__name__ != f"{pre}DecoderLayer" or type(attn).__name__ != f"{pre}Attention" or mlp is None:
                self.skip("layer", path, layer, f"layout is not {pre}DecoderLayer/{pre}Attention: Linear routing only")
            else:
                self.layers.append((path, layer))

    def add(self, rewrite: Rewrite, path: str, mod: nn.Module, detail: str, **data) -> Change:
        change = Change(rewrite, path, data)
        self.changes.append(change)
        self._at[(type(rewrite), path)] = change
        self.report.change(rewrite.kind, path, type(mod).__name__, detail)
        return change

    def defer(self, rewrite: Rewrite, **data) -> None:
        self.changes.append(Change(rewrite, "", data))

    def skip(self, kind: str, path: str, mod: nn.Module, why: str) -> None:
        self.report.skip(kind, path, type(mod).__name__, why)

    def planned(self, rewrite: type[Rewrite], path: str) -> Change | None:
        """The Change a rewrite of that class planned for `path`, if any."""
        return self._at.get((rewrite, path))

    def probe(self, key, compute: Callable):
        """compute(), once per key: a probe two rewrites need (a norm's formula, an MoE block's experts)."""
        if key not in self._probes:
            self._probes[key] = compute()
        return self._probes[key]

    def norm_spec(self, path: str, mod: nn.Module) -> architectures.NormSpec | str:
        return self.probe(("norm", path), lambda: architectures.detect_norm(mod))

    def rope_kind(self, fn, ref) -> str:
        if not self.opts["fused_ops"]:
            return ""
        device, dtype = ref.device, ref.dtype
        return self.probe(("rope", fn, device, dtype), lambda: architectures.detect_rope(fn, device, dtype))

    def leave_linear(self, path: str) -> None:
        self.no_route.add(path)

    def leave_subtree(self, path: str) -> None:
        self.no_route_prefixes.append(path + ".")

    def left_alone(self, path: str) -> bool:
        """Whether a rewrite keeps the Linear routing away from `path`."""
        return path in self.no_route or any(path.startswith(p) for p in self.no_route_prefixes)
