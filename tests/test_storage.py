"""CPU tier: autosoft.storage, the study storage opened from a URL.

URL forms and their one-line errors, SQLite and journal files, the default URL beside the cache,
hidden passwords; RetryingStorage on a stub failure; and, against a real PostgreSQL server started
for the session (tests/postgres.py; skipped where none is installed): two processes adding trials
to one study, Optuna's errors passing through unretried, a server restart in the middle of a loop
of storage calls, and a server that stays down past the backoff.
"""
from __future__ import annotations

import multiprocessing
import sqlite3
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest
import sqlalchemy.exc
from optuna.storages import BaseStorage, JournalStorage, _CachedStorage
from optuna.trial import TrialState

from autosoft.cache import Cache
from autosoft.errors import UserError
from autosoft.storage import (RetryingStorage, StorageUnavailableError, connection_lost, default_storage_url,
                              _with_driver, check_url, describe, open_storage)
from autosoft.tune import study_storage

from helpers import make_entry

optuna.logging.set_verbosity(optuna.logging.WARNING)
MIN = [optuna.study.StudyDirection.MINIMIZE]


def _lost() -> sqlalchemy.exc.OperationalError:
    return sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))


def _one_line_error(excinfo: pytest.ExceptionInfo, *parts: str) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text.startswith("storage "), text
    for part in parts:
        assert part in text, text
    return text


# --- URLs, files, messages -------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["redis://localhost:6379", "studies.db", "", "sqlite://relative.db",
                                 "postgres://ann:s3cret@db.example/studies", "file:///tmp/x.sqlite"])
def test_other_text_is_a_one_line_error_listing_the_three_forms(url):
    with pytest.raises(UserError) as excinfo:
        open_storage(url, create=True)
    text = _one_line_error(excinfo, "not a storage URL", "sqlite:///PATH", "journal:///PATH", "postgresql://")
    assert "s3cret" not in text


def test_describe_hides_the_password_only():
    assert describe("postgresql+psycopg2://ann:s3:cr/et@db.example:5433/studies") == \
        "postgresql+psycopg2://ann:***@db.example:5433/studies"
    assert describe("mysql://root:pw@localhost/db?charset=utf8") == "mysql://root:***@localhost/db?charset=utf8"
    assert describe("postgresql://ann@host/db?sslmode=require&password=pw") == \
        "postgresql://ann@host/db?sslmode=require&password=***"
    for url in ("postgresql://ann@host/db", "sqlite:////tmp/a:b@c.sqlite", "journal:///tmp/x.log", "runs/x.log"):
        assert describe(url) == url


def test_a_server_that_refuses_is_one_line_without_the_password():
    with pytest.raises(UserError) as excinfo:  # port 1 on loopback: refused at once
        open_storage("postgresql+psycopg2://ann:s3cret@127.0.0.1:1/studies")
    text = _one_line_error(excinfo, "ann:***@127.0.0.1:1")
    assert "s3cret" not in text


def test_a_missing_driver_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg2", None)  # as if neither driver were installed
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(UserError) as excinfo:
        open_storage("postgresql://ann:s3cret@127.0.0.1:1/studies", create=True)
    text = _one_line_error(excinfo, "database driver is missing", "pip install 'autosoft[postgresql]'")
    assert "s3cret" not in text


def test_a_url_is_checked_without_opening_anything(tmp_path, monkeypatch):
    """check_url refuses what no storage could open (a tune calls it before looking for a GPU) and
    passes the rest untouched: no file is created, no server is asked."""
    for url in (f"sqlite:///{tmp_path}/a.sqlite", f"journal:///{tmp_path}/a.log", str(tmp_path / "b.log"),
                "postgresql://ann:s3cret@127.0.0.1:1/studies", "postgresql+psycopg2://ann@127.0.0.1:1/studies"):
        check_url(url)
    assert not list(tmp_path.iterdir())
    cases = {"foo://x": "not a storage URL", "postgresql+nosuch://ann:s3cret@h/db": "nosuch",
             "mysql+nosuch://ann@h/db": "nosuch"}
    for url, words in cases.items():
        with pytest.raises(UserError) as excinfo:
            check_url(url)
        assert "s3cret" not in _one_line_error(excinfo, words)
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    monkeypatch.setitem(sys.modules, "psycopg", None)
    with pytest.raises(UserError) as excinfo:
        check_url("postgresql://ann@h/db")
    _one_line_error(excinfo, "database driver is missing", "pip install 'autosoft[postgresql]'")


