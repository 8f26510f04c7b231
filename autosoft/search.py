"""Choosing the next variant: Optuna over the valid points of a search space.

The only module that imports optuna. Constraints make most of the raw product of parameter
values invalid (97% for softmax), so a point Optuna suggests is repaired to the nearest valid
point not yet tried; the suggestion is closed as pruned and the repaired point is added to the
study as the trial that was measured, so the sampler learns only from real measurements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from .space import ParamValue, SearchSpace

optuna.logging.set_verbosity(optuna.logging.WARNING)


@dataclass(frozen=True)
class Proposal:
    params: dict[str, ParamValue]
    seeded: bool  # one of the family's seeds rather than a sampler suggestion


class Search:
    def __init__(self, space: SearchSpace, valid: Sequence[Mapping[str, ParamValue]], *,
                 seeds: Sequence[Mapping[str, ParamValue]] = (), seed: int = 0,
                 storage: str | None = None, study_name: str | None = None, n_startup: int = 12):
        if not valid:
            raise ValueError("the search space has no valid point for this problem")
        self.space = space
        self._names = space.names
        self._valid = [dict(v) for v in valid]
        # each valid point as the index of its value in every parameter's domain
        self._index = np.array([[space.parameter(n).values.index(v[n]) for n in self._names] for v in valid])
        self._scale = np.array([max(1, len(space.parameter(n).values) - 1) for n in self._names], dtype=float)
        self._row = {self._key(v): i for i, v in enumerate(self._valid)}
        self._tried = np.zeros(len(valid), dtype=bool)
        self._distributions = {n: CategoricalDistribution(list(space.parameter(n).values)) for n in self._names}
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup, multivariate=True)
        self.study = optuna.create_study(direction="minimize", sampler=sampler, storage=storage,
                                         study_name=study_name, load_if_exists=storage is not None)
        self._pending_seeds = [dict(s) for s in seeds if self._key(s) in self._row]
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            if t.params and self._key(t.params) in self._row:
                self._tried[self._row[self._key(t.params)]] = True  # resuming: never re-run a finished point

    def _key(self, params: Mapping[str, Any]) -> tuple:
        return tuple(params.get(n) for n in self._names)

    @property
    def exhausted(self) -> bool:
        return bool(self._tried.all())

    def ask(self) -> Proposal | None:
        """The next untried valid point, or None when every valid point has been tried."""
        while self._pending_seeds:
            row = self._row[self._key(self._pending_seeds.pop(0))]
            if not self._tried[row]:
                self._tried[row] = True
                return Proposal(dict(self._valid[row]), True)  # the declared values, not the caller's
        if self.exhausted:
            return None
        trial = self.study.ask(self._distributions)
        wanted = np.array([self.space.parameter(n).values.index(trial.params[n]) for n in self._names])
        distance = (np.abs(self._index - wanted) / self._scale).sum(axis=1)
        distance[self._tried] = np.inf
        row = int(np.argmin(distance))
        self.study.tell(trial, state=TrialState.PRUNED)
        self._tried[row] = True
        return Proposal(dict(self._valid[row]), False)

    def mark_tried(self, params: Mapping[str, ParamValue]) -> None:
        """A point measured outside ask() (the default, first) is not proposed again."""
        row = self._row.get(self._key(params))
        if row is not None:
            self._tried[row] = True

    def tell(self, params: Mapping[str, ParamValue], time_us: float | None, status: str,
             attrs: Mapping[str, float | str] | None = None) -> None:
        """Record a measured point: its time when correct, a failure otherwise; `attrs` (e.g.
        compile_s, evaluate_s) are kept with it as the trial's user attributes."""
        state = TrialState.COMPLETE if time_us is not None else TrialState.FAIL
        self.study.add_trial(optuna.trial.create_trial(
            params=dict(params), distributions=self._distributions,
            value=time_us if time_us is not None else None, state=state,
            user_attrs={**(attrs or {}), "status": status}))

    def note(self, name: str, value: float | str) -> None:
        """Keep a fact about the whole study with it (e.g. the GPU's measured peak)."""
        self.study.set_user_attr(name, value)

    def finished(self) -> list[tuple[dict[str, ParamValue], float | None, str]]:
        out = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
            out.append((dict(t.params), t.value, str(t.user_attrs.get("status", ""))))
        return out
