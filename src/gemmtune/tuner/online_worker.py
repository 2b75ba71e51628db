"""The tuning worker of one device for background online tuning: started at its first key (by the
background thread that tunes it, never the serving thread), fed key after key over its pipe, replaced
only when it dies or hangs, ended at close() or at exit.

It is one long run of run_workers (workers.py) fed by `tune`: each call puts one key in the run's key
source and drives the run until that key's result comes out, so the crash and hang handling is the
tune command's (a crashing candidate ends the worker; the key is retried without it, on a fresh
worker) and the worker's start is paid by the first key only.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch

from .. import families
from ..families import Family
from .candidates import TuneOptions
from .search import ShapeResult
from .workers import ShapeFailure, run_workers, start_workers

log = logging.getLogger("gemmtune")
HEARTBEAT_TIMEOUT_S = 60.0  # a worker silent this long (a hung candidate) is replaced, as `gemmtune tune` does


class DeviceWorker:
    """One worker process on `device`, tuning one key at a time with `opts` (the budget is per key)."""

    def __init__(self, device: torch.device, opts: TuneOptions):
        self.device, self.opts = torch.device(device), opts
        self._lock = threading.Lock()  # one key at a time: held while a call drives the run
        self._stop = threading.Event()
        self._keys: collections.deque[tuple] = collections.deque()  # (key, family name), read by the run
        self._families: dict[tuple, str] = {}
        self._run = None  # the run_workers generator, between keys suspended
        self._workers: list = []  # the run's worker list (it replaces a lost worker in place)
        self.pids: list[int] = []  # the worker pid that served each key, in order
        self.start_s: dict[int, float] = {}  # worker pid -> seconds from its start until it took keys

    def tune(self, key, family: Family) -> ShapeResult:
        """Tune `key` in this device's worker (starting it first if none runs); RuntimeError when the
        key could not be tuned or the worker was closed meanwhile."""
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError("the tuning worker is closed")
            if self._run is None:
                self._workers = start_workers(self.device, self.opts, 1, verbose=False)
                self._run = run_workers(self._next_key(), self.device, self.opts, 1,
                                        HEARTBEAT_TIMEOUT_S + self.opts.budget_s, self._say, verbose=False,
                                        family=self._families.__getitem__, describe=self._describe,
                                        workers=self._workers, stop=self._stop)  # fmt: skip
            self._keys.append(key)
            self._families[key] = family.name
            try:
                item = next(self._run)
            except StopIteration:  # close() stopped the run
                self._run = None
                raise RuntimeError("the tuning worker was closed") from None
            except BaseException:  # the run ended (closed, or a worker that cannot start): a new one next time
                self._run = None
                self._keys.clear()
                raise
            finally:
                self._families.pop(key, None)
                self._note_starts()
            if isinstance(item, ShapeFailure):
                raise RuntimeError(item.reason)
            self.pids.append(self._workers[0].proc.pid)
            return item

    def close(self) -> None:
        """End the worker: at once when no key is in flight, else within a wait of the run's loop."""
        self._stop.set()
        if self._lock.acquire(blocking=False):
            try:
                if self._run is not None:
                    self._run.close()  # its finally stops the worker
                    self._run = None
            finally:
                self._lock.release()

    def _next_key(self):
        # The run asks only while a worker is free, which is after `tune` put its key here.
        while True:
            yield self._keys.popleft()

    def _note_starts(self) -> None:
        for w in self._workers:
            if w.start_s is not None and w.proc.pid not in self.start_s:
                self.start_s[w.proc.pid] = w.start_s
                log.info("gemmtune: online tuning: worker %d on %s started in %.1fs", w.proc.pid, w.device, w.start_s)

    def _describe(self, task) -> str:
        return families.get(task.family).describe(task.key)

    @staticmethod
    def _say(msg: str) -> None:
        log.info("gemmtune: online tuning: %s", msg)
