"""The `blaslt` backend: explicit cuBLASLt algorithms (through nvmath-python's cuBLASLt bindings).

cuBLAS runs one algorithm per shape, picked by its heuristic. This backend offers many: the heuristic's
ranked list for the shape plus neighbours of its best entries (split-K factors, custom options, CTA
swizzle, cluster shape), each checked with cublasLtMatmulAlgoCheck. A solution is named by the
algorithm's config attributes and the library version (`lt130200_a66_t20_s35_k1_r0_w0_c0_i0_cl2`: algo id, tile, stages,
split-K, reduction scheme, CTA swizzle, custom option, inner shape, cluster shape), and is re-created
from those attributes (cublasLtMatmulAlgoInit + config attributes), not from a heuristic rank, so a
table row means the same kernel after a restart. A row written under another cuBLASLt version is
refused (the ids may mean other kernels there) and the caller falls back, with a log line saying why.

Runners call cublasLtMatmul directly on torch's current stream, on the caller's tensors (no copies
except to fix a misaligned or non-unit-stride input), with the bias added by the BIAS epilogue.
Layout: cuBLASLt is column-major, so y[M, N] = x @ w^T is computed as y^T[N, M] = w[N, K] @ x^T,
with A = w (transposed), B = x, D = y^T (the layout cuBLAS uses for F.linear).

`GEMMTUNE_BLASLT_SEARCH=wide` adds the whole space the library lists for the key's types (every
algorithm id x tile x stages x cluster shape that cublasLtMatmulAlgoCheck accepts, ~700 on an H100
for bf16): measured over the prefill suite's 40 points with 32 <= M <= 512, it gained 0.5% geomean
over the default list (up to 5% at one point; benchmarks/results/h100/prefill_triton_blaslt_vs_cublas/), for ~10x the
tuning time, so it is opt-in.

On ROCm the hipBLASLt equivalent would live here; it needs an AMD GPU to build and test, so this
backend reports itself unavailable there.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass

import torch

from ..keys import GemmKey
from .base import Backend, Runner, Solution, stable_solidx

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
_CUDA_TYPE = {torch.float16: 2, torch.bfloat16: 14, torch.float32: 0}
_CUDA_R_32F = 0
_OP_N, _OP_T = 0, 1

# Config attributes that identify an algorithm, in name order: (attribute, name tag).
_ATTRS = (
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
_NAME_RE = re.compile(r"^lt(\d+)" + "".join(rf"_{tag}(\d+)" for _, tag in _ATTRS) + "$")


@dataclass(frozen=True)
class AlgoSpec:
    """An algorithm as its identifying attributes plus the cuBLASLt version they belong to."""

    version: int
    attrs: tuple[int, ...]  # values of _ATTRS, in order

    @property
    def name(self) -> str:
        parts = (f"_{tag}{v}" for (_, tag), v in zip(_ATTRS, self.attrs, strict=True))
        return f"lt{self.version}" + "".join(parts)

    @property
    def split_k(self) -> int:
        return self.attrs[3]

    @classmethod
    def parse(cls, name: str) -> AlgoSpec | None:
        m = _NAME_RE.match(name.strip())
        if m is None:
            return None
        vals = [int(v) for v in m.groups()]
        return cls(vals[0], tuple(vals[1:]))


# ---- the library, loaded lazily ----------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _lib():
    """(cublasLt bindings module, cublas bindings module); raises ImportError with the reason."""
    from nvmath.bindings import cublas, cublasLt  # optional extra: gemmtune[blaslt]

    return cublasLt, cublas


@functools.lru_cache(maxsize=1)
def _unavailable() -> str:
    if torch.version.hip is not None:
        return "blaslt: hipBLASLt on ROCm is not implemented (it needs an AMD GPU to build and test)"
    if not torch.cuda.is_available():
        return "blaslt: no CUDA GPU"
    try:
        lt, _ = _lib()
        lt.get_version()
    except Exception as exc:  # noqa: BLE001 - any load failure makes the backend unavailable
        return f"blaslt: nvmath-python's cuBLASLt bindings cannot be loaded ({type(exc).__name__}: {exc})"
    return ""


@functools.lru_cache(maxsize=1)
def lt_version() -> int:
    return int(_lib()[0].get_version())


@functools.cache
def _handle(device_index: int) -> int:
    with torch.cuda.device(device_index):
        return _lib()[0].create()


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _np():
    import numpy as np

    return np


def _set(setter, dtype_of, obj: int, attr, value) -> None:
    np = _np()
    buf = np.array([value], dtype=dtype_of(attr))
    setter(obj, attr, buf.ctypes.data, buf.nbytes)


def _get(getter, dtype_of, obj: int, attr) -> int:
    np = _np()
    buf = np.zeros(1, dtype=dtype_of(attr))
    written = np.zeros(1, dtype=np.uint64)
    getter(obj, attr, buf.ctypes.data, buf.nbytes, written.ctypes.data)
    return int(buf[0])


class _Problem:
    """cuBLASLt descriptors for one (key, M, ld of x, bias or not); owns and frees them."""

    def __init__(self, key: GemmKey, m: int, ldx: int, bias: bool, device_index: int):
        self._describe(key, device_index, _OP_T, _OP_N, "BIAS" if bias else "DEFAULT")
        lt, (a_t, _, _, d_t) = self.lt, self.types
        self.a = lt.matrix_layout_create(a_t, key.K, key.N, key.K)  # w [N, K] row-major = [K, N] col-major
        self.b = lt.matrix_layout_create(a_t, key.K, m, ldx)  # x [M, K] (row stride ldx)
        self.d = lt.matrix_layout_create(d_t, key.N, m, key.N)  # y [M, N] = y^T [N, M] col-major
        self.c = self.d

    def _describe(self, key, device_index: int, op_a: int, op_b: int, epilogue: str) -> None:
        """The matmul descriptor: A/B in the key's dtype, C/D in its out dtype, fp32 compute and scale,
        the two ops and the epilogue (a cublasLtEpilogue_t name). A *BIAS epilogue reads its bias in the
        out dtype, from the pointer set_bias() sets before each call. Subclasses add the layouts."""
        lt, cublas = _lib()
        self.lt, self.key = lt, key
        self.handle = _handle(device_index)
        a_t, d_t = _CUDA_TYPE[key.dtype], _CUDA_TYPE[key.outdtype]
        self.types = (a_t, a_t, d_t, d_t)
        self.compute = int(cublas.ComputeType.COMPUTE_32F)
        self.desc = lt.matmul_desc_create(self.compute, _CUDA_R_32F)
        dset = functools.partial(_set, lt.matmul_desc_set_attribute, lt.get_matmul_desc_attribute_dtype)
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

    def heuristic(self, limit: int, min_align: int = 256):
        """cuBLASLt's ranked algorithms for this problem: list of (algo bytes, workspace bytes)."""
        lt, np = self.lt, _np()
        pref = lt.matmul_preference_create()
        try:
            pset = functools.partial(_set, lt.matmul_preference_set_attribute, lt.get_matmul_preference_attribute_dtype)
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
            ws, WORKSPACE_BYTES, torch.cuda.current_stream().cuda_stream,
        )  # fmt: skip

    def __del__(self) -> None:
        try:
            for layout in {self.a, self.b, self.c, self.d}:  # C may be D's layout
                self.lt.matrix_layout_destroy(layout)
            self.lt.matmul_desc_destroy(self.desc)
        except Exception:  # noqa: BLE001 - half-built, or the library is already gone at exit
            pass


