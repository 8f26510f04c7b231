"""Files written whole or not at all: the text goes to a temporary file in the same folder, is
synced, and takes the target's place with os.replace, so a failure (disk full, interrupted)
never leaves a half-written file and a reader sees the old text or the new one. And SQLite files
that turn out to be bad are left as they were found, with nothing new beside them."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path


def replace_text(target: Path, text: str) -> None:
    """Write `text` to `target` atomically; a file it replaces keeps its permissions, a new one
    gets the umask's. Raises OSError (the temporary file is removed)."""
    tmp: Path | None = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileNotFoundError):  # replacing a file: keep its permissions
            os.chmod(tmp, stat.S_IMODE(target.stat().st_mode))
        os.replace(tmp, target)
        tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


@contextlib.contextmanager
def sqlite_side_files_removed_on_error(database: Path) -> Iterator[None]:
    """Where the block raises, remove the -journal, -wal and -shm files of `database` that it made.

    SQLite makes -wal and -shm beside a file whose header says "WAL mode" (byte 19 is 2) as it opens
    it, read-only too, even when the rest is garbage it then cannot read; a user's bad file must be
    refused with nothing left beside it. Side files that were there before are never touched."""
    before = _sqlite_side_files(database)
    try:
        yield
    except BaseException:
        for side in _sqlite_side_files(database) - before:
            with contextlib.suppress(OSError):
                side.unlink()
        raise


def _sqlite_side_files(database: Path) -> set[Path]:
    sides = (database.with_name(database.name + suffix) for suffix in ("-journal", "-wal", "-shm"))
    return {side for side in sides if side.exists()}
