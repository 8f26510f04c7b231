"""GPU tier: softmax variants, the tuner and the Python API on a real device."""
from __future__ import annotations

import pytest

from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.evaluate import Status, evaluate, poisoned, verify
from autosoft.families import get_family
from autosoft.families.base import ITEMSIZE, Problem, build_variant
from autosoft.dtypes import to_storage
from helpers import compile_ahead, loaded_variants, sample_points

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1), (5, 3), (1, 1000), (7, 1025), (33, 50257), (1, 8192), (4096, 128), (300, 4000),
          (16, 131072), (2, 1048576), (65536, 64), (1000, 77)]


def _device():
    from autosoft.runtime import device_info

    return device_info()


def _sample(problem: Problem, k: int, seed: int) -> list[dict]:
    return sample_points(get_family("softmax"), problem, _device().target, k, seed)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sampled_variants_are_correct(dtype):
    """On every shape of SHAPES: the default, its seeds and six random points; all the shapes'
    variants compile together."""
    family = get_family("softmax")
    variants = []
    for shape in SHAPES:
        problem = Problem("softmax", dtype, shape)
        variants += [build_variant(family, problem, params, _device().target)
                     for params in _sample(problem, 6, seed=shape[0] * 7919 + shape[1] + len(dtype))]
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(family, loaded, seed=7)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text}: {wrong}")
    assert not failures, "\n".join(failures)


def _loaded(problem: Problem, params: dict):
    """The variant at params, compiled for this device (once a run: see _compile_together) and loaded."""
    (loaded,) = loaded_variants([build_variant(get_family("softmax"), problem, params, _device().target)])
    return loaded


def _compile_together(problem: Problem, points: list[dict]) -> None:
    """Start compiling the points' variants together, ahead of the test's _loaded calls."""
    compile_ahead([build_variant(get_family("softmax"), problem, params, _device().target) for params in points])


def _assert_correct(problem: Problem, params: dict, xs, seed: int):
    """Compile a variant, verify it as the tuner does, then run it on the test's own input xs
    into a poisoned output and check every element; returns the variant."""
    import cupy as cp

    family = get_family("softmax")
    loaded = _loaded(problem, params)
    variant = loaded.variant
    assert verify(family, loaded, seed=seed) is None, variant.name
    y = poisoned(problem.shape, problem.dtype, cp)  # NaN in every dtype (bfloat16 as its bits)
    loaded.launch({"x": xs, "y": y})
    assert family.check(problem, {"x": xs}, {"y": y}, cp) is None, variant.name
    return variant


ROWS_IN_SMEM = [{"normalise": norm, "keep_exp": keep, "chunks": chunks, **layout}
                for norm in ("online", "three_pass") for keep in (False, True) for chunks in (1, 2, 4)
                for layout in (
                    {"threads": 512, "row_threads": 128},
                    {"threads": 512, "row_threads": 128, "persistent": True, "prefetch": True})]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_staged_in_shared_memory_are_correct(dtype):
    """Every way of working on a row in shared memory: by chunks as they land (the max growing
    from chunk to chunk, or whole chunks of -inf first), and with the next row staged ahead by a
    persistent block; on rows of odd length (odd start addresses, a scalar head and tail)."""
    import cupy as cp

    family = get_family("softmax")
    problem = Problem("softmax", dtype, (3000, 4001))
    x = cp.random.default_rng(3).standard_normal(problem.shape, dtype=cp.float32)
    x[::4, :2500] = -cp.inf                                  # the first chunks of a row are all -inf
    x[1::4] = cp.linspace(-30, 30, problem.shape[1], dtype=cp.float32)  # the max grows every chunk
    x[2::4, 3000:] = -cp.inf                                 # the last chunk is all -inf
    xs = to_storage(x, dtype, cp)
    target = _device().target
    checked = []
    points = [{**family.default_params(problem, target), "storage": "smem", "unroll": 1, "split": 1,
               "combine": "launches", "persistent": False, **combo} for combo in ROWS_IN_SMEM]
    points = [params for params in points if family.is_valid(problem, target, params)]
    _compile_together(problem, points)
    for params in points:
        variant = _assert_correct(problem, params, xs, seed=11)
        if params["prefetch"]:  # every block must have a next row to stage
            assert variant.launches[0].grid[0] * 4 < problem.shape[0], variant.name
        checked.append(variant.name)
    assert len(checked) >= 18 and any("_c4_prefetch_keep" in name for name in checked), checked


