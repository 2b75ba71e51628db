"""The a16w16 `blaslt` backend: explicit cuBLASLt algorithms (through nvmath-python's cuBLASLt bindings).

cuBLAS runs one algorithm per shape, picked by its heuristic. This backend offers many: the heuristic's
ranked list for the shape plus neighbours of its best entries (split-K factors, custom options, CTA
swizzle, cluster shape), each checked with cublasLtMatmulAlgoCheck; names, enumeration and the version
check are lib/blaslt.py's.

Runners call cublasLtMatmul directly on torch's current stream, on the caller's tensors (no copies
except to fix a misaligned or non-unit-stride input), with the bias added by the BIAS epilogue.
Layout: cuBLASLt is column-major, so y[M, N] = x @ w^T is computed as y^T[N, M] = w[N, K] @ x^T,
with A = w (transposed), B = x, D = y^T (the layout cuBLAS uses for F.linear).
"""

from __future__ import annotations

import logging

import torch

from ...keys import GemmKey
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
    workspace,
)

log = logging.getLogger(__name__)


class BlasLtBackend(LtBackend):
    def key_ok(self, key: GemmKey) -> bool:
        if key.scaleAB or key.bpreshuffle or key.dtype not in CUDA_TYPE or key.outdtype not in CUDA_TYPE:
            return False
        # fp16/bf16 in -> same or fp32 out; fp32 in -> fp32 out
        return key.dtype == key.outdtype or key.outdtype == torch.float32

    def problem(self, key: GemmKey, device: torch.device) -> Problem:
        return Problem(key, max(key.M, 1), key.K, key.bias, device_index(device))

    def runner(self, spec: AlgoSpec, key: GemmKey, device: torch.device) -> Runner:
        return LtRunner(spec, key, device_index(device))


class LtRunner:
    """runner(x, w, bias) -> y for one algorithm; descriptors per (M, ld, bias) are made once."""

    def __init__(self, spec: AlgoSpec, key: GemmKey, device_index: int):
        import numpy as np

        self.spec, self.key, self.dev = spec, key, device_index
        self.lt = bindings()[0]
        self.handle = handle(device_index)
        self.ws = workspace(device_index)
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        # Addresses read once: ndarray.ctypes costs microseconds per access on the hot path.
        self._alpha_addr, self._beta_addr = self.alpha.ctypes.data, self.beta.ctypes.data
        self._ws_addr = self.ws.data_ptr()
        self._plans: dict[tuple[int, int, bool], tuple[Problem, object, int]] = {}
        self.algo_bytes = None
        self._plan(max(key.M, 1), key.K, key.bias)  # the key's own problem, checked now
        # Pointer alignment the algorithm assumes for x (B) and w (A); others are copied first.
        self.align_x = max(ALIGN, cap_or(self.algo_bytes, "MIN_ALIGNMENT_B_BYTES", ALIGN))
        self.align_w = max(ALIGN, cap_or(self.algo_bytes, "MIN_ALIGNMENT_A_BYTES", ALIGN))

    def _plan(self, m: int, ldx: int, bias: bool):
        got = self._plans.get((m, ldx, bias))
        if got is not None:
            return got
        prob = Problem(self.key, m, ldx, bias, self.dev)
        algo = algo_from_spec(self.spec, prob)
        if prob.check(algo) is None:
            # Another M (untuned-M rule) or stride the algorithm does not cover: cuBLASLt's own pick.
            ranked = prob.heuristic(1, min_align=ALIGN)
            if not ranked:
                raise RuntimeError(f"cuBLASLt has no algorithm for {self.key.describe()} at M={m} ld={ldx}")
            log.info("blaslt %s does not run M=%d ld=%d; using cuBLASLt's heuristic there", self.spec.name, m, ldx)
            algo = ranked[0][0]
        if self.algo_bytes is None:
            self.algo_bytes = algo
        arr = algo_array(algo)
        got = (prob, arr, arr.ctypes.data)  # the array stays alive beside its address
        self._plans[(m, ldx, bias)] = got
        return got

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        key = self.key
        x2 = x if x.dim() == 2 else x.reshape(-1, key.K)
        if x2.shape[1] != key.K or tuple(w.shape) != (key.N, key.K) or not x.dtype == w.dtype == key.dtype:
            raise ValueError(
                f"blaslt runner for {key.describe()} got x {tuple(x.shape)} {x.dtype}, w {tuple(w.shape)} {w.dtype}"
            )
        # Unusual strides or alignment: an aligned contiguous copy (never on the normal path).
        if (
            x2.stride(1) != 1
            or x2.stride(0) < key.K
            or x2.data_ptr() % self.align_x
            or (x2.stride(0) * x2.element_size()) % ALIGN
        ):
            x2 = x2.clone(memory_format=torch.contiguous_format)
        if w.stride(1) != 1 or w.stride(0) != key.K or w.data_ptr() % self.align_w:
            w = w.clone(memory_format=torch.contiguous_format)
        m = x2.shape[0]
        y = torch.empty((m, key.N), dtype=key.outdtype, device=x.device)
        if m:
            prob, _algo, algo_addr = self._plan(m, x2.stride(0), bias is not None)
            if bias is not None:
                if bias.dtype != key.outdtype or bias.data_ptr() % ALIGN or bias.stride(0) != 1:
                    bias = bias.to(key.outdtype).clone(memory_format=torch.contiguous_format)
                prob.set_bias(bias.data_ptr())
            yp = y.data_ptr()
            self.lt.matmul(
                self.handle,
                prob.desc,
                self._alpha_addr,
                w.data_ptr(),
                prob.a,
                x2.data_ptr(),
                prob.b,
                self._beta_addr,
                yp,
                prob.d,
                yp,
                prob.d,
                algo_addr,
                self._ws_addr,
                WORKSPACE_BYTES,
                current_stream(self.dev),
            )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], key.N)


BACKENDS = (BlasLtBackend(),)
