"""The topk_softmax family (the MoE router) on the CPU tier: problems and their argument errors, the
search space for every expert count, rendering and NVRTC compilation of each selection strategy and
form, the float64 reference against torch's composition (ties to the lower index), and `check`
(NumPy standing in for CuPy) accepting the reference while rejecting wrong choices and weights."""
from __future__ import annotations

import numpy as np
import pytest

import autosoft
from autosoft.compile import compile_source
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant, space_of
from autosoft.families.topk_softmax import check_routing, reference_routing

FAMILY = get_family("topk_softmax")
EXPERTS = (8, 16, 60, 64, 128, 160, 256, 384, 512)
DEEPSEEK = {"k": 8, "renormalize": True, "n_group": 8, "topk_group": 4, "sigmoid": True, "bias": True}
FORMS = {
    "plain": {"k": 4, "renormalize": True},
    "plain_softmax_sum": {"k": 4},
    "grouped_sigmoid_bias": {"k": 4, "renormalize": True, "n_group": 4, "topk_group": 2, "sigmoid": True, "bias": True},
    "grouped_softmax": {"k": 4, "n_group": 4, "topk_group": 2},
}



def point(**changes) -> dict:
    """A point of the space: 128 threads, four a token, 16-byte loads, bitonic lists, 16-bit or
    64-bit keys, every expert in the list, no launch bound, with `changes`."""
    return {"threads": 128, "row_threads": 4, "vec": 8, "select": "bitonic", "short_keys": False, "compact": False,
            "full_occupancy": False, **changes}

# --- problems and argument errors ----------------------------------------------------------------

def test_the_options_are_part_of_the_key():
    problem = FAMILY.problem("4096x256", "bfloat16", DEEPSEEK)
    assert problem.shape == (4096, 256)
    assert problem.shape_text == "4096x256+bias+k=8+n_group=8+renormalize+sigmoid+topk_group=4"
    assert FAMILY.parse_problem(problem.shape_text, "bfloat16") == problem
    assert FAMILY.problem("4x60", "float32", {"k": 2}).shape_text == "4x60+k=2"


@pytest.mark.parametrize("shape, options, message", [
    ("4x8", {}, "needs --k"),
    ("4x8", {"k": 0}, "outside 1 <= k <= 8"),
    ("4x8", {"k": 9}, "outside 1 <= k <= 8"),
    ("4x60", {"k": 2, "n_group": 7, "topk_group": 1}, "must divide the 60 experts"),
    ("4x256", {"k": 2, "n_group": 64, "topk_group": 1}, "at most 32"),
    ("4x256", {"k": 2, "n_group": 8, "topk_group": 9}, "outside 1 <= topk_group <= n_group=8"),
    ("4x256", {"k": 65, "n_group": 8, "topk_group": 2}, "more than the 64 experts"),
    ("4x16", {"k": 2, "n_group": 16, "topk_group": 4, "bias": True}, "two best experts"),
    ("4x4096", {"k": 2}, "at most 2048 experts"),
])
def test_bad_problems_say_what_is_wrong_in_one_line(shape, options, message):
    with pytest.raises(UserError, match=message) as caught:
        FAMILY.problem(shape, "float32", options)
    assert "\n" not in str(caught.value)


def test_problem_for_flattens_tokens_and_shapes_the_outputs():
    problem = FAMILY.problem_for({"logits": (2, 3, 60)}, "bfloat16", {"k": 6, "renormalize": True})
    assert problem == FAMILY.problem("6x60", "bfloat16", {"k": 6, "renormalize": True})
    assert FAMILY.caller_outputs({"logits": (2, 3, 60)}, "bfloat16", {"k": 6}) == {
        "weights": ((2, 3, 6), "float32"), "indices": ((2, 3, 6), "int32")}
    with pytest.raises(ValueError, match="k=7 is outside"):
        FAMILY.problem_for({"logits": (5, 6)}, "float32", {"k": 7})
    with pytest.raises(ValueError, match="scalar"):
        FAMILY.problem_for({"logits": ()}, "float32", {"k": 1})


