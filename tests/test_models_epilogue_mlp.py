"""optimize() on Linear -> GELU -> Linear MLPs (models/epilogue_mlp.py): GPT-NeoX (Pythia), Phi,
Starcoder2, Falcon. CPU parity on tiny random configs, the report, restore, the act probe, the
epilogue keys a model config yields; and a tuned epilogue row actually used by the patched MLP."""

from __future__ import annotations

import copy

import pytest
import torch

import gemmtune

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256, max_position_embeddings=64)
CONFIGS = {
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**TINY, intermediate_size=176, hidden_act="gelu"),
    "phi": lambda: transformers.PhiConfig(**TINY, intermediate_size=176, hidden_act="gelu_new"),
    "starcoder2": lambda: transformers.Starcoder2Config(
        **TINY, intermediate_size=176, num_key_value_heads=2, hidden_act="gelu_pytorch_tanh", use_bias=True
    ),  # fmt: skip
    "falcon": lambda: transformers.FalconConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=256,
        bias=True,
        new_decoder_architecture=False,
    ),  # fmt: skip
}
MLP_CLASS = {"gpt_neox": "GPTNeoXMLP", "phi": "PhiMLP", "starcoder2": "Starcoder2MLP", "falcon": "FalconMLP"}


def _build(name):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]()).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, 0.2)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_parity_report_and_restore(name):
    stock = _build(name)
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    mlps = [m for m in opt.modules() if type(m).__name__ == MLP_CLASS[name]]
    assert mlps and all("_gemmtune_epilogue_mlp" in m.__dict__ for m in mlps)
    assert sum("epilogue_mlp:" in c for c in report.changed) == len(mlps)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = stock(ids, use_cache=False).logits
        b = opt(ids, use_cache=False).logits
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    spec = mlps[0]._gemmtune_epilogue_mlp
    up = getattr(mlps[0], spec.up)
    assert "forward" not in up.__dict__  # the MLP's linears are not routed a second time
    gemmtune.restore(opt)
    assert not any("_gemmtune_epilogue_mlp" in m.__dict__ for m in opt.modules())
    with torch.no_grad():
        torch.testing.assert_close(opt(ids, use_cache=False).logits, a, rtol=0, atol=0)


def test_fused_ops_off_leaves_mlps_alone():
    opt = _build("phi")
    gemmtune.optimize(opt, fused_ops=False)
    assert not any("_gemmtune_epilogue_mlp" in m.__dict__ for m in opt.modules())


def test_act_probe():
    import torch.nn.functional as F

    from gemmtune.models.epilogue_mlp import detect_act

    acts = transformers.activations.ACT2FN
    assert detect_act(acts["gelu"]) == "gelu"
    assert detect_act(acts["gelu_new"]) == "gelu_tanh"
    assert detect_act(acts["gelu_pytorch_tanh"]) == "gelu_tanh"
    assert detect_act(acts["relu"]) == "relu"
    assert detect_act(acts["silu"]) is None
    assert detect_act(lambda x: F.gelu(x) * 1.01) is None


def test_unknown_act_is_skipped_with_a_reason():
    opt = _build("gpt_neox")
    for m in opt.modules():
        if type(m).__name__ == "GPTNeoXMLP":
            m.act = torch.nn.SiLU()
    report = gemmtune.optimize(opt)
    assert any("SiLU is not exact GELU" in why for _, why in report.skipped)


def test_epilogue_keys_of_model_configs():
    from gemmtune.tuner.model_shapes import model_keys

    phi2 = dict(model_type="phi", hidden_size=2560, intermediate_size=10240, hidden_act="gelu_new")
    keys = model_keys("epilogue", phi2, 1, [1, 64], torch.bfloat16)
    assert [(k.M, k.N, k.K, k.bias, k.act) for k in keys] == [
        (1, 10240, 2560, True, "gelu_tanh"), (1, 2560, 10240, True, "none"),
        (64, 10240, 2560, True, "gelu_tanh"), (64, 2560, 10240, True, "none"),
    ]  # fmt: skip
    sc2 = dict(model_type="starcoder2", hidden_size=6144, intermediate_size=24576, hidden_act="gelu_pytorch_tanh",
               use_bias=True)  # fmt: skip
    up, down = model_keys("epilogue", sc2, 2, [8], torch.bfloat16)
    assert (up.N, up.K, up.bias, down.N, down.K, down.bias) == (12288, 6144, True, 6144, 12288, False)
    assert model_keys("epilogue", dict(model_type="llama", hidden_size=64), 1, [1], torch.bfloat16) == []


def test_patched_mlp_uses_a_tuned_epilogue_row(tmp_path):
    from gemmtune.device import identity
    from gemmtune.families import get

    opt = _build("phi")
    gemmtune.optimize(opt)
    ident = identity("cpu")
    cols = list(get("epilogue").tuned_columns)
    row = dict(gfx=ident.gfx, cu_num=ident.cu_num, M=18, N=176, K=64, bias="True", dtype="torch.float32",
               outdtype="torch.float32", scaleAB="False", bpreshuffle="False", libtype="torch", solidx=0, splitK=0,
               us=1, kernelName="native", err_ratio=0, tflops=0, bw=0, act="gelu_tanh", alpha="False",
               beta="False", c="none", w_layout="nk")  # fmt: skip
    p = tmp_path / "epilogue.csv"
    p.write_text(",".join(cols) + "\n" + ",".join(str(row[c]) for c in cols) + "\n")
    gemmtune.set_config(str(p))
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        opt(ids, use_cache=False)
    from gemmtune.families.epilogue import EpilogueKey

    res = gemmtune.resolve(EpilogueKey(18, 176, 64, True, torch.float32, torch.float32, "gelu_tanh"), "cpu",
                           family="epilogue")  # fmt: skip
    assert res.row is not None
    cache = gemmtune.get_dispatcher().cache("epilogue")
    assert any(sig[0] == (2, 9, 64) and sig[8] == "gelu_tanh" for sig in cache)  # the MLP called the op


@pytest.mark.parametrize("name", list(CONFIGS))
def test_report_says_what_the_registry_entry_says(name):
    # these model types are registry entries without an optimize() layout: the report gives the entry's reason
    from gemmtune.model_types import REGISTRY

    report = gemmtune.optimize(_build(name))
    why = dict(report.skipped)["architecture"]
    assert why == f"model_type {name!r} has no optimize() layout: {REGISTRY[name].not_optimized}"
    assert REGISTRY[name].epilogue_mlp.mlp_class == MLP_CLASS[name]
