"""export.py and `autosoft export`: a cache entry made by hand becomes a standalone .cu file with
its provenance, on a machine without a GPU; a stale entry is never exported."""
from __future__ import annotations

import dataclasses
import re
import subprocess

import numpy as np
import pytest

import autosoft
from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.export import standalone_source
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant, params_from_text

from conftest import gpu_available
from helpers import make_entry, nvcc_path, run_cli, softmax_key

SOFTMAX = get_family("softmax")
ATTENTION = get_family("attention")


def _here() -> tuple[str, str]:
    """The GPU an exported entry must be for: this machine's when it has one, else any (an H200 here)."""
    if gpu_available():
        from autosoft.runtime import device_info

        info = device_info()
        return info.name, info.compute_capability
    return "NVIDIA H200", "90"


def _key(shape: str, dtype: str = "float32", **changes):
    name, cc = _here()
    return softmax_key(shape, dtype, **{"gpu_name": name, "compute_capability": cc, **changes})


def _entry_params(shape: str, dtype: str, **changes):
    problem = SOFTMAX.problem(shape, dtype)
    params = {**SOFTMAX.default_params(problem, Target.for_arch("90")), **changes}
    assert SOFTMAX.is_valid(problem, Target.for_arch("90"), params)
    return params


def _kernels_of(text: str) -> str:
    """What lies between the header and the host launcher (#ifdef AUTOSOFT_HOST_LAUNCH ... at the end)."""
    body = text[text.index("\n\n") + 2:]
    return body[:body.index("\n#ifdef AUTOSOFT_HOST_LAUNCH\n")]


def _export(tmp_path, shape: str, dtype: str, entries) -> tuple[subprocess.CompletedProcess, str]:
    cache_file = tmp_path / "tuned.sqlite"
    cache = Cache(cache_file)
    for e in entries:
        cache.put(e)
    out = tmp_path / "out" / "f.cu"
    result = run_cli(["export", "softmax", "--shape", shape, "--dtype", dtype, "-o", str(out),
                      "--cache", str(cache_file)], tmp_path / "default-cache")
    return result, out.read_text() if out.exists() else ""


def test_export_writes_a_file_with_its_provenance(tmp_path):
    params = _entry_params("2048x5000", "float16", storage="smem", persistent=True, prefetch=True)
    entry = make_entry(_key("2048x5000", "float16"), time_us=17.25, params=params,
                       variant_name="softmax_from_cache", default_time_us=21.5, copy_time_us=14.0)
    result, text = _export(tmp_path, "2048x5000", "float16", [entry])
    assert result.returncode == 0, result.stderr
    assert "f.cu" in result.stdout and "17.25" in result.stdout
    header = [l for l in text.splitlines() if l.startswith("// ")]
    head = "\n".join(header[:20])
    variant = build_variant(SOFTMAX, SOFTMAX.problem("2048x5000", "float16"), params, Target.for_arch("90"))
    assert f"autosoft {autosoft.__version__}" in head
    assert variant.name in head
    assert "params: " + ", ".join(f"{k}={v}" for k, v in params.items()) in head
    launch = variant.launches[0]
    assert f"grid={launch.grid}" in head and f"block={launch.block}" in head
    assert f"dynamic shared memory={launch.shared_mem} B" in head and launch.shared_mem > 0
    name, cc = _here()
    assert name in head and f"sm_{cc}" in head and "CUDA 13.0" in head
    assert "17.25 us" in head and "21.50" in head and "14.00" in head
    assert variant.digest in head and re.search(r"\b[0-9a-f]{64}\b", head)
    assert "float16" in head and "2048x5000" in head
    assert _kernels_of(text) == variant.source, "the kernel itself follows the header unchanged"
    assert "{{" not in text and "{%" not in text


