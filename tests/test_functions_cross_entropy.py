"""autosoft.cross_entropy and autosoft.linear_cross_entropy (autosoft/functions/cross_entropy.py) on
the CPU tier: argument errors (which all show before any GPU is touched), the chunk size, the
reductions, in-place gradients, chunking and autograd around the family's float64 `reference`
standing in for the kernel launch, and torch.compile tracing one operator with its backward."""
from __future__ import annotations

import re

import numpy as np
import pytest

from autosoft.families.cross_entropy import reference
from autosoft.functions.cross_entropy import default_chunk

def test_cross_entropy_argument_errors_are_one_line():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(4, 10)
    t = torch.zeros(4, dtype=torch.int64)
    cases = [
        ((np.zeros((4, 10)), t), {}, TypeError, "logits must be a CUDA torch tensor"),
        ((x, [0, 1, 2, 3]), {}, TypeError, "target must be a torch tensor"),
        ((x.to(torch.int32), t), {}, TypeError, "unsupported logits dtype"),
        ((x, t.float()), {}, TypeError, "int64 or int32"),
        ((x, t), {"ignore_index": 1.5}, TypeError, "ignore_index must be an int"),
        ((x, t), {"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ((x, t), {"z_loss": -1.0}, ValueError, "z_loss must be finite"),
        ((x, t), {"reduction": "avg"}, ValueError, "reduction must be one of"),
        ((x, t[:3]), {}, ValueError, "must have the shape of logits"),
        ((x, t), {"inplace_backward": 1}, TypeError, "inplace_backward must be True or False"),
        ((x[:0], t[:0]), {}, ValueError, "is empty"),
        ((x, t), {}, TypeError, r"logits is a CPU tensor; move it to the GPU first \(logits.cuda\(\)\)"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as info:
            autosoft.cross_entropy(*args, **kwargs)
        assert "\n" not in str(info.value)


def test_linear_cross_entropy_argument_errors_are_one_line():
    torch = pytest.importorskip("torch")
    import autosoft

    h = torch.randn(6, 8)
    w = torch.randn(20, 8)
    t = torch.zeros(6, dtype=torch.int64)
    cases = [
        ((h.numpy(), w, t), {}, TypeError, "hidden and weight must be CUDA torch tensors"),
        ((h, w[:, :7], t), {}, ValueError, "do not fit"),
        ((h, w.half(), t), {}, TypeError, "must share one dtype"),
        ((h, w, t), {"bias": torch.zeros(19)}, ValueError, r"bias must be a tensor of shape \(20,\)"),
        ((h, w, t[:5]), {}, ValueError, r"target must be a tensor of shape \(6,\)"),
        ((h, w, t), {"reduction": "none"}, ValueError, "reduction must be one of 'mean', 'sum'"),
        ((h, w, t), {"chunk_size": 0}, ValueError, "chunk_size must be a positive int"),
        ((h, w, t), {"label_smoothing": -0.1}, ValueError, "label_smoothing"),
        ((h, w, t), {}, TypeError, "hidden is a CPU tensor"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message) as info:
            autosoft.linear_cross_entropy(*args, **kwargs)
        assert "\n" not in str(info.value)


def test_default_chunk_is_ligers_and_bounds_a_chunks_logits():
    """Liger's choice for the issue's rows: 8192 and 32768 tokens, hidden 4096, vocab 128256
    (ceil(V/H) = 32) and 151936 (38)."""
    assert default_chunk(8192, 128256, 4096) == 256 and default_chunk(32768, 128256, 4096) == 1024
    assert default_chunk(8192, 151936, 4096) == 256 and default_chunk(32768, 151936, 4096) == 1024
    assert default_chunk(100, 128256, 4096) == 4 and default_chunk(3, 10, 4096) == 3
    for tokens, vocab, hidden in ((32768, 151936, 4096), (8192, 50257, 2048), (65536, 32000, 8192)):
        chunk = default_chunk(tokens, vocab, hidden)
        assert chunk & (chunk - 1) == 0 and chunk * vocab < 2 * tokens * hidden  # logits < 2x the hidden states


# --- the public functions' Python, on the CPU ----------------------------------------------------

@pytest.fixture
def kernel_on_the_cpu(monkeypatch):
    """autosoft.cross_entropy's Python around a stand-in for the kernel launch: `reference` in
    float64 on CPU tensors, writing over the logits where asked (devices left unchecked)."""
    torch = pytest.importorskip("torch")
    import autosoft.functions.cross_entropy as module

    launches = []

    def forward(logits2d, target1d, scale, ignore_index, eps, z, inplace, loss_only=False):
        assert logits2d.is_contiguous() and logits2d.dim() == 2 and target1d.dim() == 1
        loss, lse, grad = reference(logits2d.double().numpy(), target1d.long().numpy(), ignore_index, eps, z,
                                    float(scale))
        grad = None if loss_only else torch.from_numpy(grad).to(logits2d.dtype)
        if inplace and not loss_only:
            logits2d.data.copy_(grad)  # as the kernel writes: no autograd version bump
            grad = logits2d
        launches.append((tuple(logits2d.shape), "loss_only" if loss_only else inplace))
        return torch.from_numpy(loss).float(), torch.from_numpy(lse).float(), grad

    def scale_unless_one(x, factor):  # the GPU's kernel, on the CPU: in float32, untouched by a factor of 1
        assert factor.dtype == torch.float32 and factor.shape == (1,) and x.is_contiguous()
        if float(factor) != 1.0:
            x.data.copy_((x.float() * factor).to(x.dtype))
        return x

    def mean_scale(target, ignore_index):  # the GPU's kernels, on the CPU, as they compute
        assert target.is_contiguous() and target.dtype in (torch.int64, torch.int32)
        return (1.0 / (target != ignore_index).sum().to(torch.float32)).reshape(1)

    def scaled_sum(loss, scale):
        assert loss.dtype == torch.float32 and scale.dtype == torch.float32 and scale.shape == (1,)
        return (loss.sum() * scale[0]).reshape(())

    monkeypatch.setattr(module, "_forward", forward)
    monkeypatch.setattr(module, "_scale_unless_one", scale_unless_one)
    monkeypatch.setattr(module, "_mean_scale", mean_scale)
    monkeypatch.setattr(module, "_scaled_sum", scaled_sum)
    monkeypatch.setattr(module, "_check_devices", lambda who, named: None)
    return launches


def _composition(torch, logits, target, ignore_index, eps, z, reduction):
    x = logits.detach().double().requires_grad_()
    per_row = torch.nn.functional.cross_entropy(x.reshape(-1, x.shape[-1]), target.reshape(-1).long(),
                                                ignore_index=ignore_index, label_smoothing=eps, reduction="none")
    kept = target.reshape(-1) != ignore_index
    per_row = per_row + z * torch.where(kept, torch.logsumexp(x.reshape(-1, x.shape[-1]), -1) ** 2, 0)
    loss = {"mean": per_row.sum() / kept.sum(), "sum": per_row.sum(), "none": per_row.reshape(target.shape)}[reduction]
    return loss, x


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_python_reduces_and_backpropagates(kernel_on_the_cpu, reduction):
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 33, generator=gen).requires_grad_()
    target = torch.randint(0, 33, (2, 5), generator=gen, dtype=torch.int32)
    target[0, 1] = 4
    weight = torch.rand(2, 5, generator=gen) if reduction == "none" else torch.tensor(2.5)
    loss = autosoft.cross_entropy(logits, target, ignore_index=4, label_smoothing=0.1, z_loss=1e-3,
                                  reduction=reduction)
    (loss * weight).sum().backward()
    expected, x = _composition(torch, logits, target, 4, 0.1, 1e-3, reduction)
    (expected * weight.double()).sum().backward()
    assert loss.shape == expected.shape and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
        again, lse = autosoft.cross_entropy(logits, target, ignore_index=4, label_smoothing=0.1, z_loss=1e-3,
                                            reduction=reduction, return_lse=True)
    assert kernel_on_the_cpu[-1] == ((10, 33), "loss_only")  # no gradient written without autograd
    torch.testing.assert_close(again, loss.detach())
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits.detach().double(), -1))


def test_cross_entropy_python_in_place_and_copies(kernel_on_the_cpu):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = torch.randn(6, 40).requires_grad_()
    kept = logits.detach().clone()
    target = torch.randint(0, 40, (6,))
    autosoft.cross_entropy(logits, target, inplace_backward=True).backward()
    assert kernel_on_the_cpu[-1] == ((6, 40), True)
    assert not torch.equal(logits.detach(), kept)  # the logits' memory took the gradient
    loss64, x = _composition(torch, kept, target, -100, 0.0, 0.0, "mean")
    loss64.backward()
    torch.testing.assert_close(logits.grad.double(), x.grad, rtol=1e-6, atol=1e-7)
    wide = torch.randn(6, 50)[:, 5:45].requires_grad_()  # not contiguous: copied, the copy takes the gradient
    before = wide.detach().clone()
    autosoft.cross_entropy(wide, target).backward()
    assert kernel_on_the_cpu[-1] == ((6, 40), True) and torch.equal(wide.detach(), before)
    assert wide.grad.shape == (6, 40)


@pytest.mark.parametrize("bias,chunk", [(False, None), (True, 7), (True, 1)])
def test_linear_cross_entropy_python_chunks_and_gradients(kernel_on_the_cpu, bias, chunk):
    torch = pytest.importorskip("torch")
    import autosoft

    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, 10, 8, generator=gen).requires_grad_()
    w = torch.randn(21, 8, generator=gen).requires_grad_()
    b = torch.randn(21, generator=gen).requires_grad_() if bias else None
    target = torch.randint(0, 21, (3, 10), generator=gen)
    target[1, ::3] = -100
    loss = autosoft.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.05, z_loss=1e-3,
                                         chunk_size=chunk)
    (loss * 3).backward()
    sizes = [shape[0] for shape, inplace in kernel_on_the_cpu]
    assert all(inplace for _, inplace in kernel_on_the_cpu)
    step = default_chunk(30, 21, 8) if chunk is None else chunk  # 16: ceil(21 / 8) = 3, 30 / 3 -> 16
    assert sizes == [min(step, 30 - s) for s in range(0, 30, step)]
    h2, w2 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b2 = b.detach().double().requires_grad_() if bias else None
    logits = h2 @ w2.t() + (b2 if bias else 0)
    per_row = torch.nn.functional.cross_entropy(logits.reshape(-1, 21), target.reshape(-1), label_smoothing=0.05,
                                                reduction="none")
    kept = target.reshape(-1) != -100
    per_row = per_row + 1e-3 * torch.where(kept, torch.logsumexp(logits.reshape(-1, 21), -1) ** 2, 0)
    expected = per_row.sum() / kept.sum()
    (expected * 3).backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    for got, want in ((h.grad, h2.grad), (w.grad, w2.grad)) + (((b.grad, b2.grad),) if bias else ()):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(autosoft.linear_cross_entropy(h, w, target, bias=b, label_smoothing=0.05,
                                                                 z_loss=1e-3, chunk_size=chunk), loss.detach())
    assert kernel_on_the_cpu[-1][1] == "loss_only"


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_traces_one_operator_with_its_backward(no_kernels, reduction):
    """Under torch.compile (fullgraph: no graph break) autosoft.cross_entropy is the operator
    torch.ops.autosoft.cross_entropy, whose declared backward AOTAutograd traces (meta tensors:
    the fake implementation gives the shapes and dtypes; no kernel runs)."""
    torch = pytest.importorskip("torch")
    import autosoft

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    logits = torch.empty(2, 6, 50, device="meta", dtype=torch.bfloat16).requires_grad_()
    target = torch.empty(2, 6, device="meta", dtype=torch.int32)
    compiled = torch.compile(lambda x, t: autosoft.cross_entropy(x, t, label_smoothing=0.1, reduction=reduction),
                             backend=backend, fullgraph=True)
    loss = compiled(logits, target)
    assert (loss.shape, loss.dtype) == ((2, 6) if reduction == "none" else (), torch.float32)
    loss.sum().backward()
    assert (logits.grad.shape, logits.grad.dtype) == ((2, 6, 50), torch.bfloat16)
    targets = [str(n.target) for n in graphs[0].graph.nodes if "autosoft" in str(n.target)]
    assert targets == ["autosoft.cross_entropy"]  # the operator Dynamo saw called
    torch._dynamo.reset()


