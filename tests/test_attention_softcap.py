"""gemmtune's softcapped flash attention (kernels/attention_softcap.py, ops/attention.py) and its routing.

Kernel cases run under the Triton interpreter in a subprocess without a GPU (fp32, fp16), on the GPU
with one (plus bf16 at Gemma-2-9B's shapes); outputs are NaN-poisoned and checked against the fp32
reference, and each softcapped case also against the reference without the softcap (which must be far
off). Keys a tile must skip (past the diagonal, before the window) are NaN-poisoned in the skip cases.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, kernel_results, nan_outputs
from tiers import tiered

from gemmtune import settings
from gemmtune.errors import EnvVarError
from gemmtune.kernels import attention_softcap as kattn
from gemmtune.ops import attention as attn_ops

HAS_GPU = torch.cuda.is_available()
CAP = 2.0  # small enough to matter for the scaled-up q/k below (scores of O(10))
C16, C32x16, C16x32 = kattn.Config(16, 16, 1, 1), kattn.Config(32, 16, 2, 1), kattn.Config(16, 32, 2, 1)
C16x64, C16x128 = kattn.Config(16, 64, 2, 1), kattn.Config(16, 128, 2, 1)

# (name, b, hq, hkv, L, S, D, causal, window, softcap, dtype, config, layout): L and S off the blocks,
# L < S (chunked prefill), GQA, windows inside and beyond the keys, head dims 64, 48 (a masked D axis)
# and 256 with a tiny L; layout "hf": q/v as transposed [B, L, H, D] views (what transformers passes).
CASES = [
    (f"{n}-{dt}", *rest, dt, cfg, layout)
    for dt in ("float32", "float16")
    for n, *rest, cfg, layout in (
        ("causal-gqa", 2, 4, 2, 37, 37, 64, True, None, CAP, C16, "hf"),
        ("causal-chunk", 2, 4, 2, 37, 53, 64, True, None, CAP, C32x16, "hf"),
        ("window-chunk", 2, 4, 2, 37, 53, 64, True, 7, CAP, C16x32, "hf"),
        ("window-wide", 1, 6, 2, 45, 45, 64, True, 33, CAP, C16, "contig"),
        ("window-past-keys", 1, 2, 1, 20, 20, 64, True, 500, CAP, C16, "hf"),
        ("full-nocap", 1, 4, 1, 37, 53, 64, False, None, None, C32x16, "hf"),
        ("full-cap", 2, 2, 2, 9, 70, 48, False, None, CAP, C16, "contig"),
        ("causal-nocap", 1, 4, 4, 40, 40, 64, True, 5, None, C16x32, "hf"),
        ("d256-tiny", 1, 2, 1, 3, 9, 256, True, None, CAP, C16, "hf"),
        ("one-query", 1, 4, 2, 1, 23, 64, True, 4, CAP, C16, "hf"),
        ("default-config", 1, 2, 1, 19, 19, 64, True, None, CAP, None, "hf"),
    )
]
GPU_CASES = [  # Gemma-2-9B: 16 query heads, 8 KV heads, head dim 256, softcap 50
    (f"gemma2-{L}-{S}-w{w}-{dt}", 1, 16, 8, L, S, 256, True, w, 50.0, dt, None, "hf")
    for dt in ("bfloat16", "float16")
    for L, S, w in ((2048, 2048, None), (2048, 2048, 1000), (1000, 1000, None), (333, 1357, 300))
] + [(n.replace("float16", "bfloat16"), *rest) for n, *rest in CASES if "float16" in n]
ALL = CASES + (GPU_CASES if HAS_GPU else [])
# Boolean masks (transformers' for causal LMs): (name, b, L, S, window, left padding per row, extra
# columns past the keys, static: queries at positions 0..L-1 of S cache slots, dtype, config).
MASK_CASES = [
    (f"mask-{n}-{dt}", *rest, dt, cfg)
    for dt in ("float32", "float16")
    for n, *rest, cfg in (
        ("padded", 3, 37, 37, None, (0, 5, 40), 0, False, C16),  # row 3: all padding (sees nothing: 0)
        ("padded-window", 2, 21, 53, 9, (0, 30), 3, False, C32x16),
        ("static", 2, 19, 64, None, (0, 4), 0, True, C16x32),
        ("broadcast", 1, 33, 45, 12, (2,), 0, False, C16),
        ("padded-n64", 2, 70, 150, None, (0, 77), 5, False, C16x64),  # bit 63 of the mask words
        ("window-n128", 2, 41, 300, 50, (3, 130), 0, False, C16x128),  # masks cap BLOCK_N at 64
        ("nocap-padded", 2, 45, 45, None, (0, 20), 0, False, C32x16),  # softcap None (Llama-like)
    )
]
GPU_MASK_CASES = [
    ("mask-gemma2-bfloat16", 2, 1000, 1000, None, (0, 300), 0, False, "bfloat16", None),
    ("mask-nocap-llama3-bfloat16", 2, 1000, 1000, None, (0, 300), 0, False, "bfloat16", None),
]
ALL_MASK = MASK_CASES + (GPU_MASK_CASES if HAS_GPU else [])
# Max |out - fp32 reference| (outputs are O(1)): fp32 the summation order; 16-bit inputs the output
# rounding and P rounded to the input dtype for the second product (flash attention's usual error).
TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


def make_qkv(b, hq, hkv, L, S, D, dtype, layout, gen, device):
    scale = 2.0  # scores of O(10) with the scaling below
    if layout == "hf":  # [B, L, H, D] storage viewed as [B, H, L, D], as projections reshaped by transformers
        q = (torch.randn(b, L, hq, D, generator=gen) * scale).to(dtype).to(device).transpose(1, 2)
        k = (torch.randn(b, S, hkv, D, generator=gen) * scale).to(dtype).to(device).transpose(1, 2)
        v = torch.randn(b, S, hkv, D, generator=gen).to(dtype).to(device).transpose(1, 2)
    else:
        q = (torch.randn(b, hq, L, D, generator=gen) * scale).to(dtype).to(device)
        k = (torch.randn(b, hkv, S, D, generator=gen) * scale).to(dtype).to(device)
        v = torch.randn(b, hkv, S, D, generator=gen).to(dtype).to(device)
    return q, k, v


def scaling_of(D):
    return 0.3 if D <= 64 else D**-0.5 * 3


def run_cases(cases, device: str) -> dict:
    """The plain and the masked (names mask-...) cases, then the skip, random-mask and mask-block ones."""
    mask_cases = [c for c in cases if c[0].startswith("mask-")]
    with nan_outputs(kattn):
        out = {name: _case(name, *rest, device) for name, *rest in cases if not name.startswith("mask-")}
        out.update({name: _mask_case(name, *rest, device) for name, *rest in mask_cases})
        out.update(_skip_cases(device))
        out.update(_random_mask_cases(device))
    out["mask-blocks"] = _mask_block_mismatches(device)
    return out


# (batch, hq, hkv, L, S, D, config, mask batch) of the random block masks: 16x16 regions each whole,
# hidden or random, so the config's tiles hold all three classes and runs of whole blocks.
RANDOM_MASKS = {
    "c16": (2, 4, 2, 45, 61, 32, C16, 2),
    "c32x16-broadcast": (2, 4, 1, 67, 50, 48, C32x16, 1),
    "c16x64": (1, 2, 2, 29, 200, 64, C16x64, 1),
}


def random_block_mask(b, L, S, gen, region=16):
    """region x region squares each hidden (1/4), visible (1/2) or random (1/4)."""
    kind = torch.randint(0, 4, (b, 1, L // region + 1, S // region + 1), generator=gen)
    kind = kind.repeat_interleave(region, 2).repeat_interleave(region, 3)[:, :, :L, :S]
    mask = (kind == 1) | (kind == 2) | ((kind == 3) & (torch.rand(kind.shape, generator=gen) < 0.5))
    mask[:, :, L // 3] = False  # a row that sees nothing
    return mask


def _random_mask_cases(device) -> dict:
    out = {}
    for name, (b, hq, hkv, L, S, D, cfg, mb) in RANDOM_MASKS.items():
        for dt in ("float32", "float16"):
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}-{dt}".encode()))
            q, k, v = make_qkv(b, hq, hkv, L, S, D, getattr(torch, dt), "hf", gen, device)
            mask = random_block_mask(mb, L, S, gen).to(device)
            kw = {"scaling": 0.3, "softcap": CAP, "causal": False, "mask": mask}
            y = kattn.softcap_attention(q, k, v, config=cfg, **kw)
            ref = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **kw)
            unmasked = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **{**kw, "mask": None})
            out[f"random-mask-{name}-{dt}"] = {
                "ok": tuple(y.shape) == (b, L, hq, D), "nan": bool(torch.isnan(y).any()),
                "err": (y.float() - ref).abs().max().item(), "mask_effect": (unmasked - ref).abs().max().item(),
            }  # fmt: skip
    return out


def mask_blocks_ref(mask, L, S, bm, bn):
    """(classes [B, n_m, n_n], row bits [B, L, n_n], ranges [B, n_m, 4]) as _mask_blocks / _mask_ranges
    define them."""
    n_m, n_n = -(-L // bm), -(-S // bn)
    m = torch.zeros(mask.shape[0], n_m * bm, n_n * bn, dtype=torch.bool)
    m[:, :L, :S] = mask[:, 0, :, :S].cpu()
    tiles = m.view(-1, n_m, bm, n_n, bn)
    rows_in = (torch.arange(n_m * bm) < L).view(1, n_m, bm, 1, 1)
    seen = tiles.any(-1).any(2)
    full = (tiles | ~rows_in).all(-1).all(2) & (torch.arange(n_n * bn) < S).view(n_n, bn).all(-1)
    classes = torch.where(full, 2, seen.to(torch.int64))
    weights = 2 ** torch.arange(bn, dtype=torch.int64)
    bits = (m[:, :L].view(-1, L, n_n, bn).to(torch.int64) * weights).sum(-1)
    ranges = torch.zeros(mask.shape[0], n_m, 4, dtype=torch.int64)
    for b in range(mask.shape[0]):
        for i in range(n_m):
            vis = seen[b, i].nonzero().flatten().tolist()
            whole = (classes[b, i] == 2).tolist()
            lo, hi = (vis[0], vis[-1] + 1) if vis else (0, 0)
            run_lo = whole.index(True) if True in whole else 0
            run_hi = run_lo
            while run_hi < n_n and whole[run_hi]:
                run_hi += 1
            ranges[b, i] = torch.tensor([lo, hi, run_lo, run_hi]) * bn
    return classes, bits, ranges


def _mask_block_mismatches(device) -> list:
    """Run the two mask kernels on random and causal-LM masks; the names of the outputs that differ."""
    bad = []
    gen = torch.Generator().manual_seed(11)
    masks = [(random_block_mask(2, 45, 70, gen), 45, 61, 16, 16),
             (random_block_mask(1, 70, 130, gen), 70, 130, 32, 64),
             (causal_lm_mask(3, 37, 37, 9, (0, 5, 40), 2, False), 37, 37, 16, 32)]  # fmt: skip
    for i, (mask, L, S, bm, bn) in enumerate(masks):
        m8 = mask.to(device).view(torch.uint8)
        mb, n_m, n_n = mask.shape[0], -(-L // bm), -(-S // bn)
        classes = torch.full((mb, n_m, n_n), -1, dtype=torch.int8, device=device)
        bits = torch.full((mb, L, n_n), -1, dtype=torch.int64, device=device)
        ranges = torch.full((mb, n_m, 4), -1, dtype=torch.int32, device=device)
        kattn._mask_blocks[(mb, n_m, n_n)](m8, bits, classes, m8.stride(0), m8.stride(2), m8.stride(3), L, S,
                                           BLOCK_M=bm, BLOCK_N=bn)  # fmt: skip
        kattn._mask_ranges[(mb * n_m,)](classes, ranges, n_n, BLOCK_N=bn, CHUNK=2)  # several chunks
        want = mask_blocks_ref(mask, L, S, bm, bn)
        for name, got, ref in zip(("classes", "bits", "ranges"), (classes, bits, ranges), want):
            if not torch.equal(got.cpu().to(torch.int64), ref):
                bad.append(f"mask {i}: {name}")
    return bad


def causal_lm_mask(b, L, S, window, pad, extra, static):
    """A mask like transformers' for a causal LM: causal (and windowed) at the queries' positions, left
    padding per row, `extra` False columns past the keys; static: positions 0..L-1, the rest empty slots."""
    ok = kattn.visible(L, L if static else S, True, window)
    if static:
        ok = torch.cat([ok, torch.zeros(L, S - L, dtype=torch.bool)], -1)
    ok = ok[None, None].repeat(b, 1, 1, 1)
    for row, n in enumerate(pad):
        ok[row, :, :, :n] = False
    return torch.cat([ok, torch.zeros(b, 1, L, extra, dtype=torch.bool)], -1)


def _mask_case(name, b, L, S, window, pad, extra, static, dt, cfg, device):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, dt)
    hq, hkv, D = (16, 8, 256) if "gemma2" in name else (32, 8, 128) if "llama3" in name else (4, 2, 64)
    q, k, v = make_qkv(b, hq, hkv, L, S, D, dtype, "hf", gen, device)
    mask = causal_lm_mask(len(pad), L, S, window, pad, extra, static).to(device)
    cap = None if "nocap" in name else 50.0 if D == 256 else CAP
    kw = {"scaling": scaling_of(D), "softcap": cap, "mask": mask}
    # the mask ANDed with causal, and the mask alone (it is causal itself: what the routing passes)
    ys = [kattn.softcap_attention(q, k, v, config=cfg, causal=c, **kw) for c in (True, False)]
    ref = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **kw)
    # the output with the mask ignored (causal only) is far off: the cases test the mask
    unmasked = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **{**kw, "mask": None})
    return {"ok": all(tuple(y.shape) == (b, L, hq, D) for y in ys), "nan": any(bool(y.isnan().any()) for y in ys),
            "err": max((y.float() - ref).abs().max().item() for y in ys),
            "mask_effect": (unmasked - ref).abs().max().item()}  # fmt: skip


def _case(name, b, hq, hkv, L, S, D, causal, window, cap, dt, cfg, layout, device):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    dtype = getattr(torch, dt)
    q, k, v = make_qkv(b, hq, hkv, L, S, D, dtype, layout, gen, device)
    kw = {"scaling": scaling_of(D), "softcap": cap, "causal": causal, "window": window}
    y = kattn.softcap_attention(q, k, v, config=cfg, **kw)
    ref = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **kw)
    r = {
        "ok": tuple(y.shape) == (b, L, hq, D) and y.dtype == dtype and y.is_contiguous(),
        "nan": bool(torch.isnan(y).any()),
        "err": (y.float() - ref).abs().max().item(),
    }
    if cap is not None:  # how far the output would be with the softcap dropped
        plain = kattn.softcap_attention_ref(q.float(), k.float(), v.float(), **{**kw, "softcap": None})
        r["cap_effect"] = (plain - ref).abs().max().item()
    return r


def _skip_cases(device) -> dict:
    """Keys no row of a tile sees are NaN: a tile that reads them (V x 0 is NaN) fails."""
    out = {}
    gen = torch.Generator().manual_seed(7)
    # causal, L == S = 64, 16x16 tiles: rows 0..15 (the first tile) must not read keys 16..
    q, k, v = make_qkv(1, 2, 1, 64, 64, 32, torch.float32, "contig", gen, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 16:], v2[:, :, 16:] = float("nan"), float("nan")
    y = kattn.softcap_attention(q, k2, v2, scaling=0.3, softcap=CAP, config=C16)
    ref = kattn.softcap_attention_ref(q, k, v, scaling=0.3, softcap=CAP)
    out["skip-causal"] = (y[:, :16] - ref[:, :16]).abs().max().item()
    # window 16, a chunk of 16 queries at positions 64..79: keys before 48 are out of every row's window
    q, k, v = make_qkv(1, 2, 1, 16, 80, 32, torch.float32, "contig", gen, device)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :48], v2[:, :, :48] = float("nan"), float("nan")
    y = kattn.softcap_attention(q, k2, v2, scaling=0.3, softcap=CAP, window=16, config=C16)
    ref = kattn.softcap_attention_ref(q, k, v, scaling=0.3, softcap=CAP, window=16)
    out["skip-window"] = (y - ref).abs().max().item()
    # any mask, not causal: all-visible, hidden and mixed 8x8 regions, rows that see nothing
    q, k, v = make_qkv(2, 4, 2, 45, 61, 32, torch.float32, "contig", gen, device)
    kind = torch.randint(0, 3, (2, 1, 6, 9), generator=gen).repeat_interleave(8, 2).repeat_interleave(8, 3)
    mask = ((kind == 1) | ((kind == 2) & (torch.rand(kind.shape, generator=gen) < 0.5)))[:, :, :45, :64]
    mask[1, :, 3] = False
    y = kattn.softcap_attention(q, k, v, scaling=0.3, softcap=CAP, causal=False, mask=mask.to(device), config=C16)
    ref = kattn.softcap_attention_ref(q, k, v, scaling=0.3, softcap=CAP, causal=False, mask=mask.to(device))
    out["any-mask"] = (y - ref).abs().max().item() if not torch.isnan(y).any() else float("inf")
    return out


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES + MASK_CASES, GPU_CASES + GPU_MASK_CASES, request)


_FP32_DEFAULT = {"causal-gqa-float32"}
_FP16_DEFAULT = {
    f"{n}-float16" for n in ("window-chunk", "full-cap", "one-query", "mask-padded-window", "mask-broadcast")
}


def _in_default(case) -> bool:
    """The default tier: bf16 at every shape on a GPU, a spread of the fp16 cases (causal, window, cap,
    head size, one query, the default config; each kind of mask) and a few fp32 ones for the summation
    order; the other cases are slow."""
    name = case[0]
    return name.endswith("-bfloat16") or name in _FP16_DEFAULT or name in _FP32_DEFAULT


@pytest.mark.parametrize("case", tiered(ALL, _in_default), ids=[c[0] for c in ALL])
def test_kernel_matches_fp32_reference(case, results):
    name, dt, cap = case[0], case[10], case[9]
    r = results[name]
    assert r["ok"] and not r["nan"], r
    assert r["err"] <= TOL[dt], r
    if cap is not None:  # the softcap is applied: dropping it would be far outside the tolerance
        assert r["cap_effect"] > 20 * TOL[dt], r


@pytest.mark.parametrize("case", tiered(ALL_MASK, _in_default), ids=[c[0] for c in ALL_MASK])
def test_masked_kernel_matches_fp32_reference(case, results):
    r = results[case[0]]
    assert r["ok"] and not r["nan"], r
    assert r["err"] <= TOL[case[8]], r
    assert r["mask_effect"] > 20 * TOL[case[8]], r


@pytest.mark.parametrize("name", [f"random-mask-{n}-{dt}" for n in RANDOM_MASKS for dt in ("float32", "float16")])
def test_kernel_with_random_block_masks(name, results):
    """Masks mixing whole, hidden and partial key blocks (not causal-like): every block class and the
    edge blocks on both sides of a run of whole ones; rows that see nothing give 0."""
    r = results[name]
    assert r["ok"] and not r["nan"], r
    assert r["err"] <= TOL[name.rsplit("-", 1)[1]], r
    assert r["mask_effect"] > 20 * TOL[name.rsplit("-", 1)[1]], r


def test_mask_block_classes_and_ranges(results):
    """_mask_blocks / _mask_ranges against their definition in PyTorch (classes, row bits, ranges)."""
    assert results["mask-blocks"] == [], results["mask-blocks"]


@pytest.mark.parametrize("name", ["skip-causal", "skip-window", "any-mask"])
def test_kernel_skips_invisible_key_blocks(name, results):
    assert results[name] <= TOL["float32"], results[name]


# ---- CPU: reference, validation, configs --------------------------------------------------------
def test_reference_masks_follow_transformers():
    """visible() is transformers' own causal / sliding-window mask for queries at the last L of S keys."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    for L, S, w in ((7, 7, None), (5, 13, None), (5, 13, 4), (13, 13, 3), (9, 9, 9)):
        fn = causal_mask_function if w is None else sliding_window_causal_mask_function(w)
        hf = sdpa_mask(batch_size=1, q_length=L, kv_length=S, q_offset=S - L, mask_function=fn,
                       allow_is_causal_skip=False)  # fmt: skip
        assert torch.equal(kattn.visible(L, S, True, w), hf[0, 0]), (L, S, w)


