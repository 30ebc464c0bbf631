"""Batch-1 to small-batch GEMV / skinny GEMM that streams the weight at memory bandwidth.

Math: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), accumulated in float32, M in 1..16
(decode batches); W is the nn.Linear weight layout [out_features, in_features].

Data flow: grid (cdiv(N, BLOCK_N), SPLIT_K). Program (n, s) streams the W tile rows
[n*BLOCK_N, (n+1)*BLOCK_N) over its K slice in BLOCK_K steps (the only large read: each weight
byte is read exactly once) against the matching x slice (tiny, L2 resident), then
  SPLIT_K == 1: writes y[:, tile] (+ bias) in the output dtype;
  SPLIT_K > 1:  writes a float32 partial [SPLIT_K, M, N]; a second kernel sums the partials,
                adds the bias and casts.
Split-K exists because at small N (e.g. 2048 outputs) there are too few row tiles to keep all
132 SMs of an H200 streaming; the split multiplies the number of independent programs.
Variants: "dot" pads the rows of x to 16 and uses tensor-core dots (their operands go through
shared memory with Triton's software pipelining, which keeps several weight tiles in flight);
"fma" multiplies and reduces on CUDA cores with x held in registers (M <= 4).
`out` may be float32 for bf16/fp16 inputs (the lm_head writes float32 logits directly instead
of rounding them and launching a cast).

`gemv_silu_and_mul` is the same stream over a fused [gate; up] weight [2I, K] with the SwiGLU
gate in the epilogue: program n accumulates gate rows n*BLOCK_N.. and the matching up rows
I + n*BLOCK_N.. and writes silu(gate) * up [M, I] (no split-K: the gate is non-linear), so the
[M, 2I] intermediate and a separate activation launch disappear.

Both launchers take an optional RMSNorm prologue (`norm_weight`, `eps`, optional `residual`):
x is then the un-normalised hidden state h (+ residual); every program first reads the whole
row (K elements, L2 resident) to get 1/rms, and normalises each x tile as it streams the
weight, with the rounding points of kernels/rmsnorm.py. Program (0, 0) writes h + residual to
`residual_out` (which must not alias x or residual: other programs still read them). This
removes the separate RMSNorm launch in front of the qkv and gate/up projections.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, StreamCounters, cdiv, check_runnable_device, check_same_dtype, check_tensor,
                     dot_flags, dtype_name, gemv_pdl_trigger_late, gemv_prefetch_columns, interpreter_active,
                     next_power_of_2, pdl_options)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import dot, grid_dependency_sync, grid_dependency_wait, launch_dependents, prefetch_rows_l2

MAX_M = 16


@triton.jit
def _norm_prologue(
    x_ptr, res_ptr, res_out_ptr, M, K, stride_x_m, stride_r_m, stride_ro_m, eps,
    WRITE_RESIDUAL, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, PRO_M: tl.constexpr, PRO_K: tl.constexpr,
):
    """1 / rms of each row of h = x (+ residual, rounded to x's dtype) -> [BLOCK_M] float32;
    writes h to res_out when WRITE_RESIDUAL (one program of the grid).

    Reads PRO_M (= next power of two >= M, not the dot's padded BLOCK_M) rows in PRO_K-wide
    chunks, so at M = 1 the whole hidden row is one load: one L2 round trip per program
    before its weight stream starts."""
    m = tl.arange(0, PRO_M)
    m_mask = m < M
    kk = tl.arange(0, PRO_K)
    sum_sq = tl.zeros([PRO_M, PRO_K], tl.float32)
    for k0 in range(0, K, PRO_K):
        mask = m_mask[:, None] & ((k0 + kk) < K)[None, :]
        h = tl.load(x_ptr + m[:, None] * stride_x_m + (k0 + kk)[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + m[:, None] * stride_r_m + (k0 + kk)[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + m[:, None] * stride_ro_m + (k0 + kk)[None, :], h, mask=mask & WRITE_RESIDUAL)
        hf = h.to(tl.float32)
        sum_sq += hf * hf
    inv_rms = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / K + eps)  # [PRO_M]
    # Spread to the [BLOCK_M] row vector of the main loop (rows >= PRO_M are padding).
    rows = tl.arange(0, BLOCK_M)
    return tl.sum(tl.where(rows[:, None] == m[None, :], inv_rms[None, :], 0.0), axis=1)


@triton.jit
def _normed_tile(x, r_ptrs, nw_ptrs, inv_rms, mask_m, mask_k, HAS_RESIDUAL: tl.constexpr, DTYPE: tl.constexpr):
    """round(round(h * inv_rms) * norm_weight) for one [BLOCK_M, BLOCK_K] tile of h = x (+ r)."""
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        h = (h + r.to(tl.float32)).to(DTYPE).to(tl.float32)
    nw = tl.load(nw_ptrs, mask=mask_k, other=0.0).to(tl.float32)
    normed = (h * inv_rms[:, None]).to(DTYPE).to(tl.float32)
    return (normed * nw[None, :]).to(DTYPE)


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N] (unused without HAS_BIAS)
    y_ptr,  # [M, N] (SPLIT_K == 1)
    partial_ptr,  # [SPLIT_K, M, N] float32 (SPLIT_K > 1)
    M,
    N,
    K,
    stride_x_m,
    stride_w_n,
    stride_y_m,
    res_ptr,  # [M, K] residual added before the norm (NORM and HAS_RESIDUAL)
    res_out_ptr,  # [M, K] h = x + residual, written by program (0, 0)
    norm_w_ptr,  # [K] RMSNorm weight (NORM)
    stride_r_m,
    stride_ro_m,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K is a multiple of SPLIT_K * BLOCK_K: no K masks in the loop
    USE_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = False,
    PRO_M: tl.constexpr = 1,  # norm prologue: rows (next power of two >= M)
    PRO_K: tl.constexpr = 16,  # norm prologue: columns per chunk
    USE_PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,  # weight columns per row prefetched into L2 first (before the wait)
    PREFETCH_LINE: tl.constexpr = 64,  # elements per 128-byte line
    TRIGGER_LATE: tl.constexpr = False,  # with USE_PDL: the next kernel launches after the weight stream
    FUSED_REDUCE: tl.constexpr = False,  # SPLIT_K > 1: the last split of each row tile reduces (one launch)
    counter_ptr=None,  # [cdiv(N, BLOCK_N)] int32, zero between launches (FUSED_REDUCE)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    kk = tl.arange(0, BLOCK_K)
    # Row pointers clamp out-of-range rows to row 0 instead of masking them, so W loads carry
    # no N mask and stay 16-byte vectorised; the garbage columns are never stored.
    n_safe = tl.where(n_mask, n, 0).to(tl.int64)
    w_ptrs = w_ptr + n_safe[:, None] * stride_w_n + (k_start + kk)[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + m[:, None] * stride_x_m + (k_start + kk)[None, :]  # [BLOCK_M, BLOCK_K]
    if PREFETCH_K > 0:  # weights are not written by the kernel ahead: start their stream (and
        # overlap the norm prologue's read of the hidden row)
        prefetch_rows_l2(w_ptr, n_safe, stride_w_n, k_start, k_end, PREFETCH_K, PREFETCH_LINE)
    grid_dependency_wait(USE_PDL)  # nothing above reads or writes memory (the prefetch fills L2 only)
    if not TRIGGER_LATE:
        launch_dependents(USE_PDL)
    if NORM:
        inv_rms = _norm_prologue(x_ptr, res_ptr, res_out_ptr, M, K, stride_x_m, stride_r_m, stride_ro_m, eps,
                                 (pid_n == 0) & (pid_k == 0), HAS_RESIDUAL, BLOCK_M, PRO_M, PRO_K)
        r_ptrs = res_ptr + m[:, None] * stride_r_m + (k_start + kk)[None, :]
        nw_ptrs = norm_w_ptr + k_start + kk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            k_mask = kk < BLOCK_K
        else:
            k_mask = (k0 + kk) < k_end
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            x = _normed_tile(x, r_ptrs, nw_ptrs, inv_rms, m_mask, k_mask, HAS_RESIDUAL, x_ptr.dtype.element_ty)
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        if USE_DOT:
            acc += dot(x, tl.trans(w), UPCAST_DOT, DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if TRIGGER_LATE:
        launch_dependents(USE_PDL)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + m[:, None] * stride_y_m + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        partial_tile = partial_ptr + m[:, None] * N + n[None, :]  # split 0's [BLOCK_M, BLOCK_N] tile
        tl.store(partial_tile + pid_k * M * N, acc, mask=out_mask)
        if FUSED_REDUCE:
            # Serial fix-up instead of a second launch: every split counts itself in on this row
            # tile's counter; the last to arrive sums the partials (from zero, in split order,
            # as _split_k_reduce_kernel does, so the result is the same bit for bit), writes y
            # and resets the counter for the next launch (or graph replay).
            tl.debug_barrier()  # the whole tile is stored before the release below
            arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                tl.debug_barrier()
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(partial_tile + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                tl.store(y_ptr + m[:, None] * stride_y_m + n[None, :], total.to(y_ptr.dtype.element_ty),
                         mask=out_mask)
                tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr,  # [SPLIT_K, M, N] float32
    bias_ptr,  # [N]
    y_ptr,  # [M, N]
    M,
    N,
    stride_y_m,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_sync(USE_PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    total = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + (s * M + m) * N + n, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_y_m + n, total.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_silu_and_mul_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [2I, K]: gate rows [0, I), up rows [I, 2I)
    y_ptr,  # [M, I]
    M,
    INNER,
    K,
    stride_x_m,
    stride_w_n,
    stride_y_m,
    res_ptr,
    res_out_ptr,
    norm_w_ptr,
    stride_r_m,
    stride_ro_m,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NORM: tl.constexpr = False,
    HAS_RESIDUAL: tl.constexpr = False,
    PRO_M: tl.constexpr = 1,  # norm prologue: rows (next power of two >= M)
    PRO_K: tl.constexpr = 16,  # norm prologue: columns per chunk
    USE_PDL: tl.constexpr = False,
    PREFETCH_K: tl.constexpr = 0,
    PREFETCH_LINE: tl.constexpr = 64,
    TRIGGER_LATE: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < INNER
    m = tl.arange(0, BLOCK_M)
    m_mask = m < M
    kk = tl.arange(0, BLOCK_K)
    n_safe = tl.where(n_mask, n, 0).to(tl.int64)  # clamped rows: unmasked 16-byte weight loads
    g_ptrs = w_ptr + n_safe[:, None] * stride_w_n + kk[None, :]  # [BLOCK_N, BLOCK_K]
    u_ptrs = g_ptrs + INNER * stride_w_n
    x_ptrs = x_ptr + m[:, None] * stride_x_m + kk[None, :]  # [BLOCK_M, BLOCK_K]
    if PREFETCH_K > 0:
        prefetch_rows_l2(w_ptr, n_safe, stride_w_n, 0, K, PREFETCH_K, PREFETCH_LINE)
        prefetch_rows_l2(w_ptr, n_safe + INNER, stride_w_n, 0, K, PREFETCH_K, PREFETCH_LINE)
    grid_dependency_wait(USE_PDL)
    if not TRIGGER_LATE:
        launch_dependents(USE_PDL)
    if NORM:
        inv_rms = _norm_prologue(x_ptr, res_ptr, res_out_ptr, M, K, stride_x_m, stride_r_m, stride_ro_m, eps,
                                 pid_n == 0, HAS_RESIDUAL, BLOCK_M, PRO_M, PRO_K)
        r_ptrs = res_ptr + m[:, None] * stride_r_m + kk[None, :]
        nw_ptrs = norm_w_ptr + kk
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            wg = tl.load(g_ptrs)
            wu = tl.load(u_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            k_mask = kk < BLOCK_K
        else:
            k_mask = (k0 + kk) < K
            wg = tl.load(g_ptrs, mask=k_mask[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:
            x = _normed_tile(x, r_ptrs, nw_ptrs, inv_rms, m_mask, k_mask, HAS_RESIDUAL, x_ptr.dtype.element_ty)
            r_ptrs += BLOCK_K
            nw_ptrs += BLOCK_K
        if USE_DOT:
            acc_g += dot(x, tl.trans(wg), UPCAST_DOT, DOT_PRECISION)
            acc_u += dot(x, tl.trans(wu), UPCAST_DOT, DOT_PRECISION)
        else:
            xf = x.to(tl.float32)[:, None, :]
            acc_g += tl.sum(xf * wg.to(tl.float32)[None, :, :], axis=2)
            acc_u += tl.sum(xf * wu.to(tl.float32)[None, :, :], axis=2)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if TRIGGER_LATE:
        launch_dependents(USE_PDL)
    # Rounding points of the unfused path: the projection output, then silu(gate), then the
    # product, each rounded to the output dtype (kernels/activation.py).
    gate = acc_g.to(y_ptr.dtype.element_ty).to(tl.float32)
    up = acc_u.to(y_ptr.dtype.element_ty).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + m[:, None] * stride_y_m + n[None, :], (activated * up).to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch reference in float32: x @ weight^T (+ bias), cast to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _prologue_shape(M: int, K: int) -> dict[str, int]:
    """Norm-prologue tile: all rows at once, up to 8192 elements per chunk (the whole 2048-wide
    row of a 1B model at M = 1: 16 values per thread at 4 warps)."""
    pro_m = next_power_of_2(M)
    return {"PRO_M": pro_m, "PRO_K": max(16, min(next_power_of_2(K), 8192 // pro_m))}


def _check_x_and_weight(op: str, x: torch.Tensor, weight_name: str, weight: torch.Tensor) -> tuple[int, int]:
    """The checks both launchers make on x [M, K] and their weight [*, K] -> (M, K)."""
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, x)
    M, K = x.shape
    if not 1 <= M <= MAX_M:
        raise ValueError(f"{op}: x has {M} rows; this kernel serves 1..{MAX_M} rows (use a GEMM for larger batches)")
    check_tensor(op, weight_name, weight, shape=(None, K), device=x.device)
    check_same_dtype(op, "x", x, **{weight_name: weight})
    return M, K


def _variant_rows(op: str, config: KernelConfig, M: int) -> tuple[bool, int]:
    """(USE_DOT, BLOCK_M) of a config: "dot" pads x's rows to 16, "fma" holds up to 4 in registers."""
    if config.variant == "dot":
        return True, 16
    if M > 4:
        raise ValueError(f"{op}: the 'fma' variant serves at most 4 rows, got {M}; use the 'dot' variant")
    return False, next_power_of_2(M)


def _norm_args(op: str, x: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
               residual_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Validate the RMSNorm-prologue arguments -> (residual, residual_out, norm_weight) kernel
    arguments (x stands in for unused ones) and the residual_out to return (or None)."""
    M, K = x.shape
    if norm_weight is None:
        if residual is not None or residual_out is not None:
            raise ValueError(f"{op}: residual / residual_out need norm_weight (they feed the RMSNorm prologue)")
        return x, x, x, None
    check_tensor(op, "norm_weight", norm_weight, shape=(K,), dtypes=FLOAT_DTYPES, device=x.device)
    if residual is None:
        if residual_out is not None:
            raise ValueError(f"{op}: residual_out is written only when a residual is given")
        return x, x, norm_weight, None
    check_tensor(op, "residual", residual, shape=(M, K), device=x.device)
    check_same_dtype(op, "x", x, residual=residual)
    if residual_out is None:
        residual_out = torch.empty((M, K), dtype=x.dtype, device=x.device)
    check_tensor(op, "residual_out", residual_out, shape=(M, K), device=x.device)
    check_same_dtype(op, "x", x, residual_out=residual_out)
    if residual_out.data_ptr() in (x.data_ptr(), residual.data_ptr()):
        raise ValueError(f"{op}: residual_out must not alias x or residual (other programs still read them)")
    return residual, residual_out, norm_weight, residual_out


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """y = x @ weight^T (+ bias) for x [M, K] with 1 <= M <= 16 and weight [N, K].

    The output has x's dtype, or float32 when `out_dtype` (or a given `out`) says so. With
    `norm_weight`, y = rmsnorm(x (+ residual)) @ weight^T, and `(y, residual_out)` is returned
    when a residual is given (residual_out = x + residual).
    """
    op = "gemv"
    M, K = _check_x_and_weight(op, x, "weight", weight)
    N = weight.shape[0]
    if bias is not None:
        check_tensor(op, "bias", bias, shape=(N,), device=x.device)
        check_same_dtype(op, "x", x, bias=bias)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(M, N), device=x.device)
    if out.dtype != torch.float32:
        check_same_dtype(op, "x", x, out=out)
    res_arg, res_out_arg, norm_arg, res_ret = _norm_args(op, x, norm_weight, residual, residual_out)
    if config is None:
        config = GEMV_SPEC.default_config({"m": M, "n": N, "k": K, "dtype": dtype_name(x.dtype)}, x.device)
    if N == 0:
        return out if res_ret is None else (out, res_ret)
    use_dot, block_m = _variant_rows(op, config, M)
    split_k = config["SPLIT_K"]
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    upcast_dot, dot_precision = dot_flags(x.dtype)
    partial = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split_k > 1 else out
    bias_arg = bias if bias is not None else out
    fused = {}
    if split_k > 1 and split_k_fixup_enabled(x.device):
        counters = _SPLIT_K_COUNTERS.for_stream(x.device, cdiv(N, block_n))
        if counters is not None:
            fused = {"FUSED_REDUCE": True, "counter_ptr": counters}
    _gemv_kernel[(cdiv(N, block_n), split_k)](
        x, weight, bias_arg, out, partial,
        M, N, K, x.stride(0), weight.stride(0), out.stride(0),
        res_arg, res_out_arg, norm_arg, res_arg.stride(0), res_out_arg.stride(0), float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        EVEN_K=K % (split_k * block_k) == 0, USE_DOT=use_dot, HAS_BIAS=bias is not None,
        UPCAST_DOT=upcast_dot, DOT_PRECISION=dot_precision,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, **_prologue_shape(M, K),
        num_warps=config.num_warps, num_stages=config.num_stages, **_pdl_and_prefetch(weight), **fused,
    )
    if split_k > 1 and not fused:
        reduce_block = 1024
        _split_k_reduce_kernel[(M, cdiv(N, reduce_block))](
            partial, bias_arg, out, M, N, out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4,
            **pdl_options(x.device, "gemv"),
        )
    return out if res_ret is None else (out, res_ret)


def gemv_silu_and_mul_ref(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: the projection rounded to x's dtype, then SiLU-and-mul with the
    rounding points of kernels/activation.py."""
    y = gemv_ref(x, gate_up)
    inner = gate_up.shape[0] // 2
    gate, up = y[:, :inner].float(), y[:, inner:].float()
    return (torch.nn.functional.silu(gate).to(x.dtype).float() * up).to(x.dtype)


def gemv_silu_and_mul(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """silu(x @ gate^T) * (x @ up^T) for x [M, K] (1 <= M <= 16) and gate_up = [gate; up] [2I, K].

    `config` is a gemv config (for the problem n = I); SPLIT_K is forced to 1. The optional
    RMSNorm prologue works as in `gemv`.
    """
    op = "gemv_silu_and_mul"
    M, K = _check_x_and_weight(op, x, "gate_up", gate_up)
    if gate_up.shape[0] % 2:
        raise ValueError(f"{op}: gate_up must stack [gate; up] (an even number of rows), got {gate_up.shape[0]}")
    inner = gate_up.shape[0] // 2
    if out is None:
        out = torch.empty((M, inner), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(M, inner), device=x.device)
    check_same_dtype(op, "x", x, out=out)
    res_arg, res_out_arg, norm_arg, res_ret = _norm_args(op, x, norm_weight, residual, residual_out)
    if config is None:
        config = GEMV_SPEC.default_config({"m": M, "n": inner, "k": K, "dtype": dtype_name(x.dtype), "gated": True},
                                          x.device)
    if inner == 0:
        return out if res_ret is None else (out, res_ret)
    use_dot, block_m = _variant_rows(op, config, M)
    block_n, block_k = config["BLOCK_N"], config["BLOCK_K"]
    upcast_dot, dot_precision = dot_flags(x.dtype)
    _gemv_silu_and_mul_kernel[(cdiv(inner, block_n),)](
        x, gate_up, out, M, inner, K, x.stride(0), gate_up.stride(0), out.stride(0),
        res_arg, res_out_arg, norm_arg, res_arg.stride(0), res_out_arg.stride(0), float(eps),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, USE_DOT=use_dot, UPCAST_DOT=upcast_dot, DOT_PRECISION=dot_precision,
        NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None, **_prologue_shape(M, K),
        num_warps=config.num_warps, num_stages=config.num_stages, **_pdl_and_prefetch(gate_up),
    )
    return out if res_ret is None else (out, res_ret)


# Tile counters of the split-K fix-up (the last split of a tile resets its counter). While a CUDA
# graph is captured on a stream that has none yet, the capture keeps the reduce launch.
_SPLIT_K_COUNTERS = StreamCounters(min_size=4096)


def split_k_fixup_enabled(device: torch.device) -> bool:
    """Split-K GEMVs reduce in their last split (one launch) unless SHAPESHIFT_GEMV_SPLIT_K_FIXUP=0,
    which brings back the separate reduce launch (to measure the difference)."""
    return os.environ.get("SHAPESHIFT_GEMV_SPLIT_K_FIXUP", "1") != "0"


def _prefetch_allowed(weight: torch.Tensor) -> bool:
    """PTX prefetches: CUDA only (the interpreter cannot run inline assembly)."""
    return weight.is_cuda and not interpreter_active()


def _pdl_and_prefetch(weight: torch.Tensor) -> dict:
    """Launch options: programmatic dependent launch (checks.pdl_options) and where it lets the
    next kernel launch (checks.gemv_pdl_trigger_late); the weight columns each program
    prefetches into L2 first, ahead of the grid-dependency wait and the norm prologue
    (checks.gemv_prefetch_columns; at least one 128-byte line, else none; CUDA only)."""
    options = dict(pdl_options(weight.device, "gemv"))
    if options["USE_PDL"]:
        options["TRIGGER_LATE"] = gemv_pdl_trigger_late()
    columns = gemv_prefetch_columns() if _prefetch_allowed(weight) else 0
    line = 128 // weight.element_size()
    if columns >= line:
        options.update(PREFETCH_K=next_power_of_2(columns), PREFETCH_LINE=line)
    return options


# H100 / H200 defaults per weight shape (N, K), for every M in 1..16 (the "dot" variant pads M
# to 16, so the weight stream is the same for every batch). Shapes not listed fall back to the
# heuristic below. `hack/bench_kernels.py --tune --ops gemv` times the space around these with
# CUDA graphs over HBM-resident weights and prints a replacement table.
SM90_GEMV_TABLE: dict[tuple[int, int], KernelConfig] = {
    # Llama-3.2-1B. The qkv_proj, o_proj and down_proj entries are the best of hack/bench_kernels.py
    # --tune on an H200 (bench/results/kernels-tune-llama-3.2-1b-qwen3-30b-a3b-nvidia-h200-20261129T184337Z.json,
    # M=1, graph time): qkv 7.67 -> 6.53 us, o 6.67 -> 5.73 us, down 17.39 -> 13.70 us against the entries
    # they replace (cuBLAS: 6.39, 5.98, 14.05 us). qkv_proj and o_proj: 96 / 128 programs; the
    # whole K slice of a program is in flight after (num_stages - 1) tiles, so the read is one
    # latency + transfer.
    (3072, 2048): KernelConfig.make("dot", num_warps=4, num_stages=4, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1),
    (2048, 2048): KernelConfig.make("dot", num_warps=4, num_stages=4, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1),
    # up_proj / fused gate_up_proj: 256 programs, ~2 resident per SM, 48 / 96 KB in flight per SM
    # (tuning found nothing better than 1%).
    (8192, 2048): KernelConfig.make("dot", num_warps=4, num_stages=4, BLOCK_N=32, BLOCK_K=128, SPLIT_K=1),
    (16384, 2048): KernelConfig.make("dot", num_warps=4, num_stages=4, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1),
    # down_proj: 128 programs, one per SM, each streaming 256 KB through a 5-deep pipeline; two
    # warps per program (tuned) rather than four: fewer threads share each tile's reduction.
    # Split-K would add a second launch worth ~25% of this kernel.
    (2048, 8192): KernelConfig.make("dot", num_warps=2, num_stages=5, BLOCK_N=16, BLOCK_K=512, SPLIT_K=1),
    # lm_head: 2004 programs; measured 96.7% of copy bandwidth on an H200 (2026-11-29).
    (128256, 2048): KernelConfig.make("dot", num_warps=4, num_stages=4, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1),
}


# The gated gate/up GEMV (gemv_silu_and_mul, problem "gated": True, n = I) streams two row tiles
# per program; where its best tiles differ from the plain kernel's, they are listed here.
SM90_GATED_GEMV_TABLE: dict[tuple[int, int], KernelConfig] = {
    # Llama-3.2-1B gate/up: against the plain up_proj entry (32 x 128, 4 stages) in one process
    # on an H200, batch-1 decode of the fast recipe 898.2 vs 889.6 / 894.5 tok/s single-step and
    # 937.8 vs 913.3 / 913.5 with 8 overlapped steps (bench/results/decode-llama-3.2-1b-shape-
    # nvidia-h200-20261130T012823Z.json; bench/recipes/decode-gated-gemv.json has the variants).
    (8192, 2048): KernelConfig.make("dot", num_warps=4, num_stages=3, BLOCK_N=32, BLOCK_K=256, SPLIT_K=1),
}


def _choose_default(problem, key: str) -> KernelConfig:
    n, k = int(problem["n"]), int(problem["k"])
    if key == "interpreter":
        return KernelConfig.make("dot", num_warps=4, num_stages=2, BLOCK_N=16, BLOCK_K=64, SPLIT_K=1)
    gated = SM90_GATED_GEMV_TABLE.get((n, k)) if key == "sm90" and problem.get("gated") else None
    if gated is not None and _constraint(gated, problem):
        return gated
    tabled = SM90_GEMV_TABLE.get((n, k)) if key == "sm90" else None
    if tabled is not None and _constraint(tabled, problem):
        return tabled
    sms = 132 if key == "sm90" else 108
    stages = 4 if key == "sm90" else 3
    # Split-K costs a second launch (~1-2 us), as much as streaming ~6 MB: avoid it whenever
    # 16-row tiles alone nearly fill the GPU. Otherwise take the widest row tile that still
    # gives >= 1.5 programs per SM, and split K only when even 16-row tiles leave SMs idle.
    block_n = next((b for b in (64, 32) if cdiv(n, b) >= 1.5 * sms), 16)
    split_k = 1
    if cdiv(n, block_n) < 0.9 * sms:
        while cdiv(n, block_n) * split_k < 2 * sms and k // (split_k * 2) >= 256:
            split_k *= 2
    programs = cdiv(n, block_n) * split_k
    # Little's law: ~4.3 TB/s x ~1 us of HBM latency is ~4.5 MB in flight, ~48 KB per SM with
    # margin. Each program keeps (stages - 1) weight tiles of BLOCK_N x BLOCK_K in flight, and
    # about two programs per SM are resident at once (shared memory) when there are more.
    per_sm = min(2.0, max(1.0, programs / sms))
    block_k = 48 * 1024 / (per_sm * (stages - 1) * block_n * _element_size(problem))
    block_k = 1 << max(7, min(9, int(block_k).bit_length() - 1))  # power of two in [128, 512]
    while block_k > 64 and block_k * split_k > k:
        block_k //= 2
    return KernelConfig.make("dot", num_warps=4, num_stages=stages, BLOCK_N=block_n, BLOCK_K=block_k,
                             SPLIT_K=split_k)


def _element_size(problem) -> int:
    return 4 if problem.get("dtype") == "float32" else 2


def _constraint(config: KernelConfig, problem) -> bool:
    if config.variant == "fma" and int(problem["m"]) > 4:
        return False
    # Every split must get at least one K tile.
    if config["SPLIT_K"] * config["BLOCK_K"] > max(config["BLOCK_K"], int(problem["k"])):
        return False
    # Pipelined tiles (weight + padded x) must fit in an H100/H200 SM's 227 KB of shared memory.
    rows = config["BLOCK_N"] + (16 if config.variant == "dot" else 0)
    return config.num_stages * rows * config["BLOCK_K"] * _element_size(problem) <= 227 * 1024


GEMV_SPEC = register(
    KernelSpec(
        op="gemv",
        module=__name__,
        launcher=gemv,
        reference=gemv_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace(
                    "dot",
                    {"BLOCK_N": (16, 32, 64, 128), "BLOCK_K": (64, 128, 256, 512), "SPLIT_K": (1, 2, 4, 8, 16),
                     "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5, 6)},
                    "x rows padded to 16, tensor-core dots, pipelined weight tiles",
                ),
                VariantSpace(
                    "fma",
                    {"BLOCK_N": (8, 16, 32, 64), "BLOCK_K": (128, 256, 512, 1024), "SPLIT_K": (1, 2, 4, 8, 16),
                     "num_warps": (2, 4, 8), "num_stages": (1, 2, 3)},
                    "CUDA-core multiply-reduce, M <= 4",
                ),
            ),
            constraint=_constraint,
        ),
        choose_default=_choose_default,
        problem_keys=("m", "n", "k", "dtype"),
        doc=__doc__ or "",
    )
)
