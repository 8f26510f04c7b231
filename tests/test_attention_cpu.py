"""CPU tier for the attention family: shapes, search space, rendering, nvcc builds, the checker (the
conformance suite compiles a sample of its variants with NVRTC)."""
from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.compile import ARCH_SPECIFIC, compile_source
from autosoft.families.attention import call_options, fast_divisor, key_bounds, reference, visible_pairs
from autosoft.families.base import Target, TensorMap, build_variant, params_from_text, space_of

FAMILY = get_family("attention")

def _mma_default(problem, target):
    """The mma engine's own default, as a point of the family."""
    return {"engine": "mma", **FAMILY.engine("mma").default_params(problem, target)}

ARCHS = ("90", "80")

# (shape text, dtype, flags): head dims, tails, tiny and long sequences, causal or not
PROBLEMS = [
    ("1,32,8192,64", "bfloat16", ()),
    ("4,16,4096,128", "float16", ("causal",)),
    ("2,3,1000,128", "bfloat16", ()),
    ("1,2,17,64", "float16", ("causal",)),
    ("1,1,1,32", "bfloat16", ()),
    ("2,2,3333,32", "float16", ("causal",)),
]


def _values(problem, arch="90"):
    return FAMILY.problem_values(problem, Target.for_arch(arch))


# --- shapes and problems ----------------------------------------------------------------

@pytest.mark.parametrize("text", ["1,32,8192,64", "1x32x8192x64", " 1 , 32 ,8192, 64 ", "1X32X8192X64"])
def test_shape_forms(text):
    assert FAMILY.parse_shape(text) == (1, 32, 8192, 64)


@pytest.mark.parametrize("text, needle", [
    ("1,32,8192", "B,H,N,D"),
    ("1,32,8192,64,1", "B,H,N,D"),
    ("a,b,c,d", "B,H,N,D"),
    ("1,32,-5,64", "B,H,N,D"),
    ("0,32,8192,64", "at least 1"),
    ("1,32,8192,72", "head dim"),
    ("1,32,8192,512", "head dim"),
    ("70000,1,16,64", "at most 65535"),
])
def test_bad_shapes_say_what_to_do(text, needle):
    with pytest.raises(UserError, match=needle):
        FAMILY.parse_shape(text)


def test_problem_dtypes_and_flags():
    p = FAMILY.problem("1x2x3x64", "bfloat16", ("causal",))
    assert p.flags == ("causal",) and p.shape == (1, 2, 3, 64) and p.family == "attention"
    assert p.shape_text == "1x2x3x64+causal"
    assert FAMILY.problem("1,2,3,64", "float16").flags == ()
    with pytest.raises(UserError, match="float16 or bfloat16"):
        FAMILY.problem("1,2,3,64", "float32")
    with pytest.raises(UserError, match="unknown dtype"):
        FAMILY.problem("1,2,3,64", "int8")
    with pytest.raises(UserError, match="--window"):
        FAMILY.problem("1,2,3,64", "float16", ("window",))


def test_costs_and_outputs():
    p = FAMILY.problem("2,3,100,64", "float16")
    pc = FAMILY.problem("2,3,100,64", "float16", ("causal",))
    assert FAMILY.flops(p) == 4 * 2 * 3 * 100 * 100 * 64
    assert FAMILY.flops(pc) == FAMILY.flops(p) / 2
    assert FAMILY.bytes_moved(p) == 4 * 2 * 3 * 100 * 64 * 2 + 4 * 2 * 3 * 100
    assert FAMILY.output_specs(p) == {"o": ((2, 3, 100, 64), "float16"), "lse": ((2, 3, 100), "float32")}


# --- search space -----------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape, dtype, flags", PROBLEMS)
def test_space_defaults_and_constraints(shape, dtype, flags, arch):
    problem = FAMILY.problem(shape, dtype, flags)
    target = Target.for_arch(arch)
    space = space_of(FAMILY)
    valid = space.valid_points(_values(problem, arch))
    assert valid, "every problem has a valid variant"
    default = FAMILY.default_params(problem, target)
    assert default in valid
    for seed in FAMILY.seed_params(problem, target):
        assert seed in valid and seed != default
    n = problem.shape[2]
    for p in valid:
        v = space.evaluate(p, _values(problem, arch))
        if v["engine"] == "wgmma":  # one consumer warpgroup per 64 rows, a register budget each
            assert arch == "90" and v["block_m"] in (64, 128, 192) and v["D"] % 16 == 0
            assert v["wgmma_regs"] <= (240 if v["block_m"] <= 128 else 160)
        else:
            assert v["block_m"] * v["key_warps"] in (16 * v["warps"], 32 * v["warps"])
        assert v["smem_bytes"] <= target.smem_optin
        assert v["stages"] == 1 or v["stages"] <= math.ceil(n / v["block_n"])


def test_tiny_sequence_gets_the_smallest_tiles():
    problem = FAMILY.problem("1,1,1,64", "float16")
    valid = space_of(FAMILY).valid_points(_values(problem))
    assert {(p["block_m"], p["block_n"], p["stages"]) for p in valid} == {(16, 32, 1)}


def test_shared_memory_limit_prunes_sm80_less_than_sm90():
    problem = FAMILY.problem("1,8,4096,128", "float16")
    n90 = len(space_of(FAMILY).valid_points(_values(problem, "90")))
    small = FAMILY.problem_values(problem, Target.for_arch("86"))  # 99 KiB per block
    n86 = len(space_of(FAMILY).valid_points(small))
    assert 0 < n86 < n90


