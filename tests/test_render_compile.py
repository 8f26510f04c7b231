"""render.py, compile.py and the softmax family's rendering: a deterministic sample of variants
renders to complete CUDA and compiles with NVRTC for sm_90 and sm_80, no GPU needed."""
from __future__ import annotations

import concurrent.futures as cf
import functools
import random
import re
import subprocess
from dataclasses import dataclass

import jinja2
import pytest

from autosoft.compile import COMPILE_OPTIONS, compile_source, source_digest
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import DTYPES, Problem, Target, build_variant, space_of
from autosoft.render import environment, render

from helpers import cuda_tool

# one worker runs the whole module under `pytest -n 2 --dist loadgroup`: its module fixtures are built once
pytestmark = pytest.mark.xdist_group("render_compile")

SOFTMAX = get_family("softmax")
ARCHS = ("90", "80")
SAMPLE_SHAPES = [(1, 1), (1, 3), (5, 3), (1, 1000), (3, 1000), (7, 1025), (33, 50257), (1, 50257),
                 (1, 131072), (4, 131072), (4096, 8192)]
# a few random points per (shape, dtype) and one split variant where they exist: every value of
# every parameter is then compiled (the draw's misses are added), each on some shape and dtype
PER_PROBLEM = 3
SPLITS_PER_PROBLEM = 1
KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__\w+__\s*\([^)]*\)\s+)*(\w+)\s*\(')

# Row lengths around every boundary of the default heuristic, and row counts around the split rule
DEFAULT_NS = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 1000,
              1023, 1024, 1025, 2047, 2048, 4095, 4096, 4097, 8191, 8192, 16383, 16384, 32768, 50257, 65535,
              65536, 65537, 131072, 262144, 1048576, 16777217, 2**31 // 8 - 1]
DEFAULT_MS = [1, 3, 65, 66, 4096, 1_000_000]


@dataclass(frozen=True)
class Built:
    label: str
    arch: str
    source: str
    kernels: tuple[str, ...]
    split: int


def _cubin_sm(cubin: bytes) -> int:
    """The SM version in a CUDA ELF's e_flags (bits 8-15 since CUDA 12.x, bits 0-7 before)."""
    import struct

    flags = struct.unpack_from("<I", cubin, 48)[0]
    return (flags >> 8) & 0xFF if (flags >> 8) & 0xFF >= 50 else flags & 0xFF


def _compile_job(source: str, arch: str) -> tuple[bool, str, bytes]:
    result = compile_source(source, arch)
    return result.ok, result.log, result.cubin


def _compile_all(built: list[Built]) -> dict[tuple[str, str], tuple[bool, str, bytes]]:
    """Compile each distinct (source, arch) once, on two CPU processes."""
    jobs = sorted({(b.source, b.arch) for b in built}, key=lambda j: (len(j[0]), j[1]))
    with cf.ProcessPoolExecutor(max_workers=2) as pool:
        results = pool.map(_compile_job, [s for s, _ in jobs], [a for _, a in jobs], chunksize=4)
        return dict(zip(jobs, results))


@functools.lru_cache(maxsize=1)
def _sample_points() -> list[tuple[Problem, dict]]:
    """Random valid points per (shape, dtype), split variants among them, then for every value of
    every parameter that the draw missed, one point that has it."""
    space = space_of(SOFTMAX)
    picks: list[tuple[Problem, dict]] = []
    pools: list[tuple[Problem, list[dict]]] = []
    enumerated: dict[tuple, list[dict]] = {}  # float16 and bfloat16 rows give the space the same values
    for shape in SAMPLE_SHAPES:
        for dtype in DTYPES:
            problem = Problem("softmax", dtype, shape)
            rng = random.Random(f"{shape}-{dtype}")
            values = SOFTMAX.problem_values(problem, Target.for_arch("90"))
            key = tuple(sorted(values.items()))
            if key not in enumerated:
                enumerated[key] = space.valid_points(values)
            valid = enumerated[key]
            pools.append((problem, valid))
            splits = [p for p in valid if p["split"] > 1]
            picks += [(problem, p) for p in rng.sample(valid, min(PER_PROBLEM, len(valid)))]
            picks += [(problem, p) for p in rng.sample(splits, min(SPLITS_PER_PROBLEM, len(splits)))]
    rng = random.Random(7)
    for param in space.parameters:
        for value in param.values:
            if any(p[param.name] == value and type(p[param.name]) is type(value) for _, p in picks):
                continue
            problem, valid = rng.choice([(pr, v) for pr, v in pools if any(p[param.name] == value for p in v)])
            picks.append((problem, rng.choice([p for p in valid if p[param.name] == value])))
    return picks


def _sample_variants() -> list[Built]:
    built = []
    for problem, params in _sample_points():
        for arch in ARCHS:
            target = Target.for_arch(arch)
            if arch != "90" and not SOFTMAX.is_valid(problem, target, params):
                continue  # e.g. more shared memory than sm_80 has, or an sm_90-only feature
            v = build_variant(SOFTMAX, problem, params, target)
            built.append(Built(f"{v.name} {problem.shape_text} sm_{arch}", arch, v.source,
                               v.kernel_names, int(params["split"])))
    return built


@pytest.fixture(scope="module")
def sample():
    built = _sample_variants()
    return built, _compile_all(built)


def test_sample_is_large_and_covers_the_interesting_cases(sample):
    built, _ = sample
    per_arch = {a: [b for b in built if b.arch == a] for a in ARCHS}
    assert len(per_arch["90"]) >= 100 and len(per_arch["80"]) >= 100
    assert sum(b.split > 1 for b in per_arch["90"]) >= 20
    assert sum(b.split > 1 for b in per_arch["80"]) >= 20
    for dtype_short in ("_f32_", "_f16_", "_bf16_"):
        assert sum(dtype_short in b.label for b in built) >= 60
    for shape in ("x1 ", "x3 ", "x1000 ", "x1025 ", "x50257 ", "x131072 "):
        assert any(shape in b.label for b in built), shape
    assert any(b.label.split()[1].startswith("1x") for b in built)  # M = 1
    for word in ("_registers_", "_smem_", "_reread_", "_online_", "_three_pass_", "_persistent", "_cs",
                 "_v8_", "_u8_", "_g1_", "_g1024_", "_keep", "_c8"):
        assert any(word in b.label for b in built), word
    points = _sample_points()
    for param in space_of(SOFTMAX).parameters:
        for value in param.values:
            assert any(p[param.name] == value for _, p in points), f"{param.name}={value} is never compiled"


def test_sampled_variants_compile_for_sm90_and_sm80(sample):
    built, results = sample
    failures = []
    for b in built:
        ok, log, cubin = results[(b.source, b.arch)]
        if not ok:
            failures.append(f"{b.label}: {log.strip().splitlines()[:3]}")
        elif len(cubin) < 1000 or not cubin.startswith(b"\x7fELF"):
            failures.append(f"{b.label}: no ELF cubin ({len(cubin)} bytes)")
        elif _cubin_sm(cubin) != int(b.arch):
            failures.append(f"{b.label}: cubin is for sm_{_cubin_sm(cubin)}")
    assert not failures, f"{len(failures)} of {len(built)} failed:\n" + "\n".join(failures[:20])


def test_rendered_source_is_complete(sample):
    built, _ = sample
    for b in built:
        for marker in ("{{", "}}", "{%", "%}", "{#", "#}"):
            assert marker not in b.source, f"{b.label}: unrendered Jinja {marker!r}"
        assert b.source.startswith("// autosoft softmax variant ")
        assert "None" not in b.source and "Undefined" not in b.source, b.label
        assert b.source.count("{") == b.source.count("}"), f"{b.label}: unbalanced braces"


def test_launch_kernels_exist_in_source_and_cubin(sample):
    built, results = sample
    for b in built:
        declared = KERNEL_RE.findall(b.source)
        assert sorted(declared) == sorted(b.kernels), f"{b.label}: launches {b.kernels}, source has {declared}"
        assert len(b.kernels) == len(set(b.kernels)) >= 1
        ok, _, cubin = results[(b.source, b.arch)]
        if ok:
            for name in b.kernels:  # extern "C": the ELF symbol is the plain name
                assert name.encode() + b"\0" in cubin, f"{b.label}: {name} not in the cubin"


def _default_problems():
    for n in DEFAULT_NS:
        for m in DEFAULT_MS:
            for dtype in DTYPES:
                yield Problem("softmax", dtype, (m, n))


def test_default_params_are_valid_everywhere():
    space = space_of(SOFTMAX)
    for arch in ("90", "80", "86"):
        target = Target.for_arch(arch)
        for problem in _default_problems():
            params = SOFTMAX.default_params(problem, target)
            assert space.check_values(params) == params
            broken = space.violations(params, SOFTMAX.problem_values(problem, target))
            assert not broken, f"default for {problem.shape_text} {problem.dtype} sm_{arch}: {broken}"
            for seed in SOFTMAX.seed_params(problem, target):
                assert SOFTMAX.is_valid(problem, target, seed)


def test_default_params_use_16_byte_vectors_when_the_row_allows():
    target = Target.for_arch("90")
    for dtype, vec in (("float32", 4), ("float16", 8), ("bfloat16", 8)):
        for m, n in ((4096, 8192), (1, 50257), (64, 1000), (1, 131072)):
            params = SOFTMAX.default_params(Problem("softmax", dtype, (m, n)), target)
            assert params["vec"] == vec, (dtype, m, n, params)
    few_wide = SOFTMAX.default_params(Problem("softmax", "float32", (1, 1048576)), target)
    assert few_wide["split"] > 1, "one very long row needs several blocks"


def test_default_variants_compile():
    built = []
    for problem in _default_problems():
        for arch in ARCHS:
            target = Target.for_arch(arch)
            v = build_variant(SOFTMAX, problem, SOFTMAX.default_params(problem, target), target)
            built.append(Built(f"{v.name} {problem.shape_text} sm_{arch}", arch, v.source, v.kernel_names,
                               int(v.params["split"])))
    results = _compile_all(built)
    failures = [f"{b.label}: {results[(b.source, b.arch)][1].strip()[:300]}"
                for b in built if not results[(b.source, b.arch)][0]]
    assert not failures, "\n".join(failures[:20])
    assert len(results) >= 150, "the defaults should differ across these shapes"


# --- the renderer itself ----------------------------------------------------------------------

def _args_for(problem: Problem, params: dict, target: Target) -> dict:
    space = space_of(SOFTMAX)
    values = space.evaluate(space.check_values(params), SOFTMAX.problem_values(problem, target))
    args = SOFTMAX.template_args(problem, values)
    launches, _ = SOFTMAX.launches(problem, values, target)
    return {**args, "name": SOFTMAX.variant_name(problem, params), "kernel_names": [l.kernel for l in launches]}


def test_strict_undefined_fails_on_a_missing_argument():
    assert environment().undefined is jinja2.StrictUndefined
    target = Target.for_arch("90")
    problem = Problem("softmax", "float16", (8, 4096))
    params = SOFTMAX.default_params(problem, target)
    args = _args_for(problem, params, target)
    assert render(SOFTMAX.template, args) == build_variant(SOFTMAX, problem, params, target).source
    for missing in ("N", "seg", "vec_bits_type", "kernel_names", "name", "dtype"):
        partial = {k: v for k, v in args.items() if k != missing}
        with pytest.raises(jinja2.UndefinedError):
            render(SOFTMAX.template, partial)


def test_params_change_the_source_and_the_digest():
    target = Target.for_arch("90")
    problem = Problem("softmax", "float32", (8, 4096))
    base = SOFTMAX.default_params(problem, target)
    v0 = build_variant(SOFTMAX, problem, base, target)
    v1 = build_variant(SOFTMAX, problem, {**base, "streaming": not base["streaming"]}, target)
    assert v0.source != v1.source and v0.digest != v1.digest and v0.name != v1.name
    assert "__ldcs" in (v1.source if v1.params["streaming"] else v0.source)
    v80 = build_variant(SOFTMAX, problem, base, Target.for_arch("80"))
    assert v80.source == v0.source and v80.digest != v0.digest, "the digest covers the target architecture"
    assert v0.digest == source_digest(v0.source, "90")
    other_n = build_variant(SOFTMAX, Problem("softmax", "float32", (8, 4097)), base, target)
    assert "constexpr int N = 4097;" in other_n.source and "constexpr int N = 4096;" in v0.source


def test_build_variant_refuses_invalid_points_and_foreign_values():
    target = Target.for_arch("90")
    problem = Problem("softmax", "float32", (8, 3))
    base = SOFTMAX.default_params(problem, target)
    with pytest.raises(UserError, match="wider than the row"):
        build_variant(SOFTMAX, problem, {**base, "vec": 4, "row_threads": 4}, target)  # 4 > N = 3
    with pytest.raises(UserError):
        build_variant(SOFTMAX, problem, {**base, "storage": "registers;\n__global__ void evil(){}"}, target)
    with pytest.raises(UserError):
        build_variant(SOFTMAX, problem, {**base, "extra": 1}, target)


def test_compile_failure_is_returned_not_raised():
    result = compile_source('extern "C" __global__ void k(float* y) { y[0] = undeclared_name; }', "90")
    assert not result.ok and result.cubin == b""
    assert "undeclared_name" in result.log
    for arch in ("80", "86", "90"):
        good = compile_source('extern "C" __global__ void k(float* y) { y[0] = 1.f; }', arch)
        assert good.ok and good.cubin.startswith(b"\x7fELF") and _cubin_sm(good.cubin) == int(arch)
    assert "--use_fast_math" in COMPILE_OPTIONS


# --- what the compiler made of it -------------------------------------------------------------

def _ptx(source: str, arch: str) -> str:
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{arch}", *COMPILE_OPTIONS])
        ptx = nvrtc.getPTX(prog)
        return ptx.decode() if isinstance(ptx, bytes) else ptx
    finally:
        nvrtc.destroyProgram(prog)


def _fp32_vec_variants(vec: int):
    target = Target.for_arch("90")
    problem = Problem("softmax", "float32", (4096, 8192))
    base = SOFTMAX.default_params(problem, target)
    params = {**base, "vec": vec, "row_threads": 256, "threads": 256, "storage": "reread", "normalise": "online",
              "unroll": 2}
    return build_variant(SOFTMAX, problem, params, target)


def test_vec4_fp32_uses_16_byte_accesses_in_ptx():
    wide = _ptx(_fp32_vec_variants(4).source, "90")
    narrow = _ptx(_fp32_vec_variants(1).source, "90")
    assert re.search(r"ld\.global\.nc\.v4\.(u32|b32|f32)", wide), "16-byte loads of x"
    assert re.search(r"st\.global\.v4\.(u32|b32|f32)", wide), "16-byte stores of y"
    assert not re.search(r"ld\.global[.\w]*\.v4", narrow)


@pytest.mark.parametrize("storage", ["smem", "registers"])
def test_16_bit_rows_are_written_with_16_byte_stores_only(storage):
    """Every store of a row's vector body is one 16-byte store: left to the compiler, a vector
    assembled from packed 16-bit pairs was at times stored as four 4-byte stores (a staged
    4096x32768 float16 variant's first position, and every position once the loops changed)."""
    target = Target.for_arch("90")
    problem = Problem("softmax", "float16", (4096, 32768 if storage == "smem" else 4001))
    params = {**SOFTMAX.default_params(problem, target), "storage": storage, "vec": 8, "unroll": 1, "split": 1,
              "persistent": False, "prefetch": False, "streaming": False}
    params.update({"threads": 1024, "row_threads": 1024, "normalise": "online", "chunks": 4} if storage == "smem"
                  else {"threads": 128, "row_threads": 128, "normalise": "three_pass", "keep_exp": True})
    ptx = _ptx(build_variant(SOFTMAX, problem, params, target).source, "90")
    stores = set(re.findall(r"st\.global[.\w]*", ptx))
    narrow = {s for s in stores if ".v4." not in s and not s.endswith(("16", ".b16"))}
    assert any(".v4." in s for s in stores) and not narrow, sorted(stores)  # 16-bit: the head and tail


def test_vec4_fp32_uses_16_byte_loads_in_sass(tmp_path):
    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump not found (not on PATH, not next to nvcc)")
    for vec, expect in ((4, True), (1, False)):
        result = compile_source(_fp32_vec_variants(vec).source, "90")
        assert result.ok
        cubin = tmp_path / f"v{vec}.cubin"
        cubin.write_bytes(result.cubin)
        proc = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, timeout=60)
        if "does not contain device code" in proc.stdout + proc.stderr:
            # seen on the H200 machine: its cuobjdump 13.0 does not read the cubin of a newer NVRTC
            pytest.skip(f"{cuobjdump} cannot read NVRTC's cubin here (the PTX test covers the vector width)")
        sass = proc.stdout
        assert "softmax_rows" in sass
        assert bool(re.search(r"LDG\.E[.\w]*\.128", sass)) is expect, f"vec={vec}"


