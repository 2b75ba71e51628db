"""`gemmtune tune` over torch.distributed (torchrun, gloo on the CPU) and the rank-consistency check of the
tables in effect."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from click.testing import CliRunner

from gemmtune.cli.main import cli
from gemmtune.configs.table import read_table_file
from gemmtune.errors import ConfigError
from gemmtune.tuner.distributed import Claims, by_cost, host_share, launched_by_torchrun, make_plan
from gemmtune.tuner.runner import PLUGINS_ENV, tune_file
from gemmtune.tuner.search import TuneOptions

MODELS = os.path.join(os.path.dirname(__file__), "data", "models")
TIMED = {"us", "tflops", "bw", "err_ratio"}  # measured columns: the rest is what a run decides
# A backend with no candidates that kills rank 1 hard at that rank's second key (when RANK_DEATH is set).
RANK_DEATH = textwrap.dedent(
    """
    import os
    from gemmtune import backends
    from gemmtune.backends.base import Backend

    SEEN = set()

    class RankDeath(Backend):
        name = "rankdeath"

        def is_available(self, device):
            return True

        def candidates(self, key, device):
            SEEN.add(key)
            if os.environ.get("RANK_DEATH") and os.environ.get("RANK") == "1" and len(SEEN) > 1:
                os._exit(9)
            return []

        def solution_from_row(self, solidx, kernel_name, splitk):
            return None

        def supports(self, solution, key, device):
            return False

        def make_runner(self, sol, key, device):
            raise NotImplementedError

    backends.register(RankDeath())
    """
)

# Makes rank 1 report another GPU kind, as a rank of a mixed fleet would.
OTHER_KIND = textwrap.dedent(
    """
    import os
    from gemmtune.device import DeviceIdentity
    from gemmtune.tuner import distributed

    if os.environ.get("RANK") == "1":
        distributed.identity = lambda device: DeviceIdentity("cpu-other", 7)
    """
)


def plugin_env(tmp_path, name: str, text: str) -> dict:
    (tmp_path / f"{name}.py").write_text(text)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
            PLUGINS_ENV: name}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_llama_shapes(tmp_path) -> str:
    path = str(tmp_path / "shapes.csv")
    res = CliRunner().invoke(cli, ["shapes", "--model", os.path.join(MODELS, "tiny-llama.json"), "-o", path])
    assert res.exit_code == 0, res.output
    return path


def torchrun(*args, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "gemmtune.cli.main", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def decided(path) -> list[dict]:
    """The table's rows without their timings, in key order."""
    with open(path, newline="") as fh:
        rows = [{c: v for c, v in r.items() if c not in TIMED} for r in csv.DictReader(fh)]
    return sorted(rows, key=lambda r: (int(r["N"]), int(r["K"]), int(r["M"])))


def test_launched_by_torchrun_needs_all_its_variables():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert launched_by_torchrun(env)
    assert not launched_by_torchrun({**env, "MASTER_PORT": ""}) and not launched_by_torchrun({})


def test_keys_are_claimed_most_expensive_first_each_by_one_rank_as_it_frees_up():
    costs = {"a": 8.0, "b": 1.0, "c": 4.0, "d": 4.0, "e": 1.0}
    order = by_cost(list(costs), costs)
    assert order == ["a", "c", "d", "b", "e"]  # ties keep the list's order
    store = dist.HashStore()
    slow, fast = Claims(order, store, "kind0"), Claims(order, store, "kind0")
    assert len(slow) == len(fast) == 5
    slow_keys, fast_iter = [], iter(fast)
    fast_keys = [next(fast_iter)]  # "a": the fast rank starts first
    for k in slow:  # the slow rank takes one key while the fast one takes two
        slow_keys.append(k)
        fast_keys += [k2 for _, k2 in zip(range(2), fast_iter)]
    assert fast_keys == ["a", "d", "b"] and slow_keys == ["c", "e"]
    assert list(Claims(order, store, "kind0")) == []  # all claimed: a late rank gets nothing
    assert list(Claims(order, store, "kind1")) == order  # another GPU kind has its own counter


