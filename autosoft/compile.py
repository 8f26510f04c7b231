"""NVRTC compilation to a cubin: the only place that builds kernels.

Works without a GPU (the CPU test tier and the compile pool use it): it talks to NVRTC
through CuPy's low-level binding, not through CuPy's driver-backed compiler.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import UserError

COMPILE_OPTIONS: tuple[str, ...] = ("-std=c++17", "--use_fast_math")


@dataclass(frozen=True)
class CompileResult:
    ok: bool
    cubin: bytes
    log: str


def nvrtc_version() -> str:
    nvrtc = _nvrtc()
    major, minor = nvrtc.getVersion()
    return f"{major}.{minor}"


def arch_option(arch: str) -> str:
    return f"--gpu-architecture=sm_{arch}"


def source_digest(source: str, arch: str) -> str:
    """Hash of what the compiler sees: source, options, target and compiler version."""
    h = hashlib.sha256()
    for part in (source, " ".join(COMPILE_OPTIONS), arch, nvrtc_version()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def compile_source(source: str, arch: str, name: str = "kernel.cu") -> CompileResult:
    """Compile CUDA source to a cubin for sm_<arch>. Failures are returned, not raised."""
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [arch_option(arch), *COMPILE_OPTIONS])
        except nvrtc.NVRTCError as exc:
            return CompileResult(False, b"", f"{exc}\n{nvrtc.getProgramLog(prog)}".strip())
        return CompileResult(True, nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog))
    finally:
        nvrtc.destroyProgram(prog)


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise UserError(
            "CuPy is not installed: pip install 'autosoft[cuda13]' (or [cuda12]) on a CUDA machine"
        ) from exc
    return nvrtc
