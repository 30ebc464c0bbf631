"""Skinny GEMM / GEMV against a float32 matmul reference, across variants and split-K."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_norm, poisoned

from shapeshift.kernels.gemv import GEMV_SPEC, SM90_GEMV_TABLE, gemv, gemv_ref
from shapeshift.kernels.registry import KernelConfig


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 37, 123, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
        (5, 70, 129, KernelConfig.make("dot", BLOCK_N=32, BLOCK_K=32, SPLIT_K=3)),
        (16, 33, 64, KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)),  # even K
        (3, 50, 100, KernelConfig.make("fma", BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)),
        (1, 24, 96, KernelConfig.make("fma", BLOCK_N=8, BLOCK_K=32, SPLIT_K=1)),
    ],
)
def test_gemv_matches_reference(m, n, k, config, dtype, device):
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    out = poisoned((m, n), dtype, device)
    gemv(x, w, out=out, config=config)
    assert_close_norm(out, gemv_ref(x, w), dtype)


@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_bias_and_default_config(split_k, device):
    x = torch.randn(2, 40, device=device)
    w = torch.randn(30, 40, device=device)
    bias = torch.randn(30, device=device)
    config = KernelConfig.make("dot", BLOCK_N=16, BLOCK_K=16, SPLIT_K=split_k)
    assert_close_norm(gemv(x, w, bias, config=config), gemv_ref(x, w, bias), torch.float32)
    assert_close_norm(gemv(x, w), gemv_ref(x, w), torch.float32)


def test_gemv_sm90_defaults_fill_the_gpu():
    # Shapes without a measured table entry (Llama-3-8B's): the rule keeps >= 0.9 programs per SM
    # busy and needs no split-K (whose second launch costs as much as streaming several MB).
    for n, k in [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        problem = {"m": 1, "n": n, "k": k, "dtype": "bfloat16"}
        config = GEMV_SPEC.choose_default(problem, "sm90")
        assert GEMV_SPEC.is_valid(config, problem)
        programs = -(-n // config["BLOCK_N"]) * config["SPLIT_K"]
        assert programs >= 0.9 * 132 and config["SPLIT_K"] == 1, (n, k, config, programs)
    # The Llama-3.2-1B projections take their H200-tuned entries (measured, so they may leave
    # SMs idle where that streamed faster: qkv_proj runs 96 programs of 32 rows), all without split-K.
    for (n, k), tabled in SM90_GEMV_TABLE.items():
        problem = {"m": 1, "n": n, "k": k, "dtype": "bfloat16"}
        assert GEMV_SPEC.choose_default(problem, "sm90") == tabled and tabled["SPLIT_K"] == 1
    # Narrow outputs fall back to split-K to fill the GPU.
    config = GEMV_SPEC.choose_default({"m": 1, "n": 512, "k": 4096, "dtype": "bfloat16"}, "sm90")
    assert config["SPLIT_K"] > 1 and -(-512 // config["BLOCK_N"]) * config["SPLIT_K"] >= 132


def test_gemv_errors(device):
    x = torch.randn(2, 8, device=device)
    with pytest.raises(ValueError, match=r"weight has shape \(4, 9\) but expected \(\*, 8\)"):
        gemv(x, torch.randn(4, 9, device=device))
    with pytest.raises(ValueError, match="x has 17 rows; this kernel serves 1..16 rows"):
        gemv(torch.randn(17, 8, device=device), torch.randn(4, 8, device=device))
    with pytest.raises(ValueError, match="'fma' variant serves at most 4 rows"):
        gemv(torch.randn(5, 8, device=device), torch.randn(4, 8, device=device),
             config=KernelConfig.make("fma", BLOCK_N=8, BLOCK_K=128, SPLIT_K=1))
    with pytest.raises(ValueError, match="weight has dtype torch.float16 but x has torch.float32"):
        gemv(x, torch.randn(4, 8, device=device).half())