@pytest.mark.parametrize("storage", ["smem", "registers"])
def test_stagger_delays_every_other_block_of_the_first_wave(storage):
    """stagger makes the odd blocks among the first sm_count (one per SM) sleep before they
    start, in both one-kernel layouts; stagger 0 leaves no trace in the kernel."""
    target = Target(arch="90", name="a GPU with 78 SMs", sm_count=78)
    problem = Problem("softmax", "float32", (1024, 32768))
    params = {**SOFTMAX.default_params(problem, target), "threads": 1024, "row_threads": 1024, "vec": 4,
              "unroll": 1, "split": 1, "combine": "launches", "storage": storage}
    params.update({"normalise": "online", "chunks": 4} if storage == "smem" else {"normalise": "three_pass"})
    staggered = build_variant(SOFTMAX, problem, {**params, "stagger": 2000}, target)
    plain = build_variant(SOFTMAX, problem, {**params, "stagger": 0}, target)
    assert "if ((blockIdx.x & 1) && blockIdx.x < 78) __nanosleep(2000);" in staggered.source
    assert staggered.name == plain.name + "_stagger2000"
    assert "nanosleep" in _ptx(staggered.source, "90")
    assert "nanosleep" not in plain.source and "nanosleep" not in _ptx(plain.source, "90")


