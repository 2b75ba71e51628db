"""The tuning driver: shapes in, one tuned row per finished shape out (resumable), in-process or in workers.

Output: aiter's tuned CSV. Each finished shape is written at once under a file lock (read, replace
or add the row, write a temp file, rename), so a killed run keeps every finished row and a rerun
skips shapes that already have a row for this GPU (gfx, cu_num) unless `all_shapes` is set.

Workers (`mp` > 0): one spawned process per GPU (or per CPU worker on a CPU machine), fed one shape at
a time through a pipe. Before each step (a candidate's check, a timing group) the worker sends a
heartbeat naming the candidates in flight, synchronously, so when the worker dies (segfault,
os._exit, a CUDA error that kills the context) or stays silent longer than `timeout`, the parent
knows which candidate did it: that candidate is recorded as crashed/timeout, the worker is restarted,
and the shape is tuned again without it. If several candidates were in flight (a timing group), the
shape is retried with one candidate per group, which pins the culprit down on the next failure.
"""

from __future__ import annotations

import collections
import csv
import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait

import torch

from ..capture import read_shapes
from ..configs.io import locked, write_atomic
from ..configs.schema import TUNED_COLUMNS, TunedRow, throughput
from ..configs.table import read_table_file
from ..device import DeviceIdentity, identity
from ..keys import GemmKey, dtype_name
from .search import CRASHED, TIMEOUT, DeviceLostError, ShapeResult, TuneOptions, tune_shape

EXIT_AFTER_ENV = "GEMMTUNE_TUNE_EXIT_AFTER"  # testing hook: os._exit after writing N rows
PLUGINS_ENV = "GEMMTUNE_PLUGINS"  # comma list of modules to import (they register extra backends)
MAX_ATTEMPTS = 4  # worker restarts allowed per shape before the shape is given up
STARTUP_TIMEOUT = 600.0
BAN_AFTER = 2

PROFILE_COLUMNS = [
    "gfx", "cu_num", "M", "N", "K", "bias", "dtype", "outdtype", "libtype", "kernelName", "solidx", "splitK",
    "status", "err", "screen_us", "us", "default_us", "winner", "reason",
]  # fmt: skip


def import_plugins() -> None:
    """Import the modules named in GEMMTUNE_PLUGINS (in the parent and in every worker)."""
    import importlib

    for mod in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(mod)


@dataclass
class ShapeFailure:
    """A shape that could not be tuned at all (no row is written for it)."""

    key: GemmKey
    reason: str


# ---- output files -----------------------------------------------------------------------------------
def existing_rows(path: str) -> tuple[list[str], list[TunedRow]]:
    if not os.path.exists(path):
        return list(TUNED_COLUMNS), []
    return read_table_file(path)


def done_keys(path: str, ident: DeviceIdentity) -> set[GemmKey]:
    _, rows = existing_rows(path)
    return {r.key for r in rows if r.gfx == ident.gfx and r.cu_num == ident.cu_num}


def result_row(res: ShapeResult, ident: DeviceIdentity) -> TunedRow:
    w = res.winner
    tflops, bw = throughput(res.key, res.us)
    err = w.err if math.isfinite(w.err) else 0.0
    return TunedRow(ident.gfx, ident.cu_num, res.key, w.libtype, w.solidx, w.splitk, res.us, w.kernel_name,
                    err, tflops, bw)  # fmt: skip


def write_row(path: str, row: TunedRow) -> None:
    """Replace (or add) the row of the same GPU and key, atomically, under the file's lock."""
    with locked(path):
        columns, rows = existing_rows(path)
        rows = [r for r in rows if r.full_key != row.full_key] + [row]
        write_atomic(path, columns, ([r.value(c) for c in columns] for r in rows))


def _fmt(v: float) -> str:
    return "" if v != v else f"{v:.4g}"


