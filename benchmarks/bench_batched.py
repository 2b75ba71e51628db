"""Batched-GEMM kernel study: torch.bmm against the batched family's triton and blaslt backends.

Shapes (bf16, b stored (B, N, K) as aiter's and SGLang's batched weights are: transB):
- aiter's untuned batched table (tests/data/aiter-configs/bf16_untuned_batched_gemm.csv, built in
  below so the script needs no data files): B=16, (N, K) in (1280, 8192), (8192, 1024), M 1..16384;
- DeepSeek-V3 MLA's absorbed per-head GEMMs (gemmtune.tuner.model_shapes.batched_gemms) at tp 1 (128 heads)
  and tp 8 (16 heads), tokens 1, 4, 16, 64, 256, 1024, 4096.

Method (docs/benchmarking.md) through gemmtune.tuner.timing.time_graphs: CUDA-graph replay over
rotating input sets (> 2x L2), contenders interleaved in one process, median of repeats, ceilings
measured in the same run (measure_ceilings), roof from families.get("batched").roof_us. Per shape:
every candidate is checked against the fp32 reference (NaN or error over the family's threshold:
dropped and reported), then all of them are screened together with torch.bmm (timed twice: the
spread is the noise); the best of each backend is re-timed against torch.bmm on fresh inputs, and
that confirm pass gives the reported figures. Triton kernels are compiled first in parallel processes.

    PYTHONPATH=src python benchmarks/bench_batched.py --out OUT_DIR

Writes batched.md / .csv / .json into --out (default $OUT, else ./out) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import sys
import time

import torch

from gemmtune import backends, families
from gemmtune.families.batched import BatchedKey
from gemmtune.tuner.model_shapes import PRESETS, batched_gemms
from gemmtune.tuner.timing import l2_bytes, measure_ceilings, time_graphs

AITER_NK = ((1280, 8192), (8192, 1024))
AITER_MS = (1, 32, 64, 128, 192, 256, 320, 512, 1024, 2048, 4096, 8192, 16384)
MLA_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
MAX_SETS = 256
BACKENDS = ("triton", "blaslt")
M_RANGES = (("M<=16", lambda m: m <= 16), ("16<M<=512", lambda m: 16 < m <= 512), ("M>512", lambda m: m > 512))


def aiter_shapes(csv_path: str | None) -> list[tuple[str, int, int, int, tuple[int, ...]]]:
    """(label, B, N, K, Ms) of aiter's table: read from `csv_path` if given, else the built-in copy."""
    if not csv_path:
        return [(f"aiter N{n} K{k}", 16, n, k, AITER_MS) for n, k in AITER_NK]
    groups: dict[tuple[int, int, int], list[int]] = {}
    with open(csv_path, encoding="utf-8-sig") as fh:
        for row in csv.DictReader(fh, skipinitialspace=True):
            groups.setdefault((int(row["B"]), int(row["N"]), int(row["K"])), []).append(int(row["M"]))
    return [(f"aiter N{n} K{k}", b, n, k, tuple(sorted(ms))) for (b, n, k), ms in groups.items()]


def plan(args) -> list[tuple[str, BatchedKey]]:
    """(label, key) in run order: MLA first, then aiter's shapes by growing M (the budget cuts the end)."""
    dtype = torch.bfloat16
    out = []
    for tp in (8, 1):
        for s in batched_gemms(PRESETS["deepseek-v3"], tp):
            out += [(f"dsv3 tp{tp} {s.name}", BatchedKey(s.B, m, s.N, s.K, dtype, dtype, False, s.transB))
                    for m in MLA_TOKENS]  # fmt: skip
    aiter = [(lbl, BatchedKey(b, m, n, k, dtype, dtype, False, True))
             for lbl, b, n, k, ms in aiter_shapes(args.aiter_csv) for m in ms]  # fmt: skip
    out += sorted(aiter, key=lambda lk: (lk[1].M, lk[0]))
    free = torch.cuda.mem_get_info()[0]
    fam = families.get("batched")
    fits = [(lbl, k) for lbl, k in out if 6 * fam.bytes(k) < free]  # inputs, outputs, fp32 reference
    for lbl, k in out:
        if (lbl, k) not in fits:
            print(f"does not fit this GPU, skipped: {lbl} {k.describe()}")
    return fits


