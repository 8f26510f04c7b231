"""GPU tier: the cross_entropy family's variants, its public functions against float64 torch, and
the tuner. Variants are verified as the tuner verifies them (autosoft.evaluate.verify: every input
kind, outputs poisoned first); autosoft.cross_entropy and autosoft.linear_cross_entropy are
compared, loss and gradients, with torch's unfused composition computed in float64."""
from __future__ import annotations

import pytest

from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.dtypes import poisoned
from autosoft.evaluate import Status, evaluate, verify
from autosoft.families import get_family
from autosoft.families.base import Problem, build_variant, space_of
from helpers import loaded_variant, loaded_variants

pytestmark = pytest.mark.gpu

FAMILY = get_family("cross_entropy")
# the gradient's tolerance against float64, per dtype: its rounding (half an ulp, with margin)
GRAD_RTOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def _device():
    from autosoft.runtime import device_info

    return device_info()


def _loaded(problem: Problem, params: dict):
    """The variant at params, compiled for this device and loaded."""
    return loaded_variant(FAMILY, problem, params)


def _one_per_strategy(problem: Problem) -> list[dict]:
    """The default and one valid point of each (storage, combine, streaming) on this device."""
    target = _device().target
    picks = [FAMILY.default_params(problem, target)]
    seen = set()
    for params in space_of(FAMILY).valid_points(FAMILY.problem_values(problem, target)):
        kind = (params["storage"], params["combine"], params["streaming"])
        if kind not in seen:
            seen.add(kind)
            picks.append(params)
    return picks


PROBLEMS = [("3x33", "bfloat16", {}), ("5x1025", "float32", {"int32_target": True}), ("64x32000", "bfloat16", {}),
            ("33x50257", "float16", {"inplace": True}), ("16x128256", "bfloat16", {}), ("8x151936", "float32", {}),
            ("4x256000", "bfloat16", {"int32_target": True}), ("40x50257", "float32", {"loss_only": True})]


def _wrong(variants, seed: int) -> list[str]:
    """The variants compiled together, then verified one by one: the failures, described."""
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(FAMILY, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text} {loaded.variant.problem.dtype}: {wrong}")
    return failures


def test_every_strategy_verifies():
    """On every problem of PROBLEMS, the default and one point of each strategy; all compiled together."""
    target = _device().target
    variants = []
    for shape, dtype, options in PROBLEMS:
        problem = FAMILY.problem(shape, dtype, options)
        variants += [build_variant(FAMILY, problem, params, target) for params in _one_per_strategy(problem)]
    failures = _wrong(variants, seed=7)
    assert not failures, "\n".join(failures)


def test_every_example_default_and_first_seeds_verify():
    """On every example problem, the default and the first four seeds; all compiled together."""
    target = _device().target
    variants = []
    for shape, dtype, options in FAMILY.examples:
        problem = FAMILY.problem(shape, dtype, options)
        points = [FAMILY.default_params(problem, target), *FAMILY.seed_params(problem, target)[:4]]
        variants += [build_variant(FAMILY, problem, params, target) for params in points]
    failures = _wrong(variants, seed=3)
    assert not failures, "\n".join(failures)


def test_an_inplace_kernel_writes_the_gradient_over_its_logits():
    """The inplace variants' promise: grad may be the logits buffer itself (split over a cluster
    or not), the loss still from the logits as they were."""
    import cupy as cp

    problem = FAMILY.problem("24x50257", "bfloat16", {"inplace": True})
    target = _device().target
    for loaded in loaded_variants([build_variant(FAMILY, problem, p, target) for p in _one_per_strategy(problem)]):
        inputs = FAMILY.make_inputs(problem, "smoothed", cp, cp.random.default_rng(5))
        original = {**inputs, "logits": inputs["logits"].copy()}
        loss = cp.full(24, cp.nan, dtype=cp.float32)
        lse = cp.full(24, cp.nan, dtype=cp.float32)
        loaded.launch({**inputs, "grad": inputs["logits"], "loss": loss, "lse": lse})
        cp.cuda.runtime.deviceSynchronize()
        wrong = FAMILY.check(problem, original, {"loss": loss, "lse": lse, "grad": inputs["logits"]}, cp)
        assert wrong is None, f"{loaded.variant.name}: {wrong}"


