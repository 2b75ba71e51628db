"""A busy machine never writes an outlier into a table: the tuner and bench re-measure a run whose two copies
of the default disagree (or whose samples have a long tail), keep the quietest run, and mark what stayed noisy.
Timings are scripted (bench_gemm replaced): deterministic, no sleeps."""

from __future__ import annotations

import pytest
import torch

from gemmtune.configs import ConfigTable
from gemmtune.configs.schema import TUNED_COLUMNS, TunedRow
from gemmtune.device import identity
from gemmtune.keys import GemmKey
from gemmtune.tuner import bench, candidates
from gemmtune.tuner.bench import bench_table, summarize, summary_lines
from gemmtune.tuner.runner import RunReport
from gemmtune.tuner.search import (
    LONG_TAIL,
    REMEASURE,
    TuneOptions,
    busy_reason,
    drift_reason,
    quietest,
    runs_to_agree,
    tune_shape,
)
from gemmtune.tuner.summary import summary_lines as tune_summary

CPU = torch.device("cpu")
KEY = GemmKey(4, 48, 40, False, torch.float32, torch.float32)
QUIET, OUTLIER = 2.7, 11994.0  # a 1x128x64-like GEMM, and what a loaded machine once measured for it


def scripted(noisy_runs: int):
    """A bench_gemm whose first `noisy_runs` runs with two copies of the default are disturbed."""
    seen = [0]

    def fake(key, runners, **kw):
        out = {n: QUIET * (0.5 if n.startswith("fake") else 1.0) for n in runners}
        if "default#2" in runners:
            seen[0] += 1
            if seen[0] <= noisy_runs:
                out["default#2"] = OUTLIER
        return out

    return fake, seen


def test_busy_reason_spread_and_tail():
    assert busy_reason(10.0, 10.2, {"default": 1.1}) == ""
    assert "differed by" in busy_reason(10.0, 100.0, {})
    assert "long tail" in busy_reason(10.0, 10.0, {"default#2": LONG_TAIL + 1})
    # any contender's tail counts, and the message names it
    assert "fake:tile's samples had a long tail" in busy_reason(10.0, 10.0, {"default": 1.0, "fake:tile": 9.0})


def test_drift_reason_compares_with_the_nearest_earlier_run():
    assert drift_reason(10.0, [100.0, 10.5]) == ""
    assert "moved by 900%" in drift_reason(100.0, [10.0])


def whole_runs(scales):
    """A measure() whose i-th run has every sample scaled by scales[i]: a disturbance that lasts a whole run
    moves both copies of the default alike and leaves no tail, so nothing inside one run shows it."""
    calls = iter(scales)

    def measure(tails):
        k = next(calls)
        tails.update({"default": 1.0, "default#2": 1.0, "cand": 1.0})
        return {"default": QUIET * k, "cand": QUIET * k / 2, "default#2": QUIET * k}

    return measure


def test_cpu_runs_must_agree_before_one_is_trusted():
    assert runs_to_agree(CPU) == 2 and runs_to_agree(torch.device("cuda")) == 1
    # the first run was disturbed throughout: a second run disagrees, a third agrees with it, and is kept
    times, why = quietest(whole_runs([OUTLIER / QUIET, 1.0, 1.0]), agree=2)
    assert why == "" and times["default"] == pytest.approx(QUIET)
    # every run disagrees with every other: marked, the quietest kept, never called quiet
    times, why = quietest(whole_runs([1.0, 10.0, 100.0, 1000.0]), agree=2)
    assert "between two runs" in why
    # one run alone is trusted where whole-run disturbances are not the risk (a GPU's graph replays)
    times, why = quietest(whole_runs([OUTLIER / QUIET]), agree=1)
    assert why == ""


def test_tuner_remeasures_a_noisy_final_and_keeps_the_quiet_run(monkeypatch):
    fake, seen = scripted(noisy_runs=1)
    monkeypatch.setattr(candidates, "bench_gemm", fake)
    res = tune_shape(KEY, CPU, TuneOptions(reps=5, verify_range=False))
    assert seen[0] >= 1 + runs_to_agree(CPU)  # the noisy final was timed again, until two runs agreed
    assert res.default_us == pytest.approx(QUIET) and not res.busy and "busy" not in res.note


def test_tuner_marks_a_row_that_stays_noisy_and_never_records_the_outlier(monkeypatch):
    fake, seen = scripted(noisy_runs=10**6)
    monkeypatch.setattr(candidates, "bench_gemm", fake)
    res = tune_shape(KEY, CPU, TuneOptions(reps=5, verify_range=False))
    assert seen[0] >= 1 + REMEASURE
    assert res.busy and "busy machine" in res.note
    assert res.default_us == pytest.approx(QUIET) and res.us < 10 * QUIET  # the quieter copy, not the mean
    lines = tune_summary(RunReport([res], [], 0, 1.0), "t.csv")
    assert any("(busy)" in ln for ln in lines) and any("busy machine" in ln for ln in lines)


def _table(tmp_path, keys):
    ident = identity(CPU)
    rows = [TunedRow(ident.gfx, ident.cu_num, k, "torch", 0, 0, 5.0, "native") for k in keys]
    path = tmp_path / "tuned.csv"
    ConfigTable(rows).write(str(path), TUNED_COLUMNS)
    return ConfigTable.load([str(path)])


@pytest.mark.parametrize("noisy_runs,busy", [(1, False), (10**6, True)])
def test_bench_remeasures_and_marks(tmp_path, monkeypatch, noisy_runs, busy):
    fake, seen = scripted(noisy_runs)
    monkeypatch.setattr(bench, "bench_gemm", fake)
    (row,) = bench_table(_table(tmp_path, [KEY]), CPU, reps=5)
    agree = runs_to_agree(CPU)
    assert seen[0] == (agree + REMEASURE if busy else 1 + agree)  # the noisy run, then `agree` that agree
    assert bool(row.busy) is busy and row.default_us == pytest.approx(QUIET)
    text = "\n".join(summary_lines(summarize([row])))
    assert ("busy machine" in text) is busy
    assert "busy machine" in bench._line(row) if busy else "busy" not in bench._line(row)


def test_bench_prints_no_speedup_for_a_table_that_dispatches_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "bench_gemm", lambda key, runners, **kw: {"default": 10.0, "tuned": 9.8,
                                                                         "default#2": 10.0})  # fmt: skip
    rows = bench_table(_table(tmp_path, [KEY]), CPU, reps=5)
    assert rows[0].is_default and rows[0].speedup == 1.0  # not 1.020x: one kernel timed twice
    text = "\n".join(summary_lines(summarize(rows)))
    assert "no speedup to report" in text and "1.020" not in text and "=" in bench._line(rows[0])