def n_sets(key: BatchedKey, dev) -> int:
    fam = families.get("batched")
    return min(MAX_SETS, max(2, math.ceil(2 * l2_bytes(dev) / fam.set_bytes(key)) + 1))


def precompile_triton(keys: list[BatchedKey], dev, workers: int) -> None:
    from gemmtune.backends.batched.triton import precompile

    be = backends.get("triton", "batched")
    jobs = [(s, k) for k in keys for s in be.candidates(k, dev)]
    t0 = time.time()
    failed = precompile(jobs, dev, workers=workers)
    print(f"precompile: {len(jobs)} (config, shape) pairs in {time.time() - t0:.0f} s, {len(failed)} failures")
    for name, key, why in failed[:10]:
        print(f"  compile failed: {name} {key.describe()}: {why[:200]}")


def checked_runners(key: BatchedKey, dev, inputs, max_per_backend: int):
    """{libtype: {kernel name: runner}} of the candidates that pass the family's check, and failures."""
    fam = families.get("batched")
    ref = fam.reference(key, inputs)
    out, bad = {}, {}
    for lt in BACKENDS:
        be = backends.get(lt, "batched")
        if be is None or not be.is_available(dev):
            continue
        good = {}
        for sol in be.candidates(key, dev)[:max_per_backend]:
            try:
                run = be.make_runner(sol, key, dev)
                y = run(*inputs)
                err = ((y.float() - ref).norm() / ref.norm()).item()
            except Exception as exc:  # noqa: BLE001 - reported, the candidate is dropped
                bad[f"{lt}:{sol.kernel_name}"] = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            if not err < fam.error_threshold(key):
                bad[f"{lt}:{sol.kernel_name}"] = f"rel err {err:.2e}"
            else:
                good[sol.kernel_name] = run
        out[lt] = good
    del ref
    return out, bad


def time_us(runners: dict, sets, reps: int, chunk: int) -> dict[str, float]:
    """Microseconds per call of each runner over all `sets`, interleaved; `chunk` runners per round
    (each captured graph keeps its outputs alive), torch.bmm ('bmm') in every round."""
    names = [n for n in runners if n != "bmm"]
    out: dict[str, float] = {}
    for i in range(0, max(len(names), 1), chunk):
        part = ["bmm", *names[i : i + chunk]]

        def calls_of(run):
            def all_sets():
                for inp in sets:
                    run(*inp)

            return all_sets

        ms = time_graphs({n: calls_of(runners[n]) for n in part}, reps=reps, calls_per_graph=len(sets))
        for n in part:
            out.setdefault(n, ms[n] * 1e3)
    return out


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def bench_key(label: str, key: BatchedKey, idx: int, dev, ceil, args) -> dict | None:
    fam = families.get("batched")
    bmm = backends.get("torch", "batched")
    sets = fam.make_inputs(key, dev, n_sets(key, dev), seed=idx)
    runners, bad = checked_runners(key, dev, sets[0], args.max_per_backend)
    for name, why in bad.items():
        print(f"  FAILED {name} on {key.describe()}: {why}")
    bmm_run = bmm.make_runner(bmm.default_solution(key, dev), key, dev)
    out_bytes = key.B * key.M * key.N * key.outdtype.itemsize * len(sets)
    chunk = max(1, min(64, int(0.3 * torch.cuda.mem_get_info()[0] / (3 * out_bytes))))
    flat = {"bmm": bmm_run, "bmm_again": bmm_run}
    flat.update({f"{lt}:{n}": r for lt, rs in runners.items() for n, r in rs.items()})
    screen = time_us(flat, sets, args.screen_reps, chunk)
    best = {}
    for lt, rs in runners.items():
        t = {n: screen[f"{lt}:{n}"] for n in rs if math.isfinite(screen.get(f"{lt}:{n}", math.nan))}
        if t:
            best[lt] = min(t, key=t.get)
    del sets
    fresh = fam.make_inputs(key, dev, n_sets(key, dev), seed=100_000 + idx)
    conf = time_us({"bmm": bmm_run, **{lt: runners[lt][n] for lt, n in best.items()}}, fresh, args.reps, 8)
    del fresh
    roof = fam.roof_us(key, ceil.read_bw, ceil.flops)
    row = {
        "shape": label, "B": key.B, "M": key.M, "N": key.N, "K": key.K, "roof_us": roof,
        "bmm_us": conf["bmm"], "bmm_roof_pct": 100 * roof / conf["bmm"],
        "noise_pct": 100 * abs(screen["bmm"] - screen["bmm_again"]) / screen["bmm"],
        "failed": len(bad),
    }  # fmt: skip
    for lt in BACKENDS:
        us = conf.get(lt, math.nan)
        row[f"{lt}_us"] = us
        row[f"{lt}_best"] = best.get(lt, "")
        row[f"{lt}_speedup"] = conf["bmm"] / us if us == us else math.nan
        row[f"{lt}_roof_pct"] = 100 * roof / us if us == us else math.nan
        row[f"{lt}_candidates"] = len(runners.get(lt, {}))
    best_us = min([conf["bmm"]] + [conf[lt] for lt in best if math.isfinite(conf[lt])])
    row["best_us"], row["best_speedup"], row["best_roof_pct"] = best_us, conf["bmm"] / best_us, 100 * roof / best_us
    row["screen"] = {n: round(t, 3) for n, t in sorted(screen.items(), key=lambda kv: kv[1])[:12]}
    return row


