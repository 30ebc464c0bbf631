"""Chunked-prefill attention over paged KV (mixed prefill / chunk / decode rows)."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_norm, poisoned

from shapeshift.kernels.prefill_attention import prefill_attention, prefill_attention_ref
from shapeshift.kernels.registry import KernelConfig


def _mixed_batch(query_lens, context_lens, hq, hkv, d, block_size, dtype, device):
    B = len(query_lens)
    max_blocks = max((n + block_size - 1) // block_size for n in context_lens) + 1
    num_blocks = B * max_blocks + 2
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    block_tables = torch.randperm(num_blocks, device=device)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    qsl = torch.zeros(B + 1, dtype=torch.int32, device=device)
    qsl[1:] = torch.tensor(query_lens, device=device).cumsum(0)
    q = torch.randn(int(qsl[-1]), hq, d, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, qsl, lens


# (query lens, context lens): a fresh prompt, a later chunk after cached blocks, a decode row,
# and a sequence with no new tokens this step.
MIXED = ([19, 3, 1, 0], [19, 21, 9, 4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,bs", [(4, 2, 16, 4), (3, 1, 24, 8)])
@pytest.mark.parametrize("variant,block_m,block_n", [("tile", 16, 16), ("tile", 32, 16), ("gqa", 8, 16)])
def test_prefill_attention_matches_reference(hq, hkv, d, bs, variant, block_m, block_n, dtype, device):
    q, kc, vc, bt, qsl, cl = _mixed_batch(*MIXED, hq, hkv, d, bs, dtype, device)
    out = poisoned(q.shape, dtype, device)
    config = KernelConfig.make(variant, num_warps=4, num_stages=1, BLOCK_M=block_m, BLOCK_N=block_n)
    prefill_attention(q, kc, vc, bt, qsl, cl, d ** -0.5, max(MIXED[0]), out=out, config=config)
    assert_close_norm(out, prefill_attention_ref(q, kc, vc, bt, qsl, cl, d ** -0.5), dtype)


def test_prefill_attention_first_token_attends_only_to_itself(device):
    q, kc, vc, bt, qsl, cl = _mixed_batch([6], [6], 2, 2, 16, 4, torch.float32, device)
    out = prefill_attention(q, kc, vc, bt, qsl, cl, 0.25, 6)
    first_v = vc[bt[0, 0].long(), 0]  # [Hkv, D]: token 0's value
    torch.testing.assert_close(out[0], first_v, rtol=1e-5, atol=1e-5)


def test_prefill_attention_errors(device):
    q, kc, vc, bt, qsl, cl = _mixed_batch([3], [3], 2, 1, 16, 4, torch.float32, device)
    with pytest.raises(ValueError, match="max_query_len must be a non-negative Python int"):
        prefill_attention(q, kc, vc, bt, qsl, cl, 1.0, torch.tensor(3))
    with pytest.raises(ValueError, match="query_start_loc has dtype torch.int64"):
        prefill_attention(q, kc, vc, bt, qsl.long(), cl, 1.0, 3)
    with pytest.raises(ValueError, match=r"context_lens has shape \(2,\) but expected \(1,\)"):
        prefill_attention(q, kc, vc, bt, qsl, torch.ones(2, dtype=torch.int32, device=device), 1.0, 3)
    with pytest.raises(ValueError, match="k_cache has shape"):
        prefill_attention(q, kc[..., :8], vc, bt, qsl, cl, 1.0, 3)
