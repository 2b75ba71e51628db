"""CSV reading with line numbers, byte-faithful rewrites, and CSV writes under the file rule (files.py:
regular files only, through symlinks, hard links kept, atomic, never onto another kind of file).

Records split at CR, LF and CRLF outside quotes only (as aiter's pandas reader does): U+2028, U+0085 or a
form feed inside a field is data. A row with fewer fields than the header reads its missing trailing
fields as empty (pandas fills them with NaN); more fields than the header is an error, as in pandas.
Each record keeps the text it was read from, so a rewrite of unchanged rows reproduces the file's
byte-order mark, line endings, quoting and blank lines. Files are read as utf-8 with an optional BOM
(a BOM must not stick to the first column's name: `\\ufeffgfx` is not `gfx`).
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from ..errors import ConfigError
from .files import Kind, locked, open_regular, replace_file

__all__ = ["CsvStyle", "CsvText", "Verbatim", "locked", "read_csv", "render", "write_atomic"]

BOM = "\ufeff"
_EOL = re.compile(r"(\r\n|\r|\n)")


class Verbatim(NamedTuple):
    """A record as written in its file: blank lines before it, its text, its line end ('' at EOF)."""

    prefix: str
    body: str
    eol: str


@dataclass
class CsvStyle:
    """How a file was written, so a rewrite looks the same: BOM, line end, the header's own text."""

    bom: bool = False
    newline: str = "\n"
    header: Verbatim | None = None
    trailer: str = ""  # blank lines after the last record


@dataclass
class CsvText:
    """A CSV as read: the header as written, stripped names, records, and each record's own text."""

    path: str
    raw_header: list[str]
    records: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    final_newline: bool = True
    style: CsvStyle = field(default_factory=CsvStyle)
    texts: dict[int, tuple[list[str], Verbatim]] = field(default_factory=dict)  # line -> (fields, text)
    short: list[int] = field(default_factory=list)  # lines with fewer fields than the header

    @property
    def header(self) -> list[str]:
        return [h.strip() for h in self.raw_header]


def split_records(text: str) -> Iterator[tuple[int, Verbatim]]:
    """(first line number, record) for each record; a quoted field may span lines."""
    parts = _EOL.split(text)
    line, prefix, i = 1, "", 0
    while i < len(parts):
        start, body, eol = line, parts[i], parts[i + 1] if i + 1 < len(parts) else ""
        i += 2
        line += 1 if eol else 0
        while body.count('"') % 2 and i < len(parts):  # an open quote: the line end is data
            body += eol + parts[i]
            eol = parts[i + 1] if i + 1 < len(parts) else ""
            i += 2
            line += 1 if eol else 0
        if not body.strip():
            prefix += body + eol
            continue
        yield start, Verbatim(prefix, body, eol)
        prefix = ""
    if prefix:
        yield line, Verbatim(prefix, "", "")


def _fields(body: str, path: str, line: int, error) -> list[str]:
    try:
        return next(csv.reader([body]), [])
    except csv.Error as exc:
        raise error(f"{path}:{line}: {exc}") from None


def read_csv(path: str, error=ConfigError) -> CsvText:
    """Header and (line number, {stripped column: text}) for each non-blank record; errors name the file."""
    try:
        with open_regular(path, error, "a CSV file", newline="", encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None
    style = CsvStyle(bom=text.startswith(BOM))
    records = list(split_records(text[1:] if style.bom else text))
    if not records or not records[0][1].body.strip():
        raise error(f"{path}: empty file (no header line)")
    if not records[-1][1].body:  # blank lines after the last record
        style.trailer = records.pop()[1].prefix
    hline, style.header = records[0]
    style.newline = next((v.eol for _, v in records if v.eol), "\n")
    out = CsvText(path, _fields(style.header.body, path, hline, error), style=style)
    out.final_newline = bool(style.trailer) or bool(records[-1][1].eol)
    header = out.header
    for line, rec in records[1:]:
        row = _fields(rec.body, path, line, error)
        if len(row) > len(header):
            raise error(f"{path}:{line}:{len(header) + 1}: {len(row)} fields, header has {len(header)}")
        if len(row) < len(header):
            out.short.append(line)
            row = row + [""] * (len(header) - len(row))
        out.texts[line] = (row, rec)
        out.records.append((line, dict(zip(header, row))))
    return out


def render(header: list[str], rows: Iterable[Iterable[str] | Verbatim], final_newline: bool = True,
           style: CsvStyle | None = None) -> str:  # fmt: skip
    """The file's text: Verbatim records as they were read, others CSV-formatted in the file's style."""
    style = style or CsvStyle()
    nl = style.newline
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator=nl)
    if style.bom:
        buf.write(BOM)
    h = style.header
    if h is not None and next(csv.reader([h.body]), []) == list(header):
        buf.write(h.prefix + h.body + (h.eol or nl))
    else:
        writer.writerow(header)
    for row in rows:
        if isinstance(row, Verbatim):
            buf.write(row.prefix + row.body + (row.eol or nl))
        else:
            writer.writerow(row)
    text = buf.getvalue() + style.trailer
    if not final_newline and text.endswith(nl):
        text = text[: -len(nl)]
    return text


def write_atomic(path: str, header: list[str], rows: Iterable[Iterable[str] | Verbatim], final_newline: bool = True,
                 style: CsvStyle | None = None, kind: Kind | None = None, inputs: Iterable[str] = (),
                 error: type[Exception] | None = None) -> None:  # fmt: skip
    """Write a CSV whole under the file rule (files.replace_file): readers see the old text or the new,
    never half; an existing file must be of `kind` (when given) and none of `inputs`."""
    text = render(header, rows, final_newline, style)
    replace_file(path, text, kind, inputs, **({"error": error} if error else {}))
