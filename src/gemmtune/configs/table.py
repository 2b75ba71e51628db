"""A merged set of tuned tables and the lookup rule for a GEMM key on one GPU.

Merge rule (several files, `GEMMTUNE_CONFIG=a.csv:b.csv`): on a duplicate key an override row
(us == 0) beats any timed row, the earlier file winning between two overrides; otherwise the lowest
measured `us` wins. Conflicts are collected and reported once; loading never raises on a duplicate
and never writes to the files it reads.

Untuned-M rule: a key whose M has no row resolves to the row of the same (N, K, bias, dtypes,
scaleAB, bpreshuffle) on the same GPU with the nearest tuned M at or above it, else the largest M
below it. (aiter pads M up a fixed ladder and misses when the padded M has no row.)
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

from ..device import DeviceIdentity
from ..errors import ConfigError
from ..keys import GemmKey
from .io import read_records, write_atomic
from .schema import TUNED_COLUMNS, TunedRow, normalize_header, parse_tuned_row

log = logging.getLogger("gemmtune")


@dataclass
class Conflict:
    key: tuple
    kept: TunedRow
    dropped: TunedRow

    def describe(self) -> str:
        k = self.kept
        return (
            f"{k.gfx or '*'}/{k.cu_num} {k.key.describe()}: kept {k.libtype} us={k.us:g} ({k.where}), "
            f"dropped {self.dropped.libtype} us={self.dropped.us:g} ({self.dropped.where})"
        )


def _wins(new: TunedRow, old: TunedRow) -> bool:
    if new.is_override or old.is_override:
        return new.is_override and not old.is_override
    return new.us < old.us


def read_table_file(path: str) -> tuple[list[str], list[TunedRow]]:
    """The file's own header (normalized) and its rows, in file order. Never modifies the file."""
    header, records = read_records(path)
    columns = normalize_header(header, path)
    rows = []
    for line, rec in records:
        raw = {columns[i]: rec[h] for i, h in enumerate(header)}
        rows.append(parse_tuned_row(raw, path, line))
    return columns, rows


class ConfigTable:
    """Tuned rows from one or more files, merged, with a per-GPU index for lookups."""

    def __init__(self, rows: list[TunedRow] | None = None, files: list[str] | None = None):
        self.files: list[str] = list(files or [])
        self.columns: list[str] = list(TUNED_COLUMNS)
        self.conflicts: list[Conflict] = []
        self._rows: dict[tuple, TunedRow] = {}
        self._index: dict[DeviceIdentity, dict[tuple, tuple[list[int], list[TunedRow]]]] = {}
        for row in rows or []:
            self.add(row)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def load(cls, paths: list[str] | str) -> ConfigTable:
        """Read and merge `paths` (a list, or a ':'-separated string as in GEMMTUNE_CONFIG)."""
        if isinstance(paths, str):
            paths = [p for p in paths.split(":") if p.strip()]
        table = cls()
        for path in paths:
            columns, rows = read_table_file(path)
            if len(paths) == 1:
                table.columns = columns  # a single file writes back with its own columns
            table.files.append(path)
            for row in rows:
                table.add(row)
        table.report_conflicts()
        return table

    def add(self, row: TunedRow) -> None:
        full = row.full_key
        old = self._rows.get(full)
        if old is None:
            self._rows[full] = row
        elif _wins(row, old):
            self._rows[full] = row
            self.conflicts.append(Conflict(full, row, old))
        else:
            self.conflicts.append(Conflict(full, old, row))
        self._index.clear()

    def report_conflicts(self) -> None:
        """One warning for all duplicate keys, naming the first few."""
        if not self.conflicts:
            return
        shown = "; ".join(c.describe() for c in self.conflicts[:3])
        more = (
            f" (+{len(self.conflicts) - 3} more; `gemmtune show-config` lists all)" if len(self.conflicts) > 3 else ""
        )
        log.warning("gemmtune: %d duplicate config key(s): %s%s", len(self.conflicts), shown, more)

    # ---- reading --------------------------------------------------------------------------
    @property
    def rows(self) -> list[TunedRow]:
        return list(self._rows.values())

    def __len__(self) -> int:
        return len(self._rows)

    def rows_for(self, ident: DeviceIdentity) -> list[TunedRow]:
        """Rows that apply to this GPU: its cu_num and one of its gfx aliases (exact, bare arch, legacy)."""
        aliases = ident.gfx_aliases()
        return [r for r in self._rows.values() if r.cu_num == ident.cu_num and r.gfx in aliases]

    def _family_index(self, ident: DeviceIdentity):
        idx = self._index.get(ident)
        if idx is None:
            rank = {g: i for i, g in enumerate(ident.gfx_aliases())}
            fams: dict[tuple, dict[int, TunedRow]] = {}
            for r in self.rows_for(ident):
                per_m = fams.setdefault(r.key.shape_family(), {})
                # The most specific gfx wins for one M (sm90-80G over sm90 over a legacy row).
                old = per_m.get(r.key.M)
                if old is None or rank[r.gfx] < rank[old.gfx]:
                    per_m[r.key.M] = r
            idx = {}
            for fam, per_m in fams.items():
                ms = sorted(per_m)
                idx[fam] = (ms, [per_m[m] for m in ms])
            self._index[ident] = idx
        return idx

    def lookup(self, key: GemmKey, ident: DeviceIdentity) -> TunedRow | None:
        """The row for `key` on `ident` under the untuned-M rule, or None (use the default backend)."""
        entry = self._family_index(ident).get(key.shape_family())
        if entry is None:
            return None
        ms, rows = entry
        i = bisect.bisect_left(ms, key.M)
        return rows[i] if i < len(ms) else rows[-1]

    # ---- writing --------------------------------------------------------------------------
    def write(self, path: str, columns: list[str] | None = None) -> None:
        """Write all rows atomically, with this table's columns (a single loaded file's own)."""
        cols = columns or self.columns
        write_atomic(path, cols, ([r.value(c) for c in cols] for r in self._rows.values()))


def load_paths_env(value: str) -> ConfigTable:
    """GEMMTUNE_CONFIG's value -> table; a named file that does not exist is an error, not 'no table'."""
    paths = [p for p in value.split(":") if p.strip()]
    if not paths:
        raise ConfigError("GEMMTUNE_CONFIG is set but names no file")
    return ConfigTable.load(paths)
