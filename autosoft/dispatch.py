"""From a call like autosoft.softmax(x) to a launch: pick the variant, keep it loaded, run it.

Choice, in order: the variant tuned for this exact problem on this GPU; else the variant
tuned for the nearest shape (same family, dtype, GPU and digests) whose params are valid
for this shape; else the family's heuristic default. A variant not tuned for this exact
shape is verified on this shape before its first use. Loaded variants are kept per
(family, dtype, shape, device), so repeated calls neither look up nor compile again.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .cache import Cache, CacheKey, Entry, default_cache_path
from .compile import compile_source
from .errors import UserError
from .evaluate import verify
from .families import get_family
from .families.base import Family, Problem, Target, Variant, build_variant, family_template_digest, space_of
from .runtime import DeviceInfo, LoadedVariant, device_info


@dataclass(frozen=True)
class Choice:
    variant: Variant
    source: str  # "tuned", "nearest <shape>" or "default"


class Dispatcher:
    """In-memory caches behind the public API: entries read from cache files, loaded variants."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # _prepare reads entries() while holding it
        self._extra_files: list[Path] = []
        self._entries: list[Entry] | None = None
        self._loaded: dict[tuple, LoadedVariant] = {}
        # the API's hot path: (array dtype, shape, device) -> launch(x_ptr, y_ptr, stream_ptr)
        self.fast: dict[tuple, Callable[..., None]] = {}

    # -- cache files --------------------------------------------------------------------
    def load_cache(self, path: str | Path) -> int:
        """Use the entries of a cache file (e.g. tuned on another machine); returns how many it holds."""
        cache = Cache(path, create=False)  # validates; never modifies the file
        count = len(cache.entries())
        with self._lock:
            self._extra_files.insert(0, cache.path)
            self._entries = None
            self._loaded.clear()
            self.fast.clear()
        return count

    def entries(self) -> list[Entry]:
        with self._lock:
            if self._entries is None:
                entries: list[Entry] = []
                for path in self._extra_files:
                    entries += Cache(path, create=False).entries()
                default = default_cache_path()
                if default.exists():
                    entries += Cache(default, create=False).entries()
                self._entries = entries
            return self._entries

    def forget(self) -> None:
        """Drop the in-memory caches (the files stay); the next call reads the files again."""
        with self._lock:
            self._entries = None
            self._loaded.clear()
            self.fast.clear()

    # -- choosing -----------------------------------------------------------------------
    def choose(self, problem: Problem) -> Choice:
        family = get_family(problem.family)
        target = device_info().target
        key = cache_key(problem, device_info())
        candidates = [e for e in self.entries() if e.key.same_except_shape(key)]
        exact = [e for e in candidates if e.key.shape == key.shape]
        if exact:
            best = min(exact, key=lambda e: e.time_us)
            return Choice(build_variant(family, problem, best.params, target), "tuned")
        distances = [(_shape_distance(family, e.key, key), i) for i, e in enumerate(candidates)]
        for _, i in sorted(d for d in distances if d[0] < math.inf):
            entry = candidates[i]
            try:
                variant = build_variant(family, problem, entry.params, target)
            except UserError:
                continue  # invalid for this shape
            return Choice(variant, f"nearest {entry.key.shape}")
        return Choice(build_variant(family, problem, family.default_params(problem, target), target), "default")

    def loaded(self, problem: Problem, device_index: int) -> LoadedVariant:
        key = (problem, device_index)
        found = self._loaded.get(key)
        if found is not None:
            return found
        with self._lock:
            found = self._loaded.get(key)
            if found is None:
                found = self._prepare(problem)
                self._loaded[key] = found
        return found

    def _prepare(self, problem: Problem) -> LoadedVariant:
        choice = self.choose(problem)
        variant = choice.variant
        cubin = _compile_or_fail(variant)
        if choice.source != "tuned":
            _verify_on_shape(variant)
        return LoadedVariant(variant, cubin)


def _compile_or_fail(variant: Variant) -> bytes:
    result = compile_source(variant.source, variant.target.arch)
    if not result.ok:
        raise RuntimeError(f"autosoft: {variant.name} does not compile: {result.log.splitlines()[0]}")
    return result.cubin


def _verify_on_shape(variant: Variant) -> None:
    """Check an untuned choice on random data of this row length before it runs for real."""
    family = get_family(variant.family)
    shape = family.verification_shape(variant.problem.shape)
    small = build_variant(family, replace(variant.problem, shape=shape), variant.params, variant.target)
    wrong = verify(family, LoadedVariant(small, _compile_or_fail(small)), seed=1)
    if wrong:
        raise RuntimeError(f"autosoft: {variant.name} failed verification on shape {variant.problem.shape_text}: "
                           f"{wrong}; re-tune this shape with `autosoft tune`")


def cache_key(problem: Problem, device: DeviceInfo, family: Family | None = None) -> CacheKey:
    """The key a tuned variant for this problem is stored under (family: when not a registered one)."""
    family = family or get_family(problem.family)
    return CacheKey(problem.family, problem.dtype, problem.shape_text, device.name, device.compute_capability,
                    device.cuda_version, family_template_digest(family), space_of(family).digest)


def find_entry(cache: Cache | None, problem: Problem, path: Path) -> tuple[Entry, Target]:
    """The fastest current entry for a problem (this GPU's when one is present), and its target.

    Works without a GPU, so a kernel tuned elsewhere can be exported from any machine."""
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
                        f"run `autosoft tune {problem.family} --shape {problem.shape_text} --dtype {problem.dtype}` first")
    best = min(entries, key=lambda e: e.time_us)
    target = here.target if here else Target.for_arch(best.key.compute_capability)
    return best, target


def _shape_distance(family: Family, a: CacheKey, b: CacheKey) -> float:
    """The family's distance between two keys' shapes; infinite across flags (e.g. causal)."""
    (dims_a, _, flags_a), (dims_b, _, flags_b) = a.shape.partition("+"), b.shape.partition("+")
    sa = tuple(int(s) for s in dims_a.split("x"))
    sb = tuple(int(s) for s in dims_b.split("x"))
    if len(sa) != len(sb) or flags_a != flags_b:
        return math.inf
    return family.shape_distance(sa, sb)


DISPATCHER = Dispatcher()

