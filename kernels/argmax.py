"""Greedy sampling: the first index of each row's maximum, logits [B, V] -> int64 [B].

A split-vocabulary two-pass kernel for all-greedy batches, where one program per row (as in
kernels/sampling.py's row search) would leave most of the GPU idle at batch 1:
  pass 1, grid (B, NUM_SPLITS): each program scans its chunk of the row (BLOCK_V lanes, each
    keeping its running max and the first index reaching it) -> the chunk's max and first argmax;
  pass 2, grid (B,): the first split index among the chunks that hold the row's max.
Ties resolve to the lowest index, as torch.argmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import cdiv, check_tensor, next_power_of_2, pdl_options
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.sampling import _INT32_MAX, _check_logits
from shapeshift.kernels.triton_helpers import grid_dependency_sync


@triton.jit
def _argmax_partial_kernel(
    logits_ptr, partial_val_ptr, partial_idx_ptr, V, stride_row, chunk,
    NUM_SPLITS: tl.constexpr, BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_sync(USE_PDL)
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
def _argmax_reduce_kernel(partial_val_ptr, partial_idx_ptr, out_ptr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    grid_dependency_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    mask = s < NUM_SPLITS
    vals = tl.load(partial_val_ptr + row * NUM_SPLITS + s, mask=mask, other=float("-inf"))
    idxs = tl.load(partial_idx_ptr + row * NUM_SPLITS + s, mask=mask, other=_INT32_MAX)
    best = tl.max(vals, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(vals == best, idxs, _INT32_MAX), axis=0).to(tl.int64))


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
    chunk = cdiv(cdiv(V, splits), block_v) * block_v
    vals = torch.empty((B, splits), dtype=torch.float32, device=logits.device)
    idxs = torch.empty((B, splits), dtype=torch.int32, device=logits.device)
    pdl = pdl_options(logits.device, "sampling")
    _argmax_partial_kernel[(B, splits)](logits, vals, idxs, V, logits.stride(0), chunk,
                                        NUM_SPLITS=splits, BLOCK_V=block_v, num_warps=config.num_warps, **pdl)
    _argmax_reduce_kernel[(B,)](vals, idxs, out, NUM_SPLITS=splits, BLOCK_S=max(2, next_power_of_2(splits)), **pdl)
    return out


def _argmax_default(problem, key: str) -> KernelConfig:
    if key == "interpreter":
        return KernelConfig.make("split", num_warps=4, num_stages=1, BLOCK_V=512, NUM_SPLITS=2)
    batch, vocab = int(problem["batch"]), int(problem["vocab"])
    # Split the vocabulary until every program reads its chunk in one BLOCK_V load (the loop's
    # loads wait for each other: at batch 1 on an H200, 32 programs of 4 x 1024 logits took 5.0 us
    # a step), or there are ~2 programs per SM.
    block_v, splits = 2048, 1
    while batch * splits < 264 and cdiv(vocab, splits) > block_v and splits < 128:
        splits *= 2
    return KernelConfig.make("split", num_warps=4, num_stages=1, BLOCK_V=block_v, NUM_SPLITS=splits)


ARGMAX_SPEC = register(
    KernelSpec(
        op="argmax",
        module=__name__,
        launcher=argmax,
        reference=argmax_ref,
        config_space=KernelConfigSpace(
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
