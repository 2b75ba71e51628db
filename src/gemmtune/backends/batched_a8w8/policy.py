"""What an untuned batched_a8w8 key runs: torch's dequantize + torch.bmm (`native`)."""

from __future__ import annotations

import torch

from ..base import Solution
from .pytorch import NATIVE


def batched_a8w8(key, device: torch.device) -> tuple[str, Solution]:
    return "torch", NATIVE


POLICIES = {"batched_a8w8": batched_a8w8}
