"""What an untuned epilogue key runs: the unfused torch path a model runs (a GEMM, then the epilogue's
elementwise kernels)."""

from __future__ import annotations

import torch

from ..base import Solution
from .pytorch import UNFUSED


def epilogue(key, device: torch.device) -> tuple[str, Solution]:
    return "torch", UNFUSED


POLICIES = {"epilogue": epilogue}
