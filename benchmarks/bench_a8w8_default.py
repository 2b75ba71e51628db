"""The untuned 8-bit default against torch's own 8-bit path, counted as a model pays it: the activation
arrives in bf16 and is quantized per token before the GEMM.

Per point (format, N, K, M), one interleaved CUDA-graph run over rotating cold input sets (> 2x L2):
- bf16: F.linear(x, w) on the bf16 activation and weight;
- torch q+gemm: torch's quantizer (quant/quantize.py's per-token formula in plain PyTorch ops) then
  torch._scaled_mm rowwise (fp8), or torch._int_mm + the scales (int8; _int_mm needs M > 16, so smaller
  M is padded to 17 rows, as a user of it must);
- torch gemm: the same GEMM on the already quantized activation;
- gemmtune q+gemm: kernels/quant.py's one-kernel quantizer then gemmtune.gemm_a8w8 with no table (the
  default of quantized/policy.py, through dispatch);
- gemmtune gemm: gemm_a8w8 on the already quantized activation.
With --producer the activation is an RMSNorm's output, as for a model's q/k/v and gate/up GEMMs, and the
norm is counted in every contender: bf16 norm+gemm (kernels/norms.py's rmsnorm, then F.linear), gemmtune
norm+q+gemm (the norm, the quantizer, gemm_a8w8), gemmtune fused norm+gemm (kernels/quant_producers.py's
rmsnorm_quant writes the 8-bit activation and its scales, then gemm_a8w8).
Ratios > 1 mean gemmtune is faster; the 8-bit roof takes twice the bf16 matmul rate (measured in the run).

    PYTHONPATH=src python benchmarks/bench_a8w8_default.py --out OUT_DIR [--formats fp8,int8] [--ms 1,16,...]
    PYTHONPATH=src python benchmarks/bench_a8w8_default.py --producer --suite-only --out OUT_DIR
    PYTHONPATH=src python benchmarks/bench_a8w8_default.py --producer --suite-only --table tuned.csv --out OUT_DIR
    PYTHONPATH=src python benchmarks/bench_a8w8_default.py --nk 5760x3840,3840x3840 --formats fp8 --out OUT_DIR
    PYTHONPATH=src python benchmarks/bench_a8w8_default.py --skinny-max-m 64 --ms 17,64 --formats fp8 --out OUT_DIR

With --table, gemmtune's GEMM is the tuned table's row for each point instead of the untuned default
(the report says which); torch's and bf16's contenders are unchanged. With --tiles (what-if, GEMM only),
each named Triton tile (kernels/a8w8.py, BMxBNxBKwWsS) is also timed on the quantized activation, its K
split by the tile kernel's own rule (lib/quant_tiles.tile_split), and with --tg the first a8w8_tg_
candidate whose name matches the pattern, and with --blaslt cuBLASLt's heuristic pick (fast accumulation
from policy.FAST_ACCUM_MIN_M): what a default policy could run instead.

Writes a8w8_default.md / .json into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
import time

import torch
import torch.nn.functional as F
from suites import find_models_dir, suite_shapes

import gemmtune
from gemmtune.backends.lib.quant_tiles import tile_split
from gemmtune.backends.quantized import policy, triton_tg
from gemmtune.backends.quantized.blaslt import BlasLtA8W8Backend
from gemmtune.backends.quantized.triton import TritonA8W8Backend
from gemmtune.device import facts
from gemmtune.families.quantized import FP8, QuantKey
from gemmtune.kernels.a8w8 import TileConfig
from gemmtune.kernels.norms import rmsnorm
from gemmtune.kernels.quant import quantize_per_token_triton
from gemmtune.kernels.quant_producers import rmsnorm_quant
from gemmtune.quant.quantize import quantize_per_channel, quantize_per_token
from gemmtune.tuner.timing import MAX_SETS, l2_bytes, measure_ceilings, time_graphs

SUITE = [("llama-3-8b", 1), ("llama-3-70b", 8), ("qwen3-32b", 1)]
# Shapes beyond the three models: small and large hidden sizes, a tp8 down_proj of a 400B-class model,
# the 17408-wide down_proj of a 32B-class model, odd multiples of 16.
EXTRA = [("2048x2048", 2048, 2048), ("3072x8192", 3072, 8192), ("16384x4096", 16384, 4096),
         ("16384x6656 (tp8 down)", 16384, 6656), ("5120x17408", 5120, 17408), ("1040x4112", 1040, 4112),
         ("26624x5120", 26624, 5120)]  # fmt: skip
MS = [1, 4, 16, 17, 32, 64, 128, 256, 512, 1024, 2048, 4096]
DTYPES = {"fp8": FP8, "int8": torch.int8}
INT_MM_MIN_M = 17


def _geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _torch_gemm(qd):
    """torch's own GEMM on (xq, wq, xs, ws) -> bf16."""
    if qd == FP8:
        return lambda xq, wq, xs, ws: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    def int_mm(xq, wq, xs, ws):
        m = xq.shape[0]
        if m < INT_MM_MIN_M:
            xq, xs = F.pad(xq, (0, 0, 0, INT_MM_MIN_M - m)), F.pad(xs, (0, 0, 0, INT_MM_MIN_M - m))
        return (torch._int_mm(xq, wq.t()).float() * xs * ws)[:m].to(torch.bfloat16)

    return int_mm


