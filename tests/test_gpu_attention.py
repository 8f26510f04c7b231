"""GPU tier for the attention family: sampled variants against the float64 reference, torch SDPA, a short tune."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest

from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.evaluate import Status, allocate_outputs, evaluate, verify
from autosoft.families import get_family
from autosoft.families.attention import TOLERANCE
from autosoft.families.base import build_variant, space_of
from helpers import compile_ahead, compiled, loaded_variants, pairwise_cover, sample_points

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention")

# (B, H, N, D): a single query, tails of every tile size, several tiles, every head dim (on
# sm_90 the wgmma kernel's 64-byte chunks at 32 and 96, 32-byte ones at 80, three 128-byte at 192)
SHAPES = [(1, 1, 1, 64), (2, 3, 17, 64), (1, 4, 1000, 128), (1, 2, 3333, 64), (2, 2, 1000, 32),
          (1, 2, 256, 128), (1, 1, 4097, 128), (1, 3, 999, 96), (1, 3, 999, 80), (1, 2, 1000, 192)]


def _target():
    from autosoft.runtime import device_info

    return device_info().target


def _sample(problem, k: int, seed: int) -> list[dict]:
    """The default, its first 12 seeds (on sm_90 the wgmma kernel's likeliest tiles and schedules)
    and k random points."""
    return sample_points(FAMILY, problem, _target(), k, seed, seeds=12)


def _wrong(variants, seed: int) -> list[str]:
    """Compile the variants together, then verify each; the failures, described."""
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(FAMILY, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text}: {wrong}")
    return failures


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sampled_variants_are_correct(dtype, causal):
    """On every shape of SHAPES: the default, its first seeds and three random points; all the
    shapes' variants compile together."""
    variants = []
    for shape in SHAPES:
        problem = FAMILY.problem(",".join(map(str, shape)), dtype, ("causal",) if causal else ())
        variants += [build_variant(FAMILY, problem, p, _target())
                     for p in _sample(problem, 3, seed=sum(shape) * 7 + len(dtype) + causal)]
    failures = _wrong(variants, seed=11)
    assert not failures, "\n".join(failures)


@lru_cache(maxsize=None)  # each test of a parametrised group asks for all the group's defaults
def _default(shape: tuple[int, ...], dtype: str, causal: bool):
    """The default variant of a (B, H, N, D) problem."""
    problem = FAMILY.problem(",".join(map(str, shape)), dtype, ("causal",) if causal else ())
    return build_variant(FAMILY, problem, FAMILY.default_params(problem, _target()), _target())


def _cubin_among(variant, shapes) -> bytes:
    """The variant's cubin, compiled (on a test's first call) together with the defaults of every
    shape, dtype and mask the test is parametrised with: one batch instead of one compile a test."""
    compile_ahead([_default(s, dtype, causal) for s in shapes for dtype in DTYPES for causal in (False, True)])
    (result,) = compiled([variant])
    assert result.ok, f"{variant.name}: {result.log[:2000]}"
    return result.cubin


DTYPES = ["float16", "bfloat16"]
FILL_SHAPES = [(4, 32, 2048, 64), (4, 32, 2048, 96), (4, 32, 2048, 128)]
SDPA_SHAPES = [(2, 4, 1000, 64), (1, 8, 777, 128), (3, 2, 64, 32), (1, 4, 500, 96)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 96, 128])
def test_default_fills_the_gpu_and_is_correct(d, dtype, causal):
    """B*H = 128 heads of 2048 queries: thousands of blocks, every SM busy, causal tiles of every length."""
    variant = _default((4, 32, 2048, d), dtype, causal)
    assert variant.launches[0].grid[0] * 4 * 32 >= 4 * _target().sm_count
    outcome = evaluate(FAMILY, variant, _cubin_among(variant, FILL_SHAPES), seed=5, reps=5)
    assert outcome.ok, f"{variant.name}: {outcome.message}"