def test_stagger_is_refused_for_split_rows():
    target = Target.for_arch("90")
    problem = Problem("softmax", "float32", (8, 131072))
    params = {**SOFTMAX.default_params(problem, target), "storage": "registers", "normalise": "three_pass",
              "unroll": 1, "split": 8, "combine": "cluster", "threads": 512, "row_threads": 512, "vec": 4}
    assert SOFTMAX.is_valid(problem, target, params)
    assert not SOFTMAX.is_valid(problem, target, {**params, "stagger": 1000})


def _split_params(problem: Problem, target: Target, combine: str, split: int, threads: int = 512) -> dict:
    return {**SOFTMAX.default_params(problem, target), "storage": "registers", "normalise": "three_pass",
            "unroll": 1, "persistent": False, "vec": 4, "combine": combine, "split": split, "threads": threads,
            "row_threads": threads}


@pytest.mark.parametrize("arch, split", [("90", 16), ("80", 8)])
def test_a_cooperative_grid_split_publishes_pairs_and_waits_at_a_barrier(arch, split):
    """combine=grid: one cooperative launch whose blocks exchange (max, sum) pairs through a
    workspace of pairs and per-row arrival counters; it needs no cluster, so sm_80 builds it too."""
    target = Target.for_arch(arch)
    problem = Problem("softmax", "float32", (8, 131072))
    variant = build_variant(SOFTMAX, problem, _split_params(problem, target, "grid", split), target)
    (launch,) = variant.launches
    assert variant.name.endswith(f"_grid{split}")
    assert launch.kernel == "softmax_grid" and launch.cooperative and launch.cluster_blocks == 1
    assert launch.grid == (8 * split, 1, 1) and launch.args[:3] == ("x", "y", "workspace")
    assert variant.workspace_bytes == 8 * split * 8 + 8 * 4  # a float2 per segment, a counter per row
    ptx = _ptx(variant.source, arch)
    assert "ld.acquire.gpu" in ptx and "atom.global.add.u32" in ptx and "barrier.cluster" not in ptx
    assert "ld.global.cg.v2.f32" in ptx  # the pairs are read past L1


