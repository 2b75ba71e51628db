"""`gemmtune show-config`: the tables in effect, each file's family, rows that apply to this GPU, conflicts,
and what cannot run here (said once per family)."""

from __future__ import annotations

import collections
import os

import click

from .. import backends, families
from ..configs import ConfigStore
from ..configs.io import read_csv
from ..configs.recognize import NotATable, refuse_foreign
from ..configs.shapes import ShapeListFile, read_any
from ..configs.table import TableFile, env_sources, unique_paths
from ..device import default_device, identity
from ..errors import ConfigError


def _unrunnable(fam) -> str | None:
    if backends.all_backends(fam.name) and not fam.unrunnable:
        return None
    return fam.unrunnable or "it has no op here"


def _load(paths: tuple[str, ...]) -> tuple[ConfigStore, list[TableFile], list[ShapeListFile], list[str]]:
    """PATHS (files or folders) -> the store of their tables, the tables as read, the shape lists, and
    what each of aiter's non-GEMM CSVs named is (shown, not refused: show-config only describes)."""
    if not paths:
        store = ConfigStore.from_env(os.environ)
        return store, store.table_files, [], []
    store, lists, foreign = ConfigStore(), [], []
    for path in unique_paths(list(paths)):
        if os.path.isdir(path):
            store.add_path(path)
            continue
        try:
            refuse_foreign(read_csv(path).header, path)
        except NotATable as exc:
            foreign.append(str(exc))
            continue
        got = read_any(path)
        if isinstance(got, ShapeListFile):
            lists.append(got)
        else:
            store.add_table(got)
    for tab in store.tables.values():
        tab.report_conflicts()
    return store, store.table_files, lists, foreign


@click.command("show-config")
@click.argument("paths", nargs=-1, type=click.Path())
@click.option("--conflicts/--no-conflicts", default=True, help="List every duplicate key and which row won.")
def show_config(paths: tuple[str, ...], conflicts: bool) -> None:
    """Show the tuned tables in effect (PATHS: tables, shape lists or folders of tables; else the
    GEMMTUNE_CONFIG* variables): each file's GEMM family and row count, what applies to this GPU,
    what cannot run here, and duplicate keys."""
    try:
        store, tables, lists, foreign = _load(paths)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    for line in foreign:
        click.echo(line)
    for sl in lists:
        click.echo(f"{sl.path}: {sl.family.name} shape list (aiter's untuned CSV), {len(sl.keys)} shapes: the "
                   "input of `gemmtune tune`, nothing dispatches from it"
                   + (f"; {len(sl.inert)} with an empty key field, kept" if sl.inert else ""))  # fmt: skip
    if not store.files:
        if not lists and not foreign:
            names = ", ".join(f.env_var for f in families.all_families())
            click.echo(f"No table in effect (none of {names} names a file): every GEMM uses its family's default.")
        return
    ident = identity(default_device())
    sources = dict((p, v) for v, p in env_sources(os.environ)) if not paths else {}
    click.echo(f"this device is gfx={ident.gfx} cu_num={ident.cu_num}")
    for tf in tables:
        via = f" (from {sources[tf.path]})" if tf.path in sources else ""
        n = sum(1 for r in store.table(tf.family).rows if r.source == tf.path)
        unused = f"; {len(tf.inert)} kept in the file but never used" if tf.inert else ""
        click.echo(f"{tf.path}{via}: {tf.family.name} table, {n} rows kept after merge{unused}")
        for r in tf.inert[:5]:
            click.echo(f"  {r.where}: {r.why}")
    for name, table in store.tables.items():
        fam = table.family
        here = table.rows_for(ident)
        click.echo(f"[{name}] tables: {', '.join(table.files)}")
        click.echo(f"[{name}] rows: {len(table)} after merge; rows that apply here: {len(here)}")
        why = _unrunnable(fam)
        if why:
            click.echo(f"[{name}] cannot run here: {why}; its rows are kept, every key uses the default")
        else:
            reasons = collections.Counter(fam.why_not_here(r.key) for r in table.rows)
            reasons.pop(None, None)
            for reason, n in reasons.most_common():
                click.echo(f"[{name}] {n} rows cannot run here ({reason}): kept, their keys use the default")
        by_gpu = collections.Counter((r.gfx or "*", r.cu_num) for r in table.rows)
        for (gfx, cu), n in sorted(by_gpu.items()):
            mark = " (this device)" if (gfx in (ident.gfx, "*") and cu in (ident.cu_num, 0)) else ""
            click.echo(f"  gfx={gfx} cu_num={cu or '*'}: {n} rows{mark}")
        libs = collections.Counter(r.libtype for r in here)
        if libs:
            click.echo(f"[{name}] libtypes here: " + ", ".join(f"{k}={v}" for k, v in sorted(libs.items())))
        click.echo(f"[{name}] conflicts (duplicate keys): {len(table.conflicts)}")
        if conflicts:
            for c in table.conflicts:
                click.echo(f"  {c.describe()}")
