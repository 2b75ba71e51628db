"""Experiment: both fused_moe stages and the combine in ONE launch at fine-grained decode (issue 29).

At T <= 4 the direct pair is three launches (stage 1, stage 2, the combine), each ~3-4 us above its bytes in a
CUDA graph (results/h100/fused_moe_op/grid_default.md), which keeps E=128 I=384 top 8 at 53% / 77% of its read
roof at T = 1 / 4. This prototype (not a product path) asks how far one launch goes:

- programs [0, P1) are stage 1: (slot, I tile) of act(gate) * up, a GEMV over H on the CUDA cores, the
  intermediate row stored in the model dtype, then the slot's ready counter counted up;
- programs [P1, P1 + P2) are stage 2: (slot, H tile). Each first touches its w2 tile (volatile loads: into L2
  while stage 1 runs), then waits for its slot's counter, reads the intermediate row and streams the tile
  from L2, and stores its routing-weighted rows (fp32) in a staging buffer; the last of a token's top-k slots
  to arrive on a (token, H tile) sums them in slot order (deterministic) into the output;
- the last program of the grid re-arms every counter (zero between calls: CUDA-graph replays).

Programs are dispatched in order, so every stage-1 program starts before any stage-2 program can wait on it;
under Triton's interpreter they run one after another in that order.

Checks it against kernels/fused_moe.fused_moe_ref (fp32) on odd sizes (the interpreter on the CPU), then on
a GPU times it against fused_moe's untuned default (CUDA graphs over rotating routings, interleaved,
gemmtune.tuner.timing.time_graphs) with each point's read roof (experts hit + activations at the measured
read bandwidth):

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/experiments/exp_moe_one_launch.py --check
    PYTHONPATH=src python benchmarks/experiments/exp_moe_one_launch.py
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from gemmtune.families import fmoe
from gemmtune.kernels import fused_moe as kmoe


@triton.jit
def _one_launch_moe(x_ptr, w1_ptr, w2_ptr, tw_ptr, ids_ptr, inter_ptr, stage_ptr, out_ptr, ready_ptr, done_ptr,
                    finished_ptr, part_ptr, lock1_ptr, H, INTER, TOPK, S, NT1, NT2, P1, P_ALL, BN1: tl.constexpr,
                    BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr, PREFETCH: tl.constexpr,
                    SPLIT: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    dt = out_ptr.dtype.element_ty
    if pid < P1:
        tile = pid // SPLIT  # (slot, I tile); its SPLIT programs each take a run of H
        ks = pid % SPLIT
        s = tile // NT1
        n = tile % NT1
        t = s // TOPK
        e = tl.load(ids_ptr + s).to(tl.int64)
        rows = n * BN1 + tl.arange(0, BN1)
        row_ok = rows < INTER
        gate = tl.zeros((BN1,), tl.float32)
        up = tl.zeros((BN1,), tl.float32)
        base = w1_ptr + e * 2 * INTER * H
        per = tl.cdiv(tl.cdiv(H, BK1), SPLIT) * BK1
        for k0 in range(ks * per, tl.minimum(H, ks * per + per), BK1):
            k = k0 + tl.arange(0, BK1)
            k_ok = k < H
            xk = tl.load(x_ptr + t * H + k, mask=k_ok, other=0.0).to(tl.float32)
            m = row_ok[:, None] & k_ok[None, :]
            wg = tl.load(base + rows[:, None] * H + k[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(base + (INTER + rows[:, None]) * H + k[None, :], mask=m, other=0.0).to(tl.float32)
            gate += tl.sum(wg * xk[None, :], axis=1)
            up += tl.sum(wu * xk[None, :], axis=1)
        j = tl.arange(0, BN1)
        if SPLIT > 1:  # partial sums in L2; the last split of the tile adds them up in split order
            prow = part_ptr + (tile * SPLIT + ks).to(tl.int64) * 2 * BN1
            tl.store(prow + j, gate, cache_modifier=".cg")
            tl.store(prow + BN1 + j, up, cache_modifier=".cg")
            tl.debug_barrier()
            arrived = tl.atomic_add(lock1_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                gate = tl.zeros((BN1,), tl.float32)
                up = tl.zeros((BN1,), tl.float32)
                for i in range(0, SPLIT):
                    pi = part_ptr + (tile * SPLIT + i).to(tl.int64) * 2 * BN1
                    gate += tl.load(pi + j, cache_modifier=".cg")
                    up += tl.load(pi + BN1 + j, cache_modifier=".cg")
                h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
                tl.store(inter_ptr + s * INTER + rows, h.to(dt), mask=row_ok)
                tl.atomic_xchg(lock1_ptr + tile, 0, sem="relaxed", scope="gpu")
                tl.debug_barrier()  # the row is stored before one thread counts it in
                tl.atomic_add(ready_ptr + s, 1, sem="release", scope="gpu")
        else:
            h = gate / (1.0 + tl.exp(-gate)) * up  # silu(gate) * up
            tl.store(inter_ptr + s * INTER + rows, h.to(dt), mask=row_ok)
            tl.debug_barrier()  # the row is stored before one thread counts it in
            tl.atomic_add(ready_ptr + s, 1, sem="release", scope="gpu")
    else:
        q = pid - P1
        s = q // NT2
        m2 = q % NT2
        t = s // TOPK
        e = tl.load(ids_ptr + s).to(tl.int64)
        cols = m2 * BN2 + tl.arange(0, BN2)  # rows of w2 (H)
        col_ok = cols < H
        base = w2_ptr + e * H * INTER
        if PREFETCH:
            for k0 in range(0, INTER, BK2):
                k = k0 + tl.arange(0, BK2)
                tl.load(base + cols[:, None] * INTER + k[None, :], mask=col_ok[:, None] & (k[None, :] < INTER),
                        volatile=True)  # fmt: skip
        seen = tl.atomic_add(ready_ptr + s, 0, sem="acquire", scope="gpu")
        while seen < NT1:
            seen = tl.atomic_add(ready_ptr + s, 0, sem="acquire", scope="gpu")
        acc = tl.zeros((BN2,), tl.float32)
        for k0 in range(0, INTER, BK2):
            k = k0 + tl.arange(0, BK2)
            k_ok = k < INTER
            hk = tl.load(inter_ptr + s * INTER + k, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            w = tl.load(base + cols[:, None] * INTER + k[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.sum(w * hk[None, :], axis=1)
        acc = acc * tl.load(tw_ptr + s).to(tl.float32)
        tl.store(stage_ptr + s * H + cols, acc, mask=col_ok, cache_modifier=".cg")
        tl.debug_barrier()
        arrived = tl.atomic_add(done_ptr + t * NT2 + m2, 1, sem="acq_rel", scope="gpu")
        if arrived == TOPK - 1:  # the token's last slot on this tile: the combine, in slot order
            total = tl.zeros((BN2,), tl.float32)
            for j in range(0, TOPK):
                total += tl.load(stage_ptr + (t * TOPK + j) * H + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + t * H + cols, total.to(dt), mask=col_ok)
            tl.atomic_xchg(done_ptr + t * NT2 + m2, 0, sem="relaxed", scope="gpu")
    last = tl.atomic_add(finished_ptr, 1, sem="acq_rel", scope="gpu")
    if last == P_ALL - 1:  # every program is past its waits: re-arm the slots' counters
        for i in range(0, S):
            tl.atomic_xchg(ready_ptr + i, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(finished_ptr, 0, sem="relaxed", scope="gpu")


class OneLaunch:
    """fused_moe (gated SiLU, no expert map) for one key's shapes, in one launch; counters kept zero between calls."""

    def __init__(self, T: int, H: int, inter: int, topk: int, device, dtype, bn1=32, bk1=128, bn2=64, bk2=128,
                 prefetch=True, split=1):  # fmt: skip
        self.T, self.H, self.I, self.topk = T, H, inter, topk
        S = T * topk
        self.S, self.nt1, self.nt2 = S, triton.cdiv(inter, bn1), triton.cdiv(H, bn2)
        self.p1 = S * self.nt1 * split
        self.p_all = self.p1 + S * self.nt2
        self.cfg = dict(BN1=bn1, BK1=bk1, BN2=bn2, BK2=bk2, PREFETCH=prefetch, SPLIT=split)
        self.part = torch.empty(S * self.nt1 * split * 2 * bn1, device=device, dtype=torch.float32)
        self.lock1 = torch.zeros(S * self.nt1, device=device, dtype=torch.int32)
        self.inter = torch.empty(S, inter, device=device, dtype=dtype)
        self.stage = torch.empty(S, H, device=device, dtype=torch.float32)
        self.ready = torch.zeros(S, device=device, dtype=torch.int32)
        self.done = torch.zeros(T * self.nt2, device=device, dtype=torch.int32)
        self.finished = torch.zeros(1, device=device, dtype=torch.int32)

    def __call__(self, x, w1, w2, topk_w, topk_ids, expert_map=None):
        out = torch.empty(self.T, self.H, device=x.device, dtype=x.dtype)
        ids = topk_ids.reshape(-1).contiguous()
        tw = topk_w.reshape(-1).contiguous()
        _one_launch_moe[(self.p_all,)](x, w1, w2, tw, ids, self.inter, self.stage, out, self.ready, self.done,
                                       self.finished, self.part, self.lock1, self.H, self.I, self.topk, self.S,
                                       self.nt1, self.nt2, self.p1, self.p_all, num_warps=4, **self.cfg)  # fmt: skip
        return out


