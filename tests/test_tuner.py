"""`gemmtune tune` on the CPU: correctness checks, the search decision, resume, crash isolation, bad input."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from conftest import VirtualClock
from test_m_ranges import slow_default

from gemmtune import backends
from gemmtune.backends.a16w16.pytorch import NATIVE, TorchBackend
from gemmtune.capture import key_to_record
from gemmtune.cli.main import cli
from gemmtune.configs.schema import UNTUNED_COLUMNS, throughput
from gemmtune.configs.table import read_table_file
from gemmtune.keys import GemmKey
from gemmtune.tuner import timing
from gemmtune.tuner.check import check_runner, reference, threshold_for
from gemmtune.tuner.runner import EXIT_AFTER_ENV, PLUGINS_ENV, summary_lines, tune_file
from gemmtune.tuner.search import TuneOptions, tune_shape
from gemmtune.tuner.timing import make_inputs

CPU = torch.device("cpu")

# A backend whose candidates misbehave on purpose; FAKE_KINDS picks which ones it offers.
FAKE_BACKEND = textwrap.dedent(
    """
    import os, time
    import torch
    import torch.nn.functional as F
    from gemmtune import backends
    from gemmtune.backends.base import Backend, Solution, stable_solidx

    class FakeBackend(Backend):
        name = "fake"

        def is_available(self, device):
            return True

        def candidates(self, key, device):
            kinds = os.environ.get("FAKE_KINDS", "good,wrong,raises,partial,oom").split(",")
            return [Solution("fake", k, stable_solidx(k)) for k in kinds]

        def solution_from_row(self, solidx, kernel_name, splitk):
            return Solution("fake", kernel_name, stable_solidx(kernel_name))

        def supports(self, solution, key, device):
            return True

        def make_runner(self, sol, key, device):
            k = sol.kernel_name
            if k == "oom":
                raise torch.OutOfMemoryError("fake: tried to allocate 1 PiB")

            def run(x, w, b):
                if k == "raises":
                    raise RuntimeError("fake kernel raised")
                if k == "crash":
                    os._exit(9)
                if k == "hang":
                    time.sleep(3600)
                if k == "nograph":  # a host sync: runs eagerly, cannot be captured in a CUDA graph
                    x.sum().item()
                if k == "strided" and (x.dim() != 2 or not x.is_contiguous()):  # wrong on padded rows only
                    return torch.zeros((*x.shape[:-1], w.shape[0]), dtype=key.outdtype, device=x.device)
                if k == "slowgood":
                    from gemmtune.tuner import timing

                    timing.CPU_CLOCK.sleep(0.003)  # virtual (conftest.VirtualClock): the test installs it
                if k == "partial":  # leaves the last output column unwritten: stale memory, not a lucky reuse
                    out = torch.full((*x.shape[:-1], w.shape[0]), 1e4, dtype=key.outdtype, device=x.device)
                    out[..., :-1] = F.linear(x, w[:-1], None if b is None else b[:-1])
                    return out
                y = F.linear(x, w, b).to(key.outdtype)
                return y * 1.1 if k == "wrong" else y

            return run

    backends.register(FakeBackend())
    """
)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Make `fake_backend` importable (here and in spawned workers) and registered; remove it after."""
    (tmp_path / "fake_backend.py").write_text(FAKE_BACKEND)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(PLUGINS_ENV, "fake_backend")
    sys.modules.pop("fake_backend", None)
    yield tmp_path
    backends._registry.pop(("a16w16", "fake"), None)
    sys.modules.pop("fake_backend", None)


def write_shapes(path, keys):
    path.write_text(",".join(UNTUNED_COLUMNS) + "\n" + "".join(",".join(key_to_record(k)) + "\n" for k in keys))
    return str(path)


KEYS = [GemmKey(1, 48, 40, False, torch.float32, torch.float32), GemmKey(5, 48, 40, True, torch.float32, torch.float32),
        GemmKey(3, 33, 17, False, torch.bfloat16, torch.bfloat16), GemmKey(2, 24, 40, False, torch.float16,
        torch.float32)]  # fmt: skip
FAST = TuneOptions(reps=5, screen_reps=5)


