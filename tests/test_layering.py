"""gemmtune's imports point one way: down the layer table, never in a cycle. Function-level imports count
too (a lazy import up the layers is still a dependency up the layers)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Each top-level module or subpackage of gemmtune and its layer, bottom first. A module may import a module
# of a lower layer, or one of its own package (tuner.search -> tuner.timing); two packages on one layer
# (configs, backends) never import each other. The package itself (gemmtune/__init__.py) is the top.
LAYERS = {
    "errors": 0,  # foundation: facts every layer may ask
    "checks": 0,  # the argument checks of every public function
    "keys": 0,
    "concurrency": 0,  # once-only initialization and fork handling for every lazy registry
    "settings": 1,  # every environment variable, parsed and validated in one place
    "device": 2,
    "plugins": 2,
    "child_process": 2,  # the processes gemmtune starts: its own entry point, never the caller's __main__
    "quant": 3,
    "kernels": 4,  # Triton kernels and their plain-PyTorch references
    "families": 5,  # one module per GEMM family: keys, schemas, references, default policy
    "configs": 6,  # the tuned tables
    "backends": 6,  # one module per (family, library)
    "capture": 7,  # shape capture, a sink the dispatcher writes to
    "dispatch": 8,  # key -> runner, with a miss hook installed from above
    "ops": 9,  # the public ops
    "tuned_gemm": 10,  # aiter's tuned_gemm names over the ops
    "model_types": 10,  # the architecture registry: each model type's layout and GEMM shapes (data, no ops)
    "tuner": 11,  # model -> shapes, timing, search, online tuning
    "models": 12,  # optimize(model)
    "profiling": 13,
    "doctor": 13,
    "cli": 14,
    "__main__": 15,  # python -m gemmtune: the command line
}


@dataclass(frozen=True)
class Edge:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    where: str  # file:line of the import

    def __str__(self) -> str:
        return f"{self.where}: {self.source} -> {self.target}"


def modules_of(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} of every module under src/package."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (path, is_pkg)
    return out


def import_edges(src: Path, package: str) -> list[Edge]:
    """Every import of a module of `package` by a module of `package`, at any depth of the file (module
    level, functions, branches), relative imports resolved, `from pkg import submodule` to the submodule."""
    mods = modules_of(src, package)

    def known(name: str) -> str:
        # `from .a import b` where b is a name inside a: the edge is to a (or the nearest module above it).
        while name not in mods and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    edges = []
    for mod, (path, is_pkg) in mods.items():
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            where = f"{path.relative_to(src.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names if a.name.split(".")[0] == package]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - node.level + 1]
                    origin = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    origin = node.module or ""
                if origin.split(".")[0] != package:
                    continue
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in mods else known(origin) for a in node.names]
            else:
                continue
            edges += [Edge(mod, t, where) for t in dict.fromkeys(targets) if t != mod]
    return edges


def cycles(edges: list[Edge]) -> list[list[str]]:
    """The import cycles: strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.source, []).append(e.target)
        graph.setdefault(e.target, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def unit_of(module: str) -> str:
    """The layer-table entry a module belongs to ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layering_violations(edges: list[Edge], layers: dict[str, int]) -> list[str]:
    """Imports that point up the table or sideways between units of one layer, and modules the table lacks."""
    top = max(layers.values()) + 1

    def layer(module: str) -> int | None:
        unit = unit_of(module)
        return top if unit == "" else layers.get(unit)

    out = []
    for e in edges:
        src_unit, dst_unit = unit_of(e.source), unit_of(e.target)
        src, dst = layer(e.source), layer(e.target)
        if src is None or dst is None:
            unplaced = e.source if src is None else e.target
            out.append(f"{e}: {unit_of(unplaced)!r} has no layer in LAYERS")
        elif dst > src or (dst == src and src_unit != dst_unit):
            out.append(f"{e}: up from {src_unit or 'gemmtune'} (layer {src}) to {dst_unit or 'gemmtune'} (layer {dst})")
    return sorted(set(out))


def cycle_report(edges: list[Edge]) -> list[str]:
    out = []
    for component in cycles(edges):
        members = set(component)
        inside = sorted(str(e) for e in edges if e.source in members and e.target in members)
        out.append(f"cycle of {len(component)} modules: " + ", ".join(component) + "\n    " + "\n    ".join(inside))
    return out


def test_no_import_cycle():
    problems = cycle_report(import_edges(SRC, "gemmtune"))
    assert not problems, "import cycles in gemmtune:\n" + "\n".join(problems)


def test_every_import_points_down_the_layers():
    problems = layering_violations(import_edges(SRC, "gemmtune"), LAYERS)
    assert not problems, "imports against the layer table (tests/test_layering.py LAYERS):\n" + "\n".join(problems)


def test_every_module_has_a_layer():
    units = {unit_of(m) for m in modules_of(SRC, "gemmtune")} - {""}
    assert units <= set(LAYERS), f"modules without a layer in LAYERS: {sorted(units - set(LAYERS))}"


# ---- the checker itself ----------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_the_checker_finds_a_planted_cycle_and_up_imports(tmp_path):
    src = tmp_path / "src"
    _write(src, {
        "pkg/__init__.py": "from . import low\n",
        "pkg/low.py": "def f():\n    from .high.a import g  # function level, up\n",
        "pkg/high/__init__.py": "",
        "pkg/high/a.py": "from . import b\nfrom ..low import f\n\n\ndef g():\n    pass\n",
        "pkg/high/b.py": "import os\n\n\ndef h():\n    import pkg.high.a\n",
        "pkg/mid/__init__.py": "from ..side import x\n",
        "pkg/side.py": "x = 1\n",
    })  # fmt: skip
    edges = import_edges(src, "pkg")
    assert {(e.source, e.target) for e in edges} == {
        ("pkg", "pkg.low"), ("pkg.low", "pkg.high.a"), ("pkg.high.a", "pkg.high.b"), ("pkg.high.a", "pkg.low"),
        ("pkg.high.b", "pkg.high.a"), ("pkg.mid", "pkg.side"),
    }  # fmt: skip
    assert cycles(edges) == [["pkg.high.a", "pkg.high.b", "pkg.low"]]
    assert "src/pkg/high/b.py:5: pkg.high.b -> pkg.high.a" in cycle_report(edges)[0]
    assert layering_violations(edges, {"low": 0, "high": 1, "mid": 2, "side": 2}) == [
        "src/pkg/low.py:2: pkg.low -> pkg.high.a: up from low (layer 0) to high (layer 1)",
        "src/pkg/mid/__init__.py:1: pkg.mid -> pkg.side: up from mid (layer 2) to side (layer 2)",
    ]
    assert layering_violations(edges, {"low": 0, "high": 1, "side": 2}) == [
        "src/pkg/low.py:2: pkg.low -> pkg.high.a: up from low (layer 0) to high (layer 1)",
        "src/pkg/mid/__init__.py:1: pkg.mid -> pkg.side: 'mid' has no layer in LAYERS",
    ]
