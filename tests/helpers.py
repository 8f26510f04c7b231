"""Shared helpers of the test tiers: cache entries made by hand, running the CLI, finding CUDA tools,
compiling GPU variants together, choosing a pairwise covering of a search space."""
from __future__ import annotations

import heapq
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from autosoft.testing.compiling import compile_ahead, compiled, loaded_variants  # noqa: F401 - the GPU tests' names

REPO = Path(__file__).resolve().parent.parent


def softmax_key(shape: str = "4096x8192", dtype: str = "float32", **changes: str):
    """A cache key that the current softmax template and search space would produce."""
    from autosoft.cache import CacheKey
    from autosoft.families import get_family
    from autosoft.families.base import family_template_digest, space_of

    family = get_family("softmax")
    key = CacheKey("softmax", dtype, shape, "NVIDIA H200", "90", "13.0",
                   family_template_digest(family), space_of(family).digest)
    return replace(key, **changes)


def make_entry(key=None, time_us: float = 10.0, params: dict[str, Any] | None = None, **fields: Any):
    """An Entry for `key`; params default to the softmax heuristic default for the key's shape."""
    from autosoft.cache import Entry
    from autosoft.families import get_family
    from autosoft.families.base import Target

    key = key or softmax_key()
    if params is None:
        family = get_family("softmax")
        problem = family.problem(key.shape, key.dtype)
        params = family.default_params(problem, Target.for_arch(key.compute_capability))
    values = dict(variant_name="softmax_test_variant", params=params, source_digest="ab" * 32, time_us=time_us,
                  default_time_us=2 * time_us, copy_time_us=0.5 * time_us,
                  launches="softmax_rows grid=(1, 1, 1) block=(128, 1, 1) smem=0B",
                  autosoft_version="0.1.0", created=1_700_000_000.0)
    values.update(fields)
    return Entry(key=key, **values)


def make_selector(configs: list[dict[str, Any]], tree: Any = None, key=None, **fields: Any):
    """A softmax Selector fitted (so it says) for `key`'s GPU, NVRTC and digests; by default its
    tree is one leaf ranking the configurations in the order given."""
    from autosoft.selector import Leaf, Selector

    key = key or softmax_key()
    values = dict(family=key.family, gpu_name=key.gpu_name, compute_capability=key.compute_capability,
                  cuda_version=key.cuda_version, template_digest=key.template_digest, space_digest=key.space_digest,
                  configs=tuple(configs), features=("rows", "columns", "bytes_per_row", "dtype_size", "log"),
                  tree=tree if tree is not None else Leaf(tuple(range(len(configs)))),
                  shapes=("float32 256x512", "float32 512x1024", "float32 64x65536"),
                  autosoft_version="0.1.0", created=1_700_000_000.0)
    values.update(fields)
    return Selector(**values)


def cli_env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["AUTOSOFT_CACHE_DIR"] = str(cache_dir)
    return env


