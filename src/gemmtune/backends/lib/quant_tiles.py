"""The Triton 8-bit tile configs offered per key (kernels/a8w8.py, kernels/blockscale.py).

Small M (decode, M <= 32) is a weight stream: 16/32-row tiles, K split so that the N tiles times the
splits come close to one wave over the SMs (the skinny kernels' rule, lib/skinny.py). Larger M
takes the usual compute tiles (64-256 x 64-256, 128-deep K steps, which are 128 bytes of fp8/int8),
split only when the output tiles alone leave most SMs idle. Block-scale tiles step K by 64 or 128 so
one step never straddles a 128-wide scale group.
"""

from __future__ import annotations

import torch
import triton

from ...device import facts
from ...kernels.a8w8 import TileConfig

_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# (block_m, block_n, block_k, num_warps, num_stages)
_SMALL = ((16, 64, 256, 4, 4), (16, 128, 128, 4, 4), (16, 64, 128, 4, 5), (32, 64, 256, 4, 4),
          (32, 128, 128, 4, 4), (16, 128, 256, 4, 3))  # fmt: skip
_MID = ((64, 64, 128, 4, 4), (64, 128, 128, 4, 4), (64, 256, 128, 8, 3), (32, 128, 128, 4, 4),
        (128, 64, 128, 4, 4), (128, 128, 128, 8, 3))  # fmt: skip
# Deeper pipelines and 256-deep K steps were offered here too and won nothing (int8 at M >= 1024 stayed
# at 1.43x over bf16, H100): the 8-bit TMA GEMM (quantized/triton_tg.py) is what lifted it.
_LARGE = ((128, 128, 128, 8, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3),
          (64, 256, 128, 8, 3), (128, 64, 128, 4, 4), (64, 128, 128, 4, 4))  # fmt: skip
# Block-scale tiles scale each K step's partial product in registers, so the MMA waits on it every
# step; the winners measured on an H100 at M >= 1024 were the 64x128 4-warp tiles, which leave room
# for 2-3 programs an SM to overlap one another's scaling (fewer stages, more programs).
_LARGE_BLOCK = _LARGE + ((64, 128, 128, 4, 3), (64, 128, 128, 4, 5), (128, 64, 128, 4, 3), (64, 64, 128, 4, 3))
SMEM = 227 * 1024


def _pick_split(tiles: int, k_iters: int, slots: int) -> int:
    best, best_waves = 1, tiles / slots
    for sk in _SPLITS[1:]:
        per = triton.cdiv(k_iters, sk)
        if triton.cdiv(k_iters, per) != sk or per < 2:
            continue
        waves = tiles * sk / slots
        if best_waves < waves <= 1.05:
            best, best_waves = sk, waves
    return best


def tile_split(bm: int, bn: int, bk: int, key, sms: int) -> int:
    """The K split of a bm x bn x bk tile for `key` on `sms` SMs: where its output tiles leave most SMs
    idle (or at decode sizes), the split that comes closest to one wave; else 1."""
    n_tiles = triton.cdiv(key.M, bm) * triton.cdiv(key.N, bn)
    # Small tiles fit 2 programs an SM; half a wave of output tiles is enough to stay unsplit.
    slots = sms * (2 if bm * bn <= 64 * 128 else 1)
    return _pick_split(n_tiles, triton.cdiv(key.K, bk), slots) if n_tiles < slots // 2 or key.M <= 32 else 1


def tile_configs(kind: str, key, device: torch.device) -> list[TileConfig]:
    sms = facts(device).sms
    large = _LARGE_BLOCK if kind == "blockscale" else _LARGE
    tiles = _SMALL if key.M <= 32 else _MID if key.M <= 256 else large
    out = []
    for bm, bn, bk, w, s in tiles:
        if kind == "blockscale":
            bk = min(bk, 128)
        if (bm + bn) * bk * s > SMEM:
            continue
        sk = tile_split(bm, bn, bk, key, sms)
        group = 8 if key.M > 32 else 1
        for split in dict.fromkeys((sk, 1)):
            out.append(TileConfig(kind, bm, bn, bk, group, split, w, s))
    return list(dict.fromkeys(out))


# The tiles an untuned key runs above M = 32 (the measured H100 winners at M >= 1024); decode keys
# take the first small tile with its split. On CUDA GPUs these now serve only what the better defaults
# leave (quantized/policy.py): int8 at 16 < M <= 32, fp8 keys cuBLASLt cannot run
# (fp32 / fp16 out with per-token scales, K or N % 16 != 0), and the block-scale family.
_DEFAULT_LARGE = {"a8w8": (128, 256, 128, 8, 3), "blockscale": (64, 128, 128, 4, 4)}
_DEFAULT_MID = (64, 128, 128, 4, 4)


def default_config(kind: str, key, device: torch.device) -> TileConfig | None:
    """The heuristic config for a key nobody tuned (the Triton backend's default_solution)."""
    cfgs = tile_configs(kind, key, device)
    if not cfgs:
        return None
    if key.M > 32:
        want = _DEFAULT_LARGE[kind] if key.M > 256 else _DEFAULT_MID
        for c in cfgs:
            if (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages) == want and c.split_k == 1:
                return c
    return cfgs[0]
