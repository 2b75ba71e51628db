"""optimize(quantize=...) with the 8-bit producers wired (models/quant_feeds.py), on tiny Llama / Gemma
models (CPU): which GEMMs get their input from a producer, logits on the cached decode path equal to the
same model quantized without producers (the same quantizer on the same values) and within the 8-bit
bound of stock, restore(), gemm_errors, hooks, torch.compile(fullgraph)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import gemmtune  # noqa: E402
from gemmtune.models import quant_feeds, verify  # noqa: E402
from gemmtune.models import quantize as quantize_mod  # noqa: E402
from gemmtune.models.quantize import FEEDS, QuantizedActivation, gemm_errors, input_format  # noqa: E402

MODES = ["int8", "fp8", "fp8-block"]
# Logits vs stock fp32 on random weights (test_quant_models.py measures the same bounds).
BOUNDS = {"int8": 0.04, "fp8": 0.12, "fp8-block": 0.12}


def _tiny_llama(model_configs, seed=0, **overrides):
    cfg = json.loads((model_configs / "tiny-llama.json").read_text())
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**{**cfg, **overrides})).eval()


def _wide_llama(model_configs):
    """tiny-llama with K = 128 / 256, so 1x128 block scales apply to every linear."""
    return _tiny_llama(model_configs, hidden_size=128, intermediate_size=256, head_dim=32)


def _decode_logits(model) -> list[torch.Tensor]:
    """Logits of a left-padded prefill and 3 cached decode steps (verify.py's probe), valid tokens only."""
    probe = verify.Probe.for_model(model)
    trace = verify.run(model, [], probe)
    return [lg[probe.valid(call)] for call, lg in enumerate(trace.logits)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _quantized(stock, mode, producers: bool, monkeypatch):
    model = copy.deepcopy(stock)
    report = gemmtune.optimize(model, quantize=mode, quantize_producers=producers)
    if not producers:
        assert not _feeds(report) and FEEDS not in model.__dict__  # the switch wires nothing
    return model, report


def _feeds(report) -> list[str]:
    return [c for c in report.changed if c.startswith("quantize feed:")]


@pytest.mark.parametrize("mode", MODES)
def test_producers_match_the_unwired_model_on_the_decode_path(mode, model_configs, monkeypatch):
    stock = _wide_llama(model_configs)
    wired, report = _quantized(stock, mode, True, monkeypatch)
    plain, plain_report = _quantized(stock, mode, False, monkeypatch)
    feeds = _feeds(report)
    # per layer: input_layernorm -> qkv_proj, post_attention_layernorm -> gate_up_proj, mlp (act*mul) -> down_proj
    assert len(feeds) == 6 and not _feeds(plain_report), report.summary()
    for name in ("input_layernorm: emits qkv_proj", "post_attention_layernorm: emits gate_up_proj",
                 "mlp: emits down_proj"):  # fmt: skip
        assert sum(name in f for f in feeds) == 2, feeds
    assert any("quantize feeds: 6/6 of" in n for n in report.notes)
    want = _decode_logits(stock)
    for got, same, ref in zip(_decode_logits(wired), _decode_logits(plain), want):
        assert _rel(got, same) <= 1e-6  # the same quantization math: equal here (CPU), near-equal on a GPU
        assert 0 < _rel(got, ref) < BOUNDS[mode]


@pytest.mark.parametrize("mode", MODES)
def test_restore_gives_stock_back(mode, model_configs):
    stock = _wide_llama(model_configs)
    model = copy.deepcopy(stock)
    gemmtune.optimize(model, quantize=mode)
    assert FEEDS in model.__dict__
    gemmtune.restore(model)
    for got, want in zip(_decode_logits(model), _decode_logits(stock)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    left = [(n, k) for n, m in model.named_modules() for k in m.__dict__ if k.startswith("_gemmtune")]
    assert not left and FEEDS not in model.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_unquantized_optimize_wires_nothing(model_configs):
    model = _wide_llama(model_configs)
    report = gemmtune.optimize(model)
    assert not _feeds(report) and FEEDS not in model.__dict__
    assert not any(quant_feeds.FORMAT in m.__dict__ for m in model.modules())


def test_only_quantized_consumers_are_fed(model_configs):
    """fp8-block on tiny-llama (hidden 64): only down_proj (K = 128) is quantized, so only act*mul is wired."""
    model = _tiny_llama(model_configs)
    report = gemmtune.optimize(model, quantize="fp8-block")
    feeds = _feeds(report)
    assert len(feeds) == 2 and all("mlp: emits down_proj" in f for f in feeds), report.summary()
    assert any("quantize feeds: 2/2 of" in n for n in report.notes)
    stock = _tiny_llama(model_configs)
    for got, want in zip(_decode_logits(model), _decode_logits(stock)):
        assert _rel(got, want) < BOUNDS["fp8-block"]


def test_a_hook_on_the_consumer_keeps_its_own_quantizer(model_configs):
    stock = _wide_llama(model_configs)
    model = copy.deepcopy(stock)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, y: None)  # blocks the qkv fusion
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, a, y: seen.append(type(a[0])))
    report = gemmtune.optimize(model, quantize="int8")
    feeds = _feeds(report)
    assert not any("layers.0.input_layernorm" in f for f in feeds)  # q/k/v unfused: no fused attention forward
    assert not any("layers.1.mlp:" in f for f in feeds)
    assert ("quantize feed: model.layers.1.mlp", "down_proj: hooks on down_proj") in report.skipped
    _decode_logits(model)
    assert seen and set(seen) == {torch.Tensor}  # the hook saw 16-bit activations


def test_gemm_errors_pauses_the_producers(model_configs):
    model = _wide_llama(model_configs)
    gemmtune.optimize(model, quantize="fp8")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    errs = gemm_errors(model, lambda: model(ids, use_cache=False))
    assert len(errs) == 8 and all(0 < e < 0.1 for _, _, e in errs), errs
    norm = model.model.layers[0].input_layernorm
    assert "forward" in norm.__dict__ and quant_feeds.FORMAT in norm.__dict__  # wired again afterwards
    with torch.no_grad():
        assert isinstance(norm(torch.randn(1, 3, 128)), QuantizedActivation)


def test_reference_linears_runs_the_plain_reference_and_puts_everything_back(model_configs, monkeypatch):
    model = _wide_llama(model_configs)
    gemmtune.optimize(model, quantize="fp8")
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    quantized = [m for m in model.modules() if input_format(m) is not None]
    forwards = [m.__dict__["forward"] for m in quantized]
    calls = []
    real = quantize_mod.reference_forward
    monkeypatch.setattr(quantize_mod, "reference_forward", lambda mod, x: calls.append(mod) or real(mod, x))
    with torch.no_grad():
        fast = model(ids, use_cache=False).logits
        with quantize_mod.reference_linears(model):
            norm = model.model.layers[0].input_layernorm
            assert not isinstance(norm(torch.randn(1, 3, 128)), QuantizedActivation)  # producers paused
            ref = model(ids, use_cache=False).logits
    assert {id(m) for m in calls} == {id(m) for m in quantized}  # every 8-bit linear ran its reference
    assert [m.__dict__["forward"] for m in quantized] == forwards  # and got its 8-bit forward back
    assert isinstance(model.model.layers[0].input_layernorm(torch.randn(1, 3, 128)), QuantizedActivation)
    assert _rel(fast, ref) < 1e-4  # on the CPU the 8-bit path computes the reference's math


@pytest.mark.parametrize("mode", ["int8", "fp8-block"])
def test_compiled_fullgraph_runs_the_producer_ops(mode, model_configs):
    model = _wide_llama(model_configs)
    gemmtune.optimize(model, quantize=mode)
    seen = []

    def backend(gm, inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(ids, use_cache=False).logits
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True, backend=backend)(ids, use_cache=False)
    torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert {"gemmtune.rmsnorm_quant", "gemmtune.add_rmsnorm_quant", "gemmtune.act_mul_quant"} <= set(seen), seen


@pytest.mark.parametrize("model_type", ["gemma", "gemma2"])
def test_gemma_norms_and_gelu_feed_too(model_type, monkeypatch):
    """Gemma's (1 + w) norms and GELU-tanh; Gemma-2's sandwich layer feeds the MLP from pre_feedforward_layernorm."""
    cls = {"gemma": transformers.GemmaConfig, "gemma2": transformers.Gemma2Config}[model_type]
    cfg = cls(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_hidden_layers=2, vocab_size=256, max_position_embeddings=64,
              hidden_activation="gelu_pytorch_tanh")  # fmt: skip
    torch.manual_seed(0)
    stock = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    wired, report = _quantized(stock, "fp8", True, monkeypatch)
    plain, _ = _quantized(stock, "fp8", False, monkeypatch)
    feeds = _feeds(report)
    add_norm = "pre_feedforward_layernorm" if model_type == "gemma2" else "post_attention_layernorm"
    assert len(feeds) == 6 and sum(f"{add_norm}: emits gate_up_proj" in f for f in feeds) == 2, report.summary()
    for got, same, ref in zip(_decode_logits(wired), _decode_logits(plain), _decode_logits(stock)):
        assert _rel(got, same) <= 1e-6
        assert _rel(got, ref) < BOUNDS["fp8"]


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_bf16_producers_match_the_unwired_model(mode, model_configs, monkeypatch, gpu):
    """bf16 on the GPU (the Triton producers and 8-bit GEMMs): the wired model's decode-path logits equal
    the unwired one's (the fused kernels share the norm, act*mul and quantizer code of the unfused ones),
    and stay within the 8-bit bound of stock."""
    stock = _wide_llama(model_configs).to(gpu, torch.bfloat16)
    wired, report = _quantized(stock, mode, True, monkeypatch)
    plain, _ = _quantized(stock, mode, False, monkeypatch)
    assert len(_feeds(report)) == 6, report.summary()
    for got, same, ref in zip(_decode_logits(wired), _decode_logits(plain), _decode_logits(stock)):
        assert _rel(got, same) <= 1e-3
        assert _rel(got, ref) < BOUNDS[mode] + 0.05
