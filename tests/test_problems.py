"""problems.py without a GPU: reading the problems file (crossing, defaults, duplicates, every
error on one line naming the file and item), the command line's problems, writing (round trip,
merge, concurrent processes) and the AUTOSOFT_RECORD hook in dispatch with a stand-in device."""
from __future__ import annotations

import hashlib
import multiprocessing
import warnings
from pathlib import Path

import pytest

import autosoft.compile as compiler
import autosoft.dispatch as dispatch
import autosoft.kernel_store as kernel_store
import autosoft.problems as problems
from autosoft.cache import Cache
from autosoft.compile import CompileResult
from autosoft.dispatch import Dispatcher
from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.families.base import Target
from autosoft.problems import problems_from_args, read_problems, write_problems
from autosoft.runtime import DeviceInfo

from helpers import make_entry, softmax_key

SOFTMAX = get_family("softmax")
ATTENTION = get_family("attention")


def _file(tmp_path: Path, text: str, name: str = "problems.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# --- reading ------------------------------------------------------------------------------------

def test_every_list_in_an_item_is_crossed(tmp_path):
    path = _file(tmp_path, "attention:\n"
                           "  - shape: ['1,32,1024,128', 1x32x2048x128]\n"  # not all ints: two shapes
                           "    dtype: [float16, bfloat16]\n"
                           "    causal: [true, false]\n")
    got = read_problems(path)
    assert len(got) == 8 and len(set(got)) == 8
    assert got[0] == ATTENTION.problem("1,32,1024,128", "float16", {"causal": True})
    assert got[1] == ATTENTION.problem("1,32,1024,128", "float16")  # false: the option is absent
    assert got[1].options == ()
    assert {p.shape for p in got} == {(1, 32, 1024, 128), (1, 32, 2048, 128)}
    assert {p.dtype for p in got} == {"float16", "bfloat16"}
    assert sum(p.flags == ("causal",) for p in got) == 4


def test_the_brief_example_reads(tmp_path):
    path = _file(tmp_path, "softmax:\n"
                           "  - shape: [4096x128, 4096x256]   # one shape or a list\n"
                           "    dtype: [float32, float16]\n"
                           "attention:\n"
                           "  - shape: 1,32,1024,128\n"
                           "    dtype: bfloat16\n"
                           "    causal: [true, false]\n")
    got = read_problems(path)
    assert [(p.family, p.shape_text, p.dtype) for p in got] == [
        ("softmax", "4096x128", "float32"), ("softmax", "4096x128", "float16"),
        ("softmax", "4096x256", "float32"), ("softmax", "4096x256", "float16"),
        ("attention", "1x32x1024x128+causal", "bfloat16"), ("attention", "1x32x1024x128", "bfloat16")]


def test_an_omitted_dtype_is_the_family_default(tmp_path):
    got = read_problems(_file(tmp_path, "softmax:\n  - shape: 64x1000\nattention:\n  - shape: 1,2,77,64\n"
                                        "    dtype: null\n"))
    assert [p.dtype for p in got] == [SOFTMAX.default_dtype, ATTENTION.default_dtype] == ["float32", "bfloat16"]


def test_a_list_of_ints_is_one_shape(tmp_path):
    got = read_problems(_file(tmp_path, "softmax:\n  - shape: [4096, 128]\n"
                                        "  - shape: [[64, 1000], 7x1025, 4096x128]\n"))
    assert [p.shape for p in got] == [(4096, 128), (64, 1000), (7, 1025)]


def test_duplicates_are_dropped_in_order_of_appearance(tmp_path):
    got = read_problems(_file(tmp_path, "softmax:\n"
                                        "  - shape: [8x8, 4x4, 8x8]\n"
                                        "  - shape: [8, 8]\n"
                                        "    dtype: float32\n"
                                        "  - shape: 2x2\n"))
    assert [p.shape_text for p in got] == ["8x8", "4x4", "2x2"]


@pytest.mark.parametrize("text, where, says", [
    ("softmax:\n  - shape: 8x8\n  - shape: 8x8\n    dtypes: float16\n", "softmax item 2",
     "unknown key 'dtypes' (expected shape, dtype, log)"),
    ("attention:\n  - shape: 1,1,8,64\n    casual: true\n", "attention item 1", "expected shape, dtype, causal"),
    ("softmax:\n  - dtype: float16\n", "softmax item 1", "missing shape"),
    ("softmax:\n  - shape: 8y8\n", "softmax item 1", "malformed --shape '8y8'"),
    ("softmax:\n  - shape: [8x8, [1, 2, 3]]\n", "softmax item 1", "malformed --shape '1x2x3'"),
    ("softmax:\n  - shape: [8x8, 1.5]\n", "softmax item 1", "shape 1.5"),
    ("attention:\n  - shape: [1,1,8,64, 1x1x8x64]\n", "attention item 1", "mixes integers and texts"),
    ("softmax:\n  - shape: []\n", "softmax item 1", "shape is an empty list"),
    ("softmax:\n  - shape: 8x8\n    dtype: float64\n", "softmax item 1", "unknown dtype 'float64'"),
    ("attention:\n  - shape: 1,1,8,64\n    dtype: float32\n", "attention item 1", "not float32"),
    ("softmax:\n  - shape: 8x8\n    dtype: [float16, 3]\n", "softmax item 1", "dtype 3"),
    ("attention:\n  - shape: 1,1,8,64\n    causal: maybe\n", "attention item 1", "causal 'maybe': expected true or false"),
    ("attention:\n  - shape: 1,1,8,64\n    causal: 1\n", "attention item 1", "expected true or false"),
    ("softmax:\n  - 8x8\n", "softmax item 1", "expected a mapping of shape, dtype, log, not a text"),
    ("softmax:\n  - shape: 8x8\n  -\n", "softmax item 2", "not nothing"),
    ("softmax:\n  shape: 8x8\n", "softmax", "expected a list of items"),
    ("softmx:\n  - shape: 8x8\n", "unknown family 'softmx'", "attention, attention_backward, attention_colsum, attention_kvcache, attention_varlen, cross_entropy, softmax"),
    ("- shape: 8x8\n", "not a problems file", "not a list"),
    ("just some text\n", "not a problems file", "not a text"),
    ("softmax: [\n", "not YAML", "line 2"),
    ("", "holds no problems", "softmax:"),
    ("# nothing but a comment\n", "holds no problems", ""),
    ("softmax: []\n", "holds no problems", ""),
])
def test_every_error_is_one_line_naming_the_file_and_item(tmp_path, text, where, says):
    path = _file(tmp_path, text)
    with pytest.raises(UserError) as caught:
        read_problems(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    assert where in message and says in message, message


def test_a_missing_or_unreadable_file_is_one_line(tmp_path):
    for path, says in ((tmp_path / "missing.yaml", "no such problems file"), (tmp_path, "cannot read")):
        with pytest.raises(UserError) as caught:
            read_problems(path)
        assert str(caught.value).startswith(f"{path}: ") and says in str(caught.value)
        assert "\n" not in str(caught.value)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(UserError, match="binary.yaml: not a problems file"):
        read_problems(binary)


# --- the command line ---------------------------------------------------------------------------

def test_problems_from_args_crosses_shapes_and_dtypes_and_drops_duplicates():
    got = problems_from_args("softmax", ["4096x128", "4096x256", "4096x128"], ["float32", "float16"], {})
    assert [(p.shape_text, p.dtype) for p in got] == [("4096x128", "float32"), ("4096x128", "float16"),
                                                      ("4096x256", "float32"), ("4096x256", "float16")]
    got = problems_from_args(ATTENTION, ["1,32,1024,128", "1x32x1024x128"], [], {"causal": True})
    assert got == [ATTENTION.problem("1,32,1024,128", "bfloat16", {"causal": True})]
    with pytest.raises(UserError, match="float32"):
        problems_from_args("attention", ["1,32,1024,128"], ["float32"], {})
    with pytest.raises(UserError, match="--shape"):
        problems_from_args("softmax", [], [], {})


# --- writing ------------------------------------------------------------------------------------

MIXED = [SOFTMAX.problem("4096x128", "float16"), ATTENTION.problem("1,32,1024,128", "float16", {"causal": True}),
         SOFTMAX.problem("7x1025", "float32"), ATTENTION.problem("1,2,77,64", "bfloat16")]


def test_write_then_read_gives_the_problems_back(tmp_path):
    path = tmp_path / "sub" / "problems.yaml"
    grouped = sorted(MIXED, key=lambda p: p.family)  # the file groups families, sorted by name
    write_problems(path, grouped)
    assert read_problems(path) == grouped
    text = path.read_text()
    assert "shape: 1x32x1024x128\n" in text and "causal: true" in text and "+causal" not in text
    other = tmp_path / "other.yaml"
    write_problems(other, MIXED)  # interleaved families: grouped, each family's order kept
    assert read_problems(other) == grouped


def test_write_merges_without_duplicates_and_keeps_what_is_there(tmp_path):
    path = _file(tmp_path, "softmax:\n  - shape: [8x8, 16x16]\n    dtype: [float32, float16]\n")
    held = read_problems(path)
    write_problems(path, [MIXED[0], held[1], MIXED[1], MIXED[0]])
    assert read_problems(path) == [MIXED[1], *held, MIXED[0]]
    before = path.read_bytes()
    write_problems(path, held[::-1])
    assert path.read_bytes() == before, "nothing new: the file is not rewritten"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["problems.yaml", "problems.yaml.lock"], "no temp files left"


def test_write_refuses_a_file_that_is_no_problems_file_and_leaves_it(tmp_path):
    for text in ("just some text\n", "softmax:\n  - shape: 8y8\n", "a: [\n"):
        path = _file(tmp_path, text, "notes.yaml")
        with pytest.raises(UserError, match="notes.yaml: "):
            write_problems(path, MIXED)
        assert path.read_text() == text
    empty = _file(tmp_path, "", "empty.yaml")
    write_problems(empty, MIXED[:1])  # an empty file holds nothing yet
    assert read_problems(empty) == MIXED[:1]


def _write_many(path: str, start: int, count: int) -> None:
    family = get_family("softmax")
    for m in range(start, start + count):
        write_problems(path, [family.problem(f"{m}x64", "float32")])


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "problems.yaml")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_many, args=(path, start, 40)) for start in (1, 1001)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    got = {p.shape[0] for p in read_problems(path)}
    assert got == set(range(1, 41)) | set(range(1001, 1041))


