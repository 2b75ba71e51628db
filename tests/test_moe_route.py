"""Routing glue in Triton (kernels/moe_route.py): the sort of slots by expert, the top-k router and the
grouped sigmoid router (DeepSeek-V3, GLM-4-MoE), against their torch references, plus the host work of
the grouped_mm path (aten ops, Triton launches) and optimize() swapping the Qwen3-MoE / Mixtral routers.

Without a GPU the kernels run under Triton's interpreter (fp32/fp16) in a subprocess (kernel_cases.py);
with one, in-process, bf16 included, plus CUDA-graph replay equal to eager and torch.topk's own order
of tied values. Every output starts poisoned (NaN, or -7777 for ints), so a skipped element fails.

Sort cases: E not a power of two, experts with no slots, every slot on one expert, topk 1/2/8, T 1..300
(several programs), 128 experts (256 bins), out-of-range ids, expert parallelism, a shared expert.
"""

from __future__ import annotations

import contextlib
import json
import sys
import zlib

import pytest
import torch
from kernel_cases import chosen_cases, kernel_results
from tiers import tiered_at

from gemmtune.device import triton_runs_on
from gemmtune.kernels import fused_moe as kmoe
from gemmtune.kernels import moe_route

HAS_GPU = torch.cuda.is_available()

# (T, topk, E, routing, extra): routing "random", "one" (all slots on expert E-1), "low" (only experts
# 0..topk), extra "", "bad" (some ids out of range), "ep" (12 global ids, this rank holds E), "shared".
SORT_CASES = [
    (1, 1, 3, "random", ""),
    (7, 2, 5, "random", ""),
    (33, 8, 11, "random", ""),
    (300, 2, 13, "random", ""),
    (64, 8, 128, "random", ""),
    (29, 2, 6, "one", ""),
    (40, 2, 9, "low", ""),
    (50, 4, 7, "random", "bad"),
    (45, 2, 5, "random", "ep"),
    (37, 2, 5, "random", "shared"),
]
GPU_SORT_CASES = [(2048, 8, 128, "random", ""), (4096, 2, 60, "low", "bad"), (1000, 4, 60, "random", "shared")]
# (T, E, k, renorm, logits dtype, weights dtype, shared slots): shared > 0 appends a shared-expert gate column
ROUTER_CASES = [
    (1, 3, 1, True, "float32", "float32", 0),
    (7, 13, 2, True, "float32", "float32", 0),
    (300, 60, 8, False, "float32", "float32", 0),
    (37, 128, 8, True, "float16", "float16", 0),
    (5, 8, 2, True, "float16", "float32", 0),
    (19, 4, 4, False, "float16", "float16", 0),
    (9, 60, 4, False, "float32", "float32", 4),  # Qwen2-MoE: top 4 of 60 + a shared expert in 4 slots
    (70, 13, 3, True, "float16", "float16", 1),
    (3, 5, 2, False, "float32", "float32", 3),  # k + shared not a power of two
]
GPU_ROUTER_CASES = [(2048, 128, 8, True, "bfloat16", "bfloat16", 0), (77, 8, 2, True, "bfloat16", "float32", 0),
                    (8, 60, 4, False, "bfloat16", "bfloat16", 4)]  # fmt: skip
# grouped sigmoid routers: (T, E, k, n_group, topk_group, renorm, scale); DeepSeek-V3 is E=256 8 groups top 4,
# GLM-4.5 one group; a group size that is not a power of two; T over several programs
GROUPED_CASES = [
    (1, 16, 2, 4, 2, True, 1.0),
    (7, 64, 6, 8, 3, False, 2.5),
    (37, 256, 8, 8, 4, True, 2.5),
    (19, 24, 4, 3, 2, True, 1.5),
    (5, 128, 8, 1, 1, True, 1.0),
]
GPU_GROUPED_CASES = [(2048, 256, 8, 8, 4, True, 2.5), (300, 160, 6, 8, 3, True, 16.0)]


