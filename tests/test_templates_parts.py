"""Templates in parts: the shared prelude and PTX helpers under templates/common/, softmax's
storage strategies and combine modes as include files, and a template digest that covers every
file a render reads.

Run as a script, it is the byte-identity check of a template refactor (a one-off, not a test:
it renders about two million variants):

    python tests/test_templates_parts.py snapshot /tmp/render-hashes.json   # before the change
    python tests/test_templates_parts.py compare /tmp/render-hashes.json    # after it

snapshot renders every valid point of a set of softmax and attention problems and saves the
sha256 of each rendered source; compare renders the same points again and reports any variant
whose source changed.
"""
from __future__ import annotations

import hashlib
import json
import sys
from typing import Any, Iterator

# The problems of the byte-identity check: every valid point of each, on sm_90 and sm_80.
SOFTMAX_SHAPES = ("4096x8192", "7x1025", "32x131072", "1x1048576", "65536x64", "4096x50257",
                  "16384x4000", "1024x32768")
ATTENTION_SHAPES = ("1x32x8192x64", "4x16x4096x128", "3x7x1000x64", "1x2x77x32")
ARCHS = ("90", "80")


def _cases() -> Iterator[tuple[str, str, str, tuple[str, ...], str]]:
    for shape in SOFTMAX_SHAPES:
        for dtype in ("float32", "float16", "bfloat16"):
            for arch in ARCHS:
                yield "softmax", shape, dtype, (), arch
    for shape in ATTENTION_SHAPES:
        for dtype in ("float16", "bfloat16"):
            for flags in ((), ("causal",)):
                for arch in ARCHS:
                    yield "attention", shape, dtype, flags, arch


def _render_case(name: str, shape: str, dtype: str, flags: tuple[str, ...], arch: str) -> dict[str, Any]:
    """Every valid point of one problem: a digest of the point list, and per point (in
    valid_points order) an index into the distinct source hashes."""
    from autosoft.families import get_family
    from autosoft.families.base import Target, build_variant, space_of

    family = get_family(name)
    problem = family.problem(shape, dtype, flags)
    target = Target.for_arch(arch)
    points = space_of(family).valid_points(family.problem_values(problem, target))
    unique: dict[str, int] = {}
    index: list[int] = []
    for params in points:
        digest = hashlib.sha256(build_variant(family, problem, params, target).source.encode()).hexdigest()
        index.append(unique.setdefault(digest, len(unique)))
    points_digest = hashlib.sha256(json.dumps(points, sort_keys=True).encode()).hexdigest()
    return {"points": points_digest, "sources": list(unique), "index": index}


def _label(case: tuple[str, str, str, tuple[str, ...], str]) -> str:
    name, shape, dtype, flags, arch = case
    return f"{name} {shape}{''.join('+' + f for f in flags)} {dtype} sm_{arch}"


def snapshot(path: str) -> None:
    result = {}
    for case in _cases():
        result[_label(case)] = _render_case(*case)
        print(_label(case), len(result[_label(case)]["index"]), "points", flush=True)
    with open(path, "w") as f:
        json.dump(result, f)


def compare(path: str) -> int:
    with open(path) as f:
        before = json.load(f)
    variants = identical = 0
    for case in _cases():
        label = _label(case)
        old, new = before[label], _render_case(*case)
        assert old["points"] == new["points"], f"{label}: the valid points changed; compare needs the same space"
        same = sum(old["sources"][i] == new["sources"][j] for i, j in zip(old["index"], new["index"]))
        variants += len(old["index"])
        identical += same
        print(f"{label}: {same}/{len(old['index'])} identical ({len(new['sources'])} distinct sources)", flush=True)
    print(f"total: {identical}/{variants} variants render byte-identical sources")
    return 0 if identical == variants else 1


if __name__ == "__main__":
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's autosoft
    if len(sys.argv) != 3 or sys.argv[1] not in ("snapshot", "compare"):
        sys.exit(__doc__)
    sys.exit(snapshot(sys.argv[2]) if sys.argv[1] == "snapshot" else compare(sys.argv[2]))
