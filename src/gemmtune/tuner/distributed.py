"""`gemmtune tune` over torch.distributed: one launch (torchrun) tunes a shape list on every rank's GPU.

Rank 0 reads the shape list and the output table, learns every rank's GPU (gfx, cu_num), and lists each
kind's untuned keys, largest expected cost first; the ranks of that kind claim them one at a time from a
counter in the launch's store as their GPU frees up. Each rank tunes what it claims on its own device
(cuda:LOCAL_RANK under a crash-isolating worker, or the CPU in-process) and sends every finished key to
rank 0, which writes its row for the sender's GPU at once, through the same sink as a 1-process run
(table lock, atomic rewrite). A rank that dies loses only the key it was tuning: the others go on
claiming the rest, the output holds every row written so far, and the restarted launch skips them.

Objects travel over a gloo group (the default one on CPUs, a gloo group beside NCCL on GPUs): rank 0
receives from any rank as keys finish, which NCCL's point-to-point cannot do.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import families
from ..device import DeviceIdentity, identity
from .compile_ahead import Board, CompileAhead
from .output import check_tune_outputs, done_keys
from .runner import (
    RowSink,
    RunReport,
    _Progress,
    compile_processes,
    estimated_cost,
    load_keys,
    range_floors,
    tune_items,
    with_donor,
)
from .search import TuneOptions, select_backends
from .workers import import_plugins

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# A gap between two messages is one key's tuning, or a rank's precompile before its first: generous.
CONTROL_TIMEOUT = timedelta(hours=2)


def launched_by_torchrun(environ=os.environ) -> bool:
    """True when torchrun (or another launcher setting its variables) started this process."""
    return all(environ.get(v) for v in TORCHRUN_ENV)


@dataclass
class Fleet:
    rank: int
    world: int
    local_rank: int
    local_world: int
    control: object  # the gloo process group objects travel over


@contextlib.contextmanager
def joined(device_type: str, environ=os.environ) -> Iterator[Fleet]:
    """Join the launch's process group (NCCL on GPUs, gloo on CPUs) and leave it at the end."""
    missing = [v for v in TORCHRUN_ENV if not environ.get(v)]
    if missing:
        raise RuntimeError(f"--distributed: {', '.join(missing)} not set; launch with torchrun")
    local_rank = int(environ["LOCAL_RANK"])
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=CONTROL_TIMEOUT)
    try:
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if cuda else dist.group.WORLD
        yield Fleet(dist.get_rank(), dist.get_world_size(), local_rank,
                    int(environ.get("LOCAL_WORLD_SIZE", "1")), control)  # fmt: skip
    finally:
        dist.destroy_process_group()


def rank_device(device: torch.device, fleet: Fleet) -> torch.device:
    """A rank tunes on its own GPU (cuda:LOCAL_RANK); on a CPU every rank uses the CPU."""
    return torch.device("cuda", fleet.local_rank) if device.type == "cuda" else device


def by_cost(keys: list, costs: dict) -> list:
    """The keys most expensive first (ties in list order): claimed in this order, the last keys to
    finish are the cheap ones, so the ranks end close together."""
    return [keys[i] for i in sorted(range(len(keys)), key=lambda i: (-costs[keys[i]], i))]


class Claims:
    """One GPU kind's keys, taken one at a time by whichever of that kind's ranks is free: each next
    key is an atomic add on a counter in the launch's store, so a rank that drew cheap keys takes more
    (a deal fixed up front left one rank idle while the other finished). Its length is the kind's list."""

    def __init__(self, keys: list, store, counter: str):
        self.keys, self.store, self.counter = keys, store, counter

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self) -> Iterator:
        while (i := self.store.add(self.counter, 1) - 1) < len(self.keys):
            yield self.keys[i]


@dataclass
class Plan:
    """What rank 0 decided: per GPU kind among the ranks, the keys it still needs (most expensive first;
    the kind's ranks claim them from one counter) and their M floors; each rank's kind; what was skipped."""

    family: str
    run: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this launch's claim counters
    todo: dict[int, list] = field(default_factory=dict)
    floors: dict[int, dict] = field(default_factory=dict)
    kind_of: dict[int, int] = field(default_factory=dict)
    skipped: int = 0
    lines: list[str] = field(default_factory=list)

    def keys_of(self, rank: int) -> list:
        return self.todo[self.kind_of[rank]]

    def floors_of(self, rank: int) -> dict:
        return self.floors[self.kind_of[rank]]

    def everything(self) -> list:
        """Every key to tune, once per GPU kind: the progress bar's total."""
        return [k for kind in sorted(self.todo) for k in self.todo[kind]]

    def claims(self, rank: int, store) -> Claims:
        return Claims(self.keys_of(rank), store, f"gemmtune/claims/{self.run}/{self.kind_of[rank]}")