def producer_contenders(qd, norm_w: torch.Tensor) -> dict:
    """The norm -> GEMM chain three ways (see the module doc), on the same arguments as bench_point's."""
    eps = 1e-6

    def bf16(x, w, wq, ws, xq, xs):
        return F.linear(rmsnorm(x, norm_w, eps), w)

    def unfused(x, w, wq, ws, xq, xs):
        q, s = quantize_per_token_triton(rmsnorm(x, norm_w, eps), qd)
        return gemmtune.gemm_a8w8(q, wq, s, ws)

    def fused(x, w, wq, ws, xq, xs):
        q, s = rmsnorm_quant(x, norm_w, eps, qd)
        return gemmtune.gemm_a8w8(q, wq, s, ws)

    return {"bf16 norm+gemm": bf16, "gemmtune norm+q+gemm": unfused, "gemmtune fused norm+gemm": fused}


def what_if_runners(key, dev, tiles: list[str], tg_pattern: str | None, blaslt: bool = False) -> dict:
    """name -> GEMM runner(xq, wq, xs, ws, bias) of each --tiles tile (its rule's split), the --tg match and
    cuBLASLt's heuristic pick (--blaslt)."""
    backend, out = TritonA8W8Backend(), {}
    if blaslt:
        lt = BlasLtA8W8Backend()
        pick = lt.default_solution(key, dev, fast=key.M >= policy.FAST_ACCUM_MIN_M)
        if pick is not None:
            out["blaslt heuristic"] = lt.make_runner(pick, key, dev)
    for spec in tiles:
        bm, bn, rest = spec.split("x")
        bk, rest = rest.split("w")
        w, s = (int(v) for v in rest.split("s"))
        split = tile_split(int(bm), int(bn), int(bk), key, facts(dev).sms)
        cfg = TileConfig("a8w8", int(bm), int(bn), int(bk), 8, split, w, s)
        out[cfg.name] = backend.make_runner(backend.solution(cfg), key, dev)
    if tg_pattern:
        match = next((c for c in triton_tg.candidates(key, dev) if re.fullmatch(tg_pattern, c.kernel_name)), None)
        if match is not None:
            out[match.kernel_name] = backend.make_runner(match, key, dev)
    return out


