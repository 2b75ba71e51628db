"""A profile's outputs: the printed table, profile.json, the chrome trace and a PNG."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..configs.files import PNG, Kind, head_text, json_object_with, replace_file, save_figure
from .breakdown import Breakdown
from .categorize import CATEGORIES, label

TOP = 5


def _pct(v: float, total: float) -> float:
    return 100.0 * v / total if total > 0 else 0.0


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


@dataclass
class Profile:
    """The result of gemmtune.profile(): a Breakdown plus where its trace went."""

    breakdown: Breakdown
    trace: str | None = None

    # convenient views
    @property
    def mode(self) -> str:
        return self.breakdown.mode

    @property
    def total_ms(self) -> float:
        return self.breakdown.total_ms

    @property
    def categories(self) -> dict[str, float]:
        return self.breakdown.categories

    def kernel_categories(self) -> dict[str, str]:
        return self.breakdown.kernel_categories()

    # ---- text -------------------------------------------------------------------------------------
    def category_lines(self) -> list[str]:
        bd = self.breakdown
        unit = "GPU" if bd.mode == "cuda" else "CPU"
        out = [f"{unit} time per step: {bd.total_ms:.3f} ms over {bd.steps} step(s)", "",
               f"{'category':<26} {'ms':>10} {'%':>7}"]  # fmt: skip
        for c in CATEGORIES:
            out.append(
                f"{label(c, bd.mode):<26} {bd.categories[c]:>10.3f} {_pct(bd.categories[c], bd.total_ms):>6.1f}%"
            )
        return out

    def top_lines(self, top: int = TOP) -> list[str]:
        bd = self.breakdown
        what = "kernels" if bd.mode == "cuda" else "ops (self time)"
        out = [f"top {what} per category (ms per step, calls per step):"]
        for c in CATEGORIES[:-1]:
            items = [i for i in bd.items if i.category == c][:top]
            if not items:
                continue
            out.append(f"  {label(c, bd.mode)}:")
            for i in items:
                how = "" if i.how == "site" else f"  [by {i.how}]"
                out.append(f"    {i.ms:9.3f}  x{i.calls:<6g} {_short(i.name)}{how}")
        unknown = [i for i in bd.items if i.how == "unknown"]
        if unknown:
            out.append(f"  not recognized ({len(unknown)}, counted as other): "
                       + ", ".join(_short(i.name, 40) for i in unknown[:8]))  # fmt: skip
        return out

    def gemm_lines(self) -> list[str]:
        bd = self.breakdown
        if not bd.gemms:
            return ["GEMMs: none"]
        gemm_ms = bd.categories["gemm"]
        head = f"  {'M':>7} {'N':>7} {'K':>7} {'bias':>4} {'dtype':>9} {'ms':>9} {'%gemm':>6} {'calls':>6}  status"
        out = [f"GEMMs ({len(bd.gemms)} shapes): % of GEMM time, calls per step, what the tables in effect run", head]
        for r in bd.gemms:
            pct = _pct(r.ms, gemm_ms)
            if r.call is None:
                out.append(f"  {'(shapes unknown)':>34} {r.ms:>9.3f} {pct:>5.1f}% {'':>6}  n/a")
                continue
            c = r.call
            dt = str(c.dtype).replace("torch.", "")
            m = f"{c.batch}x{c.M}" if c.batch > 1 else str(c.M)
            out.append(f"  {m:>7} {c.N:>7} {c.K:>7} {('yes' if c.bias else 'no'):>4} {dt:>9} {r.ms:>9.3f} "
                       f"{pct:>5.1f}% {r.calls:>6g}  {r.status}: {r.detail}")  # fmt: skip
        return out

    def table(self, top: int = TOP) -> str:
        lines = self.category_lines() + [""] + self.top_lines(top) + [""] + self.gemm_lines()
        lines += [f"note: {n}" for n in self.breakdown.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # ---- files ------------------------------------------------------------------------------------
    def to_dict(self, top: int | None = None) -> dict:
        bd = self.breakdown
        items = bd.items if top is None else bd.items[:top]
        return {
            "mode": bd.mode,
            "steps": bd.steps,
            "total_ms": bd.total_ms,
            "categories": {
                c: {"label": label(c, bd.mode), "ms": bd.categories[c], "pct": _pct(bd.categories[c], bd.total_ms)}
                for c in CATEGORIES
            },  # fmt: skip
            "kernels" if bd.mode == "cuda" else "ops": [
                {"name": i.name, "category": i.category, "by": i.how, "ms": i.ms, "calls": i.calls} for i in items
            ],
            "gemms": [
                {
                    **(
                        {
                            "op": r.call.op,
                            "M": r.call.M,
                            "N": r.call.N,
                            "K": r.call.K,
                            "batch": r.call.batch,
                            "bias": r.call.bias,
                            "dtype": str(r.call.dtype),
                            "outdtype": str(r.call.outdtype),
                        }
                        if r.call is not None
                        else {"op": None}
                    ),
                    "calls": r.calls,
                    "ms": r.ms,
                    "pct_of_gemm": _pct(r.ms, bd.categories["gemm"]),
                    "pct_of_total": _pct(r.ms, bd.total_ms),
                    "status": r.status,
                    "detail": r.detail,
                }
                for r in bd.gemms
            ],  # fmt: skip
            "notes": bd.notes,
            "trace": self.trace,
        }

    def save(self, out_dir: str, title: str = "gemmtune profile") -> list[str]:
        """out_dir/profile.json, profile.png (with matplotlib) and trace.json (if traced), each under the file
        rule (configs/files.py); returns notes."""
        os.makedirs(out_dir, exist_ok=True)
        notes = []
        if self.trace and os.path.abspath(os.path.dirname(self.trace)) != os.path.abspath(out_dir):
            dst = os.path.join(out_dir, "trace.json")
            with open(self.trace, "rb") as fh:
                replace_file(dst, fh.read(), TRACE_JSON)
            self.trace = dst
        path = os.path.join(out_dir, "profile.json")
        replace_file(path, json.dumps(self.to_dict(), indent=1), PROFILE_JSON)
        notes.append(f"wrote {path}" + (f" and {self.trace}" if self.trace else ""))
        try:
            png = os.path.join(out_dir, "profile.png")
            plot([(title, self)], png)
            notes.append(f"wrote {png}")
        except ImportError:
            notes.append(
                "matplotlib is not installed: no profile.png (pip install matplotlib, a dependency of gemmtune)"
            )
        return notes


PROFILE_JSON = Kind("profile report", lambda p: json_object_with(p, ("mode", "steps", "total_ms")))


def _is_trace(path: str) -> bool:
    """torch.profiler's Chrome trace, judged by its opening (a trace may be too large to parse)."""
    head = head_text(path).lstrip()
    return head.startswith("{") and ('"traceEvents"' in head or '"schemaVersion"' in head)


