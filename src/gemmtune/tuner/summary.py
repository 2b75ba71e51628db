"""What `gemmtune tune` prints: a line per key as it finishes (-v) and the closing table."""

from __future__ import annotations

import collections
import math

from .. import families
from .donor import VERDICTS
from .search import ShapeResult
from .workers import ShapeFailure


def describe_key(item) -> str:
    return families.get(getattr(item, "family", "a16w16")).describe(item.key)


def describe_item(item) -> str:
    if isinstance(item, ShapeFailure):
        return f"FAILED {describe_key(item)}: {item.reason}"
    r = item
    ok = sum(c.status == "ok" for c in r.candidates)
    verdict = "default kept" if r.kept_default else f"{r.speedup:.3f}x vs default"
    verdict += f"; donor: {r.donor}" if r.donor else ""
    note = f" [{r.note}]" if r.note else ""
    return (
        f"{describe_key(r)}: {r.winner.name} {r.us:.2f} us ({verdict}, default {r.default_us:.2f} us, "
        f"noise {r.noise * 100:.1f}%, {ok}/{len(r.candidates)} candidates passed, {r.seconds:.1f}s){note}"
    )


def _shape_text(r: ShapeResult) -> str:
    k = r.key
    if r.family == "a16w16":
        return f"{k.M}x{k.N}x{k.K}{'+b' if k.bias else ''} {str(k.dtype).replace('torch.', '')}"
    fam = families.get(r.family)
    return fam.describe(k).removeprefix(fam.name + " ")


def summary_lines(report, output: str) -> list[str]:
    lines = []
    donor = getattr(report, "donor", "")
    if report.results:
        width = max(28, *(len(_shape_text(r)) for r in report.results))
        head = f"{'shape':<{width}} {'winner':<44} {'us':>9} {'default':>9} {'speedup':>8} {'roof':>6}"
        lines.append(head + (f"  {'donor'}" if donor else ""))
        for r in report.results:
            win = ("= " if r.kept_default else "") + r.winner.name + (" (busy)" if r.busy else "")
            roof = "-" if r.roof_pct != r.roof_pct else f"{r.roof_pct:.0f}%"
            lines.append(f"{_shape_text(r):<{width}} {win[:44]:<44} {r.us:>9.2f} {r.default_us:>9.2f} "
                         f"{r.speedup:>7.2f}x {roof:>6}" + (f"  {r.donor}" if donor else ""))  # fmt: skip
    bad = collections.Counter()
    examples: dict[str, str] = {}
    for r in report.results:
        for c in r.candidates:
            if c.status not in ("ok", "pending"):
                bad[c.status] += 1
                examples.setdefault(c.name, f"{c.status}: {c.reason}")
    n = len(report.results)
    if n:
        sp = [r.speedup for r in report.results if r.speedup == r.speedup and r.speedup > 0]
        geo = math.exp(sum(math.log(s) for s in sp) / len(sp)) if sp else math.nan
        kept = sum(r.kept_default for r in report.results)
        libs = collections.Counter(r.winner.libtype for r in report.results)
        lines.append(
            f"tuned {n} shapes in {report.seconds:.1f}s -> {output}: default kept for {kept}, "
            f"winners {dict(libs)}, geomean speedup vs default {geo:.3f}x"
        )
    phases: collections.Counter = collections.Counter()
    for r in report.results:
        phases.update(r.phases)
    if sum(phases.values()) > 0:  # where the keys' tuning time went (tune_shape's phases)
        lines.append("time per phase, all keys: " + ", ".join(f"{p} {s:.1f}s" for p, s in phases.items()))
    if donor and report.results:
        counts = collections.Counter(r.donor for r in report.results)
        lines.append(f"from {donor}: " + ", ".join(f"{v} {counts[v]}" for v in VERDICTS))
    busy = [r for r in report.results if r.busy]
    if busy:
        lines.append(f"{len(busy)} shapes timed on a busy machine even after re-measuring (e.g. {busy[0].busy}): "
                     "their times are unreliable; retune them with --all when the machine is quiet")  # fmt: skip
    if bad:
        lines.append(f"candidates not timed: {dict(bad)}; e.g.")
        lines += [f"  {name}: {why}" for name, why in list(examples.items())[:8]]
    if report.skipped:
        lines.append(f"skipped {report.skipped} shapes already tuned (--all retunes them)")
    for f in report.failures:
        lines.append(f"FAILED {describe_key(f)}: {f.reason}")
    return lines
