"""The M rule's promise: a tuned row answers only the Ms its winner was verified on."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune import backends
from gemmtune.backends.a16w16.pytorch import TorchBackend
from gemmtune.backends.base import Backend, Solution, stable_solidx
from gemmtune.configs import read_table_file
from gemmtune.keys import GemmKey
from gemmtune.tuner import timing
from gemmtune.tuner.runner import range_floors, tune_file
from gemmtune.tuner.search import TuneOptions, tune_shape

CPU = torch.device("cpu")


class FastAboveBackend(Backend):
    """One candidate: instant at M >= 8, 80 ms below (a tile that only pays for big M)."""

    name = "fastabove"

    def is_available(self, device):
        return True

    def candidates(self, key, device):
        return [Solution(self.name, "tile", stable_solidx("tile"))]

    def solution_from_row(self, solidx, kernel_name, splitk):
        return self.candidates(None, None)[0] if kernel_name == "tile" else None

    def supports(self, solution, key, device):
        return True

    def make_runner(self, solution, key, device):
        def run(x, w, b):
            if x.numel() // x.shape[-1] < 8:
                timing.CPU_CLOCK.sleep(0.08)  # virtual: see slow_default
            return F.linear(x, w, b)

        return run


def slow_default(monkeypatch, seconds=0.005):
    """The default kernel takes `seconds` longer, on a virtual clock (conftest.VirtualClock) that the
    tuner's CPU timer reads: no real sleep, so no race with a loaded machine."""
    from conftest import VirtualClock

    if not isinstance(timing.CPU_CLOCK, VirtualClock):
        monkeypatch.setattr(timing, "CPU_CLOCK", VirtualClock())
    real = TorchBackend.make_runner

    def make(self, sol, k, dev):
        run = real(self, sol, k, dev)

        def slow(x, w, b):
            timing.CPU_CLOCK.sleep(seconds)
            return run(x, w, b)

        return slow

    monkeypatch.setattr(TorchBackend, "make_runner", make)


def test_range_shrinks_to_where_the_winner_is_not_slower(monkeypatch):
    backends.register(FastAboveBackend())
    try:
        slow_default(monkeypatch)
        key = GemmKey(16, 32, 32, False, torch.float32, torch.float32)
        res = tune_shape(key, CPU, TuneOptions(reps=7, min_gain=0.1), m_lo=5)
        assert res.winner.libtype == "fastabove"
        # Checked at 11 and 8 (fast), then 5 (80 ms): it serves 8..16 only.
        assert (res.m_lo, res.m_hi) == (8, 16) and "verified on M 8..16" in res.note
        whole = tune_shape(key, CPU, TuneOptions(reps=7, min_gain=0.1), m_lo=9)  # checked at 14 and 9
        assert (whole.m_lo, whole.m_hi) == (9, 16)
        off = tune_shape(key, CPU, TuneOptions(reps=7, min_gain=0.1, verify_range=False), m_lo=9)
        assert (off.m_lo, off.m_hi) == (16, 16)
    finally:
        backends._registry.pop(("a16w16", "fastabove"), None)


def test_tuned_table_serves_verified_ms_and_sends_the_rest_to_the_default(monkeypatch, tmp_path):
    backends.register(FastAboveBackend())
    try:
        slow_default(monkeypatch)
        shapes = tmp_path / "s.csv"
        shapes.write_text("M,N,K,dtype\n4,32,32,torch.float32\n")
        out = tmp_path / "t.csv"
        tune_file(str(shapes), str(out), TuneOptions(reps=7, min_gain=0.1), CPU, progress=False, ms=[4, 16],
                  log=lambda m: None)  # fmt: skip
        rows = {r.key.M: r for r in read_table_file(str(out)).rows}
        assert rows[4].libtype == "torch" and (rows[4].m_lo, rows[4].m_hi) == (1, 4)
        assert rows[16].libtype == "fastabove" and (rows[16].m_lo, rows[16].m_hi) == (8, 16)
    finally:
        backends._registry.pop(("a16w16", "fastabove"), None)
    gemmtune.set_config(str(out))
    for m, expect in ((3, 4), (4, 4), (5, None), (7, None), (8, 16), (16, 16), (17, None)):
        res = gemmtune.resolve(GemmKey(m, 32, 32, False, torch.float32, torch.float32), CPU)
        assert (res.row.key.M if res.row else None) == expect, m


def test_range_floors_come_from_the_list_and_the_rows_already_tuned():
    from gemmtune import families

    fam = families.get("a16w16")
    k = lambda m, n=8: GemmKey(m, n, 8)  # noqa: E731
    floors = range_floors(fam, [k(16), k(4), k(64), k(16, n=9)], tuned=[k(32)])
    assert floors == {k(16): 5, k(4): 1, k(64): 33, k(16, n=9): 1}


def test_range_points_probe_every_half_of_m_nearest_first():
    from gemmtune.tuner.search import range_points

    assert range_points(1025, 4096) == [3461, 2307, 1538, 1025]
    assert range_points(5, 16) == [12, 8, 5]
    assert range_points(1, 4) == [3, 2, 1] and range_points(16, 16) == []
