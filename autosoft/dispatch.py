"""From a call like autosoft.softmax(x) to a launch: pick the variant, keep it loaded, run it.

Choice, in order, among entries of the same family, dtype, GPU and digests: tuned with this
NVRTC version for this exact shape; the family's selector (selector.py), fitted on this GPU with
this NVRTC major and these digests (its leaf's first configuration where that is valid for this
shape, else the next valid one only when no tuned shape lends its params); with this
NVRTC for the nearest shape whose params are valid for this shape; tuned with another NVRTC of
the same major version (13.0 here on 13.5), exact shape, then nearest; else the family's
heuristic default. Another major version is never used. Only the first is trusted as it is: any
other choice is rebuilt from its params, compiled with the local NVRTC and verified on this
shape before its first use. A selector's pick that fails to compile or verify gives way to the
choice that would have come without the selector (nearest, then default), verified in its turn.

A selector's pick is a guess from other shapes, and so is the nearest entry; the family's heuristic
default is a third guess, from rules. Where the family has a selector and the shape moves at most
RACE_MAX_BYTES, the three race before their first use (each verified, then timed side by side on
random data of this exact shape) and the fastest serves (the pick or the default only when faster
than the nearest entry by RACE_MARGIN: close kernels swap places from one timing to the next). The
race's winner is recorded in the kernel store, so it runs once per shape and kind of GPU, and a
later process serves the same kernel. Where the leaf's first configuration is invalid, its first
valid one races; where no configuration of the selector is valid for the shape (a regime no fitted
shape had, such as few rows too long for any of its splits), the default races the nearest entry
alone. A larger shape, a first call made while a CUDA graph is being captured, one when the device
has no room for the race's data, and one in a process that has not loaded CuPy and would load it
only to race (torch tensors, a warm store) are served as described above without a race (and
without a record).

A check syncs the device, which would end a CUDA graph capture: a first call made while one is
captured is served the first of the choice and its rivals already verified on this kind of GPU
(another row count of the same row length shares the kernel), and where none is, fails with a
UserError that asks for one call before the capture (the warm-up torch.cuda.graph asks for).

Compiled kernels live in the kernel store (kernel_store.py), keyed by variant digest, so a
fresh process with a warm store loads without NVRTC, and a verification is recorded there per
digest: every row count M of one softmax row length shares one compile and one verification.
Loaded variants are also kept per (problem, device) in memory, so repeated calls neither look
up nor read the store again.
"""
from __future__ import annotations

import math
import re
import sys
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .cache import Cache, CacheKey, Entry, default_cache_path
from .compile import nvrtc_version
from .errors import CacheWarning, UserError
from .evaluate import race, verify
from .families import get_family
from .families.base import Family, Problem, Target, Variant, build_variant, family_template_digest, space_of
from .kernel_store import KernelStore, default_store
from .problems import record
from .runtime import DeviceInfo, LoadedVariant, device_info
from .selector import Selector

TUNED = "tuned"
SELECTOR = "selector"
DEFAULT_RIVAL = "default (raced)"  # the family's heuristic default, racing the pick and the nearest entry
_VERSION = re.compile(r"^(\d+)\.(\d+)$")
# the most bytes a call may move for its shape to be raced: a race allocates its inputs and outputs
# (several sets for a small shape, to rotate them past the L2) beside the caller's
RACE_MAX_BYTES = 1 << 30
# how much faster than the borrowed choice (what served before selectors) the selector's pick must
# run to serve instead: two kernels closer than this swap places from one timing to the next
RACE_MARGIN = 0.01


