"""Merged tuned tables, one per GEMM family, and the lookup rule for a key on one GPU.

Merge rule (several files, `GEMMTUNE_CONFIG=a.csv:b.csv`): on a duplicate key an override row
(us == 0) beats any timed row, the earlier file winning between two overrides; otherwise the lowest
measured `us` wins. Conflicts are collected and reported once; loading never raises on a duplicate
and never writes to the files it reads.

M rule: a key resolves to the row of its shape family (every key field but M) on this GPU with the
smallest M at or above its own whose answered range contains its M, else to none (the family's
default). A row's range is the one the tuner verified it on (`M_lo`..`M_hi`: it timed the winner
against the default at the range's edges, see tuner/search.py); a row without one (aiter's tables,
older gemmtune tables) answers its own M and the Ms aiter's own lookup pads up to it (a multiple of
16 up to 256, of 32 up to 1024, of 64 up to 4096, else 128), never a guess beyond that.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from .. import families
from ..device import DeviceIdentity
from ..errors import ConfigError
from ..families import Family
from .io import CsvText, read_csv, write_atomic
from .schema import TunedRow, normalize_header, parse_tuned_row

log = logging.getLogger("gemmtune")


@dataclass
class Conflict:
    key: tuple
    kept: TunedRow
    dropped: TunedRow

    def describe(self) -> str:
        k = self.kept
        return (
            f"{k.gfx or '*'}/{k.cu_num} {k.describe_key()}: kept {k.libtype} us={k.us:g} ({k.where}), "
            f"dropped {self.dropped.libtype} us={self.dropped.us:g} ({self.dropped.where})"
        )


def _wins(new: TunedRow, old: TunedRow) -> bool:
    if new.is_override or old.is_override:
        return new.is_override and not old.is_override
    return new.us < old.us


@dataclass
class TableFile:
    """One tuned CSV as read: its family, header as written, rows in file order."""

    path: str
    family: Family
    raw_header: list[str]
    rows: list[TunedRow] = field(default_factory=list)
    final_newline: bool = True

    @property
    def columns(self) -> list[str]:
        return families.normalize(self.family, [h.strip() for h in self.raw_header])

    def write(self, path: str | None = None) -> None:
        """Write the rows back with this file's own header: an unchanged table comes out byte-identical."""
        cols = self.columns
        write_atomic(path or self.path, self.raw_header, ([r.value(c) for c in cols] for r in self.rows),
                     self.final_newline)  # fmt: skip


def family_of(text: CsvText, family: Family | str | None = None) -> Family:
    """The family `text` belongs to: the one named (its header must fit), else detected from the header."""
    if family is not None:
        fam = families.get(family) if isinstance(family, str) else family
        if not families.fits(fam, text.header):
            found = families.detect(text.header, text.path, _kernel_names(text))
            raise ConfigError(f"{text.path}:1: expected a {fam.name} table, but its columns are a {found.name} "
                              f"table's ({','.join(text.header)})")  # fmt: skip
        return fam
    return families.detect(text.header, text.path, _kernel_names(text))


def _kernel_names(text: CsvText) -> list[str]:
    return [rec.get("kernelName", rec.get("kernelName1", "")) for _, rec in text.records[:200]]


def read_table_file(path: str, family: Family | str | None = None, allow_empty: bool = False) -> TableFile:
    """A tuned table's family, header and rows, in file order. Never modifies the file. A header with
    no rows is an error (a table that answers nothing is a mistake) unless `allow_empty`."""
    text = read_csv(path)
    fam = family_of(text, family)
    columns = normalize_header(text.header, path, fam)
    rows = []
    for line, rec in text.records:
        raw = {columns[i]: rec[h] for i, h in enumerate(text.header)}
        rows.append(parse_tuned_row(raw, path, line, fam))
    if not rows and not allow_empty:
        raise ConfigError(f"{path}: has a header but no rows (an empty table answers nothing)")
    return TableFile(path, fam, text.raw_header, rows, text.final_newline)


