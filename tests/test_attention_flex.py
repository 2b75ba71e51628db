"""The flex attention tier: which tier a model gets and why (the report line), flex_attention's score and
mask functions against an fp64 reference of the eager softcap formula (odd shapes, GQA, sliding window,
padding), Gemma-2 through optimize() against stock eager attention (CPU with flex allowed there; GPU
bf16 eager, torch.compile and CUDA-graph decode), and bench-model's note on stock ignoring softcap."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_parity import build, tiny_config  # noqa: E402
from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.models import attention as attn_mod  # noqa: E402
from gemmtune.models import flex  # noqa: E402
from gemmtune.models.hf_cache import cache_of, with_cache  # noqa: E402
from gemmtune.profiling.stock_attention import ignored_features  # noqa: E402

SOFTCAP = 2.0  # small enough to matter for the scaled-up q/k below (scores of O(10))


def reference(q, k, v, mask, softcap, scale):
    """transformers' eager formula in fp64: repeat_kv, scale, softcap, mask, softmax, @ v -> [B, L, H, D]."""
    q, k, v = q.double(), k.double(), v.double()
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
    w = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    return (torch.softmax(w, -1) @ v).transpose(1, 2)


def qkv(b, hq, hkv, q_len, kv_len, d, device="cpu", dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, q_len, d, generator=g) * 2
    k = torch.randn(b, hkv, kv_len, d, generator=g) * 2
    v = torch.randn(b, hkv, kv_len, d, generator=g)
    return (t.to(device=device, dtype=dtype) for t in (q, k, v))