def test_a_grid_split_is_refused_unless_its_whole_grid_fits_on_the_gpu_at_once():
    """Blocks resident per SM, by threads and by an estimate of registers (the row's plus 32)."""
    target = Target(arch="90", name="a GPU with 100 SMs", sm_count=100)
    problem = Problem("softmax", "float32", (8, 131072))
    # blocks in the grid, and (floats held per thread, registers estimated, blocks per SM):
    # 1024 threads: (16, 48, 1) at split 8 and (8, 40, 1) at split 16, so 100 blocks fit
    assert SOFTMAX.is_valid(problem, target, _split_params(problem, target, "grid", 8, threads=1024))       # 64
    assert not SOFTMAX.is_valid(problem, target, _split_params(problem, target, "grid", 16, threads=1024))  # 128
    # 512 threads: (16, 48, 2) at split 16, (8, 40, 3) at split 32 and (4, 36, 3) at split 64
    assert SOFTMAX.is_valid(problem, target, _split_params(problem, target, "grid", 16, threads=512))       # 128
    assert SOFTMAX.is_valid(problem, target, _split_params(problem, target, "grid", 32, threads=512))       # 256
    assert not SOFTMAX.is_valid(problem, target, _split_params(problem, target, "grid", 64, threads=512))  # 512
    fits = _split_params(problem, target, "grid", 8)
    assert not SOFTMAX.is_valid(problem, target, {**fits, "storage": "reread", "normalise": "online"})
    assert not SOFTMAX.is_valid(problem, target, {**fits, "split": 1})


