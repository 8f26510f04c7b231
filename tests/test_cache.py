"""cache.py: the SQLite store: round trips, replacement rules, keys, bad files, concurrency."""
from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import sqlite3
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest

from autosoft.cache import CACHE_FILE, SCHEMA_VERSION, Cache, CacheKey, default_cache_path
from autosoft.errors import CacheWarning, UserError

from helpers import make_entry, softmax_key


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_put_get_entries_round_trip(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    assert cache.entries() == []
    assert cache.get(softmax_key()) is None
    entry = make_entry(time_us=12.5)
    assert cache.put(entry)
    assert cache.get(entry.key) == entry
    assert cache.entries() == [entry]
    again = Cache(tmp_path / "k.sqlite")  # reopening validates and reads the same file
    got = again.get(entry.key)
    assert got == entry
    assert dict(got.params) == dict(entry.params)
    for name, value in got.params.items():
        assert type(value) is type(entry.params[name]), f"{name}: {value!r} changed type"
    assert got.default_time_us == 25.0 and got.copy_time_us == 6.25


def test_optional_times_may_be_missing(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    entry = make_entry(default_time_us=None, copy_time_us=None)
    cache.put(entry)
    assert cache.get(entry.key) == entry


def test_faster_replaces_slower_and_not_the_reverse(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    key = softmax_key()
    assert cache.put(make_entry(key, time_us=20.0, variant_name="slow"))
    assert cache.put(make_entry(key, time_us=10.0, variant_name="fast"))
    assert cache.get(key).variant_name == "fast" and cache.get(key).time_us == 10.0
    assert not cache.put(make_entry(key, time_us=15.0, variant_name="slower"))
    assert not cache.put(make_entry(key, time_us=10.0, variant_name="tie"))
    got = cache.get(key)
    assert (got.variant_name, got.time_us) == ("fast", 10.0)
    assert len(cache.entries()) == 1


@pytest.mark.parametrize("field", [f.name for f in fields(CacheKey)])
def test_keys_differing_in_any_field_are_distinct(tmp_path, field):
    cache = Cache(tmp_path / "k.sqlite")
    base = softmax_key()
    other_value = {"family": "attention", "dtype": "float16", "shape": "4096x8191", "gpu_name": "NVIDIA A100",
                   "compute_capability": "80", "cuda_version": "12.9", "template_digest": "0" * 64,
                   "space_digest": "1" * 64}[field]
    other = replace(base, **{field: other_value})
    assert other != base
    cache.put(make_entry(base, time_us=50.0, variant_name="base", params={"p": 1}))
    cache.put(make_entry(other, time_us=5.0, variant_name="other", params={"p": 2}))
    assert len(cache.entries()) == 2, "a faster entry under another key must not replace this one"
    assert cache.get(base).variant_name == "base"
    assert cache.get(other).variant_name == "other"


def test_params_are_stored_as_plain_json(tmp_path):
    path = tmp_path / "k.sqlite"
    cache = Cache(path)
    entry = make_entry()
    cache.put(entry)
    with sqlite3.connect(path) as conn:
        (text,) = conn.execute("SELECT params FROM entries").fetchone()
    assert json.loads(text) == dict(entry.params)


def _rebuilt_without_constraints(path: Path) -> None:
    """The entries table as a tamperer might leave it: same columns, no types, no NOT NULL, no key."""
    with sqlite3.connect(path) as conn:
        cols = [r[1] for r in conn.execute("PRAGMA table_info(entries)")]
        conn.execute("ALTER TABLE entries RENAME TO old_entries")
        conn.execute(f"CREATE TABLE entries ({', '.join(cols)})")
        conn.execute("INSERT INTO entries SELECT * FROM old_entries")
        conn.execute("DROP TABLE old_entries")
    conn.close()


# each: SQL that breaks the row of shape 2x4096 (rowid 2) in a table without constraints, a word of the reason
MALFORMED_ROWS = {
    "params_not_json": ("UPDATE entries SET params = 'not json'", "not JSON"),
    "params_a_list": ("UPDATE entries SET params = '[1, 2]'", "not a mapping"),
    "params_null": ("UPDATE entries SET params = NULL", "params is NULL"),
    "params_deeply_nested": ("UPDATE entries SET params = '" + "[" * 100000 + "'", "not JSON"),
    "time_text": ("UPDATE entries SET time_us = 'fast'", "time_us"),
    "time_null": ("UPDATE entries SET time_us = NULL", "time_us"),
    "time_negative": ("UPDATE entries SET time_us = -1.0", "time_us"),
    "time_blob": ("UPDATE entries SET time_us = x'00'", "time_us"),
    "copy_time_text": ("UPDATE entries SET copy_time_us = 'x'", "copy_time_us"),
    "created_too_late": ("UPDATE entries SET created = 1e300", "created"),
    "gpu_name_null": ("UPDATE entries SET gpu_name = NULL", "gpu_name is NULL"),
    "launches_integer": ("UPDATE entries SET launches = 7", "launches is not text"),
    "variant_name_blob": ("UPDATE entries SET variant_name = x'ff00'", "variant_name"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_ROWS))
def test_a_malformed_row_is_skipped_with_a_warning_naming_the_file_and_the_row(tmp_path, case):
    path = tmp_path / "k.sqlite"
    cache = Cache(path)
    good = [make_entry(softmax_key(shape=f"{i}x4096"), time_us=float(i)) for i in (1, 2, 3)]
    for e in good:
        cache.put(e)
    _rebuilt_without_constraints(path)
    sql, why = MALFORMED_ROWS[case]
    with sqlite3.connect(path) as conn:
        conn.execute(sql + " WHERE shape = '2x4096'")
    conn.close()
    before = _sha(path)
    with pytest.warns(CacheWarning) as caught:
        got = Cache(path, create=False).entries()
    assert got == [good[0], good[2]], "the other rows still serve"
    (warning,) = caught
    message = str(warning.message)
    assert str(path) in message and "rowid 2" in message and "'2x4096'" in message and why in message, message
    assert "\n" not in message and len(message) < 400
    if case != "gpu_name_null":  # a NULL key column matches no key: get finds nothing to warn about
        with pytest.warns(CacheWarning, match="rowid 2"):
            assert Cache(path, create=False).get(good[1].key) is None
    assert Cache(path, create=False).get(good[2].key) == good[2]
    assert _sha(path) == before, "reading never changes the file"


def test_a_null_shape_is_skipped_too(tmp_path):
    path = tmp_path / "k.sqlite"
    Cache(path).put(make_entry())
    _rebuilt_without_constraints(path)
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE entries SET shape = NULL")
    conn.close()
    with pytest.warns(CacheWarning, match=r"rowid 1 \(shape None\): shape is NULL"):
        assert Cache(path).entries() == []


def test_an_entries_table_without_a_column_is_one_user_error(tmp_path):
    path = tmp_path / "k.sqlite"
    Cache(path).put(make_entry())
    with sqlite3.connect(path) as conn:
        conn.execute("ALTER TABLE entries DROP COLUMN launches")
    conn.close()
    with pytest.raises(UserError, match=f"{re.escape(str(path))}: the entries table has no column launches"):
        Cache(path).entries()


@pytest.mark.parametrize("bad", [None, 3, 2.5, b"k.sqlite", ["k.sqlite"], object()])
def test_a_cache_path_that_is_not_a_path_is_a_clear_type_error(bad):
    with pytest.raises(TypeError, match=r"cache path: expected a file path \(str or os.PathLike\), got "
                                        + type(bad).__name__):
        Cache(bad)


@pytest.mark.parametrize("bad", [None, 7])
def test_load_cache_of_a_non_path_says_what_it_expects(bad):
    import autosoft

    with pytest.raises(TypeError, match=r"expected a file path \(str or os.PathLike\), got " + type(bad).__name__):
        autosoft.load_cache(bad)


def test_an_empty_cache_path_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="empty"):
        Cache("")
    assert not list(tmp_path.iterdir())


def test_record_trials_round_trip(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    cache.record_trials([])
    rows = [
        {"family": "softmax", "dtype": "float16", "shape": "8x1025", "gpu_name": "NVIDIA H200",
         "variant_name": "v_ok", "params": {"vec": 8, "storage": "smem", "persistent": False}, "status": "ok",
         "time_us": 3.5, "message": ""},
        {"family": "softmax", "dtype": "float16", "shape": "8x1025", "gpu_name": "NVIDIA H200",
         "variant_name": "v_bad", "params": {"vec": 2}, "status": "compile_fail", "time_us": None,
         "message": "error: something; with 'quotes'"},
    ]
    cache.record_trials(rows)
    got = list(Cache(tmp_path / "k.sqlite").trials())
    assert [r["variant_name"] for r in got] == ["v_ok", "v_bad"]
    assert json.loads(got[0]["params"]) == rows[0]["params"]
    assert got[0]["time_us"] == 3.5 and got[0]["status"] == "ok"
    assert got[1]["time_us"] is None and got[1]["status"] == "compile_fail"
    assert got[1]["message"] == rows[1]["message"]
    assert all(r["created"] > 0 for r in got)
    assert cache.entries() == [], "trials are not entries"


# --- files that are not (or no longer) autosoft caches ----------------------------------------

def _valid_cache_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "source.sqlite"
    cache = Cache(path)
    for i in range(10):
        cache.put(make_entry(softmax_key(shape=f"{i + 1}x4096"), time_us=1.0 + i))
    cache.record_trials([{"family": "softmax", "dtype": "float32", "shape": "1x1", "gpu_name": "g",
                          "variant_name": "v" * 200, "params": {"x": "y" * 300}, "status": "ok",
                          "time_us": 1.0, "message": "m" * 500}] * 50)
    return path.read_bytes()


def _header_then_garbage(wal: bool) -> bytes:
    """SQLite's 16-byte magic, then garbage, with the header's read-version byte (19) chosen, not drawn:
    drawn, it said "WAL" once in 256 runs, and the test's outcome with it."""
    garbage = bytearray(random.Random(19).randbytes(8000))
    garbage[19 - 16] = 2 if wal else 1
    return b"SQLite format 3\0" + bytes(garbage)


def _foreign_db(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE entries (a, b)")
        conn.execute("INSERT INTO entries VALUES (1, 2)")
    conn.close()


def _db_with_meta(path: Path, meta: dict[str, str], tables: bool = True) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        conn.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
        if tables:
            conn.execute("CREATE TABLE entries (family TEXT)")
            conn.execute("CREATE TABLE trials (family TEXT)")
    conn.close()


BAD_FILES = {
    "random_bytes": lambda p, t: p.write_bytes(os.urandom(4096 * 3)),
    "text": lambda p, t: p.write_text("family,dtype\nsoftmax,float32\n"),
    "sqlite_header_then_garbage": lambda p, t: p.write_bytes(_header_then_garbage(wal=False)),
    # byte 19 = 2 says "WAL mode": SQLite then makes -wal and -shm files before finding the rest unreadable
    "sqlite_header_says_wal_then_garbage": lambda p, t: p.write_bytes(_header_then_garbage(wal=True)),
    "truncated_to_header": lambda p, t: p.write_bytes(_valid_cache_bytes(t)[:100]),
    "truncated_to_one_page": lambda p, t: p.write_bytes(_valid_cache_bytes(t)[:4096]),
    "truncated_half": lambda p, t: p.write_bytes(_valid_cache_bytes(t)[: len(_valid_cache_bytes(t)) // 2]),
    "foreign_sqlite": lambda p, t: _foreign_db(p),
    "other_app": lambda p, t: _db_with_meta(p, {"app": "someone-else", "schema_version": "1"}),
    "newer_schema": lambda p, t: _db_with_meta(p, {"app": "autosoft-cache", "schema_version": str(SCHEMA_VERSION + 1)}),
    "older_schema": lambda p, t: _db_with_meta(p, {"app": "autosoft-cache", "schema_version": "0"}),
    "missing_tables": lambda p, t: _db_with_meta(p, {"app": "autosoft-cache", "schema_version": "1"}, tables=False),
}


@pytest.mark.parametrize("kind", sorted(BAD_FILES))
def test_bad_files_are_refused_by_name_and_left_untouched(tmp_path, kind):
    path = tmp_path / "kernels.sqlite"
    BAD_FILES[kind](path, tmp_path)
    before = _sha(path)
    size = path.stat().st_size
    for create in (True, False):
        with pytest.raises(UserError) as info:
            Cache(path, create=create)
        assert str(path) in str(info.value), "the message names the file"
    if kind == "newer_schema":
        assert "newer" in str(info.value)
    assert _sha(path) == before and path.stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("kernels")) == ["kernels.sqlite"], \
        "no journal or WAL file left behind"


@pytest.mark.parametrize("page_size, journal_mode", [(512, "DELETE"), (4096, "WAL"), (65536, "DELETE")])
def test_caches_of_any_page_size_and_in_wal_mode_still_open(tmp_path, page_size, journal_mode):
    """The header is checked before SQLite opens a file; every header SQLite writes must pass
    (65536 is stored as 1), and a cache someone switched to WAL mode is a cache."""
    path = tmp_path / "k.sqlite"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA page_size = {page_size}")
    conn.execute("VACUUM")
    conn.close()
    Cache(path).put(make_entry(softmax_key()))
    conn = sqlite3.connect(path)
    assert conn.execute(f"PRAGMA journal_mode = {journal_mode}").fetchone()[0].upper() == journal_mode
    assert conn.execute("PRAGMA page_size").fetchone()[0] == page_size
    conn.close()
    assert [e.key for e in Cache(path, create=False).entries()] == [softmax_key()]


@pytest.mark.parametrize("folder", ["with space", "hash#mark", "question?mode=rw", "percent%41", "100%"])
def test_paths_with_uri_characters_work(tmp_path, folder):
    """The path is a file name, not a URI: '#', '?' and '%' in it must not change which file is opened."""
    path = tmp_path / folder / "k.sqlite"
    cache = Cache(path)
    entry = make_entry()
    cache.put(entry)
    assert Cache(path, create=False).entries() == [entry]
    assert Cache(path).get(entry.key) == entry
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert made == [folder, f"{folder}/k.sqlite"], f"stray files: {made}"


def test_a_folder_is_not_a_cache(tmp_path):
    with pytest.raises(UserError, match="not a file"):
        Cache(tmp_path)


def test_missing_file_is_created_or_refused(tmp_path):
    path = tmp_path / "deeper" / "folder" / "k.sqlite"
    with pytest.raises(UserError, match="no such file"):
        Cache(path, create=False)
    assert not path.exists() and not path.parent.exists()
    Cache(path)
    assert path.is_file()
    Cache(path, create=False)  # now it opens


@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_a_cache_dir_variable_naming_a_file_is_a_user_error(tmp_path, monkeypatch, below):
    afile = tmp_path / "not-a-folder"
    afile.write_text("x")
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(afile / below) if below else str(afile))
    with pytest.raises(UserError) as info:
        default_cache_path()
    assert "AUTOSOFT_CACHE_DIR" in str(info.value) and f"{afile} is a file" in str(info.value)
    assert afile.read_text() == "x"


def test_default_cache_path_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path / "somewhere"))
    assert default_cache_path() == tmp_path / "somewhere" / CACHE_FILE
    monkeypatch.setenv("AUTOSOFT_CACHE_DIR", "~/autosoft-test-cache")
    assert default_cache_path() == Path.home() / "autosoft-test-cache" / CACHE_FILE
    monkeypatch.delenv("AUTOSOFT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = default_cache_path()
    assert path.name == CACHE_FILE and "autosoft" in str(path.parent)
    if sys.platform.startswith("linux"):
        assert path == tmp_path / "xdg" / "autosoft" / CACHE_FILE


# --- several processes at once -------------------------------------------------------------------

WRITERS = 8
ROUNDS = 24


def _writer(folder: str, index: int, barrier) -> list[tuple[int, int, str]]:
    """Open each round's file at the same moment as the other writers and add this writer's entry."""
    from helpers import make_entry, softmax_key

    from autosoft.cache import Cache

    errors = []
    for r in range(ROUNDS):
        barrier.wait(timeout=120)
        try:
            cache = Cache(Path(folder) / f"round{r}.sqlite")
            cache.put(make_entry(softmax_key(shape=f"{index + 1}x{r + 1}"), time_us=1.0 + index,
                                 params={"writer": index, "round": r}))
            cache.record_trials([{"family": "softmax", "dtype": "float32", "shape": f"{index + 1}x{r + 1}",
                                  "gpu_name": "g", "variant_name": f"w{index}", "params": {"w": index},
                                  "status": "ok", "time_us": 1.0, "message": ""}])
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            errors.append((r, index, repr(exc)))
    return errors


@pytest.fixture(scope="module")
def concurrent_run(tmp_path_factory):
    """Writers race on ROUNDS files; the even rounds' files exist beforehand, the odd ones do not."""
    folder = tmp_path_factory.mktemp("concurrent")
    for r in range(0, ROUNDS, 2):
        Cache(folder / f"round{r}.sqlite")
    tests_dir = str(Path(__file__).resolve().parent)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, str(Path(tests_dir).parent), old]))
    try:
        ctx = mp.get_context("spawn")
        with ctx.Manager() as manager:
            barrier = manager.Barrier(WRITERS)
            with ctx.Pool(WRITERS) as pool:
                results = pool.starmap(_writer, [(str(folder), i, barrier) for i in range(WRITERS)])
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    return folder, [e for errs in results for e in errs]


