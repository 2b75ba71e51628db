"""`gemmtune bench-model --tp N` under torchrun: stock tensor-parallel transformers vs optimize() of it.

Rank 0 builds the model with random weights and saves it to a temporary folder; every rank loads it
twice with DistributedConfig(tp_size=N) (stock and optimized: a deep copy would share transformers'
forward wrappers with the original). Greedy decode parity over `decode_steps` cached steps is checked
on every rank and gathered; decode speed (eager, a DynamicCache grown from a short prefill) is timed
interleaved on all ranks and printed by rank 0.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from ..errors import GemmtuneError

PROMPT = 8  # prefill tokens before the decode steps


class TPBenchError(GemmtuneError, ValueError):
    """bench-model --tp cannot run (not under torchrun, or the world size is not --tp)."""


@dataclass(frozen=True)
class TPSettings:
    model: str
    layers: int
    tp: int
    device: str
    dtype: torch.dtype | None = None
    table: str | list | None = None
    batches: tuple[int, ...] = (1, 4)
    decode_steps: int = 16
    reps: int = 5
    seed: int = 0


def greedy(model, ids: torch.Tensor, steps: int) -> list[list[int]]:
    """Each row's greedy tokens over `steps` cached decode steps after a prefill of `ids`."""
    out = model(input_ids=ids, use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt[:, 0].tolist())
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return [list(row) for row in zip(*tokens)]


def _decode_ms(model, batch: int, steps: int, vocab: int, seed: int) -> float:
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(seed)).to(_device(model))
    out = model(input_ids=ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(model)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    _sync(model)
    return (time.perf_counter() - t0) * 1e3 / steps


def _device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _sync(model) -> None:
    if _device(model).type == "cuda":
        torch.cuda.synchronize()


def _launched(tp: int) -> tuple[int, int]:
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        raise TPBenchError(f"bench-model --tp {tp} runs under torchrun: torchrun --nproc-per-node {tp} -m gemmtune "
                           f"bench-model --tp {tp} ...")  # fmt: skip
    world = int(os.environ["WORLD_SIZE"])
    if world != tp:
        raise TPBenchError(f"bench-model --tp {tp}: torchrun started {world} processes, expected {tp}")
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])


def run(s: TPSettings, echo=print) -> bool:
    """Run on every rank; returns whether decode parity held on every rank."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from ..models import optimize
    from .build import build_model

    rank, local = _launched(s.tp)
    cuda = s.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    folder = [None]
    if rank == 0:
        net, desc = build_model(s.model, s.layers, "cpu", s.dtype or (torch.bfloat16 if cuda else torch.float32),
                                s.seed)  # fmt: skip
        folder[0] = tempfile.mkdtemp(prefix="gemmtune-bench-tp-")
        net.save_pretrained(folder[0])
        echo(f"model: {desc}; tensor parallel over {s.tp} ranks ({'nccl' if cuda else 'gloo'})")
        del net
    dist.broadcast_object_list(folder, src=0)
    try:

        def load():
            m = AutoModelForCausalLM.from_pretrained(folder[0], distributed_config=DistributedConfig(tp_size=s.tp))
            return m.eval()

        stock, opt = load(), load()
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
    report = optimize(opt, config=s.table)
    if rank == 0:
        echo(str(report))
    vocab = stock.config.vocab_size
    ids = torch.randint(0, vocab, (2, PROMPT), generator=torch.Generator().manual_seed(s.seed)).to(_device(stock))
    with torch.no_grad():
        want, got = greedy(stock, ids, s.decode_steps), greedy(opt, ids, s.decode_steps)
    verdicts: list = [None] * s.tp
    dist.all_gather_object(verdicts, want == got)
    if rank == 0:
        for r, ok in enumerate(verdicts):
            echo(f"decode parity rank {r} ({s.decode_steps} greedy cached steps, batch 2): "
                 f"{'same tokens as stock' if ok else 'PARITY FAIL: tokens differ from stock'}")  # fmt: skip
    if not all(verdicts):
        return False
    steps = 16 if cuda else 4
    for b in s.batches:
        times: dict[str, list[float]] = {"stock": [], "optimize": []}
        with torch.no_grad():
            for _ in range(s.reps):  # interleaved: a slow moment of the machine hits both
                for name, m in (("stock", stock), ("optimize", opt)):
                    times[name].append(_decode_ms(m, b, steps, vocab, s.seed))
        if rank == 0:
            ms = {n: statistics.median(t) for n, t in times.items()}
            echo(f"decode b={b} (eager, {steps} steps, median of {s.reps}): stock {ms['stock']:.3f} ms, "
                 f"optimize {ms['optimize']:.3f} ms, speedup {ms['stock'] / ms['optimize']:.2f}x")  # fmt: skip
    return True
