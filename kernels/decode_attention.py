"""Paged decode attention with grouped-query heads and split-K (flash-decoding).

Math, for each sequence b and query head h (kv head g = h // (Hq / Hkv)), over the
n = context_lens[b] cached tokens j:
    s_j   = scale * <q[b, h], K_j>
    out   = sum_j softmax(s)_j * V_j
with K_j, V_j = k_cache/v_cache[block_tables[b, j // bs], j % bs, g]. A sequence with
context length 0 (a padding row of a CUDA-graph batch) gets a zero output.

Data flow (two passes):
  pass 1, grid (B, Hkv, NUM_SPLITS): each program takes every query head of one kv group
    (GQA: K/V are read once for the whole group) and one contiguous slice of the context,
    runs an online softmax over BLOCK_N-token tiles gathered through the block table, and
    writes its normalised partial output [B, Hq, S, D] and log2-sum-exp [B, Hq, S] (float32).
  pass 2 (merge_group), per (sequence, kv head): merges each query head's S partials with
    weights 2^(lse_s - max lse). With MERGE_LAST (the default) it runs in pass 1's program that
    finishes its group last (an atomic count per (sequence, kv head) says which; that program
    resets the count), so there is no second launch; otherwise it is a launch of its own,
    grid (B, Hkv).
With NUM_SPLITS == 1, pass 1 writes the final output directly and pass 2 is skipped.
decode_attention_rope (FUSE_ROPE) takes q and the step's new key and value un-rotated: each
program rotates q (and the new key) itself, reads only the tokens before the new one from the
cache, and the program whose slice ends at the new token starts its softmax from that token
(held in registers) and writes the rotated key and the value to the cache for later steps.
That replaces kernels.rotary's launch in front of every decode attention.
All grid sizes come from static shapes (B, Hkv, NUM_SPLITS), never from context_lens values,
so the launcher can be captured in a CUDA graph; the split boundaries are computed on the
device from context_lens.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, LaunchPlans, StreamCounters, check_runnable_device, check_same_dtype, check_tensor,
                     dot_flags, dtype_name, interpreter_active, next_power_of_2, pdl_options)
from shapeshift.kernels.triton_helpers import STAMP_SLOTS, clock_stamp, dot, grid_dependency_sync, prefetch_share_l2
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register

LOG2E = 1.4426950408889634


@triton.jit
def _decode_attention_split_kernel(
    q_ptr,  # [B, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D] (written when NUM_SPLITS == 1)
    partial_out_ptr,  # [B, Hq, NUM_SPLITS, D] float32
    partial_lse_ptr,  # [B, Hq, NUM_SPLITS] float32 (log2 domain)
    scale_log2,  # softmax scale * log2(e)
    stride_q_b, stride_q_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt_b,
    stride_o_b, stride_o_h,
    block_size,
    num_q_heads,
    QUERY_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    # Rotary + KV write fused in (decode_attention_rope): q and the new token's k, v arrive
    # un-rotated; the last token of the context is the new one and is taken from registers.
    FUSE_ROPE: tl.constexpr = False,
    k_new_ptr=None,  # [B, Hkv, D]
    v_new_ptr=None,  # [B, Hkv, D]
    positions_ptr=None,  # [B] int
    cos_sin_ptr=None,  # [max_position, D] float32: cos | sin
    slot_mapping_ptr=None,  # [B] int64
    stride_kn_b=0, stride_kn_h=0, stride_vn_b=0, stride_vn_h=0, stride_cs=0,
    HALF: tl.constexpr = 1,
    # L2 prefetch of weights the next kernels read (l2_prefetch): attention leaves HBM idle.
    PREFETCH: tl.constexpr = False,
    pf_ptr0=None, pf_lines0=0, pf_ptr1=None, pf_lines1=0,
    PF_LINE: tl.constexpr = 64,
    # The last split of each (sequence, kv head) to finish merges the group's partials itself
    # (no pass-2 launch): counter_ptr [B * Hkv] int32, zero before the launch and after it.
    MERGE_LAST: tl.constexpr = False,
    counter_ptr=None,
    BLOCK_S: tl.constexpr = 2,
    # Clock stamps (decode_attention's timestamps; CUDA only): per program (b, kv head, split),
    # row-major, the kernel's start, its split's partial stored, and its end (after the merge).
    TIMING: tl.constexpr = False,
    stamps_ptr=None,
):
    # This program's index in the (b, kv head, split) grid, row-major: its stamp row and its share
    # of the L2 prefetch.
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)
    clock_stamp(stamps_ptr, pid, 0, TIMING)
    grid_dependency_sync(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PREFETCH:
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        prefetch_share_l2(pf_ptr0, pf_lines0, pid, programs, PF_LINE, 256)
        prefetch_share_l2(pf_ptr1, pf_lines1, pid, programs, PF_LINE, 256)
    attend_split(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partial_out_ptr,
                 partial_lse_ptr, scale_log2, b, kv_head, split,
                 stride_q_b, stride_q_h, stride_k_block, stride_k_slot, stride_k_head,
                 stride_v_block, stride_v_slot, stride_v_head, stride_bt_b, stride_o_b, stride_o_h,
                 block_size, num_q_heads, QUERY_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_SPLITS,
                 USE_DOT, UPCAST_DOT, DOT_PRECISION, FUSE_ROPE, k_new_ptr, v_new_ptr, positions_ptr, cos_sin_ptr,
                 slot_mapping_ptr, stride_kn_b, stride_kn_h, stride_vn_b, stride_vn_h, stride_cs, HALF)
    clock_stamp(stamps_ptr, pid, 1, TIMING)
    if MERGE_LAST:
        merge_if_last(counter_ptr + b * tl.num_programs(1) + kv_head, partial_out_ptr, partial_lse_ptr, out_ptr, b,
                      kv_head, stride_o_b, stride_o_h, num_q_heads, QUERY_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D,
                      NUM_SPLITS, BLOCK_S)
    clock_stamp(stamps_ptr, pid, 2, TIMING)


@triton.jit
def merge_if_last(counter, partial_out_ptr, partial_lse_ptr, out_ptr, b, kv_head, stride_o_b, stride_o_h,
                  num_q_heads, QUERY_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """After a split's partial is stored: count it on the group's counter (int32, zero before),
    and if it is the group's last, merge the group (merge_group) and zero the counter again.
    Every thread's partial stores are issued before the release; the acquire side of the last
    arrival's add makes the other splits' partials visible to its loads (through L2). Shared by
    the split kernel (MERGE_LAST) and the layer-tail kernel's attention of the next layer."""
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
        tl.debug_barrier()  # no thread loads a partial before the acquire is done
        merge_group(partial_out_ptr, partial_lse_ptr, out_ptr, b, kv_head, stride_o_b, stride_o_h, num_q_heads,
                    QUERY_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S)
        tl.store(counter, 0)  # every split has arrived: nobody else touches it in this launch


