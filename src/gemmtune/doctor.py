"""Environment report: what `gemmtune doctor` prints (device, versions, backends, settings)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch

from . import backends, settings
from .device import default_device, facts, identity, rocm_version, vendor
from .errors import EnvVarError


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _pdl_status(dev: torch.device) -> str:
    from .kernels._common import pdl_reason

    try:
        why = pdl_reason(dev)
    except EnvVarError as exc:
        return f"unknown ({exc})"
    return f"off ({why})" if why else "on (GEMMTUNE_PDL=0 turns it off)"


def environment_report() -> dict[str, object]:
    dev = default_device()
    ident = identity(dev)
    report: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "gemmtune": _version("gemmtune"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "nvmath-python": _version("nvmath-python"),
        "cuda (torch built with)": torch.version.cuda or "-",
        "rocm/hip (torch built with)": rocm_version() or "-",
        "device": str(dev),
        "gfx": ident.gfx,
        "cu_num": ident.cu_num,
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        report["device name"] = props.name
        report["vendor"] = vendor(dev).upper()
        report["memory GiB"] = round(props.total_memory / 2**30, 1)
        report["L2 MiB"] = round(facts(dev).l2_bytes / 2**20, 1)
        report["gpu count"] = torch.cuda.device_count()
    else:
        report["device name"] = platform.processor() or "cpu"
    report["programmatic dependent launch"] = _pdl_status(dev)
    if dev.type == "cuda":  # runs a few small GEMMs once (backends/lib/scaled_mm_blockwise.py)
        from .backends.lib.scaled_mm_blockwise import cuda_support

        report["fp8 block-scaled torch._scaled_mm"] = cuda_support(dev.index).describe()
    rows = {}
    for name, b in backends.all_backends().items():
        rows[name] = "available" if b.is_available(dev) else f"unavailable: {b.unavailable_reason(dev)}"
    for name, why in backends.import_errors().items():
        rows.setdefault(name, f"unavailable: {why}")
    report["backends"] = rows
    report["GEMM families"] = family_status(dev)
    report["settings"] = effective_settings()
    return report


def effective_settings() -> dict[str, str]:
    """Every GEMMTUNE_* variable (each family's table variable too): its value in effect and where it
    came from (environment, default, or the API call that overrides it)."""
    from . import families

    return settings.effective(names=[fam.env_var for fam in families.all_families()])


def family_status(dev: torch.device) -> dict[str, str]:
    """Each family: the backends that run it here, or why its tables load but nothing runs from them."""
    from . import families

    out = {}
    for fam in families.all_families():
        here = [n for n, b in backends.all_backends(fam.name).items() if b.is_available(dev)]
        why = fam.unrunnable or ("" if here else "no backend available here")
        out[fam.name] = f"tables load, rows fall back: {why}" if why else f"runs here ({', '.join(here)})"
    return out
