"""Token sampling from logits: greedy argmax, and temperature / top-k / top-p sampling with
per-row parameters, without sorting the vocabulary (only chunk-local top-k candidates).

Math, per row with logits x [V], temperature T, top_k k (0 = off), top_p p (1 = off):
    w_i = exp((x_i - max x) / T)                              (unnormalised probabilities, max 1)
    top-k keeps {i : w_i >= t_k}, t_k the largest t with #{w >= t} >= k  (ties at the k-th value
          are all kept, as Hugging Face's TopKLogitsWarper does)
    top-p then keeps {i : w_i >= t_p}, t_p the largest t >= t_k with
          sum{w_i : w_i >= t} >= p * sum{w_i : w_i >= t_k}   (the smallest top set of mass >= p,
          computed on the top-k-renormalised distribution, as vLLM orders the two filters)
    token = argmax over kept i of w_i / E_i,  E_i = -log(U_i), U_i ~ Uniform(0, 1)
The last line is the exponential race (Gumbel-max in another form): it draws i with
probability w_i / sum(kept w), and needs one pass instead of a cumulative sum.
Rows with T <= 0 are greedy: token = first index of max x.

Data flow of the default "split" variant (thresholds and race keys in the order-preserving
int32 image of the float32 logits, so every comparison is exact):
  stage 1, grid (B, cdiv(V, BLOCK_V)): each program reads one chunk of the row once: its max
    and first argmax; for a filtered row its NUM_CAND largest logits (candidates), its
    "floor" (smallest candidate, when the chunk holds more tokens than that) and its mass;
    for an unfiltered row the chunk's exponential-race winner.
  stage 2, grid (B,): greedy rows take the first argmax, unfiltered rows the best race key;
    filtered rows find t_k and t_p by bisection over the candidates (NUM_PIVOTS pivots per
    pass) and race over the candidates above the threshold. All tokens above the highest
    chunk floor are candidates, so a threshold above it is exact; otherwise the row is flagged.
  stage 3, grid (B,): flagged rows redo the search over the whole row, one program per row.
  Race key: x_i / T * log2(e) - log2(E_i), i.e. log2(w_i / E_i) up to a per-row constant,
  with Philox uniforms from (seeds[row], i): both paths draw the same token for a seed.
The "row" variant is one program per row doing all of it by full passes over the row (a
bisection on the bit patterns of w): simple, and slow at small batches.
Randomness depends only on the row's seed and the token index, never on batch mates, so a
request's draws are reproducible whatever it is batched with; the engine passes a fresh seed
per request per step (drawn from the request's own torch.Generator).
Greedy-only batches use kernels/argmax.py instead (a split-vocabulary two-pass argmax).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import LaunchPlans, cdiv, check_runnable_device, check_tensor, next_power_of_2
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_ONE_PLUS_ULP_BITS: tl.constexpr = tl.constexpr(0x3F800001)  # bits just above 1.0f: no w_i reaches it
_INT32_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _largest_valid_threshold(
    row_ptr, V, row_max, scale, lo, hi, target,
    USE_MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """Largest float t (as int32 bits, lo <= bits < hi) with count(w >= t) >= target
    (USE_MASS False) or sum(w : w >= t) >= target (USE_MASS True). `lo` must be valid and
    `hi` invalid."""
    offs = tl.arange(0, BLOCK_V)
    j = (tl.arange(0, NUM_PIVOTS) + 1).to(tl.int64)
    while hi - lo > 1:
        pivot_bits = (lo.to(tl.int64) + ((hi - lo).to(tl.int64) * j) // (NUM_PIVOTS + 1)).to(tl.int32)
        pivots = pivot_bits.to(tl.float32, bitcast=True)  # [NUM_PIVOTS], ascending
        total = tl.zeros([NUM_PIVOTS], tl.float32)
        for start in range(0, V, BLOCK_V):
            in_row = (start + offs) < V
            x = tl.load(row_ptr + start + offs, mask=in_row, other=float("-inf")).to(tl.float32)
            w = tl.exp2((x - row_max) * scale)  # [BLOCK_V]
            above = (w[None, :] >= pivots[:, None]) & in_row[None, :]  # [NUM_PIVOTS, BLOCK_V]
            if USE_MASS:
                total += tl.sum(tl.where(above, w[None, :], 0.0), axis=1)
            else:
                total += tl.sum(above.to(tl.float32), axis=1)
        valid = total >= target
        new_lo = tl.max(tl.where(valid, pivot_bits, lo), axis=0)
        new_hi = tl.min(tl.where(valid, hi, pivot_bits), axis=0)
        lo = new_lo
        hi = new_hi
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    out_ptr,  # [B] int64
    V,
    stride_row,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: max and its first index, kept per lane and merged after the loop.
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + offs, mask=(start + offs) < V, other=float("-inf")).to(tl.float32)
        better = x > lane_max
        lane_idx = tl.where(better, start + offs, lane_idx)
        lane_max = tl.where(better, x, lane_max)
    row_max = tl.max(lane_max, axis=0)
    token = tl.min(tl.where(lane_max == row_max, lane_idx, V), axis=0).to(tl.int64)

    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0.0:
        scale = LOG2E / temperature
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        seed = tl.load(seeds_ptr + row)
        lo = tl.zeros([], tl.int32)  # bits of 0.0: keeps every token
        if (top_k > 0) & (top_k < V):
            lo = _largest_valid_threshold(row_ptr, V, row_max, scale, lo, tl.full([], _ONE_PLUS_ULP_BITS, tl.int32),
                                          top_k.to(tl.float32), False, BLOCK_V, NUM_PIVOTS)
        if top_p < 1.0:
            kept_mass = tl.zeros([BLOCK_V], tl.float32)
            t_k = lo.to(tl.float32, bitcast=True)
            for start in range(0, V, BLOCK_V):
                in_row = (start + offs) < V
                x = tl.load(row_ptr + start + offs, mask=in_row, other=float("-inf")).to(tl.float32)
                w = tl.exp2((x - row_max) * scale)
                kept_mass += tl.where(in_row & (w >= t_k), w, 0.0)
            target = top_p * tl.sum(kept_mass, axis=0)
            lo = _largest_valid_threshold(row_ptr, V, row_max, scale, lo, tl.full([], _ONE_PLUS_ULP_BITS, tl.int32),
                                          target, True, BLOCK_V, NUM_PIVOTS)
        threshold = lo.to(tl.float32, bitcast=True)
        # Exponential race over the kept tokens.
        lane_key = tl.full([BLOCK_V], -1.0, tl.float32)
        lane_tok = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            in_row = idx < V
            x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf")).to(tl.float32)
            w = tl.exp2((x - row_max) * scale)
            uniform = tl.rand(seed, idx)
            key = w / (-tl.log(uniform))
            key = tl.where(in_row & (w >= threshold), key, -1.0)
            better = key > lane_key
            lane_tok = tl.where(better, idx, lane_tok)
            lane_key = tl.where(better, key, lane_key)
        best_key = tl.max(lane_key, axis=0)
        token = tl.min(tl.where(lane_key == best_key, lane_tok, V), axis=0).to(tl.int64)
    tl.store(out_ptr + row, token)


# ----------------------------------------------------------------------------- split-row sampling
# Thresholds of the "split" variant live in the order-preserving int32 image of the float32
# logits (see `_ordered_int`): comparing those ints compares the floats, and bisection over
# them is exact after at most ~32 / log2(NUM_PIVOTS - 1) passes. INT32_MIN is below every
# float's image and marks an empty candidate slot; it never counts towards a threshold.
_INT32_MIN: tl.constexpr = tl.constexpr(-2147483648)
# Per-row workspace layout (S chunks, K = NUM_CAND candidates per chunk), see `_sample_split`.
#   float32 [3S]: chunk max | chunk race winner's key | chunk mass sum exp2((x - chunk max) * s)
#   int32 [3S + 2SK + 1]: chunk first argmax | chunk race winner | chunk floor |
#                         candidates' ordered logits [S*K] | candidates' token ids [S*K] | needs-exact flag


@triton.jit
def _ordered_int(x):
    """float32 -> int32 with the same order (x < y  <=>  f(x) < f(y) for non-NaN floats)."""
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats order backwards by their bits: flip their 31 magnitude bits.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _float_of_ordered(o):
    bits = o ^ ((o >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _race_key(x, scale, seed, idx):
    """log2 of the exponential-race key w_i / E_i (up to a per-row constant): x_i * s - log2(E_i)."""
    uniform = tl.rand(seed, idx)
    return x * scale - tl.log2(-tl.log(uniform))


@triton.jit
def _ordered_tile(src_ptr, idx, n, FROM_LOGITS: tl.constexpr):
    """Ordered int32 values of src[idx] (INT32_MIN where idx >= n). FROM_LOGITS: src holds floats
    (a logits row); otherwise src already holds ordered ints (a candidate list)."""
    in_range = idx < n
    if FROM_LOGITS:
        x = tl.load(src_ptr + idx, mask=in_range, other=0.0).to(tl.float32)
        o = tl.where(in_range, _ordered_int(x), _INT32_MIN)
    else:
        o = tl.load(src_ptr + idx, mask=in_range, other=_INT32_MIN)
    return o


@triton.jit
def _largest_threshold(
    src_ptr, n, row_max, scale, lo, hi, target,
    USE_MASS: tl.constexpr, FROM_LOGITS: tl.constexpr, BLOCK: tl.constexpr, NUM_PIVOTS: tl.constexpr,
):
    """Largest ordered threshold t (int64, lo <= t < hi) with count{o >= t} >= target
    (USE_MASS False) or sum{w(o) : o >= t} >= target (USE_MASS True), w(o) = exp2((x - max) * s),
    over the n values at src_ptr. `lo` is taken as valid and `hi` as invalid."""
    offs = tl.arange(0, BLOCK)
    j = tl.arange(0, NUM_PIVOTS).to(tl.int64)
    while hi - lo > 1:
        # NUM_PIVOTS ascending pivots spread over [lo + 1, hi - 1], both ends included, so the
        # bracket shrinks at least (NUM_PIVOTS - 1)-fold per pass and never re-tests lo.
        pivots = lo + 1 + ((hi - lo - 2) * j) // (NUM_PIVOTS - 1)  # [NUM_PIVOTS] int64
        pivots32 = pivots.to(tl.int32)
        total = tl.zeros([NUM_PIVOTS], tl.float32)
        for start in range(0, n, BLOCK):
            o = _ordered_tile(src_ptr, start + offs, n, FROM_LOGITS)  # [BLOCK]
            above = o[None, :] >= pivots32[:, None]  # [NUM_PIVOTS, BLOCK]
            if USE_MASS:
                w = tl.exp2((_float_of_ordered(o) - row_max) * scale)
                total += tl.sum(tl.where(above, w[None, :], 0.0), axis=1)
            else:
                total += tl.sum(above.to(tl.float32), axis=1)
        valid = total >= target
        new_lo = tl.max(tl.where(valid, pivots, lo), axis=0)
        new_hi = tl.min(tl.where(valid, hi, pivots), axis=0)
        lo = new_lo
        hi = new_hi
    return lo


@triton.jit
def _sample_chunk_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    ws_f32_ptr,  # [B, f_stride] float32
    ws_i32_ptr,  # [B, i_stride] int32
    V,
    stride_row,
    num_chunks,
    f_stride,
    i_stride,
    CHUNK: tl.constexpr,
    NUM_CAND: tl.constexpr,
    USE_TOPK: tl.constexpr,  # tl.topk is available (cheaper than a full sort)
):
    """Stage 1, grid (B, S): per chunk of CHUNK logits, the max and its first index; then for a
    filtered row its NUM_CAND largest logits (the candidates) and its mass, for an unfiltered
    row its exponential-race winner."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = offs < V
    x = tl.load(logits_ptr + row * stride_row + offs, mask=in_row, other=float("-inf")).to(tl.float32)  # [CHUNK]
    f_row = ws_f32_ptr + row * f_stride
    i_row = ws_i32_ptr + row * i_stride
    chunk_max = tl.max(x, axis=0)
    tl.store(f_row + chunk, chunk_max)
    tl.store(i_row + chunk, tl.min(tl.where(in_row & (x == chunk_max), offs, _INT32_MAX), axis=0))
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0.0:
        scale = LOG2E / temperature
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        if ((top_k > 0) & (top_k < V)) | (top_p < 1.0):
            shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
            mass = tl.sum(tl.where(in_row, tl.exp2((x - shift) * scale), 0.0), axis=0)
            tl.store(f_row + 2 * num_chunks + chunk, mass)
            # One int64 key per token: ordered logit in the high word, (INT32_MAX - id) in the
            # low word, so a descending sort puts larger logits first and, among equal ones,
            # smaller token ids first.
            o = tl.where(in_row, _ordered_int(x), _INT32_MIN)
            key = (o.to(tl.int64) << 32) | (2147483647 - offs).to(tl.int64)  # [CHUNK]
            if USE_TOPK:
                ranked = tl.topk(key, NUM_CAND)  # [NUM_CAND]
                slot = tl.arange(0, NUM_CAND)
            else:
                ranked = tl.sort(key, descending=True)  # [CHUNK]; the first NUM_CAND are stored
                slot = tl.arange(0, CHUNK)
            cand_o = (ranked >> 32).to(tl.int32)
            cand_idx = tl.where(cand_o == _INT32_MIN, -1, 2147483647 - (ranked & 0x7FFFFFFF).to(tl.int32))
            stored = slot < NUM_CAND
            cand_base = i_row + 3 * num_chunks + chunk * NUM_CAND
            tl.store(cand_base + slot, cand_o, mask=stored)
            tl.store(cand_base + num_chunks * NUM_CAND + slot, cand_idx, mask=stored)
            # The chunk's floor: when it holds more than NUM_CAND tokens, every token above its
            # smallest candidate is a candidate, tokens equal to it may not be.
            n_tokens = tl.minimum(V - chunk * CHUNK, CHUNK)
            floor = tl.min(tl.where(stored, cand_o, _INT32_MAX), axis=0)
            tl.store(i_row + 2 * num_chunks + chunk, tl.where(n_tokens > NUM_CAND, floor, _INT32_MIN))
        else:
            seed = tl.load(seeds_ptr + row)
            race = tl.where(in_row, _race_key(x, scale, seed, offs), float("-inf"))
            best = tl.max(race, axis=0)
            tl.store(f_row + num_chunks + chunk, best)
            tl.store(i_row + num_chunks + chunk, tl.min(tl.where(in_row & (race == best), offs, _INT32_MAX), axis=0))


