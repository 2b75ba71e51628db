"""Online tuning, as aiter's HIP_ONLINE_TUNING and PyTorch's TunableOp offer it.

With `GEMMTUNE_TUNE_ONLINE=table.csv` (or `gemmtune.set_online_tuning("table.csv")`), a key that no
row of the tables in effect answers is tuned at its first eager call, in this process, and its row is
appended to table.csv under the file's lock (other families go beside it: table.batched.csv ...).
The row then serves every later call and every later run that loads the table.

Never while a CUDA graph is being captured (a tuning run would be recorded into the graph) and never
while torch.compile traces (tracing runs the ops' fake implementations, not this): such a key gets the
default for now and is queued; the next eager miss tunes the queue first. Bounded: every key gets
`GEMMTUNE_TUNE_ONLINE_BUDGET` seconds (default 20) for checking candidates before the screen, and
`GEMMTUNE_TUNE_ONLINE_LIBTYPES` may restrict the backends. Off: unset the variable, set it to 0, or
`set_online_tuning(None)`. Each tuned key logs one line.

The dispatcher knows nothing of tuning: an OnlineTuner is its miss hook (Dispatcher.set_miss_hook), and
`from_env` the factory the package installs (gemmtune/__init__.py), so the variables work without a call.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from .. import backends
from ..capture import capture_path
from ..device import identity
from ..dispatch import get_dispatcher
from ..errors import EnvVarError
from ..families import Family

log = logging.getLogger("gemmtune")
ENV = "GEMMTUNE_TUNE_ONLINE"
BUDGET_ENV = "GEMMTUNE_TUNE_ONLINE_BUDGET"
LIBTYPES_ENV = "GEMMTUNE_TUNE_ONLINE_LIBTYPES"
DEFAULT_BUDGET_S = 20.0


def capturing(device: torch.device) -> bool:
    """Is a CUDA graph being captured on the current stream (no tuning may run now)?"""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_libtypes(libtypes) -> None:
    if libtypes is not None and (isinstance(libtypes, str) or not all(isinstance(x, str) for x in libtypes)):
        raise TypeError(
            f"gemmtune.set_online_tuning: libtypes must be a list of backend names or None, got {libtypes!r}"
        )


class OnlineTuner:
    """Tunes missed keys into `path` (per family), within a time budget per key."""

    def __init__(self, path: str, budget_s: float = DEFAULT_BUDGET_S, libtypes: list[str] | None = None):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"gemmtune.set_online_tuning: path must be a str or None, got {type(path).__name__}")
        _check_libtypes(libtypes)
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not 0 < budget_s < math.inf:
            raise ValueError(f"gemmtune.set_online_tuning: budget_s must be a positive number of seconds, "
                             f"got {budget_s!r}")  # fmt: skip
        self.path = os.path.abspath(path)
        self.budget_s = budget_s
        self.libtypes = libtypes
        self.queue: list[tuple[tuple, Family, torch.device]] = []
        self.tuned: list[tuple] = []
        self._busy = False

    @classmethod
    def from_env(cls, environ) -> OnlineTuner | None:
        path = environ.get(ENV, "").strip()
        if not path or path.lower() in ("0", "false", "no", "off"):
            return None
        text = environ.get(BUDGET_ENV, "").strip()
        try:
            budget = float(text) if text else DEFAULT_BUDGET_S
        except ValueError:
            budget = math.nan
        if not 0 < budget < math.inf:
            raise EnvVarError(f"{BUDGET_ENV}={text!r}: expected a positive number of seconds per key (default "
                              f"{DEFAULT_BUDGET_S:g})")  # fmt: skip
        libs = [s.strip() for s in environ.get(LIBTYPES_ENV, "").split(",") if s.strip()] or None
        if libs:
            known = {n for fam in backends.families_with_backends() for n in backends.all_backends(fam)}
            unknown = [n for n in libs if n not in known]
            if unknown:
                raise EnvVarError(f"{LIBTYPES_ENV}={environ.get(LIBTYPES_ENV)!r}: unknown backend(s) "
                                  f"{', '.join(unknown)} (known: {', '.join(sorted(known))})")  # fmt: skip
        return cls(path, budget, libs)

    def table_path(self, family: Family) -> str:
        return capture_path(self.path, family)

    def on_miss(self, key, family: Family, device: torch.device, dispatcher) -> bool:
        """Called for a key no row answers. Tunes it (and the queue) now when that is safe; returns
        True when a row was added, so the caller resolves again."""
        if self._busy:
            return False
        if capturing(device) or torch.compiler.is_compiling():
            if (key, family, device) not in self.queue:
                self.queue.append((key, family, device))
            return False
        self._busy = True
        try:
            pending, self.queue = self.queue, []
            for k, fam, dev in pending:
                self._tune(k, fam, dev, dispatcher)
            if pending:
                dispatcher.clear_cache()  # queued keys ran the default: let their next call re-resolve
            return self._tune(key, family, device, dispatcher)
        finally:
            self._busy = False

    def _tune(self, key, family: Family, device: torch.device, dispatcher) -> bool:
        # The search pulls in the timing and checking machinery: only when a key is tuned.
        from .output import result_row, write_row
        from .search import TuneOptions, tune_shape

        if dispatcher.table(family.name).lookup(key, identity(device)) is not None:
            return True  # tuned meanwhile (queued twice, or another path)
        t0 = time.perf_counter()
        opts = TuneOptions(libtypes=self.libtypes, budget_s=self.budget_s)
        try:
            res = tune_shape(key, device, opts, family=family)
        except Exception as exc:  # noqa: BLE001 - the user's run goes on with the default
            log.warning("gemmtune: online tuning of %s failed (%s: %s); the default serves it",
                        family.describe(key), type(exc).__name__, exc)  # fmt: skip
            return False
        row = result_row(res, identity(device), family)
        path = self.table_path(family)
        write_row(path, row)
        dispatcher.table(family.name).add(row)
        self.tuned.append(key)
        verdict = "default kept" if res.kept_default else f"{res.winner.name}, {res.speedup:.2f}x"
        log.warning("gemmtune: tuned %s online in %.1fs: %s -> %s", family.describe(key),
                    time.perf_counter() - t0, verdict, path)  # fmt: skip
        return True


def set_online_tuning(path: str | None, budget_s: float | None = None,
                      libtypes: list[str] | None = None) -> OnlineTuner | None:  # fmt: skip
    """Python API for GEMMTUNE_TUNE_ONLINE: tune keys no table answers at their first eager call into
    `path` (None: off, whatever the variable says); clears the runner caches."""
    _check_libtypes(libtypes)
    tuner = OnlineTuner(path, DEFAULT_BUDGET_S if budget_s is None else budget_s, libtypes) if path else None
    get_dispatcher().set_miss_hook(tuner)
    return tuner
