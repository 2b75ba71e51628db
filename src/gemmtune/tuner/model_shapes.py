"""The GEMM keys a Hugging Face model config runs, as serving engines run them: its linear layers
(model_gemms), its batched GEMMs (batched_gemms), and the keys of every GEMM family it runs at given
token counts (model_keys). The shapes of each architecture come from its entry of the architecture
registry (gemmtune.model_types, where their conventions are); this module turns them into keys.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from ..families.batched import BatchedKey
from ..families.epilogue import EpilogueKey
from ..families.fmoe import ACT_TYPES, MoeKey
from ..families.quantized import BlockKey, QuantKey
from ..keys import GemmKey, parse_dtype
from ..model_types import REGISTRY, BatchedShape, LinearShape, ModelConfigError, model_type_of, text_config
from ..model_types.config import optional, required, split
from ..quant import formats
from .presets import PRESETS, load_model_config

# This module's key builders, with the registry's shapes and the presets they take (one import for the
# CLI, benchmarks and tests).
__all__ = [
    "CONFIG_DTYPES",
    "FAMILY_KEYS",
    "MAX_TOKENS",
    "OWN_GEMMS",
    "QUANT_LINEAR_FAMILIES",
    "PRESETS",
    "BatchedShape",
    "LinearShape",
    "ModelConfigError",
    "batched_gemms",
    "config_dtype",
    "epilogue_keys",
    "gemm_keys",
    "load_model_config",
    "mlp_shape",
    "model_gemms",
    "model_keys",
    "model_type_of",
    "moe_keys",
    "named_keys",
    "parse_nsets",
    "text_config",
]


def model_gemms(config: dict, tp: int = 1) -> list[LinearShape]:
    """The distinct linear layers of one TP rank of the model described by an HF `config` dict."""
    if not isinstance(tp, int) or tp < 1:
        raise ModelConfigError(f"tp must be a positive integer, got {tp!r}")
    return REGISTRY[model_type_of(config)].shapes(text_config(config), tp)


def batched_gemms(config: dict, tp: int = 1) -> list[BatchedShape]:
    """The distinct batched GEMMs of one TP rank of the model (DeepSeek V2/V3's MLA); [] for others."""
    if not isinstance(tp, int) or tp < 1:
        raise ModelConfigError(f"tp must be a positive integer, got {tp!r}")
    fn = REGISTRY[model_type_of(config)].batched
    return fn(text_config(config), tp) if fn else []


CONFIG_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def config_dtype(config: dict, default: torch.dtype = torch.bfloat16) -> torch.dtype:
    """The dtype the config says the model runs in (torch_dtype / dtype), else `default` when it says none.

    A dtype gemmtune does not tune (float64, int8, ...) is an error, not a silent `default`."""
    cfg = text_config(config)
    field = "torch_dtype" if cfg.get("torch_dtype") else "dtype"
    text = cfg.get(field)
    if not text:
        return default
    try:
        dtype = parse_dtype(str(text))
    except ValueError:
        dtype = None
    if dtype not in CONFIG_DTYPES:
        raise ModelConfigError(
            f"model config: {field}={text!r} is not a dtype gemmtune tunes (bfloat16, float16, float32); "
            "pass the dtype to use explicitly (gemmtune shapes --dtype)"
        )
    return dtype


def gemm_keys(
    shapes: Iterable[LinearShape],
    ms: Iterable[int],
    dtype: torch.dtype = torch.bfloat16,
    outdtype: torch.dtype | None = None,
) -> list[GemmKey]:
    """GemmKeys for every shape at every token count in `ms` (nsets), deduplicated, in shape then M order."""
    ms = list(ms)
    bad = [m for m in ms if not isinstance(m, int) or m < 1]
    if bad:
        raise ValueError(f"token counts must be positive integers, got {bad}")
    seen: dict[GemmKey, None] = {}
    for s in shapes:
        for m in ms:
            seen.setdefault(s.key(m, dtype, outdtype))
    return list(seen)


def named_keys(shapes: Iterable[LinearShape], ms: Iterable[int], dtype=torch.bfloat16, outdtype=None):
    """(layer names, key) pairs: like gemm_keys, with the layer names that share each key."""
    out: dict[GemmKey, list[str]] = {}
    for s in shapes:
        for m in ms:
            out.setdefault(s.key(m, dtype, outdtype), []).append(s.name)
    return [(names, k) for k, names in out.items()]


# ---- keys of each GEMM family ---------------------------------------------------------------------
def moe_keys(config: dict, tp: int = 1, ep: int = 1, tokens=(1,), dtype: torch.dtype = torch.bfloat16,
             activation: str | None = None, fuse_shared: bool = False) -> list[MoeKey]:  # fmt: skip
    """The fmoe keys one rank of an MoE model runs at each token count (empty for a dense model).

    tp splits every expert's intermediate size; ep splits the routed experts (each rank holds
    experts / ep of them and keys global_expert = experts). Shared experts are dense MLPs, as optimize()
    runs them (their GEMMs are in model_gemms); `fuse_shared` keys DeepSeek-V3's and GLM-4-MoE's shared
    experts of the routed experts' size as extra experts of the fmoe call (shared_expert =
    n_shared_experts), as aiter and SGLang run them. Qwen2-MoE's sigmoid-gated shared expert is folded
    into the call as optimize() folds it (models/moe_shared.py: ceil(shared / moe intermediate size)
    more experts, every token routed to all of them) where ep = 1; with ep > 1 it is dense.
    """
    cfg = text_config(config)
    mt = cfg.get("model_type", "")
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be positive, got tp={tp} ep={ep}")
    entry = REGISTRY.get(mt)
    spec = entry.experts if entry else None
    if spec is None:
        return []
    experts, inter = required(cfg, *spec.count), required(cfg, spec.intermediate)
    topk = required(cfg, "num_experts_per_tok")
    shared = optional(cfg, "n_shared_experts", 0) if fuse_shared and spec.shared == "fusable" else 0
    for what, total, parts in (("experts", experts, ep), ("intermediate size", inter, tp)):
        if total % parts:
            raise ValueError(f"{mt}: {what} {total} do not split over {parts} ranks")
    folded = (
        -(-optional(cfg, "shared_expert_intermediate_size", 0) // inter) if spec.shared == "folded" and ep == 1 else 0
    )
    experts, topk = experts + folded, topk + folded
    act = activation or {"gelu_pytorch_tanh": "gelu_tanh"}.get(cfg.get("hidden_act", "silu"), cfg.get("hidden_act"))
    act_type = ACT_TYPES.get(act, "ActivationType.Silu")
    return [MoeKey(t, required(cfg, "hidden_size"), inter // tp, experts // ep + shared, topk, act_type, dtype, dtype,
                   dtype, "QuantType.No", True, False, experts if ep > 1 else 0, shared) for t in tokens]  # fmt: skip


def mlp_shape(config: dict) -> tuple[int, int, str, bool] | None:
    """(hidden, intermediate, act, bias) of the model's Linear -> act -> Linear MLP, as its registry entry's
    epilogue_mlp layout reads them (the MLPs models/epilogue_mlp.py fuses); None for another model type, a
    config that does not size the MLP, or an activation the epilogue GEMMs lack."""
    try:
        layout = REGISTRY[model_type_of(config)].epilogue_mlp
    except ModelConfigError:
        return None
    cfg = text_config(config)
    if layout is None or cfg.get("hidden_size") is None:
        return None
    inter, act = layout.intermediate_size(cfg), layout.epilogue_act(cfg)
    if inter is None or act is None:
        return None
    return required(cfg, "hidden_size"), inter, act, layout.bias(cfg)


def epilogue_keys(config: dict, tp: int, ms: Iterable[int], dtype: torch.dtype) -> list[EpilogueKey]:
    """The epilogue-family keys of such a model at token counts `ms`: up as GEMM + bias + act (its
    columns split over tp ranks), down as GEMM + bias (rows split; with tp > 1 the bias follows the
    all-reduce, so the GEMM has none)."""
    shape = mlp_shape(config)
    if shape is None:
        return []
    hidden, inter, act, bias = shape
    i_rank = split(inter, tp, "the MLP's intermediate size")
    out = []
    for m in ms:
        out.append(EpilogueKey(m, i_rank, hidden, bias, dtype, dtype, act))
        out.append(EpilogueKey(m, hidden, i_rank, bias and tp == 1, dtype, dtype))
    return out


def _weight_shapes(config: dict, tp: int, lm_head: bool = True) -> list[tuple[int, int]]:
    """The distinct (N, K) of the model's linear layers (lm_head's among them unless lm_head=False)."""
    return list(dict.fromkeys((s.N, s.K) for s in model_gemms(config, tp) if lm_head or s.name != "lm_head"))


def _quant_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 8-bit type a model's GEMMs are tuned for: its own when quantized, else fp8."""
    return dtype if formats.is_quant_dtype(dtype) else formats.FP8


def _a8w8_keys(config, tp, ms, dtype, lm_head: bool = True) -> list[QuantKey]:
    q = _quant_dtype(dtype)
    return [QuantKey(m, n, k, q, "per_token", False, torch.bfloat16) for n, k in _weight_shapes(config, tp, lm_head)
            for m in ms]  # fmt: skip


def _blockscale_keys(config, tp, ms, dtype, lm_head: bool = True) -> list[BlockKey]:
    q = _quant_dtype(dtype)
    return [BlockKey(m, n, k, q, torch.bfloat16) for n, k in _weight_shapes(config, tp, lm_head)
            if k % formats.BLOCK == 0 for m in ms]  # fmt: skip


def _batched_keys(config, tp, ms, dtype) -> list[BatchedKey]:
    return [BatchedKey(s.B, m, s.N, s.K, dtype, dtype, False, s.transB) for s in batched_gemms(config, tp)
            for m in ms]  # fmt: skip


def _fmoe_keys(config, tp, ms, dtype, fuse_shared: bool = False) -> list[MoeKey]:
    return moe_keys(config, tp, 1, ms, dtype, fuse_shared=fuse_shared)


# family name -> (config, tp, token counts, dtype) -> the family's keys the model runs
FAMILY_KEYS: dict[str, Callable[[dict, int, Sequence[int], torch.dtype], list]] = {
    "a16w16": lambda config, tp, ms, dtype: gemm_keys(model_gemms(config, tp), ms, dtype),
    "batched": _batched_keys,
    "a8w8": _a8w8_keys,
    "a8w8_bpreshuffle": _a8w8_keys,
    "a8w8_blockscale": _blockscale_keys,
    "a8w8_blockscale_bpreshuffle": _blockscale_keys,
    "fmoe": _fmoe_keys,
    "epilogue": epilogue_keys,
}
# Families whose keys are the model's linear layers run 8-bit: their derivers take lm_head=.
QUANT_LINEAR_FAMILIES = tuple(f for f, derive in FAMILY_KEYS.items() if derive in (_a8w8_keys, _blockscale_keys))
# Families a model runs besides its linear layers (the others run the same linear layers another way:
# quantized, fused epilogue).
OWN_GEMMS = ("batched", "fmoe")


def model_keys(family: str, config: dict, tp: int, ms: Sequence[int], dtype: torch.dtype, **options) -> list:
    """The keys of `family` one TP rank of the model runs at token counts `ms` (empty when it runs none,
    or gemmtune derives none for that family); `options` go to the family's deriver (fmoe: fuse_shared)."""
    derive = FAMILY_KEYS.get(family)
    return derive(config, tp, list(ms), dtype, **options) if derive else []


MAX_TOKENS = 1 << 24  # a token count beyond this is a typo, not a GEMM anyone runs (16M tokens)


def parse_nsets(text: str) -> list[int]:
    """'1,16,256' or '32..8192' (powers of two between) or a mix -> sorted unique token counts in
    [1, MAX_TOKENS]; ValueError naming the bad part for an empty item, a bad number or range."""
    out: set[int] = set()
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and parts[-1] == "":
        parts.pop()  # a trailing comma is harmless
    for part in parts:
        try:
            if not part:
                raise ValueError
            if ".." in part:
                lo, hi = (int(v) for v in part.split("..", 1))
                if not 1 <= lo <= hi <= MAX_TOKENS:
                    raise ValueError
                m = lo
                while m <= hi:
                    out.add(m)
                    m *= 2
            else:
                v = int(part)
                if not 1 <= v <= MAX_TOKENS:
                    raise ValueError
                out.add(v)
        except ValueError:
            raise ValueError(f"bad token count {part!r} in {text!r} (integers 1..{MAX_TOKENS}, or LO..HI)") from None
    if not out:
        raise ValueError(f"no token counts in {text!r}")
    return sorted(out)
