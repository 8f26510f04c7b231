"""Functions without a backward (attention_colsum) refuse torch inputs that require gradients while autograd records
(a stand-in torch module: the refusal happens before any array is touched, so no GPU or torch is needed)."""
from __future__ import annotations

import sys
import types

import pytest

import autosoft


class FakeTensor:
    def __init__(self, requires_grad: bool) -> None:
        self.requires_grad = requires_grad
        self.shape = (1, 2, 8, 64)


@pytest.fixture
def fake_torch(monkeypatch):
    torch = types.ModuleType("torch")
    torch.Tensor = FakeTensor
    torch.grad_enabled = True
    torch.is_grad_enabled = lambda: torch.grad_enabled
    monkeypatch.setitem(sys.modules, "torch", torch)
    return torch


def test_inputs_that_require_gradients_are_refused_while_autograd_records(fake_torch):
    # attention_colsum has no backward (autosoft.attention has one: tests/test_torch_ops.py)
    call = lambda q, k, v: autosoft.attention_colsum(q, k, v, 4)  # noqa: E731
    plain, needy = FakeTensor(False), FakeTensor(True)
    with pytest.raises(RuntimeError, match=r"has no backward yet.*torch.no_grad\(\)"):
        call(plain, needy, plain)
    fake_torch.grad_enabled = False  # under torch.no_grad(): the call goes on (and fails later on the fake)
    with pytest.raises(Exception) as caught:
        call(plain, needy, plain)
    assert "no backward" not in str(caught.value)


def test_without_torch_nothing_is_checked(monkeypatch):
    from autosoft.autograd import refuse_gradients

    monkeypatch.delitem(sys.modules, "torch", raising=False)
    refuse_gradients("attention", FakeTensor(True))  # no torch loaded: a CuPy call, nothing to refuse
