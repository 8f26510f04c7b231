"""autosoft.cross_entropy and autosoft.linear_cross_entropy: torch functions with autograd over the
cross_entropy family (autosoft/families/cross_entropy.py holds its problem, kernels' meaning and
operator), launched on torch's current stream."""
from __future__ import annotations

import math
import sys
import threading
from typing import Any, Mapping

import numpy as np

from ..arrays import torch_current_stream, torch_loaded
from ..dispatch import DISPATCHER
from ..families._rows import pow2_ceil
from ..families.base import OptionValue, Problem
from ..families.cross_entropy import _KERNEL_BUFFERS, CROSS_ENTROPY, SCALARS
from ._loss_kernels import mean_scale as _mean_scale, scale_unless_one as _scale_unless_one, \
    scaled_sum as _scaled_sum

__all__ = ["cross_entropy", "linear_cross_entropy", "default_chunk"]


REDUCTIONS = ("mean", "sum", "none")


def _check_arguments(who: str, logits: Any, target: Any, ignore_index: Any, label_smoothing: Any, z_loss: Any,
                     reduction: Any, reductions: tuple[str, ...] = REDUCTIONS, first: str = "logits") -> Any:
    """torch, once the arguments are what the kernels take: TypeError or ValueError (one line) else."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(logits, torch.Tensor):
        raise TypeError(f"{who}: {first} must be a CUDA torch tensor, not {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{who}: target must be a torch tensor of class indices, not {type(target).__name__}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{who}: unsupported {first} dtype {logits.dtype}; use float32, float16 or bfloat16")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{who}: target must hold int64 or int32 class indices, got {target.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{who}: ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{who}: {name} must be a number, got {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{who}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"{who}: z_loss must be finite and >= 0, got {z_loss}")
    if reduction not in reductions:
        raise ValueError(f"{who}: reduction must be one of {', '.join(map(repr, reductions))}, got {reduction!r}")
    return torch


def _check_devices(who: str, named: Mapping[str, Any]) -> None:
    """TypeError for a CPU tensor, ValueError for tensors on several GPUs: checked last, so that
    every other error shows on the CPU too. While torch.compile traces, meta tensors pass (the
    operator's fake implementation takes them, for shape inference)."""
    torch = sys.modules["torch"]
    meta = ("meta",) if torch.compiler.is_compiling() else ()
    for name, tensor in named.items():
        if tensor is not None and not tensor.is_cuda and tensor.device.type not in meta:
            raise TypeError(f"{who}: {name} is a CPU tensor; move it to the GPU first ({name}.cuda())")
    devices = {tensor.device for tensor in named.values() if tensor is not None}
    if len(devices) > 1:
        raise ValueError(f"{who}: {', '.join(n for n, t in named.items() if t is not None)} must be on one device")


class _Launcher:
    """The launch function of each call signature (rows, vocabulary, dtypes, mode, device): its
    problem's loaded variant's, kept until load_cache or forget clears the dispatcher's caches.
    A call whose signature was seen before costs one dict lookup."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.launchers: dict[tuple, Any] = {}
        self._watching = False

    def clear(self) -> None:
        self.launchers.clear()

    def get(self, signature: tuple, problem: Problem, device: int) -> Any:
        """The launch function of `problem` on `device`, remembered under `signature`."""
        with self._lock:
            if not self._watching:
                DISPATCHER.on_clear(self.clear)
                self._watching = True
            loaded = torch_loaded(problem, device)
            found = self.launchers[signature] = loaded.launcher(_KERNEL_BUFFERS + SCALARS, SCALARS)
        return found


_LAUNCHER = _Launcher()


def _forward(logits2d: Any, target1d: Any, scale: Any, ignore_index: int, eps: float, z: float,
             inplace: bool, loss_only: bool = False) -> tuple[Any, Any, Any]:
    """loss (M,), lse (M,) and grad (M, N) (the logits themselves where inplace; None with
    loss_only) of contiguous 2-D logits, launched on torch's current stream. scale: a one-element
    float32 tensor."""
    import torch

    m, n = logits2d.shape
    device = logits2d.get_device()
    signature = (m, n, logits2d.dtype, target1d.dtype, inplace, loss_only, device)
    launch = _LAUNCHER.launchers.get(signature)
    if launch is None:
        options: dict[str, OptionValue] = {}
        if target1d.dtype == torch.int32:
            options["int32_target"] = True
        if loss_only:
            options["loss_only"] = True
        elif inplace:
            options["inplace"] = True
        problem = CROSS_ENTROPY.problem_for({"logits": (m, n), "target": (m,)}, TORCH_DTYPES[logits2d.dtype],
                                            options)
        launch = _LAUNCHER.get(signature, problem, device)
    loss = torch.empty(m, dtype=torch.float32, device=logits2d.device)
    lse = torch.empty(m, dtype=torch.float32, device=logits2d.device)
    grad = None if loss_only else logits2d if inplace else torch.empty_like(logits2d)
    launch(logits2d.data_ptr(), target1d.data_ptr(), scale.data_ptr(), 0 if grad is None else grad.data_ptr(),
           loss.data_ptr(), lse.data_ptr(), np.int64(ignore_index), np.float32(eps), np.float32(z),
           torch_current_stream(torch)(device))
    return loss, lse, grad


TORCH_DTYPES: dict[Any, str] = {}


def _torch_dtypes(torch: Any) -> None:
    if not TORCH_DTYPES:
        TORCH_DTYPES.update({torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"})


def _prepared(torch: Any, logits: Any, target: Any) -> tuple[Any, Any, bool]:
    """2-D logits and 1-D targets the kernels take (contiguous, the logits 16-byte aligned: else
    copied), and whether the logits were copied (a copy of ours may take the gradient in place)."""
    _torch_dtypes(torch)
    x = logits.reshape(-1, logits.shape[-1])
    copied = not x.is_contiguous() or x.data_ptr() % 16 != 0
    if copied:
        x = x.clone(memory_format=torch.contiguous_format)  # a fresh block is 256-byte aligned
    t = target.reshape(-1)
    if not t.is_contiguous():
        t = t.contiguous()
    return x, t, copied


def _scale_of(torch: Any, target: Any, ignore_index: int, reduction: str) -> Any:
    """The one-element float32 scale of the gradient: 1 / the rows kept for a mean (one small
    kernel, no host synchronisation), else 1. With no row kept it is inf, which no row's gradient
    meets (the kernel scales only the rows kept) and which makes the mean NaN, as torch's."""
    if reduction == "mean":
        return _mean_scale(target.contiguous(), ignore_index)
    return _one(torch, target.device)


def _one(torch: Any, device: Any) -> Any:
    """A one-element float32 tensor holding 1 on `device`, made once per device (no fill kernel
    per call; nothing writes it). Not kept when made inside a CUDA graph capture: its fill would
    run only when the graph replays."""
    one = _ONES.get(device)
    if one is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
        if not (one.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ONES[device] = one
    return one


_ONES: dict[Any, Any] = {}


def _reduced(torch: Any, loss: Any, target: Any, ignore_index: int, reduction: str, scale: Any = None) -> Any:
    """The per-row losses reduced: with the gradient's scale given, its sum times the scale in one
    small kernel (a mean, or a sum with a scale of 1); else (while torch.compile traces) torch's ops."""
    if reduction == "none":
        return loss
    if scale is not None:
        return _scaled_sum(loss, scale)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()  # 0 / 0 = NaN when every row is ignored, as torch


def _scaled_(torch: Any, grad: Any, grad_output: Any) -> Any:
    """grad * grad_output, in place (grad is ours). For a scalar loss, decided on the GPU
    (functions/_loss_kernels.py): nothing is read or written where grad_output is 1, the usual case
    (loss.backward()), and the host never waits to know it."""
    if grad_output.numel() == 1 and grad.is_contiguous():
        return _scale_unless_one(grad, grad_output.reshape(1).to(torch.float32))
    return grad.mul_(grad_output.reshape(*grad_output.shape, *([1] * (grad.dim() - grad_output.dim()))).to(grad.dtype))


def _function_class(torch: Any) -> Any:
    global _CrossEntropyFunction
    if _CrossEntropyFunction is None:
        class CrossEntropyFunction(torch.autograd.Function):
            """The loss forward; the gradient of the logits computed with it and kept for backward."""

            @staticmethod
            def forward(ctx: Any, logits: Any, target: Any, ignore_index: int, eps: float, z: float,
                        reduction: str, inplace: bool) -> Any:
                x, t, copied = _prepared(torch, logits, target)
                scale = _scale_of(torch, t, ignore_index, reduction)
                loss, lse, grad = _forward(x, t, scale, ignore_index, eps, z, inplace or copied)
                ctx.save_for_backward(grad)
                ctx.shape = logits.shape
                lse = lse.reshape(target.shape)
                ctx.mark_non_differentiable(lse)
                return _reduced(torch, loss, t, ignore_index, reduction, scale).reshape(
                    target.shape if reduction == "none" else ()), lse

            @staticmethod
            def backward(ctx: Any, grad_loss: Any, grad_lse: Any) -> Any:
                grad, = ctx.saved_tensors
                g = grad_loss.reshape(-1) if grad_loss.dim() else grad_loss
                return _scaled_(torch, grad, g).reshape(ctx.shape), None, None, None, None, None, None

        _CrossEntropyFunction = CrossEntropyFunction
    return _CrossEntropyFunction


_CrossEntropyFunction: Any = None


def cross_entropy(logits: Any, target: Any, ignore_index: int = -100, label_smoothing: float = 0.0,
                  z_loss: float = 0.0, reduction: str = "mean", *, inplace_backward: bool = False,
                  return_lse: bool = False) -> Any:
    """Cross-entropy of logits (..., V) (CUDA torch tensor: float32, float16, bfloat16) against
    target (...) class indices (int64 or int32), as torch.nn.functional.cross_entropy with
    ignore_index and label_smoothing, plus the z-loss z_loss * lse^2 per row (PaLM). reduction:
    "mean" over the rows not ignored, "sum", or "none" (a float32 loss per row, 0 where ignored).
    Returns the loss (float32), or (loss, lse) with return_lse=True (lse float32 per row).

    One kernel reads the logits once and writes their gradient with the loss (the tuned
    cross_entropy family); backward scales it by the incoming gradient where that is not 1.
    inplace_backward=True lets that gradient overwrite the logits (as Liger's): the logits'
    memory is reused, and their values are gone after the call. Called without gradients
    (no requires_grad, or under torch.no_grad()), the gradient is computed and dropped.
    A target outside [0, V) that is not ignore_index gives a NaN loss (torch raises).
    While torch.compile traces, it is the operator torch.ops.autosoft.cross_entropy (declared
    below), its gradient never in place, lse not differentiated."""
    torch = _check_arguments("autosoft.cross_entropy", logits, target, ignore_index, label_smoothing, z_loss,
                             reduction)
    if logits.dim() == 0 or tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"autosoft.cross_entropy: target {tuple(target.shape)} must have the shape of logits "
                         f"{tuple(logits.shape)} without its last (vocabulary) dimension")
    if not isinstance(inplace_backward, bool):
        raise TypeError("autosoft.cross_entropy: inplace_backward must be True or False")
    if logits.numel() == 0:
        raise ValueError(f"autosoft.cross_entropy: logits {tuple(logits.shape)} is empty")
    _check_devices("autosoft.cross_entropy", {"logits": logits, "target": target})
    eps, z = float(label_smoothing), float(z_loss)
    if torch.compiler.is_compiling():  # one operator for the graph (the gradient never in place)
        from .. import torch_ops  # noqa: F401 - registers the operators; Dynamo imports it for real

        ones = torch.ones(1, dtype=torch.float32, device=logits.device)  # the scale: each row's own gradient
        per_row, lse, _ = torch.ops.autosoft.cross_entropy(logits, target, ones, ignore_index, eps, z)
        loss = _reduced(torch, per_row, target, ignore_index, reduction)
    elif logits.requires_grad and torch.is_grad_enabled():
        loss, lse = _function_class(torch).apply(logits, target, ignore_index, eps, z, reduction, inplace_backward)
    else:
        x, t, copied = _prepared(torch, logits, target)
        scale = _scale_of(torch, t, ignore_index, reduction)
        loss, lse, _ = _forward(x, t, scale, ignore_index, eps, z, copied, loss_only=True)
        loss = _reduced(torch, loss, t, ignore_index, reduction, scale).reshape(
            target.shape if reduction == "none" else ())
        lse = lse.reshape(target.shape)
    return (loss, lse) if return_lse else loss


# --- linear + cross-entropy, chunked over the tokens ---------------------------------------------

def default_chunk(tokens: int, vocab: int, hidden: int) -> int:
    """Tokens per chunk: as Liger's fused linear cross-entropy chooses, so that a chunk's logits
    are about the size of the hidden states (the power of two at or above tokens / ceil(V / H)),
    and the peak memory matches its; never more than the tokens. benchmarks/cross_entropy.py
    --linear measures other sizes."""
    return min(tokens, pow2_ceil(-(-tokens // -(-vocab // hidden))))


def _linear_ce(torch: Any, hidden: Any, weight: Any, bias: Any, target: Any, ignore_index: int, eps: float,
               z: float, reduction: str, chunk: int, need_grad: bool) -> tuple[Any, Any, Any, Any]:
    """The loss and, with need_grad, the gradients of hidden, weight and bias (for an incoming 1),
    one chunk of tokens at a time: logits = h W^T (+ b) by torch.matmul, our kernel writing their
    gradient over them, then the gradient's products with W and h. Peak extra memory: one chunk's
    logits (and the float32 loss and lse of the rows)."""
    tokens = hidden.shape[0]
    scale = _scale_of(torch, target, ignore_index, reduction)
    losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_grad and hidden.requires_grad else None
    grad_weight = torch.zeros_like(weight) if need_grad and weight.requires_grad else None
    grad_bias = torch.zeros_like(bias) if need_grad and bias is not None and bias.requires_grad else None
    for start in range(0, tokens, chunk):
        end = min(tokens, start + chunk)
        h = hidden[start:end]
        logits = torch.matmul(h, weight.t())
        if bias is not None:
            logits += bias
        x, t, _ = _prepared(torch, logits, target[start:end])
        loss, _, grad = _forward(x, t, scale, ignore_index, eps, z, True, loss_only=not need_grad)
        losses[start:end] = loss
        if grad_hidden is not None:
            torch.matmul(grad, weight, out=grad_hidden[start:end])
        if grad_weight is not None:
            grad_weight.addmm_(grad.t(), h)
        if grad_bias is not None:
            grad_bias.add_(grad.sum(dim=0))
        del logits, x, grad  # before the next chunk's logits: one chunk's at a time
    return _reduced(torch, losses, target, ignore_index, reduction, scale), grad_hidden, grad_weight, grad_bias


def _linear_function_class(torch: Any) -> Any:
    global _LinearFunction
    if _LinearFunction is None:
        class LinearCrossEntropyFunction(torch.autograd.Function):
            """The loss forward, the gradients of hidden, weight and bias computed with it."""

            @staticmethod
            def forward(ctx: Any, hidden: Any, weight: Any, bias: Any, target: Any, ignore_index: int, eps: float,
                        z: float, reduction: str, chunk: int) -> Any:
                loss, gh, gw, gb = _linear_ce(torch, hidden, weight, bias, target, ignore_index, eps, z, reduction,
                                              chunk, True)
                ctx.save_for_backward(*(g if g is not None else torch.empty(0) for g in (gh, gw, gb)))
                ctx.present = (gh is not None, gw is not None, gb is not None)
                return loss

            @staticmethod
            def backward(ctx: Any, grad_loss: Any) -> Any:
                grads = [_scaled_(torch, g, grad_loss) if present else None
                         for g, present in zip(ctx.saved_tensors, ctx.present)]
                return (*grads, None, None, None, None, None, None)

        _LinearFunction = LinearCrossEntropyFunction
    return _LinearFunction


_LinearFunction: Any = None


def linear_cross_entropy(hidden: Any, weight: Any, target: Any, bias: Any = None, ignore_index: int = -100,
                         label_smoothing: float = 0.0, z_loss: float = 0.0, reduction: str = "mean", *,
                         chunk_size: int | None = None) -> Any:
    """cross_entropy(hidden @ weight.T + bias, target, ...) without the whole logits: hidden (..., H)
    and weight (V, H) CUDA torch tensors of one dtype (float32, float16, bfloat16), bias (V,) or
    None, target (...) int64 or int32. The tokens go in chunks of chunk_size (default:
    `default_chunk`: logits about the size of the hidden states): each chunk's logits come from
    torch.matmul, the cross_entropy kernel writes their gradient over them, and two more matmuls
    turn it into the gradients of hidden and weight, computed in the forward when they are needed
    (the logits are never kept). reduction "mean" or "sum" (a per-row loss cannot be chunked
    this way). Returns the float32 loss."""
    who = "autosoft.linear_cross_entropy"
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{who}: hidden and weight must be CUDA torch tensors")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"{who}: hidden (..., H) and weight (V, H) do not fit: {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or (bias is not None and getattr(bias, "dtype", None) != weight.dtype):
        raise TypeError(f"{who}: hidden, weight (and bias) must share one dtype, got {hidden.dtype} and {weight.dtype}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"{who}: bias must be a tensor of shape ({weight.shape[0]},)")
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"{who}: target must be a tensor of shape {tuple(hidden.shape[:-1])} (hidden without H)")
    _check_arguments(who, hidden, target, ignore_index, label_smoothing, z_loss, reduction, ("mean", "sum"), "hidden")
    tokens = math.prod(hidden.shape[:-1])
    if tokens == 0:
        raise ValueError(f"{who}: hidden {tuple(hidden.shape)} has no tokens")
    if chunk_size is None:
        chunk = default_chunk(tokens, weight.shape[0], weight.shape[1])
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{who}: chunk_size must be a positive int, got {chunk_size!r}")
    else:
        chunk = min(chunk_size, tokens)
    _check_devices(who, {"hidden": hidden, "weight": weight, "bias": bias, "target": target})
    h = hidden.reshape(tokens, hidden.shape[-1])
    t = target.reshape(tokens)
    eps, z = float(label_smoothing), float(z_loss)
    needs = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad or
                                         (bias is not None and bias.requires_grad))
    if needs:
        return _linear_function_class(torch).apply(h, weight, bias, t, ignore_index, eps, z, reduction, chunk)
    with torch.no_grad():
        return _linear_ce(torch, h, weight, bias, t, ignore_index, eps, z, reduction, chunk, False)[0]


