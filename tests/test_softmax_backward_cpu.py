"""The softmax_backward family on the CPU tier: problems and the command line, the search space's
constraints, rendering and NVRTC compilation of every example's default and a sample of variants
for sm_90 and sm_80, register spills under nvcc, and `check` (with NumPy standing in for CuPy)
accepting an exact dx and an fp32 one while rejecting wrong ones."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import random
import re
import subprocess

import numpy as np
import pytest

from autosoft.compile import COMPILE_OPTIONS, compile_source
from autosoft.dtypes import ITEMSIZE, to_float64
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Problem, Target, build_variant, space_of
from autosoft.families.softmax_backward import _store

from autosoft.testing.conformance import sample_points
from helpers import nvcc_path, run_cli

# one worker runs the module under `pytest -n 2 --dist loadgroup`: the examples' spaces are enumerated once
pytestmark = pytest.mark.xdist_group("softmax_backward")

FAMILY = get_family("softmax_backward")
ARCHS = ("90", "80")
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__\w+__\s*\([^)]*\)\s+)*(\w+)\s*\(')


def _examples() -> list[Problem]:
    return [FAMILY.problem(shape, dtype, options) for shape, dtype, options in FAMILY.examples]


@functools.lru_cache(maxsize=None)  # the examples' spaces, enumerated once per process for every test here
def _valid(problem: Problem, arch: str = "90") -> list[dict]:
    return space_of(FAMILY).valid_points(FAMILY.problem_values(problem, Target.for_arch(arch)))


# --- problems and the command line --------------------------------------------------------------

def test_problems_parse_and_the_log_flag_is_part_of_the_key():
    problem = FAMILY.problem("4096x1024", "float16", {"log": True})
    assert problem.shape == (4096, 1024) and problem.flags == ("log",)
    assert problem.shape_text == "4096x1024+log"
    assert FAMILY.parse_problem("4096x1024+log", "float16") == problem
    assert FAMILY.problem("4096x1024", "float16").shape_text == "4096x1024"
    assert FAMILY.problem(" 3 X 5 ", "bfloat16").shape == (3, 5)
    for bad in ("4096x", "0x5", "5x0", "2x3x4", "axb", "1x2147483647"):
        with pytest.raises(UserError):
            FAMILY.problem(bad, "float32")
    with pytest.raises(UserError):
        FAMILY.problem("4x8", "float32", {"causal": True})


def test_problem_for_flattens_leading_dimensions_and_wants_equal_shapes():
    problem = FAMILY.problem_for({"y": (3, 5, 1000), "dy": (3, 5, 1000)}, "float16", {"log": True})
    assert problem == FAMILY.problem("15x1000", "float16", {"log": True})
    with pytest.raises(ValueError, match="same shape"):
        FAMILY.problem_for({"y": (4, 8), "dy": (4, 9)}, "float32", {})
    assert FAMILY.caller_outputs({"y": (3, 5, 7), "dy": (3, 5, 7)}, "bfloat16", {}) == {"dx": ((3, 5, 7), "bfloat16")}


def test_bytes_moved_reads_y_and_dy_and_writes_dx():
    assert FAMILY.bytes_moved(FAMILY.problem("4096x8192", "float32")) == 3 * 4096 * 8192 * 4
    assert FAMILY.bytes_moved(FAMILY.problem("7x1025", "bfloat16", {"log": True})) == 3 * 7 * 1025 * 2
    assert FAMILY.flops(FAMILY.problem("7x1025", "float16")) == 0


def test_render_through_the_cli_with_log(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_cli(["render", "softmax_backward", "--shape", "4096x1024", "--dtype", "float16", "--log"], cache_dir)
    assert result.returncode == 0, result.stderr
    src = result.stdout
    first = src.splitlines()[0]
    assert first.startswith("// autosoft softmax_backward variant softmax_backward_f16_") and first.endswith("_log")
    assert "constexpr int N = 1024;" in src and "exp(y[r, :]) * sum(dy[r, :])" in src
    assert compile_source(src, "90").ok
    assert not cache_dir.exists(), "render touches no cache"
    plain = run_cli(["render", "softmax_backward", "--shape", "4096x1024", "--dtype", "float16"], cache_dir)
    assert plain.returncode == 0, plain.stderr
    assert "_log" not in plain.stdout.splitlines()[0] and "sum(dy[r, :] * y[r, :])" in plain.stdout


def test_tune_help_names_the_log_flag(tmp_path):
    out = run_cli(["tune", "softmax_backward", "--help"], tmp_path / "cache").stdout
    assert "--log" in out and "log-softmax" in out and "--causal" not in out


@pytest.mark.parametrize("args", [["--shape", "4096x"], ["--shape", "4x8", "--causal"],
                                  ["--shape", "4x1024", "--param", "vec=3"],
                                  ["--shape", "4x3", "--param", "vec=4"]], ids=str)
def test_cli_user_errors_are_one_line(args, tmp_path):
    result = run_cli(["render", "softmax_backward", *args], tmp_path / "cache")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


# --- the search space ------------------------------------------------------------------------------

def test_every_parameter_is_documented_and_every_constraint_says_why():
    space = space_of(FAMILY)
    assert all(p.doc for p in space.parameters)
    assert space.constraints and all(c.why and len(c.why) > 15 for c in space.constraints)


@pytest.mark.parametrize("arch", ARCHS)
def test_valid_points_keep_the_promises_the_kernels_rely_on(arch):
    target = Target.for_arch(arch)
    for problem in _examples():
        m, n = problem.shape
        itemsize = ITEMSIZE[problem.dtype]
        points = _valid(problem, arch)
        assert points, problem
        for p in points:
            assert p["vec"] * itemsize <= 16 and p["vec"] <= n, p
            assert p["vec"] <= p["row_threads"], p  # a thread per element of a scalar head or tail
            assert p["row_threads"] <= p["threads"]
            assert (p["split"] == 1) == (p["combine"] == "none"), p
            if p["combine"] == "cluster":
                assert arch == "90" and p["split"] <= 16
            if p["split"] > 1:
                seg = -(-(-(-n // p["split"])) // 8) * 8
                assert p["row_threads"] == p["threads"] and not p["persistent"], p  # a block per segment
                assert -(-n // seg) == p["split"], p  # no empty segment
            if p["combine"] == "grid":
                # the whole grid resident: 2048 threads and 32 blocks per SM at most
                assert m * p["split"] <= target.sm_count * min(2048 // p["threads"], 32), p
            if p["storage"] == "registers":
                assert p["unroll"] == 1
            seg = n if p["split"] == 1 else -(-(-(-n // p["split"])) // 8) * 8
            if p["storage"] == "smem":  # cp.async sizes; y's and dy's slots of every row group fit
                assert p["vec"] * itemsize >= 4 and p["unroll"] == 1, p
                slots = 2 * (p["threads"] // p["row_threads"]) * (-(-seg // 8) * 8) * itemsize
                assert slots <= target.smem_optin - 4096, p
            else:
                assert p["chunks"] == 1, p
            assert p["chunks"] <= max(1, -(-(seg // p["vec"]) // p["row_threads"])), p


def test_an_invalid_point_is_refused_with_its_why():
    problem = FAMILY.problem("4x1026", "float32")
    target = Target.for_arch("90")
    params = {**FAMILY.default_params(problem, target), "vec": 4, "threads": 128, "row_threads": 2}
    with pytest.raises(UserError, match="one thread per element"):
        build_variant(FAMILY, problem, params, target)
    wide = FAMILY.problem("4x131072", "float32")
    cluster = {**FAMILY.default_params(wide, target), "storage": "registers", "unroll": 1, "split": 8,
               "combine": "cluster", "threads": 1024, "row_threads": 1024, "persistent": False}
    assert FAMILY.is_valid(wide, target, cluster)
    assert not FAMILY.is_valid(wide, Target.for_arch("80"), cluster), "clusters need sm_90"
    assert not FAMILY.is_valid(wide, target, {**cluster, "split": 32}), "a cluster holds 16 blocks at most"
    # 1000 rows x 64 blocks never fit on the GPU at once
    many = FAMILY.problem("1000x131072", "float32")
    assert not FAMILY.is_valid(many, target, {**cluster, "combine": "grid", "split": 64})


def test_variant_names_are_unique_among_all_valid_points():
    for problem in _examples():
        for arch in ARCHS:
            names = [FAMILY.variant_name(problem, p) for p in _valid(problem, arch)]
            assert len(set(names)) == len(names), problem
            assert all(re.fullmatch(r"softmax_backward_\w+", n) for n in names)
            assert all(n.endswith("_log") or "_log_" in n for n in names) == bool(problem.option("log"))


def test_the_default_uses_16_byte_vectors_when_the_row_allows_and_splits_few_wide_rows():
    target = Target.for_arch("90")
    for shape, dtype, vec in (("4096x8192", "float32", 4), ("4096x8192", "bfloat16", 8), ("4x1026", "float16", 8),
                              ("7x1025", "float32", 4), ("3x5", "float16", 4), ("1x1", "bfloat16", 1)):
        assert FAMILY.default_params(FAMILY.problem(shape, dtype), target)["vec"] == vec
    wide = FAMILY.default_params(FAMILY.problem("1x1048576", "bfloat16"), target)
    assert wide["split"] > 1 and wide["combine"] != "none"
    wide80 = FAMILY.default_params(FAMILY.problem("1x1048576", "bfloat16"), Target.for_arch("80"))
    assert wide80["combine"] == "grid"
    assert FAMILY.default_params(FAMILY.problem("4096x8192", "float32"), target)["split"] == 1


def test_few_rows_past_the_registers_reach_split_and_stream_twice():
    """Float32 8x500000: y and dy (32 MB) outgrow the registers of every split whose blocks can all
    be resident, and a segment outgrows shared memory, so the default streams split segments."""
    target = Target(arch="90", name="NVIDIA H100 80GB HBM3", sm_count=132, smem_optin=227 * 1024)
    problem = FAMILY.problem("8x500000", "float32")
    values = FAMILY.problem_values(problem, target)
    valid = space_of(FAMILY).valid_points(values)
    assert not [p for p in valid if p["split"] > 1 and p["storage"] != "reread"]
    params = FAMILY.default_params(problem, target)
    assert params["split"] > 1 and params["storage"] == "reread", params
    source = build_variant(FAMILY, problem, params, target).source
    exchange = ", exchange" if params["combine"] == "grid" else ""
    assert f"s = row_sum(s, scratch{exchange});" in source, "the streamed segment's sum is the row's"
    seeds = FAMILY.seed_params(problem, target)
    assert {p["combine"] for p in seeds if p["split"] > 1} == {"cluster", "grid"}


def test_grid_split_launch_declares_its_workspace():
    problem = FAMILY.problem("2x262144", "float32")
    target = Target.for_arch("80")
    params = FAMILY.default_params(problem, target)
    assert params["combine"] == "grid"
    variant = build_variant(FAMILY, problem, params, target)
    (launch,) = variant.launches
    assert launch.cooperative and launch.grid[0] == 2 * params["split"] and "workspace" in launch.args
    assert variant.workspace_bytes == 2 * params["split"] * 4 + 2 * 4


# --- rendering and compiling -----------------------------------------------------------------------

def _compile_job(source: str, arch: str) -> tuple[bool, str, bytes]:
    result = compile_source(source, arch)
    return result.ok, result.log, result.cubin


@functools.lru_cache(maxsize=1)
def _built() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name, arch, source, kernels) of every example's default, its first seed and a random valid
    point, with a split of each kind and a log variant among them, for sm_90 and sm_80."""
    out = []
    for arch in ARCHS:
        target = Target.for_arch(arch)
        for i, problem in enumerate(_examples()):
            points = sample_points(FAMILY, problem, target, 0, seed=i, seeds=1)
            valid = _valid(problem, arch)
            rng = random.Random(f"{problem.shape_text}-{arch}")
            points += rng.sample(valid, 1)
            for combine in ("cluster", "grid"):
                kind = [p for p in valid if p["combine"] == combine]
                points += rng.sample(kind, min(1, len(kind)))
            reread = [p for p in valid if p["storage"] == "reread" and p["unroll"] > 1]
            points += rng.sample(reread, min(1, len(reread)))
            reread_split = [p for p in valid if p["storage"] == "reread" and p["split"] > 1]
            points += rng.sample(reread_split, min(1, len(reread_split)))
            for split in (False, True):  # staged in shared memory, a row per group and split
                staged = [p for p in valid if p["storage"] == "smem" and (p["split"] > 1) == split]
                points += rng.sample(staged, min(1, len(staged)))
            for p in points:
                v = build_variant(FAMILY, problem, p, target)
                out.append((v.name, arch, v.source, v.kernel_names))
    return out


