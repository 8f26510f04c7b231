"""GPU tier: softmax_backward variants and the tuner on a real device. Every variant is verified
as the tuner verifies it (autosoft.evaluate.verify: each input kind, outputs poisoned with NaN
first), and the special cases run again on the test's own inputs."""
from __future__ import annotations

import itertools

import pytest

from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.dtypes import poisoned, to_storage
from autosoft.evaluate import Status, evaluate, verify
from autosoft.families import get_family
from autosoft.families.base import Problem, build_variant
from autosoft.testing.conformance import sample_points
from helpers import loaded_variant, loaded_variants

pytestmark = pytest.mark.gpu

FAMILY = get_family("softmax_backward")


def _device():
    from autosoft.runtime import device_info

    return device_info()


def _loaded(problem: Problem, params: dict):
    """The variant at params, compiled for this device and loaded."""
    return loaded_variant(FAMILY, problem, params)


def _verify_all(problem: Problem, points: list[dict], seed: int) -> list[str]:
    """The points compiled together, then verified one by one: the names of the variants
    checked; fails listing every wrong one."""
    failures, names = [], []
    target = _device().target
    for loaded in loaded_variants([build_variant(FAMILY, problem, params, target) for params in points]):
        wrong = verify(FAMILY, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name}: {wrong}")
        names.append(loaded.variant.name)
    assert not failures, "\n".join(failures)
    return names


@pytest.mark.parametrize("example", FAMILY.examples, ids=lambda e: f"{e[0]}-{e[1]}{'-log' if e[2] else ''}")
def test_every_example_default_is_correct(example):
    shape, dtype, options = example
    problem = FAMILY.problem(shape, dtype, options)
    target = _device().target
    _verify_all(problem, [FAMILY.default_params(problem, target)], seed=1)


# A few problems with ~40 variants each: the default, its seeds, then random valid points; among
# them rows split over a cluster (sm_90) or a cooperative grid, and log-softmax's backward.
# Odd row lengths start most rows off a vector boundary: a scalar head and tail in every row (or
# segment of a split row), taken by the first threads of a group, sub-warp groups included.
SAMPLED = [("300x4000", "float32", {}), ("300x4000", "bfloat16", {"log": True}), ("1000x77", "float16", {}),
           ("33x50257", "float16", {"log": True}), ("8x131072", "float32", {"log": True}),
           ("2x1048573", "float16", {}), ("65536x64", "bfloat16", {})]


@pytest.mark.parametrize("shape,dtype,options", SAMPLED, ids=str)
def test_sampled_variants_are_correct(shape, dtype, options):
    problem = FAMILY.problem(shape, dtype, options)
    target = _device().target
    points = sample_points(FAMILY, problem, target, 40, seed=len(shape) * 31 + len(dtype), seeds=12)
    names = _verify_all(problem, points[:44], seed=3)
    assert len(names) >= 40, names
    if problem.shape[0] * 4 < target.sm_count:  # few wide rows: splits were among them
        assert any("_grid" in n or "_cluster" in n for n in names), names


