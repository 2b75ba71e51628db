"""Sort token slots by expert into BLOCK_M-padded blocks, on the device: no host sync, sizes fixed by
(slots, experts, BLOCK_M) alone, so it captures in a CUDA graph at a fixed token count.

Output, for S slots with local expert ids in [0, E) (any other id: the slot is dropped):
  sorted_slots (capacity,) int32: for each padded row, the slot it holds, or S for a padding row
  block_expert (capacity // BLOCK_M,) int32: the expert of each block, -1 past the used blocks
Each expert's slots fill whole blocks of its own (in slot order); capacity covers the worst case,
S + min(E, S) * (BLOCK_M - 1) rounded up to BLOCK_M. A padding row never names a real slot, so the
GEMM masks it and never writes over a real output row.
"""

from __future__ import annotations

import torch


def capacity(n_slots: int, num_experts: int, block_m: int) -> int:
    worst = n_slots + min(num_experts, n_slots) * (block_m - 1)
    return max(block_m, -(-worst // block_m) * block_m)


def moe_align(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots, block_expert) for the flattened local ids (see the module doc); torch ops only."""
    ids = local_ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    dev = ids.device
    cap = capacity(n, num_experts, block_m)
    e = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # dropped slots sort last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, e, torch.ones_like(e))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends.new_zeros(1), ends])  # starts[E] = ends[-1]: where dropped slots go (then cut)
    firsts = torch.cumsum(counts, 0) - counts  # first sorted position of each expert's slots
    sorted_e, perm = torch.sort(e, stable=True)
    rank = torch.arange(n, device=dev) - firsts[sorted_e]
    dest = torch.where(sorted_e < num_experts, starts[sorted_e] + rank, cap)
    sorted_slots = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, dest, perm.to(torch.int32))
    block_start = torch.arange(cap // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_slots[:cap], block_expert


def moe_align_ref(local_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-Python reference of moe_align (same output, element for element)."""
    ids = [int(v) for v in local_ids.reshape(-1).tolist()]
    n = len(ids)
    cap = capacity(n, num_experts, block_m)
    rows: list[int] = []
    experts: list[int] = []
    for ex in range(num_experts):
        mine = [s for s, v in enumerate(ids) if v == ex]
        if not mine:
            continue
        nb = -(-len(mine) // block_m)
        rows += mine + [n] * (nb * block_m - len(mine))
        experts += [ex] * nb
    rows += [n] * (cap - len(rows))
    experts += [-1] * (cap // block_m - len(experts))
    return torch.tensor(rows, dtype=torch.int32), torch.tensor(experts, dtype=torch.int32)
