"""GPU timing shared by the tuner and the benchmarks: one method for every contender.

Each repetition is bracketed by CUDA events on the null stream. A spin kernel is queued first
so that all repetitions are enqueued before the GPU reaches them: the events then measure GPU
time only, not Python's launch overhead. Inputs rotate over enough buffer sets that each run
reads data last touched more than two L2 sizes ago, so no shape is timed from cache. Before
the timed runs the L2 is filled with ordinary dirty lines, the state that any earlier kernel
writing memory leaves behind (see _dirty_l2).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from .runtime import cupy_module

_SPIN_SOURCE = r"""
extern "C" __global__ void autosoft_spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) { }
}
"""


@dataclass(frozen=True)
class Timing:
    median_us: float
    min_us: float
    samples: int


def rotation_count(bytes_per_set: int, l2_bytes: int, max_bytes: int = 4 << 30) -> int:
    """How many input/output sets to cycle through so each run starts with a cold L2."""
    want = max(2, -(-3 * l2_bytes // max(1, bytes_per_set)))
    return int(max(1, min(want, max_bytes // max(1, bytes_per_set), 256)))


@lru_cache(maxsize=1)
def _spin_kernel() -> Any:
    return cupy_module().RawKernel(_SPIN_SOURCE, "autosoft_spin")


def _block_gpu(cycles: int) -> None:
    import numpy as np

    _spin_kernel()((1,), (1,), (np.int64(cycles),))


@lru_cache(maxsize=None)
def _l2_scratch(device: int) -> Any:
    from .runtime import device_info

    with cupy_module().cuda.Device(device):
        return cupy_module().empty(2 * device_info(device).target.l2_bytes, dtype="uint8")


def release_l2_scratch() -> None:
    """Drop the buffers _dirty_l2 keeps (one per device), so their memory can go back to the device."""
    _l2_scratch.cache_clear()


def _dirty_l2() -> None:
    """Write twice the L2's size with ordinary stores. A kernel whose accesses are evict-first
    is faster while the L2 holds nothing but lines of its own: on the H200 one 4096x16384
    float32 variant took 134 us when timed alone and 141 us after any copy had run, while
    variants with normal accesses did not move. Users run softmax after other kernels, so
    every timing starts from that state."""
    cp = cupy_module()
    buf = _l2_scratch(cp.cuda.runtime.getDevice())
    cp.cuda.runtime.memsetAsync(buf.data.ptr, 0, buf.nbytes, 0)


def time_gpu(run: Callable[[int], None], n_sets: int, reps: int = 40, warmup: int = 3) -> Timing:
    """Median GPU time of run(i % n_sets) over `reps` repetitions, in microseconds."""
    cp = cupy_module()
    for i in range(warmup):
        run(i % n_sets)
    _dirty_l2()
    cp.cuda.runtime.deviceSynchronize()
    starts = [cp.cuda.Event() for _ in range(reps)]
    ends = [cp.cuda.Event() for _ in range(reps)]
    # ~20 ms at 2 GHz: longer than enqueueing the repetitions from Python
    _block_gpu(40_000_000)
    for i in range(reps):
        starts[i].record()
        run((warmup + i) % n_sets)
        ends[i].record()
    ends[-1].synchronize()
    samples = [cp.cuda.get_elapsed_time(s, e) * 1000.0 for s, e in zip(starts, ends)]
    return Timing(statistics.median(samples), min(samples), len(samples))


def time_copy(nbytes_each_way: int, l2_bytes: int, reps: int = 40) -> Timing:
    """A device-to-device copy of nbytes (read nbytes + write nbytes): the limit for a memory-bound kernel."""
    cp = cupy_module()
    n_sets = rotation_count(2 * nbytes_each_way, l2_bytes)
    src = [cp.empty(nbytes_each_way, dtype=cp.uint8) for _ in range(n_sets)]
    dst = [cp.empty(nbytes_each_way, dtype=cp.uint8) for _ in range(n_sets)]
    for s in src:
        s.fill(7)  # never time on memory nothing wrote

    def run(i: int) -> None:
        cp.cuda.runtime.memcpyAsync(dst[i].data.ptr, src[i].data.ptr, nbytes_each_way,
                                    cp.cuda.runtime.memcpyDeviceToDevice, 0)

    return time_gpu(run, n_sets, reps)


def matmul_tflops(n: int = 8192, reps: int = 20) -> float:
    """The tensor-core rate of this GPU as a compute-bound kernel meets it: a dense n x n x n
    float16 matrix product (cuBLAS, fp32 accumulation) on random data, timed like a kernel,
    in TFLOP/s. The bound a compute-bound family is compared with, as the copy is for a
    memory-bound one."""
    cp = cupy_module()
    a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    b = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
    c = cp.empty((n, n), dtype=cp.float16)
    timing = time_gpu(lambda i: cp.matmul(a, b, out=c), 1, reps)
    return 2.0 * n ** 3 / (timing.median_us * 1e-6) / 1e12
