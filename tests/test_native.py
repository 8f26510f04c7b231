"""autosoft.native without a GPU: native_ops.cpp builds against the installed torch, once per
source and torch; its kernels register for AutogradCUDA (and only there) and deregister; records
refuse what they cannot launch; `autosoft native` says what it built. Skipped where torch, a C++
compiler or ninja is missing (the CLI's error for those is tested in test_cli.py)."""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import autosoft  # noqa: E402
import autosoft.torch_ops  # noqa: E402,F401 - defines torch.ops.autosoft
from autosoft import native  # noqa: E402
from helpers import cli_env, run_cli, run_cli_read_only_honoured  # noqa: E402

native._ninja_on_path()
if shutil.which("c++") is None or shutil.which("ninja") is None:
    pytest.skip("needs a C++ compiler and ninja", allow_module_level=True)

# a build keeps a C++ compiler busy for long: one worker runs the module under
# `pytest -n 2 --dist loadgroup`, so its module fixtures (one build, by three processes at once)
# are made once
pytestmark = pytest.mark.xdist_group("native")

# what each of two programs that find no library runs: build it, load it, print its path
_BUILD_AND_LOAD = ("import autosoft.torch_ops\nfrom autosoft import native\n"
                   "import torch\npath = native.build(); torch.ops.load_library(str(path)); print(path)")


@pytest.fixture(scope="module")
def cache_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("native-cache")


@pytest.fixture(scope="module")
def built_at_once(cache_folder):
    """`autosoft native` and two programs that build and load the library, started together on
    one fresh cache folder: the CLI's result, the programs' (exit status, stdout, stderr), and
    the libraries left in the folder."""
    env = cli_env(cache_folder)
    runs = [subprocess.Popen([sys.executable, *args], env=env, cwd=cache_folder, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for args in (["-m", "autosoft", "native"], ["-c", _BUILD_AND_LOAD], ["-c", _BUILD_AND_LOAD])]
    outs = [run.communicate(timeout=600) for run in runs]
    results = [(run.returncode, out, err) for run, (out, err) in zip(runs, outs)]
    return results[0], results[1:], sorted((cache_folder / "native").glob("*/*.so"))


@pytest.fixture(scope="module")
def module(built_at_once, cache_folder):
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


def test_the_cli_builds_once_and_says_so(built_at_once, cache_folder):
    (code, out, err), _, built = built_at_once
    assert code == 0, err
    assert out.startswith("built in ")
    assert len(built) == 1 and str(built[0]) in out
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


def test_two_processes_building_at_once_both_load_a_whole_library(built_at_once):
    """Two programs (or two xdist workers) that find no library build it at once: cpp_extension's
    lock lets one link; the other must neither load a library still being written nor fail when
    the first has already moved it into place. (The CLI builds beside them, a third process.)"""
    _, programs, built = built_at_once
    assert [code for code, _, _ in programs] == [0, 0], [err[-400:] for _, _, err in programs]
    assert programs[0][1] == programs[1][1] and programs[0][1].strip() == str(built[0])


def test_a_build_whose_library_another_process_moved_into_place_meanwhile_returns_it(tmp_path, monkeypatch):
    """The child waited for the other process's build lock, found the library built, and was
    loading it from the staging folder when the other process moved it into place: the child
    fails (ImportError), but the library is there, whole."""
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path))
    path = native.library_path()

    def other_process_wins(*args, **kwargs):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"the other process's library")
        return subprocess.CompletedProcess(args[0], 1, "", f"ImportError: {path.parent}/staging/{path.name}: "
                                                           "cannot open shared object file: No such file or directory")

    monkeypatch.setattr(native.subprocess, "run", other_process_wins)
    assert native.build() == path and path.read_bytes() == b"the other process's library"
    path.unlink()
    monkeypatch.setattr(native.subprocess, "run", lambda *args, **kwargs: subprocess.CompletedProcess(
        args[0], 1, "", "error: native_ops.cpp:1: broken"))
    with pytest.raises(native.NativeBuildError, match="building native_ops.cpp failed .*: error: native_ops.cpp:1: broken"):
        native.build()


# --- the public functions' compiled first step (softmax_direct, log_softmax_direct) ---------------

def test_the_public_entries_take_no_call_they_cannot_launch(module):
    """Every call that is not a plain CUDA tensor along the last dim without out gets None (the
    public function's Python path then runs), and none reaches the miss callback (which runs that
    path and records): host, meta and subclass tensors, other dims, out, non-arrays."""
    assert module.softmax_direct(torch.randn(4, 8), -1, None) is None, "before init the entries take nothing"
    misses = []
    module.init(1, lambda op, x: misses.append(op))  # a stand-in driver address: nothing is launched here
    try:
        assert module.direct_on()
        x = torch.randn(4, 8)
        for entry in (module.softmax_direct, module.log_softmax_direct):
            for args in ((x, -1, None), (x, 1, None), (x, 0, None), (x, -2, None), (x, 2, None), (x, -1, torch.empty(4, 8)), (x, True, None), (x, 2**70, None),
                         (torch.empty(4, 8, device="meta"), -1, None), (torch.nn.Parameter(x), -1, None),
                         (x.numpy(), -1, None), (None, -1, None), (x, -1)):
                assert entry(*args) is None, args
        assert misses == []
    finally:
        module.disable()
    assert not module.direct_on() and not module.enabled()