def test_the_python_function_checks_its_arguments_before_any_kernel():
    logits = np.zeros((4, 64), dtype=np.float32)
    call = FAMILY.python_call(logits, 2)
    assert call.options == {"k": 2, "renormalize": True, "n_group": 1, "topk_group": 1, "sigmoid": False}
    assert call.arrays[1] is None and call.scalars == {"scale": np.float32(1.0)}
    assert call.returns == ("weights", "indices")
    grouped = FAMILY.python_call(logits, 8, n_group=8, topk_group=4, scoring="sigmoid", routed_scaling_factor=2.5)
    assert grouped.options["sigmoid"] and grouped.options["n_group"] == 8
    assert grouped.scalars["scale"] == np.float32(2.5)
    with pytest.raises(TypeError, match="k must be an int"):
        FAMILY.python_call(logits, True)
    with pytest.raises(TypeError, match="k must be an int"):
        FAMILY.python_call(logits, 2.0)
    with pytest.raises(ValueError, match="scoring must be 'softmax' or 'sigmoid'"):
        FAMILY.python_call(logits, 2, scoring="relu")
    with pytest.raises(ValueError, match="n_group and topk_group together"):
        FAMILY.python_call(logits, 2, n_group=8)
    with pytest.raises(ValueError, match="routed_scaling_factor must be finite"):
        FAMILY.python_call(logits, 2, routed_scaling_factor=float("nan"))


def test_the_bias_is_an_input_that_sets_the_bias_option():
    """Given, the bias is the kernel's second array (the option `bias` follows it, whatever the
    options say); absent, a null pointer and no bias."""
    assert FAMILY.problem_for({"logits": (4, 64), "bias": (64,)}, "float32", {"k": 2}).option("bias")
    assert not FAMILY.problem_for({"logits": (4, 64)}, "float32", {"k": 2, "bias": True}).option("bias")
    with pytest.raises(ValueError, match="bias must be a vector of the 64 experts, got shape \\(63,\\)"):
        FAMILY.problem_for({"logits": (4, 64), "bias": (63,)}, "float32", {"k": 2})


class _CupyLike:
    """Taken for a CuPy array by the array layer's classification (its module's name)."""


_CupyLike.__module__ = "cupy._core.core"


def test_a_host_bias_is_refused_and_an_absent_one_passes_the_array_layer():
    from autosoft.arrays import as_cupy

    logits = _CupyLike()
    with pytest.raises(TypeError, match="bias is a host \\(NumPy\\) array"):
        as_cupy(FAMILY, [logits, np.zeros(64, dtype=np.float32)])
    assert as_cupy(FAMILY, [logits, None]) == [logits, None]  # an optional input not given


def test_a_torch_bias_of_another_dtype_or_shape_is_a_one_line_error():
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    logits = torch.empty(4, 64, device="meta")
    for bias, error, message in ((torch.empty(64, device="meta", dtype=torch.float16), TypeError,
                                  r"^autosoft\.topk_softmax: bias must be float32, got torch\.float16$"),
                                 (torch.empty(64, device="meta", dtype=torch.int32), TypeError,
                                  r"^autosoft\.topk_softmax: bias must be float32, got torch\.int32$"),
                                 (torch.empty(63, device="meta"), ValueError, r"bias must be a vector of the 64"),
                                 (torch.empty(64), TypeError, r"bias is a CPU tensor")):
        with pytest.raises(error, match=message):
            torch.ops.autosoft.topk_softmax(logits, bias, 1.0, 2, True, 8, 2, False)
    with pytest.raises(RuntimeError, match="no backward"):
        autosoft.topk_softmax(torch.empty(4, 64, device="meta", requires_grad=True), 2)


@pytest.mark.parametrize("bias", [False, True])
def test_the_operator_gives_float32_weights_and_int32_indices(bias):
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    logits = torch.empty(2, 3, 64, device="meta", dtype=torch.bfloat16)
    weights, indices = torch.ops.autosoft.topk_softmax(logits, torch.empty(64, device="meta") if bias else None,
                                                       2.5, 6, True, 8, 4, True)
    assert (weights.shape, weights.dtype, indices.shape, indices.dtype) == \
        ((2, 3, 6), torch.float32, (2, 3, 6), torch.int32)


