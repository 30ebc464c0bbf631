"""Small @triton.jit helpers shared by several kernels."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ b with a float32 accumulator; see checks.dot_flags for UPCAST / PRECISION."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result
