"""The MLA latent decode kernel (kernels/mla_decode.py): every query head against the shared latent cache.

Kernel cases against the fp32 reference, outputs NaN-poisoned: 1..16 query tokens, head counts that do
and do not fill a row block, odd latent / rope widths and key counts, a mask broadcast over the batch and
one per sequence, a row that sees no key (0), one token with no mask, queries and caches as strided
views (the projections' and transformers' cache layouts), one and many splits; fp32 / fp16 under
Triton's interpreter, bf16 on the GPU at DeepSeek-V3's shapes; the arrival counters left zero; a CUDA
graph's replays bit-equal to the eager call."""

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

from gemmtune.kernels import mla_decode as kmla

HAS_GPU = torch.cuda.is_available()

# (B, H, L, S, mask keys, R, dr, dtype, mask "batch" | "shared" | "none", views "contig" | "strided")
CASES = [
    (2, 4, 1, 100, 110, 32, 16, "float32", "batch", "contig"),
    (1, 5, 3, 70, 70, 24, 8, "float16", "shared", "strided"),  # 15 rows: one block, one row masked off
    (3, 16, 1, 200, 0, 64, 16, "float32", "none", "strided"),
    (2, 3, 2, 5, 8, 40, 12, "float32", "batch", "contig"),  # fewer keys than a block
    (1, 8, 16, 129, 129, 16, 16, "float16", "batch", "contig"),  # 128 rows: 8 row blocks
]
GPU_CASES = [
    (1, 128, 1, 1040, 1040, 512, 64, "bfloat16", "shared", "strided"),  # DeepSeek-V3 decode, static cache
    (8, 128, 1, 1040, 1040, 512, 64, "bfloat16", "batch", "strided"),
    (2, 128, 4, 4097, 4100, 512, 64, "bfloat16", "batch", "contig"),  # 4 speculative tokens
    (2, 16, 1, 33, 0, 512, 64, "bfloat16", "none", "contig"),  # tp8's 16 heads a rank
]


def inputs(case, device):
    B, H, L, S, Sm, R, dr, dt, how, views = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    dtype = getattr(torch, dt)
    if views == "strided":  # the q_b_proj output [B, L, H, dn + dr] read per head; the cache [B, 1, S, R + 3]
        q = torch.randn(B, L, H, R + dr + 3, generator=g).transpose(1, 2)
        q_lat, q_rot = q[..., :R], q[..., R : R + dr]
        latent = torch.randn(B, 1, S, R + 3, generator=g)[:, 0, :, :R]
        k_rot = torch.randn(B, 1, S, dr + 5, generator=g)[:, 0, :, :dr]
    else:
        q_lat, q_rot = torch.randn(B, H, L, R, generator=g), torch.randn(B, H, L, dr, generator=g)
        latent, k_rot = torch.randn(B, S, R, generator=g), torch.randn(B, S, dr, generator=g)
    mask = None
    if how != "none":
        mask = torch.rand(B if how == "batch" else 1, 1, L, Sm, generator=g) > 0.3
        mask[0, 0, 0, :] = False  # a row that sees no key
    move = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731 (keeps the views' strides)
    scale = (R + dr) ** -0.5
    return move(q_lat), move(q_rot), move(latent), move(k_rot), None if mask is None else mask.to(device), scale


def run_cases(cases, device) -> dict:
    out = {}
    for case in cases:
        q_lat, q_rot, latent, k_rot, mask, scale = inputs(case, device)
        B, H, L, R = q_lat.shape
        counters = torch.zeros(kmla.counters_needed(B, H, L), dtype=torch.int32, device=device)
        with nan_outputs(kmla):
            y = kmla.mla_decode(q_lat, q_rot, latent, k_rot, mask, scale, counters)
        ref = kmla.mla_decode_ref(q_lat.float(), q_rot.float(), latent.float(), k_rot.float(), mask, scale)
        out[repr(case)] = split_attention_facts(y, ref, (B, L, H, R), q_lat.dtype, mask, counters)
        out[repr(case)]["blocks"] = kmla.head_blocks(H, L)
    return out


def results():
    return kernel_results(__file__, run_cases, CASES, GPU_CASES)


@pytest.fixture(scope="module")
def res():
    return results()


@pytest.mark.parametrize("case", CASES + (GPU_CASES if HAS_GPU else []), ids=repr)
def test_mla_decode_matches_fp32_reference(case, res):
    assert_split_attention_ok(res[repr(case)], case[7])


def test_cases_cover_one_and_many_row_blocks(res):
    blocks = {res[repr(c)]["blocks"] for c in CASES}
    assert 1 in blocks and max(blocks) > 1, blocks


def test_reference_is_attention_over_the_expanded_keys():
    """mla_decode_ref equals SDPA over keys [latent | k_rot] and values latent, shared by every head."""
    g = torch.Generator().manual_seed(3)
    B, H, L, S, R, dr = 2, 3, 2, 20, 16, 8
    q_lat, q_rot = torch.randn(B, H, L, R, generator=g), torch.randn(B, H, L, dr, generator=g)
    latent, k_rot = torch.randn(B, S, R, generator=g), torch.randn(B, S, dr, generator=g)
    mask = torch.rand(B, 1, L, 24, generator=g) > 0.5
    mask[..., 0] = True
    k = torch.cat([latent, k_rot], -1)[:, None].expand(B, H, S, R + dr)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.cat([q_lat, q_rot], -1), k, latent[:, None].expand(B, H, S, R), attn_mask=mask[..., :S], scale=0.2
    )
    torch.testing.assert_close(kmla.mla_decode_ref(q_lat, q_rot, latent, k_rot, mask, 0.2), want.transpose(1, 2))


def test_mla_decode_refuses_what_it_does_not_compute():
    ql, qr, c, r = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 8), torch.zeros(1, 5, 16), torch.zeros(1, 5, 8)
    assert "beyond the MLA decode kernel" in kmla.takes(torch.zeros(1, 4, 17, 16), torch.zeros(1, 4, 17, 8), c, r,
                                                         torch.ones(1, 1, 17, 5, dtype=torch.bool))  # fmt: skip
    assert "do not fit together" in kmla.takes(ql, torch.zeros(1, 4, 1, 4), c, r, None)
    assert "2 query tokens and no mask" in kmla.takes(torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 8), c, r, None)
    assert "is not a boolean [B|1, 1, 1, >=5] mask" in kmla.takes(ql, qr, c, r, torch.zeros(1, 1, 1, 5))
    assert kmla.takes(ql, qr, c, r, torch.ones(1, 1, 1, 9, dtype=torch.bool)) == ""
    with pytest.raises(ValueError, match="mla_decode: dtypes differ"):
        kmla.mla_decode(ql, qr, c.half(), r, None, 1.0, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="counters must be int32 with >= 1 elements"):
        kmla.mla_decode(ql, qr, c, r, None, 1.0, torch.zeros(0, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_graph_replays_equal_eager(gpu):
    q_lat, q_rot, latent, k_rot, mask, scale = inputs(GPU_CASES[1], gpu)
    B, H, L, _ = q_lat.shape
    counters = torch.zeros(kmla.counters_needed(B, H, L), dtype=torch.int32, device=gpu)
    with nan_outputs(kmla):
        eager = kmla.mla_decode(q_lat, q_rot, latent, k_rot, mask, scale, counters)
        assert_replays_bit_equal(lambda *a: kmla.mla_decode(*a, scale, counters), (q_lat, q_rot, latent, k_rot, mask),
                                 eager, "mla_decode")  # fmt: skip
    assert not counters.any()


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(run_cases(CASES, "cpu")))
