"""Online tuning in the background, as a server meets it: how long the first call of a missing key takes
(the default serves it; no stall), how long until its row is in the table file, and that the next call
runs the row. Under torchrun (one rank per GPU, NCCL) every rank calls the same GEMMs, a first key is
met inside a CUDA graph capture, rows are adopted at gemmtune.sync_online_rows(), and the run prints
each rank's rows and how many collectives were issued while a graph was being captured (must be 0).

    python benchmarks/bench_online.py --table /tmp/online.csv
    torchrun --nproc-per-node 2 benchmarks/bench_online.py --table /tmp/online.csv
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import gemmtune
from gemmtune.configs import read_table_file
from gemmtune.keys import GemmKey


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--table", required=True, help="online table to write (removed first)")
    ap.add_argument("--shape", default="4096x4096", help="N x K of the GEMM (bf16)")
    ap.add_argument("--ms", default="7,13,48", help="the missing Ms, one after another")
    ap.add_argument("--budget", type=float, default=20.0, help="GEMMTUNE_TUNE_ONLINE_BUDGET per key")
    args = ap.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        torch.distributed.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    rank = torch.distributed.get_rank() if distributed else 0
    table = f"{args.table}.rank{rank}.csv" if distributed else args.table
    if os.path.exists(table):
        os.remove(table)
    in_capture = []
    if distributed:  # count the collectives online tuning issues while a graph is being captured
        gather = torch.distributed.all_gather_object

        def counted(*a, **kw):
            in_capture.append(torch.cuda.is_current_stream_capturing())
            return gather(*a, **kw)

        torch.distributed.all_gather_object = counted
    tuner = gemmtune.set_online_tuning(table, budget_s=args.budget)
    n, k = (int(v) for v in args.shape.split("x"))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.nn.functional.linear(x[:, :-1], w[:, :-1])  # the CUDA library start-up any first GEMM pays
    torch.cuda.synchronize()
    print(f"rank {rank}: first F.linear of the process: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    gemmtune.gemm(x, w)  # the process's first miss: also starts the tuner's thread and worker
    torch.cuda.synchronize()
    print(f"rank {rank}: first call of the process (M=1, a miss): {(time.perf_counter() - t0) * 1e3:.1f} ms")
    if distributed:  # a key met first inside a capture: the default is recorded, the key is queued
        stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        x = torch.randn(3, k, device="cuda", dtype=torch.bfloat16)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            gemmtune.gemm(x, w)
        graph.replay()
    ms = [int(m) for m in args.ms.split(",")]
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gemmtune.gemm(x, w)
        torch.cuda.synchronize()
        print(f"rank {rank}: first call of M={m}: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    t0 = time.perf_counter()
    if distributed:
        gemmtune.sync_online_rows()  # the misses are shared; the first rank tunes them
    tuner.wait()
    if distributed:
        torch.distributed.barrier()
        gemmtune.sync_online_rows()  # every rank adopts the rows at once
    print(f"rank {rank}: all rows tuned {time.perf_counter() - t0:.1f}s after the last miss")
    for m in [1, *ms] + ([3] if distributed else []):
        gemmtune.gemm(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w)
        row = gemmtune.resolve(GemmKey(m, n, k, False, torch.bfloat16, torch.bfloat16), "cuda").row
        print(f"rank {rank}: M={m} runs {row.libtype}:{row.kernel_name} ({row.us:.2f} us)" if row else "no row")
    if os.path.exists(table):
        print(f"rank {rank}: {len(read_table_file(table).rows)} rows in {table}")
    if distributed:
        print(f"rank {rank}: collectives during a graph capture: {sum(in_capture)} of {len(in_capture)}")
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
