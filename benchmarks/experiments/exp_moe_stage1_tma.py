"""Experiment: does a TMA load of the expert weights speed up fused_moe's stage 1 at decode (issue 29)?

A prototype stage 1 (a program per (slot, I tile) of a direct grid over slots, gated silu, one chunk of at
most 16 slots per expert, no split, no shared experts) loads w1's gate and up tiles either through a host
TMA descriptor over w1 viewed (E * 2I, H) (`tma`) or through pointers (`ptr`), BLOCK_N 32/64, BLOCK_K 128/256,
3-5 pipeline stages. Each is checked against an fp32 einsum of the slot rows (rel err < 2e-2), then timed with
the default stage 1 (backends/fmoe stage_runner of heuristic_configs' stage 1): real top-k routing over 8
rotating input sets, CUDA-graph replays (gemmtune.tuner.timing.time_graphs); "% roof" is the bytes of the gate
and up weights of the experts hit over the read bandwidth measured in the run. Needs an sm90 GPU.

    PYTHONPATH=src python benchmarks/experiments/exp_moe_stage1_tma.py 2048,384,128,8,4 7168,256,256,8,4
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from gemmtune.backends.fmoe.stages import stage_runner
from gemmtune.backends.fmoe.triton import heuristic_configs
from gemmtune.families import fmoe
from gemmtune.tuner.timing import measure_ceilings, time_graphs

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/: bench_moe
from bench_moe import expert_inputs  # noqa: E402

SETS = 8


@triton.jit(do_not_specialize=["n_slots"])
def _stage1(x_ptr, w_desc, w_ptr, h_ptr, ids_ptr, n_slots, inter, hidden, topk, stride_xt, SLOTS: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    slots = tl.arange(0, SLOTS)
    valid = slots < n_slots
    ids = tl.load(ids_ptr + slots, mask=valid, other=-1).to(tl.int32)
    e = tl.sum(tl.where(slots == pid, ids, 0), axis=0)
    if tl.sum(((ids == e) & (slots < pid)).to(tl.int32), axis=0) == 0:  # the first slot of its expert
        hit = ((ids == e) & valid).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1
        r = tl.arange(0, BM)
        slot = tl.sum(tl.where((hit[None, :] > 0) & (rank[None, :] == r[:, None]), slots[None, :], 0), axis=1)
        row_ok = r < tl.sum(hit, axis=0)
        a_rows = (slot // topk).to(tl.int64) * stride_xt
        offs_k = tl.arange(0, BK)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < inter
        base = w_ptr + e.to(tl.int64) * 2 * inter * hidden
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, hidden, BK):
            k_ok = (k0 + offs_k) < hidden
            a = tl.load(x_ptr + a_rows[:, None] + (k0 + offs_k)[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            if TMA:  # rows past the tile's own belong to masked-off columns, or TMA fills them with zeros
                gate = w_desc.load([e * 2 * inter + pid_n * BN, k0])
                up = w_desc.load([e * 2 * inter + inter + pid_n * BN, k0])
            else:
                m = n_ok[:, None] & k_ok[None, :]
                gate = tl.load(base + offs_n[:, None] * hidden + (k0 + offs_k)[None, :], mask=m, other=0.0)
                up = tl.load(base + (inter + offs_n)[:, None] * hidden + (k0 + offs_k)[None, :], mask=m, other=0.0)
            acc = tl.dot(a, gate.T, acc)
            acc_up = tl.dot(a, up.T, acc_up)
        y = acc / (1.0 + tl.exp(-acc)) * acc_up
        tl.store(h_ptr + slot.to(tl.int64)[:, None] * inter + offs_n[None, :], y.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


def prototype(key, bn: int, bk: int, stages: int, tma: bool):
    E, inter, H = key.expert, key.inter_dim, key.model_dim  # noqa: N806
    descs: dict[int, TensorDescriptor] = {}

    def run(x, w1, w2, tw, ids, emap):
        S = ids.numel()  # noqa: N806
        h = torch.empty(S, inter, device=x.device, dtype=x.dtype)
        desc = descs.setdefault(w1.data_ptr(), TensorDescriptor.from_tensor(w1.view(E * 2 * inter, H), [bn, bk]))
        _stage1[(S, triton.cdiv(inter, bn))](x, desc, w1, h, ids, S, inter, H, key.topk, x.stride(0),
                                              SLOTS=max(16, triton.next_power_of_2(S)), BM=16, BN=bn, BK=bk, TMA=tma,
                                              num_warps=4, num_stages=stages)  # fmt: skip
        return h

    return run


def reference(key, x, w1, ids) -> torch.Tensor:
    """silu(x @ gate) * (x @ up) of every slot, fp32."""
    inter = key.inter_dim
    xs = x.float()[torch.arange(ids.numel(), device=x.device) // key.topk]
    w = w1.float()[ids.flatten().long()]
    gate, up = torch.einsum("sh,sih->si", xs, w[:, :inter]), torch.einsum("sh,sih->si", xs, w[:, inter:])
    return torch.nn.functional.silu(gate) * up


def point(H: int, inter: int, E: int, topk: int, T: int, ceilings) -> None:  # noqa: N803
    dt = torch.bfloat16
    key = fmoe.MoeKey(T, H, inter, E, topk, dtype=dt, q_dtype_a=dt, q_dtype_w=dt)
    ins = expert_inputs(key, SETS, torch.Generator(device="cuda").manual_seed(T))
    hit = sum(i[4].unique().numel() for i in ins) / SETS
    roof = hit * 2 * inter * H * dt.itemsize / ceilings.read_bw * 1e6
    h1, _ = heuristic_configs(key)
    default = stage_runner(key, 1, h1)
    runs = {f"default {h1.name}": lambda i: default(*ins[i])}
    want = reference(key, ins[0][0], ins[0][1], ins[0][4])
    for bn, bk, st, tma in itertools.product((32, 64), (128, 256), (3, 4, 5), (True, False)):
        run = prototype(key, bn, bk, st, tma)
        try:
            err = ((run(*ins[0]).float() - want).norm() / want.norm()).item()
        except Exception as exc:  # noqa: BLE001 - past the shared memory: skip it
            print(f"  bn{bn} bk{bk} s{st}: {type(exc).__name__}, dropped")
            continue
        if err > 2e-2:
            print(f"  {'tma' if tma else 'ptr'} bn{bn} bk{bk} s{st}: rel err {err:.2e}, dropped")
            continue
        runs[f"{'tma' if tma else 'ptr'} bn{bn} bk{bk} s{st}"] = lambda i, run=run: run(*ins[i])
    t = time_graphs({n: (lambda r=r: [r(i) for i in range(SETS)]) for n, r in runs.items()}, reps=20,
                    calls_per_graph=SETS)  # fmt: skip
    print(f"== stage 1 E{E} I{inter} H{H} top{topk} T{T}: roof {roof:.1f} us", flush=True)
    for n in sorted(t, key=t.get)[:12]:
        print(f"  {n}: {t[n] * 1e3:.1f} us ({100 * roof / (t[n] * 1e3):.0f}%)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("points", nargs="+", help="H,I,E,topk,T")
    args = ap.parse_args()
    ceilings = measure_ceilings(torch.device("cuda"))
    print(f"read bandwidth {ceilings.read_bw / 1e12:.2f} TB/s")
    for p in args.points:
        point(*(int(v) for v in p.split(",")), ceilings)


if __name__ == "__main__":
    main()
