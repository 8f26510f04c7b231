"""Time a fixed set of variants with whichever autosoft is on PYTHONPATH: the check that a refactor kept the
kernels (and their speed) of the current tables.

Rows come from three places: a table's JSON whose rows carry "params" (benchmarks/attention.py's tuned runs),
a cache file (every entry, read as stored), and problems given on the command line whose variant is the
tree's heuristic default (rows whose JSON names a variant but not its params). Each row is built, its source
hashed, compiled (cubins shared through --cubins by source hash, so two trees with the same source time the
same cubin), verified against the family's reference and timed (median over rotated, cold inputs).

    PYTHONPATH=<tree> python benchmarks/retime.py --table T.json --cache C.sqlite \
        --defaults "attention_colsum:1x32x1024x128+causal+split=512:bfloat16" --out <tree>.json

Run it once per tree, in turns (old, new, old, new), then `--compare a.json,b.json c.json,d.json` prints
each row's time in both and their ratio; rows whose sources differ are named.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sqlite3
import statistics
import sys
from pathlib import Path
from typing import Any


def table_rows(path: str) -> list[tuple[str, str, str, dict]]:
    """(family, shape text, dtype, params) of the verified rows of an attention table's JSON."""
    out = []
    for row in json.loads(Path(path).read_text())["rows"]:
        if "params" in row and row.get("verified"):
            shape = row["shape"] + ("+causal" if row["causal"] else "")
            out.append(("attention", shape, row["dtype"], row["params"]))
    return out


def cache_rows(path: str) -> list[tuple[str, str, str, dict]]:
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        return [(f, s, d, json.loads(p)) for f, s, d, p in
                db.execute("SELECT family, shape, dtype, params FROM entries ORDER BY family, dtype, shape")]


def default_rows(spec: str) -> list[tuple[str, str, str, dict | None]]:
    return [tuple(item.split(":")) + (None,) for item in spec.split(";") if item]  # type: ignore[misc]


def _compile(job: tuple[str, str, str, str]) -> str | None:
    """Compile one source into its cubin file (in a pool process); the log's tail on failure."""
    from autosoft.compile import compile_source

    source, arch, name, path = job
    compiled = compile_source(source, arch, name)
    if not compiled.ok:
        return compiled.log[-300:]
    Path(path).write_bytes(compiled.cubin)
    return None


def run(rows: list, cubins: Path, reps: int, check: bool = True) -> list[dict[str, Any]]:
    import concurrent.futures as cf
    import multiprocessing as mp
    import os

    from autosoft.evaluate import time_variant, verify
    from autosoft.families import get_family
    from autosoft.families.base import build_variant
    from autosoft.runtime import LoadedVariant, device_info

    target = device_info().target
    cubins.mkdir(parents=True, exist_ok=True)
    built = []
    for family_name, shape, dtype, params in rows:
        family = get_family(family_name)
        problem = family.parse_problem(shape, dtype)
        if params is None:
            params = family.default_params(problem, target)
        variant = build_variant(family, problem, params, target)
        sha = hashlib.sha256(variant.source.encode()).hexdigest()
        key = f"{family_name} {shape} {dtype} {json.dumps(params, sort_keys=True)}"
        built.append((family, variant, sha, key, cubins / f"{sha}_{target.arch}.cubin"))
    jobs = {str(path): (v.source, target.arch, v.name + ".cu", str(path)) for _, v, _, _, path in built
            if not path.exists()}
    with cf.ProcessPoolExecutor(min(16, os.cpu_count() or 1), mp.get_context("spawn")) as pool:
        errors = dict(zip(jobs, pool.map(_compile, jobs.values())))
    results = []
    for family, variant, sha, key, path in built:
        if errors.get(str(path)):
            results.append({"key": key, "sha": sha, "error": errors[str(path)]})
            continue
        loaded = LoadedVariant(variant, path.read_bytes())
        wrong = verify(family, loaded, seed=7) if check else None
        time_variant(family, loaded, reps)  # a first timing brings the clocks up from whatever came before
        us = time_variant(family, loaded, reps).median_us
        results.append({"key": key, "name": variant.name, "sha": sha, "us": us, "wrong": wrong})
        print(f"{us:9.2f} us  {'WRONG ' + wrong if wrong else 'ok'}  {variant.name}  {variant.problem.shape_text} "
              f"{variant.problem.dtype}", flush=True)
    return results


def compare(sides: list[str]) -> int:
    """sides: two comma-separated lists of result files (rounds of the old tree, rounds of the new).
    Rows match by family, problem, dtype and variant name: a refactor may spell a point's params
    differently (an engine's point holds only its own), never its name."""
    times: list[dict[str, list[float]]] = []
    shas: list[dict[str, str]] = []
    for side in sides:
        t: dict[str, list[float]] = {}
        s: dict[str, str] = {}
        for path in side.split(","):
            for r in json.loads(Path(path).read_text())["rows"]:
                if "us" not in r or r.get("wrong"):
                    continue
                key = " ".join(r["key"].split(" ")[:3] + [r["name"]])
                s[key] = r["sha"]
                t.setdefault(key, []).append(r["us"])
        times.append(t)
        shas.append(s)
    worst, bad = 0.0, 0
    print("| row | variant | before µs | after µs | after / before | source |")
    print("|---|---|---:|---:|---:|---|")
    for key in times[0]:
        family, shape, dtype, name = key.split(" ")
        if key not in times[1]:
            print(f"| {family} {shape} {dtype} | `{name}` | {statistics.median(times[0][key]):.2f} | missing | | |")
            bad += 1
            continue
        a, b = statistics.median(times[0][key]), statistics.median(times[1][key])
        same = "same" if shas[0][key] == shas[1][key] else "CHANGED"
        bad += same != "same"
        worst = max(worst, b / a)
        print(f"| {family} {shape} {dtype} | `{name}` | {a:.2f} | {b:.2f} | {b / a:.3f} | {same} |")
    print(f"\n{len(times[0])} rows; worst after/before {worst:.3f}; rows with changed sources or missing: {bad}")
    return 0 if bad == 0 and worst <= 1.02 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="append", default=[], help="a table JSON whose rows carry params")
    parser.add_argument("--cache", action="append", default=[], help="a cache file: every entry")
    parser.add_argument("--defaults", default="", help="family:shape text:dtype;... timed at the default variant")
    parser.add_argument("--cubins", type=Path, default=Path("/tmp/retime-cubins"))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--no-verify", action="store_true", help="time only (a later round of rows already verified)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compare", nargs=2, metavar="FILES", help="old results, new results (comma-separated)")
    args = parser.parse_args()
    if args.compare:
        return compare(args.compare)
    rows = [r for p in args.table for r in table_rows(p)] + [r for p in args.cache for r in cache_rows(p)]
    rows += default_rows(args.defaults)
    from autosoft.runtime import device_info

    result = {"gpu": device_info().name, "rows": run(rows, args.cubins, args.reps, not args.no_verify)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
