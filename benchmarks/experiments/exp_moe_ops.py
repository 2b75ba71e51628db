"""Host work of one MoE block forward (router + experts) after optimize(): aten ops and Triton launches.

Counts, not times: deterministic, so it runs anywhere. On CPU run it with TRITON_INTERPRET=1 (the
Triton glue then runs in the interpreter; the ops the interpreter itself issues are not counted).

    TRITON_INTERPRET=1 python benchmarks/experiments/exp_moe_ops.py                # tiny Qwen3-MoE, CPU fp32
    python benchmarks/experiments/exp_moe_ops.py --device cuda --dtype bfloat16    # on a GPU
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gemmtune

_VIEWS = {"view", "_unsafe_view", "reshape", "transpose", "t", "unsqueeze", "squeeze", "slice", "select", "expand",
          "as_strided", "alias", "permute", "detach", "split", "chunk", "unbind"}  # fmt: skip
_NO_KERNEL = _VIEWS | {"empty", "empty_like", "empty_strided", "scalar_tensor"}  # host-side only


class OpCounter(TorchDispatchMode):
    """Counts aten ops; paused while a Triton kernel launches (the interpreter's own ops)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def launching(self) -> int:
        """Ops that launch device work (not views, allocations or host scalars)."""
        return sum(n for op, n in self.ops.items() if op not in _NO_KERNEL)


@contextlib.contextmanager
def count_triton(counter: OpCounter):
    """Patch the Triton launch entry points (JIT and interpreter) to count launches."""
    from triton.runtime import jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:
        pass
    launches: collections.Counter = collections.Counter()
    saved = [(cls, cls.run) for cls in classes]

    def wrap(orig):
        def run(self, *args, **kwargs):
            launches[getattr(self, "__name__", None) or getattr(self.fn, "__name__", "?")] += 1
            counter.paused += 1
            try:
                return orig(self, *args, **kwargs)
            finally:
                counter.paused -= 1

        return run

    for cls, orig in saved:
        cls.run = wrap(orig)
    try:
        yield launches
    finally:
        for cls, orig in saved:
            cls.run = orig


def tiny_block(device: str, dtype: torch.dtype, experts: int, topk: int, hidden: int, inter: int):
    import transformers

    cfg = transformers.Qwen3MoeConfig(hidden_size=hidden, intermediate_size=2 * inter, moe_intermediate_size=inter,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                      num_experts=experts, num_experts_per_tok=topk, vocab_size=64,
                                      norm_topk_prob=True)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def count_block(block, x) -> tuple[OpCounter, collections.Counter]:
    with torch.no_grad():
        block(x)  # warm: dispatch, compile
        counter = OpCounter()
        with count_triton(counter) as launches, counter:
            block(x)
    return counter, launches


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--inter", type=int, default=32)
    ap.add_argument("--config", default=None, help="a tuned fmoe table to set_config() first")
    a = ap.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    model = tiny_block(a.device, dtype, a.experts, a.topk, a.hidden, a.inter)
    report = gemmtune.optimize(model)
    if a.config:
        gemmtune.set_config(a.config)
    print(report.summary() if hasattr(report, "summary") else report)
    block = model.model.layers[0].mlp
    x = torch.randn(1, a.tokens, a.hidden, device=a.device, dtype=dtype)
    counter, launches = count_block(block, x)
    print(f"aten ops {sum(counter.ops.values())} (launching {counter.launching()}), "
          f"triton launches {sum(launches.values())}")  # fmt: skip
    print("  aten:", dict(sorted(counter.ops.items(), key=lambda kv: -kv[1])))
    print("  triton:", dict(launches))


if __name__ == "__main__":
    main()