@dataclass(frozen=True)
class Choice:
    variant: Variant
    # "tuned", "selector (config 2 of 7)", "nearest <shape>", "tuned with NVRTC 13.0",
    # "nearest <shape>, tuned with NVRTC 13.0" or "default"
    source: str
    entry: Entry | None = None  # the cache entry whose params were taken; None for a selector or the default
    fallback: "Choice | None" = None  # a selector's pick: what serves when the pick fails its check
    rivals: "tuple[Choice, ...]" = ()  # raced against this choice on its shape before first use (module doc)

    @property
    def trusted(self) -> bool:
        """Tuned and verified for exactly this problem, GPU and compiler: used without a check."""
        return self.source == TUNED


class Dispatcher:
    """In-memory caches behind the public API: entries read from cache files, loaded variants.

    store: the kernel store to use; None uses the one the environment names at each load."""

    def __init__(self, store: KernelStore | None = None) -> None:
        self._store = store
        self._lock = threading.RLock()  # _prepare reads entries() while holding it
        self._extra_files: list[Path] = []
        self._entries: list[Entry] | None = None
        self._selectors: list[Selector] | None = None
        self._loaded: dict[tuple, LoadedVariant] = {}
        # the API's hot path (arrays.call_family): (family, options, scalar names, each array's
        # dtype, shape and device) -> the call's prepared plan
        self.fast: dict[tuple, Callable[..., tuple]] = {}
        # called after load_cache and forget clear the caches above (autosoft.native's records,
        # which replay plans of `fast`, must go with them)
        self._on_clear: list[Callable[[], None]] = []

    # -- cache files --------------------------------------------------------------------
    def load_cache(self, path: str | Path) -> int:
        """Use the entries of a cache file (e.g. tuned on another machine); returns how many it holds."""
        cache = Cache(path, create=False)  # validates; never modifies the file
        count = len(cache.entries())
        with self._lock:
            self._extra_files.insert(0, cache.path)
            self._entries = None
            self._selectors = None
            self._loaded.clear()
            self.fast.clear()
            self._cleared()
        return count

    def entries(self) -> list[Entry]:
        with self._lock:
            if self._entries is None:
                self._entries = [entry for cache in self._caches() for entry in cache.entries()]
            return self._entries

    def selectors(self) -> list[Selector]:
        """The selectors of the same files as entries(), a file loaded later first."""
        with self._lock:
            if self._selectors is None:
                self._selectors = [selector for cache in self._caches() for selector in cache.selectors()]
            return self._selectors

    def _caches(self) -> list[Cache]:
        """The files dispatch reads, opened: those load_cache gave (the latest first), then the
        default cache where it exists."""
        default = default_cache_path()
        return [Cache(path, create=False) for path in (*self._extra_files, *([default] if default.exists() else []))]

    def forget(self) -> None:
        """Drop the in-memory caches (the files stay); the next call reads the files again."""
        with self._lock:
            self._entries = None
            self._selectors = None
            self._loaded.clear()
            self.fast.clear()
            self._cleared()

    def on_clear(self, callback: Callable[[], None]) -> None:
        """Call `callback` each time load_cache or forget clears the in-memory caches (a cache of
        what they hold, kept elsewhere, goes with them)."""
        with self._lock:
            if callback not in self._on_clear:
                self._on_clear.append(callback)

    def _cleared(self) -> None:
        for callback in self._on_clear:
            callback()

    @property
    def store(self) -> KernelStore:
        return self._store if self._store is not None else default_store()

    # -- choosing -----------------------------------------------------------------------
    def choose(self, problem: Problem) -> Choice:
        """The variant for this problem on this GPU, and where it comes from (see the module doc)."""
        family = get_family(problem.family)
        target = device_info().target
        key = cache_key(problem, device_info())
        usable = [e for e in self.entries() if nvrtc_match(e.key, key) is not None]
        exact = [e for e in usable if nvrtc_match(e.key, key) == EXACT_NVRTC and e.key.shape == key.shape]
        if exact:
            best = min(exact, key=lambda e: e.time_us)
            return Choice(build_variant(family, problem, best.params, target), TUNED, best)
        borrowed = self._borrowed(family, problem, key, target, usable)
        return self._selector_choice(family, problem, key, target, borrowed) or borrowed

    def _borrowed(self, family: Family, problem: Problem, key: CacheKey, target: Target,
                  usable: list[Entry]) -> Choice:
        """The choice without an exact entry of this NVRTC and without a selector: the nearest
        valid shape of this NVRTC, the exact or nearest shape of its major version, the default."""
        for match in (EXACT_NVRTC, SAME_MAJOR):
            candidates = [e for e in usable if nvrtc_match(e.key, key) == match]
            gap = {id(e): _minor_gap(e.key.cuda_version, key.cuda_version) for e in candidates}  # nearest minor first
            exact = [e for e in candidates if e.key.shape == key.shape]
            if exact:
                best = min(exact, key=lambda e: (gap[id(e)], e.time_us))
                return Choice(build_variant(family, problem, best.params, target), _source(best, key, match), best)
            distances = [(key_distance(family, e.key, key), gap[id(e)], i) for i, e in enumerate(candidates)]
            for _, _, i in sorted(d for d in distances if d[0] < math.inf):
                entry = candidates[i]
                try:
                    variant = build_variant(family, problem, entry.params, target)
                except UserError:
                    continue  # invalid for this shape
                return Choice(variant, _source(entry, key, match), entry)
        return Choice(build_variant(family, problem, family.default_params(problem, target), target), "default")

    def _selector_choice(self, family: Family, problem: Problem, key: CacheKey, target: Target,
                         borrowed: Choice) -> Choice | None:
        """With the family's selector fitted on this GPU, NVRTC major and digests, the choice and
        its rivals (module doc): its pick, the borrowed choice and the family's default; None
        without a selector, or where the borrowed choice would race nothing."""
        selector = find_selector(self.selectors(), key)
        if selector is None:
            return None
        first = selector_pick(selector, family, problem, target, first_only=True)
        pick = first or selector_pick(selector, family, problem, target, first_only=False)
        default = _default_rival(family, problem, target, borrowed)
        if pick is None:  # a shape unlike every fitted one: the default races the nearest entry alone
            return replace(borrowed, rivals=(default,)) if default is not None else None
        index, variant = pick
        source = f"{SELECTOR} (config {index} of {len(selector.configs)})"
        others = (default,) if default is not None else ()
        if first is None and borrowed.entry is not None:  # see selector_pick: the nearest entry serves
            return replace(borrowed, rivals=(Choice(variant, source, None, borrowed), *others))
        return Choice(variant, source, None, borrowed, (borrowed, *others))

    def loaded(self, problem: Problem, device_index: int,
               load: Callable[[Variant, bytes], LoadedVariant] | None = None) -> LoadedVariant:
        """The problem's variant loaded on the current device (device_index). load(variant, cubin):
        how (runtime.load_for_torch: through libcuda, no CuPy); default LoadedVariant, CuPy's."""
        key = (problem, device_index, load)
        found = self._loaded.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._loaded.get(key)
            if found is None:
                found = self._prepare(problem, load)
                self._loaded[key] = found
        return found

    def _prepare(self, problem: Problem, load: Callable[[Variant, bytes], LoadedVariant] | None = None
                 ) -> LoadedVariant:
        """Choose, take the cubin from the store (NVRTC only on a miss), verify an untrusted
        choice unless its digest was verified before on this kind of GPU (through CuPy), load."""
        store = self.store
        choice = self.choose(problem)
        if choice.entry is None or choice.entry.key.shape != problem.shape_text:
            record(problem)  # no entry tuned for this exact problem: AUTOSOFT_RECORD notes it
        choice = _raced(choice, store)
        try:
            return _load_checked(choice, store, load)
        except RuntimeError as exc:
            if choice.fallback is None:
                raise
            _give_way(choice, exc, choice.fallback)
            return _load_checked(choice.fallback, store, load)