def test_clusters_of_more_than_eight_blocks_opt_in_and_stop_at_sixteen():
    target = Target.for_arch("90")
    problem = Problem("softmax", "float32", (8, 262144))
    variant = build_variant(SOFTMAX, problem, _split_params(problem, target, "cluster", 16), target)
    assert variant.launches[0].cluster_blocks == 16 and not variant.launches[0].cooperative
    assert "__cluster_dims__(SPLIT, 1, 1)" in variant.source and "constexpr int SPLIT = 16;" in variant.source
    assert compile_source(variant.source, "90").ok
    assert build_variant(SOFTMAX, problem, _split_params(problem, target, "cluster", 8), target).launches[0].cluster_blocks == 8
    assert not SOFTMAX.is_valid(problem, target, _split_params(problem, target, "cluster", 32, threads=1024))
    assert not SOFTMAX.is_valid(problem, Target.for_arch("80"), _split_params(problem, target, "cluster", 16))


# --- sources of one architecture's own instructions (sm_90a) ------------------------------------

_SETMAXNREG = """
extern "C" __global__ void __launch_bounds__(BOUNDS) k(float* x) {
  if (threadIdx.x < 128) { asm volatile("setmaxnreg.dec.sync.aligned.u32 24;" ::: "memory"); return; }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;" ::: "memory");
  x[threadIdx.x] = 1.f;
}
"""


