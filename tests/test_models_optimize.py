"""optimize()/restore() behaviour: report, idempotence, bad input, restore, state_dict, isolation,
capture of the fused shapes, guards, and never a half-patched model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_models_parity import batch, build, tiny_config  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.device import triton_reason  # noqa: E402
from gemmtune.errors import EnvVarError  # noqa: E402
from gemmtune.models import api as opt_mod  # noqa: E402
from gemmtune.models import version  # noqa: E402
from gemmtune.models.linear import FusedLinear  # noqa: E402


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def test_report_lists_changes_and_skips():
    model = build("mixtral")
    report = gemmtune.optimize(model)
    text = report.summary()
    assert report.architecture == "mixtral" and report.attention_tier in ("sdpa", "flash")
    assert "fuse" in report.counts() and "norm" in report.counts()
    assert report.counts().get("moe") == 2 and "gemmtune.fused_moe" in text
    assert str(report) == text
    assert gemmtune.models.report_of(model) is report


def test_optimize_report_groups_by_module_type():
    # The report says what was fused / swapped / routed / left alone, per module type, with reasons;
    # it used to print bare counts ("attention: 1", "route: 5").
    model = build("llama")
    model.model.layers[1].self_attn.k_proj = nn.Identity()  # not an nn.Linear: q/k/v cannot be fused
    text = str(gemmtune.optimize(model))
    sections = [line.strip() for line in text.splitlines() if line.startswith("  ") and line.endswith(":")]
    assert sections == ["fused:", "swapped:", "routed through gemmtune.gemm:", "left alone:"], text
    assert "LlamaAttention x1 [model.layers.*.self_attn]: q/k/v -> qkv_proj N=128 (4 q heads, 2 kv heads)" in text
    assert "LlamaMLP x2 [model.layers.*.mlp]: gate/up -> gate_up_proj N=256" in text
    norms = "model.layers.*.input_layernorm, model.layers.*.post_attention_layernorm, model.norm"
    assert f"LlamaRMSNorm x5 [{norms}]: gemmtune RMSNorm" in text
    assert "Linear x2 [model.layers.*.mlp.down_proj]: GEMM N=64 K=128" in text
    assert "LlamaAttention x1 [model.layers.*.self_attn]: q/k/v not fused: k_proj" in text
    assert "attention: 1" not in text and "route: " not in text
    # where Triton cannot run (the CPU), the kernels the report names run as their PyTorch references
    why = triton_reason(next(model.parameters()).device)
    assert (f"note: {why}: the kernels named above run as their PyTorch references" in text) == bool(why), text


def test_optimize_twice_is_a_noop_and_other_options_raise():
    model = build("llama")
    r1 = gemmtune.optimize(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert gemmtune.optimize(model) is r1
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="already optimized"):
        gemmtune.optimize(model, fuse_qkv=False)


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match="PreTrainedModel"):
        gemmtune.optimize(nn.Sequential(nn.Linear(4, 4)))


def test_restore_gives_back_stock_modules_and_results():
    stock = build("qwen2")
    model = copy.deepcopy(stock)
    ids, mask = batch()
    report = gemmtune.optimize(model)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedLinear)
    report.undo()
    attn = model.model.layers[0].self_attn
    assert list(attn._modules) == list(stock.model.layers[0].self_attn._modules)
    assert type(attn.q_proj) is nn.Linear and attn.q_proj.bias is not None
    assert not any(k.startswith("_gemmtune") or k == "forward" for m in model.modules() for k in m.__dict__)
    assert model.config._attn_implementation == stock.config._attn_implementation
    assert torch.equal(logits(model, ids, mask), logits(stock, ids, mask))
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in stock.named_parameters()]
    with pytest.raises(ValueError, match="not optimized"):
        gemmtune.restore(model)
    gemmtune.optimize(model)  # and it can be optimized again
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)


def test_fusion_does_not_double_parameters():
    stock = build("llama")
    model = copy.deepcopy(stock)
    gemmtune.optimize(model)
    n_stock = sum(p.numel() for p in stock.parameters())
    assert sum(p.numel() for p in model.parameters()) == n_stock


def test_state_dict_round_trips_with_stock_keys():
    stock = build("qwen2")
    model = copy.deepcopy(stock)
    gemmtune.optimize(model)
    sd, sd0 = model.state_dict(), stock.state_dict()
    assert sorted(sd) == sorted(sd0)
    assert all(torch.equal(sd[k], sd0[k]) for k in sd0)
    # a stock checkpoint loads into the optimized model (into the fused weight)
    other = build("qwen2")
    other = type(other)(other.config)
    with torch.no_grad():
        for p in other.parameters():
            p.normal_()
    model.load_state_dict(other.state_dict())
    ids, mask = batch()
    torch.testing.assert_close(logits(model, ids, mask), logits(other, ids, mask), rtol=1e-4, atol=1e-5)
    # and the optimized model's state dict loads into a stock one
    stock.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(stock, ids, mask), logits(other, ids, mask), rtol=1e-4, atol=1e-5)


def test_partial_checkpoint_is_refused_clearly():
    model = build("llama")
    gemmtune.optimize(model)
    sd = model.state_dict()
    del sd["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(RuntimeError, match=r"k_proj.weight.*restore"):
        model.load_state_dict(sd)


def test_models_sharing_a_config_stay_untouched():
    cfg = tiny_config("llama")
    a = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    b = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    assert a.config is b.config
    gemmtune.optimize(a, attention="eager")
    assert b.config._attn_implementation == "sdpa"
    assert all(m.config is b.config for m in b.modules() if hasattr(m, "config"))
    assert not any("forward" in m.__dict__ for m in b.modules())


def test_unknown_architecture_gets_linear_routing_only():
    cfg = transformers.OPTConfig(
        hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2, vocab_size=64, word_embed_proj_dim=32
    )
    stock = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model = copy.deepcopy(stock)
    report = gemmtune.optimize(model)
    assert report.architecture == "unknown" and report.attention_tier is None
    assert set(report.counts()) == {"route"}
    assert any(w == "architecture" for w, _ in report.skipped)
    ids = torch.randint(4, 64, (2, 7))
    mask = torch.ones_like(ids)
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)


def test_capture_sees_the_fused_shapes(tmp_path, clean_dispatch):
    model = build("llama")
    gemmtune.optimize(model)
    cap = gemmtune.set_capture(str(tmp_path / "shapes.csv"))
    ids, mask = batch()
    logits(model, ids, mask)
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    seen = {(k.N, k.K) for k in cap.counts}
    assert (q + 2 * kv, cfg.hidden_size) in seen  # qkv as one GEMM
    assert (2 * cfg.intermediate_size, cfg.hidden_size) in seen  # gate_up as one GEMM
    assert (cfg.hidden_size, cfg.intermediate_size) in seen  # down_proj
    assert (kv, cfg.hidden_size) not in seen  # no separate k_proj / v_proj call
    gemmtune.set_capture(None)
    rows = (tmp_path / "shapes.csv").read_text()
    assert f",{q + 2 * kv},{cfg.hidden_size}," in rows


def test_m_threshold_keeps_small_m_on_f_linear(clean_dispatch, tmp_path):
    model = build("llama")
    gemmtune.optimize(model, m_threshold=16)
    cap = gemmtune.set_capture(str(tmp_path / "s.csv"))
    ids, mask = batch()  # 3 x 11 = 33 tokens >= 16: through gemm
    logits(model, ids, mask)
    big = set(cap.counts)
    assert big and all(k.M == 33 for k in big)
    with torch.no_grad():
        model(ids[:, :1], use_cache=False)  # M = 3 < 16: F.linear, nothing captured
    assert set(cap.counts) == big


def test_split_bias_and_dtype_guard():
    stock = build("qwen2")
    model = copy.deepcopy(stock)
    gemmtune.optimize(model, split_bias=True)
    ids, mask = batch()
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)
    lin = model.model.layers[0].self_attn.o_proj
    x = torch.randn(2, lin.in_features, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # same error F.linear gives for a dtype mix
        lin(x)


def test_gemm_failure_falls_back_to_f_linear(monkeypatch):
    from gemmtune.models import linear

    stock = build("llama")
    model = copy.deepcopy(stock)
    gemmtune.optimize(model)

    def broken(*a, **k):
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(linear, "_gemm_fn", [broken])
    ids, mask = batch()
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)


def test_failure_while_applying_leaves_the_model_unpatched(monkeypatch):
    model = build("gemma3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mods_before = [n for n, _ in model.named_modules()]
    real = opt_mod._apply
    calls = []

    def flaky(model_, action, route):
        calls.append(action.kind)
        if len(calls) == 12:
            raise RuntimeError("injected")
        return real(model_, action, route)

    monkeypatch.setattr(opt_mod, "_apply", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        gemmtune.optimize(model)
    assert [n for n, _ in model.named_modules()] == mods_before
    assert not any(k.startswith("_gemmtune") or k == "forward" for m in model.modules() for k in m.__dict__)
    sd = model.state_dict()
    assert sorted(sd) == sorted(before) and all(torch.equal(sd[k], before[k]) for k in before)
    assert gemmtune.models.report_of(model) is None


def test_layout_mismatch_is_skipped_not_guessed():
    model = build("llama")
    model.model.layers[1].self_attn.q_proj = nn.Sequential(nn.Linear(64, 64, bias=False))
    report = gemmtune.optimize(model)
    skipped = dict(report.skipped)
    assert "not a plain nn.Linear" in skipped["fuse qkv: model.layers.1.self_attn"]
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert not hasattr(model.model.layers[1].self_attn, "qkv_proj")


def test_unknown_norm_formula_is_skipped():
    model = build("llama")
    norm = model.model.layers[0].input_layernorm
    norm.variance_epsilon = 1e-5

    class Odd(type(norm)):
        def forward(self, x):
            return super().forward(x) * 2

    norm.__class__ = Odd
    report = gemmtune.optimize(model)
    assert "known RMSNorm formula" in dict(report.skipped)["norm: model.layers.0.input_layernorm"]


def test_forced_flash_without_flash_attn_raises(monkeypatch):
    from gemmtune.models import attention

    monkeypatch.setattr(attention, "_flash_cache", [None])
    with pytest.raises(ValueError, match="flash-attn"):
        gemmtune.optimize(build("llama"), attention="flash")
    monkeypatch.setenv(attention.ENV, "bogus")
    with pytest.raises(EnvVarError, match="GEMMTUNE_ATTENTION='bogus'"):
        gemmtune.optimize(build("llama"))


def test_version_check_message(monkeypatch):
    monkeypatch.delenv(version.SKIP_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"supports transformers >=5\.17,<5\.25, found 4\.46\.0"):
        version.check_transformers("4.46.0")
    with pytest.raises(RuntimeError, match=r"found 5\.25\.0"):  # newer than what CI has tested
        version.check_transformers("5.25.0")
    assert version.check_transformers("5.20.1") == "5.20.1" and version.check_transformers("5.24.0") == "5.24.0"
    monkeypatch.setenv(version.SKIP_ENV, "1")
    assert version.check_transformers("6.3.0") == "6.3.0"


def test_deepcopy_of_optimized_model_restores_itself():
    model = build("llama")
    gemmtune.optimize(model)
    twin = copy.deepcopy(model)
    gemmtune.restore(twin)
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert hasattr(twin.model.layers[0].self_attn, "q_proj")
    ids, mask = batch()
    torch.testing.assert_close(logits(twin, ids, mask), logits(model, ids, mask), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_optimized_model_compiles_fullgraph_and_matches(arch):
    """optimize() before torch.compile: no graph break, same logits on a padded batch (its real tokens:
    a padding position attends to nothing, and what each attention path leaves there is undefined)."""
    model = build(arch)
    ids, mask = batch()
    ref = logits(model, ids, mask)
    gemmtune.optimize(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        out = compiled(ids, attention_mask=mask, use_cache=False).logits
    valid = mask.bool()
    torch.testing.assert_close(out[valid], ref[valid], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a fresh interpreter without triton runs the whole pipeline
def test_optimize_runs_without_triton(tmp_path):
    """Triton is an optional extra: optimize(), plain and quantized, runs its PyTorch references without it
    (a fresh process where importing triton fails)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError
        import torch
        import gemmtune
        from gemmtune.profiling.build import build_model
        ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(0))
        for quantize in (None, "fp8"):
            model, _ = build_model("tiny-llama", layers=1)
            want = model(ids).logits
            report = gemmtune.optimize(model, quantize=quantize)
            got = model(ids).logits
            print(quantize, dict(report.counts()).get("quantize", 0), float((got - want).abs().max()))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, quantized = (line.split() for line in proc.stdout.strip().splitlines()[-2:])
    assert plain[0] == "None" and float(plain[2]) < 1e-4, proc.stdout
    assert quantized[0] == "fp8" and int(quantized[1]) > 0 and float(quantized[2]) < 0.5, proc.stdout
