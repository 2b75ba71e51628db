"""Two-stage families (fmoe): time each stage's kernels apart, then pair the fastest of each.

aiter's fused-MoE table records stage 1 (gate+up GEMM and activation) and stage 2 (down GEMM and
combine) apart (us1/kernelName1, us2/kernelName2): any stage-1 kernel runs with any stage-2 kernel,
so timing them apart costs n1 + n2 timings instead of n1 * n2, and a row may mix backends (a Triton
stage 1 with a torch._grouped_mm stage 2).

1. Stage candidates: every selected backend's kernels for each stage (Backend.stage_candidates; the
   first --stage-limit of each, which backends list likely winners first).
2. Each is checked alone (check.py, NaN-poisoned outputs; the CUDA-graph replay too in the exhaustive
   search, while the fast one fully checks the pair that would win) against the family's fp32 stage
   reference; stage 2 runs on the stage-1 reference rounded to the key's dtype.
3. Each stage's passing kernels are timed on the same rotating cold input sets, interleaved in
   groups, `screen_reps` replays (timing.py).
4. The `keep` fastest of each stage are paired (keep ** stages pairs); the backend that runs a pair
   names its solution. search.py then checks, screens and times the pairs whole, with the family's
   whole candidates, against the default: the decision is on the whole call, whose stages share
   their routing work (so us is not exactly us1 + us2).
5. stage_columns(): the winner's stages timed once more (`reps` replays) for the row's us1/us2,
   with the errors of step 2 (err1/err2).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, Runner, Solution
from ..families import Family
from ..families.base import fmt_float
from .candidates import (
    FAILED,
    OK,
    REJECTED,
    SKIPPED,
    CandidateResult,
    DeviceLostError,
    TuneOptions,
    after_failure,
    check_deadline,
    describe_exc,
    group_size,
    time_group,
)
from .check import check_runner

KEEP = 2  # fastest kernels kept per stage: KEEP ** 2 pairs go on to the whole-call phases


class StageView(Family):
    """One stage of a two-stage family, seen as a family by check.py and timing.py."""

    def __init__(self, family: Family, stage: int):
        self.family, self.stage = family, stage
        self.name = f"{family.name}.stage{stage}"

    def make_inputs(self, key, device, sets, seed):
        return self.family.stage_inputs(key, self.stage, self.family.make_inputs(key, device, sets, seed))

    def reference(self, key, inputs):
        return self.family.stage_reference(key, self.stage, inputs)

    def output_shape(self, key):
        return self.family.stage_output_shape(key, self.stage)

    def out_dtype(self, key):
        return self.family.out_dtype(key)

    def error_threshold(self, key):
        return self.family.error_threshold(key)

    def describe(self, key) -> str:
        return f"{self.family.describe(key)} (stage {self.stage})"


def stage_label(stage: int, name: str) -> str:
    """A stage kernel's name among the tuner's candidates (profile file, crash exclusions)."""
    return f"stage{stage}:{name}"


@dataclass
class StagedSearch:
    candidates: list[CandidateResult] = field(default_factory=list)  # every stage kernel, as reported
    pairs: list[tuple[Backend, Solution]] = field(default_factory=list)  # fastest pair (by us1 + us2) first
    runners: dict[tuple[int, str], Runner] = field(default_factory=dict)  # the stage kernels that passed
    results: dict[tuple[int, str], CandidateResult] = field(default_factory=dict)
    sets: dict[int, list] = field(default_factory=dict)  # each stage's input sets


def _as_result(fam: Family, key, stage: int, run: Runner) -> Runner:
    return lambda *args: fam.stage_result(key, stage, run(*args), args)


def _check_stage(fam, key, device, stage, chosen, sets, opts, exclude, heartbeat, say, out: StagedSearch,
                 deadline: float):  # fmt: skip
    view = StageView(fam, stage)
    ref = fam.stage_reference(key, stage, sets[0])
    for bname, backend in chosen.items():
        try:
            names = backend.stage_candidates(key, device, stage)[: opts.stage_limit]
        except Exception as exc:  # noqa: BLE001 - a backend that cannot list its stage kernels is reported
            out.candidates.append(CandidateResult(bname, stage_label(stage, "<candidates>"), -1, 0, FAILED,
                                                  reason=describe_exc(exc)))  # fmt: skip
            continue
        for name in names:
            if (stage, name) in out.results:
                continue
            cand = CandidateResult(bname, stage_label(stage, name), 0, 0)
            out.results[(stage, name)] = cand
            out.candidates.append(cand)
            if cand.name in exclude:
                cand.status, cand.reason = exclude[cand.name]
                continue
            if time.perf_counter() > deadline:
                cand.status, cand.reason = SKIPPED, f"over the {opts.budget_s:g} s budget"
                continue
            heartbeat([cand.name], "check")
            try:
                run = backend.make_stage_runner(stage, name, key, device)
                # the fast search checks the plain call here: the pair that would win gets the full check
                verdict = check_runner(_as_result(fam, key, stage, run), key, sets[0], ref, opts.err_ratio,
                                       graph=opts.search != "fast", family=view)  # fmt: skip
            except DeviceLostError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure of a kernel rejects it alone
                cand.status, cand.reason = FAILED, describe_exc(exc)
                after_failure(device, cand.name, exc)
                say(f"  {cand.name}: failed ({cand.reason})")
                continue
            cand.err = verdict.err
            if verdict.ok:
                cand.status = OK
                out.runners[(stage, name)] = run
            else:
                cand.status, cand.reason = REJECTED, verdict.reason
                say(f"  {cand.name}: rejected ({verdict.reason})")


def _time_stage(fam, key, device, stage, sets, reps, seed, batch, heartbeat, runners: dict[str, Runner],
                isolate: bool = False) -> dict[str, float]:  # fmt: skip
    """us of each stage runner, interleaved in groups, on the stage's input sets."""
    view = StageView(fam, stage)
    size = 1 if isolate else group_size(view, key, device, len(sets), batch)
    inputs = sets if device.type == "cuda" else None
    names = list(runners)
    times: dict[str, float] = {}
    for i in range(0, len(names), size):
        group = {stage_label(stage, n): runners[n] for n in names[i : i + size]}
        got = time_group(key, group, device, reps, seed, inputs, heartbeat, f"stage {stage}", view)
        times.update({n: got[stage_label(stage, n)] for n in names[i : i + size]})
    return times


