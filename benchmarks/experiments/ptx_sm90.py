"""Compile the Triton GEMM kernel (kernels/triton_gemm.py `_tg_kernel`) for sm_90 without a GPU and
report its tensor-core instructions: wgmma vs mma.sync, and how many wgmma groups each K step keeps in
flight (`wgmma.wait_group N` inside the loop: N = 1 overlaps a step's MMAs with the next step's issue,
only 0 waits for every step). Uses the installed Triton's bundled ptxas; findings hold for that Triton.

    PYTHONPATH=src python benchmarks/experiments/ptx_sm90.py [--config a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma ...]
"""

from __future__ import annotations

import argparse
import collections
import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gemmtune.kernels.a8w8_tg import parse_config as parse_8bit
from gemmtune.kernels.triton_gemm import _tg_kernel, parse_config

_PTRS = {"bias", "y", "c"}  # bf16 pointers
_DIVISIBLE = {"x", "w", "bias", "y", "part", "lock", "c", "xs", "ws", "N", "K", "sxm", "swn", "sym"}


def compile_sm90(cfg, dtype: str):
    """The compiled kernel of `cfg` for K-major operands of Triton type `dtype` (i8, fp8e4nv, bf16),
    per-token x per-channel scales for 8-bit ones, bf16 out, no bias, every size a multiple of 16."""
    eight = dtype != "bf16"
    consts = dict(sxk=1, swk=1, syn=1, HAS_BIAS=False, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
                  IS_SPLIT=cfg.split_k > 1, FIXUP=cfg.sk_mode == "f", EVEN_K=True, USE_TMA=cfg.tma,
                  PERSISTENT=cfg.persistent, NUM_SMS=132, INPUT_PREC="tf32", STAGES=cfg.stages, PDL=0,
                  HAS_ALPHA=False, HAS_C=False, ACT=0, XS=2 if eight else 0, WS=2 if eight else 0,
                  ACC_INT=dtype == "i8", FLATTEN=cfg.flatten)  # fmt: skip
    types = {"x": f"tensordesc<{dtype}[{cfg.bm}, {cfg.bk}]>" if cfg.tma else f"*{dtype}",
             "w": f"tensordesc<{dtype}[{cfg.bn}, {cfg.bk}]>" if cfg.tma else f"*{dtype}",
             "part": "*fp32", "lock": "*i32", "xs": "*fp32", "ws": "*fp32",
             "alpha": "fp32", "beta": "fp32"}  # fmt: skip
    names = _tg_kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n in _PTRS else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n in _DIVISIBLE and not sig[n].startswith("tensordesc")}  # fmt: skip
    src = ASTSource(_tg_kernel, sig, consts, attrs)
    options = {"num_warps": cfg.warps, "num_stages": cfg.stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def summary(ptx: str) -> dict:
    ops = re.findall(r"wgmma\.mma_async\.[\w.]+|mma\.sync\.[\w.]+|wgmma\.wait_group\.sync\.aligned \d+", ptx)
    return dict(collections.Counter(ops))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = ["a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1",
               "a8w8_tg_bm128_bn256_bk256_g8_w8_s2_sk1_tma",
               "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_pf_tma"]  # fmt: skip
    ap.add_argument("--config", nargs="+", default=default)
    args = ap.parse_args()
    print(f"triton {triton.__version__}, target sm_90")
    for name in args.config:
        cfg = parse_8bit(name) or parse_config(name)
        for dtype in ("i8", "fp8e4nv") if name.startswith("a8w8_") else ("bf16",):
            k = compile_sm90(cfg, dtype)
            print(f"{name} {dtype}: smem {k.metadata.shared} B; {summary(k.asm['ptx'])}")


if __name__ == "__main__":
    main()
