"""Tuning from a donor table (`gemmtune tune SHAPES --from DONOR.csv`): a table tuned on another GPU
kind names, per key, a winner that most likely carries over; this GPU times only that winner, a few of
its neighbours in its backend's solution space, the default and a few of the default's neighbours,
instead of every candidate.

The donor's rows are matched by key alone (any gfx/cu_num; several rows of one key give every
distinct solution they name). A key the donor has no row for, but whose shape (the key but its M) it
tuned at other Ms, takes the rows of the nearest tuned M below and above it, the nearer first: a table
tuned at a few Ms seeds the Ms between them and beyond, as its runtime would answer them from its
nearest rows; the search decides here. The search itself is the full tune's (search.py: check, screen, final
timing against the default with its noise rule, head-to-head, M-range verification), run over that
short list; a key of a shape the donor never tuned, or whose donor solutions cannot run here, gets
the full search.

Neighbours: a solution's kernel name is read as `_`-separated fields, each a label with a number
(`bm128`, `s4`, `sk2f`) or a literal (`tg`, `tma`, `fa`). A candidate of the same backend for this key
is one step away when its name differs in exactly one numbered field (one step along one axis: tile
sizes, warps, stages, split-K, cuBLASLt's custom option or cluster shape; the nearest value below and
above on each axis) or has one literal flag field more or less (a mode toggled: cuBLASLt's `_fa` fast
accumulation, Triton's `_tma`), toggles first, then one step of each axis before a second, at most
MAX_NEIGHBOURS per origin. The origins are the donor's solutions and, where the family's default is a
solution of a backend in use, the default itself: a new GPU's library may offer there what the donor's
GPU never picked (an H200's cuBLASLt fast-accumulation algorithms, where the H100 table names Triton).
A backend whose kernels cost no compile (no compile_items: cuBLASLt, torch) also adds, per mode of its
names (their set of literal fields), its first LIBRARY_FIRST candidates: its list is in the library's
own heuristic order, and the library's best guesses cost only their timing. All come from the backend's
own candidate list here, so every one can run; at most MAX_NEAR per key in all, in that order
(the donor's neighbours, the default's, the library's first).
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ..backends.base import Backend, Solution, compile_items_of
from ..configs.files import same_file
from ..configs.table import read_table_file
from ..errors import ConfigError
from ..families import Family

MAX_NEIGHBOURS = 6  # per origin, a handful: the point of a donor is to time a few candidates, not the space
LIBRARY_FIRST = 2  # per mode of a backend that compiles nothing: its heuristic's first picks
MAX_NEAR = 16  # neighbours of every origin of a key together (the donor's solutions come on top)

# What happened to a key (ShapeResult.donor, the summary, the profile file's `donor` column).
CARRIED = "carried over"  # the donor's solution beat the default here too
NEIGHBOUR = "neighbour won"  # a neighbour of the donor's solution beat it and the default
DEFAULT_KEPT = "default kept"  # neither beat the default beyond the noise
FULL_SEARCH = "full search"  # no donor row for the key, or none of its solutions runs here
VERDICTS = (CARRIED, NEIGHBOUR, DEFAULT_KEPT, FULL_SEARCH)

DONOR, NEAR = "donor", "neighbour"  # a candidate's role in a donor tune


class DonorError(ConfigError):
    """The donor table cannot be used (unreadable, malformed, another family, the same file as the
    shapes or the output); the message names the file."""


@dataclass(frozen=True)
class DonorPick:
    """One donor row's solution for a key, and where it was tuned."""

    libtype: str
    kernel_name: str
    solidx: int
    splitk: int
    us: float
    gfx: str
    cu_num: int
    m: int  # the M of the donor row (another M than the key's when seeded from its shape's rows)


def check_donor_path(donor: str, shapes: str, output: str) -> None:
    """DonorError when the donor is the shape list or the output table (a tune writes its output)."""
    for what, other in (("the shape list", shapes), ("the output table", output)):
        if same_file(donor, other):
            raise DonorError(f"donor table {donor}: is {what} ({other}); name a table tuned elsewhere")


