"""The device vocabulary (gemmtune/device.py): vendor, capability, where Triton runs, Needs.missing, and
that no other module asks these questions its own way.

GPUs are faked: torch.cuda.is_available, torch.version.hip and the device properties are patched, and
device.facts' cache is cleared around each test so no other test sees a fake GPU.
"""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import pytest
import torch

from gemmtune import device as dev
from gemmtune.device import AMD, CPU, GPU_ONLY, NVIDIA, Needs

SRC = pathlib.Path(dev.__file__).resolve().parent


@pytest.fixture(autouse=True)
def _fresh_facts():
    dev._facts_of.cache_clear()
    yield
    dev._facts_of.cache_clear()


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def fake_gpu(monkeypatch, *, capability=(9, 0), hip: str | None = None):
    """Make torch report one GPU of `capability`: NVIDIA, or AMD when `hip` is a ROCm version."""
    props = SimpleNamespace(
        major=capability[0], minor=capability[1], multi_processor_count=132, name="NVIDIA Fake GPU",
        gcnArchName="gfx942:sramecc+:xnack-", shared_memory_per_block_optin=227 * 1024,
        shared_memory_per_multiprocessor=228 * 1024, L2_cache_size=50 * 2**20, total_memory=80 * 2**30,
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: props)
    monkeypatch.setattr(torch.version, "hip", hip)
    dev._facts_of.cache_clear()  # facts are cached per device: a second fake GPU must be read afresh


def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---- vendor, capability, build ------------------------------------------------------------------
def test_cpu_and_invisible_gpu_are_cpu(monkeypatch):
    no_gpu(monkeypatch)
    assert dev.vendor("cpu") == dev.vendor("cuda") == dev.vendor(None) == CPU
    assert not dev.is_gpu("cuda") and dev.capability("cuda") == (0, 0)


def test_nvidia_gpu(monkeypatch):
    fake_gpu(monkeypatch, capability=(8, 6))
    assert dev.vendor("cuda") == dev.vendor(torch.device("cuda", 0)) == NVIDIA
    assert dev.vendor(None) == NVIDIA  # the default device is the GPU when one is visible
    assert dev.vendor("cpu") == CPU
    assert dev.capability("cuda") == (8, 6) and dev.capability("cpu") == (0, 0)
    assert not dev.is_rocm() and dev.rocm_version() is None


def test_amd_gpu(monkeypatch):
    fake_gpu(monkeypatch, capability=(9, 4), hip="6.2.41133")
    assert dev.vendor("cuda:0") == AMD and dev.is_gpu("cuda")
    assert dev.is_rocm() and dev.rocm_version() == "6.2.41133"
    assert dev.capability("cuda") == (9, 4)


# ---- where Triton runs --------------------------------------------------------------------------
def test_interpreter_is_read_at_each_call(monkeypatch):
    assert not dev.interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dev.interpreter()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not dev.interpreter()


@pytest.mark.skipif(not dev.triton_installed(), reason="triton is not installed")
def test_triton_on_the_cpu_only_through_the_interpreter(monkeypatch):
    no_gpu(monkeypatch)
    assert not dev.triton_runs_on("cpu")
    assert dev.triton_reason("cpu") == "Triton runs on GPUs (or on the CPU with TRITON_INTERPRET=1), not on cpu"
    assert dev.triton_reason("cuda") == "no GPU is visible to PyTorch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dev.triton_runs_on("cpu") and dev.triton_reason("cpu") == ""
    assert not dev.triton_runs_on("cuda")  # the interpreter takes CPU tensors, not a missing GPU's
    assert not dev.triton_on_gpu("cpu")  # automatic kernel choices ignore the interpreter


@pytest.mark.skipif(not dev.triton_installed(), reason="triton is not installed")
def test_triton_on_a_gpu(monkeypatch):
    for hip in (None, "6.2"):
        fake_gpu(monkeypatch, hip=hip)
        assert dev.triton_on_gpu("cuda") and dev.triton_runs_on("cuda")
        assert not dev.triton_on_gpu("cpu")


def test_without_triton_nothing_runs_triton(monkeypatch):
    fake_gpu(monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dev, "triton_installed", lambda: False)
    for where in ("cuda", "cpu"):
        assert not dev.triton_on_gpu(where) and not dev.triton_runs_on(where)
        assert dev.triton_reason(where) == "triton is not installed"
        assert Needs(triton=True).missing(where) == "triton is not installed"


# ---- Needs --------------------------------------------------------------------------------------
HOPPER_TRITON = Needs(vendors=frozenset({NVIDIA}), triton=True, interpreter_ok=False, min_capability=(9, 0))


def test_needs_on_an_nvidia_gpu(monkeypatch):
    fake_gpu(monkeypatch, capability=(8, 0))
    assert Needs().missing("cuda") == Needs(vendors=GPU_ONLY).missing("cuda") == ""
    hopper = Needs(vendors=frozenset({NVIDIA}), min_capability=(9, 0))
    assert hopper.missing("cuda") == "it needs an NVIDIA GPU of capability >= 9.0 (sm90), this one is 8.0"
    fake_gpu(monkeypatch, capability=(9, 0))
    assert hopper.missing("cuda") == ""
    assert Needs(vendors=frozenset({AMD})).missing("cuda") == "it needs an AMD GPU, not an NVIDIA GPU"
    assert Needs(vendors=frozenset({CPU})).missing("cuda") == "it needs the CPU, not an NVIDIA GPU"


