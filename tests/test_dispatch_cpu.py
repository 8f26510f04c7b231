"""dispatch.py and api.py without a GPU: the shape distance, which cache entry is chosen (with a
stand-in device), loading through the kernel store (a stand-in loader and verifier), and the
API's refusal of host arrays before it looks for a device."""
from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest

import autosoft
import autosoft.compile as compiler
import autosoft.dispatch as dispatch
import autosoft.kernel_store as kernel_store
from autosoft.cache import Cache
from autosoft.compile import CompileResult
from autosoft.dispatch import Dispatcher, key_distance, find_entry
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Problem, Target
from autosoft.runtime import DeviceInfo

from helpers import make_entry, softmax_key

SOFTMAX = get_family("softmax")


def _k(shape: str):
    return softmax_key(shape)


def _d(a, b, family=None):
    from autosoft.families import get_family

    return key_distance(family or get_family("softmax"), a, b)


# --- the distance between shapes ------------------------------------------------------------------

def test_shape_distance_is_zero_for_the_same_shape_and_symmetric():
    assert _d(_k("4096x8192"), _k("4096x8192")) == 0
    for a, b in (("1x1", "4096x8192"), ("3x1000", "7x1025"), ("65536x64", "2x1048576")):
        assert _d(_k(a), _k(b)) == pytest.approx(_d(_k(b), _k(a)))
        assert _d(_k(a), _k(b)) > 0


def test_row_length_weighs_more_than_row_count():
    here = _k("4096x8192")
    order = sorted(["4096x16384", "8192x8192", "4096x8000", "2x8192", "4096x2048", "1024x8192", "4096x1024"],
                   key=lambda s: _d(_k(s), here))
    assert order == ["4096x8000", "8192x8192", "1024x8192", "4096x16384", "4096x2048", "2x8192", "4096x1024"]
    # doubling N costs as much as 16x more rows
    assert _d(_k("4096x16384"), here) == pytest.approx(_d(_k("65536x8192"), here))


def test_distance_is_infinite_across_flags_ranks_and_head_dims():
    from autosoft.families import get_family

    attention = get_family("attention")
    key = lambda shape: softmax_key(shape, "bfloat16")  # noqa: E731 - attention takes 16-bit types
    plain, causal = key("1x32x8192x64"), key("1x32x8192x64+causal")
    assert _d(plain, causal, attention) == math.inf
    assert _d(causal, plain, attention) == math.inf
    assert _d(causal, key("1x32x4096x64+causal"), attention) == pytest.approx(4.0)  # N weighs 4x
    assert _d(plain, key("1x32x8192x128"), attention) == math.inf  # another head dim, another kernel
    assert _d(plain, key("1x32x8192x64+bogus"), attention) == math.inf  # not a problem of this family
    assert _d(_k("4096x8192"), _k("1x4096x8192")) == math.inf


# --- choosing with a stand-in device ----------------------------------------------------------------

H200 = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")


@pytest.fixture
def device(monkeypatch, cache_dir):
    """dispatch sees an H200 (nothing is compiled or launched by choose); the default cache is empty."""
    monkeypatch.setattr(dispatch, "device_info", lambda index=None: H200)
    return H200


def _params(shape: str, dtype: str = "float32", **changes):
    problem = SOFTMAX.problem(shape, dtype)
    params = {**SOFTMAX.default_params(problem, H200.target), **changes}
    assert SOFTMAX.is_valid(problem, H200.target, params)
    return params


def _key(shape: str, dtype: str = "float32", **changes):
    return softmax_key(shape, dtype, **{"gpu_name": H200.name, "compute_capability": H200.compute_capability,
                                        "cuda_version": H200.cuda_version, **changes})


def test_exact_entry_wins(device, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    exact = _params("4096x8192", storage="reread", normalise="online", unroll=2)
    cache.put(make_entry(_key("4096x8192"), time_us=5.0, params=exact))
    cache.put(make_entry(_key("4096x8000"), time_us=1.0, params=_params("4096x8000", streaming=True)))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "tuned"
    assert dict(choice.variant.params) == exact


def test_nearest_valid_shape_is_borrowed(device, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    near = _params("4096x8192", storage="reread", normalise="online", unroll=2, streaming=True)
    far = _params("4096x1024", storage="reread", normalise="online", unroll=1, persistent=True)
    cache.put(make_entry(_key("4096x8192"), time_us=50.0, params=near))
    cache.put(make_entry(_key("4096x1024"), time_us=1.0, params=far))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 7000)))
    assert choice.source == "nearest 4096x8192"
    assert dict(choice.variant.params) == near
    assert "constexpr int N = 7000;" in choice.variant.source


