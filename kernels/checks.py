"""Argument checks shared by the kernel launchers.

Every launcher validates shapes, dtypes, devices and strides on the host (metadata only, never
tensor values, so launchers stay free of device syncs and can be captured in CUDA graphs) and
raises `ValueError` naming the op, the argument, what it got and what it expected.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


_INTERPRETER_ACTIVE: bool | None = None


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1 set before importing triton).

    Read once: Triton itself only honours the variable when kernels are first defined, and
    launchers ask on every call (an environment lookup costs microseconds)."""
    global _INTERPRETER_ACTIVE
    if _INTERPRETER_ACTIVE is None:
        _INTERPRETER_ACTIVE = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return _INTERPRETER_ACTIVE


def _pretty_shape(shape: Sequence[int | None]) -> str:
    items = ["*" if s is None else str(s) for s in shape]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    tensor: object,
    *,
    shape: Sequence[int | None] | None = None,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument; `None` entries in `shape` accept any size.

    Launchers call this for every argument of every launch, so the passing path reads each
    piece of tensor metadata once and builds no message; failures are reported by
    `_tensor_problem`, which re-derives what exactly is wrong."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    sizes = tensor.shape
    ok = True
    if shape is not None:
        if len(sizes) != len(shape):
            ok = False
        else:
            for got, want in zip(sizes, shape):
                if want is not None and got != want:
                    ok = False
                    break
    elif ndim is not None and len(sizes) != ndim:
        ok = False
    if ok and dtypes is not None and tensor.dtype not in dtypes:
        ok = False
    if ok and device is not None and tensor.device != device:
        ok = False
    if ok and contiguous and not tensor.is_contiguous():
        ok = False
    if ok and last_dim_contiguous and sizes and sizes[-1] > 1 and tensor.stride(-1) != 1:
        ok = False
    if not ok:
        _tensor_problem(op, name, tensor, shape, ndim, dtypes, device, last_dim_contiguous, contiguous)
    return tensor


def _tensor_problem(op, name, tensor, shape, ndim, dtypes, device, last_dim_contiguous, contiguous) -> None:
    """Raise the ValueError that says what is wrong with `tensor` (the slow, failing path)."""
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and tensor.dim() != ndim:
        expected = f"shape {_pretty_shape(shape)}" if shape is not None else f"{ndim} dims"
        raise ValueError(f"{op}: {name} must have {expected}, got shape {tuple(tensor.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(tensor.shape, shape)):
            if want is not None and got != want:
                raise ValueError(
                    f"{op}: {name} has shape {tuple(tensor.shape)} but expected {_pretty_shape(shape)} "
                    f"(dim {axis} must be {want})"
                )
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if tensor.dtype not in dtypes:
            raise ValueError(f"{op}: {name} has dtype {tensor.dtype}, expected one of: {_dtype_names(dtypes)}")
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{op}: {name} is on {tensor.device} but the other inputs are on {device}; move it with .to({str(device)!r})"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (strides {tensor.stride()}); call .contiguous() first")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must have a unit stride in its last dim (got strides {tensor.stride()}); "
            "call .contiguous() first"
        )
    raise AssertionError(f"{op}: {name} failed a check that _tensor_problem cannot name")  # unreachable


