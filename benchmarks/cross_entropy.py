"""Cross-entropy forward + backward: autosoft against torch's F.cross_entropy (eager and
torch.compile), QuACK's cross_entropy and Liger's LigerCrossEntropyLoss (each when importable),
against the copy limit; and with --linear, linear + cross-entropy against Liger's fused linear
cross-entropy and torch's unfused composition, in time and peak memory.

    python benchmarks/cross_entropy.py --cache ce.sqlite --out ce.json             # every row
    python benchmarks/cross_entropy.py --quick --cache ce.sqlite --out quick.json  # < 3 minutes on an H100
    python benchmarks/cross_entropy.py --linear --cache ce.sqlite --out linear.json
    python benchmarks/cross_entropy.py --tune-only --cache ce.sqlite          # tune, time nothing
    python benchmarks/cross_entropy.py --dtypes bfloat16 --vocabs 32000,50257 --cache ce.sqlite  # some rows

Rows: tokens 4096..32768 x vocabularies 32000, 50257, 128256, 151936, 256000, bfloat16 and
float32 (--quick: three of them). For each vocabulary and dtype the family is tuned once, at
min(tokens, TUNE_TOKENS) rows (or taken from --cache), and every token count of it runs that
variant (the kernel's code does not depend on the row count). Each row times, in --rounds rounds
that take turns (each figure the median of its rounds' medians; CUDA events, warm-up, inputs
rotated so that every run reads cold logits):
- copy: a device-to-device copy of the logits' bytes (read once, written once): the limit;
- autosoft_kernel: the tuned kernel alone (loss, lse and gradient in one read of the logits);
- autosoft, torch, torch_compile, quack, liger (and autosoft_inplace, liger's is in place too):
  loss = f(logits, target); loss.backward(), from Python, the logits' .grad cleared before each.
pct_copy = copy time / the contender's time. A contender that fails or runs out of memory on a
row gets null and its error. JSON out (--out), and a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.dispatch import cache_key  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402

FAMILY = get_family("cross_entropy")
VOCABS = (32000, 50257, 128256, 151936, 256000)
TOKENS = (4096, 8192, 16384, 32768)
DTYPES = ("bfloat16", "float32")
QUICK = [(4096, 32000, "bfloat16"), (4096, 128256, "bfloat16"), (4096, 32000, "float32")]
TUNE_TOKENS = 2048
COPY_CAP = 1 << 30  # bytes each way
LINEAR = [(tokens, 4096, vocab) for tokens in (8192, 32768) for vocab in (128256, 151936)]
LINEAR_QUICK = [(8192, 4096, 128256)]


def medians_in_turns(timers: dict[str, Callable[[], float]], rounds: int) -> tuple[dict[str, float], dict[str, str]]:
    """Each timer's median over `rounds` rounds that take turns; a timer that raises is dropped,
    its error kept."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    errors: dict[str, str] = {}
    for _ in range(rounds):
        for name, timer in timers.items():
            if name in errors:
                continue
            try:
                samples[name].append(timer())
            except Exception as exc:  # noqa: BLE001 - out of memory, a peer's limit: this row's figure is null
                errors[name] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                _release()
    return {n: statistics.median(s) for n, s in samples.items() if s and n not in errors}, errors


def _release() -> None:
    """Give freed memory back: torch's cached blocks and CuPy's pool (the copy's buffers)."""
    import torch

    from autosoft.runtime import cupy_module

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cupy_module().get_default_memory_pool().free_all_blocks()


