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
The tiles, the split rule and the config lists are lib/skinny.py's (the 8-bit skinny backends share them).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ...device import Needs
from ...kernels import skinny as ks
from ...kernels._common import pdl_enabled
from ...kernels.skinny import REDUCE_FIXUP, REDUCE_NONE, SkinnyConfig
from ...keys import GemmKey
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib.skinny import MAX_ROWS, Shape, compile_items, device_limits, smem_bytes, tile_config, tile_configs
from ..lib.triton_tiles import compile_in_workers

MAX_TUNE_M = 32  # candidates are offered up to here (measured: skinny lost most shapes at M=64)
IN_DTYPES = (torch.float16, torch.bfloat16)
OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _solution(cfg: SkinnyConfig) -> Solution:
    return Solution("skinny", cfg.name, stable_solidx(cfg.name), cfg.split_k)


class SkinnyBackend(Backend):
    """libtype `skinny`: the Triton skinny kernels (a kernel kind of the Triton library, named apart in
    tables since aiter's)."""

    name = "skinny"
    needs = Needs(triton=True)

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # launch plans are made per M inside the runner

    def _key_ok(self, key: GemmKey) -> bool:
        return (
            key.dtype in IN_DTYPES
            and key.outdtype in OUT_DTYPES
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
        sms, smem, smem_sm = device_limits(device)
        tile = ("gemv", 8, 512, 4, 1) if key.M == 1 else ("dot", 64, 256, 4, 3)
        if smem_bytes(SkinnyConfig(*tile[:3], 1, *tile[3:]), key.dtype.itemsize) > smem:
            tile = ("dot", 32, 128, 4, 2)  # small shared memory (ROCm LDS, older GPUs)
        return _solution(tile_config(*tile, Shape.of(key), sms, smem_sm))

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
        _, smem, _ = device_limits(device)
        return smem_bytes(cfg, key.dtype.itemsize) <= smem

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


def precompile(jobs: list[tuple[Solution, GemmKey]], device: torch.device, workers: int = 8,
               share: tuple[int, int] = (0, 1)) -> list:  # fmt: skip
    """Compile every (config, key) in `workers` processes by running each once (skinny kernels
    compile on their first call); they fill Triton's on-disk cache, so the tuner then loads them."""
    return compile_in_workers(SkinnyBackend, compile_items(jobs), device, workers, share)


BACKENDS = (SkinnyBackend(),)
