"""The Python API: one short function per family over the generic array layer (arrays.call_family),
and load_cache for tuned kernels from another machine.

softmax and attention are written out here; any other family that declares a Python function
(`Family.python_call`) is served as `autosoft.<name>` by `family_function`, with that method's
signature and docstring, so a new family adds its function in its own module.

The functions are typed for type checkers (the package ships py.typed): torch in, torch out;
CuPy in, CuPy out (softmax: any other DLPack producer in, CuPy out); with return_lse=True a pair.
The torch overloads come first and name torch.Tensor alone: CuPy ships no type hints, so to a
user's mypy a CuPy array is Any, and a type variable constrained to torch.Tensor or cupy.ndarray
(as these were) then gave Any for torch calls too. Calls on CuPy arrays are Any unless the user
has CuPy stubs; with them, q, k and v of two kinds are a type error, as they are a TypeError at
run time (tests/test_typing.py checks both).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, TypeVar, overload

import numpy as np

from .arrays import call_along, call_family
from .autograd import through_operator
from .dispatch import DISPATCHER
from .errors import UserError
from .families import get_family
from .families.attention import call_options, check_scale

if TYPE_CHECKING:
    import cupy
    import torch

# A family function's array kind in its return annotation (help() shows it): the kind it was given
Array = TypeVar("Array", "torch.Tensor", "cupy.ndarray")


class DLPackArray(Protocol):
    """Any other array that hands its CUDA memory over through DLPack (the result is a CuPy array)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...


@overload
def softmax(x: torch.Tensor, dim: int = ..., out: torch.Tensor | None = ...) -> torch.Tensor: ...
@overload
def softmax(x: DLPackArray, dim: int = ..., out: cupy.ndarray | None = ...) -> cupy.ndarray: ...


def softmax(x: Any, dim: int = -1, out: Any = None) -> Any:
    """Softmax over dimension `dim` (default the last). x is a CUDA torch tensor (float32,
    float16, bfloat16), a CuPy array (float32, float16) or another DLPack CUDA producer; returns
    the same kind of array (a DLPack producer gives a CuPy array), shaped like x.

    The kernels work along the last dimension: for another `dim`, x is copied once with that
    dimension moved last, and the result is a view of that layout with it moved back (shaped like
    x, not contiguous). `out`: an array of x's kind, shape and dtype to write the result into,
    returned (written directly where it is contiguous, else copied in). A non-contiguous input is
    copied first; an empty input gives an empty output. Raises TypeError for host arrays,
    non-arrays and unsupported dtypes, ValueError for a scalar, IndexError for a dim out of range.

    Autograd: a torch tensor that requires gradients (while autograd records) goes through the
    operator torch.ops.autosoft.softmax, whose backward is the tuned softmax_backward family; so
    does any call while torch.compile traces, which then sees one operator (autosoft.torch_ops).

    Where `autosoft native` built the compiled extension, a call on a CUDA tensor along its last
    dim (-1 or its index) without `out` whose plan is recorded (by the first such call of its shape and dtype)
    allocates and launches from C++ (autosoft.native), with the same bits.
    """
    if not _compiling():
        y = _softmax_direct(x, dim, out)
        if y is not None:
            return y
    if through_operator(x):
        return _operator_call("softmax", x, dim, out)
    if type(dim) is int and dim == -1:
        return call_family("softmax", (x,), out=out)[0]
    return call_along("softmax", x, dim, out, None, "softmax")


LOG = {"log": True}  # the softmax family's problem options for the log-softmax


@overload
def log_softmax(x: torch.Tensor, dim: int = ..., out: torch.Tensor | None = ...) -> torch.Tensor: ...
@overload
def log_softmax(x: DLPackArray, dim: int = ..., out: cupy.ndarray | None = ...) -> cupy.ndarray: ...


