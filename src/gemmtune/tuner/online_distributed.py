"""Online tuning under torch.distributed: every rank runs the same row for a key from the same moment.

Tensor-parallel ranks that pick different kernels for one key drift apart numerically and in time, so
under torch.distributed a background tuner (online_background.py) neither tunes what it misses nor
adopts rows on its own: it keeps its misses, and `sync_online_rows(group)`, a collective every rank of
the group calls at the same point of its serving loop, does the rest:
1. all ranks gather the keys missed since the last sync and the rows finished since then;
2. every rank adopts the gathered rows, in rank order, into its tables in effect and empties those
   families' runner caches: the rows serve from the next call on, on every rank alike;
3. the group's first rank queues the gathered keys for its background tuner, so each key is tuned once,
   on one GPU; its rows are shared at a later sync (and written to its table file as they finish).

Only the serving loop knows a point where every rank is outside a CUDA graph capture and a
torch.compile trace, so the collective is never issued from a miss: sync_online_rows refuses to run
during a capture. Without torch.distributed it adopts the finished rows of this process.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import families
from ..configs.schema import TunedRow
from ..dispatch import get_dispatcher
from . import online_common
from .online_background import BackgroundTuner


def _local_device(device_type: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


def sync_online_rows(group=None) -> list[TunedRow]:
    """Share online tuning's misses and rows with every rank of `group` (None: the default group) and
    adopt the rows on all of them at once; call it on every rank, outside a CUDA graph capture. Without
    torch.distributed: adopt this process's finished rows. Returns the rows adopted."""
    dispatcher = get_dispatcher()
    tuner = dispatcher.miss_hook()
    if not isinstance(tuner, BackgroundTuner):
        what = "off" if tuner is None else f"in {getattr(tuner, 'mode', type(tuner).__name__)} mode"
        raise ValueError(f"gemmtune.sync_online_rows: online tuning must be on in background mode, it is {what}")
    here = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if not online_common.safe_point(here):
        raise RuntimeError("gemmtune.sync_online_rows: called during a CUDA graph capture or torch.compile trace")
    if not online_common.distributed():
        return tuner.adopt(dispatcher)
    dist = torch.distributed
    tuner.lockstep = True
    missed, finished = tuner.take_to_share()
    mine = (missed, [(family.name, dataclasses.replace(row, family=None)) for row, family in finished])
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    adopted, names = [], set()
    for _, rows in everyone:
        for name, row in rows:
            row = dataclasses.replace(row, family=families.get(name))
            dispatcher.table(name).add(row)
            adopted.append(row)
            names.add(name)
    for name in names:
        dispatcher.forget_runners(name)
    first = dist.get_process_group_ranks(group)[0] if group is not None else 0
    if dist.get_rank() == first:
        for keys, _ in everyone:
            for name, key, device_type in keys:
                tuner.enqueue(key, families.get(name), _local_device(device_type), dispatcher)
    return adopted