def test_a_pairwise_covering_of_a_tail_problem_is_correct():
    """One awkward shape (N not a multiple of any tile), causal: the default and a pairwise
    covering of its valid points (every pair of values of two parameters that some valid point
    holds is held by a chosen point: each engine with each tile, pipeline and schedule, each
    tile with each schedule, and so on), chosen greedily and deterministically."""
    problem = FAMILY.problem("1,2,555,64", "bfloat16", ("causal",))
    target = _target()
    valid = space_of(FAMILY).valid_points(FAMILY.problem_values(problem, target))
    points = pairwise_cover(valid, first=[FAMILY.default_params(problem, target)])
    variants = [build_variant(FAMILY, problem, p, target) for p in points]
    failures = _wrong(variants, seed=3)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shape, options", [
    ("2,16,1000,128", {"causal": True}),
    ("1,32,2048,64", {"causal": True, "kv_heads": 8}),
    ("3,8,777,128", {"kv_len": 3333, "causal": True, "window_left": 200}),
])
def test_persistent_blocks_taking_tiles_from_a_queue_are_right_launch_after_launch(shape, options):
    """wgmma blocks that take their tiles from a counter in the workspace: every tile is computed
    once in each of several launches on fresh inputs (the last block out sets the counter back to
    zero; if it did not, the second launch would leave all but each block's first tile unwritten)."""
    if _target().arch != "90":
        pytest.skip("the wgmma kernel needs sm_90a")
    problem = FAMILY.problem(shape, "bfloat16", options)
    default = FAMILY.default_params(problem, _target())
    points = [p for p in FAMILY.seed_params(problem, _target()) if p.get("queue")][:3]
    assert points and default["engine"] == "wgmma"
    variants = [build_variant(FAMILY, problem, p, _target()) for p in points]
    for loaded in loaded_variants(variants):
        variant = loaded.variant
        for seed in (1, 2, 3):
            wrong = verify(FAMILY, loaded, seed=seed)
            assert not wrong, f"{variant.name}, launch {seed}: {wrong}"


@pytest.mark.parametrize("shape, options", [
    ("2,16,1000,128", {}),
    ("2,16,1000,128", {"causal": True}),
    ("1,32,2048,64", {"causal": True, "kv_heads": 8}),
    ("2,4,1000,64", {"kv_len": 300, "causal": True}),  # queries before the keys start: tiles with no key
    ("3,8,777,128", {"kv_len": 3333, "causal": True, "window_left": 200, "softcap": 30.0}),
    ("2,8,1500,128", {"window_right": 5}),
])
def test_chained_tiles_are_right_launch_after_launch(shape, options):
    """Persistent blocks that issue the next tile's first S with the current tile's last P.V: every
    chained point among the seeds and the default's tiles chained (ping-pong or not, queue or
    not, tiles without keys that break the chain), on fresh inputs in two launches."""
    if _target().arch != "90":
        pytest.skip("the wgmma kernel needs sm_90a")
    problem = FAMILY.problem(shape, "bfloat16", options)
    default = FAMILY.default_params(problem, _target())
    assert default["engine"] == "wgmma"
    points = [p for p in FAMILY.seed_params(problem, _target()) if p.get("chain")][:3]
    mine = {**default, "persistent": True, "chain": True}
    if mine not in points and FAMILY.is_valid(problem, _target(), mine):
        points.append(mine)
    assert points
    variants = [build_variant(FAMILY, problem, p, _target()) for p in points]
    for loaded in loaded_variants(variants):
        variant = loaded.variant
        for seed in (4, 5):
            wrong = verify(FAMILY, loaded, seed=seed)
            assert not wrong, f"{variant.name}, launch {seed}: {wrong}"


@pytest.mark.parametrize("d", [96, 128])
def test_lazy_rescaling_follows_a_max_that_rises_every_key_tile(d):
    """Keys whose scores climb by about 20 every 128 keys: each key tile moves every row's max
    past the lazy threshold, the path random inputs seldom take. Eager and lazy variants of the
    default both match the reference."""
    import cupy as cp

    from autosoft.dtypes import to_storage

    problem = FAMILY.problem(f"1,2,1000,{d}", "bfloat16")
    default = FAMILY.default_params(problem, _target())
    if default["engine"] != "wgmma":
        pytest.skip("lazy rescaling is the wgmma kernel's (sm_90)")
    rng = np.random.default_rng(4)
    q = np.abs(rng.standard_normal((1, 2, 1000, d), dtype=np.float32))
    k = rng.standard_normal((1, 2, 1000, d), dtype=np.float32) + np.linspace(0.0, 20.0, 1000, dtype=np.float32)[:, None]
    v = rng.standard_normal((1, 2, 1000, d), dtype=np.float32)
    inputs = {name: cp.asarray(to_storage(x, "bfloat16", np)) for name, x in (("q", q), ("k", k), ("v", v))}
    inputs["scale"] = np.float32(1.0 / math.sqrt(d))
    variants = [build_variant(FAMILY, problem, {**default, "rescale": r}, _target()) for r in ("eager", "lazy")]
    for loaded in loaded_variants(variants):
        outputs = allocate_outputs(FAMILY, loaded.variant, cp)
        loaded.launch({**inputs, **outputs})
        assert FAMILY.check(problem, inputs, outputs, cp) is None, loaded.variant.name