def test_invalid_params_are_refused():
    problem = FAMILY.problem("1,2,1000,64", "float16")
    target = Target.for_arch("90")
    good = FAMILY.default_params(problem, target)
    assert good["engine"] == "wgmma"
    with pytest.raises(UserError, match="block_m"):
        build_variant(FAMILY, problem, {**good, "block_m": 96}, target)
    # a parameter only the mma engine declares never reaches the wgmma kernel (points stored when
    # every point held both engines' parameters still build); the command line refuses it
    assert build_variant(FAMILY, problem, {**good, "warps": 8}, target).source == \
        build_variant(FAMILY, problem, good, target).source
    with pytest.raises(UserError, match="a parameter of the mma engine, not of wgmma"):
        params_from_text(FAMILY, problem, target, ["warps=8"])
    with pytest.raises(UserError, match="wgmma engine is built for sm_90"):
        build_variant(FAMILY, problem, good, Target.for_arch("80"))
    with pytest.raises(UserError, match="registers setmaxnreg gives it"):
        build_variant(FAMILY, FAMILY.problem("1,2,1000,128", "float16"),
                      {**good, "block_m": 192, "block_n": 128, "blocks_per_sm": 1}, target)
    with pytest.raises(UserError, match="two resident blocks are for one consumer warpgroup"):
        build_variant(FAMILY, problem, {**good, "block_m": 128, "pingpong": True}, target)
    good = _mma_default(problem, target)
    with pytest.raises(UserError, match="mma tile"):
        build_variant(FAMILY, problem, {**good, "block_m": 64, "warps": 8}, target)
    with pytest.raises(UserError, match="not allowed"):
        build_variant(FAMILY, problem, {**good, "layout": "x; system()"}, target)


def test_variant_name_and_launch():
    problem = FAMILY.problem("2,16,1000,128", "bfloat16", ("causal",))
    params = {"engine": "mma", "overlap": False, "pingpong": False, "blocks_per_sm": 1, "lpt": False, "persistent": False, "queue": False, "chain": False, "merge": "last_block", "block_m": 128, "block_n": 64, "warps": 8, "stages": 2, "layout": "swizzle", "q_in": "registers",
              "pack": False, "splits": 1, "key_warps": 1}
    v = build_variant(FAMILY, problem, params, Target.for_arch("90"))
    assert v.name == "attention_bf16_d128_causal_m128_n64_w8_s2_swz_qreg"
    (launch,) = v.launches
    assert launch.grid == (8, 16, 2) and launch.block == (256, 1, 1)
    assert launch.shared_mem == (128 + 2 * 2 * 64) * 128 * 2
    strides = tuple(f"{a}_stride{i}" for a in "qkv" for i in range(3))
    assert launch.args == ("q", "k", "v", "o", "lse", "scale", *strides)
    assert v.workspace_bytes == 0


# --- rendering and compiling ------------------------------------------------------------

def test_rendered_source_uses_tensor_core_ptx():
    problem = FAMILY.problem("1,32,8192,64", "bfloat16")
    src = build_variant(FAMILY, problem, _mma_default(problem, Target.for_arch("90")),
                        Target.for_arch("90")).source
    for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                   "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                   "cp.async.commit_group", "cp.async.wait_group", "__shfl_xor_sync", "exp2f"):
        assert needle in src, needle
    assert "#include" not in src


def _tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    for folder in ([Path(nvcc).resolve().parent] if nvcc else []) + [Path("/usr/local/cuda/bin")]:
        if (folder / name).exists():
            return str(folder / name)
    return None


def _arch_flag(source: str, arch: str) -> str:
    """nvcc's target for a source: the sm_XXa cubin alone for a kernel of Hopper's own instructions."""
    return f"-gencode=arch=compute_{arch}a,code=sm_{arch}a" if ARCH_SPECIFIC in source else f"-arch=sm_{arch}"


