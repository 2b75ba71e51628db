"""Speed of the 8-bit GEMMs on the decode or prefill suite: bf16 F.linear vs torch's own 8-bit GEMM
with the same scales vs gemmtune tuned, per format (fp8 per-token x per-channel, int8 per-token x
per-channel, fp8 1x128 / 128x128 block-scale).

Suite: the linears (fused qkv, o, fused gate_up, down) of llama-3-8b (tp 1), llama-3-70b (tp 8) and
qwen3-32b (tp 1); decode M in 1, 8, 16; prefill M in 1024, 2048, 4096. Contenders per (shape, M, format):
- bf16: F.linear on bf16 x, w of the same N, K;
- torch: torch._scaled_mm (fp8 rowwise; fp8 blockwise where the probe of this torch/cuBLAS finds it
  right, see backends/lib/scaled_mm_blockwise.py, else the dequantize path, marked) or torch._int_mm + scales (int8;
  M <= 16 falls back to dequantize, marked);
- tuned: the fastest of every gemmtune candidate (every available backend of the family: Triton tile
  configs, the skinny split-K configs for M <= 16, the torch solutions) on a screen (8 repeats),
  re-timed against the others (20 repeats) on fresh inputs: what the tuner would pick;
- tuned+q: tuned plus the dynamic per-token (or 1x128) activation quantization kernel before it.
Method (docs/benchmarking.md): CUDA-graph replay over rotating cold input sets > 2x L2, contenders
interleaved in one process, median of repeats; ceilings (read bandwidth, bf16 matmul) measured in the
same run; the 8-bit roof takes twice the bf16 matmul rate.

    PYTHONPATH=src python benchmarks/bench_quant.py --suite decode --out OUT_DIR
    PYTHONPATH=src python benchmarks/bench_quant.py --suite prefill --out OUT_DIR

Writes quant_<suite>.md / .csv / .json into --out.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import time

import torch
import torch.nn.functional as F
from suites import find_models_dir, suite_shapes

from gemmtune import backends, families
from gemmtune.backends.lib import scaled_mm_blockwise as blockwise
from gemmtune.families.quantized import FP8, BlockKey, QuantKey
from gemmtune.kernels.quant import quantize_1x128_triton, quantize_per_token_triton
from gemmtune.keys import GemmKey
from gemmtune.tuner.search import TuneOptions, precompile_all
from gemmtune.tuner.timing import MAX_SETS, l2_bytes, measure_ceilings, roof_us, time_graphs

SUITE = [("llama-3-8b", 1), ("llama-3-70b", 8), ("qwen3-32b", 1)]
MS = {"decode": [1, 8, 16], "prefill": [1024, 2048, 4096]}
FORMATS = {  # name -> (family, key maker, torch baseline solution)
    "fp8": ("a8w8", lambda m, n, k: QuantKey(m, n, k, FP8, "per_token"), "scaled_mm"),
    "int8": ("a8w8", lambda m, n, k: QuantKey(m, n, k, torch.int8, "per_token"), "int_mm"),
    "fp8-block": ("a8w8_blockscale", lambda m, n, k: BlockKey(m, n, k, FP8), "scaled_mm_blockwise"),
}


def _geomean(xs):
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _sets(set_bytes: int, dev) -> int:
    return min(MAX_SETS, max(2, math.ceil(2 * l2_bytes(dev) / set_bytes) + 1))


def _calls(run, sets):
    def all_sets():
        for s in sets:
            run(*s)

    return all_sets


def _bf16_sets(key: GemmKey, dev, n_sets, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [
        (
            torch.randn(key.M, key.K, device=dev, generator=g, dtype=torch.bfloat16),
            (torch.randn(key.N, key.K, device=dev, generator=g) / key.K**0.5).to(torch.bfloat16),
        )
        for _ in range(n_sets)
    ]


def precompile(fmts, shapes, ms, dev, workers: int) -> None:
    """Compile the candidates that compile on their first call (skinny) in parallel processes first."""
    t0 = time.time()
    fails = []
    for fmt in fmts:
        fam_name, make_key, _ = FORMATS[fmt]
        keys = [make_key(m, n, k) for _, _, n, k in shapes for m in ms]
        fails += precompile_all(keys, dev, TuneOptions(), workers=workers, family=fam_name)
    print(f"precompile: {time.time() - t0:.0f} s, {len(fails)} failed", *(f"\n  {f}" for f in fails[:10]))


def bench_point(fmt, label, layer, m, n, k, dev, ceil, args, seed):
    fam_name, make_key, base_name = FORMATS[fmt]
    fam = families.get(fam_name)
    key = make_key(m, n, k)
    row = {"model": label, "layer": layer, "format": fmt, "M": m, "N": n, "K": k}
    if fam_name == "a8w8_blockscale" and k % 128:
        return {**row, "error": "K not a multiple of 128"}
    n_sets = _sets(fam.set_bytes(key), dev)
    cands = {}
    for be in backends.available(dev, fam_name).values():
        for sol in be.candidates(key, dev):
            try:
                cands[f"{be.name}:{sol.kernel_name}"] = be.make_runner(sol, key, dev)
            except Exception as exc:  # noqa: BLE001
                print(f"  skip {sol.describe()}: {exc}")
    base_key = f"torch:{base_name}"
    base_note = ""
    if base_key not in cands:
        base_key, base_note = "torch:dequant", f"{base_name} n/a: dequantize"
    else:  # the dequantize fallback re-expands the whole weight per call: never the winner, slow to time
        cands.pop("torch:dequant", None)
    # Screen every candidate on one draw, then confirm the best three beside the baselines on a fresh one.
    sets = fam.make_inputs(key, dev, n_sets, seed)
    ref = fam.reference(key, sets[0])
    ok = {}
    for name, run in cands.items():
        try:
            y = run(*sets[0])
            err = ((y.float() - ref).norm() / ref.norm()).item()
        except Exception as exc:  # noqa: BLE001
            print(f"  {name} failed: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if err < fam.error_threshold(key):
            ok[name] = run
        else:
            print(f"  {name} rejected: rel err {err:.2e}")
    screen = time_graphs(
        {n_: _calls(r, sets) for n_, r in ok.items()}, reps=args.screen_reps, calls_per_graph=len(sets)
    )
    ranked = [n_ for _, n_ in sorted((v, n_) for n_, v in screen.items() if math.isfinite(v))]
    del sets
    sets = fam.make_inputs(key, dev, n_sets, seed + 7919)
    bf = _bf16_sets(GemmKey(m, n, k), dev, n_sets, seed)
    if fam_name == "a8w8_blockscale":  # M-major scales, as optimize(quantize="fp8-block") makes them
        quant = lambda x, dt: quantize_1x128_triton(x, dt, m_major=True)  # noqa: E731
    else:
        quant = quantize_per_token_triton
    x_bf = bf[0][0]
    final_names = list(dict.fromkeys(ranked[:3] + ([base_key] if base_key in ok else [])))
    calls = {"pad": _calls(F.linear, bf), "bf16": _calls(F.linear, bf), "bf16#2": _calls(F.linear, bf)}
    calls.update({n_: _calls(ok[n_], sets) for n_ in final_names})
    best = ranked[0] if ranked else None
    if best:
        run = ok[best]
        qd = key.q_dtype_w

        def with_quant(_x, wq, _xs, *rest):  # quantize a bf16 activation, then the GEMM with this set's weight
            xq, xs = quant(x_bf, qd)
            return run(xq, wq, xs, *rest)

        calls["tuned+q"] = _calls(with_quant, sets)
    ms = time_graphs(calls, reps=args.reps, calls_per_graph=len(sets))
    us = {n_: v * 1e3 for n_, v in ms.items()}
    tuned_name = min((n_ for n_ in final_names), key=lambda n_: us.get(n_, float("inf")), default=None)
    roof = fam.roof_us(key, ceil.read_bw, ceil.flops)
    bf_roof = roof_us(GemmKey(m, n, k), ceil)
    row.update(
        bf16=us["bf16"],
        bf16_noise=abs(us["bf16"] - us["bf16#2"]) / us["bf16"],
        torch=us.get(base_key, float("nan")),
        torch_kind=base_key.split(":")[1] + (f" ({base_note})" if base_note else ""),
        tuned=us.get(tuned_name, float("nan")),
        tuned_kernel=tuned_name or "",
        tuned_q=us.get("tuned+q", float("nan")),
        roof_us=roof,
        bf16_roof_us=bf_roof,
    )
    row["x_bf16"] = row["bf16"] / row["tuned"]
    row["x_torch"] = row["torch"] / row["tuned"]
    row["x_bf16_q"] = row["bf16"] / row["tuned_q"]
    row["pct_roof"] = 100 * roof / row["tuned"]
    row["bf16_pct_roof"] = 100 * bf_roof / row["bf16"]
    torch.cuda.empty_cache()
    return row


def summarize(rows, suite):
    lines = [
        f"# 8-bit GEMMs, {suite} suite",
        "",
        "| model | layer | fmt | M | N | K | bf16 us | torch us (kind) | "
        "tuned us | +quant us | x bf16 | x torch | x bf16 w/ quant | % roof | bf16 % roof | tuned kernel |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['format']} | {r['M']} | {r['N']} | {r['K']} | "
                f"{r['error']} |" + " |" * 10
            )
            continue
        lines.append(
            f"| {r['model']} | {r['layer']} | {r['format']} | {r['M']} | {r['N']} | {r['K']} | "
            f"{r['bf16']:.1f} | {r['torch']:.1f} ({r['torch_kind']}) | {r['tuned']:.1f} | {r['tuned_q']:.1f} | "
            f"{r['x_bf16']:.2f} | {r['x_torch']:.2f} | {r['x_bf16_q']:.2f} | {r['pct_roof']:.0f} | "
            f"{r['bf16_pct_roof']:.0f} | {r['tuned_kernel']} |"
        )
    lines += [
        "",
        "Geomeans (x = speedup; torch = torch's 8-bit GEMM with the same scales):",
        "",
        "| format | M range | x bf16 | x torch | x bf16 incl. activation quant | tuned % roof | worst x torch |",
        "|---|---|---|---|---|---|---|",
    ]
    for fmt in FORMATS:
        for lo, hi in ((1, 16), (1024, 1 << 30)):
            sel = [r for r in rows if r["format"] == fmt and lo <= r["M"] <= hi and "error" not in r]
            if not sel:
                continue
            rng = "M<=16" if hi == 16 else "M>=1024"
            worst = min(r["x_torch"] for r in sel)
            lines.append(
                f"| {fmt} | {rng} | {_geomean([r['x_bf16'] for r in sel]):.2f} | "
                f"{_geomean([r['x_torch'] for r in sel]):.2f} | {_geomean([r['x_bf16_q'] for r in sel]):.2f} | "
                f"{_geomean([r['pct_roof'] for r in sel]):.0f} | {worst:.2f} |"
            )
    noise = max((r["bf16_noise"] for r in rows if "bf16_noise" in r), default=float("nan"))
    lines += ["", f"Noise: largest |bf16 - bf16#2| / bf16 over the run: {100 * noise:.1f}%"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=list(MS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--ms", default=None, help="override the suite's M list, e.g. 1,16")
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--screen-reps", type=int, default=8)
    ap.add_argument("--workers", type=int, default=16, help="precompile processes (0: compile on first call)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ceil = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; ceilings: {ceil.describe()}")
    blockwise_note = blockwise.cuda_support(dev.index).describe()
    print(blockwise_note)
    shapes, sources = suite_shapes(find_models_dir(args.models_dir), SUITE)
    print("shapes from:", ", ".join(sources))
    ms = [int(v) for v in args.ms.split(",")] if args.ms else MS[args.suite]
    if args.workers:
        precompile(args.formats.split(","), shapes, ms, dev, args.workers)
    rows, t0 = [], time.time()
    for fmt in args.formats.split(","):
        for i, (label, layer, n, k) in enumerate(shapes):
            for m in ms:
                r = bench_point(fmt, label, layer, m, n, k, dev, ceil, args, seed=1000 * i + m)
                rows.append(r)
                if "error" not in r:
                    print(
                        f"{fmt:9s} {label:16s} {layer:8s} M={m:5d} bf16 {r['bf16']:7.1f} torch {r['torch']:7.1f} "
                        f"tuned {r['tuned']:7.1f} ({r['x_bf16']:.2f}x bf16, {r['x_torch']:.2f}x torch, "
                        f"{r['pct_roof']:.0f}% roof) {r['tuned_kernel']}  [{time.time() - t0:.0f}s]",
                        flush=True,
                    )
    text = summarize(rows, args.suite) + f"\n\n{blockwise_note}"
    print(text)
    stem = out / f"quant_{args.suite}"
    stem.with_suffix(".md").write_text(text + "\n")
    stem.with_suffix(".json").write_text(
        json.dumps({"device": torch.cuda.get_device_name(dev), "ceilings": ceil.__dict__, "rows": rows}, indent=1)
    )
    cols = sorted({c for r in rows for c in r}, key=lambda c: list(rows[0]).index(c) if c in rows[0] else 99)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
