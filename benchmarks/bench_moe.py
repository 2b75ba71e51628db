"""Mixture of experts on one GPU: gemmtune.fused_moe vs Hugging Face's experts and torch._grouped_mm.

Part `op` (the acceptance's speed matrix): Mixtral-8x7B experts (tp 1 and 2: I = 14336, 7168) and
Qwen3-30B-A3B experts, tokens 1 .. 4096, real top-k routing (softmax of random router logits, top-k,
renormalized). Contenders run on the same inputs (rotating routing sets), interleaved, median of reps
(gemmtune.tuner.timing.time_graphs):
  gemmtune     fused_moe's untuned default (the Triton heuristic pair)
  tuned        with --table: the solution the table's row gives fused_moe (what `gemmtune tune` chose);
               otherwise the best of a quick stage search (tuner/stages.py: --sweep kernels per backend
               and stage timed apart, the fastest pairs timed whole; mixed Triton / grouped_mm pairs too)
  grouped_mm   the whole MoE on torch._grouped_mm in plain torch ops (sorted on the device)
  hf_grouped_mm / hf_batched_mm   transformers' experts implementations (experts_implementation;
               grouped_mm is transformers 5.x's default for a whole model). batched_mm is skipped
               where its per-slot weight gather would not fit in memory.
  hf_eager     transformers' eager loop over the experts hit (experts_implementation="eager", the
               stock path of transformers 4.x). It syncs with the host, so it cannot be captured: it is
               timed EAGERLY (CUDA events around one call, launch cost and syncs included); every
               other contender is a CUDA-graph replay. Ratios against it are marked "(eager)".
  roof         max(FLOPs / bf16 matmul ceiling, bytes of the experts actually hit + activations / read BW),
               ceilings measured in this run.
"x grouped_mm" compares with the faster of grouped_mm and hf_grouped_mm (the torch._grouped_mm baseline).

Part `e2e`: a 4-layer Qwen3-30B-A3B-architecture model (random weights, router re-initialized so
routing is spread), gemmtune.optimize() vs stock HF with each experts implementation (eager loop,
grouped_mm = the default of transformers 5.x, batched_mm): decode b=1 and b=8 on a StaticCache (CUDA
graphs; the eager loop eagerly), and prefill of 2048 tokens (eager, last-token logits). x_hf_best is
the speedup over the fastest of them, x_hf_default over the model's default. On a GPU each decode row
has the weight-read roof too (weight_read: dense weights, lm_head and the experts hit, at the read
bandwidth measured in the run) and optimize()'s share of it. --table applies here too.

    python benchmarks/bench_moe.py --part op --out OUT_DIR                                   # ~5-8 min on an H100
    python benchmarks/bench_moe.py --part op --table tuned_fmoe.csv --out ...                # tuned = the table's rows
    python benchmarks/bench_moe.py --part e2e --out OUT_DIR                                  # ~2-3 min
    python benchmarks/bench_moe.py --device cpu --tiny --out /tmp/moe                        # smoke test (CPU, tiny)

--ab-stage1-split adds a contender `unsplit1` wherever the default splits stage 1 over H: the same pair
with stage 1 unsplit, timed interleaved with it (the A/B of backends/fmoe/triton.py's STAGE1_SPLIT rule).
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import math
import pathlib
import statistics
import sys
import time
import traceback
import zlib

import torch

MODELS = {  # name: (hidden, inter per rank, experts, topk)
    "mixtral-8x7b-tp1": (4096, 14336, 8, 2),
    "mixtral-8x7b-tp2": (4096, 7168, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),  # its routed experts, tp1 (the shared expert is a dense MLP)
}
TINY_MODELS = {"tiny-mixtral": (64, 96, 6, 2), "tiny-qwen3": (32, 16, 12, 8)}
# Part `grid`: expert shapes well beyond the repo's models (hidden, inter per rank, experts, topk), for the
# rule of the untuned default (backends/fmoe/policy.py): it must never lose to transformers' best.
GRID = {
    "E8-k2-I4096-H4096": (4096, 4096, 8, 2),  # Mixtral-8x7B tp4
    "E8-k2-I14336-H4096": (4096, 14336, 8, 2),  # Mixtral-8x7B
    "E16-k1-I8192-H5120": (5120, 8192, 16, 1),  # Llama-4-Scout
    "E60-k4-I1408-H2048": (2048, 1408, 60, 4),  # Qwen1.5-MoE-A2.7B
    "E64-k6-I1408-H2048": (2048, 1408, 64, 6),  # DeepSeek-V2-Lite
    "E64-k8-I1024-H2048": (2048, 1024, 64, 8),  # OLMoE-1B-7B
    "E64-k8-I1280-H4096": (4096, 1280, 64, 8),
    "E128-k8-I384-H2048": (2048, 384, 128, 8),  # Qwen3-30B-A3B tp2
    "E128-k8-I1408-H4096": (4096, 1408, 128, 8),  # GLM-4.5-Air-like
    "E128-k1-I1024-H5120": (5120, 1024, 128, 1),  # Llama-4-Maverick tp8
    "E256-k8-I256-H7168": (7168, 256, 256, 8),  # DeepSeek-V3 tp8
    "E512-k10-I512-H2048": (2048, 512, 512, 10),  # Qwen3-Next-like
}
GRID_TOKENS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096]
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
HF_GRAPH = ("hf_grouped_mm", "hf_batched_mm")


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def geomean(xs):
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def hf_experts(kind: str, hidden: int, inter: int, experts: int, topk: int, w1, w2, impl: str):
    """transformers' experts module of `kind` holding w1/w2 (shared, not copied), forward = `impl`."""
    import transformers as t

    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        cfg = t.MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                              num_experts_per_tok=topk)  # fmt: skip
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        cfg = t.Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                               num_experts_per_tok=topk)  # fmt: skip
    cfg._experts_implementation = impl
    with torch.device("meta"):
        mod = cls(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w1, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return mod


def time_all(graphs: dict, eager: dict, reps: int, per_call: int, cuda: bool) -> dict[str, float]:
    """us per call: graph contenders as CUDA-graph replays, `eager` ones eagerly (time_graphs); on the
    CPU everything eagerly, wall clock, interleaved (a smoke test, not a speed claim)."""
    if cuda:
        from gemmtune.tuner.timing import time_graphs

        ms = time_graphs(graphs, reps=reps, calls_per_graph=per_call, eager=eager)
        return {n: v * 1e3 for n, v in ms.items()}
    fns = {**graphs, **eager}
    samples: dict[str, list[float]] = {n: [] for n in fns}
    for _ in range(reps):
        for n, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[n].append((time.perf_counter() - t0) * 1e6 / per_call)
    return {n: statistics.median(v) for n, v in samples.items()}


def quick_pairs(key, sets, device, sweep: int):
    """(backend, solution) pairs of a quick stage search: --sweep kernels per backend and stage."""
    from gemmtune.backends.fmoe.pytorch import TorchMoeBackend
    from gemmtune.backends.fmoe.triton import TritonMoeBackend
    from gemmtune.families import fmoe
    from gemmtune.tuner.search import TuneOptions
    from gemmtune.tuner.stages import search_stages

    chosen = {b.name: b for b in (TorchMoeBackend(), TritonMoeBackend()) if b.is_available(device)}
    found = search_stages(fmoe.FAMILY, key, device, chosen, sets, TuneOptions(stage_limit=sweep, screen_reps=5), 0)
    bad = [f"{c.name}: {c.reason}" for c in found.candidates if c.status not in ("ok", "pending")]
    if bad:
        log("  stage kernels not kept: " + "; ".join(bad[:4]))
    return found.pairs


def unsplit_stage1(sol):
    """The default pair `sol` with its stage 1 unsplit, or None where its stage 1 is not a split Triton one."""
    from dataclasses import replace

    from gemmtune.backends.fmoe.stages import GM, parse_stage
    from gemmtune.backends.fmoe.triton import solution_of
    from gemmtune.families.fmoe import split_name

    n1, n2 = split_name(sol.kernel_name)
    s1 = parse_stage(n1, 1)
    if sol.libtype != "triton" or s1 in (None, GM) or s1.split_k == 1:
        return None
    return solution_of(replace(s1, split_k=1), parse_stage(n2, 2))


def expert_inputs(key, sets: int, g: torch.Generator) -> list[tuple]:
    """`sets` fused_moe input tuples of `key` on g's device: one set of expert weights, each set its own
    hidden states and real top-k routing (softmax of random router logits)."""
    from gemmtune.families import fmoe

    T, H, inter, E, dt, dev = key.token, key.model_dim, key.inter_dim, key.expert, key.dtype, g.device
    w1 = (torch.randn(E, 2 * inter, H, device=dev, generator=g) / H**0.5).to(dt)
    w2 = (torch.randn(E, H, inter, device=dev, generator=g) / inter**0.5).to(dt)
    ins = []
    for _ in range(sets):
        x = torch.randn(T, H, device=dev, generator=g).to(dt)
        w, ids = fmoe.route(torch.randn(T, E, device=dev, generator=g), key.topk)
        ins.append((x, w1, w2, w, ids, None))
    return ins


def op_point(name, T, sets, ceilings, device, args) -> dict:
    from gemmtune import backends
    from gemmtune.backends.fmoe.pytorch import grouped_mm_torch_runner
    from gemmtune.backends.fmoe.stages import grouped_mm_fits
    from gemmtune.families import fmoe

    H, inter, E, topk = {**MODELS, **GRID, **TINY_MODELS}[name]
    cuda = device.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    key = fmoe.MoeKey(T, H, inter, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name} {T}".encode()))
    ins = expert_inputs(key, sets, g)
    w1, w2 = ins[0][1], ins[0][2]
    ref = fmoe.FAMILY.reference(key, ins[0])

    def all_sets(run):
        return lambda: [run(*inp) for inp in ins]

    def err(run):
        y = run(*ins[0]).float()
        return ((y - ref).norm() / ref.norm()).item()

    default_backend, default = backends.default("fmoe", key, device)  # what an untuned key runs
    contenders = {"gemmtune": default_backend.make_runner(default, key, device)}
    names = {"gemmtune": default.describe()}
    unsplit = unsplit_stage1(default) if args.ab_stage1_split else None
    if unsplit is not None:
        contenders["unsplit1"] = default_backend.make_runner(unsplit, key, device)
        names["unsplit1"] = unsplit.describe()
    if args.table:
        from gemmtune.dispatch import resolve

        res = resolve(key, device, family="fmoe")
        contenders["tuned"] = res.runner
        names["tuned"] = res.solution.describe() if res.row is not None else f"no row: {default.describe()}"
    elif args.sweep:
        for i, (backend, sol) in enumerate(quick_pairs(key, ins, device, args.sweep)):
            contenders[f"cand{i}"] = backend.make_runner(sol, key, device)
            names[f"cand{i}"] = sol.describe()
    if grouped_mm_fits(key, device):
        contenders["grouped_mm"] = grouped_mm_torch_runner(key)
    kind = "mixtral" if "mixtral" in name else "qwen3"
    eager = {}
    for impl in ("grouped_mm", "batched_mm") + (() if args.part == "grid" else ("eager",)):
        if impl == "batched_mm" and T * topk * fmoe.expert_bytes(key) > 6e9:
            continue  # batched_mm gathers every slot's expert weights: would not fit
        mod = hf_experts(kind, H, inter, E, topk, w1, w2, impl)
        run = lambda x, a, b, w, ids, m, mod=mod: mod(x, ids, w)  # noqa: E731
        (eager if impl == "eager" else contenders)[f"hf_{impl}"] = run
    errs, graph_calls, eager_calls = {}, {}, {}
    for n, run in {**contenders, **eager}.items():
        try:
            with torch.no_grad():
                errs[n] = err(run)
            if not errs[n] < 2e-2:
                log(f"  {name} T={T} {n}: rel err {errs[n]:.2e}: dropped")
                continue
            (eager_calls if n in eager else graph_calls)[n] = all_sets(run)
        except Exception as exc:  # noqa: BLE001 - report, keep going
            log(f"  {name} T={T} {n}: {type(exc).__name__}: {str(exc)[:200]}")
    with torch.no_grad():
        us = time_all(graph_calls, eager_calls, args.reps, sets, cuda)
    us = {n: v for n, v in us.items() if math.isfinite(v)}
    tuned = "tuned" if args.table else min((n for n in us if n.startswith("cand") or n == "gemmtune"), key=us.get)
    hit_bytes = sum(fmoe.bytes_hit(key, inp[4]) for inp in ins) / sets
    roof = max(fmoe.FAMILY.flops(key) / ceilings.flops, hit_bytes / ceilings.read_bw) * 1e6 if ceilings else None
    hf = [us[n] for n in HF_GRAPH if n in us]
    base = [us[n] for n in ("grouped_mm", "hf_grouped_mm") if n in us]
    return {"model": name, "T": T, "gemmtune_us": us.get("gemmtune"), "default_solution": names["gemmtune"],
            "tuned_us": us.get(tuned),
            "tuned_solution": names.get(tuned, ""), "grouped_mm_us": us.get("grouped_mm"),
            "hf_grouped_mm_us": us.get("hf_grouped_mm"), "hf_batched_mm_us": us.get("hf_batched_mm"),
            "hf_best_us": min(hf) if hf else None, "hf_eager_us_eager_timed": us.get("hf_eager"),
            "grouped_mm_base_us": min(base) if base else None, "roof_us": roof, "hit_MB": hit_bytes / 1e6,
            "err_gemmtune": errs.get("gemmtune"), "err_tuned": errs.get(tuned), "unsplit1_us": us.get("unsplit1"),
            "unsplit1_solution": names.get("unsplit1", "")}  # fmt: skip


def run_op(args, device, ceilings) -> list[dict]:
    rows = []
    for name in args.models:
        for T in args.tokens:
            t0 = time.time()
            sets = 8 if T <= 64 else 2
            try:
                row = op_point(name, T, sets, ceilings, device, args)
            except Exception:  # noqa: BLE001
                log(traceback.format_exc())
                continue
            rows.append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            f = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
            log(f"{name:<18} T={T:<5} gemmtune {f(row['gemmtune_us'])} tuned {f(row['tuned_us'])} "
                f"grouped_mm {f(row['grouped_mm_base_us'])} hf_best {f(row['hf_best_us'])} "
                f"hf_eager {f(row['hf_eager_us_eager_timed'])} roof {f(row['roof_us'])} "
                + (f"unsplit1 {f(row['unsplit1_us'])} " if row["unsplit1_us"] else "")
                + f"({time.time() - t0:.0f}s; tuned = {row['tuned_solution']})")  # fmt: skip
    return rows


def _ratio(a, b) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def summarize_op(rows) -> list[str]:
    head = ("| model | T | gemmtune us | tuned us | grouped_mm base us | HF best us (graph) | HF eager loop us (eager) "
            "| roof us | x HF best | x HF eager (eager) | x grouped_mm | % roof |")  # fmt: skip
    out = [head, "|" + "---|" * 12]
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        t = r["tuned_us"]
        pct = f"{100 * r['roof_us'] / t:.0f}%" if r["roof_us"] and t else "-"
        out.append(f"| {r['model']} | {r['T']} | {f(r['gemmtune_us'])} | {f(t)} | {f(r['grouped_mm_base_us'])} | "
                   f"{f(r['hf_best_us'])} | {f(r['hf_eager_us_eager_timed'])} | {f(r['roof_us'])} | "
                   f"{_ratio(r['hf_best_us'], t)} | {_ratio(r['hf_eager_us_eager_timed'], t)} | "
                   f"{_ratio(r['grouped_mm_base_us'], t)} | {pct} |")  # fmt: skip
    out += ["", "tuned solutions: " + "; ".join(f"{r['model']} T={r['T']}: {r['tuned_solution']}" for r in rows)]
    dec = [r for r in rows if r["T"] <= 16]
    big = [r for r in rows if r["T"] >= 1024]
    for label, col in (("tuned", "tuned_us"), ("gemmtune default", "gemmtune_us")):
        roof = geomean([r["roof_us"] / r[col] for r in dec if r.get(col) and r["roof_us"]])
        hf = geomean([r["hf_best_us"] / r[col] for r in dec if r.get(col) and r["hf_best_us"]])
        eag = geomean([r["hf_eager_us_eager_timed"] / r[col] for r in dec
                       if r.get(col) and r["hf_eager_us_eager_timed"]])  # fmt: skip
        out += ["", f"{label}: decode (T <= 16) roof fraction geomean {roof:.2f}; speedup geomean over HF best "
                    f"(graph) {hf:.2f}, over the HF eager loop (eager-timed, uncapturable) {eag:.2f}"]  # fmt: skip
        sp = [r["grouped_mm_base_us"] / r[col] for r in big if r.get(col) and r["grouped_mm_base_us"]]
        if sp:
            slower = sum(s < 1 for s in sp)
            out.append(f"{label}: T >= 1024 over the grouped_mm baseline geomean {geomean(sp):.2f}, worst "
                       f"{min(sp):.2f} ({slower} of {len(sp)} points below 1.00)")  # fmt: skip
    return out


def summarize_stage1_split(rows) -> list[str]:
    """--ab-stage1-split: the default (stage 1 split) against the same pair with stage 1 unsplit."""
    ab = [r for r in rows if r.get("unsplit1_us") and r.get("gemmtune_us")]
    if not ab:
        return []
    out = ["", "Stage 1 split over H (the default) vs unsplit, same stage 2; x > 1: the split is faster.", "",
           "| experts | T | split us | unsplit us | x unsplit | % roof split | % roof unsplit | default |",
           "|" + "---|" * 8]  # fmt: skip
    pct = lambda r, col: f"{100 * r['roof_us'] / r[col]:.0f}%" if r["roof_us"] else "-"  # noqa: E731
    for r in ab:
        out.append(f"| {r['model']} | {r['T']} | {r['gemmtune_us']:.1f} | {r['unsplit1_us']:.1f} | "
                   f"{_ratio(r['unsplit1_us'], r['gemmtune_us'])} | {pct(r, 'gemmtune_us')} | "
                   f"{pct(r, 'unsplit1_us')} | {r['default_solution']} |")  # fmt: skip
    sp = [r["unsplit1_us"] / r["gemmtune_us"] for r in ab]
    out += ["", f"split vs unsplit: geomean x {geomean(sp):.2f}, worst {min(sp):.2f} ({len(sp)} points)"]
    return out


def summarize_grid(rows) -> list[str]:
    """The untuned default against transformers' best (grouped_mm or batched_mm, CUDA graphs), per point."""
    out = ["| experts | T | default us | HF grouped_mm us | HF batched_mm us | x HF best | % roof | default |",
           "|" + "---|" * 8]  # fmt: skip
    f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    for r in rows:
        d = r["gemmtune_us"]
        pct = f"{100 * r['roof_us'] / d:.0f}%" if r["roof_us"] and d else "-"
        out.append(f"| {r['model']} | {r['T']} | {f(d)} | {f(r['hf_grouped_mm_us'])} | {f(r['hf_batched_mm_us'])} | "
                   f"{_ratio(r['hf_best_us'], d)} | {pct} | {r['default_solution']} |")  # fmt: skip
    out += ["", "| T range | points | x HF best geomean | worst | points below 1.00 |", "|---|---|---|---|---|"]
    for lo, hi, label in ((1, 16, "T <= 16"), (17, 512, "17..512"), (1024, 1 << 30, "T >= 1024"), (1, 1 << 30, "all")):
        sp = [r["hf_best_us"] / r["gemmtune_us"] for r in rows
              if lo <= r["T"] <= hi and r["hf_best_us"] and r["gemmtune_us"]]  # fmt: skip
        if sp:
            out.append(f"| {label} | {len(sp)} | {geomean(sp):.2f} | {min(sp):.2f} | {sum(x < 1 for x in sp)} |")
    return out


# ---- e2e ----------------------------------------------------------------------------------------
QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
             "tie_word_embeddings": False, "norm_topk_prob": True}  # fmt: skip
