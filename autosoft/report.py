"""`autosoft report`: what a tuning run found, as plots, from stored data alone (no GPU).

Reads a tuned cache (its entries and its `trials` log) and/or an Optuna storage (the study of
each problem, named by tune.study_name), optionally benchmark JSONs (torch/Triton figures), and
writes DIR/index.html (self-contained: plotly.js inlined once, nothing fetched) and one PNG per
figure kind (matplotlib; the per-problem kinds as one grid of subplots per kind, so that 48
problems stay a few seconds of drawing).

Per problem: best-so-far time against trial number and against wall time with the default as a
line; outcome counts with the first message line of each failure kind; parameter importances
(Optuna's PED-ANOVA, which needs no scikit-learn); time against the most important parameters;
compile against evaluation time where the store records the split. Across problems: achieved
GB/s against the copy bandwidth measured in the same tune (and torch/Triton from benchmarks)
for memory-bound families, TFLOP/s for compute-bound ones, and a summary table.

Storage URLs: those of autosoft.storage.open_storage (`sqlite:///path`, a journal file `journal:///path`
or a plain path ending in `.log` / `.journal`, `postgresql://...`), opened without changing anything.
"""
from __future__ import annotations

import html
import json
import math
import os
import sqlite3
import time
import urllib.parse
import warnings
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from .board import is_board_study
from .cache import Cache, Entry, default_cache_path
from .errors import UserError, one_line
from .families import get_family
from .families.base import Family, Problem, Target
from .storage import open_storage

STATUSES = ("ok", "compile_fail", "launch_fail", "timeout", "wrong", "invalid")
STATUS_COLORS = {"ok": "#2ca02c", "compile_fail": "#ff7f0e", "launch_fail": "#d62728", "timeout": "#9467bd",
                 "wrong": "#8c564b", "invalid": "#7f7f7f"}
MIN_IMPORTANCE_TRIALS = 4  # PED-ANOVA compares the best quantile with the rest: below this it says nothing
TOP_PARAMS = 3
# Dense fp16/bf16 tensor-core peak from the datasheet (TFLOP/s), matched on the GPU name: the bound
# drawn for compute-bound problems whose studies carry no measured peak (a tune measures one, a
# dense float16 matrix product on its GPU, and keeps it as the study's "peak_tflops").
DATASHEET_PEAK_TFLOPS = {"H200": 989.4, "H100 80GB HBM3": 989.4, "H100 SXM": 989.4, "H100 PCIe": 756.0,
                         "A100": 312.0}
REF_COLORS = ("#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")  # never the autosoft bars' blue
PNG_KINDS = ("convergence", "convergence_wall", "outcomes", "importance", "params", "timing")
INSTALL_HINT = "pip install 'autosoft[report]'"


# --- values ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Trial:
    number: int                    # 1-based place in the problem's log
    params: Mapping[str, Any]
    status: str
    time_us: float | None
    message: str
    created: float | None          # seconds since the epoch, when the trial was recorded
    compile_s: float | None = None  # only where the store records the split (study user_attrs)
    evaluate_s: float | None = None


@dataclass(frozen=True)
class ProblemRun:
    family: str
    dtype: str
    shape: str
    gpu: str
    trials: tuple[Trial, ...]
    entry: Entry | None
    cc: str | None = None
    peak_tflops: float | None = None  # measured in the tune (study user attribute), compute-bound only

    @property
    def label(self) -> str:
        return f"{self.family} {self.shape} {self.dtype}"

    @property
    def slug(self) -> str:
        text = f"{self.family}-{self.dtype}-{self.shape}-{self.gpu}"
        return "".join(c if c.isalnum() else "-" for c in text).strip("-").lower()


