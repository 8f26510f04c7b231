"""Issue 41's rows: decode over a KV cache (paged, contiguous) and variable-length causal prefill.

    python benchmarks/attention_serving.py --out serving.json                         # heuristic defaults
    python benchmarks/attention_serving.py --tune 16 --cache serving.sqlite --out serving.json
    python benchmarks/attention_serving.py --prefill --tune 16 --cache serving.sqlite --out prefill.json

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

--prefill times the prefill rows instead (--rows then picks among them): causal attention over
sequences of different lengths packed into one (total, H, D) tensor, Hq = 32, Hkv = 8, D = 128:
32768 tokens in 21 sequences of 133 to 3679 tokens, and 65536 tokens in 17 of 722 to 6995. The
lengths are drawn from a fixed seed (prefill_lengths: the stated shortest and longest among them,
the others in between, exactly the stated total) and written to the JSON. Columns, in TF/s (causal
FLOPs: 4 H D times each sequence's visible pairs, N^2 / 2 as autosoft.families.attention's
visible_pairs counts them):
  varlen        autosoft.attention_varlen on the packed tensors (cu_seqlens, max_seqlen = the longest);
  dense         autosoft.attention, causal, on a dense batch of the same token count,
                (total / 4096) x 4096, contiguous (B, H, N, D) tensors holding the same values;
  sdpa_cudnn    torch SDPA with the cuDNN backend, one call per sequence on (1, H, N, D) views of
                the packed tensors (enable_gqa), all of them timed as one run;
  fa4_varlen    FlashAttention-4's flash_attn_varlen_func on the packed tensors, where
                `flash_attn.cute` imports (else its error is recorded);
  fa4_dense     FlashAttention-4's flash_attn_func on the dense batch, (B, N, H, D) views.
varlen_x_<col> is varlen's TF/s over that column's (above 1: varlen is faster per FLOP); issue 41
wants varlen_x_fa4_varlen >= 1.0 and varlen_x_dense >= 0.95. Before timing, varlen's output is
checked sequence by sequence and dense's as a whole against SDPA (fa4's error is recorded). With
--tune the varlen problem of each row (its bucket: B, heads, D, the longest length) and the dense
one are tuned.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autosoft.families import get_family  # noqa: E402
from autosoft.families.base import Problem  # noqa: E402
from autosoft.runtime import device_info  # noqa: E402
from autosoft.timing import rotation_count, time_copy, time_gpu  # noqa: E402

from provenance import commit  # noqa: E402

ROWS = [(1, 4096), (1, 32768), (16, 4096), (64, 2048), (32, 8192)]
HQ, HKV, D = 32, 8, 128
PAGES = (16, 64, 128)
FA4_SPLITS = (1, 2, 4, 8, 16, 32)
MAX_REL_ERROR = 2e-2
DTYPES = ("float16", "bfloat16")
# prefill: (total tokens, sequences, shortest, longest), issue 41's two batches
PREFILL = [(32768, 21, 133, 3679), (65536, 17, 722, 6995)]
PREFILL_SEED = 41
DENSE_N = 4096  # the sequence length of the dense batch of the same token count


def problems(b: int, n: int, dtype: str) -> dict[str, object]:
    """The problems this row's autosoft calls form (the ones tuned for it), by column."""
    kvcache, attention = get_family("attention_kvcache"), get_family("attention")
    out = {"dense": attention.problem(f"{b},{HQ},1,{D}", dtype, {"kv_heads": HKV, "kv_len": n}),
           "contig": kvcache.problem(f"{b},{HQ},1,{D}", dtype, {"kv_heads": HKV, "kv_len": n, "causal": True})}
    for page in PAGES:
        out[f"paged{page}"] = kvcache.problem(f"{b},{HQ},1,{D}", dtype,
                                              {"kv_heads": HKV, "kv_len": n, "page_size": page, "causal": True})
    return out


