"""How fast can a grid only read S bytes? The floor under a decode kernel.

    python benchmarks/read_stream.py                       # 16.8 and 134 MB: decode's K and V at B = 1
    python benchmarks/read_stream.py --mb 17,134 --out stream.json

Each block reads its contiguous share of S bytes through a ring of shared-memory stages, as a
decode kernel streams its keys and values, and sums a few words of every tile (so that the reads
are used), with either cp.async (16 bytes per thread per instruction) or one TMA bulk copy per
tile (cp.async.bulk, mbarrier completion). Grids of 128 (one per SM), 256 and 512 blocks, tiles of
16 and 32 KB, 2 to 4 stages. And as a bandwidth test reads, with no shared memory: plain 16-byte
loads (ld.global.nc), 8 in flight per thread, by grids of 1, 2, 4 and 8 blocks of 256 threads
per SM striding over the bytes. Timed as every variant is (autosoft.timing.time_gpu: CUDA events
behind a spin kernel, median, inputs rotated past the L2), beside a device copy of S / 2 bytes
each way (the issue's "copy moving the same bytes"). Nothing is computed or written, so no
attention kernel reading the same bytes can be faster than the best of these. Needs a GPU with
sm_90a (the TMA kernel).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.compile import ARCH_SPECIFIC, compile_source  # noqa: E402
from autosoft.runtime import cupy_module, device_info  # noqa: E402
from autosoft.timing import time_copy, time_gpu  # noqa: E402

MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

SOURCE = ARCH_SPECIFIC + r"""
#define THREADS 128
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
// a few words of every 16 bytes of the tile, so that the compiler keeps the reads
__device__ __forceinline__ float consume(const uint4* t, int n16) {
  float a = 0.f;
  for (int i = threadIdx.x; i < n16; i += THREADS) { const uint4 v = t[i]; a += __int_as_float(v.x) + __int_as_float(v.w); }
  return a;
}
extern "C" __global__ void __launch_bounds__(THREADS) ring_cp_async(const char* __restrict__ src, long long chunk,
                                                                     int tile, int stages, float* out) {
  extern __shared__ __align__(128) uint4 ring[];
  const char* base = src + blockIdx.x * chunk;
  const int tiles = (int)(chunk / tile), n16 = tile / 16;
  auto issue = [&](int t) {
    const char* g = base + (long long)t * tile;
    uint4* s = ring + (t % stages) * n16;
    for (int i = threadIdx.x; i < n16; i += THREADS)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_u32(s + i)), "l"(g + 16 * i) : "memory");
  };
  for (int s = 0; s < stages; ++s) {  // one commit group per stage, empty past the last tile
    if (s < tiles) issue(s);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  float acc = 0.f;
  for (int t = 0; t < tiles; ++t) {
    if (stages == 2) asm volatile("cp.async.wait_group 1;" ::: "memory");
    else if (stages == 3) asm volatile("cp.async.wait_group 2;" ::: "memory");
    else asm volatile("cp.async.wait_group 3;" ::: "memory");
    __syncthreads();
    acc += consume(ring + (t % stages) * n16, n16);
    __syncthreads();
    if (t + stages < tiles) issue(t + stages);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
extern "C" __global__ void __launch_bounds__(THREADS) ring_bulk(const char* __restrict__ src, long long chunk,
                                                                 int tile, int stages, float* out) {
  extern __shared__ __align__(128) uint4 ring[];
  __shared__ __align__(8) unsigned long long full[4];
  const char* base = src + blockIdx.x * chunk;
  const int tiles = (int)(chunk / tile), n16 = tile / 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(full + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t) {  // thread 0: one bulk copy of the whole tile
    const unsigned bar = smem_u32(full + t % stages);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(tile) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(ring + (t % stages) * n16)), "l"(base + (long long)t * tile), "r"(tile), "r"(bar) : "memory");
  };
  if (threadIdx.x == 0)
    for (int s = 0; s < stages && s < tiles; ++s) issue(s);
  float acc = 0.f;
  for (int t = 0; t < tiles; ++t) {
    const unsigned bar = smem_u32(full + t % stages), parity = (t / stages) & 1;
    asm volatile("{\n.reg .pred p;\nWAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra WAIT;\n}\n"
                 :: "r"(bar), "r"(parity) : "memory");
    acc += consume(ring + (t % stages) * n16, n16);
    __syncthreads();
    if (threadIdx.x == 0 && t + stages < tiles) issue(t + stages);
  }
  out[blockIdx.x * THREADS + threadIdx.x] = acc;
}
// every thread of the grid takes 16-byte words i, i + stride, ..., eight loads in flight at a time
extern "C" __global__ void __launch_bounds__(256) plain_loads(const uint4* __restrict__ src, long long n16, float* out) {
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) v[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < 8; ++u) acc += __int_as_float(v[u].x) + __int_as_float(v[u].w);
  }
  for (; i < n16; i += stride) { const uint4 v = __ldg(src + i); acc += __int_as_float(v.x) + __int_as_float(v.w); }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="16.8,134.2", help="comma-separated sizes in MB (decode's K + V at B = 1)")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    cp = cupy_module()
    device = device_info()
    compiled = compile_source(SOURCE, device.target.arch)
    if not compiled.ok:
        raise SystemExit(compiled.log[:2000])
    module = cp.cuda.function.Module()
    module.load(compiled.cubin)
    kernels = {name: module.get_function(name) for name in ("ring_cp_async", "ring_bulk")}
    for kernel in kernels.values():  # up to 4 stages of 32 KB: past the 48 KB that needs no opt-in
        cp.cuda.driver.funcSetAttribute(kernel.ptr, MAX_DYNAMIC_SHARED, 4 * 32768)
    plain = module.get_function("plain_loads")
    sms = device.target.sm_count
    out = cp.zeros(8 * sms * 256, cp.float32)  # a float per thread of the largest grid
    rows = []
    for mb in (float(x) for x in args.mb.split(",")):
        size = max(8 << 20, round(mb * 1e6 / (8 << 20)) * (8 << 20))  # 8 MiB steps: every grid's shares are whole tiles
        n_sets = max(2, int(4 * device.target.l2_bytes // size) + 1)
        sets = [cp.random.random(size // 4, dtype=cp.float32).view(cp.uint8) for _ in range(n_sets)]
        copy_us = time_copy(size // 2, device.target.l2_bytes, args.reps).median_us
        print(f"{size / 1e6:.1f} MB: copy of {size / 2e6:.1f} MB each way {copy_us:.2f} us")
        for grid in (128, 256, 512):
            for tile in (16384, 32768):
                chunk = size // grid // tile * tile
                if chunk < 2 * tile or chunk * grid != size:
                    continue  # fewer than two tiles a block (nothing to pipeline), or not all of S read
                for stages in (2, 3, 4):
                    for name, kernel in kernels.items():
                        def run(i: int, kernel=kernel, chunk=chunk, tile=tile, stages=stages) -> None:
                            kernel((grid,), (128,), (sets[i], cp.int64(chunk), cp.int32(tile), cp.int32(stages), out),
                                   shared_mem=stages * tile)

                        us = time_gpu(run, n_sets, args.reps).median_us
                        read = chunk * grid
                        rows.append({"mb": size / 1e6, "kernel": name, "grid": grid, "tile": tile, "stages": stages,
                                     "read_mb": read / 1e6, "us": us, "tb_per_s": read / us / 1e6, "copy_us": copy_us})
                        print(f"  {name:13} grid {grid:4} tile {tile:6} stages {stages}: {read / 1e6:6.1f} MB read "
                              f"in {us:8.2f} us, {read / us / 1e6:5.2f} TB/s")
        for per_sm in (1, 2, 4, 8):
            def run_plain(i: int, grid=per_sm * sms) -> None:
                plain((grid,), (256,), (sets[i], cp.int64(size // 16), out))

            us = time_gpu(run_plain, n_sets, args.reps).median_us
            rows.append({"mb": size / 1e6, "kernel": "plain_loads", "grid": per_sm * sms, "tile": 0, "stages": 0,
                         "read_mb": size / 1e6, "us": us, "tb_per_s": size / us / 1e6, "copy_us": copy_us})
            print(f"  plain_loads   grid {per_sm * sms:4} (256 threads): {size / 1e6:6.1f} MB read in {us:8.2f} us, "
                  f"{size / us / 1e6:5.2f} TB/s")
        best = min((r for r in rows if r["mb"] == size / 1e6), key=lambda r: r["us"], default=None)
        if best:
            print(f"  fastest: {best['us']:.2f} us ({best['kernel']}, grid {best['grid']}, tile {best['tile']}, "
                  f"{best['stages']} stages)")
    if args.out:
        args.out.write_text(json.dumps({"gpu": device.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