def _failed(errors: list[tuple[int, int, str]], fresh: bool) -> list[str]:
    return [f"round {r}, writer {i}: {msg}" for r, i, msg in errors if (r % 2 == 1) == fresh]


@pytest.mark.xdist_group("cache_concurrent")  # one race for the three
def test_concurrent_writers_to_an_existing_file_all_succeed(concurrent_run):
    _, errors = concurrent_run
    failed = _failed(errors, fresh=False)
    assert not failed, "\n".join(failed[:5])


@pytest.mark.xdist_group("cache_concurrent")  # one race for the three
def test_concurrent_first_opens_of_a_new_file_all_succeed(concurrent_run):
    """Several tuning jobs that start together on a fresh cache file must all be able to open it."""
    _, errors = concurrent_run
    failed = _failed(errors, fresh=True)
    assert not failed, f"{len(failed)} of {WRITERS * ROUNDS // 2} opens failed, e.g.:\n" + "\n".join(failed[:5])


@pytest.mark.xdist_group("cache_concurrent")  # one race for the three
def test_concurrent_writers_lose_no_entry(concurrent_run):
    folder, errors = concurrent_run
    failed = {(r, i) for r, i, _ in errors}
    for r in range(ROUNDS):
        cache = Cache(folder / f"round{r}.sqlite", create=False)
        got = {(e.params["writer"], e.params["round"]) for e in cache.entries()}
        expected = {(i, r) for i in range(WRITERS) if (r, i) not in failed}
        assert len(expected) >= 1
        assert got == expected, f"round {r}: lost {sorted(expected - got)}"
        trials = {json.loads(t["params"])["w"] for t in cache.trials()}
        assert trials == {i for i, _ in expected}


