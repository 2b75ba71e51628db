"""The split-KV decode attention kernel (kernels/decode_attention.py) and where the sdpa tier runs it
(models/attention.py: decode with transformers' boolean mask, or one token without one).

Kernel cases against the fp32 reference, outputs NaN-poisoned: GQA groups of 1..8 heads, 1..16 query
tokens, odd head sizes and key counts, a mask broadcast over the batch and one per sequence, a row that
sees no key (0), no mask, q / k / v as strided views (the fused q/k/v output's), one and many splits,
fp32/fp16 under Triton's interpreter, bf16 on the GPU at Llama-3-8B / Qwen2-MoE decode shapes; the
arrival counters left zero; a CUDA graph's replays bit-equal to the eager call."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import (
    assert_replays_bit_equal,
    assert_split_attention_ok,
    kernel_results,
    nan_outputs,
    split_attention_facts,
)

from gemmtune import settings
from gemmtune.errors import EnvVarError
from gemmtune.kernels import decode_attention as kdec

HAS_GPU = torch.cuda.is_available()

# (B, Hq, Hkv, L, S, mask keys (0: no mask), D, dtype, mask "batch" | "shared" | "none", views "contig" | "strided")
CASES = [
    (2, 4, 2, 1, 100, 110, 32, "float32", "batch", "contig"),
    (1, 2, 2, 3, 70, 70, 16, "float16", "shared", "strided"),
    (3, 8, 1, 1, 200, 0, 64, "float32", "none", "strided"),
    (2, 3, 3, 2, 5, 8, 24, "float32", "batch", "contig"),  # fewer keys than a block; head size 24
    (1, 8, 1, 16, 129, 129, 8, "float16", "batch", "contig"),  # 8 x 16 = 128 rows, keys over 3 blocks
]
GPU_CASES = [
    (8, 32, 8, 1, 1040, 1040, 128, "bfloat16", "shared", "strided"),  # Llama-3-8B decode, static cache
    (8, 16, 16, 1, 1040, 1040, 128, "bfloat16", "batch", "strided"),  # Qwen2-MoE
    (1, 32, 4, 4, 4097, 4100, 128, "bfloat16", "batch", "contig"),  # Qwen3-30B-A3B, 4 speculative tokens
    (2, 8, 2, 1, 33, 0, 256, "bfloat16", "none", "contig"),
]


def inputs(case, device):
    B, Hq, Hkv, L, S, Sm, D, dt, how, views = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    dtype = getattr(torch, dt)
    if views == "strided":  # [B, L|S, H, D] projections read as [B, H, L|S, D]
        q = torch.randn(B, L, Hq, D + 3, generator=g)[..., :D].transpose(1, 2)
        kv = torch.randn(B, S, Hkv, 2 * D, generator=g)
        k, v = kv[..., :D].transpose(1, 2), kv[..., D:].transpose(1, 2)
    else:
        q, k, v = (torch.randn(B, H, n, D, generator=g) for H, n in ((Hq, L), (Hkv, S), (Hkv, S)))
    mask = None
    if how != "none":
        mask = torch.rand(B if how == "batch" else 1, 1, L, Sm, generator=g) > 0.3
        mask[0, 0, 0, :] = False  # a row that sees no key
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731 (keeps the views' strides)
    return move(q), move(k), move(v), None if mask is None else mask.to(device), D**-0.5


def run_cases(cases, device) -> dict:
    out = {}
    for case in cases:
        q, k, v, mask, scale = inputs(case, device)
        counters = torch.zeros(q.shape[0] * k.shape[1], dtype=torch.int32, device=device)
        with nan_outputs(kdec):
            y = kdec.decode_attention(q, k, v, mask, scale, counters)
        ref = kdec.decode_attention_ref(q.float(), k.float(), v.float(), mask, scale)
        shape = (q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        out[repr(case)] = split_attention_facts(y, ref, shape, q.dtype, mask, counters)
        out[repr(case)]["splits"] = kdec.splits_for(q.shape[0] * k.shape[1], k.shape[2])
    return out


def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.fixture(scope="module")
def res():
    return results()


@pytest.mark.parametrize("case", CASES + (GPU_CASES if HAS_GPU else []), ids=repr)
def test_decode_attention_matches_fp32_reference(case, res):
    assert_split_attention_ok(res[repr(case)], case[7])


def test_cases_cover_one_and_many_splits(res):
    splits = {res[repr(c)]["splits"] for c in CASES}
    assert 1 in splits and max(splits) > 1, splits


def test_decode_attention_refuses_what_it_does_not_compute():
    q, k = torch.zeros(1, 4, 1, 8), torch.zeros(1, 2, 5, 8)
    assert "beyond the decode kernel" in kdec.takes(torch.zeros(1, 4, 17, 8), k, k, None)
    assert "does not fit" in kdec.takes(torch.zeros(1, 3, 1, 8), k, k, None)
    assert "is not a boolean [B|1, 1, 1, >=5] mask" in kdec.takes(q, k, k, torch.zeros(1, 1, 1, 5))
    assert "is not a boolean" in kdec.takes(q, k, k, torch.ones(1, 1, 1, 4, dtype=torch.bool))
    assert kdec.takes(q, k, k, torch.ones(1, 1, 1, 9, dtype=torch.bool)) == ""
    with pytest.raises(ValueError, match="decode_attention: dtypes differ"):
        kdec.decode_attention(q, k.half(), k.half(), None, 1.0, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="counters must be int32 with >= 2 elements"):
        kdec.decode_attention(q, k, k, None, 1.0, torch.zeros(1, dtype=torch.int32))


def test_reference_is_sdpa_with_the_mask():
    """decode_attention_ref against torch's SDPA (GQA repeated) where some key is seen by every row."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((2, 4, 3, 16), (2, 2, 20, 16), (2, 2, 20, 16)))
    mask = torch.rand(2, 1, 3, 24, generator=g) > 0.5
    mask[..., 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask[..., :20], scale=0.2
    )
    torch.testing.assert_close(kdec.decode_attention_ref(q, k, v, mask, 0.2), want.transpose(1, 2))


