"""optimize() / restore() against hostile use: training mode and optimizers, pickling an optimized model,
restore after the module tree changed; and capture's exit status for a child killed by a signal."""

from __future__ import annotations

import copy
import io
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_models_moe_families import build as build_family  # noqa: E402
from test_models_moe_families import moe_blocks  # noqa: E402
from test_models_moe_shared import router_reference  # noqa: E402, F401 (a fixture: the top-k kernel's reference)
from test_models_parity import batch, build  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.cli.capture_cmd import shell_exit_status  # noqa: E402
from gemmtune.models.linear import FusedLinear  # noqa: E402


def logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False).logits


def gemmtune_marks(model) -> list[str]:
    return [
        f"{p}.{k}" for p, m in model.named_modules() for k in m.__dict__ if k.startswith("_gemmtune") or k == "forward"
    ]


def one_sgd_step(model, opt, ids, mask):
    loss = model(ids, attention_mask=mask, use_cache=False).logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


# ---- training mode and optimizers -----------------------------------------------------------------
def test_training_mode_with_fusion_is_refused_and_the_model_untouched():
    model = build("llama").train()
    params = [(n, id(p)) for n, p in model.named_parameters()]
    with pytest.raises(ValueError) as exc:
        gemmtune.optimize(model)
    msg = str(exc.value)
    assert "\n" not in msg and "model.training is True" in msg and "model.eval()" in msg
    assert "fusing gate/up, fusing q/k/v" in msg and "fuse_gate_up=False, fuse_qkv=False" in msg
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert gemmtune_marks(model) == [] and gemmtune.models.report_of(model) is None


def test_training_mode_names_only_the_fusion_it_would_do():
    model = build("llama").train()
    with pytest.raises(ValueError, match=r"and fusing q/k/v makes new weight tensors.*pass fuse_qkv=False$"):
        gemmtune.optimize(model, fuse_gate_up=False)


def test_training_mode_with_quantize_names_quantize():
    model = build("llama").train()
    with pytest.raises(ValueError, match=r"quantize='int8' makes new weight tensors.*pass quantize=None$"):
        gemmtune.optimize(model, fuse_qkv=False, fuse_gate_up=False, quantize="int8")


@pytest.mark.usefixtures("router_reference")
def test_training_mode_moe_fold_names_fused_ops():
    model = build_family("qwen2-moe").train()
    with pytest.raises(ValueError, match="folding shared experts into the experts.*fused_ops=False"):
        gemmtune.optimize(model, fuse_qkv=False, fuse_gate_up=False)


def test_training_mode_without_new_weights_keeps_an_earlier_optimizer_training():
    model = build("llama").train()
    ids, mask = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    params = {id(p) for p in model.parameters()}
    report = gemmtune.optimize(model, fuse_qkv=False, fuse_gate_up=False)
    assert "training mode" in " ".join(report.notes)
    assert {id(p) for p in model.parameters()} == params  # the optimizer's Parameters are the model's
    model.eval()
    before = logits(model, ids, mask)
    model.train()
    one_sgd_step(model, opt, ids, mask)
    model.eval()
    assert not torch.allclose(logits(model, ids, mask), before)


def test_eval_mode_with_an_optimizer_holding_the_weights_is_refused_until_it_is_gone():
    model = build("llama")  # eval mode, as from_pretrained gives
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = [(n, id(p)) for n, p in model.named_parameters()]
    with pytest.raises(ValueError) as exc:
        gemmtune.optimize(model)
    msg = str(exc.value)
    assert "\n" not in msg and "an optimizer holds the model's parameters (" in msg
    assert "make optimizers after optimize()" in msg and "fuse_gate_up=False, fuse_qkv=False" in msg
    assert [(n, id(p)) for n, p in model.named_parameters()] == params and gemmtune.models.report_of(model) is None
    assert gemmtune.optimize(model, fuse_qkv=False, fuse_gate_up=False).changed  # no new tensors: allowed
    gemmtune.restore(model)
    del opt
    gemmtune.optimize(model)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedLinear)


def test_an_optimizer_made_after_optimize_trains_the_fused_weights():
    model = build("llama")
    ids, mask = batch()
    gemmtune.optimize(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, FusedLinear) and any(p is qkv.weight for p in model.parameters())
    w0, before = qkv.weight.detach().clone(), logits(model, ids, mask)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    one_sgd_step(model, opt, ids, mask)
    assert not torch.equal(qkv.weight.detach(), w0)
    assert not torch.allclose(logits(model, ids, mask), before)


