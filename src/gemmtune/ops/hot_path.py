"""One builder for every public op: its eager hot path, its custom op (torch.compile, export) and its
entry in the registry. An op module states only what differs per op and decorates its prototype:

    @public_op(family="a16w16", signature=_signature, validate=validate, bind=_bind, call=("x", "w", "bias"),
               fake=_fake, autograd=(_backward, _setup_context))
    def gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, ...) -> torch.Tensor:
        # the public docstring; no body: the decorator writes it

- signature(*args) -> a hashable tuple of everything validate() depends on: a signature found in the
  cache was validated when first seen. Arguments come in the prototype's order, keyword-only ones too.
- validate(*args) raises naming the bad argument: on a miss, and when the signature cannot be built from
  the arguments (a non-tensor, an unhashable value).
- bind(*args) -> the call to cache for this signature, after validate: usually the family's runner from
  `get_dispatcher().runner_for(key, ...)`, or a closure making the views that runner takes.
- call: the names of the arguments the cached call takes (default: all of them, in order).
- fake(*op_args) -> the output's empty tensor when torch.compile traces the custom op.
- op_params: the prototype's parameters the custom op takes, in its schema's order (default: all), each
  "name" or "schema_name=name" where the schema spells it otherwise; the others are given `op_fixed`'s
  value (else their default) when the custom op runs the eager function.

The eager function runs: under torch.compile, the custom op `gemmtune::<name>`; else
signature -> one dict lookup in the family's runner cache -> the cached call, and on a miss
validate -> bind -> store. It is generated with the prototype's own parameter list, so the public
signature, defaults and docstring are the prototype's and a call costs what a hand-written one does:
no *args packing, one frame for the signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

import torch

from ..dispatch import get_dispatcher
from . import registry

# The eager function and the custom op's body, generated together: each calls the other through a closure.
_TEMPLATE = """\
def _factory(_is_compiling, _signature, _get, _validate, _miss, _no_grad, _finish, _register, {fixed}):
    def {name}({params}):
        if _is_compiling():
            return _op({op_args})
        try:
            sig = _signature({args})
            call = _get(sig)
        except (AttributeError, TypeError):  # a non-tensor (or unhashable) argument: validate names it
            _validate({args})
            raise
        if call is None:
            call = _miss(sig, {args})
        return call({call_args})

    def _custom_op_body({op_schema}):
        with _no_grad():  # the op's autograd, where it has one, is registered on the op
            return {op_result}

    _op = _register(_custom_op_body)
    return {name}
