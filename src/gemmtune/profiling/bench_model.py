"""Stock Hugging Face vs optimize() vs torch.compile of each, on one model, in one process.

Contenders share one set of random weights: "stock" (the model as built), "optimize" (a deep copy
after gemmtune.optimize), "compile" (torch.compile of stock) and "compile+optimize" (torch.compile of
the optimized copy; one contender per compile-ops mode asked for, see kernels/compile_mode.py); with
`quantize` also "quantize" (a deep copy after optimize(quantize=...)) and "compile+quantize". A model
too large to copy once per contender has copies that share stock's parameters (shared_weights.py). For
the quantized copy the report also says what was quantized, each 8-bit GEMM's relative error against
the 16-bit GEMM it replaced (on the parity prefill's activations) and the logits' relative error
against the stock model.
Scenarios: prefill (batch x seq, last-token logits as generate() asks) and decode (one token per
step on a static cache primed with `ctx` tokens, captured once in a CUDA graph and replayed).
Timing follows docs/benchmarking.md: contenders interleaved round by round (order balanced, the
GPU kept busy while a round is queued), median ms per call over the rounds. On the CPU there are no
graphs: eager steps, wall clock.
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..kernels.compile_mode import compile_ops
from ..models.hf_cache import CACHE_ARGS, with_cache
from ..tuner.search import BUSY_SPREAD, REMEASURE
from ..tuner.timing import round_order
from .collect import profile
from .moe_routing import Flip, ForcedRouting, RoutingTrace, explain, moe_blocks
from .moe_routing import rel_l2 as _rel
from .report import Profile
from .shared_weights import check_unchanged, copy_model, fingerprint, must_share
from .stock_attention import ignored_features

CONTENDERS = ("stock", "optimize", "compile", "compile+optimize", "quantize", "compile+quantize")
_QUANT = ("quantize", "compile+quantize")
_SPACER_CYCLES = 2_000_000  # ~1 ms of GPU sleep: longer than queueing a round's first launches


@dataclass
class Settings:
    model: str
    layers: int | None = 4
    table: str | None = None
    device: str = "cuda"
    dtype: torch.dtype | None = None
    prefill: tuple[tuple[int, int], ...] = ((1, 2048),)
    batches: tuple[int, ...] = (1, 8)
    ctx: int = 1024
    reps: int = 7
    contenders: tuple[str, ...] = CONTENDERS[:4]
    quantize: str | None = None  # "fp8" / "fp8-block" / "int8": adds the quantize contender(s)
    quantize_producers: bool = True  # optimize(quantize_producers=): norms / act*mul emit the 8-bit input
    compile_ops: tuple[str, ...] = ("ref",)  # one compile+optimize contender per mode spec
    compile_backend: str | None = None  # default: inductor on a GPU, aot_eager on the CPU
    profile: bool = True
    seed: int = 0
    decode_steps: int = 16  # teacher-forced decode parity: steps checked per contender
    keep_going: bool = False  # time contenders that fail parity too (marked) instead of stopping
    break_contender: str | None = None  # test hook: this contender's attention ignores its KV cache

    def __post_init__(self):
        bad = [c for c in self.contenders if c not in CONTENDERS]
        if bad or not self.contenders:
            raise ValueError(f"contenders {bad or '(none)'}: expected some of {', '.join(CONTENDERS)}")
        if self.quantize is not None:
            from ..models.quantize import check_mode

            check_mode(self.quantize)
            if not any(c in _QUANT for c in self.contenders):  # asked to quantize: the quantized copy runs too
                extra = ("quantize", "compile+quantize") if "compile+optimize" in self.contenders else ("quantize",)
                self.contenders = (*self.contenders, *extra)
        elif any(c in _QUANT for c in self.contenders):
            raise ValueError("the quantize contenders need a quantize mode (--quantize fp8 | fp8-block | int8)")
        if any(b < 1 for b in self.batches) or any(b < 1 or s < 1 for b, s in self.prefill) or self.ctx < 1:
            raise ValueError(f"batches {self.batches}, prefill {self.prefill} and ctx {self.ctx} must be positive")
        if self.reps < 1:
            raise ValueError(f"reps must be >= 1, got {self.reps}")
        if self.decode_steps < 1:
            raise ValueError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.break_contender is not None and self.break_contender not in self.contenders:
            raise ValueError(f"break_contender {self.break_contender!r} is not among {', '.join(self.contenders)}")


@dataclass
class Contender:
    name: str
    module: torch.nn.Module  # the eager module (stock or optimized): primes caches
    call: Callable  # the module, or its torch.compile wrapper
    ops: str | None = None  # compile-ops mode the calls run under

    def context(self):
        return compile_ops(self.ops) if self.ops else contextlib.nullcontext()


@dataclass
class Cell:
    """One contender in one scenario."""

    ms: float = float("nan")
    spread: float = float("nan")  # half the max-min range over rounds
    error: str = ""
    busy: str = ""  # why its rounds stayed disturbed after re-measuring ('' when they agreed)
    profile: Profile | None = None
    gemm_profile: Profile | None = None  # decode: the un-graphed step (shapes and launch sites)


@dataclass
class Scenario:
    name: str
    kind: str  # "prefill" or "decode"
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class Result:
    settings: Settings
    meta: dict
    optimize_summary: str
    parity: dict[str, str]
    scenarios: list[Scenario]
    errors: list[str]
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the reader must know to compare (stock_attention)
    quant: dict | None = None  # the quantized copy: mode, optimize summary, per-GEMM and logits errors
    decode_parity: dict[str, DecodeParity] = field(default_factory=dict)

    def parity_failures(self) -> list[str]:
        return [f"{n}: {p.verdict()}" for n, p in self.decode_parity.items() if not p.ok]


def log(*a) -> None:
    print(*a, flush=True)


# ---- timing -------------------------------------------------------------------------------------
def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def interleaved(fns: dict[str, Callable], iters: int, reps: int, cuda: bool) -> dict[str, list[float]]:
    """ms per call of each fn, one sample per round; rounds interleave the fns in a balanced order
    (timing.round_order: every position and every predecessor equally often)."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    events = (
        {n: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for n in names} if cuda else {}
    )
    for rep in range(reps):
        order = [names[i] for i in round_order(len(names), rep)]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(_SPACER_CYCLES)
            for n in order:
                start, end = events[n]
                start.record()
                for _ in range(iters):
                    fns[n]()
                end.record()
            torch.cuda.synchronize()
            for n in names:
                start, end = events[n]
                times[n].append(start.elapsed_time(end) / iters)
        else:
            for n in order:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fns[n]()
                times[n].append((time.perf_counter() - t0) * 1e3 / iters)
    return times