def test_reference_matches_the_eager_tier():
    """The reference is transformers' eager formula (softcap after the scaling, GQA by kv head h // n_rep)."""
    from gemmtune.models import attention as attn_mod

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g, dtype=torch.float64) * 2 for h, n in ((6, 11), (2, 11), (2, 11)))
    mod = type("Attn", (), {"is_causal": True, "training": False})()
    want, _ = attn_mod.eager_attention(mod, q, k, v, None, scaling=0.3, softcap=CAP)
    got = kattn.softcap_attention_ref(q, k, v, scaling=0.3, softcap=CAP)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_bad_inputs_raise():
    q, k = torch.zeros(1, 4, 8, 64), torch.zeros(1, 2, 8, 64)
    with pytest.raises(ValueError, match=r"not a multiple of 3 KV heads"):
        kattn.validate(q, torch.zeros(1, 3, 8, 64), torch.zeros(1, 3, 8, 64), None, True, None)
    with pytest.raises(ValueError, match=r"head dim 512"):
        z = torch.zeros(1, 2, 8, 512)
        kattn.validate(z, z, z, None, True, None)
    with pytest.raises(ValueError, match="key and value shapes differ"):
        kattn.validate(q, k, torch.zeros(1, 2, 9, 64), None, True, None)
    with pytest.raises(ValueError, match=r"causal with more queries \(8\) than keys \(5\)"):
        kattn.validate(q, k[:, :, :5], k[:, :, :5], None, True, None)
    with pytest.raises(ValueError, match="sliding window"):
        kattn.validate(q, k, k, None, False, 4)
    with pytest.raises(ValueError, match="must share one of"):
        kattn.validate(q.half(), k, k, None, True, None)
    with pytest.raises(TypeError, match="key must be a tensor"):
        kattn.validate(q, None, k, None, True, None)


