"""torch._scaled_mm's DeepSeek-style block-scaled fp8 GEMM: 1x128 activation groups x 128x128 weight
blocks, fp32 scales, through cuBLASLt (VEC128_32F x BLK128x128_32F: sm90, CUDA >= 12.9).

torch picks the recipe from the scales' shapes and strides: scale_a [M, K/128] M-major (strides
(1, M)), scale_b [K/128, ceil(N/128)] whose transpose has unit stride along K/128 and rows either
K/128 or round_up(K/128, 4) apart, depending on the torch release (cuBLASLt itself reads rows
round_up(K/128, 4) apart: torch releases that check the packed stride give silently wrong answers
when K/128 % 4 != 0). So what this torch and GPU accept is probed once per GPU, by running the
GEMM on a few small problems against the dequantized reference: whether it works at all (K/128 = 4,
where the two layouts coincide), which weight-scale row stride is right when K/128 % 4 != 0 (if
either), whether M and N need alignment, and which output dtypes it writes. Candidates are offered
only where the probe says the call is right.

Per-call cost: none when the scales come in the layouts of quant/layouts.py (what the model path and
the family's timing inputs use); otherwise one small copy of the activation scales (row-major ->
M-major) and/or of the weight scales (packed -> row-padded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...device import NVIDIA, capability, vendor
from ...quant import formats
from ...quant.layouts import k_padded, m_major

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _empty(shape, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The output allocation (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=dtype)


def scaled_mm_blockwise(xq, wq, xs, ws, out_dtype=torch.bfloat16, pad_k: bool = True, mm: Callable | None = None):
    """y[M, N] = block-scaled xq [M, K] @ wq [N, K]^T via torch._scaled_mm (or `mm`, same signature).

    xs [M, K/128] and ws [ceil(N/128), K/128] in any layout; pad_k: hand cuBLASLt weight-scale rows
    round_up(K/128, 4) apart (else packed), as the probe found this torch wants.
    """
    mm = mm or torch._scaled_mm
    sb = (k_padded(ws) if pad_k else ws.contiguous()).t()
    y = _empty((xq.shape[0], wq.shape[0]), xq, out_dtype)
    return mm(xq, wq.t(), scale_a=m_major(xs), scale_b=sb, out_dtype=out_dtype, out=y)


@dataclass(frozen=True)
class BlockwiseSupport:
    ok: bool  # the GEMM runs and is right at K/128 = 4, M = 64, N = 256, bf16 out
    reason: str = ""  # why not (when not ok)
    pad_k: bool | None = None  # K/128 % 4 != 0: padded weight-scale rows (True), packed (False), neither (None)
    m_align: int = 64  # M must be a multiple of this
    ragged_n: bool = False  # N need not be a multiple of 128 (only of 16)
    out_dtypes: tuple[torch.dtype, ...] = ()

    def fits(self, m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
        if not self.ok or k % formats.BLOCK or n % 16 or m % self.m_align:
            return False
        if n % formats.BLOCK and not self.ragged_n:
            return False
        if (k // formats.BLOCK) % 4 and self.pad_k is None:
            return False
        return out_dtype in self.out_dtypes

    def describe(self) -> str:
        if not self.ok:
            return f"torch._scaled_mm blockwise unavailable: {self.reason}"
        layout = {True: "rows padded to 4", False: "packed rows", None: "K/128 % 4 == 0 only"}[self.pad_k]
        outs = "/".join(str(d).removeprefix("torch.") for d in self.out_dtypes)
        return (f"torch._scaled_mm blockwise: weight scales {layout}; M % {self.m_align} == 0; "
                f"N % {16 if self.ragged_n else 128} == 0; out {outs}")  # fmt: skip


class _Wrong(Exception):
    pass


def _case(device, mm, m: int, n: int, k: int, out_dtype=torch.bfloat16, pad_k: bool = True) -> None:
    """One small block-scaled GEMM vs the dequantized fp32 reference; raises when it fails or is wrong."""
    from ...quant.quantize import dequantize_1x128, dequantize_128x128, quantize_1x128, quantize_128x128

    g = torch.Generator(device=device).manual_seed(m * 7919 + n * 31 + k)
    x = torch.randn(m, k, device=device, generator=g)
    w = torch.randn(n, k, device=device, generator=g) / math.sqrt(k)
    (xq, xs), (wq, ws) = quantize_1x128(x, formats.FP8), quantize_128x128(w, formats.FP8)
    y = scaled_mm_blockwise(xq, wq, xs, ws, out_dtype, pad_k, mm).float()
    ref = dequantize_1x128(xq, xs) @ dequantize_128x128(wq, ws).t()
    err = ((y - ref).norm() / ref.norm()).item()
    if not err < 1e-2:  # NaN fails too
        raise _Wrong(f"wrong result (rel err {err:.2e}) at M={m} N={n} K={k}")


def _passes(*args, **kw) -> bool:
    try:
        _case(*args, **kw)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not this variant"
        return False


def probe(device: torch.device, mm: Callable | None = None) -> BlockwiseSupport:
    """Run the block-scaled GEMM on small problems on `device` and say what works (see the module doc)."""
    mm = mm or torch._scaled_mm
    try:
        _case(device, mm, 64, 256, 4 * formats.BLOCK)
    except Exception as exc:  # noqa: BLE001 - the reason is reported, the candidate not offered
        return BlockwiseSupport(False, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}")
    k3 = 3 * formats.BLOCK  # K/128 = 3: only the right weight-scale row stride gives the right answer
    pad_k = next((p for p in (True, False) if _passes(device, mm, 64, 256, k3, pad_k=p)), None)
    k4 = 4 * formats.BLOCK
    aligns = ((1, (1, 37)), (16, (16, 48)))
    m_align = next((a for a, ms in aligns if all(_passes(device, mm, m, 256, k4) for m in ms)), 64)
    ragged_n = _passes(device, mm, 64, 400, k4)
    outs = (torch.bfloat16,) + tuple(d for d in OUT_DTYPES[1:] if _passes(device, mm, 64, 256, k4, d))
    return BlockwiseSupport(True, "", pad_k, m_align, ragged_n, outs)


_support: dict[int, BlockwiseSupport] = {}


def cuda_support(index: int | None) -> BlockwiseSupport:
    """The probe's answer for this CUDA device (cached per device; never probed during a graph capture)."""
    idx = torch.cuda.current_device() if index is None else index
    found = _support.get(idx)
    if found is not None:
        return found
    if torch.cuda.is_current_stream_capturing():  # the probe syncs: answer no now, probe on a later call
        return BlockwiseSupport(False, "not probed yet (first asked during a CUDA-graph capture)")
    cap = capability(torch.device("cuda", idx))
    if not hasattr(torch, "_scaled_mm"):
        found = BlockwiseSupport(False, f"torch {torch.__version__} has no torch._scaled_mm")
    elif vendor(torch.device("cuda", idx)) != NVIDIA:
        found = BlockwiseSupport(False, "ROCm: the 1x128 x 128x128 recipe is cuBLASLt's (sm90)")
    elif cap[0] != 9:
        found = BlockwiseSupport(False, f"cuBLASLt's 128x128 block scaling runs on sm90 only, not sm{cap[0]}{cap[1]}")
    else:
        found = probe(torch.device("cuda", idx))
    _support[idx] = found
    return found
