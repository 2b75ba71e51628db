"""`gemmtune bench tuned.csv`: the table through the runtime vs the vendor default vs the roof."""

from __future__ import annotations

import os
import time

import click
import torch

from ..configs import ConfigTable
from ..configs.table import ConfigStore, env_sources
from ..device import identity
from ..errors import GemmtuneError
from ..plugins import import_plugins
from ..tuner.bench import (
    HEADER,
    bench_outputs,
    bench_table,
    dispatch_overhead_us,
    summarize,
    summary_lines,
    write_outputs,
)
from ..tuner.timing import measure_ceilings
from . import _validate as v


def _prefix(ctx, param, value):
    if value is not None:
        v.output_file(ctx, param, value + ".csv")
    return value


@click.command("bench")
@click.argument("tuned", type=click.Path(dir_okay=False))
@click.option(
    "-o",
    "--out",
    "prefix",
    default=None,
    callback=_prefix,
    help="Output prefix for PREFIX.csv/.json/.png (default: the table's path without .csv + '.bench').",
)
@click.option("--reps", type=click.IntRange(min=5), default=20, show_default=True, help="Graph replays (median).")
@click.option("--device", default=None, callback=v.device, help="cuda or cpu (default: cuda when available).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--plugin", multiple=True, callback=v.plugins, help="Module to import that registers extra backends.")
@click.option("--progress/--no-progress", default=True, help="Progress bar with ETA on stderr.")
@click.option("--ms", default=None, callback=v.nsets,
              help="Bench every shape of TUNED at these Ms, tuned or not (a comma list, LO..HI for the powers "
              "of two between, or both), e.g. 1..8192,3,12,24,48,96: the Ms a server runs.")  # fmt: skip
def command(tuned, prefix, reps, device, seed, plugin, progress, ms) -> None:  # fmt: skip
    """Benchmark TUNED (a tuned table of any GEMM family) on this GPU: what the runtime dispatches with the
    table in effect vs the family's default (F.linear, torch.bmm ..., timed twice for the noise) vs the
    roofline, one interleaved CUDA-graph run over cold weights per key: every row that applies here, or
    with --ms every shape at every M given. Prints a table and geomean speedups per M range; writes CSV,
    JSON and a PNG plot. Example:

        gemmtune bench tuned.csv -o results/llama8b --ms 1..4096,3,12,24,48,96,192,384,768,1536,3072
    """
    dev, ladder = device, ms
    base = prefix or (tuned[:-4] if tuned.endswith(".csv") else tuned) + ".bench"
    # Never over TUNED, a table GEMMTUNE_CONFIG* names, or a file that is no bench report (files.py).
    v.outputs_checked(bench_outputs(base), [tuned, *(p for _, p in env_sources(os.environ))])
    try:
        import_plugins()
        table = ConfigTable.load([tuned])
    except GemmtuneError as exc:
        raise click.ClickException(str(exc)) from None
    try:
        ConfigStore.from_env(os.environ)  # a GEMMTUNE_CONFIG* table that cannot load: say so now, not mid-run
    except GemmtuneError as exc:
        named = ", ".join(dict.fromkeys(var for var, _ in env_sources(os.environ))) or "GEMMTUNE_CONFIG"
        raise click.ClickException(f"{exc} (bench times TUNED alone: unset {named} or fix it)") from None
    ident = identity(dev)
    here = table.rows_for(ident)
    if not here:
        gpus = sorted({(r.gfx or "*", r.cu_num) for r in table.rows})
        raise click.ClickException(
            f"{tuned}: no row applies to this device ({ident.gfx}, {ident.cu_num} units); "
            f"the table has rows for {', '.join(f'{g}/{c}' for g, c in gpus) or 'nothing'}"
        )
    t0 = time.perf_counter()
    meta = {"table": os.path.abspath(tuned), "family": table.family.name, "ms": ladder, "device": str(dev),
            "gfx": ident.gfx, "cu_num": ident.cu_num,
            "torch": torch.__version__, "reps": reps, "title": f"{os.path.basename(tuned)} on {ident.gfx}"}  # fmt: skip
    if dev.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(dev)
        meta["title"] = f"{os.path.basename(tuned)} on {meta['gpu']}"
        c = measure_ceilings(dev)
        meta["ceilings"] = {"read_bw_TBps": c.read_bw / 1e12, "matmul_TFLOPs": c.flops / 1e12}
        click.echo(f"{meta['gpu']}: {c.describe()}")
    else:
        click.echo("CPU: this measures the harness, not a speedup. Times are eager wall-clock (no CUDA graphs), "
                   "so the tuned column includes gemmtune's per-call dispatch overhead; no roofline.")  # fmt: skip
    click.echo(HEADER)
    rows = bench_table(table, dev, reps=reps, seed=seed, log=click.echo, progress=progress, ms=ladder)
    summary = summarize(rows)
    meta["dispatch_overhead_us"] = dispatch_overhead_us(dev)
    meta["seconds"] = time.perf_counter() - t0
    click.echo("")
    for line in summary_lines(summary):
        click.echo(line)
    click.echo(f"eager dispatch overhead of gemmtune.gemm over F.linear: {meta['dispatch_overhead_us']:.2f} us/call")
    for note in write_outputs(rows, summary, base, meta):
        click.echo(note, err=True)
