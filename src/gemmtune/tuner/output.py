"""The tuner's files: the tuned table (one row per finished key, written at once, atomically, under the
table's lock, in the family's full schema) and the optional per-candidate profile CSV."""

from __future__ import annotations

import csv
import math
import os

from .. import families
from ..configs.files import TUNED_TABLE, Kind, check_outputs, check_writable, csv_header
from ..configs.io import locked
from ..configs.schema import TunedRow
from ..configs.table import TableFile, read_table_file
from ..device import DeviceIdentity
from ..errors import ConfigError
from ..families import Family
from .search import ShapeResult

PROFILE_COLUMNS = [
    "family", "gfx", "cu_num", "key", "libtype", "kernelName", "solidx", "splitK",
    "status", "err", "screen_us", "us", "default_us", "winner", "reason", "donor",
]  # fmt: skip
# The columns up to `reason`: a profile file with only these takes rows of these (no donor verdict).
SHORT_PROFILE_COLUMNS = PROFILE_COLUMNS[:-1]


PROFILE_FILE = Kind("tuner profile file", lambda p: csv_header(p) == PROFILE_COLUMNS)


def tune_outputs(output: str, profile_file: str | None = None) -> list[tuple[str, Kind, str]]:
    """(path, kind, option) of every file a tuning run writes."""
    return [(output, TUNED_TABLE, "-o"), *([(profile_file, PROFILE_FILE, "--profile-file")] if profile_file else [])]


def check_tune_outputs(shapes: str, output: str, profile_file: str | None = None) -> None:
    """Before any key is tuned: OUTPUT and the profile file are writable, neither is SHAPES nor the other,
    and each is a file of its kind if it exists (files.check_outputs names both paths when not)."""
    check_outputs(tune_outputs(output, profile_file), [shapes])


def existing_table(path: str, family: Family) -> TableFile:
    """The output table as it is (empty, in the family's schema, when the file does not exist yet).
    A file of another family is an error: tuning bf16 keys into an a8w8 table would mix their rows."""
    if not os.path.exists(path):
        return TableFile(path, family, list(family.table_columns()), [])
    return read_table_file(path, family, allow_empty=True)


def done_keys(path: str, ident: DeviceIdentity, family: Family) -> set:
    return {r.key for r in existing_table(path, family).rows if r.gfx == ident.gfx and r.cu_num == ident.cu_num}


def full_header(tf: TableFile) -> list[str]:
    """The file's header, with any of the family's columns it lacks added in the family's order: a row
    written into a legacy file (no gfx / dtype / bias ...) must keep its key and GPU, not read back as
    'bf16, no bias, any arch'. Columns the family does not know stay, after the family's."""
    have = tf.columns
    schema = list(tf.family.table_columns())
    if all(c in have for c in (families.normalize(tf.family, schema))):
        return list(tf.raw_header)
    extra = [h for h, c in zip(tf.raw_header, have) if c not in families.normalize(tf.family, schema)]
    return schema + extra


def result_row(res: ShapeResult, ident: DeviceIdentity, family: Family) -> TunedRow:
    w = res.winner
    tflops, bw = family.throughput(res.key, res.us)
    err = w.err if math.isfinite(w.err) else 0.0
    return TunedRow(ident.gfx, ident.cu_num, res.key, w.libtype, w.solidx, w.splitk, res.us, w.kernel_name,
                    err, tflops, bw, family=family, m_lo=res.m_lo, m_hi=res.m_hi, extra=dict(res.extra))  # fmt: skip


def write_row(path: str, row: TunedRow) -> None:
    """Replace (or add) the row of the same GPU and key, atomically, under the file's lock."""
    with locked(path):
        tf = existing_table(path, row.family)
        header = full_header(tf)  # old rows keep their meaning: a missing gfx is written empty (any GPU)
        tf.rows = [r for r in tf.rows if r.full_key != row.full_key] + [row]
        tf.write(path, header)  # unchanged rows keep their text (BOM, line ends, quoting)


def _fmt(v: float) -> str:
    return "" if v != v else f"{v:.4g}"


def append_profile(path: str, res: ShapeResult, ident: DeviceIdentity, family: Family) -> None:
    base = [family.name, ident.gfx, str(ident.cu_num), family.describe(res.key)]
    rows = []
    for c in res.candidates:
        us = res.default_us if c.name == res.default.name and c.us != c.us else c.us
        winner = c is res.winner or c.name == res.winner.name
        rows.append([*base, c.libtype, c.kernel_name, str(c.solidx), str(c.splitk), c.status, _fmt(c.err),
                     _fmt(c.screen_us), _fmt(us), _fmt(res.default_us), str(winner), c.reason,
                     res.donor])  # fmt: skip
    with locked(path):
        check_writable(path, ConfigError)  # a FIFO would block the append; a read-only file is named
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path, newline="", encoding="utf-8-sig") as fh:
                first = next(csv.reader(fh), [])
            if first not in (PROFILE_COLUMNS, SHORT_PROFILE_COLUMNS):
                raise ConfigError(f"{path}:1: not a gemmtune profile file (columns {','.join(first)}); "
                                  "choose another --profile-file")  # fmt: skip
            rows = [r[: len(first)] for r in rows]
            new = False
        else:
            new = True
        with open(path, "a", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh, lineterminator="\n")
            if new:
                writer.writerow(PROFILE_COLUMNS)
            writer.writerows(rows)
