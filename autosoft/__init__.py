"""autosoft: a code-generating autotuner for GPU softmax and attention kernels.

    import autosoft
    y = autosoft.softmax(x)                     # softmax over the last dim (CuPy or CUDA torch)
    o = autosoft.attention(q, k, v, causal=True)  # flash-attention forward, (B, H, N, D)
    autosoft.load_cache("tuned.sqlite")
"""
from __future__ import annotations

__version__ = "0.1.0"

from .api import attention, load_cache, softmax  # noqa: E402
from .errors import NoDeviceError, UserError  # noqa: E402

__all__ = ["softmax", "attention", "load_cache", "UserError", "NoDeviceError", "__version__"]
