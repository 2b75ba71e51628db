"""optimize(quantize=...): the ops before a decoder layer's 8-bit GEMMs emit those GEMMs' quantized input.

A quantized linear (models/quantize.py) quantizes its 16-bit input itself: the norm or act*mul before
it writes the activation in 16 bits and the quantizer reads it back. Here the producer quantizes
instead (kernels/quant_producers.py) and hands a QuantizedActivation on:
- input_layernorm -> the fused qkv_proj: the norm's forward returns it, the patched attention forward
  passes it to qkv_proj;
- the residual add + norm before the MLP -> gate_up_proj: the layer forward's fused add-norm
  (the norm's architectures.ADD_NORM, replaced here) returns it with the new residual;
- act(gate) * up -> down_proj: the MLP forward.
o_proj (its input comes out of attention) and lm_head keep quantizing their own input. A producer is
wired only where its one consumer is a quantized linear reached through gemmtune's own forwards with
no hook in between that would see the activation; elsewhere quantize.py's path stays. The math is the
same (the same quantizer on the same 16-bit values), so the logits match the unwired model's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ..kernels.quant_producers import act_mul_quant, add_rmsnorm_quant, rmsnorm_quant
from . import architectures
from .bind import bind, bound_function
from .quantize import FEEDS, QuantizedActivation, input_format
from .rewrite import Change, Deferred

FORMAT = "_gemmtune_feed"  # producer.__dict__: the (8-bit dtype, scaling) its consumer reads
# Layouts whose fused add-norm feeds layer.mlp, and that norm's name.
_MLP_INPUT_NORM = {"prenorm": "post_attention_layernorm", "sandwich": "pre_feedforward_layernorm"}


# ---- the producers' forwards --------------------------------------------------------------------
def _norm_dtype(spec: architectures.NormSpec, x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the 16-bit norm returns (Llama style promotes x to the weight's dtype)."""
    return torch.promote_types(weight.dtype, x.dtype) if spec.cast_before_weight else x.dtype


def _norm_feed_forward(self, hidden_states: torch.Tensor) -> QuantizedActivation:
    s = self._gemmtune_norm
    q, scale = rmsnorm_quant(hidden_states, self.weight, s.eps, *self.__dict__[FORMAT], offset=s.offset,
                             cast_before_weight=s.cast_before_weight)  # fmt: skip
    return QuantizedActivation(q, scale, _norm_dtype(s, hidden_states, self.weight))


def _add_norm_feed(self, x: torch.Tensor, residual: torch.Tensor):
    s = self._gemmtune_norm
    q, scale, total = add_rmsnorm_quant(x, residual, self.weight, s.eps, *self.__dict__[FORMAT], offset=s.offset,
                                        cast_before_weight=s.cast_before_weight)  # fmt: skip
    return QuantizedActivation(q, scale, _norm_dtype(s, total, self.weight)), total


def _mlp_feed_forward(self, x) -> torch.Tensor:
    gu = self.gate_up_proj(x)
    q, scale = act_mul_quant(gu, self._gemmtune_mlp.act, *self.__dict__[FORMAT])
    return self.down_proj(QuantizedActivation(q, scale, gu.dtype))


# ---- wiring -------------------------------------------------------------------------------------
@dataclass
class _Patch:
    """Instance attributes set on one module; revert() puts back what they replaced."""

    mod: nn.Module
    attrs: dict
    saved: dict = field(default_factory=dict)

    def apply(self) -> None:
        self.saved = {k: self.mod.__dict__[k] for k in self.attrs if k in self.mod.__dict__}
        self.mod.__dict__.update(self.attrs)

    def revert(self) -> None:
        for k in self.attrs:
            if k in self.saved:
                self.mod.__dict__[k] = self.saved[k]
            else:
                self.mod.__dict__.pop(k, None)


@dataclass
class Feeds:
    """The producers wired into one model."""

    patches: list[_Patch]

    def apply(self) -> None:
        for p in self.patches:
            p.apply()

    def revert(self) -> None:
        for p in reversed(self.patches):
            p.revert()

    @contextlib.contextmanager
    def paused(self):
        """Every quantized linear quantizes its own 16-bit input inside the block."""
        self.revert()
        try:
            yield
        finally:
            self.apply()