def _default_rival(family: Family, problem: Problem, target: Target, borrowed: Choice) -> Choice | None:
    """The family's heuristic default as a rival of a selector's pick and of a borrowed entry:
    a third guess, made from rules rather than other shapes; None where the default is what was
    borrowed already, or is not valid here."""
    if borrowed.entry is None:
        return None  # the borrowed choice is the default
    try:
        variant = build_variant(family, problem, family.default_params(problem, target), target)
    except UserError:
        return None
    return Choice(variant, DEFAULT_RIVAL, None, borrowed)


def _cupy_loaded() -> bool:
    return "cupy" in sys.modules


def _stream_capturing() -> bool:
    """Whether the current stream of torch or CuPy is capturing a CUDA graph: a race syncs the
    device, which would end the capture (a serving engine captures one graph per batch size)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return False
    try:
        return bool(cupy.cuda.get_current_stream().is_capturing())
    except cupy.cuda.runtime.CUDARuntimeError:  # no device or driver to ask: nothing is capturing
        return False


def _give_way(choice: Choice, exc: RuntimeError, instead: Choice) -> None:
    problem = choice.variant.problem
    warnings.warn(f"autosoft: {choice.source} for {problem.family} {problem.shape_text} {problem.dtype} "
                  f"failed ({exc}); using {instead.source} instead", CacheWarning, stacklevel=4)


def _raced(choice: Choice, store: KernelStore) -> Choice:
    """The fastest of the choice and its rivals on the choice's shape (module doc): the recorded
    winner of their race, else the winner of a race run now and recorded; the choice itself
    without rivals, where no race may run (module doc), or when the race cannot finish."""
    contenders = [choice]
    for rival in choice.rivals:  # one of each kernel: a rival may be the choice's kernel again
        if all(rival.variant.digest != c.variant.digest for c in contenders):
            contenders.append(rival)
    if len(contenders) == 1:
        return choice
    problem = choice.variant.problem
    variants = [c.variant for c in contenders]
    winner = store.race_winner(problem, variants)
    if winner is not None:
        return next(c for c in contenders if c.variant.digest == winner)
    family = get_family(problem.family)
    if _stream_capturing():  # no check may run: a kernel already verified serves (module doc)
        return next((c for c in contenders if c.trusted or store.is_verified(c.variant)), choice)
    if family.bytes_moved(problem) > RACE_MAX_BYTES:
        return choice  # not recorded: a later process, not capturing, races
    if not _cupy_loaded() and all(store.is_verified(v) for v in variants):
        return choice  # torch tensors and a warm store: CuPy, which a race times with, stays unloaded
    try:
        return _race(contenders, family, store)
    except (MemoryError, RuntimeError, UserError):
        return choice  # no room for the race's data, a device error or no CuPy: as if it had not run


def _race(contenders: list[Choice], family: Family, store: KernelStore) -> Choice:
    """_raced's race of [choice, *rivals]: each compiled and verified (one that fails is out),
    timed side by side, the winner recorded."""
    choice = contenders[0]
    ready: list[tuple[Choice, LoadedVariant]] = []
    for contender in contenders:
        try:
            cubin = _compile_or_fail(contender.variant, store)
            if not store.is_verified(contender.variant):
                _verify_on_shape(contender.variant, store)
                store.mark_verified(contender.variant)
        except RuntimeError as exc:
            if contender is choice:
                _give_way(choice, exc, contenders[1])
            continue  # out of the race
        ready.append((contender, LoadedVariant(contender.variant, cubin)))
    if len(ready) < 2:
        return ready[0][0] if ready else choice  # none: the choice fails again in _prepare, which says why
    times = race(family, [loaded for _, loaded in ready])
    if times is None:
        return choice  # no room on the device for the race's data: unrecorded, a later process races
    # the selector's pick and the default, to serve, must beat the borrowed choice by RACE_MARGIN
    scores = [t if contender.source.startswith((SELECTOR, DEFAULT_RIVAL)) else t * (1.0 - RACE_MARGIN)
              for t, (contender, _) in zip(times, ready)]
    fastest = ready[scores.index(min(scores))][0]
    store.record_race(choice.variant.problem, [c.variant for c in contenders], fastest.variant)
    return fastest


def _load_checked(choice: Choice, store: KernelStore,
                  load: Callable[[Variant, bytes], LoadedVariant] | None = None) -> LoadedVariant:
    """The choice's kernel, compiled on a store miss, verified first unless trusted or verified
    before, loaded by `load` (Dispatcher.loaded's)."""
    variant = choice.variant
    cubin = _compile_or_fail(variant, store)
    if not choice.trusted and not store.is_verified(variant):
        if _stream_capturing():
            problem = variant.problem
            raise UserError(f"autosoft: {problem.family} {problem.shape_text} {problem.dtype} is first called inside a "
                            f"CUDA graph capture, and its kernel ({choice.source}) is not yet verified on this GPU "
                            f"(the check would end the capture): call it once before capturing")
        _verify_on_shape(variant, store)
        store.mark_verified(variant)
    return (load or LoadedVariant)(variant, cubin)


def find_selector(selectors: list[Selector], key: CacheKey) -> Selector | None:
    """The selector that may serve `key`'s problem: same family, GPU, compute capability, NVRTC
    major and digests (the first such, a file loaded later first; the newest of one file)."""
    fitting = [s for s in selectors
               if (s.family, s.gpu_name, s.compute_capability, s.template_digest, s.space_digest)
               == (key.family, key.gpu_name, key.compute_capability, key.template_digest, key.space_digest)
               and _same_major(s.cuda_version, key.cuda_version)]
    return fitting[0] if fitting else None


def selector_pick(selector: Selector, family: Family, problem: Problem, target: Target, *,
                  first_only: bool) -> tuple[int, Variant] | None:
    """The configuration the selector's leaf for this shape ranks first, as (index, variant), when
    it is valid here. Where it is not (a row length the tuned shapes never had), the leaf's later
    configurations are those its shapes ran slower, often of another regime (one block per row
    where the first split rows): with first_only, None, so that the params of the nearest tuned
    shape serve instead; without it, the next valid configuration of the ranking."""
    ranking = selector.ranking(family.selector_features(problem))
    for index in ranking[:1] if first_only else ranking:
        try:
            return index, build_variant(family, problem, selector.configs[index], target)
        except UserError:
            continue  # invalid for this shape
    return None


def _compile_or_fail(variant: Variant, store: KernelStore) -> bytes:
    """The variant's cubin from the store, compiled on a miss; RuntimeError when it does not compile."""
    return store.get_or_compile(variant)  # CompileFailed is a RuntimeError naming the variant


def _verify_on_shape(variant: Variant, store: KernelStore) -> None:
    """Check an untuned choice on random data of this row length before it runs for real.

    The check runs at the family's verification shape, whose source (softmax: fewer rows of the
    same length) is the variant's own, so its cubin is the one already in the store."""
    family = get_family(variant.family)
    small = build_variant(family, family.verification_problem(variant.problem), variant.params, variant.target)
    wrong = verify(family, LoadedVariant(small, _compile_or_fail(small, store)), seed=1)
    if wrong:
        raise RuntimeError(f"autosoft: {variant.name} failed verification on shape {variant.problem.shape_text}: "
                           f"{wrong}; re-tune this shape with `autosoft tune`")


EXACT_NVRTC = "exact"
SAME_MAJOR = "same major"


def nvrtc_match(entry: CacheKey, key: CacheKey) -> str | None:
    """How an entry's key matches ours when shapes are set aside: EXACT_NVRTC when all of it does,
    SAME_MAJOR when only the NVRTC minor version differs (13.0 for 13.5), else None."""
    if replace(entry, shape=key.shape) == key:
        return EXACT_NVRTC
    if replace(entry, shape=key.shape, cuda_version=key.cuda_version) == key \
            and _same_major(entry.cuda_version, key.cuda_version):
        return SAME_MAJOR
    return None


def _source(entry: Entry, key: CacheKey, match: str) -> str:
    """Choice.source for an entry: tuned, nearest <shape>, and which NVRTC tuned it when not ours."""
    if entry.key.shape == key.shape:
        return TUNED if match == EXACT_NVRTC else f"{TUNED} with NVRTC {entry.key.cuda_version}"
    nearest = f"nearest {entry.key.shape}"
    return nearest if match == EXACT_NVRTC else f"{nearest}, tuned with NVRTC {entry.key.cuda_version}"


def _version(text: str) -> tuple[int, int] | None:
    """(major, minor) of an NVRTC version as keys write it ("13.0"); None for anything else."""
    found = _VERSION.match(text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _same_major(a: str, b: str) -> bool:
    va, vb = _version(a), _version(b)
    return va is not None and vb is not None and va[0] == vb[0]


def _minor_gap(a: str, b: str) -> int:
    """How far apart two versions of one major are (13.0 and 13.5: 5)."""
    va, vb = _version(a), _version(b)
    return abs(va[1] - vb[1]) if va and vb else 0


def cache_key(problem: Problem, device: DeviceInfo, family: Family | None = None) -> CacheKey:
    """The key a tuned variant for this problem is stored under (family: when not a registered one)."""
    family = family or get_family(problem.family)
    return CacheKey(problem.family, problem.dtype, problem.shape_text, device.name, device.compute_capability,
                    device.cuda_version, family_template_digest(family), space_of(family).digest)


def find_entry(cache: Cache | None, problem: Problem, path: Path) -> tuple[Entry, Target]:
    """The fastest current entry for a problem (this GPU's when one is present), and its target.

    Works without a GPU, so a kernel tuned elsewhere can be exported from any machine. Entries
    tuned with this NVRTC version come first, then those of its major version, then the rest
    (a .cu file is built by whatever nvcc the user has); without a loadable NVRTC, all alike."""
    family = get_family(problem.family)
    entries = [] if cache is None else [
        e for e in cache.entries()
        if (e.key.family, e.key.dtype, e.key.shape) == (problem.family, problem.dtype, problem.shape_text)
        and e.key.template_digest == family_template_digest(family) and e.key.space_digest == space_of(family).digest]
    try:
        here = device_info()
        entries = [e for e in entries if (e.key.gpu_name, e.key.compute_capability) == (here.name, here.compute_capability)]
    except UserError:
        here = None
    if not entries:
        on = f" on {here.name}" if here else ""
        raise UserError(f"no tuned {problem.family} {problem.shape_text} {problem.dtype}{on} in {path}; "
                        f"run `{problem.tune_command}` first")
    local = here.cuda_version if here else _local_nvrtc()
    best = min(entries, key=lambda e: (_nvrtc_rank(e.key.cuda_version, local), e.time_us))
    target = here.target if here else Target.for_arch(best.key.compute_capability)
    return best, target


def _local_nvrtc() -> str | None:
    try:
        return nvrtc_version()
    except UserError:
        return None  # no NVRTC here: every entry ranks alike


def _nvrtc_rank(version: str, local: str | None) -> int:
    if local is None or version == local:
        return 0
    return 1 if _same_major(version, local) else 2


def key_distance(family: Family, a: CacheKey, b: CacheKey) -> float:
    """The family's problem_distance between two keys' problems (shape and options, e.g. causal);
    infinite where either key's shape text is not a problem of this family."""
    try:
        pa, pb = family.parse_problem(a.shape, a.dtype), family.parse_problem(b.shape, b.dtype)
    except UserError:
        return math.inf
    return family.problem_distance(pa, pb)


DISPATCHER = Dispatcher()