SPLITS = [{"combine": combine, "split": split, "threads": threads, "row_threads": threads}
          for combine in ("cluster", "grid") for split in (2, 4, 8, 16) for threads in (256, 512, 1024)]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_split_rows_combine_their_sums(dtype, log):
    """Blocks of a cluster (up to 16, past the portable 8) or of a cooperative grid exchange one
    partial sum each; rows whose values are -inf in all but the last block or the first one. The
    row length is odd: segments start off vector boundaries, with a scalar head and tail each."""
    import cupy as cp

    problem = FAMILY.problem("12x65531", dtype, {"log": log})
    n = problem.shape[1]
    target = _device().target
    inputs = FAMILY.make_inputs(problem, "normal", cp, cp.random.default_rng(5))
    # rows made by hand: one finite entry in the first block, and the mass in the last block
    x = cp.full((2, n), -cp.inf, dtype=cp.float64)
    x[0, 3] = 0.0
    x[1, n - 100:] = cp.linspace(-3, 3, 100)
    shifted = x - x.max(axis=1, keepdims=True)
    if log:
        special = shifted - cp.log(cp.exp(shifted).sum(axis=1, keepdims=True))
    else:
        special = cp.exp(shifted) / cp.exp(shifted).sum(axis=1, keepdims=True)
    y = cp.asarray(inputs["y"]).copy()
    y[:2] = cp.asarray(_store(special, dtype))
    inputs = {"y": y, "dy": inputs["dy"]}
    checked = []
    # each segment held in registers, or staged in shared memory
    points = [{**FAMILY.default_params(problem, target), "storage": storage, "chunks": chunks, "unroll": 1,
               "persistent": False, **combo}
              for combo, (storage, chunks) in itertools.product(SPLITS, (("registers", 1), ("smem", 2)))]
    points = [params for params in points if FAMILY.is_valid(problem, target, params)]
    for loaded in loaded_variants([build_variant(FAMILY, problem, params, target) for params in points]):
        assert verify(FAMILY, loaded, seed=13) is None, loaded.variant.name
        dx = poisoned(problem.shape, dtype, cp)
        loaded.launch({**inputs, "dx": dx})
        assert FAMILY.check(problem, inputs, {"dx": dx}, cp) is None, loaded.variant.name
        checked.append(loaded.variant.name)
    assert any("_grid" in n for n in checked), checked
    assert any("_smem_" in n and "_grid" in n for n in checked), checked
    if int(target.arch) >= 90:
        assert any(n.endswith("_cluster16") or "_cluster16_" in n for n in checked), checked
        assert any("_smem_" in n and "_cluster" in n for n in checked), checked


STAGED = [{"threads": t, "row_threads": g, "chunks": c, "persistent": p, "streaming": cs}
          for t, g in ((128, 32), (256, 256), (512, 128), (1024, 1024)) for c in (1, 2, 4)
          for p, cs in ((False, False), (True, True))]


@pytest.mark.parametrize("shape,dtype,options", [("300x4000", "float16", {}), ("33x20011", "float32", {"log": True}),
                                                 ("1000x77", "bfloat16", {"log": True})], ids=str)
