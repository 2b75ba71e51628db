"""`gemmtune tune shapes.csv -o tuned.csv`: time every backend's candidates, keep the correct fastest."""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import click

from .. import settings
from ..errors import GemmtuneError, NoShapesError
from ..tuner.candidates import MIN_GAIN, SEARCHES, TuneOptions
from ..tuner.distributed import joined, launched_by_torchrun, tune_fleet
from ..tuner.donor import DonorError
from ..tuner.output import tune_outputs
from ..tuner.runner import PLUGINS_ENV, summary_lines, tune_file
from . import _validate as v


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM (torchrun stopping the other ranks when one dies, a scheduler's kill) exits through Python's
    unwinding, so a row being written leaves no temp file and worker processes are stopped; restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


@click.command("tune")
@click.argument("shapes", type=click.Path(dir_okay=False))
@v.output_file_option("-o", "--output", required=True,
                      help="Tuned CSV (aiter's columns); existing rows for this GPU are kept and skipped.")  # fmt: skip
@click.option(
    "--libtype",
    default=None,
    help="Comma list of backends to draw candidates from (default: every available one). "
    "The vendor default (torch) is always timed as the baseline.",
)
@click.option(
    "--err-ratio",
    type=v.Number(0, 1e6, lo_open=True),
    default=None,
    help="Max relative error ||y-ref||/||ref|| vs fp32 (default by dtype: bf16 1e-2, fp16 2e-3, fp32 1e-4).",
)
@click.option(
    "--min-gain",
    type=v.Number(0, 10),
    default=MIN_GAIN,
    show_default=True,
    help="A candidate replaces the default only if faster by more than this fraction (and the noise).",
)
@click.option(
    "--top",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Candidates kept by the screen for the accurate timing.",
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Candidates timed together in one interleaved screening run (fewer if memory is short).",
)
@click.option(
    "--reps",
    type=click.IntRange(min=5),
    default=20,
    show_default=True,
    help="Graph replays in the final timing (median).",
)
@click.option(
    "--timeout",
    type=v.Number(0, 1e7, lo_open=True),
    default=60.0,
    show_default=True,
    help="Seconds a worker may spend on one step (a candidate's check, a timing group) "
    "before it is killed and the candidate recorded as timed out (workers only).",
)
@click.option(
    "--mp",
    "mp_workers",
    type=click.IntRange(min=0),
    default=None,
    help="Worker processes, one per GPU (default: 1 on a GPU, so a crashing candidate "
    "cannot end the run; 0 on the CPU). 0 tunes in this process.",
)
@click.option("--all", "all_shapes", is_flag=True, help="Retune shapes already in the output.")
@v.output_file_option(
    "--profile-file", default=None, help="Append each candidate's result (status, error, screen/final us, reason), CSV."
)
@click.option("--device", default=None, callback=v.device, help="cuda or cpu (default: cuda when available).")
@click.option("--family", default=None,
              help="GEMM family of SHAPES (a16w16, batched, ...; default: from its header and file name). "
              "A list of another family is refused, never tuned as this one.")  # fmt: skip
@click.option("--ms", default=None, callback=v.nsets,
              help="Tune every shape of SHAPES at these Ms instead of the list's own: a comma list, LO..HI "
              "for the powers of two between, or both (e.g. 1..8192).")  # fmt: skip
@click.option(
    "--verify-range/--no-verify-range",
    default=True,
    show_default=True,
    help="Time each winner at the middle and lower edge of the M range its row will answer (down "
    "to the next smaller tuned M) and record the range where it is not slower than the default.",
)
@click.option("--stage-limit", type=click.IntRange(min=1), default=None,
              help="Two-stage families (fmoe): time at most this many kernels per backend and stage, the ones "
              "nearest the backend's heuristic (default: all).")  # fmt: skip
@click.option("--search", type=click.Choice(SEARCHES), default="fast", show_default=True,
              help="fast: every candidate gets a quick check (its plain call) and is screened, the would-be "
              "winner the full check (other call forms, graph replay); exhaustive: every candidate gets the "
              "full check first (~4x slower, same winners up to timing noise: docs/tuner.md).")  # fmt: skip
@click.option("--seed", type=int, default=0, show_default=True, help="Base seed (per shape derived).")
@click.option(
    "--precompile/--no-precompile",
    default=True,
    show_default=True,
    help="Compile backends' kernels for all shapes in parallel processes first (GPU).",
)
@click.option("--plugin", multiple=True, callback=v.plugins,
              help="Module to import (workers too) that registers more backends.")  # fmt: skip
@click.option("--distributed/--no-distributed", default=None,
              help="Shard the keys over the ranks of a torchrun launch, rows written by rank 0 (default: on "
              "when torchrun's variables are set; docs/tuner.md Fleet).")  # fmt: skip
@click.option("--from", "donor", type=click.Path(dir_okay=False), default=None,
              help="A tuned table of SHAPES' family from another GPU (any gfx): for each key it has, time only "
              "its winner, a few neighbours and the default here; other keys get the full search.")  # fmt: skip
@click.option("--progress/--no-progress", default=True, help="Progress bar with ETA on stderr.")
@click.option("-v", "--verbose", is_flag=True, help="Per-shape and per-rejected-candidate lines.")
def command(shapes, output, libtype, err_ratio, min_gain, top, batch, reps, timeout, mp_workers, all_shapes,
            profile_file, device, family, ms, verify_range, stage_limit, search, seed, precompile, plugin,
            distributed, donor, progress, verbose) -> None:  # fmt: skip
    """Tune every shape of SHAPES (aiter's untuned CSV of any GEMM family, or a capture file) and write
    the winners into OUTPUT, a tuned table of the same family.

    For each shape: every candidate is checked against an fp32 reference (wrong, NaN, crashing or
    out-of-memory candidates are rejected), screened, and the finalists timed against the vendor
    default in one interleaved CUDA-graph run over cold weights. The default is kept unless a
    candidate beats it by more than --min-gain and the measured noise. One row is written per
    finished shape, so a killed run resumes where it stopped. Example:

        gemmtune tune shapes.csv -o tuned.csv --profile-file profile.csv
        gemmtune tune shapes.csv --from h100_tuned.csv -o h200_tuned.csv
    """
    dev = device
    v.outputs_checked(tune_outputs(output, profile_file), [shapes])
    if plugin:
        os.environ[PLUGINS_ENV] = ",".join(filter(None, [settings.PLUGINS.raw(), *plugin]))
    if mp_workers is None:
        mp_workers = 1 if dev.type == "cuda" else 0
    libs = [s.strip() for s in libtype.split(",") if s.strip()] if libtype else None
    opts = TuneOptions(libtypes=libs, err_ratio=err_ratio, min_gain=min_gain, top=top, reps=reps, batch=batch,
                       seed=seed, verify_range=verify_range, stage_limit=stage_limit, search=search)  # fmt: skip
    ladder = ms
    args = dict(
        mp_workers=mp_workers,
        timeout=timeout,
        all_shapes=all_shapes,
        profile_file=profile_file,
        precompile=precompile,
        progress=progress,
        log=_log,
        verbose=verbose,
        family=family,
        ms=ladder,
        donor=donor,
    )
    if distributed is None:
        distributed = launched_by_torchrun()
    try:
        with _sigterm_exits():
            report = _tune(shapes, output, opts, dev, distributed, args)
        if report is None:
            return
    except DonorError as exc:
        raise click.BadParameter(str(exc), param_hint="'--from'") from None
    except NoShapesError as exc:
        raise click.BadParameter(str(exc), param_hint="SHAPES") from None
    except (GemmtuneError, ValueError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    for line in summary_lines(report, output):
        click.echo(line)
    if report.failures:
        raise SystemExit(1)


def _tune(shapes, output, opts, dev, distributed, args):
    """The run's report; None on a rank other than 0 of a distributed run (rank 0 reports every rank's keys)."""
    if not distributed:
        return tune_file(shapes, output, opts, dev, **args)
    with joined(dev.type) as fleet:
        report = tune_fleet(shapes, output, opts, dev, fleet, **args)
    return None if fleet.rank else report