TINY_QWEN3 = {**QWEN3_30B, "hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 8, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "intermediate_size": 128}  # fmt: skip
HF_IMPLS = ("eager", "grouped_mm", "batched_mm")


def build_qwen3(layers: int, device, tiny: bool):
    from gemmtune.profiling.build import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, desc = build_model(dict(TINY_QWEN3 if tiny else QWEN3_30B), layers, device, dtype)
    with torch.no_grad():  # spread routing: a router left near zero sends every token to the same experts
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.normal_(0.0, m.weight.shape[1] ** -0.5)
    return model, desc


def stock_variant(stock, impl: str):
    """The stock model with another experts implementation, sharing its weights."""
    memo = {id(t): t for t in (*stock.parameters(), *stock.buffers())}
    model = copy.deepcopy(stock, memo)
    model.set_experts_implementation(impl)
    return model


def _batched_mm_fits(model, tokens: int) -> bool:
    cfg = model.config
    per_expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * model.dtype.itemsize
    return tokens * cfg.num_experts_per_tok * per_expert <= 6e9  # batched_mm gathers every slot's weights


def weight_read(model, batch: int) -> tuple[int, float]:
    """(bytes, experts hit per MoE layer) one decode step of `batch` tokens reads of the weights: every
    dense weight (lm_head included; of the embedding only the tokens' rows) and the experts hit, counted
    on a forward of `batch` random one-token sequences (the roof of issue 29: KV cache reads left out)."""
    experts = [m for m in model.modules() if getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3]
    embed = model.get_input_embeddings().weight
    skip = {id(embed)} | {id(t) for m in experts for t in (m.gate_up_proj, m.down_proj)}
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)
    dense += batch * embed.shape[1] * embed.element_size()
    hit: list[int] = []
    hooks = [m.register_forward_pre_hook(lambda mod, a: hit.append(int(a[1].unique().numel()))) for m in experts]
    try:
        g = torch.Generator(device="cpu").manual_seed(3)
        ids = torch.randint(0, model.config.vocab_size, (batch, 1), generator=g).to(embed.device)
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    per_expert = [(m.gate_up_proj[0].numel() + m.down_proj[0].numel()) * m.down_proj.element_size() for m in experts]
    return dense + sum(n * b for n, b in zip(hit, per_expert)), sum(hit) / max(1, len(hit))


