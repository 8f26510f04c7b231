"""Probe: log-softmax of 1024x32768 16-bit rows with the row moved by the tensor-memory
accelerator (1-D bulk copies, mbarrier completion), against the family's best staged variants
and the copy, timed in turns in one process."""
import json, os, statistics, sys
from pathlib import Path
import numpy as np
import cupy as cp

sys.path.insert(0, os.getcwd())
from autosoft.compile import compile_source
from autosoft.evaluate import _timing_sets, verify
from autosoft.families import get_family
from autosoft.families.base import build_variant, space_of
from autosoft.runtime import LoadedVariant, device_info
from autosoft.timing import time_copy, time_gpu

SRC = r"""
constexpr int N = __N__;
constexpr int THREADS = __THREADS__;
constexpr int CHUNKS = __CHUNKS__;
constexpr int ROW_BYTES = N * 2;
constexpr int CB = ROW_BYTES / CHUNKS;     // bytes per chunk
constexpr int JPC = CB / 16 / THREADS;     // 16-byte vectors per thread per chunk
constexpr float LOG2E = 1.4426950408889634f;
#define NEG_INF __int_as_float(0xff800000)
static_assert(JPC * THREADS * 16 == CB, "chunk must split evenly");

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ float ex2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ void unpack2(unsigned w, float& lo, float& hi) {
#if __BF16__
  lo = __uint_as_float(w << 16); hi = __uint_as_float(w & 0xffff0000u);
#else
  asm("{ .reg .f16 a, b; mov.b32 {a, b}, %2; cvt.f32.f16 %0, a; cvt.f32.f16 %1, b; }" : "=f"(lo), "=f"(hi) : "r"(w));
#endif
}
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned w;
#if __BF16__
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
#else
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
#endif
  return w;
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n@!done bra WAIT;\n}\n"
               :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void bulk_store(void* dst, unsigned src, unsigned bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(dst), "r"(src), "r"(bytes) : "memory");
}

extern "C" __global__ void __launch_bounds__(THREADS) probe(const unsigned short* __restrict__ x, unsigned short* __restrict__ y) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bars[CHUNKS];
  __shared__ float red_m[32], red_s[32];
  const int tid = threadIdx.x;
  const long long row = blockIdx.x;
  const unsigned sbase = smem_u32(sm);
  const unsigned char* xr = reinterpret_cast<const unsigned char*>(x) + row * ROW_BYTES;
  unsigned char* yr = reinterpret_cast<unsigned char*>(y) + row * ROW_BYTES;
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) mbar_init(smem_u32(&bars[c]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      mbar_expect_tx(smem_u32(&bars[c]), CB);
      bulk_load(sbase + c * CB, xr + c * CB, CB, smem_u32(&bars[c]));
    }
  }
  float m = NEG_INF, s = 0.f;
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
    mbar_wait(smem_u32(&bars[c]), 0);
    uint4 v[JPC];
    float cm0 = NEG_INF, cm1 = NEG_INF;
#pragma unroll
    for (int j = 0; j < JPC; ++j) {
      v[j] = *reinterpret_cast<const uint4*>(sm + c * CB + (tid + j * THREADS) * 16);
      const unsigned w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) { float lo, hi; unpack2(w[i], lo, hi); cm0 = fmaxf(cm0, lo); cm1 = fmaxf(cm1, hi); }
    }
    const float mn = fmaxf(m, fmaxf(cm0, cm1));
    const float ms = mn == NEG_INF ? 0.f : mn;
    s *= ex2((m - ms) * LOG2E);
    float s0 = 0.f, s1 = 0.f;
#pragma unroll
    for (int j = 0; j < JPC; ++j) {
      const unsigned w[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int i = 0; i < 4; ++i) { float lo, hi; unpack2(w[i], lo, hi); s0 += ex2((lo - ms) * LOG2E); s1 += ex2((hi - ms) * LOG2E); }
    }
    s += s0 + s1;
    m = mn;
  }
  // block reduction of (max, sum)
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
    const float mn = fmaxf(m, om), ms = mn == NEG_INF ? 0.f : mn;
    s = s * ex2((m - ms) * LOG2E) + os * ex2((om - ms) * LOG2E);
    m = mn;
  }
  if (tid % 32 == 0) { red_m[tid / 32] = m; red_s[tid / 32] = s; }
  __syncthreads();
  m = NEG_INF; s = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) {
    const float om = red_m[w], os = red_s[w];
    const float mn = fmaxf(m, om), ms = mn == NEG_INF ? 0.f : mn;
    s = s * ex2((m - ms) * LOG2E) + os * ex2((om - ms) * LOG2E);
    m = mn;
  }
  const float ms = m == NEG_INF ? 0.f : m;
  const float lg = __logf(s);
#pragma unroll
  for (int c = 0; c < CHUNKS; ++c) {
#pragma unroll
    for (int j = 0; j < JPC; ++j) {
      const int off = c * CB + (tid + j * THREADS) * 16;
      uint4 v = *reinterpret_cast<const uint4*>(sm + off);
      unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) { float lo, hi; unpack2(w[i], lo, hi); w[i] = pack2((lo - ms) - lg, (hi - ms) - lg); }
      v = make_uint4(w[0], w[1], w[2], w[3]);
#if __BULK_STORE__
      *reinterpret_cast<uint4*>(sm + off) = v;
#else
      *reinterpret_cast<uint4*>(yr + off) = v;
#endif
    }
#if __BULK_STORE__
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
    if (tid == 0) { bulk_store(yr + c * CB, sbase + c * CB, CB); asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
#endif
  }
#if __BULK_STORE__
  if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
#endif
}
"""


