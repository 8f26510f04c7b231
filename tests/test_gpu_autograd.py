"""GPU tier: gradients through autosoft.softmax and autosoft.log_softmax (the torch operators of
autosoft.torch_ops, differentiated by the softmax_backward family) against torch's in float64,
on the softmax sweep's shapes, dims 0, 1 and -1 of 3-D inputs, rows with -inf; and a compiled
model's outputs and gradients against eager.

autosoft.attention's gradients (its operator's backward, the attention_backward family) against
torch autograd of an explicit float32 attention with masks; a compiled training step, a CUDA
graph of forward and backward, and torch's deterministic flag."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import autosoft  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from softmax import SWEEP  # noqa: E402

# |dx - ref| <= ATOL * max|dy| * (1 + max|y| of softmax, or 1 for the log-softmax) + RTOL * |ref|
TOL = {torch.float32: (2e-6, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 3e-2)}


def _reference(x, dy, dim, log):
    x64 = x.detach().double().requires_grad_()
    y64 = (torch.log_softmax if log else torch.softmax)(x64, dim=dim)
    (dx64,) = torch.autograd.grad(y64, x64, dy.double())
    return y64.detach(), dx64


def _assert_gradient(x, dim, log, seed):
    torch.manual_seed(seed)
    x = x.detach().requires_grad_()
    y = (autosoft.log_softmax if log else autosoft.softmax)(x, dim=dim)
    assert y.grad_fn is not None, "autosoft's output carries no gradient"
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    y64, ref = _reference(x, dy, dim, log)
    atol, rtol = TOL[x.dtype]
    scale = dy.double().abs().amax() * (1.0 if log else 1.0 + y64.abs().amax())
    allowed = atol * scale + rtol * ref.abs()
    if log:
        # dx = dy - e^y sum(dy): the sum over a line, rounded in float32, errs by up to a few ulps of
        # sum|dy| (8192 terms: ~1e-4 where e^y is near 1, against atol*scale ~1e-5 in float32)
        allowed = allowed + y64.exp() * dy.double().abs().sum(dim=dim, keepdim=True) * 2.0 ** -22
    err = (dx.double() - ref).abs()
    bad = ~(err <= allowed)
    assert not bad.any(), (f"{int(bad.sum())} of {dx.numel()} off; worst {float(err.max())} "
                           f"(allowed {float(atol * scale)} + {rtol}|ref|)")


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gradients_along_each_dim_of_a_3d_input_match_torch(dim, dtype, log):
    torch.manual_seed(dim)  # the same inputs each run
    x = (torch.randn(6, 33, 1000, device="cuda") * 3).to(dtype)
    x[0, 1, ::3] = float("-inf")  # -inf entries: softmax 0 and no gradient there (log: dx = dy)
    x[2, :20, 7] = float("-inf")  # no whole line along any dim: those give NaN, as in torch
    _assert_gradient(x, dim, log, seed=dim + 10)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape", SWEEP, ids=lambda s: f"{s[0]}x{s[1]}")
def test_gradients_on_the_sweep_shapes_match_torch(shape, log):
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(shape[0])  # the same inputs each run
        _assert_gradient(torch.randn(shape, device="cuda").to(dtype) * 4, -1, log, seed=shape[1])


def test_a_compiled_model_gives_eager_outputs_and_gradients():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(256, 512, device="cuda")

        def forward(self, x):
            h = self.proj(x)
            return autosoft.softmax(h, dim=-1) * 2 + autosoft.log_softmax(h, dim=0)

    model = Model()
    compiled = torch.compile(model, fullgraph=True)
    for _ in range(2):  # the second call runs the compiled graph on new data
        x = torch.randn(64, 256, device="cuda")
        out_eager = model(x)
        grads_eager = torch.autograd.grad(out_eager.sum(), list(model.parameters()))
        out_compiled = compiled(x)
        grads_compiled = torch.autograd.grad(out_compiled.sum(), list(model.parameters()))
        torch.testing.assert_close(out_compiled, out_eager, atol=1e-5, rtol=1e-5)
        for a, b in zip(grads_compiled, grads_eager):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    explained = torch._dynamo.explain(model)(torch.randn(64, 256, device="cuda"))
    assert explained.graph_break_count == 0


# --- attention ----------------------------------------------------------------------------------

def _attention_reference(q, k, v, causal=False, scale=None, window=None, softcap=None):
    """(o, lse) of explicit float32 attention with masks, differentiable by torch: k and v repeated
    over each KV head's query heads, query i at key position i + Nkv - Nq (bottom-right)."""
    n, kv_len, d = q.shape[2], k.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    k, v = (t.float().repeat_interleave(group, dim=1) for t in (k, v))
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    at = torch.arange(n, device=q.device)[:, None] + (kv_len - n)
    keys = torch.arange(kv_len, device=q.device)[None, :]
    hidden = torch.zeros(n, kv_len, dtype=torch.bool, device=q.device)
    if causal:
        hidden |= keys > at
    if window is not None and window[0] is not None:
        hidden |= keys < at - window[0]
    if window is not None and window[1] is not None:
        hidden |= keys > at + window[1]
    s = s.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.softmax(s, dim=-1), v), lse


def _relative(got, ref):
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _qkv(shape, kv_heads, kv_len=None, dtype=torch.bfloat16, seed=0):
    b, h, n, d = shape
    generator = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, n, d, device="cuda", generator=generator).to(dtype)
    k, v = (torch.randn(b, kv_heads, kv_len or n, d, device="cuda", generator=generator).to(dtype) for _ in range(2))
    return q, k, v


