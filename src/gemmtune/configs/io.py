"""CSV reading with line numbers, atomic writes, and a lock for files several processes update.

Files are read as utf-8-sig: a byte-order mark (Excel, Windows tools) would otherwise stick to the
first column's name and hide it (`\\ufeffgfx` is not `gfx`).
"""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from filelock import FileLock

from ..errors import ConfigError


@dataclass
class CsvText:
    """A CSV as read: the header as written (for byte-identical rewrites), stripped names, records."""

    path: str
    raw_header: list[str]
    records: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    final_newline: bool = True

    @property
    def header(self) -> list[str]:
        return [h.strip() for h in self.raw_header]


def read_csv(path: str, error=ConfigError) -> CsvText:
    """Header and (line number, {stripped column: text}) for each non-blank record; errors name the file."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, not a CSV file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{path}: cannot read: {exc}") from None
    reader = csv.reader(text.splitlines(keepends=True))
    try:
        raw_header = next(reader)
    except StopIteration:
        raise error(f"{path}: empty file (no header line)") from None
    except csv.Error as exc:
        raise error(f"{path}:1: {exc}") from None
    out = CsvText(path, raw_header, final_newline=text.endswith(("\n", "\r")))
    header = out.header
    try:
        for row in reader:
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise error(f"{path}:{reader.line_num}: {len(row)} fields, header has {len(header)}")
            out.records.append((reader.line_num, dict(zip(header, row))))
    except csv.Error as exc:
        raise error(f"{path}:{reader.line_num}: {exc}") from None
    return out


def write_atomic(path: str, header: list[str], rows: Iterable[Iterable[str]], final_newline: bool = True) -> None:
    """Write a CSV via a temp file in the same folder and a rename: readers see old or new, never half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gemmtune-", suffix=".csv.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(rows)
            if not final_newline:
                fh.seek(fh.tell() - 1)
                fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o777)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: str, timeout: float = 60.0) -> Iterator[None]:
    """Hold `path + '.lock'` so read-modify-write cycles of several processes serialize."""
    with FileLock(os.path.abspath(path) + ".lock", timeout=timeout):
        yield
