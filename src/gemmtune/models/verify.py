"""optimize()'s parity check on the cached path, run on the model's own device and dtype.

Before anything changes, the stock model runs a tiny probe: a left-padded batch of 2 (prefill of
PREFILL tokens, then DECODE_STEPS one-token steps on the KV cache the prefill returned), and every
decoder layer's input and output at every call is recorded. After the changes the same probe runs
again with each decoder layer fed the stock layer's input (teacher forcing), so each layer is judged
on its own: an error in layer 3 does not make layer 4 look wrong. A layer whose output at any call
differs from stock beyond the dtype's tolerance (relative L2 over the real, unpadded tokens) is put
back to stock by the caller, and the logits check does the same for what lies outside the layers
(final norm, lm_head).

A mixture-of-experts block inside a layer is teacher-forced too: it gets the stock block's input, and
the input the optimized layer computed for it is judged on its own. Otherwise a rounding difference
in the attention, well within the tolerance, may flip the router's choice between two near-tied
experts and move the layer's output by a whole expert's share (0.12 on a random-weight DeepSeek-V3
with absorbed MLA), which says nothing of either half. Judged apart, the attention half (up to the
block's input) and the block (on the same input, so routing as stock's) must each agree.

The probe's GEMMs are neither captured nor tuned online (Dispatcher.quiet).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from .architectures import is_moe_block
from .hf_cache import cache_of, with_cache

PREFILL = 5
DECODE_STEPS = 3
BATCH = 2
LEFT_PAD = 2  # padding of the second row: the mask path of every attention tier is exercised

# Relative L2 error a layer output (or the logits) may have against stock. The bugs this catches (a
# decode step that ignores its cache, a dropped argument) give errors of order 1.
TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}
DEFAULT_TOLERANCE = 3e-2


@dataclass
class Probe:
    ids: torch.Tensor  # [BATCH, PREFILL + DECODE_STEPS]
    mask: torch.Tensor  # same shape, 0 on the left padding

    @classmethod
    def for_model(cls, model: nn.Module) -> Probe:
        emb = model.get_input_embeddings()
        vocab, device = emb.num_embeddings, emb.weight.device
        gen = torch.Generator(device="cpu").manual_seed(20251125)
        ids = torch.randint(0, vocab, (BATCH, PREFILL + DECODE_STEPS), generator=gen).to(device)
        mask = torch.ones_like(ids)
        mask[1, :LEFT_PAD] = 0
        return cls(ids, mask)

    def valid(self, call: int) -> torch.Tensor:
        """Which rows / tokens of call `call` (0: prefill) are real tokens: [BATCH, tokens] bool."""
        if call == 0:
            return self.mask[:, :PREFILL].bool()
        return torch.ones(BATCH, 1, dtype=torch.bool, device=self.mask.device)


@dataclass
class Trace:
    inputs: list[list[torch.Tensor]]  # per layer, per call: the hidden states it received
    outputs: list[list[torch.Tensor]]  # per layer, per call: what it returned
    logits: list[torch.Tensor] = field(default_factory=list)  # per call
    seconds: float = 0.0
    # per layer, per call of its MoE block(s): the input the layer computed for the block (before forcing)
    block_inputs: list[list[torch.Tensor]] = field(default_factory=list)


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def run(model: nn.Module, layers: list[nn.Module], probe: Probe, teacher: Trace | None = None) -> Trace:
    """Prefill + DECODE_STEPS cached steps, recording each layer's inputs and outputs; with `teacher`,
    each layer is fed the teacher's input of the same call instead of its predecessor's output."""
    trace = Trace([[] for _ in layers], [[] for _ in layers], block_inputs=[[] for _ in layers])
    handles = []

    def pre_hook(i):
        def hook(mod, args, kwargs):
            calls = trace.inputs[i]
            if teacher is not None:
                h = teacher.inputs[i][len(calls)]
                if args:
                    args = (h, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": h}
            calls.append(_hidden(args, kwargs).detach().clone())
            return args, kwargs

        return hook

    def post_hook(i):
        def hook(mod, args, kwargs, out):
            trace.outputs[i].append((out[0] if isinstance(out, tuple) else out).detach().clone())

        return hook

    def block_hook(i):
        def hook(mod, args, kwargs):
            calls = trace.block_inputs[i]
            calls.append(_hidden(args, kwargs).detach().clone())
            taught = teacher.block_inputs[i] if teacher is not None else []
            if len(taught) >= len(calls):  # the stock block's input of the same call
                h = taught[len(calls) - 1]
                if args:
                    args = (h, *args[1:])
                else:
                    kwargs = {**kwargs, "hidden_states": h}
            return args, kwargs

        return hook

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post_hook(i), with_kwargs=True))
        for block in (m for m in layer.modules() if m is not layer and is_moe_block(m)):
            handles.append(block.register_forward_pre_hook(block_hook(i), with_kwargs=True))
    start = time.perf_counter()
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=probe.ids[:, :PREFILL], attention_mask=probe.mask[:, :PREFILL], use_cache=True)
            trace.logits.append(out.logits.detach().float())
            for t in range(PREFILL, PREFILL + DECODE_STEPS):
                out = model(
                    input_ids=probe.ids[:, t : t + 1],
                    attention_mask=probe.mask[:, : t + 1],
                    use_cache=True,
                    **with_cache(model, cache_of(out)),
                )
                trace.logits.append(out.logits.detach().float())
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    trace.seconds = time.perf_counter() - start
    return trace


def rel_error(got: torch.Tensor, want: torch.Tensor, valid: torch.Tensor) -> float:
    """Relative L2 error over the real tokens (padding rows hold whatever each path leaves there); a
    [tokens, hidden] tensor (an MoE block's flattened input) is read as [BATCH, tokens / BATCH, hidden]."""
    if got.dim() == 2 and tuple(got.shape[:1]) == (valid.numel(),):
        got, want = got.view(*valid.shape, -1), want.view(*valid.shape, -1)
    g, w = got.float()[valid], want.float()[valid]
    if not torch.isfinite(g).all():
        return float("inf")
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


@dataclass
class Finding:
    index: int  # layer index, or -1 for the logits
    call: int  # 0: prefill, 1..: decode step
    error: float

    def where(self) -> str:
        return "prefill" if self.call == 0 else f"cached decode step {self.call}"


@dataclass
class Verdict:
    bad: list[Finding]  # the layers that disagree, each at its worst call
    logits: Finding | None  # the logits' worst call when it disagrees, else None
    worst_layer: float  # the largest layer error seen, agreeing or not
    layers: list[Finding | None] = field(default_factory=list)  # each layer's worst call, agreeing or not
    logits_worst: Finding | None = None  # the logits' worst call, agreeing or not
    tol: float = DEFAULT_TOLERANCE


def combine(verdicts: list[Verdict]) -> Verdict:
    """The verdicts of several ranks of one tensor-parallel model as one: each layer (and the logits) at
    its worst call on any rank, so every rank puts back the same layers."""
    tol = verdicts[0].tol
    layers = [_worst_of(found) for found in zip(*(v.layers for v in verdicts))]
    logits = _worst_of([v.logits_worst for v in verdicts])
    return _verdict(layers, logits, tol)


def _worst_of(found) -> Finding | None:
    found = [f for f in found if f is not None]
    return max(found, key=lambda f: f.error) if found else None


def _verdict(layers: list[Finding | None], logits: Finding | None, tol: float) -> Verdict:
    found = [f for f in layers if f is not None]
    return Verdict(
        bad=[f for f in found if f.error > tol],
        logits=logits if logits is not None and logits.error > tol else None,
        worst_layer=max((f.error for f in found), default=0.0),
        layers=layers,
        logits_worst=logits,
        tol=tol,
    )


def compare(stock: Trace, opt: Trace, probe: Probe, tol: float) -> Verdict:
    """Each layer at its worst call: its output, or the input it computed for its MoE block(s)."""
    worst = []
    for i, (want, got) in enumerate(zip(stock.outputs, opt.outputs)):
        found = [_worst(i, want, got, probe)]
        if stock.block_inputs and (stock.block_inputs[i] or opt.block_inputs[i]):
            found.append(_worst(i, stock.block_inputs[i], opt.block_inputs[i], probe, per_call=len(want)))
        found = [f for f in found if f is not None]
        worst.append(max(found, key=lambda f: f.error) if found else None)
    return _verdict(worst, _worst(-1, stock.logits, opt.logits, probe), tol)


def _worst(index: int, want: list, got: list, probe: Probe, per_call: int = 0) -> Finding | None:
    """The worst of the calls; per_call: the layer's calls, when `want` holds several entries a call
    (a layer with more than one MoE block)."""
    if len(got) != len(want):  # a layer skipped or called twice: as wrong as it gets
        return Finding(index, min(len(got), len(want)), float("inf"))
    each = max(1, len(want) // per_call) if per_call else 1
    found = None
    for n, (w, g) in enumerate(zip(want, got)):
        call = n // each
        err = rel_error(g, w, probe.valid(call)) if g.shape == w.shape else float("inf")
        if found is None or err > found.error:
            found = Finding(index, call, err)
    return found


def tolerance(model: nn.Module) -> float:
    p = next(model.parameters(), None)
    return TOLERANCE.get(p.dtype if p is not None else None, DEFAULT_TOLERANCE)
