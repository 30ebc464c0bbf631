"""Rotary position embedding (neox "rotate half", as Llama in Hugging Face) fused with the
paged KV-cache write.

Math, for a head vector x of width D = 2H at position p, with cos/sin from the cache row p:
    x1, x2 = x[:H], x[H:]
    rope(x) = [x1 * cos - x2 * sin,  x2 * cos + x1 * sin]
    cos[i] = cos(p * inv_freq[i]), sin[i] = sin(p * inv_freq[i]),  i < H
computed in float32 and rounded once to the input dtype. `rope_cos_sin_cache()` builds the
[max_position, D] float32 table (cos in the first half, sin in the second), including the
"llama3" frequency scaling.

Data flow, one program per token t:
    q [T, Hq, D]  --rope-->  q_out [T, Hq, D]                      (returned)
    k [T, Hkv, D] --rope-->  k_cache[slot // bs, slot % bs, :, :]   (slot = slot_mapping[t])
    v [T, Hkv, D] --copy-->  v_cache[slot // bs, slot % bs, :, :]
Caches are [num_blocks, block_size, Hkv, D] (ENGINE-CONTRACT). A negative slot skips the cache
write (padding tokens of a CUDA-graph batch).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, LaunchPlans, check_runnable_device, check_same_dtype, check_tensor, dtype_name,
                     next_power_of_2, pdl_options)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import grid_dependency_sync


@triton.jit
def _rope_kv_write_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [T, Hkv, D]
    v_ptr,  # [T, Hkv, D]
    positions_ptr,  # [T] int
    cos_sin_ptr,  # [max_position, D] float32
    slot_mapping_ptr,  # [T] int64
    q_out_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    stride_q_t, stride_q_h,
    stride_k_t, stride_k_h,
    stride_v_t, stride_v_h,
    stride_qo_t, stride_qo_h,
    stride_cs,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    num_q_heads,
    num_kv_heads,
    block_size,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_sync(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < HALF
    cos = tl.load(cos_sin_ptr + position * stride_cs + d, mask=d_mask, other=0.0)[None, :]  # [1, BLOCK_HALF]
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + d, mask=d_mask, other=0.0)[None, :]

    # Queries: all heads of the token at once.
    hq = tl.arange(0, BLOCK_HQ)
    q_mask = (hq[:, None] < num_q_heads) & d_mask[None, :]
    q_base = q_ptr + t * stride_q_t + hq[:, None] * stride_q_h + d[None, :]
    q1 = tl.load(q_base, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF, mask=q_mask, other=0.0).to(tl.float32)
    qo_base = q_out_ptr + t * stride_qo_t + hq[:, None] * stride_qo_h + d[None, :]
    tl.store(qo_base, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(qo_base + HALF, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=q_mask)

    # Keys and values go straight to their paged slot.
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    hk = tl.arange(0, BLOCK_HKV)
    kv_mask = (hk[:, None] < num_kv_heads) & d_mask[None, :] & (slot >= 0)
    k_base = k_ptr + t * stride_k_t + hk[:, None] * stride_k_h + d[None, :]
    k1 = tl.load(k_base, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    kc_base = k_cache_ptr + block * stride_kc_block + offset * stride_kc_slot + hk[:, None] * stride_kc_head + d[None, :]
    tl.store(kc_base, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(kc_base + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
    v_base = v_ptr + t * stride_v_t + hk[:, None] * stride_v_h + d[None, :]
    vc_base = v_cache_ptr + block * stride_vc_block + offset * stride_vc_slot + hk[:, None] * stride_vc_head + d[None, :]
    tl.store(vc_base, tl.load(v_base, mask=kv_mask, other=0.0), mask=kv_mask)
    tl.store(vc_base + HALF, tl.load(v_base + HALF, mask=kv_mask, other=0.0), mask=kv_mask)


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] float32, with optional "llama3" scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (supported: llama3, default)")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are slowed by `factor`; short ones are kept; the band
    # in between is interpolated smoothly between the two.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


def rope_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    scaling: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[max_position, head_dim] float32: cos(p * inv_freq) in [:, :D/2], sin in [:, D/2:]."""
    if head_dim % 2 != 0:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.arange(max_position, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_kv_write_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Plain-torch reference: writes k_cache/v_cache in place, returns rotated q (float32 math)."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q_out = _rotate(q.float(), cos, sin).to(q.dtype)
    k_rot = _rotate(k.float(), cos, sin).to(k_cache.dtype)
    block_size = k_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache[slots // block_size, slots % block_size] = k_rot[valid]
    v_cache[slots // block_size, slots % block_size] = v[valid].to(v_cache.dtype)
    return q_out


def rotary_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Rotate q [T, Hq, D] and k [T, Hkv, D]; write rotated k and v into the paged caches at
    `slot_mapping` [T] (negative = skip); return rotated q (a new tensor, or `q_out`, which may
    be q itself). q/k/v may be strided views of a fused qkv projection (unit last stride)."""
    config, strides, num_kv_heads, constexprs = _PLANS.plan(
        _plan, (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out), config)
    T, num_q_heads, head_dim = q.shape
    if q_out is None:
        q_out = torch.empty((T, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if T == 0:
        return q_out
    _rope_kv_write_kernel[(T,)](
        q, k, v, positions, cos_sin_cache, slot_mapping, q_out, k_cache, v_cache,
        *strides,
        num_q_heads, num_kv_heads, k_cache.shape[1],
        **constexprs, **pdl_options(q.device, "rotary"),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return q_out


# (argument metadata, config) -> (config, strides, num_kv_heads, constexpr kwargs), see checks.LaunchPlans.
_PLANS = LaunchPlans()


def _plan(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, config):
    """All argument checks of rotary_kv_write, and what the launch derives from the shapes."""
    op = "rotary_kv_write"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, q)
    T, num_q_heads, head_dim = q.shape
    device = q.device
    if head_dim % 2 != 0:
        raise ValueError(f"{op}: head_dim must be even for rotate-half, got {head_dim}")
    check_tensor(op, "k", k, shape=(T, None, head_dim), device=device)
    num_kv_heads = k.shape[1]
    check_tensor(op, "v", v, shape=(T, num_kv_heads, head_dim), device=device)
    check_same_dtype(op, "q", q, k=k, v=v)
    check_tensor(op, "positions", positions, shape=(T,), dtypes=(torch.int32, torch.int64), device=device)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, shape=(None, head_dim), dtypes=(torch.float32,), device=device)
    check_tensor(op, "k_cache", k_cache, shape=(None, None, num_kv_heads, head_dim), device=device)
    check_tensor(op, "v_cache", v_cache, shape=tuple(k_cache.shape), device=device)
    check_same_dtype(op, "q", q, k_cache=k_cache, v_cache=v_cache)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(T,), dtypes=(torch.int64, torch.int32), device=device)
    if q_out is not None:
        check_tensor(op, "q_out", q_out, shape=(T, num_q_heads, head_dim), device=device)
        check_same_dtype(op, "q", q, q_out=q_out)
    if config is None:
        problem = {"tokens": T, "q_heads": num_q_heads, "kv_heads": num_kv_heads, "head_dim": head_dim,
                   "dtype": dtype_name(q.dtype)}
        config = ROTARY_SPEC.default_config(problem, device)
    half = head_dim // 2
    constexprs = {"HALF": half, "BLOCK_HALF": next_power_of_2(half), "BLOCK_HQ": next_power_of_2(num_q_heads),
                  "BLOCK_HKV": next_power_of_2(num_kv_heads)}
    # The launcher allocates a missing q_out contiguous: [T, Hq, D] strides (Hq * D, D).
    q_out_strides = q_out.stride() if q_out is not None else (num_q_heads * head_dim, head_dim)
    # The kernel's stride arguments, in its order (q, k, v, q_out, cos_sin, k_cache, v_cache).
    strides = (*q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *q_out_strides[:2], cos_sin_cache.stride(0),
               *k_cache.stride()[:3], *v_cache.stride()[:3])
    return config, strides, num_kv_heads, constexprs


def _choose_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("token", num_warps=4, num_stages=1)
    elements = int(problem["q_heads"]) * int(problem["head_dim"])
    return KernelConfig.make("token", num_warps=2 if elements <= 1024 else 4 if elements <= 4096 else 8, num_stages=1)


ROTARY_SPEC = register(
    KernelSpec(
        op="rotary_kv_write",
        module=__name__,
        launcher=rotary_kv_write,
        reference=rotary_kv_write_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace("token", {"num_warps": (1, 2, 4, 8), "num_stages": (1,)},
                             "one program per token: all q heads, all kv heads"),
            ),
        ),
        choose_default=_choose_default,
        problem_keys=("tokens", "q_heads", "kv_heads", "head_dim", "dtype"),
        doc=__doc__ or "",
    )
)
