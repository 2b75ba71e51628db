"""`gemmtune doctor`: device, arch, SM/CU count, library versions, backends available, settings in effect."""

from __future__ import annotations

import json

import click

from .. import settings
from ..doctor import environment_report


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--settings-table", is_flag=True, help="Print docs/settings.md's table of every setting and exit.")
def doctor(as_json: bool, settings_table: bool) -> None:
    """Report the device (arch, SM/CU count), torch/triton/CUDA/ROCm versions, available backends and
    every GEMMTUNE_* setting in effect with where it came from (environment, default, an API call)."""
    if settings_table:
        click.echo(settings.markdown_table(), nl=False)
        return
    report = environment_report()
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    width = max(len(k) for k in report)
    for k, v in report.items():
        if isinstance(v, dict):
            click.echo(f"{k}:")
            inner = max([width - 2, *map(len, v)])
            for name, state in v.items():
                click.echo(f"  {name:<{inner}}  {state}")
        else:
            click.echo(f"{k:<{width}}  {v}")