"""

_RESERVED = {"sig", "call"}  # locals of the generated eager function


def _parameters(prototype: Callable) -> tuple[list[str], list[str]]:
    """(positional names, keyword-only names) of a prototype without *args / **kwargs."""
    positional, keyword_only = [], []
    for p in inspect.signature(prototype).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"public_op: {prototype.__name__}'s parameter {p.name} must be a plain or keyword-only one")
        if p.name.startswith("_") or p.name in _RESERVED:
            raise TypeError(f"public_op: {prototype.__name__}'s parameter name {p.name!r} is reserved")
        (keyword_only if p.kind == p.KEYWORD_ONLY else positional).append(p.name)
    return positional, keyword_only


def _schema_names(op_params: Sequence[str]) -> list[tuple[str, str]]:
    """[(parameter, its name in the custom op's schema)] from "name" / "schema_name=name" entries."""
    pairs = []
    for entry in op_params:
        schema_name, _, param = entry.rpartition("=")
        pairs.append((param, schema_name or param))
    return pairs


def public_op(
    *,
    family: str,
    signature: Callable,
    validate: Callable,
    bind: Callable,
    fake: Callable,
    call: Sequence[str] | None = None,
    op_params: Sequence[str] | None = None,
    op_fixed: Mapping[str, object] | None = None,
    autograd: tuple[Callable, Callable] | None = None,
    finish: Callable | None = None,
    cache: str | None = None,
    aiter_names: Sequence[str] = (),
) -> Callable[[Callable], Callable]:
    """Build the public op from its prototype (see the module doc). autograd: (backward, setup_context)
    registered on the custom op; finish: applied to the eager result inside the custom op (e.g. making
    a view a fresh tensor); cache: the dispatcher's runner cache (default the family's); aiter_names:
    the op's names in aiter's tuned_gemm (gemmtune.tuned_gemm re-exports it under them)."""

    def build(prototype: Callable) -> Callable:
        name = prototype.__name__
        positional, keyword_only = _parameters(prototype)
        params = [*positional, *keyword_only]
        schema = dict(_schema_names(params if op_params is None else op_params))  # {parameter: its schema name}
        in_op = list(schema)
        cached_call = list(params if call is None else call)
        unknown = sorted(set(in_op + cached_call + list(op_fixed or ())) - set(params))
        if unknown:
            raise TypeError(f"public_op: {name} has no parameter(s) {', '.join(unknown)}")
        if {schema[p] for p in in_op if schema[p] != p} & set(params):
            raise TypeError(f"public_op: {name}'s schema names {schema} reuse another parameter's name")
        declared = inspect.signature(prototype, eval_str=True).parameters
        # What the custom op's body passes for the parameters its schema lacks (fused_moe's check_ids).
        fixed = {p: (op_fixed or {}).get(p, declared[p].default) for p in params if p not in schema}

        def register(body: Callable):
            body.__annotations__ = {schema[p]: declared[p].annotation for p in in_op} | {"return": torch.Tensor}
            body.__module__ = prototype.__module__
            opdef = torch.library.custom_op(f"gemmtune::{name}", body, mutates_args=())
            opdef.register_fake(fake)
            if autograd is not None:
                opdef.register_autograd(autograd[0], setup_context=autograd[1])
            return getattr(torch.ops.gemmtune, name)

        runners = get_dispatcher().cache(cache or family)  # cleared in place by the dispatcher, never rebound

        def miss(sig, *args):
            validate(*args)
            bound = bind(*args)
            runners[sig] = bound
            return bound

        def arg(p: str) -> str:
            return schema[p] if p in schema else f"_fixed_{p}"

        eager_call = f"{name}({', '.join([arg(p) for p in positional] + [f'{p}={arg(p)}' for p in keyword_only])})"
        source = _TEMPLATE.format(
            name=name,
            params=", ".join([*positional, *(["*", *keyword_only] if keyword_only else [])]),
            op_args=", ".join(in_op),
            op_schema=", ".join(schema[p] for p in in_op),
            args=", ".join(params),
            call_args=", ".join(cached_call),
            op_result=f"_finish({eager_call})" if finish is not None else eager_call,
            fixed=", ".join(f"_fixed_{p}" for p in fixed) or "_unused=None",
        )
        namespace: dict = {}
        exec(compile(source, f"<gemmtune.{name}: ops/hot_path.py template>", "exec"), namespace)  # noqa: S102
        eager = namespace["_factory"](
            _is_compiling=torch.compiler.is_compiling, _signature=signature, _get=runners.get, _validate=validate,
            _miss=miss, _no_grad=torch.no_grad, _finish=finish, _register=register,
            **{f"_fixed_{p}": v for p, v in fixed.items()},
        )  # fmt: skip
        _copy_surface(prototype, eager)
        registry.record(eager, custom_op=f"gemmtune::{name}", family=family, aiter_names=tuple(aiter_names))
        return eager

    return build


def _copy_surface(prototype: Callable, eager: Callable) -> None:
    """The public face of the prototype: names, docstring, defaults, annotations."""
    for attr in ("__module__", "__name__", "__qualname__", "__doc__", "__defaults__", "__kwdefaults__"):
        setattr(eager, attr, getattr(prototype, attr))
    eager.__annotations__ = dict(prototype.__annotations__)


def spelling_of(op: Callable, *, aiter_names: Sequence[str] = ()) -> Callable[[Callable], Callable]:
    """Declare a public function that only re-spells `op` (gemm_bias of gemm_epilogue): it runs as op's
    custom op and reads op's family's tables."""

    def record(fn: Callable) -> Callable:
        entry = registry.entry(op.__name__)
        return registry.record(fn, custom_op=entry.custom_op, family=entry.family, aiter_names=tuple(aiter_names))

    return record


def public_helper(*, family: str | None) -> Callable[[Callable], Callable]:
    """Declare a public function of an op module that is no op (prune_2_4, prepare_expert_weights)."""
    return lambda fn: registry.record(fn, custom_op=None, family=family)
