"""autosoft's functions as torch custom operators, for autograd, torch.compile and CUDA graphs.

    import autosoft.torch_ops                     # registers the operators (imports torch)
    y = torch.ops.autosoft.softmax(x, -1)         # and log_softmax(x, dim)
    dx = torch.ops.autosoft.softmax_backward(y, dy, -1, False)   # log=True: the log-softmax's
    o, lse = torch.ops.autosoft.attention(q, k, v, causal, scale, window_left, window_right, softcap)
                                                  # the last three optional (None: no limit, no cap)
    o, colsum, lse = torch.ops.autosoft.attention_colsum(q, k, v, split, causal, scale, deterministic)

Called as plain Python, autosoft is something torch.compile cannot see into and autograd cannot
differentiate. The operators below are defined with a `torch.library.Library` (schemas tagged
pt2_compliant_tag; none mutates its inputs), each with

- its real implementation for every backend (CompositeExplicitAutograd), the public function's
  own path (`arrays.call_family` and `arrays.call_along` with the options and scalars the public
  functions pass: same kernels, same plans, same errors, launched on torch's current stream,
  outputs allocated by torch: what a CUDA graph capture needs); softmax and log_softmax along
  the last dim take call_family's cached plan under call_family's own key, nothing else checked
  (the schema already made x a tensor and dim an int; a first call goes through call_family);
- a fake implementation (`torch.library.register_fake`, also the Meta kernel) that checks what
  can be checked without data (device, dtypes, shapes, dim, 0 < split < N, scale > 0, window
  sides >= 0, softcap > 0) with the errors of the real path, and returns empty tensors laid out
  as the real outputs are (contiguous; along a dim other than the last, the moved layout's view;
  attention's o and lse shaped by q, whatever k's and v's head count and length), which
  torch.compile traces with;
- an Autograd kernel of its own (`_autograd_kernel`, for every autograd key): softmax and
  log_softmax, with grad mode on and an input that requires gradients, run an autograd.Function
  that saves the output and differentiates through the softmax_backward operator (the tuned
  softmax_backward family: dx = y (dy - sum(dy y)), or for the log-softmax dx = dy - e^y sum(dy));
  AOTAutograd traces it, so a compiled model's backward graph holds softmax_backward. The others
  refuse such calls before anything runs (attention has no backward yet, softmax_backward no
  second derivative): RuntimeError (autograd.no_backward_error) in eager mode, and at compile
  time under torch.compile, where Dynamo runs the operator on fake tensors that require gradients.

Why not `torch.library.custom_op` (as before issue 19): on a 2-core CPU host with torch 2.13
(benchmarks/op_dispatch.py: a trivial implementation on a CPU tensor, dispatch cost over calling
it directly) custom_op's dispatch cost 9-14 us per call (about 20 us on the H200 host of
BENCHMARKS.md), `register_autograd` on a Library op 7-10 us, this registration 3-4.5 us, of which
2-3.5 us is the dispatcher's floor (a Library op with no Autograd kernel at all costs that: the C++
dispatcher and one call into Python and back). A call that needs no gradient costs one Python
hop: the Autograd kernel calls the real implementation itself where the dispatcher would call it
next, that is where the call's dispatch key set (passed to the kernel, memoised by its bits) names
the CPU or CUDA backend after autograd, with nothing between (no tensor subclass such as
FakeTensor, no dispatch mode, no functionalization or functorch layer). Anything else (fake or
meta tensors while tracing, modes) is redispatched below autograd, exactly as custom_op's kernel
always redispatches. Under torch.inference_mode() the dispatcher skips the Autograd kernel and
calls the real one.

The public functions go through these operators when they must: `autosoft.softmax` and
`autosoft.log_softmax` on a tensor that requires gradients while autograd records, and while
torch.compile traces (api._through_operator). Otherwise they take the plan path directly, which
has no dispatcher in between. `autosoft` itself never imports torch, so a CuPy user never loads
it; importing this module registers the operators (`register()`, once per process).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from . import native
from .arrays import call_along, call_family
from .autograd import no_backward_error
from .dispatch import DISPATCHER
from .dtypes import TORCH_NAMES
from .families import get_family
from .families.attention import call_options
from .families.base import OptionValue

if TYPE_CHECKING:
    import torch

__all__ = ["register", "softmax", "log_softmax", "softmax_backward", "attention", "attention_colsum", "OPS"]

OPS = ("softmax", "log_softmax", "softmax_backward", "attention", "attention_colsum")
"""The operators' names in torch.ops.autosoft: one per public function, and the softmax backward."""