def make_plan(fam, keys: list, idents: list[DeviceIdentity], output: str, all_shapes: bool) -> Plan:
    """Per GPU kind among the ranks: the keys without a row for it in `output`, for that kind's ranks."""
    plan = Plan(fam.name)
    kinds: dict[DeviceIdentity, list[int]] = {}
    for r, ident in enumerate(idents):
        kinds.setdefault(ident, []).append(r)
    for kind, (ident, ranks) in enumerate(kinds.items()):
        tuned = done_keys(output, ident, fam)
        todo = [k for k in keys if all_shapes or k not in tuned]
        floors = range_floors(fam, keys, list(tuned))
        plan.skipped += len(keys) - len(todo)
        if len(todo) < len(keys):
            plan.lines.append(f"gemmtune: {len(keys) - len(todo)} of {len(keys)} shapes already tuned in {output} "
                              f"for {ident.gfx}/{ident.cu_num} ({fam.name}; skipped, --all retunes them)")  # fmt: skip
        plan.todo[kind] = by_cost(todo, {k: estimated_cost(fam, k) for k in todo})
        plan.floors[kind] = {k: floors[k] for k in todo}
        plan.kind_of.update(dict.fromkeys(ranks, kind))
        if todo:
            plan.lines.append(f"gemmtune: tuning {len(todo)} {fam.name} keys on {len(ranks)} rank(s) of "
                              f"{ident.gfx} ({ident.cu_num} units)")  # fmt: skip
    return plan


def _broadcast(obj, fleet: Fleet):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=fleet.control)
    return box[0]


def _gather(obj, fleet: Fleet) -> list:
    out = [None] * fleet.world
    dist.all_gather_object(out, obj, group=fleet.control)
    return out


def host_share(shares: dict[int, list], hosts: list[str], rank: int) -> tuple[list, tuple[int, int]]:
    """The keys any rank on `rank`'s host may tune, once each (in rank order: each rank lists the same),
    and `rank`'s part (i, n) of compiling their kernels: the host's ranks share one on-disk Triton cache,
    so each compiles 1/n of the host's kernels once instead of every rank compiling all of them."""
    here = [r for r, h in enumerate(hosts) if h == hosts[rank]]
    return list(dict.fromkeys(k for r in here for k in shares.get(r, []))), (here.index(rank), len(here))


def _compile_on_host(fleet: Fleet, plan, fam, dev: torch.device, opts: TuneOptions, workers: int,
                     store) -> CompileAhead:  # fmt: skip
    """Start compiling the host's Triton kernels in the background, split over its ranks: each rank builds
    its part and publishes its progress on a board in the launch's store, and a key is tuned once every
    part has built the kernels up to it."""
    shares = {r: plan.keys_of(r) for r in plan.kind_of}
    hosts = _gather(socket.gethostname(), fleet)
    keys, share = host_share(shares, hosts, fleet.rank)
    floors: dict = {}
    for kind in sorted(plan.floors):  # a key's floor as its tune gets it (the first GPU kind's, if several)
        floors.update({k: f for k, f in plan.floors[kind].items() if k not in floors})
    board = Board(store, f"gemmtune/compiled/{plan.run}/{hosts[fleet.rank]}", share[1])
    return CompileAhead(keys, dev, opts, workers, fam.name, share=share, floors=floors, board=board).start()


def _send_to_rank0(item, fleet: Fleet) -> None:
    """One finished key (None: this rank is done) to rank 0: its length, then its pickled bytes."""
    data = b"" if item is None else pickle.dumps(item)
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=0, group=fleet.control)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=0, group=fleet.control)


def _receive_any(fleet: Fleet) -> tuple[int, object]:
    """The next message from whichever rank sends first (the object collectives need a known sender)."""
    size = torch.empty(1, dtype=torch.int64)
    sender = dist.recv(size, src=None, group=fleet.control)
    if not size.item():
        return sender, None
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(data, src=sender, group=fleet.control)
    return sender, pickle.loads(data.numpy().tobytes())


def _attempt(fn):
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - sent to every rank, raised there
        return None, str(exc) or type(exc).__name__


def _on_every_rank(fleet: Fleet, fn):
    """fn() on every rank; the first rank's error, naming it, raised on all of them."""
    value, err = _attempt(fn)
    errors = _gather(err, fleet)
    for r, e in enumerate(errors):
        if e:
            raise RuntimeError(f"rank {r}: {e}")
    return value