def test_a_marked_source_compiles_for_sm90a_and_an_unmarked_one_for_sm90():
    from autosoft.compile import ARCH_SPECIFIC

    good = _SETMAXNREG.replace("BOUNDS", "384, 1")
    assert compile_source(ARCH_SPECIFIC + "\n" + good, "90").ok
    plain = compile_source(good, "90")
    assert not plain.ok and "not supported on .target 'sm_90'" in plain.log, "no mark: plain sm_90, no setmaxnreg"
    assert source_digest(ARCH_SPECIFIC + "\n" + good, "90") != source_digest(good, "90")


# ptxas's own lines (NVRTC 13.0, sm_90a), met on kernels that autosoft must not keep: the wgmma
# attention template with a half-width diagonal tile (C7511, C7515, C7519, C7520; see
# benchmarks/results/issue18_half_tile_3365f00/), _SETMAXNREG without a block count (C7508), _TWO_WGMMA below (C7517)
_SERIALISED = [
    "ptxas info    : (C7511) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
    "insufficient register resources for the wgmma pipeline in the function 'attention_fwd'",
    "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non "
    "wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in "
    "the function 'attention_fwd'",
    "ptxas info    : (C7519) warpgroup.arrive is injected in around line 2111 by compiler to allow use of registers "
    "in GMMA in function 'attention_fwd'",
    "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program "
    "dependence on compiler-inserted WG.AR in divergent path in the function 'attention_fwd'",
    "ptxas info    : (C7508) Potential Performance Loss: 'setmaxnreg' ignored; unable to determine register count "
    "at entry.",
    "ptxas info    : (C7517) warpgroup.wait is injected in around line 42 by compiler to allow use of registers "
    "defined by GMMA in function 'serialised'",
]


