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
import glob
import hashlib
import logging
import math
import os
from dataclasses import dataclass, field

from .. import families, settings
from ..checks import check_paths
from ..device import DeviceIdentity
from ..errors import ConfigError
from ..families import Family
from .files import TUNED_TABLE
from .io import CsvStyle, CsvText, Verbatim, read_csv, write_atomic
from .recognize import NotATable, is_shape_list, refuse_foreign
from .schema import InertRow, MissingValue, TunedRow, never_answers, normalize_header, parse_tuned_row

log = logging.getLogger("gemmtune")
_warned: set[str] = set()


def warn_once(msg: str) -> None:
    """Log `msg` the first time this process sees it (a table read again says nothing new)."""
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def _lines(items: list[str], n: int = 3) -> str:
    return "; ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


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
    """One tuned CSV as read: its family, header as written, rows in file order, and the records it
    keeps without using them (inert), so a rewrite is the file it read."""

    path: str
    family: Family
    raw_header: list[str]
    rows: list[TunedRow] = field(default_factory=list)
    final_newline: bool = True
    style: CsvStyle = field(default_factory=CsvStyle)
    inert: list[InertRow] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        return families.normalize(self.family, [h.strip() for h in self.raw_header])

    def records(self, header: list[str]) -> list[list[str] | Verbatim]:
        """Every row as `header` lays it out; a row unchanged since it was read, as its own text."""
        cols = families.normalize(self.family, [h.strip() for h in header])

        def order(r):  # rows of this file in file order, new rows after them
            return r.line if r.source == self.path and r.line else math.inf

        out = []
        for r in sorted([*self.rows, *self.inert], key=order):
            vals = [r.raw.get(c, "") for c in cols] if isinstance(r, InertRow) else [r.value(c) for c in cols]
            out.append(r.text[1] if r.text is not None and r.text[0] == vals else vals)
        return out

    def write(self, path: str | None = None, header: list[str] | None = None) -> None:
        """Write the rows back with this file's header (or `header`): an unchanged table comes out
        byte-identical (BOM, line ends, quoting, short rows and all)."""
        header = list(header or self.raw_header)
        write_atomic(path or self.path, header, self.records(header), self.final_newline, self.style, TUNED_TABLE)


def family_of(text: CsvText, family: Family | str | None = None) -> Family:
    """The family `text` belongs to: the one named (its header must fit), else detected from the header."""
    refuse_foreign(text.header, text.path)
    if family is not None:
        fam = families.get(family) if isinstance(family, str) else family
        if not families.fits(fam, text.header):
            found = families.detect(text.header, text.path, _kernel_names(text))
            raise NotATable(f"{text.path}:1: expected a {fam.name} table, but its columns are a {found.name} "
                            f"table's ({','.join(text.header)})")  # fmt: skip
        return fam
    return families.detect(text.header, text.path, _kernel_names(text))


def _kernel_names(text: CsvText) -> list[str]:
    return [rec.get("kernelName", rec.get("kernelName1", "")) for _, rec in text.records[:200]]


def shape_list_error(path: str, fam: Family) -> NotATable:
    return NotATable(
        f"{path}: a shape list of the {fam.name} family (aiter's untuned CSV: no timing or kernel "
        f"columns), not a tuned table; tune it (`gemmtune tune {path} -o tuned.csv`) and name the "
        "tuned table instead"
    )


