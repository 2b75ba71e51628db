"""Decode-suite benchmark of the skinny (small-M Triton) backend against cuBLAS (F.linear), issue 3.

Suite: every decoder linear of llama-3-8b (tp 1), llama-3-70b (tp 8) and qwen3-32b (tp 4), fused
qkv and gate_up, o and down sharded along K, bf16, M in 1, 2, 4, 8, 16. Method (docs/benchmarking.md):
all timing through gemmtune.tuner.timing.bench_gemm (CUDA-graph replay over rotating cold weight
sets, interleaved, median); ceilings measured in the same run.

For each (shape, M): a screen times cuBLAS (twice: the spread is the noise) and every candidate
the backend offers; the fastest candidate is then re-timed against cuBLAS and the backend's
default (untuned) choice on fresh inputs, and that confirm pass gives the reported figures (so
the winner of many noisy draws is not flattered). A reduction study times the best split-K config
with its three reductions (one-launch fix-up, partials + reduce kernel, fp32 atomics + memset/cast).

    PYTHONPATH=src python benchmarks/bench_skinny.py --out OUT_DIR

Writes skinny_decode.md / .csv / .json into --out (default $OUT, else ./out) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from suites import LAYERS, find_models_dir, suite_shapes

from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend
from gemmtune.kernels import skinny as ks
from gemmtune.kernels._common import gdc_launch_dependents, gdc_wait, pdl_enabled
from gemmtune.keys import GemmKey
from gemmtune.tuner.timing import bench_gemm, measure_ceilings, roof_us

SUITE = [("llama-3-8b", 1), ("llama-3-70b", 8), ("qwen3-32b", 4)]
BIG_WEIGHT = 32 * 2**20  # the ">= 32 MB" weights must reach 85% of the read roof


@triton.jit
def _producer_kernel(src, dst, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Writes x, like the norm / activation kernel before a decode GEMM (with PDL: triggers early)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def with_producer(run, kind: str):
    """run(x, w, b) behind a kernel that writes x first: 'torch' (an elementwise torch kernel, which
    never triggers its dependents early) or 'pdl' (a Triton kernel that does)."""
    bufs = {}

    def go(x, w, b):
        buf = bufs.get(x.shape)
        if buf is None:
            buf = bufs[x.shape] = torch.empty_like(x)
        if kind == "torch":
            torch.mul(x, 1.0, out=buf)
        else:
            n = x.numel()
            _producer_kernel[(triton.cdiv(n, 1024),)](x, buf, n, BLOCK=1024, PDL=True, launch_pdl=True, num_warps=4)
        return run(buf, w, b)

    return go


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * scale).to(dtype)


def _variant_runner(cfg: ks.SkinnyConfig, key: GemmKey):
    """A runner for any config, the measurement-only ATOMIC reduction included (not via the backend)."""
    counters = ks.new_counters(cfg, key.N, key.M, "cuda")

    def run(x, w, b):
        y = torch.empty((x.shape[0], key.N), dtype=key.outdtype, device=x.device)
        return ks.launch(cfg, x, w, b, y, counters)

    return run


def _precompile_worker(items):
    """Run each (key, kernel names) once so its kernels land in Triton's on-disk cache."""
    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    errors = []
    for key_t, names in items:
        key = GemmKey(*key_t[:3], dtype=torch.bfloat16, outdtype=torch.bfloat16)
        x = _randn((key.M, key.K), key.dtype, gen)
        w = _randn((key.N, key.K), key.dtype, gen)
        for name in names:
            try:
                cfg = ks.SkinnyConfig.parse(name)
                _variant_runner(cfg, key)(x, w, None)
            except Exception as exc:  # noqa: BLE001 - reported by the main process
                errors.append(f"{name} {key.describe()}: {type(exc).__name__}: {str(exc)[:300]}")
    torch.cuda.synchronize()
    return errors


def precompile(work: list[tuple[GemmKey, list[str]]], workers: int) -> list[str]:
    """Compile every distinct kernel specialization in parallel processes (Triton caches on disk)."""
    seen, jobs = set(), []
    for key, names in work:
        for name in names:
            cfg = ks.SkinnyConfig.parse(name)
            sig = (
                cfg.kind,
                cfg.block_n,
                cfg.block_k,
                cfg.num_warps,
                cfg.num_stages,
                cfg.reduce,
                cfg.block_m(key.M),
                cfg.pdl,
            )
            if sig not in seen:
                seen.add(sig)
                jobs.append(((key.M, key.N, key.K), [name]))
    if not jobs or workers <= 1:
        return _precompile_worker(jobs) if jobs else []
    chunks = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [e for errs in pool.map(_precompile_worker, chunks) for e in errs]


