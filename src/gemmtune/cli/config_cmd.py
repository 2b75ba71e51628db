"""`gemmtune show-config`: the tables in effect, rows that apply to this GPU, conflicts."""

from __future__ import annotations

import collections
import os

import click

from ..configs import ConfigTable
from ..device import default_device, identity
from ..errors import ConfigError


@click.command("show-config")
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--conflicts/--no-conflicts", default=True, help="List every duplicate key and which row won.")
def show_config(paths: tuple[str, ...], conflicts: bool) -> None:
    """Show the tuned tables in effect (PATHS, else $GEMMTUNE_CONFIG) and what applies to this GPU."""
    sources = list(paths) or [p for p in os.environ.get("GEMMTUNE_CONFIG", "").split(":") if p.strip()]
    if not sources:
        click.echo("No table in effect (GEMMTUNE_CONFIG is not set): every GEMM uses the default backend.")
        return
    try:
        table = ConfigTable.load(sources)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    ident = identity(default_device())
    here = table.rows_for(ident)
    click.echo(f"tables: {', '.join(table.files)}")
    click.echo(f"rows: {len(table)} after merge; this device is gfx={ident.gfx} cu_num={ident.cu_num}")
    click.echo(f"rows that apply here: {len(here)}")
    by_gpu = collections.Counter((r.gfx or "*", r.cu_num) for r in table.rows)
    for (gfx, cu), n in sorted(by_gpu.items()):
        mark = " (this device)" if (gfx in (ident.gfx, "*") and cu == ident.cu_num) else ""
        click.echo(f"  gfx={gfx} cu_num={cu}: {n} rows{mark}")
    libs = collections.Counter(r.libtype for r in here)
    if libs:
        click.echo("libtypes here: " + ", ".join(f"{k}={v}" for k, v in sorted(libs.items())))
    click.echo(f"conflicts (duplicate keys): {len(table.conflicts)}")
    if conflicts:
        for c in table.conflicts:
            click.echo(f"  {c.describe()}")
