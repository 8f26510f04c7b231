"""arrays.py, the layer under every public entry point: what it refuses before touching CUDA, and
how a family turns the caller's arrays into a Problem."""
from __future__ import annotations

import numpy as np
import pytest

import autosoft
from autosoft import dispatch, runtime
from autosoft.families import get_family

SOFTMAX = get_family("softmax")
ATTENTION = get_family("attention")


@pytest.fixture
def no_gpu_allowed(monkeypatch):
    """Any attempt to reach CuPy or a device fails the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("this path must not look for a GPU")

    monkeypatch.setattr(runtime, "cupy_module", forbidden)
    monkeypatch.setattr(runtime, "device_info", forbidden)
    monkeypatch.setattr(dispatch, "device_info", forbidden)


@pytest.mark.parametrize("make", [
    lambda: np.ones((4, 8), dtype=np.float32),
    lambda: np.ones((4, 8), dtype=np.float16),
    lambda: np.ones((2, 3, 8), dtype=np.float32)[:, 1],
    lambda: np.ones(8, dtype=np.int32),
    lambda: np.zeros((0, 8), dtype=np.float32),
    lambda: np.float32(1.0),
    lambda: np.ma.masked_array(np.ones((2, 2), dtype=np.float32)),
])
def test_softmax_of_a_numpy_array_is_a_type_error_without_a_device(no_gpu_allowed, make):
    with pytest.raises(TypeError, match="host"):
        autosoft.softmax(make())


@pytest.mark.parametrize("dim", [-1, 0])
@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_errors_name_the_function_that_was_called(no_gpu_allowed, name, dim):
    # log_softmax runs the softmax family: its errors said autosoft.softmax
    call = getattr(autosoft, name)
    with pytest.raises(TypeError, match=rf"^autosoft\.{name}: x is a host"):
        call(np.ones((4, 8), dtype=np.float32), dim=dim)
    with pytest.raises(TypeError, match=rf"^autosoft\.{name}: x is a list"):
        call([1.0, 2.0], dim=dim)


@pytest.mark.parametrize("value, needle", [
    (None, "NoneType"), ([1.0, 2.0], "list"), (1.5, "float"), ("x", "str"), (object(), "object"),
])
def test_non_arrays_are_a_type_error_without_a_device(no_gpu_allowed, value, needle):
    with pytest.raises(TypeError, match=needle):
        autosoft.softmax(value)
    with pytest.raises(TypeError, match="CuPy array"):
        autosoft.attention(value, value, value)


def test_host_arrays_to_attention_are_a_type_error_without_a_device(no_gpu_allowed):
    q = np.ones((1, 2, 8, 64), dtype=np.float16)
    with pytest.raises(TypeError, match="host"):
        autosoft.attention(q, q, q)


def test_softmax_problem_flattens_leading_dimensions():
    assert SOFTMAX.problem_for({"x": (2, 3, 5)}, "float16", {}).shape == (6, 5)
    assert SOFTMAX.problem_for({"x": (7,)}, "float32", {}).shape == (1, 7)
    assert SOFTMAX.caller_outputs({"x": (2, 3, 5)}, "float16", {}) == {"y": ((2, 3, 5), "float16")}
    with pytest.raises(ValueError, match="scalar"):
        SOFTMAX.problem_for({"x": ()}, "float32", {})
    with pytest.raises(ValueError):
        SOFTMAX.problem_for({"x": (4, 0)}, "float32", {})
    with pytest.raises(ValueError):
        SOFTMAX.problem_for({"x": (1, 2**31)}, "float32", {})


def test_attention_problem_follows_the_shapes_and_carries_causal():
    shapes = {"q": (1, 2, 77, 64), "k": (1, 2, 77, 64), "v": (1, 2, 77, 64)}
    problem = ATTENTION.problem_for(shapes, "bfloat16", {"causal": True})
    assert problem.shape == (1, 2, 77, 64) and problem.flags == ("causal",)
    assert ATTENTION.problem_for(shapes, "bfloat16", {"causal": False}).options == ()  # kv_heads = H, kv_len = N: dropped
    assert ATTENTION.caller_outputs(shapes, "float16", {}) == {"o": ((1, 2, 77, 64), "float16"),
                                                           "lse": ((1, 2, 77), "float32")}
    grouped = ATTENTION.problem_for({"q": (1, 8, 5, 64), "k": (1, 2, 300, 64), "v": (1, 2, 300, 64)}, "float16", {})
    assert grouped.shape == (1, 8, 5, 64) and grouped.options == (("kv_heads", 2), ("kv_len", 300))
    assert grouped.shape_text == "1x8x5x64+kv_heads=2+kv_len=300"
    with pytest.raises(ValueError, match="one shape"):  # k and v differ
        ATTENTION.problem_for({**shapes, "k": (1, 2, 78, 64)}, "float16", {})
    with pytest.raises(ValueError, match="multiple"):
        ATTENTION.problem_for({"q": (1, 3, 5, 64), "k": (1, 2, 5, 64), "v": (1, 2, 5, 64)}, "float16", {})
    with pytest.raises(ValueError, match="batch"):  # empty inputs get no Problem, but the same check
        ATTENTION.caller_outputs({**shapes, "q": (0, 2, 77, 64)}, "float16", {})
    with pytest.raises(ValueError, match="head dim"):
        ATTENTION.problem_for({n: (1, 2, 77, 48) for n in shapes}, "float16", {})


# --- autosoft.attention's window and softcap (issue 17): checked before any array is classified ---

HOST_Q = np.ones((1, 2, 8, 64), dtype=np.float16)  # a host array: reaching the array layer is a "host" TypeError

BAD_WINDOWS_AND_CAPS = [
    # (keyword arguments, error, message)
    ({"window": 4}, TypeError, r"^autosoft\.attention: window must be None or a pair \(left, right\) of key counts, "
                               r"got int$"),
    ({"window": (1, 2, 3)}, TypeError, r"window must be None or a pair .*, got 3 values$"),
    ({"window": (True, None)}, TypeError, r"^autosoft\.attention: window's left side must be an int >= 0 or None, "
                                          r"got bool$"),
    ({"window": (None, 2.0)}, TypeError, r"window's right side must be an int >= 0 or None, got float$"),
    ({"window": (-1, None)}, ValueError,
     r"^autosoft\.attention: window's left side must be >= 0 \(a number of keys\), got -1$"),
    ({"window": (0, np.int64(-3))}, ValueError, r"window's right side must be >= 0 .*got -3$"),
    ({"softcap": 0}, ValueError,
     r"^autosoft\.attention: softcap must be None or a positive finite number.*, got 0\.0$"),
    ({"softcap": -30.0}, ValueError, r"softcap must be None or a positive finite number.*, got -30\.0$"),
    ({"softcap": float("inf")}, ValueError, r"softcap must be .* finite number.*, got inf$"),
    ({"softcap": float("nan")}, ValueError, r"softcap must be .* finite number.*, got nan$"),
    ({"softcap": True}, TypeError, r"softcap must be None or a positive finite number.*, got bool$"),
    ({"softcap": "30"}, TypeError, r"softcap must be None or a positive finite number.*, got str$"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_WINDOWS_AND_CAPS,
                         ids=[repr(c[0]) for c in BAD_WINDOWS_AND_CAPS])
def test_attention_refuses_bad_windows_and_caps_without_a_device(no_gpu_allowed, kwargs, error, message):
    with pytest.raises(error, match=message):
        autosoft.attention(HOST_Q, HOST_Q, HOST_Q, **kwargs)


@pytest.mark.parametrize("kwargs", [{"window": (None, None)}, {"window": [0, 0]}, {"window": (np.int32(7), None)},
                                    {"softcap": 50}, {"softcap": np.float32(0.5)},
                                    {"causal": True, "window": (8, 3)}])
def test_attention_lets_good_windows_and_caps_through_to_the_arrays(no_gpu_allowed, kwargs):
    with pytest.raises(TypeError, match="host"):  # the array layer's error: the options passed their checks
        autosoft.attention(HOST_Q, HOST_Q, HOST_Q, **kwargs)


@pytest.mark.parametrize("kwargs, options", [
    ({}, {"causal": False}),
    ({"causal": 1}, {"causal": True}),
    ({"window": (None, None), "softcap": None}, {"causal": False}),  # absent and None are one problem
    ({"causal": True, "window": (np.int64(128), None)}, {"causal": True, "window_left": 128}),
    ({"window": [None, 0], "softcap": 30}, {"causal": False, "window_right": 0, "softcap": 30.0}),
    ({"window": (4, 2), "softcap": np.float32(50.0)}, {"causal": False, "window_left": 4, "window_right": 2,
                                                        "softcap": 50.0}),
])
def test_attention_passes_only_the_given_options_and_never_the_kv_shape(monkeypatch, kwargs, options):
    """kv_heads and kv_len are the family's to derive from k's shape (problem_for): the call passes
    causal always, and window_left, window_right, softcap only where given, as plain ints and floats."""
    calls = []
    monkeypatch.setattr(autosoft.api, "call_family",
                        lambda name, arrays, **kw: calls.append((name, len(arrays), kw)) or ("o", "lse"))
    k = np.ones((1, 1, 300, 64), dtype=np.float16)
    assert autosoft.attention(HOST_Q, k, k, return_lse=True, **kwargs) == ("o", "lse")
    ((name, count, kw),) = calls
    assert (name, count, kw["options"]) == ("attention", 3, options)
    assert all(type(v) in (bool, int, float) for v in kw["options"].values())
    assert kw["scalars"] == {"scale": np.float32(0.125)} and type(kw["scalars"]["scale"]) is np.float32


class HostProducer:
    """A DLPack producer whose memory is on the host (DLPack device type 1, kDLCPU)."""

    def __dlpack__(self, *args, **kwargs):
        raise AssertionError("a host producer's memory must not be asked for")

    def __dlpack_device__(self):
        return (1, 0)


class OtherDeviceProducer(HostProducer):
    def __dlpack_device__(self):
        return (10, 0)  # kDLROCM


def test_a_host_dlpack_producer_is_a_type_error_without_a_device(no_gpu_allowed):
    """README: a host array raises TypeError, also on a machine without a GPU (it raised NoDeviceError
    there, CuPy being asked first)."""
    with pytest.raises(TypeError, match=r"^autosoft\.softmax: x is a test_arrays\.HostProducer in host memory; "
                                        r"move it to the GPU first$"):
        autosoft.softmax(HostProducer())
    with pytest.raises(TypeError, match=r"^autosoft\.log_softmax: x is a test_arrays\.OtherDeviceProducer on a "
                                        r"DLPack device of type 10, not a CUDA GPU"):
        autosoft.log_softmax(OtherDeviceProducer(), dim=0)


def test_a_meta_tensor_is_called_a_meta_tensor(no_gpu_allowed):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^autosoft\.softmax: x is a meta tensor \(a shape without data\); autosoft "
                                        r"computes on CUDA tensors"):
        autosoft.softmax(torch.empty(4, 8, device="meta"))
    q = torch.empty(1, 2, 16, 64, dtype=torch.float16, device="meta")
    with pytest.raises(TypeError, match=r"^autosoft\.attention: q is a meta tensor"):
        autosoft.attention(q, q, q)
    with pytest.raises(TypeError, match=r"^autosoft\.softmax: x is a CPU tensor; move it to the GPU first \(x\.cuda\(\)\)$"):
        autosoft.softmax(torch.empty(4, 8))
