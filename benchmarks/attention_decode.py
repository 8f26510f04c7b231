"""Issue 17's rows: autosoft against torch SDPA on grouped-KV decode and prefill.

    python benchmarks/attention_decode.py --out attention_decode.json                    # untuned default
    python benchmarks/attention_decode.py --tune 24 --cache decode.sqlite --rows 0,1,2,3,4,5 --out decode.json
    python benchmarks/attention_decode.py --tune 12 --cache prefill.sqlite --rows 6,7,8,9 --out prefill.json

Decode rows: bf16, Hq = 32, Hkv = 8, D = 128, one query per sequence, against B x Nkv of the
issue's table; prefill rows: grouped KV heads (causal), prefill with a cache (Nq < Nkv, causal
aligned bottom-right) and head dim 256.

Every row times the public function `autosoft.attention(q, k, v, causal=...)` on (B, Hq, Nq, D)
and (B, Hkv, Nkv, D) torch tensors, as a user calls it (its output allocated per call, every kernel
it launches counted), beside SDPA's default backend and each forced backend with
`enable_gqa=True` (a backend that refuses the call says why), SDPA on k and v expanded to Hq heads
beforehand (the expansion not timed), and, for decode, a device copy moving as many bytes as K
and V (half each way), the bound a read-mostly kernel is compared with. Causal with Nq != Nkv is
aligned bottom-right for SDPA through torch's `causal_lower_right` mask (its `is_causal` aligns
top-left); with Nq = Nkv, `is_causal`. Ratios are SDPA's time over autosoft's (above 1: autosoft
is faster). autosoft's output is checked against SDPA's default on the first input set before it
is timed (relative error and max abs difference printed; a relative error above 2e-2 stops the
run).

Which variant autosoft runs: `--tune TRIALS` (default 0) first tunes every row's problem into
`--cache` (default attention_decode.sqlite) with that many trials, skipping problems the cache
already holds, all rows before any timing (no tuning worker shares the GPU with a timing); the
cache is then loaded with `autosoft.load_cache`, so the public function runs the tuned variant.
With `--tune 0` an existing `--cache` is loaded without tuning, and without `--cache` every row
runs the heuristic default. The user's own cache ($AUTOSOFT_CACHE_DIR, ~/.cache/autosoft) is not
read (a temporary one stands in for it), so only --cache decides. Each row records the variant
and where it came from ("tuned": the cache's entry for this exact problem; "default"; "nearest
...": an entry of another problem, verified on this one).

Timed as every benchmark here (autosoft.timing.time_gpu): CUDA events, a spin-blocked queue,
warm-up, the median of --reps launches, fresh random inputs rotated so that no launch reads them
from the L2; autosoft and SDPA on the same tensors. The commit is recorded (benchmarks/provenance.py).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402

from provenance import commit  # noqa: E402

# (B, Hq, Hkv, Nq, Nkv, D, causal)
DECODE = [(1, 32, 8, 1, 4096, 128, False), (1, 32, 8, 1, 32768, 128, False), (16, 32, 8, 1, 4096, 128, False),
          (16, 32, 8, 1, 32768, 128, False), (64, 32, 8, 1, 4096, 128, False), (64, 32, 8, 1, 32768, 128, False)]
PREFILL = [(1, 32, 8, 4096, 4096, 128, True), (2, 32, 4, 8192, 8192, 128, True), (1, 32, 8, 512, 8192, 128, True),
           (4, 16, 16, 4096, 4096, 256, True)]
BACKENDS = ("default", "flash", "cudnn", "efficient")
FAMILY = get_family("attention")
DEFAULT_CACHE = Path("attention_decode.sqlite")
MAX_REL_ERROR = 2e-2


def problem_of(row: tuple):
    """The problem autosoft.attention forms for the row's call (and the one tuned for it)."""
    b, hq, hkv, nq, nkv, d, causal = row
    return FAMILY.problem(f"{b},{hq},{nq},{d}", "bfloat16", {"kv_heads": hkv, "kv_len": nkv, "causal": causal})


