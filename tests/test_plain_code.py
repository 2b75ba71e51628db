"""gemmtune's code is the code a reader sees: no module builds functions from source at run time, and
every public op's function is defined in its module's file.

Every call of exec / eval / compile (the builtins, also through `builtins.`) in src/gemmtune is found
from the modules' syntax trees, so `model.eval()` or `torch.compile(...)` do not count and a call
cannot hide in a string or a comment.
"""

from __future__ import annotations

import ast
import inspect
import sys
from pathlib import Path

import gemmtune
from gemmtune.ops import registry

SRC = Path(gemmtune.__file__).parent
CODE_BUILDERS = {"exec", "eval", "compile"}
# Where a module must build code, and why: each entry is checked to be still needed.
ALLOWED = {
    # flex_attention's score/mask mods with the value a constant of the code, not a closure cell
    # (torch.compile makes a closure's float symbolic after two values; see _baked's doc).
    "models/flex.py": ["compile", "exec"],
}


def code_builder_calls(source: str) -> list[str]:
    """'line: name' for each call of a code-building builtin in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id in CODE_BUILDERS:
            found.append(f"{node.lineno}: {f.id}")
        elif (isinstance(f, ast.Attribute) and f.attr in CODE_BUILDERS and isinstance(f.value, ast.Name)
              and f.value.id in ("builtins", "__builtins__")):  # fmt: skip
            found.append(f"{node.lineno}: {f.value.id}.{f.attr}")
    return found


def test_the_check_finds_the_builtins_and_only_them():
    source = (
        "exec(compile(src, 'f', 'exec'), ns)\n"
        "y = eval('1 + 1')\n"
        "import builtins\nbuiltins.exec('pass')\n"
        "model.eval()\ntorch.compile(fn)\nre.compile('x')\n"
        "text = 'exec(src)'  # exec(src)\n"
    )
    assert sorted(code_builder_calls(source)) == ["1: compile", "1: exec", "2: eval", "4: builtins.exec"]


def test_no_module_of_gemmtune_builds_code_at_run_time():
    modules = sorted(SRC.rglob("*.py"))
    assert len(modules) > 50 and SRC / "ops" / "gemm.py" in modules  # the package itself, every folder of it
    found = {
        str(p.relative_to(SRC)): calls for p in modules if (calls := code_builder_calls(p.read_text(encoding="utf-8")))
    }
    builders = {path: sorted(call.partition(": ")[2] for call in calls) for path, calls in found.items()}
    assert builders == ALLOWED, f"exec/eval/compile builds code at {found}; allowed: {ALLOWED}"


def test_every_public_op_is_defined_in_its_modules_file():
    entries = [e for e in registry.public_ops() if e.fn.__module__.startswith("gemmtune.")]
    assert {"gemm", "fused_moe", "gemm_a8w8_blockscale"} <= {e.name for e in entries}
    for e in entries:
        module_file = Path(sys.modules[e.fn.__module__].__file__)
        assert Path(inspect.getsourcefile(e.fn)) == module_file, e.name
        assert inspect.getsource(e.fn).lstrip().startswith(("@", "def ")), e.name
