"""What autosoft does when torch's autograd is watching: functions without a backward refuse
inputs that require gradients, so that a training step cannot silently stop learning.

A function whose kernels have no backward (attention_colsum) returns outputs that carry no
gradient; handed q, k or v that require gradients while autograd records, it raises instead of
returning a tensor that looks right and cannot learn. (autosoft.attention has a backward: its
torch operator's, the attention_backward family.)
"""
from __future__ import annotations

import sys
from typing import Any

__all__ = ["refuse_gradients", "no_backward_error", "through_operator", "tracing"]


def tracing() -> bool:
    """Whether torch.compile traces this call (torch is never imported here: a CuPy user never
    loads it)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def through_operator(*arrays: Any) -> bool:
    """Whether a call on these arrays must go through autosoft's torch operator: the first is a
    torch tensor and torch.compile traces, or autograd records one that requires gradients."""
    torch = sys.modules.get("torch")  # never imported here: a CuPy user never loads torch
    if torch is None or not arrays or not isinstance(arrays[0], torch.Tensor):
        return False
    if tracing():
        return True
    for array in arrays:
        if isinstance(array, torch.Tensor) and array.requires_grad:
            return torch.is_grad_enabled()
    return False


def refuse_gradients(who: str, *arrays: Any) -> None:
    """RuntimeError when torch is recording gradients and one of the arrays requires them."""
    torch = sys.modules.get("torch")  # not imported here: a CuPy user never loads torch
    if torch is None or not torch.is_grad_enabled():
        return
    needy = [i for i, a in enumerate(arrays) if isinstance(a, torch.Tensor) and a.requires_grad]
    if needy:
        raise no_backward_error(who)


def no_backward_error(who: str, instead: str = "scaled_dot_product_attention") -> RuntimeError:
    """The error of a call that autograd would record on a function without a backward (also
    what the torch custom operators of autosoft.torch_ops raise); `instead` names the torch
    function to use where gradients are needed ("": none is named)."""
    use = f" (or use torch's {instead} where gradients are needed)" if instead else ""
    return RuntimeError(
        f"autosoft.{who} has no backward yet, so its outputs cannot carry gradients to the inputs that "
        f"require them; call it under torch.no_grad() or on detached tensors{use}")