def test_a_plan_lists_each_kinds_keys_once_for_its_ranks(tmp_path):
    from gemmtune.device import DeviceIdentity
    from gemmtune.families import get
    from gemmtune.keys import GemmKey

    fam = get("a16w16")
    keys = [GemmKey(m, 4096, 4096) for m in (1, 512, 8)]
    h100, mi300 = DeviceIdentity("sm90", 132), DeviceIdentity("gfx942", 304)
    plan = make_plan(fam, keys, [h100, mi300, h100], str(tmp_path / "none.csv"), False)
    assert plan.kind_of == {0: 0, 1: 1, 2: 0} and plan.keys_of(0) == plan.keys_of(2) == plan.keys_of(1)
    assert plan.keys_of(0)[0] == keys[1]  # M=512, the most expensive, first
    assert sorted(plan.everything(), key=str) == sorted(keys * 2, key=str)  # each key once per kind
    store = dist.HashStore()
    assert plan.claims(0, store).counter == plan.claims(2, store).counter != plan.claims(1, store).counter


def test_a_hosts_ranks_split_its_compiles_and_list_the_same_keys():
    shares = {0: ["a", "b"], 1: ["c"], 2: ["d"], 3: []}
    hosts = ["h1", "h2", "h1", "h2"]
    assert host_share(shares, hosts, 0) == (["a", "b", "d"], (0, 2))
    assert host_share(shares, hosts, 2) == (["a", "b", "d"], (1, 2))  # the same list, the other half
    assert host_share(shares, hosts, 3) == (["c"], (1, 2))  # a rank without keys still compiles its part
    same_kind = {0: ["a", "b"], 1: ["a", "b"]}  # two ranks claiming from one list
    assert host_share(same_kind, ["h1", "h1"], 1) == (["a", "b"], (1, 2))


def test_each_item_is_compiled_by_one_rank_of_the_host_whatever_order_it_lists_them(monkeypatch):
    from gemmtune.backends.lib import triton_tiles

    built = []
    monkeypatch.setattr(triton_tiles, "compile_all", lambda items, device, workers: built.append(items) or [])
    items = [(name, (m,)) for m in (1, 16, 128) for name in ("k1", "k2", "k3", "k4", "k5")] + [("k1", (7,))]
    for order in (items, list(reversed(items))):  # every rank lists the same items, maybe in another order
        for i in range(2):
            triton_tiles.compile_in_workers(object, order, torch.device("cpu"), 4, (i, 2))
    parts = [[(it.name, it.key) for it in part] for part in built]
    assert sorted(parts[0] + parts[1]) == sorted(items)  # every item once, over both ranks
    assert list(map(len, parts[:2])) == [8, 8]  # balanced over the ranks
    assert parts[:2] == parts[2:]  # the same split whatever the order


