"""kernel_store.py without a GPU: cubins by digest, atomic writes, the size bound, damaged files,
unwritable folders, verification records; and compile.py's one-line error when libnvrtc is missing."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

import autosoft.compile as compiler
import autosoft.kernel_store as kernel_store
from autosoft.compile import CompileResult
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Problem, Target, build_variant
from autosoft.kernel_store import CompileFailed, KernelStore, default_store, default_store_folder

from helpers import REPO, cli_env, make_entry, softmax_key

SOFTMAX = get_family("softmax")
H200 = Target(arch="90", name="NVIDIA H200", sm_count=132)


def _variant(shape=(4096, 8192), dtype="float32", target=H200, **changes):
    problem = Problem("softmax", dtype, shape)
    params = {**SOFTMAX.default_params(problem, target), **changes}
    return build_variant(SOFTMAX, problem, params, target)


@pytest.fixture
def compiles(monkeypatch):
    """NVRTC stand-in: a fake cubin per source, every call recorded."""
    calls: list[str] = []

    def fake(source, arch, name="kernel.cu"):
        calls.append(source)
        return CompileResult(True, b"CUBIN" + hashlib.sha256(f"{source}{arch}".encode()).digest() * 8, "")

    monkeypatch.setattr(compiler, "compile_source", fake)
    return calls


def _no_compile(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("NVRTC was called although the store holds the kernel")

    monkeypatch.setattr(compiler, "compile_source", forbidden)


# --- cubins by digest -------------------------------------------------------------------------

def test_a_miss_compiles_once_and_a_fresh_store_loads_without_nvrtc(tmp_path, compiles, monkeypatch):
    variant = _variant()
    store = KernelStore(tmp_path / "kernels")
    cubin = store.get_or_compile(variant)
    assert len(compiles) == 1
    assert store.get_or_compile(variant) == cubin and len(compiles) == 1
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [f"{variant.digest}.cubin"]
    _no_compile(monkeypatch)
    fresh = KernelStore(tmp_path / "kernels")  # what a new process sees
    assert fresh.get_or_compile(variant) == cubin
    assert fresh.stats().hits == 1 and fresh.stats().compiles == 0


def test_row_counts_of_one_row_length_share_one_cubin(tmp_path, compiles):
    store = KernelStore(tmp_path / "kernels")
    a, b, c = _variant((4096, 8192)), _variant((4097, 8192)), _variant((256, 8192))
    assert a.source == b.source == c.source and a.digest == b.digest == c.digest
    assert store.get_or_compile(a) == store.get_or_compile(b) == store.get_or_compile(c)
    assert len(compiles) == 1
    store.get_or_compile(_variant((4096, 8000)))  # another row length is another kernel
    assert len(compiles) == 2


def test_a_real_cubin_round_trips(tmp_path):
    variant = _variant((64, 1000))
    cubin = KernelStore(tmp_path).get_or_compile(variant)
    assert cubin.startswith(b"\x7fELF")
    assert KernelStore(tmp_path).get(variant.digest) == cubin


def test_a_compile_failure_is_raised_and_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler, "compile_source",
                        lambda source, arch, name="k": CompileResult(False, b"", "kernel.cu(3): error: nope\nmore"))
    store = KernelStore(tmp_path)
    variant = _variant()
    with pytest.raises(CompileFailed, match=f"{variant.name} does not compile: kernel.cu\\(3\\): error: nope$"):
        store.get_or_compile(variant)
    assert isinstance(CompileFailed("x"), RuntimeError)
    assert not list(tmp_path.iterdir())


def test_digests_that_are_not_digests_are_refused(tmp_path):
    store = KernelStore(tmp_path)
    for bad in ("../../etc/passwd", "A" * 64, "ab" * 31, ""):
        with pytest.raises(ValueError):
            store.get(bad)
        with pytest.raises(ValueError):
            store.put(bad, b"x")


# --- atomic writes and damaged files -----------------------------------------------------------

def test_a_write_is_never_visible_half_done(tmp_path, monkeypatch):
    store = KernelStore(tmp_path)
    digest, cubin = "ab" * 32, os.urandom(100_000)
    final = store.cubin_path(digest)
    seen = []
    real_replace = os.replace

    def watching_replace(src, dst):
        # the whole file exists under a temporary name in the same folder; the final name does not yet
        seen.append((Path(src).parent == tmp_path, final.exists(), Path(src).stat().st_size))
        real_replace(src, dst)

    monkeypatch.setattr(kernel_store.os, "replace", watching_replace)
    assert store.put(digest, cubin)
    assert seen == [(True, False, len(cubin) + kernel_store._HEADER_LEN)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name], "no temporary file left"
    assert store.get(digest) == cubin


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path, compiles):
    """A process that dies between writing and renaming leaves a temporary file that no reader
    takes for a kernel; a later write after an hour sweeps it away."""
    variant = _variant()
    code = ("import os, autosoft.kernel_store as ks; os.replace = lambda *a: os._exit(3); "
            f"ks.KernelStore({str(tmp_path)!r}).put({variant.digest!r}, b'x' * 50000)")
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(tmp_path / "cache"), cwd=REPO, timeout=120)
    assert result.returncode == 3
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp") and leftovers[0].name.startswith(".")
    store = KernelStore(tmp_path)
    assert store.get(variant.digest) is None
    old = time.time() - 2 * kernel_store._STALE_TEMP_S
    os.utime(leftovers[0], (old, old))
    cubin = store.get_or_compile(variant)
    assert len(compiles) == 1 and store.get(variant.digest) == cubin
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{variant.digest}.cubin"]


def _damages(data: bytes, other: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    flipped[-10] ^= 0xFF
    return {"empty": b"", "truncated_header": data[:20], "truncated_cubin": data[: len(data) // 2],
            "flipped_byte": bytes(flipped), "garbage": os.urandom(len(data)), "another_digest": other}


@pytest.mark.parametrize("kind", ["empty", "truncated_header", "truncated_cubin", "flipped_byte", "garbage",
                                  "another_digest"])
def test_a_damaged_file_is_a_miss_and_is_rebuilt(tmp_path, compiles, kind):
    variant = _variant()
    other = _variant((4096, 1000))
    store = KernelStore(tmp_path)
    cubin = store.get_or_compile(variant)
    store.get_or_compile(other)
    path = store.cubin_path(variant.digest)
    path.write_bytes(_damages(path.read_bytes(), store.cubin_path(other.digest).read_bytes())[kind])
    fresh = KernelStore(tmp_path)
    assert fresh.get(variant.digest) is None
    assert fresh.stats().misses == 1
    assert fresh.get_or_compile(variant) == cubin
    assert len(compiles) == 3
    assert KernelStore(tmp_path).get(variant.digest) == cubin, "the rebuilt file is whole"


# --- the size bound ---------------------------------------------------------------------------

def _age(store: KernelStore, digest: str, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    os.utime(store.cubin_path(digest), (t, t))


def test_the_bound_evicts_the_least_recently_used(tmp_path):
    size = 1000 + kernel_store._HEADER_LEN
    store = KernelStore(tmp_path, max_bytes=int(2.5 * size))
    a, b, c, d = (hashlib.sha256(name.encode()).hexdigest() for name in "abcd")
    store.put(a, b"a" * 1000)
    store.put(b, b"b" * 1000)
    _age(store, a, 300)
    _age(store, b, 200)
    store.mark_verified(_stub(b))
    assert store.get(a) == b"a" * 1000  # a hit makes a the most recently used
    store.put(c, b"c" * 1000)
    assert store.get(b) is None, "b was the least recently used"
    assert store.get(a) is not None and store.get(c) is not None
    assert not list(tmp_path.glob(f"{b}-*.verified")), "an evicted kernel's verification goes with it"
    assert store.size_bytes() <= store.max_bytes and store.stats().evictions == 1
    store.put(d, b"d" * 5000)  # larger than the bound alone: kept, everything else goes
    assert [p.stem for p in tmp_path.glob("*.cubin")] == [d]


def test_a_bound_of_zero_keeps_kernels_in_memory_only(tmp_path, compiles):
    store = KernelStore(tmp_path / "kernels", max_bytes=0)
    variant = _variant()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a store switched off is no reason to warn
        assert store.get_or_compile(variant) == store.get_or_compile(variant)
    assert len(compiles) == 1 and not (tmp_path / "kernels").exists()


# --- unwritable folders -------------------------------------------------------------------------

def test_an_unwritable_folder_warns_once_and_still_works(tmp_path, compiles):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    store = KernelStore(blocker / "kernels")  # cannot be created, even by root
    variant = _variant()
    with pytest.warns(RuntimeWarning, match="not writable") as caught:
        cubin = store.get_or_compile(variant)
        assert store.get_or_compile(_variant((4096, 8000))) != cubin
        store.mark_verified(variant)
    assert len(caught) == 1
    assert store.get_or_compile(_variant((8, 8192))) == cubin, "kept in memory: no second compile"
    assert len(compiles) == 2
    assert store.is_verified(variant), "recorded in memory for the process"
    assert blocker.read_text() == "not a folder"


def test_a_read_only_store_still_serves(tmp_path, compiles, monkeypatch):
    variant = _variant()
    cubin = KernelStore(tmp_path).get_or_compile(variant)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(kernel_store.os, "utime", refuse)
    monkeypatch.setattr(kernel_store.tempfile, "mkstemp", refuse)
    _no_compile(monkeypatch)
    assert KernelStore(tmp_path).get_or_compile(variant) == cubin


# --- verification records -----------------------------------------------------------------------

def _stub(digest: str):
    class Stub:
        name, target = "stub", H200

    stub = Stub()
    stub.digest = digest
    return stub


def test_a_race_is_recorded_per_problem_contenders_and_kind_of_gpu(tmp_path):
    problem = Problem("softmax", "float32", (100, 8192))
    a, b = _variant((100, 8192)), _variant((100, 8192), vec=2)
    store = KernelStore(tmp_path)
    assert store.race_winner(problem, [a, b]) is None
    store.record_race(problem, [a, b], b)
    assert store.race_winner(problem, [a, b]) == b.digest
    fresh = KernelStore(tmp_path)
    assert fresh.race_winner(problem, [b, a]) == b.digest, "read back in a new process, in any order"
    assert fresh.race_winner(Problem("softmax", "float32", (4096, 8192)), [a, b]) is None, "another row count"
    c = _variant((100, 8192), vec=1)
    assert fresh.race_winner(problem, [a, c]) is None, "other contenders race again"
    h100 = replace(H200, name="NVIDIA H100", sm_count=114)
    assert fresh.race_winner(problem, [_variant((100, 8192), target=h100), _variant((100, 8192), target=h100, vec=2)]) is None
    (tmp_path / next(p.name for p in tmp_path.glob("*.race"))).write_text("not-a-digest\n")
    assert KernelStore(tmp_path).race_winner(problem, [a, b]) is None, "a record naming no contender is ignored"


def test_a_verification_is_recorded_per_digest_and_kind_of_gpu(tmp_path, compiles):
    store = KernelStore(tmp_path)
    variant = _variant((4096, 8192))
    assert not store.is_verified(variant)
    store.mark_verified(variant)
    fresh = KernelStore(tmp_path)
    assert fresh.is_verified(variant) and fresh.is_verified(_variant((100, 8192))), "every M of this N"
    assert not fresh.is_verified(_variant((4096, 8000)))
    assert not fresh.is_verified(_variant((4096, 8192), target=replace(H200, name="NVIDIA H100", sm_count=114)))
    assert len(list(tmp_path.glob("*.verified"))) == 1


# --- where the store is ---------------------------------------------------------------------------

def test_the_store_sits_beside_the_cache_unless_told(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOSOFT_KERNEL_STORE", raising=False)
    monkeypatch.delenv("AUTOSOFT_KERNEL_STORE_BYTES", raising=False)
    assert default_store_folder() == tmp_path / "cache" / "kernels"
    assert default_store().max_bytes == 1 << 30
    assert default_store() is default_store(), "one store per folder in a process"
    monkeypatch.setenv("AUTOSOFT_KERNEL_STORE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("AUTOSOFT_KERNEL_STORE_BYTES", "12345")
    assert default_store().folder == tmp_path / "elsewhere" and default_store().max_bytes == 12345
    for bad in ("1G", "-1", "lots"):
        monkeypatch.setenv("AUTOSOFT_KERNEL_STORE_BYTES", bad)
        with pytest.raises(UserError, match="AUTOSOFT_KERNEL_STORE_BYTES"):
            default_store()


def test_the_store_imports_without_cupy(tmp_path):
    code = ("import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
            "from autosoft.kernel_store import KernelStore\n"
            f"s = KernelStore({str(tmp_path)!r}); s.put('ab' * 32, b'cubin'); assert s.get('ab' * 32) == b'cubin'")
    result = subprocess.run([sys.executable, "-c", code], env=cli_env(tmp_path / "cache"), cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --- libnvrtc missing ---------------------------------------------------------------------------

MISSING = ('Failure finding "libnvrtc.so.13": No such file\n  searched: /usr/lib\n  searched: /opt/cuda\n'
           + "\n".join(f"  line {i}" for i in range(35)))


class _MissingNvrtc:
    """CuPy's binding when libnvrtc is absent: its first call fails (cuda.pathfinder's error is a RuntimeError)."""

    class NVRTCError(RuntimeError):
        pass

    def getVersion(self):
        raise RuntimeError(MISSING)

    def createProgram(self, *args):
        raise RuntimeError(MISSING)


@pytest.fixture
def no_nvrtc(monkeypatch):
    monkeypatch.setattr(compiler, "_binding", lambda: _MissingNvrtc())
    # cuda-bindings finds no libnvrtc either: it answers None, and CuPy's binding says what to install
    monkeypatch.setattr(compiler, "_bindings_nvrtc_version", lambda: None)
    # and the library a process recorded beside the store is gone with it
    monkeypatch.setattr(compiler, "_recorded_nvrtc_version", lambda: None)
    compiler._nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()
    yield
    compiler._nvrtc.cache_clear()
    compiler.nvrtc_version.cache_clear()


def test_a_missing_libnvrtc_is_one_line_saying_what_to_install(no_nvrtc):
    for call in (compiler.nvrtc_version, lambda: compiler.compile_source("__global__ void k() {}", "90"),
                 lambda: compiler.source_digest("x", "90"), lambda: _variant().digest):
        with pytest.raises(UserError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message and "libnvrtc.so.13" in message
        assert "pip install 'autosoft[cuda13]'" in message


def test_the_cli_says_it_in_one_line_with_exit_2(tmp_path):
    from autosoft.cache import Cache

    cache_dir = tmp_path / "cache"
    Cache(cache_dir / "kernels.sqlite").put(make_entry(softmax_key("256x4096")))
    # the real binding with its Python-visible entry points failing as CuPy's do without libnvrtc
    code = ("import sys\n"
            "from cupy_backends.cuda.libs import nvrtc\n"
            "def missing(*args):\n"
            f"    raise RuntimeError({MISSING!r})\n"
            "nvrtc.getVersion = nvrtc.createProgram = missing\n"
            "from cuda.bindings import nvrtc as bindings_nvrtc\n"  # asked first for the version
            "bindings_nvrtc.nvrtcVersion = missing\n"
            "from autosoft.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    result = subprocess.run([sys.executable, "-c", code, "export", "softmax", "--shape", "256x4096", "-o",
                             str(tmp_path / "out.cu")], env=cli_env(cache_dir), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("autosoft: error: NVRTC (libnvrtc.so.13) could not be loaded")
    assert "autosoft[cuda13]" in lines[0] and "Traceback" not in result.stderr
    assert not (tmp_path / "out.cu").exists()


def _fresh_process_version(store: Path) -> dict:
    """nvrtc_version() in a fresh process whose kernel store is `store`: the version, and whether
    NVRTC's bindings were imported to get it."""
    code = ("import json, sys\n"
            "from autosoft.compile import nvrtc_version\n"
            "v = nvrtc_version()\n"
            "print(json.dumps({'version': v, 'loaded': 'cuda.bindings.nvrtc' in sys.modules\n"
            "                  or 'cupy_backends.cuda.libs.nvrtc' in sys.modules}))\n")
    env = {**os.environ, "AUTOSOFT_KERNEL_STORE": str(store), "PYTHONPATH": str(Path(__file__).parents[1])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_recorded_nvrtc_version_without_loading_nvrtc(tmp_path):
    """The first process asks NVRTC and records its library beside the store; the next one of the
    same environment reads the record and loads nothing; a record whose library changed size is
    not believed (that process asks NVRTC again and records the truth)."""
    store = tmp_path / "kernels"
    first = _fresh_process_version(store)
    assert first["loaded"] and re.fullmatch(r"\d+\.\d+", first["version"])
    records = json.loads((store / compiler.NVRTC_RECORD).read_text())
    (entry,) = records.values()
    assert Path(entry["library"]).name.startswith("libnvrtc") and entry["version"] == first["version"]
    assert _fresh_process_version(store) == {"version": first["version"], "loaded": False}
    entry["size"] += 1
    (store / compiler.NVRTC_RECORD).write_text(json.dumps(records))
    assert _fresh_process_version(store) == {"version": first["version"], "loaded": True}
    assert _fresh_process_version(store)["loaded"] is False


def test_a_damaged_or_foreign_record_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSOFT_KERNEL_STORE", str(tmp_path))
    for text in ("not json", "[]", '{"x": 1}', json.dumps({compiler._environment_key(): {"library": "/nonexistent"}})):
        (tmp_path / compiler.NVRTC_RECORD).write_text(text)
        assert compiler._recorded_nvrtc_version() is None
