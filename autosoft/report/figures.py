"""The report's figures: plotly figures for the page (dicts, not graph objects: no validation cost for
a few hundred figures) and matplotlib PNGs, the per-problem kinds as one grid of subplots per kind,
so that 48 problems stay a few seconds of drawing.

Per problem: best-so-far time against trial number and against wall time with the default as a
line; outcome counts; parameter importances; time against the most important parameters; compile
against evaluation time where the store records the split. Across problems: achieved GB/s against
the copy bandwidth measured in the same tune (and torch/Triton from benchmarks) for memory-bound
families, TFLOP/s for compute-bound ones, against the peak."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from .analysis import STATUSES, TOP_PARAMS, Analysis, best_so_far, has_split, intervals, top_params


STATUS_COLORS = {"ok": "#2ca02c", "compile_fail": "#ff7f0e", "launch_fail": "#d62728", "timeout": "#9467bd",
                 "wrong": "#8c564b", "invalid": "#7f7f7f"}


# Dense fp16/bf16 tensor-core peak from the datasheet (TFLOP/s), matched on the GPU name: the bound
# drawn for compute-bound problems whose studies carry no measured peak (a tune measures one, a
# dense float16 matrix product on its GPU, and keeps it as the study's "peak_tflops").
DATASHEET_PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0,
                         "A100": 312.0}


REF_COLORS = ("#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")  # never the autosoft bars' blue


PNG_KINDS = ("convergence", "convergence_wall", "outcomes", "importance", "params", "timing")


# --- plotly figures -----------------------------------------------------------------------------

def _layout(title: str, xtitle: str, ytitle: str, **extra: Any) -> dict[str, Any]:
    layout = {"title": {"text": title, "font": {"size": 14}}, "xaxis": {"title": {"text": xtitle}},
              "yaxis": {"title": {"text": ytitle}}, "height": 340, "width": 560,
              "margin": {"l": 60, "r": 20, "t": 50, "b": 50}, "legend": {"orientation": "h", "y": -0.25},
              "plot_bgcolor": "white"}
    for axis in ("xaxis", "yaxis"):
        layout[axis].update(gridcolor="#e5e5e5", zerolinecolor="#cccccc")
    layout.update(extra)
    return layout


def fig_convergence(a: Analysis, wall: bool) -> dict[str, Any]:
    points = best_so_far(a.run.trials)
    xs = [(p[1] if wall else p[0]) for p in points]
    ok = [t for t in a.run.trials if t.status == "ok" and t.time_us]
    start = next((t.created for t in a.run.trials if t.created is not None), None)
    raw_x = [((t.created - start) if wall and start is not None and t.created is not None else t.number) for t in ok]
    data: list[dict[str, Any]] = [
        {"type": "scatter", "mode": "markers", "x": raw_x, "y": [t.time_us for t in ok], "name": "trial",
         "marker": {"size": 5, "color": "#9ecae1"}},
        {"type": "scatter", "mode": "lines+markers", "line": {"shape": "hv", "color": "#1f77b4"},
         "x": xs, "y": [p[2] for p in points], "name": "best so far", "marker": {"size": 4}}]
    shapes = []
    if a.default_us:
        data.append({"type": "scatter", "mode": "lines", "x": [min(xs or [0]), max(xs or [1])],
                     "y": [a.default_us] * 2, "name": f"default {a.default_us:.2f} µs",
                     "line": {"dash": "dash", "color": "#d62728"}})
    xt = "seconds since the first trial record" if wall else "trial number"
    return {"data": data, "layout": _layout(f"{a.run.label}: best so far vs {'wall time' if wall else 'trial'}",
                                            xt, "kernel time (µs)", shapes=shapes)}


def fig_outcomes(a: Analysis) -> dict[str, Any]:
    return {"data": [{"type": "bar", "x": list(STATUSES), "y": [a.counts.get(s, 0) for s in STATUSES],
                      "marker": {"color": [STATUS_COLORS[s] for s in STATUSES]},
                      "text": [a.counts.get(s, 0) for s in STATUSES], "textposition": "auto", "showlegend": False}],
            "layout": _layout(f"{a.run.label}: outcomes of {len(a.run.trials)} trials", "outcome", "trials")}


def fig_importance(a: Analysis) -> dict[str, Any]:
    if not a.importances:
        layout = _layout(f"{a.run.label}: parameter importance", "", "")
        layout["annotations"] = [{"text": a.importance_note, "showarrow": False, "xref": "paper", "yref": "paper",
                                  "x": 0.5, "y": 0.5}]
        layout["xaxis"]["visible"] = layout["yaxis"]["visible"] = False
        return {"data": [], "layout": layout}
    names = list(a.importances)[::-1]
    return {"data": [{"type": "bar", "orientation": "h", "y": names, "x": [a.importances[n] for n in names],
                      "marker": {"color": "#1f77b4"}, "showlegend": False}],
            "layout": _layout(f"{a.run.label}: parameter importance ({a.importance_note})",
                              "importance (PED-ANOVA, sums to 1)", "", height=max(260, 40 + 24 * len(names)))}


def fig_params(a: Analysis) -> dict[str, Any]:
    names = top_params(a)
    ok = [t for t in a.run.trials if t.status == "ok" and t.time_us]
    layout = _layout(f"{a.run.label}: time against the most important parameters", "", "kernel time (µs)",
                     width=760)
    data: list[dict[str, Any]] = []
    if not names:
        layout["annotations"] = [{"text": "no parameter varied among the correct trials", "showarrow": False,
                                  "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5}]
        return {"data": data, "layout": layout}
    gap = 0.06
    width = (1 - gap * (len(names) - 1)) / len(names)
    for i, name in enumerate(names):
        axis = "" if i == 0 else str(i + 1)
        data.append({"type": "scatter", "mode": "markers", "x": [str(t.params.get(name)) for t in ok],
                     "y": [t.time_us for t in ok], "xaxis": f"x{axis}", "yaxis": "y", "name": name,
                     "marker": {"size": 7, "opacity": 0.7}, "showlegend": False})
        layout[f"xaxis{axis}"] = {"domain": [i * (width + gap), i * (width + gap) + width], "type": "category",
                                  "title": {"text": name}, "anchor": "y"}
    return {"data": data, "layout": layout}


def fig_timing(a: Analysis) -> dict[str, Any]:
    run = a.run
    if has_split(run):
        xs = [t.number for t in run.trials]
        data = [{"type": "bar", "x": xs, "y": [t.compile_s or 0 for t in run.trials], "name": "compile (s)"},
                {"type": "bar", "x": xs, "y": [t.evaluate_s or 0 for t in run.trials], "name": "verify + time (s)"}]
        return {"data": data, "layout": _layout(f"{run.label}: compiling against timing", "trial number",
                                                "seconds", barmode="stack")}
    pairs = intervals(run)
    layout = _layout(f"{run.label}: seconds per trial (no compile/evaluate split recorded)", "trial number",
                     "seconds since the previous trial record")
    return {"data": [{"type": "bar", "x": [p[0] for p in pairs], "y": [p[1] for p in pairs],
                      "marker": {"color": "#aaaaaa"}, "name": "compile + evaluate (not split)"}],
            "layout": layout}


def fig_bandwidth(analyses: Sequence[Analysis], dtype: str) -> dict[str, Any]:
    rows = [a for a in analyses if a.memory_bound and a.run.dtype == dtype and a.nbytes]
    labels = [f"{a.run.shape}" for a in rows]
    data: list[dict[str, Any]] = [
        {"type": "bar", "x": labels, "y": [a.gbps(a.best_us) for a in rows], "name": "autosoft (tuned)",
         "marker": {"color": "#1f77b4"}},
        {"type": "scatter", "mode": "markers", "x": labels, "y": [a.gbps(a.copy_us) for a in rows],
         "name": "device copy, same tune", "marker": {"symbol": "line-ew-open", "size": 18, "color": "black",
                                                      "line": {"width": 3}}},
        {"type": "scatter", "mode": "markers", "x": labels, "y": [a.gbps(a.default_us) for a in rows],
         "name": "default variant", "marker": {"symbol": "x", "size": 8, "color": "#d62728"}}]
    for name in sorted({n for a in rows for n in a.references}):
        data.append({"type": "scatter", "mode": "markers", "x": labels, "y": [a.references.get(name) for a in rows],
                     "name": f"{name} (benchmark)", "marker": {"size": 8, "symbol": "diamond"}})
    families = ", ".join(sorted({a.run.family for a in rows}))
    return {"data": data, "layout": _layout(f"{families} {dtype}: achieved bandwidth (input read once + output "
                                            "written once)", "shape (rows x row length)", "GB/s",
                                            width=1100, height=420, legend={"orientation": "h", "y": 1.12})}


def fig_tflops(analyses: Sequence[Analysis]) -> dict[str, Any]:
    rows = [a for a in analyses if not a.memory_bound]
    labels = [f"{a.run.shape} {a.run.dtype}" for a in rows]
    data: list[dict[str, Any]] = [
        {"type": "bar", "x": labels, "y": [a.tflops(a.best_us) for a in rows], "name": "autosoft (tuned)"},
        {"type": "scatter", "mode": "markers", "x": labels, "y": [a.tflops(a.default_us) for a in rows],
         "name": "default variant", "marker": {"symbol": "x", "size": 8, "color": "#d62728"}}]
    for name in sorted({n for a in rows for n in a.references}):
        data.append({"type": "scatter", "mode": "markers", "x": labels, "y": [a.references.get(name) for a in rows],
                     "name": f"{name} (benchmark)", "marker": {"size": 8, "symbol": "diamond"}})
    peak = peak_bound(rows)
    if peak:
        data.append({"type": "scatter", "mode": "lines", "x": [labels[0], labels[-1]], "y": [peak[1]] * 2,
                     "name": f"{peak[0]} {peak[1]:.0f}", "line": {"dash": "dash", "color": "black"}})
    return {"data": data, "layout": _layout("compute-bound families: achieved TFLOP/s", "problem", "TFLOP/s",
                                            width=1100, height=420, legend={"orientation": "h", "y": 1.12})}


def peak_bound(rows: Sequence[Analysis]) -> tuple[str, float] | None:
    """(label, TFLOP/s) of the bound for these problems: the peak their tunes measured on their
    GPU (the median, where several did), else the datasheet's for that GPU; None across GPUs."""
    gpus = {a.run.gpu for a in rows}
    if len(gpus) != 1:
        return None
    gpu = gpus.pop()
    measured = sorted(a.run.peak_tflops for a in rows if a.run.peak_tflops is not None)
    if measured:
        return f"{gpu} measured peak (dense float16 GEMM in the tunes)", measured[len(measured) // 2]
    for name, value in DATASHEET_PEAK_TFLOPS.items():
        if name in gpu:
            return f"{gpu} datasheet peak", value
    return None


# --- matplotlib PNGs ------------------------------------------------------------------------------

def _grid(n: int, title: str, xlabel: str, ylabel: str, ncols: int = 6, w: float = 2.9, h: float = 2.1,
          left: float = 0.75, wspace: float = 0.32):
    import matplotlib.pyplot as plt

    ncols = max(1, min(ncols, n))
    nrows = max(1, math.ceil(n / ncols))
    height = h * nrows + 1.2
    fig, axes = plt.subplots(nrows, ncols, figsize=(w * ncols, height), squeeze=False)
    # fixed margins in inches (tight_layout would draw the grid twice: seconds for 48 panels)
    fig.subplots_adjust(left=left / (w * ncols), right=1 - 0.15 / (w * ncols), bottom=0.55 / height,
                        top=1 - 0.75 / height, wspace=wspace, hspace=0.55)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=12)
    fig.supxlabel(xlabel, fontsize=10)
    fig.supylabel(ylabel, fontsize=10)
    return fig, list(axes.flat[:n])