def tune_rows(rows: list[tuple], cache: Cache, trials: int, seed: int) -> dict[tuple, str]:
    """Tune each row's problem into the cache (problems it already holds are skipped), one GPU
    worker for all of them, closed before anything is timed; row -> "tuned now" or "cached"."""
    from autosoft.runners import GpuRunner
    from autosoft.tune import tuned_kernel

    done: dict[tuple, str] = {}
    runner = GpuRunner()
    try:
        for row in rows:
            if row in done:
                continue
            print(f"  tuning {row_name(row)} ({trials} trials) ...", flush=True)
            loaded, tuned_now = tuned_kernel(FAMILY, problem_of(row), cache, trials, runner=runner, seed=seed)
            done[row] = "tuned now" if tuned_now else "cached"
            print(f"    {loaded.variant.name} ({done[row]})", flush=True)
    finally:
        runner.close()
    return done


def chosen_variant(row: tuple) -> dict:
    """The variant the public function runs for this row, and where it comes from."""
    try:
        from autosoft.dispatch import DISPATCHER

        choice = DISPATCHER.choose(problem_of(row))
        return {"variant": choice.variant.name, "source": choice.source}
    except Exception as exc:  # noqa: BLE001 - reported, not fatal: the timing does not depend on it
        return {"variant": "?", "source": f"unknown ({type(exc).__name__}: {exc})"[:200]}


def row_name(row: tuple) -> str:
    b, hq, hkv, nq, nkv, d, causal = row
    return f"B{b} Hq{hq}/Hkv{hkv} Nq{nq} Nkv{nkv} D{d}{' causal' if causal else ''}"


def attention_flops(row: tuple) -> float:
    """4*B*Hq*Nq*Nkv*D, the visible half of each bottom-right causal row set counted exactly."""
    b, hq, _, nq, nkv, d, causal = row
    if not causal:
        return 4.0 * b * hq * nq * nkv * d
    visible = sum(max(0, min(nkv, i + nkv - nq + 1)) for i in range(nq))  # query i sees keys j <= i + Nkv - Nq
    return 4.0 * b * hq * visible * d