def hf_mask(b, q_len, kv_len, window=None, pad=(), device="cpu"):
    """transformers' own boolean mask: queries at the last q_len of kv_len positions, left padding."""
    attn = torch.ones(b, kv_len, dtype=torch.bool, device=device)
    for row, n in enumerate(pad):
        attn[row, :n] = False
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(batch_size=b, q_length=q_len, kv_length=kv_len, q_offset=kv_len - q_len, mask_function=fn,
                     attention_mask=attn, allow_is_causal_skip=False, device=device)  # fmt: skip


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """Let flex run on the CPU: unfused (flex_attention uncompiled) unless a test compiles it."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "FUSED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex, "_compiled_cache", [flex_attention])
    monkeypatch.setattr(flex, "_warm", set())
    monkeypatch.setattr(flex, "_failed", {})
    monkeypatch.setattr(flex, "_CAUSAL_BLOCKS", {})
    monkeypatch.setattr(flex, "_TENSOR_BLOCKS", {})
    monkeypatch.setattr(flex, "_PLAIN", {})
    return flex


# ---- routing -------------------------------------------------------------------------------------
@pytest.fixture
def no_flash(monkeypatch):
    monkeypatch.delenv(attn_mod.ENV, raising=False)
    monkeypatch.setattr(attn_mod, "_flash_cache", [None])


def test_auto_tier_per_model_and_device(no_flash, monkeypatch):
    assert attn_mod.resolve_tier("auto", None, "cpu") == ("sdpa", "auto")
    assert attn_mod.resolve_tier("auto", None, "cuda")[0] == "sdpa"
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cuda")
    assert tier == "triton" and "softcap 50.0, flash-attn not installed" in note
    assert f"masked prefill runs the Triton kernel with the mask, calls of < {attn_mod.KERNEL_MIN_Q} query tokens "\
           "(decode) run the eager tier" in note  # fmt: skip
    monkeypatch.setattr(attn_mod, "KERNEL_MASKED", False)
    assert "masked prefill runs flex_attention" in attn_mod.resolve_tier("auto", 50.0, "cuda")[1]
    monkeypatch.setattr(attn_mod, "KERNEL_MASKED", True)
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cpu")
    assert tier == "eager" and "no Triton or flex tier: flex_attention is fused only on CUDA here (model on cpu)" \
        in note  # fmt: skip
    monkeypatch.setattr(attn_mod, "KERNEL_DEVICES", ())  # no Triton kernel here: flex is next
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cuda")
    assert tier == "flex" and "no Triton tier: gemmtune's Triton attention runs on NVIDIA CUDA only" in note
    assert f"< {flex.FLEX_MIN_Q} query tokens (decode) run the eager tier" in note
    monkeypatch.setattr(gemmtune.device, "triton_installed", lambda: False)
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cuda")
    assert tier == "eager" and "triton is not installed" in note
    monkeypatch.setattr(flex, "_MISSING", "torch 2.4 has no torch.nn.attention.flex_attention (needs >= 2.5)")
    assert "needs >= 2.5" in attn_mod.resolve_tier("auto", 50.0, "cuda")[1]


def test_auto_tier_with_a_flash_backend(monkeypatch):
    monkeypatch.delenv(attn_mod.ENV, raising=False)
    monkeypatch.setattr(attn_mod, "_flash_cache", [("flash_attn", None)])
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cuda")
    assert tier == "flash" and "calls SDPA cannot run go to the Triton kernel for prefill (with or without a " \
        "mask)" in note  # masked calls, and fp32 ones  # fmt: skip
    assert attn_mod.resolve_tier("auto", 50.0, "cpu")[0] == "eager"
    monkeypatch.setattr(attn_mod, "_flash_cache", [("aiter", None)])
    tier, note = attn_mod.resolve_tier("auto", 50.0, "cuda")
    assert tier == "triton" and "aiter has no softcap" in note
    assert attn_mod.resolve_tier("auto", None, "cuda")[0] == "flash"


def test_forced_tiers_say_where_softcap_goes(no_flash, monkeypatch):
    with pytest.raises(ValueError, match="tier 'flex' is not available: flex_attention is fused only on CUDA"):
        attn_mod.resolve_tier("flex", 50.0, "cpu")
    with pytest.raises(ValueError, match="tier 'triton' is not available: gemmtune's Triton attention runs on NVIDIA"):
        attn_mod.resolve_tier("triton", 50.0, "cpu")
    note = attn_mod.resolve_tier("sdpa", 50.0, "cuda")[1]
    assert "softcap 50.0: calls SDPA cannot run go to the Triton kernel for prefill (with or without a mask), the " \
        "eager tier otherwise" in note  # fmt: skip
    monkeypatch.setattr(attn_mod, "KERNEL_MASKED", False)
    assert "the Triton kernel for mask-free prefill, flex_attention for masked prefill, the eager tier otherwise" \
        in attn_mod.resolve_tier("sdpa", 50.0, "cuda")[1]  # fmt: skip
    monkeypatch.setattr(attn_mod, "KERNEL_MASKED", True)
    assert "go to the eager tier" in attn_mod.resolve_tier("sdpa", 50.0, "cpu")[1]
    monkeypatch.setattr(attn_mod, "KERNEL_DEVICES", ())
    note = attn_mod.resolve_tier("sdpa", 50.0, "cuda")[1]
    assert "softcap 50.0: calls SDPA cannot run go to flex_attention for prefill, the eager tier otherwise" in note
    monkeypatch.setattr(attn_mod, "KERNEL_DEVICES", ("cuda",))
    tier, note = attn_mod.resolve_tier("flex", 50.0, "cuda")
    assert "under torch.compile, mask-free prefill runs the Triton kernel" in note
    tier, note = attn_mod.resolve_tier("triton", None, "cuda")
    assert tier == "triton" and "masked prefill runs the Triton kernel with the mask (MASKED_PREFILL)" in note
    monkeypatch.setattr(attn_mod, "MASKED_PREFILL", "sdpa")
    assert "masked prefill runs the sdpa tier" in attn_mod.resolve_tier("triton", None, "cuda")[1]
    monkeypatch.setenv(attn_mod.ENV, "flex")
    tier, note = attn_mod.resolve_tier("auto", None, "cuda")
    assert tier == "flex" and "forced by GEMMTUNE_ATTENTION=flex" in note and "run the sdpa tier" in note
    assert "torch.compile" not in note  # no softcap: compiled calls run SDPA


def test_optimize_report_line_names_tier_and_reason(no_flash):
    report = gemmtune.optimize(build("gemma2"))  # CPU model: flex is not fused here
    line = next(x for x in report.summary().splitlines() if x.strip().startswith("attention:"))
    assert line.strip().startswith("attention: eager tier")
    assert "softcap 50.0, flash-attn not installed; no Triton or flex tier" in line
    assert gemmtune.optimize(build("llama")).attention_tier == "sdpa"


def test_optimize_picks_flex_for_softcap_where_it_runs(no_flash, flex_on_cpu):
    model = build("gemma2")
    report = gemmtune.optimize(model)
    assert report.attention_tier == "flex"
    assert model.config._attn_implementation == attn_mod.NAMES["flex"]
    assert "flex tier via transformers' AttentionInterface (auto: softcap 50.0" in report.summary()


def test_takes_prefill_sized_calls_only(flex_on_cpu):
    q, k, v = qkv(2, 4, 2, flex.FLEX_MIN_Q, 20, 16)
    assert flex.takes(q, k, v, None, 0.0)
    assert not flex.takes(q[:, :, : flex.FLEX_MIN_Q - 1], k, v, None, 0.0)  # decode-sized
    assert not flex.takes(q[:, :, :1], k, v, None, 0.0)
    assert not flex.takes(q, k, v, None, 0.1)  # dropout
    q80, k80, v80 = qkv(2, 4, 2, flex.FLEX_MIN_Q, 20, 80)
    assert not flex.takes(q80, k80, v80, None, 0.0)  # head dim not a power of two
    mask = hf_mask(2, flex.FLEX_MIN_Q, 20)
    assert flex.takes(q, k, v, mask, 0.0)
    assert not flex.takes(q, k, v, mask.float(), 0.0)  # additive masks stay with the other tiers
    assert not flex.takes(q, k, v, mask.expand(2, 4, -1, -1), 0.0)  # per-head masks too
    assert not flex.takes(q, k, v, mask[..., :19], 0.0)  # fewer mask columns than keys
    assert not flex.takes(q.to("meta"), k.to("meta"), v.to("meta"), None, 0.0)  # not a fused device


# ---- the score and mask functions vs the eager formula -------------------------------------------
CASES = [  # b, hq, hkv, q_len, kv_len, window, left padding per row, softcap
    (3, 4, 2, 7, 13, None, (0, 3, 5), SOFTCAP),
    (3, 4, 2, 7, 13, 4, (0, 3, 5), SOFTCAP),
    (2, 6, 2, 13, 13, 5, (0, 4), None),
    (1, 4, 4, 9, 9, None, (), SOFTCAP),
]


@pytest.mark.parametrize("case", CASES)
def test_flex_matches_eager_formula_with_hf_masks(case, flex_on_cpu):
    b, hq, hkv, q_len, kv_len, window, pad, cap = case
    q, k, v = qkv(b, hq, hkv, q_len, kv_len, 16, dtype=torch.float64)
    mask = hf_mask(b, q_len, kv_len, window, pad)
    out = flex.attention(q, k, v, mask, scaling=0.3, softcap=cap, window=window, causal=False)
    want = reference(q, k, v, mask, cap, 0.3)
    rows = mask[:, 0].any(-1)  # fully masked (padding) query rows carry no value
    torch.testing.assert_close(out[rows], want[rows], rtol=1e-9, atol=1e-9)
    capped_away = reference(q, k, v, mask, None if cap else SOFTCAP, 0.3)
    assert (capped_away[rows] - want[rows]).abs().max() > 1e-2  # the softcap changes these outputs


@pytest.mark.parametrize("window", [None, 4, 10])  # 10: only the last query loses its first key
def test_flex_without_a_mask_is_causal_with_the_window(window, flex_on_cpu):
    q, k, v = qkv(2, 4, 2, 11, 11, 16, dtype=torch.float64)
    out = flex.attention(q, k, v, None, scaling=0.25, softcap=SOFTCAP, window=window, causal=True)
    torch.testing.assert_close(out, reference(q, k, v, hf_mask(2, 11, 11, window), SOFTCAP, 0.25))
    full = flex.attention(q, k, v, None, scaling=0.25, softcap=SOFTCAP, window=None, causal=False)
    torch.testing.assert_close(full, reference(q, k, v, None, SOFTCAP, 0.25))


def test_flex_tier_crops_an_empty_static_cache(flex_on_cpu, monkeypatch):
    """No mask with keys past the queries (prefill into an empty static cache): causal over the first L."""
    monkeypatch.setattr(flex, "FLEX_MIN_Q", 2)
    q, k, v = qkv(2, 4, 2, 7, 19, 16)
    k[:, :, 7:], v[:, :, 7:] = float("nan"), float("nan")  # the unwritten tail must not be read
    module = type("Attn", (), {"is_causal": True, "training": False})()
    out, weights = attn_mod.flex_tier(module, q, k, v, None, scaling=0.3, softcap=SOFTCAP, sliding_window=4)
    assert weights is None and len(flex._warm) == 1
    want = reference(q, k[:, :, :7], v[:, :, :7], hf_mask(2, 7, 7, 4), SOFTCAP, 0.3).float()
    torch.testing.assert_close(out, want)
    out, _ = attn_mod.sdpa_attention(module, q, k, v, None, scaling=0.3, softcap=SOFTCAP, sliding_window=4)
    torch.testing.assert_close(out, want)  # the sdpa tier hands softcapped prefill to flex too
    module.training = True  # training: the eager tier (flex's backward is not checked here)
    out, weights = attn_mod.flex_tier(module, q, k, v, None, scaling=0.3, softcap=SOFTCAP)
    torch.testing.assert_close(out, reference(q, k[:, :, :7], v[:, :, :7], hf_mask(2, 7, 7), SOFTCAP, 0.3).float())
    assert weights is not None and len(flex._warm) == 1


def test_causal_block_masks_are_cached_per_shape_and_window(flex_on_cpu):
    a = flex.causal_block_mask(300, 300, None, "cpu")
    assert flex.causal_block_mask(300, 300, None, "cpu") is a
    assert flex.causal_block_mask(300, 300, 4096, "cpu") is a  # a window beyond every key is plain causal
    assert flex.causal_block_mask(300, 300, 300, "cpu") is a
    assert flex.causal_block_mask(300, 300, 299, "cpu") is not a
    w = flex.causal_block_mask(300, 300, 100, "cpu")
    assert w is not a and w.seq_lengths == (300, 300)
    assert flex.causal_block_mask(301, 301, 100, "cpu") is not w


def test_tensor_block_mask_reused_for_the_same_mask_only(flex_on_cpu):
    mask = hf_mask(2, 20, 20, 6, (0, 3))
    bm = flex.tensor_block_mask(mask, 2, 20)
    assert flex.tensor_block_mask(mask, 2, 20) is bm  # the next layer of the same forward
    mask[1, 0, 5, 5] = False  # changed in place: rebuilt
    assert flex.tensor_block_mask(mask, 2, 20) is not bm
    assert flex.tensor_block_mask(mask.clone(), 2, 20) is not flex.tensor_block_mask(mask, 2, 20)


@pytest.mark.slow
def test_compiled_flex_block_sparsity_on_cpu(flex_on_cpu, monkeypatch):
    """The compiled kernel skips masked blocks and trusts full ones: the BlockMasks must be exact."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "_compiled_cache", [torch.compile(flex_attention, dynamic=False, fullgraph=True)])
    q, k, v = qkv(1, 4, 2, 300, 300, 16)
    out = flex.attention(q, k, v, None, scaling=0.25, softcap=SOFTCAP, window=100, causal=True)
    assert not flex._failed, flex._failed
    torch.testing.assert_close(out.double(), reference(q, k, v, hf_mask(1, 300, 300, 100), SOFTCAP, 0.25),
                               rtol=1e-4, atol=1e-5)  # fmt: skip
    q, k, v = qkv(2, 4, 2, 263, 263, 16, seed=1)
    mask = hf_mask(2, 263, 263, 70, (0, 130))
    out = flex.attention(q, k, v, mask, scaling=0.25, softcap=SOFTCAP, window=70, causal=False)
    assert not flex._failed, flex._failed
    rows = mask[:, 0].any(-1)
    want = reference(q, k, v, mask, SOFTCAP, 0.25)
    torch.testing.assert_close(out.double()[rows], want[rows], rtol=1e-4, atol=1e-5)


