"""The epilogue family's `triton` backend: the Triton GEMM (kernels/triton_gemm.py) with the epilogue
(alpha, beta * C, bias, activation) applied in registers before the one store; the a16w16 Triton
backend's config space and names (lib/triton_tiles.py), so one config string means one tile either way.
"""

from __future__ import annotations

import torch

from ...device import Needs
from ...families import get as family
from ...families.epilogue import EpilogueKey
from ...kernels.triton_gemm import parse_config
from ...keys import GemmKey
from ..base import Backend, Runner, Solution
from ..lib.triton_tiles import (
    DTYPES,
    config_solution,
    config_space,
    hardware,
    runs_here,
    solution_from_name,
    tile_kernel,
)


def gemm_key(key: EpilogueKey) -> GemmKey:
    """The a16w16 key with the same GEMM (the Triton config space and compile facts are shared)."""
    return GemmKey(key.M, key.N, key.K, key.bias, key.dtype, key.outdtype)


class TritonEpilogueBackend(Backend):
    name = "triton"
    family = "epilogue"
    needs = Needs(triton=True)

    @staticmethod
    def key_ok(key: EpilogueKey) -> bool:
        return key.dtype in DTYPES and key.outdtype in DTYPES

    def candidates(self, key: EpilogueKey, device: torch.device) -> list[Solution]:
        if not self.key_ok(key):
            return []
        sols = (config_solution(cfg) for cfg in config_space(gemm_key(key), hardware(device)))
        return [s for s in sols if self.supports(s, key, device)]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return solution_from_name(parse_config, kernel_name, solidx)

    def supports(self, solution: Solution, key: EpilogueKey, device: torch.device) -> bool:
        cfg = parse_config(solution.kernel_name)
        if cfg is None or solution.libtype != self.name or not self.key_ok(key):
            return False
        # TMA descriptors need the weight's K stride to be 1: not a [K, N]-stored weight.
        if key.w_layout == "kn" and cfg.tma:
            return False
        return runs_here(cfg, gemm_key(key), hardware(device))

    def make_runner(self, solution: Solution, key: EpilogueKey, device: torch.device) -> Runner:
        kern = tile_kernel(self, solution, key, device)
        N, K, out_dtype, act = key.N, key.K, key.outdtype, key.act

        def run(x, w, bias, c, alpha, beta):
            if x.shape[1] != K or w.shape[0] != N:
                raise ValueError(f"triton epilogue runner for N={N} K={K} got x {tuple(x.shape)}, w {tuple(w.shape)}")
            y = torch.empty((x.shape[0], N), dtype=out_dtype, device=x.device)
            return kern(x, w, bias, y, c, alpha, beta, act)

        self.warmup(kern, key, device)
        return run

    @staticmethod
    def warmup(kern, key: EpilogueKey, device: torch.device) -> None:
        """Compile now (stand-in tensors that specialize like the real ones), not inside a graph capture."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        small = key._replace(M=min(key.M, 16))
        x, w, b, c, alpha, beta = family("epilogue").make_inputs(small, device, 1, 0)[0]
        y = torch.empty((small.M, key.N), dtype=key.outdtype, device=device)
        kern(x, w, b, y, c, alpha, beta, key.act)


BACKENDS = (TritonEpilogueBackend(),)
