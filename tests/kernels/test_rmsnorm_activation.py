"""RMSNorm (+ residual) and SiLU-and-mul against their float32 references."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_elementwise, poisoned

from shapeshift.kernels.activation import silu_and_mul, silu_and_mul_ref
from shapeshift.kernels.registry import KernelConfig
from shapeshift.kernels.rmsnorm import rmsnorm, rmsnorm_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 123), (3, 129)])
def test_rmsnorm_matches_reference(rows, hidden, dtype, device):
    x = torch.randn(rows, hidden, dtype=dtype, device=device) * 3
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out = poisoned((rows, hidden), dtype, device)
    got = rmsnorm(x, weight, 1e-5, out=out)
    assert got is out
    assert_close_elementwise(out, rmsnorm_ref(x, weight, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden,rows_per_program", [(5, 123, 1), (7, 129, 4)])
def test_rmsnorm_fused_residual(rows, hidden, rows_per_program, dtype, device):
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    residual = torch.randn(rows, hidden, dtype=dtype, device=device)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    ref_out, ref_h = rmsnorm_ref(x, weight, 1e-6, residual)
    out = poisoned((rows, hidden), dtype, device)
    residual_out = poisoned((rows, hidden), dtype, device)
    config = KernelConfig.make("row", num_warps=2, num_stages=1, ROWS_PER_PROGRAM=rows_per_program)
    rmsnorm(x, weight, 1e-6, residual, out=out, residual_out=residual_out, config=config)
    assert_close_elementwise(residual_out, ref_h, dtype, "residual_out")
    assert_close_elementwise(out, ref_out, dtype, "out")


def test_rmsnorm_in_place_residual_and_strided_rows(device):
    dtype = torch.float32
    big = torch.randn(4, 200, dtype=dtype, device=device)
    x = big[:, :100]  # row stride 200
    residual = torch.randn(4, 100, dtype=dtype, device=device)
    weight = torch.randn(100, dtype=dtype, device=device)
    ref_out, ref_h = rmsnorm_ref(x, weight, 1e-5, residual.clone())
    out, res = rmsnorm(x, weight, 1e-5, residual, residual_out=residual)
    assert res is residual
    assert_close_elementwise(residual, ref_h, dtype, "in-place residual")
    assert_close_elementwise(out, ref_out, dtype)


def test_rmsnorm_errors(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\).*expected \(8,\)"):
        rmsnorm(x, torch.ones(7, device=device), 1e-5)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        rmsnorm(x[0], torch.ones(8, device=device), 1e-5)
    with pytest.raises(ValueError, match="residual has dtype torch.float16 but x has torch.float32"):
        rmsnorm(x, torch.ones(8, device=device), 1e-5, residual=torch.ones(3, 8, dtype=torch.float16, device=device))
    with pytest.raises(ValueError, match="unit stride in its last dim"):
        rmsnorm(torch.randn(8, 3, device=device).t(), torch.ones(8, device=device), 1e-5)
    with pytest.raises(ValueError, match="dtype torch.int32"):
        rmsnorm(x.int(), torch.ones(8, device=device), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inner,block", [(1, 64, 256), (5, 123, 256), (3, 300, 128 * 2)])
def test_silu_and_mul_matches_reference(rows, inner, block, dtype, device):
    x = torch.randn(rows, 2 * inner, dtype=dtype, device=device) * 4
    out = poisoned((rows, inner), dtype, device)
    silu_and_mul(x, out=out, config=KernelConfig.make("tile", num_warps=4, num_stages=1, BLOCK=block))
    assert_close_elementwise(out, silu_and_mul_ref(x), dtype)


def test_silu_and_mul_default_config_and_errors(device):
    x = torch.randn(2, 10, device=device)
    assert_close_elementwise(silu_and_mul(x), silu_and_mul_ref(x), torch.float32)
    with pytest.raises(ValueError, match="last dim 9 is odd"):
        silu_and_mul(torch.randn(2, 9, device=device))
    with pytest.raises(ValueError, match=r"out has shape \(2, 4\) but expected \(2, 5\)"):
        silu_and_mul(x, out=torch.empty(2, 4, device=device))
