"""selector.py and generalize.py without a GPU: the tree fit, the greedy choice of configurations,
the features, and a selector fitted from a cache with a stand-in for the GPU's timing."""
from __future__ import annotations

import hashlib
import json
import math
import random

import pytest

from autosoft.cache import Cache
from autosoft.errors import UserError
from autosoft.evaluate import Outcome, Status
from autosoft.families import get_family
from autosoft.families.base import Family, Target
from autosoft.generalize import fit_selector
from autosoft.runners import Runner
from autosoft.runtime import DeviceInfo
from autosoft.selector import Leaf, Sample, Split, choose_configs, depth, fit_tree, params_key, predict, tree_text

from helpers import make_entry, softmax_key

SOFTMAX = get_family("softmax")
H200 = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")


def _sample(rows: int, columns: int, times: tuple) -> Sample:
    return Sample(f"{rows}x{columns}", {"rows": float(rows), "columns": float(columns)}, times)


# --- the tree ------------------------------------------------------------------------------------

def test_the_tree_splits_on_the_feature_that_separates_the_winners():
    # config 0 wins on rows of up to 1024 elements, config 1 on rows of 4096 and more; row counts vary alike
    samples = [_sample(m, n, (1.0, 3.0) if n <= 1024 else (3.0, 1.0))
               for m in (64, 4096, 65536) for n in (256, 1024, 4096, 16384)]
    tree = fit_tree(samples, ("rows", "columns"), 2)
    assert tree == Split("columns", 2048.0, Leaf((0, 1)), Leaf((1, 0)))  # the geometric mean of 1024 and 4096
    assert depth(tree) == 1
    assert "if columns <= 2048:" in tree_text(tree)
    shuffled = samples[:]
    random.Random(3).shuffle(shuffled)
    assert fit_tree(shuffled, ("rows", "columns"), 2) == tree, "the order of the samples changes nothing"


def test_the_tree_predicts_each_training_shapes_winner():
    # three configurations, the winner decided by both features: a tree of depth 2 separates them
    def times(m: int, n: int) -> tuple:
        winner = 0 if n <= 1024 else (1 if m <= 512 else 2)
        return tuple(1.0 if c == winner else 1.5 + c for c in range(3))

    samples = [_sample(m, n, times(m, n)) for m in (8, 128, 512, 2048, 16384) for n in (64, 1024, 8192, 131072)]
    tree = fit_tree(samples, ("rows", "columns"), 3)
    for s in samples:
        assert predict(tree, s.features)[0] == s.times.index(min(s.times)), s.label
    assert depth(tree) == 2
    assert fit_tree(samples, ("rows", "columns"), 3) == tree
    assert isinstance(fit_tree(samples, ("rows", "columns"), 3, max_depth=0), Leaf)


def test_a_split_that_lowers_nothing_is_not_made_and_one_configuration_is_a_leaf():
    same = [_sample(m, n, (2.0, 1.0)) for m in (1, 10, 100) for n in (5, 50)]
    assert fit_tree(same, ("rows", "columns"), 2) == Leaf((1, 0))


def test_a_configuration_that_cannot_serve_a_shape_is_not_ranked_first_where_another_can():
    # config 0 is the fastest where it runs, but invalid on half the shapes of its side of any split
    samples = [_sample(1, n, (1.0 if n % 2 else None, 1.05)) for n in (3, 4, 5, 6)]
    tree = fit_tree(samples, ("columns",), 2, max_depth=0)
    assert tree == Leaf((1, 0))


# --- the greedy choice of configurations ----------------------------------------------------------

def test_greedy_cover_takes_the_configuration_near_the_best_on_most_shapes_first():
    times = {
        "A": {"x": 1.02, "y": 1.0, "z": 2.0},
        "B": {"x": 1.0, "y": 1.3},
        "C": {"x": 1.04, "z": 1.0},
        "D": {"y": 1.0, "z": 1.01, "x": 1.5},
    }
    assert choose_configs(times, max_configs=10, within=0.05) == ["x", "y"]  # x covers A, B, C; then D
    assert choose_configs(times, max_configs=1, within=0.05) == ["x"]
    # tighter: x is within 1% only on B; y and z each cover two shapes, y's ratios are lower
    assert choose_configs(times, max_configs=10, within=0.01) == ["y", "z", "x"]
    assert choose_configs({}, 10) == []


