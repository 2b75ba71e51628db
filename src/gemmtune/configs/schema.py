"""One parsed row of a tuned table, in any GEMM family's schema (families/ says which columns).

A row keeps the exact strings it was read with, so a table written back is the same file, and its
parsed values (key, libtype, us ...) for lookup. Errors name the file, line and column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..device import ANY_GFX_SENTINEL
from ..errors import ConfigError
from ..families import Family, get
from ..families.a16w16 import AITER_TUNED_COLUMNS
from ..families.base import fmt_float, nonneg_float, positive_int
from ..keys import GemmKey
from .io import Verbatim

_A16W16 = "a16w16"
TUNED_COLUMNS = list(AITER_TUNED_COLUMNS)  # aiter's 18; gemmtune writes the family's (+ M_lo, M_hi)
UNTUNED_COLUMNS = list(get(_A16W16).untuned_columns)


def aiter_pad_step(m: int) -> int:
    """aiter's fine M padding: a multiple of 16 up to 256, of 32 up to 1024, of 64 up to 4096, else 128."""
    return 16 if m <= 256 else 32 if m <= 1024 else 64 if m <= 4096 else 128


def aiter_padded_range(m: int) -> tuple[int, int]:
    """The Ms aiter's lookup pads up to `m` (m itself when m is not on its padding grid)."""
    step = aiter_pad_step(m)
    return (m, m) if m % step else (max(1, m - step + 1), m)


def _err_value(text: str) -> float:
    # aiter's fused-MoE table writes errors as percentages ("0.3%").
    t = text.strip()
    return float(t[:-1]) / 100 if t.endswith("%") else float(t)


@dataclass
class TunedRow:
    gfx: str
    cu_num: int
    key: tuple
    libtype: str
    solidx: int
    splitk: int
    us: float
    kernel_name: str
    err_ratio: float = 0.0
    tflops: float = 0.0
    bw: float = 0.0
    raw: dict[str, str] = field(default_factory=dict, repr=False)
    source: str = "<memory>"
    line: int = 0
    family: Family | None = field(default=None, repr=False)
    # The M range the tuner verified this row on (0: not recorded, as in aiter's tables; see m_range).
    m_lo: int = 0
    m_hi: int = 0
    # More columns a new row writes (a two-stage family's us1/err1/us2/err2); they win over computed ones.
    extra: dict[str, str] = field(default_factory=dict, repr=False)
    # (fields, record text) as read: an unchanged row is written back exactly as it was.
    text: tuple[list[str], Verbatim] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.family is None:
            self.family = get(_A16W16)

    @property
    def is_override(self) -> bool:
        """aiter's hand-written routing rows carry us == 0: they are choices, not timings."""
        return self.us == 0

    @property
    def full_key(self) -> tuple:
        return (self.gfx, self.cu_num, *self.key)

    @property
    def m(self) -> int:
        return self.family.m_of(self.key)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def describe_key(self) -> str:
        return self.family.describe(self.key)

    def m_range(self) -> tuple[int, int]:
        """The Ms this row answers. Verified rows: the range the tuner checked. Rows without one (aiter's
        tables, older gemmtune tables) answer their own M and the Ms aiter itself would pad up to it."""
        if self.m_lo > 0:
            return self.m_lo, max(self.m_hi, self.m)
        return aiter_padded_range(self.m)

    def value(self, column: str) -> str:
        """The column as written in the file, or formatted from the parsed value for new rows."""
        col = self.family.column_aliases.get(column, column)
        if col in self.raw:
            return self.raw[col]
        return self.computed().get(col, "")

    def computed(self) -> dict[str, str]:
        r = self.family.roles
        out = {"gfx": self.gfx, "cu_num": str(self.cu_num), **self.family.key_record(self.key),
               r.solidx: str(self.solidx), r.splitk: str(self.splitk), r.us: fmt_float(self.us),
               r.kernel_name: self.kernel_name, r.err_ratio: fmt_float(self.err_ratio),
               r.tflops: f"{self.tflops:.2f}", r.bw: f"{self.bw:.2f}"}  # fmt: skip
        out.update(self.family.solution_record(self.libtype, self.kernel_name))
        lo, hi = self.family.range_columns
        out[lo], out[hi] = (str(self.m_lo), str(self.m_hi)) if self.m_lo > 0 else ("", "")
        out.update(self.extra)
        return out


@dataclass
class InertRow:
    """A record kept for write-back that answers no key: aiter reads it (pandas takes empty fields as
    NaN), gemmtune cannot use it (a key field empty, a timing that is not a number, an empty range)."""

    source: str
    line: int
    raw: dict[str, str]
    text: tuple[list[str], Verbatim]
    why: str

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"


class MissingValue(ConfigError):
    """A required field left empty (or NaN, pandas' spelling of empty)."""