@dataclass(frozen=True)
class Analysis:
    run: ProblemRun
    best_us: float | None          # the entry's time (re-timed winner), else the best trial's
    variant: str
    default_us: float | None
    default_params: Mapping[str, Any] | None
    copy_us: float | None
    nbytes: int | None
    flops: float | None
    counts: Mapping[str, int]
    first_messages: Mapping[str, str]
    tuning_s: float | None         # last - first trial record: leaves out the first evaluation and re-timing
    to_1pct: int | None            # trials until the best-so-far was within 1% of the final best
    importances: Mapping[str, float] | None
    importance_note: str
    references: Mapping[str, float] = field(default_factory=dict)  # "torch" -> GB/s or TFLOP/s

    @property
    def memory_bound(self) -> bool:
        return not self.flops

    def gbps(self, us: float | None) -> float | None:
        return self.nbytes / us / 1e3 if us and self.nbytes else None

    def tflops(self, us: float | None) -> float | None:
        return self.flops / us / 1e6 if us and self.flops else None

    @property
    def pct_copy(self) -> float | None:
        return 100 * self.copy_us / self.best_us if self.copy_us and self.best_us else None


@dataclass(frozen=True)
class ReportResult:
    index: Path
    pngs: tuple[Path, ...]
    problems: int
    seconds: float


# --- reading the stores ---------------------------------------------------------------------------

def _require_libraries() -> None:
    try:
        import matplotlib  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        raise UserError(f"autosoft report needs matplotlib and plotly ({exc.name} is missing): {INSTALL_HINT}") from None


def _parse_study_name(name: str) -> tuple[str, str, str, str, str, str] | None:
    """family/dtype/shape/gpu/cc/nvrtc/tdigest/sdigest (tune.study_name); the GPU name may hold '/'.
    None for any other study, a batch's board included (board.py)."""
    if is_board_study(name):
        return None
    parts = name.split("/")
    if len(parts) < 8:
        return None
    family, dtype, shape, *gpu, cc, nvrtc, _t, _s = parts
    return family, dtype, shape, "/".join(gpu), cc, nvrtc


def _cache_trials(cache: Cache) -> dict[tuple[str, str, str, str], list[Trial]]:
    by_problem: dict[tuple[str, str, str, str], list[Trial]] = {}
    try:
        rows = list(cache.trials())
    except sqlite3.DatabaseError as exc:
        raise UserError(f"cache {cache.path}: unreadable trials ({one_line(exc)})") from None
    for r in rows:  # ordered by created
        try:
            params = json.loads(r["params"])
        except (TypeError, ValueError):
            continue  # a damaged row: the rest of the log still tells its story
        if not isinstance(params, dict):
            continue
        key = (r["family"], r["dtype"], r["shape"], r["gpu_name"])
        trials = by_problem.setdefault(key, [])
        time_us = r["time_us"] if isinstance(r["time_us"], (int, float)) and r["time_us"] > 0 else None
        created = r["created"] if isinstance(r["created"], (int, float)) else None
        trials.append(Trial(len(trials) + 1, params, str(r["status"]), time_us, str(r["message"] or ""), created))
    return by_problem