def read_donor(path: str, family: Family) -> dict[tuple, tuple[DonorPick, ...]]:
    """key -> the distinct solutions the donor's rows name for it (any GPU), the fastest measured first.
    DonorError naming the file when it cannot be read as a tuned table of `family`."""
    try:
        tf = read_table_file(path, family)
    except ConfigError as exc:
        raise DonorError(f"donor table {exc}") from None
    picks: dict[tuple, dict[tuple, DonorPick]] = {}
    for r in tf.rows:
        pick = DonorPick(r.libtype, r.kernel_name, r.solidx, r.splitk, r.us, r.gfx, r.cu_num, family.m_of(r.key))
        sol = (pick.libtype, pick.kernel_name, pick.solidx, pick.splitk)
        old = picks.setdefault(r.key, {}).get(sol)
        if old is None or pick.us < old.us:
            picks[r.key][sol] = pick
    return {k: tuple(sorted(v.values(), key=lambda p: p.us)) for k, v in picks.items()}


Picks = dict[tuple, tuple[DonorPick, ...]]  # key -> the donor's solutions for it


def picks_for(keys: list, picks: Picks, family: Family) -> Picks:
    """key -> its donor solutions among `picks` (read_donor): the key's own rows, else those of its shape
    at the nearest tuned M below and above (module doc); a key of a shape the donor never tuned has none."""
    by_shape: dict[tuple, dict[int, tuple[DonorPick, ...]]] = {}
    for key, ps in picks.items():
        by_shape.setdefault(family.shape_family(key), {})[family.m_of(key)] = ps
    out = {}
    for key in keys:
        if key in picks:
            out[key] = picks[key]
            continue
        tuned = by_shape.get(family.shape_family(key))
        if not tuned:
            continue
        m = family.m_of(key)
        below = max((t for t in tuned if t < m), default=None)
        above = min((t for t in tuned if t > m), default=None)
        nearest = sorted((t for t in (below, above) if t is not None), key=lambda t: (abs(math.log(t / m)), t))
        merged: dict[tuple, DonorPick] = {}
        for t in nearest:
            for p in tuned[t]:
                merged.setdefault((p.libtype, p.kernel_name, p.solidx, p.splitk), p)
        out[key] = tuple(merged.values())
    return out


# ---- neighbours -----------------------------------------------------------------------------------
_FIELD = re.compile(r"^([a-z]+)(\d+)([a-z]*)$")


def _fields(name: str) -> list[tuple[str, int | None, str]]:
    """(label, number, suffix) per `_`-separated field; a literal field has no number."""
    out = []
    for part in name.split("_"):
        m = _FIELD.match(part)
        out.append((m.group(1), int(m.group(2)), m.group(3)) if m else (part, None, ""))
    return out


def _axis(a: list, b: list) -> int | None:
    """The one numbered field where name fields `b` step away from `a`, or None."""
    if len(a) != len(b) or any(x[0] != y[0] for x, y in zip(a, b)):
        return None
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(diff) != 1 or a[diff[0]][1] is None:
        return None
    return diff[0]


def _toggled(a: list, b: list) -> str | None:
    """The literal flag field that name fields `b` add to or drop from `a`, all else equal, or None."""
    short, longer = (a, b) if len(a) < len(b) else (b, a)
    if len(longer) != len(short) + 1:
        return None
    for i, f in enumerate(longer):
        if f[1] is None and longer[:i] + longer[i + 1 :] == short:
            return f[0]
    return None


def neighbours(solution: Solution, offered: list[Solution], most: int = MAX_NEIGHBOURS) -> list[Solution]:
    """The solutions of `offered` one step from `solution` (module doc): each literal flag toggled, and
    per numbered axis the nearest value below and above; the toggles first, then one of each axis before
    any axis's second, at most `most`."""
    base = _fields(solution.kernel_name)
    per_axis: dict[int, list[Solution]] = {}
    toggles: dict[str, Solution] = {}
    for sol in offered:
        if sol.libtype != solution.libtype or sol.kernel_name == solution.kernel_name:
            continue
        fields = _fields(sol.kernel_name)
        axis = _axis(base, fields)
        if axis is not None:
            per_axis.setdefault(axis, []).append(sol)
            continue
        flag = _toggled(base, fields)
        if flag is not None:
            toggles.setdefault(flag, sol)
    steps: list[list[Solution]] = [[s] for s in toggles.values()]
    for axis in sorted(per_axis):
        v = base[axis][1]
        num = lambda s, axis=axis: _fields(s.kernel_name)[axis][1]  # noqa: E731
        alts = per_axis[axis]
        near = [
            max((s for s in alts if num(s) < v), key=num, default=None),
            min((s for s in alts if num(s) > v), key=num, default=None),
            next((s for s in alts if num(s) == v), None),  # the same value in another mode (sk2f, sk2r)
        ]
        steps.append([s for s in near if s is not None])
    out: list[Solution] = []
    for rank in range(3):  # every axis's first step before any axis's second
        out += [s[rank] for s in steps if len(s) > rank]
    return out[:most]