def test_config_table_and_parse():
    assert kattn.default_config(256, torch.bfloat16) == kattn.CONFIGS[256]
    assert kattn.default_config(80, torch.float16) == kattn.CONFIGS[128]  # padded head dim
    cfg = kattn.parse_config("64x32w4s3")
    assert cfg == kattn.Config(64, 32, 4, 3) and str(cfg) == "64x32w4s3"
    with pytest.raises(ValueError, match="BMxBNwWARPSsSTAGES"):
        kattn.parse_config("64x32")
    for d, c in kattn.CONFIGS.items():  # Q plus the pipelined K and V tiles fit Hopper's 227 KB
        assert 2 * d * (c.block_m + 2 * c.num_stages * c.block_n) <= 227 * 1024, (d, c)


def test_op_on_cpu_is_the_reference_and_compiles():
    """Off CUDA the op runs the reference; torch.compile(fullgraph) traces it as one custom op call."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h, n in ((4, 20), (2, 20), (2, 20)))

    def f(q, k, v):
        return attn_ops.softcap_attention(q, k, v, 0.3, CAP, True, 6) * 2

    want = kattn.softcap_attention_ref(q, k, v, scaling=0.3, softcap=CAP, window=6) * 2
    torch.testing.assert_close(f(q, k, v), want)
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(f, backend=counter, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, want)
    graph = str(counter.graphs[0].code)
    assert "gemmtune.softcap_attention" in graph, graph


# ---- routing (CPU: the op runs the reference there) ----------------------------------------------
@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """Let the routing pick the kernel on the CPU in fp32 (the op then runs the reference); record
    each call that reaches it as (L, S, causal, window, softcap, masked)."""
    pytest.importorskip("transformers")
    from gemmtune.models import attention as attn_mod

    monkeypatch.delenv(attn_mod.ENV, raising=False)
    monkeypatch.setattr(attn_mod, "_flash_cache", [None])
    monkeypatch.setattr(attn_mod, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(attn_mod, "KERNEL_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    calls = []
    real = attn_ops._run

    def spy(q, k, v, mask, scaling, softcap, causal, window):
        calls.append((q.shape[2], k.shape[2], causal, window, softcap, mask is not None))
        return real(q, k, v, mask, scaling, softcap, causal, window)

    monkeypatch.setattr(attn_ops, "_run", spy)
    return attn_mod, calls


def _close(out, want):  # fp32 kernel path vs the fp64 formula
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def _module(causal=True, training=False):
    return type("Attn", (), {"is_causal": causal, "training": training})()


def test_triton_tier_takes_prefill(kernel_on_cpu):
    from test_attention_flex import hf_mask, qkv, reference

    attn_mod, calls = kernel_on_cpu
    q, k, v = qkv(2, 4, 2, 20, 20, 16)
    out, w = attn_mod.triton_tier(_module(), q, k, v, None, scaling=0.3, softcap=CAP, sliding_window=6)
    assert w is None and calls == [(20, 20, True, 6, CAP, False)]
    _close(out, reference(q, k, v, hf_mask(2, 20, 20, 6), CAP, 0.3))
    attn_mod.triton_tier(_module(), q, k, v, None, scaling=0.3, softcap=CAP, sliding_window=500)
    assert calls[-1] == (20, 20, True, None, CAP, False)  # a window past every key is none
    attn_mod.triton_tier(_module(causal=False), q, k, v, None, scaling=0.3, softcap=CAP, sliding_window=6)
    assert calls[-1] == (20, 20, False, None, CAP, False)
    # prefill into an empty static cache (no mask, keys past the queries): causal over the first L keys
    q, k, v = qkv(2, 4, 2, 20, 31, 16)
    k[:, :, 20:], v[:, :, 20:] = float("nan"), float("nan")
    out, _ = attn_mod.sdpa_attention(_module(), q, k, v, None, scaling=0.3, softcap=CAP)  # sdpa hands it on
    assert calls[-1] == (20, 20, True, None, CAP, False)
    _close(out, reference(q, k[:, :, :20], v[:, :, :20], hf_mask(2, 20, 20), CAP, 0.3))
    # eager code: a boolean mask that is plain causal (and windowed) from position 0 counts as none
    q, k, v = qkv(1, 4, 2, 20, 20, 16)
    out, _ = attn_mod.triton_tier(_module(), q, k, v, hf_mask(1, 20, 20, 6), scaling=0.3, softcap=CAP,
                                  sliding_window=6)  # fmt: skip
    assert calls[-1] == (20, 20, True, 6, CAP, False)
    _close(out, reference(q, k, v, hf_mask(1, 20, 20, 6), CAP, 0.3))
    # padding, and a chunk of queries after a cache (mask wider than the keys): the masked kernel
    q, k, v = qkv(2, 4, 2, 20, 33, 16)
    mask = hf_mask(2, 20, 33, 9, (0, 5))
    for m in (mask, torch.cat([mask, torch.zeros(2, 1, 20, 4, dtype=torch.bool)], -1)):
        out, _ = attn_mod.triton_tier(_module(), q, k, v, m, scaling=0.3, softcap=CAP, sliding_window=9)
        assert calls[-1] == (20, 33, False, None, CAP, True)  # the mask alone decides
        _close(out, reference(q, k, v, mask, CAP, 0.3))


def test_triton_tier_declines_what_it_does_not_compute(kernel_on_cpu):
    from test_attention_flex import hf_mask, qkv

    attn_mod, calls = kernel_on_cpu
    q, k, v = qkv(2, 4, 2, 20, 20, 16)
    short = q[:, :, : attn_mod.KERNEL_MIN_Q - 1]  # decode-sized
    attn_mod.triton_tier(_module(), short, k, v, hf_mask(2, short.shape[2], 20), scaling=0.3, softcap=CAP)
    attn_mod.triton_tier(_module(training=True), q, k, v, None, scaling=0.3, softcap=CAP)
    _, w = attn_mod.triton_tier(_module(), q, k, v, None, scaling=0.3, softcap=CAP, output_attentions=True)
    assert w is not None
    attn_mod.triton_tier(_module(), q, k, v, None, 0.1, scaling=0.3, softcap=CAP)  # dropout
    qg = q.clone().requires_grad_()
    attn_mod.triton_tier(_module(), qg, k, v, None, scaling=0.3, softcap=CAP)  # no backward
    attn_mod.triton_tier(_module(), q.double(), k.double(), v.double(), None, scaling=0.3, softcap=CAP)
    padded = hf_mask(2, 20, 20, None, (0, 5))
    attn_mod.triton_tier(_module(), q, k, v, padded.expand(2, 4, 20, 20), scaling=0.3, softcap=CAP)  # per head
    attn_mod.triton_tier(_module(), q, k, v, padded.float(), scaling=0.3, softcap=CAP)  # additive
    attn_mod.triton_tier(_module(), q, k, v, padded, scaling=0.3)  # no softcap: masks may be non-causal
    assert calls == []
    attn_mod.sdpa_attention(_module(), q, k, v, None, scaling=0.3)  # no softcap: SDPA itself
    assert calls == []
    attn_mod.triton_tier(_module(), q, k, v, None, scaling=0.3)  # forced tier, no softcap, no mask: the kernel
    assert calls == [(20, 20, True, None, None, False)]


def test_masked_prefill_without_softcap_goes_to_the_kernel(kernel_on_cpu, monkeypatch):
    """MASKED_PREFILL="triton" (the default): the sdpa tier (and the tiers that hand masked calls to it)
    runs masked prefill without softcap through the kernel with the mask alone; "sdpa" and every call the
    kernel does not take keep SDPA; mask-free calls are untouched."""
    from test_attention_flex import hf_mask, qkv, reference

    attn_mod, calls = kernel_on_cpu
    env_mode = settings.MASKED_PREFILL.get
    q, k, v = qkv(2, 4, 2, 20, 33, 64)
    mask = hf_mask(2, 20, 33, 9, (0, 5))
    want = reference(q, k, v, mask, None, 0.1)
    monkeypatch.delenv("GEMMTUNE_MASKED_PREFILL", raising=False)
    assert env_mode() == "triton"
    monkeypatch.setattr(attn_mod, "MASKED_PREFILL", "sdpa")
    out, _ = attn_mod.sdpa_attention(_module(), q, k, v, mask, scaling=0.1)
    assert calls == []
    _close(out, want)
    monkeypatch.setattr(attn_mod, "MASKED_PREFILL", "triton")
    for tier in (attn_mod.sdpa_attention, attn_mod.triton_tier, attn_mod.flash_attention, attn_mod.flex_tier):
        out, w = tier(_module(), q, k, v, mask, scaling=0.1, sliding_window=9)
        assert w is None and calls[-1] == (20, 33, False, None, None, True), tier.__name__
        _close(out, want)
    calls.clear()
    attn_mod.sdpa_attention(_module(), q, k, v, None, scaling=0.1)  # no mask: SDPA is_causal as before
    short = q[:, :, : attn_mod.KERNEL_MIN_Q - 1]
    attn_mod.sdpa_attention(_module(), short, k, v, hf_mask(2, short.shape[2], 33), scaling=0.1)  # decode
    q32, k32, v32 = qkv(2, 4, 2, 20, 33, attn_mod.MASKED_PREFILL_MIN_D - 16)
    attn_mod.sdpa_attention(_module(), q32, k32, v32, mask, scaling=0.1)  # head dim below the kernel's range
    attn_mod.sdpa_attention(_module(), q, k, v, mask, 0.1, scaling=0.1)  # dropout
    attn_mod.sdpa_attention(_module(training=True), q, k, v, mask, scaling=0.1)
    attn_mod.sdpa_attention(_module(), q, k, v, mask.expand(2, 4, 20, 33), scaling=0.1)  # per-head mask
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    attn_mod.sdpa_attention(_module(), q, k, v, additive, scaling=0.1)
    _, w = attn_mod.sdpa_attention(_module(), q, k, v, mask, scaling=0.1, output_attentions=True)
    assert calls == [] and w is not None
    monkeypatch.setenv("GEMMTUNE_MASKED_PREFILL", "Triton")
    assert env_mode() == "triton"
    monkeypatch.setenv("GEMMTUNE_MASKED_PREFILL", "flex")
    with pytest.raises(EnvVarError, match="GEMMTUNE_MASKED_PREFILL='flex'"):
        env_mode()
    with pytest.raises(ValueError, match="masked prefill mode 'fast'"):
        attn_mod.set_masked_prefill("fast")


def test_compiled_mask_skip_mirrors_transformers():
    """Under torch.compile the triton tier's mask function returns None where sdpa_mask does eagerly."""
    pytest.importorskip("transformers")
    from gemmtune.models import attention as attn_mod

    L = attn_mod.KERNEL_MIN_Q + 3
    kw = {"batch_size": 1, "q_length": L, "kv_length": L, "q_offset": 0, "kv_offset": 0, "attention_mask": None,
          "allow_is_causal_skip": True}  # fmt: skip
    assert attn_mod.triton_mask(**kw) is None  # eager: transformers' own sdpa_mask, which skips it too
    assert attn_mod.triton_mask(**{**kw, "allow_is_causal_skip": False}).shape == (1, 1, L, L)
    hits = []

    def f(x):
        hits.extend(attn_mod._compiled_mask_skip(dict(kw, **over)) for over in (
            {}, {"local_size": L + 1}, {"local_size": L}, {"allow_is_causal_skip": False},
            {"attention_mask": torch.ones(1, L, dtype=torch.bool)}, {"kv_length": L + 4},
            {"q_length": 1, "kv_length": 1},
        ))  # fmt: skip
        return x + 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(1))
    assert hits == [True, True, False, False, False, False, False]