@contextlib.contextmanager
def poisoned():
    """moe_route's outputs start NaN (floats) or -7777 (ints)."""
    saved = moe_route._alloc

    def alloc(shape, dtype, device):
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7777, dtype=dtype, device=device)

    moe_route._alloc = alloc
    try:
        yield
    finally:
        moe_route._alloc = saved


def sort_inputs(case, device):
    T, topk, E, routing, extra = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    shared = 1 if extra == "shared" else 0
    n_routed = 12 if extra == "ep" else E
    ids = torch.stack([torch.randperm(n_routed, generator=g)[:topk] for _ in range(T)])
    if routing == "one":
        ids[:, 0] = n_routed - 1
        ids[:, 1:] = torch.arange(topk - 1).expand(T, topk - 1)
    elif routing == "low":
        ids = torch.stack([torch.randperm(topk + 1, generator=g)[:topk] for _ in range(T)])
    if extra == "bad":
        ids[::7, 0] = E + 2
        ids[3::11, -1] = -4
    emap = None
    if extra == "ep":  # global ids 1, 4, 6, 9, 11 are this rank's experts 0..4
        emap = torch.full((n_routed,), -1, dtype=torch.int32)
        emap[torch.tensor([1, 4, 6, 9, 11])] = torch.arange(5, dtype=torch.int32)
    id_dtype = torch.int64 if T % 2 else torch.int32  # (the HF routers' ids are int64)
    routing_ = kmoe.Routing(ids.to(device=device, dtype=id_dtype), topk, shared, n_routed, E,
                            None if emap is None else emap.to(device))  # fmt: skip
    return routing_, E + shared


def _sort_ref(r: kmoe.Routing, num_experts: int):
    local = kmoe.local_expert_ids(r.topk_ids, r.num_routed, r.expert_map, r.shared, r.num_local_routed)
    return moe_route.expert_sort_torch(local, num_experts)


def router_logits(case, device):
    T, E, _, _, dt, _, shared = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    # distinct values in every dtype: a permutation of a grid 1/16 apart, plus a small jitter
    x = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float() / 16 - E / 32
    x = x + torch.rand(T, E, generator=g) / 64
    if shared:  # the shared expert's gate logit, spread over the sigmoid's range
        x = torch.cat([x, torch.randn(T, 1, generator=g) * 3], dim=1)
    return x.to(device=device, dtype=getattr(torch, dt))


def grouped_inputs(case, device):
    """fp32 logits whose values (and so sigmoid scores) are 1/16 apart plus jitter, and a correction bias."""
    T, E = case[:2]
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    x = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float() / 16 - E / 32
    x = x + torch.rand(T, E, generator=g) / 64
    bias = torch.randn(E, generator=g) / 8
    x, bias = x.to(device), bias.to(device)
    if T == 19:  # column-major logits and a strided bias: both read through their strides
        x = x.t().contiguous().t()
        bias = torch.stack([bias, bias]).t().reshape(-1)[::2]
    return x, bias


def run_grouped(cases, device) -> dict:
    out = {}
    for case in cases:
        _, _, k, n_group, topk_group, renorm, scale = case
        x, bias = grouped_inputs(case, device)
        with poisoned():
            w, ids = moe_route.grouped_router_topk(x, bias, k, n_group, topk_group, renorm, scale)
        w_ref, ids_ref = moe_route.grouped_router_topk_ref(x, bias, k, n_group, topk_group, renorm, scale)
        mine, order = ids.sort(1)
        theirs, their_order = ids_ref.sort(1)
        out[repr(case)] = {
            "ids": bool(torch.equal(mine, theirs)),
            "largest_first": bool((lambda c: (c[:, :-1] >= c[:, 1:]).all())((x.sigmoid() + bias).gather(1, ids))),
            "dtype": str(w.dtype) == "torch.float32" and str(ids.dtype) == "torch.int64",
            "err": ((w.gather(1, order) - w_ref.gather(1, their_order)).abs().max() / scale).item(),
        }
    return out


