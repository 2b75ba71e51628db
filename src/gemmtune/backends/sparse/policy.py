"""What an untuned sparse key runs: the weight's own format through torch (widened to fp32 where torch
lacks the dtype here), the dense twin as a last resort (TorchSparseBackend.default_solution)."""

from __future__ import annotations

import torch

from ..base import Solution
from .pytorch import TorchSparseBackend


def sparse(key, device: torch.device) -> tuple[str, Solution]:
    return "torch", TorchSparseBackend().default_solution(key, torch.device(device))


POLICIES = {"sparse": sparse}
