"""One batch tune against single tunes: the softmax sweep's 48 problems, from an empty cache and
an empty kernel store each time, the same trials and seed.

    python benchmarks/batch_tune.py singles --trials 12 --out DIR   # 48 x `autosoft tune softmax ...`
    python benchmarks/batch_tune.py batch --trials 12 --out DIR     # `autosoft tune --problems ...`
    python benchmarks/batch_tune.py compare DIR                     # the table, from both JSON files

`batch` keeps its studies in a PostgreSQL server it starts on this machine (tests/postgres.py: the
system's binaries, else those of the `pgserver` wheel), as a cluster's hosts would share one;
`--storage URL` names another. Each mode writes DIR/<mode>.json: the wall time of the whole (the
commands as a user would run them, process start-ups included), each problem's winner and time.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from softmax import DTYPES, SWEEP  # noqa: E402

from autosoft.cache import STORE_ENV, Cache  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.problems import write_problems  # noqa: E402


def problems():
    softmax = get_family("softmax")
    return [softmax.problem(f"{m}x{n}", dtype) for dtype in DTYPES for m, n in SWEEP]


def entries(cache_path: Path) -> dict[str, dict]:
    return {f"{e.key.shape} {e.key.dtype}": {"variant": e.variant_name, "time_us": e.time_us,
                                             "default_time_us": e.default_time_us}
            for e in Cache(cache_path).entries()}


def commit() -> str:
    if os.environ.get("BENCH_COMMIT"):  # the device machine's copy has no .git
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autosoft", *args], cwd=REPO, env=env, capture_output=True,
                          text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"autosoft {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def singles(out: Path, trials: int, seed: int) -> dict:
    cache = out / "singles.sqlite"
    env = {**os.environ, STORE_ENV: str(out / "store-singles")}
    per_problem = {}
    start = time.perf_counter()
    for p in problems():
        per_problem[f"{p.shape_text} {p.dtype}"] = run(
            ["tune", "softmax", "--shape", p.shape_text, "--dtype", p.dtype, "--trials", str(trials),
             "--seed", str(seed), "--cache", str(cache)], env)
        print(f"{p.shape_text} {p.dtype}: {per_problem[f'{p.shape_text} {p.dtype}']:.1f} s", flush=True)
    return {"mode": "singles", "wall_s": time.perf_counter() - start, "per_problem_s": per_problem,
            "entries": entries(cache)}


def batch(out: Path, trials: int, seed: int, storage: str | None) -> dict:
    cache = out / "batch.sqlite"
    listing = out / "sweep.yaml"
    write_problems(listing, problems())
    server = None
    if storage is None:
        sys.path.insert(0, str(REPO / "tests"))
        from postgres import PostgresServer, find_binaries, free_port

        binaries = find_binaries()
        if binaries is None:
            raise SystemExit("no PostgreSQL binaries (apt-get install postgresql, or pip install pgserver)")
        root = Path("/tmp") / f"autosoft-bench-pg-{os.getpid()}"
        root.mkdir(mode=0o755)
        server = PostgresServer(binaries, root, free_port())
        server.init()
        server.start()
        storage = server.database("batch")
    env = {**os.environ, STORE_ENV: str(out / "store-batch")}
    try:
        wall = run(["tune", "--problems", str(listing), "--trials", str(trials), "--seed", str(seed),
                    "--cache", str(cache), "--storage", storage], env)
    finally:
        if server is not None:
            server.close()
    return {"mode": "batch", "wall_s": wall, "storage": "postgresql (started here)" if server else storage,
            "entries": entries(cache)}


def compare(out: Path) -> None:
    one = json.loads((out / "singles.json").read_text())
    many = json.loads((out / "batch.json").read_text())
    same = diffs = 0
    rows = []
    for key, s in one["entries"].items():
        b = many["entries"].get(key)
        if b is None:
            rows.append(f"| {key} | {s['variant']} | {s['time_us']:.2f} | missing | - | - |")
            continue
        delta = 100 * (b["time_us"] - s["time_us"]) / s["time_us"]
        same += s["variant"] == b["variant"]
        diffs += s["variant"] != b["variant"]
        if s["variant"] != b["variant"]:
            rows.append(f"| {key} | `{s['variant']}` | {s['time_us']:.2f} | `{b['variant']}` | {b['time_us']:.2f} "
                        f"| {delta:+.1f}% |")
    print(f"GPU run at {one.get('commit')} / {many.get('commit')}, {one['trials']} trials per problem")
    print(f"singles: {one['wall_s']:.1f} s; batch: {many['wall_s']:.1f} s "
          f"({100 * (many['wall_s'] / one['wall_s'] - 1):+.1f}%)")
    print(f"same winner: {same} of {len(one['entries'])}; different winners:")
    print("| problem | single's winner | µs | batch's winner | µs | batch vs single |")
    print("|---|---|---:|---|---:|---:|")
    print("\n".join(rows))
    times = [100 * (many['entries'][k]['time_us'] - v['time_us']) / v['time_us']
             for k, v in one["entries"].items() if k in many["entries"]]
    print(f"winner time, batch vs single: median {sorted(times)[len(times) // 2]:+.2f}%, "
          f"range {min(times):+.2f}% .. {max(times):+.2f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("singles", "batch", "compare"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default=None, help="batch: a storage URL instead of a PostgreSQL started here")
    args = parser.parse_args()
    if args.mode == "compare":
        compare(args.out)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    result = singles(args.out, args.trials, args.seed) if args.mode == "singles" else \
        batch(args.out, args.trials, args.seed, args.storage)
    from autosoft.runtime import device_info

    result.update(trials=args.trials, seed=args.seed, commit=commit(), gpu=device_info().name)
    (args.out / f"{args.mode}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"{args.mode}: {result['wall_s']:.1f} s for {len(result['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
