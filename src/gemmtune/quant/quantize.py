"""Quantizers and dequantizers, plain PyTorch (the references the kernels are checked against).

scale = amax / qmax per group, q = round_to_format(x / scale), so x ~= q * scale. Scale layouts:
- per-tensor: [1] (one element);
- per-token (activations [..., K]): [..., 1]; per-channel (weights [N, K]): [1, N];
- 1x128 (activations): [M, ceil(K/128)]; 128x128 (weights): [ceil(N/128), ceil(K/128)].
An all-zero group gets a tiny positive scale so q is 0 and never NaN.
"""

from __future__ import annotations

import torch

from .formats import BLOCK, SCALE_DTYPE, is_fp8, qmax

_TINY = 1e-12


def _to_q(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lim = qmax(dtype)
    y = x.float() / scale
    if not is_fp8(dtype):
        y = y.round()
    return y.clamp(-lim, lim).to(dtype)


def _scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (amax.float().clamp(min=_TINY) / qmax(dtype)).to(SCALE_DTYPE)


def quantize_per_tensor(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [1]) with one scale for the whole tensor."""
    s = _scale(x.detach().abs().amax().reshape(1), dtype)
    return _to_q(x, s, dtype), s


def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [..., 1]): one scale per row of x [..., K] (dynamic activation quantization)."""
    s = _scale(x.detach().abs().amax(dim=-1, keepdim=True), dtype)
    return _to_q(x, s, dtype), s


def quantize_per_channel(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [1, N]): one scale per output channel of a weight w [N, K]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_per_channel: weight must be 2-D [N, K], got {tuple(w.shape)}")
    s = _scale(w.detach().abs().amax(dim=1, keepdim=True), dtype)
    return _to_q(w, s, dtype), s.reshape(1, -1)


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    r, c = t.shape
    if r == rows and c == cols:
        return t
    return torch.nn.functional.pad(t, (0, cols - c, 0, rows - r))


def _blocks(n: int, b: int = BLOCK) -> int:
    return -(-n // b)


def quantize_1x128(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [M, ceil(K/128)]): one scale per 128 consecutive elements of each row of x [..., K]."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    kb = _blocks(k)
    g = _pad_to(x2.detach().float(), x2.shape[0], kb * BLOCK).abs().view(-1, kb, BLOCK).amax(-1)
    s = _scale(g, dtype)
    q = _to_q(x2, s.repeat_interleave(BLOCK, dim=1)[:, :k], dtype)
    return q.view(x.shape), s.view(*x.shape[:-1], kb)


def quantize_128x128(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale [ceil(N/128), ceil(K/128)]): one scale per 128x128 block of a weight w [N, K]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_128x128: weight must be 2-D [N, K], got {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    g = _pad_to(w.detach().float(), nb * BLOCK, kb * BLOCK).abs().view(nb, BLOCK, kb, BLOCK).amax(dim=(1, 3))
    s = _scale(g, dtype)
    return _to_q(w, expand_blocks(s, n, k), dtype), s


def expand_blocks(scale: torch.Tensor, rows: int, cols: int, row_block: int = BLOCK, col_block: int = BLOCK):
    """A block-scale grid repeated to one scale per element of a [rows, cols] tensor."""
    return scale.repeat_interleave(row_block, 0)[:rows].repeat_interleave(col_block, 1)[:, :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 q * scale for per-tensor / per-token / per-channel scales (broadcast: [1], [M, 1], [1, N])."""
    return q.float() * scale.float()


def dequantize_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    k = q.shape[-1]
    q2 = q.reshape(-1, k)
    s = scale.reshape(q2.shape[0], -1).float().repeat_interleave(BLOCK, dim=1)[:, :k]
    return (q2.float() * s).view(q.shape)


def dequantize_128x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * expand_blocks(scale.float(), *q.shape)
