"""Backends of the batched_a8w8 family (aiter's batched_gemm_a8w8; families/quantized.py):

torch (the default): `native` dequantizes (q * scale; bf16 on a GPU unless the output is fp32, fp32 on
the CPU) and runs torch.bmm. On CUDA with fp8 operands also `scaled_mm_loop`: cuBLASLt's rowwise
fp8 GEMM (torch._scaled_mm) once per batch, bf16 out only.
triton: kernels/batched_a8w8.py tile configs (kernelName = the config string, solidx its crc).
Runners take (xq [B, M, K], wq [B, N, K], xs [B, M, 1], ws [B, 1, N]) with fp32 scales.
"""

from __future__ import annotations

import torch

from ..kernels._common import HAS_TRITON
from .base import Backend, Runner, Solution, stable_solidx
from .quantized import _cuda, _tensor_core_fp8

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NATIVE = Solution("torch", "native", 0, 0)
SCALED_MM_LOOP = Solution("torch", "scaled_mm_loop", stable_solidx("scaled_mm_loop"), 0)


def _q_ok(key) -> bool:
    return key.q_dtype_w == torch.int8 or _tensor_core_fp8(key.q_dtype_w) or key.q_dtype_w == torch.float8_e4m3fn


def _loop_ok(key, device) -> bool:
    return (_cuda(device) and hasattr(torch, "_scaled_mm") and _tensor_core_fp8(key.q_dtype_w)
            and key.outdtype == torch.bfloat16 and key.K % 16 == 0 and key.N % 16 == 0)  # fmt: skip


def _native_runner(key, device) -> Runner:
    mid = torch.bfloat16 if _cuda(device) and key.outdtype != torch.float32 else torch.float32
    out = key.outdtype

    def run(xq, wq, xs, ws):
        x = (xq.to(torch.float32) * xs).to(mid)
        w = (wq.to(torch.float32) * ws.transpose(1, 2)).to(mid)
        return torch.bmm(x, w.transpose(1, 2)).to(out)

    return run


def _loop_runner(key) -> Runner:
    def run(xq, wq, xs, ws):
        y = torch.empty((key.B, key.M, key.N), dtype=key.outdtype, device=xq.device)
        for b in range(key.B):
            y[b] = torch._scaled_mm(xq[b], wq[b].t(), xs[b], ws[b], out_dtype=key.outdtype)
        return y

    return run


class TorchBatchedA8W8Backend(Backend):
    name = "torch"
    family = "batched_a8w8"

    def is_available(self, device: torch.device) -> bool:
        return True

    def candidates(self, key, device: torch.device) -> list[Solution]:
        return [SCALED_MM_LOOP] if _loop_ok(key, device) else []

    def default_solution(self, key, device: torch.device) -> Solution:
        return NATIVE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, SCALED_MM_LOOP):
            if kernel_name == sol.kernel_name:
                return sol
        return NATIVE if solidx == 0 and kernel_name in ("", "native") else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        if key.outdtype not in _OUT_DTYPES:
            return False
        return solution == NATIVE or (solution == SCALED_MM_LOOP and _loop_ok(key, device))

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        return _loop_runner(key) if solution == SCALED_MM_LOOP else _native_runner(key, device)


def tile_configs(key, smem: int = 227 * 1024):
    """The Triton configs worth timing for `key`: tiles no taller than M needs, no wider than N or deeper
    than K, that fit shared memory (8-bit operands, `stages` buffers of each)."""
    from ..kernels.batched_a8w8 import BatchedA8W8Config

    def p2(v):
        return 1 << max(0, (v - 1).bit_length())

    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, p2(key.M)):
            continue
        for bn in (32, 64, 128, 256):
            if bn > max(32, p2(key.N)):
                continue
            for bk in (64, 128, 256):
                if bk > max(64, p2(key.K)):
                    continue
                for warps, stages in ((4, 3), (4, 4), (8, 3)):
                    if (bm + bn) * bk * stages <= smem and not (warps == 8 and bm * bn < 128 * 64):
                        out.append(BatchedA8W8Config(bm, bn, bk, warps, stages))
    return out


class TritonBatchedA8W8Backend(Backend):
    name = "triton"
    family = "batched_a8w8"

    def is_available(self, device: torch.device) -> bool:
        return HAS_TRITON and _cuda(device)

    def unavailable_reason(self, device: torch.device) -> str:
        if not HAS_TRITON:
            return "triton is not installed"
        return "" if self.is_available(device) else "the Triton batched 8-bit GEMM needs a CUDA or ROCm GPU"

    def _key_ok(self, key) -> bool:
        return _q_ok(key) and key.outdtype in _OUT_DTYPES and key.M > 0 and key.N * key.K < 2**31

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not (self.is_available(device) and self._key_ok(key)):
            return []
        from ..device import facts

        return [self._solution(c) for c in tile_configs(key, facts(torch.device(device)).smem_per_block)]

    def _solution(self, cfg) -> Solution:
        return Solution(self.name, cfg.name, stable_solidx(cfg.name), 0)

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        from ..kernels.batched_a8w8 import parse_config

        cfg = parse_config(kernel_name)
        return self._solution(cfg) if cfg is not None else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        from ..kernels.batched_a8w8 import parse_config

        return parse_config(solution.kernel_name) is not None and self.is_available(device) and self._key_ok(key)

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        from ..kernels.batched_a8w8 import batched_a8w8, parse_config

        cfg, out = parse_config(solution.kernel_name), key.outdtype

        def run(xq, wq, xs, ws):
            return batched_a8w8(xq, wq, xs.contiguous(), ws.contiguous(), out, cfg)

        return run
