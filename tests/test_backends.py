"""The backend registry (backends/__init__.py): availability and its reason derive from a backend's declared
`needs`, backends and policies are discovered from the family-group folders, and every family's untuned
default names the backend that really runs it (a Triton kernel under `skinny` / `triton`, torch under
`torch`)."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from gemmtune import backends
from gemmtune import device as dv
from gemmtune.backends.base import Backend, Solution
from gemmtune.concurrency import Once
from gemmtune.device import AMD, NVIDIA, Needs
from gemmtune.families.fmoe import MoeKey
from gemmtune.families.quantized import FP8, QuantKey
from gemmtune.kernels import _common

CPU_DEV = torch.device("cpu")


class _Probe(Backend):
    """A backend that declares what it needs and nothing else."""

    name = "probe"
    family = "a16w16"

    def __init__(self, needs: Needs, library: str = ""):
        self.needs, self.library = needs, library

    def library_missing(self, device) -> str:
        return self.library

    def candidates(self, key, device):
        return []

    def solution_from_row(self, solidx, kernel_name, splitk):
        return None

    def supports(self, solution, key, device):
        return False

    def make_runner(self, solution, key, device):
        raise NotImplementedError


@pytest.fixture
def as_gpu(monkeypatch):
    """The device vocabulary answering a GPU of `who` for every device (no GPU needed): returns a setter."""

    def become(who: str, capability=(9, 0)):
        monkeypatch.setattr(dv, "vendor", lambda d=None: who)
        monkeypatch.setattr(dv, "facts", lambda d=None: dv.OFF_GPU._replace(capability=capability))
        monkeypatch.setattr(torch.version, "hip", "6.2" if who == AMD else None)
        monkeypatch.setattr(_common, "_pdl_on", {})  # its per-device answers must not outlive the patch

    return become


# ---- availability from needs -----------------------------------------------------------------------
def test_availability_and_reason_derive_from_needs(as_gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    nvidia_only = _Probe(Needs(vendors=frozenset({NVIDIA})))
    assert not nvidia_only.is_available(CPU_DEV)
    assert nvidia_only.unavailable_reason(CPU_DEV).startswith("probe (a16w16): it needs an NVIDIA GPU")
    triton = _Probe(Needs(triton=True))
    assert "TRITON_INTERPRET=1" in triton.unavailable_reason(CPU_DEV)
    anywhere = _Probe(Needs())
    assert anywhere.is_available(CPU_DEV) and anywhere.unavailable_reason(CPU_DEV) == ""

    as_gpu(AMD)
    assert "not an AMD GPU" in nvidia_only.unavailable_reason(CPU_DEV) and triton.is_available(CPU_DEV)
    as_gpu(NVIDIA, capability=(8, 0))
    assert nvidia_only.is_available(CPU_DEV)
    hopper = _Probe(Needs(vendors=frozenset({NVIDIA}), min_capability=(9, 0)))
    assert "capability >= 9.0" in hopper.unavailable_reason(CPU_DEV)
    as_gpu(NVIDIA, capability=(9, 0))
    assert hopper.is_available(CPU_DEV)
    # the library probe speaks after the needs, under the backend's name
    assert _Probe(Needs(), library="libfoo cannot be loaded").unavailable_reason(CPU_DEV) == (
        "probe (a16w16): libfoo cannot be loaded"
    )
    monkeypatch.setattr(dv, "triton_installed", lambda: False)
    assert triton.unavailable_reason(CPU_DEV) == "probe (a16w16): triton is not installed"


def test_every_builtin_backend_reason_names_it_and_triton_ones_follow_one_rule(monkeypatch):
    """One rule for Triton: every builtin Triton backend runs on the CPU exactly when the interpreter is on."""
    everyone = [b for fam in sorted(backends.families_with_backends()) for b in backends.all_backends(fam).values()]
    tritons = [b for b in everyone if b.needs.triton]
    assert len({(b.family, b.name) for b in tritons}) >= 10  # a16w16 triton + skinny, batched, epilogue, 8-bit, fmoe
    for interp in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interp)
        for b in everyone:
            why = b.unavailable_reason(CPU_DEV)
            assert why == "" or why.startswith(f"{b.name} ({b.family}): "), why
            if b.needs.triton:
                assert b.is_available(CPU_DEV) == (interp == "1"), (b.family, b.name, why)
    blaslt = backends.get("blaslt")
    assert blaslt.needs.vendors == frozenset({NVIDIA}) and "nvmath" in blaslt.needs.modules
    assert backends.get("torch").needs == Needs() and backends.get("torch").is_available(CPU_DEV)


# ---- discovery ------------------------------------------------------------------------------------
_TOY = """
from gemmtune.backends.base import Backend, Solution

