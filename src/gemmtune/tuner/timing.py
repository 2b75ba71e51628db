"""How gemmtune times a GEMM of any family (docs/benchmarking.md): every speed figure goes through here.

- Cold weights: R input sets (x_i, w_i, bias_i) whose bytes together exceed 2x the L2 are rotated.
- CUDA graphs: R calls (one per set) are captured in one graph; a replay / R is one call's time, so CPU
  launch cost is excluded and every kernel a solution launches (memsets, reductions, casts) counts.
- Ratios in one run: contenders are replayed interleaved, on the same inputs; median of repeats.
- Random data, fresh seed per shape.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import families
from ..backends.base import Runner
from ..device import facts
from ..families import Family

MAX_SETS = 256  # small shapes would need thousands of sets to cover 2x L2; this keeps graphs small
_SPACER_CYCLES = 2_000_000  # ~1 ms of GPU sleep at ~2 GHz: longer than queueing 8 contenders' launches


@dataclass(frozen=True)
class Ceilings:
    read_bw: float  # bytes/s, torch.sum over a 1 GiB bf16 tensor
    flops: float  # FLOP/s, 8192^3 bf16 matmul

    def describe(self) -> str:
        return f"read {self.read_bw / 1e12:.2f} TB/s, bf16 matmul {self.flops / 1e12:.0f} TFLOP/s"


def l2_bytes(device: torch.device) -> int:
    return facts(device).l2_bytes


def make_inputs(key, device: torch.device, sets: int | None = None, seed: int = 0, family: Family | None = None):
    """Random input sets of `family` (a16w16 by default); on a GPU enough of them that their bytes
    exceed 2x L2, so every call reads its weights from HBM."""
    fam = family or families.get("a16w16")
    if sets is None:
        per_set = max(fam.set_bytes(key), 1)
        sets = 1 if device.type != "cuda" else min(MAX_SETS, max(2, math.ceil(2 * l2_bytes(device) / per_set) + 1))
    return fam.make_inputs(key, device, sets, seed)


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def tail_ratio(xs: list[float]) -> float:
    """p90 / median of a runner's samples: ~1 on a quiet machine; a long tail means other work shared it."""
    if len(xs) < 5:
        return 1.0
    s = sorted(xs)
    med = _median(s)
    return s[min(len(s) - 1, int(0.9 * len(s)))] / med if med > 0 else math.nan


def round_order(n: int, rep: int) -> list[int]:
    """The order of n contenders in round `rep`: the rows of a Williams square, cycled. Over n rounds
    (2n for odd n) every contender runs once in every position and right after every other contender
    once. A plain rotation always put the same contender before each one; measured on an H100, which
    kernel ran just before moved an F.linear timing by up to 2% (M=1024 N=7168 K=8192), so a fixed
    predecessor biased one contender for the whole run."""
    if n <= 1:
        return list(range(n))
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...: consecutive differences cover every residue once
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    rows = n if n % 2 == 0 else 2 * n  # odd n: the mirrored square balances what one square cannot
    r = rep % rows
    row = [(x + r) % n for x in first]
    return row if r < n else row[::-1]


