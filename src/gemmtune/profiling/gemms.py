"""GEMM calls seen in a profile: their (M, N, K, dtype) key, and whether the tables in effect answer it.

Keys come from the shapes the profiler recorded for the outermost GEMM frame of a call: aten::linear,
addmm, mm, matmul, the gemmtune::gemm custom op, or the `gemmtune.gemm ...` range `annotate_gemms()`
wraps around eager gemmtune.gemm calls (whose Triton kernels have no aten op to carry the shapes).
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch

from .categorize import GEMM_ANNOTATION, GEMM_OPS, Frame

_DTYPES = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
    "int": torch.int32,
    "signed char": torch.int8,
}
for _n in ("Float8_e4m3fn", "Float8_e5m2", "Float8_e4m3fnuz", "Float8_e5m2fnuz"):
    _t = getattr(torch, _n.lower(), None)
    if _t is not None:
        _DTYPES[f"c10::{_n}"] = _t


@dataclass(frozen=True)
class GemmCall:
    """y[M, N] = x[M, K] @ w[N, K]^T (+ bias), `batch` times (1 for a plain GEMM)."""

    op: str
    M: int
    N: int
    K: int
    bias: bool
    dtype: torch.dtype | str
    outdtype: torch.dtype | str
    batch: int = 1

    def describe(self) -> str:
        b = f"{self.batch}x " if self.batch > 1 else ""
        return f"{b}M={self.M} N={self.N} K={self.K}{' +bias' if self.bias else ''} {_dt(self.dtype)}"


def _dt(d) -> str:
    return str(d).replace("torch.", "")


def _dtype(text: str):
    return _DTYPES.get(text, text or "?")


def _prod(dims) -> int:
    return math.prod(int(d) for d in dims)


def label(key) -> str:
    """The range name annotate_gemms() gives one gemmtune.gemm call (parsed back by call_of)."""
    try:
        return (f"{GEMM_ANNOTATION} M={key.M} N={key.N} K={key.K} bias={int(bool(key.bias))} "
                f"{key.dtype}->{key.outdtype}")  # fmt: skip
    except AttributeError:  # another GEMM family's key: name it, without a parsable shape
        return f"{GEMM_ANNOTATION} {key}"


_LABEL = re.compile(rf"^{re.escape(GEMM_ANNOTATION)} M=(\d+) N=(\d+) K=(\d+) bias=([01]) (\S+)->(\S+)$")
_TORCH_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


def call_of(f: Frame) -> GemmCall | None:
    """The GEMM a frame computes, from its recorded input shapes; None if they do not say."""
    s, d, n = f.shapes, f.dtypes, f.name
    try:
        if n.startswith(GEMM_ANNOTATION):
            m = _LABEL.match(n)
            if not m:
                return None
            dt, odt = (_TORCH_DTYPES.get(x, x) for x in m.group(5, 6))
            return GemmCall("gemmtune.gemm", int(m[1]), int(m[2]), int(m[3]), m[4] == "1", dt, odt)
        if n in ("aten::linear", "gemmtune::gemm"):  # x [..., K], w [N, K], bias [N] or None
            x, w = s[0], s[1]
            has_bias = len(s) > 2 and len(s[2]) == 1
            return GemmCall(n, _prod(x[:-1]), int(w[0]), int(w[1]), has_bias, _dtype(d[0]), _dtype(d[0]))
        if n in ("aten::mm", "aten::_scaled_mm", "aten::_int_mm"):  # a [M, K], b [K, N]
            a, b = s[0], s[1]
            return GemmCall(n, int(a[0]), int(b[1]), int(a[1]), False, _dtype(d[0]), _dtype(d[0]))
        if n in ("aten::addmm", "aten::_addmm_activation"):  # bias, a [M, K], b [K, N]
            a, b = s[1], s[2]
            return GemmCall(n, int(a[0]), int(b[1]), int(a[1]), len(s[0]) > 0, _dtype(d[1]), _dtype(d[1]))
        if n == "aten::matmul":
            a, b = s[0], s[1]
            if len(b) == 2:  # activations [..., K] x weight [K, N]
                return GemmCall(n, _prod(a[:-1]), int(b[1]), int(a[-1]), False, _dtype(d[0]), _dtype(d[0]))
            if len(a) >= 2 and len(b) >= 2:
                batch = _prod(a[:-2]) if len(a) >= len(b) else _prod(b[:-2])
                return GemmCall(n, int(a[-2]), int(b[-1]), int(a[-1]), False, _dtype(d[0]), _dtype(d[0]), batch)
            return None
        if n in ("aten::bmm", "aten::baddbmm"):  # [B, M, K] x [B, K, N] (baddbmm: input first)
            a, b = (s[0], s[1]) if n == "aten::bmm" else (s[1], s[2])
            k = 0 if n == "aten::bmm" else 1
            return GemmCall(n, int(a[1]), int(b[2]), int(a[2]), n == "aten::baddbmm", _dtype(d[k]), _dtype(d[k]),
                            int(a[0]))  # fmt: skip
    except (IndexError, TypeError, ValueError):
        return None
    return None


def is_gemm_frame(f: Frame) -> bool:
    return f.name in GEMM_OPS or f.name.startswith(GEMM_ANNOTATION)


def status(call: GemmCall, device: torch.device | str) -> tuple[str, str]:
    """("tuned" | "untuned-M" | "default" | "n/a", detail): what the tables in effect run for `call`.

    The one place that builds a dispatch key from a profiled call: a16w16 GemmKeys only.
    """
    if call.batch > 1:
        return "n/a", "batched GEMM: not dispatched by gemmtune"
    if not all(isinstance(t, torch.dtype) for t in (call.dtype, call.outdtype)):
        return "n/a", f"dtype {call.dtype} not recognized"
    try:
        from ..dispatch import resolve
        from ..keys import GemmKey

        res = resolve(GemmKey(call.M, call.N, call.K, call.bias, call.dtype, call.outdtype), device)
    except Exception as exc:  # noqa: BLE001 - a key the dispatcher cannot resolve is reported, not fatal
        return "n/a", f"{type(exc).__name__}: {exc}"
    if res.row is None:
        return "default", f"no tuned row: {res.solution.describe()}"
    if res.note:
        return "default", f"row {res.row.where} not usable here ({res.note})"
    if res.row.key.M == call.M:
        return "tuned", f"row {res.row.where}: {res.solution.describe()}"
    return "untuned-M", f"untuned-M rule (row M={res.row.key.M}, {res.row.where}): {res.solution.describe()}"


@contextlib.contextmanager
def annotate_gemms():
    """Wrap every gemmtune.gemm runner resolved inside the block in a profiler range named by its key.

    The runner cache is swapped for the block and put back after it, so runners captured in CUDA
    graphs before the block stay alive and in use. Yields False when the dispatcher cannot be hooked.
    """
    from ..dispatch import get_dispatcher

    d = get_dispatcher()
    orig = getattr(d, "runner_for", None)
    runners = getattr(d, "runners", None)
    if orig is None or not isinstance(runners, dict) or "runner_for" in d.__dict__:
        yield False
        return
    saved = dict(runners)
    record = torch.profiler.record_function

    def runner_for(key, *args, **kwargs):
        run = orig(key, *args, **kwargs)
        name = label(key)

        def annotated(*a, **k):
            with record(name):
                return run(*a, **k)

        return annotated

    d.runner_for = runner_for
    runners.clear()
    try:
        yield True
    finally:
        del d.runner_for
        runners.clear()
        runners.update(saved)
