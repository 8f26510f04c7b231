"""Flash-attention forward: autosoft against torch SDPA with each backend forced (flash, efficient, cuDNN), its default and FA4.

    python benchmarks/attention.py --cache attention.sqlite --trials 16 --out attention.json
    python benchmarks/attention.py --no-tune --shapes 1,32,8192,64 --dtypes bfloat16 --causal no

For every shape x dtype x (full, causal): autosoft's variant (tuned, or taken from --cache when
the entry is there; with --no-tune the heuristic default) is verified once against the float64
reference, then autosoft and every SDPA backend are timed on the same torch tensors by the same
method (autosoft.timing.time_gpu: CUDA events, spin-blocked queue, median, inputs rotated so no
run reads them from L2); FlashAttention-4 (flash_attn.cute.interface.flash_attn_func on
(B, N, H, D) copies of the same tensors) too where it imports (the peer flash-attn-4: run through
/tmp/peers/run.py after peer-install), else its column stays empty. TFLOP/s counts 4*B*H*N*N*D, halved for causal. --sweep times every
valid variant of the search space instead (verifying the fastest few) to see the whole landscape;
--seeds K times the default and its first K seeds (those matching --match NAME=VALUE,...), each
verified, beside cuDNN timed before and after them on the same tensors: an ablation in one run.
--ablate TABLE.json takes the variants a tuned run wrote (its rows, filtered by --shapes, --dtypes
and --causal where given) and times each beside itself with one technique it uses removed at a
time (ABLATIONS), and beside the mma kernel's default (no wgmma, TMA or producer warpgroup), the
same way: what each technique is worth on that row.

    python benchmarks/attention.py --seeds 12 --shapes 8,32,2048,128 --dtypes bfloat16 --causal yes
    python benchmarks/attention.py --ablate attention_tuned_bf16.json --shapes "16,16,512,64" --out ablation.json
"""
from __future__ import annotations

import argparse
import atexit
import concurrent.futures as cf
import json
import math
import multiprocessing as mp
import sys
import time
import traceback
from functools import lru_cache
from typing import Any
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.runners import GpuRunner  # noqa: E402
from autosoft.compile import compile_source  # noqa: E402
from autosoft.evaluate import poisoned, verify  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import Problem, Target, build_variant, space_of  # noqa: E402
from autosoft.runtime import LoadedVariant, device_info  # noqa: E402
from autosoft.timing import rotation_count, time_gpu  # noqa: E402
from autosoft.tune import tuned_kernel  # noqa: E402
from autosoft.kernel_store import default_store  # noqa: E402

from attention_backward import fa4_function  # noqa: E402
from provenance import commit  # noqa: E402

SHAPES = [(1, 32, 8192, 64), (4, 16, 1024, 64), (4, 16, 4096, 64), (4, 16, 4096, 128), (2, 16, 16384, 128),
          (16, 16, 512, 64)]
DTYPES = ("float16", "bfloat16")
BACKENDS = ("flash", "efficient", "cudnn", "default")

FAMILY = get_family("attention")

# What --ablate removes, one at a time, from a tuned wgmma variant that uses it: the parameter
# values that remove it (a schedule that needs the removed one goes with it: chain needs the
# overlap and persistent blocks, a queue needs persistent blocks)
ABLATIONS: tuple[tuple[str, dict], ...] = (
    ("no overlap", {"overlap": False, "chain": False}),
    ("no ping-pong", {"pingpong": False}),
    ("no chain", {"chain": False}),
    ("not persistent", {"persistent": False, "queue": False, "chain": False}),
    ("no queue", {"queue": False}),
    ("not longest first", {"lpt": False}),
    ("one block per SM", {"blocks_per_sm": 1}),
)


