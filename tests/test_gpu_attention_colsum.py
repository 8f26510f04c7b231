"""GPU tier for the attention_colsum family: both passes against the float64 reference (o, lse,
colsum, and column sums that add to the number of queries), the public function, a short tune."""
from __future__ import annotations

import numpy as np
import pytest

from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.evaluate import Status, allocate_outputs, evaluate, verify
from autosoft.families import get_family
from autosoft.families.base import build_variant, space_of
from helpers import loaded_variants, pairwise_cover, sample_points

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention_colsum")

def _mma_default(problem, target):
    """The mma engine's own default, as a point of the family."""
    return {"engine": "mma", **FAMILY.engine("mma").default_params(problem, target)}


# (B, H, N, D, split): the first and last possible split, N not a multiple of any tile, splits
# inside a tile and on a tile edge, head dims 64 and 128
CASES = [(1, 2, 2, 64, 1), (1, 3, 77, 64, 76), (2, 2, 1000, 128, 1), (2, 2, 1000, 128, 999),
         (1, 4, 1000, 64, 500), (1, 2, 555, 128, 128), (1, 2, 3333, 64, 3269)]


def _target():
    from autosoft.runtime import device_info

    return device_info().target


def _wrong(variants, seed: int) -> list[str]:
    """Compile the variants together, then verify each; the failures, described."""
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(FAMILY, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text}: {wrong}")
    return failures


def _problem(b, h, n, d, split, dtype, causal, deterministic=False):
    return FAMILY.problem(f"{b},{h},{n},{d}", dtype, {"split": split, "causal": causal, "deterministic": deterministic})


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_both_passes_are_correct(dtype, causal):
    """On every case of CASES: the default and seeds, random points and the mma kernel's default
    with each pass, on normal, x10 and equal inputs (on sm_90 the default and first seeds are
    wgmma pairs, which take the key-major pass only); all the cases' variants compile together."""
    variants = []
    for case in CASES:
        problem = _problem(*case, dtype, causal)
        points = sample_points(FAMILY, problem, _target(), 3, seed=sum(case) + causal, seeds=12)
        mma = _mma_default(problem, _target())
        points += [q for q in ({**mma, "colsum": "fused", "km_split": 1}, {**mma, "colsum": "key_major"})
                   if q not in points and FAMILY.is_valid(problem, _target(), q)]
        ways = {p["colsum"] for p in points}
        assert ways == {"fused", "key_major"}, (case, ways)
        variants += [build_variant(FAMILY, problem, p, _target()) for p in points]
    failures = _wrong(variants, seed=13)
    assert not failures, "\n".join(failures)


def test_a_pairwise_covering_of_the_passes_on_a_tail_problem_is_correct():
    """N and split inside tiles, causal: the default and a pairwise covering of the valid points
    with the mma attention kernel (the wgmma one has its own test below): every pair of values of
    two parameters that some such point holds is held by a chosen point, so each pass meets each
    attention tiling and warp count, and each key-major tiling, pipeline, layout, fragment source
    and split of the query tiles meets each other; chosen greedily and deterministically."""
    problem = _problem(1, 2, 555, 64, 300, "bfloat16", True)
    target = _target()
    mma = [p for p in space_of(FAMILY).valid_points(FAMILY.problem_values(problem, target)) if p["engine"] == "mma"]
    points = pairwise_cover(mma)
    points += [p for p in [FAMILY.default_params(problem, target)] if p not in points]
    assert {p["km_split"] for p in points} == {1, 2, 4, 8} and {p["colsum"] for p in points} == {"fused", "key_major"}
    failures = _wrong([build_variant(FAMILY, problem, p, target) for p in points], seed=3)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case, causal", [((1, 3, 77, 64, 76), True), ((2, 2, 1000, 128, 999), False),
                                         ((1, 2, 3333, 64, 3269), True), ((2, 16, 1024, 128, 960), True)],
                         ids=lambda c: "x".join(map(str, c[:4])) + f"_split{c[4]}" if isinstance(c, tuple) else str(c))
def test_the_wgmma_attention_kernel_then_the_key_major_pass_is_correct(case, causal):
    """On Hopper: the attention family's wgmma kernel (first seeds: its schedules and tiles), then
    the key-major pass built on the mma kernel's helpers, with and without split query tiles."""
    if _target().arch != "90":
        pytest.skip("the wgmma kernel needs sm_90a")
    problem = _problem(*case, "bfloat16", causal)
    pairs = [p for p in FAMILY.seed_params(problem, _target()) if p["engine"] == "wgmma"]
    points = pairs[:3] + [{**pairs[0], "km_split": 2}, {**pairs[0], "km_rows": 32, "km_queries": 128}]
    points = [p for p in points if FAMILY.is_valid(problem, _target(), p)]
    assert len(points) >= 3
    failures = _wrong([build_variant(FAMILY, problem, p, _target()) for p in points], seed=17)
    assert not failures, "\n".join(failures)


