"""Experiment: what limits fused_moe at fine-grained decode? Each direct stage alone over a range of
configs, then the best stage-1 / stage-2 configs as pairs, against the untuned default (issue 29).

Per point (H, I, E, top-k, T): real top-k routing over 8 rotating input sets, CUDA-graph replays
(gemmtune.tuner.timing.time_graphs). Stage 1 (gate+up, activation) is timed alone on the inputs;
stage 2 alone on the default stage 1's rows (its figure includes the combine kernel); "% roof" is each
stage's bytes of the experts hit over the read bandwidth measured in the run. Stage-1 configs: BLOCK_N
32/64/128, BLOCK_K 64/128, split over H 1..16 (1..4 above 16 slots), 3/4 pipeline stages; stage 2: BLOCK_N
32..256, BLOCK_K 32..128, split 1/2, 3/4 stages. The best three of each stage form the pairs; a pair
whose output is more than 2e-2 from the fp32 reference is dropped (and printed).

    PYTHONPATH=src python benchmarks/experiments/exp_moe_fine_stages.py 2048,384,128,8,1 7168,256,256,8,4
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import time

import torch

from gemmtune.backends.fmoe.stages import pair_runner, stage_runner
from gemmtune.backends.fmoe.triton import heuristic_configs
from gemmtune.families import fmoe
from gemmtune.kernels.fused_moe import MoeGemmConfig
from gemmtune.tuner.timing import measure_ceilings, time_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: bench_moe
from bench_moe import expert_inputs  # noqa: E402

SETS = 8


def stage_configs(T: int, topk: int) -> tuple[list[MoeGemmConfig], list[MoeGemmConfig]]:
    splits = (1, 2, 4, 8, 16) if T * topk <= 16 else (1, 2, 4)
    s1 = [MoeGemmConfig(1, True, 16, bn, bk, sk, 4, st)
          for bn, bk, sk, st in itertools.product((32, 64, 128), (64, 128), splits, (3, 4))]  # fmt: skip
    s2 = [MoeGemmConfig(2, True, 16, bn, bk, sk, 4, st)
          for bn, bk, sk, st in itertools.product((32, 64, 128, 256), (32, 64, 128), (1, 2), (3, 4))]  # fmt: skip
    return s1, s2


def run_point(H: int, I: int, E: int, topk: int, T: int, read_bw: float, device) -> None:  # noqa: E741
    t0 = time.time()
    dt = torch.bfloat16
    key = fmoe.MoeKey(T, H, I, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    ins = expert_inputs(key, SETS, torch.Generator(device=device).manual_seed(T))
    hit = sum(i[4].unique().numel() for i in ins) / SETS
    b1, b2 = hit * 2 * I * H * dt.itemsize, hit * H * I * dt.itemsize
    h1, h2 = heuristic_configs(key)
    rows = [stage_runner(key, 1, h1)(*i).slot_order() for i in ins]
    s1s, s2s = stage_configs(T, topk)

    def graphs(runs: dict) -> dict:
        return {n: (lambda r=r: [r(i) for i in range(SETS)]) for n, r in runs.items()}

    r1 = {c.name: (lambda i, run=stage_runner(key, 1, c): run(*ins[i])) for c in s1s}
    r2 = {c.name: (lambda i, run=stage_runner(key, 2, c): run(rows[i], *ins[i])) for c in s2s}
    with torch.no_grad():
        t1 = time_graphs(graphs(r1), reps=10, calls_per_graph=SETS)
        t2 = time_graphs(graphs(r2), reps=10, calls_per_graph=SETS)
    us = lambda ms: ms * 1e3  # noqa: E731
    pct = lambda nbytes, ms: f"{100 * nbytes / read_bw / (ms * 1e-3):.0f}%"  # noqa: E731
    print(f"== E{E} I{I} H{H} top{topk} T{T}: experts hit {hit:.1f}; roof {1e6 * (b1 + b2) / read_bw:.1f} us "
          f"(stage 1 {1e6 * b1 / read_bw:.1f}, stage 2 {1e6 * b2 / read_bw:.1f})")  # fmt: skip
    print(f"  default stage 1 {h1.name} {us(t1.get(h1.name, float('nan'))):.1f} us; "
          f"stage 2 {h2.name} {us(t2.get(h2.name, float('nan'))):.1f} us")  # fmt: skip
    top1 = sorted(t1, key=t1.get)[:3]
    top2 = sorted(t2, key=t2.get)[:3]
    for n in top1:
        print(f"  stage 1 {n} {us(t1[n]):.1f} us {pct(b1, t1[n])}")
    for n in top2:
        print(f"  stage 2 {n} {us(t2[n]):.1f} us {pct(b2, t2[n])}")
    ref = fmoe.FAMILY.reference(key, ins[0])
    pairs = {"default": pair_runner(key, h1, h2)}
    for a, b in itertools.product(top1, top2):
        pairs[f"{a}|{b}"] = pair_runner(key, MoeGemmConfig.parse(a), MoeGemmConfig.parse(b))
    ok = {}
    for n, run in pairs.items():
        y = run(*ins[0]).float()
        err = ((y - ref).norm() / ref.norm()).item()
        if err < 2e-2:
            ok[n] = lambda i, run=run: run(*ins[i])
        else:
            print(f"  pair {n}: rel err {err:.2e}, dropped")
    with torch.no_grad():
        tp = time_graphs(graphs(ok), reps=20, calls_per_graph=SETS)
    for n in [*sorted(tp, key=tp.get)[:3], "default"]:
        print(f"  pair {n} {us(tp[n]):.1f} us {pct(b1 + b2, tp[n])}")
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", help="H,I,E,topk,T")
    args = ap.parse_args()
    device = torch.device("cuda")
    read_bw = measure_ceilings(device).read_bw
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s")
    for p in args.points:
        H, I, E, topk, T = (int(v) for v in p.split(","))  # noqa: E741
        run_point(H, I, E, topk, T, read_bw, device)


if __name__ == "__main__":
    main()
