"""Command lines the CLI tests share."""

from __future__ import annotations

import json
import pathlib

from click.testing import CliRunner

from gemmtune.cli.main import cli

# `gemmtune bench-model` on the CPU at its smallest: one tiny-llama layer, a 16-token prefill, decode b=1
# on 16 tokens of context; tests add the contenders, reps and flags they are about, and -o.
TINY_BENCH_MODEL = ("bench-model", "--device", "cpu", "--model", "tiny-llama", "--layers", "1", "--prefill", "1x16",
                    "--ctx", "16", "--batches", "1")  # fmt: skip


def bench_model_report(out: pathlib.Path, *flags: str) -> dict:
    """report.json of a TINY_BENCH_MODEL run with `flags` into `out`, which must exit 0 with no errors."""
    res = CliRunner().invoke(cli, [*TINY_BENCH_MODEL, *flags, "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "report.json").read_text())
    assert not data["errors"], data["errors"]
    return data
