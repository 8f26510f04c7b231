"""GPU tier for the attention backward: sampled variants against float64 gradients (every input
kind, outputs poisoned), dQ bit for bit over runs in the ordered variants, the Python function on
torch tensors against torch's autograd."""
from __future__ import annotations

import numpy as np
import pytest

from autosoft.evaluate import allocate_outputs, verify
from autosoft.families import get_family
from autosoft.families.base import build_variant
from helpers import loaded_variants, sample_points

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention_backward")

# (shape, options) beyond the family's examples: MQA, Nq > Nkv under causal (queries that see no
# key), windows cutting the first and last tiles, softcap with causal, N off every tile size
PROBLEMS = [
    ("1,8,200,64", {"kv_heads": 1, "causal": True}),
    ("2,8,130,128", {"kv_heads": 2, "kv_len": 77, "causal": True}),
    ("1,2,300,64", {"window_left": 10, "window_right": 5}),
    ("1,4,333,128", {"causal": True, "softcap": 15.0}),
    ("1,2,1000,64", {"kv_len": 3001, "causal": True, "lse_grad": True}),
    ("2,2,129,32", {}),
]


def _target():
    from autosoft.runtime import device_info

    return device_info().target


def _problems(dtype: str):
    out = [FAMILY.problem(shape, dt, opts) for shape, dt, opts in FAMILY.examples]
    return out + [FAMILY.problem(shape, dtype, opts) for shape, opts in PROBLEMS]


def _with_dq_add(problem, target, params, dq_add: str):
    """params with dQ added as dq_add (with one dS^T buffer where two leave no room), or None where
    the engine has no such choice or no form of it is valid."""
    if params.get("engine") != "wgmma":
        return None
    for change in ({"dq_add": dq_add}, {"dq_add": dq_add, "ds_buffers": 1}):
        candidate = {**params, **change}
        if FAMILY.is_valid(problem, target, candidate):
            return candidate
    return None


def _wide(problem, target, params):
    """params at 128 queries a step (with one dS^T buffer, then one stage, where they do not fit),
    or None where no form of it is valid."""
    candidate = {**params, "block_m": 128}
    for change in ({}, {"ds_buffers": 1}, {"stages": 1}):
        candidate = {**candidate, **change}
        if FAMILY.is_valid(problem, target, candidate):
            return candidate
    return None


# head dim 64, where 128 queries a step are valid: MQA and GQA, causal with Nq != Nkv (queries that
# see no key) and Nq < Nkv, windows, softcap, N off 128, the ordered adds
WIDE_PROBLEMS = [
    ("1,8,200,64", {"kv_heads": 1, "causal": True}),
    ("2,8,333,64", {"kv_heads": 2}),
    ("1,2,300,64", {"window_left": 10, "window_right": 5}),
    ("1,4,333,64", {"causal": True, "softcap": 15.0}),
    ("1,2,1000,64", {"kv_len": 3001, "causal": True, "lse_grad": True}),
    ("2,4,700,64", {"kv_len": 190, "causal": True}),
    ("2,4,1000,64", {"causal": True, "kv_heads": 2, "deterministic": True}),
]


