"""autosoft/functions/_scale.py: the gradient-scaling kernels compile for the architectures the
families serve (CPU tier, NVRTC), and on a GPU scale in place unless the factor is 1."""
from __future__ import annotations

import pytest

from autosoft.compile import compile_source
from autosoft.functions import _scale


@pytest.mark.parametrize("arch", ["80", "90"])
def test_the_kernels_compile(arch):
    result = compile_source(_scale.SOURCE, arch, "scale_unless_one.cu")
    assert result.ok, result.log
    for dtype in ("float32", "float16", "bfloat16"):
        assert f"scale_unless_one_{dtype}".encode() in result.cubin


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scales_in_place_unless_the_factor_is_one(dtype):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    kind = getattr(torch, dtype)
    x = (torch.randn(3, 100_003, device="cuda") * 8).to(kind)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30, 6e4]).to(kind)
    before = x.clone()
    _scale.scale_unless_one(x, torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    assert x.view(torch.int32 if dtype == "float32" else torch.int16).equal(
        before.view(torch.int32 if dtype == "float32" else torch.int16))  # not one bit touched, NaN included
    for factor in (0.37, -3.0, float("inf")):
        y = before.clone()
        _scale.scale_unless_one(y, torch.full((1,), factor, device="cuda"))
        expected = (before.float() * factor).to(kind)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
