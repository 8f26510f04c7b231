"""The CUDA driver itself (libcuda, through ctypes): how torch tensors reach autosoft's kernels
without CuPy and without importing any binding.

A torch process has libcuda loaded already; ctypes opens that same library, so a warm first call
imports no binding (importing cuda-bindings' driver module, let alone CuPy, was most of it) and a
launch is one foreign call with its arguments typed once. This module loads a stored cubin into
the device's primary context (the one torch and CuPy share), sets each kernel's attributes once,
reads the device's properties and launches. runtime.LoadedVariant keeps the argument slots and
launches through `LibcudaDriver.bound_launch` on torch's current stream (runtime.CupyDriver is its
counterpart through CuPy, which CuPy arrays, the tuner and the verification use).

Nothing here is loaded by `import autosoft`; every function raises NoDeviceError where no driver
library or no device is found, DriverError where the driver refuses a call.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from functools import lru_cache
from typing import Any, Iterator

from .errors import NoDeviceError

# CUdevice_attribute values (cuda.h), which the driver's ABI keeps fixed
_ATTRIBUTES = {"sm_count": 16, "l2_bytes": 38, "major": 75, "minor": 76, "smem_optin": 97}
_LIBRARY = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
_P, _U, _I = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
# the functions used, with their argument types; a name with _v2 is what cuda.h maps the plain
# name to (the plain symbol is the old ABI)
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (_U,),
    "cuDeviceGetCount": (ctypes.POINTER(_I),),
    "cuDeviceGet": (ctypes.POINTER(_I), _I),
    "cuDeviceGetName": (ctypes.c_char_p, _I, _I),
    "cuDeviceGetAttribute": (ctypes.POINTER(_I), _I, _I),
    "cuDevicePrimaryCtxRetain": (ctypes.POINTER(_P), _I),
    "cuCtxGetCurrent": (ctypes.POINTER(_P),),
    "cuCtxSetCurrent": (_P,),
    "cuCtxGetDevice": (ctypes.POINTER(_I),),
    "cuCtxPushCurrent_v2": (_P,),
    "cuCtxPopCurrent_v2": (ctypes.POINTER(_P),),
    "cuModuleLoadData": (ctypes.POINTER(_P), ctypes.c_char_p),
    "cuModuleGetFunction": (ctypes.POINTER(_P), _P, ctypes.c_char_p),
    "cuFuncSetAttribute": (_P, _I, _I),
    "cuLaunchKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P, _P),
    "cuLaunchCooperativeKernel": (_P, _U, _U, _U, _U, _U, _U, _U, _P, _P),
    "cuGetErrorName": (_I, ctypes.POINTER(ctypes.c_char_p)),
    # a TMA descriptor (runtime.encode_tensor_map): map, dtype, rank, address, sizes, strides,
    # box, element strides, interleave, swizzle, L2 promotion, out-of-bounds fill
    "cuTensorMapEncodeTiled": (_P, _I, ctypes.c_uint32, _P, _P, _P, _P, _P, _I, _I, _I, _I),
}


class DriverError(RuntimeError):
    """A CUDA driver call that failed; `code` is its CUresult (an int)."""

    def __init__(self, call: str, code: Any) -> None:
        self.code = int(code)
        super().__init__(f"{call}: {_error_name(self.code)}")


@lru_cache(maxsize=1)  # a failure raises, so only a working driver is remembered
def cu() -> Any:
    """libcuda with every function used typed, initialised; NoDeviceError saying what to do where
    there is no driver library or cuInit fails."""
    library = _library()
    if library is None:
        raise NoDeviceError(f"no CUDA driver ({_LIBRARY} not found): run this on a machine with an NVIDIA GPU "
                            "and its driver")
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, _I
    status = library.cuInit(0)
    if status != 0:
        raise NoDeviceError(f"no CUDA device: cuInit: {_error_name(status)}; run this on a machine with an NVIDIA GPU")
    return library


@lru_cache(maxsize=1)
def _library() -> Any:
    """The driver library (the one torch and CuPy loaded: the dynamic linker hands back the same
    handle), or None where it is not installed."""
    try:
        return ctypes.CDLL(_LIBRARY)
    except OSError:
        return None


def available() -> bool:
    """Whether the driver library can be opened (a device is not asked for)."""
    return _library() is not None


def check(call: str, status: int) -> None:
    """DriverError unless a driver call's status is CUDA_SUCCESS."""
    if status != 0:
        raise DriverError(call, status)


def _out(kind: Any, call: str, function: Any, *args: Any) -> Any:
    """The value a driver call writes through its first (pointer) argument."""
    value = kind()
    check(call, function(ctypes.byref(value), *args))
    return value.value


# -- devices and contexts ----------------------------------------------------------------------
def device_count() -> int:
    return int(_out(_I, "cuDeviceGetCount", cu().cuDeviceGetCount))


def current_device() -> int:
    """The device of this thread's current context (the one torch.cuda.device or CuPy's Device
    made current); 0 where none is current, as the CUDA runtime answers."""
    library = cu()
    if not _out(_P, "cuCtxGetCurrent", library.cuCtxGetCurrent):
        return 0
    return int(_out(_I, "cuCtxGetDevice", library.cuCtxGetDevice))


_contexts: dict[int, int] = {}
_contexts_lock = threading.Lock()


