"""Key -> runner resolution, cached. The hot path (ops/gemm.py) does one dict lookup and one call;
everything here runs once per new call signature.

Resolution of a GemmKey on a device:
1. the tuned row from the table in effect (untuned-M rule in configs/table.py), if its backend is
   available here, knows the row's solution and supports the key;
2. otherwise the default backend (vendor BLAS through torch). A row that cannot run here is logged
   once per key with the reason.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from . import backends
from .backends.base import Runner, Solution
from .capture import ShapeCapture
from .configs.schema import TunedRow
from .configs.table import ConfigTable, load_paths_env
from .device import identity
from .keys import GemmKey

log = logging.getLogger("gemmtune")
DEFAULT_BACKEND = "torch"


def _log_enabled() -> bool:
    return os.environ.get("GEMMTUNE_LOG", "").strip().lower() not in ("", "0", "false", "no")


def _setup_logging() -> None:
    if _log_enabled() and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[gemmtune] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


@dataclass
class Resolution:
    key: GemmKey
    solution: Solution
    row: TunedRow | None
    runner: Runner
    note: str = ""

    def describe(self) -> str:
        where = f"row {self.row.where} (M={self.row.key.M})" if self.row else "no tuned row"
        note = f"; {self.note}" if self.note else ""
        return f"{self.key.describe()} -> {self.solution.describe()} [{where}{note}]"


class Dispatcher:
    """Holds the table in effect, the capture sink and the runner cache the hot path reads."""

    def __init__(self) -> None:
        # The hot path keeps a reference to this dict: it is cleared in place, never rebound.
        self.runners: dict[tuple, Runner] = {}
        self._table: ConfigTable | None = None
        self._table_from_env = True
        self._capture: ShapeCapture | None = None
        self._capture_from_env = True
        self._warned: set[tuple] = set()
        _setup_logging()

    # ---- configuration ---------------------------------------------------------------------
    def table(self) -> ConfigTable:
        """The table in effect: set by set_config(), else GEMMTUNE_CONFIG, else empty."""
        if self._table is None:
            env = os.environ.get("GEMMTUNE_CONFIG")
            self._table = load_paths_env(env) if env is not None and self._table_from_env else ConfigTable()
        return self._table

    def set_config(self, config: ConfigTable | str | list[str] | None) -> ConfigTable:
        """Use `config` (a table, paths, or None for no table) from now on; clears the cache."""
        if isinstance(config, (str, list)):
            config = ConfigTable.load(config)
        self._table = config if config is not None else ConfigTable()
        self._table_from_env = False
        self.runners.clear()
        return self._table

    def capture(self) -> ShapeCapture | None:
        if self._capture is None and self._capture_from_env:
            path = os.environ.get("GEMMTUNE_CAPTURE", "").strip()
            self._capture_from_env = False
            if path:
                self._capture = ShapeCapture(path)
        return self._capture

    def set_capture(self, path: str | None) -> ShapeCapture | None:
        """Record shapes into `path` (None stops); clears the cache so counting wrappers apply."""
        if self._capture is not None:
            self._capture.flush()
        self._capture = ShapeCapture(path) if path else None
        self._capture_from_env = False
        self.runners.clear()
        return self._capture

    def clear_cache(self) -> None:
        self.runners.clear()

    # ---- resolution ------------------------------------------------------------------------
    def _warn_once(self, key: GemmKey, msg: str) -> None:
        tag = (key, msg)
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("gemmtune: %s", msg)

    def resolve(self, key: GemmKey, device: torch.device) -> Resolution:
        """Which solution runs `key` on `device`, and its runner."""
        row = self.table().lookup(key, identity(device)) if key.M > 0 and key.K > 0 else None
        if row is not None:
            backend = backends.get(row.libtype)
            reason = ""
            if backend is None:
                reason = f"libtype {row.libtype!r} is not a gemmtune backend"
            elif not backend.is_available(device):
                reason = backend.unavailable_reason(device) or f"{row.libtype} is unavailable here"
            else:
                sol = backend.solution_from_row(row.solidx, row.kernel_name, row.splitk)
                if sol is None:
                    reason = f"{row.libtype} does not know solution {row.kernel_name!r} (solidx {row.solidx})"
                elif not backend.supports(sol, key, device):
                    reason = f"{sol.describe()} does not support {key.describe()}"
                else:
                    return Resolution(key, sol, row, backend.make_runner(sol, key, device))
            self._warn_once(key, f"row {row.where} ({row.libtype}) falls back to {DEFAULT_BACKEND}: {reason}")
            return self._default(key, device, row, note=f"fallback: {reason}")
        return self._default(key, device, None)

    def _default(self, key: GemmKey, device: torch.device, row, note: str = "") -> Resolution:
        backend = backends.get(DEFAULT_BACKEND)
        sol = backend.default_solution(key, device)
        return Resolution(key, sol, row, backend.make_runner(sol, key, device), note)

    def runner_for(self, key: GemmKey, device: torch.device, needs_grad: bool) -> Runner:
        """Resolve, then wrap for autograd and capture as needed; called on a cache miss."""
        res = self.resolve(key, device)
        (log.info if _log_enabled() else log.debug)("%s", res.describe())
        run = res.runner
        if needs_grad and res.solution.libtype != DEFAULT_BACKEND:
            from .ops.autograd import with_autograd

            run = with_autograd(run)
        cap = self.capture()
        if cap is not None:
            cap.add_key(key)
            run = cap.counting(key, run)
        return run


_dispatcher = Dispatcher()


def get_dispatcher() -> Dispatcher:
    return _dispatcher


def set_config(config: ConfigTable | str | list[str] | None) -> ConfigTable:
    """Python API for GEMMTUNE_CONFIG: a table, a path, a list of paths (merged), or None."""
    return _dispatcher.set_config(config)


def set_capture(path: str | None) -> ShapeCapture | None:
    """Python API for GEMMTUNE_CAPTURE."""
    return _dispatcher.set_capture(path)


def resolve(key: GemmKey, device: torch.device | str | None = None) -> Resolution:
    """What `gemmtune.gemm` would run for `key` (for tools and tests; not the hot path)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    return _dispatcher.resolve(key, dev)
