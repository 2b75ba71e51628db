"""optimize() vs stock transformers: same logits (padded batches, with and without KV cache) and the
same greedy tokens, for every supported architecture and every attention tier (CPU, fp32; GPU, bf16)."""

from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiers import tiered, tiered_at  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.models import attention as attn_mod  # noqa: E402
from gemmtune.models.hf_cache import cache_of, with_cache  # noqa: E402
from gemmtune.models.version import MAX_EXCLUSIVE, MIN_VERSION, _parse  # noqa: E402

if not (MIN_VERSION <= _parse(transformers.__version__) < MAX_EXCLUSIVE):
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range", allow_module_level=True)

# The sizes of tests/data/models/tiny-llama.json; each architecture is built with them in its own config class
# (which sets its own model type, activation and dtype).
_TINY_FILE = pathlib.Path(__file__).resolve().parent / "data" / "models" / "tiny-llama.json"
_NOT_SIZES = ("architectures", "model_type", "hidden_act", "torch_dtype")
TINY = {k: v for k, v in json.loads(_TINY_FILE.read_text()).items() if k not in _NOT_SIZES}
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(arch: str):
    """The tiny-llama shape in each architecture's own config class."""
    t = transformers
    base = {**TINY, **_IDS}
    if arch == "llama":
        return t.LlamaConfig(**base)
    if arch == "mistral":
        return t.MistralConfig(**base, sliding_window=6)
    if arch == "qwen2":
        return t.Qwen2Config(**base)  # q/k/v carry biases
    if arch == "qwen3":
        return t.Qwen3Config(**base)
    if arch == "gemma":
        return t.GemmaConfig(**base, hidden_act="gelu_pytorch_tanh")
    if arch == "gemma2":
        return t.Gemma2Config(
            **base,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            sliding_window=6,
        )
    if arch == "gemma3":
        return t.Gemma3TextConfig(
            **base, query_pre_attn_scalar=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
        )
    if arch == "phi3":
        return t.Phi3Config(**base, partial_rotary_factor=0.5)
    if arch == "mixtral":
        return t.MixtralConfig(**base, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2
        )
    raise KeyError(arch)


ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe"]


def build(arch: str, device="cpu", dtype=torch.float32, seed=0):
    return build_from(tiny_config(arch), device, dtype, seed)


def build_from(config, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
    with torch.no_grad():  # random norm weights and biases, so (1+w) and bias handling are exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.normal_(0.0, 0.2)
    return model


def batch(device="cpu", b=3, s=11, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (b, s), generator=g).to(device)
    mask = torch.ones(b, s, dtype=torch.long, device=device)
    mask[1, :4] = 0  # left padding
    mask[2, :7] = 0
    return ids, mask


def pair(arch, device="cpu", dtype=torch.float32, **opts):
    stock = build(arch, device, dtype)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt, **opts)
    return stock, opt, report


NEW_TOKENS = 16