def test_the_operators_declared_backward_weights_each_rows_gradient(monkeypatch):
    """torch.ops.autosoft.cross_entropy's autograd: the kernel's gradient (scale times each row's)
    times the incoming gradient of each row's loss over the scale; lse carries none. The kernel is
    `reference` in float64 behind the array layer (CPU tensors)."""
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops as torch_ops

    def kernel(name, arrays, options=None, scalars=None, who=None):
        assert name == "cross_entropy" and options == {"int32_target": True}
        x, t, scale = arrays
        loss, lse, grad = reference(x.detach().double().reshape(-1, x.shape[-1]).numpy(), t.reshape(-1).long().numpy(),
                                    int(scalars["ignore_index"]), float(scalars["label_smoothing"]),
                                    float(scalars["z_loss"]), float(scale[0]))
        return (torch.from_numpy(loss).float().reshape(t.shape), torch.from_numpy(lse).float().reshape(t.shape),
                torch.from_numpy(grad).to(x.dtype).reshape(x.shape))
    monkeypatch.setattr(torch_ops, "call_family", kernel)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 17, generator=gen, dtype=torch.float64).requires_grad_()
    target = torch.randint(0, 17, (3, 4), generator=gen, dtype=torch.int32)
    target[0, 1] = -100
    weight = torch.rand(3, 4, generator=gen, dtype=torch.float64)
    loss, lse, grad = torch.ops.autosoft.cross_entropy(logits, target, torch.tensor([0.25]), -100, 0.1, 1e-3)
    assert loss.grad_fn is not None and "cross_entropy" in type(loss.grad_fn).__name__
    (loss * weight).sum().backward()
    expected, x = _composition(torch, logits, target, -100, 0.1, 1e-3, "none")
    (expected * weight).sum().backward()
    torch.testing.assert_close(logits.grad, x.grad, rtol=1e-6, atol=1e-9)


