"""What an untuned batched key runs: torch.bmm (vendor BLAS through torch)."""

from __future__ import annotations

import torch

from ..base import Solution
from .pytorch import BMM


def batched(key, device: torch.device) -> tuple[str, Solution]:
    return "torch", BMM


POLICIES = {"batched": batched}
