"""Softmax: autosoft against torch.softmax and a Triton row softmax, against the copy limit.

    python benchmarks/softmax.py --cache sweep.sqlite --trials 40 --out softmax.json
    python benchmarks/softmax.py --mode log ...            # log-softmax against torch.log_softmax
    python benchmarks/softmax.py --mode backward ...       # softmax_backward against torch._softmax_backward_data
    python benchmarks/softmax.py --mode log_backward ...   # ... against torch._log_softmax_backward_data

For every shape x dtype: a device-to-device copy of the same bytes (input read + output
written) is timed as the limit; autosoft is tuned (or taken from the cache when the entry is
there); the copy, autosoft, torch.softmax and the Triton kernel are then timed the same way
(CUDA events, spin-blocked queue, inputs rotated so every run reads cold data, and every
output written into rotated buffers too), in --rounds rounds that take turns: each figure is
the median of its rounds' medians. torch.softmax writes through its out= form (the same
kernel): allocating its output in the timing loop hands it the block it just freed, still in
L2, which on the H200 made it 1-10% faster than writing a buffer of the rotation. That is
also timed and kept in the JSON as torch_fresh_output_us.
Running it again with the same --cache re-uses the tuned kernels: the tuned cache for the
sweep is reproducible with this one command. Last, autosoft.softmax and torch.softmax are
timed per call from Python (host overhead included) on the tuned 4096x128 float32 and on 1x1, in a
fresh process that loads the cache as a user's program would (--host-only runs just that, printing
a table on stderr and the JSON on stdout; with `autosoft native` built, autosoft.softmax takes its
compiled entry, and the same calls with the extension turned off take turns beside it).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402
from autosoft.tune import tuned_kernel  # noqa: E402
from autosoft.runners import GpuRunner  # noqa: E402

SWEEP = [(4096, n) for n in (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)] + [
    (1024, 32768), (65536, 64), (32, 131072), (8, 262144), (1, 1048576), (16384, 4000), (4096, 50257)]
DTYPES = ("float32", "float16", "bfloat16")


def medians_in_turns(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each timer's median over `rounds` rounds that take turns: drift of the GPU's clocks or of
    the host weighs on every contender alike, and the median of the rounds drops a stray one."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, timer in timers.items():
            samples[name].append(timer())
    return {name: statistics.median(values) for name, values in samples.items()}


MODES = ("forward", "log", "backward", "log_backward")
"""forward: softmax; log: the log-softmax (softmax family, option log); backward and log_backward:
the softmax_backward family (dx from y and dy), against torch's own backward kernels."""


def problem_of(mode: str, shape_text: str, dtype: str):
    family = get_family("softmax_backward" if mode.endswith("backward") else "softmax")
    return family.problem(shape_text, dtype, {"log": True} if mode.startswith("log") else {})