# ---- correctness check ------------------------------------------------------------------------------
@pytest.mark.parametrize("key", KEYS, ids=lambda k: k.describe())
def test_check_accepts_the_default_and_rejects_bad_outputs(key):
    inputs = make_inputs(key, CPU, sets=1, seed=1)[0]
    ref = reference(key, *inputs)
    good = TorchBackend().make_runner(NATIVE, key, CPU)
    res = check_runner(good, key, inputs, ref)
    assert res.ok and res.err <= threshold_for(key), res

    def nan_one(x, w, b):
        y = good(x, w, b).clone()
        y.view(-1)[-1] = float("nan")
        return y

    bad = {
        "NaN": nan_one,
        "rel_err": lambda x, w, b: good(x, w, b) * (1 + 20 * threshold_for(key)),
        "output shape": lambda x, w, b: good(x, w, b)[..., :-1],
        "output dtype": lambda x, w, b: good(x, w, b).double(),
    }
    for why, run in bad.items():
        res = check_runner(run, key, inputs, ref)
        assert not res.ok and why in res.reason, (why, res)
    # --err-ratio loosens the threshold, but never past "catastrophic" or NaN.
    assert check_runner(bad["rel_err"], key, inputs, ref, err_ratio=0.4).ok
    assert not check_runner(lambda x, w, b: -good(x, w, b), key, inputs, ref, err_ratio=10).ok
    assert not check_runner(nan_one, key, inputs, ref, err_ratio=10).ok


def test_check_calls_with_noncontiguous_batched_x():
    key = KEYS[1]
    inputs = make_inputs(key, CPU, sets=1, seed=2)[0]
    ref = reference(key, *inputs)

    def contiguous_only(x, w, b):
        if not x.is_contiguous() or x.dim() != 2:
            return torch.zeros(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, b)

    res = check_runner(contiguous_only, key, inputs, ref)
    assert not res.ok and "non-contiguous" in res.reason


# ---- search -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("search", ["fast", "exhaustive"])
def test_a_winner_wrong_on_another_call_form_never_wins(search, fake, monkeypatch):
    """The fast search gives every candidate only the plain call before timing: the fastest one here
    is wrong on padded rows, so the full check of the would-be winner must reject it and the next
    finalist wins; the exhaustive search rejects it up front. Both end with the same winner."""
    import fake_backend  # noqa: F401

    monkeypatch.setenv("FAKE_KINDS", "strided,slowgood")
    slow_default(monkeypatch, seconds=0.01)
    res = tune_shape(KEYS[1], CPU, TuneOptions(reps=7, screen_reps=5, search=search))
    by = {c.name: c for c in res.candidates}
    assert by["fake:strided"].status == "rejected" and "non-contiguous" in by["fake:strided"].reason
    assert res.winner.name == "fake:slowgood" and not res.kept_default
    assert {"check", "screen", "final", "confirm"} <= set(res.phases)  # where the time went, per phase
    if search == "fast":  # timed before it was rejected: it was the would-be winner
        assert by["fake:strided"].us == by["fake:strided"].us  # not NaN


def test_a_spent_budget_skips_the_checks_and_keeps_the_default(fake, monkeypatch):
    import fake_backend  # noqa: F401

    monkeypatch.setenv("FAKE_KINDS", "slowgood,strided")
    res = tune_shape(KEYS[1], CPU, TuneOptions(budget_s=1e-9))  # spent before the first check
    by = {c.name: c for c in res.candidates}
    assert {by[n].status for n in ("fake:slowgood", "fake:strided")} == {"skipped"}
    assert "over the 1e-09 s budget" in by["fake:slowgood"].reason and res.kept_default


class _TileStub:
    """A backend that compiles ahead: three configs per key, one kernel per config name (M, bias do not matter)."""

    def candidates(self, key, device):
        from gemmtune.backends.base import Solution

        return [Solution("tiles", f"t{i}", i) for i in range(3)]

    def supports(self, sol, key, device):
        return True

    def compile_items(self, jobs, scope=None):
        first: dict = {}  # as the real backends: an item names the first job's key of its kernel
        for sol, key in jobs:
            first.setdefault(sol.kernel_name, (sol.kernel_name, key))
        return list(first.values())


class _SkinnyStub(_TileStub):
    """A second such backend: one kernel per key."""

    def candidates(self, key, device):
        from gemmtune.backends.base import Solution

        return [Solution("skinny", f"s{key.M}", 1)]

    def compile_items(self, jobs, scope=None):
        return [(sol.kernel_name, key) for sol, key in jobs]


