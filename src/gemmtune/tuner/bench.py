"""`gemmtune bench`: a tuned table, dispatched through the runtime, vs the vendor default vs the roof.

Per row of the table that applies to this GPU, one interleaved bench_gemm run (docs/benchmarking.md:
CUDA-graph replay over rotating cold input sets, median) of three contenders on the same inputs:
  tuned     gemmtune.gemm with the table in effect (dispatch.set_config), i.e. what a user gets;
  default   the vendor default (torch's default solution: F.linear), timed before and after tuned
            (default, default#2); the noise is the spread between the two, drift included, but never
            less than NOISE_FLOOR (1%, measured with A/A rows, see below).
speedup = default_us / tuned_us; % of roof = roof_us / us (timing.roof_us, ceilings measured in the
same process). A row found slower than the default beyond the noise is timed again on fresh inputs
and graphs, and counts as slower only if the recheck agrees. A row whose solution is the default
itself is never called slower: tuned and default run the same kernel, so their difference is noise.
Geomeans are reported per M range: M <= 16, 16 < M <= 512, M > 512.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import backends
from ..configs.table import ConfigTable
from ..device import identity
from ..dispatch import get_dispatcher, resolve, set_config
from ..keys import GemmKey, dtype_name
from ..ops.gemm import gemm
from .search import DEFAULT_LIBTYPE, shape_seed
from .timing import Ceilings, bench_gemm, measure_ceilings, roof_us

# The smallest difference this method resolves. Rows that dispatch to the default kernel itself are
# A/A runs: on an H100 (76 such rows of the decode, prefill and llama-3-8b benches, 2026-11-21) they
# read 0.993x-1.008x against the same F.linear timed beside them, some in the recheck too, while the
# two default timings agreed to 0.0-0.3%. Two samples understate the noise; below 1% is no difference.
NOISE_FLOOR = 0.01

M_RANGES = (("M<=16", 1, 16), ("16<M<=512", 17, 512), ("M>512", 513, 1 << 62))

# For the progress bar's ETA only (never reported as a figure): shapes differ in cost by orders of
# magnitude, so each is weighed by a rough model of its run instead of counting one unit per shape.
_CONTENDERS = 3  # default, tuned, default#2
_NOMINAL_CPU = Ceilings(read_bw=20e9, flops=200e9)  # a few cores; only the ratios between shapes matter
_SETUP_US = {"cuda": 30_000.0, "cpu": 1_000.0}  # inputs, warm-up, graph capture
_ROUND_US = {"cuda": 1_000.0, "cpu": 0.0}  # the GPU sleep that starts each timed round
_CALL_FLOOR_US = {"cuda": 3.0, "cpu": 2.0}  # a launch-bound call


@dataclass
class BenchRow:
    M: int
    N: int
    K: int
    bias: bool
    dtype: str
    outdtype: str
    solution: str  # what the runtime dispatched to
    table_us: float  # the us the tuner recorded
    tuned_us: float
    default_us: float
    noise: float
    roof_us: float

    @property
    def speedup(self) -> float:
        return self.default_us / self.tuned_us if self.tuned_us > 0 else math.nan

    def roof_pct(self, us: float) -> float:
        return 100.0 * self.roof_us / us if us > 0 and self.roof_us > 0 else math.nan

    recheck_speedup: float = math.nan  # second, independent run of a row the first run found slower
    is_default: bool = False  # the row dispatches to the default solution: tuned and default are one kernel

    @property
    def first_run_slower(self) -> bool:
        return not self.is_default and self.tuned_us > self.default_us * (1 + self.noise)

    @property
    def slower_beyond_noise(self) -> bool:
        """Slower than the default by more than the noise, in the first run and in its recheck."""
        if not self.first_run_slower:
            return False
        return self.recheck_speedup != self.recheck_speedup or self.recheck_speedup < 1 / (1 + self.noise)


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _runner_through_dispatch(key: GemmKey):
    out_dtype = None if key.outdtype == key.dtype else key.outdtype

    def run(x, w, b):
        return gemm(x, w, b, out_dtype)

    return run


def dispatch_overhead_us(device: torch.device, calls: int = 2000) -> float:
    """Eager CPU cost of gemmtune.gemm over F.linear per call (tiny shape, launch-bound), microseconds."""
    x = torch.randn(1, 64, device=device)
    w = torch.randn(64, 64, device=device)
    out = {}
    for name, fn in (("linear", F.linear), ("gemm", gemm), ("linear2", F.linear)):
        for _ in range(50):
            fn(x, w, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x, w, None)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out[name] = (time.perf_counter() - t0) / calls * 1e6
    return out["gemm"] - min(out["linear"], out["linear2"])


def estimated_cost_us(key: GemmKey, device: torch.device, reps: int, ceilings: Ceilings | None = None) -> float:
    """Rough wall time of one shape's bench run (setup, then `reps` interleaved rounds of the
    contenders at roofline speed); weighs the progress bar's ETA, is never reported as a time."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    call_us = max(roof_us(key, ceilings or _NOMINAL_CPU), _CALL_FLOOR_US[kind])
    return _SETUP_US[kind] + reps * (_ROUND_US[kind] + _CONTENDERS * call_us)