def _study_trials(storage: Any, messages: Mapping[tuple, str]) -> dict[tuple, tuple[list[Trial], str, str, float | None]]:
    """Each autosoft study's finished trials (the pruned ones are the sampler's raw suggestions,
    never measured), keyed like the cache's trial log, with compute capability and NVRTC version."""
    import optuna
    from optuna.trial import TrialState

    out: dict[tuple, tuple[list[Trial], str, str, float | None]] = {}
    try:
        summaries = storage.get_all_studies()
    except Exception as exc:  # noqa: BLE001
        raise UserError(f"storage: cannot list its studies ({one_line(exc)[:160]})") from None
    for s in summaries:
        parsed = _parse_study_name(s.study_name)
        if parsed is None:
            continue  # not an autosoft study
        family, dtype, shape, gpu, cc, nvrtc = parsed
        study = optuna.load_study(study_name=s.study_name, storage=storage)
        trials: list[Trial] = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            status = str(t.user_attrs.get("status") or ("ok" if t.state == TrialState.COMPLETE else "launch_fail"))
            done = t.datetime_complete or t.datetime_start
            params = dict(t.params)
            message = messages.get((family, dtype, shape, gpu, json.dumps(params, sort_keys=True)), "")
            trials.append(Trial(len(trials) + 1, params, status, t.value if status == "ok" else None, message,
                                done.timestamp() if done else None,
                                _number(t.user_attrs.get("compile_s")), _number(t.user_attrs.get("evaluate_s"))))
        key = (family, dtype, shape, gpu)
        if trials and (key not in out or len(trials) > len(out[key][0])):
            out[key] = (trials, cc, nvrtc, _number(study.user_attrs.get("peak_tflops")))
    return out


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def load_runs(cache_path: Path | None = None, storage_url: str | None = None, *, families: Sequence[str] = (),
              shapes: Sequence[str] = (), dtypes: Sequence[str] = ()) -> list[ProblemRun]:
    """The tuned problems of the stores, filtered. Per-trial data from the storage's studies when a
    storage is given, else from the cache's trial log; entries from the cache (the one given, the
    one beside a `<stem>-studies.sqlite` storage, or the default cache when neither is given)."""
    if storage_url is None and cache_path is None:
        cache_path = default_cache_path()
    if cache_path is None and storage_url and storage_url.startswith("sqlite:///"):
        beside = Path(urllib.parse.unquote(storage_url[len("sqlite:///"):])).expanduser()
        if beside.name.endswith("-studies.sqlite"):
            candidate = beside.with_name(beside.name[:-len("-studies.sqlite")] + ".sqlite")
            cache_path = candidate if candidate.is_file() else None
    cache = None
    if cache_path is not None:
        if not Path(cache_path).exists():
            raise UserError(f"cache {cache_path}: no such file; pass --cache FILE (autosoft tune writes it)")
        cache = Cache(cache_path, create=False)  # validates: corrupt, foreign, empty -> UserError
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a malformed entry is skipped; `autosoft list` names it
        entries = cache.entries() if cache else []
    cache_trials = _cache_trials(cache) if cache else {}
    newest: dict[tuple, Entry] = {}
    for e in sorted(entries, key=lambda e: e.created):
        newest[(e.key.family, e.key.dtype, e.key.shape, e.key.gpu_name)] = e

    keys: dict[tuple, tuple[list[Trial], str | None, float | None]] = {}
    if storage_url:
        messages = {(*k, json.dumps(dict(t.params), sort_keys=True)): t.message
                    for k, ts in cache_trials.items() for t in ts if t.message}
        for key, (trials, cc, _nvrtc, peak) in _study_trials(open_storage(storage_url), messages).items():
            keys[key] = (trials, cc, peak)
    else:
        for key, trials in cache_trials.items():
            keys[key] = (trials, None, None)
    for key in newest:
        keys.setdefault(key, ([], None, None))
    if not keys:
        where = storage_url or str(cache_path)
        raise UserError(f"{where}: holds no tuned problem (no entries and no trials); run autosoft tune first")

    runs = []
    for (family, dtype, shape, gpu), (trials, cc, peak) in keys.items():
        if (families and family not in families) or (shapes and shape not in shapes) or (dtypes and dtype not in dtypes):
            continue
        entry = newest.get((family, dtype, shape, gpu))
        runs.append(ProblemRun(family, dtype, shape, gpu, tuple(trials), entry,
                               cc or (entry.key.compute_capability if entry else None), peak))
    if not runs:
        asked = " ".join([*(f"--family {f}" for f in families), *(f"--shape {s}" for s in shapes),
                          *(f"--dtype {d}" for d in dtypes)])
        have = sorted({f"{k[0]} {k[2]} {k[1]}" for k in keys})
        raise UserError(f"no tuned problem matches {asked}; the store holds {len(have)}, e.g. {', '.join(have[:3])}")
    return sorted(runs, key=_run_order)


def _run_order(run: ProblemRun) -> tuple:
    dims, _, flags = run.shape.partition("+")
    try:
        size = math.prod(int(d) for d in dims.replace(",", "x").split("x"))
    except ValueError:
        size = 0
    return (run.family, run.dtype, size, run.shape, run.gpu)