@pytest.fixture
def one_pool(monkeypatch):
    """Two stub backends (and one that cannot compile ahead) for precompile_all; its pool runs no process,
    it records the items of each pool it was asked to start, and each of its processes' seconds."""
    from gemmtune.backends.lib import triton_tiles
    from gemmtune.tuner import search

    pools = []

    def run_pool(items, device, workers, busy=None):
        pools.append(items)
        if busy is not None:
            busy += [float(len(items[i::workers])) for i in range(min(workers, len(items)))]
        return [("t0", KEYS[0], "did not compile")] if items else []

    monkeypatch.setattr(triton_tiles, "compile_all", run_pool)
    chosen = {"tiles": _TileStub(), "skinny": _SkinnyStub(), "none": object()}
    monkeypatch.setattr(search, "select_backends", lambda device, libtypes, family: chosen)
    return pools


def test_precompile_all_compiles_every_backends_kernels_in_one_pool(one_pool):
    from gemmtune.tuner import search

    timings = search.PrecompileTimings()
    fails = search.precompile_all(KEYS[:2], CPU, TuneOptions(), workers=3, timings=timings)
    assert len(one_pool) == 1 and len(fails) == 1  # one pool for both backends; "none" is passed over
    items = one_pool[0]
    built = sorted((item.name, item.backend.__name__) for item in items)
    assert built == [("s1", "_SkinnyStub"), ("s5", "_SkinnyStub"), ("t0", "_TileStub"), ("t1", "_TileStub"),
                     ("t2", "_TileStub")]  # fmt: skip
    assert timings.jobs == {"tiles": 6, "skinny": 2} and timings.kernels == {"tiles": 3, "skinny": 2}
    assert timings.processes == 3 and timings.seconds >= 0  # 5 kernel names over 3 processes
    assert sorted(timings.busy) == [1.0, 2.0, 2.0]  # each process's seconds, kept


def test_a_hosts_ranks_share_one_plan_over_every_backend(one_pool):
    from gemmtune.tuner import search

    for share in ((0, 2), (1, 2)):
        search.precompile_all(KEYS[:2], CPU, TuneOptions(), workers=4, share=share)
    parts = [{item.name for item in items} for items in one_pool]
    assert len(one_pool) == 2 and not parts[0] & parts[1]  # each kernel compiled by one rank of the host
    assert parts[0] | parts[1] == {"s1", "s5", "t0", "t1", "t2"}


def test_a_backend_that_takes_the_scope_gets_it_and_may_name_each_items_builder(one_pool, monkeypatch):
    """compile_items(jobs, scope): the tune's options and each key's M floor (the range verification's
    keys); an item (name, key, builder) is built by that class, the others by their backend's."""
    from gemmtune.tuner import search

    got = []

    class Builder:
        def build_item(self, name, key, device):
            pass

    class Scoped(_TileStub):
        def compile_items(self, jobs, scope):
            got.append(scope)
            return [("b0", jobs[0][1], Builder), ("plain", jobs[0][1])]

    monkeypatch.setattr(search, "select_backends", lambda device, libtypes, family: {"tiles": _TileStub(),
                                                                                     "scoped": Scoped()})  # fmt: skip
    big = KEYS[0]._replace(M=64)
    search.precompile_all([KEYS[0], big], CPU, FAST, workers=2, floors={big: 2})
    scope = got[0]  # once for every key's jobs, then once per key (which key needs each kernel first)
    assert len(got) == 3 and all(s is scope for s in got)
    assert scope.opts is FAST and scope.family.name == "a16w16"
    assert [k.M for k in scope.range_keys(big)] == search.range_points(2, 64) == [62, 41, 27, 18, 12, 8, 5, 3, 2]
    assert scope.range_keys(KEYS[0]) == []  # no floor: its own M alone
    assert search.CompileScope(scope.family, CPU, TuneOptions(verify_range=False), {big: 2}).range_keys(big) == []
    assert search.CompileScope(scope.family, CPU, FAST, {big: 64}).range_keys(big) == []
    assert scope.default(big) == backends.default("a16w16", big, CPU)[1]
    built = {item.name: item.backend for item in one_pool[0]}
    assert built["b0"] is Builder and built["plain"] is Scoped and built["t0"] is _TileStub  # the others: as before


