"""Is eager prefill host-bound? For stock, optimize() and optimize(quantize="fp8") of a 4-layer model
(random weights, 1x2048): the host time to issue one forward (no sync inside) against its wall time and
against the GPU's busy time (the sum of its kernels' durations, torch.profiler), then torch.profiler's
host-side table of the fp8 model's forwards.

    python benchmarks/experiments/exp_host_overhead.py llama-3-8b [--table a8w8.csv:lm_head.csv] [--cprofile]

--cprofile adds a cProfile of 5 forwards of the fp8 model (Python functions by own time).
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gemmtune.models import optimize
from gemmtune.profiling.build import build_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="llama-3-8b")
    ap.add_argument("--table", default=None, help="tuned table(s) for optimize(), ':'-joined")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile 5 forwards of the fp8 model")
    a = ap.parse_args()
    dev = torch.device("cuda")
    stock, _ = build_model(a.model, 4, dev, torch.bfloat16, 0)
    opt = copy.deepcopy(stock)
    optimize(opt, config=a.table)
    q = copy.deepcopy(stock)
    optimize(q, config=a.table, quantize="fp8")
    ids = torch.randint(0, stock.config.vocab_size, (1, 2048), device=dev)
    for label, m in (("stock", stock), ("optimize", opt), ("quantize=fp8", q)):
        host, wall = [], []
        with torch.no_grad():
            for _ in range(3):
                m(input_ids=ids, use_cache=False, logits_to_keep=1)
            for _ in range(7):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                m(input_ids=ids, use_cache=False, logits_to_keep=1)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append(t1 - t0)
                wall.append(time.perf_counter() - t0)
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                m(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.device_time for e in kernels) / 3 / 1e3
        print(
            f"{label}: host issue {statistics.median(host) * 1e3:.2f} ms, wall {statistics.median(wall) * 1e3:.2f} ms, "
            f"GPU busy {busy:.2f} ms ({len(kernels) / 3:.0f} kernels a forward)"
        )
        per_kernel = collections.Counter()
        for e in kernels:
            per_kernel[e.name[:70]] += e.device_time / 3 / 1e3
        for kname, ms in per_kernel.most_common(6):
            print(f"    {ms:.3f} ms  {kname}")
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            q(input_ids=ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if a.cprofile:
        pr = cProfile.Profile()
        with torch.no_grad():
            pr.enable()
            for _ in range(5):
                q(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize()
            pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


if __name__ == "__main__":
    main()
