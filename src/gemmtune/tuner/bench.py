"""`gemmtune bench`: a tuned table of any GEMM family, dispatched through the runtime, vs the family's
default vs the roof, at the table's own Ms or at any list of Ms (`--ms`: tuned or not, what a server runs).

Per key (a row of the table that applies to this GPU, or each of its shapes at each M of `ms`), one
interleaved bench_gemm run (docs/benchmarking.md: CUDA-graph replay over rotating cold input sets,
median) of three contenders on the same inputs:
  tuned     what the runtime dispatches with the table in effect (dispatch.set_config): for a16w16 the
            call goes through gemmtune.gemm, for other families through the runner their op caches;
  default   the family's default (torch's default solution: F.linear, torch.bmm ...), timed before and after tuned
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
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .. import backends
from ..configs.files import PNG, Kind, csv_header, json_object_with, replace_file, save_figure
from ..configs.table import ConfigTable
from ..device import identity
from ..dispatch import get_dispatcher, resolve, set_config
from ..families import Family
from ..keys import GemmKey, dtype_name
from ..ops.gemm import gemm
from .search import NOISE_FLOOR, quietest, runs_to_agree, shape_seed
from .timing import Ceilings, bench_gemm, measure_ceilings, roof_us

# NOISE_FLOOR (search.py): the smallest difference this method resolves. Rows that dispatch to the
# default kernel itself are A/A runs: on an H100 (76 such rows of the decode, prefill and llama-3-8b
# benches) they read 0.993x-1.008x against the same F.linear timed beside them, while the two default
# timings agreed to 0.0-0.3%. Two samples understate the noise; below 1% is no difference.

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
        if self.is_default:  # one kernel timed twice: any ratio but 1 would report noise as a speedup
            return 1.0
        return self.default_us / self.tuned_us if self.tuned_us > 0 else math.nan

    def roof_pct(self, us: float) -> float:
        return 100.0 * self.roof_us / us if us > 0 and self.roof_us > 0 else math.nan

    recheck_speedup: float = math.nan  # second, independent run of a row the first run found slower
    is_default: bool = False  # the row dispatches to the default solution: tuned and default are one kernel
    family: str = "a16w16"
    shape: str = ""  # the key without M, as the family writes it
    row_m: int = 0  # M of the table row that answered (0: none, the default ran)
    busy: str = ""  # why the timing stayed noisy after re-measuring ('' when the machine was quiet)

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


def estimated_cost_us(key, device: torch.device, reps: int, ceilings: Ceilings | None = None,
                      family: Family | None = None) -> float:  # fmt: skip
    """Rough wall time of one shape's bench run (setup, then `reps` interleaved rounds of the
    contenders at roofline speed); weighs the progress bar's ETA, is never reported as a time."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    try:
        call_us = max(roof_us(key, ceilings or _NOMINAL_CPU, family), _CALL_FLOOR_US[kind])
    except NotImplementedError:
        call_us = _CALL_FLOOR_US[kind]
    return _SETUP_US[kind] + reps * (_ROUND_US[kind] + _CONTENDERS * call_us)


def _progress_bar(total: float, shapes: int, enabled: bool):
    from tqdm import tqdm

    # Cost-weighted: the bar and its ETA advance by each shape's estimated cost; the text counts shapes.
    fmt = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}]"
    # Not a terminal (a log file, CI): no bar redrawn with carriage returns; each shape's line is the progress.
    from .runner import stderr_is_tty

    tty = stderr_is_tty()
    return tqdm(total=total, desc="bench", file=sys.stderr, dynamic_ncols=True, smoothing=0.1, bar_format=fmt,
                disable=not (enabled and shapes and tty))  # fmt: skip


def bench_keys(table: ConfigTable, ident, ms: list[int] | None = None) -> list[tuple]:
    """What to bench: the table's rows for this GPU (key, recorded us), or with `ms` each of its shapes
    at every M of `ms` (recorded us where a row has exactly that key, else NaN)."""
    fam = table.family
    rows = table.rows_for(ident)
    order = lambda k: (str(fam.shape_family(k)), fam.m_of(k))  # noqa: E731
    if not ms:
        return sorted(((r.key, r.us) for r in rows), key=lambda p: order(p[0]))
    recorded = {r.key: r.us for r in rows}
    shapes = dict.fromkeys(fam.with_m(r.key, 1) for r in rows)
    keys = [fam.with_m(k, m) for k in shapes for m in sorted(set(ms))]
    return sorted(((k, recorded.get(k, math.nan)) for k in keys), key=lambda p: order(p[0]))


