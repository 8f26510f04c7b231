"""The Python API: autosoft.softmax(x) and autosoft.attention(q, k, v) for CuPy arrays and CUDA
torch tensors (softmax also takes any DLPack CUDA producer)."""
from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from .dispatch import DISPATCHER
from .errors import UserError
from .families import get_family
from .families.base import Problem

_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16"}
_CUPY_DTYPES = {"float32": "float32", "float16": "float16"}
_VEC_ALIGN = 16  # the kernels read 16-byte vectors: x and y must agree on their address mod 16


def softmax(x: Any) -> Any:
    """Softmax over the last dimension. Returns the same kind of array as x (torch in, torch out).

    Non-contiguous inputs are copied to a contiguous array first; an empty input gives an
    empty output. Raises TypeError for host arrays or unsupported dtypes.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _softmax_torch(x, torch)
    return _softmax_cupy(x)


def _softmax_torch(x: Any, torch: Any) -> Any:
    # Hot path: a tensor of a (dtype, shape, device) seen before needs only its output and a launch.
    key = (x.dtype, x.shape, x.get_device())
    launch = DISPATCHER.fast.get(key)
    if launch is None or not x.is_contiguous():
        return _softmax_torch_checked(x, torch)
    y = torch.empty_like(x)
    xp, yp = x.data_ptr(), y.data_ptr()
    if (xp - yp) % _VEC_ALIGN:
        y = _empty_aligned_like_torch(x)
        yp = y.data_ptr()
    launch(xp, yp, _torch_stream(torch, key[2]))
    return y


def _softmax_torch_checked(x: Any, torch: Any) -> Any:
    if not x.is_cuda:
        raise TypeError("autosoft.softmax: x is a CPU tensor; move it to the GPU first (x.cuda())")
    dtype = _TORCH_DTYPES.get(str(x.dtype))
    if dtype is None:
        raise TypeError(f"autosoft.softmax: unsupported dtype {x.dtype}; use float32, float16 or bfloat16")
    if x.dim() == 0:
        raise ValueError("autosoft.softmax: x is a scalar; it needs at least one dimension")
    if x.numel() == 0:
        return torch.empty_like(x)
    if not x.is_contiguous():
        x = x.contiguous()
    device = x.get_device()
    launch = _loaded(_problem(dtype, tuple(x.shape)), device).launcher(("x", "y"))
    DISPATCHER.fast[(x.dtype, x.shape, device)] = launch
    y = _empty_aligned_like_torch(x)
    launch(x.data_ptr(), y.data_ptr(), _torch_stream(torch, device))
    return y


def _torch_stream(torch: Any, device: int) -> int:
    # the raw handle without building a torch Stream object (Triton reads it the same way)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device) if raw else torch.cuda.current_stream(device).cuda_stream


def _loaded(problem: Problem, device: int) -> Any:
    from .runtime import cupy_module

    with cupy_module().cuda.Device(device):
        return DISPATCHER.loaded(problem, device)


def _softmax_cupy(x: Any) -> Any:
    from .runtime import cupy_module

    type_name = f"{type(x).__module__}.{type(x).__name__}"
    if type_name.startswith("numpy"):
        raise TypeError("autosoft.softmax: x is a host (NumPy) array; move it to the GPU first (cupy.asarray(x))")
    cp = cupy_module()
    if not isinstance(x, cp.ndarray):
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"autosoft.softmax: {type_name} is neither a CuPy array nor a DLPack CUDA tensor")
        try:
            x = cp.from_dlpack(x)
        except Exception as exc:  # noqa: BLE001 - DLPack producers raise many kinds
            raise TypeError(f"autosoft.softmax: cannot view {type_name} on the GPU through DLPack: {exc}") from None
    dtype = _CUPY_DTYPES.get(str(x.dtype))
    if dtype is None:
        raise TypeError(f"autosoft.softmax: unsupported dtype {x.dtype}; use float32 or float16 "
                        "(bfloat16 through a torch tensor)")
    if x.ndim == 0:
        raise ValueError("autosoft.softmax: x is a scalar; it needs at least one dimension")
    if x.size == 0:
        return cp.empty_like(x)
    if not x.flags.c_contiguous:
        x = cp.ascontiguousarray(x)
    device = x.data.device_id
    key = (x.dtype, x.shape, device)
    launch = DISPATCHER.fast.get(key)
    if launch is None:
        launch = DISPATCHER.fast[key] = _loaded(_problem(dtype, x.shape), device).launcher(("x", "y"))
    with x.device:
        y = _empty_aligned_like_cupy(cp, x)
        launch(x.data.ptr, y.data.ptr, cp.cuda.get_current_stream().ptr)
    return y


def _problem(dtype: str, shape: tuple[int, ...]) -> Problem:
    n = int(shape[-1])
    m = 1
    for s in shape[:-1]:
        m *= int(s)
    family = get_family("softmax")
    try:
        family.check_shape((m, n))
    except UserError as exc:
        raise ValueError(f"autosoft.softmax: {exc}") from None
    return Problem("softmax", dtype, (m, n))


def _empty_aligned_like_torch(x: Any) -> Any:
    import torch

    misalign = x.data_ptr() % _VEC_ALIGN
    if misalign == 0:
        return torch.empty_like(x)
    pad = _VEC_ALIGN // x.element_size()
    flat = torch.empty(x.numel() + pad, dtype=x.dtype, device=x.device)
    start = misalign // x.element_size()
    return flat[start:start + x.numel()].view(x.shape)


def _empty_aligned_like_cupy(cp: Any, x: Any) -> Any:
    misalign = x.data.ptr % _VEC_ALIGN
    if misalign == 0:
        return cp.empty_like(x)
    flat = cp.empty(x.size + _VEC_ALIGN // x.itemsize, dtype=x.dtype)
    start = misalign // x.itemsize
    return flat[start:start + x.size].reshape(x.shape)


def attention(q: Any, k: Any, v: Any, causal: bool = False, scale: float | None = None,
              return_lse: bool = False) -> Any:
    """softmax(scale * q kᵀ [causal]) v for (B, H, N, D) q, k, v: CUDA torch tensors (float16,
    bfloat16) or CuPy float16 arrays, one shape, D in 32, 64, 128. Returns o like q, or (o, lse)
    with return_lse=True: lse (B, H, N) float32, the natural log-sum-exp of each query's scores.
    Inputs that are not contiguous or 16-byte aligned are copied first."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor):
        return _attention_torch(torch, q, k, v, causal, scale, return_lse)
    from .runtime import cupy_module

    cp = cupy_module()
    if not all(isinstance(t, cp.ndarray) for t in (q, k, v)):
        raise TypeError("autosoft.attention: q, k, v must be CUDA torch tensors or CuPy arrays")
    if str(q.dtype) != "float16" or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("autosoft.attention: CuPy arrays must be float16 (bfloat16 through torch tensors)")
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError("autosoft.attention: q, k, v must be (B, H, N, D) arrays of one shape")
    scale = _attention_scale(scale, q.shape[3])
    with q.device:
        o = cp.empty(q.shape, dtype=q.dtype)
        lse = cp.empty(q.shape[:3], dtype=cp.float32)
        if q.size:
            q, k, v = (t if t.flags.c_contiguous and t.data.ptr % 16 == 0 else t.copy() for t in (q, k, v))
            loaded = _loaded(_attention_problem("float16", q.shape, causal), q.device.id)
            loaded.launch({"q": q, "k": k, "v": v, "o": o, "lse": lse, "scale": np.float32(scale)})
    return (o, lse) if return_lse else o