def log_softmax(x: Any, dim: int = -1, out: Any = None) -> Any:
    """log(softmax(x)) over dimension `dim`, computed as x - max - log(sum(e^(x - max))): the
    softmax family's log variant, tuned as its own problems (`autosoft tune softmax --log`). The
    arrays, `dim` and `out` as for autosoft.softmax."""
    if not _compiling():
        y = _log_softmax_direct(x, dim, out)
        if y is not None:
            return y
    if through_operator(x):
        return _operator_call("log_softmax", x, dim, out)
    if type(dim) is int and dim == -1:
        return call_family("softmax", (x,), options=LOG, out=out, who="autosoft.log_softmax")[0]
    return call_along("softmax", x, dim, out, LOG, "log_softmax")


# softmax's and log_softmax's first step. Until a call on a CUDA torch tensor, a loader; then
# autosoft.native's compiled entries where the extension is built (they launch a recorded plan, or
# return None: the Python path below runs), else _no_direct. _compiling guards them: torch.compile
# would break its graph at a call into the extension; dynamo reads is_dynamo_compiling() as True.
def _no_direct(x: Any, dim: Any, out: Any) -> None:
    return None


def _softmax_first(x: Any, dim: Any, out: Any) -> Any:
    return _first_direct(0, x, dim, out)


def _log_softmax_first(x: Any, dim: Any, out: Any) -> Any:
    return _first_direct(1, x, dim, out)


def _torch_compiling() -> bool:
    torch = sys.modules.get("torch")  # never imported here: a CuPy user never loads torch
    return torch is not None and torch.compiler.is_dynamo_compiling()


def _first_direct(op: int, x: Any, dim: Any, out: Any) -> Any:
    """The first call on a CUDA torch tensor: take autosoft.native's entries (loading the extension
    where it is built) and run this call through the one for `op` (0 softmax, 1 log_softmax)."""
    global _softmax_direct, _log_softmax_direct, _compiling
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or not x.is_cuda:
        return None  # nothing to load for (CuPy arrays, host tensors: the Python path says what they are)
    # not `from . import native`: that asks the package's __getattr__ first, which looks for a family
    # function of that name through every family and plug-in (tens of milliseconds)
    from .native import direct

    _softmax_direct, _log_softmax_direct = direct(ask_again=_direct_reset) or (_no_direct, _no_direct)
    _compiling = torch.compiler.is_dynamo_compiling
    return (_softmax_direct, _log_softmax_direct)[op](x, dim, out)


def _direct_reset() -> None:
    """Ask autosoft.native again at the next call on a CUDA tensor (autosoft.native.enable calls
    it: the extension was built or enabled since)."""
    global _softmax_direct, _log_softmax_direct, _compiling
    _softmax_direct, _log_softmax_direct, _compiling = _softmax_first, _log_softmax_first, _torch_compiling


_softmax_direct: Callable[[Any, Any, Any], Any] = _softmax_first
_log_softmax_direct: Callable[[Any, Any, Any], Any] = _log_softmax_first
_compiling: Callable[[], bool] = _torch_compiling


def _operator_call(name: str, x: Any, dim: Any, out: Any) -> Any:
    from . import torch_ops  # registers the operators (torch is loaded: x is a tensor)

    if out is not None:  # as torch's own functions with out=
        raise RuntimeError(f"autosoft.{name}(): out= does not support automatic differentiation "
                           "(x requires grad); call it without out or under torch.no_grad()")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"autosoft.{name}: dim must be an int, got {type(dim).__name__}")
    return getattr(torch_ops, name)(x, dim)


Window = tuple[int | None, int | None]
"""attention's window: (left, right), the keys before and after each query's position it sees; None: no limit."""


@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = ..., scale: float | None = ...,
              return_lse: Literal[False] = ..., window: Window | None = ..., softcap: float | None = ...
              ) -> torch.Tensor: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = ..., scale: float | None = ..., *,
              return_lse: Literal[True], window: Window | None = ..., softcap: float | None = ...
              ) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
              return_lse: Literal[True], window: Window | None = ..., softcap: float | None = ...
              ) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = ..., scale: float | None = ...,
              return_lse: bool = ..., window: Window | None = ..., softcap: float | None = ...
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
@overload
def attention(q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, causal: bool = ..., scale: float | None = ...,
              return_lse: Literal[False] = ..., window: Window | None = ..., softcap: float | None = ...
              ) -> cupy.ndarray: ...