def _installed(mod: nn.Module | None, fn) -> bool:
    """Is `fn` the forward installed on this instance (by optimize's earlier steps)?"""
    return bound_function(mod) is fn


def _hooked(*mods: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


def _layout(layer: nn.Module) -> str | None:
    fwd = bound_function(layer)
    return next((k for k, f in architectures.LAYER_FORWARDS.items() if f is fwd), None)


class _Planner:
    def __init__(self, report):
        self.report = report
        self.patches: list[_Patch] = []
        self.consumers = 0  # 8-bit GEMMs with a producer in a fused layer

    def feed(self, path: str, producer: nn.Module, consumer: str, consumer_mod: nn.Module, attrs: dict, why: str):
        fmt = input_format(consumer_mod)
        if fmt is None:
            return
        self.consumers += 1
        if why:
            self.report.skip("quantize feed", path, type(producer).__name__, f"{consumer}: {why}")
            return
        self.patches.append(_Patch(producer, {**attrs, FORMAT: fmt}))
        dtype, scaling = str(fmt[0]).removeprefix("torch."), fmt[1].replace("_", "-")
        detail = f"emits {consumer}'s input as {dtype} with {scaling} scales"
        self.report.change("quantize feed", path, type(producer).__name__, detail)

    def layer(self, path: str, layer: nn.Module) -> None:
        layout = _layout(layer)
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if layout is None:
            return
        norm = getattr(layer, "input_layernorm", None)
        if _installed(attn, architectures._attention_forward) and _installed(norm, architectures._norm_forward):
            why = "hooks on the norm, attention or qkv_proj" if _hooked(norm, attn, attn.qkv_proj) else ""
            attrs = {"forward": bind(_norm_feed_forward, norm)}
            self.feed(f"{path}.input_layernorm", norm, "qkv_proj", attn.qkv_proj, attrs, why)
        if not _installed(mlp, architectures._mlp_forward):
            return
        name = _MLP_INPUT_NORM.get(layout)
        add_norm = getattr(layer, name, None) if name else None
        if add_norm is not None and hasattr(add_norm, "_gemmtune_norm"):
            why = "hooks on the MLP or gate_up_proj" if _hooked(mlp, mlp.gate_up_proj) else ""
            attrs = {architectures.ADD_NORM: bind(_add_norm_feed, add_norm)}
            self.feed(f"{path}.{name}", add_norm, "gate_up_proj", mlp.gate_up_proj, attrs, why)
        if mlp._gemmtune_mlp.act is not None:
            why = "hooks on down_proj" if _hooked(mlp.down_proj) else ""
            attrs = {"forward": bind(_mlp_feed_forward, mlp)}
            self.feed(f"{path}.mlp", mlp, "down_proj", mlp.down_proj, attrs, why)


def wire_producers(model: nn.Module, report):
    """Wire the producers of every fused decoder layer of a quantized model; returns the undo."""
    stack = architectures.decoder_stack(model)
    planner = _Planner(report)
    if stack is not None:
        spath, smod = stack
        for i, layer in enumerate(smod.layers):
            planner.layer(".".join(p for p in (spath, "layers", str(i)) if p), layer)
    feeds = Feeds(planner.patches)
    feeds.apply()
    model.__dict__[FEEDS] = feeds
    if planner.consumers:
        report.notes.append(f"quantize feeds: {len(feeds.patches)}/{planner.consumers} of the decoder layers' 8-bit "
                            "GEMMs after a norm or act*mul take their input quantized by that op")  # fmt: skip
    return _Unwire(model, feeds)


class _Unwire:
    """Undoes wire_producers (an object, not a closure: it pickles with the model)."""

    def __init__(self, model: nn.Module, feeds: Feeds):
        self.model, self.feeds = model, feeds

    def __call__(self) -> None:
        self.feeds.revert()
        self.model.__dict__.pop(FEEDS, None)


class QuantFeeds(Deferred):
    """The norms and act*mul of the fused decoder layers emit the next 8-bit GEMM's input already quantized."""

    kind = "quantize feed"

    def applies(self, arch, opts) -> bool:
        return bool(opts.get("quantize")) and opts["quantize_producers"]

    def run(self, model: nn.Module, change: Change, report):
        return wire_producers(model, report)
