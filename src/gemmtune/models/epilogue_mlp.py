"""Linear -> GELU (or ReLU) -> Linear MLPs through the fused-epilogue GEMMs (ops/epilogue.py).

The up projection runs as one gemm_epilogue(x, W_up, b_up, act) (bias and activation fused into the
GEMM's epilogue when a tuned row says so), the down projection as gemm_epilogue(h, W_down, b_down), then
the dropout the layout names. The layouts are the registry entries' epilogue_mlp (GPT-NeoX / Pythia, Phi,
StarCoder2, Falcon: transformers 5.17-5.24; the stock forwards are reproduced op for op; FalconLinear is
x @ W^T + b, nn.Linear's math). The activation module is identified on a probe tensor (exact GELU, tanh
GELU, ReLU), never by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model_types import REGISTRY, EpilogueLayout
from .bind import bind
from .rewrite import Change, ForwardSwap, PlanContext, join

log = logging.getLogger("gemmtune")
_warned: set[str] = set()

# MLP class name -> its layout: the registry entries' epilogue_mlp (gemmtune.model_types)
LAYOUTS: dict[str, EpilogueLayout] = {
    e.epilogue_mlp.mlp_class: e.epilogue_mlp for e in REGISTRY.values() if e.epilogue_mlp is not None
}


@dataclass(frozen=True)
class MlpSpec:
    up: str
    act: str  # the epilogue family's act: gelu, gelu_tanh, relu
    down: str
    dropout: str | None


def detect_act(fn) -> str | None:
    """gelu / gelu_tanh / relu when `fn` computes that on a probe (fp32, CPU), else None."""
    x = torch.linspace(-6, 6, 257)
    try:
        with torch.no_grad():
            y = fn(x.clone())
    except Exception:  # noqa: BLE001 - an activation that cannot run on a CPU probe is not ours
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for name, ref in (("gelu", F.gelu(x)), ("gelu_tanh", F.gelu(x, approximate="tanh")), ("relu", torch.relu(x))):
        if torch.allclose(y.float(), ref, rtol=1e-5, atol=1e-6):
            return name
    return None


def skip_reason(mod: nn.Module) -> tuple[MlpSpec | None, str]:
    """(spec, '') when `mod` is a known MLP whose layout checks out; (None, why) otherwise."""
    layout = LAYOUTS[type(mod).__name__]
    up_n, act_n, down_n, drop_n = layout.up, layout.act, layout.down, layout.dropout
    up, down, act = getattr(mod, up_n, None), getattr(mod, down_n, None), getattr(mod, act_n, None)
    if "forward" in mod.__dict__:
        return None, "its forward is already overridden on the instance"
    for name, lin in ((up_n, up), (down_n, down)):
        if not isinstance(lin, nn.Linear) or "forward" in lin.__dict__ or getattr(lin, "_hf_hook", None):
            return None, f"{name} is not a plain (un-hooked) nn.Linear"
        if lin.weight.device.type == "meta" or not lin.weight.dtype.is_floating_point:
            return None, f"{name} weights are not materialized float tensors"
    if up.out_features != down.in_features:
        return None, f"{up_n} width {up.out_features} != {down_n} input {down.in_features}"
    if drop_n is not None and not isinstance(getattr(mod, drop_n, None), (int, float)):
        return None, f"no {drop_n} attribute"
    kind = detect_act(act) if act is not None else None
    if kind is None:
        return None, f"{type(act).__name__} is not exact GELU, tanh GELU or ReLU"
    return MlpSpec(up_n, kind, down_n, drop_n), ""


_autocast = getattr(torch._C, "_is_any_autocast_enabled", None) or (
    lambda: torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()
)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    spec: MlpSpec = self._gemmtune_epilogue_mlp
    up, down = getattr(self, spec.up), getattr(self, spec.down)
    w = up.weight
    if x.dtype != w.dtype or down.weight.dtype != w.dtype or _autocast() or not x.is_floating_point():
        return type(self).forward(self, x)
    from ..ops.epilogue import gemm_epilogue

    try:
        h = gemm_epilogue(x, w, up.bias, act=spec.act)
        y = gemm_epilogue(h, down.weight, down.bias)
    except (RuntimeError, ValueError, TypeError) as exc:  # a broken fast tier must not break the model
        tag = f"{type(exc).__name__}: {exc}"
        if tag not in _warned:
            _warned.add(tag)
            log.warning("gemmtune fused MLP failed (%s); the stock forward runs for this call", tag)
        return type(self).forward(self, x)
    if spec.dropout is not None:
        y = F.dropout(y, p=getattr(self, spec.dropout), training=self.training)
    return y


def apply(mod: nn.Module, spec: MlpSpec) -> None:
    mod._gemmtune_epilogue_mlp = spec
    mod.forward = bind(_mlp_forward, mod)


UNDO_ATTRS = ("forward", "_gemmtune_epilogue_mlp")


class EpilogueMlp(ForwardSwap):
    """Every known Linear -> act -> Linear MLP of the model (any architecture) on the fused-epilogue GEMMs."""

    kind = "epilogue_mlp"
    attrs = UNDO_ATTRS

    def applies(self, arch, opts) -> bool:
        # the fused-epilogue MLP runs its own 16-bit GEMMs: with quantize it would bypass the 8-bit ones
        return opts["fused_ops"] and not opts.get("quantize")

    def plan(self, ctx: PlanContext) -> None:
        for path, mod in ctx.model.named_modules():
            if type(mod).__name__ not in LAYOUTS or ctx.left_alone(path):
                continue
            spec, why = skip_reason(mod)
            if spec is None:
                ctx.skip("epilogue mlp", path, mod, why)
                continue
            up = getattr(mod, spec.up)
            ctx.add(self, path, mod, f"{spec.up} + bias + {spec.act} fused, {spec.down} + bias fused "
                    f"({up.in_features}->{up.out_features})", spec=spec)  # fmt: skip
            ctx.leave_linear(join(path, spec.up))
            ctx.leave_linear(join(path, spec.down))

    def install(self, mod: nn.Module, change: Change) -> None:
        apply(mod, change.data["spec"])
