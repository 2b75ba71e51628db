"""Which GPU (or CPU) a table row is for: aiter's (gfx, cu_num) pair, extended to NVIDIA and CPU.

On ROCm `gfx` is the arch name (gfx942) and `cu_num` the CU count, as aiter writes them. On NVIDIA
`gfx` is the arch plus the product, `sm90-H100-80GB-HBM3` or `sm90-H200`: both have 132 SMs but
different memory bandwidth, and their winners differ (an H100 table's skinny rows measured
0.92-0.97x on an H200), so one must not silently use the other's rows. A row written with the bare
arch (`sm90`) still applies to every sm90 GPU with its SM count, after the exact rows. On the CPU
`gfx` is `cpu` and `cu_num` the logical core count.

It is also the one place that asks what the device is: `vendor` (NVIDIA, AMD or CPU), `is_gpu`,
`is_rocm` / `rocm_version` (the torch build), `capability`, and where Triton kernels run. Nothing else
reads torch.version.hip or TRITON_INTERPRET.

Where Triton kernels run. A GPU with triton installed compiles them (`triton_on_gpu`). With
TRITON_INTERPRET=1, Triton's interpreter also runs them on CPU tensors (`triton_runs_on` counts that):
slowly, and bf16 comes out wrong there (fp32 and fp16 are right). So the rule is:
- automatic choices (`impl="auto"` of the elementwise kernels, the public ops' eager paths, the
  attention tiers) take a Triton kernel only where `triton_on_gpu` holds; on the CPU they run the
  PyTorch reference, interpreter or not. The interpreter runs such a kernel only when a caller forces
  it (`impl="triton"`: the interpreter tests);
- kernels whose work is exact in the interpreter and which CPU CI is meant to exercise (MoE routing
  and glue, Triton GEMM backends declaring `Needs(triton=True)`) follow `triton_runs_on`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from dataclasses import dataclass
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


def rocm_version() -> str | None:
    """The ROCm (HIP) version this PyTorch was built with; None for a CUDA or CPU-only build."""
    return torch.version.hip


def is_rocm() -> bool:
    """Is this PyTorch a ROCm build (its "cuda" devices are AMD GPUs)?"""
    return rocm_version() is not None


# ---- the device vocabulary: every layer asks these, nobody reads torch.version.hip itself --------
NVIDIA, AMD, CPU = "nvidia", "amd", "cpu"


def _as_device(device) -> torch.device:
    if isinstance(device, torch.device):  # the hot path: a tensor's device
        return device
    return torch.device(device) if device is not None else default_device()


def vendor(device: torch.device | str | None = None) -> str:
    """Who made `device`: NVIDIA or AMD for a GPU PyTorch can use, CPU otherwise."""
    device = _as_device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return CPU
    return AMD if is_rocm() else NVIDIA


def is_gpu(device: torch.device | str | None = None) -> bool:
    return vendor(device) != CPU


def capability(device: torch.device | str | None = None) -> tuple[int, int]:
    """(major, minor) of a GPU (gfx9 is (9, x) on ROCm); (0, 0) off a GPU."""
    return facts(device).capability if is_gpu(device) else (0, 0)


# Looked up once at import: kernels ask inside torch.compile'd code, where dynamo cannot trace find_spec.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_installed() -> bool:
    return _TRITON_INSTALLED


def interpreter() -> bool:
    """TRITON_INTERPRET=1: Triton kernels run on CPU tensors through Triton's interpreter (slow; fp32
    and fp16 are right there, bf16 is not). Read at each call: tests switch it per test."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def triton_on_gpu(device: torch.device | str | None = None) -> bool:
    """Does Triton compile kernels for `device`: a GPU with triton installed (the interpreter does not
    count). What automatic kernel choices ask; see the module docstring."""
    return is_gpu(device) and triton_installed()


def triton_runs_on(device: torch.device | str | None = None) -> bool:
    """Can a Triton kernel run on `device`: a GPU with triton installed, or the CPU with the interpreter."""
    return not triton_reason(device)


def triton_reason(device: torch.device | str | None = None) -> str:
    """Why Triton kernels cannot run on `device` ("" when they can)."""
    device = _as_device(device)
    if not triton_installed():
        return "triton is not installed"
    if is_gpu(device) or (device.type == "cpu" and interpreter()):
        return ""
    if device.type == "cuda":
        return "no GPU is visible to PyTorch"
    return f"Triton runs on GPUs (or on the CPU with TRITON_INTERPRET=1), not on {device.type}"


@dataclass(frozen=True)
class Needs:
    """What a backend or kernel needs of the device; availability and the reason derive from it.

    vendors: who may run it (CPU included means it runs anywhere torch does); triton: its kernels are
    Triton (the CPU then qualifies only through the interpreter, and only with `interpreter_ok`,
    whatever `vendors` says);
    min_capability: the least GPU capability (NVIDIA's sm, e.g. (9, 0)) on NVIDIA; modules: Python
    modules that must be importable (optional extras, e.g. "nvmath")."""

    vendors: frozenset[str] = frozenset({NVIDIA, AMD, CPU})
    triton: bool = False
    interpreter_ok: bool = True
    min_capability: tuple[int, int] | None = None
    modules: tuple[str, ...] = ()

    def missing(self, device: torch.device | str | None = None) -> str:
        """The first thing `device` lacks, in words; "" when it has everything needed."""
        device = _as_device(device)
        who = vendor(device)
        for mod in self.modules:
            if importlib.util.find_spec(mod.split(".")[0]) is None:
                return f"python module {mod!r} is not installed"
        if self.triton and not triton_installed():
            return "triton is not installed"
        if who == CPU:
            interpreted = self.triton and self.interpreter_ok and device.type == "cpu"
            if interpreted and interpreter():
                return ""  # Triton's interpreter runs its kernels on the CPU
            if device.type == "cuda":
                return "no GPU is visible to PyTorch"
            if interpreted:
                return f"Triton runs on GPUs (or on the CPU with TRITON_INTERPRET=1), not on {device.type}"
            if CPU not in self.vendors or self.triton:
                return f"it needs {self._gpus()}, not {device.type}"
            return ""
        if who not in self.vendors:
            allowed = "the CPU" if self.vendors == {CPU} else self._gpus()
            return f"it needs {allowed}, not an {who.upper()} GPU"
        if self.min_capability and who == NVIDIA and capability(device) < self.min_capability:
            (major, minor), (got_major, got_minor) = self.min_capability, capability(device)
            return (
                f"it needs an NVIDIA GPU of capability >= {major}.{minor} (sm{major}{minor}), "
                f"this one is {got_major}.{got_minor}"
            )
        return ""

    def _gpus(self) -> str:
        gpus = sorted(self.vendors - {CPU})
        return " or ".join(f"an {v.upper()} GPU" for v in gpus) if gpus else "a GPU"


GPU_ONLY = frozenset({NVIDIA, AMD})


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
        if torch.version.cuda is None and not is_rocm():
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
