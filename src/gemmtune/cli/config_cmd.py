"""`gemmtune show-config`: the tables in effect, each file's family, rows that apply to this GPU, conflicts."""

from __future__ import annotations

import collections
import os

import click

from .. import backends, families
from ..configs import ConfigStore
from ..configs.table import env_sources
from ..device import default_device, identity
from ..errors import ConfigError


def _runnable(fam) -> str:
    if backends.all_backends(fam.name):
        return ""
    return f" (loads, but {fam.unrunnable or 'has no op here'}: its rows are kept, nothing dispatches from them)"


@click.command("show-config")
@click.argument("paths", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--conflicts/--no-conflicts", default=True, help="List every duplicate key and which row won.")
def show_config(paths: tuple[str, ...], conflicts: bool) -> None:
    """Show the tuned tables in effect (PATHS, else the GEMMTUNE_CONFIG* variables): each file's GEMM
    family and row count, what applies to this GPU, and duplicate keys."""
    try:
        store = ConfigStore.load(list(paths)) if paths else ConfigStore.from_env(os.environ)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    if not store.files:
        names = ", ".join(f.env_var for f in families.all_families())
        click.echo(f"No table in effect (none of {names} names a file): every GEMM uses its family's default.")
        return
    ident = identity(default_device())
    sources = dict((p, v) for v, p in env_sources(os.environ)) if not paths else {}
    click.echo(f"this device is gfx={ident.gfx} cu_num={ident.cu_num}")
    for path, fam_name in store.files:
        fam = families.get(fam_name)
        via = f" (from {sources[path]})" if path in sources else ""
        n = sum(1 for r in store.table(fam).rows if r.source == path)
        click.echo(f"{path}{via}: {fam.name} table, {n} rows kept after merge{_runnable(fam)}")
    for name, table in store.tables.items():
        here = table.rows_for(ident)
        click.echo(f"[{name}] tables: {', '.join(table.files)}")
        click.echo(f"[{name}] rows: {len(table)} after merge; rows that apply here: {len(here)}")
        by_gpu = collections.Counter((r.gfx or "*", r.cu_num) for r in table.rows)
        for (gfx, cu), n in sorted(by_gpu.items()):
            mark = " (this device)" if (gfx in (ident.gfx, "*") and cu == ident.cu_num) else ""
            click.echo(f"  gfx={gfx} cu_num={cu}: {n} rows{mark}")
        libs = collections.Counter(r.libtype for r in here)
        if libs:
            click.echo(f"[{name}] libtypes here: " + ", ".join(f"{k}={v}" for k, v in sorted(libs.items())))
        click.echo(f"[{name}] conflicts (duplicate keys): {len(table.conflicts)}")
        if conflicts:
            for c in table.conflicts:
                click.echo(f"  {c.describe()}")
