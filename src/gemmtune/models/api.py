"""optimize(model) / restore(model): plan every change first, then apply; undo in reverse.

The plan is the list of Changes the rewrites of models/plan.py make, named by module path (so a
deep-copied optimized model restores itself, not the original). Validation happens while planning,
before the model is touched; if
applying still fails halfway, the applied part is undone and the error re-raised, so a model is
never left half patched.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..checks import check_bool, check_choice, check_int
from ..device import triton_installed
from . import architectures
from . import attention as attn_mod
from . import tensor_parallel as tp_mod
from . import verify as verify_mod
from .plan import plan
from .report import OptimizeReport
from .rewrite import Change, join
from .version import check_transformers

_REPORT = "_gemmtune_report"
ATTENTION_CHOICES = ("auto", "off", *attn_mod.TIERS)  # optimize(attention=...), None too


def _apply(model: nn.Module, change: Change, report: OptimizeReport) -> None:
    if "tp" in change.data:  # a sharded module of a tensor-parallel model (models/tensor_parallel.py)
        return change.data["tp"].apply(model, change.path, lambda: change.rewrite.apply(model, change, report))
    change.rewrite.apply(model, change, report)


def _undo(model: nn.Module, change: Change) -> str | None:
    """Undo one change; returns why it could not be undone where the module tree changed since."""
    if "tp" in change.data:
        return change.data["tp"].undo(model, change.path, lambda: change.rewrite.undo(model, change))
    return change.rewrite.undo(model, change)


def _softcap(model) -> float | None:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "attn_logit_softcapping", None)
    return float(cap) if cap else None


def _device(model):
    p = next(model.parameters(), None)
    return None if p is None else p.device


# ---- the cached-path check ----------------------------------------------------------------------
def _inside(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


class _CachedPathCheck:
    """optimize()'s parity check (models/verify.py): the stock trace before the changes, the judgement
    after; what disagrees is undone here and reported."""

    def __init__(self, model, report: OptimizeReport):
        from ..dispatch import get_dispatcher

        spath, smod = architectures.decoder_stack(model)
        self.paths = [join(spath, "layers", str(i)) for i in range(len(smod.layers))]
        self.layers = list(smod.layers)
        self.quiet = get_dispatcher().quiet
        self.probe = verify_mod.Probe.for_model(model)
        self.tol = verify_mod.tolerance(model)
        with self.quiet():
            self.stock = verify_mod.run(model, self.layers, self.probe)

    def finish(self, model, changes: list[Change], done: list[Change], report: OptimizeReport) -> None:
        def revert(pick) -> int:
            picked = [a for a in reversed(done) if pick(a)]
            for a in picked:
                _undo(model, a)
                done.remove(a)
                changes.remove(a)
            return len(picked)

        try:
            with self.quiet():
                opt = verify_mod.run(model, self.layers, self.probe, teacher=self.stock)
        except Exception as e:  # noqa: BLE001 - a patched path that cannot even run: nothing stays patched
            revert(lambda a: True)
            report.entries = [e for e in report.entries if e.section == "left alone"]
            report.changed.clear()
            report.notes.append(f"cached-path check failed to run the optimized model ({type(e).__name__}: {e}); "
                                "every change was undone")  # fmt: skip
            return
        verdict = verify_mod.compare(self.stock, opt, self.probe, self.tol)
        verdict = tp_mod.decide_together(verdict, tp_mod.group_of(model))  # every rank puts back the same
        bad, logits = verdict.bad, verdict.logits
        for f in bad:
            prefix = self.paths[f.index]
            if revert(lambda a, p=prefix: _inside(a.path, p)):
                report.withdraw(prefix)
                why = f"differs from stock at {f.where()} (relative error {f.error:.2e} > {self.tol:g})"
                report.skip("verify", prefix, type(self.layers[f.index]).__name__, why)
        last_ok = not bad or bad[-1].index != len(self.layers) - 1
        if logits is not None and last_ok:  # the final norm or lm_head path, outside every layer
            outside = lambda a: not a.rewrite.kept_by_check and not any(_inside(a.path, p) for p in self.paths)  # noqa: E731
            reverted = [a.path for a in done if outside(a)]
            revert(outside)
            for p in reverted:
                report.withdraw(p)
            why = f"logits differ from stock at {logits.where()} (relative error {logits.error:.2e} > {self.tol:g})"
            report.skip("verify", "", type(model).__name__, why + ": changes outside the decoder layers undone")
        n = len(self.layers)
        secs = self.stock.seconds + opt.seconds
        report.notes.append(
            f"cached-path check: {n - len(bad)}/{n} decoder layers agree with stock (prefill of {verify_mod.PREFILL}"
            f" + {verify_mod.DECODE_STEPS} cached decode steps, batch {verify_mod.BATCH} left-padded, relative"
            f" error <= {self.tol:g}; worst layer {verdict.worst_layer:.1e}); took {secs:.2f} s"
        )


def _optimizers_holding(model) -> list[str]:
    """The names of the model's parameters that a live torch.optim.Optimizer holds (found by the garbage
    collector's list of objects: an optimizer keeps no link back to the model)."""
    import gc

    ids = {id(p): name for name, p in model.named_parameters()}
    held = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.optim.Optimizer):  # type(): a dead weakref proxy raises on isinstance
            held |= {ids[id(p)] for group in obj.param_groups for p in group["params"] if id(p) in ids}
    return sorted(held)


