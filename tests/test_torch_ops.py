"""autosoft's torch custom operators (autosoft.torch_ops) without a GPU: registration, the fake
implementations' shapes, dtypes and errors, the refusal of gradients, and torch.compile tracing
them into one graph with no break.

No test here runs a kernel. torch's FakeTensorMode makes CUDA fake tensors on a CPU-only torch
(only creating them: viewing or slicing one, or making one require gradients, needs CUDA), so
the shape tests and the compiled models run on CUDA fake tensors, the kind a real call passes.
Where autograd or AOTAutograd must run (they build their own fake mode, or an autograd graph node
on a CUDA fake tensor aborts the process on a CPU-only torch) the inputs are meta tensors, which
reach only the fake implementations too. tests/test_gpu_torch_ops.py runs the real kernels."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import autosoft  # noqa: E402
import autosoft.torch_ops as torch_ops  # noqa: E402
from autosoft.autograd import no_backward_error  # noqa: E402
from autosoft.families.base import Call  # noqa: E402
from autosoft.operators import Backward, OperatorCall, TorchOperator  # noqa: E402
from fault_family import FaultyFamily  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ops = torch.ops.autosoft
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def fake_cuda(*shape, dtype=F32):
    return torch.empty(shape, device="cuda", dtype=dtype)


# --- registration -------------------------------------------------------------------------

CORE_SCHEMAS = {
    "softmax": "autosoft::softmax(Tensor x, int dim) -> Tensor",
    "log_softmax": "autosoft::log_softmax(Tensor x, int dim) -> Tensor",
    "softmax_backward": "autosoft::softmax_backward(Tensor y, Tensor dy, int dim, bool log) -> Tensor",
    "attention": "autosoft::attention(Tensor q, Tensor k, Tensor v, bool causal, float scale, "
                 "int? window_left=None, int? window_right=None, float? softcap=None) -> (Tensor o, Tensor lse)",
    "attention_colsum": "autosoft::attention_colsum(Tensor q, Tensor k, Tensor v, int split, bool causal, "
                        "float scale, bool deterministic) -> (Tensor o, Tensor colsum, Tensor lse)"}


def test_the_operators_are_registered_with_their_schemas():
    from autosoft.families import families

    declared = {op.name: op.schema for family in families().values() for op in family.torch_operators}
    assert set(torch_ops.OPS) == set(declared)  # every declared operator, and nothing else
    schemas = {name: str(getattr(ops, name).default._schema) for name in torch_ops.OPS}
    for name, schema in declared.items():
        assert getattr(ops, name).default._schema == torch._C.parse_schema(f"autosoft::{name}{schema}")
    # the core families' operators as users and compiled graphs see them (each other family's own
    # tests state its schema)
    assert {name: schemas[name] for name in CORE_SCHEMAS} == CORE_SCHEMAS
    for name in torch_ops.OPS:  # tagged as safe for torch.compile; only the KV cache's are written in place
        overload = getattr(ops, name).default
        assert torch.Tag.pt2_compliant_tag in overload.tags
        written = {a.name for a in overload._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == ({"k_cache", "v_cache"} if name == "attention_kvcache" else set()), name
        assert getattr(torch_ops, name) is overload
        # the real implementation for every backend, the fake one (also the Meta kernel), and a kernel
        # of autosoft's own for every autograd key (not torch's autograd fallback, which would let
        # outputs of inputs that require gradients carry none)
        qualname = f"autosoft::{name}"
        table = dict(line.split(": ", 1) for line in torch._C._dispatch_dump_table(qualname).splitlines()
                     if ": " in line)
        for key in ("CPU", "CUDA", "Meta", "AutogradCPU", "AutogradCUDA", "AutogradMeta"):
            assert "autosoft/torch_ops.py" in table[key], (name, key, table[key])
        assert torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None


def test_register_is_idempotent_from_many_threads():
    before = ops.softmax.default
    errors = []

    def again():
        try:
            torch_ops.register()
        except Exception as exc:  # noqa: BLE001 - any error is the finding
            errors.append(exc)

    threads = [threading.Thread(target=again) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and ops.softmax.default is before


def test_autosoft_alone_never_imports_torch_and_torch_ops_registers_on_import():
    code = ("import sys, autosoft; autosoft.softmax; autosoft.attention_colsum; "
            "assert 'torch' not in sys.modules, 'autosoft imported torch'; "
            "import autosoft.torch_ops, torch; torch.ops.autosoft.attention_colsum.default; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# --- a family's declaration is all it takes ----------------------------------------------------

def _toy_call(x, factor):
    if not factor > 0:
        raise ValueError(f"autosoft.toy_scale: factor must be positive, got {factor}")
    return OperatorCall((x,), {}, {"factor": np.float32(factor)})


def _toy_gradient(ops, saved, grads):
    return grads[0] * saved["factor"], None  # y = factor x


class ToyFamily(FaultyFamily):
    """A family defined here, with one operator and a Python function: nothing in autosoft names it."""
    name = "toy"
    inputs = ("x", "factor")
    torch_operators = (
        TorchOperator("toy_scale", "toy", "(Tensor x, float factor) -> Tensor", _toy_call,
                      backward=Backward(("factor",), _toy_gradient)),
        TorchOperator("toy", "toy", "(Tensor x, float factor) -> Tensor", _toy_call,
                      backward=Backward(("factor",), _toy_gradient)),
    )

    def python_call(self, x, factor=1.0) -> Call:
        return Call((x,), {}, {"factor": np.float32(factor)}, ("y",))


def test_torch_ops_names_no_family_and_no_operator():
    source = Path(torch_ops.__file__).read_text()
    names = set(autosoft.families.families()) | set(torch_ops.OPS)
    assert not [n for n in names if re.search(rf"\b{n}\b", source)]


def test_a_family_that_declares_an_operator_gets_it_with_fake_and_autograd_kernels(monkeypatch):
    """A family registered after import (a plug-in) gets its operator on the next register(): real,
    fake and Autograd kernels from its declaration alone."""
    monkeypatch.setitem(autosoft.families._registry, "toy", ToyFamily())
    torch_ops.register()
    assert "toy_scale" in torch_ops.OPS and torch_ops.toy_scale is ops.toy_scale.default
    assert str(ops.toy_scale.default._schema) == "autosoft::toy_scale(Tensor x, float factor) -> Tensor"
    with FakeTensorMode():  # the fake kernel: the family's caller_outputs
        y = ops.toy_scale(fake_cuda(21), 2.0)
        assert (y.shape, y.dtype, y.device.type) == ((21,), F32, "cuda")
        with pytest.raises(ValueError, match=r"autosoft\.toy_scale: factor must be positive, got -1\.0"):
            ops.toy_scale(fake_cuda(21), -1.0)
        with pytest.raises(TypeError, match=r"autosoft\.toy_scale: x must be float32, got torch\.float16"):
            ops.toy_scale(fake_cuda(21, dtype=F16), 1.0)
    meta = torch.empty(5, device="meta")
    assert set(torch.library.opcheck(ops.toy_scale.default, (meta, 3.0)).values()) == {"SUCCESS"}
    seen = []  # the real kernel: the declared call through the array layer (a stand-in here)
    monkeypatch.setattr(torch_ops, "call_family", lambda name, arrays, *, options=None, scalars=None, who=None:
                        seen.append((name, options, scalars, who)) or (arrays[0] * float(scalars["factor"]),))
    assert ops.toy_scale(torch.ones(3), 4.0).tolist() == [4.0] * 3
    assert seen == [("toy", None, {"factor": np.float32(4.0)}, "autosoft.toy_scale")]
    x = torch.ones(3, requires_grad=True)  # autograd: the declared formula
    (dx,) = torch.autograd.grad(ops.toy_scale(x, 3.0).sum(), x)
    assert dx.tolist() == [3.0] * 3
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(lambda x: ops.toy_scale(x * 2, 0.5) + 1, backend=backend, fullgraph=True)
    with FakeTensorMode():
        assert compiled(fake_cuda(16)).shape == (16,)
    assert op_targets(graphs[0]) == ["autosoft.toy_scale"]
    torch._dynamo.reset()


def test_a_family_function_with_gradients_goes_through_its_operators_declared_backward(monkeypatch):
    """autosoft.toy (built from ToyFamily.python_call): plain calls take the array layer, calls that
    autograd records take the operator named like the family, differentiated by its formula."""
    import autosoft.api

    monkeypatch.setitem(autosoft.families._registry, "toy", ToyFamily())
    torch_ops.register()
    taken = []

    def stand_in(route):
        def call_family(name, arrays, *, options=None, scalars=None, out=None, who=None):
            taken.append(route)
            return (arrays[0] * float(scalars["factor"]),)
        return call_family

    monkeypatch.setattr(autosoft.api, "call_family", stand_in("plan"))
    monkeypatch.setattr(torch_ops, "call_family", stand_in("operator"))
    toy = autosoft.api.family_function("toy")
    try:
        x = torch.ones(3, requires_grad=True)
        y = toy(x, 3.0)
        (dx,) = torch.autograd.grad(y.sum(), x)
        assert dx.tolist() == [3.0] * 3 and type(y.grad_fn).__name__ == "toy_autogradBackward"
        with torch.no_grad():
            assert toy(x, 2.0).tolist() == [2.0] * 3
        assert toy(x.detach(), 2.0).grad_fn is None
        assert taken == ["operator", "plan", "plan"]
    finally:
        autosoft.api.family_function.cache_clear()


def test_an_operator_whose_schema_returns_other_than_the_family_outputs_is_refused(monkeypatch):
    class TwoOutputs(FaultyFamily):
        name = "toy_two"
        torch_operators = (TorchOperator("toy_two", "toy_two", "(Tensor x) -> (Tensor a, Tensor b)",
                                         lambda x: OperatorCall((x,))),)

    monkeypatch.setitem(autosoft.families._registry, "toy_two", TwoOutputs())
    with pytest.raises(ValueError, match=r"torch operator toy_two: its schema returns 2 tensors, the toy_two "
                                         r"family's outputs are y"):
        torch_ops.register()
    assert "toy_two" not in torch_ops.OPS and not hasattr(ops, "toy_two")


# --- the fake implementations ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 1000), (5,), (0, 8)])
def test_fake_softmax_gives_y_like_x(dtype, shape):
    with FakeTensorMode():
        y = ops.softmax(fake_cuda(*shape, dtype=dtype), -1)
    assert (y.shape, y.dtype, y.device.type, y.is_contiguous()) == (shape, dtype, "cuda", True)


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_fake_attention_gives_o_like_q_and_float32_lse(dtype):
    with FakeTensorMode():
        q = fake_cuda(2, 3, 77, 64, dtype=dtype)
        o, lse = ops.attention(q, fake_cuda(2, 3, 77, 64, dtype=dtype), fake_cuda(2, 3, 77, 64, dtype=dtype), True, 0.125)
    assert (o.shape, o.dtype, o.device.type, o.is_contiguous()) == ((2, 3, 77, 64), dtype, "cuda", True)
    assert (lse.shape, lse.dtype, lse.device.type) == ((2, 3, 77), F32, "cuda")


@pytest.mark.parametrize("q_shape, kv_shape", [((2, 8, 5, 64), (2, 2, 77, 64)), ((1, 32, 1, 128), (1, 1, 4096, 128)),
                                                ((1, 4, 300, 96), (1, 4, 7, 96)), ((3, 2, 9, 256), (3, 2, 9, 256))])
def test_fake_attention_takes_grouped_heads_and_other_key_lengths(q_shape, kv_shape):
    with FakeTensorMode():
        o, lse = ops.attention(fake_cuda(*q_shape, dtype=BF16), fake_cuda(*kv_shape, dtype=BF16),
                               fake_cuda(*kv_shape, dtype=BF16), True, 0.1, 16, None, 30.0)
    assert (o.shape, o.dtype, o.is_contiguous()) == (q_shape, BF16, True)
    assert (lse.shape, lse.dtype) == (q_shape[:3], F32)


@pytest.mark.parametrize("args, kwargs, options", [
    ((), {}, {"causal": True}),
    ((None, None, None), {}, {"causal": True}),  # None: the schema's default, no limit and no cap
    ((16,), {}, {"causal": True, "window_left": 16}),
    ((), {"window_right": 0, "softcap": 30}, {"causal": True, "window_right": 0, "softcap": 30.0}),
    ((4, 2, 50.0), {}, {"causal": True, "window_left": 4, "window_right": 2, "softcap": 50.0}),
])
def test_the_real_attention_passes_window_and_softcap_as_the_public_function_does(monkeypatch, args, kwargs,
                                                                                  options):
    """The schema's optional arguments, positional or by keyword, reach call_family as the problem
    options autosoft.attention builds (absent ones left out; kv_heads and kv_len never passed: the
    family reads them off k). CPU tensors reach the real implementation; call_family is a stand-in."""
    seen = []

    def record(name, arrays, *, options=None, scalars=None, out=None, who=None):
        seen.append((name, [tuple(a.shape) for a in arrays], options, scalars))
        return torch.zeros(2, 8, 5, 64, dtype=F16), torch.zeros(2, 8, 5)

    monkeypatch.setattr(torch_ops, "call_family", record)
    q, kv = torch.empty(2, 8, 5, 64, dtype=F16), torch.empty(2, 2, 77, 64, dtype=F16)
    o, lse = ops.attention(q, kv, kv, True, 0.125, *args, **kwargs)
    assert (o.shape, lse.shape) == ((2, 8, 5, 64), (2, 8, 5))
    ((name, shapes, given, scalars),) = seen
    assert (name, shapes, given) == ("attention", [(2, 8, 5, 64), (2, 2, 77, 64), (2, 2, 77, 64)], options)
    assert scalars == {"scale": np.float32(0.125)} and type(scalars["scale"]) is np.float32


def test_the_schema_refuses_a_float_window_before_any_implementation(no_kernels):
    refused = r"Expected a value of type 'Optional\[int\]' for argument 'window_left'"
    with pytest.raises(RuntimeError, match=refused):
        ops.attention(*[torch.empty(1, 2, 4, 64, dtype=F16)] * 3, True, 0.1, 2.5)


@pytest.mark.parametrize("split", [1, 40, 76])
def test_fake_attention_colsum_gives_o_colsum_and_lse(split):
    with FakeTensorMode():
        q = fake_cuda(1, 4, 77, 128, dtype=BF16)
        o, colsum, lse = ops.attention_colsum(q, q, q, split, True, 0.1, False)
    assert (o.shape, o.dtype) == ((1, 4, 77, 128), BF16)
    assert (colsum.shape, colsum.dtype, colsum.device.type) == ((1, 4, split), F32, "cuda")
    assert (lse.shape, lse.dtype) == ((1, 4, 77), F32)


def test_fake_attention_varlen_gives_o_like_packed_q_and_token_major_lse():
    q = torch.empty(30, 8, 128, device="meta", dtype=BF16)
    kv = torch.empty(50, 2, 128, device="meta", dtype=BF16)
    offsets = torch.empty(4, device="meta", dtype=torch.int32)
    o, lse = ops.attention_varlen(q, kv, kv, offsets, offsets, 16, 24, True, 0.1)
    assert o.shape == q.shape and o.dtype == BF16 and lse.shape == (30, 8) and lse.dtype == F32
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        ops.attention_varlen(q, kv, kv, offsets, offsets[:3], 16, 24, True, 0.1)


def test_empty_inputs_give_empty_outputs_as_the_real_path_does():
    with FakeTensorMode():
        q = fake_cuda(0, 2, 8, 48, dtype=F16)  # an empty call skips the head-dim check, as arrays._prepare does
        o, lse = ops.attention(q, q, q, False, 1.0)
    assert o.shape == (0, 2, 8, 48) and lse.shape == (0, 2, 8)


def test_meta_tensors_are_accepted_for_shape_inference():
    q = torch.empty(2, 3, 16, 64, device="meta", dtype=F16)
    o, colsum, lse = ops.attention_colsum(q, q, q, 5, False, 0.125, True)
    assert [(t.device.type, tuple(t.shape)) for t in (o, colsum, lse)] == \
        [("meta", (2, 3, 16, 64)), ("meta", (2, 3, 5)), ("meta", (2, 3, 16))]


BAD_CALLS = [
    # (what is wrong, call on fake tensors made by `t`, error, message)
    ("k and v of two shapes", lambda t: ops.attention(t(1, 2, 16, 64), t(1, 2, 16, 64), t(1, 2, 8, 64), False, 0.1),
     ValueError, r"autosoft\.attention: q must be \(B, H, N, D\) and k, v \(B, Hkv, Nkv, D\) of one shape, got "
                 r"\(1, 2, 16, 64\), \(1, 2, 16, 64\), \(1, 2, 8, 64\)"),
    ("3-d q", lambda t: ops.attention(t(2, 16, 64), t(2, 16, 64), t(2, 16, 64), False, 0.1),
     ValueError, r"autosoft\.attention: q must be \(B, H, N, D\)"),
    ("heads not a multiple", lambda t: ops.attention(t(1, 6, 16, 64), t(1, 4, 16, 64), t(1, 4, 16, 64), False, 0.1),
     ValueError, r"autosoft\.attention: q's 6 heads must be a multiple of k's and v's 4"),
    ("batches differ", lambda t: ops.attention(t(2, 4, 16, 64), t(1, 4, 16, 64), t(1, 4, 16, 64), False, 0.1),
     ValueError, r"must share the batch \(first\) and head dim \(last\)"),
    ("negative window", lambda t: ops.attention(*[t(1, 2, 16, 64)] * 3, True, 0.1, -1),
     ValueError, r"autosoft\.attention: window's left side must be >= 0 \(a number of keys\), got -1"),
    ("negative right window", lambda t: ops.attention(*[t(1, 2, 16, 64)] * 3, False, 0.1, window_right=-2),
     ValueError, r"autosoft\.attention: window's right side must be >= 0 \(a number of keys\), got -2"),
    ("softcap 0", lambda t: ops.attention(*[t(1, 2, 16, 64)] * 3, True, 0.1, None, None, 0.0),
     ValueError, r"autosoft\.attention: softcap must be None or a positive finite number.*, got 0\.0"),
    ("softcap inf", lambda t: ops.attention(*[t(1, 2, 16, 64)] * 3, True, 0.1, softcap=float("inf")),
     ValueError, r"autosoft\.attention: softcap must be None or a positive finite number.*, got inf"),
    ("head dim 48", lambda t: ops.attention(t(1, 2, 16, 48), t(1, 2, 16, 48), t(1, 2, 16, 48), True, 0.1),
     ValueError, r"autosoft\.attention: shape '1x2x16x48': head dim D=48 is not supported"),
    ("dtypes differ", lambda t: ops.attention(t(1, 2, 16, 64), t(1, 2, 16, 64, dtype=BF16), t(1, 2, 16, 64), True, 0.1),
     TypeError, r"autosoft\.attention: k must be float16 \(q's dtype\), got torch\.bfloat16"),
    ("float32 attention", lambda t: ops.attention(*[t(1, 2, 16, 64, dtype=F32)] * 3, True, 0.1),
     TypeError, r"autosoft\.attention: q must be float16 or bfloat16, got torch\.float32"),
    ("scale 0", lambda t: ops.attention(*[t(1, 2, 16, 64)] * 3, True, 0.0),
     ValueError, r"autosoft\.attention: scale must be positive and a float32 .*, got 0\.0"),
    ("split = N", lambda t: ops.attention_colsum(*[t(1, 2, 16, 64)] * 3, 16, True, 0.1, False),
     ValueError, r"autosoft\.attention_colsum: split=16 is outside 0 < split < N=16"),
    ("split 0", lambda t: ops.attention_colsum(*[t(1, 2, 16, 64)] * 3, 0, False, 0.1, True),
     ValueError, r"autosoft\.attention_colsum: split=0 is outside 0 < split < N=16"),
    ("negative scale colsum", lambda t: ops.attention_colsum(*[t(1, 2, 16, 64)] * 3, 4, False, -1.0, True),
     ValueError, r"autosoft\.attention_colsum: scale must be positive.*, got -1\.0"),
    ("int softmax", lambda t: ops.softmax(t(4, 8, dtype=torch.int32), -1),
     TypeError, r"autosoft\.softmax: x must be float32 or float16 or bfloat16, got torch\.int32"),
    ("0-d softmax", lambda t: ops.softmax(t(dtype=F32), -1),
     ValueError, r"autosoft\.softmax: x is a scalar; it needs at least one dimension"),
]


@pytest.mark.parametrize("what, call, error, message", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_fake_implementations_raise_the_real_paths_errors(what, call, error, message):
    with FakeTensorMode():
        with pytest.raises(error, match=message):
            call(lambda *shape, dtype=F16: fake_cuda(*shape, dtype=dtype))


def test_cpu_tensors_are_refused_alike_by_the_fake_and_the_real_implementation():
    """The real implementation on CPU tensors is the public function's path: its TypeError comes
    before any CUDA is touched. The fake implementation raises the same one while tracing."""
    x = torch.randn(4, 8)
    with pytest.raises(TypeError) as public:
        autosoft.softmax(x)
    with pytest.raises(TypeError) as real:
        ops.softmax(x, -1)
    with FakeTensorMode():
        with pytest.raises(TypeError) as fake:
            ops.softmax(torch.empty(4, 8), -1)
    assert str(real.value) == str(fake.value) == str(public.value) == \
        "autosoft.softmax: x is a CPU tensor; move it to the GPU first (x.cuda())"
    q = torch.randn(1, 2, 8, 64, dtype=F16)
    with pytest.raises(TypeError, match=r"autosoft\.attention_colsum: q is a CPU tensor"):
        ops.attention_colsum(q, q, q, 4, False, 0.125, False)
    with FakeTensorMode():
        with pytest.raises(TypeError, match=r"autosoft\.attention: k is a CPU tensor"):
            ops.attention(fake_cuda(1, 2, 8, 64, dtype=F16), torch.empty(1, 2, 8, 64, dtype=F16),
                          fake_cuda(1, 2, 8, 64, dtype=F16), False, 0.125)


def test_the_real_implementations_call_the_array_layer_as_the_public_functions_do(monkeypatch):
    """Same family, arrays, options and scalars: the same plan and kernels (a stand-in array layer
    records each call; the GPU tests check that the outputs agree)."""
    import autosoft.api

    calls = []

    def record(name, arrays, *, options=None, scalars=None, out=None, who=None):
        calls.append((name, [id(a) for a in arrays], dict(options or {}),
                      {k: (type(v), v) for k, v in (scalars or {}).items()}, who))
        outs = autosoft.families.get_family(name).caller_outputs(
            {n: tuple(a.shape) for n, a in zip(("q", "k", "v") if len(arrays) == 3 else ("x",), arrays)},
            "float16", options or {})
        return tuple(torch.zeros(shape) for shape, _ in outs.values())

    monkeypatch.setattr(autosoft.api, "call_family", record)
    monkeypatch.setattr(autosoft.arrays, "call_family", record)
    monkeypatch.setattr(torch_ops, "call_family", record)
    x, q, k, v = torch.randn(4, 8), *[torch.randn(1, 2, 16, 64, dtype=F16) for _ in range(3)]
    pairs = [(lambda: autosoft.softmax(x), lambda: ops.softmax(x, -1)),
             (lambda: autosoft.log_softmax(x, dim=1), lambda: ops.log_softmax(x, 1)),
             (lambda: autosoft.log_softmax(x), lambda: ops.log_softmax(x, -1)),
             (lambda: autosoft.attention(q, k, v, causal=True, scale=0.3, return_lse=True),
              lambda: ops.attention(q, k, v, True, 0.3)),
             (lambda: autosoft.attention(q, k, v), lambda: ops.attention(q, k, v, False, 64 ** -0.5)),
             (lambda: autosoft.attention_colsum(q, k, v, 5, causal=True, scale=0.3, deterministic=True),
              lambda: ops.attention_colsum(q, k, v, 5, True, 0.3, True)),
             (lambda: autosoft.attention_colsum(q, k, v, 15), lambda: ops.attention_colsum(q, k, v, 15, False, 0.125, False))]
    for public, op in pairs:
        calls.clear()
        public()
        op()
        assert len(calls) == 2 and calls[0] == calls[1], calls


def test_the_operators_take_the_plan_that_the_public_functions_prepared(monkeypatch):
    """One plan per call signature, under call_family's key: the operators' lean path finds the plan
    autosoft.softmax / log_softmax prepared and never prepares one of its own (a stand-in plan on a
    CPU tensor; tests/test_gpu_torch_ops.py checks the same with real plans)."""
    import autosoft.arrays
    from autosoft.dispatch import DISPATCHER

    prepared, ran = [], []

    def prepare(family, fw, arrays, options, names, who=None):
        prepared.append(dict(options))

        def plan(arrays, scalars, given=None):
            ran.append((tuple(arrays), scalars))
            return (torch.full((4, 8), float(len(ran))),)
        return plan

    monkeypatch.setattr(autosoft.arrays, "_prepare", prepare)
    x = torch.randn(4, 8)
    try:
        outputs = [autosoft.softmax(x), autosoft.log_softmax(x), ops.softmax(x, -1), ops.log_softmax(x, -1),
                   torch_ops.softmax(x, -1)]
        assert [float(y[0, 0]) for y in outputs] == [1, 2, 3, 4, 5]
        assert prepared == [{}, {"log": True}]
        assert all(arrays[0] is x and scalars == () for arrays, scalars in ran)
    finally:
        DISPATCHER.fast.clear()


def _excluded_autograd_when_the_real_implementation_ran(monkeypatch, call):
    """Run `call` with a stand-in array layer; whether the real implementation ran with autograd
    excluded (the redispatch below autograd) or not (called by the autograd kernel itself)."""
    seen = []

    def record(name, arrays, *, options=None, scalars=None, out=None, who=None):
        seen.append(torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality))
        return (torch.zeros(arrays[0].shape),)

    monkeypatch.setattr(torch_ops, "call_family", record)
    monkeypatch.setattr(autosoft.arrays, "call_family", record)  # call_along's (a dim other than the last)
    call()
    assert len(seen) == 1
    return seen[0]


def test_a_plain_tensor_takes_one_python_hop_and_anything_else_the_dispatcher(monkeypatch):
    """The autograd kernel calls the real implementation itself only where the dispatcher would call
    it next: a dispatch mode (FakeTensorMode is one, as is make_fx's tracing) must still see the
    operator, and meta tensors must reach the fake implementation."""
    x = torch.randn(4, 8)
    assert not _excluded_autograd_when_the_real_implementation_ran(monkeypatch, lambda: ops.softmax(x, -1))
    assert not _excluded_autograd_when_the_real_implementation_ran(monkeypatch, lambda: ops.log_softmax(x, 0))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:  # (the mode runs with the dispatch keys of the call's start: no signal there)
        _excluded_autograd_when_the_real_implementation_ran(monkeypatch, lambda: ops.softmax(x, -1))
    assert mode.ops == ["autosoft.softmax.default"]
    with torch.inference_mode():  # no autograd kernel at all: the dispatcher calls the real implementation
        assert _excluded_autograd_when_the_real_implementation_ran(monkeypatch, lambda: ops.softmax(x, -1))
    meta = torch.empty(4, 8, device="meta")
    assert ops.softmax(meta, -1).device.type == "meta"  # the fake implementation (the stand-in is not called)


def test_inference_mode_calls_reach_the_implementations_and_record_nothing():
    needy = torch.empty(3, 5, device="meta").requires_grad_()
    with torch.inference_mode():
        y = ops.log_softmax(needy, 1)
        o, lse = ops.attention(*[needy.new_empty(1, 2, 16, 64, dtype=F16).requires_grad_()] * 3, False, 0.125)
        with pytest.raises(TypeError, match=r"autosoft\.softmax: x is a CPU tensor"):
            ops.softmax(torch.randn(4, 8, requires_grad=True), -1)
    assert y.shape == (3, 5) and not y.requires_grad and not o.requires_grad and lse.shape == (1, 2, 16)


@pytest.mark.parametrize("name", torch_ops.OPS)
def test_opcheck_on_meta_tensors(name):
    """torch.library.opcheck: schema, autograd registration, fake tensor and AOT dispatch tests. On
    meta tensors only the fake implementation runs (the real one needs CUDA tensors and a GPU):
    this checks the registration's consistency; the GPU tests compare fake and real outputs."""
    meta = torch.empty(2, 3, 16, 64, device="meta", dtype=F16)
    rows = torch.empty(7, 33, device="meta")
    args = {"softmax": (rows, -1), "log_softmax": (meta, 0), "softmax_backward": (rows, rows, -1, True),
            "attention": (meta, meta, meta, True, 0.125), "attention_colsum": (meta, meta, meta, 5, True, 0.125, False),
            "attention_backward": (meta, meta, meta, meta, meta, meta[..., 0].float(), None, True, 0.125),
            "topk_softmax": (rows, torch.empty(33, device="meta"), 1.0, 3, True, 3, 2, True),
            "cross_entropy": (rows, torch.empty(7, device="meta", dtype=torch.int64), torch.empty(1, device="meta"),
                              -100, 0.1, 0.0),
            "attention_kvcache": (torch.empty(2, 1, 8, 64, device="meta", dtype=F16),
                                  torch.empty(9, 16, 2, 64, device="meta", dtype=F16),
                                  torch.empty(9, 16, 2, 64, device="meta", dtype=F16),
                                  torch.empty(2, device="meta", dtype=torch.int32),
                                  torch.empty(2, 4, device="meta", dtype=torch.int32),
                                  torch.empty(2, 1, 2, 64, device="meta", dtype=F16),
                                  torch.empty(2, 1, 2, 64, device="meta", dtype=F16), True, 0.125),
            "attention_varlen": (torch.empty(30, 4, 64, device="meta", dtype=F16),
                                 torch.empty(50, 2, 64, device="meta", dtype=F16),
                                 torch.empty(50, 2, 64, device="meta", dtype=F16),
                                 torch.empty(3, device="meta", dtype=torch.int32),
                                 torch.empty(3, device="meta", dtype=torch.int32), 20, 30, True, 0.125)}[name]
    results = torch.library.opcheck(getattr(ops, name).default, args)
    assert set(results.values()) == {"SUCCESS"}, results


# --- gradients: the softmax's through softmax_backward; refused where there is no backward -------

@pytest.mark.parametrize("name", ["attention_colsum", "softmax_backward"])
def test_inputs_that_require_gradients_are_refused_while_autograd_records(name):
    meta = torch.empty(1, 2, 16, 64, device="meta", dtype=F16)
    needy = meta.clone().requires_grad_()
    call = {"softmax_backward": lambda a: ops.softmax_backward(meta, a, -1, False),
            "attention_colsum": lambda a: ops.attention_colsum(a, meta, meta, 4, True, 0.125, False)}[name]
    with pytest.raises(RuntimeError) as refused:
        call(needy)
    if name == "softmax_backward":
        assert "autosoft.softmax_backward has no backward" in str(refused.value)
    else:
        assert str(refused.value) == str(no_backward_error(name))
    with torch.no_grad():
        outs = call(needy)
    assert not any(t.requires_grad for t in (outs if isinstance(outs, tuple) else (outs,)))
    call(needy.detach())  # no input requires gradients: nothing to refuse


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_gradients_flow_through_the_softmax_backward_operator(log, dim):
    """Autograd records the operator with its output saved; backward (the softmax family's declared
    formula) calls softmax_backward with that output, the incoming gradient, the dim and the
    flavour (meta tensors: the fake paths)."""
    x = torch.empty(5, 7, 33, device="meta").requires_grad_()
    y = (ops.log_softmax if log else ops.softmax)(x, dim)
    assert y.requires_grad and y.shape == x.shape
    assert type(y.grad_fn).__name__ == ("log_softmax" if log else "softmax") + "_autogradBackward"
    with OperatorCalls("softmax_backward") as seen:
        (dx,) = torch.autograd.grad(y, x, torch.empty_like(y))
    assert [(tuple(c["y"].shape), tuple(c["dy"].shape), c["dim"], c["log"]) for c in seen.calls] == [
        ((5, 7, 33), (5, 7, 33), dim, log)]
    assert dx.shape == x.shape and dx.device.type == "meta"


def test_the_public_softmax_takes_the_operator_when_autograd_records_and_the_plan_otherwise(monkeypatch):
    import autosoft.api

    taken = []
    monkeypatch.setattr(autosoft.api, "_operator_call", lambda name, x, dim, out: taken.append((name, dim)) or x)
    monkeypatch.setattr(autosoft.api, "call_family", lambda *a, **k: taken.append("plan") or (None,))
    needy = torch.empty(4, 8, device="meta").requires_grad_()
    autosoft.softmax(needy)
    autosoft.log_softmax(needy, dim=0)
    with torch.no_grad():
        autosoft.softmax(needy)
    autosoft.softmax(needy.detach())
    assert taken == [("softmax", -1), ("log_softmax", 0), "plan", "plan"]


# --- attention's gradients: its declared formula calls attention_backward ------------------------

def test_the_attention_operator_declares_a_backward_that_saves_what_exists():
    """The formula reads schema arguments and the family's outputs by name: each name must be one
    of them (torch_ops would only find a wrong name when the first gradient is recorded)."""
    from autosoft.families import get_family

    declared = torch_ops.declared("attention")
    assert declared.backward is not None
    schema = ops.attention.default._schema
    arguments = [a.name for a in schema.arguments]
    outputs = get_family("attention").outputs
    saves = declared.backward.saves
    assert set(saves) <= set(arguments) | set(outputs), set(saves) - set(arguments) - set(outputs)
    # what attention_backward needs besides the incoming gradients: every input, both outputs, every option
    assert set(saves) == set(arguments) | {"o", "lse"}


@pytest.mark.parametrize("with_dlse", [False, True])
def test_fake_attention_backward_gives_dq_like_q_and_dk_dv_like_grouped_k(with_dlse):
    """GQA 8/2 with more keys than queries: dq follows q, dk and dv follow k (summed over the group)."""
    with FakeTensorMode():
        q, kv = fake_cuda(2, 8, 77, 64, dtype=BF16), fake_cuda(2, 2, 130, 64, dtype=BF16)
        lse = fake_cuda(2, 8, 77)
        dq, dk, dv = ops.attention_backward(q, kv, kv, q, q, lse, lse if with_dlse else None, True, 0.125,
                                            16, None, 30.0, True)
    assert (dq.shape, dq.dtype, dq.device.type) == ((2, 8, 77, 64), BF16, "cuda")
    assert (dk.shape, dv.shape, dk.dtype, dv.dtype) == ((2, 2, 130, 64), (2, 2, 130, 64), BF16, BF16)
    meta = torch.empty(1, 4, 9, 128, device="meta", dtype=F16)  # MQA on meta tensors
    meta_kv = torch.empty(1, 1, 9, 128, device="meta", dtype=F16)
    dq, dk, dv = ops.attention_backward(meta, meta_kv, meta_kv, meta, meta, meta[..., 0].float(), None, False, 0.1)
    assert (dq.shape, dk.shape, dv.shape) == ((1, 4, 9, 128), (1, 1, 9, 128), (1, 1, 9, 128))


def test_fake_attention_backward_refuses_an_lse_of_the_wrong_shape():
    with FakeTensorMode():
        q = fake_cuda(1, 2, 16, 64, dtype=F16)
        with pytest.raises(ValueError, match=r"autosoft\.attention_backward: lse must be \(B, H, N\)"):
            ops.attention_backward(q, q, q, q, q, fake_cuda(1, 2, 15), None, True, 0.125)


class OperatorCalls(TorchDispatchMode):
    """Records the arguments, by name, of each call of one autosoft operator that the dispatcher
    reaches: a spy that leaves torch.ops.autosoft as it is (torch looks an operator up there on its
    first fake call in a process, and would find a stand-in)."""

    def __init__(self, name: str):
        super().__init__()
        self.name, self.calls = f"autosoft.{name}.default", []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func) == self.name:
            self.calls.append({a.name: args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                               for i, a in enumerate(func._schema.arguments)})
        return func(*args, **kwargs)