def test_state_dict_after_optimize_has_stock_keys_for_moe():
    stock = build("mixtral")
    model = copy.deepcopy(stock)
    gemmtune.optimize(model)
    sd, sd0 = model.state_dict(), stock.state_dict()
    assert sorted(sd) == sorted(sd0)
    assert all(torch.equal(sd[k], sd0[k]) for k in sd0)


# ---- pickling -------------------------------------------------------------------------------------
def round_trip(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral", "qwen3_moe"])
def test_an_optimized_model_pickles_and_restores_after_loading(arch):
    stock = build(arch)
    model = copy.deepcopy(stock)
    ids, mask = batch()
    gemmtune.optimize(model)
    loaded = round_trip(model)
    torch.testing.assert_close(logits(loaded, ids, mask), logits(model, ids, mask), rtol=0, atol=0)
    report = gemmtune.models.report_of(loaded)
    assert report is not None and report._model is loaded and report.summary() == model._gemmtune_report.summary()
    gemmtune.restore(loaded)
    assert gemmtune_marks(loaded) == []
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in stock.named_parameters()]
    torch.testing.assert_close(logits(loaded, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedLinear)  # the original stays optimized


@pytest.mark.usefixtures("router_reference")
def test_a_folded_moe_model_pickles():
    model = build_family("qwen2-moe")
    gemmtune.optimize(model)
    assert model._gemmtune_report.counts().get("moe_fold") == 1
    loaded = round_trip(model)
    (block,) = moe_blocks(loaded)
    assert block.experts.gate_up_proj.data_ptr() == block._gemmtune_moe_fold.w1.data_ptr()  # still views
    ids = torch.randint(3, 100, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_quantized_model_pickles_and_its_undo_acts_on_the_copy():
    model = build("llama")
    ids, mask = batch()
    gemmtune.optimize(model, quantize="int8")
    loaded = round_trip(model)
    torch.testing.assert_close(logits(loaded, ids, mask), logits(model, ids, mask), rtol=0, atol=0)
    gemmtune.restore(loaded)
    assert gemmtune_marks(loaded) == []
    assert any(m.endswith("._gemmtune_quant") for m in gemmtune_marks(model))  # the original stays quantized


@pytest.mark.slow
def test_a_saved_model_loads_in_a_fresh_process(tmp_path):
    model = build("llama")
    ids, mask = batch()
    gemmtune.optimize(model)
    assert model.config._attn_implementation.startswith("gemmtune_")
    path = tmp_path / "model.pt"
    torch.save({"model": model, "ids": ids, "mask": mask, "want": logits(model, ids, mask)}, path)
    script = (
        "import sys, torch\n"
        "d = torch.load(sys.argv[1], weights_only=False)\n"
        "with torch.no_grad():\n"
        "    got = d['model'](d['ids'], attention_mask=d['mask'], use_cache=False).logits\n"
        "torch.testing.assert_close(got, d['want'], rtol=0, atol=0)\n"
        "print('ok', d['model'].config._attn_implementation)\n"
    )
    res = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == f"ok {model.config._attn_implementation}"


# ---- restore after the module tree changed --------------------------------------------------------
def restore_warning(model) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gemmtune.restore(model)
    msgs = [str(w.message) for w in caught if "gemmtune.restore" in str(w.message)]
    assert len(msgs) == 1, [str(w.message) for w in caught]
    return msgs[0]


def assert_stock_layer(layer):
    attn, mlp = layer.self_attn, layer.mlp
    assert type(attn.q_proj) is nn.Linear and attn.q_proj.weight is not None and "qkv_proj" not in attn._modules
    assert type(mlp.gate_proj) is nn.Linear and "gate_up_proj" not in mlp._modules
    assert not [k for m in layer.modules() for k in m.__dict__ if k.startswith("_gemmtune") or k == "forward"]


def test_restore_after_deleting_the_last_layer():
    model = build("llama")
    gemmtune.optimize(model)
    del model.model.layers[1]
    msg = restore_warning(model)
    assert "not restored: model.layers.1: no longer in the model" in msg and "\n" not in msg
    assert_stock_layer(model.model.layers[0])
    assert gemmtune_marks(model) == [] and gemmtune.models.report_of(model) is None


def test_restore_after_deleting_the_first_layer():
    model = build("llama")
    gemmtune.optimize(model)
    kept = model.model.layers[1]
    del model.model.layers[0]  # the other layer moves to index 0
    assert "model.layers.1: no longer in the model" in restore_warning(model)
    assert_stock_layer(kept)
    assert gemmtune_marks(model) == []


def test_restore_after_replacing_a_layer_by_identity():
    model = build("llama")
    gemmtune.optimize(model)
    model.model.layers[1] = nn.Identity()
    msg = restore_warning(model)
    assert "model.layers.1.self_attn: no longer in the model" in msg
    assert "model.layers.1.mlp: no longer in the model" in msg
    assert_stock_layer(model.model.layers[0])


def test_restore_after_replacing_an_mlp():
    stock = build("llama")
    model = copy.deepcopy(stock)
    ids, mask = batch()
    gemmtune.optimize(model)
    fresh = copy.deepcopy(stock.model.layers[0].mlp)
    model.model.layers[0].mlp = fresh
    msg = restore_warning(model)
    assert "model.layers.0.mlp: gate_up_proj is not fused here (the module was replaced after optimize())" in msg
    assert model.model.layers[0].mlp is fresh and "forward" not in fresh.__dict__
    assert_stock_layer(model.model.layers[1])
    assert gemmtune_marks(model) == []
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)


def test_restore_after_replacing_the_fused_linear():
    model = build("llama")
    gemmtune.optimize(model)
    attn = model.model.layers[0].self_attn
    mine = nn.Linear(attn.qkv_proj.in_features, attn.qkv_proj.out_features, bias=False)
    attn.qkv_proj = mine
    msg = restore_warning(model)
    assert (
        "model.layers.0.self_attn: qkv_proj was replaced after optimize(): q_proj, k_proj, v_proj not put back" in msg
    )
    assert attn.qkv_proj is mine and "_gemmtune_fused" not in attn.__dict__
    assert "model.layers.0.self_attn.qkv_proj.weight" in model.state_dict()  # no hook splits the user's Linear
    assert_stock_layer(model.model.layers[1])


def test_restore_after_replacing_a_routed_linear_needs_no_warning():
    stock = build("llama")
    model = copy.deepcopy(stock)
    ids, mask = batch()
    gemmtune.optimize(model)
    mine = copy.deepcopy(stock.model.layers[0].mlp.down_proj)
    model.model.layers[0].mlp.down_proj = mine
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemmtune.restore(model)
    assert model.model.layers[0].mlp.down_proj is mine and gemmtune_marks(model) == []
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)