def check(device: str) -> bool:
    ok = True
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for T, H, inter, E, topk in ((1, 40, 24, 6, 2), (3, 72, 40, 8, 3), (2, 64, 32, 5, 5)):
        g = torch.Generator().manual_seed(T * 1000 + H)
        x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
        w1 = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
        w2 = (torch.randn(E, H, inter, generator=g) / inter**0.5).to(device=device, dtype=dtype)
        w, ids = fmoe.route(torch.randn(T, E, generator=g).to(device), topk)
        ref = kmoe.fused_moe_ref(x.float(), w1.float(), w2.float(), w, ids)
        for split in (1, 3):
            run = OneLaunch(T, H, inter, topk, device, dtype, bn1=16, bk1=16, bn2=16, bk2=16, split=split)
            for call in range(2):  # the second call on the counters the first re-armed
                y = run(x, w1, w2, w, ids).float()
                err = ((y - ref).norm() / ref.norm()).item()
                good = err < (1e-5 if dtype == torch.float32 else 1.6e-2)
                armed = not (run.ready.any() or run.done.any() or run.finished.any() or run.lock1.any())
                print(
                    f"T={T} H={H} I={inter} E={E} top{topk} split {split} call {call}: rel err {err:.2e}, "
                    f"counters re-armed {armed}"
                )
                ok &= good and armed
    return ok


