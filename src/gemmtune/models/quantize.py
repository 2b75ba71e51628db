"""optimize(model, quantize="fp8" | "fp8-block" | "int8"): the model's linears through the 8-bit ops.

Each Linear weight (fused q/k/v and gate/up included, since they are quantized after fusion) is
quantized once: per output channel for "fp8" / "int8", per 128x128 block for "fp8-block". At run
time each activation row is quantized on the fly (per token, or per 1x128 group for block scales;
one Triton kernel on a GPU) and the GEMM goes to gemm_a8w8 / gemm_a8w8_blockscale with the
output in the activation's dtype. lm_head stays 16-bit unless asked (its error reaches the logits
directly). The quantized weights live in the module's __dict__, not its state_dict, and the 16-bit
weights are kept, so restore() gives the stock model back and checkpoints are unchanged.
A linear also takes a QuantizedActivation, its input already quantized by the op before it
(models/quant_feeds.py wires the norms and act*mul of a decoder layer so), and then skips its quantizer.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..checks import check_choice
from ..kernels.quant import quantize_1x128_triton, quantize_per_token_triton
from ..ops.quantized import gemm_a8w8, gemm_a8w8_blockscale
from ..quant import formats, layouts, quantize
from .bind import bind
from .rewrite import Change, Deferred

MODES = {"fp8": ("a8w8", "fp8"), "int8": ("a8w8", "int8"), "fp8-block": ("blockscale", "fp8")}
_STATE = "_gemmtune_quant"
FEEDS = "_gemmtune_feeds"  # model.__dict__: the producers wired by quant_feeds.py (paused by gemm_errors)


@dataclass
class QuantState:
    mode: str
    wq: torch.Tensor
    ws: torch.Tensor
    bias: torch.Tensor | None
    prev_forward: object  # an instance-level forward this replaced (a routed Linear's), or None


def check_mode(mode) -> str:
    return check_choice("optimize", "quantize", mode, tuple(MODES))


def _skip_reason(mod: nn.Module, mode: str) -> str | None:
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.dtype.is_floating_point:
        return "no 2-D float weight"
    if w.device.type == "meta":
        return "weights are not materialized"
    if mode == "fp8-block" and w.shape[1] % formats.BLOCK:
        return f"K={w.shape[1]} is not a multiple of {formats.BLOCK} (block scales)"
    if getattr(mod, "_hf_hook", None) is not None:
        return "an accelerate hook"
    return None


class QuantizedActivation(NamedTuple):
    """A linear's input quantized by the op that produced it (kernels/quant_producers.py), in the format
    the linear's own quantizer would have made: the linear runs its GEMM on it directly."""

    q: torch.Tensor  # [..., K] int8 / fp8
    scale: torch.Tensor  # [..., 1] per token, or the M-major [M, K/128] grid per 1x128 group
    dtype: torch.dtype  # the 16-bit activation's dtype (the GEMM's output dtype)

    @property
    def shape(self) -> torch.Size:  # what a forward reads of its input before the linear
        return self.q.shape


def input_format(mod: nn.Module) -> tuple[torch.dtype, str] | None:
    """(8-bit dtype, "per_token" or "1x128") of the activation a quantized linear reads; None if not quantized."""
    st = mod.__dict__.get(_STATE)
    if st is None:
        return None
    return st.wq.dtype, "1x128" if st.mode == "fp8-block" else "per_token"


def _out_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


def _blockscale_linear(xq, xs, wq, ws, bias, out: torch.dtype) -> torch.Tensor:
    y = gemm_a8w8_blockscale(xq, wq, xs, ws, out)
    return y if bias is None else y + bias.to(out)


def fp8_block_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None):
    """y = x @ dequant(wq, ws)^T (+ bias) through gemm_a8w8_blockscale, x quantized per 1x128 group at
    run time (M-major scales, no copy before cuBLASLt); ws in any layout (row-padded saves a copy)."""
    xq, xs = quantize_1x128_triton(x, wq.dtype, m_major=True)
    return _blockscale_linear(xq, xs, wq, ws, bias, _out_dtype(x.dtype))


