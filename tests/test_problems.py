"""problems.py without a GPU: reading the problems file (crossing, defaults, duplicates, every
error on one line naming the file and item), the command line's problems, writing (round trip,
merge, concurrent processes)."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from autosoft.errors import UserError
from autosoft.families import get_family
from autosoft.problems import problems_from_args, read_problems, write_problems

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
     "unknown key 'dtypes' (expected shape, dtype)"),
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
    ("softmax:\n  - 8x8\n", "softmax item 1", "expected a mapping of shape, dtype, not a text"),
    ("softmax:\n  - shape: 8x8\n  -\n", "softmax item 2", "not nothing"),
    ("softmax:\n  shape: 8x8\n", "softmax", "expected a list of items"),
    ("softmx:\n  - shape: 8x8\n", "unknown family 'softmx'", "attention, softmax"),
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
