"""Attention with column sums: autosoft.attention_colsum against torch ways to get o and colsum.

    python benchmarks/attention_colsum.py --cache attention_colsum.sqlite --trials 16
    python benchmarks/attention_colsum.py --no-tune --rows 0,1 -o colsum.json

For q, k, v of shape (B, H, N, D) and 0 < split < N, with P = softmax(scale * q kᵀ [causal:
key j > query i masked]) over keys and o = P v, colsum[b, h, j] is the sum of P[b, h, i, j]
over the queries i >= split, for the keys j < split (float32, (B, H, split)). Each row (a
problem at split = N/2 and at split = N-64) times, by one method, on the same tensors:

    colsum       autosoft.attention_colsum(q, k, v, split, causal=...)
    det          the same with deterministic=True
    materialise  torch float32: s = q kᵀ * scale, masked, p = softmax(s), o = p v, colsum from p
    sdpa_tail    o from F.scaled_dot_product_attention, colsum from the float32 softmax of the
                 query rows i >= split alone
    attention    autosoft.attention(q, k, v, causal=...), o alone
    sdpa         F.scaled_dot_product_attention(q, k, v, is_causal=...), o alone (default backend)

autosoft's problems are tuned into --cache when it holds no entry for them (with --no-tune the
dispatcher's choice, normally the heuristic default, is timed); the cache is loaded with
autosoft.load_cache so that the public calls above dispatch to the tuned variants. Every
contender is called through its public function, so every one allocates its outputs per call.
Before it is timed, each contender's output on one input set is checked against the
materialise reference, computed with float32 output (o: ‖o − ref‖/‖ref‖ within the attention
family's tolerance; colsum: |c − ref| <= 1e-3·|ref| + 1e-5 everywhere; det: also bitwise equal
on a second call). A contender that fails is not timed. Timing is autosoft.timing.time_gpu,
as in benchmarks/attention.py: CUDA events, a spin-blocked queue, 3 warm-up runs, the median of
--reps runs, in --rounds rounds in which the contenders take turns (the median of a contender's
round medians is its time), q, k, v rotated over enough random sets that no run reads them from L2. Float32 matrix
products run at full float32 precision (no TF32). The JSON gets every time, check and ratio;
the table last gives the targets: colsum / attention <= 1.3, colsum against sdpa_tail >= 5x at
split = N/2 and >= 1x at split = N-64, and colsum / sdpa.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from provenance import commit  # noqa: E402
from autosoft.cache import Cache  # noqa: E402
from autosoft.dispatch import DISPATCHER  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.attention import TOLERANCE  # noqa: E402
from autosoft.families.base import OptionValue  # noqa: E402
from autosoft.runners import GpuRunner  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_gpu  # noqa: E402
from autosoft.tune import tuned_kernel  # noqa: E402

if TYPE_CHECKING:
    from torch import Tensor

# (B, H, N, D), dtype, causal; each at every split of SPLITS
PROBLEMS: list[tuple[tuple[int, int, int, int], str, bool]] = [
    ((1, 32, 1024, 128), "bfloat16", True), ((1, 32, 4096, 128), "bfloat16", True),
    ((4, 32, 2048, 64), "float16", False), ((1, 32, 8192, 128), "bfloat16", True)]
SPLITS = ("N/2", "N-64")
CONTENDERS = ("colsum", "det", "materialise", "sdpa_tail", "attention", "sdpa")
MAX_VS_ATTENTION = 1.3                              # colsum time / autosoft.attention time, at most
MIN_VS_SDPA_TAIL = {"N/2": 5.0, "N-64": 1.0}        # sdpa_tail time / colsum time, at least
COLSUM_RTOL, COLSUM_ATOL = 1e-3, 1e-5


@dataclass(frozen=True)
class Row:
    shape: tuple[int, int, int, int]
    dtype: str
    causal: bool
    split_kind: str  # one of SPLITS

    @property
    def split(self) -> int:
        n = self.shape[2]
        return n // 2 if self.split_kind == "N/2" else n - 64

    def describe(self) -> str:
        return (f"{'x'.join(map(str, self.shape))} {self.dtype} {'causal' if self.causal else 'full'} "
                f"split={self.split} ({self.split_kind})")


ROWS = [Row(shape, dtype, causal, kind) for shape, dtype, causal in PROBLEMS for kind in SPLITS]


@lru_cache(maxsize=1)
def _tuning_runner() -> GpuRunner:
    """One GPU worker process for every tune of the run (starting one costs seconds)."""
    runner = GpuRunner()
    atexit.register(runner.close)
    return runner


def autosoft_choice(family_name: str, row: Row, options: Mapping[str, OptionValue], cache: Cache | None,
                    trials: int, seed: int) -> dict:
    """Tune the problem into `cache` when it has no entry there (with a cache); then the variant the
    public call's dispatch uses for it, and where that comes from ("tuned", "default", ...)."""
    family = get_family(family_name)
    problem = family.problem(",".join(map(str, row.shape)), row.dtype, options)
    found: dict = {}
    if cache is not None:
        t0 = time.perf_counter()
        _, tuned_now = tuned_kernel(family, problem, cache, trials, runner=_tuning_runner(), seed=seed)
        found.update(tuned_now=tuned_now, tune_s=round(time.perf_counter() - t0, 2))
        if tuned_now:
            DISPATCHER.forget()  # read the cache file again: it has a new entry
    choice = DISPATCHER.choose(problem)
    return {"variant": choice.variant.name, "source": choice.source, **found}


