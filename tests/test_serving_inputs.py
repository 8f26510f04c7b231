"""CPU tier for the serving functions' bad input: autosoft.attention_kvcache and
autosoft.attention_varlen refuse it with a one-line TypeError or ValueError naming the argument,
before anything reaches a device. The arrays are CPU tensors: a call that got past the host checks
would be refused as a CPU tensor instead, so each case shows the check ran first."""
from __future__ import annotations

import pytest

import autosoft

torch = pytest.importorskip("torch")
F16, BF16, F32, I32, I64 = torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int64
B, NQ, HQ, HKV, D = 2, 1, 8, 2, 64


def z(*shape, dtype=F16):
    return torch.zeros(*shape, dtype=dtype)


def kvcache(q=None, k_cache=None, v_cache=None, cache_seqlens=None, block_table=None, **kwargs):
    """autosoft.attention_kvcache on a valid contiguous-cache call, the given arguments replaced."""
    cache = z(B, 40, HKV, D)
    return autosoft.attention_kvcache(z(B, NQ, HQ, D) if q is None else q, cache if k_cache is None else k_cache,
                                      cache if v_cache is None else v_cache,
                                      z(B, dtype=I32) if cache_seqlens is None else cache_seqlens, block_table, **kwargs)


def paged(block_table=None, pool=(10, 16, HKV, D), **kwargs):
    """autosoft.attention_kvcache on a valid paged call (pages of 16), the given arguments replaced."""
    table = z(B, 5, dtype=I32) if block_table is None else block_table
    return kvcache(k_cache=z(*pool), v_cache=z(*pool), block_table=table, **kwargs)


def refused(call, error, *needles):
    """The call's error: of type `error`, one line, naming the function and each needle."""
    with pytest.raises(error) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message, message
    for needle in ("autosoft.", *needles):
        assert needle in message, message
    return message


KVCACHE_CASES = [
    (lambda: kvcache(q=z(B, HQ, D)), ValueError, ("q must be (B, Nq, Hq, D)", "(2, 8, 64)")),
    (lambda: kvcache(q=z(B, NQ, HQ, D, 1)), ValueError, ("q must be (B, Nq, Hq, D)",)),
    (lambda: kvcache(k_cache=z(B, 40, D), v_cache=z(B, 40, D)), ValueError, ("k_cache must be",)),
    (lambda: kvcache(v_cache=z(B, 41, HKV, D)), ValueError, ("v_cache must have k_cache's shape",)),
    (lambda: kvcache(k_cache=z(B, 40, HKV, D, dtype=BF16)), TypeError, ("k_cache must be float16", "bfloat16")),
    (lambda: kvcache(v_cache=z(B, 40, HKV, D, dtype=BF16)), TypeError, ("v_cache must be float16",)),
    (lambda: kvcache(k_cache=z(B, 40, HKV, D, dtype=F32), v_cache=z(B, 40, HKV, D, dtype=F32)), TypeError,
     ("k_cache must be float16", "float32")),
    (lambda: kvcache(q=z(B, NQ, HQ, D, dtype=F32)), TypeError, ("q must be float16 or bfloat16", "float32")),
    (lambda: kvcache(k_cache=z(B, 40, 3, D), v_cache=z(B, 40, 3, D)), ValueError, ("q's 8 heads", "multiple", "3")),
    (lambda: kvcache(k_cache=z(B, 40, HKV, 128), v_cache=z(B, 40, HKV, 128)), ValueError,
     ("k_cache and v_cache must have q's head dim 64", "128")),
    (lambda: kvcache(q=z(B, NQ, HQ, 512), k_cache=z(B, 40, HKV, 512), v_cache=z(B, 40, HKV, 512)), ValueError,
     ("q's head dim 512 is not supported", "256")),
    (lambda: kvcache(cache_seqlens=z(B, dtype=I64)), TypeError, ("cache_seqlens must be int32", "int64")),
    (lambda: kvcache(cache_seqlens=z(3, dtype=I32)), ValueError, ("cache_seqlens must be (B,) = (2,)", "(3,)")),
    (lambda: kvcache(cache_seqlens=z(B, 1, dtype=I32)), ValueError, ("cache_seqlens must be (B,)", "(2, 1)")),
    (lambda: paged(z(B, 5, dtype=I64)), TypeError, ("block_table must be int32", "int64")),
    (lambda: paged(z(5, dtype=I32)), ValueError, ("block_table must be (B, max_pages)", "(5,)")),
    (lambda: paged(z(3, 5, dtype=I32)), ValueError, ("block_table must be (B, max_pages) with B = 2", "(3, 5)")),
    (lambda: paged(pool=(10, 8, HKV, D)), ValueError, ("k_cache's page size 8", "1, 16, 32, 64, 128, 256")),
    (lambda: paged(pool=(0, 16, HKV, D)), ValueError, ("k_cache holds no pages",)),
    (lambda: paged(z(B, 0, dtype=I32)), ValueError, ("q's 1 queries", "block_table's 0 pages")),
    (lambda: kvcache(k_new=z(B, 1, HKV, D)), ValueError, ("k_new and v_new together",)),
    (lambda: kvcache(v_new=z(B, 1, HKV, D)), ValueError, ("k_new and v_new together",)),
    (lambda: kvcache(k_new=z(B, HKV, D), v_new=z(B, HKV, D)), ValueError, ("k_new and v_new must be (B, Nnew, Hkv, D)",)),
    (lambda: kvcache(k_new=z(B, 1, HQ, D), v_new=z(B, 1, HQ, D)), ValueError, ("(2, Nnew, 2, 64)", "(2, 1, 8, 64)")),
    (lambda: kvcache(k_new=z(B, 1, HKV, D), v_new=z(B, 2, HKV, D)), ValueError, ("k_new and v_new must have one shape",)),
    (lambda: kvcache(k_new=z(B, 1, HKV, D, dtype=BF16), v_new=z(B, 1, HKV, D, dtype=BF16)), TypeError,
     ("k_new must be float16",)),
    (lambda: kvcache(k_new=z(B, 41, HKV, D), v_new=z(B, 41, HKV, D)), ValueError, ("k_new's 41 new tokens", "40 keys")),
    (lambda: kvcache(q=z(B, 50, HQ, D)), ValueError, ("q's 50 queries", "40 keys the cache holds")),
    (lambda: kvcache(k_cache=z(10, 16, HKV, D), v_cache=z(10, 16, HKV, D)), ValueError,
     ("without a block_table the cache is taken as contiguous", "k_cache's first dim is 10", "block_table")),
    (lambda: kvcache(window=5), TypeError, ("window",)),
    (lambda: kvcache(window=(-1, 0)), ValueError, ("window's left side",)),
    (lambda: kvcache(softcap=0.0), ValueError, ("softcap",)),
    (lambda: kvcache(scale=-1.0), ValueError, ("scale",)),
    (lambda: kvcache(scale="x"), TypeError, ("scale",)),
]


