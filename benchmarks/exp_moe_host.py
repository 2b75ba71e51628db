"""Host time of a 4-layer Qwen3-30B-A3B prefill (2048 tokens): stock vs optimize() with the default
dispatch and with a tuned fmoe table, plus a cProfile of optimize()'s forward. This prefill is
host-bound: its wall time follows the Python time per forward, not the GPU's.

    python benchmarks/exp_moe_host.py TUNED_FMOE.csv   # H100 log: benchmarks/results/h100/moe/e2e_tuned/
"""

from __future__ import annotations

import copy
import cProfile
import io
import pstats
import sys
import time

import torch

import gemmtune
from gemmtune.profiling.build import build_model


def forward(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1).logits


def host_and_wall(name: str, model, ids, reps: int = 7) -> None:
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
    print(f"{name}: host ms {sorted(host)[reps // 2]:.2f}, wall ms {sorted(wall)[reps // 2]:.2f}", flush=True)


def main() -> None:
    stock, _ = build_model("qwen3-30b-a3b", 4, "cuda", torch.bfloat16)
    opt = copy.deepcopy(stock)
    gemmtune.optimize(opt)
    ids = torch.randint(0, stock.config.vocab_size, (1, 2048), device="cuda")
    host_and_wall("stock", stock, ids)
    host_and_wall("optimize default", opt, ids)
    prof = cProfile.Profile()
    prof.enable()
    forward(opt, ids)
    torch.cuda.synchronize()
    prof.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(order).print_stats(30)
        print(out.getvalue()[:6000])
    if len(sys.argv) > 1:
        gemmtune.set_config(sys.argv[1])  # clears the runner caches: the table's solutions run from here
        host_and_wall("optimize tuned table", opt, ids)


if __name__ == "__main__":
    main()
