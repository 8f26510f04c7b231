"""Variants compiled together for the GPU tests (the project's and a family author's conformance
run): a pool of min(16, CPUs) threads shared by the whole run, since CuPy's NVRTC binding releases
the GIL while it compiles, and each source compiled once per run, kept by (source digest, arch)."""
from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Any, Iterator, Sequence

# What this process has compiled or is compiling, by (source digest, arch): a variant several GPU
# tests check (a default, a seed) compiles once per run.
_COMPILED: dict[tuple[str, str], cf.Future] = {}
_POOL: list[cf.ThreadPoolExecutor] = []


def _submitted(variants: Sequence[Any]) -> list[cf.Future]:
    """Each variant's compilation, in order: those not yet asked for this run go to a pool of
    min(16, CPUs) threads, shared by the whole run (CuPy's NVRTC binding releases the GIL while
    it compiles, so they compile in parallel)."""
    from ..compile import compile_source

    if not _POOL:
        _POOL.append(cf.ThreadPoolExecutor(min(16, os.cpu_count() or 1), thread_name_prefix="nvrtc"))
    futures = []
    for variant in variants:
        key = (variant.digest, variant.target.arch)
        if key not in _COMPILED:
            _COMPILED[key] = _POOL[0].submit(compile_source, variant.source, variant.target.arch)
        futures.append(_COMPILED[key])
    return futures


def compile_ahead(variants: Sequence[Any]) -> None:
    """Start compiling the variants in the pool without waiting: a test parametrised over several
    problems hands over all of them on its first call, and each call then takes its own."""
    _submitted(variants)


def compiled(variants: Sequence[Any]) -> list[Any]:
    """Each variant's NVRTC CompileResult, in order, the variants compiled together in the pool;
    every result is kept by (source digest, arch) for the whole run."""
    return [future.result() for future in _submitted(variants)]


def loaded_variants(variants: Sequence[Any]) -> Iterator[Any]:
    """The variants compiled together (as `compiled` does), each loaded as soon as its own
    compilation ends and the caller asks for it: the test verifies one variant on the GPU while
    the pool compiles the next ones. A variant that does not compile fails the test."""
    from ..runtime import LoadedVariant

    for variant, future in zip(variants, _submitted(variants)):
        result = future.result()
        assert result.ok, f"{variant.name}: {result.log[:2000]}"
        yield LoadedVariant(variant, result.cubin)
