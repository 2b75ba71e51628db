"""fused_moe / grouped_gemm ops (CPU: torch backends; GPU: the default Triton path and CUDA graphs),
the on-device align, the fmoe family (aiter's table, naming hooks, compute methods, model keys) and
bad input."""

from __future__ import annotations

import hashlib

import pytest
import torch
from tiers import tiered

import gemmtune
from gemmtune.backends.fmoe import pytorch as mto
from gemmtune.backends.fmoe import stages as mst
from gemmtune.backends.fmoe import triton as mtr
from gemmtune.families import fmoe
from gemmtune.families.fmoe import MoeKey, route
from gemmtune.kernels.fused_moe import BAD_ID, fused_moe_ref, local_expert_ids
from gemmtune.kernels.moe_align import moe_align, moe_align_ref


def inputs(T, H, inter, E, topk, dtype=torch.float32, seed=0, device="cpu", shared=0, n_routed=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w1 = torch.randn(E + shared, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E + shared, H, inter, generator=g) / inter**0.5
    w, ids = route(torch.randn(T, n_routed or E, generator=g), topk)
    return tuple(t.to(device=device, dtype=dtype if t.is_floating_point() and t is not w else t.dtype)
                 for t in (x, w1, w2, w, ids))  # fmt: skip


def rel(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


SHAPES = [(1, 24, 20, 5, 1), (3, 40, 36, 6, 2), (17, 56, 28, 7, 2), (9, 32, 24, 12, 8), (64, 48, 40, 3, 2)]


@pytest.mark.parametrize("solution", [mto.LOOP, mto.DENSE, mto.GROUPED_MM], ids=lambda s: s.kernel_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-k{}".format(*s))
def test_torch_backends_match_fp32_reference(solution, shape):
    T, H, inter, E, topk = shape
    x, w1, w2, w, ids = inputs(*shape)
    key = MoeKey(T, H, inter, E, topk, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    backend = mto.TorchMoeBackend()
    if not backend.supports(solution, key, torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not run here")
    y = backend.make_runner(solution, key, torch.device("cpu"))(x, w1, w2, w, ids, None)
    assert rel(y, fused_moe_ref(x, w1, w2, w, ids)) < 1e-5


def test_fused_moe_routing_corner_cases_and_bf16():
    x, w1, w2, w, ids = inputs(11, 40, 24, 7, 2, dtype=torch.bfloat16)
    ids[:, 0] = 6  # every token on expert 6; experts 2..5 get nothing
    ids[:, 1] = torch.arange(11) % 2
    y = gemmtune.fused_moe(x, w1, w2, w, ids)
    assert y.dtype == torch.bfloat16 and y.shape == (11, 40)
    assert rel(y, fused_moe_ref(x.float(), w1.float(), w2.float(), w, ids)) < 1e-2


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_activation_doweight_and_custom_op(activation):
    x, w1, w2, w, ids = inputs(6, 32, 20, 5, 2)
    ref = fused_moe_ref(x, w1, w2, w, ids, activation)
    assert rel(gemmtune.fused_moe(x, w1, w2, w, ids, activation), ref) < 1e-5
    assert rel(gemmtune.fused_moe(x, w1, w2, w, ids, activation, doweight_stage1=True), ref) < 1e-5
    op = torch.ops.gemmtune.fused_moe(x, w1, w2, w, ids, activation, False, None, 0)
    assert rel(op, ref) < 1e-5


def test_expert_parallel_map_and_shared_expert():
    x, w1, w2, w, ids = inputs(9, 32, 20, 3, 2, shared=1, n_routed=8)
    emap = torch.full((8,), -1, dtype=torch.int32)
    emap[torch.tensor([1, 4, 6])] = torch.arange(3, dtype=torch.int32)
    y = gemmtune.fused_moe(x, w1, w2, w, ids, expert_map=emap, num_shared_experts=1)
    ref = fused_moe_ref(x, w1, w2, w, ids, "silu", emap, shared=1)
    assert rel(y, ref) < 1e-5
    # by hand: the shared expert (weight 1) plus the local routed experts only
    h = lambda e, t: w2[e] @ (torch.nn.functional.silu(w1[e, :20] @ x[t]) * (w1[e, 20:] @ x[t]))  # noqa: E731
    for t in (0, 5):
        want = h(3, t) + sum(w[t, j] * h(int(emap[ids[t, j]]), t) for j in range(2) if emap[ids[t, j]] >= 0)
        assert torch.allclose(y[t], want, atol=1e-5)


def test_local_expert_ids_marks_other_ranks_and_bad_ids():
    ids = torch.tensor([[0, 3], [7, 9]])
    emap = torch.tensor([-1, -1, -1, 0, -1, -1, -1, 1])
    assert local_expert_ids(ids, 8, emap).tolist() == [[-1, 0], [1, BAD_ID]]
    assert local_expert_ids(ids, 8, emap, shared=2, num_local_routed=2).tolist() == [[-1, 0, 2, 3], [1, BAD_ID, 2, 3]]


@pytest.mark.parametrize("bm", [16, 32])
@pytest.mark.parametrize("ids", [[3, 1, 3, 0, -1, 3, -2, 1], [2] * 40, list(range(5)) * 7], ids=["mixed", "one", "all"])
def test_moe_align_matches_reference_and_pads_with_the_slot_count(ids, bm):
    t = torch.tensor(ids, dtype=torch.int32)
    got, blocks = moe_align(t, 5, bm)
    want, want_blocks = moe_align_ref(t, 5, bm)
    assert got.tolist() == want.tolist() and blocks.tolist() == want_blocks.tolist()
    real = got[got < len(ids)]
    assert sorted(real.tolist()) == [i for i, v in enumerate(ids) if 0 <= v < 5]  # each real slot exactly once


def test_unchecked_bad_ids_poison_only_their_token():
    x, w1, w2, w, ids = inputs(5, 32, 20, 4, 2)
    ids[2, 1] = 9
    y = gemmtune.fused_moe(x, w1, w2, w, ids, check_ids=False)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3, 4]]).any()


def test_bad_input_errors_name_the_problem():
    x, w1, w2, w, ids = inputs(5, 32, 20, 4, 2)
    with pytest.raises(ValueError, match=r"expert id 4 at \(1, 0\) is out of range \[0, 4\)"):
        bad = ids.clone()
        bad[1, 0] = 4
        gemmtune.fused_moe(x, w1, w2, w, bad)
    with pytest.raises(ValueError, match="w1 looks stored"):
        gemmtune.fused_moe(x, w1.transpose(1, 2).contiguous(), w2, w, ids)
    with pytest.raises(ValueError, match="w2 looks stored"):
        gemmtune.fused_moe(x, w1, w2.transpose(1, 2).contiguous(), w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        gemmtune.fused_moe(x, w1, w2, w[:, :1], ids)
    with pytest.raises(ValueError, match="share one dtype"):
        gemmtune.fused_moe(x.half(), w1, w2, w, ids)
    with pytest.raises(ValueError, match="activation must be one of silu, gelu, gelu_tanh, got 'relu'"):
        gemmtune.fused_moe(x, w1, w2, w, ids, "relu")
    with pytest.raises(ValueError, match="expert_map"):
        gemmtune.fused_moe(x, w1, w2, w, ids, expert_map=torch.tensor([0, 1, 2, 7]))


def test_grouped_gemm_semantics_layouts_and_errors():
    g = torch.Generator().manual_seed(3)
    T, K, N, E, topk = 7, 24, 40, 5, 2
    x = torch.randn(T, K, generator=g)
    x3 = torch.randn(T, topk, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    ids = torch.randint(0, E, (T, topk), generator=g)
    want = torch.stack([torch.stack([x[t] @ w[ids[t, j]] for j in range(topk)]) for t in range(T)])
    want3 = torch.stack([torch.stack([x3[t, j] @ w[ids[t, j]] for j in range(topk)]) for t in range(T)])
    assert torch.allclose(gemmtune.grouped_gemm(x, w, ids), want, atol=1e-5)
    assert torch.allclose(gemmtune.grouped_gemm(x3, w, ids), want3, atol=1e-5)
    assert torch.allclose(gemmtune.grouped_gemm(x, w.transpose(1, 2).contiguous(), ids, weights_transposed=True),
                          want, atol=1e-5)  # fmt: skip
    assert torch.allclose(gemmtune.grouped_gemm(x, gemmtune.prepare_expert_weights(w), ids), want, atol=1e-5)
    assert torch.allclose(gemmtune.grouped_gemm(x, w, ids.flatten(), topk=2), want, atol=1e-5)
    with pytest.raises(ValueError, match="topk=3 does not match"):
        gemmtune.grouped_gemm(x, w, ids, topk=3)
    with pytest.raises(ValueError, match="weights_transposed=True"):
        gemmtune.grouped_gemm(x, w.transpose(1, 2).contiguous(), ids)
    with pytest.raises(ValueError, match="out of range"):
        gemmtune.grouped_gemm(x, w, ids + E)
    y = gemmtune.grouped_gemm(x, w, torch.where(ids == 0, 9, ids), check_ids=False)
    assert torch.isnan(y[ids == 0]).all() and not torch.isnan(y[ids != 0]).any()


# ---- family -----------------------------------------------------------------------------------------
def test_aiter_table_loads_and_rewrites_byte_identically(aiter_configs, tmp_path):
    from gemmtune.configs.table import ConfigTable, read_table_file

    path = aiter_configs / "tuned_fmoe.csv"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    table = ConfigTable.load(str(path))
    assert table.family.name == "fmoe" and len(table) > 100
    tf = read_table_file(str(path))
    tf.write(str(tmp_path / "out.csv"))
    assert (tmp_path / "out.csv").read_bytes() == path.read_bytes()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    row = tf.rows[0]
    assert row.key.global_expert == 0 and row.key.shared_expert == 0  # aiter's rows read as aiter tuned them
    assert fmoe.FAMILY.libtype_of(row.raw) == "aiter"
    assert fmoe.FAMILY.kernel_name_of(row.raw).count("|") == 1


def test_solution_naming_round_trips_through_kernel_names():
    fam = fmoe.FAMILY
    sol = mtr.solution_of(*mtr.heuristic_configs(MoeKey(16, 4096, 14336, 8, 2)))
    rec = fam.solution_record(sol.libtype, sol.kernel_name)
    assert rec["kernelName1"].startswith("triton:moe1_") and rec["kernelName2"].startswith("moe2_")
    assert fam.libtype_of(rec) == "triton" and fam.kernel_name_of(rec) == sol.kernel_name
    back = mtr.TritonMoeBackend().solution_from_row(0, fam.kernel_name_of(rec), 0)
    assert back == sol
    assert mto.TorchMoeBackend().solution_from_row(0, mto.GROUPED_MM.kernel_name, 0) == mto.GROUPED_MM


def test_family_compute_methods_agree_with_the_op():
    fam = fmoe.FAMILY
    key = MoeKey(6, 32, 20, 5, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    (inp,) = fam.make_inputs(key, torch.device("cpu"), 1, seed=1)
    ref = fam.reference(key, inp)
    assert tuple(ref.shape) == fam.output_shape(key)
    run = gemmtune.dispatch.resolve(key, "cpu", family="fmoe").runner
    assert rel(run(*inp), ref) < 1e-5
    for what, variant, shape in fam.check_variants(key, inp):
        assert rel(run(*variant), ref) < 1e-5, what
        assert tuple(ref.shape) == shape
    # bytes: the experts expected to be hit; at 1 token exactly topk of them
    one = key._replace(token=1)
    assert fam.bytes(one) == 2 * fmoe.expert_bytes(one) + 2 * 32 * 4
    assert fam.flops(one) == 2 * 2 * 32 * 20 * 3


def test_ep_key_and_inputs():
    key = MoeKey(8, 32, 20, 4, 2, global_expert=16)
    (inp,) = fmoe.FAMILY.make_inputs(key, torch.device("cpu"), 1, seed=0)
    emap = inp[5]
    assert emap.shape == (16,) and emap[:4].tolist() == [0, 1, 2, 3] and (emap[4:] == -1).all()
    assert inp[4].max() < 16 and fmoe.expected_experts_hit(key) < 4


def test_moe_keys_for_models():
    from gemmtune.tuner.model_shapes import PRESETS, model_keys, moe_keys

    mix = moe_keys(PRESETS["mixtral-8x7b"], tp=2, tokens=[1, 64])
    got = [(k.token, k.model_dim, k.inter_dim, k.expert, k.topk) for k in mix]
    assert got == [(1, 4096, 7168, 8, 2), (64, 4096, 7168, 8, 2)]
    (q,) = moe_keys(PRESETS["qwen3-30b-a3b"], tokens=[16])
    assert (q.inter_dim, q.expert, q.topk, q.global_expert) == (768, 128, 8, 0)
    (d,) = moe_keys(PRESETS["deepseek-v3"], tp=1, ep=8, tokens=[4])  # its shared expert: a dense MLP
    assert (d.expert, d.global_expert, d.shared_expert, d.local_routed, d.topk) == (32, 256, 0, 32, 8)
    (d,) = moe_keys(PRESETS["deepseek-v3"], tp=1, ep=8, tokens=[4], fuse_shared=True)  # as aiter runs it
    assert (d.expert, d.global_expert, d.shared_expert, d.local_routed, d.topk) == (33, 256, 1, 32, 8)
    # Qwen2-MoE's shared expert (5632 = 4 x 1408) folded as optimize() folds it: 4 more experts, 4 more slots
    (q,) = moe_keys(PRESETS["qwen2-moe"], tokens=[4])
    assert (q.inter_dim, q.expert, q.topk, q.shared_expert) == (1408, 64, 8, 0)
    (q,) = moe_keys(PRESETS["qwen2-57b-a14b"], tp=4, tokens=[4])  # 20480 / 2560: 8 experts at any tp
    assert (q.inter_dim, q.expert, q.topk) == (640, 72, 16)
    (q,) = moe_keys(PRESETS["qwen2-moe"], ep=2, tokens=[4])  # expert parallel: the shared expert stays dense
    assert (q.expert, q.topk, q.global_expert) == (30, 4, 60)
    assert moe_keys(PRESETS["llama-3-8b"], tokens=[1]) == []
    with pytest.raises(ValueError, match="do not split"):
        moe_keys(PRESETS["mixtral-8x7b"], ep=3)
    assert model_keys("fmoe", PRESETS["qwen3-30b-a3b"], 1, [1, 2], torch.bfloat16)[1].token == 2


def test_untuned_key_resolves_to_a_runnable_default_on_cpu():
    key = MoeKey(4, 32, 20, 5, 2, dtype=torch.float32)
    res = gemmtune.dispatch.resolve(key, "cpu", family="fmoe")
    assert res.solution.libtype == "torch" and res.row is None


# ---- GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("T", tiered([1, 4, 16, 64, 256, 1024, 4096], lambda t: t in (1, 16, 256, 4096)))
@pytest.mark.parametrize("E,topk", [(8, 2), (60, 8), (7, 1)])
def test_gpu_default_path_matches_reference(T, E, topk, gpu):
    x, w1, w2, w, ids = inputs(T, 512, 200, E, topk, dtype=torch.bfloat16, device="cuda", seed=T)
    y = gemmtune.fused_moe(x, w1, w2, w, ids)
    assert rel(y, fused_moe_ref(x.float(), w1.float(), w2.float(), w, ids)) < 1.5e-2
    if mst.grouped_mm_usable(torch.bfloat16, x.device):
        key = MoeKey(T, 512, 200, E, topk)
        y2 = mto.TorchMoeBackend().make_runner(mto.GROUPED_MM, key, x.device)(x, w1, w2, w, ids, None)
        assert rel(y2, fused_moe_ref(x.float(), w1.float(), w2.float(), w, ids)) < 1.5e-2


@pytest.mark.gpu
def test_gpu_fused_moe_graph_replay_equals_eager(gpu):
    x, w1, w2, w, ids = inputs(16, 512, 200, 10, 2, dtype=torch.bfloat16, device="cuda")
    gemmtune.fused_moe(x, w1, w2, w, ids)  # warm-up, compiles
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gemmtune.fused_moe(x, w1, w2, w, ids)
    ids.copy_(ids.roll(3, 0))
    x.mul_(0.5)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, gemmtune.fused_moe(x, w1, w2, w, ids))


def test_capture_records_fused_moe_keys(tmp_path):
    path = tmp_path / "cap.csv"
    gemmtune.set_capture(str(path))
    x, w1, w2, w, ids = inputs(5, 32, 20, 4, 2)
    gemmtune.fused_moe(x, w1, w2, w, ids)
    gemmtune.fused_moe(x, w1, w2, w, ids)
    gemmtune.set_capture(None)
    (out,) = tmp_path.glob("cap.fmoe.csv")
    header, row = out.read_text().splitlines()
    assert header.startswith("token,model_dim,inter_dim,expert,topk,act_type")
    assert row.startswith("5,32,20,4,2,ActivationType.Silu,") and row.endswith(",2")  # seen twice
