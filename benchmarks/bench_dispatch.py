"""Eager CPU dispatch overhead of gemmtune.gemm over F.linear (docs/benchmarking.md rule 4: reported apart).

The GPU work is kept tiny (M=1, 256x256) so each call's wall time is CPU dispatch; both calls are
timed interleaved in one process, after warm-up; per case the median and the minimum of the repeats
(the minimum is the cost with the least host noise on top: compare two trees by it). Run:

    python benchmarks/bench_dispatch.py [--calls 20000] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import gemmtune


def per_call_us(fn, calls: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def main(calls: int = 20000, repeats: int = 15) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(1, 256, device=dev, dtype=dtype)
    w = torch.randn(256, 256, device=dev, dtype=dtype)
    b = torch.randn(256, device=dev, dtype=dtype)
    cases = {
        "F.linear": lambda: F.linear(x, w),
        "gemmtune.gemm": lambda: gemmtune.gemm(x, w),
        "F.linear+bias": lambda: F.linear(x, w, b),
        "gemmtune.gemm+bias": lambda: gemmtune.gemm(x, w, b),
        "torch.ops.gemmtune.gemm": lambda: torch.ops.gemmtune.gemm(x, w, None, None),
    }
    with torch.inference_mode():
        for fn in cases.values():
            per_call_us(fn, 1000)
        samples = {k: [] for k in cases}
        for _ in range(repeats):
            for k, fn in cases.items():
                samples[k].append(per_call_us(fn, calls // repeats))
    med = {k: statistics.median(v) for k, v in samples.items()}
    low = {k: min(v) for k, v in samples.items()}
    spread = {k: (max(v) - min(v)) for k, v in samples.items()}
    print(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}, torch {torch.__version__}")
    print(f"{'call':<26}{'median':>9}{'min':>9}{'spread':>9}{'over F.linear (median, min)':>30}")
    for k in cases:
        base = "F.linear+bias" if "bias" in k else "F.linear"
        over = f"{med[k] - med[base]:+15.2f}{low[k] - low[base]:+15.2f}"
        print(f"{k:<26}{med[k]:9.2f}{low[k]:9.2f}{spread[k]:9.2f}{over}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per case over all repeats")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    main(args.calls, args.repeats)