def _refuse_new_weights_when_trained(model, changes: list[Change]) -> None:
    """No new weight tensors for a model being trained: in training mode, or with parameters an optimizer
    already holds, that optimizer would keep stepping the Parameters the new tensors replace and silently
    stop training what the model computes with."""
    found = {new for c in changes if (new := c.rewrite.new_weights(c)) is not None}
    if not found:
        return
    what, remedy = zip(*sorted(found))
    if model.training:
        why, first = "the model is in training mode (model.training is True)", "call model.eval() first"
    else:
        held = _optimizers_holding(model)
        if not held:
            return
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        why, first = f"an optimizer holds the model's parameters ({shown})", "make optimizers after optimize()"
    raise ValueError(
        f"gemmtune.optimize: {why} and {', '.join(what)} makes new weight tensors that an optimizer made "
        f"before optimize() would not train; {first} (gemmtune.restore(model) before training again), or "
        f"pass {', '.join(remedy)}"
    )


# ---- public -------------------------------------------------------------------------------------
def optimize(
    model,
    *,
    config=None,
    fuse_qkv: bool = True,
    fuse_gate_up: bool = True,
    fused_ops: bool = True,
    attention: str | None = "auto",
    m_threshold: int | None = None,
    split_bias: bool = False,
    route_linears: bool = True,
    quantize: str | None = None,
    quantize_lm_head: bool = False,
    quantize_producers: bool = True,
    verify: bool = True,
    mla_absorb: bool = True,
) -> OptimizeReport:
    """Optimize a loaded Hugging Face causal LM in place (call before torch.compile).

    config: a tuned table (path, list of paths or ConfigTable) to put in effect for gemmtune.gemm.
    fuse_qkv / fuse_gate_up: one GEMM for q/k/v and for gate/up. fused_ops: Triton RMSNorm,
    residual-add + RMSNorm and act*mul, and the causal mask built without transformers' packed-sequence
    sync on the model's own positions (models/mask_positions.py). attention: "auto", "flash", "triton",
    "flex", "sdpa", "eager" or None (leave as is; models/attention.py describes the tiers);
    GEMMTUNE_ATTENTION forces a tier.
    m_threshold: calls with fewer rows keep F.linear.
    split_bias: bias-free GEMM plus a separate add. route_linears: other nn.Linear via gemmtune.gemm,
    and fp8 block-scaled checkpoint Linears (transformers' FP8Linear) via gemm_a8w8_blockscale.
    quantize: "fp8" / "int8" (per-channel weights, per-token activations) or "fp8-block" (128x128 /
    1x128) runs the linears through the 8-bit ops (models/quantize.py); lm_head only with
    quantize_lm_head. In fused decoder layers the norms and act*mul emit the next GEMM's input
    already quantized (models/quant_feeds.py); quantize_producers=False leaves that out (each 8-bit
    GEMM quantizes its 16-bit input: the same math, one more pass per GEMM; for comparisons).
    verify: check every changed decoder layer against stock on a tiny left-padded prefill plus cached
    decode steps (models/verify.py) before quantizing; a layer that disagrees is put back to stock and
    reported (its cost is in the report's notes).
    mla_absorb: DeepSeek-V2/V3's MLA decodes (<= 16 new tokens) on the latent cache with kv_b_proj
    absorbed (models/mla.py), where transformers expands the whole cache every step: a 4-layer
    DeepSeek-V3's CUDA-graph decode 1.54x (b=1) / 1.95x (b=8) over stock instead of 1.19x / 1.10x
    (H100). False keeps its own forward.
    A model in training mode is refused where the changes would make new weight tensors (fusions, the
    shared-expert fold, quantize): an optimizer made earlier would not train them (docs/model-toolkit.md).
    Returns an OptimizeReport; gemmtune.restore(model) (or report.undo()) gives the original back.
    """
    flags = dict(fuse_qkv=fuse_qkv, fuse_gate_up=fuse_gate_up, fused_ops=fused_ops, split_bias=split_bias,
                 route_linears=route_linears, quantize_lm_head=quantize_lm_head,
                 quantize_producers=quantize_producers, verify=verify, mla_absorb=mla_absorb)  # fmt: skip
    for name, flag in flags.items():
        check_bool("optimize", name, flag)
    check_choice("optimize", "attention", attention, ATTENTION_CHOICES, optional=True)
    check_int("optimize", "m_threshold", m_threshold, optional=True)
    if quantize is not None:
        from .quantize import check_mode

        check_mode(quantize)
    version = check_transformers()
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"gemmtune.optimize takes a transformers PreTrainedModel, got {type(model).__name__}")
    opts = dict(
        fuse_qkv=bool(fuse_qkv), fuse_gate_up=bool(fuse_gate_up), fused_ops=bool(fused_ops),
        attention=attention, m_threshold=m_threshold, split_bias=bool(split_bias),
        route_linears=bool(route_linears), config=None if config is None else repr(config), verify=bool(verify),
    )  # fmt: skip
    opts.update(mla_absorb=bool(mla_absorb))
    if quantize is not None:
        from .quantize import check_mode

        opts.update(quantize=check_mode(quantize), quantize_lm_head=bool(quantize_lm_head),
                    quantize_producers=bool(quantize_producers))  # fmt: skip
    existing = model.__dict__.get(_REPORT)
    if existing is not None:
        if existing.options == opts:
            return existing  # idempotent: the same call twice changes nothing
        raise ValueError(
            "gemmtune.optimize: this model is already optimized with other options "
            f"({existing.options}); call gemmtune.restore(model) first"
        )
    inner = next((path for path, mod in model.named_modules() if path and _REPORT in mod.__dict__), None)
    if inner is not None:
        raise ValueError(f"gemmtune.optimize: {inner} is already optimized by gemmtune.optimize; call "
                         f"gemmtune.restore(model.{inner}) first")  # fmt: skip
    meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(f"gemmtune.optimize: parameters are not materialized (meta device), e.g. {meta[0]}")
    tier, note = attn_mod.resolve_tier(attention, _softcap(model), _device(model))
    arch = architectures.architecture_of(model)
    report = OptimizeReport(
        architecture=arch.name if arch else "unknown",
        model_type=str(getattr(model.config, "model_type", "?")),
        transformers_version=version,
        options=opts,
        attention_tier=tier if arch else None,
        attention_note=note,
    )
    if model.training:
        report.notes.append("model is in training mode: fused layer forwards run the stock path until eval()")
    if fused_ops:
        if not triton_installed():
            report.notes.append("triton is not installed: fused ops run their PyTorch references")
    changes = tp_mod.plan(model, report, lambda: plan(model, arch, opts, report, tier),
                          check_tables=config is None)  # fmt: skip
    _refuse_new_weights_when_trained(model, changes)
    checked = [c for c in changes if not c.rewrite.after_check]
    after_check = [c for c in changes if c.rewrite.after_check]
    check = None
    if verify and arch is not None and architectures.decoder_stack(model) is not None and checked:
        try:
            check = _CachedPathCheck(model, report)
        except Exception as e:  # noqa: BLE001 - the stock model itself cannot run the probe
            report.notes.append(f"cached-path check not run: the stock model failed on its probe ({e})")
    if config is not None:
        from ..dispatch import set_config

        set_config(config)
        report.notes.append("tuned table put in effect for gemmtune.gemm (process-wide)")
    done: list[Change] = []
    try:
        for c in checked:
            _apply(model, c, report)
            done.append(c)
        if check is not None:
            check.finish(model, changes, done, report)
        for c in after_check:
            _apply(model, c, report)
            done.append(c)
    except BaseException:
        for c in reversed(done):
            _undo(model, c)
        raise
    report._model = model
    report._restore = restore
    report._actions = changes
    model.__dict__[_REPORT] = report
    return report


