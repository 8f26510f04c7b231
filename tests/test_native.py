"""autosoft.native without a GPU: native_ops.cpp builds against the installed torch, once per
source and torch; its kernels register for AutogradCUDA (and only there) and deregister; records
refuse what they cannot launch; `autosoft native` says what it built. Skipped where torch, a C++
compiler or ninja is missing (the CLI's error for those is tested in test_cli.py)."""
from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")

import autosoft.torch_ops  # noqa: E402,F401 - defines torch.ops.autosoft
from autosoft import native  # noqa: E402
from helpers import run_cli, run_cli_read_only_honoured  # noqa: E402

native._ninja_on_path()
if shutil.which("c++") is None or shutil.which("ninja") is None:
    pytest.skip("needs a C++ compiler and ninja", allow_module_level=True)

# a build keeps a C++ compiler busy for long: one worker runs the module under
# `pytest -n 2 --dist loadgroup`, so its module fixtures (one build, by the CLI) are made once
pytestmark = pytest.mark.xdist_group("native")


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture(scope="module")
def cli_build(cache_folder):
    """`autosoft native` run in a fresh cache folder: what it printed, and the libraries it left."""
    first = run_cli(["native"], cache_folder, cwd=cache_folder, timeout=600)
    return first, sorted((cache_folder / "native").glob("*/*.so"))


@pytest.fixture(scope="module")
def module(cli_build, cache_folder):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AUTOSOFT_CACHE_DIR", str(cache_folder))
        path = native.build()
        assert path.is_file() and path.parent.parent == cache_folder / "native"
        assert native.build() == path, "a second build of the same source and torch is the same file"
        return native._load(path)


def test_a_failed_forced_rebuild_keeps_the_built_library(module, cache_folder, monkeypatch):
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(cache_folder))
    path = native.library_path()
    before = path.read_bytes()
    monkeypatch.setenv("CXX", shutil.which("false") or "/bin/false")
    with pytest.raises(native.NativeBuildError, match="building native_ops.cpp failed"):
        native.build(force=True)
    assert path.read_bytes() == before


def _has_kernel(key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("autosoft::softmax", key)


def test_the_kernels_register_for_autograd_cuda_only_and_deregister(module):
    assert not module.enabled() and not _has_kernel("AutogradCUDA")
    calls = []
    module.enable(1, lambda *args: calls.append(args))  # a stand-in driver address: nothing is launched here
    try:
        assert module.enabled()
        assert _has_kernel("AutogradCUDA")
        assert torch._C._dispatch_has_kernel_for_dispatch_key("autosoft::log_softmax", "AutogradCUDA")
        # CPU tensors still reach the Python kernels, which refuse them with the public function's error
        with pytest.raises(TypeError, match="CPU tensor"):
            torch.ops.autosoft.softmax(torch.randn(4, 8), -1)
        assert calls == []
    finally:
        module.disable()
    assert not module.enabled() and not _has_kernel("AutogradCUDA")


def test_records_refuse_what_cannot_be_launched(module):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        module.record(0, x, 1234, [1, 1, 1, 32, 1, 1, 0], [0, 0], 0, 1)
    meta = torch.empty(4, 8, device="meta")
    with pytest.raises(RuntimeError, match="no operator"):
        module.record(7, meta, 1234, [1, 1, 1, 32, 1, 1, 0], [0, 0], 0, 1)
    assert module.size() == 0


def test_the_cli_builds_once_and_says_so(cli_build, cache_folder):
    first, built = cli_build
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("built in ")
    assert len(built) == 1 and str(built[0]) in first.stdout
    again = run_cli(["native"], cache_folder, cwd=cache_folder)
    assert again.returncode == 0 and again.stdout.startswith("already built: ")


def test_a_second_folder_in_one_process_gets_its_own_build(module, tmp_path, monkeypatch):
    # cpp_extension skips a build it made before in the same process; the build's child process does not
    from torch.utils import cpp_extension

    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path / "other"))
    path = native.build()
    assert path.is_file() and str(path).startswith(str(tmp_path / "other"))
    assert path.stem not in cpp_extension.JIT_EXTENSION_VERSIONER.entries, "built in this process, not a child"


def test_enable_without_a_build_or_with_a_bad_cache_folder_leaves_the_python_kernels(tmp_path, monkeypatch):
    if native._module is not None:
        pytest.skip("a build is loaded in this process (enable() then needs no folder)")
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path / "empty"))
    assert native.enable() is False
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(not_a_folder))
    assert native.enable() is False
    assert not _has_kernel("AutogradCUDA")


def test_native_with_a_read_only_cache_folder_is_one_line_and_builds_nothing(tmp_path):
    """The folder beside the cache could not be made: a traceback, before."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        result = run_cli_read_only_honoured(["native"], locked, cwd=tmp_path)
    finally:
        locked.chmod(0o755)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"autosoft: error: autosoft native: cannot write the build {locked / 'native'} (")
    assert "AUTOSOFT_CACHE_DIR" in line and result.stdout == ""
    assert not list(locked.iterdir())


def test_two_processes_building_at_once_both_load_a_whole_library(tmp_path):
    """Two programs (or two xdist workers) that find no library build it at once: cpp_extension's
    lock lets one link; the other must neither load a library still being written nor fail when
    the first has already moved it into place."""
    import os
    import subprocess
    import sys

    child = ("import autosoft.torch_ops\nfrom autosoft import native\n"
             "import torch\npath = native.build(); torch.ops.load_library(str(path)); print(path)")
    env = {**os.environ, "AUTOSOFT_CACHE_DIR": str(tmp_path / "cache")}
    runs = [subprocess.Popen([sys.executable, "-c", child], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    outs = [run.communicate(timeout=600) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-400:] for _, err in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().endswith(".so")