def test_scale_is_a_runtime_argument():
    import cupy as cp

    problem = FAMILY.problem("1,2,300,64", "float16", ("causal",))
    variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, _target()), _target())
    (loaded,) = loaded_variants([variant])
    for scale in (0.05, 0.125, 1.0):
        inputs = {**FAMILY.make_inputs(problem, "normal", cp, cp.random.default_rng(2)), "scale": np.float32(scale)}
        outputs = allocate_outputs(FAMILY, variant, cp)
        loaded.launch({**inputs, **outputs})
        assert FAMILY.check(problem, inputs, outputs, cp) is None, scale


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_torch_sdpa(shape, dtype, causal):
    torch = pytest.importorskip("torch")
    import cupy as cp

    from autosoft.runtime import LoadedVariant

    variant = _default(shape, dtype, causal)
    loaded = LoadedVariant(variant, _cubin_among(variant, SDPA_SHAPES))
    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", generator=gen).to(tdtype) for _ in range(3))
    o = torch.empty_like(q)
    lse = torch.empty(shape[:3], device="cuda", dtype=torch.float32)
    scale = 1 / math.sqrt(shape[3])
    torch.cuda.synchronize()
    loaded.launch({"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(),
                   "lse": lse.data_ptr(), "scale": np.float32(scale)})
    cp.cuda.runtime.deviceSynchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    tol = {"float16": 4e-3, "bfloat16": 2e-2}[dtype]
    torch.testing.assert_close(o.float(), ref.float(), atol=tol, rtol=tol)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(shape[2], shape[2], device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1), atol=1e-3, rtol=1e-4)


@pytest.mark.timing
def test_short_tune_is_correct_and_not_slower_than_default(cache_dir):
    from autosoft.tune import tune

    problem = FAMILY.problem("2,8,1024,64", "bfloat16", ("causal",))
    cache = Cache(cache_dir / "k.sqlite")
    report = tune("attention", problem, 10, cache, seed=1)
    assert report.best is not None and report.best.outcome.status is Status.OK
    assert report.default.outcome.ok
    assert report.best.outcome.time_us <= report.default.outcome.time_us
    (entry,) = cache.entries()
    assert entry.key.shape == "2x8x1024x64+causal" and entry.variant_name == report.best.variant.name
    variant = build_variant(FAMILY, problem, entry.params, _target())
    outcome = evaluate(FAMILY, variant, compile_source(variant.source, variant.target.arch).cubin, seed=99)
    assert outcome.ok, outcome.message


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_public_api_matches_sdpa_and_returns_lse(dtype, causal, cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    autosoft.api.DISPATCHER.forget()
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(2, 3, 333, 64, device="cuda", dtype=tdtype) for _ in range(3))
    o, lse = autosoft.attention(q, k, v, causal=causal, return_lse=True)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == (2, 3, 333) and lse.dtype == torch.float32
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    assert ((o.float() - ref).norm() / ref.norm()).item() < TOLERANCE[dtype]
    scores = (q.float() @ k.float().transpose(-1, -2)) / 8.0
    if causal:
        scores = scores.masked_fill(torch.ones(333, 333, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=1e-4)
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got torch.float32"):
        autosoft.attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="scale"):
        autosoft.attention(q, k, v, scale=-1.0)


def test_inputs_the_call_must_copy_each_keep_their_own_copy_until_the_launch(cache_dir):
    """q, k and v whose rows are not 16-byte aligned (a head dim of 64 padded to 65) are copied
    before the launch; each copy is held until the kernel has read it, so none is handed to the
    next one's allocation (k and v read from one block would give attention over v as keys)."""
    torch = pytest.importorskip("torch")
    import autosoft

    autosoft.api.DISPATCHER.forget()
    padded = [torch.randn(2, 3, 200, 65, device="cuda", dtype=torch.float16) for _ in range(3)]
    q, k, v = (t[..., :64] for t in padded)
    assert not q.is_contiguous() and q.stride(-2) * 2 % 16
    o = autosoft.attention(q, k, v)
    expected = autosoft.attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(o, expected)