def check_parity(stock, opt, device="cpu", rtol=1e-4, atol=1e-5):
    ids, mask = batch(device)
    valid = mask.bool()
    with torch.no_grad():
        # no cache, padded batch
        a = stock(ids, attention_mask=mask, use_cache=False).logits
        b = opt(ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(b[valid], a[valid], rtol=rtol, atol=atol)
    # greedy generation with the KV cache: the same tokens
    ga = stock.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    gb = opt.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert ga.shape[1] == ids.shape[1] + NEW_TOKENS
    assert torch.equal(ga, gb), f"greedy tokens differ:\n{ga}\n{gb}"
    # teacher-forced cached decode of stock's tokens: per-step logits (q_len != k_len on every step)
    full = torch.cat([mask, torch.ones_like(ga[:, ids.shape[1] :])], dim=1)
    n = ids.shape[1]
    with torch.no_grad():
        oa = stock(ids, attention_mask=mask, use_cache=True)
        ob = opt(ids, attention_mask=mask, use_cache=True)
        torch.testing.assert_close(ob.logits[valid], oa.logits[valid], rtol=rtol, atol=atol)
        for t in range(n, ga.shape[1]):
            step = dict(input_ids=ga[:, t : t + 1], attention_mask=full[:, : t + 1], use_cache=True)
            oa = stock(**step, **with_cache(stock, cache_of(oa)))
            ob = opt(**step, **with_cache(opt, cache_of(ob)))
            torch.testing.assert_close(
                ob.logits, oa.logits, rtol=rtol, atol=atol, msg=lambda m, s=t - n: f"step {s}: {m}"
            )


# The default test tier: one architecture of each layout (pre-norm, sandwich with softcap, q/k norms,
# no fusion, MoE); the slow tier (and CI's model legs) run every one.
DEFAULT_TIER_ARCHS = {"llama", "qwen3", "gemma2", "phi3", "qwen3_moe"}


@pytest.mark.parametrize("arch", tiered(ARCHITECTURES, DEFAULT_TIER_ARCHS.__contains__))
def test_architecture_parity_default(arch):
    stock, opt, report = pair(arch)
    counts = report.counts()
    assert counts["norm"] >= 5 and counts["route"] >= 1, report.summary()
    if arch != "phi3":
        assert counts["fuse"] >= 2, report.summary()  # q/k/v per layer (+ gate/up where dense)
    check_parity(stock, opt)


_FORCED_ARCHS, _TIERS = ["llama", "qwen2", "gemma2", "gemma3", "phi3", "qwen3_moe"], ["eager", "sdpa", "flash"]


# In the default test tier each architecture is forced to one attention tier, the attention tiers in
# turn; test_architecture_parity_default checks every architecture under the tier optimize() picks.
@pytest.mark.parametrize(
    "arch_tier",
    tiered(
        [(a, t) for a in _FORCED_ARCHS for t in _TIERS],
        lambda at: _TIERS.index(at[1]) == _FORCED_ARCHS.index(at[0]) % len(_TIERS),
    ),
    ids="-".join,
)
def test_architecture_parity_forced_tier(arch_tier, monkeypatch):
    arch, tier = arch_tier
    if tier == "flash" and (attn_mod.flash_backend() is None or not torch.cuda.is_available()):
        pytest.skip("flash tier needs flash-attn / aiter on a GPU")
    monkeypatch.setenv(attn_mod.ENV, tier)
    stock, opt, report = pair(arch)
    assert report.attention_tier == tier
    assert opt.config._attn_implementation == attn_mod.NAMES[tier]
    check_parity(stock, opt)


@pytest.mark.parametrize(
    "opts", tiered_at([{"fuse_qkv": False}, {"fuse_gate_up": False}, {"fused_ops": False}, {"attention": None}], {2})
)
def test_option_subsets_keep_parity(opts):
    stock, opt, _ = pair("qwen3", **opts)
    check_parity(stock, opt)


def test_moe_experts_go_to_fused_moe_and_restore():
    stock, opt, report = pair("qwen3_moe")
    layer1 = opt.model.layers[1]  # decoder_sparse_step=2: layer 1 is sparse, layer 0 dense
    assert "forward" not in layer1.mlp.__dict__  # the block (router) stays stock
    assert "forward" in layer1.mlp.experts.__dict__  # its experts run gemmtune.fused_moe
    assert not any("_gemmtune_route" in m.__dict__ for m in layer1.mlp.modules())
    assert hasattr(opt.model.layers[0].mlp, "gate_up_proj")  # the dense layer is fused
    assert report.counts().get("moe") == 1
    gemmtune.restore(opt)
    assert "forward" not in layer1.mlp.experts.__dict__


# ---- q_norm / k_norm + rope in one kernel --------------------------------------------------------
QK_ARCHITECTURES = ["qwen3", "qwen3_moe", "gemma3"]


def _count_attention_ops(monkeypatch) -> dict:
    """Count the calls (one Triton launch each on the GPU) of the per-head norms, rope and the fused op."""
    from gemmtune.models import architectures

    counts = {"head_rmsnorm": 0, "rope": 0, "qk_norm_rope": 0}

    def counting(name, fn, per_head=False):
        def wrapped(x, *args, **kwargs):
            if not per_head or x.dim() == 4:  # q / k norms see [B, S, H, D]; layer norms [B, S, hidden]
                counts[name] += 1
            return fn(x, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(architectures, "rmsnorm", counting("head_rmsnorm", architectures.rmsnorm, per_head=True))
    monkeypatch.setattr(architectures, "rope", counting("rope", architectures.rope))
    monkeypatch.setattr(architectures, "qk_norm_rope", counting("qk_norm_rope", architectures.qk_norm_rope))
    return counts


def _qk_pair(arch, layers, monkeypatch, device="cpu", dtype=torch.float32):
    """(stock, fused, unfused): optimize() with q_norm/k_norm + rope fused, and with it turned off."""
    from gemmtune.models import dense

    monkeypatch.setitem(TINY, "num_hidden_layers", layers)
    stock, fused, report = pair(arch, device, dtype)
    assert "q_norm/k_norm + rope in one kernel" in report.summary(), report.summary()
    with monkeypatch.context() as m:
        m.setattr(dense, "_qk_norms_fusable", lambda *a: None)
        unfused = copy.deepcopy(stock)
        rep = gemmtune.optimize(unfused)
    assert "q_norm/k_norm + rope" not in rep.summary() and "fused rope kernel" in rep.summary()
    return stock, fused, unfused


# gemma3: 2 layer_types
@pytest.mark.parametrize(
    "arch, n", [("qwen3", 4), *(pytest.param(*c, marks=pytest.mark.slow) for c in [("qwen3_moe", 4), ("gemma3", 2)])]
)
def test_qk_norm_rope_saves_two_launches_per_layer(arch, n, monkeypatch):
    stock, fused, unfused = _qk_pair(arch, n, monkeypatch)
    counts = _count_attention_ops(monkeypatch)
    ids, mask = batch()
    with torch.no_grad():
        a = fused(ids, attention_mask=mask, use_cache=False).logits
        per_fused = dict(counts)
        counts.update(dict.fromkeys(counts, 0))
        b = unfused(ids, attention_mask=mask, use_cache=False).logits
        want = stock(ids, attention_mask=mask, use_cache=False).logits
    assert per_fused == {"head_rmsnorm": 0, "rope": 0, "qk_norm_rope": n}, per_fused  # n launches
    assert counts == {"head_rmsnorm": 2 * n, "rope": n, "qk_norm_rope": 0}, counts  # 3 n launches
    assert torch.equal(a, b)  # off the GPU the fused op runs today's ops: the same bits
    torch.testing.assert_close(a[mask.bool()], want[mask.bool()], rtol=1e-4, atol=1e-5)


# ---- GPU: bf16 parity ----------------------------------------------------------------------------
# bf16 tolerance: the fused kernels round once where torch rounds per op, and one GEMM over [q;k;v]
# may pick another cuBLAS kernel than three; logits of these tiny random models are O(1), so an
# absolute 3e-2 / relative 3e-2 bound is a few bf16 ulps. Greedy tokens can flip on near-ties, so on
# GPU the token check compares the first generated token only through logits (check_parity_bf16).
def check_parity_bf16(stock, opt, device):
    ids, mask = batch(device)
    valid = mask.bool()
    with torch.no_grad():
        a = stock(ids, attention_mask=mask, use_cache=False).logits.float()
        b = opt(ids, attention_mask=mask, use_cache=False).logits.float()
        torch.testing.assert_close(b[valid], a[valid], rtol=3e-2, atol=3e-2)
        n = ids.shape[1] - 2
        oa = stock(ids[:, :n], attention_mask=mask[:, :n], use_cache=True)
        ob = opt(ids[:, :n], attention_mask=mask[:, :n], use_cache=True)
        sa = stock(ids[:, n : n + 1], attention_mask=mask[:, : n + 1], **with_cache(stock, cache_of(oa)))
        sb = opt(ids[:, n : n + 1], attention_mask=mask[:, : n + 1], **with_cache(opt, cache_of(ob)))
        torch.testing.assert_close(sb.logits.float(), sa.logits.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_architecture_parity_bf16_gpu(arch, gpu):
    stock, opt, _ = pair(arch, device=gpu, dtype=torch.bfloat16)
    check_parity_bf16(stock, opt, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", QK_ARCHITECTURES)
def test_qk_norm_rope_matches_unfused_bf16_gpu(arch, gpu, monkeypatch):
    stock, fused, unfused = _qk_pair(arch, 2, monkeypatch, gpu, torch.bfloat16)
    counts = _count_attention_ops(monkeypatch)
    ids, mask = batch(gpu)
    with torch.no_grad():
        a = fused(ids, attention_mask=mask, use_cache=False).logits.float()
        b = unfused(ids, attention_mask=mask, use_cache=False).logits.float()
    assert counts["qk_norm_rope"] == 2 and counts["rope"] == 2, counts
    # same arithmetic; only a norm's fp32 row sum may be ordered differently (one rounding, rarely)
    torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    check_parity_bf16(stock, fused, gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["eager", "sdpa", "flash"])
def test_tier_parity_bf16_gpu(tier, gpu, monkeypatch):
    if tier == "flash" and attn_mod.flash_backend() is None:
        pytest.skip("flash-attn / aiter not installed")
    monkeypatch.setenv(attn_mod.ENV, tier)
    stock, opt, _ = pair("llama", device=gpu, dtype=torch.bfloat16)
    check_parity_bf16(stock, opt, gpu)


@pytest.mark.parametrize("mode", attn_mod.MASKED_DECODE_MODES)
def test_masked_decode_modes_keep_parity(mode, monkeypatch):
    monkeypatch.setattr(attn_mod, "MASKED_DECODE", mode)  # padded decode steps take the masked path
    stock, opt, _ = pair("llama")
    check_parity(stock, opt)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", attn_mod.MASKED_DECODE_MODES)
def test_masked_decode_modes_bf16_gpu(mode, gpu, monkeypatch):
    monkeypatch.setattr(attn_mod, "MASKED_DECODE", mode)
    stock, opt, _ = pair("qwen2", device=gpu, dtype=torch.bfloat16)
    check_parity_bf16(stock, opt, gpu)