def input_sets(row: Row) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Random q, k, v sets, enough of them that each run reads inputs last touched 3 L2 sizes ago."""
    import torch

    b, h, n, d = row.shape
    per_set = 4 * b * h * n * d * 2 + b * h * row.split * 4  # q, k, v read; o, colsum written
    n_sets = rotation_count(per_set, device_info().target.l2_bytes, max_bytes=2 << 30)
    dtype = getattr(torch, row.dtype)
    return [tuple(torch.randn(row.shape, device="cuda", dtype=dtype) for _ in range(3)) for _ in range(n_sets)]


def causal_masks(row: Row) -> tuple[Tensor, Tensor]:
    """True where a key is masked (key j > query i): for all N query rows, and for rows split..N-1."""
    import torch

    keys = torch.arange(row.shape[2], device="cuda")
    full = keys[None, :] > keys[:, None]
    return full, full[row.split:]


def materialise_p(q: Tensor, k: Tensor, v: Tensor, split: int, scale: float, mask: Tensor | None,
                  out_dtype: Any) -> tuple[Tensor, Tensor]:
    """o (as out_dtype) and colsum from the whole float32 probability matrix P."""
    s = q.float() @ k.float().transpose(-1, -2)
    s *= scale
    if mask is not None:
        s.masked_fill_(mask, -math.inf)
    p = s.softmax(-1)
    del s  # P at N=8192 is 8.6 GB: do not hold the scores beside it
    return (p @ v.float()).to(out_dtype), p[:, :, split:, :split].sum(2)


def tail_colsum(q: Tensor, k: Tensor, split: int, scale: float, mask: Tensor | None) -> Tensor:
    """colsum from the float32 softmax of the query rows i >= split over all keys."""
    s = q[:, :, split:].float() @ k.float().transpose(-1, -2)
    s *= scale
    if mask is not None:
        s.masked_fill_(mask, -math.inf)
    return s.softmax(-1)[..., :split].sum(2)


Output = tuple["Tensor", "Tensor | None"]  # (o, colsum), colsum None for attention alone


def contenders(row: Row, sets: list[tuple[Tensor, Tensor, Tensor]],
               masks: tuple[Tensor, Tensor] | None) -> dict[str, Callable[[int], Output]]:
    """Each contender as run(i) -> (o, colsum) on input set i, keyed as in CONTENDERS."""
    import torch.nn.functional as F

    import autosoft

    split, causal = row.split, row.causal
    scale = 1.0 / math.sqrt(row.shape[3])
    full_mask, tail_mask = masks if masks is not None else (None, None)
    sdpa = F.scaled_dot_product_attention
    attention_colsum = autosoft.attention_colsum  # looked up once, not in the timed loop

    def colsum(i: int) -> Output:
        return attention_colsum(*sets[i], split, causal=causal)

    def det(i: int) -> Output:
        return attention_colsum(*sets[i], split, causal=causal, deterministic=True)

    def materialise(i: int) -> Output:
        q, k, v = sets[i]
        return materialise_p(q, k, v, split, scale, full_mask, q.dtype)

    def sdpa_tail(i: int) -> Output:
        q, k, v = sets[i]
        return sdpa(q, k, v, is_causal=causal), tail_colsum(q, k, split, scale, tail_mask)

    def attention(i: int) -> Output:
        return autosoft.attention(*sets[i], causal=causal), None

    def sdpa_alone(i: int) -> Output:
        return sdpa(*sets[i], is_causal=causal), None

    return {"colsum": colsum, "det": det, "materialise": materialise, "sdpa_tail": sdpa_tail,
            "attention": attention, "sdpa": sdpa_alone}


def check(out: Output, ref: tuple[Tensor, Tensor], dtype: str) -> dict:
    """How far a contender's (o, colsum) is from the float32 reference, and whether that passes."""
    o, colsum = out
    ref_o, ref_colsum = ref
    if tuple(o.shape) != tuple(ref_o.shape):
        return {"ok": False, "error": f"o has shape {tuple(o.shape)}, expected {tuple(ref_o.shape)}"}
    o_err = float((o.float() - ref_o).norm() / ref_o.norm())
    found = {"o_rel_err": o_err}
    ok = o_err <= TOLERANCE[dtype]  # False for NaN
    if colsum is not None:
        if tuple(colsum.shape) != tuple(ref_colsum.shape) or colsum.dtype != ref_colsum.dtype:
            return {**found, "ok": False, "error": f"colsum is {colsum.dtype} {tuple(colsum.shape)}, expected "
                                                   f"{ref_colsum.dtype} {tuple(ref_colsum.shape)}"}
        diff = (colsum - ref_colsum).abs()
        bound = COLSUM_RTOL * ref_colsum.abs() + COLSUM_ATOL
        found.update(colsum_max_abs_err=float(diff.max()), colsum_max_rel_err=float((diff / ref_colsum.abs()).max()),
                     colsum_err_over_tol=float((diff / bound).max()))
        ok = ok and bool((diff <= bound).all())  # False where NaN
    return {**found, "ok": ok}


