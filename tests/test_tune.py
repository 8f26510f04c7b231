"""CPU tier: how the tuner picks the variants it re-times at the end of a search, and how it
records a trial."""
from __future__ import annotations

import signal

import pytest
from optuna.trial import TrialState

from autosoft.cache import Cache
from autosoft.evaluate import Outcome, Status
from autosoft.families import get_family
from autosoft.families.base import Problem, Target, build_variant, space_of
from autosoft.runtime import DeviceInfo
from autosoft.search import Search
from autosoft.tune import FINALISTS, Ledger, Measured, finalists


def _measured(threads: int, status: Status, time_us: float | None) -> Measured:
    family = get_family("softmax")
    problem = Problem("softmax", "float32", (4096, 4096))
    target = Target.for_arch("90")
    params = {**family.default_params(problem, target), "threads": threads, "row_threads": threads}
    return Measured(build_variant(family, problem, params, target), Outcome(status, time_us))


def test_finalists_are_the_fastest_correct_variants_each_once():
    trials = [
        _measured(128, Status.OK, 30.0),
        _measured(256, Status.OK, 20.0),
        _measured(512, Status.WRONG, None),
        _measured(256, Status.OK, 19.0),     # the same variant measured twice (a resumed study)
        _measured(1024, Status.OK, 40.0),
        _measured(512, Status.TIMEOUT, None),
    ]
    chosen = finalists(trials, count=3)
    assert [m.variant.params["threads"] for m in chosen] == [256, 128, 1024]
    assert chosen[0].outcome.time_us == 19.0
    assert all(m.outcome.ok for m in chosen)


def test_finalists_are_capped_and_empty_without_a_correct_trial():
    trials = [_measured(t, Status.OK, float(t)) for t in (128, 256, 512, 1024)] * 2
    assert len(finalists(trials)) == min(FINALISTS, 4)
    assert finalists(trials, count=2)[1].variant.params["threads"] == 256
    assert finalists([_measured(128, Status.WRONG, None)]) == []


def test_ctrl_c_between_the_writes_of_a_trial_comes_after_the_trial_is_recorded(tmp_path, sigint_handled):
    """A Ctrl-C while a trial is being recorded (its attributes written, not yet its state) used
    to leave a running trial that carried a result: --resume took it for a dead worker's and
    measured the point again. Now the interruption waits until the trial is whole."""
    m = _measured(256, Status.OK, 20.0)
    search = Search(space_of(get_family("softmax")), [dict(m.variant.params)])
    search.claim(m.variant.params)
    write_attr = search._storage.set_trial_user_attr

    def interrupted_write(trial_id, key, value):
        write_attr(trial_id, key, value)
        if key == "status":
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, between the status and the state

    search._storage.set_trial_user_attr = interrupted_write
    cache = Cache(tmp_path / "k.sqlite")
    device = DeviceInfo(0, Target.for_arch("90"), "13.0")
    ledger = Ledger(search, cache, m.variant.problem, device, 1, None, default_params=m.variant.params)
    with pytest.raises(KeyboardInterrupt):
        ledger.record(m)
    [trial] = search.study.get_trials()
    assert trial.state == TrialState.COMPLETE and trial.value == 20.0 and trial.user_attrs["status"] == "ok"
    assert len(list(cache.trials())) == 1, "the trial log has the trial too"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_tune_and_a_batch_worker_run_one_pipeline(tmp_path, monkeypatch):
    """batch._own re-assembled tune()'s sequence step by step; both now run tune.tune_problem. The
    same replayed problem, through tune() and through a one-worker batch, gives the same entry."""
    from pathlib import Path

    from autosoft import tune as tune_module
    from autosoft.batch import BatchSpec, run_batch
    from autosoft.runners import ReplayRunner

    recording = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "softmax_h200.sqlite"
    family = get_family("softmax")
    problem = family.problem("4096x16384", "float32")
    alone = tune_module.tune(family, problem, 12, Cache(tmp_path / "alone.sqlite"),
                             runner=ReplayRunner(recording, problem), seed=0)

    calls = []
    pipeline = tune_module.tune_problem

    def counted(*args, **kwargs):
        calls.append(kwargs.get("shared"))
        return pipeline(*args, **kwargs)

    monkeypatch.setattr(tune_module, "tune_problem", counted)
    batch = run_batch(BatchSpec(problems=(problem,), trials=12, cache=str(tmp_path / "batch.sqlite"),
                                storage=f"sqlite:///{tmp_path / 'batch-studies.sqlite'}", fresh=True,
                                replay=str(recording)))
    assert len(calls) == 1 and calls[0] is not None, "the worker ran the pipeline once, its study shared"
    (result,) = batch.results
    (entry,) = Cache(tmp_path / "batch.sqlite").entries()
    assert alone.entry is not None and alone.stored and alone.measured_here == 12
    assert (entry.variant_name, entry.time_us, entry.default_time_us) == \
        (alone.entry.variant_name, alone.entry.time_us, alone.entry.default_time_us)
    assert result["entry"]["variant_name"] == entry.variant_name and result["trials"] == 12
