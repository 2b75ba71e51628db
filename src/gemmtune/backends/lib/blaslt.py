"""cuBLASLt machinery (through nvmath-python's bindings) shared by the `blaslt` backends of the a16w16,
batched, epilogue and a8w8 families: the library and its version, matmul problem descriptors (with
per-operand scales for fp8), algorithm enumeration (the heuristic's ranked list, neighbours of its best
picks, the wide space), stable algorithm names, re-creation from attributes and the check, and
`LtBackend`, the backend logic they share (each family describes its own problem and runner).

A solution is named by the algorithm's config attributes and the library version
(`lt130200_a66_t20_s35_k1_r0_w0_c0_i0_cl2`: algo id, tile, stages, split-K, reduction scheme, CTA
swizzle, custom option, inner shape, cluster shape), and is re-created from those attributes
(cublasLtMatmulAlgoInit + config attributes), not from a heuristic rank, so a table row means the same
kernel after a restart. A row written under another cuBLASLt version is refused (the ids may mean other
kernels there) and the caller falls back, with a log line saying why.

`GEMMTUNE_BLASLT_SEARCH=wide` adds the whole space the library lists for the key's types (every
algorithm id x tile x stages x cluster shape that cublasLtMatmulAlgoCheck accepts, ~700 on an H100
for bf16): measured over the prefill suite's 40 points with 32 <= M <= 512, it gained 0.5% geomean
over the default list (up to 5% at one point; benchmarks/results/h100/prefill_triton_blaslt_vs_cublas/), for ~10x the
tuning time, so it is opt-in.

On ROCm the hipBLASLt equivalent would live beside this; it needs an AMD GPU to build and test, so the
backends declare NVIDIA only.
"""

from __future__ import annotations

import functools
import logging
import re
from abc import abstractmethod
from dataclasses import dataclass

import torch

from ... import settings
from ...device import NVIDIA, Needs
from ...keys import GemmKey
from ..base import Backend, Runner, Solution, stable_solidx

log = logging.getLogger(__name__)

WORKSPACE_BYTES = 32 * 2**20  # what PyTorch gives cuBLASLt on Hopper
HEURISTIC_LIMIT = 64
EXPAND_TOP = 6  # neighbours (split-K, custom option, swizzle, cluster) are tried for this many picks
SPLITK_FACTORS = (2, 3, 4, 6, 8, 12, 16)
CUSTOM_OPTIONS_MAX = 7
CLUSTER_SHAPES = (2, 3, 4, 5, 6)  # cublasLtClusterShape_t: 1x1x1, 2x1x1, 4x1x1, 1x2x1, 2x2x1
MAX_CANDIDATES = 96
WIDE_LIMIT = 4000  # GEMMTUNE_BLASLT_SEARCH=wide: at most this many more
ALIGN = 16  # bytes the runner requires of x, w, bias pointers (it copies inputs that are not)

# cudaDataType_t values (library_types.h): stable ABI numbers.
CUDA_TYPE = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
CUDA_R_32F = 0
CUDA_R_8F_E4M3 = 28  # torch.float8_e4m3fn
OP_N, OP_T = 0, 1

# Config attributes that identify an algorithm, in name order: (attribute, name tag).
ATTRS = (
    ("ID", "a"),
    ("TILE_ID", "t"),
    ("STAGES_ID", "s"),
    ("SPLITK_NUM", "k"),
    ("REDUCTION_SCHEME", "r"),
    ("CTA_SWIZZLING", "w"),
    ("CUSTOM_OPTION", "c"),
    ("INNER_SHAPE_ID", "i"),
    ("CLUSTER_SHAPE_ID", "cl"),
)
NAME_RE = re.compile(r"^lt(\d+)" + "".join(rf"_{tag}(\d+)" for _, tag in ATTRS) + "$")


