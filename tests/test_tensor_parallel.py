"""optimize() on a tensor-parallel transformers model: two gloo ranks under torchrun
(tests/tp_worker.py), a tiny dense and a tiny MoE model loaded with DistributedConfig(tp_size=2)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers loads tensor-parallel only with accelerate installed

from gemmtune.models import tensor_parallel  # noqa: E402
from gemmtune.models.verify import Finding, Verdict, combine  # noqa: E402

WORKER = Path(__file__).with_name("tp_worker.py")
HEADER = "gfx,cu_num,M,N,K,bias,dtype,outdtype,scaleAB,bpreshuffle,libtype,solidx,splitK,us,kernelName\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny(kind: str, folder: Path) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)  # fmt: skip
    if kind == "dense":
        config = LlamaConfig(intermediate_size=128, **common)
    else:
        config = Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                head_dim=16, decoder_sparse_step=1, **common)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def run_ranks(tmp_path: Path, *args: str) -> list[dict]:
    out = tmp_path / "rank"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(WORKER), args[0], str(out), *args[1:]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEMMTUNE_CONFIG", None)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]


# Each case starts two processes that load a model twice: the slow tier (and CI's model legs, on the
# minimum and newest transformers) runs them; the default tier checks the planning rules in-process below.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_optimize_gives_stock_tp_greedy_tokens_on_every_rank(tmp_path, kind):
    ranks = run_ranks(tmp_path, save_tiny(kind, tmp_path / kind), kind)
    for r in ranks:
        assert len(r["stock"]) == 16
        assert r["opt"] == r["stock"], r["report"]
        assert r["restored"] == r["stock"]
        assert r["dtensors_back"] == r["dtensors_stock"] > 0  # restore() hands the DTensor shards back
        assert r["routed"] == r["derived"]  # the GEMMs run on the shapes `gemmtune shapes --tp 2` derives
        assert "cached-path check: 2/2 decoder layers agree" in r["report"]
    assert ranks[0]["changed"] == ranks[1]["changed"]
    changed = "\n".join(ranks[0]["changed"])
    assert "q/k/v -> qkv_proj N=64 (2 q heads, 1 kv heads)" in changed  # this rank's half of 4 q + 2 kv heads
    assert "route: model.layers.0.self_attn.o_proj: GEMM N=64 K=32" in changed
    if kind == "dense":
        assert "gate/up -> gate_up_proj N=128" in changed
    else:
        assert "experts -> gemmtune.fused_moe (E=4 I=16" in changed  # every expert, half its intermediate size


@pytest.mark.slow
def test_a_table_that_differs_on_one_rank_is_refused_on_every_rank(tmp_path):
    row = "cpu,2,{m},128,64,False,torch.float32,torch.float32,False,False,torch,0,0,5.0,native\n"
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(HEADER + row.format(m=16))
    b.write_text(HEADER + row.format(m=32))
    ranks = run_ranks(tmp_path, save_tiny("dense", tmp_path / "dense"), "tables", str(a), str(b))
    for r in ranks:
        assert r["error"] is not None
        assert "tuned tables differ across ranks" in r["error"]
        assert f"rank 0 ({a}) vs rank 1 ({b})" in r["error"]


def test_an_unfusable_plan_is_reported_and_left_stock():
    """A q/k/v whose plan is not plain colwise (here rowwise v) is not fused, and the fused forward
    that builds on it goes too; a norm under another style stays stock."""
    from gemmtune.models import dense
    from gemmtune.models.rewrite import Change

    sharding = tensor_parallel.Sharding(
        {"m.attn.q": "colwise", "m.attn.k": "colwise", "m.attn.v": "rowwise", "m.n": "colwise"},
        mesh=None, hooked={"m.attn.q", "m.attn.k", "m.attn.v", "m.n"},
    )  # fmt: skip
    fuse = Change(dense.QkvFusion(), "m.attn", {"names": ("q", "k", "v"), "fused": "qkv_proj"})
    why, change = tensor_parallel._why_not(None, sharding, fuse)
    assert change is None and "v 'rowwise'" in why
    attn = Change(dense.AttentionForward(), "m.attn", {})
    assert tensor_parallel._dependents([fuse, attn], [fuse]) == [attn]
    norm = Change(dense.Norms(), "m.n", {})
    why, _ = tensor_parallel._why_not(None, sharding, norm)
    assert "'colwise' on a norm" in why
    ok = Change(dense.QkvFusion(), "m.attn", {"names": ("q", "k"), "fused": "qk"})
    why, change = tensor_parallel._why_not(None, sharding, ok)
    assert why is None and change.local == ("q", "k")


def test_verdicts_are_decided_together():
    """A layer one rank finds wrong is put back on every rank."""
    tol = 1e-3
    rank0 = Verdict([], None, 0.0, layers=[Finding(0, 1, 1e-5), Finding(1, 0, 1e-5)], tol=tol)
    rank1 = Verdict([Finding(1, 2, 0.5)], None, 0.5, layers=[Finding(0, 0, 1e-6), Finding(1, 2, 0.5)], tol=tol)
    both = combine([rank0, rank1])
    assert [(f.index, f.call, f.error) for f in both.bad] == [(1, 2, 0.5)]
    assert both.worst_layer == 0.5 and both.logits is None
    assert tensor_parallel.decide_together(rank0, None) is rank0  # not tensor parallel: this rank's own


MODELS = Path(__file__).with_name("data") / "models"


@pytest.mark.slow
def test_bench_model_tp_checks_parity_on_every_rank_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "gemmtune", "bench-model", "--tp", "2", "--model",
           str(MODELS / "tiny-llama.json"), "--layers", "2", "--reps", "1", "--batches", "1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEMMTUNE_CONFIG", None)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    for rank in range(2):
        assert f"decode parity rank {rank} (16 greedy cached steps, batch 2): same tokens as stock" in res.stdout
    assert "q/k/v -> qkv_proj N=64" in res.stdout  # this rank's half of (4 + 2 + 2) heads of 16
    assert "decode b=1 (eager" in res.stdout and "speedup" in res.stdout


def test_bench_model_tp_outside_torchrun_says_how_to_launch_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    from click.testing import CliRunner

    from gemmtune.cli.main import cli

    res = CliRunner().invoke(cli, ["bench-model", "--tp", "2", "--model", str(MODELS / "tiny-llama.json")])
    assert res.exit_code == 1
    assert "bench-model --tp 2 runs under torchrun: torchrun --nproc-per-node 2 -m gemmtune" in res.output
