"""Shared helpers for kernel tests: tolerance table, poisoning, relative-error checks."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Relative tolerances for elementwise / normalisation kernels compared in the kernel's dtype
# (the reference computes in float32 with the same rounding points, so the gap is a few ulps).
ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# Tolerances on ||out - ref|| / ||ref|| for reductions through matrix units (attention, GEMM):
# float32 dots may run as tf32 on a GPU.
NORM_TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def poisoned(shape, dtype, device) -> torch.Tensor:
    """An output buffer full of NaN, so any element the kernel forgets to write fails the check."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7777, dtype=dtype, device=device)


def assert_close_elementwise(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: contains NaN (unwritten or invalid elements)"
    tol = ELEMENTWISE_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def assert_close_norm(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: contains NaN (unwritten or invalid elements)"
    out64, ref64 = out.double(), ref.double()
    rel = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert rel <= NORM_TOL[dtype], f"{what}: relative error {rel:.2e} > {NORM_TOL[dtype]:.0e} for {dtype}"
