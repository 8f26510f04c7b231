"""The Optuna storage that keeps the search state of tuning studies, opened from a URL.

Three forms of URL:

- `sqlite:///PATH`: one SQLite file (the default of one process: `<cache stem>-studies.sqlite`
  beside the cache).
- a journal file: `journal:///PATH` (`journal://` then an absolute path) or a plain path ending in
  `.log` / `.journal`: Optuna's JournalFileStorage, for several processes of one host.
- a database server: `postgresql://USER[:PASSWORD]@HOST[:PORT]/DB` (any `postgresql+DRIVER://`,
  psycopg2 by default: `pip install 'autosoft[postgresql]'`) or `mysql[+DRIVER]://...`, for
  processes on several hosts.

`open_storage` turns a URL into a storage; every failure to open it is a one-line UserError. SQL
storages come back wrapped in RetryingStorage, which retries an operation whose database
connection was lost (a server restarted, a connection dropped while idle during a long trial:
optuna#5600) with backoff instead of failing the tune. `describe` hides the password of a URL for
messages and logs.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import re
import signal
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Callable, Container, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import optuna
from optuna.storages import BaseStorage
from optuna.storages._heartbeat import BaseHeartbeat

from .errors import UserError, one_line
from .files import sqlite_header_problem

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.study import StudyDirection
    from optuna.study._frozen import FrozenStudy
    from optuna.trial import FrozenTrial, TrialState

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

FORMS = ("sqlite:///PATH, journal:///PATH (or a path ending .log/.journal), "
         "or postgresql://USER[:PASSWORD]@HOST[:PORT]/DB (mysql://... too)")
POSTGRES_HINT = "pip install 'autosoft[postgresql]'"
_SERVER_SCHEMES = re.compile(r"^(postgresql|mysql)(\+[A-Za-z0-9_]+)?://", re.IGNORECASE)


# --- URLs ----------------------------------------------------------------------------------------

def describe(url: str) -> str:
    """`url` with any password replaced by `***` (in `user:password@` and in a `password=` query)."""
    text = re.sub(r"^([A-Za-z][\w+.\-]*://[^:/@]*):[^@]*@", r"\1:***@", str(url))
    return re.sub(r"([?&]password=)[^&]*", r"\1***", text, flags=re.IGNORECASE)


def _journal_path(url: str) -> Path | None:
    """The file of a journal URL (`journal:///abs/path`, also `journal:////abs/path`), else None."""
    if url.startswith("journal://"):
        path = urllib.parse.unquote(url[len("journal://"):])
        if path.startswith("//"):
            path = path[1:]  # journal:////abs/path, sqlite's spelling of an absolute path
        return Path(path).expanduser()
    if "://" not in url and url.endswith((".log", ".journal")):
        return Path(url).expanduser()
    return None


def _sqlite_path(url: str) -> Path:
    return Path(urllib.parse.unquote(url[len("sqlite:///"):].split("?")[0])).expanduser()


def default_storage_url(cache_path: Path | str, processes: int) -> str:
    """Where a tune keeps its studies when given no storage: for one process the SQLite file
    `<cache stem>-studies.sqlite` beside the cache; for several processes of one host (SQLite's
    locking serialises them and fails under contention) the journal file
    `journal:///<cache folder>/<cache stem>-studies.log`."""
    path = Path(cache_path).expanduser()
    if processes <= 1:
        return f"sqlite:///{path.parent / (path.stem + '-studies.sqlite')}"
    return f"journal://{path.absolute().parent / (path.stem + '-studies.log')}"


def _with_driver(url: str) -> str:
    """A `postgresql://` URL that names no driver, given the one installed: SQLAlchemy's own
    choice moved from psycopg2 (up to 2.0) to psycopg 3 (2.1), and the [postgresql] extra brings
    psycopg2, so README's plain URL failed under SQLAlchemy 2.1 with the extra installed.
    psycopg2 first, then psycopg; with neither, the URL as given (its error names the extra)."""
    if not url.lower().startswith("postgresql://"):
        return url
    for driver in ("psycopg2", "psycopg"):
        try:
            importlib.import_module(driver)
        except ImportError:
            continue
        return f"postgresql+{driver}://" + url[len("postgresql://"):]
    return url


def check_url(url: str) -> None:
    """Raise UserError (one line) for a URL that no storage could be opened from: not one of
    FORMS, or a server URL whose SQLAlchemy dialect or database driver is not installed. Opens
    and creates nothing, so a tune refuses a mistyped --storage before it looks for a GPU."""
    url = str(url)
    shown = describe(url)
    if url.startswith("sqlite:///"):
        path = _sqlite_path(url)
        if path.is_file():
            _check_sqlite_header(path, shown)
            _check_optuna_tables(path, shown, blank_ok=True)
        return
    if _journal_path(url) is not None:
        return
    if not _SERVER_SCHEMES.match(url):
        raise UserError(f"storage {shown!r}: not a storage URL; give {FORMS}")
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(_with_driver(url)).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise UserError(f"storage {shown}: {one_line(exc)[:160]}") from None
    try:
        dialect.import_dbapi()
    except ImportError as exc:
        raise _driver_missing(shown, url, exc) from None


def _driver_missing(shown: str, url: str, exc: ImportError) -> UserError:
    """The one-line error for a server URL whose database driver cannot be imported."""
    psycopg2 = re.match(r"postgresql(\+psycopg2)?://", url, re.IGNORECASE)
    hint = POSTGRES_HINT if psycopg2 else "install that module"
    return UserError(f"storage {shown}: its database driver is missing ({one_line(exc)[:120]}): {hint}")


def local_file(url: str) -> Path | None:
    """The file of an SQLite or journal URL, None for a server's."""
    url = str(url)
    journal = _journal_path(url)
    if journal is not None:
        return journal
    return _sqlite_path(url) if url.startswith("sqlite:///") else None


