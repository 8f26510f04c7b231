"""NVRTC compilation to a cubin: the only place that builds kernels.

Works without a GPU (the CPU test tier and the compile pool use it): it talks to NVRTC
through CuPy's low-level binding, not through CuPy's driver-backed compiler. CuPy loads
libnvrtc on the binding's first call; when it is missing that call fails with a long
pathfinder report, which becomes one UserError saying which extra brings NVRTC.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import UserError
from .files import replace_text

COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17", "--use_fast_math")

# A source containing this line uses instructions of one architecture only (Hopper's wgmma and
# setmaxnreg exist on sm_90a, not on sm_90 nor later GPUs): it is compiled for sm_<arch>a. The
# mark is part of the source, so the source digest already tells the two targets apart.
ARCH_SPECIFIC = "// autosoft: arch-specific target"

# ptxas messages that mean a Hopper kernel would silently run far below what it was written for:
# setmaxnreg ignored (C7508), an injected warpgroup.arrive (C7519), and every "Potential
# Performance Loss: wgmma.mma_async instructions are serialized due to ..." whatever the cause,
# each with a code of its own: a wait it had to inject (C7517, C7520), too few registers for the
# pipeline (C7511), accumulators defined by other instructions inside a pipeline stage (C7515).
REJECTED_PTXAS_WARNINGS = re.compile(r"C75(08|17|19|20)|wgmma\.mma_async instructions are serialized")


@dataclass(frozen=True)
class CompileResult:
    ok: bool
    cubin: bytes
    log: str


@lru_cache(maxsize=1)  # a failure raises, so only a loaded NVRTC's version is remembered
def nvrtc_version() -> str:
    """The local NVRTC's version, e.g. "13.0": part of every variant digest and cache key.

    Loading NVRTC to ask it costs a warm first call more than anything else it does (the
    bindings' import and cuda-pathfinder's search), so a process that has not loaded it reads the
    version that a process of the same environment recorded beside the kernel store, as long as
    the library that process loaded is still the same file (NVRTC_RECORD). Otherwise NVRTC is
    asked, through cuda-bindings where installed (CuPy's binding would import CuPy; both find
    the same library through cuda-pathfinder), and the answer is recorded. Cached per process."""
    recorded = _recorded_nvrtc_version()
    if recorded is not None:
        return recorded
    found = _bindings_nvrtc_version()
    major, minor = found if found is not None else _nvrtc().getVersion()
    version = f"{major}.{minor}"
    _record_nvrtc_version(version)
    return version


# Beside the kernel store: per environment (what decides which libnvrtc cuda-pathfinder finds),
# the library a process loaded, its size and modification time, and its version.
NVRTC_RECORD = "nvrtc-version.json"


def _environment_key() -> str:
    """What decides which libnvrtc this process would load: the interpreter's prefix, its
    package folders and whether an `nvidia` package folder in them changed (a wheel installed or
    removed), and the variables cuda-pathfinder and the dynamic linker read."""
    folders = []
    for entry in sys.path[1:]:
        if entry.endswith(("site-packages", "dist-packages")):
            try:
                changed = os.stat(os.path.join(entry, "nvidia")).st_mtime_ns
            except OSError:
                changed = 0
            folders.append(f"{entry}:{changed}")
    variables = [f"{name}={os.environ.get(name, '')}" for name in
                 ("CONDA_PREFIX", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH")]
    return hashlib.sha256("\0".join([sys.prefix, *folders, *variables]).encode()).hexdigest()[:24]


def _record_path() -> Path:
    from .cache import default_store_folder  # the cache module (sqlite3, the selector) only when asked

    return default_store_folder() / NVRTC_RECORD


def _recorded_nvrtc_version() -> str | None:
    """The version recorded for this environment, if the library it names is unchanged."""
    try:
        entry = json.loads(_record_path().read_text())[_environment_key()]
        now = os.stat(entry["library"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (now.st_size, now.st_mtime_ns) != (entry.get("size"), entry.get("mtime_ns")):
        return None
    version = entry.get("version")
    return version if isinstance(version, str) and re.fullmatch(r"\d+\.\d+", version) else None


def _record_nvrtc_version(version: str) -> None:
    """Record the version beside the kernel store, with the libnvrtc this process loaded (read
    from the process's memory map, so Linux only). A folder that cannot be written is no error:
    the next process asks NVRTC again."""
    library = _loaded_nvrtc_library()
    if library is None:
        return
    path = _record_path()
    try:
        stat = os.stat(library)
        try:
            records = json.loads(path.read_text())
            records = records if isinstance(records, dict) else {}
        except (OSError, ValueError):
            records = {}
        records[_environment_key()] = {"library": library, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                                       "version": version}
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_text(path, json.dumps(records, indent=1, sort_keys=True))
    except OSError:
        return


def _loaded_nvrtc_library() -> str | None:
    """The libnvrtc file this process has loaded (not its builtins library), if any."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libnvrtc.so") or name.startswith("libnvrtc64_"):
                    return path
    except OSError:
        return None
    return None