def test_a_plain_postgresql_url_takes_the_installed_driver(monkeypatch):
    """README's `postgresql://user@host/db` names no driver; SQLAlchemy 2.1 would pick psycopg 3,
    which the [postgresql] extra does not bring: the installed driver is named for it."""
    pytest.importorskip("psycopg2")
    assert _with_driver("postgresql://ann@h/db") == "postgresql+psycopg2://ann@h/db"
    assert _with_driver("postgresql+psycopg://ann@h/db") == "postgresql+psycopg://ann@h/db", "a named driver stays"
    assert _with_driver("mysql://ann@h/db") == "mysql://ann@h/db"
    monkeypatch.setitem(sys.modules, "psycopg2", None)
    monkeypatch.setitem(sys.modules, "psycopg", None)
    assert _with_driver("postgresql://ann@h/db") == "postgresql://ann@h/db", "none installed: as given"


def test_sqlite_create_and_open(tmp_path):
    path = tmp_path / "new" / "folder" / "studies.sqlite"
    url = f"sqlite:///{path}"
    with pytest.raises(UserError) as excinfo:
        open_storage(url)
    _one_line_error(excinfo, "no such file")
    assert not path.parent.exists()  # opening without create made nothing

    storage = open_storage(url, create=True)
    assert isinstance(storage, RetryingStorage) and isinstance(storage.inner, _CachedStorage)
    assert storage.inner._backend.engine.dialect.name == "sqlite"
    optuna.create_study(study_name="s", storage=storage).add_trial(optuna.trial.create_trial(value=1.0))
    (summary,) = optuna.get_all_study_summaries(open_storage(url))
    assert (summary.study_name, summary.n_trials) == ("s", 1)

    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.commit()
    with pytest.raises(UserError) as excinfo:
        open_storage(f"sqlite:///{other}")
    _one_line_error(excinfo, "not an Optuna storage")


@pytest.mark.parametrize("how", ["check_url", "open", "create"])
def test_a_cache_file_or_another_database_is_refused_as_storage_and_left_unchanged(tmp_path, how):
    """A cache file given as --storage got Optuna's tables beside its own (whose `trials` table
    collides with Optuna's). Any SQLite file with tables that are not Optuna's is refused, unchanged."""
    cache = tmp_path / "kernels.sqlite"
    Cache(cache).put(make_entry())
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE trials (x)").connection.commit()
    for path, words in ((cache, "is an autosoft cache file"), (other, "not an Optuna storage")):
        before = path.read_bytes()
        url = f"sqlite:///{path}"
        with pytest.raises(UserError) as excinfo:
            check_url(url) if how == "check_url" else open_storage(url, create=how == "create")
        _one_line_error(excinfo, words)
        assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.sqlite", "other.sqlite"]
    blank = tmp_path / "blank.sqlite"
    blank.touch()
    check_url(f"sqlite:///{blank}")  # an empty file is a new database: Optuna may fill it
    open_storage(f"sqlite:///{blank}", create=True)
    assert open_storage(f"sqlite:///{blank}") is not None


@pytest.mark.parametrize("create", [False, True])
def test_sqlite_file_of_garbage_saying_wal_is_refused_and_left_alone(tmp_path, create):
    """Byte 19 = 2 in SQLite's header says WAL mode: SQLite makes -wal and -shm on opening such a file,
    before it finds the rest unreadable. The user's file is refused, unchanged, with nothing beside it."""
    path = tmp_path / "studies.sqlite"
    garbage = bytearray(b"SQLite format 3\0" + bytes(range(256)) * 16)
    garbage[18] = garbage[19] = 2
    path.write_bytes(bytes(garbage))
    with pytest.raises(UserError) as excinfo:
        open_storage(f"sqlite:///{path}", create=create)
    _one_line_error(excinfo, str(path))
    assert path.read_bytes() == bytes(garbage)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["studies.sqlite"], "no -wal or -shm left behind"