def holds_no_trial(url: str) -> bool:
    """Whether the storage file of `url` holds no trial of any study: nothing a --resume could
    continue, so a failed tune that created it may remove it. False when it cannot be read."""
    path = local_file(url)
    if path is None or not path.is_file():
        return False
    if path.stat().st_size == 0:
        return True
    try:
        storage = open_storage(url)
        return all(storage.get_n_trials(s._study_id) == 0 for s in storage.get_all_studies())
    except Exception:  # noqa: BLE001 - unreadable: not ours to judge empty
        return False


# --- opening -------------------------------------------------------------------------------------

def open_storage(url: str, *, create: bool = False) -> BaseStorage:
    """An Optuna storage for `url` (the forms of the module docstring).

    create=False opens an existing storage without creating or changing anything: the SQLite or
    journal file must exist (and an SQLite file must hold Optuna's tables), a server database is
    opened without creating tables. create=True creates what is missing: the file and its folder,
    the tables. SQL storages come back as RetryingStorage(optuna's _CachedStorage(RDBStorage)).
    Raises UserError (one line, password hidden) when the storage cannot be opened.
    """
    url = str(url)
    shown = describe(url)
    journal = _journal_path(url)
    if journal is not None:
        return _open_journal(journal, shown, create)
    if url.startswith("sqlite:///"):
        path = _sqlite_path(url)
        if create:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserError(f"storage {shown}: cannot create its folder ({one_line(exc)})") from None
        if not create:
            _check_sqlite(path, shown)
        elif path.is_file():
            _check_sqlite_header(path, shown)
            _check_optuna_tables(path, shown, blank_ok=True)
        return _open_rdb(url, shown, create, {"connect_args": {"timeout": 60}})
    if _SERVER_SCHEMES.match(url):
        return _open_rdb(_with_driver(url), shown, create, {"pool_pre_ping": True})
    raise UserError(f"storage {shown!r}: not a storage URL; give {FORMS}")


