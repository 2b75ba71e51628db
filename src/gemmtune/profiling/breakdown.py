"""Profiled time by category, the top kernels (ops on the CPU), and the GEMM table.

The total is the wall time of the profiled steps (each step ends with a device synchronize, so steps
do not overlap). On CUDA, kernel time is split by category (an instant shared by kernels on several
streams is split evenly between them, so the busy time is counted once) and the rest of each step is
"idle": the GPU waiting for launches or host work. On the CPU, each op's self time goes to its
category, and the time outside any op (Python, and view/metadata ops outside a categorized op) to
"host". Either way the categories sum to the total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import gemms
from .categorize import CATEGORIES, METADATA_OPS, chain_category, kernel_name_category
from .timeline import Node, Timeline

STEP = "gemmtune.step"  # the range around one profiled step (gemmtune.profiling.step() in scripts)
SCRIPT = "gemmtune.script"  # the range around a whole script when it marks no steps


@dataclass
class Item:
    """A kernel (CUDA) or an op (CPU) and its time per step."""

    name: str
    category: str
    how: str  # "site" (launch site), "hint" (same kernel name's site, given or in this run), "name", "unknown"
    ms: float = 0.0
    calls: float = 0.0


@dataclass
class GemmRow:
    call: gemms.GemmCall | None  # None: GEMM kernels with no launch site to read shapes from
    calls: float = 0.0
    ms: float = 0.0
    status: str = "n/a"
    detail: str = ""


@dataclass
class Breakdown:
    mode: str  # "cuda" or "cpu"
    steps: int
    total_ms: float  # per step
    categories: dict[str, float]  # ms per step
    items: list[Item]
    gemms: list[GemmRow]
    notes: list[str] = field(default_factory=list)

    def kernel_categories(self) -> dict[str, str]:
        """Kernel name -> category for kernels categorized by their launch site (hints for graph replays).

        A kernel launched from several kinds of site (a copy kernel for casts and for clones) gets the
        category it spent most time in."""
        out: dict[str, str] = {}
        for i in sorted(self.items, key=lambda i: i.ms):  # most time last: it wins
            if i.how == "site":
                out[i.name] = i.category
        return out


def _split_busy(spans: list[tuple[float, float]]) -> list[float]:
    """Each span's share of the covered time: overlapped instants are split evenly (sum = union)."""
    share = [0.0] * len(spans)
    points = sorted([(s, 1, i) for i, (s, e) in enumerate(spans) if e > s] +
                    [(e, 0, i) for i, (s, e) in enumerate(spans) if e > s])  # fmt: skip
    active: set[int] = set()
    last = None
    for t, is_start, i in points:
        if active and t > last:
            d = (t - last) / len(active)
            for j in active:
                share[j] += d
        last = t
        if is_start:
            active.add(i)
        else:
            active.discard(i)
    return share


def _clip(start: float, end: float, windows: list[tuple[float, float]], starts: list[float]):
    import bisect

    i = bisect.bisect_right(starts, end) - 1
    while i >= 0:
        ws, we = windows[i]
        if we <= start:
            return None
        if ws < end:
            return max(start, ws), min(end, we)
        i -= 1
    return None


def _outer_gemm(chain: list[Node]) -> Node | None:
    """The outermost GEMM frame of a launch chain (innermost first) whose shapes say the call: the call
    the user made. A GEMM custom op whose inputs the table cannot read (gemmtune::fused_moe, ...) gives
    way to the GEMM inside it; with none readable, the outermost GEMM frame."""
    outer = readable = None
    for n in chain:
        if gemms.is_gemm_frame(n.frame):
            outer = n
            if gemms.call_of(n.frame) is not None:
                readable = n
    return readable or outer


class _Acc:
    def __init__(self, device):
        self.items: dict[tuple[str, str], Item] = {}  # (name, category): one kernel, several kinds of site
        self.gemm: dict[object, GemmRow] = {}
        self.gemm_frames: dict[object, set[int]] = {}
        self.device = device

    def add(self, name, cat, how, ms, calls=1.0):
        it = self.items.get((name, cat))
        if it is None:
            it = self.items[(name, cat)] = Item(name, cat, how)
        it.ms += ms
        it.calls += calls

    def add_gemm(self, outer: Node | None, ms: float):
        call = gemms.call_of(outer.frame) if outer is not None else None
        row = self.gemm.get(call)
        if row is None:
            row = self.gemm[call] = GemmRow(call)
            self.gemm_frames[call] = set()
        row.ms += ms
        if outer is not None:
            self.gemm_frames[call].add(id(outer))

    def gemm_rows(self, steps: int) -> list[GemmRow]:
        rows = []
        for call, row in self.gemm.items():
            row.calls = len(self.gemm_frames[call]) / steps
            row.ms /= steps
            if call is not None:
                row.status, row.detail = gemms.status(call, self.device)
            else:
                row.detail = "GEMM kernels without a launch site (CUDA-graph replay, or Triton launched from Python)"
            rows.append(row)
        return sorted(rows, key=lambda r: -r.ms)