def test_exported_file_compiles_with_nvrtc_and_nvcc(tmp_path):
    params = _entry_params("1x1048576", "float32")
    assert params["split"] > 1, "a two-launch variant exercises the workspace line too"
    entry = make_entry(_key("1x1048576"), time_us=9.0, params=params)
    result, text = _export(tmp_path, "1x1048576", "float32", [entry])
    assert result.returncode == 0, result.stderr
    assert "workspace:" in text and text.count("// launch ") == 2
    assert compile_source(text, "90").ok
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cu = tmp_path / "out" / "f.cu"
    obj = tmp_path / "f.o"
    build = subprocess.run([nvcc, "-c", "-arch=sm_90", "-std=c++17", str(cu), "-o", str(obj)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    assert obj.stat().st_size > 1000
    assert b"softmax_partials" in obj.read_bytes() and b"softmax_finish" in obj.read_bytes()


def test_the_build_lines_in_the_header_work(tmp_path):
    from cupy_backends.cuda.libs import nvrtc

    from autosoft.compile import compile_options

    entry = make_entry(_key("64x1000", "bfloat16"), params=_entry_params("64x1000", "bfloat16"))
    result, text = _export(tmp_path, "64x1000", "bfloat16", [entry])
    assert result.returncode == 0, result.stderr
    (options,) = [l[len("// NVRTC options: "):].split() for l in text.splitlines() if l.startswith("// NVRTC options: ")]
    assert options[0] == "--gpu-architecture=sm_90" and tuple(options) == compile_options(text, "90")
    prog = nvrtc.createProgram(text, "f.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)
    finally:
        nvrtc.destroyProgram(prog)
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    (line,) = [l for l in text.splitlines() if l.startswith("// build: ")]
    command = line[len("// build: "):].replace("<this file>", "f.cu").split()
    assert command[0] == "nvcc"
    build = subprocess.run([nvcc, *command[1:], "-o", "f.o"], cwd=tmp_path / "out", capture_output=True,
                           text=True, timeout=300)
    assert build.returncode == 0, build.stderr


def test_the_fastest_current_entry_is_exported(tmp_path):
    shape, dtype = "512x2048", "float32"
    other_gpu = make_entry(_key(shape, dtype, gpu_name="NVIDIA A100", compute_capability="80"), time_us=40.0,
                           params=_entry_params(shape, dtype, unroll=1))
    slow = make_entry(_key(shape, dtype, cuda_version="12.8"), time_us=30.0, params=_entry_params(shape, dtype))
    fast = make_entry(_key(shape, dtype), time_us=12.0, params=_entry_params(shape, dtype, streaming=True))
    result, text = _export(tmp_path, shape, dtype, [other_gpu, slow, fast])
    assert result.returncode == 0, result.stderr
    assert "streaming=True" in text and "12.00 us" in text and _here()[0] in text and "A100" not in text


@pytest.mark.parametrize("stale", ["template_digest", "space_digest"])
def test_a_stale_entry_is_not_exported(tmp_path, stale):
    shape, dtype = "256x4096", "float16"
    entry = make_entry(_key(shape, dtype, **{stale: "f" * 64}), params=_entry_params(shape, dtype))
    result, text = _export(tmp_path, shape, dtype, [entry])
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("autosoft: error: ")
    assert "autosoft tune" in result.stderr
    assert text == "" and not (tmp_path / "out").exists()


def test_an_entry_with_params_outside_the_space_is_refused(tmp_path):
    shape, dtype = "256x4096", "float16"
    params = {**_entry_params(shape, dtype), "storage": "registers */ __global__ void evil() { /*"}
    entry = make_entry(_key(shape, dtype), params=params)
    result, text = _export(tmp_path, shape, dtype, [entry])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and "storage" in result.stderr
    assert text == "" and "evil" not in result.stdout


def test_standalone_source_without_an_entry_says_untuned():
    problem = SOFTMAX.problem("8x100", "float32")
    target = Target.for_arch("80")
    variant = build_variant(SOFTMAX, problem, SOFTMAX.default_params(problem, target), target)
    text = standalone_source(variant, None)
    assert "untuned" in text and "sm_80" in text and "measured" not in text
    assert _kernels_of(text) == variant.source


def test_export_says_how_to_launch_a_cooperative_split_and_a_sixteen_block_cluster(tmp_path):
    grid = _entry_params("8x131072", "float32", storage="registers", normalise="three_pass", unroll=1, vec=4,
                         combine="grid", split=16, threads=512, row_threads=512, persistent=False)
    result, text = _export(tmp_path, "8x131072", "float32", [make_entry(_key("8x131072"), time_us=9.0, params=grid)])
    assert result.returncode == 0, result.stderr
    assert "softmax_grid must be launched cooperatively (cudaLaunchCooperativeKernel)" in text
    assert "workspace: 1056 bytes of device memory, zeroed once before the first launch" in text
    assert "NonPortableClusterSize" not in text
    cluster = {**grid, "combine": "cluster"}
    result, text = _export(tmp_path / "cluster", "8x131072", "float32",
                           [make_entry(_key("8x131072"), time_us=9.0, params=cluster)])
    assert result.returncode == 0, result.stderr
    assert "clusters of 16 blocks: set cudaFuncAttributeNonPortableClusterSizeAllowed" in text
    assert "cooperatively" not in text and "workspace:" not in text


# --- the host launcher (-DAUTOSOFT_HOST_LAUNCH) ---------------------------------------------------

_GRID = dict(storage="registers", normalise="three_pass", unroll=1, vec=4, split=16, threads=512, row_threads=512,
             persistent=False)
# name: family, shape, dtype, param changes; each a kind of launch the launcher must get right
HOST_VARIANTS = {
    "softmax_default": (SOFTMAX, "4096x8192", "float32", {}),
    "softmax_two_launches": (SOFTMAX, "32x131072", "float32", {"split": 4, "combine": "launches"}),
    "softmax_cooperative_grid": (SOFTMAX, "8x131072", "float32", {**_GRID, "combine": "grid"}),
    "softmax_cluster_of_16": (SOFTMAX, "8x131072", "float32", {**_GRID, "combine": "cluster"}),
    "attention_past_48_kib": (ATTENTION, "1,32,8192,128", "bfloat16", {"engine": "mma", "splits": 1, "merge": "last_block", "block_m": 128,
                                                                       "block_n": 64, "warps": 4, "stages": 2}),
    "attention_tensor_maps": (ATTENTION, "1,32,8192,128", "bfloat16", {
        "engine": "wgmma", "overlap": True, "pingpong": True, "blocks_per_sm": 1, "lpt": False, "persistent": False,
        "queue": False, "chain": False, "block_m": 128, "block_n": 128, "stages": 2}),
    # the key splits of each query tile merged inside a cluster, no workspace
    "attention_split_cluster": (ATTENTION, "1,2,2048,128", "bfloat16", {
        "engine": "mma", "block_m": 64, "block_n": 64, "warps": 4, "stages": 2, "splits": 2, "merge": "cluster"}),
    # persistent blocks taking tiles from a counter in the workspace, which the last block resets,
    # each tile's first S issued with the last P.V of the one before
    "attention_tensor_maps_queue": (ATTENTION, "1,32,8192,128", "bfloat16", {
        "engine": "wgmma", "overlap": True, "pingpong": True, "blocks_per_sm": 1, "lpt": False, "persistent": True,
        "queue": True, "chain": True, "block_m": 128, "block_n": 128, "stages": 2}),
}


# on the GPU the CPU reference of 1x32x8192x128 attention would take minutes: a smaller one, still past 48 KiB
GPU_SHAPES = {"attention_past_48_kib": "1,2,300,128", "attention_tensor_maps": "1,2,300,128",
              "attention_split_cluster": "1,2,300,128",
              "attention_tensor_maps_queue": "2,3,700,128"}


def _build_arch(text: str) -> str:
    """The target flag of the header's build line: the sm_90a cubin for a kernel of Hopper's own instructions."""
    return re.search(r"^// build: nvcc -c (\S+) ", text, re.M).group(1)


def _host_variant(case: str, target: Target | None = None, shape: str | None = None):
    family, default_shape, dtype, changes = HOST_VARIANTS[case]
    shape = shape or default_shape
    target = target or Target.for_arch("90")
    problem = family.problem(shape, dtype)
    # a case that names its engine starts from that engine's own default, whatever the target prefers
    start = params_from_text(family, problem, target, [f"engine={changes['engine']}"])[0] if "engine" in changes \
        else family.default_params(problem, target)
    return build_variant(family, problem, {**start, **changes}, target)


def _launcher(text: str) -> str:
    return text[text.index("\n#ifdef AUTOSOFT_HOST_LAUNCH\n"):]


@pytest.mark.parametrize("case", sorted(HOST_VARIANTS))
def test_the_header_and_the_host_launcher_say_how_each_kernel_is_launched(case):
    variant = _host_variant(case)
    text = standalone_source(variant, None)
    header = text[:text.index("\n\n")]
    host = _launcher(text)
    assert host.rstrip().endswith("#endif  // AUTOSOFT_HOST_LAUNCH") and host.count("#ifdef") == 1
    assert "compile with -DAUTOSOFT_HOST_LAUNCH to get" in header
    (prototype,) = re.findall(r'^//   extern "C" (cudaError_t autosoft_launch\(.*\));$', header, re.M)
    assert f'extern "C" {prototype} {{' in host, "the header's prototype is the definition's"
    assert prototype.endswith("cudaStream_t stream)")
    assert ("void* workspace" in prototype) == bool(variant.workspace_bytes)
    big = [l for l in variant.launches if l.shared_mem > 48 * 1024]
    assert bool(big) == case.startswith("attention")
    maps = case.startswith("attention_tensor_maps")
    assert _build_arch(text) == ("-gencode=arch=compute_90a,code=sm_90a" if maps else "-arch=sm_90")
    assert ("CUtensorMap" in text and "link with -lcuda" in header) == maps
    for launch in variant.launches:
        attribute = (f"cudaFuncSetAttribute({launch.kernel}, cudaFuncAttributeMaxDynamicSharedMemorySize, "
                     f"{launch.shared_mem})")
        assert (attribute in header) == (launch in big) and (attribute in host) == (launch in big)
        assert ("cudaFuncAttributeNonPortableClusterSizeAllowed, 1)" in host) == launch.non_portable_cluster
        if launch.cooperative:
            assert f"cudaLaunchCooperativeKernel((const void*){launch.kernel}, dim3({launch.grid[0]}u, " in host
        else:
            grid = ", ".join(f"{d}u" for d in launch.grid)
            assert f"{launch.kernel}<<<dim3({grid}), " in host and f", {launch.shared_mem}, stream>>>(" in host
    assert host.index(variant.launches[0].kernel + "<<<" if not variant.launches[0].cooperative
                      else "cudaLaunchCooperativeKernel") < host.rindex("return cudaSuccess;")
    if len(variant.launches) == 2:
        assert host.index("softmax_partials<<<") < host.index("softmax_finish<<<"), "in order"
    if case.startswith("softmax"):
        m = variant.problem.shape[0]
        assert "const float* x, float* y" in prototype and f"(long long){m}" in host
    else:
        assert prototype == ("cudaError_t autosoft_launch(const unsigned short* q, const unsigned short* k, "
                             "const unsigned short* v, unsigned short* o, float* lse, float scale, "
                             "long long q_stride0, long long q_stride1, long long q_stride2, "
                             "long long k_stride0, long long k_stride1, long long k_stride2, "
                             "long long v_stride0, long long v_stride1, long long v_stride2, "
                             + ("void* workspace, " if variant.workspace_bytes else "") +
                             "cudaStream_t stream)"), "16-bit values as their bits; the scale and strides are parameters"
    assert compile_source(text, "90").ok, "NVRTC compiles the file: the launcher hides behind its macro"


@pytest.mark.parametrize("case", sorted(HOST_VARIANTS))
def test_the_exported_file_with_its_host_launcher_compiles_with_nvcc(tmp_path, case):
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    cu = tmp_path / f"{case}.cu"
    text = standalone_source(_host_variant(case), None)
    cu.write_text(text)
    obj = tmp_path / f"{case}.o"
    build = subprocess.run([nvcc, "-c", _build_arch(text), "-std=c++17", "--use_fast_math", "-DAUTOSOFT_HOST_LAUNCH",
                            str(cu), "-o", str(obj)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    symbols = obj.read_bytes()
    assert b"autosoft_launch" in symbols and b"__cudaRegisterFatBinary" in symbols


_DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>
extern "C" PROTOTYPE;
struct Buffer {  // a device pointer that converts to whatever pointer the launcher takes
  void* p;
  template <class T> operator T*() const { return static_cast<T*>(p); }
};
static Buffer upload(const char* name, size_t bytes) {
  std::vector<char> host(bytes);
  FILE* f = std::fopen(name, "rb");
  if (f) { if (std::fread(host.data(), 1, bytes, f) != bytes) std::exit(3); std::fclose(f); }
  void* d = nullptr;
  if (cudaMalloc(&d, bytes) != cudaSuccess || cudaMemcpy(d, host.data(), bytes, cudaMemcpyHostToDevice)) std::exit(4);
  return Buffer{d};
}
static void download(Buffer b, const char* name, size_t bytes) {
  std::vector<char> host(bytes);
  if (cudaMemcpy(host.data(), b.p, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) std::exit(5);
  FILE* f = std::fopen(name, "wb");
  std::fwrite(host.data(), 1, bytes, f);
  std::fclose(f);
}
int main() {
UPLOADS
  for (int i = 0; i < 2; ++i) {  // twice: the workspace is reused as it is left
    cudaError_t err = autosoft_launch(ARGS);
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) { std::printf("launch failed: %s\n", cudaGetErrorString(err)); return 1; }
  }
DOWNLOADS
  return 0;
}
"""


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    bits = a.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(HOST_VARIANTS))
def test_the_host_launcher_computes_the_right_thing_on_the_gpu(tmp_path, case):
    """Built with nvcc next to a C++ main that calls autosoft_launch as the header says, run twice."""
    from autosoft.runtime import device_info

    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    family = HOST_VARIANTS[case][0]
    target = device_info().target
    if case == "attention_tensor_maps_queue":  # four persistent blocks: each takes several tiles from the queue
        target = dataclasses.replace(target, sm_count=4)
    variant = _host_variant(case, target, GPU_SHAPES.get(case))
    assert variant.launches[0].shared_mem > 48 * 1024 or family is SOFTMAX
    text = standalone_source(variant, None)
    (prototype,) = re.findall(r'^//   extern "C" (cudaError_t autosoft_launch\(.*\));$', text, re.M)
    rng = np.random.default_rng(0)
    uploads, downloads, args, expect = [], [], [], {}
    if family is SOFTMAX:
        m, n = variant.problem.shape
        x = (rng.standard_normal((m, n)) * 3).astype(np.float32)
        x.tofile(tmp_path / "x.bin")
        e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
        expect["y"] = (e / e.sum(axis=1, keepdims=True), np.float32, 1e-5)
        buffers = {"x": x.nbytes, "y": x.nbytes}
    else:
        b, h, n, d = variant.problem.shape
        q, k, v = (_bf16_bits(rng.standard_normal((b, h, n, d)).astype(np.float32)) for _ in range(3))
        for name, a in zip("qkv", (q, k, v)):
            a.tofile(tmp_path / f"{name}.bin")
        scale = 1.0 / np.sqrt(d)
        s = np.einsum("bhid,bhjd->bhij", _from_bf16(q).astype(np.float64), _from_bf16(k).astype(np.float64)) * scale
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        expect["o"] = (np.einsum("bhij,bhjd->bhid", p / p.sum(axis=-1, keepdims=True), _from_bf16(v)), np.uint16, 2e-2)
        expect["lse"] = (np.log(p.sum(axis=-1)) + s.max(axis=-1), np.float32, 1e-3)
        buffers = {"q": q.nbytes, "k": k.nbytes, "v": v.nbytes, "o": q.nbytes, "lse": b * h * n * 4}
    for name, nbytes in buffers.items():
        uploads.append(f'  Buffer {name} = upload("{name}.bin", {nbytes});')
    if variant.workspace_bytes:
        uploads.append(f'  Buffer workspace = upload("zeros.bin", {variant.workspace_bytes});')
        (tmp_path / "zeros.bin").write_bytes(bytes(variant.workspace_bytes))
    # the arguments in the prototype's order: buffers, the scale, strides (contiguous), workspace, stream
    for param in prototype[prototype.index("(") + 1:-1].split(", "):
        name = param.split()[-1].lstrip("*")
        stride = re.fullmatch(r"([qkv])_stride(\d)", name)
        if name in buffers or name == "workspace":
            args.append(name)
        elif name == "scale":
            args.append(f"{float(scale)!r}f")
        elif stride:
            shape = variant.problem.shape
            args.append(f"{int(np.prod(shape[int(stride.group(2)) + 1:]))}LL")
        else:
            assert name == "stream", f"unexpected parameter {param!r}"
            args.append("0")
    for name in expect:
        downloads.append(f'  download({name}, "{name}.out", {buffers[name]});')
    driver = (_DRIVER.replace("PROTOTYPE", prototype).replace("UPLOADS", "\n".join(uploads))
              .replace("ARGS", ", ".join(args)).replace("DOWNLOADS", "\n".join(downloads)))
    (tmp_path / "kernel.cu").write_text(text)
    (tmp_path / "main.cpp").write_text(driver)
    link = ["-lcuda"] if "link with -lcuda" in text else []  # the launcher encodes tensor maps
    build = subprocess.run([nvcc, _build_arch(text), "-std=c++17", "--use_fast_math", "-DAUTOSOFT_HOST_LAUNCH",
                            "kernel.cu", "main.cpp", "-o", "run", *link], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
    assert build.returncode == 0, build.stderr
    ran = subprocess.run(["./run"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    for name, (want, stored, tol) in expect.items():
        got = np.fromfile(tmp_path / f"{name}.out", dtype=stored).reshape(want.shape)
        got = _from_bf16(got) if stored is np.uint16 else got
        err = np.abs(got - want).max() / max(1e-30, np.abs(want).max())
        assert err < tol, f"{case} {name}: relative error {err:.3g}"
