"""The batched_a8w8 family's `torch` backend (aiter's batched_gemm_a8w8; families/quantized.py):

`native` (what an untuned key runs) dequantizes (q * scale; bf16 on a GPU unless the output is fp32, fp32 on
the CPU) and runs torch.bmm. On CUDA with fp8 operands also `scaled_mm_loop`: cuBLASLt's rowwise
fp8 GEMM (torch._scaled_mm) once per batch, bf16 out only.
The `triton` backend is batched_a8w8/triton.py. Runners take (xq [B, M, K], wq [B, N, K], xs [B, M, 1],
ws [B, 1, N]) with fp32 scales.
"""

from __future__ import annotations

import torch

from ...device import is_gpu
from ..base import Backend, Runner, Solution, stable_solidx
from ..lib.quant_support import OUT_DTYPES, tensor_core_fp8

NATIVE = Solution("torch", "native", 0, 0)
SCALED_MM_LOOP = Solution("torch", "scaled_mm_loop", stable_solidx("scaled_mm_loop"), 0)


def _loop_ok(key, device) -> bool:
    return (is_gpu(device) and hasattr(torch, "_scaled_mm") and tensor_core_fp8(key.q_dtype_w)
            and key.outdtype == torch.bfloat16 and key.K % 16 == 0 and key.N % 16 == 0)  # fmt: skip


def _native_runner(key, device) -> Runner:
    mid = torch.bfloat16 if is_gpu(device) and key.outdtype != torch.float32 else torch.float32
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
        if key.outdtype not in OUT_DTYPES:
            return False
        return solution == NATIVE or (solution == SCALED_MM_LOOP and _loop_ok(key, device))

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        return _loop_runner(key) if solution == SCALED_MM_LOOP else _native_runner(key, device)


BACKENDS = (TorchBatchedA8W8Backend(),)