def test_each_kernel_is_ranked_by_the_first_key_whose_candidates_need_it(one_pool, monkeypatch):
    from gemmtune.tuner import search

    class PerM(_TileStub):
        """Configs by M: t0 for every key, t<M> for that M only."""

        def candidates(self, key, device):
            from gemmtune.backends.base import Solution

            return [Solution("tiles", "t0", 0), Solution("tiles", f"t{key.M}", key.M)]

    monkeypatch.setattr(search, "select_backends", lambda device, libtypes, family: {"tiles": PerM()})
    keys = [KEYS[0]._replace(M=64), KEYS[0], KEYS[0]._replace(M=16)]
    ranked = search.ahead_items(keys, CPU, FAST)
    assert [(i, it.name) for i, it in ranked] == [(0, "t0"), (0, "t64"), (1, "t1"), (2, "t16")]


def test_describe_timings_gives_each_backends_jobs_and_the_pools_time():
    from gemmtune.tuner.search import PrecompileTimings, describe_timings

    spent = PrecompileTimings({"triton": 4184, "skinny": 718}, {"triton": 812, "skinny": 718}, 16, 19.24)
    assert describe_timings(spent) == (
        "triton 4184 jobs (812 kernels), skinny 718 jobs (718 kernels): 1 pool of 16 processes, 19.2 s"
    )
    spent.busy = [17.04, 13.0, 15.2]
    assert describe_timings(spent).endswith("19.2 s (busiest 17.0 s, mean 15.1 s)")
    spent.processes = 0  # another rank of the host compiles all of them
    assert describe_timings(spent).endswith(": nothing to compile here")
    assert describe_timings(PrecompileTimings()) == "nothing to compile"


def test_a_pool_process_builds_each_item_with_its_own_backend():
    from gemmtune.backends.lib import triton_tiles

    built = []

    def recording(tag):
        class Recorder:
            def solution_from_row(self, solidx, name, splitk):
                return name

            def make_runner(self, sol, key, device):
                built.append((tag, sol))
                if sol == "bad":
                    raise ValueError("no such config")

        return Recorder

    a, b = recording("a"), recording("b")
    items = [triton_tiles.CompileItem(n, KEYS[0], cls) for n, cls in (("x", a), ("y", b), ("bad", a))]
    done = [triton_tiles._compile_one((i, item, "cpu")) for i, item in enumerate(items)]
    assert sorted(built) == [("a", "bad"), ("a", "x"), ("b", "y")]
    failed = [f for _, fails, _, _ in done for f in fails]
    assert [(name, err) for name, _, err in failed] == [("bad", "ValueError: no such config")]
    assert [number for number, *_ in done] == [0, 1, 2] and all(seconds >= 0 for _, _, seconds, _ in done)


class _Calls:
    """tune_items' collaborators, recording the order they are called in: no process is started."""

    def __init__(self, monkeypatch):
        from gemmtune.tuner import runner

        self.order = []
        self.stopped = []
        monkeypatch.setattr(runner, "start_workers", self.start)
        monkeypatch.setattr(runner, "stop_workers", self.stopped.append)
        monkeypatch.setattr(runner, "compile_ahead_keys", self.compile_ahead)
        monkeypatch.setattr(runner, "run_workers", self.run)

    def start(self, device, opts, n, verbose):
        self.order.append("start workers")
        return ["worker"]

    def compile_ahead(self, keys, fam, device, opts, workers, floors=None):
        self.order.append("compile in the background")
        return _Ahead(self.order)

    def run(self, keys, *args, workers, **kwargs):
        self.order.append(f"tune with {workers}")
        return iter(keys)


class _Ahead:
    """A background compile that records each key it hands on and its join."""

    def __init__(self, order):
        from gemmtune.tuner.search import PrecompileTimings

        self.order, self.timings, self.error, self.waited = order, PrecompileTimings(), None, 0.0

    def gated(self, keys, log):
        for key in keys:
            self.order.append(f"kernels of M={key.M} built")
            yield key

    def join(self):
        self.order.append("compile joined")
        return []


def test_the_worker_starts_first_then_the_compile_and_each_key_waits_for_its_kernels(monkeypatch):
    from gemmtune import families
    from gemmtune.tuner.runner import tune_items

    calls = _Calls(monkeypatch)
    logged = []
    items = tune_items(KEYS[:2], {}, families.get("a16w16"), torch.device("cuda"), FAST, 1, 60.0, print, False,
                       True, logged.append)  # fmt: skip
    assert calls.order == ["start workers", "compile in the background", "tune with ['worker']"]
    assert list(items) == KEYS[:2]
    assert calls.order[3:] == [f"kernels of M={KEYS[0].M} built", f"kernels of M={KEYS[1].M} built", "compile joined"]
    assert "precompiled kernels beside the tune" in logged[0]


