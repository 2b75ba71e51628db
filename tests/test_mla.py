"""Absorbed multi-head latent attention (models/mla.py) against the stock expansion: kv_b_proj applied
to the latent cache, per-head keys and values, softmax attention; odd sizes, bool / additive / no mask,
fp32 on the CPU and bf16 on a GPU. The model-level parity (DeepSeek-V3 on the cached decode path) is in
test_models_moe_families.py."""

from __future__ import annotations

import pytest
import torch

from gemmtune.models import mla

B, H, S, DN, DR, DV, R = 3, 5, 37, 12, 6, 10, 20


def expanded_reference(q_nope, q_rot, kv_latent, k_rot, w, scaling, mask):
    """Transformers' way, in fp64: every cached latent through kv_b_proj, then attention per head."""
    q_nope, q_rot, kv_latent, k_rot, w = (t.double() for t in (q_nope, q_rot, kv_latent, k_rot, w))
    kv = (kv_latent[:, 0] @ w.T).view(B, S, H, DN + DV).transpose(1, 2)  # [B, H, S, dn + dv]
    k = torch.cat([kv[..., :DN], k_rot.expand(B, H, S, DR)], dim=-1)
    q = torch.cat([q_nope, q_rot], dim=-1)
    scores = q @ k.transpose(-1, -2) * scaling
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ kv[..., DN:]).transpose(1, 2)  # [B, L, H, dv]


def inputs(L, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return r(B, H, L, DN), r(B, H, L, DR), r(B, 1, S, R), r(B, 1, S, DR), r(H * (DN + DV), R) * 0.3


def masks(L, device):
    pad = torch.ones(B, 1, L, S + 4, dtype=torch.bool, device=device)  # wider than S, as a static cache's
    pad[1, ..., :7] = False  # left padding of one row
    pad[2, ..., 30:] = False  # unfilled static-cache slots
    add = torch.zeros(B, 1, L, S + 4, device=device).masked_fill(~pad, float("-inf"))
    return {"none": None, "bool": pad, "additive": add}


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("kind", ["none", "bool", "additive"])
def test_absorbed_matches_the_expansion_fp32(L, kind):
    q_nope, q_rot, lat, k_rot, w = inputs(L, torch.float32, "cpu", seed=L)
    mask = masks(L, "cpu")[kind]
    got = mla.absorbed_attention_ref(q_nope, q_rot, lat, k_rot, w, DV, 0.17, mask)
    want = expanded_reference(q_nope, q_rot, lat, k_rot, w, 0.17, None if mask is None else mask[..., :S])
    assert got.shape == (B, L, H, DV) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    other = expanded_reference(q_nope, q_rot, lat, k_rot, w, 0.2, None)  # a wrong scale is far away
    assert (got.double() - other).abs().max() > 1e-2


def test_a_query_that_sees_no_key_gets_zeros():
    q_nope, q_rot, lat, k_rot, w = inputs(1, torch.float32, "cpu", seed=9)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[0] = False
    got = mla.absorbed_attention_ref(q_nope, q_rot, lat, k_rot, w, DV, 0.17, mask)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and not got.isnan().any()


@pytest.mark.parametrize("L", [1, 3])
def test_kernel_path_plumbing_matches_the_reference(L, monkeypatch):
    """The kernel path's per-head GEMMs, layouts and output view on the CPU, with the latent kernel's
    reference writing into the buffer the value GEMM reads (the kernel itself: test_mla_decode.py)."""
    from gemmtune.kernels import mla_decode as kmla

    calls = []

    def kernel(q_lat, q_rot, latent, k_rot, mask, scale, counters, check=True, out=None):
        B_, H_, L_, R_ = q_lat.shape
        assert not check and counters.dtype == torch.int32 and out.shape == (B_, L_, H_, R_)
        calls.append(q_lat.shape)
        out.copy_(kmla.mla_decode_ref(q_lat, q_rot, latent, k_rot, mask, scale))
        return out

    monkeypatch.setattr(mla.kmla, "mla_decode", kernel)
    q_nope, q_rot, lat, k_rot, w = inputs(L, torch.float32, "cpu", seed=40 + L)
    mask = masks(L, "cpu")["bool"]
    owner = torch.nn.Module()
    got = mla._absorbed_kernel(owner, q_nope, q_rot, lat, k_rot, w, DV, 0.17, mask)
    want = expanded_reference(q_nope, q_rot, lat, k_rot, w, 0.17, mask[..., :S])
    assert calls == [(B, H, L, R)] and got.shape == (B, L, H, DV)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert not mla._kernel_takes(q_nope, q_rot, lat, k_rot, mask)  # fp32 on the CPU: the reference serves


def test_plan_names_what_it_cannot_absorb():
    assert "not a transformers MLA attention" in mla.plan(torch.nn.Linear(3, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("L", [1, 4])
def test_absorbed_bf16_on_the_gpu(L, gpu):
    q_nope, q_rot, lat, k_rot, w = inputs(L, torch.bfloat16, gpu, seed=20 + L)
    mask = masks(L, gpu)["bool"]
    want = expanded_reference(q_nope, q_rot, lat, k_rot, w, 0.17, mask[..., :S])
    got = mla.absorbed_attention_ref(q_nope, q_rot, lat, k_rot, w, DV, 0.17, mask)
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 8e-3, err  # fp32 inside: the output's one bf16 rounding (2^-8 of the largest)
    assert mla._kernel_takes(q_nope, q_rot, lat, k_rot, mask)
    got = mla.absorbed_attention(torch.nn.Module(), q_nope, q_rot, lat, k_rot, w, DV, 0.17, mask)
    err = (got.double() - want).abs().max() / want.abs().max()
    assert got.shape == (B, L, H, DV) and err < 2.4e-2, err  # q_lat and the latent output round to bf16 too


def test_the_rope_kernel_stands_in_only_for_the_rotary_it_matches():
    """plan() probes the modeling module's rotary against kernels/rope's reference (bit for bit); a
    rotary it does not match keeps the module's own function."""
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    assert mla._rope_matches(ds.apply_rotary_pos_emb_interleave, True)
    assert mla._rope_matches(ds.apply_rotary_pos_emb, False)
    assert not mla._rope_matches(ds.apply_rotary_pos_emb_interleave, False)
    assert not mla._rope_matches(lambda q, k, cos, sin: (q * 2, k), False)
    assert not mla._rope_matches(lambda q, k: (q, k), False)  # another signature
