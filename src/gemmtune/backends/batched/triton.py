"""The batched family's `triton` backend: explicit Triton batched-GEMM configs (tiles, split-K) per shape.

A solution's kernel_name is the config string (`bmm_bm64_bn128_bk64_g8_w4_s4_sk1`, see
kernels/batched_gemm.py), so a table row means the same kernel after a restart. The config space is
lib/triton_tiles.py's tile lists and pruning (the a16w16 Triton backend's) (tiles that fit shared memory and are not far
taller than M; blocks wider than N or deeper than K narrowed to fit) with split-K counted over all
B x tiles programs: a split is offered only when the batches' tiles together leave most SMs idle
(DeepSeek MLA at tp 8: 16 heads x one or two tiles). `make_runner` binds the config to the key's
shape and compiles it before returning (on small stand-in tensors that Triton specializes like the
real ones), so a runner can be captured in a CUDA graph at once; `precompile` does that for many
(config, key) pairs in parallel processes.
"""

from __future__ import annotations

import torch

from ...device import Needs
from ...families.batched import BatchedKey
from ...kernels.batched_gemm import MAX_GRID_YZ, BmmConfig, BmmKernel, parse_config
from ..base import Backend, Runner, Solution
from ..lib.triton_tiles import (
    SMEM_MARGIN,
    SPLITS,
    Hardware,
    cdiv,
    compile_in_workers,
    config_solution,
    fits,
    hardware,
    next_pow2,
    solution_from_name,
    split_factors,
    tiles_for,
    twin,
)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SPLIT_MODES = ("f", "r")  # in-kernel fixup (one launch), partials + reduce kernel (two)
STREAM_MAX_M = 64  # up to this M a GEMM streams its weights (the a16w16 backend's stream tiles)


def config_space(key: BatchedKey, hw: Hardware) -> list[BmmConfig]:
    """The configs worth timing for `key` on hardware `hw` (see the module docstring for the pruning)."""
    out: list[BmmConfig] = []
    # Blocks wider than N or deeper than K (short per-head GEMMs) are narrowed rather than dropped.
    n_cap, k_cap = max(32, next_pow2(key.N)), max(32, next_pow2(key.K))
    tiles = dict.fromkeys((bm, min(bn, n_cap), min(bk, k_cap), w, s) for bm, bn, bk, w, s in tiles_for(key))
    for bm, bn, bk, warps, stages in tiles:
        base = BmmConfig(bm, bn, bk, 8, warps, stages)
        if not fits(base, key, hw):
            continue
        programs = key.B * cdiv(key.M, bm) * cdiv(key.N, bn)
        k_tiles = cdiv(key.K, bk)
        out.append(base)
        for split in split_factors(programs, k_tiles, hw.sms):
            out += [BmmConfig(bm, bn, bk, 8, warps, stages, split, mode) for mode in SPLIT_MODES]
        wave = _wave_split(programs, k_tiles, hw.sms) if key.M <= STREAM_MAX_M else None
        if wave:
            out.append(BmmConfig(bm, bn, bk, 8, warps, stages, wave, "f"))
    return out


