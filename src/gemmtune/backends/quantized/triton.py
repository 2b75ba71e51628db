"""The `triton` backends of the quantized families (families/quantized.py), each also serving its
*_bpreshuffle twin: kernels/a8w8.py and kernels/blockscale.py tile configs (kernelName = the config
string, solidx its crc; lib/quant_tiles.py lists them per key), and for a8w8 above M = 32 also the
Triton GEMM kernel's 8-bit configs (`a8w8_tg_...`, quantized/triton_tg.py).
"""

from __future__ import annotations

import torch

from ...device import Needs
from ...kernels.a8w8 import TileConfig, a8w8_launch
from ...kernels.blockscale import blockscale_launch
from ...quant import formats
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib import quant_tiles
from ..lib.quant_support import OUT_DTYPES, tensor_core_fp8
from ..lib.triton_tiles import compile_in_workers
from . import triton_tg as tg


class TritonQuantBackend(Backend):
    """The 8-bit tile kernels of one scale scheme (`kind`: a8w8 or blockscale)."""

    name = "triton"
    kind = "a8w8"
    needs = Needs(triton=True)

    def key_ok(self, key) -> bool:
        q_ok = key.q_dtype_w == torch.int8 or tensor_core_fp8(key.q_dtype_w)
        return (q_ok and key.outdtype in OUT_DTYPES and key.N * key.K < 2**31 and key.M * key.N < 2**31
                and key.M > 0)  # fmt: skip

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not (self.is_available(device) and self.key_ok(key)):
            return []
        return [self.solution(c) for c in quant_tiles.tile_configs(self.kind, key, torch.device(device))]

    def default_solution(self, key, device: torch.device) -> Solution | None:
        """The tile kernel's heuristic config for a key nobody tuned (quant_tiles.default_config), or None
        where this backend cannot run the key."""
        if not (self.is_available(device) and self.key_ok(key)):
            return None
        cfg = quant_tiles.default_config(self.kind, key, torch.device(device))
        return None if cfg is None else self.solution(cfg)

    def solution(self, cfg: TileConfig) -> Solution:
        return Solution(self.name, cfg.name, stable_solidx(cfg.name), cfg.split_k)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        cfg = TileConfig.parse(kernel_name)
        return self.solution(cfg) if cfg is not None and cfg.kind == self.kind else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        cfg = TileConfig.parse(solution.kernel_name)
        return cfg is not None and cfg.kind == self.kind and self.is_available(device) and self.key_ok(key)


class TritonA8W8Backend(TritonQuantBackend):
    family = "a8w8"
    kind = "a8w8"

    def candidates(self, key, device: torch.device) -> list[Solution]:
        sols = super().candidates(key, device)
        return (sols + tg.candidates(key, torch.device(device))) if sols else sols

    def default_solution(self, key, device: torch.device) -> Solution | None:
        """int8 from M = 33: the Triton GEMM kernel's 8-bit config that won most prefill points on an H100
        (tg.DEFAULT); else the tile kernel's heuristic config."""
        if key.q_dtype_w == torch.int8 and self.is_available(device) and self.key_ok(key):
            name = tg.default_name(key, torch.device(device))  # None below tg.MIN_M
            if name is not None:
                return tg.solution_from_row(0, name)
        return super().default_solution(key, device)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        if tg.is_tg_name(kernel_name):
            return tg.solution_from_row(solidx, kernel_name)
        return super().solution_from_row(solidx, kernel_name, splitk)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if not tg.is_tg_name(solution.kernel_name):
            return super().supports(solution, key, device)
        ok = self.is_available(device) and self.key_ok(key)
        return ok and tg.supports(solution.kernel_name, key, torch.device(device))

    def compile_items(self, jobs: list, scope=None) -> list[tuple[str, tuple]]:
        """The a8w8_tg_ candidates' kernels to compile ahead (the a8w8_ tiles compile on their first call)."""
        return tg.compile_items(jobs)

    def precompile(self, jobs: list, device: torch.device, workers: int = 8, share: tuple[int, int] = (0, 1)) -> list:
        """Compile the jobs' compile_items in `workers` processes (Triton's on-disk cache then serves them)."""
        return compile_in_workers(type(self), self.compile_items(jobs), device, workers, share)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        if tg.is_tg_name(solution.kernel_name):
            if not self.supports(solution, key, device):
                raise ValueError(f"triton a8w8: {solution.kernel_name} cannot run {key} on {device}")
            return tg.make_runner(solution.kernel_name, key, torch.device(device))
        cfg = TileConfig.parse(solution.kernel_name)
        out = key.outdtype

        def run(xq, wq, xs, ws, bias):
            y = torch.empty((xq.shape[0], wq.shape[0]), device=xq.device, dtype=out)
            return a8w8_launch(cfg, xq, wq, xs, ws, bias, y)

        # Compile now on operands that specialize like the key's (the policy runs these tiles untuned, and a
        # first call may come inside a CUDA-graph capture), unless a graph is being captured.
        if torch.device(device).type == "cuda" and not torch.cuda.is_current_stream_capturing():
            a8w8_launch(cfg, *tg.standins(key, torch.device(device)))
        return run


class TritonA8W8BPreshuffleBackend(TritonA8W8Backend):
    family = "a8w8_bpreshuffle"


class TritonBlockscaleBackend(TritonQuantBackend):
    family = "a8w8_blockscale"
    kind = "blockscale"

    def key_ok(self, key) -> bool:
        return super().key_ok(key) and key.K % formats.BLOCK == 0

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        cfg = TileConfig.parse(solution.kernel_name)
        out = key.outdtype

        def run(xq, wq, xs, ws):
            y = torch.empty((xq.shape[0], wq.shape[0]), device=xq.device, dtype=out)
            return blockscale_launch(cfg, xq, wq, xs, ws, y)

        return run


class TritonBlockscaleBPreshuffleBackend(TritonBlockscaleBackend):
    family = "a8w8_blockscale_bpreshuffle"


BACKENDS = (
    TritonA8W8Backend(),
    TritonA8W8BPreshuffleBackend(),
    TritonBlockscaleBackend(),
    TritonBlockscaleBPreshuffleBackend(),
)
