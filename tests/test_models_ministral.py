"""Ministral, the worked example of docs/extending.md ("Adding an architecture"): its one registry entry
makes optimize() rewrite it (parity with stock on the cached decode path, as every architecture's
parity test checks) and `gemmtune shapes` derive the GEMMs the optimized model runs."""

from __future__ import annotations

import copy

import pytest

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from test_models_parity import _IDS, TINY, build_from, check_parity  # noqa: E402

import gemmtune  # noqa: E402
from gemmtune.capture import read_shapes  # noqa: E402
from gemmtune.cli.main import cli  # noqa: E402


def tiny_ministral():
    # one sliding-window layer and one full one: Ministral's attention passes a per-layer window
    return transformers.MinistralConfig(
        **TINY, **_IDS, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
    )


def test_ministral_optimize_keeps_parity_with_stock():
    stock = build_from(tiny_ministral())
    opt = copy.deepcopy(stock)
    report = gemmtune.optimize(opt)
    assert report.architecture == "ministral"
    # every rewrite Llama of the same sizes gets: fused q/k/v and gate/up, norms, layer and attention forwards
    llama = gemmtune.optimize(build_from(transformers.LlamaConfig(**TINY, **_IDS)))
    assert report.counts() == llama.counts(), report.summary()
    assert not report.skipped, report.summary()
    assert opt.model.layers[0].self_attn._gemmtune_attn.sliding_window == 6
    assert opt.model.layers[1].self_attn._gemmtune_attn.sliding_window is None
    check_parity(stock, opt)


def test_ministral_shapes_are_the_gemms_optimize_runs(tmp_path):
    stock = build_from(tiny_ministral())
    stock.config.to_json_file(tmp_path / "config.json")  # the config.json save_pretrained writes
    out = tmp_path / "shapes.csv"
    res = CliRunner().invoke(cli, ["shapes", "--model", str(tmp_path), "--nsets", "1,16", "-o", str(out)])
    assert res.exit_code == 0, res.output
    keys = [key for key, _ in read_shapes(str(out))]
    # by hand from the tiny sizes (hidden 64, 4 heads + 2 KV heads of 16, intermediate 128, vocab 256):
    # qkv (4 + 2 * 2) * 16, o, gate_up 2 * 128, down, lm_head
    assert sorted({(k.N, k.K) for k in keys}) == [(64, 64), (64, 128), (128, 64), (256, 64)]
    assert sorted(k.M for k in keys) == [1] * 4 + [16] * 4
    opt = copy.deepcopy(stock)
    gemmtune.optimize(opt)
    # the modules optimize() routes through gemmtune's GEMM (the fused ones included)
    routed = [(m.out_features, m.in_features) for m in opt.modules() if "_gemmtune_route" in m.__dict__]
    assert len(routed) == 2 * 4 + 1  # o, qkv, gate_up, down per layer, lm_head
    assert set(routed) == {(k.N, k.K) for k in keys}