def _algo_array(algo_bytes: bytes):
    lt = _lib()[0]
    return _np().frombuffer(bytearray(algo_bytes), dtype=lt.matmul_algo_dtype).copy()


def _config_get(algo, attr: str) -> int:
    lt = _lib()[0]
    return _get(
        lt.matmul_algo_config_get_attribute,
        lt.get_matmul_algo_config_attribute_dtype,
        algo.ctypes.data,
        getattr(lt.MatmulAlgoConfigAttribute, attr),
    )


def _config_set(algo, attr: str, value: int) -> None:
    lt = _lib()[0]
    _set(
        lt.matmul_algo_config_set_attribute,
        lt.get_matmul_algo_config_attribute_dtype,
        algo.ctypes.data,
        getattr(lt.MatmulAlgoConfigAttribute, attr),
        value,
    )


def algo_attrs(algo_bytes: bytes) -> tuple[int, ...]:
    """The identifying config attributes of an algorithm struct."""
    algo = _algo_array(algo_bytes)
    return tuple(_config_get(algo, attr) for attr, _ in _ATTRS)


def _algo_init(prob: _Problem, algo_id: int):
    """cublasLtMatmulAlgoInit for the problem's types: the algorithm with default config attributes."""
    lt = prob.lt
    algo = _np().zeros(1, dtype=lt.matmul_algo_dtype)
    lt.matmul_algo_init(prob.handle, prob.compute, _CUDA_R_32F, *prob.types, int(algo_id), algo.ctypes.data)
    return algo


