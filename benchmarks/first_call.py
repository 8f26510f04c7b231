"""The first call in a fresh process: autosoft.softmax with a cold and a warm kernel store, and torch.softmax.

    python benchmarks/first_call.py --cache benchmarks/results/softmax_h200.sqlite --out first_call.json

Every figure is one fresh Python process (a subprocess of this script) that imports torch and
autosoft, makes a CUDA tensor x of --shape and --dtype, synchronizes, calls autosoft.load_cache
(--cache) and only then times its first softmax call with a wall clock, up to a
torch.cuda.synchronize() after it. Imports, the CUDA context and the tensor are outside the
timing; what the first call itself does is inside: choosing the variant, importing CuPy,
reading the kernel store or compiling with NVRTC (and verifying, for a variant that needs it),
loading the cubin, launching. Modes:

    cold         an empty kernel store (a new temporary folder per process): NVRTC compiles
    warm         a kernel store filled by one earlier process (not counted): no NVRTC call
    warm+cupy    as warm, with CuPy imported before the timing: what not importing it saves
    torch        torch.softmax(x, dim=-1), the first in its process

A warm-store process loads and launches through cuda-bindings and must not import CuPy: each
process reports whether CuPy was imported by the end, and a warm one that did makes the script
say so and exit 1 (a cold one imports it to compile with NVRTC).

Modes take turns, --reps processes each; the table gives the median, min and max. Each
autosoft process counts its calls of autosoft.compile.compile_source (the only way to NVRTC)
and reports the kernel store's counters; a warm-store process that compiled anything makes the
script say so and exit 1. A second call is timed too (the steady state), and the output is
checked against torch.softmax in float32. The default cache folder of the children is an
empty temporary one, so only --cache's entries are used; with --native it holds the extension
`autosoft native` builds (built first where missing), which a user who ran that command has, and
each process reports whether its first call loaded it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("cold", "warm", "warm+cupy", "torch")
LABELS = {"cold": "autosoft, cold kernel store", "warm": "autosoft, warm kernel store",
          "warm+cupy": "autosoft, warm store, CuPy imported", "torch": "torch.softmax"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--cache", type=Path, default=REPO / "benchmarks/results/softmax_h200.sqlite",
                        help="tuned cache to load (default: benchmarks/results/softmax_h200.sqlite)")
    parser.add_argument("--shape", default="4096x8192", help="MxN (default 4096x8192)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--reps", type=int, default=7, help="fresh processes per mode (default 7)")
    parser.add_argument("--out", type=Path, default=None, help="write the samples and medians as JSON here")
    parser.add_argument("--native", action="store_true",
                        help="give the autosoft processes the extension `autosoft native` builds (built here first "
                             "where missing), as a user who ran it has; each process reports whether it loaded it")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # internal: one measurement
    return parser.parse_args(argv)


# -- one fresh process ------------------------------------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """Time the first softmax call of this process; print one JSON line."""
    import torch

    sys.path.insert(0, str(REPO))
    m, n = (int(s) for s in args.shape.lower().split("x"))
    x = torch.randn(m, n, device="cuda", dtype=getattr(torch, args.dtype))
    torch.cuda.synchronize()
    result: dict = {"mode": args.child, "pid": os.getpid()}
    if args.child == "torch":
        softmax = lambda t: torch.softmax(t, dim=-1)  # noqa: E731
    else:
        import autosoft
        import autosoft.compile as compiler

        compiles: list[str] = []
        real_compile = compiler.compile_source

        def counting_compile(*a, **k):
            compiles.append(a[0][:80] if a else "")
            return real_compile(*a, **k)

        compiler.compile_source = counting_compile  # the kernel store calls it through the module
        autosoft.load_cache(str(args.cache))
        if args.child == "warm+cupy":
            import cupy  # noqa: F401
        result["cupy_imported_before"] = "cupy" in sys.modules
        softmax = autosoft.softmax

    start = time.perf_counter()
    y = softmax(x)
    torch.cuda.synchronize()
    result["first_call_s"] = time.perf_counter() - start
    start = time.perf_counter()
    softmax(x)
    torch.cuda.synchronize()
    result["second_call_s"] = time.perf_counter() - start

    result["device"] = torch.cuda.get_device_name(x.device)
    result["cupy_imported"] = "cupy" in sys.modules
    if args.child != "torch":
        from autosoft import native

        result["native_loaded"] = native.direct_enabled()
        from dataclasses import asdict

        from autosoft.compile import nvrtc_version
        from autosoft.dispatch import DISPATCHER
        from autosoft.families.base import Problem

        store = DISPATCHER.store
        result.update(
            nvrtc_compiles=len(compiles), store=str(store.folder), store_stats=asdict(store.stats()),
            nvrtc=nvrtc_version(), choice=DISPATCHER.choose(Problem("softmax", args.dtype, (m, n))).source,
            max_abs_error=float((y.float() - torch.softmax(x.float(), dim=-1)).abs().max()))
    print(json.dumps(result), flush=True)


def run_child(args: argparse.Namespace, mode: str, store: Path, cache_dir: Path) -> dict:
    env = dict(os.environ, AUTOSOFT_KERNEL_STORE=str(store), AUTOSOFT_CACHE_DIR=str(cache_dir))
    env.pop("AUTOSOFT_KERNEL_STORE_BYTES", None)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--cache", str(args.cache.resolve()),
           "--shape", args.shape, "--dtype", args.dtype]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-15:])
        raise SystemExit(f"first_call: the {mode} process failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


# -- the parent ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    if not args.cache.is_file():
        raise SystemExit(f"first_call: no cache file {args.cache}")
    if args.reps < 1:
        raise SystemExit("first_call: --reps must be at least 1")
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="autosoft-first-call-") as tmp:
        root = Path(tmp)
        cache_dir = root / "empty-cache-dir"  # no default cache entries (with --native, the extension alone)
        if args.native:
            from autosoft import native

            built = native.build()  # in this process's cache folder, as `autosoft native` builds it
            (cache_dir / "native" / built.parent.name).mkdir(parents=True)
            shutil.copy2(built, cache_dir / "native" / built.parent.name / built.name)
        warm_store = root / "warm-store"
        prime = run_child(args, "warm", warm_store, cache_dir)  # fills the warm store; not counted
        cubins = sorted(p.name for p in warm_store.glob("*.cubin"))
        if not cubins:
            raise SystemExit(f"first_call: priming wrote no cubin to {warm_store}: {prime}")
        print(f"primed the warm store: {len(cubins)} cubin(s), {prime['nvrtc_compiles']} NVRTC compile(s), "
              f"choice: {prime['choice']}", file=sys.stderr)
        for rep in range(args.reps):
            for mode in MODES:  # modes take turns, so a drift of the machine falls on all of them
                store = root / f"cold-{rep}" if mode == "cold" else warm_store
                samples[mode].append(run_child(args, mode, store, cache_dir))
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(
                f"{mode} {samples[mode][-1]['first_call_s'] * 1e3:.1f} ms" for mode in MODES), file=sys.stderr)

    summary = {mode: _summary([s["first_call_s"] for s in samples[mode]]) for mode in MODES}
    second = {mode: statistics.median(s["second_call_s"] for s in samples[mode]) for mode in MODES}
    warm = samples["warm"] + samples["warm+cupy"]
    warm_compiles = sum(s["nvrtc_compiles"] for s in warm)  # seen by the spy on compile_source
    warm_store_compiles = sum(s["store_stats"]["compiles"] for s in warm)  # counted by the store itself
    cold_compiles = [s["nvrtc_compiles"] for s in samples["cold"]]
    first = samples["warm"][0]
    errors = max(s["max_abs_error"] for mode in MODES if mode != "torch" for s in samples[mode])

    print(f"\nfirst softmax call in a fresh process: {args.shape} {args.dtype} on {first['device']} "
          f"(NVRTC {first['nvrtc']}; autosoft's choice: {first['choice']}); {args.reps} processes per mode")
    print(f"{'':38} {'median ms':>10} {'min ms':>9} {'max ms':>9} {'2nd call ms':>12} {'NVRTC compiles':>15}")
    for mode in MODES:
        s = summary[mode]
        nvrtc = "-" if mode == "torch" else "/".join(str(x["nvrtc_compiles"]) for x in samples[mode])
        print(f"{LABELS[mode]:38} {s['median'] * 1e3:10.1f} {s['min'] * 1e3:9.1f} {s['max'] * 1e3:9.1f} "
              f"{second[mode] * 1e3:12.3f} {nvrtc:>15}")
    loaded = [s.get("native_loaded") for mode in MODES if mode != "torch" for s in samples[mode]]
    print(f"native extension loaded in {sum(bool(x) for x in loaded)} of {len(loaded)} autosoft processes"
          f"{'' if args.native else ' (without --native none is given)'}")
    warm_cupy = sum(s["cupy_imported"] for s in samples["warm"])  # warm+cupy imports it on purpose
    ok = warm_compiles == 0 and warm_store_compiles == 0 and warm_cupy == 0
    print(f"warm store imported CuPy: {'no' if warm_cupy == 0 else f'YES ({warm_cupy} processes)'}")
    nvrtc_free = warm_compiles == 0 and warm_store_compiles == 0
    print(f"warm store called NVRTC: {'no' if nvrtc_free else f'YES ({warm_compiles} compiles)'}; cold store compiled "
          f"{statistics.median(cold_compiles):g} kernel(s) per process; largest error against torch "
          f"(float32) {errors:.2e}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "shape": args.shape, "dtype": args.dtype, "cache": str(args.cache), "reps": args.reps,
            "device": first["device"], "nvrtc": first["nvrtc"], "choice": first["choice"],
            "warm_store_called_nvrtc": not nvrtc_free, "warm_store_imported_cupy": warm_cupy > 0,
            "first_call_s": summary, "second_call_median_s": second,
            "samples": samples, "primer": prime, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        }, indent=1))
        print(f"wrote {args.out}")
    return 0 if ok else 1


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


if __name__ == "__main__":
    sys.exit(main())