def test_grid_split_rows_combine_on_every_launch():
    """The cooperative grid's arrival counters are never reset: launch after launch they count on."""
    import cupy as cp

    problem = FAMILY.problem("4x128256", "float32")
    target = _device().target
    params = {**FAMILY.default_params(problem, target), "split": 8, "combine": "grid", "threads": 1024,
              "storage": "registers", "unroll": 1}
    assert FAMILY.is_valid(problem, target, params)
    loaded = _loaded(problem, params)
    rng = cp.random.default_rng(2)
    for i in range(4):
        inputs = FAMILY.make_inputs(problem, FAMILY.input_kinds[i], cp, rng)
        outputs = {name: poisoned(shape, dtype, cp) for name, (shape, dtype) in FAMILY.output_specs(problem).items()}
        loaded.launch({**inputs, **outputs})
        cp.cuda.runtime.deviceSynchronize()
        assert FAMILY.check(problem, inputs, outputs, cp) is None, i


# --- autosoft.cross_entropy against float64 torch ------------------------------------------------

def _torch_reference(torch, logits, target, ignore_index, eps, z, reduction, weight=None):
    """torch's composition in float64: F.cross_entropy plus z lse^2 per kept row; returns the loss
    and the gradient of (loss * weight).sum() (weight 1 for a reduced loss)."""
    x = logits.detach().double().requires_grad_()
    per_row = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1).long(),
                                                ignore_index=ignore_index, label_smoothing=eps, reduction="none")
    kept = target.reshape(-1) != ignore_index
    per_row = per_row + z * torch.where(kept, torch.logsumexp(x.reshape(-1, x.shape[-1]), -1) ** 2, 0)
    if reduction == "mean":
        loss = per_row.sum() / kept.sum()
    elif reduction == "sum":
        loss = per_row.sum()
    else:
        loss = per_row.reshape(target.shape)
    (loss * (1 if weight is None else weight.double())).sum().backward()
    return loss.detach(), x.grad


def _logits(torch, m, n, dtype, seed, neg_inf=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, n, device="cuda", generator=gen) * 3
    if neg_inf:
        x[torch.rand(m, n, device="cuda", generator=gen) < 0.1] = -float("inf")
        rows = torch.arange(m, device="cuda")
        x[rows, (rows * 7 + 3) % n] = 1.0
    return x.to(getattr(torch, dtype))


def _targets(torch, m, n, ignore_index, seed, dtype=None):
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    t = torch.randint(0, n, (m,), device="cuda", generator=gen)
    t[::7] = ignore_index
    return t.to(dtype or torch.int64)


def _assert_close(torch, got, expected, rtol, atol, what):
    got, expected = got.double(), expected.double()
    same_inf = torch.isinf(expected) & (got == expected)
    err = torch.where(same_inf, 0.0, (got - expected).abs())
    tol = rtol * torch.where(torch.isinf(expected), 0.0, expected.abs()) + atol
    bad = ~(err <= tol)
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} off; worst {float(err.max())} "
                           f"(got {got.flatten()[int(err.argmax())]}, expected {expected.flatten()[int(err.argmax())]})")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("reduction,eps,z", [("mean", 0.0, 0.0), ("sum", 0.1, 0.0), ("none", 0.0, 1e-3),
                                             ("mean", 0.2, 1e-4)])
@pytest.mark.parametrize("n", [1025, 32003])
def test_cross_entropy_matches_float64_torch(cache_dir, dtype, reduction, eps, z, n):
    torch = pytest.importorskip("torch")
    import autosoft

    m = 67
    logits = _logits(torch, m, n, dtype, seed=n).requires_grad_()
    target = _targets(torch, m, n, -100, seed=n)
    weight = torch.rand(m, device="cuda") if reduction == "none" else None
    expected, expected_grad = _torch_reference(torch, logits, target, -100, eps, z, reduction, weight)
    loss = autosoft.cross_entropy(logits, target, label_smoothing=eps, z_loss=z, reduction=reduction)
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    (loss * (1 if weight is None else weight)).sum().backward()
    _assert_close(torch, loss, expected, 1e-5, 1e-5, "loss")
    scale = float(expected_grad.abs().max())
    _assert_close(torch, logits.grad, expected_grad, GRAD_RTOL[dtype], 1e-5 * scale, "grad")
    assert logits.grad.dtype == logits.dtype


def test_unaligned_strided_and_batched_logits(cache_dir):
    """Rows that start mid-vector (odd vocabulary; a base address 2 bytes past 16), a
    non-contiguous view, and (B, T, V) logits with (B, T) targets."""
    torch = pytest.importorskip("torch")
    import autosoft

    m, n = 40, 4097
    flat = torch.randn(m * n + 1, device="cuda", dtype=torch.bfloat16)
    shifted = flat[1:].view(m, n).requires_grad_()  # 2 bytes past a 256-byte boundary
    wide = torch.randn(m, n + 5, device="cuda", dtype=torch.float32)[:, 3:3 + n].requires_grad_()
    batched = torch.randn(4, 10, n, device="cuda", dtype=torch.float16).requires_grad_()
    for logits, target in ((shifted, _targets(torch, m, n, -100, 1)), (wide, _targets(torch, m, n, -100, 2)),
                           (batched, _targets(torch, 40, n, -100, 3).reshape(4, 10))):
        expected, expected_grad = _torch_reference(torch, logits, target, -100, 0.1, 1e-4, "mean")
        loss = autosoft.cross_entropy(logits, target, label_smoothing=0.1, z_loss=1e-4)
        loss.backward()
        _assert_close(torch, loss, expected, 1e-5, 1e-6, "loss")
        dtype = str(logits.dtype).removeprefix("torch.")
        _assert_close(torch, logits.grad, expected_grad, GRAD_RTOL[dtype], 1e-7, "grad")
        assert logits.grad.shape == logits.shape