# ---- Gemma-2 through optimize() ------------------------------------------------------------------
def gemma2_pair(device="cpu", dtype=torch.float32, softcap=SOFTCAP, window=None):
    """Stock Gemma-2 on the eager attention implementation (the reference) and an optimized twin.
    q/k projections scaled up so that scores are O(10) and the softcap changes the logits."""
    cfg = tiny_config("gemma2")
    cfg.attn_logit_softcapping = softcap
    if window is not None:
        cfg.sliding_window = window
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    stock = stock.to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for layer in stock.model.layers:
            layer.self_attn.q_proj.weight.mul_(16)
            layer.self_attn.k_proj.weight.mul_(16)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    return stock, opt, report


def long_batch(device, b=2, s=29, pad=9, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (b, s), generator=g).to(device)
    mask = torch.ones(b, s, dtype=torch.long, device=device)
    mask[1, :pad] = 0
    return ids, mask


def softcap_matters(stock, ids, mask, logits, atol):
    """The reference with the softcap switched off differs from `logits` by far more than atol."""
    plain = copy.deepcopy(stock)
    for layer in plain.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        other = plain(ids, attention_mask=mask, use_cache=False).logits.float()
    valid = mask.bool()
    assert (other[valid] - logits[valid]).abs().max() > 5 * atol