def run_e2e(args, device) -> tuple[list[dict], dict]:
    import gemmtune
    from gemmtune.profiling.bench_model import Contender, Decode, interleaved, prefill_call

    cuda = device.type == "cuda"
    stock, desc = build_qwen3(args.layers, device, args.tiny)
    default_impl = stock.config._experts_implementation
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    log(str(report))
    models = {f"hf_{impl}": stock_variant(stock, impl) for impl in HF_IMPLS}
    models["gemmtune"] = opt
    vocab = stock.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(2)
    probe = torch.randint(0, vocab, (1, 64), generator=g).to(device)
    with torch.no_grad():
        want = models["hf_eager"](input_ids=probe, use_cache=False, logits_to_keep=1).logits.float()
        got = opt(input_ids=probe, use_cache=False, logits_to_keep=1).logits.float()
    meta = {"model": desc, "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "transformers": __import__("transformers").__version__, "hf_default_experts": default_impl,
            "optimize": str(report).splitlines()[0] if str(report) else "",
            "parity": f"optimize() vs HF eager loop, 64-token prefill logits: max |diff| "
                      f"{(got - want).abs().max().item():.3g} of max |x| {want.abs().max().item():.3g}"}  # fmt: skip
    log(meta["parity"])
    rows = []
    iters = 16 if cuda else 2
    steps = 8 + args.e2e_reps * iters + 32
    read_bw = None
    if cuda:
        from gemmtune.tuner.timing import measure_ceilings

        read_bw = measure_ceilings(device).read_bw
        meta["read_bw_GBps"] = read_bw / 1e9
    for b in (1, 8):
        fns = {}
        for name, model in models.items():
            graph = cuda and name != "hf_eager"  # the eager loop syncs with the host: no graph
            try:
                dec = Decode(Contender(name, model, model), b, args.ctx, steps, graph, vocab, 0)
                fns[name] = dec.replay
            except Exception as exc:  # noqa: BLE001
                log(f"decode b={b} {name}: {type(exc).__name__}: {str(exc)[:200]}")
        row = _e2e_row(f"decode b={b} ctx={args.ctx}", interleaved(fns, iters, args.e2e_reps, cuda),
                       "CUDA graph, hf_eager eager" if cuda else "eager, CPU", default_impl)  # fmt: skip
        if read_bw:
            nbytes, hit = weight_read(stock, b)
            row.update(weight_MB=nbytes / 1e6, experts_hit_per_layer=hit, weight_roof_ms=nbytes / read_bw * 1e3)
            if "gemmtune_ms" in row:
                row["gemmtune_pct_roof"] = 100 * row["weight_roof_ms"] / row["gemmtune_ms"]
            log(row)
        rows.append(row)
        del fns
        if cuda:
            torch.cuda.empty_cache()
    ids = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    fns = {n: prefill_call(Contender(n, m, m), ids) for n, m in models.items()
           if n != "hf_batched_mm" or _batched_mm_fits(stock, args.prefill)}  # fmt: skip
    for fn in fns.values():
        fn()  # warm-up: compiles, caches
    rows.append(_e2e_row(f"prefill {args.prefill} tokens", interleaved(fns, 2 if cuda else 1, args.e2e_reps, cuda),
                         "eager", default_impl))  # fmt: skip
    return rows, meta