def time_graphs(calls: dict[str, Callable[[], object]], reps: int = 20, calls_per_graph: int = 1,
                eager: dict[str, Callable[[], object]] | None = None,
                tails: dict[str, float] | None = None) -> dict[str, float]:  # fmt: skip
    """Capture each callable once in a CUDA graph, replay them interleaved `reps` times.

    Returns median milliseconds per replay / calls_per_graph for each name. A callable that raises
    during warm-up or capture is reported as NaN (the caller decides what failure means).

    `eager`: baselines that cannot be captured (a host sync, e.g. a Python loop over the experts hit),
    timed without a graph: CUDA events around one call, CPU launch cost and host syncs included (what
    a user of that code pays), after each round of replays, so they share the run's inputs and drift.
    Their figures are eager times: label them so wherever they are reported.
    """
    graphs: dict[str, torch.cuda.CUDAGraph] = {}
    stream = torch.cuda.Stream()
    for name, fn in calls.items():
        try:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()  # warm-up outside the graph: compiles, allocates workspaces
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            graphs[name] = g
        except Exception:  # noqa: BLE001 - a failing contender is reported, not fatal
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    eager_ok = _warm_eager(eager or {})
    eager_times: dict[str, list[float]] = {n: [] for n in eager_ok}
    eager_events = {n: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for n in eager_ok}
    names = list(graphs)
    times: dict[str, list[float]] = {n: [] for n in names}
    events = {n: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for n in names}
    for _ in range(2):  # warm replays
        for g in graphs.values():
            g.replay()
    for rep in range(reps):
        # A round starts after a synchronize: without a spacer the first graph would also pay its
        # CPU launch while the GPU idles (2-4% on a 50 us GEMM, measured on an H100). The spacer keeps
        # the GPU busy while every launch of the round is queued; the order changes (round_order) so no
        # contender always runs first or always after the same one.
        torch.cuda._sleep(_SPACER_CYCLES * (1 + len(names) // 8))
        for name in (names[i] for i in round_order(len(names), rep)):
            start, end = events[name]
            start.record()
            graphs[name].replay()
            end.record()
        torch.cuda.synchronize()
        for name in names:
            start, end = events[name]
            times[name].append(start.elapsed_time(end) / calls_per_graph)
        for name in eager_ok:
            start, end = eager_events[name]
            start.record()
            eager[name]()
            end.record()
            torch.cuda.synchronize()
            eager_times[name].append(start.elapsed_time(end) / calls_per_graph)
    out = {n: (_median(times[n]) if n in times else float("nan")) for n in calls}
    if tails is not None:
        tails.update({n: tail_ratio(times[n]) for n in names})
    out.update({n: (_median(eager_times[n]) if n in eager_ok else float("nan")) for n in eager or {}})
    return out


def _warm_eager(eager: dict[str, Callable[[], object]]) -> list[str]:
    """The eager callables that run (twice: caches, compilation); the others time as NaN."""
    ok = []
    for name, fn in eager.items():
        try:
            fn()
            fn()
            torch.cuda.synchronize()
            ok.append(name)
        except Exception:  # noqa: BLE001 - a failing contender is reported, not fatal
            torch.cuda.synchronize()
    return ok


def bench_gemm(
    key,
    runners: dict[str, Runner],
    device: torch.device | str = "cuda",
    reps: int = 20,
    seed: int = 0,
    inputs=None,
    family: Family | None = None,
    tails: dict[str, float] | None = None,
) -> dict[str, float]:
    """Microseconds per call of each runner on `key`: graph replay over rotating cold input sets,
    interleaved, median of `reps`. NaN for a runner that failed to run or capture. `tails`, when given,
    receives each runner's tail_ratio (how noisy its samples were)."""
    device = torch.device(device)
    if device.type != "cuda":
        return _bench_cpu(key, runners, reps, seed, family, tails)
    sets = inputs if inputs is not None else make_inputs(key, device, seed=seed, family=family)

    def calls_of(run):
        def all_sets():
            for args in sets:
                run(*args)

        return all_sets

    ms = time_graphs({n: calls_of(r) for n, r in runners.items()}, reps=reps, calls_per_graph=len(sets), tails=tails)
    return {n: v * 1e3 for n, v in ms.items()}


# The CPU timer: a module attribute so tests can put a virtual clock here (a "slow" fake kernel
# advances it instead of sleeping, which a loaded CI machine would race).
CPU_CLOCK: Callable[[], float] = time.perf_counter


def _bench_cpu(key, runners: dict[str, Runner], reps: int, seed: int, family: Family | None,
               tails: dict[str, float] | None = None) -> dict[str, float]:  # fmt: skip
    """Wall-clock median on the CPU (no graphs there); used by CPU tests and CPU-only tuning."""
    args = make_inputs(key, torch.device("cpu"), sets=1, seed=seed, family=family)[0]
    out: dict[str, float] = {}
    times: dict[str, list[float]] = {n: [] for n in runners}
    failed: set[str] = set()
    for name, run in runners.items():
        try:
            run(*args)
        except Exception:  # noqa: BLE001
            failed.add(name)
    for _ in range(reps):
        for name, run in runners.items():
            if name in failed:
                continue
            t0 = CPU_CLOCK()
            run(*args)
            times[name].append((CPU_CLOCK() - t0) * 1e6)
    for name in runners:
        out[name] = float("nan") if name in failed else _median(times[name])
        if tails is not None and name not in failed:
            tails[name] = tail_ratio(times[name])
    return out


def _measure(device: torch.device) -> Ceilings:
    big = torch.randn(2**29, device=device, dtype=torch.bfloat16)  # 1 GiB
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = time_graphs({"sum": lambda: big.sum(), "mm": lambda: a @ b}, reps=10)
    return Ceilings(read_bw=big.numel() * 2 / (ms["sum"] * 1e-3), flops=2 * n**3 / (ms["mm"] * 1e-3))


@functools.cache
def measure_ceilings(device: torch.device | str = "cuda") -> Ceilings:
    """Read bandwidth (torch.sum of 1 GiB bf16) and bf16 matmul rate (8192^3), measured once."""
    ceil = _measure(torch.device(device))
    torch.cuda.empty_cache()  # the 1.5 GiB of probes are freed once _measure returns
    return ceil


def roof_us(key, ceilings: Ceilings, family: Family | None = None) -> float:
    """max(compute time at the matmul ceiling, bytes at the read bandwidth), in microseconds."""
    return (family or families.get("a16w16")).roof_us(key, ceilings.read_bw, ceilings.flops)
