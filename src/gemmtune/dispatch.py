"""Key -> runner resolution for every GEMM family, cached. Each op's hot path does one dict lookup and
one call; everything here runs once per new call signature.

Resolution of a key of family F on a device:
1. the tuned row from F's table in effect (untuned-M rule in configs/table.py), if its backend (F's
   backend of the row's libtype) is available here, knows the row's solution and supports the key;
2. otherwise F's default: what its policy (backends/<group>/policy.py) names, under the backend that
   really runs it (torch's vendor BLAS for most; a Triton kernel for some 8-bit and MoE keys on a GPU).
   A row that cannot run here is logged once per key with the reason.

A key no row answers goes to the miss hook, when one is set: an object from above (the tuner's online
tuning) that may add a row for it. The hook comes from set_miss_hook, else from the factory the package
installs (set_miss_hook_factory), which reads the environment at the first miss.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from . import backends, families, settings
from .backends.base import Runner, Solution
from .capture import CaptureSet, ShapeCapture
from .checks import bad, check_path, check_paths, check_str
from .concurrency import Once
from .configs.schema import TunedRow
from .configs.table import ConfigStore, ConfigTable
from .device import identity
from .errors import ConfigError, GemmtuneError
from .families import Family
from .families.base import positive_int
from .plugins import import_plugins

log = logging.getLogger("gemmtune")
DEFAULT_BACKEND = "torch"
A16W16 = "a16w16"
MISS_HOOK = "miss hook"  # its key in the sticky environment errors


class MissHook(Protocol):
    def on_miss(self, key, family: Family, device: torch.device, dispatcher: Dispatcher) -> bool:
        """Called once per new key no row answers; True when it added a row (the dispatcher resolves again)."""


# Makes the miss hook from the environment (None: no hook); installed from above (gemmtune/__init__.py).
_miss_hook_factory: Callable[[Mapping[str, str]], MissHook | None] | None = None


def set_miss_hook_factory(factory: Callable[[Mapping[str, str]], MissHook | None] | None) -> None:
    """Every dispatcher without an explicit hook asks `factory(os.environ)` for one at its first miss."""
    global _miss_hook_factory
    _miss_hook_factory = factory


LOG_RESOLUTIONS = settings.LOG.get()  # read at import: each new key's resolution is logged at INFO


def _setup_logging() -> None:
    if LOG_RESOLUTIONS and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[gemmtune] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


@dataclass
class Resolution:
    key: tuple
    solution: Solution
    row: TunedRow | None
    runner: Runner
    note: str = ""
    family: Family | None = None

    def describe(self) -> str:
        fam = self.family or families.get(A16W16)
        where = f"row {self.row.where} ({fam.m_field}={self.row.m})" if self.row else "no tuned row"
        note = f"; {self.note}" if self.note else ""
        return f"{fam.describe(self.key)} -> {self.solution.describe()} [{where}{note}]"


class Dispatcher:
    """Holds the tables in effect, the capture sinks and the runner caches the ops' hot paths read."""

    def __init__(self) -> None:
        # The hot paths keep references to these dicts: they are cleared in place, never rebound.
        self.runners: dict[tuple, Runner] = {}  # a16w16's (gemmtune.gemm)
        self._caches: dict[str, dict[tuple, Runner]] = {A16W16: self.runners}
        self._store: ConfigStore | None = None
        self._store_from_env = True
        self._capture: CaptureSet | None = None
        self._capture_from_env = True
        self._warned: set[tuple] = set()
        # One runner per (family, solution, scope: the key without M for most backends, device), shared
        # by every M that resolves to it, so a server's hundred batch sizes compile and allocate once.
        self._shared: dict[tuple, Runner] = {}
        self._miss_hook: MissHook | None = None
        self._miss_hook_from_env = True
        self._plugins_from_env = True
        # A variable that cannot be used raises at the first call and at every later one, never turning
        # into a silent mode change (capture quietly off after one failed call).
        self._env_errors: dict[str, GemmtuneError] = {}
        # What is read from the environment at first use is read once, by one thread, while the others
        # wait; each test is the state's own "still to read" flag, which the set_* methods settle.
        self._store_once = Once(lambda: self._store is None)
        self._capture_once = Once(lambda: self._capture is None and self._capture_from_env)
        self._miss_hook_once = Once(
            lambda: self._miss_hook is None and self._miss_hook_from_env and _miss_hook_factory is not None
        )
        self._plugins_once = Once(lambda: self._plugins_from_env)
        self._shared_once = Once()  # a shared runner is made by one thread (a Triton runner compiles)
        _setup_logging()

    def _from_env(self, what: str, make):
        err = self._env_errors.get(what)
        if err is not None:
            raise type(err)(*err.args) from None
        try:
            return make()
        except GemmtuneError as exc:
            self._env_errors[what] = exc
            raise

    def cache(self, family: str) -> dict[tuple, Runner]:
        """The runner cache of `family`'s op (one dict per family, kept for the process)."""
        c = self._caches.get(family)
        return c if c is not None else self._caches.setdefault(family, {})

    # ---- configuration ---------------------------------------------------------------------
    def store(self) -> ConfigStore:
        """The tables in effect: set by set_config(), else the GEMMTUNE_CONFIG* variables, else none."""
        self._store_once.run(self._read_store)
        return self._store

    def _read_store(self) -> None:
        self._store = ConfigStore.from_env(os.environ) if self._store_from_env else ConfigStore()

    def table(self, family: str = A16W16) -> ConfigTable:
        return self.store().table(family)

    def set_config(self, config: ConfigStore | ConfigTable | str | list[str] | None, group=None) -> ConfigStore:
        """Use `config` from now on: a store, one family's table, paths (each file to its family), or
        None for no tables; clears the runner caches. Under torch.distributed every rank of `group` (None:
        the default group) must call it, and it raises, changing nothing, unless all their tables agree."""
        if config is not None and not isinstance(config, (ConfigStore, ConfigTable, str, os.PathLike, list)):
            raise TypeError(f"gemmtune.set_config: config must be a path, a list of paths, a ConfigStore, a "
                            f"ConfigTable or None, got {type(config).__name__}")  # fmt: skip
        if group is not None and not _distributed():
            raise ValueError(f"gemmtune.set_config: group={group!r} given but torch.distributed is not initialized")
        if isinstance(config, (str, os.PathLike, list)):
            config = ConfigStore.load(check_paths("set_config", "config", config))
        elif isinstance(config, ConfigTable):
            table, config = config, ConfigStore()
            config.tables[table.family.name] = table
        config = config if config is not None else ConfigStore()
        if _distributed():
            check_stores_agree(config, group)
        self._store = config
        self._store_from_env = False
        settings.api_called("set_config")
        self.clear_cache()
        return self._store

    def check_tables_agree(self, group=None) -> None:
        """Raise unless every rank of `group` (None: the default group) has the same tables in effect;
        a collective: every rank calls it (once, after loading tables: never on the hot path)."""
        if not _distributed():
            raise ValueError("gemmtune.check_tables_agree: torch.distributed is not initialized")
        check_stores_agree(self.store(), group)

    def capture(self, family: Family | None = None) -> ShapeCapture | None:
        self._capture_once.run(self._read_capture)
        capture = self._capture
        if capture is None:
            return None
        return capture.for_family(family or families.get(A16W16))

    def _read_capture(self) -> None:
        path = settings.CAPTURE.get()
        if path:
            self._capture = self._from_env(settings.CAPTURE.name, lambda: _env_capture(path))
        self._capture_from_env = False

    def set_capture(self, path: str | None) -> CaptureSet | None:
        """Record shapes into `path` (None stops); clears the caches so counting wrappers apply."""
        path = check_path("set_capture", "path", path, optional=True)
        if self._capture is not None:
            self._capture.flush()
        self._capture = CaptureSet(path) if path else None
        self._capture_from_env = False
        self._env_errors.pop(settings.CAPTURE.name, None)
        settings.api_called("set_capture")
        self.clear_cache()
        return self._capture

    def miss_hook(self) -> MissHook | None:
        """The hook keys no row answers go to: set_miss_hook's, else the installed factory's from the environment."""
        self._miss_hook_once.run(self._read_miss_hook)
        return self._miss_hook

    def _read_miss_hook(self) -> None:
        self._miss_hook = self._from_env(MISS_HOOK, lambda: _miss_hook_factory(os.environ))
        self._miss_hook_from_env = False

    def set_miss_hook(self, hook: MissHook | None) -> MissHook | None:
        """Send keys no row answers to `hook` from now on (None: nowhere, whatever the environment says);
        clears the runner caches."""
        if hook is not None and not callable(getattr(hook, "on_miss", None)):
            raise TypeError(f"set_miss_hook: hook must have an on_miss method or be None, got {type(hook).__name__}")
        self._miss_hook = hook
        self._miss_hook_from_env = False
        settings.api_called("set_miss_hook")
        self._env_errors.pop(MISS_HOOK, None)
        self.clear_cache()
        return hook

    def forget_runners(self, family: str) -> None:
        """Empty the runner caches of `family`'s ops so their next calls resolve anew (a row was added).
        Safe from another thread: dict.clear is atomic under the GIL, a call in flight keeps the runner it
        fetched, and the shared runners stay, so resolving again rebuilds nothing."""
        for name, c in list(self._caches.items()):
            if name == family or name.startswith(family + "."):
                c.clear()

    def clear_cache(self) -> None:
        for c in self._caches.values():
            c.clear()
        self._shared.clear()

    @contextlib.contextmanager
    def quiet(self):
        """Run gemmtune's own probes (optimize()'s parity check) without recording their shapes or
        tuning their keys; capture and online tuning come back as they were."""
        saved = (self._capture, self._capture_from_env, self._miss_hook, self._miss_hook_from_env)
        self._capture, self._capture_from_env, self._miss_hook, self._miss_hook_from_env = None, False, None, False
        self.clear_cache()
        try:
            yield
        finally:
            self._capture, self._capture_from_env, self._miss_hook, self._miss_hook_from_env = saved
            self.clear_cache()  # runners built in the probe lack the capture wrappers

    def _runner(self, backend, sol: Solution, key, device: torch.device, fam: Family) -> Runner:
        scope = (fam.name, backend.name, sol, backend.runner_scope(sol, key), device)
        return self._shared_once.get_or_make(self._shared, scope, lambda: backend.make_runner(sol, key, device))

    # ---- resolution ------------------------------------------------------------------------
    def _warn_once(self, key, msg: str) -> None:
        tag = (key, msg)
        if tag not in self._warned:
            self._warned.add(tag)
            log.warning("gemmtune: %s", msg)

    def plugins(self) -> None:
        """Import GEMMTUNE_PLUGINS' modules before the first resolution, so their backends serve rows."""
        self._plugins_once.run(self._read_plugins)

    def _read_plugins(self) -> None:
        self._from_env(settings.PLUGINS.name, import_plugins)
        self._plugins_from_env = False

    def resolve(self, key, device: torch.device, family: str = A16W16) -> Resolution:
        """Which solution runs `key` of `family` on `device`, and its runner."""
        self.plugins()
        fam = families.get(family)
        row = self.table(family).lookup(key, identity(device)) if _nonempty(key, fam) else None
        if row is not None:
            backend = backends.get(row.libtype, family)
            reason = ""
            if backend is None:
                reason = f"libtype {row.libtype!r} is not a gemmtune {family} backend"
            elif not backend.is_available(device):
                reason = backend.unavailable_reason(device) or f"{row.libtype} is unavailable here"
            else:
                sol = backend.solution_from_row(row.solidx, row.kernel_name, row.splitk)
                if sol is None:
                    reason = f"{row.libtype} does not know solution {row.kernel_name!r} (solidx {row.solidx})"
                elif not backend.supports(sol, key, device):
                    reason = f"{sol.describe()} does not support {fam.describe(key)}"
                else:
                    return Resolution(key, sol, row, self._runner(backend, sol, key, device, fam), family=fam)
            self._warn_once(key, f"row {row.where} ({row.libtype}) falls back to the {family} default: {reason}")
            return self._default(key, device, fam, row, note=f"fallback: {reason}")
        return self._default(key, device, fam, None)

    def _default(self, key, device: torch.device, fam: Family, row, note: str = "") -> Resolution:
        """The family's untuned default (its policy, backends/<group>/policy.py), under the backend that runs it."""
        if not backends.all_backends(fam.name):
            raise RuntimeError(f"gemmtune: the {fam.name} family has no runnable op here ({fam.unrunnable})")
        backend, sol = backends.default(fam.name, key, device)
        return Resolution(key, sol, row, self._runner(backend, sol, key, device, fam), note, fam)

    def runner_for(self, key, device: torch.device, family: str = A16W16,
                   autograd: Callable[[Runner], Runner] | None = None) -> Runner:  # fmt: skip
        """Resolve (tuning the key first when online tuning is on and no row answers it), then wrap for
        autograd and capture as needed; called on a cache miss. `autograd` (from an op whose call needs
        gradients) wraps a runner whose solution computes the forward only: any backend but torch's own ops."""
        res = self.resolve(key, device, family)
        hook = self.miss_hook()
        if hook is not None and res.row is None and backends.all_backends(family):
            if hook.on_miss(key, res.family, device, self):
                res = self.resolve(key, device, family)
        (log.info if LOG_RESOLUTIONS else log.debug)("%s", res.describe())
        run = res.runner
        if autograd is not None and res.solution.libtype != DEFAULT_BACKEND:  # a forward-only kernel
            run = autograd(run)
        cap = self.capture(res.family)
        if cap is not None:
            cap.add_key(key)
            run = cap.counting(key, run)
        return run


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def check_stores_agree(store: ConfigStore, group=None) -> None:
    """Raise ConfigError naming the ranks of `group` whose tables differ (by what dispatch would run) and
    their files: tensor-parallel ranks that pick different kernels for one key drift apart."""
    dist = torch.distributed
    mine = {name: (tab.digest(), tab.files) for name, tab in sorted(store.tables.items()) if len(tab)}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
    differ = []
    for name in sorted({n for tables in everyone for n in tables}):
        sides: dict[str, list[int]] = {}
        for rank, tables in zip(ranks, everyone):
            sides.setdefault(tables.get(name, ("", []))[0], []).append(rank)
        if len(sides) > 1:
            parts = []
            for members in sides.values():
                table = everyone[ranks.index(members[0])].get(name)
                where = "no table" if table is None else ", ".join(table[1]) or "rows set in memory"
                parts.append(f"rank{'s' if len(members) > 1 else ''} {','.join(map(str, members))} ({where})")
            differ.append(f"{name}: {' vs '.join(parts)}")
    if differ:
        raise ConfigError("gemmtune: tuned tables differ across ranks (they could run different kernels for one "
                          f"key): {'; '.join(differ)}")  # fmt: skip