def test_an_entry_invalid_for_this_shape_is_skipped(device, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    wide = _params("64x8", "float16", vec=8, row_threads=8)
    cache.put(make_entry(_key("64x8", "float16"), params=wide))
    problem = Problem("softmax", "float16", (64, 3))  # vec=8 is wider than the row
    choice = Dispatcher().choose(problem)
    assert choice.source == "default"
    assert dict(choice.variant.params) == SOFTMAX.default_params(problem, H200.target)


@pytest.mark.parametrize("field, value", [("gpu_name", "NVIDIA A100"), ("compute_capability", "80"),
                                          ("cuda_version", "12.4"), ("template_digest", "0" * 64),
                                          ("space_digest", "0" * 64), ("dtype", "float16")])
def test_entries_for_another_gpu_compiler_template_or_dtype_are_never_used(device, cache_dir, field, value):
    cache = Cache(cache_dir / "kernels.sqlite")
    params = _params("4096x8192", streaming=True, unroll=1)
    cache.put(make_entry(_key("4096x8192", **{field: value}), params=params))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "default"


def test_load_cache_adds_a_file_and_never_writes_it(device, cache_dir, tmp_path):
    other = tmp_path / "from-another-machine.sqlite"
    params = _params("1024x2048", persistent=True)
    Cache(other).put(make_entry(_key("1024x2048"), params=params))
    before = hashlib.sha256(other.read_bytes()).hexdigest()
    d = Dispatcher()
    problem = Problem("softmax", "float32", (1024, 2048))
    assert d.choose(problem).source == "default"
    assert d.load_cache(other) == 1
    choice = d.choose(problem)
    assert choice.source == "tuned" and dict(choice.variant.params) == params
    assert hashlib.sha256(other.read_bytes()).hexdigest() == before
    assert not cache_dir.exists(), "choosing creates no default cache file"


def test_load_cache_of_a_bad_file_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"\x00garbage" * 512)
    before = bad.read_bytes()
    with pytest.raises(UserError, match="bad.sqlite"):
        Dispatcher().load_cache(bad)
    with pytest.raises(UserError, match="no such file"):
        Dispatcher().load_cache(tmp_path / "missing.sqlite")
    assert bad.read_bytes() == before and not (tmp_path / "missing.sqlite").exists()


def test_find_entry_prefers_this_gpu(device, tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    cache.put(make_entry(_key("256x4096", gpu_name="NVIDIA A100", compute_capability="80"), time_us=1.0,
                         params=_params("256x4096")))
    mine = _params("256x4096", streaming=True)
    cache.put(make_entry(_key("256x4096"), time_us=9.0, params=mine))
    entry, target = find_entry(cache, Problem("softmax", "float32", (256, 4096)), cache.path)
    assert entry.key.gpu_name == "NVIDIA H200" and dict(entry.params) == mine
    assert target == H200.target


def test_find_entry_without_a_device_uses_the_entry_architecture(monkeypatch, tmp_path):
    def no_device(index=None):
        raise autosoft.NoDeviceError("no CUDA device")

    monkeypatch.setattr(dispatch, "device_info", no_device)
    cache = Cache(tmp_path / "k.sqlite")
    cache.put(make_entry(_key("256x4096", gpu_name="NVIDIA A100", compute_capability="80"), time_us=3.0,
                         params=_params("256x4096")))
    entry, target = find_entry(cache, Problem("softmax", "float32", (256, 4096)), cache.path)
    assert entry.key.compute_capability == "80" and target.arch == "80"
    with pytest.raises(UserError, match="autosoft tune"):
        find_entry(cache, Problem("softmax", "float32", (256, 4097)), cache.path)


# --- NVRTC versions: exact first, then the same major version -----------------------------------

H200_13_5 = replace(H200, cuda_version="13.5")


@pytest.fixture
def device_13_5(monkeypatch, cache_dir):
    monkeypatch.setattr(dispatch, "device_info", lambda index=None: H200_13_5)
    return H200_13_5


def test_an_entry_of_the_same_major_version_serves_and_is_named(device_13_5, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    params = _params("4096x8192", storage="reread", normalise="online", unroll=2)
    cache.put(make_entry(_key("4096x8192", cuda_version="13.0"), params=params))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "tuned with NVRTC 13.0" and not choice.trusted
    assert dict(choice.variant.params) == params and choice.entry.key.cuda_version == "13.0"
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 7000)))
    assert choice.source == "nearest 4096x8192, tuned with NVRTC 13.0"