def _wrong(variants, seed: int) -> list[str]:
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(FAMILY, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name} on {loaded.variant.problem.shape_text} "
                            f"{dict(loaded.variant.problem.options)}: {wrong}")
    return failures


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sampled_variants_are_correct(dtype):
    """Every problem: the default, its first four seeds, two random points, an ordered one, and
    the wgmma engine's dQ writer in both orders."""
    target = _target()
    variants = []
    for i, problem in enumerate(_problems(dtype)):
        points = sample_points(FAMILY, problem, target, 2, seed=31 * i + len(dtype), seeds=4)
        default = FAMILY.default_params(problem, target)
        ordered = {**default, "dq_add": "ordered"}
        if FAMILY.is_valid(problem, target, ordered) and ordered not in points:
            points.append(ordered)
        for dq_add in ("writer", "writer_ordered"):  # at both step heights where the default has 128
            for base in (default, {**default, "block_m": 64}) if default.get("block_m") == 128 else (default,):
                writer = _with_dq_add(problem, target, base, dq_add)
                if writer is not None and writer not in points:
                    points.append(writer)
        variants += [build_variant(FAMILY, problem, p, target) for p in points]
    failures = _wrong(variants, seed=5)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_128_queries_a_step_are_correct(dtype):
    """Every wide problem (and the examples at head dim 64) at 128 queries a step, in every way of
    adding dQ its flags allow, with two consumers and with one."""
    target = _target()
    problems = [FAMILY.problem(shape, dt, opts) for shape, dt, opts in FAMILY.examples]
    problems = [p for p in problems if p.shape[3] == 64]
    problems += [FAMILY.problem(shape, dtype, opts) for shape, opts in WIDE_PROBLEMS]
    variants = []
    for problem in problems:
        default = FAMILY.default_params(problem, target)
        points = []
        for dq_add in ("atomic", "ordered", "writer", "writer_ordered"):
            for block_n in (128, 64):
                wide = _wide(problem, target, {**default, "dq_add": dq_add, "block_n": block_n})
                if wide is not None and wide not in points:
                    points.append(wide)
        assert points, f"no valid point at 128 queries a step for {problem.shape_text}"
        variants += [build_variant(FAMILY, problem, p, target) for p in points]
    failures = _wrong(variants, seed=7)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("shape, dq_add, block_m", [
    ("2,8,1500,64", "ordered", 64),
    ("2,8,1500,64", "writer_ordered", 64),   # two consumers' dQ tiles over the same elements, one after the other
    ("1,8,1100,128", "writer_ordered", 64),  # one dQ tile, its columns split between the consumers
    ("2,8,1500,64", "ordered", 128),         # 128 queries a step: the consumers' rows of dQ
    ("2,8,1500,64", "writer_ordered", 128),
])
def test_ordered_dq_is_the_same_bits_on_every_run(shape, dq_add, block_m):
    """Causal, grouped heads, many key tiles per query tile: three runs of an ordered variant (the
    consumers' adds in turn, or the writer thread's) give one dq bit for bit (and the atomic
    variant agrees with it to rounding)."""
    import cupy as cp

    target = _target()
    problem = FAMILY.problem(shape, "bfloat16", {"causal": True, "kv_heads": 2, "deterministic": True})
    default = FAMILY.default_params(problem, target)
    assert default["dq_add"] in ("ordered", "writer_ordered")  # only ordered adds where the problem asks
    narrow = {**default, "block_m": 64}
    params = (_with_dq_add(problem, target, narrow, dq_add) if block_m == 64 else
              _wide(problem, target, {**default, "dq_add": dq_add}))
    assert params is not None
    atomic = {**narrow, "dq_add": "atomic"}
    free = FAMILY.problem(shape, "bfloat16", {"causal": True, "kv_heads": 2})
    ordered_v, atomic_v = loaded_variants([build_variant(FAMILY, problem, params, target),
                                           build_variant(FAMILY, free, atomic, target)])
    inputs = FAMILY.make_inputs(problem, "normal", cp, cp.random.default_rng(3))
    runs = []
    for _ in range(3):
        outputs = allocate_outputs(FAMILY, ordered_v.variant, cp)
        ordered_v.launch({**inputs, **outputs})
        runs.append({n: cp.asnumpy(a) for n, a in outputs.items()})
    for run in runs[1:]:
        for name in ("dq", "dk", "dv"):
            assert np.array_equal(run[name], runs[0][name]), f"{name} differs between runs"
    outputs = allocate_outputs(FAMILY, atomic_v.variant, cp)
    atomic_v.launch({**inputs, **outputs})
    assert FAMILY.check(problem, inputs, outputs, cp) is None
    assert FAMILY.check(problem, inputs, {n: cp.asarray(a) for n, a in runs[0].items()}, cp) is None


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_function_on_torch_tensors_matches_torch_autograd(causal):
    """autosoft.attention_backward from autosoft.attention's o and lse, against torch's autograd of
    SDPA in float32 on the same bf16 inputs (grouped heads, N off the tiles, q a strided view)."""
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv, n, d = 2, 8, 2, 777, 128
    qkv = torch.randn(b, n, hq + 2 * hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    q = qkv[:, :, :hq].transpose(1, 2)                       # a (B, N, H, D) projection seen as (B, H, N, D)
    k = qkv[:, :, hq:hq + hkv].transpose(1, 2)
    v = qkv[:, :, hq + hkv:].transpose(1, 2)
    do = torch.randn(b, hq, n, d, device="cuda", generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        o, lse = autosoft.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = autosoft.attention_backward(q, k, v, o, do, lse, causal=causal)
    q32, k32, v32 = (x.float().detach().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=causal, enable_gqa=True)
    ref.backward(do.float())
    for name, got, want in (("dq", dq, q32.grad), ("dk", dk, k32.grad), ("dv", dv, v32.grad)):
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < 3e-2, f"{name}: relative error {err:.3g}"
