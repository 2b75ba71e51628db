"""A GEMM family added from outside gemmtune: a plugin package written into a temp folder (a family spec
module, an op module written with ops.hot_path's OpCache, one backend module with two solutions and a policy)
whose only link into gemmtune is one registration line, imported through GEMMTUNE_PLUGINS.

With nothing else edited, the family's op runs eagerly and under torch.compile, capture records its
shapes into its own file, `gemmtune tune` tunes them on the CPU, the table loads back (its family
detected from its header), `gemmtune show-config` describes it, and the dispatcher serves its rows and,
without a table, the family's policy. A fresh process that never imports the plugin or the tuner itself
loads a table of the family (GEMMTUNE_CONFIG_TOY or set_config) and runs the op: plugins load at runtime.
The registries are restored afterwards, so nothing of the toy family reaches other tests.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from gemmtune import backends, dispatch, families, plugins
from gemmtune.capture import capture_path, read_shape_list
from gemmtune.cli.main import cli
from gemmtune.configs.table import read_table_file
from gemmtune.device import identity
from gemmtune.errors import EnvVarError
from gemmtune.ops import registry

PLUGIN = "gemmtune_toy_plugin"
FAMILY = "toy"
CPU = torch.device("cpu")

PACKAGE = {
    "__init__.py": '''
        """A toy GEMM family as a gemmtune plugin: y[M, N] = (x[M, K] @ w[N, K]^T) * s[N]."""

        from gemmtune.backends import register_family

        from . import backend, family, op  # noqa: F401 - the op declares itself (public_op)

        register_family(family.FAMILY, backend)
    ''',
    "family.py": '''
        """The toy family's spec: key, table columns, env var, reference, inputs, roofline."""

        from typing import NamedTuple

        import torch

        from gemmtune.families.base import Family, dtype_col, generator, int_col, inv_sqrt, randn


        class ToyKey(NamedTuple):
            M: int
            N: int
            K: int
            dtype: torch.dtype = torch.float32
            s_dtype: torch.dtype = torch.float32  # the row scales' dtype: the column only this family has


        class Toy(Family):
            name = "toy"
            description = "row-scaled GEMM y = (x @ w^T) * s (toy_gemm), a test's plugin family"
            ops = ("toy_gemm",)
            env_var = "GEMMTUNE_CONFIG_TOY"
            key_type = ToyKey
            key_columns = (int_col("M"), int_col("N"), int_col("K"), dtype_col("dtype", default=torch.float32),
                           dtype_col("s_dtype", default=None))
            tuned_columns = ("gfx", "cu_num", "M", "N", "K", "dtype", "s_dtype", "libtype", "solidx", "splitK", "us",
                             "kernelName", "err_ratio", "tflops", "bw")
            untuned_columns = ("M", "N", "K", "dtype", "s_dtype")
            signature = frozenset({"M", "N", "K", "s_dtype"})

            def out_dtype(self, key):
                return key.dtype

            def make_inputs(self, key, device, sets, seed):
                gen = generator(device, seed)
                return [(randn((key.M, key.K), device, gen, key.dtype),
                         randn((key.N, key.K), device, gen, key.dtype, inv_sqrt(key.K)),
                         randn((key.N,), device, gen, key.s_dtype)) for _ in range(sets)]

            def reference(self, key, inputs):
                x, w, s = inputs
                return (x.double() @ w.double().t() * s.double()).float()

            def output_shape(self, key):
                return (key.M, key.N)

            def bytes(self, key):
                return (key.M * key.K + key.N * key.K + key.M * key.N) * key.dtype.itemsize

            def flops(self, key):
                return 2 * key.M * key.N * key.K


        FAMILY = Toy()
    ''',
    "op.py": '''
        """toy_gemm(x, w, s): the toy family's public op, dispatched per key to its tuned solution."""

        import torch

        from gemmtune.dispatch import get_dispatcher
        from gemmtune.ops.hot_path import OpCache, custom_op, public_op

        from .family import ToyKey


        def _signature(x, w, s):
            return (x.shape, w.shape, s.shape, x.dtype, w.dtype, s.dtype, x.device, w.device, s.device)


        def _validate(x, w, s):
            for name, t in (("x", x), ("w", w), ("s", s)):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"toy_gemm: {name} must be a tensor, got {type(t).__name__}")
            if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or s.shape != (w.shape[0],):
                raise ValueError(f"toy_gemm: shapes x {tuple(x.shape)}, w {tuple(w.shape)}, s {tuple(s.shape)}")
            if x.dtype != w.dtype or not (x.device == w.device == s.device):
                raise ValueError("toy_gemm: x and w must share a dtype, and all three a device")


        def _bind(x, w, s):
            key = ToyKey(x.shape[0], w.shape[0], x.shape[1], x.dtype, s.dtype)
            return get_dispatcher().runner_for(key, x.device, family="toy")


        def _fake(x, w, s):
            return x.new_empty((x.shape[0], w.shape[0]))


        _cache = OpCache("toy_gemm", family="toy", validate=_validate, bind=_bind)


        @public_op(_cache)
        def toy_gemm(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            """y[M, N] = (x[M, K] @ w[N, K]^T) * s[N], the toy family's tuned solution."""
            if torch.compiler.is_compiling():
                return torch.ops.gemmtune.toy_gemm(x, w, s)
            try:
                call = _cache.get(sig := _signature(x, w, s))
            except (AttributeError, TypeError):  # a non-tensor argument: validate names it
                _cache.reject(x, w, s)
                raise
            if call is None:
                call = _cache.miss(sig, x, w, s)
            return call(x, w, s)


        @custom_op(_cache, fake=_fake)
        def _toy_gemm_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            return toy_gemm(x, w, s)
    ''',
    "backend.py": '''
        """The toy family's `torch` backend (two solutions) and its policy (what an untuned key runs)."""

        import collections

        import torch

        from gemmtune.backends.base import Backend, Solution, stable_solidx

        CALLS = collections.Counter()  # runs per kernel name: which runner the op really called

        FUSED = Solution("torch", "fused", stable_solidx("fused"))
        ROW_LOOP = Solution("torch", "row_loop", stable_solidx("row_loop"))  # one matvec per row: extra work
        SOLUTIONS = (FUSED, ROW_LOOP)


        def _fused(x, w, s):
            CALLS["fused"] += 1
            return (x @ w.t() * s).to(x.dtype)


        def _row_loop(x, w, s):
            CALLS["row_loop"] += 1
            return (torch.stack([w @ row for row in x]) * s).to(x.dtype)


        class ToyTorchBackend(Backend):
            name = "torch"
            family = "toy"

            def candidates(self, key, device):
                return list(SOLUTIONS)

            def solution_from_row(self, solidx, kernel_name, splitk):
                return next((s for s in SOLUTIONS if s.kernel_name == kernel_name), None)

            def supports(self, solution, key, device):
                return solution in SOLUTIONS and key.dtype.is_floating_point

            def make_runner(self, solution, key, device):
                return _fused if solution == FUSED else _row_loop


        def policy(key, device):
            return "torch", FUSED


        BACKENDS = (ToyTorchBackend(),)
        POLICIES = {"toy": policy}
    ''',
}


def write_plugin(root) -> None:
    package = root / PLUGIN
    package.mkdir()
    for name, text in PACKAGE.items():
        (package / name).write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")


def _registries() -> list:
    """The process-wide registries a plugin adds to (loaded first, so a restore keeps the builtins)."""
    families.all_families()
    backends.all_backends()
    d = dispatch.get_dispatcher()
    return [families._REGISTRY, backends._registry, backends._policies, registry._recorded, plugins._imported,
            plugins._failed, d._caches]  # fmt: skip


def _restore(saved: list) -> None:
    for live, before in saved:
        live.clear()
        live.update(before)


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The plugin, loaded through GEMMTUNE_PLUGINS by the first family look-up; every registry restored after.
    Its custom op gemmtune::toy_gemm stays defined in torch (no public API drops one); no test names it."""
    root = tmp_path_factory.mktemp("plugin")
    write_plugin(root)
    saved = [(live, live.copy()) for live in _registries()]
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        mp.setenv(plugins.PLUGINS_ENV, PLUGIN)
        assert PLUGIN not in sys.modules
        fam = families.get(FAMILY)  # unknown to gemmtune: the registry imports GEMMTUNE_PLUGINS
        assert PLUGIN in sys.modules
        yield SimpleNamespace(root=root, family=fam, op=registry.entry("toy_gemm").fn,
                              key_type=sys.modules[f"{PLUGIN}.family"].ToyKey,
                              backend=sys.modules[f"{PLUGIN}.backend"])  # fmt: skip
    dispatch.get_dispatcher().clear_cache()
    _restore(saved)
    for name in [m for m in sys.modules if m == PLUGIN or m.startswith(PLUGIN + ".")]:
        del sys.modules[name]


def inputs(toy, key, seed: int = 0):
    return toy.family.make_inputs(key, CPU, 1, seed)[0]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def test_one_call_registers_the_family_its_backend_policy_and_op(toy):
    assert toy.family.name == FAMILY and toy.family in families.all_families()
    assert backends.get("torch", FAMILY) is toy.backend.BACKENDS[0]
    key = toy.key_type(8, 16, 32)
    backend, sol = backends.default(FAMILY, key, CPU)
    assert (backend, sol) == (toy.backend.BACKENDS[0], toy.backend.FUSED)
    entry = registry.entry("toy_gemm")
    assert (entry.custom_op, entry.family) == ("gemmtune::toy_gemm", FAMILY)
    init = ast.parse(textwrap.dedent(PACKAGE["__init__.py"]))
    assert [ast.unparse(c) for c in ast.walk(init) if isinstance(c, ast.Call)] == [
        "register_family(family.FAMILY, backend)"
    ]  # the plugin's one registration line: its other modules only import what they build on


def test_toy_op_matches_its_reference_eagerly_and_under_compile(toy):
    key = toy.key_type(8, 24, 40)
    x, w, s = inputs(toy, key)
    ref = toy.family.reference(key, (x, w, s))
    y = toy.op(x, w, s)
    assert y.shape == (8, 24) and y.dtype == torch.float32 and rel_err(y, ref) < 1e-5
    compiled = torch.compile(lambda a, b, c: toy.op(a, b, c) + 1.0, fullgraph=True)
    assert rel_err(compiled(x, w, s) - 1.0, ref) < 1e-5
    with pytest.raises(ValueError, match=r"toy_gemm: shapes x \(8, 40\), w \(24, 40\), s \(3,\)"):
        toy.op(x, w, s[:3])


def test_untuned_key_runs_the_policy_default(toy):
    key = toy.key_type(4, 16, 32)
    res = dispatch.resolve(key, CPU, family=FAMILY)
    assert res.row is None and res.solution == toy.backend.FUSED
    assert "torch:fused [no tuned row]" in res.describe() and res.describe().startswith("toy M=4 N=16 K=32")
    before = toy.backend.CALLS["fused"]
    toy.op(*inputs(toy, key))
    assert toy.backend.CALLS["fused"] == before + 1


def test_capture_tune_show_config_and_dispatch_of_the_toy_family(toy, tmp_path):
    keys = [toy.key_type(4, 16, 32), toy.key_type(12, 16, 32), toy.key_type(6, 24, 8)]
    shapes = tmp_path / "shapes.csv"
    dispatch.set_capture(str(shapes))
    for key in keys:
        toy.op(*inputs(toy, key))
        toy.op(*inputs(toy, key, seed=1))
    dispatch.set_capture(None)  # flushes the counts
    captured = capture_path(str(shapes), toy.family)
    assert captured == str(tmp_path / "shapes.toy.csv") and not shapes.exists()
    fam, counted = read_shape_list(captured)  # the family from the header alone
    assert fam is toy.family and counted == [(k, 2) for k in keys]

    out = tmp_path / "tuned.csv"
    r = CliRunner().invoke(cli, ["tune", captured, "-o", str(out), "--no-progress", "--reps", "5"])
    assert r.exit_code == 0, r.output
    table = read_table_file(str(out))
    assert table.family is toy.family
    rows = {row.key: row for row in table.rows}
    assert list(rows) == keys
    assert all(row.libtype == "torch" and row.kernel_name in ("fused", "row_loop") for row in rows.values())
    assert all(row.gfx == identity(CPU).gfx for row in rows.values())

    shown = CliRunner().invoke(cli, ["show-config", str(out)])
    assert shown.exit_code == 0, shown.output
    assert f"{out}: toy table, 3 rows" in shown.output and "[toy] rows: 3 after merge" in shown.output

    dispatch.set_config(str(out))
    for key in keys:
        res = dispatch.resolve(key, CPU, family=FAMILY)
        assert res.row is not None and res.row.key == key
        assert res.solution.kernel_name == rows[key].kernel_name
        before = dict(toy.backend.CALLS)
        toy.op(*inputs(toy, key))
        assert toy.backend.CALLS[res.solution.kernel_name] == before.get(res.solution.kernel_name, 0) + 1
        assert sum(toy.backend.CALLS.values()) == sum(before.values()) + 1


SCRIPT = """
import sys

import torch

import gemmtune
from gemmtune import dispatch
from gemmtune.ops import registry

how, table = sys.argv[1:]
assert "{plugin}" not in sys.modules
store = gemmtune.set_config(table) if how == "set_config" else dispatch.get_dispatcher().store()
assert "{plugin}" in sys.modules and len(store.table("toy")) == 1
toy_gemm = registry.entry("toy_gemm").fn
ToyKey = sys.modules["{plugin}.family"].ToyKey
key = ToyKey(5, 12, 20)
fam = gemmtune.families.get("toy")
x, w, s = fam.make_inputs(key, torch.device("cpu"), 1, 0)[0]
y = toy_gemm(x, w, s)
err = float((y - fam.reference(key, (x, w, s))).norm() / fam.reference(key, (x, w, s)).norm())
res = dispatch.resolve(key, family="toy")
calls = sys.modules["{plugin}.backend"].CALLS
print(res.solution.kernel_name, res.row is not None, calls["row_loop"], calls["fused"], err < 1e-5,
      "gemmtune.tuner.runner" in sys.modules)
"""


@pytest.mark.parametrize("how", ["GEMMTUNE_CONFIG_TOY", pytest.param("set_config", marks=pytest.mark.slow)])
def test_a_fresh_process_loads_the_plugin_family_table_at_runtime(toy, tmp_path, how):
    ident = identity(CPU)
    table = tmp_path / "toy_table.csv"
    table.write_text(
        ",".join(toy.family.tuned_columns) + "\n"
        + f"{ident.gfx},{ident.cu_num},5,12,20,torch.float32,torch.float32,torch,{toy.backend.ROW_LOOP.solidx},0,"
        "3.5,row_loop,0,0,0\n"
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("GEMMTUNE_")}
    env[plugins.PLUGINS_ENV] = PLUGIN
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(toy.root), env.get("PYTHONPATH")]))
    if how == "GEMMTUNE_CONFIG_TOY":
        env[how] = str(table)
    script = SCRIPT.format(plugin=PLUGIN)
    p = subprocess.run([sys.executable, "-c", script, how, str(table)], env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    # the row's solution ran once, the default never; the op matched its reference; the tuner stayed out
    assert p.stdout.split() == ["row_loop", "True", "1", "0", "True", "False"], p.stdout


def test_a_plugin_that_fails_to_import_is_named_at_every_family_lookup(toy, monkeypatch):
    saved = [(plugins._failed, plugins._failed.copy())]
    monkeypatch.setenv(plugins.PLUGINS_ENV, "gemmtune_no_such_toy_plugin")
    try:
        errors = []
        for _ in range(2):
            with pytest.raises(EnvVarError) as info:
                families.get("no_such_family")
            errors.append(str(info.value))
        assert errors[0] == errors[1]
        assert "GEMMTUNE_PLUGINS 'gemmtune_no_such_toy_plugin': cannot import plugin module" in errors[0]
        assert families.get(FAMILY) is toy.family  # a family already known needs no plugin import
    finally:
        _restore(saved)