def check_gemma2(stock, opt, device, rtol, atol, compiled=None):
    ids, mask = long_batch(device)
    valid = mask.bool()
    run = compiled if compiled is not None else opt
    with torch.no_grad():
        for m in (None, mask):  # unpadded (no mask on full layers) and padded (materialized masks)
            want = stock(ids, attention_mask=m, use_cache=False).logits.float()
            got = run(ids, attention_mask=m, use_cache=False).logits.float()
            rows = valid if m is not None else torch.ones_like(valid)
            torch.testing.assert_close(got[rows], want[rows], rtol=rtol, atol=atol)
        softcap_matters(stock, ids, mask, want, atol)  # want: the padded batch's
        if compiled is None:  # cached prefill, then decode steps (the eager tier)
            n = ids.shape[1] - 2
            oa = stock(ids[:, :n], attention_mask=mask[:, :n], use_cache=True)
            ob = opt(ids[:, :n], attention_mask=mask[:, :n], use_cache=True)
            torch.testing.assert_close(ob.logits.float()[valid[:, :n]], oa.logits.float()[valid[:, :n]],
                                       rtol=rtol, atol=atol)  # fmt: skip
            sa = stock(ids[:, n : n + 1], attention_mask=mask[:, : n + 1], **with_cache(stock, cache_of(oa)))
            sb = opt(ids[:, n : n + 1], attention_mask=mask[:, : n + 1], **with_cache(opt, cache_of(ob)))
            torch.testing.assert_close(sb.logits.float(), sa.logits.float(), rtol=rtol, atol=atol)


