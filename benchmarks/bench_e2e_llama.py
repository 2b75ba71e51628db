"""End to end on Llama: stock Hugging Face vs gemmtune.optimize(), with the rows `gemmtune bench-model`
does not time: eager decode (DynamicCache and StaticCache) and every masked-decode strategy of the
SDPA tier under CUDA graphs. Everything else (model building, interleaved timing, CUDA-graph decode,
the profile breakdown) is gemmtune.profiling; for the four-contender comparison with torch.compile
use `gemmtune bench-model --model llama-3-8b`.

A Llama-3-8B-architecture model (tests/data/models/llama-3-8b.json, inlined below so the script
needs no data files) with random weights and a few layers, bf16:
  prefill  batch 1 x 2048 tokens, logits of the last token only (as generate() asks);
  decode   batch 1 and 8, one token per step on a 1024-token KV cache: eager with a DynamicCache,
           eager with a StaticCache, and CUDA-graph replays of one step with a StaticCache.

    python benchmarks/bench_e2e_llama.py --layers 4 --out OUT_DIR/e2e.md
    python benchmarks/bench_e2e_llama.py --skip prefill,eager,profile    # only the CUDA-graph decode rows
    python benchmarks/bench_e2e_llama.py --device cpu --tiny     # smoke test of the script itself
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import statistics
import sys
import traceback

import torch

import gemmtune
from gemmtune.models import attention as attn_mod
from gemmtune.profiling import profile
from gemmtune.profiling.bench_model import Contender, Decode, interleaved, prefill_call
from gemmtune.profiling.build import build_model
from gemmtune.profiling.categorize import CATEGORIES, label

LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}
TINY = {**LLAMA3_8B, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "max_position_embeddings": 4096}  # fmt: skip
# One tensor-parallel rank of Llama-3-70B at tp 8 (heads, kv heads, intermediate and vocab split by 8):
# the per-rank GEMM shapes of the decode suite, without the all-reduces a real tp run adds.
LLAMA3_70B_TP8_RANK = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 3584, "num_attention_heads": 8,
                       "num_key_value_heads": 1, "vocab_size": 16032}  # fmt: skip


def log(*a):
    print(*a, flush=True)


def config_of(args) -> dict:
    if args.tiny:
        return dict(TINY)
    if args.preset != "8b":
        return dict(LLAMA3_70B_TP8_RANK)
    return dict(LLAMA3_8B)


class EagerDecode:
    """One eager decode step at a time on a DynamicCache primed with `ctx` tokens."""

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


def graph_and_step(d: Decode):
    """(the replay to profile, the un-graphed step whose launch sites categorize its kernels)"""
    return d.replay, d.step


def fmt_row(name, st: list[float], op: list[float]) -> str:
    a, b = statistics.median(st), statistics.median(op)
    sa, sb = (max(st) - min(st)) / 2, (max(op) - min(op)) / 2
    return f"| {name} | {a:.3f} (±{sa:.3f}) | {b:.3f} (±{sb:.3f}) | {a / b:.2f}x |"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=1024, help="KV-cache length for decode")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    p.add_argument("--preset", choices=("8b", "70b-tp8-rank"), default="8b",
                   help="Llama-3-8B, or one tp-8 rank of Llama-3-70B (its GEMM shapes, no all-reduce)")  # fmt: skip
    p.add_argument("--config", default=None, help="tuned table for gemmtune (else GEMMTUNE_CONFIG / default)")
    p.add_argument("--out", default=None, help="markdown file to write")
    p.add_argument("--skip", default="", help="comma list of: prefill,eager,graph,profile")
    p.add_argument("--masked-decode", default="fold,fold_efficient,gqa,repeat", help="strategies to time (graphs)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    import transformers

    stock, desc = build_model(config_of(args), args.layers, device)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt, config=args.config)
    vocab = stock.config.vocab_size
    cs, co = Contender("stock", stock, stock), Contender("gemmtune", opt, opt)
    table_src = args.config or os.environ.get("GEMMTUNE_CONFIG") or "none (default dispatch: vendor BLAS via torch)"
    head = [
        f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}; torch {torch.__version__}; "
        f"transformers {transformers.__version__}",
        f"model: {desc}; tuned table: {table_src}",
        "optimize(): " + ", ".join(f"{k} x{v}" for k, v in sorted(report.counts().items())),
    ]
    for h in head:
        log(h)
    rows, breakdown, errors = [], {}, []
    ids = torch.randint(0, vocab, (1, args.prefill), generator=torch.Generator().manual_seed(0)).to(device)
    la, lb = (prefill_call(c, ids)().logits.float() for c in (cs, co))
    same = bool((la.argmax(-1) == lb.argmax(-1)).all())
    parity = (f"parity (prefill, last-token logits): max |diff| {(la - lb).abs().max().item():.3g} "
              f"(logits max |x| {la.abs().max().item():.3g}), argmax equal: {same}")  # fmt: skip
    head.append(parity)
    log(parity)

    def section(name, make, iters):
        try:
            fns = make()
            for f in fns.values():
                f()
            res = interleaved(fns, iters, args.reps, cuda)
            for other in [k for k in res if k != "stock"]:
                label_ = name if len(res) == 2 else f"{name}, masked decode={other}"
                rows.append(fmt_row(label_, res["stock"], res[other]))
                log(rows[-1])
        except Exception as exc:  # noqa: BLE001 - report and go on with the other scenarios
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            log(errors[-1])
            traceback.print_exc()

    skip = set(args.skip.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    steps = 16 + (args.reps + 2) * 16
    if "prefill" not in skip:
        section(f"prefill b=1 s={args.prefill} (eager)", lambda: {c.name: prefill_call(c, ids) for c in (cs, co)}, 3)
    for b in [] if "eager" in skip else batches:
        section(
            f"decode b={b} ctx={args.ctx} (eager, DynamicCache)",
            lambda b=b: {c.name: EagerDecode(c.module, b, args.ctx, device, vocab) for c in (cs, co)},
            16,
        )
        section(f"decode b={b} ctx={args.ctx} (eager, StaticCache)",
                lambda b=b: {c.name: Decode(c, b, args.ctx, steps, False, vocab, 1).step for c in (cs, co)},
                16)  # fmt: skip
    if cuda and "graph" not in skip:
        default_mode = attn_mod.MASKED_DECODE
        for b in batches:

            def graphs(b=b):
                fns = {"stock": Decode(cs, b, args.ctx, steps, True, vocab, 1).replay}
                for mode in [m for m in args.masked_decode.split(",") if m]:
                    attn_mod.set_masked_decode(mode)  # fixed when the graph is captured
                    fns[mode] = Decode(co, b, args.ctx, steps, True, vocab, 1).replay
                attn_mod.set_masked_decode(default_mode)
                return fns

            section(f"decode b={b} ctx={args.ctx} (CUDA graph, StaticCache)", graphs, 16)
            attn_mod.set_masked_decode(default_mode)
            torch.cuda.empty_cache()
    if cuda and "profile" not in skip:
        scen = {f"prefill s={args.prefill} (eager)": lambda c: (prefill_call(c, ids), None)}
        for b in batches:
            scen[f"decode b={b} (eager)"] = lambda c, b=b: (EagerDecode(c.module, b, args.ctx, device, vocab), None)
            scen[f"decode b={b} (CUDA graph)"] = lambda c, b=b: graph_and_step(
                Decode(c, b, args.ctx, 64, True, vocab, 1)
            )
        for name, make in scen.items():
            try:
                got = []
                for c in (cs, co):
                    fn, eager_step = make(c)
                    hints = profile(eager_step, warmup=1, iters=3).kernel_categories() if eager_step else None
                    got.append(profile(fn, warmup=1, iters=8, hints=hints, annotate=eager_step is None))
                breakdown[name] = got
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001
                errors.append(f"profile {name}: {type(exc).__name__}: {exc}")
                traceback.print_exc()

    lines = ["# End-to-end: stock HF (sdpa) vs gemmtune.optimize()", "", *[f"- {h}" for h in head], ""]
    lines += ["Median ms per call (± half the spread over reps), stock and gemmtune interleaved in one process.", ""]
    lines += ["| scenario | stock ms | gemmtune ms | speedup |", "|---|---|---|---|", *rows, ""]
    if breakdown:
        lines += ["## Device time per call by category (gemmtune.profile), ms", ""]
        lines += ["| scenario | side | " + " | ".join(label(c, "cuda") for c in CATEGORIES) + " | total |",
                  "|---" * (len(CATEGORIES) + 3) + "|"]  # fmt: skip
        for name, profs in breakdown.items():
            for side, pr in zip(("stock", "gemmtune"), profs):
                vals = " | ".join(f"{pr.categories[c]:.3f}" for c in CATEGORIES)
                lines.append(f"| {name} | {side} | {vals} | {pr.total_ms:.3f} |")
        lines += ["", "Top kernels (ms per call):", ""]
        for name, profs in breakdown.items():
            for side, pr in zip(("stock", "gemmtune"), profs):
                top = [i for i in pr.breakdown.items if i.category != "idle"][:8]
                lines.append(f"- {name}, {side}: " + "; ".join(f"`{i.name[:70]}` {i.ms:.3f}" for i in top))
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
