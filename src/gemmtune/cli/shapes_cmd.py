"""`gemmtune shapes --model config.json --tp 8 --nsets 1,16,256 -o shapes.csv`: a model's GEMM shapes."""

from __future__ import annotations

import click

from ..capture import key_to_record
from ..configs.io import write_atomic
from ..configs.schema import UNTUNED_COLUMNS
from ..keys import parse_dtype
from ..tuner.shapes import PRESETS, ModelConfigError, config_dtype, load_model_config, model_gemms, named_keys
from ..tuner.shapes import parse_nsets as _parse_nsets

DEFAULT_NSETS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
_MODEL_HELP = f"config.json path, a folder holding one, or a preset: {', '.join(sorted(PRESETS))}."
_OUT_HELP = "Untuned CSV to write (aiter's M,N,K,bias,dtype,outdtype,...); default: print to stdout."


@click.command("shapes")
@click.option("--model", "-m", required=True, help=_MODEL_HELP)
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="Tensor-parallel ranks.")
@click.option("--nsets", default=DEFAULT_NSETS, show_default=True,
              help="Token counts M: a comma list, LO..HI for powers of two between, or both.")  # fmt: skip
@click.option("--dtype", default=None, help="Input dtype (default: the config's torch_dtype, else bfloat16).")
@click.option("--outdtype", default=None, help="Output dtype (default: the input dtype).")
@click.option("--no-lm-head", is_flag=True, help="Leave out the lm_head GEMM.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help=_OUT_HELP)
def command(model, tp, nsets, dtype, outdtype, no_lm_head, output) -> None:
    """The GEMM shapes a Hugging Face model runs (one TP rank), as aiter's untuned CSV.

    Fused QKV and gate+up as serving engines run them; column-parallel layers split along N,
    row-parallel ones along K; MoE expert GEMMs keyed on the mean tokens per expert. Example:

        gemmtune shapes --model llama-3-70b --tp 8 --nsets 1,16,256,4096 -o shapes.csv
    """
    try:
        ms = _parse_nsets(nsets)
        dt = parse_dtype(dtype) if dtype else None
        odt = parse_dtype(outdtype) if outdtype else None
        config, source = load_model_config(model)
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    try:
        shapes = model_gemms(config, tp)
        dt = dt or config_dtype(config)
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(f"{source}: {exc}") from None
    odt = odt or dt
    if no_lm_head:
        shapes = [s for s in shapes if s.name != "lm_head"]
    pairs = named_keys(shapes, ms, dt, odt)
    rows = [key_to_record(k) for _, k in pairs]
    if output:
        write_atomic(output, UNTUNED_COLUMNS, rows)
        click.echo(f"gemmtune: {len(rows)} shapes from {source} (tp={tp}) written to {output}", err=True)
        for s in shapes:
            extra = f" (M = ceil(T*{s.top_k}/{s.experts}))" if s.experts else ""
            click.echo(f"  {s.name:<22} N={s.N:<7} K={s.K:<7} bias={s.bias} x{s.count}{extra}", err=True)
    else:
        click.echo(",".join(UNTUNED_COLUMNS))
        for r in rows:
            click.echo(",".join(r))
