"""export.py and `autosoft export`: a cache entry made by hand becomes a standalone .cu file with
its provenance, on a machine without a GPU; a stale entry is never exported."""
from __future__ import annotations

import re
import subprocess

import pytest

import autosoft
from autosoft.cache import Cache
from autosoft.compile import compile_source
from autosoft.export import standalone_source
from autosoft.families import get_family
from autosoft.families.base import Target, build_variant

from conftest import gpu_available
from helpers import make_entry, nvcc_path, run_cli, softmax_key

SOFTMAX = get_family("softmax")


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
    assert text.endswith(variant.source), "the kernel itself follows the header unchanged"
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


def test_the_build_line_in_the_header_works(tmp_path):
    nvcc = nvcc_path()
    if nvcc is None:
        pytest.skip("nvcc not found")
    entry = make_entry(_key("64x1000", "bfloat16"), params=_entry_params("64x1000", "bfloat16"))
    result, text = _export(tmp_path, "64x1000", "bfloat16", [entry])
    assert result.returncode == 0, result.stderr
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
    assert text.endswith(variant.source)


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
