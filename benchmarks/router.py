"""The MoE router: autosoft's topk_softmax against torch's eager composition (softmax, topk,
renormalise; DeepSeek-V3's grouped_topk for the grouped rows) and the same under torch.compile,
against the copy limit.

    python benchmarks/router.py --cache router.sqlite --trials 30 --out router.json
    python benchmarks/router.py --quick --out router_quick.json     # 7 rows, about 3 minutes

For every row (tokens x experts x k, dtype, plain or grouped): a device-to-device copy of the same
bytes (logits read + weights and indices written) is timed as the limit; autosoft is tuned (or
taken from the cache); the copy, autosoft, torch eager and torch.compile are then timed the same way
(CUDA events after warm-up, inputs rotated so every run reads fresh data from memory), in --rounds
rounds that take turns: each figure is the median of its rounds' medians. torch's composition
returns int64 indices (no cast to int32 is timed against it). Before timing, autosoft's indices are
compared with torch's float64 choice and its weights with torch's float64 weights (in the JSON).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.cache import Cache  # noqa: E402
from autosoft.families import get_family  # noqa: E402
from autosoft.runners import GpuRunner  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402
from autosoft.tune import tuned_kernel  # noqa: E402
from softmax import medians_in_turns  # noqa: E402

DEEPSEEK = {"n_group": 8, "topk_group": 4, "sigmoid": True, "bias": True}
SCALE = 2.5  # DeepSeek-V3's routed_scaling_factor
# (tokens, experts, k, dtype, grouped): Mixtral (8, k 2), Qwen1.5-MoE (60, k 4), DeepSeek-V2-Lite
# (64, k 6), Qwen3 (128, k 8), DeepSeek-V2 (160, k 6), DeepSeek-V3 (256, k 8, grouped), Kimi K2
# (384, k 8), 512 experts with k 16; decode (1, 128 tokens), prefill (4096, 65536 tokens)
ROWS = [(1, 8, 2, "float32", False), (1, 256, 8, "bfloat16", True), (128, 8, 2, "bfloat16", False),
        (128, 60, 4, "bfloat16", False), (128, 128, 8, "bfloat16", False), (4096, 8, 2, "bfloat16", False),
        (4096, 60, 4, "bfloat16", False), (4096, 64, 6, "bfloat16", False), (4096, 128, 8, "bfloat16", False),
        (4096, 160, 6, "bfloat16", False), (4096, 256, 8, "bfloat16", True), (4096, 384, 8, "bfloat16", False),
        (4096, 512, 16, "float32", False), (65536, 8, 2, "bfloat16", False), (65536, 60, 4, "float32", False),
        (65536, 64, 6, "bfloat16", False), (65536, 128, 8, "bfloat16", False), (65536, 160, 6, "float16", False),
        (65536, 256, 8, "bfloat16", False), (65536, 256, 8, "bfloat16", True), (65536, 256, 1, "float32", False),
        (65536, 384, 8, "bfloat16", False), (65536, 512, 16, "bfloat16", False)]
# the copy target is set at 65,536 tokens: 128, 256 and 384 experts (k 8) and DeepSeek-V3's grouped shape
QUICK = [(4096, 8, 2, "bfloat16", False), (4096, 128, 8, "bfloat16", False), (4096, 256, 8, "bfloat16", True),
         (65536, 128, 8, "bfloat16", False), (65536, 256, 8, "bfloat16", False), (65536, 384, 8, "bfloat16", False),
         (65536, 256, 8, "bfloat16", True)]


def torch_router(torch, grouped: bool):
    """torch's composition: softmax, topk, renormalise; grouped: DeepSeek-V3's grouped_topk (as
    vLLM's Python reference writes it)."""
    def fp32(x):  # the reference's float64 stays float64
        return x if x.dtype == torch.float64 else x.float()

    def plain(x, k: int):
        w = torch.softmax(fp32(x), dim=-1)
        w, i = torch.topk(w, k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), i

    def deepseek(x, bias, k: int):
        scores = torch.sigmoid(fp32(x))
        keys = scores + bias
        t, e = keys.shape
        group = keys.view(t, 8, e // 8).topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(group).scatter_(1, group.topk(4, dim=-1).indices, 1)
        mask = kept.unsqueeze(-1).expand(t, 8, e // 8).reshape(t, e)
        i = keys.masked_fill(mask == 0, float("-inf")).topk(k, dim=-1).indices
        w = scores.gather(1, i)
        return SCALE * w / w.sum(dim=-1, keepdim=True), i

    return deepseek if grouped else plain


def bench_row(torch, row: tuple, cache: Cache, trials: int, reps: int, rounds: int, runner: GpuRunner) -> dict:
    tokens, experts, k, dtype, grouped = row
    family = get_family("topk_softmax")
    problem = family.problem(f"{tokens}x{experts}", dtype, {"k": k, "renormalize": True, **(DEEPSEEK if grouped else {})})
    device = device_info()
    nbytes = family.bytes_moved(problem)
    n_sets = rotation_count(nbytes, device.target.l2_bytes)
    tdtype = getattr(torch, dtype)
    xs = [torch.randn(tokens, experts, device="cuda").to(tdtype) for _ in range(n_sets)]
    bias = torch.randn(experts, device="cuda") * 0.1
    ws = [torch.empty(tokens, k, device="cuda") for _ in range(n_sets)]
    ids = [torch.empty(tokens, k, device="cuda", dtype=torch.int32) for _ in range(n_sets)]
    out = {"tokens": tokens, "experts": experts, "k": k, "dtype": dtype, "grouped": grouped,
           "shape": problem.shape_text, "bytes": nbytes}

    t0 = time.perf_counter()
    loaded, tuned_now = tuned_kernel(family, problem, cache, trials, runner=runner, seed=0)
    out.update(variant=loaded.variant.name, tuned_now=tuned_now, tune_s=round(time.perf_counter() - t0, 2))
    scale = np.float32(SCALE if grouped else 1.0)

    def ours(i: int) -> None:
        loaded.launch({"logits": xs[i].data_ptr(), "weights": ws[i].data_ptr(), "indices": ids[i].data_ptr(),
                       "bias": bias.data_ptr(), "scale": scale})

    eager = torch_router(torch, grouped)
    args = (lambda i: (xs[i], bias, k)) if grouped else (lambda i: (xs[i], k))
    t0 = time.perf_counter()
    compiled = torch.compile(eager, dynamic=False)
    compiled(*args(0))
    torch.cuda.synchronize()
    out["torch_compile_s"] = round(time.perf_counter() - t0, 2)

    # correctness before speed: the same choice as torch in float64 (no ties in normal data)
    ws[0].fill_(float("nan"))
    ours(0)
    ref_w, ref_i = eager(xs[0].double(), bias.double(), k) if grouped else eager(xs[0].double(), k)
    same = (torch.sort(ids[0].long(), -1).values == torch.sort(ref_i, -1).values).all(-1)
    out["indices_agree"] = float(same.float().mean())
    out["weights_max_err"] = float((torch.sort(ws[0].double(), -1).values - torch.sort(ref_w, -1).values).abs().max())

    timers = {
        "copy": lambda: time_copy(nbytes // 2, device.target.l2_bytes, reps).median_us,
        "autosoft": lambda: time_gpu(ours, n_sets, reps).median_us,
        "torch": lambda: time_gpu(lambda i: eager(*args(i)), n_sets, reps).median_us,
        "torch_compile": lambda: time_gpu(lambda i: compiled(*args(i)), n_sets, reps).median_us,
    }
    for name, us in medians_in_turns(timers, rounds).items():
        out[f"{name}_us"] = us
    out["rounds"] = rounds
    out["x_torch"] = out["torch_us"] / out["autosoft_us"]
    out["x_torch_compile"] = out["torch_compile_us"] / out["autosoft_us"]
    out["autosoft_pct_copy"] = 100 * out["copy_us"] / out["autosoft_us"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", default="router.sqlite", help="tuned-kernel cache (SQLite), reused when present")
    parser.add_argument("--trials", type=int, default=None, help="tuning trials per row (default 30; --quick: 8)")
    parser.add_argument("--reps", type=int, default=40, help="timed runs per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds in which the contenders take turns")
    parser.add_argument("--quick", action="store_true", help="7 rows, 8 trials unless --trials, 3 rounds: about 3 minutes")
    parser.add_argument("--out", default="router.json", help="JSON results")
    args = parser.parse_args()
    if args.trials is None:
        args.trials = 8 if args.quick else 30
    if args.trials < 1 or args.reps < 1 or args.rounds < 1:
        print("error: --trials, --reps and --rounds must be at least 1", file=sys.stderr)
        return 2
    import torch

    rows, trials, rounds = (QUICK, args.trials, min(args.rounds, 3)) if args.quick else \
        (ROWS, args.trials, args.rounds)
    device = device_info()
    result = {"gpu": device.name, "cc": device.compute_capability, "torch": torch.__version__, "trials": trials,
              "rows": []}
    cache = Cache(args.cache)
    runner = GpuRunner()  # one tuning worker and compile pool for every row
    for row in rows:
        try:
            result["rows"].append(bench_row(torch, row, cache, trials, args.reps, rounds, runner))
        except Exception as exc:  # noqa: BLE001 - one row's failure is reported, the rest still run
            traceback.print_exc()
            result["rows"].append({"row": list(row), "error": " ".join(str(exc).split())[:300]})
        Path(args.out).write_text(json.dumps(result, indent=1))  # partial results survive a kill
        r = result["rows"][-1]
        print(f"{r['shape']:>52} {r['dtype']:>8}  ours {r['autosoft_us']:8.2f} us  "
              f"torch {r['torch_us']:8.2f} ({r['x_torch']:.1f}x)  compile {r['torch_compile_us']:8.2f} "
              f"({r['x_torch_compile']:.1f}x)  {r['autosoft_pct_copy']:5.1f}% of copy  "
              f"agree {r['indices_agree']:.4f}  [{r['variant']}]" if "error" not in r else f"{row} ERROR {r['error']}",
              flush=True)
    runner.close()
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