def autosoft_variant(problem: Problem, cache: Cache | None, trials: int, seed: int) -> tuple[LoadedVariant, str]:
    """The cached variant for this problem (tuning it first when the cache has none), or the default."""
    if cache is not None:
        loaded, tuned_now = tuned_kernel(FAMILY, problem, cache, trials, runner=_tuning_runner(), seed=seed)
        return loaded, "tuned" if tuned_now else "cached"
    device = device_info()
    variant = build_variant(FAMILY, problem, FAMILY.default_params(problem, device.target), device.target)
    return LoadedVariant(variant, default_store().get_or_compile(variant)), "default"


@lru_cache(maxsize=1)
def _tuning_runner() -> GpuRunner:
    """One GPU worker process for every tune of the run (starting one costs seconds)."""
    runner = GpuRunner()
    atexit.register(runner.close)
    return runner


class Inputs:
    """Rotated sets of q, k, v (torch tensors when torch is there, else CuPy arrays) and outputs."""

    def __init__(self, torch, problem: Problem):
        self.torch = torch
        n_sets = rotation_count(FAMILY.bytes_moved(problem), device_info().target.l2_bytes, max_bytes=2 << 30)
        self.n_sets = n_sets
        self.scale = np.float32(1.0 / math.sqrt(problem.shape[3]))
        self.sets = []
        if torch is not None:
            tdtype = getattr(torch, problem.dtype)
            for _ in range(n_sets):
                q, k, v = (torch.randn(problem.shape, device="cuda").to(tdtype) for _ in range(3))
                o = torch.empty_like(q)
                lse = torch.empty(problem.shape[:3], device="cuda", dtype=torch.float32)
                self.sets.append({"q": q, "k": k, "v": v, "o": o, "lse": lse})
        else:
            import cupy as cp

            rng = cp.random.default_rng(0)
            for _ in range(n_sets):
                s = FAMILY.make_inputs(problem, "normal", cp, rng)
                s.pop("scale")
                s.update({n: poisoned(shape, dtype, cp) for n, (shape, dtype) in FAMILY.output_specs(problem).items()})
                self.sets.append(s)

    @lru_cache(maxsize=None)
    def bnhd(self, i: int) -> tuple:
        """Set i's q, k and v as (B, N, H, D) contiguous copies, FA4's layout."""
        return tuple(self.sets[i][n].transpose(1, 2).contiguous() for n in ("q", "k", "v"))

    def buffers(self, i: int) -> dict:
        s = self.sets[i]
        ptr = (lambda a: a.data_ptr()) if self.torch is not None else (lambda a: a.data.ptr)
        return {**{n: ptr(a) for n, a in s.items()}, "scale": self.scale}


def time_autosoft(loaded: LoadedVariant, inputs: Inputs, reps: int) -> float:
    return time_gpu(lambda i: loaded.launch(inputs.buffers(i)), inputs.n_sets, reps).median_us


def time_sdpa(torch, inputs: Inputs, causal: bool, backend: str, reps: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
              "cudnn": SDPBackend.CUDNN_ATTENTION}.get(backend)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run(i: int) -> None:
        s = inputs.sets[i]
        sdpa(s["q"], s["k"], s["v"], is_causal=causal)

    try:
        if forced is None:
            run(0)
            torch.cuda.synchronize()
            return {"us": time_gpu(run, inputs.n_sets, reps).median_us}
        with sdpa_kernel(forced):
            run(0)
            torch.cuda.synchronize()
            return {"us": time_gpu(run, inputs.n_sets, reps).median_us}
    except Exception as exc:  # noqa: BLE001 - a backend that does not support this shape/GPU
        return {"us": None, "error": " ".join(str(exc).split())[:200]}


