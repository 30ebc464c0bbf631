"""Rotary embedding fused with the paged KV-cache write, against the float32 reference."""

import math

import pytest
import torch
from kernel_test_utils import DTYPES, assert_close_elementwise, poisoned

from shapeshift.kernels.rotary import rope_cos_sin_cache, rope_inv_freq, rotary_kv_write, rotary_kv_write_ref


def _inputs(T, hq, hkv, d, dtype, device, num_blocks=6, block_size=4):
    qkv = torch.randn(T, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    # q/k/v as strided views of one fused projection, as the engine produces them.
    q = qkv[:, : hq * d].view(T, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    positions = torch.randint(0, 50, (T,), device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:T]
    return q, k, v, positions, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,hq,hkv,d", [(5, 4, 2, 16), (3, 6, 3, 10), (1, 2, 1, 64)])
def test_rotary_kv_write_matches_reference(T, hq, hkv, d, dtype, device):
    num_blocks, block_size = 6, 4
    q, k, v, positions, slots = _inputs(T, hq, hkv, d, dtype, device, num_blocks, block_size)
    slots[0] = -1  # padding token: no cache write
    cos_sin = rope_cos_sin_cache(d, 64, 10000.0, device=device)
    k_cache = poisoned((num_blocks, block_size, hkv, d), dtype, device)
    v_cache = poisoned((num_blocks, block_size, hkv, d), dtype, device)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref_q = rotary_kv_write_ref(q, k, v, positions, cos_sin, ref_k, ref_v, slots)
    q_out = poisoned((T, hq, d), dtype, device)
    got = rotary_kv_write(q, k, v, positions, cos_sin, k_cache, v_cache, slots, q_out=q_out)
    assert got is q_out
    assert_close_elementwise(q_out, ref_q, dtype, "q_out")
    written = slots[slots >= 0]
    blocks, offs = written // block_size, written % block_size
    assert_close_elementwise(k_cache[blocks, offs], ref_k[blocks, offs], dtype, "k_cache slots")
    assert torch.equal(v_cache[blocks, offs], ref_v[blocks, offs]), "v must be copied bit-exactly"
    # Every slot not in slot_mapping (including the skipped padding token's) stays untouched.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[written] = False
    assert torch.isnan(k_cache.view(-1, hkv, d)[untouched]).all()
    assert torch.isnan(v_cache.view(-1, hkv, d)[untouched]).all()


def test_rotary_q_in_place(device):
    T, hq, hkv, d = 3, 4, 2, 8
    q, k, v, positions, slots = _inputs(T, hq, hkv, d, torch.float32, device)
    q = q.contiguous()
    cos_sin = rope_cos_sin_cache(d, 64, 500000.0, device=device)
    kc = torch.zeros(6, 4, hkv, d, device=device)
    ref_q = rotary_kv_write_ref(q, k, v, positions, cos_sin, kc.clone(), kc.clone(), slots)
    rotary_kv_write(q, k, v, positions, cos_sin, kc, kc.clone(), slots, q_out=q)
    assert_close_elementwise(q, ref_q, torch.float32)


def test_rope_cache_math_and_llama3_scaling():
    cs = rope_cos_sin_cache(8, 10, 10000.0)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).double() / 8)
    assert torch.allclose(cs[7, :4].double(), torch.cos(7 * inv), atol=1e-6)
    assert torch.allclose(cs[7, 4:].double(), torch.sin(7 * inv), atol=1e-6)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base = rope_inv_freq(64, 500000.0)
    scaled = rope_inv_freq(64, 500000.0, scaling)
    wavelen = 2 * math.pi / base
    assert torch.equal(scaled[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies kept
    assert torch.allclose(scaled[wavelen > 8192], base[wavelen > 8192] / 32)  # low frequencies slowed
    band = (wavelen >= 8192 / 4) & (wavelen <= 8192)
    assert band.any() and ((scaled[band] < base[band]) & (scaled[band] > base[band] / 32)).all()
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_inv_freq(64, 1e4, {"rope_type": "yarn"})


def test_rotary_errors(device):
    T, hq, hkv, d = 2, 4, 2, 8
    q, k, v, positions, slots = _inputs(T, hq, hkv, d, torch.float32, device)
    cos_sin = rope_cos_sin_cache(d, 64, 1e4, device=device)
    kc = torch.zeros(6, 4, hkv, d, device=device)
    with pytest.raises(ValueError, match=r"k_cache has shape .* expected \(\*, \*, 2, 8\)"):
        rotary_kv_write(q, k, v, positions, cos_sin, torch.zeros(6, 4, 3, d, device=device), kc, slots)
    with pytest.raises(ValueError, match="cos_sin_cache has dtype torch.float16"):
        rotary_kv_write(q, k, v, positions, cos_sin.half(), kc, kc, slots)
    with pytest.raises(ValueError, match="slot_mapping has dtype torch.float32"):
        rotary_kv_write(q, k, v, positions, cos_sin, kc, kc, slots.float())
    with pytest.raises(ValueError, match="k_cache has dtype torch.float16 but q has torch.float32"):
        rotary_kv_write(q, k, v, positions, cos_sin, kc.half(), kc.half(), slots)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rotary_kv_write(q[..., :7], k[..., :7], v[..., :7], positions, cos_sin[:, :7], kc[..., :7], kc[..., :7], slots)