def peers(torch: Any) -> dict[str, Callable[[Any, Any], Any]]:
    """The loss functions to compare, by name: torch's always, QuACK's and Liger's when importable."""
    import torch.nn.functional as F

    import autosoft

    found: dict[str, Callable[[Any, Any], Any]] = {
        "autosoft": lambda x, t: autosoft.cross_entropy(x, t),
        "autosoft_inplace": lambda x, t: autosoft.cross_entropy(x, t, inplace_backward=True),
        "torch": lambda x, t: F.cross_entropy(x, t),
    }
    # one compiled graph per shape and dtype: as many as the rows (past the default limit, Dynamo
    # would fall back to eager without saying so)
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    compiled = torch.compile(lambda x, t: F.cross_entropy(x, t), dynamic=False)
    found["torch_compile"] = compiled
    try:
        from quack.cross_entropy import cross_entropy as quack_ce

        found["quack"] = lambda x, t: quack_ce(x, t, reduction="mean")
    except Exception:  # noqa: BLE001 - not installed, or no CuTe DSL for this GPU
        pass
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()
        found["liger"] = lambda x, t: liger(x, t)
    except Exception:  # noqa: BLE001
        pass
    return found


def tuned_params(problem, cache: Cache, trials: int, runner: Any, seed: int) -> tuple[dict, bool, float]:
    """The tuned params of `problem` from the cache, after tuning it there when missing."""
    from autosoft.runtime import device_info
    from autosoft.tune import tune

    key = cache_key(problem, device_info(), FAMILY)
    entry = cache.get(key)
    start = time.perf_counter()
    tuned_now = entry is None
    if entry is None:
        report = tune(FAMILY, problem, trials, cache, runner=runner, seed=seed)
        if report.best is None:
            raise RuntimeError(f"{problem.shape_text} {problem.dtype}: no correct variant in {trials} trials")
        entry = cache.get(key)
    return dict(entry.params), tuned_now, time.perf_counter() - start


def bench_row(torch: Any, tokens: int, vocab: int, dtype: str, params: dict, contenders: dict, reps: int,
              rounds: int) -> dict:
    from autosoft.compile import compile_source
    from autosoft.families.base import build_variant
    from autosoft.runtime import LoadedVariant, device_info

    import numpy as np

    problem = FAMILY.problem(f"{tokens}x{vocab}", dtype)
    target_info = device_info().target
    nbytes = FAMILY.bytes_moved(problem)
    row: dict[str, Any] = {"tokens": tokens, "vocab": vocab, "dtype": dtype, "bytes": nbytes}
    variant = build_variant(FAMILY, problem, params, target_info)
    row["variant"] = variant.name
    result = compile_source(variant.source, target_info.arch)
    if not result.ok:
        raise RuntimeError(f"{variant.name}: {result.log[:500]}")
    loaded = LoadedVariant(variant, result.cubin)
    n_sets = rotation_count(nbytes, target_info.l2_bytes)
    tdtype = getattr(torch, dtype)
    xs = [torch.randn(tokens, vocab, device="cuda", dtype=tdtype) for _ in range(n_sets)]
    ts = [torch.randint(0, vocab, (tokens,), device="cuda") for _ in range(n_sets)]
    for t in ts:
        t[::17] = -100  # a few ignored rows, as padding gives
    grads = [torch.empty_like(xs[0])]  # the kernel's own output; one buffer serves the rotation
    loss = torch.empty(tokens, device="cuda", dtype=torch.float32)
    lse = torch.empty_like(loss)
    scale = torch.full((1,), 1.0 / tokens, device="cuda", dtype=torch.float32)
    scalars = {"ignore_index": np.int64(-100), "label_smoothing": np.float32(0.0), "z_loss": np.float32(0.0)}

    def kernel(i: int) -> None:
        loaded.launch({"logits": xs[i].data_ptr(), "target": ts[i].data_ptr(), "scale": scale.data_ptr(),
                       "grad": grads[0].data_ptr(), "loss": loss.data_ptr(), "lse": lse.data_ptr(), **scalars})

    # the copy at up to COPY_CAP bytes each way, scaled to the row's: far past the L2 a copy's rate
    # does not depend on its size, and the largest rows leave no memory for a copy of their own
    each_way = nbytes // 2
    copied = min(each_way, COPY_CAP)

    def copy() -> float:
        us = time_copy(copied, target_info.l2_bytes, reps).median_us * each_way / copied
        _release()
        return us

    timers: dict[str, Callable[[], float]] = {
        "copy": copy,
        "autosoft_kernel": lambda: time_gpu(kernel, n_sets, reps).median_us,
    }

    def fwd_bwd(fn: Callable[[Any, Any], Any]) -> Callable[[int], None]:
        def run(i: int) -> None:
            x = xs[i]
            x.grad = None
            fn(x, ts[i]).backward()
        return run

    for x in xs:
        x.requires_grad_()
    for name, fn in contenders.items():
        timers[name] = (lambda fn=fn: time_gpu(fwd_bwd(fn), n_sets, reps).median_us)
    medians, errors = medians_in_turns(timers, rounds)
    for x in xs:
        x.grad = None
    row.update({f"{name}_us": medians.get(name) for name in timers})
    row.update({f"{name}_error": error for name, error in errors.items()})
    copy_us = medians.get("copy")
    for name in timers:
        us = medians.get(name)
        row[f"{name}_pct_copy"] = 100 * copy_us / us if us and copy_us else None
    # a check on the first rows of one set: the kernel's loss against float32 torch
    kernel(0)
    rows = min(tokens, 1024)
    expected = torch.nn.functional.cross_entropy(xs[0][:rows].detach().float(), ts[0][:rows], reduction="none")
    row["autosoft_loss_max_err"] = float((loss[:rows] - expected).abs().max())
    del xs, grads
    _release()
    return row