def algo_from_spec(spec: AlgoSpec, prob: _Problem) -> bytes:
    """Re-create an algorithm struct from its attributes (cublasLtMatmulAlgoInit + config setters)."""
    algo = _algo_init(prob, spec.attrs[0])
    for (attr, _), value in zip(_ATTRS[1:], spec.attrs[1:], strict=True):
        _config_set(algo, attr, value)
    return bytes(algo.tobytes())


def fitted_algo(spec: AlgoSpec, prob: _Problem) -> bytes | None:
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
        return _OP_N, cols, rows, s_row if rows > 1 else cols
    if s_row == 1 and (cols == 1 or s_col >= rows):
        return _OP_T, rows, cols, s_col if cols > 1 else rows
    return None


def _cap(algo_bytes: bytes, attr: str) -> int:
    lt = _lib()[0]
    return _get(
        lt.matmul_algo_cap_get_attribute,
        lt.get_matmul_algo_cap_attribute_dtype,
        _algo_array(algo_bytes).ctypes.data,
        getattr(lt.MatmulAlgoCapAttribute, attr),
    )


def _cap_or(algo_bytes: bytes, attr: str, default: int) -> int:
    try:
        return _cap(algo_bytes, attr)
    except Exception:  # noqa: BLE001 - capability not reported by this cuBLASLt
        return default


def _with_attrs(algo_bytes: bytes, **attrs: int) -> bytes:
    algo = _algo_array(algo_bytes)
    for attr, value in attrs.items():
        _config_set(algo, attr, value)
    return bytes(algo.tobytes())


def _variants(algo: bytes, key: GemmKey) -> list[bytes]:
    """Neighbours of a heuristic pick: other split-K factors / reduction schemes, custom options (on
    Hopper these change e.g. the raster order), the CTA swizzle flipped, other cluster shapes."""
    out = []
    if _cap_or(algo, "SPLITK_SUPPORT", 0):
        mask = _cap_or(algo, "REDUCTION_SCHEME_MASK", 0)
        schemes = [s for s in (1, 2, 4) if mask & s][:2]  # in place, compute-type / output-type workspace
        # Only factors that give every split whole 64-wide K blocks: ragged splits were seen to drop a
        # split's contribution while cublasLtMatmulAlgoCheck still accepted them.
        for split in SPLITK_FACTORS:
            if key.K % (split * 64) == 0:
                out += [_with_attrs(algo, SPLITK_NUM=split, REDUCTION_SCHEME=s) for s in schemes]
    current = algo_attrs(algo)
    for opt in range(min(_cap_or(algo, "CUSTOM_OPTION_MAX", 0), CUSTOM_OPTIONS_MAX) + 1):
        if opt != current[6]:
            out.append(_with_attrs(algo, CUSTOM_OPTION=opt))
    if _cap_or(algo, "CTA_SWIZZLING_SUPPORT", 0):
        out.append(_with_attrs(algo, CTA_SWIZZLING=1 - current[5]))
    # Thread-block cluster shapes (Hopper): cuBLASLt reports no list of them, the check filters.
    out += [_with_attrs(algo, CLUSTER_SHAPE_ID=c) for c in CLUSTER_SHAPES if c != current[8]]
    return out


