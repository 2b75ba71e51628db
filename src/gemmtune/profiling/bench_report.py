"""bench-model's outputs: a markdown report, report.json and report.png."""

from __future__ import annotations

import json
import math
import os
import textwrap

from ..configs.files import PNG, Kind, first_line, json_object_with, replace_file, save_figure
from ..models.report import fold_path
from .bench_model import QUANT_DECODE_TOL, QUANT_FLOOR_MARGIN, Result
from .categorize import CATEGORIES, label
from .report import COLORS


def _f(v: float, nd: int = 3) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"


def _names(res: Result) -> list[str]:
    seen: dict[str, None] = {}
    for sc in res.scenarios:
        for n in sc.cells:
            seen.setdefault(n)
    return list(seen)


def _speedup(sc, name) -> float:
    base, cell = sc.cells.get("stock"), sc.cells.get(name)
    if base is None or cell is None or not (base.ms > 0 and cell.ms > 0):
        return float("nan")
    return base.ms / cell.ms


def markdown(res: Result, command: str = "") -> str:
    m, names = res.meta, _names(res)
    lines = [f"# gemmtune bench-model: {m['model']}", ""]
    lines += [f"- {k}: {v}" for k, v in m.items() if k != "model"]
    lines += [f"- run time: {res.seconds:.0f} s", ""]
    lines += ["## optimize()", "", "```", res.optimize_summary, "```", ""]
    lines += _quant_section(res)
    lines += ["Parity (prefill, last-token logits vs the first contender):", ""]
    lines += [f"- {k}: {v}" for k, v in res.parity.items()] + [""]
    lines += _decode_parity_section(res)
    lines += [f"Note: {n}" for n in res.notes] + ([""] if res.notes else [])
    lines += ["## Speed: median ms per call (speedup vs stock)", ""]
    lines += _speed_section(res, names)
    prof_rows = [(sc, n, sc.cells[n].profile) for sc in res.scenarios for n in names
                 if n in sc.cells and sc.cells[n].profile is not None]  # fmt: skip
    if prof_rows:
        mode = prof_rows[0][2].mode
        lines += ["## Time by category (torch.profiler, ms per call)", ""]
        graphed = any(c.gemm_profile is not None for sc in res.scenarios for c in sc.cells.values())
        lines += ["Profiled apart from the timed rounds (each step ends with a synchronize), so totals differ a "
                  "little from the medians above."
                  + (" Decode rows profile the CUDA-graph replays; their kernels are categorized by the "
                     "un-graphed step's launch sites." if graphed else " Decode rows profile eager steps."),
                  ""]  # fmt: skip
        heads = [label(c, mode) for c in CATEGORIES]
        lines += ["| scenario | contender | " + " | ".join(heads) + " | total |", "|---" * (len(heads) + 3) + "|"]
        for sc, n, p in prof_rows:
            vals = " | ".join(_f(p.categories[c]) for c in CATEGORIES)
            lines.append(f"| {sc.name} | {n} | {vals} | {_f(p.total_ms)} |")
        lines.append("")
        lines += ["Top kernels per contender (ms per call):", ""]
        for sc, n, p in prof_rows:
            top = [i for i in p.breakdown.items if i.category != "idle"][:6]
            lines.append(f"- {sc.name}, {n}: " + "; ".join(f"`{i.name[:60]}` {i.ms:.3f} ({i.category})" for i in top))
        lines.append("")
        lines += _gemm_section(res, names)
    if res.errors:
        lines += ["## Errors", "", *[f"- {e}" for e in res.errors], ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    return "\n".join(lines)


def _cpu(res: Result) -> bool:
    return res.meta.get("device") == "cpu"


def nothing_timed(res: Result) -> str:
    """Why no scenario was timed ('' when some contender was)."""
    if any(c.ms == c.ms for sc in res.scenarios for c in sc.cells.values()):  # some ms is not NaN
        return ""
    if res.parity_failures():
        return ("the run stopped before timing: a contender fails decode parity (above); --keep-going times it "
                "anyway, marked")  # fmt: skip
    return "every contender failed (see Errors)" if res.errors else "no scenario ran"


def _speed_section(res: Result, names: list[str]) -> list[str]:
    why = nothing_timed(res)
    if why:
        return [f"Nothing was timed: {why}.", ""]
    out = []
    if _cpu(res):
        out += ["CPU: gemmtune's Triton kernels do not run here (their PyTorch references stand in) and the times "
                "are eager wall clock, so this measures the harness, not a speedup.", ""]  # fmt: skip
    out += ["| scenario | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    busy = []
    for sc in res.scenarios:
        row = []
        for n in names:
            c = sc.cells.get(n)
            mark = "" if res.decode_parity.get(n) is None or res.decode_parity[n].ok else " PARITY FAIL"
            if c is not None and c.busy:
                mark += " BUSY"
                busy.append(f"- {sc.name}, {n}: {c.busy}")
            if c is None or c.error:
                row.append(("error" if c is not None else "-") + mark)
            elif n == "stock":
                row.append(_f(c.ms) + mark)
            else:
                row.append(f"{_f(c.ms)} ({_f(_speedup(sc, n), 2)}x){mark}")
        out.append(f"| {sc.name} | " + " | ".join(row) + " |")
    out.append("")
    if busy:
        out += ["BUSY: timed on a busy machine (other work shared it; on the CPU try OMP_NUM_THREADS=1): these "
                "times and the speedups they enter are not measurements.", "", *busy, ""]  # fmt: skip
    return out


def _decode_parity_section(res: Result) -> list[str]:
    dp = res.decode_parity
    if not dp:
        return []
    steps = res.settings.decode_steps
    out = [f"Decode parity (teacher-forced: stock's greedy tokens fed to every contender on a static cache, "
           f"{steps} steps; relative L2 error of each step's logits vs the contender's reference: stock, or for "
           "an 8-bit contender the same quantized model on the plain-PyTorch reference of its 8-bit linears; "
           "its error vs stock, the quantization's own, is in the last column. An 8-bit contender's tolerance "
           f"is {QUANT_FLOOR_MARGIN:g}x the floor, the reference's own distance from its twin with the matmul "
           f"in the model dtype, and at least {QUANT_DECODE_TOL:g}. Steps over the tolerance that a MoE routing "
           "flip explains (near-tied experts; the block's input within the tolerance and its router agreeing "
           "on the reference's input) are named in the verdict; the contender is then decoded again with the "
           "reference's expert choices forced, and every step of that run must be within the tolerance):",
           ""]  # fmt: skip
    out += ["| contender | reference | verdict | max step rel err | greedy tokens equal | tolerance | vs stock |",
            "|---|---|---|---|---|---|---|"]  # fmt: skip
    for n, p in dp.items():
        worst = _f(max(p.errors), 4) if p.errors else "-"
        agree = f"{sum(p.agree)}/{len(p.agree)}" if p.agree else "-"
        verdict = "ok" if p.ok else ("FAILED" if p.failure else "MISMATCH")
        if p.flips:
            forced = f", forced routing max {_f(max(p.forced), 4)}" if p.forced else ""
            verdict += f" ({len(p.flips)} routing flips{forced})"
        vs_stock = _f(max(p.vs_stock), 4) if p.vs_stock else "-"
        tol = f"{p.tolerance:.3g}" + (f" (floor {p.floor:.3g})" if p.floor is not None else "")
        out.append(f"| {n} | {p.reference} | {verdict} | {worst} | {agree} | {tol} | {vs_stock} |")
    out.append("")
    return out


def _quant_section(res: Result) -> list[str]:
    q = res.quant
    if not q:
        return []
    out = [f"## optimize(quantize={q['mode']!r}): what runs 8-bit", "", "```", q["summary"], "```", ""]
    groups: dict[tuple[str, str], list[float]] = {}
    for path, shape, err in q["gemm_errors"]:
        groups.setdefault((fold_path(path), shape), []).append(err)
    if groups:
        out += ["Each 8-bit GEMM vs the 16-bit GEMM it replaced (same input: the parity prefill's activations), "
                "relative error ||y8 - y16|| / ||y16||:", ""]  # fmt: skip
        out += ["| GEMM | N x K | layers | median | max |", "|---|---|---|---|---|"]
        for (path, shape), errs in groups.items():
            errs = sorted(errs)
            out.append(f"| {path} | {shape} | {len(errs)} | {errs[len(errs) // 2]:.2e} | {errs[-1]:.2e} |")
        out.append("")
    out += [f"Logits (prefill, last token) relative error vs {q.get('logits_ref', 'stock')}: "
            f"{_f(q.get('logits_rel_err', float('nan')), 4)}", ""]  # fmt: skip
    return out


def _gemm_section(res: Result, names: list[str]) -> list[str]:
    out = ["## GEMMs of each scenario (optimize() / quantize contenders: what the tables in effect run)", ""]
    for sc in res.scenarios:
        for n in names:
            c = sc.cells.get(n)
            p = c and (c.gemm_profile or c.profile)
            if p is None or not ("optimize" in n or "quantize" in n):
                continue
            out.append(f"{sc.name}, {n}:")
            out.append("")
            out += ["```", *p.gemm_lines(), "```", ""]
    return out


def _num(v: float) -> float | None:
    return None if math.isnan(v) else v


def _clean(d: dict | None) -> dict | None:
    """NaN -> None (JSON has no NaN)."""
    if d is None:
        return None
    return {k: _num(v) if isinstance(v, float) else v for k, v in d.items()}


def to_dict(res: Result) -> dict:
    s = res.settings
    scen = []
    for sc in res.scenarios:
        cells = {}
        for n, c in sc.cells.items():
            d = {
                "ms": _num(c.ms),
                "spread": _num(c.spread),
                "speedup_vs_stock": _num(_speedup(sc, n)),
                "error": c.error,
                "busy": c.busy,
            }
            if c.profile is not None:
                d["profile"] = c.profile.to_dict(top=20)
            if c.gemm_profile is not None:
                d["eager_step_profile"] = c.gemm_profile.to_dict(top=20)
            cells[n] = d
        scen.append({"name": sc.name, "kind": sc.kind, "contenders": cells})
    return {
        "meta": res.meta,
        "settings": {
            "model": s.model,
            "layers": s.layers,
            "table": s.table,
            "device": s.device,
            "prefill": [list(p) for p in s.prefill],
            "batches": list(s.batches),
            "ctx": s.ctx,
            "reps": s.reps,
            "contenders": list(s.contenders),
            "quantize": s.quantize,
            "compile_ops": list(s.compile_ops),
            "decode_steps": s.decode_steps,
            "keep_going": s.keep_going,
        },  # fmt: skip
        "optimize": res.optimize_summary,
        "parity": res.parity,
        "decode_parity": {n: _clean(p.as_dict()) for n, p in res.decode_parity.items()},
        "quantize": _clean(res.quant),
        "notes": res.notes,
        "scenarios": scen,
        "errors": res.errors,
        "seconds": res.seconds,
    }


def plot(res: Result, path: str) -> None:
    """Speedups vs stock per scenario; beside them, where profiled, ms by category: one panel per
    scenario kind, each on its own scale (a prefill is many times a decode step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = _names(res)
    kinds = {}
    for sc in res.scenarios:
        for n in names:
            if n in sc.cells and sc.cells[n].profile is not None:
                kinds.setdefault(sc.kind, []).append((sc, n, sc.cells[n].profile))
    # The profile panels only when something was profiled (--no-profile: one panel, never an empty one).
    fig, axes = plt.subplots(1, 1 + len(kinds), figsize=(9 + 7 * len(kinds), 6.5), squeeze=False,
                             gridspec_kw={"width_ratios": [1.3] + [1] * len(kinds)})  # fmt: skip
    ax1 = axes[0][0]
    width = 0.8 / max(1, len(names))
    handles = []  # plain swatches: a hatched first bar would hatch its contender's legend entry
    for i, n in enumerate(names):
        xs = [j + i * width for j in range(len(res.scenarios))]
        bars = ax1.bar(xs, [_speedup(sc, n) for sc in res.scenarios], width, label=n)
        handles.append(Patch(facecolor=bars.patches[0].get_facecolor(), label=n) if bars.patches else bars)
        for bar, sc in zip(bars, res.scenarios):
            if n in sc.cells and sc.cells[n].busy:
                bar.set_hatch("//")
    ax1.axhline(1.0, color="gray", lw=0.8)
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(res.scenarios))],
                   [textwrap.fill(sc.name, 18) for sc in res.scenarios], fontsize=9)  # fmt: skip
    ax1.set_ylabel("speedup vs stock (stock ms / ms)", fontsize=10)
    caveats = []
    if _cpu(res):
        caveats.append("CPU: measures the harness, not a speedup")
    if any(c.busy for sc in res.scenarios for c in sc.cells.values()):
        caveats.append("hatched: timed on a busy machine")
    ax1.set_title(textwrap.fill(str(res.meta["model"]), 60) + "".join(f"\n{c}" for c in caveats), fontsize=10)
    # Legends sit outside the axes: inside, they covered the bars.
    ax1.legend(handles=handles, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.14),
               ncol=min(4, max(1, len(names))))  # fmt: skip
    for ax, (kind, rows) in zip(axes[0][1:], kinds.items()):
        xs = list(range(len(rows)))
        bottom = [0.0] * len(rows)
        for c in CATEGORIES:
            vals = [p.categories[c] for _, _, p in rows]
            ax.bar(xs, vals, bottom=bottom, color=COLORS[c], label=label(c, rows[0][2].mode))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks(xs, [n for _, n, _ in rows], fontsize=9, rotation=40, ha="right")
        # One group of bars per scenario, named above it.
        groups: dict[str, list[int]] = {}
        for x, (sc, _, _) in zip(xs, rows):
            groups.setdefault(sc.name, []).append(x)
        for g, (name, gx) in enumerate(groups.items()):
            if g:
                ax.axvline(gx[0] - 0.5, color="gray", lw=0.8, ls=":")
            ax.text((gx[0] + gx[-1]) / 2, 1.01, textwrap.fill(name, 22), transform=ax.get_xaxis_transform(),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_ylabel(f"{kind}: ms per call (profiled)", fontsize=10)
        ax.set_title(f"{kind}: time by category", fontsize=10, pad=28)
    if kinds:
        last = axes[0][-1]
        last.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    try:
        save_figure(fig, path)
    finally:
        plt.close(fig)


REPORT_MD = Kind("bench-model report", lambda p: first_line(p).startswith("# gemmtune bench-model"))
REPORT_JSON = Kind("bench-model report", lambda p: json_object_with(p, ("meta", "settings", "optimize")))


def report_outputs(out_dir: str) -> list[tuple[str, Kind, str]]:
    """(path, kind, option) of every file write() puts in `out_dir`."""
    return [(os.path.join(out_dir, "report.md"), REPORT_MD, "-o"),
            (os.path.join(out_dir, "report.json"), REPORT_JSON, "-o"),
            (os.path.join(out_dir, "report.png"), PNG, "-o")]  # fmt: skip


def write(res: Result, out_dir: str, command: str = "") -> list[str]:
    """out_dir/report.md, report.json and report.png (with matplotlib), each under the file rule
    (configs/files.py); returns notes."""
    os.makedirs(out_dir, exist_ok=True)
    md = os.path.join(out_dir, "report.md")
    replace_file(md, markdown(res, command), REPORT_MD)
    js = os.path.join(out_dir, "report.json")
    replace_file(js, json.dumps(to_dict(res), indent=1), REPORT_JSON)
    notes = [f"wrote {md} and {js}"]
    png = os.path.join(out_dir, "report.png")
    why = nothing_timed(res)
    if why:  # no chart of nothing; one left from an earlier run would pass for this one's
        stale = " (the report.png there is from an earlier run)" if os.path.exists(png) else ""
        notes.append(f"no report.png: nothing was timed{stale}")
        return notes
    try:
        plot(res, png)
        notes.append(f"wrote {png}")
    except ImportError:
        notes.append("matplotlib is not installed: no report.png (pip install matplotlib, a dependency of gemmtune)")
    return notes