def _e2e_row(what: str, times: dict[str, list[float]], how: str, default_impl: str) -> dict:
    ms = {k: statistics.median(v) for k, v in times.items()}
    hf = {k: v for k, v in ms.items() if k.startswith("hf_")}
    best = min(hf, key=hf.get) if hf else None
    row = {"what": what, "timing": how, **{f"{k}_ms": v for k, v in ms.items()}}
    if "gemmtune" in ms and best:
        row["hf_best"] = best
        row["x_hf_best"] = hf[best] / ms["gemmtune"]
        if f"hf_{default_impl}" in hf:
            row["x_hf_default"] = hf[f"hf_{default_impl}"] / ms["gemmtune"]
        for k, v in hf.items():
            row[f"x_{k}"] = v / ms["gemmtune"]
    log(row)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for moe_op.csv/json, moe_e2e.json and moe.md")
    ap.add_argument(
        "--part",
        choices=["op", "grid", "e2e", "all"],
        default="all",
        help="grid: the untuned default vs transformers over GRID (no search, no eager loop)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", "--smoke", action="store_true", help="tiny sizes (a CPU smoke test of the script)")
    ap.add_argument("--models", default=None, help="comma list of the op part's models (default: all)")
    ap.add_argument("--tokens", default=None, help="token counts (default: TOKENS, or GRID_TOKENS for --part grid)")
    ap.add_argument("--table", default=None, help="tuned fmoe table: the tuned column is its rows' solutions")
    ap.add_argument("--sweep", type=int, default=6, help="without --table: kernels per backend and stage timed")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ab-stage1-split", action="store_true",
                    help="also time the default with stage 1 unsplit where the default splits it over H")  # fmt: skip
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--e2e-reps", type=int, default=7)
    args = ap.parse_args(argv)
    zoo = TINY_MODELS if args.tiny else GRID if args.part == "grid" else {**MODELS, **GRID}
    args.models = args.models.split(",") if args.models else list(zoo)
    if args.part == "grid":
        args.sweep = 0  # the default against transformers: no search
    unknown = [m for m in args.models if m not in zoo]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(zoo)}")
    args.tokens = (
        [int(t) for t in args.tokens.split(",")] if args.tokens else (GRID_TOKENS if args.part == "grid" else TOKENS)
    )
    if args.tiny:
        args.ctx, args.prefill = min(args.ctx, 32), min(args.prefill, 48)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.table:
        import gemmtune

        gemmtune.set_config(args.table)
    md = [f"# MoE bench ({torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__})", ""]
    if not cuda:
        md += ["CPU: every contender eager, wall clock: a smoke test of the script, not a speed claim.", ""]
    t0 = time.time()
    if args.part == "grid":
        from gemmtune.tuner.timing import measure_ceilings

        rows = run_op(args, device, measure_ceilings(device) if cuda else None)
        (out / "moe_grid.json").write_text(json.dumps(rows, indent=1))
        md += [
            "The untuned fused_moe default vs transformers' experts (grouped_mm / batched_mm), CUDA graphs, "
            "real top-k routing; x HF best > 1: the default is faster.",
            "",
        ] + summarize_grid(rows)
        md += summarize_stage1_split(rows)
    if args.part in ("op", "all"):
        ceilings = None
        if cuda:
            from gemmtune.tuner.timing import measure_ceilings

            ceilings = measure_ceilings(device)
            md += [f"Ceilings: {ceilings.describe()}", ""]
        md += ["Tuned: " + (f"rows of {args.table}" if args.table else f"quick stage search (--sweep {args.sweep})"),
               "HF best = the faster of transformers' grouped_mm and batched_mm (CUDA graphs); HF eager loop = "
               "experts_implementation='eager', timed eagerly (not capturable); grouped_mm base = the faster of "
               "gemmtune's plain-torch torch._grouped_mm MoE and HF's grouped_mm.", ""]  # fmt: skip
        rows = run_op(args, device, ceilings)
        if rows:
            with open(out / "moe_op.csv", "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            (out / "moe_op.json").write_text(json.dumps(rows, indent=1))
            md += summarize_op(rows) + summarize_stage1_split(rows)
        log(f"op part: {time.time() - t0:.0f}s")
    if args.part in ("e2e", "all"):
        rows, meta = run_e2e(args, device)
        (out / "moe_e2e.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        md += ["", "End to end (ms per call; x = speedup of optimize() over each stock HF experts implementation; "
                   f"transformers' default for this model: {meta['hf_default_experts']}):",
               f"- {meta['parity']}"]  # fmt: skip
        for r in rows:
            md.append(f"- {r['what']} ({r['timing']}): " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                if k not in ("what", "timing")))  # fmt: skip
    text = "\n".join(md)
    (out / "moe.md").write_text(text + "\n")
    print(text)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
