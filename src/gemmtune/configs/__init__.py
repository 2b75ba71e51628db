"""Config store: aiter-compatible tuned tables of every GEMM family (read, merge, look up, write)."""

from .schema import TUNED_COLUMNS, UNTUNED_COLUMNS, TunedRow, gemm_bytes, parse_tuned_row, throughput
from .table import ConfigStore, ConfigTable, Conflict, TableFile, env_sources, load_paths_env, read_table_file

__all__ = [
    "TUNED_COLUMNS",
    "UNTUNED_COLUMNS",
    "ConfigStore",
    "ConfigTable",
    "Conflict",
    "TableFile",
    "TunedRow",
    "env_sources",
    "gemm_bytes",
    "load_paths_env",
    "parse_tuned_row",
    "read_table_file",
    "throughput",
]