def append_profile(path: str, res: ShapeResult, ident: DeviceIdentity) -> None:
    k = res.key
    base = [ident.gfx, str(ident.cu_num), str(k.M), str(k.N), str(k.K), str(k.bias), dtype_name(k.dtype),
            dtype_name(k.outdtype)]  # fmt: skip
    rows = []
    for c in res.candidates:
        us = res.default_us if c.name == res.default.name and c.us != c.us else c.us
        rows.append([*base, c.libtype, c.kernel_name, str(c.solidx), str(c.splitk), c.status, _fmt(c.err),
                     _fmt(c.screen_us), _fmt(us), _fmt(res.default_us), str(c is res.winner or c.name ==
                     res.winner.name), c.reason])  # fmt: skip
    with locked(path):
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        with open(path, "a", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            if new:
                writer.writerow(PROFILE_COLUMNS)
            writer.writerows(rows)


# ---- in-process ---------------------------------------------------------------------------------------
def run_inprocess(keys: list[GemmKey], device: torch.device, opts: TuneOptions, log: Callable[[str], None]):
    inflight: list[str] = []

    def heartbeat(names, phase):
        inflight[:] = [f"{phase}: {', '.join(names)}"]

    for key in keys:
        try:
            yield tune_shape(key, device, opts, heartbeat=heartbeat, log=log)
        except DeviceLostError as exc:
            raise RuntimeError(
                f"{key.describe()}: {exc} (in flight: {inflight[0] if inflight else '?'}); rerun with --mp 1 "
                "to isolate crashing candidates in a worker process (finished rows are kept)"
            ) from None
        except Exception as exc:  # noqa: BLE001 - one shape failing does not end the run
            yield ShapeFailure(key, f"{type(exc).__name__}: {exc}")


# ---- workers ------------------------------------------------------------------------------------------
def _worker_main(wid: int, device_str: str, opts: TuneOptions, conn, plugins: str, verbose: bool) -> None:
    os.environ[PLUGINS_ENV] = plugins
    import_plugins()
    device = torch.device(device_str)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("ready", wid))
    while True:
        task = conn.recv()
        if task is None:
            return
        idx, key, exclude, isolate = task
        hb = lambda names, phase, i=idx: conn.send(("hb", i, list(names), phase))  # noqa: E731
        say = (lambda msg, i=idx: conn.send(("log", i, msg))) if verbose else None
        try:
            hb([], "setup")
            res = tune_shape(key, device, opts, exclude, hb, isolate, log=say)
            conn.send(("done", idx, res))
        except DeviceLostError as exc:
            conn.send(("lost", idx, str(exc)))
            conn.close()
            os._exit(3)
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", idx, f"{type(exc).__name__}: {exc}"))