def _from_rank0(fleet: Fleet, fn):
    """fn() on rank 0, its value (or its error, raised) on every rank."""
    value, err = _attempt(fn) if fleet.rank == 0 else (None, None)
    value, err = _broadcast((value, err), fleet)
    if err:
        raise RuntimeError(err)
    return value


def _receive(fleet: Fleet, sink: RowSink, idents: list[DeviceIdentity], failed: list) -> None:
    """Rank 0: every other rank's finished keys, written as they come, until each sent its end."""
    open_ranks = set(range(1, fleet.world))
    try:
        while open_ranks:
            sender, item = _receive_any(fleet)
            if item is None:
                open_ranks.discard(sender)
            else:
                sink.take(item, idents[sender])
    except Exception as exc:  # noqa: BLE001 - re-raised by the main thread
        failed.append(f"receiving rows from ranks {sorted(open_ranks)}: {type(exc).__name__}: {exc}")


def tune_fleet(shapes_path: str, output: str, opts: TuneOptions, device: torch.device, fleet: Fleet,
               mp_workers: int = 0, timeout: float = 60.0, all_shapes: bool = False,
               profile_file: str | None = None, precompile: bool = True,
               log: Callable[[str], None] = print, progress: bool = True, verbose: bool = False,
               family: str | None = None, ms: list[int] | None = None,
               donor: str | None = None) -> RunReport:  # fmt: skip
    """This rank's part of a distributed `tune`; rank 0's report covers every rank's keys (`donor`: as
    tune_file's, read on rank 0)."""
    t0 = time.perf_counter()
    if mp_workers > 1:
        raise ValueError(f"--mp {mp_workers}: under torch.distributed each rank tunes on its own device; use 0 or 1")
    dev = rank_device(device, fleet)
    _from_rank0(fleet, lambda: check_tune_outputs(shapes_path, output, profile_file))  # rank 0 writes them
    _on_every_rank(fleet, import_plugins)  # before any key of a plugin family is unpickled

    def read_list():
        fam, keys = load_keys(shapes_path, family, ms)
        return fam.name, keys

    fam_name, keys = _from_rank0(fleet, read_list)
    fam = families.get(fam_name)
    log0 = log if fleet.rank == 0 else (lambda m: None)
    opts = _from_rank0(fleet, lambda: with_donor(opts, donor, shapes_path, output, fam, keys, log0))
    ident = _on_every_rank(fleet, lambda: (select_backends(dev, opts.libtypes, fam_name), identity(dev))[1])
    idents = _gather(ident, fleet)
    plan = _from_rank0(fleet, lambda: make_plan(fam, keys, idents, output, all_shapes))
    if fleet.rank == 0:
        for line in plan.lines:
            log(line)
    store = dist.distributed_c10d._get_default_store()
    mine = plan.claims(fleet.rank, store)
    compile_workers = compile_processes(fleet.local_world)
    log_here = log if fleet.rank == 0 else (lambda m: None)  # rank 0 speaks for the launch
    # tune_items starts this rank's worker, then `host` (the host's kernels compiling in the background,
    # split over its ranks) in place of its own compile; each claimed key waits until its kernels are built.
    host = None
    if precompile and dev.type == "cuda":
        host = functools.partial(_compile_on_host, fleet, plan, fam, dev, opts, compile_workers, store)
    if fleet.rank == 0:
        bar = _Progress(fam, plan.everything(), progress, log)
        sink = RowSink(output, fam, profile_file, bar, verbose)
        failed: list[str] = []
        receiver = threading.Thread(target=_receive, args=(fleet, sink, idents, failed), daemon=True)
        try:
            items = tune_items(mine, plan.floors_of(0), fam, dev, opts, mp_workers, timeout, bar.say, verbose,
                               False, log_here, compile_workers, prepare=host)  # fmt: skip
            receiver.start()  # after the precompile's collectives: the receiver's recv shares their group
            for item in items:
                sink.take(item, ident)
            receiver.join()
        finally:
            bar.close()
        if failed:
            raise RuntimeError(failed[0])
        dist.barrier(group=fleet.control)
        return RunReport(sink.results, sink.failures, plan.skipped, time.perf_counter() - t0, fam.name,
                         donor or "")  # fmt: skip
    say = (lambda m: log(f"[rank {fleet.rank}] {m}")) if verbose else (lambda m: None)
    for item in tune_items(mine, plan.floors_of(fleet.rank), fam, dev, opts, mp_workers, timeout, say, verbose,
                           False, log_here, compile_workers, prepare=host):  # fmt: skip
        _send_to_rank0(item, fleet)
    _send_to_rank0(None, fleet)
    dist.barrier(group=fleet.control)
    return RunReport([], [], 0, time.perf_counter() - t0, fam.name)
