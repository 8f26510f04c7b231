"""cli.py through `python -m autosoft` in a subprocess: user errors are one line and exit 2,
and touch no file; render, list and export behave on a machine without a GPU."""
from __future__ import annotations

import re

import pytest

from conftest import gpu_available
from helpers import make_entry, run_cli, softmax_key

from autosoft.cache import Cache

ERROR_CASES = {
    "shape_trailing_x": ["render", "softmax", "--shape", "4096x"],
    "shape_zero_rows": ["render", "softmax", "--shape", "0x5"],
    "shape_zero_cols": ["render", "softmax", "--shape", "5x0"],
    "shape_negative_separate": ["render", "softmax", "--shape", "-1x8"],
    "shape_negative_equals": ["render", "softmax", "--shape=-1x8"],
    "shape_letters": ["render", "softmax", "--shape", "axb"],
    "shape_empty": ["render", "softmax", "--shape", ""],
    "shape_three_dims": ["render", "softmax", "--shape", "2x3x4"],
    "shape_float": ["render", "softmax", "--shape", "4.5x8"],
    "shape_too_long_rows": ["render", "softmax", "--shape", "1x2147483647"],
    "shape_missing": ["render", "softmax"],
    "unknown_dtype": ["render", "softmax", "--shape", "4x8", "--dtype", "float64"],
    "unknown_dtype_int": ["render", "softmax", "--shape", "4x8", "--dtype", "int8"],
    "unknown_family": ["render", "softmaxx", "--shape", "4x8"],
    "unknown_param": ["render", "softmax", "--shape", "4x1024", "--param", "warps=4"],
    "bad_param_value": ["render", "softmax", "--shape", "4x1024", "--param", "vec=3"],
    "injected_param_value": ["render", "softmax", "--shape", "4x1024", "--param",
                             "storage=registers; system(\"id\")"],
    "param_without_equals": ["render", "softmax", "--shape", "4x1024", "--param", "vec"],
    "param_invalid_for_shape": ["render", "softmax", "--shape", "4x3", "--param", "vec=4"],
    "causal_softmax": ["render", "softmax", "--shape", "4x8", "--causal"],
    "unknown_command": ["frobnicate"],
    "no_command": [],
    "unknown_option": ["list", "--verbose"],
    "tune_trials_zero": ["tune", "softmax", "--shape", "64x64", "--trials", "0"],
    "tune_trials_negative": ["tune", "softmax", "--shape", "64x64", "--trials", "-3"],
    "tune_trials_not_int": ["tune", "softmax", "--shape", "64x64", "--trials", "many"],
    "tune_bad_shape": ["tune", "softmax", "--shape", "64x", "--trials", "5"],
    "tune_bad_dtype": ["tune", "softmax", "--shape", "64x64", "--dtype", "half"],
    "export_bad_shape": ["export", "softmax", "--shape", "0x5", "-o", "out.cu"],
    "export_unknown_family": ["export", "nope", "--shape", "4x5", "-o", "out.cu"],
}