def read_table_file(path: str, family: Family | str | None = None, allow_empty: bool = False) -> TableFile:
    """A tuned table's family, header and rows, in file order. Never modifies the file. A header with
    no rows is an error (a table that answers nothing is a mistake) unless `allow_empty`. Records aiter
    reads but no key can use (an empty key field, NaN timing, an empty M range) are kept, not used, and
    named in one warning; rows shorter than the header read their missing fields as empty (one warning)."""
    text = read_csv(path)
    fam = family_of(text, family)
    if is_shape_list(text.header):
        raise shape_list_error(path, fam)
    columns = normalize_header(text.header, path, fam)
    tf = TableFile(path, fam, text.raw_header, final_newline=text.final_newline, style=text.style)
    for line, rec in text.records:
        raw = {columns[i]: rec[h] for i, h in enumerate(text.header)}
        try:
            row = parse_tuned_row(raw, path, line, fam)
        except MissingValue as exc:
            tf.inert.append(InertRow(path, line, raw, text.texts[line], str(exc).split(": ", 1)[1]))
            continue
        row.text = text.texts[line]
        why = never_answers(row)
        if why:
            tf.inert.append(InertRow(path, line, raw, text.texts[line], why))
        else:
            tf.rows.append(row)
    if not tf.rows and not allow_empty:
        if tf.inert:
            raise ConfigError(f"{tf.inert[0].where}: no row of {path} can answer a key ({tf.inert[0].why})")
        raise ConfigError(f"{path}: has a header but no rows (an empty table answers nothing)")
    if text.short:
        warn_once(f"gemmtune: {path}: {len(text.short)} row(s) shorter than the header, read with the missing "
                  "trailing fields empty as aiter's reader does: "
                  + _lines([f"{path}:{n}" for n in text.short], 5))  # fmt: skip
    if tf.inert:
        warn_once(f"gemmtune: {path}: {len(tf.inert)} row(s) kept in the file but never used: "
                  + _lines([f"{r.where}: {r.why}" for r in tf.inert]))  # fmt: skip
    return tf


def table_files(path: str, family: Family | str | None = None) -> list[TableFile]:
    """The tables `path` names: the file itself, or every tuned table in a folder (of `family` when
    named; shape lists, other families' tables and aiter's non-GEMM CSVs there are skipped, as aiter
    merges only the tuned tables of its model_configs/ folder)."""
    if not os.path.isdir(path):
        return [read_table_file(path, family)]
    out, skipped = [], []
    for file in sorted(glob.glob(os.path.join(path, "*.csv"))):
        try:
            out.append(read_table_file(file, family))
        except NotATable as exc:
            skipped.append(str(exc))
    if not out:
        what = f"{families.get(family).name if isinstance(family, str) else family.name} " if family else ""
        raise ConfigError(f"{path}: folder has no tuned {what}table (*.csv)")
    if skipped:
        log.info("gemmtune: %s: %d table(s) read, %d file(s) skipped: %s", path, len(out), len(skipped),
                 _lines(skipped))  # fmt: skip
    return out


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
        table, files = None, []
        for path in unique_paths(_split(check_paths("ConfigTable.load", "paths", paths))):
            for tf in table_files(path, family if family is not None else (table.family if table else None)):
                table = table or cls(family=tf.family)
                table.add_file(tf)
                files.append(tf)
        if len(files) == 1:
            table.columns = files[0].columns  # a single file writes back with its own columns
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
        self._index = {}  # rebound, not cleared: an index another thread is building from older rows is not kept

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
        return [r for r in self.rows if r.cu_num in (ident.cu_num, 0) and r.gfx in aliases]

    def _family_index(self, ident: DeviceIdentity):
        cache = self._index
        idx = cache.get(ident)
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
            cache[ident] = idx
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

    def digest(self) -> str:
        """A fingerprint of what the rows make dispatch run (key, GPU, M range, solution), not of their
        timings or file text: two tables with equal digests pick the same kernel for every key."""
        rows = sorted(repr((r.full_key, r.m_lo, r.m_hi, r.libtype, r.solidx, r.splitk, r.kernel_name))
                      for r in self._rows.values())  # fmt: skip
        return hashlib.sha256("\n".join(rows).encode()).hexdigest()

    # ---- writing --------------------------------------------------------------------------
    def write(self, path: str, columns: list[str] | None = None) -> None:
        """Write all rows atomically, with this table's columns (a single loaded file's own), never over a file
        of another kind or one this table was read from but others (files.py's rule)."""
        cols = columns or self.columns
        write_atomic(path, cols, ([r.value(c) for c in cols] for r in self._rows.values()), kind=TUNED_TABLE)