def bench_one(torch, problem, cache: Cache, trials: int, seed: int, reps: int, rounds: int,
              runner: GpuRunner, mode: str = "forward") -> dict:
    """One problem of `mode`: the copy of the same bytes, autosoft (tuned, or from the cache) and
    torch's kernel for it (and Triton's row softmax for the forward), timed in turns."""
    from triton_softmax import TritonSoftmax

    m, n = problem.shape
    tdtype = getattr(torch, problem.dtype)
    family = get_family(problem.family)
    nbytes = family.bytes_moved(problem)
    device = device_info()
    n_sets = rotation_count(nbytes, device.target.l2_bytes)
    log = mode.startswith("log")
    xs = [torch.randn(m, n, device="cuda").to(tdtype) for _ in range(n_sets)]
    row = {"shape": problem.shape_text, "dtype": problem.dtype, "bytes": nbytes, "mode": mode}

    t0 = time.perf_counter()
    loaded, tuned_now = tuned_kernel(problem.family, problem, cache, trials, runner=runner, seed=seed)
    row.update(variant=loaded.variant.name, tuned_now=tuned_now, tune_s=round(time.perf_counter() - t0, 2))
    timers = {"copy": lambda: time_copy(nbytes // 2, device.target.l2_bytes, reps).median_us}
    if mode.endswith("backward"):
        # y a true (log-)softmax output, dy fresh: what autograd hands the backward
        ys = [(torch.log_softmax if log else torch.softmax)(x.float(), -1).to(tdtype) for x in xs]
        dys = [torch.randn(m, n, device="cuda").to(tdtype) for _ in range(n_sets)]
        dxs = [torch.empty_like(x) for x in xs]
        torch_backward = torch._log_softmax_backward_data if log else torch._softmax_backward_data

        def ours(i: int) -> None:
            loaded.launch({"y": ys[i].data_ptr(), "dy": dys[i].data_ptr(), "dx": dxs[i].data_ptr()})

        timers["autosoft"] = lambda: time_gpu(ours, n_sets, reps).median_us
        timers["torch"] = lambda: time_gpu(lambda i: torch_backward(dys[i], ys[i], -1, tdtype), n_sets, reps).median_us
        dxs[0].fill_(float("nan"))  # poisoned: every element must be written by the checked run
        ours(0)
        expected = torch_backward(dys[0].double(), ys[0].double(), -1, torch.float64)
        row["autosoft_max_err"] = float((dxs[0].double() - expected).abs().max())
    else:
        ys = [torch.empty_like(x) for x in xs]
        torch_forward = torch.log_softmax if log else torch.softmax

        def ours(i: int) -> None:
            loaded.launch({"x": xs[i].data_ptr(), "y": ys[i].data_ptr()})

        timers["autosoft"] = lambda: time_gpu(ours, n_sets, reps).median_us
        timers["torch"] = lambda: time_gpu(lambda i: torch_forward(xs[i], dim=-1, out=ys[i]), n_sets, reps).median_us
        timers["torch_fresh_output"] = lambda: time_gpu(lambda i: torch_forward(xs[i], dim=-1), n_sets, reps).median_us
        if not log:
            try:
                tri = TritonSoftmax(m, n, tdtype)
                tri(xs[0], ys[0])
                torch.cuda.synchronize()
                timers["triton"] = lambda: time_gpu(lambda i: tri(xs[i], ys[i]), n_sets, reps).median_us
            except Exception as exc:  # noqa: BLE001 - Triton cannot hold very long rows in one block
                row["triton_us"], row["triton_error"] = None, " ".join(str(exc).split())[:200]
        else:
            row["triton_us"] = None
    for name, us in medians_in_turns(timers, rounds).items():
        row[f"{name}_us"] = us
    row["rounds"] = rounds

    if not mode.endswith("backward"):
        ys[0].fill_(float("nan"))  # poisoned: every element must be written by the checked run
        ours(0)
        row["autosoft_max_err"] = float((ys[0].float() - torch_forward(xs[0].float(), -1)).abs().max())
    for k in ("autosoft", "torch", "triton"):
        t = row.get(f"{k}_us")
        row[f"{k}_pct_copy"] = 100 * row["copy_us"] / t if t else None
        row[f"{k}_gbps"] = nbytes / (t * 1e-6) / 1e9 if t else None
    return row


HOST_SHAPE, HOST_DTYPE = "4096x128", "float32"  # the host-overhead target
HOST_SHAPES = (HOST_SHAPE, "1x1")  # timed per call in --host-only, each on its own; the first is the summary


def host_overhead_in_fresh_process(cache_path: Path) -> dict:
    """host_overhead() in a new Python process, as a user's program would call autosoft.softmax
    (load the cache, then call), not in this one after hours of tuning and timing."""
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--host-only", "--cache", str(cache_path)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"the host-overhead process failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def host_overhead(torch, cache_path: Path, calls=2000, rounds=7) -> dict:
    """Wall time per call from Python (output allocation and launch included) of autosoft.softmax
    (the public function: its compiled entry where `autosoft native` built the extension) and of
    its torch operator (torch.ops.autosoft.softmax) against torch.softmax, with the cache loaded,
    per shape of HOST_SHAPES: the median of `rounds` rounds that take turns, so that a slow spell
    of the host weighs on all alike. With the extension built, the same calls with it turned off
    (native.disable: the public function's Python path, the operator's Python kernel) take turns
    too. The first shape's figures are also the top-level keys (as before the per-shape list)."""
    import autosoft
    import autosoft.torch_ops  # noqa: F401 - registers torch.ops.autosoft (and the compiled kernels where built)
    from autosoft import native
    from autosoft.dispatch import DISPATCHER

    autosoft.load_cache(str(cache_path))
    operator = torch.ops.autosoft.softmax
    compiled = native.enabled()  # `autosoft native` built the extension: the public entry and the operator's kernel

    per_shape = []
    for shape in HOST_SHAPES:
        problem = get_family("softmax").problem(shape, HOST_DTYPE)
        x = torch.randn(*problem.shape, device="cuda").to(getattr(torch, HOST_DTYPE))

        def per_call_us(fn) -> float:
            for _ in range(50):
                fn(x)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) / calls * 1e6

        def without_extension(fn) -> float:
            native.disable()
            try:
                return per_call_us(fn)
            finally:
                native.enable()

        contenders = {"autosoft": lambda: per_call_us(autosoft.softmax),
                      "operator": lambda: per_call_us(lambda t: operator(t, -1)),
                      "torch": lambda: per_call_us(lambda t: torch.softmax(t, -1))}
        if compiled:  # the same calls with the Python paths, in the same turns
            contenders["autosoft_python"] = lambda: without_extension(autosoft.softmax)
            contenders["operator_python"] = lambda: without_extension(lambda t: operator(t, -1))
        launched = native.launches()
        medians = medians_in_turns(contenders, rounds)
        out = {f"{name}_us_per_call": us for name, us in medians.items()}
        torch_us = out["torch_us_per_call"]
        out["ratio"] = out["autosoft_us_per_call"] / torch_us
        out["operator_ratio"] = out["operator_us_per_call"] / torch_us
        out["operator_kernel"] = "compiled (autosoft.native)" if compiled else "Python"
        out["autosoft_path"] = "compiled entry (autosoft.native)" if native.direct_enabled() else "Python"
        if compiled:
            out["autosoft_python_ratio"] = out["autosoft_python_us_per_call"] / torch_us
            out["operator_python_ratio"] = out["operator_python_us_per_call"] / torch_us
            # calls launched from C++ (public entry and operator kernel): 0 means the plan is not replayable
            out["compiled_launches"] = native.launches() - launched
        choice = DISPATCHER.choose(problem)
        out["shape"], out["dtype"] = shape, HOST_DTYPE
        out["variant"], out["variant_source"] = choice.variant.name, choice.source  # "tuned" from the cache
        per_shape.append(out)
    result = {**per_shape[0], "shapes": per_shape, "rounds": rounds, "calls_per_round": calls,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    return result


def print_host_table(h: dict, file=sys.stderr) -> None:
    """The --host-only figures as a table (µs per call; ratio to torch.softmax in the same turns)."""
    print(f"per call from Python, {h['dtype']}, median of {h['rounds']} rounds of {h['calls_per_round']} calls "
          f"taking turns ({h.get('gpu', '')}, torch {h.get('torch', '')})", file=file)
    print("| shape | torch.softmax µs | autosoft.softmax µs | ratio | path | autosoft.softmax, Python path µs "
          "| ratio | operator µs | ratio | C++ launches | variant |", file=file)
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|", file=file)
    for r in h.get("shapes", [h]):
        python = r.get("autosoft_python_us_per_call")
        print(f"| {r['shape']} | {r['torch_us_per_call']:.2f} | {r['autosoft_us_per_call']:.2f} | {r['ratio']:.2f} "
              f"| {r.get('autosoft_path', 'Python')} | {'-' if python is None else f'{python:.2f}'} "
              f"| {'-' if python is None else format(r['autosoft_python_ratio'], '.2f')} "
              f"| {r['operator_us_per_call']:.2f} | {r['operator_ratio']:.2f} | {r.get('compiled_launches', 0)} "
              f"| {r['variant_source']} {r['variant']} |", file=file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("softmax_sweep.sqlite"))
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=40, help="launches timed per round (median)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds taking turns between copy, autosoft, torch "
                                                               "and Triton (median of the rounds)")
    parser.add_argument("--out", type=Path, default=Path("softmax_bench.json"))
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--shapes", default="", help="comma-separated MxN list (default: the full sweep)")
    parser.add_argument("--mode", choices=MODES, default="forward",
                        help="forward (softmax), log (log-softmax), backward, log_backward")
    parser.add_argument("--host-only", action="store_true",
                        help="only time autosoft.softmax against torch.softmax from Python on "
                             f"{' and '.join(HOST_SHAPES)} {HOST_DTYPE} (tuned in --cache); print the result as JSON")
    args = parser.parse_args()
    if args.host_only and not args.cache.is_file():
        parser.error(f"--cache {args.cache} does not exist; run the sweep into it first")
    import torch

    if args.host_only:
        result = host_overhead(torch, args.cache)
        print_host_table(result)
        print(json.dumps(result))
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    family = get_family("softmax")
    shapes = [family.parse_shape(s) for s in args.shapes.split(",")] if args.shapes else SWEEP
    cache = Cache(args.cache)
    device = device_info()
    rows = []
    runner = GpuRunner()  # one tuning worker and compile pool for the whole sweep
    for shape in shapes:
        for dtype in args.dtypes.split(","):
            problem = problem_of(args.mode, "x".join(map(str, shape)), dtype)
            try:
                rows.append(bench_one(torch, problem, cache, args.trials, args.seed, args.reps, args.rounds, runner,
                                      args.mode))
            except Exception as exc:  # noqa: BLE001 - one broken shape must not end the sweep
                traceback.print_exc()
                rows.append({"shape": problem.shape_text, "dtype": dtype, "error": str(exc)})
            args.out.write_text(json.dumps({"gpu": device.name, "rows": rows}, indent=1))  # partial results survive a kill
            r = rows[-1]
            print(f"{r['shape']:>13} {dtype:8} " + (
                f"copy {r['copy_us']:8.2f}  autosoft {r['autosoft_us']:8.2f} ({r['autosoft_pct_copy']:5.1f}%)  "
                f"torch {r['torch_us']:8.2f}  triton {r.get('triton_us') or float('nan'):8.2f}  [{r['variant']}]"
                if "error" not in r else f"ERROR {r['error']}"), flush=True)
    overhead = None
    if args.mode == "forward":
        # the host figures are for tuned variants: tune the shapes into the cache if the sweep had not
        for shape in HOST_SHAPES:
            tuned_kernel(family, family.problem(shape, HOST_DTYPE), cache, args.trials, runner=runner, seed=args.seed)
    runner.close()
    if args.mode == "forward":
        overhead = host_overhead_in_fresh_process(args.cache)
    result = {"gpu": device.name, "cc": device.compute_capability, "nvrtc": device.cuda_version,
              "torch": torch.__version__, "mode": args.mode, "rows": rows, "host_overhead": overhead}
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"\nsoftmax ({result.get('mode', 'forward')}) on {result['gpu']} (sm_{result['cc']}, NVRTC {result['nvrtc']}, "
          f"torch {result['torch']})")
    print("| shape | dtype | MB | copy µs | autosoft µs | GB/s | % copy | torch µs | % copy | triton µs | % copy "
          "| vs torch | vs triton |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r['shape']} | {r['dtype']} | error: {r['error'][:80]} |")
            continue
        tri, auto, tor = r.get("triton_us"), r["autosoft_us"], r["torch_us"]
        tri_text = "n/a" if tri is None else f"{tri:.2f}"
        tri_pct = "-" if tri is None else f"{r['triton_pct_copy']:.1f}"
        tri_ratio = "-" if tri is None else f"{tri / auto:.2f}x"
        print(f"| {r['shape']} | {r['dtype']} | {r['bytes'] / 1e6:.1f} | {r['copy_us']:.2f} | {auto:.2f} "
              f"| {r['autosoft_gbps']:.0f} | {r['autosoft_pct_copy']:.1f} | {tor:.2f} | {r['torch_pct_copy']:.1f} "
              f"| {tri_text} | {tri_pct} | {tor / auto:.2f}x | {tri_ratio} |")
    h = result["host_overhead"]
    if h is None:
        return
    print(f"\nautosoft.softmax on {h['shape']} {h['dtype']}: {h['autosoft_us_per_call']:.2f} us/call from Python, "
          f"torch.softmax {h['torch_us_per_call']:.2f} us/call (ratio {h['ratio']:.2f}; median of {h['rounds']} rounds "
          f"taking turns, in a fresh process; {h['variant_source']} {h['variant']}); torch.ops.autosoft.softmax "
          f"{h.get('operator_us_per_call', float('nan')):.2f} us/call (ratio {h.get('operator_ratio', float('nan')):.2f}, "
          f"{h.get('operator_kernel', 'Python')} kernel)"
          + (f"; with the Python kernel {h['operator_python_us_per_call']:.2f} us/call "
             f"(ratio {h['operator_python_ratio']:.2f})" if "operator_python_us_per_call" in h else ""))
    print_host_table(h, sys.stdout)


if __name__ == "__main__":
    raise SystemExit(main())
