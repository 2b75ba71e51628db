"""What optimize() did to a model: every change and every skipped part with its reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class OptimizeReport:
    family: str  # the family table entry used, or "unknown"
    model_type: str
    transformers_version: str
    options: dict
    attention_tier: str | None = None
    attention_note: str = ""
    changed: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why)
    notes: list[str] = field(default_factory=list)
    _model: object = field(default=None, repr=False, compare=False)
    _actions: list = field(default_factory=list, repr=False, compare=False)

    def change(self, what: str) -> None:
        self.changed.append(what)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append((what, why))

    def undo(self):
        """Give the model its original behaviour back (same as gemmtune.restore(model))."""
        from . import restore

        if self._model is None:
            raise RuntimeError("this report is not attached to a model")
        return restore(self._model)

    def counts(self) -> Counter:
        """Changes grouped by kind (the text before the first ':' of each entry)."""
        return Counter(c.split(":", 1)[0] for c in self.changed)

    def summary(self) -> str:
        lines = [
            f"gemmtune.optimize: {self.model_type} (family {self.family}, transformers {self.transformers_version})"
        ]
        tier = self.attention_tier or "unchanged"
        lines.append(f"  attention: {tier}" + (f" ({self.attention_note})" if self.attention_note else ""))
        for kind, n in sorted(self.counts().items()):
            lines.append(f"  {kind}: {n}")
        reasons = Counter(f"{w.split(':', 1)[0]}: {why}" for w, why in self.skipped)
        for text, n in sorted(reasons.items()):
            lines.append(f"  skipped {text}" + (f" (x{n})" if n > 1 else ""))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