def _bindings_nvrtc_version() -> tuple[int, int] | None:
    """(major, minor) from cuda-bindings' NVRTC; None where it is not installed or finds no
    libnvrtc (CuPy's binding then says what to install)."""
    try:
        from cuda.bindings import nvrtc

        status, major, minor = nvrtc.nvrtcVersion()
    except Exception:  # noqa: BLE001 - not installed, or cuda-pathfinder's error for a missing library
        return None
    return (int(major), int(minor)) if status == nvrtc.nvrtcResult.NVRTC_SUCCESS else None


def arch_option(arch: str, source: str = "") -> str:
    """NVRTC's target option: sm_<arch>, or sm_<arch>a for a source with the ARCH_SPECIFIC mark."""
    return f"--gpu-architecture=sm_{arch}{'a' if ARCH_SPECIFIC in source else ''}"


def compile_options(source: str, arch: str) -> tuple[str, ...]:
    """Every NVRTC option a source is compiled with: its target, then COMPILE_OPTIONS."""
    return (arch_option(arch, source), *COMPILE_OPTIONS)


def nvcc_command(source: str, arch: str, file: str = "<this file>") -> str:
    """The nvcc command that builds `source` as NVRTC does: the same options, and for a source with
    the ARCH_SPECIFIC mark its sm_<arch>a cubin alone (-arch=sm_90a would also embed compute_90 PTX,
    which cannot hold those instructions, and ptxas fails)."""
    target = f"-gencode=arch=compute_{arch}a,code=sm_{arch}a" if ARCH_SPECIFIC in source else f"-arch=sm_{arch}"
    return " ".join(("nvcc", "-c", target, *COMPILE_OPTIONS, file))


def build_lines(source: str, arch: str) -> list[str]:
    """What `render` and `export` print with a source (as comment lines): how to build it."""
    return [f"build: {nvcc_command(source, arch)}", f"NVRTC options: {' '.join(compile_options(source, arch))}"]


def source_digest(source: str, arch: str, nvrtc: str | None = None) -> str:
    """Hash of what the compiler sees: source, options, target and compiler version (this
    machine's NVRTC, or `nvrtc` to recompute an entry's digest as another machine wrote it)."""
    h = hashlib.sha256()
    for part in (source, " ".join(COMPILE_OPTIONS), arch, nvrtc or nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_source(source: str, arch: str, name: str = "kernel.cu") -> CompileResult:
    """Compile CUDA source to a cubin for sm_<arch> (sm_<arch>a for a source with the
    ARCH_SPECIFIC mark, which also fails on the REJECTED_PTXAS_WARNINGS). Failures are returned,
    not raised."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(compile_options(source, arch)))
        except nvrtc.NVRTCError as exc:
            return CompileResult(False, b"", f"{exc}\n{nvrtc.getProgramLog(prog)}".strip())
        log = nvrtc.getProgramLog(prog)
        if ARCH_SPECIFIC in source and REJECTED_PTXAS_WARNINGS.search(log):
            return CompileResult(False, b"", f"rejected: ptxas would run this kernel degraded\n{log}".strip())
        return CompileResult(True, nvrtc.getCUBIN(prog), log)
    finally:
        nvrtc.destroyProgram(prog)


@lru_cache(maxsize=1)  # a failure raises, so the probe runs again until libnvrtc loads
def _nvrtc() -> Any:
    """CuPy's NVRTC binding with libnvrtc loaded, or a one-line UserError saying what to install."""
    nvrtc = _binding()
    try:
        major, minor = nvrtc.getVersion()  # the first call loads libnvrtc: a missing library fails here
    except (RuntimeError, OSError, ImportError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
        found = re.search(r"libnvrtc[\w.]*", str(exc))
        library = found.group(0) if found else "libnvrtc"
        raise UserError(f"NVRTC ({library}) could not be loaded: {_install_hint()}") from None
    if _recorded_nvrtc_version() not in (None, f"{major}.{minor}"):
        _record_nvrtc_version(f"{major}.{minor}")  # the record was wrong: the next process reads the truth
    return nvrtc


def _binding() -> Any:
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise UserError(
            "CuPy is not installed: pip install 'autosoft[cuda13]' (or [cuda12]) on a CUDA machine"
        ) from exc
    return nvrtc


def _install_hint() -> str:
    """What brings NVRTC: the extra matching the installed CuPy wheel, else both."""
    from importlib import metadata

    for major in ("13", "12"):
        try:
            metadata.version(f"cupy-cuda{major}x")
        except metadata.PackageNotFoundError:
            continue
        return f"pip install 'autosoft[cuda{major}]' (it brings NVRTC for CUDA {major})"
    return "pip install 'autosoft[cuda13]' (CUDA 13 driver) or 'autosoft[cuda12]' (CUDA 12), which bring NVRTC"