ATTENTION_CASES = [  # (q shape, kv heads, kv len, options): GQA 8/2, N off every tile size
    ((2, 8, 777, 128), 2, None, {"causal": False}),
    ((2, 8, 777, 128), 2, None, {"causal": True}),
    ((2, 8, 777, 64), 2, None, {"causal": False, "window": (200, 50), "softcap": 30.0}),
    ((1, 8, 300, 128), 2, 777, {"causal": True}),  # Nq < Nkv: bottom-right
]


@pytest.mark.parametrize("use_lse", [False, True], ids=["o", "o_and_lse"])
@pytest.mark.parametrize("shape, kv_heads, kv_len, options", ATTENTION_CASES,
                         ids=["full", "causal", "window_softcap", "nq_lt_nkv"])
def test_attention_gradients_match_torch_autograd_of_an_explicit_attention(shape, kv_heads, kv_len, options,
                                                                            use_lse):
    """dq, dk, dv (and with a loss that reads lse too, the dlse path) within 3e-2 relative L2 of
    float32 autograd on the same bf16 inputs."""
    q, k, v = _qkv(shape, kv_heads, kv_len, seed=len(options) + use_lse)
    do = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dlse = torch.randn(shape[:3], device="cuda")

    def loss(o, lse):
        return (o.float() * do.float()).sum() + ((lse * dlse).sum() if use_lse else 0.0)

    leaves = _leaves(q, k, v)
    o, lse = autosoft.attention(*leaves, return_lse=True, **options)
    assert o.grad_fn is not None and lse.grad_fn is not None
    grads = torch.autograd.grad(loss(o, lse), leaves)
    ref_leaves = _leaves(q, k, v)
    o_ref, lse_ref = _attention_reference(*ref_leaves, **options)
    refs = torch.autograd.grad(loss(o_ref, lse_ref), ref_leaves)
    assert _relative(o, o_ref) < 2e-2
    for name, got, ref, leaf in zip(("dq", "dk", "dv"), grads, refs, leaves):
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, name
        assert not got.isnan().any(), name
        assert _relative(got, ref) < 3e-2, f"{name}: relative L2 {_relative(got, ref):.3g}"


class _AttentionBlock(torch.nn.Module):
    """q, k, v projections (GQA 8/2), autosoft.attention, an output projection."""

    def __init__(self, width=256, heads=8, kv_heads=2, head_dim=64):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = torch.nn.Linear(width, heads * head_dim, device="cuda")
        self.kv = torch.nn.Linear(width, 2 * kv_heads * head_dim, device="cuda")
        self.out = torch.nn.Linear(heads * head_dim, width, device="cuda")

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_dim).transpose(1, 2).to(torch.bfloat16)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).to(torch.bfloat16)
        o = autosoft.attention(q, k, v, causal=True)
        return self.out(o.transpose(1, 2).reshape(b, n, -1).float())


def test_a_compiled_training_step_gives_eager_gradients():
    torch.manual_seed(0)
    model = _AttentionBlock()
    compiled = torch.compile(model, fullgraph=True)
    for n in (333, 333):  # the second call runs the compiled graph on new data
        x = torch.randn(2, n, 256, device="cuda")
        eager = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
        got = torch.autograd.grad(compiled(x).square().mean(), list(model.parameters()))
        for (name, _), a, b in zip(model.named_parameters(), got, eager):
            assert _relative(a, b) < 1e-3, f"{name}: relative L2 {_relative(a, b):.3g}"
    explained = torch._dynamo.explain(model)(torch.randn(2, 333, 256, device="cuda"))
    assert explained.graph_break_count == 0


def test_forward_and_backward_replay_in_a_cuda_graph():
    """Captured as torch documents for whole networks: warm up on a side stream, grads None before
    the capture, new data copied into the static inputs, then replay; against eager on that data."""
    shape, kv_heads = (1, 8, 777, 128), 2
    static = _leaves(*_qkv(shape, kv_heads, seed=1))
    static_do = torch.randn(shape, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            for t in static:
                t.grad = None
            autosoft.attention(*static, causal=True).backward(static_do)
    torch.cuda.current_stream().wait_stream(side)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_o = autosoft.attention(*static, causal=True)
        static_o.backward(static_do)
    for seed in (2, 3):
        fresh, do = _qkv(shape, kv_heads, seed=seed), torch.randn(shape, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            for t, new in zip(static, fresh):
                t.copy_(new)
            static_do.copy_(do)
        graph.replay()
        leaves = _leaves(*fresh)
        o = autosoft.attention(*leaves, causal=True)
        o.backward(do)
        assert torch.equal(static_o, o)
        for name, t, leaf in zip(("dq", "dk", "dv"), static, leaves):
            assert _relative(t.grad, leaf.grad) < 1e-3, f"{name}: relative L2 {_relative(t.grad, leaf.grad):.3g}"


def test_deterministic_algorithms_give_bit_identical_dq():
    shape, kv_heads = (2, 8, 2048, 128), 2
    q, k, v = _qkv(shape, kv_heads, seed=4)
    do = torch.randn(shape, device="cuda").to(torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        runs = []
        for _ in range(2):
            leaves = _leaves(q, k, v)
            autosoft.attention(*leaves, causal=True).backward(do)
            runs.append([t.grad for t in leaves])
    finally:
        torch.use_deterministic_algorithms(before)
    for name, first, second in zip(("dq", "dk", "dv"), *runs):
        assert torch.equal(first, second), f"{name} differs between two deterministic backward passes"
    leaves = _leaves(q, k, v)  # the default (atomic) dq agrees with the deterministic one
    autosoft.attention(*leaves, causal=True).backward(do)
    assert _relative(leaves[0].grad, runs[0][0]) < 1e-2
