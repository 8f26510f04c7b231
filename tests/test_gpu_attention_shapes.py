"""GPU tier for the attention shapes inference runs (issue 17), through the public function
`autosoft.attention` (untuned: the heuristic default, chosen by the dispatcher): grouped KV heads
(groups of 1, 4, 8, multi-query), Nq != Nkv with causal masks aligned bottom-right (rows that see
no key: o = 0, lse = -inf), sliding windows, softcap, head dims 96 and 256, strided views and KV
cache slices (the same bits as contiguous inputs), decoding with long caches; every result against
a float64 reference built with an explicit boolean mask. One more test verifies sampled variants
of the search space on a few of these problems.

Every distinct (dtype, D, group, Nq, Nkv, mask, cap) is one kernel compiled on its first call:
cases share kernels where they can (batch and head counts are run-time values)."""
from __future__ import annotations

import math
from typing import NamedTuple

import pytest

from helpers import loaded_variants

pytestmark = pytest.mark.gpu

TOLERANCE = {"float16": 5e-3, "bfloat16": 1e-2}  # relative norm error over o, as the family checks it
ROW_FACTOR = 4.0                                  # and per row at most 4x that
LSE_ATOL, LSE_RTOL = 1e-3, 1e-4


@pytest.fixture(scope="module", autouse=True)
def empty_cache(tmp_path_factory):
    """An empty AUTOSOFT_CACHE_DIR for the module, so that every call runs the heuristic default
    (never an entry of the user's cache); one for the whole module, so that kernels compiled for
    one test serve the others. The dispatcher forgets what it read before and after."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOSOFT_CACHE_DIR", str(tmp_path_factory.mktemp("attention_shapes_cache")))
        _forget()
        yield
    _forget()


def _forget() -> None:
    import autosoft

    dispatcher = getattr(getattr(autosoft, "api", None), "DISPATCHER", None)
    if dispatcher is not None:
        dispatcher.forget()


# --- the reference ---------------------------------------------------------------------------

def _visible(torch, nq: int, nkv: int, causal: bool, window, device):
    """The (Nq, Nkv) boolean mask: query i stands at key i + Nkv - Nq (bottom-right); causal hides
    the keys after it; window=(left, right) keeps left keys before and right after (None: all)."""
    at = torch.arange(nq, device=device)[:, None] + (nkv - nq)
    j = torch.arange(nkv, device=device)[None, :]
    seen = torch.ones(nq, nkv, dtype=torch.bool, device=device)
    if causal:
        seen &= j <= at
    if window is not None:
        left, right = window
        if left is not None:
            seen &= j >= at - left
        if right is not None:
            seen &= j <= at + right
    return seen


def _reference(torch, q, k, v, causal=False, window=None, softcap=None, scale=None):
    """float64 attention with an explicit boolean mask, k and v repeated to the query heads
    (repeat_interleave over the head dim: query head h reads KV head h // group), softcap applied
    to the scaled scores; rows that see no key: o = 0, lse = -inf. One batch at a time, so that
    the expanded float64 k and v of a long grouped cache stay near a GiB."""
    b, h, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    hidden = ~_visible(torch, nq, nkv, causal, window, q.device)
    outs, lses = [], []
    for i in range(b):
        kb = k[i:i + 1].double().repeat_interleave(h // hkv, dim=1)
        vb = v[i:i + 1].double().repeat_interleave(h // hkv, dim=1)
        s = (q[i:i + 1].double() @ kb.transpose(-1, -2)) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # an empty row: exp(-inf - -inf) = nan -> 0
        outs.append(p @ vb)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _check(torch, o, lse, ref_o, ref_lse, dtype: str) -> None:
    """o within the family's tolerance over the whole output and per row; every o finite; lse
    -inf exactly where a row sees no key (and there o is zeros), elsewhere finite and close."""
    tol = TOLERANCE[dtype]
    assert not torch.isnan(o).any() and not torch.isnan(lse).any(), "NaN in o or lse"
    assert torch.isfinite(o).all(), "o has non-finite values"
    diff = o.double() - ref_o
    err = float(diff.norm() / ref_o.norm().clamp_min(1e-30))
    assert err <= tol, f"relative error ||o - ref|| / ||ref|| = {err:.3g} > {tol:g}"
    row_err, row_ref = diff.norm(dim=-1), ref_o.norm(dim=-1)
    bad = ~(row_err <= ROW_FACTOR * tol * row_ref + 1e-6)
    if bad.any():
        worst = int(torch.argmax(torch.where(bad, row_err / (row_ref + 1e-30), -1.0)))
        raise AssertionError(f"{int(bad.sum())} rows off; worst (flat row {worst}): relative error "
                             f"{float(row_err.flatten()[worst] / row_ref.flatten()[worst]):.3g} > {ROW_FACTOR * tol:g}")
    empty = torch.isneginf(ref_lse)
    got_empty = torch.isneginf(lse)
    assert torch.equal(got_empty, empty), (f"lse -inf in {int(got_empty.sum())} rows, expected exactly the "
                                           f"{int(empty.sum())} rows that see no key")
    assert (o[empty] == 0).all(), "rows that see no key must be zeros"
    assert torch.isfinite(lse[~empty]).all(), "lse of a row that sees keys must be finite"
    torch.testing.assert_close(lse.double()[~empty], ref_lse[~empty], atol=LSE_ATOL, rtol=LSE_RTOL)


def _inputs(torch, b, hq, hkv, nq, nkv, d, dtype, seed, q_mult=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tdtype = getattr(torch, dtype)
    q = (torch.randn(b, hq, nq, d, device="cuda", generator=gen) * q_mult).to(tdtype)
    k, v = (torch.randn(b, hkv, nkv, d, device="cuda", generator=gen).to(tdtype) for _ in range(2))
    return q, k, v


def _run(torch, q, k, v, **kwargs):
    import autosoft

    o, lse = autosoft.attention(q, k, v, return_lse=True, **kwargs)
    assert o.shape == q.shape and o.dtype == q.dtype and o.is_contiguous(), (o.shape, o.dtype, o.stride())
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    return o, lse


# --- the public function against the explicit mask ---------------------------------------------

class Case(NamedTuple):
    b: int
    hq: int
    hkv: int
    nq: int
    nkv: int
    d: int
    dtype: str
    causal: bool = False
    window: tuple | None = None
    softcap: float | None = None
    scale: float | None = None

    @property
    def id(self) -> str:
        text = f"B{self.b}-H{self.hq}/{self.hkv}-N{self.nq}/{self.nkv}-D{self.d}-{self.dtype}"
        text += "-causal" if self.causal else ""
        if self.window is not None:
            text += f"-w{self.window[0]},{self.window[1]}"
        text += f"-cap{self.softcap:g}" if self.softcap else ""
        text += f"-scale{self.scale:g}" if self.scale else ""
        return text


# group = Hq / Hkv: 1, 4, 8, and multi-query (Hkv = 1); Nq 1, 7, 64, 1000 against Nkv 1, 1000,
# 3333, 32768; B*Hq*Nq*Nkv at most ~27M (the float64 reference's score block)
LENGTHS = [
    Case(2, 4, 4, 1, 1, 64, "float16"),                   # one query, one key
    Case(1, 4, 4, 1000, 1, 64, "bfloat16", True),         # 999 rows see no key
    Case(1, 8, 1, 64, 1, 64, "bfloat16"),                 # MQA, every query sees the single key
    Case(2, 8, 2, 7, 1000, 128, "bfloat16", True),        # group 4, prefill with a cache
    Case(1, 4, 1, 7, 1, 128, "float16", True),            # MQA group 4: 6 rows see no key
    Case(1, 8, 2, 1000, 3333, 64, "float16", True),       # group 4, 2333 keys before the first query
    Case(1, 16, 2, 1, 3333, 64, "bfloat16"),              # group 8 decode
    Case(2, 8, 1, 1000, 1000, 128, "float16"),            # MQA group 8, full
    Case(1, 8, 1, 7, 32768, 64, "bfloat16", True),        # MQA, a long cache
    Case(1, 8, 2, 64, 32768, 128, "bfloat16"),            # group 4, a long cache
    Case(1, 16, 2, 64, 3333, 128, "float16", True),       # group 8, causal
    Case(1, 2, 2, 1000, 1000, 64, "bfloat16", True),      # group 1, square causal
    Case(2, 4, 4, 1000, 64, 64, "bfloat16", True, scale=0.05),  # 936 rows see no key; a given scale
]

# decode: one query per sequence, Hq 32, Hkv 8, B 1 and 4, Nkv 4096 and 32768
DECODE = [
    Case(1, 32, 8, 1, 4096, 128, "bfloat16"),
    Case(4, 32, 8, 1, 4096, 128, "bfloat16"),
    Case(1, 32, 8, 1, 32768, 128, "bfloat16"),
    Case(4, 32, 8, 1, 32768, 128, "bfloat16"),
    Case(4, 32, 8, 1, 32768, 128, "float16", True),       # causal decode sees every key
]

# windows whose edges cut the first and last key tiles (not multiples of any tile size)
WINDOWS = [
    Case(1, 4, 2, 1000, 3333, 64, "bfloat16", True, (100, 0)),
    Case(2, 4, 2, 333, 1000, 64, "float16", False, (64, 64)),
    Case(1, 4, 4, 200, 300, 64, "bfloat16", False, (None, 5)),
    Case(1, 4, 4, 300, 200, 64, "float16", False, (None, 5)),   # Nq > Nkv: the first 95 rows see no key
    Case(1, 4, 4, 200, 300, 64, "bfloat16", False, (0, None)),
    Case(1, 4, 4, 64, 1000, 64, "float16", True, (0, 0)),       # one key per query
    Case(1, 32, 8, 1, 32768, 128, "bfloat16", True, (4096, None)),  # sliding-window decode (right capped at 0)
]

# softcap, with q scaled so that the cap matters (checked below)
SOFTCAPS = [
    Case(2, 8, 2, 64, 1000, 128, "bfloat16", softcap=30.0),
    Case(1, 8, 8, 100, 777, 64, "float16", True, softcap=50.0),
    Case(1, 8, 4, 300, 1000, 128, "bfloat16", True, (256, 0), 50.0),  # Gemma 2's local layers
]

# head dims 96 and 256, both dtypes
HEAD_DIMS = [
    Case(1, 8, 2, 300, 300, 96, "float16", True),
    Case(2, 4, 4, 1, 3333, 96, "bfloat16"),
    Case(1, 4, 1, 500, 500, 256, "bfloat16", True),
    Case(2, 8, 4, 1, 1000, 256, "float16"),
    Case(1, 4, 2, 64, 1000, 256, "float16", True),
    Case(1, 4, 4, 700, 700, 256, "bfloat16"),  # no mask at D = 256: the wgmma kernel, one block per tile
]

CASES = LENGTHS + DECODE + WINDOWS + SOFTCAPS + HEAD_DIMS
Q_MULT = {30.0: 4.0, 50.0: 8.0}  # q scaled: scores of std 4 (8) against a cap of 30 (50)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_public_attention_matches_an_explicit_mask(case: Case):
    torch = pytest.importorskip("torch")

    c = case
    q, k, v = _inputs(torch, c.b, c.hq, c.hkv, c.nq, c.nkv, c.d, c.dtype, seed=c.nq * 7 + c.nkv + c.d,
                      q_mult=Q_MULT.get(c.softcap, 1.0))
    o, lse = _run(torch, q, k, v, causal=c.causal, scale=c.scale, window=c.window, softcap=c.softcap)
    ref_o, ref_lse = _reference(torch, q, k, v, c.causal, c.window, c.softcap, c.scale)
    _check(torch, o, lse, ref_o, ref_lse, c.dtype)
    if c.softcap:  # the inputs are such that ignoring the cap would fail the check
        plain, _ = _reference(torch, q, k, v, c.causal, c.window, None, c.scale)
        assert float((plain - ref_o).norm() / ref_o.norm()) > 5 * TOLERANCE[c.dtype]


def test_causal_is_bottom_right_not_torch_top_left():
    """With Nq != Nkv autosoft's causal equals SDPA with the bottom-right boolean mask, not SDPA's
    is_causal=True (top-left)."""
    torch = pytest.importorskip("torch")

    q, k, v = _inputs(torch, 2, 4, 4, 64, 1000, 128, "float16", seed=1)
    o, lse = _run(torch, q, k, v, causal=True)
    ref_o, ref_lse = _reference(torch, q, k, v, causal=True)
    _check(torch, o, lse, ref_o, ref_lse, "float16")
    mask = torch.ones(64, 1000, dtype=torch.bool, device="cuda").tril(1000 - 64)
    assert torch.equal(mask, _visible(torch, 64, 1000, True, None, "cuda"))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bottom_right = sdpa(q.float(), k.float(), v.float(), attn_mask=mask)
    top_left = sdpa(q.float(), k.float(), v.float(), is_causal=True)
    assert float((o.float() - bottom_right).norm() / bottom_right.norm()) < TOLERANCE["float16"]
    assert float((o.float() - top_left).norm() / top_left.norm()) > 0.1


# --- layouts: strided views, cache slices --------------------------------------------------------

def _same_bits(torch, got, want, what: str) -> None:
    assert torch.equal(got[0], want[0]), f"{what}: o differs from the contiguous inputs' o"
    assert torch.equal(got[1], want[1]), f"{what}: lse differs from the contiguous inputs' lse"


def test_fused_qkv_views_give_the_contiguous_inputs_bits():
    """q, k, v as transposed views of a fused (B, N, 3, H, D) projection, and of a (B, N, H, 3D)
    one (q = qkv[..., :D]): taken as they are, the same bits as contiguous copies, and right."""
    torch = pytest.importorskip("torch")

    b, n, h, d = 2, 1000, 2, 64
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(b, n, 3, h, d, device="cuda", generator=gen).to(torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous() and q.shape == (b, h, n, d)
    got = _run(torch, q, k, v, causal=True)
    want = _run(torch, q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _same_bits(torch, got, want, "(B, N, 3, H, D) views")
    _check(torch, *got, *_reference(torch, q, k, v, causal=True), "bfloat16")

    packed = torch.randn(b, n, h, 3 * d, device="cuda", generator=gen).to(torch.bfloat16)
    q, k, v = (packed[..., i * d:(i + 1) * d].transpose(1, 2) for i in range(3))
    assert q.stride() == (n * h * 3 * d, 3 * d, h * 3 * d, 1)
    got = _run(torch, q, k, v, causal=True)
    want = _run(torch, q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _same_bits(torch, got, want, "(B, N, H, 3D) views")
    _check(torch, *got, *_reference(torch, q, k, v, causal=True), "bfloat16")


def test_grouped_views_and_cache_slices_give_the_contiguous_inputs_bits():
    """Grouped heads: q a view of (B, N, Hq, D), k and v of a fused (B, N, 2, Hkv, D); k and v
    slices of longer caches, (B, Hkv, Nmax, D)[:, :, :Nkv] and (B, Nmax, Hkv, D)[:, :Nkv]
    transposed; a last dim not 16-byte aligned (copied first): all the contiguous inputs' bits."""
    torch = pytest.importorskip("torch")

    b, hq, hkv, nq, nkv, d = 2, 8, 2, 7, 1000, 128
    gen = torch.Generator(device="cuda").manual_seed(6)
    bf16 = torch.bfloat16

    q = torch.randn(b, nq, hq, d, device="cuda", generator=gen).to(bf16).transpose(1, 2)
    kv = torch.randn(b, nkv, 2, hkv, d, device="cuda", generator=gen).to(bf16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    want = _run(torch, q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    _check(torch, *want, *_reference(torch, q, k, v, causal=True), "bfloat16")
    _same_bits(torch, _run(torch, q, k, v, causal=True), want, "(B, N, H, D) and (B, N, 2, Hkv, D) views")

    k_cache = torch.zeros(b, hkv, 4096, d, device="cuda", dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :, :nkv], v_cache[:, :, :nkv] = k, v
    _same_bits(torch, _run(torch, q, k_cache[:, :, :nkv], v_cache[:, :, :nkv], causal=True), want,
               "(B, Hkv, Nmax, D)[:, :, :Nkv] slices")

    k_cache = torch.zeros(b, 2048, hkv, d, device="cuda", dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, :nkv], v_cache[:, :nkv] = k.transpose(1, 2), v.transpose(1, 2)
    _same_bits(torch, _run(torch, q, k_cache[:, :nkv].transpose(1, 2), v_cache[:, :nkv].transpose(1, 2),
                           causal=True), want, "(B, Nmax, Hkv, D)[:, :Nkv] slices, transposed")

    odd = torch.zeros(b, hkv, nkv, d + 1, device="cuda", dtype=bf16)  # address and strides off 16 bytes
    odd[..., 1:] = k
    _same_bits(torch, _run(torch, q, odd[..., 1:], v, causal=True), want, "a misaligned k (copied first)")


def test_decode_with_a_cache_slice_in_bshd_layout():
    """Decoding against a (B, Nmax, Hkv, D) cache filled to Nkv: the issue's decode shape."""
    torch = pytest.importorskip("torch")

    b, hq, hkv, nkv, d = 4, 32, 8, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(b, hq, 1, d, device="cuda", generator=gen).to(torch.bfloat16)
    k_cache, v_cache = (torch.randn(b, 8192, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
                        for _ in range(2))
    k, v = k_cache[:, :nkv].transpose(1, 2), v_cache[:, :nkv].transpose(1, 2)
    got = _run(torch, q, k, v)
    _same_bits(torch, got, _run(torch, q, k.contiguous(), v.contiguous()), "decode cache slice")
    _check(torch, *got, *_reference(torch, q, k, v), "bfloat16")


def test_one_shape_called_with_different_strides_is_right_each_time():
    """The call's plan is kept per shape and dtype; strides are passed per call. A shape seen
    first with strided views, then contiguous, then other strides: every call right, and the same
    bits each time."""
    torch = pytest.importorskip("torch")

    b, hq, hkv, nq, nkv, d = 3, 8, 2, 7, 1000, 128  # the same kernel as a case above, a new plan
    gen = torch.Generator(device="cuda").manual_seed(8)
    bf16 = torch.bfloat16
    q_big = torch.randn(b, nq, hq, 2 * d, device="cuda", generator=gen).to(bf16)
    k_big, v_big = (torch.randn(b, hkv, 3000, d, device="cuda", generator=gen).to(bf16) for _ in range(2))
    layouts = [
        ("strided first", q_big[..., :d].transpose(1, 2), k_big[:, :, :nkv], v_big[:, :, 1000:1000 + nkv]),
    ]
    q0, k0, v0 = layouts[0][1:]
    layouts.append(("contiguous", q0.contiguous(), k0.contiguous(), v0.contiguous()))
    k_bshd = k0.transpose(1, 2).contiguous()  # (B, Nkv, Hkv, D)
    v_wide = torch.zeros(b, hkv, nkv, 3 * d, device="cuda", dtype=bf16)
    v_wide[..., d:2 * d] = v0
    layouts.append(("other strides", q0.contiguous(), k_bshd.transpose(1, 2), v_wide[..., d:2 * d]))
    ref = _reference(torch, q0, k0, v0, causal=True)
    results = []
    for what, q, k, v in layouts:
        assert q.shape == (b, hq, nq, d) and k.shape == v.shape == (b, hkv, nkv, d), what
        got = _run(torch, q, k, v, causal=True)
        _check(torch, *got, *ref, "bfloat16")
        results.append((what, got))
    for what, got in results[1:]:
        _same_bits(torch, got, results[0][1], what)


def test_cupy_float16_arrays_give_torch_s_bits():
    """CuPy float16 arrays (the same memory through DLPack) give CuPy results with the bits of
    the torch call."""
    torch = pytest.importorskip("torch")
    cp = pytest.importorskip("cupy")
    import autosoft

    q, k, v = _inputs(torch, 1, 4, 1, 1000, 3333, 64, "float16", seed=9)  # a kernel of a case above
    want = _run(torch, q, k, v, causal=True)
    torch.cuda.synchronize()
    qc, kc, vc = (cp.from_dlpack(t) for t in (q, k, v))
    o, lse = autosoft.attention(qc, kc, vc, causal=True, return_lse=True)
    assert isinstance(o, cp.ndarray) and o.dtype == cp.float16 and o.shape == q.shape and lse.shape == q.shape[:3]
    cp.cuda.runtime.deviceSynchronize()
    _same_bits(torch, (torch.from_dlpack(o), torch.from_dlpack(lse)), want, "CuPy arrays")
    _check(torch, *want, *_reference(torch, q, k, v, causal=True), "float16")


# --- sampled variants of the search space on some of these problems -------------------------------

# (shape B,H,N,D, dtype, options): grouped with a cache, rows with no key, a window, softcap, D 96, D 256
SAMPLED = [
    ("2,8,7,128", "bfloat16", {"kv_heads": 2, "kv_len": 1000, "causal": True}),
    ("2,8,1000,64", "float16", {"kv_heads": 8, "kv_len": 64, "causal": True}),
    ("1,4,1000,64", "bfloat16", {"kv_len": 3333, "causal": True, "window_left": 100}),
    ("1,8,100,64", "float16", {"kv_heads": 4, "kv_len": 777, "softcap": 50.0, "causal": True}),
    ("1,32,1,96", "float16", {"kv_heads": 8, "kv_len": 4096}),
    ("1,4,500,256", "bfloat16", {"kv_heads": 1, "causal": True}),
]


@pytest.mark.parametrize("shape, dtype, options", SAMPLED,
                         ids=[f"{s.replace(',', 'x')}-{d}-" + "-".join(f"{k}={v}" for k, v in o.items())
                              for s, d, o in SAMPLED])
def test_sampled_variants_are_correct(shape, dtype, options):
    """The default, its first seed and two sampled points, each verified on every input kind
    (strided views included) against the family's float64 reference."""
    from autosoft.families import get_family
    from autosoft.runtime import device_info
    from autosoft.testing.conformance import sample_points

    family = get_family("attention")
    target = device_info().target
    problem = family.problem(shape, dtype, options)
    points = sample_points(family, problem, target, 2, seed=len(shape) + len(options), seeds=1)
    failures = _wrong_points(family, problem, target, points, seeds=(3,))
    assert not failures, "\n".join(failures)


def _wrong_points(family, problem, target, points, seeds) -> list[str]:
    """Compile the points' variants together and verify each once per seed: the failures, described."""
    from autosoft.evaluate import verify
    from autosoft.families.base import build_variant

    failures = []
    for loaded in loaded_variants([build_variant(family, problem, p, target) for p in points]):
        for seed in seeds:
            wrong = verify(family, loaded, seed=seed)
            if wrong:
                failures.append(f"{loaded.variant.name}, seed {seed}: {wrong}")
    return failures


CLUSTER_MERGED = [
    ("1,32,1,128", "bfloat16", {"kv_heads": 8, "kv_len": 4096}),
    ("2,8,7,64", "float16", {"kv_heads": 2, "kv_len": 1000, "causal": True}),
    ("1,32,1,96", "float16", {"kv_heads": 8, "kv_len": 3333}),
    ("1,4,3,256", "bfloat16", {"kv_heads": 1, "kv_len": 5000, "window_left": 100, "softcap": 30.0}),
]


@pytest.mark.parametrize("shape, dtype, options", CLUSTER_MERGED,
                         ids=[f"{s.replace(',', 'x')}-{d}" for s, d, _ in CLUSTER_MERGED])
def test_splits_merged_in_a_cluster_are_correct(shape, dtype, options):
    """Decoding with the key splits of each query tile merged inside a thread-block cluster (the
    default's tiles at its split count, 16, 8 and 4 where valid: distributed shared memory), on
    every input kind, launched twice (a cluster variant keeps nothing between launches)."""
    from autosoft.families import get_family
    from autosoft.runtime import device_info

    family = get_family("attention")
    target = device_info().target
    if target.arch != "90":
        pytest.skip("thread-block clusters of this kernel are built for sm_90")
    problem = family.problem(shape, dtype, options)
    default = family.default_params(problem, target)
    counts = dict.fromkeys((default["splits"], 16, 8, 4))  # in order, once each
    points = [p for p in ({**default, "splits": n, "merge": "cluster"} for n in counts)
              if family.is_valid(problem, target, p)]
    assert points
    failures = _wrong_points(family, problem, target, points, seeds=(5, 6))
    assert not failures, "\n".join(failures)


def test_no_key_gives_zero_and_minus_infinity_and_no_query_zero_key_gradients():
    """Empty inputs launch nothing: attention over no key gives o = 0 and lse = -inf (as a row that
    sees no key does); the backward of a call with no query gives dk = dv = 0, through autograd."""
    torch = pytest.importorskip("torch")
    import autosoft

    q = torch.randn(1, 2, 4, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.float16)
    o, lse = autosoft.attention(q, kv, kv, return_lse=True)
    assert o.shape == q.shape and not o.any()
    assert torch.isneginf(lse).all()
    q = torch.randn(1, 2, 0, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    k, v = (torch.randn(1, 2, 6, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(2))
    autosoft.attention(q, k, v).sum().backward()
    assert k.grad is not None and not k.grad.any() and not v.grad.any()
