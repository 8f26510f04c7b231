"""Launch one router (topk_softmax) row's tuned kernel for Nsight Compute.

    python benchmarks/router_profile.py --cache router.sqlite --row 65536x256 --grouped    # tunes where missing
    ncu --clock-control none --profile-from-start off --set full --csv --page details \
        python benchmarks/router_profile.py --cache router.sqlite --row 65536x256 --grouped > ncu.csv

The row's kernel comes from --cache, tuned there first (--trials, seed 0) where it holds none, as
benchmarks/router.py does; then, on random bf16 logits (and DeepSeek-V3's bias where grouped), a few
warm-up launches and one launch between cudaProfilerStart and cudaProfilerStop, so that
`ncu --profile-from-start off` profiles that launch alone (tuning and verification launch the kernel
too). Run it once without ncu to tune: under ncu every trial would be profiled.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autosoft.cache import Cache  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.tune import tuned_kernel  # noqa: E402
from router import DEEPSEEK, SCALE  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", type=Path, required=True, help="tuned-kernel cache (SQLite), tuned into where missing")
    parser.add_argument("--row", default="65536x256", help="TOKENSxEXPERTS")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--grouped", action="store_true", help="DeepSeek-V3's grouped form (8 groups, 4 kept, bias)")
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    import torch

    tokens, experts = (int(v) for v in args.row.lower().split("x"))
    family = get_family("topk_softmax")
    problem = family.problem(args.row, "bfloat16", {"k": args.k, "renormalize": True,
                                                    **(DEEPSEEK if args.grouped else {})})
    loaded, tuned_now = tuned_kernel(family, problem, Cache(args.cache), args.trials, seed=0)
    x = torch.randn(tokens, experts, device="cuda").bfloat16()
    bias = torch.randn(experts, device="cuda") * 0.1
    weights = torch.empty(tokens, args.k, device="cuda")
    indices = torch.empty(tokens, args.k, device="cuda", dtype=torch.int32)
    launch = {"logits": x.data_ptr(), "weights": weights.data_ptr(), "indices": indices.data_ptr(),
              "bias": bias.data_ptr(), "scale": np.float32(SCALE if args.grouped else 1.0)}
    for _ in range(3):
        loaded.launch(launch)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    loaded.launch(launch)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"{loaded.variant.name}{' (tuned now)' if tuned_now else ''}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
