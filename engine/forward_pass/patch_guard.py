"""References a candidate could patch, captured before any candidate code runs.

Importing this module records the objects a candidate could patch to fake its speed or
its correctness (clocks, synchronisation, the comparison and math functions the gates
use, the shared attention helpers). ``importer.import_bundle`` imports it before it runs a
bundle's code, so the first candidate of a process is already measured against the
originals; the verifier times with the captured clock (a patched ``time.perf_counter``
cannot shorten a measurement), and ``patched_functions()`` lists (``restore_patched()``
repairs) every reference that changed since.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (captured through PATCH_TARGETS)

# torch._dynamo rebinds torch.manual_seed (and friends) the first time it is imported,
# which can happen lazily in the middle of a candidate's run (torch.compile, some
# Triton paths). Import it before the references are captured so that torch's own
# rebinding is never mistaken for a candidate patching the harness.
try:
    import torch._dynamo  # noqa: F401
except Exception:  # pragma: no cover - builds without dynamo
    pass

# ------------------------------------------------------------------ captured references
perf_counter = time.perf_counter  # the harness clock
_cuda_synchronize = torch.cuda.synchronize

PATCH_TARGETS: dict[str, tuple[str, ...]] = {
    # every clock the evaluator may time with (wall, process or thread CPU time) and the engine reads
    "time": ("perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns",
             "process_time", "process_time_ns", "thread_time", "thread_time_ns", "sleep"),
    "torch": ("matmul", "softmax", "log_softmax", "isfinite", "isnan", "allclose", "equal", "argmax",
              "topk", "cat", "stack", "randn", "randint", "manual_seed", "zeros", "empty", "full"),
    "torch.nn.functional": ("linear", "embedding", "scaled_dot_product_attention", "silu", "softmax",
                            "log_softmax", "rms_norm"),
    "torch.cuda": ("synchronize", "Event", "CUDAGraph", "graph"),
    "shapeshift.engine.core.attention": ("write_kv", "paged_attention", "paged_decode_attention",
                                    "paged_prefill_attention", "AttentionContext"),
    "shapeshift.engine.core.kv_cache": ("KVCache",),
    # the engine's samplers: a replaced sampler serves other tokens than the logits say
    "shapeshift.engine.core.sampling": ("sample", "apply_processors", "apply_min_p", "apply_top_k_top_p"),
    "shapeshift.engine.core.device_sampling": ("ChunkSampler", "device_sampler", "hashed_uniforms",
                                               "sample_hashed"),
}
TENSOR_METHODS = ("__matmul__", "argmax", "float", "copy_", "clone", "sum", "tolist", "item", "max", "abs",
                  "isfinite", "equal", "allclose", "index_copy_")


def _lookup(owner: str, attr: str) -> Any:
    target = _resolve(owner)
    return getattr(target, attr, None)


def _snapshot() -> dict[tuple[str, str], Any]:
    snap: dict[tuple[str, str], Any] = {}
    for modname, attrs in PATCH_TARGETS.items():
        for attr in attrs:
            snap[(modname, attr)] = _lookup(modname, attr)
    for attr in TENSOR_METHODS:
        snap[("torch.Tensor", attr)] = _lookup("torch.Tensor", attr)
    for attr in ("elapsed_time", "record", "synchronize"):
        snap[("torch.cuda.Event", attr)] = _lookup("torch.cuda.Event", attr)
    return snap


def _resolve(owner: str) -> Any:
    if owner == "torch.Tensor":
        return torch.Tensor
    if owner == "torch.cuda.Event":
        return torch.cuda.Event
    return sys.modules.get(owner) or importlib.import_module(owner)


_REFERENCE = _snapshot()
_REFERENCE_TRACE = sys.gettrace()
_REFERENCE_PROFILE = sys.getprofile()


def patched_functions() -> list[str]:
    """Names of captured references that are no longer the captured objects."""
    now = _snapshot()
    changed = [f"{m}.{a}" for (m, a), obj in _REFERENCE.items() if now.get((m, a)) is not obj]
    if sys.gettrace() is not _REFERENCE_TRACE:
        changed.append("sys.settrace")
    if sys.getprofile() is not _REFERENCE_PROFILE:
        changed.append("sys.setprofile")
    return sorted(changed)


def restore_patched() -> list[str]:
    """Put every patched reference back (a cheating candidate must not leave the process broken)."""
    restored = []
    for (owner, attr), obj in _REFERENCE.items():
        if _lookup(owner, attr) is not obj and obj is not None:
            setattr(_resolve(owner), attr, obj)
            restored.append(f"{owner}.{attr}")
    return restored