def test_journal_create_and_open_both_spellings(tmp_path):
    plain = tmp_path / "a" / "b" / "studies.log"
    with pytest.raises(UserError) as excinfo:
        open_storage(str(plain))
    _one_line_error(excinfo, "no such journal file")
    assert not plain.parent.exists()

    storage = open_storage(str(plain), create=True)
    assert isinstance(storage, JournalStorage) and plain.is_file()
    optuna.create_study(study_name="j", storage=storage).add_trial(optuna.trial.create_trial(value=2.0))
    for url in (str(plain), f"journal://{plain}", f"journal:///{plain}"):  # journal:///abs and journal:////abs
        (summary,) = optuna.get_all_study_summaries(open_storage(url))
        assert (summary.study_name, summary.n_trials) == ("j", 1), url

    other = tmp_path / "c" / "x.journal"
    assert isinstance(open_storage(f"journal://{other}", create=True), JournalStorage) and other.is_file()
    (tmp_path / "dir.log").mkdir()
    with pytest.raises(UserError) as excinfo:
        open_storage(str(tmp_path / "dir.log"), create=True)
    _one_line_error(excinfo, "is a folder")
    bad = tmp_path / "bad.log"
    bad.write_text("not a journal\nnor this\n")  # (one bad last line is read as a write cut short)
    with pytest.raises(UserError) as excinfo:
        open_storage(str(bad))
    _one_line_error(excinfo, "not an Optuna journal")


def test_default_storage_url_beside_the_cache(tmp_path):
    cache = Cache(tmp_path / "cache" / "kernels.sqlite")
    one = default_storage_url(cache.path, 1)
    assert one == f"sqlite:///{tmp_path / 'cache' / 'kernels-studies.sqlite'}" == study_storage(cache)
    several = default_storage_url(cache.path, 4)
    assert several == f"journal://{tmp_path / 'cache' / 'kernels-studies.log'}"
    assert several.startswith("journal:///")
    assert isinstance(open_storage(several, create=True), JournalStorage)
    assert (tmp_path / "cache" / "kernels-studies.log").is_file()
    rel = default_storage_url(Path("k.sqlite"), 2)  # a relative cache path still names an absolute file
    assert rel == f"journal://{Path.cwd() / 'k-studies.log'}"


# --- RetryingStorage, on stub failures --------------------------------------------------------------

def test_retrying_storage_delegates_every_storage_method():
    optional = {"get_trial_id_from_study_id_trial_number", "get_trial_number_from_id", "get_trial_param",
                "get_n_trials", "get_best_trial", "get_trial_params", "get_trial_user_attrs",
                "get_trial_system_attrs", "remove_session", "check_trial_is_updatable",
                "record_heartbeat", "_get_stale_trial_ids", "get_heartbeat_interval",
                "get_heartbeat_stale_trial_callback"}
    public = {n for n, v in vars(BaseStorage).items() if callable(v) and not n.startswith("__")}
    assert BaseStorage.__abstractmethods__ <= public <= optional | BaseStorage.__abstractmethods__
    missing = (BaseStorage.__abstractmethods__ | optional) - set(vars(RetryingStorage))
    assert not missing
    assert not RetryingStorage.__abstractmethods__


def test_connection_lost_reads_the_cause_chain():
    try:
        try:
            raise _lost()
        except sqlalchemy.exc.OperationalError as exc:
            raise optuna.exceptions.StorageInternalError("during the commit") from exc
    except optuna.exceptions.StorageInternalError as wrapped:
        assert connection_lost(wrapped)
    assert not connection_lost(optuna.exceptions.StorageInternalError("value too long"))
    assert not connection_lost(sqlalchemy.exc.IntegrityError("INSERT", {}, Exception("duplicate")))
    assert not connection_lost(KeyError("no study"))


def _sqlite_retrying(tmp_path) -> RetryingStorage:
    storage = open_storage(f"sqlite:///{tmp_path / 's.sqlite'}", create=True)
    assert isinstance(storage, RetryingStorage)
    storage.backoff = (0.01, 0.01, 0.01)
    return storage


def test_a_lost_connection_is_retried_and_then_raised(tmp_path, monkeypatch):
    storage = _sqlite_retrying(tmp_path)
    storage.create_new_study(MIN, "s")
    real, failures = storage.inner.get_all_studies, [2]

    def flaky():
        if failures[0]:
            failures[0] -= 1
            raise _lost()
        return real()

    monkeypatch.setattr(storage.inner, "get_all_studies", flaky)
    assert [s.study_name for s in storage.get_all_studies()] == ["s"] and storage.retries == 2

    failures[0] = 10
    with pytest.raises(StorageUnavailableError) as excinfo:
        storage.get_all_studies()
    assert storage.retries == 2 + 3 and failures[0] == 10 - 4  # the first try and 3 retries
    assert isinstance(excinfo.value, UserError) and isinstance(excinfo.value.__cause__, sqlalchemy.exc.OperationalError)
    _one_line_error(excinfo, "get_all_studies failed after 3 retries", "connection is lost")

    monkeypatch.setattr(storage.inner, "get_all_studies", lambda: (_ for _ in ()).throw(ValueError("bad")))
    with pytest.raises(ValueError):
        storage.get_all_studies()
    assert storage.retries == 5  # not retried


