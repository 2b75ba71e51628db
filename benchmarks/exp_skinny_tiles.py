"""Experiment: extra tensor-core tiles for the skinny shapes that miss 85% of the roof (issue 3).

Times the backend's own candidates and a set of extra (block_n, block_k, warps, stages) tiles, each
split to fill one wave the way the backend splits, plain and with PDL, against cuBLAS.

    PYTHONPATH=src python benchmarks/exp_skinny_tiles.py
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from bench_skinny import _variant_runner, check_inputs, check_runner

from gemmtune.backends import skinny as bs
from gemmtune.kernels import skinny as ks
from gemmtune.keys import GemmKey
from gemmtune.tuner.timing import bench_gemm, measure_ceilings, roof_us

EXTRA = [
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
CASES = [(4, 4096, 4096), (8, 4096, 4096), (16, 4096, 4096), (16, 5120, 6400), (4, 1280, 8192), (16, 8192, 1024)]


def main():
    dev = torch.device("cuda")
    be = bs.SkinnyBackend()
    sms, _, smem_sm = bs._device_limits("cuda", 0)
    ceil = measure_ceilings(dev)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for m, n, k in CASES:
        key = GemmKey(m, n, k)
        own = {s.kernel_name: ks.SkinnyConfig.parse(s.kernel_name) for s in be.candidates(key, dev)}
        extra = {}
        for bn, bk, w, s in EXTRA:
            base = bs._config("dot", bn, bk, w, s, key, sms, smem_sm)
            for p in (0, 2):
                cfg = dataclasses.replace(base, pdl=p)
                if cfg.name not in own:
                    extra[cfg.name] = cfg
        inputs = check_inputs(key, gen)
        runners = {}
        for name, cfg in {**own, **extra}.items():
            try:
                r = _variant_runner(cfg, key)
                if check_runner(r, key, inputs) < 1e-2:
                    runners[name] = r
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is just skipped
                print("  skip", name, type(exc).__name__)
        t = bench_gemm(key, {"cublas": F.linear, **runners}, dev, reps=15)
        roof = roof_us(key, ceil)
        best_own = min((nm for nm in own if math.isfinite(t.get(nm, math.nan))), key=t.get)
        ranked = sorted((nm for nm in extra if math.isfinite(t.get(nm, math.nan))), key=t.get)[:3]
        print(
            f"M={m} N={n} K={k} roof {roof:.2f} cublas {t['cublas']:.2f} | own best {t[best_own]:.2f} "
            f"({100 * roof / t[best_own]:.0f}%) {best_own[7:]} | extra: "
            + ", ".join(f"{nm[7:]} {t[nm]:.2f} ({100 * roof / t[nm]:.0f}%)" for nm in ranked),
            flush=True,
        )


if __name__ == "__main__":
    main()