@overload
def attention(q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, causal: bool = ..., scale: float | None = ..., *,
              return_lse: Literal[True], window: Window | None = ..., softcap: float | None = ...
              ) -> tuple[cupy.ndarray, cupy.ndarray]: ...
@overload
def attention(q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, causal: bool, scale: float | None,
              return_lse: Literal[True], window: Window | None = ..., softcap: float | None = ...
              ) -> tuple[cupy.ndarray, cupy.ndarray]: ...
@overload
def attention(q: cupy.ndarray, k: cupy.ndarray, v: cupy.ndarray, causal: bool = ..., scale: float | None = ...,
              return_lse: bool = ..., window: Window | None = ..., softcap: float | None = ...
              ) -> cupy.ndarray | tuple[cupy.ndarray, cupy.ndarray]: ...


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None,
              return_lse: bool = False, window: Any = None, softcap: float | None = None) -> Any:
    """softmax(s) v over the keys each query sees, s = scale * q kᵀ, for q (B, Hq, Nq, D) and k, v
    (B, Hkv, Nkv, D): CUDA torch tensors (float16, bfloat16) or CuPy float16 arrays, D in 32, 64,
    96, 128, 256; Hq a multiple of Hkv (grouped-query attention; Hkv = 1: multi-query), Nq and
    Nkv independent. Returns o (B, Hq, Nq, D) like q, contiguous, or (o, lse) with
    return_lse=True: lse (B, Hq, Nq) float32, the natural log-sum-exp of each query's scores.

    Which keys query i sees: query i stands at key position i + Nkv - Nq (aligned bottom-right,
    as FlashAttention >= 2.1: prefill with a KV cache, decoding). causal=True hides the keys after
    that position; note that torch's scaled_dot_product_attention(is_causal=True) aligns top-left
    instead, which differs when Nq != Nkv. window=(left, right) keeps only the keys from `left`
    before to `right` after that position, both included (ints >= 0; either may be None: no limit
    on that side; causal=True caps right at 0). softcap=c (positive, finite) turns every score s
    into c * tanh(s / c) before the softmax (Gemma 2). A query that sees no key (with Nq > Nkv,
    the first queries under causal or a right limit) gets o = 0 and lse = -inf, never NaN. A
    window that is not None or such a pair (bool is no int), or a softcap that is not None or such
    a number, raises TypeError or ValueError naming it, before any kernel or device is touched.

    scale defaults to 1/sqrt(D) and must be positive. Arrays whose last dimension is contiguous
    are taken as they are, whatever their other strides (e.g. q, k, v of a fused QKV projection
    seen as (B, N, H, D) and transposed to (B, H, N, D)): their strides go to the kernel, no copy.
    Others, and addresses or strides that are not multiples of 16 bytes, are copied first.

    Autograd: torch tensors that require gradients (while autograd records) go through the
    operator torch.ops.autosoft.attention, whose backward is the tuned attention_backward family
    (dq, and dk, dv summed over each KV head's query heads); so does any call while torch.compile
    traces, which then sees one operator (autosoft.torch_ops), forward and backward, and both can
    be captured in a CUDA graph. o and lse both carry gradients: a loss may read lse too
    (return_lse=True). With torch.use_deterministic_algorithms(True) the backward takes the
    variants whose dq is the same bits on every run (dk and dv always are)."""
    head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
    scale = check_scale(scale, head_dim, "autosoft.attention")
    options = call_options(causal, window, softcap)
    if through_operator(q, k, v):  # autograd records it, or torch.compile sees one operator
        from . import torch_ops

        o, lse = torch_ops.attention(q, k, v, bool(causal), scale, options.get("window_left"),
                                     options.get("window_right"), options.get("softcap"))
    else:
        o, lse = call_family("attention", (q, k, v), options=options, scalars={"scale": np.float32(scale)})
    return (o, lse) if return_lse else o


