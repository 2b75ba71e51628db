"""The block-scale layouts cuBLASLt's 1x128 x 128x128 fp8 GEMM reads (torch._scaled_mm on sm90).

Both are views of the logical scale grids every op here takes, so the Triton kernels and the
references (which read any strides) see the same values:
- activation scales x_scale [M, K/128] "M-major": element (m, g) at g * M + m (strides (1, M)).
  The dynamic quantizer writes them so (kernels/quant.py, m_major=True): no transpose per call.
- weight scales w_scale [ceil(N/128), K/128] with the row stride rounded up to a multiple of 4
  (cuBLASLt's L4 = round_up(K/128, 4) padding; rows are 16-byte aligned). A weight's scales are
  laid out once, when it is quantized or loaded; when K/128 % 4 == 0 the plain contiguous grid is
  already that layout.
"""

from __future__ import annotations

import torch


def round_up(v: int, to: int) -> int:
    return -(-v // to) * to


def is_m_major(xs: torch.Tensor) -> bool:
    """Is the [M, G] grid stored M-major (stride 1 along M, M along G; size-1 dims any stride)?"""
    m, g = xs.shape
    return (m <= 1 or xs.stride(0) == 1) and (g <= 1 or xs.stride(1) == m)


def m_major(xs: torch.Tensor) -> torch.Tensor:
    """The [M, G] grid as an M-major view (a copy only when it is not one already)."""
    return xs if is_m_major(xs) else xs.t().contiguous().t()


def is_k_padded(ws: torch.Tensor) -> bool:
    """Is the [NB, KB] weight grid stored with unit stride along KB and rows round_up(KB, 4) apart?"""
    nb, kb = ws.shape
    return (kb <= 1 or ws.stride(1) == 1) and (nb <= 1 or ws.stride(0) == round_up(kb, 4))


def k_padded(ws: torch.Tensor) -> torch.Tensor:
    """The [NB, KB] weight grid as a view of an [NB, round_up(KB, 4)] buffer (padding zero-filled)."""
    if is_k_padded(ws):
        return ws
    nb, kb = ws.shape
    buf = ws.new_zeros((nb, round_up(kb, 4)))
    buf[:, :kb] = ws
    return buf[:, :kb]
