"""What the elementwise kernels (norms, activations, rope) share: optional Triton, dtypes, output alloc.

HAS_TRITON says the triton module imported here (it guards the kernel definitions); whether a kernel
runs on a device is device.py's question (`triton_on_gpu`, `triton_runs_on`)."""

from __future__ import annotations

import torch

from .. import settings
from ..device import NVIDIA, Needs

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the PyTorch references still work
    triton = None
    tl = None
    HAS_TRITON = False

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Programmatic dependent launch (Hopper+, CUDA): a kernel launched with launch_pdl=True may start while
# the kernel before it finishes; it must gdc_wait() before touching anything that kernel wrote, and
# gdc_launch_dependents() lets the kernel after it start early in turn. Absent from older Tritons.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    HAS_PDL = True
except ImportError:
    gdc_launch_dependents = gdc_wait = None  # only named inside `if PDL:` branches, never compiled then
    HAS_PDL = False


# PDL's device side: an NVIDIA GPU of sm90+ compiling the kernel (the interpreter has no PDL).
PDL_NEEDS = Needs(vendors=frozenset({NVIDIA}), triton=True, interpreter_ok=False, min_capability=(9, 0))


def pdl_reason(device: torch.device) -> str:
    """Why PDL launches are off on `device` ("" when they are on)."""
    why = PDL_NEEDS.missing(device)
    if why:
        return why
    if not HAS_PDL:
        return "this Triton has no gdc_wait"
    if not settings.PDL.get():
        return f"{settings.PDL.name}={settings.PDL.raw()}"
    return ""


def pdl_enabled(device: torch.device) -> bool:
    """PDL launches need CUDA sm90+ and a Triton with gdc_wait; GEMMTUNE_PDL=0 turns them off
    everywhere (tuned PDL rows then run as their plain configs). Decided once per device (the
    environment is read then), since elementwise kernels ask on every launch."""
    key = (device.type, device.index)
    on = _pdl_on.get(key)
    if on is None:
        on = _pdl_on[key] = not pdl_reason(device)
    return on


_pdl_on: dict[tuple[str, int | None], bool] = {}


def pdl_kwargs(device: torch.device) -> dict:
    """Launch arguments for a kernel with a `PDL` constexpr that waits on its producer (elementwise kernels)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(device) else {}


def empty_out(shape, like: torch.Tensor) -> torch.Tensor:
    """Output allocation (tests swap in a NaN-filled one to prove every element is written)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype)


class ArrivalCounters:
    """int32 counters that a split kernel's programs count their arrivals on, so the last one to arrive
    finishes the work (fused_moe's split stage 1, the static KV-cache write, the decode attention merge).
    They are zero between calls (the last arrival re-arms its own), so one set serves every call of its
    owner, but not two of its calls running at once. Allocated on first use: a call before CUDA-graph
    capture (the warm-up that compiles the kernels) allocates them outside the graph."""

    def __init__(self) -> None:
        self._counters: torch.Tensor | None = None

    def get(self, n: int, device: torch.device) -> torch.Tensor:
        c = self._counters
        if c is None or c.numel() < n or c.device != device:
            self._counters = c = torch.zeros(n, dtype=torch.int32, device=device)
        return c