# --- selectors: stored with the entries, carried by merge ---------------------------------------------

def _selector(**fields):
    from helpers import make_selector
    from autosoft.selector import Leaf, Split

    short = make_entry(softmax_key("64x512")).params
    tree = Split("columns", 2048.0, Leaf((0, 1)), Leaf((1, 0)))
    return make_selector([dict(short), {**short, "unroll": 2}], tree=tree, **fields)


def test_a_selector_round_trips_and_a_refit_replaces_it(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    assert cache.selectors() == []
    selector = _selector()
    cache.put_selector(selector)
    assert Cache(cache.path).selectors() == [selector]
    refit = replace(selector, created=selector.created + 60, shapes=("float32 1x1",) * 4)
    cache.put_selector(refit)
    assert cache.selectors() == [refit], "one selector per family, GPU, NVRTC major and digests"
    other_major = replace(selector, cuda_version="12.8")
    cache.put_selector(other_major)
    assert len(cache.selectors()) == 2
    cache.put(make_entry(time_us=3.0))
    assert len(cache.selectors()) == 2, "storing entries keeps the selectors"


def test_a_file_made_before_the_selectors_table_reads_as_none_and_takes_one(tmp_path):
    path = tmp_path / "old.sqlite"
    Cache(path).put(make_entry())
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE selectors")
    cache = Cache(path)
    assert cache.selectors() == []
    cache.put_selector(_selector())
    assert cache.selectors() == [_selector()] and len(cache.entries()) == 1


def test_a_malformed_selector_row_is_skipped_with_a_warning(tmp_path):
    cache = Cache(tmp_path / "k.sqlite")
    cache.put_selector(_selector())
    cache.put_selector(_selector(gpu_name="NVIDIA A100"))
    with sqlite3.connect(cache.path) as conn:
        conn.execute("UPDATE selectors SET tree = ? WHERE gpu_name = 'NVIDIA A100'", (json.dumps({"ranking": [7]}),))
    with pytest.warns(CacheWarning, match="k.sqlite: skipped the malformed selector at rowid"):
        kept = cache.selectors()
    assert [s.gpu_name for s in kept] == ["NVIDIA H200"]


def test_merge_takes_entries_and_newer_selectors_and_only_reads_the_other_file(tmp_path):
    mine, theirs = Cache(tmp_path / "mine.sqlite"), Cache(tmp_path / "theirs.sqlite")
    old, new = _selector(), _selector(created=1_800_000_000.0)
    mine.put_selector(new)
    theirs.put_selector(old)
    theirs.put_selector(_selector(gpu_name="NVIDIA A100"))
    theirs.put(make_entry(softmax_key("64x512"), time_us=2.0))
    before = _sha(theirs.path)
    assert mine.merge(theirs) == (1, 1)
    assert sorted((s.gpu_name, s.created) for s in mine.selectors()) == [("NVIDIA A100", old.created),
                                                                          ("NVIDIA H200", new.created)]
    assert [e.key.shape for e in mine.entries()] == ["64x512"]
    assert _sha(theirs.path) == before
    assert theirs.merge(mine) == (0, 1), "the newer selector goes the other way"
    assert {s.created for s in theirs.selectors() if s.gpu_name == "NVIDIA H200"} == {new.created}
