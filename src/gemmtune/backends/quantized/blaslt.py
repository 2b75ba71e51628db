"""The a8w8 families' `blaslt` backend: fp8 (e4m3) GEMMs with their scales, as explicit cuBLASLt algorithms
(through nvmath-python's bindings). Also serves the a8w8_bpreshuffle twin: on NVIDIA its weight is the
plain [N, K] one (quant/shuffle.py).

y[M, N] = (xq[M, K] * x_scale) @ (wq[N, K] * w_scale)^T (+ bias) is one cublasLtMatmul in the a16w16
layout (lib/blaslt.py): A = wq (op T), B = xq (op N), D = y^T [N, M], fp32 compute. cuBLASLt applies the
scales (Problem.describe_scales): per_token keys as OUTER_VEC_32F on both operands (A's scale pointer the
N weight scales, B's the M activation scales), per_tensor keys as the default SCALAR_32F (one fp32 each).
A bias goes through the BIAS epilogue in the output dtype. bf16, fp16 and fp32 outputs are offered as far
as cuBLASLt's heuristic and check accept them for the key (a key they refuse gets no candidates, and
the untuned default runs something else). Not offered: int8, the fnuz fp8 (key_ok), and N or K not a
multiple of 16 (cuBLASLt's fp8 GEMMs need 16-byte leading dimensions: sizes_ok).

Accumulation: FAST_ACCUM off (fp32 accumulation all along K, torch._scaled_mm's default numerics) or on
(Hopper's fp8 fast accumulation: faster, less precise). The kernel name says which: a fast-accumulation
algorithm's name ends in `_fa` (`lt130100_a66_t20_s35_k1_r0_w0_c0_i0_cl2_fa`). The tuner gets both as
candidates and its check against the fp32 reference decides; the untuned default (default_solution) is
the heuristic's pick of the accumulation the policy asks for (quantized/policy.py).

Runners call cublasLtMatmul on torch's current stream with the caller's tensors (copies only for a
misaligned or non-unit-stride operand), descriptors made once per (M, row stride of xq, bias), the scale
and bias pointers set before every call (a CUDA graph keeps those of its capture).
"""

from __future__ import annotations

import logging

import torch

from ...device import NVIDIA, Needs
from ...quant import formats
from ..base import Runner, Solution
from ..lib.blaslt import (
    ALIGN,
    CUDA_R_8F_E4M3,
    CUDA_TYPE,
    OP_N,
    OP_T,
    AlgoSpec,
    LtBackend,
    Problem,
    algo_array,
    algo_attrs,
    cap_or,
    device_index,
    fitted_algo,
    lt_version,
    workspace,
)

log = logging.getLogger(__name__)

FAST = "_fa"  # the name tag of an algorithm run with FAST_ACCUM on
SCALE_MODES = {"per_token": "OUTER_VEC_32F", "per_tensor": None}  # None: cuBLASLt's default, SCALAR_32F
DIM_MULTIPLE = 16  # N and K: cuBLASLt's fp8 GEMMs take leading dimensions of 16 elements only
SCALE_ALIGN = 16  # a per-row scale vector at a lower address alignment is copied first


def split_name(name: str) -> tuple[AlgoSpec | None, str]:
    """(the algorithm a kernel name names or None, its tag: FAST or "")."""
    name = name.strip()
    tag = FAST if name.endswith(FAST) else ""
    return AlgoSpec.parse(name[: len(name) - len(tag)]), tag


class A8W8Problem(Problem):
    """cuBLASLt descriptors for one (key, M, row stride of xq, bias or not, accumulation)."""

    def __init__(self, key, m: int, ldx: int, bias: bool, fast: bool, device_index: int):
        d_t = CUDA_TYPE[key.outdtype]
        types = (CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, d_t, d_t)
        self.describe_matmul(key, device_index, OP_T, OP_N, "BIAS" if bias else "DEFAULT", types)
        self.describe_scales(SCALE_MODES[key.scale], fast, device_index)
        lt = self.lt
        self.a = lt.matrix_layout_create(CUDA_R_8F_E4M3, key.K, key.N, key.K)  # wq [N, K] = [K, N] col-major
        self.b = lt.matrix_layout_create(CUDA_R_8F_E4M3, key.K, m, ldx)  # xq [M, K], row stride ldx
        self.d = lt.matrix_layout_create(d_t, key.N, m, key.N)  # y [M, N] = y^T [N, M] col-major
        self.c = self.d