def test_rows_staged_in_shared_memory_are_correct(shape, dtype, options):
    """Rows copied into shared memory by cp.async in chunks, several row groups per block (each
    with its own slots), persistent blocks reusing their slots row after row; odd row lengths."""
    problem = FAMILY.problem(shape, dtype, options)
    target = _device().target
    base = {**FAMILY.default_params(problem, target), "storage": "smem", "unroll": 1, "split": 1, "combine": "none"}
    points = [p for p in ({**base, "vec": v, **combo} for combo in STAGED for v in (4 // _itemsize(dtype), 16 // _itemsize(dtype)))
              if FAMILY.is_valid(problem, target, p)]
    names = _verify_all(problem, points, seed=7)
    assert len(names) >= 6 and all("_smem" in n for n in names), names
    assert any("_persistent" in n for n in names) and any("_c2" in n for n in names), names


def _itemsize(dtype):
    return {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]


def _store(values64, dtype):
    from autosoft.families.softmax_backward import _store as store

    return store(values64, dtype)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
def test_rows_with_minus_inf_and_a_three_row_odd_problem(log):
    """-inf in x: y = 0 there (log: y = -inf, and dx = dy exactly); an odd N over 3 rows (rows
    starting off vector boundaries: scalar heads and tails)."""
    import cupy as cp

    target = _device().target
    for shape, dtype in (("3x1001", "float16"), ("3x1001", "float32"), ("64x4096", "bfloat16")):
        problem = FAMILY.problem(shape, dtype, {"log": log})
        m, n = problem.shape
        x = cp.random.default_rng(9).standard_normal((m, n)).astype(cp.float64)
        x[:, ::3] = -cp.inf
        x[0, :] = -cp.inf
        x[0, 1] = 0.5  # one finite entry
        shifted = x - x.max(axis=1, keepdims=True)
        y64 = shifted - cp.log(cp.exp(shifted).sum(axis=1, keepdims=True)) if log else \
            cp.exp(shifted) / cp.exp(shifted).sum(axis=1, keepdims=True)
        inputs = {"y": _store(y64, dtype),
                  "dy": to_storage(cp.random.default_rng(10).standard_normal((m, n), dtype=cp.float32), dtype, cp)}
        points = sample_points(FAMILY, problem, target, 8, seed=m + n, seeds=4)
        for loaded in loaded_variants([build_variant(FAMILY, problem, params, target) for params in points]):
            dx = poisoned(problem.shape, dtype, cp)
            loaded.launch({**inputs, "dx": dx})
            assert FAMILY.check(problem, inputs, {"dx": dx}, cp) is None, loaded.variant.name
            if log:  # where y = -inf, e^y = 0: dx is dy bit for bit
                where = cp.isneginf(x)
                assert bool(cp.all(dx.view(inputs["dy"].dtype)[where] == inputs["dy"][where])), loaded.variant.name


def test_a_cooperative_split_waits_for_its_row_launch_after_launch():
    """A row's arrival counter grows by SPLIT per launch and is never reset: every launch on
    the same workspace must still wait for all of its row's blocks."""
    import cupy as cp

    problem = FAMILY.problem("4x262144", "float32")
    target = _device().target
    params = {**FAMILY.default_params(problem, target), "storage": "registers", "unroll": 1, "persistent": False,
              "combine": "grid", "split": 32, "threads": 1024, "row_threads": 1024, "vec": 4}
    assert FAMILY.is_valid(problem, target, params), "128 blocks of 1024 threads fit an H100 or H200 at once"
    loaded = _loaded(problem, params)
    (launch,) = loaded.variant.launches
    assert launch.cooperative and launch.grid[0] == 4 * 32
    rng = cp.random.default_rng(21)
    stream = cp.cuda.get_current_stream()
    for i in range(5):
        inputs = FAMILY.make_inputs(problem, "normal", cp, rng)
        inputs["dy"] *= 1 + 10 * i
        dx = poisoned(problem.shape, "float32", cp)
        loaded.launch({**inputs, "dx": dx})
        assert FAMILY.check(problem, inputs, {"dx": dx}, cp) is None, i
    stream.synchronize()
    workspace, _ = loaded._workspaces[stream.ptr]
    arrivals = cp.asnumpy(workspace[4 * 32 * 4:].view(cp.uint32))  # after 4 x 32 float partial sums
    assert arrivals.tolist() == [5 * 32] * 4


@pytest.mark.timing
def test_short_tune_is_correct_and_not_slower_than_default(cache_dir):
    from autosoft.tune import tune

    problem = FAMILY.problem("2048x4096", "float16", {"log": True})
    cache = Cache(cache_dir / "k.sqlite")
    report = tune("softmax_backward", problem, 30, cache, seed=3)
    assert report.best is not None and report.best.outcome.status is Status.OK
    assert report.default.outcome.ok
    assert report.best.outcome.time_us <= report.default.outcome.time_us
    assert len(report.trials) == 30
    (entry,) = cache.entries()
    assert entry.variant_name == report.best.variant.name and "log" in entry.variant_name.split("_")
    variant = build_variant(FAMILY, problem, entry.params, _device().target)
    outcome = evaluate(FAMILY, variant, compile_source(variant.source, variant.target.arch).cubin, seed=99)
    assert outcome.ok, outcome.message


@pytest.mark.timing
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log"])
def test_a_tuned_variant_moves_the_bytes_near_copy_speed(log, cache_dir):
    """The family's target: reading y and dy and writing dx once each, at >= 90% of a device copy
    of the same bytes when tuned. A short tune must reach 85% on a large problem (margin for a
    40-trial search and timing noise); the message gives the rate reached."""
    from autosoft.tune import tune

    problem = FAMILY.problem("8192x8192", "bfloat16", {"log": log})
    report = tune("softmax_backward", problem, 40, Cache(cache_dir / "k.sqlite"), seed=5)
    assert report.best is not None and report.best.outcome.ok
    rate = report.copy_time_us / report.best.outcome.time_us
    assert rate >= 0.85, f"{report.best.variant.name}: {100 * rate:.1f}% of copy speed " \
                         f"({report.best.outcome.time_us:.1f} us, copy {report.copy_time_us:.1f} us)"
