"""Issue 41's decode rows: attention over a KV cache, paged and contiguous, against dense attention.

    python benchmarks/attention_serving.py --out serving.json                         # heuristic defaults
    python benchmarks/attention_serving.py --tune 16 --cache serving.sqlite --out serving.json

Rows: B sequences x a context of Nkv keys, Hq = 32, Hkv = 8, D = 128, one query per sequence (decode),
bf16 (--dtypes float16,bfloat16 for both). Every sequence holds all Nkv keys. Columns, each timed on
the same keys and values laid out as that call takes them:
  sdpa_cudnn    torch SDPA with the cuDNN backend on dense (B, H, N, D) keys (enable_gqa);
  dense         autosoft.attention on the same dense tensors;
  contig        autosoft.attention_kvcache on a contiguous (B, Nkv, Hkv, D) cache;
  paged<P>      autosoft.attention_kvcache on pages of P tokens scattered through a pool, with a
                block table (P = 16, 64, 128);
  fa4_paged<P>  FlashAttention-4's flash_attn_varlen_func on the same pages (page_table, seqused_k),
                the fastest of the num_splits it accepts, where `flash_attn.cute` imports (run it
                through the peers' runner);
  copy          a device copy moving as many bytes as K and V (half each way): the read bound.
Ratios are the other column's time over autosoft's paged time (above 1: autosoft is faster).
Before timing, every autosoft column's output is checked against SDPA's on the first input set.

With --tune TRIALS the kvcache problems (one per row, page size and the contiguous layout) and the
dense ones are tuned into --cache first, then the cache is loaded. Timed as every benchmark here
(autosoft.timing.time_gpu): CUDA events, warm-up, the median of --reps launches, inputs rotated past
the L2. The commit is recorded (benchmarks/provenance.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.families import get_family  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402

from provenance import commit  # noqa: E402

ROWS = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (32, 8192)]
HQ, HKV, D = 32, 8, 128
PAGES = (16, 64, 128)
FA4_SPLITS = (1, 2, 4, 8, 16, 32)
MAX_REL_ERROR = 2e-2


def problems(b: int, n: int, dtype: str) -> dict[str, object]:
    """The problems this row's autosoft calls form (the ones tuned for it), by column."""
    kvcache, attention = get_family("attention_kvcache"), get_family("attention")
    out = {"dense": attention.problem(f"{b},{HQ},1,{D}", dtype, {"kv_heads": HKV, "kv_len": n}),
           "contig": kvcache.problem(f"{b},{HQ},1,{D}", dtype, {"kv_heads": HKV, "kv_len": n, "causal": True})}
    for page in PAGES:
        out[f"paged{page}"] = kvcache.problem(f"{b},{HQ},1,{D}", dtype,
                                              {"kv_heads": HKV, "kv_len": n, "page_size": page, "causal": True})
    return out


def tune(rows: list[tuple[int, int]], dtypes: list[str], cache_path: Path, trials: int) -> None:
    from autosoft.cache import Cache
    from autosoft.runners import GpuRunner
    from autosoft.tune import tuned_kernel

    cache, runner = Cache(cache_path), GpuRunner()
    try:
        for dtype in dtypes:
            for b, n in rows:
                for column, problem in problems(b, n, dtype).items():
                    loaded, now = tuned_kernel(get_family(problem.family), problem, cache, trials, runner=runner)
                    print(f"  {dtype} B{b} N{n} {column}: {loaded.variant.name} ({'tuned now' if now else 'cached'})",
                          flush=True)
    finally:
        runner.close()