def test_unreplayable_marks_are_no_records(module):
    with pytest.raises(RuntimeError, match="no operator"):
        module.record_unreplayable(2, torch.empty(4, 8, device="meta"))
    module.record_unreplayable(0, torch.empty(4, 8, device="meta"))
    try:
        assert module.size() == 0, "a mark that a plan cannot be replayed is not a record that launches"
    finally:
        module.clear()


@pytest.fixture
def with_driver(module, cache_folder, monkeypatch):
    """autosoft.native as on a GPU machine with the build: a stand-in cuLaunchKernel address (no
    call here reaches it), this module's cache folder, nothing loaded before; undone after."""
    from autosoft import api

    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(cache_folder))
    monkeypatch.setattr(native, "_cu_launch_kernel", lambda: 1)
    monkeypatch.setattr(native, "_module", None)
    api._direct_reset()
    yield api
    if native._module is not None:
        native._module.disable()
    api._direct_reset()


def test_direct_loads_the_build_unless_autosoft_native_is_0(with_driver, monkeypatch):
    monkeypatch.setenv("AUTOSOFT_NATIVE", "0")
    assert native.direct() is None and native._module is None
    monkeypatch.delenv("AUTOSOFT_NATIVE")
    softmax_entry, log_softmax_entry = native.direct()
    assert softmax_entry.__name__ == "softmax_direct" and log_softmax_entry.__name__ == "log_softmax_direct"
    assert native.direct_enabled() and not native.enabled(), "no operator kernel is registered by the public path"
    native.disable()
    assert not native.direct_enabled()


def test_enable_after_a_build_makes_the_public_functions_ask_again(with_driver, monkeypatch):
    """A process whose first CUDA call found no build holds the Python path; `autosoft native`
    building and enabling in that process must hand the public functions the compiled entries
    (native tells what direct()'s caller gave it, once however often it asked)."""
    api = with_driver
    with monkeypatch.context() as before_the_build:
        before_the_build.setattr(native, "_loaded", lambda: None)
        assert native.direct(ask_again=api._direct_reset) is None
        assert native.direct(ask_again=api._direct_reset) is None
    api._softmax_direct = api._log_softmax_direct = api._no_direct  # what _first_direct holds then
    assert native._asking_again.count(api._direct_reset) == 1
    assert native.enable()
    assert api._softmax_direct is api._softmax_first and api._log_softmax_direct is api._log_softmax_first


def test_host_tensors_load_nothing_and_keep_the_public_error(with_driver):
    api = with_driver
    with pytest.raises(TypeError, match="CPU tensor"):
        autosoft.softmax(torch.randn(4, 8))
    assert api._softmax_direct is api._softmax_first and native._module is None, "loaded for a host tensor"


@pytest.mark.parametrize("installed", [False, True])
def test_compile_traces_the_public_functions_as_operators_with_the_entries_installed_or_not(
        with_driver, no_kernels, installed):
    """torch.compile (fullgraph: a call into the extension would break the graph) sees the
    operators whether the public functions still hold their loader or the compiled entries."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    api = with_driver
    if installed:
        api._softmax_direct, api._log_softmax_direct = native.direct()
        api._compiling = torch.compiler.is_dynamo_compiling
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: autosoft.softmax(x) + autosoft.log_softmax(x), backend=backend, fullgraph=True)
    with FakeTensorMode():
        assert compiled(torch.empty(4, 8, device="cuda")).shape == (4, 8)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function" and "autosoft" in str(n.target)]
    assert targets == ["autosoft.softmax.default", "autosoft.log_softmax.default"]
    torch._dynamo.reset()


def test_the_public_functions_return_what_their_entry_gives_and_fall_through_on_none(monkeypatch):
    """The wiring, with stand-in entries: each public function hands (x, dim, out) to its own entry
    and returns its result untouched; on None its Python path runs (here: the host tensor's error)."""
    from autosoft import api

    calls = []

    def entry(name, result):
        return lambda x, dim, out: calls.append((name, x, dim, out)) or result

    sentinel = object()
    monkeypatch.setattr(api, "_compiling", lambda: False)
    monkeypatch.setattr(api, "_softmax_direct", entry("softmax", sentinel))
    monkeypatch.setattr(api, "_log_softmax_direct", entry("log_softmax", None))
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    assert autosoft.softmax(x, 0, out) is sentinel
    with pytest.raises(TypeError, match="autosoft.log_softmax: x is a CPU tensor"):
        autosoft.log_softmax(x)
    assert [(name, a is x, dim, o) for name, a, dim, o in calls] == [("softmax", True, 0, out),
                                                                     ("log_softmax", True, -1, None)]


def test_a_build_that_cannot_load_leaves_the_python_paths_with_a_warning(tmp_path, monkeypatch):
    """A library this process cannot load (one built by another torch build of the same version,
    through a cache folder two environments share: undefined symbols) must not break every call of
    autosoft.softmax and every import of autosoft.torch_ops: a warning naming the fix, then the
    Python paths."""
    if native._module is not None:
        pytest.skip("a build is loaded in this process")
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_cu_launch_kernel", lambda: 1)
    path = native.library_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    with pytest.warns(RuntimeWarning, match="autosoft native --force"):
        assert native.direct() is None
    with pytest.warns(RuntimeWarning, match="autosoft native --force"):
        assert native.enable() is False
    assert native._module is None and not _has_kernel("AutogradCUDA")


def test_the_library_name_tells_torch_builds_of_one_version_apart(monkeypatch):
    """Two torch builds with one version string (PyPI's and conda-forge's, a source build) link
    differently: each gets its own library."""
    name = native._name(torch)
    monkeypatch.setattr(torch.version, "git_version", "0" * 40)
    assert native._name(torch) != name