def restore(model):
    """Undo gemmtune.optimize on `model` (weights of fused projections come back as views). Modules
    deleted or replaced after optimize() are left as they are and named in one warning."""
    report = getattr(model, "__dict__", {}).get(_REPORT)
    if report is None:
        raise ValueError("gemmtune.restore: this model was not optimized by gemmtune.optimize")
    left = {}
    for a in reversed(report._actions):
        why = _undo(model, a)
        gone = _missing_prefix(model, a.path)
        if gone is not None:
            left.setdefault(gone, "no longer in the model")
        elif why is not None:
            left.setdefault(a.path, why)
    del model.__dict__[_REPORT]
    report._model = None
    if left:
        where = "; ".join(f"{p}: {why}" for p, why in reversed(left.items()))
        warnings.warn(f"gemmtune.restore: the module tree changed after optimize(); not restored: {where}",
                      stacklevel=2)  # fmt: skip
    return model


def _missing_prefix(model: nn.Module, path: str) -> str | None:
    """The first prefix of `path` that names no module of `model` (None when the whole path does)."""
    mod, parts = model, path.split(".") if path else []
    for i, name in enumerate(parts):
        mod = mod._modules.get(name) if isinstance(mod, nn.Module) else None
        if mod is None:
            return ".".join(parts[: i + 1])
    return None


def report_of(model) -> OptimizeReport | None:
    """The report of an optimized model, or None."""
    return getattr(model, "__dict__", {}).get(_REPORT)
