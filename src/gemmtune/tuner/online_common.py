"""What both online tuning modes share: where rows go, the time budget, and when tuning may run."""

from __future__ import annotations

import logging
import math
import os
import threading

import torch

from .. import families
from ..capture import capture_path
from ..configs.files import TUNED_TABLE, check_output, check_writable
from ..errors import GemmtuneError
from ..families import Family

log = logging.getLogger("gemmtune")

MODES = ("background", "blocking")  # the first is the default
DEFAULT_BUDGET_S = 20.0


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream (no tuning may run now)?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def safe_point(device: torch.device) -> bool:
    """May this thread tune a key or build a tuned runner now: no graph capture, no torch.compile trace?"""
    return not (capturing(device) or torch.compiler.is_compiling())


def distributed() -> bool:
    """Is torch.distributed initialized (online rows then wait for sync_online_rows)?"""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def verdict(res) -> str:
    """What a tuned key's row says, for its log line."""
    return "default kept" if res.kept_default else f"{res.winner.name}, {res.speedup:.2f}x"


def check_libtypes(libtypes) -> None:
    if libtypes is not None and (isinstance(libtypes, str) or not all(isinstance(x, str) for x in libtypes)):
        raise TypeError(
            f"gemmtune.set_online_tuning: libtypes must be a list of backend names or None, got {libtypes!r}"
        )


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"gemmtune.set_online_tuning: mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class OnlineSettings:
    """Where rows go and how long a key may take: what both modes share."""

    def __init__(self, path: str, budget_s: float = DEFAULT_BUDGET_S, libtypes: list[str] | None = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"gemmtune.set_online_tuning: path must be a str or None, got {type(path).__name__}")
        check_libtypes(libtypes)
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
            raise ValueError(f"gemmtune.set_online_tuning: budget_s must be a positive number of seconds, "
                             f"got {budget_s!r}")  # fmt: skip
        self.path = os.path.abspath(path)
        self.budget_s = budget_s
        self.libtypes = libtypes
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        # As `tune -o` and capture: a missing or read-only folder, a FIFO, a shape list ... refused now.
        for fam in families.all_families():
            check_output(self.table_path(fam), TUNED_TABLE)

    def table_path(self, family: Family) -> str:
        return capture_path(self.path, family)

    def writable_path(self, family: Family) -> str | None:
        """`family`'s table path, or None (said once) when it cannot be written now: no key is tuned for
        a row that could not be kept."""
        path = self.table_path(family)
        try:
            check_writable(path)
        except GemmtuneError as exc:
            self.cannot_write(exc)
            return None
        return path

    def write(self, family: Family, row) -> bool:
        """Write `row` into `family`'s table; False (said once) when the file cannot take it: the serving
        call goes on with the default, never raises."""
        from .output import write_row  # the search machinery it pulls in: only when a row is written

        try:
            write_row(self.table_path(family), row)
        except (GemmtuneError, OSError) as exc:
            self.cannot_write(exc)
            return False
        return True

    def cannot_write(self, exc: Exception) -> None:
        msg = str(exc)
        with self._warn_lock:
            if msg in self._warned:
                return
            self._warned.add(msg)
        log.warning("gemmtune: online tuning cannot write its table: %s; the defaults serve untuned keys", msg)
