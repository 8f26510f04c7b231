"""cli.py through `python -m autosoft` in a subprocess: user errors are one line and exit 2,
and touch no file; render, list and export behave on a machine without a GPU."""
from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import gpu_available
from helpers import cli_env, make_entry, nvcc_path, run_cli, run_cli_read_only_honoured, softmax_key

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
    "param_given_twice": ["render", "softmax", "--shape", "4x1024", "--param", "vec=4", "--param", "vec=2"],
    "param_given_twice_spaced": ["render", "softmax", "--shape", "4x1024", "--param", "vec=4", "--param", " vec =4"],
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
    "generalize_unknown_family": ["generalize", "softmaxx"],
    "generalize_max_configs_zero": ["generalize", "softmax", "--max-configs", "0"],
    "generalize_without_a_cache": ["generalize", "softmax"],
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
    if case.startswith("param_given_twice"):
        assert "vec is given twice" in line
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


def _torch_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@pytest.mark.skipif(_torch_importable(), reason="checks the message where torch is missing (the GPU tier builds it)")
def test_native_without_torch_is_a_one_line_error(tmp_path):
    cache_dir = tmp_path / "cache"
    result = run_cli(["native"], cache_dir, cwd=tmp_path)
    line = _assert_user_error(result, cache_dir)
    assert "needs torch" in line
    assert not (cache_dir / "native").exists()


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


@pytest.mark.parametrize("args", [["softmax", "--shape", "64x1000", "--arch", "80"],
                                  ["attention", "--shape", "1x2x256x128", "--dtype", "bfloat16",
                                   "--param", "engine=wgmma"]])