NATIVE = Solution("torch", "native", 0, 0)


class ToyBackend(Backend):
    name = "torch"
    family = "toyfam"

    def candidates(self, key, device):
        return [NATIVE]

    def solution_from_row(self, solidx, kernel_name, splitk):
        return NATIVE if kernel_name == "native" else None

    def supports(self, solution, key, device):
        return solution == NATIVE

    def make_runner(self, solution, key, device):
        return lambda x: x


BACKENDS = (ToyBackend(),)
"""


@pytest.fixture
def fresh_registry(monkeypatch):
    """An empty registry that loads the builtins (and whatever the test adds) again on first use."""
    monkeypatch.setattr(backends, "_registry", {})
    monkeypatch.setattr(backends, "_policies", {})
    monkeypatch.setattr(backends, "_import_errors", {})
    monkeypatch.setattr(backends, "_builtins", Once())
    yield
    for name in [m for m in sys.modules if m.startswith("gemmtune.backends.toygroup")]:
        del sys.modules[name]


def test_a_module_dropped_into_a_family_folder_is_discovered(tmp_path, monkeypatch, fresh_registry):
    group = tmp_path / "toygroup"
    group.mkdir()
    (group / "__init__.py").write_text('"""A toy family group."""\n')
    (group / "pytorch.py").write_text(textwrap.dedent(_TOY))
    (group / "policy.py").write_text(
        "from .pytorch import NATIVE\n\nPOLICIES = {'toyfam': lambda key, device: ('torch', NATIVE)}\n"
    )
    (group / "triton.py").write_text("import a_library_nobody_installed  # noqa: F401\n\nBACKENDS = ()\n")
    monkeypatch.setattr(backends, "__path__", [*backends.__path__, str(tmp_path)])

    assert "gemmtune.backends.toygroup.pytorch" in backends.group_modules()
    assert not any(".lib." in m for m in backends.group_modules())  # shared machinery declares no backends
    toy = backends.get("torch", "toyfam")
    assert type(toy).__name__ == "ToyBackend" and "toyfam" in backends.families_with_backends()
    backend, sol = backends.default("toyfam", (1,), CPU_DEV)
    assert backend is toy and sol.kernel_name == "native"
    # a module whose optional dependency is missing leaves its backends out, with the reason
    assert backends.import_errors()["toygroup/triton"] == "missing dependency: a_library_nobody_installed"
    assert backends.get("torch", "a16w16") is not None  # the builtins load beside it


def test_every_builtin_family_with_backends_has_a_policy():
    for fam in backends.families_with_backends():
        assert fam in backends._policies, fam


def test_without_triton_every_policy_still_loads():
    """Triton is optional: without it only Triton's backend modules drop out; every family keeps its policy
    (a policy that imports a Triton helper at the top would drop the family to a backend default)."""
    import json
    import subprocess

    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError
        import json
        from gemmtune import backends
        backends.families_with_backends()
        print(json.dumps({"errors": backends.import_errors(), "policies": sorted(backends._policies)}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["errors"] and all(v == "missing dependency: triton" for v in got["errors"].values()), got
    assert not [m for m in got["errors"] if m.endswith("/policy")], got["errors"]
    assert {"a8w8", "a8w8_blockscale"} <= set(got["policies"]), got["policies"]


def test_a_family_without_a_policy_falls_back_to_a_backend_default(fresh_registry):
    class Plain(_Probe):
        name, family = "torch", "nopolicy"

        def default_solution(self, key, device):
            return Solution("torch", "plain", 0)

    backends.register(Plain(Needs()))
    backend, sol = backends.default("nopolicy", (1,), CPU_DEV)
    assert backend.name == "torch" and sol.kernel_name == "plain"
    with pytest.raises(LookupError, match="nofamily"):
        backends.default("nofamily", (1,), CPU_DEV)


# ---- untuned defaults name what runs --------------------------------------------------------------
def _default(family, key, device=CPU_DEV) -> tuple[str, str]:
    backend, sol = backends.default(family, key, device)
    assert backend.name == sol.libtype, (backend.name, sol)  # the row names the backend that runs it
    return sol.libtype, sol.kernel_name


@pytest.mark.parametrize(
    "key, want",
    [
        (QuantKey(8, 4096, 4096, torch.int8), ("skinny", "a8w8_skinny_dot_bn64_bk512_sk2_w4_s3_fx_pdl2")),
        (QuantKey(1024, 4096, 4096, torch.int8), ("triton", "a8w8_tg_bm128_bn128_bk128_g8_w8_s3_sk1_tma")),
        (QuantKey(1024, 4096, 4096, FP8), ("torch", "scaled_mm")),
    ],
    ids=["decode-int8", "prefill-int8", "prefill-fp8"],
)
def test_a8w8_default_names_the_kernel_that_runs_on_an_nvidia_gpu(as_gpu, key, want):
    as_gpu(NVIDIA)
    assert _default("a8w8", key) == want
    assert _default("a8w8_bpreshuffle", key) == want


def test_a8w8_default_off_a_gpu_is_torch_and_runs_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from gemmtune.backends.quantized import triton as qtriton
    from gemmtune.dispatch import get_dispatcher

    key = QuantKey(8, 48, 64, torch.int8, "per_token", True, torch.float32)
    assert _default("a8w8", key) == ("torch", "dequant")
    # a torch row (here the untuned default) never reaches a Triton launcher
    monkeypatch.setattr(qtriton, "a8w8_launch", lambda *a: pytest.fail("a torch row ran a Triton kernel"))
    res = get_dispatcher().resolve(key, CPU_DEV, "a8w8")
    assert res.row is None and res.solution.describe() == "torch:dequant"
    assert "-> torch:dequant" in res.describe()


def test_fmoe_default_names_the_triton_glue_where_triton_runs(monkeypatch):
    from gemmtune.backends.fmoe import stages, triton

    key = MoeKey(64, 32, 16, 4, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    if not stages.grouped_mm_fits(key, CPU_DEV):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _default("fmoe", key) == ("torch", "grouped_mm|grouped_mm")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton runs here now: its sort, activation and combine
    assert _default("fmoe", key) == ("triton", triton.GROUPED_MM_GLUED.kernel_name)


def test_fmoe_torch_grouped_mm_pair_runs_no_triton_kernel(monkeypatch):
    """The torch backend's grouped_mm pair keeps its glue in torch ops even where Triton runs."""
    from gemmtune.backends.fmoe import pytorch as mto
    from gemmtune.backends.fmoe import stages
    from gemmtune.families.fmoe import FAMILY
    from gemmtune.kernels import fused_moe, moe_route

    key = MoeKey(64, 32, 16, 4, 2, dtype=torch.float32, q_dtype_a=torch.float32, q_dtype_w=torch.float32)
    if not stages.grouped_mm_fits(key, CPU_DEV):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def boom(*args, **kwargs):
        pytest.fail("a torch row ran a Triton kernel")

    for mod, name in ((fused_moe, "combine"), (moe_route, "expert_sort"), (stages, "act_mul")):
        monkeypatch.setattr(mod, name, boom)
    (inputs,) = FAMILY.make_inputs(key, CPU_DEV, 1, seed=3)
    y = mto.TorchMoeBackend().make_runner(mto.GROUPED_MM, key, CPU_DEV)(*inputs)
    ref = FAMILY.reference(key, inputs)
    assert ((y.float() - ref).norm() / ref.norm()).item() < FAMILY.error_threshold(key)


def test_simple_families_default_to_torch():
    from gemmtune.families.batched import BatchedKey
    from gemmtune.keys import GemmKey

    assert _default("a16w16", GemmKey(8, 64, 64)) == ("torch", "native")
    assert _default("batched", BatchedKey(2, 8, 16, 32)) == ("torch", "native")


def test_gpu_vendors_never_change_where_torch_defaults_run(as_gpu):
    """The policies' Triton choices are NVIDIA-measured: on ROCm an untuned int8 decode key stays torch."""
    as_gpu(AMD)
    assert _default("a8w8", QuantKey(8, 4096, 4096, torch.int8)) == ("torch", "dequant")
