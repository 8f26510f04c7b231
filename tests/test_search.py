"""search.py: proposals are valid, new, seeds first; the sampler beats random on a synthetic objective."""
from __future__ import annotations

import random
import textwrap

import numpy as np
import pytest

from autosoft.families import get_family
from autosoft.families.base import Problem, Target, space_of
from autosoft.search import Search
from autosoft.space import parse_space

SOFTMAX = get_family("softmax")

TINY = textwrap.dedent("""\
    family: tiny
    parameters:
      a: {values: [1, 2, 4, 8]}
      b: {values: [x, y, z]}
      c: {values: [false, true]}
    constraints:
      - require: "a <= 4 or b != 'z'"
        why: test
      - require: "not c or a >= 2"
        why: test
    """)


def _key(space, params) -> tuple:
    return tuple(params[n] for n in space.names)


def _softmax_setup(shape=(7, 1025), dtype="float16"):
    space = space_of(SOFTMAX)
    problem = Problem("softmax", dtype, shape)
    target = Target.for_arch("90")
    valid = space.valid_points(SOFTMAX.problem_values(problem, target))
    default = SOFTMAX.default_params(problem, target)
    seeds = [default, *SOFTMAX.seed_params(problem, target)]
    return space, valid, seeds


def test_proposals_are_valid_new_and_seeds_come_first():
    space, valid, seeds = _softmax_setup()
    assert len(seeds) >= 3
    valid_keys = {_key(space, v) for v in valid}
    search = Search(space, valid, seeds=seeds, seed=5)
    seen = []
    for i in range(120):
        proposal = search.ask()
        assert proposal is not None
        key = _key(space, proposal.params)
        assert key in valid_keys, f"ask {i}: {proposal.params} is not a valid point"
        assert key not in seen, f"ask {i}: {proposal.params} proposed twice"
        assert set(proposal.params) == set(space.names)
        seen.append(key)
        if i < len(seeds):
            assert proposal.seeded and proposal.params == seeds[i], "seeds first, in order"
        else:
            assert not proposal.seeded
        # a made-up objective; every fifth variant "fails"
        fails = i % 5 == 4
        search.tell(proposal.params, None if fails else 10.0 + i % 7, "wrong" if fails else "ok")
    finished = search.finished()
    assert len(finished) == 120
    assert sum(1 for _, t, s in finished if t is None and s == "wrong") == 24
    assert {_key(space, p) for p, _, _ in finished} == set(seen)


def test_invalid_and_repeated_seeds_are_skipped():
    space = parse_space(TINY, "tiny.yaml")
    valid = space.valid_points({})
    invalid_seed = {"a": 8, "b": "z", "c": False}
    assert _key(space, invalid_seed) not in {_key(space, v) for v in valid}
    good = {"a": 2, "b": "y", "c": True}
    search = Search(space, valid, seeds=[invalid_seed, good, dict(good), {"a": 1, "b": "x", "c": False}], seed=0)
    first = [search.ask() for _ in range(3)]
    assert [p.params for p in first[:2]] == [good, {"a": 1, "b": "x", "c": False}]
    assert [p.seeded for p in first] == [True, True, False]
    assert first[2].params not in (good, invalid_seed)


def test_small_space_is_exhausted_exactly_once_then_none():
    space = parse_space(TINY, "tiny.yaml")
    valid = space.valid_points({})
    assert 10 < len(valid) < 24
    search = Search(space, valid, seeds=[valid[3]], seed=1, n_startup=4)
    seen = []
    for i in range(len(valid)):
        assert not search.exhausted
        proposal = search.ask()
        assert proposal is not None, f"None after {i} of {len(valid)} points"
        seen.append(_key(space, proposal.params))
        search.tell(proposal.params, float(i % 3) + 1.0, "ok")
    assert sorted(seen, key=repr) == sorted((_key(space, v) for v in valid), key=repr)
    assert search.exhausted
    assert search.ask() is None
    assert search.ask() is None


def test_a_single_valid_point_and_an_empty_set():
    space = parse_space(TINY, "tiny.yaml")
    only = [{"a": 1, "b": "x", "c": False}]
    search = Search(space, only)
    assert search.ask().params == only[0]
    assert search.ask() is None
    with pytest.raises(ValueError):
        Search(space, [])


def test_resuming_a_stored_study_never_repeats_a_finished_point(tmp_path):
    space, valid, seeds = _softmax_setup((64, 1000), "float32")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = Search(space, valid, seeds=seeds, seed=2, storage=storage, study_name="s")
    done = []
    first_run = len(seeds) + 3  # every seed, then a few points of the sampler's own
    for i in range(first_run):
        p = first.ask()
        first.tell(p.params, 5.0 + i, "ok")
        done.append(_key(space, p.params))
    second = Search(space, valid, seeds=seeds, seed=2, storage=storage, study_name="s")
    for _ in range(10):
        p = second.ask()
        assert _key(space, p.params) not in done, "a point finished before the restart was proposed again"
        assert not p.seeded, "every seed was already measured"
        second.tell(p.params, 1.0, "ok")
    assert len(second.finished()) == first_run + 10


