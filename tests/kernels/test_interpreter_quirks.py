"""Known defects of Triton's CPU interpreter that the kernels work around, checked against the
installed Triton so the suite says whether each workaround is still needed.

Kernels upcast bfloat16 values to float32 before any arithmetic with a Python constant, and
`checks.dot_flags` upcasts bfloat16 dot operands under the interpreter. Each test below
reports XFAIL (with the Triton version) while the defect is present, and passes once fixed.
"""

import pytest
import torch
import triton
import triton.language as tl

from shapeshift.kernels.checks import dot_flags, interpreter_active

pytestmark = pytest.mark.skipif(not interpreter_active(), reason="checks the CPU interpreter only")


@triton.jit
def _bf16_plus_constant(x_ptr, y_ptr):
    offs = tl.arange(0, 16)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def _bf16_dot(a_ptr, b_ptr, c_ptr):
    o = tl.arange(0, 16)
    tile = o[:, None] * 16 + o[None, :]
    tl.store(c_ptr + tile, tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile)))


def test_interpreter_bf16_plus_python_constant():
    x = torch.randn(16).to(torch.bfloat16)
    y = torch.empty_like(x)
    try:
        _bf16_plus_constant[(1,)](x, y)
    except Exception as error:  # triton.runtime.errors.InterpreterError
        pytest.xfail(f"triton {triton.__version__} interpreter cannot add a constant to bf16: {error}")
    assert torch.equal(y, x + 1.0)


def test_interpreter_bf16_dot():
    a, b = torch.randn(16, 16).to(torch.bfloat16), torch.randn(16, 16).to(torch.bfloat16)
    c = torch.empty(16, 16)
    _bf16_dot[(1,)](a, b, c)
    assert dot_flags(torch.bfloat16)[0], "bf16 dots must be upcast under the interpreter"
    error = (c - a.float() @ b.float()).abs().max().item()
    if error > 1e-2:
        pytest.xfail(f"triton {triton.__version__} interpreter computes bf16 tl.dot wrongly (max error {error:.3g})")


@triton.jit
def _to_bf16(x_ptr, y_ptr):
    offs = tl.arange(0, 1024)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))


def test_interpreter_float32_to_bf16_rounds_to_nearest_even():
    """A GPU rounds float32 -> bfloat16 to nearest even; an interpreter that truncates makes
    chains of bf16 rounding points drift further from a torch reference than on the GPU, so
    bf16 tests of such chains (tests/kernels/test_decode_layer_tail.py) run on CUDA only."""
    x = torch.randn(1024)
    y = torch.empty(1024, dtype=torch.bfloat16)
    _to_bf16[(1,)](x, y)
    matching = (y == x.to(torch.bfloat16)).float().mean().item()
    if matching < 1.0:
        pytest.xfail(f"triton {triton.__version__} interpreter rounds float32 -> bf16 differently from torch "
                     f"({matching:.1%} of values equal; truncation gives ~50%)")
