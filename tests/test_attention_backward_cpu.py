"""CPU tier for the attention backward: its float64 reference against torch's autograd, its
problems, search space and kernels (rendered and compiled), the Python function's errors."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import autosoft
from autosoft.compile import compile_source
from autosoft.dtypes import to_float64
from autosoft.families import get_family
from autosoft.families.attention import reference
from autosoft.families.attention_backward import reference_gradients
from autosoft.families.base import Target, build_variant, space_of

FAMILY = get_family("attention_backward")


def _torch_gradients(problem, inputs):
    """dq, dk, dv by torch's autograd of an explicit float64 attention (masks, cap, groups, lse)."""
    torch = pytest.importorskip("torch")
    b, h, n, d = problem.shape
    kv_heads, kv_len = FAMILY.kv(problem)
    q, k, v, do = (torch.tensor(to_float64(inputs[x], problem.dtype, np), requires_grad=x != "do")
                   for x in ("q", "k", "v", "do"))
    kk, vv = (x.repeat_interleave(h // kv_heads, dim=1) for x in (k, v))
    s = q @ kk.transpose(-1, -2) * float(inputs["scale"])
    cap = problem.option("softcap")
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    at = torch.arange(n)[:, None] + kv_len - n
    keys = torch.arange(kv_len)[None, :]
    hidden = torch.zeros(n, kv_len, dtype=torch.bool)
    if problem.option("causal"):
        hidden |= keys > at
    if problem.option("window_left") is not None:
        hidden |= keys < at - problem.option("window_left")
    if problem.option("window_right") is not None:
        hidden |= keys > at + problem.option("window_right")
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]).nan_to_num(0.0)
    o = p @ vv
    loss = (o * do).sum()
    if problem.option("lse_grad"):
        dlse = torch.tensor(inputs["dlse"].astype(np.float64))
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    loss.backward()
    return {"dq": q.grad.numpy(), "dk": k.grad.numpy(), "dv": v.grad.numpy()}


@pytest.mark.parametrize("shape, options", [
    ("1,4,9,32", {"causal": True, "kv_heads": 2}),
    ("2,2,7,32", {"kv_len": 12, "window_left": 3, "window_right": 1, "softcap": 2.0}),
    ("1,2,10,32", {"kv_len": 6, "causal": True, "lse_grad": True}),  # the first queries see no key
])
def test_reference_is_torch_autograd(shape, options):
    """The family's float64 reference gradients are torch's autograd of the forward, masks, softcap,
    grouped heads and an lse gradient included (the check that the GPU tier trusts)."""
    problem = FAMILY.problem(shape, "float16", options)
    inputs = FAMILY.make_inputs(problem, "normal", np, np.random.default_rng(0))
    inputs["o"], inputs["lse"] = reference(problem, inputs, np)  # the exact forward: float64, unrounded
    ref, _ = reference_gradients(problem, inputs, np)
    want = _torch_gradients(problem, inputs)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(ref[name], want[name], rtol=1e-9, atol=1e-9, err_msg=name)


@pytest.mark.parametrize("arch", ["80", "90"])
def test_default_kernels_compile(arch):
    """Each example's default (every head dim, mask, cap, dlse, ordered adds) compiles with NVRTC."""
    target = Target.for_arch(arch)
    for shape, dtype, options in FAMILY.examples:
        problem = FAMILY.problem(shape, dtype, options)
        variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
        result = compile_source(variant.source, arch)
        assert result.ok, f"{variant.name}: {result.log[:2000]}"


def test_deterministic_problems_take_ordered_adds_only():
    target = Target.for_arch("90")
    for shape, default_add in (("2,8,1500,64", "ordered"), ("2,8,1500,128", "writer_ordered")):
        problem = FAMILY.problem(shape, "bfloat16", {"causal": True, "deterministic": True})
        default = FAMILY.default_params(problem, target)
        assert default["dq_add"] == default_add
        assert not FAMILY.is_valid(problem, target, {**default, "dq_add": "atomic"})
        assert not FAMILY.is_valid(problem, target, {**default, "dq_add": "writer"})
        seeds = FAMILY.seed_params(problem, target)
        assert all(p["dq_add"] in ("ordered", "writer_ordered") for p in seeds)
        if problem.shape[3] == 128:  # at D = 64, 128 queries a step leave the writer no room with two stages
            assert {p["dq_add"] for p in seeds} == {"ordered", "writer_ordered"}