@pytest.mark.slow  # a torchrun tuning run
def test_two_ranks_write_the_table_one_process_writes(tmp_path):
    shapes = tiny_llama_shapes(tmp_path)
    one, two = tmp_path / "one.csv", tmp_path / "two.csv"
    opts = TuneOptions(libtypes=["torch"], reps=5, screen_reps=5)
    tune_file(shapes, str(one), opts, torch.device("cpu"), progress=False, log=lambda m: None)
    p = torchrun("tune", shapes, "-o", str(two), "--libtype", "torch", "--reps", "5", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "on 2 rank(s) of cpu" in p.stderr
    assert decided(two) == decided(one) and len(decided(one)) > 20
    assert read_table_file(str(two)).rows  # a valid table of the family
    # Everything is tuned: a rerun over two ranks skips every key.
    p = torchrun("tune", shapes, "-o", str(two), "--libtype", "torch", "--reps", "5", "--no-progress")
    assert p.returncode == 0 and "already tuned" in p.stderr, p.stderr[-3000:]


@pytest.mark.slow  # a torchrun tuning run
def test_a_killed_rank_leaves_a_table_the_restart_completes(tmp_path):
    env = plugin_env(tmp_path, "rank_death", RANK_DEATH)
    shapes = tiny_llama_shapes(tmp_path)
    out = tmp_path / "t.csv"
    args = ("tune", shapes, "-o", str(out), "--libtype", "torch,rankdeath", "--reps", "5", "--no-progress")
    p = torchrun(*args, env={**env, "RANK_DEATH": "1"})
    assert p.returncode != 0  # rank 1 died at its second key; torchrun stopped rank 0
    p = torchrun(*args, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    with open(shapes, newline="") as fh:
        listed = {(r["M"], r["N"], r["K"]) for r in csv.DictReader(fh)}
    assert {(r["M"], r["N"], r["K"]) for r in decided(out)} == listed
    assert not list(tmp_path.glob(".gemmtune-*"))  # no temp files left behind


@pytest.mark.slow  # torchrun tuning runs: the gloo table check is the default tier's torchrun test
def test_ranks_of_two_gpu_kinds_each_tune_every_key_for_their_own_kind(tmp_path):
    env = plugin_env(tmp_path, "other_kind", OTHER_KIND)
    shapes = tiny_llama_shapes(tmp_path)
    out = tmp_path / "t.csv"
    p = torchrun("tune", shapes, "-o", str(out), "--libtype", "torch", "--reps", "5", "--no-progress", env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "on 1 rank(s) of cpu-other (7 units)" in p.stderr
    rows = decided(out)
    by_kind = {(g, c): {(r["M"], r["N"], r["K"]) for r in rows if (r["gfx"], r["cu_num"]) == (g, c)}
               for g, c in {(r["gfx"], r["cu_num"]) for r in rows}}  # fmt: skip
    assert len(by_kind) == 2 and ("cpu-other", "7") in by_kind
    a, b = by_kind.values()
    assert a == b and len(rows) == 2 * len(a)


@pytest.mark.gpu
@pytest.mark.slow
def test_two_gpus_under_nccl_write_every_key_for_their_gpu(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from gemmtune.device import identity

    shapes = tiny_llama_shapes(tmp_path)
    out = tmp_path / "t.csv"
    p = torchrun("tune", shapes, "-o", str(out), "--device", "cuda", "--libtype", "torch,triton", "--no-progress")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = decided(out)
    with open(shapes, newline="") as fh:
        assert len(rows) == sum(1 for _ in csv.DictReader(fh))
    ident = identity(torch.device("cuda", 0))
    assert {(r["gfx"], r["cu_num"]) for r in rows} == {(ident.gfx, str(ident.cu_num))}


@pytest.mark.slow  # a torchrun run: the gloo table check is the default tier's
def test_distributed_refuses_more_than_one_worker_per_rank(tmp_path):
    shapes = tiny_llama_shapes(tmp_path)
    p = torchrun("tune", shapes, "-o", str(tmp_path / "t.csv"), "--mp", "2", "--no-progress")
    assert p.returncode != 0 and "--mp 2: under torch.distributed" in p.stderr


def test_distributed_without_torchrun_names_what_is_missing(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    shapes = tiny_llama_shapes(tmp_path)
    res = CliRunner().invoke(cli, ["tune", shapes, "-o", str(tmp_path / "t.csv"), "--distributed"])
    assert res.exit_code != 0 and "--distributed: RANK, WORLD_SIZE" in res.output


# ---- the tables every rank has in effect ---------------------------------------------------------------
HEADER = "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName\n"


def table(path, m: int, us: float) -> str:
    path.write_text(HEADER + f"cpu,2,{m},128,64,False,torch.float32,torch.float32,False,False,torch,0,0,{us},native\n")
    return str(path)


def _check_ranks(rank: int, port: int, cases: list[list], out: str, backend: str = "gloo") -> None:
    import gemmtune

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        verdicts = []
        for tables in cases:
            try:
                gemmtune.set_config(tables[rank])
                gemmtune.check_tables_agree(group=dist.new_group([0, 1]))
                verdicts.append("agree")
            except ConfigError as exc:
                verdicts.append(str(exc))
        with open(f"{out}.{rank}", "w") as fh:
            fh.write("\n".join(verdicts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_the_check_passes_equal_tables_and_names_the_ranks_of_different_ones(tmp_path, backend):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    a = table(tmp_path / "a.csv", 16, 5.0)
    timed_again = table(tmp_path / "b.csv", 16, 7.5)  # another timing of the same choice
    other_m = table(tmp_path / "c.csv", 32, 5.0)
    cases = [[a, timed_again], [a, other_m], [a, None]]
    out = str(tmp_path / "verdict")
    tmp.spawn(_check_ranks, args=(free_port(), cases, out, backend), nprocs=2, join=True)
    verdicts = [open(f"{out}.{r}").read().split("\n") for r in range(2)]
    assert verdicts[0] == verdicts[1]  # every rank raises the same error
    same, different, missing = verdicts[0]
    assert same == "agree"
    assert "tuned tables differ across ranks" in different
    assert f"a16w16: rank 0 ({a}) vs rank 1 ({other_m})" in different
    assert f"a16w16: rank 0 ({a}) vs rank 1 (no table)" in missing


def test_set_config_group_needs_torch_distributed():
    import gemmtune

    with pytest.raises(ValueError, match="group=.* torch.distributed is not initialized"):
        gemmtune.set_config(None, group=object())
    with pytest.raises(ValueError, match="check_tables_agree: torch.distributed is not initialized"):
        gemmtune.check_tables_agree()
