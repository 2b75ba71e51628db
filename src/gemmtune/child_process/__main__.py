"""The child's side of child_process: `python -m gemmtune.child_process CONN_FD PARENT_PID`.

Takes the parent's sys.path, imports the target module by name and calls function(conn, *args); exits
when the parent is gone (a pidfd on it, or its pid polled where there is none)."""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

PARENT_POLL_S = 0.5  # where there is no pidfd: how often the parent's pid is checked
PARENT_GONE_EXIT = 70  # the exit status of a child whose parent went away


def _exit_when_parent_is_gone(parent: int) -> None:
    """Wait for the parent to end, then end this process at once (its main thread may be deep in a call)."""
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):
        fd = None
    if os.getppid() != parent:  # it ended before the watch began (the pidfd may name a reused pid)
        os._exit(PARENT_GONE_EXIT)
    if fd is not None:
        select.select([fd], [], [])
    else:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
    os._exit(PARENT_GONE_EXIT)


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle; it ends us
    threading.Thread(target=_exit_when_parent_is_gone, args=(parent,), name="gemmtune-parent-watch",
                     daemon=True).start()  # fmt: skip
    conn = Connection(fd)
    try:
        boot = conn.recv()
    except EOFError:
        return 0  # the parent closed before saying what to run
    sys.path[:] = boot["sys_path"]
    if boot["pythonpath"] is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = boot["pythonpath"]
    module, _, function = boot["target"].partition(":")
    func = getattr(importlib.import_module(module), function)
    func(conn, *pickle.loads(boot["args"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
