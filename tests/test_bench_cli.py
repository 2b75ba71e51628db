"""`gemmtune bench` on the CPU: one run per row through the runtime vs the default, outputs, summaries."""

from __future__ import annotations

import importlib.util
import json
import math

import torch
from click.testing import CliRunner

from gemmtune.cli.main import cli
from gemmtune.configs.schema import TUNED_COLUMNS, TunedRow
from gemmtune.configs.table import ConfigTable
from gemmtune.device import identity
from gemmtune.dispatch import get_dispatcher
from gemmtune.keys import GemmKey
from gemmtune.tuner.bench import BenchRow, bench_table, summarize, summary_lines
from gemmtune.tuner.search import runs_to_agree

CPU = torch.device("cpu")


def _table_file(tmp_path, keys, gfx=None, cu=None, libtype="torch", kernel="native", solidx=0):
    ident = identity(CPU)
    rows = [TunedRow(gfx or ident.gfx, cu or ident.cu_num, k, libtype, solidx, 0, 5.0, kernel) for k in keys]
    path = tmp_path / "tuned.csv"
    ConfigTable(rows).write(str(path), TUNED_COLUMNS)
    return path


KEYS = [GemmKey(1, 40, 24, False, torch.float32, torch.float32), GemmKey(48, 40, 24, True, torch.float32,
        torch.float32), GemmKey(600, 16, 8, False, torch.float32, torch.float32)]  # fmt: skip


def test_bench_cli_writes_table_csv_json_and_plot_or_says_why(tmp_path):
    path = _table_file(tmp_path, KEYS)
    prefix = tmp_path / "out" / "b"
    prefix.parent.mkdir()
    res = CliRunner().invoke(cli, ["bench", str(path), "-o", str(prefix), "--reps", "5"])
    assert res.exit_code == 0, res.output
    for rng in ("M<=16", "16<M<=512", "M>512"):
        assert rng in res.output
    assert "dispatch overhead" in res.output and "CPU: this measures the harness, not a speedup" in res.output
    data = json.loads((tmp_path / "out" / "b.json").read_text())
    assert data["summary"]["shapes"] == 3 and set(data["summary"]["ranges"]) == {"M<=16", "16<M<=512", "M>512"}
    assert [(r["M"], r["solution"]) for r in data["rows"]] == [(600, "torch:native"), (1, "torch:native"),
                                                               (48, "torch:native")]  # fmt: skip
    assert all(r["tuned_us"] > 0 and r["default_us"] > 0 for r in data["rows"])
    csv_lines = (tmp_path / "out" / "b.csv").read_text().splitlines()
    assert csv_lines[0].startswith("M,N,K,bias") and len(csv_lines) == 4
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "b.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in res.output


def test_bench_dispatches_through_the_table_and_restores_it(tmp_path, clean_dispatch):
    from gemmtune.backends.a16w16.pytorch import MM_OUT_DTYPE

    key = GemmKey(3, 32, 16, False, torch.float32, torch.float32)
    # A row naming a solution the runtime cannot run here falls back, and bench shows what ran.
    table = ConfigTable([TunedRow(identity(CPU).gfx, identity(CPU).cu_num, key, "torch", MM_OUT_DTYPE.solidx, 0,
                                  5.0, MM_OUT_DTYPE.kernel_name)])  # fmt: skip
    before = get_dispatcher().table()
    rows = bench_table(table, CPU, reps=5)
    assert len(rows) == 1 and rows[0].solution == "torch:native" and rows[0].table_us == 5.0
    assert get_dispatcher().table() is before


def test_bench_refuses_a_table_with_no_row_for_this_device(tmp_path):
    path = _table_file(tmp_path, KEYS[:1], gfx="gfx942", cu=304)
    res = CliRunner().invoke(cli, ["bench", str(path)])
    assert res.exit_code != 0 and "no row applies to this device" in res.output and "gfx942/304" in res.output
    res = CliRunner().invoke(cli, ["bench", str(tmp_path / "missing.csv")])
    assert res.exit_code != 0 and "no such file" in res.output


def _row(M, tuned, default, noise=0.01, roof=math.nan):
    return BenchRow(M, 64, 64, False, "torch.bfloat16", "torch.bfloat16", "x:y", tuned, tuned, default, noise, roof)


def test_summary_geomeans_per_m_range():
    rows = [_row(1, 10, 20), _row(16, 10, 5), _row(17, 10, 10), _row(512, 10, 10.05), _row(513, 8, 10, roof=4)]
    s = summarize(rows)
    assert s["ranges"]["M<=16"]["shapes"] == 2
    assert math.isclose(s["ranges"]["M<=16"]["geomean_speedup"], 1.0)  # sqrt(2 * 0.5)
    assert s["ranges"]["M<=16"]["worst_speedup"] == 0.5
    assert s["ranges"]["M<=16"]["slower_beyond_noise"] == 1
    assert s["ranges"]["16<M<=512"]["slower_beyond_noise"] == 0  # 0.5% slower is within 1% noise
    assert math.isclose(s["ranges"]["M>512"]["geomean_roof_pct_tuned"], 50.0)
    assert math.isclose(s["ranges"]["M>512"]["geomean_roof_pct_default"], 40.0)
    assert s["slower_beyond_noise"] == 1
    # A slower first run counts only if its recheck (fresh inputs and graphs) agrees.
    assert not BenchRow(**{**_row(8, 10, 9).__dict__, "recheck_speedup": 0.995}).slower_beyond_noise
    assert BenchRow(**{**_row(8, 10, 9).__dict__, "recheck_speedup": 0.9}).slower_beyond_noise
    text = "\n".join(summary_lines(s))
    assert "M<=16" in text and "roof 50% (default 40%)" in text