# the operators' default overloads (torch.ops.autosoft.<name>.default), set by register()
softmax: Any = None
log_softmax: Any = None
softmax_backward: Any = None
attention: Any = None
attention_colsum: Any = None

_lock = threading.Lock()
_registered = False
_lib: Any = None  # the torch.library.Library that holds the registrations (they last as long as it does)

_SCHEMAS = {
    "softmax": "(Tensor x, int dim) -> Tensor",
    "log_softmax": "(Tensor x, int dim) -> Tensor",
    "softmax_backward": "(Tensor y, Tensor dy, int dim, bool log) -> Tensor",
    "attention": "(Tensor q, Tensor k, Tensor v, bool causal, float scale, int? window_left=None, "
                 "int? window_right=None, float? softcap=None) -> (Tensor o, Tensor lse)",
    "attention_colsum": "(Tensor q, Tensor k, Tensor v, int split, bool causal, float scale, bool deterministic) "
                        "-> (Tensor o, Tensor colsum, Tensor lse)",
}


def register() -> None:
    """Register the operators torch.ops.autosoft.{softmax, log_softmax, softmax_backward, attention,
    attention_colsum}, once per process (later calls, from any thread, do nothing). Imports torch;
    ImportError where torch is missing or older than torch.library.register_fake (torch 2.4)."""
    global _registered, _lib, softmax, log_softmax, softmax_backward, attention, attention_colsum
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch

        if not hasattr(torch.library, "register_fake"):
            raise ImportError(f"autosoft.torch_ops needs torch.library.register_fake (torch >= 2.4); this is torch "
                              f"{torch.__version__}")
        lib = torch.library.Library("autosoft", "DEF")
        for name in OPS:
            lib.define(name + _SCHEMAS[name], tags=(torch.Tag.pt2_compliant_tag,))
        kernels = {}
        for name in OPS:
            real, fake = _IMPLS[name]
            # every backend: a CPU tensor reaches the real path, which refuses it with the public function's error
            lib.impl(name, real, "CompositeExplicitAutograd")
            torch.library.register_fake(f"autosoft::{name}", fake, lib=lib)  # also the Meta kernel
            op = getattr(torch.ops.autosoft, name).default
            kernel = kernels[name] = _autograd_kernel(torch, name, op, real, _PLAN_OPTIONS.get(name))
            lib.impl(name, kernel, "Autograd", with_keyset=True)
        _lib = lib
        # where `autosoft native` built them: compiled AutogradCUDA kernels for softmax and
        # log_softmax, which fall back on the Python kernels above for what they do not take
        native.enable({name: (kernels[name], _PLAN_OPTIONS[name]) for name in native.OPS})
        ops = torch.ops.autosoft
        softmax, log_softmax = ops.softmax.default, ops.log_softmax.default
        softmax_backward = ops.softmax_backward.default
        attention, attention_colsum = ops.attention.default, ops.attention_colsum.default
        _registered = True


# --- the autograd kernels: the one Python hop of a call ---------------------------------------
#
# The dispatcher runs an operator's Autograd kernel first (unless inference mode or a
# no-autograd guard excludes it), for every device. Each kernel here:
# - with grad mode on and an input that requires gradients: softmax and log_softmax run their
#   autograd.Function (forward below autograd, backward the softmax_backward operator); the others
#   refuse before anything runs (no_backward_error), in eager mode and, under torch.compile, when
#   Dynamo runs the operator on fake tensors, that is at compile time;
# - otherwise, where the dispatcher's next kernel would be the real implementation (the call's key
#   set, after autograd, names the CPU or CUDA backend and nothing above it: no tensor subclass,
#   no dispatch mode, no functionalization or functorch layer), calls that implementation itself:
#   one Python hop for the whole call;
# - otherwise (fake tensors while tracing, meta tensors, modes, ...), redispatches below autograd,
#   as torch.library.custom_op's autograd kernel always does.

_DIRECT: dict[int, bool] = {}  # a call's dispatch key set (its raw bits) -> whether its next kernel is the real one


