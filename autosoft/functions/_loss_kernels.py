"""The small fixed kernels around the cross-entropy kernel, each one launch where torch's
composition took two or three (at a few thousand tokens a step's tiny kernels weigh: BENCHMARKS.md,
issue 43):

- mean_scale: the gradient's scale of a mean, 1 / the rows whose target is not ignore_index
  (torch: ne, sum, reciprocal);
- scaled_sum: the reduced loss, the sum of the per-row losses times that scale, in a fixed order
  (torch: sum, mul);
- scale_unless_one: x *= factor unless factor is 1, decided on the GPU: the backward of a loss
  whose gradient was written in the forward. After `loss.backward()` the incoming gradient is 1
  and nothing is read or written; knowing that on the host would cost a synchronisation
  (Liger's torch.equal, a `.item()`), which stalls the whole step's queue. Each block reads the
  factor and returns at once when it is 1, else scales its share of x in place.

Fixed kernels, compiled once per GPU architecture into the kernel store and launched through the
CUDA driver on torch's current stream (no CuPy)."""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
from typing import Any

from .. import driver
from ..arrays import torch_current_stream
from ..compile import compile_source, source_digest
from ..errors import UserError
from ..kernel_store import default_store

THREADS = 256
BLOCKS_PER_SM = 4
REDUCE_THREADS = 1024  # mean_scale and scaled_sum: one block

SOURCE = r"""
__device__ __forceinline__ float f16_to_f32(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f32_to_f16(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ unsigned short f32_to_bf16(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float same(float f) { return f; }

// x[i] *= *factor for i < n, unless *factor == 1 (every block then returns at once).
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

// The sum of one block's 1024 values, in a fixed order (warp trees, then the 32 warps' sums):
// every launch adds the same values in the same order.
template <typename T>
__device__ __forceinline__ T block_sum(T v) {
    __shared__ T warps[32];
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x < 32 ? warps[threadIdx.x] : T(0);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// *scale = 1 / (the i < m with target[i] != ignore_index): inf when there is none, which makes
// the mean NaN (0 * inf), as torch's. __frcp_rn: correctly rounded under --use_fast_math, as
// torch's reciprocal. One block of 1024 threads.
#define MEAN_SCALE(NAME, T)                                                                      \
extern "C" __global__ void __launch_bounds__(1024) NAME(const T* __restrict__ target, long long m, \
                                                        long long ignore_index, float* __restrict__ scale) { \
    long long kept = 0;                                                                          \
    for (long long i = threadIdx.x; i < m; i += 1024) kept += (long long)target[i] != ignore_index; \
    kept = block_sum(kept);                                                                      \
    if (threadIdx.x == 0) *scale = __frcp_rn((float)kept);  /* rounded as torch's reciprocal */ \
}

MEAN_SCALE(mean_scale_int64, long long)
MEAN_SCALE(mean_scale_int32, int)

// *out = (loss[0] + ... + loss[m - 1]) * *scale in fp32, in a fixed order (thread j adds the
// values j, j + 1024, ...). One block of 1024 threads.
extern "C" __global__ void __launch_bounds__(1024) scaled_sum(const float* __restrict__ loss, long long m,
                                                              const float* __restrict__ scale, float* __restrict__ out) {
    float s = 0.f;
    for (long long i = threadIdx.x; i < m; i += 1024) s += loss[i];
    s = block_sum(s);
    if (threadIdx.x == 0) *out = s * *scale;
}
"""

KERNELS = ("scale_unless_one_float32", "scale_unless_one_float16", "scale_unless_one_bfloat16",
           "mean_scale_int64", "mean_scale_int32", "scaled_sum")

_LOCK = threading.Lock()
_FUNCTIONS: dict[tuple[int, str], Any] = {}  # (device, kernel name) -> function
_BLOCKS: dict[int, int] = {}  # device -> scale_unless_one's grid


