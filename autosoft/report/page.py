"""The report's page: one self-contained HTML file (plotly.js inlined once, nothing fetched) with the
summary table and, per problem, its figures."""
from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any, Sequence

from .analysis import NO_SPLIT_NOTE, Analysis, has_split
from .figures import (fig_bandwidth, fig_convergence, fig_importance, fig_outcomes, fig_params, fig_tflops,
                      fig_timing, peak_bound)


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222} table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 7px;text-align:right} th{background:#f3f3f3} td.l,th.l{text-align:left}
details{margin:.4em 0;border:1px solid #ddd;padding:.3em .6em} summary{cursor:pointer;font-weight:600}
.figs{display:flex;flex-wrap:wrap;gap:8px} .note{color:#666;font-size:13px} code{background:#f4f4f4}
"""


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def summary_rows(analyses: Sequence[Analysis]) -> list[dict[str, Any]]:
    """The summary table as values: what the page shows and the tests check."""
    out = []
    for a in analyses:
        out.append({"problem": a.run.label, "gpu": a.run.gpu, "variant": a.variant, "time_us": a.best_us,
                    "default_us": a.default_us,
                    "speedup": a.default_us / a.best_us if a.default_us and a.best_us else None,
                    "gbps": a.gbps(a.best_us) if a.memory_bound else None,
                    "pct_copy": a.pct_copy if a.memory_bound else None,
                    "tflops": a.tflops(a.best_us), "trials": len(a.run.trials),
                    "failed": sum(v for k, v in a.counts.items() if k != "ok"),
                    "to_1pct": a.to_1pct, "tuning_s": a.tuning_s})
    return out


def _table(analyses: Sequence[Analysis]) -> str:
    head = ("<tr><th class=l>problem</th><th class=l>variant</th><th>time (µs)</th><th>default (µs)</th>"
            "<th>× vs default</th><th>GB/s</th><th>% of copy</th><th>TFLOP/s</th><th>trials</th><th>failed</th>"
            "<th>trials to ≤1% of best</th><th>tuning time*</th></tr>")
    body = []
    for a, r in zip(analyses, summary_rows(analyses)):
        body.append(
            f"<tr><td class=l><a href='#{a.run.slug}'>{html.escape(r['problem'])}</a></td>"
            f"<td class=l><code>{html.escape(r['variant'])}</code></td><td>{_fmt(r['time_us'])}</td>"
            f"<td>{_fmt(r['default_us'])}</td><td>{_fmt(r['speedup'], '.2f', '×')}</td><td>{_fmt(r['gbps'], '.0f')}</td>"
            f"<td>{_fmt(r['pct_copy'], '.1f', '%')}</td><td>{_fmt(r['tflops'], '.1f')}</td><td>{r['trials']}</td>"
            f"<td>{r['failed']}</td><td>{r['to_1pct'] or '-'}</td><td>{_duration(r['tuning_s'])}</td></tr>")
    return f"<table id=summary>{head}{''.join(body)}</table>"


def _div(fig: dict[str, Any], div_id: str) -> str:
    import plotly.io as pio

    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, validate=False,
                       config={"displaylogo": False})


def render_page(analyses: Sequence[Analysis], source: str, pngs: Sequence[str], selectors: Sequence[str] = ()) -> str:
    from plotly.offline import get_plotlyjs

    parts = [f"<h1>autosoft report</h1><p class=note>{html.escape(source)} · {len(analyses)} problems · "
             f"written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · PNGs: "
             + ", ".join(f"<a href='{p}'>{p}</a>" for p in pngs) + "</p>",
             "<h2>Summary</h2>", _table(analyses),
             "<p class=note>* tuning time: last minus first trial record of the problem (leaves out the first "
             "trial's own evaluation and the finalists' re-timing: an approximation). Time: the stored entry "
             "(the finalists re-timed side by side), else the best trial. % of copy: a device-to-device copy of "
             "the same bytes, timed in the same tune, over the kernel time.</p>",
             "<h2>Selectors</h2>",
             ("<ul id=selectors>" + "".join(f"<li>{html.escape(line)}</li>" for line in selectors) + "</ul>"
              if selectors else "<p class=note>no selector in the cache (autosoft generalize FAMILY fits one): "
                                "an untuned shape borrows the nearest tuned entry</p>"),
             "<h2>Across problems</h2>"]
    memory = [a for a in analyses if a.memory_bound and a.nbytes]
    for dtype in sorted({a.run.dtype for a in memory}):
        parts.append(_div(fig_bandwidth(memory, dtype), f"bandwidth-{dtype}"))
    compute = [a for a in analyses if not a.memory_bound]
    if compute:
        parts.append(_div(fig_tflops(compute), "tflops"))
        if not peak_bound(compute):
            parts.append("<p class=note>no measured or datasheet peak known for this GPU; the chart shows achieved TFLOP/s "
                         "and the benchmark's figures only</p>")
    if not memory and not compute:
        parts.append("<p class=note>no problem of a known family: no bandwidth or TFLOP/s chart</p>")
    parts.append("<h2>Per problem</h2>")
    if not any(has_split(a.run) for a in analyses):
        parts.append(f"<p class=note>Compile against timing: {html.escape(NO_SPLIT_NOTE)}.</p>")
    for a in analyses:
        s = a.run.slug
        fails = "".join(f"<li><b>{html.escape(k)}</b> ({a.counts[k]}): {html.escape(m)}</li>"
                        for k, m in a.first_messages.items())
        figs = [_div(fig_convergence(a, False), f"{s}-convergence"), _div(fig_convergence(a, True), f"{s}-wall"),
                _div(fig_outcomes(a), f"{s}-outcomes"), _div(fig_importance(a), f"{s}-importance"),
                _div(fig_params(a), f"{s}-params"), _div(fig_timing(a), f"{s}-timing")]
        parts.append(
            f"<details class=problem id='{s}'><summary>{html.escape(a.run.label)} on {html.escape(a.run.gpu)}: "
            f"{_fmt(a.best_us)} µs, {len(a.run.trials)} trials</summary>"
            + (f"<p>failures (first message of each kind):</p><ul>{fails}</ul>" if fails else
               "<p class=note>no failed trial</p>")
            + f"<div class=figs>{''.join(figs)}</div></details>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>autosoft report</title>"
            f"<style>{_CSS}</style><script type='text/javascript'>{get_plotlyjs()}</script></head><body>"
            + "\n".join(parts) + "</body></html>")
