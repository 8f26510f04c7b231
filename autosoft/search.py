"""Choosing the next variant: Optuna over the valid points of a search space.

The only module that uses Optuna's samplers and studies (storage.py opens Optuna storages,
board.py keeps a batch's board in one, report/ reads them). Constraints make most of the raw
product of parameter values invalid (97% for softmax), so a point Optuna suggests is repaired to
the nearest valid point not yet tried; the suggestion is closed as pruned and the repaired point
is added to the study as the trial that is measured, so the sampler learns only from real
measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
import uuid
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from .space import ParamValue, SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Proposal:
    params: dict[str, ParamValue]
    seeded: bool  # one of the family's seeds rather than a sampler suggestion
    retry_of: int | None = None  # the number of a dead worker's trial of this point, taken up again


class Search:
    """The points of one problem's study to evaluate, in order: trials a dead worker left (taken
    up again), then the seeds, then the sampler's suggestions repaired to untried valid points.

    worker: the id this process's claims carry (a fresh one by default); is_live(worker id):
    whether another worker is alive (default: none is, so a RUNNING trial left by an earlier,
    interrupted run is taken up again). `reaps`: whether this search takes up dead workers'
    trials; a helper's does not (only the problem's owner does, who re-runs what it reaps
    before anything else, so a reaped point is never left without its retry)."""

    def __init__(self, space: SearchSpace, valid: Sequence[Mapping[str, ParamValue]], *,
                 seeds: Sequence[Mapping[str, ParamValue]] = (), seed: int = 0,
                 storage: Any = None, study_name: str | None = None, n_startup: int = 12,
                 worker: str | None = None, is_live: Callable[[str], bool] | None = None, reaps: bool = True):
        if not valid:
            raise ValueError("the search space has no valid point for this problem")
        self.space = space
        # one group of parameters per engine (a family with engines); one unnamed group otherwise
        self._groups: dict[str | None, SearchSpace] = dict(getattr(space, "spaces", None) or [(None, space)])
        self._multi = None not in self._groups
        self._valid = [dict(v) for v in valid]
        self._row = {self._key(v): i for i, v in enumerate(self._valid)}
        self._tried = np.zeros(len(valid), dtype=bool)
        # each engine's valid points, as the index of their value in every parameter's domain
        self._rows: dict[str | None, np.ndarray] = {}
        self._index: dict[str | None, np.ndarray] = {}
        self._scale: dict[str | None, np.ndarray] = {}
        for engine, group in self._groups.items():
            rows = [i for i, v in enumerate(self._valid) if self._engine(v) == engine]
            self._rows[engine] = np.array(rows, dtype=int)
            self._index[engine] = np.array([[group.parameter(n).values.index(self._valid[i][n]) for n in group.names]
                                            for i in rows]).reshape(len(rows), len(group.names))
            self._scale[engine] = np.array([max(1, len(group.parameter(n).values) - 1) for n in group.names], dtype=float)
        # Optuna's names: a family with engines qualifies each parameter by its engine ("mma.block_m"),
        # so that two engines' parameters of one name but other values never meet in one distribution
        self._distributions = {engine: {**({"engine": CategoricalDistribution(list(self._groups))} if self._multi else {}),
                                        **{self._optuna_name(engine, n): CategoricalDistribution(list(group.parameter(n).values))
                                           for n in group.names}}
                               for engine, group in self._groups.items()}
        self.worker = worker or uuid.uuid4().hex
        self._is_live = is_live or (lambda other: False)
        self._reaps = reaps
        self._storage = optuna.storages.get_storage(storage)
        # with engines the space is conditional (each engine's parameters): TPE's groups model each
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # `group`: experimental
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup, multivariate=True,
                                                 **({"group": True} if self._multi else {}))
        self.study = optuna.create_study(direction="minimize", sampler=sampler, storage=self._storage,
                                         study_name=study_name, load_if_exists=storage is not None)
        self._study_id = self._storage.get_study_id_from_name(self.study.study_name)
        self._pending_seeds = [dict(s) for s in seeds if self._key(s) in self._row]
        self._retries: list[tuple[dict[str, ParamValue], int]] = []
        self._mine: dict[tuple, int] = {}  # my claims not yet told: point -> trial id
        self._spent = 0
        self._running_elsewhere = 0
        self.reaped = 0  # dead workers' trials this search took up again
        self.refresh()

    def _engine(self, params: Mapping[str, Any]) -> str | None:
        return params.get("engine") if self._multi else None

    def _key(self, params: Mapping[str, Any]) -> tuple:
        engine = self._engine(params)
        group = self._groups.get(engine)
        if group is None:
            return (engine,)
        values = tuple(params.get(n) for n in group.names)
        return (engine, *values) if self._multi else values

    @staticmethod
    def _optuna_name(engine: str | None, name: str) -> str:
        return name if engine is None else f"{engine}.{name}"

    def _optuna_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A point as its trial records it: with engines, the engine and its qualified parameters."""
        engine = self._engine(params)
        names = self._groups[engine].names
        return {**({"engine": engine} if self._multi else {}), **{self._optuna_name(engine, n): params[n] for n in names}}

    def plain(self, trial_params: Mapping[str, Any]) -> dict[str, Any]:
        """A trial's params as a point (the inverse of the qualified names)."""
        return plain_params(trial_params)

    @property
    def exhausted(self) -> bool:
        return bool(self._tried.all()) and not self._retries

    # -- the shared view --------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the study again: points others took count as tried, trials of dead workers are
        reaped (the ones this worker won are evaluated again first)."""
        self._spent = self._running_elsewhere = 0
        for t in self._storage.get_all_trials(self._study_id, deepcopy=False):
            kind = _point_state(t)
            if kind is None:
                continue  # a sampler suggestion (pruned) or a withdrawn claim
            row = self._row.get(self._key(self.plain(t.params))) if t.params else None
            if row is not None:
                self._tried[row] = True  # finished, running or reaped: not proposed again
            if kind == "running":
                owner = str(t.user_attrs.get("worker", ""))
                if owner != self.worker and not self._is_live(owner):
                    if self._reaps:
                        if self._reap(t):
                            continue
                        kind = "reaped"
                elif owner != self.worker:
                    self._running_elsewhere += 1
            if kind != "reaped":
                self._spent += 1

    def _reap(self, t: FrozenTrial) -> bool:
        """Fail a dead worker's running trial; True when this worker won it (and will re-run it)."""
        try:
            self._storage.set_trial_user_attr(t._trial_id, "reaped_by", self.worker)
            self._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            return False  # finished meanwhile, or another worker reaped it first
        if self._key(self.plain(t.params)) in self._row:
            self._retries.append((self.plain(t.params), t.number))
        self.reaped += 1
        return True

    def spent(self) -> int:
        """Points of the study measured or being measured, by any worker (as of the last refresh
        and this worker's own claims since)."""
        return self._spent

    @property
    def running_elsewhere(self) -> int:
        """Trials other live workers are evaluating in this study (as of the last refresh)."""
        return self._running_elsewhere

    # -- taking points ----------------------------------------------------------------------
    def ask(self, budget: int | None = None) -> Proposal | None:
        """The next point to evaluate, claimed for this worker: a dead worker's trial first, then
        the seeds, then the sampler's; None when every valid point has been tried, or when
        `budget` points of the study (measured or being measured, by any worker) came before this
        worker's claim: workers sharing a study that each saw one point left take one between them."""
        self.refresh()
        if self._retries:
            params, number = self._retries.pop(0)
            self._claim(params, retry_of=number)
            return Proposal(params, False, number)
        while True:
            if self._pending_seeds:
                row = self._row[self._key(self._pending_seeds.pop(0))]
                if self._tried[row]:
                    continue
                seeded = True
            else:
                if self._tried.all():
                    return None
                trial, engine, wanted = self._suggest()
                rows = self._rows[engine]
                if len(rows) and not self._tried[rows].all():
                    distance = (np.abs(self._index[engine] - wanted) / self._scale[engine]).sum(axis=1)
                    distance[self._tried[rows]] = np.inf
                    row = int(rows[int(np.argmin(distance))])
                else:  # every point of the suggested engine is tried: the first untried of another
                    row = int(np.argmin(self._tried))
                self.study.tell(trial, state=TrialState.PRUNED)
                seeded = False
            params = dict(self._valid[row])  # the declared values, not the caller's
            claimed = self._claim(params, first=True, budget=budget)
            if claimed is None:
                return None  # the budget went to other workers' claims since the refresh
            if claimed:
                return Proposal(params, seeded)
            # another worker claimed this point since the refresh: it is tried; choose again

    def _suggest(self) -> tuple[Any, str | None, np.ndarray]:
        """A sampler suggestion: the trial, its engine and its values' indices in their domains.
        With engines the trial chooses the engine first, then that engine's parameters."""
        if not self._multi:
            group = self._groups[None]
            trial = self.study.ask(self._distributions[None])
            return trial, None, np.array([group.parameter(n).values.index(trial.params[n]) for n in group.names])
        trial = self.study.ask()
        engine = trial.suggest_categorical("engine", list(self._groups))
        group = self._groups[engine]
        wanted = [group.parameter(n).values.index(trial.suggest_categorical(self._optuna_name(engine, n),
                                                                            list(group.parameter(n).values)))
                  for n in group.names]
        return trial, engine, np.array(wanted)

    def claim(self, params: Mapping[str, ParamValue]) -> None:
        """Claim a point measured outside ask() (the default, first): not proposed again, and
        told like the others. A pending retry of the same point is this claim (it records the
        reaped trial it replaces, as ask()'s retries do)."""
        key = self._key(params)
        replaced = [n for p, n in self._retries if self._key(p) == key]
        self._retries = [(p, n) for p, n in self._retries if self._key(p) != key]
        self._claim(dict(params), retry_of=replaced[0] if replaced else None)

    def _claim(self, params: dict[str, ParamValue], retry_of: int | None = None, first: bool = False,
               budget: int | None = None) -> bool | None:
        """Add this worker's RUNNING trial of the point. With `first`, keep it only if no other
        worker's claim or measurement of the point came before it in the study (trial numbers
        follow the order the storage took them in, so of two workers claiming one point at once
        exactly one keeps it); the other claim is withdrawn and False returned. With a `budget`,
        the claim is also withdrawn, and None returned, when that many points came before it."""
        key = self._key(params)
        row = self._row.get(key)
        if row is not None:
            self._tried[row] = True
        attrs: dict[str, Any] = {"worker": self.worker}
        if retry_of is not None:
            attrs["retry_of"] = retry_of
        trial_id = self._storage.create_new_trial(self._study_id, template_trial=optuna.trial.create_trial(
            params=self._optuna_params(params), distributions=self._distributions[self._engine(params)],
            state=TrialState.RUNNING, user_attrs=attrs))
        if first:
            number = self._storage.get_trial_number_from_id(trial_id)
            earlier: set[tuple] = set()  # the points claimed or measured before this claim
            for t in self._storage.get_all_trials(self._study_id, deepcopy=False):
                if t.number < number and t.params and self._holds_place(t):
                    earlier.add(self._key(self.plain(t.params)))
            if key in earlier:
                self._storage.set_trial_state_values(trial_id, TrialState.PRUNED)
                return False
            if budget is not None and len(earlier) >= budget:
                self._storage.set_trial_state_values(trial_id, TrialState.PRUNED)
                if row is not None:
                    self._tried[row] = False  # nobody measures it: untried, as before the claim
                return None
        self._mine[key] = trial_id
        self._spent += 1
        return True

    def _holds_place(self, t: FrozenTrial) -> bool:
        """Whether a trial holds one of the study's places: measured, running, or reaped by a
        live worker, whose retry of the point is about to be claimed (the same point: a set of
        points counts the two once). Without the last, a claim slipped in between a reap and its
        retry would take the reaped trial's place and the study end one point past its budget."""
        kind = _point_state(t)
        if kind == "reaped":
            reaper = str(t.user_attrs.get("reaped_by", ""))
            return bool(reaper) and (reaper == self.worker or self._is_live(reaper))
        return kind in ("measured", "running")

    def withdraw(self, params: Mapping[str, ParamValue]) -> None:
        """Give up a claim unevaluated (the tune was interrupted): the point is untried again."""
        trial_id = self._mine.pop(self._key(params), None)
        if trial_id is None:
            return
        try:
            self._storage.set_trial_state_values(trial_id, TrialState.PRUNED)
        except UpdateFinishedTrialError:
            return
        row = self._row.get(self._key(params))
        if row is not None:
            self._tried[row] = False
        self._spent -= 1

    def tell(self, params: Mapping[str, ParamValue], time_us: float | None, status: str,
             attrs: Mapping[str, float | str] | None = None) -> bool:
        """Record a measured point: its time when correct, a failure otherwise; `attrs` (e.g.
        compile_s, evaluate_s) are kept with it as the trial's user attributes. False when the
        claim had been reaped meanwhile (this worker was taken for dead): the point's result is
        then the worker's that took it up."""
        state = TrialState.COMPLETE if time_us is not None else TrialState.FAIL
        trial_id = self._mine.pop(self._key(params), None)
        if trial_id is None:  # a point never claimed (a caller measuring on its own)
            self._claim(dict(params))
            trial_id = self._mine.pop(self._key(params))
        try:
            for name, value in {**(attrs or {}), "status": status}.items():
                self._storage.set_trial_user_attr(trial_id, name, value)
            self._storage.set_trial_state_values(trial_id, state, None if time_us is None else [time_us])
        except UpdateFinishedTrialError:
            return False
        return True

    def note(self, name: str, value: float | str) -> None:
        """Keep a fact about the whole study with it (e.g. the GPU's measured peak)."""
        self.study.set_user_attr(name, value)

    def finished(self) -> list[tuple[dict[str, ParamValue], float | None, str]]:
        """Every point measured in the study, by any worker: (params, time or None, status)."""
        out = []
        for t in self._storage.get_all_trials(self._study_id, deepcopy=False,
                                              states=(TrialState.COMPLETE, TrialState.FAIL)):
            if _point_state(t) == "measured":
                out.append((self.plain(t.params), t.value, str(t.user_attrs.get("status", ""))))
        return out


def plain_params(trial_params: Mapping[str, Any]) -> dict[str, Any]:
    """A trial's params as the point they record: a family with engines names its parameters in
    Optuna qualified by the engine ("mma.block_m"); the point holds "engine" and the bare names."""
    engine = trial_params.get("engine")
    out: dict[str, Any] = {}
    for name, value in trial_params.items():
        prefix, dot, bare = name.partition(".")
        if not dot:
            out.setdefault(name, value)
        elif prefix == engine:
            out[bare] = value
    return out


def _point_state(t: FrozenTrial) -> str | None:
    """What a trial of the study is: "measured", "running", "reaped", or None (a sampler's
    suggestion, closed as pruned at once, or a withdrawn claim)."""
    if t.state == TrialState.COMPLETE:
        return "measured"
    if t.state == TrialState.FAIL:
        # A measured failure carries its status. A correct result is always COMPLETE: a failed
        # trial with status "ok" is a tell the reaper cut between its two writes (status, then
        # state) when a live but slow worker was taken for dead, so it is reaped, not measured.
        status = t.user_attrs.get("status")
        return "measured" if status is not None and status != "ok" else "reaped"
    if t.state == TrialState.RUNNING and "worker" in t.user_attrs:
        return "running"
    return None