def test_a_tell_whose_commit_landed_before_the_connection_dropped_succeeds(tmp_path, monkeypatch):
    storage = _sqlite_retrying(tmp_path)
    study = optuna.create_study(study_name="s", storage=storage)
    trial = study.ask()
    trial.suggest_int("x", 0, 3)
    real = storage.inner.set_trial_state_values
    calls = []

    def commit_then_drop(trial_id, state, values=None):
        calls.append(state)
        result = real(trial_id, state, values)
        if len(calls) == 1:
            raise _lost()  # committed, and the answer was lost
        return result

    monkeypatch.setattr(storage.inner, "set_trial_state_values", commit_then_drop)
    study.tell(trial, 1.5)
    assert len(calls) == 2 and storage.retries == 1
    (done,) = study.get_trials()
    assert (done.state, done.value) == (TrialState.COMPLETE, 1.5)

    calls.clear()  # a tell of an already finished trial is still an error, at once
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        storage.set_trial_state_values(done._trial_id, TrialState.COMPLETE, [1.5])
    assert storage.retries == 1


def test_ctrl_c_inside_a_write_takes_effect_after_it(tmp_path, monkeypatch, sigint_handled):
    """Ctrl-C that arrives inside a storage call is raised when the call returns: the write is
    whole, and the SQLite database is left unlocked, so the interrupted worker's last write (its
    problem given back) goes through at once. Before, an interruption inside a write could leave
    its transaction open, and that last write waited 60 s on its own lock, try after try."""
    import os
    import signal
    import time

    storage = _sqlite_retrying(tmp_path)
    study_id = storage.create_new_study(MIN, "s")
    real = storage.inner.set_study_user_attr

    def interrupted_midway(sid, key, value):
        real(sid, key + "-first", value)
        os.kill(os.getpid(), signal.SIGINT)  # the user's Ctrl-C, between the two writes
        time.sleep(0.05)
        real(sid, key, value)

    monkeypatch.setattr(storage.inner, "set_study_user_attr", interrupted_midway)
    with pytest.raises(KeyboardInterrupt):
        storage.set_study_user_attr(study_id, "lease", "worker-1")
    monkeypatch.undo()
    assert storage.get_study_user_attrs(study_id) == {"lease-first": "worker-1", "lease": "worker-1"}
    started = time.perf_counter()
    storage.set_study_user_attr(study_id, "lease", None)  # what `finally: board.release(...)` does
    assert time.perf_counter() - started < 5 and storage.get_study_user_attrs(study_id)["lease"] is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


# --- a real PostgreSQL ----------------------------------------------------------------------------

def _add_trials(url: str, study_name: str, n: int, barrier) -> None:
    """In a spawned process: open the storage and add n asked-and-told trials and one added trial."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    barrier.wait()  # both processes open the fresh database (and create its tables) together
    storage = open_storage(url, create=True)
    study = optuna.create_study(study_name=study_name, storage=storage, load_if_exists=True)
    for _ in range(n):
        trial = study.ask()
        study.tell(trial, trial.suggest_float("x", 0.0, 1.0))
    study.add_trial(optuna.trial.create_trial(params={"x": 0.5}, distributions={
        "x": optuna.distributions.FloatDistribution(0.0, 1.0)}, value=0.5))


def test_two_processes_add_trials_to_one_study(postgres_server):
    url = postgres_server.database("two_processes")  # empty: both processes create the tables
    ctx = multiprocessing.get_context("spawn")
    barrier, n = ctx.Barrier(2), 15
    procs = [ctx.Process(target=_add_trials, args=(url, "shared", n, barrier)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    study = optuna.load_study(study_name="shared", storage=open_storage(url))
    trials = study.get_trials()
    assert len(trials) == 2 * (n + 1)
    assert sorted(t.number for t in trials) == list(range(2 * (n + 1)))
    assert all(t.state == TrialState.COMPLETE and t.value == t.params["x"] for t in trials)
    assert len(optuna.get_all_study_summaries(open_storage(url))) == 1


def test_a_plain_postgresql_url_opens_the_server(postgres_server):
    """The URL as README writes it (no driver) opens the real server with the extra's driver."""
    url = postgres_server.database("plain_url").replace("postgresql+psycopg2://", "postgresql://")
    assert url.startswith("postgresql://")
    storage = open_storage(url, create=True)
    study = optuna.create_study(storage=storage, study_name="plain")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    assert len(optuna.load_study(study_name="plain", storage=open_storage(url)).trials) == 2


