"""Batch tuning: many problems, one worker per GPU, on one host or many, through one study storage.

`autosoft tune` with several --shape/--dtype or --problems FILE runs run_batch(): the problems
go to workers (this process for one GPU; one process per GPU, each pinned with
CUDA_VISIBLE_DEVICES and with its own compile pool, for --gpus; one Ray task per GPU for --ray),
and every worker runs run_worker() against the same Optuna storage:

- it takes the longest problem nobody alive holds (the board, board.py: leases in the storage),
  tunes it through the tuner's own pipeline (tune.tune_problem), writes the result on the board, then
  the next; problems are handed out as workers come free, never dealt in advance;
- when every problem left is held, it helps the one held problem with the most trials left:
  the study is shared, so several GPUs of one model measure one large problem's trials, and its
  holder alone re-times the finalists and writes the result;
- a killed worker's problem is taken over by the next worker that finds its lease expired, with
  the trials already finished; its running trial is taken up again exactly once (search.py).

Several hosts: the same command with the same `--storage postgresql://...` on every host; the
board is in the storage, so they share the work without knowing of each other. Results are on
the board (each with the host that tuned it) and in each host's own cache file; `autosoft
collect --storage URL` writes them all into one cache file to ship.

Progress: a Monitor reads the board and the active studies about once a second, so every host
shows the progress of the whole batch, and draws it with tqdm (Optuna's own dependency).
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import zlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence, TextIO

from .board import Board, Snapshot, lease_seconds
from .cache import Cache, CacheKey, Entry
from .errors import UserError, one_line
from .families import get_family
from .families.base import Problem, family_template_digest, space_of
from .runners import GpuRunner, ReplayRunner, Runner, default_compile_workers, new_compile_pool
from .storage import open_storage
from .worker import Watchdog

__all__ = ["BatchSpec", "Monitor", "WorkerSummary", "entry_from_record", "order", "run_batch", "run_worker",
           "stored_results"]


@dataclass(frozen=True)
class BatchSpec:
    """Everything a worker needs, picklable (it crosses into spawned processes and Ray tasks).

    fresh: tune afresh: a problem's study is restarted when the first lease on it is taken
    (the default storage without --resume; run_batch clears the board's earlier leases first).
    replay: answer from the trials recorded in this cache file instead of the GPU (Kernel
    Tuner's simulation mode), each taking `replay_delay_s`."""
    problems: tuple[Problem, ...]
    trials: int
    cache: str
    storage: str
    seed: int = 0
    fresh: bool = False
    replay: str | None = None
    replay_delay_s: float = 0.0
    compile_workers: int | None = None
    watchdog: Watchdog = Watchdog()
    lease_s: float | None = None
    poll_s: float = 0.5


@dataclass
class WorkerSummary:
    worker: str
    label: str
    owned: list[str] = field(default_factory=list)    # problems this worker finished
    helped: list[str] = field(default_factory=list)   # problems it measured trials of for their holder
    trials: int = 0


def cost(problem: Problem) -> float:
    """A rough time of one evaluation in seconds: bytes at 3 TB/s, flops at 300 TFLOP/s. Only the
    order matters: the longest problems are handed out first so none is left to run alone at
    the end."""
    family = get_family(problem.family)
    return family.bytes_moved(problem) / 3e12 + family.flops(problem) / 3e14


def order(problems: Iterable[Problem]) -> list[Problem]:
    """Longest first; ties in the order given."""
    listed = list(problems)
    return sorted(listed, key=lambda p: -cost(p))


def problem_text(problem: Problem) -> str:
    return f"{problem.family} {problem.shape_text} {problem.dtype}"


# --- one worker -----------------------------------------------------------------------------------

class _Runners:
    """The runner for each problem: one GpuRunner for all (its compile pool and GPU worker stay
    up between problems), or a ReplayRunner per problem."""

    def __init__(self, spec: BatchSpec):
        self.spec = spec
        self._gpu: GpuRunner | None = None
        self._pool: cf.ProcessPoolExecutor | None = None
        self._replays: dict[Problem, ReplayRunner] = {}

    def get(self, problem: Problem) -> Runner:
        if self.spec.replay is None:
            if self._gpu is None:
                # its own compile pool, shut down in close(): a worker spawned for --gpus would
                # otherwise hang at exit on the session pool's processes (runners.compile_pool)
                workers = self.spec.compile_workers or default_compile_workers()
                self._pool = new_compile_pool(workers)
                self._gpu = GpuRunner(workers=workers, pool=self._pool)
            return self._gpu
        if problem not in self._replays:
            try:
                self._replays[problem] = ReplayRunner(self.spec.replay, problem, delay_s=self.spec.replay_delay_s)
            except ValueError as exc:
                raise UserError(f"--replay: {one_line(exc)}") from None
        return self._replays[problem]

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def run_worker(spec: BatchSpec, label: str = "", stop: threading.Event | None = None) -> WorkerSummary:
    """Work on the batch until every problem has a result: claim, tune, write; help when all
    left are held; wait when there is nothing to help. `label` names this worker's GPU in the
    board. Returns what it did. `stop` (set by another thread) ends it after the current step."""
    from .tune import study_name

    storage = open_storage(spec.storage, create=True)
    board = Board(storage, lease_s=spec.lease_s)
    cache = Cache(spec.cache)
    runners = _Runners(spec)
    summary = WorkerSummary(board.worker, label)
    lease = None
    try:
        plan = []
        for problem in order(spec.problems):
            runner = runners.get(problem)
            plan.append((problem, study_name(get_family(problem.family), problem, runner.device)))
        device = runners.get(plan[0][0]).device if plan else None
        board.join(gpu=label, device=device.name if device else "")
        while stop is None or not stop.is_set():
            snap = board.snapshot()
            todo = [(p, name) for p, name in plan if not snap.problem(name).done]
            if not todo:
                break
            for problem, name in todo:
                lease = board.claim(name, snap)
                if lease is not None:
                    break
            if lease is not None:
                summary.trials += _own(spec, problem, lease, board, runners.get(problem), cache, storage, label)
                summary.owned.append(problem_text(problem))
                lease = None
                continue
            helped = _help(spec, todo, snap, board, runners, cache, storage)
            if helped is not None:
                summary.helped.append(problem_text(helped[0]))
                summary.trials += helped[1]
                continue
            time.sleep(spec.poll_s)
    finally:
        if lease is not None:
            board.release(lease)
        board.leave()
        runners.close()
    return summary


def _open(spec: BatchSpec, problem: Problem, runner: Runner, cache: Cache, storage: Any, board: Board, *,
          resume: bool, seed: int):
    from .tune import Ledger, open_study, resumed_trials

    family = get_family(problem.family)
    device = runner.device
    search = open_study(family, problem, device, cache, runner, seed=seed, resume=resume, storage=storage,
                        worker=board.worker, is_live=board.live, reaps=False)
    ledger = Ledger(search, cache, problem, device, spec.trials, None,
                    default_params=family.default_params(problem, device.target),
                    resumed=resumed_trials(search, family, problem, device.target))
    return family, device, search, ledger


def _own(spec: BatchSpec, problem: Problem, lease: Any, board: Board, runner: Runner, cache: Cache,
         storage: Any, label: str) -> int:
    """Tune a claimed problem to its result through the tuner's own pipeline (tune.tune_problem),
    its study shared with the helpers, then write the result on the board. The trials this
    worker measured."""
    from .tune import SharedStudy, tune_problem

    fresh = spec.fresh and lease.generation == 0
    report = tune_problem(get_family(problem.family), problem, spec.trials, cache, runner, seed=spec.seed,
                          resume=not fresh, watchdog=spec.watchdog,
                          shared=SharedStudy(storage, board.worker, board.live, spec.poll_s))
    record = {"problem": {"family": problem.family, "shape": problem.shape_text, "dtype": problem.dtype},
              "entry": entry_record(report.entry) if report.entry else None, "peak_tflops": report.peak_tflops,
              "trials": len(report.trials), "seconds": round(report.seconds, 3), "gpu": label,
              "reaped": report.reaped}
    board.finish(lease, record)
    return report.measured_here


def _help(spec: BatchSpec, todo: Sequence[tuple[Problem, str]], snap: Snapshot, board: Board,
          runners: _Runners, cache: Cache, storage: Any) -> tuple[Problem, int] | None:
    """Measure trials of a problem another live worker holds (longest first, with its default
    measured and trials left): that problem and the number measured, None when there was none
    to help."""
    from .tune import evaluation_launches, run_trials

    for problem, name in todo:
        state = snap.problem(name)
        if state.holder == board.worker or not state.holder_live:
            continue
        try:
            storage.get_study_id_from_name(name)
        except KeyError:
            continue  # its holder has not opened the study yet
        runner = runners.get(problem)
        helper_seed = spec.seed + 1 + zlib.crc32(board.worker.encode()) % 10007  # its own suggestions
        family, device, search, ledger = _open(spec, problem, runner, cache, storage, board, resume=True,
                                               seed=helper_seed)
        if ledger.default is None or search.spent() >= spec.trials or search.exhausted:
            continue
        timeout_s = spec.watchdog.limit(ledger.default.outcome.time_us, evaluation_launches(family))
        before = len(ledger.measured)
        run_trials(family, problem, device.target, runner, search, ledger, spec.trials, spec.seed, timeout_s)
        if len(ledger.measured) > before:
            return problem, len(ledger.measured) - before
    return None


# --- results ------------------------------------------------------------------------------------

def entry_record(entry: Entry) -> dict[str, Any]:
    """A cache entry as plain JSON values (the result written on the board)."""
    return asdict(entry)


def entry_from_record(record: Mapping[str, Any]) -> Entry:
    fields = dict(record)
    return Entry(key=CacheKey(**fields.pop("key")), **{**fields, "params": dict(fields["params"])})


def stored_results(storage: Any) -> list[Mapping[str, Any]]:
    """Every result on the board of `storage` (an Optuna storage), one per problem and GPU model."""
    return Board(storage).snapshot().results()


# --- the whole batch ----------------------------------------------------------------------------

@dataclass
class BatchResult:
    results: list[Mapping[str, Any]]     # the batch's problems' results, in the batch's order
    missing: list[Problem]               # problems with no result (every worker died, or interrupted)
    failed_workers: list[str]
    seconds: float


class Monitor:
    """The batch's progress as the board shows it, drawn with tqdm on a terminal (problems done,
    ETA, the problems in progress with their trial and best time) and one line per finished
    problem anywhere. Matches results to the batch's problems by family, dtype, shape and the
    current template and space digests, on whatever GPU tuned them."""

    def __init__(self, storage: Any, problems: Sequence[Problem], trials: int, stream: TextIO = sys.stderr):
        from tqdm import tqdm

        self.storage = storage
        self.problems = list(problems)
        self.trials = trials
        self.stream = stream
        self._wanted = {self._ident_of_problem(p): p for p in self.problems}
        self._seen: set[str] = set()
        self.results: dict[Problem, Mapping[str, Any]] = {}
        tty = getattr(stream, "isatty", lambda: False)()
        self.bar = tqdm(total=len(self.problems), unit="problem", file=stream, disable=not tty,
                        dynamic_ncols=True, desc="tuning")

    @staticmethod
    def _ident_of_problem(p: Problem) -> tuple[str, str, str, str, str]:
        family = get_family(p.family)
        return (p.family, p.dtype, p.shape_text, family_template_digest(family)[:16], space_of(family).digest[:16])

    @staticmethod
    def _ident_of_study(name: str) -> tuple[str, ...] | None:
        parts = name.split("/")
        if len(parts) < 8:
            return None
        return (parts[0], parts[1], parts[2], parts[-2], parts[-1])

    def tick(self) -> int:
        """Read the board once, draw; the number of the batch's problems finished so far."""
        snap = Board(self.storage).snapshot()
        active = []
        for study, gens in sorted(snap.leases.items()):
            problem = self._wanted.get(self._ident_of_study(study))  # type: ignore[arg-type]
            if problem is None:
                continue
            state = snap.problem(study)
            if state.done:
                key = study
                if key not in self._seen:
                    self._seen.add(key)
                    self.results.setdefault(problem, state.result)  # type: ignore[arg-type]
                    self._announce(problem, state.result)  # type: ignore[arg-type]
            elif state.holder_live:
                active.append((problem, study))
        self.bar.n = len(self.results)
        if active and not self.bar.disable:
            self.bar.set_postfix_str("; ".join(self._progress(p, s) for p, s in active[:3]), refresh=False)
        self.bar.refresh()
        return len(self.results)

    def _progress(self, problem: Problem, study: str) -> str:
        try:
            trials = self.storage.get_all_trials(self.storage.get_study_id_from_name(study), deepcopy=False)
        except KeyError:
            return f"{problem_text(problem)} starting"
        points = [t for t in trials if "worker" in t.user_attrs or "status" in t.user_attrs]
        times = [t.value for t in points if t.value is not None]
        best = f"best {min(times):.2f} us" if times else "no time yet"
        return f"{problem_text(problem)} {len(points)}/{self.trials} {best}"

    def _announce(self, problem: Problem, result: Mapping[str, Any]) -> None:
        entry = result.get("entry")
        what = (f"{entry['time_us']:.2f} us {entry['variant_name']}" if entry else "no correct variant")
        line = (f"[{len(self.results)}/{len(self.problems)}] {problem_text(problem)}: {what} "
                f"({result.get('host', '?')} {result.get('gpu', '')}".rstrip() +
                f", {result.get('trials', 0)} trials, {result.get('seconds', 0):.0f} s)")
        self.bar.write(line, file=self.stream)

    def close(self) -> None:
        self.bar.close()


def run_batch(spec: BatchSpec, *, gpus: Sequence[str] | None = None, ray_address: str | None = None,
              use_ray: bool = False, stream: TextIO = sys.stderr) -> BatchResult:
    """Run the batch to the end: in this process (gpus None), one spawned process per GPU in
    `gpus`, or one Ray task per GPU of the cluster (use_ray). Returns the results of the
    batch's problems as the board holds them at the end."""
    start = time.perf_counter()
    if spec.lease_s is None:  # decided here: a worker on another host or in Ray gets the same
        spec = replace(spec, lease_s=lease_seconds())
    storage = open_storage(spec.storage, create=True)
    if spec.fresh:
        wanted = {Monitor._ident_of_problem(p) for p in spec.problems}
        Board(storage).clear(lambda study: Monitor._ident_of_study(study) in wanted)
    monitor = Monitor(open_storage(spec.storage, create=True), spec.problems, spec.trials, stream)
    failed: list[str] = []
    try:
        if use_ray:
            from .ray_workers import run_on_ray

            failed = run_on_ray(spec, ray_address, run_worker, tick=monitor.tick)
        elif gpus is None:
            _in_process(spec, monitor)
        else:
            failed = _processes(spec, gpus, monitor, stream)
        monitor.tick()
    finally:
        monitor.close()
    results = [monitor.results[p] for p in spec.problems if p in monitor.results]
    missing = [p for p in spec.problems if p not in monitor.results]
    return BatchResult(results, missing, failed, time.perf_counter() - start)


def _in_process(spec: BatchSpec, monitor: Monitor) -> None:
    done = threading.Event()

    def draw() -> None:
        while not done.wait(1.0):
            try:
                monitor.tick()
            except Exception:  # noqa: BLE001 - the display must never stop the tune
                pass

    thread = threading.Thread(target=draw, name="autosoft-monitor", daemon=True)
    thread.start()
    try:
        run_worker(spec, label=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    finally:
        done.set()
        thread.join(timeout=5)


_ENV_LOCK = threading.Lock()


def _processes(spec: BatchSpec, gpus: Sequence[str], monitor: Monitor, stream: TextIO) -> list[str]:
    """One spawned worker process per GPU, pinned with CUDA_VISIBLE_DEVICES; the monitor draws
    while they run. A worker that dies is reported; the others take over its problem."""
    ctx = mp.get_context("spawn")  # never fork a process that may hold a CUDA context
    procs: dict[str, Any] = {}
    for gpu in gpus:
        with _ENV_LOCK:  # a spawned child takes the environment as it is at start()
            before = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            try:
                proc = ctx.Process(target=_worker_process, args=(spec, gpu), name=f"autosoft-tune-gpu{gpu}")
                proc.start()
            finally:
                if before is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = before
        procs[gpu] = proc
    failed: list[str] = []
    try:
        while any(p.is_alive() for p in procs.values()):
            for gpu, proc in procs.items():
                if not proc.is_alive() and proc.exitcode not in (0, None) and gpu not in failed:
                    failed.append(gpu)
                    monitor.bar.write(f"autosoft: worker on GPU {gpu} ended with {_exit_text(proc.exitcode)}; "
                                      "the others take over its problem", file=stream)
            monitor.tick()
            time.sleep(1.0)
    except BaseException:
        for proc in procs.values():  # Ctrl-C reached them too; a SIGTERM of this process did not
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGINT)
        for proc in procs.values():
            proc.join(timeout=30)  # let them give their problems back
            if proc.is_alive():
                proc.terminate()
        raise
    for gpu, proc in procs.items():
        proc.join()
        if proc.exitcode != 0 and gpu not in failed:
            failed.append(gpu)
            monitor.bar.write(f"autosoft: worker on GPU {gpu} ended with {_exit_text(proc.exitcode)}", file=stream)
    return failed


def _exit_text(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _worker_process(spec: BatchSpec, gpu: str) -> None:
    """A spawned worker's body: errors on one line, as the CLI prints them. It ends as after
    Ctrl-C (its problem given back) when the process that started it is gone: killed, it cannot
    have stopped its workers, which would otherwise go on tuning unseen."""
    # The batch stops its workers with SIGINT (and so does the watch below). A batch started with
    # SIGINT ignored (`autosoft tune ... &` in a script: a shell without job control starts background
    # commands so) passes that on to the processes it spawns, and its workers then tuned on after
    # their parent was stopped or killed.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _end_with_parent()
    try:
        run_worker(spec, label=gpu)
    except KeyboardInterrupt:
        sys.exit(130)
    except UserError as exc:
        print(f"autosoft: error: worker on GPU {gpu}: {exc}", file=sys.stderr)
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001 - reported here, in the worker's own words
        print(f"autosoft: error: worker on GPU {gpu}: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr)
        sys.exit(1)


def _end_with_parent(poll_s: float = 1.0) -> None:
    """Interrupt this process's main thread (KeyboardInterrupt) once its parent process is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="autosoft-parent-watch", daemon=True).start()


def result_summary(record: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a result the summary table prints."""
    entry = record.get("entry") or {}
    return {"time_us": entry.get("time_us"), "default_time_us": entry.get("default_time_us"),
            "copy_time_us": entry.get("copy_time_us"), "variant": entry.get("variant_name", ""),
            "gpu_name": (entry.get("key") or {}).get("gpu_name", ""), "host": record.get("host", ""),
            "trials": record.get("trials", 0), "seconds": record.get("seconds", 0.0)}
