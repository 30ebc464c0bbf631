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
norm and the lm_head.

Why one kernel: at batch 1 each of these GEMVs streams 8-67 MB, and the separate kernels pay a
launch, a ramp (the first weight bytes are an HBM latency away) and a tail (the slowest program)
each; those fixed ~3-5 us are what kept the small projections at 34-58% of copy bandwidth
(docs/decode-performance.md). Here a grid of two programs per SM walks the phases; between two
phases every program must see all of the previous phase's output, so a barrier (an atomic
counter every program adds to and spins on) separates them. Weights never depend on the
previous phase, so each program loads its first two weight tiles of the next phase *before*
it waits at the barrier: HBM stays busy through the barrier and the ramp.

Data flow in a phase: the input vector x (attn, or the normalised h2 / h3, or act) is read once
per program into registers (float32, [K]); the program then walks its row tiles t = pid,
pid + G, ... of the weight, [BLOCK_N, K] each (whole rows, 16 KB), keeping the next two tiles'
loads in flight while it reduces the current one (3 tiles x 2 programs = 96 KB per SM: HBM
latency times bandwidth is ~4-8 MB over the 132 SMs), and writes its BLOCK_N outputs. Loads of
data that other programs wrote in this launch (y1, act, y3, res2) bypass L1 (.cg).

The barriers need every program resident at once: the launcher reads the compiled variant's
registers, threads and shared memory, takes two programs per SM where they fit (else one; SM
count as the device reports it, a MIG slice its own) and refuses an explicit grid that cannot
be resident. The launch is an ordinary one, not a cooperative launch, so residency rests on
that count and on the GPU dispatching a grid's programs before a later grid's of the same
priority; two of these kernels on streams of different priorities, or MPS with a thread limit
the device properties do not show, could leave a barrier waiting for programs that never get
an SM. The engine's streams (serving, and a hot reload's warm-up off the serving path) all
have the default priority; the recipe knob (fuse_layer_tail) turns the kernel off where that
does not hold. Triton's cooperative launch (launch_cooperative_grid) would make residency the
driver's guarantee; it has not been measured here. Under
the Triton interpreter programs run one after another, so there (and whenever ``sync=False``)
the launcher runs each phase as a launch of its own instead; the arithmetic is the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .checks import (FLOAT_DTYPES, LaunchPlans, StreamCounters, check_runnable_device, check_same_dtype, check_tensor,
                     interpreter_active, next_power_of_2, pdl_options)
from .gemv import gemv_ref, gemv_silu_and_mul_ref
from .rmsnorm import rmsnorm_ref
from .triton_helpers import grid_dependency_wait, launch_dependents