@pytest.mark.parametrize("shape, options, default_add, order, seed_add", [
    ("4,16,4096,128", {}, "writer", "keys", "atomic"),
    ("4,16,4096,128", {"causal": True}, "writer", "keys", "atomic"),
    ("2,32,4096,128", {"causal": True, "kv_heads": 8}, "writer", "heads", "atomic"),  # grouped heads
    ("4,16,4096,128", {"causal": True, "deterministic": True}, "writer_ordered", "heads", "ordered"),
    ("2,8,60,64", {"causal": True}, "atomic", "heads", "writer"),  # too few queries for 128 a step
    ("2,8,60,64", {"causal": True, "deterministic": True}, "writer_ordered", "heads", "ordered")])
def test_the_dq_writer_is_the_default_at_64_queries_a_step_from_head_dim_128_and_when_ordered(
        shape, options, default_add, order, seed_add):
    """At 64 queries a step the writer warp adds dQ by default where a consumer's dQ tile is 128
    wide or the adds must be ordered (the consumers' atomics at D = 64 otherwise), and a causal
    mask walks key tiles slowest except under the unordered writer without grouped query heads;
    the first seed adds dQ the
    other way. At D = 128 with two consumers the writer's two dQ tiles leave no room for a second
    dS^T buffer, so it takes one; the variant is named for its adds and holds the bulk reduce
    only with the writer."""
    target = Target.for_arch("90")
    problem = FAMILY.problem(shape, "bfloat16", options)
    default = FAMILY.default_params(problem, target)
    assert default["engine"] == "wgmma" and default["block_m"] == 64
    assert (default["dq_add"], default["tile_order"]) == (default_add, order)
    first = FAMILY.seed_params(problem, target)[0]
    assert first["dq_add"] == seed_add
    if problem.shape[3] == 128:
        assert (default["block_n"], default["ds_buffers"]) == (128, 1)
    for params in (default, first):
        variant = build_variant(FAMILY, problem, params, target)
        by_writer = str(params["dq_add"]).startswith("writer")
        suffix = {"atomic": "", "ordered": "_ordered", "writer": "_dqw", "writer_ordered": "_dqw_ordered"}
        assert variant.name.endswith(suffix[str(params["dq_add"])])
        assert ("cp.reduce.async.bulk" in variant.source) == by_writer
        assert ("red.global.add" in variant.source) != by_writer


@pytest.mark.parametrize("shape, options", [("2,16,8192,64", {"causal": True}), ("16,16,1024,64", {"causal": True}),
                                            ("2,16,8192,64", {}), ("2,8,1500,64", {"causal": True, "deterministic": True})])
def test_128_queries_a_step_with_the_consumers_adds_is_the_default_at_head_dim_64(shape, options):
    """At D = 64 the default takes 128 queries a step, dQ added by the consumers (atomics, or in
    turn where ordered), named _m128, with Q and dO in 128-row boxes; the first seed is the same
    point at 64 queries a step, which keeps its old name."""
    target = Target.for_arch("90")
    problem = FAMILY.problem(shape, "bfloat16", options)
    default = FAMILY.default_params(problem, target)
    assert default["engine"] == "wgmma" and default["block_m"] == 128
    assert default["dq_add"] == ("ordered" if "deterministic" in problem.flags else "atomic")
    first = FAMILY.seed_params(problem, target)[0]
    assert first == {**default, "block_m": 64}
    wide, narrow = (build_variant(FAMILY, problem, p, target) for p in (default, first))
    assert wide.name.endswith("_m128") and not narrow.name.endswith("_m128")
    assert wide.name[:-len("_m128")] == narrow.name
    q_map = wide.launches[1].args[0]
    assert q_map.box[2] == 128 and narrow.launches[1].args[0].box[2] == 64
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in wide.source
    assert "m64n128k16" not in narrow.source


def test_128_queries_a_step_is_refused_past_head_dim_64_and_for_few_queries():
    target = Target.for_arch("90")
    for shape, why in (("4,16,4096,128", "only at D = 64"), ("1,8,64,64", "twice the queries")):
        problem = FAMILY.problem(shape, "bfloat16", {})
        params = {**FAMILY.default_params(problem, target), "block_m": 128}
        assert not FAMILY.is_valid(problem, target, params)
        broken = space_of(FAMILY).violations(params, FAMILY.problem_values(problem, target))
        assert any(why in text for text in broken), broken


