"""The tuning job: search a family's space for one problem and store the fastest correct variant.

The search (search.py) decides what to try; a Runner (runners.py) decides how a candidate is
evaluated: the GPU worker with its compile pool ahead of the GPU, or a replay of recorded
trials. tune_problem() is the pipeline that tune() and a batch worker (batch.py) both run; it is
the parts below, in order:

- open_study: the Optuna study beside the cache file, fresh or resumed, over the valid points
  (the runner's recorded points, for a replay), its first points the default, what the cache
  already knows (warm_start_points: the family selector's pick and the winners of the nearest
  tuned shapes) and the family's seeds;
- measure_default: the family's default first; it sets the watchdog and the baseline;
- run_trials: the evaluation loop, search <-> runner, keeping `runner.depth` candidates in flight;
- Ledger: the bookkeeping of each finished trial (study, trial log, best, progress);
- confirm_best: the fastest few and the default, re-timed side by side, decide the winner and its speed-up;
- make_entry: the cache entry; only a correct variant can become one.

Each evaluated variant, failures included, is recorded in the cache file's trial log and in
the study as soon as it finishes, so an interrupted tune loses at most the candidates in
flight and `--resume` continues it.
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ._version import __version__
from .cache import Cache, Entry
from .dispatch import cache_key, find_selector, key_distance, nvrtc_match, selector_pick
from .errors import UserError
from .evaluate import Outcome, Status
from .families import get_family
from .families.base import Family, Problem, Target, Variant, build_variant, is_valid, space_of
from .families.base import valid_points as family_valid_points
from .runners import GpuRunner, Pending, Runner
from .runtime import DeviceInfo, LoadedVariant
from .search import Search
from .selector import params_key
from .space import ParamValue
from .storage import default_storage_url, interrupts_held
from .worker import Watchdog

_WARMUP, _REPS = 3, 40  # launches per evaluation besides verification (see evaluate.time_variant)
FINALISTS = 4  # fastest distinct variants of a search that are timed again side by side
WARM_NEAREST = 3  # tuned shapes nearest a new one whose winners a warm-started tune tries first
# how a warm-started tune ranks a family seed that none of those shapes ran: as if this much slower
# than the best there (a seed that ran within it there goes first, one that ran slower after it)
WARM_UNKNOWN_RATIO = 1.10


@dataclass(frozen=True)
class Measured:
    variant: Variant
    outcome: Outcome


@dataclass
class TuneReport:
    problem: Problem
    device: DeviceInfo
    best: Measured | None
    default: Measured
    copy_time_us: float
    trials: list[Measured] = field(default_factory=list)
    resumed: int = 0          # trials taken from an earlier run of the same study
    seconds: float = 0.0
    worker_restarts: int = 0
    stored: bool = False
    peak_tflops: float | None = None  # compute-bound families: the GPU's measured tensor-core rate
    entry: Entry | None = None  # the winner's cache entry, stored or not (a faster one was there)
    measured_here: int = 0    # trials this worker measured in this run (a batch's helpers measure others)
    reaped: int = 0           # trials of workers taken for dead, run again (search.Search.reaped)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.trials:
            out[m.outcome.status.value] = out.get(m.outcome.status.value, 0) + 1
        return out

    @property
    def trials_per_minute(self) -> float:
        new = len(self.trials) - self.resumed
        return new / max(1e-9, self.seconds / 60)


def launches_text(variant: Variant) -> str:
    return "; ".join(f"{l.kernel} grid={l.grid} block={l.block} smem={l.shared_mem}B" for l in variant.launches)


def study_storage(cache: Cache) -> str:
    return default_storage_url(cache.path, 1)


def study_name(family: Family, problem: Problem, device: DeviceInfo) -> str:
    key = cache_key(problem, device, family)
    return "/".join((key.family, key.dtype, key.shape, key.gpu_name, key.compute_capability, key.cuda_version,
                     key.template_digest[:16], key.space_digest[:16]))


ProgressFn = Callable[[int, int, "Measured | None", "Measured"], None]


def tune(family: Family | str, problem: Problem, trials: int, cache: Cache, *, runner: Runner | None = None,
         seed: int = 0, progress: ProgressFn | None = None, resume: bool = False,
         watchdog: Watchdog = Watchdog(), workers: int | None = None, warm_start: bool = True) -> TuneReport:
    """Tune one problem: `trials` evaluations (the default's included), the finalists re-timed
    side by side, the winner stored in `cache` unless a faster entry is there.

    runner: how candidates are evaluated. By default a GpuRunner with `workers` compiler
    processes, made for this call and closed after it; a caller tuning many problems passes
    its own runner to reuse it (and closes it). resume: continue this problem's study instead
    of starting afresh; its finished trials are not evaluated again. warm_start: try what the
    cache knows first (warm_start_points); off, the search starts from the family's seeds alone.
    """
    family = get_family(family) if isinstance(family, str) else family
    own_runner = runner is None
    runner = runner if runner is not None else GpuRunner(workers=workers)
    try:
        return tune_problem(family, problem, trials, cache, runner, seed=seed, resume=resume, watchdog=watchdog,
                            progress=progress, warm_start=warm_start)
    finally:
        if own_runner:
            runner.close()


@dataclass(frozen=True)
class SharedStudy:
    """How a batch worker shares a problem's study with other workers (batch.py): the storage
    they all use, this worker's id on the board, whether another worker is alive, and how
    long to wait between looks at the trials the others still run."""
    storage: Any
    worker: str
    is_live: Callable[[str], bool]
    poll_s: float = 0.5


def tune_problem(family: Family, problem: Problem, trials: int, cache: Cache, runner: Runner, *, seed: int = 0,
                 resume: bool = False, watchdog: Watchdog = Watchdog(), progress: ProgressFn | None = None,
                 shared: SharedStudy | None = None, warm_start: bool = True) -> TuneReport:
    """The tuning pipeline, which tune() and a batch worker both run: the study, the default, the
    trials, the finalists re-timed side by side, the copy time and the peak, the cache entry.

    shared: the study is shared with other workers (a batch), who may measure its trials too;
    this worker waits for the ones they still run, then re-times the finalists of every worker's
    trials and writes the entry. The report's `entry` is the winner's entry (stored or not)."""
    start = time.perf_counter()
    device = runner.device
    target = device.target
    restarts_before = runner.restarts
    search = open_study(family, problem, device, cache, runner, seed=seed, resume=resume,
                        storage=shared.storage if shared else None, worker=shared.worker if shared else None,
                        is_live=shared.is_live if shared else None, warm_start=warm_start)
    ledger = Ledger(search, cache, problem, device, trials, progress,
                    default_params=family.default_params(problem, target),
                    resumed=resumed_trials(search, family, problem, target))
    default = measure_default(family, problem, target, runner, search, ledger, seed, watchdog.cap_s)
    timeout_s = watchdog.limit(default.outcome.time_us, evaluation_launches(family))
    while True:
        run_trials(family, problem, target, runner, search, ledger, trials, seed, timeout_s)
        if shared is None:
            break
        search.refresh()  # helpers' trials, and dead workers' trials reaped (this worker re-runs those)
        if search.spent() < trials and not search.exhausted:
            continue
        if search.running_elsewhere == 0:
            break
        time.sleep(shared.poll_s)
    # alone, this worker's own record (with each outcome's message); shared, every worker's trials
    measured = ledger.measured if shared is None else resumed_trials(search, family, problem, target)
    confirmed = confirm_best(family, runner, measured, timeout_s, default)
    if confirmed:
        best, default = confirmed[0], confirmed[1] or default
    else:
        best = min((m for m in measured if m.outcome.ok), key=lambda m: m.outcome.time_us, default=None)
    copy_us = runner.time_copy(family.bytes_moved(problem) // 2)
    peak = runner.peak_tflops() if family.flops(problem) else None
    if peak is not None:  # kept with the study: `autosoft report --storage` draws the bound
        search.note("peak_tflops", peak)
    entry = make_entry(family, problem, device, best, default, copy_us) if best is not None else None
    stored = entry is not None and cache.put(entry)
    if stored:
        runner.keep(best.variant)  # the first call after the tune loads it without NVRTC
    return TuneReport(problem, device, best, default, copy_us, measured, ledger.resumed,
                      seconds=time.perf_counter() - start, worker_restarts=runner.restarts - restarts_before,
                      stored=stored, peak_tflops=peak, entry=entry,
                      measured_here=len(ledger.measured) - ledger.resumed, reaped=search.reaped)


def tuned_kernel(family: Family | str, problem: Problem, cache: Cache, trials: int, *,
                 runner: Runner | None = None, seed: int = 0) -> tuple[LoadedVariant, bool]:
    """The problem's tuned kernel from `cache`, loaded on the current device, after tuning it into
    the cache with `trials` trials when the cache holds no entry for this GPU: what a benchmark
    needs ("tune or load"). Returns (loaded variant, whether it was tuned now). Raises
    RuntimeError when tuning finds no correct variant."""
    from .kernel_store import default_store
    from .runtime import device_info

    family = get_family(family) if isinstance(family, str) else family
    device = device_info()
    entry = cache.get(cache_key(problem, device, family))
    tuned_now = entry is None
    if entry is None:
        tune(family, problem, trials, cache, runner=runner, seed=seed)
        entry = cache.get(cache_key(problem, device, family))
    if entry is None:
        raise RuntimeError(f"tuning found no correct {family.name} variant for {problem.shape_text} {problem.dtype}")
    variant = build_variant(family, problem, entry.params, device.target)
    return LoadedVariant(variant, default_store().get_or_compile(variant)), tuned_now


def evaluation_launches(family: Family) -> int:
    """Launches of one evaluation: one per verification input kind, then warm-up and timed runs."""
    return len(family.input_kinds) + _WARMUP + _REPS


# --- the study ----------------------------------------------------------------------------------

def valid_points(family: Family, problem: Problem, target: Target,
                 candidates: list[dict[str, ParamValue]] | None) -> list[dict[str, ParamValue]]:
    """The points the search may propose: every valid point of the space on this target (no
    engine built for another architecture), or, when the runner can evaluate only some (a
    replay), those of its candidates that are valid in the current space (a recorded point whose
    parameter or value the space no longer declares drops out)."""
    if candidates is None:
        return family_valid_points(family, problem, target)
    space = space_of(family)
    out: list[dict[str, ParamValue]] = []
    for params in candidates:
        try:
            checked = space.check_values(params)
        except UserError:
            continue
        if is_valid(family, problem, target, checked) and checked not in out:
            out.append(checked)
    return out


def open_study(family: Family, problem: Problem, device: DeviceInfo, cache: Cache, runner: Runner, *,
               seed: int, resume: bool, storage: Any = None, worker: str | None = None,
               is_live: Callable[[str], bool] | None = None, warm_start: bool = True, reaps: bool = True) -> Search:
    """The search over the problem's valid points, its Optuna study in `storage` (an Optuna
    storage or URL; by default the SQLite file beside the cache) under a name that holds
    everything of the cache key. Without `resume` an earlier study of that name is deleted
    first; with it, the study's finished points are never proposed again. `worker`,
    `is_live` and `reaps` share the study with other workers (see search.Search). The seeds, tried first in
    this order: the default, with `warm_start` the cache's knowledge (warm_start_points), then the
    family's own seeds (with `warm_start` in warm_seed_order's order), each point once.
    Raises ValueError when there is no valid point (for a replay: none recorded is still valid)."""
    target = device.target
    valid = valid_points(family, problem, target, runner.candidates(family, problem))
    storage = storage if storage is not None else study_storage(cache)
    name = study_name(family, problem, device)
    if not resume:
        _delete_study(storage, name)
    seeds = family.seed_params(problem, target)
    warm = warm_start_points(family, problem, device, cache) if warm_start else []
    if warm_start:
        seeds = warm_seed_order(family, problem, device, cache, seeds)
    return Search(space_of(family), valid, seeds=seed_order(family.default_params(problem, target), warm, seeds),
                  seed=seed, storage=storage, study_name=name, worker=worker, is_live=is_live,
                  reaps=reaps)


def seed_order(default: Mapping[str, ParamValue], warm: Sequence[Mapping[str, ParamValue]],
               seeds: Sequence[Mapping[str, ParamValue]]) -> list[dict[str, ParamValue]]:
    """The points a study tries first: the default, the warm start, the family's seeds, each once."""
    out: list[dict[str, ParamValue]] = []
    for point in (default, *warm, *seeds):
        if dict(point) not in out:
            out.append(dict(point))
    return out


