"""tuner/compile_ahead.py: the kernels compile in the background in key order, and a key is handed to the
tune once every kernel up to it is built, on every compile part of its host (a fleet's ranks publish
their progress on a board in the launch's store). The pool is a stub the test releases item by item, so
nothing races: a key that is not ready stays not ready until the test releases what it waits for.
"""

from __future__ import annotations

import pathlib
import queue
import re
import threading

import pytest
import torch

from gemmtune.backends.lib import triton_tiles
from gemmtune.errors import EnvVarError
from gemmtune.keys import GemmKey
from gemmtune.tuner import compile_ahead as C
from gemmtune.tuner.runner import compile_processes, finish_compile
from gemmtune.tuner.search import TuneOptions

CPU = torch.device("cpu")
K0, K1, K2, OTHER = (GemmKey(16, n, 512) for n in (256, 512, 768, 1024))  # four shapes; OTHER is not listed


class _Pools:
    """compile_streaming's stand-in: each pool (named by its first item) builds an item when the test
    releases its number; None makes the pool fail."""

    def __init__(self):
        self.releases: dict[str, queue.Queue] = {}
        self.lock = threading.Lock()

    def queue_of(self, first: str) -> queue.Queue:
        with self.lock:
            return self.releases.setdefault(first, queue.Queue())

    def __call__(self, items, device, workers, on_done):
        q = self.queue_of(items[0].name)
        for _ in items:
            number = q.get(timeout=60)
            if number is None:
                raise RuntimeError("the pool died")
            on_done(number, [], 0.5, 7)

    def release(self, first: str, *numbers) -> None:
        for n in numbers:
            self.queue_of(first).put(n)


def _item(name, key):
    return triton_tiles.CompileItem(name, key, object)


@pytest.fixture
def pools(monkeypatch):
    p = _Pools()
    monkeypatch.setattr(triton_tiles, "compile_streaming", p)
    return p


def _ahead(monkeypatch, items, **kw):
    """A CompileAhead over K0..K2 whose items count toward the first key of their shape (OTHER: key 0)."""
    from gemmtune.tuner.search import first_needing

    index = first_needing([K0, K1, K2], "a16w16")
    ranked = [(index(it.key), it) for it in items]
    monkeypatch.setattr(C, "ahead_items", lambda keys, device, opts, family, floors, timings: ranked)
    return C.CompileAhead([K0, K1, K2], CPU, TuneOptions(), 2, "a16w16", **kw)


def test_a_key_waits_for_its_kernels_and_those_before_it(monkeypatch, pools):
    # as ahead_items orders them: the kernel no listed key owns first, then by first key needing it
    items = [_item("stand-in", OTHER), _item("a0", K0), _item("a1", K0), _item("b", K1)]
    ahead = _ahead(monkeypatch, items).start()
    assert not ahead.ready(K0) and not ahead.ready(K2)
    pools.release("stand-in", 1)
    assert not ahead.ready(K0)  # a1 and the stand-in are still compiling
    pools.release("stand-in", 2, 0)
    ahead.wait_for(K0)
    assert ahead.ready(K0) and not ahead.ready(K1)
    pools.release("stand-in", 3)
    ahead.wait_for(K2)  # K2 needs no kernel of its own: ready with K1
    assert ahead.join() == [] and ahead.timings.busy == [2.0] and ahead.error is None
    assert ahead.ready(GemmKey(3, 3, 3))  # a key the list does not have never waits


def test_gated_hands_keys_on_in_order_as_they_become_ready(monkeypatch, pools):
    ahead = _ahead(monkeypatch, [_item("a", K0), _item("b", K1)]).start()
    handed = ahead.gated([K0, K1, K2])
    pools.release("a", 0)
    assert next(handed) == K0
    pools.release("a", 1)
    assert list(handed) == [K1, K2]
    ahead.join()


