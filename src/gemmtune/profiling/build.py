"""A Hugging Face causal LM with random weights from a preset or a config.json (nothing downloaded)."""

from __future__ import annotations

import torch

from ..tuner.model_shapes import ModelConfigError, load_model_config, text_config

# config.json keys that describe a checkpoint or loading, not the architecture
_DROP = ("torch_dtype", "dtype", "architectures", "auto_map", "quantization_config", "transformers_version",
         "_name_or_path", "use_cache")  # fmt: skip


def parameter_count(n: int) -> str:
    """1.91 B, 8.45 M, 37.1 k: three significant figures in the largest unit that keeps one before the point."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if float(f"{n / scale:.3g}") >= 1:  # rounded first: 999_999 is 1 M, not 1e+03 k
            return f"{float(f'{n / scale:.3g}'):g} {unit}"
    return str(n)


def architecture(model: str | dict, layers: int | None = None) -> tuple[dict, str]:
    """(config dict of the language model, source) for a preset name, config.json, folder or dict (a
    multimodal config gives its text_config)."""
    config, source = (dict(model), "config dict") if isinstance(model, dict) else load_model_config(model)
    cfg = {k: v for k, v in text_config(config).items() if k not in _DROP}
    if "model_type" not in cfg:
        raise ModelConfigError(f"{source}: the config has no model_type")
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        full = cfg.get("num_hidden_layers")
        cfg["num_hidden_layers"] = layers
        if isinstance(cfg.get("layer_types"), list):  # per-layer attention kinds (Gemma 2/3, Qwen 3 ...)
            cfg["layer_types"] = cfg["layer_types"][:layers]
        _keep_dense_share(cfg, full, layers)
    return cfg, source


def _keep_dense_share(cfg: dict, full_layers, layers: int) -> None:
    """A model whose first first_k_dense_replace layers are dense and the rest MoE (DeepSeek-V3: 3 of 61)
    keeps its share of dense layers when cut to `layers` (at least one of each kind from 2 layers on): its
    first 4 layers alone would be 3 dense and 1 MoE, a model that is mostly dense GEMMs where the real one
    is mostly experts."""
    dense = cfg.get("first_k_dense_replace")
    if not (isinstance(dense, int) and isinstance(full_layers, int) and 0 < dense < full_layers > layers):
        return
    if layers < 2:
        cfg["first_k_dense_replace"] = min(dense, layers)
        return
    cfg["first_k_dense_replace"] = max(1, min(layers - 1, round(dense * layers / full_layers)))


def build_model(
    model: str | dict,
    layers: int | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
):
    """(model in eval mode with random weights, description) for a preset, config.json or config dict.

    dtype defaults to bfloat16 on a GPU and float32 on the CPU.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, source = architecture(model, layers)
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    mt = cfg.pop("model_type")
    try:
        config = AutoConfig.for_model(mt, **cfg)
    except (ValueError, KeyError) as exc:
        raise ModelConfigError(f"{source}: transformers cannot build model_type {mt!r}: {exc}") from None
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(seed)
            net = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    net = net.to(dtype=dtype).eval()
    n_params = sum(p.numel() for p in net.parameters())
    dense = cfg.get("first_k_dense_replace")
    mix = f" ({dense} dense, {config.num_hidden_layers - dense} MoE)" if isinstance(dense, int) else ""
    desc = (f"{source}: {mt}, {config.num_hidden_layers} layers{mix}, {parameter_count(n_params)} parameters, "
            f"random weights, {str(dtype).replace('torch.', '')}")  # fmt: skip
    return net, desc