def _needy(*shape):
    return torch.empty(shape, device="meta", dtype=BF16).requires_grad_()


@pytest.mark.parametrize("reads", ["o", "lse", "both"])
def test_attention_gradients_flow_through_attention_backward(reads):
    """autosoft.attention on tensors that require gradients records the operator; backward calls
    attention_backward with the saved inputs and outputs and the call's options. The gradient of an
    output the loss did not read is None: no dlse (the family's cheaper problem), or zeros for do."""
    q, k, v = _needy(2, 8, 33, 64), _needy(2, 2, 50, 64), _needy(2, 2, 50, 64)
    o, lse = autosoft.attention(q, k, v, causal=True, scale=0.3, return_lse=True, window=(16, None), softcap=20.0)
    assert type(o.grad_fn).__name__ == "attention_autogradBackward" and lse.requires_grad
    loss = {"o": [o], "lse": [lse], "both": [o, lse]}[reads]
    with OperatorCalls("attention_backward") as seen:
        grads = torch.autograd.grad(loss, (q, k, v), [torch.empty_like(t) for t in loss])
    assert [tuple(g.shape) for g in grads] == [(2, 8, 33, 64), (2, 2, 50, 64), (2, 2, 50, 64)]
    (call,) = seen.calls
    assert [tuple(call[name].shape) for name in ("q", "k", "v", "o", "do", "lse")] == [
        (2, 8, 33, 64), (2, 2, 50, 64), (2, 2, 50, 64), (2, 8, 33, 64), (2, 8, 33, 64), (2, 8, 33)]
    assert (call["dlse"] is None) == (reads == "o")
    options = [call[name] for name in ("causal", "window_left", "window_right", "softcap", "deterministic")]
    assert options == [True, 16, None, 20.0, False]
    assert call["scale"] == pytest.approx(0.3)