def test_a_fleets_host_compile_runs_in_place_of_the_own_one(monkeypatch):
    from gemmtune import families
    from gemmtune.tuner.runner import tune_items

    calls = _Calls(monkeypatch)
    fam = families.get("a16w16")

    def host():
        calls.order.append("host compile")
        return _Ahead(calls.order)

    list(tune_items(KEYS[:2], {}, fam, torch.device("cuda"), FAST, 1, 60.0, print, False, False, print,
                    prepare=host))  # fmt: skip
    assert calls.order[:3] == ["start workers", "host compile", "tune with ['worker']"]
    calls.order.clear()
    assert list(tune_items([], {}, fam, CPU, FAST, 1, 60.0, print, False, False, print, prepare=host)) == []
    assert calls.order == ["host compile", "compile joined"]  # a rank without keys compiles its part, no worker


def test_a_failed_precompile_stops_the_started_workers(monkeypatch):
    from gemmtune import families
    from gemmtune.tuner.runner import tune_items

    calls = _Calls(monkeypatch)

    def host():
        raise RuntimeError("rank 1: barrier timed out")

    with pytest.raises(RuntimeError, match="barrier"):
        tune_items(KEYS[:2], {}, families.get("a16w16"), CPU, FAST, 1, 60.0, print, False, False, print,
                   prepare=host)  # fmt: skip
    assert calls.stopped == [["worker"]]


def test_an_items_builder_builds_it_by_its_name():
    from gemmtune.backends.lib import triton_tiles

    built = []

    class Builder:
        def build_item(self, name, key, device):
            if name == "bad":
                raise ValueError("no such item")
            built.append((name, key, device.type))

    assert triton_tiles._precompile_worker((Builder, ["x", "bad"], [KEYS[0], KEYS[1]], "cpu")) == [
        ("bad", KEYS[1], "ValueError: no such item")
    ]
    assert built == [("x", KEYS[0], "cpu")]  # as named: no stand-in of its own, no runner


def test_a_first_call_precompile_runs_a_narrow_stand_in_of_each_key():
    from gemmtune.backends.lib import triton_tiles

    seen = []

    class FirstCall:
        compiles_on_first_call = True

        def solution_from_row(self, solidx, name, splitk):
            return name

        def make_runner(self, sol, key, device):
            seen.append(key)
            return lambda x, w, b: seen.append(tuple(w.shape))

    wide = GemmKey(M=4, N=128256, K=64)
    odd = GemmKey(M=4, N=1000, K=64)
    assert triton_tiles._precompile_worker((FirstCall, ["a", "b"], [wide, odd], "cpu")) == []
    # N specializes only as twin(N) does (a multiple of 16, or not): the same kernels, a 16 x K weight
    assert seen == [wide._replace(N=16), (16, 64), odd._replace(N=17), (17, 64)]
    assert triton_tiles.compile_stand_in(GemmKey(M=1, N=8, K=64)).N == 8


def test_unknown_search_is_refused():
    with pytest.raises(ValueError, match=r"search must be one of fast, exhaustive, got 'quick'"):
        tune_shape(KEYS[0], CPU, TuneOptions(search="quick"))


