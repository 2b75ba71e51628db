"""Shape capture: counts, concurrent writers, crash safety, the `gemmtune capture` command."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gemmtune
from gemmtune.capture import CAPTURE_COLUMNS, read_shapes
from gemmtune.keys import GemmKey


def test_capture_records_shapes_with_counts(tmp_path, clean_dispatch):
    out = tmp_path / "shapes.csv"
    cap = gemmtune.set_capture(str(out))
    w = torch.randn(8, 16)
    for _ in range(5):
        gemmtune.gemm(torch.randn(3, 16), w)
    gemmtune.gemm(torch.randn(2, 4, 16), w, torch.randn(8))
    assert out.exists()  # a new shape is written at once
    cap.flush()
    shapes = dict(read_shapes(str(out)))
    f32 = torch.float32
    assert shapes == {GemmKey(3, 8, 16, False, f32, f32): 5, GemmKey(8, 8, 16, True, f32, f32): 1}
    assert out.read_text().splitlines()[0] == ",".join(CAPTURE_COLUMNS)


WORKER = textwrap.dedent(
    """
    import sys, torch, gemmtune
    wid, calls = int(sys.argv[1]), int(sys.argv[2])
    for i in range(calls):
        # a shape every worker shares, and one of its own
        gemmtune.gemm(torch.randn(4, 32), torch.randn(16, 32))
        gemmtune.gemm(torch.randn(wid + 1, 32), torch.randn(64 + wid, 32))
    if len(sys.argv) > 3:
        import os; os._exit(0)  # crash: no atexit flush
    """
)


@pytest.mark.slow
def test_four_concurrent_processes_lose_nothing(tmp_path):
    out = tmp_path / "shapes.csv"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, GEMMTUNE_CAPTURE=str(out))
    procs = [subprocess.Popen([sys.executable, str(script), str(i), "10"], env=env) for i in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    shapes = {(k.M, k.N, k.K): c for k, c in read_shapes(str(out))}
    expected = {(4, 16, 32): 40, **{(i + 1, 64 + i, 32): 10 for i in range(4)}}
    assert shapes == expected


def test_crash_leaves_a_valid_file_with_every_shape_seen(tmp_path):
    out = tmp_path / "shapes.csv"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, GEMMTUNE_CAPTURE=str(out))
    subprocess.run([sys.executable, str(script), "2", "3", "crash"], env=env, check=True)
    shapes = {(k.M, k.N, k.K) for k, _ in read_shapes(str(out))}
    assert shapes == {(4, 16, 32), (3, 66, 32)}
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_capture_cli_runs_the_command(tmp_path):
    out = tmp_path / "cap.csv"
    script = tmp_path / "job.py"
    script.write_text("import torch, gemmtune\ngemmtune.gemm(torch.randn(5, 24), torch.randn(40, 24))\n")
    res = subprocess.run(
        [sys.executable, "-m", "gemmtune.cli.main", "capture", "-o", str(out), "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert "1 distinct shapes, 1 calls" in res.stderr
    assert [(k.M, k.N, k.K, c) for k, c in read_shapes(str(out))] == [(5, 40, 24, 1)]


@pytest.mark.slow  # the exit statuses: tests/test_toolkit_hardening.py's default cases
def test_capture_cli_passes_the_exit_code(tmp_path):
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "gemmtune.cli.main",
            "capture",
            "-o",
            str(tmp_path / "x.csv"),
            "--",
            sys.executable,
            "-c",
            "raise SystemExit(3)",
        ],  # fmt: skip
        capture_output=True,
        text=True,
    )
    assert res.returncode == 3
    # nothing went through gemmtune: the summary says how a GEMM would
    assert "no GEMM went through gemmtune" in res.stderr and "gemmtune.optimize(model)" in res.stderr
    assert "gemmtune.gemm" in res.stderr and not (tmp_path / "x.csv").exists()
