"""Triton batched GEMM: c[b] = a[b] @ b[b] for every batch b, fp32 accumulation, output in its own dtype.

a is a logical (B, M, K) view and b a logical (B, K, N) view with any strides (either operand may be
stored transposed, batch-strided inside a wider tensor, or broadcast with batch stride 0); c is
written through its strides. The grid is (M tiles x N tiles, B, split-K): tiles of one batch are
walked in grouped order (GROUP_M row-tiles per weight column-tile, for L2 reuse), batches one after
another. The tile main loop, tile order and epilogue are the a16w16 Triton GEMM's (kernels/triton_gemm.py).

Split-K (for few output tiles and a long K, e.g. DeepSeek MLA's per-head GEMMs at tp 8) is reduced
deterministically, in one of two ways:
- 'r': each split stores its fp32 partial tile, then a reduce kernel adds the partials in split order
  and casts (two launches);
- 'f': the same partials, but the last split to arrive at a tile (per-tile arrival counter) adds them
  in split order, casts and re-arms the counter (one launch).
`batched_gemm_ref` is the plain-PyTorch reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton
import triton.language as tl

from ._common import empty_out as _empty
from .tile_config import GemmTileConfig
from .triton_gemm import (
    split_k_range,
    store_partial_arrive,
    sum_partials,
    tile_coords,
    tile_epilogue,
    tile_mainloop,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GRID_YZ = 65535  # CUDA's limit on grid dimensions 1 and 2 (batches, splits)


def batched_gemm_ref(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference the kernel must match: the fp32 product of the same inputs, rounded once."""
    return torch.bmm(a.float(), b.float()).to(out_dtype or a.dtype)


@dataclass(frozen=True)
class BmmConfig(GemmTileConfig):
    """One explicit kernel config; `name` is the stable id stored in tables."""

    PREFIX: ClassVar[str] = "bmm"
    MAX_SPLIT_K: ClassVar[int | None] = MAX_GRID_YZ  # splits are grid dimension 2


def parse_config(name: str) -> BmmConfig | None:
    """The config a kernel name spells, or None when it is not one of ours."""
    return BmmConfig.parse(name)


# M and the split-K factor are runtime values so one compiled kernel serves every M and split.
@triton.jit
def _store(acc, y, M, N, sym, syn, pid_m, pid_n, BM: tl.constexpr, BN: tl.constexpr):
    """The plain epilogue: cast and store the tile (no bias, scales or activation)."""
    tile_epilogue(
        acc, y, y, M, N, sym, syn, pid_m, pid_n, BM, BN, False, y, 0, 0, 1.0, 0.0, False, False, 0, y, y, 0, 0
    )  # fmt: skip


@triton.jit(do_not_specialize=["M", "split_k"])
def _bmm_kernel(
    a, b, c, part, lock, M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, split_k,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    IS_SPLIT: tl.constexpr, FIXUP: tl.constexpr, EVEN_K: tl.constexpr, INPUT_PREC: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)  # batch offsets pass 2^31 elements on large shapes
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    a += batch * sab
    b += batch * sbb
    c += batch * scb
    k_tiles = tl.cdiv(K, BK)
    kt0, kt1 = split_k_range(k_tiles, split_k, 2, IS_SPLIT)
    # The a16w16 main loop computes x[M, K] @ w[N, K]^T from w's (N, K) strides: b's (K, N) swapped.
    acc = tile_mainloop(
        a, b, M, N, K, sam, sak, sbn, sbk, pid_m, pid_n, kt0, kt1,
        BM, BN, BK, EVEN_K, False, INPUT_PREC, STAGES, False,
    )  # fmt: skip
    if not IS_SPLIT:
        _store(acc, c, M, N, scm, scn, pid_m, pid_n, BM, BN)
    else:
        pid_k = tl.program_id(2)
        # Partials live per (batch, tile) as [split_k, BM, BN] fp32 blocks: contiguous, no masks.
        slot = batch * (num_pid_m * num_pid_n) + tile
        offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
        tile_part = part + slot * (split_k * BM * BN)
        if FIXUP:
            arrived = store_partial_arrive(acc, tile_part, offs, pid_k, lock, slot, BM, BN)
            if arrived == split_k - 1:  # the last split adds all partials (its own included)
                acc = sum_partials(tile_part, offs, split_k, BM, BN, ".cg")
                _store(acc, c, M, N, scm, scn, pid_m, pid_n, BM, BN)
                tl.atomic_xchg(lock + slot, 0, sem="relaxed", scope="gpu")  # ready for the next call
        else:
            tl.store(tile_part + pid_k * (BM * BN) + offs, acc)


