"""Fused GEMM epilogues vs unfused, and 2:4 sparse vs dense (the epilogue and sparse families).

Part 1, epilogue: the MLP GEMMs of Phi-2 (2560 -> 10240, gelu_new = GELU tanh, bias), Pythia-6.9B (4096 ->
16384, GELU erf, bias) and StarCoder2-15B (6144 -> 24576, gelu_pytorch_tanh, bias), bf16, at M in 1, 4,
16, 64, 256, 1024, 2048, 4096: the up projection as gemm_gelu (GEMM + bias + GELU) and the down
projection as gemm_bias (GEMM + bias). Two baselines per point:
- `unfused` (F.linear then F.gelu: what the model runs, gemmtune's default; cuBLAS(Lt) already adds the
  bias inside its GEMM, so a fused gemm_bias has nothing left to save against it);
- `separate` (torch.mm, then + bias, then the activation, each its own kernel: the "unfused" that
  aiter's "1.5-2x over unfused" compares against).
Fused contenders (`--contenders`): torch's `_addmm_activation` (`addmm_activation`, or
`addmm_activation_tanh` standing in for the erf GELU of Pythia: families/epilogue.py says why and when),
the Triton GEMM with the epilogue fused, and cuBLASLt algorithms with the epilogue set (`blaslt`, needs
nvmath-python); each screened over its candidates, then the fastest few (and the best of each contender)
confirmed. `dispatched` is what a tuned table would run: the fastest confirmed contender, unfused
included, so its ratio to unfused is >= 1 up to noise. Noise: unfused is timed twice in the confirm
pass; the spread is printed. Candidates whose error vs the fp32 reference exceeds twice the unfused
path's (+1e-3) are dropped and listed.

Part 2, sparse: Llama-3-8B's linears (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336)
at M in 512, 1024, 2048, 4096: the weight pruned to 2:4 as a SparseSemiStructuredTensor (cuSPARSELt,
else CUTLASS) vs its dense twin through F.linear. A 2:4 row is dispatched only where it wins beyond
noise; the table written says so.

Method (docs/benchmarking.md): CUDA-graph replay over rotating cold input sets > 2x L2, contenders
interleaved in one process, median of repeats; ceilings (read bandwidth, bf16 matmul) measured in the
same run and % of roof printed. Triton configs are compiled up front in parallel processes.

    PYTHONPATH=src python benchmarks/bench_epilogue.py --out OUT_DIR [--ms 1,64,4096] [--skip-sparse]
        [--contenders torch,triton,blaslt]

Writes epilogue.md / .csv / .json, tuned_epilogue.csv and tuned_sparse.csv (gemmtune tables of the
winners, for GEMMTUNE_CONFIG_EPILOGUE / GEMMTUNE_CONFIG_SPARSE) into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import time

import torch

from gemmtune.backends import get as get_backend
from gemmtune.backends.base import Solution
from gemmtune.configs.schema import TunedRow
from gemmtune.configs.table import ConfigTable
from gemmtune.device import identity
from gemmtune.families import get as get_family
from gemmtune.families.epilogue import EpilogueKey, apply_act
from gemmtune.families.sparse import SparseKey
from gemmtune.tuner.timing import l2_bytes, measure_ceilings, time_graphs

MODELS = [  # (name, hidden, intermediate, act of the up projection)
    ("phi-2", 2560, 10240, "gelu_tanh"),
    ("pythia-6.9b", 4096, 16384, "gelu"),
    ("starcoder2-15b", 6144, 24576, "gelu_tanh"),
]
MS = [1, 4, 16, 64, 256, 1024, 2048, 4096]
SPARSE_SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
SPARSE_MS = [512, 1024, 2048, 4096]
GRAPH_BYTES = 8 * 2**30  # output memory the screen's simultaneously captured graphs may hold
CONTENDERS = ("torch", "triton", "blaslt")


def _geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _sets(fam, key, dev, seed):
    per = fam.set_bytes(key)
    n = min(64, max(2, math.ceil(2 * l2_bytes(dev) / per) + 1))
    return fam.make_inputs(key, dev, n, seed)


def _time(runners: dict, sets, reps: int) -> dict[str, float]:
    """Microseconds per call of each runner over the rotating sets (graph replay, interleaved)."""

    def calls(run):
        def all_sets():
            for s in sets:
                run(*s)

        return all_sets

    ms = time_graphs({"pad": calls(next(iter(runners.values()))), **{n: calls(r) for n, r in runners.items()}},
                     reps=reps, calls_per_graph=len(sets))  # fmt: skip
    return {n: v * 1e3 for n, v in ms.items() if n != "pad"}


def _roof(fam, key, ceil) -> float:
    return fam.roof_us(key, ceil.read_bw, ceil.flops)


# ---- part 1: epilogues --------------------------------------------------------------------------------
def _compile_worker(args):
    names, keys = args
    be = get_backend("triton", "epilogue")
    dev = torch.device("cuda")
    failed = []
    for name, key in zip(names, keys, strict=True):
        try:
            be.make_runner(be.solution_from_row(0, name, 0), key, dev)
        except Exception as exc:  # noqa: BLE001 - reported; the config is dropped
            failed.append(f"{name} {key.describe()}: {type(exc).__name__}: {str(exc)[:160]}")
    torch.cuda.synchronize()
    return failed


def precompile(keys, dev, workers: int) -> list[str]:
    """Compile each distinct Triton kernel once, in parallel processes (fills Triton's disk cache).
    M is a runtime value and these N, K share their specialization, so (config, act, bias) decides."""
    import multiprocessing as mp

    tb = get_backend("triton", "epilogue")
    uniq = {}
    for key in keys:
        for sol in tb.candidates(key, dev):
            uniq.setdefault((sol.kernel_name, key.act, key.bias), (sol.kernel_name, key._replace(M=16)))
    items = list(uniq.values())
    chunks = [items[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        res = pool.map(_compile_worker, [([n for n, _ in c], [k for _, k in c]) for c in chunks if c])
    return [f for r in res for f in r]


def separate(key):
    """The GEMM, the bias and the activation as separate kernels (torch.mm, +, act)."""

    def run(x, w, bias, c, alpha, beta):
        y = torch.mm(x, w.t())
        if bias is not None:
            y = y + bias
        return apply_act(y, key.act)

    return run


def bench_epilogue_key(key, dev, args, seed):
    fam = get_family("epilogue")
    torch_be = get_backend("torch", "epilogue")
    sets = _sets(fam, key, dev, seed)
    ref = fam.reference(key, sets[0])
    unfused = torch_be.make_runner(torch_be.default_solution(key, dev), key, dev)
    floor = _rel_err(unfused(*sets[0]), ref)
    tol = 2 * floor + 1e-3
    cands, errors = {}, []
    baselines = {"unfused": unfused, "unfused#2": unfused, "separate": separate(key)}
    err = _rel_err(baselines["separate"](*sets[0]), ref)
    if err > tol:
        errors.append(f"separate {key.describe()}: rel err {err:.2e} > {tol:.2e}")
    for lib in args.contenders:
        be = get_backend(lib, "epilogue")
        if not be.is_available(dev):
            continue
        for sol in be.candidates(key, dev):
            if lib == "torch" and sol.kernel_name == "native":
                continue
            try:
                run = be.make_runner(sol, key, dev)
                err = _rel_err(run(*sets[0]), ref)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{sol.describe()} {key.describe()}: {type(exc).__name__}: {str(exc)[:160]}")
                continue
            if err > tol:
                errors.append(f"{sol.describe()} {key.describe()}: rel err {err:.2e} > {tol:.2e}")
                continue
            cands[f"{lib}:{sol.kernel_name}"] = run
    # Screen in chunks whose graphs' outputs fit memory; then confirm the fastest few on fresh inputs.
    per_graph = len(sets) * key.M * key.N * 2 * 2
    chunk = int(max(1, min(24, GRAPH_BYTES // per_graph)))
    names, screen = list(cands), {}
    for i in range(0, len(names), chunk):
        screen.update(_time({n: cands[n] for n in names[i : i + chunk]}, sets, args.screen_reps))
        torch.cuda.empty_cache()
    ranked = [n for _, n in sorted((v, n) for n, v in screen.items() if math.isfinite(v))]
    finalists = dict(baselines)
    finalists.update({n: cands[n] for n in ranked[: args.finalists]})
    for lib in args.contenders:  # the best of each contender, so each has its confirmed time
        best = next((n for n in ranked if n.startswith(f"{lib}:")), None)
        if best:
            finalists[best] = cands[best]
    del sets
    fresh = _sets(fam, key, dev, seed + 7919)
    final = _time(finalists, fresh, args.reps)
    del fresh
    torch.cuda.empty_cache()
    return final, errors, len(cands)


def _best_of(final: dict, lib: str) -> tuple[float, str]:
    """(us, name) of the contender's fastest confirmed candidate; (nan, "") when it has none."""
    times = [(v, n) for n, v in final.items() if n.startswith(f"{lib}:") and math.isfinite(v)]
    return min(times) if times else (float("nan"), "")


def part_epilogue(args, dev, ceil, out_rows, table_rows, errors):
    keys = []
    for model, hidden, inter, act in MODELS:
        for m in args.ms:
            keys.append(
                (model, "up (gemm_gelu)", EpilogueKey(m, inter, hidden, True, torch.bfloat16, torch.bfloat16, act))
            )
            keys.append(
                (model, "down (gemm_bias)", EpilogueKey(m, hidden, inter, True, torch.bfloat16, torch.bfloat16))
            )
    for lib in args.contenders:
        be = get_backend(lib, "epilogue")
        if not be.is_available(dev):
            print(f"{lib} not timed: {be.unavailable_reason(dev)}", flush=True)
            errors.append(f"{lib} not timed: {be.unavailable_reason(dev)}")
    if "triton" in args.contenders and get_backend("triton", "epilogue").is_available(dev):
        t0 = time.time()
        errors += precompile([k for _, _, k in keys], dev, args.workers)
        print(f"compiled Triton epilogue kernels in {time.time() - t0:.0f} s", flush=True)
    fam = get_family("epilogue")
    hdr = (f"{'model':15} {'gemm':17} {'M':>5} {'unfused':>9} {'noise':>6} {'separate':>9} {'addmm_act':>9} "
           f"{'triton':>9} {'blaslt':>9} {'disp':>9} {'x':>6} {'x sep':>6} {'%roof':>6}  winner")  # fmt: skip
    print(hdr)
    for model, what, key in keys:
        final, errs, n_cand = bench_epilogue_key(key, dev, args, seed=key.M + key.N)
        errors += errs
        u1, u2, sep = final["unfused"], final["unfused#2"], final["separate"]
        unf = min(u1, u2)
        noise = abs(u1 - u2) / unf
        add, tri, lt = _best_of(final, "torch"), _best_of(final, "triton"), _best_of(final, "blaslt")
        best_v, best_n = min((v, n) for n, v in final.items() if math.isfinite(v) and n != "separate")
        best_n = "unfused" if best_n.startswith("unfused") else best_n
        fused = min((v for v in (add[0], tri[0], lt[0]) if math.isfinite(v)), default=float("nan"))
        roof = _roof(fam, key, ceil)
        row = dict(model=model, gemm=what, M=key.M, N=key.N, K=key.K, act=key.act, unfused_us=round(unf, 2),
                   noise=round(noise, 4), separate_us=round(sep, 2), addmm_act_us=round(add[0], 2),
                   addmm_act=add[1], triton_us=round(tri[0], 2), triton_cfg=tri[1], blaslt_us=round(lt[0], 2),
                   blaslt_cfg=lt[1], dispatched_us=round(best_v, 2), dispatched=best_n,
                   speedup=round(unf / best_v, 4), fused_speedup=round(unf / fused, 4),
                   speedup_vs_separate=round(sep / best_v, 4), fused_speedup_vs_separate=round(sep / fused, 4),
                   roof_us=round(roof, 2), candidates=n_cand)  # fmt: skip
        out_rows.append(row)
        print(f"{model:15} {what:17} {key.M:>5} {unf:9.1f} {noise:6.1%} {sep:9.1f} {add[0]:9.1f} {tri[0]:9.1f} "
              f"{lt[0]:9.1f} {best_v:9.1f} {unf / best_v:6.3f} {sep / best_v:6.3f} {roof / best_v:6.0%}  {best_n}",
              flush=True)  # fmt: skip
        lib, _, kname = best_n.partition(":") if best_n != "unfused" else ("torch", "", "native")
        table_rows.append(("epilogue", key, lib, kname, best_v))


# ---- part 2: 2:4 sparse ---------------------------------------------------------------------------
def part_sparse(args, dev, ceil, out_rows, table_rows, errors):
    from gemmtune.ops.sparse import semi_structured_reason

    why = semi_structured_reason(dev, torch.bfloat16, (4096, 4096))
    if why:
        print(f"2:4 sparse skipped: {why}")
        errors.append(f"2:4 sparse skipped: {why}")
        return
    fam, be = get_family("sparse"), get_backend("torch", "sparse")
    sparse_sol, dense_sol = be.solution_from_row(0, "sparse", 0), be.solution_from_row(0, "dense", 0)
    print(f"\n{'llama-3-8b':10} {'M':>5} {'dense':>9} {'noise':>6} {'2:4':>9} {'x':>6} {'%roof(d)':>8}  dispatched")
    for layer, n, k in SPARSE_SHAPES:
        for m in args.sparse_ms:
            key = SparseKey(m, n, k, "2:4", 0.5, "", False, torch.bfloat16)
            sets = _sets(fam, key, dev, seed=m + n)
            dense_run, sparse_run = be.make_runner(dense_sol, key, dev), be.make_runner(sparse_sol, key, dev)
            ref = fam.reference(key, sets[0])
            err = _rel_err(sparse_run(*sets[0]), ref)
            if err > 2 * _rel_err(dense_run(*sets[0]), ref) + 1e-3:
                errors.append(f"2:4 {key.describe()}: rel err {err:.2e}")
            t = _time({"dense": dense_run, "dense#2": dense_run, "sparse": sparse_run}, sets, args.reps)
            if not math.isfinite(t.get("sparse", float("nan"))):
                errors.append(f"2:4 {key.describe()}: not CUDA-graph capturable; not timed")
                continue
            d = min(t["dense"], t["dense#2"])
            noise = abs(t["dense"] - t["dense#2"]) / d
            x = d / t["sparse"]
            wins = x > 1 + max(noise, 0.01)
            dense_key = EpilogueKey(m, n, k, False)
            roof = get_family("epilogue").roof_us(dense_key, ceil.read_bw, ceil.flops)
            out_rows.append(dict(model="llama-3-8b", gemm=f"{layer} 2:4", M=m, N=n, K=k, dense_us=round(d, 2),
                                 noise=round(noise, 4), sparse_us=round(t["sparse"], 2), speedup=round(x, 4),
                                 dispatched="2:4" if wins else "dense", roof_us=round(roof, 2)))  # fmt: skip
            print(f"{layer:10} {m:>5} {d:9.1f} {noise:6.1%} {t['sparse']:9.1f} {x:6.3f} {roof / d:8.0%}  "
                  f"{'2:4' if wins else 'dense'}", flush=True)  # fmt: skip
            table_rows.append(("sparse", key, "torch", "sparse" if wins else "dense", t["sparse"] if wins else d))
            del sets
            torch.cuda.empty_cache()


def write_tables(out: pathlib.Path, table_rows, dev) -> None:
    ident = identity(dev)
    for fam_name in ("epilogue", "sparse"):
        fam = get_family(fam_name)
        table = ConfigTable(family=fam)
        for f, key, lib, kname, us in table_rows:
            if f != fam_name:
                continue
            be = get_backend(lib, fam_name)
            sol = be.solution_from_row(0, kname, 0) or Solution(lib, kname, 0, 0)
            tflops, bw = fam.throughput(key, us)
            table.add(TunedRow(ident.gfx, ident.cu_num, key, lib, sol.solidx, sol.splitk, us, kname, 0.0, tflops, bw,
                               family=fam))  # fmt: skip
        if len(table):
            table.write(str(out / f"tuned_{fam_name}.csv"))


def summary(rows) -> list[str]:
    """Geomean speedups per op and M range: of what a table dispatches and of the best fused contender,
    against F.linear + act (`unfused`) and against mm, + bias, act as separate kernels (`separate`);
    then, at M >= 1024, each fused contender alone against both."""
    lines = []
    epi = [r for r in rows if "unfused_us" in r]
    for what in ("up (gemm_gelu)", "down (gemm_bias)"):
        for lo, hi, label in (
            (1, 16, "M<=16"),
            (17, 512, "16<M<=512"),
            (513, 10**9, "M>512"),
            (1024, 10**9, "M>=1024"),
        ):
            sel = [r for r in epi if r["gemm"] == what and lo <= r["M"] <= hi]
            if sel:
                g = {k: _geomean([r[k] for r in sel]) for k in ("speedup", "fused_speedup", "speedup_vs_separate",
                                                               "fused_speedup_vs_separate")}  # fmt: skip
                lines.append(f"{what:17} {label:10} vs F.linear+act: dispatched x{g['speedup']:.3f}  "
                             f"best fused x{g['fused_speedup']:.3f}  worst dispatched "
                             f"x{min(r['speedup'] for r in sel):.3f} | vs mm,+bias,act separate: dispatched "
                             f"x{g['speedup_vs_separate']:.3f}  best fused x{g['fused_speedup_vs_separate']:.3f}  "
                             f"(n={len(sel)})")  # fmt: skip
        big = [r for r in epi if r["gemm"] == what and r["M"] >= 1024]
        for lib, col in (("addmm_act", "addmm_act_us"), ("triton", "triton_us"), ("blaslt", "blaslt_us")):
            have = [r for r in big if math.isfinite(r[col])]
            if have:
                vs_unf = _geomean([r["unfused_us"] / r[col] for r in have])
                vs_sep = _geomean([r["separate_us"] / r[col] for r in have])
                lines.append(f"{what:17} M>=1024    {lib:9} alone: x{vs_unf:.3f} vs F.linear+act, x{vs_sep:.3f} "
                             f"vs separate (n={len(have)})")  # fmt: skip
    sp = [r for r in rows if "sparse_us" in r]
    if sp:
        wins = [r for r in sp if r["dispatched"] == "2:4"]
        where = ", ".join(f"{r['gemm']} M={r['M']} x{r['speedup']:.2f}" for r in wins)
        lines.append(f"2:4 vs dense: geomean x{_geomean([r['speedup'] for r in sp]):.3f}, wins beyond noise at "
                     f"{len(wins)}/{len(sp)}: {where}")  # fmt: skip
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--sparse-ms", default=",".join(map(str, SPARSE_MS)))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--screen-reps", type=int, default=4)
    ap.add_argument("--finalists", type=int, default=3)
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--skip-sparse", action="store_true")
    ap.add_argument("--skip-epilogue", action="store_true")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="fused backends to time (torch,triton,blaslt)")
    args = ap.parse_args()
    args.contenders = [v.strip() for v in args.contenders.split(",") if v.strip()]
    if bad := [v for v in args.contenders if v not in CONTENDERS]:
        ap.error(f"--contenders: unknown {', '.join(bad)} (expected some of {', '.join(CONTENDERS)})")
    args.ms = [int(v) for v in args.ms.split(",") if v]
    args.sparse_ms = [int(v) for v in args.sparse_ms.split(",") if v]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    t0 = time.time()
    ceil = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; ceilings: {ceil.describe()}", flush=True)
    rows, table_rows, errors = [], [], []
    if not args.skip_epilogue:
        part_epilogue(args, dev, ceil, rows, table_rows, errors)
    if not args.skip_sparse:
        part_sparse(args, dev, ceil, rows, table_rows, errors)
    write_tables(out, table_rows, dev)
    lines = summary(rows)
    print("\n" + "\n".join(lines))
    if errors:
        print(f"\n{len(errors)} problem(s):\n  " + "\n  ".join(errors[:30]))
    (out / "epilogue.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(dev), ceilings=ceil.describe(),
                                                       rows=rows, summary=lines, errors=errors), indent=1))  # fmt: skip
    fields = sorted({k for r in rows for k in r})
    with open(out / "epilogue.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    md = ["| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    md += ["| " + " | ".join(str(r.get(k, "")) for k in fields) + " |" for r in rows]
    (out / "epilogue.md").write_text("\n".join(md + [""] + lines) + "\n")
    print(f"\nwrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
