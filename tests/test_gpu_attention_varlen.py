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


# --- the wgmma engine over packed sequences (sm_90a) ------------------------------------------

# queries per sequence: one token, either side of a 64-row warpgroup tile, a few tiles, a long one;
# keys: as many, or others (fewer than the queries: causal rows that see no key)
EDGES_Q = [1, 63, 64, 65, 200, 1500]
EDGES_K = {"same": EDGES_Q, "other": [300, 1, 64, 30, 450, 1700]}
SPARE = 130  # rows past the batch's tokens in every array: never read as a sequence's, never written

WGMMA_CASES = [
    ("bfloat16", 128, 8, 2, "same", {"causal": True}),
    ("float16", 64, 4, 4, "other", {}),
    ("bfloat16", 64, 8, 1, "other", {"causal": True}),
    ("bfloat16", 128, 8, 4, "same", {"causal": True, "window_left": 100, "window_right": 0}),
    ("float16", 128, 4, 2, "other", {"window_left": 90, "window_right": 40, "softcap": 20.0}),
]


def _wgmma_points(problem, target, count: int):
    """The default wgmma point under each schedule (one block per tile, persistent blocks, from a
    queue) and the first `count` other wgmma seeds (other tiles and consumers)."""
    default = FAMILY.default_params(problem, target)
    assert default["engine"] == "wgmma", default
    schedules = [{**default, "persistent": p, "queue": q} for p, q in ((False, False), (True, False), (True, True))]
    points = [default, *[p for p in schedules if p != default]]
    return points + [p for p in FAMILY.seed_params(problem, target) if p["engine"] == "wgmma" and p not in points][:count]


@pytest.mark.parametrize("dtype, d, hq, hkv, keys, opts", WGMMA_CASES)
def test_wgmma_engine_matches_the_reference_and_writes_only_the_batch_s_rows(dtype, d, hq, hkv, keys, opts):
    cp = pytest.importorskip("cupy")
    import numpy as np

    from autosoft.dtypes import to_float64, to_storage
    from autosoft.runtime import device_info
    from helpers import loaded_variant

    target = device_info().target
    if target.arch != "90":
        pytest.skip("the wgmma engine needs sm_90")
    queries, key_counts = EDGES_Q, EDGES_K[keys]
    problem = FAMILY.problem(f"{len(queries)},{hq},{max(queries)},{d}", dtype,
                             {**opts, "kv_heads": hkv, "kv_len": max(key_counts)})
    rng = np.random.default_rng(11)
    total_q, total_k = sum(queries), sum(key_counts)
    offsets = [np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (queries, key_counts)]
    def stored(x32):  # to_storage works on the host: the device gets its bits
        return cp.asarray(to_storage(x32, dtype, np))

    inputs = {"q": stored(rng.standard_normal((total_q + SPARE, hq, d), dtype=np.float32)),
              "k": stored(rng.standard_normal((total_k + SPARE, hkv, d), dtype=np.float32)),
              "v": stored(rng.standard_normal((total_k + SPARE, hkv, d), dtype=np.float32)),
              "cu_seqlens_q": cp.asarray(offsets[0]), "cu_seqlens_k": cp.asarray(offsets[1]),
              "scale": np.float32(1 / math.sqrt(d))}
    poison_o = stored(np.full((total_q + SPARE, hq, d), np.nan, dtype=np.float32))
    for params in _wgmma_points(problem, target, 2):
        loaded = loaded_variant(FAMILY, problem, params)
        outputs = {"o": poison_o.copy(), "lse": cp.full((total_q + SPARE, hq), cp.nan, dtype=cp.float32)}
        loaded.launch({**inputs, **outputs})
        cp.cuda.Device().synchronize()
        wrong = FAMILY.check(problem, inputs, outputs, cp)
        assert wrong is None, f"{loaded.variant.name}: {wrong}"
        # every row of the batch written, none past it (the spare rows keep their poison)
        assert not bool(cp.isnan(to_float64(outputs["o"][:total_q], dtype, cp)).any()), \
            f"{loaded.variant.name}: an o row not written"
        assert bool(cp.isnan(outputs["lse"][total_q:]).all()), f"{loaded.variant.name}: lse written past the batch"
        assert bool((outputs["o"][total_q:].view(cp.uint16) == poison_o[total_q:].view(cp.uint16)).all()), \
            f"{loaded.variant.name}: o written past the batch"
        assert not bool(cp.isnan(outputs["lse"][:total_q]).any()), f"{loaded.variant.name}: an lse row not written"


