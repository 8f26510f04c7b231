"""A throwaway PostgreSQL server for the storage tests, started from the system's binaries.

The session fixture `postgres_server` runs initdb and `pg_ctl start` on 127.0.0.1 on a free port,
with its data and socket folders in a fresh folder under /tmp, and stops it and removes the folder
after the session. It never touches a cluster that Debian's `postgresql` package may have started
as a service (own port, own data folder, own socket folder). PostgreSQL refuses to run as root: as
root the server runs as `nobody` (through runuser, else setpriv), in a folder that user owns.

`postgres_url` is the URL of its database `autosoft`; `postgres_server.stop()` / `.start()` /
`.restart()` drop and bring back the server in the middle of a test, and `.database(name)` makes a
fresh, empty database and returns its URL. Tests that find no PostgreSQL skip with the line to
install it.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

INSTALL_HINT = "apt-get install postgresql (and pip install psycopg2-binary)"
RUN_AS = "nobody"  # the user the server runs as when the tests run as root


def find_binaries() -> tuple[str, str] | None:
    """initdb and pg_ctl: from PATH, else from the newest /usr/lib/postgresql/VERSION/bin (Debian's place),
    else those the `pgserver` wheel bundles (a machine with no package registry can carry that wheel)."""
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl:
        return initdb, pg_ctl
    folders = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                     key=lambda p: [int(x) if x.isdigit() else -1 for x in Path(p).parent.name.split(".")])
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.submodule_search_locations:
        folders += [os.path.join(spec.submodule_search_locations[0], "pginstall", "bin")]
    for folder in reversed(folders):
        initdb, pg_ctl = os.path.join(folder, "initdb"), os.path.join(folder, "pg_ctl")
        if os.access(initdb, os.X_OK) and os.access(pg_ctl, os.X_OK):
            return initdb, pg_ctl
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_user_prefix() -> tuple[list[str], int | None, int | None]:
    """The command prefix that runs a program as the server's user, and that user's uid and gid."""
    if os.geteuid() != 0:
        return [], None, None
    import pwd

    entry = pwd.getpwnam(RUN_AS)
    if shutil.which("runuser"):
        return ["runuser", "-u", RUN_AS, "--"], entry.pw_uid, entry.pw_gid
    if shutil.which("setpriv"):
        return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", "--"], \
            entry.pw_uid, entry.pw_gid
    raise RuntimeError("running as root, and neither runuser nor setpriv is installed to run PostgreSQL as nobody")


class PostgresServer:
    """One PostgreSQL server in its own folder; `url` is its database `autosoft`."""

    def __init__(self, binaries: tuple[str, str], root: Path, port: int):
        (self.initdb, self.pg_ctl), self.root, self.port = binaries, root, port
        self.data, self.sockets, self.log = root / "data", root / "sockets", root / "server.log"
        self.prefix, uid, gid = _as_user_prefix()
        if uid is not None:
            for path in (root, self.sockets):
                path.mkdir(exist_ok=True)
                os.chown(path, uid, gid)
        else:
            self.sockets.mkdir(exist_ok=True)
        self.url = self.url_for("autosoft")
        self.running = False

    def url_for(self, database: str) -> str:
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        env.pop("PGDATA", None)
        proc = subprocess.run([*self.prefix, *args], cwd=self.root, env=env, capture_output=True, text=True,
                              timeout=120)
        if check and proc.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.is_file() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({proc.returncode}): {proc.stdout}{proc.stderr}{log}")
        return proc

    def init(self) -> None:
        self._run(self.initdb, "-D", str(self.data), "-U", "postgres", "--auth=trust",
                  "-E", "UTF8", "--no-locale", "--no-sync")

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(self.pg_ctl, "start", "-w", "-t", "60", "-D", str(self.data),
                  "-l", str(self.log), "-o", options)
        self.running = True

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (`pg_ctl stop -m fast`: open connections are dropped)."""
        self._run(self.pg_ctl, "stop", "-w", "-t", "60", "-m", mode, "-D", str(self.data))
        self.running = False

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_running(self) -> None:
        if not self.running:
            self.start()

    def database(self, name: str) -> str:
        """Create the empty database `name` (dropping one of that name) and return its URL."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{name}"')
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url_for(name)

    def close(self) -> None:
        try:
            if self.running:
                try:
                    self.stop()
                except Exception:  # noqa: BLE001 - a server that will not stop politely
                    self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session (see the module docstring); skips where none is installed."""
    binaries = find_binaries()
    if binaries is None:
        pytest.skip(f"needs PostgreSQL's initdb and pg_ctl: {INSTALL_HINT}")
    if importlib.util.find_spec("psycopg2") is None:
        pytest.skip("needs psycopg2: pip install psycopg2-binary (or '.[test]')")
    root = Path(tempfile.mkdtemp(prefix="autosoft-pg-", dir="/tmp"))
    root.chmod(0o755)  # /tmp is 1777: the server's user can reach its folder
    server = PostgresServer(binaries, root, free_port())
    try:
        server.init()
        server.start()
        server.database("autosoft")
    except BaseException:
        server.close()
        raise
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """postgresql+psycopg2://postgres@127.0.0.1:PORT/autosoft of the session's server."""
    return postgres_server.url
