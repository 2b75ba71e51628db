"""`gemmtune bench-model --model PRESET|config.json`: stock vs optimize() vs torch.compile of each."""

from __future__ import annotations

import sys

import click

from ..tuner.model_shapes import PRESETS
from . import _validate as v


def _device(ctx, param, value):
    # Checked to exist here: a CPU-only torch asked for cuda is a usage error, not a traceback mid-run.
    return None if value is None else str(v.device(ctx, param, value))


def _dtype(ctx, param, value):
    return None if value is None else str(v.gemm_dtype(ctx, param, value)).removeprefix("torch.")


# On the CPU (CI, smoke tests) the defaults shrink so a tiny model runs in seconds.
_GPU_DEFAULTS = {"prefill": "1x2048", "batches": "1,8", "ctx": 1024, "reps": 7}
_CPU_DEFAULTS = {"prefill": "1x64", "batches": "1,4", "ctx": 64, "reps": 5}


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{what}: expected a comma list of integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise click.BadParameter(f"{what}: expected positive integers, got {text!r}")
    return vals


def _prefill(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        b, _, s = part.partition("x")
        try:
            out.append((int(b), int(s)))
        except ValueError:
            raise click.BadParameter(f"prefill: expected BATCHxSEQ[,BATCHxSEQ...], got {part!r}") from None
    if not out:
        raise click.BadParameter(f"prefill: no BATCHxSEQ in {text!r}")
    return tuple(out)


@click.command("bench-model")
@click.option("--model", "-m", required=True,
              help=f"config.json, a folder holding one, or a preset: {', '.join(sorted(PRESETS))}.")  # fmt: skip
@click.option("--layers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Decoder layers to build (a dense prefix keeps its share of the layers).")  # fmt: skip
@click.option("--table", default=None, help="Tuned table(s) for optimize() (a CSV; several joined by ':').")
@click.option("--device", default=None, callback=_device, help="cuda or cpu (default: cuda when available).")
@click.option(
    "--dtype", default=None, callback=_dtype, help="Model dtype (default: bfloat16 on a GPU, float32 on the CPU)."
)
@click.option("--prefill", default=None, help="BATCHxSEQ list [GPU 1x2048, CPU 1x64].")
@click.option("--batches", default=None, help="Decode batch sizes [GPU 1,8, CPU 1,4].")
@click.option("--ctx", type=click.IntRange(min=1), default=None, help="Decode context length [GPU 1024, CPU 64].")
@click.option("--reps", type=click.IntRange(min=1), default=None, help="Timed rounds (median) [GPU 7, CPU 5].")
@click.option("--contenders", default="stock,optimize,compile,compile+optimize", show_default=True,
              help="Which of stock, optimize, compile, compile+optimize (and with --quantize: quantize, "
                   "compile+quantize) to run.")  # fmt: skip
@click.option("--quantize", type=click.Choice(["fp8", "fp8-block", "int8"]), default=None,
              help="Also run optimize(quantize=...) (contender 'quantize', and 'compile+quantize' when "
                   "compile+optimize runs): 8-bit linears, lm_head 16-bit; the report adds what was quantized, "
                   "each 8-bit GEMM's error vs the 16-bit GEMM and the logits' error vs stock.")  # fmt: skip
@click.option("--no-producers", is_flag=True,
              help="With --quantize: optimize(quantize_producers=False), every 8-bit GEMM quantizes its 16-bit "
                   "input (no norm / act*mul emitting it): the A/B of the producers.")  # fmt: skip
@click.option("--compile-ops", "compile_ops", multiple=True,
              help="How gemmtune's norms/act/rope run under torch.compile, one compile+optimize contender per "
                   "use: ref (inductor fuses the PyTorch formula), op (Triton kernel as a custom op), or e.g. "
                   "'ref,rope=op'. Default: GEMMTUNE_COMPILE_OPS, else the built-in per-op defaults.")  # fmt: skip
@click.option("--compile-backend", default=None, help="torch.compile backend [GPU inductor, CPU aot_eager].")
@click.option("--no-profile", is_flag=True, help="Only time; no profile breakdown.")
@click.option("--decode-steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Teacher-forced decode parity: cached steps each contender is checked on vs stock.")  # fmt: skip
@click.option("--keep-going", is_flag=True,
              help="Time contenders that fail decode parity too (marked PARITY FAIL) and exit 0; by default a "
                   "failing or erroring contender stops the run before timing and the command exits 1.")  # fmt: skip
@click.option(
    "--test-break",
    "test_break",
    default=None,
    help="Check the parity check: this contender's attention ignores its KV cache, so decode parity must "
    "fail it (exit 1).",
)
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Under torchrun with this many processes: stock tensor-parallel transformers vs optimize() of "
                   "it (decode parity on every rank, eager decode speed on rank 0; nothing written).")  # fmt: skip
