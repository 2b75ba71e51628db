"""The static KV cache's update in one launch (kernels/kv_cache.py) and where optimize()'s attention uses it
(models/static_cache.py).

Kernel cases against transformers' own update (static_write_ref: arange, index_copy_, the length's add):
caches of random values (so a write to a wrong position shows), strided new states (the fused qkv
output's views), a prefill then decode steps on the same cache (the arrival counter re-arms), k and v
head sizes that differ, fp16/fp32 under Triton's interpreter and bf16 on the GPU, and writes past the end
left out. Model: the tiny Llama and Qwen2-MoE optimized, decoding on a StaticCache, logits equal to stock's
with every layer's update taken by the kernel; caches it does not take fall back to their own update."""

from __future__ import annotations

import json
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, kernel_results
from tiers import tiered_at

from gemmtune.kernels import kv_cache

HAS_GPU = torch.cuda.is_available()

# (B, H, S, DK, DV, steps: new positions per call, start length, dtype, states "contig" | "strided")
CASES = [
    (1, 1, 8, 4, 4, (1,), 0, "float32", "contig"),
    (2, 3, 40, 16, 16, (5, 1, 1, 1), 0, "float32", "strided"),
    (3, 2, 64, 32, 24, (17, 1, 2), 3, "float16", "strided"),  # a prefill over two programs, DK != DV
    (2, 2, 12, 8, 8, (2, 1), 9, "float32", "contig"),  # the second call ends exactly at S
]
OVERFLOW = (2, 2, 10, 8, 8, (4,), 8, "float32", "contig")  # positions 10, 11 fall past the end
GPU_CASES = [(8, 16, 1100, 128, 128, (1024, 1, 1, 1), 0, "bfloat16", "strided"), (1, 8, 300, 64, 64, (1,), 299,
             "bfloat16", "contig")]  # fmt: skip


def _states(case, L, g):
    B, H, _, DK, DV, _, _, dt, layout = case
    dtype = getattr(torch, dt)
    if layout == "strided":  # [B, L, H, D] views transposed, as the fused q/k/v output is read
        qkv = torch.randn(B, L, H, DK + DV + 5, generator=g).to(dtype)
        return qkv[..., :DK].transpose(1, 2), qkv[..., DK : DK + DV].transpose(1, 2)
    return torch.randn(B, H, L, DK, generator=g).to(dtype), torch.randn(B, H, L, DV, generator=g).to(dtype)


def run_case(case, device, overflow=False) -> dict:
    B, H, S, DK, DV, steps, start, dt, _ = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    dtype = getattr(torch, dt)
    keys = torch.randn(B, H, S, DK, generator=g).to(dtype)
    values = torch.randn(B, H, S, DV, generator=g).to(dtype)
    mine = [t.clone().to(device) for t in (keys, values)]
    length = torch.tensor(start, dtype=torch.int64, device=device)
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    ref = [keys.clone(), values.clone()]
    ref_len = torch.tensor(start, dtype=torch.int64)
    for L in steps:
        k, v = _states(case, L, g)
        kv_cache.static_write(*mine, k.to(device), v.to(device), length, arrivals)
        if overflow:  # what fits is written, the rest left out
            n = S - int(ref_len)
            ref[0][:, :, int(ref_len) :] = k[:, :, :n]
            ref[1][:, :, int(ref_len) :] = v[:, :, :n]
            ref_len += L
        else:
            kv_cache.static_write_ref(*ref, k, v, ref_len)
    return {
        "keys": bool(torch.equal(mine[0].cpu(), ref[0])),
        "values": bool(torch.equal(mine[1].cpu(), ref[1])),
        "length": int(length.item()) == int(ref_len) == start + sum(steps),
        "rearmed": int(arrivals.item()) == 0,
    }


DECODE_MODELS = ["llama", "qwen2-moe"]


def static_decode(device, names=DECODE_MODELS) -> dict:
    """Tiny Llama and Qwen2-MoE (fp32), optimize()d, decoding on a StaticCache against stock on its own."""
    from test_models_moe_families import build as build_moe
    from test_models_parity import build
    from transformers import StaticCache

    import gemmtune
    from gemmtune.models import static_cache
    from gemmtune.models.hf_cache import with_cache

    out = {}
    for name in names:
        stock = build(name, device) if name == "llama" else build_moe(name).to(device)
        opt = build(name, device) if name == "llama" else build_moe(name).to(device)
        gemmtune.optimize(opt)
        caches = [StaticCache(config=m.config, max_cache_len=24) for m in (stock, opt)]
        ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(7)).to(device)
        worst = 0.0
        with torch.no_grad():
            for step in range(4):
                x = ids if step == 0 else ids[:, step : step + 1]
                pos = torch.arange(9, device=device) if step == 0 else torch.tensor([8 + step], device=device)
                a = stock(x, **with_cache(stock, caches[0]), use_cache=True, cache_position=pos).logits
                b = opt(x, **with_cache(opt, caches[1]), use_cache=True, cache_position=pos).logits
                worst = max(worst, (a - b).abs().max().item())
        taken = sum(layer in static_cache._ARRIVALS for layer in caches[1].layers)  # the kernel's counters
        out[name] = {"err": worst, "layers": len(caches[1].layers), "taken": taken,
                     "lengths": [int(layer.cumulative_length) for layer in caches[1].layers]}  # fmt: skip
    return out


