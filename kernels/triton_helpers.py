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


@triton.jit
def grid_dependency_sync(USE_PDL: tl.constexpr):
    """First statement of a kernel launched with programmatic dependent launch (checks.pdl_options).

    Waits until the kernel ahead in the stream has finished and its writes are visible (nothing
    of this kernel reads or writes memory before), then lets the next kernel's programs launch:
    they in turn wait here, so at most one kernel runs ahead, and only up to this point.
    """
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