def _nvcc_cubin(tmp_path: Path, source: str, arch: str) -> Path:
    src = tmp_path / "attention.cu"
    src.write_text(source)
    out = tmp_path / "attention.cubin"
    proc = subprocess.run([_tool("nvcc"), "-cubin", _arch_flag(source, arch), "-std=c++17", "--use_fast_math",
                           "-o", str(out), str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.skipif(_tool("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("shape, dtype, flags", PROBLEMS[:3])
def test_default_variant_builds_with_nvcc(tmp_path, shape, dtype, flags):
    problem = FAMILY.problem(shape, dtype, flags)
    target = Target.for_arch("90")
    for params in (FAMILY.default_params(problem, target), _mma_default(problem, target)):
        variant = build_variant(FAMILY, problem, params, target)
        src = tmp_path / "attention.cu"
        src.write_text(variant.source)
        proc = subprocess.run([_tool("nvcc"), "-c", _arch_flag(variant.source, "90"), "-std=c++17",
                               "-o", str(tmp_path / "a.o"), str(src)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "warning" not in proc.stderr, proc.stderr


@pytest.mark.skipif(_tool("nvcc") is None or _tool("cuobjdump") is None or _tool("nvdisasm") is None,
                    reason="nvcc, cuobjdump or nvdisasm not installed")
@pytest.mark.parametrize("layout", ["swizzle", "pad"])
def test_sass_has_tensor_core_and_ldmatrix_instructions(tmp_path, layout):
    problem = FAMILY.problem("1,8,1000,128", "float16", ("causal",))
    target = Target.for_arch("90")
    params = {**_mma_default(problem, target), "layout": layout}
    cubin = _nvcc_cubin(tmp_path, build_variant(FAMILY, problem, params, target).source, "90")
    proc = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    sass = proc.stdout
    for op in ("HMMA.16816.F32", "LDSM.16.M88.4", "LDSM.16.MT88.4", "LDGSTS", "MUFU.EX2", "SHFL.BFLY"):
        assert op in sass, op


# --- the checker and the reference (NumPy stands in for CuPy) ----------------------------

def _naive(q, k, v, scale, causal):
    s = np.einsum("bhid,bhjd->bhij", q, k) * scale
    if causal:
        n = q.shape[2]
        s[..., np.triu(np.ones((n, n), dtype=bool), 1)] = -np.inf
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return np.einsum("bhij,bhjd->bhid", p, v) / p.sum(-1, keepdims=True), (m + np.log(p.sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_reference_matches_naive_and_checker_accepts_it(monkeypatch, causal, dtype):
    import autosoft.families.attention as attention
    from autosoft.dtypes import to_float64, to_storage

    monkeypatch.setattr(attention, "_REF_BYTES", 8 * 37 * 5)  # force several row and head chunks
    problem = FAMILY.problem("2,3,37,32", dtype, ("causal",) if causal else ())
    rng = np.random.default_rng(0)
    for kind in FAMILY.input_kinds:
        inputs = FAMILY.make_inputs(problem, kind, np, rng)
        assert inputs["scale"] == np.float32(1 / math.sqrt(32)) and isinstance(inputs["scale"], np.float32)
        q, k, v = (to_float64(inputs[n], dtype, np) for n in "qkv")
        ref_o, ref_lse = reference(problem, inputs, np)
        naive_o, naive_lse = _naive(q, k, v, float(inputs["scale"]), causal)
        np.testing.assert_allclose(ref_o, naive_o, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(ref_lse, naive_lse, rtol=1e-10, atol=1e-12)
        outputs = {"o": to_storage(ref_o.astype(np.float32), dtype, np), "lse": ref_lse.astype(np.float32)}
        assert FAMILY.check(problem, inputs, outputs, np) is None, kind


def test_checker_catches_nan_wrong_rows_and_wrong_lse():
    from autosoft.dtypes import to_storage

    problem = FAMILY.problem("1,2,300,64", "float16")
    inputs = FAMILY.make_inputs(problem, "normal", np, np.random.default_rng(1))
    ref_o, ref_lse = reference(problem, inputs, np)

    def outputs():
        return {"o": to_storage(ref_o.astype(np.float32), "float16", np), "lse": ref_lse.astype(np.float32)}

    out = outputs()
    out["o"][0, 1, 299, 5] = np.nan  # the last row left unwritten
    assert "NaN" in FAMILY.check(problem, inputs, out, np)
    out = outputs()
    out["o"][0, 1, 299] = (out["o"][0, 1, 299].astype(np.float32) * 1.08).astype(np.float16)  # hides in the norm
    assert "rows off" in FAMILY.check(problem, inputs, out, np)
    out = outputs()
    out["o"] = (out["o"].astype(np.float32) * 1.05).astype(np.float16)
    assert "relative error" in FAMILY.check(problem, inputs, out, np)
    out = outputs()
    out["lse"][0, 0, 7] += 0.01
    assert "lse" in FAMILY.check(problem, inputs, out, np)


# --- grouped heads, other key lengths, windows, softcap (issue 17) -----------------------


def test_kv_options_equal_to_the_query_shape_are_dropped_and_others_checked():
    assert FAMILY.problem("1,8,64,64", "float16", {"kv_heads": 8, "kv_len": 64}).options == ()
    assert FAMILY.problem("1,8,1,64", "float16", {"kv_heads": 2, "kv_len": 4096}).shape_text == \
        "1x8x1x64+kv_heads=2+kv_len=4096"
    with pytest.raises(UserError, match="multiple of the KV heads"):
        FAMILY.problem("1,8,1,64", "float16", {"kv_heads": 3})
    with pytest.raises(UserError, match="--window-left -1"):
        FAMILY.problem("1,8,1,64", "float16", {"window_left": -1})
    with pytest.raises(UserError, match="--softcap"):
        FAMILY.problem("1,8,1,64", "float16", {"softcap": 0.0})


def test_key_bounds_align_bottom_right_and_apply_windows():
    # 3 queries over 5 keys: query i stands at key i + 2
    p = FAMILY.problem("1,1,3,64", "float16", {"kv_len": 5, "causal": True})
    lo, hi = key_bounds(p, np.arange(3))
    assert lo.tolist() == [0, 0, 0] and hi.tolist() == [2, 3, 4]
    w = FAMILY.problem("1,1,3,64", "float16", {"kv_len": 5, "window_left": 1, "window_right": 1})
    lo, hi = key_bounds(w, np.arange(3))
    assert lo.tolist() == [1, 2, 3] and hi.tolist() == [3, 4, 4]
    # more queries than keys, causal: the first queries see nothing
    e = FAMILY.problem("1,1,5,64", "float16", {"kv_len": 2, "causal": True})
    lo, hi = key_bounds(e, np.arange(5))
    assert (hi - lo + 1).clip(0).tolist() == [0, 0, 0, 1, 2]


def test_flops_count_the_visible_pairs_with_the_causal_edge_as_half():
    square = FAMILY.problem("1,1,100,64", "float16", ("causal",))
    assert visible_pairs(square) == 100 * 100 / 2
    cache = FAMILY.problem("1,1,10,64", "float16", {"kv_len": 1000, "causal": True})
    assert visible_pairs(cache) == 10 * 990 + 10 * 10 / 2
    window = FAMILY.problem("1,1,1000,64", "float16", {"window_left": 9, "window_right": 0})
    assert visible_pairs(window) == sum(min(i, 9) + 1 for i in range(1000))
    assert FAMILY.flops(FAMILY.problem("2,4,1,64", "float16", {"kv_heads": 1, "kv_len": 77})) == 4 * 2 * 4 * 64 * 77


def test_bytes_moved_count_k_and_v_once_per_kv_head():
    p = FAMILY.problem("2,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096})
    assert FAMILY.bytes_moved(p) == 2 * 128 * (2 * 2 * 32 * 1 + 2 * 2 * 8 * 4096) + 4 * 2 * 32


def test_the_verification_problem_keeps_the_group_and_the_kernel():
    target = Target.for_arch("90")
    p = FAMILY.problem("4,32,7,128", "bfloat16", {"kv_heads": 8, "kv_len": 3333, "causal": True})
    small = FAMILY.verification_problem(p)
    assert small.shape == (1, 4, 7, 128) and dict(small.options)["kv_heads"] == 1
    params = FAMILY.default_params(p, target)
    assert build_variant(FAMILY, small, params, target).source == build_variant(FAMILY, p, params, target).source


def test_problems_of_other_groups_or_masks_never_borrow_each_others_kernels():
    a = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096})
    b = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 8192})
    c = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 4, "kv_len": 4096})
    d = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096, "softcap": 30.0})
    assert FAMILY.problem_distance(a, b) == 4.0  # one log2 step of kv_len, weighing as N does
    assert FAMILY.problem_distance(a, c) == FAMILY.problem_distance(a, d) == float("inf")


def test_decode_defaults_pack_the_group_and_split_the_keys():
    target = Target.for_arch("90")
    p = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 32768})
    d = FAMILY.default_params(p, target)
    assert d["pack"] is True and d["block_m"] == 16 and d["key_warps"] == 4 and d["splits"] > 1
    v = build_variant(FAMILY, p, d, target)
    (launch,) = v.launches
    assert launch.grid == (d["splits"], 8, 1) and launch.args[-1] == "workspace" and v.workspace_bytes > 0


