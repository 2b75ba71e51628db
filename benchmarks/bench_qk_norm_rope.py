"""q_norm + k_norm + rope in one Triton launch vs today's three (rmsnorm q, rmsnorm k, rope).

1. Kernel time, CUDA graphs (docs/benchmarking.md): Qwen3 attention shapes (Hq 32, Hkv 4 / 8, D 128,
   bf16), q/k read in place from a fused qkv output; R rotating input sets exceeding 2x L2, one graph of
   R calls per contender, contenders replayed interleaved, median of 30 rounds.
2. Eager host time of a 4-layer Qwen3-30B-A3B prefill (1 x 2048 tokens, random weights): optimize() with
   the fused kernel vs optimize() with it turned off, interleaved rounds; "host" is the time until
   Python returns, "wall" until the GPU is done (this prefill is host-bound). Eager figures.

    python benchmarks/bench_qk_norm_rope.py | tee qk_norm_rope.txt
"""

from __future__ import annotations

import copy
import math
import statistics
import time

import torch

import gemmtune
from gemmtune.device import facts
from gemmtune.kernels.norms import rmsnorm
from gemmtune.kernels.qk_norm_rope import qk_norm_rope
from gemmtune.kernels.rope import rope
from gemmtune.models import dense
from gemmtune.profiling.build import build_model
from gemmtune.tuner.timing import time_graphs

EPS = 1e-6


def log(*a):
    print(*a, flush=True)


def kernel_sets(tokens: int, hq: int, hkv: int, d: int, dev, l2: int):
    """Input sets (q, k views of a qkv output, cos, sin, wq, wk), enough to exceed 2x L2."""
    per_set = tokens * (hq + 2 * hkv) * d * 2
    n = min(64, max(2, math.ceil(2 * l2 / per_set) + 1))
    g = torch.Generator(device=dev).manual_seed(tokens * 131 + hkv)
    sets = []
    for _ in range(n):
        qkv = torch.randn(1, tokens, (hq + 2 * hkv) * d, device=dev, generator=g).bfloat16()
        q = qkv[..., : hq * d].view(1, tokens, hq, d)
        k = qkv[..., hq * d : (hq + hkv) * d].view(1, tokens, hkv, d)
        cos, sin = (torch.randn(1, tokens, d, device=dev, generator=g).bfloat16() for _ in "cs")
        wq, wk = (torch.randn(d, device=dev, generator=g).bfloat16() * 0.1 + 1 for _ in "qk")
        sets.append((q, k, cos, sin, wq, wk))
    return sets


def bench_kernels(dev) -> None:
    l2 = facts(dev).l2_bytes
    log("## kernel time, CUDA graphs (us per call; unfused = rmsnorm q + rmsnorm k + rope)")
    log("| Hq | Hkv | tokens | fused us | unfused us | unfused / fused |")
    log("|---|---|---|---|---|---|")
    for hkv in (4, 8):
        for tokens in (1, 8, 128, 2048, 8192):
            sets = kernel_sets(tokens, 32, hkv, 128, dev, l2)

            def fused(sets=sets):
                for q, k, cos, sin, wq, wk in sets:
                    qk_norm_rope(q, k, wq, wk, cos, sin, EPS, EPS)

            def unfused(sets=sets):
                for q, k, cos, sin, wq, wk in sets:
                    rope(rmsnorm(q, wq, EPS), rmsnorm(k, wk, EPS), cos, sin)

            t = time_graphs({"fused": fused, "unfused": unfused}, reps=30, calls_per_graph=len(sets))
            f, u = t["fused"] * 1e3, t["unfused"] * 1e3
            log(f"| 32 | {hkv} | {tokens} | {f:.2f} | {u:.2f} | {u / f:.2f} |")


def forward(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1).logits


def bench_model(dev, reps: int = 9) -> None:
    base, _ = build_model("qwen3-30b-a3b", 4, dev, torch.bfloat16)
    unfused = copy.deepcopy(base)
    fused = base
    rep = gemmtune.optimize(fused)
    assert "q_norm/k_norm + rope in one kernel" in rep.summary(), rep.summary()
    saved = dense._qk_norms_fusable
    dense._qk_norms_fusable = lambda *a: None
    try:
        gemmtune.optimize(unfused)
    finally:
        dense._qk_norms_fusable = saved
    ids = torch.randint(0, base.config.vocab_size, (1, 2048), device=dev)
    models = {"fused": fused, "unfused": unfused}
    outs = {n: forward(m, ids).float() for n, m in models.items()}
    diff = (outs["fused"] - outs["unfused"]).abs().max().item()
    for m in models.values():
        for _ in range(3):
            forward(m, ids)
    torch.cuda.synchronize()
    host = {n: [] for n in models}
    wall = {n: [] for n in models}
    for r in range(reps):
        names = list(models)[r % 2 :] + list(models)[: r % 2]
        for n in names:
            t = time.perf_counter()
            forward(models[n], ids)
            host[n].append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            wall[n].append((time.perf_counter() - t) * 1e3)
    log("\n## 4-layer Qwen3-30B-A3B prefill 1 x 2048, eager (ms, median of interleaved rounds)")
    log(f"max |logits fused - unfused| = {diff:.3g}")
    log("| contender | host ms | wall ms |")
    log("|---|---|---|")
    for n in models:
        log(f"| {n} | {statistics.median(host[n]):.2f} | {statistics.median(wall[n]):.2f} |")


def main() -> None:
    dev = torch.device("cuda")
    log(f"# qk_norm_rope on {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    bench_kernels(dev)
    bench_model(dev)


if __name__ == "__main__":
    main()
