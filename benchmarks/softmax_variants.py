"""Time hand-picked variants of a row-wise family side by side, to see where a shape loses time.

    python benchmarks/softmax_variants.py --shape 1024x32768 --dtype float16 \
        --set storage=registers,row_threads=512,threads=512 --set combine=cluster,split=4,threads=512,row_threads=512
    python benchmarks/softmax_variants.py --family softmax_backward --shape 4096x50257 --match storage=smem
    python benchmarks/softmax_variants.py --family attention --shape 1,32,1,128 --dtype bfloat16 \
        --option kv_heads=8 --option kv_len=4096 --set splits=16,stages=4

Any family: --option NAME=VALUE sets one of its problem options (repeatable; --log is the
softmax families' log=true).

Each --set overrides the heuristic default; each --match adds every valid variant whose parameters
have those values (at most --limit per match, spread over the list). Every variant is verified
before it is timed; --out writes the timings as JSON.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.compile import compile_source  # noqa: E402
from autosoft.errors import UserError  # noqa: E402
from autosoft.evaluate import time_variant, verify  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import build_variant, space_of  # noqa: E402
from autosoft.runtime import LoadedVariant, device_info  # noqa: E402
from autosoft.timing import time_copy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--family", default="softmax")
    parser.add_argument("--log", action="store_true", help="the family's log option (log-softmax)")
    parser.add_argument("--option", action="append", default=[], help="NAME=VALUE, a problem option (repeatable)")
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE,NAME=VALUE,... (repeatable)")
    parser.add_argument("--match", action="append", default=[], help="NAME=VALUE,... every valid variant with these")
    parser.add_argument("--limit", type=int, default=40, help="variants per --match at most")
    parser.add_argument("--out", type=Path, help="JSON file for the timings")
    args = parser.parse_args()
    family = get_family(args.family)
    options: dict = {"log": True} if args.log else {}
    declared = {o.name: o for o in family.options}
    for item in args.option:
        name, _, value = item.partition("=")
        if name not in declared:
            parser.error(f"--option {item}: the {family.name} family has no option {name!r} (it has {sorted(declared)})")
        options[name] = declared[name].parse(value)
    problem = family.problem(args.shape, args.dtype, options)
    target = device_info().target
    space = space_of(family)
    copy = time_copy(family.bytes_moved(problem) // 2, target.l2_bytes)
    print(f"{problem.shape_text} {problem.dtype}: copy {copy.median_us:.2f} us")
    candidates = []
    for spec in ["", *args.set]:
        params = family.default_params(problem, target)
        for item in filter(None, spec.split(",")):
            name, _, value = item.partition("=")
            params[name] = space.parse_value(name, value)
        candidates.append((spec or "default", params))
    valid = space.valid_points(family.problem_values(problem, target)) if args.match else []
    for spec in args.match:
        want = {name: space.parse_value(name, value)
                for name, _, value in (item.partition("=") for item in filter(None, spec.split(",")))}
        matching = [p for p in valid if all(p[k] == v for k, v in want.items())]
        step = max(1, len(matching) / max(1, args.limit))
        candidates += [(spec, matching[int(i * step)]) for i in range(min(args.limit, len(matching)))]
    built = []
    for spec, params in candidates:
        try:
            built.append(build_variant(family, problem, params, target))
        except UserError as exc:
            print(f"  {spec:60} invalid: {exc}")
    with ProcessPoolExecutor(mp_context=multiprocessing.get_context("spawn")) as pool:  # compiling dominates
        cubins = list(pool.map(_compile, [v.source for v in built], [target.arch] * len(built)))
    rows = []
    for variant, cubin in zip(built, cubins):
        params = dict(variant.params)
        loaded = LoadedVariant(variant, cubin)
        wrong = verify(family, loaded, seed=1)
        if wrong:
            print(f"  {variant.name:70} WRONG {wrong}")
            continue
        t = time_variant(family, loaded, reps=60)
        print(f"  {variant.name:70} {t.median_us:9.2f} us {100 * copy.median_us / t.median_us:6.1f}% of copy")
        rows.append({"variant": variant.name, "params": params, "us": t.median_us,
                     "pct_of_copy": 100 * copy.median_us / t.median_us})
    rows.sort(key=lambda r: r["us"])
    print(f"fastest of {len(rows)}:")
    for r in rows[:8]:
        print(f"  {r['variant']:70} {r['us']:9.2f} us {r['pct_of_copy']:6.1f}% of copy")
    if args.out:
        args.out.write_text(json.dumps({"shape": problem.shape_text, "dtype": problem.dtype, "family": family.name,
                                        "copy_us": copy.median_us, "variants": rows}, indent=1))
    return 0


def _compile(source: str, arch: str) -> bytes:
    result = compile_source(source, arch)
    if not result.ok:
        raise RuntimeError(result.log[:2000])
    return result.cubin


if __name__ == "__main__":
    raise SystemExit(main())
