"""The profiler's raw events as a timeline: CPU frames (ops and annotations) nested per thread, and
device activities (kernels, memcpy, memset) tied to the frames around their launch.

Read from the Kineto events torch.profiler collected (`prof.profiler.kineto_results.events()`), whose
accessors have been stable across torch 2.x; times are microseconds from the first event.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from .categorize import Frame

# CUDA/HIP runtime and driver calls (kernel launches, memcpy, graph launches) on the CPU side.
_RUNTIME = re.compile(r"^(cuda[A-Z]|cu[A-Z]|hip[A-Z]|hsa_|hipExt)")
_SKIP = ("[memory]", "[OutOfMemory]")
# device-side records that are not work: CUDA sync waits (optional CUPTI activity)
_NOT_WORK = re.compile(r"^(Context|Stream|Event|Device) (Sync|Wait)|Stream Wait Event")


@dataclass(eq=False)
class Node:
    """A CPU frame: an op (`ns::name`) or a user annotation (record_function), with its parent."""

    name: str
    start: float
    end: float
    thread: int
    corr: int
    shapes: tuple = ()
    dtypes: tuple = ()
    parent: Node | None = None
    child_time: float = 0.0
    _frame: Frame | None = field(default=None, repr=False)

    @property
    def is_op(self) -> bool:
        return "::" in self.name

    @property
    def frame(self) -> Frame:
        if self._frame is None:
            self._frame = Frame(self.name, self.shapes, self.dtypes)
        return self._frame

    def chain(self) -> list[Node]:
        """This frame and its ancestors, innermost first."""
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.parent
        return out


@dataclass(eq=False)
class DeviceEvent:
    name: str
    start: float
    end: float
    site: Node | None  # innermost CPU frame around the launch, None when unknown (graph replays ...)


@dataclass
class Timeline:
    nodes: dict[int, list[Node]]  # thread -> frames sorted by (start, -end)
    device: list[DeviceEvent]
    has_device_activity: bool

    def frames_named(self, name: str) -> list[Node]:
        return sorted((n for ns in self.nodes.values() for n in ns if n.name == name), key=lambda n: n.start)


@dataclass
class _Raw:
    name: str
    on_cpu: bool
    start: float
    end: float
    thread: int
    corr: int
    linked: int
    shapes: tuple
    dtypes: tuple


def _gpu_annotation(e, name: str) -> bool:
    """The GPU-side copy of a record_function range: it spans kernels, it is not one."""
    if hasattr(e, "is_user_annotation"):
        return bool(e.is_user_annotation())
    return name.startswith(("gemmtune.", "## ", "Torch-Compiled Region", "ProfilerStep"))


def _ns(e, what: str) -> int:
    fn = getattr(e, f"{what}_ns", None)
    if fn is not None:
        return int(fn())
    if what == "end":
        return _ns(e, "start") + int(e.duration_us()) * 1000
    return int(e.start_us()) * 1000


def _raw_events(prof) -> list[_Raw]:
    import torch

    results = prof.profiler.kineto_results
    events = results.events()
    base = results.trace_start_ns() if hasattr(results, "trace_start_ns") else 0
    if base <= 0:
        base = min((t for t in (_ns(e, "start") for e in events) if t > 0), default=0)
    out = []
    for e in events:
        name = e.name()
        if name in _SKIP or (hasattr(e, "is_async") and e.is_async()):
            continue
        on_cpu = e.device_type() == torch.autograd.DeviceType.CPU
        if not on_cpu and (_NOT_WORK.search(name) or _gpu_annotation(e, name)):
            continue
        try:
            shapes = tuple(tuple(s) for s in e.shapes()) if on_cpu else ()
            dtypes = tuple(e.dtypes()) if on_cpu else ()
        except (RuntimeError, TypeError):
            shapes, dtypes = (), ()
        out.append(
            _Raw(
                name, on_cpu, (_ns(e, "start") - base) / 1e3, (_ns(e, "end") - base) / 1e3, int(e.start_thread_id()),
                int(e.correlation_id()), int(e.linked_correlation_id()), shapes, dtypes,
            )
        )  # fmt: skip
    return out


def _nest(nodes: list[Node]) -> None:
    """Parent links and child time for frames of one thread, sorted by (start, -end)."""
    stack: list[Node] = []
    for n in nodes:
        while stack and (n.start >= stack[-1].end or n.end > stack[-1].end):
            stack.pop()
        if stack:
            n.parent = stack[-1]
            stack[-1].child_time += n.end - n.start
        stack.append(n)


def _innermost(nodes: list[Node], starts: list[float], t: float) -> Node | None:
    i = bisect.bisect_right(starts, t) - 1
    n = nodes[i] if i >= 0 else None
    while n is not None and n.end < t:
        n = n.parent
    return n


def build(prof) -> Timeline:
    raws = _raw_events(prof)
    nodes: dict[int, list[Node]] = {}
    runtime: dict[int, _Raw] = {}
    device: list[_Raw] = []
    for r in raws:
        if not r.on_cpu:
            device.append(r)
        elif _RUNTIME.match(r.name):
            runtime[r.corr] = r
        else:
            nodes.setdefault(r.thread, []).append(Node(r.name, r.start, r.end, r.thread, r.corr, r.shapes, r.dtypes))
    by_corr: dict[int, Node] = {}
    starts: dict[int, list[float]] = {}
    for th, ns in nodes.items():
        ns.sort(key=lambda n: (n.start, -n.end))
        _nest(ns)
        starts[th] = [n.start for n in ns]
        for n in ns:
            by_corr.setdefault(n.corr, n)

    def site_of(rt: _Raw | None) -> Node | None:
        """The innermost frame around a launch call: the op Kineto linked it to, refined by time to a
        frame inside that op (a range without a correlation id of its own); by time alone without one."""
        if rt is None:
            return None
        op = by_corr.get(rt.linked) if rt.linked > 0 else None
        if op is not None:
            n = _innermost(nodes[op.thread], starts[op.thread], rt.start)
            return n if n is not None and any(a is op for a in n.chain()) else op
        for th in [rt.thread] + [t for t in nodes if t != rt.thread]:
            if th in nodes:
                n = _innermost(nodes[th], starts[th], rt.start)
                if n is not None:
                    return n
        return None

    def linked(r: _Raw) -> Node | None:
        return by_corr.get(r.linked) if r.linked > 0 else None

    # the launch call with the same correlation id, else the op Kineto linked the activity to
    dev = [DeviceEvent(r.name, r.start, r.end, site_of(runtime.get(r.corr)) or linked(r)) for r in device]
    dev.sort(key=lambda d: d.start)
    return Timeline(nodes, dev, bool(dev))
