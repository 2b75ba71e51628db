"""Experiment: does programmatic dependent launch (PDL) shorten skinny decode GEMMs? (issue 3)

For each decode-suite shape and M: screen the skinny backend's plain candidates against cuBLAS, take
the best two configs, and time their PDL variants (pdl1: trigger + wait; pdlN: N-1 weight tiles
prefetched into L2 before the wait). Three settings, all graph-replayed over cold weights:
- chain:    GEMM after GEMM (docs/benchmarking.md's harness as is);
- torch:    each GEMM behind a torch elementwise kernel that writes x (a producer with no PDL trigger);
- pdlprod:  each GEMM behind a Triton kernel that writes x and triggers its dependents early
            (what gemmtune's fused norm / activation kernels would do with PDL).
The producer's time is in every contender's figure; the ratio vs cuBLAS is the same-run ratio.

    PYTHONPATH=src python benchmarks/experiments/exp_pdl.py --out OUT_DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: suites, bench_skinny

from bench_skinny import (  # noqa: E402
    SUITE,
    _variant_runner,
    check_inputs,
    check_runner,
    geomean,
    precompile,
    with_producer,
)
from suites import find_models_dir, suite_shapes  # noqa: E402

from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend  # noqa: E402
from gemmtune.kernels import skinny as ks  # noqa: E402
from gemmtune.keys import GemmKey  # noqa: E402
from gemmtune.tuner.timing import bench_gemm, measure_ceilings, roof_us  # noqa: E402

PDLS = (1, 2, 3, 5)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    be = SkinnyBackend()
    shapes, _ = suite_shapes(find_models_dir(None), SUITE)
    ms = [int(v) for v in args.ms.split(",")]
    plan = [(s, m) for s in shapes for m in ms]
    work = []
    for (_, _, n, k), m in plan:
        key = GemmKey(m, n, k)
        names = [s.kernel_name for s in be.candidates(key, dev) if not s.kernel_name.endswith("_rk")]
        work.append(
            (key, names + [dataclasses.replace(ks.SkinnyConfig.parse(nm), pdl=p).name for nm in names for p in PDLS])
        )
    t0 = time.time()
    errs = precompile(work, args.workers)
    print(f"precompile {time.time() - t0:.0f} s, {len(errs)} errors", *errs[:5], sep="\n")
    ceil = measure_ceilings(dev)
    print("ceilings", ceil.describe(), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows = []
    for idx, ((label, layer, n, k), m) in enumerate(plan):
        key = GemmKey(m, n, k)
        names = [s.kernel_name for s in be.candidates(key, dev) if not s.kernel_name.endswith("_rk")]
        plain = {nm: _variant_runner(ks.SkinnyConfig.parse(nm), key) for nm in names}
        screen = bench_gemm(key, {"cublas": F.linear, **plain}, dev, args.reps, seed=idx)
        top = sorted((nm for nm in plain if math.isfinite(screen[nm])), key=screen.get)[:2]
        inputs = check_inputs(key, gen)
        cands = {}
        for nm in top:
            base = ks.SkinnyConfig.parse(nm)
            for p in (0, *PDLS):
                cfg = dataclasses.replace(base, pdl=p)
                r = _variant_runner(cfg, key)
                err = check_runner(r, key, inputs)
                if err > 1e-2:
                    print("  BAD", cfg.name, key.describe(), err)
                    continue
                cands[cfg.name] = r
        del inputs
        chain = bench_gemm(key, {"cublas": F.linear, "cublas2": F.linear, **cands}, dev, args.reps, seed=100 + idx)
        best_plain = min((c for c in cands if "_pdl" not in c), key=chain.get)
        best_pdl = min((c for c in cands if "_pdl" in c), key=chain.get)
        prod = {}
        for kind in ("torch", "pdl"):
            r = bench_gemm(
                key,
                {
                    "cublas": with_producer(F.linear, kind),
                    "plain": with_producer(cands[best_plain], kind),
                    "pdl": with_producer(cands[best_pdl], kind),
                },
                dev,
                args.reps,
                seed=200 + idx,
            )
            prod[kind] = r
        roof = roof_us(key, ceil)
        row = dict(
            model=label,
            layer=layer,
            N=n,
            K=k,
            M=m,
            roof=roof,
            cublas=chain["cublas"],
            cublas2=chain["cublas2"],
            best_plain=best_plain,
            plain=chain[best_plain],
            best_pdl=best_pdl,
            pdl=chain[best_pdl],
            all={c: round(chain[c], 3) for c in cands},
            torch_prod={k_: round(v, 3) for k_, v in prod["torch"].items()},
            pdl_prod={k_: round(v, 3) for k_, v in prod["pdl"].items()},
        )
        rows.append(row)
        tp, pp = prod["torch"], prod["pdl"]
        print(
            f"{label:>15} {layer:>8} M={m:<3} roof {roof:6.2f} | chain cublas {row['cublas']:6.2f} plain "
            f"{row['plain']:6.2f} ({row['cublas'] / row['plain']:.3f}x) pdl {row['pdl']:6.2f} "
            f"({row['cublas'] / row['pdl']:.3f}x, {100 * roof / row['pdl']:.0f}%) {best_pdl[7:]} | "
            f"torch-prod {tp['cublas'] / tp['plain']:.3f}x/{tp['cublas'] / tp['pdl']:.3f}x | "
            f"pdl-prod {pp['cublas'] / pp['plain']:.3f}x/{pp['cublas'] / pp['pdl']:.3f}x "
            f"[{pp['cublas']:.2f} {pp['plain']:.2f} {pp['pdl']:.2f}]",
            flush=True,
        )
    (out / "exp_pdl.json").write_text(json.dumps(rows, indent=1))
    for what, f in (
        ("chain plain", lambda r: r["cublas"] / r["plain"]),
        ("chain pdl", lambda r: r["cublas"] / r["pdl"]),
        ("torch-prod plain", lambda r: r["torch_prod"]["cublas"] / r["torch_prod"]["plain"]),
        ("torch-prod pdl", lambda r: r["torch_prod"]["cublas"] / r["torch_prod"]["pdl"]),
        ("pdl-prod plain", lambda r: r["pdl_prod"]["cublas"] / r["pdl_prod"]["plain"]),
        ("pdl-prod pdl", lambda r: r["pdl_prod"]["cublas"] / r["pdl_prod"]["pdl"]),
    ):
        print(f"geomean {what}: {geomean([f(r) for r in rows]):.3f}x")
    for p in (1, *PDLS[1:]):
        wins = sum(r["best_pdl"].endswith(f"_pdl{p}") for r in rows)
        print(f"pdl{p} best in {wins} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