def time_fa4(torch, inputs: Inputs, causal: bool, reps: int) -> dict:
    """FlashAttention-4's forward on the rotated sets, and its largest difference from SDPA on the
    first; {"us": None, "error": ...} where it does not import or refuses the problem."""
    fa4 = fa4_function()
    if fa4 is None:
        return {"us": None, "error": "flash_attn.cute does not import"}

    def run(i: int) -> Any:
        out = fa4(*inputs.bnhd(i), causal=causal)
        return out[0] if isinstance(out, tuple) else out

    try:
        for i in range(3):  # FA4 compiles each configuration on its first calls
            run(i % inputs.n_sets)
        torch.cuda.synchronize()
        us = time_gpu(run, inputs.n_sets, reps).median_us
        first = inputs.sets[0]
        ref = torch.nn.functional.scaled_dot_product_attention(first["q"], first["k"], first["v"], is_causal=causal,
                                                               enable_gqa=first["k"].shape[1] != first["q"].shape[1])
        diff = float((run(0).transpose(1, 2).float() - ref.float()).abs().max())
        return {"us": us, "max_abs_diff_vs_sdpa": diff}
    except Exception as exc:  # noqa: BLE001 - FA4 refuses this problem or this GPU
        return {"us": None, "error": " ".join(str(exc).split())[:200]}


def bench_one(torch, problem: Problem, cache: Cache | None, trials: int, seed: int, reps: int) -> dict:
    causal = "causal" in problem.flags
    flops = FAMILY.flops(problem)
    row = {"shape": "x".join(map(str, problem.shape)), "dtype": problem.dtype, "causal": causal, "flops": flops}
    t0 = time.perf_counter()
    loaded, source = autosoft_variant(problem, cache, trials, seed)
    row.update(variant=loaded.variant.name, params=dict(loaded.variant.params), source=source,
               tune_s=round(time.perf_counter() - t0, 2))
    wrong = verify(FAMILY, loaded, seed=seed + 1)
    row["verified"] = wrong is None
    if wrong:
        row["verify_error"] = wrong
    inputs = Inputs(torch, problem)
    row["autosoft_us"] = time_autosoft(loaded, inputs, reps)
    if torch is not None:
        for backend in BACKENDS:
            r = time_sdpa(torch, inputs, causal, backend, reps)
            row[f"{backend}_us"] = r["us"]
            if "error" in r:
                row[f"{backend}_error"] = r["error"]
        r = time_fa4(torch, inputs, causal, reps)
        row["fa4_us"] = r["us"]
        row.update({f"fa4_{k}": v for k, v in r.items() if k != "us"})
        last = inputs.sets[(3 + reps - 1) % inputs.n_sets]  # written by the last timed autosoft run
        ref = torch.nn.functional.scaled_dot_product_attention(last["q"], last["k"], last["v"], is_causal=causal)
        row["max_abs_diff_vs_sdpa"] = float((last["o"].float() - ref.float()).abs().max())
    for k in ("autosoft", *BACKENDS, "fa4"):
        t = row.get(f"{k}_us")
        row[f"{k}_tflops"] = flops / (t * 1e-6) / 1e12 if t else None
    for k in ("flash", "cudnn", "fa4"):
        t = row.get(f"{k}_us")
        row[f"speedup_vs_{k}"] = t / row["autosoft_us"] if t else None
    return row


def sweep_one(problem: Problem, reps: int, verify_top: int = 3) -> dict:
    """Time every valid variant on one input set; verify the fastest few."""
    device = device_info()
    points = space_of(FAMILY).valid_points(FAMILY.problem_values(problem, device.target))
    variants = [build_variant(FAMILY, problem, p, device.target) for p in points]
    with cf.ProcessPoolExecutor(max_workers=min(16, len(variants)), mp_context=mp.get_context("spawn")) as pool:
        results = list(pool.map(compile_source, [v.source for v in variants], [v.target.arch for v in variants]))
    inputs = Inputs(None, problem)
    timed = []
    for v, r in zip(variants, results):
        if not r.ok:
            timed.append({"variant": v.name, "error": "compile_fail"})
            continue
        loaded = LoadedVariant(v, r.cubin)
        timed.append({"variant": v.name, "params": dict(v.params), "us": time_autosoft(loaded, inputs, reps),
                      "loaded": loaded})
    ok = sorted((t for t in timed if "us" in t), key=lambda t: t["us"])
    for t in ok[:verify_top]:
        wrong = verify(FAMILY, t["loaded"], seed=1)
        t["verified"] = wrong is None
        if wrong:
            t["verify_error"] = wrong
    for t in timed:
        t.pop("loaded", None)
        if "us" in t:
            t["tflops"] = FAMILY.flops(problem) / (t["us"] * 1e-6) / 1e12
    default = FAMILY.variant_name(problem, FAMILY.default_params(problem, device.target))
    return {"shape": "x".join(map(str, problem.shape)), "dtype": problem.dtype, "causal": "causal" in problem.flags,
            "default": default, "variants": sorted(timed, key=lambda t: t.get("us", math.inf))}