def test_key_major_is_deterministic_and_fused_repeats_within_rounding():
    """The default key-major pass (its query tiles shared among blocks, the partials added by the
    last block; after the wgmma kernel on sm_90) gives the same bits three times; the mma kernel's
    fused pass agrees within rounding."""
    import cupy as cp

    from autosoft.runtime import LoadedVariant

    results = {}
    for way in ("key_major", "fused"):
        problem = _problem(1, 8, 2048, 128, 1024, "bfloat16", True)
        params = FAMILY.default_params(problem, _target())
        if way == "fused":  # the mma kernel's; the default shares query tiles among blocks: a key-major choice
            params = {**_mma_default(problem, _target()), "colsum": way, "km_split": 1}
        variant = build_variant(FAMILY, problem, params, _target())
        loaded = LoadedVariant(variant, compile_source(variant.source, variant.target.arch).cubin)
        inputs = FAMILY.make_inputs(problem, "normal", cp, cp.random.default_rng(4))
        runs = []
        for _ in range(3):
            outputs = allocate_outputs(FAMILY, variant, cp)
            loaded.launch({**inputs, **outputs})
            runs.append(cp.asnumpy(outputs["colsum"]))
        results[way] = runs
    assert FAMILY.default_params(_problem(1, 8, 2048, 128, 1024, "bfloat16", True), _target())["km_split"] > 1
    assert all(np.array_equal(results["key_major"][0], r) for r in results["key_major"][1:])
    for r in results["fused"]:
        np.testing.assert_allclose(r, results["key_major"][0], rtol=1e-5, atol=1e-7)


def test_large_default_fills_the_gpu_and_is_correct():
    """32 heads of 4096 queries, split = N / 2: the benchmark's problem kind; the default, and the
    mma kernel's tiles with either pass."""
    problem = _problem(1, 32, 4096, 128, 2048, "bfloat16", True)
    mma = _mma_default(problem, _target())
    for params in (FAMILY.default_params(problem, _target()), {**mma, "colsum": "fused"}, {**mma, "colsum": "key_major"}):
        variant = build_variant(FAMILY, problem, params, _target())
        outcome = evaluate(FAMILY, variant, compile_source(variant.source, variant.target.arch).cubin, seed=5, reps=5)
        assert outcome.ok, f"{variant.name}: {outcome.message}"


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_public_function_matches_torch(framework, cache_dir):
    torch = pytest.importorskip("torch")
    import cupy as cp

    import autosoft

    autosoft.api.DISPATCHER.forget()
    b, h, n, d, split = 2, 3, 333, 64, 200
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.float16) for _ in range(3))
    args = (q, k, v) if framework == "torch" else tuple(cp.from_dlpack(t) for t in (q, k, v))
    for causal in (False, True):
        o, colsum, lse = autosoft.attention_colsum(*args, split, causal=causal, return_lse=True)
        o, colsum, lse = (torch.from_dlpack(x) for x in (o, colsum, lse))
        assert o.shape == q.shape and colsum.shape == (b, h, split) and colsum.dtype == torch.float32
        scores = (q.double() @ k.double().transpose(-1, -2)) / 8.0
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        p = scores.softmax(-1)
        torch.testing.assert_close(colsum.double(), p[:, :, split:, :split].sum(2), rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), atol=1e-3, rtol=1e-4)
        ref_o = (p @ v.double()).float()
        assert ((o.float() - ref_o).norm() / ref_o.norm()).item() < 5e-3
    o2, colsum2 = autosoft.attention_colsum(*args, split, deterministic=True)
    first = torch.from_dlpack(colsum2).clone()
    _, again = autosoft.attention_colsum(*args, split, deterministic=True)
    assert torch.equal(first, torch.from_dlpack(again))
    with pytest.raises(ValueError, match="split"):
        autosoft.attention_colsum(*args, n)
    with pytest.raises(TypeError, match="split must be an int"):
        autosoft.attention_colsum(*args, 2.5)


def test_short_tune_is_correct_and_a_near_split_borrows_it(cache_dir):
    from autosoft.dispatch import Dispatcher
    from autosoft.tune import tune

    problem = _problem(1, 8, 1024, 64, 512, "bfloat16", True)
    cache = Cache(cache_dir / "k.sqlite")
    report = tune("attention_colsum", problem, 8, cache, seed=1)
    assert report.best is not None and report.best.outcome.status is Status.OK
    assert report.best.outcome.time_us <= report.default.outcome.time_us
    (entry,) = cache.entries()
    assert entry.key.shape == "1x8x1024x64+causal+split=512"
    dispatcher = Dispatcher()
    dispatcher.load_cache(cache.path)
    near = _problem(1, 8, 1024, 64, 500, "bfloat16", True)
    choice = dispatcher.choose(near)
    assert choice.source == "nearest 1x8x1024x64+causal+split=512" and choice.variant.params == entry.params
    assert dispatcher.choose(_problem(1, 8, 1024, 64, 500, "bfloat16", False)).source == "default"
    loaded = dispatcher.loaded(near, 0)  # verified on the near problem before its first use
    assert loaded.variant.problem == near