@pytest.mark.parametrize("call, error, needles", KVCACHE_CASES, ids=[needles[0] for *_, needles in KVCACHE_CASES])
def test_kvcache_refuses_bad_input_naming_the_argument(call, error, needles):
    refused(call, error, "attention_kvcache", *needles)


def test_kvcache_refuses_an_append_into_a_cache_it_would_copy():
    """k_new goes into the cache in place: a cache the array layer copies (not contiguous) would
    lose it, silently. Read-only, the same cache is taken (copied) as before."""
    fused = z(B, 40, 2, HKV, D)  # k and v interleaved per token: each a strided view
    k_cache, v_cache = fused[:, :, 0], fused[:, :, 1]
    new = z(B, 1, HKV, D)
    refused(lambda: kvcache(k_cache=k_cache, v_cache=v_cache, k_new=new, v_new=new), ValueError,
            "k_cache must be contiguous", "in place")
    refused(lambda: kvcache(k_cache=k_cache, v_cache=v_cache), TypeError, "CPU tensor")


def test_kvcache_valid_calls_reach_the_array_layer():
    """Valid calls, paged or not, with and without an append (an empty one too), pass every host
    check: what refuses them is the array layer, for being on the CPU."""
    new = z(B, 1, HKV, D)
    for call in (lambda: kvcache(), lambda: paged(), lambda: paged(k_new=new, v_new=new, causal=False),
                 lambda: kvcache(k_new=z(B, 0, HKV, D), v_new=z(B, 0, HKV, D)), lambda: kvcache(q=z(B, 40, HQ, D))):
        refused(call, TypeError, "q is a CPU tensor")


def varlen(q=None, k=None, v=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=6, max_seqlen_k=7, **kwargs):
    """autosoft.attention_varlen on a valid packed call (two sequences), the given arguments replaced."""
    kv = z(12, HKV, D)
    offsets_q, offsets_k = torch.tensor([0, 4, 10], dtype=I32), torch.tensor([0, 5, 12], dtype=I32)
    return autosoft.attention_varlen(z(10, HQ, D) if q is None else q, kv if k is None else k, kv if v is None else v,
                                     offsets_q if cu_seqlens_q is None else cu_seqlens_q,
                                     offsets_k if cu_seqlens_k is None else cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     **kwargs)