def check_inputs(key: GemmKey, gen):
    x = _randn((key.M, key.K), key.dtype, gen)
    w = _randn((key.N, key.K), key.dtype, gen, 1 / math.sqrt(key.K))
    return x, w, x.double() @ w.double().t()


def check_runner(run, key: GemmKey, inputs) -> float:
    """Relative error vs an fp64 reference on one random input; inf if NaN/shape wrong."""
    x, w, ref = inputs
    y = run(x, w, None)
    if y.shape != (key.M, key.N) or torch.isnan(y).any():
        return float("inf")
    return ((y.double() - ref).norm() / ref.norm()).item()


def eager_overhead(be: SkinnyBackend, dev) -> dict[str, float]:
    """Eager wall time per call (CPU launch path included), M=1 4096x4096: rule 4 of docs/benchmarking.md."""
    key = GemmKey(1, 4096, 4096)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, w, _ = check_inputs(key, gen)
    calls = {"F.linear": F.linear, "skinny default": be.make_runner(be.default_solution(key, dev), key, dev)}
    out = {}
    for name, run in calls.items():
        run(x, w, None)
        samples = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(300):
                run(x, w, None)
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) / 300 * 1e6)
        out[name] = sorted(samples)[len(samples) // 2]
    return out


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--models", default=None, help="folder with llama-3-8b.json etc. (default: tests/data/models)")
    ap.add_argument("--ms", default="1,2,4,8,16")
    ap.add_argument("--extra-ms", default="32", help="also measured, reported apart from the suite geomean")
    ap.add_argument("--lm-head", action="store_true", help="also time lm_head (extra rows, M=1,16)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    ap.add_argument("--budget-s", type=float, default=210, help="skip extras once this much time has passed")
    ap.add_argument(
        "--producers",
        action="store_true",
        help="also time cuBLAS, the best and the best non-PDL config behind a kernel that writes x",
    )
    args = ap.parse_args()
    t_start = time.time()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    be = SkinnyBackend()
    ms = [int(v) for v in args.ms.split(",") if v]
    extra_ms = [int(v) for v in args.extra_ms.split(",") if v]
    models_dir = find_models_dir(args.models)
    shapes, sources = suite_shapes(models_dir, SUITE)
    extra_shapes = suite_shapes(models_dir, SUITE, (*LAYERS, "lm_head"))[0] if args.lm_head else []
    extra_shapes = [s for s in extra_shapes if s[1] == "lm_head"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {ks.triton.__version__}")
    print(f"models: {'; '.join(sources)}")

    plan = [(s, m, True) for s in shapes for m in ms]
    plan += [(s, m, False) for s in shapes for m in extra_ms] + [(s, m, False) for s in extra_shapes for m in (1, 16)]
    work = []
    for (_, _, n, k), m, _ in plan:
        key = GemmKey(m, n, k)
        names = [s.kernel_name for s in be.candidates(key, dev)]
        if m in (1, 16):  # the reduction study's variants
            names += [n_.replace("_fx", suf) for n_ in names if n_.endswith("_fx") for suf in ("_rk", "_at")]
        work.append((key, names))
    t0 = time.time()
    errors = precompile(work, args.workers)
    print(f"precompile: {time.time() - t0:.0f} s, {len(errors)} errors")
    for e in errors[:20]:
        print("  compile error:", e)

    ceil = measure_ceilings(dev)
    print(f"ceilings: {ceil.describe()}")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    rows, reductions = [], []
    for idx, ((label, layer, n, k), m, in_suite) in enumerate(plan):
        if not in_suite and time.time() - t_start > args.budget_s:
            print(f"budget reached: skipping extra {label} {layer} M={m}")
            continue
        key = GemmKey(m, n, k)
        sols = be.candidates(key, dev)
        runners, bad = {}, {}
        inputs = check_inputs(key, gen)
        for sol in sols:
            try:
                run = be.make_runner(sol, key, dev)
                err = check_runner(run, key, inputs)
            except Exception as exc:  # noqa: BLE001
                bad[sol.kernel_name] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            if err < 1e-2:
                runners[sol.kernel_name] = run
            else:
                bad[sol.kernel_name] = f"rel err {err:.2e}"
        del inputs
        for name, why in bad.items():
            print(f"  FAILED {name} on {key.describe()}: {why}")
        screen = bench_gemm(key, {"cublas": F.linear, "cublas_again": F.linear, **runners}, dev, args.reps, seed=idx)
        sk_times = {nm: t for nm, t in screen.items() if nm.startswith("skinny") and math.isfinite(t)}
        if not sk_times:
            print(f"  no skinny candidate ran on {key.describe()}")
            continue
        best = min(sk_times, key=sk_times.get)
        dsol = be.default_solution(key, dev)
        plain = [nm for nm in sk_times if "_pdl" not in nm]
        best_plain = min(plain, key=sk_times.get) if plain else best
        # "read": one torch.sum over the same weight, the cost of a plain kernel that only streams it
        confirm_runners = {
            "cublas": F.linear,
            "best": runners[best],
            "plain": runners[best_plain],
            "read": lambda x, w, b: w.sum(),
        }
        if dsol is not None:
            confirm_runners["default"] = runners.get(dsol.kernel_name) or be.make_runner(dsol, key, dev)
        conf = bench_gemm(key, confirm_runners, dev, args.reps, seed=10_000 + idx)
        prod = {}
        for kind in ("torch", "pdl") if args.producers else ():
            if kind == "pdl" and not pdl_enabled(dev):
                continue
            prod[kind] = bench_gemm(
                key,
                {
                    nm: with_producer(r, kind)
                    for nm, r in (("cublas", F.linear), ("best", runners[best]), ("plain", runners[best_plain]))
                },
                dev,
                args.reps,
                seed=30_000 + idx,
            )
        roof = roof_us(key, ceil)
        row = {
            "model": label,
            "layer": layer,
            "N": n,
            "K": k,
            "M": m,
            "suite": in_suite,
            "weight_MB": n * k * 2 / 2**20,
            "cublas_us": conf["cublas"],
            "skinny_us": conf["best"],
            "speedup": conf["cublas"] / conf["best"],
            "roof_us": roof,
            "skinny_roof_pct": 100 * roof / conf["best"],
            "cublas_roof_pct": 100 * roof / conf["cublas"],
            "best": best,
            "default": dsol.kernel_name if dsol else "",
            "plain_best": best_plain,
            "plain_us": conf["plain"],
            "read_us": conf["read"],
            "prod": {kd: {nm: round(t, 3) for nm, t in v.items()} for kd, v in prod.items()},
            "default_us": conf.get("default", float("nan")),
            "screen_cublas_us": screen["cublas"],
            "noise_pct": 100 * abs(screen["cublas"] - screen["cublas_again"]) / screen["cublas"],
            "candidates": len(runners),
            "failed": len(bad),
            "screen": {nm: round(t, 3) for nm, t in sorted(sk_times.items(), key=lambda kv: kv[1])},
        }
        rows.append(row)
        print(
            f"{label:>15} {layer:>8} N={n:<6} K={k:<6} M={m:<3} cublas {row['cublas_us']:7.2f}  "
            f"skinny {row['skinny_us']:7.2f}  x{row['speedup']:.2f}  roof {row['skinny_roof_pct']:5.1f}%  "
            f"{best[7:]}  (default x{conf['cublas'] / row['default_us']:.2f})",
            flush=True,
        )
        best_fx = min((nm for nm in sk_times if nm.endswith("_fx")), key=sk_times.get, default=None)
        cfg = ks.SkinnyConfig.parse(best_fx) if best_fx else None
        if in_suite and m in (1, 16) and cfg is not None:
            variants = {
                suf: ks.SkinnyConfig(
                    cfg.kind, cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_warps, cfg.num_stages, red
                )
                for suf, red in (
                    ("fixup", ks.REDUCE_FIXUP),
                    ("reduce_kernel", ks.REDUCE_KERNEL),
                    ("atomic", ks.REDUCE_ATOMIC),
                )
            }
            rt = bench_gemm(
                key, {s: _variant_runner(c, key) for s, c in variants.items()}, dev, args.reps, seed=20_000 + idx
            )
            reductions.append({"model": label, "layer": layer, "N": n, "K": k, "M": m, "config": best_fx, **rt})

    eager = eager_overhead(be, dev)
    write_outputs(out, rows, reductions, ceil, sources, time.time() - t_start, eager)
    return 0


def write_outputs(out: pathlib.Path, rows, reductions, ceil, sources, elapsed, eager=None) -> None:
    suite = [r for r in rows if r["suite"]]
    lines = [
        f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}; "
        f"torch {torch.__version__}; triton {ks.triton.__version__}; "
        f"ceilings: {ceil.describe()}; models: {'; '.join(sources)}; run took {elapsed:.0f} s",
        "",
        "| model | layer | N | K | M | weight MB | cuBLAS us | skinny us | speedup | skinny % roof | "
        "cuBLAS % roof | noise % | best config | default speedup | best no-PDL us | read-only kernel us |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tag = "" if r["suite"] else " (extra)"
        lines.append(
            f"| {r['model']}{tag} | {r['layer']} | {r['N']} | {r['K']} | {r['M']} | {r['weight_MB']:.0f} | "
            f"{r['cublas_us']:.2f} | {r['skinny_us']:.2f} | {r['speedup']:.2f} | {r['skinny_roof_pct']:.1f} | "
            f"{r['cublas_roof_pct']:.1f} | {r['noise_pct']:.1f} | {r['best'][7:]} | "
            f"{r['cublas_us'] / r['default_us']:.2f} | {r['plain_us']:.2f} | {r['read_us']:.2f} |"
        )
    lines.append("")
    lines.append(
        f"**Suite geomean speedup (best skinny vs cuBLAS, {len(suite)} cases): "
        f"{geomean([r['speedup'] for r in suite]):.3f}x**; with the untuned default choice: "
        f"{geomean([r['cublas_us'] / r['default_us'] for r in suite]):.3f}x"
    )
    for m in sorted({r["M"] for r in rows}):
        in_suite = any(r["suite"] and r["M"] == m for r in rows)  # suite Ms: suite rows only (no lm_head)
        sel = [r for r in rows if r["M"] == m and r["suite"] == in_suite]
        tag = "" if in_suite else " (extra)"
        lines.append(
            f"- M={m}{tag}: geomean speedup {geomean([r['speedup'] for r in sel]):.3f}x, skinny "
            f"{geomean([r['skinny_roof_pct'] for r in sel]):.1f}% of roof (cuBLAS "
            f"{geomean([r['cublas_roof_pct'] for r in sel]):.1f}%)"
        )
    big = [r for r in suite if r["N"] * r["K"] * 2 >= BIG_WEIGHT]
    if big:
        worst = min(big, key=lambda r: r["skinny_roof_pct"])
        lines.append(
            f"- weights >= 32 MB: min skinny % roof {worst['skinny_roof_pct']:.1f} "
            f"({worst['model']} {worst['layer']} M={worst['M']}); "
            f"{sum(r['skinny_roof_pct'] >= 85 for r in big)}/{len(big)} at >= 85%"
        )
    lines.append(
        f"- without PDL variants (best plain config, same confirm run): geomean "
        f"{geomean([r['cublas_us'] / r['plain_us'] for r in suite]):.3f}x; a read-only kernel over "
        f"the same weight (torch.sum) would be {geomean([r['cublas_us'] / r['read_us'] for r in suite]):.3f}x"
    )
    if big:
        lines.append(
            f"- weights >= 32 MB, read-only kernel at >= 85% of roof: "
            f"{sum(100 * r['roof_us'] / r['read_us'] >= 85 for r in big)}/{len(big)}"
        )
    for kind, what in (("torch", "a torch kernel (no early trigger)"), ("pdl", "a Triton kernel that triggers early")):
        sel = [r for r in suite if kind in r.get("prod", {})]
        if sel:
            ratio = lambda r, nm, kind=kind: r["prod"][kind]["cublas"] / r["prod"][kind][nm]
            lines.append(
                f"- behind {what} writing x: best {geomean([ratio(r, 'best') for r in sel]):.3f}x, "
                f"best no-PDL {geomean([ratio(r, 'plain') for r in sel]):.3f}x "
                f"({len(sel)} cases; the producer's time is in both sides)"
            )
    losses = [r for r in rows if r["speedup"] < 1.0]
    lines.append(
        f"- skinny loses (speedup < 1) in {len(losses)} cases: "
        + (", ".join(f"{r['model']} {r['layer']} M={r['M']} (x{r['speedup']:.2f})" for r in losses) or "none")
    )
    if reductions:
        lines += [
            "",
            "Split-K reduction study (the best split-K config's tiles and split; us):",
            "",
            "| model | layer | M | config | fix-up (1 launch) | partials + reduce kernel | atomics + memset + cast |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in reductions:
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['M']} | {r['config'][7:]} | {r['fixup']:.2f} | "
                f"{r['reduce_kernel']:.2f} | {r['atomic']:.2f} |"
            )
        lines.append(
            f"\ngeomean time vs fix-up: reduce kernel "
            f"{geomean([r['reduce_kernel'] / r['fixup'] for r in reductions]):.3f}x, atomics "
            f"{geomean([r['atomic'] / r['fixup'] for r in reductions]):.3f}x"
        )
    if eager:
        lines.append(
            "\nEager wall time per call, M=1 N=4096 K=4096 (GPU time plus CPU launch; not in the table): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in eager.items())
        )
    text = "\n".join(lines) + "\n"
    (out / "skinny_decode.md").write_text(text)
    (out / "skinny_decode.json").write_text(
        json.dumps({"rows": rows, "reductions": reductions, "eager_us": eager, "ceilings": ceil.__dict__}, indent=1)
    )
    with open(out / "skinny_decode.csv", "w", newline="") as fh:
        cols = [c for c in rows[0] if c != "screen"] if rows else []
        wr = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        wr.writeheader()
        wr.writerows(rows)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