def primary_context(device: int) -> int:
    """The device's primary context, retained for the process: the context torch and CuPy use."""
    found = _contexts.get(device)
    if found is None:
        library = cu()
        with _contexts_lock:
            found = _contexts.get(device)
            if found is None:
                handle = _out(_I, "cuDeviceGet", library.cuDeviceGet, device)
                found = _contexts[device] = _out(_P, "cuDevicePrimaryCtxRetain", library.cuDevicePrimaryCtxRetain,
                                                 handle)
    return found


def is_current(device: int) -> bool:
    """Whether the device's primary context is this thread's current one."""
    current = _out(_P, "cuCtxGetCurrent", cu().cuCtxGetCurrent)
    return bool(current) and current == primary_context(device)


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make the device's primary context current for the block. Where another context was
    current, the thread gets it back afterwards (torch reads its current device from it); where
    none was, ours stays, as the CUDA runtime's first call on a thread would leave it."""
    library = cu()
    context = primary_context(device)
    if not _out(_P, "cuCtxGetCurrent", library.cuCtxGetCurrent):
        check("cuCtxSetCurrent", library.cuCtxSetCurrent(context))
        yield
        return
    check("cuCtxPushCurrent", library.cuCtxPushCurrent_v2(context))
    try:
        yield
    finally:
        _out(_P, "cuCtxPopCurrent", library.cuCtxPopCurrent_v2)


def device_properties(device: int) -> dict[str, Any]:
    """name, major, minor, sm_count, smem_optin and l2_bytes of a device, from the driver."""
    library = cu()
    handle = _out(_I, "cuDeviceGet", library.cuDeviceGet, device)
    name = ctypes.create_string_buffer(256)
    check("cuDeviceGetName", library.cuDeviceGetName(name, len(name), handle))
    properties: dict[str, Any] = {"name": name.value.decode(errors="replace").strip()}
    for key, attribute in _ATTRIBUTES.items():
        properties[key] = int(_out(_I, "cuDeviceGetAttribute", library.cuDeviceGetAttribute, attribute, handle))
    return properties


# -- modules, functions, launches ---------------------------------------------------------------
class LibcudaDriver:
    """runtime.LoadedVariant's driver through libcuda (see runtime.DriverBackend, whose methods
    these are): modules loaded into the device's primary context, launches on any stream of that
    device."""

    name = "libcuda"
    error: type[Exception] = DriverError
    launch_ok = 0  # what launch_kernel returns on success (CUDA_SUCCESS)

    def __init__(self) -> None:
        self.launch_kernel = cu().cuLaunchKernel  # typed: takes ints
        # The same function without argument types, for bound_launch: it is handed ctypes objects
        # made once, which ctypes passes as they are (no conversion per argument and call).
        untyped = ctypes.CDLL(_LIBRARY).cuLaunchKernel
        untyped.restype = _I
        self._launch_untyped = untyped

    def bound_launch(self, function: int, geometry: tuple[int, ...], params: int) -> Any:
        """start(stream) launches `function` with this geometry and argument array on the stream
        (an int), returning the CUresult."""
        launch = self._launch_untyped
        handle, arguments = _P(function), _P(params)
        gx, gy, gz, bx, by, bz, smem = (_U(v) for v in geometry)
        streams: dict[int, Any] = {}  # the handles a plan meets are few: each wrapped once

        def start(stream: int) -> int:
            wrapped = streams.get(stream)
            if wrapped is None:
                if len(streams) >= 64:
                    streams.clear()
                wrapped = streams[stream] = _P(stream)
            return launch(handle, gx, gy, gz, bx, by, bz, smem, wrapped, arguments, None)
        return start

    def load(self, cubin: bytes, device: int) -> int:
        with on_device(device):
            return _out(_P, "cuModuleLoadData", cu().cuModuleLoadData, cubin)

    def function(self, module: int, kernel: str) -> tuple[int, int]:
        """(the handle launch_kernel takes, its address as an int) of a kernel of the module: both
        the CUfunction's address."""
        function = _out(_P, "cuModuleGetFunction", cu().cuModuleGetFunction, module, kernel.encode())
        return function, function

    def set_attribute(self, function: int, attribute: int, value: int) -> None:
        check("cuFuncSetAttribute", cu().cuFuncSetAttribute(function, attribute, value))

    def failed(self, call: str, status: int) -> Exception:
        """The error for what launch_kernel returned when it was not launch_ok."""
        return DriverError(call, status)

    def launch_cooperative(self, function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                           stream: int, params: int) -> None:
        check("cuLaunchCooperativeKernel",
              cu().cuLaunchCooperativeKernel(function, gx, gy, gz, bx, by, bz, smem, stream, params))

    def current_device(self) -> int:
        return current_device()

    def is_current(self, device: int) -> bool:
        return is_current(device)

    def on_device(self, device: int) -> contextlib.AbstractContextManager[None]:
        return on_device(device)

    def zeros(self, nbytes: int, device: int) -> tuple[Any, int]:
        """Zeroed device memory for a workspace, from torch on its current stream (the stream the
        plan launches on), which also makes it part of a CUDA graph being captured there."""
        import torch  # loaded: this driver serves torch tensors

        held = torch.zeros(nbytes, dtype=torch.uint8, device=torch.device("cuda", device))
        return held, held.data_ptr()


@lru_cache(maxsize=1)
def libcuda() -> LibcudaDriver:
    """The one LibcudaDriver of the process (NoDeviceError without a driver or a device)."""
    return LibcudaDriver()


def _error_name(status: int) -> str:
    """CUDA_ERROR_... for a CUresult, from the driver where it can name it."""
    library = _library()
    name = ctypes.c_char_p()
    if library is not None and library.cuGetErrorName(int(status), ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {int(status)}"