def run_cases(sort_cases, router_cases, device) -> dict:
    out = {"sort": {}, "router": {}}
    for case in sort_cases:
        r, E = sort_inputs(case, device)
        with poisoned():
            got = moe_route.expert_sort(r, E)
        want = _sort_ref(r, E)
        out["sort"][repr(case)] = {f: bool(torch.equal(a, b)) and a.dtype == b.dtype
                                   for f, a, b in zip(got._fields, got, want)}  # fmt: skip
    for case in router_cases:
        T, E, k, renorm, _, wdt, shared = case
        x = router_logits(case, device)
        with poisoned():
            w, ids = moe_route.router_topk(x, k, renorm, getattr(torch, wdt), shared)
        w_ref, ids_ref = moe_route.router_topk_ref(x, k, renorm, getattr(torch, wdt), shared)
        out["router"][repr(case)] = {
            "ids": bool(torch.equal(ids, ids_ref)),
            "dtype": str(w.dtype) == f"torch.{wdt}",
            "err": (w.double() - w_ref.double()).abs().max().item(),
        }
    return out


def host_counts() -> dict:
    """aten ops and Triton launches of the grouped_mm pair (Triton glue) and of a whole optimized
    Qwen3-MoE block (router + experts); needs Triton to run (GPU, or the interpreter)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))
    from exp_moe_ops import OpCounter, count_block, count_triton, tiny_block
    from moe_cases import make_case

    import gemmtune
    from gemmtune.backends.fmoe.stages import GM, pair_runner

    dev = "cuda" if HAS_GPU else "cpu"
    key, inputs = make_case(("fp32", 40, 64, 32, 8, 2, "random", 0, 0, 0, ""), dev)
    run = pair_runner(key, GM, GM, triton_glue=True)
    run(*inputs)
    counter = OpCounter()
    with count_triton(counter) as launches, counter:
        run(*inputs)
    res = {"pair_ops": counter.launching(), "pair_triton": sum(launches.values())}
    # bf16 on the GPU, where fp32 experts run torch's bmm path (torch._grouped_mm takes no fp32)
    model = tiny_block(dev, torch.bfloat16 if HAS_GPU else torch.float32, 8, 2, 64, 32)
    report = gemmtune.optimize(model)
    res["router_swapped"] = report.counts().get("router", 0)
    x = torch.randn(1, 40, 64, device=dev, dtype=model.dtype)
    counter, launches = count_block(model.model.layers[0].mlp, x)
    res.update(block_ops=counter.launching(), block_triton=sum(launches.values()))
    return res


PARITY_ARCHS = ["qwen3_moe", "mixtral"]
HOST_COUNTS = ["host counts"]  # a part of _all() that a selected test asks for, as a case is


def optimize_parity(archs=PARITY_ARCHS) -> dict:
    """optimize() with the routers swapped vs stock, on the tiny Qwen3-MoE and Mixtral (fp32)."""
    from test_models_parity import batch, build

    import gemmtune

    dev = "cuda" if HAS_GPU else "cpu"
    res = {}
    for arch in archs:
        stock = build(arch, dev)
        opt = build(arch, dev)
        report = gemmtune.optimize(opt)
        ids, mask = batch(dev)
        with torch.no_grad():
            a = stock(ids, attention_mask=mask, use_cache=False).logits
            b = opt(ids, attention_mask=mask, use_cache=False).logits
        valid = mask.bool()
        res[arch] = {"routers": report.counts().get("router", 0),
                       "err": (a[valid] - b[valid]).abs().max().item()}  # fmt: skip
        gemmtune.restore(opt)
        res[arch]["restored"] = not any("forward" in layer.mlp.gate.__dict__ for layer in opt.model.layers
                                          if hasattr(layer.mlp, "gate"))  # fmt: skip
    return res


def _all(device, chosen=list) -> dict:
    """Every selected case's result (chosen(cases): the selected ones, in order), the host counts and the
    optimize() parity."""
    gpu = device == "cuda"
    res = run_cases(chosen(SORT_CASES) + (GPU_SORT_CASES if gpu else []),
                    chosen(ROUTER_CASES) + (GPU_ROUTER_CASES if gpu else []), device)  # fmt: skip
    res["grouped"] = run_grouped(chosen(GROUPED_CASES) + (GPU_GROUPED_CASES if gpu else []), device)
    if chosen(HOST_COUNTS):
        res["host"] = host_counts()
    res["parity"] = optimize_parity(chosen(PARITY_ARCHS))
    return res


@pytest.fixture(scope="module")
def results(request):
    def run(cases, device):
        return _all(device, lambda of: [c for c in of if c in cases])

    return kernel_results(__file__, run, SORT_CASES + ROUTER_CASES + GROUPED_CASES + PARITY_ARCHS + HOST_COUNTS, [],
                         request)  # fmt: skip


# The default tier of each sweep: a spread of its kinds (sizes, routings, extras, dtypes); the rest is slow.
_SORT_DEFAULT, _ROUTER_DEFAULT, _GROUPED_DEFAULT = {0, 7, 9}, {0, 6}, {3}


@pytest.mark.parametrize("case", tiered_at(SORT_CASES, _SORT_DEFAULT) + (GPU_SORT_CASES if HAS_GPU else []), ids=repr)
def test_expert_sort_matches_torch_sort(case, results):
    r = results["sort"][repr(case)]
    assert all(r.values()), r  # perm, tok, offs, inv: equal element for element, same dtypes


@pytest.mark.parametrize(
    "case", tiered_at(ROUTER_CASES, _ROUTER_DEFAULT) + (GPU_ROUTER_CASES if HAS_GPU else []), ids=repr
)
def test_router_topk_matches_reference(case, results):
    r = results["router"][repr(case)]
    assert r["ids"] and r["dtype"], r
    wdt = case[5]
    assert r["err"] <= {"float32": 2e-7, "float16": 1e-3, "bfloat16": 8e-3}[wdt], r


@pytest.mark.parametrize(
    "case", tiered_at(GROUPED_CASES, _GROUPED_DEFAULT) + (GPU_GROUPED_CASES if HAS_GPU else []), ids=repr
)
def test_grouped_router_topk_matches_reference(case, results):
    r = results["grouped"][repr(case)]
    assert r["ids"] and r["dtype"] and r["largest_first"], r
    assert r["err"] <= 1e-6, r  # fp32 throughout: the sigmoid's and the sum's last bits


def test_grouped_router_topk_rejects_bad_arguments():
    x, bias = torch.randn(3, 16), torch.zeros(16)
    with pytest.raises(ValueError, match=r"bias \(8,\) \(experts,\)"):
        moe_route.grouped_router_topk(x, torch.zeros(8), 2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"n_group=5 groups"):
        moe_route.grouped_router_topk(x, bias, 2, 5, 2, True, 1.0)
    with pytest.raises(ValueError, match=r"top_k=9 must be 1..8"):
        moe_route.grouped_router_topk(x, bias, 9, 4, 2, True, 1.0)


@pytest.mark.parametrize("part", tiered_at(HOST_COUNTS, set()))  # the interpreter counts them slowly
def test_grouped_mm_path_host_work_is_bounded(part, results):
    """aten ops that launch device work, and Triton launches. Before this glue: the grouped_mm pair
    22 ops + 2 launches, an optimized Qwen3-MoE block (router + experts) 26 ops + 2 launches (fp32).
    Now the pair is the gather and the two torch._grouped_mm (+ sort, activation, combine in Triton),
    the block adds the router's linear (+ its top-k kernel)."""
    h = results["host"]
    assert h["pair_ops"] <= 3 and h["pair_triton"] <= 3, h
    assert h["router_swapped"] == 1, h
    assert h["block_ops"] <= 4 and h["block_triton"] <= 4, h


