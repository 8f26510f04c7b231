"""Carry a tuned cache across a template change that leaves the kernels' source as it was.

A cache key holds the template digest, so any edit of a template file (a split into includes;
Jinja comments no longer count) retires every entry, even where the CUDA source a variant renders
to is byte for byte the same. This script re-renders each entry's params for its own problem and GPU kind with the
current templates and compares the sha256 over (source, compile options, sm_XX, the entry's
NVRTC version) with the `source_digest` the entry was stored with. Where they are equal the
kernel is the very one that was tuned and timed, and the entry is stored again under the
current template digest; where they differ it is left out and listed. The input file is never
modified; the output is a new file.

    python benchmarks/rekey_cache.py benchmarks/results/softmax_h200.sqlite -o rekeyed.sqlite
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from contextlib import closing
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autosoft.cache import Cache  # noqa: E402
from autosoft.compile import source_digest  # noqa: E402
from autosoft.errors import UserError  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import Target, build_variant, family_template_digest, space_of  # noqa: E402

# The device properties a tuned entry's GPU had, where the source depends on them (shared-memory
# limit, SM count); GPUs not listed render with Target.for_arch.
KNOWN_GPUS = {"NVIDIA H200": Target(arch="90", name="NVIDIA H200", sm_count=132, smem_optin=227 * 1024)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache", type=Path, help="the tuned cache to read (never modified)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="the re-keyed cache to write")
    args = parser.parse_args()
    if args.output.exists():
        print(f"rekey_cache: {args.output} exists; name a new file", file=sys.stderr)
        return 2
    source_cache = Cache(args.cache, create=False)
    kept, dropped = 0, []
    out = Cache(args.output)
    for entry in source_cache.entries():
        family = get_family(entry.key.family)
        target = KNOWN_GPUS.get(entry.key.gpu_name, Target.for_arch(entry.key.compute_capability))
        try:
            problem = family.parse_problem(entry.key.shape, entry.key.dtype)
            variant = build_variant(family, problem, entry.params, target)
        except UserError as exc:
            dropped.append(f"{entry.key.shape} {entry.key.dtype}: {exc}")
            continue
        if source_digest(variant.source, target.arch, entry.key.cuda_version) != entry.source_digest:
            dropped.append(f"{entry.key.shape} {entry.key.dtype}: {entry.variant_name} renders to another source")
            continue
        key = replace(entry.key, template_digest=family_template_digest(family), space_digest=space_of(family).digest)
        out.put(replace(entry, key=key))
        kept += 1
    with closing(sqlite3.connect(args.output)) as conn, conn:  # the trial log as it was, times included
        conn.execute("ATTACH DATABASE ? AS src", (f"file:{args.cache.resolve()}?mode=ro",))
        conn.execute("INSERT INTO trials SELECT * FROM src.trials")
    print(f"{kept} entries re-keyed, {len(dropped)} left out; trials copied")
    for line in dropped:
        print(f"  left out: {line}")
    return 0 if not dropped else 1


if __name__ == "__main__":
    sys.exit(main())