def test_gemma2_optimize_runs_the_kernel_eager(kernel_on_cpu):
    """auto picks the triton tier for a softcapped model where the kernel runs; prefill goes through the
    op eagerly, with stock eager Gemma-2's logits (softcap kept)."""
    from test_attention_flex import check_gemma2, gemma2_pair, long_batch

    attn_mod, calls = kernel_on_cpu
    stock, opt, report = gemma2_pair()
    assert report.attention_tier == "triton"
    assert "triton tier via transformers' AttentionInterface (auto: softcap 2.0" in report.summary()
    check_gemma2(stock, opt, "cpu", rtol=1e-4, atol=1e-4)
    ids, pad = long_batch("cpu")
    calls.clear()
    with torch.no_grad():
        opt(ids, use_cache=False)
        assert {c[3:] for c in calls} == {(None, CAP, False), (6, CAP, False)}  # full layers; sliding ones
        calls.clear()
        opt(ids, attention_mask=pad, use_cache=False)
        assert {c[2:] for c in calls} == {(False, None, CAP, True)}  # padded: the kernel with the mask


@pytest.mark.slow  # torch.compile of the model; test_models_optimize compiles one in the default tier
def test_gemma2_optimize_runs_the_kernel_compiled(kernel_on_cpu):
    """Prefill of the triton tier goes through the op inside torch.compile(fullgraph) too, with stock eager
    Gemma-2's logits."""
    from test_attention_flex import check_gemma2, gemma2_pair, long_batch

    attn_mod, calls = kernel_on_cpu
    stock, opt, report = gemma2_pair()
    assert report.attention_tier == "triton"
    ids, _ = long_batch("cpu")
    torch._dynamo.reset()
    compiled = torch.compile(opt, fullgraph=True, backend="aot_eager")
    check_gemma2(stock, opt, "cpu", rtol=1e-4, atol=1e-4, compiled=compiled)
    calls.clear()
    with torch.no_grad():
        compiled(ids, use_cache=False)
        # transformers materializes the masks while tracing: every layer runs the masked kernel
        assert len(calls) == 2 and {c[2:] for c in calls} == {(False, None, CAP, True)}
        calls.clear()
        compiled(ids, use_cache=True)  # a fresh cache: the full layers' mask is skipped as eagerly
        assert {c[2:] for c in calls} == {(True, None, CAP, False), (False, None, CAP, True)}