def warm_start_points(family: Family, problem: Problem, device: DeviceInfo, cache: Cache) -> list[dict[str, ParamValue]]:
    """What the cache knows for a problem, as points to try first: the pick of the family's
    selector for this GPU and NVRTC major (as dispatch takes it: its leaf's first configuration
    when valid here, the next valid one only when no nearby winner is), then the winners of the
    WARM_NEAREST tuned shapes nearest this one (same dtype, GPU, NVRTC major and digests; the
    family's problem_distance) that are valid here. Each once."""
    target = device.target
    key = cache_key(problem, device, family)
    space = space_of(family)
    out: list[dict[str, ParamValue]] = []

    def valid(params: Mapping[str, Any]) -> dict[str, ParamValue] | None:
        try:
            checked = space.check_values(params)
        except UserError:
            return None  # a value the space no longer declares
        return checked if family.is_valid(problem, target, checked) else None

    nearest = [point for point in (valid(e.params) for e in nearest_entries(family, problem, device, cache))
               if point is not None]
    selector = find_selector(cache.selectors(), key)
    pick = selector_pick(selector, family, problem, target, first_only=bool(nearest)) \
        if selector is not None else None
    if pick is not None:
        point = valid(selector.configs[pick[0]])
        if point is not None:
            out.append(point)
    for point in nearest:
        if point not in out:
            out.append(point)
    return out


