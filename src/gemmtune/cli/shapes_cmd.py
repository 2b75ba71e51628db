"""`gemmtune shapes --model config.json --tp 8 --nsets 1,16,256 -o shapes.csv`: a model's GEMM shapes."""

from __future__ import annotations

import click

from .. import families
from ..capture import key_to_record
from ..configs.files import SHAPE_LIST
from ..configs.io import write_atomic
from ..configs.schema import UNTUNED_COLUMNS
from ..tuner.model_shapes import (
    OWN_GEMMS,
    PRESETS,
    QUANT_LINEAR_FAMILIES,
    ModelConfigError,
    config_dtype,
    load_model_config,
    model_gemms,
    model_keys,
    named_keys,
)
from . import _validate as v

DEFAULT_NSETS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
_MODEL_HELP = f"config.json path, a folder holding one, or a preset: {', '.join(sorted(PRESETS))}."
_OUT_HELP = "Untuned CSV to write (aiter's M,N,K,bias,dtype,outdtype,...); default: print to stdout."


@click.command("shapes")
@click.option("--model", "-m", required=True, help=_MODEL_HELP)
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="Tensor-parallel ranks.")
@click.option("--nsets", default=DEFAULT_NSETS, show_default=True, callback=v.nsets,
              help="Token counts M: a comma list, LO..HI for powers of two between, or both.")  # fmt: skip
@click.option(
    "--dtype",
    default=None,
    callback=v.gemm_dtype,
    help="Input dtype (default: the config's torch_dtype, else bfloat16).",
)
@click.option("--outdtype", default=None, callback=v.gemm_dtype, help="Output dtype (default: the input dtype).")
@click.option("--no-lm-head", is_flag=True, help="Leave out the lm_head GEMM.")
@click.option("--family", default="a16w16", show_default=True,
              help="GEMM family to emit: a16w16 (the linear layers) or another family the model runs "
              "(batched: DeepSeek MLA's per-head absorbed projections).")  # fmt: skip
@click.option("--fuse-shared-experts", is_flag=True,
              help="--family fmoe: key DeepSeek-V3's / GLM-4-MoE's shared experts as extra experts of the "
              "fused MoE call, as aiter and SGLang run them (default: dense MLPs, as gemmtune.optimize runs "
              "them).")  # fmt: skip
@v.output_file_option("-o", "--output", default=None, help=_OUT_HELP)
def command(model, tp, nsets, dtype, outdtype, no_lm_head, family, fuse_shared_experts, output) -> None:
    """The GEMM shapes a Hugging Face model runs (one TP rank), as aiter's untuned CSV.

    Fused QKV and gate+up as serving engines run them; column-parallel layers split along N,
    row-parallel ones along K; MoE expert GEMMs keyed on the mean tokens per expert. Example:

        gemmtune shapes --model llama-3-70b --tp 8 --nsets 1,16,256,4096 -o shapes.csv
    """
    try:
        ms, dt, odt = nsets, dtype, outdtype
        config, source = load_model_config(model)
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if output:  # never over the model's config, a tuned table or a capture file (files.py)
        v.outputs_checked([(output, SHAPE_LIST, "-o")], [] if model in PRESETS else [source])
    try:
        shapes = model_gemms(config, tp)
        dt = dt or config_dtype(config)
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(f"{source}: {exc}") from None
    odt = odt or dt
    if fuse_shared_experts and family != "fmoe":
        raise click.UsageError(f"--fuse-shared-experts applies to --family fmoe, not --family {family}")
    if family != "a16w16":
        _other_family(family, config, source, tp, ms, dt, output, fuse_shared_experts, no_lm_head)
        return
    others = [name for name in OWN_GEMMS if _keys(name, config, tp, ms[:1], dt)]
    if others and output:
        click.echo(f"gemmtune: {source} also runs {', '.join(others)} GEMMs: --family {others[0]} emits them",
                   err=True)  # fmt: skip
    if no_lm_head:
        shapes = [s for s in shapes if s.name != "lm_head"]
    pairs = named_keys(shapes, ms, dt, odt)
    rows = [key_to_record(k) for _, k in pairs]
    if output:
        write_atomic(output, UNTUNED_COLUMNS, rows, kind=SHAPE_LIST)
        click.echo(f"gemmtune: {len(rows)} shapes from {source} (tp={tp}) written to {output}", err=True)
        for s in shapes:
            extra = f" (M = ceil(T*{s.top_k}/{s.experts}))" if s.experts else ""
            click.echo(f"  {s.name:<22} N={s.N:<7} K={s.K:<7} bias={s.bias} x{s.count}{extra}", err=True)
    else:
        click.echo(",".join(UNTUNED_COLUMNS))
        for r in rows:
            click.echo(",".join(r))


def _keys(family: str, config, tp, ms, dtype) -> list:
    try:
        return model_keys(family, config, tp, ms, dtype)
    except (ModelConfigError, ValueError, NotImplementedError):
        return []


def _other_family(name, config, source, tp, ms, dtype, output, fuse_shared: bool = False,
                  no_lm_head: bool = False) -> None:  # fmt: skip
    try:
        fam = families.get(name)
        options = {"fuse_shared": True} if fuse_shared else {}
        if no_lm_head and name in QUANT_LINEAR_FAMILIES:  # the other families have no lm_head key
            options["lm_head"] = False
        keys = list(dict.fromkeys(model_keys(name, config, tp, ms, dtype, **options)))
    except (ModelConfigError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    if not keys:
        raise click.ClickException(f"{source} runs no {name} GEMMs that gemmtune knows how to derive")
    rows = [key_to_record(k, fam) for k in keys]
    cols = list(fam.untuned_columns)
    if output:
        write_atomic(output, cols, rows, kind=SHAPE_LIST)
        click.echo(f"gemmtune: {len(rows)} {name} shapes from {source} (tp={tp}) written to {output}", err=True)
    else:
        click.echo(",".join(cols))
        for r in rows:
            click.echo(",".join(r))