def _attention_torch(torch: Any, q: Any, k: Any, v: Any, causal: bool, scale: float | None, return_lse: bool) -> Any:
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in (q, k, v)):
        raise TypeError("autosoft.attention: q, k, v must all be CUDA tensors (move them with .cuda())")
    names = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
    if q.dtype not in names or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"autosoft.attention: q, k, v must share dtype float16 or bfloat16, got "
                        f"{q.dtype}, {k.dtype}, {v.dtype} (convert with .half() or .bfloat16())")
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape or len({t.device for t in (q, k, v)}) != 1:
        raise ValueError("autosoft.attention: q, k, v must be (B, H, N, D) tensors of one shape on one device")
    scale = _attention_scale(scale, q.shape[3])
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    if q.numel():
        q, k, v = (t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)
                   for t in (q, k, v))  # the kernel reads 16-byte vectors
        device = q.get_device()
        loaded = _loaded(_attention_problem(names[q.dtype], tuple(q.shape), causal), device)
        loaded.launch_raw({"q": q.data_ptr(), "k": k.data_ptr(), "v": v.data_ptr(), "o": o.data_ptr(),
                           "lse": lse.data_ptr(), "scale": np.float32(scale)}, _torch_stream(torch, device))
    return (o, lse) if return_lse else o


def _attention_scale(scale: float | None, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not scale > 0:  # the kernel tracks the running max of the unscaled scores
        raise ValueError(f"autosoft.attention: scale must be positive, got {scale}")
    return scale


def _attention_problem(dtype: str, shape: tuple[int, ...], causal: bool) -> Problem:
    try:
        shape = get_family("attention").check_shape(tuple(int(s) for s in shape))
    except UserError as exc:
        raise ValueError(f"autosoft.attention: {exc}") from None
    return Problem("attention", dtype, shape, ("causal",) if causal else ())


def load_cache(path: str) -> int:
    """Use the tuned kernels of a cache file from another machine; returns the number of entries."""
    return DISPATCHER.load_cache(path)
