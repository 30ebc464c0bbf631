"""Device code of the persistent layer-tail kernel (kernels/decode_layer_tail.py launches it).

One program walks the phases (attention, o_proj, MLP, the next qkv, the next attention)
over its row tiles, with grid-wide barriers (an atomic counter each program adds to and
spins on) between phases; the math, the data flow and why it is one kernel are in
decode_layer_tail.py's docstring and kernels/PERFORMANCE.md ("The layer-tail kernel").
"""

from __future__ import annotations

import triton
import triton.language as tl

from shapeshift.kernels.decode_attention import attend_split, merge_if_last
from shapeshift.kernels.triton_helpers import clock_stamp, grid_dependency_wait, launch_dependents


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Wait until `target` arrivals are counted (every program adds one per barrier)."""
    _barrier_arrive(counter_ptr)
    _barrier_wait(counter_ptr, target)


@triton.jit
def _barrier_arrive(counter_ptr):
    """This program's arrival: its stores so far are visible to whoever sees the count."""
    tl.debug_barrier()  # every thread's stores of the phase are issued before the release below
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _barrier_wait(counter_ptr, target):
    """Spin until `target` arrivals are counted; later loads see the arrivals' stores. Polling
    the counter with acquire atomics measured faster than volatile loads of it plus one acquire at
    the end (40.5 against 46.1 us a layer on an H200), than acquire loads of a flag the last
    arrival raises (2.8-3.8 against 0.9-2.0 us a barrier), and no slower than polls 100-300 ns
    apart (docs/decode-performance.md)."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _row_tile(w_ptr, t, row0, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr):
    """Rows [row0 + t*BLOCK_N, +BLOCK_N) of a row-major [*, K] weight as [BLOCK_N, KP]; nothing
    is read for rows past N (so a tile index past the last tile loads nothing)."""
    rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, KP)
    mask = (rows < N)[:, None] & (kk < K)[None, :]
    ptrs = w_ptr + (row0 + rows).to(tl.int64)[:, None] * K + kk[None, :]
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _tiles_before(w_ptr, pid, row0, G: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                  KP: tl.constexpr, EARLY: tl.constexpr):
    """A program's first two row tiles of a phase (pid and pid + G), of which the first EARLY (0-2)
    are loaded, ahead of the barrier; the others are zeros until _tiles_after loads them.
    Fewer early tiles shorten the barrier (its polls wait behind the program's outstanding loads)
    and lengthen the phase after it by more; asking the others into L2 instead (PTX prefetch)
    lengthened both (docs/decode-performance.md, ninth set)."""
    if EARLY >= 1:
        w0 = _row_tile(w_ptr, pid, row0, N, K, BLOCK_N, KP)
    else:
        w0 = tl.zeros([BLOCK_N, KP], w_ptr.dtype.element_ty)
    if EARLY >= 2:
        w1 = _row_tile(w_ptr, pid + G, row0, N, K, BLOCK_N, KP)
    else:
        w1 = tl.zeros([BLOCK_N, KP], w_ptr.dtype.element_ty)
    return w0, w1


@triton.jit
def _tiles_after(w_ptr, pid, row0, w0, w1, G: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 KP: tl.constexpr, EARLY: tl.constexpr):
    """The first two row tiles that _tiles_before left out, loaded after the barrier."""
    if EARLY < 1:
        w0 = _row_tile(w_ptr, pid, row0, N, K, BLOCK_N, KP)
    if EARLY < 2:
        w1 = _row_tile(w_ptr, pid + G, row0, N, K, BLOCK_N, KP)
    return w0, w1


@triton.jit
def _vector(ptr, K: tl.constexpr, KP: tl.constexpr, COHERENT: tl.constexpr):
    """A [K] activation vector as float32 [KP] (zeros past K); COHERENT: written by other
    programs of this launch, so read through L2."""
    kk = tl.arange(0, KP)
    if COHERENT:
        v = tl.load(ptr + kk, mask=kk < K, other=0.0, cache_modifier=".cg")
    else:
        v = tl.load(ptr + kk, mask=kk < K, other=0.0)
    return v.to(tl.float32)


@triton.jit
def _normed_vector(x_ptr, res_ptr, res_out_ptr, norm_w_ptr, eps, WRITE, K: tl.constexpr, KP: tl.constexpr):
    """round(round(h * 1/rms(h)) * norm_w) for h = round(x + res), as float32 [KP]; h is written
    to res_out when WRITE (one program). Same rounding points as kernels/gemv.py's prologue."""
    kk = tl.arange(0, KP)
    mask = kk < K
    x = tl.load(x_ptr + kk, mask=mask, other=0.0, cache_modifier=".cg")
    r = tl.load(res_ptr + kk, mask=mask, other=0.0, cache_modifier=".cg")
    dtype = x_ptr.dtype.element_ty
    h = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_out_ptr + kk, h, mask=mask & WRITE)
    hf = h.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / K + eps)
    nw = tl.load(norm_w_ptr + kk, mask=mask, other=0.0).to(tl.float32)
    normed = (hf * inv_rms).to(dtype).to(tl.float32)
    return (normed * nw).to(dtype).to(tl.float32)


