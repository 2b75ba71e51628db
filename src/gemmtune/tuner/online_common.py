"""What both online tuning modes share: where rows go, the time budget, and when tuning may run."""

from __future__ import annotations

import logging
import os
import threading

import torch

from .. import backends, families, settings
from ..capture import capture_path
from ..checks import check_choice, check_list, check_number, check_path
from ..configs.files import TUNED_TABLE, check_output, check_writable
from ..errors import GemmtuneError
from ..families import Family

log = logging.getLogger("gemmtune")

MODES = settings.TUNE_ONLINE_MODE.parse.modes  # background (the default), blocking
_API = "set_online_tuning"  # the public function whose arguments these checks name
DEFAULT_BUDGET_S = settings.TUNE_ONLINE_BUDGET.default


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


def unknown_libtypes(libtypes: list[str]) -> tuple[list[str], list[str]]:
    """(the names in `libtypes` no family has a backend of, every backend name known)."""
    known = sorted({n for fam in backends.families_with_backends() for n in backends.all_backends(fam)})
    return [n for n in libtypes if n not in known], known


def check_libtypes(libtypes) -> list[str] | None:
    """None, or a list of backend names each of which some family has (as GEMMTUNE_TUNE_ONLINE_LIBTYPES)."""
    if libtypes is None:
        return None
    known = tuple(unknown_libtypes([])[1])
    return check_list(
        _API, "libtypes", libtypes, lambda fn, name, lib: check_choice(fn, name, lib, known), optional=True
    )


def check_mode(mode) -> str:
    return check_choice(_API, "mode", mode, MODES)


class OnlineSettings:
    """Where rows go and how long a key may take: what both modes share."""

    def __init__(self, path: str, budget_s: float = DEFAULT_BUDGET_S, libtypes: list[str] | None = None):
        path = check_path(_API, "path", path)
        libtypes = check_libtypes(libtypes)
        check_number(_API, "budget_s", budget_s, lo=0, lo_open=True)  # seconds
        self.path = os.path.abspath(path)
        self.budget_s = budget_s
        self.libtypes = libtypes
        self._warned: set[str] = set()
        self._warn_lock = threading.Lock()
        # As `tune -o` and capture: a missing or read-only folder, a FIFO, a shape list ... refused now.
        for fam in families.all_families():
            check_output(self.table_path(fam), TUNED_TABLE)
        # The backend registry every miss and the tuner consult: loaded with the tuner, not in the first call.
        backends.families_with_backends()

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
