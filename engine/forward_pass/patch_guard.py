"""References a candidate could patch, captured before any candidate code runs.

Importing this module records the objects a candidate could patch to fake its speed or
its correctness (clocks, synchronisation, the comparison and math functions the gates
use, the shared attention helpers). ``importer.import_bundle`` imports it before it runs a
bundle's code, so the first candidate of a process is already measured against the
originals; the verifier times with the captured clock (a patched ``time.perf_counter``
cannot shorten a measurement), and ``patched_functions()`` lists (``restore_patched()``
repairs) every reference that changed since.

The measuring process (the compile worker, which hot-reloads every candidate it measures into
itself) also guards its own harness: ``capture_harness(modules)``, called before it loads any
candidate, records what those modules hold (every function and class, with the code and
defaults of every function and the methods of the classes they define, every public constant,
and the contents of their public tables such as TOLERANCES); ``harness_patched()`` lists and
``restore_harness()`` puts back what a candidate changed there. The modules are named by the
layers above (engine/verify/anticheat.py HARNESS_MODULES, the evaluator's own); the evaluator
checks them after every measurement and around verification.
"""

from __future__ import annotations

import copy
import importlib
import sys
import time
import types
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
perf_counter = time.perf_counter  # the harness clocks (the evaluator times replays with one of them)
process_time = time.process_time
thread_time = time.thread_time
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


# ------------------------------------------------------------------ the measuring process's harness
_CALLABLE = (types.FunctionType, types.BuiltinFunctionType, type, staticmethod, classmethod, property)
# (label, owner, attr) -> the object bound there when captured
_HARNESS: dict[tuple[str, Any, str], Any] = {}
_HARNESS_FUNCTIONS: list[tuple[str, Any, Any, Any, Any]] = []  # (label, function, code, defaults, kwdefaults)
_HARNESS_TABLES: dict[str, tuple[dict, dict]] = {}  # label -> (the table, a copy of its contents)
_CAPTURED: set[str] = set()


def _keep(attr: str, obj: Any) -> bool:
    return isinstance(obj, _CALLABLE) or (attr.isupper() and not attr.startswith("_"))


def _capture_function(label: str, fn: Any) -> None:
    fn = getattr(fn, "__func__", fn)  # staticmethod, classmethod
    if isinstance(fn, property):
        for part in (fn.fget, fn.fset, fn.fdel):
            if part is not None:
                _capture_function(label, part)
        return
    if isinstance(fn, types.FunctionType):
        _HARNESS_FUNCTIONS.append((label, fn, fn.__code__, fn.__defaults__, dict(fn.__kwdefaults__ or {})))


def _same(table: dict, contents: dict) -> bool:
    """Contents equal (a table whose values do not compare, tensors say, is kept by identity only)."""
    try:
        return bool(table == contents)
    except Exception:  # noqa: BLE001
        return False


def _copy(table: dict) -> dict:
    """The table's contents, copied down to its values' own dicts (a HardwareSpec's FLOPs)."""
    try:
        return copy.deepcopy(table)
    except Exception:  # noqa: BLE001 - values that do not copy are kept by reference
        return dict(table)


def _function_changed(fn: Any, code: Any, defaults: Any, kwdefaults: dict) -> bool:
    return fn.__code__ is not code or fn.__defaults__ is not defaults or (fn.__kwdefaults__ or {}) != kwdefaults


def capture_harness(modules: tuple[str, ...]) -> None:
    """Record the harness ``modules`` (dotted names, imported here): call before any candidate is
    loaded in this process. A module is captured once, the first time; later calls add nothing."""
    for modname in modules:
        if modname in _CAPTURED:
            continue
        module = importlib.import_module(modname)
        _CAPTURED.add(modname)
        for attr, obj in list(vars(module).items()):
            if attr.startswith("__") or not _keep(attr, obj):
                continue
            label = f"{modname}.{attr}"
            _HARNESS[(label, module, attr)] = obj
            _capture_function(label, obj)
            if isinstance(obj, dict) and attr.isupper() and _same(obj, _copy(obj)):
                _HARNESS_TABLES.setdefault(label, (obj, _copy(obj)))
            if isinstance(obj, type) and obj.__module__ == modname:
                for name, member in list(vars(obj).items()):
                    if not name.startswith("__") or name == "__init__":
                        if isinstance(member, _CALLABLE):
                            _HARNESS[(f"{label}.{name}", obj, name)] = member
                            _capture_function(f"{label}.{name}", member)


def harness_patched() -> list[str]:
    """What changed in the captured harness: a rebound name, a function's code or defaults, a
    table's contents (empty before capture_harness)."""
    changed = [label for (label, owner, attr), obj in _HARNESS.items() if vars(owner).get(attr) is not obj]
    for label, fn, code, defaults, kwdefaults in _HARNESS_FUNCTIONS:
        if _function_changed(fn, code, defaults, kwdefaults):
            changed.append(f"{label} (code or defaults)")
    for label, (table, contents) in _HARNESS_TABLES.items():
        if not _same(table, contents):
            changed.append(f"{label} (contents)")
    return sorted(set(changed))


def restore_harness() -> list[str]:
    """Put the captured harness back; what was restored."""
    restored = []
    for (label, owner, attr), obj in _HARNESS.items():
        if vars(owner).get(attr) is not obj:
            setattr(owner, attr, obj)
            restored.append(label)
    for label, fn, code, defaults, kwdefaults in _HARNESS_FUNCTIONS:
        if _function_changed(fn, code, defaults, kwdefaults):
            fn.__code__, fn.__defaults__, fn.__kwdefaults__ = code, defaults, dict(kwdefaults) or None
            restored.append(f"{label} (code or defaults)")
    for label, (table, contents) in _HARNESS_TABLES.items():
        if not _same(table, contents):
            table.clear()
            table.update(_copy(contents))
            restored.append(f"{label} (contents)")
    return sorted(set(restored))


def put_back() -> list[str]:
    """Every captured reference, harness entry and table that changed (patched_functions,
    harness_patched), put back; what had changed."""
    changed = patched_functions() + harness_patched()
    if changed:
        restore_patched()
        restore_harness()
    return changed