def disturbance(ts: list[float]) -> float:
    """How far one contender's rounds disagree: their range over their median (0 for one round)."""
    med = statistics.median(ts) if ts else 0.0
    return (max(ts) - min(ts)) / med if med > 0 else 0.0


def quietest_rounds(measure: Callable[[], dict[str, list[float]]]) -> tuple[dict[str, list[float]], dict[str, str]]:
    """measure() (ms per round of each contender), repeated up to REMEASURE times while some contender's
    rounds range wider than BUSY_SPREAD of their median (other work shared the machine: the CPU's
    threads, a throttled GPU): the quietest run, whole (its contenders were interleaved), and per
    contender why even that run was disturbed (empty when none was)."""
    best = None
    for attempt in range(1 + REMEASURE):
        times = measure()
        worst = max((disturbance(ts) for ts in times.values()), default=0.0)
        if best is None or worst < best[0]:
            best = (worst, times)
        if worst <= BUSY_SPREAD:
            break
        if attempt < REMEASURE:
            log(f"  rounds disagree by up to {worst * 100:.0f}% of their median: timing again (busy machine?)")
    times = best[1]
    why = {}
    for name, ts in times.items():
        if disturbance(ts) > BUSY_SPREAD:
            why[name] = (f"rounds ranged {min(ts):.3g}-{max(ts):.3g} ms ({disturbance(ts) * 100:.0f}% of the "
                         f"median) after {1 + REMEASURE} runs")  # fmt: skip
    return times, why


# ---- contenders ---------------------------------------------------------------------------------
def _compile(module, backend: str):
    # torch.compile's defaults, as a user would call it: a size or int that changes between calls is
    # recompiled once as dynamic (HF's sliding-window static cache keeps a Python int position).
    return torch.compile(module, backend=backend)


def raise_recompile_limits() -> None:
    # Every contender x shape is its own compiled graph of the same forward code objects.
    import torch._dynamo.config as dc

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(64, getattr(dc, name)))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dc, name):
            setattr(dc, name, max(1024, getattr(dc, name)))


