"""Online tuning: missed keys are tuned at their first eager call and appended to the table; never
while a CUDA graph is captured (queued instead), and off when asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import gemmtune
from gemmtune.configs import read_table_file
from gemmtune.keys import GemmKey
from gemmtune.tuner import online, online_common

CPU = torch.device("cpu")


@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) for m in ("background", "blocking")])
def test_a_model_run_fills_the_table_and_a_second_run_reuses_it(tmp_path, mode):
    """Both modes end with the same rows, in the file and in effect; background mode tunes in a worker
    process (the run waits for it only to check the outcome)."""
    table = tmp_path / "online.csv"
    script = (
        "import torch, gemmtune\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))\n"
        "x = torch.randn(5, 32)\n"
        "def run():\n"
        "    return gemmtune.gemm(torch.relu(gemmtune.gemm(x, m[0].weight, m[0].bias)), m[2].weight, m[2].bias)\n"
        "for _ in range(3):\n"
        "    y = run()\n"
        "assert torch.allclose(y, m(x), atol=1e-5)\n"
        "hook = gemmtune.get_dispatcher().miss_hook()\n"
        "assert hook.mode == " + repr(mode) + "\n"
        "if hook.mode == 'background':\n"
        "    assert hook.wait(240)\n"
        "assert torch.allclose(run(), m(x), atol=1e-5)\n"
        "print(len(hook.tuned), len(gemmtune.get_dispatcher().table()))\n"
    )
    env = {**os.environ, "GEMMTUNE_TUNE_ONLINE": str(table), "GEMMTUNE_TUNE_ONLINE_BUDGET": "5",
           "GEMMTUNE_TUNE_ONLINE_MODE": mode}  # fmt: skip
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "2 2" and first.stderr.count("tuned") == 2 and "online" in first.stderr
    rows = read_table_file(str(table)).rows
    assert {(r.key.M, r.key.N, r.key.K, r.key.bias) for r in rows} == {(5, 48, 32, True), (5, 16, 48, True)}
    env["GEMMTUNE_CONFIG"] = str(table)  # the tuned table in effect: nothing left to tune
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and second.stdout.strip() == "0 2", second.stderr
    assert len(read_table_file(str(table)).rows) == 2


def test_no_tuning_while_a_graph_is_captured_then_the_queue_is_tuned(tmp_path, monkeypatch):
    table = tmp_path / "online.csv"
    tuner = gemmtune.set_online_tuning(str(table), budget_s=5, mode="blocking")
    monkeypatch.setattr(online_common, "capturing", lambda device: True)
    w = torch.randn(24, 16)
    y = gemmtune.gemm(torch.randn(3, 16), w)  # "inside a capture": default now, key queued
    assert y.shape == (3, 24) and not table.exists()
    assert [k for k, _, _ in tuner.queue] == [GemmKey(3, 24, 16, False, torch.float32, torch.float32)]
    monkeypatch.setattr(online_common, "capturing", lambda device: False)
    gemmtune.gemm(torch.randn(7, 16), w)  # the next eager miss tunes the queue, then itself
    assert not tuner.queue and [r.key.M for r in read_table_file(str(table)).rows] == [3, 7]


def test_off_switches(monkeypatch, tmp_path):
    d = gemmtune.get_dispatcher()
    for value in ("", "0", "off"):
        monkeypatch.setenv("GEMMTUNE_TUNE_ONLINE", value)
        d._miss_hook, d._miss_hook_from_env = None, True
        assert d.miss_hook() is None
    monkeypatch.setenv("GEMMTUNE_TUNE_ONLINE", str(tmp_path / "t.csv"))
    d._miss_hook, d._miss_hook_from_env = None, True
    assert d.miss_hook().mode == "background"
    monkeypatch.setenv("GEMMTUNE_TUNE_ONLINE_MODE", "blocking")
    d._miss_hook, d._miss_hook_from_env = None, True
    assert isinstance(d.miss_hook(), online.OnlineTuner)
    gemmtune.set_online_tuning(None)
    gemmtune.gemm(torch.randn(2, 4), torch.randn(3, 4))
    assert not (tmp_path / "t.csv").exists()


def test_the_dispatcher_asks_any_miss_hook_once_per_new_key_except_while_quiet():
    """Online tuning is one miss hook among possible others: the dispatcher calls whatever is set, once
    per key no row answers, and Dispatcher.quiet() suspends it."""
    seen = []

    class Recorder:
        def on_miss(self, key, family, device, dispatcher):
            seen.append((key.M, family.name))
            return False  # no row added: the default serves the key

    d = gemmtune.get_dispatcher()
    d.set_miss_hook(Recorder())
    w = torch.randn(24, 16)
    for _ in range(2):
        gemmtune.gemm(torch.randn(3, 16), w)
    assert seen == [(3, "a16w16")]
    with d.quiet():
        gemmtune.gemm(torch.randn(5, 16), w)
    assert seen == [(3, "a16w16")]
    gemmtune.gemm(torch.randn(5, 16), w)
    assert seen == [(3, "a16w16"), (5, "a16w16")]
    with pytest.raises(TypeError, match="on_miss"):
        d.set_miss_hook(object())


@pytest.mark.gpu
@pytest.mark.slow
def test_graph_capture_in_online_mode_neither_tunes_nor_breaks(gpu, tmp_path):
    table = tmp_path / "online.csv"
    tuner = gemmtune.set_online_tuning(str(table), budget_s=10, mode="blocking")
    x = torch.randn(6, 512, device=gpu, dtype=torch.bfloat16)
    w = torch.randn(768, 512, device=gpu, dtype=torch.bfloat16) / 23
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # the warm-up any capture needs (cuBLAS makes its handle outside it)
        torch.nn.functional.linear(x, w)
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(g):
        y = gemmtune.gemm(x, w)  # first call of this key happens inside the capture
    assert not table.exists() and len(tuner.queue) == 1
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w))
    gemmtune.gemm(torch.randn(9, 512, device=gpu, dtype=torch.bfloat16), w)  # eager: tunes the queue too
    assert {r.key.M for r in read_table_file(str(table)).rows} == {6, 9}


def test_the_budget_covers_the_key_and_the_checks_stop_at_their_share():
    from gemmtune.tuner.candidates import CHECK_SHARE, TuneOptions, check_deadline

    opts = TuneOptions(budget_s=20.0)
    assert check_deadline(opts, start=100.0) == 100.0 + 20.0 * CHECK_SHARE < 120.0  # room left for the timing
    assert check_deadline(opts, 0.25, start=100.0) == 100.0 + 5.0 * CHECK_SHARE
    assert check_deadline(TuneOptions(), start=100.0) == float("inf")  # offline tuning has no budget
