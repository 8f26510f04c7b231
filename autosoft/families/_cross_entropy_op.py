"""torch.ops.autosoft_ce.cross_entropy: what torch.compile traces for autosoft.cross_entropy.

(logits, target, ignore_index, label_smoothing, z_loss) -> (loss per row, lse per row, the
gradient of the rows' summed loss), a custom op running the cross_entropy family's kernel, whose
backward multiplies that gradient by the incoming one per row: an elementwise pass that the eager
path skips where the incoming gradient is 1, and the gradient is never written over the logits.

Registered when this module is first imported (it imports torch), which autosoft.cross_entropy
does while torch.compile traces: Dynamo imports a module for real, so the registration itself is
not traced. A namespace of its own: the operators of autosoft.torch_ops take arrays of one dtype
(arrays.call_family), and the targets are integers. Private to the cross_entropy family: the
registry imports no module whose name starts with "_".
"""
from __future__ import annotations

from typing import Any

import torch

from . import cross_entropy as family

__all__ = ["cross_entropy"]


@torch.library.custom_op("autosoft_ce::cross_entropy", mutates_args=())
def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                  z_loss: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x, t, copied = family._prepared(torch, logits, target)
    ones = torch.ones(1, dtype=torch.float32, device=x.device)  # the scale: each row's own gradient
    loss, lse, grad = family._forward(x, t, ones, ignore_index, label_smoothing, z_loss, copied)
    return loss.reshape(target.shape), lse.reshape(target.shape), grad.reshape(logits.shape)


@cross_entropy.register_fake
def _(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
      z_loss: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = logits.new_empty(target.shape, dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(output[2])


def _backward(ctx: Any, grad_loss: torch.Tensor, grad_lse: Any, grad_grad: Any) -> tuple[Any, ...]:
    grad, = ctx.saved_tensors
    return grad * grad_loss.unsqueeze(-1).to(grad.dtype), None, None, None, None


cross_entropy.register_autograd(_backward, setup_context=_setup_context)
