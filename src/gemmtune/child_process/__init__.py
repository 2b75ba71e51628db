"""The processes gemmtune starts: a fresh interpreter running gemmtune's own entry point
(`python -m gemmtune.child_process`), never a re-import of the caller's `__main__`.

multiprocessing's spawn re-runs the caller's main module in the child, so a script without an
`if __name__ == "__main__":` guard runs twice and its child fails to bootstrap; fork copies a process
that may hold threads and locks. A child started here is a plain subprocess (Popen: fork-safe from any
thread) that talks to its parent over a socket pair wrapped in a multiprocessing Connection (pickled
messages). Its first message names the target as "package.module:function" with the parent's sys.path and
the pickled arguments; the child imports that module by name and calls function(conn, *args).

A child never outlives its parent: it watches the parent's pid (a pidfd, or getppid where there is none)
and exits when the parent is gone, and the parent ends its live children at exit. A forked copy of the
parent owns none of them.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection, wait

ENTRY = "gemmtune.child_process"  # the module `python -m` runs in the child (its __main__.py)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_live: set[ChildProcess] = set()  # started and not yet closed: ended at exit
_live_lock = threading.Lock()
_exiting = threading.Event()  # set at interpreter exit: no child starts after the live ones are ended


class ExitingError(RuntimeError):
    """A child was asked for while the interpreter exits."""


def python_executable() -> str:
    """The interpreter to start: sys.executable, or the python beside it where the program embeds Python
    (sys.executable is then the host program)."""
    exe = sys.executable
    if exe and os.path.basename(exe).lower().startswith(("python", "pypy")):
        return exe
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", f"python{sys.version_info.major}"):
        candidate = os.path.join(sys.exec_prefix, "bin", name)
        if os.access(candidate, os.X_OK):
            return candidate
    if not exe:
        raise RuntimeError("gemmtune: cannot start a worker process: sys.executable is empty and no python "
                           f"is in {os.path.join(sys.exec_prefix, 'bin')}")  # fmt: skip
    return exe


def _check_target(target: str) -> tuple[str, str]:
    module, sep, function = target.partition(":")
    if not (sep and module and function):
        raise ValueError(f"child_process target={target!r}: expected 'package.module:function'")
    return module, function


class ChildProcess:
    """One child running `target` (called as function(conn, *args)); `conn` is this side's Connection."""

    def __init__(self, target: str, args: Iterable = (), env: dict[str, str] | None = None):
        _check_target(target)
        if _exiting.is_set():
            raise ExitingError(f"gemmtune: not starting {target}: the interpreter is exiting")
        payload = pickle.dumps(tuple(args))  # before the start: an unpicklable argument starts nothing
        ours, theirs = socket.socketpair()
        environ = dict(os.environ if env is None else env)
        user_path = environ.get("PYTHONPATH")
        # The child must find this gemmtune before it can take the parent's sys.path.
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, user_path]))
        read_end = None
        try:
            pass_fds = [theirs.fileno()]
            if not hasattr(os, "pidfd_open"):  # the sentinel is a pipe the child holds open until it ends
                read_end, write_end = os.pipe()
                pass_fds.append(write_end)
            argv = [python_executable(), "-m", ENTRY, str(theirs.fileno()), str(os.getpid())]
            try:
                self.popen = subprocess.Popen(argv, pass_fds=pass_fds, stdin=subprocess.DEVNULL, env=environ)
            finally:
                if read_end is not None:
                    os.close(write_end)
        except BaseException:
            ours.close()
            if read_end is not None:
                os.close(read_end)
            raise
        finally:
            theirs.close()
        self.pid = self.popen.pid
        self.conn = Connection(ours.detach())
        self.sentinel = read_end if read_end is not None else os.pidfd_open(self.pid)
        self._closed = False
        with _live_lock:
            _live.add(self)
            if _exiting.is_set():  # exit began while it started: end it here, the exit hook has run
                _live.discard(self)
                self.close()
                raise ExitingError(f"gemmtune: not starting {target}: the interpreter is exiting")
        self.conn.send({"sys_path": list(sys.path), "pythonpath": user_path, "target": target, "args": payload})

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N when signal N ended it (as multiprocessing says)."""
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                self.popen.kill()
            except ProcessLookupError:
                pass

    def close(self) -> None:
        """End it (if it still runs), reap it and release its descriptors."""
        if self._closed:
            return
        self.kill()
        self.join()
        self._closed = True
        self.conn.close()
        os.close(self.sentinel)
        with _live_lock:
            _live.discard(self)


def start(target: str, *args, env: dict[str, str] | None = None) -> ChildProcess:
    """Start a child running `target` ("package.module:function") as function(conn, *args)."""
    return ChildProcess(target, args, env)


def children() -> list[ChildProcess]:
    """The children this process started and has not closed."""
    with _live_lock:
        return list(_live)


def exiting() -> bool:
    """True once the interpreter's exit has begun ending the children (a worker lost then is no failure)."""
    return _exiting.is_set()


@atexit.register
def _end_live_children() -> None:
    with _live_lock:
        _exiting.set()
        children = list(_live)
    for child in children:
        child.close()


def _forget_children_in_fork() -> None:
    # A forked copy shares the parent's pipes but not its children: it must neither talk to nor end them.
    global _live, _live_lock, _exiting
    _live, _live_lock, _exiting = set(), threading.Lock(), threading.Event()


os.register_at_fork(after_in_child=_forget_children_in_fork)


# ---- calls handed out over a few children ------------------------------------------------------------
def serve_calls(conn, target: str) -> None:
    """The child side of map_unordered: call `target` on each item received until None comes."""
    import importlib

    module, function = _check_target(target)
    func = getattr(importlib.import_module(module), function)
    while True:
        item = conn.recv()
        if item is None:
            return
        try:
            conn.send((True, func(item)))
        except Exception as exc:  # noqa: BLE001 - the parent raises it, naming the item
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def map_unordered(target: str, items: list, processes: int) -> Iterator:
    """target(item) for each item, in `processes` children, handed out one at a time in list order;
    yields the results as they finish. A child that dies or a call that raises is a RuntimeError."""
    if not items:
        return
    children = [start(f"{__name__}:serve_calls", target) for _ in range(max(1, min(processes, len(items))))]
    queue = list(enumerate(items))[::-1]
    busy: dict[ChildProcess, int] = {}
    try:
        while queue or busy:
            for child in children:
                if child not in busy and queue:
                    number, item = queue.pop()
                    child.conn.send(item)
                    busy[child] = number
            ready = wait([c.conn for c in busy] + [c.sentinel for c in busy])
            for child in list(busy):
                if child.conn in ready:
                    try:
                        ok, value = child.conn.recv()
                    except EOFError:
                        ok, value = None, None
                    if ok is not None:
                        number = busy.pop(child)
                        if not ok:
                            raise RuntimeError(f"{target} failed on item {number}: {value}")
                        yield value
                        continue
                if child.sentinel in ready or child.conn in ready:
                    child.join(5)
                    raise RuntimeError(f"{target}: worker process {child.pid} ended (exit code {child.exitcode}) "
                                       f"on item {busy[child]}")  # fmt: skip
    finally:
        for child in children:
            try:
                child.conn.send(None)
            except OSError:
                pass
        for child in children:
            child.join(2)
            child.close()
