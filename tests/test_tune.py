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


# --- warm starts: what the cache knows is tried first ---------------------------------------------

from autosoft.runners import Runner  # noqa: E402
from autosoft.tune import open_study, seed_order, warm_seed_order, warm_start_points  # noqa: E402

from helpers import make_entry, make_selector, softmax_key  # noqa: E402

H200 = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")
SOFTMAX = get_family("softmax")
PROBLEM = Problem("softmax", "float32", (4096, 20000))  # nobody tuned it
DEFAULT = SOFTMAX.default_params(PROBLEM, H200.target)
PICK = {**DEFAULT, "threads": 1024, "row_threads": 1024, "unroll": 2, "storage": "reread", "normalise": "online"}
NEAR = {**DEFAULT, "streaming": True}
NEXT = {**DEFAULT, "vec": 2}
SHORT_ONLY = SOFTMAX.default_params(SOFTMAX.problem("64x512"), H200.target)  # invalid on rows of 20000


def _warm_cache(path, selector_configs=(PICK, SHORT_ONLY)):
    cache = Cache(path)
    cache.put(make_entry(softmax_key("4096x16384"), time_us=5.0, params=NEAR))
    cache.put(make_entry(softmax_key("2048x32768"), time_us=5.0, params=NEXT))
    cache.put(make_entry(softmax_key("4096x512"), time_us=1.0, params=SHORT_ONLY))  # near enough, invalid here
    cache.put(make_entry(softmax_key("1x1"), time_us=1.0, params=PICK))  # farther than the three above
    cache.put(make_entry(softmax_key("4096x20000", gpu_name="NVIDIA A100"), params={**DEFAULT, "unroll": 4}))
    cache.put_selector(make_selector(list(selector_configs)))  # one leaf, ranked in this order
    return cache


def test_warm_start_points_are_the_selector_pick_then_the_nearest_valid_winners(tmp_path):
    cache = _warm_cache(tmp_path / "k.sqlite")
    for p in (PICK, NEAR, NEXT):
        assert SOFTMAX.is_valid(PROBLEM, H200.target, p)
    assert warm_start_points(SOFTMAX, PROBLEM, H200, cache) == [PICK, NEAR, NEXT]
    assert warm_start_points(SOFTMAX, PROBLEM, H200, Cache(tmp_path / "empty.sqlite")) == []


def test_a_selector_whose_first_configuration_is_invalid_here_adds_no_point(tmp_path):
    cache = _warm_cache(tmp_path / "k.sqlite", selector_configs=(SHORT_ONLY, PICK))
    assert not SOFTMAX.is_valid(PROBLEM, H200.target, SHORT_ONLY)
    assert warm_start_points(SOFTMAX, PROBLEM, H200, cache) == [NEAR, NEXT]