def test_sample_covers_every_strategy():
    names = [name for name, *_ in _built()]
    for part in ("_registers", "_reread", "_smem", "_cluster", "_grid", "_log", "_cs", "_persistent", "_v1_", "_v8_",
                 "_g1_"):
        assert any(part in n for n in names), part
    assert any(re.search(r"_u[248]_reread", n) for n in names)
    assert any(re.search(r"_smem(_log)?_c[24]", n) for n in names), "chunked copies"
    assert any(re.search(r"_smem.*_(cluster|grid)\d+", n) for n in names), "split rows staged"
    assert any(re.search(r"_reread.*_cluster\d+", n) for n in names), "split rows streamed, over a cluster"
    assert any(re.search(r"_reread.*_grid\d+", n) for n in names), "split rows streamed, over a grid"


def test_example_defaults_and_sampled_variants_compile_with_nvrtc_for_sm90_and_sm80():
    built = _built()
    jobs = sorted({(src, arch) for _, arch, src, _ in built}, key=lambda j: (len(j[0]), j[1]))
    with cf.ProcessPoolExecutor(max_workers=2) as pool:
        results = dict(zip(jobs, pool.map(_compile_job, [s for s, _ in jobs], [a for _, a in jobs], chunksize=4)))
    failures = []
    for name, arch, src, kernels in built:
        ok, log, cubin = results[(src, arch)]
        if not ok:
            failures.append(f"{name} sm_{arch}: {log[:1500]}")
            continue
        assert tuple(KERNEL_RE.findall(src)) == kernels, name  # exactly the launched kernels
        assert all(k.encode() in cubin for k in kernels), name
        assert "{{" not in src and "{%" not in src
    assert not failures, "\n".join(failures)


