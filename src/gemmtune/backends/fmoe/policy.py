"""What an untuned fmoe key runs: (backend name, solution), named after what really runs.

On a GPU where Triton runs, in 16-bit: keys with many tokens per expert run the grouped_mm pair with
the Triton glue (triton:grouped_mm|grouped_mm), the others the Triton heuristic pair. Elsewhere the
grouped_mm pair where torch._grouped_mm runs, with the Triton glue where Triton runs (a GPU, or the CPU
under the interpreter), in torch ops otherwise (torch:grouped_mm|grouped_mm); else the loop (CPU) or
dense (torch).
"""

from __future__ import annotations

import torch

from ... import device as device_facts
from ...families.fmoe import MoeKey
from ..base import Solution
from .pytorch import TorchMoeBackend

# Untuned keys with many tokens per expert run the grouped_mm pair (with the Triton glue): measured on
# an H100 (benchmarks/results/h100/fused_moe_op/), the tuner picked it for every key with
# >= 64 slots per expert hit and >= 1024 slots (Mixtral-8x7B tp1/tp2 and Qwen3-30B-A3B, T 1024 and
# 4096: 1.07-1.49x over the Triton heuristic pair). Below that the Triton pair won or tied, except on
# Mixtral tp2 at T 64 and 256 (grouped_mm 1.05-1.16x): tuning finds those.
GM_MIN_SLOTS, GM_MIN_PER_EXPERT = 1024, 64


def prefers_grouped_mm(key: MoeKey) -> bool:
    """Does an untuned `key` run the grouped_mm pair rather than the Triton heuristic pair (on a GPU
    where both run)?"""
    slots = key.slots
    return slots >= GM_MIN_SLOTS and slots / max(1, min(key.expert, slots)) >= GM_MIN_PER_EXPERT


def fmoe(key: MoeKey, device: torch.device) -> tuple[str, Solution]:
    device = torch.device(device)
    triton_here = device_facts.triton_runs_on(device)  # a GPU, or the CPU under Triton's interpreter
    tor = TorchMoeBackend()
    if triton_here:
        from .triton import GROUPED_MM_GLUED, TritonMoeBackend

        tri = TritonMoeBackend()
        if device_facts.is_gpu(device) and key.dtype in (torch.float16, torch.bfloat16):
            order = [GROUPED_MM_GLUED] if prefers_grouped_mm(key) else []
            order.append(tri.default_solution(key, device))
        else:  # where the Triton pair is not the default, the grouped_mm pair still takes the Triton glue
            order = [GROUPED_MM_GLUED]
        for sol in order:
            if tri.supports(sol, key, device):
                return "triton", sol
    return "torch", tor.default_solution(key, device)


POLICIES = {"fmoe": fmoe}