def test_launches_name_dlse_only_with_an_lse_gradient():
    target = Target.for_arch("90")
    plain = FAMILY.problem("1,2,100,64", "float16", {})
    with_grad = FAMILY.problem("1,2,100,64", "float16", {"lse_grad": True})
    for problem, named in ((plain, False), (with_grad, True)):
        variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
        assert ("dlse" in variant.launches[0].args) is named
        assert ("dlse[row]" in variant.source) is named
        assert [launch.kernel for launch in variant.launches] == ["attention_bwd_prep", "attention_bwd",
                                                                  "attention_bwd_dq"]


def test_function_refuses_mismatched_arrays_before_any_gpu_work():
    torch = pytest.importorskip("torch")
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(TypeError, match="autosoft.attention_backward"):
        autosoft.attention_backward(q, q, q, q, q, lse, window=5)
    with pytest.raises(ValueError, match="scale"):
        autosoft.attention_backward(q, q, q, q, q, lse, scale=-1.0)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("shape, options, block_n, dq_add, ds_buffers, block_m, stages", [
    ("4,16,4096,128", {}, 128, "atomic", 1, 64, 2), ("4,16,4096,128", {}, 128, "atomic", 2, 64, 2), ("4,16,4096,128", {}, 64, "atomic", 1, 64, 2),
    ("2,16,8192,64", {"causal": True}, 128, "atomic", 2, 64, 2), ("2,16,8192,64", {"causal": True}, 128, "ordered", 1, 64, 2),
    ("4,16,4096,128", {}, 128, "writer", 1, 64, 2), ("4,16,4096,128", {"deterministic": True}, 64, "writer_ordered", 2, 64, 2),
    ("2,16,8192,64", {"causal": True}, 128, "writer", 2, 64, 2), ("2,16,8192,64", {"causal": True}, 64, "writer", 2, 64, 2),
    ("2,16,8192,64", {"causal": True, "deterministic": True}, 128, "writer_ordered", 2, 64, 2),
    # 128 queries a step: every way of adding dQ, one and two consumers, one and two dS^T buffers and stages
    ("2,16,8192,64", {"causal": True}, 128, "atomic", 2, 128, 2), ("2,16,8192,64", {"kv_heads": 4}, 128, "ordered", 1, 128, 2),
    ("2,16,8192,64", {"causal": True}, 128, "writer", 1, 128, 1), ("2,16,8192,64", {"kv_heads": 4}, 128, "writer_ordered", 1, 128, 1),
    ("2,16,8192,64", {"causal": True, "kv_heads": 4}, 64, "atomic", 1, 128, 1),
    ("2,16,8192,64", {"causal": True}, 64, "writer_ordered", 2, 128, 2),
    ("2,16,2048,64", {"window_left": 256, "window_right": 0, "softcap": 30.0}, 128, "atomic", 2, 128, 2)])
def test_wgmma_variants_build_with_nvcc_without_spilling(tmp_path, shape, options, block_n, dq_add, ds_buffers,
                                                         block_m, stages):
    """Two consumers at D = 128 hold dK and dV of their keys in registers (D floats a thread):
    anything else held for a whole step (each query's lse and Delta once did) spills; so does a
    producer warp that needs more than the 24 registers it keeps (the dQ writer's loop among them).
    At 128 queries a step S^T and dP^T take 64 floats each beside dK and dV (P^T is in shared
    memory for that): every way of adding dQ, one and two consumers, masks and a cap."""
    problem = FAMILY.problem(shape, "bfloat16", options)
    params = {"engine": "wgmma", "block_m": block_m, "block_n": block_n, "stages": stages, "dq_add": dq_add,
              "ds_buffers": ds_buffers, "tile_order": "heads" if options.get("causal") else "keys"}
    assert FAMILY.is_valid(problem, Target.for_arch("90"), params)
    variant = build_variant(FAMILY, problem, params, Target.for_arch("90"))
    path = tmp_path / "k.cu"
    path.write_text(variant.source)
    result = subprocess.run([shutil.which("nvcc"), "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                             "-o", str(tmp_path / "k.cubin"), str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention_bwd" in result.stderr
    assert "bytes spill stores" not in result.stderr.replace(" 0 bytes spill stores", ""), result.stderr[-2000:]
