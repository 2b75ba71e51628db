"""Experiment: the MLA latent decode kernel's tiles (kernels/mla_decode.py), DeepSeek-V3 decode shapes (issue 29).

128 heads, latent 512, rope 64, one query token, 1040 cached keys (a 1024-token context in a static cache,
boolean mask), batch 1 and 8, bf16. Each setting of the module's ROWS (rows of a program), BLOCK_S (keys
per block), MAX_SPLITS (splits of the keys, merged by the last program) and NUM_WARPS is captured in a
CUDA graph of 20 calls; the graphs are replayed interleaved (gemmtune.tuner.timing.time_graphs), median
us per call. The first row is the module's setting.

    PYTHONPATH=src python benchmarks/experiments/exp_mla_decode_tiles.py
"""

from __future__ import annotations

import itertools

import torch

from gemmtune.kernels import mla_decode as kmla
from gemmtune.kernels.launch import Plans
from gemmtune.tuner.timing import time_graphs

H, R, DR, S = 128, 512, 64, 1040
SETTINGS = [(kmla.ROWS, kmla.BLOCK_S, kmla.MAX_SPLITS, kmla.NUM_WARPS)] + list(
    itertools.product((16, 32, 64), (32, 64), (2, 4, 8, 16), (4, 8))
)


def inputs(batch: int, g: torch.Generator):
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(batch, 1, H, 128 + DR, device=dev, generator=g).to(dt).transpose(1, 2)
    q_lat = torch.randn(batch, H, 1, R, device=dev, generator=g).to(dt)
    latent = torch.randn(batch, S, R, device=dev, generator=g).to(dt)
    k_rot = torch.randn(batch, S, DR, device=dev, generator=g).to(dt)
    mask = torch.ones(batch, 1, 1, S, dtype=torch.bool, device=dev)
    mask[..., 1030:] = False
    return q_lat, q[..., 128:], latent, k_rot, mask


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch in (1, 8):
        args = inputs(batch, g)
        ref = kmla.mla_decode_ref(*args, 0.1)
        calls = {}
        for rows, block_s, splits, warps in dict.fromkeys(SETTINGS):
            counters = torch.zeros(batch * H, dtype=torch.int32, device="cuda")

            def call(rows=rows, block_s=block_s, splits=splits, warps=warps, counters=counters, args=args):
                kmla.ROWS, kmla.BLOCK_S, kmla.MAX_SPLITS, kmla.NUM_WARPS = rows, block_s, splits, warps
                kmla._PLANS = Plans()
                return kmla.mla_decode(*args, 0.1, counters)

            try:
                err = (call().float() - ref.float()).abs().max().item()
            except Exception as exc:  # noqa: BLE001 - a setting that does not compile (registers, shared memory)
                print(f"b={batch} rows {rows} block_s {block_s} splits {splits} warps {warps}: {type(exc).__name__}")
                continue
            if err > 2e-2:
                print(f"b={batch} rows {rows} block_s {block_s} splits {splits} warps {warps}: error {err:.2e}")
                continue
            calls[(rows, block_s, splits, warps)] = call
        ms = time_graphs({str(k): v for k, v in calls.items()}, reps=20, calls_per_graph=1)
        for name, t in sorted(ms.items(), key=lambda kv: kv[1])[:12]:
            print(f"b={batch} (rows, block_s, splits, warps) {name}: {t * 1e3:6.1f} us")
        print(f"b={batch} module setting {SETTINGS[0]}: {ms[str(SETTINGS[0])] * 1e3:6.1f} us")


if __name__ == "__main__":
    main()
