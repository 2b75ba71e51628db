"""The a16w16 `torch` backend: F.linear, vendor BLAS through PyTorch (cuBLAS / hipBLAS(Lt) / the CPU
BLAS); what an untuned a16w16 key runs (a16w16/policy.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...keys import GemmKey
from ..base import Backend, Runner, Solution, stable_solidx

# aiter writes torch rows as solidx 0, kernelName "native"; keep that spelling so tables move both ways.
NATIVE = Solution("torch", "native", 0, 0)
# Explicit fp32-output mm (aten::mm.dtype) where PyTorch has it; otherwise computes in fp32.
MM_OUT_DTYPE = Solution("torch", "mm_out_dtype", stable_solidx("mm_out_dtype"), 0)


def _linear_in_fp32(x, w, bias):
    # A wider output should carry the wider accumulation, not a rounded-then-widened value.
    b = None if bias is None else bias.float()
    return F.linear(x.float(), w.float(), b)


def _cast_runner(out_dtype: torch.dtype) -> Runner:
    def run(x, w, bias):
        return F.linear(x, w, bias).to(out_dtype)

    return run


def _mm_fp32_out(x, w, bias):
    y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], w.shape[0])


class TorchBackend(Backend):
    name = "torch"

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # F.linear takes any M

    def candidates(self, key: GemmKey, device: torch.device) -> list[Solution]:
        sols = [NATIVE]
        if self.supports(MM_OUT_DTYPE, key, device):
            sols.append(MM_OUT_DTYPE)
        return sols

    def default_solution(self, key: GemmKey, device: torch.device) -> Solution:
        return NATIVE

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in (NATIVE, MM_OUT_DTYPE):
            if kernel_name == sol.kernel_name:
                return sol
        # aiter's torch rows are all one native call whatever the name; solidx 0 means that.
        return NATIVE if solidx == 0 else None

    def supports(self, solution: Solution, key: GemmKey, device: torch.device) -> bool:
        if key.scaleAB or key.bpreshuffle:
            return False
        if solution == MM_OUT_DTYPE:
            return (
                device.type == "cuda" and key.dtype in (torch.float16, torch.bfloat16) and key.outdtype == torch.float32
            )
        return True

    def make_runner(self, solution: Solution, key: GemmKey, device: torch.device) -> Runner:
        if solution == MM_OUT_DTYPE:
            return _mm_fp32_out
        if key.outdtype == key.dtype:
            return F.linear  # the plain call itself: no wrapper on the hot path
        if key.outdtype == torch.float32:
            return _linear_in_fp32
        return _cast_runner(key.outdtype)


BACKENDS = (TorchBackend(),)