def verified(run: Callable[[int], Output], ref: tuple[Tensor, Tensor], dtype: str, repeatable: bool = False) -> dict:
    """Check one contender on set 0 (with repeatable, also that a second call gives the same bits);
    only a contender whose "ok" is True is timed."""
    try:
        out = run(0)
        found = check(out, ref, dtype)
        if repeatable:
            (o, colsum), (o_again, colsum_again) = out, run(0)
            found["repeatable"] = o.equal(o_again) and colsum.equal(colsum_again)
            found["ok"] = found["ok"] and found["repeatable"]
        return found
    except Exception as exc:  # noqa: BLE001 - one contender failing must not end the row
        return {"ok": False, "error": " ".join(str(exc).split())[:300]}


def timed_in_rounds(runs: Mapping[str, Callable[[int], Output]], n_sets: int, reps: int, rounds: int) -> dict:
    """Each contender's median of its round medians, the contenders taking turns in every round:
    a clock or L2 state that drifts during a row reaches them all alike (timed one after the
    other, one kernel came out 3-5 % apart from itself under two names)."""
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            medians[name].append(time_gpu(run, n_sets, reps).median_us)
    return {name: (statistics.median(found), found) for name, found in medians.items()}


def bench_row(torch: Any, row: Row, cache: Cache | None, trials: int, det_trials: int, tune_max_n: int,
              seed: int, reps: int, rounds: int) -> dict:
    r: dict = {"shape": "x".join(map(str, row.shape)), "dtype": row.dtype, "causal": row.causal,
               "split": row.split, "split_kind": row.split_kind}
    colsum_options = {"split": row.split, "causal": row.causal}
    # past --tune-max-n the dispatcher serves the row from the nearest tuned problem (verified first)
    tune_into = cache if row.shape[2] <= tune_max_n else None
    r["variants"] = {
        "colsum": autosoft_choice("attention_colsum", row, colsum_options, tune_into, trials, seed),
        "det": autosoft_choice("attention_colsum", row, {**colsum_options, "deterministic": True}, tune_into,
                               det_trials, seed),
        "attention": autosoft_choice("attention", row, {"causal": row.causal}, tune_into, trials, seed)}
    sets = input_sets(row)
    masks = causal_masks(row) if row.causal else None
    runs = contenders(row, sets, masks)
    q, k, v = sets[0]
    ref = materialise_p(q, k, v, row.split, 1.0 / math.sqrt(row.shape[3]), masks[0] if masks else None,
                        torch.float32)
    r["checks"] = {name: verified(run, ref, row.dtype, repeatable=name == "det") for name, run in runs.items()}
    right = {name: run for name, run in runs.items() if r["checks"][name]["ok"]}
    times = timed_in_rounds(right, len(sets), reps, rounds)
    for name in runs:
        r[f"{name}_us"], r["checks"][name]["round_us"] = times.get(name, (None, None))
    for prefix in ("colsum", "det"):
        r.update(ratios(r, prefix))
    return r