def test_splits_merged_in_a_cluster_need_no_workspace_and_compile_for_sm90():
    """The splits of a query tile as one cluster (sm_90, up to 16 blocks): the kernel declares
    the cluster, the launch names it and takes no workspace; 32 splits or another GPU: refused."""
    target = Target.for_arch("90")
    p = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 32768})
    d = FAMILY.default_params(p, target)
    assert d["merge"] == "last_block"
    merged = {**d, "splits": 16, "merge": "cluster"}
    v = build_variant(FAMILY, p, merged, target)
    (launch,) = v.launches
    assert v.name.endswith("_split16_cluster") and launch.cluster_blocks == 16 and launch.non_portable_cluster
    assert launch.grid == (16, 8, 1) and "workspace" not in launch.args and v.workspace_bytes == 0
    assert "__cluster_dims__(SPLITS, 1, 1)" in v.source and "float* __restrict__ workspace" not in v.source
    assert "__cluster_dims__" not in build_variant(FAMILY, p, d, target).source
    result = compile_source(v.source, "90", v.name + ".cu")
    assert result.ok, result.log[:2000]
    with pytest.raises(UserError, match="a cluster"):
        build_variant(FAMILY, p, {**d, "splits": 32, "merge": "cluster"}, target)
    with pytest.raises(UserError, match="a cluster"):
        build_variant(FAMILY, p, {**d, "splits": 1, "merge": "cluster"}, target)
    sm80 = Target.for_arch("80")
    with pytest.raises(UserError, match="a cluster"):
        build_variant(FAMILY, p, {**FAMILY.default_params(p, sm80), "splits": 8, "merge": "cluster"}, sm80)
    assert not any(s.get("merge") == "cluster" for s in FAMILY.seed_params(p, target)), "lost on the H200: not seeded"


def test_call_options_keep_only_what_is_given():
    assert call_options(True, None, None) == {"causal": True}
    assert call_options(False, (None, 4), 50) == {"causal": False, "window_right": 4, "softcap": 50.0}


@pytest.mark.parametrize("shape, dtype, options", [
    ("1,32,1,96", "float16", {"kv_heads": 8, "kv_len": 1000}),
    ("1,4,300,256", "bfloat16", {"kv_heads": 1, "kv_len": 7, "causal": True}),
    ("2,4,64,64", "float16", {"window_left": 10, "window_right": 3, "softcap": 30.0}),
])
def test_new_problems_compile_for_sm80_and_sm90(shape, dtype, options):
    problem = FAMILY.problem(shape, dtype, options)
    for arch in ("80", "90"):
        target = Target.for_arch(arch)
        for params in [FAMILY.default_params(problem, target)] + FAMILY.seed_params(problem, target)[:2]:
            v = build_variant(FAMILY, problem, params, target)
            result = compile_source(v.source, arch, v.name + ".cu")
            assert result.ok, f"{v.name}: {result.log[:2000]}"


