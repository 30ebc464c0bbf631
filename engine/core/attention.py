"""Attention metadata and the plain-torch paged attention (the reference backend).

Data flow: the runner builds an ``AttentionContext`` per step from the scheduled batch;
the forward pass writes each layer's new K/V into the paged cache at
``ctx.slot_mapping`` (``write_kv``) and then attends over the cache through
``ctx.block_tables`` (``paged_attention``). Decode-only batches take a shape-static
path (a fixed number of blocks per sequence, masked by ``context_lens``) so CUDA graphs
can capture it; prefill and mixed batches loop over sequences in eager mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionContext:
    is_prefill: bool  # False only when every sequence has exactly one new token (decode)
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (width fixed per CUDA graph)
    context_lens: torch.Tensor  # [B] int32: tokens in cache after this step
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    max_query_len: int
    max_context_len: int
    last_token_indices: torch.Tensor  # [B] int64: row of each sequence's last new token
    # Host copies for the eager prefill loop (None under CUDA graphs, which never need them).
    query_start_loc_cpu: list[int] | None = None
    context_lens_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into the cache.

    k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks + 1, block_size, Hkv, D]; slot_mapping: [T].
    """
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def decode_attention_bias(context_lens: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [B, 1, 1, S]: 0 for the first context_lens[b] keys, -inf after.

    Built once per forward and shared by every layer (it depends only on the batch).
    """
    valid = torch.arange(width, device=context_lens.device)[None, :] < context_lens[:, None]  # [B, S]
    zero = torch.zeros((), dtype=dtype, device=context_lens.device)
    return torch.where(valid, zero, float("-inf")).to(dtype)[:, None, None, :]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           attn_bias: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence over its cached context; shape-static.

    q: [B, Hq, D]; block_tables: [B, W] (W fixed per graph); context_lens: [B] -> [B, Hq, D].
    Keys beyond context_lens (stale or other sequences' blocks) are masked out. The G
    query heads sharing a KV head are laid out as G "query positions" of that head, so
    one SDPA call covers grouped-query attention without repeating K/V.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * block_size
    if attn_bias is None:
        attn_bias = decode_attention_bias(context_lens, width, q.dtype)
    k = k_cache[block_tables].view(batch, width, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = v_cache[block_tables].view(batch, width, num_kv_heads, head_dim).transpose(1, 2)
    q4 = q.view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(q4, k, v, attn_mask=attn_bias, scale=scale)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            ctx: AttentionContext, scale: float) -> torch.Tensor:
    """Variable-length queries (chunked prefill and decodes mixed) over the paged cache.

    q: [T, Hq, D] -> [T, Hq, D]. Sequence i's queries are the last ``q_len`` of its
    ``context_len`` positions, so query j may see keys 0..context_len - q_len + j
    (a bottom-right aligned causal mask). Eager only: loops over sequences on the host.
    """
    assert ctx.query_start_loc_cpu is not None and ctx.context_lens_cpu is not None, \
        "prefill attention needs the host copies of query_start_loc/context_lens"
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    qsl, lens = ctx.query_start_loc_cpu, ctx.context_lens_cpu
    for i, context_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        num_blocks = math.ceil(context_len / block_size)
        blocks = ctx.block_tables[i, :num_blocks]
        k = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:context_len]  # [S, Hkv, D]
        v = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:context_len]
        qi = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        ki = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, S, D]
        vi = v.transpose(0, 1).unsqueeze(0)
        if q_len == context_len:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        elif q_len == 1:
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=scale, enable_gqa=True)
        else:
            offset = context_len - q_len
            rows = torch.arange(q_len, device=q.device)[:, None] + offset
            mask = torch.arange(context_len, device=q.device)[None, :] <= rows  # [L, S]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                    scale: float, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; dispatches on ``ctx.is_prefill``."""
    if ctx.is_prefill:
        return paged_prefill_attention(q, k_cache, v_cache, ctx, scale)
    return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, attn_bias)
