"""Tune one key of any GEMM family: check every candidate, screen them cheaply, time the finalists
against the family's default.

1. Candidates: every solution of every selected backend that supports the key (the family's default,
   what its policy runs untuned, is always timed, whatever --libtype says). A tune from a donor table
   (`--from`, TuneOptions.donor) takes only the donor's solutions for the key and their neighbours
   (donor.py); the steps below are the same.
2. Correctness (check.py) on random data; a candidate that raises, runs out of memory, or fails the
   check is rejected with the reason and never timed.
3. Screen: all passing candidates, in interleaved groups of --batch (fewer when their graph outputs
   would not fit in a quarter of free memory), `screen_reps` (>= 5) graph replays each over the same
   rotating cold input sets, each group with the default as its anchor (candidates are ranked by their
   time relative to it, so groups timed in separate runs compare fairly); the `top` fastest go on.
4. Final: the finalists and the default, one interleaved bench_gemm run of `reps` replays
   (docs/benchmarking.md), the default timed twice as two contenders (d1, d2): noise = |d1 - d2| /
   min(d1, d2).
5. Decision: the fastest finalist replaces the default only if default_us / its_us - 1 exceeds both
   --min-gain and the noise; otherwise the default is kept, so a tuned row never makes a shape slower.
   A close call (the gain within MARGIN of that line, or a runner-up within RUNNER_UP of the best) is
   timed once more, those contenders and the default alone on fresh inputs, and decided on the mean
   of both rounds: one round's noise otherwise flips such decisions from run to run. A winner must
   then also beat the default by that line head to head (the two alone, fresh inputs, as `bench`
   times a row), or the default is kept.
   Two-stage families (fmoe): before step 3, each stage's kernels are checked and timed apart and the
   fastest of each paired (stages.py); the pairs join the candidates, and the winner's stages are
   timed once more for the row's per-stage columns (us1/us2, err1/err2).
6. Range: the row will answer the Ms between the previous tuned M of its shape (exclusive) and its own
   (`m_lo`..M). The winner is checked and timed against the default at points ~1.5x apart from M down
   to m_lo (range_points); the range ends above the first point where it is slower beyond the noise
   (down to M alone), and the runtime sends the Ms outside every verified range to the default.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import backends, families
from ..backends.base import Backend, Runner, Solution, compile_items_of
from ..families import Family
from .candidates import (
    FAILED,
    OK,
    REJECTED,
    SEARCHES,
    SKIPPED,
    CandidateResult,
    DeviceLostError,
    Heartbeat,
    TuneOptions,
    after_failure,
    check_deadline,
    describe_exc,
    group_size,
    time_group,
)
from .check import check_runner, reference
from .donor import DonorPlan, donor_verdict, plan_for
from .stages import search_stages, stage_columns
from .timing import make_inputs, measure_ceilings, roof_us

DEFAULT_LIBTYPE = "torch"


def _no_heartbeat(names: list[str], phase: str) -> None:
    pass


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ShapeResult:
    key: tuple
    winner: CandidateResult
    us: float
    default: CandidateResult
    default_us: float
    noise: float
    roof_us: float
    kept_default: bool
    candidates: list[CandidateResult] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    family: str = "a16w16"
    m_lo: int = 0  # the verified range the row answers (0: not verified)
    m_hi: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per tuning phase
    extra: dict[str, str] = field(default_factory=dict)  # more columns of the row (per-stage us / err)
    busy: str = ""  # why the final timing stayed noisy after re-measuring ('' when it was quiet)
    donor: str = ""  # a donor tune (--from): what happened to the key (donor.VERDICTS); '' otherwise

    @property
    def speedup(self) -> float:
        return self.default_us / self.us if self.us > 0 else math.nan

    @property
    def roof_pct(self) -> float:
        return 100.0 * self.roof_us / self.us if self.us > 0 and self.roof_us > 0 else math.nan


def shape_seed(key, seed: int, family: Family | None = None) -> int:
    """A fresh, reproducible seed per shape."""
    text = (family or families.get("a16w16")).describe(key)
    return (seed * 1_000_003 + zlib.crc32(text.encode())) & 0x7FFFFFFF


def select_backends(device: torch.device, libtypes: list[str] | None, family: str = "a16w16") -> dict[str, Backend]:
    """The backends to draw candidates from; ValueError naming what is known/available otherwise."""
    known = backends.all_backends(family)
    avail = backends.available(device, family)
    if not known:
        raise ValueError(f"the {family} family has no backend in gemmtune yet ({families.get(family).unrunnable})")
    if not libtypes:
        return avail
    unknown = [n for n in libtypes if n not in known]
    if unknown:
        errs = backends.import_errors()
        why = "; ".join(f"{m}: {e}" for m, e in errs.items())  # backend modules that failed to import
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            + (f" (failed to load: {why})" if why else "")
        )
    missing = [n for n in libtypes if n not in avail]
    if missing:
        reasons = "; ".join(known[n].unavailable_reason(device) or f"{n}: not available" for n in missing)
        raise ValueError(f"backend(s) not available on {device}: {reasons} (available: {', '.join(sorted(avail))})")
    return {n: avail[n] for n in libtypes}


def _unique_name(names: dict, cand: CandidateResult) -> str:
    name = cand.name
    if name in names:
        name = f"{name}@{cand.solidx}/sk{cand.splitk}"
    return name


@dataclass
class _Pool:
    """The candidates of one key: results by unique name, and what is needed to run each."""

    results: dict[str, CandidateResult] = field(default_factory=dict)
    solutions: dict[str, tuple[Backend, Solution]] = field(default_factory=dict)
    runners: dict[str, Runner] = field(default_factory=dict)  # the ones that passed the check
    busy: str = ""  # set by _final when even the quietest of its runs was noisy
    roles: dict[str, str] = field(default_factory=dict)  # a donor tune: donor.DONOR / donor.NEAR by name


def _offered(bname: str, backend: Backend, key, device, plan: DonorPlan | None) -> list[tuple[str, Solution]]:
    """(role, solution) for each solution of `backend` a tune of `key` times: with a usable donor plan
    its donor solutions and their neighbours, else every candidate it supports (role '')."""
    if plan is not None and plan.usable:
        return list(plan.by_backend.get(bname, []))
    return [("", s) for s in backend.candidates(key, device) if backend.supports(s, key, device)]


def donor_plan(fam: Family, key, device, opts: TuneOptions, chosen: dict[str, Backend],
               listed=None) -> tuple[DonorPlan | None, str]:  # fmt: skip
    """A donor tune's plan for `key` (None: not a donor tune, or the full search) and a note: for the
    full search why, for a key seeded from its shape's rows at other Ms which Ms; `listed`: the
    backends whose short lists are wanted (donor.plan_for)."""
    if opts.donor is None:
        return None, ""
    picks = opts.donor.get(key)
    if not picks:
        return None, "no donor row"
    plan = plan_for(picks, key, device, chosen, backends.default(fam.name, key, device)[1], listed)
    if not plan.usable:
        return None, f"no donor solution runs here ({'; '.join(plan.unusable)})"
    donor_ms = sorted({p.m for p in picks})
    if donor_ms != [fam.m_of(key)]:
        return plan, "donor rows of M=" + ",".join(map(str, donor_ms))
    return plan, ""


def _gather(fam: Family, key, device, opts: TuneOptions, exclude, plan: DonorPlan | None = None) -> _Pool:
    """Every solution of every selected backend that supports the key (with a donor plan: its short
    list); `exclude` pre-decides some."""
    pool = _Pool()
    for bname, backend in select_backends(device, opts.libtypes, fam.name).items():
        try:
            offered = _offered(bname, backend, key, device, plan)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot list candidates is reported
            bad = CandidateResult(bname, "<candidates>", -1, 0, FAILED, reason=describe_exc(exc))
            pool.results[bad.name] = bad
            continue
        for role, sol in offered:
            cand = CandidateResult.of(sol)
            name = _unique_name(pool.results, cand)
            if name in exclude:
                cand.status, cand.reason = exclude[name]
            pool.results[name] = cand
            pool.solutions[name] = (backend, sol)
            if role:
                pool.roles[name] = role
    return pool


def _check_all(fam, key, device, opts, pool: _Pool, default: CandidateResult, check_in, ref, heartbeat, say,
               phases: dict[str, float] | None = None, quick: bool = False):  # fmt: skip
    """Check every pending candidate against the reference; passing ones get a runner in the pool.
    `quick`: the plain call only (no other call forms, no graph replay); see _confirm."""
    deadline = check_deadline(opts, 0.5 if fam.stages else 1.0)  # the stages' checks took the other half
    phases = {} if phases is None else phases
    for name, cand in pool.results.items():
        if cand.status != "pending":
            continue
        if time.perf_counter() > deadline:
            cand.status, cand.reason = SKIPPED, f"over the {opts.budget_s:g} s budget"
            continue
        if name == default.name and (cand.solidx, cand.splitk) == (default.solidx, default.splitk):
            cand.status, cand.err, cand.reason = default.status, default.err, default.reason
            continue  # the default itself: timed in the final run under its own name
        backend, sol = pool.solutions[name]
        heartbeat([name], "check")
        t0 = time.perf_counter()
        try:
            run = backend.make_runner(sol, key, device)
            verdict = check_runner(run, key, check_in, ref, opts.err_ratio, family=fam, graph=not quick,
                                   variants=not quick)  # fmt: skip
        except DeviceLostError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of a candidate rejects it alone
            cand.status, cand.reason = FAILED, describe_exc(exc)
            after_failure(device, name, exc)
            say(f"  {name}: failed ({cand.reason})")
            continue
        finally:
            what = f"check:{cand.libtype}"
            phases[what] = phases.get(what, 0.0) + time.perf_counter() - t0
        cand.err = verdict.err
        if verdict.ok:
            cand.status = OK
            pool.runners[name] = run
        else:
            cand.status, cand.reason = REJECTED, verdict.reason
            say(f"  {name}: rejected ({verdict.reason})")
        _sync(device)


def _full_check(fam, key, device, opts, pool: _Pool, name: str, check_in, ref, say) -> bool:
    """The fast search's check of a would-be winner: every call form and a graph replay (the quick
    check ran only the plain call). A candidate that fails it is rejected."""
    cand = pool.results[name]
    try:
        verdict = check_runner(pool.runners[name], key, check_in, ref, opts.err_ratio, family=fam)
    except DeviceLostError:
        raise
    except Exception as exc:  # noqa: BLE001 - a failure rejects this candidate alone
        cand.status, cand.reason = FAILED, describe_exc(exc)
        after_failure(device, name, exc)
        say(f"  {name}: failed the full check ({cand.reason})")
        return False
    if verdict.ok:
        cand.err = max(cand.err, verdict.err)
        return True
    cand.status, cand.reason = REJECTED, verdict.reason
    say(f"  {name}: rejected by the full check ({verdict.reason})")
    return False


ANCHOR = "default#anchor"  # the default in every screen group (a name no candidate can take)


def _screen(fam, key, device, opts, pool: _Pool, seed, inputs, heartbeat, isolate, default_runner) -> list[str]:
    """The `top` fastest passing candidates, fastest first, after a cheap interleaved timing in groups.
    Every group also times the default (ANCHOR) and each candidate's screen time is taken relative to
    it: groups are separate runs, and one run's absolute times can sit several % off another's
    (measured on an H100: 2-4% between runs, under 0.5% within one), which misranked candidates of
    different groups."""
    if len(pool.runners) <= opts.top:
        return list(pool.runners)
    results = pool.results
    sets = len(inputs) if inputs else 1
    size = 1 if isolate else max(1, group_size(fam, key, device, sets, opts.batch) - 1)
    names = list(pool.runners)
    scale = math.nan  # the anchor's time in the first group that timed it: every group is scaled to it
    for i in range(0, len(names), size):
        group = {n: pool.runners[n] for n in names[i : i + size]}
        times = time_group(key, {**group, ANCHOR: default_runner}, device, max(5, opts.screen_reps), seed, inputs,
                           heartbeat, "screen", fam)  # fmt: skip
        anchor = times.pop(ANCHOR)
        if scale != scale:
            scale = anchor
        factor = scale / anchor if anchor == anchor and scale == scale else 1.0
        for n, us in times.items():
            results[n].screen_us = us * factor
    timed = [n for n in names if results[n].screen_us == results[n].screen_us]  # not NaN
    for n in names:
        if n not in timed:
            results[n].status, results[n].reason = FAILED, "timing failed (graph capture or launch error)"
    return sorted(timed, key=lambda n: results[n].screen_us)[: opts.top]


# A busy machine (other processes, a throttled GPU): the default timed twice disagreeing by more than
# BUSY_SPREAD, or its samples' p90 beyond LONG_TAIL x their median. Such a run is timed again, up to
# REMEASURE times, and the quietest kept; its times are never averaged with an outlier.
BUSY_SPREAD = 0.25
LONG_TAIL = 3.0
REMEASURE = 2


def busy_reason(d1: float, d2: float, tails: dict[str, float]) -> str:
    """Why a run with default copies d1, d2 and these tail ratios (every contender's) looks disturbed
    ('' when it does not)."""
    spread = abs(d1 - d2) / min(d1, d2) if min(d1, d2) > 0 else math.inf
    if spread > BUSY_SPREAD:
        return f"the default timed twice differed by {spread * 100:.0f}%"
    if tails:
        name, tail = max(tails.items(), key=lambda item: item[1])
        if tail > LONG_TAIL:
            return f"{name}'s samples had a long tail (p90 {tail:.1f}x the median)"
    return ""


def drift_reason(default_us: float, earlier: list[float]) -> str:
    """Why a run whose default took default_us disagrees with every earlier run's ('' when one agrees).
    A disturbance that lasts a whole run (on the CPU: another process taking the cores the GEMM's threads
    wait on) moves every sample and both copies of the default alike, so only another run shows it."""
    nearest = min(earlier, key=lambda us: abs(us - default_us))
    drift = abs(default_us - nearest) / min(default_us, nearest) if min(default_us, nearest) > 0 else math.inf
    if drift > BUSY_SPREAD:
        return f"the default's time moved by {drift * 100:.0f}% between two runs"
    return ""


def runs_to_agree(device: torch.device) -> int:
    """How many runs must agree before one is trusted: 2 on the CPU (a whole run can be disturbed there,
    drift_reason), 1 on a GPU (a graph replay's samples are disturbed one by one, busy_reason sees it)."""
    return 2 if device.type == "cpu" else 1


def quietest(measure: Callable[[dict[str, float]], dict[str, float]],
             agree: int = 1) -> tuple[dict[str, float], str | None]:  # fmt: skip
    """measure(tails) (times with "default" and "default#2"), repeated up to REMEASURE times while the
    machine looks busy (busy_reason) or, with agree=2, until two runs' defaults agree (drift_reason): a
    confirmed run's times and '' or, when none was, the least disturbed run's times and why; None as
    the reason when the default could not be timed (returned at once)."""
    runs: list[tuple[float, dict[str, float], str, float]] = []  # (rank, times, in-run reason, default)
    for _ in range(agree + REMEASURE):
        tails: dict[str, float] = {}
        times = measure(tails)
        d1, d2 = times["default"], times["default#2"]
        if not (d1 == d1 and d2 == d2):
            return times, None
        why, default_us = busy_reason(d1, d2, tails), min(d1, d2)
        if not why:
            quiet = [r[3] for r in runs if not r[2]]
            if agree == 1 or (quiet and not drift_reason(default_us, quiet)):
                return times, ""
        rank = abs(d1 - d2) / min(d1, d2) + max(tails.values(), default=1.0)
        runs.append((rank, times, why, default_us))
    rank, times, why, default_us = min(runs, key=lambda r: r[0])
    others = [r[3] for r in runs if r[1] is not times]
    return times, why or (drift_reason(default_us, others) if others else "no second run agreed")


def _final(fam, key, device, opts, pool: _Pool, finalists, default, default_runner, seed, inputs, heartbeat):
    """The finalists and the default in one accurate run; the default is two contenders, and their
    spread is the run's noise. A run on a busy machine (busy_reason) is repeated up to REMEASURE times
    and the quietest kept; pool.busy says why when even that one was disturbed. Returns (default_us, noise)."""
    final = {"default": default_runner, **{n: pool.runners[n] for n in finalists}, "default#2": default_runner}
    times, why = quietest(lambda tails: time_group(key, final, device, opts.reps, seed, inputs, heartbeat, "final",
                                                   fam, tails), runs_to_agree(device))  # fmt: skip
    if why is None:
        raise RuntimeError(f"{fam.describe(key)}: the default ({default.name}) could not be timed")
    pool.busy = why
    d1, d2 = times["default"], times["default#2"]
    # On a busy machine extra time is all the load adds: the faster copy is the less disturbed one.
    default.us = min(d1, d2) if pool.busy else (d1 + d2) / 2
    for n in finalists:
        pool.results[n].us = times[n]
        if times[n] != times[n]:
            pool.results[n].status, pool.results[n].reason = FAILED, "timing failed (graph capture or launch error)"
    return default.us, abs(d1 - d2) / min(d1, d2)


# Close calls (step 5): measured on the H100, two runs of the tuner disagreed only on keys whose best
# gain sat within ~2% of --min-gain or whose two best finalists were within ~2% of each other.
MARGIN = 0.015
RUNNER_UP = 0.02


def _close_call(pool: _Pool, finalists, default: CandidateResult, noise: float, opts: TuneOptions) -> list[str]:
    """The finalists worth a second round (best first), or [] when the first round decided clearly."""
    timed = sorted((n for n in finalists if pool.results[n].status == OK), key=lambda n: pool.results[n].us)
    if not timed or default.status != OK:
        return []
    best = pool.results[timed[0]].us
    gain = default.us / best - 1
    near = [n for n in timed[1:] if pool.results[n].us <= best * (1 + RUNNER_UP)]
    if abs(gain - max(opts.min_gain, noise)) < MARGIN or near:
        return timed[:1] + near
    return []


def _second_round(fam, key, device, opts, pool: _Pool, contenders, default, default_runner, seed, inputs,
                  heartbeat, noise: float) -> float:  # fmt: skip
    """Time the contenders and the default again on freshly allocated cold inputs (another seed, other
    buffers: where they sit in memory moved a GEMM's time by up to ~4% between allocations) and keep the
    mean of both rounds for each; returns the mean noise."""
    first = {n: pool.results[n].us for n in contenders}
    d_first, busy_first = default.us, pool.busy
    fresh = make_inputs(key, device, seed=seed + 1, family=fam) if inputs else None
    _, noise2 = _final(fam, key, device, opts, pool, contenders, default, default_runner, seed + 1, fresh,
                       heartbeat)  # fmt: skip
    del fresh
    pool.busy = pool.busy or busy_first
    default.us = (default.us + d_first) / 2
    for n in contenders:
        if pool.results[n].status == OK:
            pool.results[n].us = (pool.results[n].us + first[n]) / 2
    return (noise + noise2) / 2


def _decide(pool: _Pool, finalists, default: CandidateResult, noise: float, opts: TuneOptions):
    """The fastest finalist replaces the default only beyond --min-gain and the noise (or when the
    default failed its own check). Returns (the winner's name in the pool, None: the default stays; note)."""
    timed = [n for n in finalists if pool.results[n].status == OK]
    if not timed:
        return None, ""
    best = min(timed, key=lambda n: pool.results[n].us)
    gain = default.us / pool.results[best].us - 1
    need = max(opts.min_gain, noise)
    if gain > need or default.status != OK:
        return best, f"default failed its check ({default.reason})" if default.status != OK else ""
    return None, f"best {best} gains {gain * 100:+.1f}% <= {need * 100:.1f}% (min-gain/noise): default kept"


def _versus_default(fam, key, device, name, run, default_runner, reps, seed, inputs, heartbeat, phase):
    """One run of candidate `name` between two copies of the default, as `gemmtune bench` times a row
    (the heartbeat names the candidate, so a worker it crashes blames it). Returns (its us, the
    default's mean us, the default copies' spread)."""
    t = time_group(key, {"default": default_runner, name: run, "default#2": default_runner}, device, reps, seed,
                   inputs, heartbeat, phase, fam)  # fmt: skip
    d1, d2 = t["default"], t["default#2"]
    return t[name], (d1 + d2) / 2, abs(d1 - d2) / min(d1, d2)


def _head_to_head(fam, key, device, opts, pool: _Pool, name: str, default_runner, seed, heartbeat) -> float:
    """The would-be winner against the default alone, on freshly allocated inputs: its gain there (NaN
    if it failed). Measured on an H100 (Gemma-2-9B down, M=2048 and 4096): among several compute-bound
    cuBLASLt finalists, F.linear timed 3-10% slower than it did next to the winner alone, so a gain seen
    only in the final round did not hold in `bench` (0.956x)."""
    fresh = make_inputs(key, device, seed=seed + 2, family=fam) if device.type == "cuda" else None
    w, d, _ = _versus_default(fam, key, device, name, pool.runners[name], default_runner, opts.reps, seed + 2,
                              fresh, heartbeat, "head-to-head")  # fmt: skip
    return d / w - 1 if w == w and w > 0 else math.nan


class _Lap:
    """Adds the seconds since the previous lap to `phases[name]` (where a key's tuning time goes)."""

    def __init__(self, phases: dict[str, float]):
        self.phases, self.t = phases, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self.t
        self.t = now


NOISE_FLOOR = 0.01  # below 1% two timings of the same kernel are no different (A/A rows of `bench`)


def _not_slower_at(fam, key, m, device, opts, pool, winner, seed, heartbeat) -> bool:
    """Is the winner correct at M=m and not slower than the default there beyond the noise?"""
    km = fam.with_m(key, m)
    backend, sol = pool.solutions[winner]
    try:
        run = backend.make_runner(sol, km, device)
        sets = make_inputs(km, device, sets=None if device.type == "cuda" else 1, seed=seed + m, family=fam)
        if not check_runner(run, km, sets[0], reference(km, *sets[0], family=fam), opts.err_ratio, family=fam).ok:
            return False
        default_backend, default_sol = backends.default(fam.name, km, device)  # the default at this M
        default = default_backend.make_runner(default_sol, km, device)
        w, d, noise = _versus_default(fam, km, device, winner, run, default, max(10, opts.reps // 2), seed + m,
                                      sets, heartbeat, "range")  # fmt: skip
    except DeviceLostError:
        raise
    except Exception as exc:  # noqa: BLE001 - a winner that fails at another M does not serve it
        after_failure(device, winner, exc)
        return False
    return w == w and w <= d * (1 + max(noise, NOISE_FLOOR))


def range_points(m_lo: int, m: int, step: float = 1.5) -> list[int]:
    """The Ms a winner is checked at for the range m_lo..m, nearest to m first: m_lo and a geometric
    ladder above it (x1.5 apart), so a range of any width is probed every ~50% of M."""
    pts, p = [], m_lo
    while p < m:
        pts.append(p)
        p = max(p + 1, math.ceil(p * step))
    return sorted(set(pts), reverse=True)


def _verified_range(fam, key, m_lo, device, opts, pool, winner, seed, heartbeat) -> int:
    """The lowest M of [m_lo, M] down to which the winner was not slower at every checked point."""
    lo = fam.m_of(key)
    for p in range_points(m_lo, lo):
        if not _not_slower_at(fam, key, p, device, opts, pool, winner, seed, heartbeat):
            break
        lo = p
    return lo


def tune_shape(
    key,
    device: torch.device,
    opts: TuneOptions,
    exclude: dict[str, tuple[str, str]] | None = None,
    heartbeat: Heartbeat = _no_heartbeat,
    isolate: bool = False,
    log: Callable[[str], None] | None = None,
    family: Family | str = "a16w16",
    m_lo: int | None = None,
) -> ShapeResult:
    """Tune `key` of `family` on `device`. `exclude` maps candidate names to (status, reason) decided
    elsewhere (a worker that crashed or hung on them); `isolate` screens one candidate at a time;
    `m_lo` is the lowest M the row should answer (default: its own M only)."""
    if opts.search not in SEARCHES:
        raise ValueError(f"unknown search {opts.search!r}; known: {', '.join(SEARCHES)}")
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    lap = _Lap(phases)
    fam = families.get(family) if isinstance(family, str) else family
    seed = shape_seed(key, opts.seed, fam)
    say = log or (lambda msg: None)
    if not backends.all_backends(fam.name):
        raise ValueError(f"the {fam.name} family has no default backend here ({fam.unrunnable})")
    default_backend, default_sol = backends.default(fam.name, key, device)
    default = CandidateResult.of(default_sol)
    plan, donor_note = donor_plan(fam, key, device, opts, select_backends(device, opts.libtypes, fam.name))
    pool = _gather(fam, key, device, opts, exclude or {}, plan)
    lap("gather")

    inputs = make_inputs(key, device, seed=seed, family=fam) if device.type == "cuda" else None
    check_in = inputs[0] if inputs else make_inputs(key, device, sets=1, seed=seed, family=fam)[0]
    ref = reference(key, *check_in, family=fam)
    default_runner = default_backend.make_runner(default_sol, key, device)
    verdict = check_runner(default_runner, key, check_in, ref, opts.err_ratio, family=fam)
    default.err, default.status, default.reason = verdict.err, OK if verdict.ok else REJECTED, verdict.reason
    lap("inputs")
    fast = opts.search == "fast"
    staged = None
    if fam.stages and plan is None:  # a donor names whole solutions: its stages are not searched apart
        staged = search_stages(fam, key, device, select_backends(device, opts.libtypes, fam.name),
                               inputs or [check_in], opts, seed, exclude, heartbeat, say, isolate)  # fmt: skip
        _add_pairs(pool, staged.pairs, exclude or {})
        lap("stages")
    _check_all(fam, key, device, opts, pool, default, check_in, ref, heartbeat, say, phases, quick=fast)
    lap("check")

    finalists = _screen(fam, key, device, opts, pool, seed, inputs, heartbeat, isolate, default_runner)
    lap("screen")
    _, noise = _final(fam, key, device, opts, pool, finalists, default, default_runner, seed, inputs, heartbeat)
    close = _close_call(pool, finalists, default, noise, opts) if inputs else []
    if close:
        noise = _second_round(fam, key, device, opts, pool, close, default, default_runner, seed, inputs,
                              heartbeat, noise)  # fmt: skip
    lap("final")
    best, note = _decide(pool, finalists, default, noise, opts)
    while fast and best is not None:  # the would-be winner passed only the quick check so far
        if _full_check(fam, key, device, opts, pool, best, check_in, ref, say):
            break
        finalists = [n for n in finalists if n != best]
        best, note = _decide(pool, finalists, default, noise, opts)
    del ref, check_in
    inputs = None  # the head-to-head and the range allocate their own: peak memory stays one set
    if best is not None and default.status == OK:
        again = _head_to_head(fam, key, device, opts, pool, best, default_runner, seed, heartbeat)
        if not again > max(opts.min_gain, noise):
            note = (f"best {best} gains {(default.us / pool.results[best].us - 1) * 100:+.1f}% in the final but "
                    f"{again * 100:+.1f}% against the default alone: default kept")  # fmt: skip
            best = None
    lap("confirm")
    m = fam.m_of(key)
    lo = m if m_lo is None or not opts.verify_range else min(m_lo, m)
    if best is not None and lo < m:
        lo = _verified_range(fam, key, lo, device, opts, pool, best, seed, heartbeat)
        if lo > (m_lo or m):
            note = (note + "; " if note else "") + f"verified on M {lo}..{m} (slower below)"
    lap("range")
    winner = default if best is None else pool.results[best]
    roof = roof_us(key, measure_ceilings(device), fam) if device.type == "cuda" else math.nan
    cands = list(pool.results.values())
    if not any(c.name == default.name for c in cands):
        cands.insert(0, default)
    extra = {}
    if staged is not None:
        cands += staged.candidates
        extra = stage_columns(fam, key, device, staged, winner.kernel_name, opts.reps, seed, heartbeat)
    if pool.busy:
        note = (note + "; " if note else "") + f"busy machine: {pool.busy} after {1 + REMEASURE} runs"
    donor = ""
    if opts.donor is not None:
        donor = donor_verdict(plan is not None, best is None, pool.roles.get(best or "", ""))
        if donor_note:
            note = f"{donor_note}; " + note if note else donor_note
    return ShapeResult(key, winner, winner.us, default, default.us, noise, roof, best is None, cands,
                       time.perf_counter() - t0, note, fam.name, lo, m, phases, extra, pool.busy,
                       donor)  # fmt: skip


def _add_pairs(pool: _Pool, pairs: list[tuple[Backend, Solution]], exclude) -> None:
    """Stage pairs as whole candidates (a pair some backend also offers whole is already there)."""
    for backend, sol in pairs:
        cand = CandidateResult.of(sol)
        if cand.name in pool.results:
            continue
        if cand.name in exclude:
            cand.status, cand.reason = exclude[cand.name]
        pool.results[cand.name] = cand
        pool.solutions[cand.name] = (backend, sol)


@dataclass
class PrecompileTimings:
    """Where one precompile's time went: per backend its (candidate, key) jobs and the distinct kernels
    they need, and the one pool of processes that compiled every backend's kernels."""

    jobs: dict[str, int] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    processes: int = 0
    seconds: float = 0.0
    busy: list[float] = field(default_factory=list)  # each process's seconds: the busiest is the critical path


@dataclass(frozen=True)
class CompileScope:
    """What a tune of the keys runs beyond each candidate's plain call on its own key, given to every
    backend's compile_items (those that compile only the plain calls ignore it): the options (the search,
    --stage-limit, the range verification), the family's default at a key, and the keys at the Ms the
    range verification checks a winner at (step 6: range_points from the key's floor, the lowest M its row
    should answer)."""

    family: Family
    device: torch.device
    opts: TuneOptions
    floors: dict = field(default_factory=dict)  # key -> its M floor (runner.range_floors); none: its M alone

    def range_keys(self, key) -> list:
        """The keys the range verification may check a winner for `key` at (nearest first; it stops at
        the first where the winner is slower), as tune_shape(m_lo=floor) walks them."""
        m, lo = self.family.m_of(key), self.floors.get(key)
        if lo is None or not self.opts.verify_range or lo >= m:
            return []
        return [self.family.with_m(key, p) for p in range_points(lo, m)]

    def default(self, key) -> Solution | None:
        """The family's default solution at `key` here (None when there is none)."""
        try:
            return backends.default(self.family.name, key, self.device)[1]
        except Exception:  # noqa: BLE001 - tune_shape reports it per shape
            return None


def _candidate_jobs(bname: str, backend: Backend, key, device: torch.device, plan: DonorPlan | None) -> list:
    """Every (solution, key) of the backend a tune of `key` times here (_offered)."""
    try:
        return [(s, key) for _, s in _offered(bname, backend, key, device, plan)]
    except Exception:  # noqa: BLE001 - tune_shape reports it per shape
        return []


def _plan_or_none(fam: Family, key, device, opts: TuneOptions, chosen: dict[str, Backend],
                  listed) -> DonorPlan | None:  # fmt: skip
    try:
        return donor_plan(fam, key, device, opts, chosen, listed)[0]
    except Exception:  # noqa: BLE001 - tune_shape reports it per shape
        return None


def first_needing(keys: list, family: str) -> Callable[[object], int]:
    """item key -> the index in `keys` of the first key that may need a kernel built for it, where no key's
    own candidates name it (ahead_items): the first key of its shape at any M (a backend's item names a
    stand-in M, or the first of the keys sharing a binary), else 0 (a stand-in of another shape, or one the
    family cannot re-M: needed before any key). Never later than the first key that needs the kernel, so a
    key waiting for its index's kernels waits for its own."""
    fam = families.get(family)
    shapes: dict = {}
    for i, k in enumerate(keys):
        shape = _shape_of(fam, k)
        if shape is not None:
            shapes.setdefault(shape, i)

    def index(key) -> int:
        shape = _shape_of(fam, key)
        return 0 if shape is None else shapes.get(shape, 0)

    return index


def _shape_of(fam: Family, key):
    try:
        return fam.with_m(key, 1)
    except Exception:  # noqa: BLE001 - a stand-in the family cannot re-M: no shape match
        return None


def ahead_items(
    keys: list,
    device: torch.device,
    opts: TuneOptions,
    family: str = "a16w16",
    floors: dict | None = None,
    timings: PrecompileTimings | None = None,
) -> list:
    """Every kernel the backends that can compile ahead of time (those with `compile_items`) need for
    `keys`, each once, as (index of the first of `keys` that needs it, CompileItem), in that order (then
    backend, name: every rank listing the same keys lists the same items). The index: the first key whose
    own candidates list the item's kernel name at the item's shape, else first_needing's. `floors`: each
    key's M floor as the tune gets it (m_lo), for backends that also compile what the range verification
    runs (CompileScope)."""
    timings = timings if timings is not None else PrecompileTimings()
    fam = families.get(family)
    scope = CompileScope(fam, device, opts, dict(floors or {}))
    per_backend = []
    needs: dict = {}  # (builder, kernel name, shape) -> the first key listing it
    chosen = select_backends(device, opts.libtypes, family)
    compiling = {n for n, b in chosen.items() if compile_items_of(b) is not None}  # only these are listed
    plans = [_plan_or_none(fam, k, device, opts, chosen, compiling) if opts.donor is not None else None
             for k in keys]  # fmt: skip
    for name, backend in chosen.items():
        fn = compile_items_of(backend)
        if fn is None:
            continue
        per_key = [_candidate_jobs(name, backend, k, device, plan) for k, plan in zip(keys, plans)]
        jobs = [j for js in per_key for j in js]
        if not jobs:
            continue
        items = fn(jobs, scope=scope)
        per_backend.append((type(backend), items))
        timings.jobs[name], timings.kernels[name] = len(jobs), len(items)
        for i, own in enumerate(per_key):
            for it in fn(own, scope=scope) if own else ():
                needs.setdefault((it[2] if len(it) == 3 else type(backend), it[0], _shape_of(fam, it[1])), i)
    if not per_backend:
        return []
    from ..backends.lib import triton_tiles  # here: it imports Triton, which the CPU-only tuner may lack

    # an item is (name, key), built by its backend's class, or (name, key, the class that builds it)
    items = [triton_tiles.CompileItem(*it) if len(it) == 3 else triton_tiles.CompileItem(*it, cls)
             for cls, its in per_backend for it in its]  # fmt: skip
    fallback = first_needing(keys, family)
    ranked = [(needs.get((it.backend, it.name, _shape_of(fam, it.key)), fallback(it.key)), it) for it in items]
    return sorted(ranked, key=lambda r: (r[0], r[1].backend.__name__, r[1].name, repr(r[1].key)))


def precompile_all(keys: list, device: torch.device, opts: TuneOptions, workers: int = 8,
                   family: str = "a16w16", share: tuple[int, int] = (0, 1),
                   timings: PrecompileTimings | None = None, floors: dict | None = None) -> list:  # fmt: skip
    """Fill Triton's on-disk cache with every kernel of ahead_items(keys) in ONE pool of `workers`
    processes for all of them (each process start costs seconds), and return when it is done (the
    tuner's own overlaps it with the tune: compile_ahead.py). `share` (i, n): this process compiles the
    i-th of n parts, the other parts compiled by processes sharing its on-disk cache (a host's ranks).
    Returns failures."""
    timings = timings if timings is not None else PrecompileTimings()
    items = [item for _, item in ahead_items(keys, device, opts, family, floors, timings)][share[0] :: share[1]]
    if not items:
        return []
    from ..backends.lib import triton_tiles

    t0 = time.perf_counter()
    failures = triton_tiles.compile_all(items, device, workers, timings.busy)
    timings.processes, timings.seconds = min(workers, len(items)), time.perf_counter() - t0
    return failures


def describe_timings(timings: PrecompileTimings) -> str:
    """'triton 4184 jobs (812 kernels), skinny 718 jobs (90 kernels): 1 pool of 16 processes, 19.2 s
    (busiest 17.0 s, mean 15.1 s)'."""
    backends = ", ".join(f"{name} {jobs} jobs ({timings.kernels[name]} kernels)" for name, jobs in timings.jobs.items())
    if not timings.processes:
        return f"{backends}: nothing to compile here" if backends else "nothing to compile"
    plural = "es" if timings.processes != 1 else ""
    busy = ""
    if timings.busy:
        busy = f" (busiest {max(timings.busy):.1f} s, mean {sum(timings.busy) / len(timings.busy):.1f} s)"
    return f"{backends}: 1 pool of {timings.processes} process{plural}, {timings.seconds:.1f} s{busy}"
