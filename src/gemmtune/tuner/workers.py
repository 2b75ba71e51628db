"""Tuning in worker processes, so a candidate that crashes or hangs ends a worker, not the run.

One process per GPU (or per CPU worker on a CPU machine), fed one key at a time through a pipe; each is
a fresh interpreter running this module (child_process), never a re-import of the caller's main module.
Before each step (a candidate's check, a timing group) the worker sends a heartbeat naming the
candidates in flight, synchronously, so when the worker dies (segfault, os._exit, a CUDA error that
kills the context) or stays silent longer than `timeout`, the parent knows which candidate did it:
that candidate is recorded as crashed/timeout, the worker is restarted, and the key is tuned again
without it. If several candidates were in flight (a timing group), the key is retried with one
candidate per group, which pins the culprit down on the next failure.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait

import torch

from .. import child_process, settings
from ..plugins import PLUGINS_ENV, import_plugins
from .candidates import CRASHED, TIMEOUT, DeviceLostError, TuneOptions
from .search import tune_shape

MAX_ATTEMPTS = 4  # worker restarts allowed per key before the key is given up
STARTUP_TIMEOUT = 600.0
BAN_AFTER = 2  # a candidate that kills its worker on this many keys is skipped for the rest of the run


@dataclass
class ShapeFailure:
    """A key that could not be tuned at all (no row is written for it)."""

    key: tuple
    reason: str
    family: str = "a16w16"


# ---- messages -------------------------------------------------------------------------------------
@dataclass
class Task:
    idx: int
    key: tuple
    family: str
    exclude: dict[str, tuple[str, str]] = field(default_factory=dict)
    isolate: bool = False
    attempts: int = 0
    m_lo: int | None = None


@dataclass
class Ready:
    wid: int


@dataclass
class Beat:
    idx: int
    names: list[str]
    phase: str


@dataclass
class Log:
    idx: int
    text: str


@dataclass
class Done:
    idx: int
    result: object  # ShapeResult


@dataclass
class Failed:
    idx: int
    reason: str


@dataclass
class Lost:
    idx: int
    reason: str


# ---- the worker process -----------------------------------------------------------------------------
def worker_main(conn, wid: int, device_str: str, opts: TuneOptions, plugins: str, verbose: bool) -> None:
    """The worker process: tune each Task received until None comes."""
    os.environ[PLUGINS_ENV] = plugins
    import_plugins()
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(Ready(wid))
    while True:
        task = conn.recv()
        if task is None:
            return
        i = task.idx
        hb = lambda names, phase, i=i: conn.send(Beat(i, list(names), phase))  # noqa: E731
        say = (lambda msg, i=i: conn.send(Log(i, msg))) if verbose else None
        try:
            hb([], "setup")
            res = tune_shape(task.key, device, opts, task.exclude, hb, task.isolate, log=say, family=task.family,
                             m_lo=task.m_lo)  # fmt: skip
            conn.send(Done(i, res))
        except DeviceLostError as exc:
            conn.send(Lost(i, str(exc)))
            conn.close()
            os._exit(3)
        except Exception as exc:  # noqa: BLE001
            conn.send(Failed(i, f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, wid: int, device: str, opts: TuneOptions, verbose: bool):
        self.wid, self.device = wid, device
        self.proc = child_process.start(f"{__name__}:worker_main", wid, device, opts,
                                        settings.PLUGINS.raw(), verbose)  # fmt: skip
        self.conn = self.proc.conn
        self.ready = False
        self.started = time.monotonic()
        self.start_s: float | None = None  # seconds from its start until it took keys
        self.task: Task | None = None
        self.inflight: tuple[list[str], str] = ([], "")
        self.last_hb = time.monotonic()

    def assign(self, task: Task) -> None:
        self.task = task
        self.last_hb = time.monotonic()
        self.inflight = ([], "start")
        try:
            self.conn.send(task)
        except OSError:  # it died meanwhile: the loss check requeues the key, no candidate blamed
            pass

    def stop(self) -> None:
        self.proc.close()

    def drain(self, log) -> list:
        """Handle every message waiting; return the finished results / failures."""
        out = []
        while True:
            try:
                if not self.conn.poll():
                    break
                msg = self.conn.recv()
            except (EOFError, OSError):
                break
            if isinstance(msg, Ready):
                self.ready = True
                self.start_s = time.monotonic() - self.started
            elif isinstance(msg, Beat):
                self.inflight = (msg.names, msg.phase)
                self.last_hb = time.monotonic()
            elif isinstance(msg, Log):
                log(msg.text)
                self.last_hb = time.monotonic()
            elif isinstance(msg, (Done, Failed)) and self.task is not None:
                t = self.task
                out.append(msg.result if isinstance(msg, Done) else ShapeFailure(t.key, msg.reason, t.family))
                self.task = None
            elif isinstance(msg, Lost):
                log(f"worker {self.wid}: {msg.reason}")
        return out


def worker_devices(device: torch.device, n: int) -> list[str]:
    if device.type == "cuda":
        if device.index is not None and n == 1:  # a given GPU (a torch.distributed rank's own)
            return [str(device)]
        count = torch.cuda.device_count()
        if n > count:
            raise ValueError(f"--mp {n} asks for more workers than GPUs here ({count})")
        return [f"cuda:{i}" for i in range(n)]
    return [device.type] * n


class _Bans:
    """Strikes against candidates that killed workers; banned ones are excluded from later keys."""

    def __init__(self) -> None:
        self.strikes: collections.Counter = collections.Counter()
        self.banned: dict[str, tuple[str, str]] = {}

    def strike(self, name: str, status: str, why: str) -> None:
        self.strikes[name] += 1
        if self.strikes[name] >= BAN_AFTER:
            self.banned[name] = (status, f"{why}; skipped after failing on {BAN_AFTER} shapes")


def _on_worker_loss(w: _Worker, hung: bool, timeout: float, pending, log, bans: _Bans, describe):
    """Record the in-flight candidate(s) as crashed/timed out; requeue the key or give it up."""
    t = w.task
    if t is None:
        return None
    names, phase = w.inflight
    status = TIMEOUT if hung else CRASHED
    why = (f"no progress for {timeout:g}s" if hung else f"worker exited with code {w.proc.exitcode}") + f" ({phase})"
    log(f"{describe(t)}: worker {w.wid} {'hung' if hung else 'died'} on {', '.join(names) or phase}: {why}")
    w.task = None
    exclude, isolate = dict(t.exclude), t.isolate
    if phase == "start":  # lost before it began the key (ended while idle): no candidate to blame
        pass
    elif len(names) == 1 and not names[0].startswith("default"):
        exclude[names[0]] = (status, why)
        bans.strike(names[0], status, why)
    elif len(names) > 1 and not isolate:
        isolate = True  # several in flight: time one at a time to find which
    else:
        return ShapeFailure(t.key, f"worker {'hung' if hung else 'died'} outside any single candidate: {why}",
                            t.family)  # fmt: skip
    if t.attempts + 1 >= MAX_ATTEMPTS:
        return ShapeFailure(t.key, f"gave up after {MAX_ATTEMPTS} worker failures; last: {why}", t.family)
    pending.appendleft(Task(t.idx, t.key, t.family, exclude, isolate, t.attempts + 1, t.m_lo))
    return None


def start_workers(device: torch.device, opts: TuneOptions, n: int, verbose: bool) -> list[_Worker]:
    """Start `n` tuning workers; each imports torch and takes its device, then waits for keys."""
    return [_Worker(i, d, opts, verbose) for i, d in enumerate(worker_devices(device, n))]


def stop_workers(workers: list[_Worker]) -> None:
    """Ask each worker to end, then end any that did not."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        w.proc.join(timeout=2)
        w.stop()