def bench_linear(torch: Any, tokens: int, hidden: int, vocab: int, chunks: list[int | None], reps: int,
                 rounds: int) -> dict:
    """Linear + cross-entropy, bfloat16: time of loss.backward() included and peak memory above the
    inputs, for autosoft at each chunk size (None: its default), Liger's fused loss and torch's
    unfused composition."""
    import torch.nn.functional as F

    import autosoft

    row: dict[str, Any] = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": "bfloat16"}
    h = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    runs: dict[str, Callable[[], Any]] = {}
    for chunk in chunks:
        runs[f"autosoft_chunk{chunk or 'default'}"] = \
            lambda chunk=chunk: autosoft.linear_cross_entropy(h, w, t, chunk_size=chunk)
    runs["torch"] = lambda: F.cross_entropy(F.linear(h, w).float(), t)
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        runs["liger"] = lambda: liger(w, h, t)
    except Exception:  # noqa: BLE001 - not installed
        pass

    def timed(fn: Callable[[], Any]) -> Callable[[], float]:
        def run(_: int) -> None:
            h.grad = w.grad = None
            fn().backward()
        return lambda: time_gpu(run, 1, reps).median_us

    medians, errors = medians_in_turns({name: timed(fn) for name, fn in runs.items()}, rounds)
    for name, fn in runs.items():
        if name in errors:
            continue
        h.grad = w.grad = None
        _release()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        try:
            fn().backward()
            torch.cuda.synchronize()
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        except Exception as exc:  # noqa: BLE001
            errors[name] = " ".join(str(exc).split())[:300]
    row.update({f"{name}_ms": medians[name] / 1000 if name in medians else None for name in runs})
    row.update({f"{name}_error": error for name, error in errors.items()})
    h.grad = w.grad = None
    del h, w
    _release()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three rows (and one linear row with --linear)")
    parser.add_argument("--linear", action="store_true", help="linear + cross-entropy instead")
    parser.add_argument("--cache", default="cross_entropy_bench.sqlite", help="tuned kernels (reused when present)")
    parser.add_argument("--trials", type=int, default=None, help="tuning trials per vocabulary and dtype "
                        "(default 100: the family has about 30 seeds; 12 with --quick)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--chunks", default="default,1024,2048,4096",
                        help="linear: autosoft's chunk sizes to measure (tokens; 'default' is its own choice)")
    parser.add_argument("--vocabs", default=None, help="only these vocabularies (comma-separated)")
    parser.add_argument("--dtypes", default=None, help="only these dtypes (comma-separated)")
    parser.add_argument("--tokens", default=None, help="only these token counts (comma-separated)")
    parser.add_argument("--tune-only", action="store_true", help="tune the rows' problems into --cache, time nothing")
    parser.add_argument("--contenders", default=None,
                        help="only these of autosoft, autosoft_inplace, torch, torch_compile, quack, liger "
                             "(comma-separated; the copy and autosoft's kernel alone always run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the rows")
    args = parser.parse_args()
    if args.trials is not None and args.trials < 1 or args.rounds < 1 or args.reps < 1:
        parser.error("--trials, --rounds and --reps must be at least 1")
    try:
        chunks = [None if c == "default" else int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks {args.chunks!r}: comma-separated token counts or 'default'")
    if any(c is not None and c < 1 for c in chunks):
        parser.error("--chunks: chunk sizes must be at least 1")

    import torch

    from autosoft.runtime import device_info

    device = device_info()
    result: dict[str, Any] = {"device": device.name, "torch": torch.__version__, "rows": []}
    started = time.perf_counter()
    if args.linear:
        for tokens, hidden, vocab in (LINEAR_QUICK if args.quick else LINEAR):
            row = bench_linear(torch, tokens, hidden, vocab, chunks[:2] if args.quick else chunks, args.reps,
                               args.rounds)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    else:
        from autosoft.runners import GpuRunner

        import autosoft

        rows = QUICK if args.quick else [(t, v, d) for d in DTYPES for v in VOCABS for t in TOKENS]
        for position, flag in ((0, args.tokens), (1, args.vocabs), (2, args.dtypes)):
            if flag is not None:
                wanted = set(flag.split(","))
                rows = [row for row in rows if str(row[position]) in wanted]
        if not rows:
            parser.error("--tokens, --vocabs and --dtypes leave no row")
        trials = args.trials or (12 if args.quick else 100)
        cache = Cache(args.cache)
        tuned: dict[tuple[int, str], dict] = {}
        with GpuRunner() as runner:
            for _, vocab, dtype in rows:
                if (vocab, dtype) in tuned:
                    continue
                tokens = min(t for t, v, d in rows if (v, d) == (vocab, dtype))
                problem = FAMILY.problem(f"{min(tokens, TUNE_TOKENS)}x{vocab}", dtype)
                params, now, seconds = tuned_params(problem, cache, trials, runner, args.seed)
                tuned[vocab, dtype] = params
                result.setdefault("tuning", []).append({"problem": problem.shape_text, "dtype": dtype,
                                                        "tuned_now": now, "seconds": round(seconds, 1)})
        autosoft.load_cache(str(cache.path))  # autosoft.cross_entropy dispatches the tuned variants
        if args.tune_only:
            rows = []
        contenders = peers(torch)
        if args.contenders is not None:
            unknown = set(args.contenders.split(",")) - set(contenders)
            if unknown:
                parser.error(f"--contenders: {', '.join(sorted(unknown))} not among {', '.join(sorted(contenders))}")
            contenders = {name: fn for name, fn in contenders.items() if name in args.contenders.split(",")}
        result["contenders"] = sorted(contenders)
        for tokens, vocab, dtype in rows:
            try:
                row = bench_row(torch, tokens, vocab, dtype, tuned[vocab, dtype], contenders, args.reps, args.rounds)
            except Exception as exc:  # noqa: BLE001 - a row that cannot run (memory) is reported, the rest go on
                traceback.print_exc()
                row = {"tokens": tokens, "vocab": vocab, "dtype": dtype, "error": " ".join(str(exc).split())[:300]}
                _release()
            result["rows"].append(row)
            print_row(row)
    result["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{len(result['rows'])} rows in {result['seconds']} s", flush=True)
    return 0


def print_row(row: dict) -> None:
    if "error" in row:
        print(f"{row['tokens']:>6} x {row['vocab']:<7} {row['dtype']:<9} error: {row['error']}", flush=True)
        return
    names = [k[:-3] for k in row if k.endswith("_us") and k != "copy_us"]
    parts = [f"{n} {row[n + '_us']:.0f} us ({row[n + '_pct_copy']:.0f}%)"
             if row.get(n + "_us") and row.get(n + "_pct_copy") else f"{n} -" for n in names]
    print(f"{row['tokens']:>6} x {row['vocab']:<7} {row['dtype']:<9} copy {row['copy_us'] or 0:.0f} us | "
          + " | ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main())
