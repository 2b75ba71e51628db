"""Shape capture: record every distinct key a run dispatches, with call counts, in aiter's untuned CSV
of the key's family.

`GEMMTUNE_CAPTURE=shapes.csv` records a16w16 GEMMs into shapes.csv and every other family into a file
beside it named for the family (`shapes.batched.csv`, `shapes.a8w8.csv` ...), each in that family's
untuned columns plus `count`. A shape is written the first time it is seen (so a crash loses no shape)
and counts are flushed at exit. Every write is a locked read-merge-write of the whole file, renamed
into place, so several processes capturing into one file lose nothing and the file is always valid.
Capture merges only into a file it wrote: one whose header is exactly the family's untuned columns plus
`count`. Any other file (a tuned table, bench output, a shape list with columns of its own) is refused
before anything runs, and left as it was.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import threading

from . import families
from .concurrency import Once, at_fork_in_child
from .configs.files import check_writable
from .configs.io import locked, read_csv, write_atomic
from .configs.schema import UNTUNED_COLUMNS, parse_key
from .errors import ShapesFileError
from .families import Family
from .keys import GemmKey

CAPTURE_COLUMNS = [*UNTUNED_COLUMNS, "count"]
# Columns only a tuned table has: a file with any of them is a table, never a shape list.
TUNED_ONLY = frozenset({"us", "libtype", "kernelName", "solidx", "kernelId", "us1", "kernelName1"})


def key_to_record(key, family: Family | None = None) -> list[str]:
    fam = family or families.get("a16w16")
    rec = fam.key_record(key)
    return [rec[c] for c in fam.untuned_columns]


def capture_path(path: str, family: Family) -> str:
    """Where `family`'s shapes go when capture is pointed at `path` (a16w16: path itself)."""
    if family.name == "a16w16":
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{family.name}{ext or '.csv'}"


def read_shape_list(path: str, family: Family | str | None = None) -> tuple[Family, list[tuple[tuple, int]]]:
    """(family, [(key, count)]) of an untuned/capture CSV; duplicate keys are summed, order kept. The
    family is the one named, else the header's (and the file name's, where headers are alike)."""
    text = read_csv(path, ShapesFileError)
    header = text.header
    if family is None:
        try:
            fam = families.detect(header, path)
        except Exception as exc:  # noqa: BLE001 - reworded as a shape-list error
            raise ShapesFileError(str(exc).replace("fit no GEMM family", "fit no GEMM family's shape list")) from None
    else:
        fam = families.get(family) if isinstance(family, str) else family
        if not families.fits(fam, header):
            missing = sorted(fam.signature - set(header))
            what = f"missing column(s) {', '.join(missing)}" if missing else f"columns {','.join(header)}"
            raise ShapesFileError(f"{path}:1: not a shape list of family {fam.name}: {what} "
                                  f"(expected {','.join(fam.untuned_columns)})")  # fmt: skip
    out: dict[tuple, int] = {}
    for line, rec in text.records:
        key = parse_key(fam, rec, path, line, ShapesFileError)
        untunable = fam.untunable(key)
        if untunable is not None:
            raise ShapesFileError(f"{path}:{line}: column {untunable[0]!r}: {untunable[1]}")
        count = rec.get("count", "").strip()
        try:
            n = int(count) if count else 0
        except ValueError:
            n = -1
        if n < 0:
            raise ShapesFileError(f"{path}:{line}: column 'count': bad value {count!r} (a call count: a whole "
                                  "number >= 0)")  # fmt: skip
        out[key] = out.get(key, 0) + n
    return fam, list(out.items())


def read_shapes(path: str, family: Family | str | None = "a16w16") -> list[tuple[GemmKey, int]]:
    """(key, count) for each record of an untuned/capture CSV of `family` (a16w16 by default)."""
    return read_shape_list(path, family)[1]


def refuse_tuned_table(path: str, family: Family | None = None) -> None:
    """ShapesFileError naming `path` and why, unless capture may merge `family`'s shapes into it: its folder
    exists and is writable, and it does not exist yet, is empty, or is a regular file with exactly capture's
    columns of `family` (files.check_writable: a symlink is judged by the file it names)."""
    fam = family or families.get("a16w16")
    real = check_writable(path, ShapesFileError)
    if not os.path.exists(real) or os.path.getsize(real) == 0:
        return
    header = read_csv(path, ShapesFileError).header
    tuned = sorted(TUNED_ONLY & set(header))
    if tuned:
        raise ShapesFileError(
            f"{path} is a tuned table (it has {', '.join(tuned)} columns), not a shape list: capture would "
            "overwrite it; capture into another file"
        )
    want = [*fam.untuned_columns, "count"]
    if header != want:
        raise ShapesFileError(
            f"{path} is not a capture file of family {fam.name} (columns {','.join(header)}, capture writes "
            f"{','.join(want)}): merging would rewrite it; capture into another file"
        )


def check_capture_targets(path: str) -> None:
    """refuse_tuned_table for `path` and every family's file beside it (all before any shape is seen)."""
    for fam in families.all_families():
        refuse_tuned_table(os.path.abspath(capture_path(path, fam)), fam)


