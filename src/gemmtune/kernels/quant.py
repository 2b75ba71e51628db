"""Dynamic activation quantization kernels: per-token (one scale per row) and 1x128 groups.

One pass over x instead of torch's four (abs, amax, divide, cast): at decode the 8-bit GEMM after
it takes a few microseconds, so a chain of small torch kernels before it would eat the gain. The
math is the plain-PyTorch quantizers' (quant/quantize.py): scale = max(amax, 1e-12) / qmax,
q = clamp(x / scale) cast to the format (int8: rounded half away from zero; torch rounds half to
even, so an exact tie may differ by one step).
"""

from __future__ import annotations

import torch

from ..quant.formats import SCALE_DTYPE, is_fp8, qmax
from ..quant.layouts import m_major as m_major_view
from ..quant.quantize import quantize_1x128, quantize_per_token
from ._common import HAS_TRITON, gdc_launch_dependents, gdc_wait, tl, triton  # noqa: F401 - gdc_* in kernels
from ._common import pdl_kwargs as _pdl_kwargs
from .launch import Plans, bind, cached_launch, tensor_signature

if HAS_TRITON:  # the kernels; the quantizers below run their references where Triton cannot

    @triton.jit
    def _to_q(y, QMAX: tl.constexpr, IS_INT: tl.constexpr, q_ty: tl.constexpr):
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_INT:
            y = tl.where(y >= 0, tl.floor(y + 0.5), tl.ceil(y - 0.5))
        return y.to(q_ty)

    @triton.jit
    def quantize_rows(y, QMAX: tl.constexpr, IS_INT: tl.constexpr, q_ty: tl.constexpr):
        """(q, scale [R]) of the fp32 tile y [R, C], one scale per tile row (zeros past the data change nothing)."""
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), 1e-12) / QMAX
        return _to_q(y / scale[:, None], QMAX, IS_INT, q_ty), scale

    @triton.jit
    def row_piece(row_ptr, START: tl.constexpr, SIZE: tl.constexpr, width):
        """(offsets, fp32 values) of the SIZE-wide piece of a row from START (zero past `width`)."""
        offs = START + tl.arange(0, SIZE)
        return offs, tl.load(row_ptr + offs, mask=offs < width, other=0.0).to(tl.float32)

    @triton.jit
    def store_piece(row_ptr, offs, values, scale, width, QMAX: tl.constexpr, IS_INT: tl.constexpr):
        tl.store(row_ptr + offs, _to_q(values / scale, QMAX, IS_INT, row_ptr.dtype.element_ty), mask=offs < width)

    @triton.jit(do_not_specialize=["K"])
    def _per_token_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, QMAX: tl.constexpr, IS_INT: tl.constexpr,
                          BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, TAIL: tl.constexpr = 0,
                          PDL: tl.constexpr = False):  # fmt: skip
        """One row a program. ONE_PASS: the row is read once, as one BLOCK-wide piece and a TAIL-wide one after
        it (row_launch; 0: none), kept in registers for the amax and the values; else two passes over
        BLOCK-wide chunks."""
        if PDL:  # see norms.py: the 8-bit GEMM after it may start prefetching its weights; x is the last kernel's
            gdc_launch_dependents()
            gdc_wait()
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        q_row = q_ptr + row * K
        if ONE_PASS:
            o0, x0 = row_piece(x_row, 0, BLOCK, K)
            amax = tl.max(tl.abs(x0), axis=0)
            if TAIL > 0:
                o1, x1 = row_piece(x_row, BLOCK, TAIL, K)
                amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=0))
            scale = tl.maximum(amax, 1e-12) / QMAX
            tl.store(s_ptr + row, scale)
            store_piece(q_row, o0, x0, scale, K, QMAX, IS_INT)
            if TAIL > 0:
                store_piece(q_row, o1, x1, scale, K, QMAX, IS_INT)
        else:
            offs = tl.arange(0, BLOCK)
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for k in range(0, K, BLOCK):
                x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / QMAX
            tl.store(s_ptr + row, scale)
            for k in range(0, K, BLOCK):
                x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
                q = _to_q(x / scale, QMAX, IS_INT, q_ptr.dtype.element_ty)
                tl.store(q_row + k + offs, q, mask=k + offs < K)

    @triton.jit
    def _group_kernel(x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm, stride_sm, stride_sg, QMAX: tl.constexpr,
                      IS_INT: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr,
                      PDL: tl.constexpr = False):  # fmt: skip
        """GROUPS consecutive 128-wide groups of one row: a [GROUPS, GROUP] tile, one scale per tile row."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        row = tl.program_id(0)
        gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        offs = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        ok = offs < K  # also masks groups past the last one
        x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        q, scale = quantize_rows(x, QMAX, IS_INT, q_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_sm + gs * stride_sg, scale, mask=gs < n_groups)
        tl.store(q_ptr + row * K + offs, q, mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


# A row up to this wide is read once and kept on chip (32 warps: 32 values a thread). Two passes read x
# twice: at M=1024, K=8192 on an H100 that quantizer ran at ~1 TB/s, slower than the fp8 GEMM it fed gained.
ONE_PASS_MAX = 32768
# A row read in one pass is one block of next_power_of_2(K) values, or a block and a tail where that pads
# most: a 17408-wide row took a 32768 block, twice the registers a thread of 16384 and half the programs an
# SM. The second piece costs a second reduction, which loses where few rows leave latency exposed
# (benchmarks/experiments/exp_quant_pieces.py); so only from TAIL_MIN_ROWS rows, and where the two pieces
# are at most TAIL_MAX_FILL of the block.
TAIL_MIN_ROWS = 1024
TAIL_MAX_FILL = 0.75
LEAST_TAIL = 16

_PER_TOKEN, _GROUPS = Plans(), Plans()  # the launches of each kernel, per signature


def row_pieces(width: int, rows: int) -> tuple[int, ...]:
    """The power-of-two pieces a one-pass kernel reads a `width`-wide row in, for `rows` rows: (block,) or
    (block, tail), the block the largest power of two below width (the note above TAIL_MIN_ROWS)."""
    whole = triton.next_power_of_2(max(width, LEAST_TAIL))
    if rows < TAIL_MIN_ROWS or whole == width:
        return (whole,)
    head = whole // 2
    tail = max(LEAST_TAIL, triton.next_power_of_2(width - head))
    return (head, tail) if head + tail <= TAIL_MAX_FILL * whole else (whole,)


def row_launch(width: int, rows: int = 1, one_pass_max: int = ONE_PASS_MAX) -> dict:
    """BLOCK, TAIL (0: none), ONE_PASS and num_warps of a per-token kernel over `rows` rows `width` wide,
    one row a program: the whole row in row_pieces up to one_pass_max values, else 4096-wide blocks in two
    passes; 16 values a thread (up to 32 warps)."""
    whole = triton.next_power_of_2(width)
    if whole > one_pass_max:
        block = min(4096, whole)
        return {"BLOCK": block, "TAIL": 0, "ONE_PASS": False, "num_warps": 4 if block <= 2048 else block // 512}
    pieces = row_pieces(width, rows)
    total = sum(pieces)
    warps = 4 if total <= 2048 else min(32, triton.next_power_of_2(triton.cdiv(total, 512)))
    return {"BLOCK": pieces[0], "TAIL": pieces[1] if len(pieces) > 1 else 0, "ONE_PASS": True, "num_warps": warps}


def launch_per_token(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor, one_pass_max: int = ONE_PASS_MAX) -> None:
    """Fill q [M, K] and s [M, 1] from x2 [M, K] (unit stride along K)."""
    m, k = x2.shape
    if not m:
        return
    signature = (tensor_signature(x2), q.dtype, one_pass_max)
    kept = _PER_TOKEN.get(signature)
    if kept is not None:
        kept(x2, q, s)
    else:
        _PER_TOKEN.put(signature, bind(_per_token_kernel, (m,), x2, q, s, k, x2.stride(0), QMAX=qmax(q.dtype),
                                       IS_INT=not is_fp8(q.dtype), **row_launch(k, m, one_pass_max),
                                       **_pdl_kwargs(x2.device)))  # fmt: skip


def group_launch(m: int, groups: int) -> tuple[tuple[int, int], dict]:
    """(grid, GROUPS and num_warps) of a 1x128 kernel over m rows of `groups` groups: up to 8 groups (1024
    elements) a program."""
    per = min(8, triton.next_power_of_2(groups))
    return (m, triton.cdiv(groups, per)), {"GROUPS": per, "num_warps": 4 if per >= 4 else 1}


def launch_1x128(x2: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Fill q [M, K] and s [M, ceil(K/128)] (any strides: M-major or row-major) from x2 [M, K]."""
    m, k = x2.shape
    groups = s.shape[1]
    if m:
        grid, per = group_launch(m, groups)
        signature = (tensor_signature(x2), q.dtype, s.stride())
        cached_launch(
            _GROUPS, signature, _group_kernel, grid,
            x2, q, s, k, groups, x2.stride(0), s.stride(0), s.stride(1), QMAX=qmax(q.dtype),
            IS_INT=not is_fp8(q.dtype), GROUP=128, **per, **_pdl_kwargs(x2.device),
        )  # fmt: skip


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [..., K], scale [..., 1] fp32): quantize_per_token in one kernel (CUDA; CPU: the reference)."""
    if x.device.type != "cuda":
        return quantize_per_token(x, dtype)
    x2 = _rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), device=x.device, dtype=dtype)
    s = torch.empty((m, 1), device=x.device, dtype=SCALE_DTYPE)
    launch_per_token(x2, q, s)
    return q.view(x.shape), s.view(*x.shape[:-1], 1)


def scales_1x128(m: int, k: int, device, m_major: bool) -> torch.Tensor:
    """An empty fp32 [M, ceil(K/128)] scale grid, M-major (quant/layouts.py) or row-major."""
    groups = triton.cdiv(k, 128)
    if m_major:
        return torch.empty((groups, m), device=device, dtype=SCALE_DTYPE).t()
    return torch.empty((m, groups), device=device, dtype=SCALE_DTYPE)


def quantize_1x128_triton(x: torch.Tensor, dtype: torch.dtype, m_major: bool = False):
    """(q [..., K], scale [M, ceil(K/128)] fp32): quantize_1x128 in one kernel (CUDA; CPU: the reference).

    m_major=True stores the scales M-major (what cuBLASLt's block-scaled GEMM reads) and returns them
    as the 2-D [M, K/128] grid, M = the product of x's leading dims; otherwise [..., K/128] row-major.
    """
    if x.device.type != "cuda":
        q, s = quantize_1x128(x, dtype)
        return (q, m_major_view(s.reshape(-1, s.shape[-1]))) if m_major else (q, s)
    x2 = _rows(x)
    m, k = x2.shape
    q = torch.empty((m, k), device=x.device, dtype=dtype)
    s = scales_1x128(m, k, x.device, m_major)
    launch_1x128(x2, q, s)
    return q.view(x.shape), (s if m_major else s.view(*x.shape[:-1], s.shape[1]))


quantize_per_token_ref = quantize_per_token
quantize_1x128_ref = quantize_1x128