def load_cache(path: str | os.PathLike[str]) -> int:
    """Use the tuned kernels of a cache file from another machine; returns the number of entries.
    UserError for a folder, a missing file or one that is no cache (the file is never changed);
    TypeError for anything but a path."""
    if isinstance(path, (str, os.PathLike)) and not isinstance(path, bytes) and os.fspath(path) \
            and Path(path).expanduser().is_dir():
        # said here, in the caller's terms: the cache's own message speaks to the command line (--cache)
        raise UserError(f"autosoft.load_cache: {os.fspath(path)!r} is a folder; give the path of a cache file "
                        f"(the kernels.sqlite that `autosoft tune` writes)")
    return DISPATCHER.load_cache(path)


GENERIC_RETURNS = "Array | tuple[Array, ...]"
"""A family function's return annotation where its family declares none (python_returns): the
outputs the call names, one alone, several as a tuple, each of the kind of array given."""


def family_function_names() -> list[str]:
    """The names of every family's public functions, sorted: declared calls and hand-written ones."""
    from .families import families

    names = set()
    for family_name, family in families().items():
        if family.has_python_call:
            names.add(family_name)
        names.update(path.rpartition(":")[2] for path in family.public_functions)
    return sorted(names)


def _public_function(name: str) -> Callable[..., Any] | None:
    """The hand-written function `name` a family declares (Family.public_functions), imported."""
    from .families import families

    for family in families().values():
        for path in family.public_functions:
            module, _, function = path.partition(":")
            if function == name:
                return getattr(importlib.import_module(module), function)
    return None


def run_call(name: str, inputs: tuple[str, ...], call: Any, traced: bool = True) -> tuple[Any, ...]:
    """The outputs of the family `name` for a call (Family.python_call's Call): through its torch
    operator where it has one (`traced`) and through_operator says so (torch.compile traces, or
    autograd records), else through the array layer."""
    if traced and through_operator(*call.arrays):
        from . import torch_ops

        return torch_ops.call_operator(name, inputs, call.arrays, call.options, call.scalars)
    return call_family(name, call.arrays, options=call.options, scalars=call.scalars)


@functools.lru_cache(maxsize=None)
def family_function(name: str) -> Callable[..., Any]:
    """autosoft.<name>: the Python function of the family `name`, built from its python_call (its
    parameters and docstring; its return annotation the family's `python_returns`, else
    GENERIC_RETURNS). Where the family declares an operator of the same name (autosoft.torch_ops),
    a call goes through it while torch.compile traces (the graph holds one operator) and while
    autograd records a tensor that requires gradients (the operator's declared backward, or its
    refusal). A function a family writes by hand (Family.public_functions) is returned as it is.
    LookupError where no family of that name declares a Python function."""
    written = _public_function(name)
    if written is not None:
        return written
    try:
        family = get_family(name)
    except UserError:
        raise LookupError(f"no family {name!r}") from None
    if not family.has_python_call:
        raise LookupError(f"the {name} family declares no Python function")
    python_call, inputs, outputs = family.python_call, family.inputs, family.outputs
    traced = any(op.name == name and op.family == name for op in getattr(family, "torch_operators", ()))

    @functools.wraps(python_call)
    def function(*args: Any, **kwargs: Any) -> Any:
        call = python_call(*args, **kwargs)
        results = dict(zip(outputs, run_call(name, inputs, call, traced)))
        picked = tuple(results[n] for n in call.returns)
        return picked[0] if len(picked) == 1 else picked

    returns = getattr(family, "python_returns", None) or GENERIC_RETURNS
    function.__name__ = function.__qualname__ = name
    function.__module__ = "autosoft"
    function.__annotations__ = {**python_call.__annotations__, "return": returns}
    function.__signature__ = inspect.signature(python_call).replace(return_annotation=returns)  # type: ignore[attr-defined]
    return function
