"""Chunked-prefill attention: variable-length query chunks attending to paged KV, causally.

Math: sequence b has L_b = query_start_loc[b+1] - query_start_loc[b] new tokens, the last L_b
of its n_b = context_lens[b] cached tokens (their K/V were already written to the cache by
`rotary_kv_write`). New token i sits at position p_i = n_b - L_b + i and, for query head h
(kv head h // (Hq / Hkv)):
    out[i, h] = sum_{j <= p_i} softmax_j(scale * <q[i, h], K_j>) V_j
with K_j, V_j = k_cache/v_cache[block_tables[b, j // bs], j % bs, kv_head]. This covers a
plain prefill (L_b = n_b), a later chunk of a long prompt, a prefix-cache hit (earlier
blocks already filled) and a decode token (L_b = 1) in one mixed batch.

Data flow: q [T, Hq, D] (rows grouped by sequence through query_start_loc [B+1]) -> grid
(cdiv(max_query_len, BLOCK_M), B, Hq); each program takes BLOCK_M query rows of one sequence
and head, walks KV tiles of BLOCK_N tokens up to its last row's position through the block
table with an online softmax (tensor-core dots, float32 accumulators) -> out [T, Hq, D].
The grid depends on max_query_len (a host integer the scheduler already knows), so this op is
for the eager prefill path, not for CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, cdiv, check_runnable_device, check_same_dtype, check_tensor, dot_flags, dtype_name,
                     next_power_of_2)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import dot

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [T, Hq, D]
    scale_log2,
    stride_q_t, stride_q_h,
    stride_k_block, stride_k_slot, stride_k_head,
    stride_v_block, stride_v_slot, stride_v_head,
    stride_bt_b,
    stride_o_t, stride_o_h,
    block_size,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,  # 1, or the query group padded to a power of two (PACK_GQA)
    PACK_GQA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        context_len = tl.load(context_lens_ptr + b)
        first_position = context_len - q_len
        # Rows of the score tile: BLOCK_M tokens x HEADS_PER_PROGRAM heads. With PACK_GQA the
        # heads of one kv group share each K/V tile (read once instead of once per head).
        r = tl.arange(0, BLOCK_M * HEADS_PER_PROGRAM)
        rows = m_tile * BLOCK_M + r // HEADS_PER_PROGRAM  # token index within the chunk
        if PACK_GQA:
            kv_head = tl.program_id(2)
            in_group = r % HEADS_PER_PROGRAM
            head = kv_head * QUERY_GROUP + in_group
            row_mask = (rows < q_len) & (in_group < QUERY_GROUP)
        else:
            head = tl.program_id(2) + r * 0
            kv_head = tl.program_id(2) // QUERY_GROUP
            row_mask = rows < q_len
        positions = first_position + rows  # [BLOCK_R]
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        token = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_D]

        m_i = tl.full([BLOCK_M * HEADS_PER_PROGRAM], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * HEADS_PER_PROGRAM], tl.float32)
        acc = tl.zeros([BLOCK_M * HEADS_PER_PROGRAM, BLOCK_D], tl.float32)
        # Causal: this tile's last valid row sees tokens up to its position (inclusive).
        kv_end = tl.minimum(context_len, first_position + tl.minimum((m_tile + 1) * BLOCK_M, q_len))
        for tile_start in range(0, kv_end, BLOCK_N):
            tok = tile_start + tl.arange(0, BLOCK_N)
            tok_mask = tok < kv_end
            block_id = tl.load(block_tables_ptr + b * stride_bt_b + tok // block_size, mask=tok_mask, other=0).to(tl.int64)
            slot = tok % block_size
            kv_mask = tok_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + block_id[:, None] * stride_k_block + slot[:, None] * stride_k_slot
                        + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_cache_ptr + block_id[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                        + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
            scores = dot(q, tl.trans(k), UPCAST_DOT, DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
            visible = (tok[None, :] <= positions[:, None]) & tok_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
            # Rows past the chunk's end (masked anyway) still see token 0, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, UPCAST_DOT, DOT_PRECISION)
            m_i = m_new
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch reference: per sequence, gather K/V, causal softmax attention in float32."""
    T, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(T, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(len(context_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        n, L = int(context_lens[b]), end - start
        if L == 0:
            continue
        tok = torch.arange(n, device=q.device)
        blocks = block_tables[b, tok // block_size].long()
        k = k_cache[blocks, tok % block_size].float().repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = v_cache[blocks, tok % block_size].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("lhd,nhd->hln", q[start:end].float(), k) * scale  # [Hq, L, n]
        positions = torch.arange(n - L, n, device=q.device)
        scores = scores.masked_fill(tok[None, None, :] > positions[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hln,nhd->lhd", scores.softmax(-1), v)
    return out.to(q.dtype)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    *,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens q [T, Hq, D] over paged caches; see module doc.

    query_start_loc [B+1] int32, context_lens [B] int32, block_tables [B, max_blocks] int32,
    max_query_len: a host int >= every sequence's query length (sizes the grid).
    """
    op = "prefill_attention"
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, q)
    T, num_q_heads, head_dim = q.shape
    device = q.device
    check_tensor(op, "k_cache", k_cache, shape=(None, None, None, head_dim), device=device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    check_tensor(op, "v_cache", v_cache, shape=tuple(k_cache.shape), device=device)
    check_same_dtype(op, "q", q, k_cache=k_cache, v_cache=v_cache)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} kv heads")
    check_tensor(op, "query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,), device=device)
    B = query_start_loc.shape[0] - 1
    if B < 0:
        raise ValueError(f"{op}: query_start_loc must have B+1 >= 1 entries (cumulative query lengths), got 0")
    check_tensor(op, "context_lens", context_lens, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor(op, "block_tables", block_tables, shape=(B, None), dtypes=(torch.int32,), device=device)
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"{op}: max_query_len must be a non-negative Python int, got {max_query_len!r}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_tensor(op, "out", out, shape=(T, num_q_heads, head_dim), device=device)
    check_same_dtype(op, "q", q, out=out)
    if config is None:
        problem = {"max_query_len": max_query_len, "head_dim": head_dim, "query_group": num_q_heads // num_kv_heads,
                   "dtype": dtype_name(q.dtype)}
        config = PREFILL_ATTENTION_SPEC.default_config(problem, device)
    if B == 0 or T == 0 or max_query_len == 0:
        return out
    upcast_dot, dot_precision = dot_flags(q.dtype)
    block_m = config["BLOCK_M"]
    group = num_q_heads // num_kv_heads
    pack = config.variant == "gqa"
    heads_per_program = next_power_of_2(group) if pack else 1
    grid = (cdiv(max_query_len, block_m), B, num_kv_heads if pack else num_q_heads)
    _prefill_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out,
        float(scale) * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        block_size,
        QUERY_GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=config["BLOCK_N"], HEADS_PER_PROGRAM=heads_per_program, PACK_GQA=pack,
        UPCAST_DOT=upcast_dot, DOT_PRECISION=dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _choose_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("tile", num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=16)
    head_dim = int(problem["head_dim"])
    if int(problem["max_query_len"]) <= 16:
        # Decode-like chunks: pack the kv group's heads into the 16-row tile instead of padding
        # a few tokens of one head to 16 rows; K/V are then read once per group.
        group = next_power_of_2(max(1, int(problem.get("query_group", 1))))
        block_m = max(4, min(16, 16 // group)) if group <= 16 else 4
        return KernelConfig.make("gqa", num_warps=4, num_stages=2, BLOCK_M=block_m, BLOCK_N=64)
    if head_dim <= 64:
        return KernelConfig.make("tile", num_warps=4, num_stages=3, BLOCK_M=128, BLOCK_N=64)
    return KernelConfig.make("tile", num_warps=8, num_stages=3, BLOCK_M=128, BLOCK_N=64)


def _constraint(config: KernelConfig, problem) -> bool:
    if config.variant != "gqa":
        return True
    # Packed rows = BLOCK_M x group (padded): the tensor-core tile needs >= 16 rows and more
    # than 256 rows overflows registers.
    group = next_power_of_2(max(1, int(problem.get("query_group", 4))))
    return 16 <= config["BLOCK_M"] * group <= 256


PREFILL_ATTENTION_SPEC = register(
    KernelSpec(
        op="prefill_attention",
        module=__name__,
        launcher=prefill_attention,
        reference=prefill_attention_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace("tile", {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128),
                                      "num_warps": (4, 8), "num_stages": (1, 2, 3, 4)},
                             "BLOCK_M query rows of one head per program, KV gathered per tile"),
                VariantSpace("gqa", {"BLOCK_M": (4, 8, 16, 32, 64), "BLOCK_N": (16, 32, 64, 128),
                                     "num_warps": (4, 8), "num_stages": (1, 2, 3, 4)},
                             "BLOCK_M tokens x every head of one kv group per program: K/V read once per group"),
            ),
            constraint=_constraint,
        ),
        choose_default=_choose_default,
        problem_keys=("max_query_len", "head_dim", "query_group", "dtype"),
        doc=__doc__ or "",
    )
)
