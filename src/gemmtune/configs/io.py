"""CSV reading with line numbers, atomic writes, and a lock for files several processes update."""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from collections.abc import Iterable, Iterator

from filelock import FileLock

from ..errors import ConfigError


def read_records(path: str) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header and (line number, {column: text}) for each non-blank record; errors name the file."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            try:
                header = next(reader)
            except StopIteration:
                raise ConfigError(f"{path}: empty file (no header line)") from None
            header = [h.strip() for h in header]
            records = []
            for row in reader:
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise ConfigError(f"{path}:{reader.line_num}: {len(row)} fields, header has {len(header)}")
                records.append((reader.line_num, dict(zip(header, row))))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    return header, records


def write_atomic(path: str, header: list[str], rows: Iterable[Iterable[str]]) -> None:
    """Write a CSV via a temp file in the same folder and a rename: readers see old or new, never half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gemmtune-", suffix=".csv.tmp", dir=folder)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(rows)
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
