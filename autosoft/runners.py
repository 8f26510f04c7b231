"""Runners: how a candidate is evaluated, kept apart from what to try (Kernel Tuner's split).

The tuner (tune.py) decides which variants to try and in what order; a Runner takes a
rendered variant and gives back an Outcome, re-times finalists and times the reference copy.
How that happens is the runner's business:

- GpuRunner compiles in a pool of CPU processes ahead of the GPU and verifies and times in a
  crash-isolating worker process (worker.py); a fault or hang costs the candidate, not the tune.
- ReplayRunner answers from the trials recorded in a cache file (Kernel Tuner's "simulation
  mode"): no GPU, no compiler, so the search, re-timing, resume and the cache write can be
  tested on a CPU against real measurements.

Later runners (one worker per GPU, workers on other hosts or on Ray) fit the same contract:
`submit` starts work and returns a Pending, whose `result` is the Outcome.

Nothing here imports CuPy at module import: the GPU is touched only inside GpuRunner's methods
and its worker process.
"""
from __future__ import annotations

import abc
import atexit
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .cache import Cache
from .compile import CompileResult, compile_source
from .evaluate import Outcome, Status
from .families.base import Family, Problem, Target, Variant
from .runtime import DeviceInfo
from .space import ParamValue
from .worker import GpuWorker


class Pending:
    """A candidate submitted to a runner; `result()` is its Outcome.

    result() waits for whatever the runner started at submit (a compile, a remote call) and
    finishes the evaluation; it never raises for the candidate's own failure (that is the
    Outcome) and returns the same Outcome when called again. cancel() gives up a submission
    whose result will not be asked for (an interrupted tune): work not yet started is dropped.
    """

    def __init__(self, finish: Callable[[], Outcome], cancel: Callable[[], Any] = lambda: None):
        self._finish: Callable[[], Outcome] | None = finish
        self._cancel = cancel
        self._outcome: Outcome | None = None

    def result(self) -> Outcome:
        if self._outcome is None:
            if self._finish is None:
                raise RuntimeError("result() of a cancelled submission")
            self._outcome = self._finish()
            self._finish = None
        return self._outcome

    def cancel(self) -> None:
        if self._outcome is None:
            self._finish = None
            self._cancel()


class Runner(abc.ABC):
    """Evaluates candidates for the tuner. A runner is used by one tune at a time; a caller
    tuning many problems may pass the same runner to each tune() and close it at the end.

    Contract, for every method: a candidate's own failure (does not compile, faults, hangs,
    wrong result, not recorded) is an Outcome, never an exception. Exceptions are for the
    runner itself failing (no device, the worker cannot start): they end the tune.
    """

    #: how many submissions the tuner keeps outstanding; above 1 only for a runner that does
    #: useful work between submit and result (the GPU runner compiles ahead of the GPU)
    depth: int = 1

    @property
    @abc.abstractmethod
    def device(self) -> DeviceInfo:
        """The GPU the candidates are evaluated on: its Target lays variants out, and its name,
        compute capability and NVRTC version key the cache entry and the study. Raises
        NoDeviceError when there is no usable device (GpuRunner on a machine without one)."""

    def candidates(self, family: Family, problem: Problem) -> list[dict[str, ParamValue]] | None:
        """The only points this runner can evaluate for `problem`, or None (the default) when it
        can evaluate any point of the family's space. The tuner searches the valid points among
        them, so a replay searches what was recorded instead of asking for points it cannot
        answer. The points need not be valid in the current space: the tuner checks them."""
        return None

    def submit(self, family: Family, variant: Variant, seed: int, timeout_s: float) -> Pending:
        """Start evaluating `variant` and return at once; the Pending's result() is what
        evaluate() would return. The tuner submits up to `depth` candidates and takes their
        results in the order it submitted them. The default starts nothing: result() calls
        evaluate()."""
        return Pending(lambda: self.evaluate(family, variant, seed, timeout_s))

    @abc.abstractmethod
    def evaluate(self, family: Family, variant: Variant, seed: int, timeout_s: float) -> Outcome:
        """Compile (if the runner compiles), verify on inputs drawn from `seed`, and time one
        variant laid out for `self.device.target`. Returns Status.OK with the median kernel
        time in microseconds, or the failure: COMPILE_FAIL, LAUNCH_FAIL, TIMEOUT (verification
        and timing together took longer than `timeout_s` seconds), WRONG, INVALID (this runner
        cannot evaluate the point, e.g. it was never recorded; the message says why)."""

    @abc.abstractmethod
    def time_side_by_side(self, family: Family, variants: Sequence[Variant], timeout_s: float) -> list[float] | None:
        """Re-time variants of one problem, each already verified, side by side in turns (see
        evaluate.time_side_by_side), within `timeout_s` seconds for the whole call. Returns one
        median time in microseconds per variant, in the order given, or None when that failed
        (the tuner then keeps the times it has)."""

    @abc.abstractmethod
    def time_copy(self, nbytes_each_way: int) -> float:
        """The time in microseconds of a device-to-device copy of `nbytes_each_way` bytes, timed
        as a kernel is (the bandwidth bound a kernel is compared with). Raises RuntimeError when
        it cannot be had."""

    def peak_tflops(self) -> float | None:
        """The GPU's measured tensor-core rate in TFLOP/s (a dense float16 matrix product timed
        as a kernel is): the bound a compute-bound family is compared with. None where the
        runner cannot measure it (the default)."""
        return None

    def keep(self, variant: Variant) -> None:
        """The tune's winner: make its compiled kernel ready for dispatch on this machine (the
        kernel store), so the first call after a tune loads it without NVRTC. Default: nothing."""

    @property
    def restarts(self) -> int:
        """How many times the runner replaced a worker that faulted, hung or died so far."""
        return 0

    def close(self) -> None:
        """Release what the runner started (worker processes); it is not used afterwards."""

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --- the GPU ------------------------------------------------------------------------------------

