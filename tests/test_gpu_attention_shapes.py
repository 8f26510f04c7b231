"""GPU tier for the attention shapes inference runs (issue 17): grouped KV heads, Nq != Nkv with
bottom-right causal masks, windows, softcap, head dims 96 and 256, strided views, decoding with
split keys; sampled variants against the float64 reference, the public function against an
explicit-mask reference built with torch."""
from __future__ import annotations

import concurrent.futures as cf
import math

import pytest

from autosoft.compile import compile_source
from autosoft.evaluate import verify
from autosoft.families import get_family
from autosoft.families.base import build_variant
from helpers import sample_points

pytestmark = pytest.mark.gpu

FAMILY = get_family("attention")

# (shape B,H,N,D, dtype, options): groups of 1, 4, 8 and MQA; Nq 1, 7, 64, 1000 against Nkv 1,
# 1000, 3333, 32768; masks that empty whole rows; windows cutting the first and last tiles;
# softcap 30 and 50; D 96 and 256
PROBLEMS = [
    ("1,4,1,64", "float16", {"kv_len": 1}),
    ("2,8,7,128", "bfloat16", {"kv_heads": 2, "kv_len": 1000, "causal": True}),
    ("1,8,64,64", "float16", {"kv_heads": 1, "kv_len": 3333, "causal": True}),
    ("1,16,1000,128", "bfloat16", {"kv_heads": 2, "kv_len": 1000, "causal": True}),
    ("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 32768}),
    ("2,8,1000,64", "float16", {"kv_heads": 8, "kv_len": 64, "causal": True}),    # rows with no key
    ("1,4,1000,64", "bfloat16", {"kv_len": 3333, "causal": True, "window_left": 100}),
    ("1,4,333,128", "float16", {"kv_heads": 2, "window_left": 64, "window_right": 64}),
    ("1,2,1000,64", "bfloat16", {"kv_len": 1000, "window_right": 5}),
    ("2,4,64,128", "bfloat16", {"kv_heads": 1, "kv_len": 1000, "softcap": 30.0}),
    ("1,8,100,64", "float16", {"kv_heads": 4, "kv_len": 3333, "softcap": 50.0, "causal": True}),
    ("1,8,1000,96", "float16", {"kv_heads": 2, "causal": True}),
    ("2,4,7,96", "bfloat16", {"kv_heads": 4, "kv_len": 3333}),
    ("1,4,1000,256", "bfloat16", {"kv_heads": 1, "causal": True}),
    ("1,8,1,256", "float16", {"kv_heads": 2, "kv_len": 4096}),
]


def _target():
    from autosoft.runtime import device_info

    return device_info().target


@pytest.mark.parametrize("shape, dtype, options", PROBLEMS,
                         ids=[FAMILY.problem(s, d, o).shape_text + "-" + d for s, d, o in PROBLEMS])
def test_sampled_variants_are_correct(shape, dtype, options):
    """The default, its seeds and sampled points, each on every input kind (strided views too)."""
    from autosoft.runtime import LoadedVariant

    problem = FAMILY.problem(shape, dtype, options)
    target = _target()
    points = [FAMILY.default_params(problem, target)] + FAMILY.seed_params(problem, target)[:3]
    points += [p for p in sample_points(FAMILY, problem, target, 4, seed=len(shape)) if p not in points]
    variants = [build_variant(FAMILY, problem, p, target) for p in points]
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda v: compile_source(v.source, v.target.arch), variants))
    failures = []
    for variant, result in zip(variants, results):
        assert result.ok, f"{variant.name}: {result.log[:2000]}"
        wrong = verify(FAMILY, LoadedVariant(variant, result.cubin), seed=3)
        if wrong:
            failures.append(f"{variant.name}: {wrong}")
    assert not failures, "\n".join(failures)


# --- the public function, against torch -----------------------------------------------------

