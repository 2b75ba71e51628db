"""A tuning candidate and the failure-tolerant steps every search runs on candidates (search.py for whole
calls, stages.py for each stage of a two-stage family): the options, a candidate's result and status,
freeing what a failed one left, and timing a group so one bad runner fails alone."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backends.base import Solution
from ..checks import check_bool, check_choice, check_int, check_list, check_number, check_str
from ..families import Family
from .timing import bench_gemm

# A candidate replaces the default only when faster by more than this (and the noise). A decision at
# the line flips with timing noise from run to run, and a flip costs about the line itself. Measured on
# an H100 (docs/tuner.md): at 3%, fast and exhaustive searches disagreed by up to 2.4% on such keys
# and a 3% search left gains of 2.2-2.6% untaken; at 1%, they disagreed by 1.0-1.1%; at 0.5%, 32 of
# 32 keys within 1%. A winner must still hold its gain head to head (_head_to_head) and at the edges
# of its M range.
MIN_GAIN = 0.005
SEARCHES = ("fast", "exhaustive")
# Online tuning's budget covers a key end to end: the worker's start, the candidate checks, the screen and
# the final timing. The checks (most of the time: each compiles a kernel) stop at this share of it; the
# rest is for what comes after them (measured on an H200: 3-7 s of a 20 s budget).
CHECK_SHARE = 0.5


def check_deadline(opts: TuneOptions, part: float = 1.0, start: float | None = None) -> float:
    """The perf_counter() time after which no more candidates are checked: `part` of the checks' share
    of the budget from `start` (default: now; a two-stage family splits it between stages and pairs)."""
    if not opts.budget_s:
        return math.inf
    return (time.perf_counter() if start is None else start) + opts.budget_s * CHECK_SHARE * part


# Statuses a candidate can end in; only "ok" candidates were timed.
OK, REJECTED, FAILED, CRASHED, TIMEOUT, SKIPPED = "ok", "rejected", "failed", "crashed", "timeout", "skipped"


class DeviceLostError(RuntimeError):
    """The device context is unusable after a candidate (e.g. an illegal memory access): the process
    must end. With --mp the worker is restarted and the candidate excluded; in-process the run stops."""


@dataclass
class TuneOptions:
    libtypes: list[str] | None = None  # None: every available backend
    err_ratio: float | None = None  # None: check.THRESHOLDS by dtype
    min_gain: float = MIN_GAIN
    top: int = 4
    screen_reps: int = 5
    reps: int = 20
    batch: int = 16
    seed: int = 0
    verify_range: bool = True  # step 6; off: a row answers only its own M
    budget_s: float | None = None  # online tuning: the seconds one key may take (see check_deadline)
    # "fast": every candidate gets the quick check (its plain call), only the best-screened ones the
    # full check; "exhaustive": every candidate gets the full check (measured: 85% of tuning time).
    search: str = "fast"
    stage_limit: int | None = None  # two-stage families: at most this many kernels per backend and stage
    # tune --from (donor.py): key -> the donor table's picks for it; a key without any gets the full
    # search. None: every key gets the full search.
    donor: dict | None = None

    def __post_init__(self):
        fn = "tuner.TuneOptions"
        check_list(fn, "libtypes", self.libtypes, check_str, optional=True)
        check_number(fn, "err_ratio", self.err_ratio, lo=0, lo_open=True, optional=True)
        check_number(fn, "min_gain", self.min_gain, lo=0)
        for name in ("top", "screen_reps", "reps", "batch"):
            check_int(fn, name, getattr(self, name))
        check_int(fn, "seed", self.seed, lo=None)
        check_bool(fn, "verify_range", self.verify_range)
        check_number(fn, "budget_s", self.budget_s, lo=0, lo_open=True, optional=True)
        check_choice(fn, "search", self.search, SEARCHES)
        check_int(fn, "stage_limit", self.stage_limit, optional=True)


@dataclass
class CandidateResult:
    libtype: str
    kernel_name: str
    solidx: int
    splitk: int
    status: str = "pending"
    err: float = math.nan
    screen_us: float = math.nan
    us: float = math.nan
    reason: str = ""

    @property
    def name(self) -> str:
        return f"{self.libtype}:{self.kernel_name}"

    @classmethod
    def of(cls, sol: Solution) -> CandidateResult:
        return cls(sol.libtype, sol.kernel_name, sol.solidx, sol.splitk)


Heartbeat = Callable[[list[str], str], None]


def after_failure(device: torch.device, what: str, exc: BaseException) -> None:
    """Free what a failed candidate left; raise DeviceLostError when the device no longer works."""
    if device.type != "cuda":
        return
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    except Exception as sync_exc:  # noqa: BLE001
        raise DeviceLostError(f"{what} left the device unusable: {type(exc).__name__}: {exc}") from sync_exc


def describe_exc(exc: BaseException) -> str:
    if isinstance(exc, torch.OutOfMemoryError):
        return "out of memory"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def group_size(fam: Family, key, device: torch.device, sets: int, batch: int) -> int:
    if device.type != "cuda":
        return max(1, batch)
    out_bytes = math.prod(fam.output_shape(key)) * fam.out_dtype(key).itemsize
    per = sets * out_bytes * 2  # graph outputs plus slack for workspaces
    free, _ = torch.cuda.mem_get_info(device)
    return max(1, min(batch, int(0.25 * free // max(per, 1))))


def time_group(key, runners, device, reps, seed, inputs, heartbeat, phase, fam: Family, tails=None) -> dict[str, float]:
    """bench_gemm; if the whole run raises, time each runner alone so one bad runner fails alone."""
    heartbeat(list(runners), phase)
    try:
        return bench_gemm(key, runners, device=device, reps=reps, seed=seed, inputs=inputs, family=fam, tails=tails)
    except DeviceLostError:
        raise
    except Exception as exc:  # noqa: BLE001
        after_failure(device, f"timing {', '.join(runners)}", exc)
        if len(runners) == 1:
            return {n: math.nan for n in runners}
    out = {}
    for name, run in runners.items():
        out.update(time_group(key, {name: run}, device, reps, seed, inputs, heartbeat, phase, fam))
    return out
