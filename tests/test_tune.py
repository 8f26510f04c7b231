"""CPU tier: how the tuner picks the variants it re-times at the end of a search."""
from __future__ import annotations

from autosoft.evaluate import Outcome, Status
from autosoft.families import get_family
from autosoft.families.base import Problem, Target, build_variant
from autosoft.tune import FINALISTS, Measured, finalists


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