def ratios(r: dict, prefix: str) -> dict:
    """prefix's time against attention, sdpa_tail, sdpa and materialise, and whether the targets are met."""
    t = r[f"{prefix}_us"]

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    vs_attention = over(t, r["attention_us"])
    vs_tail = over(r["sdpa_tail_us"], t)
    met = None if vs_attention is None or vs_tail is None else \
        vs_attention <= MAX_VS_ATTENTION and vs_tail >= MIN_VS_SDPA_TAIL[r["split_kind"]]
    return {f"{prefix}_vs_attention": vs_attention, f"{prefix}_speedup_vs_sdpa_tail": vs_tail,
            f"{prefix}_vs_sdpa": over(t, r["sdpa_us"]),
            f"{prefix}_speedup_vs_materialise": over(r["materialise_us"], t), f"{prefix}_meets_targets": met}


def parse_rows(text: str) -> list[Row]:
    if not text:
        return ROWS
    numbers = text.split(",")
    if not all(n.strip().isdigit() and int(n) < len(ROWS) for n in numbers):
        raise SystemExit(f"--rows {text!r}: comma-separated numbers from 0 to {len(ROWS) - 1} (see --help)")
    return [ROWS[int(n)] for n in numbers]


def main() -> int:
    listing = "\n".join(f"  {i}  {row.describe()}" for i, row in enumerate(ROWS))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=f"rows:\n{listing}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--json", type=Path, default=REPO / "benchmarks/results/attention_colsum_h200.json",
                        help="results file, rewritten after every row "
                        "(default: benchmarks/results/attention_colsum_h200.json)")
    parser.add_argument("--cache", type=Path, default=Path("attention_colsum.sqlite"),
                        help="tuned-kernel cache: entries found there are re-used, missing ones tuned into it")
    parser.add_argument("--trials", type=int, default=16, help="tuning trials per problem")
    parser.add_argument("--det-trials", type=int, default=None,
                        help="tuning trials for the deterministic problems (default: --trials)")
    parser.add_argument("--tune-max-n", type=int, default=1 << 30, metavar="N",
                        help="tune only rows with N up to this; longer rows take the nearest tuned problem's variant")
    parser.add_argument("--no-tune", action="store_true", help="time the dispatcher's choice (the heuristic "
                        "default when no cache file has an entry), no tuning")
    parser.add_argument("--rows", default="", help="comma-separated row numbers (default: all; listed below)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the tuner and torch's random inputs")
    parser.add_argument("--reps", type=int, default=20, help="timed runs per contender and round (median)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds in which the contenders take turns (median of the round medians)")
    args = parser.parse_args()
    rows = parse_rows(args.rows)
    det_trials = args.trials if args.det_trials is None else args.det_trials

    import torch

    import autosoft

    torch.manual_seed(args.seed)
    torch.set_float32_matmul_precision("highest")  # the float32 reference and baselines: no TF32
    device = device_info()
    cache = None if args.no_tune else Cache(args.cache)
    if cache is not None:
        autosoft.load_cache(str(cache.path))
    result: dict = {"gpu": device.name, "cc": device.compute_capability, "nvrtc": device.cuda_version,
                    "torch": torch.__version__, "commit": commit(), "tuned": cache is not None,
                    "cache": str(args.cache) if cache is not None else None, "trials": args.trials,
                    "det_trials": det_trials, "tune_max_n": args.tune_max_n,
                    "reps": args.reps, "rounds": args.rounds, "seed": args.seed,
                    "targets": {"colsum_vs_attention_max": MAX_VS_ATTENTION,
                                "colsum_speedup_vs_sdpa_tail_min": MIN_VS_SDPA_TAIL},
                    "tolerance": {"o_rel": TOLERANCE, "colsum_rtol": COLSUM_RTOL, "colsum_atol": COLSUM_ATOL},
                    "rows": []}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        try:
            r = bench_row(torch, row, cache, args.trials, det_trials, args.tune_max_n, args.seed, args.reps,
                          args.rounds)
        except Exception as exc:  # noqa: BLE001 - one broken row must not end the run
            traceback.print_exc()
            r = {"shape": "x".join(map(str, row.shape)), "dtype": row.dtype, "causal": row.causal,
                 "split": row.split, "split_kind": row.split_kind, "error": " ".join(str(exc).split())[:300]}
        gc.collect()
        torch.cuda.empty_cache()  # the 8192 rows' float32 P needs the memory the last row's allocator kept
        result["rows"].append(r)
        args.json.write_text(json.dumps(result, indent=1))  # partial results survive a kill
        print(_line(r), flush=True)
    print_table(result)
    return 0


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _head(r: dict) -> str:
    return f"{r['shape']} | {r['dtype']} | {'causal' if r['causal'] else 'full'} | {r['split']} ({r['split_kind']})"


