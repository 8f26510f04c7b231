"""The tuned-kernel store: one SQLite file, keyed so that a stale kernel can never be found.

A key names everything that decides whether a tuned variant is still the right one: family,
dtype, shape, GPU name and compute capability, CUDA (NVRTC) version, the digest of the
family's template and of its search space. Params are stored as a JSON mapping of plain
values; nothing in the file is ever executed, and params are re-checked against the search
space before they are rendered again.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
import urllib.parse
import warnings
from contextlib import closing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import CacheWarning, UserError, one_line
from .files import sqlite_header_problem
from .selector import Selector, node_from_json, node_to_json

SCHEMA_VERSION = 1
APP_ID = "autosoft-cache"
CACHE_FILE = "kernels.sqlite"

# Added after schema 1 without a new version: a file without it reads as one without selectors, and an
# older autosoft ignores it. Keyed by NVRTC major, not version: a selector serves its whole major.
_SELECTORS_TABLE = """
CREATE TABLE IF NOT EXISTS selectors (
    family TEXT NOT NULL, gpu_name TEXT NOT NULL, compute_capability TEXT NOT NULL, cuda_major TEXT NOT NULL,
    template_digest TEXT NOT NULL, space_digest TEXT NOT NULL, cuda_version TEXT NOT NULL,
    configs TEXT NOT NULL, features TEXT NOT NULL, tree TEXT NOT NULL, shapes TEXT NOT NULL,
    autosoft_version TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (family, gpu_name, compute_capability, cuda_major, template_digest, space_digest)
);
"""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    family TEXT NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL,
    gpu_name TEXT NOT NULL, compute_capability TEXT NOT NULL, cuda_version TEXT NOT NULL,
    template_digest TEXT NOT NULL, space_digest TEXT NOT NULL,
    variant_name TEXT NOT NULL, params TEXT NOT NULL, source_digest TEXT NOT NULL,
    time_us REAL NOT NULL, default_time_us REAL, copy_time_us REAL,
    launches TEXT NOT NULL, autosoft_version TEXT NOT NULL, created REAL NOT NULL,
    PRIMARY KEY (family, dtype, shape, gpu_name, compute_capability, cuda_version,
                 template_digest, space_digest)
);
CREATE TABLE IF NOT EXISTS trials (
    family TEXT NOT NULL, dtype TEXT NOT NULL, shape TEXT NOT NULL, gpu_name TEXT NOT NULL,
    variant_name TEXT NOT NULL, params TEXT NOT NULL, status TEXT NOT NULL,
    time_us REAL, message TEXT NOT NULL, created REAL NOT NULL
);
""" + _SELECTORS_TABLE

_KEY_FIELDS = ("family", "dtype", "shape", "gpu_name", "compute_capability", "cuda_version",
               "template_digest", "space_digest")


@dataclass(frozen=True)
class CacheKey:
    family: str
    dtype: str
    shape: str            # Problem.shape_text: "4096x8192", "1x32x8192x64+causal"
    gpu_name: str
    compute_capability: str
    cuda_version: str
    template_digest: str
    space_digest: str


@dataclass(frozen=True)
class Entry:
    key: CacheKey
    variant_name: str
    params: Mapping[str, Any]
    source_digest: str
    time_us: float
    default_time_us: float | None
    copy_time_us: float | None
    launches: str          # human-readable launch geometry, for export headers and `list`
    autosoft_version: str
    created: float


def default_cache_path() -> Path:
    """$AUTOSOFT_CACHE_DIR/kernels.sqlite, else the user cache directory.

    Raises UserError when $AUTOSOFT_CACHE_DIR (or a folder above it) is an existing file: every
    command and the API then say so, instead of "no cache" from one and a traceback from another."""
    value = os.environ.get("AUTOSOFT_CACHE_DIR")
    if not value:
        import platformdirs

        return Path(platformdirs.user_cache_dir("autosoft")) / CACHE_FILE
    folder = Path(value).expanduser()
    for above in (folder, *folder.parents):
        if above.exists():
            if not above.is_dir():
                raise UserError(f"AUTOSOFT_CACHE_DIR={value}: {above} is a file, not a folder; "
                                "point the variable at a folder (or unset it)")
            break
    return folder / CACHE_FILE


STORE_ENV = "AUTOSOFT_KERNEL_STORE"


def default_store_folder() -> Path:
    """Where compiled kernels are kept (kernel_store.py): $AUTOSOFT_KERNEL_STORE, else `kernels/`
    beside default_cache_path(). Here, beside the cache's own path, so that every module finds
    the stores the same way."""
    folder = os.environ.get(STORE_ENV)
    if folder:
        return Path(folder).expanduser()
    return default_cache_path().parent / "kernels"


