"""What the fmoe triton backend compiles ahead of a tune (tuner/search.py precompile_all builds it in the one
pool of compile processes, which fills Triton's on-disk cache): every Triton kernel the tune of the keys
would otherwise compile in the tuning process, one after another.

Units, each a Triton stage config (`moe1_...`, the stage alone, as the stage phase runs it; stage 2 on zero
rows) or the grouped_mm pair's Triton glue, in a call form (launches.FORMS; none: the family's inputs as
made), on a key. What a tune of a key runs on them:
  - every stage config the stage phase times (the backend's stage sweep, both stages; the first
    --stage-limit of each where the options give one),
  - the backend's whole candidates (the heuristic pair's stages, the grouped_mm pair's glue), in every call
    form: the full check calls the family's default in all of them (the tuner's `inputs` phase) and the
    candidate that would win (`confirm`),
and with the tune's scope (tuner/search.py CompileScope: the keys' M floors), the range verification
(step 6), at each token count it checks a winner at: the candidates that can win (all but the default) in
every call form (their full check) and the family's default there (timed beside them).
The stage pairs that the stage phase forms (the fastest configs of each stage) can win too; which pairs
they are is timed, not known ahead, so the fast search compiles the would-be winner's other call forms
(its full check) and token counts (its range) in the tuning process: a pool process compiles a binary
~10x cheaper in wall time than the tuning process (16 at once), yet a given config wins too rarely for
all of them (518 binaries over exp_tune_speed's 12 keys) to pay. The exhaustive search gives every pair
the full check: there the scope adds every stage config in every call form.

Items, one per distinct compile signature (launches.py) over all keys: a unit whose launches earlier items
all make is left out. An item is named by its unit and form (`moe1_...`, `moe2_...+ids32`,
`grouped_mm|grouped_mm+strided`) and built by ItemBuilder, on a stand-in key: the real key's experts can
be many GB (DeepSeek-V3, 256 experts: 7.5 GB for stage 1), and the pool runs 16 processes on one GPU. The
stand-in is the smallest key found (tokens, experts, intermediate and hidden size lowered in turn) whose
launches have the item's exact signature, so it takes the same path (grid over slots or experts, split or
not) into the same binaries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch

from ...families.fmoe import FAMILY, MoeKey, join_name, split_name
from ...kernels import fused_moe as kmoe
from ..base import Solution
from .launches import FORMS, glue_launches, stage_launches
from .stages import GM, pair_runner, parse_stage, stage_runner

Sweep = Callable[[MoeKey, int], list[kmoe.MoeGemmConfig]]  # the stage configs the stage phase times
Describe = Callable[[MoeKey], tuple]  # an item's launches for a key
GLUE = join_name(GM, GM)  # the grouped_mm pair: its unit is the Triton glue around torch._grouped_mm
LIBTYPE = "triton"  # the backend whose kernels these are (a default of another backend compiles nothing here)

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


# ---- units: an item's name <-> what it runs and launches ------------------------------------------------
def item_name(unit: str, form: str = "") -> str:
    """`unit` (a stage config's name or GLUE) in call form `form` ('' as made)."""
    return f"{unit}+{form}" if form else unit


def parse_item(name: str) -> tuple[kmoe.MoeGemmConfig | str, str]:
    """(the stage config or GLUE, the call form) an item name spells; ValueError for another name."""
    unit, _, form = name.partition("+")
    if form and form not in FORMS:
        raise ValueError(f"{name!r}: unknown call form {form!r} (known: {', '.join(FORMS)})")
    if unit == GLUE:
        return GLUE, form
    cfg = kmoe.MoeGemmConfig.parse(unit)
    if cfg is None:
        raise ValueError(f"not an fmoe precompile item: {name!r}")
    return cfg, form


def describe_item(name: str) -> Describe:
    """The launches of item `name` for a key (launches.py)."""
    unit, form = parse_item(name)
    if unit == GLUE:
        return functools.partial(glue_launches, form=form)
    return functools.partial(stage_launches, cfg=unit, form=form)


def item_runner(name: str, key: MoeKey):
    """runner(*inputs) of item `name` on `key`'s inputs (the family's, as made): it runs the unit in the
    item's call form (the full check's inputs), a stage as the stage phase runs it (stage 2 on zero rows)."""
    unit, form = parse_item(name)
    if unit == GLUE:
        run = pair_runner(key, GM, GM, triton_glue=True)
    elif unit.stage == 1:
        run = stage_runner(key, 1, unit, triton_glue=True)
    else:
        second = stage_runner(key, 2, unit, triton_glue=True)
        slots = key.slots

        def run(hidden, *rest):
            return second(torch.zeros(slots, key.inter_dim, dtype=hidden.dtype, device=hidden.device), hidden, *rest)

    if not form:
        return run
    label = FORMS[form]

    def in_form(*inputs):
        (args,) = [args for what, args, _ in FAMILY.check_variants(key, inputs) if what == label]
        return run(*args)

    return in_form


class ItemBuilder:
    """Builds the fmoe triton backend's precompile items in a pool process (backends/lib/triton_tiles.py):
    runs the item once on its key's inputs, which compiles its kernels into Triton's cache."""

    def build_item(self, name: str, key: MoeKey, device: torch.device) -> None:
        (inputs,) = FAMILY.make_inputs(key, device, 1, 0)
        item_runner(name, key)(*inputs)


# ---- what a tune of the keys compiles ------------------------------------------------------------------
def _stages(sol: Solution) -> list:
    return [parse_stage(n, s) for s, n in enumerate(split_name(sol.kernel_name), start=1)]


def _solution_units(sol: Solution, form: str = "") -> list[str]:
    """The item names of solution `sol`'s Triton kernels in call form `form`: its Triton stages, the glue
    where a stage is grouped_mm."""
    stages = _stages(sol)
    out = [item_name(GLUE, form)] if GM in stages else []
    return out + [item_name(s.name, form) for s in stages if s not in (GM, None)]


def _every_form(sol: Solution) -> list[str]:
    return [n for form in ("", *FORMS) for n in _solution_units(sol, form)]


def _units(key: MoeKey, solutions: list[Solution], sweep: Sweep, scope) -> Iterable[tuple[str, MoeKey]]:
    """(item name, key) of what a tune of `key` compiles (the module doc): the candidate pairs' units, the
    stage sweep, the candidates' other call forms; with a scope, the range verification's token counts."""
    limit = scope.opts.stage_limit if scope is not None else None
    sweeps = [c for stage in (1, 2) for c in sweep(key, stage)[:limit]]
    for sol in solutions:
        yield from ((n, key) for n in _solution_units(sol))
    yield from ((c.name, key) for c in sweeps)
    for sol in solutions:
        yield from ((n, key) for n in _every_form(sol))
    if scope is None:
        return
    if scope.opts.search != "fast":  # every pair gets the full check: the stage configs in every call form
        yield from ((item_name(c.name, form), key) for form in FORMS for c in sweeps)
    default = scope.default(key)
    can_win = [s for s in solutions if s != default]  # the default never is a finalist: it is timed as itself
    for km in scope.range_keys(key):
        for sol in can_win:
            yield from ((n, km) for n in _every_form(sol))
        there = scope.default(km)
        if there is not None and there.libtype == LIBTYPE:
            yield from ((n, km) for n in _solution_units(there))


def compile_items(jobs: list[tuple[Solution, MoeKey]], sweep: Sweep, scope=None) -> list[tuple[str, MoeKey, type]]:
    """(item name, stand-in key, ItemBuilder) for the (solution, key) jobs of the backend's candidates: one
    item per distinct signature among every key's units (_units), each built on its stand-in. `scope`
    (tuner/search.py CompileScope, optional): the tune's options, the default at a key and the keys at the
    range verification's token counts."""
    by_key: dict[MoeKey, list[Solution]] = {}
    for sol, key in jobs:
        by_key.setdefault(key, []).append(sol)
    made: set = set()  # every launch an item makes
    items: list[tuple[str, MoeKey]] = []
    for key, sols in by_key.items():
        for name, k in _units(key, sols, sweep, scope):
            launches = set(describe_item(name)(k))
            if launches <= made:
                continue
            made |= launches
            items.append((name, k))
    return [(name, stand_in(k, describe_item(name)), ItemBuilder) for name, k in items]
