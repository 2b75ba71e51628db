"""The a16w16 `triton` backend: explicit Triton GEMM configs (tiles, split-K, persistent grid, TMA) per shape.

A solution's kernel_name is the config string (`tg_bm128_bn128_bk64_g8_w8_s4_sk1`, see
kernels/triton_gemm.py), so a table row means the same kernel after a restart. The candidate space is
pruned per shape (lib/triton_tiles.py): configs whose buffers cannot fit shared memory, whose tile is
far taller than M, or that would leave most SMs idle are not offered (and so never compiled).
`make_runner` compiles the config before returning (on tiny stand-in tensors with the same
specialization), so a runner can be captured in a CUDA graph at once; `precompile` does that for many
configs in parallel processes.
"""

from __future__ import annotations

import torch

from ...device import Needs
from ...kernels.triton_gemm import TGConfig, TGKernel, check_operands, parse_config
from ...keys import GemmKey
from ..base import Backend, Runner, Solution
from ..lib.triton_tiles import (
    DTYPES,
    compile_in_workers,
    config_solution,
    config_space,
    hardware,
    runs_here,
    solution_from_name,
    tile_kernel,
    twin,
)


class TritonGemmBackend(Backend):
    name = "triton"
    needs = Needs(triton=True)

    def candidates(self, key: GemmKey, device: torch.device) -> list[Solution]:
        if not self.key_ok(key):
            return []
        return [config_solution(cfg) for cfg in config_space(key, hardware(device))]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return solution_from_name(parse_config, kernel_name, solidx)

    @staticmethod
    def key_ok(key: GemmKey) -> bool:
        return not key.scaleAB and not key.bpreshuffle and key.dtype in DTYPES and key.outdtype in DTYPES

    def supports(self, solution: Solution, key: GemmKey, device: torch.device) -> bool:
        cfg = parse_config(solution.kernel_name)
        if cfg is None or solution.libtype != self.name or not self.key_ok(key):
            return False
        return runs_here(cfg, key, hardware(device))

    def make_runner(self, solution: Solution, key: GemmKey, device: torch.device) -> Runner:
        kern = tile_kernel(self, solution, key, device)
        N, K, out_dtype = key.N, key.K, key.outdtype

        def run(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            x2 = x if x.dim() == 2 else x.reshape(-1, K)
            if x2.shape[1] != K or w.shape[0] != N or x.dtype != w.dtype:
                check_operands(x, w, bias)
                raise ValueError(f"triton runner for N={N} K={K} got x {tuple(x.shape)}, w {tuple(w.shape)}")
            y = torch.empty((x2.shape[0], N), dtype=out_dtype, device=x.device)
            kern(x2, w, bias, y)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], N)

        self.warmup(kern, key, device)
        return run

    @staticmethod
    def warmup(kern: TGKernel, key: GemmKey, device: torch.device) -> None:
        """Compile `kern` for `key` now: one launch on stand-in tensors that specialize like the real ones.

        Skipped while a CUDA graph is being captured (a launch there would be recorded)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        M, N = twin(max(key.M, 1)), twin(key.N)
        x = torch.randn(M, key.K, device=device).to(key.dtype)
        w = torch.randn(N, key.K, device=device).to(key.dtype)
        b = torch.randn(N, device=device).to(key.dtype) if key.bias else None
        kern(x, w, b, torch.empty((M, N), dtype=key.outdtype, device=device))


def compile_items(jobs: list[tuple[Solution, GemmKey]], scope=None) -> list[tuple[str, GemmKey]]:
    """The (kernel name, key) pairs whose runners compile every kernel the (solution, key) jobs need:
    one per distinct compiled kernel (M does not specialize, N and K only through these facts)."""
    uniq: dict[tuple, tuple[str, GemmKey]] = {}
    for sol, key in jobs:
        cfg = parse_config(sol.kernel_name)
        if cfg is None:
            continue
        kernel = TGConfig(**{**cfg.__dict__, "split_k": min(cfg.split_k, 2)}).name  # split is runtime
        sig = (kernel, key.dtype, key.outdtype, key.bias, twin(key.N), key.K % 16 == 0, key.K % cfg.bk)
        uniq.setdefault(sig, (cfg.name, key._replace(M=16)))
    return list(uniq.values())


def precompile(jobs: list[tuple[Solution, GemmKey]], device: torch.device, workers: int = 8,
               share: tuple[int, int] = (0, 1)) -> list:  # fmt: skip
    """Compile many (solution, key) pairs in `workers` processes; they fill Triton's on-disk cache, so
    this process then loads each kernel instead of compiling it. Returns [(name, key, error)] failures."""
    return compile_in_workers(TritonGemmBackend, compile_items(jobs), device, workers, share)


BACKENDS = (TritonGemmBackend(),)