def ablation_points(problem: Problem, params: dict, target: Target) -> list[tuple[str, dict]]:
    """params labelled "tuned", then for a wgmma variant each ABLATIONS entry whose technique it
    uses (its first parameter differs from the removed value) and whose removal is a valid point,
    then the mma kernel's default (the one it takes where sm_90a's instructions are not there)."""
    points = [("tuned", dict(params))]
    if params.get("engine") != "wgmma":
        return points
    for label, removed in ABLATIONS:
        name, value = next(iter(removed.items()))
        point = {**params, **removed}
        if params.get(name) != value and FAMILY.is_valid(problem, target, point):
            points.append((label, point))
    points.append(("mma kernel (default)", FAMILY.default_params(problem, Target.for_arch("80"))))
    return points


def seeds_one(torch, problem: Problem, count: int, reps: int, match: str = "") -> dict:
    """The default and the first `count` seeds (matching `match`), each verified, timed on one
    rotated set of torch tensors between two timings of cuDNN."""
    target = device_info().target
    want = dict(item.split("=", 1) for item in filter(None, match.split(",")))
    seeds = [p for p in FAMILY.seed_params(problem, target)
             if all(str(p.get(name)).lower() == value.lower() for name, value in want.items())]
    points = [("default", FAMILY.default_params(problem, target))]
    points += [(f"seed {i + 1}", p) for i, p in enumerate(seeds[:count])]
    return side_by_side(torch, problem, points, reps)


def side_by_side(torch, problem: Problem, points: list[tuple[str, dict]], reps: int) -> dict:
    """Each labelled point's variant verified and timed on one rotated set of torch tensors,
    between two timings of cuDNN."""
    target = device_info().target
    variants = [build_variant(FAMILY, problem, p, target) for _, p in points]
    with cf.ThreadPoolExecutor(max_workers=16) as pool:  # NVRTC releases the GIL while it compiles
        built = list(pool.map(lambda v: compile_source(v.source, v.target.arch), variants))
    inputs = Inputs(torch, problem)
    causal = "causal" in problem.flags
    cudnn = [time_sdpa(torch, inputs, causal, "cudnn", reps)["us"]]
    timed = []
    for (label, _), variant, result in zip(points, variants, built):
        row: dict = {"label": label, "variant": variant.name, "params": dict(variant.params)}
        if not result.ok:
            row["error"] = "compile_fail: " + " ".join(result.log.split())[:200]
        else:
            loaded = LoadedVariant(variant, result.cubin)
            wrong = verify(FAMILY, loaded, seed=1)
            row["verified"] = wrong is None
            if wrong:
                row["verify_error"] = wrong
            row["us"] = time_autosoft(loaded, inputs, reps)
            row["tflops"] = FAMILY.flops(problem) / (row["us"] * 1e-6) / 1e12
        timed.append(row)
    cudnn.append(time_sdpa(torch, inputs, causal, "cudnn", reps)["us"])
    fa4 = time_fa4(torch, inputs, causal, reps)
    return {"shape": "x".join(map(str, problem.shape)), "dtype": problem.dtype, "causal": causal,
            "cudnn_us": cudnn, "fa4_us": fa4["us"], "fa4_error": fa4.get("error"), "variants": timed}


