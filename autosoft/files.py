"""Files written whole or not at all: the text goes to a temporary file in the same folder, is
synced, and takes the target's place with os.replace, so a failure (disk full, interrupted)
never leaves a half-written file and a reader sees the old text or the new one. And a file's
SQLite header is read before SQLite opens it, so that a bad file is refused with nothing made
beside it."""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
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


def sqlite_header_problem(path: Path) -> str | None:
    """Why the file at `path` cannot be an SQLite database, judged from its 100-byte header alone, or
    None (an empty file too: SQLite takes it for a new database).

    Checked before SQLite opens a file: SQLite makes -wal and -shm beside a file whose header says
    "WAL mode" (byte 19 is 2) as it opens it, read-only too, before it reads the rest; garbage with
    that byte would be refused with two new files left beside it. The fields checked are the ones
    every SQLite database has: the magic, a page size that is a power of two from 512 to 65536, and
    the payload fractions 64, 32, 32 (https://www.sqlite.org/fileformat.html#the_database_header)."""
    try:
        with open(path, "rb") as f:
            header = f.read(100)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if not header:
        return None
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if (len(header) < 100 or not header.startswith(b"SQLite format 3\0") or header[21:24] != b"\x40\x20\x20"
            or page_size < 512 or page_size & (page_size - 1)):
        return "file is not a database"  # SQLite's own words for it
    return None
