"""Which GPU (or CPU) a table row is for: aiter's (gfx, cu_num) pair, extended to NVIDIA and CPU.

On ROCm `gfx` is the arch name (gfx942) and `cu_num` the CU count, as aiter writes them. On NVIDIA
`gfx` is the arch plus the product, `sm90-H100-80GB-HBM3` or `sm90-H200`: both have 132 SMs but
different memory bandwidth, and their winners differ (an H100 table's skinny rows measured
0.92-0.97x on an H200), so one must not silently use the other's rows. A row written with the bare
arch (`sm90`) still applies to every sm90 GPU with its SM count, after the exact rows. On the CPU
`gfx` is `cpu` and `cu_num` the logical core count.
"""

from __future__ import annotations

import functools
import os
import re
from typing import NamedTuple

import torch

from .errors import DeviceError

# A legacy table (no gfx column) leaves gfx empty: such rows apply to any arch with their cu_num.
ANY_GFX_SENTINEL = ""


class DeviceIdentity(NamedTuple):
    gfx: str
    cu_num: int

    def gfx_aliases(self) -> tuple[str, ...]:
        """The gfx values whose rows apply here, most specific first: sm90-H200, sm90, legacy ''."""
        return tuple(dict.fromkeys((self.gfx, self.gfx.split("-", 1)[0], ANY_GFX_SENTINEL)))


def is_rocm() -> bool:
    return torch.version.hip is not None


class DeviceFacts(NamedTuple):
    """What kernels and candidate lists are sized by. One place reads them, with one off-GPU answer."""

    sms: int  # streaming multiprocessors (CUs on ROCm)
    smem_per_block: int  # bytes one program may use (opt-in limit)
    smem_per_sm: int
    l2_bytes: int
    capability: tuple[int, int]  # (0, 0) off a GPU
    rocm: bool


# Off a GPU (the CPU, Triton's interpreter, tests) candidate lists are built as for an H100, the GPU
# the project measures on, so what CI enumerates is what a GPU run would.
OFF_GPU = DeviceFacts(sms=132, smem_per_block=227 * 1024, smem_per_sm=228 * 1024, l2_bytes=50 * 2**20,
                      capability=(0, 0), rocm=False)  # fmt: skip


@functools.cache
def _facts_of(device_type: str, index: int | None) -> DeviceFacts:
    if device_type != "cuda" or not torch.cuda.is_available():
        return OFF_GPU
    props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
    block = int(getattr(props, "shared_memory_per_block_optin", 0) or (64 if is_rocm() else 99) * 1024)
    return DeviceFacts(
        sms=props.multi_processor_count,
        smem_per_block=block,
        smem_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0) or block + 1024),
        l2_bytes=int(getattr(props, "L2_cache_size", 0) or OFF_GPU.l2_bytes),
        capability=(props.major, props.minor),
        rocm=is_rocm(),
    )


def facts(device: torch.device | str | None = None) -> DeviceFacts:
    """SM count, shared memory, L2 and capability of `device` (OFF_GPU's when it is not a GPU)."""
    device = torch.device(device) if device is not None else default_device()
    return _facts_of(device.type, device.index)


@functools.cache
def _identity_of(device_type: str, index: int | None) -> DeviceIdentity:
    if device_type == "cuda":
        props = torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device())
        if is_rocm():
            arch = getattr(props, "gcnArchName", "") or "gfx"
            return DeviceIdentity(arch.split(":")[0], props.multi_processor_count)
        product = re.sub(r"[^A-Za-z0-9]+", "-", props.name.removeprefix("NVIDIA ")).strip("-")
        return DeviceIdentity(f"sm{props.major}{props.minor}-{product}", props.multi_processor_count)
    return DeviceIdentity(device_type, os.cpu_count() or 1)


def _check_cuda(device: torch.device) -> None:
    # torch raises AssertionError / RuntimeError deep inside torch.cuda for these; say what is wrong.
    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            why = f"this PyTorch build ({torch.__version__}) has no CUDA/ROCm support"
        else:
            why = "no GPU is visible to PyTorch (torch.cuda.is_available() is False)"
        raise DeviceError(f"device {str(device)!r}: {why}; use cpu, or install a GPU build of torch")
    count = torch.cuda.device_count()
    if device.index is not None and not 0 <= device.index < count:
        raise DeviceError(f"device {str(device)!r}: there are {count} GPU(s), cuda:0 to cuda:{count - 1}")


def parse_device(text: str | None) -> torch.device:
    """A --device value (cpu, cuda, cuda:N; None = cuda when available) checked to exist here."""
    if text is None:
        return default_device()
    try:
        device = torch.device(text.strip())
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {text!r} (expected cpu, cuda or cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {text!r}: gemmtune runs on cpu or cuda (ROCm GPUs are cuda in PyTorch)")
    if device.type == "cuda":
        _check_cuda(device)
    return device


def identity(device: torch.device | str | None = None) -> DeviceIdentity:
    """The (gfx, cu_num) of `device`; the current GPU when None and one exists, else the CPU.

    DeviceError when `device` is a GPU this machine does not have."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        _check_cuda(device)
    return _identity_of(device.type, device.index)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
