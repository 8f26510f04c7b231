"""autosoft: a code-generating autotuner for GPU softmax (and attention) kernels.

    import autosoft
    y = autosoft.softmax(x)          # CuPy array or CUDA torch tensor, softmax over the last dim
    autosoft.load_cache("tuned.sqlite")
"""
from __future__ import annotations

__version__ = "0.1.0"

from .api import load_cache, softmax  # noqa: E402
from .errors import NoDeviceError, UserError  # noqa: E402

__all__ = ["softmax", "load_cache", "UserError", "NoDeviceError", "__version__"]