def bench_row(torch, row: tuple, reps: int, l2_bytes: int, with_autosoft: bool = True, tuning: str = "") -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    b, hq, hkv, nq, nkv, d, causal = row
    dt = torch.bfloat16
    kv_bytes = 2 * b * hkv * nkv * d * 2
    n_sets = rotation_count(kv_bytes, l2_bytes)
    sets = [(torch.randn(b, hq, nq, d, device="cuda", dtype=dt), torch.randn(b, hkv, nkv, d, device="cuda", dtype=dt),
             torch.randn(b, hkv, nkv, d, device="cuda", dtype=dt)) for _ in range(n_sets)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # is_causal aligns top-left; with Nq != Nkv the causal is bottom-right: an explicit bias
    mask = causal_lower_right(nq, nkv) if causal and nq != nkv else None
    top_left = causal and nq == nkv
    out: dict = {"row": row_name(row), "shape": list(row), "kv_mb": kv_bytes / 1e6, "n_sets": n_sets,
                 "flops": attention_flops(row)}

    def timed(run) -> dict:
        try:
            run(0)
            torch.cuda.synchronize()
            return {"us": time_gpu(run, n_sets, reps).median_us}
        except Exception as exc:  # noqa: BLE001 - a backend that does not take this call
            return {"us": None, "error": " ".join(str(exc).split())[:200]}

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def gqa(i: int) -> None:
        q, k, v = sets[i]
        sdpa(q, k, v, attn_mask=mask, is_causal=top_left, enable_gqa=True)

    if with_autosoft:
        import autosoft

        def ours(i: int) -> None:
            q, k, v = sets[i]
            autosoft.attention(q, k, v, causal=causal)

        q, k, v = sets[0]
        with torch.no_grad():
            o = autosoft.attention(q, k, v, causal=causal)  # first call: compiles (and verifies) untimed
            ref = sdpa(q, k, v, attn_mask=mask, is_causal=top_left, enable_gqa=True)
        torch.cuda.synchronize()
        if o.shape != ref.shape or o.dtype != ref.dtype:
            raise SystemExit(f"autosoft on {row_name(row)}: output {tuple(o.shape)} {o.dtype}, "
                             f"SDPA's {tuple(ref.shape)} {ref.dtype}")
        diff = o.float() - ref.float()
        error = float(diff.norm() / ref.float().norm())
        max_abs = float(diff.abs().max())
        chosen = chosen_variant(row)
        print(f"  {row_name(row)}: autosoft {chosen['variant']} ({chosen['source']}) against SDPA: "
              f"relative error {error:.3g}, max abs diff {max_abs:.3g}", flush=True)
        if not error <= MAX_REL_ERROR or not bool(torch.isfinite(o).all()):
            raise SystemExit(f"autosoft {chosen['variant']} on {row_name(row)}: relative error {error:.3g} "
                             f"(max abs diff {max_abs:.3g}) against SDPA, above {MAX_REL_ERROR:g} or not finite")
        del o, ref, diff
        out["autosoft"] = {**timed(ours), **chosen, "tuning": tuning, "rel_error": error, "max_abs_diff": max_abs}
    for backend in BACKENDS:
        if backend == "default":
            out[backend] = timed(gqa)
        else:
            with sdpa_kernel(forced[backend]):
                out[backend] = timed(gqa)
    expanded = [(q, k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)) for q, k, v in sets]
    sets.clear()  # the grouped inputs freed before the expanded ones are timed
    out["expanded"] = timed(lambda i: sdpa(*expanded[i], attn_mask=mask, is_causal=top_left))
    expanded.clear()
    if nq == 1:
        out["copy_us"] = time_copy(kv_bytes // 2, l2_bytes, reps).median_us
    ours_us = out.get("autosoft", {}).get("us")
    if ours_us:
        for backend in ("default", "flash", "cudnn"):
            theirs = out[backend].get("us")
            out[f"x_{backend}"] = theirs / ours_us if theirs else None
        out["tflops"] = out["flops"] / (ours_us * 1e-6) / 1e12
        if "copy_us" in out:
            out["pct_of_copy"] = 100.0 * out["copy_us"] / ours_us
    torch.cuda.empty_cache()
    return out


def _isolate_user_cache() -> str:
    """Point AUTOSOFT_CACHE_DIR at an empty temporary folder (removed at exit): the public
    function then reads only the caches loaded here, never the user's."""
    folder = tempfile.mkdtemp(prefix="autosoft-attention-decode-")
    atexit.register(shutil.rmtree, folder, True)
    os.environ["AUTOSOFT_CACHE_DIR"] = folder
    return folder


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="rows: " + "; ".join(f"{i}: {row_name(r)}"
                                                                 for i, r in enumerate(DECODE + PREFILL)))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("attention_decode.json"))
    parser.add_argument("--tune", "--trials", dest="tune", type=int, default=0, metavar="TRIALS",
                        help="tune each row's problem into --cache with TRIALS trials before timing, "
                             "skipping problems the cache holds (default 0: no tuning; --trials is the old name)")
    parser.add_argument("--cache", type=Path, default=None,
                        help=f"tuned-kernel cache: its entries are used, missing ones tuned into it with --tune "
                             f"(default with --tune: {DEFAULT_CACHE}; without --tune and --cache: the untuned default)")
    parser.add_argument("--seed", type=int, default=0, help="the tuner's seed")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all ten; see below)")
    parser.add_argument("--sdpa-only", action="store_true", help="the baselines alone, no autosoft column")
    args = parser.parse_args()
    if args.tune < 0:
        parser.error("--tune must be >= 0")
    picked = DECODE + PREFILL
    if args.rows:
        try:
            picked = [picked[int(i)] for i in args.rows.split(",")]
        except (ValueError, IndexError):
            parser.error(f"--rows {args.rows!r}: comma-separated indices 0..{len(DECODE + PREFILL) - 1}")
    cache_path = args.cache if args.cache is not None else (DEFAULT_CACHE if args.tune > 0 else None)
    if cache_path is not None and args.tune == 0 and not cache_path.is_file():
        parser.error(f"--cache {cache_path} does not exist (give --tune TRIALS to tune into it)")
    import torch

    _isolate_user_cache()
    device = device_info()
    tuning: dict[tuple, str] = {}
    if not args.sdpa_only:
        # every row's tune first (tuning runs in a worker process): nothing else on the GPU while timing
        if args.tune > 0:
            tuning = tune_rows(picked, Cache(cache_path), args.tune, args.seed)
        if cache_path is not None:
            import autosoft

            count = autosoft.load_cache(str(cache_path))
            print(f"  loaded {count} entries from {cache_path}", flush=True)
    rows = []
    for row in picked:
        rows.append(bench_row(torch, row, args.reps, device.target.l2_bytes, not args.sdpa_only,
                              tuning.get(row, "not tuned here")))
        print_row(rows[-1])
    result = {"gpu": device.name, "torch": torch.__version__, "commit": commit(), "dtype": "bfloat16",
              "reps": args.reps, "tune_trials": args.tune, "seed": args.seed,
              "cache": str(cache_path) if cache_path is not None else None, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def _us(entry: dict) -> str:
    return f"{entry['us']:.1f}" if entry.get("us") is not None else "refused"


def _columns(r: dict) -> tuple[str, ...]:
    return (("autosoft",) if "autosoft" in r else ()) + (*BACKENDS, "expanded")


def print_row(r: dict) -> None:
    print(f"  {r['row']:42} " + "  ".join(f"{k} {_us(r[k])}" for k in _columns(r))
          + (f"  copy {r['copy_us']:.1f}" if "copy_us" in r else ""), flush=True)


def _x(value) -> str:
    return f"{value:.2f}" if value else "-"


def print_table(result: dict) -> None:
    print(f"\nissue 17 rows on {result['gpu']} (torch {result['torch']}, commit {result['commit']}), bf16, µs; "
          "% of copy = copy / time (decode); TF/s (prefill) counts visible pairs; x = SDPA's time / autosoft's "
          "(above 1: autosoft faster)")
    print("| problem | K+V MB | copy µs | autosoft µs | % of copy | TF/s | SDPA default µs | x default | flash µs "
          "| x flash | cudnn µs | k/v expanded µs | variant |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in result["rows"]:
        ours = r.get("autosoft", {}).get("us")
        copy = r.get("copy_us")
        decode = r["shape"][3] == 1
        pct = f"{r['pct_of_copy']:.0f}" if r.get("pct_of_copy") else "-"
        tfs = f"{r['tflops']:.0f}" if r.get("tflops") and not decode else "-"
        print(f"| {r['row']} | {r['kv_mb']:.0f} | {f'{copy:.1f}' if copy else '-'} | "
              f"{f'{ours:.1f}' if ours else _us(r['autosoft']) if 'autosoft' in r else '-'} | {pct} | {tfs} | "
              f"{_us(r['default'])} | {_x(r.get('x_default'))} | {_us(r['flash'])} | {_x(r.get('x_flash'))} | "
              f"{_us(r['cudnn'])} | {_us(r['expanded'])} | "
              f"{r.get('autosoft', {}).get('variant', '-')} ({r.get('autosoft', {}).get('source', '-')}) |")


if __name__ == "__main__":
    raise SystemExit(main())