def test_needs_on_an_amd_gpu(monkeypatch):
    fake_gpu(monkeypatch, capability=(9, 4), hip="6.2")
    # min_capability is NVIDIA's sm: it does not apply to a ROCm gfx9 capability
    assert Needs(vendors=GPU_ONLY, min_capability=(10, 0)).missing("cuda") == ""
    assert Needs(vendors=frozenset({NVIDIA})).missing("cuda") == "it needs an NVIDIA GPU, not an AMD GPU"


def test_needs_on_the_cpu(monkeypatch):
    no_gpu(monkeypatch)
    assert Needs().missing("cpu") == ""
    assert Needs(vendors=GPU_ONLY).missing("cpu") == "it needs an AMD GPU or an NVIDIA GPU, not cpu"
    assert Needs(vendors=GPU_ONLY).missing("cuda") == "no GPU is visible to PyTorch"
    assert Needs(modules=("no_such_module_xyz.sub",)).missing("cpu") == (
        "python module 'no_such_module_xyz.sub' is not installed"
    )


@pytest.mark.skipif(not dev.triton_installed(), reason="triton is not installed")
def test_needs_triton_on_the_cpu(monkeypatch):
    no_gpu(monkeypatch)
    triton_kernels = Needs(vendors=GPU_ONLY, triton=True)
    assert triton_kernels.missing("cpu") == "Triton runs on GPUs (or on the CPU with TRITON_INTERPRET=1), not on cpu"
    # A GPU-only kernel is not offered the interpreter as a way out
    assert HOPPER_TRITON.missing("cpu") == "it needs an NVIDIA GPU, not cpu"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_kernels.missing("cpu") == ""
    assert HOPPER_TRITON.missing("cpu") == "it needs an NVIDIA GPU, not cpu"
    assert triton_kernels.missing("cuda") == "no GPU is visible to PyTorch"


@pytest.mark.skipif(not dev.triton_installed(), reason="triton is not installed")
def test_pdl_reason_follows_the_vocabulary(monkeypatch):
    from gemmtune.kernels import _common

    no_gpu(monkeypatch)
    assert _common.pdl_reason(torch.device("cpu")) == "it needs an NVIDIA GPU, not cpu"
    fake_gpu(monkeypatch, hip="6.2")
    assert _common.pdl_reason(torch.device("cuda")) == "it needs an NVIDIA GPU, not an AMD GPU"
    fake_gpu(monkeypatch, capability=(8, 0))
    assert "capability >= 9.0" in _common.pdl_reason(torch.device("cuda"))
    fake_gpu(monkeypatch, capability=(9, 0))
    monkeypatch.setenv("GEMMTUNE_PDL", "0")
    want = "GEMMTUNE_PDL=0" if _common.HAS_PDL else "this Triton has no gdc_wait"
    assert _common.pdl_reason(torch.device("cuda")) == want


# ---- the rule for automatic kernel choices --------------------------------------------------------
@pytest.mark.skipif(not dev.triton_installed(), reason="triton is not installed")
def test_auto_elementwise_kernels_skip_the_interpreter(monkeypatch):
    """Under TRITON_INTERPRET=1 a CPU tensor still gets the reference from impl="auto" (bf16 is wrong in
    the interpreter); only impl="triton" sends it to the kernel."""
    from gemmtune.kernels import activations, norms

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def no_kernel(*args, **kwargs):
        raise AssertionError("impl='auto' launched the Triton kernel on a CPU tensor")

    monkeypatch.setattr(norms, "_launch", no_kernel)
    monkeypatch.setattr(activations, "_launch", no_kernel)
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    torch.testing.assert_close(norms.rmsnorm(x, w, 1e-6), norms.rmsnorm_ref(x, w, 1e-6))
    gu = torch.randn(4, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(activations.silu_mul(gu), activations.act_mul(gu, "silu", impl="ref"))
    with pytest.raises(AssertionError, match="launched the Triton kernel"):
        norms.rmsnorm(x, w, 1e-6, impl="triton")


# ---- nobody else asks its own way ---------------------------------------------------------------
def _own_way_reads(path: pathlib.Path) -> list[str]:
    """Where `path` reads torch.version.hip or the TRITON_INTERPRET variable, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "hip":
            found.append(f"{node.lineno}: .hip")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.version":
            found.append(f"{node.lineno}: from torch.version import")
        elif isinstance(node, ast.Constant) and node.value == "TRITON_INTERPRET":
            found.append(f"{node.lineno}: TRITON_INTERPRET")
    return found


def test_the_checker_finds_own_way_reads(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os, torch\n"
        "from torch.version import hip\n"
        "A = torch.version.hip\n"
        'B = os.environ.get("TRITON_INTERPRET")\n'
        'C = "set TRITON_INTERPRET=1 to run on the CPU"\n'  # words about the variable are not a read
    )
    assert _own_way_reads(src) == ["2: from torch.version import", "3: .hip", "4: TRITON_INTERPRET"]


def test_only_device_py_reads_hip_and_the_interpreter_variable():
    found = [
        f"{path.relative_to(SRC.parent)}:{hit}"
        for path in sorted(SRC.rglob("*.py"))
        if path != SRC / "device.py"
        for hit in _own_way_reads(path)
    ]
    assert not found, "ask gemmtune.device (vendor, is_rocm, interpreter, triton_runs_on):\n" + "\n".join(found)


def test_the_vocabulary_traces_under_torch_compile():
    # Kernels ask these inside compiled models: dynamo must trace them without a graph break
    # (importlib's find_spec, for one, it refuses to trace).
    def f(x):
        if dev.triton_installed() and dev.triton_on_gpu(x.device):
            return x + 1
        return x * 2 if dev.vendor(x.device) == CPU else x

    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="eager")(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 2.0))
