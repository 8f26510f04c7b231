"""The array layer's plan for calls it need not launch (autosoft/arrays.py), over NumPy arrays:
the decisions a CUDA framework's arrays get, without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from autosoft.arrays import _Framework, _prepare
from autosoft.families import get_family


class _Host(_Framework):
    """NumPy arrays as the array layer sees a framework's; fresh outputs are poisoned (NaN), so
    what a plan leaves unwritten shows."""

    def check(self, who, names, arrays):
        pass

    def dtype(self, a):
        return str(a.dtype)

    def device(self, a):
        return 0

    def size(self, a):
        return a.size

    def empty(self, shape, dtype, device, like_ptr):
        return np.full(shape, np.nan, dtype=dtype)

    def fill(self, out, value):
        out.fill(value)


def _outputs(family: str, arrays: tuple, options: dict | None = None) -> tuple:
    fam = get_family(family)
    scalars = tuple(n for n in fam.inputs if n == "scale")
    plan = _prepare(fam, _Host(), arrays, options or {}, scalars)
    return plan(arrays, (np.float32(0.125),) * len(scalars))


def test_attention_over_no_key_gives_zero_and_minus_infinity():
    """Queries with no key at all: o = 0 and lse = -inf, as for a query that sees none, not what
    the allocation held."""
    q = np.ones((1, 2, 4, 64), np.float16)
    kv = np.ones((1, 2, 0, 64), np.float16)
    o, lse = _outputs("attention", (q, kv, kv))
    assert o.shape == (1, 2, 4, 64) and not o.any()
    assert lse.shape == (1, 2, 4) and np.isneginf(lse).all()


def test_attention_with_no_query_gives_empty_outputs():
    q = np.ones((1, 2, 0, 64), np.float16)
    kv = np.ones((1, 2, 5, 64), np.float16)
    o, lse = _outputs("attention", (q, kv, kv))
    assert o.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)


def test_the_backward_over_no_query_gives_zero_key_and_value_gradients():
    """No query: dk and dv are sums over none, 0; dq is empty."""
    q = np.ones((1, 2, 0, 64), np.float16)
    kv = np.ones((1, 2, 6, 64), np.float16)
    lse = np.zeros((1, 2, 0), np.float32)
    dq, dk, dv = _outputs("attention_backward", (q, kv, kv, q, q, lse, None))
    assert dq.shape == (1, 2, 0, 64)
    assert dk.shape == dv.shape == (1, 2, 6, 64) and not dk.any() and not dv.any()