def bench() -> None:
    from gemmtune import backends
    from gemmtune.tuner.timing import measure_ceilings, time_graphs

    dev, dt = torch.device("cuda"), torch.bfloat16
    read_bw = measure_ceilings(dev).read_bw
    print(f"read bandwidth {read_bw / 1e12:.2f} TB/s")
    for H, inter, E, topk in ((2048, 384, 128, 8), (7168, 256, 256, 8)):
        for T in (1, 2, 4):
            key = fmoe.MoeKey(T, H, inter, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
            g = torch.Generator(device=dev).manual_seed(T * 7 + E)
            w1 = (torch.randn(E, 2 * inter, H, device=dev, generator=g) / H**0.5).to(dt)
            w2 = (torch.randn(E, H, inter, device=dev, generator=g) / inter**0.5).to(dt)
            sets = []
            for _ in range(8):
                x = torch.randn(T, H, device=dev, generator=g).to(dt)
                w, ids = fmoe.route(torch.randn(T, E, device=dev, generator=g), topk)
                sets.append((x, w1, w2, w, ids, None))
            backend, sol = backends.default("fmoe", key, dev)
            default = backend.make_runner(sol, key, dev)
            fused = {
                f"one_launch split {sp}": OneLaunch(T, H, inter, topk, dev, dt, bn1=32, bk1=128, bn2=64, split=sp)
                for sp in (1, 4, 8)
            }
            ref = kmoe.fused_moe_ref(*[t.float() if t.is_floating_point() and t.dim() > 1 else t for t in sets[0][:3]],
                                     sets[0][3], sets[0][4])  # fmt: skip
            calls = {"default": default, **fused}
            for name, run in calls.items():
                err = ((run(*sets[0]).float() - ref).norm() / ref.norm()).item()
                if err > 1.6e-2:
                    print(f"  {name}: rel err {err:.2e}: dropped")
            ms = time_graphs({n: (lambda r=r, sets=sets: [r(*s) for s in sets]) for n, r in calls.items()}, reps=20,
                             calls_per_graph=len(sets))  # fmt: skip
            roof = sum(fmoe.bytes_hit(key, s[4]) for s in sets) / len(sets) / read_bw * 1e6
            row = " ".join(f"{n} {v * 1e3:6.1f} us ({roof / (v * 1e3):.0%})" for n, v in ms.items())
            print(f"E={E} I={inter} H={H} top{topk} T={T}: roof {roof:5.1f} us | {row} | default {sol.describe()}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only the correctness check (CPU: under TRITON_INTERPRET=1)")
    a = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not check(device):
        print("CHECK FAILED")
        return 1
    if not a.check and device == "cuda":
        bench()
    return 0


if __name__ == "__main__":
    sys.exit(main())