@dataclass(frozen=True)
class AlgoSpec:
    """An algorithm as its identifying attributes plus the cuBLASLt version they belong to."""

    version: int
    attrs: tuple[int, ...]  # values of ATTRS, in order

    @property
    def name(self) -> str:
        parts = (f"_{tag}{v}" for (_, tag), v in zip(ATTRS, self.attrs, strict=True))
        return f"lt{self.version}" + "".join(parts)

    @property
    def split_k(self) -> int:
        return self.attrs[3]

    @classmethod
    def parse(cls, name: str) -> AlgoSpec | None:
        m = NAME_RE.match(name.strip())
        if m is None:
            return None
        vals = [int(v) for v in m.groups()]
        return cls(vals[0], tuple(vals[1:]))


# ---- the library, loaded lazily ----------------------------------------------------------------
# ---- the library, loaded lazily ----------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def bindings():
    """(cublasLt bindings module, cublas bindings module); raises ImportError with the reason."""
    from nvmath.bindings import cublas, cublasLt  # optional extra: gemmtune[blaslt]

    return cublasLt, cublas


@functools.lru_cache(maxsize=1)
def library_missing() -> str:
    """Why nvmath-python's cuBLASLt bindings cannot be used here ("" when they can)."""
    try:
        lt, _ = bindings()
        lt.get_version()
    except Exception as exc:  # noqa: BLE001 - any load failure makes the backends unavailable
        return f"nvmath-python's cuBLASLt bindings cannot be loaded ({type(exc).__name__}: {exc})"
    return ""


@functools.lru_cache(maxsize=1)
def lt_version() -> int:
    return int(bindings()[0].get_version())


@functools.cache
def handle(device_index: int) -> int:
    with torch.cuda.device(device_index):
        return bindings()[0].create()


# The raw handle of the current stream: what Triton's launcher reads too, ~10x cheaper than
# torch.cuda.current_stream().cuda_stream on the hot path (that builds a Stream object each call).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """torch's current stream on `device_index`, as the handle cuBLASLt takes."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@functools.cache
def workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _np():
    import numpy as np

    return np


def set_attr(setter, dtype_of, obj: int, attr, value) -> None:
    np = _np()
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