def enumerate_algos(
    key: GemmKey, device_index: int, wide: bool = False, prob: _Problem | None = None
) -> list[tuple[AlgoSpec, bytes]]:
    """The heuristic's ranked list for `key`, then neighbours of its best entries, and with `wide` the
    whole space (wide_algos); all checked. `prob`: the problem's descriptors, when not the a16w16 GEMM
    of `key` (the batched family's strided-batched problem)."""
    if prob is None:
        prob = _Problem(key, key.M, key.K, key.bias, device_index)
    ver = lt_version()
    out: dict[str, tuple[AlgoSpec, bytes]] = {}
    ranked = prob.heuristic(HEURISTIC_LIMIT)
    for algo, _ws in ranked:
        spec = AlgoSpec(ver, algo_attrs(algo))
        out.setdefault(spec.name, (spec, algo))
    for algo, _ws in ranked[:EXPAND_TOP]:
        for cand in _variants(algo, key):
            if len(out) >= MAX_CANDIDATES:
                break
            spec = AlgoSpec(ver, algo_attrs(cand))
            if spec.name not in out and prob.check(cand) is not None:
                out[spec.name] = (spec, cand)
    for spec, cand in wide_algos(prob) if wide else ():
        out.setdefault(spec.name, (spec, cand))
    return list(out.values())


def _cap_list(algo_bytes: bytes, attr: str) -> list[int]:
    """An array-valued capability (TILE_IDS, STAGES_IDS): asked for its size first, then read."""
    lt, np = _lib()[0], _np()
    arr = _algo_array(algo_bytes)
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
    mode = os.environ.get("GEMMTUNE_BLASLT_SEARCH", "heuristic").strip().lower() or "heuristic"
    if mode not in ("heuristic", "wide"):
        raise ValueError(f"GEMMTUNE_BLASLT_SEARCH={mode!r}: expected 'heuristic' or 'wide'")
    return mode


def wide_algos(prob: _Problem, clusters=(0, 2, 3, 5), limit: int = WIDE_LIMIT) -> list[tuple[AlgoSpec, bytes]]:
    """Every (algorithm id, tile, stages, cluster shape) the library lists for the problem's types that
    cublasLtMatmulAlgoCheck accepts for it, split-K 1, custom option 0: the space the heuristic picks
    from, not only its picks."""
    lt, ver = prob.lt, lt_version()
    out: dict[str, tuple[AlgoSpec, bytes]] = {}
    for algo_id in lt.matmul_algo_get_ids(prob.handle, prob.compute, _CUDA_R_32F, *prob.types, 128):
        try:
            base = bytes(_algo_init(prob, algo_id).tobytes())
        except Exception:  # noqa: BLE001 - an id this problem's types cannot init
            continue
        for tile in _cap_list(base, "TILE_IDS") or [0]:
            for stage in _cap_list(base, "STAGES_IDS") or [0]:
                for cl in clusters:
                    try:
                        cand = _with_attrs(base, TILE_ID=tile, STAGES_ID=stage, CLUSTER_SHAPE_ID=cl)
                    except Exception:  # noqa: BLE001 - attribute not settable for this id
                        continue
                    if prob.check(cand) is not None:
                        spec = AlgoSpec(ver, algo_attrs(cand))
                        out.setdefault(spec.name, (spec, cand))
                        if len(out) >= limit:
                            return list(out.values())
    return list(out.values())


