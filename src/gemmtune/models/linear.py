"""Route nn.Linear calls (and fused projections) through gemmtune.gemm.

A routed layer keeps its class, parameters and state_dict keys; only the instance's `forward` is
replaced, so other models in the process are untouched and `restore` just deletes the override.
Guards keep the stock path wherever gemm would not give the stock answer: dtype mixes, autocast,
dtypes gemm does not take (float64, fp8, integers), small M under an M-threshold, and any exception
from the gemmtune path (logged once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .bind import bind
from .rewrite import Change, PlanContext, Rewrite, find
from .sharding import ShardedChange

log = logging.getLogger("gemmtune")
# transformers' parallel styles of one nn.Linear: a routed one gets the style's wrapper back around its forward
LINEAR_STYLES = ("colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_rep", "rowwise_split_input")
_warned: set[str] = set()


@dataclass(frozen=True)
class RouteOptions:
    m_threshold: int | None = None  # M below this keeps F.linear (the vendor path)
    split_bias: bool = False  # run a bias-free GEMM and add the bias after (backends without bias)


def route_options(opts: dict) -> RouteOptions:
    """The RouteOptions of optimize()'s options."""
    return RouteOptions(opts["m_threshold"], opts["split_bias"])


_gemm_fn: list = []


def _gemm():
    if not _gemm_fn:
        from ..ops import gemm  # late: the ops module pulls in the dispatcher

        _gemm_fn.append(gemm)
    return _gemm_fn[0]


# gemmtune.gemm's dtypes (ops.gemm.DTYPES; not imported here, the ops module pulls in the dispatcher).
_GEMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Any autocast region (any device) keeps F.linear: gemm would not cast the inputs.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
)


def routed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: RouteOptions):
    """F.linear semantics; the GEMM goes to gemmtune.gemm when that gives the same answer.

    Device mismatches need no check here: gemm validates them on a cache miss and the ValueError
    lands in the fallback, where F.linear raises its usual error.
    """
    if (
        x.dtype != weight.dtype
        or x.dtype not in _GEMM_DTYPES
        or (bias is not None and bias.dtype != x.dtype)
        or _any_autocast()
        or (opts.m_threshold is not None and x.numel() < opts.m_threshold * max(1, x.shape[-1]))
    ):
        return F.linear(x, weight, bias)
    gemm = _gemm_fn[0] if _gemm_fn else _gemm()
    try:
        if bias is not None and opts.split_bias:
            y = gemm(x, weight)
            return y.add_(bias) if not (torch.is_grad_enabled() and bias.requires_grad) else y + bias
        return gemm(x, weight, bias)
    except (RuntimeError, ValueError, TypeError) as exc:  # a broken fast tier must not break the model
        tag = f"{type(exc).__name__}: {exc}"
        if tag not in _warned:
            _warned.add(tag)
            log.warning("gemmtune.gemm failed (%s); falling back to F.linear for this call", tag)
        return F.linear(x, weight, bias)


def _linear_forward(self: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    return routed_linear(input, self.weight, self.bias, self._gemmtune_route)


def linear_skip_reason(mod: nn.Module) -> str | None:
    """Why this module cannot be routed (None when it can)."""
    if type(mod) is not nn.Linear:
        return f"{type(mod).__name__} is not a plain nn.Linear"
    if "forward" in mod.__dict__:
        return "its forward is already overridden on the instance (another patch or an accelerate hook)"
    if getattr(mod, "_hf_hook", None) is not None:
        return "an accelerate hook (offloaded or dispatched model)"
    if mod.weight is None or mod.weight.device.type == "meta":
        return "weights are not materialized (meta device)"
    if mod.weight.dtype not in _GEMM_DTYPES:
        return f"weight dtype {mod.weight.dtype} is not one gemmtune.gemm takes (float16, bfloat16, float32)"
    return None


def route_linear(mod: nn.Linear, opts: RouteOptions) -> None:
    mod._gemmtune_route = opts
    mod.forward = bind(_linear_forward, mod)


def unroute_linear(mod: nn.Linear) -> None:
    mod.__dict__.pop("forward", None)
    mod.__dict__.pop("_gemmtune_route", None)


def is_routed(mod: nn.Module) -> bool:
    return "_gemmtune_route" in mod.__dict__


class LinearRouting(Rewrite):
    """Every nn.Linear no other rewrite keeps (PlanContext.left_alone) runs through gemmtune.gemm."""

    kind = "route"

    def applies(self, arch, opts) -> bool:
        return opts["route_linears"]

    def plan(self, ctx: PlanContext) -> None:
        route = route_options(ctx.opts)
        for path, mod in ctx.model.named_modules():
            if not isinstance(mod, nn.Linear) or ctx.left_alone(path):
                continue
            if hasattr(mod, "weight_scale_inv"):  # an fp8 checkpoint Linear: models/fp8_checkpoint.py reports it
                continue
            why = linear_skip_reason(mod)
            if why:
                ctx.skip("linear", path, mod, why)
            else:
                ctx.add(self, path, mod, f"GEMM N={mod.out_features} K={mod.in_features}", opts=route)

    def apply(self, model: nn.Module, change: Change, report) -> None:
        route_linear(find(model, change.path), change.data["opts"])

    def undo(self, model: nn.Module, change: Change) -> str | None:
        mod = find(model, change.path)
        if mod is not None and is_routed(mod):
            unroute_linear(mod)
        return None

    def on_sharded(self, model, sharding, change: Change):
        if change.path not in sharding.hooked:
            return None, None
        style = sharding.style(change.path)
        if style in LINEAR_STYLES:
            return None, ShardedChange(sharding, rewrap=style)
        return f"tensor parallel: plan entry {style!r} is not a linear style gemmtune routes", None


class FusedLinear(nn.Module):
    """One GEMM for several projections of the same input: weight = cat(parts, dim=0).

    `parts` names the original projections and their output sizes, in order, so the output can be
    split and the weight handed back at restore.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, parts, opts: RouteOptions):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.parts = tuple(parts)  # ((name, out_features, had_bias), ...)
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self._gemmtune_route = opts

    @property
    def sizes(self) -> list[int]:
        return [n for _, n, _ in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return routed_linear(x, self.weight, self.bias, self._gemmtune_route)

    def extra_repr(self) -> str:
        names = "+".join(f"{n}[{s}]" for n, s, _ in self.parts)
        return (
            f"in_features={self.in_features}, out_features={self.out_features} ({names}), bias={self.bias is not None}"
        )
