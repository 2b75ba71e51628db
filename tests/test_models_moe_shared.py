"""optimize() folds Qwen2-MoE's sigmoid-gated shared expert into the experts' fused_moe call
(models/moe_shared.py): what is folded and what the block keeps, parity on the cached decode path,
what fused_moe receives (the shared slots and their sigmoid weights), the tensors (the experts'
parameters become views, values unchanged), restore, the probe and the reasons a block is left alone.
On the CPU the router's top-k kernel does not run, so its reference stands in for it (the kernel:
test_moe_route.py); the GPU test runs the kernels in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_moe_families import build, moe_blocks, skipped  # noqa: E402
from test_models_parity import check_parity, check_parity_bf16  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.kernels import moe_route  # noqa: E402
from gemmtune.models import moe as moe_mod  # noqa: E402
from gemmtune.models import moe_shared  # noqa: E402


@pytest.fixture
def router_reference(monkeypatch):
    """The top-k kernel's reference in place of the kernel (which needs Triton on a GPU here)."""
    monkeypatch.setattr(moe_mod, "triton_reason", lambda device: None)
    monkeypatch.setattr(moe_mod, "router_topk", moe_route.router_topk_ref)
    monkeypatch.setattr(moe_shared, "router_topk", moe_route.router_topk_ref)


def folded_pair(**overrides):
    stock = build("qwen2-moe", **overrides)
    opt = copy.deepcopy(stock)
    return stock, opt, gemmtune.optimize(opt)


def test_shared_expert_folds_into_the_experts_call(router_reference, monkeypatch):
    stock, opt, report = folded_pair()  # shared 48 = 2 x 32 (the second chunk half zero padding)
    (block,) = moe_blocks(opt)
    (stock_block,) = moe_blocks(stock)
    assert report.counts().get("moe_fold") == 1 and not report.counts().get("moe"), report.summary()
    assert "forward" in block.__dict__ and "forward" not in block.experts.__dict__
    assert "forward" not in block.gate.__dict__  # the block routes itself
    shared = block.shared_expert  # left as it was: neither fused nor routed
    assert "gate_proj" in shared._modules and "forward" not in shared.__dict__
    assert not any("forward" in m.__dict__ for m in shared.modules())
    f = block._gemmtune_moe_fold
    E, two_i, H = stock_block.experts.gate_up_proj.shape
    assert f.plan.chunks == 2 and f.w1.shape == (E + 2, two_i, H) and f.w2.shape == (E + 2, H, two_i // 2)
    # the experts' parameters: views of the folded tensors, values unchanged
    assert block.experts.gate_up_proj.data_ptr() == f.w1.data_ptr()
    assert block.experts.down_proj.data_ptr() == f.w2.data_ptr()
    assert torch.equal(block.experts.gate_up_proj, stock_block.experts.gate_up_proj)
    assert torch.equal(block.experts.down_proj, stock_block.experts.down_proj)
    assert f.router_weight.shape[0] % moe_shared.ROW_MULTIPLE == 0 and not f.router_weight[E + 1 :].any()

    seen = []
    real = moe_shared.fused_moe
    monkeypatch.setattr(moe_shared, "fused_moe", lambda *a, **k: seen.append(a) or real(*a, **k))
    check_parity(stock, opt)
    assert seen and {a[0].shape[0] for a in seen} >= {3}  # the decode steps (batch 3) ran the fold too
    x, w1, _, weights, ids = seen[-1][:5]
    k = block.gate.top_k
    assert w1 is f.w1 and ids.shape == (x.shape[0], k + 2)
    assert torch.equal(ids[:, k:], torch.tensor([[E, E + 1]]).expand(x.shape[0], -1))
    gate = torch.sigmoid(x @ stock_block.shared_expert_gate.weight.T)
    torch.testing.assert_close(weights[:, k:], gate.expand(-1, 2).to(weights.dtype))


def test_restore_gives_back_the_stock_block(router_reference):
    stock, opt, _ = folded_pair()
    gemmtune.restore(opt)
    (block,) = moe_blocks(opt)
    assert not any(k.startswith("_gemmtune") or k == "forward" for m in opt.modules() for k in m.__dict__)
    ids = torch.randint(3, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(opt(ids).logits, stock(ids).logits)


def test_an_exact_multiple_needs_no_padding(router_reference):
    stock, opt, report = folded_pair(shared_expert_intermediate_size=96)  # 3 x 32
    (block,) = moe_blocks(opt)
    assert block._gemmtune_moe_fold.plan.chunks == 3
    check_parity(stock, opt)


def test_training_mode_runs_the_stock_forward(router_reference):
    stock, opt, _ = folded_pair()
    (block,), (stock_block,) = moe_blocks(opt), moe_blocks(stock)
    x = torch.randn(2, 5, block.experts.gate_up_proj.shape[2], requires_grad=True)
    out = block(x)
    out.sum().backward()  # the kernels have no backward: the block's own forward ran
    torch.testing.assert_close(out, stock_block(x), rtol=0, atol=0)
    assert x.grad is not None


def test_a_shared_expert_with_another_activation_is_left_alone(router_reference):
    stock = build("qwen2-moe")
    (block,) = moe_blocks(stock)
    block.shared_expert.act_fn = torch.nn.GELU(approximate="tanh")
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    assert not report.counts().get("moe_fold"), report.summary()
    assert any("the shared expert's activation (gelu_tanh) is not the experts' (silu)" in w
               for w in skipped(report, "moe_fold"))  # fmt: skip
    assert report.counts().get("moe") == 1  # the experts and router swaps as before
    (opt_block,) = moe_blocks(opt)
    assert hasattr(opt_block.shared_expert, "gate_up_proj")  # the shared expert fused as a dense MLP
    check_parity(stock, opt)


def test_a_block_whose_forward_differs_is_left_alone(router_reference, monkeypatch):
    from transformers.models.qwen2_moe import modeling_qwen2_moe as mod

    real = mod.Qwen2MoeSparseMoeBlock.forward
    monkeypatch.setattr(mod.Qwen2MoeSparseMoeBlock, "forward", lambda self, h: real(self, h) * 1.5)
    stock = build("qwen2-moe")
    (block,) = moe_blocks(stock)
    plan = moe_shared.plan(block, moe_mod.plan_experts(block.experts), moe_mod.plan_router(block.gate))
    assert plan.startswith("the folded block differs from its forward on a probe (rel err "), plan


def test_no_fold_without_the_router_kernel_or_fused_ops(router_reference):
    stock = build("qwen2-moe")
    (block,) = moe_blocks(stock)
    spec = moe_mod.plan_experts(block.experts)
    assert moe_shared.plan(block, spec, "the Triton top-k kernel cannot run: x") == (
        "the experts or the softmax top-k router stay stock"
    )
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt, fused_ops=False)
    assert not report.counts().get("moe_fold") and "forward" not in moe_blocks(opt)[0].__dict__


@pytest.mark.gpu
def test_gpu_folded_block_bf16(gpu):
    """The real kernels (router top-k with the shared slots, fused_moe over E + c experts) in bf16 on the GPU."""
    stock = build("qwen2-moe").to(device=gpu, dtype=torch.bfloat16)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    assert report.counts().get("moe_fold") == 1, report.summary()
    assert not skipped(report, "verify"), report.summary()
    check_parity_bf16(stock, opt, gpu)