def _small(ax, title: str) -> None:
    ax.set_title(title, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def _save(fig, path: Path, tight: bool = False) -> None:
    import matplotlib.pyplot as plt

    if tight:  # tight_layout draws the figure once more: only for the single-panel figures
        fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def png_per_problem(kind: str, analyses: Sequence[Analysis], path: Path) -> None:
    """One figure kind for every problem, a subplot each."""
    n = len(analyses)
    if kind in ("convergence", "convergence_wall"):
        wall = kind == "convergence_wall"
        fig, axes = _grid(n, f"best-so-far kernel time vs {'wall time' if wall else 'trial number'} "
                             "(dots: each correct trial, slow ones off the top; dashed red: the default variant)",
                          "seconds since the first trial record" if wall else "trial number", "kernel time (µs)")
        for a, ax in zip(analyses, axes):
            ok = [t for t in a.run.trials if t.status == "ok" and t.time_us]
            points = best_so_far(a.run.trials)
            start = next((t.created for t in a.run.trials if t.created is not None), None)
            if wall and start is not None:
                ax.scatter([t.created - start for t in ok if t.created], [t.time_us for t in ok if t.created],
                           s=4, color="#9ecae1")
                ax.step([p[1] for p in points], [p[2] for p in points], where="post", color="#1f77b4")
            else:
                ax.scatter([t.number for t in ok], [t.time_us for t in ok], s=4, color="#9ecae1")
                ax.step([p[0] for p in points], [p[2] for p in points], where="post", color="#1f77b4")
            if a.default_us:
                ax.axhline(a.default_us, color="#d62728", ls="--", lw=1)
            if ok:  # the range that matters: slow outliers (up to 100x) would flatten the best-so-far curve
                low = min(t.time_us for t in ok)
                ax.set_ylim(0.97 * low, 1.3 * max(a.default_us or low, points[0][2] if points else low, low))
            _small(ax, f"{a.run.shape} {a.run.dtype}")
    elif kind == "outcomes":
        fig, axes = _grid(n, "outcomes per problem", "outcome", "trials")
        short = [s.replace("_fail", "") for s in STATUSES]
        for a, ax in zip(analyses, axes):
            ax.bar(short, [a.counts.get(s, 0) for s in STATUSES], color=[STATUS_COLORS[s] for s in STATUSES])
            ax.tick_params(axis="x", rotation=60)
            _small(ax, f"{a.run.shape} {a.run.dtype}")
    elif kind == "importance":
        fig, axes = _grid(n, "parameter importance (PED-ANOVA over the correct trials)", "importance (sums to 1)", "",
                          w=3.2, left=0.95, wspace=0.5)  # room for parameter names such as row_threads
        for a, ax in zip(analyses, axes):
            if a.importances:
                names = list(a.importances)[:6][::-1]
                ax.barh(names, [a.importances[k] for k in names], color="#1f77b4")
                ax.set_xlim(0, 1)
            else:
                ax.text(0.5, 0.5, a.importance_note, ha="center", va="center", wrap=True, fontsize=7,
                        transform=ax.transAxes)
                ax.set_xticks([]), ax.set_yticks([])
            _small(ax, f"{a.run.shape} {a.run.dtype}")
    elif kind == "params":
        fig, axes = _grid(n * TOP_PARAMS, f"kernel time against the {TOP_PARAMS} most important parameters "
                                          "(one row of panels per problem)", "parameter value", "kernel time (µs)",
                          ncols=TOP_PARAMS * 2, w=2.4, h=1.9)
        for i, a in enumerate(analyses):
            names = top_params(a)
            ok = [t for t in a.run.trials if t.status == "ok" and t.time_us]
            for j in range(TOP_PARAMS):
                ax = axes[i * TOP_PARAMS + j]
                if j >= len(names):
                    ax.set_visible(False)
                    continue
                values = [str(t.params.get(names[j])) for t in ok]
                order = list(dict.fromkeys(sorted(values, key=_natural)))
                ax.scatter([order.index(v) for v in values], [t.time_us for t in ok], s=6, alpha=0.7)
                ax.set_xticks(range(len(order)), order, fontsize=6)
                _small(ax, f"{a.run.shape} {a.run.dtype}: {names[j]}")
    elif kind == "timing":
        split = any(has_split(a.run) for a in analyses)
        fig, axes = _grid(n, "compile vs verify+time seconds per trial" if split else
                          "seconds between trial records (no compile/evaluate split recorded in this store)",
                          "trial number", "seconds")
        for a, ax in zip(analyses, axes):
            if has_split(a.run):
                xs = [t.number for t in a.run.trials]
                c = [t.compile_s or 0 for t in a.run.trials]
                ax.bar(xs, c, color="#ff7f0e", label="compile")
                ax.bar(xs, [t.evaluate_s or 0 for t in a.run.trials], bottom=c, color="#1f77b4", label="evaluate")
            else:
                pairs = intervals(a.run)
                ax.bar([p[0] for p in pairs], [p[1] for p in pairs], color="#999999")
            _small(ax, f"{a.run.shape} {a.run.dtype}")
    else:
        raise ValueError(kind)
    _save(fig, path)


def _natural(text: str) -> tuple:
    try:
        return (0, float(text), "")
    except ValueError:
        return (1, 0.0, text)


def png_bandwidth(analyses: Sequence[Analysis], path: Path) -> None:
    import matplotlib.pyplot as plt

    dtypes = sorted({a.run.dtype for a in analyses if a.memory_bound and a.nbytes})
    fig, axes = plt.subplots(len(dtypes), 1, figsize=(12, 3.4 * len(dtypes) + 0.6), squeeze=False)
    refs = sorted({n for a in analyses for n in a.references if a.memory_bound})
    markers = ["D", "^", "s", "v"]
    for dtype, ax in zip(dtypes, axes[:, 0]):
        rows = [a for a in analyses if a.memory_bound and a.run.dtype == dtype and a.nbytes]
        xs = range(len(rows))
        ax.bar(xs, [a.gbps(a.best_us) or 0 for a in rows], color="#1f77b4", label="autosoft (tuned)", width=0.6)
        ax.scatter(xs, [a.gbps(a.copy_us) or math.nan for a in rows], marker="_", s=400, color="black",
                   linewidths=2.5, label="device copy of the same bytes (same tune)", zorder=3)
        ax.scatter(xs, [a.gbps(a.default_us) or math.nan for a in rows], marker="x", color="#d62728",
                   label="default variant", zorder=3)
        for name, marker, color in zip(refs, markers, REF_COLORS):
            ax.scatter(xs, [a.references.get(name, math.nan) for a in rows], marker=marker, s=30, color=color,
                       edgecolors="black", linewidths=0.5, label=f"{name} (benchmark)", zorder=3)
        ax.set_xticks(list(xs), [a.run.shape for a in rows], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{dtype}: achieved bandwidth (input read once + output written once), "
                     f"{rows[0].run.gpu if rows else ''}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        ax.set_xlim(-0.6, len(rows) - 0.4)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, frameon=False)
    fig.supxlabel("shape (rows x row length), ordered by size", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def png_tflops(analyses: Sequence[Analysis], path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [a for a in analyses if not a.memory_bound]
    fig, ax = plt.subplots(figsize=(12, 4.2))
    xs = range(len(rows))
    ax.bar(xs, [a.tflops(a.best_us) or 0 for a in rows], color="#1f77b4", label="autosoft (tuned)", width=0.6)
    ax.scatter(xs, [a.tflops(a.default_us) or math.nan for a in rows], marker="x", color="#d62728",
               label="default variant", zorder=3)
    for name, marker, color in zip(sorted({n for a in rows for n in a.references}), ["D", "^", "s", "v"], REF_COLORS):
        ax.scatter(xs, [a.references.get(name, math.nan) for a in rows], marker=marker, color=color,
                   edgecolors="black", linewidths=0.5, label=f"{name} (benchmark)", zorder=3)
    peak = peak_bound(rows)
    if peak:
        ax.axhline(peak[1], color="black", ls="--", lw=1, label=f"{peak[0]} {peak[1]:.0f} TFLOP/s")
    ax.set_xticks(list(xs), [f"{a.run.shape} {a.run.dtype}" for a in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("compute-bound families: achieved TFLOP/s", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path, tight=True)
