"""Token sampling from logits: greedy argmax, and temperature / top-k / top-p sampling with
per-row parameters, without sorting the vocabulary.

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

Data flow, one program per row (grid (B,)):
  pass 1: max and first argmax of x;  pass 2: Z = sum w (skipped for greedy rows);
  threshold search: t_k and t_p are found by bisection on the IEEE-754 bit patterns of
    positive floats (monotone in the value), NUM_PIVOTS pivots per pass over the row, until
    the bracket is one float wide: the result is exact, not approximate;
  last pass: exponential race over the kept tokens with Philox uniforms from (seeds[row], i).
Randomness depends only on the row's seed and the token index, never on batch mates, so a
request's draws are reproducible whatever it is batched with; the engine passes a fresh seed
per request per step (drawn from the request's own torch.Generator).
`argmax()` is a separate split-vocabulary two-pass kernel for all-greedy batches, where one
program per row would leave most of the GPU idle at batch 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import check_runnable_device, check_tensor, next_power_of_2
from .registry import KernelConfig, KernelSpec, SearchSpace, VariantSpace, register

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


@triton.jit
def _argmax_partial_kernel(
    logits_ptr, partial_val_ptr, partial_idx_ptr, V, stride_row, chunk,
    NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    offs = tl.arange(0, BLOCK_V)
    start = split * chunk
    end = tl.minimum(start + chunk, V)
    lane_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    lane_idx = tl.full([BLOCK_V], _INT32_MAX, tl.int32)
    for tile in range(start, end, BLOCK_V):
        idx = tile + offs
        x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        better = x > lane_max
        lane_idx = tl.where(better, idx, lane_idx)
        lane_max = tl.where(better, x, lane_max)
    best = tl.max(lane_max, axis=0)
    tl.store(partial_val_ptr + row * NUM_SPLITS + split, best)
    tl.store(partial_idx_ptr + row * NUM_SPLITS + split, tl.min(tl.where(lane_max == best, lane_idx, _INT32_MAX), axis=0))


@triton.jit
def _argmax_reduce_kernel(partial_val_ptr, partial_idx_ptr, out_ptr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    mask = s < NUM_SPLITS
    vals = tl.load(partial_val_ptr + row * NUM_SPLITS + s, mask=mask, other=float("-inf"))
    idxs = tl.load(partial_idx_ptr + row * NUM_SPLITS + s, mask=mask, other=_INT32_MAX)
    best = tl.max(vals, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(vals == best, idxs, _INT32_MAX), axis=0).to(tl.int64))


def _check_logits(op: str, logits: torch.Tensor) -> None:
    check_tensor(op, "logits", logits, ndim=2, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    check_runnable_device(op, logits)
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits has an empty vocabulary dimension (shape {tuple(logits.shape)})")


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """First index of the maximum of each row, int64 [B]."""
    return logits.float().argmax(dim=-1)


def argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """Greedy sampling: first index of each row's maximum, logits [B, V] -> int64 [B]."""
    op = "argmax"
    _check_logits(op, logits)
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    check_tensor(op, "out", out, shape=(B,), dtypes=(torch.int64,), device=logits.device)
    if config is None:
        config = ARGMAX_SPEC.default_config({"batch": B, "vocab": V}, logits.device)
    if B == 0:
        return out
    splits, block_v = config["NUM_SPLITS"], config["BLOCK_V"]
    chunk = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    vals = torch.empty((B, splits), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((B, splits), dtype=torch.int32, device=logits.device)
    _argmax_partial_kernel[(B, splits)](logits, vals, idxs, V, logits.stride(0), chunk,
                                        NUM_SPLITS=splits, BLOCK_V=block_v, num_warps=config.num_warps)
    _argmax_reduce_kernel[(B,)](vals, idxs, out, NUM_SPLITS=splits, BLOCK_S=max(2, next_power_of_2(splits)))
    return out


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
    op = "sample"
    _check_logits(op, logits)
    B, V = logits.shape
    device = logits.device
    check_tensor(op, "temperature", temperature, shape=(B,), dtypes=(torch.float32,), device=device)
    check_tensor(op, "top_k", top_k, shape=(B,), dtypes=(torch.int32,), device=device)
    check_tensor(op, "top_p", top_p, shape=(B,), dtypes=(torch.float32,), device=device)
    check_tensor(op, "seeds", seeds, shape=(B,), dtypes=(torch.int64,), device=device)
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=device)
    check_tensor(op, "out", out, shape=(B,), dtypes=(torch.int64,), device=device)
    if config is None:
        config = SAMPLE_SPEC.default_config({"batch": B, "vocab": V}, device)
    if B == 0:
        return out
    _sample_kernel[(B,)](
        logits, temperature, top_k, top_p, seeds, out, V, logits.stride(0),
        BLOCK_V=config["BLOCK_V"], NUM_PIVOTS=config["NUM_PIVOTS"],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def _sample_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("row", num_warps=4, num_stages=1, BLOCK_V=256, NUM_PIVOTS=16)
    return KernelConfig.make("row", num_warps=8, num_stages=1, BLOCK_V=1024, NUM_PIVOTS=16)


def _argmax_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("split", num_warps=4, num_stages=1, BLOCK_V=512, NUM_SPLITS=2)
    batch, vocab = int(problem["batch"]), int(problem["vocab"])
    # Split the vocabulary until there are ~2 programs per SM, each reading >= 8 KB.
    splits = 1
    while batch * splits < 264 and vocab // (splits * 2) >= 2048 and splits < 128:
        splits *= 2
    return KernelConfig.make("split", num_warps=4, num_stages=1, BLOCK_V=1024, NUM_SPLITS=splits)


SAMPLE_SPEC = register(
    KernelSpec(
        op="sample",
        module=__name__,
        launcher=sample,
        reference=sampling_probs_ref,
        search_space=SearchSpace(
            variants=(
                VariantSpace("row", {"BLOCK_V": (256, 512, 1024, 2048, 4096), "NUM_PIVOTS": (4, 8, 16, 32),
                                     "num_warps": (4, 8, 16), "num_stages": (1,)},
                             "one program per row; NUM_PIVOTS thresholds tested per pass"),
            ),
        ),
        choose_default=_sample_default,
        problem_keys=("batch", "vocab"),
        doc=__doc__ or "",
    )
)

ARGMAX_SPEC = register(
    KernelSpec(
        op="argmax",
        module=__name__,
        launcher=argmax,
        reference=argmax_ref,
        search_space=SearchSpace(
            variants=(
                VariantSpace("split", {"BLOCK_V": (512, 1024, 2048, 4096), "NUM_SPLITS": (1, 2, 4, 8, 16, 32, 64, 128),
                                       "num_warps": (4, 8), "num_stages": (1,)},
                             "vocabulary split over NUM_SPLITS programs per row, then merged"),
            ),
        ),
        choose_default=_argmax_default,
        problem_keys=("batch", "vocab"),
        doc=__doc__ or "",
    )
)