def test_an_exact_nvrtc_entry_is_preferred_to_a_faster_same_major_one(device_13_5, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    mine = _params("4096x8192", streaming=True)
    cache.put(make_entry(_key("4096x8192", cuda_version="13.5"), time_us=50.0, params=mine))
    cache.put(make_entry(_key("4096x8192", cuda_version="13.0"), time_us=1.0, params=_params("4096x8192")))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "tuned" and choice.trusted and dict(choice.variant.params) == mine


def test_this_nvrtc_at_the_nearest_shape_comes_before_another_minor_at_this_shape(device_13_5, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put(make_entry(_key("4096x8000", cuda_version="13.5"), params=_params("4096x8000", streaming=True)))
    cache.put(make_entry(_key("4096x8192", cuda_version="13.0"), params=_params("4096x8192")))
    assert Dispatcher().choose(Problem("softmax", "float32", (4096, 8192))).source == "nearest 4096x8000"


def test_the_nearest_minor_version_wins_among_several(device_13_5, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    near = _params("4096x8192", unroll=2, storage="reread", normalise="online")
    cache.put(make_entry(_key("4096x8192", cuda_version="13.0"), time_us=1.0, params=_params("4096x8192")))
    cache.put(make_entry(_key("4096x8192", cuda_version="13.4"), time_us=9.0, params=near))
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "tuned with NVRTC 13.4" and dict(choice.variant.params) == near


@pytest.mark.parametrize("version", ["12.8", "14.0", "13", "x.y", ""])
def test_another_major_or_a_malformed_version_is_never_used(device_13_5, cache_dir, version):
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put(make_entry(_key("4096x8192", cuda_version=version), params=_params("4096x8192", streaming=True)))
    cache.put(make_entry(_key("4096x8000", cuda_version=version), params=_params("4096x8000", streaming=True)))
    assert Dispatcher().choose(Problem("softmax", "float32", (4096, 8192))).source == "default"


def test_find_entry_takes_this_nvrtc_then_its_major_then_any(monkeypatch, tmp_path):
    monkeypatch.setattr(dispatch, "device_info", lambda index=None: H200_13_5)
    cache = Cache(tmp_path / "k.sqlite")
    problem = Problem("softmax", "float32", (256, 4096))
    for version, time_us in (("12.8", 1.0), ("13.0", 5.0), ("13.5", 9.0)):
        cache.put(make_entry(_key("256x4096", cuda_version=version), time_us=time_us, params=_params("256x4096")))
        assert find_entry(cache, problem, cache.path)[0].key.cuda_version == version

    def no_device(index=None):
        raise autosoft.NoDeviceError("no CUDA device")

    monkeypatch.setattr(dispatch, "device_info", no_device)  # export on a machine without a GPU
    monkeypatch.setattr(dispatch, "nvrtc_version", lambda: "13.2")
    assert find_entry(cache, problem, cache.path)[0].key.cuda_version == "13.0"


# --- loading through the kernel store ------------------------------------------------------------

class _FakeLoaded:
    """LoadedVariant without a GPU: keeps what it was given."""

    def __init__(self, variant, cubin):
        self.variant, self.cubin = variant, cubin


@pytest.fixture
def loading(monkeypatch, device, cache_dir):
    """A stand-in loader, verifier and NVRTC; the kernel store is the default one, beside the
    cache (cache_dir/kernels). Returns the calls made, by kind."""
    calls = {"compile": [], "verify": []}

    def fake_compile(source, arch, name="kernel.cu"):
        calls["compile"].append(source)
        return CompileResult(True, b"CUBIN" + hashlib.sha256(source.encode()).digest(), "")

    def fake_verify(family, loaded, seed):
        calls["verify"].append(loaded.variant.problem.shape)
        assert loaded.cubin.startswith(b"CUBIN")
        return None

    monkeypatch.setattr(compiler, "compile_source", fake_compile)
    monkeypatch.setattr(dispatch, "LoadedVariant", _FakeLoaded)
    monkeypatch.setattr(dispatch, "verify", fake_verify)
    monkeypatch.setattr(dispatch, "_stream_capturing", lambda: False)  # no GPU, no capture
    monkeypatch.setattr(dispatch, "_cupy_loaded", lambda: True)  # as in a process that verified
    monkeypatch.setattr(kernel_store, "_STORES", {})
    return calls


def _fresh_process(monkeypatch) -> None:
    """What a new process has: no store instances, hence no in-memory records."""
    monkeypatch.setattr(kernel_store, "_STORES", {})


def test_a_warm_store_loads_a_tuned_kernel_without_nvrtc(loading, cache_dir, monkeypatch):
    params = _params("4096x8192", streaming=True)
    Cache(cache_dir / "kernels.sqlite").put(make_entry(_key("4096x8192"), params=params))
    problem = Problem("softmax", "float32", (4096, 8192))
    first = Dispatcher().loaded(problem, 0)
    assert len(loading["compile"]) == 1 and loading["verify"] == [], "a tuned kernel is not verified again"
    assert (cache_dir / "kernels" / f"{first.variant.digest}.cubin").is_file()

    _fresh_process(monkeypatch)

    def forbidden(*args, **kwargs):
        raise AssertionError("NVRTC called although the store holds the kernel")

    monkeypatch.setattr(compiler, "compile_source", forbidden)
    d = Dispatcher()
    again = d.loaded(problem, 0)
    assert again.cubin == first.cubin and dict(again.variant.params) == params
    assert d.store.stats().hits == 1 and d.store.stats().compiles == 0
    assert d.loaded(problem, 0) is again, "kept loaded in memory"


def test_row_counts_share_one_compile_and_one_verification(loading, cache_dir, monkeypatch):
    d = Dispatcher()  # no entries: the heuristic default, checked before its first use
    for m in (4096, 4097, 300):
        loaded = d.loaded(Problem("softmax", "float32", (m, 8192)), 0)
        assert loaded.variant.problem.shape == (m, 8192)
    assert len(loading["compile"]) == 1
    assert loading["verify"] == [(256, 8192)], "verified once, at the verification shape"
    assert len(list((cache_dir / "kernels").glob("*.verified"))) == 1
    _fresh_process(monkeypatch)
    Dispatcher().loaded(Problem("softmax", "float32", (12345, 8192)), 0)
    assert len(loading["compile"]) == 1 and len(loading["verify"]) == 1, "a new process neither compiles nor verifies"
    Dispatcher().loaded(Problem("softmax", "float32", (4096, 1000)), 0)
    assert len(loading["compile"]) == 2 and len(loading["verify"]) == 2, "another row length is another kernel"


def test_a_same_major_entry_is_compiled_here_and_verified_once(loading, cache_dir, monkeypatch):
    monkeypatch.setattr(dispatch, "device_info", lambda index=None: H200_13_5)
    params = _params("4096x8192", streaming=True)
    Cache(cache_dir / "kernels.sqlite").put(make_entry(_key("4096x8192", cuda_version="13.0"), params=params))
    problem = Problem("softmax", "float32", (4096, 8192))
    loaded = Dispatcher().loaded(problem, 0)
    assert dict(loaded.variant.params) == params
    assert len(loading["compile"]) == 1 and loading["verify"] == [(256, 8192)]
    _fresh_process(monkeypatch)
    Dispatcher().loaded(problem, 0)
    assert len(loading["compile"]) == 1 and len(loading["verify"]) == 1


def test_a_failed_verification_is_not_recorded(loading, cache_dir, monkeypatch):
    monkeypatch.setattr(dispatch, "verify", lambda family, loaded, seed: "normal inputs: 3 elements wrong")
    problem = Problem("softmax", "float32", (64, 1000))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed verification"):
            Dispatcher().loaded(problem, 0)
    assert not list((cache_dir / "kernels").glob("*.verified"))


def test_a_kernel_that_does_not_compile_is_a_runtime_error(loading, monkeypatch):
    monkeypatch.setattr(compiler, "compile_source",
                        lambda source, arch, name="k": CompileResult(False, b"", "kernel.cu(1): error: bad"))
    with pytest.raises(RuntimeError, match="does not compile: kernel.cu\\(1\\): error: bad"):
        Dispatcher().loaded(Problem("softmax", "float32", (64, 1000)), 0)


# --- the family's selector: before borrowing, verified, with the nearest entry behind it ------------

from autosoft.selector import Leaf, Split  # noqa: E402

from helpers import make_selector  # noqa: E402

SHORT = _params("64x512")  # valid on short rows only
LONG = _params("64x65536", threads=1024, row_threads=1024, unroll=2, storage="reread", normalise="online", split=1)


def _store_selector(cache_dir, **key_changes):
    """A selector of SHORT (rows of up to 2048) and LONG (longer rows) for the H200, beside an entry
    of a nearby shape tuned with other params."""
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put(make_entry(_key("4096x8192"), params=_params("4096x8192", streaming=True)))
    tree = Split("columns", 2048.0, Leaf((0, 1)), Leaf((1, 0)))
    cache.put_selector(make_selector([SHORT, LONG], tree=tree, key=_key("4096x8192", **key_changes)))
    return cache


def test_the_selector_serves_an_untuned_shape_before_the_nearest_entry(device, cache_dir):
    _store_selector(cache_dir)
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 20000)))
    assert choice.source == "selector (config 1 of 2)" and not choice.trusted
    assert dict(choice.variant.params) == LONG
    default = get_family("softmax").default_params(Problem("softmax", "float32", (4096, 20000)), H200.target)
    assert choice.fallback.source == "nearest 4096x8192" and choice.rivals[0] == choice.fallback
    assert choice.rivals[1].source == dispatch.DEFAULT_RIVAL and dict(choice.rivals[1].variant.params) == default
    short = Dispatcher().choose(Problem("softmax", "float32", (300, 700)))
    assert dict(short.variant.params) == SHORT


