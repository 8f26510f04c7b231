"""GPU tier for attention over packed sequences: sampled variants of every bucket against the
float64 reference, and the function against SDPA sequence by sequence."""
from __future__ import annotations

import math

import pytest

from autosoft.families import get_family
from helpers import wrong_samples

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention_varlen")

# beyond the examples: packed query heads (G = 8) of a bucket of short sequences, D 96 and 256,
# a window without causal
PROBLEMS = [
    ("6,8,17,128", "bfloat16", {"kv_heads": 1, "kv_len": 300, "causal": True}),
    ("3,4,200,96", "float16", {"kv_heads": 4, "window_left": 50, "window_right": 10}),
    ("2,8,128,256", "bfloat16", {"kv_heads": 2, "causal": True}),
]


def test_sampled_variants_of_every_bucket_are_correct():
    failures = wrong_samples(FAMILY, [FAMILY.problem(*case) for case in (*FAMILY.examples, *PROBLEMS)], seed=9)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_function_matches_sdpa_sequence_by_sequence(dtype):
    torch = pytest.importorskip("torch")
    import autosoft

    tdtype = getattr(torch, dtype)
    queries, keys = [5, 300, 1, 77], [5, 300, 900, 200]
    hq, hkv, d = 8, 2, 128
    cu_q = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(keys).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(sum(queries), hq, d, device="cuda", generator=gen).to(tdtype)
    k = torch.randn(sum(keys), hkv, d, device="cuda", generator=gen).to(tdtype)
    v = torch.randn(sum(keys), hkv, d, device="cuda", generator=gen).to(tdtype)
    o, lse = autosoft.attention_varlen(q, k, v, cu_q, cu_k, max(queries), max(keys), causal=True, return_lse=True)
    assert o.shape == q.shape and lse.shape == (hq, sum(queries))
    for s, (nq, nk) in enumerate(zip(queries, keys)):
        q0, k0 = int(cu_q[s]), int(cu_k[s])
        qs = q[q0:q0 + nq].transpose(0, 1)[None].float()
        ks = k[k0:k0 + nk].transpose(0, 1)[None].repeat_interleave(hq // hkv, dim=1).float()
        vs = v[k0:k0 + nk].transpose(0, 1)[None].repeat_interleave(hq // hkv, dim=1).float()
        mask = torch.arange(nk, device="cuda")[None, :] <= (torch.arange(nq, device="cuda")[:, None] + nk - nq)
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask)
        tol = {"float16": 4e-3, "bfloat16": 2e-2}[dtype]
        torch.testing.assert_close(o[q0:q0 + nq].transpose(0, 1)[None].float(), ref, atol=tol, rtol=tol)
        scores = (qs.double() @ ks.double().transpose(-1, -2)) / math.sqrt(d)
        expected = torch.logsumexp(scores.masked_fill(~mask, -math.inf), dim=-1)
        torch.testing.assert_close(lse[:, q0:q0 + nq][None].double(), expected, atol=1e-3, rtol=1e-4)