def test_the_deterministic_flag_of_torch_picks_the_deterministic_backward():
    q = _needy(1, 2, 16, 64)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        with OperatorCalls("attention_backward") as seen:
            for flag in (True, False):
                torch.use_deterministic_algorithms(flag)
                o = autosoft.attention(q, q, q)
                torch.autograd.grad(o, q, torch.empty_like(o))
    finally:
        torch.use_deterministic_algorithms(before)
    assert [call["deterministic"] for call in seen.calls] == [True, False]


def test_attention_on_cpu_tensors_that_require_gradients_fails_with_the_public_error():
    """Autograd records the operator, whose real implementation refuses a CPU tensor before any
    kernel: the public function's TypeError, not a result that looks right."""
    q = torch.randn(1, 2, 8, 64, dtype=F16, requires_grad=True)
    with pytest.raises(TypeError, match=r"^autosoft\.attention: q is a CPU tensor; move it to the GPU first"):
        autosoft.attention(q, q.detach(), q.detach(), causal=True)


def test_the_public_attention_takes_the_operator_when_autograd_records_and_the_plan_otherwise(monkeypatch):
    import autosoft.api

    taken = []
    monkeypatch.setattr(autosoft.api, "call_family", lambda *a, **k: taken.append("plan") or (None, None))
    q = _needy(1, 2, 16, 64)
    o = autosoft.attention(q, q, q, causal=True)
    with torch.no_grad():
        autosoft.attention(q, q, q)
    autosoft.attention(q.detach(), q.detach(), q.detach())
    assert o.requires_grad and taken == ["plan", "plan"]