def bench_point(fmt: str, n: int, k: int, m: int, dev, reps: int, seed: int, producer: bool = False,
                tiles: tuple = (), tg_pattern: str | None = None, blaslt: bool = False) -> dict:  # fmt: skip
    qd = DTYPES[fmt]
    per_set = m * k * 2 + n * k * 3 + m * n * 2  # bf16 x and w, 8-bit w, bf16 y
    n_sets = min(MAX_SETS, max(2, math.ceil(2 * l2_bytes(dev) / per_set) + 1))
    g = torch.Generator(device=dev).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(m, k, device=dev, generator=g, dtype=torch.bfloat16)
        w = (torch.randn(n, k, device=dev, generator=g) / k**0.5).to(torch.bfloat16)
        wq, ws = quantize_per_channel(w, qd)
        xq, xs = quantize_per_token(x, qd)
        sets.append((x, w, wq, ws, xq, xs))
    gemm = _torch_gemm(qd)

    def torch_q_gemm(x, w, wq, ws, xq, xs):
        q, s = quantize_per_token(x, qd)
        return gemm(q, wq, s, ws)

    def gemmtune_q_gemm(x, w, wq, ws, xq, xs):
        q, s = quantize_per_token_triton(x, qd)
        return gemmtune.gemm_a8w8(q, wq, s, ws)

    contenders = {
        "bf16": lambda x, w, wq, ws, xq, xs: F.linear(x, w),
        "torch q+gemm": torch_q_gemm,
        "torch gemm": lambda x, w, wq, ws, xq, xs: gemm(xq, wq, xs, ws),
        "gemmtune q+gemm": gemmtune_q_gemm,
        "gemmtune gemm": lambda x, w, wq, ws, xq, xs: gemmtune.gemm_a8w8(xq, wq, xs, ws),
        "bf16#2": lambda x, w, wq, ws, xq, xs: F.linear(x, w),
    }
    if producer:
        contenders.update(producer_contenders(qd, 1 + torch.rand(k, device=dev, generator=g).to(torch.bfloat16)))
    key = QuantKey(m, n, k, qd, "per_token")
    alts = what_if_runners(key, dev, list(tiles), tg_pattern, blaslt) if (tiles or tg_pattern or blaslt) else {}
    for name, run in alts.items():
        contenders[name] = lambda x, w, wq, ws, xq, xs, run=run: run(xq, wq, xs, ws, None)
    ref = F.linear(*(t.float() for t in sets[0][:2]))
    errors = {}
    for name in ("torch gemm", "gemmtune gemm", "gemmtune q+gemm", *alts):
        y = contenders[name](*sets[0]).float()
        errors[name] = ((y - ref).norm() / ref.norm()).item()

    def calls(fn):
        def all_sets():
            for s in sets:
                fn(*s)

        return all_sets

    us = {n_: v * 1e3 for n_, v in time_graphs({n_: calls(f) for n_, f in contenders.items()}, reps=reps,
                                                 calls_per_graph=len(sets)).items()}  # fmt: skip
    res = gemmtune.resolve(key, dev, family="a8w8")
    row = {"format": fmt, "M": m, "N": n, "K": k, "us": us, "rel_err": errors, "default": res.solution.describe(),
           "noise": abs(us["bf16"] - us["bf16#2"]) / us["bf16"]}  # fmt: skip
    row["x_torch_q"] = us["torch q+gemm"] / us["gemmtune q+gemm"]
    row["x_torch_gemm"] = us["torch gemm"] / us["gemmtune gemm"]
    row["x_bf16_q"] = us["bf16"] / us["gemmtune q+gemm"]
    row["x_bf16_gemm"] = us["bf16"] / us["gemmtune gemm"]
    row["alt_x_default"] = {name: us["gemmtune gemm"] / us[name] for name in alts}  # > 1: the tile is faster
    if producer:
        row["x_bf16_fused"] = us["bf16 norm+gemm"] / us["gemmtune fused norm+gemm"]
        row["x_bf16_unfused"] = us["bf16 norm+gemm"] / us["gemmtune norm+q+gemm"]
    return row


