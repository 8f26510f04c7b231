"""The tuning job: search a family's space for one problem and store the fastest correct variant.

Compilation runs in a pool of CPU processes ahead of the GPU; a worker process verifies and
times one variant at a time (a crash or hang costs that candidate, not the tune). Each
evaluated variant, failures included, is recorded in the cache file's trial log and in the
Optuna study (an SQLite file beside the cache) as soon as it finishes, so an interrupted
tune loses at most the candidate in flight and `--resume` continues it. Only a correct
variant can become the cache entry.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping

from . import __version__
from .cache import Cache, Entry
from .compile import CompileResult, compile_source
from .dispatch import cache_key
from .evaluate import Outcome, Status
from .families import get_family
from .families.base import Family, Problem, Variant, build_variant, space_of
from .runtime import DeviceInfo, device_info
from .search import Search
from .space import ParamValue
from .worker import GpuWorker, Watchdog

_WARMUP, _REPS = 3, 40  # launches per evaluation besides verification (see evaluate.time_variant)
FINALISTS = 4  # fastest distinct variants of a search that are timed again side by side


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
    return f"sqlite:///{cache.path.parent / (cache.path.stem + '-studies.sqlite')}"


def study_name(family: Family, problem: Problem, device: DeviceInfo) -> str:
    key = cache_key(problem, device, family)
    return "/".join((key.family, key.dtype, key.shape, key.gpu_name, key.compute_capability, key.cuda_version,
                     key.template_digest[:16], key.space_digest[:16]))


@lru_cache(maxsize=1)
def compile_pool(workers: int) -> cf.ProcessPoolExecutor:
    """One pool of compiler processes per session (spawned: never forked from a CUDA process)."""
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    atexit.register(pool.shutdown)
    return pool


ProgressFn = Callable[[int, int, "Measured | None", "Measured"], None]


def tune(family: Family | str, problem: Problem, trials: int, cache: Cache, *, seed: int = 0,
         progress: ProgressFn | None = None, workers: int | None = None, resume: bool = False,
         watchdog: Watchdog = Watchdog(), worker: GpuWorker | None = None) -> TuneReport:
    """Tune one problem. A caller tuning many problems may pass its own GpuWorker to reuse it."""
    start = time.perf_counter()
    family = get_family(family) if isinstance(family, str) else family
    device = device_info()
    target = device.target
    space = space_of(family)
    valid = space.valid_points(family.problem_values(problem, target))
    default_params = family.default_params(problem, target)
    storage, name = study_storage(cache), study_name(family, problem, device)
    if not resume:
        _delete_study(storage, name)
    search = Search(space, valid, seeds=[default_params, *family.seed_params(problem, target)], seed=seed,
                    storage=storage, study_name=name)
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))
    pool = compile_pool(workers)
    depth = 2 * workers  # compiles kept ahead of the GPU

    measured = [Measured(build_variant(family, problem, p, target), Outcome(Status(status), t))
                for p, t, status in search.finished()]
    resumed = len(measured)
    best = min((m for m in measured if m.outcome.ok), key=lambda m: m.outcome.time_us, default=None)
    default = next((m for m in measured if dict(m.variant.params) == default_params), None)
    launches = len(family.input_kinds) + _WARMUP + _REPS

    own_worker = worker is None
    worker = worker or GpuWorker()
    restarts_before = worker.restarts
    try:
        if default is None:  # the default is measured first: it sets the watchdog and the baseline
            default = _evaluate(family, worker, pool, build_variant(family, problem, default_params, target),
                                seed, watchdog.cap_s)
            search.tell(default_params, default.outcome.time_us, default.outcome.status.value)
            search.mark_tried(default_params)
            measured.append(default)
            _record(cache, problem, device, default)
            if default.outcome.ok and (best is None or default.outcome.time_us < best.outcome.time_us):
                best = default
            if progress:
                progress(len(measured), trials, best, default)
        timeout_s = watchdog.limit(default.outcome.time_us, launches)

        in_flight: list[tuple[Variant, cf.Future]] = []

        def refill() -> None:
            while len(in_flight) < depth and len(measured) + len(in_flight) < trials:
                proposal = search.ask()
                if proposal is None:
                    return
                variant = build_variant(family, problem, proposal.params, target)
                in_flight.append((variant, pool.submit(compile_source, variant.source, target.arch)))

        refill()
        while in_flight:
            variant, future = in_flight[0]
            refill()  # keep the compilers busy while the GPU works
            in_flight.pop(0)
            m = Measured(variant, _outcome(family, worker, variant, future.result(), seed + len(measured), timeout_s))
            measured.append(m)
            search.tell(variant.params, m.outcome.time_us, m.outcome.status.value)
            _record(cache, problem, device, m)
            if m.outcome.ok and (best is None or m.outcome.time_us < best.outcome.time_us):
                best = m
            if progress:
                progress(len(measured), trials, best, m)
        best = _confirm_best(family, worker, pool, measured, timeout_s) or best
        copy_us = worker.time_copy(family.bytes_moved(problem) // 2, target.l2_bytes)
        restarts = worker.restarts - restarts_before
    finally:
        if own_worker:
            worker.stop()

    report = TuneReport(problem, device, best, default, copy_us, measured, resumed, worker_restarts=restarts)
    if best is not None:
        report.stored = cache.put(Entry(
            key=cache_key(problem, device, family), variant_name=best.variant.name, params=dict(best.variant.params),
            source_digest=best.variant.digest, time_us=best.outcome.time_us,
            default_time_us=default.outcome.time_us, copy_time_us=copy_us,
            launches=launches_text(best.variant), autosoft_version=__version__, created=time.time()))
    report.seconds = time.perf_counter() - start
    return report


def finalists(measured: list[Measured], count: int = FINALISTS) -> list[Measured]:
    """The fastest correct trials, one per variant, fastest first."""
    ranked = sorted((m for m in measured if m.outcome.ok), key=lambda m: m.outcome.time_us)
    out: list[Measured] = []
    for m in ranked:
        if len(out) < count and all(m.variant.name != o.variant.name for o in out):
            out.append(m)
    return out


def _confirm_best(family: Family, worker: GpuWorker, pool: cf.ProcessPoolExecutor, measured: list[Measured],
                  timeout_s: float) -> Measured | None:
    """Re-time the finalists side by side and return the fastest, with that time; None when
    there is nothing to choose between or the re-timing failed (the search's best stands)."""
    chosen = finalists(measured)
    if len(chosen) < 2:
        return None
    results = list(pool.map(compile_source, [m.variant.source for m in chosen],
                            [m.variant.target.arch for m in chosen]))
    if not all(r.ok for r in results):
        return None
    times = worker.time_side_by_side(family, [(m.variant, r.cubin) for m, r in zip(chosen, results)],
                                     timeout_s * len(chosen))
    if times is None:
        return None
    t, m = min(zip(times, chosen), key=lambda pair: pair[0])
    return Measured(m.variant, Outcome(Status.OK, time_us=t))


def _evaluate(family: Family, worker: GpuWorker, pool: cf.ProcessPoolExecutor, variant: Variant,
              seed: int, timeout_s: float) -> Measured:
    result = pool.submit(compile_source, variant.source, variant.target.arch).result()
    return Measured(variant, _outcome(family, worker, variant, result, seed, timeout_s))


def _outcome(family: Family, worker: GpuWorker, variant: Variant, result: CompileResult, seed: int,
             timeout_s: float) -> Outcome:
    if not result.ok:
        first = next((line for line in result.log.splitlines() if "error" in line), result.log.strip()[:200])
        return Outcome(Status.COMPILE_FAIL, message=first)
    return worker.evaluate(family, variant, result.cubin, seed, timeout_s)


def _record(cache: Cache, problem: Problem, device: DeviceInfo, m: Measured) -> None:
    cache.record_trials([{
        "family": problem.family, "dtype": problem.dtype, "shape": problem.shape_text, "gpu_name": device.name,
        "variant_name": m.variant.name, "params": dict(m.variant.params), "status": m.outcome.status.value,
        "time_us": m.outcome.time_us, "message": m.outcome.message}])


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
