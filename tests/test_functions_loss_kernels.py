"""autosoft/functions/_loss_kernels.py: the loss's small kernels compile for the architectures the
families serve (CPU tier, NVRTC); on a GPU the gradient's scaling leaves x alone for a factor of
1, the mean's scale counts the rows kept, and the scaled sum is torch's within fp32 rounding
and the same bits at every call."""
from __future__ import annotations

import pytest

from autosoft.compile import compile_source
from autosoft.functions import _loss_kernels


@pytest.mark.parametrize("arch", ["80", "90"])
def test_the_kernels_compile(arch):
    result = compile_source(_loss_kernels.SOURCE, arch, "loss_kernels.cu")
    assert result.ok, result.log
    for kernel in _loss_kernels.KERNELS:
        assert kernel.encode() in result.cubin


def _cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scales_in_place_unless_the_factor_is_one(dtype):
    torch = _cuda()
    kind = getattr(torch, dtype)
    x = (torch.randn(3, 100_003, device="cuda") * 8).to(kind)
    x[0, :5] = torch.tensor([float("nan"), float("inf"), -0.0, 1e-30, 6e4]).to(kind)
    before = x.clone()
    _loss_kernels.scale_unless_one(x, torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    assert x.view(torch.int32 if dtype == "float32" else torch.int16).equal(
        before.view(torch.int32 if dtype == "float32" else torch.int16))  # not one bit touched, NaN included
    for factor in (0.37, -3.0, float("inf")):
        y = before.clone()
        _loss_kernels.scale_unless_one(y, torch.full((1,), factor, device="cuda"))
        expected = (before.float() * factor).to(kind)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["int64", "int32"])
@pytest.mark.parametrize("rows", [1, 1023, 1025, 70_001])
def test_the_mean_scale_is_one_over_the_rows_kept(dtype, rows):
    torch = _cuda()
    target = torch.randint(0, 50, (rows,), device="cuda", dtype=getattr(torch, dtype))
    target[::3] = 7
    kept = int((target != 7).sum())
    scale = _loss_kernels.mean_scale(target, 7)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert float(scale) == (float("inf") if kept == 0 else float(torch.tensor(1.0) / kept))
    assert float(_loss_kernels.mean_scale(torch.full_like(target, -100), -100)) == float("inf")  # none kept


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 1000, 4096, 100_003])
def test_the_scaled_sum_is_torchs_within_rounding_and_repeats_its_bits(rows):
    torch = _cuda()
    loss = torch.rand(rows, device="cuda") * 10
    scale = torch.full((1,), 1 / 3, device="cuda")
    got = _loss_kernels.scaled_sum(loss, scale)
    assert got.shape == () and got.dtype == torch.float32
    expected = float(loss.double().sum() * scale.double())
    assert abs(float(got) - expected) <= 1e-6 * abs(expected) + 1e-6
    assert all(_loss_kernels.scaled_sum(loss, scale).view(torch.int32) == got.view(torch.int32) for _ in range(5))
    loss[rows // 2] = float("nan")
    assert torch.isnan(_loss_kernels.scaled_sum(loss, scale))
    zero = torch.zeros(rows, device="cuda")
    assert torch.isnan(_loss_kernels.scaled_sum(zero, torch.full((1,), float("inf"), device="cuda")))  # 0 * inf


@pytest.mark.gpu
def test_bad_arguments_are_one_line_value_errors():
    torch = _cuda()
    cases = [(lambda: _loss_kernels.mean_scale(torch.zeros(4, device="cuda"), -100), "int64 or int32"),
             (lambda: _loss_kernels.scaled_sum(torch.zeros(4, device="cuda", dtype=torch.float16),
                                              torch.ones(1, device="cuda")), "contiguous float32"),
             (lambda: _loss_kernels.scale_unless_one(torch.zeros(4, 4, device="cuda").t(),
                                                    torch.ones(1, device="cuda")), "contiguous")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "\n" not in str(info.value)