# --- the wgmma engine (sm_90a) ------------------------------------------------------------------

WGMMA = {"engine": "wgmma", "warps": 4, "key_warps": 1, "q_in": "smem", "layout": "swizzle", "pack": False, "splits": 1,
         "blocks_per_sm": 1, "lpt": False, "persistent": False, "queue": False, "chain": False, "merge": "last_block"}


def test_fast_divisor_divides_every_kernel_index_exactly():
    rng = np.random.default_rng(7)
    divisors = [*range(1, 1100), *(2**k + e for k in range(11, 31) for e in (-1, 0, 1)), *rng.integers(1, 2**31, 300)]
    for d in (int(x) for x in divisors if 1 <= x < 2**31):
        mul, shift = fast_divisor(d)
        assert isinstance(mul, np.uint32) and isinstance(shift, np.int32)
        m, p = int(mul), int(shift)
        # around each multiple of d (where a rounding error would show first) and the ends of [0, 2^31)
        top = (2**31 - 1) // d * d
        for n in {0, 1, d - 1, d, d + 1, 2 * d - 1, top - 1, top, 2**31 - 1, *(int(x) for x in rng.integers(0, 2**31, 8))}:
            if 0 <= n < 2**31:
                assert (n * m) >> p == n // d, (n, d)
    for bad in (0, -3, 2**31):
        with pytest.raises(ValueError, match="outside"):
            fast_divisor(bad)


@pytest.mark.parametrize("block_m, blocks_per_sm", [(64, 2), (128, 1), (192, 1)])
@pytest.mark.parametrize("queue", [False, True])
def test_setmaxnreg_never_asks_for_more_registers_than_the_block_holds(block_m, blocks_per_sm, queue):
    """An increase past the block's registers waits forever: the producer's decrease and the
    consumers' increase must fit in what the launch bound gave every thread (in steps of 8)."""
    problem = FAMILY.problem("4,16,4096,64", "bfloat16", {"causal": True})
    params = {**WGMMA, "block_m": block_m, "block_n": 128, "stages": 2, "overlap": True, "pingpong": block_m == 128,
              "blocks_per_sm": blocks_per_sm, "persistent": True, "queue": queue}
    v = build_variant(FAMILY, problem, params, Target.for_arch("90"))
    (dec,), (inc,) = (re.findall(rf"setmaxnreg\.{op}\.sync\.aligned\.u32 (\d+)", v.source) for op in ("dec", "inc"))
    threads = v.launches[0].block[0]
    launch_regs = 65536 // (threads * blocks_per_sm) // 8 * 8
    assert 128 * int(dec) + (threads - 128) * int(inc) <= launch_regs * threads


def test_wgmma_variant_name_and_launch_take_tensor_maps():
    problem = FAMILY.problem("2,16,1000,128", "bfloat16", {"causal": True, "kv_heads": 4, "kv_len": 3000})
    params = {**WGMMA, "block_m": 128, "block_n": 176, "stages": 2, "overlap": True, "pingpong": True}
    v = build_variant(FAMILY, problem, params, Target.for_arch("90"))
    assert v.name == "attention_bf16_d128_causal_g4_wgmma_m128_n176_s2_ov_pp"
    (launch,) = v.launches
    assert launch.grid == (8, 16, 2) and launch.block == (384, 1, 1), "a producer and two consumer warpgroups"
    assert launch.shared_mem == 2 * 128 * (128 + 2 * 2 * 176) + 1024 + 8 * (2 + 4 * 2)
    q, k, val = launch.args[:3]
    assert q == TensorMap("q", (2, 16, 1000, 128), (1, 1, 128, 64), "bfloat16")
    assert k == TensorMap("k", (2, 4, 3000, 128), (1, 1, 176, 64), "bfloat16") and val == TensorMap(
        "v", (2, 4, 3000, 128), (1, 1, 176, 64), "bfloat16")
    assert launch.args[3:] == ("o", "lse", "scale", 16, 2) and v.workspace_bytes == 0, "heads and batch as ints"
    with pytest.raises(UserError, match="must fit in shared memory"):  # a second Q buffer does not fit beside them
        build_variant(FAMILY, problem, {**params, "persistent": True}, Target.for_arch("90"))
    persistent = build_variant(FAMILY, problem, {**params, "block_n": 128, "persistent": True}, Target.for_arch("90"))
    (launch,) = persistent.launches
    assert persistent.name.endswith("_n128_s2_ov_pp_pers") and launch.grid == (132, 1, 1), "one block per SM walks the tiles"
    assert launch.shared_mem == 2 * 128 * (2 * 128 + 2 * 2 * 128) + 1024 + 8 * (4 + 4 * 2), "Q double-buffered"
    with pytest.raises(UserError, match="only persistent blocks take more than one tile"):
        build_variant(FAMILY, problem, {**params, "block_n": 128, "queue": True}, Target.for_arch("90"))
    queued = build_variant(FAMILY, problem, {**params, "block_n": 128, "persistent": True, "queue": True},
                           Target.for_arch("90"))
    (launch,) = queued.launches
    assert queued.name.endswith("_n128_s2_ov_pp_pers_queue") and launch.grid == (132, 1, 1)
    assert launch.args[-1] == "workspace" and queued.workspace_bytes == 8, "the tile counter and the blocks done"
    assert launch.args[3] == TensorMap("o", (2, 16, 1000, 128), (1, 1, 64, 64), "bfloat16", always_contiguous=True), \
        "with a queue a consumer's 64 rows are stored by the tensor-memory accelerator"
    assert launch.args[3].stride_names == (), "the output is contiguous: no stride arguments"
    assert "tma_store(&tm_o" in queued.source and "tma_store(&tm_o" not in persistent.source
    hq_mul, hq_shift, last_mul, last_shift = (int(a) for a in launch.args[9:13])
    assert [(n * hq_mul) >> hq_shift for n in (0, 15, 16, 31)] == [0, 0, 1, 1], "the head count as multiplier and shift"
    # lpt's groups: 2 * 3000 * 128 * 2 bytes of K and V per KV head, 16 fit in half of 50 MB, 4 query heads each
    assert [(n * last_mul) >> last_shift for n in (31, 32, 95)] == [0, 1, 2], "the last group: all 32 (batch, head) pairs"
    assert "divide(flat_head, hq_mul, hq_shift)" in queued.source and "divide(" not in persistent.source.split("__global__")[1]
    assert launch.shared_mem == persistent.launches[0].shared_mem + 8, "the Q buffers' tile numbers"
    assert "atomicAdd(queue, 1)" in queued.source and "atomicAdd" not in persistent.source
    assert q.stride_names == ("q_stride0", "q_stride1", "q_stride2")
    assert ARCH_SPECIFIC in v.source and "setmaxnreg.inc.sync.aligned.u32 240" in v.source