# --- features -------------------------------------------------------------------------------------

def test_default_features_of_a_row_family_and_of_attention():
    f = SOFTMAX.selector_features(SOFTMAX.problem("4096x8192", "bfloat16"))
    assert f == {"rows": 4096.0, "columns": 8192.0, "bytes_per_row": 16384.0, "dtype_size": 2.0, "log": 0.0}
    attention = get_family("attention")
    rank4 = Family.selector_features(attention, attention.problem("2,16,1000,64", "float16", {"causal": True}))
    assert (rank4["outer"], rank4["n"], rank4["d"], rank4["causal"]) == (32.0, 1000.0, 64.0, 1.0)


def test_attention_declares_its_own_features():
    attention = get_family("attention")
    problem = attention.problem("2,16,1000,64", "float16", {"causal": True, "kv_heads": 4, "kv_len": 3000})
    assert attention.selector_features(problem) == {"bh": 32.0, "nq": 1000.0, "nkv": 3000.0, "d": 64.0,
                                                    "causal": 1.0, "window": 0.0, "softcap": 0.0, "gqa": 4.0}


# --- fitting from a cache, with a stand-in for the GPU's timing -------------------------------------

SHORT = SOFTMAX.default_params(SOFTMAX.problem("64x512", "float32"), H200.target)  # valid on short rows only
LONG = {**SHORT, "threads": 1024, "row_threads": 1024, "unroll": 2, "storage": "reread", "normalise": "online"}
MIDDLE = {**SHORT, "threads": 256, "row_threads": 256}


class TimedRunner(Runner):
    """Stands in for the GPU worker: every variant is correct and takes a time given by its row
    length and its row threads (many threads pay on long rows); records what it evaluated."""

    def __init__(self) -> None:
        self.evaluated: list[tuple[str, str]] = []

    @property
    def device(self) -> DeviceInfo:
        return H200

    @staticmethod
    def time(variant) -> float:
        n, threads = variant.problem.shape[1], variant.params["row_threads"]
        return n / min(threads, n) + (4.0 if threads > 4 * n else 0.0)

    def evaluate(self, family, variant, seed, timeout_s):
        self.evaluated.append((variant.problem.shape_text, params_key(variant.params)))
        return Outcome(Status.OK, self.time(variant))

    def time_side_by_side(self, family, variants, timeout_s):
        return [self.time(v) for v in variants]

    def time_copy(self, nbytes_each_way):
        return 1.0


def _tuned_cache(path, shapes, winners):
    cache = Cache(path)
    for shape, params in zip(shapes, winners):
        cache.put(make_entry(softmax_key(shape), time_us=1.0, params=params))
        cache.record_trials([{"family": "softmax", "dtype": "float32", "shape": shape, "gpu_name": H200.name,
                              "variant_name": "v", "params": p, "status": "ok", "time_us": t, "message": ""}
                             for p, t in ((params, 1.0), (MIDDLE, 1.2))])
    return cache