def test_every_wgmma_serialisation_ptxas_reports_is_a_rejection_and_nothing_else_is():
    from autosoft.compile import REJECTED_PTXAS_WARNINGS

    for line in _SERIALISED:
        assert REJECTED_PTXAS_WARNINGS.search(line), line
    for line in ("ptxas info    : Used 168 registers, used 1 barriers, 12 bytes spill stores",
                 "ptxas info    : Compiling entry function 'attention_fwd' for 'sm_90a'",
                 "ptxas info    : Function properties for attention_fwd"):
        assert not REJECTED_PTXAS_WARNINGS.search(line), line


def test_a_kernel_whose_wgmma_ptxas_serialises_is_rejected():
    """A non-wgmma instruction writing an accumulator between two wgmma of one pipeline stage: ptxas
    serialises them (and says so); that variant fails to compile. The same kernel without it compiles."""
    from autosoft.compile import ARCH_SPECIFIC

    kernel = _TWO_WGMMA.replace("MIDDLE", "d[1] = d[1] + 1.f;")
    result = compile_source(ARCH_SPECIFIC + "\n" + kernel, "90")
    assert not result.ok and result.cubin == b""
    assert result.log.startswith("rejected: ptxas would run this kernel degraded")
    assert "wgmma.mma_async instructions are serialized" in result.log
    assert compile_source(ARCH_SPECIFIC + "\n" + _TWO_WGMMA.replace("MIDDLE", ""), "90").ok


_TWO_WGMMA = r"""
extern "C" __global__ void __launch_bounds__(128, 1) serialised(float* out, unsigned long long da, unsigned long long db) {
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  MIDDLE
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  out[threadIdx.x] = d[0] + d[1] + d[2] + d[3];
}
"""


def test_a_kernel_whose_setmaxnreg_ptxas_ignores_is_rejected():
    """Without a minimum block count in __launch_bounds__, ptxas ignores setmaxnreg (C7508) and the
    consumer warpgroups would run on a third of their registers: that variant fails to compile."""
    from autosoft.compile import ARCH_SPECIFIC

    result = compile_source(ARCH_SPECIFIC + "\n" + _SETMAXNREG.replace("BOUNDS", "384"), "90")
    assert not result.ok and result.cubin == b""
    assert result.log.startswith("rejected: ptxas would run this kernel degraded") and "C7508" in result.log
