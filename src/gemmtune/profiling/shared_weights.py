"""Contender copies of a model that does not fit on its device once per contender.

bench-model gives each contender (optimize, quantize) its own deep copy of the stock model. A cut
DeepSeek-V3 (1 dense + 3 MoE layers: 75 GiB of bf16 weights) fits an 80 GB GPU once, not twice. Such a
model's copies share stock's parameters instead: optimize() builds new tensors where it changes a
weight (fused q/k/v, 8-bit weights) and reads the others as they are, so sharing is exact as long as
nothing writes a shared parameter in place. That is checked, not assumed: each shared parameter's
address and the sum of its bit patterns are taken before the copies are optimized and compared after.
"""

from __future__ import annotations

import copy

import torch

FIT_FRACTION = 0.85  # of the device's memory the weights of every copy may take; the rest: activations, graphs
_SLICE = 1 << 26  # elements summed at a time (512 MiB as int64)
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sharing_reason(weights: int, copies: int, device_memory: int) -> str:
    """Why `copies` contender copies must share the weights (`weights` bytes) on a device of
    `device_memory` bytes, or "" when every copy fits beside the stock model."""
    if copies < 1 or weights * (1 + copies) <= FIT_FRACTION * device_memory:
        return ""
    gib = 2**30
    return (
        f"the contenders share stock's parameters: {1 + copies} copies of {weights / gib:.1f} GiB of weights "
        f"would not fit {FIT_FRACTION:.0%} of the device's {device_memory / gib:.1f} GiB; each shared parameter is "
        "checked unchanged after optimize()"
    )


def must_share(model: torch.nn.Module, copies: int) -> str:
    """sharing_reason for `model` on its device ("" off CUDA: host memory is not the limit timed here)."""
    params = list(model.parameters())
    if not params or params[0].device.type != "cuda":
        return ""
    weights = sum(p.numel() * p.element_size() for p in params)
    return sharing_reason(weights, copies, torch.cuda.get_device_properties(params[0].device).total_memory)


def copy_model(model: torch.nn.Module, share: bool) -> torch.nn.Module:
    """A deep copy of `model`; with share, one whose parameters are the very tensors of `model`."""
    if not share:
        return copy.deepcopy(model)
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


def fingerprint(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """name -> (address, sum of the parameter's bit patterns as integers): changes with any write."""
    out = {}
    for name, p in model.named_parameters():
        bits = p.detach().contiguous().view(_INT_VIEW[p.element_size()]).reshape(-1)
        # in slices: the int64 copy of a whole 14 GiB expert tensor would need 56 GiB
        total = sum(int(bits[i : i + _SLICE].sum(dtype=torch.int64)) for i in range(0, bits.numel(), _SLICE))
        out[name] = (p.data_ptr(), total)
    return out


def check_unchanged(before: dict[str, tuple[int, int]], model: torch.nn.Module) -> None:
    """RuntimeError naming the first shared parameter that a contender's optimize() wrote in place."""
    after = fingerprint(model)
    for name, mark in before.items():
        if after.get(name) != mark:
            raise RuntimeError(
                f"bench-model: parameter {name} of the stock model changed while the contenders were built "
                "(optimize() wrote a shared weight in place); the shared-weights mode cannot time this model"
            )