def run_cli(args: list[str], cache_dir: Path, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m autosoft ARGS` in a fresh process with its own AUTOSOFT_CACHE_DIR."""
    return subprocess.run([sys.executable, "-m", "autosoft", *args], env=cli_env(cache_dir), cwd=cwd or REPO,
                          capture_output=True, text=True, timeout=timeout)


def nvcc_path() -> str | None:
    return shutil.which("nvcc")


def cuda_tool(name: str) -> str | None:
    """A CUDA binary (cuobjdump, nvdisasm): on PATH, next to nvcc (following wrapper scripts), or in /usr/local/cuda*."""
    found = shutil.which(name)
    if found:
        return found
    candidates: list[Path] = []
    nvcc = nvcc_path()
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent)
        try:  # /usr/local/bin/nvcc is often a one-line `exec /usr/local/cuda-X/bin/nvcc "$@"` script
            text = Path(nvcc).read_text(errors="replace")[:4096]
            for word in text.split():
                if word.endswith("/nvcc"):
                    candidates.append(Path(word).parent)
        except OSError:
            pass
    candidates += sorted(Path("/usr/local").glob("cuda*/bin"))
    for folder in candidates:
        tool = folder / name
        if tool.is_file() and os.access(tool, os.X_OK):
            return str(tool)
    return None



def sample_points(family: Any, problem: Any, target: Any, k: int, seed: int,
                  seeds: int | None = None) -> list[dict[str, Any]]:
    """The default, its first `seeds` seeds (all with None) and k valid points drawn with a fixed
    seed, each once."""
    from autosoft.testing.conformance import sample_points

    return sample_points(family, problem, target, k, seed, seeds)


def wrong_samples(family: Any, problems: Sequence[Any], seed: int, seeds: int = 6, k: int = 2) -> list[str]:
    """Every problem's default, its first `seeds` seeds and k random points, compiled together
    and each verified on the GPU: the failures, one line each (none: all correct)."""
    from autosoft.evaluate import verify
    from autosoft.families.base import build_variant
    from autosoft.runtime import device_info

    target = device_info().target
    variants = [build_variant(family, problem, params, target) for i, problem in enumerate(problems)
                for params in sample_points(family, problem, target, k, seed=i, seeds=seeds)]
    failures = []
    for loaded in loaded_variants(variants):
        wrong = verify(family, loaded, seed=seed)
        if wrong:
            failures.append(f"{loaded.variant.name} {loaded.variant.problem.shape_text}: {wrong}")
    return failures


def _drop_permission_override() -> None:
    """In a child about to exec: take CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of its bounding
    set, so that the program it runs as root still meets file permissions (a read-only folder)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH (linux/capability.h)
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_cli_read_only_honoured(args: list[str], cache_dir: Path, cwd: Path | None = None,
                               timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """run_cli where read-only files and folders stay read-only for root too (the CPU tier runs as
    root in containers): the child runs without the capability that lets root write anywhere."""
    drop = _drop_permission_override if os.geteuid() == 0 else None
    return subprocess.run([sys.executable, "-m", "autosoft", *args], env={**cli_env(cache_dir), **env},
                          cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, preexec_fn=drop)


def loaded_variant(family: Any, problem: Any, params: dict[str, Any]) -> Any:
    """The family's variant at params, compiled with NVRTC for this GPU and loaded (the GPU tier)."""
    from autosoft.compile import compile_source
    from autosoft.families.base import build_variant
    from autosoft.runtime import LoadedVariant, device_info

    variant = build_variant(family, problem, params, device_info().target)
    result = compile_source(variant.source, variant.target.arch)
    assert result.ok, f"{variant.name}: {result.log[:2000]}"
    return LoadedVariant(variant, result.cubin)


def pairwise_cover(points: Sequence[dict[str, Any]], first: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """A pairwise covering of `points`: `first` (each once), then points chosen greedily until
    every pair of values of two parameters that appear together in some point of `points`
    appear together in a chosen one. Each step takes the point covering the most pairs not yet
    covered, the earliest on a tie (deterministic). Gains only shrink as pairs get covered, so a
    point's last computed gain bounds its gain now: only the heap's top is recomputed (lazy greedy,
    the same choices as recomputing every point each step)."""
    ids: dict[tuple[Any, ...], int] = {}

    def pairs(point: dict[str, Any]) -> set[int]:
        items = sorted((name, repr(value)) for name, value in point.items())  # repr: True is not 1
        return {ids.setdefault((a, b), len(ids)) for i, a in enumerate(items) for b in items[i + 1:]}

    chosen: list[dict[str, Any]] = []
    covered: set[int] = set()
    for point in first:
        if point not in chosen:
            chosen.append(point)
            covered |= pairs(point)
    candidates = [pairs(point) for point in points]
    heap = [(-len(c - covered), i) for i, c in enumerate(candidates)]
    heapq.heapify(heap)
    while heap:
        _, i = heapq.heappop(heap)
        gain = len(candidates[i] - covered)
        if gain == 0:
            continue  # nothing left for it: it is never chosen
        if heap and (-gain, i) > heap[0]:
            heapq.heappush(heap, (-gain, i))  # its bound was stale and another may gain more
            continue
        chosen.append(points[i])  # new pairs: not a point chosen before
        covered |= candidates[i]
    return chosen