def bench_row(torch, b: int, n: int, dtype: str, reps: int, l2_bytes: int) -> dict:
    import autosoft

    tdtype = getattr(torch, dtype)
    kv_bytes = 2 * b * HKV * n * D * 2
    n_sets = rotation_count(kv_bytes, l2_bytes)
    out: dict = {"row": f"B{b} x {n}", "dtype": dtype, "kv_mb": kv_bytes / 1e6, "n_sets": n_sets}
    gen = torch.Generator(device="cuda").manual_seed(b * 7919 + n)
    lengths = torch.full((b,), n, device="cuda", dtype=torch.int32)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(b, 1, HQ, D, device="cuda", generator=gen).to(tdtype)
        k = torch.randn(b, n, HKV, D, device="cuda", generator=gen).to(tdtype)
        v = torch.randn(b, n, HKV, D, device="cuda", generator=gen).to(tdtype)
        one = {"q": q, "k": k, "v": v}
        for page in PAGES:
            pool = b * n // page + 1
            table = torch.randperm(pool, device="cuda", generator=gen)[: b * n // page].reshape(b, n // page).int()
            for name, dense in (("k", k), ("v", v)):
                pages = torch.zeros(pool, page, HKV, D, device="cuda", dtype=tdtype)
                pages[table.reshape(-1)] = dense.reshape(b * n // page, page, HKV, D)
                one[f"{name}{page}"] = pages
            one[f"table{page}"] = table
        sets.append(one)

    def dense_q(s):
        return s["q"].transpose(1, 2)  # (B, Hq, 1, D)

    def dense_kv(s, name):
        return s[name].transpose(1, 2)  # (B, Hkv, N, D), a strided view

    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {
        "dense": lambda s: autosoft.attention(dense_q(s), dense_kv(s, "k"), dense_kv(s, "v")),
        "contig": lambda s: autosoft.attention_kvcache(s["q"], s["k"], s["v"], lengths),
        **{f"paged{p}": (lambda s, p=p: autosoft.attention_kvcache(s["q"], s[f"k{p}"], s[f"v{p}"], lengths,
                                                                    s[f"table{p}"])) for p in PAGES},
    }
    with torch.no_grad():
        ref = sdpa(dense_q(sets[0]), dense_kv(sets[0], "k"), dense_kv(sets[0], "v"), enable_gqa=True).float()
        for column, call in calls.items():
            got = call(sets[0]).float()
            got = got if got.shape == ref.shape else got.transpose(1, 2)
            error = float((got - ref).norm() / ref.norm())
            if not error <= MAX_REL_ERROR:
                raise SystemExit(f"autosoft {column} on B{b} x {n} {dtype}: relative error {error:.3g} against SDPA")
    torch.cuda.synchronize()

    def timed(run) -> dict:
        try:
            run(0)
            torch.cuda.synchronize()
            return {"us": time_gpu(run, n_sets, reps).median_us}
        except Exception as exc:  # noqa: BLE001 - a contender that does not take this call
            return {"us": None, "error": " ".join(str(exc).split())[:200]}

    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out["sdpa_cudnn"] = timed(lambda i: sdpa(dense_q(sets[i]), dense_kv(sets[i], "k"), dense_kv(sets[i], "v"),
                                                 enable_gqa=True))
    for column, call in calls.items():
        out[column] = timed(lambda i, call=call: call(sets[i]))
    try:
        from flash_attn.cute.interface import flash_attn_varlen_func
    except ImportError as exc:
        out["fa4"] = {"error": f"flash_attn.cute does not import: {exc}"}
    else:
        for page in PAGES:
            best: dict = {"us": None}
            for splits in FA4_SPLITS:
                got = timed(lambda i, p=page, s=splits: flash_attn_varlen_func(
                    sets[i]["q"], sets[i][f"k{p}"], sets[i][f"v{p}"], seqused_k=lengths, page_table=sets[i][f"table{p}"],
                    causal=True, num_splits=s))
                if got["us"] is not None and (best["us"] is None or got["us"] < best["us"]):
                    best = {**got, "num_splits": splits}
            out[f"fa4_paged{page}"] = best
    out["copy"] = {"us": time_copy(kv_bytes // 2, l2_bytes, reps).median_us}
    for page in PAGES:
        ours = out[f"paged{page}"].get("us")
        for other in ("sdpa_cudnn", "dense", "contig", f"fa4_paged{page}", "copy"):
            theirs = out.get(other, {}).get("us")
            out[f"paged{page}_x_{other}"] = theirs / ours if ours and theirs else None
    sets.clear()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("attention_serving.json"))
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS", help="tune every autosoft problem first")
    parser.add_argument("--cache", type=Path, default=None, help="the tuned cache to fill (--tune) and load")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    import torch

    import autosoft

    rows = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    dtypes = args.dtypes.split(",")
    if args.tune:
        if args.cache is None:
            raise SystemExit("--tune needs --cache (where the tuned variants go)")
        tune(rows, dtypes, args.cache, args.tune)
    if args.cache is not None:
        autosoft.load_cache(args.cache)
    l2 = device_info().target.l2_bytes
    results = [bench_row(torch, b, n, dtype, args.reps, l2) for dtype in dtypes for b, n in rows]
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "commit": commit(),
                                    "tuned": bool(args.cache), "rows": results}, indent=1))
    columns = ["sdpa_cudnn", "dense", "contig", *(f"paged{p}" for p in PAGES), *(f"fa4_paged{p}" for p in PAGES), "copy"]
    print("| row | dtype | K+V MB | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for r in results:
        cells = [f"{r[c]['us']:.1f}" if r.get(c, {}).get("us") else "-" for c in columns]
        print(f"| {r['row']} | {r['dtype']} | {r['kv_mb']:.0f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