def new_compile_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A pool of compiler processes (spawned: never forked from a CUDA process); the caller shuts it down."""
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))


@lru_cache(maxsize=None)
def compile_pool(workers: int) -> cf.ProcessPoolExecutor:
    """One pool of compiler processes per session and size, shut down at exit. Not for code that
    runs in a multiprocessing child (a batch worker): such a child joins its child processes
    before atexit runs, so it would wait forever on a pool still open; it uses new_compile_pool
    and shuts the pool down itself."""
    pool = new_compile_pool(workers)
    atexit.register(pool.shutdown)
    return pool


def timed_compile(source: str, arch: str) -> tuple[CompileResult, float]:
    """compile_source and the wall seconds it took (run in the pool: the compile alone)."""
    start = time.perf_counter()
    result = compile_source(source, arch)
    return result, time.perf_counter() - start


def default_compile_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) - 1))


class GpuRunner(Runner):
    """Compiles in a pool of CPU processes ahead of the GPU; verifies and times in a GpuWorker.

    workers: compiler processes (default: the cores less one, at most 8); the tuner keeps
    2 x workers candidates submitted, so the compilers stay busy while the GPU works.
    worker: a GpuWorker to use (the caller stops it); by default the runner starts its own on
    the first evaluation and stops it at close(). pool: an executor to compile in (the caller
    shuts it down); by default the session's shared pool. device: what to report instead of
    asking CuPy (for a stand-in worker on a machine without a GPU).
    """

    def __init__(self, *, workers: int | None = None, worker: GpuWorker | None = None,
                 pool: cf.Executor | None = None, device: DeviceInfo | None = None):
        self.workers = workers or default_compile_workers()
        self.depth = 2 * self.workers
        self._pool = pool
        self._worker = worker if worker is not None else GpuWorker()
        self._own_worker = worker is None
        self._device = device

    @property
    def device(self) -> DeviceInfo:
        if self._device is None:
            from .runtime import device_info  # CuPy: only when asked

            self._device = device_info()
        return self._device

    @property
    def pool(self) -> cf.Executor:
        if self._pool is None:
            self._pool = compile_pool(self.workers)
        return self._pool

    def submit(self, family: Family, variant: Variant, seed: int, timeout_s: float) -> Pending:
        compiling = self.pool.submit(timed_compile, variant.source, variant.target.arch)
        return Pending(lambda: self._run(family, variant, *compiling.result(), seed, timeout_s), compiling.cancel)

    def evaluate(self, family: Family, variant: Variant, seed: int, timeout_s: float) -> Outcome:
        return self.submit(family, variant, seed, timeout_s).result()

    def _run(self, family: Family, variant: Variant, compiled: CompileResult, compile_s: float, seed: int,
             timeout_s: float) -> Outcome:
        if not compiled.ok:
            first = next((line for line in compiled.log.splitlines() if "error" in line), compiled.log.strip()[:200])
            return Outcome(Status.COMPILE_FAIL, message=first, compile_s=compile_s)
        start = time.perf_counter()
        outcome = self._worker.evaluate(family, variant, compiled.cubin, seed, timeout_s)
        return replace(outcome, compile_s=compile_s, evaluate_s=time.perf_counter() - start)

    def time_side_by_side(self, family: Family, variants: Sequence[Variant], timeout_s: float) -> list[float] | None:
        compiled = list(self.pool.map(compile_source, [v.source for v in variants], [v.target.arch for v in variants]))
        if not all(c.ok for c in compiled):
            return None
        return self._worker.time_side_by_side(family, [(v, c.cubin) for v, c in zip(variants, compiled)], timeout_s)

    def time_copy(self, nbytes_each_way: int) -> float:
        return self._worker.time_copy(nbytes_each_way, self.device.target.l2_bytes)

    def peak_tflops(self) -> float | None:
        return self._worker.matmul_tflops()

    def keep(self, variant: Variant) -> None:
        from .kernel_store import default_store

        default_store().get_or_compile(variant)  # a hit when an earlier process kept it

    @property
    def restarts(self) -> int:
        return self._worker.restarts

    def close(self) -> None:
        if self._own_worker:
            self._worker.stop()


# --- a replay of recorded trials ----------------------------------------------------------------

def params_key(params: Mapping[str, Any]) -> str:
    """A point as the cache's trial log writes it (JSON, sorted keys): how recorded trials are keyed."""
    return json.dumps(dict(params), sort_keys=True)


