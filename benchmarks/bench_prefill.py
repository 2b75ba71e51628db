"""Prefill-suite benchmark of the `triton` and `blaslt` backends against cuBLAS (F.linear), issue 4.

Suite: the decoder linears of llama-3-8b (tp 1) and llama-3-70b (tp 8): fused qkv, o, fused gate_up,
down; bf16; M in 32, 64, ..., 8192. Method (docs/benchmarking.md): all timing through
gemmtune.tuner.timing.bench_gemm (CUDA-graph replay over rotating cold input sets > 2x L2, interleaved,
median); ceilings measured in the same run.

Per (shape, M): a screen times every candidate both backends offer (8 repeats, in chunks that fit
memory, on one input draw); the three fastest of each backend that also pass the accuracy check (vs an
fp32 reference, no worse than 2x F.linear's own error + 1e-3), plus cuBLASLt's own heuristic pick, are
re-timed against cuBLAS (twice: the spread is the noise) on a fresh input draw, and that confirm pass
gives the reported figures, so a winner of many noisy draws is not flattered. The first graph of every
timing round is a pad (F.linear, not reported): it alone pays the idle-GPU launch latency. Triton
configs are compiled first, in parallel processes.

    PYTHONPATH=src python benchmarks/bench_prefill.py --out OUT_DIR [--ms 32,256,4096] [--models llama-3-8b:1]

Writes prefill.md / .csv / .json and tuned.csv (the winners as a gemmtune/aiter table) into --out;
then re-loads tuned.csv in a fresh process (--verify) and times its blaslt rows again, to show a
re-created algorithm runs the same kernel at the same speed.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from suites import LAYERS, find_models_dir, suite_shapes

from gemmtune.backends.a16w16.blaslt import BlasLtBackend
from gemmtune.backends.a16w16.triton import TritonGemmBackend, precompile
from gemmtune.backends.lib.blaslt import algo_attrs, lt_version
from gemmtune.keys import GemmKey
from gemmtune.tuner.timing import bench_gemm, make_inputs, measure_ceilings, roof_us

SUITE = [("llama-3-8b", 1), ("llama-3-70b", 8)]
MS = [32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
GRAPH_BYTES = 12 * 2**30  # output memory the screen's simultaneously captured graphs may hold


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _runners(key, dev, tb, lb):
    """name -> runner for every candidate of both backends (a failing make_runner is reported)."""
    out, errors = {}, []
    for be in (tb, lb):
        if not be.is_available(dev):
            continue
        try:
            sols = be.candidates(key, dev)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{be.name} candidates {key.describe()}: {exc}")
            continue
        for sol in sols:
            try:
                out[f"{be.name}:{sol.kernel_name}"] = be.make_runner(sol, key, dev)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{sol.describe()} {key.describe()}: {type(exc).__name__}: {str(exc)[:200]}")
    return out, errors


def bench_point(key, dev, tb, lb, args, seed):
    inputs = make_inputs(key, dev, seed=seed)
    cands, errors = _runners(key, dev, tb, lb)
    # Screen: every candidate, few repeats, in chunks whose graphs' outputs fit GRAPH_BYTES.
    per_graph = len(inputs) * key.M * key.N * 4 * 2
    chunk = int(max(1, min(24, GRAPH_BYTES // per_graph)))
    names = list(cands)
    screen = {}
    for i in range(0, len(names), chunk):
        # The first graph of each round starts on an idle GPU and pays the launch latency: a pad takes it.
        part = {"pad": F.linear, **{n: cands[n] for n in names[i : i + chunk]}}
        t = bench_gemm(key, part, device=dev, reps=args.screen_reps, inputs=inputs)
        screen.update({n: v for n, v in t.items() if n != "pad"})
        torch.cuda.empty_cache()
    # Accuracy of the fastest few of each backend, on the first input set.
    x, w, b = inputs[0]
    ref = x.float() @ w.float().t()
    tol = 2 * _rel_err(F.linear(x, w, b), ref) + 1e-3
    finalists = {"pad": F.linear, "cublas": F.linear, "cublas#2": F.linear}
    lt_first = next((n for n in cands if n.startswith("blaslt:")), None)  # cuBLASLt's heuristic pick
    bad = []
    for in_group in _GROUPS.values():
        ranked = sorted((v, n) for n, v in screen.items() if in_group(n) and math.isfinite(v))
        kept = 0
        for _, n in ranked:
            err = _rel_err(cands[n](x, w, b), ref)
            if err > tol:
                bad.append(f"{n} {key.describe()}: rel err {err:.2e} > {tol:.2e}")
                continue
            finalists[n] = cands[n]
            kept += 1
            if kept == args.finalists:
                break
    if lt_first and lt_first not in finalists:
        finalists[lt_first] = cands[lt_first]  # cuBLASLt's own pick, always confirmed beside the others
    del inputs
    fresh = make_inputs(key, dev, seed=seed + 7919)
    final = bench_gemm(key, finalists, device=dev, reps=args.reps, inputs=fresh)
    del fresh
    torch.cuda.empty_cache()
    best = {}
    for be in ("triton", "blaslt", "triton_plain"):
        in_group = _GROUPS[be] if be != "triton" else (lambda n: n.startswith("triton:"))
        got = [(v, n.split(":", 1)[1]) for n, v in final.items() if in_group(n) and math.isfinite(v)]
        best[be] = min(got) if got else (float("nan"), "")
    n_cand = {be: sum(1 for n in cands if n.startswith(be + ":")) for be in ("triton", "blaslt")}
    top = {
        be: [
            [n.split(":", 1)[1], round(v, 2)]
            for v, n in sorted((v, n) for n, v in screen.items() if n.startswith(be + ":") and math.isfinite(v))[:6]
        ]
        for be in ("triton", "blaslt")
    }
    final["screen_top"] = top
    final["heuristic0"] = final.get(lt_first, float("nan"))
    return final, best, n_cand, errors + bad


# Finalist groups: PDL variants (programmatic dependent launch, M <= 256) and plain Triton configs are
# confirmed separately, so the report can say what the GEMMs gain without PDL too.
_GROUPS = {
    "triton": lambda n: n.startswith("triton:") and "_pdl" in n,
    "triton_plain": lambda n: n.startswith("triton:") and "_pdl" not in n,
    "blaslt": lambda n: n.startswith("blaslt:"),
}


def write_tuned(rows, path, dev):
    """The winners as a gemmtune/aiter table (libtype, stable solidx, splitK, us, kernelName)."""
    from gemmtune.backends import get
    from gemmtune.configs import ConfigTable, TunedRow
    from gemmtune.device import identity

    ident = identity(dev)
    table = ConfigTable()
    for r in rows:
        key = GemmKey(r["M"], r["N"], r["K"])
        lib, kname = r["winner"].split(":", 1)
        sol = get(lib).solution_from_row(0, kname, 0)
        table.add(TunedRow(ident.gfx, ident.cu_num, key, lib, sol.solidx, sol.splitk, r["best_us"], kname))
    table.write(str(path))


def verify(table_path, out_path, reps, limit):
    """Fresh process: re-create each blaslt row of the table and time it beside cuBLAS."""
    from gemmtune.backends import get
    from gemmtune.configs import ConfigTable

    dev = torch.device("cuda")
    table = ConfigTable.load(str(table_path))
    res = []
    rows = [r for r in table.rows if r.libtype == "blaslt"]
    for row in rows[:: max(1, len(rows) // limit)][:limit]:  # spread over the shapes
        be = get("blaslt")
        sol = be.solution_from_row(row.solidx, row.kernel_name, row.splitk)
        if sol is None:
            res.append({"kernel": row.kernel_name, "error": "refused"})
            continue
        run = be.make_runner(sol, row.key, dev)
        t = bench_gemm(row.key, {"cublas": F.linear, "table": run}, device=dev, reps=reps, seed=11)
        res.append(
            {
                "M": row.key.M,
                "N": row.key.N,
                "K": row.key.K,
                "kernel": row.kernel_name,
                "attrs": list(algo_attrs(run.algo_bytes)),
                "us_table": row.us,
                "us_fresh": t["table"],
                "cublas_fresh": t["cublas"],
            }
        )
    pathlib.Path(out_path).write_text(json.dumps(res, indent=1))
    return res


def eager_overhead(dev, tb, lb):
    """Host time per eager call (enqueue, no sync) at a small shape, vs F.linear: dispatch cost."""
    key = GemmKey(32, 4096, 4096)
    x, w, _ = make_inputs(key, dev, sets=1)[0]
    runs = {"F.linear": F.linear}
    for be in (tb, lb):
        if be.is_available(dev):
            sols = be.candidates(key, dev)
            if sols:
                runs[be.name] = be.make_runner(sols[0], key, dev)
    out = {}
    for name, run in runs.items():
        for _ in range(20):
            run(x, w, None)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            run(x, w, None)
        out[name] = (time.perf_counter() - t0) / 200 * 1e6
        torch.cuda.synchronize()
    return out


def render(rows, meta) -> str:
    lines = [f"# Prefill suite: triton and blaslt vs cuBLAS ({meta['device']})", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "device"]
    lines += [
        "",
        "| shape | N x K | M | cuBLAS us | (2nd) | triton us | blaslt us | Lt heur. #0 us | best/cuBLAS | "
        "% roof best | % roof cuBLAS | roof us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} {r['layer']} | {r['N']} x {r['K']} | {r['M']} | {r['cublas_us']:.1f} | "
            f"{r['cublas2_us']:.1f} | {r['triton_us']:.1f} | {r['blaslt_us']:.1f} | "
            f"{r['blaslt_heuristic0_us']:.1f} | "
            f"{r['speedup']:.3f} | {r['pct_roof']:.0f} | {r['cublas_pct_roof']:.0f} | {r['roof_us']:.1f} |"
        )
    lines += ["", "Geomean speedup of the best of {triton, blaslt} over cuBLAS (>1: faster), same run:", ""]
    lines += [
        "| M range | best/cuBLAS | triton/cuBLAS | blaslt/cuBLAS | % roof best | % roof cuBLAS | points |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, lo, hi in (("32 <= M <= 512", 32, 512), ("M >= 1024", 1024, 10**9)):
        sel = [r for r in rows if lo <= r["M"] <= hi]
        if not sel:
            continue
        lines.append(
            f"| {label} | {_geomean([r['speedup'] for r in sel]):.3f} | "
            f"{_geomean([r['cublas_us'] / r['triton_us'] for r in sel]):.3f} | "
            f"{_geomean([r['cublas_us'] / r['blaslt_us'] for r in sel]):.3f} | "
            f"{100 * _geomean([r['pct_roof'] / 100 for r in sel]):.0f} | "
            f"{100 * _geomean([r['cublas_pct_roof'] / 100 for r in sel]):.0f} | {len(sel)} |"
        )
    lines += [
        "",
        "Without the PDL variants (best of plain triton and blaslt; PDL gains need the kernel before the GEMM to "
        "trigger early: benchmarks/bench_skinny.py --producers): "
        + ", ".join(
            f"{label} {_geomean([r['no_pdl_speedup'] for r in rows if lo <= r['M'] <= hi]):.3f}"
            for label, lo, hi in (("32 <= M <= 512", 32, 512), ("M >= 1024", 1024, 10**9))
        ),
    ]
    lost = [r for r in rows if r["speedup"] < 1.0]
    lines += ["", f"cuBLAS still wins (best/cuBLAS < 1) at {len(lost)} of {len(rows)} points:", ""]
    lines += [
        f"- {r['label']} {r['layer']} M={r['M']}: cuBLAS {r['cublas_us']:.1f} us, best "
        f"{r['best_us']:.1f} us ({r['speedup']:.3f})"
        for r in lost
    ] or ["- none"]
    lines += ["", "Winners (kernel names):", ""]
    lines += [
        f"- {r['label']} {r['layer']} M={r['M']}: triton `{r['triton_name']}`, blaslt `{r['blaslt_name']}`"
        for r in rows
    ]
    lines += [
        "",
        "cuBLAS (2nd) is the same F.linear timed again in the same round: the spread is the noise. "
        "'Lt heur. #0' is cuBLASLt's own first heuristic pick run through the blaslt backend.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--models", default=",".join(f"{m}:{tp}" for m, tp in SUITE))
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--screen-reps", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--finalists", type=int, default=3)
    ap.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    ap.add_argument("--max-seconds", type=float, default=1e9, help="stop starting new points after this")
    ap.add_argument("--verify", default=None, help="(internal) re-time the blaslt rows of this table")
    ap.add_argument("--verify-limit", type=int, default=8)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.verify:
        res = verify(args.verify, out / "verify.json", args.reps, args.verify_limit)
        print(json.dumps(res))
        return 0

    t_start = time.time()
    dev = torch.device("cuda")
    tb, lb = TritonGemmBackend(), BlasLtBackend()
    suite = [(m.split(":")[0], int(m.split(":")[1])) for m in args.models.split(",")]
    shapes, sources = suite_shapes(find_models_dir(args.models_dir), suite)
    layers = set(args.layers.split(","))
    shapes = [s for s in shapes if s[1] in layers]
    ms = [int(v) for v in args.ms.split(",")]
    ceil = measure_ceilings(dev)
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "cuBLASLt (blaslt backend)": lt_version() if lb.is_available(dev) else lb.unavailable_reason(dev),
        "ceilings": ceil.describe(),
        "models": ", ".join(sources),
        "method": f"bench_gemm, screen reps {args.screen_reps}, confirm reps {args.reps} on fresh inputs, "
        f"{args.finalists} finalists per backend",
    }
    print(meta, flush=True)

    points = [(label, layer, GemmKey(m, n, k)) for label, layer, n, k in shapes for m in ms]
    t0 = time.time()
    jobs = [(s, key) for _, _, key in points for s in tb.candidates(key, dev)]
    fails = precompile(jobs, dev, workers=args.workers)
    meta["triton precompile"] = f"{len(jobs)} (config, shape) pairs in {time.time() - t0:.0f} s, {len(fails)} failed"
    print(meta["triton precompile"], flush=True)
    for f in fails[:20]:
        print("  compile failure:", f[0], f[1].describe(), f[2][:300], flush=True)

    rows, errors = [], []
    for i, (label, layer, key) in enumerate(points):
        if time.time() - t_start > args.max_seconds:
            print(f"time limit: stopping before {label} {layer} M={key.M}", flush=True)
            break
        tp0 = time.time()
        final, best, n_cand, errs = bench_point(key, dev, tb, lb, args, seed=1000 + i)
        errors += errs
        cub = final["cublas"]
        (t_us, t_name), (l_us, l_name) = best["triton"], best["blaslt"]
        options = [(cub, "cublas"), (t_us, f"triton:{t_name}"), (l_us, f"blaslt:{l_name}")]
        best_us, winner = min((v, n) for v, n in options if math.isfinite(v))
        best_lib_us = min(v for v in (t_us, l_us) if math.isfinite(v))
        roof = roof_us(key, ceil)
        row = {
            "label": label,
            "layer": layer,
            "M": key.M,
            "N": key.N,
            "K": key.K,
            "cublas_us": cub,
            "cublas2_us": final["cublas#2"],
            "triton_us": t_us,
            "blaslt_us": l_us,
            "triton_name": t_name,
            "blaslt_name": l_name,
            "best_us": best_lib_us,
            "speedup": cub / best_lib_us,
            "roof_us": roof,
            "pct_roof": 100 * roof / best_lib_us,
            "cublas_pct_roof": 100 * roof / cub,
            "winner": winner,
            "winner_us": best_us,
            "n_triton": n_cand["triton"],
            "n_blaslt": n_cand["blaslt"],
            "blaslt_heuristic0_us": final["heuristic0"],
            "triton_plain_us": best["triton_plain"][0],
            "no_pdl_speedup": cub / min(v for v in (best["triton_plain"][0], l_us, float("inf")) if math.isfinite(v)),
            "screen_top": final["screen_top"],
        }
        rows.append(row)
        print(
            f"{label:16s} {layer:8s} M={key.M:5d} N={key.N:6d} K={key.K:6d} cuBLAS {cub:8.1f} "
            f"({final['cublas#2']:8.1f}) triton {t_us:8.1f} blaslt {l_us:8.1f} x{row['speedup']:.3f} "
            f"roof {roof:7.1f} [{n_cand['triton']}+{n_cand['blaslt']} cands, {time.time() - tp0:.1f}s]",
            flush=True,
        )

    meta["eager host us/call (M=32 4096x4096, enqueue only)"] = {
        k: round(v, 1) for k, v in eager_overhead(dev, tb, lb).items()
    }
    meta["wall time"] = f"{time.time() - t_start:.0f} s"
    md = render(rows, meta)
    if errors:
        md += "\nErrors and rejected candidates:\n\n" + "\n".join(f"- {e}" for e in errors[:50]) + "\n"
    (out / "prefill.md").write_text(md)
    (out / "prefill.json").write_text(json.dumps({"meta": meta, "rows": rows, "errors": errors}, indent=1, default=str))
    with open(out / "prefill.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["label"])
        wr.writeheader()
        wr.writerows(rows)
    if rows:
        # The libraries' winners as a table (the torch row where cuBLAS won), then a fresh process
        # re-creates the blaslt rows from it and times them again.
        lib_rows = []
        for r in rows:
            cand = [(r["triton_us"], "triton:" + r["triton_name"]), (r["blaslt_us"], "blaslt:" + r["blaslt_name"])]
            us, name = min((v, n) for v, n in cand if math.isfinite(v))
            lib_rows.append({**r, "winner": name, "best_us": us})
        write_tuned(lib_rows, out / "tuned.csv", dev)
        if lb.is_available(dev):
            proc = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--verify",
                    str(out / "tuned.csv"),
                    "--out",
                    str(out),
                    "--reps",
                    str(args.reps),
                ],
                capture_output=True,
                text=True,
                timeout=300,
            )
            md_v = ["", "Table round trip (fresh process re-creates each blaslt row from tuned.csv):", ""]
            if proc.returncode == 0:
                for v in json.loads(proc.stdout.strip().splitlines()[-1]):
                    md_v.append(
                        f"- M={v.get('M')} N={v.get('N')} K={v.get('K')} `{v['kernel']}`: "
                        f"tuned {v.get('us_table', float('nan')):.1f} us, fresh process "
                        f"{v.get('us_fresh', float('nan')):.1f} us (cuBLAS there "
                        f"{v.get('cublas_fresh', float('nan')):.1f}), attrs {v.get('attrs')}"
                    )
            else:
                md_v.append("verify failed: " + proc.stderr[-1500:])
            md += "\n".join(md_v) + "\n"
            (out / "prefill.md").write_text(md)
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