def _goes_to_real(torch: Any) -> Any:
    """direct(keyset) -> whether the dispatcher would call the real implementation next, memoised
    in _DIRECT (the kernels look there first: a key set's bits are one cheap call, its highest
    key after autograd several)."""
    after = torch._C._after_ADInplaceOrView_keyset  # ADInplaceOrView: a fallthrough for these operators
    backends = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)

    def direct(keyset: Any) -> bool:
        known = _DIRECT[keyset.raw_repr()] = (keyset & after).highestPriorityTypeId() in backends
        return known

    return direct


def _autograd_kernel(torch: Any, name: str, op: Any, real: Any, plan_options: tuple | None = None) -> Any:
    """The Autograd kernel of operator `name` (the OpOverload `op`, whose real implementation is
    `real`), as lib.impl(..., "Autograd", with_keyset=True) takes it: kernel(keyset, *args).
    plan_options (softmax and log_softmax): the softmax family's options as call_family keys its
    plans; a call along the last dim then takes the plan straight from call_family's cache, as
    _softmax does, one Python frame fewer."""
    direct = _goes_to_real(torch)
    below, after_autograd = torch._C._AutoDispatchBelowAutograd, torch._C._after_autograd_keyset
    grad_enabled, any_requires_grad = torch._C.is_grad_enabled, torch._C._any_requires_grad
    known = _DIRECT.get  # written out in each kernel below: every call saved is ~0.1 us of the hot path

    def redispatch(keyset: Any, *args: Any) -> Any:
        with below():
            return op.redispatch(keyset & after_autograd, *args)

    if name in ("softmax", "log_softmax"):
        log = name == "log_softmax"

        class Function(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, dim: int, keyset: Any) -> Any:  # type: ignore[override]
                to_real = known(keyset.raw_repr())
                if to_real is None:
                    to_real = direct(keyset)
                y = real(x, dim) if to_real else redispatch(keyset, x, dim)
                ctx.save_for_backward(y)  # dx needs only y (and dy)
                ctx.dim = dim
                return y

            @staticmethod
            def backward(ctx: Any, dy: Any) -> Any:  # type: ignore[override]
                (y,) = ctx.saved_tensors
                # the module's attribute, looked up here: the operator, or a test's stand-in for it
                return softmax_backward(y, dy, ctx.dim, log), None, None

        Function.__name__ = Function.__qualname__ = f"{name}_autograd"
        apply = Function.apply

        def softmax_kernel(keyset: Any, x: Any, dim: int) -> Any:
            if grad_enabled() and x.requires_grad:
                return apply(x, dim, keyset)
            to_real = known(keyset.raw_repr())
            if to_real or (to_real is None and direct(keyset)):
                return real(x, dim)
            return redispatch(keyset, x, dim)

        if plan_options is None:
            return softmax_kernel
        plans = DISPATCHER.fast  # load_cache and forget clear it; it is never replaced

        def softmax_plan_kernel(keyset: Any, x: Any, dim: int) -> Any:
            # softmax_kernel with _softmax's hot path written in: the operator's whole Python, per call
            if grad_enabled() and x.requires_grad:
                return apply(x, dim, keyset)
            to_real = known(keyset.raw_repr())
            if to_real or (to_real is None and direct(keyset)):
                if dim == -1:
                    plan = plans.get(("softmax", plan_options, (), x.dtype, x.shape, x.get_device()))
                    if plan is not None:
                        return plan((x,), ())[0]
                return real(x, dim)
            return redispatch(keyset, x, dim)

        return softmax_plan_kernel

    def refusing_kernel(keyset: Any, *args: Any) -> Any:
        # No backward: without this refusal, outputs of inputs that require gradients would carry
        # none, and backward() would fail far from the call (or a model silently stop learning).
        if grad_enabled() and any_requires_grad(*args):
            raise _no_backward(name)
        to_real = known(keyset.raw_repr())
        if to_real or (to_real is None and direct(keyset)):
            return real(*args)
        return redispatch(keyset, *args)

    return refusing_kernel


def _no_backward(name: str) -> RuntimeError:
    """autograd.refuse_gradients' error; for the softmax backward, that it has no backward itself."""
    if name == "softmax_backward":
        return RuntimeError("autosoft.softmax_backward has no backward (the softmax's second derivative); "
                            "use torch.softmax where it is needed")
    return no_backward_error(name)


