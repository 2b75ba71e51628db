"""Once-only initialization that threads and fork() can share, for every lazily built registry and cache.

`Once` guards an initializer: the first caller runs it under a lock while other threads wait for it to
finish, and it counts as done only after the initializer returns (a thread never sees a registry that
says it is loaded before it is; a failure leaves it to be run again). Once done, asking costs one
attribute read and no lock, so a hot path may ask. It is re-entrant: the initializer's own thread asking
again from inside it (a backend module imported by the loader that looks the registry up) returns at once
and sees what is built so far, as a module's own import sees its partial module.

`Once.get_or_make` is the same rule for keyed caches whose values are costly or have side effects (a runner
that compiles, a capture sink that registers exit hooks): each key is made once, by one thread.

`at_fork_in_child(obj, fn)` runs fn(obj) in the child of every later os.fork() while obj lives (one
process-wide hook, objects held weakly): a lock held by a parent thread that does not exist in the child
is replaced, and per-process state (capture's pending counts) starts anew.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, MutableMapping
from typing import TypeVar

T = TypeVar("T")
V = TypeVar("V")

_in_child: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # obj -> fn(obj), run in a fork's child


def at_fork_in_child(obj: T, fn: Callable[[T], None]) -> T:
    """Run fn(obj) in the child after each os.fork() (multiprocessing's fork context too) while obj lives."""
    _in_child[obj] = fn
    return obj


def _after_fork_in_child() -> None:
    for obj, fn in list(_in_child.items()):
        fn(obj)


os.register_at_fork(after_in_child=_after_fork_in_child)


class Once:
    """Run an initializer once per process, whichever thread asks first (see the module doc).

    pending: the owner's own test of whether its state still needs building (the dispatcher's "not read
    from the environment yet" flags, which set_config and friends settle); None: this Once's done flag.
    """

    __slots__ = ("done", "_pending", "_lock", "_owner", "__weakref__")

    def __init__(self, pending: Callable[[], bool] | None = None) -> None:
        self.done = False
        self._pending = pending
        self._lock = threading.RLock()
        self._owner: int | None = None  # the thread running the initializer
        at_fork_in_child(self, Once._forked)

    def needed(self) -> bool:
        return self._pending() if self._pending is not None else not self.done

    def run(self, init: Callable[[], object]) -> None:
        """init() unless done; a thread arriving while another runs it waits for it to finish."""
        if not self.needed():
            return
        with self._lock:
            me = threading.get_ident()
            if self._owner == me or not self.needed():
                return
            self._owner = me
            try:
                init()
                self.done = True
            finally:
                self._owner = None

    def get_or_make(self, cache: MutableMapping, key, make: Callable[[], V]) -> V:
        """cache[key], made by make() under this Once's lock the first time: one maker per key, other
        threads wait for it. A hit takes no lock. (A keyed cache's Once has no use for `done`.)"""
        found = cache.get(key)
        if found is not None:
            return found
        with self._lock:
            found = cache.get(key)
            if found is None:
                found = cache[key] = make()
            return found

    def _forked(self) -> None:
        # Only the forking thread lives on: a lock another thread held (or was taking) would never be
        # released, and that thread's half-run initializer is run again by the child's first ask.
        if self._owner != threading.get_ident():
            self._owner = None
            self._lock = threading.RLock()
