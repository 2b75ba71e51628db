"""Shape derivation from model configs (hand-computed per model and tp) and `gemmtune shapes`."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from gemmtune.capture import read_shapes
from gemmtune.cli.main import cli
from gemmtune.keys import GemmKey
from gemmtune.tuner.model_shapes import (
    PRESETS,
    ModelConfigError,
    config_dtype,
    gemm_keys,
    load_model_config,
    model_gemms,
    parse_nsets,
)

# (name, N, K) per rank, computed by hand from each config.json in tests/data/models:
# qkv N = (heads/tp + 2 * max(1, kv/tp)) * head_dim, o K = heads/tp * head_dim,
# gate_up N = 2 * inter/tp, down K = inter/tp, lm_head N = vocab/tp.
EXPECTED = {
    ("llama-3-8b", 1): [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
                        ("lm_head", 128256, 4096)],
    ("llama-3-8b", 8): [("qkv", 768, 4096), ("o", 4096, 512), ("gate_up", 3584, 4096), ("down", 4096, 1792),
                        ("lm_head", 16032, 4096)],
    ("llama-3-70b", 1): [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672),
                         ("lm_head", 128256, 8192)],
    ("llama-3-70b", 8): [("qkv", 1280, 8192), ("o", 8192, 1024), ("gate_up", 7168, 8192), ("down", 8192, 3584),
                         ("lm_head", 16032, 8192)],
    ("mixtral-8x7b", 1): [("qkv", 6144, 4096), ("o", 4096, 4096), ("router", 8, 4096),
                          ("expert_gate_up", 28672, 4096), ("expert_down", 4096, 14336), ("lm_head", 32000, 4096)],
    ("mixtral-8x7b", 8): [("qkv", 768, 4096), ("o", 4096, 512), ("router", 8, 4096),
                          ("expert_gate_up", 3584, 4096), ("expert_down", 4096, 1792), ("lm_head", 4000, 4096)],
    ("qwen3-30b-a3b", 1): [("qkv", 5120, 2048), ("o", 2048, 4096), ("router", 128, 2048),
                           ("expert_gate_up", 1536, 2048), ("expert_down", 2048, 768), ("lm_head", 151936, 2048)],
    # 4 kv heads over 8 ranks: each rank keeps one (replicated).
    ("qwen3-30b-a3b", 8): [("qkv", 768, 2048), ("o", 2048, 512), ("router", 128, 2048),
                           ("expert_gate_up", 192, 2048), ("expert_down", 2048, 96), ("lm_head", 18992, 2048)],
    ("qwen3-32b", 1): [("qkv", 10240, 5120), ("o", 5120, 8192), ("gate_up", 51200, 5120), ("down", 5120, 25600),
                       ("lm_head", 151936, 5120)],
    ("qwen3-32b", 8): [("qkv", 1280, 5120), ("o", 5120, 1024), ("gate_up", 6400, 5120), ("down", 5120, 3200),
                       ("lm_head", 18992, 5120)],
    ("tiny-llama", 1): [("qkv", 128, 64), ("o", 64, 64), ("gate_up", 256, 64), ("down", 64, 128),
                        ("lm_head", 256, 64)],
    ("tiny-llama", 2): [("qkv", 64, 64), ("o", 64, 32), ("gate_up", 128, 64), ("down", 64, 64),
                        ("lm_head", 128, 64)],
}  # fmt: skip


def _shapes(config, tp):
    return [(s.name, s.N, s.K) for s in model_gemms(config, tp)]


@pytest.mark.parametrize(("model", "tp"), sorted(EXPECTED))
def test_model_files_match_hand_computed(model_configs, model, tp):
    config = json.loads((model_configs / f"{model}.json").read_text())
    assert _shapes(config, tp) == EXPECTED[(model, tp)]
    # The built-in preset of the same name derives the same shapes.
    assert _shapes(PRESETS[model], tp) == EXPECTED[(model, tp)]
    assert not any(s.bias for s in model_gemms(config, tp))


def test_every_model_file_is_covered(model_configs):
    files = {p.stem for p in model_configs.glob("*.json")}
    assert files == {m for m, _ in EXPECTED}


def test_tiny_llama_tp8_is_an_error_naming_heads(model_configs):
    config = json.loads((model_configs / "tiny-llama.json").read_text())
    with pytest.raises(ModelConfigError, match="num_attention_heads=4 is not divisible by tp=8"):
        model_gemms(config, 8)


def test_kv_heads_replicated_when_fewer_than_tp():
    # Llama-3-8B at tp 16: 2 q heads and 1 (replicated) kv head per rank.
    qkv = model_gemms(PRESETS["llama-3-8b"], 16)[0]
    assert (qkv.name, qkv.N, qkv.K) == ("qkv", (2 + 2 * 1) * 128, 4096)
    with pytest.raises(ModelConfigError, match="replicated"):
        model_gemms(dict(PRESETS["llama-3-8b"], num_key_value_heads=3, num_attention_heads=48), 16)


def test_biases_follow_the_architecture():
    qwen2 = {s.name: s.bias for s in model_gemms(PRESETS["qwen2.5-7b"])}
    assert qwen2 == {"qkv": True, "o": False, "gate_up": False, "down": False, "lm_head": False}
    llama = {s.name: s.bias for s in model_gemms(dict(PRESETS["llama-3-8b"], attention_bias=True, mlp_bias=True))}
    assert llama == {"qkv": True, "o": True, "gate_up": True, "down": True, "lm_head": False}


def test_head_dim_explicit_differs_from_hidden_over_heads():
    # Gemma-2-9B: 16 heads x 256 = 4096 != hidden 3584.
    shapes = {s.name: (s.N, s.K) for s in model_gemms(PRESETS["gemma-2-9b"], 2)}
    assert shapes["qkv"] == ((8 + 2 * 4) * 256, 3584)
    assert shapes["o"] == (3584, 8 * 256)


def test_deepseek_v3_tp8_covers_aiters_shape_list(aiter_configs):
    ours = {(s.N, s.K) for s in model_gemms(PRESETS["deepseek-v3"], 8)}
    path = aiter_configs / "dsv3_bf16_untuned_gemm.csv"
    theirs = {(k.N, k.K) for k, _ in read_shapes(str(path))}
    assert theirs <= ours, theirs - ours


def test_expert_gemms_are_keyed_on_tokens_per_expert():
    shapes = {s.name: s for s in model_gemms(PRESETS["qwen3-30b-a3b"])}
    e = shapes["expert_gate_up"]
    assert [e.m_for(t) for t in (1, 16, 64, 1000)] == [1, 1, 4, 63]  # ceil(T * 8 / 128)
    assert shapes["router"].m_for(64) == 64
    keys = gemm_keys([e], [1, 16, 64], torch.bfloat16)
    assert keys == [GemmKey(1, 1536, 2048), GemmKey(4, 1536, 2048)]  # deduplicated


def test_text_config_nesting_and_architectures_fallback():
    inner = dict(PRESETS["llama-3-8b"], model_type="gemma3_text")
    outer = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": inner}
    assert _shapes(outer, 1) == _shapes(inner, 1)
    no_type = {k: v for k, v in PRESETS["llama-3-8b"].items() if k != "model_type"}
    no_type["architectures"] = ["LlamaForCausalLM"]
    assert _shapes(no_type, 8) == EXPECTED[("llama-3-8b", 8)]


def test_unknown_architecture_lists_supported():
    with pytest.raises(ModelConfigError) as err:
        model_gemms({"model_type": "bert", "hidden_size": 8})
    msg = str(err.value)
    assert "bert" in msg and "llama" in msg and "qwen3_moe" in msg and "deepseek_v3" in msg


def test_config_dtype_and_nsets():
    assert config_dtype(PRESETS["tiny-llama"]) == torch.float32
    assert config_dtype({}) == torch.bfloat16
    assert parse_nsets("1,4,32..256") == [1, 4, 32, 64, 128, 256]
    for bad in ("0", "x", "8..2", ""):
        with pytest.raises(ValueError):
            parse_nsets(bad)


def test_load_model_config_sources(tmp_path, model_configs):
    cfg, src = load_model_config("llama-3-70b")
    assert src == "preset llama-3-70b" and cfg["hidden_size"] == 8192
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text((model_configs / "qwen3-32b.json").read_text())
    assert load_model_config(str(d))[0]["model_type"] == "qwen3"
    with pytest.raises(ModelConfigError, match="preset"):
        load_model_config(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="bad.json"):
        load_model_config(str(tmp_path / "bad.json"))


def test_shapes_cli_writes_aiter_untuned_csv(tmp_path, model_configs):
    out = tmp_path / "shapes.csv"
    model = str(model_configs / "llama-3-70b.json")
    res = CliRunner().invoke(cli, ["shapes", "--model", model, "--tp", "8", "--nsets", "1,16", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_text().splitlines()[0] == "M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle"
    keys = [k for k, _ in read_shapes(str(out))]
    assert len(keys) == 10
    assert GemmKey(16, 1280, 8192) in keys and GemmKey(1, 8192, 3584) in keys
    assert all(k.dtype == torch.bfloat16 for k in keys)


def test_shapes_cli_dtype_override_and_stdout():
    res = CliRunner().invoke(cli, ["shapes", "-m", "tiny-llama", "--nsets", "2", "--dtype", "fp16", "--no-lm-head"])
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[1] == "2,128,64,False,torch.float16,torch.float16,False,False"
    assert len(lines) == 1 + 4


@pytest.mark.parametrize("family", ["a8w8", "a8w8_blockscale"])
def test_shapes_cli_no_lm_head_for_8bit_families(family):
    """--no-lm-head leaves the vocab projection out of the 8-bit lists too (optimize keeps it 16-bit)."""

    def ns(*extra):
        res = CliRunner().invoke(cli, ["shapes", "-m", "llama-3-8b", "--family", family, "--nsets", "2048", *extra])
        assert res.exit_code == 0, res.output
        return {int(line.split(",")[1]) for line in res.output.strip().splitlines()[1:]}

    assert ns() == {6144, 4096, 28672, 128256}
    assert ns("--no-lm-head") == {6144, 4096, 28672}


def test_shapes_cli_fmoe_keys_shared_experts_dense_or_fused(tmp_path):
    """DeepSeek-V3's shared expert: a dense MLP by default (optimize() runs it so: its GEMMs are in the
    a16w16 list), an extra expert of the fused call with --fuse-shared-experts (aiter's, SGLang's way)."""

    def expert_columns(*extra):
        out = tmp_path / "moe.csv"
        args = ["shapes", "-m", "deepseek-v3", "--family", "fmoe", "--nsets", "4", *extra, "-o", str(out)]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, res.output
        header, row = out.read_text().splitlines()
        return {c: v for c, v in zip(header.split(","), row.split(",")) if c in ("expert", "topk")}

    assert expert_columns() == {"expert": "256", "topk": "8"}
    assert expert_columns("--fuse-shared-experts") == {"expert": "257", "topk": "8"}
    dense = CliRunner().invoke(cli, ["shapes", "-m", "deepseek-v3", "--nsets", "4"])
    # the shared expert's gate/up GEMM at every token (the routed experts' is keyed at ceil(4*8/256) = 1)
    assert dense.exit_code == 0 and "\n4,4096,7168,False," in dense.output
    bad = CliRunner().invoke(cli, ["shapes", "-m", "deepseek-v3", "--fuse-shared-experts"])
    assert bad.exit_code != 0 and "--fuse-shared-experts applies to --family fmoe, not --family a16w16" in bad.output


def test_shapes_cli_errors_are_clear(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"model_type": "t5"}))
    res = CliRunner().invoke(cli, ["shapes", "-m", str(tmp_path / "c.json"), "-o", str(tmp_path / "o.csv")])
    assert res.exit_code != 0 and "t5" in res.output and "supported" in res.output
    assert not (tmp_path / "o.csv").exists()
    res = CliRunner().invoke(cli, ["shapes", "-m", "tiny-llama", "--nsets", "0"])
    assert res.exit_code != 0 and "bad token count" in res.output


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_attention_heads", 0, "num_attention_heads=0 must be a positive integer"),
        ("hidden_size", -64, "hidden_size=-64 must be a positive integer"),
        ("intermediate_size", 12.5, "intermediate_size=12.5 must be a positive integer"),
        ("vocab_size", "256", "vocab_size='256' must be a positive integer"),
        ("num_key_value_heads", -2, "num_key_value_heads=-2 must be a non-negative integer"),
        ("head_dim", -16, "head_dim=-16 must be a non-negative integer"),
    ],
)
def test_shapes_zero_heads_and_negative_sizes_are_clear_errors(field, value, match):
    # 0 heads used to raise ZeroDivisionError; a negative hidden_size wrote negative N and K.
    with pytest.raises(ModelConfigError, match=match):
        model_gemms(dict(PRESETS["tiny-llama"], **{field: value}))


def test_shapes_cli_bad_config_value_is_one_line_error_naming_file_and_field(tmp_path):
    for field, value in (("num_attention_heads", 0), ("hidden_size", -64)):
        cfg = tmp_path / f"{field}.json"
        cfg.write_text(json.dumps(dict(PRESETS["tiny-llama"], **{field: value})))
        out = tmp_path / "shapes.csv"
        res = CliRunner().invoke(cli, ["shapes", "-m", str(cfg), "-o", str(out)])
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert res.output.strip().splitlines() == [f"Error: {cfg}: model config: {field}={value} must be a positive "
                                                   "integer (model_type 'llama')"]  # fmt: skip
        assert not out.exists()


def test_config_dtype_float64_is_an_error_not_bf16(tmp_path):
    for field in ("torch_dtype", "dtype"):
        with pytest.raises(ModelConfigError, match=f"{field}='float64' is not a dtype gemmtune tunes"):
            config_dtype({field: "float64"})
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(dict(PRESETS["tiny-llama"], torch_dtype="float64")))
    res = CliRunner().invoke(cli, ["shapes", "-m", str(cfg), "--nsets", "1"])
    assert res.exit_code == 1 and "torch_dtype='float64'" in res.output and "--dtype" in res.output
    res = CliRunner().invoke(cli, ["shapes", "-m", str(cfg), "--nsets", "1", "--dtype", "bf16"])
    assert res.exit_code == 0 and "torch.bfloat16" in res.output  # an explicit --dtype is the way out


# Linear -> act -> Linear models, from their public config.json files (the fields their shapes read).
EPILOGUE_MLP_CONFIGS = {
    "pythia-6.9b": dict(model_type="gpt_neox", hidden_size=4096, num_attention_heads=32, intermediate_size=16384,
                        num_hidden_layers=32, vocab_size=50432, hidden_act="gelu", attention_bias=True),
    "phi-2": dict(model_type="phi", hidden_size=2560, num_attention_heads=32, num_key_value_heads=32,
                  intermediate_size=10240, num_hidden_layers=32, vocab_size=51200, hidden_act="gelu_new"),
    "starcoder2-15b": dict(model_type="starcoder2", hidden_size=6144, num_attention_heads=48, num_key_value_heads=4,
                           intermediate_size=24576, num_hidden_layers=40, vocab_size=49152, use_bias=True,
                           hidden_act="gelu_pytorch_tanh"),
    "falcon-7b": dict(model_type="falcon", hidden_size=4544, num_attention_heads=71, num_hidden_layers=32,
                      vocab_size=65024, multi_query=True, new_decoder_architecture=False, bias=False),
    "falcon-40b": dict(model_type="falcon", hidden_size=8192, num_attention_heads=128, num_kv_heads=8,
                       num_hidden_layers=60, vocab_size=65024, new_decoder_architecture=True, bias=False),
}  # fmt: skip
# (name, N, K, bias) per rank by hand: GPT-NeoX's qkv 3 * hidden/tp; Phi's and StarCoder2's as Llama's with
# biases (StarCoder2-15B's 4 kv heads replicated at tp 8); Falcon-7B's one kv head: hidden + 2 * 64;
# Falcon-40B's (128/tp + 2 * 8/tp) * 64; up N = inter/tp (4 * hidden for Falcon), down K = inter/tp.
EPILOGUE_MLP_EXPECTED = {
    ("pythia-6.9b", 1): [("qkv", 12288, 4096, True), ("o", 4096, 4096, True), ("up", 16384, 4096, True),
                         ("down", 4096, 16384, True), ("lm_head", 50432, 4096, False)],
    ("pythia-6.9b", 8): [("qkv", 1536, 4096, True), ("o", 4096, 512, True), ("up", 2048, 4096, True),
                         ("down", 4096, 2048, True), ("lm_head", 6304, 4096, False)],
    ("phi-2", 1): [("qkv", 7680, 2560, True), ("o", 2560, 2560, True), ("up", 10240, 2560, True),
                   ("down", 2560, 10240, True), ("lm_head", 51200, 2560, True)],
    ("starcoder2-15b", 8): [("qkv", 1024, 6144, True), ("o", 6144, 768, True), ("up", 3072, 6144, True),
                            ("down", 6144, 3072, True), ("lm_head", 6144, 6144, False)],
    ("falcon-7b", 1): [("qkv", 4672, 4544, False), ("o", 4544, 4544, False), ("up", 18176, 4544, False),
                       ("down", 4544, 18176, False), ("lm_head", 65024, 4544, False)],
    ("falcon-40b", 8): [("qkv", 1152, 8192, False), ("o", 8192, 1024, False), ("up", 4096, 8192, False),
                        ("down", 8192, 4096, False), ("lm_head", 8128, 8192, False)],
}  # fmt: skip


@pytest.mark.parametrize(("model", "tp"), sorted(EPILOGUE_MLP_EXPECTED))
def test_epilogue_mlp_models_match_hand_computed(model, tp):
    got = [(s.name, s.N, s.K, s.bias) for s in model_gemms(EPILOGUE_MLP_CONFIGS[model], tp)]
    assert got == EPILOGUE_MLP_EXPECTED[(model, tp)]


def test_falcon_7b_heads_do_not_split_over_tp():
    with pytest.raises(ModelConfigError, match="num_attention_heads=71 is not divisible by tp=2"):
        model_gemms(EPILOGUE_MLP_CONFIGS["falcon-7b"], 2)


@pytest.mark.parametrize("model", sorted(EPILOGUE_MLP_CONFIGS))
def test_shapes_cli_on_an_epilogue_mlp_config_every_family(tmp_path, model):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(EPILOGUE_MLP_CONFIGS[model]))
    tp = "8" if model != "falcon-7b" else "1"
    shapes = model_gemms(EPILOGUE_MLP_CONFIGS[model], int(tp))
    for family, rows in (("a16w16", 2 * len(shapes)), ("epilogue", 4), ("a8w8", 2 * len(shapes))):
        out = tmp_path / f"{family}.csv"
        args = ["shapes", "-m", str(cfg), "--tp", tp, "--nsets", "1,16", "--family", family, "-o", str(out)]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 0, (family, res.output)
        assert len(out.read_text().splitlines()) == 1 + rows, family
    header, up = (tmp_path / "epilogue.csv").read_text().splitlines()[:2]
    row = dict(zip(header.split(","), up.split(",")))
    first_up = next(s for s in shapes if s.name == "up")
    assert (row["M"], row["N"], row["K"]) == ("1", str(first_up.N), str(first_up.K))
    assert row["act"] in ("gelu", "gelu_tanh")
    for fam in ("fmoe", "batched"):  # families these dense models do not run
        res = CliRunner().invoke(cli, ["shapes", "-m", str(cfg), "--tp", tp, "--family", fam])
        assert res.exit_code != 0 and f"runs no {fam} GEMMs" in res.output
