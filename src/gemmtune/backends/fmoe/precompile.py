"""What the fmoe triton backend compiles ahead of a tune (tuner/search.py precompile_all builds it in the one
pool of compile processes, which fills Triton's on-disk cache): every Triton kernel the tune of the keys
would otherwise compile in the tuning process, one after another.

Items, one per distinct compile signature (launches.py) over all keys:
  - every stage config the stage phase times (the backend's stage sweep, both stages),
  - the heuristic pair's stages (the default; on a GPU of another SM count than the sweep's it differs),
  - the grouped_mm pair's Triton glue (sort, act*mul, combine), where that pair is a candidate.
A stage item is named by the bare config (`moe2_...`): the backend runs it as a one-stage solution, the
stage alone on the family's inputs (stage 2 on zero rows), as the stage phase runs it. The glue item is
the grouped_mm pair itself. An item whose launches earlier items all make is left out.

Each item is built on a stand-in key: the real key's experts can be many GB (DeepSeek-V3, 256 experts:
7.5 GB for stage 1), and the pool runs 16 processes on one GPU. The stand-in is the smallest key found
(tokens, experts, intermediate and hidden size lowered in turn) whose launches have the item's exact
signature, so it takes the same path (grid over slots or experts, split or not) into the same binaries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from ...families.fmoe import MoeKey, join_name, split_name
from ...kernels import fused_moe as kmoe
from ..base import Runner, Solution
from .launches import glue_launches, stage_launches
from .stages import GM, parse_stage, stage_runner

Sweep = Callable[[MoeKey, int], list[kmoe.MoeGemmConfig]]  # the stage configs the stage phase times
Describe = Callable[[MoeKey], tuple]  # an item's launches for a key

_DIMS = ("token", "expert", "inter_dim", "model_dim")  # lowered in this order: fewer tokens let experts go lower


def _below(v: int) -> list[int]:
    """Values below v worth trying for a stand-in, ascending. Each is v mod 16 (Triton specializes ints on
    divisibility by 16, and so any product keeps its own); every one below 1024, past that the least one
    above each power of two (the launchers' block sizes, bins and chunks follow powers of two)."""
    r = v % 16
    out = set(range(r or 16, min(v, 1024), 16))
    p = 1024
    while p < v:
        out.add(p + 1 + (r - p - 1) % 16)
        p *= 2
    return sorted(x for x in out if x < v)


def _runnable(key: MoeKey) -> bool:
    return key.token >= 1 and key.local_routed >= 1 and key.num_routed >= key.topk


def stand_in(key: MoeKey, describe: Describe) -> MoeKey:
    """The smallest key found whose launches describe(key) has: each of _DIMS lowered in turn to the least
    value that keeps them."""
    want = describe(key)
    best = key
    for dim in _DIMS:
        for v in _below(getattr(best, dim)):
            k = best._replace(**{dim: v})
            if _runnable(k) and describe(k) == want:
                best = k
                break
    return best


def _units(key: MoeKey, solutions: Iterable[Solution], sweep: Sweep):
    """(item name, describe) of what a tune of `key` compiles: the candidate pairs' stages or glue, then
    the stage sweep."""
    for sol in solutions:
        stages = [parse_stage(n, s) for s, n in enumerate(split_name(sol.kernel_name), start=1)]
        if GM in stages:
            yield join_name(GM, GM), glue_launches
        yield from ((s.name, functools.partial(stage_launches, cfg=s)) for s in stages if s not in (GM, None))
    for stage in (1, 2):
        yield from ((c.name, functools.partial(stage_launches, cfg=c)) for c in sweep(key, stage))


def compile_items(jobs: list[tuple[Solution, MoeKey]], sweep: Sweep) -> list[tuple[str, MoeKey]]:
    """(item name, stand-in key) for the (solution, key) jobs of the backend's candidates: one item per
    distinct signature among every key's units (_units), each built on its stand-in."""
    by_key: dict[MoeKey, list[Solution]] = {}
    for sol, key in jobs:
        by_key.setdefault(key, []).append(sol)
    made: set = set()  # every launch an item makes
    items: list[tuple[str, MoeKey, Describe]] = []
    for key, sols in by_key.items():
        for name, describe in _units(key, sols, sweep):
            launches = set(describe(key))
            if launches <= made:
                continue
            made |= launches
            items.append((name, key, describe))
    return [(name, stand_in(key, describe)) for name, key, describe in items]


def one_stage(name: str) -> kmoe.MoeGemmConfig | None:
    """The Triton stage config a bare item name (no `|`) is, else None."""
    return kmoe.MoeGemmConfig.parse(name) if "|" not in name else None


def one_stage_runner(key: MoeKey, cfg: kmoe.MoeGemmConfig) -> Runner:
    """Stage cfg alone on the family's inputs, as the stage phase runs it (stage 2 on zero rows in slot order)."""
    run = stage_runner(key, cfg.stage, cfg, triton_glue=True)
    if cfg.stage == 1:
        return run
    slots = key.token * (key.topk + key.shared_expert)

    def second(hidden, *rest):
        return run(torch.zeros(slots, key.inter_dim, dtype=hidden.dtype, device=hidden.device), hidden, *rest)

    return second
