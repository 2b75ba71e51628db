"""One rank of tests/test_tensor_parallel.py, started by torchrun: loads the tiny model saved at argv[1]
tensor-parallel twice (stock and optimize()), and writes what it saw to argv[2].<rank> as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def load(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=2),
                                                 dtype=torch.float32)  # fmt: skip
    return model.eval()


def greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """Greedy tokens of `steps` cached decode steps after a prefill of `ids`."""
    out = model(input_ids=ids, use_cache=True)
    cache, tokens = out.past_key_values, []
    for _ in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(nxt[0, 0]))
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
    return tokens


def main() -> None:
    path, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    rank = int(os.environ["RANK"])
    if mode == "tables":  # each rank its own table in effect (argv[4 + rank])
        os.environ["GEMMTUNE_CONFIG"] = sys.argv[4 + rank]
    import gemmtune
    from gemmtune.errors import ConfigError
    from gemmtune.tuner.model_shapes import model_gemms

    result: dict = {"rank": rank}
    stock = load(path)
    if mode == "tables":  # the tables differ across ranks: optimize() must refuse on every rank
        try:
            gemmtune.optimize(stock)
            result["error"] = None
        except ConfigError as exc:
            result["error"] = str(exc)
    else:
        ids = torch.randint(0, stock.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            result["stock"] = greedy(stock, ids, 16)
            opt = load(path)
            report = gemmtune.optimize(opt)
            result["report"] = str(report)
            result["changed"] = report.changed
            result["opt"] = greedy(opt, ids, 16)
            local = [m.weight.to_local() if hasattr(m.weight, "to_local") else m.weight
                     for m in opt.modules() if "_gemmtune_route" in m.__dict__]  # fmt: skip
            routed = {tuple(w.shape) for w in local}
            result["routed"] = sorted(map(list, routed))
            cfg = json.load(open(os.path.join(path, "config.json")))
            plain = [s for s in model_gemms(cfg, 2) if not s.experts and s.name != "router"]  # left to the block
            result["derived"] = sorted({(s.N, s.K) for s in plain})
            gemmtune.restore(opt)
            result["restored"] = greedy(opt, ids, 16)
            result["dtensors_back"] = sum(type(p).__name__ == "DTensor" for p in opt.parameters())
            result["dtensors_stock"] = sum(type(p).__name__ == "DTensor" for p in stock.parameters())
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(result, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