def test_the_function_on_sm90_runs_the_wgmma_engine_and_matches_sdpa():
    """autosoft.attention_varlen on sm_90 (the wgmma engine by default) against SDPA sequence by
    sequence, on the prefill benchmark's kind of batch: long and short causal sequences, GQA."""
    torch = pytest.importorskip("torch")
    import autosoft
    from autosoft.runtime import device_info

    if device_info().target.arch != "90":
        pytest.skip("the wgmma engine needs sm_90")
    lengths = [133, 3679, 1, 64, 65, 977, 2048]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lengths), 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(sum(lengths), 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(lengths), 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    shapes = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "cu_seqlens_q": (len(cu),),
              "cu_seqlens_k": (len(cu),)}
    bounds = {"causal": True, "max_seqlen_q": max(lengths), "max_seqlen_k": max(lengths)}
    problem = FAMILY.problem_for(shapes, "bfloat16", bounds)
    assert FAMILY.default_params(problem, device_info().target)["engine"] == "wgmma"
    o, lse = autosoft.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, return_lse=True)
    for s, n in enumerate(lengths):
        a = int(cu[s])
        qs, ks, vs = (x[a:a + n].transpose(0, 1)[None].float() for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qs, ks.repeat_interleave(4, 1), vs.repeat_interleave(4, 1),
                                                               is_causal=True)
        torch.testing.assert_close(o[a:a + n].transpose(0, 1)[None].float(), ref, atol=2e-2, rtol=2e-2)
    assert not torch.isnan(lse).any()


def test_short_batches_then_a_long_one_on_the_same_plan_compute_every_tile():
    """A serving loop: one bucket (the arrays' shapes and bounds fixed, so one plan and one queue
    counter in its workspace) and the offsets changing per call. Batches of one-token sequences
    have fewer tiles than the persistent grid; its idle blocks must still count themselves out of
    the queue, else the counter is never set back and a later long batch skips tiles (rows of o
    never written)."""
    torch = pytest.importorskip("torch")
    import autosoft
    from autosoft.runtime import device_info

    if device_info().target.arch != "90":
        pytest.skip("the wgmma engine needs sm_90")
    b, hq, hkv, d, longest = 8, 8, 2, 128, 1024
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b * longest, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(b * longest, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(b * longest, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
    shapes = {"q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "cu_seqlens_q": (b + 1,),
              "cu_seqlens_k": (b + 1,)}
    problem = FAMILY.problem_for(shapes, "bfloat16", {"causal": True, "max_seqlen_q": longest, "max_seqlen_k": longest})
    params = FAMILY.default_params(problem, device_info().target)
    assert params["engine"] == "wgmma" and params["queue"], params
    short = torch.arange(b + 1, device="cuda", dtype=torch.int32)  # one token each: b * hq tiles
    assert b * hq < device_info().target.sm_count * params["blocks_per_sm"], "not fewer tiles than blocks"
    full = torch.arange(b + 1, device="cuda", dtype=torch.int32) * longest
    for _ in range(3):
        autosoft.attention_varlen(q, k, v, short, short, longest, longest, causal=True)
    for _ in range(2):
        o = autosoft.attention_varlen(q, k, v, full, full, longest, longest, causal=True)
        for s in range(b):
            a = s * longest
            qs, ks, vs = (x[a:a + longest].transpose(0, 1)[None].float() for x in (q, k, v))
            ref = torch.nn.functional.scaled_dot_product_attention(
                qs, ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1), is_causal=True)
            torch.testing.assert_close(o[a:a + longest].transpose(0, 1)[None].float(), ref, atol=2e-2, rtol=2e-2)
        autosoft.attention_varlen(q, k, v, short, short, longest, longest, causal=True)