def test_aot_autograd_traces_attentions_backward_through_attention_backward():
    """Training under torch.compile: the forward graph holds the attention operator and the backward
    graph one attention_backward with the call's options; lse is an output of the compiled function,
    so AOTAutograd gives it a tangent, which the graph passes as dlse."""
    torch._dynamo.reset()
    graphs, backend = _aot_graphs()

    def f(q, k, v):
        o, lse = autosoft.attention(q, k, v, causal=True, return_lse=True, window=(8, 4))
        return o * 2, lse

    q, k, v = _needy(1, 4, 16, 64), _needy(1, 2, 16, 64), _needy(1, 2, 16, 64)
    o, lse = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    grads = torch.autograd.grad((o, lse), (q, k, v), (torch.empty_like(o), torch.empty_like(lse)))
    assert [tuple(g.shape) for g in grads] == [(1, 4, 16, 64), (1, 2, 16, 64), (1, 2, 16, 64)]
    assert op_targets(graphs["forward"][0]) == ["autosoft.attention.default"]
    (node,) = [n for n in graphs["backward"][0].graph.nodes if "autosoft" in str(n.target)]
    assert str(node.target) == "autosoft.attention_backward.default"
    # dlse a tangent; causal, scale, the window; softcap None and deterministic False (the graph leaves defaults out)
    assert node.args[6] is not None and node.args[7:11] == (True, 0.125, 8, 4)
    assert tuple(node.args[11:]) == (None, False)[:len(node.args) - 11]
    torch._dynamo.reset()