def summarize(rows: list[dict], device: str, table: str | None = None) -> str:
    what = f"the tuned table {table}" if table else "the untuned a8w8 default"
    lines = [f"# gemmtune's 8-bit GEMM ({what}) vs torch's own 8-bit path ({device})", "",
             "x = time of the other / time of gemmtune's (> 1: gemmtune is faster; 'default' is the solution "
             "dispatch ran).", "",
             "| fmt | M | N | K | bf16 us | torch q+gemm | torch gemm | gemmtune q+gemm | gemmtune gemm | "
             "x torch (q+gemm) | x torch (gemm) | x bf16 (q+gemm) | default |", "|" + "---|" * 13]  # fmt: skip
    for r in rows:
        u = r["us"]
        cells = [r["format"], r["M"], r["N"], r["K"], *(f"{u[c]:.1f}" for c in ("bf16", "torch q+gemm", "torch gemm",
                 "gemmtune q+gemm", "gemmtune gemm")), f"{r['x_torch_q']:.3f}", f"{r['x_torch_gemm']:.3f}",
                 f"{r['x_bf16_q']:.2f}", r["default"]]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "| fmt | M range | points | x torch (q+gemm) geomean / worst | x torch (gemm) geomean / worst | "
              "x bf16 (q+gemm) geomean | x bf16 (gemm) geomean |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    ranges = ((1, 16, "M<=16"), (17, 512, "17..512"), (1024, 1 << 30, "M>=1024"), (1, 1 << 30, "all"))
    for fmt in DTYPES:
        for lo, hi, label in ranges:
            sel = [r for r in rows if r["format"] == fmt and lo <= r["M"] <= hi]
            if not sel:
                continue
            tq, tg = [r["x_torch_q"] for r in sel], [r["x_torch_gemm"] for r in sel]
            bq, bg = [r["x_bf16_q"] for r in sel], [r["x_bf16_gemm"] for r in sel]
            cells = [fmt, label, len(sel), f"{_geomean(tq):.3f} / {min(tq):.3f}", f"{_geomean(tg):.3f} / {min(tg):.3f}",
                     f"{_geomean(bq):.2f}", f"{_geomean(bg):.2f}"]  # fmt: skip
            lines.append("| " + " | ".join(map(str, cells)) + " |")
    if any("x_bf16_fused" in r for r in rows):
        lines += ["", "RMSNorm -> GEMM, the norm counted everywhere, x = bf16 norm+gemm / gemmtune's:", "",
                  "| fmt | M range | points | fused norm->8-bit + gemm | norm + quantizer + gemm | gemm only |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for fmt in DTYPES:
            for lo, hi, label in ranges:
                sel = [r for r in rows if r["format"] == fmt and lo <= r["M"] <= hi and "x_bf16_fused" in r]
                if sel:
                    cells = [fmt, label, len(sel), *(f"{_geomean([r[c] for r in sel]):.2f}"
                             for c in ("x_bf16_fused", "x_bf16_unfused", "x_bf16_gemm"))]  # fmt: skip
                    lines.append("| " + " | ".join(map(str, cells)) + " |")
    alt_rows = [r for r in rows if r.get("alt_x_default")]
    if alt_rows:
        lines += [
            "",
            "What-if tiles (--tiles / --tg), GEMM alone, x = the default's time / the tile's (> 1: the tile "
            "is faster), per point:",
            "",
            "| fmt | M | N | K | default | tiles |",
            "|---|---|---|---|---|---|",
        ]
        for r in alt_rows:
            cells = ", ".join(f"{name} {x:.3f}" for name, x in r["alt_x_default"].items())
            lines.append(f"| {r['format']} | {r['M']} | {r['N']} | {r['K']} | {r['default']} | {cells} |")
    lines += ["", f"Noise: largest |bf16 - bf16#2| / bf16: {100 * max(r['noise'] for r in rows):.1f}%"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default="fp8,int8")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--producer", action="store_true", help="also the RMSNorm -> GEMM chain, fused and not")
    ap.add_argument("--suite-only", action="store_true", help="only the three models' shapes (no EXTRA)")
    ap.add_argument("--table", default=None, help="a tuned a8w8 table for gemmtune's GEMM (default: none)")
    ap.add_argument(
        "--skinny-max-m",
        type=int,
        default=None,
        help="run the 8-bit skinny default tile for every untuned key up to this M (at most 64)",
    )
    ap.add_argument("--tiles", default="", help="what-if Triton tiles to time too (comma list, 64x128x128w4s4,...)")
    ap.add_argument("--tg", default=None, help="what-if: also the first a8w8_tg_ candidate matching this regex")
    ap.add_argument("--blaslt", action="store_true", help="what-if: also cuBLASLt's heuristic pick")
    ap.add_argument("--nk", default=None, help="these NxK shapes instead of the suite's (comma list, 5760x3840,...)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.skinny_max_m is not None:  # what-if: the policy's skinny band widened (or narrowed) for this run
        from gemmtune.backends.quantized import triton_skinny

        m = min(args.skinny_max_m, triton_skinny.DEFAULT_MAX_M)
        policy.SKINNY_MAX_M = policy.SKINNY_FP8_MAX_M = policy.SKINNY_FP8_WIDE_MAX_M = m
    gemmtune.set_config(args.table)  # None: the untuned default, whatever GEMMTUNE_CONFIG says
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = measure_ceilings(dev)
    device = torch.cuda.get_device_name(dev)
    print(f"{device}; torch {torch.__version__}; ceilings: {ceil.describe()}", flush=True)
    if args.nk:
        points = [tuple(int(v) for v in nk.split("x")) for nk in args.nk.split(",")]
    else:
        shapes, _ = suite_shapes(find_models_dir(args.models_dir), SUITE)
        extra = set() if args.suite_only else {(n, k) for _, n, k in EXTRA}
        points = sorted({(n, k) for _, _, n, k in shapes} | extra)
    rows, t0 = [], time.time()
    for fmt in args.formats.split(","):
        for i, (n, k) in enumerate(points):
            for m in (int(v) for v in args.ms.split(",")):
                r = bench_point(
                    fmt,
                    n,
                    k,
                    m,
                    dev,
                    args.reps,
                    seed=1000 * i + m,
                    producer=args.producer,
                    tiles=tuple(t for t in args.tiles.split(",") if t),
                    tg_pattern=args.tg,
                    blaslt=args.blaslt,
                )
                rows.append(r)
                print(f"{fmt:5s} M={m:5d} N={n:6d} K={k:6d} x torch q+gemm {r['x_torch_q']:.3f} gemm "
                      f"{r['x_torch_gemm']:.3f} x bf16 {r['x_bf16_q']:.2f} {r['default']} [{time.time() - t0:.0f}s]"
                      + "".join(f" | {name} {x:.3f}" for name, x in r["alt_x_default"].items()),
                      flush=True)  # fmt: skip
    text = summarize(rows, device, args.table)
    print(text)
    (out / "a8w8_default.md").write_text(text + "\n")
    (out / "a8w8_default.json").write_text(json.dumps({"device": device, "ceilings": ceil.__dict__, "rows": rows},
                                                       indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
