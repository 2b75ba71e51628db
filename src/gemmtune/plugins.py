"""GEMMTUNE_PLUGINS: modules that register extra backends or whole GEMM families, imported wherever gemmtune
needs what they register: the dispatcher's first resolution, the family registry (detecting a table's
family, loading GEMMTUNE_CONFIG_<FAMILY>, naming an unknown family), `tune`, `bench` and every tuning
worker. So a serving process gets the plugin's backends and families too, instead of falling back to
torch or refusing the plugin's tables without a word.

Each module is imported once. One that fails raises the same error at every later ask and is never
imported again: half of it may have registered already, and a mode that changes after the first call
(plugins quietly off) is worse than the error.
"""

from __future__ import annotations

import importlib

from . import settings
from .concurrency import Once
from .errors import EnvVarError

PLUGINS_ENV = settings.PLUGINS.name
_imported: set[str] = set()
_failed: dict[str, str] = {}  # module -> why its import failed
# module -> the Once its import runs under: another thread waits for it, while a plugin whose import asks
# for the plugins again (its own thread) gets its own partial module
_imports: dict[str, Once] = {}


def env_plugins(environ=None) -> list[str]:
    return list(settings.PLUGINS.get(environ))


def import_plugin(name: str, source: str = PLUGINS_ENV) -> None:
    """Import plugin module `name` once; EnvVarError naming `source` and the module when it fails (now
    and at every later call)."""
    if name in _imported:
        return
    once = _imports.get(name) or _imports.setdefault(name, Once(lambda: name not in _imported and name not in _failed))
    once.run(lambda: _import(name))
    why = _failed.get(name)
    if why is not None:
        raise EnvVarError(f"{source} {name!r}: cannot import plugin module: {why}") from None


def _import(name: str) -> None:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure of a plugin's import is reported the same way
        _failed[name] = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
    else:
        _imported.add(name)


def import_plugins(environ=None) -> None:
    """Import every module GEMMTUNE_PLUGINS names (idempotent; cheap once they are imported)."""
    for name in env_plugins(environ):
        import_plugin(name)