def _failed(r: dict) -> list[str]:
    return [name for name, c in r["checks"].items() if not c["ok"]]


def _line(r: dict) -> str:
    head = _head(r).replace(" | ", " ")
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    times = "  ".join(f"{name} {_fmt(r[f'{name}_us'])}" for name in CONTENDERS)
    failed = _failed(r)
    wrong = f"  WRONG: {', '.join(failed)}" if failed else ""
    v = r["variants"]
    return f"{head} us: {times}{wrong}  [{v['colsum']['variant']}, {v['colsum']['source']}]"


def _ratio(x: float | None, ok: bool) -> str:
    return "-" if x is None else f"{x:.2f}x" + ("" if ok else " ✗")


def print_table(result: dict) -> None:
    print(f"\nattention_colsum on {result['gpu']} (sm_{result['cc']}, NVRTC {result['nvrtc']}, "
          f"torch {result['torch']}) at {result['commit']}, {'tuned' if result['tuned'] else 'untuned'}; "
          f"µs, median of {result.get('rounds', 1)} round medians of {result['reps']}")
    print(f"targets: colsum/attention <= {MAX_VS_ATTENTION}; sdpa_tail/colsum >= "
          f"{MIN_VS_SDPA_TAIL['N/2']} at N/2, >= {MIN_VS_SDPA_TAIL['N-64']} at N-64 (✗: missed)")
    print("| B,H,N,D | dtype | mask | split | colsum | det | attention | sdpa | sdpa+tail | materialise "
          "| colsum/attn | vs sdpa+tail | colsum/sdpa | det/attn | det vs sdpa+tail | det/sdpa | checks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {_head(r)} | error: {r['error'][:100]} |")
            continue
        least = MIN_VS_SDPA_TAIL[r["split_kind"]]
        cells = [_fmt(r[f"{name}_us"]) for name in ("colsum", "det", "attention", "sdpa", "sdpa_tail",
                                                     "materialise")]
        for p in ("colsum", "det"):
            vs_attention, vs_tail = r[f"{p}_vs_attention"], r[f"{p}_speedup_vs_sdpa_tail"]
            cells += [_ratio(vs_attention, vs_attention is None or vs_attention <= MAX_VS_ATTENTION),
                      _ratio(vs_tail, vs_tail is None or vs_tail >= least), _ratio(r[f"{p}_vs_sdpa"], True)]
        failed = _failed(r)
        cells.append(f"WRONG: {', '.join(failed)}" if failed else "ok")
        print(f"| {_head(r)} | {' | '.join(cells)} |")


if __name__ == "__main__":
    raise SystemExit(main())
