"""CPU tier for attention over a KV cache: the bucket a problem is, the inputs (pages scattered in
a pool, lengths at the edges) and the check, against an append and an attention written here
independently in NumPy; the default kernels compile."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autosoft.dtypes import to_float64
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant

FAMILY = get_family("attention_kvcache")

PAGED = ("3,8,2,64", "float16", {"kv_len": 70, "kv_heads": 2, "page_size": 16, "new_len": 3, "causal": True})
CONTIGUOUS = ("2,4,1,128", "bfloat16", {"kv_len": 33, "kv_heads": 4, "window_left": 9, "softcap": 20.0})


def _append(problem, inputs):
    """k_new and v_new written where they belong, by position and block table: the kernel's job."""
    page = int(problem.option("page_size", 0))
    new = int(problem.option("new_len", 0))
    for name in ("k", "v"):
        cache, fresh = inputs[f"{name}_cache"], inputs.get(f"{name}_new")
        for b, start in enumerate(inputs["cache_seqlens"]):
            for j in range(new):
                pos = int(start) + j
                if page:
                    cache[inputs["block_table"][b, pos // page], pos % page] = fresh[b, j]
                else:
                    cache[b, pos] = fresh[b, j]


def _attend(problem, inputs):
    """o (B, Hq, Nq, D) and lse (B, Hq, Nq) in float64, one query at a time, from the gathered keys."""
    b, h, n, d = problem.shape
    kv_heads = int(problem.option("kv_heads", h))
    page = int(problem.option("page_size", 0))
    left, right, cap = problem.option("window_left"), problem.option("window_right"), problem.option("softcap")
    scale = float(inputs["scale"])
    q = to_float64(inputs["q"], problem.dtype, np)
    o, lse = np.zeros((b, h, n, d)), np.zeros((b, h, n))
    for s in range(b):
        length = int(inputs["cache_seqlens"][s]) + int(problem.option("new_len", 0))
        if page:
            rows = [(int(inputs["block_table"][s, t // page]), t % page) for t in range(length)]
            keys = np.stack([to_float64(inputs["k_cache"][p, r], problem.dtype, np) for p, r in rows])
            values = np.stack([to_float64(inputs["v_cache"][p, r], problem.dtype, np) for p, r in rows])
        else:
            keys = to_float64(inputs["k_cache"][s, :length], problem.dtype, np)
            values = to_float64(inputs["v_cache"][s, :length], problem.dtype, np)
        for head in range(h):
            kv = head // (h // kv_heads)
            for i in range(n):
                pos = length - n + i
                seen = [t for t in range(length)
                        if ("causal" not in problem.flags or t <= pos)
                        and (left is None or t >= pos - int(left)) and (right is None or t <= pos + int(right))]
                scores = np.array([scale * q[s, i, head] @ keys[t, kv] for t in seen])
                if cap is not None:
                    scores = float(cap) * np.tanh(scores / float(cap))
                top = scores.max()
                weights = np.exp(scores - top)
                o[s, head, i] = weights @ np.stack([values[t, kv] for t in seen]) / weights.sum()
                lse[s, head, i] = top + math.log(weights.sum())
    return o, lse


@pytest.mark.parametrize("case", [PAGED, CONTIGUOUS], ids=["paged", "contiguous"])
def test_the_check_passes_the_right_answer_and_names_what_is_wrong(case):
    problem = FAMILY.problem(*case)
    inputs = FAMILY.make_inputs(problem, "normal_x10", np, np.random.default_rng(7))
    lengths = inputs["cache_seqlens"] + int(problem.option("new_len", 0))
    assert lengths.min() >= max(1, problem.shape[2]) and lengths.max() <= int(problem.option("kv_len"))
    assert len(set(lengths.tolist())) > 1, "the sequences' lengths differ"
    if problem.option("new_len"):
        wrong = FAMILY.check(problem, inputs, {}, np)
        assert wrong is not None and "k_cache after the append" in wrong, "a cache nobody appended to fails"
    _append(problem, inputs)
    o, lse = _attend(problem, inputs)
    outputs = {"o": o.astype(np.float16 if problem.dtype == "float16" else np.float32), "lse": lse.astype(np.float32)}
    if problem.dtype == "bfloat16":
        from autosoft.dtypes import to_storage
        outputs["o"] = to_storage(o.astype(np.float32), "bfloat16", np)
    assert FAMILY.check(problem, inputs, outputs, np) is None
    last = problem.shape[0] - 1
    outputs["lse"][last, 0, 0] += 0.5
    wrong = FAMILY.check(problem, inputs, outputs, np)
    assert wrong is not None and wrong.startswith(f"sequence {last} (")


def test_pages_are_scattered_and_one_is_left_to_no_sequence():
    problem = FAMILY.problem(*PAGED)
    inputs = FAMILY.make_inputs(problem, "equal", np, np.random.default_rng(3))
    table = inputs["block_table"]
    assert table.shape == (3, 5) and len(set(table.ravel().tolist())) == 15
    assert inputs["k_cache"].shape[0] == 16, "a spare page in the pool"
    assert not np.array_equal(table.ravel(), np.sort(table.ravel())), "pages out of order"


@pytest.mark.parametrize("options, needle", [
    ({}, "needs --kv-len"),
    ({"kv_len": 64, "page_size": 12}, "--page-size 12"),
    ({"kv_len": 64, "new_len": 65}, "--new-len 65"),
    ({"kv_len": 4}, "at most --kv-len 4"),
    ({"kv_len": 64, "kv_heads": 3}, "multiple of the KV heads"),
])
def test_bad_buckets_say_what_to_do(options, needle):
    with pytest.raises(UserError, match=needle):
        FAMILY.problem("2,8,5,64", "float16", options)


def test_a_call_s_arrays_give_its_bucket():
    paged = FAMILY.problem_for({"q": (3, 2, 8, 64), "k_cache": (20, 16, 2, 64), "v_cache": (20, 16, 2, 64),
                                "cache_seqlens": (3,), "block_table": (3, 5), "k_new": (3, 3, 2, 64),
                                "v_new": (3, 3, 2, 64)}, "float16", {"causal": True})
    assert paged == FAMILY.problem("3,8,2,64", "float16",
                                   {"kv_len": 80, "kv_heads": 2, "page_size": 16, "new_len": 3, "causal": True})
    contiguous = FAMILY.problem_for({"q": (2, 1, 4, 128), "k_cache": (2, 33, 4, 128), "v_cache": (2, 33, 4, 128),
                                     "cache_seqlens": (2,)}, "bfloat16", {})
    assert contiguous.option("kv_len") == 33 and contiguous.option("page_size") is None
    with pytest.raises(ValueError, match="block_table must be"):
        FAMILY.problem_for({"q": (3, 2, 8, 64), "k_cache": (20, 16, 2, 64), "v_cache": (20, 16, 2, 64),
                            "cache_seqlens": (3,), "block_table": (2, 5)}, "float16", {})
    with pytest.raises(ValueError, match="k_new and v_new"):
        FAMILY.problem_for({"q": (2, 1, 4, 128), "k_cache": (2, 33, 4, 128), "v_cache": (2, 33, 4, 128),
                            "cache_seqlens": (2,), "k_new": (2, 1, 4, 128), "v_new": (2, 2, 4, 128)}, "bfloat16", {})


@pytest.mark.parametrize("arch", ["80", "90"])
def test_default_kernels_compile(arch):
    from autosoft.compile import compile_source

    target = Target.for_arch(arch)
    for case in (PAGED, CONTIGUOUS):
        problem = FAMILY.problem(*case)
        variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
        result = compile_source(variant.source, target.arch)
        assert result.ok, result.log[:2000]
        assert [launch.kernel for launch in variant.launches][-1] == "attention_fwd"


def test_the_function_refuses_bad_arguments_before_any_gpu_work():
    import autosoft

    torch = pytest.importorskip("torch")
    q = torch.zeros(2, 1, 8, 64, dtype=torch.float16)
    cache = torch.zeros(2, 40, 2, 64, dtype=torch.float16)
    lengths = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_new and v_new together"):
        autosoft.attention_kvcache(q, cache, cache, lengths, k_new=cache[:, :1])
    with pytest.raises(TypeError, match="window"):
        autosoft.attention_kvcache(q, cache, cache, lengths, window=5)
    with pytest.raises(ValueError, match="scale"):
        autosoft.attention_kvcache(q, cache, cache, lengths, scale=0.0)
    with pytest.raises(TypeError, match="CPU tensor"):
        autosoft.attention_kvcache(q, cache, cache, lengths)
