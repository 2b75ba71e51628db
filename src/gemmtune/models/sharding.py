"""What transformers did to a tensor-parallel model (its plan of parallel styles, its TP mesh, the
modules it sharded) and what runs around one planned change of a sharded module (ShardedChange).

Each Rewrite says in `on_sharded` whether and how its change runs on such a model (models/rewrite.py);
models/tensor_parallel.py is the planning step that asks them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn


def dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor has no transformers tensor parallelism either
        return None
    return DTensor


def generic(path: str) -> str:
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
        return self.plan.get(generic(path))

    def hooked_style(self, path: str) -> str | None:
        """The plan's style of the module at `path` where transformers sharded it (None: not sharded)."""
        return self.style(path) if path in self.hooked else None

    def under(self, path: str) -> list[str]:
        """The sharded modules at or inside `path` ("" : the whole model), sorted."""
        return sorted(p for p in self.hooked if not path or p == path or p.startswith(path + "."))

    def calls_wrapped(self, path: str) -> tuple[str | None, None]:
        """on_sharded of a change whose forward calls the module's (still wrapped) submodules and touches
        no shard itself: it runs unless the module itself is planned."""
        if path and path in self.hooked:
            return f"tensor parallel: the module itself is planned {self.style(path)!r}", None
        return None, None


def holds_some_experts(experts: nn.Module) -> bool:
    """Whether the experts' weights are split over the expert dimension (expert parallel) rather than
    each expert's width (tensor parallel)."""
    dtensor = dtensor_type()
    for p in experts._parameters.values():
        if dtensor is not None and isinstance(p, dtensor) and p.ndim == 3:
            if any(getattr(pl, "dim", None) == 0 for pl in p.placements):
                return True
    return False


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
        dtensor = dtensor_type()
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