def _shape_text(fam: Family, key) -> str:
    text = fam.describe(key).removeprefix(fam.name + " ")
    return " ".join(p for p in text.split() if not p.startswith(f"{fam.m_field}="))


def bench_table(
    table: ConfigTable,
    device: torch.device,
    reps: int = 20,
    seed: int = 0,
    log: Callable[[str], None] = lambda m: None,
    progress: bool = False,
    ms: list[int] | None = None,
) -> list[BenchRow]:
    """Benchmark `table` on `device` (its rows for this GPU, or its shapes at every M of `ms`); the table
    is in effect meanwhile.

    progress: a bar on stderr whose ETA weighs each shape by estimated_cost_us."""
    fam = table.family
    ident = identity(device)
    keys = bench_keys(table, ident, ms)
    ceilings = measure_ceilings(device) if device.type == "cuda" else None
    dispatcher = get_dispatcher()
    previous = dispatcher.store()
    costs = [estimated_cost_us(k, device, reps, ceilings, fam) for k, _ in keys]
    bar = _progress_bar(sum(costs), len(keys), progress)

    def say(msg: str) -> None:
        with bar.external_write_mode():  # lift the bar off the terminal while the line is written
            log(msg)

    set_config(table)
    out: list[BenchRow] = []
    try:
        for i, ((key, table_us), cost) in enumerate(zip(keys, costs)):
            bar.set_description_str(f"bench {fam.describe(key)} ({i + 1}/{len(keys)} shapes)", refresh=False)
            why = _unbenchable(fam, key)
            if why:
                say(f"skipped {fam.describe(key)}: {why}")
                bar.update(cost)
                continue
            default_backend, default_solution = backends.default(fam.name, key, device)
            default = default_backend.make_runner(default_solution, key, device)
            res = resolve(key, device, fam.name)
            is_default = res.solution == default_solution
            # On a GPU the a16w16 call goes through gemmtune.gemm inside the graph (its CPU cost vanishes,
            # as in serving); without graphs (CPU) wall time would be dispatch cost, reported apart, so
            # the row's resolved runner (what the op calls) is timed instead.
            through_op = device.type == "cuda" and fam.name == "a16w16"
            tuned = _runner_through_dispatch(key) if through_op else res.runner
            runners = {"default": default, "tuned": tuned, "default#2": default}
            sseed = shape_seed(key, seed, fam)
            t, busy = _quietest(key, runners, device, reps, sseed, fam)
            d1, d2 = t["default"], t["default#2"]
            recheck = math.nan
            noise = max(abs(d1 - d2) / min(d1, d2), NOISE_FLOOR) if min(d1, d2) > 0 else math.nan
            default_us = min(d1, d2) if busy else (d1 + d2) / 2  # load only adds time: keep the quieter copy
            if not is_default and t["tuned"] > (d1 + d2) / 2 * (1 + noise):
                # Found slower: time it again on fresh inputs and graphs before calling it a regression.
                bar.total += cost
                t2 = bench_gemm(key, runners, device=device, reps=reps, seed=sseed + 1, family=fam)
                recheck = (t2["default"] + t2["default#2"]) / 2 / t2["tuned"]
                bar.update(cost)
            out.append(
                BenchRow(
                    fam.m_of(key),
                    getattr(key, "N", 0),
                    getattr(key, "K", 0),
                    bool(getattr(key, "bias", False)),
                    dtype_name(getattr(key, "dtype", torch.bfloat16)),
                    dtype_name(fam.out_dtype(key)),
                    res.solution.describe(),
                    table_us,
                    t["tuned"],
                    default_us,
                    noise,
                    roof_us(key, ceilings, fam) if ceilings else math.nan,
                    recheck,
                    is_default,
                    fam.name,
                    _shape_text(fam, key),
                    res.row.m if res.row is not None else 0,
                    busy,
                )  # fmt: skip
            )
            say(_line(out[-1]))
            bar.update(cost)
    finally:
        set_config(previous)
        bar.close()
    return out


def _quietest(key, runners, device, reps: int, seed: int, fam: Family) -> tuple[dict[str, float], str]:
    """bench_gemm, repeated while the machine looks busy (search.quietest): the quietest run's times and,
    when even that one was disturbed, why."""
    times, why = quietest(lambda tails: bench_gemm(key, runners, device=device, reps=reps, seed=seed, family=fam,
                                                   tails=tails), runs_to_agree(device))  # fmt: skip
    return times, why or ""


def _unbenchable(fam: Family, key) -> str:
    if not backends.all_backends(fam.name):
        return f"the {fam.name} family has no runnable op here ({fam.unrunnable})"
    if fam.name == "a16w16" and (key.scaleAB or key.bpreshuffle or not key.dtype.is_floating_point):
        return "scaled / pre-shuffled a16w16 rows are aiter's: gemmtune runs no such kernel"
    return ""


