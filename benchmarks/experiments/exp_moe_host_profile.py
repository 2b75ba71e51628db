"""Where the host time of a 4-layer Qwen3-30B-A3B prefill (2048 tokens) goes: stock vs optimize() (with a
tuned fmoe table), each also with its MoE blocks replaced by identity (the rest of the model's host
time), then per Python function (cProfile, us) and per aten op (torch.profiler, CPU us) of one forward.
Prefill runs eagerly, so host time per forward bounds its wall time.

    python benchmarks/experiments/exp_moe_host_profile.py TUNED_FMOE.csv
"""

from __future__ import annotations

import copy
import cProfile
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

import gemmtune
from gemmtune.profiling.build import build_model


def forward(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1).logits


def host_and_wall(name: str, model, ids, reps: int = 9) -> None:
    """Median ms until Python returns (host) and until the GPU is done (wall)."""
    for _ in range(3):
        forward(model, ids)
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(reps):
        t = time.perf_counter()
        forward(model, ids)
        host.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t) * 1e3)
    print(f"{name}: host ms {sorted(host)[reps // 2]:.3f}, wall ms {sorted(wall)[reps // 2]:.3f}", flush=True)


def without_moe(model):
    """A copy whose MoE blocks return their input: what the rest of the model costs."""
    out = copy.deepcopy(model)
    for layer in out.model.layers:
        layer.mlp.forward = lambda h: h
    return out


def _where(file: str, line: int) -> str:
    return f"{file.split('site-packages/')[-1].split('/src/')[-1]}:{line}"


def function_table(model, ids, rows: int = 45) -> None:
    forward(model, ids)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    forward(model, ids)
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, self s, cum s, callers)
    total = sum(v[2] for v in stats.values())
    print(f"cProfile total self time {total * 1e3:.2f} ms, {sum(v[1] for v in stats.values())} calls")
    for (file, line, fn), (_, calls, self_s, cum_s, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]:
        print(f"  {self_s * 1e6:8.0f} us self {cum_s * 1e6:8.0f} us cum {calls:5d} calls  {fn}  {_where(file, line)}")
    print("by cumulative:")
    for (file, line, fn), (_, calls, _, cum_s, _) in sorted(stats.items(), key=lambda kv: -kv[1][3])[:rows]:
        print(f"  {cum_s * 1e6:8.0f} us cum {calls:5d} calls  {fn}  {_where(file, line)}")


def op_table(model, ids) -> None:
    forward(model, ids)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward(model, ids)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60))


def main() -> None:
    stock, _ = build_model("qwen3-30b-a3b", 4, "cuda", torch.bfloat16)
    opt = copy.deepcopy(stock)
    gemmtune.optimize(opt)
    if len(sys.argv) > 1:
        gemmtune.set_config(sys.argv[1])
    ids = torch.randint(0, stock.config.vocab_size, (1, 2048), device="cuda")
    host_and_wall("stock", stock, ids)
    host_and_wall("optimize", opt, ids)
    host_and_wall("optimize, MoE blocks = identity", without_moe(opt), ids)
    host_and_wall("stock, MoE blocks = identity", without_moe(stock), ids)
    for name, model in (("optimize", opt), ("stock", stock)):
        print(f"==== {name}")
        function_table(model, ids)
        op_table(model, ids)


if __name__ == "__main__":
    main()
