"""GPU tier: the topk_softmax family (the MoE router) on a real device. Variants are verified as the
tuner verifies them (autosoft.evaluate.verify: every input kind, outputs poisoned first) for every
expert count, k = 1 and k = E, every strategy, the DeepSeek-V3 grouped form, 1 and 65,536 tokens,
and points sampled from the whole space (every block size, store width and list length); then
autosoft.topk_softmax through torch against torch's float64 composition, ties included."""
from __future__ import annotations

import random

import numpy as np
import pytest

from autosoft.dtypes import to_storage
from autosoft.evaluate import verify
from autosoft.families import get_family
from autosoft.families.base import Problem, build_variant, space_of
from helpers import loaded_variants

pytestmark = pytest.mark.gpu

FAMILY = get_family("topk_softmax")
EXPERTS = (8, 16, 60, 64, 128, 160, 256, 384, 512)
DEEPSEEK = {"k": 8, "renormalize": True, "n_group": 8, "topk_group": 4, "sigmoid": True, "bias": True}


def _target():
    from autosoft.runtime import device_info

    return device_info().target


def _verify_all(cases: list[tuple[Problem, list[dict]]]) -> None:
    """Every case's points compiled together, then verified one by one; fails listing every wrong one."""
    variants = [build_variant(FAMILY, problem, params, _target()) for problem, points in cases for params in points]
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(FAMILY, loaded, seed=11)
        if wrong:
            problem = loaded.variant.problem
            failures.append(f"{loaded.variant.name} on {problem.shape_text} {problem.dtype}: {wrong}")
    assert not failures, "\n".join(failures)


def _points(problem: Problem) -> list[dict]:
    """The default; of each strategy and token group size, one valid point; and of each strategy,
    one point with each of short keys (fp32 values), compact lists (grouped) and a full SM's
    launch bound (16-bit keys) where valid."""
    target = _target()
    points = [FAMILY.default_params(problem, target)]
    valid = [p for p in space_of(FAMILY).valid_points(FAMILY.problem_values(problem, target)) if p["threads"] == 128]

    def add(p: dict, kind: tuple[str, ...]) -> None:
        if not any(all(q[n] == p[n] for n in kind) for q in points):
            points.append(p)

    for p in valid:
        add(p, ("select", "row_threads"))
    for flag in ("short_keys", "compact", "full_occupancy"):
        for p in valid:
            if p[flag]:
                add(p, ("select", flag))
    return points


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_expert_count_with_k_1_16_and_e(dtype):
    """Every expert count of EXPERTS with k = 1, min(16, E) and E, renormalised or not; all of a
    dtype's variants compile together."""
    cases = []
    for experts in EXPERTS:
        for k in sorted({1, min(16, experts), experts}):
            for renormalize in (True, False):
                problem = FAMILY.problem(f"97x{experts}", dtype, {"k": k, "renormalize": renormalize})
                cases.append((problem, _points(problem) if k != experts else [FAMILY.default_params(problem, _target())]))
    _verify_all(cases)


