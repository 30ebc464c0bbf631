"""SiLU-and-mul (the SwiGLU gate of Llama-style MLPs).

Math, per row of the fused gate/up projection x = [gate | up] of width 2I:
    out[i] = round(round(silu(gate[i])) * up[i]),   silu(g) = g / (1 + exp(-g))
computed in float32; the two roundings to the input dtype match Hugging Face's
`act_fn(gate_proj(x)) * up_proj(x)` evaluated in that dtype.

Data flow: x [T, 2I] -> grid (T, cdiv(I, BLOCK)) -> out [T, I]. Reads 2I and writes I
elements per row: memory bound; the search space varies the tile width and warps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import (FLOAT_DTYPES, LaunchPlans, cdiv, check_runnable_device, check_same_dtype, check_tensor,
                     dtype_name, pdl_options)
from shapeshift.kernels.registry import KernelConfig, KernelSpec, KernelConfigSpace, VariantSpace, register
from shapeshift.kernels.triton_helpers import grid_dependency_sync


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    inner,  # I
    stride_x,
    stride_out,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    grid_dependency_sync(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inner + cols, mask=mask, other=0.0).to(tl.float32)
    activated = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch reference: float32 math with the kernel's rounding points."""
    inner = x.shape[-1] // 2
    gate, up = x[..., :inner].float(), x[..., inner:].float()
    activated = torch.nn.functional.silu(gate).to(x.dtype).float()
    return (activated * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] for x [T, 2I] -> [T, I]."""
    config, grid_n = _PLANS.plan(_plan, (x, out), config)
    T, width = x.shape
    inner = width // 2
    if out is None:
        out = torch.empty((T, inner), dtype=x.dtype, device=x.device)
    if T == 0 or inner == 0:
        return out
    _silu_and_mul_kernel[(T, grid_n)](
        x, out, inner, x.stride(0), out.stride(0),
        BLOCK=config["BLOCK"], num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_options(x.device, "activation"),
    )
    return out


# (argument metadata, config) -> (config, column programs), see checks.LaunchPlans.
_PLANS = LaunchPlans()


def _plan(x, out, config):
    """All argument checks of silu_and_mul, the config, and the grid's column count."""
    op = "silu_and_mul"
    check_tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_runnable_device(op, x)
    T, width = x.shape
    if width % 2 != 0:
        raise ValueError(f"{op}: x must be [T, 2*I] (gate then up), but its last dim {width} is odd")
    inner = width // 2
    if out is not None:
        check_tensor(op, "out", out, shape=(T, inner), device=x.device)
        check_same_dtype(op, "x", x, out=out)
    if config is None:
        config = SILU_AND_MUL_SPEC.default_config({"rows": T, "inner": inner, "dtype": dtype_name(x.dtype)}, x.device)
    return config, cdiv(inner, config["BLOCK"])


def _choose_default(problem, key: str) -> KernelConfig:
    inner = int(problem["inner"])
    rows = int(problem["rows"])
    if key == "interpreter":
        return KernelConfig.make("tile", num_warps=4, num_stages=1, BLOCK=256)
    # Small batches: narrow tiles so the grid still spreads over every SM; large batches:
    # wide tiles so each program streams more bytes per launch-scheduling decision.
    block = 512 if rows <= 16 else 1024 if rows <= 1024 else 2048
    block = min(block, max(256, triton.next_power_of_2(inner)))
    return KernelConfig.make("tile", num_warps=4 if block <= 1024 else 8, num_stages=1, BLOCK=block)


SILU_AND_MUL_SPEC = register(
    KernelSpec(
        op="silu_and_mul",
        module=__name__,
        launcher=silu_and_mul,
        reference=silu_and_mul_ref,
        config_space=KernelConfigSpace(
            variants=(
                VariantSpace(
                    "tile",
                    {"BLOCK": (256, 512, 1024, 2048, 4096), "num_warps": (2, 4, 8), "num_stages": (1,)},
                    "one row x BLOCK columns per program",
                ),
            ),
        ),
        choose_default=_choose_default,
        problem_keys=("rows", "inner", "dtype"),
        doc=__doc__ or "",
    )
)