class _Store:
    """The launch store's calls a Board makes (a dict; a clone shares it, as a second client would)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode()

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def clone(self):
        return self


def test_a_hosts_parts_each_build_their_share_and_a_key_waits_for_every_part(monkeypatch, pools):
    items = [_item("i0", K0), _item("i1", K0), _item("i2", K1), _item("i3", K1)]
    store = _Store()
    parts = [_ahead(monkeypatch, items, share=(i, 2), board=C.Board(store, "host", 2)) for i in range(2)]
    assert [[it.name for it in p.items] for p in parts] == [["i0", "i2"], ["i1", "i3"]]
    for p in parts:
        p.start()
    pools.release("i0", 0)  # part 0's kernel of K0
    with parts[0]._cond:
        parts[0]._cond.wait_for(lambda: parts[0].done_keys == 1, timeout=60)
    assert not parts[0].ready(K0)  # part 1 has not built its kernel of K0
    pools.release("i1", 0)
    parts[0].wait_for(K0)
    parts[1].wait_for(K0)
    assert not parts[1].ready(K1)
    pools.release("i0", 1)
    pools.release("i1", 1)
    for p in parts:
        p.wait_for(K2)
        p.join()
    assert store.data["host/0"] == store.data["host/1"] == b"3"


def test_a_failed_pool_lets_every_key_through_and_says_so(monkeypatch, pools):
    ahead = _ahead(monkeypatch, [_item("a", K0), _item("b", K1)]).start()
    pools.release("a", None)
    ahead.wait_for(K2)
    logged = []
    finish_compile(ahead, logged.append)
    assert ahead.error == "RuntimeError: the pool died" and "the pool failed (RuntimeError: the pool died)" in logged[0]


def test_a_key_stops_waiting_after_the_limit(monkeypatch, pools):
    monkeypatch.setattr(C, "WAIT_MAX", 0.0)
    ahead = _ahead(monkeypatch, [_item("a", K0)]).start()
    logged = []
    ahead.wait_for(K0, logged.append)
    assert not ahead.ready(K0) and "still compiling" in logged[0]
    monkeypatch.setattr(C, "WAIT_MAX", 3600.0)
    ahead.wait_for(K1, logged.append)  # after one key gave up, none waits (a stuck part holds no key again)
    assert len(logged) == 1
    pools.release("a", 0)
    ahead.join()


def test_a_cancelled_compile_stops_after_the_item_it_is_on(monkeypatch, pools):
    ahead = _ahead(monkeypatch, [_item("a", K0), _item("b", K1), _item("c", K2)]).start()
    pools.release("a", 0)
    ahead.wait_for(K0)
    ahead.cancel()
    pools.release("a", 1)  # the item the pool was on finishes; the third is never asked for (unreleased,
    assert ahead.join() == [] and ahead.error is None  # it would hold the stub pool for its 60 s timeout)
    assert ahead.ready(K2)  # the thread's end releases every key: the tune compiles what is missing


def test_a_tune_that_fails_cancels_the_compile(monkeypatch):
    from gemmtune.tuner import runner

    class Ahead:
        cancelled = joined = False

        def cancel(self):
            self.cancelled = True

        def join(self):
            self.joined = True
            return []

        error, timings, waited = None, C.PrecompileTimings(), 0.0

    def failing():
        yield 1
        raise KeyboardInterrupt

    ahead = Ahead()
    items = runner._tuned_then_finish(failing(), ahead, lambda m: None)
    assert next(items) == 1
    with pytest.raises(KeyboardInterrupt):
        next(items)
    assert ahead.cancelled and ahead.joined
    finished = Ahead()
    assert list(runner._tuned_then_finish(iter([1, 2]), finished, lambda m: None)) == [1, 2]
    assert finished.joined and not finished.cancelled


class _Touch:
    """A builder the real pool runs in its processes: one file a name, so each build is seen once."""

    def build_item(self, name, key, device):
        path = pathlib.Path(name)
        path.write_text(f"{key.M}\n" + (path.read_text() if path.exists() else ""))


def test_an_item_counts_toward_the_first_key_of_its_shape():
    from gemmtune.tuner.search import first_needing

    keys = [K1._replace(M=1024), K0, K1._replace(M=1)]
    index = first_needing(keys, "a16w16")
    assert index(K1._replace(M=16)) == 0  # a stand-in M: the first key of its shape, never a later one
    assert index(K1._replace(M=1)) == 0 and index(K0) == 1
    assert index(OTHER) == 0  # a shape no key has: before every key


@pytest.mark.slow
def test_the_real_pool_builds_every_item_once_in_spawned_processes(tmp_path):
    items = [triton_tiles.CompileItem(str(tmp_path / f"k{i}"), GemmKey(i + 1, 8, 8), _Touch) for i in range(5)]
    seen = []
    triton_tiles.compile_streaming(items, CPU, 2, lambda n, failed, s, pid: seen.append((n, failed)))
    assert sorted(seen) == [(i, []) for i in range(5)]
    assert all((tmp_path / f"k{i}").read_text() == f"{i + 1}\n" for i in range(5))


def test_compile_processes_split_the_hosts_total_over_its_ranks(monkeypatch):
    monkeypatch.delenv("GEMMTUNE_COMPILE_PROCESSES", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 32)
    assert [compile_processes(n) for n in (1, 2, 4, 64)] == [16, 16, 8, 1]
    monkeypatch.setenv("GEMMTUNE_COMPILE_PROCESSES", "28")
    assert [compile_processes(n) for n in (1, 2, 3)] == [28, 14, 9]


@pytest.mark.parametrize("value", ["many", "0", "-3", "2.5"])
def test_a_bad_compile_process_count_is_named(monkeypatch, value):
    monkeypatch.setenv("GEMMTUNE_COMPILE_PROCESSES", value)
    with pytest.raises(EnvVarError, match=rf"GEMMTUNE_COMPILE_PROCESSES='{re.escape(value)}'"):
        compile_processes(2)