def test_render_says_how_to_build_its_output_and_that_builds(tmp_path, args):
    """A wgmma source carried no build line, and plain -arch=sm_90a fails in ptxas."""
    from cupy_backends.cuda.libs import nvrtc

    from autosoft.compile import REJECTED_PTXAS_WARNINGS

    result = run_cli(["render", *args], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    source = result.stdout
    head = source[:source.index("\n#") if "\n#" in source else len(source)].splitlines()
    (build,) = [l[len("// build: "):] for l in head if l.startswith("// build: ")]
    (options,) = [l[len("// NVRTC options: "):].split() for l in head if l.startswith("// NVRTC options: ")]
    wgmma = "engine=wgmma" in args
    assert ("-gencode=arch=compute_90a,code=sm_90a" in build.split()) == wgmma and "-arch=sm_90a" not in build
    prog = nvrtc.createProgram(source, "k.cu", [], [])
    try:
        nvrtc.compileProgram(prog, options)  # exactly the options the line gives
        assert not REJECTED_PTXAS_WARNINGS.search(nvrtc.getProgramLog(prog))
        assert len(nvrtc.getCUBIN(prog)) > 1000
    finally:
        nvrtc.destroyProgram(prog)
    nvcc = nvcc_path()
    if nvcc is not None:
        (tmp_path / "k.cu").write_text(source)
        command = build.replace("<this file>", "k.cu").split()
        built = subprocess.run([nvcc, *command[1:], "-o", "k.o"], cwd=tmp_path, capture_output=True, text=True,
                               timeout=300)
        assert built.returncode == 0, built.stderr


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


# --- rough edges: --version, pipes, `~`, where -o points, malformed rows ------------------------

def test_version_prints_the_version_and_exits_0(tmp_path):
    import autosoft

    result = run_cli(["--version"], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"autosoft {autosoft.__version__}\n" and result.stderr == ""


def test_the_version_is_one_number_in_autosoft_version_and_pyproject():
    import tomllib

    import autosoft
    from autosoft import _version

    declared = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert autosoft.__version__ is _version.__version__
    assert _version.__version__ == declared["project"]["version"]


def _cache_with_entries(path: Path, count: int) -> None:
    """count softmax entries, inserted in one transaction (put() commits each: slow for thousands)."""
    from dataclasses import asdict

    from autosoft.cache import _entry_fields

    Cache(path)
    rows = [{**asdict(e.key), **_entry_fields(e)}
            for e in (make_entry(softmax_key(f"{i + 1}x1000"), params={"p": i}) for i in range(count))]
    with sqlite3.connect(path) as conn:
        conn.executemany(f"INSERT INTO entries ({', '.join(rows[0])}) VALUES ({', '.join(':' + c for c in rows[0])})",
                         rows)
    conn.close()


def test_list_into_head_exits_quietly(tmp_path):
    """Thousands of rows do not fit the pipe: the write itself fails when head has gone."""
    path = tmp_path / "big.sqlite"
    _cache_with_entries(path, 3000)
    script = f'"{sys.executable}" -m autosoft list --cache "{path}" | head -2; echo "status ${{PIPESTATUS[0]}}" >&2'
    result = subprocess.run(["bash", "-c", script], env=cli_env(tmp_path / "cache"), capture_output=True, text=True,
                            timeout=120)
    assert result.stdout.splitlines()[0].startswith(f"{path}: 3000 entries") and len(result.stdout.splitlines()) == 2
    assert result.stderr == "status 141\n", result.stderr


def test_list_into_a_pipe_closed_before_the_last_flush_exits_quietly(tmp_path):
    """A few rows stay in stdout's buffer until exit: the failure comes at the final flush."""
    path = tmp_path / "small.sqlite"
    _cache_with_entries(path, 3)
    proc = subprocess.Popen([sys.executable, "-m", "autosoft", "list", "--cache", str(path)],
                            env=cli_env(tmp_path / "cache"), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the only reader is gone before the child has printed anything
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (141, "")


def _run_with_env(args: list[str], cache_dir: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autosoft", *args], env={**cli_env(cache_dir), **env}, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_tilde_is_expanded_in_cache_and_output_of_every_command(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    Cache(home / "mine.sqlite").put(make_entry(_export_key("64x1000"), variant_name="softmax_in_home"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    listed = _run_with_env(["list", "--cache=~/mine.sqlite"], tmp_path / "cache", cwd, HOME=str(home))
    assert listed.returncode == 0, listed.stderr
    assert "1 entries" in listed.stdout and "softmax_in_home" in listed.stdout
    exported = _run_with_env(["export", "softmax", "--shape", "64x1000", "--cache=~/mine.sqlite", "-o", "~/out/k.cu"],
                             tmp_path / "cache", cwd, HOME=str(home))
    assert exported.returncode == 0, exported.stderr
    assert (home / "out" / "k.cu").read_text().startswith("// autosoft ")
    assert not list(cwd.iterdir()), "no folder named ~ is made"


CACHE_DIR_COMMANDS = {  # every command, in each form that reaches the cache differently or not at all
    "tune": ["tune", "softmax", "--shape", "64x1000"],
    "tune_replay": ["tune", "softmax", "--shape", "64x1000", "--replay", "{studies}"],
    "tune_gpus": ["tune", "softmax", "--shape", "64x1000", "--gpus", "0"],
    "list": ["list"],
    "list_storage": ["list", "--storage", "sqlite:///{studies}"],
    "collect": ["collect", "--storage", "sqlite:///{studies}"],
    "export": ["export", "softmax", "--shape", "64x1000", "-o", "k.cu"],
    "render": ["render", "softmax", "--shape", "64x1000"],
    "report": ["report", "-o", "r"],
    "report_storage": ["report", "--storage", "sqlite:///{studies}", "-o", "r"],
    "native": ["native"],
    "generalize": ["generalize", "softmax"],
}


def test_the_cache_dir_cases_name_every_command():
    from autosoft.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert set(commands) == {args[0] for args in CACHE_DIR_COMMANDS.values()}


@pytest.mark.parametrize("command", sorted(CACHE_DIR_COMMANDS))
@pytest.mark.parametrize("below", ["", "sub"])
def test_a_cache_dir_variable_naming_a_file_is_a_one_line_error(tmp_path, command, below):
    from autosoft.storage import open_storage

    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    studies = tmp_path / "studies.sqlite"
    open_storage(f"sqlite:///{studies}", create=True)
    args = [a.format(studies=studies) for a in CACHE_DIR_COMMANDS[command]]
    result = _run_with_env(args, tmp_path / "cache", cwd, AUTOSOFT_CACHE_DIR=str(afile / below))
    line = _assert_user_error(result, tmp_path / "cache", cwd)
    assert "AUTOSOFT_CACHE_DIR" in line and f"{afile} exists" not in line and f"{afile} is a file" in line
    assert "autosoft tune creates it" not in result.stdout + line and result.stdout == ""
    assert afile.read_text() == "not a folder"


@pytest.mark.parametrize("extra", [[], ["--replay", "{cache}"], ["--gpus", "0"]])
def test_tune_refuses_a_cache_file_as_its_storage_and_changes_nothing(tmp_path, extra):
    """Optuna's tables went into the cache file (its `trials` table collides with Optuna's) and the
    tune ended after a quarter-minute of retries with "connection lost"."""
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    cache = cache_dir / "kernels.sqlite"
    Cache(cache).put(make_entry())
    before = cache.read_bytes()
    args = [a.format(cache=cache) for a in extra]
    result = run_cli(["tune", "softmax", "--shape", "64x1000", "--storage", f"sqlite:///{cache}", *args],
                     cache_dir, cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert "is an autosoft cache file, not an Optuna storage" in line and "Traceback" not in result.stderr
    assert cache.read_bytes() == before
    assert sorted(p.name for p in cache_dir.iterdir()) == ["kernels.sqlite"]


@pytest.mark.parametrize("locked", ["file", "folder"])
def test_collect_into_a_read_only_cache_is_one_line_and_changes_nothing(tmp_path, locked):
    from autosoft.batch import entry_record
    from autosoft.board import Board
    from autosoft.storage import open_storage

    studies = tmp_path / "studies.sqlite"
    storage = open_storage(f"sqlite:///{studies}", create=True)
    board = Board(storage)
    board.join(gpu="0", device="NVIDIA H200")
    lease = board.claim("softmax/float32/64x1000/NVIDIA H200/90/13.0/a/b", board.snapshot())
    board.finish(lease, {"problem": {"family": "softmax", "shape": "64x1000", "dtype": "float32"},
                         "entry": entry_record(make_entry(softmax_key("64x1000"))), "trials": 1})
    board.leave()
    folder = tmp_path / "ro"
    folder.mkdir()
    cache = folder / "kernels.sqlite"
    Cache(cache)
    before = cache.read_bytes()
    (cache if locked == "file" else folder).chmod(0o444 if locked == "file" else 0o555)
    try:
        result = run_cli_read_only_honoured(["collect", "--storage", f"sqlite:///{studies}", "--cache", str(cache)],
                                            tmp_path / "cache", cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"autosoft: error: cache {cache}: cannot be written (") and result.stdout == ""
    finally:
        cache.chmod(0o644)
        folder.chmod(0o755)
    assert cache.read_bytes() == before and [p.name for p in folder.iterdir()] == ["kernels.sqlite"]


@pytest.mark.parametrize("shapes", [["64x1000"], ["64x1000", "64x2000"]])
def test_a_failed_tune_leaves_no_empty_cache_or_studies_behind(tmp_path, shapes):
    """kernels.sqlite and kernels-studies.sqlite were left empty after a tune that failed; what
    existed before the tune stays as it was."""
    from autosoft.storage import open_storage

    recording = tmp_path / "recording.sqlite"
    Cache(recording)  # a cache without trials: the replay fails after the files were made
    args = ["tune", "softmax", *[a for shape in shapes for a in ("--shape", shape)], "--replay", str(recording)]
    cache_dir = tmp_path / "new" / "cache"
    result = run_cli(args, cache_dir, cwd=tmp_path)
    assert result.returncode == 2 and "no recorded trials" in result.stderr.splitlines()[-1], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recording.sqlite"], "the folders it made are gone too"

    kept = tmp_path / "kept"
    kept.mkdir()
    Cache(kept / "kernels.sqlite")
    open_storage(f"sqlite:///{kept / 'kernels-studies.sqlite'}", create=True)  # no study, no trial
    before = (kept / "kernels.sqlite").read_bytes()
    result = run_cli(args, kept, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert sorted(p.name for p in kept.iterdir()) == ["kernels-studies.sqlite", "kernels.sqlite"]
    assert (kept / "kernels.sqlite").read_bytes() == before


def _export_key(shape: str):
    """A float32 entry export will pick: for this machine's GPU when it has one (export prefers it)."""
    if not gpu_available():
        return softmax_key(shape, "float32")
    from autosoft.runtime import device_info

    info = device_info()
    return softmax_key(shape, "float32", gpu_name=info.name, compute_capability=info.compute_capability)


def _export_setup(tmp_path: Path) -> tuple[Path, Path, bytes]:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cache = cwd / "tuned.sqlite"
    Cache(cache).put(make_entry(_export_key("64x1000")))
    return cwd, cache, cache.read_bytes()


def _export_to(output: str, cache: str, tmp_path: Path, cwd: Path) -> subprocess.CompletedProcess:
    return run_cli(["export", "softmax", "--shape", "64x1000", "-o", output, "--cache", cache],
                   tmp_path / "cache", cwd=cwd)


OUTPUT_CASES = {  # -o, what the one-line error says
    "a_folder": (".", "is a folder"),
    "a_folder_with_slash": ("sub/", "is a folder"),
    "under_a_file": ("afile.txt/x.cu", "afile.txt exists and is not a folder"),
    "deeper_under_a_file": ("afile.txt/a/b/x.cu", "afile.txt exists and is not a folder"),
    "the_cache": ("tuned.sqlite", "is the cache file"),
    "the_cache_relative": ("sub/../tuned.sqlite", "is the cache file"),
    "the_cache_through_a_link": ("link.sqlite", "is the cache file"),
    "the_cache_through_a_hard_link": ("hard.sqlite", "is the cache file"),
    "the_cache_absolute": ("{cwd}/tuned.sqlite", "is the cache file"),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_export_to_a_bad_output_is_a_one_line_error_and_leaves_the_cache_alone(tmp_path, case):
    cwd, cache, before = _export_setup(tmp_path)
    (cwd / "sub").mkdir()
    (cwd / "afile.txt").write_text("keep me")
    (cwd / "link.sqlite").symlink_to("tuned.sqlite")
    os.link(cache, cwd / "hard.sqlite")
    output, says = OUTPUT_CASES[case]
    listing = sorted(p.name for p in cwd.iterdir())
    for cache_arg in ("tuned.sqlite", str(cache), "link.sqlite"):
        result = _export_to(output.format(cwd=cwd), cache_arg, tmp_path, cwd)
        line = _assert_user_error(result, tmp_path / "cache")
        assert says in line and "-o" in line, line
        assert result.stdout == ""
        assert cache.read_bytes() == before, "the cache is byte-for-byte what it was"
        assert (cwd / "afile.txt").read_text() == "keep me"
        assert sorted(p.name for p in cwd.iterdir()) == listing and not list((cwd / "sub").iterdir())


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_export_into_a_read_only_folder_is_a_one_line_error(tmp_path):
    cwd, cache, _ = _export_setup(tmp_path)
    locked = cwd / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = _export_to("locked/k.cu", str(cache), tmp_path, cwd)
        line = _assert_user_error(result, tmp_path / "cache")
        assert "locked/k.cu" in line and "ermission denied" in line
        assert not list(locked.iterdir())
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("fails", ["open", "fsync", "replace"])
def test_a_failed_export_write_leaves_the_old_file_whole_and_no_temporary(tmp_path, monkeypatch, capsys, fails):
    """Unwritable places (a refused open) and a full disk mid-write: one line, nothing half-written."""
    import errno

    from autosoft import cli

    cwd, cache, _ = _export_setup(tmp_path)
    old = cwd / "k.cu"
    old.write_text("// the previous export\n")
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path / "cache"))
    real = getattr(os, fails)

    def failing(*args, **kwargs):
        if fails == "open" and not str(args[0]).endswith(".tmp"):
            return real(*args, **kwargs)  # only the export's own temporary file is refused
        raise OSError(errno.EACCES if fails == "open" else errno.ENOSPC,
                      os.strerror(errno.EACCES if fails == "open" else errno.ENOSPC))

    monkeypatch.setattr(os, fails, failing)
    code = cli.main(["export", "softmax", "--shape", "64x1000", "-o", "k.cu", "--cache", str(cache)])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("autosoft: error: -o k.cu: cannot write")
    assert ("Permission denied" if fails == "open" else "No space left") in err
    assert old.read_text() == "// the previous export\n"
    assert sorted(p.name for p in cwd.iterdir()) == ["k.cu", "tuned.sqlite"], "no temporary file is left"


def test_export_replaces_an_existing_file_and_keeps_its_mode(tmp_path):
    cwd, cache, _ = _export_setup(tmp_path)
    old = cwd / "k.cu"
    old.write_text("// old\n")
    old.chmod(0o640)
    result = _export_to("k.cu", str(cache), tmp_path, cwd)
    assert result.returncode == 0, result.stderr
    assert old.read_text().startswith("// autosoft ") and (old.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in cwd.iterdir()) == ["k.cu", "tuned.sqlite"]


def test_list_shows_the_good_rows_and_one_warning_line_for_a_malformed_row(tmp_path):
    path = tmp_path / "tampered.sqlite"
    cache = Cache(path)
    for shape in ("1x1000", "2x1000", "3x1000"):
        cache.put(make_entry(softmax_key(shape), variant_name=f"softmax_{shape}"))
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE entries SET params = '{broken' WHERE shape = '2x1000'")
    conn.close()
    result = run_cli(["list", "--cache", str(path)], tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert "2 entries" in result.stdout and "softmax_1x1000" in result.stdout and "softmax_3x1000" in result.stdout
    assert "softmax_2x1000" not in result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("autosoft: warning: cache ") and str(path) in line and "rowid 2" in line
    assert "'2x1000'" in line and "params is not JSON" in line and "Traceback" not in result.stderr


# --- a family's own arguments ------------------------------------------------------------------

@pytest.mark.parametrize("arch, ok", [("90", True), ("sm_90", True), ("sm_90a", True), ("80", True),
                                      ("75", False), ("abc", False), ("sm_", False)])
def test_render_arch_takes_the_architectures_the_templates_support(tmp_path, arch, ok):
    result = run_cli(["render", "softmax", "--shape", "4x1000", "--arch", arch], tmp_path / "cache")
    if ok:
        assert result.returncode == 0, result.stderr
        assert "constexpr int N = 1000;" in result.stdout
    else:
        line = _assert_user_error(result, tmp_path / "cache")
        assert "arch" in line and ("80" in line or "compute capability" in line)


def test_a_broken_constraint_after_param_names_the_defaults_it_meets(tmp_path):
    result = run_cli(["render", "softmax", "--shape", "4x3", "--param", "vec=4"], tmp_path / "cache")
    line = _assert_user_error(result, tmp_path / "cache")
    assert "default's" in line and "row_threads=" in line and "--param" in line


def test_render_help_lists_every_parameter_and_its_values(tmp_path):
    from autosoft.families import get_family
    from autosoft.families.base import space_of

    result = run_cli(["render", "softmax", "--help"], tmp_path / "cache")
    assert result.returncode == 0
    for parameter in space_of(get_family("softmax")).parameters:
        line = next(l for l in result.stdout.splitlines() if l.split()[:1] == [parameter.name])
        assert ", ".join(map(str, parameter.values)) in line


def test_each_familys_help_says_what_it_computes_in_whole_sentences(tmp_path):
    from autosoft.cli import family_summary
    from autosoft.families import families

    listing = run_cli(["tune", "--help"], tmp_path / "cache").stdout
    for family in families().values():
        summary = family_summary(family)
        assert summary.endswith("."), f"{family.name}: {summary!r} stops mid-sentence"
        out = run_cli(["tune", family.name, "--help"], tmp_path / "cache").stdout
        description = out.split("\n\n")[1]  # usage, description, options
        assert " ".join(description.split()) == summary
        assert summary.split()[-1] in listing  # the families' list has it whole too


@pytest.mark.parametrize("family,shape,dtype,options", [
    ("softmax", "4096x8192", "float16", {"log": True}),
    ("softmax_backward", "64x1000", "float32", {}),
    ("attention", "1,32,1,128", "bfloat16", {"causal": True, "kv_heads": 8, "kv_len": 4096}),
    ("attention", "2,8,300,64", "float16", {"window_left": 100, "window_right": 0, "softcap": 30.0}),
    ("attention_colsum", "1,4,512,64", "bfloat16", {"split": 448, "causal": True}),
])
def test_the_tune_command_a_problem_names_tunes_that_problem(family, shape, dtype, options):
    # export's "not tuned" error names it; it once wrote the cache key (1x32x1x128+kv_heads=8), which --shape refuses
    from autosoft.cli import _problem, build_parser
    from autosoft.families import get_family

    problem = get_family(family).problem(shape, dtype, options)
    words = problem.tune_command.split()
    assert words[:3] == ["autosoft", "tune", family]
    args = build_parser().parse_args(["render"] + words[2:])  # render takes tune's problem arguments, one of each
    assert _problem(args)[1] == problem


def test_each_family_brings_its_own_options_and_dtypes(tmp_path):
    attention = run_cli(["tune", "attention", "--help"], tmp_path / "cache").stdout
    softmax = run_cli(["tune", "softmax", "--help"], tmp_path / "cache").stdout
    assert "--causal" in attention and "--causal" not in softmax
    assert "default bfloat16" in attention and "default float32" in softmax
    assert "B,H,N,D" in attention and "MxN" in softmax
    result = run_cli(["render", "attention", "--shape", "1,2,77,64"], tmp_path / "cache")
    assert result.returncode == 0 and "variant attention_bf16_" in result.stdout, "attention defaults to bfloat16"
    result = run_cli(["render", "softmax", "--shape", "4x8", "--causal"], tmp_path / "cache")
    line = _assert_user_error(result, tmp_path / "cache")
    assert "--causal" in line and "autosoft render softmax --help" in line


# --- generalize: the selector's command ------------------------------------------------------------

def _tuned(cache_dir: Path, shapes: list[str]) -> Cache:
    cache = Cache(cache_dir / "kernels.sqlite")
    for shape in shapes:
        cache.put(make_entry(softmax_key(shape)))
    return cache


def test_generalize_with_too_few_tuned_shapes_is_one_line_and_changes_nothing(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = _tuned(cache_dir, ["256x512", "64x65536"])
    before = cache.path.read_bytes()
    result = run_cli(["generalize", "softmax"], cache_dir)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "2 tuned softmax shapes" in result.stderr and "at least 3" in result.stderr
    assert cache.path.read_bytes() == before


@pytest.mark.skipif(gpu_available(), reason="checks the message on a machine without a CUDA device")
def test_generalize_without_a_device_is_one_line_and_changes_nothing(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = _tuned(cache_dir, ["256x512", "512x1024", "64x65536"])
    before = cache.path.read_bytes()
    result = run_cli(["generalize", "softmax", "--max-configs", "4"], cache_dir)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert "CUDA" in result.stderr or "GPU" in result.stderr
    assert cache.path.read_bytes() == before and result.stdout == ""


def test_list_shows_a_line_per_selector(tmp_path):
    from helpers import make_selector

    cache_dir = tmp_path / "cache"
    cache = _tuned(cache_dir, ["256x512"])
    params = make_entry(softmax_key("256x512")).params
    cache.put_selector(make_selector([dict(params), {**params, "unroll": 2}]))
    result = run_cli(["list"], cache_dir)
    assert result.returncode == 0, result.stderr
    assert ("selector softmax on NVIDIA H200 (sm_90, NVRTC 13.x): 2 configurations, 3 shapes fitted, tree depth 0"
            in result.stdout.splitlines())
