"""The job board of a batch tune: who is alive, who holds which problem, what finished.

It lives in the study storage itself (the Optuna storage the problems' studies are in), so
every worker process on every host that names the same storage reads the same board, and no
other server is needed. Each fact is a study whose name says what it is; Optuna's storages
create a study name at most once (a unique column in an RDB, the log's order in a journal),
which is the one atomic step everything here rests on:

- `autosoft-worker:<id>`: a worker. Its user attribute `alive_until` (epoch seconds) is moved
  forward by a heartbeat thread every `lease_s / 4`; a worker whose `alive_until` has passed
  is dead (killed, host lost). A worker that stops cleanly sets it to 0.
- `autosoft-lease:<problem study>:<g>`: generation g of the lease on a problem. Whoever
  creates generation g holds the problem while its worker is alive; when that worker is dead
  and the problem has no result, any worker may create generation g + 1 (only one can) and
  take the problem over, with the trials already finished in its study.
- a result: the user attribute `result` (JSON: the cache entry, the host and worker that
  tuned it, trials and seconds) of the lease generation that finished the problem. A holder
  writes it only while its own lease is unexpired by its own clock and no later generation
  exists (fencing), so a problem is finished exactly once; readers take the lowest generation
  with a result regardless.

Trial-level liveness (a killed worker's running trial is taken up again exactly once) is in
search.py: a RUNNING trial names its worker, and `Board.is_live` says whether that worker
still is.

Clocks: deadlines are compared on each host's own clock; keep hosts within a few seconds of
each other (NTP) and `lease_s` well above that (default 60 s).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from optuna.exceptions import DuplicatedStudyError
from optuna.study import StudyDirection

WORKER_PREFIX = "autosoft-worker:"
LEASE_PREFIX = "autosoft-lease:"
DEFAULT_LEASE_S = 60.0
LEASE_ENV = "AUTOSOFT_LEASE_SECONDS"  # tests shorten it; a cluster with slow storage lengthens it


def lease_seconds() -> float:
    text = os.environ.get(LEASE_ENV)
    if not text:
        return DEFAULT_LEASE_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        from .errors import UserError
        raise UserError(f"{LEASE_ENV}={text!r}: expected a number of seconds above 0")
    return value


def is_board_study(name: str) -> bool:
    """A study of the board rather than a problem's study (reports and listings skip these)."""
    return name.startswith((WORKER_PREFIX, LEASE_PREFIX))


@dataclass(frozen=True)
class Lease:
    problem_study: str
    generation: int
    worker: str

    @property
    def study_name(self) -> str:
        return f"{LEASE_PREFIX}{self.problem_study}:{self.generation}"


@dataclass(frozen=True)
class ProblemState:
    """One problem as the board shows it."""
    study: str
    result: Mapping[str, Any] | None = None  # the finished problem's result record
    results: int = 0                          # how many generations hold a result (1 when all is well)
    holder: str | None = None                 # the worker of the newest lease, if any
    holder_live: bool = False
    generation: int = -1                      # the newest lease generation (-1: never claimed)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def free(self) -> bool:
        """Nobody alive holds it and it is not done: a worker may claim it."""
        return not self.done and not self.holder_live


@dataclass
class Snapshot:
    """The whole board at one moment (one get_all_studies call)."""
    taken: float
    workers: dict[str, Mapping[str, Any]] = field(default_factory=dict)   # id -> user attrs
    leases: dict[str, dict[int, Mapping[str, Any]]] = field(default_factory=dict)  # problem -> gen -> attrs

    def is_live(self, worker: str) -> bool:
        attrs = self.workers.get(worker)
        return attrs is not None and float(attrs.get("alive_until", 0)) > self.taken

    def problem(self, study: str) -> ProblemState:
        gens = self.leases.get(study, {})
        with_result = sorted(g for g, attrs in gens.items() if "result" in attrs)
        result = json.loads(gens[with_result[0]]["result"]) if with_result else None
        if not gens:
            return ProblemState(study, result, len(with_result))
        newest = max(gens)
        holder = str(gens[newest].get("worker", ""))
        return ProblemState(study, result, len(with_result), holder, self.is_live(holder), newest)

    def results(self) -> list[Mapping[str, Any]]:
        """Every finished problem's result record (one per problem)."""
        return [s.result for s in (self.problem(p) for p in sorted(self.leases)) if s.result is not None]

    def live_workers(self) -> list[str]:
        return sorted(w for w in self.workers if self.is_live(w))