def test_optimize_twice_then_restore_once():
    stock = build("llama")
    model = copy.deepcopy(stock)
    ids, mask = batch()
    assert gemmtune.optimize(model) is gemmtune.optimize(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemmtune.restore(model)
    assert gemmtune_marks(model) == []
    torch.testing.assert_close(logits(model, ids, mask), logits(stock, ids, mask), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="not optimized"):
        gemmtune.restore(model)


# ---- capture's exit status ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "child, want",
    [
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + signal.SIGKILL),
        pytest.param(
            "import os, signal; os.kill(os.getpid(), signal.SIGTERM)", 128 + signal.SIGTERM, marks=pytest.mark.slow
        ),
        ("raise SystemExit(5)", 5),
        pytest.param("pass", 0, marks=pytest.mark.slow),
    ],
    ids=["sigkill", "sigterm", "code5", "code0"],
)
def test_capture_exits_as_a_shell_reports_the_child(tmp_path, child, want):
    cmd = [sys.executable, "-m", "gemmtune.cli.main", "capture", "-o", str(tmp_path / "x.csv"), "--",
           sys.executable, "-c", child]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == want, res.stderr
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{child}"; exit $?'], timeout=300)
    assert shell.returncode == want  # the status a shell gives the same child


@pytest.mark.parametrize(
    "what, want",
    [
        ("missing", 127),
        *(pytest.param(*c, marks=pytest.mark.slow) for c in [("not executable", 126), ("a folder", 126)]),
    ],
)
def test_capture_of_a_command_that_cannot_start_exits_as_a_shell_does(tmp_path, what, want):
    script = tmp_path / "job.sh"
    script.write_text(f"echo ran > {tmp_path / 'RAN'}\n")
    script.chmod(0o644)
    name = {"missing": str(tmp_path / "no-such-command"), "not executable": str(script), "a folder": str(tmp_path)}
    cmd = [sys.executable, "-m", "gemmtune.cli.main", "capture", "-o", str(tmp_path / "x.csv"), "--", name[what]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("Error:")]
    assert res.returncode == want and len(errors) == 1 and name[what] in errors[0], res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "x.csv").exists() and not (tmp_path / "RAN").exists()
    shell = subprocess.run(["sh", "-c", f'"{name[what]}"; exit $?'], capture_output=True, timeout=300)
    assert shell.returncode == want  # the status a shell gives the same command


@pytest.mark.parametrize("code, want", [(-9, 137), (-15, 143), (-2, 130), (0, 0), (1, 1), (255, 255)])
def test_shell_exit_status(code, want):
    assert shell_exit_status(code) == want