def _all(device, chosen=list) -> dict:
    """The selected cases' results (chosen(of): the selected ones of `of`), the overflow case and the
    selected models' decode."""
    cases = chosen(CASES) + (GPU_CASES if device == "cuda" else [])
    res = {repr(c): run_case(c, device) for c in cases}
    res["overflow"] = run_case(OVERFLOW, device, overflow=True)
    res["decode"] = static_decode(device, chosen(DECODE_MODELS))
    return res


@pytest.fixture(scope="module")
def results(request):
    def run(cases, device):
        return _all(device, lambda of: [c for c in of if c in cases])

    return kernel_results(__file__, run, CASES + DECODE_MODELS, [], request)


@pytest.mark.parametrize("case", tiered_at(CASES, {0, 2}) + (GPU_CASES if HAS_GPU else []), ids=repr)
def test_static_write_matches_the_stock_update(case, results):
    r = results[repr(case)]
    assert all(r.values()), r


def test_writes_past_the_end_are_left_out(results):
    r = results["overflow"]
    assert all(r.values()), r


@pytest.mark.parametrize("name", tiered_at(DECODE_MODELS, {0}))
def test_optimized_decode_on_a_static_cache(name, results):
    pytest.importorskip("transformers")
    r = results["decode"][name]
    assert r["taken"] == r["layers"] > 0, r  # every layer's update ran the kernel
    assert r["lengths"] == [12] * r["layers"], r  # 9 prompt tokens + 3 steps
    assert r["err"] < 1e-4, r


def test_static_write_rejects_what_it_cannot_take():
    keys, values = torch.zeros(1, 2, 8, 4), torch.zeros(1, 2, 8, 4)
    length, arrivals = torch.zeros((), dtype=torch.int64), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"states \(1, 3, 1, 4\) / \(1, 3, 1, 4\): the states do not fit"):
        kv_cache.static_write(keys, values, torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), length, arrivals)
    with pytest.raises(ValueError, match="dtypes differ: cache torch.float32/torch.float32, states torch.float16"):
        kv_cache.static_write(keys, values, torch.zeros(1, 2, 1, 4).half(), torch.zeros(1, 2, 1, 4), length, arrivals)
    with pytest.raises(ValueError, match="length must be one int64, got torch.int32"):
        kv_cache.static_write(keys, values, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), length.int(), arrivals)


def test_caches_it_does_not_take_update_themselves():
    """A DynamicCache, a device Triton does not run on (this CPU without the interpreter) and states that
    need gradients keep the cache's own update."""
    tf = pytest.importorskip("transformers")
    from gemmtune.models import static_cache

    cfg = tf.LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=32, vocab_size=32)  # fmt: skip
    k = torch.randn(1, 2, 3, 8)
    dynamic = tf.DynamicCache(config=cfg)
    keys, _ = static_cache.update(dynamic, k, k.clone(), 0)
    assert torch.equal(keys, k) and static_cache.static_layer(dynamic, 0, k, k) is None
    static = tf.StaticCache(config=cfg, max_cache_len=8)
    static.update(k, k.clone(), 0)  # initializes the layer (stock)
    assert static_cache.static_layer(static, 0, k, k.requires_grad_()) is None
    if torch.cuda.is_available():
        return
    keys, _ = static_cache.update(static, k.detach(), k.detach(), 0)  # the CPU: the layer's own update
    assert int(static.layers[0].cumulative_length) == 6 and torch.equal(keys[:, :, 3:6], k.detach())


@pytest.mark.gpu
def test_gpu_static_write_replays_in_a_cuda_graph(gpu):
    """Captured once, replayed three times: three positions written, the length moved on each time."""
    keys, values = torch.zeros(2, 4, 16, 8, device=gpu), torch.zeros(2, 4, 16, 8, device=gpu)
    length = torch.zeros((), dtype=torch.int64, device=gpu)
    arrivals = torch.zeros(1, dtype=torch.int32, device=gpu)
    k = torch.randn(2, 4, 1, 8, device=gpu)
    kv_cache.static_write(keys, values, k, k, length, arrivals)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_cache.static_write(keys, values, k, k, length, arrivals)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert int(length.item()) == 4 and int(arrivals.item()) == 0
    assert torch.equal(keys[:, :, :4], k.expand(-1, -1, 4, -1)) and not keys[:, :, 4:].any()


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(_all("cpu", chosen_cases)))


def test_static_layer_under_torch_compile_warns_nothing(monkeypatch):
    """Under torch.compile the cache keeps its own update, decided before any functools.cache call:
    dynamo warns once per process about each such call it traces into."""
    import warnings

    import torch._dynamo.utils as dynamo_utils

    from gemmtune.models import static_cache

    monkeypatch.setattr(dynamo_utils, "warn_once_cache", set())  # an earlier test's warning does not hide ours
    k = torch.zeros(1, 1, 1, 4)
    no_cache = None

    @torch.compile(backend="eager", fullgraph=True)
    def taken(k):
        return k + (0.0 if static_cache.static_layer(no_cache, 0, k, k) is None else 1.0)

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = taken(k)
    torch._dynamo.reset()
    assert torch.equal(out, k)
    assert not [w for w in caught if "static_cache.py" in str(w.message)], [str(w.message) for w in caught]
