"""The 8-bit formats the quantized GEMMs take: fp8 e4m3 (OCP `fn` on NVIDIA, `fnuz` on MI300) and int8.

The fnuz variants (no negative zero, bias 8, max 240) are what aiter's MI300 tables name; they parse
and quantize here so those tables read, but NVIDIA tensor cores only run the OCP format.
"""

from __future__ import annotations

import torch

from ..device import AMD, vendor

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_FNUZ = getattr(torch, "float8_e4m3fnuz", None)
FP8_DTYPES = tuple(d for d in (FP8, FP8_FNUZ) if d is not None)
QUANT_DTYPES = (torch.int8, *FP8_DTYPES)
SCALE_DTYPE = torch.float32  # every scale is fp32, as aiter, vLLM and the fp8 checkpoints store them
BLOCK = 128  # block-scale group: 1x128 activation groups, 128x128 weight blocks (DeepSeek-V3)

_NAMES = {"fp8": FP8, "int8": torch.int8, "fp8_fnuz": FP8_FNUZ}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def is_quant_dtype(dtype: torch.dtype) -> bool:
    return dtype in QUANT_DTYPES


def qmax(dtype: torch.dtype) -> float:
    """The largest finite magnitude of `dtype` (448 for e4m3fn, 240 for e4m3fnuz, 127 for int8)."""
    if dtype == torch.int8:
        return 127.0
    if is_fp8(dtype):
        return float(torch.finfo(dtype).max)
    raise ValueError(f"{dtype} is not an 8-bit quantized dtype (expected int8 or float8_e4m3fn/fnuz)")


def quant_dtype(name: str | torch.dtype) -> torch.dtype:
    """'fp8' / 'int8' / 'fp8_fnuz' (or the dtype itself) -> the torch dtype; ValueError otherwise."""
    if isinstance(name, torch.dtype):
        dt = name
    else:
        dt = _NAMES.get(str(name).strip().lower().replace("-", "_"))
    if dt is None or dt not in QUANT_DTYPES:
        raise ValueError(f"unknown quantized dtype {name!r} (expected 'fp8', 'int8' or 'fp8_fnuz' in this torch)")
    return dt


def native_fp8(device: torch.device | None = None) -> torch.dtype:
    """The fp8 e4m3 flavour this GPU's tensor cores take: fnuz on MI300 (gfx942), OCP fn elsewhere."""
    if device is not None and vendor(device) == AMD:
        arch = torch.cuda.get_device_properties(device).gcnArchName
        if "gfx94" in arch and FP8_FNUZ is not None:
            return FP8_FNUZ
    return FP8
