"""2:4 semi-structured sparsity: pruning a dense weight to 2 of every 4 along K, and torch's
SparseSemiStructuredTensor (cuSPARSELt / CUTLASS on NVIDIA sm80+) made from it.

`prune_2_4(weight)` is public (gemmtune.prune_2_4); `semi_structured_reason` tells a backend or a test
why this device cannot hold a 2:4 weight ('' when it can).
"""

from __future__ import annotations

import functools

import torch

from ..checks import check_bool
from ..device import NVIDIA, capability, vendor


@functools.cache
def _semi_cls():
    """(SparseSemiStructuredTensor, to_sparse_semi_structured), or (None, None) on a torch without them."""
    try:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
    except ImportError:
        return None, None
    return SparseSemiStructuredTensor, to_sparse_semi_structured


def is_semi_structured(w) -> bool:
    cls, _ = _semi_cls()
    return cls is not None and isinstance(w, cls)


def semi_structured_reason(device: torch.device, dtype: torch.dtype, shape=None) -> str:
    """Why a 2:4 semi-structured weight cannot be made here ('' when it can)."""
    cls, _ = _semi_cls()
    if cls is None:
        return "this torch has no torch.sparse.to_sparse_semi_structured"
    if vendor(device) != NVIDIA:
        return f"2:4 semi-structured sparsity runs on NVIDIA GPUs (sm80+), not on {device.type}"
    if capability(device) < (8, 0):
        return "2:4 semi-structured sparsity needs an sm80+ GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"2:4 semi-structured sparsity takes float16 / bfloat16, not {dtype}"
    if shape is not None and (shape[0] % 64 or shape[1] % 64):
        return f"2:4 semi-structured weights need N and K multiples of 64, got {tuple(shape)}"
    return ""


def semi_structured(dense: torch.Tensor):
    """A dense [N, K] weight already in 2:4 form as a SparseSemiStructuredTensor (cuSPARSELt when
    torch has it, else CUTLASS); ValueError saying why when this device cannot."""
    why = semi_structured_reason(dense.device, dense.dtype, dense.shape)
    if why:
        raise ValueError(f"gemmtune: cannot make a 2:4 weight: {why}")
    return _semi_cls()[1](dense)


def prune_2_4_dense(w: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest-magnitude values of every 4 consecutive along K, zero the other 2."""
    n, k = w.shape
    groups = w.reshape(n, k // 4, 4)
    idx = groups.abs().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return (groups * mask).reshape(n, k)


def describe(t) -> str:
    """A tensor argument as error messages show it: shape, dtype, layout (or 2:4 class), device."""
    if t is None:
        return "None"
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    kind = type(t).__name__ if is_semi_structured(t) else str(t.layout)
    return f"{tuple(t.shape)} {t.dtype} {kind} on {t.device}"


def prune_2_4(weight: torch.Tensor, compress: bool = True):
    """(weight pruned to 2:4 by magnitude, ||W - W_2:4|| / ||W||).

    compress=True returns a SparseSemiStructuredTensor for sparse_gemm(..., '2:4') (NVIDIA sm80+,
    fp16/bf16, N and K multiples of 64; a clear ValueError elsewhere); compress=False the pruned dense
    tensor (any device), e.g. to measure the error or to keep a dense twin."""
    check_bool("prune_2_4", "compress", compress)
    if not isinstance(weight, torch.Tensor) or weight.layout != torch.strided or weight.dim() != 2:
        raise ValueError(f"gemmtune.prune_2_4: weight must be a dense 2-D [N, K] tensor, got {describe(weight)}")
    if weight.shape[1] % 4:
        raise ValueError(f"gemmtune.prune_2_4: K={weight.shape[1]} is not a multiple of 4 ({describe(weight)})")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"gemmtune.prune_2_4: weight must be a float tensor, got {weight.dtype}")
    with torch.no_grad():
        pruned = prune_2_4_dense(weight.detach())
        w32 = weight.detach().float()
        rel = ((w32 - pruned.float()).norm() / w32.norm().clamp_min(1e-30)).item()
    return (semi_structured(pruned) if compress else pruned), rel
