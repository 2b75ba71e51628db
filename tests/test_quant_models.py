"""optimize(model, quantize=...) on a small Llama (CPU): what is quantized, the logits' error against
the stock model bounded per mode, fused projections stay fused, lm_head left alone unless asked,
restore() gives the stock model back, bad modes refused."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gemmtune  # noqa: E402
from gemmtune.models.linear import FusedLinear  # noqa: E402


def _llama(seed=0):
    # K = 256 / 512: multiples of 128, so block scales apply everywhere.
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=300,
                                   max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


# Bounds on the logits' relative error vs the stock fp32 model of random weights; measured here:
# int8 0.021, fp8 0.079, fp8-block 0.068 (e4m3 keeps 3 mantissa bits: ~4% per element).
BOUNDS = {"int8": 0.04, "fp8": 0.12, "fp8-block": 0.12}


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp8-block"])
def test_quantized_model_logits_close_and_restore_exact(mode):
    stock = _llama()
    model = copy.deepcopy(stock)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _logits(stock, ids)
    report = gemmtune.optimize(model, quantize=mode)
    quantized = [c for c in report.changed if c.startswith("quantize:")]
    # 2 layers x (qkv, o, gate_up, down): fused projections stay fused and are quantized as one
    assert len(quantized) == 8, report.summary()
    assert any("qkv_proj" in c for c in quantized) and any("gate_up_proj" in c for c in quantized)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedLinear)
    assert any(w.startswith("quantize: lm_head") for w, _ in report.skipped)
    assert any(f"quantize={mode}" in n for n in report.notes)
    err = _rel(_logits(model, ids), ref)
    assert 0 < err < BOUNDS[mode], err  # 0 would mean the 8-bit path never ran
    gemmtune.restore(model)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    assert not any("_gemmtune_quant" in m.__dict__ for m in model.modules())


def test_lm_head_quantized_when_asked_and_bad_mode():
    model = _llama()
    report = gemmtune.optimize(model, quantize="int8", quantize_lm_head=True)
    assert any(c.startswith("quantize: lm_head") for c in report.changed)
    with pytest.raises(ValueError, match="quantize must be one of"):
        gemmtune.optimize(_llama(), quantize="fp4")


def test_per_gemm_error_is_reported():
    report = gemmtune.optimize(_llama(), quantize="fp8")
    errs = [float(c.rsplit("weight rel err ", 1)[1].rstrip(")")) for c in report.changed if "weight rel err" in c]
    assert errs and all(0 < e < 0.06 for e in errs)


@pytest.mark.parametrize("mode", ["int8", "fp8", "fp8-block"])
def test_reference_forward_is_the_quantized_linear_in_plain_pytorch(mode):
    """reference_forward (what the GPU test holds the kernels to) against a hand-written dequantized matmul."""
    from gemmtune.models.quantize import quantize_linears, reference_forward
    from gemmtune.models.report import OptimizeReport
    from gemmtune.quant import quantize as q

    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 136, bias=True)
    quantize_linears(torch.nn.Sequential(lin), mode, OptimizeReport("unknown", "none", "", {}))
    x = torch.randn(3, 5, 256)
    dt = torch.float8_e4m3fn if "fp8" in mode else torch.int8
    if mode == "fp8-block":
        wq, ws = q.quantize_128x128(lin.weight.detach(), dt)
        xq, xs = q.quantize_1x128(x.reshape(-1, 256), dt)
        want = q.dequantize_1x128(xq, xs) @ q.dequantize_128x128(wq, ws).t()
    else:
        wq, ws = q.quantize_per_channel(lin.weight.detach(), dt)
        xq, xs = q.quantize_per_token(x.reshape(-1, 256), dt)
        want = q.dequantize(xq, xs) @ q.dequantize(wq, ws.reshape(-1, 1)).t()
    want = (want + lin.bias.detach()).view(3, 5, 136)
    got = reference_forward(lin, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin(x), got, rtol=1e-4, atol=1e-4)  # on the CPU the module runs the reference too
