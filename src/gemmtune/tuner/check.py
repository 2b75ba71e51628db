"""Correctness of one candidate against an fp32 reference, before it is ever timed.

Metric: rel_err = ||y - ref||_F / ||ref||_F over all M*N elements, with ref = x.float() @ w.float()^T
(+ bias) computed in fp32 (TF32 off) from the same rounded inputs. So the metric measures only what
the kernel adds: accumulation order and the rounding of its output.

Thresholds (by output dtype; `--err-ratio` replaces them):
  bfloat16 1e-2   output rounding alone gives ~2e-3 (unit roundoff 2^-8 over random data)
  float16  2e-3   output rounding alone gives ~3e-4 (2^-11)
  float32  1e-4   fp32 accumulation of 16-bit products gives ~1e-6; TF32 (~1e-3) is rejected
A NaN or Inf anywhere, a wrong shape or dtype, or rel_err > 0.5 (garbage) always rejects.

Uninitialized output memory: runners allocate their own output, so the allocator is poisoned first:
a NaN-filled block of the output's size is allocated and freed right before the call, which the
caching allocator (and usually malloc) hands back as the output. A kernel that skips part of its
output then leaves NaN behind. The graph check replays into a captured output filled with NaN.

Checked calls: 2-D x; x with a leading batch dim and padded (non-contiguous) rows, as the dispatcher
can pass; on CUDA, a CUDA-graph replay, which must reproduce the eager result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backends.base import Runner
from ..keys import GemmKey

THRESHOLDS = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
CATASTROPHIC = 0.5


def threshold_for(key: GemmKey, err_ratio: float | None = None) -> float:
    if err_ratio is not None:
        return err_ratio
    return THRESHOLDS.get(key.outdtype, THRESHOLDS.get(key.dtype, 1e-2))


@dataclass
class CheckResult:
    ok: bool
    err: float  # worst rel_err over the checked calls (NaN when the output was not finite)
    reason: str = ""


def reference(key: GemmKey, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """fp32 x @ w^T (+ b) with TF32 off."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = x.float() @ w.float().t()
        if b is not None:
            y += b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return y


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| over all elements; inf when y has a NaN/Inf."""
    yf = y.float()
    if not bool(torch.isfinite(yf).all()):
        return math.inf
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(yf - ref))
    return num / den if den > 0 else num


def _poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    # Allocate-and-free a NaN block of exactly the output's size so the next allocation reuses it.
    torch.full((numel,), float("nan"), dtype=dtype, device=device)


def _strided_view(x: torch.Tensor) -> torch.Tensor:
    """The same values as x [M, K], as a [1, M, K] view with padded rows (non-contiguous)."""
    M, K = x.shape
    wide = torch.full((M, K + 8), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, :K] = x
    return wide[:, :K].unsqueeze(0)


def _judge(y, key: GemmKey, shape: tuple, ref: torch.Tensor, limit: float, what: str) -> tuple[float, str]:
    if not isinstance(y, torch.Tensor):
        return math.nan, f"{what}: returned {type(y).__name__}, not a tensor"
    if tuple(y.shape) != shape:
        return math.nan, f"{what}: output shape {tuple(y.shape)}, expected {shape}"
    if y.dtype != key.outdtype:
        return math.nan, f"{what}: output dtype {y.dtype}, expected {key.outdtype}"
    err = rel_error(y.reshape(key.M, key.N), ref)
    if math.isinf(err):
        return math.nan, f"{what}: output has NaN/Inf (unwritten or overflowed elements)"
    cap = min(limit, CATASTROPHIC)
    if err > cap:
        return err, f"{what}: rel_err {err:.3g} > {cap:.3g}"
    return err, ""


def check_runner(
    runner: Runner,
    key: GemmKey,
    inputs: tuple,
    ref: torch.Tensor,
    err_ratio: float | None = None,
    graph: bool = True,
) -> CheckResult:
    """Run `runner` on `inputs` (x [M, K], w, bias) every way the dispatcher may call it; judge vs `ref`."""
    x, w, b = inputs
    dev = x.device
    limit = threshold_for(key, err_ratio)
    worst = 0.0

    def verdict(y, shape, what):
        nonlocal worst
        err, why = _judge(y, key, shape, ref, limit, what)
        if not why:
            worst = max(worst, err)
        return err, why

    _poison_allocator(key.M * key.N, key.outdtype, dev)
    y = runner(x, w, b)
    err, why = verdict(y, (key.M, key.N), "eager")
    if why:
        return CheckResult(False, err, why)
    eager = y.clone()
    del y

    _poison_allocator(key.M * key.N, key.outdtype, dev)
    y3 = runner(_strided_view(x), w, b)
    err, why = verdict(y3, (1, key.M, key.N), "x [1, M, K] non-contiguous")
    if why:
        return CheckResult(False, err, why)
    del y3

    if graph and dev.type == "cuda":
        err, why = _graph_check(runner, key, (x, w, b), eager, ref, limit)
        if why:
            return CheckResult(False, err, why)
        worst = max(worst, err)
    return CheckResult(True, worst)


def _graph_check(runner, key, inputs, eager, ref, limit) -> tuple[float, str]:
    x, w, b = inputs
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner(x, w, b)  # warm-up outside the graph (workspaces, compilation)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            y = runner(x, w, b)
    except Exception as exc:  # noqa: BLE001 - a runner that cannot be captured is rejected, not fatal
        torch.cuda.synchronize()
        first = (str(exc).strip().splitlines() or [""])[0]
        return math.nan, f"CUDA graph capture failed: {type(exc).__name__}: {first}"
    y.fill_(float("nan"))  # the replay must write every element again
    g.replay()
    torch.cuda.synchronize()
    err, why = _judge(y, key, (key.M, key.N), ref, limit, "CUDA graph replay")
    if why:
        return err, why
    drift = rel_error(y, eager.float())
    if drift > limit:
        return drift, f"CUDA graph replay differs from the eager result (rel {drift:.3g})"
    return err, ""