@dataclass(frozen=True)
class Recorded:
    """One recorded trial's result."""
    params: Mapping[str, ParamValue]
    status: Status
    time_us: float | None
    message: str

    @property
    def outcome(self) -> Outcome:
        return Outcome(self.status, self.time_us, self.message)


class ReplayRunner(Runner):
    """Answers from the trials of one problem recorded in a cache file (`autosoft tune` writes
    every evaluated variant, failures included, to the file's trial log).

    Recorded trials are keyed by (family, dtype, shape, GPU name, params) only, never by the
    variant's name, source or the template digest: a recording stays replayable while the
    templates change. A point recorded twice answers with its latest record.

    Which points: `candidates()` returns the recorded points, so the tuner searches only those
    (a softmax problem has tens of thousands of valid points and a recording some 40). A point
    evaluated anyway that was never recorded (the family's default, when the recording did not
    measure it) gets Status.INVALID, "not recorded in <file>": the tune goes on and stores
    nothing it did not see measured.

    What is replayed: evaluate() returns the recorded Outcome; time_side_by_side() returns the
    finalists' recorded times (a replay cannot measure again; the file keeps the recording's
    own re-timing only for its winner, in the entry); time_copy() returns the copy time of the
    problem's entry. `timeout_s` is not applied again: the recording's watchdog already was.
    `restarts` counts the worker restarts the recording had (one per launch failure or timeout).
    `evaluated` lists the params of every evaluate() call, in order. `delay_s`: each evaluation
    takes this long (a batch's workers can then be caught, and killed, mid-trial).

    Device: GPU name, compute capability and NVRTC version come from the problem's entry in the
    file (the newest, if several); the file does not record SM count, L2 size or opt-in shared
    memory, so those are the architecture's (Target.for_arch: 132 SMs, 227 KiB, 50 MiB for sm_90).
    Pass `device` to replay a GPU whose figures differ, or a recording without an entry.
    """

    def __init__(self, path: Path | str, problem: Problem, *, gpu_name: str | None = None,
                 device: DeviceInfo | None = None, delay_s: float = 0.0):
        cache = Cache(path, create=False)  # validates the file; never writes to it
        self.path = cache.path
        self.problem = problem
        mine = (problem.family, problem.dtype, problem.shape_text)
        rows = [r for r in cache.trials() if (r["family"], r["dtype"], r["shape"]) == mine]
        gpus = sorted({r["gpu_name"] for r in rows})
        if gpu_name is None and device is not None:
            gpu_name = device.name
        if gpu_name is None and len(gpus) > 1:
            raise ValueError(f"{self.path}: {self._what()} was recorded on {', '.join(gpus)}; pass gpu_name")
        gpu_name = gpu_name or (gpus[0] if gpus else None)
        rows = [r for r in rows if r["gpu_name"] == gpu_name]
        if not rows:
            raise ValueError(f"{self.path}: no recorded trials of {self._what()}"
                             + (f" on {gpu_name}" if gpu_name else ""))
        self._recorded: dict[str, Recorded] = {}
        for r in rows:  # oldest first: a later record of the same point replaces an earlier one
            params = json.loads(r["params"])
            self._recorded[params_key(params)] = Recorded(params, Status(r["status"]), r["time_us"], r["message"])
        entries = sorted((e for e in cache.entries()
                          if (e.key.family, e.key.dtype, e.key.shape) == mine and e.key.gpu_name == gpu_name),
                         key=lambda e: e.created)
        self.entry = entries[-1] if entries else None
        if device is None:
            if self.entry is None:
                raise ValueError(f"{self.path}: no entry of {self._what()} on {gpu_name} says which GPU and NVRTC "
                                 "recorded it; pass device")
            arch = self.entry.key.compute_capability
            base = Target.for_arch(arch)
            device = DeviceInfo(0, Target(arch=arch, name=gpu_name, sm_count=base.sm_count,
                                          smem_optin=base.smem_optin, l2_bytes=base.l2_bytes),
                                self.entry.key.cuda_version)
        self._device = device
        self._restarts = 0
        self.delay_s = delay_s
        self.evaluated: list[dict[str, ParamValue]] = []

    def _what(self) -> str:
        p = self.problem
        return f"{p.family} {p.dtype} {p.shape_text}"

    @property
    def device(self) -> DeviceInfo:
        return self._device

    @property
    def recorded(self) -> dict[str, Recorded]:
        """Every recorded point of the problem, by params_key."""
        return dict(self._recorded)

    def candidates(self, family: Family, problem: Problem) -> list[dict[str, ParamValue]] | None:
        if (family.name, problem) != (self.problem.family, self.problem):
            return []
        return [dict(r.params) for r in self._recorded.values()]

    def lookup(self, variant: Variant) -> Recorded | None:
        """The recorded trial of this variant's point, None when it was not recorded."""
        if variant.problem != self.problem or variant.target.name != self._device.name:
            return None
        return self._recorded.get(params_key(variant.params))

    def evaluate(self, family: Family, variant: Variant, seed: int, timeout_s: float) -> Outcome:
        self.evaluated.append(dict(variant.params))
        if self.delay_s:
            time.sleep(self.delay_s)  # what an evaluation takes, for tests of workers dying mid-trial
        found = self.lookup(variant)
        if found is None:
            return Outcome(Status.INVALID, message=f"not recorded in {self.path}")
        if found.status in (Status.LAUNCH_FAIL, Status.TIMEOUT):
            self._restarts += 1  # what the GPU worker did after this candidate
        return found.outcome

    def time_side_by_side(self, family: Family, variants: Sequence[Variant], timeout_s: float) -> list[float] | None:
        found = [self.lookup(v) for v in variants]
        if any(f is None or f.status is not Status.OK or f.time_us is None for f in found):
            return None
        return [float(f.time_us) for f in found]  # type: ignore[union-attr]

    def time_copy(self, nbytes_each_way: int) -> float:
        if self.entry is None or self.entry.copy_time_us is None:
            raise RuntimeError(f"{self.path}: no copy time recorded for {self._what()}")
        return float(self.entry.copy_time_us)

    @property
    def restarts(self) -> int:
        return self._restarts
