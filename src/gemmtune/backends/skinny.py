"""Triton small-M ("skinny", decode-time) GEMMs: the kernel configs of kernels/skinny.py as solutions.

A solution's kernel_name is the config string (skinny_dot_bn64_bk256_sk4_w4_s4_fx) and its solidx
the crc of that string, so a table row means the same kernel after a restart or a change of the
candidate list. The list for a shape is pruned to configs whose grid fills the GPU (split-K chosen
from the SM count and the tile's shared-memory occupancy): 8 tensor-core tiles, each split one also
with a partials + reduce-kernel variant, and up to 4 CUDA-core tiles for M <= 4 (9 to 22 per shape);
on sm90+ CUDA each (but the reduce-kernel ones) also comes as two programmatic-dependent-launch
variants (`_pdl2`, `_pdl3`: see kernels/skinny.py), so 27 to 54 per shape.

PDL variants gain when the kernel before the GEMM triggers its dependents early (gemmtune's own norm,
activation and GEMM kernels do) and lose a little behind one that does not (a torch kernel, SDPA):
measured in benchmarks/results/h100/skinny_vs_cublas_decode/. GEMMTUNE_PDL=0 runs every PDL row as its plain config.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton

from ..device import facts
from ..kernels import skinny as ks
from ..kernels._common import pdl_enabled
from ..kernels.skinny import REDUCE_FIXUP, REDUCE_NONE, SkinnyConfig
from ..keys import GemmKey
from .base import Backend, Runner, Solution, stable_solidx

# Tuned rows are for decode M; a runner still computes any M, but past this it is not a skinny GEMM
# any more (the weight would be streamed once per 64-row tile) and the runner hands it to F.linear.
MAX_ROWS = 256
MAX_TUNE_M = 32  # candidates are offered up to here (measured: skinny lost most shapes at M=64)
_IN_DTYPES = (torch.float16, torch.bfloat16)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)

# Tensor-core tiles (block_n, block_k, num_warps, num_stages). Measured on an H100 and an H200
# (benchmarks/results/h100/skinny_vs_cublas_decode/, and h200/): the winners were whole-K or lightly
# split tiles of 64 rows, with the grid at most one wave; 2 partial waves or a stream-K split lost 10-25%.
_DOT_TILES = (
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
_GEMV_TILES = ((8, 512, 4), (8, 1024, 4), (16, 512, 8), (16, 256, 4))
# Programmatic-dependent-launch variants offered per config (1 or 2 weight tiles prefetched into L2
# before waiting): on an H100 these won 25 of 36 decode cases, by up to 1.2x on 16-25 MB weights
# (benchmarks/experiments/exp_pdl.py), when the kernel before them triggers early.
_PDL_VARIANTS = (2, 3)


def _device_limits(device_type: str, index: int | None) -> tuple[int, int, int]:
    """(SM count, shared memory per block, shared memory per SM) in bytes (device.facts)."""
    f = facts(torch.device(device_type, index) if index is not None else torch.device(device_type))
    return f.sms, f.smem_per_block, f.smem_per_sm


def _smem_bytes(cfg: SkinnyConfig, elem: int) -> int:
    """Shared memory of a tile, as Triton 3.6 allocated it on sm90: num_stages buffers of the w and
    x tiles on the wgmma path (block_n >= 64), num_stages - 1 on the mma path."""
    if not cfg.uses_dot:
        return 8 * 1024
    bufs = cfg.num_stages if cfg.block_n >= 64 else max(1, cfg.num_stages - 1)
    return bufs * (cfg.block_n + 16) * cfg.block_k * elem


def _ctas_per_sm(cfg: SkinnyConfig, elem: int, smem_sm: int, m: int) -> int:
    if not cfg.uses_dot:  # register-bound: the fp32 accumulator holds BLOCK_M*BLOCK_N*BLOCK_K values
        return {1: 4, 2: 3}.get(cfg.block_m(m), 2)
    return max(1, min(4, smem_sm // (_smem_bytes(cfg, elem) + 1024)))


def _pick_split(n_tiles: int, k_iters: int, slots: int) -> int:
    """The split-K factor whose grid comes closest to one full wave of `slots` programs without
    passing it (a second, partial wave costs a pipeline refill); 1 when the N tiles alone fill it."""
    best, best_waves = 1, n_tiles / slots
    for sk in _SPLITS[1:]:
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


def _config(kind: str, bn: int, bk: int, w: int, s: int, shape: Shape, sms: int, smem_sm: int):
    probe = SkinnyConfig(kind, bn, bk, 1, w, s)
    slots = sms * _ctas_per_sm(probe, shape.elem, smem_sm, shape.M)
    sk = _pick_split(triton.cdiv(shape.N, bn), triton.cdiv(shape.K, bk), slots)
    return SkinnyConfig(kind, bn, bk, sk, w, s, REDUCE_FIXUP if sk > 1 else REDUCE_NONE)


def tile_configs(shape: Shape, device: torch.device, dot_tiles=_DOT_TILES, gemv_tiles=_GEMV_TILES,
                 reduce_kernel: bool = True) -> list[SkinnyConfig]:  # fmt: skip
    """The configs offered for `shape`: each tile that fits the shared memory, split to fill one wave
    (and, with `reduce_kernel`, its partials + reduce-kernel twin), plus the PDL variants on sm90+."""
    sms, smem, smem_sm = _device_limits(device.type, device.index)
    tiles = [("dot", bn, bk, w, s) for bn, bk, w, s in dot_tiles]
    if shape.M <= ks.GEMV_MAX_ROWS:
        bm = SkinnyConfig("gemv", 8, 16).block_m(shape.M)
        # At most 128 fp32 accumulator registers a thread (more spills: seen with 8x1024 at M=4).
        tiles += [("gemv", bn, bk, w, 1) for bn, bk, w in gemv_tiles if bm * bn * bk <= 128 * 32 * w]
    out = []
    for kind, bn, bk, w, s in tiles:
        if _smem_bytes(SkinnyConfig(kind, bn, bk, 1, w, s), shape.elem) <= smem:
            cfg = _config(kind, bn, bk, w, s, shape, sms, smem_sm)
            out.append(cfg)
            if reduce_kernel and cfg.uses_dot and cfg.split_k > 1:  # measured within 2% of the fix-up
                out.append(dataclasses.replace(cfg, reduce=ks.REDUCE_KERNEL))
    if pdl_enabled(device):
        out += [dataclasses.replace(c, pdl=p) for c in out if c.reduce != ks.REDUCE_KERNEL for p in _PDL_VARIANTS]
    return list(dict.fromkeys(out))


def _solution(cfg: SkinnyConfig) -> Solution:
    return Solution("skinny", cfg.name, stable_solidx(cfg.name), cfg.split_k)


class SkinnyBackend(Backend):
    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # launch plans are made per M inside the runner

    name = "skinny"

    def is_available(self, device: torch.device) -> bool:
        device = torch.device(device)
        return device.type == "cuda" and torch.cuda.is_available()

    def unavailable_reason(self, device: torch.device) -> str:
        return "" if self.is_available(device) else "skinny (Triton) kernels need a CUDA or ROCm GPU"

    def _key_ok(self, key: GemmKey) -> bool:
        return (
            key.dtype in _IN_DTYPES
            and key.outdtype in _OUT_DTYPES
            and not key.scaleAB
            and not key.bpreshuffle
            and 0 < key.M <= MAX_TUNE_M
            and key.N > 0
            and key.K > 0
            and key.N * key.K < 2**31
        )

    def candidates(self, key: GemmKey, device: torch.device) -> list[Solution]:
        if not self._key_ok(key):
            return []
        return [_solution(c) for c in tile_configs(Shape.of(key), torch.device(device))]

    def default_solution(self, key: GemmKey, device: torch.device) -> Solution | None:
        """The config that won most decode shapes (M <= 16 only): gemv 8x512 at M=1, else the
        64x256 tensor-core tile, each split to fill one wave."""
        if key.M > 16 or not self._key_ok(key):
            return None
        device = torch.device(device)
        sms, smem, smem_sm = _device_limits(device.type, device.index)
        tile = ("gemv", 8, 512, 4, 1) if key.M == 1 else ("dot", 64, 256, 4, 3)
        if _smem_bytes(SkinnyConfig(*tile[:3], 1, *tile[3:]), key.dtype.itemsize) > smem:
            tile = ("dot", 32, 128, 4, 2)  # small shared memory (ROCm LDS, older GPUs)
        return _solution(_config(*tile, Shape.of(key), sms, smem_sm))

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        cfg = SkinnyConfig.parse(kernel_name)
        if cfg is None or cfg.reduce not in (REDUCE_NONE, REDUCE_FIXUP, ks.REDUCE_KERNEL):
            return None
        return _solution(cfg)

    def supports(self, solution: Solution, key: GemmKey, device: torch.device) -> bool:
        if solution.libtype != self.name or not self._key_ok(key):
            return False
        cfg = SkinnyConfig.parse(solution.kernel_name)
        if cfg is None or cfg.reduce == ks.REDUCE_ATOMIC:  # atomics are not deterministic
            return False
        device = torch.device(device)
        _, smem, _ = _device_limits(device.type, device.index)
        return _smem_bytes(cfg, key.dtype.itemsize) <= smem

    compiles_on_first_call = True  # launch plans (and so the kernels) are made on the first call

    def make_runner(self, solution: Solution, key: GemmKey, device: torch.device) -> Runner:
        cfg = SkinnyConfig.parse(solution.kernel_name)
        if cfg is None or not self.supports(solution, key, device):
            raise ValueError(f"skinny: solution {solution.describe()} cannot run {key.describe()} on {device}")
        return _make_runner(cfg, key, torch.device(device))


def _make_runner(cfg: SkinnyConfig, key: GemmKey, device: torch.device) -> Runner:
    if cfg.pdl and not pdl_enabled(device):
        cfg = dataclasses.replace(cfg, pdl=0)  # same kernel, plain launch
    n, k, out_dtype = key.N, key.K, key.outdtype
    # The FIXUP counters live as long as the runner (they are back at 0 after every launch); one
    # runner must therefore not run on two streams at the same time.
    counters = ks.new_counters(cfg, n, MAX_ROWS, device)
    plans: dict[tuple[int, torch.dtype], ks.LaunchPlan] = {}
    launch, make_plan = ks.launch, ks.make_plan

    def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if w.shape != (n, k) or x2.shape[1] != k:
            ks.check_operands(x, w, bias)
            raise ValueError(f"skinny runner for N={n} K={k} called with x {tuple(x.shape)}, w {tuple(w.shape)}")
        if m > MAX_ROWS:
            y = F.linear(x2, w, bias)
            return (y if y.dtype == out_dtype else y.to(out_dtype)).view(*x.shape[:-1], n)
        plan = plans.get((m, x2.dtype))
        if plan is None:
            ks.check_operands(x2, w, bias)
            plan = plans[(m, x2.dtype)] = make_plan(cfg, m, n, k, x2.dtype)
        if w.stride(1) != 1:
            w = w.contiguous()
        y = torch.empty((m, n), dtype=out_dtype, device=x2.device)
        launch(cfg, x2, w, bias, y, counters, plan)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], n)

    return run


def precompile(jobs: list[tuple[Solution, GemmKey]], device: torch.device, workers: int = 8) -> list:
    """Compile every (config, key) in `workers` processes by running each once (skinny kernels
    compile on their first call); they fill Triton's on-disk cache, so the tuner then loads them."""
    from .triton_gemm import compile_in_workers

    uniq = {(sol.kernel_name, key): None for sol, key in jobs}
    return compile_in_workers(SkinnyBackend, list(uniq), device, workers)