@pytest.mark.parametrize("arch", tiered_at(PARITY_ARCHS, {0}))
def test_optimize_with_router_kernel_keeps_logits(arch, results):
    r = results["parity"][arch]
    assert r["routers"] >= 1 and r["restored"], r
    assert r["err"] < 1e-4, r


# ---- CPU, no Triton needed ------------------------------------------------------------------------
def _sort_python(local_ids: torch.Tensor, E: int):
    ids = local_ids.reshape(-1).tolist()
    order = sorted(range(len(ids)), key=lambda s: (ids[s] if 0 <= ids[s] < E else E, s))
    counts = [sum(1 for v in ids if v == e) for e in range(E)]
    return order, [sum(counts[: e + 1]) for e in range(E)]


@pytest.mark.parametrize("case", SORT_CASES, ids=repr)
def test_torch_sort_matches_python(case):
    r, E = sort_inputs(case, "cpu")
    local = kmoe.local_expert_ids(r.topk_ids, r.num_routed, r.expert_map, r.shared, r.num_local_routed)
    got = moe_route.expert_sort_torch(local, E)
    order, ends = _sort_python(local, E)
    assert got.perm.tolist() == order and got.offs.tolist() == ends
    assert got.tok.tolist() == [s // local.shape[1] for s in order]
    assert got.inv[got.perm].tolist() == list(range(len(order)))


@pytest.mark.parametrize("norm", [True, False])
def test_router_reference_is_the_hf_routers(norm):
    tf = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    qcfg = tf.Qwen3MoeConfig(hidden_size=32, num_experts=12, num_experts_per_tok=3, norm_topk_prob=norm)
    mcfg = tf.MixtralConfig(hidden_size=32, num_local_experts=12, num_experts_per_tok=3)
    for cls, cfg, renorm, keep in ((Qwen3MoeTopKRouter, qcfg, norm, False), (MixtralTopKRouter, mcfg, True, True)):
        for dtype in (torch.float32, torch.bfloat16):
            router = cls(cfg).to(dtype)
            with torch.no_grad():
                router.weight.normal_()
                x = torch.randn(9, 32).to(dtype)
                logits, w, ids = router(x)
            w_ref, ids_ref = moe_route.router_topk_ref(logits, 3, renorm, torch.float32 if keep else dtype)
            assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


def test_router_topk_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"logits \(3, 4\)"):
        moe_route.router_topk(torch.randn(3, 4), 5, True, torch.float32)
    with pytest.raises(ValueError, match=r"logits \(3, 4\) must be \(tokens, experts \+ 1 shared gate\)"):
        moe_route.router_topk(torch.randn(3, 4), 4, True, torch.float32, shared=2)  # 3 routed experts
    with pytest.raises(ValueError, match="shared must be an int >= 0, got -1"):
        moe_route.router_topk(torch.randn(3, 4), 2, True, torch.float32, shared=-1)