def _line(r: BenchRow) -> str:
    if r.family == "a16w16":
        shape = f"{r.M}x{r.N}x{r.K}{'+b' if r.bias else ''}"
    else:
        shape = f"M={r.M} {r.shape}"
    roof_t = r.roof_pct(r.tuned_us)
    roof_d = r.roof_pct(r.default_us)
    rt = "-" if roof_t != roof_t else f"{roof_t:.0f}%"
    rd = "-" if roof_d != roof_d else f"{roof_d:.0f}%"
    flag = "  (= default: same kernel, no speedup)" if r.is_default else ""
    if r.busy:
        flag += f"  (busy machine: {r.busy})"
    if r.row_m and r.row_m != r.M:
        flag += f"  [row M={r.row_m}]"
    if r.first_run_slower:
        again = f"recheck {r.recheck_speedup:.3f}x"
        flag = f"  SLOWER ({again})" if r.slower_beyond_noise else f"  (slower once; {again})"
    return (
        f"{shape:<22} {r.solution[:40]:<40} {r.tuned_us:>9.2f} {r.default_us:>9.2f} {_speedup_text(r):>8} "
        f"{r.noise * 100:>5.1f}% {rt:>6} {rd:>6}{flag}"
    )


def _speedup_text(r: BenchRow) -> str:
    return "=" if r.is_default else f"{r.speedup:.3f}x"


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
            "dispatch_default": sum(r.is_default for r in sel),
        }
    return {
        "shapes": len(rows),
        "dispatch_default": sum(r.is_default for r in rows),
        "busy": sum(bool(r.busy) for r in rows),
        "geomean_speedup": _geomean([r.speedup for r in rows]),
        "slower_beyond_noise": sum(r.slower_beyond_noise for r in rows),
        "ranges": ranges,
    }


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for name, s in summary["ranges"].items():
        if s.get("dispatch_default") == s["shapes"]:
            lines.append(f"{name:<10} {s['shapes']:>4} shapes: all dispatch the default itself: no speedup to report")
            continue
        rt, rd = s["geomean_roof_pct_tuned"], s["geomean_roof_pct_default"]
        roof = "" if rt != rt else f", roof {rt:.0f}% (default {rd:.0f}%)"
        lines.append(
            f"{name:<10} {s['shapes']:>4} shapes: geomean speedup {s['geomean_speedup']:.3f}x "
            f"(worst {s['worst_speedup']:.3f}x){roof}, slower beyond noise: {s['slower_beyond_noise']}"
        )
    n, same = summary["shapes"], summary.get("dispatch_default", 0)
    if n and same == n:
        lines.append(f"all        {n:>4} shapes dispatch the default itself (the table keeps it everywhere): "
                     "no speedup to report")  # fmt: skip
    else:
        lines.append(
            f"all        {n:>4} shapes: geomean speedup {summary['geomean_speedup']:.3f}x"
            f"{f' ({same} dispatch the default, counted 1x)' if same else ''}, "
            f"slower beyond noise: {summary['slower_beyond_noise']}"
        )
    if summary.get("busy"):
        lines.append(f"{summary['busy']} shapes were timed on a busy machine even after re-measuring: "
                     "their figures are unreliable; bench again when the machine is quiet")  # fmt: skip
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


def _csv_columns() -> list[str]:
    return [*BenchRow.__dataclass_fields__, "speedup", "tuned_roof_pct", "default_roof_pct"]


# A report of any gemmtune version: its columns grow, these stay.
BENCH_CSV = Kind("bench report", lambda p: {"solution", "tuned_us", "default_us"} <= set(csv_header(p)))
BENCH_JSON = Kind("bench report", lambda p: json_object_with(p, ("meta", "summary", "rows")))


def bench_outputs(prefix: str) -> list[tuple[str, Kind, str]]:
    """(path, kind, option) of every file write_outputs writes for `prefix`."""
    return [(prefix + ".csv", BENCH_CSV, "-o"), (prefix + ".json", BENCH_JSON, "-o"), (prefix + ".png", PNG, "-o")]


