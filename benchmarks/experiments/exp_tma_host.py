"""Where the host time of one eager Triton TMA launch goes, against the same tile without TMA and cuBLASLt's
default row, for one fp8 prefill key (M 2048, N 14336, K 4096 by default): the backend runner, the bound
kernel, the kernel's own launcher with every argument ready, and the pieces between (the descriptors,
Triton's descriptor expansion); then cProfile's top entries of the TMA runner. Each figure is the median over
7 rounds of the host time of 200 calls queued behind a GPU sleep (exp_host_per_op.host_us), per call.
With --dump DIR, the Triton launcher's descriptor handling is written there (its source, for reading).

    python benchmarks/experiments/exp_tma_host.py [--nk 14336x4096] [--dump OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import io
import os
import pstats

import torch
import triton
from exp_host_per_op import host_us

import gemmtune
from gemmtune.backends.quantized import triton_tg
from gemmtune.families import get
from gemmtune.families.quantized import QuantKey
from gemmtune.kernels.a8w8_tg import parse_config
from gemmtune.kernels.launch import tensor_signature
from gemmtune.kernels.triton_gemm import TensorDescriptor, TGKernel

TMA = "a8w8_tg_bm128_bn256_bk128_g8_w8_s3_sk1_pf_tma"


def bound_of(kern: TGKernel):
    """The kernel's one kept BoundLaunch (a _Launch's GEMM launch, or before it a Plans entry)."""
    (entry,) = getattr(kern, "_launches", getattr(kern, "_plans", {})).values()
    return getattr(entry, "gemm", entry)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nk", default="14336x4096")
    ap.add_argument("--m", type=int, default=2048)
    ap.add_argument("--dump", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n, k = (int(v) for v in args.nk.split("x"))
    key = QuantKey(args.m, n, k, torch.float8_e4m3fn, "per_token", False, torch.bfloat16)
    xq, wq, xs, ws, _ = get("a8w8").make_inputs(key, dev, 1, 0)[0]
    y = torch.empty(args.m, n, device=dev, dtype=torch.bfloat16)
    plain = TMA.removesuffix("_tma")
    runners = {name: triton_tg.make_runner(name, key, dev) for name in (TMA, plain)}
    kerns = {name: TGKernel(parse_config(name), dev) for name in (TMA, plain)}
    for kern in kerns.values():
        kern(xq, wq, None, y, xs=xs, ws=ws)
    gemmtune.set_config(None)
    default = gemmtune.resolve(key, dev, family="a8w8")
    cfg = parse_config(TMA)
    xa, wa = TensorDescriptor.from_tensor(xq, [cfg.bm, cfg.bk]), TensorDescriptor.from_tensor(wq, [cfg.bn, cfg.bk])
    slots = {TMA: [xa, wa, y, y, y, y, y, xs, ws], plain: [xq, wq, y, y, y, y, y, xs, ws]}
    stream = torch.cuda.current_stream().cuda_stream

    def direct(name):
        run, gx, gy, gz, function, metadata, full, _ = bound_of(kerns[name]).direct
        full = full.copy()
        for i, t in zip(bound_of(kerns[name]).slots, slots[name], strict=True):
            full[i] = t
        return lambda: run(gx, gy, gz, stream, function, metadata, None, None, None, *full)

    rows = {
        f"default runner [{default.solution.kernel_name}]": lambda: default.runner(xq, wq, xs, ws, None),
        "gemm_a8w8 op (default row)": lambda: gemmtune.gemm_a8w8(xq, wq, xs, ws),
        "runner tma": lambda: runners[TMA](xq, wq, xs, ws, None),
        "runner plain": lambda: runners[plain](xq, wq, xs, ws, None),
        "TGKernel tma": lambda: kerns[TMA](xq, wq, None, y, xs=xs, ws=ws),
        "TGKernel plain": lambda: kerns[plain](xq, wq, None, y, xs=xs, ws=ws),
        "BoundLaunch tma (descriptors made)": lambda: bound_of(kerns[TMA])(*slots[TMA]),
        "BoundLaunch plain": lambda: bound_of(kerns[plain])(*slots[plain]),
        "compiled.run tma (arguments made)": direct(TMA),
        "compiled.run plain": direct(plain),
        "TensorDescriptor.from_tensor x2": lambda: (
            TensorDescriptor.from_tensor(xq, [cfg.bm, cfg.bk]),
            TensorDescriptor.from_tensor(wq, [cfg.bn, cfg.bk]),
        ),
        "tensor_signature x7": lambda: tuple(tensor_signature(t) for t in (xq, wq, None, y, None, xs, ws)),
        "torch.empty y": lambda: torch.empty(args.m, n, device=dev, dtype=torch.bfloat16),
    }
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}, M={args.m} "
          f"N={n} K={k}")  # fmt: skip
    for label, fn in rows.items():
        print(f"{label:60s} {host_us(fn):7.1f} us/call", flush=True)

    prof = cProfile.Profile()
    torch.cuda._sleep(300_000_000)
    prof.enable()
    for _ in range(200):
        runners[TMA](xq, wq, xs, ws, None)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    if args.dump:
        from triton.backends import driver as base_driver
        from triton.backends.nvidia import driver as nv

        os.makedirs(args.dump, exist_ok=True)
        with open(os.path.join(args.dump, "triton_nvidia_driver.py"), "w") as f:
            f.write(inspect.getsource(nv))
        with open(os.path.join(args.dump, "triton_backends_driver.py"), "w") as f:
            f.write(inspect.getsource(base_driver))


if __name__ == "__main__":
    main()