def _reference(torch, q, k, v, causal=False, window=None, softcap=None, scale=None):
    """float64 attention with an explicit boolean mask (bottom-right aligned), k and v repeated
    to the query heads; rows that see no key: o = 0, lse = -inf."""
    b, h, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = k.double().repeat_interleave(h // hkv, dim=1)
    v = v.double().repeat_interleave(h // hkv, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    at = torch.arange(nq, device=q.device)[:, None] + (nkv - nq)
    j = torch.arange(nkv, device=q.device)[None, :]
    seen = torch.ones(nq, nkv, dtype=torch.bool, device=q.device)
    if causal:
        seen &= j <= at
    if window is not None:
        left, right = window
        if left is not None:
            seen &= j >= at - left
        if right is not None:
            seen &= j <= at + right
    s = s.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return p @ v, lse


def _close(torch, o, lse, ref_o, ref_lse, dtype):
    tol = {torch.float16: 5e-3, torch.bfloat16: 1e-2}[dtype]
    err = (o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-30)
    assert err <= tol, f"relative error {float(err):.3g}"
    assert torch.isfinite(o).all(), "o has non-finite values"
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse is -inf exactly where a row sees no key"
    assert (o[empty] == 0).all(), "rows that see no key are zeros"
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=1e-3, rtol=1e-4)


CALLS = [
    # (B, Hq, Hkv, Nq, Nkv, D, dtype, causal, window, softcap)
    (2, 8, 8, 64, 64, 64, "float16", True, None, None),
    (1, 8, 2, 7, 1000, 128, "bfloat16", True, None, None),
    (2, 8, 1, 1000, 3333, 64, "float16", True, None, None),
    (1, 32, 8, 1, 4096, 128, "bfloat16", False, None, None),
    (4, 32, 8, 1, 32768, 128, "bfloat16", True, None, None),
    (1, 4, 4, 1000, 64, 128, "bfloat16", True, None, None),   # Nq > Nkv: 936 rows see no key
    (1, 4, 2, 1000, 1000, 64, "float16", True, (100, 0), None),
    (1, 4, 2, 333, 1000, 64, "float16", False, (64, 64), None),
    (1, 4, 4, 200, 300, 64, "bfloat16", False, (None, 5), None),
    (1, 4, 4, 200, 300, 64, "bfloat16", False, (0, None), None),
    (2, 8, 2, 64, 1000, 128, "bfloat16", False, None, 30.0),
    (1, 8, 8, 100, 777, 64, "float16", True, None, 50.0),
    (1, 8, 2, 300, 300, 96, "float16", True, None, None),
    (2, 4, 4, 1, 3333, 96, "bfloat16", False, None, None),
    (1, 4, 1, 500, 500, 256, "bfloat16", True, None, None),
    (2, 8, 4, 1, 1000, 256, "float16", False, None, None),
]


@pytest.mark.parametrize("b, hq, hkv, nq, nkv, d, dtype, causal, window, softcap", CALLS,
                         ids=[f"{c[0]}x{c[1]}/{c[2]}x{c[3]}/{c[4]}x{c[5]}-{c[6]}{'-causal' if c[7] else ''}"
                              f"{f'-w{c[8]}' if c[8] else ''}{f'-cap{c[9]}' if c[9] else ''}" for c in CALLS])
def test_public_attention_matches_an_explicit_mask(b, hq, hkv, nq, nkv, d, dtype, causal, window, softcap):
    torch = pytest.importorskip("torch")
    import autosoft

    tdtype = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(nq + nkv)
    q = torch.randn(b, hq, nq, d, device="cuda", generator=gen).to(tdtype)
    if softcap:
        q = q * 4  # scores past the cap
    k, v = (torch.randn(b, hkv, nkv, d, device="cuda", generator=gen).to(tdtype) for _ in range(2))
    o, lse = autosoft.attention(q, k, v, causal=causal, return_lse=True, window=window, softcap=softcap)
    assert o.shape == q.shape and o.dtype == tdtype and o.is_contiguous() and lse.shape == q.shape[:3]
    ref_o, ref_lse = _reference(torch, q, k, v, causal, window, softcap)
    _close(torch, o, lse, ref_o, ref_lse, tdtype)


def test_strided_views_give_the_contiguous_inputs_bits():
    """q, k, v as (B, N, H, D) slices of a fused projection, transposed; k and v slices of a longer
    cache: taken as they are (strides passed), the same bits as contiguous copies."""
    torch = pytest.importorskip("torch")
    import autosoft

    b, n, h, d = 2, 300, 8, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    o = autosoft.attention(q, k, v, causal=True)
    assert torch.equal(o, autosoft.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True))
    cache_k = torch.randn(b, 2, 4096, d, device="cuda", dtype=torch.bfloat16)
    cache_v = torch.randn_like(cache_k)
    q1 = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    o1 = autosoft.attention(q1, cache_k[:, :, :1000], cache_v[:, :, :1000])  # same shape, two layouts
    o2 = autosoft.attention(q1, cache_k[:, :, :1000].contiguous(), cache_v[:, :, :1000].contiguous())
    assert torch.equal(o1, o2)
    ref_o, _ = _reference(torch, q1, cache_k[:, :, :1000], cache_v[:, :, :1000])
    torch.testing.assert_close(o1.double(), ref_o, atol=2e-2, rtol=2e-2)


def test_causal_is_bottom_right_not_torch_top_left():
    torch = pytest.importorskip("torch")
    import autosoft

    q = torch.randn(1, 2, 16, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 2, 48, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    o = autosoft.attention(q, k, v, causal=True)
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    bottom_right = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=torch.ones(16, 48, dtype=torch.bool, device="cuda").tril(48 - 16))
    torch.testing.assert_close(o, bottom_right, atol=5e-3, rtol=5e-3)
    assert not torch.allclose(o, top_left, atol=5e-2, rtol=5e-2)