def _wave_split(programs: int, k_tiles: int, sms: int) -> int | None:
    """For a weight-streaming grid of one to three waves (aiter's B=16 N=1280 K=8192 at small M: 320
    tiles on 132 SMs), the smallest split giving >= 4 waves of programs, so the last partial wave
    costs less; each split keeps >= 4 K tiles. One-launch fixup only."""
    if not sms <= programs < 3 * sms:
        return None
    return next((s for s in SPLITS if k_tiles // s >= 4 and programs * s >= 4 * sms), None)


def key_ok(key: BatchedKey) -> bool:
    return key.dtype in DTYPES and key.outdtype in DTYPES and 1 <= key.B <= MAX_GRID_YZ


class TritonBatchedBackend(Backend):
    name = "triton"
    family = "batched"

    needs = Needs(triton=True)

    def candidates(self, key: BatchedKey, device: torch.device) -> list[Solution]:
        if not key_ok(key):
            return []
        return [config_solution(cfg) for cfg in config_space(key, hardware(device))]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return solution_from_name(parse_config, kernel_name, solidx)

    def supports(self, solution: Solution, key: BatchedKey, device: torch.device) -> bool:
        cfg = parse_config(solution.kernel_name)
        if cfg is None or solution.libtype != self.name or not key_ok(key):
            return False
        return cfg.smem_bytes(key.dtype.itemsize) + SMEM_MARGIN <= hardware(device).smem

    def make_runner(self, solution: Solution, key: BatchedKey, device: torch.device) -> Runner:
        cfg = parse_config(solution.kernel_name)
        if cfg is None or not self.supports(solution, key, device):
            raise ValueError(f"triton cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
        run_kernel = BmmKernel(cfg, key.B, key.M, key.N, key.K, key.outdtype, device).run
        shape_a, shape_b, dtype = (key.B, key.M, key.K), (key.B, key.K, key.N), key.dtype

        def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            if a.shape != shape_a or b.shape != shape_b or a.dtype != dtype or b.dtype != dtype:
                raise ValueError(
                    f"triton batched runner for {key.describe()} got a {tuple(a.shape)} {a.dtype}, "
                    f"b {tuple(b.shape)} {b.dtype} (needs a{shape_a}, b{shape_b} {dtype})"
                )
            return run_kernel(a, b)

        warmup(cfg, key, device)
        return run


# ---- compiling ahead of the first call ----------------------------------------------------------
def _twin_stride(v: int) -> int:
    """A stride Triton specializes like v (0, 1, a multiple of 16, or none of these), kept small."""
    return v if v <= 1 else (16 if v % 16 == 0 else 17)


def stored_strides(key: BatchedKey) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Strides of the logical a (B, M, K), b (B, K, N) and c (B, M, N) views in the key's stored layouts."""
    M, N, K = key.M, key.N, key.K
    a = (M * K, 1, M) if key.transA else (M * K, K, 1)
    b = (K * N, 1, K) if key.transB else (K * N, N, 1)
    return a, b, (M * N, N, 1)


def _stand_in(shape, strides, dtype, device) -> torch.Tensor:
    # Elements may overlap (strides shrunk to their twins): stand-ins are only read, or written once.
    size = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return torch.zeros(size, dtype=dtype, device=device).as_strided(shape, strides)


def compile_signature(cfg: BmmConfig, key: BatchedKey) -> tuple:
    """What decides which compiled kernel a (config, key) launch uses: the launch constants and how
    Triton specializes N, K and the strides (M, B and the split factor are not specialized on)."""
    sa, sb, sc = (tuple(_twin_stride(s) for s in st) for st in stored_strides(key))
    split = BmmConfig(cfg.bm, cfg.bn, cfg.bk, cfg.group_m, cfg.warps, cfg.stages,
                      min(cfg.split_k, 2), cfg.sk_mode)  # fmt: skip
    return (split.name, key.dtype, key.outdtype, twin(key.N), twin(key.K), key.K % cfg.bk, sa, sb, sc)


def warmup(cfg: BmmConfig, key: BatchedKey, device: torch.device) -> None:
    """Compile `cfg` for `key` now: one launch on one small batch whose strides specialize like the
    key's stored layouts. Skipped while a CUDA graph is being captured (the launch would be recorded)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    m = min(max(key.M, 1), 16)
    sa, sb, sc = (tuple(_twin_stride(s) for s in st) for st in stored_strides(key))
    a = _stand_in((1, m, key.K), sa, key.dtype, device)
    b = _stand_in((1, key.K, key.N), sb, key.dtype, device)
    c = _stand_in((1, m, key.N), sc, key.outdtype, device)
    BmmKernel(cfg, 1, m, key.N, key.K, key.outdtype, device).launch(a, b, c)


def compile_items(jobs: list[tuple[Solution, BatchedKey]], scope=None) -> list[tuple[str, BatchedKey]]:
    """The (kernel name, key) pairs whose runners compile every kernel the (solution, key) jobs need,
    one per distinct compiled kernel."""
    uniq: dict[tuple, tuple[str, BatchedKey]] = {}
    for sol, key in jobs:
        cfg = parse_config(sol.kernel_name)
        if cfg is not None:
            uniq.setdefault(compile_signature(cfg, key), (cfg.name, key))
    return list(uniq.values())


def precompile(jobs: list[tuple[Solution, BatchedKey]], device: torch.device, workers: int = 8,
               share: tuple[int, int] = (0, 1)) -> list:  # fmt: skip
    """Compile many (solution, key) pairs in `workers` processes; they fill Triton's on-disk cache, so
    this process then loads each kernel instead of compiling it. Returns [(name, key, error)] failures."""
    return compile_in_workers(TritonBatchedBackend, compile_items(jobs), device, workers, share)


BACKENDS = (TritonBatchedBackend(),)