# --- recording in dispatch ----------------------------------------------------------------------

H200 = DeviceInfo(0, Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024), "13.0")


class _FakeLoaded:
    def __init__(self, variant, cubin):
        self.variant, self.cubin = variant, cubin


@pytest.fixture
def loading(monkeypatch, cache_dir):
    """dispatch sees an H200 and loads, compiles and verifies with stand-ins (as in
    test_dispatch_cpu.py); this process has recorded nothing yet."""
    monkeypatch.setattr(dispatch, "device_info", lambda index=None: H200)
    monkeypatch.setattr(compiler, "compile_source", lambda source, arch, name="kernel.cu":
                        CompileResult(True, b"CUBIN" + hashlib.sha256(source.encode()).digest(), ""))
    monkeypatch.setattr(dispatch, "LoadedVariant", _FakeLoaded)
    monkeypatch.setattr(dispatch, "verify", lambda family, loaded, seed: None)
    monkeypatch.setattr(kernel_store, "_STORES", {})
    monkeypatch.setattr(problems, "_recorded", set())


def _tuned(cache_dir: Path, shape: str) -> None:
    key = softmax_key(shape, gpu_name=H200.name, compute_capability=H200.compute_capability,
                      cuda_version=H200.cuda_version)
    params = {**SOFTMAX.default_params(SOFTMAX.problem(shape), H200.target), "streaming": True}
    Cache(cache_dir / "kernels.sqlite").put(make_entry(key, params=params))


