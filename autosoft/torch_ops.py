"""autosoft's functions as torch custom operators, for torch.compile and CUDA graphs.

    import autosoft.torch_ops                     # registers the operators (imports torch)
    y = torch.ops.autosoft.softmax(x)
    o, lse = torch.ops.autosoft.attention(q, k, v, causal, scale)
    o, colsum, lse = torch.ops.autosoft.attention_colsum(q, k, v, split, causal, scale, deterministic)

Called as `autosoft.softmax(x)`, autosoft is Python that torch.compile cannot see into: Dynamo
breaks the graph around it (`fullgraph=True` refuses it). The operators below are registered with
`torch.library.custom_op`, each with

- its real implementation, the public function's own path: `arrays.call_family` with the options
  and scalars that `autosoft.softmax`, `autosoft.attention` and the attention_colsum family's
  `python_call` pass (same kernels, same plans, same errors, launched on torch's current stream,
  outputs allocated by torch: what a CUDA graph capture needs);
- a fake implementation that checks what can be checked without data (device, dtypes, shapes,
  0 < split < N, scale > 0) with the errors of the real path, and returns empty tensors of the
  outputs' shapes, dtypes and device (contiguous, as the real outputs are), which torch.compile
  traces with;
- an autograd registration that refuses: none of them has a backward yet (see `_define`).
  Called while autograd records on inputs that require gradients, each raises the RuntimeError
  of autograd.refuse_gradients; softmax too, although `autosoft.softmax` itself does not refuse
  (it returns an output without gradient): an operator inside a compiled training graph must not
  cut the gradient's path silently.

The schemas (`torch.ops.autosoft.<name>.default._schema`):

    autosoft::softmax(Tensor x) -> Tensor
    autosoft::attention(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor o, Tensor lse)
    autosoft::attention_colsum(Tensor q, Tensor k, Tensor v, int split, bool causal, float scale,
                               bool deterministic) -> (Tensor o, Tensor colsum, Tensor lse)

Every argument is required (scale too: 1/sqrt(D) is the public functions' default), and the
attention operators return every output (`lse` always). Importing this module registers them
(`register()`, once per process); `autosoft` itself never imports torch, so a CuPy user never
loads it.

Not done here, on purpose: `autosoft.softmax` and `autosoft.attention` do not go through these
operators. A custom operator's Python dispatch (autograd wrapper, backend wrapper, aliasing
check) costs per call, and the public functions' plan path was made lean for calls that are a
few microseconds of GPU work. Routing them through the operators waits for a GPU measurement of
that overhead against issue 19's target: the custom-operator path's wall time per call at most
1.5x `torch.softmax` on a tuned 4096x128 float32 input. Measured without a GPU (torch 2.13, a
small CPU host, the real implementation replaced by an empty_like), the dispatch costs about
10 us per call above the implementation, 4 us under torch.inference_mode(); one softmax launch
through the plan took 4.5 us on the H200 host (runtime.Loaded.launcher). Until that measurement
a user who compiles calls `torch.ops.autosoft.*` after `import autosoft.torch_ops`; a CUDA graph
(or torch.compile's mode="reduce-overhead") replays the kernels without that Python.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .arrays import call_family
from .autograd import no_backward_error
from .dtypes import TORCH_NAMES
from .families import get_family
from .families.base import OptionValue

if TYPE_CHECKING:
    import torch

__all__ = ["register", "softmax", "attention", "attention_colsum", "OPS"]

OPS = ("softmax", "attention", "attention_colsum")
"""The operators' names in torch.ops.autosoft, one per family with a public function."""

# the CustomOpDef objects, set by register()
softmax: Any = None
attention: Any = None
attention_colsum: Any = None

_lock = threading.Lock()
_registered = False

_SCHEMAS = {
    "softmax": "(Tensor x) -> Tensor",
    "attention": "(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor o, Tensor lse)",
    "attention_colsum": "(Tensor q, Tensor k, Tensor v, int split, bool causal, float scale, bool deterministic) "
                        "-> (Tensor o, Tensor colsum, Tensor lse)",
}


def register() -> None:
    """Register the operators torch.ops.autosoft.{softmax, attention, attention_colsum}, once per
    process (later calls, from any thread, do nothing). Imports torch; ImportError where torch
    is missing or older than torch.library.custom_op (torch 2.4)."""
    global _registered, softmax, attention, attention_colsum
    if _registered:
        return
    with _lock:
        if _registered:
            return
        import torch

        if not hasattr(torch.library, "custom_op"):
            raise ImportError(f"autosoft.torch_ops needs torch.library.custom_op (torch >= 2.4); this is torch "
                              f"{torch.__version__}")
        ops = {name: _define(torch, name) for name in OPS}
        softmax, attention, attention_colsum = ops["softmax"], ops["attention"], ops["attention_colsum"]
        _registered = True


def _define(torch: Any, name: str) -> Any:
    real, fake = _IMPLS[name]
    op = torch.library.custom_op(f"autosoft::{name}", real, mutates_args=(), schema=_SCHEMAS[name])
    op.register_fake(fake)
    # No backward yet. Without an autograd registration a call on inputs that require gradients
    # returns outputs that carry none (torch warns at most), and backward() fails far from the call.
    # The setup_context hook is the earliest point a custom_op's autograd wrapper offers: torch calls
    # it only when grad mode is on and an input requires grad, right after the forward; raising
    # there refuses the call in eager mode (after the kernel ran: the outputs are dropped) and, under
    # torch.compile, while Dynamo runs the fake implementation, that is at compile time (Dynamo wraps
    # it in a TorchRuntimeError, a RuntimeError, whose message holds ours). A check inside the
    # implementation cannot do this: torch runs it with grad mode off in both cases, so it cannot
    # tell a recording call from one under torch.no_grad().
    op.register_autograd(_backward(name), setup_context=_refuse(name))
    return op


def _no_backward(name: str) -> RuntimeError:
    """autograd.refuse_gradients' error, naming torch.softmax as the way with gradients for softmax."""
    return no_backward_error(name, "softmax") if name == "softmax" else no_backward_error(name)


def _refuse(name: str) -> Any:
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        raise _no_backward(name)
    return setup_context


def _backward(name: str) -> Any:
    def backward(ctx: Any, *grads: Any) -> Any:  # never reached: setup_context refuses first
        raise _no_backward(name)
    return backward


# --- the real implementations: the public functions' calls ------------------------------------

def _check_scale(name: str, scale: float) -> None:
    if not scale > 0:  # the kernel tracks the running max of the unscaled scores
        raise ValueError(f"autosoft.{name}: scale must be positive, got {scale}")


def _softmax(x: torch.Tensor) -> torch.Tensor:
    return call_family("softmax", (x,))[0]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_scale("attention", scale)
    o, lse = call_family("attention", (q, k, v), options={"causal": bool(causal)},
                         scalars={"scale": np.float32(scale)})
    return o, lse


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

def _fake_softmax(x: torch.Tensor) -> torch.Tensor:
    return _fake_outputs("softmax", (x,), {})[0]


def _fake_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check_scale("attention", scale)
    o, lse = _fake_outputs("attention", (q, k, v), {"causal": bool(causal)})
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


_IMPLS = {"softmax": (_softmax, _fake_softmax), "attention": (_attention, _fake_attention),
          "attention_colsum": (_attention_colsum, _fake_attention_colsum)}

register()