def test_an_exact_entry_comes_before_the_selector(device, cache_dir):
    _store_selector(cache_dir)
    choice = Dispatcher().choose(Problem("softmax", "float32", (4096, 8192)))
    assert choice.source == "tuned" and choice.fallback is None


def test_the_next_configuration_of_the_leaf_serves_where_the_first_is_invalid_and_nothing_was_tuned(
        device, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put_selector(make_selector([LONG, SHORT], key=_key("4096x8192")))  # one leaf: LONG first
    choice = Dispatcher().choose(Problem("softmax", "float32", (64, 700)))  # LONG is invalid on 700
    assert choice.source == "selector (config 1 of 2)" and dict(choice.variant.params) == SHORT
    assert choice.fallback.source == "default"


def test_the_nearest_entry_serves_where_the_leafs_first_configuration_is_invalid(device, cache_dir):
    cache = Cache(cache_dir / "kernels.sqlite")
    near = _params("64x512", streaming=True)
    cache.put(make_entry(_key("64x512"), params=near))
    cache.put_selector(make_selector([LONG, SHORT], key=_key("4096x8192")))  # one leaf: LONG first
    choice = Dispatcher().choose(Problem("softmax", "float32", (64, 700)))  # LONG is invalid on 700
    assert choice.source == "nearest 64x512" and dict(choice.variant.params) == near
    assert choice.fallback is None
    assert choice.rivals[0].source == "selector (config 1 of 2)" and dict(choice.rivals[0].variant.params) == SHORT
    assert [r.source for r in choice.rivals[1:]] == [dispatch.DEFAULT_RIVAL]


@pytest.mark.parametrize("field, value", [("gpu_name", "NVIDIA A100"), ("cuda_version", "12.8"),
                                          ("template_digest", "0" * 64), ("compute_capability", "80")])
def test_a_selector_of_another_gpu_nvrtc_major_or_template_is_never_used(device, cache_dir, field, value):
    _store_selector(cache_dir, **{field: value})
    assert Dispatcher().choose(Problem("softmax", "float32", (4096, 20000))).source == "nearest 4096x8192"


def test_a_selector_of_another_minor_version_serves(device_13_5, cache_dir):
    _store_selector(cache_dir)  # fitted with 13.0; this machine has 13.5
    assert Dispatcher().choose(Problem("softmax", "float32", (4096, 20000))).source.startswith("selector")


def test_the_selector_pick_is_verified_once_before_its_first_use(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)  # the shape moves more than RACE_MAX_BYTES: served unraced
    loaded = Dispatcher().loaded(Problem("softmax", "float32", (16384, 20000)), 0)
    assert dict(loaded.variant.params) == LONG
    assert loading["verify"] == [(256, 20000)]
    _fresh_process(monkeypatch)
    Dispatcher().loaded(Problem("softmax", "float32", (16384, 20000)), 0)
    assert loading["verify"] == [(256, 20000)], "its verification is recorded in the store"


def test_a_selector_pick_that_fails_verification_gives_way_to_the_nearest_entry(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    checked = []

    def wrong_for_long(family, loaded, seed):
        checked.append(dict(loaded.variant.params))
        return "normal inputs: 3 elements wrong" if loaded.variant.params["storage"] == "reread" else None

    monkeypatch.setattr(dispatch, "verify", wrong_for_long)
    big = Problem("softmax", "float32", (16384, 20000))  # moves more than RACE_MAX_BYTES: not raced
    with pytest.warns(autosoft.errors.CacheWarning, match="selector \\(config 1 of 2\\) .* failed .* using nearest 4096x8192"):
        loaded = Dispatcher().loaded(big, 0)
    nearest = _params("4096x8192", streaming=True)
    assert dict(loaded.variant.params) == nearest
    assert checked == [LONG, nearest], "the nearest entry is verified too before it serves"


# --- the race: the selector's pick, the nearest entry and the default, on the shape, once ----------

NEAREST = _params("4096x8192", streaming=True)  # the entry _store_selector puts beside the selector
SMALL = Problem("softmax", "float32", (64, 20000))  # few bytes: raced
DEFAULT = get_family("softmax").default_params(SMALL, H200.target)  # the family's default on SMALL


def _race_times(monkeypatch, fastest: dict, slower: float = 2.0) -> list:
    """evaluate.race stand-in: `fastest` params take 1 us, any other `slower`; returns its calls."""
    calls = []

    def fake(family, loaded):
        calls.append([dict(one.variant.params) for one in loaded])
        return [1.0 if dict(one.variant.params) == fastest else slower for one in loaded]

    monkeypatch.setattr(dispatch, "race", fake)
    return calls


def _no_race(monkeypatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("a race ran")

    monkeypatch.setattr(dispatch, "race", forbidden)


@pytest.mark.parametrize("fastest", [NEAREST, LONG, DEFAULT], ids=["nearest", "selector", "default"])
def test_the_pick_the_nearest_entry_and_the_default_race_once_and_the_fastest_serves(
        loading, cache_dir, monkeypatch, fastest):
    _store_selector(cache_dir)
    assert len({str(sorted(p.items())) for p in (NEAREST, LONG, DEFAULT)}) == 3
    races = _race_times(monkeypatch, fastest)
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == fastest
    assert races == [[LONG, NEAREST, DEFAULT]] and len(loading["verify"]) == 3, "each verified, then timed"
    _fresh_process(monkeypatch)
    _no_race(monkeypatch)
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == fastest, "the recorded winner serves"
    assert len(loading["verify"]) == 3 and len(loading["compile"]) == 3
    races = _race_times(monkeypatch, NEAREST)
    assert dict(Dispatcher().loaded(Problem("softmax", "float32", (32, 20000)), 0).variant.params) == NEAREST
    assert len(races) == 1, "another row count races again, on the kernels already compiled and verified"
    assert len(loading["verify"]) == 3 and len(loading["compile"]) == 3


def test_a_shape_moving_more_than_the_race_bound_is_served_the_pick_unraced(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    _no_race(monkeypatch)
    big = Problem("softmax", "float32", (16384, 20000))
    assert get_family("softmax").bytes_moved(big) > dispatch.RACE_MAX_BYTES
    assert dict(Dispatcher().loaded(big, 0).variant.params) == LONG
    assert not list((cache_dir / "kernels").glob("*.race"))


def test_the_nearest_entry_races_the_leafs_next_configuration_where_its_first_is_invalid(
        loading, cache_dir, monkeypatch):
    cache = Cache(cache_dir / "kernels.sqlite")
    near = _params("64x512", streaming=True)
    cache.put(make_entry(_key("64x512"), params=near))
    cache.put_selector(make_selector([LONG, SHORT], key=_key("4096x8192")))  # one leaf: LONG first, invalid on 700
    races = _race_times(monkeypatch, SHORT)
    problem = Problem("softmax", "float32", (64, 700))
    assert dict(Dispatcher().loaded(problem, 0).variant.params) == SHORT
    assert races == [[near, SHORT, get_family("softmax").default_params(problem, H200.target)]]


@pytest.mark.parametrize("margin", [0.5, 2.0], ids=["within-the-margin", "beyond-it"])
def test_the_default_races_the_nearest_entry_where_no_configuration_of_the_selector_is_valid(
        loading, cache_dir, monkeypatch, margin):
    """A shape unlike every fitted one (softmax_backward's 8 x 500000 float32: each configuration
    too long for its registers, or its grid not resident) has no pick; the family's default races
    the nearest entry alone, and like a pick must beat it by RACE_MARGIN."""
    cache = Cache(cache_dir / "kernels.sqlite")
    near = _params("64x512", streaming=True)
    cache.put(make_entry(_key("64x512"), params=near))
    cache.put_selector(make_selector([LONG], key=_key("4096x8192")))  # invalid on 700 columns
    problem = Problem("softmax", "float32", (64, 700))
    default = get_family("softmax").default_params(problem, H200.target)
    choice = Dispatcher().choose(problem)
    assert choice.source == "nearest 64x512" and [r.source for r in choice.rivals] == [dispatch.DEFAULT_RIVAL]
    assert dict(choice.rivals[0].variant.params) == default != near
    races = _race_times(monkeypatch, default, slower=1.0 + margin * dispatch.RACE_MARGIN)
    served = Dispatcher().loaded(problem, 0).variant.params
    assert races == [[near, default]]
    assert dict(served) == (near if margin < 1 else default)


def test_without_a_tuned_entry_the_default_serves_unraced_where_no_configuration_is_valid(
        loading, cache_dir, monkeypatch):
    Cache(cache_dir / "kernels.sqlite").put_selector(make_selector([LONG], key=_key("4096x8192")))
    _no_race(monkeypatch)
    choice = Dispatcher().choose(Problem("softmax", "float32", (64, 700)))
    assert choice.source == "default" and choice.rivals == ()


def test_a_pick_failing_verification_leaves_the_race_to_the_nearest_entry_and_the_default(
        loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    races = _race_times(monkeypatch, NEAREST)
    monkeypatch.setattr(dispatch, "verify", lambda family, loaded, seed: (
        "normal inputs: 3 elements wrong" if loaded.variant.params["storage"] == "reread" else None))
    with pytest.warns(autosoft.errors.CacheWarning, match="selector \\(config 1 of 2\\) .* failed .* using nearest"):
        loaded = Dispatcher().loaded(SMALL, 0)
    assert dict(loaded.variant.params) == NEAREST and races == [[NEAREST, DEFAULT]]


def test_a_pick_failing_verification_with_no_other_rival_serves_the_nearest_entry_unraced(
        loading, cache_dir, monkeypatch):
    cache = Cache(cache_dir / "kernels.sqlite")
    cache.put(make_entry(_key("4096x8192"), params=DEFAULT))  # the nearest entry is the default itself
    cache.put_selector(make_selector([LONG], key=_key("4096x8192")))
    _no_race(monkeypatch)
    monkeypatch.setattr(dispatch, "verify", lambda family, loaded, seed: (
        "normal inputs: 3 elements wrong" if loaded.variant.params["storage"] == "reread" else None))
    with pytest.warns(autosoft.errors.CacheWarning, match="selector \\(config 0 of 1\\) .* failed .* using nearest"):
        loaded = Dispatcher().loaded(SMALL, 0)
    assert dict(loaded.variant.params) == DEFAULT
    assert not list((cache_dir / "kernels").glob("*.race")), "no race ran, so none is recorded"


def test_a_first_call_inside_a_cuda_graph_capture_is_served_the_verified_pick_unraced(
        loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    _race_times(monkeypatch, NEAREST)
    Dispatcher().loaded(Problem("softmax", "float32", (32, 20000)), 0)  # outside the capture: all three checked
    _no_race(monkeypatch)
    monkeypatch.setattr(dispatch, "_stream_capturing", lambda: True)
    verified, races = len(loading["verify"]), sorted((cache_dir / "kernels").glob("*.race"))
    assert len(races) == 1
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == LONG, "the pick: another row count's kernel"
    assert len(loading["verify"]) == verified, "no check inside the capture"
    assert sorted((cache_dir / "kernels").glob("*.race")) == races, "a later process, not capturing, races"


def test_inside_a_capture_an_unverified_pick_gives_way_to_a_verified_rival(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    dispatcher = Dispatcher()
    choice = dispatcher.choose(SMALL)
    nearest = next(rival for rival in choice.rivals if rival.source.startswith("nearest"))
    dispatcher.store.mark_verified(nearest.variant)
    _no_race(monkeypatch)
    monkeypatch.setattr(dispatch, "_stream_capturing", lambda: True)
    assert dict(dispatcher.loaded(SMALL, 0).variant.params) == NEAREST
    assert loading["verify"] == [], "nothing checked inside the capture"


def test_inside_a_capture_a_kernel_never_verified_fails_with_the_remedy(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    _no_race(monkeypatch)
    monkeypatch.setattr(dispatch, "_stream_capturing", lambda: True)
    with pytest.raises(UserError, match="softmax 64x20000 float32 is first called inside a CUDA graph capture.*"
                                        "call it once before capturing"):
        Dispatcher().loaded(SMALL, 0)
    assert loading["verify"] == [], "the check, which would end the capture, did not run"
    monkeypatch.setattr(dispatch, "_stream_capturing", lambda: False)
    _race_times(monkeypatch, NEAREST)
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == NEAREST, "after the capture, the race runs"


def test_without_a_device_to_ask_nothing_is_capturing():
    """Whether a capture is under way is asked of torch and CuPy; where CuPy has no driver or device
    to ask (this machine), the answer is no, not CuPy's error: the first call of an untuned shape
    goes on to its check."""
    pytest.importorskip("cupy")
    import cupy  # noqa: F401 - in sys.modules, as a CuPy program has it

    assert dispatch._stream_capturing() is False


def test_the_pick_must_beat_the_nearest_entry_by_the_margin_to_serve(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    _race_times(monkeypatch, LONG, slower=1.0 + dispatch.RACE_MARGIN / 2)  # faster, but within the noise
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == NEAREST
    _fresh_process(monkeypatch)
    _race_times(monkeypatch, LONG, slower=1.0 + 2 * dispatch.RACE_MARGIN)
    assert dict(Dispatcher().loaded(Problem("softmax", "float32", (32, 20000)), 0).variant.params) == LONG


def test_no_room_on_the_device_for_the_race_serves_the_pick_unrecorded(loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    monkeypatch.setattr(dispatch, "race", lambda family, loaded: None)
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == LONG
    assert not list((cache_dir / "kernels").glob("*.race"))


def test_a_torch_process_with_a_warm_store_serves_the_pick_unraced_without_loading_cupy(
        loading, cache_dir, monkeypatch):
    _store_selector(cache_dir)
    _race_times(monkeypatch, NEAREST)
    Dispatcher().loaded(SMALL, 0)  # both contenders compiled and verified, the race recorded
    _fresh_process(monkeypatch)
    monkeypatch.setattr(dispatch, "_cupy_loaded", lambda: False)
    _no_race(monkeypatch)
    other_rows = Problem("softmax", "float32", (32, 20000))
    assert dict(Dispatcher().loaded(other_rows, 0).variant.params) == LONG, "a new row count: the pick, unraced"
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == NEAREST, "a recorded race still serves its winner"
    assert len(list((cache_dir / "kernels").glob("*.race"))) == 1


@pytest.mark.parametrize("error", [MemoryError("out of memory"), RuntimeError("cudaErrorLaunchFailure"),
                                   autosoft.errors.NoDeviceError("CuPy is not installed")])
def test_a_race_that_cannot_finish_serves_the_pick_unrecorded(loading, cache_dir, monkeypatch, error):
    _store_selector(cache_dir)

    def failing(family, loaded):
        raise error

    monkeypatch.setattr(dispatch, "race", failing)
    assert dict(Dispatcher().loaded(SMALL, 0).variant.params) == LONG
    assert not list((cache_dir / "kernels").glob("*.race"))
