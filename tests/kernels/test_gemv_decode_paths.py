"""The decode-path GEMV additions: float32 output (lm_head logits without a cast) and the
gate/up GEMV with SiLU-and-mul in its epilogue, against plain-torch references."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_norm, poisoned

from shapeshift.kernels.activation import silu_and_mul_ref
from shapeshift.kernels.gemv import gemv, gemv_ref, gemv_silu_and_mul, gemv_silu_and_mul_ref
from shapeshift.kernels.registry import KernelConfig


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_float32_output(dtype, split_k, device):
    x = torch.randn(3, 96, dtype=dtype, device=device)
    w = torch.randn(40, 96, dtype=dtype, device=device)
    out = poisoned((3, 40), torch.float32, device)
    gemv(x, w, out=out, config=KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=split_k))
    ref = x.float() @ w.float().t()  # unrounded: the float32 output skips the rounding to dtype
    assert out.dtype == torch.float32
    assert_close_norm(out, ref, torch.float32 if dtype == torch.float32 else torch.float16)
    y = gemv(x, w, out_dtype=torch.float32, config=KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1))
    assert y.dtype == torch.float32 and y.shape == (3, 40)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,inner,k,config",
    [
        (1, 40, 96, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),  # masked N tail, even K
        (5, 32, 100, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),  # K tail
        (16, 24, 64, KernelConfig.make("dot", BLOCK_N=32, BLOCK_K=16, SPLIT_K=4)),  # split ignored
        (2, 20, 48, KernelConfig.make("fma", BLOCK_N=8, BLOCK_K=16, SPLIT_K=1)),
    ],
)
def test_gemv_silu_and_mul_matches_unfused(m, inner, k, config, dtype, device):
    x = torch.randn(m, k, dtype=dtype, device=device)
    gate_up = torch.randn(2 * inner, k, dtype=dtype, device=device) / k ** 0.5
    out = poisoned((m, inner), dtype, device)
    gemv_silu_and_mul(x, gate_up, out=out, config=config)
    ref = gemv_silu_and_mul_ref(x, gate_up)
    assert_close_norm(out, ref, dtype)
    # The reference is the unfused path: projection rounded to dtype, then silu_and_mul.
    assert torch.equal(ref, silu_and_mul_ref(gemv_ref(x, gate_up)))


def test_gemv_silu_and_mul_default_config_and_errors(device):
    x = torch.randn(2, 64, device=device)
    gate_up = torch.randn(48, 64, device=device) / 8
    assert_close_norm(gemv_silu_and_mul(x, gate_up), gemv_silu_and_mul_ref(x, gate_up), torch.float32)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv_silu_and_mul(x, torch.randn(47, 64, device=device))
    with pytest.raises(ValueError, match="x has 17 rows"):
        gemv_silu_and_mul(torch.randn(17, 64, device=device), gate_up)