class ConfigTable:
    """Tuned rows of one family from one or more files, merged, with a per-GPU index for lookups."""

    def __init__(self, rows: list[TunedRow] | None = None, files: list[str] | None = None,
                 family: Family | str = "a16w16"):  # fmt: skip
        self.family: Family = families.get(family) if isinstance(family, str) else family
        self.files: list[str] = list(files or [])
        self.columns: list[str] = list(self.family.table_columns())
        self.conflicts: list[Conflict] = []
        self._rows: dict[tuple, TunedRow] = {}
        self._index: dict[DeviceIdentity, dict[tuple, tuple[list[int], list[TunedRow]]]] = {}
        for row in rows or []:
            self.add(row)

    # ---- building -------------------------------------------------------------------------
    @classmethod
    def load(cls, paths: list[str] | str, family: Family | str | None = None) -> ConfigTable:
        """Read and merge `paths` (a list, or a ':'-separated string) into one family's table. The family
        is `family`, else the first file's; a file of another family is an error naming both."""
        if isinstance(paths, str):
            paths = [p for p in paths.split(":") if p.strip()]
        table = None
        for path in paths:
            tf = read_table_file(path, family if family is not None else (table.family if table else None))
            if table is None:
                table = cls(family=tf.family)
                if len(paths) == 1:
                    table.columns = tf.columns  # a single file writes back with its own columns
            table.add_file(tf)
        table = table or cls(family=family or "a16w16")
        table.report_conflicts()
        return table

    def add_file(self, tf: TableFile) -> None:
        self.files.append(tf.path)
        for row in tf.rows:
            self.add(row)

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
        log.warning("gemmtune: %d duplicate config key(s) (%s): %s%s", len(self.conflicts), self.family.name, shown,
                    more)  # fmt: skip

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
            fam = self.family
            shapes: dict[tuple, dict[int, TunedRow]] = {}
            for r in self.rows_for(ident):
                per_m = shapes.setdefault(fam.shape_family(r.key), {})
                # The most specific gfx wins for one M (sm90-80G over sm90 over a legacy row).
                m = fam.m_of(r.key)
                old = per_m.get(m)
                if old is None or rank[r.gfx] < rank[old.gfx]:
                    per_m[m] = r
            idx = {}
            for shape, per_m in shapes.items():
                ms = sorted(per_m)
                idx[shape] = (ms, [per_m[m] for m in ms])
            self._index[ident] = idx
        return idx

    def lookup(self, key, ident: DeviceIdentity) -> TunedRow | None:
        """The row for `key` on `ident` under the M rule, or None (use the family's default)."""
        entry = self._family_index(ident).get(self.family.shape_family(key))
        if entry is None:
            return None
        ms, rows = entry
        m = self.family.m_of(key)
        for row in rows[bisect.bisect_left(ms, m) :]:
            lo, hi = row.m_range()
            if lo <= m <= hi:
                return row
        return None

    # ---- writing --------------------------------------------------------------------------
    def write(self, path: str, columns: list[str] | None = None) -> None:
        """Write all rows atomically, with this table's columns (a single loaded file's own)."""
        cols = columns or self.columns
        write_atomic(path, cols, ([r.value(c) for c in cols] for r in self._rows.values()))


class ConfigStore:
    """The tables in effect, one ConfigTable per family; files are routed to their family."""

    def __init__(self) -> None:
        self.tables: dict[str, ConfigTable] = {}
        self.files: list[tuple[str, str]] = []  # (path, family name), in load order

    def table(self, family: Family | str) -> ConfigTable:
        fam = families.get(family) if isinstance(family, str) else family
        tab = self.tables.get(fam.name)
        if tab is None:
            tab = self.tables[fam.name] = ConfigTable(family=fam)
        return tab

    def add_file(self, path: str, family: Family | str | None = None) -> TableFile:
        tf = read_table_file(path, family)
        self.table(tf.family).add_file(tf)
        self.files.append((path, tf.family.name))
        return tf

    @classmethod
    def load(cls, paths: list[str] | str, family: Family | str | None = None) -> ConfigStore:
        """Read `paths`; each file goes to the family its header says (or to `family`, if named)."""
        if isinstance(paths, str):
            paths = [p for p in paths.split(":") if p.strip()]
        store = cls()
        for path in paths:
            store.add_file(path, family)
        for tab in store.tables.values():
            tab.report_conflicts()
        return store

    @classmethod
    def from_env(cls, environ) -> ConfigStore:
        """GEMMTUNE_CONFIG (files of any family, detected by header) and GEMMTUNE_CONFIG_<FAMILY>
        (files of that family). An empty variable is the same as an unset one; a named file that does
        not exist is an error, never silently 'no table'."""
        store = cls()
        for fam in families.all_families():
            value = environ.get(fam.env_var, "")
            forced = None if fam.name == "a16w16" else fam
            for path in (p for p in value.split(":") if p.strip()):
                store.add_file(path, forced)
        for tab in store.tables.values():
            tab.report_conflicts()
        return store

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


def env_sources(environ) -> list[tuple[str, str]]:
    """(variable, path) for every table named by a GEMMTUNE_CONFIG* variable, in family order."""
    return [(fam.env_var, p) for fam in families.all_families()
            for p in environ.get(fam.env_var, "").split(":") if p.strip()]  # fmt: skip


def load_paths_env(value: str) -> ConfigTable:
    """GEMMTUNE_CONFIG's value -> a16w16 table; a named file that does not exist is an error."""
    paths = [p for p in value.split(":") if p.strip()]
    if not paths:
        raise ConfigError("GEMMTUNE_CONFIG is set but names no file")
    return ConfigTable.load(paths)
