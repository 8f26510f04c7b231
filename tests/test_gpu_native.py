"""autosoft.native on the GPU: the compiled AutogradCUDA kernels of torch.ops.autosoft.softmax and
log_softmax launch recorded plans themselves and give what the Python kernels give; every call
they do not take (first calls, gradients, other dims, strided or misaligned inputs, errors, CUDA
graphs) ends as it does without them; a cleared dispatcher drops their records."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

import autosoft  # noqa: E402
import autosoft.torch_ops  # noqa: E402,F401 - registers torch.ops.autosoft
from autosoft import native  # noqa: E402
from autosoft.dispatch import DISPATCHER  # noqa: E402

ops = torch.ops.autosoft
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The extension built once (xdist workers share the folder: the build holds a file lock in
    it), enabled for this module's tests and disabled after them, so that other modules see the
    Python kernels."""
    base = tmp_path_factory.getbasetemp()
    folder = base.parent / "native-build" if os.environ.get("PYTEST_XDIST_WORKER") else base / "native-build"
    folder.mkdir(exist_ok=True)
    saved = os.environ.get("AUTOSOFT_CACHE_DIR")
    os.environ["AUTOSOFT_CACHE_DIR"] = str(folder)
    try:
        path = native.build()
        assert native.enable(), "built, but not enabled"
    finally:
        if saved is None:
            del os.environ["AUTOSOFT_CACHE_DIR"]
        else:
            os.environ["AUTOSOFT_CACHE_DIR"] = saved
    yield Path(path)
    native.disable()


@pytest.fixture(autouse=True)
def fresh(built, cache_dir):
    DISPATCHER.forget()
    yield
    DISPATCHER.forget()


def fresh_input(shape, dtype, scale=4.0):
    return (torch.randn(shape, device="cuda", dtype=F32) * scale).to(dtype)


@pytest.mark.parametrize("shape", [(4096, 128), (3, 5, 1000), (64, 4096)])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("log", [False, True])
def test_recorded_calls_launch_from_cpp_and_match(shape, dtype, log):
    op, reference = (ops.log_softmax, torch.log_softmax) if log else (ops.softmax, torch.softmax)
    first = fresh_input(shape, dtype)
    y_first = op(first, -1)  # the Python kernel prepares the plan; the miss records it if it can
    plan = DISPATCHER.fast[("softmax", (("log", True),) if log else (), (), dtype, first.shape, first.get_device())]
    replayable = getattr(plan, "native", None) is not None
    if shape == (4096, 128):
        assert replayable, "the plainest plan is not replayable from C++"
    assert native.recorded() == int(replayable)
    launched = native.launches()
    for _ in range(3):
        x = fresh_input(shape, dtype)
        y = op(x, -1)
        torch.testing.assert_close(y.float(), reference(x.float(), dim=-1), atol=2e-3 if not log else 2e-2,
                                   rtol=1e-2)
        assert y.data_ptr() != x.data_ptr() and y.shape == x.shape and y.dtype == x.dtype
        assert y.is_contiguous()
    assert native.launches() == launched + 3 * replayable
    # the public function (its own plan path) gives the same bits as the compiled kernel
    public = autosoft.log_softmax(first) if log else autosoft.softmax(first)
    assert torch.equal(y_first, public)
    assert torch.equal(op(first, -1), public)


def test_rows_of_minus_infinity_and_a_second_stream():
    x = fresh_input((512, 1000), F32)
    x[3, :] = float("-inf")
    x[7, 10:] = float("-inf")
    ops.softmax(x, -1)
    launched = native.launches()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        y = ops.softmax(x, -1)  # launched on the current stream, which is this one
    stream.synchronize()
    assert native.launches() == launched + 1
    torch.testing.assert_close(y, autosoft.softmax(x), rtol=0, atol=0, equal_nan=True)  # the Python path's bits
    torch.testing.assert_close(y[7], torch.softmax(x[7], dim=-1))


