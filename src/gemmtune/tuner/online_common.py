"""What both online tuning modes share: where rows go, the time budget, and when tuning may run."""

from __future__ import annotations

import os

import torch

from .. import backends
from ..capture import capture_path
from ..checks import check_choice, check_list, check_number, check_path
from ..families import Family

MODES = ("background", "blocking")  # the first is the default
_API = "set_online_tuning"  # the public function whose arguments these checks name
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

    def table_path(self, family: Family) -> str:
        return capture_path(self.path, family)