def _progress_bar(total: float, shapes: int, enabled: bool):
    from tqdm import tqdm

    # Cost-weighted: the bar and its ETA advance by each shape's estimated cost; the text counts shapes.
    fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"
    return tqdm(total=total, desc="bench", file=sys.stderr, dynamic_ncols=True, smoothing=0.1, bar_format=fmt,
                disable=not (enabled and shapes))  # fmt: skip


def bench_table(
    table: ConfigTable,
    device: torch.device,
    reps: int = 20,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
    progress: bool = False,
) -> list[BenchRow]:
    """Benchmark every row of `table` that applies to `device`; the table is in effect meanwhile.

    progress: a bar on stderr whose ETA weighs each shape by estimated_cost_us."""
    ident = identity(device)
    rows = sorted(table.rows_for(ident), key=lambda r: (r.key.shape_family()[:3], str(r.key.dtype), r.key.M))
    ceilings = measure_ceilings(device) if device.type == "cuda" else None
    torch_backend = backends.get(DEFAULT_LIBTYPE)
    dispatcher = get_dispatcher()
    previous = dispatcher.table()
    costs = [estimated_cost_us(r.key, device, reps, ceilings) for r in rows]
    bar = _progress_bar(sum(costs), len(rows), progress)

    def say(msg: str) -> None:
        with bar.external_write_mode():  # lift the bar off the terminal while the line is written
            log(msg)

    set_config(table)
    out: list[BenchRow] = []
    try:
        for i, (row, cost) in enumerate(zip(rows, costs)):
            key = row.key
            bar.set_description_str(f"bench {key.M}x{key.N}x{key.K} ({i + 1}/{len(rows)} shapes)", refresh=False)
            if key.scaleAB or key.bpreshuffle or not key.dtype.is_floating_point:
                say(f"skipped {key.describe()}: gemmtune bench covers a16w16 GEMMs only")
                bar.update(cost)
                continue
            default_solution = torch_backend.default_solution(key, device)
            default = torch_backend.make_runner(default_solution, key, device)
            res = resolve(key, device)
            is_default = res.solution == default_solution
            # On a GPU the call goes through gemmtune.gemm inside the graph (its CPU cost vanishes, as in
            # serving); without graphs (CPU) wall time would be dispatch cost, reported apart, so the
            # row's resolved runner (what gemm calls) is timed instead.
            tuned = _runner_through_dispatch(key) if device.type == "cuda" else res.runner
            runners = {"default": default, "tuned": tuned, "default#2": default}
            t = bench_gemm(key, runners, device=device, reps=reps, seed=shape_seed(key, seed))
            d1, d2 = t["default"], t["default#2"]
            recheck = math.nan
            noise = max(abs(d1 - d2) / min(d1, d2), NOISE_FLOOR) if min(d1, d2) > 0 else math.nan
            if not is_default and t["tuned"] > (d1 + d2) / 2 * (1 + noise):
                # Found slower: time it again on fresh inputs and graphs before calling it a regression.
                bar.total += cost
                t2 = bench_gemm(key, runners, device=device, reps=reps, seed=shape_seed(key, seed + 1))
                recheck = (t2["default"] + t2["default#2"]) / 2 / t2["tuned"]
                bar.update(cost)
            out.append(
                BenchRow(
                    key.M,
                    key.N,
                    key.K,
                    key.bias,
                    dtype_name(key.dtype),
                    dtype_name(key.outdtype),
                    res.solution.describe(),
                    row.us,
                    t["tuned"],
                    (d1 + d2) / 2,
                    noise,
                    roof_us(key, ceilings) if ceilings else math.nan,
                    recheck,
                    is_default,
                )  # fmt: skip
            )
            say(_line(out[-1]))
            bar.update(cost)
    finally:
        set_config(previous)
        bar.close()
    return out


def _line(r: BenchRow) -> str:
    shape = f"{r.M}x{r.N}x{r.K}{'+b' if r.bias else ''}"
    roof_t = r.roof_pct(r.tuned_us)
    roof_d = r.roof_pct(r.default_us)
    rt = "-" if roof_t != roof_t else f"{roof_t:.0f}%"
    rd = "-" if roof_d != roof_d else f"{roof_d:.0f}%"
    flag = "  (= default: noise only)" if r.is_default else ""
    if r.first_run_slower:
        again = f"recheck {r.recheck_speedup:.3f}x"
        flag = f"  SLOWER ({again})" if r.slower_beyond_noise else f"  (slower once; {again})"
    return (
        f"{shape:<22} {r.solution[:40]:<40} {r.tuned_us:>9.2f} {r.default_us:>9.2f} {r.speedup:>7.3f}x "
        f"{r.noise * 100:>5.1f}% {rt:>6} {rd:>6}{flag}"
    )