def test_gemma2_flex_tier_matches_stock_eager_cpu(no_flash, flex_on_cpu):
    stock, opt, report = gemma2_pair()
    assert report.attention_tier == "flex"
    check_gemma2(stock, opt, "cpu", rtol=1e-4, atol=1e-4)
    assert flex._warm and not flex._failed  # prefill went through flex


@pytest.mark.slow  # torch.compile of a whole model: test_compiled_flex_block_sparsity_on_cpu compiles flex
def test_gemma2_flex_tier_under_compile_cpu(no_flash, flex_on_cpu, monkeypatch):
    """Under torch.compile the eager tier runs in the graph (fused by inductor), never flex: parity holds."""
    calls = []
    real = flex._compiled_cache[0]

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(flex, "_compiled_cache", [counting])
    stock, opt, _ = gemma2_pair()
    torch._dynamo.reset()
    compiled = torch.compile(opt, fullgraph=True, backend="aot_eager")
    check_gemma2(stock, opt, "cpu", rtol=1e-4, atol=1e-4, compiled=compiled)
    ids = long_batch("cpu")[0]
    calls.clear()
    with torch.no_grad():
        opt(ids, use_cache=False)
        assert calls  # eager: flex
        calls.clear()
        compiled(ids, use_cache=False)
    assert not calls  # compiled: no graph break (fullgraph) and no flex inside the graph


