"""Online tuning under torch.distributed (2 gloo processes under torchrun): a key missed on any rank is
tuned once, on the first rank, and every rank adopts the same row at the same sync_online_rows call,
never before it. Without torch.distributed the call adopts this process's finished rows; during a
capture it refuses to run."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

import gemmtune
from gemmtune.configs import read_table_file
from gemmtune.keys import GemmKey
from gemmtune.tuner import online_common
from gemmtune.tuner.online_background import BackgroundTuner
from gemmtune.tuner.search import tune_shape

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    import gemmtune
    from gemmtune.keys import GemmKey
    from gemmtune.tuner.online_background import BackgroundTuner
    from gemmtune.tuner.search import tune_shape

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tune = lambda key, family, device, opts: tune_shape(key, device, opts, family=family)  # in this process
    tuner = gemmtune.get_dispatcher().set_miss_hook(BackgroundTuner(sys.argv[1], budget_s=5, tune=tune))
    w = torch.randn(24, 16, generator=torch.Generator().manual_seed(0))
    key = lambda m: GemmKey(m, 24, 16, False, torch.float32, torch.float32)
    row = lambda m: gemmtune.resolve(key(m)).row
    gemmtune.gemm(torch.randn(3, 16), w)  # a key both ranks miss
    gemmtune.gemm(torch.randn(5 + rank, 16), w)  # and one each
    assert not tuner.waiting and not tuner.running  # nothing is tuned before the ranks have met
    assert gemmtune.sync_online_rows() == []  # the misses are shared: the first rank queues 3, 5, 6
    assert tuner.wait(120)
    gemmtune.gemm(torch.randn(3, 16), w)
    assert row(3) is None  # finished on rank 0, but adopted only at the next sync, by every rank at once
    adopted = gemmtune.sync_online_rows()
    seen = [(r.key.M, r.libtype, r.kernel_name, r.solidx, r.us) for r in (row(3), row(5), row(6))]
    result = {"rank": rank, "adopted": len(adopted), "tuned": len(tuner.tuned), "rows": seen}
    with open(f"{sys.argv[1]}.rank{rank}.json", "w") as fh:  # one file each: the ranks' stdout interleaves
        json.dump(result, fh)
    dist.destroy_process_group()
    """
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_ranks_adopt_the_same_rows_at_the_same_sync(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT)
    table = tmp_path / "online.csv"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), str(table)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    results = [json.loads(pathlib.Path(f"{table}.rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(r["rank"], r["adopted"], r["tuned"]) for r in results] == [(0, 3, 3), (1, 3, 0)]  # tuned once, on rank 0
    assert results[0]["rows"] == results[1]["rows"] and [r[0] for r in results[0]["rows"]] == [3, 5, 6]
    assert sorted(r.key.M for r in read_table_file(str(table)).rows) == [3, 5, 6]


def test_without_distributed_the_sync_adopts_this_process_rows(tmp_path, clean_dispatch, monkeypatch):
    with pytest.raises(ValueError, match="online tuning must be on in background mode, it is off"):
        gemmtune.sync_online_rows()
    tune = lambda key, family, device, opts: tune_shape(key, device, opts, family=family)  # noqa: E731
    tuner = clean_dispatch.set_miss_hook(BackgroundTuner(str(tmp_path / "t.csv"), budget_s=5, tune=tune))
    gemmtune.gemm(torch.randn(3, 16), torch.randn(24, 16))
    assert tuner.wait(60)
    monkeypatch.setattr(online_common, "capturing", lambda device: True)
    with pytest.raises(RuntimeError, match="during a CUDA graph capture"):
        gemmtune.sync_online_rows()
    monkeypatch.setattr(online_common, "capturing", lambda device: False)
    assert [r.key.M for r in gemmtune.sync_online_rows()] == [3]
    assert gemmtune.resolve(GemmKey(3, 24, 16, False, torch.float32, torch.float32)).row is not None
    tuner.close()
