"""Experiment: stage 2 and the combine in one launch at decode (a `moe2_token_...` config: a program per
(token, N tile) walks the token's experts, kernels/fused_moe.py moe_down_by_token) against the default
pair, issue 29's fine-grained decode roofs.

Per point (H, I, E, top-k, T): real top-k routing over 8 rotating input sets, CUDA-graph replays
(gemmtune.tuner.timing.time_graphs). Timed: the untuned default pair; its stage 1 alone; the default
stage 1 (or --stage1-config) with each by-token stage 2 (BLOCK_N 16/32/64, BLOCK_K 128/256, 3/4 pipeline
stages, each token's experts split 1/2/4 ways; or the --configs given). With --pdl-past-limit, past
PDL_MAX_SLOTS all of them again with PDL launches. "% roof" is bench_moe's: the bytes of the experts hit
and the activations over the measured read bandwidth (or the FLOPs over the bf16 ceiling, whichever is
longer). A pair more than 2e-2 from the fp32 reference is dropped. --stage1: stage 1 alone over tiles,
warps and splits over H instead.

    PYTHONPATH=src python benchmarks/experiments/exp_moe_by_token.py 2048,384,128,8,1 7168,256,256,8,4
    PYTHONPATH=src python benchmarks/experiments/exp_moe_by_token.py --stage1 2048,384,128,8,4
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch

from gemmtune.backends.fmoe import stages
from gemmtune.backends.fmoe.stages import pair_runner, stage_runner
from gemmtune.backends.fmoe.triton import heuristic_configs
from gemmtune.families import fmoe
from gemmtune.kernels.fused_moe import MoeGemmConfig
from gemmtune.tuner.timing import measure_ceilings, time_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: bench_moe
from bench_moe import expert_inputs  # noqa: E402

SETS = 8
PDL_PAST_LIMIT = False
STAGE1 = None  # a stage-1 config name in place of the default's (--stage1-config)
CONFIGS: list[str] = []  # by-token configs to time instead of the sweep (--configs)


def token_configs() -> list[MoeGemmConfig]:
    if CONFIGS:
        return [MoeGemmConfig.parse(n) for n in CONFIGS]
    return [MoeGemmConfig(2, True, 16, bn, bk, sk, 4, st, by_token=True)
            for bn, bk, st, sk in itertools.product((16, 32, 64), (128, 256), (3, 4), (1, 2, 4))]  # fmt: skip


def run_point(H: int, I: int, E: int, topk: int, T: int, ceilings, device) -> None:  # noqa: E741
    dt = torch.bfloat16
    key = fmoe.MoeKey(T, H, I, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    ins = expert_inputs(key, SETS, torch.Generator(device=device).manual_seed(T))
    hit_bytes = sum(fmoe.bytes_hit(key, i[4]) for i in ins) / SETS
    roof = max(fmoe.FAMILY.flops(key) / ceilings.flops, hit_bytes / ceilings.read_bw) * 1e6
    h1, h2 = heuristic_configs(key)
    if STAGE1:
        h1 = MoeGemmConfig.parse(STAGE1)
    ref = fmoe.FAMILY.reference(key, ins[0])
    runs = {"default": pair_runner(key, h1, h2)}
    for c in token_configs():
        runs[c.name] = pair_runner(key, h1, c)
    ok = {}
    with torch.no_grad():
        for n, run in runs.items():
            try:
                y = run(*ins[0]).float()
            except Exception as exc:  # noqa: BLE001 - a config past the shared memory: skip it
                print(f"  {n}: {type(exc).__name__}, dropped")
                continue
            err = ((y - ref).norm() / ref.norm()).item()
            if err < 2e-2:
                ok[n] = lambda i, run=run: run(*ins[i])
            else:
                print(f"  {n}: rel err {err:.2e}, dropped")
        s1 = stage_runner(key, 1, h1)
        ok["stage 1 alone"] = lambda i: s1(*ins[i])
        t = time_graphs({n: (lambda r=r: [r(i) for i in range(SETS)]) for n, r in ok.items()}, reps=20,
                        calls_per_graph=SETS)  # fmt: skip
        if key.slots > stages.PDL_MAX_SLOTS and PDL_PAST_LIMIT:  # the same with PDL past its slot limit
            saved = stages.PDL_MAX_SLOTS
            stages.PDL_MAX_SLOTS = 1 << 20
            try:
                tp = time_graphs({f"{n} +pdl": (lambda r=r: [r(i) for i in range(SETS)]) for n, r in ok.items()},
                                 reps=20, calls_per_graph=SETS)  # fmt: skip
            finally:
                stages.PDL_MAX_SLOTS = saved
            t.update(tp)
    us = {n: v * 1e3 for n, v in t.items()}
    print(
        f"== E{E} I{I} H{H} top{topk} T{T}: roof {roof:.1f} us; default {h1.name}|{h2.name} "
        f"{us['default']:.1f} us ({100 * roof / us['default']:.0f}%); stage 1 alone {us['stage 1 alone']:.1f}"
    )
    for n in ("default +pdl", "stage 1 alone +pdl"):
        if n in us:
            print(f"  {n} {us[n]:.1f} us ({100 * roof / us[n]:.0f}%)")
    best = sorted((n for n in us if n.startswith("moe2_token")), key=us.get)
    for n in best[:8]:
        print(f"  {h1.name}|{n} {us[n]:.1f} us ({100 * roof / us[n]:.0f}%)")
    print(f"  worst token config {best[-1]} {us[best[-1]]:.1f} us", flush=True)


def stage1_sweep(H: int, I: int, E: int, topk: int, T: int, ceilings, device) -> None:  # noqa: E741
    """Stage 1 alone over tiles and splits over H (no split limit), against the default's."""
    dt = torch.bfloat16
    key = fmoe.MoeKey(T, H, I, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    ins = expert_inputs(key, SETS, torch.Generator(device=device).manual_seed(T))
    hit = sum(i[4].unique().numel() for i in ins) / SETS
    roof1 = hit * 2 * I * H * dt.itemsize / ceilings.read_bw * 1e6
    h1, _ = heuristic_configs(key)
    cfgs = {h1.name: h1}
    for bn, bk, st, sk, w in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 5), (1, 2), (4, 8)):
        c = MoeGemmConfig(1, True, 16, bn, bk, sk, w, st)
        cfgs.setdefault(c.name, c)
    runs = {}
    with torch.no_grad():
        for n, c in cfgs.items():
            run = stage_runner(key, 1, c)
            try:
                run(*ins[0])
            except Exception as exc:  # noqa: BLE001
                print(f"  {n}: {type(exc).__name__}, dropped")
                continue
            runs[n] = lambda i, run=run: run(*ins[i])
        t = time_graphs({n: (lambda r=r: [r(i) for i in range(SETS)]) for n, r in runs.items()}, reps=20,
                        calls_per_graph=SETS)  # fmt: skip
    us = {n: v * 1e3 for n, v in t.items()}
    print(
        f"== stage 1 alone E{E} I{I} H{H} top{topk} T{T}: roof {roof1:.1f} us; default {h1.name} "
        f"{us[h1.name]:.1f} us ({100 * roof1 / us[h1.name]:.0f}%)"
    )
    for n in sorted(us, key=us.get)[:8]:
        print(f"  {n} {us[n]:.1f} us ({100 * roof1 / us[n]:.0f}%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", help="H,I,E,topk,T")
    ap.add_argument("--stage1", action="store_true", help="sweep stage 1 alone instead")
    ap.add_argument("--stage1-config", default=None, help="pair the stage-2 configs with this stage 1")
    ap.add_argument("--pdl-past-limit", action="store_true", help="also time every pair with PDL at any slots")
    ap.add_argument("--configs", default="", help="comma list of by-token stage-2 configs to time instead")
    args = ap.parse_args()
    global STAGE1, PDL_PAST_LIMIT, CONFIGS
    STAGE1, PDL_PAST_LIMIT = args.stage1_config, args.pdl_past_limit
    CONFIGS = [n for n in args.configs.split(",") if n]
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    print(f"read bandwidth {ceilings.read_bw / 1e12:.2f} TB/s")
    for p in args.points:
        H, I, E, topk, T = (int(v) for v in p.split(","))  # noqa: E741
        (stage1_sweep if args.stage1 else run_point)(H, I, E, topk, T, ceilings, device)


if __name__ == "__main__":
    main()
