"""The epilogue family's `blaslt` backend: cuBLASLt algorithms with the matmul epilogue set (through
nvmath-python), y = act(alpha * x @ w^T + beta * C + bias) in one cublasLtMatmul.

The cuBLASLt machinery of lib/blaslt.py ( problem descriptors, algorithm enumeration,
stable names with the cuBLASLt version, re-creation from attributes, the check, the workspace) with:
- act and bias: CUBLASLT_EPILOGUE_DEFAULT / BIAS / RELU / RELU_BIAS / GELU / GELU_BIAS (`lt_epilogue`).
  The bias (BIAS_POINTER, set before each call; BIAS_DATA_TYPE the out dtype) has one value per row of
  the column-major D = y^T, i.e. per output column n, as nn.Linear's. cuBLASLt's GELU is the tanh
  approximation: gelu_tanh keys use it as it is; gelu (erf) keys only with a 16-bit output, under a
  name ending in `_tanh`, the tuner's check against the erf reference deciding (families/epilogue.py).
- alpha and beta: cublasLtMatmul's host scalars (fp32), written before each call; a CUDA graph keeps
  the values of its capture, as the Triton runner's scalar arguments do.
- C: a full (M, N) C is cuBLASLt's C matrix, read in place with its own row stride (D is a fresh
  output). A row (N,) or scalar C adds the same values to every output row, as a bias does: beta * C
  (+ bias) is folded into the bias vector first (one small kernel over N values). A column (M, 1) C has
  no cuBLASLt form: no candidates.
- Operands: x with padded rows and w in either storage order ([N, K] or [K, N]) are read in place as
  op N / op T layouts (as the batched backend's operands); other strides, and a pointer below the
  algorithm's alignment, are copied first.

Names: the a16w16 backend's (`lt130200_a66_t20_s35_k1_r0_w0_c0_i0_cl2`), with `_tanh` appended for an
erf-GELU key, so a table row shows where the tanh GELU stands in.
"""

from __future__ import annotations

import torch

from ...families.epilogue import EpilogueKey, tanh_for_erf
from ..base import Runner
from ..lib.blaslt import (
    ALIGN,
    CUDA_TYPE,
    AlgoSpec,
    LtBackend,
    Problem,
    algo_array,
    cap_or,
    device_index,
    fitted_algo,
    operand_layout,
    workspace,
)

TANH = "_tanh"  # the name tag of a tanh-GELU algorithm standing in for an erf-GELU key
_ACT = {"none": "", "relu": "RELU", "gelu": "GELU", "gelu_tanh": "GELU"}
_FOLDED = ("row", "scalar")  # C kinds added through the bias vector


def lt_epilogue(key: EpilogueKey) -> str | None:
    """The cublasLtEpilogue_t name that computes the key's act and bias; None where cuBLASLt has none (a
    column C; an erf GELU where the tanh one may not stand in)."""
    if key.act not in _ACT or key.c == "col" or (key.act == "gelu" and not tanh_for_erf(key)):
        return None
    act = _ACT[key.act]
    if key.bias or key.c in _FOLDED:
        return f"{act}_BIAS" if act else "BIAS"
    return act or "DEFAULT"


def name_tag(key: EpilogueKey) -> str:
    """What a kernel name adds to the algorithm's name for `key`."""
    return TANH if key.act == "gelu" else ""


def split_name(name: str) -> tuple[AlgoSpec | None, str]:
    """(the algorithm a kernel name names or None, its tag)."""
    name = name.strip()
    tag = TANH if name.endswith(TANH) else ""
    return AlgoSpec.parse(name[: len(name) - len(tag)]), tag


def key_strides(key: EpilogueKey) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int] | None]:
    """Strides of x, w and the C matrix (None: no C matrix) as the tuner's inputs have them."""
    w = (key.K, 1) if key.w_layout == "nk" else (1, key.N)
    return (key.K, 1), w, ((key.N, 1) if key.c == "full" else None)


def lt_layout(key: EpilogueKey, m: int, sx: tuple, sw: tuple, sc: tuple | None):
    """(A = w's (op, rows, cols, ld), B = x's, ld of C or None) for x [m, K], w [N, K] and a full C
    [m, N] with strides sx, sw, sc (None: no C); None when one of them cannot be read in place."""
    la = operand_layout(key.K, key.N, sw[1], sw[0])  # op(A) = w = (w^T)^T
    lb = operand_layout(m, key.K, sx[0], sx[1])  # op(B) = x^T
    if la is None or lb is None:
        return None
    if sc is None:
        return la, lb, None
    if sc[1] != 1 or (m > 1 and sc[0] < key.N):
        return None
    return la, lb, sc[0] if m > 1 else key.N


class EpilogueProblem(Problem):
    """cuBLASLt descriptors for one (key, M, layout of x / w / C) with the key's epilogue (heuristic,
    check, launch and cleanup are the a16w16 problem's)."""

    def __init__(self, key: EpilogueKey, m: int, layout, device_index: int):
        (op_a, ra, ca, lda), (op_b, rb, cb, ldb), ldc = layout
        self.describe_matmul(key, device_index, op_a, op_b, lt_epilogue(key))
        lt, (a_t, _, _, d_t) = self.lt, self.types
        self.a = lt.matrix_layout_create(a_t, ra, ca, lda)
        self.b = lt.matrix_layout_create(a_t, rb, cb, ldb)
        self.d = lt.matrix_layout_create(d_t, key.N, m, key.N)  # y [m, N] = y^T [N, m] col-major
        self.c = self.d if ldc is None else lt.matrix_layout_create(d_t, key.N, m, ldc)