def test_postgres_open_without_create_needs_the_tables(postgres_server):
    url = postgres_server.database("empty")
    with pytest.raises(UserError) as excinfo:
        optuna.get_all_study_summaries(open_storage(url))
    _one_line_error(excinfo, "/empty: not an Optuna storage (no Optuna tables")
    storage = open_storage(url, create=True)
    assert isinstance(storage, RetryingStorage) and storage.inner._backend.engine.pool._pre_ping
    assert open_storage(url).get_all_studies() == []


def test_optunas_errors_pass_through_unretried(postgres_url):
    storage = open_storage(postgres_url, create=True)
    storage.create_new_study(MIN, "duplicated")
    start = time.monotonic()
    with pytest.raises(optuna.exceptions.DuplicatedStudyError):
        storage.create_new_study(MIN, "duplicated")
    with pytest.raises(KeyError):
        storage.get_study_id_from_name("no such study")
    assert storage.retries == 0 and time.monotonic() - start < storage.backoff[0]
    with pytest.raises(optuna.exceptions.DuplicatedStudyError):  # and create_study says so too
        optuna.create_study(study_name="duplicated", storage=storage)


def test_calls_survive_a_server_restart(postgres_server, postgres_url):
    """The server stops for 2 s while a loop of storage calls runs: none raises. (The loop leaves out
    create_new_trial, which RDBStorage itself retries a few times, so that the outage meets ours.)"""
    storage = open_storage(postgres_url, create=True)
    storage.backoff = (0.25, 0.5, 1.0, 2.0, 4.0)
    study = optuna.create_study(study_name="restarted", storage=storage)
    trial = study.ask()
    trial.suggest_float("x", 0.0, 1.0)
    thread_errors: list[BaseException] = []

    def restart():
        try:
            postgres_server.stop()
            time.sleep(2.0)
            postgres_server.start()
        except BaseException as exc:  # noqa: BLE001 - asserted below
            thread_errors.append(exc)

    thread = threading.Thread(target=restart)
    steps, deadline = 0, None
    try:
        thread.start()
        while deadline is None or time.monotonic() < deadline:
            storage.set_trial_intermediate_value(trial._trial_id, steps, float(steps))
            storage.set_study_user_attr(study._study_id, "steps", steps + 1)
            assert storage.get_study_user_attrs(study._study_id)["steps"] == steps + 1
            assert [s.study_name for s in storage.get_all_studies()].count("restarted") == 1
            steps += 1
            if deadline is None and not thread.is_alive():
                deadline = time.monotonic() + 0.5  # a few more calls on the restarted server
    finally:
        thread.join()
        postgres_server.ensure_running()
    assert not thread_errors and postgres_server.running
    assert storage.retries >= 1  # the loop did meet the stopped server
    study.tell(trial, 0.25)
    for _ in range(3):  # and trials go on as before
        t = study.ask()
        study.tell(t, t.suggest_float("x", 0.0, 1.0))
    (first, *more) = study.get_trials()
    assert first.intermediate_values == {i: float(i) for i in range(steps)} and first.value == 0.25
    assert len(more) == 3 and all(t.state == TrialState.COMPLETE for t in (first, *more))


def test_a_server_down_longer_than_the_backoff_raises(postgres_server, postgres_url):
    storage = open_storage(postgres_url, create=True)
    storage.backoff = (0.1, 0.2, 0.3)
    study_id = storage.create_new_study(MIN, "down")
    postgres_server.stop()
    try:
        start = time.monotonic()
        with pytest.raises(StorageUnavailableError) as excinfo:
            storage.get_study_user_attrs(study_id)
        elapsed = time.monotonic() - start
    finally:
        postgres_server.start()
    assert storage.retries == 3 and sum(storage.backoff) <= elapsed < sum(storage.backoff) + 5
    _one_line_error(excinfo, "get_study_user_attrs failed after 3 retries", "postgres@127.0.0.1")
    assert storage.get_study_user_attrs(study_id) == {}  # and the same storage works once the server is back