def tuned_rows(paths: str, shapes: str, dtypes: str, causal: str) -> list[tuple[Problem, dict]]:
    """(problem, tuned params) of every verified row of the tuned runs' JSON files (comma-separated
    paths), keeping those of the given shapes ("B,H,N,D;..."; empty: all), dtypes and masks."""
    keep_shapes = {tuple(FAMILY.parse_shape(s)) for s in shapes.split(";")} if shapes else None
    masks = {"both": (False, True), "no": (False,), "yes": (True,)}[causal]
    out = []
    for path in paths.split(","):
        for row in json.loads(Path(path).read_text())["rows"]:
            shape = tuple(int(x) for x in row["shape"].split("x"))
            if ("params" not in row or not row.get("verified") or row["dtype"] not in dtypes.split(",")
                    or row["causal"] not in masks or (keep_shapes is not None and shape not in keep_shapes)):
                continue
            problem = FAMILY.problem(",".join(map(str, shape)), row["dtype"], ("causal",) if row["causal"] else ())
            out.append((problem, row["params"]))
    return out


def print_seeds(result: dict) -> None:
    for s in result["seeds"]:
        cudnn = min((t for t in s["cudnn_us"] if t), default=None)
        head = f"\n{s['shape']} {s['dtype']} {'causal' if s['causal'] else 'full'}"
        fa4 = s.get("fa4_us")
        print(head + (f": cuDNN {cudnn:.1f} us (runs {', '.join(_fmt(t) for t in s['cudnn_us'])})" if cudnn else "")
              + (f", FA4 {fa4:.1f} us" if fa4 else ""))
        for v in s["variants"]:
            if "us" not in v:
                print(f"  {v['label']} {v['variant']} {v['error']}")
                continue
            ratio = (f"{cudnn / v['us']:.3f}x cuDNN" if cudnn else "") + (f" {fa4 / v['us']:.3f}x FA4" if fa4 else "")
            mark = "" if v["verified"] else f" WRONG {v['verify_error']}"
            print(f"  {v['us']:10.1f} us {v['tflops']:7.1f} TF/s {ratio}  {v['label']:20} {v['variant']}{mark}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("attention_bench.json"))
    parser.add_argument("--cache", type=Path, default=Path("attention_sweep.sqlite"),
                        help="tuned-kernel cache: entries found there are re-used, missing ones tuned into it")
    parser.add_argument("--trials", type=int, default=16, help="tuning trials per problem")
    parser.add_argument("--no-tune", action="store_true", help="time the heuristic default variant, no tuning")
    parser.add_argument("--sweep", action="store_true", help="time every valid variant instead (no torch)")
    parser.add_argument("--seeds", type=int, default=0, metavar="K",
                        help="time the default and its first K seeds instead, beside cuDNN (needs torch)")
    parser.add_argument("--match", default="", help="with --seeds: only seeds with these NAME=VALUE,... values")
    parser.add_argument("--ablate", default="", metavar="TABLE.json[,...]",
                        help="time each tuned row of these runs' JSON beside itself with one technique removed "
                             "at a time, and beside cuDNN (needs torch)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    parser.add_argument("--shapes", default="", help="semicolon-separated B,H,N,D list (default: the benchmark set)")
    args = parser.parse_args()

    shapes = [FAMILY.parse_shape(s) for s in args.shapes.split(";")] if args.shapes else SHAPES
    flag_sets = {"both": [(), ("causal",)], "no": [()], "yes": [("causal",)]}[args.causal]
    problems = [FAMILY.problem(",".join(map(str, s)), d, f) for s in shapes for d in args.dtypes.split(",")
                for f in flag_sets]
    device = device_info()
    result: dict = {"gpu": device.name, "cc": device.compute_capability, "nvrtc": device.cuda_version,
                    "commit": commit()}

    if args.sweep:
        result["sweeps"] = []
        for problem in problems:
            result["sweeps"].append(sweep_one(problem, args.reps))
            args.out.write_text(json.dumps(result, indent=1))
        print_sweeps(result)
        return 0

    try:
        import torch
    except ImportError:
        torch = None
        print("torch is not importable: timing autosoft alone", file=sys.stderr)
    result["torch"] = getattr(torch, "__version__", None)
    if args.ablate:
        if torch is None:
            print("--ablate times cuDNN beside the variants: it needs torch", file=sys.stderr)
            return 2
        result["seeds"] = []
        target = device_info().target
        for problem, params in tuned_rows(args.ablate, args.shapes, args.dtypes, args.causal):
            points = ablation_points(problem, params, target)
            result["seeds"].append(side_by_side(torch, problem, points, args.reps))
            args.out.write_text(json.dumps(result, indent=1))
        print_seeds(result)
        return 0
    if args.seeds:
        if torch is None:
            print("--seeds times cuDNN beside the variants: it needs torch", file=sys.stderr)
            return 2
        result["seeds"] = []
        for problem in problems:
            result["seeds"].append(seeds_one(torch, problem, args.seeds, args.reps, args.match))
            args.out.write_text(json.dumps(result, indent=1))
        print_seeds(result)
        return 0
    cache = None if args.no_tune else Cache(args.cache)
    result["rows"] = []
    for problem in problems:
        try:
            row = bench_one(torch, problem, cache, args.trials, args.seed, args.reps)
        except Exception as exc:  # noqa: BLE001 - one broken problem must not end the sweep
            traceback.print_exc()
            row = {"shape": "x".join(map(str, problem.shape)), "dtype": problem.dtype,
                   "causal": "causal" in problem.flags, "error": " ".join(str(exc).split())[:300]}
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1))  # partial results survive a kill
        print(_line(row), flush=True)
    print_table(result)
    return 0


