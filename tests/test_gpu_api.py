"""The public functions through the array layer (arrays.call_family) on the GPU: torch and CuPy
in, the same kind out, plans reused across calls with new data, the caller's stream honoured,
views and misaligned bases copied or followed, and a row split with a workspace."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def fresh(cache_dir):
    from autosoft.dispatch import DISPATCHER

    DISPATCHER.forget()
    yield
    DISPATCHER.forget()


@pytest.mark.parametrize("shape", [(3, 5, 1000), (7,), (2, 65536), (4, 1, 257)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_softmax_of_torch_tensors_matches_torch_on_new_data_every_call(shape, dtype):
    torch = pytest.importorskip("torch")
    import autosoft

    tdtype = getattr(torch, dtype)
    for _ in range(3):  # the second and third calls take the prepared plan
        x = torch.randn(shape, device="cuda", dtype=torch.float32).to(tdtype) * 4
        y = autosoft.softmax(x)
        assert isinstance(y, torch.Tensor) and y.shape == x.shape and y.dtype == x.dtype
        torch.testing.assert_close(y.float(), torch.softmax(x.float(), dim=-1), atol=2e-3 if dtype != "float32" else 1e-6,
                                   rtol=1e-2 if dtype == "bfloat16" else 2e-3)


def test_softmax_of_views_and_misaligned_bases():
    torch = pytest.importorskip("torch")
    import autosoft

    base = torch.randn(64, 2050, device="cuda")
    for x in (base[:, 1:1025], base.t()[:100], base.view(-1)[3:3 + 33 * 1000].view(33, 1000)):
        torch.testing.assert_close(autosoft.softmax(x), torch.softmax(x, dim=-1))


def test_softmax_honours_the_callers_stream():
    torch = pytest.importorskip("torch")
    import autosoft

    x = torch.randn(4096, 4096, device="cuda")
    autosoft.softmax(x)  # prepared
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # keeps this stream busy: work on another stream would finish first
        x2 = torch.randn(4096, 4096, device="cuda")
        y = autosoft.softmax(x2)
    stream.synchronize()
    torch.testing.assert_close(y, torch.softmax(x2, dim=-1))


def test_softmax_of_few_wide_rows_splits_with_a_workspace():
    torch = pytest.importorskip("torch")
    import autosoft
    from autosoft.dispatch import DISPATCHER
    from autosoft.families import get_family

    x = torch.randn(8, 262144, device="cuda")
    torch.testing.assert_close(autosoft.softmax(x), torch.softmax(x, dim=-1))
    problem = get_family("softmax").problem("8x262144", "float32")
    assert DISPATCHER.choose(problem).variant.workspace_bytes > 0, "the default splits these rows"
    x = torch.randn(8, 262144, device="cuda")  # again: the workspace is reused
    torch.testing.assert_close(autosoft.softmax(x), torch.softmax(x, dim=-1))


def test_cupy_and_dlpack_inputs_give_cupy_arrays():
    torch = pytest.importorskip("torch")
    import cupy as cp

    import autosoft

    x = cp.random.standard_normal((100, 300), dtype=cp.float32)
    y = autosoft.softmax(x)
    assert isinstance(y, cp.ndarray)
    ref = cp.exp(x - x.max(axis=1, keepdims=True))
    cp.testing.assert_allclose(y, ref / ref.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)

    class Producer:  # a DLPack producer that is neither torch nor CuPy
        def __init__(self, t):
            self.t = t

        def __dlpack__(self, **kwargs):
            return self.t.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.t.__dlpack_device__()

    t = torch.randn(10, 77, device="cuda")
    out = autosoft.softmax(Producer(t))
    assert isinstance(out, cp.ndarray)
    torch.testing.assert_close(torch.from_dlpack(out), torch.softmax(t, dim=-1))


def test_attention_in_cupy_float16_and_mixed_inputs_refused():
    torch = pytest.importorskip("torch")
    import cupy as cp

    import autosoft

    q, k, v = (cp.random.standard_normal((1, 2, 100, 64), dtype=cp.float32).astype(cp.float16) for _ in range(3))
    o, lse = autosoft.attention(q, k, v, causal=True, return_lse=True)
    assert isinstance(o, cp.ndarray) and o.shape == q.shape and lse.shape == (1, 2, 100)
    tq, tk, tv = (torch.from_dlpack(a) for a in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(tq.float(), tk.float(), tv.float(), is_causal=True)
    assert ((torch.from_dlpack(o).float() - ref).norm() / ref.norm()).item() < 5e-3
    with pytest.raises(TypeError, match="one kind"):
        autosoft.attention(q, tk, v)
    with pytest.raises(ValueError, match="one shape"):
        autosoft.attention(q, k[:, :, :50], v)


def test_attention_records_gradients_and_attention_colsum_refuses_them():
    torch = pytest.importorskip("torch")
    import autosoft

    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    k.requires_grad_()
    assert autosoft.attention(q, k, v).grad_fn is not None  # its backward: tests/test_gpu_autograd.py
    with pytest.raises(RuntimeError, match="no backward"):
        autosoft.attention_colsum(q, k, v, 32)
    with torch.no_grad():
        o = autosoft.attention(q, k, v)
        o2, colsum = autosoft.attention_colsum(q, k, v, 32)
    assert o.grad_fn is None and colsum.shape == (1, 2, 32)
    torch.testing.assert_close(o, o2, atol=2e-3, rtol=2e-3)
    o3 = autosoft.attention(q, k.detach(), v)
    assert torch.equal(o, o3)
