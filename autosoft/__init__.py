"""autosoft: a code-generating autotuner for GPU softmax and attention kernels.

    import autosoft
    y = autosoft.softmax(x)                     # softmax over the last dim (CuPy or CUDA torch)
    y = autosoft.log_softmax(x, dim=1)          # log-softmax, over any dim
    o = autosoft.attention(q, k, v, causal=True)  # flash-attention forward, (B, H, N, D)
    o, colsum = autosoft.attention_colsum(q, k, v, split)  # and every other family's function
    autosoft.load_cache("tuned.sqlite")
"""
from __future__ import annotations

import typing as _typing

from ._version import __version__  # noqa: E402
from .api import attention, load_cache, log_softmax, softmax  # noqa: E402
from .errors import NoDeviceError, UserError  # noqa: E402

_API = ["softmax", "log_softmax", "attention", "load_cache", "UserError", "NoDeviceError", "__version__"]


def __getattr__(name: str) -> _typing.Any:
    """autosoft.<name>: a family's Python function, declared in its own module (attention_colsum,
    topk_softmax, plug-in families) or written by hand in autosoft/functions/ (cross_entropy,
    linear_cross_entropy), found on first use. autosoft.__all__: the functions above and every
    family's, built-in or plug-in (computed when asked: reading the plug-ins' entry points costs
    a first call tens of milliseconds, which `import autosoft` does not pay)."""
    if name == "__all__":
        from .api import family_function_names

        return _API + [n for n in family_function_names() if n not in _API]
    if not name.startswith("_"):
        from .api import family_function

        try:
            return family_function(name)
        except LookupError:
            pass
    raise AttributeError(f"module 'autosoft' has no attribute {name!r}")


def __dir__() -> list[str]:
    from .api import family_function_names

    return sorted(set(globals()) | set(family_function_names()))
