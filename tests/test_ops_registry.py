"""The public ops as declared (ops/registry.py) and the pieces they share (ops/hot_path.py).

Every public op and helper is declared with its custom op and family; gemmtune.__all__, gemmtune.ops,
tuned_gemm's aiter names and profiling's GEMM op list are read from the declarations and stay the public
API they were. An op written with OpCache, public_op and custom_op is declared as it is, validates once
per signature, and runs as its custom op under torch.compile.
"""

from __future__ import annotations

import functools

import pytest
import torch

import gemmtune
from gemmtune.dispatch import get_dispatcher
from gemmtune.ops import registry
from gemmtune.ops.hot_path import OpCache, custom_op, public_op

# name: (the gemmtune:: custom op it runs as, its GEMM family); None where it has none
DECLARED = {
    "gemm": ("gemmtune::gemm", "a16w16"),
    "batched_gemm": ("gemmtune::batched_gemm", "batched"),
    "batched_gemm_a8w8": ("gemmtune::batched_gemm_a8w8", "batched_a8w8"),
    "gemm_epilogue": ("gemmtune::gemm_epilogue", "epilogue"),
    "gemm_bias": ("gemmtune::gemm_epilogue", "epilogue"),
    "gemm_gelu": ("gemmtune::gemm_epilogue", "epilogue"),
    "gemm_relu": ("gemmtune::gemm_epilogue", "epilogue"),
    "cutlass_gemm": ("gemmtune::gemm_epilogue", "epilogue"),
    "gemm_a8w8": ("gemmtune::gemm_a8w8", "a8w8"),
    "int8_gemm": ("gemmtune::gemm_a8w8", "a8w8"),
    "gemm_a8w8_bpreshuffle": ("gemmtune::gemm_a8w8_bpreshuffle", "a8w8_bpreshuffle"),
    "gemm_a8w8_blockscale": ("gemmtune::gemm_a8w8_blockscale", "a8w8_blockscale"),
    "gemm_a8w8_blockscale_bpreshuffle": ("gemmtune::gemm_a8w8_blockscale_bpreshuffle", "a8w8_blockscale_bpreshuffle"),
    "sparse_gemm": ("gemmtune::sparse_gemm", "sparse"),
    "prune_2_4": (None, "sparse"),
    "fused_moe": ("gemmtune::fused_moe", "fmoe"),
    "grouped_gemm": ("gemmtune::grouped_gemm", "fmoe"),
    "prepare_expert_weights": (None, "fmoe"),
    "softcap_attention": ("gemmtune::softcap_attention", None),
}

# The public API as it stood before the ops were declared: a pin, not a copy of the code's list.
GEMMTUNE_ALL = [
    "ConfigTable", "GemmKey", "batched_gemm", "batched_gemm_a8w8", "check_tables_agree", "cutlass_gemm", "fused_moe",
    "gemm", "gemm_a8w8", "gemm_a8w8_blockscale", "gemm_a8w8_blockscale_bpreshuffle", "gemm_a8w8_bpreshuffle",
    "gemm_bias", "gemm_epilogue", "gemm_gelu", "gemm_relu", "get_dispatcher", "grouped_gemm", "int8_gemm",
    "load_config", "load_fp8_checkpoint", "optimize", "prepare_expert_weights", "profile", "prune_2_4", "resolve",
    "restore", "set_capture", "set_config", "set_online_tuning", "softcap_attention", "sparse_gemm", "sync_online_rows",
    "tuned_gemm",
]  # fmt: skip
TUNED_GEMM_NAMES = [
    "annotations", "cutlass_gemm", "gemm", "gemm_a16w16", "gemm_a8w8", "gemm_a8w8_blockscale",
    "gemm_a8w8_blockscale_bpreshuffle", "gemm_a8w8_bpreshuffle", "gemm_bias", "gemm_gelu", "gemm_relu", "int8_gemm",
    "shuffle_weight", "sparse_gemm", "torch",
]  # fmt: skip


def _gemmtune_entries() -> dict[str, registry.PublicOp]:
    """The declarations of gemmtune's own modules (a test may declare a toy op of its own)."""
    return {e.name: e for e in registry.public_ops() if e.fn.__module__.startswith("gemmtune.")}


def test_registry_declares_every_public_op_with_its_custom_op_and_family():
    entries = _gemmtune_entries()
    assert {n: (e.custom_op, e.family) for n, e in entries.items()} == DECLARED
    for e in entries.values():
        if e.custom_op is not None:
            assert hasattr(torch.ops.gemmtune, e.custom_op.removeprefix("gemmtune::")), e.custom_op
        assert getattr(gemmtune, e.name) is e.fn


def test_gemmtune_all_and_tuned_gemm_names_unchanged():
    assert sorted(gemmtune.__all__) == sorted(GEMMTUNE_ALL)
    assert len(gemmtune.__all__) == len(set(gemmtune.__all__))
    assert sorted(n for n in dir(gemmtune.tuned_gemm) if not n.startswith("_")) == TUNED_GEMM_NAMES
    for alias, fn in registry.aiter_exports().items():
        assert getattr(gemmtune.tuned_gemm, alias) is fn