def test_router_reference_shared_slots():
    """The shared slots of router_topk_ref: experts E.., weighing sigmoid of the last logit column, after the
    routed top k (which ignores that column)."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 50.0], [3.0, 1.0, 0.0, -1.0]])
    w, ids = moe_route.router_topk_ref(logits, 2, True, torch.float32, shared=2)
    assert ids.tolist() == [[1, 2, 3, 4], [0, 1, 3, 4]]
    routed = torch.softmax(logits[:, :3], -1).topk(2).values
    torch.testing.assert_close(w[:, :2], routed / routed.sum(-1, keepdim=True))
    torch.testing.assert_close(w[:, 2:], torch.sigmoid(logits[:, 3:]).expand(-1, 2))


def test_router_left_alone_where_triton_does_not_run():
    tf = pytest.importorskip("transformers")
    from gemmtune.models import moe as moe_mod

    router = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
        tf.Qwen3MoeConfig(hidden_size=16, num_experts=4, num_experts_per_tok=2)
    )
    with torch.no_grad():  # the module leaves its weight uninitialized; tied probabilities are refused
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(0)))
    why = moe_mod.plan_router(router)
    if triton_runs_on("cpu"):
        assert not isinstance(why, str), why
    else:
        assert isinstance(why, str) and "the Triton top-k kernel cannot run: " in why


# ---- compiled for the GPU without one --------------------------------------------------------------
@pytest.mark.parametrize(("E", "n_group", "topk_group", "k"), [(256, 8, 4, 8), (128, 1, 1, 8), (24, 3, 2, 4)])
def test_grouped_router_kernel_compiles_for_hopper(E, n_group, topk_group, k):
    """The interpreter runs the kernel's logic; this builds it for sm90 (Triton's own ptxas, no GPU needed),
    so a construct only the GPU compiler refuses fails here too."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    if not hasattr(triton.compiler, "ASTSource"):
        pytest.skip(f"Triton {triton.__version__} has no ASTSource")
    sig = {"logits_ptr": "*fp32", "bias_ptr": "*bf16", "w_ptr": "*fp32", "ids_ptr": "*i64", "T": "i32", "E": "i32",
           "GS": "i32", "stride_lt": "i32", "stride_le": "i32", "scale": "fp32"}  # fmt: skip
    p2 = triton.next_power_of_2
    const = {"K": k, "K_P2": p2(k), "E_P2": p2(E), "NG": n_group, "NG_P2": p2(n_group), "TOPK_GROUP": topk_group,
             "BLOCK_T": 8, "RENORM": True}  # fmt: skip
    sig.update(dict.fromkeys(const, "constexpr"))
    src = triton.compiler.ASTSource(fn=moe_route._grouped_router_kernel, signature=sig, constexprs=const)
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except RuntimeError as exc:  # no ptxas in this Triton install
        if "ptxas" in str(exc).lower():
            pytest.skip(str(exc).splitlines()[0])
        raise
    assert compiled.asm["cubin"]


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_graph_replay_equals_eager(gpu):
    r, E = sort_inputs(GPU_SORT_CASES[0], gpu)
    x = router_logits(GPU_ROUTER_CASES[0], gpu)
    gx, bias = grouped_inputs(GPU_GROUPED_CASES[0], gpu)

    def run():
        w, ids = moe_route.router_topk(x, 8, True, torch.bfloat16)
        gw, gids = moe_route.grouped_router_topk(gx, bias, 8, 8, 4, True, 2.5)
        return (w, ids, *moe_route.expert_sort(r, E), gw, gids)

    eager = [t.clone() for t in run()]  # (compiles both kernels: the capture launches only)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    for _ in range(2):
        for t in outs:
            t.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, eager))
    # new ids in the same buffer: the replay follows them
    r.topk_ids.copy_(torch.randint(0, E, r.topk_ids.shape, device=gpu, dtype=r.topk_ids.dtype))
    g.replay()
    want = _sort_ref(r, E)
    assert all(torch.equal(a, b) for a, b in zip(outs[2:6], want))


@pytest.mark.gpu
def test_gpu_router_picks_the_experts_torch_topk_picks_on_ties(gpu):
    """bf16 logits on a coarse grid tie all the time: the kernel picks the same experts as torch.topk
    (the lowest ids among equal values at the k-th place) with the same weights. The order of tied
    slots is torch's own business (CUDA's topk lists them highest id first) and changes nothing: the
    block sums its slots."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randint(-8, 8, (4096, 128), generator=g).float() / 4).to(gpu, torch.bfloat16)
    for k in (1, 2, 8):
        w, ids = moe_route.router_topk(x, k, True, torch.bfloat16)
        w_ref, ids_ref = moe_route.router_topk_ref(x, k, True, torch.bfloat16)
        ids_s, order = ids.sort(1)
        ids_ref_s, order_ref = ids_ref.sort(1)
        assert torch.equal(ids_s, ids_ref_s), (ids_s != ids_ref_s).any(1).sum().item()
        torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=8e-3, atol=1e-3)


if __name__ == "__main__":  # the interpreter subprocess
    print(json.dumps(_all("cpu", chosen_cases)))
