"""End to end: stock Hugging Face Llama (sdpa) vs gemmtune.optimize(), same process, same weights.

A Llama-3-8B-architecture model (tests/data/models/llama-3-8b.json) with random weights and a few
layers, bf16:
  prefill  batch 1 x 2048 tokens, logits of the last token only (as generate() asks);
  decode   batch 1 and 8, one token per step on a 1024-token KV cache: eager with a DynamicCache,
           eager with a StaticCache, and replayed CUDA graphs of one step with a StaticCache (for each
           masked-decode strategy of gemmtune's SDPA tier, --masked-decode).
Timing: CUDA events, stock and optimized interleaved rep by rep, median per call over reps.
Breakdown: torch.profiler device time per call, kernels grouped by name into GEMM / attention /
elementwise / other.

    python benchmarks/bench_e2e_llama.py --layers 4 --out benchmarks/results/e2e_h100.md
    python benchmarks/bench_e2e_llama.py --skip prefill,eager,profile    # only the CUDA-graph decode rows
    python benchmarks/bench_e2e_llama.py --device cpu --tiny     # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import re
import statistics
import sys
import time
import traceback

import torch

CONFIG_FILE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "models" / "llama-3-8b.json"
LLAMA3_8B = {k: v for k, v in json.loads(CONFIG_FILE.read_text()).items() if k != "torch_dtype"}
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 4096}  # fmt: skip
# One tensor-parallel rank of Llama-3-70B at tp 8 (heads, kv heads, intermediate and vocab split by 8):
# the per-rank GEMM shapes of the decode suite, without the all-reduces a real tp run adds.
LLAMA3_70B_TP8_RANK = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 3584, "num_attention_heads": 8,
                       "num_key_value_heads": 1, "vocab_size": 16032}  # fmt: skip

CATEGORIES = [
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|softmax", re.I)),
    ("gemm", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|cublas|matmul|splitk|sm90_|sm80_|_mm_|dot", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce|norm|act_mul|rope|triton|copy|cat|index|where|fill|"
                               r"arange|unrolled|mul|add|neg|pow|rsqrt|silu|exp|cast|scatter|gather", re.I)),
]  # fmt: skip


def log(*a):
    print(*a, flush=True)


def build(n_layers: int, device, tiny: bool, preset: str = "8b"):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(TINY if tiny else LLAMA3_70B_TP8_RANK if preset == "70b-tp8-rank" else LLAMA3_8B)
    cfg["num_hidden_layers"] = n_layers
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
    finally:
        torch.set_default_dtype(prev)
    return model.eval()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters, device) -> float:
    """ms per call of `fn` over `iters` back-to-back calls."""
    if device.type != "cuda":
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def interleaved(fns: dict, iters, reps, device) -> dict:
    """Median ms per call for each fn, measured alternately rep by rep."""
    times = {k: [] for k in fns}
    for fn in fns.values():  # warm-up (compiles Triton kernels, fills dispatch caches)
        fn()
    sync(device)
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(timed(fn, iters, device))
    return {k: (statistics.median(v), max(v) - min(v)) for k, v in times.items()}


def categorize(prof) -> dict:
    out = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0, "other": 0.0}
    kernels = {}
    for e in prof.key_averages():
        dev = getattr(e, "self_device_time_total", None)
        if dev is None:
            dev = getattr(e, "self_cuda_time_total", 0.0)
        if not dev or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        cat = next((c for c, rx in CATEGORIES if rx.search(e.key)), "other")
        out[cat] += dev
        kernels[e.key] = kernels.get(e.key, 0.0) + dev
    return out, kernels


def profile(fn, calls, device) -> tuple[dict, dict]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    fn()
    sync(device)
    with tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    cats, kernels = categorize(prof)
    return {k: v / calls / 1e3 for k, v in cats.items()}, {k: v / calls / 1e3 for k, v in kernels.items()}


# ---- scenarios -----------------------------------------------------------------------------------
def prefill_fn(model, ids):
    def run():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return run


class EagerDecode:
    """One decode step at a time on a DynamicCache primed with `ctx` tokens."""

    def __init__(self, model, batch, ctx, device, vocab):
        from transformers import DynamicCache

        self.model = model
        g = torch.Generator(device="cpu").manual_seed(1)
        prompt = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.tok = torch.randint(0, vocab, (batch, 1), generator=g).to(device)

    def __call__(self):
        with torch.no_grad():
            self.model(input_ids=self.tok, past_key_values=self.cache, use_cache=True, logits_to_keep=1)


class GraphDecode:
    """One decode step with a StaticCache, captured once in a CUDA graph and replayed."""

    def __init__(self, model, batch, ctx, device, vocab, max_steps, use_graph=True, before_capture=None):
        from transformers import StaticCache

        g = torch.Generator(device="cpu").manual_seed(1)
        prompt = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        self.cache = StaticCache(config=model.config, max_cache_len=ctx + max_steps)
        self.tok = torch.randint(0, vocab, (batch, 1), generator=g).to(device)
        with torch.no_grad():
            model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)

            def step():
                return model(input_ids=self.tok, past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits

            self.step = step
            if device.type != "cuda" or not use_graph:
                self.graph = None
                return
            if before_capture is not None:
                before_capture()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(s)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = step()

    def __call__(self):
        if self.graph is None:
            with torch.no_grad():
                self.step()
        else:
            self.graph.replay()


# ---- main ----------------------------------------------------------------------------------------
def fmt_row(name, st, op):
    (a, sa), (b, sb) = st, op
    return f"| {name} | {a:.3f} (±{sa / 2:.3f}) | {b:.3f} (±{sb / 2:.3f}) | {a / b:.2f}x |"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=1024, help="KV-cache length for decode")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument(
        "--preset",
        choices=("8b", "70b-tp8-rank"),
        default="8b",
        help="Llama-3-8B, or one tp-8 rank of Llama-3-70B (its GEMM shapes, no all-reduce)",
    )
    p.add_argument("--config", default=None, help="tuned table for gemmtune (else GEMMTUNE_CONFIG / default)")
    p.add_argument("--out", default=None, help="markdown file to write")
    p.add_argument("--skip", default="", help="comma list of: prefill,eager,graph,profile")
    p.add_argument("--masked-decode", default="fold,fold_efficient,gqa,repeat", help="strategies to time (graphs)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    import transformers

    import gemmtune

    stock = build(args.layers, device, args.tiny, args.preset)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt, config=args.config)
    vocab = stock.config.vocab_size
    table_src = args.config or os.environ.get("GEMMTUNE_CONFIG") or "none (default dispatch: vendor BLAS via torch)"
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = [
        f"device: {dev_name}; torch {torch.__version__}; transformers {transformers.__version__}",
        f"model: {'one tp-8 rank of Llama-3-70B (no all-reduce)' if args.preset != '8b' else 'Llama-3-8B'} "
        f"architecture, {args.layers} layers, random weights, "
        f"{'bf16' if device.type == 'cuda' else 'fp32'}; tuned table: {table_src}",
        f"optimize(): {report.summary().splitlines()[1].strip()}; "
        + ", ".join(f"{k} x{v}" for k, v in sorted(report.counts().items())),
    ]
    for h in head:
        log(h)
    rows, breakdown, errors = [], {}, []
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    with torch.no_grad():  # same answer first: last-token logits of the prefill
        la = stock(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
        lb = opt(input_ids=ids, use_cache=False, logits_to_keep=1).logits.float()
    parity = (
        f"parity (prefill, last-token logits): max |diff| {(la - lb).abs().max().item():.3g} "
        f"(logits max |x| {la.abs().max().item():.3g}), argmax equal: {bool((la.argmax(-1) == lb.argmax(-1)).all())}"
    )
    head.append(parity)
    log(parity)

    def section(name, make, iters):
        try:
            fns = make()
            res = interleaved(fns, iters, args.reps, device)
            rows.append(fmt_row(name, res["stock"], res["gemmtune"]))
            log(rows[-1])
        except Exception as exc:  # noqa: BLE001 - report and go on with the other scenarios
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            log(errors[-1])
            traceback.print_exc()

    skip = set(args.skip.split(","))
    if "prefill" not in skip:
        section(
            f"prefill b=1 s={args.prefill} (eager)",
            lambda: {"stock": prefill_fn(stock, ids), "gemmtune": prefill_fn(opt, ids)},
            3,
        )
    batches = [int(b) for b in args.batches.split(",")]
    modes = [m for m in args.masked_decode.split(",") if m]
    max_steps = 3 + (args.reps + 1) * 16 + 8
    for b in [] if "eager" in skip else batches:

        def eager_dynamic(b=b):
            fns = {
                "stock": EagerDecode(stock, b, args.ctx, device, vocab),
                "gemmtune": EagerDecode(opt, b, args.ctx, device, vocab),
            }
            if device.type == "cuda":  # allocator traffic of a growing DynamicCache, for the notes
                before = torch.cuda.memory_stats().get("num_device_alloc", 0)
                for f in fns.values():
                    for _ in range(16):
                        f()
                sync(device)
                grew = torch.cuda.memory_stats().get("num_device_alloc", 0) - before
                log(f"b={b}: cudaMalloc calls during 2 x 16 DynamicCache decode steps: {grew}")
            return fns

        section(f"decode b={b} ctx={args.ctx} (eager, DynamicCache)", eager_dynamic, 16)
        section(
            f"decode b={b} ctx={args.ctx} (eager, StaticCache)",
            lambda b=b: {
                "stock": GraphDecode(stock, b, args.ctx, device, vocab, max_steps, use_graph=False),
                "gemmtune": GraphDecode(opt, b, args.ctx, device, vocab, max_steps, use_graph=False),
            },
            16,
        )
    if device.type == "cuda" and "graph" not in skip:
        from gemmtune.models import attention as attn_mod

        default_mode = attn_mod.MASKED_DECODE
        for b in batches:
            try:
                fns = {"stock": GraphDecode(stock, b, args.ctx, device, vocab, max_steps)}
                for mode in modes:  # the masked-decode strategy is fixed when the graph is captured
                    fns[mode] = GraphDecode(
                        opt, b, args.ctx, device, vocab, max_steps,
                        before_capture=lambda mode=mode: attn_mod.set_masked_decode(mode),
                    )  # fmt: skip
                attn_mod.set_masked_decode(default_mode)
                res = interleaved(fns, 16, args.reps, device)
                for mode in modes:
                    rows.append(fmt_row(f"decode b={b} ctx={args.ctx} (CUDA graph, StaticCache), "
                                        f"masked decode={mode}", res["stock"], res[mode]))  # fmt: skip
                    log(rows[-1])
                del fns
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                attn_mod.set_masked_decode(default_mode)
                errors.append(f"graph decode b={b}: {type(exc).__name__}: {exc}")
                traceback.print_exc()

    # per-category device time (profiler): eager steps, and graph replays where they were captured
    if device.type == "cuda" and "profile" not in skip:
        scen = {f"prefill s={args.prefill} (eager)": lambda: (prefill_fn(stock, ids), prefill_fn(opt, ids), 2)}
        for b in batches:
            scen[f"decode b={b} (eager)"] = lambda b=b: (
                EagerDecode(stock, b, args.ctx, device, vocab),
                EagerDecode(opt, b, args.ctx, device, vocab),
                8,
            )
            scen[f"decode b={b} (CUDA graph)"] = lambda b=b: (
                GraphDecode(stock, b, args.ctx, device, vocab, 64),
                GraphDecode(opt, b, args.ctx, device, vocab, 64),
                8,
            )
        for name, make in scen.items():
            try:
                fs, fo, calls = make()
                cs, ks = profile(fs, calls, device)
                co, ko = profile(fo, calls, device)
                breakdown[name] = (cs, co, ks, ko)
                log(name, "stock", cs, "gemmtune", co)
                del fs, fo
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"profile {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()

    lines = ["# End-to-end: stock HF (sdpa) vs gemmtune.optimize()", "", *[f"- {h}" for h in head], ""]
    lines += ["Median ms per call (± half the spread over reps), stock and gemmtune interleaved in one process.", ""]
    lines += ["| scenario | stock ms | gemmtune ms | speedup |", "|---|---|---|---|", *rows, ""]
    if breakdown:
        lines += ["## Device time per call by kernel category (torch.profiler, eager), ms", ""]
        lines += [
            "| scenario | side | GEMM | attention | elementwise | other | total |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, (cs, co, _ks, _ko) in breakdown.items():
            for side, c in (("stock", cs), ("gemmtune", co)):
                tot = sum(c.values())
                lines.append(
                    f"| {name} | {side} | {c['gemm']:.3f} | {c['attention']:.3f} | {c['elementwise']:.3f} "
                    f"| {c['other']:.3f} | {tot:.3f} |"
                )
        lines += ["", "Top kernels (ms per call):", ""]
        for name, (_, _, ks, ko) in breakdown.items():
            for side, k in (("stock", ks), ("gemmtune", ko)):
                top = sorted(k.items(), key=lambda kv: -kv[1])[:8]
                lines.append(f"- {name}, {side}: " + "; ".join(f"`{n[:70]}` {v:.3f}" for n, v in top))
        lines.append("")
    if errors:
        lines += ["## Errors", "", *[f"- {e}" for e in errors], ""]
    lines += ["Command: `python benchmarks/bench_e2e_llama.py " + " ".join(argv or sys.argv[1:]) + "`", ""]
    text = "\n".join(lines)
    log(text)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
