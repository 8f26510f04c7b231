"""The baselines of the attention-shapes issue (17): torch SDPA on grouped-KV decode and prefill.

    python benchmarks/attention_decode.py --out attention_decode_baselines.json

Decode rows: bf16, Hq = 32, Hkv = 8, D = 128, one query per sequence, against B x Nkv of the
issue's table; prefill rows: grouped KV heads (causal), prefill with a cache (Nq < Nkv, causal
aligned bottom-right through torch's `causal_lower_right` mask) and head dim 256. Every row times
SDPA's default backend and each forced backend with `enable_gqa=True` (a backend that refuses the
call says why), SDPA on k and v expanded to Hq heads beforehand (the expansion not timed), and,
for decode, a device copy moving as many bytes as K and V (half each way), the bound a
read-mostly kernel is compared with.

Timed as every benchmark here (autosoft.timing.time_gpu): CUDA events, a spin-blocked queue,
warm-up, the median of --reps launches, fresh random inputs rotated so that no launch reads them
from the L2. autosoft itself is not timed yet: its attention family does not take these problems
(grouped KV heads, Nq != Nkv) before issue 17's kernels land; this script gains its column then.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402

from provenance import commit  # noqa: E402

# (B, Hq, Hkv, Nq, Nkv, D, causal)
DECODE = [(1, 32, 8, 1, 4096, 128, False), (1, 32, 8, 1, 32768, 128, False), (16, 32, 8, 1, 4096, 128, False),
          (16, 32, 8, 1, 32768, 128, False), (64, 32, 8, 1, 4096, 128, False), (64, 32, 8, 1, 32768, 128, False)]
PREFILL = [(1, 32, 8, 4096, 4096, 128, True), (2, 32, 4, 8192, 8192, 128, True), (1, 32, 8, 512, 8192, 128, True),
           (4, 16, 16, 4096, 4096, 256, True)]
BACKENDS = ("default", "flash", "cudnn", "efficient")


def row_name(row: tuple) -> str:
    b, hq, hkv, nq, nkv, d, causal = row
    return f"B{b} Hq{hq}/Hkv{hkv} Nq{nq} Nkv{nkv} D{d}{' causal' if causal else ''}"


def attention_flops(row: tuple) -> float:
    """4*B*Hq*Nq*Nkv*D, the visible half of each bottom-right causal row set counted exactly."""
    b, hq, _, nq, nkv, d, causal = row
    if not causal:
        return 4.0 * b * hq * nq * nkv * d
    visible = sum(min(nkv, i + nkv - nq + 1) for i in range(nq))  # query i sees keys j <= i + Nkv - Nq
    return 4.0 * b * hq * visible * d


def bench_row(torch, row: tuple, reps: int, l2_bytes: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    b, hq, hkv, nq, nkv, d, causal = row
    dt = torch.bfloat16
    kv_bytes = 2 * b * hkv * nkv * d * 2
    n_sets = rotation_count(kv_bytes, l2_bytes)
    sets = [(torch.randn(b, hq, nq, d, device="cuda", dtype=dt), torch.randn(b, hkv, nkv, d, device="cuda", dtype=dt),
             torch.randn(b, hkv, nkv, d, device="cuda", dtype=dt)) for _ in range(n_sets)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # is_causal aligns top-left; with Nq != Nkv the causal is bottom-right: an explicit bias
    mask = causal_lower_right(nq, nkv) if causal and nq != nkv else None
    top_left = causal and nq == nkv
    out: dict = {"row": row_name(row), "shape": list(row), "kv_mb": kv_bytes / 1e6, "n_sets": n_sets,
                 "flops": attention_flops(row)}

    def timed(run) -> dict:
        try:
            run(0)
            torch.cuda.synchronize()
            return {"us": time_gpu(run, n_sets, reps).median_us}
        except Exception as exc:  # noqa: BLE001 - a backend that does not take this call
            return {"us": None, "error": " ".join(str(exc).split())[:200]}

    forced = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}

    def gqa(i: int) -> None:
        q, k, v = sets[i]
        sdpa(q, k, v, attn_mask=mask, is_causal=top_left, enable_gqa=True)

    for backend in BACKENDS:
        if backend == "default":
            out[backend] = timed(gqa)
        else:
            with sdpa_kernel(forced[backend]):
                out[backend] = timed(gqa)
    expanded = [(q, k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)) for q, k, v in sets]
    sets.clear()  # the grouped inputs freed before the expanded ones are timed
    out["expanded"] = timed(lambda i: sdpa(*expanded[i], attn_mask=mask, is_causal=top_left))
    expanded.clear()
    if nq == 1:
        out["copy_us"] = time_copy(kv_bytes // 2, l2_bytes, reps).median_us
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("attention_decode_baselines.json"))
    args = parser.parse_args()
    import torch

    device = device_info()
    rows = []
    for row in DECODE + PREFILL:
        rows.append(bench_row(torch, row, args.reps, device.target.l2_bytes))
        print_row(rows[-1])
    result = {"gpu": device.name, "torch": torch.__version__, "commit": commit(), "rows": rows}
    args.out.write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def _us(entry: dict) -> str:
    return f"{entry['us']:.1f}" if entry.get("us") is not None else "refused"


def print_row(r: dict) -> None:
    print(f"  {r['row']:42} " + "  ".join(f"{k} {_us(r[k])}" for k in (*BACKENDS, "expanded"))
          + (f"  copy {r['copy_us']:.1f}" if "copy_us" in r else ""), flush=True)


def print_table(result: dict) -> None:
    print(f"\nSDPA baselines on {result['gpu']} (torch {result['torch']}), bf16, µs (decode: % of copy = copy / default)")
    print("| problem | K+V MB | copy µs | default µs | % of copy | flash µs | cudnn µs | efficient µs | k/v expanded µs "
          "| default TF/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in result["rows"]:
        default = r["default"].get("us")
        copy = r.get("copy_us")
        pct = f"{100 * copy / default:.0f}" if copy and default else "-"
        tfs = f"{r['flops'] / (default * 1e-6) / 1e12:.0f}" if default else "-"
        print(f"| {r['row']} | {r['kv_mb']:.0f} | {copy:.1f} | " if copy else f"| {r['row']} | {r['kv_mb']:.0f} | - | ",
              end="")
        print(f"{_us(r['default'])} | {pct} | {_us(r['flash'])} | {_us(r['cudnn'])} | {_us(r['efficient'])} | "
              f"{_us(r['expanded'])} | {tfs} |")


if __name__ == "__main__":
    raise SystemExit(main())