# ---- routing (CPU: the reference stands in for the kernel) -------------------------------------------
@pytest.fixture
def decode_on_cpu(monkeypatch):
    """Let the sdpa tier pick the decode kernel on the CPU in fp32, the reference computing it; record
    each call that reaches it as (query tokens, keys, masked)."""
    pytest.importorskip("transformers")
    from gemmtune.models import attention as attn_mod

    monkeypatch.setattr(attn_mod, "DECODE_KERNEL", "triton")
    monkeypatch.setattr(attn_mod, "DECODE_VENDORS", ("nvidia", "cpu"))
    monkeypatch.setattr(attn_mod, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    calls = []

    def spy(q, k, v, mask, scale, counters, check=True):
        assert not check  # the routing checked the call (kdec.takes) and does not have it checked twice
        calls.append((q.shape[2], k.shape[2], mask is not None))
        assert counters.dtype == torch.int32 and counters.numel() >= q.shape[0] * k.shape[1]
        return kdec.decode_attention_ref(q, k, v, mask, scale)

    monkeypatch.setattr(attn_mod.kdecode, "decode_attention", spy)
    return attn_mod, calls


def test_static_cache_decode_goes_to_the_kernel(decode_on_cpu):
    """Llama (GQA 4:2) optimize()d, decoding on a StaticCache: every decode step of every layer takes the
    kernel (the mask hides the cache's unwritten positions), the prefill does not; logits as stock's."""
    attn_mod, calls = decode_on_cpu
    from test_models_parity import build
    from transformers import StaticCache

    import gemmtune
    from gemmtune.models.hf_cache import with_cache

    stock, opt = build("llama"), build("llama")
    gemmtune.optimize(opt)
    calls.clear()  # (optimize()'s own cached-path check decodes on a DynamicCache)
    caches = [StaticCache(config=m.config, max_cache_len=20) for m in (stock, opt)]
    ids = torch.randint(3, 200, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for step in range(3):
            x = ids if step == 0 else ids[:, step : step + 1]
            pos = torch.arange(7) if step == 0 else torch.tensor([6 + step])
            a = stock(x, **with_cache(stock, caches[0]), use_cache=True, cache_position=pos).logits
            b = opt(x, **with_cache(opt, caches[1]), use_cache=True, cache_position=pos).logits
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    layers = opt.config.num_hidden_layers
    assert calls == [(1, 20, True)] * (2 * layers), calls  # the two decode steps; the 7-token prefill not


def test_decode_kernel_is_left_out_where_it_does_not_apply(decode_on_cpu):
    attn_mod, calls = decode_on_cpu
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    mod = type("Attn", (), {"is_causal": True, "training": False})()
    mask = torch.ones(1, 1, 1, 12, dtype=torch.bool)
    attn_mod.sdpa_attention(mod, q, k, k, mask)
    attn_mod.sdpa_attention(mod, q, k, k, None)  # one token, no mask: every key
    assert calls == [(1, 12, True), (1, 12, False)]
    calls.clear()
    attn_mod.sdpa_attention(mod, torch.randn(1, 4, 2, 16, generator=g), k, k, None)  # causal without a mask
    attn_mod.sdpa_attention(mod, q, k, k, torch.zeros(1, 1, 1, 12))  # an additive mask
    attn_mod.sdpa_attention(mod, q, k, k, mask, dropout=0.1)
    attn_mod.sdpa_attention(type("Attn", (), {"is_causal": True, "training": True})(), q, k, k, mask)
    attn_mod.sdpa_attention(mod, q.requires_grad_(), k, k, mask)
    attn_mod.set_decode_kernel("sdpa")
    attn_mod.sdpa_attention(mod, q.detach(), k, k, mask)
    assert calls == []
    with pytest.raises(ValueError, match="decode attention mode 'x': expected one of sdpa, triton"):
        attn_mod.set_decode_kernel("x")


def test_decode_kernel_setting(monkeypatch):
    pytest.importorskip("transformers")

    def read():
        return settings.DECODE_ATTENTION.get()

    monkeypatch.delenv("GEMMTUNE_DECODE_ATTENTION", raising=False)
    assert read() == "triton"
    monkeypatch.setenv("GEMMTUNE_DECODE_ATTENTION", "SDPA")
    assert read() == "sdpa"
    monkeypatch.setenv("GEMMTUNE_DECODE_ATTENTION", "flash")
    with pytest.raises(EnvVarError, match="GEMMTUNE_DECODE_ATTENTION='flash': expected one of sdpa, triton"):
        read()


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager(gpu):
    q, k, v, mask, scale = inputs(GPU_CASES[0], gpu)
    counters = torch.zeros(q.shape[0] * k.shape[1], dtype=torch.int32, device=gpu)
    with nan_outputs(kdec):
        eager = kdec.decode_attention(q, k, v, mask, scale, counters)
        assert_replays_bit_equal(lambda *a: kdec.decode_attention(*a, scale, counters), (q, k, v, mask), eager,
                                 "decode_attention")  # fmt: skip
    assert not counters.any()


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