def make_contenders(stock, opt, s: Settings, backend: str, quant=None) -> list[Contender]:
    out = []
    for name in s.contenders:
        if name == "stock":
            out.append(Contender(name, stock, stock))
        elif name == "optimize":
            out.append(Contender(name, opt, opt))
        elif name == "compile":
            out.append(Contender(name, stock, _compile(stock, backend)))
        elif name == "quantize":
            out.append(Contender(name, quant, quant))
        elif name == "compile+quantize":
            out.append(Contender(name, quant, _compile(quant, backend), s.compile_ops[0]))
        else:
            for ops in s.compile_ops:
                label = name if len(s.compile_ops) == 1 else f"{name}[{ops}]"
                out.append(Contender(label, opt, _compile(opt, backend), ops))
    return out


# ---- scenarios ----------------------------------------------------------------------------------
def _ids(batch: int, seq: int, vocab: int, device, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g).to(device)


def prefill_call(c: Contender, ids: torch.Tensor) -> Callable:
    def run():
        with torch.no_grad(), c.context():
            return c.call(input_ids=ids, use_cache=False, logits_to_keep=1)

    return run


class Decode:
    """One decode step of `c` on a static cache primed with ctx tokens; `replay` is the timed call
    (a CUDA graph of the step on a GPU, the eager step on the CPU)."""

    def __init__(self, c: Contender, batch: int, ctx: int, steps: int, cuda: bool, vocab: int, seed: int):
        from transformers import StaticCache

        device = next(c.module.parameters()).device
        prompt = _ids(batch, ctx, vocab, device, seed)
        self.tok = _ids(batch, 1, vocab, device, seed + 1)
        # Every call (replays too) advances the cache by one token: room for all of them.
        self.cache = StaticCache(config=c.module.config, max_cache_len=ctx + steps)
        self.c = c
        self.cache_kw = with_cache(c.module, self.cache)
        with torch.no_grad(), c.context():
            c.module(input_ids=prompt, **with_cache(c.module, self.cache), use_cache=True, logits_to_keep=1)
            for _ in range(2):  # compiles here, outside any capture
                self.step()
        self.graph = None
        if cuda:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self.step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.step()

    def step(self):
        with torch.no_grad(), self.c.context():
            return self.c.call(input_ids=self.tok, **self.cache_kw, use_cache=True, logits_to_keep=1)

    def replay(self):
        if self.graph is None:
            self.step()
        else:
            self.graph.replay()


# ---- decode parity ------------------------------------------------------------------------------
# Relative L2 error of a contender's per-step logits against its reference's. 16-bit contenders: stock,
# a few ulps of the model dtype through 4 layers. 8-bit contenders: the quantized reference (the same
# model with every 8-bit linear on models/quantize.reference_forward: the same quantizers in plain
# PyTorch, fp32 matmul), since the 8-bit rounding itself moves random-weight logits 20-30% from stock
# (3 mantissa bits a GEMM, compounding over the layers); the kernels must match what they compute.
# How closely is measured, not guessed: any rounding difference upstream (accumulation order) flips the
# 8-bit rounding of activation elements near a boundary, each flip a whole 8-bit step, and random
# weights amplify it layer by layer. Measured on an H100 (llama-3-8b, fp8): each 8-bit GEMM within 9e-4
# of its reference, yet the logits 0.06 (1 layer) and 0.14 (4 layers) away, and the reference itself
# as far from its own twin with the matmul in bf16 (0.063 / 0.141). So the tolerance is that floor,
# the reference vs its bf16-matmul twin on the same tokens, times QUANT_FLOOR_MARGIN, and never below
# QUANT_DECODE_TOL. A wrong cache path or a wrong scale lands far above it (errors of order 1).
DECODE_TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}
QUANT_DECODE_TOL = 0.05
QUANT_FLOOR_MARGIN = 1.5
PARITY_PROMPT = (2, 32)  # batch, prompt tokens
# A MoE routing flip (moe_routing.py) may explain a step over the tolerance. A contender with flips is
# decoded again with the reference's routing forced on every MoE block (moe_routing.ForcedRouting):
# every step must then be within the tolerance, which shows the flips were the only difference. Where
# forcing cannot reach every block (one that does not call its experts module), more than one step in
# MAX_FLIP_SHARE needing a flip fails the contender all the same.
MAX_FLIP_SHARE = 4