VARLEN_CASES = [
    (lambda: varlen(q=z(10, HQ, D, 1)), ValueError, ("q must be (total_q, Hq, D)", "(10, 8, 64, 1)")),
    (lambda: varlen(q=z(1, 10, HQ, D)), ValueError, ("q must be (total_q, Hq, D)",)),
    (lambda: varlen(k=z(12, D), v=z(12, D)), ValueError, ("k must be (total_k, Hkv, D)", "(12, 64)")),
    (lambda: varlen(v=z(11, HKV, D)), ValueError, ("v must have k's shape",)),
    (lambda: varlen(k=z(12, HKV, D, dtype=BF16)), TypeError, ("k must be float16", "bfloat16")),
    (lambda: varlen(v=z(12, HKV, D, dtype=F32)), TypeError, ("v must be float16", "float32")),
    (lambda: varlen(q=z(10, HQ, D, dtype=F32)), TypeError, ("q must be float16 or bfloat16",)),
    (lambda: varlen(cu_seqlens_q=torch.tensor([0, 4, 10])), TypeError, ("cu_seqlens_q must be int32", "int64")),
    (lambda: varlen(cu_seqlens_k=torch.tensor([0, 5, 12])), TypeError, ("cu_seqlens_k must be int32",)),
    (lambda: varlen(cu_seqlens_q=z(1, 3, dtype=I32)), ValueError, ("cu_seqlens_q must be (B + 1,)", "(1, 3)")),
    (lambda: varlen(cu_seqlens_q=z(1, dtype=I32), cu_seqlens_k=z(1, dtype=I32)), ValueError,
     ("cu_seqlens_q must be (B + 1,) with B >= 1",)),
    (lambda: varlen(cu_seqlens_k=z(4, dtype=I32)), ValueError, ("cu_seqlens_q and cu_seqlens_k", "3 and 4")),
    (lambda: varlen(max_seqlen_q=0), ValueError, ("max_seqlen_q must be an int >= 1",)),
    (lambda: varlen(max_seqlen_k=-1), ValueError, ("max_seqlen_k must be an int >= 1",)),
    (lambda: varlen(max_seqlen_k=7.0), TypeError, ("max_seqlen_k must be an int",)),
    (lambda: varlen(max_seqlen_q=True), TypeError, ("max_seqlen_q must be an int",)),
    (lambda: varlen(k=z(12, 3, D), v=z(12, 3, D)), ValueError, ("q's 8 heads", "multiple of k's and v's 3")),
    (lambda: varlen(k=z(12, HKV, 128), v=z(12, HKV, 128)), ValueError, ("k and v must have q's head dim 64", "128")),
    (lambda: varlen(q=z(10, HQ, 48), k=z(12, HKV, 48), v=z(12, HKV, 48)), ValueError,
     ("q's head dim 48 is not supported",)),
    (lambda: varlen(k=z(0, HKV, D), v=z(0, HKV, D)), ValueError, ("k and v hold no tokens",)),
    (lambda: varlen(window=5), TypeError, ("window",)),
    (lambda: varlen(softcap=float("inf")), ValueError, ("softcap",)),
    (lambda: varlen(scale=0), ValueError, ("scale",)),
]


@pytest.mark.parametrize("call, error, needles", VARLEN_CASES, ids=[needles[0] for *_, needles in VARLEN_CASES])
def test_varlen_refuses_bad_input_naming_the_argument(call, error, needles):
    refused(call, error, "attention_varlen", *needles)


def test_varlen_valid_calls_reach_the_array_layer():
    """A valid call, and an empty one (no queries: empty outputs), pass every host check."""
    for call in (lambda: varlen(), lambda: varlen(q=z(0, HQ, 48), k=z(12, HKV, 48), v=z(12, HKV, 48))):
        refused(call, TypeError, "q is a CPU tensor")


@pytest.mark.gpu
def test_on_the_gpu_an_empty_append_is_none_and_a_strided_cache_is_refused_before_writing():
    """On CUDA tensors: k_new of no tokens gives what no k_new gives (not an empty call's
    uninitialised o) and leaves the cache as it was; an append into a strided cache is refused
    with the cache untouched; the same cache read-only is taken."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, NQ, HQ, D, device="cuda", generator=gen).half()
    fused = torch.randn(B, 40, 2, HKV, D, device="cuda", generator=gen).half()
    k_cache, v_cache = fused[:, :, 0].contiguous(), fused[:, :, 1].contiguous()
    lengths = torch.tensor([7, 40], device="cuda", dtype=I32)
    plain = autosoft.attention_kvcache(q, k_cache, v_cache, lengths)
    before = k_cache.clone()
    empty = torch.zeros(B, 0, HKV, D, device="cuda", dtype=F16)
    assert torch.equal(autosoft.attention_kvcache(q, k_cache, v_cache, lengths, k_new=empty, v_new=empty), plain)
    assert torch.equal(k_cache, before)
    new = torch.ones(B, 1, HKV, D, device="cuda", dtype=F16)
    kept = fused.clone()
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        autosoft.attention_kvcache(q, fused[:, :, 0], fused[:, :, 1], lengths - 1, k_new=new, v_new=new)
    assert torch.equal(fused, kept)
    strided = autosoft.attention_kvcache(q, fused[:, :, 0], fused[:, :, 1], lengths)
    assert torch.allclose(strided.float(), plain.float(), atol=1e-3)
