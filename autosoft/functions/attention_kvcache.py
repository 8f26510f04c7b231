"""autosoft.attention_kvcache: attention of a few queries per sequence over a (paged) KV cache, with
FlashAttention's flash_attn_with_kvcache calling convention, over the attention_kvcache family
(autosoft/families/attention_kvcache.py)."""
from __future__ import annotations

from typing import Any

from ..api import run_call
from ..families.attention_kvcache import ATTENTION_KVCACHE

__all__ = ["attention_kvcache"]


def attention_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any, block_table: Any = None,
                      k_new: Any = None, v_new: Any = None, causal: bool = True, scale: float | None = None,
                      window: Any = None, softcap: float | None = None, return_lse: bool = False) -> Any:
    """Attention of q over each sequence's cached keys and values, new ones appended first.

    q (B, Nq, Hq, D): Nq queries per sequence (1 for decode; more for speculative verification or
    chunked prefill), the last Nq positions of the sequence. The cache, CUDA torch tensors or CuPy
    arrays of q's dtype (float16, bfloat16): paged, k_cache and v_cache (num_pages, page_size, Hkv,
    D) with block_table (B, max_pages) int32 naming each sequence's pages in order (page sizes 1,
    16, 32, 64, 128, 256), or contiguous (B, max_len, Hkv, D) without one; Hq a multiple of Hkv.
    cache_seqlens (B,) int32: the tokens each sequence's cache holds before this call. k_new and
    v_new (B, Nnew, Hkv, D), optional: written into the cache at positions cache_seqlens[b] to
    cache_seqlens[b] + Nnew - 1 (in place; the caller advances cache_seqlens), then attended to.
    causal (default True) aligns the queries bottom-right: query i of a sequence of Nkv =
    cache_seqlens[b] + Nnew keys sees keys up to i + Nkv - Nq; window=(left, right) and softcap as
    autosoft.attention's; scale defaults to 1/sqrt(D). Returns o (B, Nq, Hq, D), a view of the
    kernel's (B, Hq, Nq, D) output, and with return_lse=True also lse (B, Hq, Nq) float32.

    The lengths are read on the GPU: nothing synchronises with the host, so a call captured in a
    CUDA graph replays correctly as cache_seqlens changes, within the bucket it was made for
    (the same B, heads, Nq, Nnew, page size and block_table width). The host checks shapes and
    dtypes, before anything reaches the GPU (TypeError or ValueError naming the argument), and with
    k_new that k_cache and v_cache are contiguous (they are written in place: a copy would lose the
    new tokens). The values on the GPU are the caller's to keep valid, as with FlashAttention:
    lengths past the cache, block_table entries past the pool."""
    call = ATTENTION_KVCACHE.python_call(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, causal,
                                         scale, window, softcap, return_lse)
    o, lse = run_call("attention_kvcache", ATTENTION_KVCACHE.inputs, call)  # torch.compile: one operator
    o = o.swapaxes(1, 2)  # (B, Hq, Nq, D) as the kernel writes it, seen as (B, Nq, Hq, D)
    return (o, lse) if return_lse else o