@triton.jit
def _sample_merge_kernel(
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    ws_f32_ptr,  # [B, f_stride] float32
    ws_i32_ptr,  # [B, i_stride] int32
    out_ptr,  # [B] int64
    V,
    num_chunks,
    f_stride,
    i_stride,
    NUM_CAND: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
    SORTED: tl.constexpr,  # all candidates fit one BLOCK_C tile: sort them instead of bisecting
):
    """Stage 2, grid (B,): merges a row's chunks. Greedy rows take the first argmax, unfiltered
    rows the race winner; filtered rows find the top-k / top-p thresholds on the candidates and
    race over them, or raise the row's needs-exact flag when the candidates cannot decide.
    SORTED: one descending sort of the candidates' values gives t_k as the k-th value and t_p
    as the value where the cumulative mass first reaches the target (one pass, no bisection)."""
    row = tl.program_id(0).to(tl.int64)
    f_row = ws_f32_ptr + row * f_stride
    i_row = ws_i32_ptr + row * i_stride
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_chunks
    chunk_max = tl.load(f_row + s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    row_max = tl.max(chunk_max, axis=0)
    first = tl.load(i_row + s, mask=s_mask, other=_INT32_MAX)
    token = tl.min(tl.where(s_mask & (chunk_max == row_max), first, _INT32_MAX), axis=0)
    n_cand = num_chunks * NUM_CAND
    needs_exact = tl.zeros([], tl.int32)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    if temperature > 0.0:
        scale = LOG2E / temperature
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        use_top_k = (top_k > 0) & (top_k < V)
        if use_top_k | (top_p < 1.0):
            cand_o_ptr = i_row + 3 * num_chunks
            cand_idx_ptr = cand_o_ptr + n_cand
            c = tl.arange(0, BLOCK_C)
            lo = tl.full([], _INT32_MIN, tl.int64)  # keeps every token
            top = _ordered_int(row_max).to(tl.int64) + 1  # no token reaches it
            if SORTED:
                ranked = tl.sort(_ordered_tile(cand_o_ptr, c, n_cand, False), descending=True)  # [BLOCK_C]
                if use_top_k:
                    # The k-th largest value: count{o >= it} >= k, and any larger value has < k.
                    lo = tl.max(tl.where(c == top_k - 1, ranked, _INT32_MIN), axis=0).to(tl.int64)
                if top_p < 1.0:
                    w = tl.where((ranked > _INT32_MIN) & (ranked.to(tl.int64) >= lo),
                                 tl.exp2((_float_of_ordered(ranked) - row_max) * scale), 0.0)
                    if use_top_k:
                        kept_mass = tl.sum(w, axis=0)
                    else:
                        chunk_mass = tl.load(f_row + 2 * num_chunks + s, mask=s_mask, other=0.0)
                        shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
                        kept_mass = tl.sum(tl.where(s_mask, chunk_mass * tl.exp2((shift - row_max) * scale), 0.0),
                                           axis=0)
                    # First rank whose cumulative mass reaches the target; its value is t_p (ties
                    # with it only add mass, and any larger value's prefix falls short).
                    reached = tl.cumsum(w, axis=0) >= top_p * kept_mass
                    first_rank = tl.min(tl.where(reached, c, BLOCK_C), axis=0)
                    t_p = tl.max(tl.where(c == first_rank, ranked, _INT32_MIN), axis=0).to(tl.int64)
                    lo = tl.maximum(lo, t_p)
            else:
                if use_top_k:
                    lo = _largest_threshold(cand_o_ptr, n_cand, row_max, scale, lo, top, top_k.to(tl.float32),
                                            False, False, BLOCK_C, NUM_PIVOTS)
                if top_p < 1.0:
                    if use_top_k:
                        lane_mass = tl.zeros([BLOCK_C], tl.float32)
                        for start in range(0, n_cand, BLOCK_C):
                            o = _ordered_tile(cand_o_ptr, start + c, n_cand, False)
                            kept = (o > _INT32_MIN) & (o.to(tl.int64) >= lo)
                            lane_mass += tl.where(kept, tl.exp2((_float_of_ordered(o) - row_max) * scale), 0.0)
                        kept_mass = tl.sum(lane_mass, axis=0)
                    else:
                        chunk_mass = tl.load(f_row + 2 * num_chunks + s, mask=s_mask, other=0.0)
                        shift = tl.where(chunk_max > float("-inf"), chunk_max, 0.0)
                        kept_mass = tl.sum(tl.where(s_mask, chunk_mass * tl.exp2((shift - row_max) * scale), 0.0), axis=0)
                    lo = _largest_threshold(cand_o_ptr, n_cand, row_max, scale, lo, top, top_p * kept_mass,
                                            True, False, BLOCK_C, NUM_PIVOTS)
            # Every token strictly above the highest chunk floor is a candidate, so a threshold
            # above it was decided on complete data (counts and masses above it are exact).
            floors = tl.load(i_row + 2 * num_chunks + s, mask=s_mask, other=_INT32_MIN)
            highest_floor = tl.max(floors, axis=0)
            if (highest_floor == _INT32_MIN) | (lo > highest_floor.to(tl.int64)):
                seed = tl.load(seeds_ptr + row)
                lane_key = tl.full([BLOCK_C], float("-inf"), tl.float32)
                lane_tok = tl.full([BLOCK_C], _INT32_MAX, tl.int32)
                for start in range(0, n_cand, BLOCK_C):
                    o = _ordered_tile(cand_o_ptr, start + c, n_cand, False)
                    idx = tl.load(cand_idx_ptr + start + c, mask=(start + c) < n_cand, other=-1)
                    kept = (idx >= 0) & (o.to(tl.int64) >= lo)
                    key = tl.where(kept, _race_key(_float_of_ordered(o), scale, seed, idx), float("-inf"))
                    better = kept & ((key > lane_key) | ((key == lane_key) & (idx < lane_tok)))
                    lane_tok = tl.where(better, idx, lane_tok)
                    lane_key = tl.where(better, key, lane_key)
                best_key = tl.max(lane_key, axis=0)
                token = tl.min(tl.where(lane_key == best_key, lane_tok, _INT32_MAX), axis=0)
            else:
                needs_exact = tl.full([], 1, tl.int32)
        else:
            race_key = tl.load(f_row + num_chunks + s, mask=s_mask, other=float("-inf"))
            race_tok = tl.load(i_row + num_chunks + s, mask=s_mask, other=_INT32_MAX)
            best_key = tl.max(race_key, axis=0)
            token = tl.min(tl.where(s_mask & (race_key == best_key), race_tok, _INT32_MAX), axis=0)
    tl.store(i_row + 3 * num_chunks + 2 * n_cand, needs_exact)
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _sample_exact_row_kernel(
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] float32
    seeds_ptr,  # [B] int64
    ws_i32_ptr,  # [B, i_stride] int32 (reads the needs-exact flag)
    out_ptr,  # [B] int64
    V,
    stride_row,
    flag_offset,
    i_stride,
    BLOCK_V: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    """Stage 3, grid (B,): rows whose flag stage 2 raised (their kept set reaches below the
    candidates) redo the threshold search over the whole row, one program per row; every
    other program returns at once."""
    row = tl.program_id(0).to(tl.int64)
    flag = tl.load(ws_i32_ptr + row * i_stride + flag_offset)
    if flag != 0:
        row_ptr = logits_ptr + row * stride_row
        offs = tl.arange(0, BLOCK_V)
        lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for start in range(0, V, BLOCK_V):
            x = tl.load(row_ptr + start + offs, mask=(start + offs) < V, other=float("-inf")).to(tl.float32)
            lane_max = tl.maximum(lane_max, x)
        row_max = tl.max(lane_max, axis=0)
        scale = LOG2E / tl.load(temperature_ptr + row).to(tl.float32)
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        lo = tl.full([], _INT32_MIN, tl.int64)
        top = _ordered_int(row_max).to(tl.int64) + 1
        if (top_k > 0) & (top_k < V):
            lo = _largest_threshold(row_ptr, V, row_max, scale, lo, top, top_k.to(tl.float32),
                                    False, True, BLOCK_V, NUM_PIVOTS)
        if top_p < 1.0:
            lane_mass = tl.zeros([BLOCK_V], tl.float32)
            for start in range(0, V, BLOCK_V):
                o = _ordered_tile(row_ptr, start + offs, V, True)
                kept = (o > _INT32_MIN) & (o.to(tl.int64) >= lo)
                lane_mass += tl.where(kept, tl.exp2((_float_of_ordered(o) - row_max) * scale), 0.0)
            lo = _largest_threshold(row_ptr, V, row_max, scale, lo, top, top_p * tl.sum(lane_mass, axis=0),
                                    True, True, BLOCK_V, NUM_PIVOTS)
        seed = tl.load(seeds_ptr + row)
        lane_key = tl.full([BLOCK_V], float("-inf"), tl.float32)
        lane_tok = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
        for start in range(0, V, BLOCK_V):
            idx = start + offs
            in_row = idx < V
            x = tl.load(row_ptr + idx, mask=in_row, other=float("-inf")).to(tl.float32)
            kept = in_row & (_ordered_int(x).to(tl.int64) >= lo)
            key = tl.where(kept, _race_key(x, scale, seed, idx), float("-inf"))
            better = kept & ((key > lane_key) | ((key == lane_key) & (idx < lane_tok)))
            lane_tok = tl.where(better, idx, lane_tok)
            lane_key = tl.where(better, key, lane_key)
        best_key = tl.max(lane_key, axis=0)
        token = tl.min(tl.where(lane_key == best_key, lane_tok, _INT32_MAX), axis=0)
        tl.store(out_ptr + row, token.to(tl.int64))


def _check_logits(op: str, logits: torch.Tensor) -> None:
    check_tensor(op, "logits", logits, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    check_runnable_device(op, logits)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits has an empty vocabulary dimension (shape {tuple(logits.shape)})")


def sampling_probs_ref(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The distribution each row samples from after temperature, top-k and top-p, float64 [B, V].
    Greedy rows (temperature <= 0) are one-hot at their argmax."""
    B, V = logits.shape
    probs = torch.zeros(B, V, dtype=torch.float64, device=logits.device)
    for b in range(B):
        x = logits[b].double()
        t = float(temperature[b])
        if t <= 0:
            probs[b, int(x.argmax())] = 1.0
            continue
        w = torch.exp((x - x.max()) / t)
        keep = torch.ones(V, dtype=torch.bool, device=logits.device)
        k = int(top_k[b])
        if 0 < k < V:
            keep &= w >= torch.topk(w, k).values[-1]
        p = float(top_p[b])
        if p < 1.0:
            kept = torch.where(keep, w, torch.zeros_like(w))
            ordered = kept.sort(descending=True).values
            cut = int(torch.searchsorted(ordered.cumsum(0), p * kept.sum()))
            keep &= w >= ordered[min(cut, V - 1)]
        w = torch.where(keep, w, torch.zeros_like(w))
        probs[b] = w / w.sum()
    return probs


def sample_ref(logits, temperature, top_k, top_p, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw tokens int64 [B] from `sampling_probs_ref` with torch.multinomial."""
    probs = sampling_probs_ref(logits, temperature, top_k, top_p)
    return torch.multinomial(probs.float(), 1, generator=generator).squeeze(1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Sample one token per row of logits [B, V] -> int64 [B].

    temperature [B] float32 (<= 0: greedy), top_k [B] int32 (0 or >= V: off), top_p [B]
    float32 in (0, 1] (1: off), seeds [B] int64 (Philox key of the row's draw).
    """
    config = _SAMPLE_PLANS.plan(_sample_checks, (logits, temperature, top_k, top_p, seeds, out), config)
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    if config.variant == "split":
        return _sample_split(logits, temperature, top_k, top_p, seeds, out, config)
    _sample_kernel[(B,)](
        logits, temperature, top_k, top_p, seeds, out, V, logits.stride(0),
        BLOCK_V=config["BLOCK_V"], NUM_PIVOTS=config["NUM_PIVOTS"],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


# (argument metadata, config) -> the config to run, see checks.LaunchPlans.
_SAMPLE_PLANS = LaunchPlans()


def _sample_checks(logits, temperature, top_k, top_p, seeds, out, config) -> KernelConfig:
    """All argument checks of sample(); returns the config to run (the default when None)."""
    op = "sample"
    _check_logits(op, logits)
    B, V = logits.shape
    device = logits.device
    check_tensor(op, "temperature", temperature, shape=(B,), dtypes=(torch.float32,), device=device)
    check_tensor(op, "top_k", top_k, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor(op, "top_p", top_p, shape=(B,), dtypes=(torch.float32,), device=device)
    check_tensor(op, "seeds", seeds, shape=(B,), dtypes=(torch.int64,), device=device)
    if out is not None:
        check_tensor(op, "out", out, shape=(B,), dtypes=(torch.int64,), device=device)
    return config if config is not None else SAMPLE_SPEC.default_config({"batch": B, "vocab": V}, device)


def split_workspace_ints(vocab: int, config: KernelConfig) -> int:
    """int32 workspace entries per row of the "split" variant; the last one is the row's flag."""
    num_chunks = cdiv(vocab, config["BLOCK_V"])
    return 3 * num_chunks + 2 * num_chunks * min(config["NUM_CAND"], config["BLOCK_V"]) + 1


# Stage 2 sorts a row's candidates in one program when they are at most this many (4032 at the
# H200 default: V = 128256 in 1024-token chunks x 32), else it bisects over them in tiles.
MERGE_SORT_MAX_CANDIDATES = 4096

# tl.topk (Triton >= 3.4) selects a chunk's candidates in fewer steps than a full sort.
_TL_HAS_TOPK = hasattr(tl, "topk")


def _sample_split(logits, temperature, top_k, top_p, seeds, out, config: KernelConfig,
                  ws_i32: torch.Tensor | None = None) -> torch.Tensor:
    """The "split" variant: three launches, no host syncs (CUDA-graph safe).

    stage 1, grid (B, S): S = cdiv(V, BLOCK_V) chunks per row, so batch 1 still fills the GPU;
    stage 2, grid (B,): merge; decides every row whose kept set lies within the candidates;
    stage 3, grid (B,): the exact one-program-per-row search, only for rows stage 2 flagged.
    `ws_i32` may be passed (int32 [B, >= split_workspace_ints(V, config)]) to read the
    per-row needs-exact flags (column split_workspace_ints - 1) afterwards.
    """
    B, V = logits.shape
    chunk, num_cand = config["BLOCK_V"], config["NUM_CAND"]
    num_chunks = cdiv(V, chunk)
    num_cand = min(num_cand, chunk)
    n_cand = num_chunks * num_cand
    f_stride = 3 * num_chunks
    flag_offset = 3 * num_chunks + 2 * n_cand
    i_stride = flag_offset + 1
    ws_f32 = torch.empty((B, f_stride), dtype=torch.float32, device=logits.device)
    if ws_i32 is None:
        ws_i32 = torch.empty((B, i_stride), dtype=torch.int32, device=logits.device)
    i_stride = ws_i32.stride(0)
    global _TL_HAS_TOPK
    use_topk = _TL_HAS_TOPK and num_cand > 1  # tl.topk rejects k=1
    sort_merge = next_power_of_2(n_cand) <= MERGE_SORT_MAX_CANDIDATES
    try:
        _sample_chunk_kernel[(B, num_chunks)](
            logits, temperature, top_k, top_p, seeds, ws_f32, ws_i32,
            V, logits.stride(0), num_chunks, f_stride, i_stride,
            CHUNK=chunk, NUM_CAND=num_cand, USE_TOPK=use_topk,
            num_warps=config.num_warps, num_stages=1,
        )
    except triton.CompilationError:
        if not use_topk:
            raise
        # A Triton whose tl.topk cannot compile this (int64 keys): use the full sort from now on.
        _TL_HAS_TOPK = False
        _sample_chunk_kernel[(B, num_chunks)](
            logits, temperature, top_k, top_p, seeds, ws_f32, ws_i32,
            V, logits.stride(0), num_chunks, f_stride, i_stride,
            CHUNK=chunk, NUM_CAND=num_cand, USE_TOPK=False,
            num_warps=config.num_warps, num_stages=1,
        )
    _sample_merge_kernel[(B,)](
        temperature, top_k, top_p, seeds, ws_f32, ws_i32, out,
        V, num_chunks, f_stride, i_stride,
        NUM_CAND=num_cand, BLOCK_S=max(2, next_power_of_2(num_chunks)),
        BLOCK_C=max(16, next_power_of_2(n_cand) if sort_merge else min(1024, next_power_of_2(n_cand))),
        NUM_PIVOTS=config["NUM_PIVOTS"], SORTED=sort_merge,
        num_warps=config.num_warps, num_stages=1,
    )
    _sample_exact_row_kernel[(B,)](
        logits, temperature, top_k, top_p, seeds, ws_i32, out,
        V, logits.stride(0), flag_offset, i_stride,
        BLOCK_V=chunk, NUM_PIVOTS=config["NUM_PIVOTS"],
        num_warps=config.num_warps, num_stages=1,
    )
    return out


def _sample_default(problem, key: str) -> KernelConfig:
    # Never a function of the batch size: which path decides a row (candidates or the exact
    # fallback) and so its draw must not depend on how many rows share the launch.
    if key == "interpreter":
        return KernelConfig.make("split", num_warps=4, num_stages=1, BLOCK_V=256, NUM_CAND=16, NUM_PIVOTS=16)
    # 1024-token chunks: 126 programs per row at V = 128256 (one wave on 132 SMs at batch 1);
    # 32 candidates per chunk: 4032 per row, far more than top-k / top-p usually keep.
    return KernelConfig.make("split", num_warps=8, num_stages=1, BLOCK_V=1024, NUM_CAND=32, NUM_PIVOTS=16)


def _sample_constraint(config: KernelConfig, problem) -> bool:
    return config.variant != "split" or config["NUM_CAND"] <= config["BLOCK_V"]


SAMPLE_SPEC = register(
    KernelSpec(
        op="sample",
        module=__name__,
        launcher=sample,
        reference=sampling_probs_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace("split", {"BLOCK_V": (256, 512, 1024, 2048), "NUM_CAND": (16, 32, 64),
                                       "NUM_PIVOTS": (8, 16, 32), "num_warps": (4, 8), "num_stages": (1,)},
                             "BLOCK_V-token chunks per program, NUM_CAND candidates each, merged per row; "
                             "rows the candidates cannot decide fall back to the exact per-row search"),
                VariantSpace("row", {"BLOCK_V": (256, 512, 1024, 2048, 4096), "NUM_PIVOTS": (4, 8, 16, 32),
                                     "num_warps": (4, 8, 16), "num_stages": (1,)},
                             "one program per row; NUM_PIVOTS thresholds tested per pass"),
            ),
            constraint=_sample_constraint,
        ),
        choose_default=_sample_default,
        problem_keys=("batch", "vocab"),
        doc=__doc__ or "",
    )
)