def _assert_user_error(result, cache_dir, cwd=None):
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("autosoft: error: ") and len(lines[0]) > len("autosoft: error: ") + 10
    assert "Traceback" not in result.stderr + result.stdout
    assert not cache_dir.exists() or not any(cache_dir.iterdir()), "nothing is written to the cache dir"
    if cwd is not None:
        assert not list(cwd.iterdir()), "no output file is written"
    return lines[0]


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_user_errors_are_one_line_exit_2_and_write_nothing(case, tmp_path):
    cache_dir = tmp_path / "cache"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_cli(ERROR_CASES[case], cache_dir, cwd=cwd)
    line = _assert_user_error(result, cache_dir, cwd)
    assert result.stdout == ""
    if case.startswith("shape_") and case != "shape_missing":
        assert "shape" in line
    if case == "unknown_param":
        assert "warps" in line and "vec" in line, "names the bad parameter and the known ones"
    if case == "bad_param_value":
        assert "1, 2, 4, 8" in line, "says which values are allowed"
    if case == "unknown_dtype":
        assert "float64" in line and "bfloat16" in line
    if case == "unknown_family":
        assert "softmaxx" in line and "softmax" in line.replace("softmaxx", "")
    if case == "tune_trials_zero":
        assert "--trials" in line


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a CUDA device")
def test_tune_without_a_device_is_a_one_line_error(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_cli(["tune", "softmax", "--shape", "64x1000", "--trials", "3"], cache_dir, cwd=tmp_path)
    line = _assert_user_error(result, cache_dir)
    assert "CUDA" in line or "GPU" in line
    assert result.stdout == ""
    explicit = tmp_path / "explicit.sqlite"
    result = run_cli(["tune", "softmax", "--shape", "64x1000", "--cache", str(explicit)], cache_dir, cwd=tmp_path)
    _assert_user_error(result, cache_dir)
    assert not explicit.exists(), "no cache file is created before the device is found"


def test_render_prints_a_kernel(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_cli(["render", "softmax", "--shape", "4096x1000", "--dtype", "float16",
                      "--param", "vec=4", "--param", "storage=smem", "--param", "persistent=true"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    src = result.stdout
    assert src.startswith("// autosoft softmax variant softmax_f16_")
    assert "_v4_" in src.splitlines()[0] and "_smem_" in src.splitlines()[0] and "_persistent" in src.splitlines()[0]
    assert "constexpr int N = 1000;" in src and "constexpr int VEC = 4;" in src
    # 4 rows of 2000 bytes per 128-thread block: the threads, not the shared memory, allow 16 blocks per SM
    assert re.search(r'extern "C" __global__ void __launch_bounds__\(THREADS, 16\) softmax_rows\(', src)
    assert "{{" not in src and "{%" not in src
    assert not cache_dir.exists(), "render touches no cache"


def test_render_output_compiles_and_respects_arch(tmp_path):
    from autosoft.compile import compile_source

    for arch in ("80", "90"):
        result = run_cli(["render", "softmax", "--shape", "3x50257", "--dtype", "bfloat16", "--arch", arch],
                         tmp_path / "cache")
        assert result.returncode == 0, result.stderr
        compiled = compile_source(result.stdout, arch)
        assert compiled.ok, compiled.log


def test_list_with_no_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert "no cache" in result.stdout and str(cache_dir) in result.stdout
    assert not cache_dir.exists(), "list does not create the cache"
    missing = tmp_path / "elsewhere.sqlite"
    result = run_cli(["list", "--cache", str(missing)], cache_dir)
    assert result.returncode == 0 and "no cache" in result.stdout
    assert not missing.exists()


def test_list_shows_entries(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put(make_entry(softmax_key("4096x8192", "float16"), time_us=123.45, variant_name="softmax_f16_listed"))
    cache.put(make_entry(softmax_key("1x1000"), time_us=2.5, variant_name="softmax_f32_other"))
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert "2 entries" in result.stdout
    assert "softmax_f16_listed" in result.stdout and "123.45" in result.stdout and "4096x8192" in result.stdout
    assert "softmax_f32_other" in result.stdout and "NVIDIA H200" in result.stdout


def _rows(stdout: str) -> list[list[str]]:
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family"))
    return [line.split() for line in lines[header + 1:]]


def test_list_sorts_shapes_by_their_numbers_and_shows_the_nvrtc(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir / "kernels.sqlite")
    for shape, dtype, version in (("65536x64", "float32", "13.0"), ("4096x1024", "float32", "13.0"),
                                  ("4096x128", "float32", "12.8"), ("4096x128", "float16", "13.5"),
                                  ("512x8192", "float32", "13.0")):
        cache.put(make_entry(softmax_key(shape, dtype, cuda_version=version)))
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    header = next(line for line in result.stdout.splitlines() if line.startswith("family"))
    assert header.split()[:8] == ["family", "dtype", "shape", "gpu", "sm", "nvrtc", "serves", "time"]
    assert "cuda" not in header
    rows = _rows(result.stdout)
    assert [(r[1], r[2], r[6]) for r in rows] == [
        ("float16", "4096x128", "13.5"), ("float32", "512x8192", "13.0"), ("float32", "4096x128", "12.8"),
        ("float32", "4096x1024", "13.0"), ("float32", "65536x64", "13.0")]


@pytest.mark.skipif(gpu_available(), reason="without a GPU, list cannot tell which entries serve")
def test_list_without_a_gpu_cannot_tell_what_serves(tmp_path):
    cache_dir = tmp_path / "cache"
    Cache(cache_dir / "kernels.sqlite").put(make_entry(softmax_key("4096x128")))
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert "no GPU" in result.stdout.splitlines()[0]
    assert _rows(result.stdout)[0][7] == "-"


def test_list_says_which_entries_would_serve_here(tmp_path, monkeypatch, capsys):
    import autosoft.runtime as runtime
    from autosoft.cli import main
    from autosoft.families.base import Target
    from autosoft.runtime import DeviceInfo

    here = DeviceInfo(0, Target(arch="90", name="NVIDIA H200"), "13.5")
    monkeypatch.setattr(runtime, "device_info", lambda index=None: here)
    path = tmp_path / "k.sqlite"
    cache = Cache(path)
    for shape, changes in (("1x1000", {"cuda_version": "13.5"}), ("2x1000", {"cuda_version": "13.0"}),
                           ("3x1000", {"cuda_version": "12.8"}), ("4x1000", {"gpu_name": "NVIDIA A100"}),
                           ("5x1000", {"template_digest": "0" * 64})):
        cache.put(make_entry(softmax_key(shape, **{"cuda_version": "13.5", **changes})))
    from autosoft.families import get_family
    from autosoft.families.base import family_template_digest, space_of

    attention = get_family("attention")
    cache.put(make_entry(softmax_key("1x32x128x64+causal", "float16", family="attention", cuda_version="13.0",
                                     template_digest=family_template_digest(attention),
                                     space_digest=space_of(attention).digest), params={}))
    assert main(["list", "--cache", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200, NVRTC 13.5" in out.splitlines()[0]
    serves = {r[2]: " ".join(r[7:9]) if r[7] == "same" else r[7] for r in _rows(out)}
    assert serves == {"1x1000": "exact", "2x1000": "same major", "3x1000": "no", "4x1000": "no",
                      "5x1000": "no", "1x32x128x64+causal": "same major"}


def test_list_of_an_empty_cache(tmp_path):
    path = tmp_path / "empty.sqlite"
    Cache(path)
    result = run_cli(["list", "--cache", str(path)], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "0 entries" in result.stdout


def test_list_of_a_corrupt_cache_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    before = path.read_bytes()
    result = run_cli(["list", "--cache", str(path)], tmp_path / "cache")
    line = _assert_user_error(result, tmp_path / "cache")
    assert str(path) in line
    assert path.read_bytes() == before


@pytest.mark.parametrize("with_file", [False, True])
def test_export_without_an_entry_is_a_one_line_error(tmp_path, with_file):
    cache_dir = tmp_path / "cache"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    if with_file:  # a cache that holds other shapes only
        Cache(cache_dir / "kernels.sqlite").put(make_entry(softmax_key("4096x8192")))
    result = run_cli(["export", "softmax", "--shape", "4096x4096", "-o", "out.cu"], cache_dir, cwd=cwd)
    line = _assert_user_error(result, cache_dir if not with_file else tmp_path / "nothing", cwd)
    assert "autosoft tune softmax --shape 4096x4096" in line, "says what to run"
    if not with_file:
        assert not cache_dir.exists(), "export does not create a cache"