def test_workers_that_each_see_one_point_left_take_one_between_them(tmp_path, monkeypatch):
    """Two workers share a study with a budget of 4 points and 3 taken: both refreshed before
    either claimed, so each counts 3; the claim the storage took first is kept, the other is
    withdrawn (ask returns None) and its point stays untried for that worker."""
    space, valid, seeds = _softmax_setup((64, 1000), "float32")
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = Search(space, valid, seeds=seeds, seed=2, storage=storage, study_name="s", worker="a",
                   is_live=lambda w: True)
    for i in range(3):
        p = first.ask(budget=4)
        first.tell(p.params, 5.0 + i, "ok")
    second = Search(space, valid, seed=3, storage=storage, study_name="s", worker="b", is_live=lambda w: True)
    first.refresh()
    second.refresh()
    assert first.spent() == second.spent() == 3
    with monkeypatch.context() as m:
        m.setattr(Search, "refresh", lambda self: None)  # both ask with what they saw: one point left
        kept = first.ask(budget=4)
        lost = second.ask(budget=4)
    assert kept is not None and lost is None
    second.refresh()
    assert second.spent() == 4, "the withdrawn claim is not a point of the study"
    assert first.ask(budget=5) is not None, "a larger budget still proposes"


def _synthetic_best_percentiles(space, valid, runs: int, asks: int, use_search: bool) -> list[float]:
    """time = 1 + L1 distance (in value-index steps) from a hidden optimum; the fraction of valid
    points strictly better than the best point found in `asks` proposals, per run."""
    index = np.array([[space.parameter(n).values.index(v[n]) for n in space.names] for v in valid])
    row_of = {_key(space, v): i for i, v in enumerate(valid)} if use_search else {}
    out = []
    for run in range(runs):
        rng = random.Random(1000 + run)
        optimum = index[rng.randrange(len(valid))]
        cost = np.abs(index - optimum).sum(axis=1)
        if use_search:
            search = Search(space, valid, seed=run)
            best = np.inf
            for _ in range(asks):
                p = search.ask()
                c = float(cost[row_of[_key(space, p.params)]])
                best = min(best, c)
                search.tell(p.params, 1.0 + c, "ok")
        else:
            best = float(cost[rng.sample(range(len(valid)), asks)].min())
        out.append(float((cost < best).mean()))
    return out


@pytest.mark.long
def test_search_beats_random_on_a_synthetic_objective():
    space, valid, _ = _softmax_setup((4096, 8192), "float16")
    runs, asks = 8, 60
    found = _synthetic_best_percentiles(space, valid, runs, asks, use_search=True)
    rand = _synthetic_best_percentiles(space, valid, 200, asks, use_search=False)
    # every run ends within the best 5%; random misses that about once in 20 runs
    assert max(found) <= 0.05, found
    # and well inside it: on average the search ends more than twice as close to the top as random
    assert np.mean(found) < 0.5 * np.mean(rand), (np.mean(found), np.mean(rand))
    # it reaches the best 0.5% more often than random does
    assert np.mean(np.array(found) <= 0.005) > np.mean(np.array(rand) <= 0.005) + 0.2, (found, np.mean(rand))


def test_seeds_are_returned_as_the_declared_valid_point():
    """A seed that equals a valid point only loosely (2.0 for 2, 1 for True) comes back as the valid point."""
    space = parse_space(TINY, "tiny.yaml")
    valid = space.valid_points({})
    search = Search(space, valid, seeds=[{"a": 2.0, "b": "y", "c": 1}], seed=0)
    proposal = search.ask()
    assert proposal.params in valid
    assert [type(proposal.params[n]) for n in space.names] == [int, str, bool], proposal.params


# --- the tuning loop, with a stand-in GPU ----------------------------------------------------------

