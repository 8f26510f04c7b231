"""Compiled kernels on disk beside the tuned cache, so that a fresh process loads without NVRTC.

Layout: a folder, `$AUTOSOFT_KERNEL_STORE` when set, else `kernels/` beside the default cache
file (`$AUTOSOFT_CACHE_DIR/kernels/` or `~/.cache/autosoft/kernels/`), holding

    <digest>.cubin               a cubin: a header (magic, digest, sha256 of the cubin), then the cubin
    <digest>-<target>.verified   a variant with this digest passed verification on this kind of GPU
    <race>.race                  the digest that won a race: candidates for one untuned problem
                                 timed against each other on this kind of GPU (dispatch.py)

where <digest> is Variant.digest: the sha256 of source, compile options, architecture and NVRTC
version, so a file can only ever be found by the compilation that made it. Softmax source
depends on the row length N, not on the row count M: every M of one N and one variant shares
one cubin and one verification.

Writes go to a temporary file in the same folder and are renamed over the final name, so a
reader sees a whole file or none; a file whose header or checksum is wrong (a torn copy, a
truncated disk) is a miss, removed and rebuilt. The cubins together stay under a size bound
(1 GiB, `$AUTOSOFT_KERNEL_STORE_BYTES`; 0 keeps nothing on disk): past it the least recently
used are deleted, by modification time, which every hit refreshes. A folder that cannot be
written costs one warning; kernels are then kept in memory for the process.

Nothing here needs CuPy or a GPU; NVRTC is called only on a miss.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from . import compile as compiler
from .cache import STORE_ENV, default_store_folder
from .errors import UserError

if TYPE_CHECKING:
    from .families.base import Problem, Target, Variant

BYTES_ENV = "AUTOSOFT_KERNEL_STORE_BYTES"
DEFAULT_MAX_BYTES = 1 << 30

_MAGIC = b"autosoft-cubin1\n"   # 16 bytes; a new layout gets a new magic and old files become misses
_DIGEST_LEN = 64                 # hex sha256
_HEADER_LEN = len(_MAGIC) + _DIGEST_LEN + 32
_STALE_TEMP_S = 3600.0           # a temporary file this old belongs to a writer that died


@dataclass(frozen=True)
class StoreStats:
    """What a store did in this process: hits and misses of cubins, NVRTC compiles, verifications."""
    hits: int
    misses: int
    compiles: int
    writes: int
    evictions: int
    verifications_recorded: int


class CompileFailed(RuntimeError):
    """A variant that NVRTC rejects; the message names it and gives the log's first line."""