def write_outputs(rows: list[BenchRow], summary: dict, prefix: str, meta: dict) -> list[str]:
    """prefix.csv, prefix.json and (when matplotlib is installed) prefix.png, each under the file rule
    (configs/files.py); returns notes."""
    import csv
    import io

    notes = []
    cols = _csv_columns()
    buf = io.StringIO()
    wr = csv.writer(buf, lineterminator="\n")
    wr.writerow(cols)
    for r in rows:
        d = asdict(r)
        wr.writerow([*d.values(), f"{r.speedup:.4f}", f"{r.roof_pct(r.tuned_us):.1f}",
                     f"{r.roof_pct(r.default_us):.1f}"])  # fmt: skip
    replace_file(prefix + ".csv", buf.getvalue(), BENCH_CSV)
    data = {"meta": meta, "summary": summary, "rows": [asdict(r) | {"speedup": r.speedup} for r in rows]}
    replace_file(prefix + ".json", json.dumps(_finite(data), indent=1), BENCH_JSON)
    notes.append(f"wrote {prefix}.csv and {prefix}.json")
    try:
        plot(rows, prefix + ".png", meta.get("title", "gemmtune bench"), cpu=meta.get("device") == "cpu")
        notes.append(f"wrote {prefix}.png")
    except ImportError:
        notes.append(f"matplotlib is not installed: no {prefix}.png (pip install matplotlib, a dependency of gemmtune)")
    return notes


def _m_axis(ax, ms: list[int]) -> None:
    """A log M axis ticked at the Ms benched, in plain numbers (not 3x10^0); powers of two only when
    there are too many to read."""
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    ticks = sorted(set(ms))
    if len(ticks) > 12:
        ticks = [m for m in ticks if m & (m - 1) == 0] or ticks[:: max(1, len(ticks) // 12)]
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    fmt = ScalarFormatter()
    fmt.set_scientific(False)
    ax.xaxis.set_major_formatter(fmt)
    ax.tick_params(axis="x", labelsize=8, labelrotation=45 if len(ticks) > 8 else 0)


def plot(rows: list[BenchRow], path: str, title: str, cpu: bool = False) -> None:
    """Speedup vs M per shape; beside it % of roof (GPU), or on the CPU, with no roofline, the times
    themselves (speedups there sit on 1x and would hide one another)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes: dict[str, list[BenchRow]] = {}
    for r in rows:
        label = f"{r.N}x{r.K}{'+b' if r.bias else ''}" if r.family == "a16w16" else r.shape
        shapes.setdefault(label, []).append(r)
    roofed = any(r.roof_us == r.roof_us and r.roof_us > 0 for r in rows)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5), squeeze=False)
    ax1, ax2 = axes[0]
    for label, rs in shapes.items():
        rs = sorted(rs, key=lambda r: r.M)
        ms = [r.M for r in rs]
        line = ax1.plot(ms, [r.speedup for r in rs], marker="o", label=label)[0]
        if roofed:
            ax2.plot(ms, [r.roof_pct(r.tuned_us) for r in rs], marker="o", color=line.get_color())
            ax2.plot(ms, [r.roof_pct(r.default_us) for r in rs], ls="--", color=line.get_color())
        else:
            ax2.plot(ms, [r.tuned_us for r in rs], marker="o", color=line.get_color())
            ax2.plot(ms, [r.default_us for r in rs], ls="--", color=line.get_color())
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set(xlabel="M (tokens)", ylabel="speedup vs default (default us / tuned us)")
    caveats = []
    if cpu:
        caveats.append("CPU: measures the harness, not a speedup")
    if rows and all(r.is_default for r in rows):
        caveats.append("every key dispatches the default itself: 1x by construction")
    ax1.set_title("\n".join([textwrap.fill(title, 60), *caveats]), fontsize=10)
    if roofed:
        ax2.set(ylabel="% of roof (solid tuned, dashed default)", ylim=(0, 105))
    else:
        from matplotlib.ticker import FuncFormatter

        ax2.set(yscale="log", ylabel="us per call (solid tuned, dashed default)")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # 6, not 6x10^0
        # Minor ticks labelled at 2 and 5 of each decade only: all of them overlap on a tall range.
        two_five = FuncFormatter(lambda v, _: f"{v:g}" if v > 0 and f"{v:e}"[0] in "25" else "")
        ax2.yaxis.set_major_formatter(plain)
        ax2.yaxis.set_minor_formatter(two_five)
        ax2.set_title("time per call (no roofline without a GPU)", fontsize=10)
    all_ms = [r.M for r in rows]
    for ax in (ax1, ax2):
        ax.set_xlabel("M (tokens)")
        _m_axis(ax, all_ms)
    # The legend goes right of the last panel: inside, it covered the points.
    ax2.legend(fontsize=7, title="shape", loc="upper left", bbox_to_anchor=(1.02, 1.0),
               borderaxespad=0.0, handles=ax1.get_legend_handles_labels()[0])  # fmt: skip
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
