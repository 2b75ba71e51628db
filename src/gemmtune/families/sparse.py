"""sparse: y[M, N] = x[M, K] @ w[N, K]^T (+ bias) with a sparse weight (sparse_gemm, ops/sparse.py).

Patterns: csr, coo, bsr (aiter's 'block') as torch.sparse tensors, and 2:4 semi-structured as torch's
SparseSemiStructuredTensor (cuSPARSELt / CUTLASS on NVIDIA GPUs). The key has the pattern, the density
rounded up to a bucket (one row answers every weight of about that density) and the BSR block shape,
since all three decide whether the sparse kernel or the dense twin is faster. Runners are called as
runner(x [M, K], w sparse [N, K], bias [N] | None) -> y [M, N] in the weight's dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..checks import FLOAT_DTYPES
from ..kernels.gemm_ref import fp32_matmul
from ..keys import dtype_name
from ..quant.semi_structured import prune_2_4_dense, semi_structured
from .base import Column, Family, bool_col, dtype_col, generator, int_col, inv_sqrt, randn

PATTERNS = ("csr", "coo", "bsr", "2:4")
ALIASES = {"block": "bsr"}  # aiter's spelling
DENSITY_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
LAYOUTS = {"csr": torch.sparse_csr, "coo": torch.sparse_coo, "bsr": torch.sparse_bsr}


def density_bucket(density: float) -> float:
    """The smallest bucket >= density (a weight of density 0.27 tunes as 0.3)."""
    for b in DENSITY_BUCKETS:
        if density <= b * (1 + 1e-9):
            return b
    return 1.0


def _density(text: str) -> float:
    v = float(text)
    if not 0 < v <= 1:
        raise ValueError("density must be in (0, 1]")
    return density_bucket(v)


def _pattern(text: str) -> str:
    v = ALIASES.get(text.strip().lower(), text.strip().lower())
    if v not in PATTERNS:
        raise ValueError(f"expected one of {', '.join(PATTERNS)} (or 'block' for bsr)")
    return v


def parse_block(text: str) -> str:
    """'' (no blocks) or 'RxC' with positive R and C."""
    t = text.strip().lower()
    if not t:
        return ""
    r, sep, c = t.partition("x")
    if not sep or not r.isdigit() or not c.isdigit() or int(r) < 1 or int(c) < 1:
        raise ValueError("block must be empty or 'RxC' (e.g. 16x16)")
    return f"{int(r)}x{int(c)}"


class SparseKey(NamedTuple):
    M: int
    N: int
    K: int
    pattern: str = "csr"
    density: float = 0.5
    block: str = ""  # BSR block shape 'RxC'; '' for the other patterns
    bias: bool = False
    dtype: torch.dtype = torch.bfloat16

    @property
    def outdtype(self) -> torch.dtype:
        return self.dtype

    def block_shape(self) -> tuple[int, int]:
        r, _, c = self.block.partition("x")
        return int(r), int(c)

    def describe(self) -> str:
        blk = f" {self.block}" if self.block else ""
        b = "+bias" if self.bias else ""
        return (f"M={self.M} N={self.N} K={self.K}{b} {self.pattern}{blk} density<={self.density:g} "
                f"{dtype_name(self.dtype)}")  # fmt: skip


def sparse_mask(shape, density: float, device, gen, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """A random keep-mask of `shape` with about `density` kept, in whole blocks."""
    n, k = shape
    r, c = block
    keep = torch.rand((n // r, k // c), device=device, generator=gen) < density
    return keep.repeat_interleave(r, 0).repeat_interleave(c, 1)


def to_pattern(dense: torch.Tensor, pattern: str, block: str = "") -> torch.Tensor:
    """A dense [N, K] weight (already zero where pruned) in the sparse storage of `pattern`."""
    if pattern == "csr":
        return dense.to_sparse_csr()
    if pattern == "coo":
        return dense.to_sparse().coalesce()
    if pattern == "bsr":
        r, _, c = block.partition("x")
        return dense.to_sparse_bsr((int(r), int(c)))
    return semi_structured(dense)


class Sparse(Family):
    name = "sparse"
    description = "GEMM with a sparse weight: CSR / COO / BSR (torch.sparse), 2:4 (cuSPARSELt) (sparse_gemm)"
    ops = ("sparse_gemm",)
    env_var = "GEMMTUNE_CONFIG_SPARSE"
    key_type = SparseKey
    key_columns = (
        int_col("M"), int_col("N"), int_col("K"), Column("pattern", "pattern", _pattern, str, None),
        Column("density", "density", _density, lambda v: f"{v:g}", 1.0),
        Column("block", "block", parse_block, str, ""), bool_col("bias"), dtype_col("dtype"),
    )  # fmt: skip
    tuned_columns = (
        "gfx", "cu_num", "M", "N", "K", "bias", "dtype", "libtype", "solidx", "splitK", "us", "kernelName",
        "err_ratio", "tflops", "bw", "pattern", "density", "block",
    )  # fmt: skip
    untuned_columns = ("M", "N", "K", "bias", "dtype", "pattern", "density", "block")
    computed_dtypes = {"dtype": FLOAT_DTYPES}
    signature = frozenset({"M", "N", "K", "pattern"})
    excludes = frozenset({"B", "q_dtype_w", "kernelId", "token", "act"})
    name_hints = ("sparse",)

    def parse_key(self, raw, parse_column):
        vals = {c.field: parse_column(c.name, c.parse, c.default) for c in self.key_columns}
        pattern = vals["pattern"]

        def block_for(text: str) -> str:
            blk = parse_block(text)
            if bool(blk) != (pattern == "bsr"):
                raise ValueError("a bsr row needs a block 'RxC'; other patterns none")
            return blk

        vals["block"] = parse_column("block", block_for, None if pattern == "bsr" else "")
        if pattern == "2:4":
            vals["density"] = 0.5
        return SparseKey(**vals)

    def describe(self, key: SparseKey) -> str:
        return key.describe()

    def out_dtype(self, key: SparseKey) -> torch.dtype:
        return key.dtype

    def make_inputs(self, key: SparseKey, device, sets, seed):
        gen = generator(device, seed)
        out = []
        for _ in range(sets):
            x = randn((key.M, key.K), device, gen, key.dtype)
            w = randn((key.N, key.K), device, gen, torch.float32, inv_sqrt(key.K * key.density))
            if key.pattern == "2:4":
                w = prune_2_4_dense(w)
            else:
                block = key.block_shape() if key.pattern == "bsr" else (1, 1)
                w = w * sparse_mask((key.N, key.K), key.density, device, gen, block)
            b = randn((key.N,), device, gen, key.dtype) if key.bias else None
            out.append((x, to_pattern(w.to(key.dtype), key.pattern, key.block), b))
        return out

    def set_bytes(self, key: SparseKey) -> int:
        return self.bytes(key)

    def reference(self, key: SparseKey, inputs):
        x, w, b = inputs
        y = fp32_matmul(x, w.to_dense().t())
        return y + b.float() if b is not None else y

    def output_shape(self, key: SparseKey):
        return (key.M, key.N)

    def check_variants(self, key: SparseKey, inputs):
        x, w, b = inputs
        wide = torch.full((key.M, key.K + 8), float("nan"), dtype=x.dtype, device=x.device)
        wide[:, : key.K] = x
        return [("x [M, K] with padded rows", (wide[:, : key.K], w, b), (key.M, key.N))]

    def weight_bytes(self, key: SparseKey) -> int:
        nnz = key.N * key.K * key.density
        e = key.dtype.itemsize
        if key.pattern == "2:4":
            return int(nnz * e + nnz / 8)  # values plus 2-bit indices (cuSPARSELt's metadata)
        if key.pattern == "bsr":
            r, c = key.block_shape()
            return int(nnz * e + nnz / (r * c) * 8)
        return int(nnz * (e + 8 * (2 if key.pattern == "coo" else 1)))

    def bytes(self, key: SparseKey) -> int:
        e = key.dtype.itemsize
        return key.M * key.K * e + self.weight_bytes(key) + key.M * key.N * e

    def flops(self, key: SparseKey) -> int:
        return int(2 * key.M * key.N * key.K * key.density)


FAMILY = Sparse()