def prefill_lengths(total: int, count: int, shortest: int, longest: int, seed: int = PREFILL_SEED) -> list[int]:
    """`count` sequence lengths summing to `total`: `shortest` and `longest` among them, the others
    drawn between the two and scaled to the total, in an order drawn from `seed` (the same list on
    every machine: random.Random's integer draws and shuffle are stable). ValueError where no such
    list is."""
    if not (count >= 2 and 1 <= shortest <= longest
            and (count - 2) * shortest <= total - shortest - longest <= (count - 2) * longest):
        raise ValueError(f"no {count} lengths of {shortest} to {longest} tokens sum to {total}")
    rng = random.Random(seed * 1_000_003 + total)
    drawn = [rng.randint(shortest, longest) for _ in range(count - 2)]
    want, have = total - shortest - longest, sum(drawn)
    # scale the draws towards the bound on the side of the total, keeping their spread, then
    # hand out what rounding left one token at a time
    if have > want:
        f = (want - len(drawn) * shortest) / (have - len(drawn) * shortest)
        inner = [round(shortest + (n - shortest) * f) for n in drawn]
    elif have < want:
        f = (len(drawn) * longest - want) / (len(drawn) * longest - have)
        inner = [round(longest - (longest - n) * f) for n in drawn]
    else:
        inner = drawn
    for i in itertools.cycle(range(len(inner))):
        gap = want - sum(inner)
        if not gap:
            break
        step = 1 if gap > 0 else -1
        if shortest <= inner[i] + step <= longest:
            inner[i] += step
    lengths = [shortest, longest, *inner]
    rng.shuffle(lengths)
    return lengths


def causal_flops(lengths: list[int]) -> float:
    """Causal attention FLOPs of these sequences, each over its own keys: 4 H D per visible
    (query, key) pair, N^2 / 2 pairs a sequence (the diagonal counted half, as visible_pairs)."""
    return 4.0 * HQ * D * sum(n * n / 2 for n in lengths)


def prefill_problems(lengths: list[int], dtype: str) -> dict[str, Problem]:
    """The problems this prefill row's autosoft calls form, by column: formed by the families'
    problem_for from the calls' shapes and options, as the calls themselves form them."""
    total, longest, b = sum(lengths), max(lengths), len(lengths)
    varlen = get_family("attention_varlen").problem_for(
        {"q": (total, HQ, D), "k": (total, HKV, D), "v": (total, HKV, D), "cu_seqlens_q": (b + 1,),
         "cu_seqlens_k": (b + 1,)}, dtype, {"causal": True, "max_seqlen_q": longest, "max_seqlen_k": longest})
    dense_b = total // DENSE_N
    dense = get_family("attention").problem_for(
        {"q": (dense_b, HQ, DENSE_N, D), "k": (dense_b, HKV, DENSE_N, D), "v": (dense_b, HKV, DENSE_N, D)},
        dtype, {"causal": True})
    return {"varlen": varlen, "dense": dense}


