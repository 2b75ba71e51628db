"""A shape list (aiter's untuned CSV of a family) read as a whole file, for show-config and rewrites:
its family, keys with line numbers, and each record's own text, so writing it back is the same file.
The tuner and capture read keys through capture.read_shape_list; this keeps what they drop."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..families import Family
from .io import CsvStyle, read_csv, write_atomic
from .recognize import NotATable, is_shape_list
from .schema import InertRow, MissingValue, parse_key
from .table import TableFile, family_of, read_table_file, warn_once


@dataclass
class ShapeListFile:
    path: str
    family: Family
    raw_header: list[str]
    keys: list[tuple[int, tuple]] = field(default_factory=list)  # (line, key) in file order
    inert: list[InertRow] = field(default_factory=list)  # records with an empty key field
    final_newline: bool = True
    style: CsvStyle = field(default_factory=CsvStyle)
    _records: list = field(default_factory=list, repr=False)

    def write(self, path: str | None = None) -> None:
        """Every record as it was read (a shape list is never edited in place)."""
        write_atomic(path or self.path, self.raw_header, self._records, self.final_newline, self.style)


def read_shape_list_file(path: str, family: Family | str | None = None) -> ShapeListFile:
    text = read_csv(path)
    fam = family_of(text, family)
    if not is_shape_list(text.header):
        raise NotATable(f"{path}: a tuned {fam.name} table, not a shape list")
    out = ShapeListFile(path, fam, text.raw_header, final_newline=text.final_newline, style=text.style)
    for line, rec in text.records:
        out._records.append(text.texts[line][1])
        try:
            out.keys.append((line, parse_key(fam, rec, path, line)))
        except MissingValue as exc:
            out.inert.append(InertRow(path, line, rec, text.texts[line], str(exc).split(": ", 1)[1]))
    if out.inert:
        warn_once(f"gemmtune: {path}: {len(out.inert)} shape(s) with an empty key field, kept but never tuned: "
                  + "; ".join(f"{r.where}: {r.why}" for r in out.inert[:3]))  # fmt: skip
    return out


def read_any(path: str, family: Family | str | None = None) -> TableFile | ShapeListFile:
    """A tuned table, or else a shape list; anything else is a ConfigError saying what the file is."""
    try:
        return read_table_file(path, family)
    except NotATable:
        text_header = read_csv(path).header
        if not is_shape_list(text_header):
            raise
    try:
        return read_shape_list_file(path, family)
    except NotATable as exc:
        raise ConfigError(str(exc)) from None