@pytest.mark.parametrize("shape, dtype, options", [
    ("4,16,4096,128", "bfloat16", {}),
    ("1,8,1000,64", "float16", {"kv_heads": 2, "kv_len": 3333, "causal": True, "window_left": 100, "softcap": 30.0}),
    ("2,4,300,256", "bfloat16", {"window_right": 7}),
])
def test_a_sample_of_wgmma_variants_compiles_for_sm90a_without_degrading_warnings(shape, dtype, options):
    """Every wgmma seed of the problem compiles with NVRTC for sm_90a, and none is rejected for a
    ptxas warning that setmaxnreg was ignored or a wgmma serialised (compile_source fails those)."""
    problem = FAMILY.problem(shape, dtype, options)
    target = Target.for_arch("90")
    seeds = [p for p in [FAMILY.default_params(problem, target)] + FAMILY.seed_params(problem, target)
             if p["engine"] == "wgmma"]
    assert seeds
    for params in seeds[:4]:
        result = compile_source(build_variant(FAMILY, problem, params, target).source, "90")
        assert result.ok, result.log[:2000]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_two_key_tiles_without_a_mask_keep_the_wgmma_pipelined(dtype):
    """With two key tiles and no mask ptxas laid the key loop out straight and, for 128 rows of
    128-key tiles without ping-pong (a seed of 1x2x256x128), ran short of registers and
    serialised the wgmma (C7512), which compile_source rejects: the GPU tier's sampled variants
    failed on it. The template hides the tile count from ptxas there."""
    problem = FAMILY.problem("1,2,256,128", dtype, {})
    target = Target.for_arch("90")
    params = {**FAMILY.default_params(problem, target), "block_m": 128, "block_n": 128, "pingpong": False,
              "chain": False, "persistent": True, "overlap": True}
    assert FAMILY.is_valid(problem, target, params)
    variant = build_variant(FAMILY, problem, params, target)
    assert variant.name.endswith("d128_wgmma_m128_n128_s2_ov_pers"), variant.name
    result = compile_source(variant.source, "90")
    assert result.ok, result.log[:2000]
    assert "asm(\"\" : \"+r\"(n_tiles));" in variant.source
    # longer problems render the loop as before: the tile count stays a constant there
    longer = build_variant(FAMILY, FAMILY.problem("1,2,384,128", dtype, {}), params, target)
    assert "(n_tiles));" not in longer.source


def test_a_wgmma_entry_tuned_before_lazy_rescaling_builds_the_kernel_it_timed():
    """Entries stored before `rescale` existed hold no value of it: they render the eager kernel,
    byte for byte; the lazy one skips a warp's rescale of O unless one of its rows moved its max."""
    target = Target.for_arch("90")
    problem = FAMILY.problem("2,8,1000,128", "bfloat16", ("causal",))
    eager = FAMILY.default_params(problem, target)
    assert eager["engine"] == "wgmma" and eager["rescale"] == "eager"
    stored = {n: v for n, v in eager.items() if n != "rescale"}
    assert build_variant(FAMILY, problem, stored, target).source == build_variant(FAMILY, problem, eager, target).source
    lazy = build_variant(FAMILY, problem, {**eager, "rescale": "lazy"}, target)
    assert lazy.name.endswith("_lazy") and "__any_sync" in lazy.source and "RESCALE_LOG2" in lazy.source
    assert "__any_sync" not in build_variant(FAMILY, problem, eager, target).source


