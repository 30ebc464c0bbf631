"""Mixture-of-experts building blocks: top-k routing, token alignment by expert, and a grouped
expert GEMM, composed by `fused_moe()`.

Math:
  routing   p = softmax(router_logits[t]) (float32); ids = top-k indices of p; weights = p[ids],
            divided by their sum when `renormalize` (Mixtral; Qwen3-MoE's norm_topk_prob).
  alignment the T*k (token, slot) entries e = t*k + j are grouped by expert ids[e]; each
            expert's group is padded to a multiple of BLOCK_M with the sentinel T*k, so that
            every BLOCK_M-row block of `sorted_ids` belongs to exactly one expert (`expert_ids`).
  grouped   out[e] = A[row(e)] @ W[ids[e]]^T (* weights[e]), row(e) = e // k when A holds one
  GEMM      row per token (the first projection), e when A holds one row per entry (the second).
  fused_moe y[t] = sum_j weights[t, j] * W2[ids[t,j]] @ silu_and_mul(W13[ids[t,j]] @ x[t])
            with W13 [E, 2I, H] (gate rows then up rows) and W2 [E, H, I].

Data flow of fused_moe: router logits [T, E] -> routing -> (weights, ids) [T, k]
  -> align (per-program expert histograms merged with one atomic per expert, pad and
     prefix-sum in one program, scatter through per-program reservations) -> sorted_ids [T*k + min(E, T*k)*(BLOCK_M-1)], expert_ids [blocks], num_padded [1]
  -> grouped GEMM 1: x [T, H] x W13 -> [T*k, 2I] -> silu_and_mul -> [T*k, I]
  -> grouped GEMM 2 (routing weight folded in) -> [T*k, H] -> sum over k -> y [T, H].
All grid sizes come from T, k, E and BLOCK_M (static shapes); blocks past num_padded exit at
once, so the path is CUDA-graph capturable. The order of entries inside one expert's group is
set by atomics and may vary run to run; each output row is computed independently, so results
do not depend on it. Only experts that received tokens have their weights read: skewed
routing reads fewer weight bytes than uniform routing but loads the hot experts' blocks unevenly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.activation import silu_and_mul
from shapeshift.kernels.checks import (FLOAT_DTYPES, cdiv, check_runnable_device, check_same_dtype, check_tensor, dot_flags, dtype_name,
                     next_power_of_2)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import dot

MAX_EXPERTS = 1024


# ----------------------------------------------------------------------------- routing
@triton.jit
def _topk_routing_kernel(
    logits_ptr,  # [T, E]
    weights_ptr,  # [T, TOP_K] float32
    ids_ptr,  # [T, TOP_K] int32
    T,
    E,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_mask = cols < E
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_logits + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :], other=float("-inf")).to(tl.float32)
    # Rows past T are all -inf: give them a finite max and unit sum so no NaN is produced.
    x_max = tl.where(row_mask, tl.max(x, axis=1), 0.0)
    e = tl.exp(x - x_max[:, None])
    probs = e / tl.where(row_mask, tl.sum(e, axis=1), 1.0)[:, None]  # [BLOCK_T, BLOCK_E]
    probs = tl.where(col_mask[None, :], probs, -1.0)
    # The k picks are collected in registers ([BLOCK_T, BLOCK_TOPK]) and stored once.
    slots = tl.arange(0, BLOCK_TOPK)
    picked_weights = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.float32)
    picked_ids = tl.zeros([BLOCK_T, BLOCK_TOPK], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, axis=1)
        best_id = tl.min(tl.where(probs == best[:, None], cols[None, :], BLOCK_E), axis=1)
        picked_weights = tl.where(slots[None, :] == j, best[:, None], picked_weights)
        picked_ids = tl.where(slots[None, :] == j, best_id[:, None], picked_ids)
        probs = tl.where(cols[None, :] == best_id[:, None], -1.0, probs)
    if RENORMALIZE:
        picked_weights = picked_weights / tl.where(row_mask, tl.sum(picked_weights, axis=1), 1.0)[:, None]
    out_offsets = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, picked_weights, mask=out_mask)
    tl.store(ids_ptr + out_offsets, picked_ids, mask=out_mask)


def topk_routing_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax (float32) + top-k (+ renormalise): weights float32 [T, k], ids int32 [T, k]."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_routing(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, config: KernelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k]), best first."""
    op = "topk_routing"
    check_tensor(op, "router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, router_logits)
    T, E = router_logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{op}: number of experts {E} outside 1..{MAX_EXPERTS}")
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"{op}: top_k must be an int in 1..{E} (the number of experts), got {top_k!r}")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int32, device=router_logits.device)
    if config is None:
        config = TOPK_ROUTING_SPEC.default_config({"tokens": T, "experts": E, "top_k": top_k}, router_logits.device)
    if T == 0:
        return weights, ids
    block_t = config["BLOCK_T"]
    _topk_routing_kernel[(cdiv(T, block_t),)](
        router_logits, weights, ids, T, E, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=next_power_of_2(E),
        BLOCK_TOPK=next_power_of_2(top_k),
        num_warps=config.num_warps,
    )
    return weights, ids