def probe_kernel(dtype, threads, chunks, bulk_store, n=32768):
    src = (SRC.replace("__N__", str(n)).replace("__THREADS__", str(threads)).replace("__CHUNKS__", str(chunks))
           .replace("__BF16__", "1" if dtype == "bfloat16" else "0").replace("__BULK_STORE__", "1" if bulk_store else "0"))
    res = compile_source(src, "90")
    if not res.ok:
        raise RuntimeError(res.log)
    path = Path(os.environ.get("OUT", "/tmp")) / f"probe_{dtype}_{threads}_{chunks}_{int(bulk_store)}.cubin"
    path.write_bytes(res.cubin)
    k = cp.RawModule(path=str(path)).get_function("probe")
    k.max_dynamic_shared_size_bytes = 2 * n
    return k


def main():
    dtype = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    out = Path(os.environ.get("OUT", "."))
    fam = get_family("softmax")
    target = device_info().target
    prob = fam.problem("1024x32768", dtype, {"log": True})
    fprob = fam.problem("1024x32768", dtype, {})
    contenders = {}
    fam_sets = {
        "log t512 smem online smem c8 stagger1000": (prob, "storage=smem,threads=512,row_threads=512,normalise=online,reduce=smem,chunks=8,stagger=1000"),
        "log t1024 smem online shuffle c4 stagger2000": (prob, "storage=smem,threads=1024,row_threads=1024,normalise=online,reduce=shuffle,chunks=4,stagger=2000"),
        "log t256 smem online shuffle c4": (prob, "storage=smem,threads=256,row_threads=256,normalise=online,reduce=shuffle,chunks=4"),
        "fwd t256 smem online shuffle c4 keep": (fprob, "storage=smem,threads=256,row_threads=256,normalise=online,reduce=shuffle,chunks=4,keep_exp=true"),
    }
    space = space_of(fam)
    sets = _timing_sets(fam, build_variant(fam, prob, fam.default_params(prob, target), target), seed=54321)
    for label, (p, spec) in fam_sets.items():
        params = fam.default_params(p, target)
        for item in spec.split(","):
            k, _, v = item.partition("=")
            params[k] = space.parse_value(k, v)
        var = build_variant(fam, p, params, target)
        res = compile_source(var.source, target.arch)
        lv = LoadedVariant(var, res.cubin)
        print(label, var.name, "verify:", verify(fam, lv, seed=1) or "ok", flush=True)
        contenders[label] = (lambda i, lv=lv: lv.launch(sets[i]))
    # the probe kernels: verify against the family's check on fresh data
    rng = cp.random.default_rng(7)
    xin = fam.make_inputs(prob, "normal", cp, rng)["x"]
    for threads in (256, 512, 1024):
        for chunks in (2, 4, 8):
            if 2 * 32768 // chunks // 16 % threads:
                continue
            for bulk in (False, True):
                try:
                    k = probe_kernel(dtype, threads, chunks, bulk)
                except Exception as exc:
                    print("compile failed", threads, chunks, bulk, str(exc)[:2000]); continue
                label = f"bulk-load t{threads} c{chunks} {'bulk-store' if bulk else 'st.global'}"
                yv = cp.full_like(xin, 7)
                k((1024,), (threads,), (xin, yv), shared_mem=65536)
                cp.cuda.runtime.deviceSynchronize()
                wrong = fam.check(prob, {"x": xin}, {"y": yv}, cp)
                print(label, "verify:", wrong or "ok", flush=True)
                if wrong:
                    continue
                contenders[label] = (lambda i, k=k, threads=threads: k((1024,), (threads,), (sets[i]["x"], sets[i]["y"]), shared_mem=65536))
    copy_us = []
    times = {k: [] for k in contenders}
    for r in range(rounds):
        copy_us.append(time_copy(1024 * 32768 * 2, target.l2_bytes).median_us)
        for label, run in contenders.items():
            times[label].append(time_gpu(run, len(sets), reps=40).median_us)
    copy = statistics.median(copy_us)
    rows = sorted(((statistics.median(t), label, t) for label, t in times.items()))
    (out / f"bulk_probe_{dtype}.json").write_text(json.dumps({"copy_us": copy_us, "times": times}, indent=1))
    print(f"{dtype} copy {copy:.2f} us (rounds {' '.join(f'{c:.2f}' for c in copy_us)})")
    for med, label, t in rows:
        print(f"  {med:7.2f} us {100 * copy / med:5.1f}%  {label:50} [{' '.join(f'{x:.2f}' for x in t)}]")


if __name__ == "__main__":
    main()
