"""What an untuned a16w16 key runs: F.linear (vendor BLAS through torch), the call a model makes anyway."""

from __future__ import annotations

import torch

from ...keys import GemmKey
from ..base import Solution
from .pytorch import NATIVE


def a16w16(key: GemmKey, device: torch.device) -> tuple[str, Solution]:
    return "torch", NATIVE


POLICIES = {"a16w16": a16w16}