def test_bad_candidates_are_rejected_and_reported(fake, tmp_path):
    import fake_backend  # noqa: F401 - registers "fake"

    res = tune_shape(KEYS[0], CPU, FAST)
    by = {c.name: c for c in res.candidates}
    assert by["fake:good"].status == "ok"
    assert by["fake:wrong"].status == "rejected" and "rel_err" in by["fake:wrong"].reason
    assert by["fake:raises"].status == "failed" and "fake kernel raised" in by["fake:raises"].reason
    assert by["fake:oom"].status == "failed" and by["fake:oom"].reason == "out of memory"
    assert by["fake:partial"].status == "rejected"
    assert res.winner.name in ("torch:native", "fake:good")
    # ...and the same reported through the CLI: summary and profile file.
    shapes = write_shapes(tmp_path / "s.csv", KEYS[:2])
    out, prof = tmp_path / "t.csv", tmp_path / "p.csv"
    r = CliRunner().invoke(cli, ["tune", shapes, "-o", str(out), "--profile-file", str(prof), "--no-progress",
                                 "--reps", "5"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "rejected" in r.output and "fake:wrong" in r.output and "out of memory" in r.output
    profile = prof.read_text()
    assert profile.count("fake,wrong") == 2 and "fake kernel raised" in profile
    rows = read_table_file(str(out)).rows
    assert {r.libtype for r in rows} <= {"torch", "fake"} and len(rows) == 2


def test_default_kept_unless_beaten_by_min_gain(fake, monkeypatch):
    import fake_backend  # noqa: F401

    monkeypatch.setenv("FAKE_KINDS", "good")
    key = GemmKey(4, 64, 64, False, torch.float32, torch.float32)
    # "good" is F.linear plus a no-op cast: no real gain, so the default must stay.
    res = tune_shape(key, CPU, TuneOptions(reps=9, min_gain=0.5))
    assert res.kept_default and res.winner.name == "torch:native" and res.us == res.default_us
    assert res.speedup == 1.0

    # Make the default slow: now the candidate wins by far more than min-gain and noise.
    real = TorchBackend.make_runner

    clock = VirtualClock()
    monkeypatch.setattr(timing, "CPU_CLOCK", clock)

    def slow_default(self, sol, k, dev):
        run = real(self, sol, k, dev)

        def slow(x, w, b):
            clock.sleep(0.002)
            return run(x, w, b)

        return slow

    monkeypatch.setattr(TorchBackend, "make_runner", slow_default)
    res = tune_shape(key, CPU, TuneOptions(reps=9, min_gain=0.03))
    assert not res.kept_default and res.winner.name == "fake:good"
    assert res.speedup > 1.5 and res.default_us >= 2000


def test_libtype_restriction_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    shapes = write_shapes(tmp_path / "s.csv", KEYS[:1])
    out = tmp_path / "t.csv"
    r = CliRunner().invoke(cli, ["tune", shapes, "-o", str(out), "--libtype", "nope", "--no-progress"])
    assert r.exit_code != 0 and "unknown backend(s) nope" in r.output and "torch" in r.output
    if backends.get("triton") is not None:
        r = CliRunner().invoke(cli, ["tune", shapes, "-o", str(out), "--libtype", "triton", "--no-progress"])
        assert r.exit_code != 0 and "not available on cpu" in r.output
    assert not out.exists()


# ---- the driver -------------------------------------------------------------------------------------
def test_tune_end_to_end_writes_honest_rows_and_resumes(tmp_path):
    shapes = write_shapes(tmp_path / "s.csv", KEYS)
    out = tmp_path / "t.csv"
    rep = tune_file(shapes, str(out), FAST, CPU, progress=False, log=lambda m: None)
    assert len(rep.results) == len(KEYS) and not rep.failures
    tf = read_table_file(str(out))
    cols, rows = tf.columns, tf.rows
    assert cols[:3] == ["gfx", "cu_num", "M"]
    assert [r.key for r in rows] == KEYS
    for r in rows:
        assert r.gfx == "cpu" and r.libtype == "torch" and r.us > 0
        tf, bw = throughput(r.key, r.us)
        assert math.isclose(r.tflops, tf, abs_tol=0.01) and math.isclose(r.bw, bw, abs_tol=0.01)
    lines = summary_lines(rep, str(out))
    assert any("torch:native" in ln for ln in lines) and any("geomean speedup" in ln for ln in lines)
    # A rerun skips what is there; --all retunes (same keys, new timings).
    rep2 = tune_file(shapes, str(out), FAST, CPU, progress=False, log=lambda m: None)
    assert rep2.skipped == len(KEYS) and not rep2.results
    rep3 = tune_file(shapes, str(out), FAST, CPU, all_shapes=True, progress=False, log=lambda m: None)
    assert len(rep3.results) == len(KEYS)
    assert [r.key for r in read_table_file(str(out)).rows] == KEYS


def _cli(*args, env=None):
    cmd = [sys.executable, "-m", "gemmtune.cli.main", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_kill_and_resume_loses_no_finished_row(tmp_path):
    shapes = write_shapes(tmp_path / "s.csv", KEYS)
    out = tmp_path / "t.csv"
    p = _cli("tune", shapes, "-o", str(out), "--no-progress", "--reps", "5", env={EXIT_AFTER_ENV: "2"})
    assert p.returncode == 17, p.stderr  # killed by the hook right after the 2nd row
    first = read_table_file(str(out)).rows
    assert [r.key for r in first] == KEYS[:2]
    p = _cli("tune", shapes, "-o", str(out), "--no-progress", "--reps", "5")
    assert p.returncode == 0, p.stderr
    assert "2 of 4 shapes already tuned" in p.stderr
    rows = read_table_file(str(out)).rows
    assert [r.key for r in rows] == KEYS
    assert [r.us for r in rows[:2]] == [r.us for r in first]  # finished rows were kept as they were
    assert not list(tmp_path.glob(".gemmtune-*"))  # no temp files left behind


@pytest.mark.slow
def test_crashing_and_hanging_candidates_in_workers_do_not_stop_the_run(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_KINDS", "good,crash,hang,wrong")
    keys = KEYS[:2]
    shapes = write_shapes(tmp_path / "s.csv", keys)
    out, prof = tmp_path / "t.csv", tmp_path / "p.csv"
    logs = []
    rep = tune_file(shapes, str(out), FAST, CPU, mp_workers=2, timeout=3, profile_file=str(prof), progress=False,
                    log=logs.append)  # fmt: skip
    assert not rep.failures, rep.failures
    assert {r.key for r in read_table_file(str(out)).rows} == set(keys)  # workers finish in any order
    for res in rep.results:
        by = {c.name: c for c in res.candidates}
        assert by["fake:crash"].status == "crashed" and "exited with code 9" in by["fake:crash"].reason
        assert by["fake:hang"].status == "timeout"
        assert by["fake:wrong"].status == "rejected" and by["fake:good"].status == "ok"
    text = prof.read_text()
    assert text.count(",crashed,") == 2 and text.count(",timeout,") == 2
    assert any("died on fake:crash" in m for m in logs)


# ---- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "msg"),
    [
        ("M,N\n1,2\n", "missing column(s) K"),
        ("M,N,K\n1,2,3\n4,x,5\n", ":3: column 'N'"),
        ("M,N,K\n1,2,3\n0,2,3\n", ":3: column 'M'"),
        ("M,N,K\n1,2,-3\n", ":2: column 'K'"),
        ("M,N,K\n1,2\n", ":2: column 'K' is missing"),
        ("M,N,K,dtype\n1,2,3,int4\n", "unknown dtype"),
    ],
)
def test_malformed_shapes_file_names_file_and_line_and_writes_nothing(tmp_path, body, msg):
    bad = tmp_path / "bad.csv"
    bad.write_text(body)
    out, prof = tmp_path / "t.csv", tmp_path / "p.csv"
    r = CliRunner().invoke(cli, ["tune", str(bad), "-o", str(out), "--profile-file", str(prof), "--no-progress"])
    assert r.exit_code != 0
    assert str(bad) in r.output and msg in r.output, r.output
    assert not out.exists() and not prof.exists()


def test_malformed_existing_output_is_an_error_not_overwritten(tmp_path):
    shapes = write_shapes(tmp_path / "s.csv", KEYS[:1])
    out = tmp_path / "t.csv"
    out.write_text("not,a,table\n1,2,3\n")
    r = CliRunner().invoke(cli, ["tune", shapes, "-o", str(out), "--no-progress"])
    assert r.exit_code == 2 and "not a tuned table" in r.output and "not,a,table" in r.output  # configs/files.py
    assert out.read_text() == "not,a,table\n1,2,3\n"


def test_close_calls_get_a_second_round_and_clear_ones_do_not():
    """Step 5: a gain near --min-gain, or a runner-up near the best, is timed again (both modes)."""
    from gemmtune.tuner.search import OK, CandidateResult, _close_call, _Pool

    def pool_of(times):
        pool = _Pool()
        for name, us in times.items():
            pool.results[name] = CandidateResult("triton", name, 0, 1, status=OK, us=us)
        return pool

    opts = TuneOptions(min_gain=0.03)
    default = CandidateResult("torch", "native", 0, 1, status=OK, us=100.0)
    clear_win = pool_of({"a": 80.0, "b": 90.0})
    assert _close_call(clear_win, ["a", "b"], default, 0.0, opts) == []
    clear_loss = pool_of({"a": 99.5})
    assert _close_call(clear_loss, ["a"], default, 0.0, opts) == []
    near_line = pool_of({"a": 97.5, "b": 105.0})  # gain 2.6%: within MARGIN of 3%
    assert _close_call(near_line, ["a", "b"], default, 0.0, opts) == ["a"]
    assert _close_call(near_line, ["a", "b"], default, 0.06, opts) == []  # the noise moved the line to 6%
    near_pair = pool_of({"b": 81.0, "a": 80.0, "c": 95.0})
    assert _close_call(near_pair, ["b", "a", "c"], default, 0.0, opts) == ["a", "b"]
    near_pair.results["a"].status = "rejected"
    assert _close_call(near_pair, ["b", "a", "c"], default, 0.0, opts) == []


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7])
def test_round_order_balances_positions_and_predecessors(n):
    """Over one cycle of rounds every contender runs once per position (twice for odd n) and right
    after every other contender equally often: no contender is always timed after the same kernel."""
    from collections import Counter

    from gemmtune.tuner.timing import round_order

    rows = n if n % 2 == 0 else 2 * n
    orders = [round_order(n, r) for r in range(rows)]
    assert all(sorted(o) == list(range(n)) for o in orders)
    positions = Counter((i, x) for o in orders for i, x in enumerate(o))
    follows = Counter(pair for o in orders for pair in zip(o, o[1:]))
    assert set(positions.values()) == {rows // n} and len(positions) == n * n
    assert set(follows.values()) == {rows // n} and len(follows) == n * (n - 1)
    assert round_order(n, rows) == orders[0]  # the cycle repeats


def _with_timings(monkeypatch, adjust):
    """Wrap search.time_group so `adjust(phase, times)` can change what a phase measured."""
    from gemmtune.tuner import search

    real = search.time_group

    def timed(key, runners, device, reps, seed, inputs, heartbeat, phase, fam, tails=None):
        return adjust(phase, real(key, runners, device, reps, seed, inputs, heartbeat, phase, fam, tails))

    monkeypatch.setattr(search, "time_group", timed)


def test_a_winner_that_loses_head_to_head_is_not_kept(fake, monkeypatch):
    """The final round's winner is timed once more against the default alone; when that run does
    not confirm its gain, the default is kept and the note says why."""
    import fake_backend  # noqa: F401

    monkeypatch.setenv("FAKE_KINDS", "slowgood")
    slow_default(monkeypatch, seconds=0.01)
    phases, lose = [], [True]

    def adjust(phase, times):
        phases.append(phase)
        if phase == "head-to-head" and lose[0]:
            return {n: (us * 10 if n == "fake:slowgood" else us) for n, us in times.items()}
        return times

    _with_timings(monkeypatch, adjust)
    res = tune_shape(KEYS[1], CPU, TuneOptions(reps=7, screen_reps=5))
    assert "head-to-head" in phases
    assert res.kept_default and res.winner.name == "torch:native"
    assert "against the default alone: default kept" in res.note

    lose[0] = False  # the head-to-head confirms: the clear winner stays
    res = tune_shape(KEYS[1], CPU, TuneOptions(reps=7, screen_reps=5))
    assert not res.kept_default and res.winner.name == "fake:slowgood"


def test_screen_ranks_candidates_relative_to_the_default_in_their_group(fake, monkeypatch, virtual_clock):
    """Screen groups are separate runs; a run that measured everything far slower must not push its
    candidates behind a truly slow one: each group also times the default and is scaled by it."""
    import fake_backend  # noqa: F401

    from gemmtune.tuner.search import ANCHOR

    monkeypatch.setenv("FAKE_KINDS", "slowgood,g1,good,g2,g3,g4")  # groups of 2: good apart from slowgood
    groups = []

    def adjust(phase, times):
        if phase == "screen":
            assert ANCHOR in times  # every group carries the anchor
            groups.append(set(times) - {ANCHOR})
            if "fake:good" in times:  # this whole run measured 1000x slow, the anchor too
                return {n: us * 1000 for n, us in times.items()}
        return times

    _with_timings(monkeypatch, adjust)
    res = tune_shape(KEYS[1], CPU, TuneOptions(reps=5, screen_reps=5, top=3, batch=3))
    assert len(groups) >= 2 and all(ANCHOR not in g for g in groups)
    by = {c.name: c for c in res.candidates}
    assert by["fake:slowgood"].screen_us > max(by[n].screen_us for n in ("fake:good", "fake:g1", "fake:g2"))
    assert "fake:slowgood" not in {c.name for c in res.candidates if c.us == c.us}  # not a finalist