def _env_capture(path: str) -> CaptureSet:
    try:
        return CaptureSet(path)
    except GemmtuneError as exc:
        raise type(exc)(f"{settings.CAPTURE.name}={path}: {exc}") from None


def _nonempty(key, fam: Family) -> bool:
    """No zero-sized dimension (such calls never reach a table). Only the family's size columns count:
    fmoe's expert-parallel and shared-expert columns are 0 in most rows."""
    return all(getattr(key, c.field) > 0 for c in fam.key_columns if c.parse is positive_int)


_dispatcher = Dispatcher()


def get_dispatcher() -> Dispatcher:
    return _dispatcher


def set_config(config: ConfigStore | ConfigTable | str | list[str] | None, group=None) -> ConfigStore:
    """Python API for the GEMMTUNE_CONFIG* variables: a store, a table, a path or paths, or None. Under
    torch.distributed, a collective that checks every rank of `group` has the same tables (see
    check_tables_agree)."""
    return _dispatcher.set_config(config, group)


def check_tables_agree(group=None) -> None:
    """Under torch.distributed: raise ConfigError, naming ranks and files, unless every rank of `group` (None:
    the default group) has the same tables in effect (GEMMTUNE_CONFIG* or set_config's). Every rank calls it."""
    _dispatcher.check_tables_agree(group)


def set_capture(path: str | None) -> CaptureSet | None:
    """Python API for GEMMTUNE_CAPTURE."""
    return _dispatcher.set_capture(path)


def resolve(key, device: torch.device | str | None = None, family: str = A16W16) -> Resolution:
    """What the family's op would run for `key` (for tools and tests; not the hot path). The key must be
    one the family's tables could hold (GemmKey for a16w16: M, N, K ints >= 1, dtypes torch.dtype)."""
    fam = families.get(check_str("resolve", "family", family))
    fam.check_key(key, "resolve")
    if device is None:
        dev = torch.device("cpu")
    elif isinstance(device, (str, torch.device)):
        try:
            dev = torch.device(device)
        except RuntimeError:
            raise bad("resolve", "device", "a torch.device or its name (cpu, cuda, cuda:N)", device) from None
    else:
        raise bad("resolve", "device", "a torch.device, its name or None", device, TypeError)
    return _dispatcher.resolve(key, dev, fam.name)