# ---- bench-model's note on stock attention -------------------------------------------------------
def _sdpa_without_softcap(module, query, key, value, attention_mask, softcap=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_bench_note_when_stock_attention_ignores_softcap():
    from transformers import AttentionInterface

    AttentionInterface.register("test_drops_softcap", _sdpa_without_softcap)
    model = build("gemma2")
    model.config._attn_implementation = "eager"
    assert ignored_features(model) == []
    model.config._attn_implementation = "test_drops_softcap"
    notes = ignored_features(model)
    assert len(notes) == 1 and "'test_drops_softcap' ignores attn_logit_softcapping=50.0" in notes[0]
    model.config._attn_implementation = attn_mod.NAMES["sdpa"]  # gemmtune's sdpa tier hands softcap on
    attn_mod.register()
    assert ignored_features(model) == []
    assert ignored_features(build("llama")) == []  # no softcap asked for


def test_bench_report_prints_the_notes():
    from gemmtune.profiling import bench_report
    from gemmtune.profiling.bench_model import Result, Settings

    res = Result(Settings("tiny-llama", device="cpu"), {"model": "m"}, "summary", {"stock": "reference"}, [], [],
                 notes=["stock attention implementation 'sdpa' ignores attn_logit_softcapping=50.0"])  # fmt: skip
    md = bench_report.markdown(res)
    assert "Note: stock attention implementation 'sdpa' ignores attn_logit_softcapping=50.0" in md
    assert bench_report.to_dict(res)["notes"] == res.notes


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.fixture
def flex_gpu(gpu, monkeypatch):
    if flex.unavailable_reason(gpu) is not None:
        pytest.skip(flex.unavailable_reason(gpu))
    monkeypatch.setattr(attn_mod, "_flash_cache", [None])
    monkeypatch.setenv(attn_mod.ENV, "flex")
    monkeypatch.setattr(flex, "_failed", {})
    return gpu


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)])
def test_flex_head_dim_256_gpu(flex_gpu, dtype):
    """Gemma-2-9B's attention shape (16 q heads, 8 kv heads, head dim 256) compiles and is right."""
    q, k, v = qkv(1, 16, 8, 1000, 1000, 256, flex_gpu, dtype)
    out = flex.attention(q, k, v, None, scaling=256**-0.5, softcap=50.0, window=512, causal=True)
    assert not flex._failed, flex._failed
    want = reference(q, k, v, hf_mask(1, 1000, 1000, 512, device=flex_gpu), 50.0, 256**-0.5)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    q, k, v = qkv(2, 16, 8, 333, 333, 256, flex_gpu, dtype, seed=1)
    mask = hf_mask(2, 333, 333, None, (0, 100), device=flex_gpu)
    out = flex.attention(q, k, v, mask, scaling=256**-0.5, softcap=50.0, window=None, causal=False)
    assert not flex._failed, flex._failed
    rows = mask[:, 0].any(-1)
    want = reference(q, k, v, mask, 50.0, 256**-0.5)
    torch.testing.assert_close(out.double()[rows], want[rows], rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gemma2_flex_tier_bf16_gpu(flex_gpu):
    stock, opt, report = gemma2_pair(flex_gpu, torch.bfloat16)
    assert report.attention_tier == "flex"
    flex._warm.clear()
    check_gemma2(stock, opt, flex_gpu, rtol=3e-2, atol=3e-2)
    assert any(sig[-1] for sig in flex._warm)  # unpadded prefill: flex with the causal block mask
    # Padded batches keep the mask tensor; where flex cannot build with it (torch 2.11's inductor
    # could not lower it on the H100) the eager tier ran them, and the logits above still matched.
    assert all(not sig[-1] for sig in flex._failed), flex._failed


@pytest.mark.gpu
@pytest.mark.slow
def test_gemma2_flex_tier_inductor_gpu(flex_gpu):
    stock, opt, _ = gemma2_pair(flex_gpu, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(opt)
    check_gemma2(stock, opt, flex_gpu, rtol=3e-2, atol=3e-2, compiled=compiled)


@pytest.mark.gpu
def test_gemma2_flex_prefill_then_graph_decode_gpu(flex_gpu):
    """Prefill through flex, then a decode step captured in a CUDA graph: the replay gives the eager
    step's logits. (Stock Gemma-2 on its eager attention fails this capture in transformers 5.17: a
    host-to-device copy in its decode step, H100.)"""
    from transformers import StaticCache

    # A window past the prefill and the decode steps: once a sliding layer of transformers' StaticCache
    # is full, its update makes a host tensor per step, which no CUDA graph (stock HF's either) captures.
    _, opt, _ = gemma2_pair(flex_gpu, torch.bfloat16, window=48)
    ids, _ = long_batch(flex_gpu, b=2, pad=0)
    n = ids.shape[1] - 3
    caches = [StaticCache(config=opt.config, max_cache_len=64) for _ in range(2)]
    tok = ids[:, n : n + 1].clone()
    flex._warm.clear()

    def step(cache):
        return opt(input_ids=tok, **with_cache(opt, cache), use_cache=True, logits_to_keep=1)

    with torch.no_grad():
        for c in caches:
            opt(input_ids=ids[:, :n], **with_cache(opt, c), use_cache=True, logits_to_keep=1)
        assert flex._warm, "prefill did not run through flex"
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # one warm-up step on each cache: both stay in the same state
            for c in caches:
                step(c)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(caches[1]).logits
        # A captured step replays the cache positions it was captured at (transformers derives them on
        # the host), so it is compared once, against the eager step from the same cache state.
        tok.copy_(ids[:, n + 1 : n + 2])
        want = step(caches[0]).logits.float()
        graph.replay()
        torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.slow
def test_flex_new_prefill_lengths_keep_flex_gpu(flex_gpu):
    """A second and third prefill length recompile flex (dynamic shapes) instead of falling back."""
    _, opt, _ = gemma2_pair(flex_gpu, torch.bfloat16)
    flex._warm.clear()
    with torch.no_grad():
        for s in (40, 57, 200):
            ids = torch.randint(3, 256, (1, s), device=flex_gpu)
            opt(ids, use_cache=False)
    assert not flex._failed, flex._failed
    assert len({sig[0] for sig in flex._warm}) == 3


def test_mod_functions_carry_their_constants_in_code_not_closures():
    """torch.compile makes a closure's int/float symbolic once it saw two values (torch 2.11 then failed
    to lower flex); the softcap and the window are written into each function's code instead."""
    s, q, kv = torch.tensor([0.5, 30.0, -7.0]), torch.tensor([5, 5, 9]), torch.tensor([5, 1, 2])
    for cap in (2.0, 50.0):
        fn = flex.score_mod(cap)
        assert fn.__closure__ is None and flex.score_mod(cap) is fn
        torch.testing.assert_close(fn(s, 0, 0, q, kv), torch.tanh(s / cap) * cap)
    for window in (3, 4096):
        fn = flex.causal_mask_mod(window)
        assert fn.__closure__ is None and flex.causal_mask_mod(window) is fn
        assert fn(0, 0, q, kv).tolist() == ((q >= kv) & (q - kv < window)).tolist()
    assert flex.causal_mask_mod(3) is not flex.causal_mask_mod(4)
