"""Experiment: where do the 32-64 MB decode weights lose their last 5-15% of the read roof? (issue 3)

For the decode cases below 85% of the roof, times against cuBLAS, in one run:
- `own`: every candidate the skinny backend offers (tiles split to fill one wave);
- `split`: each tensor-core tile at every split-K factor 1..8 (does the fix-up's tail cost more
  than the idle SMs of an unsplit grid?), plain and PDL;
- `gemv16`: the CUDA-core kernel let loose up to 16 rows (the backend stops it at 4);
- `tg`: the triton backend's GEMM configs (TMA loads) at these M;
- `tiles`: 12 more tensor-core tiles (block sizes, warps, stages), each split to fill one wave;
- `stages`: tensor-core tiles with 1-2 stages (register loads, no cp.async ring);
- `gemvstages`: the CUDA-core kernel software-pipelined (2-4 stages) so its FMAs hide behind loads.
A screen over all of them, then the 6 fastest + cuBLAS re-timed on fresh inputs.

    PYTHONPATH=src python benchmarks/experiments/exp_skinny_splits.py [--out DIR] [--cases M:N:K,...]
        [--families split,gemv16,tg,tiles,stages,gemvstages]
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

from bench_skinny import _variant_runner, check_inputs, check_runner, precompile  # noqa: E402

from gemmtune.backends.a16w16 import triton as btg  # noqa: E402
from gemmtune.backends.a16w16.triton_skinny import SkinnyBackend  # noqa: E402
from gemmtune.backends.lib import skinny as bs  # noqa: E402
from gemmtune.kernels import skinny as ks  # noqa: E402
from gemmtune.keys import GemmKey  # noqa: E402
from gemmtune.tuner.timing import bench_gemm, measure_ceilings, roof_us  # noqa: E402

ks.GEMV_MAX_ROWS = 16  # module-level, so the spawned precompile workers see it too

CASES = [
    (2, 4096, 4096),
    (4, 4096, 4096),
    (8, 4096, 4096),
    (16, 4096, 4096),
    (8, 6144, 4096),
    (16, 6144, 4096),
    (8, 5120, 6400),
    (16, 5120, 6400),
    (16, 8192, 3584),
    (4, 1280, 8192),
    (8, 8192, 1024),
]
SPLITS = (1, 2, 3, 4, 6, 8)
GEMV_TILES = [(bn, bk, w) for bn in (4, 8, 16) for bk in (128, 256, 512) for w in (4, 8)]
LOW_STAGE_TILES = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (256, 512) for w in (4, 8) for s in (1, 2)]
# Session 2's extra tensor-core tiles (block_n, block_k, warps, stages); 32x256/3 won and joined the backend.
EXTRA_TILES = [
    (32, 512, 4, 2),
    (32, 512, 4, 3),
    (64, 512, 4, 2),
    (64, 256, 8, 2),
    (16, 1024, 4, 2),
    (16, 512, 4, 2),
    (32, 256, 4, 3),
    (32, 256, 8, 4),
    (64, 128, 4, 6),
    (64, 256, 4, 2),
    (128, 256, 8, 3),
    (32, 128, 4, 6),
]


def _split_cfg(kind, bn, bk, sk, w, s, key):
    """The config with split-K `sk`, or None when K gives that split no work."""
    cfg = ks.SkinnyConfig(kind, bn, bk, sk, w, s, ks.REDUCE_FIXUP if sk > 1 else ks.REDUCE_NONE)
    return cfg if cfg.effective_split(key.K)[0] == sk else None


def skinny_variants(key: GemmKey, families) -> dict[str, ks.SkinnyConfig]:
    """{family:name: config} of the studied families, each config plain and with PDL (pdl2)."""
    sms, _, smem_sm = bs.device_limits(torch.device("cuda", 0))
    shape = bs.Shape.of(key)
    bm = ks.SkinnyConfig("gemv", 8, 16).block_m(key.M)
    fits = lambda bn, bk, w: bm * bn * bk <= 128 * 32 * w  # noqa: E731 - the gemv register bound
    cfgs = []  # (family, config)
    if "split" in families:
        cfgs += [("split", _split_cfg("dot", *t[:2], sk, *t[2:], key)) for t in bs.DOT_TILES for sk in SPLITS]
    if "tiles" in families:
        cfgs += [("tiles", bs.tile_config("dot", *t, shape, sms, smem_sm)) for t in EXTRA_TILES]
    if "stages" in families:
        cfgs += [("stages", bs.tile_config("dot", *t, shape, sms, smem_sm)) for t in LOW_STAGE_TILES]
    if "gemvstages" in families:
        cfgs += [
            ("gemvstages", bs.tile_config("gemv", bn, bk, w, st, shape, sms, smem_sm))
            for bn, bk, w in GEMV_TILES
            if fits(bn, bk, w)
            for st in (2, 3, 4)
        ]
    if "gemv16" in families:
        cfgs += [
            ("gemv16", _split_cfg("gemv", bn, bk, sk, w, 1, key))
            for bn, bk, w in GEMV_TILES
            if fits(bn, bk, w)
            for sk in (1, 2, 4)
            if sk == 1 or -(-key.N // bn) * sk <= 3 * sms
        ]
    return {f"{fam}:{c.name}": c for fam, cfg in cfgs if cfg for c in (cfg, dataclasses.replace(cfg, pdl=2))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--families", default="split,gemv16,tg,stages")
    ap.add_argument("--cases", default="", help="M:N:K,... (default: the cases below 85%% of the roof)")
    args = ap.parse_args()
    families = set(args.families.split(","))
    cases = [tuple(map(int, c.split(":"))) for c in args.cases.split(",") if c] or CASES
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    be, tg = SkinnyBackend(), btg.TritonGemmBackend()
    t0 = time.time()
    work, tg_jobs = [], []
    for m, n, k in cases:
        key = GemmKey(m, n, k)
        names = [s.kernel_name for s in be.candidates(key, dev)] + [
            c.name for c in skinny_variants(key, families).values()
        ]
        work.append((key, list(dict.fromkeys(names))))
        tg_jobs += [(s, key) for s in tg.candidates(key, dev)] if "tg" in families else []
    errs = precompile(work, 14) + (btg.precompile(tg_jobs, dev, 14) if tg_jobs else [])
    print(f"precompile {time.time() - t0:.0f} s, {len(errs)} errors", flush=True)
    for e in errs[:10]:
        print("  ", e)
    ceil = measure_ceilings(dev)
    print("ceilings:", ceil.describe(), flush=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    results = []
    for idx, (m, n, k) in enumerate(cases):
        key = GemmKey(m, n, k)
        runners = {}
        for s in be.candidates(key, dev):
            runners["own:" + s.kernel_name] = be.make_runner(s, key, dev)
        for label, cfg in skinny_variants(key, families).items():
            runners[label] = _variant_runner(cfg, key)
        for s in tg.candidates(key, dev) if "tg" in families else ():
            try:
                runners["tg:" + s.kernel_name] = tg.make_runner(s, key, dev)
            except Exception as exc:  # noqa: BLE001 - a config that does not build is skipped
                print("  skip", s.kernel_name, type(exc).__name__)
        inputs = check_inputs(key, gen)
        ok = {}
        for nm, r in runners.items():
            try:
                if check_runner(r, key, inputs) < 1e-2:
                    ok[nm] = r
                else:
                    print("  inaccurate", nm)
            except Exception as exc:  # noqa: BLE001
                print("  failed", nm, type(exc).__name__, str(exc)[:120])
        del inputs
        screen = bench_gemm(key, {"cublas": F.linear, **ok}, dev, reps=args.reps, seed=idx)
        fin = [nm for nm in sorted(ok, key=lambda nm: screen.get(nm, math.inf)) if math.isfinite(screen[nm])]
        groups = {}
        for nm in fin:  # the best of each family, then the next fastest overall
            groups.setdefault(nm.split(":")[0], nm)
        pick = list(dict.fromkeys([*groups.values(), *fin[:6]]))
        conf = bench_gemm(key, {"cublas": F.linear, **{nm: ok[nm] for nm in pick}}, dev, reps=20, seed=100 + idx)
        roof = roof_us(key, ceil)
        rank = sorted(pick, key=lambda nm: conf[nm])
        print(
            f"M={m} N={n} K={k} roof {roof:.2f} cublas {conf['cublas']:.2f} ({100 * roof / conf['cublas']:.1f}%)",
            flush=True,
        )
        for nm in rank:
            print(f"    {conf[nm]:7.2f} us {100 * roof / conf[nm]:5.1f}%  screen {screen[nm]:7.2f}  {nm}", flush=True)
        results.append(
            {
                "M": m,
                "N": n,
                "K": k,
                "roof_us": roof,
                "cublas_us": conf["cublas"],
                "confirm": {nm: conf[nm] for nm in rank},
                "screen_top": {nm: screen[nm] for nm in fin[:25]},
            }
        )
    (out_dir / "exp_skinny_splits.json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(), "ceilings": ceil.describe(), "cases": results}, indent=1)
    )
    print(f"done in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
