"""CPU tier for the attention_colsum family: the split as a problem option, the deterministic
restriction, its share of the attention kernel, the Python function, the command line, list and
the nearest-split rule (the conformance suite renders and compiles a sample of its variants)."""
from __future__ import annotations

import inspect
import math
import shutil
import subprocess
from dataclasses import replace

import pytest

import autosoft
from autosoft.errors import UserError
import numpy as np
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant, space_of
from helpers import make_entry, nvcc_path, run_cli, softmax_key

FAMILY = get_family("attention_colsum")

def _mma_default(problem, target):
    """The mma engine's own default, as a point of the family."""
    return {"engine": "mma", **FAMILY.engine("mma").default_params(problem, target)}

ATTENTION = get_family("attention")
TARGET = Target.for_arch("90")


def _problem(shape="1,32,1024,128", split=512, dtype="bfloat16", **flags):
    return FAMILY.problem(shape, dtype, {"split": split, **flags})


# --- the problem --------------------------------------------------------------------------

def test_split_is_part_of_the_problem_and_its_key():
    problem = _problem(causal=True)
    assert problem.shape_text == "1x32x1024x128+causal+split=512"
    assert FAMILY.parse_problem(problem.shape_text, "bfloat16") == problem
    assert _problem(deterministic=True).shape_text == "1x32x1024x128+deterministic+split=512"


@pytest.mark.parametrize("split", [0, -3, 1024, 5000])
def test_a_split_outside_the_sequence_is_a_user_error(split):
    with pytest.raises(UserError, match=r"0 < split < N=1024"):
        _problem(split=split)


def test_split_is_required_and_one_query_has_no_split():
    with pytest.raises(UserError, match="needs --split"):
        FAMILY.problem("1,32,1024,128", "bfloat16")
    with pytest.raises(UserError, match="N must be at least 2"):
        _problem(shape="1,1,1,64", split=1)


def test_output_shapes_follow_the_split():
    shapes = {"q": (2, 3, 77, 64), "k": (2, 3, 77, 64), "v": (2, 3, 77, 64)}
    outputs = FAMILY.caller_outputs(shapes, "float16", {"split": 40})
    assert outputs == {"o": ((2, 3, 77, 64), "float16"), "colsum": ((2, 3, 40), "float32"),
                       "lse": ((2, 3, 77), "float32")}
    assert FAMILY.output_specs(_problem("2,3,77,64", 40, "float16"))["colsum"] == ((2, 3, 40), "float32")
    with pytest.raises(ValueError, match="autosoft.attention_colsum: split=77"):
        FAMILY.problem_for(shapes, "float16", {"split": 77})
    # an empty input gets empty outputs without a Problem: its split is still checked
    empty, batchless = (1, 2, 0, 64), (0, 2, 9, 64)
    with pytest.raises(ValueError, match="split=5 is outside 0 < split < N=0"):
        FAMILY.caller_outputs({"q": empty, "k": empty, "v": empty}, "float16", {"split": 5})
    assert FAMILY.caller_outputs({"q": batchless, "k": batchless, "v": batchless}, "float16",
                                 {"split": 5})["colsum"] == ((0, 2, 5), "float32")


def test_flops_add_one_product_per_tail_query_and_early_key():
    full = _problem("1,1,1000,64", 600, "float16")
    assert FAMILY.flops(full) == ATTENTION.flops(ATTENTION.problem("1,1,1000,64", "float16")) + 2.0 * 400 * 600 * 64


# --- the search space ---------------------------------------------------------------------

def test_deterministic_problems_have_only_key_major_variants():
    det = _problem("1,4,1000,64", 500, "float16", deterministic=True)
    points = space_of(FAMILY).valid_points(FAMILY.problem_values(det, TARGET))
    assert points and {p["colsum"] for p in points} == {"key_major"}
    assert FAMILY.default_params(det, TARGET)["colsum"] == "key_major"
    assert all(p["colsum"] == "key_major" for p in FAMILY.seed_params(det, TARGET))
    free = _problem("1,4,1000,64", 500, "float16")
    assert {p["colsum"] for p in space_of(FAMILY).valid_points(FAMILY.problem_values(free, TARGET))} == \
        {"key_major", "fused"}
    with pytest.raises(UserError, match="only the key-major pass sums in a fixed order"):
        build_variant(FAMILY, det, {**_mma_default(det, TARGET), "colsum": "fused"}, TARGET)


