"""The sparse family's `torch` backend (what an untuned key runs): runner(x [M, K], w sparse [N, K], bias)
-> y [M, N].

Solutions:
- `sparse`: the pattern's own kernel in the weight's dtype: torch.sparse (cuSPARSE on CUDA, MKL on the
  CPU) for csr / coo / bsr, F.linear on a SparseSemiStructuredTensor (cuSPARSELt / CUTLASS) for 2:4;
- `sparse_fp32`: the same with the values widened to fp32 per call (the CPU's MKL has no fp16 / bf16
  sparse matmul; correct everywhere, slow);
- `dense`: the weight's dense twin (made once per weight object and kept while it lives) through
  F.linear. It costs the dense weight's memory; a tuned table picks it only where it wins.
Which combinations torch runs is found by a tiny probe per (pattern, dtype, block, device type).
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from ...families.sparse import LAYOUTS, SparseKey, to_pattern
from ...quant.semi_structured import prune_2_4_dense, semi_structured_reason
from ..base import Backend, Runner, Solution, stable_solidx

SPARSE = Solution("torch", "sparse", stable_solidx("sparse"), 0)
SPARSE_FP32 = Solution("torch", "sparse_fp32", stable_solidx("sparse_fp32"), 0)
DENSE = Solution("torch", "dense", stable_solidx("dense"), 0)
_ALL = (SPARSE, SPARSE_FP32, DENSE)

_twins: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def dense_twin(w: torch.Tensor) -> torch.Tensor:
    """w.to_dense(), made once per weight object (dropped when the weight is freed). A weight whose
    values change in place keeps its old twin: call forget_dense_twin(w) after such a change."""
    ent = _twins.get(id(w))
    if ent is not None and ent[0]() is w:
        return ent[1]
    dense = w.to_dense()
    key = id(w)
    _twins[key] = (weakref.ref(w, lambda _r: _twins.pop(key, None)), dense)
    return dense


def forget_dense_twin(w: torch.Tensor) -> None:
    _twins.pop(id(w), None)


def _sparse_mm(x, w, bias):
    y = (w @ x.t()).t()  # torch.sparse multiplies sparse @ dense: (W x^T)^T
    return y + bias if bias is not None else y


def _sparse_mm_fp32(x, w, bias):
    y = (w.to(torch.float32) @ x.t().float()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _semi_linear(x, w, bias):
    return F.linear(x, w, bias)


def _dense_linear(x, w, bias):
    return F.linear(x, dense_twin(w), bias)


@functools.cache
def _probe(pattern: str, dtype: torch.dtype, block: str, device_type: str, index: int | None) -> bool:
    """Does torch run `pattern` x `dtype` (x `block`) natively on this device? One tiny product."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    r, c = (int(v) for v in block.split("x")) if block else (1, 1)
    n, k = (64, 64) if pattern == "2:4" else (2 * r, 4 * c)
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(n, k, generator=gen)
    if pattern == "2:4":
        dense = prune_2_4_dense(dense)
    else:  # one empty block row, one full
        dense[:r] = 0
    dense = dense.to(dtype).to(device)
    x = torch.randn(16, k, generator=gen).to(dtype).to(device)
    try:
        if pattern == "2:4" and semi_structured_reason(device, dtype, (n, k)):
            return False
        y = (_semi_linear if pattern == "2:4" else _sparse_mm)(x, to_pattern(dense, pattern, block), None)
    except (RuntimeError, NotImplementedError, ValueError, TypeError):
        return False
    ref = x.float() @ dense.float().t()
    return bool(((y.float() - ref).norm() <= 1e-2 * ref.norm()).item())


def native_ok(key: SparseKey, device: torch.device, dtype: torch.dtype | None = None) -> bool:
    return _probe(key.pattern, dtype or key.dtype, key.block, device.type, device.index)


class TorchSparseBackend(Backend):
    name = "torch"
    family = "sparse"

    def candidates(self, key: SparseKey, device: torch.device) -> list[Solution]:
        return [s for s in _ALL if self.supports(s, key, device)]

    def default_solution(self, key: SparseKey, device: torch.device) -> Solution:
        # The weight's own format, widened if torch lacks the dtype here, the dense twin as a last resort.
        return next(s for s in _ALL if self.supports(s, key, device))

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        return next((s for s in _ALL if s.kernel_name == kernel_name), None)

    def supports(self, solution: Solution, key: SparseKey, device: torch.device) -> bool:
        if solution == SPARSE:
            return native_ok(key, device)
        if solution == SPARSE_FP32:
            return key.pattern in LAYOUTS and key.dtype != torch.float32 and native_ok(key, device, torch.float32)
        return solution == DENSE

    def make_runner(self, solution: Solution, key: SparseKey, device: torch.device) -> Runner:
        if not self.supports(solution, key, device):
            raise ValueError(f"torch cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
        if solution == DENSE:
            return _dense_linear
        if solution == SPARSE_FP32:
            return _sparse_mm_fp32
        return _semi_linear if key.pattern == "2:4" else _sparse_mm


BACKENDS = (TorchSparseBackend(),)