HEADER = (
    f"{'shape (MxNxK)':<22} {'dispatched to':<40} {'tuned us':>9} {'default':>9} {'speedup':>8} "
    f"{'noise':>6} {'roof':>6} {'d.roof':>6}"
)


def summarize(rows: list[BenchRow]) -> dict:
    ranges = {}
    for name, lo, hi in M_RANGES:
        sel = [r for r in rows if lo <= r.M <= hi]
        if not sel:
            continue
        ranges[name] = {
            "shapes": len(sel),
            "geomean_speedup": _geomean([r.speedup for r in sel]),
            "worst_speedup": min(r.speedup for r in sel),
            "geomean_roof_pct_tuned": _geomean([r.roof_pct(r.tuned_us) for r in sel]),
            "geomean_roof_pct_default": _geomean([r.roof_pct(r.default_us) for r in sel]),
            "slower_beyond_noise": sum(r.slower_beyond_noise for r in sel),
        }
    return {
        "shapes": len(rows),
        "geomean_speedup": _geomean([r.speedup for r in rows]),
        "slower_beyond_noise": sum(r.slower_beyond_noise for r in rows),
        "ranges": ranges,
    }


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for name, s in summary["ranges"].items():
        rt, rd = s["geomean_roof_pct_tuned"], s["geomean_roof_pct_default"]
        roof = "" if rt != rt else f", roof {rt:.0f}% (default {rd:.0f}%)"
        lines.append(
            f"{name:<10} {s['shapes']:>4} shapes: geomean speedup {s['geomean_speedup']:.3f}x "
            f"(worst {s['worst_speedup']:.3f}x){roof}, slower beyond noise: {s['slower_beyond_noise']}"
        )
    lines.append(
        f"all        {summary['shapes']:>4} shapes: geomean speedup {summary['geomean_speedup']:.3f}x, "
        f"slower beyond noise: {summary['slower_beyond_noise']}"
    )
    return lines


def _finite(v):
    """NaN/Inf -> None, so the JSON is standard."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_finite(x) for x in v]
    return v


def write_outputs(rows: list[BenchRow], summary: dict, prefix: str, meta: dict) -> list[str]:
    """prefix.csv, prefix.json and (when matplotlib is installed) prefix.png; returns notes."""
    import csv

    notes = []
    cols = [*BenchRow.__dataclass_fields__, "speedup", "tuned_roof_pct", "default_roof_pct"]
    with open(prefix + ".csv", "w", newline="", encoding="utf-8") as fh:
        wr = csv.writer(fh, lineterminator="\n")
        wr.writerow(cols)
        for r in rows:
            d = asdict(r)
            wr.writerow([*d.values(), f"{r.speedup:.4f}", f"{r.roof_pct(r.tuned_us):.1f}",
                         f"{r.roof_pct(r.default_us):.1f}"])  # fmt: skip
    with open(prefix + ".json", "w", encoding="utf-8") as fh:
        data = {"meta": meta, "summary": summary, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}
        json.dump(_finite(data), fh, indent=1)
    notes.append(f"wrote {prefix}.csv and {prefix}.json")
    try:
        plot(rows, prefix + ".png", meta.get("title", "gemmtune bench"))
        notes.append(f"wrote {prefix}.png")
    except ImportError:
        notes.append("matplotlib is not installed: no plot (pip install matplotlib)")
    return notes


def plot(rows: list[BenchRow], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams: dict[tuple, list[BenchRow]] = {}
    for r in rows:
        fams.setdefault((r.N, r.K, r.bias, r.dtype), []).append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for (n, k, b, _), rs in fams.items():
        rs = sorted(rs, key=lambda r: r.M)
        ms = [r.M for r in rs]
        line = ax1.plot(ms, [r.speedup for r in rs], marker="o", label=f"{n}x{k}{'+b' if b else ''}")[0]
        if any(r.roof_us == r.roof_us for r in rs):
            ax2.plot(ms, [r.roof_pct(r.tuned_us) for r in rs], marker="o", color=line.get_color())
            ax2.plot(ms, [r.roof_pct(r.default_us) for r in rs], ls="--", color=line.get_color())
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xscale="log", xlabel="M (tokens)", ylabel="speedup vs default (default us / tuned us)", title=title)
    ax1.legend(fontsize=7, title="N x K")
    ax2.set(xscale="log", xlabel="M (tokens)", ylabel="% of roof (solid tuned, dashed default)", ylim=(0, 105))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
