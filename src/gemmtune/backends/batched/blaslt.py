"""The batched family's `blaslt` backend: cuBLASLt strided-batched algorithms (through nvmath-python).

The cuBLASLt machinery of lib/blaslt.py ( algorithm enumeration, stable names with
the cuBLASLt version, re-creation from attributes, the check) applied to one strided-batched problem:
every matrix layout carries BATCH_COUNT = B and its STRIDED_BATCH_OFFSET.

Layout: cuBLASLt is column-major, so c[M, N] = a[M, K] @ b[K, N] per batch is computed as
c^T[N, M] = b^T @ a^T, with A = b and B = a. A row-major view X[R, C] with strides (sr, sc) is read as
the column-major (C, R) matrix with ld = sr when sc == 1 (op N), or as (R, C) with ld = sc, transposed,
when sr == 1 (op T): so a and b are used in place whatever their layout, as long as one stride of each
is 1 and leading dimensions and batch strides keep 16-byte alignment; anything else is copied first.
"""

from __future__ import annotations

import functools

import torch

from ...families.batched import BatchedKey, stored
from ...kernels._common import empty_out as _empty  # tests swap in a NaN-filled allocation
from ..base import Runner
from ..lib.blaslt import (
    ALIGN,
    CUDA_TYPE,
    WORKSPACE_BYTES,
    AlgoSpec,
    LtBackend,
    Problem,
    algo_array,
    algo_from_spec,
    bindings,
    cap_or,
    current_stream,
    device_index,
    handle,
    operand_layout,
    set_attr,
    workspace,
)


def blas_layout(key: BatchedKey, sa: tuple[int, ...], sb: tuple[int, ...], aligned: bool = True):
    """(A = b's layout + batch stride, B = a's layout + batch stride) for logical a (B, M, K) and
    b (B, K, N) with strides sa, sb; None when they cannot be used in place (with `aligned`, also when
    a leading dimension or batch stride is not a multiple of 16 bytes)."""
    la = operand_layout(key.K, key.N, sb[1], sb[2])
    lb = operand_layout(key.M, key.K, sa[1], sa[2])
    if la is None or lb is None:
        return None
    e = key.dtype.itemsize
    if aligned and any((v * e) % ALIGN for v in (la[3], lb[3], sb[0] if key.B > 1 else 0, sa[0] if key.B > 1 else 0)):
        return None
    return (*la, sb[0]), (*lb, sa[0])