class Cache:
    """A cache file. Opening validates it; a bad file raises UserError and is left untouched."""

    def __init__(self, path: Path | str, create: bool = True):
        # checked here so that every caller (load_cache, the CLI, tune) says the same, not pathlib's TypeError
        if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"cache path: expected a file path (str or os.PathLike), got {type(path).__name__}")
        if not os.fspath(path):
            raise UserError("cache path is empty; give the path of a cache file")
        self.path = Path(path).expanduser()
        if self.path.exists():
            if not self.path.is_file():
                raise UserError(f"cache {self.path}: is not a file; pass --cache with a file path")
            problem = sqlite_header_problem(self.path)  # before SQLite opens it: see its docstring
            if problem:
                raise UserError(f"cache {self.path}: unreadable ({problem}); the file was left as it is")
            if create and self._is_blank():
                self._create()  # another process is creating it right now, or it was left empty
            self._validate()
        elif not create:
            raise UserError(f"cache {self.path}: no such file")
        else:
            self._create()

    @staticmethod
    def holds_nothing(path: Path) -> bool:
        """Whether the cache file at `path` holds no entry and no trial (read-only; False when it
        cannot be read): a failed tune that created it may remove it."""
        try:
            uri = f"file:{urllib.parse.quote(str(Path(path).resolve()))}?mode=ro"
            with closing(sqlite3.connect(uri, uri=True)) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                return all(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] == 0
                           for t in ("entries", "trials") if t in tables)
        except sqlite3.DatabaseError:
            return False

    # -- opening -----------------------------------------------------------------------
    def _connect(self, readonly: bool = False) -> sqlite3.Connection:
        if readonly:
            uri = f"file:{urllib.parse.quote(str(self.path.resolve()))}?mode=ro"  # '#', '?' in paths
            conn = sqlite3.connect(uri, uri=True, timeout=60)
        else:
            conn = sqlite3.connect(self.path, timeout=60)
        conn.row_factory = sqlite3.Row
        return conn

    def _validate(self) -> None:
        where = f"cache {self.path}"
        try:
            with closing(self._connect(readonly=True)) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "meta" not in tables:
                    raise UserError(f"{where}: not an autosoft cache (no meta table); the file was left as it is")
                meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
                if meta.get("app") != APP_ID:
                    raise UserError(f"{where}: not an autosoft cache (app={meta.get('app')!r}); the file was left as it is")
                version = int(meta.get("schema_version", "-1"))
                if version > SCHEMA_VERSION:
                    raise UserError(f"{where}: written by a newer autosoft (schema {version} > {SCHEMA_VERSION}); "
                                    "upgrade autosoft or use another --cache")
                if version != SCHEMA_VERSION or not {"entries", "trials"} <= tables:
                    raise UserError(f"{where}: unsupported schema version {version}; use another --cache")
                conn.execute("SELECT count(*) FROM entries").fetchone()
                check = conn.execute("PRAGMA quick_check").fetchone()[0]
                if check != "ok":
                    raise UserError(f"{where}: corrupt ({check}); the file was left as it is")
        except sqlite3.DatabaseError as exc:
            raise UserError(f"{where}: unreadable ({exc}); the file was left as it is") from None

    def _is_blank(self) -> bool:
        """An empty file or an SQLite database without a single table: nothing in it to lose."""
        if self.path.stat().st_size == 0:
            return True
        try:
            with closing(self._connect(readonly=True)) as conn:
                return conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0
        except sqlite3.DatabaseError:
            return False  # not SQLite at all: _validate says so

    def _create(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cache {self.path}: cannot create its folder ({exc.strerror or one_line(exc)}); "
                            "pass another --cache") from None
        # one transaction: a concurrent opener sees either nothing or the whole schema with its meta rows
        with self._writing() as conn:
            conn.executescript(
                "BEGIN IMMEDIATE;" + _SCHEMA
                + f"INSERT OR IGNORE INTO meta VALUES ('app', '{APP_ID}');"
                + f"INSERT OR IGNORE INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}');COMMIT;")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[sqlite3.Connection]:
        """A connection for one transaction; a file or folder that cannot be written (read-only,
        a full disk) is a one-line UserError naming the file, and nothing of the transaction stays."""
        try:
            with closing(self._connect()) as conn, conn:
                yield conn
        except sqlite3.OperationalError as exc:
            raise UserError(f"cache {self.path}: cannot be written ({one_line(exc)}); "
                            "make it writable or pass another --cache") from None

    # -- entries -----------------------------------------------------------------------
    def put(self, entry: Entry) -> bool:
        """Store entry unless a faster one with the same key is there. True when stored."""
        row = {**asdict(entry.key), **_entry_fields(entry)}
        cols = ", ".join(row)
        marks = ", ".join(f":{c}" for c in row)
        updates = ", ".join(f"{c}=excluded.{c}" for c in row if c not in _KEY_FIELDS)
        sql = (f"INSERT INTO entries ({cols}) VALUES ({marks}) "
               f"ON CONFLICT ({', '.join(_KEY_FIELDS)}) DO UPDATE SET {updates} "
               "WHERE excluded.time_us < entries.time_us")
        with self._writing() as conn:
            cur = conn.execute(sql, row)
            return cur.rowcount > 0

    def entries(self) -> list[Entry]:
        """The well-formed entries; each malformed row is skipped with a CacheWarning naming it."""
        rows = self._select("ORDER BY family, dtype, shape")
        return [e for e in (_entry_from_row(r, self.path) for r in rows) if e is not None]

    def get(self, key: CacheKey) -> Entry | None:
        where = " AND ".join(f"{f} = ?" for f in _KEY_FIELDS)
        rows = self._select(f"WHERE {where}", tuple(asdict(key).values()))
        return _entry_from_row(rows[0], self.path) if rows else None

    def _select(self, tail: str, values: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        """Rows of the entries table with their rowid; a table that cannot be read names the file."""
        try:
            with closing(self._connect(readonly=True)) as conn:
                cur = conn.execute(f"SELECT rowid AS _rowid, * FROM entries {tail}", values)
                missing = [c for c in _ENTRY_COLUMNS if c not in {d[0] for d in cur.description}]
                if missing:  # every row would be skipped: say once what is wrong with the table
                    raise UserError(f"cache {self.path}: the entries table has no column {', '.join(missing)}; "
                                    "the file was left as it is; use another --cache")
                return cur.fetchall()
        except sqlite3.DatabaseError as exc:
            raise UserError(f"cache {self.path}: unreadable entries ({one_line(exc)}); "
                            "the file was left as it is; use another --cache") from None

    # -- trials (every evaluated variant, failures included) ----------------------------
    def record_trials(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        with self._writing() as conn:
            conn.executemany(
                "INSERT INTO trials VALUES (:family, :dtype, :shape, :gpu_name, :variant_name, :params, "
                ":status, :time_us, :message, :created)",
                [{**r, "params": json.dumps(r["params"], sort_keys=True), "created": time.time()} for r in rows])

    def trials(self) -> Iterator[sqlite3.Row]:
        with closing(self._connect(readonly=True)) as conn:
            yield from conn.execute("SELECT * FROM trials ORDER BY created").fetchall()

    # -- selectors (selector.py: what serves a shape nobody tuned) ------------------------
    def put_selector(self, selector: Selector) -> None:
        """Store a selector, replacing the one of the same family, GPU, NVRTC major and digests
        (a refit is the newer knowledge). The table is made here in a file that predates it."""
        row = _selector_row(selector)
        cols = ", ".join(row)
        with self._writing() as conn:
            conn.executescript(_SELECTORS_TABLE)
            conn.execute(f"INSERT OR REPLACE INTO selectors ({cols}) VALUES ({', '.join(':' + c for c in row)})", row)

    def selectors(self) -> list[Selector]:
        """The well-formed selectors (none in a file without the table); a malformed row is skipped
        with a CacheWarning naming it."""
        try:
            with closing(self._connect(readonly=True)) as conn:
                tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
                if "selectors" not in tables:
                    return []
                rows = conn.execute("SELECT rowid AS _rowid, * FROM selectors "
                                    "ORDER BY family, gpu_name, cuda_major, created").fetchall()
        except sqlite3.DatabaseError as exc:
            raise UserError(f"cache {self.path}: unreadable selectors ({one_line(exc)}); "
                            "the file was left as it is; use another --cache") from None
        out = []
        for row in rows:
            try:
                out.append(_selector_from_row(row))
            except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
                warnings.warn(f"cache {self.path}: skipped the malformed selector at rowid {row['_rowid']}: "
                              f"{one_line(exc)[:120]}", CacheWarning, stacklevel=2)
        return out

    def merge(self, other: "Cache") -> tuple[int, int]:
        """Take another cache file's entries (each unless a faster one of its key is here) and
        selectors (each replacing this file's of the same key only when newer). Returns how many
        of each were written; the other file is only read."""
        stored = sum(self.put(e) for e in other.entries())
        mine = {_selector_key(s): s.created for s in self.selectors()}
        taken = 0
        for s in other.selectors():
            if s.created > mine.get(_selector_key(s), -math.inf):
                self.put_selector(s)
                taken += 1
        return stored, taken


def _selector_key(s: Selector) -> tuple[str, ...]:
    return (s.family, s.gpu_name, s.compute_capability, s.cuda_major, s.template_digest, s.space_digest)


def _selector_row(s: Selector) -> dict[str, Any]:
    return {"family": s.family, "gpu_name": s.gpu_name, "compute_capability": s.compute_capability,
            "cuda_major": s.cuda_major, "template_digest": s.template_digest, "space_digest": s.space_digest,
            "cuda_version": s.cuda_version, "configs": json.dumps([dict(c) for c in s.configs], sort_keys=True),
            "features": json.dumps(list(s.features)), "tree": json.dumps(node_to_json(s.tree)),
            "shapes": json.dumps(list(s.shapes)), "autosoft_version": s.autosoft_version, "created": s.created}


def _selector_from_row(row: sqlite3.Row) -> Selector:
    configs = json.loads(row["configs"])
    features = json.loads(row["features"])
    shapes = json.loads(row["shapes"])
    if not isinstance(configs, list) or not configs or not all(isinstance(c, dict) for c in configs):
        raise ValueError("configs is not a list of mappings")
    if not all(isinstance(x, str) for x in (*features, *shapes)):
        raise ValueError("features or shapes are not lists of names")
    texts = {c: row[c] for c in ("family", "gpu_name", "compute_capability", "cuda_major", "template_digest",
                                 "space_digest", "cuda_version", "autosoft_version")}
    if not all(isinstance(v, str) for v in texts.values()) or texts["cuda_version"].split(".")[0] != texts["cuda_major"]:
        raise ValueError("a key field is not text, or the NVRTC version is not of its major")
    created = row["created"]
    if isinstance(created, bool) or not isinstance(created, (int, float)):
        raise ValueError("created is not a number")
    return Selector(texts["family"], texts["gpu_name"], texts["compute_capability"], texts["cuda_version"],
                    texts["template_digest"], texts["space_digest"], tuple(configs), tuple(features),
                    node_from_json(json.loads(row["tree"]), len(configs)), tuple(shapes),
                    texts["autosoft_version"], float(created))


def _entry_fields(entry: Entry) -> dict[str, Any]:
    return {
        "variant_name": entry.variant_name,
        "params": json.dumps(dict(entry.params), sort_keys=True),
        "source_digest": entry.source_digest,
        "time_us": float(entry.time_us),
        "default_time_us": entry.default_time_us,
        "copy_time_us": entry.copy_time_us,
        "launches": entry.launches,
        "autosoft_version": entry.autosoft_version,
        "created": entry.created,
    }


_TEXT_FIELDS = ("variant_name", "source_digest", "launches", "autosoft_version")
_ENTRY_COLUMNS = (*_KEY_FIELDS, *_TEXT_FIELDS, "params", "time_us", "default_time_us", "copy_time_us", "created")
_LATEST_TIMESTAMP = 253402300799.0  # 9999-12-31: past it, formatting the date fails


class _BadRow(ValueError):
    pass


def _text(row: sqlite3.Row, column: str) -> str:
    value = row[column]
    if value is None:
        raise _BadRow(f"{column} is NULL")
    if not isinstance(value, str):
        raise _BadRow(f"{column} is not text ({type(value).__name__})")
    return value


def _number(row: sqlite3.Row, column: str, optional: bool = False, positive: bool = True) -> float | None:
    value = row[column]
    if value is None and optional:
        return None
    # SQLite hands back int, float, str, bytes or None; only numbers (not NaN or inf) can be times
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _BadRow(f"{column} is not a finite number ({'NULL' if value is None else repr(value)[:40]})")
    if (value <= 0 if positive else value < 0):
        raise _BadRow(f"{column} is {value}, not {'positive' if positive else 'a date'}")
    return float(value)


def _entry_from_row(row: sqlite3.Row, path: Path) -> Entry | None:
    """The row as an Entry, or None (with a CacheWarning naming the file and the row) when it is malformed:
    one tampered or damaged row must not make the other entries of the file unusable."""
    try:
        key = CacheKey(**{f: _text(row, f) for f in _KEY_FIELDS})
        try:
            params = json.loads(_text(row, "params"))
        except (ValueError, RecursionError) as exc:
            raise _BadRow(f"params is not JSON ({one_line(exc)[:80]})") from None
        if not isinstance(params, dict):
            raise _BadRow(f"params is not a mapping ({type(params).__name__})")
        created = _number(row, "created", positive=False)
        if created > _LATEST_TIMESTAMP:
            raise _BadRow(f"created is {created}, not a date")
        return Entry(key, _text(row, "variant_name"), params, _text(row, "source_digest"), _number(row, "time_us"),
                     _number(row, "default_time_us", optional=True), _number(row, "copy_time_us", optional=True),
                     _text(row, "launches"), _text(row, "autosoft_version"), created)
    except _BadRow as exc:
        shape = row["shape"]
        shape_text = repr(shape) if len(repr(shape)) <= 40 else repr(shape)[:37] + "..."
        warnings.warn(f"cache {path}: skipped the malformed entry at rowid {row['_rowid']} "
                      f"(shape {shape_text}): {exc}", CacheWarning, stacklevel=3)
        return None