def test_torch_compile_fullgraph_traces_the_router_as_its_operator(no_kernels):
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lambda x, b: autosoft.topk_softmax(x, 8, n_group=8, topk_group=4, scoring="sigmoid",
                                                                bias=b, routed_scaling_factor=2.5),
                             backend=backend, fullgraph=True)
    with FakeTensorMode():
        weights, indices = compiled(torch.empty(5, 256, device="cuda", dtype=torch.bfloat16),
                                    torch.empty(256, device="cuda"))
        assert (weights.shape, weights.dtype, indices.dtype) == ((5, 8), torch.float32, torch.int32)
    (node,) = [n for n in graphs[0].graph.nodes if "autosoft" in str(n.target)]
    assert str(node.target) == "autosoft.topk_softmax.default" and node.args[2:] == (2.5, 8, True, 8, 4, True)
    torch._dynamo.reset()


# --- the search space ------------------------------------------------------------------------------

@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_expert_count_has_a_valid_default_and_seeds(experts, dtype):
    target = Target.for_arch("90")
    for k in (1, min(16, experts), experts):
        problem = FAMILY.problem(f"4096x{experts}", dtype, {"k": k, "renormalize": True})
        default = FAMILY.default_params(problem, target)
        assert FAMILY.is_valid(problem, target, default)
        assert experts % default["vec"] == 0
        seeds = FAMILY.seed_params(problem, target)
        assert {s["select"] for s in [default, *seeds]} == {"rescan", "sorted", "bitonic"}, \
            "every strategy is measured first"


def test_constraints_keep_rows_on_vector_boundaries_and_experts_in_registers():
    target = Target.for_arch("90")
    space = space_of(FAMILY)
    sixty = FAMILY.problem("128x60", "bfloat16", {"k": 2})
    valid = space.valid_points(FAMILY.problem_values(sixty, target))
    assert valid and {p["vec"] for p in valid} == {1, 2, 4}, "60 experts: no vector of 8 fits a row"
    wide = FAMILY.problem("128x512", "float32", {"k": 8})
    assert not FAMILY.is_valid(wide, target, point(row_threads=1, vec=4, select="rescan")), \
        "512 experts on one thread would spill"
    assert not FAMILY.is_valid(wide, target, point(threads=64, row_threads=32, select="rescan")), \
        "32 bytes is no load"
    tiny = FAMILY.problem("128x8", "float32", {"k": 1})
    assert not FAMILY.is_valid(tiny, target, point(vec=4, select="rescan")), \
        "two vectors cannot feed four threads"


def test_large_token_counts_get_the_bitonic_default_with_32_bit_keys():
    """Plain bf16/fp16: a key is the 16-bit logit and its index in 32 bits, exactly; fp32 logits
    or fp32 scores (grouped) need 64 (key_bits), and the default takes short keys there: the
    ordered fp32 value with its low bits holding the index, checked after the rounds. The
    default sorts each thread's keys with bitonic networks and keeps a thread to at most 64
    experts."""
    target = Target.for_arch("90")
    for shape, dtype, options, bits in (("65536x128", "bfloat16", {"k": 8, "renormalize": True}, 32),
                                        ("65536x384", "float16", {"k": 8}, 32),
                                        ("65536x60", "float32", {"k": 4}, 64),
                                        ("65536x256", "bfloat16", DEEPSEEK, 64)):
        problem = FAMILY.problem(shape, dtype, options)
        assert FAMILY.problem_values(problem, target)["key_bits"] == bits, shape
        default = FAMILY.default_params(problem, target)
        assert default["select"] == "bitonic" and default["short_keys"] == (bits == 64), shape
        values = space_of(FAMILY).evaluate(default, FAMILY.problem_values(problem, target))
        assert values["experts_per_thread"] <= 64, (shape, default)
        assert values["experts_per_thread"] * 2 > 64 or default["row_threads"] == 1, \
            "no more threads a token than that bound needs"
        source = build_variant(FAMILY, problem, default, target).source
        assert "typedef unsigned int rkey_t;" in source, shape
        assert ("IDX_MASK" in source) == (bits == 64), shape