def test_bench_cpu_default_row_not_slower(tmp_path, monkeypatch):
    # On the CPU a torch:native row dispatches to F.linear itself: tuned and default are one kernel, so
    # a slower reading is noise and must not be flagged SLOWER (nor rechecked as a regression).
    from gemmtune.tuner import bench

    calls = []

    def noisy(key, runners, **kw):
        calls.append(key)
        return {"default": 10.0, "tuned": 13.0, "default#2": 10.0}

    monkeypatch.setattr(bench, "bench_gemm", noisy)
    path = _table_file(tmp_path, KEYS[:1])
    res = CliRunner().invoke(cli, ["bench", str(path), "-o", str(tmp_path / "b"), "--no-progress"])
    assert res.exit_code == 0, res.output
    assert "SLOWER" not in res.output and "slower once" not in res.output
    assert "no speedup to report" in res.output and "(= default: same kernel, no speedup)" in res.output
    assert len(calls) == runs_to_agree(torch.device("cpu"))  # the runs that must agree, and no recheck
    row = json.loads((tmp_path / "b.json").read_text())["rows"][0]
    assert row["is_default"] is True and row["solution"] == "torch:native"
    # A row that runs another kernel is still flagged when its recheck agrees.
    other = BenchRow(**{**_row(8, 13, 10).__dict__, "recheck_speedup": 0.77})
    assert other.slower_beyond_noise and not BenchRow(**{**other.__dict__, "is_default": True}).slower_beyond_noise


def test_bench_progress_eta_weighs_shapes_by_cost(tmp_path, monkeypatch, capsys):
    from gemmtune.tuner import bench

    small = GemmKey(1, 64, 64, False, torch.float32, torch.float32)
    big = GemmKey(2048, 4096, 4096, False, torch.float32, torch.float32)
    c_small, c_big = (bench.estimated_cost_us(k, CPU, reps=20) for k in (small, big))
    assert c_big > 100 * c_small  # ~6e11 flops vs a launch-bound call, not one unit each
    assert bench.estimated_cost_us(big, CPU, reps=40) > 1.9 * bench.estimated_cost_us(big, CPU, reps=20)
    assert bench.estimated_cost_us(small, torch.device("cuda"), reps=20) > c_small  # graphs, GPU sleeps

    # The bar advances by each shape's cost (not 1 per shape), reaches 100% and counts shapes.
    updates = []
    real_bar = bench._progress_bar

    def recording_bar(total, shapes, enabled):
        bar = real_bar(total, shapes, enabled)
        update = bar.update
        bar.update = lambda n=1: (updates.append(n), update(n))[1]
        return bar

    monkeypatch.setattr(bench, "_progress_bar", recording_bar)
    monkeypatch.setattr("gemmtune.tuner.runner.stderr_is_tty", lambda: True)  # the bar, as on a terminal
    monkeypatch.setattr(bench, "bench_gemm", lambda key, runners, **kw: {n: 1.0 for n in runners})
    table = ConfigTable.load([str(_table_file(tmp_path, [small, big]))])
    capsys.readouterr()
    bench_table(table, CPU, reps=20, progress=True)
    assert sorted(updates) == [c_small, c_big]
    err = capsys.readouterr().err
    assert "100%" in err and "(2/2 shapes)" in err


def test_bench_any_ms_through_the_table_and_other_families(tmp_path):
    from gemmtune.tuner.runner import tune_file
    from gemmtune.tuner.search import TuneOptions

    shapes = tmp_path / "s.csv"
    shapes.write_text("M,N,K,dtype\n4,32,16,torch.float32\n")
    table = tmp_path / "t.csv"
    tune_file(str(shapes), str(table), TuneOptions(reps=5), CPU, progress=False, ms=[4, 16], log=lambda m: None)
    res = CliRunner().invoke(cli, ["bench", str(table), "--device", "cpu", "--reps", "5", "--no-progress",
                                   "--ms", "3,12,16,40", "-o", str(tmp_path / "b")])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "b.json").read_text())
    got = {r["M"]: r["row_m"] for r in data["rows"]}
    assert got == {3: 4, 12: 16, 16: 16, 40: 0}  # verified ranges 1..4 and 5..16 (default kept); 40: none
    assert data["meta"]["family"] == "a16w16" and data["meta"]["ms"] == [3, 12, 16, 40]
    # A batched table benches through its own op's runners.
    bshapes = tmp_path / "b.csv"
    bshapes.write_text("B,M,N,K,dtype\n2,4,8,16,torch.float32\n")
    btable = tmp_path / "bt.csv"
    tune_file(str(bshapes), str(btable), TuneOptions(reps=5), CPU, progress=False, log=lambda m: None)
    res = CliRunner().invoke(cli, ["bench", str(btable), "--device", "cpu", "--reps", "5", "--no-progress",
                                   "--ms", "1,4,9", "-o", str(tmp_path / "bb")])  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "bb.json").read_text())["rows"]
    assert [(r["family"], r["M"]) for r in rows] == [("batched", 1), ("batched", 4), ("batched", 9)]
    assert "B=2" in rows[0]["shape"] and "N=8" in rows[0]["shape"]


def test_bench_plot_ticks_m_in_plain_numbers():
    import pytest

    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gemmtune.tuner.bench import _m_axis

    fig, ax = plt.subplots()
    ax.plot([3, 12, 24], [1, 2, 3])
    _m_axis(ax, [3, 12, 24, 12])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["3", "12", "24"]
    assert not ax.xaxis.get_minorticklocs().size
    plt.close(fig)