def _fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def _line(r: dict) -> str:
    head = f"{r['shape']:>16} {r['dtype']:8} {'causal' if r['causal'] else 'full':6}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    return (f"{head} autosoft {_fmt(r['autosoft_tflops'])} TF/s  flash {_fmt(r.get('flash_tflops'))}  "
            f"cudnn {_fmt(r.get('cudnn_tflops'))}  [{r['variant']}, {r['source']}]")


def print_table(result: dict) -> None:
    print(f"\nattention forward on {result['gpu']} (sm_{result['cc']}, NVRTC {result['nvrtc']}, "
          f"torch {result.get('torch')}), TFLOP/s")
    print("| B,H,N,D | dtype | mask | autosoft | flash | efficient | cudnn | sdpa default | fa4 | vs flash | vs cudnn "
          "| vs fa4 | verified | variant |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        mask = "causal" if r["causal"] else "full"
        if "error" in r:
            print(f"| {r['shape']} | {r['dtype']} | {mask} | error: {r['error'][:100]} |")
            continue
        print(f"| {r['shape']} | {r['dtype']} | {mask} | {_fmt(r['autosoft_tflops'])} | {_fmt(r.get('flash_tflops'))} "
              f"| {_fmt(r.get('efficient_tflops'))} | {_fmt(r.get('cudnn_tflops'))} | {_fmt(r.get('default_tflops'))} "
              f"| {_fmt(r.get('fa4_tflops'))} | {_fmt(r.get('speedup_vs_flash'), '.2f')}x "
              f"| {_fmt(r.get('speedup_vs_cudnn'), '.2f')}x | {_fmt(r.get('speedup_vs_fa4'), '.2f')}x "
              f"| {'yes' if r['verified'] else 'NO'} | {r['variant']} ({r['source']}) |")


def print_sweeps(result: dict) -> None:
    for s in result["sweeps"]:
        ok = [v for v in s["variants"] if "us" in v]
        print(f"\n{s['shape']} {s['dtype']} {'causal' if s['causal'] else 'full'}: {len(ok)} variants, "
              f"default {s['default']}")
        for v in ok[:12]:
            mark = {True: "ok", False: "WRONG"}.get(v.get("verified"), "")
            print(f"  {v['us']:10.1f} us {v['tflops']:7.1f} TF/s  {v['variant']} {mark}")
        d = next((v for v in ok if v["variant"] == s["default"]), None)
        if d:
            print(f"  default: {d['us']:.1f} us {d['tflops']:.1f} TF/s (rank {ok.index(d) + 1} of {len(ok)})")


if __name__ == "__main__":
    raise SystemExit(main())