@triton.jit(do_not_specialize=["M", "split_k"])
def _bmm_reduce(
    part, c, M, N, scb, scm, scn, split_k,
    BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # One program per (tile, batch): adds its split_k partial blocks in order, casts, stores.
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    pid_m, pid_n = tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
    offs = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    tile_part = part + (batch * (num_pid_m * num_pid_n) + tile) * (split_k * BM * BN)
    acc = sum_partials(tile_part, offs, split_k, BM, BN, "")  # a default constexpr str reaches Triton 3.6 as a bare str
    _store(acc, c + batch * scb, M, N, scm, scn, pid_m, pid_n, BM, BN)


class BmmKernel:
    """A config bound to one problem (B, M, N, K, output dtype, device): `kernel.run(a, b)` returns c.

    Everything that does not depend on the operands' strides (grid, workspace size, the split-K
    arrival counters, launch constants) is settled here, once."""

    def __init__(self, cfg: BmmConfig, B: int, M: int, N: int, K: int, out_dtype: torch.dtype, device: torch.device):
        self.cfg = cfg.validate()
        if B > MAX_GRID_YZ:
            raise ValueError(f"{cfg.name}: batch {B} exceeds the grid limit {MAX_GRID_YZ}")
        if out_dtype not in _DTYPES:
            raise ValueError(f"{cfg.name}: unsupported output dtype {out_dtype}")
        self.B, self.M, self.N, self.K = B, M, N, K
        self.out_shape = (B, M, N)
        self.tiles = triton.cdiv(M, cfg.bm) * triton.cdiv(N, cfg.bn)
        self.grid = (self.tiles, B, cfg.split_k)
        self._out_like = torch.empty(0, dtype=out_dtype, device=device)  # dtype + device for _empty
        split = cfg.split_k > 1
        self._part_numel = B * self.tiles * cfg.split_k * cfg.bm * cfg.bn if split else 0
        # Per-(batch, tile) arrival counters for the in-kernel fixup; every call leaves them at zero.
        self._lock = torch.zeros(B * self.tiles, dtype=torch.int32, device=device) if cfg.sk_mode == "f" else None
        self._const = dict(
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, IS_SPLIT=split, FIXUP=cfg.sk_mode == "f",
            EVEN_K=K % cfg.bk == 0, STAGES=cfg.stages, num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip

    def run(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """c = a @ b per batch, a new (B, M, N) tensor; a, b must have this kernel's shapes."""
        c = _empty(self.out_shape, self._out_like)
        if self.M and self.N and self.B:
            self.launch(a, b, c)
        return c

    def launch(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        cfg = self.cfg
        part = c  # placeholder pointer when K is not split
        if self._part_numel:
            part = torch.empty(self._part_numel, dtype=torch.float32, device=c.device)
        lock = self._lock if self._lock is not None else c
        sab, sam, sak = a.stride()
        sbb, sbk, sbn = b.stride()
        scb, scm, scn = c.stride()
        prec = "ieee" if a.dtype == torch.float32 else "tf32"  # fp32 inputs: true fp32 products
        _bmm_kernel[self.grid](
            a, b, c, part, lock, self.M, self.N, self.K,
            sab, sam, sak, sbb, sbk, sbn, scb, scm, scn, cfg.split_k,
            INPUT_PREC=prec, **self._const,
        )  # fmt: skip
        if cfg.sk_mode == "r":
            _bmm_reduce[(self.tiles, self.B)](
                part, c, self.M, self.N, scb, scm, scn, cfg.split_k,
                BM=cfg.bm, BN=cfg.bn, GROUP_M=cfg.group_m, num_warps=4,
            )  # fmt: skip


def check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """Raise naming the problem for operands the kernel cannot take (logical (B, M, K) and (B, K, N))."""
    if a.dim() != 3 or b.dim() != 3:
        raise ValueError(f"batched gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must be 3-D")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(
            f"batched gemm: a {tuple(a.shape)} and b {tuple(b.shape)} do not match (need a[B, M, K], b[B, K, N])"
        )
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"batched gemm: dtypes a {a.dtype}, b {b.dtype} (need equal fp16/bf16/fp32)")
    if a.device != b.device:
        raise ValueError(f"batched gemm: a on {a.device}, b on {b.device}")


def batched_gemm_triton(
    a: torch.Tensor, b: torch.Tensor, cfg: BmmConfig, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """One-off call (tests, examples); the backend binds a BmmKernel once per shape instead."""
    check_operands(a, b)
    B, M, K = a.shape
    kern = BmmKernel(cfg, B, M, b.shape[2], K, out_dtype or a.dtype, a.device)
    return kern.run(a, b)