def test_wgmma_is_the_hopper_default_for_prefill_and_never_for_other_gpus_or_decoding():
    sm90, sm80 = Target.for_arch("90"), Target.for_arch("80")
    prefill = FAMILY.problem("4,16,4096,128", "bfloat16", ("causal",))
    assert FAMILY.default_params(prefill, sm90)["engine"] == "wgmma"
    assert FAMILY.default_params(prefill, sm80)["engine"] == "mma"
    assert all(p["engine"] == "mma" for p in FAMILY.seed_params(prefill, sm80))
    decode = FAMILY.problem("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 32768})
    assert FAMILY.default_params(decode, sm90)["engine"] == "mma"
    for d in (32, 80, 96, 192):  # rows of 64- or 32-byte chunks, or three 128-byte ones
        other = FAMILY.problem(f"1,8,4096,{d}", "bfloat16")
        assert FAMILY.default_params(other, sm90)["engine"] == "wgmma", d
    seeds = FAMILY.seed_params(prefill, sm90)
    assert _mma_default(prefill, sm90) in seeds and FAMILY.default_params(prefill, sm90) not in seeds


def test_chained_tiles_are_persistent_overlapped_wgmma_and_the_d128_ping_pong_default():
    """`chain` issues a block's next tile's first S with its current tile's last P.V: only
    persistent overlapped blocks have both; the default takes it for persistent ping-pong at D = 128."""
    sm90 = Target.for_arch("90")
    full = FAMILY.problem("4,16,4096,128", "bfloat16")
    default = FAMILY.default_params(full, sm90)
    assert (default["pingpong"], default["persistent"], default["chain"]) == (True, True, True)
    variant = build_variant(FAMILY, full, default, sm90)
    assert variant.name.endswith("_pers_chain") and "fin_sum" in variant.source and "primed = chained" in variant.source
    plain = build_variant(FAMILY, full, {**default, "chain": False}, sm90)
    assert "fin_sum" not in plain.source and plain.launches == variant.launches
    for flags, d in (((), 64), (("causal",), 128)):  # three consumers at D = 64; causal blocks are not persistent
        assert not FAMILY.default_params(FAMILY.problem(f"4,16,4096,{d}", "bfloat16", flags), sm90)["chain"]
    for change in ({"persistent": False, "queue": False}, {"overlap": False, "pingpong": False}):
        with pytest.raises(UserError, match="next tile"):
            build_variant(FAMILY, full, {**default, **change}, sm90)
    causal = FAMILY.problem("4,16,4096,128", "bfloat16", ("causal",))
    assert any(p.get("chain") and p.get("queue") for p in FAMILY.seed_params(causal, sm90)[:4])


def test_short_causal_rows_default_to_persistent_blocks_taking_tiles_from_a_queue():
    sm90 = Target.for_arch("90")
    few_heads = FAMILY.default_params(FAMILY.problem("4,16,1024,64", "bfloat16", ("causal",)), sm90)
    many_heads = FAMILY.default_params(FAMILY.problem("16,16,512,64", "bfloat16", ("causal",)), sm90)
    for p in (few_heads, many_heads):
        assert (p["engine"], p["block_m"], p["blocks_per_sm"], p["persistent"], p["queue"]) == ("wgmma", 64, 2, True, True)
    assert few_heads["lpt"] and not many_heads["lpt"], "longest first across 64 heads, not across 256"
    for shape in ("16,16,512,64", "4,16,4096,64"):  # no mask, or long rows: no queue
        flags = ("causal",) if shape.endswith("4096,64") else ()
        assert not FAMILY.default_params(FAMILY.problem(shape, "bfloat16", flags), sm90)["queue"]
    variant = build_variant(FAMILY, FAMILY.problem("4,16,1024,64", "bfloat16", ("causal",)), few_heads, sm90)
    assert variant.workspace_bytes == 8 and variant.name.endswith("_2cta_lpt_pers_queue")


def test_rows_shorter_than_two_128_key_tiles_default_to_wgmma_with_64_key_tiles():
    """Two stages of 128-key tiles load nothing on 128 keys; the default was then the mma engine's."""
    sm90 = Target.for_arch("90")
    for shape, flags, block_m in (("32,16,128,64", (), 64), ("32,16,128,128", (), 128), ("1,8,120,128", ("causal",), 128)):
        problem = FAMILY.problem(shape, "bfloat16", flags)
        p = FAMILY.default_params(problem, sm90)
        assert (p["engine"], p["block_n"], p["block_m"]) == ("wgmma", 64, block_m), shape
        result = compile_source(build_variant(FAMILY, problem, p, sm90).source, "90")
        assert result.ok, result.log[-2000:]
    assert FAMILY.default_params(FAMILY.problem("16,8,256,64", "bfloat16", ("causal",)), sm90)["block_n"] == 128


@pytest.mark.skipif(_tool("nvcc") is None or _tool("cuobjdump") is None, reason="nvcc or cuobjdump not installed")
def test_wgmma_sass_has_warpgroup_mma_and_tensor_memory_copies(tmp_path):
    problem = FAMILY.problem("1,8,1000,128", "bfloat16", ("causal",))
    target = Target.for_arch("90")
    cubin = _nvcc_cubin(tmp_path, build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target).source,
                        "90")
    sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True).stdout
    for op in ("HGMMA.64x128x16.F32.BF16", "UTMALDG.4D", "SYNCS", "MUFU.EX2", "USETMAXREG"):
        assert op in sass, op


class _FakeEncoder:
    """Stands in for libcuda's cuTensorMapEncodeTiled: records what it is given, writes a pattern."""

    def __init__(self, result: int = 0):
        self.calls, self.result = [], result

    @property
    def cuTensorMapEncodeTiled(self):  # noqa: N802 - the driver's name
        import ctypes

        def encode(out, dtype, rank, address, dims, strides, box, ones, interleave, swizzle, l2, oob):
            self.calls.append({"aligned": out.value % 64 == 0, "dtype": dtype, "rank": rank, "address": address.value,
                               "dims": list(dims), "strides": list(strides), "box": list(box), "ones": list(ones),
                               "modes": (interleave, swizzle, l2, oob)})
            ctypes.memmove(out.value, bytes(range(128)), 128)
            return self.result
        return encode