def check_runnable_device(op: str, tensor: torch.Tensor) -> None:
    """Triton kernels run on CUDA, or on the CPU only through the interpreter."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and interpreter_active():
        return
    raise ValueError(
        f"{op}: inputs are on {tensor.device}; Triton kernels need CUDA tensors, or CPU tensors with "
        f"TRITON_INTERPRET=1 set before triton is imported. Use {op}_ref() for plain torch."
    )


def check_same_dtype(op: str, reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        if tensor.dtype != reference.dtype:
            raise ValueError(
                f"{op}: {name} has dtype {tensor.dtype} but {reference_name} has {reference.dtype}; they must match"
            )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor_meta(tensor: torch.Tensor | None) -> tuple | None:
    """(shape, strides, dtype, device): all the metadata the launch checks read; None for None.
    Raises AttributeError for a non-tensor (the launcher's checks then say what is wrong)."""
    return None if tensor is None else (tensor.shape, tensor.stride(), tensor.dtype, tensor.device)


class LaunchPlans(dict):
    """A launcher's memo: argument metadata (+ config) -> what it checked and derived once.

    Checks read metadata only, never values, so a metadata combination that passed once
    passes again; a repeat call (every decode step) skips the checks and the config lookup.
    Plans may hold strides: the key holds every argument's strides, so they are the same on
    every call the plan serves. Bounded: cleared when it reaches `limit` entries."""

    def __init__(self, limit: int = 4096):
        super().__init__()
        self.limit = limit

    def plan(self, planner: Callable[..., Any], tensors: tuple, config: Any) -> Any:
        """The plan for a launch on `tensors` (the launcher's tensor arguments, None for absent
        ones) with `config`: memoised per their metadata, else `planner(*tensors, config)`,
        which runs every check (raising on bad arguments), remembered for the next call."""
        try:
            key = (tuple(map(tensor_meta, tensors)), config)
            plan = self.get(key)
        except (AttributeError, TypeError):  # a non-tensor argument or an unhashable config:
            return planner(*tensors, config)  # the planner's checks say what is wrong
        if plan is None:
            plan = self.remember(key, planner(*tensors, config))
        return plan

    def remember(self, key, plan):
        if len(self) >= self.limit:
            self.clear()
        self[key] = plan
        return plan


class StreamCounters(dict):
    """Int32 counters a kernel's programs coordinate through with atomics (split-K fix-up tiles,
    grid barriers), zero between launches because each launch resets what it used.

    One set per (device type, device index, stream): kernels on one stream never overlap, so
    they can share a set; kernels on two streams may run at once, so each stream has its own."""

    def __init__(self, min_size: int = 1):
        super().__init__()
        self.min_size = min_size

    def for_stream(self, device: torch.device, size: int) -> torch.Tensor | None:
        """The current stream's zeroed counters (at least `size`), or None while a CUDA graph is
        being captured on a stream that has none yet: zeroing them then would only be recorded,
        not done. (ModelRunner warms up on its capture stream, so its graphs find theirs.)"""
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        key = (device.type, device.index, stream)
        counters = self.get(key)
        if counters is None or counters.numel() < size:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            counters = torch.zeros(max(size, self.min_size), dtype=torch.int32, device=device)
            self[key] = counters
        return counters


def cdiv(a: int, b: int) -> int:
    """Ceiling division of ints (triton.cdiv is a constexpr function: ~1 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) constexprs for kernels that call `triton_helpers.dot`.

    Triton's CPU interpreter (seen in 3.7.1) multiplies bfloat16 dot operands as raw 16-bit
    integers, so under the interpreter bfloat16 dots are upcast to float32 first. float32 dots
    use exact IEEE products rather than tf32, so float32 results stay float32-accurate.
    """
    upcast = interpreter_active() and dtype == torch.bfloat16
    return upcast, "ieee" if (dtype == torch.float32 or upcast) else "tf32"


_PDL: dict[Any, dict[str, bool]] = {}
# Kernel families that can launch with programmatic dependent launch (each launcher names its own).
PDL_FAMILIES = ("gemv", "norm", "rotary", "activation", "attention", "sampling", "layer_tail")
# The families on when SHAPESHIFT_PDL is unset. Measured on an H200 (batch-1 decode, fast recipe with
# the rotary fusion, 8 overlapped steps; docs/decode-performance.md, eleventh set): these three
# +1.3-1.5% against none; the attention as well gave back half of that, the attention alone -1%;
# the layer tails cost 2% (sixth set).
DEFAULT_PDL_FAMILIES = "gemv,norm,sampling"


def _pdl_setting() -> str:
    """SHAPESHIFT_PDL as set, or DEFAULT_PDL_FAMILIES when unset."""
    return os.environ.get("SHAPESHIFT_PDL", DEFAULT_PDL_FAMILIES)


def pdl_families(raw: str | None = None) -> frozenset[str]:
    """The kernel families SHAPESHIFT_PDL turns on: "1" / "on" / "all" every one, "0" / "off" /
    empty none, else a comma list of PDL_FAMILIES (e.g. "norm,rotary,attention"); unset,
    DEFAULT_PDL_FAMILIES."""
    raw = (_pdl_setting() if raw is None else raw).strip().lower()
    if raw in ("", "0", "off", "false", "none"):
        return frozenset()
    if raw in ("1", "on", "true", "all"):
        return frozenset(PDL_FAMILIES)
    families = frozenset(f.strip() for f in raw.split(",") if f.strip())
    unknown = sorted(families - set(PDL_FAMILIES))
    if unknown:
        raise ValueError(f"SHAPESHIFT_PDL: unknown kernel families {unknown}; use 1, 0 or a comma list of "
                         f"{', '.join(PDL_FAMILIES)}")
    return families


def pdl_options(device: torch.device, family: str) -> dict[str, bool]:
    """Launch options for programmatic dependent launch (PDL) of a `family` kernel on `device`.

    With PDL (Hopper and later) a kernel's programs may be resident before the kernel ahead of it
    in the stream has finished: each such kernel waits on the grid dependency (``USE_PDL``, see
    triton_helpers.grid_dependency_sync) before it touches memory, then lets the next one launch.
    What it saves is the launch and dispatch gap between dependent kernels, which dominates the
    small kernels of a batch-1 decode step. On where SHAPESHIFT_PDL names the family, or, unset,
    for DEFAULT_PDL_FAMILIES (see pdl_families); only on CUDA, compute capability 9.0 or newer, a
    Triton that knows ``launch_pdl``; never in the interpreter.
    Returns the keyword arguments for the launch: {"USE_PDL": bool} plus ``launch_pdl`` when on.
    """
    if family not in PDL_FAMILIES:
        raise ValueError(f"pdl_options: unknown kernel family {family!r}; one of {', '.join(PDL_FAMILIES)}")
    raw = _pdl_setting()
    key = (device.type, device.index, family, raw)
    if key not in _PDL:
        on = (device.type == "cuda" and not interpreter_active() and family in pdl_families(raw)
              and torch.cuda.get_device_capability(device)[0] >= 9 and _triton_knows_pdl())
        _PDL[key] = {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}
    return _PDL[key]


def gemv_pdl_trigger_late() -> bool:
    """Where a GEMV under PDL lets the next kernel launch: after its weight stream
    (SHAPESHIFT_PDL_GEMV_TRIGGER=late) or right after its own wait (early, the default)."""
    raw = os.environ.get("SHAPESHIFT_PDL_GEMV_TRIGGER", "early").strip().lower()
    if raw not in ("early", "late"):
        raise ValueError(f"SHAPESHIFT_PDL_GEMV_TRIGGER must be early or late, got {raw!r}")
    return raw == "late"


def gemv_prefetch_columns() -> int:
    """Weight columns per row a GEMV program prefetches into L2 before anything else (its
    grid-dependency wait under PDL, its norm prologue) (SHAPESHIFT_GEMV_PREFETCH, default 0: none). Read
    on every call (the launchers are cheap next to a launch), so a benchmark can switch it."""
    raw = os.environ.get("SHAPESHIFT_GEMV_PREFETCH", "0")
    try:
        columns = int(raw)
    except ValueError:
        raise ValueError(f"SHAPESHIFT_GEMV_PREFETCH must be a whole number of columns, got {raw!r}") from None
    if columns < 0:
        raise ValueError(f"SHAPESHIFT_GEMV_PREFETCH must be >= 0, got {columns}")
    return columns


def _triton_knows_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
