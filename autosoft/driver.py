"""The CUDA driver through cuda-bindings (NVIDIA's maintained Python bindings, `cuda.bindings.driver`):
how torch tensors reach autosoft's kernels without CuPy.

torch depends on cuda-bindings and imports it, so for a torch user this costs no import; CuPy
costs about a hundred milliseconds, most of a warm first call. This module loads a stored cubin
into the device's primary context (the one torch and CuPy share), sets each kernel's attributes
once, reads the device's properties and launches. runtime.LoadedVariant keeps the argument
slots and calls `BINDINGS.launch_kernel` on torch's current stream (runtime.DriverBackend is its
counterpart through CuPy, which CuPy arrays, the tuner and the verification use).

Nothing here is imported by `import autosoft`; every function raises NoDeviceError where the
bindings or a driver are missing, DriverError where the driver refuses a call.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from functools import lru_cache
from typing import Any, Iterator

from .errors import NoDeviceError, one_line


class DriverError(RuntimeError):
    """A CUDA driver call that failed; `code` is its CUresult (an int)."""

    def __init__(self, call: str, code: Any) -> None:
        self.code = int(code)
        super().__init__(f"{call}: {_error_name(code)}")


@lru_cache(maxsize=1)  # a failure raises, so only working bindings are remembered
def cu() -> Any:
    """cuda.bindings.driver with the driver initialised, or a NoDeviceError that says what to do."""
    try:
        from cuda.bindings import driver
    except ImportError:
        raise NoDeviceError("cuda-bindings is not installed: pip install 'autosoft[cuda13]' (CUDA 13 driver) "
                            "or 'autosoft[cuda12]'") from None
    try:
        status, = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001 - the bindings raise when libcuda cannot be loaded
        raise NoDeviceError(f"no CUDA device: {one_line(exc)}; run this on a machine with an NVIDIA GPU") from None
    if status != driver.CUresult.CUDA_SUCCESS:
        raise NoDeviceError(f"no CUDA device: cuInit: {_error_name(status)}; run this on a machine with an NVIDIA GPU")
    return driver


def available() -> bool:
    """Whether cuda-bindings can be imported (a driver and a device are not asked for)."""
    if "cuda.bindings.driver" in sys.modules:
        return True
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return False
    return True


def check(call: str, result: tuple[Any, ...]) -> Any:
    """The value of a bindings call's (CUresult, value...) result; DriverError unless it succeeded."""
    status = result[0]
    if status != 0:
        raise DriverError(call, status)
    return result[1] if len(result) == 2 else result[1:] if len(result) > 2 else None


# -- devices and contexts ----------------------------------------------------------------------
def device_count() -> int:
    return int(check("cuDeviceGetCount", cu().cuDeviceGetCount()))


def current_device() -> int:
    """The device of this thread's current context (the one torch.cuda.device or CuPy's Device
    made current); 0 where none is current, as the CUDA runtime answers."""
    driver = cu()
    context = check("cuCtxGetCurrent", driver.cuCtxGetCurrent())
    if context is None or int(context) == 0:
        return 0
    return int(check("cuCtxGetDevice", driver.cuCtxGetDevice()))


_contexts: dict[int, Any] = {}
_contexts_lock = threading.Lock()


def primary_context(device: int) -> Any:
    """The device's primary context, retained for the process: the context torch and CuPy use."""
    found = _contexts.get(device)
    if found is None:
        driver = cu()
        with _contexts_lock:
            found = _contexts.get(device)
            if found is None:
                handle = check("cuDeviceGet", driver.cuDeviceGet(device))
                found = _contexts[device] = check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(handle))
    return found


def is_current(device: int) -> bool:
    """Whether the device's primary context is this thread's current one."""
    context = check("cuCtxGetCurrent", cu().cuCtxGetCurrent())
    return context is not None and int(context) == int(primary_context(device))


@contextlib.contextmanager
def on_device(device: int) -> Iterator[None]:
    """Make the device's primary context current for the block. Where another context was
    current, the thread gets it back afterwards (torch reads its current device from it); where
    none was, ours stays, as the CUDA runtime's first call on a thread would leave it."""
    driver = cu()
    context = primary_context(device)
    current = check("cuCtxGetCurrent", driver.cuCtxGetCurrent())
    if current is None or int(current) == 0:
        check("cuCtxSetCurrent", driver.cuCtxSetCurrent(context))
        yield
        return
    check("cuCtxPushCurrent", driver.cuCtxPushCurrent(context))
    try:
        yield
    finally:
        check("cuCtxPopCurrent", driver.cuCtxPopCurrent())


def device_properties(device: int) -> dict[str, Any]:
    """name, major, minor, sm_count, smem_optin and l2_bytes of a device, from the driver."""
    driver = cu()
    handle = check("cuDeviceGet", driver.cuDeviceGet(device))
    attribute = driver.CUdevice_attribute

    def get(name: str) -> int:
        return int(check("cuDeviceGetAttribute", driver.cuDeviceGetAttribute(getattr(attribute, name), handle)))

    name = check("cuDeviceGetName", driver.cuDeviceGetName(256, handle))
    return {
        "name": (name.split(b"\0", 1)[0].decode() if isinstance(name, bytes) else str(name)).strip(),
        "major": get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR"),
        "minor": get("CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR"),
        "sm_count": get("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
        "smem_optin": get("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"),
        "l2_bytes": get("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE"),
    }


# -- modules, functions, launches ---------------------------------------------------------------
class Bindings:
    """runtime.LoadedVariant's driver through cuda-bindings (see runtime.DriverBackend, whose
    methods these are): modules loaded into the device's primary context, launches on any
    stream of that device."""

    name = "cuda-bindings"
    error = DriverError

    def __init__(self) -> None:
        driver = cu()
        # the launch itself: the bindings' function, called directly (no wrapper on the hot path);
        # it returns launch_ok on success
        self.launch_kernel = driver.cuLaunchKernel
        self.launch_ok = (driver.CUresult.CUDA_SUCCESS,)

    def load(self, cubin: bytes, device: int) -> Any:
        with on_device(device):
            return check("cuModuleLoadData", cu().cuModuleLoadData(cubin))

    def function(self, module: Any, kernel: str) -> tuple[Any, int]:
        """(the handle launch_kernel takes, its address as an int) of a kernel of the module."""
        function = check("cuModuleGetFunction", cu().cuModuleGetFunction(module, kernel.encode()))
        return function, int(function)

    def set_attribute(self, function: Any, attribute: int, value: int) -> None:
        driver = cu()
        check("cuFuncSetAttribute", driver.cuFuncSetAttribute(function, driver.CUfunction_attribute(attribute), value))

    def failed(self, call: str, status: Any) -> Exception:
        """The error for what launch_kernel returned when it was not launch_ok."""
        return DriverError(call, status[0])

    def launch_cooperative(self, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
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
def bindings() -> Bindings:
    """The one Bindings of the process (NoDeviceError without bindings or a driver)."""
    return Bindings()


def _error_name(status: Any) -> str:
    try:
        from cuda.bindings import driver

        name = driver.cuGetErrorName(driver.CUresult(int(status)))[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - a code the bindings cannot name
        return f"CUresult {int(status)}"
