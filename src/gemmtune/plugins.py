"""GEMMTUNE_PLUGINS: modules that register extra backends, imported wherever gemmtune dispatches or tunes
(the runtime's first resolution, `tune`, `bench`, every tuning worker), so a serving process gets the
plugin's backends too instead of falling back to torch without a word."""

from __future__ import annotations

import importlib
import os

from .errors import EnvVarError

PLUGINS_ENV = "GEMMTUNE_PLUGINS"  # comma list of modules to import (they register extra backends)
_imported: set[str] = set()


def env_plugins(environ=None) -> list[str]:
    text = (os.environ if environ is None else environ).get(PLUGINS_ENV, "")
    return [m.strip() for m in text.split(",") if m.strip()]


def import_plugin(name: str, source: str = PLUGINS_ENV) -> None:
    """Import plugin module `name` once; EnvVarError naming `source` and the module when it fails."""
    if name in _imported:
        return
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure of a plugin's import is reported the same way
        why = str(exc) if isinstance(exc, ImportError) else f"{type(exc).__name__}: {exc}"
        raise EnvVarError(f"{source} {name!r}: cannot import plugin module: {why}") from None
    _imported.add(name)


def import_plugins(environ=None) -> None:
    """Import every module GEMMTUNE_PLUGINS names (idempotent)."""
    for name in env_plugins(environ):
        import_plugin(name)
