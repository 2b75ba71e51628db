"""Mixture of experts on one GPU: gemmtune.fused_moe vs Hugging Face's experts and torch._grouped_mm.

Part `op` (the acceptance's speed matrix): Mixtral-8x7B experts (tp 1 and 2: I = 14336, 7168) and
Qwen3-30B-A3B experts, tokens 1 .. 4096, real top-k routing (softmax of random router logits, top-k,
renormalized). Contenders, all on the same inputs, CUDA-graph replay over rotating routing sets,
interleaved, median of reps (gemmtune.tuner.timing.time_graphs):
  gemmtune    fused_moe's untuned default (the Triton heuristic config)
  tuned       the best of a small sweep of Triton config pairs (what a tuned row would pick)
  grouped_mm  the same MoE on torch._grouped_mm (sorted on the device, backends/moe.py)
  hf_grouped_mm / hf_batched_mm   transformers' own experts implementations (config._experts_implementation;
              the default eager loop cannot be captured). batched_mm is skipped where its per-slot
              weight gather would not fit in memory.
  roof        max(FLOPs / bf16 matmul ceiling, bytes of the experts actually hit + activations / read BW),
              ceilings measured in this run.
Part `e2e`: a 4-layer Qwen3-30B-A3B-architecture model (random weights, router re-initialized so
routing is spread), stock HF (best of its experts implementations) vs gemmtune.optimize():
CUDA-graph decode b=1 and b=8 on a StaticCache, and prefill of 2048 tokens.

    python benchmarks/bench_moe.py --out benchmarks/results/h100/moe        # both parts, ~6-7 min on an H100
    python benchmarks/bench_moe.py --part op --out ...                       # only the speed matrix
    python benchmarks/bench_moe.py --device cpu --smoke --out /tmp/moe      # script smoke test (CPU)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import sys
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

MODELS = {  # name: (hidden, inter per rank, experts, topk)
    "mixtral-8x7b-tp1": (4096, 14336, 8, 2),
    "mixtral-8x7b-tp2": (4096, 7168, 8, 2),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
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


def op_point(name, T, sets, ceilings, device, sweep: int, reps: int) -> dict:
    from gemmtune.backends import moe as bmoe
    from gemmtune.families import fmoe
    from gemmtune.tuner.timing import time_graphs

    H, inter, E, topk = MODELS[name]
    key = fmoe.MoeKey(T, H, inter, E, topk)
    g = torch.Generator(device=device).manual_seed(hash((name, T)) & 0xFFFF)
    w1 = (torch.randn(E, 2 * inter, H, device=device, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, inter, device=device, generator=g) / inter**0.5).to(torch.bfloat16)
    ins = []
    for _ in range(sets):
        x = torch.randn(T, H, device=device, generator=g).to(torch.bfloat16)
        w, ids = fmoe.route(torch.randn(T, E, device=device, generator=g), topk)
        ins.append((x, w, ids))
    ref = fmoe.FAMILY.reference(key, (ins[0][0], w1, w2, ins[0][1], ins[0][2], None))

    def all_sets(run):
        return lambda: [run(x, w1, w2, w, ids, None) for x, w, ids in ins]

    def err(run):
        y = run(ins[0][0], w1, w2, ins[0][1], ins[0][2], None).float()
        return ((y - ref).norm() / ref.norm()).item()

    calls, errs = {}, {}
    tri, tor = bmoe.TritonMoeBackend(), bmoe.TorchMoeBackend()
    dev = torch.device(device)
    default = tor.default_solution(key, dev)
    contenders = {"gemmtune": tor.make_runner(default, key, dev)}
    if bmoe.grouped_mm_usable(torch.bfloat16, dev):
        contenders["grouped_mm"] = tor.make_runner(bmoe.GROUPED_MM, key, dev)
    sweep_sols = tri.candidates(key, dev)[1 : 1 + sweep] if tri.is_available(dev) else []
    for i, sol in enumerate(sweep_sols):
        contenders[f"cand{i}"] = tri.make_runner(sol, key, dev)
    kind = "mixtral" if name.startswith("mixtral") else "qwen3"
    for impl in ("grouped_mm", "batched_mm"):
        if impl == "batched_mm" and T * topk * fmoe.expert_bytes(key) > 6e9:
            continue  # batched_mm gathers every slot's expert weights: would not fit
        mod = hf_experts(kind, H, inter, E, topk, w1, w2, impl)
        contenders[f"hf_{impl}"] = lambda x, a, b, w, ids, m, mod=mod: mod(x, ids, w)
    for n, run in contenders.items():
        try:
            with torch.no_grad():
                errs[n] = err(run)
            if not errs[n] < 2e-2:
                log(f"  {name} T={T} {n}: rel err {errs[n]:.2e}: dropped")
                continue
            calls[n] = all_sets(run)
        except Exception as exc:  # noqa: BLE001 - report, keep going
            log(f"  {name} T={T} {n}: {type(exc).__name__}: {str(exc)[:200]}")
    with torch.no_grad():
        ms = time_graphs(calls, reps=reps, calls_per_graph=sets)
    us = {n: v * 1e3 for n, v in ms.items()}
    cand = {n: v for n, v in us.items() if n.startswith("cand") or n == "gemmtune"}
    best = min(cand, key=lambda n: cand[n] if math.isfinite(cand[n]) else float("inf"))
    hit_bytes = sum(fmoe.bytes_hit(key, ids) for _, _, ids in ins) / sets
    roof = max(fmoe.FAMILY.flops(key) / ceilings.flops, hit_bytes / ceilings.read_bw) * 1e6
    hf = [us[n] for n in ("hf_grouped_mm", "hf_batched_mm") if n in us and math.isfinite(us[n])]
    row = {"model": name, "T": T, "gemmtune_us": us.get("gemmtune"), "tuned_us": us[best],
           "tuned_config": "default" if best == "gemmtune" else sweep_sols[int(best[4:])].kernel_name,
           "grouped_mm_us": us.get("grouped_mm"), "hf_grouped_mm_us": us.get("hf_grouped_mm"),
           "hf_batched_mm_us": us.get("hf_batched_mm"), "hf_best_us": min(hf) if hf else None, "roof_us": roof,
           "hit_MB": hit_bytes / 1e6, "err_gemmtune": errs.get("gemmtune"), "err_tuned": errs.get(best)}  # fmt: skip
    return row


def run_op(args, device, ceilings) -> list[dict]:
    rows = []
    for name in MODELS:
        for T in args.tokens:
            t0 = time.time()
            sets = 8 if T <= 64 else 2
            try:
                row = op_point(name, T, sets, ceilings, device, args.sweep, args.reps)
            except Exception:  # noqa: BLE001
                log(traceback.format_exc())
                continue
            rows.append(row)
            torch.cuda.empty_cache()
            f = lambda v: "-" if v is None else f"{v:9.1f}"  # noqa: E731
            log(f"{name:<18} T={T:<5} gemmtune {f(row['gemmtune_us'])} tuned {f(row['tuned_us'])} "
                f"grouped_mm {f(row['grouped_mm_us'])} hf_best {f(row['hf_best_us'])} roof {f(row['roof_us'])} "
                f"({time.time() - t0:.0f}s)")  # fmt: skip
    return rows


def summarize_op(rows) -> list[str]:
    head = "| model | T | gemmtune us | tuned us | grouped_mm us | HF best us | roof us | x HF | x grouped_mm |"
    out = [head + " % roof |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tuned_us"]
        f = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        xh = f"{r['hf_best_us'] / t:.2f}" if r["hf_best_us"] else "-"
        xg = f"{r['grouped_mm_us'] / t:.2f}" if r["grouped_mm_us"] else "-"
        pct = 100 * r["roof_us"] / t
        out.append(f"| {r['model']} | {r['T']} | {f(r['gemmtune_us'])} | {f(t)} | {f(r['grouped_mm_us'])} | "
                   f"{f(r['hf_best_us'])} | {f(r['roof_us'])} | {xh} | {xg} | {pct:.0f}% |")  # fmt: skip
    dec = [r for r in rows if r["T"] <= 16]
    big = [r for r in rows if r["T"] >= 1024]
    for label, col in (("tuned", "tuned_us"), ("gemmtune default", "gemmtune_us")):
        out.append("")
        out.append(f"{label}: decode (T <= 16) roof fraction geomean "
                   f"{geomean([r['roof_us'] / r[col] for r in dec if r.get(col)]):.2f}, "
                   f"speedup over HF best geomean {geomean([r['hf_best_us'] / r[col] for r in dec if r.get(col) and r['hf_best_us']]):.2f}")  # fmt: skip  # noqa: E501
        sp = [r["grouped_mm_us"] / r[col] for r in big if r.get(col) and r["grouped_mm_us"]]
        if sp:
            out.append(f"{label}: T >= 1024 over grouped_mm geomean {geomean(sp):.2f}, worst {min(sp):.2f}")
    return out


# ---- e2e ----------------------------------------------------------------------------------------
QWEN3_30B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
             "num_experts": 128, "num_experts_per_tok": 8, "num_attention_heads": 32, "num_key_value_heads": 4,
             "head_dim": 128, "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
             "max_position_embeddings": 40960, "hidden_act": "silu", "attention_bias": False,
             "tie_word_embeddings": False, "norm_topk_prob": True}  # fmt: skip


def build_qwen3(layers: int, device, smoke: bool):
    import transformers as t

    cfg = dict(QWEN3_30B, num_hidden_layers=layers)
    if smoke:
        cfg.update(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, vocab_size=256, intermediate_size=128)  # fmt: skip
    config = t.Qwen3MoeConfig(**cfg)
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():  # spread routing: a router left near zero sends every token to the same experts
        for m in model.modules():
            if type(m).__name__.endswith("TopKRouter"):
                m.weight.normal_(0.0, m.weight.shape[1] ** -0.5)
    return model


def run_e2e(args, device) -> list[dict]:
    import copy

    from bench_e2e_llama import GraphDecode, interleaved, prefill_fn

    import gemmtune

    stock = build_qwen3(args.layers, device, args.smoke)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    log(report.summary())
    vocab = stock.config.vocab_size
    # a replayed graph stays at one cache position; without graphs (CPU smoke) every call advances it
    steps = 4 if device.type == "cuda" else args.iters * (args.e2e_reps + 2) + 4
    rows = []

    def set_impl(model, impl):
        model.config._experts_implementation = impl
        for m in model.modules():
            if getattr(m, "config", None) is not None and hasattr(m, "gate_up_proj"):
                m.config._experts_implementation = impl

    # decode: CUDA graphs (HF's eager loop cannot be captured: its best capturable implementations)
    for b in (1, 8):
        fns = {}
        for impl in ("grouped_mm", "batched_mm"):
            set_impl(stock, impl)  # the graph keeps the kernels of the implementation set at capture
            try:
                fns[f"hf_{impl}"] = GraphDecode(stock, b, args.ctx, device, vocab, steps)
            except Exception as exc:  # noqa: BLE001
                log(f"decode b={b} hf {impl}: {type(exc).__name__}: {str(exc)[:200]}")
        fns["gemmtune"] = GraphDecode(opt, b, args.ctx, device, vocab, steps)
        res = interleaved(fns, args.iters, args.e2e_reps, device)
        hf = min(v[0] for k, v in res.items() if k.startswith("hf_"))
        rows.append({"what": f"decode b={b} ctx={args.ctx} (CUDA graph)", **{f"{k}_ms": v[0] for k, v in res.items()},
                     "speedup_vs_hf_best": hf / res["gemmtune"][0]})  # fmt: skip
        log(rows[-1])
        del fns
        torch.cuda.empty_cache()
    # prefill 2048 tokens, eager (HF's eager loop allowed here), logits of the last token only
    g = torch.Generator(device="cpu").manual_seed(2)
    ids = torch.randint(0, vocab, (1, args.prefill), generator=g).to(device)
    fns = {}
    for impl in ("eager", "grouped_mm"):
        fns[f"hf_{impl}"] = lambda impl=impl: (set_impl(stock, impl), prefill_fn(stock, ids)())
    fns["gemmtune"] = prefill_fn(opt, ids)
    res = interleaved(fns, max(1, args.iters // 4), args.e2e_reps, device)
    hf = min(v[0] for k, v in res.items() if k.startswith("hf_"))
    rows.append({"what": f"prefill {args.prefill} tokens", **{f"{k}_ms": v[0] for k, v in res.items()},
                 "speedup_vs_hf_best": hf / res["gemmtune"][0]})  # fmt: skip
    log(rows[-1])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for moe_op.csv/json, moe_e2e.json and moe.md")
    ap.add_argument("--part", choices=["op", "e2e", "all"], default="all")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--sweep", type=int, default=6, help="Triton config pairs timed per point besides the default")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--e2e-reps", type=int, default=7)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU smoke test of the e2e part)")
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    md = [
        f"# MoE bench ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__})"
    ]
    t0 = time.time()
    if args.part in ("op", "all") and device.type == "cuda":
        from gemmtune.tuner.timing import measure_ceilings

        ceilings = measure_ceilings(device)
        md += ["", f"Ceilings: {ceilings.describe()}", ""]
        rows = run_op(args, device, ceilings)
        with open(out / "moe_op.csv", "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        (out / "moe_op.json").write_text(json.dumps(rows, indent=1))
        md += summarize_op(rows)
        log(f"op part: {time.time() - t0:.0f}s")
    if args.part in ("e2e", "all"):
        rows = run_e2e(args, device)
        (out / "moe_e2e.json").write_text(json.dumps(rows, indent=1))
        md += ["", "End to end (ms per call; speedup over the best stock HF implementation):"]
        for r in rows:
            md.append(f"- {r['what']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "what"))
    text = "\n".join(md)
    (out / "moe.md").write_text(text + "\n")
    print(text)
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