@dataclass
class DecodeParity:
    """One contender's teacher-forced decode against stock: stock's greedy tokens are fed to both."""

    tolerance: float
    errors: list[float] = field(default_factory=list)  # per step, prefill's last token first
    agree: list[bool] = field(default_factory=list)  # per step: greedy (argmax) token equals the reference's
    failure: str = ""  # the contender raised
    reference: str = "stock"  # what the errors are against
    vs_stock: list[float] = field(default_factory=list)  # per step against stock, where the reference is not
    floor: float | None = None  # 8-bit: the reference vs its bf16-matmul twin (the tolerance's base)
    flips: list[Flip] = field(default_factory=list)  # steps over the tolerance a MoE routing flip explains
    forced: list[float] = field(default_factory=list)  # per step, with the reference's routing forced (flips only)

    @property
    def ok(self) -> bool:
        if self.failure or not self.errors:
            return False
        flipped = {f.step for f in self.flips}
        if any(e > self.tolerance for i, e in enumerate(self.errors) if i not in flipped):
            return False
        if not self.flips:
            return True
        if self.forced:
            return all(e <= self.tolerance for e in self.forced)
        return len(self.flips) <= len(self.errors) // MAX_FLIP_SHARE

    def verdict(self) -> str:
        if self.failure:
            return f"FAILED: {self.failure}"
        flipped = {f.step for f in self.flips}
        worst = max((e for i, e in enumerate(self.errors) if i not in flipped), default=0.0)
        tokens = f"greedy tokens {sum(self.agree)}/{len(self.agree)} equal (prompt's last + each step)"
        word = "ok" if self.ok else "MISMATCH"
        against = "" if self.reference == "stock" else f" vs the {self.reference}"
        text = f"{word}: max step rel err {worst:.3g}{against} (tolerance {self.tolerance:g}), {tokens}"
        if self.flips:
            text += (
                f"; {len(self.flips)} step(s) over it explained by MoE routing flips (near-tied experts; the "
                f"contender's block routes as the reference on the reference's input), up to "
                f"{max(self.errors[i] for i in flipped):.3g}: " + "; ".join(f.describe() for f in self.flips)
            )
        if self.forced:
            worst_forced = max(self.forced)
            text += (
                f"; with the reference's expert choices forced on every MoE block, max step rel err {worst_forced:.3g}"
            )
        return text

    def as_dict(self) -> dict:
        errs = [e if math.isfinite(e) else None for e in self.errors]  # JSON has no inf / NaN
        vs_stock = [e if math.isfinite(e) else None for e in self.vs_stock]
        return {"ok": self.ok, "tolerance": self.tolerance, "step_rel_err": errs, "greedy_equal": self.agree,
                "failure": self.failure, "reference": self.reference, "step_rel_err_vs_stock": vs_stock,
                "floor": self.floor, "routing_flips": [f.describe() for f in self.flips],
                "forced_routing_step_rel_err": [e if math.isfinite(e) else None for e in self.forced]}  # fmt: skip


