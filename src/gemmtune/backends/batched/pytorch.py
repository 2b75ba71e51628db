"""The batched `torch` backend: torch.bmm (vendor BLAS through PyTorch); what an untuned batched key runs."""

from __future__ import annotations

import torch

from ..base import Backend, Runner, Solution

BMM = Solution("torch", "native", 0, 0)


def _bmm_cast(out_dtype: torch.dtype) -> Runner:
    def run(a, b):
        if out_dtype == torch.float32:  # the wider output carries the fp32 accumulation
            return torch.bmm(a.float(), b.float())
        return torch.bmm(a, b).to(out_dtype)

    return run


class TorchBatchedBackend(Backend):
    name = "torch"
    family = "batched"

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # torch.bmm takes any M

    def candidates(self, key, device: torch.device) -> list[Solution]:
        return [BMM]

    def default_solution(self, key, device: torch.device) -> Solution:
        return BMM

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return BMM if kernel_name == BMM.kernel_name or solidx == 0 else None

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        return solution == BMM

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        return torch.bmm if key.outdtype == key.dtype else _bmm_cast(key.outdtype)


BACKENDS = (TorchBatchedBackend(),)
