"""Online tuning in the background: a miss is served by the default at once and its key is tuned by a
background thread that hands it to a worker process (tuner/workers.py: a crash or hang in a candidate
ends that process, never the server), so the serving thread never waits on timing.

The flow of one key:
1. the miss hook enqueues it (duplicates ignored; at most `max_queue` waiting) and returns False: the
   default serves and is cached, as for any untuned key;
2. one of `jobs` threads (one by default: the bound on concurrent background work) tunes it in the
   device's tuning worker (online_worker.py: one process per device, started at the first key and fed
   every later one, one at a time), with the search's own noise guards (each screen group anchored on the default,
   the final run timing the default twice interleaved with the finalists and re-measuring while the two
   disagree: search.quietest), which a GPU that is also serving needs;
3. the thread writes the row to the table file under its lock and parks it as finished, then empties
   the family's runner cache (dict.clear, atomic under the GIL: a call in flight keeps the runner it
   already fetched), so the key's next call misses;
4. that miss, in the serving thread and outside a CUDA graph capture or torch.compile trace, adopts every
   finished row into the tables in effect and resolves to its row. A miss inside a capture adopts
   nothing (building a tuned runner may compile or allocate, which a capture must not record): the
   default serves, and the row is adopted at the next miss outside a capture, or at adopt().

Rows enter the dispatcher's tables only in a serving thread; the background threads touch nothing the
hot path reads but the runner caches they empty. Under torch.distributed, steps 3-4 wait for
sync_online_rows, where every rank adopts the same rows at once (online_distributed.py).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from .. import child_process
from ..configs.schema import TunedRow
from ..device import identity
from ..dispatch import get_dispatcher
from ..families import Family
from . import online_common
from .candidates import TuneOptions
from .online_worker import DeviceWorker
from .output import result_row
from .search import ShapeResult

log = logging.getLogger("gemmtune")
DEFAULT_JOBS = 1
DEFAULT_MAX_QUEUE = 256


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"gemmtune.BackgroundTuner: {name} must be a positive int, got {value!r}")
    return value


class BackgroundTuner:
    """Tunes missed keys into `path` (per family) in the background, `jobs` at a time."""

    mode = "background"

    def __init__(self, path: str, budget_s: float = online_common.DEFAULT_BUDGET_S, libtypes: list[str] | None = None,
                 jobs: int = DEFAULT_JOBS, max_queue: int = DEFAULT_MAX_QUEUE,
                 tune: Callable[..., ShapeResult] | None = None):  # fmt: skip
        self.settings = online_common.OnlineSettings(path, budget_s, libtypes)
        self.jobs = _positive_int("jobs", jobs)
        self.max_queue = _positive_int("max_queue", max_queue)
        self._tune = tune or self._tune_in_worker
        self._device_workers: dict[str, DeviceWorker] = {}  # str(device) -> its tuning worker
        self._cond = threading.Condition()
        self.waiting: collections.deque = collections.deque()  # (key, family, device, dispatcher), not started
        self.running: list[tuple] = []  # at most `jobs`
        self._seen: set[tuple] = set()  # (family name, key, device) ever queued: a key is tuned once
        self._finished: list[tuple[TunedRow, Family]] = []  # tuned, written, not yet in the tables in effect
        self.tuned: list[tuple] = []  # keys whose rows were written
        self.failed: list[tuple] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        _tuners.add(self)
        # Under torch.distributed rows are adopted only at sync_online_rows (online_distributed.py), by
        # every rank at once: misses are kept here to be shared there, and tuned by one rank.
        self.lockstep = False
        self._to_share: list[tuple] = []  # (family name, key, device type) missed since the last sync
        self._shared: set[tuple] = set()

    @property
    def path(self) -> str:
        return self.settings.path

    # ---- the serving thread ---------------------------------------------------------------------
    def on_miss(self, key, family: Family, device: torch.device, dispatcher) -> bool:
        """Adopt finished rows when that is safe (True when `key` is now answered), else queue `key`."""
        if self.lockstep or online_common.distributed():
            self.lockstep = True
            with self._cond:
                tag = (family.name, key, device.type)
                if tag not in self._shared:
                    self._shared.add(tag)
                    self._to_share.append(tag)
            return False
        if self._finished and online_common.safe_point(device):
            self.adopt(dispatcher)
            if dispatcher.table(family.name).lookup(key, identity(device)) is not None:
                return True
        self.enqueue(key, family, device, dispatcher)
        return False

    def adopt(self, dispatcher=None) -> list[TunedRow]:
        """Put the finished rows in the tables in effect and empty their families' runner caches, so
        every key they answer resolves anew. Call it outside a CUDA graph capture (misses outside one do)."""
        dispatcher = dispatcher or get_dispatcher()
        with self._cond:
            rows, self._finished = self._finished, []
        for row, family in rows:
            dispatcher.table(family.name).add(row)
        for name in {family.name for _, family in rows}:
            dispatcher.forget_runners(name)
        return [row for row, _ in rows]

    def take_to_share(self) -> tuple[list[tuple], list[tuple[TunedRow, Family]]]:
        """The keys missed and the rows finished since the last call (sync_online_rows shares them)."""
        with self._cond:
            missed, self._to_share = self._to_share, []
            rows, self._finished = self._finished, []
        return missed, rows

    def enqueue(self, key, family: Family, device: torch.device, dispatcher) -> bool:
        """Queue `key` for the background (False: already queued or tuned, or the queue is full)."""
        tag = (family.name, key, device)
        with self._cond:
            if tag in self._seen or self._closed:
                return False
            if len(self.waiting) >= self.max_queue:
                log.warning("gemmtune: online tuning queue full (%d keys): %s not queued, the default serves it",
                            self.max_queue, family.describe(key))  # fmt: skip
                return False
            self._seen.add(tag)
            self.waiting.append((key, family, device, dispatcher))
            self._start_threads()
            self._cond.notify()
        log.info("gemmtune: queued %s for online tuning (%d waiting)", family.describe(key), len(self.waiting))
        return True

    # ---- the background threads -----------------------------------------------------------------
    def _start_threads(self) -> None:
        """Start threads up to `jobs` for the keys waiting (the condition is held)."""
        while len(self._threads) < min(self.jobs, len(self.waiting) + len(self.running)) and not self._closed:
            t = threading.Thread(target=self._work, name=f"gemmtune-online-{len(self._threads)}", daemon=True)
            self._threads.append(t)
            t.start()

    def _after_fork_in_child(self) -> None:
        """A forked child has none of the parent's threads, and its locks may be held by them: it starts
        clean, and the keys the parent was tuning wait here again, so this process gets their rows too
        (its runner caches hold the default for them: it never misses them again)."""
        self._cond = threading.Condition()
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self._threads = []
        self._device_workers = {}  # the parent's: this process starts its own

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self.waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = self.waiting.popleft()
                self.running.append(item)
            try:
                self._tune_one(*item)
            finally:
                with self._cond:
                    self.running.remove(item)
                    self._cond.notify_all()

    def _tune_one(self, key, family: Family, device: torch.device, dispatcher) -> None:
        t0 = time.perf_counter()
        opts = TuneOptions(libtypes=self.settings.libtypes, budget_s=self.settings.budget_s)
        path = self.settings.writable_path(family)
        if path is None:  # said once; the default serves the key
            self.failed.append(key)
            return
        try:
            res = self._tune(key, family, device, opts)
            row = result_row(res, identity(device), family)
        except Exception as exc:  # noqa: BLE001 - the server goes on with the default
            self.failed.append(key)
            if child_process.exiting() or self._closed:
                return  # the process is ending, or close() ended the worker: nothing went wrong
            log.warning("gemmtune: online tuning of %s failed (%s: %s); the default serves it",
                        family.describe(key), type(exc).__name__, exc)  # fmt: skip
            return
        if not self.settings.write(family, row):
            self.failed.append(key)
            return
        with self._cond:
            self._finished.append((row, family))
            self.tuned.append(key)
        if not self.lockstep:
            dispatcher.forget_runners(family.name)  # the key's next call misses and adopts the row
        log.warning("gemmtune: tuned %s online in the background in %.1fs: %s -> %s", family.describe(key),
                    time.perf_counter() - t0, online_common.verdict(res), path)  # fmt: skip

    def _tune_in_worker(self, key, family: Family, device: torch.device, opts: TuneOptions) -> ShapeResult:
        with self._cond:
            worker = self._device_workers.get(str(device))
            if worker is None:
                worker = self._device_workers[str(device)] = DeviceWorker(device, opts)
        return worker.tune(key, family)

    # ---- control --------------------------------------------------------------------------------
    def device_workers(self) -> list[DeviceWorker]:
        """The tuning workers started so far, one per device (their pids and start times)."""
        with self._cond:
            return list(self._device_workers.values())

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is waiting or running (True), or `timeout` seconds pass (False). For
        tests, benchmarks and warm-up scripts; a server never needs to call it."""
        with self._cond:
            self._start_threads()  # keys inherited over a fork wait for a thread of this process
            return self._cond.wait_for(lambda: not self.waiting and not self.running, timeout)

    def close(self) -> None:
        """Stop the threads and end the tuning workers; a key in flight and the keys waiting are dropped."""
        with self._cond:
            self._closed = True
            self.waiting.clear()
            self._cond.notify_all()
            workers = list(self._device_workers.values())
        for worker in workers:
            worker.close()


_tuners: weakref.WeakSet[BackgroundTuner] = weakref.WeakSet()


def _reset_tuners_in_fork_child() -> None:
    for tuner in list(_tuners):
        tuner._after_fork_in_child()


os.register_at_fork(after_in_child=_reset_tuners_in_fork_child)