# Defaults: the fastest of hack/bench_layer_tail.py's sweep on an H200 (bench/results/layer-tail-
# NVIDIA-H200-20261130T030628Z.json): 40.7 us a layer (70% of copy bandwidth) against 45.2 for one
# 16-warp program per SM with 32 KB tiles and 48.6 for the fast recipe's four GEMV launches.
TILE_ELEMENTS = 8192  # weight elements per row tile: 16 KB of bf16
NUM_WARPS = 8  # 256 threads: a 16 KB tile is 64 bytes (4 vector loads) per thread
PROGRAMS_PER_SM = 2  # two programs hide each other's reductions and barrier waits (when both fit)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Wait until `target` arrivals are counted (every program adds one per barrier). Polling
    with acquire atomics measured faster than volatile loads plus one acquire at the end
    (40.5 against 46.1 us a layer on an H200, docs/decode-performance.md)."""
    tl.debug_barrier()  # every thread's stores of the phase are issued before the release below
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
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
def _first_tiles(w_ptr, pid, row0, G: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                 KP: tl.constexpr):
    """A program's first two row tiles of a phase (pid and pid + G), loaded ahead of the phase."""
    return (_row_tile(w_ptr, pid, row0, N, K, BLOCK_N, KP), _row_tile(w_ptr, pid + G, row0, N, K, BLOCK_N, KP))


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
def _decode_layer_tail_kernel(
    attn_ptr, wo_ptr, y1_ptr,
    res_ptr, post_w_ptr, res2_ptr, wgu_ptr, act_ptr,
    wd_ptr, y3_ptr,
    in_w_ptr, res3_ptr, wqkv_ptr, bqkv_ptr, qkv_ptr,
    counter_ptr,  # int32 [2]: arrivals, exits; zero between launches
    eps,
    H: tl.constexpr, QD: tl.constexpr, INNER: tl.constexpr, NQKV: tl.constexpr,
    HP: tl.constexpr, QDP: tl.constexpr, IP: tl.constexpr,
    BN_O: tl.constexpr, BN_GU: tl.constexpr, BN_D: tl.constexpr, BN_QKV: tl.constexpr,
    G: tl.constexpr,
    FIRST: tl.constexpr, LAST: tl.constexpr,  # phases run by this launch (1..4)
    SYNC: tl.constexpr,  # grid barriers between phases (all phases in one launch)
    HAS_QKV_BIAS: tl.constexpr,
    USE_PDL: tl.constexpr = False,  # programmatic dependent launch (checks.pdl_options "layer_tail")
):
    pid = tl.program_id(0)
    if FIRST <= 1 and LAST >= 1:
        w0, w1 = _first_tiles(wo_ptr, pid, 0, G, H, QD, BN_O, QDP)
        grid_dependency_wait(USE_PDL)  # nothing above reads what the kernel ahead writes
        x = _vector(attn_ptr, QD, QDP, False)
        _stream_rows(wo_ptr, x, y1_ptr, y1_ptr, pid, w0, w1, G, H, QD, BN_O, QDP, False)
    if FIRST <= 2 and LAST >= 2:
        g0, g1 = _first_tiles(wgu_ptr, pid, 0, G, INNER, H, BN_GU, HP)
        u0, u1 = _first_tiles(wgu_ptr, pid, INNER, G, INNER, H, BN_GU, HP)
        if SYNC:
            _grid_barrier(counter_ptr, G)
        x = _normed_vector(y1_ptr, res_ptr, res2_ptr, post_w_ptr, eps, pid == 0, H, HP)
        _stream_gated(wgu_ptr, x, act_ptr, pid, g0, u0, g1, u1, G, INNER, H, BN_GU, HP)
    if FIRST <= 3 and LAST >= 3:
        w0, w1 = _first_tiles(wd_ptr, pid, 0, G, H, INNER, BN_D, IP)
        if SYNC:
            _grid_barrier(counter_ptr, 2 * G)
        if LAST == 3:
            launch_dependents(USE_PDL)  # the next kernel's programs may take their places now
        x = _vector(act_ptr, INNER, IP, True)
        _stream_rows(wd_ptr, x, y3_ptr, y3_ptr, pid, w0, w1, G, H, INNER, BN_D, IP, False)
    if FIRST <= 4 and LAST >= 4:
        w0, w1 = _first_tiles(wqkv_ptr, pid, 0, G, NQKV, H, BN_QKV, HP)
        if SYNC:
            _grid_barrier(counter_ptr, 3 * G)
        launch_dependents(USE_PDL)
        x = _normed_vector(y3_ptr, res2_ptr, res3_ptr, in_w_ptr, eps, pid == 0, H, HP)
        _stream_rows(wqkv_ptr, x, qkv_ptr, bqkv_ptr, pid, w0, w1, G, NQKV, H, BN_QKV, HP, HAS_QKV_BIAS)
    if SYNC:
        # The last program out resets the counters for the next launch (or graph replay): every
        # other program has passed its last barrier by then.
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(counter_ptr + 1, 0, sem="relaxed", scope="gpu")


# Barrier counters [arrivals, exits]: one pair per stream serves every layer (kernels on one
# stream never overlap).
_COUNTERS = StreamCounters()