def _open_journal(path: Path, shown: str, create: bool) -> BaseStorage:
    from optuna.storages import JournalStorage
    try:
        from optuna.storages.journal import JournalFileBackend as backend
    except ImportError:  # optuna < 4.0
        from optuna.storages import JournalFileStorage as backend  # type: ignore[no-redef]

    if path.is_dir():
        raise UserError(f"storage {shown}: is a folder, not a journal file")
    if not path.is_file():
        if not create:
            raise UserError(f"storage {shown}: no such journal file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"storage {shown}: cannot create its folder ({one_line(exc)})") from None
    try:
        return JournalStorage(backend(str(path)))
    except Exception as exc:  # noqa: BLE001 - any parse error of the file is "cannot be opened"
        raise UserError(f"storage {shown}: not an Optuna journal ({one_line(exc)[:120]})") from None


def _check_sqlite(path: Path, shown: str) -> None:
    """Optuna would create a missing file or an empty database's tables: check first, read-only."""
    if not path.is_file():
        raise UserError(f"storage {shown}: no such file (autosoft tune writes <cache stem>-studies.sqlite "
                        "beside the cache)")
    _check_sqlite_header(path, shown)
    _check_optuna_tables(path, shown, blank_ok=False)


# Tables only an Optuna storage has together: an autosoft cache file has a `trials` table too.
_OPTUNA_TABLES = frozenset({"studies", "trials", "version_info"})


def _check_optuna_tables(path: Path, shown: str, *, blank_ok: bool) -> None:
    """Refuse an SQLite file that is not an Optuna storage, read-only, before Optuna adds its tables
    to it: a cache file given as --storage got Optuna's tables beside its own (its `trials` table
    collides with Optuna's) and the tune then failed after a quarter-minute of retries. A file with
    no table at all (blank_ok) is a new database, which Optuna may fill."""
    try:
        uri = f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro"
        conn = sqlite3.connect(uri, uri=True)
        try:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        raise UserError(f"storage {shown}: unreadable ({one_line(exc)})") from None
    if blank_ok and not tables:
        return
    if _OPTUNA_TABLES <= tables:
        return
    if {"meta", "entries"} <= tables:
        raise UserError(f"storage {shown}: is an autosoft cache file, not an Optuna storage; give another file "
                        "(a tune keeps its studies in <cache stem>-studies.sqlite); the file was left as it is")
    raise UserError(f"storage {shown}: not an Optuna storage (no studies table); the file was left as it is")


def _check_sqlite_header(path: Path, shown: str) -> None:
    """Refuse a file whose header no SQLite database has, before SQLite opens it and makes files beside it."""
    problem = sqlite_header_problem(path)
    if problem:
        raise UserError(f"storage {shown}: unreadable ({problem})")


def _open_rdb(url: str, shown: str, create: bool, engine_kwargs: dict[str, Any]) -> RetryingStorage:
    from optuna.storages import RDBStorage, _CachedStorage

    def failed(exc: BaseException) -> UserError:
        text = one_line(exc)
        if isinstance(exc, ImportError):
            cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
            return _driver_missing(shown, url, cause)
        if isinstance(exc, optuna.exceptions.StorageInternalError) and exc.__cause__ is not None:
            text = one_line(exc.__cause__)  # Optuna's own message only guesses at the cause
        text = re.split(r" \[SQL: | \(Background on this error at: ", text)[0]
        if not create and re.search(r"relation \S+ does not exist|doesn't exist|no such table", text):
            return UserError(f"storage {shown}: not an Optuna storage (no Optuna tables; a tune creates them)")
        return UserError(f"storage {shown}: cannot be opened ({text[:200]})")

    # Processes that start together on an empty database all create the tables, and PostgreSQL
    # refuses all but one (a unique violation on its catalogue, "already exists"): try again, the
    # tables are there by then.
    attempts = 5 if create else 1
    for attempt in range(1, attempts + 1):
        try:
            try:
                rdb = RDBStorage(url, engine_kwargs=engine_kwargs, skip_table_creation=not create)
            except TypeError:  # an optuna without skip_table_creation
                rdb = RDBStorage(url, engine_kwargs=engine_kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - SQLAlchemy, driver and URL errors alike
            if attempt < attempts and _creation_race(exc):
                time.sleep(0.2 * attempt)
                continue
            raise failed(exc) from None
    # optuna.storages.get_storage wraps every RDBStorage so: it keeps finished trials in memory
    # (Study.ask/tell read them from there) and only fetches trials that changed
    return RetryingStorage(_CachedStorage(rdb), label=shown)


def _creation_race(exc: BaseException) -> bool:
    import sqlalchemy.exc as sa

    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return any(isinstance(e, sa.IntegrityError) or "already exists" in str(e) for e in chain)


# --- retrying lost connections -------------------------------------------------------------------

class StorageUnavailableError(UserError):
    """The storage's database stayed unreachable through every retry of an operation."""


def _connection_errors() -> tuple[type[BaseException], ...]:
    import sqlalchemy.exc as sa

    errors: tuple[type[BaseException], ...] = (sa.OperationalError, sa.InterfaceError, sa.DisconnectionError)
    try:
        import psycopg2
    except ImportError:
        return errors
    return errors + (psycopg2.OperationalError, psycopg2.InterfaceError)


# Optuna's own answers about the data: a retry would get the same answer
_DOMAIN_ERRORS = (optuna.exceptions.DuplicatedStudyError, optuna.exceptions.UpdateFinishedTrialError,
                  KeyError, ValueError, RuntimeError)


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive while the block runs take effect when it ends, so that a
    group of writes happens whole or not at all. Recording a trial is several writes (its
    attributes, then its state); an interruption between them left a running trial that carried
    a result, which `--resume` took for a dead worker's and measured again. An interruption inside
    one SQLite write could leave its transaction open, and the interrupted worker's last write
    (giving its problem back) then waited on its own lock: 60 s per try, over every retry. Outside
    the main thread (where signals cannot be handled) the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    # a handler not installed from Python (None) could not be put back: that signal is not held
    handled = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    before = {s: signal.signal(s, lambda signum, frame: arrived.append(signum)) for s in handled}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(arrived):
            signal.raise_signal(s)  # now handled as it would have been (KeyboardInterrupt for Ctrl-C)


def connection_lost(exc: BaseException) -> bool:
    """Whether `exc` comes from a lost or refused database connection. RDBStorage re-raises
    SQLAlchemy's errors as StorageInternalError, hence the walk down the chain of causes."""
    if isinstance(exc, _DOMAIN_ERRORS):
        return False
    lost = _connection_errors()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, lost):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class RetryingStorage(BaseStorage, BaseHeartbeat):
    """An Optuna storage that retries an operation whose database connection was lost.

    Delegates every method of BaseStorage (and of BaseHeartbeat) to `inner`. When a call fails
    because the connection was lost or refused (SQLAlchemy's OperationalError, InterfaceError or
    DisconnectionError, psycopg2's OperationalError or InterfaceError, also as the cause of
    Optuna's StorageInternalError), it waits `backoff[i]` seconds and calls again; after the last
    wait it raises StorageUnavailableError (a UserError, from the last error). The engine is made
    with pool_pre_ping, so the first retry after the server is back gets a fresh connection.
    Optuna's answers about the data (DuplicatedStudyError, KeyError, UpdateFinishedTrialError,
    ValueError, RuntimeError) and any other error pass through at once.

    A failed call may have been committed by the server before the connection dropped (the
    acknowledgement is what was lost); the retry then runs a second time:

    - reads (get_*) are idempotent.
    - set_trial_param, set_trial_intermediate_value, set_trial_user_attr, set_trial_system_attr,
      set_study_user_attr, set_study_system_attr write the same row again: idempotent.
    - set_trial_state_values to a finished state: the second attempt finds the trial finished
      (UpdateFinishedTrialError); when the stored state and values are the ones asked for, the
      call succeeds instead. WAITING -> RUNNING (taking an enqueued trial) returns False then, and
      Optuna takes another trial; the first stays RUNNING.
    - create_new_trial may create a second trial: the first stays RUNNING, never told.
    - create_new_study may have created the study once already: the retry raises
      DuplicatedStudyError (optuna.create_study(load_if_exists=True) then loads it).
    - delete_study may have deleted it already: the retry raises KeyError.

    `backoff` is a class attribute; set it on an instance (or pass it) to wait less, e.g. in tests.
    `retries` counts the retries made, for logs and tests.
    """

    backoff: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)

    def __init__(self, inner: BaseStorage, *, label: str = "", backoff: Sequence[float] | None = None) -> None:
        self.inner = inner
        self.label = label or type(inner).__name__
        if backoff is not None:
            self.backoff = tuple(backoff)
        self.retries = 0

    def _retry(self, what: str, call: Callable[[int], _T]) -> _T:
        """call(attempt) until it returns or fails for another reason than a lost connection."""
        attempt = 0
        while True:
            try:
                with interrupts_held():  # never half a write; Ctrl-C still cuts the waits between tries
                    return call(attempt)
            except Exception as exc:
                if not connection_lost(exc):
                    raise
                if attempt >= len(self.backoff):
                    raise StorageUnavailableError(
                        f"storage {self.label}: {what} failed after {attempt} retries over "
                        f"{sum(self.backoff):g} s, the database connection is lost ({one_line(exc)[:200]})") from exc
                delay = self.backoff[attempt]
                attempt += 1
                self.retries += 1
                _log.warning("storage %s: connection lost in %s (%s); retry %d/%d in %g s", self.label, what,
                             one_line(exc)[:200], attempt, len(self.backoff), delay)
                time.sleep(delay)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        method = getattr(self.inner, name)
        return self._retry(name, lambda _attempt: method(*args, **kwargs))

    # --- studies
    def create_new_study(self, directions: Sequence[StudyDirection], study_name: str | None = None) -> int:
        return self._call("create_new_study", directions, study_name)

    def delete_study(self, study_id: int) -> None:
        self._call("delete_study", study_id)

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_user_attr", study_id, key, value)

    def set_study_system_attr(self, study_id: int, key: str, value: Any) -> None:
        self._call("set_study_system_attr", study_id, key, value)

    def get_study_id_from_name(self, study_name: str) -> int:
        return self._call("get_study_id_from_name", study_name)

    def get_study_name_from_id(self, study_id: int) -> str:
        return self._call("get_study_name_from_id", study_id)

    def get_study_directions(self, study_id: int) -> list[StudyDirection]:
        return self._call("get_study_directions", study_id)

    def get_study_user_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_user_attrs", study_id)

    def get_study_system_attrs(self, study_id: int) -> dict[str, Any]:
        return self._call("get_study_system_attrs", study_id)

    def get_all_studies(self) -> list[FrozenStudy]:
        return self._call("get_all_studies")

    # --- trials
    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        return self._call("create_new_trial", study_id, template_trial)

    def set_trial_param(self, trial_id: int, param_name: str, param_value_internal: float,
                        distribution: BaseDistribution) -> None:
        self._call("set_trial_param", trial_id, param_name, param_value_internal, distribution)

    def get_trial_id_from_study_id_trial_number(self, study_id: int, trial_number: int) -> int:
        return self._call("get_trial_id_from_study_id_trial_number", study_id, trial_number)

    def get_trial_number_from_id(self, trial_id: int) -> int:
        return self._call("get_trial_number_from_id", trial_id)

    def get_trial_param(self, trial_id: int, param_name: str) -> float:
        return self._call("get_trial_param", trial_id, param_name)

    def set_trial_state_values(self, trial_id: int, state: TrialState,
                               values: Sequence[float] | None = None) -> bool:
        def call(attempt: int) -> bool:
            try:
                return self.inner.set_trial_state_values(trial_id, state, values)
            except optuna.exceptions.UpdateFinishedTrialError:
                if attempt and self._landed(trial_id, state, values):
                    return True  # the lost attempt was committed
                raise
        return self._retry("set_trial_state_values", call)

    def _landed(self, trial_id: int, state: TrialState, values: Sequence[float] | None) -> bool:
        trial = self.inner.get_trial(trial_id)
        if trial.state != state:
            return False
        return values is None or list(trial.values or ()) == [float(v) for v in values]

    def set_trial_intermediate_value(self, trial_id: int, step: int, intermediate_value: float) -> None:
        self._call("set_trial_intermediate_value", trial_id, step, intermediate_value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_user_attr", trial_id, key, value)

    def set_trial_system_attr(self, trial_id: int, key: str, value: Any) -> None:
        self._call("set_trial_system_attr", trial_id, key, value)

    def get_trial(self, trial_id: int) -> FrozenTrial:
        return self._call("get_trial", trial_id)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._call("get_all_trials", study_id, deepcopy=deepcopy, states=states)

    def get_n_trials(self, study_id: int, state: tuple[TrialState, ...] | TrialState | None = None) -> int:
        return self._call("get_n_trials", study_id, state)

    def get_best_trial(self, study_id: int) -> FrozenTrial:
        return self._call("get_best_trial", study_id)

    def get_trial_params(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_params", trial_id)

    def get_trial_user_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_user_attrs", trial_id)

    def get_trial_system_attrs(self, trial_id: int) -> dict[str, Any]:
        return self._call("get_trial_system_attrs", trial_id)

    def remove_session(self) -> None:
        self.inner.remove_session()  # closes connections: nothing to retry

    def check_trial_is_updatable(self, trial_id: int, trial_state: TrialState) -> None:
        self.inner.check_trial_is_updatable(trial_id, trial_state)  # no database access

    # --- heartbeats (RDBStorage(heartbeat_interval=...); off unless the inner storage has them)
    def record_heartbeat(self, trial_id: int) -> None:
        self._call("record_heartbeat", trial_id)

    def _get_stale_trial_ids(self, study_id: int) -> list[int]:
        return self._call("_get_stale_trial_ids", study_id)

    def get_heartbeat_interval(self) -> int | None:
        return self.inner.get_heartbeat_interval() if isinstance(self.inner, BaseHeartbeat) else None

    def get_heartbeat_stale_trial_callback(self) -> Callable[[optuna.Study, FrozenTrial], None] | None:
        if isinstance(self.inner, BaseHeartbeat):
            return self.inner.get_heartbeat_stale_trial_callback()
        return None

    def __repr__(self) -> str:
        return f"RetryingStorage({self.label})"
