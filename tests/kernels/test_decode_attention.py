"""Paged decode attention (GQA, split-K) against the float32 gather-and-softmax reference."""

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_norm, poisoned

from shapeshift.kernels.decode_attention import decode_attention, decode_attention_ref
from shapeshift.kernels.registry import KernelConfig


def _paged_problem(context_lens, hq, hkv, d, block_size, dtype, device, extra_blocks=3):
    B = len(context_lens)
    max_blocks = max(1, max((n + block_size - 1) // block_size for n in context_lens)) + 1
    num_blocks = B * max_blocks + extra_blocks
    k_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype, device=device)
    # Scattered, non-contiguous block ids per sequence; unused table entries point at junk.
    perm = torch.randperm(num_blocks, device=device)[: B * max_blocks]
    block_tables = perm.view(B, max_blocks).to(torch.int32)
    q = torch.randn(B, hq, d, dtype=dtype, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables, lens


CASES = [
    # context lens, Hq, Hkv, D, block_size
    ([1, 37, 16], 4, 2, 16, 4),
    ([23, 0, 5], 6, 2, 24, 8),  # a padding row (context 0) and head_dim not a power of two
    ([50], 3, 3, 32, 16),  # MHA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,hq,hkv,d,bs", CASES)
@pytest.mark.parametrize("variant,splits,merge_last", [("dot", 1, 0), ("dot", 4, 0), ("dot", 4, 1), ("fma", 3, 1)])
def test_decode_attention_matches_reference(lens, hq, hkv, d, bs, variant, splits, merge_last, dtype, device):
    q, kc, vc, bt, cl = _paged_problem(lens, hq, hkv, d, bs, dtype, device)
    scale = d ** -0.5
    out = poisoned(q.shape, dtype, device)
    config = KernelConfig.make(variant, num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=splits,
                               MERGE_LAST=merge_last)
    decode_attention(q, kc, vc, bt, cl, scale, out=out, config=config)
    ref = decode_attention_ref(q, kc, vc, bt, cl, scale)
    assert_close_norm(out, ref, dtype)
    zero_rows = cl == 0
    assert (out[zero_rows] == 0).all(), "sequences with no context must produce zeros"


def test_merge_in_the_last_split_agrees_with_the_merge_launch_and_resets_its_counters(device, monkeypatch):
    """MERGE_LAST runs pass 2's code in the program that finishes its group last (no pass-2
    launch): the same result as pass 2's own launch up to float32 summation order (the two
    compile it at different tile shapes), the same bits on every repeat (no launch reads a
    partial before it is written), and every counter back at zero after each launch (the next
    launch, or graph replay, starts from them)."""
    from shapeshift.kernels import decode_attention as module
    from shapeshift.kernels.decode_attention import MERGE_COUNTERS, _MERGE_COUNTERS

    q, kc, vc, bt, cl = _paged_problem([40, 0, 7, 64, 127, 3], 8, 2, 16, 8, torch.float32, device)
    pass2 = []  # grids of pass 2's own launches
    reduce_kernel = module._decode_attention_reduce_kernel

    class Counted:
        def __getitem__(self, grid):
            pass2.append(grid)
            return reduce_kernel[grid]

    monkeypatch.setattr(module, "_decode_attention_reduce_kernel", Counted())

    def run(merge_last: int) -> torch.Tensor:
        config = KernelConfig.make("dot", num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=8, MERGE_LAST=merge_last)
        return decode_attention(q, kc, vc, bt, cl, 0.25, out=poisoned(q.shape, q.dtype, device), config=config)

    launched = run(0)
    assert pass2 == [(6, 2)]  # (B, Hkv)
    merged = [run(1) for _ in range(20 if device.type == "cuda" else 2)]
    assert pass2 == [(6, 2)]  # the merging launches had no second launch, yet their outputs are whole
    assert all(torch.equal(merged[0], m) for m in merged[1:])
    torch.testing.assert_close(merged[0], launched, atol=1e-6, rtol=1e-5)
    assert_close_norm(merged[0], decode_attention_ref(q, kc, vc, bt, cl, 0.25), torch.float32)
    counters = _MERGE_COUNTERS.for_stream(q.device, MERGE_COUNTERS)
    assert counters.numel() == MERGE_COUNTERS and int(counters.count_nonzero()) == 0
    assert (merged[0][1] == 0).all()  # the empty row: every split empty, zeros


def test_decode_attention_default_config(device):
    q, kc, vc, bt, cl = _paged_problem([9, 30], 8, 2, 16, 8, torch.float32, device)
    out = decode_attention(q, kc, vc, bt, cl, 0.3)
    assert_close_norm(out, decode_attention_ref(q, kc, vc, bt, cl, 0.3), torch.float32)


def test_decode_attention_errors(device):
    q, kc, vc, bt, cl = _paged_problem([4], 4, 2, 16, 4, torch.float32, device)
    with pytest.raises(ValueError, match="not a multiple of the cache's 3 kv heads"):
        decode_attention(q, kc[:, :, :1].expand(-1, -1, 3, -1).contiguous(), vc[:, :, :1].expand(-1, -1, 3, -1).contiguous(), bt, cl, 1.0)
    with pytest.raises(ValueError, match="block_tables has dtype torch.int64"):
        decode_attention(q, kc, vc, bt.long(), cl, 1.0)
    with pytest.raises(ValueError, match=r"context_lens has shape \(2,\) but expected \(1,\)"):
        decode_attention(q, kc, vc, bt, torch.ones(2, dtype=torch.int32, device=device), 1.0)
    with pytest.raises(ValueError, match="v_cache has shape"):
        decode_attention(q, kc, vc[:-1], bt, cl, 1.0)


def test_decode_attention_timestamps(device):
    """timestamps: refused off the GPU (they read its clock); on CUDA every program stamps its
    start, its partial stored and its end, in that order, and the output is unchanged."""
    q, kc, vc, bt, cl = _paged_problem([40, 7], 8, 2, 16, 8, torch.float32, device)
    config = KernelConfig.make("dot", num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=2, MERGE_LAST=1)
    stamps = torch.zeros(8, 16, dtype=torch.int64, device=device)
    if device.type != "cuda":
        with pytest.raises(ValueError, match="CUDA only"):
            decode_attention(q, kc, vc, bt, cl, 0.3, config=config, timestamps=stamps)
        return
    with pytest.raises(ValueError, match="a row for each of the 8 programs"):
        decode_attention(q, kc, vc, bt, cl, 0.3, config=config, timestamps=stamps[:7])
    out = decode_attention(q, kc, vc, bt, cl, 0.3, config=config, timestamps=stamps)
    torch.cuda.synchronize()
    assert_close_norm(out, decode_attention_ref(q, kc, vc, bt, cl, 0.3), torch.float32)
    ran = stamps.cpu()
    assert (ran[:, 0] > 0).all() and (ran[:, 1] >= ran[:, 0]).all() and (ran[:, 2] >= ran[:, 1]).all()
    assert (ran[:, 3:15] == 0).all()  # nothing else written but the SM in slot 15


@pytest.mark.parametrize("batch,max_context,block_n,splits", [
    (1, 512, 64, 8),       # tuned on the H200: 4.80 us against 6.96 us for 2 four-tile splits
    (1, 400, 64, 8),       # 6 tiles: one-tile splits (2 empty), 1,142 against 1,132 tok/s for 4
    (32, 2048, 64, 2),     # 44.4 us against 63.0 us for 1
    (1, 32768, 128, 32),   # 30.2 us against 36.6 us with 64-token tiles
    (128, 2048, 64, 1),    # enough programs already: unchanged
])
def test_decode_attention_h200_default_follows_the_tuning(batch, max_context, block_n, splits):
    from shapeshift.kernels.decode_attention import DECODE_ATTENTION_SPEC

    problem = {"batch": batch, "q_heads": 32, "kv_heads": 8, "head_dim": 64, "max_context": max_context,
               "block_size": 16, "dtype": "bfloat16"}
    config = DECODE_ATTENTION_SPEC.choose_default(problem, "sm90")
    assert (config["BLOCK_N"], config["NUM_SPLITS"]) == (block_n, splits)
    assert config["MERGE_LAST"] == (splits > 1)  # pass 2 inside pass 1 whenever there is one
    assert DECODE_ATTENTION_SPEC.is_valid(config, problem)


ROPE_CASES = [
    # context lens (each counts the new token), Hq, Hkv, D, block_size, splits
    ([1, 37, 16], 4, 2, 16, 4, 1),
    ([1, 37, 16], 4, 2, 16, 4, 4),  # splits whose last one holds only the new token, or is empty
    ([17, 5], 6, 2, 24, 8, 3),  # head_dim not a power of two
    ([50], 3, 3, 32, 16, 2),  # MHA
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lens,hq,hkv,d,bs,splits", ROPE_CASES)
@pytest.mark.parametrize("variant,merge_last", [("dot", 1), ("fma", 0)])
def test_decode_attention_rope_matches_rotary_then_attention(lens, hq, hkv, d, bs, splits, variant, merge_last, dtype,
                                                             device):
    """Rotary + KV write + attention in one pass: the output and both caches as
    kernels.rotary's reference writing the caches and decode_attention's reference reading them."""
    from shapeshift.kernels.decode_attention import decode_attention_rope, decode_attention_rope_ref
    from shapeshift.kernels.rotary import rope_cos_sin_cache

    q, kc, vc, bt, cl = _paged_problem(lens, hq, hkv, d, bs, dtype, device)
    B = len(lens)
    # The step's projections as strided views of one fused qkv row, as the forward pass has them.
    qkv = torch.randn(B, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    q, k_new, v_new = (t.view(B, -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    positions = (cl.long() - 1).clamp(min=0) + 3  # positions need not equal context lengths
    cos_sin = rope_cos_sin_cache(d, 128, 10000.0, device=device)
    slots = torch.stack([bt[i, (n - 1) // bs].long() * bs + (n - 1) % bs for i, n in enumerate(cl.tolist())])
    slots[-1] = -1 if B > 1 else slots[-1]  # a row with no cache write (its attention still sees the token)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = decode_attention_rope_ref(q, k_new, v_new, positions, cos_sin, slots, kc_ref, vc_ref, bt, cl, d ** -0.5)
    out = poisoned(q.shape, dtype, device)
    config = KernelConfig.make(variant, num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=splits,
                               MERGE_LAST=merge_last if splits > 1 else 0)
    decode_attention_rope(q, k_new, v_new, positions, cos_sin, slots, kc, vc, bt, cl, d ** -0.5, out=out,
                          config=config)
    if B > 1:  # the skipped write: the reference attends to the cache's old content there, the kernel
        ref = ref[:-1]  # to the new token (what a real step means), so compare the written rows only
        out = out[:-1]
    assert_close_norm(out, ref, dtype)
    # float32: within a rounding or two (the GPU may contract the rotation into FMAs differently).
    torch.testing.assert_close(kc, kc_ref, atol=1e-6, rtol=1e-6) if dtype == torch.float32 else \
        assert_close_norm(kc, kc_ref, dtype)
    assert torch.equal(vc, vc_ref)


def test_decode_attention_rope_errors(device):
    from shapeshift.kernels.decode_attention import decode_attention_rope
    from shapeshift.kernels.rotary import rope_cos_sin_cache

    q, kc, vc, bt, cl = _paged_problem([4], 4, 2, 16, 4, torch.float32, device)
    k_new = v_new = torch.zeros(1, 2, 16, device=device)
    pos, slots = torch.zeros(1, dtype=torch.int64, device=device), torch.zeros(1, dtype=torch.int64, device=device)
    cs = rope_cos_sin_cache(16, 8, 10000.0, device=device)
    with pytest.raises(ValueError, match=r"k_new has shape \(1, 3, 16\)"):
        decode_attention_rope(q, torch.zeros(1, 3, 16, device=device), v_new, pos, cs, slots, kc, vc, bt, cl, 1.0)
    with pytest.raises(ValueError, match="cos_sin_cache has dtype torch.float16"):
        decode_attention_rope(q, k_new, v_new, pos, cs.half(), slots, kc, vc, bt, cl, 1.0)
    with pytest.raises(ValueError, match="v_new has dtype torch.float16"):
        decode_attention_rope(q, k_new, v_new.half(), pos, cs, slots, kc, vc, bt, cl, 1.0)