def _resident_per_sm(args: tuple, meta: dict, last: int) -> int:
    """Programs of this compiled variant one SM holds at once (registers, threads, shared memory);
    compiles the variant (the launch that follows reuses it)."""
    device = args[0].device
    kernel = _decode_layer_tail_kernel.warmup(*args, grid=(meta["G"],), FIRST=1, LAST=last, **meta)
    try:
        kernel._init_handles()  # loads the module, which fills n_regs (Triton 3.x)
        registers = int(kernel.n_regs)
    except (AttributeError, TypeError, ValueError):
        registers = 0
    if registers <= 0:  # a Triton that does not say: assume only one program per SM fits
        return 1
    props = torch.cuda.get_device_properties(device)
    threads = meta["num_warps"] * 32
    per_program = -(-registers // 8) * 8 * threads  # allocated in units of 8 a thread
    per_sm = min(getattr(props, "regs_per_multiprocessor", 65536) // per_program,
                 props.max_threads_per_multi_processor // threads)
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    if shared:
        per_sm = min(per_sm, getattr(props, "shared_memory_per_multiprocessor", 228 * 1024) // shared)
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
    """
    # Launch options; PDL (SHAPESHIFT_PDL, read by checks.pdl_options) may change between calls.
    options = (programs, sync, num_warps, tile_elements, pdl_options(attn.device, "layer_tail")["USE_PDL"])
    plan = _PLANS.plan(_plan, (attn, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv,
                               next_qkv_bias), options)
    outputs = _outputs(plan, attn)
    counters = _launch_counters(attn.device) if plan.sync else outputs[0]
    args = _kernel_args(plan, attn, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv,
                        next_qkv_bias, outputs, counters, eps)
    for first, final in plan.phases:
        _decode_layer_tail_kernel[(plan.programs,)](*args, FIRST=first, LAST=final, **plan.meta)
    y1, res2, act, y3, res3, qkv = outputs
    return (qkv, res3) if plan.has_next else (y3, res2)


@dataclass(frozen=True)
class _Plan:
    """What a launch on one argument metadata needs, derived (and checked) once."""
    hidden: int
    inner: int
    nqkv: int
    has_next: bool
    sync: bool
    programs: int
    phases: tuple[tuple[int, int], ...]
    meta: dict


# (argument metadata, launch options) -> _Plan, see checks.LaunchPlans.
_PLANS = LaunchPlans()


def _plan(attn, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv, next_qkv_bias,
          options) -> _Plan:
    """Every argument check, the kernel's constexprs and the grid (with its residency check)."""
    programs, sync, num_warps, tile_elements, _use_pdl = options
    op = "decode_layer_tail"
    check_tensor(op, "attn", attn, ndim=2, dtypes=FLOAT_DTYPES, contiguous=True)
    check_runnable_device(op, attn)
    if attn.shape[0] != 1:
        raise ValueError(f"{op}: serves one token (batch-1 decode), got attn with {attn.shape[0]} rows")
    qd = attn.shape[1]
    check_tensor(op, "o_proj", o_proj, ndim=2, device=attn.device, contiguous=True)
    hidden = o_proj.shape[0]
    check_tensor(op, "o_proj", o_proj, shape=(hidden, qd), device=attn.device, contiguous=True)
    check_tensor(op, "residual", residual, shape=(1, hidden), device=attn.device, contiguous=True)
    check_tensor(op, "post_norm", post_norm, shape=(hidden,), device=attn.device, contiguous=True)
    check_tensor(op, "gate_up", gate_up, ndim=2, device=attn.device, contiguous=True)
    if gate_up.shape[1] != hidden or gate_up.shape[0] % 2:
        raise ValueError(f"{op}: gate_up must be [2I, {hidden}] (= [gate; up]), got {tuple(gate_up.shape)}")
    inner = gate_up.shape[0] // 2
    check_tensor(op, "down_proj", down_proj, shape=(hidden, inner), device=attn.device, contiguous=True)
    check_same_dtype(op, "attn", attn, residual=residual, o_proj=o_proj, post_norm=post_norm, gate_up=gate_up,
                     down_proj=down_proj)
    has_next = next_qkv is not None
    if has_next != (next_input_norm is not None) or (next_qkv_bias is not None and not has_next):
        raise ValueError(f"{op}: next_input_norm and next_qkv come together (next_qkv_bias only with them)")
    nqkv = 1
    if has_next:
        check_tensor(op, "next_input_norm", next_input_norm, shape=(hidden,), device=attn.device, contiguous=True)
        check_tensor(op, "next_qkv", next_qkv, ndim=2, device=attn.device, contiguous=True)
        nqkv = next_qkv.shape[0]
        check_tensor(op, "next_qkv", next_qkv, shape=(nqkv, hidden), device=attn.device, contiguous=True)
        check_same_dtype(op, "attn", attn, next_input_norm=next_input_norm, next_qkv=next_qkv)
        if next_qkv_bias is not None:
            check_tensor(op, "next_qkv_bias", next_qkv_bias, shape=(nqkv,), device=attn.device, contiguous=True)
            check_same_dtype(op, "attn", attn, next_qkv_bias=next_qkv_bias)
    device = attn.device
    if sync is None:
        sync = device.type == "cuda" and not interpreter_active()

    def rows(k: int) -> int:  # rows per tile: whole rows, tile_elements elements (a power of two)
        return max(1, next_power_of_2(tile_elements) // next_power_of_2(k))

    G = programs or default_programs(device)
    last = 4 if has_next else 3
    meta = dict(H=hidden, QD=qd, INNER=inner, NQKV=nqkv, HP=next_power_of_2(hidden), QDP=next_power_of_2(qd),
                IP=next_power_of_2(inner), BN_O=rows(qd), BN_GU=max(1, rows(hidden) // 2), BN_D=rows(inner),
                BN_QKV=rows(hidden), G=G, SYNC=sync, HAS_QKV_BIAS=next_qkv_bias is not None, num_warps=num_warps,
                **(pdl_options(device, "layer_tail") if sync else {"USE_PDL": False}))
    plan = _Plan(hidden, inner, nqkv, has_next, sync, G, ((1, last),) if sync else tuple((p, p) for p in
                                                                                          range(1, last + 1)), meta)
    if sync and device.type == "cuda":
        # Compile the variant (once per plan) to read what one SM holds: PROGRAMS_PER_SM programs
        # where they fit, else one per SM; an explicit grid that cannot be resident is refused.
        outputs = _outputs(plan, attn)
        args = _kernel_args(plan, attn, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv,
                            next_qkv_bias, outputs, _launch_counters(device), 1e-6)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if programs is None and _resident_per_sm(args, dict(meta, G=G * PROGRAMS_PER_SM), last) >= PROGRAMS_PER_SM:
            G = G * PROGRAMS_PER_SM
            plan = replace(plan, programs=G, meta=dict(meta, G=G))
        per_sm = _resident_per_sm(args, plan.meta, last)
        if G > per_sm * sms:
            raise ValueError(f"{op}: {G} programs cannot all be resident ({per_sm} per SM fit by registers x "
                             f"{sms} SMs); the grid barriers need them all at once")
    return plan


def _outputs(plan: _Plan, attn: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(y1, res2, act, y3, res3, qkv); without a next layer res3 and qkv stand in as y1 (unused)."""
    device, dtype = attn.device, attn.dtype
    y1, res2, y3 = (torch.empty((1, plan.hidden), dtype=dtype, device=device) for _ in range(3))
    act = torch.empty((1, plan.inner), dtype=dtype, device=device)
    if not plan.has_next:
        return y1, res2, act, y3, y1, y1
    return (y1, res2, act, y3, torch.empty((1, plan.hidden), dtype=dtype, device=device),
            torch.empty((1, plan.nqkv), dtype=dtype, device=device))


def _kernel_args(plan: _Plan, attn, residual, o_proj, post_norm, gate_up, down_proj, next_input_norm, next_qkv,
                 next_qkv_bias, outputs, counters, eps) -> tuple:
    """The kernel's positional arguments (stand-ins where a phase is not run)."""
    y1, res2, act, y3, res3, qkv = outputs
    return (attn, o_proj, y1, residual, post_norm, res2, gate_up, act, down_proj, y3,
            next_input_norm if plan.has_next else post_norm, res3, next_qkv if plan.has_next else o_proj,
            next_qkv_bias if next_qkv_bias is not None else y1, qkv, counters, float(eps))


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