def test_tensor_maps_are_encoded_innermost_first_with_byte_strides(monkeypatch):
    from autosoft import runtime

    fake = _FakeEncoder()
    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: fake)
    q = TensorMap("q", (2, 16, 1000, 128), (1, 1, 128, 64), "bfloat16")
    # a (B, N, H, D) view transposed to (B, H, N, D): strides (N*H*D, D, H*D) elements
    encoded = runtime.encode_tensor_map(q, 0x7F0000001000, (1000 * 16 * 128, 128, 16 * 128))
    assert encoded == bytes(range(128))
    (call,) = fake.calls
    assert call["aligned"] and call["dtype"] == 9 and call["rank"] == 4 and call["address"] == 0x7F0000001000
    assert call["dims"] == [128, 1000, 16, 2] and call["box"] == [64, 128, 1, 1] and call["ones"] == [1, 1, 1, 1]
    assert call["strides"] == [16 * 128 * 2, 128 * 2, 1000 * 16 * 128 * 2], "N, H, B strides in bytes"
    assert call["modes"] == (0, 3, 2, 0), "no interleave, 128-byte swizzle, 128-byte L2 promotion, zero fill"


def test_a_box_row_narrower_than_128_bytes_takes_its_own_swizzle(monkeypatch):
    """D = 96 tiles are rows of three 64-byte chunks (D = 80 would be 32-byte ones): the map's
    swizzle is its box row's width, the layout the kernel's descriptors read."""
    from autosoft import runtime

    fake = _FakeEncoder()
    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: fake)
    for cols, code in ((32, 2), (16, 1), (64, 3)):
        runtime.encode_tensor_map(TensorMap("q", (1, 2, 100, 96 if cols != 16 else 80), (1, 1, 64, cols), "float16"), 4096)
    assert [c["modes"][1] for c in fake.calls] == [2, 1, 3], "CU_TENSOR_MAP_SWIZZLE_64B, _32B, _128B"


def test_a_dimension_of_one_takes_a_contiguous_stride_and_none_means_contiguous(monkeypatch):
    from autosoft import runtime

    fake = _FakeEncoder()
    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: fake)
    k = TensorMap("k", (1, 1, 300, 64), (1, 1, 64, 64), "float16")
    runtime.encode_tensor_map(k, 4096, (3, 5, 64))  # torch may give any stride to a dimension of one
    runtime.encode_tensor_map(k, 4096, None)
    first, second = fake.calls
    assert first["strides"] == second["strides"] == [64 * 2, 300 * 64 * 2, 300 * 64 * 2]
    assert first["dtype"] == 6


def test_a_refused_tensor_map_is_an_error_naming_the_array(monkeypatch):
    from autosoft import runtime

    monkeypatch.setattr(runtime._libcuda_driver, "cu", lambda: _FakeEncoder(result=1))
    v = TensorMap("v", (1, 2, 300, 64), (1, 1, 64, 64), "bfloat16")
    with pytest.raises(RuntimeError, match=r"cuTensorMapEncodeTiled refused the map of v .*CUresult 1"):
        runtime.encode_tensor_map(v, 4104, None)


@pytest.mark.parametrize("cap", [1e-300, 1e308])
def test_softcaps_float32_cannot_hold_are_refused(cap):
    with pytest.raises(UserError, match="float32"):
        FAMILY.problem("1,2,64,64", "float16", {"softcap": cap})
    with pytest.raises(ValueError, match="float32"):
        call_options(False, None, cap)


def test_render_with_one_engine_takes_that_engines_default_and_refuses_the_others_parameters():
    problem = FAMILY.problem("1,32,4096,128", "bfloat16")
    sm90 = Target.for_arch("90")
    params, given = params_from_text(FAMILY, problem, sm90, ["engine=mma"])
    assert params == _mma_default(problem, sm90) and given == {"engine"}
    with pytest.raises(UserError, match="mma engine, not of wgmma"):
        params_from_text(FAMILY, problem, sm90, ["engine=wgmma", "warps=4"])
    with pytest.raises(UserError, match="given twice"):
        params_from_text(FAMILY, problem, sm90, ["stages=2", "stages=3"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("d", [32, 80, 96, 192])
def test_wgmma_defaults_of_narrow_and_wide_rows_build_without_spilling(tmp_path, d):
    """Rows of 64- and 32-byte chunks (D = 32, 96, 80) and three 128-byte ones (192): the defaults,
    full and causal, compile for sm_90a with nothing spilled."""
    target = Target.for_arch("90")
    for options in ({}, {"causal": True}):
        problem = FAMILY.problem(f"4,16,4096,{d}", "bfloat16", options)
        params = FAMILY.default_params(problem, target)
        assert params["engine"] == "wgmma"
        path = tmp_path / "k.cu"
        path.write_text(build_variant(FAMILY, problem, params, target).source)
        result = subprocess.run([shutil.which("nvcc"), "-cubin", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas",
                                 "-v", "-o", str(tmp_path / "k.cubin"), str(path)], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "bytes spill stores" not in result.stderr.replace(" 0 bytes spill stores", ""), (options, result.stderr[-2000:])
