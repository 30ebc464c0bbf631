"""Batch-1 decode: a layer's o_proj, its MLP and the next layer's qkv projection in one
persistent kernel, with grid-wide barriers between the four weight streams.

Math (one token, dense Llama-family layer, rounding points of the unfused GEMV path):
    y1   = attn @ Wo^T                                     phase 1   [H]
    h2   = y1 + res                 (written to res2)
    act  = silu(rms(h2) * post_w @ Wg^T) * (... @ Wu^T)    phase 2   [I]
    y3   = act @ Wd^T                                      phase 3   [H]
    h3   = y3 + h2                  (written to res3)
    qkv  = rms(h3) * in_w @ Wqkv^T (+ bias)                phase 4   [NQKV]  (the next layer's)
The launcher returns (qkv, res3) with the next layer's weights, else (y3, res2) for the final
norm and the lm_head. decode_layer puts the layer's attention in front as phase 0 (rotary, the
KV-cache write and split attention, kernels/decode_attention.py's pass 1 per (kv head, split)
item; phase 1 merges the splits as it reads its input): one launch a layer instead of two or
three, measured slower on the H200 (47.5 against 44.7 us a layer at 256 tokens, see
docs/decode-performance.md), so the recipe knob fuse_attention_into_layer is off in `fast`.
decode_layer_tail(..., next_attention=) instead ends the launch with the next layer's attention
as phase 5 (the programs holding a (kv head, split) item, each kv head merged by its last
split), returning that attention's output: also slower there (46.6 against 44.2 us a layer),
so fuse_attention_into_tail is off too.

Why one kernel, how a phase streams its weights, and the residency rules the barriers rest on:
kernels/PERFORMANCE.md, "The layer-tail kernel" (with the measurements behind the defaults).
The device code is kernels/decode_layer_tail_kernel.py; this module plans and launches it.
Under the Triton interpreter programs run one after another, so there (and whenever
``sync=False``) the launcher runs each phase as a launch of its own; the arithmetic is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from shapeshift.kernels.checks import (FLOAT_DTYPES, LaunchPlans, StreamCounters, check_runnable_device, check_same_dtype, check_tensor,
                     interpreter_active, next_power_of_2, pdl_options)
from shapeshift.kernels.decode_attention import LOG2E, attention_plan, decode_attention_rope_ref, rope_plan
from shapeshift.kernels.decode_layer_tail_kernel import _decode_layer_tail_kernel
from shapeshift.kernels.gemv import gemv_ref, gemv_silu_and_mul_ref
from shapeshift.kernels.rmsnorm import rmsnorm_ref
from shapeshift.kernels.triton_helpers import SM_SLOT, STAMP_SLOTS  # noqa: F401  (the stamp layout, read by the benchmark and tests)

# Defaults: the fastest of hack/bench_layer_tail.py's sweep on an H200: 40.7 us a layer (70% of copy
# bandwidth) against 45.2 for one 16-warp program per SM with 32 KB tiles and 48.6 for the fast
# recipe's four GEMV launches (bench/results/layer-tail-llama-3.2-1b-shape-nvidia-h200-20261130T030628Z.json).
TILE_ELEMENTS = 8192  # weight elements per row tile: 16 KB of bf16
NUM_WARPS = 8  # 256 threads: a 16 KB tile is 64 bytes (4 vector loads) per thread
PROGRAMS_PER_SM = 2  # two programs hide each other's reductions and barrier waits (when both fit)
# Barriers: arrive before loading the next phase's first tiles, wait after (40.29 -> 38.78 us a
# layer, layer-tail-llama-3.2-1b-shape-nvidia-h200-20261130T052122Z.json).
SPLIT_BARRIER = True
# Of each weight's first two row tiles of phases 2-4, how many load between a program's arrival at
# the barrier in front of the phase and its wait there (the rest load after the wait).
EARLY_TILES = 2


MAX_NEXT_ATTENTION_KV_HEADS = 64
# Barrier counters [arrivals, exits, phase 5's merge counters]: one set per stream serves every
# layer (kernels on one stream never overlap); allocated at full size once, so a CUDA graph keeps
# the address it captured.
_COUNTERS = StreamCounters(2 + MAX_NEXT_ATTENTION_KV_HEADS)


def _resident_per_sm(args: tuple, meta: dict, phases: tuple[int, int], attention: dict) -> int:
    """Programs of this compiled variant one SM holds at once (registers, threads, shared memory);
    compiles the variant (the launch that follows reuses it)."""
    device = args[0].device
    kernel = _decode_layer_tail_kernel.warmup(*args, grid=(meta["G"],), FIRST=phases[0], LAST=phases[1], **meta,
                                              **attention)
    try:
        kernel._init_handles()  # loads the module, which fills n_regs (Triton 3.x)
        registers = int(kernel.n_regs)
    except (AttributeError, TypeError, ValueError):
        registers = 0
    if registers <= 0:  # a Triton that does not say: assume only one program per SM fits
        return 1
    props = torch.cuda.get_device_properties(device)
    return programs_per_sm(registers, meta["num_warps"], int(getattr(kernel.metadata, "shared", 0) or 0),
                           regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                           threads_per_sm=props.max_threads_per_multi_processor,
                           shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))


def programs_per_sm(registers: int, num_warps: int, shared_bytes: int = 0, *, regs_per_sm: int = 65536,
                    threads_per_sm: int = 2048, shared_per_sm: int = 228 * 1024) -> int:
    """Programs of a compiled variant (registers a thread, warps, shared memory) one SM holds at
    once; the defaults are an H100/H200 SM's. Registers are allocated 8 a thread at a time."""
    threads = num_warps * 32
    per_sm = min(regs_per_sm // (-(-registers // 8) * 8 * threads), threads_per_sm // threads)
    if shared_bytes:
        per_sm = min(per_sm, shared_per_sm // shared_bytes)
    return per_sm


def default_programs(device: torch.device) -> int:
    """One program per SM on CUDA (the launcher doubles it where two fit: PROGRAMS_PER_SM); 3
    in the interpreter, enough to exercise the tile striding."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 3


def decode_layer_tail(
    attn: torch.Tensor,
    residual: torch.Tensor,
    o_proj: torch.Tensor,
    post_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down_proj: torch.Tensor,
    eps: float,
    next_input_norm: torch.Tensor | None = None,
    next_qkv: torch.Tensor | None = None,
    next_qkv_bias: torch.Tensor | None = None,
    *,
    programs: int | None = None,
    sync: bool | None = None,
    num_warps: int = NUM_WARPS,
    tile_elements: int = TILE_ELEMENTS,
    split_barrier: bool = SPLIT_BARRIER,
    timestamps: torch.Tensor | None = None,
    next_attention: NextAttention | None = None,
    early_tiles: int = EARLY_TILES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's layer tail (see the module doc).

    attn [1, QD] (attention output), residual [1, H] (the layer's residual stream), o_proj
    [H, QD], post_norm [H], gate_up [2I, H] (= [gate; up]), down_proj [H, I]; with the next
    layer's next_input_norm [H] and next_qkv [NQKV, H] (+ next_qkv_bias [NQKV]) returns
    (qkv [1, NQKV], residual_out [1, H]), else (mlp_out [1, H], residual_out [1, H]) where
    residual_out is the residual stream after attention (mlp_out + residual_out is the layer's
    output). ``sync`` (default: on CUDA outside the interpreter) runs the four phases in one
    launch with grid barriers; otherwise each phase is a launch. ``num_warps`` and
    ``tile_elements`` (weight elements per row tile) are the kernel's tile knobs;
    hack/bench_layer_tail.py measures them with ``programs``. Under programmatic dependent launch (SHAPESHIFT_PDL naming "layer_tail",
    one launch with barriers only) the first weight tiles load before the grid-dependency wait.
    ``split_barrier``: each program arrives at a barrier before it loads the next phase's first
    tiles and waits after, instead of arriving after the loads are issued. ``early_tiles`` (0-2):
    how many of those first two tiles (of each weight) load before the wait, the rest after it.
    ``timestamps`` (CUDA, int64 [>= programs, STAMP_SLOTS]): each program writes its phases'
    begin and end times there (the benchmark's per-phase breakdown; see _stamp).
    ``next_attention`` (with the next layer's weights): the next layer's attention runs as a
    fifth phase on the qkv row phase 4 writes (rotary, the write of the new key and value to the
    next layer's caches, split attention, each kv head's splits merged by its last split), and
    the launcher returns (attn [1, QD], residual_out): the next layer's attention output, the
    input of its own tail. One launch a layer instead of two.
    """
    attention_tensors, scale, splits = (None,) * 7, 1.0, None
    if next_attention is not None:
        if not isinstance(next_attention, NextAttention):
            raise ValueError("decode_layer_tail: next_attention must be a NextAttention")
        attention_tensors, scale, splits = next_attention[:7], next_attention.scale, next_attention.splits
    return _launch(attn, residual, o_proj, post_norm, gate_up, down_proj, eps, next_input_norm, next_qkv,
                   next_qkv_bias, attention_tensors, scale,
                   _Options(programs, sync, num_warps, tile_elements, split_barrier, timestamps is not None,
                            use_pdl=pdl_options(attn.device, "layer_tail")["USE_PDL"],
                            next_attention=next_attention is not None, attention_splits=splits,
                            early_tiles=early_tiles),
                   timestamps)


class NextAttention(NamedTuple):
    """The next layer's attention for decode_layer_tail's phase 5: its caches [num_blocks,
    block_size, HKV, D] (D a power of two >= 16, HKV <= MAX_NEXT_ATTENTION_KV_HEADS), and the step's
    tensors as decode_attention_rope takes them: positions [1], cos_sin_cache [max_position, D]
    float32, slot_mapping [1] (negative: no cache write), block_tables [1, M] int32, context_lens
    [1] int32 (counting the new token); ``splits``: a power of two <= MAX_NEXT_ATTENTION_SPLITS
    (default: decode attention's own default for the shape)."""
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    splits: int | None = None


# Phase 5 merges in the last split of each kv head (decode attention's MERGE_LAST), so splits cost
# one merge a head, not one a program as in decode_layer's phase 1.
MAX_NEXT_ATTENTION_SPLITS = 32


def decode_layer(
    qkv: torch.Tensor,
    residual: torch.Tensor,
    o_proj: torch.Tensor,
    post_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down_proj: torch.Tensor,
    eps: float,
    next_input_norm: torch.Tensor | None = None,
    next_qkv: torch.Tensor | None = None,
    next_qkv_bias: torch.Tensor | None = None,
    *,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    attention_splits: int | None = None,
    programs: int | None = None,
    sync: bool | None = None,
    num_warps: int = NUM_WARPS,
    tile_elements: int = TILE_ELEMENTS,
    early_o_proj_tiles: bool = False,
    split_barrier: bool = SPLIT_BARRIER,
    timestamps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token's whole layer: decode_attention_rope's work as phase 0 (rotary, the KV
    write, attention over the paged cache) in front of decode_layer_tail's four phases, one
    launch with five barriers-separated phases (on CUDA outside the interpreter).

    qkv [1, HQ*D + 2*HKV*D]: this layer's un-rotated projections (q | k | v); the caches
    [num_blocks, block_size, HKV, D] (D a power of two >= 16), block_tables [1, M] int32,
    context_lens [1] int32 (counting the new token), positions [1], slot_mapping [1] (negative:
    no cache write), cos_sin_cache [max_position, D] float32 (kernels.rotary). Writes the rotated
    key and the value to the caches; returns what decode_layer_tail returns. ``attention_splits``
    (a power of two <= MAX_ATTENTION_SPLITS) cuts each kv head's context into that many slices
    run by different programs; every program merges them as phase 1 reads its input (default:
    default_layer_splits: decode attention's batch-1 default, capped). ``early_o_proj_tiles``:
    every program loads its first two o_proj tiles before the barrier that ends the attention
    phase (HBM busy during attention) rather than after it (default: attention's loads alone in
    HBM's queues; on the H200 a 3.8 against 5.4 us attention phase, 47.5 against 48.1 us a
    layer). ``split_barrier`` and ``timestamps`` as decode_layer_tail's.
    """
    return _launch(qkv, residual, o_proj, post_norm, gate_up, down_proj, eps, next_input_norm, next_qkv,
                   next_qkv_bias, (positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables,
                                   context_lens), scale,
                   _Options(programs, sync, num_warps, tile_elements, split_barrier, timestamps is not None,
                            attention=True, attention_splits=attention_splits,
                            early_o_proj_tiles=early_o_proj_tiles), timestamps)


# Phase 1 of decode_layer merges every query head's split partials in every program (Hq x S x D
# float32 read from L2 per program): more splits make phase 0 shorter and that merge longer.
MAX_ATTENTION_SPLITS = 8


def default_layer_splits(attention_default: int, tiles: int) -> int:
    """decode_layer's split count when none is asked: decode attention's default, at most
    MAX_ATTENTION_SPLITS and at most the context's tiles rounded down to a power of two. Decode
    attention itself rounds the tiles up (its merge runs once, in the last split's program, so
    an empty split costs it little); here every program merges every split, so an empty split
    is paid 264 times."""
    fit = 1 << (max(1, tiles).bit_length() - 1)
    return min(attention_default, MAX_ATTENTION_SPLITS, fit)


def _launch(first_input, residual, o_proj, post_norm, gate_up, down_proj, eps, next_input_norm, next_qkv,
            next_qkv_bias, attention_tensors, scale, options, timestamps):
    plan = _PLANS.plan(_plan, (first_input, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm,
                               next_qkv, next_qkv_bias, *attention_tensors), options)
    outputs = _outputs(plan, first_input)
    # Phase 5 merges through counters even when each phase is a launch of its own.
    counters = _launch_counters(first_input.device) if plan.sync or plan.next_attention else outputs[0]
    args = _kernel_args(plan, first_input, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm,
                        next_qkv, next_qkv_bias, outputs, counters, eps)
    attention = _attention_args(plan, first_input, attention_tensors, outputs, scale)
    if timestamps is not None:
        _check_timestamps(timestamps, plan, first_input.device)
        if not plan.sync:
            raise ValueError("timestamps need the phases in one launch (sync): a launch per phase would overwrite "
                             "each program's kernel-start stamp")
        attention["stamps_ptr"] = timestamps
    for first, final in plan.phases:
        _decode_layer_tail_kernel[(plan.programs,)](*args, FIRST=first, LAST=final, **plan.meta, **attention)
    y1, res2, act, y3, res3, qkv = outputs[:6]
    if plan.next_attention:
        return outputs[6], res3
    return (qkv, res3) if plan.has_next else (y3, res2)


@dataclass(frozen=True)
class _Plan:
    """What a launch on one argument metadata needs, derived (and checked) once; the shapes are
    the kernel's constexprs (meta)."""
    has_next: bool
    sync: bool
    programs: int
    phases: tuple[tuple[int, int], ...]
    meta: dict
    attention: dict | None  # decode_layer's phase 0 or the tail's phase 5: constexprs and strides

    hidden = property(lambda self: self.meta["H"])
    q_dim = property(lambda self: self.meta["QD"])
    inner = property(lambda self: self.meta["INNER"])
    nqkv = property(lambda self: self.meta["NQKV"])
    next_attention = property(lambda self: self.phases[-1][1] == 5)
    attention_first = property(lambda self: self.phases[0][0] == 0)  # decode_layer's phase 0


class _Options(NamedTuple):
    """A launch's options (part of its plan's key, with the arguments' metadata)."""
    programs: int | None
    sync: bool | None
    num_warps: int
    tile_elements: int
    split_barrier: bool
    timing: bool
    use_pdl: bool = False  # decode_layer_tail only
    attention: bool = False  # decode_layer: phase 0 runs the attention
    attention_splits: int | None = None
    early_o_proj_tiles: bool = False
    next_attention: bool = False  # decode_layer_tail: phase 5 runs the next layer's attention
    early_tiles: int = EARLY_TILES


# (argument metadata, launch options) -> _Plan, see checks.LaunchPlans.
_PLANS = LaunchPlans()


def _plan(first_input, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv, next_qkv_bias,
          positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables, context_lens,
          options: _Options) -> _Plan:
    """Every argument check, the kernel's constexprs and the grid (with its residency check)."""
    programs, sync, num_warps, tile_elements = options.programs, options.sync, options.num_warps, options.tile_elements
    has_attention, timing = options.attention, options.timing
    op = "decode_layer" if has_attention else "decode_layer_tail"
    first_name = "qkv" if has_attention else "attn"
    check_tensor(op, first_name, first_input, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check_runnable_device(op, first_input)
    if first_input.shape[0] != 1:
        raise ValueError(f"{op}: serves one token (batch-1 decode), got {first_name} with {first_input.shape[0]} rows")
    device = first_input.device
    check_tensor(op, "o_proj", o_proj, ndim=2, device=device, contiguous=True)
    hidden, qd = o_proj.shape
    if not has_attention:
        check_tensor(op, "o_proj", o_proj, shape=(hidden, first_input.shape[1]), device=device, contiguous=True)
    check_tensor(op, "residual", residual, shape=(1, hidden), device=device, contiguous=True)
    check_tensor(op, "post_norm", post_norm, shape=(hidden,), device=device, contiguous=True)
    check_tensor(op, "gate_up", gate_up, ndim=2, device=device, contiguous=True)
    if gate_up.shape[1] != hidden or gate_up.shape[0] % 2:
        raise ValueError(f"{op}: gate_up must be [2I, {hidden}] (= [gate; up]), got {tuple(gate_up.shape)}")
    inner = gate_up.shape[0] // 2
    check_tensor(op, "down_proj", down_proj, shape=(hidden, inner), device=device, contiguous=True)
    check_same_dtype(op, first_name, first_input, residual=residual, o_proj=o_proj, post_norm=post_norm,
                     gate_up=gate_up, down_proj=down_proj)
    has_next = next_qkv is not None
    if has_next != (next_input_norm is not None) or (next_qkv_bias is not None and not has_next):
        raise ValueError(f"{op}: next_input_norm and next_qkv come together (next_qkv_bias only with them)")
    nqkv = 1
    if has_next:
        check_tensor(op, "next_input_norm", next_input_norm, shape=(hidden,), device=device, contiguous=True)
        check_tensor(op, "next_qkv", next_qkv, ndim=2, device=device, contiguous=True)
        nqkv = next_qkv.shape[0]
        check_tensor(op, "next_qkv", next_qkv, shape=(nqkv, hidden), device=device, contiguous=True)
        check_same_dtype(op, first_name, first_input, next_input_norm=next_input_norm, next_qkv=next_qkv)
        if next_qkv_bias is not None:
            check_tensor(op, "next_qkv_bias", next_qkv_bias, shape=(nqkv,), device=device, contiguous=True)
            check_same_dtype(op, first_name, first_input, next_qkv_bias=next_qkv_bias)
    attention = None
    if has_attention:
        attention = _attention_plan(op, first_input, qd, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                                    block_tables, context_lens, options.attention_splits)
    if options.next_attention:
        attention = _next_attention_plan(op, first_input, has_next, qd, nqkv, positions, cos_sin_cache, slot_mapping,
                                         k_cache, v_cache, block_tables, context_lens, options.attention_splits)
    if options.early_tiles not in (0, 1, 2):
        raise ValueError(f"{op}: early_tiles must be 0, 1 or 2, got {options.early_tiles!r}")
    if sync is None:
        sync = device.type == "cuda" and not interpreter_active()

    def rows(k: int) -> int:  # rows per tile: whole rows, tile_elements elements (a power of two)
        return max(1, next_power_of_2(tile_elements) // next_power_of_2(k))

    G = programs or default_programs(device)
    first = 0 if has_attention else 1
    last = 5 if options.next_attention else 4 if has_next else 3
    # PDL's launch options whole (USE_PDL and launch_pdl), for the tail in one launch only.
    pdl = pdl_options(device, "layer_tail") if (options.use_pdl and sync and not has_attention) else {"USE_PDL": False}
    meta = dict(H=hidden, QD=qd, INNER=inner, NQKV=nqkv, HP=next_power_of_2(hidden), QDP=next_power_of_2(qd),
                IP=next_power_of_2(inner), BN_O=rows(qd), BN_GU=max(1, rows(hidden) // 2), BN_D=rows(inner),
                BN_QKV=rows(hidden), G=G, SYNC=sync, HAS_QKV_BIAS=next_qkv_bias is not None, num_warps=num_warps,
                EARLY_O=bool(options.early_o_proj_tiles), TIMING=bool(timing),
                SPLIT_BARRIER=bool(options.split_barrier), EARLY_TILES=int(options.early_tiles),
                **pdl)
    if timing and interpreter_active():
        raise ValueError(f"{op}: timestamps read the GPU clock (%globaltimer): CUDA only, not the interpreter")
    phases = ((first, last),) if sync else tuple((p, p) for p in range(first, last + 1))
    plan = _Plan(has_next, sync, G, phases, meta, attention)
    if sync and device.type == "cuda":
        # Compile the variant (once per plan) to read what one SM holds: PROGRAMS_PER_SM programs
        # where they fit, else one per SM; an explicit grid that cannot be resident is refused.
        outputs = _outputs(plan, first_input)
        args = _kernel_args(plan, first_input, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm,
                            next_qkv, next_qkv_bias, outputs, _launch_counters(device), 1e-6)
        extra = _attention_args(plan, first_input, (positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                                                    block_tables, context_lens), outputs, 1.0)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if timing:
            extra["stamps_ptr"] = torch.empty((G * PROGRAMS_PER_SM, STAMP_SLOTS), dtype=torch.int64, device=device)
        doubled = dict(meta, G=G * PROGRAMS_PER_SM)
        if programs is None and _resident_per_sm(args, doubled, phases[0], extra) >= PROGRAMS_PER_SM:
            G = G * PROGRAMS_PER_SM
            plan = replace(plan, programs=G, meta=dict(meta, G=G))
        per_sm = _resident_per_sm(args, plan.meta, phases[0], extra)
        if G > per_sm * sms:
            raise ValueError(f"{op}: {G} programs cannot all be resident ({per_sm} per SM fit by registers x "
                             f"{sms} SMs); the grid barriers need them all at once")
    return plan


def head_dim_problem(head_dim: int) -> str | None:
    """Why decode_layer cannot take this head_dim, or None: phase 1 reads the heads' outputs as one
    [next_power_of_2(Hq) * D] vector, so D must be a power of two (and >= 16 for the dots)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim must be a power of two >= 16 (phase 1 reads the heads as one vector), got {head_dim}"
    return None


def _next_attention_plan(op, attn, has_next, qd, nqkv, positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
                         block_tables, context_lens, splits) -> dict:
    """Phase 5's checks and constexprs: decode_layer's phase-0 plan on the qkv row phase 4 writes,
    with decode attention's own default split count (the merge runs once a kv head)."""
    if not has_next:
        raise ValueError(f"{op}: next_attention needs the next layer's next_input_norm and next_qkv")
    check_tensor(op, "next_attention.k_cache", k_cache, ndim=4, device=attn.device)
    hkv, head_dim = k_cache.shape[2], k_cache.shape[3]
    if hkv > MAX_NEXT_ATTENTION_KV_HEADS:
        raise ValueError(f"{op}: next_attention takes at most {MAX_NEXT_ATTENTION_KV_HEADS} kv heads (its merge "
                         f"counters), the cache has {hkv}")
    if nqkv != qd + 2 * hkv * head_dim:
        raise ValueError(f"{op}: next_qkv has {nqkv} rows; the next layer's attention needs q | k | v = {qd} + 2 x "
                         f"{hkv} x {head_dim}")
    qkv = torch.empty((1, nqkv), dtype=attn.dtype, device=attn.device)  # phase 4's output, for the planners
    return _attention_plan(op, qkv, qd, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables,
                           context_lens, splits, merge_each_program=False)


def _attention_plan(op, qkv, qd, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables,
                    context_lens, splits, merge_each_program: bool = True) -> dict:
    """decode_layer's phase-0 checks and constexprs: decode_attention_rope's own (its planners run
    on q, k and v as views of the qkv row), plus the qkv width and the split count;
    merge_each_program (phase 0: phase 1 merges the splits in every program) caps the splits at
    MAX_ATTENTION_SPLITS, else (phase 5, merged once a kv head) at MAX_NEXT_ATTENTION_SPLITS with
    decode attention's default."""
    check_tensor(op, "k_cache", k_cache, ndim=4, device=qkv.device)
    hkv, head_dim = k_cache.shape[2], k_cache.shape[3]
    problem = head_dim_problem(head_dim)
    if problem:
        raise ValueError(f"{op}: {problem}")
    if hkv == 0 or qd % head_dim:
        raise ValueError(f"{op}: o_proj's input width {qd} is not a multiple of the cache's head_dim {head_dim}")
    check_tensor(op, "qkv", qkv, shape=(1, qd + 2 * hkv * head_dim), device=qkv.device, contiguous=True)
    q, k_new, v_new = (t.view(1, -1, head_dim) for t in qkv.split([qd, hkv * head_dim, hkv * head_dim], dim=-1))
    _, strides, _, block_size, default_splits, constexprs, _, _ = attention_plan(q, k_cache, v_cache, block_tables,
                                                                                 context_lens, None, None)
    rope = rope_plan(q, k_new, v_new, positions, cos_sin_cache, slot_mapping, k_cache, None)
    most = MAX_ATTENTION_SPLITS if merge_each_program else MAX_NEXT_ATTENTION_SPLITS
    if splits is None:
        tiles = block_tables.shape[1] * block_size // constexprs["BLOCK_N"]
        splits = (default_layer_splits(default_splits, tiles) if merge_each_program
                  else min(default_splits, MAX_NEXT_ATTENTION_SPLITS))
    elif splits < 1 or splits > most or splits & (splits - 1):
        raise ValueError(f"{op}: attention_splits must be a power of two in [1, {most}], got {splits}")
    hq = qd // head_dim
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head = strides[2:8]
    return dict(HAS_ATTENTION=merge_each_program, HQ=hq, HQP=next_power_of_2(hq), HKV=hkv, HEAD_DIM=head_dim,
                BLOCK_G=constexprs["BLOCK_G"], BLOCK_N_ATT=constexprs["BLOCK_N"], SPLITS=splits,
                SPLITS_P=max(2, next_power_of_2(splits)), USE_DOT=constexprs["USE_DOT"],
                UPCAST_DOT=constexprs["UPCAST_DOT"], DOT_PRECISION=constexprs["DOT_PRECISION"],
                stride_k_block=stride_k_block, stride_k_slot=stride_k_slot, stride_k_head=stride_k_head,
                stride_v_block=stride_v_block, stride_v_slot=stride_v_slot, stride_v_head=stride_v_head,
                stride_cs=rope["stride_cs"], block_size=block_size)


def _outputs(plan: _Plan, first_input: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(y1, res2, act, y3, res3, qkv[, attn, partial_out, partial_lse]); without a next layer res3
    and qkv stand in as y1 (unused); decode_layer adds its attention output and split partials."""
    device, dtype = first_input.device, first_input.dtype
    y1, res2, y3 = (torch.empty((1, plan.hidden), dtype=dtype, device=device) for _ in range(3))
    act = torch.empty((1, plan.inner), dtype=dtype, device=device)
    if plan.has_next:
        tail = (y1, res2, act, y3, torch.empty((1, plan.hidden), dtype=dtype, device=device),
                torch.empty((1, plan.nqkv), dtype=dtype, device=device))
    else:
        tail = (y1, res2, act, y3, y1, y1)
    if plan.attention is None:
        return tail
    hq, splits, head_dim = plan.attention["HQ"], plan.attention["SPLITS"], plan.attention["HEAD_DIM"]
    attn = torch.empty((1, plan.q_dim), dtype=dtype, device=device)
    if splits == 1:
        return (*tail, attn, attn, attn)  # phase 0 writes attn itself; no partials
    return (*tail, attn, torch.empty((hq, splits, head_dim), dtype=torch.float32, device=device),
            torch.empty((hq, splits), dtype=torch.float32, device=device))


def _kernel_args(plan: _Plan, first_input, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm,
                 next_qkv, next_qkv_bias, outputs, counters, eps) -> tuple:
    """The kernel's positional arguments (stand-ins where a phase is not run)."""
    y1, res2, act, y3, res3, qkv = outputs[:6]
    attn = outputs[6] if plan.attention_first else first_input
    return (attn, o_proj, y1, residual, post_norm, res2, gate_up, act, down_proj, y3,
            next_input_norm if plan.has_next else post_norm, res3, next_qkv if plan.has_next else o_proj,
            next_qkv_bias if next_qkv_bias is not None else y1, qkv, counters, float(eps))


def _attention_args(plan: _Plan, qkv, attention_tensors, outputs, scale) -> dict:
    """The attention phase's keyword arguments: decode_layer's phase 0 on its input qkv (qkv_in),
    or the tail's phase 5, which reads phase 4's qkv row (a positional argument) and writes
    attn_out; none without either."""
    if plan.attention is None:
        return {}
    positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables, context_lens = attention_tensors
    return dict(plan.attention, qkv_in_ptr=qkv, attn_out_ptr=outputs[6], k_cache_ptr=k_cache, v_cache_ptr=v_cache,
                block_tables_ptr=block_tables, context_lens_ptr=context_lens, positions_ptr=positions,
                cos_sin_ptr=cos_sin_cache, slot_mapping_ptr=slot_mapping, partial_out_ptr=outputs[7],
                partial_lse_ptr=outputs[8], scale_log2=float(scale) * LOG2E)


def _check_timestamps(timestamps: torch.Tensor, plan: _Plan, device: torch.device) -> None:
    if (not isinstance(timestamps, torch.Tensor) or timestamps.dtype != torch.int64 or timestamps.dim() != 2
            or timestamps.shape[0] < plan.programs or timestamps.shape[1] != STAMP_SLOTS
            or not timestamps.is_contiguous() or timestamps.device != device):
        raise ValueError(f"timestamps must be a contiguous int64 [>= {plan.programs}, {STAMP_SLOTS}] tensor on the GPU")


def _launch_counters(device: torch.device) -> torch.Tensor:
    counters = _COUNTERS.for_stream(device, 2)
    if counters is None:
        raise RuntimeError("decode_layer_tail: first call on this stream is inside a CUDA graph capture; run the "
                           "kernel once on the stream before capturing (its barrier counters are allocated and "
                           "zeroed then)")
    return counters


def decode_layer_tail_ref(attn, residual, o_proj, post_norm, gate_up, down_proj, eps, next_input_norm=None,
                          next_qkv=None, next_qkv_bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops' references in sequence (kernels.gemv, kernels.rmsnorm): float32 math with
    the same rounding points (each projection output, the residual sums, the norm's two
    roundings, silu(gate) and the product, in the input dtype)."""
    x, h2 = rmsnorm_ref(gemv_ref(attn, o_proj), post_norm, eps, residual)
    y3 = gemv_ref(gemv_silu_and_mul_ref(x, gate_up), down_proj)
    if next_qkv is None:
        return y3, h2
    x, h3 = rmsnorm_ref(y3, next_input_norm, eps, h2)
    return gemv_ref(x, next_qkv, next_qkv_bias), h3


def decode_layer_ref(qkv, residual, o_proj, post_norm, gate_up, down_proj, eps, next_input_norm=None, next_qkv=None,
                     next_qkv_bias=None, *, positions, cos_sin_cache, slot_mapping, k_cache, v_cache, block_tables,
                     context_lens, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_attention_rope's reference (which writes the caches), then decode_layer_tail_ref."""
    k_cache_heads = k_cache.shape[2]
    head_dim = k_cache.shape[3]
    q, k, v = qkv.split([o_proj.shape[1], k_cache_heads * head_dim, k_cache_heads * head_dim], dim=-1)
    attn = decode_attention_rope_ref(q.reshape(1, -1, head_dim), k.reshape(1, -1, head_dim),
                                     v.reshape(1, -1, head_dim), positions, cos_sin_cache, slot_mapping, k_cache,
                                     v_cache, block_tables, context_lens, scale)
    return decode_layer_tail_ref(attn.reshape(1, -1), residual, o_proj, post_norm, gate_up, down_proj, eps,
                                 next_input_norm, next_qkv, next_qkv_bias)
