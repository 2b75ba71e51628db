"""Backend registry: each backend says whether it runs here, which solutions fit a shape, and runs one.

Layout: `backends/<family group>/<library>[_<kernel kind>].py` (library: `pytorch` for libtype torch,
`triton`, `blaslt`), `<group>/policy.py` for what the group's families run untuned, and `lib/` for the
library machinery several groups share. The registry is built from declarations: every module of every
group package (each subpackage but lib/) is imported once, and its module-level `BACKENDS` (backend
instances) and `POLICIES` ({family: policy}) are registered; adding a backend to a family is one new
module. A plugin (GEMMTUNE_PLUGINS) registers a whole family with one call, `register_family(spec,
*backend_modules)`, or adds backends to a family with `register` / `register_policy`.

Backends are registered per GEMM family under their libtype: `get("torch")` is the a16w16 torch
backend, `get("torch", "batched")` the batched one (torch.bmm). A module whose import fails for a
missing optional dependency (triton, nvmath-python) leaves its backends out, with the reason kept for
`gemmtune doctor` (`import_errors`), instead of failing the import of gemmtune.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType

import torch

from .. import families
from ..concurrency import Once
from ..families import Family
from .base import Backend, Runner, Solution, stable_solidx

# A family's default policy: (key, device) -> (backend name, solution), what runs `key` with no table row.
Policy = Callable[[tuple, torch.device], tuple[str, Solution]]

LIB_PACKAGE = "lib"  # shared machinery, no backends

_registry: dict[tuple[str, str], Backend] = {}
_policies: dict[str, Policy] = {}
_import_errors: dict[str, str] = {}
_builtins = Once()  # the group modules, imported by the first look-up of any thread


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under (its family, its `name`: the libtype its table rows carry)."""
    if not backend.name:
        raise ValueError(f"backend {type(backend).__name__} has no name")
    _registry[(backend.family, backend.name)] = backend
    return backend


def register_policy(family: str, policy: Policy) -> Policy:
    """Set what an untuned key of `family` runs: policy(key, device) -> (backend name, solution)."""
    _policies[family] = policy
    return policy


def load_module(module: str) -> None:
    """Import one backend module and register what it declares (BACKENDS, POLICIES); a missing
    dependency is recorded in import_errors() under the module's name within backends/."""
    short = module.removeprefix(__name__ + ".").replace(".", "/")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        _import_errors[short] = f"missing dependency: {exc.name}"
        return
    except ImportError as exc:
        _import_errors[short] = str(exc)
        return
    register_declared(mod)


def register_declared(module: ModuleType) -> None:
    """Register what a backend module declares: its BACKENDS and its POLICIES ({family: policy})."""
    for backend in getattr(module, "BACKENDS", ()):
        register(backend)
    for family, policy in getattr(module, "POLICIES", {}).items():
        register_policy(family, policy)


def register_family(family: Family, *backend_modules: ModuleType) -> Family:
    """A GEMM family from outside gemmtune in one call: its spec (families.register) and what each backend
    module declares (BACKENDS, POLICIES), as a builtin group folder's modules do. The family's op needs no
    call: `ops.hot_path.public_op` declares it when its module is imported."""
    families.register(family)
    for module in backend_modules:
        register_declared(module)
    return family


def group_modules() -> list[str]:
    """The dotted names of every module of every family group package (lib/ excluded), in name order."""
    out = []
    for group in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not group.ispkg or group.name == LIB_PACKAGE:
            continue
        pkg = importlib.import_module(f"{__name__}.{group.name}")
        out += [f"{pkg.__name__}.{m.name}" for m in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name)]
    return out


def _load_group_modules() -> None:
    for module in group_modules():
        load_module(module)


def _load_builtins() -> None:
    _builtins.run(_load_group_modules)


def get(name: str, family: str = "a16w16") -> Backend | None:
    _load_builtins()
    return _registry.get((family, name))


def all_backends(family: str = "a16w16") -> dict[str, Backend]:
    """The backends of `family`, by libtype."""
    _load_builtins()
    return {n: b for (f, n), b in _registry.items() if f == family}


def families_with_backends() -> set[str]:
    _load_builtins()
    return {f for f, _ in _registry}


def available(device: torch.device, family: str = "a16w16") -> dict[str, Backend]:
    return {n: b for n, b in all_backends(family).items() if b.is_available(device)}


def import_errors() -> dict[str, str]:
    _load_builtins()
    return dict(_import_errors)


def default(family: str, key, device: torch.device) -> tuple[Backend, Solution]:
    """What runs `key` of `family` on `device` with no table row: the family's policy's (backend,
    solution); for a family without a policy, the first backend (torch first) with a default_solution.
    LookupError when the family has nothing that runs here."""
    _load_builtins()
    device = torch.device(device)
    policy = _policies.get(family)
    if policy is not None:
        name, sol = policy(key, device)
        backend = _registry.get((family, name))
        if backend is None:
            raise LookupError(f"the {family} policy chose backend {name!r}, which is not registered")
        return backend, sol
    found = all_backends(family)
    for name in sorted(found, key=lambda n: n != "torch"):
        backend = found[name]
        sol = backend.default_solution(key, device) if backend.is_available(device) else None
        if sol is not None:
            return backend, sol
    raise LookupError(f"the {family} family has no default here: no policy, and no backend offers a default_solution")


__all__ = [
    "Backend",
    "Policy",
    "Runner",
    "Solution",
    "all_backends",
    "available",
    "default",
    "families_with_backends",
    "get",
    "import_errors",
    "load_module",
    "register",
    "register_declared",
    "register_family",
    "register_policy",
    "stable_solidx",
]
