"""CPU tier for attention over packed sequences: the bucket a call is, the inputs (lengths at the
edges) and the check against an attention written here independently in NumPy; the default
kernels compile."""
from __future__ import annotations

import math

import numpy as np
import pytest

from autosoft.dtypes import to_float64, to_storage
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant

FAMILY = get_family("attention_varlen")
CASE = ("4,4,40,64", "float16", {"kv_heads": 2, "kv_len": 57, "causal": True, "window_left": 30})


def _attend(problem, inputs):
    """o (total_q, Hq, D) and lse (total_q, Hq) in float64, query by query, sequence by sequence."""
    _, h, _, d = problem.shape
    kv_heads = int(problem.option("kv_heads", h))
    left = problem.option("window_left")
    q, k, v = (to_float64(inputs[n], problem.dtype, np) for n in ("q", "k", "v"))
    cu_q, cu_k = inputs["cu_seqlens_q"], inputs["cu_seqlens_k"]
    o, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    for s in range(len(cu_q) - 1):
        nq, nk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(nq):
            pos = nk - nq + i
            seen = [t for t in range(nk) if t <= pos and (left is None or t >= pos - int(left))]
            for head in range(h):
                row = cu_q[s] + i
                if not seen:
                    o[row, head], lse[row, head] = 0.0, -math.inf
                    continue
                kv = head // (h // kv_heads)
                scores = np.array([float(inputs["scale"]) * q[row, head] @ k[cu_k[s] + t, kv] for t in seen])
                weights = np.exp(scores - scores.max())
                o[row, head] = weights @ np.stack([v[cu_k[s] + t, kv] for t in seen]) / weights.sum()
                lse[row, head] = scores.max() + math.log(weights.sum())
    return o, lse


def test_the_check_passes_the_right_answer_and_names_the_wrong_sequence():
    problem = FAMILY.problem(*CASE)
    inputs = FAMILY.make_inputs(problem, "normal_x10", np, np.random.default_rng(5))
    queries, keys = np.diff(inputs["cu_seqlens_q"]), np.diff(inputs["cu_seqlens_k"])
    assert queries[:2].tolist() == [1, 40] and keys[:2].tolist() == [57, 1], "the edges come first"
    o, lse = _attend(problem, inputs)
    outputs = {"o": to_storage(o.astype(np.float32), "float16", np), "lse": lse.astype(np.float32)}
    assert FAMILY.check(problem, inputs, outputs, np) is None
    outputs["o"][int(inputs["cu_seqlens_q"][2]), 1] += 1
    wrong = FAMILY.check(problem, inputs, outputs, np)
    assert wrong is not None and wrong.startswith("sequence 2 (")


def test_a_call_s_arrays_and_bounds_give_its_bucket():
    shapes = {"q": (70, 8, 128), "k": (90, 2, 128), "v": (90, 2, 128), "cu_seqlens_q": (4,), "cu_seqlens_k": (4,)}
    problem = FAMILY.problem_for(shapes, "bfloat16", {"causal": True, "max_seqlen_q": 64, "max_seqlen_k": 80})
    assert problem == FAMILY.problem("3,8,64,128", "bfloat16", {"kv_heads": 2, "kv_len": 80, "causal": True})
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        FAMILY.problem_for({**shapes, "cu_seqlens_k": (5,)}, "bfloat16", {"max_seqlen_q": 64, "max_seqlen_k": 80})
    with pytest.raises(ValueError, match="multiple of k.s and v.s 3"):
        FAMILY.problem_for({**shapes, "k": (90, 3, 128), "v": (90, 3, 128)}, "bfloat16",
                           {"max_seqlen_q": 64, "max_seqlen_k": 80})


def test_the_function_refuses_bad_bounds_before_any_gpu_work():
    import autosoft

    torch = pytest.importorskip("torch")
    q = torch.zeros(10, 4, 64, dtype=torch.float16)
    offsets = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="max_seqlen_q must be an int >= 1"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 0, 6)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 6, 6.5)
    with pytest.raises(TypeError, match="CPU tensor"):
        autosoft.attention_varlen(q, q, q, offsets, offsets, 6, 6)


@pytest.mark.parametrize("arch", ["80", "90"])
def test_default_kernels_compile(arch):
    from autosoft.compile import compile_source

    target = Target.for_arch(arch)
    problem = FAMILY.problem(*CASE)
    variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
    assert "if (m0 >= ROWS) return;" in variant.source
    result = compile_source(variant.source, target.arch)
    assert result.ok, result.log[:2000]