class ConfigStore:
    """The tables in effect, one ConfigTable per family; files are routed to their family."""

    def __init__(self) -> None:
        self.tables: dict[str, ConfigTable] = {}
        self.files: list[tuple[str, str]] = []  # (path, family name), in load order
        self.table_files: list[TableFile] = []  # the files as read (their inert rows, style)

    def table(self, family: Family | str) -> ConfigTable:
        fam = families.get(family) if isinstance(family, str) else family
        tab = self.tables.get(fam.name)
        # setdefault: threads asking at once all get the one table (rows added to it reach every thread)
        return tab if tab is not None else self.tables.setdefault(fam.name, ConfigTable(family=fam))

    def add_file(self, path: str, family: Family | str | None = None) -> TableFile:
        tf = read_table_file(path, family)
        self.add_table(tf)
        return tf

    def add_path(self, path: str, family: Family | str | None = None) -> list[TableFile]:
        """A table file, or every tuned table in a folder, each to its family."""
        tfs = table_files(path, family)
        for tf in tfs:
            self.add_table(tf)
        return tfs

    def add_table(self, tf: TableFile) -> None:
        self.table(tf.family).add_file(tf)
        self.files.append((tf.path, tf.family.name))
        self.table_files.append(tf)

    @classmethod
    def load(cls, paths: list[str] | str, family: Family | str | None = None) -> ConfigStore:
        """Read `paths` (files or folders); each table goes to the family its header says (or to
        `family`, if named). A file named twice is read once."""
        store = cls()
        for path in unique_paths(_split(check_paths("ConfigStore.load", "paths", paths))):
            store.add_path(path, family)
        for tab in store.tables.values():
            tab.report_conflicts()
        return store

    @classmethod
    def from_env(cls, environ) -> ConfigStore:
        """GEMMTUNE_CONFIG (files or folders of any family, detected by header) and GEMMTUNE_CONFIG_<FAMILY>
        (files of that family; a folder gives its tables of that family). An empty variable is the same as
        an unset one; a named file that does not exist is an error, never silently 'no table'."""
        store = cls()
        seen: dict[str, str] = {}
        for fam in families.all_families():
            forced = None if fam.name == "a16w16" else fam
            for path in settings.get(fam.env_var, environ):
                real = os.path.realpath(path)
                if real in seen:
                    warn_once(f"gemmtune: {path} is named twice ({seen[real]} and {fam.env_var}); read once")
                    continue
                seen[real] = fam.env_var
                try:
                    store.add_path(path, forced)
                except ConfigError as exc:  # raised in the user's first call: say which variable to fix
                    raise ConfigError(f"{fam.env_var}={path}: {exc}") from None
        for tab in store.tables.values():
            tab.report_conflicts()
        return store

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


def _split(paths: list[str] | str) -> list[str]:
    return [p for p in paths.split(":") if p.strip()] if isinstance(paths, str) else list(paths)


def unique_paths(paths: list[str], where: str = "") -> list[str]:
    """`paths` without repeats (one warning names a repeated one: its rows would all 'conflict')."""
    seen, out = set(), []
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            warn_once(f"gemmtune: {p} is named twice{where}; read once")
            continue
        seen.add(real)
        out.append(p)
    return out


def env_sources(environ) -> list[tuple[str, str]]:
    """(variable, path) for every table named by a GEMMTUNE_CONFIG* variable, in family order."""
    return [(fam.env_var, p) for fam in families.all_families() for p in settings.get(fam.env_var, environ)]


def load_paths_env(value: str) -> ConfigTable:
    """GEMMTUNE_CONFIG's value -> a16w16 table; a named file that does not exist is an error."""
    paths = [p for p in value.split(":") if p.strip()]
    if not paths:
        raise ConfigError("GEMMTUNE_CONFIG is set but names no file")
    return ConfigTable.load(paths)
