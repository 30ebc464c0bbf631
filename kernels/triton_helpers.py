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
    grid_dependency_wait(USE_PDL)
    launch_dependents(USE_PDL)


@triton.jit
def grid_dependency_wait(USE_PDL: tl.constexpr):
    """The wait half of grid_dependency_sync, for kernels that let the next one launch later
    (launch_dependents): until then the next kernel's programs take no place on the SMs."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel in the stream launch (it still waits for this one to finish)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


# A program's row of clock stamps (clock_stamp): STAMP_SLOTS int64, the SM it ran on in SM_SLOT.
# (The jit function below spells them as literals: Triton reads no plain Python globals.)
STAMP_SLOTS = 16
SM_SLOT = STAMP_SLOTS - 1


@triton.jit
def clock_stamp(stamps_ptr, pid, slot: tl.constexpr, TIMING: tl.constexpr):
    """With TIMING, store the GPU's nanosecond clock (%globaltimer, one clock for every SM) as
    stamp `slot` of this program's row of STAMP_SLOTS int64 in stamps_ptr; with slot 0 also the
    SM it runs on (%smid) in SM_SLOT. CUDA only: the benchmarks' view of where a kernel's time
    goes (hack/bench_layer_tail.py --phases)."""
    if TIMING:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [pid], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(stamps_ptr + pid * 16 + slot, now)  # STAMP_SLOTS a row
        if slot == 0:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [pid], dtype=tl.int32,
                                           is_pure=False, pack=1)
            tl.store(stamps_ptr + pid * 16 + 15, sm.to(tl.int64))  # SM_SLOT


@triton.jit
def prefetch_l2(ptrs):
    """Ask for the 128-byte lines holding `ptrs` to be brought into L2; no registers are written
    and nothing waits for the data (PTX prefetch.global.L2). CUDA only, never in the interpreter."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows_l2(base_ptr, rows, stride_row, k_start, k_end, COLUMNS: tl.constexpr, LINE: tl.constexpr):
    """Prefetch into L2 columns [k_start, min(k_start + COLUMNS, k_end)) of `rows` (int64 [R]) of a
    row-major matrix, one request per LINE elements (one 128-byte line; COLUMNS // LINE is a power
    of two). Meant for weights ahead of a grid-dependency wait: weights are not written by the
    kernel in front, so their stream can start while that kernel finishes."""
    cols = tl.minimum(k_start + tl.arange(0, COLUMNS // LINE) * LINE, k_end - 1)
    prefetch_l2(base_ptr + rows[:, None] * stride_row + cols[None, :])


@triton.jit
def prefetch_share_l2(base_ptr, lines, pid, num_programs, LINE: tl.constexpr, CHUNK: tl.constexpr):
    """This program's share of prefetching `lines` 128-byte lines (LINE elements each) from
    base_ptr into L2: lines split evenly over num_programs programs, CHUNK requests at a time."""
    per = tl.cdiv(lines, num_programs)
    start = pid * per
    end = tl.minimum(start + per, lines)
    for first in range(start, end, CHUNK):
        line = tl.minimum(first + tl.arange(0, CHUNK), end - 1).to(tl.int64)  # clamped: repeats are harmless
        prefetch_l2(base_ptr + line * LINE)
