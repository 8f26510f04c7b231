"""Attention of a few queries per sequence over a KV cache: decode, speculative verification and
chunked prefill, as FlashAttention's flash_attn_with_kvcache computes it.

For q (B, Nq, Hq, D) and a cache that holds cache_seqlens[b] tokens of sequence b, either paged,
k_cache and v_cache (num_pages, page_size, Hkv, D) with block_table (B, max_pages) int32 naming a
sequence's pages in order, or contiguous, (B, max_len, Hkv, D): when k_new and v_new (B, Nnew, Hkv,
D) are given, they are first written into the cache at positions cache_seqlens[b] ... + Nnew - 1
(in place), then every query attends to the sequence's Nkv = cache_seqlens[b] + Nnew keys, query i
standing at key i + Nkv - Nq (bottom-right causal, windows and softcap as the attention family's).
The outputs are o (B, Hq, Nq, D: the caller sees it as (B, Nq, Hq, D)) and lse (B, Hq, Nq).

The lengths are read by the kernel from cache_seqlens on the GPU, so one compiled variant serves
every batch composition within the problem's bucket, and a CUDA graph captured once replays
correctly as the lengths grow. The problem is that bucket: B, Hq, Nq, D, the KV heads, the page
size (0: a contiguous cache), the most keys a sequence holds (kv_len: what tuning times, every
sequence that long) and Nnew. The kernel is the attention family's mma kernel with the key count
of each sequence a run-time value and its K/V loads going through the block table
(templates/attention/, `runtime_keys` and `paged`), extended by templates/attention_kvcache/ with
the append.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

import numpy as np

from ..dtypes import ITEMSIZE, to_storage
from ..operators import OperatorCall, TorchOperator
from ..errors import UserError
from . import register
from ._attention_mma import MmaEngine
from ._host_checks import check_arrays, taken_as_it_is
from .attention import ATTENTION, AttentionFamily, call_options, check_scale, operator_window
from .base import Call, Family, Launch, OptionValue, Problem, ProblemOption, Target

PAGE_SIZES = (0, 1, 16, 32, 64, 128, 256)
APPEND_THREADS = 256


class KVCacheMma(MmaEngine):
    """The attention mma kernel over a cache: strides of the cache's layout, the sequences' lengths
    and block table as arguments, and with new tokens the append launched first."""

    template = "attention_kvcache/attention_kvcache.cu.j2"
    splits_max = 128  # one sequence with few KV heads: enough blocks for every SM

    def __init__(self, family: Family) -> None:
        super().__init__(family, "attention_kvcache_mma")

    def template_args(self, problem: Problem, values: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().template_args(problem, values), "strided": True, "append_threads": APPEND_THREADS}

    def launches(self, problem: Problem, values: Mapping[str, Any], target: Target) -> tuple[tuple[Launch, ...], int]:
        (attention,), workspace = super().launches(problem, values, target)
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.family.kv(problem)
        page = int(problem.option("page_size", 0))
        new = int(problem.option("new_len", 0))
        # q (B, Nq, Hq, D) seen as (B, Hq, Nq, D); a cache token's row holds its Hkv heads
        q_strides = (np.int64(n * h * d), np.int64(d), np.int64(h * d))
        token = kv_heads * d
        cache_strides = (np.int64(kv_len * token if not page else 0), np.int64(d), np.int64(token))
        table = ("block_table", np.int32(self.family.max_pages(problem))) if page else ()
        args = (*attention.args[:6], *q_strides, *cache_strides, *cache_strides, "cache_seqlens", *table,
                *attention.args[6:])
        args = tuple("k_cache" if a == "k" else "v_cache" if a == "v" else a for a in args)
        main = replace(attention, args=args)
        if not new:
            return (main,), workspace
        chunks = b * new * kv_heads * d // 8
        append = Launch("attention_kvcache_append", (-(-chunks // APPEND_THREADS), 1, 1), (APPEND_THREADS, 1, 1), 0,
                        ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", *table, np.int32(b)))
        return (append, main), workspace


class AttentionKVCacheFamily(AttentionFamily):
    """o and lse of a few queries per sequence over a (paged) KV cache, new tokens appended first."""
    name = "attention_kvcache"
    template = "attention_kvcache/attention_kvcache.cu.j2"
    splits_max = 128  # one sequence with few KV heads: enough blocks for every SM
    template_folders = ("attention",)  # the attention kernel it extends
    inputs = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new", "scale")
    optional_inputs = ("block_table", "k_new", "v_new")  # given or not, page_size and new_len say
    strided_inputs = ()  # q and the cache have fixed layouts: their strides are the launch's literals
    input_kinds = ("normal", "normal_x10", "equal")
    options = (
        ProblemOption("kv_len", "keys a sequence's cache holds at most: the bucket's context length, every "
                      "sequence that long when tuning", kind="int", required=True),
        ProblemOption("kv_heads", "heads of the cache, when fewer than H (grouped-query attention)", kind="int"),
        ProblemOption("page_size", "tokens per page of a paged cache (1, 16, 32, 64, 128, 256); 0 or absent: "
                      "a contiguous (B, kv_len, Hkv, D) cache", kind="int"),
        ProblemOption("new_len", "tokens appended to each sequence's cache before attending (k_new, v_new)",
                      kind="int"),
        ProblemOption("causal", "mask keys after the query's position (bottom-right: key j > i + Nkv - Nq)"),
        ProblemOption("window_left", "keys before the query's position it sees (sliding window)", kind="int"),
        ProblemOption("window_right", "keys after the query's position it sees (sliding window)", kind="int"),
        ProblemOption("softcap", "cap the scores: s becomes softcap * tanh(s / softcap)", kind="float"),
    )
    shape_help = ("B,H,N,D (or BxHxNxD): sequences, query heads, queries per sequence (1: decode), head dim, "
                  "with --kv-len (the context a sequence's cache holds), e.g. 16,32,1,128 --kv-len 4096 "
                  "--kv-heads 8 --page-size 16")
    examples = (("1,8,1,64", "float16", {"kv_len": 100}),
                ("3,32,1,128", "bfloat16", {"kv_len": 1000, "kv_heads": 8, "page_size": 16, "causal": True}),
                ("2,4,3,128", "bfloat16", {"kv_len": 517, "kv_heads": 1, "page_size": 1, "new_len": 3,
                                            "causal": True}),
                ("2,16,7,64", "float16", {"kv_len": 300, "kv_heads": 4, "page_size": 128, "new_len": 2,
                                          "causal": True, "window_left": 50, "softcap": 30.0}),
                ("4,8,1,256", "bfloat16", {"kv_len": 2048, "kv_heads": 2, "page_size": 64}))

    input_dtypes = {"cache_seqlens": ("int32",), "block_table": ("int32",)}

    def __init__(self) -> None:
        self.engines = (KVCacheMma(self),)

    # --- the Python function -----------------------------------------------------------

    def python_call(self, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any = None,
                    k_new: Any = None, v_new: Any = None, causal: bool = True, scale: float | None = None,
                    window: Any = None, softcap: float | None = None, return_lse: bool = False) -> Call:
        """The arrays and options of a call (autosoft.attention_kvcache hands back o as the (B, Nq,
        Hq, D) view of the kernel's (B, Hq, Nq, D)); its arguments are documented there. Shapes and
        dtypes are checked here, before anything reaches a device, with errors naming the argument."""
        who = "autosoft.attention_kvcache"
        if (k_new is None) != (v_new is None):
            raise ValueError(f"{who}: give k_new and v_new together, or neither")
        arrays = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new)
        if check_arrays(who, self, self.inputs, arrays):
            if k_new is not None and k_new.shape[1] == 0:
                arrays = arrays[:5] + (None, None)  # nothing to append: an empty k_new must not empty the call
            elif k_new is not None:
                for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                    if not taken_as_it_is(cache, self.input_alignment):
                        raise ValueError(f"{who}: {name} must be contiguous and 16-byte aligned when k_new and v_new "
                                         "are given: they are written into it in place, and a copy would lose them")
        head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
        options = call_options(causal, window, softcap, who)
        scale = check_scale(scale, head_dim, who)
        return Call(arrays, options, {"scale": np.float32(scale)}, ("o", "lse") if return_lse else ("o",))

    def check_call_shapes(self, who: str, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """ValueError, naming the argument, unless the given arrays' shapes make a call: q (B, Nq, Hq,
        D) of a head dim the family takes; the cache paged, (num_pages, page_size, Hkv, D) with a
        block_table (B, max_pages) and a page size of PAGE_SIZES, or contiguous, (B, max_len, Hkv, D)
        without one; Hq a multiple of Hkv; cache_seqlens (B,); k_new and v_new (B, Nnew, Hkv, D); at
        most as many queries, and new tokens, per sequence as the cache holds."""
        q, k, v = (tuple(shapes[n]) for n in ("q", "k_cache", "v_cache"))
        if len(q) != 4:
            raise ValueError(f"{who}: q must be (B, Nq, Hq, D), four dims, got shape {q}")
        if len(k) != 4:
            raise ValueError(f"{who}: k_cache must be (num_pages, page_size, Hkv, D) with a block_table or "
                             f"(B, max_len, Hkv, D) without, four dims, got shape {k}")
        if v != k:
            raise ValueError(f"{who}: v_cache must have k_cache's shape {k}, got {v}")
        b, n, h, d = q
        if d not in self.head_dims and 0 not in q:  # an empty call gets empty outputs, as attention's does
            raise ValueError(f"{who}: q's head dim {d} is not supported; use one of "
                             f"{', '.join(map(str, self.head_dims))} (pad the heads to the next one)")
        if k[3] != d:
            raise ValueError(f"{who}: k_cache and v_cache must have q's head dim {d} (their last dim), got {k[3]}")
        if k[2] < 1 or h % k[2]:
            raise ValueError(f"{who}: q's {h} heads must be a multiple of the cache's {k[2]} (k_cache's third dim; "
                             "grouped-query attention)")
        lengths = tuple(shapes["cache_seqlens"])
        if lengths != (b,):
            raise ValueError(f"{who}: cache_seqlens must be (B,) = ({b},), one length per sequence, got shape {lengths}")
        table = shapes.get("block_table")
        if table is not None:
            if len(table) != 2 or table[0] != b:
                raise ValueError(f"{who}: block_table must be (B, max_pages) with B = {b} (q's batch), "
                                 f"got shape {tuple(table)}")
            if k[0] < 1 and 0 not in q:
                raise ValueError(f"{who}: k_cache holds no pages (shape {k}): block_table has nothing to name")
            if k[1] not in PAGE_SIZES[1:]:
                raise ValueError(f"{who}: k_cache's page size {k[1]} (its second dim, with a block_table) is not "
                                 f"supported; use one of {', '.join(map(str, PAGE_SIZES[1:]))}")
        elif k[0] != b:
            raise ValueError(f"{who}: without a block_table the cache is taken as contiguous, (B, max_len, Hkv, D) "
                             f"with B = {b} (q's batch), but k_cache's first dim is {k[0]}; a paged cache "
                             "(num_pages, page_size, Hkv, D) needs its block_table")
        capacity = table[1] * k[1] if table is not None else k[1]
        holds = "{} keys the cache holds ({})".format(capacity, f"block_table's {table[1]} pages of {k[1]}"
                                                       if table is not None else "k_cache's second dim")
        new = shapes.get("k_new")
        if new is not None:
            new = tuple(new)
            if tuple(shapes["v_new"]) != new:
                raise ValueError(f"{who}: k_new and v_new must have one shape, got {new}, {tuple(shapes['v_new'])}")
            if len(new) != 4 or (new[0], new[2], new[3]) != (b, k[2], d):
                raise ValueError(f"{who}: k_new and v_new must be (B, Nnew, Hkv, D) = ({b}, Nnew, {k[2]}, {d}), "
                                 f"got shape {new}")
            if new[1] > capacity:
                raise ValueError(f"{who}: k_new's {new[1]} new tokens per sequence are more than the {holds}")
        if n > capacity:
            raise ValueError(f"{who}: q's {n} queries per sequence are more than the {holds}; they stand at a "
                             "sequence's last keys")

    # --- problem ------------------------------------------------------------------------

    def _normalised(self, problem: Problem) -> Problem:
        """Attention's checks, kv_len always kept (it is the bucket, not q's length), the page
        size one of PAGE_SIZES (0 dropped), new_len from 1 to kv_len (0 dropped), and at most
        kv_len queries per sequence (they stand at its last keys)."""
        kv_len = int(problem.option("kv_len"))  # a required option: always there
        checked = super()._normalised(problem)
        opts = dict(checked.options)
        opts["kv_len"] = kv_len
        page = int(opts.get("page_size", 0))
        if page not in PAGE_SIZES:
            raise UserError(f"--page-size {page}: expected one of {', '.join(map(str, PAGE_SIZES[1:]))} "
                            "(or 0 for a contiguous cache)")
        new = int(opts.get("new_len", 0))
        if not 0 <= new <= kv_len:
            raise UserError(f"--new-len {new}: expected 0 to the {kv_len} keys a sequence holds")
        if checked.shape[2] > kv_len:
            raise UserError(f"{checked.shape[2]} queries per sequence: at most --kv-len {kv_len} (the queries stand "
                            "at the sequence's last keys)")
        for name, value in (("page_size", page), ("new_len", new)):
            if not value:
                opts.pop(name, None)
        return replace(checked, options=tuple(sorted(opts.items())))

    def problem_for(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                    options: Mapping[str, OptionValue]) -> Problem:
        """The bucket of a call: q (B, Nq, Hq, D); the cache paged (pages, page_size, Hkv, D) with
        block_table (B, max_pages), or contiguous (B, max_len, Hkv, D); k_new and v_new (B, Nnew,
        Hkv, D) or none. kv_len is the options' where given, else what a sequence can hold."""
        who = f"autosoft.{self.name}"
        self.check_call_shapes(who, shapes)
        q, k = tuple(shapes["q"]), tuple(shapes["k_cache"])
        b, n, h, d = q
        table, new = shapes.get("block_table"), shapes.get("k_new")
        page = k[1] if table is not None else 0
        capacity = table[1] * page if table is not None else k[1]
        given = {**dict(options), "kv_heads": k[2], "kv_len": int(options.get("kv_len", capacity)),
                 "page_size": page, "new_len": new[1] if new is not None else 0}
        try:
            return self.problem(f"{b},{h},{n},{d}", dtype, given)
        except UserError as exc:
            raise ValueError(f"{who}: {exc}") from None

    def caller_outputs(self, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                       options: Mapping[str, OptionValue]) -> dict[str, tuple[tuple[int, ...], str]]:
        """o (B, Hq, Nq, D) as the kernel writes it (autosoft.attention_kvcache hands it back
        as the (B, Nq, Hq, D) view of it) and lse (B, Hq, Nq)."""
        self.check_call_shapes(f"autosoft.{self.name}", shapes)  # also for empty inputs, which reach no Problem
        b, n, h, d = tuple(shapes["q"])
        return {"o": ((b, h, n, d), dtype), "lse": ((b, h, n), "float32")}

    def max_pages(self, problem: Problem) -> int:
        """Pages in a sequence's row of the block table: enough for kv_len keys."""
        page = int(problem.option("page_size", 0))
        return -(-int(problem.option("kv_len")) // page) if page else 0

    def problem_values(self, problem: Problem, target: Target) -> dict[str, Any]:
        return super().problem_values(problem, target)

    def kernel_args(self, problem: Problem) -> dict[str, Any]:
        page = int(problem.option("page_size", 0))
        kv_len = int(problem.option("kv_len"))
        return {**super().kernel_args(problem), "runtime_keys": True, "paged": bool(page),
                "page_size": page or kv_len, "new_keys": int(problem.option("new_len", 0)),
                "kv_heads": self.kv(problem)[0]}

    def name_prefix(self, problem: Problem) -> str:
        page = int(problem.option("page_size", 0))
        new = int(problem.option("new_len", 0))
        return (super().name_prefix(problem).replace("attention_", "attention_kvcache_", 1)
                + (f"_p{page}" if page else "_contig") + (f"_new{new}" if new else ""))

    # --- what it costs ------------------------------------------------------------------

    def bytes_moved(self, problem: Problem) -> int:
        """q and o, every sequence's kv_len keys and values read, the new ones written."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.kv(problem)
        new = int(problem.option("new_len", 0))
        return ITEMSIZE[problem.dtype] * d * (2 * b * h * n + 2 * b * kv_heads * (kv_len + 2 * new)) + 4 * b * h * n

    def verification_problem(self, problem: Problem) -> Problem:
        """At most four sequences (their lengths vary), the same heads and bucket."""
        b, h, n, d = problem.shape
        return replace(problem, shape=(min(b, 4), h, n, d))

    # --- inputs and the reference (on the GPU through CuPy; xp is the cupy module) --------

    def input_shapes(self, problem: Problem) -> dict[str, tuple[int, ...]]:
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.kv(problem)
        page = int(problem.option("page_size", 0))
        new = int(problem.option("new_len", 0))
        cache = (b * self.max_pages(problem) + 1, page, kv_heads, d) if page else (b, kv_len, kv_heads, d)
        shapes = {"q": (b, n, h, d), "k_cache": cache, "v_cache": cache, "cache_seqlens": (b,)}
        if page:
            shapes["block_table"] = (b, self.max_pages(problem))
        if new:
            shapes.update(k_new=(b, new, kv_heads, d), v_new=(b, new, kv_heads, d))
        return shapes

    def lengths(self, problem: Problem, kind: str, rng: Any) -> np.ndarray:
        """Each sequence's keys after the append. Timing ("normal" on the full bucket) fills every
        cache; the other kinds mix the edges: one key, exactly a page, a page and one, the full
        bucket, and random lengths (never fewer keys than the new ones or the queries)."""
        b, _, n, _ = problem.shape
        kv_len = int(problem.option("kv_len"))
        if kind == "normal":
            return np.full(b, kv_len, dtype=np.int32)
        least = max(1, n, int(problem.option("new_len", 0)))
        page = int(problem.option("page_size", 0)) or kv_len
        drawn = rng.integers(least, kv_len + 1, size=b)
        drawn = drawn.get() if hasattr(drawn, "get") else drawn
        edges = [least, page, page + 1, kv_len, *(int(x) for x in drawn)]
        picked = np.array([edges[(i + (0 if kind == "normal_x10" else 3)) % len(edges)] for i in range(b)])
        return np.clip(picked, least, kv_len).astype(np.int32)

    def make_inputs(self, problem: Problem, kind: str, xp: Any, rng: Any) -> dict[str, Any]:
        """q, a cache whose pages are scattered through the pool (one spare page that no
        sequence owns), each sequence's keys after the append (`lengths`), and the expected cache
        after the append (`k_expected`, `v_expected`: what the check compares the cache with)."""
        b, h, n, d = problem.shape
        kv_heads, kv_len = self.kv(problem)
        page = int(problem.option("page_size", 0))
        new = int(problem.option("new_len", 0))
        shapes = self.input_shapes(problem)
        lengths = self.lengths(problem, kind, rng)
        q = rng.standard_normal(shapes["q"], dtype=np.float32)
        if kind == "normal_x10":
            q *= 10
        elif kind not in ("normal", "equal"):
            raise ValueError(f"unknown input kind {kind!r}")
        dense_k = rng.standard_normal((b, kv_len, kv_heads, d), dtype=np.float32)
        dense_v = rng.standard_normal((b, kv_len, kv_heads, d), dtype=np.float32)
        if kind == "equal":
            dense_k[...] = dense_k[:, :1]
        arrays: dict[str, Any] = {"q": to_storage(q, problem.dtype, xp)}
        k_dense, v_dense = to_storage(dense_k, problem.dtype, xp), to_storage(dense_v, problem.dtype, xp)
        before = xp.asarray(lengths - new, dtype=np.int32)
        if new:  # the new tokens are the dense ones at [before, before + new); the cache holds others there
            idx = xp.asarray(lengths - new)[:, None] + xp.arange(new)[None, :]
            rows = xp.arange(b)[:, None]
            arrays["k_new"], arrays["v_new"] = k_dense[rows, idx], v_dense[rows, idx]
        k_cache, v_cache = k_dense.copy(), v_dense.copy()
        if new:  # stale values where the append writes: an append that wrote nothing shows
            k_cache[rows, idx] = to_storage(rng.standard_normal((b, new, kv_heads, d), dtype=np.float32), problem.dtype, xp)
            v_cache[rows, idx] = to_storage(rng.standard_normal((b, new, kv_heads, d), dtype=np.float32), problem.dtype, xp)
        if page:
            pages = self.max_pages(problem)
            # the pages in a random order, one of the pool's left to no sequence
            table = xp.argsort(rng.random(b * pages + 1))[: b * pages].reshape(b, pages).astype(np.int32)

            def paged(pool: Any, dense: Any) -> Any:
                out = pool.copy()
                padded = xp.zeros((b, pages * page, kv_heads, d), dtype=dense.dtype)
                padded[:, :kv_len] = dense
                out[table.reshape(-1)] = padded.reshape(b * pages, page, kv_heads, d)
                return out

            pools = [to_storage(rng.standard_normal(shapes["k_cache"], dtype=np.float32), problem.dtype, xp)
                     for _ in range(2)]
            arrays.update(k_cache=paged(pools[0], k_cache), v_cache=paged(pools[1], v_cache), block_table=table,
                          k_expected=paged(pools[0], k_dense), v_expected=paged(pools[1], v_dense))
        else:
            arrays.update(k_cache=k_cache, v_cache=v_cache, k_expected=k_dense, v_expected=v_dense)
        arrays["cache_seqlens"] = before
        arrays["k_dense"], arrays["v_dense"], arrays["lengths"] = k_dense, v_dense, xp.asarray(lengths)
        return {**arrays, "scale": np.float32(1.0 / math.sqrt(d))}

    def output_specs(self, problem: Problem) -> dict[str, tuple[tuple[int, ...], str]]:
        b, h, n, d = problem.shape
        return {"o": ((b, h, n, d), problem.dtype), "lse": ((b, h, n), "float32")}

    def check(self, problem: Problem, inputs: Mapping[str, Any], outputs: Mapping[str, Any], xp: Any) -> str | None:
        """The cache after the append byte for byte (the new tokens where they go, nothing else
        touched), then o and lse of each sequence against the attention reference over its keys."""
        for name in ("k", "v"):
            got, want = inputs[f"{name}_cache"], inputs[f"{name}_expected"]
            if not bool((got.view(np.uint16) == want.view(np.uint16)).all()):
                wrong = int((got.view(np.uint16) != want.view(np.uint16)).sum())
                return f"{name}_cache after the append differs from the expected cache in {wrong} elements"
        b, h, n, d = problem.shape
        kv_heads, _ = self.kv(problem)
        lengths = [int(x) for x in inputs["lengths"].get()] if hasattr(inputs["lengths"], "get") \
            else [int(x) for x in inputs["lengths"]]
        for s, length in enumerate(lengths):
            one = self._sequence(problem, length)
            seq_inputs = {"q": inputs["q"][s:s + 1].transpose(0, 2, 1, 3),
                          "k": inputs["k_dense"][s:s + 1, :length].transpose(0, 2, 1, 3),
                          "v": inputs["v_dense"][s:s + 1, :length].transpose(0, 2, 1, 3), "scale": inputs["scale"]}
            seq_outputs = {"o": outputs["o"][s:s + 1], "lse": outputs["lse"][s:s + 1]}
            wrong = super().check(one, seq_inputs, seq_outputs, xp)
            if wrong:
                return f"sequence {s} ({length} keys): {wrong}"
        return None

    def _sequence(self, problem: Problem, length: int) -> Problem:
        """The dense attention problem of one sequence of `length` keys (the reference's)."""
        b, h, n, d = problem.shape
        opts = {k: v for k, v in problem.options if k not in ("kv_len", "page_size", "new_len")}
        return ATTENTION.problem(f"1,{h},{n},{d}", problem.dtype, {**opts, "kv_len": length})


__all__ = ["ATTENTION_KVCACHE", "AttentionKVCacheFamily", "PAGE_SIZES"]

AttentionKVCacheFamily.public_functions = ("autosoft.functions.attention_kvcache:attention_kvcache",)
ATTENTION_KVCACHE = register(AttentionKVCacheFamily())


# --- the torch operator (autosoft.torch_ops registers it) ---------------------------------------

def _operator_call(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any = None, k_new: Any = None,
                   v_new: Any = None, causal: bool = True, scale: float | None = None, window_left: int | None = None,
                   window_right: int | None = None, softcap: float | None = None) -> OperatorCall:
    """What autosoft.attention_kvcache runs for the same arguments (window=(window_left, window_right))."""
    call = ATTENTION_KVCACHE.python_call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal, scale,
                                         operator_window(window_left, window_right), softcap)
    return OperatorCall(call.arrays, call.options, call.scalars)


# k_cache and v_cache are written in place (the new tokens appended): declared mutated, so that
# torch.compile orders the call against other uses of the cache
AttentionKVCacheFamily.torch_operators = (
    TorchOperator("attention_kvcache", "attention_kvcache",
                  "(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor cache_seqlens, Tensor? block_table=None, "
                  "Tensor? k_new=None, Tensor? v_new=None, bool causal=True, float? scale=None, int? window_left=None, "
                  "int? window_right=None, float? softcap=None) -> (Tensor o, Tensor lse)", _operator_call,
                  instead="scaled_dot_product_attention on the gathered keys"),
)