# ---- GPU ----------------------------------------------------------------------------------------
def _gemma_qkv(device, L=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    return make_qkv(1, 16, 8, L, L, 256, torch.bfloat16, "hf", g, device)


@pytest.mark.gpu
def test_graph_replay_equals_eager_gpu(gpu):
    from kernel_cases import assert_replays_bit_equal

    q, k, v = _gemma_qkv(gpu)

    def run(q, k, v):
        return attn_ops.softcap_attention(q, k, v, 256**-0.5, 50.0, True, 512)

    eager = run(q, k, v)
    torch.cuda.synchronize()
    assert_replays_bit_equal(run, (q, k, v), eager, "softcap_attention")
    mask = causal_lm_mask(1, 1000, 1000, None, (37,), 0, False).to(gpu)

    def run_masked(q, k, v):
        return attn_ops.softcap_attention(q, k, v, 256**-0.5, 50.0, True, None, mask)

    eager = run_masked(q, k, v)
    torch.cuda.synchronize()
    assert_replays_bit_equal(run_masked, (q, k, v), eager, "softcap_attention with a mask")


@pytest.mark.gpu
def test_inductor_compile_equals_eager_gpu(gpu):
    q, k, v = _gemma_qkv(gpu, L=777, seed=1)

    def f(q, k, v):
        return attn_ops.softcap_attention(q, k, v, 256**-0.5, 50.0, True, None).flatten(2) + 1

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(q, k, v)
    torch.testing.assert_close(got, f(q, k, v), rtol=0, atol=0)


@pytest.mark.gpu
def test_fast_tanh_is_as_accurate_as_the_exact_formula_gpu(gpu, monkeypatch):
    """tanh.approx.f32 (what FlashAttention's softcap uses too) against the exp formula, both against the
    fp32 reference: the approximation must not add error beyond the bf16 rounding both already have
    (their outputs differ by an ulp or two of bf16 here, 0.0156 at most on the H100)."""
    q, k, v = _gemma_qkv(gpu, L=513, seed=2)
    want = kattn.softcap_attention_ref(q, k, v, softcap=50.0)
    fast = kattn.softcap_attention(q, k, v, softcap=50.0)
    monkeypatch.setattr(kattn, "_fast_tanh", lambda t: False)
    exact = kattn.softcap_attention(q, k, v, softcap=50.0)

    def rel(t):
        return ((t.float() - want.float()).norm() / want.float().norm()).item()

    assert rel(exact) < 1e-2
    assert rel(fast) <= 1.5 * rel(exact) + 1e-4, (rel(fast), rel(exact))


@pytest.mark.gpu
def test_gemma2_triton_tier_bf16_gpu(gpu, monkeypatch):
    """optimize() on Gemma-2 (bf16, softcap kept) through the triton tier: stock eager attention's logits,
    eagerly (prefill, padded prefill, cached prefill then decode) and under inductor."""
    from test_attention_flex import check_gemma2, gemma2_pair

    from gemmtune.models import attention as attn_mod

    monkeypatch.setenv(attn_mod.ENV, "triton")
    calls = []
    real = attn_ops._run

    def spy(q, k, v, mask, *rest):
        calls.append(mask is not None)
        return real(q, k, v, mask, *rest)

    monkeypatch.setattr(attn_ops, "_run", spy)
    stock, opt, report = gemma2_pair(gpu, torch.bfloat16)
    assert report.attention_tier == "triton"
    check_gemma2(stock, opt, gpu, rtol=3e-2, atol=3e-2)
    assert False in calls and True in calls  # mask-free and padded prefill both ran the kernel
    calls.clear()
    torch._dynamo.reset()
    check_gemma2(stock, opt, gpu, rtol=3e-2, atol=3e-2, compiled=torch.compile(opt))
    assert calls


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES + MASK_CASES), "cpu")))
