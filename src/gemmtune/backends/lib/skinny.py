"""Skinny (small-M, decode-time) Triton GEMM machinery shared by the a16w16 and 8-bit skinny backends:
the tile lists, shared-memory and occupancy estimates, the one-wave split-K rule and the configs
offered for a shape (kernels/skinny.py's SkinnyConfig).

Measured on an H100 and an H200 (benchmarks/results/h100/skinny_vs_cublas_decode/, and h200/): the
winners were whole-K or lightly split tiles of 64 rows, with the grid at most one wave; 2 partial waves
or a stream-K split lost 10-25%. PDL variants gain when the kernel before the GEMM triggers its
dependents early.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import triton

from ...device import facts
from ...kernels import skinny as ks
from ...kernels._common import pdl_enabled
from ...kernels.skinny import REDUCE_FIXUP, REDUCE_NONE, SkinnyConfig
from ...keys import GemmKey
from .triton_tiles import twin

# A runner computes any M, but past this it is not a skinny GEMM any more (the weight would be
# streamed once per 64-row tile): the runners hand such calls to torch.
MAX_ROWS = 256
SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)

# Tensor-core tiles (block_n, block_k, num_warps, num_stages). Measured on an H100 and an H200
# (benchmarks/results/h100/skinny_vs_cublas_decode/, and h200/): the winners were whole-K or lightly
# split tiles of 64 rows, with the grid at most one wave; 2 partial waves or a stream-K split lost 10-25%.
DOT_TILES = (
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 4, 3),  # +2% over the rest on 4096x4096 at M 4-16 (experiments/exp_skinny_splits.py --families tiles)
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 256, 4, 4),
    (64, 256, 8, 3),
    (128, 128, 4, 3),
)
# CUDA-core tiles (block_n, block_k, num_warps), for M <= 4; 8 rows x 512 won most M=1 shapes.
GEMV_TILES = ((8, 512, 4), (8, 1024, 4), (16, 512, 8), (16, 256, 4))
# Programmatic-dependent-launch variants offered per config (1 or 2 weight tiles prefetched into L2
# before waiting): on an H100 these won 25 of 36 decode cases, by up to 1.2x on 16-25 MB weights
# (benchmarks/experiments/exp_pdl.py), when the kernel before them triggers early.
PDL_VARIANTS = (2, 3)


def device_limits(device: torch.device) -> tuple[int, int, int]:
    """(SM count, shared memory per block, shared memory per SM) in bytes (device.facts)."""
    f = facts(device)
    return f.sms, f.smem_per_block, f.smem_per_sm


def smem_bytes(cfg: SkinnyConfig, elem: int) -> int:
    """Shared memory of a tile, as Triton 3.6 allocated it on sm90: num_stages buffers of the w and
    x tiles on the wgmma path (block_n >= 64), num_stages - 1 on the mma path."""
    if not cfg.uses_dot:
        return 8 * 1024
    bufs = cfg.num_stages if cfg.block_n >= 64 else max(1, cfg.num_stages - 1)
    return bufs * (cfg.block_n + 16) * cfg.block_k * elem


def ctas_per_sm(cfg: SkinnyConfig, elem: int, smem_sm: int, m: int) -> int:
    if not cfg.uses_dot:  # register-bound: the fp32 accumulator holds BLOCK_M*BLOCK_N*BLOCK_K values
        return {1: 4, 2: 3}.get(cfg.block_m(m), 2)
    return max(1, min(4, smem_sm // (smem_bytes(cfg, elem) + 1024)))


def pick_split(n_tiles: int, k_iters: int, slots: int) -> int:
    """The split-K factor whose grid comes closest to one full wave of `slots` programs without
    passing it (a second, partial wave costs a pipeline refill); 1 when the N tiles alone fill it."""
    best, best_waves = 1, n_tiles / slots
    for sk in SPLITS[1:]:
        per = triton.cdiv(k_iters, sk)
        if triton.cdiv(k_iters, per) != sk or per < 2:
            continue  # a split without work, or too little work per split to pipeline
        waves = n_tiles * sk / slots
        if best_waves < waves <= 1.02:
            best, best_waves = sk, waves
    return best


class Shape(NamedTuple):
    """What the config choice reads of a key: the GEMM's M, N, K and the operands' element size."""

    M: int
    N: int
    K: int
    elem: int

    @classmethod
    def of(cls, key: GemmKey) -> Shape:
        return cls(key.M, key.N, key.K, key.dtype.itemsize)


def tile_config(kind: str, bn: int, bk: int, w: int, s: int, shape: Shape, sms: int, smem_sm: int):
    probe = SkinnyConfig(kind, bn, bk, 1, w, s)
    slots = sms * ctas_per_sm(probe, shape.elem, smem_sm, shape.M)
    sk = pick_split(triton.cdiv(shape.N, bn), triton.cdiv(shape.K, bk), slots)
    return SkinnyConfig(kind, bn, bk, sk, w, s, REDUCE_FIXUP if sk > 1 else REDUCE_NONE)


def tile_configs(shape: Shape, device: torch.device, dot_tiles=DOT_TILES, gemv_tiles=GEMV_TILES,
                 reduce_kernel: bool = True) -> list[SkinnyConfig]:  # fmt: skip
    """The configs offered for `shape`: each tile that fits the shared memory, split to fill one wave
    (and, with `reduce_kernel`, its partials + reduce-kernel twin), plus the PDL variants on sm90+."""
    sms, smem, smem_sm = device_limits(device)
    tiles = [("dot", bn, bk, w, s) for bn, bk, w, s in dot_tiles]
    if shape.M <= ks.GEMV_MAX_ROWS:
        bm = SkinnyConfig("gemv", 8, 16).block_m(shape.M)
        # At most 128 fp32 accumulator registers a thread (more spills: seen with 8x1024 at M=4).
        tiles += [("gemv", bn, bk, w, 1) for bn, bk, w in gemv_tiles if bm * bn * bk <= 128 * 32 * w]
    out = []
    for kind, bn, bk, w, s in tiles:
        if smem_bytes(SkinnyConfig(kind, bn, bk, 1, w, s), shape.elem) <= smem:
            cfg = tile_config(kind, bn, bk, w, s, shape, sms, smem_sm)
            out.append(cfg)
            if reduce_kernel and cfg.uses_dot and cfg.split_k > 1:  # measured within 2% of the fix-up
                out.append(dataclasses.replace(cfg, reduce=ks.REDUCE_KERNEL))
    if pdl_enabled(device):
        out += [dataclasses.replace(c, pdl=p) for c in out if c.reduce != ks.REDUCE_KERNEL for p in PDL_VARIANTS]
    return list(dict.fromkeys(out))


def _int_facts(v: int) -> tuple[bool, bool]:
    return v == 1, v % 16 == 0  # what Triton specializes an int argument on


def plan_signature(kernel_name: str, cfg: SkinnyConfig, key) -> tuple:
    """What the binary a skinny runner builds for `key` depends on: the config, the key's dtypes and
    flags, and its sizes only through the launch plan (rows per program, whole or split K, K's tail)
    and the int facts Triton specializes (M, K, the iterations per split; N as twin(N))."""
    m, n, k = key.M, key.N, key.K
    split, per = cfg.effective_split(k)
    sizes = (cfg.block_m(m), _int_facts(m), twin(n), _int_facts(k), k % cfg.block_k == 0, split > 1, _int_facts(per))
    return kernel_name, key._replace(M=0, N=0, K=0), sizes


def compile_items(jobs: list, scope=None, parse=SkinnyConfig.parse) -> list[tuple[str, tuple]]:
    """One (kernel name, key) per distinct binary the (solution, key) jobs' runners build (`parse`: the
    backend's kernel-name parser): many keys share a binary, and each is compiled by one process."""
    uniq: dict[tuple, tuple[str, tuple]] = {}
    for sol, key in jobs:
        cfg = parse(sol.kernel_name)
        if cfg is not None:
            uniq.setdefault(plan_signature(sol.kernel_name, cfg, key), (sol.kernel_name, key))
    return list(uniq.values())