def eager_overhead(dev) -> dict[str, float]:
    """Eager wall time per call (CPU launch included) on MLA tp8's smallest GEMM: rule 4."""
    import gemmtune

    key = BatchedKey(16, 1, 128, 512)
    a, b = families.get("batched").make_inputs(key, dev, 1, 7)[0]
    calls = {"torch.bmm": torch.bmm, "gemmtune.batched_gemm (default)": lambda a, b: gemmtune.batched_gemm(
        a, b.transpose(1, 2), transpose_b=True)}  # fmt: skip
    for lt in BACKENDS:
        be = backends.get(lt, "batched")
        if be is not None and be.is_available(dev):
            sols = be.candidates(key, dev)
            if sols:
                calls[f"{lt} runner"] = be.make_runner(sols[0], key, dev)
    out = {}
    for name, run in calls.items():
        run(a, b)
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(200):
                run(a, b)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / 200 * 1e6)
        out[name] = sorted(samples)[len(samples) // 2]
    return out


def summary_lines(rows) -> list[str]:
    lines = []
    for rname, sel_fn in M_RANGES:
        sel = [r for r in rows if sel_fn(r["M"])]
        if not sel:
            continue
        parts = [f"torch.bmm {geomean([r['bmm_roof_pct'] for r in sel]):.1f}% of roof"]
        for lt in (*BACKENDS, "best"):
            vals = [r for r in sel if math.isfinite(r[f"{lt}_us"])]
            if vals:
                speedup = geomean([r[f"{lt}_speedup"] for r in vals])
                roof = geomean([r[f"{lt}_roof_pct"] for r in vals])
                parts.append(f"{lt} x{speedup:.3f} ({roof:.1f}% of roof, {len(vals)} shapes)")
        lines.append(f"- {rname} ({len(sel)} shapes): " + "; ".join(parts))
    return lines


def write_outputs(out: pathlib.Path, rows, ceil, eager, elapsed, skipped) -> None:
    lines = [
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; ceilings: {ceil.describe()}; "
        f"run took {elapsed:.0f} s; bf16, b stored (B, N, K)",
        "",
        "| shape | B | M | N | K | bmm us | triton us | x | triton best | blaslt us | x | blaslt best | roof us | "
        "bmm % roof | triton % roof | blaslt % roof | noise % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['B']} | {r['M']} | {r['N']} | {r['K']} | {r['bmm_us']:.2f} | {r['triton_us']:.2f} "
            f"| {r['triton_speedup']:.2f} | {r['triton_best'][4:]} | {r['blaslt_us']:.2f} | {r['blaslt_speedup']:.2f} "
            f"| {r['blaslt_best']} | {r['roof_us']:.2f} | {r['bmm_roof_pct']:.1f} | {r['triton_roof_pct']:.1f} "
            f"| {r['blaslt_roof_pct']:.1f} | {r['noise_pct']:.1f} |"
        )
    lines += ["", "Geomean speedup over torch.bmm (confirm pass) and % of roof, per M range "
              "('best': the fastest of bmm and each backend's best, what a tuned table would run):"]  # fmt: skip
    lines += summary_lines(rows)
    for shape in sorted({r["shape"] for r in rows}):
        sel = [r for r in rows if r["shape"] == shape]
        lines.append(f"- {shape}: best x{geomean([r['best_speedup'] for r in sel]):.3f} over {len(sel)} Ms")
    loses = [r for r in rows if r["triton_speedup"] < 1]
    lines.append(f"- triton slower than bmm in {len(loses)}/{len(rows)} shapes")
    if skipped:
        lines.append(f"- skipped (time budget): {', '.join(skipped)}")
    if eager:
        lines.append("\nEager wall time per call, B=16 M=1 N=128 K=512 (GPU time plus CPU launch): "
                     + ", ".join(f"{k} {v:.1f} us" for k, v in eager.items()))  # fmt: skip
    text = "\n".join(lines) + "\n"
    (out / "batched.md").write_text(text)
    (out / "batched.json").write_text(json.dumps({"rows": rows, "ceilings": ceil.__dict__, "eager_us": eager,
                                                  "skipped": skipped}, indent=1))  # fmt: skip
    with open(out / "batched.csv", "w", newline="") as fh:
        cols = [c for c in rows[0] if c != "screen"] if rows else []
        wr = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)
    print(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--aiter-csv", default=None, help="aiter's bf16_untuned_batched_gemm.csv (default: built-in)")
    ap.add_argument("--reps", type=int, default=20, help="confirm-pass repeats")
    ap.add_argument("--screen-reps", type=int, default=5)
    ap.add_argument("--max-per-backend", type=int, default=40, help="candidates screened per backend, in its order")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--budget-s", type=float, default=330, help="skip the remaining shapes after this long")
    args = ap.parse_args()
    t_start = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    avail = {lt: (b.is_available(dev) if (b := backends.get(lt, "batched")) else False) for lt in BACKENDS}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; backends available: {avail}")
    for mod, why in backends.import_errors().items():
        print(f"  backend module {mod}: {why}")
    todo = plan(args)
    if avail["triton"]:
        precompile_triton([k for _, k in todo], dev, args.workers)
    ceil = measure_ceilings(dev)
    print(f"ceilings: {ceil.describe()}")
    rows, skipped = [], []
    for idx, (label, key) in enumerate(todo):
        if time.time() - t_start > args.budget_s:
            skipped.append(f"{label} M={key.M}")
            continue
        t0 = time.time()
        row = bench_key(label, key, idx, dev, ceil, args)
        torch.cuda.empty_cache()
        rows.append(row)
        print(f"{label:>26} B={key.B:<3} M={key.M:<5} N={key.N:<4} K={key.K:<4} bmm {row['bmm_us']:8.2f}  "
              f"triton {row['triton_us']:8.2f} x{row['triton_speedup']:.2f}  blaslt {row['blaslt_us']:8.2f} "
              f"x{row['blaslt_speedup']:.2f}  roof {row['best_roof_pct']:5.1f}%  {row['triton_best'][4:]}  "
              f"({time.time() - t0:.1f} s)", flush=True)  # fmt: skip
    eager = eager_overhead(dev)
    write_outputs(out, rows, ceil, eager, time.time() - t_start, skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main())
