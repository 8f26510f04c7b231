"""x *= factor unless factor is 1, decided on the GPU: the backward of a loss whose gradient was
written in the forward. After `loss.backward()` the incoming gradient is 1 and nothing is
read or written; knowing that on the host would cost a synchronisation (Liger's torch.equal,
a `.item()`), which stalls the whole step's queue. Each block reads the factor and returns
at once when it is 1, else scales its share of x in place.

One fixed kernel per dtype, compiled once per GPU architecture into the kernel store and
launched through the CUDA driver on torch's current stream (no CuPy)."""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any

from .. import driver
from ..compile import compile_source, source_digest
from ..errors import UserError
from ..kernel_store import default_store

THREADS = 256
BLOCKS_PER_SM = 4

SOURCE = r"""
// x[i] *= *factor for i < n, unless *factor == 1 (every block then returns at once).
__device__ __forceinline__ float f16_to_f32(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f32_to_f16(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float same(float f) { return f; }

#define SCALE_UNLESS_ONE(NAME, T, TO_F32, FROM_F32)                                              \
extern "C" __global__ void __launch_bounds__(256) NAME(T* __restrict__ x, const float* __restrict__ factor, \
                                                       long long n) {                            \
    const float f = *factor;                                                                     \
    if (f == 1.0f) return;                                                                       \
    const long long step = (long long)gridDim.x * blockDim.x;                                    \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step)       \
        x[i] = FROM_F32(TO_F32(x[i]) * f);                                                       \
}

SCALE_UNLESS_ONE(scale_unless_one_float32, float, same, same)
SCALE_UNLESS_ONE(scale_unless_one_float16, unsigned short, f16_to_f32, f32_to_f16)
SCALE_UNLESS_ONE(scale_unless_one_bfloat16, unsigned short, bf16_to_f32, f32_to_bf16)
"""

_LOCK = threading.Lock()
_FUNCTIONS: dict[tuple[int, str], tuple[Any, int]] = {}  # (device, dtype) -> (function, blocks)


def cubin_for(arch: str) -> bytes:
    """The kernels' cubin for sm_<arch>: from the kernel store, compiled there on a miss."""
    store = default_store()
    digest = source_digest(SOURCE, arch)
    cubin = store.get(digest)
    if cubin is None:
        result = compile_source(SOURCE, arch, "scale_unless_one.cu")
        if not result.ok:
            raise UserError(f"autosoft: the gradient-scaling kernel does not compile for sm_{arch}: "
                            f"{result.log.splitlines()[0] if result.log else 'no log'}")
        cubin = result.cubin
        store.put(digest, cubin)
    return cubin


def _function(device: int, dtype: str) -> tuple[Any, int]:
    found = _FUNCTIONS.get((device, dtype))
    if found is not None:
        return found
    with _LOCK:
        properties = driver.device_properties(device)
        module = driver.libcuda().load(cubin_for(f"{properties['major']}{properties['minor']}"), device)
        for name in ("float32", "float16", "bfloat16"):
            function, _ = driver.libcuda().function(module, f"scale_unless_one_{name}")
            _FUNCTIONS[device, name] = (function, properties["sm_count"] * BLOCKS_PER_SM)
    return _FUNCTIONS[device, dtype]


def scale_unless_one(x: Any, factor: Any) -> Any:
    """x *= factor[0] in place unless factor[0] == 1, on torch's current stream; returns x. x: a
    contiguous CUDA torch tensor (float32, float16, bfloat16); factor: a one-element float32
    CUDA tensor on x's device (the incoming gradient of a scalar loss)."""
    torch = sys.modules["torch"]
    dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[x.dtype]
    if not x.is_contiguous() or factor.dtype != torch.float32 or factor.numel() != 1 or factor.device != x.device:
        raise ValueError("scale_unless_one: x must be contiguous and factor one float32 on x's device")
    if x.numel() == 0:
        return x
    device = x.get_device()
    function, blocks = _function(device, dtype)
    blocks = min(blocks, -(-x.numel() // THREADS))
    stream = torch.cuda.current_stream(device).cuda_stream
    arguments = (ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(factor.data_ptr()), ctypes.c_longlong(x.numel()))
    params = (ctypes.c_void_p * 3)(*[ctypes.addressof(a) for a in arguments])
    if driver.is_current(device):
        _launch(function, blocks, stream, params)
    else:
        with driver.on_device(device):
            _launch(function, blocks, stream, params)
    return x


def _launch(function: Any, blocks: int, stream: int, params: Any) -> None:
    """cuLaunchKernel with `params`, the array of the arguments' addresses (kept alive by the caller)."""
    driver.check("cuLaunchKernel", driver.cu().cuLaunchKernel(function, blocks, 1, 1, THREADS, 1, 1, 0, stream,
                                                              ctypes.addressof(params), None))
