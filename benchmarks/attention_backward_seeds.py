"""The attention backward's default and first seeds on four rows, beside SDPA's backward: what each
tuned choice of the engine buys, in one run, without tuning.

    python benchmarks/attention_backward_seeds.py --seeds 6 --out bwd_seeds.json
    python benchmarks/attention_backward_seeds.py --seeds 6 --deterministic --out bwd_seeds_det.json

Rows (bf16): (4,16,4096,128) full and causal, (2,16,8192,64) causal, (16,16,1024,64) causal. For
each, the family's heuristic default and its first --seeds seeds (`Family.seed_params`, the points
the tuner tries first) are compiled, verified against the reference, and timed through the
benchmark harness (`autosoft.evaluate.time_variant`: CUDA events, warm-up, median, inputs rotated
past the L2); then SDPA's backward with the cuDNN and the flash backends, forced, on torch tensors
of the same shape (torch.autograd.grad, retain_graph). --deterministic takes the deterministic
problems (dQ the same bits on every run). TF/s counts the backward as 2.5x the forward's FLOPs
(causal halved). --out writes every variant's time as JSON; one line a row is printed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.compile import compile_source  # noqa: E402
from autosoft.evaluate import time_variant, verify  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import build_variant  # noqa: E402
from autosoft.runtime import LoadedVariant, device_info  # noqa: E402
from autosoft.timing import time_gpu  # noqa: E402

from provenance import commit  # noqa: E402

ROWS = [((4, 16, 4096, 128), False), ((4, 16, 4096, 128), True), ((2, 16, 8192, 64), True),
        ((16, 16, 1024, 64), True)]


def sdpa_backward_us(torch, shape: tuple[int, ...], causal: bool, backend: str, reps: int) -> float:
    """SDPA's backward alone with `backend` forced, on fresh bf16 tensors: median µs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel(getattr(SDPBackend, backend)):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return time_gpu(lambda i: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), 1, reps).median_us


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4, help="how many of the default's seeds to time")
    parser.add_argument("--deterministic", action="store_true", help="the deterministic problems")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.seeds < 0:
        parser.error("--seeds takes a count of 0 or more")
    import torch

    family, target = get_family("attention_backward"), device_info().target
    rows = []
    for shape, causal in ROWS:
        options = {"causal": causal, **({"deterministic": True} if args.deterministic else {})}
        problem = family.problem(",".join(map(str, shape)), "bfloat16", options)
        flops = family.flops(problem)
        points = [family.default_params(problem, target)] + family.seed_params(problem, target)[: args.seeds]
        times: dict[str, float] = {}
        for params in points:
            variant = build_variant(family, problem, params, target)
            compiled = compile_source(variant.source, target.arch)
            if not compiled.ok:
                raise SystemExit(f"{variant.name} does not compile: {compiled.log[:300]}")
            loaded = LoadedVariant(variant, compiled.cubin)
            problem_found = verify(family, loaded, seed=1)
            if problem_found:
                raise SystemExit(f"{variant.name} is wrong: {problem_found}")
            times[variant.name] = time_variant(family, loaded, reps=args.reps).median_us
        sdpa = {backend: sdpa_backward_us(torch, shape, causal, backend, args.reps)
                for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION")}
        best = min(times, key=times.get)
        rows.append({"shape": shape, "causal": causal, "variants": times, "best": best, "best_us": times[best],
                     "tflops": flops / times[best] / 1e6, "sdpa_us": sdpa,
                     "sdpa_tflops": {name: flops / us / 1e6 for name, us in sdpa.items()}})
        print(",".join(map(str, shape)), "causal" if causal else "full",
              f"autosoft {times[best]:.0f} us {flops / times[best] / 1e6:.0f} TF/s ({best})",
              " ".join(f"{name} {us:.0f} us {flops / us / 1e6:.0f}" for name, us in sdpa.items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "commit": commit(),
                                        "deterministic": args.deterministic, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