def get_attr(getter, dtype_of, obj: int, attr) -> int:
    np = _np()
    buf = np.zeros(1, dtype=dtype_of(attr))
    written = np.zeros(1, dtype=np.uint64)
    getter(obj, attr, buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return int(buf[0])


class Problem:
    """cuBLASLt descriptors for one (key, M, ld of x, bias or not); owns and frees them."""

    def __init__(self, key: GemmKey, m: int, ldx: int, bias: bool, device_index: int):
        self.describe_matmul(key, device_index, OP_T, OP_N, "BIAS" if bias else "DEFAULT")
        lt, (a_t, _, _, d_t) = self.lt, self.types
        self.a = lt.matrix_layout_create(a_t, key.K, key.N, key.K)  # w [N, K] row-major = [K, N] col-major
        self.b = lt.matrix_layout_create(a_t, key.K, m, ldx)  # x [M, K] (row stride ldx)
        self.d = lt.matrix_layout_create(d_t, key.N, m, key.N)  # y [M, N] = y^T [N, M] col-major
        self.c = self.d

    def describe_matmul(self, key, device_index: int, op_a: int, op_b: int, epilogue: str, types=None) -> None:
        """The matmul descriptor: A/B in the key's dtype, C/D in its out dtype (or `types`: the A, B, C, D
        cudaDataType_t codes), fp32 compute and scale, the two ops and the epilogue (a cublasLtEpilogue_t
        name). A *BIAS epilogue reads its bias in D's type, from the pointer set_bias() sets before each
        call. Subclasses add the layouts."""
        lt, cublas = bindings()
        self.lt, self.key = lt, key
        self.handle, self.device_index = handle(device_index), device_index
        if types is None:
            a_t, d_t = CUDA_TYPE[key.dtype], CUDA_TYPE[key.outdtype]
            types = (a_t, a_t, d_t, d_t)
        self.types, d_t = tuple(types), types[3]
        self.compute = int(cublas.ComputeType.COMPUTE_32F)
        self.desc = lt.matmul_desc_create(self.compute, CUDA_R_32F)
        dset = functools.partial(set_attr, lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype)
        A = lt.MatmulDescAttribute
        dset(self.desc, A.TRANSA, op_a)
        dset(self.desc, A.TRANSB, op_b)
        self.bias = epilogue.endswith("BIAS")
        if epilogue != "DEFAULT":
            dset(self.desc, A.EPILOGUE, int(getattr(lt.Epilogue, epilogue)))
        if self.bias:
            dset(self.desc, A.BIAS_DATA_TYPE, d_t)  # the runner hands a bias in the output dtype
        np = _np()
        self._bias_ptr = np.zeros(1, dtype=np.int64)
        self._bias_addr = self._bias_ptr.ctypes.data  # ndarray.ctypes is slow: read the address once
        self._bias_attr = int(A.BIAS_POINTER)

    def set_bias(self, ptr: int) -> None:
        self._bias_ptr[0] = ptr
        self.lt.matmul_desc_set_attribute(self.desc, self._bias_attr, self._bias_addr, 8)

    def describe_scales(self, mode: str | None, fast_accum: bool, device_index: int) -> None:
        """Per-operand scales of an fp8 matmul, D = scale_A * scale_B * op(A) @ op(B): A's and B's
        cublasLtMatmulMatrixScale_t (`mode`, e.g. OUTER_VEC_32F: one fp32 per row of op(A) and per column
        of op(B); None keeps the default SCALAR_32F, one fp32 each) and FAST_ACCUM. cuBLASLt refuses the
        heuristic while the scale pointers are unset, so they point at the workspace until set_scales()
        sets a call's own (neither the heuristic nor the check reads them)."""
        lt = self.lt
        dset = functools.partial(set_attr, lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype)
        A = lt.MatmulDescAttribute
        if mode is not None:
            code = int(getattr(lt.MatmulMatrixScale, mode))
            dset(self.desc, A.A_SCALE_MODE, code)
            dset(self.desc, A.B_SCALE_MODE, code)
        dset(self.desc, A.FAST_ACCUM, int(fast_accum))
        np = _np()
        self._scale_ptrs = np.zeros(2, dtype=np.int64)
        self._scale_addr = self._scale_ptrs.ctypes.data  # read once, as the bias pointer's
        self._scale_attrs = (int(A.A_SCALE_POINTER), int(A.B_SCALE_POINTER))
        placeholder = workspace(device_index).data_ptr()
        self.set_scales(placeholder, placeholder)

    def set_scales(self, a_ptr: int, b_ptr: int) -> None:
        """The device pointers of A's and B's fp32 scales for the next call."""
        ptrs, addr, (a_attr, b_attr) = self._scale_ptrs, self._scale_addr, self._scale_attrs
        ptrs[0], ptrs[1] = a_ptr, b_ptr
        self.lt.matmul_desc_set_attribute(self.desc, a_attr, addr, 8)
        self.lt.matmul_desc_set_attribute(self.desc, b_attr, addr + 8, 8)

    def heuristic(self, limit: int, min_align: int = 256):
        """cuBLASLt's ranked algorithms for this problem: list of (algo bytes, workspace bytes)."""
        lt, np = self.lt, _np()
        pref = lt.matmul_preference_create()
        try:
            pset = functools.partial(
                set_attr, lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype
            )
            P = lt.MatmulPreferenceAttribute
            pset(pref, P.MAX_WORKSPACE_BYTES, WORKSPACE_BYTES)
            for attr in (
                P.MIN_ALIGNMENT_A_BYTES,
                P.MIN_ALIGNMENT_B_BYTES,
                P.MIN_ALIGNMENT_C_BYTES,
                P.MIN_ALIGNMENT_D_BYTES,
            ):
                pset(pref, attr, min_align)
            res = np.zeros(limit, dtype=lt.matmul_heuristic_result_dtype)
            count = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(
                self.handle, self.desc, self.a, self.b, self.c, self.d, pref, limit, res.ctypes.data, count.ctypes.data
            )
        finally:
            lt.matmul_preference_destroy(pref)
        out = []
        for r in res[: int(count[0])]:
            if int(r["state"]) == 0:
                out.append((bytes(r["algo"].tobytes()), int(r["workspace_size"])))
        return out

    def check(self, algo_bytes: bytes) -> int | None:
        """Workspace bytes the algorithm needs here, or None when it cannot run this problem."""
        lt, np = self.lt, _np()
        algo = np.frombuffer(bytearray(algo_bytes), dtype=lt.matmul_algo_dtype).copy()
        res = np.zeros(1, dtype=lt.matmul_heuristic_result_dtype)
        try:
            lt.matmul_algo_check(
                self.handle, self.desc, self.a, self.b, self.c, self.d, algo.ctypes.data, res.ctypes.data
            )
        except Exception:  # noqa: BLE001 - cuBLASLtError: not supported for this problem
            return None
        ws = int(res[0]["workspace_size"])
        return ws if ws <= WORKSPACE_BYTES else None

    def matmul(self, algo_addr: int, alpha_addr: int, beta_addr: int, a: int, b: int, c: int, d: int, ws: int) -> None:
        """cublasLtMatmul of this problem on torch's current stream (device pointers a, b, c, d)."""
        self.lt.matmul(
            self.handle, self.desc, alpha_addr, a, self.a, b, self.b, beta_addr, c, self.c, d, self.d, algo_addr,
            ws, WORKSPACE_BYTES, current_stream(self.device_index),
        )  # fmt: skip

    def __del__(self) -> None:
        try:
            for layout in {self.a, self.b, self.c, self.d}:  # C may be D's layout
                self.lt.matrix_layout_destroy(layout)
            self.lt.matmul_desc_destroy(self.desc)
        except Exception:  # noqa: BLE001 - half-built, or the library is already gone at exit
            pass


def algo_array(algo_bytes: bytes):
    lt = bindings()[0]
    return _np().frombuffer(bytearray(algo_bytes), dtype=lt.matmul_algo_dtype).copy()


def config_get(algo, attr: str) -> int:
    lt = bindings()[0]
    return get_attr(
        lt.matmul_algo_config_get_attribute,
        lt.get_matmul_algo_config_attribute_dtype,
        algo.ctypes.data,
        getattr(lt.MatmulAlgoConfigAttribute, attr),
    )


def config_set(algo, attr: str, value: int) -> None:
    lt = bindings()[0]
    set_attr(
        lt.matmul_algo_config_set_attribute,
        lt.get_matmul_algo_config_attribute_dtype,
        algo.ctypes.data,
        getattr(lt.MatmulAlgoConfigAttribute, attr),
        value,
    )


def algo_attrs(algo_bytes: bytes) -> tuple[int, ...]:
    """The identifying config attributes of an algorithm struct."""
    algo = algo_array(algo_bytes)
    return tuple(config_get(algo, attr) for attr, _ in ATTRS)


def algo_init(prob: Problem, algo_id: int):
    """cublasLtMatmulAlgoInit for the problem's types: the algorithm with default config attributes."""
    lt = prob.lt
    algo = _np().zeros(1, dtype=lt.matmul_algo_dtype)
    lt.matmul_algo_init(prob.handle, prob.compute, CUDA_R_32F, *prob.types, int(algo_id), algo.ctypes.data)
    return algo


def algo_from_spec(spec: AlgoSpec, prob: Problem) -> bytes:
    """Re-create an algorithm struct from its attributes (cublasLtMatmulAlgoInit + config setters)."""
    algo = algo_init(prob, spec.attrs[0])
    for (attr, _), value in zip(ATTRS[1:], spec.attrs[1:], strict=True):
        config_set(algo, attr, value)
    return bytes(algo.tobytes())


def fitted_algo(spec: AlgoSpec, prob: Problem) -> bytes | None:
    """The spec's algorithm where it runs `prob`, else cuBLASLt's own pick for it (another M or stride
    than the one tuned); None when cuBLASLt has none."""
    algo = algo_from_spec(spec, prob)
    if prob.check(algo) is not None:
        return algo
    ranked = prob.heuristic(1, min_align=ALIGN)
    return ranked[0][0] if ranked else None


def operand_layout(rows: int, cols: int, s_row: int, s_col: int) -> tuple[int, int, int, int] | None:
    """How cuBLASLt reads the transpose of a row-major view X[rows, cols] with strides (s_row, s_col):
    (op, layout rows, layout cols, ld) of a column-major matrix whose op() is X^T; None when neither
    stride is unit (or the other one overlaps rows)."""
    if s_col == 1 and (rows == 1 or s_row >= cols):
        return OP_N, cols, rows, s_row if rows > 1 else cols
    if s_row == 1 and (cols == 1 or s_col >= rows):
        return OP_T, rows, cols, s_col if cols > 1 else rows
    return None


def cap(algo_bytes: bytes, attr: str) -> int:
    lt = bindings()[0]
    return get_attr(
        lt.matmul_algo_cap_get_attribute,
        lt.get_matmul_algo_cap_attribute_dtype,
        algo_array(algo_bytes).ctypes.data,
        getattr(lt.MatmulAlgoCapAttribute, attr),
    )


def cap_or(algo_bytes: bytes, attr: str, default: int) -> int:
    try:
        return cap(algo_bytes, attr)
    except Exception:  # noqa: BLE001 - capability not reported by this cuBLASLt
        return default


def with_attrs(algo_bytes: bytes, **attrs: int) -> bytes:
    algo = algo_array(algo_bytes)
    for attr, value in attrs.items():
        config_set(algo, attr, value)
    return bytes(algo.tobytes())


def variants(algo: bytes, key: GemmKey) -> list[bytes]:
    """Neighbours of a heuristic pick: other split-K factors / reduction schemes, custom options (on
    Hopper these change e.g. the raster order), the CTA swizzle flipped, other cluster shapes."""
    out = []
    if cap_or(algo, "SPLITK_SUPPORT", 0):
        mask = cap_or(algo, "REDUCTION_SCHEME_MASK", 0)
        schemes = [s for s in (1, 2, 4) if mask & s][:2]  # in place, compute-type / output-type workspace
        # Only factors that give every split whole 64-wide K blocks: ragged splits were seen to drop a
        # split's contribution while cublasLtMatmulAlgoCheck still accepted them.
        for split in SPLITK_FACTORS:
            if key.K % (split * 64) == 0:
                out += [with_attrs(algo, SPLITK_NUM=split, REDUCTION_SCHEME=s) for s in schemes]
    current = algo_attrs(algo)
    for opt in range(min(cap_or(algo, "CUSTOM_OPTION_MAX", 0), CUSTOM_OPTIONS_MAX) + 1):
        if opt != current[6]:
            out.append(with_attrs(algo, CUSTOM_OPTION=opt))
    if cap_or(algo, "CTA_SWIZZLING_SUPPORT", 0):
        out.append(with_attrs(algo, CTA_SWIZZLING=1 - current[5]))
    # Thread-block cluster shapes (Hopper): cuBLASLt reports no list of them, the check filters.
    out += [with_attrs(algo, CLUSTER_SHAPE_ID=c) for c in CLUSTER_SHAPES if c != current[8]]
    return out


def enumerate_algos(
    key: GemmKey, device_index: int, wide: bool = False, prob: Problem | None = None
) -> list[tuple[AlgoSpec, bytes]]:
    """The heuristic's ranked list for `key`, then neighbours of its best entries, and with `wide` the
    whole space (wide_algos); all checked. `prob`: the problem's descriptors, when not the a16w16 GEMM
    of `key` (the batched family's strided-batched problem)."""
    if prob is None:
        prob = Problem(key, key.M, key.K, key.bias, device_index)
    ver = lt_version()
    out: dict[str, tuple[AlgoSpec, bytes]] = {}
    ranked = prob.heuristic(HEURISTIC_LIMIT)
    for algo, _ws in ranked:
        spec = AlgoSpec(ver, algo_attrs(algo))
        out.setdefault(spec.name, (spec, algo))
    for algo, _ws in ranked[:EXPAND_TOP]:
        for cand in variants(algo, key):
            if len(out) >= MAX_CANDIDATES:
                break
            spec = AlgoSpec(ver, algo_attrs(cand))
            if spec.name not in out and prob.check(cand) is not None:
                out[spec.name] = (spec, cand)
    for spec, cand in wide_algos(prob) if wide else ():
        out.setdefault(spec.name, (spec, cand))
    return list(out.values())


def cap_list(algo_bytes: bytes, attr: str) -> list[int]:
    """An array-valued capability (TILE_IDS, STAGES_IDS): asked for its size first, then read."""
    lt, np = bindings()[0], _np()
    arr = algo_array(algo_bytes)
    which = getattr(lt.MatmulAlgoCapAttribute, attr)
    written = np.zeros(1, dtype=np.uint64)
    lt.matmul_algo_cap_get_attribute(arr.ctypes.data, which, 0, 0, written.ctypes.data)
    n = int(written[0]) // 4
    if n == 0:
        return []
    buf = np.zeros(n, dtype=np.uint32)
    lt.matmul_algo_cap_get_attribute(arr.ctypes.data, which, buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return [int(v) for v in buf]


def search_mode() -> str:
    """GEMMTUNE_BLASLT_SEARCH: "heuristic" (default: the heuristic's list and its neighbours) or "wide"."""
    return settings.BLASLT_SEARCH.get()


def wide_algos(prob: Problem, clusters=(0, 2, 3, 5), limit: int = WIDE_LIMIT) -> list[tuple[AlgoSpec, bytes]]:
    """Every (algorithm id, tile, stages, cluster shape) the library lists for the problem's types that
    cublasLtMatmulAlgoCheck accepts for it, split-K 1, custom option 0: the space the heuristic picks
    from, not only its picks."""
    lt, ver = prob.lt, lt_version()
    out: dict[str, tuple[AlgoSpec, bytes]] = {}
    for algo_id in lt.matmul_algo_get_ids(prob.handle, prob.compute, CUDA_R_32F, *prob.types, 128):
        try:
            base = bytes(algo_init(prob, algo_id).tobytes())
        except Exception:  # noqa: BLE001 - an id this problem's types cannot init
            continue
        for tile in cap_list(base, "TILE_IDS") or [0]:
            for stage in cap_list(base, "STAGES_IDS") or [0]:
                for cl in clusters:
                    try:
                        cand = with_attrs(base, TILE_ID=tile, STAGES_ID=stage, CLUSTER_SHAPE_ID=cl)
                    except Exception:  # noqa: BLE001 - attribute not settable for this id
                        continue
                    if prob.check(cand) is not None:
                        spec = AlgoSpec(ver, algo_attrs(cand))
                        out.setdefault(spec.name, (spec, cand))
                        if len(out) >= limit:
                            return list(out.values())
    return list(out.values())


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class LtBackend(Backend):
    """The `blaslt` backend logic every family shares: availability (NVIDIA, nvmath-python's bindings
    loading), candidates from enumerate_algos, names, table rows, the check. A family's subclass says
    which keys it takes (`key_ok`, `sizes_ok`), describes its problem (`problem`) and builds its runner
    (`runner`); a kernel name is the algorithm's name plus a tag (`name_tag`) for what the key alone
    does not say (the epilogue backend's `_tanh`: a tanh GELU standing in for the erf one), or one of
    several tags (`name_tags`, each its own problem: the a8w8 backend's `_fa`, fast accumulation)."""

    name = "blaslt"
    needs = Needs(vendors=frozenset({NVIDIA}), modules=("nvmath",))

    def library_missing(self, device: torch.device) -> str:
        return library_missing()

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # descriptors are made per M (and layout) inside the runner

    # ---- what a family's subclass says ----------------------------------------------------------
    @abstractmethod
    def key_ok(self, key) -> bool:
        """Does this family's cuBLASLt problem take `key` (dtypes, epilogue)?"""

    def sizes_ok(self, key) -> bool:
        return True  # M == 0 is checked as M == 1

    @abstractmethod
    def problem(self, key, device: torch.device) -> Problem:
        """The cuBLASLt descriptors of `key` as the tuner's inputs lay it out."""

    @abstractmethod
    def runner(self, spec: AlgoSpec, key, device: torch.device) -> Runner:
        """The runner of algorithm `spec` for `key`."""

    def split_name(self, name: str) -> tuple[AlgoSpec | None, str]:
        """(the algorithm a kernel name names or None, its tag)."""
        return AlgoSpec.parse(name), ""

    def name_tag(self, key) -> str:
        return ""

    def name_tags(self, key) -> tuple[str, ...]:
        """Every tag a kernel name for `key` may carry: each names a problem of its own (`problem_for`),
        e.g. the a8w8 backend's fp8 fast accumulation (`_fa`) beside the plain one."""
        return (self.name_tag(key),)

    def problem_for(self, key, device: torch.device, tag: str) -> Problem:
        """The problem the kernel names with `tag` solve; by default the key's one problem."""
        return self.problem(key, device)

    # ---- shared -----------------------------------------------------------------------------------
    def solution(self, spec: AlgoSpec, tag: str = "") -> Solution:
        name = spec.name + tag
        return Solution(self.name, name, stable_solidx(name), spec.split_k)

    def candidates(self, key, device: torch.device) -> list[Solution]:
        if not self.is_available(device) or not self.key_ok(key) or key.M < 1 or not self.sizes_ok(key):
            return []
        return [sol for tag in self.name_tags(key) for sol in self.tagged_candidates(key, device, tag)]

    def tagged_candidates(self, key, device: torch.device, tag: str) -> list[Solution]:
        """The checked algorithms of the problem `tag` names, as solutions."""
        prob = self.problem_for(key, device, tag)
        algos = enumerate_algos(key, device_index(device), wide=search_mode() == "wide", prob=prob)
        return [self.solution(spec, tag) for spec, _ in algos]

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        spec, tag = self.split_name(kernel_name)
        if spec is None:
            return None
        try:
            here = lt_version()
        except Exception as exc:  # noqa: BLE001
            log.warning("blaslt row %s: cuBLASLt cannot be loaded here (%s); falling back", kernel_name, exc)
            return None
        if spec.version != here:
            log.warning("blaslt row %s was tuned with cuBLASLt %d, this process has %d: algorithm ids may "
                        "mean other kernels, falling back", kernel_name, spec.version, here)  # fmt: skip
            return None
        return self.solution(spec, tag)

    def supports(self, solution: Solution, key, device: torch.device) -> bool:
        spec, tag = self.split_name(solution.kernel_name)
        if spec is None or tag not in self.name_tags(key) or not self.is_available(device) or not self.key_ok(key):
            return False
        if spec.version != lt_version() or not self.sizes_ok(key):
            return False
        try:
            prob = self.problem_for(key, device, tag)
            return prob.check(algo_from_spec(spec, prob)) is not None
        except Exception:  # noqa: BLE001 - an id unknown to this library, a problem it cannot describe
            return False

    def make_runner(self, solution: Solution, key, device: torch.device) -> Runner:
        spec, _ = self.split_name(solution.kernel_name)
        if spec is None or not self.supports(solution, key, device):
            raise ValueError(f"blaslt cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
        return self.runner(spec, key, device)
