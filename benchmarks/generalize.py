"""Shapes nobody tuned: the family's selector against a 40-trial tune and today's nearest-shape dispatch,
and warm-started tunes against cold ones, on the held-out shapes of benchmarks/heldout_shapes.json.

    autosoft generalize softmax --cache sweep.sqlite                       # fit the selector first
    python benchmarks/generalize.py --cache sweep.sqlite --family softmax --shapes 0:6 --out gen.json
    python benchmarks/generalize.py --cache sweep.sqlite --family softmax --shapes 0:6 --warm-start --out gen.json
    python benchmarks/generalize.py --cache refit.sqlite --family softmax --redo dispatch --out gen.json  # after a refit
    CUDA_VISIBLE_DEVICES=1 python benchmarks/generalize.py ... --shapes 8:16 --out gen1.json         # one GPU of several
    python benchmarks/generalize.py --merge gen0.json gen1.json gen2.json gen3.json --out gen.json

For each held-out shape (the slice --shapes i:j of the family's list):
(a) reference: a cold tune (no warm start) of --trials trials into <out stem>-reference.sqlite, never
    into --cache, whose per-trial times are kept;
(b) the selector's pick, the family's default and the nearest tuned entry (what dispatch served
    before selectors) are verified and timed on the shape beside the reference's winner, side by side;
    each ratio is the reference's time over the other's (1.0: as fast as the tune). What dispatch
    serves is asked of the dispatcher (the winner of its race, dispatch.py), in this process, before;
(c) with --warm-start: a tune of the same trials that starts from what --cache knows (a copy of
    it, so --cache is never written), and the trials each tune took to come within 1% of the
    better of the two final bests (a tune that never does counts trials + 1, marked censored).
Results go to --out after every shape; a shape's parts already there are skipped, so a run
split by --shapes or cut by a time limit is continued by running it again. The summary (the
geomean and worst ratios; the trials to 1 %, their median over the shapes cold and warm, and the
median of each shape's fraction saved) is printed from everything in --out.
Targets (issue 44): what dispatch serves (the winner of its race) >= 0.95 of the tune (geomean),
>= 0.85 (worst), >= 1.0x nearest on every shape; warm start: trials to 1 %, median over the shapes,
at least 35 % fewer warm than cold.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.dispatch import DEFAULT_RIVAL, SELECTOR, Dispatcher, cache_key, find_selector  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import Family, Problem, Variant, build_variant  # noqa: E402
from autosoft.runners import GpuRunner, Runner  # noqa: E402
from autosoft.tune import TuneReport, evaluation_launches, tune  # noqa: E402
from autosoft.worker import Watchdog  # noqa: E402

from provenance import commit  # noqa: E402

HELDOUT = Path(__file__).resolve().parent / "heldout_shapes.json"


def heldout(family: Family) -> list[Problem]:
    rows = json.loads(HELDOUT.read_text())[family.name]
    return [family.problem(r["shape"], r["dtype"], r.get("options", {})) for r in rows]


def label(problem: Problem) -> str:
    return f"{problem.dtype} {problem.shape_text}"


def trial_times(report: TuneReport) -> list[float | None]:
    return [m.outcome.time_us if m.outcome.ok else None for m in report.trials]


def trials_to(times: list[float | None], target: float) -> tuple[int, bool]:
    """1-based index of the first trial at or under target; (len + 1, True) when none is."""
    for i, t in enumerate(times):
        if t is not None and t <= target:
            return i + 1, False
    return len(times) + 1, True


def timed_side_by_side(family: Family, runner: Runner, variants: dict[str, Variant], timeout_s: float) -> dict[str, Any]:
    """Each variant verified and timed on the full shape, then the correct ones re-timed side by side."""
    out: dict[str, Any] = {}
    distinct: dict[str, Variant] = {}
    for name, v in variants.items():
        outcome = runner.evaluate(family, v, 0, timeout_s)
        out[name] = {"variant": v.name, "params": dict(v.params), "status": outcome.status.value,
                     "time_us": outcome.time_us}
        if outcome.ok:
            distinct[name] = v
    if len(distinct) >= 2:
        again = runner.time_side_by_side(family, list(distinct.values()), timeout_s * len(distinct))
        if again is not None:
            for name, t in zip(distinct, again):
                out[name]["time_us"] = t
    return out


def run_shape(family: Family, problem: Problem, args: argparse.Namespace, runner: Runner, record: dict[str, Any],
              reference: Cache, scratch: Path) -> None:
    device = runner.device
    if "reference" not in record:
        report = tune(family, problem, args.trials, reference, runner=runner, seed=args.seed, warm_start=False)
        if report.best is None:
            record["reference"] = {"error": "no correct variant"}
            return
        record["reference"] = {"time_us": report.best.outcome.time_us, "params": dict(report.best.variant.params),
                               "trial_times": trial_times(report)}
    ref = record["reference"]
    if "error" in ref:
        return
    if "dispatch" not in record:
        dispatcher = Dispatcher()
        dispatcher.load_cache(args.cache)
        choice = dispatcher.choose(problem)
        everyone = (choice, *choice.rivals)
        pick = next((c for c in everyone if c.source.startswith(SELECTOR)), None)
        default = next((c for c in everyone if c.source == DEFAULT_RIVAL), None)
        nearest = choice.fallback if choice.source.startswith(SELECTOR) else choice
        variants = {"reference": build_variant(family, problem, ref["params"], device.target), "nearest": nearest.variant}
        if pick is not None:
            variants["selector"] = pick.variant
        if default is not None:  # the family's default raced too
            variants["default"] = default.variant
        served = dispatcher.loaded(problem, runner.device.index).variant  # after its race, where it has one
        timeout_s = Watchdog().limit(ref["time_us"], evaluation_launches(family))
        timed = timed_side_by_side(family, runner, variants, timeout_s)
        timed["selector_source"] = pick.source if pick is not None else None
        timed["nearest_source"] = nearest.source
        timed["served"] = next(name for name in ("nearest", "selector", "default") if name in variants  # same: nearest
                               and variants[name].digest == served.digest)
        record["dispatch"] = {**timed, "commit": commit()}
    if args.warm_start and "warm" not in record:
        warm_cache = scratch / f"warm-{os.getpid()}.sqlite"
        shutil.copyfile(args.cache, warm_cache)
        try:
            report = tune(family, problem, args.trials, Cache(warm_cache), runner=runner, seed=args.seed,
                          warm_start=True)
        finally:
            for leftover in scratch.glob(f"warm-{os.getpid()}*"):
                leftover.unlink()
        cold_times = ref["trial_times"]
        warm_times = trial_times(report)
        best = min(t for t in (*cold_times, *warm_times) if t is not None)
        cold, cold_censored = trials_to(cold_times, 1.01 * best)
        warm, warm_censored = trials_to(warm_times, 1.01 * best)
        record["warm"] = {"commit": commit(), "trial_times": warm_times, "best_us": best, "cold_trials_to_1pct": cold,
                          "cold_censored": cold_censored, "warm_trials_to_1pct": warm, "warm_censored": warm_censored}


def summary(family: str, records: dict[str, Any]) -> dict[str, Any]:
    """Ratios to the tune (1.0: as fast): the selector's picks, the nearest entries, the defaults
    where they raced, and what dispatch served (the winner of its race; in records of before the race, the selector's pick
    where it made one, else the nearest entry)."""
    sel, near, dflt, served, served_vs_near, saved = [], [], [], [], [], []
    trials: list[tuple[int, int]] = []  # (cold, warm) trials to within 1 % of the best, per shape
    for name, r in records.items():
        d = r.get("dispatch")
        if d and d["reference"]["time_us"]:
            ref = d["reference"]["time_us"]
            speed = {k: (ref / d[k]["time_us"] if d.get(k, {}).get("time_us") else 0.0)
                     for k in ("selector", "nearest", "default")}
            if "selector" in d:
                sel.append((speed["selector"], name))
            if "default" in d:
                dflt.append((speed["default"], name))
            near.append((speed["nearest"], name))
            chosen = speed[d["served"]] if "served" in d else speed["selector"] if "selector" in d else speed["nearest"]
            served.append((chosen, name))
            served_vs_near.append((chosen / speed["nearest"] if speed["nearest"] else math.inf, name))
        w = r.get("warm")
        if w:
            saved.append((1 - w["warm_trials_to_1pct"] / w["cold_trials_to_1pct"], name))
            trials.append((w["cold_trials_to_1pct"], w["warm_trials_to_1pct"]))

    def geomean(pairs: list[tuple[float, str]]) -> float | None:
        values = [v for v, _ in pairs]
        return math.exp(statistics.fmean(math.log(max(v, 1e-9)) for v in values)) if values else None

    return {"family": family, "shapes": len(records),
            "selector_geomean": geomean(sel), "selector_worst": min(sel, default=None),
            "nearest_geomean": geomean(near), "nearest_worst": min(near, default=None),
            "default_geomean": geomean(dflt), "default_worst": min(dflt, default=None),
            "served_geomean": geomean(served), "served_worst": min(served, default=None),
            "served_vs_nearest_worst": min(served_vs_near, default=None),
            "shapes_without_selector_pick": len(near) - len(sel),
            "warm_median_fewer_trials": statistics.median(v for v, _ in saved) if saved else None,
            "cold_median_trials": statistics.median(c for c, _ in trials) if trials else None,
            "warm_median_trials": statistics.median(w for _, w in trials) if trials else None,
            "warm_worst": min(saved, default=None)}


def merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One results dict from the --out files of processes that measured disjoint slices of the
    held-out shapes (one per GPU of a host), with each family's summary over all of them. They
    must share the GPU model and NVRTC; a shape measured twice is an error."""
    out: dict[str, Any] = {"families": {}}
    for part in parts:
        for field in ("gpu", "nvrtc"):
            if out.setdefault(field, part.get(field)) != part.get(field):
                raise ValueError(f"the files were measured on different {field}s: {out[field]} and {part.get(field)}")
        out.setdefault("commits", [])
        if part.get("commit") not in out["commits"]:
            out["commits"].append(part.get("commit"))
        for family, records in part.get("families", {}).items():
            into = out["families"].setdefault(family, {})
            for name, record in records.items():
                if name in into:
                    raise ValueError(f"{family} {name} is in two of the files")
                into[name] = record
        for family, selector in part.get("selector", {}).items():
            out.setdefault("selector", {})[family] = selector
    out["summary"] = {family: summary(family, records) for family, records in out["families"].items()}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                        help="measure nothing: write the union of these --out files (disjoint --shapes slices, "
                             "e.g. one process per GPU) to --out, with the summary over all of them")
    parser.add_argument("--cache", type=Path, help="the tuned cache holding the family's selector")
    parser.add_argument("--family", choices=("softmax", "softmax_backward", "attention"))
    parser.add_argument("--shapes", default=":", metavar="I:J", help="slice of the family's held-out shapes")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start", action="store_true", help="also tune each shape warm-started (part c)")
    parser.add_argument("--redo", action="append", choices=("dispatch", "warm"), default=[],
                        help="run this part again where --out has it from another commit (after a refit or a "
                             "dispatch or warm-start change); a run cut short continues with the same flags")
    parser.add_argument("--out", type=Path, required=True, help="results JSON, read first and continued")
    args = parser.parse_args()
    if args.merge:
        try:
            results = merged([json.loads(path.read_text()) for path in args.merge])
        except (OSError, ValueError) as exc:
            sys.exit(f"generalize.py --merge: {exc}")
        write(args.out, results)
        print(json.dumps(results["summary"], indent=1))
        return 0
    if args.family is None or args.cache is None:
        parser.error("--family and --cache are required unless --merge is given")
    family = get_family(args.family)
    if not args.cache.is_file():
        sys.exit(f"generalize.py: no cache at {args.cache}")
    start, _, stop = args.shapes.partition(":")
    problems = heldout(family)[slice(int(start) if start else None, int(stop) if stop else None)]
    results = json.loads(args.out.read_text()) if args.out.exists() else {}
    records = results.setdefault("families", {}).setdefault(family.name, {})
    reference = Cache(args.out.with_name(args.out.stem + "-reference.sqlite"))
    with GpuRunner() as runner, tempfile.TemporaryDirectory() as scratch:
        key = cache_key(problems[0], runner.device, family) if problems else None
        selector = find_selector(Cache(args.cache, create=False).selectors(), key) if key is not None else None
        if key is not None and selector is None:
            sys.exit(f"generalize.py: no {family.name} selector for {runner.device.name} in {args.cache}; "
                     f"run `autosoft generalize {family.name} --cache {args.cache}` first")
        results.update(commit=commit(), gpu=runner.device.name, nvrtc=runner.device.cuda_version)
        if selector is not None:
            results.setdefault("selector", {})[family.name] = selector.summary()
        for problem in problems:
            record = records.setdefault(label(problem), {})
            for part in args.redo:
                if record.get(part, {}).get("commit") != results["commit"]:
                    record.pop(part, None)  # measured at another commit (or before parts kept theirs)
            started = time.perf_counter()
            run_shape(family, problem, args, runner, record, reference, Path(scratch))
            write(args.out, results)
            print(f"{family.name} {label(problem)}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    results.setdefault("summary", {})[family.name] = summary(family.name, records)
    write(args.out, results)
    print(json.dumps(results["summary"][family.name], indent=1))
    return 0


def write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