def test_int32_targets_other_ignore_index_and_inplace_backward(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    m, n = 50, 32000
    logits = _logits(torch, m, n, "bfloat16", seed=4, neg_inf=False)
    target = _targets(torch, m, n, 5, seed=4, dtype=torch.int32)
    expected, expected_grad = _torch_reference(torch, logits, target, 5, 0.0, 0.0, "mean")
    leaf = logits.clone().requires_grad_()
    loss = autosoft.cross_entropy(leaf, target, ignore_index=5, inplace_backward=True)
    _assert_close(torch, loss, expected, 1e-5, 1e-6, "loss")
    loss.backward()
    _assert_close(torch, leaf.grad, expected_grad, GRAD_RTOL["bfloat16"], 1e-7, "grad")
    assert not torch.equal(leaf.detach(), logits)  # the logits' memory took the gradient
    assert (leaf.grad[target == 5] == 0).all()


def test_without_gradients_the_loss_and_lse_and_a_nan_for_a_bad_target(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = _logits(torch, 9, 1000, "float32", seed=6, neg_inf=False)
    target = _targets(torch, 9, 1000, -100, seed=6)
    target[1] = 1000  # out of range, not ignored
    with torch.no_grad():
        loss, lse = autosoft.cross_entropy(logits, target, reduction="none", return_lse=True)
    _assert_close(torch, lse, torch.logsumexp(logits.double(), -1), 1e-6, 1e-6, "lse")
    assert torch.isnan(loss[1]) and loss[0] == 0 and torch.isfinite(loss[2:]).all()
    good = target != 1000
    expected, _ = _torch_reference(torch, logits[good], target[good], -100, 0.0, 0.0, "none")
    _assert_close(torch, loss[good], expected, 1e-5, 1e-6, "loss")


def test_backward_scales_by_the_incoming_gradient_and_every_row_ignored_gives_nan(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = _logits(torch, 20, 777, "float32", seed=8, neg_inf=False).requires_grad_()
    target = _targets(torch, 20, 777, -100, seed=8)
    (autosoft.cross_entropy(logits, target) * 3).backward()
    _, expected_grad = _torch_reference(torch, logits, target, -100, 0.0, 0.0, "mean")
    _assert_close(torch, logits.grad, 3 * expected_grad, 1e-5, 1e-8, "grad x3")
    logits.grad = None
    ignored = torch.full_like(target, -100)
    loss = autosoft.cross_entropy(logits, ignored)
    loss.backward()
    assert torch.isnan(loss) and (logits.grad == 0).all()  # torch gives NaN too


def test_a_cuda_graph_replays_every_reduction_and_eager_calls_after_it_agree(cache_dir, monkeypatch):
    """The loss's small kernels (the mean's scale, the scaled sum, the cached scale of 1) in a
    captured graph: a scale of 1 first made during the capture is not kept for eager calls (its
    fill runs only at replay)."""
    torch = pytest.importorskip("torch")
    import autosoft
    import autosoft.functions.cross_entropy as module

    logits = _logits(torch, 64, 5000, "bfloat16", seed=9, neg_inf=False)
    target = _targets(torch, 64, 5000, -100, seed=9)
    with torch.no_grad():
        eager = {r: autosoft.cross_entropy(logits, target, reduction=r) for r in ("mean", "sum", "none")}
        monkeypatch.setattr(module, "_ONES", {})
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = {r: autosoft.cross_entropy(logits, target, reduction=r) for r in ("sum", "mean", "none")}
        assert module._ONES == {}
        graph.replay()
        torch.cuda.synchronize()
        for r in ("mean", "sum", "none"):
            assert torch.equal(captured[r], eager[r]), r  # the same kernels, the same order: the same bits
            assert torch.equal(autosoft.cross_entropy(logits, target, reduction=r), eager[r]), r
    expected, _ = _torch_reference(torch, logits, target, -100, 0.0, 0.0, "sum")
    _assert_close(torch, eager["sum"], expected, 1e-5, 1e-5, "sum")


# --- linear + cross-entropy ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype,bias,chunk", [("float32", False, None), ("float32", True, 128), ("float32", True, 1),
                                              ("bfloat16", False, None), ("bfloat16", True, 128)])
def test_linear_cross_entropy_matches_the_unfused_composition(cache_dir, dtype, bias, chunk):
    """Chunks of 128 tokens (not dividing 300) and of one; the weight's gradient adds up over the
    chunks in its own dtype (as Liger's), so bfloat16 gets no chunks of one token."""
    torch = pytest.importorskip("torch")
    import autosoft

    tokens, hidden, vocab = 300, 64, 1003
    gen = torch.Generator(device="cuda").manual_seed(11)
    tdtype = getattr(torch, dtype)
    h = (torch.randn(3, tokens // 3, hidden, device="cuda", generator=gen) / 4).to(tdtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=gen) / 4).to(tdtype).requires_grad_()
    b = (torch.randn(vocab, device="cuda", generator=gen) / 4).to(tdtype).requires_grad_() if bias else None
    target = _targets(torch, tokens, vocab, -100, seed=12).reshape(3, tokens // 3)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if bias else None
    logits = h64 @ w64.t() + (b64 if bias else 0)
    expected, _ = _torch_reference(torch, logits, target, -100, 0.1, 1e-4, "sum")
    per_row = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), label_smoothing=0.1,
                                                reduction="none")
    kept = target.reshape(-1) != -100
    per_row = per_row + 1e-4 * torch.where(kept, torch.logsumexp(logits.reshape(-1, vocab), -1) ** 2, 0)
    per_row.sum().backward()
    loss = autosoft.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.1, z_loss=1e-4, reduction="sum",
                                         chunk_size=chunk)
    (loss * 2).backward()
    rtol = 1e-4 if dtype == "float32" else 3e-2
    _assert_close(torch, loss, expected, rtol, 1e-4, "loss")
    for got, want, name in ((h.grad, h64.grad, "hidden"), (w.grad, w64.grad, "weight")) + \
            (((b.grad, b64.grad, "bias"),) if bias else ()):
        _assert_close(torch, got, 2 * want, rtol, rtol * float(want.abs().max()), name)


def test_linear_cross_entropy_peak_memory_is_one_chunk(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    tokens, hidden, vocab, chunk = 4096, 256, 32000, 512
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16).requires_grad_()
    target = _targets(torch, tokens, vocab, -100, seed=13)
    autosoft.linear_cross_entropy(h, w, target, chunk_size=chunk).backward()  # compile and load first
    h.grad = w.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    autosoft.linear_cross_entropy(h, w, target, chunk_size=chunk).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    chunk_logits = chunk * vocab * 2
    grads = h.numel() * 2 + w.numel() * 2
    # the gradients (and the copies autograd may make of them), one chunk's logits, 8 MiB of slack
    assert extra < 2 * grads + chunk_logits + (8 << 20), (extra, grads, chunk_logits)
    assert extra < tokens * vocab * 2 / 2  # far below the whole logits


# --- the tuner -----------------------------------------------------------------------------------

def test_short_tune_is_correct_and_not_slower_than_default(cache_dir):
    from autosoft.tune import tune

    problem = FAMILY.problem("1024x32000", "bfloat16")
    cache = Cache(cache_dir / "k.sqlite")
    report = tune("cross_entropy", problem, 24, cache, seed=3)
    assert report.best is not None and report.best.outcome.status is Status.OK
    assert report.default.outcome.ok
    assert report.best.outcome.time_us <= report.default.outcome.time_us
    (entry,) = cache.entries()
    variant = build_variant(FAMILY, problem, entry.params, _device().target)
    outcome = evaluate(FAMILY, variant, compile_source(variant.source, variant.target.arch).cubin, seed=99)
    assert outcome.ok, outcome.message


def test_torch_compile_runs_the_operator_and_its_backward(cache_dir):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = _logits(torch, 64, 32000, "bfloat16", seed=14, neg_inf=False).requires_grad_()
    target = _targets(torch, 64, 32000, -100, seed=14)
    step = torch.compile(lambda x, t: autosoft.cross_entropy(x, t, label_smoothing=0.1), fullgraph=True)
    loss = step(logits, target)
    loss.backward()
    expected, expected_grad = _torch_reference(torch, logits, target, -100, 0.1, 0.0, "mean")
    _assert_close(torch, loss, expected, 1e-5, 1e-6, "loss")
    _assert_close(torch, logits.grad, expected_grad, GRAD_RTOL["bfloat16"], 1e-7, "grad")
    loss32 = step(logits, target.int())  # int32 targets: another plan of the same operator
    _assert_close(torch, loss32, expected, 1e-5, 1e-6, "loss (int32 targets)")
