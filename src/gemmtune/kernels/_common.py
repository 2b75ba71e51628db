"""What the elementwise kernels (norms, activations, rope) share: optional Triton, dtypes, output alloc."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the PyTorch references still work
    triton = None
    tl = None
    HAS_TRITON = False

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def empty_out(shape, like: torch.Tensor) -> torch.Tensor:
    """Output allocation (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)