def test_out_with_gradients_is_refused_as_torch_refuses_it():
    needy = torch.empty(4, 8, device="meta").requires_grad_()
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        autosoft.softmax(needy, out=torch.empty(4, 8, device="meta"))


def test_the_refusal_is_the_public_functions_error_for_attention_colsum():
    from autosoft.autograd import refuse_gradients

    needy = torch.empty(1, device="meta", requires_grad=True)
    with pytest.raises(RuntimeError) as public:
        refuse_gradients("attention_colsum", needy)
    assert str(public.value) == str(no_backward_error("attention_colsum"))


def test_compiling_a_call_on_inputs_that_require_gradients_fails_at_compile_time():
    meta = torch.empty(1, 2, 16, 64, device="meta", dtype=F16)
    compiled = torch.compile(lambda q, k, v: ops.attention_colsum(q, k, v, 4, True, 0.125, False)[0] * 2,
                             backend="eager", fullgraph=True)
    # Dynamo wraps an error of the fake run in its TorchRuntimeError (a RuntimeError) with ours in the message
    with pytest.raises(RuntimeError, match=r"autosoft\.attention_colsum has no backward yet"):
        compiled(meta, meta.clone().requires_grad_(), meta)
    with torch.no_grad():
        assert compiled(meta, meta.clone().requires_grad_(), meta).shape == (1, 2, 16, 64)