def search_stages(fam: Family, key, device: torch.device, chosen: dict[str, Backend], sets: list, opts: TuneOptions,
                  seed: int, exclude: dict | None = None, heartbeat: Callable = lambda names, phase: None,
                  say: Callable[[str], None] = lambda msg: None, isolate: bool = False,
                  keep: int = KEEP) -> StagedSearch:  # fmt: skip
    """Steps 1-4 of the module doc for `key` on the family's input `sets` (one or more)."""
    out = StagedSearch()
    fastest: dict[int, list[str]] = {}
    # online tuning: the stages' checks share half the checks' budget (search.py gives the pairs' theirs)
    share, start = 0.5 / len(fam.stages), time.perf_counter()
    for i, stage in enumerate(fam.stages):
        deadline = check_deadline(opts, share * (i + 1), start)  # time a stage leaves unused goes to the next
        out.sets[stage] = fam.stage_inputs(key, stage, sets)
        _check_stage(fam, key, device, stage, chosen, out.sets[stage], opts, exclude or {}, heartbeat, say, out,
                     deadline)  # fmt: skip
        runners = {n: r for (s, n), r in out.runners.items() if s == stage}
        times = _time_stage(fam, key, device, stage, out.sets[stage], max(5, opts.screen_reps), seed, opts.batch,
                            heartbeat, runners, isolate)  # fmt: skip
        for n, us in times.items():
            cand = out.results[(stage, n)]
            cand.screen_us = us
            if us != us:  # NaN
                cand.status, cand.reason = FAILED, "timing failed (graph capture or launch error)"
                del out.runners[(stage, n)]
        fastest[stage] = sorted((n for n in times if times[n] == times[n]), key=times.get)[:keep]
    combos = sorted(itertools.product(*(fastest[s] for s in fam.stages)),
                    key=lambda c: sum(out.results[(s, n)].screen_us for s, n in zip(fam.stages, c)))  # fmt: skip
    for names in combos:
        for backend in chosen.values():
            sol = backend.pair_solution(tuple(names), key, device)
            if sol is not None and backend.supports(sol, key, device):
                out.pairs.append((backend, sol))
                break
    return out


def stage_columns(fam: Family, key, device: torch.device, staged: StagedSearch, kernel_name: str, reps: int,
                  seed: int, heartbeat: Callable = lambda names, phase: None) -> dict[str, str]:  # fmt: skip
    """{us1, err1, us2, err2 ...} of the stages `kernel_name` names, each stage timed once more alone
    (empty for a solution whose stages were not all checked apart, e.g. the torch loop)."""
    names = fam.stage_names(kernel_name)
    if len(names) != len(fam.stages) or any((s, n) not in staged.runners for s, n in zip(fam.stages, names)):
        return {}
    cols: dict[str, str] = {}
    for stage, name in zip(fam.stages, names):
        us = _time_stage(fam, key, device, stage, staged.sets[stage], reps, seed, 1, heartbeat,
                         {name: staged.runners[(stage, name)]})[name]  # fmt: skip
        us_col, _, err_col = fam.stage_columns[stage]
        err = staged.results[(stage, name)].err
        cols[us_col] = fmt_float(us) if us == us else ""
        cols[err_col] = fmt_float(err) if math.isfinite(err) else ""
    return cols