def tune(rows: list[tuple[int, ...]], dtypes: list[str], cache_path: Path, trials: int, prefill: bool = False) -> None:
    from autosoft.cache import Cache
    from autosoft.runners import GpuRunner
    from autosoft.tune import tuned_kernel

    cache, runner = Cache(cache_path), GpuRunner()
    try:
        for dtype in dtypes:
            for row in rows:
                if prefill:
                    label, by_column = f"{row[0]} tokens in {row[1]}", prefill_problems(prefill_lengths(*row), dtype)
                else:
                    label, by_column = f"B{row[0]} N{row[1]}", problems(row[0], row[1], dtype)
                for column, problem in by_column.items():
                    loaded, now = tuned_kernel(get_family(problem.family), problem, cache, trials, runner=runner)
                    print(f"  {dtype} {label} {column}: {loaded.variant.name} ({'tuned now' if now else 'cached'})",
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


def bench_prefill(torch, total: int, count: int, shortest: int, longest: int, dtype: str, reps: int,
                  l2_bytes: int) -> dict:
    import autosoft
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tdtype = getattr(torch, dtype)
    lengths = prefill_lengths(total, count, shortest, longest)
    offsets = list(itertools.accumulate(lengths, initial=0))
    spans = list(zip(offsets[:-1], offsets[1:]))
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    max_len, dense_b = max(lengths), total // DENSE_N
    set_bytes = total * (HQ + 2 * HKV) * D * tdtype.itemsize
    n_sets = rotation_count(set_bytes, l2_bytes)
    row = f"{total} in {count} x {shortest}-{longest}"
    out: dict = {"row": row, "dtype": dtype, "lengths": lengths, "seed": PREFILL_SEED, "n_sets": n_sets,
                 "dense_batch": f"{dense_b} x {DENSE_N}"}
    flops = {"varlen": causal_flops(lengths), "dense": causal_flops([DENSE_N] * dense_b)}
    gen = torch.Generator(device="cuda").manual_seed(total * 7919 + count)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(total, HQ, D, device="cuda", generator=gen).to(tdtype)
        k = torch.randn(total, HKV, D, device="cuda", generator=gen).to(tdtype)
        v = torch.randn(total, HKV, D, device="cuda", generator=gen).to(tdtype)
        one = {"q": q, "k": k, "v": v,
               # the packed tokens cut into sequences of DENSE_N: (B, N, H, D) views, FA4's layout
               "q_bnhd": q.view(dense_b, DENSE_N, HQ, D), "k_bnhd": k.view(dense_b, DENSE_N, HKV, D),
               "v_bnhd": v.view(dense_b, DENSE_N, HKV, D),
               # each sequence as SDPA takes it: (1, H, N, D) views of the packed tensors
               "seqs": [tuple(x[a:b].transpose(0, 1)[None] for x in (q, k, v)) for a, b in spans]}
        for name in ("q", "k", "v"):  # autosoft.attention's own layout, contiguous (B, H, N, D)
            one[f"{name}_dense"] = one[f"{name}_bnhd"].transpose(1, 2).contiguous()
        sets.append(one)

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def per_sequence_sdpa(s) -> None:
        for sq, sk, sv in s["seqs"]:
            sdpa(sq, sk, sv, is_causal=True, enable_gqa=True)

    def varlen(s):
        return autosoft.attention_varlen(s["q"], s["k"], s["v"], cu, cu, max_len, max_len, causal=True)

    def dense(s):
        return autosoft.attention(s["q_dense"], s["k_dense"], s["v_dense"], causal=True)

    def worst_error(packed) -> tuple[float, int]:
        """The largest relative error over the sequences of a packed (total, Hq, D) output against
        SDPA on the first input set, and that sequence's index."""
        worst = (0.0, -1)
        for i, ((a, b), (sq, sk, sv)) in enumerate(zip(spans, sets[0]["seqs"])):
            ref = sdpa(sq, sk, sv, is_causal=True, enable_gqa=True).float()
            error = float((packed[a:b].transpose(0, 1)[None].float() - ref).norm() / ref.norm())
            worst = max(worst, (error if error == error else float("inf"), i))  # NaN counts as the worst
        return worst

    with torch.no_grad():
        error, seq = worst_error(varlen(sets[0]))
        if not error <= MAX_REL_ERROR:
            raise SystemExit(f"autosoft varlen on {row} {dtype}: relative error {error:.3g} against SDPA "
                             f"on sequence {seq} ({lengths[seq]} tokens)")
        out["varlen_rel_error"] = error
        ref = sdpa(sets[0]["q_dense"], sets[0]["k_dense"], sets[0]["v_dense"], is_causal=True, enable_gqa=True).float()
        error = float((dense(sets[0]).float() - ref).norm() / ref.norm())
        if not error <= MAX_REL_ERROR:
            raise SystemExit(f"autosoft dense on {dense_b} x {DENSE_N} {dtype}: relative error {error:.3g} "
                             f"against SDPA")
        del ref
    torch.cuda.synchronize()

    def timed(run, column: str) -> dict:
        try:
            run(0)
            torch.cuda.synchronize()
            us = time_gpu(run, n_sets, reps).median_us
        except Exception as exc:  # noqa: BLE001 - a contender that does not take this call
            return {"us": None, "error": " ".join(str(exc).split())[:200]}
        return {"us": us, "tflops": flops[column] / us / 1e6}

    out["varlen"] = timed(lambda i: varlen(sets[i]), "varlen")
    out["dense"] = timed(lambda i: dense(sets[i]), "dense")
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out["sdpa_cudnn"] = timed(lambda i: per_sequence_sdpa(sets[i]), "varlen")
    try:
        from flash_attn.cute.interface import flash_attn_func, flash_attn_varlen_func
    except ImportError as exc:
        out["fa4"] = {"error": f"flash_attn.cute does not import: {exc}"}
    else:
        def fa4_varlen(s):
            return flash_attn_varlen_func(s["q"], s["k"], s["v"], cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=max_len, max_seqlen_k=max_len, causal=True)

        out["fa4_varlen"] = timed(lambda i: fa4_varlen(sets[i]), "varlen")
        out["fa4_dense"] = timed(lambda i: flash_attn_func(sets[i]["q_bnhd"], sets[i]["k_bnhd"], sets[i]["v_bnhd"],
                                                           causal=True), "dense")
        if out["fa4_varlen"]["us"] is not None:
            with torch.no_grad():  # recorded, not enforced: it says FA4 was called as it should be
                got = fa4_varlen(sets[0])
                out["fa4_varlen"]["rel_error"] = worst_error(got[0] if isinstance(got, tuple) else got)[0]
    ours = out["varlen"].get("tflops")
    for other in ("dense", "sdpa_cudnn", "fa4_varlen", "fa4_dense"):
        theirs = out.get(other, {}).get("tflops")
        out[f"varlen_x_{other}"] = ours / theirs if ours and theirs else None
    sets.clear()
    torch.cuda.empty_cache()
    return out


PREFILL_COLUMNS = ("varlen", "dense", "sdpa_cudnn", "fa4_varlen", "fa4_dense")


def print_prefill(results: list[dict]) -> None:
    print("| prefill, tokens in sequences | dtype | " + " | ".join(f"{c} TF/s" for c in PREFILL_COLUMNS)
          + " | varlen / fa4_varlen | varlen / dense |")
    print("|---|---|" + "---:|" * (len(PREFILL_COLUMNS) + 2))
    for r in results:
        cells = [f"{r[c]['tflops']:.0f}" if r.get(c, {}).get("tflops") else "-" for c in PREFILL_COLUMNS]
        ratios = [f"{r[c]:.2f}x" if r.get(c) else "-" for c in ("varlen_x_fa4_varlen", "varlen_x_dense")]
        print(f"| {r['row']} | {r['dtype']} | " + " | ".join(cells + ratios) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="the JSON (default attention_serving.json, with --prefill attention_serving_prefill.json)")
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS", help="tune every autosoft problem first")
    parser.add_argument("--cache", type=Path, default=None, help="the tuned cache to fill (--tune) and load")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--rows", default="", help="comma-separated row indices (default: all)")
    parser.add_argument("--prefill", action="store_true",
                        help="time the variable-length prefill rows instead of the decode rows")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    table = PREFILL if args.prefill else ROWS
    try:
        rows = [table[int(i)] for i in args.rows.split(",")] if args.rows else table
    except (ValueError, IndexError):
        raise SystemExit(f"--rows {args.rows!r}: give comma-separated indices from 0 to {len(table) - 1}") from None
    dtypes = args.dtypes.split(",")
    if not set(dtypes) <= set(DTYPES):
        raise SystemExit(f"--dtypes {args.dtypes!r}: give {' or '.join(DTYPES)}, comma-separated")
    if args.tune and args.cache is None:
        raise SystemExit("--tune needs --cache (where the tuned variants go)")
    out_path = args.out or Path("attention_serving_prefill.json" if args.prefill else "attention_serving.json")
    import torch

    import autosoft

    if args.tune:
        tune(rows, dtypes, args.cache, args.tune, prefill=args.prefill)
    if args.cache is not None:
        autosoft.load_cache(args.cache)
    l2 = device_info().target.l2_bytes
    if args.prefill:
        results = [bench_prefill(torch, *row, dtype, args.reps, l2) for dtype in dtypes for row in rows]
    else:
        results = [bench_row(torch, b, n, dtype, args.reps, l2) for dtype in dtypes for b, n in rows]
    out_path.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "commit": commit(),
                                    "tuned": bool(args.cache), "mode": "prefill" if args.prefill else "decode",
                                    "rows": results}, indent=1))
    if args.prefill:
        print_prefill(results)
        return 0
    columns = ["sdpa_cudnn", "dense", "contig", *(f"paged{p}" for p in PAGES), *(f"fa4_paged{p}" for p in PAGES), "copy"]
    print("| row | dtype | K+V MB | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * len(columns))
    for r in results:
        cells = [f"{r[c]['us']:.1f}" if r.get(c, {}).get("us") else "-" for c in columns]
        print(f"| {r['row']} | {r['dtype']} | {r['kv_mb']:.0f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