# --- torch.compile ------------------------------------------------------------------------------

class Model(torch.nn.Module):
    """Each operator, with torch work around it that the graph must also hold."""

    def forward(self, x, q, k, v):
        y = ops.softmax(x * 2, -1)
        o, lse = ops.attention(q, k, v, True, 0.125)
        o2, colsum, lse2 = ops.attention_colsum(q, k, v, 5, False, 0.125, True)
        return y + 1, o + o2, lse - lse2, colsum.sum(-1)


def record_graphs():
    """A torch.compile backend that keeps each FX graph and runs it as traced (here, on fake tensors)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def op_targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "autosoft" in str(n.target)]


def model_inputs(n=16, rows=7):
    return (fake_cuda(rows, 33), *[fake_cuda(2, 3, n, 64, dtype=F16) for _ in range(3)])


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_traces_the_three_operators_into_one_graph(no_kernels, dynamic):
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(Model(), backend=backend, fullgraph=True, dynamic=dynamic)
    with FakeTensorMode():
        y, o, lse, colsum = compiled(*model_inputs())
        assert [tuple(t.shape) for t in (y, o, lse, colsum)] == [(7, 33), (2, 3, 16, 64), (2, 3, 16), (2, 3)]
        assert (y.dtype, o.dtype, lse.dtype, colsum.dtype) == (F32, F16, F32, F32)
        compiled(*model_inputs(n=40, rows=9))  # other sizes: a new graph, or the same symbolic one
    assert op_targets(graphs[0]) == ["autosoft.softmax", "autosoft.attention", "autosoft.attention_colsum"]
    assert len(graphs) == (1 if dynamic else 2)
    torch._dynamo.reset()


def test_a_compiled_decode_step_holds_the_serving_operators(no_kernels):
    """A serving step under torch.compile(fullgraph=True): the packed prefill and the paged decode
    are one operator each, the decode's cache writes functionalized into the graph."""
    torch._dynamo.reset()
    graphs, backend = record_graphs()

    def step(packed, offsets, q, k_cache, v_cache, lengths, table, k_new, v_new):
        prefill = autosoft.attention_varlen(packed, packed, packed, offsets, offsets, 16, 16, causal=True)
        decode = autosoft.attention_kvcache(q, k_cache, v_cache, lengths, table, k_new, v_new)
        return prefill * 2, decode + 1

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with FakeTensorMode():
        prefill, decode = compiled(fake_cuda(30, 4, 64, dtype=F16), torch.empty(3, device="cuda", dtype=torch.int32),
                                   fake_cuda(2, 1, 8, 64, dtype=F16), fake_cuda(9, 16, 2, 64, dtype=F16),
                                   fake_cuda(9, 16, 2, 64, dtype=F16), torch.empty(2, device="cuda", dtype=torch.int32),
                                   torch.empty(2, 4, device="cuda", dtype=torch.int32), fake_cuda(2, 1, 2, 64, dtype=F16),
                                   fake_cuda(2, 1, 2, 64, dtype=F16))
        assert prefill.shape == (30, 4, 64) and decode.shape == (2, 1, 8, 64)
    assert op_targets(graphs[0]) == ["autosoft.attention_varlen.default", "autosoft.attention_kvcache.default"]
    torch._dynamo.reset()


