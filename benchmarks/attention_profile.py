"""Launch one attention variant and cuDNN's SDPA kernel on the same problem, for Nsight Compute.

    ncu --clock-control none -k regex:"attention_fwd|fprop" --section SpeedOfLight \
        --section InstructionStats --section Occupancy --section SchedulerStats --csv --page details \
        python benchmarks/attention_profile.py --shape 16,16,512,64 --causal \
        --set block_m=64,block_n=128,blocks_per_sm=2,persistent=true,queue=true > ncu.csv
    ncu --clock-control none -k regex:"attention_bwd$|bprop" ... python benchmarks/attention_profile.py \
        --family attention_backward --shape 4,16,4096,128 > ncu_bwd.csv

The variant is the heuristic default with --set's overrides (as in softmax_variants.py); it runs
through the timing harness (a few warm-up launches, then --launches timed ones), then torch's SDPA
with the cuDNN backend forced --launches times, on fresh random inputs. Our kernel is `attention_fwd`; cuDNN's names contain `fprop`.
With --family attention_backward the variant is the backward's (main kernel `attention_bwd`) and
SDPA runs forward and backward (cuDNN's backward kernels contain `bprop`).
What the two kernels execute (instructions, issue rate, occupancy) is the first thing to compare
where a row stays below cuDNN.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.compile import compile_source  # noqa: E402
from autosoft.evaluate import time_variant  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import build_variant, space_of  # noqa: E402
from autosoft.runtime import LoadedVariant, device_info  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="attention", choices=("attention", "attention_backward"))
    parser.add_argument("--shape", required=True, help="B,H,N,D")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--set", default="", help="NAME=VALUE,... over the default's parameters")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    family = get_family(args.family)
    problem = family.problem(args.shape, args.dtype, ("causal",) if args.causal else ())
    target = device_info().target
    params = family.default_params(problem, target)
    for item in filter(None, args.set.split(",")):
        name, _, value = item.partition("=")
        params[name] = space_of(family).parse_value(name, value)
    variant = build_variant(family, problem, params, target)
    compiled = compile_source(variant.source, target.arch)
    if not compiled.ok:
        raise SystemExit(compiled.log[:2000])
    timing = time_variant(family, LoadedVariant(variant, compiled.cubin), reps=args.launches)
    print(f"{variant.name}: {timing.median_us:.1f} us", flush=True)
    b, h, n, d = problem.shape
    dtype = getattr(torch, args.dtype)
    backward = args.family == "attention_backward"
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, requires_grad=backward) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(args.launches):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            if backward:
                o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
