"""`gemmtune capture -o shapes.csv -- CMD ...`: run CMD with GEMMTUNE_CAPTURE set, then summarize."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from ..capture import read_shapes


@click.command("capture", context_settings={"ignore_unknown_options": True})
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Shapes CSV to write/merge into.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def capture(output: str, command: tuple[str, ...]) -> None:
    """Run COMMAND and record every GEMM shape it dispatches through gemmtune (with call counts).

    The file is aiter's untuned CSV (M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle) plus a count
    column; several runs (or processes) merge into the same file. Example:

        gemmtune capture -o shapes.csv -- python serve.py --model ...
    """
    env = dict(os.environ, GEMMTUNE_CAPTURE=os.path.abspath(output))
    try:
        rc = subprocess.call(list(command), env=env)
    except FileNotFoundError:
        raise click.ClickException(f"command not found: {command[0]}") from None
    if os.path.exists(output):
        shapes = read_shapes(output)
        calls = sum(c for _, c in shapes)
        click.echo(f"gemmtune: {len(shapes)} distinct shapes, {calls} calls recorded in {output}", err=True)
    else:
        click.echo(f"gemmtune: no GEMM went through gemmtune; {output} not written", err=True)
    sys.exit(rc)
