"""The tuning driver: a shape list in, one tuned row per finished key out (resumable), in-process or in
worker processes (workers.py), with a progress bar whose ETA weighs each key by its expected cost.

Output: aiter's tuned CSV of the shape list's family. Each finished key is written at once under a
file lock (read, replace or add the row, write a temp file, rename), so a killed run keeps every
finished row and a rerun skips keys that already have a row for this GPU (gfx, cu_num) unless
`all_shapes` is set.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch

from .. import settings
from ..capture import read_shape_list
from ..checks import check_int, check_list, check_path, check_str
from ..device import DeviceIdentity, identity
from ..errors import NoShapesError
from ..families import Family
from .compile_ahead import CompileAhead
from .donor import check_donor_path, picks_for, read_donor
from .output import append_profile, check_tune_outputs, done_keys, result_row, write_row
from .search import (
    ShapeResult,
    TuneOptions,
    describe_timings,
    select_backends,
    tune_shape,
)
from .summary import describe_item, summary_lines
from .workers import PLUGINS_ENV, ShapeFailure, import_plugins, run_workers, start_workers, stop_workers

EXIT_AFTER_ENV = settings.TUNE_EXIT_AFTER.name  # testing hook: os._exit after writing N rows
# Cost model for the ETA: a fixed part (candidate lists, compiles, checks, graph captures) plus the
# GEMM work timed over the screen and final replays. Measured on an H100: Llama-3-8B's keys took
# 6-8 s at M <= 256 and up to ~80 s for gate_up at M = 4096 (~1 TFLOP per call).
FIXED_COST = 1.0
FLOPS_PER_COST = 1e11

__all__ = ["EXIT_AFTER_ENV", "PLUGINS_ENV", "RowSink", "RunReport", "ShapeFailure", "describe_item",
           "estimated_cost", "summary_lines", "tune_file", "tune_items"]  # fmt: skip


@dataclass
class RunReport:
    results: list[ShapeResult]
    failures: list[ShapeFailure]
    skipped: int
    seconds: float
    family: str = "a16w16"
    donor: str = ""  # the donor table of a --from tune


def estimated_cost(family: Family, key) -> float:
    """Relative tuning time of a key (only ratios matter: it weighs the progress bar's ETA)."""
    try:
        return FIXED_COST + family.flops(key) / FLOPS_PER_COST
    except NotImplementedError:
        return FIXED_COST


def run_inprocess(keys: list, device: torch.device, opts: TuneOptions, log: Callable[[str], None], family: Family,
                  m_lo: dict | None = None):  # fmt: skip
    inflight: list[str] = []

    def heartbeat(names, phase):
        inflight[:] = [f"{phase}: {', '.join(names)}"]

    for key in keys:
        try:
            yield tune_shape(key, device, opts, heartbeat=heartbeat, log=log, family=family,
                             m_lo=(m_lo or {}).get(key))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one key failing does not end the run
            from .search import DeviceLostError

            if isinstance(exc, DeviceLostError):
                raise RuntimeError(
                    f"{family.describe(key)}: {exc} (in flight: {inflight[0] if inflight else '?'}); rerun with "
                    "--mp 1 to isolate crashing candidates in a worker process (finished rows are kept)"
                ) from None
            yield ShapeFailure(key, f"{type(exc).__name__}: {exc}", family.name)


def load_keys(shapes_path: str, family: str | None = None, ms: list[int] | None = None) -> tuple[Family, list]:
    """The shape list's family and keys, in file order (ShapesFileError names file and line); with `ms`,
    every shape of the list at each of those Ms instead of the list's own."""
    check_path("tuner.load_keys", "shapes_path", shapes_path)
    check_str("tuner.load_keys", "family", family, optional=True)
    check_list("tuner.load_keys", "ms", ms, check_int, optional=True)
    fam, keyed = read_shape_list(shapes_path, family)
    if not keyed:
        raise NoShapesError(f"{shapes_path} has no shapes (a header alone: nothing to tune)")
    keys = [k for k, _ in keyed]
    if ms:
        shapes = dict.fromkeys(fam.with_m(k, 1) for k in keys)
        keys = [fam.with_m(s, m) for s in shapes for m in sorted(set(ms))]
    return fam, keys


def with_donor(opts: TuneOptions, donor: str | None, shapes_path: str, output: str, fam: Family,
               keys: list, log: Callable[[str], None]) -> TuneOptions:  # fmt: skip
    """`opts` for a tune from the donor table `donor` (unchanged for None): its picks for `keys`.
    DonorError naming the file when it is the shape list or the output, or no table of `fam`."""
    if donor is None:
        return opts
    check_donor_path(donor, shapes_path, output)
    picks = read_donor(donor, fam)
    matched = picks_for(keys, picks, fam)
    own = sum(k in picks for k in matched)
    gpus = sorted({f"{p.gfx}/{p.cu_num}" for ps in matched.values() for p in ps})
    log(f"gemmtune: donor {donor}: rows for {own} of {len(keys)} keys, {len(matched) - own} more from their "
        f"shape's rows at other Ms (tuned on {', '.join(gpus) or '-'}); the others get the full search")  # fmt: skip
    return replace(opts, donor=matched)


def range_floors(fam: Family, keys: list, tuned: list) -> dict:
    """For each key, the lowest M its row should answer: one above the next smaller M of its shape
    among the keys and the rows already tuned (1 for the smallest)."""
    ms_by_shape: dict[tuple, set[int]] = {}
    for k in [*keys, *tuned]:
        ms_by_shape.setdefault(fam.shape_family(k), set()).add(fam.m_of(k))
    out = {}
    for k in keys:
        below = [m for m in ms_by_shape[fam.shape_family(k)] if m < fam.m_of(k)]
        out[k] = max(below) + 1 if below else 1
    return out


class _Progress:
    """tqdm over the keys' estimated costs, so the ETA knows a 4096-token gate_up is not a decode key."""

    def __init__(self, family: Family, keys: list, enabled: bool, log):
        self.costs = {k: estimated_cost(family, k) for k in keys}
        self.bar = None
        # Not a terminal (a log file, CI): a plain line per finished key instead of carriage-return redraws.
        self.plain = enabled and bool(keys) and not stderr_is_tty()
        self.total, self.done_cost, self.count, self.t0 = sum(self.costs.values()), 0.0, 0, time.perf_counter()
        if enabled and keys and not self.plain:
            from tqdm import tqdm

            fmt = "{l_bar}{bar}| {n:.0f}/{total:.0f} cost units [{elapsed}<{remaining}]"
            self.bar = tqdm(total=sum(self.costs.values()), file=sys.stderr, dynamic_ncols=True, smoothing=0.1,
                            bar_format=fmt)  # fmt: skip
        self.say = (lambda m: self.bar.write(m, file=sys.stderr)) if self.bar is not None else log

    def done(self, item) -> None:
        if self.plain:
            self.count += 1
            self.done_cost += self.costs.get(item.key, FIXED_COST)
            spent = time.perf_counter() - self.t0
            eta = spent * (self.total - self.done_cost) / self.done_cost if self.done_cost else 0.0
            self.say(f"gemmtune: {self.count}/{len(self.costs)} keys done, {spent:.0f}s spent, ~{eta:.0f}s left")
            return
        if self.bar is None:
            return
        self.bar.update(self.costs.get(item.key, FIXED_COST))
        if isinstance(item, ShapeResult):
            self.bar.set_postfix_str(f"{item.winner.libtype} {item.speedup:.2f}x", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def stderr_is_tty() -> bool:
    """Progress bars redraw with carriage returns: only on a terminal (else plain lines)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams (test runners, pipes torn down)
        return False


def compile_processes(local_ranks: int = 1) -> int:
    """How many compile processes one rank starts when `local_ranks` ranks share its host: the host's
    total (GEMMTUNE_COMPILE_PROCESSES, else 16 per rank up to one per CPU) split over them. 8, 14 and 16
    per rank tuned two ranks' keys within 5% of each other on a 32-CPU host
    (benchmarks/results/h100/fleet_tuning/)."""
    local_ranks = max(1, local_ranks)
    cpus = os.cpu_count() or 1
    total = settings.COMPILE_PROCESSES.get()
    if total is None:
        total = min(16 * local_ranks, cpus)
    return max(1, total // local_ranks)


def compile_ahead_keys(
    todo: list,
    fam: Family,
    device: torch.device,
    opts: TuneOptions,
    compile_workers: int | None,
    floors: dict | None = None,
) -> CompileAhead:
    """The keys' Triton kernels compiling in one pool of processes in the background, in `todo`'s order
    (compile_ahead.py); `floors`: each key's M floor, as its tune gets it."""
    n = compile_workers or compile_processes()
    return CompileAhead(todo, device, opts, n, fam.name, floors=floors).start()


def finish_compile(ahead: CompileAhead | None, log: Callable[[str], None]) -> None:
    """Wait for the background compile, then say what it took."""
    if ahead is None:
        return
    fails = ahead.join()
    failed = f"; the pool failed ({ahead.error}), the tune compiled what it needed" if ahead.error else ""
    log(f"gemmtune: precompiled kernels beside the tune ({describe_timings(ahead.timings)}; "
        f"{len(fails)} did not compile{failed}; keys waited {ahead.waited:.1f} s for theirs)")  # fmt: skip


def _tuned_then_finish(items: Iterator, ahead: CompileAhead | None, log: Callable[[str], None]) -> Iterator:
    try:
        yield from items
    except BaseException:  # an error, Ctrl-C or a closed generator: the compile is not waited for
        if ahead is not None:
            ahead.cancel()
        raise
    finally:
        finish_compile(ahead, log)


def tune_items(todo, floors: dict, fam: Family, device: torch.device, opts: TuneOptions, mp_workers: int,
               timeout: float, say: Callable[[str], None], verbose: bool, precompile: bool,
               log: Callable[[str], None], compile_workers: int | None = None,
               prepare: Callable[[], CompileAhead | None] | None = None) -> Iterator:  # fmt: skip
    """ShapeResult / ShapeFailure for each key of `todo` (a list, or a fleet's claims) as it finishes, in
    worker processes (`mp_workers`) or in this one. On a GPU the Triton kernels compile in the background
    (`prepare`, when given, starts that instead: a fleet's host-wide compile; it runs for an empty `todo`
    too), and each key is tuned once its kernels are built; worker processes are started first, so their
    start overlaps the compile's."""
    if prepare is None and precompile and device.type == "cuda" and len(todo):
        prepare = functools.partial(compile_ahead_keys, todo, fam, device, opts, compile_workers, floors)
    if not (len(todo) and mp_workers):  # a rank with no share starts no worker
        ahead = prepare() if prepare is not None else None
        keys = ahead.gated(todo, log) if ahead is not None else todo
        items = run_inprocess(keys, device, opts, say if verbose else (lambda m: None), fam, floors)
        return _tuned_then_finish(items, ahead, log)
    workers = start_workers(device, opts, mp_workers, verbose)
    try:
        ahead = prepare() if prepare is not None else None
    except BaseException:
        stop_workers(workers)
        raise
    keys = ahead.gated(todo, log) if ahead is not None else todo
    items = run_workers(keys, device, opts, mp_workers, timeout, say, verbose=verbose, family=fam.name,
                        describe=lambda t: fam.describe(t.key), m_lo=floors, workers=workers)  # fmt: skip
    return _tuned_then_finish(items, ahead, log)


class RowSink:
    """Where finished keys go: each result's row written at once (under the table's lock) for the GPU
    that tuned it, its candidates to the profile file; thread-safe, so a fleet's receiver can share it."""

    def __init__(self, output: str, fam: Family, profile_file: str | None, bar: _Progress, verbose: bool):
        self.output, self.fam, self.profile_file, self.bar, self.verbose = output, fam, profile_file, bar, verbose
        self.results: list[ShapeResult] = []
        self.failures: list[ShapeFailure] = []
        self.lock = threading.Lock()

    def take(self, item, ident: DeviceIdentity) -> None:
        with self.lock:
            if isinstance(item, ShapeResult):
                write_row(self.output, result_row(item, ident, self.fam))
                if self.profile_file:
                    append_profile(self.profile_file, item, ident, self.fam)
                self.results.append(item)
            else:
                self.failures.append(item)
            if self.verbose:
                self.bar.say(describe_item(item))
            self.bar.done(item)


def tune_file(
    shapes_path: str,
    output: str,
    opts: TuneOptions,
    device: torch.device,
    mp_workers: int = 0,
    timeout: float = 60.0,
    all_shapes: bool = False,
    profile_file: str | None = None,
    precompile: bool = True,
    log: Callable[[str], None] = lambda m: print(m, file=sys.stderr),
    progress: bool = True,
    verbose: bool = False,
    family: str | None = None,
    ms: list[int] | None = None,
    donor: str | None = None,
) -> RunReport:
    """Tune every key of the shape list into `output` (module doc); `donor`: a tuned table of the same
    family from any GPU whose winners are re-verified here instead of searching again (donor.py)."""
    t0 = time.perf_counter()
    check_tune_outputs(shapes_path, output, profile_file)
    import_plugins()
    fam, keys = load_keys(shapes_path, family, ms)
    opts = with_donor(opts, donor, shapes_path, output, fam, keys, log)
    ident = identity(device)
    tuned = done_keys(output, ident, fam)  # also validates an existing output file
    done = set() if all_shapes else tuned
    todo = [k for k in keys if k not in done]
    floors = range_floors(fam, keys, list(tuned))
    skipped = len(keys) - len(todo)
    if skipped:
        log(f"gemmtune: {skipped} of {len(keys)} shapes already tuned in {output} for "
            f"{ident.gfx}/{ident.cu_num} ({fam.name}; skipped, --all retunes them)")  # fmt: skip
    chosen = select_backends(device, opts.libtypes, fam.name)  # raises on an unknown/unavailable backend
    if not todo:
        return RunReport([], [], skipped, time.perf_counter() - t0, fam.name, donor or "")
    log(f"gemmtune: tuning {len(todo)} {fam.name} keys on {device} ({ident.gfx}, {ident.cu_num} units) with "
        f"{', '.join(chosen)}{f' in {mp_workers} worker(s)' if mp_workers else ''}")  # fmt: skip
    exit_after = settings.TUNE_EXIT_AFTER.get()
    bar = _Progress(fam, todo, progress, log)
    sink = RowSink(output, fam, profile_file, bar, verbose)
    gen = tune_items(todo, floors, fam, device, opts, mp_workers, timeout, bar.say, verbose, precompile, log)
    try:
        for item in gen:
            sink.take(item, ident)
            if exit_after and len(sink.results) >= exit_after:
                os._exit(17)
    finally:
        bar.close()
        if hasattr(gen, "close"):
            gen.close()
    return RunReport(sink.results, sink.failures, skipped, time.perf_counter() - t0, fam.name, donor or "")