def test_dispatch_records_problems_without_an_exact_entry(loading, cache_dir, tmp_path, monkeypatch):
    record = tmp_path / "recorded.yaml"
    monkeypatch.setenv("AUTOSOFT_RECORD", str(record))
    _tuned(cache_dir, "4096x8192")
    exact, near, untuned = (SOFTMAX.problem(s) for s in ("4096x8192", "4096x8000", "64x1000"))
    d = Dispatcher()
    assert d.choose(exact).source == "tuned" and d.choose(near).source == "nearest 4096x8192"
    assert d.choose(untuned).source == "default"
    for problem in (exact, near, untuned, near):
        d.loaded(problem, 0)
    assert read_problems(record) == [near, untuned]


def test_recording_touches_the_file_once_per_problem_and_only_when_asked(loading, tmp_path, monkeypatch):
    writes = []
    monkeypatch.setattr(problems, "write_problems", lambda path, ps: writes.append(list(ps)))
    problem = SOFTMAX.problem("64x1000")
    Dispatcher().loaded(problem, 0)
    assert writes == [], "AUTOSOFT_RECORD unset: nothing recorded"
    monkeypatch.setenv("AUTOSOFT_RECORD", str(tmp_path / "r.yaml"))
    for _ in range(3):
        Dispatcher().loaded(problem, 0)  # a new dispatcher prepares it again
    assert writes == [[problem]]


def test_a_record_file_that_cannot_be_written_warns_once_and_the_call_goes_on(loading, tmp_path, monkeypatch):
    bad = _file(tmp_path, "not a problems file\n", "notes.txt")
    monkeypatch.setenv("AUTOSOFT_RECORD", str(bad))
    problem = SOFTMAX.problem("64x1000")
    with pytest.warns(UserWarning, match="AUTOSOFT_RECORD: could not record softmax 64x1000 float32: .*notes.txt"):
        loaded = Dispatcher().loaded(problem, 0)
    assert loaded.variant.problem == problem
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Dispatcher().loaded(problem, 0)  # warned once for this problem
    assert bad.read_text() == "not a problems file\n"


@pytest.mark.long
def test_a_recorded_file_is_what_a_batch_tune_tunes(loading, tmp_path, monkeypatch):
    """A program's calls recorded, then `autosoft tune --problems` on the record (replaying the
    H200 recording): exactly the recorded problems are tuned."""
    import subprocess
    import sys

    from autosoft.batch import stored_results
    from autosoft.storage import open_storage

    record = tmp_path / "recorded.yaml"
    monkeypatch.setenv("AUTOSOFT_RECORD", str(record))
    called = [SOFTMAX.problem("4096x128", "float16"), SOFTMAX.problem("65536x64", "bfloat16")]
    d = Dispatcher()
    for problem in called + called:
        d.loaded(problem, 0)
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "autosoft", "tune", "--problems", str(record), "--trials", "60",
                           "--replay", str(repo / "benchmarks/results/softmax_h200.sqlite"),
                           "--cache", str(tmp_path / "k.sqlite")], cwd=repo, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    results = stored_results(open_storage(f"sqlite:///{tmp_path / 'k-studies.sqlite'}"))
    assert sorted((r["problem"]["shape"], r["problem"]["dtype"]) for r in results) == [
        ("4096x128", "float16"), ("65536x64", "bfloat16")]
