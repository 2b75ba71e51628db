"""Fused-MoE test inputs shared by the kernel and stage tests: one routing case -> (MoeKey, inputs), and
outputs that start NaN (kernel buffers, and the rows torch._grouped_mm leaves unwritten)."""

from __future__ import annotations

import contextlib
import zlib

import torch

_DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@contextlib.contextmanager
def nan_buffers():
    """Every output the kernels write, and every row torch._grouped_mm leaves unwritten, starts NaN."""
    from gemmtune.kernels import fused_moe as km

    saved, saved_gm = km._empty, torch._grouped_mm

    def grouped_mm(a, b, offs):
        y = saved_gm(a, b, offs=offs)
        y[int(offs[-1]) :] = float("nan")
        return y

    km._empty = lambda shape, like, dtype=None: torch.full(shape, float("nan"), device=like.device,
                                                           dtype=dtype or like.dtype)  # fmt: skip
    torch._grouped_mm = grouped_mm
    try:
        yield
    finally:
        km._empty, torch._grouped_mm = saved, saved_gm


def make_case(case, device):
    from gemmtune.families.fmoe import MoeKey, route

    dt, T, H, inter, E, topk, routing, _, _, _, extra = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    shared = 1 if extra == "shared" else 0
    e_all = E + shared
    gated = 1 if extra == "ungated" else 2
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(e_all, gated * inter, H, generator=g) / H**0.5
    w2 = torch.randn(e_all, H, inter, generator=g) / inter**0.5
    n_routed = 8 if extra == "ep" else E
    weights, ids = route(torch.randn(T, n_routed, generator=g), topk)
    if routing == "one":
        ids[:, 0] = n_routed - 1
        ids[:, 1:] = torch.arange(topk - 1).expand(T, topk - 1)
    elif routing == "low":
        ids = torch.stack([torch.randperm(topk + 1, generator=g)[:topk] for _ in range(T)])
    elif routing == "rep":  # tokens share experts on purpose: topk + 1 experts drawn from all, each hit ~T times
        pool = torch.randperm(n_routed, generator=g)[: topk + 1]
        ids = torch.stack([pool[(t + torch.randperm(topk, generator=g)) % (topk + 1)] for t in range(T)])
    elif routing == "spread":  # no expert hit twice (needs T * topk <= E): token t takes its own topk experts
        ids = torch.randperm(n_routed, generator=g)[: T * topk].view(T, topk)
    expert_map = None
    if extra == "ep":  # this rank holds global experts 2, 5, 7 as local 0, 1, 2
        expert_map = torch.full((8,), -1, dtype=torch.int32)
        expert_map[torch.tensor([2, 5, 7])] = torch.arange(3, dtype=torch.int32)
    if extra == "badid":
        ids[T // 2, 0] = E + 3
    key = MoeKey(T, H, inter, e_all, topk, "ActivationType.Silu", _DT[dt], _DT[dt], _DT[dt], "QuantType.No",
                 gated == 2, extra == "doweight", 8 if extra == "ep" else 0, shared)  # fmt: skip
    to = lambda t: t.to(device)  # noqa: E731
    ids = to(ids.to(torch.int32))
    if extra == "idsview":  # the router's ids a column slice of a wider buffer: their rows are not contiguous
        wide = torch.full((T, topk + 3), -7, dtype=torch.int32, device=ids.device)
        wide[:, 1 : 1 + topk] = ids
        ids = wide[:, 1 : 1 + topk]
    inputs = (to(x.to(_DT[dt])), to(w1.to(_DT[dt])), to(w2.to(_DT[dt])), to(weights), ids,
              None if expert_map is None else to(expert_map))  # fmt: skip
    return key, inputs