def test_fit_selector_chooses_times_and_fits_from_the_cache(tmp_path):
    shapes = ["256x512", "512x1024", "128x32768", "64x65536"]
    cache = _tuned_cache(tmp_path / "k.sqlite", shapes, [SHORT, SHORT, LONG, LONG])
    runner = TimedRunner()
    fitted = fit_selector(SOFTMAX, cache, runner, max_configs=10)
    selector = fitted.selector
    # MIDDLE was never within 5% of a best; SHORT and LONG cover two shapes each, the tie goes by their text
    assert [dict(c) for c in selector.configs] == sorted([SHORT, LONG], key=params_key)
    # each configuration timed on every shape it is valid for, nothing else
    assert sorted(runner.evaluated) == sorted([(s, params_key(SHORT)) for s in shapes[:2]]
                                              + [(s, params_key(LONG)) for s in shapes[2:]])
    assert sorted(selector.shapes) == sorted(f"float32 {s}" for s in shapes)
    assert (selector.gpu_name, selector.cuda_major) == ("NVIDIA H200", "13")
    assert fitted.training_ratios() == [1.0] * 4
    assert cache.selectors() == [selector]
    short = predict(selector.tree, SOFTMAX.selector_features(SOFTMAX.problem("300x700", "float32")))
    long = predict(selector.tree, SOFTMAX.selector_features(SOFTMAX.problem("100x50000", "float32")))
    assert (selector.configs[short[0]], selector.configs[long[0]]) == (SHORT, LONG)


def test_fit_selector_with_too_few_shapes_is_a_user_error_that_changes_nothing(tmp_path):
    cache = _tuned_cache(tmp_path / "k.sqlite", ["256x512", "128x32768"], [SHORT, LONG])
    before = hashlib.sha256(cache.path.read_bytes()).hexdigest()
    with pytest.raises(UserError, match="2 tuned softmax shapes .* at least 3"):
        fit_selector(SOFTMAX, cache, TimedRunner())
    assert hashlib.sha256(cache.path.read_bytes()).hexdigest() == before
    # shapes tuned on another GPU do not count
    Cache(cache.path).put(make_entry(softmax_key("64x65536", gpu_name="NVIDIA A100", compute_capability="80")))
    with pytest.raises(UserError, match="at least 3"):
        fit_selector(SOFTMAX, cache, TimedRunner())
    assert cache.selectors() == []


def test_the_tree_survives_json_and_refuses_a_tampered_one():
    from autosoft.selector import node_from_json, node_to_json

    tree = Split("columns", 2048.0, Leaf((0, 1)), Split("rows", 3.5, Leaf((1, 0)), Leaf((0, 1))))
    assert node_from_json(json.loads(json.dumps(node_to_json(tree))), 2) == tree
    for bad in ({"ranking": [2]}, {"ranking": []}, {"feature": "rows", "threshold": math.inf},
                {"feature": 3, "threshold": 1.0}, [1, 2]):
        with pytest.raises(ValueError):
            node_from_json(bad, 2)


def test_the_report_has_a_line_per_selector_of_the_families_asked_for(tmp_path):
    from autosoft.report import selector_lines
    from helpers import make_selector

    cache = Cache(tmp_path / "k.sqlite")
    assert selector_lines(cache.path) == [] and selector_lines(tmp_path / "missing.sqlite") == []
    cache.put_selector(make_selector([SHORT, LONG], tree=Split("columns", 2048.0, Leaf((0, 1)), Leaf((1, 0)))))
    line = "selector softmax on NVIDIA H200 (sm_90, NVRTC 13.x): 2 configurations, 3 shapes fitted, tree depth 1"
    assert selector_lines(cache.path) == [line]
    assert selector_lines(cache.path, ["attention"]) == []


def test_the_held_out_shapes_are_enough_valid_and_none_is_tuned_by_the_benchmarks():
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    try:
        import attention as attention_bench
        import softmax as softmax_bench
    finally:
        sys.path.remove(str(bench))
    data = json.loads((bench / "heldout_shapes.json").read_text())
    tuned_rows = {(m, n) for m, n in softmax_bench.SWEEP}
    for name, least in (("softmax", 30), ("softmax_backward", 30), ("attention", 20)):
        family = get_family(name)
        problems = [family.problem(r["shape"], r["dtype"], r["options"]) for r in data[name]]
        assert len(set(problems)) == len(problems) >= least, name
        if name == "attention":
            assert not {p.shape for p in problems} & set(attention_bench.SHAPES)
        else:
            assert not {p.shape for p in problems} & tuned_rows
            assert min(p.shape[0] for p in problems) <= 4 and max(p.shape[0] for p in problems) >= 100000