class _Worker:
    def __init__(self, ctx, wid: int, device: str, opts: TuneOptions, verbose: bool):
        self.wid, self.device = wid, device
        parent, child = ctx.Pipe()
        self.conn = parent
        args = (wid, device, opts, child, os.environ.get(PLUGINS_ENV, ""), verbose)
        self.proc = ctx.Process(target=_worker_main, args=args, daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.task = None  # (idx, key, exclude, isolate, attempts)
        self.inflight: tuple[list[str], str] = ([], "")
        self.last_hb = time.monotonic()

    def stop(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


def worker_devices(device: torch.device, n: int) -> list[str]:
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if n > count:
            raise ValueError(f"--mp {n} asks for more workers than GPUs here ({count})")
        return [f"cuda:{i}" for i in range(n)]
    return [device.type] * n


def run_workers(keys, device: torch.device, opts: TuneOptions, n: int, timeout: float, log, verbose: bool):
    """Yield ShapeResult / ShapeFailure for each key, tuned by `n` worker processes."""
    ctx = mp.get_context("spawn")
    devices = worker_devices(device, n)
    workers = [_Worker(ctx, i, d, opts, verbose) for i, d in enumerate(devices)]
    pending = collections.deque((i, k, {}, False, 0) for i, k in enumerate(keys))
    # A candidate that kills its worker on BAN_AFTER shapes is skipped for the rest of the run.
    strikes: collections.Counter = collections.Counter()
    banned: dict[str, tuple[str, str]] = {}
    remaining = len(keys)
    try:
        while remaining:
            for w in workers:
                if w.ready and w.task is None and pending:
                    idx, key, exclude, isolate, attempts = pending.popleft()
                    w.task = (idx, key, {**banned, **exclude}, isolate, attempts)
                    w.last_hb = time.monotonic()
                    w.inflight = ([], "start")
                    w.conn.send(w.task[:4])
            conns = [w.conn for w in workers] + [w.proc.sentinel for w in workers]
            wait(conns, timeout=0.5)
            for i, w in enumerate(workers):
                out = _drain(w, log)
                for item in out:
                    remaining -= 1
                    yield item
                dead = not w.proc.is_alive()
                hung = w.task is not None and time.monotonic() - w.last_hb > timeout
                slow_start = not w.ready and time.monotonic() - w.started > STARTUP_TIMEOUT
                if slow_start or (dead and not w.ready and w.task is None):
                    raise RuntimeError(f"tuning worker {w.wid} on {w.device} did not start "
                                       f"(exit code {w.proc.exitcode})")  # fmt: skip
                if dead or hung:
                    item = _on_worker_loss(w, hung, timeout, pending, log, strikes, banned)
                    w.stop()
                    workers[i] = _Worker(ctx, w.wid, w.device, opts, verbose)
                    if item is not None:
                        remaining -= 1
                        yield item
    finally:
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            w.proc.join(timeout=2)
            w.stop()


def _drain(w: _Worker, log) -> list:
    out = []
    while True:
        try:
            if not w.conn.poll():
                break
            msg = w.conn.recv()
        except (EOFError, OSError):
            break
        kind = msg[0]
        if kind == "ready":
            w.ready = True
        elif kind == "hb":
            w.inflight = (msg[2], msg[3])
            w.last_hb = time.monotonic()
        elif kind == "log":
            log(msg[2])
            w.last_hb = time.monotonic()
        elif kind in ("done", "error") and w.task is not None:
            key = w.task[1]
            out.append(msg[2] if kind == "done" else ShapeFailure(key, msg[2]))
            w.task = None
        elif kind == "lost":
            log(f"worker {w.wid}: {msg[2]}")
    return out


def _on_worker_loss(w: _Worker, hung: bool, timeout: float, pending, log, strikes, banned):
    """Record the in-flight candidate(s) as crashed/timed out; requeue the shape or give it up."""
    if w.task is None:
        return None
    idx, key, exclude, isolate, attempts = w.task
    names, phase = w.inflight
    status = TIMEOUT if hung else CRASHED
    why = (f"no progress for {timeout:g}s" if hung else f"worker exited with code {w.proc.exitcode}") + f" ({phase})"
    log(f"{key.describe()}: worker {w.wid} {'hung' if hung else 'died'} on {', '.join(names) or phase}: {why}")
    w.task = None
    exclude = dict(exclude)
    if len(names) == 1 and not names[0].startswith("default"):
        exclude[names[0]] = (status, why)
        strikes[names[0]] += 1
        if strikes[names[0]] >= BAN_AFTER:
            banned[names[0]] = (status, f"{why}; skipped after failing on {BAN_AFTER} shapes")
    elif len(names) > 1 and not isolate:
        isolate = True  # several in flight: time one at a time to find which
    else:
        return ShapeFailure(key, f"worker {'hung' if hung else 'died'} outside any single candidate: {why}")
    if attempts + 1 >= MAX_ATTEMPTS:
        return ShapeFailure(key, f"gave up after {MAX_ATTEMPTS} worker failures; last: {why}")
    pending.appendleft((idx, key, exclude, isolate, attempts + 1))
    return None


# ---- the run --------------------------------------------------------------------------------------
@dataclass
class RunReport:
    results: list[ShapeResult]
    failures: list[ShapeFailure]
    skipped: int
    seconds: float


def load_keys(shapes_path: str) -> list[GemmKey]:
    """The shapes to tune, in file order (ShapesFileError / ConfigError name file and line)."""
    return [k for k, _ in read_shapes(shapes_path)]


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
) -> RunReport:
    t0 = time.perf_counter()
    import_plugins()
    keys = load_keys(shapes_path)
    ident = identity(device)
    done = set() if all_shapes else done_keys(output, ident)  # also validates an existing output file
    todo = [k for k in keys if k not in done]
    skipped = len(keys) - len(todo)
    if skipped:
        log(f"gemmtune: {skipped} of {len(keys)} shapes already tuned in {output} for "
            f"{ident.gfx}/{ident.cu_num} (skipped; --all retunes them)")  # fmt: skip
    from .search import precompile_all, select_backends

    chosen = select_backends(device, opts.libtypes)  # raises on an unknown/unavailable backend
    if not todo:
        return RunReport([], [], skipped, time.perf_counter() - t0)
    log(f"gemmtune: tuning {len(todo)} shapes on {device} ({ident.gfx}, {ident.cu_num} units) with "
        f"{', '.join(chosen)}{f' in {mp_workers} worker(s)' if mp_workers else ''}")  # fmt: skip
    if precompile and device.type == "cuda" and todo:
        tp = time.perf_counter()
        fails = precompile_all(todo, device, opts, workers=min(16, os.cpu_count() or 1))
        log(f"gemmtune: precompiled kernels in {time.perf_counter() - tp:.1f}s ({len(fails)} did not compile)")
    exit_after = int(os.environ.get(EXIT_AFTER_ENV, "0") or 0)
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), unit="shape", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    say = (lambda m: bar.write(m, file=sys.stderr)) if bar is not None else log
    gen: Iterator = (
        run_workers(todo, device, opts, mp_workers, timeout, say, verbose=verbose)
        if mp_workers
        else run_inprocess(todo, device, opts, say if verbose else (lambda m: None))
    )
    results, failures, written = [], [], 0
    try:
        for item in gen:
            if isinstance(item, ShapeResult):
                write_row(output, result_row(item, ident))
                if profile_file:
                    append_profile(profile_file, item, ident)
                results.append(item)
                written += 1
                if exit_after and written >= exit_after:
                    os._exit(17)
            else:
                failures.append(item)
            if verbose:
                say(describe_item(item))
            if bar is not None:
                bar.update(1)
                if isinstance(item, ShapeResult):
                    bar.set_postfix_str(f"{item.key.M}x{item.key.N}x{item.key.K}: {item.winner.libtype} "
                                        f"{item.speedup:.2f}x", refresh=False)  # fmt: skip
    finally:
        if bar is not None:
            bar.close()
        if hasattr(gen, "close"):
            gen.close()
    return RunReport(results, failures, skipped, time.perf_counter() - t0)


