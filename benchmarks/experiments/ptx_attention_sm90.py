"""Compile the Triton attention kernel (kernels/attention_softcap.py `_softcap_attn_fwd`) for sm_90 without
a GPU and report what ptxas says: registers, spills, and the C7515 warning that wgmma instructions are
serialized. Uses the installed Triton and its bundled ptxas for sm_90 (ptxas-blackwell in Triton 3.9,
with Triton's own --regAllocOptLevel=2); findings hold for that Triton.

    PYTHONPATH=src python benchmarks/experiments/ptx_attention_sm90.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gemmtune.kernels import attention_softcap as kattn

_PTRS = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Bits": "*i64", "R": "*i32"}
_NOT_DIVISIBLE = {"L", "S", "window", "n_rep", "Hq", "score_scale", "cap_out"}


def compile_sm90(d: int, has_mask: bool, softcap: bool = True, edge_stages: int = kattn.EDGE_STAGES):
    """The kernel for bf16 transformers layouts (unit head-dim strides), causal without a mask or the mask
    alone (as the routing calls it), the table's config for head dim d."""
    cfg = kattn.CONFIGS[kattn.block_d(d)]
    consts = dict(CAUSAL=not has_mask, WINDOW=False, HAS_MASK=has_mask, SOFTCAP=softcap, FAST_TANH=True,
                  EVEN_D=True, D=d, BLOCK_D=kattn.block_d(d), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                  PRECISION=None, EDGE_STAGES=edge_stages, sqd=1, skd=1, svd=1)  # fmt: skip
    names = kattn._softcap_attn_fwd.arg_names
    sig = {n: "constexpr" if n in consts else _PTRS.get(n, "fp32" if n.endswith(("scale", "out")) else "i32")
           for n in names}  # fmt: skip
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if sig[n] != "constexpr" and n not in _NOT_DIVISIBLE}  # fmt: skip
    src = ASTSource(kattn._softcap_attn_fwd, sig, consts, attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_log(ptx: str) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", path, "-o", path + ".o"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def main():
    print(f"triton {triton.__version__}, target sm_90a")
    for d in (256, 128):
        for has_mask in (False, True):
            k = compile_sm90(d, has_mask)
            log = ptxas_log(k.asm["ptx"])
            regs = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            print(f"D={d} {'mask alone' if has_mask else 'causal, no mask'}: "
                  f"{len(re.findall(r'wgmma.mma_async', k.asm['ptx']))} wgmma, smem {k.metadata.shared} B, "
                  f"{regs.group(1) if regs else '?'} registers, spills {spills.groups() if spills else '?'} "
                  f"(stores, loads), wgmma serialized: {'C7515' in log}")  # fmt: skip


if __name__ == "__main__":
    main()