class BlasLtBackend(Backend):
    name = "blaslt"

    def runner_scope(self, solution: Solution, key) -> tuple:
        return self.m_agnostic_scope(key)  # descriptors are made per (M, ld, bias) inside the runner

    def is_available(self, device: torch.device) -> bool:
        return device.type == "cuda" and not _unavailable()

    def unavailable_reason(self, device: torch.device) -> str:
        if device.type != "cuda":
            return f"blaslt runs on CUDA GPUs, not on {device.type}"
        return _unavailable()

    @staticmethod
    def _key_ok(key: GemmKey) -> bool:
        if key.scaleAB or key.bpreshuffle or key.dtype not in _CUDA_TYPE or key.outdtype not in _CUDA_TYPE:
            return False
        # fp16/bf16 in -> same or fp32 out; fp32 in -> fp32 out
        return key.dtype == key.outdtype or key.outdtype == torch.float32

    def candidates(self, key: GemmKey, device: torch.device) -> list[Solution]:
        if not self.is_available(device) or not self._key_ok(key) or key.M < 1 or not self._sizes_ok(key):
            return []
        prob = self._problem(key, device)
        algos = enumerate_algos(key, _index(device), wide=search_mode() == "wide", prob=prob)
        return [self._solution(spec, self._tag(key)) for spec, _ in algos]

    # A kernel name is the algorithm's name (AlgoSpec) plus a tag some subclasses add for what the key
    # alone does not say (the epilogue backend's `_tanh`: a tanh GELU standing in for the erf one).
    def _split(self, name: str) -> tuple[AlgoSpec | None, str]:
        return AlgoSpec.parse(name), ""

    def _tag(self, key) -> str:
        return ""

    def _solution(self, spec: AlgoSpec, tag: str = "") -> Solution:
        name = spec.name + tag
        return Solution(self.name, name, stable_solidx(name), spec.split_k)

    def default_solution(self, key: GemmKey, device: torch.device) -> Solution | None:
        return None  # cuBLAS itself (the torch backend) is the default

    def solution_from_row(self, solidx: int, kernel_name: str, splitk: int) -> Solution | None:
        spec, tag = self._split(kernel_name)
        if spec is None:
            return None
        try:
            here = lt_version()
        except Exception as exc:  # noqa: BLE001
            log.warning("blaslt row %s: cuBLASLt cannot be loaded here (%s); falling back", kernel_name, exc)
            return None
        if spec.version != here:
            log.warning(
                "blaslt row %s was tuned with cuBLASLt %d, this process has %d: algorithm ids may "
                "mean other kernels, falling back",
                kernel_name,
                spec.version,
                here,
            )
            return None
        return self._solution(spec, tag)

    # The batched and epilogue backends describe their problem and runner differently; the rest is shared.
    def _sizes_ok(self, key: GemmKey) -> bool:
        return True  # M == 0 is checked as M == 1

    def _problem(self, key: GemmKey, device: torch.device) -> _Problem:
        return _Problem(key, max(key.M, 1), key.K, key.bias, _index(device))

    def _runner(self, spec: AlgoSpec, key: GemmKey, device: torch.device) -> Runner:
        return _LtRunner(spec, key, _index(device))

    def supports(self, solution: Solution, key: GemmKey, device: torch.device) -> bool:
        spec, tag = self._split(solution.kernel_name)
        if spec is None or tag != self._tag(key) or not self.is_available(device) or not self._key_ok(key):
            return False
        if spec.version != lt_version() or not self._sizes_ok(key):
            return False
        prob = self._problem(key, device)
        try:
            return prob.check(algo_from_spec(spec, prob)) is not None
        except Exception:  # noqa: BLE001 - an id unknown to this library
            return False

    def make_runner(self, solution: Solution, key: GemmKey, device: torch.device) -> Runner:
        spec, _ = self._split(solution.kernel_name)
        if spec is None or not self.supports(solution, key, device):
            raise ValueError(f"blaslt cannot run {solution.kernel_name!r} for {key.describe()} on {device}")
        return self._runner(spec, key, device)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _LtRunner:
    """runner(x, w, bias) -> y for one algorithm; descriptors per (M, ld, bias) are made once."""

    def __init__(self, spec: AlgoSpec, key: GemmKey, device_index: int):
        np = _np()
        self.spec, self.key, self.dev = spec, key, device_index
        self.lt = _lib()[0]
        self.handle = _handle(device_index)
        self.ws = _workspace(device_index)
        self.alpha = np.ones(1, dtype=np.float32)
        self.beta = np.zeros(1, dtype=np.float32)
        # Addresses read once: ndarray.ctypes costs microseconds per access on the hot path.
        self._alpha_addr, self._beta_addr = self.alpha.ctypes.data, self.beta.ctypes.data
        self._ws_addr = self.ws.data_ptr()
        self._plans: dict[tuple[int, int, bool], tuple[_Problem, object, int]] = {}
        self.algo_bytes = None
        self._plan(max(key.M, 1), key.K, key.bias)  # the key's own problem, checked now
        # Pointer alignment the algorithm assumes for x (B) and w (A); others are copied first.
        self.align_x = max(ALIGN, _cap_or(self.algo_bytes, "MIN_ALIGNMENT_B_BYTES", ALIGN))
        self.align_w = max(ALIGN, _cap_or(self.algo_bytes, "MIN_ALIGNMENT_A_BYTES", ALIGN))

    def _plan(self, m: int, ldx: int, bias: bool):
        got = self._plans.get((m, ldx, bias))
        if got is not None:
            return got
        prob = _Problem(self.key, m, ldx, bias, self.dev)
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
        arr = _algo_array(algo)
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
                torch.cuda.current_stream().cuda_stream,
            )
        return y if x.dim() == 2 else y.view(*x.shape[:-1], key.N)