@pytest.mark.long
def test_tune_loop_with_a_stand_in_gpu(tmp_path, monkeypatch):
    """tune() runs a GpuRunner that compiles for real (NVRTC, in its own pool) and asks a stand-in
    worker for verification and times: it runs exactly the requested trials, starts with the
    default, logs every outcome, re-times the fastest few side by side and stores the winner of
    that, a correct variant."""
    import concurrent.futures as cf
    import hashlib
    import multiprocessing as mp

    import autosoft.tune as tune_module
    from autosoft.evaluate import Outcome, Status
    from autosoft.runners import GpuRunner
    from autosoft.runtime import DeviceInfo

    monkeypatch.setenv("AUTOSOFT_KERNEL_STORE", str(tmp_path / "kernels"))
    device = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")
    evaluated = []
    slow_down = {"by": 0.0}
    side_by_side = []  # the finalists the fake device was asked to re-time

    def fake_evaluate(variant, cubin, seed=0, reps=40):
        assert cubin.startswith(b"\x7fELF"), "only compiled variants reach the GPU"
        evaluated.append(dict(variant.params))
        if variant.params["streaming"]:
            return Outcome(Status.WRONG, message="fake mismatch")
        if variant.params["unroll"] == 4:
            return Outcome(Status.LAUNCH_FAIL, message="fake fault")
        digest = int(hashlib.sha256(variant.name.encode()).hexdigest()[:8], 16)
        return Outcome(Status.OK, time_us=10.0 + digest % 1000 / 10 + slow_down["by"])

    class FakeWorker:  # stands in for the GPU worker process that runs the candidates
        restarts = 0

        def stop(self):
            pass

        def evaluate(self, family, variant, cubin, seed, timeout_s):
            return fake_evaluate(variant, cubin, seed)

        def time_copy(self, nbytes_each_way, l2_bytes, timeout_s=120.0):
            return 5.0

        def time_side_by_side(self, family, compiled, timeout_s):
            assert all(cubin.startswith(b"\x7fELF") for _, cubin in compiled)
            side_by_side.extend(variant for variant, _ in compiled)
            return [100.0 - i + slow_down["by"] for i in range(len(compiled))]  # the slowest finalist wins

    with cf.ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn")) as pool:
        runner = GpuRunner(workers=2, worker=FakeWorker(), pool=pool, device=device)
        _check_tune_loop(tune_module, runner, device, evaluated, slow_down, side_by_side, tmp_path)


def _check_tune_loop(tune_module, runner, device, evaluated, slow_down, side_by_side, tmp_path):
    from autosoft.cache import Cache
    from autosoft.evaluate import Status

    from autosoft.kernel_store import KernelStore

    family = get_family("softmax")
    problem = family.problem("64x4096", "float16")
    cache = Cache(tmp_path / "k.sqlite")
    report = tune_module.tune("softmax", problem, 14, cache, seed=1, runner=runner)
    store = KernelStore()  # $AUTOSOFT_KERNEL_STORE, set by the test
    assert store.get(report.best.variant.digest), "the winner's cubin is kept for the first call after the tune"
    import optuna

    from autosoft.tune import study_storage

    (summary,) = optuna.get_all_study_summaries(study_storage(cache))
    study = optuna.load_study(study_name=summary.study_name, storage=study_storage(cache))
    attrs = [t.user_attrs for t in study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))]
    assert attrs and all(a["compile_s"] > 0 and a["evaluate_s"] >= 0 and a["status"] == "ok" for a in attrs), \
        "each measured trial keeps the seconds spent compiling and evaluating it (autosoft report draws them)"

    assert len(report.trials) == 14 and len(evaluated) == 14
    default = family.default_params(problem, device.target)
    assert evaluated[0] == default, "the heuristic default is measured first"
    assert dict(report.default.variant.params) == default
    keys = [tuple(sorted(p.items())) for p in evaluated]
    assert len(set(keys)) == 14, "no variant is measured twice"
    ok = sorted((m for m in report.trials if m.outcome.ok), key=lambda m: m.outcome.time_us)
    assert ok and report.best is not None
    fastest = [m.variant.name for m in ok[:tune_module.FINALISTS]]
    if report.default.variant.name not in fastest:  # the default joins the round, last
        fastest.append(report.default.variant.name)
    assert [v.name for v in side_by_side] == fastest, "the fastest few are re-timed, fastest first, then the default"
    assert report.best.variant.name == fastest[-1], "the re-timing decides"
    assert report.best.outcome.time_us == 100.0 - (len(fastest) - 1)
    assert report.best.outcome.status is Status.OK
    assert report.stored and report.copy_time_us == 5.0

    (entry,) = cache.entries()
    assert dict(entry.params) == dict(report.best.variant.params)
    assert entry.time_us == report.best.outcome.time_us
    assert entry.key.gpu_name == "NVIDIA H200" and entry.key.compute_capability == "90"
    assert entry.key.shape == "64x4096" and entry.key.dtype == "float16"
    assert entry.source_digest == report.best.variant.digest
    trials = list(cache.trials())
    assert len(trials) == 14
    statuses = {t["status"] for t in trials}
    assert "ok" in statuses and statuses <= {"ok", "wrong", "launch_fail", "compile_fail"}
    assert all(t["time_us"] is None for t in trials if t["status"] != "ok")

    # a second, slower run keeps the stored entry
    slow_down["by"] = 1000.0
    again = tune_module.tune("softmax", problem, 3, cache, seed=2, runner=runner)
    assert not again.stored
    (kept,) = cache.entries()
    assert kept.time_us == entry.time_us and dict(kept.params) == dict(entry.params)
    assert len(list(cache.trials())) == 17