class KernelStore:
    """A folder of cubins keyed by variant digest, bounded in size; safe for concurrent processes.

    folder=None: $AUTOSOFT_KERNEL_STORE, else `kernels/` beside default_cache_path().
    max_bytes=None: $AUTOSOFT_KERNEL_STORE_BYTES, else 1 GiB; 0 writes nothing to disk.
    """

    def __init__(self, folder: Path | str | None = None, max_bytes: int | None = None):
        self.folder = Path(folder).expanduser() if folder is not None else default_store_folder()
        self.max_bytes = max_bytes if max_bytes is not None else default_max_bytes()
        if self.max_bytes < 0:
            raise UserError(f"kernel store size bound must be at least 0 bytes, got {self.max_bytes}")
        self._lock = threading.Lock()
        self._writable = self.max_bytes > 0  # set to False at the first failed write (one warning)
        self._memory: dict[str, bytes] = {}  # cubins that could not be written, for this process
        self._verified: set[str] = set()
        self._races: dict[str, str] = {}  # race record name -> winner's digest
        self._counts = dict(hits=0, misses=0, compiles=0, writes=0, evictions=0, verifications_recorded=0)

    # -- cubins ---------------------------------------------------------------------------
    def get(self, digest: str) -> bytes | None:
        """The stored cubin for a digest, or None. A damaged file is removed and counts as a miss."""
        _check_digest(digest)
        cubin = self._memory.get(digest)
        if cubin is None:
            cubin = self._read(digest)
        self._count("hits" if cubin is not None else "misses")
        return cubin

    def put(self, digest: str, cubin: bytes) -> bool:
        """Store a cubin atomically and enforce the bound; False when it is kept in memory only."""
        _check_digest(digest)
        if not self._writable or not self._write_file(self.cubin_path(digest), _pack(digest, cubin)):
            self._memory[digest] = cubin
            return False
        self._count("writes")
        self._enforce_bound(keep=digest)
        return True

    def get_or_compile(self, variant: Variant) -> bytes:
        """The variant's cubin: from the store, else compiled with NVRTC and stored.

        Raises CompileFailed when NVRTC rejects the source (nothing is stored then)."""
        digest = variant.digest
        cubin = self.get(digest)
        if cubin is not None:
            return cubin
        self._count("compiles")
        # through the module attribute, so that a test (or a benchmark) sees every NVRTC call
        result = compiler.compile_source(variant.source, variant.target.arch)
        if not result.ok:
            first = (result.log.splitlines() or ["(no log)"])[0]
            raise CompileFailed(f"autosoft: {variant.name} does not compile: {first}")
        self.put(digest, result.cubin)
        return result.cubin

    def cubin_path(self, digest: str) -> Path:
        return self.folder / f"{digest}.cubin"

    # -- verification records -------------------------------------------------------------
    def is_verified(self, variant: Variant) -> bool:
        """Whether this variant's compiled kernel passed verification on this kind of GPU before
        (in this process or, through the marker file, in any earlier one)."""
        name = _verification_name(variant.digest, variant.target)
        return name in self._verified or (self.folder / name).is_file()

    def mark_verified(self, variant: Variant) -> None:
        """Record that this variant passed verification; later processes skip it."""
        name = _verification_name(variant.digest, variant.target)
        with self._lock:
            self._verified.add(name)
        self._count("verifications_recorded")
        if self._writable:
            note = f"{variant.name} on {variant.target.name} (sm_{variant.target.arch}), {time.ctime()}\n"
            self._write_file(self.folder / name, note.encode())

    # -- race records ---------------------------------------------------------------------
    def race_winner(self, problem: Problem, contenders: Sequence[Variant]) -> str | None:
        """The digest that won the race of these contenders on this problem, on this kind of GPU
        (in this process or an earlier one); None when they have not raced."""
        name = _race_name(problem, contenders)
        with self._lock:
            winner = self._races.get(name)
        if winner is None:
            try:
                winner = (self.folder / name).read_text().split()[0]
            except (OSError, IndexError):
                return None
        return winner if winner in {v.digest for v in contenders} else None

    def record_race(self, problem: Problem, contenders: Sequence[Variant], winner: Variant) -> None:
        """Record the race's winner; later processes serve it without racing."""
        name = _race_name(problem, contenders)
        with self._lock:
            self._races[name] = winner.digest
        if self._writable:
            self._write_file(self.folder / name, f"{winner.digest} {winner.name} on {problem.shape_text}, "
                                                 f"{time.ctime()}\n".encode())

    # -- bookkeeping ---------------------------------------------------------------------
    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**self._counts)

    def size_bytes(self) -> int:
        """Bytes of cubins on disk now."""
        return sum(size for _, size, _ in self._listing())

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _read(self, digest: str) -> bytes | None:
        path = self.cubin_path(digest)
        try:
            data = path.read_bytes()
        except OSError:  # absent, or unreadable: either way compile it
            return None
        cubin = _unpack(digest, data)
        if cubin is None:
            _remove(path)  # damaged: rebuilt and written again by the caller
            return None
        try:
            os.utime(path)  # recently used: last to be evicted
        except OSError:
            pass  # a read-only store still serves
        return cubin

    def _write_file(self, path: Path, data: bytes) -> bool:
        """Write data to path atomically: a temporary file in the same folder, renamed over it."""
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            if tmp is not None:
                _remove(Path(tmp))
            self._give_up_writing(exc)
            return False

    def _give_up_writing(self, exc: OSError) -> None:
        with self._lock:
            if not self._writable:
                return
            self._writable = False
        warnings.warn(f"autosoft: kernel store {self.folder} is not writable ({exc.strerror or exc}); "
                      f"compiled kernels are kept in memory for this process only (set {STORE_ENV} to a "
                      "writable folder)", RuntimeWarning, stacklevel=4)

    def _listing(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every cubin on disk; files vanishing meanwhile are skipped."""
        found = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return []
        for name in names:
            if not name.endswith(".cubin"):
                continue
            path = self.folder / name
            try:
                st = path.stat()
            except OSError:
                continue  # evicted by another process just now
            found.append((st.st_mtime, st.st_size, path))
        return found

    def _enforce_bound(self, keep: str) -> None:
        """Delete the least recently used cubins (and their verification records) until the rest
        fit in max_bytes. The cubin just written is kept even when it alone is larger."""
        listing = self._listing()
        total = sum(size for _, size, _ in listing)
        kept = self.cubin_path(keep)
        for _, size, path in sorted(listing, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            if path == kept:
                continue
            if _remove(path):
                self._count("evictions")
            total -= size  # gone either way: removed here or by another process
            for marker in self.folder.glob(f"{path.stem}-*.verified"):
                _remove(marker)
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        cutoff = time.time() - _STALE_TEMP_S
        for tmp in self.folder.glob(".*.tmp"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    _remove(tmp)
            except OSError:
                continue


def default_max_bytes() -> int:
    """$AUTOSOFT_KERNEL_STORE_BYTES (a whole number of bytes), else 1 GiB."""
    text = os.environ.get(BYTES_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_BYTES
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{BYTES_ENV}={text!r}: expected a whole number of bytes, e.g. {DEFAULT_MAX_BYTES} "
                        "(0 keeps no kernels on disk)")
    return value


_STORES: dict[tuple[Path, int], KernelStore] = {}
_STORES_LOCK = threading.Lock()


def default_store() -> KernelStore:
    """The store the environment names now; one instance per (folder, bound) in a process, so its
    in-memory records (verifications, kernels kept in memory, counts) last for the process."""
    key = (default_store_folder(), default_max_bytes())
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = KernelStore(*key)
        return store


def _pack(digest: str, cubin: bytes) -> bytes:
    return _MAGIC + digest.encode() + hashlib.sha256(cubin).digest() + cubin


def _unpack(digest: str, data: bytes) -> bytes | None:
    """The cubin in a stored file, or None when the file is not a whole, intact copy for digest."""
    if len(data) <= _HEADER_LEN or not data.startswith(_MAGIC):
        return None
    start = len(_MAGIC)
    if data[start:start + _DIGEST_LEN] != digest.encode():
        return None
    checksum, cubin = data[start + _DIGEST_LEN:_HEADER_LEN], data[_HEADER_LEN:]
    return cubin if hashlib.sha256(cubin).digest() == checksum else None


def _gpu_kind(target: Target) -> str:
    # The cubin depends on the architecture alone, but a launch's geometry on the GPU's size
    # (persistent grids, cooperative splits): a verification or a race counts for one kind of GPU.
    kind = f"{target.arch}|{target.name}|{target.sm_count}|{target.smem_optin}|{target.l2_bytes}"
    return hashlib.sha256(kind.encode()).hexdigest()[:16]


def _verification_name(digest: str, target: Target) -> str:
    return f"{digest}-{_gpu_kind(target)}.verified"


def _race_name(problem: Problem, contenders: Sequence[Variant]) -> str:
    # one record per problem (a softmax's row count changes the winner though not the cubin),
    # set of contenders and kind of GPU
    kind = _gpu_kind(contenders[0].target)
    text = "|".join([problem.family, problem.dtype, problem.shape_text, kind, *sorted(v.digest for v in contenders)])
    return f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.race"


def _check_digest(digest: str) -> None:
    # digests become file names: never let one name a path elsewhere
    if len(digest) != _DIGEST_LEN or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a variant digest: {digest!r}")


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