TRACE_JSON = Kind("Chrome trace", _is_trace)


def profile_outputs(out_dir: str) -> list[tuple[str, Kind, str]]:
    """(path, kind, option) of every file `gemmtune profile -o out_dir` writes."""
    return [(os.path.join(out_dir, "profile.json"), PROFILE_JSON, "-o"),
            (os.path.join(out_dir, "trace.json"), TRACE_JSON, "-o"),
            (os.path.join(out_dir, "profile.png"), PNG, "-o")]  # fmt: skip


# GEMM rows by gemms.status: tuned rows in the GEMM colour, what falls back in greys.
STATUS_COLORS = {"tuned": "#4c72b0", "untuned-M": "#8fa8d0", "default": "#999999", "n/a": "#cccccc"}
COLORS = {"gemm": "#4c72b0", "attention": "#dd8452", "elementwise": "#55a868", "memory": "#c44e52",
          "other": "#8172b3", "idle": "#bbbbbb"}  # fmt: skip


def _fit(title: str, width: int) -> str:
    """A title that fits its panel: wrapped onto two lines, the middle elided beyond that."""
    import textwrap

    if len(title) > 2 * width:
        title = title[: width - 2] + " ... " + title[-(width - 3) :]
    return "\n".join(textwrap.wrap(title, width)) or title


def plot(profiles: list[tuple[str, Profile]], path: str, title: str = "") -> None:
    """Stacked bar of ms per category for each (name, profile); GEMM shares beside it (one profile)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    gemm_rows = [r for r in profiles[0][1].breakdown.gemms if r.ms > 0][:12] if len(profiles) == 1 else []
    single = bool(gemm_rows)  # the GEMM panel only when there is a GEMM to show: never an empty panel
    width = 13 if single else max(8, 1.2 * len(profiles) + 5)
    fig, axes = plt.subplots(1, 2 if single else 1, figsize=(width, 5))
    ax = axes[0] if single else axes
    names = [n for n, _ in profiles]
    bottom = [0.0] * len(profiles)
    for c in CATEGORIES:
        vals = [p.categories[c] for _, p in profiles]
        ax.bar(names, vals, bottom=bottom, color=COLORS[c], label=label(c, profiles[0][1].mode))
        bottom = [b + v for b, v in zip(bottom, vals)]
    # Bars are named by their command: long ones wrap instead of running off the figure.
    ax.set_xticks(range(len(names)), [_fit(n, 30) for n in names], fontsize=9)
    ax.set_ylabel("ms per step")
    ax.set_title(_fit(title or "time by category", 45 if single else 70), fontsize=10)
    # Outside the axes: inside, the legend covered the bars it explains.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    if len(profiles) > 1:
        ax.tick_params(axis="x", labelrotation=30)
    if single:
        ax2 = axes[1]
        labels = [f"{r.call.describe() if r.call else 'shapes unknown'}\n{r.status}" for r in gemm_rows]
        colors = [STATUS_COLORS.get(r.status, STATUS_COLORS["n/a"]) for r in gemm_rows]
        ax2.barh(labels[::-1], [r.ms for r in gemm_rows][::-1], color=colors[::-1])
        ax2.set_xlabel("ms per step")
        ax2.set_title(f"GEMM shapes (top {len(gemm_rows)}) by what the tables in effect run", fontsize=10)
        ax2.tick_params(axis="y", labelsize=8)
        shown = dict.fromkeys(r.status for r in gemm_rows)
        handles = [Patch(color=STATUS_COLORS.get(st, STATUS_COLORS["n/a"]), label=st) for st in shown]
        ax2.legend(handles=handles, fontsize=8, loc="lower right")
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)
