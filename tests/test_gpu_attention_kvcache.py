"""GPU tier for attention over a KV cache: sampled variants of every bucket against the float64
reference (the cache after the append byte for byte), the function on torch tensors against SDPA
on the gathered keys, and a CUDA graph replayed as the lengths grow."""
from __future__ import annotations

import math

import pytest

from autosoft.families import get_family
from helpers import wrong_samples

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention_kvcache")

# beyond the examples: pages of one token and of 256, MQA, D 32 and 96, a window with no causal
# mask, Nq of 8 (speculative verification), new tokens across a page boundary
PROBLEMS = [
    ("4,8,1,128", "bfloat16", {"kv_len": 600, "kv_heads": 1, "page_size": 256, "new_len": 1, "causal": True}),
    ("3,4,8,64", "float16", {"kv_len": 200, "kv_heads": 2, "page_size": 16, "new_len": 8, "causal": True}),
    ("2,6,1,96", "bfloat16", {"kv_len": 333, "kv_heads": 3, "page_size": 32, "window_left": 40, "window_right": 0}),
    ("2,2,2,32", "float16", {"kv_len": 50, "page_size": 1, "new_len": 2, "causal": True, "softcap": 10.0}),
]


def test_sampled_variants_of_every_bucket_are_correct():
    """The default, its first six seeds (split counts, packing, key warps) and two random points."""
    failures = wrong_samples(FAMILY, [FAMILY.problem(*case) for case in (*FAMILY.examples, *PROBLEMS)], seed=3)
    assert not failures, "\n".join(failures)


def _paged(torch, b, hkv, d, page, pages_each, dtype, seed):
    """A pool of pages scattered among b sequences, and its block table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = b * pages_each + 3
    k = torch.randn(pool, page, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(pool, page, hkv, d, device="cuda", generator=gen).to(dtype)
    table = torch.randperm(pool, device="cuda", generator=gen)[: b * pages_each].reshape(b, pages_each).int()
    return k, v, table


def _gathered(torch, cache, table, b, length, page):
    """Sequence b's first `length` tokens of a paged cache, (length, Hkv, D)."""
    return torch.stack([cache[int(table[b, t // page]), t % page] for t in range(length)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_function_matches_sdpa_on_the_gathered_keys_and_appends_in_place(dtype):
    torch = pytest.importorskip("torch")
    import autosoft

    tdtype = getattr(torch, dtype)
    b, hq, hkv, d, page, nq, new = 3, 8, 2, 128, 16, 2, 3
    k_cache, v_cache, table = _paged(torch, b, hkv, d, page, 6, tdtype, seed=1)
    before = torch.tensor([5, 16, 90], device="cuda", dtype=torch.int32)  # the last ends past a page boundary
    gen = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(b, nq, hq, d, device="cuda", generator=gen).to(tdtype)
    k_new = torch.randn(b, new, hkv, d, device="cuda", generator=gen).to(tdtype)
    v_new = torch.randn(b, new, hkv, d, device="cuda", generator=gen).to(tdtype)
    untouched = k_cache.clone()
    o, lse = autosoft.attention_kvcache(q, k_cache, v_cache, before, table, k_new, v_new, causal=True, return_lse=True)
    assert o.shape == (b, nq, hq, d) and lse.shape == (b, hq, nq)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device="cuda")
    for s in range(b):
        for j in range(new):
            pos = int(before[s]) + j
            written[int(table[s, pos // page]), pos % page] = True
            assert torch.equal(k_cache[int(table[s, pos // page]), pos % page], k_new[s, j])
    assert torch.equal(k_cache[~written], untouched[~written]), "nothing but the new tokens' slots changed"
    for s in range(b):
        length = int(before[s]) + new
        keys = _gathered(torch, k_cache, table, s, length, page).transpose(0, 1)[None]      # (1, Hkv, L, D)
        values = _gathered(torch, v_cache, table, s, length, page).transpose(0, 1)[None]
        keys = keys.repeat_interleave(hq // hkv, dim=1).float()
        values = values.repeat_interleave(hq // hkv, dim=1).float()
        queries = q[s:s + 1].transpose(1, 2).float()                                 # (1, Hq, Nq, D)
        mask = torch.arange(length, device="cuda")[None, :] <= (torch.arange(nq, device="cuda")[:, None] + length - nq)
        ref = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)
        tol = {"float16": 4e-3, "bfloat16": 2e-2}[dtype]
        torch.testing.assert_close(o[s:s + 1].transpose(1, 2).float(), ref, atol=tol, rtol=tol)
        scores = (queries.double() @ keys.double().transpose(-1, -2)) / math.sqrt(d)
        scores = scores.masked_fill(~mask, -math.inf)
        torch.testing.assert_close(lse[s:s + 1].double(), torch.logsumexp(scores, dim=-1), atol=1e-3, rtol=1e-4)


def test_a_captured_decode_step_replays_right_as_the_lengths_grow():
    """One decode step captured in a CUDA graph, replayed after cache_seqlens moved on (in place):
    each replay equals the same call made eagerly with those lengths."""
    torch = pytest.importorskip("torch")
    import autosoft

    b, hq, hkv, d, page = 4, 16, 4, 128, 16
    k_cache, v_cache, table = _paged(torch, b, hkv, d, page, 8, torch.bfloat16, seed=5)
    lengths = torch.tensor([1, 17, 40, 100], device="cuda", dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16)
    k_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16)
    autosoft.attention_kvcache(q, k_cache, v_cache, lengths, table, k_new, v_new)  # loads the kernel
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = autosoft.attention_kvcache(q, k_cache, v_cache, lengths, table, k_new, v_new)
    for step in range(3):
        lengths += torch.tensor([1, 3, 7, 20], device="cuda", dtype=torch.int32)
        q.normal_()
        k_new.normal_()
        v_new.normal_()
        graph.replay()
        eager = autosoft.attention_kvcache(q, k_cache, v_cache, lengths, table, k_new, v_new)
        torch.cuda.synchronize()
        assert torch.equal(captured, eager), f"replay {step} differs from the eager call"