class Board:
    """The board on `storage` (an Optuna storage object) for one worker, `worker` (a fresh id
    by default). `lease_s`: how long a worker counts as alive after its last heartbeat.

    A Board that only reads (a monitor, `autosoft list --storage`) never calls join()."""

    def __init__(self, storage: Any, *, worker: str | None = None, lease_s: float | None = None):
        self.storage = storage
        self.worker = worker or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lease_s = lease_s if lease_s is not None else lease_seconds()
        self._study_ids: dict[str, int] = {}
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self._alive_until = 0.0  # by this process's clock: the fence for writing results
        self._recent: Snapshot | None = None

    # -- this worker ----------------------------------------------------------------------
    def join(self, **facts: Any) -> None:
        """Register this worker (facts: host, gpu, pid, ... kept with it) and start its heartbeat."""
        sid = self._create(WORKER_PREFIX + self.worker)
        assert sid is not None, "worker ids are unique"
        facts = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), **facts}
        for key, value in facts.items():
            self.storage.set_study_user_attr(sid, key, value)
        self.heartbeat()
        self._stop.clear()
        self._beat = threading.Thread(target=self._beat_loop, name="autosoft-heartbeat", daemon=True)
        self._beat.start()

    def heartbeat(self) -> None:
        until = time.time() + self.lease_s
        self.storage.set_study_user_attr(self._id(WORKER_PREFIX + self.worker), "alive_until", until)
        self._alive_until = until

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            try:
                self.heartbeat()
            except Exception:  # noqa: BLE001 - a missed beat is retried; the lease covers 3 more
                pass

    def leave(self) -> None:
        """Stop the heartbeat and say so: this worker's leases and running trials are free at once."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        try:
            self.storage.set_study_user_attr(self._id(WORKER_PREFIX + self.worker), "alive_until", 0.0)
        except Exception:  # noqa: BLE001 - leaving is best effort; the deadline frees it anyway
            pass
        self._alive_until = 0.0

    def fenced(self, margin_s: float | None = None) -> bool:
        """Whether this worker's own lease is still safely unexpired (by its own clock)."""
        margin = self.lease_s / 4 if margin_s is None else margin_s
        return time.time() + margin < self._alive_until

    # -- reading --------------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        snap = Snapshot(taken=time.time())
        for study in self.storage.get_all_studies():
            name = study.study_name
            if name.startswith(WORKER_PREFIX):
                snap.workers[name[len(WORKER_PREFIX):]] = dict(study.user_attrs)
                self._study_ids[name] = study._study_id
            elif name.startswith(LEASE_PREFIX):
                problem, _, gen = name[len(LEASE_PREFIX):].rpartition(":")
                if gen.isdigit():
                    snap.leases.setdefault(problem, {})[int(gen)] = dict(study.user_attrs)
                    self._study_ids[name] = study._study_id
        return snap

    def live(self, worker: str) -> bool:
        """Whether `worker` is alive, from a view of the board at most lease_s / 8 old (the
        search asks for every running trial it sees; one read serves them all). A worker the
        view does not know joined after it: the board is read again rather than taking a
        worker that just started for dead."""
        if worker == self.worker:
            return True
        now = time.time()
        if (self._recent is None or now - self._recent.taken > self.lease_s / 8
                or worker not in self._recent.workers):
            self._recent = self.snapshot()
        return self._recent.is_live(worker)

    # -- claiming and finishing --------------------------------------------------------------
    def claim(self, problem_study: str, snapshot: Snapshot) -> Lease | None:
        """Take the problem: the next lease generation, if the snapshot shows it free and nobody
        took that generation meanwhile. None when it is done, held by a live worker, or lost."""
        state = snapshot.problem(problem_study)
        if not state.free:
            return None
        lease = Lease(problem_study, state.generation + 1, self.worker)
        sid = self._create(lease.study_name)
        if sid is None:
            return None  # another worker created this generation first
        self.storage.set_study_user_attr(sid, "worker", self.worker)
        self.storage.set_study_user_attr(sid, "taken", time.time())
        return lease

    def finish(self, lease: Lease, result: Mapping[str, Any]) -> bool:
        """Write the problem's result on the lease, fenced: only while this worker's own lease is
        unexpired and no later generation exists. False when the write was refused (the problem
        was taken over: its new holder finishes it)."""
        if not self.fenced():
            return False
        snap = self.snapshot()
        state = snap.problem(lease.problem_study)
        if state.generation != lease.generation or state.done:
            return False
        record = {**result, "worker": self.worker, "host": socket.gethostname(), "generation": lease.generation,
                  "finished": time.time()}
        self.storage.set_study_user_attr(self._id(lease.study_name), "result", json.dumps(record, sort_keys=True))
        return True

    def release(self, lease: Lease) -> None:
        """Give a problem back unfinished (this worker stops): the next worker may claim it at once."""
        try:
            self.storage.set_study_user_attr(self._id(lease.study_name), "worker", "")
        except Exception:  # noqa: BLE001 - the deadline frees it anyway
            pass

    def clear(self, matches: Callable[[str], bool]) -> None:
        """Forget the leases and results of the problems whose study name `matches` (a fresh batch
        on the default storage, before its workers start)."""
        for study in self.storage.get_all_studies():
            name = study.study_name
            if name.startswith(LEASE_PREFIX) and matches(name[len(LEASE_PREFIX):].rpartition(":")[0]):
                self.storage.delete_study(study._study_id)
                self._study_ids.pop(name, None)

    # -- plumbing -------------------------------------------------------------------------
    def _create(self, name: str) -> int | None:
        try:
            sid = self.storage.create_new_study([StudyDirection.MINIMIZE], name)
        except DuplicatedStudyError:
            return None
        self._study_ids[name] = sid
        return sid

    def _id(self, name: str) -> int:
        sid = self._study_ids.get(name)
        if sid is None:
            sid = self.storage.get_study_id_from_name(name)
            self._study_ids[name] = sid
        return sid
