"""MoE routing, alignment, grouped GEMM and the fused layer against float32 references."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_norm, poisoned

from shapeshift.kernels.moe import (fused_moe, fused_moe_ref, moe_align, moe_align_ref, moe_grouped_gemm,
                                    moe_grouped_gemm_ref, topk_routing, topk_routing_ref)
from shapeshift.kernels.registry import KernelConfig


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,renorm", [(5, 8, 2, True), (7, 6, 3, False), (3, 60, 8, True)])
def test_topk_routing_matches_reference(T, E, k, renorm, dtype, device):
    # Distinct logits, exact in every dtype: top-k order on ties is unspecified in torch.
    logits = torch.stack([torch.randperm(E, device=device) for _ in range(T)]).to(dtype) / 8 - E / 16
    weights, ids = topk_routing(logits, k, renorm, config=KernelConfig.make("rows", num_stages=1, BLOCK_T=4))
    ref_w, ref_ids = topk_routing_ref(logits, k, renorm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


def _check_alignment(ids, E, block_m, sorted_ids, expert_ids, num_padded):
    entries = ids.numel()
    total = int(num_padded)
    ref_sorted, ref_experts, ref_total = moe_align_ref(ids, E, block_m)
    assert total == int(ref_total) and total % block_m == 0
    assert torch.equal(expert_ids, ref_experts)
    flat = ids.flatten().long()
    for blk in range(total // block_m):
        members = sorted_ids[blk * block_m : (blk + 1) * block_m].long()
        real = members[members < entries]
        assert (flat[real] == int(expert_ids[blk])).all(), "an entry sits in another expert's block"
    real = sorted_ids[:total].long()
    real = real[real < entries]
    assert torch.equal(real.sort().values, torch.arange(entries, device=ids.device)), "each entry exactly once"
    assert (sorted_ids[total:] == entries).all(), "the tail must be padding"


@pytest.mark.parametrize("T,E,k,block_m", [(9, 5, 2, 4), (1, 8, 2, 16), (30, 4, 3, 8)])
def test_moe_align(T, E, k, block_m, device):
    ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]).to(torch.int32)
    _check_alignment(ids, E, block_m, *moe_align(ids, E, block_m))


def test_moe_align_skewed_routing(device):
    # Every token picks expert 0 plus one other: one hot expert, several empty ones.
    T, E, k = 20, 16, 2
    ids = torch.stack([torch.zeros(T, dtype=torch.int64, device=device),
                       torch.randint(1, 3, (T,), device=device)], 1).to(torch.int32)
    _check_alignment(ids, E, 4, *moe_align(ids, E, 4))


def test_moe_align_many_programs_skewed(device):
    # 600 entries over 64 experts span several count/scatter programs, which must reserve
    # disjoint runs inside the hot experts' groups.
    T, E, k = 300, 64, 2
    hot = torch.tensor([3, 17, 40], device=device)
    first = hot[torch.randint(0, 3, (T,), device=device)]
    second = (first + 1 + torch.randint(0, E - 1, (T,), device=device)) % E
    ids = torch.stack([first, second], 1).to(torch.int32)
    _check_alignment(ids, E, 16, *moe_align(ids, E, 16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_per_token", [True, False])
def test_moe_grouped_gemm(a_per_token, dtype, device):
    T, E, k, N, K = 6, 4, 2, 40, 72
    config = KernelConfig.make("grouped", num_stages=1, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]).to(torch.int32)
    a = torch.randn(T if a_per_token else T * k, K, dtype=dtype, device=device)
    w = torch.randn(E, N, K, dtype=dtype, device=device) / K**0.5
    routing = torch.rand(T, k, device=device) if not a_per_token else None
    aligned = moe_align(ids, E, 16)
    out = poisoned((T * k, N), dtype, device)
    moe_grouped_gemm(a, w, *aligned, k, a_per_token=a_per_token, routing_weights=routing, out=out, config=config)
    assert_close_norm(out, moe_grouped_gemm_ref(a, w, ids, a_per_token, routing), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe_matches_reference(dtype, device):
    T, E, k, H, inner = 7, 6, 2, 48, 40
    x = torch.randn(T, H, dtype=dtype, device=device)
    w13 = (torch.randn(E, 2 * inner, H, device=device) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inner, device=device) / inner**0.5).to(dtype)
    logits = torch.randn(T, E, device=device).to(dtype)
    out = fused_moe(x, w13, w2, logits, k, True)
    assert_close_norm(out, fused_moe_ref(x, w13, w2, logits, k, True), dtype)


def test_moe_errors(device):
    logits = torch.randn(4, 6, device=device)
    with pytest.raises(ValueError, match="top_k must be an int in 1..6"):
        topk_routing(logits, 7, True)
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        moe_align(ids, 6, 12)
    aligned = moe_align(ids, 6, 16)
    a = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="call moe_align with block_m=32"):
        moe_grouped_gemm(a, torch.randn(6, 5, 8, device=device), *aligned, 2, a_per_token=True,
                         config=KernelConfig.make("grouped", BLOCK_M=32, BLOCK_N=32, BLOCK_K=32))
    with pytest.raises(ValueError, match=r"w has shape \(6, 5, 9\) but expected \(\*, \*, 8\)"):
        moe_grouped_gemm(a, torch.randn(6, 5, 9, device=device), *aligned, 2, a_per_token=True)
    with pytest.raises(ValueError, match=r"w2 must be \[E=6, H=8, I=5\]"):
        fused_moe(a, torch.randn(6, 10, 8, device=device), torch.randn(6, 8, 4, device=device), logits, 2, True)
