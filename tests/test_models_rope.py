"""Triton rotary embedding (q and k in one launch) vs the reference and transformers' own functions.

Without a GPU the kernel runs under the Triton interpreter in a subprocess (see test_norms.py); with
one, in-process on the GPU, bf16 included. Outputs are NaN-poisoned first.
"""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, kernel_results, nan_outputs
from tiers import tiered_at

from gemmtune.kernels import rope as R

HAS_GPU = torch.cuda.is_available()

# (name, B, S, Hq, Hkv, D, rotary dim, cos batch, layout, dtype)
CASES = [
    (f"{dt}-{lay}-r{r}-cb{cb}-h{hq}x{hkv}", 2, 5, hq, hkv, 16, r, cb, lay, dt)
    for dt in ("float32", "float16")
    for lay in ("qkv", "contig")
    for r in (16, 8)
    for cb in (1, 2)
    for hq, hkv in ((4, 2), (12, 3))
] + [("float16-qkv-llama8b-decode", 8, 1, 32, 8, 128, 128, 1, "qkv", "float16")]
# interleaved (DeepSeek's rope_interleave): "-il" in the name; "mla": q and k the rope slices of MLA's
# q_b_proj [B, S, H, 128 + D] and kv_a_proj [B, S, 512 + D] outputs
CASES += [
    (f"{dt}-{lay}-il-cb{cb}-h{hq}x{hkv}", 2, 5, hq, hkv, 16, 16, cb, lay, dt)
    for dt in ("float32", "float16")
    for lay in ("qkv", "mla")
    for cb in (1, 2)
    for hq, hkv in ((4, 2), (12, 1))
] + [("float16-mla-il-deepseek-v3-decode", 8, 1, 128, 1, 64, 64, 1, "mla", "float16")]
GPU_CASES = [(n.replace("float16", "bfloat16"), *c[:-1], "bfloat16") for n, *c in CASES if c[-1] == "float16"]
ALL = CASES + (GPU_CASES if HAS_GPU else [])


def run_cases(cases, device: str) -> dict:
    with nan_outputs(R):
        return _run_cases(cases, device)


def _run_cases(cases, device: str) -> dict:
    out = {}
    for name, B, S, HQ, HKV, D, r, cb, lay, dt in cases:
        dtype = getattr(torch, dt)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        il = "-il" in name
        if lay == "mla":
            q = torch.randn(B, S, HQ, 128 + D, generator=gen).to(dtype).to(device)[..., 128:]
            k = torch.randn(B, S, 512 + HKV * D, generator=gen).to(dtype).to(device)[..., 512:].view(B, S, HKV, D)
        elif lay == "qkv":  # views into a fused [B, S, (Hq + 2 Hkv) D] projection output
            full = torch.randn(B, S, (HQ + 2 * HKV) * D, generator=gen).to(dtype).to(device)
            q = full[..., : HQ * D].view(B, S, HQ, D)
            k = full[..., HQ * D : (HQ + HKV) * D].view(B, S, HKV, D)
        else:
            q = torch.randn(B, S, HQ, D, generator=gen).to(dtype).to(device)
            k = torch.randn(B, S, HKV, D, generator=gen).to(dtype).to(device)
        cos = torch.randn(cb, S, r, generator=gen).to(dtype).to(device)
        sin = torch.randn(cb, S, r, generator=gen).to(dtype).to(device)
        qo, ko = R.rope(q, k, cos, sin, impl="triton", interleaved=il)
        qr, kr = R.rope_ref(q, k, cos, sin, interleaved=il)
        inplace = 0.0
        if lay == "mla":  # q_rot written back into the projection's output, in place
            qi, _ = R.rope(q, k, cos, sin, impl="triton", interleaved=il, out_q=q)
            same = qi.data_ptr() == q.data_ptr()
            inplace = (q.float() - qr.float()).abs().max().item() if same else float("inf")
        out[name] = {
            "shape_ok": qo.shape == q.shape and ko.shape == k.shape and qo.is_contiguous() and ko.is_contiguous(),
            "nan": bool(torch.isnan(qo).any().item() or torch.isnan(ko).any().item()),
            "err": max((qo.float() - qr.float()).abs().max().item(), (ko.float() - kr.float()).abs().max().item())
            / max(qr.float().abs().max().item(), kr.float().abs().max().item(), 1e-30),
            "inplace_err": inplace / max(qr.float().abs().max().item(), 1e-30),
        }
    return out


@pytest.fixture(scope="module")
def results(request):
    return kernel_results(__file__, run_cases, CASES, GPU_CASES, request)


# The default tier: every third case of the cross products (each dtype, layout, rotary width, batch
# config and head split appears), and the model-sized decode cases; the rest is slow.
_DEFAULT = {i for i, c in enumerate(CASES) if i % 3 == 0 or "decode" in c[0]}


@pytest.mark.parametrize("case", tiered_at(CASES, _DEFAULT) + (GPU_CASES if HAS_GPU else []), ids=lambda c: c[0])
def test_kernel_matches_reference(case, results):
    r = results[case[0]]
    assert r["shape_ok"] and not r["nan"], r
    # Same roundings as the reference (exact in fp16/bf16); in fp32 an FMA may move the last bit.
    assert r["err"] <= {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[case[-1]], r
    assert r["inplace_err"] <= {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[case[-1]], r


def test_reference_is_transformers_apply_rotary_pos_emb():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3

    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(2, 3, 4, 16).to(dtype), torch.randn(2, 3, 2, 16).to(dtype)
        for fn, r in ((llama, 16), (phi3, 16), (phi3, 8)):
            cos, sin = torch.randn(2, 3, r).to(dtype), torch.randn(2, 3, r).to(dtype)
            hq, hk = fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            rq, rk = R.rope_ref(q, k, cos, sin)
            assert torch.equal(hq.transpose(1, 2), rq) and torch.equal(hk.transpose(1, 2), rk)


def test_interleaved_reference_is_deepseek_apply_rotary_pos_emb_interleave():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave as ds

    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(2, 3, 4, 16).to(dtype), torch.randn(2, 3, 1, 16).to(dtype)
        # a rotary embedding's cos / sin are cat(angles, angles) (transformers 5.24's form reads one half)
        cos, sin = (torch.randn(2, 3, 8).to(dtype).repeat(1, 1, 2) for _ in range(2))
        hq, hk = ds(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        rq, rk = R.rope_ref(q, k, cos, sin, interleaved=True)
        assert torch.equal(hq.transpose(1, 2), rq) and torch.equal(hk.transpose(1, 2), rk)
        assert not torch.equal(rq, R.rope_ref(q, k, cos, sin)[0])  # the pairs' order matters
    with pytest.raises(ValueError, match="interleaved rotary needs R == D"):
        R.rope(q, k, cos[..., :8], sin[..., :8], interleaved=True)


def test_bad_shapes_raise():
    q, k = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 2, 16)
    with pytest.raises(ValueError, match="cos/sin"):
        R.rope(q, k, torch.randn(1, 3, 18), torch.randn(1, 3, 18))
    with pytest.raises(ValueError, match="do not fit"):
        R.rope(q, torch.randn(1, 4, 2, 16), torch.randn(1, 3, 16), torch.randn(1, 3, 16))


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(chosen_cases(CASES), "cpu")))
