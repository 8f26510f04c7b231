"""The Python API: autosoft.softmax(x) for CuPy arrays and CUDA tensors (torch, any DLPack producer)."""
from __future__ import annotations

from typing import Any

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
    if type(x).__module__.startswith("torch"):
        return _softmax_torch(x)
    return _softmax_cupy(x)


def _softmax_torch(x: Any) -> Any:
    import torch

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
    y = _empty_aligned_like_torch(x)
    problem = _problem(dtype, tuple(x.shape))
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    loaded = DISPATCHER.loaded(problem, device)
    stream = _external_stream(torch.cuda.current_stream(x.device).cuda_stream)
    with _on_device(device):
        loaded.launch({"x": x.data_ptr(), "y": y.data_ptr()}, stream=stream)
    return y


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
    problem = _problem(dtype, x.shape)
    device = x.device.id
    with x.device:
        y = _empty_aligned_like_cupy(cp, x)
        loaded = DISPATCHER.loaded(problem, device)
        loaded.launch({"x": x.data.ptr, "y": y.data.ptr})
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


_STREAMS: dict[int, Any] = {}


def _external_stream(ptr: int) -> Any:
    stream = _STREAMS.get(ptr)
    if stream is None:
        from .runtime import cupy_module

        stream = _STREAMS[ptr] = cupy_module().cuda.ExternalStream(ptr)
    return stream


class _on_device:
    """Make `index` the current CUDA device for CuPy while launching (cheap when it already is)."""

    def __init__(self, index: int):
        self.index = index
        self._ctx = None

    def __enter__(self) -> None:
        from .runtime import cupy_module

        cp = cupy_module()
        if cp.cuda.runtime.getDevice() != self.index:
            self._ctx = cp.cuda.Device(self.index)
            self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def load_cache(path: str) -> int:
    """Use the tuned kernels of a cache file from another machine; returns the number of entries."""
    return DISPATCHER.load_cache(path)