LARGE = ("4096x8192", "4097x8192", "65536x64", "32x131072", "1x1048576", "4096x50257")


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_defaults_of_the_large_examples_build_with_nvcc_without_spilling(arch, tmp_path):
    target = Target.for_arch(arch)
    checked = 0
    for problem in _examples():
        if problem.shape_text.split("+")[0] not in LARGE:
            continue
        variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, target), target)
        source = tmp_path / f"{variant.name}.cu"
        source.write_text(variant.source)
        result = subprocess.run([nvcc_path(), "-cubin", f"-arch=sm_{arch}", *COMPILE_OPTIONS, "-Xptxas", "-v",
                                 "-o", str(tmp_path / "k.cubin"), str(source)], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", result.stderr)]
        assert spills and not any(spills), f"{variant.name} sm_{arch} spills: {result.stderr[-1500:]}"
        checked += 1
    assert checked == len(LARGE)


# --- inputs and check (NumPy as xp) ---------------------------------------------------------------

def _inputs(problem: Problem, kind: str, seed: int = 0) -> dict:
    return FAMILY.make_inputs(problem, kind, np, np.random.default_rng(seed))


def _exact(problem: Problem, inputs: dict) -> np.ndarray:
    """dx in float64 from the stored y and dy."""
    y = to_float64(inputs["y"], problem.dtype, np)
    dy = to_float64(inputs["dy"], problem.dtype, np)
    if problem.option("log"):
        return dy - np.exp(y) * dy.sum(axis=1, keepdims=True)
    return y * (dy - (dy * y).sum(axis=1, keepdims=True))


def _fp32_kernel(problem: Problem, inputs: dict) -> np.ndarray:
    """dx as an fp32 kernel computes it: fp32 terms summed in order per thread (here: the row in
    one sequential fp32 sum, the worst a kernel does), fp32 products, rounded once to the dtype."""
    y = to_float64(inputs["y"], problem.dtype, np).astype(np.float32)
    dy = to_float64(inputs["dy"], problem.dtype, np).astype(np.float32)
    terms = dy if problem.option("log") else dy * y
    s = np.add.accumulate(terms, axis=1, dtype=np.float32)[:, -1:]
    with np.errstate(over="ignore", invalid="ignore"):
        dx = dy - np.exp(y) * s if problem.option("log") else y * (dy - s)
    return dx.astype(np.float32)


PROBLEMS = [("5x1000", "float32", False), ("5x1000", "float16", True), ("3x4096", "bfloat16", False),
            ("3x4096", "bfloat16", True), ("4x65536", "float32", True), ("2x65536", "float16", False),
            ("1x1", "float32", False), ("1x1", "bfloat16", True),
            ("2x1048576", "float32", True), ("1x1048576", "bfloat16", False)]  # a sequential fp32 sum of 1M terms


@pytest.mark.parametrize("shape,dtype,log", PROBLEMS, ids=str)
@pytest.mark.parametrize("kind", FAMILY.input_kinds)
def test_check_accepts_exact_and_fp32_results_and_rejects_wrong_ones(shape, dtype, log, kind):
    problem = FAMILY.problem(shape, dtype, {"log": log})
    inputs = _inputs(problem, kind, seed=len(shape) + len(kind))
    exact = _exact(problem, inputs)
    assert FAMILY.check(problem, inputs, {"dx": _store(exact, dtype)}, np) is None
    assert FAMILY.check(problem, inputs, {"dx": _store(_fp32_kernel(problem, inputs).astype(np.float64), dtype)},
                        np) is None
    m, n = problem.shape
    # one element moved by 1% of its row's largest gradient (and at least 1e-3 of a unit)
    r, c = m // 2, n // 3
    moved = exact.copy()
    moved[r, c] += max(1e-2 * float(np.abs(exact[r]).max()), 1e-3)
    message = FAMILY.check(problem, inputs, {"dx": _store(moved, dtype)}, np)
    assert message is not None and message.startswith("1 of") and f"[{r}, {c}]" in message, message
    nan = exact.copy()
    nan[r, c] = np.nan
    assert FAMILY.check(problem, inputs, {"dx": _store(nan, dtype)}, np) is not None
    if n > 1 and kind != "equal_rows":  # a kernel that forgets the row sum (equal rows of one element: sum terms cancel)
        y = to_float64(inputs["y"], dtype, np)
        dy = to_float64(inputs["dy"], dtype, np)
        forgot = dy if log else y * dy
        assert FAMILY.check(problem, inputs, {"dx": _store(forgot, dtype)}, np) is not None


def test_poisoned_output_fails():
    from autosoft.dtypes import poisoned

    for dtype in ("float32", "float16", "bfloat16"):
        problem = FAMILY.problem("3x64", dtype)
        inputs = _inputs(problem, "normal")
        assert "192 of 192" in FAMILY.check(problem, inputs, {"dx": poisoned((3, 64), dtype, np)}, np)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_inputs_are_true_softmax_outputs_and_random_gradients(dtype):
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    for kind in FAMILY.input_kinds:
        plain = FAMILY.problem("6x777", dtype)
        inputs = _inputs(plain, kind)
        y = to_float64(inputs["y"], dtype, np)
        assert np.all(y >= 0) and np.allclose(y.sum(axis=1), 1, atol=tol * 10), kind
        dy = to_float64(inputs["dy"], dtype, np)
        assert dy.std() > 0.5 and not np.any(np.all(dy == 0, axis=1))
        logged = FAMILY.problem("6x777", dtype, {"log": True})
        ly = to_float64(_inputs(logged, kind)["y"], dtype, np)
        assert np.all(ly <= 0) and np.allclose(np.log(np.exp(ly).sum(axis=1)), 0, atol=tol * 10), kind
        if kind == "neg_inf":
            assert np.any(y == 0) and np.any(np.isneginf(ly)) and np.all(np.isfinite(ly).any(axis=1))


def test_log_rows_with_minus_inf_give_dy_there():
    problem = FAMILY.problem("4x300", "float16", {"log": True})
    inputs = _inputs(problem, "neg_inf", seed=3)
    y = to_float64(inputs["y"], "float16", np)
    exact = _exact(problem, inputs)
    dy = to_float64(inputs["dy"], "float16", np)
    assert np.isneginf(y).any() and np.array_equal(exact[np.isneginf(y)], dy[np.isneginf(y)])
    assert np.isfinite(exact).all()
    assert FAMILY.check(problem, inputs, {"dx": _store(exact, "float16")}, np) is None


def test_every_valid_point_stays_valid_at_the_verification_shape():
    """Dispatch verifies a borrowed variant on fewer rows (verification_shape) with the same
    params: a constraint on M that a smaller M breaks would make that build fail."""
    target = Target.for_arch("90")
    for text in ("4096x8192", "100000x64", "1000x131072"):
        problem = FAMILY.problem(text, "bfloat16")
        small = Problem(problem.family, problem.dtype, FAMILY.verification_shape(problem.shape), problem.options)
        for p in random.Random(0).sample(_valid(problem), 300):
            assert FAMILY.is_valid(small, target, p), p
            assert build_variant(FAMILY, small, p, target).source == build_variant(FAMILY, problem, p, target).source


@pytest.mark.skipif(nvcc_path() is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_one_variant_of_each_strategy_builds_with_plain_nvcc(arch, tmp_path):
    """`nvcc -c -arch=sm_XX` with no options: the rendered source needs no header and no flag."""
    target = Target.for_arch(arch)
    problem = FAMILY.problem("12x65531", "bfloat16", {"log": True})
    odd = FAMILY.problem("1000x77", "float16")
    valid = _valid(problem, arch)
    picks = [(odd, FAMILY.default_params(odd, target)), (problem, FAMILY.default_params(problem, target))]
    for want in ({"storage": "reread", "unroll": 4}, {"combine": "grid"}, {"combine": "cluster"},
                 {"storage": "smem", "chunks": 2}, {"storage": "smem", "combine": "cluster"},
                 {"streaming": True, "persistent": True}, {"vec": 1}, {"storage": "reread", "combine": "grid"},
                 {"storage": "reread", "combine": "cluster"}):
        match = [p for p in valid if all(p[k] == v for k, v in want.items())]
        if arch == "80" and want.get("combine") == "cluster":
            assert not match, "clusters need sm_90"
            continue
        picks.append((problem, match[0]))
    for i, (prob, params) in enumerate(picks):
        variant = build_variant(FAMILY, prob, params, target)
        source = tmp_path / f"k{i}.cu"
        source.write_text(variant.source)
        result = subprocess.run([nvcc_path(), "-c", f"-arch=sm_{arch}", "-o", str(tmp_path / f"k{i}.o"), str(source)],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{variant.name}: {result.stderr[-2000:]}"


# Row lengths around every boundary of the default heuristic, and row counts around the split rule
DEFAULT_NS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000,
              1023, 1024, 1025, 2047, 2048, 4095, 4096, 4097, 8191, 8192, 16383, 16384, 32768, 50257, 65535,
              65536, 65537, 131072, 262144, 1048576, 16777217, 2**31 // 8 - 1]
DEFAULT_MS = [1, 3, 53, 54, 65, 66, 4096, 1_000_000]


@pytest.mark.parametrize("arch", ARCHS)
def test_the_default_is_valid_for_any_problem(arch):
    target = Target.for_arch(arch)
    for n in DEFAULT_NS:
        for m in DEFAULT_MS:
            for dtype in ("float32", "bfloat16"):
                problem = Problem("softmax_backward", dtype, (m, n))
                params = FAMILY.default_params(problem, target)
                assert FAMILY.is_valid(problem, target, params), (m, n, dtype, params)
                if n >= 16 // ITEMSIZE[dtype]:
                    assert params["vec"] * ITEMSIZE[dtype] == 16, (m, n, dtype, params)