@pytest.mark.parametrize("dim", [-1, 0])
def test_the_public_softmax_functions_trace_as_the_operators(no_kernels, dim):
    """While torch.compile traces, autosoft.softmax and autosoft.log_softmax call the operators
    (Dynamo cannot trace the plan path's Python: CuPy's device context, ctypes launches)."""
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(lambda x: autosoft.softmax(x, dim=dim) + autosoft.log_softmax(x, dim=dim),
                             backend=backend, fullgraph=True)
    with FakeTensorMode():
        assert compiled(fake_cuda(4, 8)).shape == (4, 8)
    assert op_targets(graphs[0]) == ["autosoft.softmax.default", "autosoft.log_softmax.default"]
    torch._dynamo.reset()


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_family_function_traces_as_its_families_operator(no_kernels, return_lse):
    """autosoft.attention_colsum is built from its family's python_call; while torch.compile traces,
    it calls the family's operator with the call's arrays, options and scalars by their names."""
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(lambda q, k, v: autosoft.attention_colsum(q, k, v, 5, causal=True, scale=0.25,
                                                                       return_lse=return_lse),
                             backend=backend, fullgraph=True)
    with FakeTensorMode():
        outs = compiled(*[fake_cuda(1, 2, 16, 64, dtype=F16) for _ in range(3)])
    assert [tuple(t.shape) for t in outs] == [(1, 2, 16, 64), (1, 2, 5)] + [(1, 2, 16)] * return_lse
    (node,) = [n for n in graphs[0].graph.nodes if "autosoft" in str(n.target)]
    assert str(node.target) == "autosoft.attention_colsum.default" and node.args[3:] == (5, True, 0.25, False)
    torch._dynamo.reset()


def test_dynamo_explain_counts_no_graph_break(no_kernels):
    torch._dynamo.reset()
    with FakeTensorMode():
        explained = torch._dynamo.explain(Model())(*model_inputs())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()


