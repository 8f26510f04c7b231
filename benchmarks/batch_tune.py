"""One batch tune against single tunes: the softmax sweep's 48 problems, from an empty cache and
an empty kernel store each time, the same trials and seed.

    python benchmarks/batch_tune.py singles --trials 12 --out DIR   # 48 x `autosoft tune softmax ...`
    python benchmarks/batch_tune.py batch --trials 12 --out DIR     # `autosoft tune --problems ...`
    python benchmarks/batch_tune.py compare --out DIR               # the table, from both JSON files

On a machine with several GPUs (the two-GPU measurement):

    python benchmarks/batch_tune.py batch --gpus 0 --name one-gpu --out DIR     # one worker process
    python benchmarks/batch_tune.py batch --gpus all --name all-gpus --out DIR  # one per GPU
    python benchmarks/batch_tune.py hosts --out DIR    # one command per GPU as separate "hosts" on one
                                                       # PostgreSQL; the first killed mid-run, started again
    python benchmarks/batch_tune.py batch --ray --name ray --out DIR           # one Ray task per GPU
                                                       # of a local one-node cluster
    python benchmarks/batch_tune.py compare --out DIR --first one-gpu --second all-gpus

`--replay FILE` answers from recorded trials instead of the GPU (to try the script without one).

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

from provenance import commit  # noqa: E402
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


def start_postgres():
    """A PostgreSQL server on this machine and the URL of a fresh database in it."""
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
    return server, server.database("batch")


def replaying(replay: str | None, delay: float = 0.0) -> list[str]:
    return ["--replay", replay, "--replay-delay", str(delay)] if replay else []


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


def batch(out: Path, trials: int, seed: int, storage: str | None, gpus: str | None, name: str,
          replay: str | None, ray: bool = False) -> dict:
    cache = out / f"{name}.sqlite"
    listing = out / "sweep.yaml"
    write_problems(listing, problems())
    server = None
    if storage is None and gpus is None and not ray:
        server, storage = start_postgres()
    env = {**os.environ, STORE_ENV: str(out / f"store-{name}")}
    where = ["--storage", storage] if storage else []
    where += ["--gpus", gpus] if gpus else []
    where += ["--ray"] if ray else []
    try:
        wall = run(["tune", "--problems", str(listing), "--trials", str(trials), "--seed", str(seed),
                    "--cache", str(cache), *where, *replaying(replay)], env)
    finally:
        if server is not None:
            server.close()
    return {"mode": name, "wall_s": wall, "gpus": gpus, "ray": ray,
            "storage": "postgresql (started here)" if server else (storage or "default"),
            "entries": entries(cache)}


def hosts(out: Path, trials: int, seed: int, replay: str | None, kill_after: int) -> dict:
    """Each GPU as a host: one `autosoft tune --problems ... --storage postgresql://... --gpus I`
    per GPU, each with its own cache file, all on one PostgreSQL server started here. Once
    `kill_after` problems are finished, the first command (its whole process group) is killed
    with SIGKILL and started again; then every problem must be finished exactly once."""
    import signal

    from autosoft.batch import stored_results
    from autosoft.board import Board
    from autosoft.storage import open_storage

    listing = out / "sweep.yaml"
    write_problems(listing, problems())
    gpu_list = ["0", "1"] if replay else [str(i) for i in range(_gpu_count())]
    server, url = start_postgres()
    try:
        def start(gpu: str) -> subprocess.Popen:
            env = {**os.environ, STORE_ENV: str(out / f"store-host{gpu}")}
            return subprocess.Popen(
                [sys.executable, "-m", "autosoft", "tune", "--problems", str(listing), "--trials", str(trials),
                 "--seed", str(seed), "--cache", str(out / f"host{gpu}.sqlite"), "--storage", url, "--gpus", gpu,
                 *replaying(replay, 0.05)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                stderr=open(out / f"host{gpu}.log", "a"), start_new_session=True)

        begin = time.perf_counter()
        procs = {gpu: start(gpu) for gpu in gpu_list}
        storage = open_storage(url, create=True)
        while len(stored_results(storage)) < kill_after and procs[gpu_list[0]].poll() is None:
            time.sleep(0.5)
        killed_at = len(stored_results(storage))
        os.killpg(procs[gpu_list[0]].pid, signal.SIGKILL)
        procs[gpu_list[0]].wait()
        procs[gpu_list[0]] = start(gpu_list[0])
        codes = {gpu: proc.wait() for gpu, proc in procs.items()}
        wall = time.perf_counter() - begin
        results = stored_results(storage)
        snap = Board(storage).snapshot()
        finished = {name: snap.problem(name).results for name in snap.leases}
        by_host: dict[str, int] = {}
        for r in results:
            by_host[str(r.get("gpu"))] = by_host.get(str(r.get("gpu")), 0) + 1
        return {"mode": "hosts", "wall_s": wall, "exit_codes": codes, "killed_after_results": killed_at,
                "results": len(results), "finished_twice": sum(n > 1 for n in finished.values()),
                "never_finished": len(problems()) - sum(n >= 1 for n in finished.values()),
                "taken_over": sum(r.get("generation", 0) > 0 for r in results), "results_by_gpu": by_host,
                "entries": {f"{r['problem']['shape']} {r['problem']['dtype']}": {
                    "variant": r["entry"]["variant_name"], "time_us": r["entry"]["time_us"],
                    "default_time_us": r["entry"]["default_time_us"]} for r in results if r.get("entry")}}
    finally:
        server.close()


def _gpu_count() -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def compare(out: Path, first: str = "singles", second: str = "batch") -> None:
    one = json.loads((out / f"{first}.json").read_text())
    many = json.loads((out / f"{second}.json").read_text())
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
    print(f"{first}: {one['wall_s']:.1f} s; {second}: {many['wall_s']:.1f} s "
          f"({100 * (many['wall_s'] / one['wall_s'] - 1):+.1f}%, {one['wall_s'] / many['wall_s']:.2f}x less)")
    print(f"same winner: {same} of {len(one['entries'])}; different winners:")
    print(f"| problem | {first}'s winner | µs | {second}'s winner | µs | {second} vs {first} |")
    print("|---|---|---:|---|---:|---:|")
    print("\n".join(rows))
    times = [100 * (many['entries'][k]['time_us'] - v['time_us']) / v['time_us']
             for k, v in one["entries"].items() if k in many["entries"]]
    print(f"winner time, {second} vs {first}: median {sorted(times)[len(times) // 2]:+.2f}%, "
          f"range {min(times):+.2f}% .. {max(times):+.2f}%")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("singles", "batch", "hosts", "compare"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage", default=None, help="batch: a storage URL instead of a PostgreSQL started here")
    parser.add_argument("--gpus", default=None, help="batch: worker processes per GPU (all, or 0,1): the default "
                                                     "journal storage unless --storage")
    parser.add_argument("--ray", action="store_true", help="batch: one worker per GPU of a local Ray cluster "
                                                           "(the default journal storage unless --storage)")
    parser.add_argument("--name", default=None, help="batch: the result's name (default batch)")
    parser.add_argument("--replay", default=None, help="answer from the trials recorded in this cache file")
    parser.add_argument("--kill-after", type=int, default=12, help="hosts: kill the first after this many results")
    parser.add_argument("--first", default="singles", help="compare: this result ...")
    parser.add_argument("--second", default="batch", help="compare: ... against this one")
    args = parser.parse_args()
    if args.mode == "compare":
        compare(args.out, args.first, args.second)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or args.mode
    if args.mode == "singles":
        result = singles(args.out, args.trials, args.seed)
    elif args.mode == "batch":
        result = batch(args.out, args.trials, args.seed, args.storage, args.gpus, name, args.replay, args.ray)
    else:
        result = hosts(args.out, args.trials, args.seed, args.replay, args.kill_after)
    gpu = "replay" if args.replay else __import__("autosoft.runtime").runtime.device_info().name
    result.update(trials=args.trials, seed=args.seed, commit=commit(), gpu=gpu)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
    print(f"{name}: {result['wall_s']:.1f} s for {len(result['entries'])} entries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
