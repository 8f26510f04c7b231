"""The report's data, read from the stores without changing them: a tuned cache (its entries and its
`trials` log) and/or an Optuna storage (the study of each problem, named by tune.study_name), and
benchmark JSONs (torch/Triton figures). Storage URLs are those of autosoft.storage.open_storage
(`sqlite:///path`, a journal file `journal:///path` or a plain path ending in `.log` / `.journal`,
`postgresql://...`)."""
from __future__ import annotations

import json
import math
import sqlite3
import urllib.parse
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..board import is_board_study
from ..cache import Cache, Entry, default_cache_path
from ..errors import UserError, one_line
from ..search import plain_params
from ..storage import open_storage


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
            params = plain_params(t.params)
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
