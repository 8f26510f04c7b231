"""Time hand-picked softmax variants side by side, to see where a shape loses time.

    python benchmarks/softmax_variants.py --shape 1024x32768 --dtype float16 \
        --set storage=registers,row_threads=512,threads=512 --set combine=cluster,split=4,threads=512,row_threads=512

Each --set overrides the heuristic default; every variant is verified before it is timed.
"""
from __future__ import annotations

import argparse
import sys
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
    parser.add_argument("--set", action="append", default=[], help="NAME=VALUE,NAME=VALUE,... (repeatable)")
    args = parser.parse_args()
    family = get_family("softmax")
    problem = family.problem(args.shape, args.dtype)
    target = device_info().target
    space = space_of(family)
    copy = time_copy(family.bytes_moved(problem) // 2, target.l2_bytes)
    print(f"{problem.shape_text} {problem.dtype}: copy {copy.median_us:.2f} us")
    for spec in ["", *args.set]:
        params = family.default_params(problem, target)
        for item in filter(None, spec.split(",")):
            name, _, value = item.partition("=")
            params[name] = space.parse_value(name, value)
        try:
            variant = build_variant(family, problem, params, target)
        except UserError as exc:
            print(f"  {spec or 'default':60} invalid: {exc}")
            continue
        result = compile_source(variant.source, target.arch)
        loaded = LoadedVariant(variant, result.cubin)
        wrong = verify(family, loaded, seed=1)
        if wrong:
            print(f"  {variant.name:70} WRONG {wrong}")
            continue
        t = time_variant(family, loaded, reps=60)
        print(f"  {variant.name:70} {t.median_us:9.2f} us {100 * copy.median_us / t.median_us:6.1f}% of copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