def test_a_target_of_another_dtype_is_a_one_line_type_error_naming_it():
    torch = pytest.importorskip("torch")
    import autosoft
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    logits, scale = torch.empty(4, 10, device="meta"), torch.empty(1, device="meta")
    for target in (torch.empty(4, device="meta"), torch.empty(4, device="meta", dtype=torch.int16)):
        with pytest.raises(TypeError, match=rf"^autosoft\.cross_entropy: target must be int64 or int32, got "
                                            rf"{re.escape(str(target.dtype))}$"):
            torch.ops.autosoft.cross_entropy(logits, target, scale, -100, 0.0, 0.0)
        with pytest.raises(TypeError, match=r"^autosoft\.cross_entropy: target must hold int64 or int32"):
            autosoft.cross_entropy(logits, target)
    with pytest.raises(TypeError, match=r"^autosoft\.cross_entropy: scale must be float32, got torch\.float64$"):
        torch.ops.autosoft.cross_entropy(logits, torch.empty(4, device="meta", dtype=torch.int64),
                                         scale.double(), -100, 0.0, 0.0)


def test_every_row_ignored_gives_a_nan_mean_and_zero_gradients(kernel_on_the_cpu):
    torch = pytest.importorskip("torch")
    import autosoft

    logits = torch.randn(5, 30).requires_grad_()
    target = torch.full((5,), -100)
    loss = autosoft.cross_entropy(logits, target)
    loss.backward()
    assert torch.isnan(loss) and torch.isnan(torch.nn.functional.cross_entropy(logits, target))
    assert (logits.grad == 0).all()
    assert autosoft.cross_entropy(logits, target, reduction="sum") == 0


def test_the_operator_is_registered_with_its_schema():
    torch = pytest.importorskip("torch")
    import autosoft.torch_ops  # noqa: F401 - registers the operators

    assert str(torch.ops.autosoft.cross_entropy.default._schema) == (
        "autosoft::cross_entropy(Tensor logits, Tensor target, Tensor scale, int ignore_index, "
        "float label_smoothing, float z_loss) -> (Tensor loss, Tensor lse, Tensor grad)")
