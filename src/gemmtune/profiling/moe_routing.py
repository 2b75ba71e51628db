"""Which decode-parity steps a mixture-of-experts routing flip explains.

A MoE router picks each token's top k experts. Where two experts' scores are nearly tied, the last
bits of the router's input decide, and any implementation that rounds differently upstream (another
GEMM, a fused norm) will sometimes pick the other one. That step's logits then move by a whole expert's
share (0.08-0.12 relative on a 4-layer random-weight DeepSeek-V3, against 0.007 on the other steps),
and the next steps return, since the cache keeps only that one token's keys. A wrong kernel or a lost
cache moves every step; so a step over the tolerance is explained only when all of these hold:
- some MoE block routed differently from the reference on that step;
- at the first such block the contender's input was within the tolerance of the reference's input
  (the hidden state is right; only its rounding differs);
- the contender's own block, run on the reference's input, routes as the reference did (its router
  computes the same decision; the flip came from the input's rounding).

Transformers 5 MoE blocks call `self.experts(hidden (T, H), top_k_index (T, k), top_k_weights)`; the
block is the experts module's parent, and optimize() keeps both calls (a block that folds its shared
expert into the experts' call does not call its experts module: nothing of it is recorded or forced).

`ForcedRouting` replays the reference's routing: every experts call of the contender gets the
reference's top_k_index and top_k_weights of the same call, so a run under it cannot flip, and what
is left of its error is the arithmetic's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.architectures import is_moe_block


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, block, experts) for each MoE block, as optimize() recognizes them (architectures.is_moe_block)."""
    return [
        (name, mod, mod.experts)
        for name, mod in model.named_modules()
        if is_moe_block(mod) and isinstance(mod.experts, torch.nn.Module)
    ]


# the experts call's routing arguments: (position, keyword)
_ROUTING_ARGS = ((1, "top_k_index"), (2, "top_k_weights"))


def _arg(args, kwargs, index: int, name: str):
    return args[index] if len(args) > index else kwargs[name]


def _id_sets(ids: torch.Tensor) -> torch.Tensor:
    return ids.detach().sort(dim=-1).values  # a set per token: the order of the k is the router's own


def _ids_of(args, kwargs) -> torch.Tensor:
    return _id_sets(_arg(args, kwargs, *_ROUTING_ARGS[0]))


class _Hooks:
    """A context that removes the hooks it registered (self._handles) on exit."""

    def __init__(self) -> None:
        self._handles: list = []

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class RoutingTrace(_Hooks):
    """Records, per forward of each MoE block: its input and the experts its router chose (sorted per
    token). Entries are appended in call order; `calls[name]` indexes them per forward of the model."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = moe_blocks(model)
        self.inputs: dict[str, list[torch.Tensor]] = {n: [] for n, _, _ in self.blocks}
        self.ids: dict[str, list[torch.Tensor]] = {n: [] for n, _, _ in self.blocks}
        self.routing: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {n: [] for n, _, _ in self.blocks}
        super().__init__()

    def __enter__(self) -> RoutingTrace:
        for name, block, experts in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._keep_input(name)))
            self._handles.append(experts.register_forward_pre_hook(self._keep_ids(name), with_kwargs=True))
        return self

    def _keep_input(self, name):
        def hook(mod, args):
            self.inputs[name].append(args[0].detach().clone())

        return hook

    def _keep_ids(self, name):
        def hook(mod, args, kwargs):
            index, weights = (_arg(args, kwargs, i, k).detach().clone() for i, k in _ROUTING_ARGS)
            self.routing[name].append((index, weights))
            self.ids[name].append(_id_sets(index))

        return hook


class ForcedRouting(_Hooks):
    """While entered: each MoE block of `model` routes as `reference` (a RoutingTrace of another run of
    the same inputs) did on the same call. `complete` says, after, whether every block with recorded
    routing had every call forced."""

    def __init__(self, model: torch.nn.Module, reference: RoutingTrace):
        self.blocks = moe_blocks(model)
        self.reference = reference
        self.forced: dict[str, int] = {n: 0 for n, _, _ in self.blocks}
        super().__init__()

    def __enter__(self) -> ForcedRouting:
        for name, _, experts in self.blocks:
            if self.reference.routing.get(name):
                self._handles.append(experts.register_forward_pre_hook(self._force(name), with_kwargs=True))
        return self

    def _force(self, name):
        def hook(mod, args, kwargs):
            calls = self.reference.routing[name]
            n = self.forced[name]
            if n >= len(calls):
                return args, kwargs
            self.forced[name] = n + 1
            args, kwargs = list(args), dict(kwargs)
            for (index, key), value in zip(_ROUTING_ARGS, calls[n]):
                if len(args) > index:
                    args[index] = value
                else:
                    kwargs[key] = value
            return tuple(args), kwargs

        return hook

    @property
    def complete(self) -> bool:
        want = {n: len(c) for n, c in self.reference.routing.items() if c}
        return bool(want) and all(self.forced.get(n, 0) == k for n, k in want.items())


@dataclass
class Flip:
    step: int
    block: str
    input_rel_err: float  # the contender's block input vs the reference's, relative L2

    def describe(self) -> str:
        return f"step {self.step}: {self.block} (its input {self.input_rel_err:.2g} from the reference's)"


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref||, in fp32 (bench-model's per-step logits error too)."""
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm().clamp(min=1e-30)).item()


def routes_on(block: torch.nn.Module, experts: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts `block` picks for input x (sorted per token)."""
    seen: list[torch.Tensor] = []
    h = experts.register_forward_pre_hook(lambda m, a, kw: seen.append(_ids_of(a, kw)), with_kwargs=True)
    try:
        with torch.no_grad():
            block(x)
    finally:
        h.remove()
    return seen[0]


def explain(step: int, ref: RoutingTrace, got: RoutingTrace, contender: torch.nn.Module, tol: float) -> Flip | None:
    """The routing flip that explains `step` (one forward of the model in both traces), or None."""
    blocks = {n: (b, e) for n, b, e in moe_blocks(contender)}
    for name in ref.ids:
        if name not in got.ids or step >= min(len(ref.ids[name]), len(got.ids[name])) or name not in blocks:
            return None
        want, have = ref.ids[name][step], got.ids[name][step]
        if have.shape == want.shape and torch.equal(have, want):
            continue
        x_ref, x_got = ref.inputs[name][step], got.inputs[name][step]
        err = rel_l2(x_got, x_ref)
        if err > tol:
            return None  # the input itself is wrong: not a rounding flip
        block, experts = blocks[name]
        again = routes_on(block, experts, x_ref.to(next(block.parameters()).dtype))
        return Flip(step, name, err) if torch.equal(again.to(want.device), want) else None
    return None  # routing equal everywhere: the step's error is not a flip's