# Larger than any GEMM dimension a kernel indexes (int32 offsets); a bigger value is a typo.
MAX_DIM = 2**31 - 1
_EMPTY = {"", "nan", "NaN", "NAN", "null", "NULL", "None"}


def never_answers(row: TunedRow) -> str | None:
    """Why a parsed row can never answer a key (None: it can)."""
    if not math.isfinite(row.us):
        return f"us={row.raw.get(row.family.roles.us, row.us)!r} is not a finite time"
    big = [f for f, v in zip(row.key._fields, row.key) if type(v) is int and v > MAX_DIM]
    if big:
        return f"{big[0]}={getattr(row.key, big[0])} is beyond any GEMM (max {MAX_DIM})"
    if row.m_lo and row.m_hi and row.m_lo > row.m_hi:
        lo, hi = row.family.range_columns
        return f"{lo}={row.m_lo} > {hi}={row.m_hi}: an empty M range"
    return None


def required_columns(family: Family) -> list[str]:
    """Columns a tuned table of `family` must have; the rest default (legacy files lack gfx, dtype ...)."""
    r = family.roles
    need = ["cu_num"] if family.cu_num_required else []
    need += [c.name for c in family.key_columns if c.default is None] + ([r.us] if family.us_required else [])
    if family.name == _A16W16:  # aiter's bf16 tables always name their solution
        need += [r.libtype, r.solidx]
    return list(dict.fromkeys(need))


def normalize_header(header: list[str], path: str, family: Family | None = None) -> list[str]:
    family = family or get(_A16W16)
    cols = [family.column_aliases.get(c.strip(), c.strip()) for c in header]
    missing = [c for c in required_columns(family) if c not in cols]
    if missing:
        raise ConfigError(
            f"{path}:1: not a tuned {family.name} table: missing column(s) {', '.join(missing)} "
            f"(expected aiter's columns {','.join(family.tuned_columns)})"
        )
    dups = {c for c in cols if cols.count(c) > 1}
    if dups:
        raise ConfigError(f"{path}:1: duplicate column(s) {', '.join(sorted(dups))}")
    return cols


def parse_column(raw: dict[str, str], column: str, conv, default, path: str, line: int, error=ConfigError):
    """raw[column] through conv; a missing/empty value takes `default` (None: required). Errors name
    path:line and the column, as `error` (ConfigError for tables, ShapesFileError for shape lists)."""
    text = raw.get(column)
    if text is None or text.strip() in _EMPTY:
        if default is None:
            cls = MissingValue if error is ConfigError else error
            raise cls(f"{path}:{line}: column {column!r} is missing or empty")
        return default
    try:
        return conv(text.strip())
    except ValueError as exc:
        raise error(f"{path}:{line}: column {column!r}: bad value {text!r} ({exc})") from None


def parse_key(family: Family, raw: dict[str, str], path: str, line: int, error=ConfigError):
    """A family's key from one record (tuned or untuned); errors name path:line and the column."""
    return family.parse_key(raw, lambda col, conv, default: parse_column(raw, col, conv, default, path, line, error))


def parse_tuned_row(raw: dict[str, str], path: str, line: int, family: Family | None = None) -> TunedRow:
    """One CSV record (normalized column names) -> TunedRow; ConfigError names path:line and the column."""
    family = family or get(_A16W16)
    r = family.roles
    p = lambda col, conv, default=None: parse_column(raw, col, conv, default, path, line)  # noqa: E731
    key = parse_key(family, raw, path, line)
    if r.libtype and r.libtype in raw and not raw[r.libtype].strip():
        raise MissingValue(f"{path}:{line}: column {r.libtype!r} is missing or empty")
    libtype = family.libtype_of(raw)
    lo_col, hi_col = family.range_columns
    return TunedRow(
        m_lo=p(lo_col, positive_int, 0),
        m_hi=p(hi_col, positive_int, 0),
        gfx=raw.get("gfx", ANY_GFX_SENTINEL).strip(),
        cu_num=p("cu_num", positive_int, None if family.cu_num_required else 0),
        key=key,
        libtype=libtype,
        solidx=p(r.solidx, int, 0),
        splitk=p(r.splitk, int, 0),
        us=p(r.us, nonneg_float, None if family.us_required else 0.0),
        kernel_name=family.kernel_name_of(raw),
        err_ratio=p(r.err_ratio, _err_value, 0.0),
        tflops=p(r.tflops, float, 0.0),
        bw=p(r.bw, float, 0.0),
        raw=raw,
        source=path,
        line=line,
        family=family,
    )


def gemm_bytes(key: GemmKey) -> int:
    """Bytes a GEMM must move at least: A and B read once, C written once (bias ignored)."""
    return get(_A16W16).bytes(key)


def throughput(key, us: float, family: Family | None = None) -> tuple[float, float]:
    """(TFLOP/s, GB/s) as aiter defines them, with the real element sizes."""
    return (family or get(_A16W16)).throughput(key, us)
