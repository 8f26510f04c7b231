"""When each thread block of one variant starts and ends, on which SM: where a kernel's time goes.

    python benchmarks/block_timeline.py --family attention --shape 1,32,1,128 --dtype bfloat16 \
        --option kv_heads=8 --option kv_len=4096 --set splits=16
    python benchmarks/block_timeline.py --family softmax --log --shape 1024x32768 --dtype bfloat16 \
        --set storage=smem,threads=1024,row_threads=1024,normalise=online,chunks=4,stagger=2000

The variant (the heuristic default, with --set's overrides) is rendered, and its kernel wrapped
in one that records %globaltimer (ns, one clock for the whole GPU) and %smid as each block starts
and ends. For the attention family's mma kernel, marks inside it record the moments between as
well: the first key tile in, the last key tile in, the main loop done, a split's partials
written (its key warps' parts merged), its arrival counted, the last block's merge done. The
instrumented kernel is verified, timed as any variant is (its event time, to compare with the
uninstrumented variant's), then launched --reps times, each right behind a launch on other inputs
(the GPU busy when it starts, its inputs not in the L2); every such launch's blocks are summarised:

  span        first block start to last block end
  busy        the fraction of (SMs x span) during which an SM holds at least one block
  sm_end      when the SMs finish their last block (min / 10% / median / 90% / max)
  block       block durations (min / 10% / median / 90% / max)
  marks       the median time of each mark over the blocks that reach it (n: how many)

One kernel per variant (split rows combined by a second launch are refused). --out writes every
block's times as JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.compile import compile_source  # noqa: E402
from autosoft.evaluate import _timing_sets, time_variant, verify  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import build_variant, space_of  # noqa: E402
from autosoft.runtime import LoadedVariant, device_info  # noqa: E402
from autosoft.timing import _dirty_l2  # noqa: E402

SLOTS = 16  # per block: 0 start, 1 end, 2.. marks, the last the SM
RECORDER = r'''
__device__ unsigned long long autosoft_timeline[MAX_BLOCKS * SLOTS];
__device__ __forceinline__ void timeline_mark(int slot) {
  if (threadIdx.x == 0) {
    unsigned long long t;
    unsigned sm;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    const unsigned long long block = blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
    autosoft_timeline[block * SLOTS + slot] = t;
    autosoft_timeline[block * SLOTS + SLOTS - 1] = sm;
  }
}
'''
# (text in the attention family's mma kernel, the same with a mark); text that the rendered
# variant lacks (no splits, one key warp) gives no mark
ATTENTION_MARKS = [
    ("__syncthreads();  // tile j visible to all;",
     "__syncthreads(); if (jt == 0) timeline_mark(2); if (jt == n_tiles - 1) timeline_mark(3);  // tile j visible to all;"),
    # the main loop done: whichever of these the variant has (the last one reached counts)
    ("  // Split keys: this block's O", "  timeline_mark(4);\n  // Split keys: this block's O"),
    ("  // Split keys in a cluster of SPLITS blocks", "  timeline_mark(4);\n  // Split keys in a cluster of SPLITS blocks"),
    ("  // The warps of a row group saw different keys", "  timeline_mark(4);\n  // The warps of a row group saw different keys"),
    ("  // epilogue: O /= l", "  timeline_mark(4);\n  // epilogue: O /= l"),
    # a split's partials written (to the workspace, or to shared memory for its cluster)
    ("  // Arrival, as CUTLASS's grid barrier does it", "  timeline_mark(5);\n  // Arrival, as CUTLASS's grid barrier does it"),
    ("  cluster_sync();  // every block's partials are in its shared memory",
     "  timeline_mark(5);\n  cluster_sync();  // every block's partials are in its shared memory"),
    ("  if (!last_block) return;", "  timeline_mark(6);\n  if (!last_block) return;"),
    ("if (c4 == 0) lse[flat] = wsum > 0.f ? mx + logf(wsum) : NEG_INF;\n  }\n",
     "if (c4 == 0) lse[flat] = wsum > 0.f ? mx + logf(wsum) : NEG_INF;\n  }\n  __syncthreads();\n  timeline_mark(7);\n"),
]
MARK_NAMES = {2: "first tile in", 3: "last tile in", 4: "loop done", 5: "partials written", 6: "arrived", 7: "merged"}


def instrument(source: str, kernel: str, max_blocks: int, attention_marks: bool) -> str:
    """The source with `kernel` renamed into a device function that a new kernel of the old name
    and attributes calls between a start and an end mark."""
    match = re.search(r'extern "C" __global__ void ((?:__\w+__(?:\([^)]*\))?\s*)*)' + re.escape(kernel) + r"\(([^)]*)\)\s*\{", source)
    if match is None:
        raise SystemExit(f"block_timeline: no kernel {kernel} in the rendered source")
    attributes, params = match.group(1), match.group(2)
    names = [re.findall(r"\w+", p)[-1] for p in params.split(",") if p.strip()]
    body = source[match.end():]
    if "__grid_constant__" in params:  # a tensor map passed on by value is no longer one TMA can use
        raise SystemExit(f"block_timeline: {kernel} takes tensor maps; only kernels without them can be wrapped")
    if attention_marks:
        for text, marked in ATTENTION_MARKS:
            body = body.replace(text, marked)
    recorder = RECORDER.replace("MAX_BLOCKS", str(max_blocks)).replace("SLOTS", str(SLOTS))
    return (source[:match.start()] + recorder + f"__device__ __forceinline__ void {kernel}_body({params}) {{" + body
            + f'\nextern "C" __global__ void {attributes}{kernel}({params}) {{\n  timeline_mark(0);\n'
            + f"  {kernel}_body({', '.join(names)});\n  __syncthreads();\n  timeline_mark(1);\n}}\n")


def summary(times: np.ndarray, sm_count: int) -> dict:
    start = times[:, 0]
    t0 = start.min()
    start, end, sm = start - t0, times[:, 1] - t0, times[:, SLOTS - 1]
    span = int(end.max())
    busy = 0
    for s in np.unique(sm):
        intervals = sorted(zip(start[sm == s], end[sm == s]))
        lo, hi = intervals[0]
        for a, b in intervals[1:]:
            if a > hi:
                busy, lo, hi = busy + hi - lo, a, b
            else:
                hi = max(hi, b)
        busy += hi - lo
    quantiles = (0, 0.1, 0.5, 0.9, 1)
    marks = {}
    for slot, name in MARK_NAMES.items():
        reached = times[:, slot] > 0
        if reached.any():
            marks[name] = {"median_ns": int(np.median(times[reached, slot] - t0)), "n": int(reached.sum())}
    return {"span_ns": span, "busy": round(busy / (sm_count * span), 4),
            "sm_end_ns": [int(x) for x in np.quantile([end[sm == s].max() for s in np.unique(sm)], quantiles)],
            "block_ns": [int(x) for x in np.quantile(end - start, quantiles)], "marks": marks}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="softmax")
    parser.add_argument("--shape", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--log", action="store_true", help="the softmax families' log option")
    parser.add_argument("--option", action="append", default=[], help="NAME=VALUE, a problem option (repeatable)")
    parser.add_argument("--set", default="", help="NAME=VALUE,NAME=VALUE,... over the heuristic default")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, help="JSON file for every block's times")
    args = parser.parse_args()
    family = get_family(args.family)
    options: dict = {"log": True} if args.log else {}
    declared = {o.name: o for o in family.options}
    for item in args.option:
        name, _, value = item.partition("=")
        if name not in declared:
            parser.error(f"--option {item}: the {family.name} family has no option {name!r}")
        options[name] = declared[name].parse(value)
    problem = family.problem(args.shape, args.dtype, options)
    target = device_info().target
    params = family.default_params(problem, target)
    space = space_of(family)
    for item in filter(None, args.set.split(",")):
        name, _, value = item.partition("=")
        params[name] = space.parse_value(name, value)
    variant = build_variant(family, problem, params, target)
    if len(variant.launches) != 1:
        parser.error(f"{variant.name} launches {len(variant.launches)} kernels; this tool follows one")
    launch = variant.launches[0]
    blocks = int(np.prod(launch.grid))
    source = instrument(variant.source, launch.kernel, blocks,
                        family.name == "attention" and params.get("engine", "mma") == "mma")
    compiled = compile_source(source, target.arch)
    if not compiled.ok:
        raise SystemExit(compiled.log[:3000])
    loaded = LoadedVariant(dataclasses.replace(variant, source=source), compiled.cubin)
    wrong = verify(family, loaded, seed=1)
    if wrong:
        raise SystemExit(f"{variant.name} instrumented: WRONG {wrong}")
    cp = __import__("cupy")
    pointer = loaded._module.get_global_var("autosoft_timeline")  # the module's own global
    timeline = cp.ndarray((blocks * SLOTS,), cp.uint64,
                          cp.cuda.MemoryPointer(cp.cuda.UnownedMemory(pointer, blocks * SLOTS * 8, loaded), 0))
    event_us = time_variant(family, loaded, reps=60).median_us
    sets = _timing_sets(family, variant, seed=1)
    print(f"{variant.name}: {blocks} blocks of {int(np.prod(launch.block))} threads, "
          f"event median {event_us:.2f} us (instrumented)")
    reps = []
    for rep in range(args.reps):
        _dirty_l2()
        loaded.launch(sets[(rep + 1) % len(sets)])
        timeline.fill(0)  # in stream order: only the next launch's marks remain
        loaded.launch(sets[rep % len(sets)])
        cp.cuda.runtime.deviceSynchronize()
        times = timeline.get().reshape(blocks, SLOTS).astype(np.int64)
        info = summary(times, target.sm_count)
        reps.append({**info, "blocks": times.tolist()})
        marks = "  ".join(f"{name} {m['median_ns']}" + (f" (n={m['n']})" if m["n"] != blocks else "")
                          for name, m in info["marks"].items())
        print(f"  launch {rep}: span {info['span_ns']} ns, busy {100 * info['busy']:.1f}%, "
              f"SMs end {info['sm_end_ns']}, blocks {info['block_ns']}" + (f"\n    marks (median ns): {marks}" if marks else ""))
    if args.out:
        args.out.write_text(json.dumps({"variant": variant.name, "event_us": event_us, "launches": reps}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