@triton.jit
def _stream_rows(w_ptr, x, y_ptr, bias_ptr, pid, w0, w1, G: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                 BLOCK_N: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[n] = x . w[n] (+ bias) for this program's row tiles t = pid, pid + G, ...; w0 and w1
    are its first two tiles, loaded already (before the barrier in front of this phase). Three
    tiles are in flight while one is reduced: the one reduced and the next two."""
    for t in range(pid, tl.cdiv(N, BLOCK_N), G):
        w2 = _row_tile(w_ptr, t + 2 * G, 0, N, K, BLOCK_N, KP)
        acc = tl.sum(w0.to(tl.float32) * x[None, :], axis=1)
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rows < N)
        w0 = w1
        w1 = w2


@triton.jit
def _stream_gated(w_ptr, x, y_ptr, pid, g0, u0, g1, u1, G: tl.constexpr, INNER: tl.constexpr, K: tl.constexpr,
                  BLOCK_N: tl.constexpr, KP: tl.constexpr):
    """y[n] = silu(x . gate[n]) * (x . up[n]) over [gate; up] [2 INNER, K], with the rounding
    points of kernels/gemv.py's gated epilogue; tiles in flight as in _stream_rows."""
    dtype = y_ptr.dtype.element_ty
    for t in range(pid, tl.cdiv(INNER, BLOCK_N), G):
        g2 = _row_tile(w_ptr, t + 2 * G, 0, INNER, K, BLOCK_N, KP)
        u2 = _row_tile(w_ptr, t + 2 * G, INNER, INNER, K, BLOCK_N, KP)
        gate = tl.sum(g0.to(tl.float32) * x[None, :], axis=1).to(dtype).to(tl.float32)
        up = tl.sum(u0.to(tl.float32) * x[None, :], axis=1).to(dtype).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        rows = t * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + rows, (activated * up).to(dtype), mask=rows < INNER)
        g0 = g1
        u0 = u1
        g1 = g2
        u1 = u2


