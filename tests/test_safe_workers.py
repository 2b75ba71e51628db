"""The processes gemmtune starts run gemmtune's own entry point, never the caller's main module: online
tuning and `tune` work from a script without a main guard, from `python -c`, under the caller's fork or
spawn start method and across os.fork(); the script's body runs once (each run of it appends its pid to
a file, which the tests count); a process that exits right after a miss leaves a readable table and no
worker behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

import gemmtune
from gemmtune import child_process
from gemmtune.configs import read_table_file

RUN_S = 240  # an upper bound for one script's run, never a timing assumption
GONE_S = 30  # how long an orphaned worker may take to notice its parent is gone
# The scripts run in their own folder: they find this gemmtune and this module by absolute paths.
SRC = os.path.dirname(os.path.dirname(os.path.abspath(gemmtune.__file__)))
PYTHONPATH = os.pathsep.join([SRC, os.path.dirname(os.path.abspath(__file__))])


def gone(pid: int) -> bool:
    """The process has ended (a zombie no one reaped counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        if gone(pid):
            return True
        time.sleep(0.05)
    return gone(pid)


# ---- child_process itself -----------------------------------------------------------------------------
def echo(conn, prefix):
    while (msg := conn.recv()) is not None:
        conn.send((prefix, msg, os.getppid()))


def square_or_fail(n):
    if n == 3:
        raise ValueError("three")
    if n == 4:
        os._exit(5)
    return n * n


def test_a_child_runs_the_named_function_over_its_pipe():
    child = child_process.start(f"{__name__}:echo", "hi")
    try:
        child.conn.send(41)
        assert child.conn.recv() == ("hi", 41, os.getpid())
        assert child.is_alive() and child.exitcode is None
        child.conn.send(None)
        child.join(RUN_S)
        assert child.exitcode == 0 and not child.is_alive()
    finally:
        child.close()
    assert wait_gone(child.pid)


def test_a_killed_child_reports_its_signal_and_wakes_its_sentinel():
    from multiprocessing.connection import wait

    child = child_process.start(f"{__name__}:echo", "x")
    try:
        child.kill()
        assert wait([child.sentinel], timeout=RUN_S) == [child.sentinel]
        child.join(RUN_S)
        assert child.exitcode == -9
    finally:
        child.close()


@pytest.mark.parametrize("target", ["os.path", "no_colon_here", ":basename", "os.path:"])
def test_a_target_that_names_no_function_is_refused(target):
    with pytest.raises(ValueError, match=f"target={target!r}: expected 'package.module:function'"):
        child_process.start(target)


@pytest.mark.slow
def test_map_unordered_returns_every_result_and_names_a_failure():
    target = f"{__name__}:square_or_fail"
    assert sorted(child_process.map_unordered(target, [0, 1, 2, 5], 2)) == [0, 1, 4, 25]
    with pytest.raises(RuntimeError, match=r"failed on item 1: ValueError: three"):
        list(child_process.map_unordered(target, [1, 3], 1))
    with pytest.raises(RuntimeError, match=r"ended \(exit code 5\) on item 0"):
        list(child_process.map_unordered(target, [4, 1], 1))


def _run(args, env, cwd):
    p = subprocess.run(args, env={**env, "PYTHONPATH": PYTHONPATH}, cwd=cwd, capture_output=True, text=True,
                       timeout=RUN_S)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return p


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["exit", "os._exit", "SIGKILL"])
def test_a_worker_never_outlives_its_parent(tmp_path, ending):
    """The parent exits (atexit ends its children), vanishes without atexit, or is killed: the worker
    goes within a bounded wait."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        from gemmtune import child_process
        child = child_process.start("{__name__}:echo", "x")
        child.conn.send(1)
        child.conn.recv()  # the worker runs
        print(child.pid, flush=True)
        if {ending!r} == "os._exit":
            os._exit(0)
        if {ending!r} == "SIGKILL":
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=RUN_S)
    assert p.returncode == (-9 if ending == "SIGKILL" else 0), p.stderr
    assert wait_gone(int(p.stdout.split()[0]))


# ---- online tuning from any program -----------------------------------------------------------------
BODY = """\
import os, sys
with open({pids!r}, "a") as fh:
    fh.write(f"{{os.getpid()}}\\n")
{start_method}import torch, gemmtune
torch.manual_seed(0)
w = torch.randn(16, 24)
gemmtune.gemm(torch.randn(3, 24), w)
hook = gemmtune.get_dispatcher().miss_hook()
{after_miss}assert hook.wait({wait}), "the key was never tuned"
print("tuned", len(hook.tuned), "failed", len(hook.failed))
"""


def online_env(table, budget="2"):
    return {**os.environ, "GEMMTUNE_TUNE_ONLINE": str(table), "GEMMTUNE_TUNE_ONLINE_BUDGET": budget}


def body(tmp_path, start_method="", after_miss=""):
    return BODY.format(pids=str(tmp_path / "pids"), start_method=start_method, after_miss=after_miss, wait=RUN_S)


def runs_of_body(tmp_path) -> list[str]:
    return (tmp_path / "pids").read_text().split()


def rows(table):
    return sorted((r.key.M, r.key.N, r.key.K) for r in read_table_file(str(table)).rows)


SLOW = pytest.mark.slow


@pytest.mark.parametrize("start_method", [None, pytest.param("fork", marks=SLOW), pytest.param("spawn", marks=SLOW)])
def test_online_tuning_from_a_script_without_a_main_guard(tmp_path, start_method):
    set_method = f"import multiprocessing\nmultiprocessing.set_start_method({start_method!r})\n" if start_method else ""
    script = tmp_path / "serve.py"
    script.write_text(body(tmp_path, set_method))
    p = _run([sys.executable, str(script)], env=online_env(tmp_path / "t.csv"), cwd=tmp_path)
    assert p.stdout.split() == ["tuned", "1", "failed", "0"], p.stderr
    assert len(runs_of_body(tmp_path)) == 1, "the script's body ran again in a worker"
    assert rows(tmp_path / "t.csv") == [(3, 16, 24)]


def test_online_tuning_from_python_c(tmp_path):
    p = _run([sys.executable, "-c", body(tmp_path)], env=online_env(tmp_path / "t.csv"), cwd=tmp_path)
    assert p.stdout.split() == ["tuned", "1", "failed", "0"], p.stderr
    assert len(runs_of_body(tmp_path)) == 1
    assert rows(tmp_path / "t.csv") == [(3, 16, 24)]


@pytest.mark.slow
def test_a_forked_child_tunes_its_own_misses(tmp_path):
    """The parent misses M=3 and forks at once (its tuner's thread may hold the key): the child, which
    has none of the parent's threads, tunes that key and its own M=5 itself."""
    after_miss = (
        textwrap.dedent("""\
        pid = os.fork()
        if pid == 0:
            gemmtune.gemm(torch.randn(5, 24), w)
            ok = hook.wait(%d)
            print("child", sorted(k.M for k in hook.tuned), ok, flush=True)
            os._exit(0 if ok else 1)
        assert os.waitpid(pid, 0)[1] == 0, "the forked child's keys were not tuned"
    """)
        % RUN_S
    )
    script = tmp_path / "serve.py"
    script.write_text(body(tmp_path, after_miss=after_miss))
    # One BLAS thread: GNU OpenMP's thread team does not survive a fork (a forked child's next matmul
    # hangs with or without gemmtune).
    env = {**online_env(tmp_path / "t.csv"), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    p = _run([sys.executable, str(script)], env=env, cwd=tmp_path)
    out = p.stdout.splitlines()
    assert "child [3, 5] True" in out and out[-1] == "tuned 1 failed 0", p.stdout + p.stderr
    assert len(runs_of_body(tmp_path)) == 1
    assert rows(tmp_path / "t.csv") == [(3, 16, 24), (5, 16, 24)]


@pytest.mark.parametrize("ending", ["exit", pytest.param("os._exit", marks=pytest.mark.slow)])
def test_a_process_that_exits_right_after_a_miss_leaves_a_valid_table_and_no_worker(tmp_path, ending):
    """The script exits as soon as the tuner's worker exists: whatever was written reads back, and the
    worker is gone."""
    after_miss = textwrap.dedent(f"""\
        import time
        from gemmtune import child_process
        deadline = time.monotonic() + {RUN_S}
        while not child_process.children() and time.monotonic() < deadline:
            time.sleep(0.01)
        print(*[c.pid for c in child_process.children()], flush=True)
        if {ending!r} == "os._exit":
            os._exit(0)
        sys.exit(0)
    """)
    table = tmp_path / "t.csv"
    p = _run([sys.executable, "-c", body(tmp_path, after_miss=after_miss)], env=online_env(table), cwd=tmp_path)
    pids = [int(v) for v in p.stdout.split()]
    assert len(pids) == 1, p.stdout + p.stderr
    assert wait_gone(pids[0])
    assert "failed" not in p.stderr, p.stderr  # an exit that takes the worker along is not a failure
    if table.exists():
        assert rows(table) in ([], [(3, 16, 24)])
    assert len(runs_of_body(tmp_path)) == 1


@pytest.mark.slow
def test_tune_from_a_script_without_a_main_guard(tmp_path):
    (tmp_path / "shapes.csv").write_text("M,N,K\n2,16,24\n4,16,24\n")
    script = tmp_path / "tune.py"
    script.write_text(
        textwrap.dedent(f"""\
        import os
        with open({str(tmp_path / "pids")!r}, "a") as fh:
            fh.write(f"{{os.getpid()}}\\n")
        import torch
        from gemmtune.tuner.candidates import TuneOptions
        from gemmtune.tuner.runner import tune_file
        rep = tune_file("shapes.csv", "t.csv", TuneOptions(reps=5, screen_reps=5, budget_s=2),
                        torch.device("cpu"), mp_workers=1, progress=False)
        print(len(rep.results), len(rep.failures))
    """)
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMTUNE_")}
    p = _run([sys.executable, str(script)], env=env, cwd=tmp_path)
    assert p.stdout.split() == ["2", "0"], p.stderr
    assert len(runs_of_body(tmp_path)) == 1
    assert rows(tmp_path / "t.csv") == [(2, 16, 24), (4, 16, 24)]
