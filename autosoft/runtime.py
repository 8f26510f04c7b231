"""The GPU side: which device we are on, loading a compiled variant, launching it.

Everything that needs a CUDA driver lives here (and in driver.py), so the rest of the package
imports without one. A variant is loaded and launched through one of two drivers behind one
launch path (DriverBackend): CuPy's, for CuPy arrays, the tuner and the verification; or libcuda's
own, through ctypes (driver.py), for torch tensors, so that a process that passes torch tensors to a
warm kernel store imports neither CuPy nor any binding. The device's properties come from libcuda
where it is found, else from CuPy.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import re
import sys
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from . import driver as _libcuda_driver
from .errors import NoDeviceError, one_line
from .families.base import Launch, Target, TensorMap, Variant

_STRIDE = re.compile(r"\w+_stride\d+")  # a strided input's stride argument (Family.strided_inputs)
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED


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
        raise NoDeviceError(f"no CUDA device: {one_line(exc)}; run this on a machine with an NVIDIA GPU") from None
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


def device_info(index: int | None = None) -> DeviceInfo:
    """The device `index` (None: the current one) as kernels are built and keyed for it."""
    return _device_info(current_device() if index is None else index)


def current_device() -> int:
    """The current device of this thread: the driver's current context (torch.cuda.device and
    CuPy's Device both set it) from libcuda where it is found, else CuPy's."""
    if _libcuda_driver.available():
        return _libcuda_driver.current_device()
    return int(cupy_module().cuda.runtime.getDevice())


@lru_cache(maxsize=None)
def _device_info(index: int) -> DeviceInfo:
    from .compile import nvrtc_version

    if _libcuda_driver.available():
        props = _libcuda_driver.device_properties(index)
        target = Target(arch=f"{props['major']}{props['minor']}", name=props["name"], sm_count=props["sm_count"],
                        smem_optin=props["smem_optin"], l2_bytes=props["l2_bytes"])
        return DeviceInfo(index, target, nvrtc_version())
    cp = cupy_module()
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


class DriverBackend(Protocol):
    """How a LoadedVariant reaches the driver: CupyDriver (CuPy's bindings) or
    driver.LibcudaDriver (libcuda through ctypes). Functions are the handles launch_kernel takes."""

    name: str
    error: type[Exception]  # what its calls raise
    # launch_kernel(function, gx, gy, gz, bx, by, bz, shared bytes, stream, params address, 0):
    # cuLaunchKernel's binding itself, called on the hot path; it returns launch_ok on success,
    # anything else is passed to failed() (or it raises `error` itself)
    launch_kernel: Callable[..., Any]
    launch_ok: Any

    # the launch of one kernel with everything but the stream fixed: start(stream) does what
    # launch_kernel(function, *geometry, stream, params, 0) does, with the fewest steps per call
    def bound_launch(self, function: Any, geometry: tuple[int, ...], params: int) -> Callable[[int], Any]: ...

    def load(self, cubin: bytes, device: int) -> Any: ...
    def function(self, module: Any, kernel: str) -> tuple[Any, int]: ...
    def set_attribute(self, function: Any, attribute: int, value: int) -> None: ...
    def failed(self, call: str, status: Any) -> Exception: ...
    def launch_cooperative(self, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                           stream: int, params: int) -> None: ...
    def current_device(self) -> int: ...
    def is_current(self, device: int) -> bool: ...
    def on_device(self, device: int) -> contextlib.AbstractContextManager[Any]: ...
    def zeros(self, nbytes: int, device: int) -> tuple[Any, int]: ...


class CupyDriver:
    """DriverBackend through CuPy: its Module in the current device's context, cupy_backends'
    cuLaunchKernel, CuPy's allocator for workspaces."""

    name = "cupy"

    def __init__(self) -> None:
        self.cp = cupy_module()
        raw = _driver()
        self.error = raw.CUDADriverError
        self.launch_kernel = raw.launchKernel
        self.launch_ok = None  # launchKernel returns nothing, and raises on failure

    def bound_launch(self, function: Any, geometry: tuple[int, ...], params: int) -> Callable[[int], Any]:
        launch_kernel = self.launch_kernel
        gx, gy, gz, bx, by, bz, smem = geometry
        return lambda stream: launch_kernel(function, gx, gy, gz, bx, by, bz, smem, stream, params, 0)

    def load(self, cubin: bytes, device: int) -> Any:
        with self.cp.cuda.Device(device):
            module = self.cp.cuda.function.Module()
            module.load(cubin)
        return module

    def function(self, module: Any, kernel: str) -> tuple[Any, int]:
        fn = module.get_function(kernel)
        return fn.ptr, fn.ptr

    def set_attribute(self, function: Any, attribute: int, value: int) -> None:
        self.cp.cuda.driver.funcSetAttribute(function, attribute, value)

    def failed(self, call: str, status: Any) -> Exception:
        return RuntimeError(f"{call}: returned {status!r}")  # never: launchKernel raises its own

    def launch_cooperative(self, function: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, smem: int,
                           stream: int, params: int) -> None:
        _driver().launchCooperativeKernel(function, gx, gy, gz, bx, by, bz, smem, stream, params)

    def current_device(self) -> int:
        return int(self.cp.cuda.runtime.getDevice())

    def is_current(self, device: int) -> bool:
        return self.current_device() == device

    def on_device(self, device: int) -> contextlib.AbstractContextManager[Any]:
        return self.cp.cuda.Device(device)

    def zeros(self, nbytes: int, device: int) -> tuple[Any, int]:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # first met inside a CUDA graph capture: allocated by torch (its allocator knows the
            # capture; CuPy's memset on its own stream would break it) and zeroed on the
            # capturing stream, so the graph zeroes it too; kept for that stream's later calls
            ws = torch.zeros(nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
            return ws, ws.data_ptr()
        with self.cp.cuda.Device(device):
            ws = self.cp.zeros(nbytes, dtype="uint8")
        return ws, ws.data.ptr


@lru_cache(maxsize=1)
def cupy_driver() -> CupyDriver:
    return CupyDriver()


def torch_driver() -> DriverBackend:
    """The driver torch tensors launch through: libcuda's own (no CuPy). A torch CUDA tensor
    means libcuda is loaded; without it, NoDeviceError."""
    return _libcuda_driver.libcuda()


def load_for_torch(variant: Variant, cubin: bytes) -> "LoadedVariant":
    """A variant loaded for torch tensors (torch_driver): what the torch plans ask the dispatcher for."""
    return LoadedVariant(variant, cubin, torch_driver())


class LoadedVariant:
    """A variant's cubin loaded into the current device's primary context, ready to launch.

    Launches go straight to cuLaunchKernel with argument slots built once: the per-call cost
    is writing the buffer addresses into those slots, which keeps autosoft.softmax's host
    overhead close to a framework's own launch. `driver`: which binding loads and launches it
    (DriverBackend): CuPy's by default (CuPy arrays, the tuner, verification), libcuda's
    for torch tensors (load_for_torch), which never imports CuPy.
    """

    def __init__(self, variant: Variant, cubin: bytes, driver: DriverBackend | None = None):
        self.driver = driver = driver if driver is not None else cupy_driver()
        self.variant = variant
        self.device = driver.current_device()
        self._module = driver.load(cubin, self.device)
        self._launches = []
        for launch in variant.launches:
            function, address = driver.function(self._module, launch.kernel)
            # Past 48 KiB a block's shared memory (static + dynamic) needs the opt-in; the kernel's
            # static part counts too, so ask for it whenever there is dynamic shared memory.
            if launch.shared_mem > 0:
                driver.set_attribute(function, _MAX_DYNAMIC_SHARED, launch.shared_mem)
            # sm_90 runs clusters of up to 16 blocks, but past 8 only for a kernel that opts in
            # (the cluster's size is compiled into the kernel: its launch needs nothing more)
            if launch.non_portable_cluster:
                driver.set_attribute(function, _NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            self._launches.append(_RawLaunch(function, address, launch, driver))
        self._workspaces: dict[int, Any] = {}  # per stream: concurrent streams must not share partials
        self._lock = threading.Lock()          # argument slots are shared between calls
        self._launchers: dict[tuple, Callable[..., None]] = {}  # launch_raw's, by (names, scalar names)
        self._maps: dict[tuple, bytes] = {}    # encoded tensor maps, by (map, address, strides)
        self._stride_args = tuple(dict.fromkeys(
            [a for l in variant.launches for a in l.args if isinstance(a, str) and _STRIDE.fullmatch(a)]
            + [name for l in variant.launches for a in l.args if isinstance(a, TensorMap) for name in a.stride_names]))
        # the maps whose outermost extent is their array's own at each launch (TensorMap.runtime_rows)
        self._rows_args = tuple(dict.fromkeys(a.rows_name for l in variant.launches for a in l.args
                                              if isinstance(a, TensorMap) and a.runtime_rows))

    def launch(self, buffers: Mapping[str, Any], stream: Any = None) -> None:
        """Run every launch of the variant. Buffers: name -> CuPy array, device pointer (int) or scalar.
        A stride argument the launches name ("q_stride1") and `buffers` lacks is the array's own
        (CuPy strides are in bytes; the kernels take elements)."""
        cp = cupy_module()
        stream_ptr = (stream or cp.cuda.get_current_stream()).ptr
        values = {k: (v.data.ptr if isinstance(v, cp.ndarray) else v) for k, v in buffers.items()}
        for name in self._stride_args:
            if name not in values:
                array, _, dim = name.rpartition("_stride")
                a = buffers[array]
                values[name] = np.int64(a.strides[int(dim)] // a.itemsize) if hasattr(a, "strides") \
                    else self._contiguous_strides[name]
        for name in self._rows_args:
            if name not in values:  # the array's own rows; a bare pointer: the problem's most
                a = buffers[name[:-len("_rows")]]
                values[name] = np.int64(a.shape[0] if hasattr(a, "shape") else
                                        self._contiguous_strides[name])
        self.launch_raw(values, stream_ptr)

    @functools.cached_property
    def _contiguous_strides(self) -> dict[str, Any]:
        """The stride arguments of contiguous inputs (`Family.input_shapes`), for buffers given as
        bare pointers."""
        from .families import get_family

        out = {}
        for array, shape in get_family(self.variant.family).input_shapes(self.variant.problem).items():
            out[f"{array}_rows"] = np.int64(shape[0])
            step = 1
            for dim in reversed(range(len(shape))):
                out[f"{array}_stride{dim}"] = np.int64(step)
                step *= shape[dim]
        return out

    def launcher(self, names: tuple[str, ...], scalars: tuple[str, ...] = ()) -> Callable[..., None]:
        """A launch function for a hot path: f(*values, stream_ptr), one value per name, in the
        order of `names`: a device pointer (int) for a buffer, a numpy scalar for the names in
        `scalars` (attention's scale). Every buffer the launches name except "workspace" must be
        in `names`; the workspace is this variant's, per stream.

        Argument slots are built once; a call writes the values into them and calls the driver:
        no dict of buffers, no argument tuple per call. On the H200 machine that was 4.51 us per
        softmax launch against 4.76 us through launch_raw (3.75 us for the driver call alone).
        A call made while another device is current is retried from the variant's device.
        """
        position = {name: i for i, name in enumerate(names)}
        plans: list[tuple[_RawLaunch, tuple[tuple[int, int], ...]]] = []
        maps: list[tuple[_RawLaunch, int, TensorMap, int, tuple[int, ...] | None, int | None]] = []
        for raw in self._launches:
            for slot, tmap in raw.tensor_maps:
                if tmap.array not in position:
                    raise KeyError(f"{self.variant.name}: launch {raw.kernel} maps buffer {tmap.array!r}, not among {names}")
                strides = tuple(position[n] for n in tmap.stride_names) \
                    if tmap.stride_names and all(n in position for n in tmap.stride_names) else None
                if tmap.runtime_rows and tmap.rows_name not in position:
                    raise KeyError(f"{self.variant.name}: launch {raw.kernel} maps {tmap.array!r} over its own rows, "
                                   f"{tmap.rows_name!r} not among {names}")
                maps.append((raw, slot, tmap, position[tmap.array], strides,
                             position[tmap.rows_name] if tmap.runtime_rows else None))
            binds = []
            for slot, name in raw.bound:
                if name == "workspace":
                    binds.append((slot, -1))
                elif name in position:
                    binds.append((slot, position[name]))
                else:
                    raise KeyError(f"{self.variant.name}: launch {raw.kernel} needs buffer {name!r}, "
                                   f"not among {names}")
            plans.append((raw, tuple(binds)))
        driver = self.driver
        driver_error, ok, failed = driver.error, driver.launch_ok, driver.failed
        lock, workspace = self._lock, self._workspace

        def on_device(args: tuple[Any, ...], error: Exception) -> None:
            """A launch that failed: called while another device's context (or none) was current,
            retry from ours; else the error stands."""
            if driver.is_current(self.device):
                raise error
            with driver.on_device(self.device):
                launch(*args)

        if len(plans) == 1 and not plans[0][0].cooperative and not maps:
            # one kernel (softmax's usual case): the driver call with its arguments bound here,
            # pointers written straight into their slots; every other case takes the loop below
            raw, binds = plans[0]
            set_slot = raw.set
            # pointer slots keep their c_void_p objects for good: a call writes the address in
            pointers = tuple((raw.slots[slot], at) for slot, at in binds if at >= 0 and names[at] not in scalars)
            values = tuple((slot, at) for slot, at in binds if at >= 0 and names[at] in scalars)
            workspaces = tuple(raw.slots[slot] for slot, at in binds if at < 0)
            start = driver.bound_launch(raw.function, raw.geometry, raw.params_ptr)

            if len(names) == 2 and not values and not workspaces and sorted(at for _, at in pointers) == [0, 1]:
                # two addresses and nothing else (softmax's input and output): a fixed signature,
                # the fewest Python steps between the plan and the driver
                first = next(slot for slot, at in pointers if at == 0)
                second = next(slot for slot, at in pointers if at == 1)

                def launch(x: int, y: int, stream_ptr: int) -> None:
                    try:
                        with lock:
                            first.value = x
                            second.value = y
                            status = start(stream_ptr)
                        if status == ok:
                            return
                        error = failed("cuLaunchKernel", status)
                    except driver_error as exc:  # CuPy's binding raises where libcuda returns
                        error = exc
                    on_device((x, y, stream_ptr), error)
            else:
                def launch(*args: Any) -> None:  # type: ignore[misc]
                    stream_ptr = args[-1]
                    try:
                        with lock:
                            for slot_object, at in pointers:
                                slot_object.value = args[at]
                            for slot, at in values:
                                set_slot(slot, args[at])
                            for slot_object in workspaces:
                                slot_object.value = workspace(stream_ptr)
                            status = start(stream_ptr)
                        if status == ok:
                            return
                        error = failed("cuLaunchKernel", status)
                    except driver_error as exc:
                        error = exc
                    on_device(args, error)

            if not values and not workspaces and all(ctypes.sizeof(s) <= 8 for s in raw.slots):
                # the same launch for compiled code to replay (autosoft.native): nothing but buffer
                # addresses changes between calls
                launch.native = NativeLaunch(  # type: ignore[attr-defined]
                    raw.address, raw.geometry, tuple(int.from_bytes(bytes(s), "little") for s in raw.slots),
                    tuple((slot, at) for slot, at in binds if at >= 0))
            return launch

        encode = self._tensor_map

        def launch(*args: Any) -> None:
            stream_ptr = args[-1]
            try:
                with lock:
                    for raw, slot, tmap, at, strides, rows in maps:  # TMA descriptors of this call's arrays
                        raw.set_bytes(slot, encode(tmap, args[at], None if strides is None else
                                                   tuple(int(args[i]) for i in strides),
                                                   None if rows is None else int(args[rows])))
                    for raw, binds in plans:
                        for slot, at in binds:
                            raw.set(slot, args[at] if at >= 0 else workspace(stream_ptr))
                        raw.start(stream_ptr)
                return
            except driver_error as exc:
                error = exc
            on_device(args, error)

        return launch

    def launch_raw(self, values: Mapping[str, Any], stream_ptr: int) -> None:
        """Launch with device pointers (ints) and scalars by name, on a raw stream handle."""
        names = tuple(values)
        scalars = tuple(name for name, value in values.items() if type(value) is not int)
        launch = self._launchers.get((names, scalars))
        if launch is None:
            launch = self._launchers[names, scalars] = self.launcher(names, scalars)
        launch(*values.values(), stream_ptr)

    def _tensor_map(self, tmap: TensorMap, pointer: int, strides: tuple[int, ...] | None,
                    rows: int | None = None) -> bytes:
        """The CUtensorMap of `tmap` over the array at `pointer` with these strides (elements;
        None: contiguous) and outermost extent (None: the map's own), from a small cache: a map
        holds the address, so each new array is encoded once (about a microsecond) and repeated
        calls on the same tensors are a lookup."""
        key = (tmap, pointer, strides, rows)
        encoded = self._maps.get(key)
        if encoded is None:
            if len(self._maps) >= _MAPS_KEPT:
                self._maps.clear()
            encoded = self._maps[key] = encode_tensor_map(tmap, pointer, strides, rows)
        return encoded

    def _workspace(self, stream_ptr: int) -> int:
        held = self._workspaces.get(stream_ptr)
        if held is None:
            # zeroed: a cooperative split's arrival counters start from a multiple of its split;
            # allocated by the framework the driver serves, on its current stream (the launch's)
            held = self._workspaces[stream_ptr] = self.driver.zeros(self.variant.workspace_bytes, self.device)
        return held[1]


@dataclass(frozen=True)
class NativeLaunch:
    """A launch that compiled code can replay (autosoft.native): one kernel, not cooperative, no
    workspace, no tensor map, no scalar set per call, every parameter at most 8 bytes. `words`:
    each parameter's bytes as a little-endian integer (the buffers' words are written at each
    call); `pointers`: (the parameter's index, the position of the launcher argument whose
    address goes there)."""

    function: int
    geometry: tuple[int, ...]  # grid x, y, z, block x, y, z, dynamic shared memory bytes
    words: tuple[int, ...]
    pointers: tuple[tuple[int, int], ...]


class _RawLaunch:
    """One kernel launch with its argument array prepared for cuLaunchKernel."""

    def __init__(self, function: Any, address: int, launch: Launch, driver: DriverBackend):
        self.kernel = launch.kernel
        self.function = function  # the handle driver.launch_kernel takes
        self.address = address    # the CUfunction as an int (autosoft.native's replay)
        self.driver = driver
        self.cooperative = launch.cooperative
        self.geometry = (*launch.grid, *launch.block, launch.shared_mem)
        self.slots: list[Any] = []
        self.bound: list[tuple[int, str]] = []  # (slot index, buffer name) filled at each call
        self.tensor_maps: list[tuple[int, TensorMap]] = []  # (slot index, map) encoded at each call
        for i, arg in enumerate(launch.args):
            if isinstance(arg, TensorMap):
                self.slots.append((ctypes.c_ubyte * _TENSOR_MAP_BYTES)())
                self.tensor_maps.append((i, arg))
            elif isinstance(arg, str):
                self.slots.append(ctypes.c_void_p(0))
                self.bound.append((i, arg))
            else:
                self.slots.append(_ctype_of(arg))
        self.params = (ctypes.c_void_p * max(1, len(self.slots)))(*[ctypes.addressof(c) for c in self.slots])
        self.params_ptr = ctypes.addressof(self.params)

    def set(self, i: int, value: Any) -> None:
        """Write one bound argument: a pointer into its void* slot, a scalar into a slot of its type."""
        slot = self.slots[i]
        if type(value) is int and type(slot) is ctypes.c_void_p:
            slot.value = value
            return
        new = _ctype_of(value)
        if type(new) is not type(slot):  # first call, or the kind of value changed
            self.slots[i] = new
            self.params[i] = ctypes.addressof(new)
        else:
            slot.value = new.value

    def set_bytes(self, i: int, value: bytes) -> None:
        """Write a by-value struct argument (a tensor map) into its slot."""
        ctypes.memmove(self.slots[i], value, _TENSOR_MAP_BYTES)

    def start(self, stream_ptr: int) -> None:
        gx, gy, gz, bx, by, bz, smem = self.geometry
        driver = self.driver
        if self.cooperative:  # cuLaunchKernel cannot start it
            driver.launch_cooperative(self.function, gx, gy, gz, bx, by, bz, smem, stream_ptr, self.params_ptr)
            return
        status = driver.launch_kernel(self.function, gx, gy, gz, bx, by, bz, smem, stream_ptr, self.params_ptr, 0)
        if status != driver.launch_ok:
            raise driver.failed("cuLaunchKernel", status)


def _ctype_of(value: Any) -> Any:
    kinds = {np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.uint64: ctypes.c_uint64, np.uint32: ctypes.c_uint32,
             np.float32: ctypes.c_float, np.float64: ctypes.c_double}
    if type(value) in kinds:
        return kinds[type(value)](value.item())
    if isinstance(value, int):
        return ctypes.c_void_p(value)
    raise TypeError(f"unsupported kernel argument {value!r} ({type(value).__name__})")


_TENSOR_MAP_BYTES = 128
_MAPS_KEPT = 256  # encoded tensor maps a loaded variant keeps (a map is tied to one array address)
_TMA_DTYPES = {"float16": 6, "bfloat16": 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16, _BFLOAT16
_SWIZZLES = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_32B, _64B, _128B by the span in bytes
_L2_PROMOTION_128B = 2


def encode_tensor_map(tmap: TensorMap, pointer: int, strides: tuple[int, ...] | None = None,
                      rows: int | None = None) -> bytes:
    """cuTensorMapEncodeTiled for `tmap` over the array at `pointer`, whose strides (elements,
    every dimension but the last, outermost first) are `strides` or, for None, contiguous, and
    whose outermost extent is `rows` (a map with runtime_rows: the array's own) or the map's. A
    dimension of one element takes a contiguous stride whatever it was given (its stride is never
    used, and the driver insists on multiples of 16 bytes). Raises RuntimeError with the driver's
    error code when the driver refuses (an address or stride that is not a multiple of 16 bytes)."""
    from .dtypes import ITEMSIZE

    itemsize = ITEMSIZE[tmap.dtype]
    shape = tmap.shape if rows is None else (rows, *tmap.shape[1:])
    packed = tmap.contiguous_strides
    given = strides if strides is not None else packed
    steps = [packed[d] if shape[d] == 1 else given[d] for d in range(len(shape) - 1)]
    rank = len(shape)
    dims = (ctypes.c_uint64 * rank)(*reversed(shape))
    byte_strides = (ctypes.c_uint64 * (rank - 1))(*[s * itemsize for s in reversed(steps)])
    box = (ctypes.c_uint32 * rank)(*reversed(tmap.box))
    ones = (ctypes.c_uint32 * rank)(*([1] * rank))
    out = (ctypes.c_uint64 * 32)()  # the map must be 64-byte aligned: encoded into an aligned spot
    at = (ctypes.addressof(out) + 127) & ~127
    result = _libcuda_driver.cu().cuTensorMapEncodeTiled(ctypes.c_void_p(at), _TMA_DTYPES[tmap.dtype], rank,
                                               ctypes.c_void_p(pointer), dims, byte_strides, box, ones, 0,
                                               _SWIZZLES[tmap.swizzle_bytes], _L2_PROMOTION_128B, 0)
    if result != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled refused the map of {tmap.array} (shape {shape}, strides {steps}, "
                           f"address {pointer:#x}): CUresult {result}")
    return ctypes.string_at(at, _TENSOR_MAP_BYTES)


@lru_cache(maxsize=1)
def _driver() -> Any:
    from cupy_backends.cuda.api import driver

    return driver