# ----------------------------------------------------------------------------- alignment
@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_entries, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert = tl.load(ids_ptr + offs, mask=offs < num_entries, other=-1)
    e = tl.arange(0, BLOCK_E)
    # A per-program histogram, then one atomic per (program, expert): skewed routing would
    # otherwise serialise thousands of atomics on the few hot experts' counters.
    local = tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)  # [BLOCK_E]
    tl.atomic_add(counts_ptr + e, local, mask=(e < E) & (local > 0))


@triton.jit
def _pad_offsets_kernel(
    counts_ptr,  # [E] int32
    cursor_ptr,  # [E] int32 out: first padded slot of each expert
    expert_ids_ptr,  # [max_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    e = tl.arange(0, BLOCK_E)
    e_mask = e < E
    counts = tl.load(counts_ptr + e, mask=e_mask, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # inclusive prefix sums
    starts = ends - padded
    tl.store(cursor_ptr + e, starts, mask=e_mask)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    # Block b belongs to the expert whose [start, end) holds b * BLOCK_M: the number of
    # experts ending at or before it. Blocks past the total get -1.
    ends_valid = tl.where(e_mask, ends, 2147483647)
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        first_row = b * BLOCK_M
        owner = tl.sum((ends_valid[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        owner = tl.where(first_row < total, owner, -1)
        tl.store(expert_ids_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, cursor_ptr, sorted_ids_ptr, num_entries, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_entries
    expert = tl.load(ids_ptr + offs, mask=mask, other=-1)
    e = tl.arange(0, BLOCK_E)
    onehot = (expert[:, None] == e[None, :]).to(tl.int32)  # [BLOCK, BLOCK_E]
    local = tl.sum(onehot, axis=0)
    # Reserve this program's run inside each expert's group with one atomic per expert, then
    # place each entry at its rank among the program's entries of the same expert.
    base = tl.atomic_add(cursor_ptr + e, local, mask=(e < E) & (local > 0))
    base = tl.where(local > 0, base, 0)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [BLOCK]
    position = tl.sum(onehot * base[None, :], axis=1) + rank
    tl.store(sorted_ids_ptr + position, offs, mask=mask)


def moe_align_sizes(num_entries: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(length of sorted_ids, number of blocks): static upper bounds from the shapes.

    Only experts that receive an entry are padded (by at most block_m - 1 rows), and at most
    min(E, T*k) experts can: at decode sizes this keeps the grid to a few blocks, not E."""
    max_padded = num_entries + min(num_experts, num_entries) * (block_m - 1)
    return max_padded, cdiv(max_padded, block_m)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Reference alignment (stable order inside each expert)."""
    flat = topk_ids.flatten().long()
    num_entries = flat.numel()
    max_padded, max_blocks = moe_align_sizes(num_entries, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), num_entries, dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.full((max_blocks,), -1, dtype=torch.int32, device=topk_ids.device)
    position = 0
    for e in range(num_experts):
        members = torch.nonzero(flat == e).flatten()
        n = members.numel()
        padded = -(-n // block_m) * block_m
        sorted_ids[position : position + n] = members.to(torch.int32)
        expert_ids[position // block_m : (position + padded) // block_m] = e
        position += padded
    return sorted_ids, expert_ids, torch.tensor([position], dtype=torch.int32, device=topk_ids.device)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the T*k entries of topk_ids [T, k] int32 by expert, padded to BLOCK_M rows.

    Returns sorted_ids int32 [T*k + min(E, T*k)*(block_m-1)] (entry indices t*k+j; padding = T*k),
    expert_ids int32 [blocks] (-1 past the end), num_padded int32 [1] (rows in use).
    """
    op = "moe_align"
    check_tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32,), contiguous=True)
    check_runnable_device(op, topk_ids)
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"{op}: num_experts {num_experts} outside 1..{MAX_EXPERTS}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"{op}: block_m must be a power of two, got {block_m}")
    device = topk_ids.device
    num_entries = topk_ids.numel()
    max_padded, max_blocks = moe_align_sizes(num_entries, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), num_entries, dtype=torch.int32, device=device)
    expert_ids = torch.empty((max_blocks,), dtype=torch.int32, device=device)
    num_padded = torch.empty((1,), dtype=torch.int32, device=device)
    counts = torch.zeros((num_experts,), dtype=torch.int32, device=device)
    cursor = torch.empty((num_experts,), dtype=torch.int32, device=device)
    block_e = next_power_of_2(num_experts)
    # Keep the [entries, experts] one-hot tile of the count/scatter kernels near 32K elements.
    block = max(16, min(1024, 32768 // block_e))
    if num_entries:
        _count_kernel[(cdiv(num_entries, block),)](topk_ids, counts, num_entries, num_experts,
                                                          BLOCK=block, BLOCK_E=block_e, num_warps=8)
    _pad_offsets_kernel[(1,)](counts, cursor, expert_ids, num_padded, num_experts, max_blocks,
                              BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=64)
    if num_entries:
        # The scatter's cumulative sum over the one-hot tile needs scratch shared memory: a
        # smaller tile (16K elements, 64 KB) than the count kernel's.
        scatter_block = max(16, min(1024, 16384 // block_e))
        _scatter_kernel[(cdiv(num_entries, scatter_block),)](
            topk_ids, cursor, sorted_ids, num_entries, num_experts, BLOCK=scatter_block, BLOCK_E=block_e, num_warps=8)
    return sorted_ids, expert_ids, num_padded


# ----------------------------------------------------------------------------- grouped GEMM
@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [T, K] (A_PER_TOKEN) or [T*k, K]
    w_ptr,  # [E, N, K]
    out_ptr,  # [T*k, N]
    sorted_ids_ptr,  # [max_padded] int32
    expert_ids_ptr,  # [max_blocks] int32
    num_padded_ptr,  # [1] int32
    routing_weights_ptr,  # [T*k] float32
    num_entries,
    N,
    K,
    stride_a,
    stride_w_e,
    stride_w_n,
    stride_out,
    TOP_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    MUL_ROUTING_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        entries = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        valid = entries < num_entries
        if A_PER_TOKEN:
            a_rows = entries // TOP_K
        else:
            a_rows = entries
        a_rows = tl.where(valid, a_rows, 0).to(tl.int64)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_safe = tl.where(n < N, n, 0).to(tl.int64)
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + kk[None, :]  # [BLOCK_M, BLOCK_K]
        w_ptrs = w_ptr + expert * stride_w_e + n_safe[:, None] * stride_w_n + kk[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + kk) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            acc += dot(a, tl.trans(w), UPCAST_DOT, DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if MUL_ROUTING_WEIGHT:
            acc *= tl.load(routing_weights_ptr + entries, mask=valid, other=0.0)[:, None]
        out_rows = tl.where(valid, entries, 0).to(tl.int64)
        tl.store(out_ptr + out_rows[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & (n < N)[None, :])


def moe_grouped_gemm_ref(a, w, topk_ids, a_per_token: bool, routing_weights=None):
    """Per entry e = t*k + j: a[row(e)] @ w[ids[e]]^T (* routing_weights[e]) in float32."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.flatten().long()
    rows = torch.arange(ids.numel(), device=a.device)
    a_rows = a.float()[rows // top_k] if a_per_token else a.float()
    out = torch.einsum("ek,enk->en", a_rows, w.float()[ids])
    if routing_weights is not None:
        out = out * routing_weights.flatten().float()[:, None]
    return out.to(a.dtype)


def moe_grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_padded: torch.Tensor,
    top_k: int,
    *,
    a_per_token: bool,
    routing_weights: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Grouped expert GEMM over `moe_align` output; returns [T*k, N] (rows by entry t*k+j).

    a: [T, K] with a_per_token (one row per token) or [T*k, K]; w: [E, N, K]; routing_weights:
    float32 [T, k] to fold the router weight into the product (second projection). The
    config's BLOCK_M must equal the block_m given to moe_align.
    """
    op = "moe_grouped_gemm"
    check_tensor(op, "a", a, ndim=2, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, a)
    K = a.shape[1]
    device = a.device
    check_tensor(op, "w", w, shape=(None, None, K), device=device)
    check_same_dtype(op, "a", a, w=w)
    E, N, _ = w.shape
    check_tensor(op, "sorted_ids", sorted_ids, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor(op, "expert_ids", expert_ids, ndim=1, dtypes=(torch.int32,), device=device)
    check_tensor(op, "num_padded", num_padded, shape=(1,), dtypes=(torch.int32,), device=device)
    num_tokens = a.shape[0] if a_per_token else a.shape[0] // max(1, top_k)
    num_entries = num_tokens * top_k
    if not a_per_token and a.shape[0] != num_entries:
        raise ValueError(f"{op}: a has {a.shape[0]} rows; without a_per_token it needs one row per entry")
    if routing_weights is not None:
        check_tensor(op, "routing_weights", routing_weights, shape=(num_tokens, top_k), dtypes=(torch.float32,),
                     device=device, contiguous=True)
    if out is None:
        out = torch.empty((num_entries, N), dtype=a.dtype, device=device)
    check_tensor(op, "out", out, shape=(num_entries, N), device=device)
    check_same_dtype(op, "a", a, out=out)
    if config is None:
        config = MOE_GEMM_SPEC.default_config({"tokens": num_tokens, "top_k": top_k, "experts": E, "n": N, "k": K,
                                               "dtype": dtype_name(a.dtype)}, device)
    block_m = config["BLOCK_M"]
    max_padded, max_blocks = moe_align_sizes(num_entries, E, block_m)
    if sorted_ids.shape[0] != max_padded or expert_ids.shape[0] != max_blocks:
        raise ValueError(
            f"{op}: sorted_ids/expert_ids have {sorted_ids.shape[0]}/{expert_ids.shape[0]} entries but BLOCK_M="
            f"{block_m} needs {max_padded}/{max_blocks}; call moe_align with block_m={block_m}"
        )
    if num_entries == 0:
        return out
    upcast_dot, dot_precision = dot_flags(a.dtype)
    block_n = config["BLOCK_N"]
    _grouped_gemm_kernel[(max_blocks, cdiv(N, block_n))](
        a, w, out, sorted_ids, expert_ids, num_padded,
        routing_weights if routing_weights is not None else out,
        num_entries, N, K, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, A_PER_TOKEN=bool(a_per_token), MUL_ROUTING_WEIGHT=routing_weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=config["BLOCK_K"],
        UPCAST_DOT=upcast_dot, DOT_PRECISION=dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# ----------------------------------------------------------------------------- full layer
def fused_moe_ref(x, w13, w2, router_logits, top_k: int, renormalize: bool) -> torch.Tensor:
    """Float32 reference of the whole MoE MLP (expert by expert)."""
    weights, ids = topk_routing_ref(router_logits, top_k, renormalize)
    inner = w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in ids.unique().tolist():
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        h = xf[token] @ w13[e].float().t()
        h = torch.nn.functional.silu(h[:, :inner]) * h[:, inner:]
        out.index_add_(0, token, (h @ w2[e].float().t()) * weights[token, slot][:, None])
    return out.to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """MoE MLP: x [T, H], w13 [E, 2I, H], w2 [E, H, I], router_logits [T, E] -> [T, H]."""
    op = "fused_moe"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "w13", w13, ndim=3, device=x.device)
    check_tensor(op, "w2", w2, ndim=3, device=x.device)
    E, two_inner, H = w13.shape
    if H != x.shape[1] or two_inner % 2:
        raise ValueError(f"{op}: w13 must be [E, 2*I, H={x.shape[1]}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (E, H, two_inner // 2):
        raise ValueError(f"{op}: w2 must be [E={E}, H={H}, I={two_inner // 2}], got {tuple(w2.shape)}")
    check_tensor(op, "router_logits", router_logits, shape=(x.shape[0], E), device=x.device)
    weights, ids = topk_routing(router_logits, top_k, renormalize)
    return fused_moe_routed(x, w13, w2, weights, ids, config=config)


def fused_moe_routed(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """The expert half of `fused_moe`, for a caller that routed already (the engine routes in
    torch and counts the choices): x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing weights
    float32 [T, k] and expert ids [T, k] (any integer dtype, each in 0..E-1) -> [T, H].
    `config` is the grouped GEMM's tile config for both projections (None: the registry's
    default for T tokens on this device)."""
    op = "fused_moe_routed"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    E, two_inner, H = w13.shape
    T = x.shape[0]
    top_k = ids.shape[1]
    check_tensor(op, "ids", ids, shape=(T, top_k), device=x.device)
    check_tensor(op, "weights", weights, shape=(T, top_k), dtypes=(torch.float32,), device=x.device)
    ids = ids.to(torch.int32).contiguous()
    weights = weights.contiguous()
    if config is None:
        config = MOE_GEMM_SPEC.default_config({"tokens": T, "top_k": top_k, "experts": E, "n": two_inner, "k": H,
                                               "dtype": dtype_name(x.dtype)}, x.device)
    sorted_ids, expert_ids, num_padded = moe_align(ids, E, config["BLOCK_M"])
    hidden = moe_grouped_gemm(x, w13, sorted_ids, expert_ids, num_padded, top_k, a_per_token=True, config=config)
    activated = silu_and_mul(hidden)  # [T*k, I]
    projected = moe_grouped_gemm(activated, w2, sorted_ids, expert_ids, num_padded, top_k, a_per_token=False,
                                 routing_weights=weights, config=config)  # [T*k, H]
    return projected.view(T, top_k, H).float().sum(dim=1).to(x.dtype)


def _gemm_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("grouped", num_warps=4, num_stages=2, BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
    entries = int(problem["tokens"]) * int(problem["top_k"])
    per_expert = entries / max(1, int(problem["experts"]))
    # Decode-sized batches put a handful of rows on each expert: small BLOCK_M wastes less of
    # each padded block; big prefill batches want large tiles for tensor-core efficiency.
    if per_expert <= 16:
        return KernelConfig.make("grouped", num_warps=4, num_stages=4, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)
    if per_expert <= 64:
        return KernelConfig.make("grouped", num_warps=4, num_stages=3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)
    return KernelConfig.make("grouped", num_warps=8, num_stages=3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)


def _gemm_constraint(config: KernelConfig, problem) -> bool:
    # Pipelined A and W tiles must fit in an H100/H200 SM's 227 KB of shared memory.
    element = 4 if problem.get("dtype") == "float32" else 2
    tile = (config["BLOCK_M"] + config["BLOCK_N"]) * config["BLOCK_K"] * element
    return config.num_stages * tile <= 227 * 1024


def _routing_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("rows", num_warps=4, num_stages=1, BLOCK_T=4)
    experts = int(problem["experts"])
    return KernelConfig.make("rows", num_warps=4, num_stages=1, BLOCK_T=max(1, min(32, 4096 // next_power_of_2(experts))))


TOPK_ROUTING_SPEC = register(
    KernelSpec(
        op="topk_routing",
        module=__name__,
        launcher=topk_routing,
        reference=topk_routing_ref,
        config_space=KernelConfigSpace(
            variants=(VariantSpace("rows", {"BLOCK_T": (1, 2, 4, 8, 16, 32), "num_warps": (1, 2, 4, 8),
                                            "num_stages": (1,)}, "BLOCK_T tokens per program, all experts"),),
        ),
        choose_default=_routing_default,
        problem_keys=("tokens", "experts", "top_k"),
        doc=__doc__ or "",
    )
)

MOE_GEMM_SPEC = register(
    KernelSpec(
        op="moe_grouped_gemm",
        module=__name__,
        launcher=moe_grouped_gemm,
        reference=moe_grouped_gemm_ref,
        config_space=KernelConfigSpace(
            constraint=_gemm_constraint,
            variants=(VariantSpace("grouped", {"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (32, 64, 128),
                                               "BLOCK_K": (32, 64, 128), "num_warps": (4, 8),
                                               "num_stages": (2, 3, 4)},
                                   "one expert block of BLOCK_M sorted entries x BLOCK_N outputs per program"),),
        ),
        choose_default=_gemm_default,
        problem_keys=("tokens", "top_k", "experts", "n", "k", "dtype"),
        doc=__doc__ or "",
    )
)