def library_first(offered: list[Solution], per_mode: int = LIBRARY_FIRST) -> list[Solution]:
    """The first `per_mode` solutions of `offered` of each mode (the set of literal fields of their names),
    modes in the order they first appear: a library's list is in its heuristic's order, each mode (the
    cuBLASLt a8w8 backend's plain and `_fa` problems) ranked apart."""
    taken: dict[frozenset, list[Solution]] = {}
    for sol in offered:
        mode = frozenset(label for label, number, _ in _fields(sol.kernel_name) if number is None)
        picked = taken.setdefault(mode, [])
        if len(picked) < per_mode:
            picked.append(sol)
    return [s for picked in taken.values() for s in picked]


# ---- one key's short list -------------------------------------------------------------------------
@dataclass
class DonorPlan:
    """What a donor tune times for one key: per backend name its (role, solution)s; `default_pick`: a
    donor row names the family's default itself (timed anyway); `unusable`: why a donor solution
    cannot run here."""

    by_backend: dict[str, list[tuple[str, Solution]]] = field(default_factory=dict)
    default_pick: bool = False
    unusable: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.default_pick or any(role == DONOR for sols in self.by_backend.values() for role, _ in sols)


def plan_for(picks: tuple[DonorPick, ...], key, device: torch.device, chosen: dict[str, Backend],
             default: Solution, listed: Collection[str] | None = None) -> DonorPlan:  # fmt: skip
    """The donor's solutions for `key` that run here among the `chosen` backends, and the neighbours of
    them and of the `default` (when its backend is chosen) among each backend's candidates for `key`
    (module doc; a backend that cannot list them adds none). `listed`: the backends whose neighbours
    are wanted (None: all; the precompile lists only those that compile, and a library's candidate list
    costs a heuristic query and a check per algorithm); the others' short lists hold their donor
    solutions alone."""
    plan = DonorPlan()
    seen: set[tuple[str, str]] = {(default.libtype, default.kernel_name)}  # the default is timed anyway
    origins: dict[str, list[Solution]] = {}
    for pick in picks:
        if (pick.libtype, pick.kernel_name) == (default.libtype, default.kernel_name):
            plan.default_pick = True
            continue
        backend = chosen.get(pick.libtype)
        if backend is None:
            plan.unusable.append(f"{pick.libtype}:{pick.kernel_name}: backend {pick.libtype} not in use here")
            continue
        sol = backend.solution_from_row(pick.solidx, pick.kernel_name, pick.splitk)
        if sol is None or not backend.supports(sol, key, device):
            plan.unusable.append(f"{pick.libtype}:{pick.kernel_name}: cannot run this key here")
            continue
        if (pick.libtype, sol.kernel_name) in seen:
            continue
        seen.add((pick.libtype, sol.kernel_name))
        plan.by_backend.setdefault(pick.libtype, []).append((DONOR, sol))
        origins.setdefault(pick.libtype, []).append(sol)
    if not plan.usable:
        return plan  # the full search: no short list
    if default.libtype in chosen:
        origins.setdefault(default.libtype, [])
    donors_near: list[tuple[str, Solution]] = []
    default_near: list[tuple[str, Solution]] = []
    cheap: list[tuple[str, Solution]] = []
    for bname, sols in origins.items():
        backend = chosen[bname]
        if listed is not None and bname not in listed:
            continue
        try:
            offered = [s for s in backend.candidates(key, device) if backend.supports(s, key, device)]
        except Exception:  # noqa: BLE001 - the donor's own solution is still timed
            offered = []
        donors_near += [(bname, s) for sol in sols for s in neighbours(sol, offered)]
        if bname == default.libtype:
            default_near += [(bname, s) for s in neighbours(default, offered)]
        if compile_items_of(backend) is None:
            cheap += [(bname, s) for s in library_first(offered)]
    count = 0
    for bname, sol in donors_near + default_near + cheap:
        if count >= MAX_NEAR:
            break
        if (bname, sol.kernel_name) not in seen:
            seen.add((bname, sol.kernel_name))
            plan.by_backend.setdefault(bname, []).append((NEAR, sol))
            count += 1
    return plan


def donor_verdict(has_plan: bool, kept_default: bool, winner_role: str) -> str:
    """What happened to a key of a donor tune (VERDICTS)."""
    if not has_plan:
        return FULL_SEARCH
    if kept_default:
        return DEFAULT_KEPT
    return CARRIED if winner_role == DONOR else NEIGHBOUR
