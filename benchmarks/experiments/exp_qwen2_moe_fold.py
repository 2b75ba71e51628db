"""Experiment: Qwen2-MoE's shared expert folded into the experts' fused_moe call, one layer's sizes (issue 29).

Times, at 1 and 8 tokens: the router's GEMM at N = 1, 60, 61 and 64 rows (cuBLAS through F.linear), and
one MoE block's work three ways: "separate" (router GEMM + top-k kernel + fused_moe over the 60 routed
experts, plus the dense shared expert: gate_up GEMM, act*mul, down GEMM, its sigmoid gate, the product and
the sum), "folded N=61" (one router GEMM with the gate's row appended, the top-k kernel writing the 4 shared
slots, one fused_moe over 64 experts) and "folded N=64 pad" (the same with the router rows padded to 64, as
models/moe_shared.py runs it); also the routed part and the shared part of "separate" alone. Random bf16
weights of Qwen1.5-MoE-A2.7B's sizes (H=2048, I=1408, E=60 top 4, shared 5632 = 4 x 1408), 16 rotating hidden
states (so the routings differ), each variant 20 calls in one CUDA graph, median of 20 replays, us per call.

    PYTHONPATH=src python benchmarks/experiments/exp_qwen2_moe_fold.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gemmtune
from gemmtune.kernels.activations import act_mul
from gemmtune.kernels.moe_route import router_topk

H, INTER, E, K, SHARED_I = 2048, 1408, 60, 4, 5632
C = SHARED_I // INTER  # the shared expert as C experts of the routed size
ROTATE = 16


def graph_time(fn, reps: int = 20, inner: int = 20) -> float:
    """us per call: `inner` calls captured in one CUDA graph, the median of `reps` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / inner)
    return sorted(times)[len(times) // 2]


class Block:
    """One layer's weights and a rotating set of hidden states at `tokens` tokens."""

    def __init__(self, tokens: int, dev: str = "cuda", dt: torch.dtype = torch.bfloat16):
        self.dt = dt
        self.w1 = torch.randn(E + C, 2 * INTER, H, device=dev, dtype=dt) * 0.02
        self.w2 = torch.randn(E + C, H, INTER, device=dev, dtype=dt) * 0.02
        self.gate_up = torch.randn(2 * SHARED_I, H, device=dev, dtype=dt) * 0.02
        self.down = torch.randn(H, SHARED_I, device=dev, dtype=dt) * 0.02
        self.router = torch.randn(E + 1, H, device=dev, dtype=dt) * 0.02  # the routed experts' rows, the gate's
        self.router_pad = torch.zeros(64, H, device=dev, dtype=dt)
        self.router_pad[: E + 1] = self.router
        self.shared_gate = self.router[E:].clone()
        self.xs = [torch.randn(tokens, H, device=dev, dtype=dt) for _ in range(ROTATE)]
        self.turn = 0

    def next_x(self) -> torch.Tensor:
        self.turn = (self.turn + 1) % ROTATE
        return self.xs[self.turn]

    def routed(self, x):
        w, ids = router_topk(F.linear(x, self.router[:E]), K, False, self.dt)
        return gemmtune.fused_moe(x, self.w1[:E], self.w2[:E], w, ids, "silu", check_ids=False)

    def shared(self, x):
        h = act_mul(F.linear(x, self.gate_up), "silu", impl="triton")
        return torch.sigmoid(F.linear(x, self.shared_gate)) * F.linear(h, self.down)

    def folded(self, x, router):
        w, ids = router_topk(F.linear(x, router)[:, : E + 1], K, False, self.dt, C)
        return gemmtune.fused_moe(x, self.w1, self.w2, w, ids, "silu", check_ids=False)

    def variants(self) -> dict:
        return {
            "separate": lambda: (lambda x: self.routed(x) + self.shared(x))(self.next_x()),
            "folded N=61": lambda: self.folded(self.next_x(), self.router),
            "folded N=64 pad": lambda: self.folded(self.next_x(), self.router_pad),
            "routed moe only": lambda: self.routed(self.next_x()),
            "shared dense only": lambda: self.shared(self.next_x()),
        }


def router_gemm_us(tokens: int, n: int) -> float:
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, H, device="cuda", dtype=torch.bfloat16)
    return graph_time(lambda: F.linear(x, w))


def main() -> None:
    torch.manual_seed(0)
    for tokens in (1, 8):
        for n in (1, 60, 61, 64):
            print(f"T={tokens} router linear N={n}: {router_gemm_us(tokens, n):.2f} us")
    for tokens in (1, 8):
        for name, run in Block(tokens).variants().items():
            print(f"T={tokens} {name}: {graph_time(run):.1f} us")


if __name__ == "__main__":
    main()