def read_bench(paths: Sequence[Path]) -> dict[tuple[str, str], dict[str, float]]:
    """Benchmark rows by (shape text, dtype): every `<name>_gbps` / `<name>_tflops` figure other than
    autosoft's and the default's, as {name: value}. The shape text is the cache's (`+causal` added)."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
            rows = data["rows"]
            if not isinstance(rows, list):
                raise TypeError("rows is not a list")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--bench {path}: not a benchmark JSON with a list of rows ({one_line(exc)[:100]})") from None
        for row in rows:
            if not isinstance(row, dict) or "shape" not in row or "dtype" not in row:
                continue
            shape = str(row["shape"]) + ("+causal" if row.get("causal") else "")
            figures = {k.rsplit("_", 1)[0]: float(v) for k, v in row.items()
                       if k.endswith(("_gbps", "_tflops")) and isinstance(v, (int, float))
                       and not k.startswith(("autosoft_", "default_"))}
            out.setdefault((shape, str(row["dtype"])), {}).update(figures)
    return out


# --- analysis -------------------------------------------------------------------------------------

def analyse(run: ProblemRun, bench: Mapping[tuple[str, str], Mapping[str, float]] | None = None) -> Analysis:
    family, problem = _family_problem(run)
    default_params = None
    if family is not None and problem is not None:
        target = Target.for_arch(run.cc or "90")
        target = Target(arch=target.arch, name=run.gpu, sm_count=target.sm_count, smem_optin=target.smem_optin,
                        l2_bytes=target.l2_bytes)
        try:
            default_params = family.default_params(problem, target)
        except Exception:  # noqa: BLE001 - a family's heuristic failing must not stop the report
            default_params = None
    ok = [t for t in run.trials if t.status == "ok" and t.time_us]
    default_us = next((t.time_us for t in ok if default_params is not None and dict(t.params) == default_params), None)
    if default_us is None and run.entry is not None:
        default_us = run.entry.default_time_us
    best_trial = min(ok, key=lambda t: t.time_us) if ok else None
    best_us = run.entry.time_us if run.entry else (best_trial.time_us if best_trial else None)
    variant = run.entry.variant_name if run.entry else (_trial_name(run, best_trial) if best_trial else "-")
    counts = Counter(t.status for t in run.trials)
    first_messages: dict[str, str] = {}
    for t in run.trials:
        if t.status != "ok" and t.status not in first_messages:
            first_messages[t.status] = (t.message.strip().splitlines() or ["(no message recorded)"])[0][:300]
    stamps = [t.created for t in run.trials if t.created is not None]
    tuning_s = max(stamps) - min(stamps) if len(stamps) > 1 else None
    to_1pct = None
    if best_trial is not None:
        final = best_trial.time_us
        running = math.inf
        for i, t in enumerate(run.trials, 1):
            if t.status == "ok" and t.time_us:
                running = min(running, t.time_us)
            if running <= 1.01 * final:
                to_1pct = i
                break
    importances, note = param_importances(run.trials)
    nbytes = flops = None
    if family is not None and problem is not None:
        nbytes = family.bytes_moved(problem)
        flops = family.flops(problem) or None
    refs = dict((bench or {}).get((run.shape, run.dtype), {}))
    return Analysis(run, best_us, variant, default_us, default_params,
                    run.entry.copy_time_us if run.entry else None, nbytes, flops, dict(counts), first_messages,
                    tuning_s, to_1pct, importances, note, refs)


def _family_problem(run: ProblemRun) -> tuple[Family | None, Problem | None]:
    try:
        family = get_family(run.family)
        return family, family.parse_problem(run.shape, run.dtype)
    except (UserError, ValueError, TypeError):
        return None, None  # a family this autosoft does not know: times only, no bandwidth or default


def _trial_name(run: ProblemRun, trial: Trial) -> str:
    family, problem = _family_problem(run)
    if family is None or problem is None:
        return "-"
    try:
        return family.variant_name(problem, trial.params)
    except Exception:  # noqa: BLE001
        return "-"


def param_importances(trials: Sequence[Trial]) -> tuple[dict[str, float] | None, str]:
    """PED-ANOVA importances over the correct trials (params that varied among them), most important
    first; (None, why) when there are too few trials or the evaluator fails."""
    ok = [t for t in trials if t.status == "ok" and t.time_us]
    if len(ok) < MIN_IMPORTANCE_TRIALS:
        return None, f"not enough trials: {len(ok)} correct, importance needs at least {MIN_IMPORTANCE_TRIALS}"
    names = sorted({n for t in ok for n in t.params})
    varied = [n for n in names if len({json.dumps(t.params.get(n)) for t in ok}) > 1]
    if not varied:
        return None, "no parameter varied among the correct trials"
    try:
        import optuna
        from optuna.distributions import CategoricalDistribution

        choices = {n: list(dict.fromkeys(_plain(t.params.get(n)) for t in ok)) for n in varied}
        dists = {n: CategoricalDistribution(c) for n, c in choices.items()}
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per in-memory study
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ExperimentalWarning for PED-ANOVA
                study = optuna.create_study(direction="minimize")
                study.add_trials([optuna.trial.create_trial(params={n: _plain(t.params.get(n)) for n in varied},
                                                            distributions=dists, value=t.time_us) for t in ok])
                result = optuna.importance.get_param_importances(
                    study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
        finally:
            optuna.logging.set_verbosity(verbosity)
    except Exception as exc:  # noqa: BLE001 - importance is a hint; its failure must not stop the report
        return None, f"importance could not be computed ({one_line(exc)[:120]})"
    return dict(sorted(result.items(), key=lambda kv: -kv[1])), f"PED-ANOVA over {len(ok)} correct trials"


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def best_so_far(trials: Sequence[Trial]) -> list[tuple[int, float | None, float]]:
    """(trial number, seconds since the first record, best correct time so far) at every correct trial."""
    start = next((t.created for t in trials if t.created is not None), None)
    out, running = [], math.inf
    for t in trials:
        if t.status == "ok" and t.time_us:
            running = min(running, t.time_us)
            out.append((t.number, (t.created - start) if start is not None and t.created is not None else None, running))
    return out


def top_params(a: Analysis) -> list[str]:
    if a.importances:
        return list(a.importances)[:TOP_PARAMS]
    ok = [t for t in a.run.trials if t.status == "ok"]
    names = sorted({n for t in ok for n in t.params})
    return [n for n in names if len({json.dumps(t.params.get(n)) for t in ok}) > 1][:TOP_PARAMS]


def has_split(run: ProblemRun) -> bool:
    return any(t.compile_s is not None or t.evaluate_s is not None for t in run.trials)


NO_SPLIT_NOTE = ("this store records no compile/evaluate split per trial; shown: seconds between consecutive "
                 "trial records (compilation overlaps evaluation, so this is the tune's throughput)")


def intervals(run: ProblemRun) -> list[tuple[int, float]]:
    out, last = [], None
    for t in run.trials:
        if t.created is not None and last is not None:
            out.append((t.number, max(0.0, t.created - last)))
        last = t.created if t.created is not None else last
    return out


# --- plotly figures (dicts, not graph objects: no validation cost for a few hundred figures) -------

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
    peak = _peak(rows)
    if peak:
        data.append({"type": "scatter", "mode": "lines", "x": [labels[0], labels[-1]], "y": [peak[1]] * 2,
                     "name": f"{peak[0]} {peak[1]:.0f}", "line": {"dash": "dash", "color": "black"}})
    return {"data": data, "layout": _layout("compute-bound families: achieved TFLOP/s", "problem", "TFLOP/s",
                                            width=1100, height=420, legend={"orientation": "h", "y": 1.12})}


def _peak(rows: Sequence[Analysis]) -> tuple[str, float] | None:
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
    peak = _peak(rows)
    if peak:
        ax.axhline(peak[1], color="black", ls="--", lw=1, label=f"{peak[0]} {peak[1]:.0f} TFLOP/s")
    ax.set_xticks(list(xs), [f"{a.run.shape} {a.run.dtype}" for a in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("TFLOP/s")
    ax.set_title("compute-bound families: achieved TFLOP/s", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    _save(fig, path, tight=True)


# --- the page -------------------------------------------------------------------------------------

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


def render_page(analyses: Sequence[Analysis], source: str, pngs: Sequence[str]) -> str:
    from plotly.offline import get_plotlyjs

    parts = [f"<h1>autosoft report</h1><p class=note>{html.escape(source)} · {len(analyses)} problems · "
             f"written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · PNGs: "
             + ", ".join(f"<a href='{p}'>{p}</a>" for p in pngs) + "</p>",
             "<h2>Summary</h2>", _table(analyses),
             "<p class=note>* tuning time: last minus first trial record of the problem (leaves out the first "
             "trial's own evaluation and the finalists' re-timing: an approximation). Time: the stored entry "
             "(the finalists re-timed side by side), else the best trial. % of copy: a device-to-device copy of "
             "the same bytes, timed in the same tune, over the kernel time.</p>",
             "<h2>Across problems</h2>"]
    memory = [a for a in analyses if a.memory_bound and a.nbytes]
    for dtype in sorted({a.run.dtype for a in memory}):
        parts.append(_div(fig_bandwidth(memory, dtype), f"bandwidth-{dtype}"))
    compute = [a for a in analyses if not a.memory_bound]
    if compute:
        parts.append(_div(fig_tflops(compute), "tflops"))
        if not _peak(compute):
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


# --- the whole report -----------------------------------------------------------------------------

def check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"-o {out}: is a file; give a folder to write the report into")
    for above in out.parents:
        if above.exists():
            if not above.is_dir():
                raise UserError(f"-o {out}: {above} is a file, not a folder")
            break


def build_report(out: Path, *, cache_path: Path | None = None, storage_url: str | None = None,
                 families: Sequence[str] = (), shapes: Sequence[str] = (), dtypes: Sequence[str] = (),
                 bench: Sequence[Path] = ()) -> ReportResult:
    """Write DIR/index.html and the PNGs. Every check runs before anything is written: a bad store,
    filter or output path raises UserError and leaves the disk as it was."""
    start = time.perf_counter()
    _require_libraries()
    out = Path(out).expanduser()
    check_output_dir(out)
    refs = read_bench(bench)
    runs = load_runs(cache_path, storage_url, families=families, shapes=shapes, dtypes=dtypes)
    analyses = [analyse(r, refs) for r in runs]
    source = " + ".join(x for x in (f"cache {cache_path}" if cache_path else "",
                                    f"storage {storage_url}" if storage_url else "") if x) or \
        f"cache {default_cache_path()}"

    import matplotlib
    matplotlib.use("Agg", force=True)  # files only: never a display

    try:
        return _write_report(out, analyses, source, start)
    except OSError as exc:  # an unwritable place (/proc, a read-only folder) or a full disk
        raise UserError(f"-o {out}: cannot write the report there ({exc.strerror or one_line(exc)}"
                        f"{': ' + str(exc.filename) if exc.filename else ''})") from None


def _write_report(out: Path, analyses: Sequence[Analysis], source: str, start: float) -> ReportResult:
    """The PNGs and the page, each written whole (a temporary file, then a rename)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    names: list[str] = []
    memory = [a for a in analyses if a.memory_bound and a.nbytes]
    jobs: list[tuple[str, Any]] = []
    if memory:
        jobs.append(("bandwidth.png", lambda p: png_bandwidth(memory, p)))
    compute = [a for a in analyses if not a.memory_bound]
    if compute:
        jobs.append(("tflops.png", lambda p: png_tflops(compute, p)))
    for kind in PNG_KINDS:
        jobs.append((f"{kind}.png", lambda p, kind=kind: png_per_problem(kind, analyses, p)))
    for name, draw in jobs:
        path = out / name
        tmp = out / f".{name}.{os.getpid()}.png"
        try:
            draw(tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        written.append(path)
        names.append(name)
    page = render_page(analyses, source, names)
    tmp = out / f".index.{os.getpid()}.html"  # open() honours the umask, as the PNGs do
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, out / "index.html")
    finally:
        tmp.unlink(missing_ok=True)
    return ReportResult(out / "index.html", tuple(written), len(analyses), time.perf_counter() - start)
