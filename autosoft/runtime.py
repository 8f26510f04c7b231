"""The GPU side: which device we are on, loading a compiled variant, launching it.

Everything that needs a CUDA driver lives here, so the rest of the package imports without one.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from .errors import NoDeviceError
from .families.base import Target, Variant

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@lru_cache(maxsize=1)  # a failure raises, so only a working CuPy is remembered
def cupy_module() -> Any:
    """CuPy with a working CUDA device, or a NoDeviceError that says what to do."""
    try:
        import cupy
    except ImportError:
        raise NoDeviceError(
            "CuPy is not installed: pip install 'autosoft[cuda13]' (CUDA 13 driver) or 'autosoft[cuda12]'"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError without a driver
        raise NoDeviceError(f"no CUDA device: {_one_line(exc)}; run this on a machine with an NVIDIA GPU") from None
    if count < 1:
        raise NoDeviceError("no CUDA device found; run this on a machine with an NVIDIA GPU")
    return cupy


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    target: Target
    cuda_version: str  # NVRTC version that builds the kernels, e.g. "13.0"

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def compute_capability(self) -> str:
        return self.target.arch


@lru_cache(maxsize=None)
def device_info(index: int | None = None) -> DeviceInfo:
    cp = cupy_module()
    from .compile import nvrtc_version

    index = cp.cuda.runtime.getDevice() if index is None else index
    props = cp.cuda.runtime.getDeviceProperties(index)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    arch = f"{props['major']}{props['minor']}"
    target = Target(
        arch=arch,
        name=name,
        sm_count=int(props["multiProcessorCount"]),
        smem_optin=int(props.get("sharedMemPerBlockOptin", 48 * 1024)),
        l2_bytes=int(props.get("l2CacheSize", 50 * 1024 * 1024)),
    )
    return DeviceInfo(index, target, nvrtc_version())


class LoadedVariant:
    """A variant's cubin loaded into the current context, ready to launch."""

    def __init__(self, variant: Variant, cubin: bytes):
        cp = cupy_module()
        self.variant = variant
        self._module = cp.cuda.function.Module()
        self._module.load(cubin)
        self._functions = {}
        for launch in variant.launches:
            fn = self._module.get_function(launch.kernel)
            if launch.shared_mem > 48 * 1024:
                cp.cuda.driver.funcSetAttribute(fn.ptr, _MAX_DYNAMIC_SHARED, launch.shared_mem)
            self._functions[launch.kernel] = fn
        self._workspace = None

    def workspace(self) -> Any:
        if self.variant.workspace_bytes and self._workspace is None:
            self._workspace = cupy_module().empty(self.variant.workspace_bytes, dtype="uint8")
        return self._workspace

    def launch(self, buffers: Mapping[str, Any], stream: Any = None) -> None:
        """Run every launch of the variant. Buffers: name -> CuPy array or raw device pointer (int)."""
        ws = self.workspace()
        for launch in self.variant.launches:
            args = tuple(_arg(a, buffers, ws) for a in launch.args)
            self._functions[launch.kernel](launch.grid, launch.block, args,
                                           shared_mem=launch.shared_mem, stream=stream)


def _arg(spec: Any, buffers: Mapping[str, Any], workspace: Any) -> Any:
    if not isinstance(spec, str):
        return spec
    value = workspace if spec == "workspace" else buffers[spec]
    if isinstance(value, int):
        import numpy as np

        return np.uint64(value)
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