def test_the_default_shares_query_tiles_among_blocks_until_the_gpu_is_full():
    small = FAMILY.default_params(_problem(causal=True), TARGET)  # 8 key tiles x 32 heads = 256 blocks
    assert small["colsum"] == "key_major" and small["km_split"] == 2
    assert FAMILY.default_params(_problem("4,32,2048,64", 1024, "float16"), TARGET)["km_split"] == 1
    assert FAMILY.default_params(_problem("1,1,2048,64", 1984, "float16"), TARGET)["km_split"] == 1  # one query tile


def test_split_key_major_launches_use_the_workspace_they_declare():
    problem = _problem("2,3,1000,64", 600, "float16")
    params = {**FAMILY.default_params(problem, TARGET), "km_split": 4}
    variant = build_variant(FAMILY, problem, params, TARGET)
    _, key_major = variant.launches
    keys = int(params.get("warps", 4))  # the wgmma pass: 4 warps (its space fixes them)
    keys = keys * int(params["km_rows"])
    assert key_major.grid == (4 * -(-600 // keys), 3, 2) and key_major.args[-1] == "workspace"
    assert variant.workspace_bytes == 4 * 2 * 3 * -(-600 // keys) * (4 * keys + 1)
    assert "arrived[tile] = 0u" in variant.source, "the counters are left at zero for the next launch"


def test_fused_variants_are_counted_once():
    """The key-major tiles mean nothing to the fused pass: one value of them is valid."""
    problem = _problem()
    fused = [p for p in space_of(FAMILY).valid_points(FAMILY.problem_values(problem, TARGET)) if p["colsum"] == "fused"]
    assert fused and all((p["km_rows"], p["km_queries"], p["km_split"]) == (16, 64, 1) for p in fused)


# --- the attention kernel, shared -----------------------------------------------------------

def _main_loop(source: str) -> str:
    start = source.index("  for (int jt = 0; jt < n_tiles; ++jt) {")
    return source[start:source.index("  // epilogue", start)]


@pytest.mark.parametrize("way", ["fused", "key_major"])
def test_the_attention_main_loop_is_the_attention_familys(way):
    """The column sums extend the attention kernel through its template blocks: its main loop
    renders to the very text the attention family's does, for the same tiles."""
    problem = _problem("1,8,3333,128", 1000, causal=True)
    params = {**_mma_default(problem, TARGET), "colsum": way, "km_rows": 16, "km_queries": 64, "km_split": 1}
    colsum = build_variant(FAMILY, problem, params, TARGET).source
    attention_problem = ATTENTION.problem("1,8,3333,128", "bfloat16", ("causal",))
    attention = build_variant(ATTENTION, attention_problem, {"pack": False, "splits": 1, "key_warps": 1, "engine": "mma",
                                                             "overlap": False, "pingpong": False, "blocks_per_sm": 1, "lpt": False, "persistent": False, "queue": False, "chain": False, "merge": "last_block", **{
        k: params[k] for k in space_of(ATTENTION).names if k in params}}, TARGET).source
    assert _main_loop(colsum).startswith(_main_loop(attention))
    assert colsum.count("// S = Q K^T (raw scores, fp32)") == 2, "qk_scores is rendered again for the second pass"
    attention_end = attention[attention.index("  // epilogue"):]
    assert attention_end.rstrip() in colsum, "the attention epilogue is unchanged"


def _wgmma(problem, **change):
    """The problem's default on sm_90 (a wgmma pair), with `change`."""
    point = FAMILY.default_params(problem, TARGET)
    assert point["engine"] == "wgmma"
    return {**point, **change}


def test_on_hopper_the_wgmma_attention_kernel_is_the_attention_familys_then_the_key_major_pass():
    """The wgmma engine shares the attention family's kernel itself: the same launch (tensor maps,
    no column sums), the same kernel text in a namespace of its own, then the key-major pass built
    on the mma kernel's helpers (which the wgmma kernel's names would otherwise clash with)."""
    problem = _problem("1,8,3333,128", 3269, causal=True)
    params = _wgmma(problem, km_split=2)
    variant = build_variant(FAMILY, problem, params, TARGET)
    attention_problem = ATTENTION.problem("1,8,3333,128", "bfloat16", ("causal",))
    attention = build_variant(ATTENTION, attention_problem, {"pack": False, "splits": 1, "key_warps": 1, "queue": False, "chain": False, "merge": "last_block",
                                                             **{k: params[k] for k in space_of(ATTENTION).names
                                                                if k in params}}, TARGET)
    assert variant.name == "attention_colsum_kmajor64x64c2_" + attention.name.removeprefix("attention_")
    first, key_major = variant.launches
    assert first == attention.launches[0], "the attention family's own launch"
    assert key_major.kernel == "colsum_key_major" and key_major.args[-1] == "workspace"
    kernel = attention.source[attention.source.index("extern \"C\" __global__"):].rstrip()
    assert "namespace hopper {" in variant.source and kernel in variant.source
    assert variant.source.index(kernel) < variant.source.index("}  // namespace hopper") \
        < variant.source.index("colsum_key_major(")
    assert "FlashAttention-2 forward" not in variant.source, "no mma attention kernel"


def test_wgmma_pairs_are_the_hopper_default_and_never_take_the_fused_pass():
    problem = _problem("1,4,4096,64", 2048, causal=True)
    valid = space_of(FAMILY).valid_points(FAMILY.problem_values(problem, TARGET))
    wgmma = [p for p in valid if p["engine"] == "wgmma"]
    # the pass's helpers keep one set of values under wgmma: its space fixes them, its points omit them
    assert wgmma and all(p["colsum"] == "key_major" and "warps" not in p and "q_in" not in p for p in wgmma)
    default = FAMILY.default_params(problem, TARGET)
    assert (default["engine"], default["colsum"]) == ("wgmma", "key_major")
    assert _mma_default(problem, TARGET)["engine"] == "mma"
    assert any(p["engine"] == "mma" for p in FAMILY.seed_params(problem, TARGET)), "the mma pairs stay seeds"
    assert FAMILY.default_params(_problem("1,4,4096,32", 2048), TARGET)["engine"] == "wgmma", "64-byte chunks at D = 32"
    sm80 = Target.for_arch("80")
    assert FAMILY.default_params(problem, sm80)["engine"] == "mma"
    assert all(p["engine"] == "mma" for p in space_of(FAMILY).valid_points(FAMILY.problem_values(problem, sm80)))


@pytest.mark.parametrize("shape, split, flags", [("1,8,3333,128", 3269, {"causal": True}), ("1,4,4096,64", 2048, {}),
                                                 ("2,3,777,64", 700, {"causal": True, "deterministic": True}),
                                                 ("1,4,1000,32", 500, {})])
def test_wgmma_pairs_compile_for_sm90a(shape, split, flags):
    from autosoft.compile import ARCH_SPECIFIC, compile_source

    problem = _problem(shape, split, **flags)
    seeds = [p for p in FAMILY.seed_params(problem, TARGET) if p["engine"] == "wgmma"]
    for params in seeds[:2] + seeds[-1:]:
        variant = build_variant(FAMILY, problem, params, TARGET)
        assert ARCH_SPECIFIC in variant.source
        result = compile_source(variant.source, "90")
        assert result.ok, f"{variant.name}: {result.log[:3000]}"


def test_the_template_digest_covers_the_attention_templates():
    from autosoft.families.base import family_template_digest
    from autosoft.render import template_digest

    assert FAMILY.template_folders == ("attention",)
    assert family_template_digest(FAMILY) != template_digest(FAMILY.template)  # without attention/ it differs
    assert family_template_digest(FAMILY) == template_digest(FAMILY.template, None, ("attention",))


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed")
def test_both_passes_build_with_nvcc_without_spilling(tmp_path):
    problem = _problem("1,32,4096,128", 2048, causal=True)
    for way, extra in (("fused", {}), ("key_major", {"km_rows": 32, "km_queries": 128, "km_split": 4})):
        params = {**_mma_default(problem, TARGET), "colsum": way, "km_rows": 16, "km_queries": 64,
                  "km_split": 1, **extra}
        variant = build_variant(FAMILY, problem, params, TARGET)
        path = tmp_path / f"{way}.cu"
        path.write_text(variant.source)
        result = subprocess.run([nvcc_path(), "-cubin", "-arch=sm_90", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                                 str(path)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        for kernel in variant.kernel_names:
            assert f"Compiling entry function '{kernel}'" in result.stderr
        assert " 0 bytes spill stores" in result.stderr and "bytes spill stores" not in \
            result.stderr.replace(" 0 bytes spill stores", "")


# --- the nearest split ------------------------------------------------------------------------

def test_nearer_splits_are_nearer_and_flags_never_mix():
    base = _problem(causal=True)
    near, far = _problem(split=500, causal=True), _problem(split=64, causal=True)
    assert 0 < FAMILY.problem_distance(base, near) < FAMILY.problem_distance(base, far)
    assert FAMILY.problem_distance(base, near) == FAMILY.problem_distance(near, base)
    assert FAMILY.problem_distance(base, _problem()) == math.inf
    assert FAMILY.problem_distance(base, _problem(causal=True, deterministic=True)) == math.inf
    # the tail length counts too: split N - 64 is far from split N - 512 though the splits are close
    tail64, tail512 = _problem(split=960, causal=True), _problem(split=512, causal=True)
    assert FAMILY.problem_distance(tail64, tail512) > FAMILY.problem_distance(base, near)


# --- the Python function ----------------------------------------------------------------------

def test_autosoft_serves_the_familys_function_with_its_signature_and_doc():
    function = autosoft.attention_colsum
    assert function is autosoft.attention_colsum, "built once"
    assert function.__name__ == "attention_colsum" and function.__module__ == "autosoft"
    assert list(inspect.signature(function).parameters) == [
        "q", "k", "v", "split", "causal", "scale", "return_lse", "deterministic"]
    assert "colsum" in function.__doc__ and "deterministic" in function.__doc__
    assert "attention_colsum" in dir(autosoft)
    with pytest.raises(AttributeError, match="no attribute 'no_such_family'"):
        autosoft.no_such_family  # noqa: B018


def test_a_family_without_a_python_function_is_no_attribute():
    from autosoft.api import family_function

    assert not get_family("softmax").has_python_call  # softmax's function is written out in api.py
    with pytest.raises(LookupError, match="declares no Python function"):
        family_function("softmax")


@pytest.mark.parametrize("split, error", [(2.0, TypeError), (True, TypeError), ("3", TypeError)])
def test_the_split_must_be_an_int(split, error):
    with pytest.raises(error, match="split must be an int"):
        FAMILY.python_call(None, None, None, split)


def test_the_call_it_asks_for():
    class Array:
        shape = (1, 2, 10, 64)

    q = k = v = Array()
    call = FAMILY.python_call(q, k, v, 4, causal=True)
    assert call.arrays == (q, k, v) and call.returns == ("o", "colsum")
    assert call.options == {"causal": True, "split": 4, "deterministic": False}
    assert call.scalars["scale"] == pytest.approx(1 / 8)
    assert FAMILY.python_call(q, k, v, 4, return_lse=True, deterministic=True).returns == ("o", "colsum", "lse")
    with pytest.raises(ValueError, match="scale must be positive"):
        FAMILY.python_call(q, k, v, 4, scale=0.0)


def test_host_arrays_are_a_type_error_before_cuda():
    np = pytest.importorskip("numpy")
    q = np.zeros((1, 1, 8, 64), dtype=np.float16)
    with pytest.raises(TypeError, match="host"):
        autosoft.attention_colsum(q, q, q, 4)


# --- the command line ------------------------------------------------------------------------

def test_tune_help_names_the_split_and_determinism(tmp_path):
    out = run_cli(["tune", "attention_colsum", "--help"], tmp_path / "cache").stdout
    assert "--split" in out and "--deterministic" in out and "--causal" in out


def test_render_needs_the_split_and_says_so(tmp_path):
    result = run_cli(["render", "attention_colsum", "--shape", "1,2,77,64", "--split", "40", "--causal"],
                     tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "variant attention_colsum_kmajor64x64c2_bf16_d64_causal" in result.stdout, "2 blocks share 2 query tiles"
    for args, message in ((["--causal"], "needs --split"), (["--split", "77"], "0 < split < N=77")):
        result = run_cli(["render", "attention_colsum", "--shape", "1,2,77,64", *args], tmp_path / "cache")
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and message in result.stderr


def test_list_shows_the_split(tmp_path):
    from autosoft.cache import Cache
    from autosoft.families.base import family_template_digest

    problem = _problem(causal=True)
    key = replace(softmax_key(), family="attention_colsum", dtype="bfloat16", shape=problem.shape_text,
                  template_digest=family_template_digest(FAMILY), space_digest=space_of(FAMILY).digest)
    params = FAMILY.default_params(problem, TARGET)
    cache_dir = tmp_path / "cache"
    Cache(cache_dir / "kernels.sqlite").put(make_entry(key, params=params, variant_name=FAMILY.variant_name(problem, params)))
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert "attention_colsum" in result.stdout and "1x32x1024x128+causal+split=512" in result.stdout


def test_export_writes_both_kernels(tmp_path):
    from autosoft.cache import Cache
    from autosoft.families.base import family_template_digest

    problem = _problem("1,2,77,64", 40, "float16")
    key = replace(softmax_key(), family="attention_colsum", dtype="float16", shape=problem.shape_text,
                  template_digest=family_template_digest(FAMILY), space_digest=space_of(FAMILY).digest)
    params = FAMILY.default_params(problem, TARGET)
    cache_dir = tmp_path / "cache"
    Cache(cache_dir / "kernels.sqlite").put(make_entry(key, params=params))
    out = tmp_path / "colsum.cu"
    result = run_cli(["export", "attention_colsum", "--shape", "1x2x77x64", "--split", "40", "--dtype", "float16",
                      "-o", str(out)], cache_dir)
    assert result.returncode == 0, result.stderr
    text = out.read_text()
    assert "attention_fwd(" in text and "colsum_key_major(" in text
    if shutil.which("nvcc"):
        from autosoft.compile import ARCH_SPECIFIC

        target = ["-gencode=arch=compute_90a,code=sm_90a"] if ARCH_SPECIFIC in text else ["-arch=sm_90"]  # wgmma: sm_90a
        built = subprocess.run(["nvcc", "-c", *target, "-o", str(tmp_path / "c.o"), str(out)],
                               capture_output=True, text=True, timeout=300)
        assert built.returncode == 0, built.stderr[-2000:]


def test_python_call_says_what_is_wrong_in_the_callers_terms():
    q = np.zeros((1, 1, 8, 32), dtype=np.float16)
    with pytest.raises(TypeError, match="autosoft.attention_colsum: split is required"):
        FAMILY.python_call(q, q, q)
    with pytest.raises(TypeError, match="scale must be None or a positive number, got str"):
        FAMILY.python_call(q, q, q, 4, scale="x")


def test_colsum_spaces_extend_the_attention_engines_and_add_only_the_pass():
    from autosoft.families.base import space_of as space
    attention = space(get_family("attention"))
    for engine in ("mma", "wgmma"):
        mine, theirs = space(FAMILY).space(engine), attention.space(engine)
        assert {"colsum", "km_rows", "km_queries", "km_split"} <= set(mine.names)
        assert set(mine.names) - {"colsum", "km_rows", "km_queries", "km_split"} <= set(theirs.names)
        assert {c.why for c in theirs.constraints} <= {c.why for c in mine.constraints}
