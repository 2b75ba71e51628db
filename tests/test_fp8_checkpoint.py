"""fp8 checkpoints with 128x128 block scales (DeepSeek-V3 / Qwen3-FP8 layout) on the CPU: a tiny random
one written to safetensors loads without a bf16 round trip and matches the model with the dequantized
weights; transformers' own FP8Linear modules are routed by optimize() and restored; bad checkpoints and
configs are refused with the offending key or field named."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import gemmtune  # noqa: E402
from gemmtune.models.fp8_checkpoint import Fp8BlockLinear, check_quantization_config  # noqa: E402
from gemmtune.quant import FP8, dequantize_128x128, quantize_128x128  # noqa: E402

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
QCFG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _llama(dtype=torch.bfloat16, seed=0):
    # hidden 256 (K of q/k/v/o, gate/up: whole 128 groups); intermediate 320: gate/up N ragged to the
    # 128-row blocks, down_proj K=320 not a multiple of 128 (loaded dequantized).
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=320, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=300,
                                   max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype).eval()


def _fp8_checkpoint(model):
    """(state dict in the DeepSeek fp8 layout, the model with those weights dequantized): every decoder
    Linear as float8_e4m3fn + weight_scale_inv, the rest (embeddings, norms, lm_head) as they are."""
    sd, deq = {}, copy.deepcopy(model)
    linears = {p for p, m in model.named_modules() if type(m) is nn.Linear and p != "lm_head"}
    for k, v in model.state_dict().items():
        path = k.rsplit(".", 1)[0]
        if path in linears and k.endswith(".weight"):
            wq, ws = quantize_128x128(v.float(), FP8)
            sd[k], sd[path + ".weight_scale_inv"] = wq, ws
            with torch.no_grad():
                deq.get_submodule(path).weight.copy_(dequantize_128x128(wq, ws))
        else:
            sd[k] = v.clone()
    return sd, deq


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


IDS = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
# What is left against the dequantized-weight model is the activations' 1x128 fp8 quantization (e4m3
# keeps 3 mantissa bits: 2.6% per GEMM output measured) through 2 layers plus bf16 rounding: measured
# 0.040-0.046 over three seeds; a wrongly wired scale gives O(1).
BOUND = 0.08


def test_safetensors_checkpoint_loads_fp8_and_matches_dequantized(tmp_path):
    src = _llama()
    sd, deq = _fp8_checkpoint(src)
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(sd, str(path))
    model = _llama(seed=5)  # other random weights: everything must come from the checkpoint
    model.config.quantization_config = dict(QCFG)
    res = gemmtune.load_fp8_checkpoint(model, path)
    layers = [f"model.layers.{i}.{n}" for i in range(2) for n in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj")]  # fmt: skip
    assert sorted(res.fp8) == sorted(layers)
    assert [p for p, _ in res.dequantized] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert all("K=320" in why for _, why in res.dequantized) and "12 linears kept fp8" in res.summary()
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Fp8BlockLinear) and q.weight.dtype == FP8 and torch.equal(q.weight, sd[layers[0] + ".weight"])
    assert torch.equal(q.weight_scale_inv, sd[layers[0] + ".weight_scale_inv"])
    # state_dict keys and tensors are the checkpoint's (fp8 stays fp8)
    out = model.state_dict()
    assert torch.equal(out[layers[4] + ".weight_scale_inv"], sd[layers[4] + ".weight_scale_inv"])
    ref = _logits(deq, IDS)
    err = _rel(_logits(model, IDS), ref)
    assert 0 < err < BOUND, err
    # each fp8 Linear alone: only its activations' quantization differs from the dequantized weight
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y = q(x).float()
    y_ref = x.float() @ q.dequantized_weight().t()
    assert _rel(y, y_ref) < 0.05


def test_meta_model_and_sharded_folder(tmp_path):
    src = _llama()
    sd, deq = _fp8_checkpoint(src)
    keys = sorted(sd)
    half = len(keys) // 2
    safetensors_torch.save_file({k: sd[k] for k in keys[:half]}, str(tmp_path / "a.safetensors"))
    safetensors_torch.save_file({k: sd[k] for k in keys[half:]}, str(tmp_path / "b.safetensors"))
    with torch.device("meta"):
        model = _llama()
    # rotary inv_freq is a buffer computed at build: rebuild it off the meta device as HF's init would
    model.model.rotary_emb = copy.deepcopy(src.model.rotary_emb)
    res = gemmtune.load_fp8_checkpoint(model, tmp_path, device="cpu")
    assert len(res.fp8) == 12 and not any(p.device.type == "meta" for p in model.parameters())
    assert _rel(_logits(model, IDS), _logits(deq, IDS)) < BOUND


def test_transformers_fp8_linear_is_routed_and_restored():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    cfg_cls = getattr(transformers, "FineGrainedFP8Config", None)
    if cfg_cls is None or not hasattr(fp8, "replace_with_fp8_linear"):
        pytest.skip("this transformers has no FineGrainedFP8Config / replace_with_fp8_linear")
    src = _llama()
    sd, deq = _fp8_checkpoint(src)
    model = _llama()
    # Same signature on every supported transformers (5.17 and 5.24 checked): a TypeError is a failure.
    fp8.replace_with_fp8_linear(
        model,
        modules_to_not_convert=["lm_head"],
        quantization_config=cfg_cls(weight_block_size=(128, 128)),
        pre_quantized=True,
    )
    model.load_state_dict(sd, strict=False, assign=True)
    names = [p for p, m in model.named_modules() if type(m).__name__ == "FP8Linear"]
    assert len(names) == 14  # 2 x (q, k, v, o, gate, up, down)
    report = gemmtune.optimize(model)
    routed = [c for c in report.changed if c.startswith("fp8:")]
    skipped = [w for w, _ in report.skipped if w.startswith("fp8:")]
    assert len(routed) == 12 and len(skipped) == 2, report.summary()  # down_proj: K=320
    assert all("down_proj" in w for w in skipped)
    # the two down_proj keep transformers' own forward, which needs a GPU: give them the dequantized math
    for i in range(2):
        mod = model.model.layers[i].mlp.down_proj
        w = dequantize_128x128(mod.weight, mod.weight_scale_inv).to(torch.bfloat16)
        mod.forward = lambda x, w=w: torch.nn.functional.linear(x, w)
    assert _rel(_logits(model, IDS), _logits(deq, IDS)) < BOUND
    gemmtune.restore(model)
    q = model.model.layers[0].self_attn.q_proj
    assert "forward" not in q.__dict__ and not any("_gemmtune_fp8_routed" in m.__dict__ for m in model.modules())


def test_bad_checkpoints_and_configs_are_refused(tmp_path):
    src = _llama()
    sd, _ = _fp8_checkpoint(src)
    bad = dict(sd)
    bad["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"q_proj: weight_scale_inv is \(2, 3\)"):
        gemmtune.load_fp8_checkpoint(_llama(), bad)
    extra = {
        **sd,
        "model.layers.7.mlp.up_proj.weight": sd["model.layers.0.mlp.up_proj.weight"],
        "model.layers.7.mlp.up_proj.weight_scale_inv": sd["model.layers.0.mlp.up_proj.weight_scale_inv"],
    }
    with pytest.raises(ValueError, match="has no nn.Linear at 'model.layers.7.mlp.up_proj'"):
        gemmtune.load_fp8_checkpoint(_llama(), extra)
    res = gemmtune.load_fp8_checkpoint(_llama(), extra, strict=False)
    assert len(res.fp8) == 12
    with pytest.raises(ValueError, match="checkpoint keys the model lacks: junk"):
        gemmtune.load_fp8_checkpoint(_llama(), {**sd, "junk": torch.zeros(1)})
    with torch.device("meta"):
        meta = _llama()
    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="left on the meta device: model.norm.weight"):
        gemmtune.load_fp8_checkpoint(meta, missing, device="cpu")
    for field, value, match in (("quant_method", "gptq", "quant_method is 'gptq'"),
                                ("weight_block_size", [64, 64], "weight_block_size is"),
                                ("activation_scheme", "static", "activation_scheme is 'static'")):  # fmt: skip
        cfg = type("C", (), {"quantization_config": {**QCFG, field: value}})()
        with pytest.raises(ValueError, match=match):
            check_quantization_config(cfg)
    assert check_quantization_config(type("C", (), {})()) is None
    with pytest.raises(ValueError, match="not a .safetensors file"):
        gemmtune.load_fp8_checkpoint(_llama(), tmp_path / "model.bin")
    with pytest.raises(ValueError, match="no .safetensors files"):
        gemmtune.load_fp8_checkpoint(_llama(), tmp_path)
    with pytest.raises(ValueError, match="Fp8BlockLinear: weight is torch.bfloat16"):
        Fp8BlockLinear(torch.zeros(128, 128, dtype=torch.bfloat16), torch.ones(1, 1))
