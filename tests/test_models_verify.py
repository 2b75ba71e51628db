"""optimize()'s own check of the cached path (models/verify.py) and its reading of the stock forwards'
signatures (models/architectures.py): a swapped layer that decodes wrong is put back to stock and reported,
a stock parameter the patch does not know leaves the module stock, the probe leaves no trace."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_models_parity import ARCHITECTURES, DEFAULT_TIER_ARCHS, batch, build, pair  # noqa: E402
from tiers import tiered  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.models import architectures, verify  # noqa: E402
from gemmtune.models.hf_cache import CACHE_ARGS, pop_cache  # noqa: E402


def _greedy(model, n=8):
    ids, mask = batch()
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)


@pytest.mark.parametrize("arch", tiered(ARCHITECTURES, DEFAULT_TIER_ARCHS.__contains__))
def test_every_architecture_passes_the_cached_path_check(arch):
    _, _, report = pair(arch)
    note = [n for n in report.notes if n.startswith("cached-path check")]
    assert len(note) == 1, report.summary()
    assert "2/2 decoder layers agree" in note[0] and "took" in note[0], note[0]
    assert not any(k.startswith("verify") for k, _ in report.skipped), report.summary()


def _drop_cache(monkeypatch):
    """The failure transformers 5.24 caused: the patched attention never sees its KV cache."""
    real = architectures._attention_forward

    def forgetful(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        for name in CACHE_ARGS:
            kwargs.pop(name, None)
        return real(self, hidden_states, position_embeddings, attention_mask, **kwargs)

    monkeypatch.setattr(architectures, "_attention_forward", forgetful)


@pytest.mark.parametrize("arch", tiered(["llama", "gemma2", "qwen3_moe"], lambda a: a == "llama"))
def test_a_layer_that_decodes_wrong_is_put_back_to_stock(arch, monkeypatch):
    _drop_cache(monkeypatch)
    stock, opt, report = pair(arch)
    skipped = [(k, why) for k, why in report.skipped if k.startswith("verify")]
    assert [k for k, _ in skipped] == ["verify: model.layers.0", "verify: model.layers.1"], report.summary()
    assert all("cached decode step" in why for _, why in skipped)  # prefill alone agreed
    assert "0/2 decoder layers agree" in report.summary()
    for layer in opt.model.layers:  # nothing of the layer stays patched
        assert not any("forward" in m.__dict__ for m in layer.modules())
        assert hasattr(layer.self_attn, "q_proj") and not hasattr(layer.self_attn, "qkv_proj")
    assert not any("model.layers" in c for c in report.changed)
    assert torch.equal(_greedy(opt), _greedy(stock))
    gemmtune.restore(opt)  # what remains (final norm, lm_head) still undoes cleanly


def test_without_the_check_the_broken_layer_would_decode_wrong(monkeypatch):
    """The check above is what saves the tokens: with verify=False the same patch changes them."""
    _drop_cache(monkeypatch)
    stock, opt, report = pair("llama", verify=False)
    assert not any(n.startswith("cached-path check") for n in report.notes)
    assert not torch.equal(_greedy(opt), _greedy(stock))


def test_one_bad_layer_only_that_layer_goes_back(monkeypatch):
    real = architectures._attention_forward

    def bad_in_layer_1(self, *args, **kwargs):
        out, w = real(self, *args, **kwargs)
        return (out * 1.01 if self.layer_idx == 1 else out), w

    monkeypatch.setattr(architectures, "_attention_forward", bad_in_layer_1)
    stock, opt, report = pair("qwen3")
    assert [k for k, _ in report.skipped if k.startswith("verify")] == ["verify: model.layers.1"]
    assert "forward" in opt.model.layers[0].self_attn.__dict__
    assert "forward" not in opt.model.layers[1].self_attn.__dict__
    assert torch.equal(_greedy(opt), _greedy(stock))


@pytest.fixture
def probe_phase(monkeypatch):
    """["stock" | "optimized" | None]: which of optimize()'s two cached-path probes is running."""
    phase = [None]
    real = verify.run

    def run(model, layers, probe, teacher=None):
        phase[0] = "stock" if teacher is None else "optimized"
        try:
            return real(model, layers, probe, teacher)
        finally:
            phase[0] = None

    monkeypatch.setattr(verify, "run", run)
    return phase


def _wrap_moe_blocks(model, monkeypatch, change):
    """Each MoE block's forward becomes change(real forward, block index, hidden_states, *args, **kwargs)."""
    blocks = [m for m in model.modules() if architectures.is_moe_block(m)]
    assert blocks
    for i, block in enumerate(blocks):
        real = block.forward
        monkeypatch.setattr(block, "forward", lambda h, *a, real=real, i=i, **k: change(real, i, h, *a, **k))


def _flip_on_any_difference(model, monkeypatch, phase):
    """A router proxy with every choice tied: in the optimized probe, a MoE block adds 1.0 to its output
    when its input is not bit-equal to one the stock block got in the stock probe (a routing flip on a
    rounding difference)."""
    seen: dict[int, list] = {}

    def change(real, i, h, *a, **k):
        out = real(h, *a, **k)
        if phase[0] == "stock":
            seen.setdefault(i, []).append(h.detach().clone())
        elif phase[0] == "optimized" and not any(x.shape == h.shape and torch.equal(x, h) for x in seen.get(i, [])):
            return (out[0] + 1.0, *out[1:]) if isinstance(out, tuple) else out + 1.0
        return out

    _wrap_moe_blocks(model, monkeypatch, change)