ROWS_SPLIT_IN_ONE_LAUNCH = [{"combine": combine, "split": split, "threads": threads, "row_threads": threads,
                             "keep_exp": keep}
                            for combine in ("cluster", "grid") for split in (2, 4, 8, 16)
                            for threads in (256, 512) for keep in (False, True)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(12, 50001), (8, 131072)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_rows_split_in_one_launch_are_correct(shape, dtype):
    """Blocks of a cluster (up to 16, past the portable 8) or of a cooperative grid exchange one
    (max, sum) pair each: blocks and threads whose values are all -inf, the max in the last
    block or the first, and rows of odd length (a scalar head and tail in the segments)."""
    import cupy as cp

    family = get_family("softmax")
    problem = Problem("softmax", dtype, shape)
    m, n = shape
    x = cp.random.default_rng(5).standard_normal(shape, dtype=cp.float32)
    x[0::4, : n - 100] = -cp.inf                      # every block but the last sees only -inf
    x[1::4] = cp.linspace(-40, 40, n, dtype=cp.float32)  # the max is in the last block
    x[2::4, 1:] = -cp.inf                             # one finite value, in the first block
    x[3::4, n // 2] = 60.0                            # one value far above the rest
    xs = to_storage(x, dtype, cp)
    target = _device().target
    checked = []
    points = [{**family.default_params(problem, target), "storage": "registers", "normalise": "three_pass",
               "unroll": 1, "persistent": False, **combo} for combo in ROWS_SPLIT_IN_ONE_LAUNCH]
    points = [params for params in points if family.is_valid(problem, target, params)]
    _compile_together(problem, points)
    for params in points:
        checked.append(_assert_correct(problem, params, xs, seed=13).name)
    for ending in ("_cluster8_keep", "_cluster16", "_grid8_keep", "_grid16"):  # 12 x 16 blocks: two per SM
        assert any(name.endswith(ending) for name in checked), (ending, checked)


def test_a_cooperative_split_waits_for_its_row_launch_after_launch():
    """A row's arrival counter grows by SPLIT per launch and is never reset: every launch on
    the same workspace must still wait for all of its row's blocks, and only for them."""
    import cupy as cp
    import numpy as np

    family = get_family("softmax")
    problem = Problem("softmax", "float32", (8, 131072))
    target = _device().target
    params = {**family.default_params(problem, target), "storage": "registers", "normalise": "three_pass",
              "unroll": 1, "persistent": False, "combine": "grid", "split": 16, "threads": 512, "row_threads": 512,
              "vec": 4}
    loaded = _loaded(problem, params)
    (launch,) = loaded.variant.launches
    assert launch.cooperative and launch.grid[0] == 8 * 16
    rng = cp.random.default_rng(21)
    stream = cp.cuda.get_current_stream()
    for i in range(5):
        x = rng.standard_normal(problem.shape, dtype=cp.float32) * (1 + 10 * i)
        x[i % 8, 1000 * i] = 200.0  # one row's max moves from launch to launch
        y = cp.full(problem.shape, np.nan, dtype=cp.float32)
        loaded.launch({"x": x, "y": y})
        assert family.check(problem, {"x": x}, {"y": y}, cp) is None, i
    stream.synchronize()
    workspace, _ = loaded._workspaces[stream.ptr]
    arrivals = cp.asnumpy(workspace[8 * 16 * 8:].view(cp.uint32))
    assert arrivals.tolist() == [5 * 16] * 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staggered_first_waves_are_correct(dtype):
    """Blocks that wait before they start still write every row: one big row per block, staged
    in shared memory or held in registers, plain or persistent, over more than two waves."""
    import cupy as cp

    family = get_family("softmax")
    problem = Problem("softmax", dtype, (300, 32768))
    xs = to_storage(cp.random.default_rng(9).standard_normal(problem.shape, dtype=cp.float32), dtype, cp)
    target = _device().target
    points = [{**family.default_params(problem, target), "threads": 1024, "row_threads": 1024,
               "vec": 16 // ITEMSIZE[dtype], "unroll": 1, "split": 1, "combine": "launches",
               "persistent": persistent, "stagger": 4000, **layout}
              for layout in ({"storage": "smem", "normalise": "online", "chunks": 4},
                             {"storage": "registers", "normalise": "three_pass"})
              for persistent in (False, True)]
    _compile_together(problem, points)
    checked = [_assert_correct(problem, params, xs, seed=17).name for params in points]
    assert len(checked) == 4 and all("_stagger4000" in name for name in checked), checked


def test_a_slot_of_exactly_48_kib_launches():
    """48 KiB of dynamic shared memory plus the kernel's static scratch is past the default
    limit: the launch needs the opt-in as much as a larger slot does."""
    family = get_family("softmax")
    problem = Problem("softmax", "float32", (64, 12288))
    target = _device().target
    params = {**family.default_params(problem, target), "storage": "smem", "threads": 256, "row_threads": 256,
              "vec": 4, "unroll": 1, "split": 1, "normalise": "three_pass", "chunks": 1, "keep_exp": False}
    loaded = _loaded(problem, params)
    assert loaded.variant.launches[0].shared_mem == 48 * 1024
    assert verify(family, loaded, seed=5) is None


@pytest.mark.parametrize("split", [1, 4])
def test_the_hot_path_launcher_writes_the_same_output_as_launch(split):
    """LoadedVariant.launcher: the API's direct cuLaunchKernel path for one kernel, and the
    fallback through launch_raw for a row split over two launches with a workspace."""
    import cupy as cp
    import numpy as np

    family = get_family("softmax")
    problem = Problem("softmax", "float32", (8, 65536))
    target = _device().target
    params = {**family.default_params(problem, target), "threads": 256, "row_threads": 256, "vec": 4,
              "storage": "reread", "normalise": "online", "unroll": 2, "split": split, "combine": "launches",
              "persistent": False}
    loaded = _loaded(problem, params)
    assert len(loaded.variant.launches) == (1 if split == 1 else 2)
    launch = loaded.launcher(("x", "y"))
    rng = cp.random.default_rng(4)
    for _ in range(2):  # the slots take new pointers on every call
        x = rng.standard_normal(problem.shape, dtype=cp.float32)
        y = cp.full(problem.shape, np.nan, dtype=cp.float32)
        launch(x.data.ptr, y.data.ptr, cp.cuda.get_current_stream().ptr)
        assert family.check(problem, {"x": x}, {"y": y}, cp) is None


def test_misaligned_rows_and_base_pointer():
    """Rows of odd length start at odd addresses; the base pointer itself may be off 16 bytes."""
    import cupy as cp

    import autosoft

    x = cp.random.standard_normal((37, 1031 * 3 + 1), dtype=cp.float32).astype(cp.float16)
    view = x.ravel()[1:1 + 37 * 1031].reshape(37, 1031)  # base 2 bytes past an aligned address
    assert view.data.ptr % 16 != 0
    y = autosoft.softmax(view)
    ref = cp.exp(view.astype(cp.float64) - view.astype(cp.float64).max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    assert float(cp.abs(y.astype(cp.float64) - ref).max()) < 2e-3


@pytest.mark.timing
def test_short_tune_is_correct_and_not_slower_than_default(cache_dir):
    from autosoft.tune import tune

    family = get_family("softmax")
    problem = family.problem("2048x4096", "float16")
    cache = Cache(cache_dir / "k.sqlite")
    report = tune("softmax", problem, 30, cache, seed=3)
    assert report.best is not None and report.best.outcome.status is Status.OK
    assert report.default.outcome.ok
    assert report.best.outcome.time_us <= report.default.outcome.time_us
    assert len(report.trials) == 30
    (entry,) = cache.entries()
    assert entry.variant_name == report.best.variant.name
    # the stored variant re-verifies on fresh inputs
    variant = build_variant(family, problem, entry.params, _device().target)
    outcome = evaluate(family, variant, compile_source(variant.source, variant.target.arch).cubin, seed=99)
    assert outcome.ok, outcome.message


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(4, 1), (3, 5, 1000), (128, 1025), (2, 50257)])
def test_api_matches_torch(shape, dtype, cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    autosoft.api.DISPATCHER.forget()
    tdtype = getattr(torch, dtype)
    x = (torch.randn(shape, device="cuda") * 4).to(tdtype)
    y = autosoft.softmax(x)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
    ref = torch.softmax(x.float(), dim=-1)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)


def test_api_special_values_follow_torch(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(6, 300, device="cuda")
    x[0] = float("-inf")           # all -inf: torch gives NaN
    x[1, 5] = float("inf")         # +inf: NaN row
    x[2, 7] = float("nan")         # NaN: NaN row
    x[3, ::2] = float("-inf")      # some -inf: zeros there
    x[4] = 1e30                    # huge equal values: uniform
    y = autosoft.softmax(x)
    ref = torch.softmax(x, dim=-1)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    finite = ~torch.isnan(ref)
    torch.testing.assert_close(y[finite], ref[finite], atol=1e-6, rtol=1e-5)