def _step_nodes(tl: Timeline) -> list[Node]:
    steps = tl.frames_named(STEP) or tl.frames_named(SCRIPT)
    outer = {id(n) for n in steps}
    # a step range nested in another (a script's step inside a profiled fn's step) is not counted twice
    return [n for n in steps if not any(id(a) in outer for a in n.chain()[1:])]


def analyze(tl: Timeline, hints: dict[str, str] | None = None, device: str | torch.device = "cpu") -> Breakdown:
    """The breakdown of the profiled steps in `tl` (hints: kernel name -> category, for kernels
    without a launch site, e.g. from an eager profile of the step a CUDA graph replays)."""
    step_nodes = _step_nodes(tl)
    windows = [(n.start, n.end) for n in step_nodes]
    if not windows:
        raise ValueError(f"the profile has no {STEP!r} or {SCRIPT!r} range to measure")
    starts = [w[0] for w in windows]
    total = sum(e - s for s, e in windows)
    steps = len(windows)
    cats = dict.fromkeys(CATEGORIES, 0.0)
    mode = "cuda" if tl.has_device_activity else "cpu"
    acc = _Acc(torch.device("cuda" if mode == "cuda" else "cpu"))
    notes: list[str] = []
    if mode == "cuda":
        _device_time(tl, windows, starts, hints or {}, cats, acc)
    else:
        _cpu_time(tl, {id(n) for n in step_nodes}, cats, acc)
    busy = sum(v for k, v in cats.items() if k != "idle")
    cats["idle"] = max(0.0, total - busy)
    if busy > total * 1.0001:
        notes.append(f"categorized time {busy:.1f} us exceeds the steps' {total:.1f} us")
    per = {k: v / steps / 1e3 for k, v in cats.items()}
    items = sorted(acc.items.values(), key=lambda i: -i.ms)
    for it in items:
        it.ms /= steps * 1e3
        it.calls /= steps
    rows = acc.gemm_rows(steps)
    for r in rows:
        r.ms /= 1e3
    return Breakdown(mode, steps, total / steps / 1e3, per, items, rows, notes)


def _device_time(tl, windows, starts, hints, cats, acc: _Acc) -> None:
    spans, meta = [], []
    for ev in tl.device:
        c = _clip(ev.start, ev.end, windows, starts)
        if c is None:
            continue
        chain = ev.site.chain() if ev.site is not None else []
        if ev.name.startswith(("Memcpy", "Memset")):
            cat, how = kernel_name_category(ev.name), "name"
        else:
            cat = chain_category([n.frame for n in chain]) if chain else None
            how = "site" if cat else ""
        spans.append(c)
        meta.append([ev.name, cat, how, chain])
    # kernels without a site: the category the same kernel name got from its sites (the caller's
    # hints first, then this run), else the name rules
    seen: dict[str, dict[str, float]] = {}
    for (name, cat, how, _), (s, e) in zip(meta, spans):
        if how == "site":
            seen.setdefault(name, {}).setdefault(cat, 0.0)
            seen[name][cat] += e - s
    for m in meta:
        name, cat = m[0], m[1]
        if cat is not None:
            continue
        if name in hints or name in seen:
            m[1] = hints.get(name) or max(seen[name].items(), key=lambda kv: kv[1])[0]
            m[2] = "hint"
        else:
            m[1] = kernel_name_category(name) or "other"
            m[2] = "name" if m[1] != "other" else "unknown"
    for (name, cat, how, chain), share in zip(meta, _split_busy(spans)):
        cats[cat] += share
        acc.add(name, cat, how, share)
        if cat == "gemm":
            acc.add_gemm(_outer_gemm(chain), share)


def _cpu_time(tl: Timeline, step_ids: set[int], cats, acc: _Acc) -> None:
    for nodes in tl.nodes.values():
        for n in nodes:
            if not n.is_op:
                continue
            chain = n.chain()
            if not any(id(a) in step_ids for a in chain):
                continue
            self_time = max(0.0, (n.end - n.start) - n.child_time)
            cat = chain_category([a.frame for a in chain])
            how = "site"
            if cat is None:  # view/metadata ops outside any categorized op are framework (host) time
                cat, how = ("idle", "site") if n.name in METADATA_OPS else ("other", "unknown")
            cats[cat] += self_time
            acc.add(n.name, cat, how, self_time)
            if cat == "gemm":
                acc.add_gemm(_outer_gemm(chain), self_time)
