"""The batched_a8w8 family's `triton` backend: kernels/batched_a8w8.py tile configs (kernelName = the
config string, solidx its crc). Runners take (xq [B, M, K], wq [B, N, K], xs [B, M, 1], ws [B, 1, N])."""

from __future__ import annotations

import torch
import triton

from ...device import Needs, facts
from ...kernels.batched_a8w8 import BatchedA8W8Config, batched_a8w8, parse_config
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib.quant_support import OUT_DTYPES, tensor_core_fp8


def _q_ok(key) -> bool:
    return key.q_dtype_w == torch.int8 or tensor_core_fp8(key.q_dtype_w) or key.q_dtype_w == torch.float8_e4m3fn


def default_config(key) -> BatchedA8W8Config:
    """The config an untuned key runs: a tile no taller than M needs (16 rows at decode), 64 columns
    where M is short (the batch and N tiles fill the GPU when each program reads little), a K depth of
    up to 256 (two loads of a 128-deep MLA head fit one step), 4 warps and 3 stages; 128 x 128 tiles
    at prefill heights."""
    bm = min(128, max(16, triton.next_power_of_2(key.M)))
    bn = min(64 if bm <= 32 else 128, max(32, triton.next_power_of_2(key.N)))
    bk = min(256 if bm <= 32 else 128, max(64, triton.next_power_of_2(key.K)))
    return BatchedA8W8Config(bm, bn, bk, 4 if bm * bn < 128 * 128 else 8, 3)


def tile_configs(key, smem: int = 227 * 1024):
    """The Triton configs worth timing for `key`: tiles no taller than M needs, no wider than N or deeper
    than K, that fit shared memory (8-bit operands, `stages` buffers of each)."""

    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, triton.next_power_of_2(key.M)):
            continue
        for bn in (32, 64, 128, 256):
            if bn > max(32, triton.next_power_of_2(key.N)):
                continue
            for bk in (64, 128, 256):
                if bk > max(64, triton.next_power_of_2(key.K)):
                    continue
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    if (bm + bn) * bk * stages <= smem and not (warps == 8 and bm * bn < 128 * 64):
                        out.append(BatchedA8W8Config(bm, bn, bk, warps, stages))
    return out


class TritonBatchedA8W8Backend(Backend):
    name = "triton"
    family = "batched_a8w8"
    needs = Needs(triton=True)

    def key_ok(self, key) -> bool:
        return _q_ok(key) and key.outdtype in OUT_DTYPES and key.M > 0 and key.N * key.K < 2**31

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not (self.is_available(device) and self.key_ok(key)):
            return []
        return [self.solution(c) for c in tile_configs(key, facts(torch.device(device)).smem_per_block)]

    def default_solution(self, key, device: torch.device) -> Solution | None:
        return self.solution(default_config(key)) if self.is_available(device) and self.key_ok(key) else None

    def solution(self, cfg) -> Solution:
        return Solution(self.name, cfg.name, stable_solidx(cfg.name), 0)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        cfg = parse_config(kernel_name)
        return self.solution(cfg) if cfg is not None else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        return parse_config(solution.kernel_name) is not None and self.is_available(device) and self.key_ok(key)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        cfg, out = parse_config(solution.kernel_name), key.outdtype

        def run(xq, wq, xs, ws):
            return batched_a8w8(xq, wq, xs.contiguous(), ws.contiguous(), out, cfg)

        return run


BACKENDS = (TritonBatchedA8W8Backend(),)
