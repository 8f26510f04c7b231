"""GPU tier: the log-softmax (the softmax family's `log` option) verified variant by variant, and
the public softmax/log_softmax with `dim` and `out` against torch."""
from __future__ import annotations

import pytest

from autosoft.evaluate import verify
from autosoft.families import get_family
from autosoft.families.base import build_variant
from helpers import loaded_variants, sample_points

pytestmark = pytest.mark.gpu

SOFTMAX = get_family("softmax")
SHAPES = ["1x1", "7x1025", "300x4000", "4096x128", "16x131072", "2x1048576", "33x50257"]


def _target():
    from autosoft.runtime import device_info

    return device_info().target


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_sampled_log_variants_are_correct(dtype):
    """On every shape of SHAPES: the default, its seeds, six random points and four that split
    rows; all the shapes' variants compile together."""
    target = _target()
    variants = []
    for shape in SHAPES:
        problem = SOFTMAX.problem(shape, dtype, {"log": True})
        points = sample_points(SOFTMAX, problem, target, 6, seed=len(shape) * 31 + len(dtype))
        splits = [p for p in sample_points(SOFTMAX, problem, target, 200, seed=5) if p["split"] > 1]
        variants += [build_variant(SOFTMAX, problem, params, target)
                     for params in [SOFTMAX.default_params(problem, target), *points, *splits[:4]]]
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(SOFTMAX, loaded, seed=11)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text}: {wrong}")
    assert not failures, "\n".join(failures)


@pytest.fixture(autouse=True)
def fresh(cache_dir):
    from autosoft.dispatch import DISPATCHER

    DISPATCHER.forget()
    yield
    DISPATCHER.forget()


TOL = {"float32": (1e-5, 1e-5), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("dim", [0, 1, -1, 2, -3])
def test_softmax_and_log_softmax_along_any_dim_match_torch(dim, dtype):
    torch = pytest.importorskip("torch")
    import autosoft

    tdtype = getattr(torch, dtype)
    for _ in range(2):  # the second call takes the prepared plan, on new data
        x = (torch.randn(5, 33, 1000, device="cuda") * 4).to(tdtype)
        for ours, theirs in ((autosoft.softmax, torch.softmax), (autosoft.log_softmax, torch.log_softmax)):
            y = ours(x, dim=dim)
            assert y.shape == x.shape and y.dtype == x.dtype
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(y.float(), theirs(x.float(), dim=dim), atol=atol * 4, rtol=rtol)


@pytest.mark.parametrize("dim", [-1, 0])
def test_out_is_written_and_returned(dim):
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(64, 4000, device="cuda")
    out = torch.full_like(x, float("nan"))
    y = autosoft.log_softmax(x, dim=dim, out=out)
    assert y is out
    torch.testing.assert_close(out, torch.log_softmax(x, dim=dim), atol=1e-5, rtol=1e-5)
    # an out the kernel cannot write into directly (another address mod 16, not contiguous): copied in
    flat = torch.full((x.numel() + 1,), float("nan"), device="cuda")
    shifted = flat[1:].view(x.shape)
    assert autosoft.softmax(x, dim=dim, out=shifted) is shifted
    torch.testing.assert_close(shifted, torch.softmax(x, dim=dim), atol=1e-6, rtol=1e-5)
    strided = torch.full((4000, 64), float("nan"), device="cuda").t()
    assert autosoft.softmax(x, dim=dim, out=strided) is strided
    torch.testing.assert_close(strided, torch.softmax(x, dim=dim), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="out must be"):
        autosoft.softmax(x, dim=dim, out=torch.empty(64, 3999, device="cuda"))
    with pytest.raises(ValueError, match="out must be"):
        autosoft.softmax(x, dim=dim, out=torch.empty(64, 4000, device="cuda", dtype=torch.float16))


def test_out_that_is_the_input_gives_the_right_answer():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(128, 5000, device="cuda")
    expected = torch.log_softmax(x, dim=-1)
    assert autosoft.log_softmax(x, out=x) is x
    torch.testing.assert_close(x, expected, atol=1e-5, rtol=1e-5)


def test_log_softmax_special_values_follow_torch():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(6, 300, device="cuda")
    x[0] = float("-inf")           # all -inf: NaN
    x[2, 7] = float("nan")         # NaN: NaN row
    x[3, ::2] = float("-inf")      # some -inf: -inf there
    x[4] = 1e30                    # huge equal values: -log(300)
    y = autosoft.log_softmax(x)
    ref = torch.log_softmax(x, dim=-1)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isneginf(y), torch.isneginf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(y[finite], ref[finite], atol=1e-5, rtol=1e-5)


def test_cupy_log_softmax_along_the_first_dim():
    cp = pytest.importorskip("cupy")
    import autosoft

    x = cp.random.standard_normal((300, 7, 129), dtype=cp.float32)
    y = autosoft.log_softmax(x, dim=0)
    assert isinstance(y, cp.ndarray) and y.shape == x.shape
    shifted = x - x.max(axis=0, keepdims=True)
    ref = shifted - cp.log(cp.exp(shifted).sum(axis=0, keepdims=True))
    assert float(cp.abs(y - ref).max()) < 1e-4
