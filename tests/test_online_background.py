"""Online tuning in the background: the serving thread never waits for the tuner, the finished row is
adopted at the key's next call outside a graph capture, background work is bounded, and a failure
leaves the default serving. The tuning of one key is a fake that blocks on an Event until the test
releases it (no sleeps, no wall-clock checks) and crowns a counting backend, so each test sees which
runner served a call."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import backends
from gemmtune.backends.a16w16.pytorch import NATIVE, TorchBackend
from gemmtune.configs import read_table_file
from gemmtune.keys import GemmKey
from gemmtune.tuner import online_common
from gemmtune.tuner.online_background import BackgroundTuner
from gemmtune.tuner.search import tune_shape

CPU = torch.device("cpu")
WAIT_S = 60  # an upper bound for a thread to reach a point the test waits on; never a timing assumption
W = torch.randn(24, 16)


class CountingBackend(TorchBackend):
    """F.linear under another libtype, counting the calls of the runners it builds."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    def solution_from_row(self, solidx, kernel_name, splitk):
        return dataclasses.replace(NATIVE, libtype=self.name) if kernel_name == NATIVE.kernel_name else None

    def supports(self, solution, key, device):
        return True

    def make_runner(self, solution, key, device):
        def run(x, w, bias):
            self.calls += 1
            return F.linear(x, w, bias)

        return run


@pytest.fixture
def counting():
    backend = backends.register(CountingBackend())
    yield backend
    backends._registry.pop((backend.family, backend.name))


class GatedTune:
    """The tuning of one key: waits for `release`, then returns a result whose winner is the counting
    backend. `entered` counts the keys that started; `peak` is the most tuned at once."""

    def __init__(self, fail: bool = False):
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.active = self.peak = 0
        self.fail = fail

    def __call__(self, key, family, device, opts):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        self.entered.release()
        try:
            assert self.release.wait(WAIT_S), "the test never released the tuner"
            if self.fail:
                raise RuntimeError("candidate crashed the worker")
            res = tune_shape(key, device, dataclasses.replace(opts, libtypes=["torch"]), family=family)
            winner = dataclasses.replace(res.winner, libtype="counting")
            return dataclasses.replace(res, winner=winner, kept_default=False)
        finally:
            with self.lock:
                self.active -= 1


def key(m: int) -> GemmKey:
    return GemmKey(m, 24, 16, False, torch.float32, torch.float32)


def gemm(m: int) -> torch.Tensor:
    x = torch.randn(m, 16)
    y = gemmtune.gemm(x, W)
    torch.testing.assert_close(y, F.linear(x, W))
    return y


def test_the_serving_thread_never_waits_for_the_tuner(tmp_path, counting, clean_dispatch):
    tune = GatedTune()
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), tune=tune))
    gemm(3)  # returns while the tuner is blocked: the test has not released it yet
    assert tune.entered.acquire(timeout=WAIT_S)  # the key reached the background tuner ...
    assert not tune.release.is_set() and [k for k, *_ in tuner.running] == [key(3)]  # ... which is still blocked
    assert counting.calls == 0 and not (tmp_path / "t.csv").exists()
    assert gemmtune.resolve(key(3)).row is None  # the default serves meanwhile
    tune.release.set()
    assert tuner.wait(WAIT_S)
    assert [(r.key, r.libtype) for r in read_table_file(str(tmp_path / "t.csv")).rows] == [(key(3), "counting")]
    gemm(3)  # the next call adopts the row and runs its runner
    assert counting.calls == 1 and gemmtune.resolve(key(3)).row.libtype == "counting"
    gemm(3)  # cached from now on
    assert counting.calls == 2 and tuner.tuned == [key(3)]
    tuner.close()


@pytest.mark.parametrize("jobs", [1, 2])
def test_background_work_is_bounded_and_duplicates_are_ignored(tmp_path, counting, clean_dispatch, jobs):
    tune = GatedTune()
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), tune=tune, jobs=jobs, max_queue=3))
    for m in range(1, jobs + 1):
        gemm(m)
        assert tune.entered.acquire(timeout=WAIT_S)  # each job takes its key before the next miss
    for m in range(jobs + 1, jobs + 5):
        gemm(m)  # three wait, the fourth finds the queue full
    clean_dispatch.clear_cache()
    gemm(jobs + 1)  # missed again: already queued, ignored
    assert not tune.entered.acquire(timeout=0)  # no job beyond `jobs` started
    assert len(tuner.running) == jobs and [k.M for k, *_ in tuner.waiting] == [jobs + 1, jobs + 2, jobs + 3]
    tune.release.set()
    assert tuner.wait(WAIT_S)
    assert tune.peak == jobs and sorted(k.M for k in tuner.tuned) == list(range(1, jobs + 4))
    tuner.close()


def test_a_row_is_never_adopted_inside_a_capture(tmp_path, counting, clean_dispatch, monkeypatch):
    tune = GatedTune()
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), tune=tune))
    monkeypatch.setattr(online_common, "capturing", lambda device: True)
    tune.release.set()
    gemm(3)  # first call inside a (simulated) capture: the default serves, the key is queued
    assert tuner.wait(WAIT_S) and tuner.tuned == [key(3)]  # finished: the runner cache was emptied
    gemm(3)  # its next call is inside a capture too: the default serves and is cached, nothing adopted
    assert counting.calls == 0 and gemmtune.resolve(key(3)).row is None
    monkeypatch.setattr(online_common, "capturing", lambda device: False)
    gemm(3)  # outside now, but cached during the capture: the default, until the next miss outside one
    assert counting.calls == 0
    gemm(7)  # a miss outside a capture adopts the finished rows and empties the family's runner cache
    gemm(3)
    assert counting.calls == 1 and gemmtune.resolve(key(3)).row.libtype == "counting"
    assert tuner.wait(WAIT_S)
    tuner.adopt()  # the explicit way, without a miss: key 7's row
    gemm(7)
    assert counting.calls == 2
    tuner.close()


def test_a_failed_key_keeps_the_default_and_logs_one_line(tmp_path, counting, clean_dispatch, caplog):
    tune = GatedTune(fail=True)
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), tune=tune))
    tune.release.set()
    with caplog.at_level(logging.INFO, logger="gemmtune"):
        gemm(3)
        assert tuner.wait(WAIT_S)
        gemm(3)
    lines = [r.getMessage() for r in caplog.records if "online" in r.getMessage()]
    assert len(lines) == 2 and "queued" in lines[0] and "failed" in lines[1] and "crashed the worker" in lines[1]
    assert tuner.failed == [key(3)] and counting.calls == 0 and not (tmp_path / "t.csv").exists()
    tuner.close()


def test_background_is_the_default_mode_and_blocking_stays_an_option(tmp_path, clean_dispatch):
    assert gemmtune.set_online_tuning(str(tmp_path / "t.csv")).mode == "background"
    blocking = gemmtune.set_online_tuning(str(tmp_path / "t.csv"), budget_s=5, mode="blocking")
    gemm(3)  # tuned in the call: the row is in effect and in the file when it returns
    assert blocking.tuned == [key(3)] and gemmtune.resolve(key(3)).row is not None
    assert [r.key for r in read_table_file(str(tmp_path / "t.csv")).rows] == [key(3)]
    with pytest.raises(ValueError, match="jobs must be a positive int, got 0"):
        BackgroundTuner(str(tmp_path / "t.csv"), jobs=0)
