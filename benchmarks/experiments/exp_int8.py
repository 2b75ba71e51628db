"""Why int8 loses on the H100: the Triton a8w8 kernel on int8 (does it compile, is it right, how fast)
against torch._int_mm and bf16 F.linear, at a few shapes and tile configs, one interleaved run each.

    python benchmarks/experiments/exp_int8.py
"""

from __future__ import annotations

import traceback

import torch
import torch.nn.functional as F

from gemmtune.kernels.a8w8 import TileConfig, a8w8_ref, gemm_a8w8_triton
from gemmtune.tuner.timing import time_graphs

CONFIGS = [TileConfig("a8w8", 128, 256, 128, 8, 1, 8, 3), TileConfig("a8w8", 128, 128, 128, 8, 1, 4, 4),
           TileConfig("a8w8", 64, 128, 128, 8, 1, 4, 4), TileConfig("a8w8", 16, 64, 256, 8, 1, 4, 4)]  # fmt: skip


def main() -> None:
    for m, n, k in [(16, 6144, 4096), (1024, 6144, 4096), (4096, 4096, 4096)]:
        bench_shape(m, n, k)


def bench_shape(m: int, n: int, k: int) -> None:
    xq = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
    xs = torch.rand(m, 1, device="cuda") * 0.01
    ws = torch.rand(1, n, device="cuda") * 0.01
    ref = a8w8_ref(xq, wq, xs, ws)
    calls = {}
    for cfg in CONFIGS:
        try:
            y = gemm_a8w8_triton(xq, wq, xs, ws, cfg=cfg)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            print(f"M={m} {cfg.name}: ok, rel err {err:.2e}", flush=True)
            calls[cfg.name] = lambda cfg=cfg: gemm_a8w8_triton(xq, wq, xs, ws, cfg=cfg)
        except Exception as exc:  # noqa: BLE001
            cause = f"{type(exc.__cause__).__name__}: {exc.__cause__}" if exc.__cause__ else ""
            print(f"M={m} {cfg.name}: FAILED: {type(exc).__name__} {cause[:800]}", flush=True)
            if m == 16:
                print(traceback.format_exc()[-800:], flush=True)
    xb, wb = xq.bfloat16(), wq.bfloat16()
    calls["bf16_linear"] = lambda: F.linear(xb, wb)
    if m > 16:
        calls["int_mm"] = lambda: torch._int_mm(xq, wq.t())
    ms = time_graphs(calls, reps=20)
    for name, t in ms.items():
        print(f"M={m} N={n} K={k} {name:40s} {t * 1e3:9.1f} us  {2 * m * n * k / t / 1e9:7.0f} TOPS", flush=True)
    if m == 1024:
        cfg = CONFIGS[1]
        from gemmtune.kernels import a8w8 as mod

        try:
            ker = mod._a8w8_kernel
            cache = ker.device_caches[0][0] if hasattr(ker, "device_caches") else {}
            for _, c in list(cache.items())[:1]:
                ttgir = c.asm.get("ttgir", "")
                print("wgmma in ttgir:", "warp_group_dot" in ttgir or "wgmma" in ttgir, "|",
                      [ln.strip()[:160] for ln in ttgir.splitlines() if "dot" in ln][:4])  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            print("could not inspect the compiled kernel:", exc, cfg.name)


if __name__ == "__main__":
    main()
