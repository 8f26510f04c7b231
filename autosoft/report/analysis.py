"""What the report says of each tuned problem: the best and default times, the outcome counts with the
first message of each failure kind, how fast the search got within 1 % of its best, and parameter
importances (Optuna's PED-ANOVA, which needs no scikit-learn)."""
from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import UserError, one_line
from ..families import get_family
from ..families.base import Family, Problem, Target
from .loading import ProblemRun, Trial


STATUSES = ("ok", "compile_fail", "launch_fail", "timeout", "wrong", "invalid")


MIN_IMPORTANCE_TRIALS = 4  # PED-ANOVA compares the best quantile with the rest: below this it says nothing


TOP_PARAMS = 3


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
