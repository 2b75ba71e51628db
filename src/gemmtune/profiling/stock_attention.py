"""Features a model's config asks of attention that its stock attention implementation leaves out.

transformers 5.17 runs Gemma-2 with attn_implementation "sdpa", whose integration drops the `softcap`
argument without a word (later releases refuse sdpa for Gemma-2): stock then computes another function
than the one the config describes, and a speed comparison against it says so in a note. Found by
calling the implementation itself on a probe, with and without a softcap that must change its output.
"""

from __future__ import annotations

import torch

_PROBE_CAP = 1.0  # probe scores are O(10): a cap of 1 changes every output


def _attention_module(model):
    for mod in model.modules():
        if hasattr(mod, "attn_logit_softcapping") and hasattr(mod, "num_key_value_groups"):
            return mod
    return None


def ignores_softcap(fn, module, device, dtype, head_dim: int) -> bool:
    """True when attention function `fn` returns the same output with and without a softcap."""
    g = torch.Generator(device="cpu").manual_seed(0)
    groups = int(getattr(module, "num_key_value_groups", 1))
    q = (torch.randn(1, groups, 5, head_dim, generator=g) * 3).to(device=device, dtype=dtype)
    k = (torch.randn(1, 1, 5, head_dim, generator=g) * 3).to(device=device, dtype=dtype)
    v = torch.randn(1, 1, 5, head_dim, generator=g).to(device=device, dtype=dtype)
    try:
        with torch.no_grad():
            capped = fn(module, q, k, v, None, dropout=0.0, scaling=head_dim**-0.5, softcap=_PROBE_CAP)[0]
            plain = fn(module, q, k, v, None, dropout=0.0, scaling=head_dim**-0.5)[0]
    except Exception:  # noqa: BLE001 - an implementation that refuses softcap does not ignore it silently
        return False
    return torch.equal(capped, plain)


def ignored_features(model) -> list[str]:
    """Notes, one per config feature the model's stock attention implementation ignores (softcap)."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cap = getattr(cfg, "attn_logit_softcapping", None)
    impl = getattr(model.config, "_attn_implementation", None)
    module = _attention_module(model)
    if not cap or impl in (None, "eager") or module is None:
        return []
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    fn = ALL_ATTENTION_FUNCTIONS.get(impl)
    if fn is None:
        return []
    p = next(model.parameters())
    head_dim = getattr(module, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if not ignores_softcap(fn, module, p.device, p.dtype, head_dim):
        return []
    return [
        f"stock attention implementation {impl!r} ignores attn_logit_softcapping={cap} (transformers "
        f"{transformers.__version__} drops the softcap argument): stock computes attention without the "
        "softcap, not the function the config asks for (optimize() applies it)"
    ]