def cubin_for(arch: str) -> bytes:
    """The kernels' cubin for sm_<arch>: from the kernel store, compiled there on a miss."""
    store = default_store()
    digest = source_digest(SOURCE, arch)
    cubin = store.get(digest)
    if cubin is None:
        result = compile_source(SOURCE, arch, "loss_kernels.cu")
        if not result.ok:
            raise UserError(f"autosoft: the loss's small kernels do not compile for sm_{arch}: "
                            f"{result.log.splitlines()[0] if result.log else 'no log'}")
        cubin = result.cubin
        store.put(digest, cubin)
    return cubin


def _function(device: int, kernel: str) -> Any:
    found = _FUNCTIONS.get((device, kernel))
    if found is not None:
        return found
    with _LOCK:
        properties = driver.device_properties(device)
        module = driver.libcuda().load(cubin_for(f"{properties['major']}{properties['minor']}"), device)
        for name in KERNELS:
            _FUNCTIONS[device, name], _ = driver.libcuda().function(module, name)
        _BLOCKS[device] = properties["sm_count"] * BLOCKS_PER_SM
    return _FUNCTIONS[device, kernel]


def _launch(device: int, kernel: str, blocks: int, threads: int, stream: int, *arguments: Any) -> None:
    """cuLaunchKernel of `kernel` with `arguments` (ctypes values) on `stream`."""
    function = _function(device, kernel)
    params = (ctypes.c_void_p * len(arguments))(*[ctypes.addressof(a) for a in arguments])
    with contextlib.nullcontext() if driver.is_current(device) else driver.on_device(device):
        driver.check("cuLaunchKernel", driver.cu().cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0, stream,
                                                                  ctypes.addressof(params), None))


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
    kernel = f"scale_unless_one_{dtype}"
    _function(device, kernel)
    blocks = min(_BLOCKS[device], -(-x.numel() // THREADS))
    _launch(device, kernel, blocks, THREADS, torch_current_stream(torch)(device),
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(factor.data_ptr()), ctypes.c_longlong(x.numel()))
    return x


def mean_scale(target: Any, ignore_index: int) -> Any:
    """A one-element float32 tensor on target's device: 1 / the entries of target (a contiguous
    int64 or int32 CUDA tensor) that are not ignore_index, inf where there is none."""
    torch = sys.modules["torch"]
    kernel = {torch.int64: "mean_scale_int64", torch.int32: "mean_scale_int32"}.get(target.dtype)
    if kernel is None or not target.is_contiguous():
        raise ValueError("mean_scale: target must be a contiguous int64 or int32 tensor")
    scale = torch.empty(1, dtype=torch.float32, device=target.device)
    device = target.get_device()
    _launch(device, kernel, 1, REDUCE_THREADS, torch_current_stream(torch)(device), ctypes.c_void_p(target.data_ptr()),
            ctypes.c_longlong(target.numel()), ctypes.c_longlong(ignore_index), ctypes.c_void_p(scale.data_ptr()))
    return scale


def scaled_sum(loss: Any, scale: Any) -> Any:
    """The 0-d float32 tensor sum(loss) * scale[0], summed in a fixed order (the same bits at every
    call). loss: a contiguous float32 CUDA tensor; scale: a one-element float32 tensor beside it."""
    torch = sys.modules["torch"]
    if loss.dtype != torch.float32 or not loss.is_contiguous() or scale.dtype != torch.float32 \
            or scale.numel() != 1 or scale.device != loss.device:
        raise ValueError("scaled_sum: loss must be contiguous float32 and scale one float32 on its device")
    out = torch.empty((), dtype=torch.float32, device=loss.device)
    device = loss.get_device()
    _launch(device, "scaled_sum", 1, REDUCE_THREADS, torch_current_stream(torch)(device),
            ctypes.c_void_p(loss.data_ptr()), ctypes.c_longlong(loss.numel()), ctypes.c_void_p(scale.data_ptr()),
            ctypes.c_void_p(out.data_ptr()))
    return out