class BlasLtA8W8Backend(LtBackend):
    """Availability, version check, enumeration and table rows are lib/blaslt.py's."""

    family = "a8w8"
    needs = Needs(vendors=frozenset({NVIDIA}), min_capability=(8, 9), modules=("nvmath",))

    def key_ok(self, key) -> bool:
        fp8 = formats.FP8 is not None and key.q_dtype_w == formats.FP8
        return fp8 and key.scale in SCALE_MODES and key.outdtype in CUDA_TYPE

    def sizes_ok(self, key) -> bool:
        return key.N > 0 and key.K > 0 and key.N % DIM_MULTIPLE == 0 and key.K % DIM_MULTIPLE == 0

    def split_name(self, name: str) -> tuple[AlgoSpec | None, str]:
        return split_name(name)

    def name_tags(self, key) -> tuple[str, ...]:
        return ("", FAST)

    def problem(self, key, device: torch.device) -> A8W8Problem:
        return self.problem_for(key, device, "")

    def problem_for(self, key, device: torch.device, tag: str) -> A8W8Problem:
        return A8W8Problem(key, max(key.M, 1), key.K, key.bias, tag == FAST, device_index(device))

    def tagged_candidates(self, key, device: torch.device, tag: str) -> list[Solution]:
        try:
            return super().tagged_candidates(key, device, tag)
        except Exception as exc:  # noqa: BLE001 - cuBLASLt refuses the problem (out dtype, bias, scale mode)
            log.info("blaslt %s%s: cuBLASLt offers nothing (%s)", key.describe(), tag, exc)
            return []

    def default_solution(self, key, device: torch.device, fast: bool = False) -> Solution | None:
        """cuBLASLt's heuristic pick for `key` with the plain accumulation (`fast`: with FAST_ACCUM on),
        under the name a table row would give it; None where this backend cannot run the key or cuBLASLt
        has no algorithm for it."""
        device = torch.device(device)
        if device.type != "cuda" or not (self.is_available(device) and self.key_ok(key) and self.sizes_ok(key)):
            return None
        tag = FAST if fast else ""
        try:
            ranked = self.problem_for(key, device, tag).heuristic(1)
        except Exception as exc:  # noqa: BLE001 - cuBLASLt refuses the problem
            log.info("blaslt %s%s: no cuBLASLt default (%s)", key.describe(), tag, exc)
            return None
        return self.solution(AlgoSpec(lt_version(), algo_attrs(ranked[0][0])), tag) if ranked else None

    def runner(self, spec: AlgoSpec, key, device: torch.device, fast: bool = False) -> Runner:
        return LtA8W8Runner(spec, key, fast, device_index(device))

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        spec, tag = self.split_name(solution.kernel_name)
        if spec is None or not self.supports(solution, key, device):
            raise ValueError(f"blaslt cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
        return self.runner(spec, key, device, fast=tag == FAST)


class BlasLtA8W8BPreshuffleBackend(BlasLtA8W8Backend):
    family = "a8w8_bpreshuffle"


class LtA8W8Runner:
    """runner(xq, wq, x_scale, w_scale, bias) -> y for one algorithm and accumulation, any M; descriptors
    per (M, row stride of xq, bias or not) are made once."""

    def __init__(self, spec: AlgoSpec, key, fast: bool, device_index: int):
        import numpy as np

        self.spec, self.key, self.fast, self.dev = spec, key, fast, device_index
        self.scalars = np.array([1.0, 0.0], dtype=np.float32)  # alpha, beta
        self._alpha_addr = self.scalars.ctypes.data  # read once: ndarray.ctypes is slow
        self._beta_addr = self._alpha_addr + 4
        self._ws_addr = workspace(device_index).data_ptr()
        self.w_shape = (key.N, key.K)
        self.per_token = key.scale == "per_token"
        self._plans: dict[tuple[int, int, bool], tuple[A8W8Problem, object, int]] = {}
        algo = self._plan(max(key.M, 1), key.K, key.bias)[1].tobytes()  # the key's own problem, checked now
        # Pointer alignment the algorithm assumes for xq (B) and wq (A); others are copied first.
        self.align_x = max(ALIGN, cap_or(algo, "MIN_ALIGNMENT_B_BYTES", ALIGN))
        self.align_w = max(ALIGN, cap_or(algo, "MIN_ALIGNMENT_A_BYTES", ALIGN))

    def _plan(self, m: int, ldx: int, bias: bool):
        prob = A8W8Problem(self.key, m, ldx, bias, self.fast, self.dev)
        algo = fitted_algo(self.spec, prob)  # another M or stride than the tuned one: cuBLASLt's own pick
        if algo is None:
            raise RuntimeError(f"cuBLASLt has no fp8 algorithm for {self.key.describe()} at M={m} ld={ldx}")
        arr = algo_array(algo)
        plan = self._plans[(m, ldx, bias)] = (prob, arr, arr.ctypes.data)  # the array lives beside its address
        return plan

    def _bad(self, **tensors) -> ValueError:
        got = ", ".join(f"{n} {tuple(t.shape)} {t.dtype}" for n, t in tensors.items() if t is not None)
        return ValueError(f"blaslt a8w8 runner for {self.key.describe()} got {got}")

    def __call__(self, xq, wq, xs, ws, bias=None) -> torch.Tensor:
        key, fp8 = self.key, formats.FP8
        m = xq.shape[0] if xq.dim() == 2 else -1
        nx, nw = (m, key.N) if self.per_token else (1, 1)
        if (
            m < 0 or xq.shape[1] != key.K or tuple(wq.shape) != self.w_shape or xq.dtype != fp8 or wq.dtype != fp8
            or xs.numel() != nx or ws.numel() != nw or xs.dtype != torch.float32 or ws.dtype != torch.float32
            or (bias is not None and bias.numel() != key.N)
        ):  # fmt: skip
            raise self._bad(xq=xq, wq=wq, x_scale=xs, w_scale=ws, bias=bias)
        y = torch.empty((m, key.N), dtype=key.outdtype, device=xq.device)
        if m == 0:
            return y
        # Unusual strides or alignment: an aligned contiguous copy (never on the ops' canonical views).
        if (
            xq.stride(1) != 1 or xq.data_ptr() % self.align_x
            or (m > 1 and (xq.stride(0) < key.K or xq.stride(0) % ALIGN))
        ):  # fmt: skip
            xq = xq.clone(memory_format=torch.contiguous_format)
        if wq.stride(1) != 1 or wq.stride(0) != key.K or wq.data_ptr() % self.align_w:
            wq = wq.clone(memory_format=torch.contiguous_format)
        if self.per_token:  # the vectors are read as N (M) packed floats
            if not xs.is_contiguous() or xs.data_ptr() % SCALE_ALIGN:
                xs = xs.clone(memory_format=torch.contiguous_format)
            if not ws.is_contiguous() or ws.data_ptr() % SCALE_ALIGN:
                ws = ws.clone(memory_format=torch.contiguous_format)
        pk = (m, xq.stride(0) if m > 1 else key.K, bias is not None)
        prob, _algo, algo_addr = self._plans[pk] if pk in self._plans else self._plan(*pk)
        if bias is not None:
            if bias.dtype != key.outdtype or bias.data_ptr() % ALIGN or bias.stride(-1) != 1:
                bias = bias.to(key.outdtype).clone(memory_format=torch.contiguous_format)
            prob.set_bias(bias.data_ptr())
        prob.set_scales(ws.data_ptr(), xs.data_ptr())
        yp = y.data_ptr()
        prob.matmul(algo_addr, self._alpha_addr, self._beta_addr, wq.data_ptr(), xq.data_ptr(), yp, yp, self._ws_addr)
        return y


BACKENDS = (BlasLtA8W8Backend(), BlasLtA8W8BPreshuffleBackend())