def nearest_entries(family: Family, problem: Problem, device: DeviceInfo, cache: Cache) -> list[Entry]:
    """The entries of the WARM_NEAREST tuned shapes nearest this problem (same dtype, GPU, NVRTC
    major and digests; the family's problem_distance), nearest first."""
    key = cache_key(problem, device, family)
    entries = [e for e in cache.entries() if nvrtc_match(e.key, key) is not None]
    ranked = sorted(((key_distance(family, e.key, key), e.time_us, i) for i, e in enumerate(entries)))
    return [entries[i] for distance, _, i in ranked if distance < math.inf][:WARM_NEAREST]


def logged_times(cache: Cache, family: Family, gpu_name: str,
                 shapes: Sequence[tuple[str, str]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (dtype, shape) asked for: the fastest correct time the cache's trial log recorded on this
    GPU for each point of the family's current space (by params_key); points the space no longer
    declares are left out."""
    space = space_of(family)
    times: dict[tuple[str, str], dict[str, float]] = {(dtype, shape): {} for dtype, shape in shapes}
    for row in cache.trials():
        where = times.get((row["dtype"], row["shape"]))
        if where is None or row["family"] != family.name or row["gpu_name"] != gpu_name \
                or row["status"] != Status.OK.value or not isinstance(row["time_us"], (int, float)) \
                or not row["time_us"] > 0:
            continue
        try:
            point = params_key(space.check_values(json.loads(row["params"])))
        except (UserError, ValueError, TypeError):
            continue
        where[point] = min(float(row["time_us"]), where.get(point, math.inf))
    return times


def warm_seed_order(family: Family, problem: Problem, device: DeviceInfo, cache: Cache,
                    seeds: Sequence[Mapping[str, ParamValue]]) -> list[dict[str, ParamValue]]:
    """The family's seeds, those that ran fastest on the nearest tuned shapes first, as
    meta-learned initial designs order theirs (Feurer et al., 2015): each seed ranks by its mean
    log time ratio to the best recorded there, over the nearest shapes whose trial log has it; a
    seed none of them ran ranks as WARM_UNKNOWN_RATIO. Ties keep the family's order."""
    nearest = nearest_entries(family, problem, device, cache)
    if not nearest:
        return [dict(s) for s in seeds]
    logged = logged_times(cache, family, device.name, [(e.key.dtype, e.key.shape) for e in nearest])
    ratios = [{point: math.log(t / min(row.values())) for point, t in row.items()} for row in logged.values() if row]
    space = space_of(family)

    def rank(seed: Mapping[str, ParamValue]) -> float:
        try:
            point = params_key(space.check_values(seed))
        except UserError:
            return math.log(WARM_UNKNOWN_RATIO)
        known = [shape[point] for shape in ratios if point in shape]
        return statistics.fmean(known) if known else math.log(WARM_UNKNOWN_RATIO)

    return [dict(s) for s in sorted(seeds, key=rank)]


def resumed_trials(search: Search, family: Family, problem: Problem, target: Target) -> list[Measured]:
    """The trials an earlier run of the study finished (none for a fresh study)."""
    return [Measured(build_variant(family, problem, p, target), Outcome(Status(status), t))
            for p, t, status in search.finished()]


# --- bookkeeping --------------------------------------------------------------------------------

class Ledger:
    """The bookkeeping of one tune: the trials in order (resumed ones first), the fastest correct
    one, the default's. Each finished trial goes to the study (so a resumed tune never runs it
    again), then to the cache file's trial log, then to `progress`: a trial reported is stored."""

    def __init__(self, search: Search, cache: Cache, problem: Problem, device: DeviceInfo, total: int,
                 progress: ProgressFn | None, *, default_params: Mapping[str, ParamValue],
                 resumed: Sequence[Measured] = ()):
        self._search, self._cache, self._problem, self._device = search, cache, problem, device
        self._total, self._progress = total, progress
        self._default_params = dict(default_params)
        self.measured: list[Measured] = []
        self.best: Measured | None = None
        self.default: Measured | None = None
        for m in resumed:
            self._track(m)
        self.resumed = len(self.measured)

    def _track(self, m: Measured) -> None:
        self.measured.append(m)
        if m.outcome.ok and (self.best is None or m.outcome.time_us < self.best.outcome.time_us):
            self.best = m
        if self.default is None and dict(m.variant.params) == self._default_params:
            self.default = m

    def record(self, m: Measured) -> None:
        spent = {name: getattr(m.outcome, name) for name in ("compile_s", "evaluate_s")
                 if getattr(m.outcome, name) is not None}  # what `autosoft report` draws against each other
        with interrupts_held():  # the study's and the trial log's writes happen whole or not at all
            if not self._search.tell(m.variant.params, m.outcome.time_us, m.outcome.status.value, spent):
                return  # this worker was taken for dead and its claim reaped: the re-run is the record
            self._cache.record_trials([trial_row(self._problem, self._device, m)])
        self._track(m)
        if self._progress:
            self._progress(len(self.measured), self._total, self.best, m)


def trial_row(problem: Problem, device: DeviceInfo, m: Measured) -> dict[str, Any]:
    """One row of the cache file's trial log."""
    return {"family": problem.family, "dtype": problem.dtype, "shape": problem.shape_text, "gpu_name": device.name,
            "variant_name": m.variant.name, "params": dict(m.variant.params), "status": m.outcome.status.value,
            "time_us": m.outcome.time_us, "message": m.outcome.message}


# --- the evaluation loop ------------------------------------------------------------------------

def measure_default(family: Family, problem: Problem, target: Target, runner: Runner, search: Search,
                    ledger: Ledger, seed: int, timeout_s: float) -> Measured:
    """The family's default, measured first unless a resumed study has it: its time sets the
    watchdog for the rest and is the baseline the report and the entry compare with."""
    if ledger.default is None:
        params = family.default_params(problem, target)
        variant = build_variant(family, problem, params, target)
        search.claim(params)
        ledger.record(Measured(variant, runner.evaluate(family, variant, seed, timeout_s)))
    if ledger.default is None:
        raise RuntimeError(f"the default of {problem.family} {problem.shape_text} {problem.dtype} was measured "
                           "but not recorded: this worker's claim was reaped (its heartbeat stopped)")
    return ledger.default


def run_trials(family: Family, problem: Problem, target: Target, runner: Runner, search: Search, ledger: Ledger,
               trials: int, seed: int, timeout_s: float) -> None:
    """Ask the search, submit to the runner, record, until the study holds `trials` points
    (measured or in flight, by any worker sharing it) or the space is exhausted. Up to
    `runner.depth` candidates are submitted ahead (the GPU runner compiles them meanwhile);
    results are taken in submission order, each with the seed of its place in the study. An
    interruption withdraws the claims still in flight."""
    in_flight: list[tuple[Variant, Pending]] = []

    def refill() -> None:
        while len(in_flight) < max(1, runner.depth) and search.spent() < trials:
            proposal = search.ask(budget=trials)
            if proposal is None:
                return
            variant = build_variant(family, problem, proposal.params, target)
            number = search.spent() - 1  # its place among the study's points
            in_flight.append((variant, runner.submit(family, variant, seed + number, timeout_s)))

    try:
        while True:
            refill()  # keep the runner busy (compiling ahead) while it evaluates the first
            if not in_flight:
                return
            variant, pending = in_flight[0]
            outcome = pending.result()  # an interruption while waiting withdraws this claim too
            in_flight.pop(0)
            ledger.record(Measured(variant, outcome))
    finally:
        for variant, pending in in_flight:  # interrupted: nothing waits for these any more
            pending.cancel()
            search.withdraw(variant.params)


# --- re-timing and the cache write --------------------------------------------------------------

def finalists(measured: list[Measured], count: int = FINALISTS) -> list[Measured]:
    """The fastest correct trials, one per variant, fastest first."""
    ranked = sorted((m for m in measured if m.outcome.ok), key=lambda m: m.outcome.time_us)
    out: list[Measured] = []
    for m in ranked:
        if len(out) < count and all(m.variant.name != o.variant.name for o in out):
            out.append(m)
    return out


def confirm_best(family: Family, runner: Runner, measured: list[Measured], timeout_s: float,
                 default: Measured | None = None) -> tuple[Measured, Measured | None] | None:
    """Re-time the finalists side by side, the default among them (when correct), and return the
    fastest and the default, each with its time from that round, so that the winner's speed-up
    over the default compares one measurement with another of the same round (a winner re-timed
    against the default's own trial could come out a hair slower than the variant it replaces).
    None when there is nothing to choose between or the re-timing failed (the search's best and
    the default's trial stand)."""
    chosen = finalists(measured)
    if default is not None and default.outcome.ok and all(m.variant.name != default.variant.name for m in chosen):
        chosen.append(default)
    if len(chosen) < 2:
        return None
    times = runner.time_side_by_side(family, [m.variant for m in chosen], timeout_s * len(chosen))
    if times is None:
        return None
    if len(times) != len(chosen):
        raise RuntimeError(f"{type(runner).__name__}.time_side_by_side gave {len(times)} times for {len(chosen)} variants")
    t, m = min(zip(times, chosen), key=lambda pair: pair[0])
    retimed = next((Measured(c.variant, Outcome(Status.OK, time_us=tc)) for tc, c in zip(times, chosen)
                    if default is not None and c.variant.name == default.variant.name), None)
    return Measured(m.variant, Outcome(Status.OK, time_us=t)), retimed


def make_entry(family: Family, problem: Problem, device: DeviceInfo, best: Measured, default: Measured,
               copy_time_us: float) -> Entry:
    """The cache entry of a winner: only a correct variant can become one."""
    if not best.outcome.ok or best.outcome.time_us is None:
        raise ValueError(f"{best.variant.name} is not a correct variant ({best.outcome.status.value})")
    return Entry(
        key=cache_key(problem, device, family), variant_name=best.variant.name, params=dict(best.variant.params),
        source_digest=best.variant.digest, time_us=best.outcome.time_us,
        default_time_us=default.outcome.time_us, copy_time_us=copy_time_us,
        launches=launches_text(best.variant), autosoft_version=__version__, created=time.time())


def _delete_study(storage: str, name: str) -> None:
    import optuna

    try:
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass  # no earlier study of this name


def print_progress(stream: Any = sys.stderr) -> ProgressFn:
    def show(n: int, total: int, best: Measured | None, last: Measured) -> None:
        width = 24
        filled = int(width * min(n, total) / max(1, total))
        best_text = f"best {best.outcome.time_us:9.2f} us {best.variant.name}" if best else "no correct variant yet"
        last_text = "" if last.outcome.ok else f"  (last: {last.outcome.status.value})"
        line = f"[{'#' * filled}{'.' * (width - filled)}] trial {n}/{total}  {best_text}{last_text}"
        if stream.isatty():
            stream.write("\r" + line[:150].ljust(150) + ("\n" if n >= total else ""))
        else:
            stream.write(line + "\n")
        stream.flush()

    return show


def params_text(params: Mapping[str, ParamValue]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
