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
    (a bottom-right aligned causal mask). Eager only: loops over the sequences with several
    new tokens on the host; the sequences with one new token (the decodes of a mixed batch)
    attend together in one batched call, as a decode-only batch does (measured on a 2-core
    CPU: 1.3x to 1.8x goodput on chat and burst traffic against one call per sequence).
    """
    assert ctx.query_start_loc_cpu is not None and ctx.context_lens_cpu is not None, \
        "prefill attention needs the host copies of query_start_loc/context_lens"
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    qsl, lens = ctx.query_start_loc_cpu, ctx.context_lens_cpu
    decode_seqs = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] == 1]
    batched = len(decode_seqs) >= 2
    if batched:
        rows = torch.tensor([qsl[i] for i in decode_seqs], device=q.device)  # [Bd] token rows
        seqs = torch.tensor(decode_seqs, device=q.device)  # [Bd]
        out[rows] = paged_decode_attention(q[rows], k_cache, v_cache, ctx.block_tables[seqs],
                                           ctx.context_lens[seqs], scale)
    for i, context_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 0 or (batched and q_len == 1):
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


def paged_varlen_attention_static(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  ctx: AttentionContext, scale: float) -> torch.Tensor:
    """The math of paged_prefill_attention with no host values: CUDA-graph capturable.

    q: [T, Hq, D] -> [T, Hq, D]. Token t belongs to the sequence b whose query range
    query_start_loc[b] .. query_start_loc[b+1] holds it; it sees that sequence's keys 0 ..
    context_lens[b] - (query end - t), read through ``ctx.block_tables`` [B, W] (every key of
    the W blocks, masked). Tokens past query_start_loc[B] (a graph bucket's padding) belong
    to no sequence and come out as zeros. Dense in T x W * block_size: the reference and CPU
    form; on CUDA the runner's graphs use the Triton kernel (see varlen_attention_static).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    batch, blocks = ctx.block_tables.shape
    width = blocks * block_size
    qsl = ctx.query_start_loc.long()  # [B + 1]
    tokens = torch.arange(num_tokens, device=q.device)
    seq = torch.searchsorted(qsl[1:], tokens, right=True).clamp(max=batch - 1)  # [T]
    live = tokens < qsl[-1]  # [T]: padding belongs to no sequence
    # Position of token t: its sequence's first new position plus its offset in the chunk.
    first = ctx.context_lens.long()[seq] - (qsl[seq + 1] - qsl[seq])  # [T]
    pos = first + tokens - qsl[seq]  # [T]
    k = k_cache[ctx.block_tables.long()].view(batch, width, num_kv_heads, head_dim)  # [B, S, Hkv, D]
    v = v_cache[ctx.block_tables.long()].view(batch, width, num_kv_heads, head_dim)
    keys = torch.arange(width, device=q.device)
    visible = (keys[None, :] <= pos[:, None]) & live[:, None]  # [T, S]
    qg = q.view(num_tokens, num_kv_heads, group, head_dim).float()  # [T, Hkv, G, D]
    scores = torch.einsum("thgd,tshd->thgs", qg, k[seq].float()) * scale  # [T, Hkv, G, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(live[:, None, None, None], probs, torch.zeros((), device=q.device))  # no NaN rows
    out = torch.einsum("thgs,tshd->thgd", probs, v[seq].float())  # [T, Hkv, G, D]
    return out.reshape(num_tokens, num_heads, head_dim).to(q.dtype)


def varlen_attention_static(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            ctx: AttentionContext, scale: float) -> torch.Tensor:
    """A graph-replayed mixed step's attention: q [T, Hq, D] -> [T, Hq, D].

    On CUDA, kernels.prefill_attention with ``ctx.max_query_len`` as the grid's bound (the
    graph's token bucket, fixed at capture; programs past a sequence's chunk exit at once), so
    the launch's shape never depends on the batch; elsewhere paged_varlen_attention_static."""
    if q.is_cuda:
        try:
            from shapeshift.kernels.prefill_attention import prefill_attention
        except ImportError:  # no Triton: the dense form is capturable too
            pass
        else:
            out = prefill_attention(q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc, ctx.context_lens,
                                    scale, ctx.max_query_len)
            # Padding tokens belong to no sequence: the kernel leaves their rows unwritten.
            return out
    return paged_varlen_attention_static(q, k_cache, v_cache, ctx, scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: AttentionContext,
                    scale: float, attn_bias: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; dispatches on ``ctx.is_prefill`` and, for prefill and
    mixed steps, on whether the context has host copies (eager) or not (graph-replayed)."""
    if ctx.is_prefill:
        if ctx.query_start_loc_cpu is None:
            return varlen_attention_static(q, k_cache, v_cache, ctx, scale)
        return paged_prefill_attention(q, k_cache, v_cache, ctx, scale)
    return paged_decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, scale, attn_bias)