def run_workers(keys, device: torch.device, opts: TuneOptions, n: int, timeout: float, log, verbose: bool,
                family: str | Callable[[tuple], str] = "a16w16", describe=lambda t: str(t.key),
                m_lo: dict | None = None, workers: list[_Worker] | None = None,
                stop: threading.Event | None = None):  # fmt: skip
    """Yield ShapeResult / ShapeFailure for each key, tuned by `n` worker processes (`workers`: already
    started by start_workers, e.g. while the kernels compiled; this generator stops them at its end).
    `family`: the keys' family, or key -> family name for keys of several. `keys` is read only when a
    worker is free, so a caller may feed it key after key to long-lived workers (online_worker.py);
    `stop` set ends the run within a wait, the key in flight dropped."""
    m_lo = m_lo or {}
    family_of = family if callable(family) else (lambda key: family)
    workers = workers if workers is not None else start_workers(device, opts, n, verbose)
    for w in workers:  # the startup timeout counts from here: a precompile may have run beside the start
        w.started = time.monotonic()
    # Keys are taken one at a time, as a worker frees up (a fleet's ranks claim theirs on demand);
    # a key requeued after a worker loss goes first.
    source = enumerate(keys)
    pending: collections.deque[Task] = collections.deque()
    exhausted = False
    bans = _Bans()
    try:
        while not (stop is not None and stop.is_set()):
            for w in workers:
                if not (w.ready and w.task is None and w.proc.is_alive()):  # a dead one is replaced below
                    continue
                if not pending and not exhausted:
                    nxt = next(source, None)
                    exhausted = nxt is None
                    if nxt is not None:
                        pending.append(Task(nxt[0], nxt[1], family_of(nxt[1]), m_lo=m_lo.get(nxt[1])))
                if pending:
                    t = pending.popleft()
                    t.exclude = {**bans.banned, **t.exclude}
                    w.assign(t)
            if exhausted and not pending and all(w.task is None for w in workers):
                return
            wait([w.conn for w in workers] + [w.proc.sentinel for w in workers], timeout=0.5)
            for i, w in enumerate(workers):
                yield from w.drain(log)
                dead = not w.proc.is_alive()
                hung = w.task is not None and time.monotonic() - w.last_hb > timeout
                slow_start = not w.ready and time.monotonic() - w.started > STARTUP_TIMEOUT
                if slow_start or (dead and not w.ready and w.task is None):
                    raise RuntimeError(f"tuning worker {w.wid} on {w.device} did not start "
                                       f"(exit code {w.proc.exitcode})")  # fmt: skip
                if dead or hung:
                    item = _on_worker_loss(w, hung, timeout, pending, log, bans, describe)
                    w.stop()
                    workers[i] = _Worker(w.wid, w.device, opts, verbose)
                    if item is not None:
                        yield item
    finally:
        stop_workers(workers)
