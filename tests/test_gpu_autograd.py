"""GPU tier: gradients through autosoft.softmax and autosoft.log_softmax (the torch operators of
autosoft.torch_ops, differentiated by the softmax_backward family) against torch's in float64,
on the softmax sweep's shapes, dims 0, 1 and -1 of 3-D inputs, rows with -inf; and a compiled
model's outputs and gradients against eager."""
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


def test_attention_still_refuses_gradients():
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError, match="has no backward yet"):
        autosoft.attention(q, q.detach(), q.detach())