def _key_strides(key: BatchedKey) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Strides of a and b in the key's stored layouts (what the tuner's inputs have)."""
    a = stored(torch.empty((key.B, key.M, key.K), device="meta"), key.transA)
    b = stored(torch.empty((key.B, key.K, key.N), device="meta"), key.transB)
    return a.stride(), b.stride()


class BatchedProblem(Problem):
    """cuBLASLt descriptors for one strided-batched layout of a key (heuristic, check and cleanup are
    the a16w16 problem's)."""

    def __init__(self, key: BatchedKey, layout, device_index: int):
        (op_a, ra, ca, lda, sa), (op_b, rb, cb, ldb, sb) = layout
        self.describe_matmul(key, device_index, op_a, op_b, "DEFAULT")
        a_t, d_t = self.types[0], self.types[3]
        self.a = self._layout(a_t, ra, ca, lda, key.B, sa)
        self.b = self._layout(a_t, rb, cb, ldb, key.B, sb)
        self.d = self._layout(d_t, key.N, key.M, key.N, key.B, key.M * key.N)
        self.c = self.d

    def _layout(self, dtype: int, rows: int, cols: int, ld: int, batch: int, stride: int) -> int:
        lt = self.lt
        lay = lt.matrix_layout_create(dtype, rows, cols, ld)
        lset = functools.partial(set_attr, lt.matrix_layout_set_attribute, lt.get_matrix_layout_attribute_dtype)
        lset(lay, lt.MatrixLayoutAttribute.BATCH_COUNT, batch)
        lset(lay, lt.MatrixLayoutAttribute.STRIDED_BATCH_OFFSET, stride)
        return lay


class BlasLtBatchedBackend(LtBackend):
    """Availability, names and table rows are lib/blaslt.py's; the problem is strided-batched."""

    family = "batched"

    def runner_scope(self, solution, key) -> tuple:
        return tuple(key)  # a strided-batched problem is described for one M (measured: another M failed)

    def key_ok(self, key: BatchedKey) -> bool:
        if key.dtype not in CUDA_TYPE or key.outdtype not in CUDA_TYPE:
            return False
        return key.dtype == key.outdtype or key.outdtype == torch.float32

    def problem(self, key: BatchedKey, device: torch.device) -> BatchedProblem:
        layout = blas_layout(key, *_key_strides(key), aligned=False)
        return BatchedProblem(key, layout, device_index(device))

    def sizes_ok(self, key: BatchedKey) -> bool:
        return min(key.B, key.M, key.N, key.K) >= 1

    def runner(self, spec: AlgoSpec, key: BatchedKey, device: torch.device) -> Runner:
        return LtBatchedRunner(spec, key, device)


_COPY = None  # a plan entry meaning: these strides are copied to contiguous operands first


class LtBatchedRunner:
    """runner(a, b) -> c for one algorithm; descriptors per stride pattern of (a, b) are made once."""

    def __init__(self, spec: AlgoSpec, key: BatchedKey, device: torch.device):
        import numpy as np

        self.spec, self.key, self.dev = spec, key, device_index(device)
        self.lt = bindings()[0]
        self.handle = handle(self.dev)
        self._ws_addr = workspace(self.dev).data_ptr()
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        self._alpha_addr, self._beta_addr = self.alpha.ctypes.data, self.beta.ctypes.data
        self.shape_a, self.shape_b = (key.B, key.M, key.K), (key.B, key.K, key.N)
        self.out_shape = (key.B, key.M, key.N)
        self._out_like = torch.empty(0, dtype=key.outdtype, device=device)
        self._plans: dict[tuple, tuple | None] = {}
        contiguous = ((key.M * key.K, key.K, 1), (key.K * key.N, key.N, 1))
        # Copied operands use this plan, aligned or not (the check and heuristic decide there).
        self._contiguous = self._plan(*contiguous, aligned=False)
        self._plan(*_key_strides(key), aligned=False)  # the tuned layout, checked now
        algo = self._contiguous[1].tobytes()
        self.align = max(ALIGN, cap_or(algo, "MIN_ALIGNMENT_A_BYTES", ALIGN),
                         cap_or(algo, "MIN_ALIGNMENT_B_BYTES", ALIGN))  # fmt: skip

    def _plan(self, sa: tuple, sb: tuple, aligned: bool = True):
        layout = blas_layout(self.key, sa, sb, aligned)
        plan = _COPY
        if layout is not None:
            prob = BatchedProblem(self.key, layout, self.dev)
            algo = algo_from_spec(self.spec, prob)
            if prob.check(algo) is None:
                # A stride pattern the algorithm does not cover: cuBLASLt's own pick for it.
                ranked = prob.heuristic(1, min_align=ALIGN)
                algo = ranked[0][0] if ranked else None
            if algo is not None:
                arr = algo_array(algo)
                plan = (prob, arr, arr.ctypes.data)  # the array stays alive beside its address
        if plan is _COPY and not aligned:
            raise RuntimeError(f"cuBLASLt has no algorithm for {self.key.describe()} with strides {sa}, {sb}")
        self._plans[(sa, sb)] = plan
        return plan

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        key = self.key
        if a.shape != self.shape_a or b.shape != self.shape_b or a.dtype != key.dtype or b.dtype != key.dtype:
            raise ValueError(
                f"blaslt batched runner for {key.describe()} got a {tuple(a.shape)} {a.dtype}, "
                f"b {tuple(b.shape)} {b.dtype}"
            )
        sa, sb = a.stride(), b.stride()
        plan = self._plans[(sa, sb)] if (sa, sb) in self._plans else self._plan(sa, sb)
        if plan is _COPY or a.data_ptr() % self.align or b.data_ptr() % self.align:
            # Strides cuBLASLt cannot take in place, or a misaligned view: contiguous copies.
            a = a.clone(memory_format=torch.contiguous_format)
            b = b.clone(memory_format=torch.contiguous_format)
            plan = self._contiguous
        prob, _algo, algo_addr = plan
        c = _empty(self.out_shape, self._out_like)
        cp = c.data_ptr()
        self.lt.matmul(
            self.handle, prob.desc, self._alpha_addr, b.data_ptr(), prob.a, a.data_ptr(), prob.b,
            self._beta_addr, cp, prob.d, cp, prob.d, algo_addr, self._ws_addr, WORKSPACE_BYTES,
            current_stream(self.dev),
        )  # fmt: skip
        return c


BACKENDS = (BlasLtBatchedBackend(),)
