"""Host and GPU microseconds per eager call of `gemm_a8w8`, untuned and with a tuned table, on one GPU.

Per key and table: `host` is the Python-side time of 50 calls queued behind a long GPU sleep (the GPU never
waits on the host, so this is what the host pays per launch); `back-to-back` is CUDA-event time of 50 calls
in a row (the GPU's time when the host keeps up); `synced` the median of 20 single calls each between two
synchronizes (what a step that syncs pays: host and GPU in series). Eager calls, no CUDA graph.

    python benchmarks/bench_eager_host.py TUNED.csv --nk 6144x4096,4096x4096,28672x4096,4096x14336 --m 2048
"""

from __future__ import annotations

import argparse
import time

import torch

import gemmtune
from gemmtune.families import get
from gemmtune.families.quantized import QuantKey
from gemmtune.ops.quantized import gemm_a8w8

SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU sleep: longer than queueing the host-timed calls


def per_call(op, args: tuple, calls: int = 50) -> tuple[float, float, float]:
    def call():
        return op(*args)

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) / calls * 1e3
    synced = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e6)
    return host, gpu, sorted(synced)[len(synced) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", help="a tuned a8w8 table")
    ap.add_argument("--nk", default="6144x4096,4096x4096,28672x4096,4096x14336", help="NxK list")
    ap.add_argument("--m", type=int, default=2048)
    args = ap.parse_args()
    fam, device = get("a8w8"), torch.device("cuda")
    for nk in args.nk.split(","):
        n, k = (int(v) for v in nk.split("x"))
        key = QuantKey(args.m, n, k, torch.float8_e4m3fn, "per_token", False, torch.bfloat16)
        xq, wq, xs, ws, _ = fam.make_inputs(key, device, 1, 0)[0]
        for table in (None, args.table):
            gemmtune.set_config(table)
            sol = gemmtune.resolve(key, device, family="a8w8").solution
            host, gpu, synced = per_call(gemm_a8w8, (xq, wq, xs, ws, None, torch.bfloat16))
            print(f"M={args.m} N={n} K={k} {'table' if table else 'none '}: host {host:7.1f} us/call, "
                  f"back-to-back {gpu:7.1f} us/call, synced call {synced:7.1f} us  "
                  f"[{sol.libtype}:{sol.kernel_name}]", flush=True)  # fmt: skip
    gemmtune.set_config(None)


if __name__ == "__main__":
    main()
