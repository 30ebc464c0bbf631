"""RMSNorm, optionally fused with the residual add that precedes it in a decoder layer.

Math (Llama / Qwen convention, as in Hugging Face `LlamaRMSNorm`), per row of N elements:
    h   = x + residual                      (rounded to the input dtype; written to residual_out)
    r   = 1 / sqrt(mean(float32(h)^2) + eps)
    out = round(round(float32(h) * r) * weight)
Without a residual, h = x. The two roundings to the input dtype reproduce the Hugging Face
order of operations (normalise in float32, cast, then multiply by the weight).

Data flow: x [M, N] (+ residual [M, N]) -> one program per ROWS_PER_PROGRAM rows, the whole
row in registers (N padded to a power of two) -> out [M, N] (and residual_out [M, N], which
may alias residual for an in-place update). Reads 2 (or 1) and writes 2 (or 1) rows: memory
bound; the search space varies warps and rows per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, LaunchPlans, cdiv, check_runnable_device, check_same_dtype, check_tensor,
                     dtype_name, next_power_of_2, pdl_options)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import grid_dependency_sync

MAX_HIDDEN = 65536


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [M, N]
    residual_ptr,  # [M, N] (unused without HAS_RESIDUAL)
    weight_ptr,  # [N]
    out_ptr,  # [M, N]
    residual_out_ptr,  # [M, N] (unused without HAS_RESIDUAL)
    M,
    N,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_sync(USE_PDL)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS_PER_PROGRAM):
        row = (pid * ROWS_PER_PROGRAM + i).to(tl.int64)
        mask = col_mask & (row < M)
        # All arithmetic in float32: the interpreter of some Triton releases cannot add a
        # Python constant to a bfloat16 tensor, and the GPU path upcasts anyway.
        h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
            h_rounded = (h + r).to(residual_out_ptr.dtype.element_ty)
            tl.store(residual_out_ptr + row * stride_residual_out + cols, h_rounded, mask=mask)
            h = h_rounded.to(tl.float32)
        mean_square = tl.sum(h * h, axis=0) / N
        inv_rms = 1.0 / tl.sqrt(mean_square + eps)
        normed = (h * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference (float32 math, same rounding points as the kernel)."""
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, h)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [M, N] (rows may be strided), optionally after adding `residual` [M, N].

    Returns `out`, or `(out, residual_out)` when a residual is given; `residual_out` may be the
    `residual` tensor itself (in-place update, as a decoder layer wants). For per-head norms
    (Qwen3 q/k norm) pass a [T * heads, head_dim] view.
    """
    config, constexprs = _PLANS.plan(_plan, (x, weight, residual, out, residual_out), config)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None and residual_out is None:
        residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    M, N = x.shape
    if M == 0:
        return out if residual is None else (out, residual_out)
    res = residual if residual is not None else x
    res_out = residual_out if residual_out is not None else out
    _rmsnorm_kernel[(cdiv(M, constexprs["ROWS_PER_PROGRAM"]),)](
        x, res, weight, out, res_out,
        M, N,
        x.stride(0), res.stride(0), out.stride(0), res_out.stride(0),
        float(eps),
        **constexprs, **pdl_options(x.device, "norm"),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out if residual is None else (out, residual_out)


# (argument metadata, config) -> (config, constexpr kwargs), see checks.LaunchPlans.
_PLANS = LaunchPlans()


def _plan(x, weight, residual, out, residual_out, config):
    """All argument checks of rmsnorm, the config, and the constexprs they imply."""
    op = "rmsnorm"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, x)
    M, N = x.shape
    if N > MAX_HIDDEN:
        raise ValueError(f"{op}: hidden size {N} exceeds the supported maximum {MAX_HIDDEN}")
    check_tensor(op, "weight", weight, shape=(N,), dtypes=FLOAT_DTYPES, device=x.device)
    if residual is not None:
        check_tensor(op, "residual", residual, shape=(M, N), device=x.device)
        check_same_dtype(op, "x", x, residual=residual)
    if out is not None:
        check_tensor(op, "out", out, shape=(M, N), device=x.device)
        check_same_dtype(op, "x", x, out=out)
    if residual is not None and residual_out is not None:
        check_tensor(op, "residual_out", residual_out, shape=(M, N), device=x.device)
        check_same_dtype(op, "x", x, residual_out=residual_out)
    if config is None:
        config = RMSNORM_SPEC.default_config({"rows": M, "hidden": N, "dtype": dtype_name(x.dtype)}, x.device)
    constexprs = {"HAS_RESIDUAL": residual is not None, "BLOCK_N": next_power_of_2(N),
                  "ROWS_PER_PROGRAM": config["ROWS_PER_PROGRAM"]}
    return config, constexprs


def _choose_default(problem, key: str) -> KernelConfig:
    hidden = int(problem["hidden"])
    rows = int(problem["rows"])
    if key == "interpreter":
        return KernelConfig.make("row", num_warps=4, num_stages=1, ROWS_PER_PROGRAM=1)
    # One row per program keeps many programs in flight; wide rows want more warps so each
    # thread holds at most ~16 elements (no spills) and issues 16-byte loads.
    warps = 1 if hidden <= 512 else 2 if hidden <= 1024 else 4 if hidden <= 4096 else 8 if hidden <= 8192 else 16
    rows_per_program = 1 if rows <= 4096 or hidden > 1024 else 4
    return KernelConfig.make("row", num_warps=warps, num_stages=1, ROWS_PER_PROGRAM=rows_per_program)


def _constraint(config: KernelConfig, problem) -> bool:
    # A program must cover at least one 32-lane warp of columns per warp to avoid idle lanes.
    return config.num_warps * 32 <= max(32, next_power_of_2(int(problem["hidden"])))


RMSNORM_SPEC = register(
    KernelSpec(
        op="rmsnorm",
        module=__name__,
        launcher=rmsnorm,
        reference=rmsnorm_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace(
                    "row",
                    {"ROWS_PER_PROGRAM": (1, 2, 4, 8), "num_warps": (1, 2, 4, 8, 16), "num_stages": (1,)},
                    "whole row in registers, ROWS_PER_PROGRAM rows per program",
                ),
            ),
            constraint=_constraint,
        ),
        choose_default=_choose_default,
        problem_keys=("rows", "hidden", "dtype"),
        doc=__doc__ or "",
    )
)
