"""The keys' Triton kernels compiled ahead of their tuning, in the background, in the order the keys are
tuned, so the GPU starts on the first key once that key's kernels are built instead of after all of them.

Compiling is CPU work (a pool of spawned processes filling Triton's on-disk cache): 27-33 s for two
models' 110 keys on an H100 host, during which the GPU sat idle (benchmarks/results/h100/fleet_tuning/).
Here the pool takes the kernels one at a time, first key's first (an item goes with the first key in
the list that needs it), and `gated(keys)` hands each key on once every kernel up to it is built;
`wait_for` gives up after WAIT_MAX seconds, and from then on no key waits: the tune compiles what is
missing itself. A tune that stops early (an error, Ctrl-C) cancels the compile instead of waiting for it.

A host's ranks (a fleet) list the same kernels and each compiles every n-th (`share`); each publishes how
far its part has come (the number of keys whose kernels it has all built) on a board in the launch's
store, and a key waits for every part of its host.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from .search import PrecompileTimings, TuneOptions, ahead_items

WAIT_MAX = 600.0  # a key waits at most this long for its kernels (a part that stopped publishing)


class _Cancelled(Exception):
    """Raised in the compile thread to leave the pool (which then terminates its processes)."""


POLL = 0.05


class Board:
    """Each compile part's progress on a host, in the launch's store: part i's count of keys whose kernels
    it has all built. The compile thread writes through a store client of its own."""

    def __init__(self, store, prefix: str, parts: int):
        self.store, self.prefix, self.parts = store, prefix, parts
        try:
            self._writer = store.clone()
        except (AttributeError, NotImplementedError, RuntimeError):  # a store without clone(): share it
            self._writer = store

    def publish(self, part: int, done: int) -> None:
        self._writer.set(f"{self.prefix}/{part}", str(done))

    def progress(self, part: int) -> int:
        key = f"{self.prefix}/{part}"
        return int(self.store.get(key)) if self.store.check([key]) else 0


class CompileAhead:
    """This process's part of compiling `keys`' kernels, started in a thread by start()."""

    def __init__(self, keys: list, device: torch.device, opts: TuneOptions, workers: int, family: str,
                 share: tuple[int, int] = (0, 1), floors: dict | None = None, board: Board | None = None,
                 timings: PrecompileTimings | None = None):  # fmt: skip
        self.keys, self.device, self.workers, self.share, self.board = list(keys), device, workers, share, board
        self.timings = timings if timings is not None else PrecompileTimings()
        self.order = {k: i for i, k in enumerate(self.keys)}
        ranked = ahead_items(self.keys, device, opts, family, floors, self.timings)[share[0] :: share[1]]
        self.items = [item for _, item in ranked]
        self._index = [i for i, _ in ranked]  # each item counts toward the first key that needs it
        self._left = [0] * (len(self.keys) + 1)
        for i in self._index:
            self._left[i] += 1
        self.done_keys = 0  # keys 0..done_keys-1 have all of this part's kernels built
        self.failures: list = []
        self.error: str | None = None
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._per_process: dict[int, float] = {}
        self._cancelled = threading.Event()
        self._gave_up = False  # a key waited WAIT_MAX: the rest go on without waiting
        self.waited = 0.0  # seconds the tune spent waiting for kernels (wait_for)
        with self._cond:
            self._advance()

    # ---- the compile thread -------------------------------------------------------------------
    def start(self) -> CompileAhead:
        self._thread = threading.Thread(target=self._run, name="gemmtune-compile-ahead", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        from ..backends.lib import triton_tiles  # imports Triton, which a CPU-only tuner may lack

        t0 = time.perf_counter()
        try:
            triton_tiles.compile_streaming(self.items, self.device, self.workers, self._item_done)
        except _Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - the tune compiles what is missing itself
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.timings.processes = max(1, min(self.workers, len(self.items))) if self.items else 0
            self.timings.seconds = time.perf_counter() - t0
            self.timings.busy = list(self._per_process.values())
            with self._cond:
                self._left = [0] * len(self._left)
                self._advance()

    def _item_done(self, number: int, failed: list, seconds: float, pid: int) -> None:
        if self._cancelled.is_set():
            raise _Cancelled
        self._per_process[pid] = self._per_process.get(pid, 0.0) + seconds
        with self._cond:
            self.failures += failed
            self._left[self._index[number]] -= 1
            self._advance()

    def _advance(self) -> None:
        """Move done_keys past every key with nothing left to build, publish it and wake the waiters (the
        condition is held, or nothing runs yet)."""
        before = self.done_keys
        while self.done_keys < len(self.keys) and self._left[self.done_keys] == 0:
            self.done_keys += 1
        if self.done_keys != before or before == 0:
            if self.board is not None:
                self.board.publish(self.share[0], self.done_keys)
            self._cond.notify_all()

    # ---- the tune's side ----------------------------------------------------------------------
    def ready(self, key) -> bool:
        """Are all of `key`'s kernels (and those of the keys before it) built, on every part of the host?"""
        i = self.order.get(key)
        if i is None:
            return True
        if self.done_keys <= i:
            return False
        return self.board is None or all(
            self.board.progress(p) > i for p in range(self.board.parts) if p != self.share[0]
        )

    def wait_for(self, key, log: Callable[[str], None] = lambda m: None) -> None:
        start = time.monotonic()
        deadline = start + WAIT_MAX
        try:
            with self._cond:
                while not self._gave_up and not self.ready(key):
                    if time.monotonic() > deadline:
                        self._gave_up = True
                        log(f"gemmtune: kernels for a key still compiling after {WAIT_MAX:.0f}s; no key waits "
                            f"for them from now on")  # fmt: skip
                        return
                    self._cond.wait(POLL)
        finally:
            self.waited += time.monotonic() - start

    def gated(self, keys: Iterable, log: Callable[[str], None] = lambda m: None) -> Iterator:
        """`keys`, each handed on once its kernels are built."""
        for key in keys:
            self.wait_for(key, log)
            yield key

    def cancel(self) -> None:
        """Stop the pool after the item it is on (the tune ended early)."""
        self._cancelled.set()

    def join(self) -> list:
        """Wait for the pool; its failures."""
        if self._thread is not None:
            self._thread.join()
        return self.failures
