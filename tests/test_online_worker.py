"""Background online tuning keeps one tuning worker per device: every key goes to the same process,
a worker killed between keys is replaced and the next key is still tuned, close() ends the worker; and
GEMMTUNE_TUNE_ONLINE's tuner is set up at `import gemmtune`, not in the first call. Real workers on the
CPU with a small budget; every wait is an upper bound, never a timing assumption."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from test_safe_workers import PYTHONPATH, RUN_S, wait_gone

import gemmtune
from gemmtune.configs import read_table_file
from gemmtune.tuner.online_background import BackgroundTuner

W = torch.randn(16, 24)


def miss(m: int) -> None:
    gemmtune.gemm(torch.randn(m, 24), W)


def table_ms(path) -> list[int]:
    return sorted(r.key.M for r in read_table_file(str(path)).rows)


def test_one_worker_tunes_key_after_key_and_close_ends_it(tmp_path, clean_dispatch):
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), budget_s=1))
    try:
        miss(3)
        miss(5)
        assert tuner.wait(RUN_S) and tuner.failed == []
        miss(7)  # after the queue ran dry: still the same worker
        assert tuner.wait(RUN_S) and tuner.failed == []
        [worker] = tuner.device_workers()
        assert len(worker.pids) == 3 and len(set(worker.pids)) == 1, worker.pids
        assert list(worker.start_s) == worker.pids[:1] and worker.start_s[worker.pids[0]] > 0
        assert table_ms(tmp_path / "t.csv") == [3, 5, 7]
    finally:
        tuner.close()
    assert wait_gone(worker.pids[0]), "close() left the worker running"


@pytest.mark.slow
def test_a_worker_killed_between_keys_is_replaced_and_the_next_key_tuned(tmp_path, clean_dispatch):
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), budget_s=1))
    try:
        miss(3)
        assert tuner.wait(RUN_S)
        [worker] = tuner.device_workers()
        first = worker.pids[0]
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first)
        miss(5)
        assert tuner.wait(RUN_S) and tuner.failed == [], tuner.failed
        assert worker.pids[1] != first and sorted(worker.start_s) == sorted(worker.pids)
        assert table_ms(tmp_path / "t.csv") == [3, 5]
    finally:
        tuner.close()
    assert wait_gone(worker.pids[1])


SET_UP_AT_IMPORT = """\
import sys
import gemmtune
d = gemmtune.get_dispatcher()
print(d._miss_hook is not None, "gemmtune.backends.a16w16.pytorch" in sys.modules, flush=True)
import torch
try:
    gemmtune.gemm(torch.randn(2, 4), torch.randn(3, 4))
    print("ran")
except gemmtune.errors.EnvVarError as exc:
    print("EnvVarError", exc)
"""


@pytest.mark.slow
def test_the_variables_tuner_is_set_up_at_import_and_a_bad_one_raises_at_the_first_call(tmp_path):
    def run(**env):
        base = {k: v for k, v in os.environ.items() if not k.startswith("GEMMTUNE_")}
        p = subprocess.run([sys.executable, "-c", textwrap.dedent(SET_UP_AT_IMPORT)],
                           env={**base, "PYTHONPATH": PYTHONPATH, **env}, capture_output=True, text=True,
                           timeout=RUN_S)  # fmt: skip
        assert p.returncode == 0, p.stderr
        return p.stdout.splitlines()

    table = str(tmp_path / "t.csv")
    assert run(GEMMTUNE_TUNE_ONLINE=table, GEMMTUNE_TUNE_ONLINE_BUDGET="1") == ["True True", "ran"]
    assert run()[0] == "False False"  # off: the registry waits for the first call
    out = run(GEMMTUNE_TUNE_ONLINE=table, GEMMTUNE_TUNE_ONLINE_BUDGET="soon")
    assert out[0] == "False False" and out[1].startswith("EnvVarError GEMMTUNE_TUNE_ONLINE_BUDGET='soon'"), out