class ShapeCapture:
    """Collects (key -> calls) of one family for one process and merges it into `path` under a lock.

    Counting takes no lock: each thread counts into a tally of its own (only that thread writes it), and
    a flush adds the tallies up. Flushes run one at a time and write what moved since the last, so each
    call is written once however many threads count and flush. A fork's child starts with nothing
    pending (what the parent counted is the parent's to write) and writes its own calls at its exit,
    multiprocessing's fork children included (they leave through os._exit, past atexit).
    """

    def __init__(self, path: str, family: Family | str = "a16w16"):
        self.family = families.get(family) if isinstance(family, str) else family
        self.path = os.path.abspath(capture_path(path, self.family))
        refuse_tuned_table(self.path, self.family)
        self.columns = [*self.family.untuned_columns, "count"]
        self._start_counting()
        atexit.register(self.flush)
        _flush_at_multiprocessing_exit(self)
        multiprocessing.util.register_after_fork(self, _flush_at_multiprocessing_exit)
        at_fork_in_child(self, ShapeCapture._start_counting)

    def _start_counting(self) -> None:
        """No key seen, nothing counted or written: a new capture, or this process's part in a fork's child."""
        self._keys: dict[tuple, None] = {}  # every key seen, in order (written even with no call)
        self._local = threading.local()  # .tally: the calling thread's {key: calls}
        self._tallies: list[tuple[threading.Thread, dict]] = []
        self._retired: dict[tuple, int] = {}  # the tallies of threads that have ended
        self._flushed: dict[tuple, int] = {}
        self._lock = threading.Lock()  # the key set and the tally list
        self._flush_lock = threading.Lock()  # one flush at a time

    def add_key(self, key) -> None:
        """A key seen for the first time in this process: record it and write it out now."""
        with self._lock:
            self._keys.setdefault(key, None)
        self.flush()

    def counting(self, key, runner):
        """Wrap `runner` so each call is counted (only installed while capture is on)."""
        capture = self

        def run(*args):
            try:
                tally = capture._local.tally
            except AttributeError:  # this thread's first counted call
                tally = capture._new_tally()
            tally[key] = tally.get(key, 0) + 1
            return runner(*args)

        return run

    def _new_tally(self) -> dict:
        tally: dict = {}
        with self._lock:
            # Fold the tallies of ended threads (none of them counts again), so a server starting a
            # thread per request keeps one tally per live thread.
            live = []
            for thread, done in self._tallies:
                if thread.is_alive():
                    live.append((thread, done))
                else:
                    for k, n in done.items():
                        self._retired[k] = self._retired.get(k, 0) + n
            self._tallies = [*live, (threading.current_thread(), tally)]
        self._local.tally = tally
        return tally

    @property
    def counts(self) -> dict:
        """Calls per key so far in this process (every key seen, 0 for one not called yet)."""
        with self._lock:
            out = dict.fromkeys(self._keys, 0)
            for k, n in self._retired.items():
                out[k] = out.get(k, 0) + n
            tallies = [tally for _, tally in self._tallies]
        for tally in tallies:
            for k, n in tally.copy().items():  # copy: a C-level snapshot while its thread counts on
                out[k] = out.get(k, 0) + n
        return out

    def flush(self) -> None:
        with self._flush_lock:
            snapshot = self.counts
            # Keys never written yet go out even with zero calls; others only when their count moved.
            pending = {k: c - self._flushed.get(k, 0) for k, c in snapshot.items()
                       if k not in self._flushed or c != self._flushed[k]}  # fmt: skip
            if not pending:
                return
            with locked(self.path, error=ShapesFileError):
                refuse_tuned_table(self.path, self.family)  # another process may have put a file there meanwhile
                existing = os.path.exists(self.path) and os.path.getsize(self.path) > 0
                merged: dict = dict(read_shapes(self.path, self.family)) if existing else {}
                for key, delta in pending.items():
                    merged[key] = merged.get(key, 0) + delta
                rows = ([*key_to_record(k, self.family), str(c)] for k, c in merged.items())
                write_atomic(self.path, self.columns, rows, error=ShapesFileError)
            self._flushed.update(snapshot)


def _flush_at_multiprocessing_exit(capture: ShapeCapture) -> None:
    """Flush `capture` when a multiprocessing child exits (its registry of exit hooks is emptied at each
    fork, so a fork's child registers again)."""
    multiprocessing.util.Finalize(capture, capture.flush, exitpriority=0)


class CaptureSet:
    """The ShapeCaptures of every family for one capture path, made on first use (once, by one thread)."""

    def __init__(self, path: str):
        self.path = path
        check_capture_targets(path)
        self._by_family: dict[str, ShapeCapture] = {}
        self._making = Once()

    def for_family(self, family: Family) -> ShapeCapture:
        return self._making.get_or_make(self._by_family, family.name, lambda: ShapeCapture(self.path, family))

    def flush(self) -> None:
        for cap in list(self._by_family.values()):
            cap.flush()

    def files(self) -> list[str]:
        return [c.path for c in list(self._by_family.values())]

    @property
    def counts(self) -> dict:
        """Calls per key so far in this process, every family together."""
        return {k: n for cap in list(self._by_family.values()) for k, n in cap.counts.items()}
