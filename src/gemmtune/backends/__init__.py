"""Backend registry: each backend says whether it runs here, which solutions fit a shape, and runs one.

Backends are registered per GEMM family under their libtype: `get("torch")` is the a16w16 torch
backend, `get("torch", "batched")` the batched one (torch.bmm). A backend module may define several.

Built-in backends are imported lazily so that a missing optional dependency (triton, nvmath-python)
makes that backend unavailable, with the reason kept for `gemmtune doctor`, instead of failing import.
"""

from __future__ import annotations

import importlib

import torch

from .base import Backend, Runner, Solution, stable_solidx

# module path -> class name, in preference order for display.
_BUILTIN = {
    "gemmtune.backends.torch_backend": ("TorchBackend", "TorchBatchedBackend"),
    "gemmtune.backends.skinny": ("SkinnyBackend",),
    "gemmtune.backends.triton_gemm": ("TritonGemmBackend",),
    "gemmtune.backends.blaslt": ("BlasLtBackend",),
    "gemmtune.backends.quantized": (
        "TorchA8W8Backend",
        "TorchA8W8BPreshuffleBackend",
        "TorchBlockscaleBackend",
        "TorchBlockscaleBPreshuffleBackend",
        "TritonA8W8Backend",
        "TritonA8W8BPreshuffleBackend",
        "TritonBlockscaleBackend",
        "TritonBlockscaleBPreshuffleBackend",
    ),  # fmt: skip
    "gemmtune.backends.skinny_quant": ("SkinnyA8W8Backend", "SkinnyA8W8BPreshuffleBackend"),
    "gemmtune.backends.skinny_blockscale": ("SkinnyBlockscaleBackend", "SkinnyBlockscaleBPreshuffleBackend"),
    "gemmtune.backends.moe": ("TorchMoeBackend", "TritonMoeBackend"),
    "gemmtune.backends.batched_triton": ("TritonBatchedBackend",),
    "gemmtune.backends.blaslt_batched": ("BlasLtBatchedBackend",),
    "gemmtune.backends.epilogue": ("TorchEpilogueBackend", "TritonEpilogueBackend"),
    "gemmtune.backends.blaslt_epilogue": ("BlasLtEpilogueBackend",),
    "gemmtune.backends.sparse": ("TorchSparseBackend",),
    "gemmtune.backends.batched_a8w8": ("TorchBatchedA8W8Backend", "TritonBatchedA8W8Backend"),
}

_registry: dict[tuple[str, str], Backend] = {}
_import_errors: dict[str, str] = {}
_loaded = False


def register(backend: Backend) -> Backend:
    """Add (or replace) a backend under (its family, its `name`: the libtype its table rows carry)."""
    if not backend.name:
        raise ValueError(f"backend {type(backend).__name__} has no name")
    _registry[(backend.family, backend.name)] = backend
    return backend


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module, classes in _BUILTIN.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # the backend module itself is not part of this build
                continue
            _import_errors[module.rsplit(".", 1)[-1]] = f"missing dependency: {exc.name}"
            continue
        except ImportError as exc:
            _import_errors[module.rsplit(".", 1)[-1]] = str(exc)
            continue
        for cls in classes:
            if hasattr(mod, cls):
                register(getattr(mod, cls)())


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


__all__ = [
    "Backend",
    "Runner",
    "Solution",
    "all_backends",
    "available",
    "families_with_backends",
    "get",
    "import_errors",
    "register",
    "stable_solidx",
]
