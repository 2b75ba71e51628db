"""Correctness of one candidate against an fp32 reference, before it is ever timed (any GEMM family).

Metric: rel_err = ||y - ref||_F / ||ref||_F over all output elements, with ref the family's reference
(a16w16: x.float() @ w.float()^T (+ bias), TF32 off) computed from the same rounded inputs. So the
metric measures only what the kernel adds: accumulation order and the rounding of its output.

Thresholds (the family's `error_threshold`; for 16-bit GEMMs by output dtype; `--err-ratio` replaces them):
  bfloat16 1e-2   output rounding alone gives ~2e-3 (unit roundoff 2^-8 over random data)
  float16  2e-3   output rounding alone gives ~3e-4 (2^-11)
  float32  1e-4   fp32 accumulation of 16-bit products gives ~1e-6; TF32 (~1e-3) is rejected
A NaN or Inf anywhere, a wrong shape or dtype, or rel_err > 0.5 (garbage) always rejects.

Uninitialized output memory: runners allocate their own output, so the allocator is poisoned first:
a NaN-filled block of the output's size is allocated and freed right before the call, which the
caching allocator (and usually malloc) hands back as the output. A kernel that skips part of its
output then leaves NaN behind. The graph check replays into a captured output filled with NaN.

Checked calls: the input set as made; the family's other call forms (`check_variants`: for a16w16,
x with a leading batch dim and padded, non-contiguous rows, as the dispatcher can pass; a variant with
other scalar arguments, as the epilogue family's other alpha / beta values, is judged against its own
reference); on CUDA, a CUDA-graph replay, which must reproduce the eager result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .. import families
from ..backends.base import Runner
from ..families import Family
from ..families.base import THRESHOLDS  # noqa: F401 - re-exported: the thresholds this module documents

CATASTROPHIC = 0.5


def _fam(family: Family | None) -> Family:
    return family or families.get("a16w16")


def threshold_for(key, err_ratio: float | None = None, family: Family | None = None) -> float:
    if err_ratio is not None:
        return err_ratio
    return _fam(family).error_threshold(key)


@dataclass
class CheckResult:
    ok: bool
    err: float  # worst rel_err over the checked calls (NaN when the output was not finite)
    reason: str = ""


def reference(key, *inputs, family: Family | None = None) -> torch.Tensor:
    """The family's fp32 reference of one input set (a16w16: x @ w^T (+ b), TF32 off)."""
    return _fam(family).reference(key, inputs)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| over all elements; inf when y has a NaN/Inf."""
    yf = y.float()
    if not bool(torch.isfinite(yf).all()):
        return math.inf
    den = float(torch.linalg.vector_norm(ref))
    num = float(torch.linalg.vector_norm(yf - ref))
    return num / den if den > 0 else num


def _scalars(args: tuple) -> list:
    return [a for a in args if not isinstance(a, torch.Tensor)]


def _poison_allocator(numel: int, dtype: torch.dtype, device: torch.device) -> None:
    # Allocate-and-free a NaN block of exactly the output's size so the next allocation reuses it.
    torch.full((numel,), float("nan"), dtype=dtype, device=device)


def _judge(y, fam: Family, key, shape: tuple, ref: torch.Tensor, limit: float, what: str) -> tuple[float, str]:
    if not isinstance(y, torch.Tensor):
        return math.nan, f"{what}: returned {type(y).__name__}, not a tensor"
    if tuple(y.shape) != tuple(shape):
        return math.nan, f"{what}: output shape {tuple(y.shape)}, expected {tuple(shape)}"
    if y.dtype != fam.out_dtype(key):
        return math.nan, f"{what}: output dtype {y.dtype}, expected {fam.out_dtype(key)}"
    err = rel_error(y.reshape(ref.shape), ref)
    if math.isinf(err):
        return math.nan, f"{what}: output has NaN/Inf (unwritten or overflowed elements)"
    cap = min(limit, CATASTROPHIC)
    if err > cap:
        return err, f"{what}: rel_err {err:.3g} > {cap:.3g}"
    return err, ""


def check_runner(
    runner: Runner,
    key,
    inputs: tuple,
    ref: torch.Tensor,
    err_ratio: float | None = None,
    graph: bool = True,
    family: Family | None = None,
    variants: bool = True,
) -> CheckResult:
    """Run `runner` on `inputs` every way the family's op may call it; judge each output vs `ref`.
    `variants=False, graph=False` is the quick check: the plain call only (the tuner's fast search
    gives every candidate the quick check and the ones that can win the full one)."""
    fam = _fam(family)
    dev = next(t for t in inputs if isinstance(t, torch.Tensor)).device
    limit = threshold_for(key, err_ratio, fam)
    out_shape = fam.output_shape(key)
    numel = math.prod(out_shape)
    worst = 0.0
    eager = None
    calls = [("eager", inputs, out_shape), *(fam.check_variants(key, inputs) if variants else [])]
    for what, args, shape in calls:
        want = ref if _scalars(args) == _scalars(inputs) else reference(key, *args, family=fam)
        _poison_allocator(numel, fam.out_dtype(key), dev)
        y = runner(*args)
        err, why = _judge(y, fam, key, shape, want, limit, what)
        if why:
            return CheckResult(False, err, why)
        worst = max(worst, err)
        if eager is None:
            eager = y.clone()
        del y

    if graph and dev.type == "cuda":
        err, why = _graph_check(runner, fam, key, inputs, eager, ref, limit)
        if why:
            return CheckResult(False, err, why)
        worst = max(worst, err)
    return CheckResult(True, worst)


def _graph_check(runner, fam: Family, key, inputs, eager, ref, limit) -> tuple[float, str]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        runner(*inputs)  # warm-up outside the graph (workspaces, compilation)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            y = runner(*inputs)
    except Exception as exc:  # noqa: BLE001 - a runner that cannot be captured is rejected, not fatal
        torch.cuda.synchronize()
        first = (str(exc).strip().splitlines() or [""])[0]
        return math.nan, f"CUDA graph capture failed: {type(exc).__name__}: {first}"
    y.fill_(float("nan"))  # the replay must write every element again
    g.replay()
    torch.cuda.synchronize()
    err, why = _judge(y, fam, key, fam.output_shape(key), ref, limit, "CUDA graph replay")
    if why:
        return err, why
    drift = rel_error(y.reshape(eager.shape), eager.float())
    if drift > limit:
        return drift, f"CUDA graph replay differs from the eager result (rel {drift:.3g})"
    return err, ""
