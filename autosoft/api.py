"""The Python API: one short function per family over the generic array layer (arrays.call_family),
and load_cache for tuned kernels from another machine.

softmax and attention are written out here; any other family that declares a Python function
(`Family.python_call`) is served as `autosoft.<name>` by `family_function`, with that method's
signature and docstring, so a new family adds its function in its own module.

The functions are typed for type checkers (the package ships py.typed): torch in, torch out;
CuPy in, CuPy out (softmax: any other DLPack producer in, CuPy out); with return_lse=True a pair.
q, k and v of two kinds are a type error, as they are a TypeError at run time.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, TypeVar, overload

import numpy as np

from .arrays import as_cupy, call_family
from .autograd import refuse_gradients
from .dispatch import DISPATCHER
from .errors import UserError
from .families import get_family

if TYPE_CHECKING:
    import cupy
    import torch

# The array kinds a call returns as it got them (a constrained type variable: both of torch, or both of CuPy)
Array = TypeVar("Array", "torch.Tensor", "cupy.ndarray")


class DLPackArray(Protocol):
    """Any other array that hands its CUDA memory over through DLPack (the result is a CuPy array)."""

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any: ...


@overload
def softmax(x: Array, dim: int = ..., out: Array | None = ...) -> Array: ...
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
    """
    if type(dim) is int and dim == -1:
        return call_family("softmax", (x,), out=out)[0]
    return _along(x, dim, out, None, "softmax")


@overload
def log_softmax(x: Array, dim: int = ..., out: Array | None = ...) -> Array: ...
@overload
def log_softmax(x: DLPackArray, dim: int = ..., out: cupy.ndarray | None = ...) -> cupy.ndarray: ...


_LOG = {"log": True}


def log_softmax(x: Any, dim: int = -1, out: Any = None) -> Any:
    """log(softmax(x)) over dimension `dim`, computed as x - max - log(sum(e^(x - max))): the
    softmax family's log variant, tuned as its own problems (`autosoft tune softmax --log`). The
    arrays, `dim` and `out` as for autosoft.softmax."""
    if type(dim) is int and dim == -1:
        return call_family("softmax", (x,), options=_LOG, out=out)[0]
    return _along(x, dim, out, _LOG, "log_softmax")


def _along(x: Any, dim: Any, out: Any, options: dict[str, Any] | None, who: str) -> Any:
    """The softmax family along `dim`: the last directly, another moved last (one copy), computed,
    moved back."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)):
        raise TypeError(f"autosoft.{who}: dim must be an int, got {type(dim).__name__}")
    shape = getattr(x, "shape", None)
    if shape is None:
        return call_family("softmax", (x,), options=options)[0]  # the array layer says what x is not
    ndim = len(shape)
    if not -max(ndim, 1) <= dim < max(ndim, 1):
        raise IndexError(f"autosoft.{who}: dim {dim} is out of range for a {ndim}-dimensional input "
                         f"(expected {-max(ndim, 1)} to {max(ndim, 1) - 1})")
    dim = int(dim) % ndim if ndim else 0
    if dim == ndim - 1 or ndim == 0:
        return call_family("softmax", (x,), options=options, out=out)[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        y = call_family("softmax", (x.movedim(dim, -1),), options=options)[0].movedim(-1, dim)
    else:
        import cupy  # as_cupy has made sure it is there: x is a CuPy array or a CUDA DLPack producer

        x = as_cupy(get_family("softmax"), [x])[0]
        y = cupy.moveaxis(call_family("softmax", (cupy.moveaxis(x, dim, -1),), options=options)[0], -1, dim)
    if out is None:
        return y
    if tuple(out.shape) != tuple(y.shape) or str(out.dtype) != str(y.dtype) or type(out) is not type(y):
        raise ValueError(f"autosoft.{who}: out must be a {y.dtype} array of shape {tuple(y.shape)} like the "
                         f"result, got {type(out).__name__} {out.dtype} {tuple(out.shape)}")
    if hasattr(out, "copy_"):
        return out.copy_(y)
    out[...] = y
    return out


@overload
def attention(q: Array, k: Array, v: Array, causal: bool = ..., scale: float | None = ...,
              return_lse: Literal[False] = ...) -> Array: ...
@overload
def attention(q: Array, k: Array, v: Array, causal: bool = ..., scale: float | None = ..., *,
              return_lse: Literal[True]) -> tuple[Array, Array]: ...
@overload
def attention(q: Array, k: Array, v: Array, causal: bool, scale: float | None,
              return_lse: Literal[True]) -> tuple[Array, Array]: ...
@overload
def attention(q: Array, k: Array, v: Array, causal: bool = ..., scale: float | None = ...,
              return_lse: bool = ...) -> Array | tuple[Array, Array]: ...


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None,
              return_lse: bool = False) -> Any:
    """softmax(scale * q kᵀ [causal]) v for (B, H, N, D) q, k, v of one shape: CUDA torch tensors
    (float16, bfloat16) or CuPy float16 arrays, D in 32, 64, 128. Returns o like q, or (o, lse)
    with return_lse=True: lse (B, H, N) float32, the natural log-sum-exp of each query's scores.
    scale defaults to 1/sqrt(D) and must be positive. Inputs that are not contiguous or 16-byte
    aligned are copied first. It has no backward: torch tensors that require gradients while
    autograd records raise RuntimeError (call it under torch.no_grad())."""
    refuse_gradients("attention", q, k, v)
    head_dim = q.shape[-1] if hasattr(q, "shape") and len(q.shape) else 1
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not scale > 0:  # the kernel tracks the running max of the unscaled scores
        raise ValueError(f"autosoft.attention: scale must be positive, got {scale}")
    o, lse = call_family("attention", (q, k, v), options={"causal": bool(causal)},
                         scalars={"scale": np.float32(scale)})
    return (o, lse) if return_lse else o


def load_cache(path: str) -> int:
    """Use the tuned kernels of a cache file from another machine; returns the number of entries."""
    return DISPATCHER.load_cache(path)


@functools.lru_cache(maxsize=None)
def family_function(name: str) -> Callable[..., Any]:
    """autosoft.<name>: the Python function of the family `name`, built from its python_call.
    LookupError where no family of that name declares one."""
    try:
        family = get_family(name)
    except UserError:
        raise LookupError(f"no family {name!r}") from None
    if not family.has_python_call:
        raise LookupError(f"the {name} family declares no Python function")
    python_call, outputs = family.python_call, family.outputs

    @functools.wraps(python_call)
    def function(*args: Any, **kwargs: Any) -> Any:
        call = python_call(*args, **kwargs)
        results = dict(zip(outputs, call_family(name, call.arrays, options=call.options, scalars=call.scalars)))
        picked = tuple(results[n] for n in call.returns)
        return picked[0] if len(picked) == 1 else picked

    function.__name__ = function.__qualname__ = name
    function.__module__ = "autosoft"
    return function