def test_short_keys_hold_the_index_in_the_fewest_low_bits_and_only_for_fp32_values():
    """The index takes the bits of E - 1 (the rest keep the value, so fewer near-ties fall back);
    16-bit logits already make exact 32-bit keys, so short keys are no choice there; with fp32
    values the seeds measure 64-bit keys too."""
    target = Target.for_arch("90")
    for experts, mask in ((8, 0x7), (60, 0x3F), (256, 0xFF), (384, 0x1FF), (2048, 0x7FF)):
        problem = FAMILY.problem(f"4x{experts}", "float32", {"k": 2})
        source = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target).source
        assert f"constexpr unsigned int IDX_MASK = {mask}u;" in source, experts
    plain = FAMILY.problem("64x256", "bfloat16", {"k": 8})
    assert FAMILY.is_valid(plain, target, point())
    assert not FAMILY.is_valid(plain, target, point(short_keys=True))
    grouped = FAMILY.problem("64x256", "bfloat16", DEEPSEEK)
    assert FAMILY.is_valid(grouped, target, point(short_keys=True))
    values = space_of(FAMILY).evaluate(point(short_keys=True), FAMILY.problem_values(grouped, target))
    assert values["key_words"] == 1 and values["list_len"] == 8
    seeds = FAMILY.seed_params(grouped, target)
    assert any(not s["short_keys"] for s in seeds[:24]), "a short tune measures the 64-bit keys too"
    assert all(s["short_keys"] for s in seeds[:12]), "short keys first"


def test_stores_and_lists_take_the_widths_that_fit():
    """out_vec divides both k and the slots of a thread (a store is all in or all out of the
    row); a bitonic list is the power of two at or above min(k, experts per thread)."""
    target = Target.for_arch("90")
    space = space_of(FAMILY)
    for k, row_threads, out_vec in ((8, 2, 4), (8, 4, 2), (6, 4, 2), (6, 2, 1), (8, 16, 1), (16, 4, 4)):
        problem = FAMILY.problem("64x128", "bfloat16", {"k": k})
        params = point(row_threads=row_threads)
        values = space.evaluate(params, FAMILY.problem_values(problem, target))
        assert values["out_vec"] == out_vec, (k, row_threads)
        assert values["list_len"] == {6: 8, 8: 8, 16: 16}[k]
    grouped = FAMILY.problem("64x160", "bfloat16", {"k": 6, "n_group": 8, "topk_group": 3})
    assert not FAMILY.is_valid(grouped, target, point()), "groups of 20 experts: a vector of 8 would straddle two"
    assert FAMILY.is_valid(grouped, target, point(vec=4))


# --- rendering and compiling -------------------------------------------------------------------------

@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("select", ["rescan", "sorted", "bitonic"])
@pytest.mark.parametrize("arch", ["90", "80"])
def test_each_strategy_and_form_compiles(form, select, arch):
    """The grouped forms (fp32 scores) with short keys on sm_90 and 64-bit keys on sm_80: both
    selections of every strategy, no compile more."""
    target = Target.for_arch(arch)
    problem = FAMILY.problem("1000x160", "bfloat16", FORMS[form])
    short_keys = form.startswith("grouped") and arch == "90"
    params = point(row_threads=8, vec=4, select=select, short_keys=short_keys)
    variant = build_variant(FAMILY, problem, params, target)
    assert variant.name == f"topk_softmax_bf16_t128_g8_v4_{select}" + ("_k32" if short_keys else "")
    assert ("const float* __restrict__ bias" in variant.source) == bool(FORMS[form].get("bias"))
    assert ("if (__any_sync(mask, clash))" in variant.source) == short_keys, "short keys check their choice"
    result = compile_source(variant.source, arch)
    assert result.ok, result.log[:2000]


def test_the_small_sorting_networks_sort_every_input():
    """The four- and eight-key networks the bitonic lists sort chunks with, read from a rendered
    variant and run on every 0-1 input (a comparator network that sorts those sorts all)."""
    import itertools
    import re

    problem = FAMILY.problem("64x256", "bfloat16", {"k": 8})
    params = point()
    source = build_variant(FAMILY, problem, params, Target.for_arch("90")).source
    for n, size in ((4, 5), (8, 19)):
        body = source.split(f"void sort_chunk(rkey_t (&a)[{n}]) {{")[1].split("}")[0]
        network = [(int(i), int(j)) for i, j in re.findall(r"exchange\(a\[(\d+)\], a\[(\d+)\]\)", body)]
        assert len(network) == size
        for bits in itertools.product((0, 1), repeat=n):
            a = list(bits)
            for i, j in network:  # exchange(a[i], a[j]) puts the larger first
                a[i], a[j] = max(a[i], a[j]), min(a[i], a[j])
            assert a == sorted(bits, reverse=True), (n, bits)