def test_without_nearby_winners_the_leafs_next_valid_configuration_is_the_point(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    cache.put_selector(make_selector([SHORT_ONLY, PICK]))  # one leaf: SHORT_ONLY first, invalid here
    assert warm_start_points(SOFTMAX, PROBLEM, H200, cache) == [PICK]


def test_seed_order_puts_the_warm_start_between_the_default_and_the_seeds_each_once():
    a, b, c = {"x": 1}, {"x": 2}, {"x": 3}
    assert seed_order(a, [b, a, b], [c, b]) == [a, b, c]


class _Points(Runner):
    """A runner double that can evaluate only the points it lists (as a replay can): the study's
    order of proposals is what is under test, nothing is evaluated."""

    def __init__(self, points):
        self.points = points

    @property
    def device(self):
        return H200

    def candidates(self, family, problem):
        return [dict(p) for p in self.points]

    def evaluate(self, family, variant, seed, timeout_s):
        raise AssertionError("nothing is evaluated here")

    def time_side_by_side(self, family, variants, timeout_s):
        raise AssertionError("nothing is timed here")

    def time_copy(self, nbytes_each_way):
        raise AssertionError("nothing is timed here")


@pytest.mark.parametrize("warm", [True, False])
def test_a_warm_started_study_proposes_the_cache_knowledge_right_after_the_default(tmp_path, warm):
    cache = _warm_cache(tmp_path / "k.sqlite")
    seeds = SOFTMAX.seed_params(PROBLEM, H200.target)
    runner = _Points([DEFAULT, *seeds, NEXT, NEAR, PICK])
    search = open_study(SOFTMAX, PROBLEM, H200, cache, runner, seed=0, resume=False, warm_start=warm)
    asked = [search.ask().params for _ in range(4)]
    if warm:
        assert asked == [DEFAULT, PICK, NEAR, NEXT]
    else:
        assert asked[:2] == [DEFAULT, *[s for s in seeds if s != DEFAULT][:1]]
        assert PICK not in asked[:1 + len(seeds)]


def _log(cache, shape, times, gpu_name="NVIDIA H200", status="ok"):
    cache.record_trials([{"family": "softmax", "dtype": "float32", "shape": shape, "gpu_name": gpu_name,
                          "variant_name": "v", "params": p, "status": status, "time_us": t, "message": ""}
                         for p, t in times])


def test_a_warm_start_orders_the_seeds_by_how_they_ran_on_the_nearest_tuned_shapes(tmp_path):
    seeds = SOFTMAX.seed_params(PROBLEM, H200.target)
    first, second, third, fourth = seeds[:4]
    cache = _warm_cache(tmp_path / "k.sqlite")
    _log(cache, "4096x16384", [(fourth, 1.0), (third, 1.5), (second, 1.05)])
    _log(cache, "2048x32768", [(fourth, 1.02), (third, 1.0)])
    _log(cache, "4096x16384", [(first, 0.5)], gpu_name="NVIDIA A100")  # another GPU's log tells nothing
    _log(cache, "4096x16384", [(first, 0.1)], status="wrong")         # nor does a wrong result
    _log(cache, "1x1", [(first, 0.1)])                                 # nor a shape farther than the nearest three
    order = warm_seed_order(SOFTMAX, PROBLEM, H200, cache, seeds)
    # fourth: ratios 1.0 and 1.02; second 1.05; then the ones never run (as 1.10) in the family's order,
    # third (1.5 and 1.0: a mean log ratio of about 1.22) after them
    assert order[:3] == [fourth, second, first]
    assert order.index(third) == len(seeds) - 1
    assert sorted(map(str, order)) == sorted(map(str, seeds)), "the same seeds, reordered"


def test_without_nearby_tuned_shapes_the_seeds_keep_the_family_order(tmp_path):
    seeds = SOFTMAX.seed_params(PROBLEM, H200.target)
    assert warm_seed_order(SOFTMAX, PROBLEM, H200, Cache(tmp_path / "empty.sqlite"), seeds) == seeds
    cache = _warm_cache(tmp_path / "k.sqlite")  # nearby entries, but no trial logged
    assert warm_seed_order(SOFTMAX, PROBLEM, H200, cache, seeds) == seeds


def test_a_cold_study_keeps_the_family_seed_order(tmp_path):
    seeds = SOFTMAX.seed_params(PROBLEM, H200.target)
    cache = _warm_cache(tmp_path / "k.sqlite")
    _log(cache, "4096x16384", [(seeds[3], 1.0), (seeds[0], 2.0)])
    runner = _Points([DEFAULT, *seeds, NEXT, NEAR, PICK])
    cold = open_study(SOFTMAX, PROBLEM, H200, cache, runner, seed=0, resume=False, warm_start=False)
    asked = [cold.ask().params for _ in range(3)]
    assert asked == seed_order(DEFAULT, [], seeds)[:3]
    warm = open_study(SOFTMAX, PROBLEM, H200, cache, runner, seed=0, resume=False, warm_start=True)
    asked = [warm.ask().params for _ in range(5)]
    assert asked[:4] == [DEFAULT, PICK, NEAR, NEXT] and asked[4] == seeds[3]