# --- the real implementations: the public functions' calls ------------------------------------

def _check_scale(name: str, scale: float) -> None:
    if not scale > 0:  # the kernel tracks the running max of the unscaled scores
        raise ValueError(f"autosoft.{name}: scale must be positive, got {scale}")


def _softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if dim == -1:
        # The hot path. The schema made x a tensor and dim an int; call_family's cached plan under
        # call_family's own key (the same plan autosoft.softmax takes); a first call prepares it there.
        plan = DISPATCHER.fast.get(("softmax", (), (), x.dtype, x.shape, x.get_device()))
        if plan is not None:
            return plan((x,), ())[0]
        return call_family("softmax", (x,))[0]
    return call_along("softmax", x, dim, None, None, "softmax")


def _log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    if dim == -1:  # as _softmax
        plan = DISPATCHER.fast.get(("softmax", _LOG_KEY, (), x.dtype, x.shape, x.get_device()))
        if plan is not None:
            return plan((x,), ())[0]
        return call_family("softmax", (x,), options=LOG, who="autosoft.log_softmax")[0]
    return call_along("softmax", x, dim, None, LOG, "log_softmax")


def _softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    """dx of the softmax (log: the log-softmax) along dim from its output y and dy: the family works
    on the last dimension, so another dim is moved last (a copy of y and dy) and back (a view)."""
    last = _last_dim("softmax_backward", y, dim)
    if y.shape != dy.shape:
        raise ValueError(f"autosoft.softmax_backward: y {tuple(y.shape)} and dy {tuple(dy.shape)} differ in shape")
    if last != y.dim() - 1:
        y, dy = y.movedim(last, -1), dy.movedim(last, -1)
    options = {"log": True} if log else None
    dx = call_family("softmax_backward", (y, dy), options=options)[0]
    return dx if last == dx.dim() - 1 else dx.movedim(-1, last)


def _last_dim(who: str, x: Any, dim: int) -> int:
    """dim as a non-negative index of x's dimensions; IndexError outside them."""
    ndim = max(x.dim(), 1)
    if not -ndim <= dim < ndim:
        raise IndexError(f"autosoft.{who}: dim {dim} is out of range for a {x.dim()}-dimensional input "
                         f"(expected {-ndim} to {ndim - 1})")
    return dim % ndim


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
               window_left: int | None = None, window_right: int | None = None,
               softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_scale("attention", scale)
    o, lse = call_family("attention", (q, k, v), options=_attention_options(causal, window_left, window_right, softcap),
                         scalars={"scale": np.float32(scale)})
    return o, lse


def _attention_options(causal: bool, window_left: int | None, window_right: int | None,
                       softcap: float | None) -> dict[str, OptionValue]:
    """The options autosoft.attention passes for the same arguments (with its errors: the schema
    already made the window sides ints and softcap a float, so only the ValueErrors remain)."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return call_options(causal, window, softcap)


def _attention_colsum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: int, causal: bool, scale: float,
                      deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_scale("attention_colsum", scale)
    o, colsum, lse = call_family("attention_colsum", (q, k, v), options=_colsum_options(split, causal, deterministic),
                                 scalars={"scale": np.float32(scale)})
    return o, colsum, lse


def _colsum_options(split: int, causal: bool, deterministic: bool) -> dict[str, OptionValue]:
    """As AttentionColsumFamily.python_call builds them."""
    return {"causal": bool(causal), "split": int(split), "deterministic": bool(deterministic)}


# --- the fake implementations: shapes, dtypes and the errors that need no data ----------------

def _fake_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _fake_along("softmax", x, dim, {})


def _fake_log_softmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _fake_along("log_softmax", x, dim, LOG)


def _fake_along(who: str, x: torch.Tensor, dim: int, options: Mapping[str, OptionValue]) -> torch.Tensor:
    """y as the real path lays it out: contiguous for the last dim, else the moved layout's view."""
    last = _last_dim(who, x, dim)
    if last == max(x.dim(), 1) - 1:
        return _fake_outputs("softmax", (x,), options)[0]
    return _fake_outputs("softmax", (x.movedim(last, -1),), options)[0].movedim(-1, last)