def test_a_full_sm_is_asked_of_launch_bounds_for_16_bit_keys_only():
    """full_occupancy: __launch_bounds__ with the blocks that fill an SM's threads (2048 on sm_90,
    1536 on sm_89), so that ptxas keeps a thread within 32 registers; a 16-bit-key choice only,
    and among the first seeds."""
    problem = FAMILY.problem("64x256", "bfloat16", {"k": 8, "renormalize": True})
    full = point(full_occupancy=True)
    for arch, blocks in (("90", 16), ("89", 12)):
        variant = build_variant(FAMILY, problem, full, Target.for_arch(arch))
        assert "__launch_bounds__(THREADS, %d)" % blocks in variant.source, arch
        assert variant.name == "topk_softmax_bf16_t128_g4_v8_bitonic_full"
    assert "__launch_bounds__(THREADS)\n" in build_variant(FAMILY, problem, point(), Target.for_arch("90")).source
    result = compile_source(build_variant(FAMILY, problem, full, Target.for_arch("80")).source, "80")
    assert result.ok, result.log[:2000]
    target = Target.for_arch("90")
    grouped = FAMILY.problem("64x256", "bfloat16", DEEPSEEK)
    assert not FAMILY.is_valid(grouped, target, point(short_keys=True, full_occupancy=True)), \
        "fp32 values spill in 32 registers"
    assert any(s["full_occupancy"] for s in FAMILY.seed_params(problem, target)[:4])
    assert not any(s["full_occupancy"] for s in FAMILY.seed_params(grouped, target))


def test_compact_lists_take_the_kept_groups_vectors_alone():
    """compact: where every lane's vector j lies in one group (a group a whole number of rows of
    RT vectors), each thread packs its kept vectors' keys through its own shared-memory column and
    sorts topk_group / n_group of its keys; short keys, bitonic or sorted lists, 16-byte packs."""
    target = Target.for_arch("90")
    values = FAMILY.problem_values(FAMILY.problem("64x256", "bfloat16", DEEPSEEK), target)
    problem = FAMILY.problem("64x256", "bfloat16", DEEPSEEK)
    packed = point(short_keys=True, compact=True)
    assert values["topk_group"] == 4
    assert space_of(FAMILY).evaluate(packed, values)["list_experts"] == 32  # 4 of 8 groups of 64 a thread
    assert space_of(FAMILY).evaluate(point(short_keys=True), values)["list_experts"] == 64
    assert not FAMILY.is_valid(problem, target, point(short_keys=True, compact=True, row_threads=8)), \
        "eight threads: a row of vectors spans two groups"
    assert not FAMILY.is_valid(problem, target, point(short_keys=True, compact=True, select="rescan"))
    assert not FAMILY.is_valid(problem, target, point(compact=True)), "64-bit keys are not packed"
    assert not FAMILY.is_valid(problem, target, point(short_keys=True, compact=True, threads=1024)), "64 KiB"
    assert not FAMILY.is_valid(FAMILY.problem("64x256", "bfloat16", {"k": 8}), target, point(compact=True))
    variant = build_variant(FAMILY, problem, packed, target)
    assert variant.name.endswith("_bitonic_k32_packed")
    assert "__shared__ uint4 packed[LE / 4][THREADS];" in variant.source
    assert "constexpr int LE = KV * VEC;" in variant.source
    assert any(s["compact"] for s in FAMILY.seed_params(problem, target)[:4])
    result = compile_source(build_variant(FAMILY, problem, packed, Target.for_arch("80")).source, "80")
    assert result.ok, result.log[:2000]


