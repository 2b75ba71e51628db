"""What an untuned batched_a8w8 key runs: on an NVIDIA GPU where Triton runs, the Triton kernel's
heuristic config (triton.default_config: one launch for every batch, the scales applied in its
epilogue); else torch's dequantize + torch.bmm (`native`), which reads the operands three times over
in fp32 and bf16 before its GEMM."""

from __future__ import annotations

import torch

from ... import device as device_facts
from ..base import Solution
from .pytorch import NATIVE


def batched_a8w8(key, device: torch.device) -> tuple[str, Solution]:
    device = torch.device(device)
    if device_facts.vendor(device) == device_facts.NVIDIA and device_facts.triton_runs_on(device):
        from .triton import TritonBatchedA8W8Backend

        sol = TritonBatchedA8W8Backend().default_solution(key, device)
        if sol is not None:
            return "triton", sol
    return "torch", NATIVE


POLICIES = {"batched_a8w8": batched_a8w8}