@triton.jit
def _merged_heads(partial_out_ptr, partial_lse_ptr, dtype: tl.constexpr, HQ: tl.constexpr, HQP: tl.constexpr,
                  S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    """The attention output [HQ * D] (as float32 [HQP * D], rounded to dtype like the output of
    kernels/decode_attention.py's merge pass) from the S split partials of every query head:
    out = sum_s 2^(lse_s - max lse) part_s / sum_s 2^(lse_s - max lse). Written by other
    programs of this launch, so read through L2. One split's [HQP, D] at a time (unrolled, so
    the loads are all issued up front): the whole [HQP, S, D] block at once took 220 registers
    a thread at S = 8 (one program per SM instead of two)."""
    h = tl.arange(0, HQP)
    d = tl.arange(0, D)
    head_ok = h < HQ
    s = tl.arange(0, SP)
    lse = tl.load(partial_lse_ptr + h[:, None] * S + s[None, :], mask=head_ok[:, None] & (s < S)[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [HQP, SP]
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: zeros, as the merge pass
    denom = tl.sum(tl.exp2(lse - top[:, None]), axis=1)
    acc = tl.zeros([HQP, D], tl.float32)
    for split in tl.static_range(S):
        weight = tl.exp2(tl.load(partial_lse_ptr + h * S + split, mask=head_ok, other=float("-inf"),
                                 cache_modifier=".cg") - top)
        part = tl.load(partial_out_ptr + (h * S + split)[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0,
                       cache_modifier=".cg")
        acc += part * weight[:, None]
    merged = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    return tl.reshape(merged.to(dtype).to(tl.float32), [HQP * D])


@triton.jit
def _attend_item(qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, partial_out_ptr,
                 partial_lse_ptr, scale_log2, item, stride_k_block, stride_k_slot, stride_k_head, stride_v_block,
                 stride_v_slot, stride_v_head, block_size, positions_ptr, cos_sin_ptr, slot_mapping_ptr, stride_cs,
                 HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                 BLOCK_N_ATT: tl.constexpr, SPLITS: tl.constexpr, USE_DOT: tl.constexpr, UPCAST_DOT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """Attention item = (kv head, split) of one token whose un-rotated q | k | v row is qkv:
    decode_attention_rope's pass 1 (rotary, the KV-cache write by the last split, attention over
    the split's slice of the paged cache); the output goes to out when SPLITS is 1, else to the
    split partials."""
    attend_split(qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
                 partial_out_ptr, partial_lse_ptr, scale_log2, 0, item // SPLITS, item % SPLITS,
                 0, HEAD_DIM, stride_k_block, stride_k_slot, stride_k_head,
                 stride_v_block, stride_v_slot, stride_v_head, 0, 0, HEAD_DIM,
                 block_size, HQ, HQ // HKV, BLOCK_G, HEAD_DIM, HEAD_DIM, BLOCK_N_ATT, SPLITS,
                 USE_DOT, UPCAST_DOT, DOT_PRECISION, True, qkv_ptr + HQ * HEAD_DIM,
                 qkv_ptr + (HQ + HKV) * HEAD_DIM, positions_ptr, cos_sin_ptr, slot_mapping_ptr,
                 0, HEAD_DIM, 0, HEAD_DIM, stride_cs, HEAD_DIM // 2)


@triton.jit
def _barrier(counter_ptr, target, ARRIVED: tl.constexpr):
    """The grid barrier in front of a phase; ARRIVED (split barrier): this program arrived
    before loading the phase's first tiles, so only the wait is left (the arrival's release
    then orders only the phase's stores, not the tile loads issued after it)."""
    if ARRIVED:
        _barrier_wait(counter_ptr, target)
    else:
        _grid_barrier(counter_ptr, target)


# A program's stamps (STAMP_SLOTS, from triton_helpers): [kernel start, phase 0 end, then (begin, end)
# of phases 1-5, unused..., the SM it ran on (SM_SLOT)].


@triton.jit
def _stamp(stamps_ptr, pid, slot: tl.constexpr, TIMING: tl.constexpr):
    """With TIMING, this program's GPU clock stamp `slot` (triton_helpers.clock_stamp, STAMP_SLOTS
    a program, the SM in SM_SLOT); phase p's work begins at slot 2p and ends at slot 2p + 1 (phase
    0 begins with the kernel). CUDA only: the benchmark's view of where a layer's time goes."""
    clock_stamp(stamps_ptr, pid, slot, TIMING)


@triton.jit
def _decode_layer_tail_kernel(
    attn_ptr, wo_ptr, y1_ptr,
    res_ptr, post_w_ptr, res2_ptr, wgu_ptr, act_ptr,
    wd_ptr, y3_ptr,
    in_w_ptr, res3_ptr, wqkv_ptr, bqkv_ptr, qkv_ptr,
    counter_ptr,  # int32 [2 + HKV]: arrivals, exits, phase 5's merge counters; zero between launches
    eps,
    H: tl.constexpr, QD: tl.constexpr, INNER: tl.constexpr, NQKV: tl.constexpr,
    HP: tl.constexpr, QDP: tl.constexpr, IP: tl.constexpr,
    BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BN_QKV: tl.constexpr,
    G: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,  # phases run by this launch (1..4)
    SYNC: tl.constexpr,  # grid barriers between phases (all phases in one launch)
    HAS_QKV_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (checks.pdl_options "layer_tail")
    # Phase 0, attention (decode_layer): this layer's qkv [1, HQ*D + 2*HKV*D] -> rotary, KV-cache
    # write and attention per (kv head, split) item; phase 1 merges the splits into its input.
    HAS_ATTENTION: tl.constexpr = False,
    qkv_in_ptr=None, k_cache_ptr=None, v_cache_ptr=None, block_tables_ptr=None, context_lens_ptr=None,
    positions_ptr=None, cos_sin_ptr=None, slot_mapping_ptr=None, partial_out_ptr=None, partial_lse_ptr=None,
    scale_log2=1.0, stride_k_block=0, stride_k_slot=0, stride_k_head=0, stride_v_block=0, stride_v_slot=0,
    stride_v_head=0, stride_cs=0, block_size=1,
    HQ: tl.constexpr = 1, HQP: tl.constexpr = 1, HKV: tl.constexpr = 1, HEAD_DIM: tl.constexpr = 16,
    BLOCK_G: tl.constexpr = 16, BLOCK_N_ATT: tl.constexpr = 16, SPLITS: tl.constexpr = 1, SPLITS_P: tl.constexpr = 2,
    USE_DOT: tl.constexpr = True, UPCAST_DOT: tl.constexpr = False, DOT_PRECISION: tl.constexpr = "tf32",
    SPLIT_BARRIER: tl.constexpr = False,  # arrive, load the next phase's first tiles, then wait
    EARLY_TILES: tl.constexpr = 2,  # of each weight's first two tiles of phases 2-4, how many load before the wait
    EARLY_O: tl.constexpr = False,  # decode_layer: o_proj's first tiles load before the attention barrier
    TIMING: tl.constexpr = False, stamps_ptr=None,  # per-phase %globaltimer stamps (hack/bench_layer_tail.py)
    # Phase 5, the next layer's attention (decode_layer_tail's next_attention): the attention
    # arguments above name the next layer's caches; its output goes to attn_out.
    attn_out_ptr=None,
):
    pid = tl.program_id(0)
    _stamp(stamps_ptr, pid, 0, TIMING)
    if FIRST <= 0 and LAST >= 0:
        # A program per (kv head, split) item (the rest go straight to phase 1's first tiles);
        # q, k and v are the qkv row's three parts, un-rotated.
        for item in range(pid, HKV * SPLITS, G):
            _attend_item(qkv_in_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, attn_ptr,
                         partial_out_ptr, partial_lse_ptr, scale_log2, item, stride_k_block, stride_k_slot,
                         stride_k_head, stride_v_block, stride_v_slot, stride_v_head, block_size, positions_ptr,
                         cos_sin_ptr, slot_mapping_ptr, stride_cs, HQ, HKV, HEAD_DIM, BLOCK_G, BLOCK_N_ATT, SPLITS,
                         USE_DOT, UPCAST_DOT, DOT_PRECISION)
        _stamp(stamps_ptr, pid, 1, TIMING)
    if FIRST <= 1 and LAST >= 1:
        if SYNC and SPLIT_BARRIER and FIRST <= 0:
            _barrier_arrive(counter_ptr)
        if EARLY_O or FIRST > 0:
            w0, w1 = _tiles_before(wo_ptr, pid, 0, G, H, QD, BN_O, QDP, 2)
        if SYNC and FIRST <= 0:
            _barrier(counter_ptr, (1 - FIRST) * G, SPLIT_BARRIER)
        if not (EARLY_O or FIRST > 0):
            w0, w1 = _tiles_before(wo_ptr, pid, 0, G, H, QD, BN_O, QDP, 2)
        grid_dependency_wait(USE_PDL)  # nothing above reads what the kernel ahead writes
        _stamp(stamps_ptr, pid, 2, TIMING)
        if HAS_ATTENTION and SPLITS > 1:
            x = _merged_heads(partial_out_ptr, partial_lse_ptr, attn_ptr.dtype.element_ty, HQ, HQP, SPLITS, SPLITS_P,
                              HEAD_DIM)
        else:
            x = _vector(attn_ptr, QD, QDP, HAS_ATTENTION)
        _stream_rows(wo_ptr, x, y1_ptr, y1_ptr, pid, w0, w1, G, H, QD, BN_O, QDP, False)
        _stamp(stamps_ptr, pid, 3, TIMING)
    if FIRST <= 2 and LAST >= 2:
        if SYNC and SPLIT_BARRIER:
            _barrier_arrive(counter_ptr)
        g0, g1 = _tiles_before(wgu_ptr, pid, 0, G, INNER, H, BN_GU, HP, EARLY_TILES)
        u0, u1 = _tiles_before(wgu_ptr, pid, INNER, G, INNER, H, BN_GU, HP, EARLY_TILES)
        if SYNC:
            _barrier(counter_ptr, (2 - FIRST) * G, SPLIT_BARRIER)
        g0, g1 = _tiles_after(wgu_ptr, pid, 0, g0, g1, G, INNER, H, BN_GU, HP, EARLY_TILES)
        u0, u1 = _tiles_after(wgu_ptr, pid, INNER, u0, u1, G, INNER, H, BN_GU, HP, EARLY_TILES)
        _stamp(stamps_ptr, pid, 4, TIMING)
        x = _normed_vector(y1_ptr, res_ptr, res2_ptr, post_w_ptr, eps, pid == 0, H, HP)
        _stream_gated(wgu_ptr, x, act_ptr, pid, g0, u0, g1, u1, G, INNER, H, BN_GU, HP)
        _stamp(stamps_ptr, pid, 5, TIMING)
    if FIRST <= 3 and LAST >= 3:
        if SYNC and SPLIT_BARRIER:
            _barrier_arrive(counter_ptr)
        w0, w1 = _tiles_before(wd_ptr, pid, 0, G, H, INNER, BN_D, IP, EARLY_TILES)
        if SYNC:
            _barrier(counter_ptr, (3 - FIRST) * G, SPLIT_BARRIER)
        w0, w1 = _tiles_after(wd_ptr, pid, 0, w0, w1, G, H, INNER, BN_D, IP, EARLY_TILES)
        if LAST == 3:
            launch_dependents(USE_PDL)  # the next kernel's programs may take their places now
        _stamp(stamps_ptr, pid, 6, TIMING)
        x = _vector(act_ptr, INNER, IP, True)
        _stream_rows(wd_ptr, x, y3_ptr, y3_ptr, pid, w0, w1, G, H, INNER, BN_D, IP, False)
        _stamp(stamps_ptr, pid, 7, TIMING)
    if FIRST <= 4 and LAST >= 4:
        if SYNC and SPLIT_BARRIER:
            _barrier_arrive(counter_ptr)
        w0, w1 = _tiles_before(wqkv_ptr, pid, 0, G, NQKV, H, BN_QKV, HP, EARLY_TILES)
        if SYNC:
            _barrier(counter_ptr, (4 - FIRST) * G, SPLIT_BARRIER)
        w0, w1 = _tiles_after(wqkv_ptr, pid, 0, w0, w1, G, NQKV, H, BN_QKV, HP, EARLY_TILES)
        launch_dependents(USE_PDL)
        _stamp(stamps_ptr, pid, 8, TIMING)
        x = _normed_vector(y3_ptr, res2_ptr, res3_ptr, in_w_ptr, eps, pid == 0, H, HP)
        _stream_rows(wqkv_ptr, x, qkv_ptr, bqkv_ptr, pid, w0, w1, G, NQKV, H, BN_QKV, HP, HAS_QKV_BIAS)
        _stamp(stamps_ptr, pid, 9, TIMING)
    if FIRST <= 5 and LAST >= 5:
        # The next layer's attention on the qkv row phase 4 wrote (NEXT_ATTENTION): one program
        # per (kv head, split) item waits for every program's qkv rows; the others exit (their
        # SMs free for the next kernel). The last split of each kv head merges its group.
        if SYNC:
            _barrier_arrive(counter_ptr)
        if pid < HKV * SPLITS:
            if SYNC:
                _barrier_wait(counter_ptr, (5 - FIRST) * G)
            _stamp(stamps_ptr, pid, 10, TIMING)
            for item in range(pid, HKV * SPLITS, G):
                _attend_item(qkv_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, attn_out_ptr,
                             partial_out_ptr, partial_lse_ptr, scale_log2, item, stride_k_block, stride_k_slot,
                             stride_k_head, stride_v_block, stride_v_slot, stride_v_head, block_size, positions_ptr,
                             cos_sin_ptr, slot_mapping_ptr, stride_cs, HQ, HKV, HEAD_DIM, BLOCK_G, BLOCK_N_ATT,
                             SPLITS, USE_DOT, UPCAST_DOT, DOT_PRECISION)
                if SPLITS > 1:
                    merge_if_last(counter_ptr + 2 + item // SPLITS, partial_out_ptr, partial_lse_ptr, attn_out_ptr,
                                  0, item // SPLITS, 0, HEAD_DIM, HQ, HQ // HKV, BLOCK_G, HEAD_DIM, HEAD_DIM, SPLITS,
                                  SPLITS_P)
            _stamp(stamps_ptr, pid, 11, TIMING)
    if SYNC:
        # The last program out resets the counters for the next launch (or graph replay): every
        # other program has passed its last barrier by then (its exit add, acq_rel, comes after).
        # Plain stores: atomic exchanges, one round trip each in sequence, kept the kernel running
        # ~0.7 us per counter after its last weight byte (layer-tail-llama-3.2-1b-shape-nvidia-h200-20261130T052914Z.json); the
        # kernel's end makes the stores visible to the next launch.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            slot = tl.arange(0, 2)
            tl.store(counter_ptr + slot, tl.zeros([2], tl.int32))


# Phase 5 (the next layer's attention) merges each kv head's splits through a counter of its own.
