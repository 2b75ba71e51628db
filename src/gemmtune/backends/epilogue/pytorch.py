"""The epilogue family's `torch` backend (families/epilogue.py): runner(x, w, bias, c, alpha, beta) -> y.

- `torch` (what an untuned key runs): the unfused path a model runs, F.linear / addmm then the activation; and
  `addmm_activation`, torch's own fused call (cuBLASLt's RELU_BIAS / GELU_BIAS epilogues on CUDA where
  its conditions hold, addmm + activation otherwise), for relu and for the GELU it computes: the tanh
  approximation on GPUs (cuBLASLt's), the erf one on the CPU. On GPUs the same call is also offered for
  erf-GELU keys with a 16-bit output as `addmm_activation_tanh` (families/epilogue.py: tanh_for_erf).
The family's other backends: `blaslt` (epilogue/blaslt.py), explicit cuBLASLt algorithms with the
epilogue set; `triton` (epilogue/triton.py), the Triton GEMM with the epilogue in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...families.epilogue import EpilogueKey, apply_act, tanh_for_erf
from ..base import Backend, Runner, Solution, stable_solidx

UNFUSED = Solution("torch", "native", 0, 0)
ADDMM_ACT = Solution("torch", "addmm_activation", stable_solidx("addmm_activation"), 0)
ADDMM_ACT_TANH = Solution("torch", "addmm_activation_tanh", stable_solidx("addmm_activation_tanh"), 0)
_SOLUTIONS = (UNFUSED, ADDMM_ACT, ADDMM_ACT_TANH)


def _unfused(key: EpilogueKey) -> Runner:
    """alpha * x @ w^T + beta * c + bias, then act: one vendor GEMM and separate elementwise kernels
    (none at all for a plain GEMM + bias). A wider out dtype computes in fp32."""
    act, out_dtype = key.act, key.outdtype
    wide = out_dtype == torch.float32 and key.dtype != torch.float32
    cdt = torch.float32 if wide else key.dtype

    def run(x, w, bias, c, alpha, beta):
        if wide:
            x, w = x.float(), w.float()
        if bias is not None and bias.dtype != cdt:
            bias = bias.to(cdt)
        if c is not None and beta != 0.0:
            y = torch.addmm(c.to(cdt), x, w.t(), beta=beta, alpha=alpha)
            if bias is not None:
                y = y + bias
        elif alpha != 1.0:
            y = torch.addmm(bias, x, w.t(), alpha=alpha) if bias is not None else torch.mm(x, w.t()) * alpha
        else:
            y = F.linear(x, w, bias)
        y = apply_act(y, act)
        return y if y.dtype == out_dtype else y.to(out_dtype)

    return run


def _addmm_activation(key: EpilogueKey) -> Runner:
    gelu = key.act != "relu"

    def run(x, w, bias, c, alpha, beta):
        if c is not None and beta != 0.0:
            return torch._addmm_activation(c, x, w.t(), beta=beta, alpha=alpha, use_gelu=gelu)
        return torch._addmm_activation(bias, x, w.t(), alpha=alpha, use_gelu=gelu)

    return run


class TorchEpilogueBackend(Backend):
    name = "torch"
    family = "epilogue"

    def candidates(self, key: EpilogueKey, device: torch.device) -> list[Solution]:
        return [s for s in _SOLUTIONS if self.supports(s, key, device)]

    def default_solution(self, key: EpilogueKey, device: torch.device) -> Solution:
        return UNFUSED

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        for sol in _SOLUTIONS:
            if kernel_name == sol.kernel_name:
                return sol
        return UNFUSED if solidx == 0 and not kernel_name else None

    def supports(self, solution: Solution, key: EpilogueKey, device: torch.device) -> bool:
        if solution == UNFUSED:
            return True
        if solution not in (ADDMM_ACT, ADDMM_ACT_TANH):
            return False
        # One addend only (bias or beta * C), no widening, and the GELU torch fuses on this device.
        if not hasattr(torch, "_addmm_activation") or key.bias == key.beta or key.outdtype != key.dtype:
            return False
        if solution == ADDMM_ACT_TANH:
            return device.type != "cpu" and tanh_for_erf(key)
        return key.act in ("relu", "gelu" if device.type == "cpu" else "gelu_tanh")

    def make_runner(self, solution: Solution, key: EpilogueKey, device: torch.device) -> Runner:
        if not self.supports(solution, key, device):
            raise ValueError(f"torch cannot run {solution.kernel_name!r} for {key.describe()}")
        return _unfused(key) if solution == UNFUSED else _addmm_activation(key)


BACKENDS = (TorchEpilogueBackend(),)