def test_aot_autograd_keeps_each_operator_as_one_node():
    """What Inductor receives: AOTAutograd's forward graph, with the operators as opaque calls."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    torch._dynamo.reset()
    forward_graphs = []

    def backend(gm, example_inputs):
        def forward_compiler(graph, inputs):
            forward_graphs.append(graph)
            return make_boxed_func(graph.forward)
        return aot_module_simplified(gm, example_inputs, fw_compiler=forward_compiler)

    meta = [torch.empty(7, 33, device="meta")] + [torch.empty(2, 3, 16, 64, device="meta", dtype=F16)] * 3
    outs = torch.compile(Model(), backend=backend, fullgraph=True)(*meta)
    assert [tuple(t.shape) for t in outs] == [(7, 33), (2, 3, 16, 64), (2, 3, 16), (2, 3)]
    assert op_targets(forward_graphs[0]) == ["autosoft.softmax.default", "autosoft.attention.default",
                                             "autosoft.attention_colsum.default"]
    torch._dynamo.reset()


TRACED_BAD_CALLS = [
    ("k and v of two shapes", lambda q, k, v: ops.attention(q, k, v, False, 0.1), [(1, 2, 16, 64)] * 2 + [(1, 2, 8, 64)],
     r"got ValueError\('autosoft\.attention: q must be \(B, H, N, D\) and k, v \(B, Hkv, Nkv, D\) of one shape"),
    ("split = N", lambda q, k, v: ops.attention_colsum(q, k, v, 16, True, 0.1, False), [(1, 2, 16, 64)] * 3,
     r"got ValueError\('autosoft\.attention_colsum: split=16 is outside 0 < split < N=16"),
    ("head dim 48", lambda q, k, v: ops.attention(q, k, v, True, 0.1), [(1, 2, 16, 48)] * 3,
     r"got ValueError\(\"autosoft\.attention: shape '1x2x16x48': head dim D=48 is not supported"),
]


@pytest.mark.parametrize("what, function, shapes, message", TRACED_BAD_CALLS, ids=[c[0] for c in TRACED_BAD_CALLS])
def test_bad_calls_fail_while_tracing(no_kernels, what, function, shapes, message):
    torch._dynamo.reset()
    compiled = torch.compile(function, backend="eager", fullgraph=True)
    with FakeTensorMode():
        with pytest.raises(RuntimeError, match=message):  # Dynamo's TorchRuntimeError, naming our error
            compiled(*[fake_cuda(*shape, dtype=F16) for shape in shapes])
    torch._dynamo.reset()


def test_the_public_attention_traces_as_the_operator(no_kernels):
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(lambda q, k, v: autosoft.attention(q, k, v, causal=True, return_lse=True),
                             backend=backend, fullgraph=True)
    with FakeTensorMode():
        o, lse = compiled(*[fake_cuda(1, 2, 16, 64, dtype=F16) for _ in range(3)])
        assert o.shape == (1, 2, 16, 64) and lse.shape == (1, 2, 16)
    assert op_targets(graphs[0]) == ["autosoft.attention.default"]
    torch._dynamo.reset()


@pytest.mark.parametrize("dynamic", [False, True])
def test_the_public_attention_traces_grouped_heads_window_and_softcap_as_one_operator_call(no_kernels, dynamic):
    """GQA with fewer queries than keys: o and lse follow q; the window and the cap are the
    operator's arguments in the graph (left given, right None: unbounded). With dynamic shapes
    another key length reuses the graph (the lengths are sizes, not constants of the trace)."""
    torch._dynamo.reset()
    graphs, backend = record_graphs()
    compiled = torch.compile(lambda q, k, v: autosoft.attention(q, k, v, causal=True, return_lse=True,
                                                                window=(64, None), softcap=30.0),
                             backend=backend, fullgraph=True, dynamic=dynamic)
    with FakeTensorMode():
        for keys in (77, 100):
            o, lse = compiled(fake_cuda(2, 8, 5, 64, dtype=BF16), fake_cuda(2, 2, keys, 64, dtype=BF16),
                              fake_cuda(2, 2, keys, 64, dtype=BF16))
            assert (o.shape, o.dtype, o.is_contiguous()) == ((2, 8, 5, 64), BF16, True)
            assert (lse.shape, lse.dtype) == ((2, 8, 5), F32)
    assert len(graphs) == (1 if dynamic else 2)
    (node,) = [n for n in graphs[0].graph.nodes if "autosoft" in str(n.target)]
    assert str(node.target) == "autosoft.attention.default"
    causal, _, window_left, window_right, softcap = node.args[3:]
    assert (causal, window_left, window_right, softcap) == (True, 64, None, 30.0)
    torch._dynamo.reset()


def test_opcheck_attention_with_grouped_heads_other_key_lengths_window_and_softcap():
    q = torch.empty(2, 8, 5, 64, device="meta", dtype=F16)
    kv = torch.empty(2, 2, 77, 64, device="meta", dtype=F16)
    for args, kwargs in (((q, kv, kv, True, 0.125, 16, 0, 30.0), {}),
                         ((q, kv, kv, False, 0.125), {"window_right": 3, "softcap": 5.0})):
        results = torch.library.opcheck(ops.attention.default, args, kwargs)
        assert set(results.values()) == {"SUCCESS"}, results


def test_aot_autograd_traces_the_backward_through_softmax_backward():
    """Training under torch.compile: AOTAutograd runs the operators' autograd kernels on its own fake
    tensors, so the forward graph holds softmax and log_softmax and the backward graph one
    softmax_backward for each, with its dim and flavour (meta tensors: the fake paths only)."""
    torch._dynamo.reset()
    graphs, backend = _aot_graphs()

    def f(x):
        return ops.softmax(x * 2, -1) + ops.log_softmax(x, 0)

    x = torch.empty(6, 33, device="meta").requires_grad_()
    y = torch.compile(f, backend=backend, fullgraph=True)(x)
    assert y.requires_grad and y.shape == (6, 33)
    (dx,) = torch.autograd.grad(y, x, torch.empty_like(y))
    assert dx.shape == (6, 33) and dx.device.type == "meta"
    assert op_targets(graphs["forward"][0]) == ["autosoft.softmax.default", "autosoft.log_softmax.default"]
    backward = [n for n in graphs["backward"][0].graph.nodes if "autosoft" in str(n.target)]
    assert sorted((str(n.target), n.args[2], n.args[3]) for n in backward) == \
        [("autosoft.softmax_backward.default", -1, False), ("autosoft.softmax_backward.default", 0, True)]
    torch._dynamo.reset()


def _aot_graphs():
    """A torch.compile backend that traces with AOTAutograd and keeps the forward and backward
    graphs it compiles, and the lists it keeps them in ({"forward": [...], "backward": [...]})."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    graphs = {"forward": [], "backward": []}

    def compiler(kind):
        def compile_graph(graph, inputs):
            graphs[kind].append(graph)
            return make_boxed_func(graph.forward)
        return compile_graph

    def backend(gm, example_inputs):
        return aot_module_simplified(gm, example_inputs, fw_compiler=compiler("forward"),
                                     bw_compiler=compiler("backward"))
    return graphs, backend