def _decode_logits(c: Contender, prompt: torch.Tensor, feed: torch.Tensor | None, steps: int, trace=None):
    """Per-step last-token logits of c on a static cache: the prompt, then `feed`'s tokens one by one
    (None: its own greedy tokens). Returns (logits [steps + 1, B, V], tokens fed [B, steps]). A
    RoutingTrace `trace` records c's MoE routing meanwhile."""
    from transformers import StaticCache

    cache = StaticCache(config=c.module.config, max_cache_len=prompt.shape[1] + steps + 1)
    kw = with_cache(c.module, cache)
    out, fed = [], []
    with torch.no_grad(), c.context(), trace or contextlib.nullcontext():
        logits = c.call(input_ids=prompt, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        for t in range(steps):
            out.append(logits)
            tok = logits.argmax(-1, keepdim=True) if feed is None else feed[:, t : t + 1]
            fed.append(tok)
            logits = c.call(input_ids=tok, **kw, use_cache=True, logits_to_keep=1).logits[:, -1].float()
        out.append(logits)
    return torch.stack(out), torch.cat(fed, dim=1)


def decode_parity(contenders: list[Contender], stock, s: Settings, vocab: int, device,
                  quant: torch.nn.Module | None = None) -> dict[str, DecodeParity]:  # fmt: skip
    """Teacher-forced decode of s.decode_steps steps for every contender against its reference: stock,
    or for the 8-bit contenders `quant` (the optimize(quantize=...) model) on its reference linears."""
    from ..models.quantize import reference_linears

    prompt = _ids(*PARITY_PROMPT, vocab, device, s.seed + 7)
    moe = bool(moe_blocks(stock))
    stock_trace = RoutingTrace(stock) if moe else None
    want, tokens = _decode_logits(Contender("stock", stock, stock), prompt, None, s.decode_steps, stock_trace)
    dtype = next(stock.parameters()).dtype
    quant_want, floor, quant_trace = None, None, None
    if quant is not None and any(c.name in _QUANT for c in contenders):
        ref = Contender("quantized reference", quant, quant)
        quant_trace = RoutingTrace(quant) if moe else None
        with reference_linears(quant):
            quant_want, _ = _decode_logits(ref, prompt, tokens, s.decode_steps, quant_trace)
        with reference_linears(quant, matmul_dtype=dtype):
            twin, _ = _decode_logits(ref, prompt, tokens, s.decode_steps)
        floor = max(_rel(t, w) for t, w in zip(twin, quant_want))
    out = {}
    for c in contenders:
        quantized = c.name in _QUANT and quant_want is not None
        ref = quant_want if quantized else want
        tol = max(QUANT_DECODE_TOL, QUANT_FLOOR_MARGIN * floor) if quantized else DECODE_TOL.get(dtype, 3e-2)
        p = out[c.name] = DecodeParity(tol, floor=floor if quantized else None)
        # eager contenders only: hooks inside a compiled model would change what is compiled
        trace = RoutingTrace(c.module) if moe and c.call is c.module else None
        try:
            got, _ = _decode_logits(c, prompt, tokens, s.decode_steps, trace)
        except Exception as exc:  # noqa: BLE001 - reported per contender
            p.failure = f"{type(exc).__name__}: {exc}"
            continue
        p.errors = [_rel(g, w) for g, w in zip(got, ref)]
        ref_trace = quant_trace if quantized else stock_trace
        if trace is not None and ref_trace is not None:
            with c.context():
                flips = (explain(i, ref_trace, trace, c.module, tol) for i, e in enumerate(p.errors) if e > tol)
                p.flips = [f for f in flips if f is not None]
            if p.flips:
                forcing = ForcedRouting(c.module, ref_trace)
                forced, _ = _decode_logits(c, prompt, tokens, s.decode_steps, forcing)
                if forcing.complete:
                    p.forced = [_rel(g, w) for g, w in zip(forced, ref)]
        p.agree = [bool(torch.equal(g.argmax(-1), w.argmax(-1))) for g, w in zip(got, ref)]
        if quantized:
            p.reference = "quantized reference"
            p.vs_stock = [_rel(g, w) for g, w in zip(got, want)]
    return out


def break_decode(module: torch.nn.Module) -> None:
    """Test hook (bench-model --test-break): every attention module of `module` loses its KV cache
    argument, the failure a cache-argument rename causes; prefill stays right, decode goes wrong."""

    def drop(mod, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if k not in CACHE_ARGS}

    for name, mod in module.named_modules():
        if name.endswith("self_attn"):
            mod.register_forward_pre_hook(drop, with_kwargs=True)


# ---- the run ------------------------------------------------------------------------------------
def _parity(contenders: list[Contender], ids) -> tuple[dict[str, str], dict[str, float]]:
    """Per contender: a line on its last-token logits vs the first contender's (an 8-bit one also vs the
    16-bit optimize()'s, where it runs), and their relative error."""
    out, rel, ref, logits_of = {}, {}, None, {}
    for c in contenders:
        try:
            logits = logits_of[c.name] = prefill_call(c, ids)().logits.float()
        except Exception as exc:  # noqa: BLE001 - reported per contender
            out[c.name] = f"failed: {type(exc).__name__}: {exc}"
            continue
        if ref is None:
            ref = logits
            out[c.name] = f"reference (logits max |x| {ref.abs().max().item():.3g})"
            continue
        same = bool((logits.argmax(-1) == ref.argmax(-1)).all())
        rel[c.name] = _rel(logits, ref)
        out[c.name] = (f"max |diff| {(logits - ref).abs().max().item():.3g}, rel err {rel[c.name]:.3g}, "
                       f"argmax {'equal' if same else 'DIFFERS'}")  # fmt: skip
        if c.name in _QUANT and "optimize" in logits_of:
            out[c.name] += f"; vs optimize() (16-bit) rel err {_rel(logits, logits_of['optimize']):.3g}"
    return out, rel


def _quant_info(model, report, mode: str, ids) -> dict:
    """What the quantized copy runs 8-bit and each 8-bit GEMM's error vs the 16-bit GEMM it replaced."""
    from ..models.quantize import gemm_errors

    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    errs = gemm_errors(model, run)
    return {"mode": mode, "summary": str(report), "gemm_errors": [list(e) for e in errs]}


def _meta(s: Settings, desc: str, backend: str, cuda: bool) -> dict:
    import transformers

    from ..kernels.compile_mode import describe
    from ..models.architectures import ARCHITECTURES

    return {
        "model": desc,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "table": s.table or "none (default dispatch: vendor BLAS through torch)",
        "quantize": (s.quantize or "none")
        + (
            "" if s.quantize is None or s.quantize_producers else " (no producers: each 8-bit GEMM quantizes its input)"
        ),
        "compile_backend": backend,
        "compile_ops_default": describe(),
        "optimize_architectures": ", ".join(sorted(ARCHITECTURES)) + " (other model types: plain Linear routing only)",
        "timing": (
            "CUDA events, contenders interleaved per round in a balanced order, median of rounds"
            if cuda
            else "wall clock (CPU: no CUDA graphs), contenders interleaved per round, median of rounds"
        ),
    }


def run(s: Settings) -> Result:
    from ..models import optimize
    from .build import build_model

    t0 = time.perf_counter()
    device = torch.device(s.device)
    cuda = device.type == "cuda"
    backend = s.compile_backend or ("inductor" if cuda else "aot_eager")
    torch._dynamo.reset()
    raise_recompile_limits()
    log(f"building {s.model} ({s.layers or 'all'} layers) with random weights on {device}")
    stock, desc = build_model(s.model, s.layers, device, s.dtype, s.seed)
    log(f"model: {desc}")
    notes = ignored_features(stock)
    for n in notes:
        log(f"note: {n}")
    want_opt = any(c in s.contenders for c in ("optimize", "compile+optimize"))
    want_quant = any(c in s.contenders for c in _QUANT)
    why = must_share(stock, int(want_opt) + int(want_quant))
    share = bool(why)
    if share:
        notes.append(why)
        log(f"note: {why}")
    marks = fingerprint(stock) if share else None
    if want_opt:
        log("optimize(): rewriting a copy of the model and checking its cached path against stock")
    opt = copy_model(stock, share) if want_opt else None
    summary = str(optimize(opt, config=s.table)) if opt is not None else "optimize() not run"
    log(summary)
    quant, qreport = None, None
    if want_quant:
        quant = copy_model(stock, share)
        qreport = optimize(quant, config=s.table, quantize=s.quantize, quantize_producers=s.quantize_producers)
        log(str(qreport))
    if marks is not None:
        check_unchanged(marks, stock)
    contenders = make_contenders(stock, opt, s, backend, quant)
    if s.break_contender is not None:  # on a copy: the contenders sharing its module stay intact
        i = [c.name for c in contenders].index(s.break_contender)
        c = contenders[i]
        broken = copy.deepcopy(c.module)
        break_decode(broken)
        call = broken if c.call is c.module else _compile(broken, backend)
        contenders[i] = Contender(c.name, broken, call, c.ops)
        log(f"test hook: {c.name}'s attention ignores its KV cache")
    meta = _meta(s, desc, backend, cuda)
    vocab = stock.config.vocab_size
    errors: list[str] = []
    b0, s0 = s.prefill[0]
    ids0 = _ids(b0, s0, vocab, device, s.seed)
    log(f"checking prefill parity ({b0}x{s0} tokens) of {len(contenders)} contenders")
    parity, rel = _parity(contenders, ids0)
    for name, text in parity.items():
        log(f"parity {name}: {text}")
    log(f"checking decode parity: {s.decode_steps} teacher-forced steps per contender")
    dparity = decode_parity(contenders, stock, s, vocab, device, quant)
    for name, p in dparity.items():
        log(f"decode parity {name} ({s.decode_steps} teacher-forced steps): {p.verdict()}")
    failing = [n for n, p in dparity.items() if not p.ok]
    if failing and not s.keep_going:
        res = Result(s, meta, summary, parity, [], [f"decode parity {n}: {dparity[n].verdict()}" for n in failing],
                     notes=notes, decode_parity=dparity)  # fmt: skip
        res.seconds = time.perf_counter() - t0
        log("stopping before timing: a contender fails decode parity (--keep-going times it anyway, marked)")
        return res
    qinfo = None
    if quant is not None:
        qinfo = _quant_info(quant, qreport, s.quantize, ids0)
        qinfo["logits_rel_err"] = rel.get("quantize", float("nan"))
        qinfo["logits_ref"] = contenders[0].name
        for path, shape, err in qinfo["gemm_errors"]:
            log(f"quantize={s.quantize} GEMM {path} [{shape}]: rel err {err:.3g} vs the 16-bit GEMM")
    scenarios: list[Scenario] = []
    for b, seq in s.prefill:
        sc = Scenario(f"prefill {b}x{seq}", "prefill")
        ids = _ids(b, seq, vocab, device, s.seed)
        _bench(sc, {c.name: prefill_call(c, ids) for c in contenders}, 3 if cuda else 2, s, cuda, errors)
        scenarios.append(sc)
    decode_iters = 16 if cuda else 4
    # room in the cache for every step: warm-up and capture, timed rounds, profiles, slack
    steps = 8 + s.reps * decode_iters + 2 * (decode_iters + 8) + 16
    for b in s.batches:
        label = f"decode b={b} ctx={s.ctx}" + (" (CUDA graph)" if cuda else " (eager, CPU)")
        sc = Scenario(label, "decode")
        decs: dict[str, Decode] = {}
        log(f"priming {label}: a static cache of {s.ctx} tokens per contender")
        for c in contenders:
            try:
                decs[c.name] = Decode(c, b, s.ctx, steps, cuda, vocab, s.seed)
            except Exception as exc:  # noqa: BLE001 - one contender failing does not stop the others
                sc.cells[c.name] = Cell(error=f"{type(exc).__name__}: {exc}")
                errors.append(f"{label} {c.name}: {sc.cells[c.name].error}")
                log(errors[-1])
                traceback.print_exc()
        _bench(sc, {n: d.replay for n, d in decs.items()}, decode_iters, s, cuda, errors, decs)
        scenarios.append(sc)
        del decs
        if cuda:
            torch.cuda.empty_cache()
    res = Result(s, meta, summary, parity, scenarios, errors, notes=notes, quant=qinfo, decode_parity=dparity)
    res.seconds = time.perf_counter() - t0
    return res


def _bench(sc: Scenario, fns: dict[str, Callable], iters: int, s: Settings, cuda: bool, errors, decs=None) -> None:
    ok = {}
    for name, fn in fns.items():  # warm-up: compiles, fills caches; a failure drops the contender
        try:
            fn()
            ok[name] = fn
        except Exception as exc:  # noqa: BLE001
            sc.cells[name] = Cell(error=f"{type(exc).__name__}: {exc}")
            errors.append(f"{sc.name} {name}: {sc.cells[name].error}")
            log(errors[-1])
    _sync(cuda)
    if ok:
        log(f"timing {sc.name}: {len(ok)} contenders x {s.reps} interleaved rounds of {iters} calls")
    times, busy = quietest_rounds(lambda: interleaved(ok, iters, s.reps, cuda)) if ok else ({}, {})
    base = statistics.median(times["stock"]) if "stock" in times else None
    for name, ts in times.items():
        med = statistics.median(ts)
        cell = sc.cells.setdefault(name, Cell())
        cell.ms, cell.spread, cell.busy = med, (max(ts) - min(ts)) / 2, busy.get(name, "")
        speed = f" ({base / med:.2f}x vs stock)" if base else ""
        mark = f"  BUSY: {cell.busy}" if cell.busy else ""
        log(f"{sc.name:<34} {name:<24} {med:9.3f} ms (±{cell.spread:.3f}){speed}{mark}")
    if not s.profile:
        return
    if ok:
        log(f"profiling {sc.name}: {len(ok)} contenders")
    for name, fn in ok.items():
        cell = sc.cells[name]
        try:
            if decs is not None and decs[name].graph is not None:
                # graph replays have no launch sites: categorize their kernels as the eager step's
                cell.gemm_profile = profile(decs[name].step, warmup=1, iters=3)
                cell.profile = profile(
                    fn, warmup=1, iters=5, hints=cell.gemm_profile.kernel_categories(), annotate=False
                )
            else:
                cell.profile = profile(fn, warmup=1, iters=3 if cuda else 2)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"profile {sc.name} {name}: {type(exc).__name__}: {exc}")
            log(errors[-1])
            traceback.print_exc()
