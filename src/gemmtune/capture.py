"""Shape capture: record every distinct GEMM a run dispatches, with call counts, in aiter's untuned CSV.

A shape is written the first time it is seen (so a crash loses no shape) and counts are flushed at
exit. Every write is a locked read-merge-write of the whole file, renamed into place, so several
processes capturing into one file lose nothing and the file is always valid.
"""

from __future__ import annotations

import atexit
import os
import threading

import torch

from .configs.io import locked, read_records, write_atomic
from .configs.schema import UNTUNED_COLUMNS, parse_column, positive_int
from .errors import ShapesFileError
from .keys import GemmKey, dtype_name, parse_bool, parse_dtype

CAPTURE_COLUMNS = [*UNTUNED_COLUMNS, "count"]


def key_to_record(key: GemmKey) -> list[str]:
    return [
        str(key.M), str(key.N), str(key.K), str(key.bias), dtype_name(key.dtype),
        dtype_name(key.outdtype), str(key.scaleAB), str(key.bpreshuffle),
    ]  # fmt: skip


def parse_shape_record(rec: dict[str, str], path: str, line: int) -> GemmKey:
    """One untuned-CSV record -> GemmKey (only M, N, K are required); errors name file:line."""

    def get(col, conv, default=None):
        return parse_column(rec, col, conv, default, path, line, error=ShapesFileError)

    dtype = get("dtype", parse_dtype, torch.bfloat16)
    outdtype = get("outdtype", parse_dtype, dtype)
    return GemmKey(
        get("M", positive_int), get("N", positive_int), get("K", positive_int), get("bias", parse_bool, False),
        dtype, outdtype, get("scaleAB", parse_bool, False), get("bpreshuffle", parse_bool, False),
    )  # fmt: skip


def read_shapes(path: str) -> list[tuple[GemmKey, int]]:
    """(key, count) for each record of an untuned/capture CSV; duplicate keys are summed, order kept."""
    header, records = read_records(path)
    missing = [c for c in ("M", "N", "K") if c not in header]
    if missing:
        raise ShapesFileError(f"{path}:1: missing column(s) {', '.join(missing)} (need at least M,N,K)")
    out: dict[GemmKey, int] = {}
    for line, rec in records:
        key = parse_shape_record(rec, path, line)
        count = rec.get("count", "").strip()
        try:
            n = int(count) if count else 0
        except ValueError:
            raise ShapesFileError(f"{path}:{line}: column 'count': bad value {count!r}") from None
        out[key] = out.get(key, 0) + n
    return list(out.items())


class ShapeCapture:
    """Collects (key -> calls) for one process and merges it into `path` under a file lock."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.counts: dict[GemmKey, int] = {}
        self._flushed: dict[GemmKey, int] = {}
        self._lock = threading.Lock()
        atexit.register(self.flush)

    def add_key(self, key: GemmKey) -> None:
        """A key seen for the first time in this process: count it and write it out now."""
        with self._lock:
            self.counts.setdefault(key, 0)
        self.flush()

    def counting(self, key: GemmKey, runner):
        """Wrap `runner` so each call is counted (only installed while capture is on)."""
        counts = self.counts

        def run(x, w, bias):
            counts[key] += 1
            return runner(x, w, bias)

        return run

    def flush(self) -> None:
        with self._lock:
            snapshot = dict(self.counts)
        # Keys never written yet go out even with zero calls; others only when their count moved.
        pending = {k: c - self._flushed.get(k, 0) for k, c in snapshot.items()
                   if k not in self._flushed or c != self._flushed[k]}  # fmt: skip
        if not pending:
            return
        with locked(self.path):
            merged: dict[GemmKey, int] = dict(read_shapes(self.path)) if os.path.exists(self.path) else {}
            for key, delta in pending.items():
                merged[key] = merged.get(key, 0) + delta
            write_atomic(self.path, CAPTURE_COLUMNS, ([*key_to_record(k), str(c)] for k, c in merged.items()))
        self._flushed.update(snapshot)