def test_what_the_compiled_kernel_does_not_take_goes_to_python():
    x = fresh_input((256, 512), F32)
    ops.softmax(x, -1)
    launched = native.launches()
    # another dim, a strided view, an input whose address cannot match a fresh output's mod 16
    torch.testing.assert_close(ops.softmax(x, 0), torch.softmax(x, dim=0))
    torch.testing.assert_close(ops.softmax(x.t().contiguous().t(), -1), torch.softmax(x, dim=-1))
    flat = fresh_input((256 * 512 + 1,), F32)
    shifted = flat[1:].view(256, 512)
    torch.testing.assert_close(ops.softmax(shifted, -1), torch.softmax(shifted, dim=-1))
    # gradients: recorded by the Python kernel's autograd.Function, backward by softmax_backward
    g = x.detach().clone().requires_grad_(True)
    y = ops.softmax(g, -1)
    assert y.grad_fn is not None
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, g, dy)
    ref = x.detach().clone().requires_grad_(True)
    (dx_ref,) = torch.autograd.grad(torch.softmax(ref, dim=-1), ref, dy)
    torch.testing.assert_close(dx, dx_ref, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        ops.softmax(g, -1)  # requires_grad without grad mode: the compiled kernel takes it
    assert native.launches() == launched + 1


def test_errors_are_the_python_kernels():
    with pytest.raises(TypeError, match=r"autosoft\.softmax: x must be float32 or float16 or bfloat16, got torch\.int64"):
        ops.softmax(torch.zeros(4, 8, device="cuda", dtype=torch.int64), -1)
    with pytest.raises(IndexError, match="out of range"):
        ops.softmax(fresh_input((4, 8), F32), 2)


def test_a_cuda_graph_replays_the_compiled_launch_on_new_data():
    x = fresh_input((1024, 256), F16)
    ops.softmax(x, -1)  # recorded
    static = fresh_input((1024, 256), F16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.softmax(static, -1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    launched = native.launches()
    with torch.cuda.graph(graph):
        y = ops.softmax(static, -1)
    assert native.launches() == launched + 1
    for _ in range(2):
        static.copy_(fresh_input((1024, 256), F16))
        graph.replay()
        torch.testing.assert_close(y.float(), torch.softmax(static.float(), dim=-1), atol=2e-3, rtol=1e-2)


def test_a_cleared_dispatcher_drops_the_records():
    x = fresh_input((128, 2048), BF16)
    ops.log_softmax(x, -1)
    assert native.recorded() == 1
    DISPATCHER.forget()
    assert native.recorded() == 0
    torch.testing.assert_close(ops.log_softmax(x, -1).float(), torch.log_softmax(x.float(), dim=-1),
                               atol=2e-2, rtol=1e-2)
    assert native.recorded() == 1


def test_disabled_the_python_kernels_serve_again():
    x = fresh_input((128, 512), F32)
    ops.softmax(x, -1)
    native.disable()
    try:
        assert not native.enabled() and native.recorded() == 0
        launched = native.launches()
        torch.testing.assert_close(ops.softmax(x, -1), torch.softmax(x, dim=-1))
        assert native.launches() == launched
    finally:
        assert native.enable()
    ops.softmax(x, -1)
    launched = native.launches()
    ops.softmax(x, -1)
    assert native.launches() == launched + 1


# --- the public functions' compiled first step ------------------------------------------------------

from autosoft import api  # noqa: E402
from autosoft.arrays import call_family  # noqa: E402

PUBLIC = {False: (autosoft.softmax, torch.softmax, None),
          True: (autosoft.log_softmax, torch.log_softmax, {"log": True})}


def python_path(x, log):
    """What the public function's Python path gives (the plan, no compiled entry)."""
    return call_family("softmax", (x,), options=PUBLIC[log][2])[0]


@pytest.mark.parametrize("shape", [(4096, 128), (1, 1), (3, 5, 1000), (64, 4096), (7, 50257)])
@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("log", [False, True])
def test_the_public_functions_launch_recorded_plans_from_cpp_with_the_python_paths_bits(shape, dtype, log):
    public, reference, _ = PUBLIC[log]
    first = fresh_input(shape, dtype)
    launched = native.launches()
    y_first = public(first)  # no record: the Python path, then the record
    assert native.launches() == launched
    replayable = native.recorded() == 1
    if shape in ((4096, 128), (1, 1)):
        assert replayable, "the issue's shapes are not replayed from C++"
    for _ in range(3):
        x = fresh_input(shape, dtype)
        y = public(x)
        assert torch.equal(y, python_path(x, log)), "not the Python path's bits"
        assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous() and y.data_ptr() != x.data_ptr()
    assert native.launches() == launched + 3 * replayable
    assert torch.equal(public(first), y_first)
    torch.testing.assert_close(y_first.float(), reference(first.float(), dim=-1), atol=2e-2 if log else 2e-3,
                               rtol=1e-2)


def test_a_record_serves_its_own_shape_operator_and_dtype_only():
    x = fresh_input((256, 512), F32)
    autosoft.softmax(x)
    assert native.recorded() == 1
    launched = native.launches()
    assert torch.equal(autosoft.softmax(x), python_path(x, False))
    assert torch.equal(autosoft.softmax(x, 1), python_path(x, False)), "the last dim by its index"
    assert native.launches() == launched + 2
    # another shape, the other operator, another dtype: each its own first call through Python, then
    # launched from C++ where its plan is replayable
    for log, other in ((False, fresh_input((512, 256), F32)), (False, fresh_input((256, 1024), F32)),
                       (True, x), (False, x.half())):
        public, reference, _ = PUBLIC[log]
        before, records = native.launches(), native.recorded()
        y = public(other)
        assert native.launches() == before, "a record of another call launched"
        torch.testing.assert_close(y.float(), reference(other.float(), dim=-1), atol=2e-2 if log else 2e-3, rtol=1e-2)
        replayable = native.recorded() - records
        assert replayable in (0, 1)
        assert torch.equal(public(other), y) and native.launches() == before + replayable


def test_calls_the_entry_does_not_take_go_to_python():
    x = fresh_input((256, 512), F32)
    autosoft.softmax(x)
    launched = native.launches()
    torch.testing.assert_close(autosoft.softmax(x, dim=0), torch.softmax(x, dim=0))
    out = torch.empty_like(x)
    assert autosoft.softmax(x, out=out) is out and torch.equal(out, python_path(x, False))
    torch.testing.assert_close(autosoft.softmax(x.t().contiguous().t()), torch.softmax(x, dim=-1))
    g = x.detach().clone().requires_grad_(True)
    assert autosoft.softmax(g).grad_fn is not None  # the operator, with its backward
    empty = fresh_input((0, 128), F32)
    assert autosoft.softmax(empty).shape == (0, 128) and autosoft.softmax(empty).shape == (0, 128)
    assert native.launches() == launched, "the compiled entry launched a call it must leave to Python"
    assert native.recorded() == 1, "an empty input's plan is no record that launches"
    with pytest.raises(TypeError, match=r"autosoft\.log_softmax: x must be float32 or float16 or bfloat16, got torch\.int64"):
        autosoft.log_softmax(torch.zeros(4, 8, device="cuda", dtype=torch.int64))


def test_autosoft_native_0_keeps_the_python_path(monkeypatch):
    x = fresh_input((128, 512), F32)
    monkeypatch.setenv("AUTOSOFT_NATIVE", "0")
    api._direct_reset()
    try:
        launched = native.launches()
        for _ in range(3):
            assert torch.equal(autosoft.softmax(x), python_path(x, False))
        assert native.launches() == launched and api._softmax_direct is api._no_direct
    finally:
        monkeypatch.delenv("AUTOSOFT_NATIVE")
        api._direct_reset()
    autosoft.softmax(x)
    launched = native.launches()
    autosoft.softmax(x)
    assert native.launches() == launched + 1, "the entry did not come back once AUTOSOFT_NATIVE was unset"


def test_the_public_entry_launches_on_the_current_stream_and_in_a_cuda_graph():
    x = fresh_input((1024, 256), F16)
    autosoft.softmax(x)  # recorded
    expected = python_path(x, False)
    new = fresh_input((1024, 256), F16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    launched = native.launches()
    with torch.cuda.stream(stream):
        # the input rewritten on this stream after a wait: a launch on any other stream reads the old data
        torch.cuda._sleep(50_000_000)
        x.copy_(new)
        y = autosoft.softmax(x)
    assert native.launches() == launched + 1
    stream.synchronize()
    assert torch.equal(y, python_path(new, False)) and not torch.equal(y, expected)
    static = fresh_input((1024, 256), F16)
    with torch.cuda.stream(stream):
        autosoft.softmax(static)  # warm-up on a side stream, as torch.cuda.graph asks
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    launched = native.launches()
    with torch.cuda.graph(graph):
        y = autosoft.softmax(static)
    assert native.launches() == launched + 1
    for _ in range(2):
        static.copy_(fresh_input((1024, 256), F16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, python_path(static, False))


def test_the_entrys_output_has_the_python_paths_strides():
    """A contiguous input may have any stride on a dimension of size 1; torch.empty_like (the Python
    path) keeps it, and so must the compiled entry's allocation."""
    x = torch.empty_strided((4, 1, 8), (8, 1, 1), device="cuda")
    x.copy_(fresh_input((4, 1, 8), F32))
    assert x.is_contiguous()
    first = autosoft.softmax(x)
    launched = native.launches()
    y = autosoft.softmax(x)
    assert native.launches() == launched + 1
    assert y.stride() == first.stride() == python_path(x, False).stride() == x.stride()
    assert torch.equal(y, first)


def test_the_public_entry_launches_without_autograd_keys():
    """Under torch.inference_mode a tensor made outside it, and outside it an inference tensor,
    dispatch through ADInplaceOrView (no autograd key) to the CUDA kernel: the entry takes both
    (it once left them to Python), and a tensor that requires gradients under no_grad; each with
    the Python path's bits, none requiring gradients."""
    x = fresh_input((512, 256), F16)
    autosoft.softmax(x)  # recorded
    expected = python_path(x, False)
    launched = native.launches()
    with torch.inference_mode():
        y = autosoft.softmax(x)
        inference = x.clone()
    assert native.launches() == launched + 1, "a tensor made outside inference_mode went to Python in it"
    assert inference.is_inference()
    z = autosoft.softmax(inference)
    assert native.launches() == launched + 2, "an inference tensor went to Python outside inference_mode"
    with torch.no_grad():
        w = autosoft.softmax(x.detach().clone().requires_grad_(True))
    assert native.launches() == launched + 3
    for out in (y, z, w):
        assert torch.equal(out, expected) and not out.requires_grad


def test_the_public_entry_leaves_misaligned_inputs_and_errors_to_python():
    """An input whose address a fresh output cannot match mod 16 gets the Python path's realigned
    output; a dim out of range and a 0-dim input get the Python path's errors, the plan recorded."""
    x = fresh_input((256, 512), F32)
    autosoft.softmax(x)  # recorded
    flat = fresh_input((256 * 512 + 1,), F32)
    shifted = flat[1:].view(256, 512)
    launched = native.launches()
    y = autosoft.softmax(shifted)
    assert native.launches() == launched
    assert torch.equal(y, python_path(shifted, False)) and y.data_ptr() % 16 == shifted.data_ptr() % 16
    for dim in (2, -3):
        with pytest.raises(IndexError, match="out of range"):
            autosoft.softmax(x, dim)
    with pytest.raises(ValueError, match="scalar"):
        autosoft.log_softmax(torch.tensor(1.0, device="cuda"))
    assert native.launches() == launched
