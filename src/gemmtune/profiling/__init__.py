"""Profiling: GPU (or CPU) time by category, top kernels and the GEMM table of a run, and the
stock-vs-optimize benchmark of a model (`gemmtune profile`, `gemmtune bench-model`)."""

from .breakdown import Breakdown, GemmRow, Item
from .collect import profile, profile_script, step
from .report import Profile

__all__ = ["Breakdown", "GemmRow", "Item", "Profile", "profile", "profile_script", "step"]