def _gemm(st: QuantState, xq: torch.Tensor, xs: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    if st.mode == "fp8-block":
        return _blockscale_linear(xq, xs, st.wq, st.ws, st.bias, out)
    # 2-D operands are gemm_a8w8's canonical call (no per-call reshaping of the scales in the dispatcher:
    # ~5 us of host time a call, measured on the CPU); a [..., K] activation is viewed as rows and back.
    k = xq.shape[-1]
    y = gemm_a8w8(xq.reshape(-1, k), st.wq, xs.reshape(-1, 1), st.ws, None if st.bias is None else st.bias.to(out), out)
    return y if xq.dim() == 2 else y.view(*xq.shape[:-1], y.shape[-1])


def _quant_forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
    st: QuantState = self.__dict__[_STATE]
    if isinstance(x, QuantizedActivation):
        return _gemm(st, x.q, x.scale, _out_dtype(x.dtype))
    if st.mode == "fp8-block":
        xq, xs = quantize_1x128_triton(x, st.wq.dtype, m_major=True)
    else:
        xq, xs = quantize_per_token_triton(x, st.wq.dtype)
    return _gemm(st, xq, xs, _out_dtype(x.dtype))


def reference_forward(mod: nn.Module, x: torch.Tensor, matmul_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The plain-PyTorch reference of a quantized linear's forward: the same quantizers (quant/quantize.py)
    on x, the dequantized operands multiplied in fp32 (or `matmul_dtype`: another valid rounding of the
    same math), the output in x's dtype. What the 8-bit kernels must match up to their accumulation order
    and output rounding."""
    st: QuantState = mod.__dict__[_STATE]
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if st.mode == "fp8-block":
        xq, xs = quantize.quantize_1x128(x2, st.wq.dtype)
        xd, wd = quantize.dequantize_1x128(xq, xs), quantize.dequantize_128x128(st.wq, st.ws.contiguous())
    else:
        xq, xs = quantize.quantize_per_token(x2, st.wq.dtype)
        xd, wd = quantize.dequantize(xq, xs), quantize.dequantize(st.wq, st.ws.reshape(-1, 1))
    y = xd @ wd.t() if matmul_dtype is None else (xd.to(matmul_dtype) @ wd.to(matmul_dtype).t()).float()
    if st.bias is not None:
        y = y + st.bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], -1)


def _quantize_weight(w: torch.Tensor, mode: str, device) -> tuple[torch.Tensor, torch.Tensor, float]:
    kind, fmt = MODES[mode]
    dt = formats.native_fp8(device) if fmt == "fp8" else torch.int8
    with torch.no_grad():
        if kind == "blockscale":
            wq, ws = quantize.quantize_128x128(w, dt)
            back = quantize.dequantize_128x128(wq, ws)
            ws = layouts.k_padded(ws)  # the row stride cuBLASLt reads, laid out once per weight
        else:
            wq, ws = quantize.quantize_per_channel(w, dt)
            back = quantize.dequantize(wq, ws.reshape(-1, 1))
        err = ((back - w.float()).norm() / w.float().norm().clamp(min=1e-30)).item()
    return wq, ws, err


class _Unquantize:
    """Undoes quantize_linears (an object, not a closure: it pickles with the model)."""

    def __init__(self):
        self.done: list[nn.Module] = []

    def __call__(self) -> None:
        for mod in reversed(self.done):
            st = mod.__dict__.pop(_STATE, None)
            mod.__dict__.pop("forward", None)
            if st is not None and st.prev_forward is not None:
                mod.forward = st.prev_forward


def quantize_linears(model: nn.Module, mode: str, report, lm_head: bool = False):
    """Quantize every linear of `model` (after fusion); returns the callable that undoes it."""
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    undo = _Unquantize()
    done = undo.done
    try:
        _quantize_all(model, mode, report, lm_head, out_emb, done)
    except BaseException:
        undo()
        raise
    report.notes.append(f"quantize={mode}: {len(done)} linears run 8-bit (activations quantized per "
                        f"{'1x128 group' if mode == 'fp8-block' else 'token'} at run time); 16-bit weights kept "
                        "for restore()")  # fmt: skip
    return undo


class QuantizeLinears(Deferred):
    """quantize=...: the linears (fused ones included) through the 8-bit ops."""

    kind = "quantize"

    def applies(self, arch, opts) -> bool:
        return bool(opts.get("quantize"))

    def settings(self, opts: dict) -> dict:
        return {"mode": opts["quantize"], "lm_head": opts["quantize_lm_head"]}

    def run(self, model: nn.Module, change: Change, report):
        return quantize_linears(model, change.data["mode"], report, change.data["lm_head"])

    def new_weights(self, change: Change) -> tuple[str, str] | None:
        return f"quantize={change.data['mode']!r}", "quantize=None"


def _quantize_all(model, mode, report, lm_head, out_emb, done) -> None:
    from .linear import FusedLinear

    for path, mod in model.named_modules():
        if type(mod) is not nn.Linear and not isinstance(mod, FusedLinear):
            continue
        if mod is out_emb and not lm_head:
            report.skip("quantize", path, type(mod).__name__, "lm_head stays 16-bit (quantize_lm_head=True)")
            continue
        if _STATE in mod.__dict__:
            continue
        why = _skip_reason(mod, mode)
        if why:
            report.skip("quantize", path, type(mod).__name__, why)
            continue
        wq, ws, err = _quantize_weight(mod.weight.detach(), mode, mod.weight.device)
        bias = None if mod.bias is None else mod.bias.detach()
        prev = mod.__dict__.get("forward")
        mod.__dict__[_STATE] = QuantState(mode, wq, ws, bias, prev)
        mod.forward = bind(_quant_forward, mod)
        done.append(mod)
        scales = "128x128 blocks" if mode == "fp8-block" else "per channel"
        report.change("quantize", path, type(mod).__name__, f"{mod.weight.shape[0]}x{mod.weight.shape[1]}, "
                      f"{wq.dtype} {scales}, weight rel err {err:.1e}")  # fmt: skip


@contextlib.contextmanager
def reference_linears(model: nn.Module, matmul_dtype: torch.dtype | None = None):
    """Inside the block every quantized linear of `model` runs reference_forward (its plain-PyTorch
    reference: the same quantizers, dequantized operands, fp32 matmul, or `matmul_dtype`'s) on its 16-bit
    input, the producers paused: the model the 8-bit kernels must match, whatever the 8-bit rounding does
    to the logits."""
    mods = [m for m in model.modules() if _STATE in m.__dict__]
    saved = [m.__dict__.get("forward") for m in mods]
    feeds = model.__dict__.get(FEEDS)
    fwd = reference_forward if matmul_dtype is None else functools.partial(reference_forward, matmul_dtype=matmul_dtype)
    with feeds.paused() if feeds is not None else contextlib.nullcontext():
        for m in mods:
            m.forward = bind(fwd, m)
        try:
            yield
        finally:
            for m, fwd in zip(mods, saved):
                if fwd is None:
                    m.__dict__.pop("forward", None)
                else:
                    m.forward = fwd


def gemm_errors(model: nn.Module, run, against=None) -> list[tuple[str, str, float]]:
    """Call run() once with every quantized linear of `model` watched: the relative error of its 8-bit
    output against the 16-bit GEMM it replaced (F.linear with the kept weight) on the same input, or
    against `against(module, x)` (e.g. reference_forward). Returns [(module path, "NxK", ||y8 - ref|| /
    ||ref||)] in module order, the largest over the calls."""
    found: dict[str, list[float]] = {}
    handles = []

    def watch(path, mod):
        def hook(_mod, args, y):
            with torch.no_grad():
                ref = (F.linear(args[0], mod.weight, mod.bias) if against is None else against(mod, args[0])).float()
                err = ((y.float() - ref).norm() / ref.norm().clamp(min=1e-30)).item()
            found.setdefault(path, []).append(err)

        return hook

    shapes = {}
    for path, mod in model.named_modules():
        if _STATE in mod.__dict__:
            shapes[path] = f"{mod.weight.shape[0]}x{mod.weight.shape[1]}"
            handles.append(mod.register_forward_hook(watch(path, mod)))
    feeds = model.__dict__.get(FEEDS)  # paused: each linear must see its 16-bit input to be compared
    try:
        with feeds.paused() if feeds is not None else contextlib.nullcontext():
            run()
    finally:
        for h in handles:
            h.remove()
    return [(p, shapes[p], max(found[p])) for p in shapes if p in found]