@pytest.mark.parametrize("select", ["rescan", "bitonic"])
def test_fp32_logits_with_short_keys_compile(select):
    """The plain form of fp32 logits with short keys reads its picks' logits again (the key no
    longer holds them) and, not renormalised, takes the softmax sum from the largest of them."""
    problem = FAMILY.problem("1000x160", "float32", {"k": 6})
    params = point(row_threads=8, vec=4, select=select, short_keys=True)
    variant = build_variant(FAMILY, problem, params, Target.for_arch("80"))
    assert "to_f32(row[i_slot[0]])" in variant.source and "key_value(best)" not in variant.source
    result = compile_source(variant.source, "80")
    assert result.ok, result.log[:2000]


@pytest.mark.parametrize("shape, options", [("3x512", {"k": 512}), ("9x384", {"k": 16}), ("5x8", {"k": 8}),
                                            ("2x256", DEEPSEEK)])
def test_the_extremes_of_k_and_experts_compile(shape, options):
    target = Target.for_arch("90")
    problem = FAMILY.problem(shape, "float16", options)
    # each selection among the default and the first seeds, once: a second rescan of the largest k
    # costs ptxas as long as the first and proves nothing the first did not
    points: dict[str, dict] = {}
    for params in [FAMILY.default_params(problem, target)] + FAMILY.seed_params(problem, target)[:3]:
        points.setdefault(params["select"], params)
    for params in points.values():
        variant = build_variant(FAMILY, problem, params, target)
        result = compile_source(variant.source, "90")
        assert result.ok, f"{variant.name}: {result.log[:2000]}"


# --- the reference and the check -------------------------------------------------------------------