@click.option("-o", "--out", "out_dir", default=None, callback=v.output_folder,
              help="Report folder (default: bench-model-<model name>).")  # fmt: skip
def command(model, layers, table, device, dtype, prefill, batches, ctx, reps, contenders, quantize, no_producers,
            compile_ops, compile_backend, no_profile, decode_steps, keep_going, test_break, tp,
            out_dir) -> None:  # fmt: skip
    """Build MODEL with random weights (nothing downloaded) and time, in one process and interleaved:
    stock Hugging Face, gemmtune.optimize(), torch.compile of stock and torch.compile of optimize(),
    for prefill (BATCHxSEQ, last-token logits) and CUDA-graph decode (static cache of CTX tokens, one
    token per step, each batch size). Reports ms, speedup vs stock and the profile breakdown of each
    as OUT/report.md, report.json and report.png. On the CPU: eager decode, wall-clock timing. Example:

        gemmtune bench-model --model llama-3-8b --layers 4 -o results/llama
        gemmtune bench-model --model llama-3-8b --layers 4 --quantize fp8 -o results/llama-fp8
    """
    import os

    v.require_module("transformers", "gemmtune bench-model")
    from ..device import default_device
    from ..errors import GemmtuneError
    from ..kernels.compile_mode import describe, parse
    from ..keys import parse_dtype
    from ..profiling import bench_model, bench_report

    dev = device or default_device().type
    if dev not in ("cuda", "cpu") and not dev.startswith("cuda:"):
        raise click.BadParameter(f"--device {dev!r}: expected cuda or cpu")
    defaults = _GPU_DEFAULTS if dev.startswith("cuda") else _CPU_DEFAULTS
    if tp > 1:
        _tensor_parallel(model, layers, table, dev, dtype, tp, batches or defaults["batches"], decode_steps,
                         reps or defaults["reps"])  # fmt: skip
        return
    name = os.path.basename(os.path.normpath(model)).removesuffix(".json")
    out = out_dir or f"bench-model-{name}"
    inputs = [model, *(table.split(":") if table else [])]
    v.outputs_checked(bench_report.report_outputs(out), inputs, folder=out)  # before the model is built (files.py)
    ops = tuple(compile_ops) or (describe(),)
    try:
        for spec in ops:
            parse(spec)
        settings = bench_model.Settings(
            model=model,
            layers=layers,
            table=table.split(":") if table and ":" in table else table,
            device=dev,
            dtype=parse_dtype(dtype) if dtype else None,
            prefill=_prefill(prefill or defaults["prefill"]),
            batches=_ints(batches or defaults["batches"], "batches"),
            ctx=ctx or defaults["ctx"],
            reps=reps or defaults["reps"],
            contenders=tuple(c.strip() for c in contenders.split(",") if c.strip()),
            quantize=quantize,
            quantize_producers=not no_producers,
            compile_ops=ops,
            compile_backend=compile_backend,
            profile=not no_profile,
            decode_steps=decode_steps,
            keep_going=keep_going,
            break_contender=test_break,
        )
        res = bench_model.run(settings)
    except (GemmtuneError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    text = bench_report.markdown(res, "gemmtune bench-model " + " ".join(sys.argv[2:]))
    click.echo(text)
    for note in bench_report.write(res, out, "gemmtune bench-model " + " ".join(sys.argv[2:])):
        click.echo(note, err=True)
    failures = res.parity_failures() + ([] if res.decode_parity else ["decode parity was not checked"])
    if (failures or res.errors) and not keep_going:
        for line in failures or res.errors:
            click.echo(f"bench-model: {line}", err=True)
        sys.exit(1)


def _tensor_parallel(model, layers, table, dev, dtype, tp, batches, decode_steps, reps) -> None:
    from ..errors import GemmtuneError
    from ..keys import parse_dtype
    from ..profiling import bench_tp

    settings = bench_tp.TPSettings(
        model=model,
        layers=layers,
        tp=tp,
        device=dev,
        dtype=parse_dtype(dtype) if dtype else None,
        table=table.split(":") if table and ":" in table else table,
        batches=_ints(batches, "batches"),
        decode_steps=decode_steps,
        reps=reps,
    )
    try:
        ok = bench_tp.run(settings, echo=click.echo)
    except (GemmtuneError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if not ok:
        sys.exit(1)
