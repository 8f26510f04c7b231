"""The tuning job: search a family's space for one problem and store the fastest correct variant.

Compilation runs in a pool of CPU processes ahead of the GPU, which verifies and times one
variant at a time. Every evaluated variant, failures included, is recorded in the cache file's
trial log; only a correct variant can become the cache entry.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from . import __version__
from .cache import Cache, Entry
from .compile import CompileResult, compile_source
from .evaluate import Outcome, Status, evaluate
from .families import get_family
from .dispatch import cache_key
from .families.base import Problem, Variant, build_variant, space_of
from .runtime import DeviceInfo, device_info
from .search import Search
from .space import ParamValue
from .timing import time_copy


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
    seconds: float = 0.0
    stored: bool = False

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.trials:
            out[m.outcome.status.value] = out.get(m.outcome.status.value, 0) + 1
        return out


def launches_text(variant: Variant) -> str:
    return "; ".join(f"{l.kernel} grid={l.grid} block={l.block} smem={l.shared_mem}B" for l in variant.launches)


def _compile(source: str, arch: str) -> CompileResult:
    return compile_source(source, arch)


ProgressFn = Callable[[int, int, "Measured | None", "Measured"], None]


def tune(family_name: str, problem: Problem, trials: int, cache: Cache, *, seed: int = 0,
         progress: ProgressFn | None = None, workers: int | None = None) -> TuneReport:
    start = time.perf_counter()
    family = get_family(family_name)
    device = device_info()
    target = device.target
    space = space_of(family)
    valid = space.valid_points(family.problem_values(problem, target))
    default_params = family.default_params(problem, target)
    search = Search(space, valid, seeds=[default_params, *family.seed_params(problem, target)], seed=seed)
    workers = workers or max(1, min(8, (os.cpu_count() or 2) - 1))

    measured: list[Measured] = []
    best: Measured | None = None
    default: Measured | None = None
    with cf.ProcessPoolExecutor(max_workers=workers) as pool:
        in_flight: list[tuple[Variant, cf.Future]] = []

        def refill() -> None:
            while len(in_flight) < workers * 2 and len(measured) + len(in_flight) < trials:
                proposal = search.ask()
                if proposal is None:
                    return
                variant = build_variant(family, problem, proposal.params, target)
                in_flight.append((variant, pool.submit(_compile, variant.source, target.arch)))

        refill()
        while in_flight:
            variant, future = in_flight[0]
            refill()  # keep the compilers busy while the GPU works
            in_flight.pop(0)
            result = future.result()
            if not result.ok:
                outcome = Outcome(Status.COMPILE_FAIL, message=result.log.strip().splitlines()[0] if result.log else "")
            else:
                outcome = evaluate(variant, result.cubin, seed=seed + len(measured))
            m = Measured(variant, outcome)
            measured.append(m)
            search.tell(variant.params, outcome.time_us, outcome.status.value)
            if outcome.ok and (best is None or outcome.time_us < best.outcome.time_us):
                best = m
            if dict(variant.params) == default_params:
                default = m
            if progress:
                progress(len(measured), trials, best, m)

    if default is None:  # only when trials == 0
        variant = build_variant(family, problem, default_params, target)
        result = compile_source(variant.source, target.arch)
        default = Measured(variant, evaluate(variant, result.cubin, seed=seed) if result.ok
                           else Outcome(Status.COMPILE_FAIL, message=result.log))
    copy = time_copy(family.bytes_moved(problem) // 2, target.l2_bytes)
    report = TuneReport(problem, device, best, default, copy.median_us, measured)

    cache.record_trials([{
        "family": problem.family, "dtype": problem.dtype, "shape": problem.shape_text, "gpu_name": device.name,
        "variant_name": m.variant.name, "params": dict(m.variant.params), "status": m.outcome.status.value,
        "time_us": m.outcome.time_us, "message": m.outcome.message} for m in measured])
    if best is not None:
        report.stored = cache.put(Entry(
            key=cache_key(problem, device), variant_name=best.variant.name, params=dict(best.variant.params),
            source_digest=best.variant.digest, time_us=best.outcome.time_us,
            default_time_us=default.outcome.time_us, copy_time_us=copy.median_us,
            launches=launches_text(best.variant), autosoft_version=__version__, created=time.time()))
    report.seconds = time.perf_counter() - start
    return report


def print_progress(stream=sys.stderr) -> ProgressFn:
    def show(n: int, total: int, best: Measured | None, last: Measured) -> None:
        width = 24
        filled = int(width * n / max(1, total))
        best_text = f"best {best.outcome.time_us:9.2f} us {best.variant.name}" if best else "no correct variant yet"
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] trial {n}/{total}  {best_text}"
        stream.write(line[:160].ljust(160) if stream.isatty() else line.lstrip("\r") + "\n")
        if n == total and stream.isatty():
            stream.write("\n")
        stream.flush()

    return show


def params_text(params: Mapping[str, ParamValue]) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