def _attention_off_by(monkeypatch, rel: float) -> None:
    real = architectures._attention_forward

    def off(self, *args, **kwargs):
        out, w = real(self, *args, **kwargs)
        return out * (1 + rel), w

    monkeypatch.setattr(architectures, "_attention_forward", off)


def test_a_moe_block_is_fed_stock_input_so_a_routing_flip_does_not_fail_its_layer(monkeypatch, probe_phase):
    """A rounding difference well within the tolerance before the MoE block (here the attention's output
    off by 1e-5) flips the proxy router's choice; the block gets stock's input in the check, so the
    layers agree: the attention half and the block are judged apart."""
    _attention_off_by(monkeypatch, 1e-5)
    model = build("qwen3_moe")
    _flip_on_any_difference(model, monkeypatch, probe_phase)
    report = gemmtune.optimize(model)
    assert "2/2 decoder layers agree" in report.summary(), report.summary()


def test_without_forcing_the_block_input_the_flip_would_fail_the_layers(monkeypatch, probe_phase):
    _attention_off_by(monkeypatch, 1e-5)
    monkeypatch.setattr(verify, "is_moe_block", lambda m: False)
    model = build("qwen3_moe")
    _flip_on_any_difference(model, monkeypatch, probe_phase)
    report = gemmtune.optimize(model)
    assert "1/2 decoder layers agree" in report.summary(), report.summary()  # layer 0 is dense
    assert [k for k, _ in report.skipped if k.startswith("verify")] == ["verify: model.layers.1"]


def test_a_wrong_input_to_the_moe_block_is_still_caught(monkeypatch, probe_phase):
    """Forcing the block's input hides nothing: the input the optimized layer computed for the block
    (as from a wrong post-attention norm: 5% off) is judged on its own, and put back."""
    model = build("qwen3_moe")

    def off_in_optimized(mod, args, kwargs):
        if probe_phase[0] == "optimized":
            h = args[0] if args else kwargs["hidden_states"]
            return ((h * 1.05, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": h * 1.05})
        return args, kwargs

    # registered before optimize(), so the check's own forcing hook (registered later) runs after it
    for m in model.modules():
        if architectures.is_moe_block(m):
            m.register_forward_pre_hook(off_in_optimized, with_kwargs=True)
    report = gemmtune.optimize(model)
    skipped = [k for k, _ in report.skipped if k.startswith("verify")]
    assert skipped == ["verify: model.layers.1"], report.summary()  # its MoE block (layer 0 is dense)


def test_the_probe_is_neither_captured_nor_left_in_caches(tmp_path):
    cap = tmp_path / "shapes.csv"
    gemmtune.set_capture(str(cap))
    try:
        model = build("llama")
        gemmtune.optimize(model)
        gemmtune.set_capture(None)  # flushes
        assert not cap.exists() or cap.read_text().count("\n") <= 1, cap.read_text()
    finally:
        gemmtune.set_capture(None)


def test_verify_cost_is_small_and_reported():
    _, _, report = pair("llama")
    note = next(n for n in report.notes if n.startswith("cached-path check"))
    secs = float(note.rsplit("took ", 1)[1].removesuffix(" s"))
    assert 0 < secs


# ---- reading the stock forwards' signatures ------------------------------------------------------
class _Attn:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        pass


class _OldAttn:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kw):
        pass


class _NewParamAttn:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, rope_deltas=None,
                **kwargs):  # fmt: skip
        pass


class _NoKwargsAttn:
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None):
        pass


def test_attention_call_reads_the_cache_name_and_refuses_unknown_parameters():
    assert architectures.attention_call(_Attn) == ("cache", None)
    assert architectures.attention_call(_OldAttn) == ("past_key_values", None)
    name, why = architectures.attention_call(_NewParamAttn)
    assert name == "" and "rope_deltas" in why and "_NewParamAttn" in why
    assert "**kwargs" in architectures.attention_call(_NoKwargsAttn)[1]


def test_installed_transformers_forwards_are_understood():
    for arch in ARCHITECTURES:
        model = build(arch)
        layer = model.model.layers[0]
        name, why = architectures.attention_call(type(layer.self_attn))
        assert why is None and name in CACHE_ARGS, (arch, why)
        assert architectures.layer_call(type(layer)) is None, arch


def test_unknown_stock_parameter_leaves_the_module_stock(monkeypatch):
    """A parameter the patch would drop: the attention and its layer stay stock, the report says why."""
    from transformers.models.llama import modeling_llama

    real = modeling_llama.LlamaAttention.forward

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, new_arg=None, **kwargs):
        return real(self, hidden_states, position_embeddings, attention_mask, **kwargs)  # the cache: in kwargs

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward)
    stock = build("llama")
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    reasons = [why for k, why in report.skipped if k.startswith("fuse qkv")]
    assert len(reasons) == 2 and all("new_arg" in r for r in reasons), report.summary()
    assert "forward" not in opt.model.layers[0].self_attn.__dict__
    assert torch.equal(_greedy(opt), _greedy(stock))


def test_patched_attention_takes_either_cache_name():
    """Callers may still pass the old name through transformers' deprecation shim: both reach the cache."""
    model = build("llama")
    gemmtune.optimize(model)
    attn = model.model.layers[0].self_attn
    spec = attn._gemmtune_attn
    other = next(n for n in CACHE_ARGS if n != spec.cache_arg)
    kwargs = {other: "the cache"}
    assert pop_cache(kwargs, spec.cache_arg) == "the cache" and not kwargs


def test_tolerance_follows_the_dtype():
    assert verify.TOLERANCE[torch.float32] < verify.TOLERANCE[torch.bfloat16]
    assert verify.tolerance(build("llama")) == verify.TOLERANCE[torch.float32]
