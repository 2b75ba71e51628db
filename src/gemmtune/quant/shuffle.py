"""What "weight pre-shuffled" means on NVIDIA: the [N, K] K-contiguous (row-major) 8-bit weight.

Both consumers of an 8-bit weight here want K innermost: cuBLASLt's fp8/int8 GEMMs only run the
"TN" layout (B read as a column-major [K, N], which is a row-major [N, K]), and the Triton kernels'
wgmma/mma operands are K-major tiles. Any other storage (a [K, N] weight as some checkpoints and
GPTQ-style packers keep it, a strided slice of a fused weight) costs a transpose copy per call.
`shuffle_weight` makes that copy once, at load time; the *_bpreshuffle ops then accept only this
layout, so their hot path never copies. A tile-interleaved layout (aiter's MI300 16x16 shuffle) has
no counterpart that wins on Hopper: TMA / cp.async already load K-major tiles at full width.
"""

from __future__ import annotations

import torch

from .formats import is_quant_dtype


def shuffle_weight(w: torch.Tensor, layout: str = "nk") -> torch.Tensor:
    """The 8-bit weight in the layout the bpreshuffle ops take: [N, K], K contiguous.

    layout: how `w` holds the weight now: "nk" ([N, K], any strides) or "kn" ([K, N], e.g. a
    transposed checkpoint).
    """
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"shuffle_weight: expected a 2-D weight tensor, got {getattr(w, 'shape', type(w))}")
    if not is_quant_dtype(w.dtype):
        raise ValueError(f"shuffle_weight: weight dtype {w.dtype} is not int8 / float8_e4m3")
    if layout not in ("nk", "kn"):
        raise ValueError(f"shuffle_weight: layout must be 'nk' or 'kn', got {layout!r}")
    nk = w.t() if layout == "kn" else w
    return nk.contiguous()


def is_shuffled(w: torch.Tensor) -> bool:
    """Does `w` [N, K] have the layout shuffle_weight produces (K contiguous, rows packed)?"""
    return w.dim() == 2 and w.stride(1) == 1 and w.stride(0) == w.shape[1]