class BlasLtEpilogueBackend(LtBackend):
    """Availability, version check, enumeration and table rows are lib/blaslt.py's."""

    family = "epilogue"

    def key_ok(self, key: EpilogueKey) -> bool:
        if key.dtype not in CUDA_TYPE or key.outdtype not in CUDA_TYPE or lt_epilogue(key) is None:
            return False
        return key.dtype == key.outdtype or key.outdtype == torch.float32

    def sizes_ok(self, key: EpilogueKey) -> bool:
        return min(key.N, key.K) >= 1  # M == 0 is checked as M == 1

    def split_name(self, name: str) -> tuple[AlgoSpec | None, str]:
        return split_name(name)

    def name_tag(self, key: EpilogueKey) -> str:
        return name_tag(key)

    def problem(self, key: EpilogueKey, device: torch.device) -> EpilogueProblem:
        m = max(key.M, 1)
        return EpilogueProblem(key, m, lt_layout(key, m, *key_strides(key)), device_index(device))

    def runner(self, spec: AlgoSpec, key: EpilogueKey, device: torch.device) -> Runner:
        return LtEpilogueRunner(spec, key, device)


class LtEpilogueRunner:
    """runner(x, w, bias, c, alpha, beta) -> y for one algorithm, any M; descriptors per (M, strides of
    x, w, C) are made once (None: those strides are copied to contiguous operands first)."""

    def __init__(self, spec: AlgoSpec, key: EpilogueKey, device: torch.device):
        import numpy as np

        self.spec, self.key, self.dev = spec, key, device_index(device)
        self._ws_addr = workspace(self.dev).data_ptr()
        self.scalars = np.array([1.0, 0.0], dtype=np.float32)  # alpha, beta: read by each cublasLtMatmul
        self._alpha_addr = self.scalars.ctypes.data  # read once: ndarray.ctypes is slow
        self._beta_addr = self._alpha_addr + 4
        self.fold = key.c in _FOLDED
        self._plans: dict[tuple, tuple | None] = {}
        plan = self._plan(max(key.M, 1), *key_strides(key))  # the tuned problem, checked now
        algo = plan[1].tobytes()
        self.align_w, self.align_x, self.align_c = (
            max(ALIGN, cap_or(algo, f"MIN_ALIGNMENT_{op}_BYTES", ALIGN)) for op in "ABC"
        )

    def _plan(self, m: int, sx: tuple, sw: tuple, sc: tuple | None):
        layout = lt_layout(self.key, m, sx, sw, sc)
        plan = None
        if layout is not None:
            prob = EpilogueProblem(self.key, m, layout, self.dev)
            algo = fitted_algo(self.spec, prob)
            if algo is None:
                raise RuntimeError(
                    f"cuBLASLt has no algorithm for {self.key.describe()} at M={m}, strides x {sx} w {sw} C {sc}"
                )
            arr = algo_array(algo)
            plan = (prob, arr, arr.ctypes.data)  # the array stays alive beside its address
        self._plans[(m, sx, sw, sc)] = plan
        return plan

    def _fold(self, bias: torch.Tensor | None, c: torch.Tensor, beta: float) -> torch.Tensor:
        """beta * C (+ bias) as one bias vector: C is a row or a scalar, the same (N,) values per row."""
        row = c[0]
        v = row * beta if bias is None else torch.add(bias, row, alpha=beta)
        return v.to(self.key.outdtype).contiguous()

    def __call__(self, x, w, bias, c, alpha: float, beta: float) -> torch.Tensor:
        key = self.key
        use_c = c is not None and beta != 0.0
        if (
            x.dim() != 2 or x.shape[1] != key.K or tuple(w.shape) != (key.N, key.K)
            or not x.dtype == w.dtype == key.dtype or (bias is not None) != key.bias or use_c != key.beta
        ):  # fmt: skip
            raise ValueError(
                f"blaslt epilogue runner for {key.describe()} got x {tuple(x.shape)} {x.dtype}, w "
                f"{tuple(w.shape)} {w.dtype}, bias {bias is not None}, C {c is not None} with beta {beta}"
            )
        m = x.shape[0]
        y = torch.empty((m, key.N), dtype=key.outdtype, device=x.device)
        if m == 0:
            return y
        if not use_c:
            c, beta = None, 0.0
        elif self.fold:
            bias, c, beta = self._fold(bias, c, beta), None, 0.0
        elif c.dtype != key.outdtype:
            c = c.to(key.outdtype)
        pk = (m, x.stride(), w.stride(), None if c is None else c.stride())
        plan = self._plans[pk] if pk in self._plans else self._plan(*pk)
        if (
            plan is None or x.data_ptr() % self.align_x or w.data_ptr() % self.align_w
            or (c is not None and c.data_ptr() % self.align_c)
        ):  # fmt: skip
            # Strides cuBLASLt cannot take in place, or a misaligned view: contiguous copies.
            x, w = x.clone(memory_format=torch.contiguous_format), w.clone(memory_format=torch.contiguous_format)
            c = None if c is None else c.clone(memory_format=torch.contiguous_format)
            pk = (m, x.stride(), w.stride(), None if c is None else c.stride())
            plan = self._plans[pk] if pk in self._plans else self._plan(*pk)
        prob, _algo, algo_addr = plan
        if prob.bias:
            if bias.dtype != key.outdtype or bias.data_ptr() % ALIGN or bias.stride(0) != 1:
                bias = bias.to(key.outdtype).clone(memory_format=torch.contiguous_format)
            prob.set_bias(bias.data_ptr())
        self.scalars[0], self.scalars[1] = alpha, beta
        yp = y.data_ptr()
        cp = yp if c is None else c.data_ptr()
        prob.matmul(algo_addr, self._alpha_addr, self._beta_addr, w.data_ptr(), x.data_ptr(), cp, yp, self._ws_addr)
        return y


BACKENDS = (BlasLtEpilogueBackend(),)
