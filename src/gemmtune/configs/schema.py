"""aiter's CSV schemas, and one parsed row of a tuned table.

A row keeps the exact strings it was read with, so a table written back is the same file, and its
parsed values (key, libtype, us ...) for lookup. Errors name the file, line and column.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..device import ANY_GFX_SENTINEL
from ..errors import ConfigError
from ..keys import GemmKey, dtype_name, parse_bool, parse_dtype

TUNED_COLUMNS = [
    "gfx", "cu_num", "M", "N", "K", "bias", "dtype", "outdtype", "scaleAB", "bpreshuffle",
    "libtype", "solidx", "splitK", "us", "kernelName", "err_ratio", "tflops", "bw",
]  # fmt: skip
UNTUNED_COLUMNS = ["M", "N", "K", "bias", "dtype", "outdtype", "scaleAB", "bpreshuffle"]
# Columns a tuned file must have; the rest default (legacy files lack gfx, some lack bias/dtype...).
REQUIRED_TUNED = ("cu_num", "M", "N", "K", "libtype", "solidx", "us")
# Older aiter files spell this column errRatio.
COLUMN_ALIASES = {"errRatio": "err_ratio"}


def _fmt_float(v: float) -> str:
    return f"{v:.4f}".rstrip("0").rstrip(".") if v else "0"


@dataclass
class TunedRow:
    gfx: str
    cu_num: int
    key: GemmKey
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

    @property
    def is_override(self) -> bool:
        """aiter's hand-written routing rows carry us == 0: they are choices, not timings."""
        return self.us == 0

    @property
    def full_key(self) -> tuple:
        return (self.gfx, self.cu_num, *self.key)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def value(self, column: str) -> str:
        """The column as written in the file, or formatted from the parsed value for new rows."""
        if column in self.raw:
            return self.raw[column]
        k = self.key
        computed = {
            "gfx": self.gfx, "cu_num": str(self.cu_num), "M": str(k.M), "N": str(k.N), "K": str(k.K),
            "bias": str(k.bias), "dtype": dtype_name(k.dtype), "outdtype": dtype_name(k.outdtype),
            "scaleAB": str(k.scaleAB), "bpreshuffle": str(k.bpreshuffle), "libtype": self.libtype,
            "solidx": str(self.solidx), "splitK": str(self.splitk), "us": _fmt_float(self.us),
            "kernelName": self.kernel_name, "err_ratio": _fmt_float(self.err_ratio),
            "tflops": f"{self.tflops:.2f}", "bw": f"{self.bw:.2f}",
        }  # fmt: skip
        return computed.get(column, "")


def normalize_header(header: list[str], path: str) -> list[str]:
    cols = [COLUMN_ALIASES.get(c.strip(), c.strip()) for c in header]
    missing = [c for c in REQUIRED_TUNED if c not in cols]
    if missing:
        raise ConfigError(
            f"{path}:1: not a tuned GEMM table: missing column(s) {', '.join(missing)} "
            f"(expected aiter's columns {','.join(TUNED_COLUMNS)})"
        )
    dups = {c for c in cols if cols.count(c) > 1}
    if dups:
        raise ConfigError(f"{path}:1: duplicate column(s) {', '.join(sorted(dups))}")
    return cols


def parse_column(raw: dict[str, str], column: str, conv, default, path: str, line: int, error=ConfigError):
    """raw[column] through conv; a missing/empty value takes `default` (None: required). Errors name
    path:line and the column, as `error` (ConfigError for tables, ShapesFileError for shape lists)."""
    text = raw.get(column)
    if text is None or text.strip() == "":
        if default is None:
            raise error(f"{path}:{line}: column {column!r} is missing or empty")
        return default
    try:
        return conv(text.strip())
    except ValueError as exc:
        raise error(f"{path}:{line}: column {column!r}: bad value {text!r} ({exc})") from None


def positive_int(text: str) -> int:
    v = int(text)
    if v <= 0:
        raise ValueError("must be a positive integer")
    return v


def _nonneg_float(text: str) -> float:
    v = float(text)
    if not v >= 0:  # also rejects NaN
        raise ValueError("must be a number >= 0")
    return v


def parse_tuned_row(raw: dict[str, str], path: str, line: int) -> TunedRow:
    """One CSV record -> TunedRow; ConfigError names path:line and the column on a bad value."""
    p = lambda col, conv, default=None: parse_column(raw, col, conv, default, path, line)  # noqa: E731
    dtype = p("dtype", parse_dtype, torch.bfloat16)
    key = GemmKey(
        M=p("M", positive_int),
        N=p("N", positive_int),
        K=p("K", positive_int),
        bias=p("bias", parse_bool, False),
        dtype=dtype,
        outdtype=p("outdtype", parse_dtype, dtype),
        scaleAB=p("scaleAB", parse_bool, False),
        bpreshuffle=p("bpreshuffle", parse_bool, False),
    )
    libtype = p("libtype", str)
    if not libtype:
        raise ConfigError(f"{path}:{line}: column 'libtype' is empty")
    return TunedRow(
        gfx=raw.get("gfx", ANY_GFX_SENTINEL).strip(),
        cu_num=p("cu_num", positive_int),
        key=key,
        libtype=libtype,
        solidx=p("solidx", int),
        splitk=p("splitK", int, 0),
        us=p("us", _nonneg_float),
        kernel_name=raw.get("kernelName", "").strip(),
        err_ratio=p("err_ratio", float, 0.0),
        tflops=p("tflops", float, 0.0),
        bw=p("bw", float, 0.0),
        raw=raw,
        source=path,
        line=line,
    )


def gemm_bytes(key: GemmKey) -> int:
    """Bytes a GEMM must move at least: A and B read once, C written once (bias ignored)."""
    a = key.M * key.K * key.dtype.itemsize
    b = key.N * key.K * key.dtype.itemsize
    c = key.M * key.N * key.outdtype.itemsize
    return a + b + c


def throughput(key: GemmKey, us: float) -> tuple[float, float]:
    """(TFLOP/s, GB/s) as aiter defines them, with the real element sizes."""
    if us <= 0:
        return 0.0, 0.0
    return 2 * key.M * key.N * key.K / (us * 1e6), gemm_bytes(key) / (us * 1e-6) / 1e9