def describe_item(item) -> str:
    if isinstance(item, ShapeFailure):
        return f"FAILED {item.key.describe()}: {item.reason}"
    r = item
    ok = sum(c.status == "ok" for c in r.candidates)
    verdict = "default kept" if r.kept_default else f"{r.speedup:.3f}x vs default"
    note = f" [{r.note}]" if r.note else ""
    return (
        f"{r.key.describe()}: {r.winner.name} {r.us:.2f} us ({verdict}, default {r.default_us:.2f} us, "
        f"noise {r.noise * 100:.1f}%, {ok}/{len(r.candidates)} candidates passed, {r.seconds:.1f}s){note}"
    )


# ---- summary -------------------------------------------------------------------------------------
def summary_lines(report: RunReport, output: str) -> list[str]:
    lines = []
    if report.results:
        lines.append(f"{'shape':<28} {'winner':<44} {'us':>9} {'default':>9} {'speedup':>8} {'roof':>6}")
        for r in report.results:
            k = r.key
            shape = f"{k.M}x{k.N}x{k.K}{'+b' if k.bias else ''} {str(k.dtype).replace('torch.', '')}"
            win = ("= " if r.kept_default else "") + r.winner.name
            roof = "-" if r.roof_pct != r.roof_pct else f"{r.roof_pct:.0f}%"
            lines.append(f"{shape:<28} {win[:44]:<44} {r.us:>9.2f} {r.default_us:>9.2f} {r.speedup:>7.2f}x {roof:>6}")
    bad = collections.Counter()
    examples: dict[str, str] = {}
    for r in report.results:
        for c in r.candidates:
            if c.status not in ("ok", "pending"):
                bad[c.status] += 1
                examples.setdefault(c.name, f"{c.status}: {c.reason}")
    n = len(report.results)
    if n:
        sp = [r.speedup for r in report.results if r.speedup == r.speedup and r.speedup > 0]
        geo = math.exp(sum(math.log(s) for s in sp) / len(sp)) if sp else math.nan
        kept = sum(r.kept_default for r in report.results)
        libs = collections.Counter(r.winner.libtype for r in report.results)
        lines.append(
            f"tuned {n} shapes in {report.seconds:.1f}s -> {output}: default kept for {kept}, "
            f"winners {dict(libs)}, geomean speedup vs default {geo:.3f}x"
        )
    if bad:
        lines.append(f"candidates not timed: {dict(bad)}; e.g.")
        lines += [f"  {name}: {why}" for name, why in list(examples.items())[:8]]
    if report.skipped:
        lines.append(f"skipped {report.skipped} shapes already tuned (--all retunes them)")
    for f in report.failures:
        lines.append(f"FAILED {f.key.describe()}: {f.reason}")
    return lines
