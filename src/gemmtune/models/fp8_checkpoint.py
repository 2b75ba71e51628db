"""Checkpoints already in fp8 with 128x128 block scales (DeepSeek-V3, Qwen3-*-FP8), without a bf16
round trip.

The layout (what transformers' "fp8" / FineGrainedFP8 quantizer reads): a Linear's `weight` is
float8_e4m3fn [N, K] and `weight_scale_inv` fp32 [ceil(N/128), ceil(K/128)] is the multiplier that
dequantizes each 128x128 block (w = q * scale_inv); config.json carries `quantization_config`
{"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}.
Activations are quantized per 1x128 group at run time, so such a Linear is exactly what
gemm_a8w8_blockscale computes.

Two ways in:
- load_fp8_checkpoint(model, checkpoint): a model built from its config (random weights, or meta
  parameters) gets the checkpoint's tensors; every fp8 Linear becomes an Fp8BlockLinear holding the
  checkpoint's fp8 weight and scales as they are (state_dict keys unchanged), the rest loads as usual.
- a model transformers loaded itself (`from_pretrained` on a GPU keeps fp8 weights in its own
  FP8Linear modules): optimize() routes those modules' forward through the same op
  (route_fp8_linears), reading their weight / weight_scale_inv; restore() puts their forward back.
Not done: fusing fp8 q/k/v or gate/up (their scales would have to be concatenated per 128-row block).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from torch import nn

from ..checks import bad, check_bool
from ..configs.files import check_regular
from ..quant import formats, layouts, quantize
from .bind import bind
from .quantize import fp8_block_linear
from .rewrite import Change, Deferred

_SCALE = "weight_scale_inv"
_ROUTED = "_gemmtune_fp8_routed"  # module.__dict__ marker: its forward runs gemm_a8w8_blockscale


def check_quantization_config(config) -> dict | None:
    """The model config's fp8 block quantization_config (as a dict), None when it has none; ValueError
    naming the field when it describes something these ops do not run."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method is {method!r}: only 'fp8' (block-scaled) checkpoints load")
    block = qc.get("weight_block_size")
    if block is not None and list(block) != [formats.BLOCK, formats.BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size is {block}: gemm_a8w8_blockscale takes [128, 128]")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme is {qc['activation_scheme']!r}: only 'dynamic' "
                         "(activations quantized per 1x128 group at run time) is supported")  # fmt: skip
    return qc