def _fake_softmax_backward(y: torch.Tensor, dy: torch.Tensor, dim: int, log: bool) -> torch.Tensor:
    last = _last_dim("softmax_backward", y, dim)
    if y.shape != dy.shape:
        raise ValueError(f"autosoft.softmax_backward: y {tuple(y.shape)} and dy {tuple(dy.shape)} differ in shape")
    options = {"log": True} if log else {}
    if last == max(y.dim(), 1) - 1:
        return _fake_outputs("softmax_backward", (y, dy), options)[0]
    moved = _fake_outputs("softmax_backward", (y.movedim(last, -1), dy.movedim(last, -1)), options)[0]
    return moved.movedim(-1, last)


def _fake_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    window_left: int | None = None, window_right: int | None = None,
                    softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_scale("attention", scale)
    o, lse = _fake_outputs("attention", (q, k, v), _attention_options(causal, window_left, window_right, softcap))
    return o, lse


def _fake_attention_colsum(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, split: int, causal: bool,
                           scale: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_scale("attention_colsum", scale)
    o, colsum, lse = _fake_outputs("attention_colsum", (q, k, v), _colsum_options(split, causal, deterministic))
    return o, colsum, lse


def _fake_outputs(name: str, arrays: Sequence[torch.Tensor], options: Mapping[str, OptionValue]) -> list[torch.Tensor]:
    """The checks of arrays._prepare that need no data, in its order and with its errors, then
    empty contiguous outputs in the order of the family's outputs.

    Device: CUDA, or meta (meta tensors only ever reach this implementation: shape inference
    with a model built on the meta device works); CPU and other devices are refused as the real
    path refuses them. Shapes: the family's caller_outputs on the (possibly symbolic) shapes, so
    q, k, v that must agree and 0 < split < N become guards of a dynamic-shape graph; the
    family's problem checks (head dim, size limits) on the example sizes only (symbolic sizes'
    hints: no guards, no specialisation), which the real implementation checks again each call."""
    import torch

    family = get_family(name)
    who = f"autosoft.{name}"
    names = [n for n in family.inputs][:len(arrays)]
    for n, a in zip(names, arrays):
        if a.device.type not in ("cuda", "meta"):
            raise TypeError(f"{who}: {n} is a CPU tensor; move it to the GPU first ({n}.cuda())")
    if len({a.device for a in arrays}) != 1:
        raise ValueError(f"{who}: {', '.join(names)} must be on one device")
    if len({str(a.dtype) for a in arrays}) > 1:
        raise TypeError(f"{who}: {', '.join(names)} must share one dtype, got {', '.join(str(a.dtype) for a in arrays)}")
    dtype = TORCH_NAMES.get(str(arrays[0].dtype))
    if dtype not in family.dtypes:
        raise TypeError(f"{who}: unsupported dtype {arrays[0].dtype}; use {' or '.join(family.dtypes)}")
    outputs = family.caller_outputs({n: tuple(a.shape) for n, a in zip(names, arrays)}, dtype, options)
    hinted = {n: tuple(_hint(s) for s in a.shape) for n, a in zip(names, arrays)}
    if all(s is not None for shape in hinted.values() for s in shape) and \
            not any(0 in shape for shape in hinted.values()):
        family.problem_for(hinted, dtype, options)  # type: ignore[arg-type]  # no Nones here
    torch_dtypes = {v: getattr(torch, v) for v in TORCH_NAMES.values()}
    first = arrays[0]
    return [first.new_empty(shape, dtype=torch_dtypes[dt]) for shape, dt in (outputs[o] for o in family.outputs)]


def _hint(size: Any) -> int | None:
    """An int size as it is; a symbolic one's example value (None where it has none) without a guard."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return hint if isinstance(hint, int) else None


LOG = {"log": True}  # the softmax family's problem options for the log-softmax (as api.LOG)
_LOG_KEY = tuple(LOG.items())  # as call_family puts them in its plan key
_PLAN_OPTIONS = {"softmax": (), "log_softmax": _LOG_KEY}  # the softmax family's options in its plan keys

_IMPLS = {"softmax": (_softmax, _fake_softmax), "log_softmax": (_log_softmax, _fake_log_softmax),
          "softmax_backward": (_softmax_backward, _fake_softmax_backward), "attention": (_attention, _fake_attention),
          "attention_colsum": (_attention_colsum, _fake_attention_colsum)}

register()
