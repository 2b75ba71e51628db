"""Config store: aiter-compatible tuned tables (read, merge, look up, write)."""

from .schema import TUNED_COLUMNS, UNTUNED_COLUMNS, TunedRow, gemm_bytes, parse_tuned_row, throughput
from .table import ConfigTable, Conflict, load_paths_env, read_table_file

__all__ = [
    "TUNED_COLUMNS",
    "UNTUNED_COLUMNS",
    "ConfigTable",
    "Conflict",
    "TunedRow",
    "gemm_bytes",
    "load_paths_env",
    "parse_tuned_row",
    "read_table_file",
    "throughput",
]
