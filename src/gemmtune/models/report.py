"""What optimize() did to a model: every change and every skipped part with its reason.

str(report) groups them by what happened (fused, swapped, routed, left alone) and, within that, by
module type, with the module paths folded over layer indices (`model.layers.*.self_attn`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..device import triton_reason

# Which heading each kind of change is listed under; kinds missing here are shown elsewhere (attention).
_SECTIONS = {
    "fuse": "fused",
    "layer": "fused",
    "attn": "swapped",
    "mlp": "swapped",
    "norm": "swapped",
    "route": "routed through gemmtune.gemm",
    "moe": "swapped",
    "router": "swapped",
    "moe_fold": "fused",
    "positions": "swapped",
    "epilogue_mlp": "fused",
    "quantize": "quantized",
    "quantize feed": "quantized",
    "fp8": "quantized",
}
_ORDER = ("fused", "swapped", "quantized", "routed through gemmtune.gemm", "left alone")
# What was not done, per kind of skip, so a reason reads as "q/k/v not fused: <why>".
_NOT_DONE = {
    "fuse qkv": "q/k/v not fused",
    "fuse gate_up": "gate/up not fused",
    "act": "activation not fused",
    "mlp": "forward not swapped",
    "norm": "not swapped",
    "layer": "layer not fused",
    "linear": "not routed",
    "moe": "experts not swapped",
    "router": "router not swapped",
    "moe_fold": "shared expert not folded into the experts' call",
    "positions": "forward not swapped (transformers' packed-sequence check stays)",
    "epilogue mlp": "MLP epilogue not fused",
    "quantize": "not quantized",
    "quantize feed": "the GEMM quantizes its own input",
    "fp8": "fp8 checkpoint weight not routed",
    "verify": "put back to stock",
}
_MAX_PATHS = 3


@dataclass(frozen=True)
class Entry:
    section: str  # one of _ORDER
    module_type: str  # class name of the module concerned
    path: str  # its path in the model ("" for the model itself)
    detail: str  # what was done, or why it was left alone


def fold_path(path: str) -> str:
    """model.layers.12.mlp -> model.layers.*.mlp: one pattern for a module of every layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path) or "(model)"


_fold = fold_path


@dataclass
class OptimizeReport:
    architecture: str  # the architecture table entry used (models/architectures.py), or "unknown"
    model_type: str
    transformers_version: str
    options: dict
    attention_tier: str | None = None
    attention_note: str = ""
    changed: list[str] = field(default_factory=list)  # "kind: path: detail"
    skipped: list[tuple[str, str]] = field(default_factory=list)  # ("kind: path", why)
    notes: list[str] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    _model: object = field(default=None, repr=False, compare=False)
    _restore: Callable | None = field(default=None, repr=False, compare=False)  # api.restore, set with _model
    _actions: list = field(default_factory=list, repr=False, compare=False)

    def change(self, kind: str, path: str, module_type: str, detail: str) -> None:
        self.changed.append(f"{kind}: {path}: {detail}" if path else f"{kind}: {detail}")
        if kind in _SECTIONS:
            self.entries.append(Entry(_SECTIONS[kind], module_type, path, detail))

    def skip(self, kind: str, path: str, module_type: str, why: str) -> None:
        self.skipped.append((f"{kind}: {path}" if path else kind, why))
        not_done = _NOT_DONE.get(kind)
        self.entries.append(Entry("left alone", module_type, path, f"{not_done}: {why}" if not_done else why))

    def retract(self, kind: str, path: str) -> None:
        """Forget the planned change of this kind to exactly this module (left out before it was made)."""
        line = f"{kind}: {path}: " if path else f"{kind}: "
        self.changed = [c for c in self.changed if not c.startswith(line)]
        section = _SECTIONS.get(kind)
        self.entries = [e for e in self.entries if not (e.section == section and e.path == path)]

    def withdraw(self, prefix: str) -> None:
        """Forget the changes made to `prefix` and the modules under it (they were undone)."""

        def inside(path: str) -> bool:
            return path == prefix or path.startswith(prefix + ".")

        self.changed = [c for c in self.changed if not inside(c.split(": ", 2)[1] if c.count(": ") >= 2 else "")]
        self.entries = [e for e in self.entries if e.section == "left alone" or not inside(e.path)]

    def undo(self):
        """Give the model its original behaviour back (same as gemmtune.restore(model))."""
        if self._model is None:
            raise RuntimeError("this report is not attached to a model")
        return self._restore(self._model)

    def counts(self) -> Counter:
        """Changes grouped by kind (the text before the first ':' of each entry)."""
        return Counter(c.split(":", 1)[0] for c in self.changed)

    def grouped(self) -> dict[str, list[tuple[str, list[str], str]]]:
        """{section: [(module type, folded paths with repeats, detail)]}: sections in display order,
        groups in the order first seen."""
        groups: dict[tuple[str, str, str], list[str]] = {}
        for e in self.entries:
            groups.setdefault((e.section, e.module_type, e.detail), []).append(_fold(e.path))
        return {
            section: [(mtype, paths, detail) for (sec, mtype, detail), paths in groups.items() if sec == section]
            for section in _ORDER
            if any(sec == section for sec, _, _ in groups)
        }

    def summary(self) -> str:
        versions = f"architecture {self.architecture}, transformers {self.transformers_version}"
        lines = [f"gemmtune.optimize: {self.model_type} ({versions})"]
        note = self.attention_note
        if self.attention_tier:
            lines.append(f"  attention: {self.attention_tier} tier via transformers' AttentionInterface ({note})")
        else:
            lines.append("  attention: unchanged" + (f" ({note})" if note else ""))
        for section, groups in self.grouped().items():
            lines.append(f"  {section}:")
            for mtype, paths, detail in groups:
                where = list(dict.fromkeys(paths))
                more = f", +{len(where) - _MAX_PATHS} more" if len(where) > _MAX_PATHS else ""
                lines.append(f"    {mtype} x{len(paths)} [{', '.join(where[:_MAX_PATHS])}{more}]: {detail}")
        if not self.entries:
            lines.append("  nothing changed")
        lines.extend(f"  note: {n}" for n in self.notes)
        why = self._no_triton()
        if why and self.entries:
            lines.append(f"  note: {why}: the kernels named above run as their PyTorch references")
        return "\n".join(lines)

    def _no_triton(self) -> str:
        """Why the attached model's Triton kernels cannot run on its device ('' when they can, or unknown)."""
        params = getattr(self._model, "parameters", None)
        first = next(params(), None) if callable(params) else None
        return "" if first is None else triton_reason(first.device)

    def __str__(self) -> str:
        return self.summary()