def _torch_routing(problem, inputs):
    """The float64 torch composition, ties to the lower index (a stable descending sort)."""
    torch = pytest.importorskip("torch")
    from autosoft.dtypes import to_float64

    x = torch.from_numpy(to_float64(inputs["logits"], problem.dtype, np))
    k = int(problem.option("k"))
    if not (problem.option("sigmoid") or problem.option("bias") or int(problem.option("n_group", 1)) > 1):
        index = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
        weights = torch.softmax(x, dim=-1).gather(1, index)
    else:
        scores = torch.sigmoid(x) if problem.option("sigmoid") else torch.softmax(x, dim=-1)
        keys = scores + (torch.from_numpy(np.asarray(inputs["bias"], dtype=np.float64)) if problem.option("bias") else 0)
        n_group, topk_group = int(problem.option("n_group", 1)), int(problem.option("topk_group", 1))
        grouped = keys.view(x.shape[0], n_group, -1)
        group = grouped.topk(2, dim=-1).values.sum(-1) if problem.option("bias") else grouped.max(-1).values
        kept_groups = torch.sort(group, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros_like(group).scatter_(1, kept_groups, 1.0).repeat_interleave(x.shape[1] // n_group, 1)
        index = torch.sort(keys.masked_fill(mask == 0, float("-inf")), dim=-1, descending=True, stable=True).indices[:, :k]
        weights = scores.gather(1, index)
    if problem.option("renormalize"):
        weights = weights / weights.sum(-1, keepdim=True)
    return index.numpy(), (weights * float(inputs["scale"])).numpy()


PROBLEMS = [("1x8", "float32", {"k": 1}), ("1x8", "float32", {"k": 8}), ("37x60", "bfloat16", {"k": 6}),
            ("37x160", "float16", {"k": 160, "renormalize": True}), ("64x384", "float32", {"k": 16}),
            ("16x512", "bfloat16", {"k": 8, "renormalize": True}), ("64x256", "bfloat16", DEEPSEEK),
            ("64x160", "float32", {"k": 6, "n_group": 8, "topk_group": 3}),
            ("64x64", "float16", {"k": 4, "sigmoid": True, "bias": True, "renormalize": True})]


@pytest.mark.parametrize("shape, dtype, options", PROBLEMS)
def test_the_reference_is_torchs_composition_and_passes_the_check(shape, dtype, options):
    problem = FAMILY.problem(shape, dtype, options)
    for kind in FAMILY.input_kinds:
        inputs = FAMILY.make_inputs(problem, kind, np, np.random.default_rng(7))
        index, weights = reference_routing(problem, inputs, np)
        torch_index, torch_weights = _torch_routing(problem, inputs)
        assert (index == torch_index).all(), f"{kind}: the choice differs from torch's"
        np.testing.assert_allclose(weights, torch_weights, rtol=1e-12, atol=0)
        outputs = {"weights": weights.astype(np.float32), "indices": index.astype(np.int32)}
        assert check_routing(problem, inputs, outputs, np) is None, kind


def test_ties_go_to_the_lower_index():
    problem = FAMILY.problem("1x8", "float32", {"k": 3, "renormalize": True})
    inputs = {"logits": np.array([[1.0, 3.0, 2.0, 3.0, 2.0, 3.0, 0.0, 2.0]], dtype=np.float32), "bias": 0,
              "scale": np.float32(1.0)}
    index, weights = reference_routing(problem, inputs, np)
    assert index.tolist() == [[1, 3, 5]]
    np.testing.assert_allclose(weights, [[1 / 3] * 3])
    swapped = {"weights": weights.astype(np.float32), "indices": np.array([[1, 5, 3]], dtype=np.int32)}
    assert "choose wrongly" in check_routing(problem, inputs, swapped, np)
    later = {"weights": weights.astype(np.float32), "indices": np.array([[1, 3, 2]], dtype=np.int32)}
    assert "choose wrongly" in check_routing(problem, inputs, later, np)


@pytest.mark.parametrize("shape, dtype, options", [PROBLEMS[2], PROBLEMS[6], PROBLEMS[7]])
def test_the_check_rejects_wrong_routings(shape, dtype, options):
    problem = FAMILY.problem(shape, dtype, options)
    inputs = FAMILY.make_inputs(problem, "normal", np, np.random.default_rng(3))
    index, weights = reference_routing(problem, inputs, np)
    right = {"weights": weights.astype(np.float32), "indices": index.astype(np.int32)}

    def changed(name, edit):
        out = {n: a.copy() for n, a in right.items()}
        edit(out[name])
        return check_routing(problem, inputs, out, np)

    assert "outside" in changed("indices", lambda a: a.__setitem__((3, 1), 0x7FC00000))  # unwritten (poisoned)
    assert "twice" in changed("indices", lambda a: a.__setitem__((3, 1), a[3, 0]))
    assert "choose wrongly" in changed("indices", lambda a: a.__setitem__((3, slice(0, 2)), a[3, 1::-1]))
    assert "weights off" in changed("weights", lambda a: a.__setitem__((5, 2), a[5, 2] * 1.001))
    assert "weights off" in changed("weights", lambda a: a.__setitem__((5, 2), np.nan))
    # the next-best expert in place of the k-th: wrong unless it ties (normal inputs: never)
    keys = np.sort(inputs["logits"].astype(np.float64), axis=1)
    if not (problem.option("n_group") or problem.option("sigmoid")):
        order = np.argsort(-inputs["logits"].astype(np.float64), axis=1, kind="stable")
        assert "choose wrongly" in changed("indices", lambda a: a.__setitem__((0, -1), order[0, a.shape[1]]))
        assert keys.size


def test_fp32_near_ties_of_the_grouped_keys_pass():
    """Keys that differ by less than fp32 rounding may come in either order from the kernel."""
    problem = FAMILY.problem("1x8", "float32", {"k": 2, "sigmoid": True, "renormalize": True})
    x = np.array([[0.0, 2.0, 2.0 + 2e-7, -1.0, -2.0, -3.0, -4.0, -5.0]], dtype=np.float32)
    inputs = {"logits": x, "bias": 0, "scale": np.float32(1.0)}
    index, weights = reference_routing(problem, inputs, np)
    assert index.tolist() == [[2, 1]]
    kernel = {"weights": weights[:, ::-1].astype(np.float32), "indices": np.array([[1, 2]], dtype=np.int32)}
    assert check_routing(problem, inputs, kernel, np) is None


def test_the_operator_is_registered_with_its_schema():
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    assert str(torch.ops.autosoft.topk_softmax.default._schema) == (
        "autosoft::topk_softmax(Tensor logits, Tensor? bias, float scale, int k, bool renormalize, "
        "int n_group, int topk_group, bool sigmoid) -> (Tensor, Tensor)")