GROUPED = [
    DEEPSEEK,
    {**DEEPSEEK, "sigmoid": False},
    {"k": 8, "renormalize": True, "n_group": 8, "topk_group": 4},                  # DeepSeek-V2: group max
    {"k": 6, "renormalize": False, "n_group": 8, "topk_group": 3, "sigmoid": True},
    {"k": 4, "renormalize": True, "sigmoid": True, "bias": True},                   # no groups
    {"k": 32, "renormalize": True, "n_group": 8, "topk_group": 1, "sigmoid": True, "bias": True},  # k = a group
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_grouped_form(dtype):
    """Every routing form of GROUPED on 256 experts; all of a dtype's variants compile together."""
    problems = [FAMILY.problem("211x256", dtype, options) for options in GROUPED]
    _verify_all([(problem, _points(problem)) for problem in problems])


@pytest.mark.parametrize("shape", ["1x256", "65536x256", "65536x60", "1x8"])
def test_one_token_and_65536_tokens(shape):
    cases = []
    for options in ({"k": 8 if shape != "1x8" else 2, "renormalize": True}, DEEPSEEK):
        if options is DEEPSEEK and not shape.endswith("x256"):
            continue
        problem = FAMILY.problem(shape, "bfloat16", options)
        cases.append((problem, _points(problem)[:4]))
    _verify_all(cases)


SAMPLED = [
    ("65536x128", "bfloat16", {"k": 8, "renormalize": True}),
    ("1000x384", "float16", {"k": 8}),
    ("777x512", "bfloat16", {"k": 16, "renormalize": True}),
    ("333x60", "float32", {"k": 6, "renormalize": True}),
    ("4099x256", "bfloat16", DEEPSEEK),
    ("129x160", "float32", {"k": 6, "n_group": 8, "topk_group": 3}),
]


def test_sampled_variants():
    """On each problem of SAMPLED, eight valid points drawn from the whole space (a fixed seed):
    block sizes whose last warp runs past the tokens, every store width, the 32- and 64-bit keys,
    lists of every length; all compiled together."""
    cases = []
    for shape, dtype, options in SAMPLED:
        problem = FAMILY.problem(shape, dtype, options)
        points = space_of(FAMILY).valid_points(FAMILY.problem_values(problem, _target()))
        cases.append((problem, random.Random(shape).sample(points, min(8, len(points)))))
    _verify_all(cases)


NEAR_TIES = [
    ("64x256", "float32", {"k": 4, "renormalize": True}),
    ("64x256", "float32", {"k": 1}),  # one pick: the best key left is a list's dropped key or another's head
    ("64x256", "float32", {"k": 4, "renormalize": True, "sigmoid": True, "bias": True}),
    ("64x256", "bfloat16", DEEPSEEK),
    ("64x256", "bfloat16", {**DEEPSEEK, "k": 1}),
]


def _near_ties(problem: Problem, cp):
    """Experts 1..5 whose selection values differ by two fp32 ulps or tie (the same kept bits of a
    short key, with the indices in the wrong order), every other expert far below: logits 1 +
    m * 2^-22 (plain), else logits 0 (equal scores) and bias 0.5 + m * 2^-22, m = 0, 1, 2, 1, 3.
    The exact order is 5, 3, 2, 4 (tied with 2: the lower index first), 1, then the rest."""
    m_, e = problem.shape
    steps = np.array([0, 1, 2, 1, 3], dtype=np.float64) * 2.0 ** -22
    x = np.full((m_, e), -20.0, dtype=np.float32)
    bias = np.zeros(e, dtype=np.float32)
    if problem.option("bias"):
        x[:, 1:6] = 0.0
        bias[1:6] = (0.5 + steps).astype(np.float32)
    else:
        x[:, 1:6] = (1.0 + steps).astype(np.float32)
    logits = cp.asarray(to_storage(x, problem.dtype, np))
    return {"logits": logits, "bias": cp.asarray(bias), "scale": np.float32(1.0)}


def test_values_that_share_a_short_keys_kept_bits_are_chosen_exactly():
    """Where picks share a short key's kept bits the index order is wrong; the check after the
    rounds must send the warp to the exact 64-bit choice (every strategy, short and 64-bit keys),
    giving 5, 3, 2, 4 and on. The grouped form's near-ties pass `check` either way, so the
    indices are compared here exactly."""
    cp = pytest.importorskip("cupy")
    from autosoft.evaluate import allocate_outputs

    cases = [(FAMILY.problem(*row), None) for row in NEAR_TIES]
    variants = [build_variant(FAMILY, problem, params, _target()) for problem, _ in cases
                for params in _points(problem)]
    assert any(v.name.endswith("_k32") for v in variants) and not all(v.name.endswith("_k32") for v in variants)
    failures = []
    for loaded in loaded_variants(variants):
        problem = loaded.variant.problem
        inputs = _near_ties(problem, cp)
        outputs = allocate_outputs(FAMILY, loaded.variant, cp)
        loaded.launch({**inputs, **outputs})
        cp.cuda.runtime.deviceSynchronize()
        k = int(problem.option("k"))
        expected = [5, 3, 2, 4, 1, 0, 6, 7][:k]  # grouped: the rest tie, groups 0..3 kept, lower index first
        got = cp.asnumpy(outputs["indices"])
        if not (got == np.array(expected)).all():
            failures.append(f"{loaded.variant.name} on {problem.shape_text}: {got[0].tolist()} != {expected}")
        wrong = FAMILY.check(problem, inputs, outputs, cp)
        if wrong:
            failures.append(f"{loaded.variant.name} on {problem.shape_text}: {wrong}")
    assert not failures, "\n".join(failures)


def test_the_torch_function_matches_torchs_composition_with_ties():
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator(device="cuda").manual_seed(5)
    for experts in EXPERTS:
        k = min(8, experts)
        # integers in [-3, 3]: most tokens tie at the k-th place
        x = torch.randint(-3, 4, (1000, experts), device="cuda", generator=gen).to(torch.bfloat16)
        weights, indices = autosoft.topk_softmax(x, k)
        assert weights.dtype == torch.float32 and indices.dtype == torch.int32
        assert weights.shape == indices.shape == (1000, k)
        ref = torch.sort(x.double(), dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(indices.long(), ref), f"E={experts}: ties must go to the lower index"
        p = torch.softmax(x.double(), dim=-1).gather(1, ref)
        torch.testing.assert_close(weights.double(), p / p.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)
        raw, _ = autosoft.topk_softmax(x.float().view(10, 100, experts), k, renormalize=False)
        assert raw.shape == (10, 100, k)
        torch.testing.assert_close(raw.view(1000, k).double(), p, rtol=1e-5, atol=1e-7)


def test_the_torch_function_runs_deepseek_v3_routing():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(256, device="cuda") * 0.1
    weights, indices = autosoft.topk_softmax(x, 8, n_group=8, topk_group=4, scoring="sigmoid", bias=bias,
                                             routed_scaling_factor=2.5)
    scores = torch.sigmoid(x.double())
    keys = scores + bias.double()
    group = keys.view(4096, 8, 32).topk(2, dim=-1).values.sum(-1)
    kept = torch.zeros_like(group).scatter_(1, group.topk(4, dim=-1).indices, 1.0).repeat_interleave(32, 1)
    ref = keys.masked_fill(kept == 0, float("-inf")).topk(8, dim=-1).indices
    same = (torch.sort(indices.long(), -1).values == torch.sort(ref, -1).values).all(-1)
    assert same.float().mean() > 0.999, "all but fp32 near-ties choose as torch does"
    w = scores.gather(1, indices.long())
    torch.testing.assert_close(weights.double(), 2.5 * w / w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="bias must be a vector of the 256 experts"):
        autosoft.topk_softmax(x, 8, n_group=8, topk_group=4, bias=bias[:255])
    with pytest.raises(TypeError, match=r"^autosoft\.topk_softmax: bias must be float32, got torch\.bfloat16$"):
        autosoft.topk_softmax(x, 8, n_group=8, topk_group=4, bias=bias.bfloat16())
    compiled = torch.compile(lambda x, b: autosoft.topk_softmax(x, 8, n_group=8, topk_group=4, scoring="sigmoid",
                                                                bias=b, routed_scaling_factor=2.5), fullgraph=True)
    traced_w, traced_i = compiled(x, bias)
    assert torch.equal(traced_i, indices) and torch.equal(traced_w, weights), "the operator runs the same kernel"
    with pytest.raises(RuntimeError, match="no backward"):
        autosoft.topk_softmax(x.float().requires_grad_(), 8)
    empty_w, empty_i = autosoft.topk_softmax(x[:0], 8)
    assert empty_w.shape == empty_i.shape == (0, 8)
