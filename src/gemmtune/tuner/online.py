"""Online tuning, as aiter's HIP_ONLINE_TUNING and PyTorch's TunableOp offer it.

With `GEMMTUNE_TUNE_ONLINE=table.csv` (or `gemmtune.set_online_tuning("table.csv")`), a key that no
row of the tables in effect answers is tuned and its row appended to table.csv under the file's lock
(other families go beside it: table.batched.csv ...). The row then serves every later call and every
later run that loads the table. `GEMMTUNE_TUNE_ONLINE_MODE` (or `mode=`) says when:
- `background` (the default): the miss is served by the default at once and the key is tuned by a
  background thread in a worker process; the row is adopted at the key's next call outside a CUDA graph
  capture (online_background.py);
- `blocking`: the key is tuned at its first eager call, in this process, and that call waits for it.

Never while a CUDA graph is being captured (a tuning run would be recorded into the graph) and never
while torch.compile traces (tracing runs the ops' fake implementations, not this): in blocking mode such
a key gets the default for now and is queued, and the next eager miss tunes the queue first. Bounded:
every key gets `GEMMTUNE_TUNE_ONLINE_BUDGET` seconds (default 20) end to end (candidates.check_deadline:
the checks stop at half of it, the screen and final timing take the rest; in the background, from
the worker taking the key: the worker's start is paid once per device, by the first key), and
`GEMMTUNE_TUNE_ONLINE_LIBTYPES` may restrict the backends. Off: unset the variable, set it to 0, or
`set_online_tuning(None)`. Each tuned key logs one line.

The dispatcher knows nothing of tuning: a tuner is its miss hook (Dispatcher.set_miss_hook), and
`from_env` the factory the package installs (gemmtune/__init__.py), so the variables work without a call.
"""

from __future__ import annotations

import logging
import time

import torch

from .. import settings
from ..checks import check_number, check_path
from ..device import identity
from ..dispatch import get_dispatcher
from ..errors import GemmtuneError, OutputFileError, ReadOnlyPathError
from ..families import Family
from . import online_common
from .online_common import DEFAULT_BUDGET_S, MODES, check_libtypes, check_mode

log = logging.getLogger("gemmtune")
ENV = settings.TUNE_ONLINE.name


class OnlineTuner:
    """Blocking mode: tunes missed keys into `path` (per family) in the missing call, within a time budget per key."""

    mode = "blocking"

    def __init__(self, path: str, budget_s: float = DEFAULT_BUDGET_S, libtypes: list[str] | None = None):
        self.settings = online_common.OnlineSettings(path, budget_s, libtypes)
        self.path, self.budget_s, self.libtypes = self.settings.path, budget_s, libtypes
        self.queue: list[tuple[tuple, Family, torch.device]] = []
        self.tuned: list[tuple] = []
        self._busy = False
        self._warned_distributed = False

    def table_path(self, family: Family) -> str:
        return self.settings.table_path(family)

    def on_miss(self, key, family: Family, device: torch.device, dispatcher) -> bool:
        """Called for a key no row answers. Tunes it (and the queue) now when that is safe; returns
        True when a row was added, so the caller resolves again."""
        if self._busy:
            return False
        if online_common.distributed() and not self._warned_distributed:
            self._warned_distributed = True
            log.warning("gemmtune: blocking online tuning tunes each rank on its own, so ranks may run different "
                        "kernels for one key; background mode with sync_online_rows() keeps them alike")  # fmt: skip
        if not online_common.safe_point(device):
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
        from .output import result_row
        from .search import TuneOptions, tune_shape

        if dispatcher.table(family.name).lookup(key, identity(device)) is not None:
            return True  # tuned meanwhile (queued twice, or another path)
        path = self.settings.writable_path(family)
        if path is None:
            return False
        t0 = time.perf_counter()
        opts = TuneOptions(libtypes=self.libtypes, budget_s=self.budget_s)
        try:
            res = tune_shape(key, device, opts, family=family)
        except Exception as exc:  # noqa: BLE001 - the user's run goes on with the default
            log.warning("gemmtune: online tuning of %s failed (%s: %s); the default serves it",
                        family.describe(key), type(exc).__name__, exc)  # fmt: skip
            return False
        row = result_row(res, identity(device), family)
        if not self.settings.write(family, row):
            return False
        dispatcher.table(family.name).add(row)
        self.tuned.append(key)
        log.warning("gemmtune: tuned %s online in %.1fs: %s -> %s", family.describe(key),
                    time.perf_counter() - t0, online_common.verdict(res), path)  # fmt: skip
        return True