def test_ops_package_exports_the_declarations():
    assert set(gemmtune.ops.__all__) == set(_gemmtune_entries()) | {"key_of", "validate"}
    assert gemmtune.ops.gemm is gemmtune.gemm  # the op, as before; its module stays in sys.modules


def test_profiling_gemm_ops_are_the_declared_gemm_custom_ops():
    from gemmtune.profiling.categorize import GEMM_OPS, Frame, frame_category

    ours = {op for op in GEMM_OPS if op.startswith("gemmtune::")}
    assert ours == {op for op, fam in DECLARED.values() if op is not None and fam is not None}
    assert ours <= registry.gemm_custom_ops()
    assert frame_category(Frame("gemmtune::gemm")) == "gemm"
    assert frame_category(Frame("gemmtune::fused_moe")) == "gemm"
    assert "gemmtune::softcap_attention" not in GEMM_OPS


# ---- hot_path's pieces on a toy op ----------------------------------------------------------------
TOY = "toy_scale_for_tests"


@functools.cache
def _toy():
    """The toy op, built once per process (its custom op is registered for good) and what it was asked."""
    seen = {"validate": 0, "bind": [], "grad": []}

    def signature(x, scale, exact):
        return (x.shape, x.dtype, x.device, exact)

    def validate(x, scale, exact):
        seen["validate"] += 1
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{TOY}: x must be a tensor, got {type(x).__name__}")

    def bind(x, scale, exact):
        seen["bind"].append(exact)
        seen["grad"].append(torch.is_grad_enabled())
        return lambda x, scale: x * scale

    def fake(x, scale):
        return torch.empty_like(x)

    cache = OpCache(TOY, family=TOY, validate=validate, bind=bind)

    @public_op(cache)
    def toy_scale_for_tests(x: torch.Tensor, scale: float = 2.0, *, exact: bool = True) -> torch.Tensor:
        """x * scale (a toy op of the tests)."""
        if torch.compiler.is_compiling():
            return torch.ops.gemmtune.toy_scale_for_tests(x, scale)
        try:
            call = cache.get(sig := signature(x, scale, exact))
        except (AttributeError, TypeError):
            cache.reject(x, scale, exact)
            raise
        if call is None:
            call = cache.miss(sig, x, scale, exact)
        return call(x, scale)

    @custom_op(cache, fake=fake)
    def _toy_op(x: torch.Tensor, scale: float) -> torch.Tensor:
        return toy_scale_for_tests(x, scale, exact=False)

    return toy_scale_for_tests, _toy_op, seen


def test_public_op_declares_the_function_as_it_is_with_its_custom_op():
    op, custom, _ = _toy()
    assert op.__doc__ == "x * scale (a toy op of the tests)." and op.__name__ == TOY
    assert op.__defaults__ == (2.0,) and op.__kwdefaults__ == {"exact": True}
    entry = registry.entry(TOY)
    assert (entry.fn, entry.custom_op, entry.family) == (op, f"gemmtune::{TOY}", TOY)
    assert custom is getattr(torch.ops.gemmtune, TOY)
    assert str(custom.default._schema) == f"gemmtune::{TOY}(Tensor x, float scale) -> Tensor"


def test_op_cache_validates_once_per_signature_and_names_a_bad_argument():
    op, _, seen = _toy()
    get_dispatcher().clear_cache()
    before = seen["validate"]
    x = torch.arange(4.0)
    for _ in range(3):
        assert torch.equal(op(x, 3.0), x * 3)
    assert seen["validate"] == before + 1  # the miss; the two hits are the memo's
    assert len(get_dispatcher().cache(TOY)) == 1
    get_dispatcher().clear_cache()  # a new config: the memo goes with the runners
    op(x)
    assert seen["validate"] == before + 2
    with pytest.raises(TypeError, match=f"{TOY}: x must be a tensor, got list"):
        op([1.0, 2.0])
    with pytest.raises(TypeError, match="unhashable"):  # validate passes: the signature's own error
        op(x, exact=[True])


def test_custom_op_runs_the_eager_function_under_compile_without_grad():
    op, custom, seen = _toy()
    get_dispatcher().clear_cache()
    seen["bind"].clear()
    seen["grad"].clear()
    x = torch.arange(6.0).reshape(2, 3)
    compiled = torch.compile(lambda t: op(t, 0.5), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), x * 0.5)
    assert seen["bind"] == [False]  # the custom op's body ran the eager function with exact=False
    assert seen["grad"] == [False]  # and without grad: the op's autograd is the op's own
    assert torch.equal(custom(x, 2.0), x * 2)


def test_public_op_refuses_a_function_of_another_name():
    cache = OpCache("toy_named_for_tests", family=TOY, validate=len, bind=len)

    def other(x):
        """not the cache's op"""

    with pytest.raises(TypeError, match="public_op: other is declared with the cache of toy_named_for_tests"):
        public_op(cache)(other)
    assert "other" not in {e.name for e in registry.public_ops()}