@triton.jit
def attend_split(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partial_out_ptr,
                 partial_lse_ptr, scale_log2, b, kv_head, split,
                 stride_q_b, stride_q_h, stride_k_block, stride_k_slot, stride_k_head,
                 stride_v_block, stride_v_slot, stride_v_head, stride_bt_b, stride_o_b, stride_o_h,
                 block_size, num_q_heads, QUERY_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSE_ROPE: tl.constexpr, k_new_ptr,
                 v_new_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr, stride_kn_b, stride_kn_h, stride_vn_b,
                 stride_vn_h, stride_cs, HALF: tl.constexpr):
    """Pass 1 for one (sequence b, kv head, split): every query head of the kv group over one
    slice of the context (see the module doc). Shared by the split kernel and the batch-1 layer
    kernel (kernels/decode_layer_tail.py), which runs it as its attention phase."""
    # The block-table entries of tile `split`, loaded before the context length arrives: when
    # every split holds at most one tile (the default split counts), that is the split's tile,
    # and its K/V loads wait for one round trip (context length and table together), not two.
    # Entries past the row (stride_bt_b; 0: no speculation) are not read.
    spec_tok = split * BLOCK_N + tl.arange(0, BLOCK_N)
    spec_block = tl.load(block_tables_ptr + b * stride_bt_b + spec_tok // block_size,
                         mask=spec_tok // block_size < stride_bt_b, other=0).to(tl.int64)
    context_len = tl.load(context_lens_ptr + b)
    # Split the context into NUM_SPLITS slices of whole BLOCK_N tiles (computed on the device).
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, context_len)

    g = tl.arange(0, BLOCK_G)
    g_mask = g < QUERY_GROUP
    q_head = kv_head * QUERY_GROUP + g  # [BLOCK_G]
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_q_b + q_head[:, None] * stride_q_h + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cached_end = end
    if FUSE_ROPE:
        # rope(x)[d] = x[d] cos[d % H] + sign(d) x[(d + H) % D] sin[d % H], sign = -1 below H: the
        # rotate-half form of kernels/rotary.py in the [.., D] layout, rounded once to x's dtype.
        position = tl.load(positions_ptr + b).to(tl.int64)
        half_d = tl.where(d < HALF, d, d - HALF)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        cos = tl.load(cos_sin_ptr + position * stride_cs + half_d, mask=d_mask, other=0.0)  # [BLOCK_D]
        sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + half_d, mask=d_mask, other=0.0)
        sin = tl.where(d < HALF, -sin, sin)
        q_partner = tl.load(q_ptr + b * stride_q_b + q_head[:, None] * stride_q_h + partner[None, :],
                            mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        q = (q.to(tl.float32) * cos[None, :] + q_partner.to(tl.float32) * sin[None, :]).to(q.dtype)
        kn_row = k_new_ptr + b * stride_kn_b + kv_head * stride_kn_h
        k_new = tl.load(kn_row + d, mask=d_mask, other=0.0).to(tl.float32)
        k_partner = tl.load(kn_row + partner, mask=d_mask, other=0.0).to(tl.float32)
        k_new = (k_new * cos + k_partner * sin).to(k_cache_ptr.dtype.element_ty)  # [BLOCK_D]
        v_new = tl.load(v_new_ptr + b * stride_vn_b + kv_head * stride_vn_h + d, mask=d_mask, other=0.0)
        # The new token (position context_len - 1) belongs to the last non-empty split: that
        # program writes its key and value to the cache for later steps and starts its softmax
        # from it; every program reads only the tokens before it from the cache.
        cached_end = tl.minimum(end, context_len - 1)
        if (end == context_len) & (start < end):
            slot = tl.load(slot_mapping_ptr + b).to(tl.int64)
            write = d_mask & (slot >= 0)
            slot = tl.maximum(slot, 0)
            tl.store(k_cache_ptr + (slot // block_size) * stride_k_block + (slot % block_size) * stride_k_slot
                     + kv_head * stride_k_head + d, k_new, mask=write)
            tl.store(v_cache_ptr + (slot // block_size) * stride_v_block + (slot % block_size) * stride_v_slot
                     + kv_head * stride_v_head + d, v_new.to(v_cache_ptr.dtype.element_ty), mask=write)
            score = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2  # [BLOCK_G]
            m_i = tl.where(g_mask, score, 0.0)
            l_i = tl.full([BLOCK_G], 1.0, tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32) + v_new.to(tl.float32)[None, :]
    if not USE_DOT:
        q = q.to(tl.float32)

    speculated = (tiles_per_split == 1) & (end <= stride_bt_b * block_size)  # the one tile, inside the row
    for tile_start in range(start, end, BLOCK_N):
        tok = tile_start + tl.arange(0, BLOCK_N)
        tok_mask = tok < cached_end
        if speculated:
            block_id = spec_block
        else:
            block_id = tl.load(block_tables_ptr + b * stride_bt_b + tok // block_size, mask=tok_mask,
                               other=0).to(tl.int64)
        slot = tok % block_size
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + block_id[:, None] * stride_k_block + slot[:, None] * stride_k_slot
                    + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + block_id[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                    + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:
            scores = dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        else:
            scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(tok_mask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    has_tokens = l_i > 0.0
    out = tl.where(has_tokens[:, None], acc / tl.where(has_tokens, l_i, 1.0)[:, None], 0.0)
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_o_b + q_head[:, None] * stride_o_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (b * num_q_heads + q_head) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=out_mask)
        lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def merge_group(partial_out_ptr, partial_lse_ptr, out_ptr, b, kv_head, stride_o_b, stride_o_h, num_q_heads,
                QUERY_GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Pass 2 for one (sequence b, kv head): each query head of the group's NUM_SPLITS partials
    merged with weights 2^(lse_s - max lse). Empty splits carry lse = -inf (weight 0); a row
    whose splits are all empty (context 0) gets zeros. The partials were written by other
    programs, so they are read through L2."""
    g = tl.arange(0, BLOCK_G)
    g_mask = g < QUERY_GROUP
    rows = (b * num_q_heads + kv_head * QUERY_GROUP + g) * NUM_SPLITS  # [BLOCK_G]: split 0 of each head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    lse = tl.load(partial_lse_ptr + rows[:, None] + s[None, :], mask=g_mask[:, None] & (s < NUM_SPLITS)[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [BLOCK_G, BLOCK_S]
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    denom = tl.sum(tl.exp2(lse - top[:, None]), axis=1)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for split in tl.static_range(NUM_SPLITS):  # unrolled: every split's loads issue up front
        weight = tl.exp2(tl.load(partial_lse_ptr + rows + split, mask=g_mask, other=float("-inf"),
                                 cache_modifier=".cg") - top)
        part = tl.load(partial_out_ptr + (rows + split)[:, None] * HEAD_DIM + d[None, :],
                       mask=g_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        acc += part * weight[:, None]
    merged = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    q_head = kv_head * QUERY_GROUP + g
    tl.store(out_ptr + b * stride_o_b + q_head[:, None] * stride_o_h + d[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_attention_reduce_kernel(
    partial_out_ptr,  # [B, Hq, NUM_SPLITS, D] float32
    partial_lse_ptr,  # [B, Hq, NUM_SPLITS] float32
    out_ptr,  # [B, Hq, D]
    stride_o_b, stride_o_h,
    num_q_heads,
    QUERY_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Pass 2 as a launch of its own, grid (B, Hkv)."""
    grid_dependency_sync(USE_PDL)
    merge_group(partial_out_ptr, partial_lse_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1),
                stride_o_b, stride_o_h, num_q_heads, QUERY_GROUP, BLOCK_G, HEAD_DIM, BLOCK_D, NUM_SPLITS, BLOCK_S)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference: gathers each sequence's K/V and runs softmax attention in float32."""
    B, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(B, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(B):
        n = int(context_lens[b])
        if n == 0:
            continue
        tok = torch.arange(n, device=q.device)
        blocks = block_tables[b, tok // block_size].long()
        k = k_cache[blocks, tok % block_size].float()  # [n, Hkv, D]
        v = v_cache[blocks, tok % block_size].float()
        k = k.repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out.to(q.dtype)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    l2_prefetch: tuple[tuple[torch.Tensor, int], ...] = (),
    timestamps: torch.Tensor | None = None,
    _rope: dict | None = None,
) -> torch.Tensor:
    """Decode attention for q [B, Hq, D] over paged caches [num_blocks, block_size, Hkv, D].

    block_tables [B, max_blocks] int32, context_lens [B] int32 (tokens in the cache, including
    the one just written). Returns out [B, Hq, D] (or writes `out`). No host syncs.
    `l2_prefetch`: up to two (contiguous tensor, bytes) regions the kernel's programs ask to be
    brought into L2 while they work, e.g. the weights of the projections that follow: at decode
    batch sizes attention reads little and leaves HBM idle. CUDA only (ignored elsewhere).
    ``timestamps`` (CUDA, int64 [>= B * Hkv * splits, STAMP_SLOTS], zeros): each program (b, kv
    head, split; row-major) writes the GPU clock at its start, once its split's partial is stored
    and at its end (after the merge), in ns (slots 0-2; its SM in SM_SLOT): the benchmark's view.
    """
    config, strides, num_kv_heads, block_size, num_splits, constexprs, reduce_constexprs, merge_last = _PLANS.plan(
        attention_plan, (q, k_cache, v_cache, block_tables, context_lens, out), config)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    B, num_q_heads, head_dim = q.shape
    if B == 0:
        return out
    merge = {}
    if num_splits > 1:
        partial_out = torch.empty((B, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        partial_lse = torch.empty((B, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
        if merge_last:
            counters = _MERGE_COUNTERS.for_stream(q.device, MERGE_COUNTERS)
            if counters is not None:  # None: a graph captured on a stream that has none yet
                merge = {**merge_last, "counter_ptr": counters}
    else:
        partial_out = partial_lse = out  # unused by the kernel when NUM_SPLITS == 1
    timing = {}
    if timestamps is not None:
        if not q.is_cuda or interpreter_active():
            raise ValueError("decode_attention: timestamps read the GPU clock (%globaltimer): CUDA only, "
                             "not the interpreter")
        check_tensor("decode_attention", "timestamps", timestamps, shape=(None, STAMP_SLOTS), dtypes=(torch.int64,),
                     device=q.device, contiguous=True)
        if timestamps.shape[0] < B * num_kv_heads * num_splits:
            raise ValueError(f"decode_attention: timestamps needs a row for each of the {B * num_kv_heads * num_splits} "
                             f"programs, got {timestamps.shape[0]}")
        timing = {"TIMING": True, "stamps_ptr": timestamps}
    _decode_attention_split_kernel[(B, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_out, partial_lse,
        float(scale) * LOG2E,
        *strides,
        block_size, num_q_heads,
        **constexprs, **pdl_options(q.device, "attention"), **(_rope or {}), **_prefetch_args(q, l2_prefetch),
        **merge, **timing, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if num_splits > 1 and not merge:
        _decode_attention_reduce_kernel[(B, num_kv_heads)](
            partial_out, partial_lse, out, *strides[-2:], num_q_heads, **reduce_constexprs,
            **pdl_options(q.device, "attention"),
        )
    return out


# Merge counters (MERGE_LAST), one per (sequence, kv head), allocated once at this size per
# stream and never grown: a CUDA graph keeps the address it captured. Batches with more
# (sequence, kv head) pairs launch pass 2 instead.
MERGE_COUNTERS = 1 << 16
_MERGE_COUNTERS = StreamCounters(MERGE_COUNTERS)


def _prefetch_allowed(q: torch.Tensor) -> bool:
    return q.is_cuda and not interpreter_active()


def _prefetch_args(q: torch.Tensor, regions) -> dict:
    """Kernel arguments for l2_prefetch: whole 128-byte lines of up to two regions (CUDA only:
    PTX prefetches; the interpreter cannot run them)."""
    if not regions or not _prefetch_allowed(q):
        return {}
    if len(regions) > 2:
        raise ValueError(f"decode_attention: l2_prefetch takes at most 2 regions, got {len(regions)}")
    args: dict = {"PREFETCH": True}
    line_elements = None
    for i, (tensor, max_bytes) in enumerate(list(regions) + [regions[0]] * (2 - len(regions))):
        if not tensor.is_contiguous() or tensor.device != q.device:
            raise ValueError("decode_attention: l2_prefetch regions must be contiguous tensors on q's device")
        element = tensor.element_size()
        if line_elements not in (None, 128 // element):
            raise ValueError("decode_attention: l2_prefetch regions must share one element size")
        line_elements = 128 // element
        lines = min(tensor.numel() * element, int(max_bytes)) // 128 if i < len(regions) else 0
        args[f"pf_ptr{i}"], args[f"pf_lines{i}"] = tensor, lines
    args["PF_LINE"] = line_elements
    return args


def decode_attention_rope_ref(q, k_new, v_new, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                              block_tables, context_lens, scale):
    """Plain-torch reference of decode_attention_rope: kernels.rotary's reference (writes the
    caches), then decode_attention_ref."""
    from shapeshift.kernels.rotary import rotary_kv_write_ref

    q_rot = rotary_kv_write_ref(q, k_new, v_new, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    return decode_attention_ref(q_rot, k_cache, v_cache, block_tables, context_lens, scale)


def decode_attention_rope(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
    l2_prefetch: tuple[tuple[torch.Tensor, int], ...] = (),
    timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding, the paged KV write and decode attention in one pass (one launch fewer
    per layer than kernels.rotary.rotary_kv_write followed by decode_attention).

    q [B, Hq, D], k_new / v_new [B, Hkv, D]: the step's un-rotated projections (strided views of
    a fused qkv output are fine); positions [B]; cos_sin_cache [max_position, D] float32 (see
    kernels.rotary.rope_cos_sin_cache); slot_mapping [B] (negative: no cache write). The new
    token is the last of each sequence's context_lens (which count it). Writes the rotated key
    and the value to the caches and returns out [B, Hq, D]. ``timestamps`` as decode_attention's.
    """
    shape_args = _ROPE_PLANS.plan(rope_plan, (q, k_new, v_new, positions, cos_sin_cache, slot_mapping, k_cache),
                                  None)
    rope = {"FUSE_ROPE": True, "k_new_ptr": k_new, "v_new_ptr": v_new, "positions_ptr": positions,
            "cos_sin_ptr": cos_sin_cache, "slot_mapping_ptr": slot_mapping, **shape_args}
    return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out, config=config,
                            l2_prefetch=l2_prefetch, timestamps=timestamps, _rope=rope)


# (argument metadata) -> the rotary arguments' checks passed and their strides (see rope_plan).
_ROPE_PLANS = LaunchPlans()


def rope_plan(q, k_new, v_new, positions, cos_sin_cache, slot_mapping, k_cache, _config) -> dict:
    """The checks decode_attention_rope adds to decode_attention's, and the kernel's stride and
    HALF arguments they imply (memoised per argument metadata, like decode_attention's plan)."""
    op = "decode_attention_rope"
    B, num_q_heads, head_dim = q.shape if q.dim() == 3 else (None, None, None)
    if head_dim is not None and head_dim % 2:
        raise ValueError(f"{op}: head_dim must be even for rotate-half, got {head_dim}")
    num_kv_heads = k_cache.shape[2] if k_cache.dim() == 4 else None
    check_tensor(op, "k_new", k_new, shape=(B, num_kv_heads, head_dim), device=q.device)
    check_tensor(op, "v_new", v_new, shape=(B, num_kv_heads, head_dim), device=q.device)
    check_same_dtype(op, "q", q, k_new=k_new, v_new=v_new)
    check_tensor(op, "positions", positions, shape=(B,), dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, shape=(None, head_dim), dtypes=(torch.float32,),
                 device=q.device)
    check_tensor(op, "slot_mapping", slot_mapping, shape=(B,), dtypes=(torch.int32, torch.int64), device=q.device)
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new), ("cos_sin_cache", cos_sin_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} needs a unit last stride, got strides {tuple(t.stride())}")
    return {"stride_kn_b": k_new.stride(0), "stride_kn_h": k_new.stride(1), "stride_vn_b": v_new.stride(0),
            "stride_vn_h": v_new.stride(1), "stride_cs": cos_sin_cache.stride(0), "HALF": head_dim // 2}


# (argument metadata, config) -> launch plan (see attention_plan), see checks.LaunchPlans.
_PLANS = LaunchPlans()


def attention_plan(q, k_cache, v_cache, block_tables, context_lens, out, config):
    """All argument checks of decode_attention, the config, and the constexprs they imply."""
    op = "decode_attention"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, q)
    B, num_q_heads, head_dim = q.shape
    device = q.device
    check_tensor(op, "k_cache", k_cache, shape=(None, None, None, head_dim), device=device)
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    check_tensor(op, "v_cache", v_cache, shape=tuple(k_cache.shape), device=device)
    check_same_dtype(op, "q", q, k_cache=k_cache, v_cache=v_cache)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    check_tensor(op, "block_tables", block_tables, shape=(B, None), dtypes=(torch.int32,), device=device)
    check_tensor(op, "context_lens", context_lens, shape=(B,), dtypes=(torch.int32,), device=device)
    if out is not None:
        check_tensor(op, "out", out, shape=(B, num_q_heads, head_dim), device=device)
        check_same_dtype(op, "q", q, out=out)
    max_context = block_tables.shape[1] * block_size
    if config is None:
        problem = {"batch": B, "q_heads": num_q_heads, "kv_heads": num_kv_heads, "head_dim": head_dim,
                   "max_context": max_context, "block_size": block_size, "dtype": dtype_name(q.dtype)}
        config = DECODE_ATTENTION_SPEC.default_config(problem, device)
    group = num_q_heads // num_kv_heads
    use_dot = config.variant == "dot"
    block_g = max(16, next_power_of_2(group)) if use_dot else next_power_of_2(group)
    block_d = max(16, next_power_of_2(head_dim))
    num_splits = config["NUM_SPLITS"]
    upcast_dot, dot_precision = dot_flags(q.dtype)
    constexprs = {"QUERY_GROUP": group, "BLOCK_G": block_g, "HEAD_DIM": head_dim, "BLOCK_D": block_d,
                  "BLOCK_N": config["BLOCK_N"], "NUM_SPLITS": num_splits, "USE_DOT": use_dot,
                  "UPCAST_DOT": upcast_dot, "DOT_PRECISION": dot_precision}
    reduce_constexprs = {"QUERY_GROUP": group, "BLOCK_G": next_power_of_2(group), "HEAD_DIM": head_dim,
                         "BLOCK_D": block_d, "NUM_SPLITS": num_splits, "BLOCK_S": max(2, next_power_of_2(num_splits)),
                         "num_warps": 2 if head_dim <= 64 else 4}
    # Pass 2 in the last split's program (the split kernel's constexprs for it), where the
    # counters hold every (sequence, kv head) pair.
    merge_last = ({"MERGE_LAST": True, "BLOCK_S": reduce_constexprs["BLOCK_S"]}
                  if num_splits > 1 and config.get("MERGE_LAST", 0) and B * num_kv_heads <= MERGE_COUNTERS else {})
    # The launcher allocates a missing out contiguous: [B, Hq, D] strides (Hq * D, D).
    out_strides = out.stride() if out is not None else (num_q_heads * head_dim, head_dim)
    # The split kernel's stride arguments, in its order (q, k_cache, v_cache, block_tables, out);
    # the reduce kernel takes the last two (out's).
    strides = (*q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
               *out_strides[:2])
    return config, strides, num_kv_heads, block_size, num_splits, constexprs, reduce_constexprs, merge_last


def _choose_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("dot", num_warps=4, num_stages=1, BLOCK_N=16, NUM_SPLITS=2, MERGE_LAST=1)
    batch, kv_heads = int(problem["batch"]), int(problem["kv_heads"])
    max_context = int(problem["max_context"])
    head_dim = int(problem["head_dim"])
    block_n = 64 if head_dim <= 128 else 32
    if head_dim <= 64 and max_context >= 16384:
        block_n = 128  # long contexts: fewer, larger tiles (H200 tuning: 30.2 vs 36.6 us at B=1, 32K)
    # Enough (sequence, kv head, split) programs to cover every SM about twice (rounded up),
    # down to one tile per split. Measured on an H200 (bench_kernels --tune): at batch 1 in a
    # 512-token graph width, 8 one-tile splits take 4.8 us against 7.0 us for 2 four-tile ones
    # (the merge pass is cheaper than idle SMs); at B=32 x 2048 tokens, 2 splits 44 vs 63 us for 1.
    # Splits of one tile each where the context is short: with the merge in the last split's
    # program (MERGE_LAST) the empty splits that rounding up leaves cost little; at batch 1 in a
    # 400-token width (6 tiles), 8 one-tile splits gave 1,142 against 1,132 tok/s end to end for
    # 4 two-tile ones (H200, fast recipe, 6 runs each alternating).
    sms = 132 if key == "sm90" else 108
    want = max(1, -(-(2 * sms) // max(1, batch * kv_heads)))
    by_length = max(1, max_context // block_n)
    splits = min(1 << (min(want, 32).bit_length() - 1), next_power_of_2(by_length))
    return KernelConfig.make("dot", num_warps=4, num_stages=3 if key == "sm90" else 2, BLOCK_N=block_n,
                             NUM_SPLITS=splits, MERGE_LAST=int(MERGE_LAST_DEFAULT and splits > 1))


# Pass 2 in the last split's program instead of a launch of its own (MERGE_LAST), by default;
# SHAPESHIFT_DECODE_ATTENTION_MERGE=0 keeps the launch (for measuring one against the other).
MERGE_LAST_DEFAULT = os.environ.get("SHAPESHIFT_DECODE_ATTENTION_MERGE", "1") != "0"


def _constraint(config: KernelConfig, problem) -> bool:
    if config.get("MERGE_LAST", 0) and config["NUM_SPLITS"] == 1:
        return False  # nothing to merge: the same kernel as MERGE_LAST 0
    # Splits beyond the tiles of the longest context, rounded up to a power of two, only add
    # empty programs.
    if config["NUM_SPLITS"] > next_power_of_2(max(1, int(problem["max_context"]) // config["BLOCK_N"])):
        return False
    if config.variant == "fma":
        # The broadcast product [group, BLOCK_N, D] lives in registers: keep it to <= 64 values
        # per thread (ptxas spills beyond that; seen at 4 x 64 x 64 with 4 warps).
        group = next_power_of_2(int(problem["q_heads"]) // int(problem["kv_heads"]))
        elements = group * config["BLOCK_N"] * next_power_of_2(int(problem["head_dim"]))
        return elements <= 64 * 32 * config.num_warps
    return True


_AXES = {"BLOCK_N": (16, 32, 64, 128), "NUM_SPLITS": (1, 2, 4, 8, 16, 32), "MERGE_LAST": (0, 1),
         "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4)}

DECODE_ATTENTION_SPEC = register(
    KernelSpec(
        op="decode_attention",
        module=__name__,
        launcher=decode_attention,
        reference=decode_attention_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace("dot", _AXES, "tensor-core dots; query group padded to 16 rows"),
                VariantSpace("fma", _AXES, "broadcast multiply-reduce on CUDA cores (small groups)"),
            ),
            constraint=_constraint,
        ),
        choose_default=_choose_default,
        problem_keys=("batch", "q_heads", "kv_heads", "head_dim", "max_context", "block_size", "dtype"),
        doc=__doc__ or "",
    )
)