def make_tuner(path: str, budget_s: float = DEFAULT_BUDGET_S, libtypes: list[str] | None = None,
               mode: str = MODES[0]):  # fmt: skip
    """The miss hook of `mode`: a BackgroundTuner or a (blocking) OnlineTuner."""
    if check_mode(mode) == "blocking":
        return OnlineTuner(path, budget_s, libtypes)
    from .online_background import BackgroundTuner

    return BackgroundTuner(path, budget_s, libtypes)


def set_up_from_env(environ) -> None:
    """At `import gemmtune`: when GEMMTUNE_TUNE_ONLINE is on, make its tuner now (the table checks, the
    backend registry), so the first call of a missing key pays none of it. A variable that cannot be
    used raises at the first call, as the dispatcher keeps the error for it."""
    try:
        if settings.TUNE_ONLINE.get(environ):
            get_dispatcher().miss_hook()
    except GemmtuneError:
        pass


def from_env(environ):
    """The miss hook the GEMMTUNE_TUNE_ONLINE* variables ask for, or None when online tuning is off."""
    path = settings.TUNE_ONLINE.get(environ)
    if not path:
        return None
    budget = settings.TUNE_ONLINE_BUDGET.get(environ)
    libs = settings.TUNE_ONLINE_LIBTYPES.get(environ, check=_known_libtypes) or None  # ", ": all backends
    mode = settings.TUNE_ONLINE_MODE.get(environ)
    try:
        return make_tuner(path, budget, libs, mode)
    except ReadOnlyPathError as exc:  # the serving call goes on with the defaults, never raises for it
        log.warning("gemmtune: %s=%s: %s; online tuning is off, the defaults serve untuned keys", ENV, path, exc)
        return None
    except OutputFileError as exc:
        raise settings.TUNE_ONLINE.error(path, str(exc)) from None


def _known_libtypes(libs: list[str]) -> None:
    unknown, known = online_common.unknown_libtypes(libs)
    if unknown:
        raise ValueError(f"unknown backend(s) {', '.join(unknown)} (known: {', '.join(known)})")


def set_online_tuning(path: str | None, budget_s: float | None = None, libtypes: list[str] | None = None,
                      mode: str | None = None):  # fmt: skip
    """Python API for GEMMTUNE_TUNE_ONLINE: tune keys no table answers into `path` (None: off, whatever
    the variable says), in the background (mode="background", the default: the default serves the miss)
    or in the missing call (mode="blocking"); clears the runner caches. Returns the miss hook."""
    check_path("set_online_tuning", "path", path, optional=True)
    check_number("set_online_tuning", "budget_s", budget_s, lo=0, lo_open=True, optional=True)
    libtypes = check_libtypes(libtypes)
    mode = MODES[0] if mode is None else check_mode(mode)
    dispatcher = get_dispatcher()
    old = dispatcher._miss_hook
    tuner = make_tuner(path, DEFAULT_BUDGET_S if budget_s is None else budget_s, libtypes, mode) if path else None
    if old is not None and callable(getattr(old, "close", None)):
        old.close()  # its background threads stop after their current key
    dispatcher.set_miss_hook(tuner)
    settings.api_called("set_online_tuning")
    return tuner