def _scale_shape(n: int, k: int) -> tuple[int, int]:
    return (-(-n // formats.BLOCK), -(-k // formats.BLOCK))


# fp32 scales (DeepSeek-V3 style) or power-of-two UE8M0 bytes (DeepSeek-V4 style, exact in fp32)
_SCALE_DTYPES = tuple(d for d in (torch.float32, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


def fp8_skip_reason(weight, scale, block_size=(128, 128), activation_scheme="dynamic") -> str | None:
    """Why an fp8 (weight, weight_scale_inv) pair cannot run as gemm_a8w8_blockscale (None when it can)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != formats.FP8:
        return f"weight is {getattr(weight, 'dtype', type(weight).__name__)}, not a 2-D float8_e4m3fn tensor"
    n, k = weight.shape
    want = _scale_shape(n, k)
    if not isinstance(scale, torch.Tensor) or scale.dtype not in _SCALE_DTYPES or tuple(scale.shape) != want:
        got = f"{tuple(scale.shape)} {scale.dtype}" if isinstance(scale, torch.Tensor) else type(scale).__name__
        return f"{_SCALE} is {got}, expected float32 {want} (one scale per 128x128 block)"
    if block_size is not None and tuple(block_size) != (formats.BLOCK, formats.BLOCK):
        return f"block_size {tuple(block_size)} is not 128x128"
    if activation_scheme not in (None, "dynamic"):
        return f"activation_scheme {activation_scheme!r}: static activation scales are not supported"
    if k % formats.BLOCK:
        return f"K={k} is not a multiple of 128 (block-scaled GEMMs need whole K groups)"
    if weight.device.type == "meta":
        return "weights are not materialized (meta device)"
    return None


def kernel_scale(mod: nn.Module) -> torch.Tensor:
    """The module's weight_scale_inv in the layout the kernels read without a copy (rows padded to 4),
    made once and remade only when the parameter changes (load_state_dict)."""
    s = getattr(mod, _SCALE)
    cached = mod.__dict__.get("_gemmtune_ws")
    if cached is None or cached[0] is not s or cached[1] != s._version:
        cached = (s, s._version, layouts.k_padded(s.detach().float()))
        mod.__dict__["_gemmtune_ws"] = cached
    return cached[2]


class Fp8BlockLinear(nn.Module):
    """A Linear whose weight is an fp8 checkpoint's: float8_e4m3fn [N, K] plus 128x128 block scales
    `weight_scale_inv`, run as 1x128 dynamic activation quantization + gemm_a8w8_blockscale."""

    def __init__(self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        why = fp8_skip_reason(weight, weight_scale_inv)
        if why:
            raise ValueError(f"Fp8BlockLinear: {why}")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(weight_scale_inv, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_linear(x, self.weight, kernel_scale(self), self.bias)

    def dequantized_weight(self, dtype=torch.float32) -> torch.Tensor:
        return quantize.dequantize_128x128(self.weight, self.weight_scale_inv.float()).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128 block scales"


# ---- loading ------------------------------------------------------------------------------------
def read_checkpoint(checkpoint, device) -> dict[str, torch.Tensor]:
    """A state dict, a .safetensors file, or a folder of them (sharded checkpoints), onto `device`."""
    if isinstance(checkpoint, dict):
        return {k: v.to(device) for k, v in checkpoint.items()}
    path = os.fspath(checkpoint)
    from safetensors.torch import load_file

    if os.path.isdir(path):
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(_regular(index, "a checkpoint index (JSON)"), encoding="utf-8") as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"load_fp8_checkpoint: no .safetensors files in {path}")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(_regular(os.path.join(path, f)), device=str(device)))
        return out
    if not path.endswith(".safetensors"):
        raise ValueError(f"load_fp8_checkpoint: {path} is not a .safetensors file or a folder of them")
    return load_file(_regular(path), device=str(device))


def _regular(path: str, what: str = "a .safetensors file") -> str:
    """`path`, once it is known to be a regular file: a FIFO or a device would block or never end."""
    try:
        check_regular(path, ValueError, what)
    except ValueError as exc:
        raise ValueError(f"load_fp8_checkpoint: {exc}") from None
    return path


@dataclass
class Fp8Load:
    """What load_fp8_checkpoint did."""

    fp8: list[str] = field(default_factory=list)  # Linear paths now Fp8BlockLinear
    dequantized: list[tuple[str, str]] = field(default_factory=list)  # (path, why) loaded as 16-bit
    other: int = 0  # other tensors loaded as they are

    def summary(self) -> str:
        lines = [f"fp8 checkpoint: {len(self.fp8)} linears kept fp8 (gemm_a8w8_blockscale), {self.other} other tensors"]
        lines += [f"  dequantized {p}: {why}" for p, why in self.dequantized]
        return "\n".join(lines)


def _default_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def _dtype(model: nn.Module) -> torch.dtype:
    """The model's 16-bit / fp32 dtype (its config's, else its first such parameter's)."""
    dt = getattr(getattr(model, "config", None), "torch_dtype", None)
    if isinstance(dt, torch.dtype) and dt in (torch.float16, torch.bfloat16, torch.float32):
        return dt
    return next((p.dtype for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16, torch.float32)),
                torch.bfloat16)  # fmt: skip


def _set(model: nn.Module, path: str, mod: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, mod)


def load_fp8_checkpoint(model: nn.Module, checkpoint, *, device=None, strict: bool = True) -> Fp8Load:
    """Load an fp8 block-scaled checkpoint into `model` (built from its config) without dequantizing it.

    checkpoint: a state dict, a .safetensors file or a folder of them. Every `<path>.weight` in
    float8_e4m3fn with a `<path>.weight_scale_inv` replaces the Linear at <path> by an Fp8BlockLinear
    holding those tensors (bias from the checkpoint, else the module's); a Linear whose K is not a
    multiple of 128 is dequantized to the model's dtype instead (listed in the result). Every other
    tensor loads as load_state_dict would (assigned where the model's parameters are on the meta
    device). strict: checkpoint keys the model does not have, or model parameters / buffers left on
    the meta device, raise a ValueError naming them.
    """
    if not isinstance(model, nn.Module):
        raise bad("load_fp8_checkpoint", "model", "a torch.nn.Module", model, TypeError)
    check_bool("load_fp8_checkpoint", "strict", strict)
    check_quantization_config(getattr(model, "config", None))
    dev = torch.device(device) if device is not None else _default_device(model)
    sd = read_checkpoint(checkpoint, dev)
    res = Fp8Load()
    names = dict(model.named_modules())
    for key in [k for k in sd if k.endswith("." + _SCALE)]:
        path = key[: -len(_SCALE) - 1]
        mod, w, s = names.get(path), sd.get(path + ".weight"), sd[key]
        if not isinstance(mod, nn.Linear):
            if strict:
                raise ValueError(f"load_fp8_checkpoint: {key} has no nn.Linear at {path!r} in the model")
            continue
        if tuple(getattr(w, "shape", ())) != (mod.out_features, mod.in_features):
            raise ValueError(f"load_fp8_checkpoint: {path}.weight is {tuple(getattr(w, 'shape', ()))}, the model's "
                             f"Linear is [{mod.out_features}, {mod.in_features}]")  # fmt: skip
        why = fp8_skip_reason(w, s)
        # A well-formed pair whose K is not a multiple of 128 is dequantized; anything else is an error.
        if why is not None and not (mod.in_features % formats.BLOCK and why.startswith("K=")):
            raise ValueError(f"load_fp8_checkpoint: {path}: {why}")
        del sd[key], sd[path + ".weight"]
        bias = sd.pop(path + ".bias", None)
        if bias is None and mod.bias is not None and mod.bias.device.type != "meta":
            bias = mod.bias.detach()
        if why is None:
            _set(model, path, Fp8BlockLinear(w, s, None if bias is None else bias.to(dev)))
            res.fp8.append(path)
            continue
        lin = nn.Linear(mod.in_features, mod.out_features, bias=bias is not None, device=dev, dtype=_dtype(model))
        with torch.no_grad():
            lin.weight.copy_(quantize.dequantize_128x128(w, s.float()))
            if bias is not None:
                lin.bias.copy_(bias)
        _set(model, path, lin)
        res.dequantized.append((path, why))
    assign = any(p.device.type == "meta" for p in model.parameters())
    result = model.load_state_dict(sd, strict=False, assign=assign)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    res.other = len(sd) - len(result.unexpected_keys)
    left = [n for n, p in (*model.named_parameters(), *model.named_buffers()) if p.device.type == "meta"]
    if strict and (result.unexpected_keys or left):
        parts = []
        if result.unexpected_keys:
            parts.append(f"checkpoint keys the model lacks: {', '.join(result.unexpected_keys[:5])}")
        if left:
            parts.append(
                f"model tensors the checkpoint left on the meta device: {', '.join(left[:5])} (build "
                "non-persistent buffers such as rotary inv_freq on a real device)"
            )
        raise ValueError("load_fp8_checkpoint: " + "; ".join(parts))
    return res


# ---- transformers' own fp8 modules --------------------------------------------------------------
def _checkpoint_forward(self, x: torch.Tensor) -> torch.Tensor:
    return fp8_block_linear(x, self.weight, kernel_scale(self), self.bias)


class _Unroute:
    """Undoes route_fp8_linears (an object, not a closure: it pickles with the model)."""

    def __init__(self):
        self.done: list[nn.Module] = []

    def __call__(self) -> None:
        for mod in reversed(self.done):
            mod.__dict__.pop("forward", None)
            mod.__dict__.pop(_ROUTED, None)


def route_fp8_linears(model: nn.Module, report):
    """Route every fp8 block-scaled Linear transformers loaded (FP8Linear: weight float8_e4m3fn plus
    weight_scale_inv, 128x128 blocks, dynamic activations) through gemm_a8w8_blockscale; Fp8BlockLinear
    modules are listed. Returns the callable that undoes it."""
    undo = _Unroute()
    done = undo.done
    for path, mod in model.named_modules():
        if isinstance(mod, Fp8BlockLinear):
            report.change("fp8", path, type(mod).__name__, f"{mod.out_features}x{mod.in_features} fp8 checkpoint "
                          "weight, 128x128 block scales: gemm_a8w8_blockscale")  # fmt: skip
            continue
        if not (isinstance(mod, nn.Linear) and hasattr(mod, _SCALE)) or _ROUTED in mod.__dict__:
            continue
        block = getattr(mod, "block_size", (128, 128))
        why = fp8_skip_reason(mod.weight, getattr(mod, _SCALE), block, getattr(mod, "activation_scheme", "dynamic"))
        if why is None and "forward" in mod.__dict__:
            why = "its forward is already overridden on the instance"
        if why:
            report.skip("fp8", path, type(mod).__name__, why)
            continue
        mod.__dict__[_ROUTED] = True
        mod.forward = bind(_checkpoint_forward, mod)
        done.append(mod)
        report.change("fp8", path, type(mod).__name__, f"{mod.out_features}x{mod.in_features} fp8 checkpoint "
                      "weight, 128x128 block scales: routed through gemm_a8w8_blockscale")  # fmt: skip
    return undo


class Fp8CheckpointLinears(Deferred):
    """The fp8 block-scaled Linears of a checkpoint (transformers' FP8Linear) through gemm_a8w8_blockscale."""

    kind = "fp8"

    def applies(self, arch, opts) -> bool:
        return opts["route_linears"]

    def run(self, model: nn.Module, change: Change, report):
        return route_fp8_linears(model, report)
