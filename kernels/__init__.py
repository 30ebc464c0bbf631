"""Triton kernels for the engine's forward pass, each with a plain-torch reference and a
declared search space (see registry.py).

Importing this package imports torch but not triton; the ops are imported lazily from their
modules (shapeshift.kernels.rmsnorm, .activation, .rotary, .decode_attention, .gemv,
.sampling, .prefill_attention, .moe), so callers that only need the registry metadata or the
references pay for Triton only when they launch a kernel. On a machine without CUDA, set
TRITON_INTERPRET=1 before triton is imported to run the kernels on the CPU (slowly).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "rmsnorm": "rmsnorm", "rmsnorm_ref": "rmsnorm",
    "silu_and_mul": "activation", "silu_and_mul_ref": "activation",
    "rotary_kv_write": "rotary", "rotary_kv_write_ref": "rotary", "rope_cos_sin_cache": "rotary",
    "decode_attention": "decode_attention", "decode_attention_ref": "decode_attention",
    "gemv": "gemv", "gemv_ref": "gemv",
    "sample": "sampling", "sampling_probs_ref": "sampling", "sample_ref": "sampling",
    "argmax": "sampling", "argmax_ref": "sampling",
    "prefill_attention": "prefill_attention", "prefill_attention_ref": "prefill_attention",
    "topk_routing": "moe", "topk_routing_ref": "moe", "moe_align": "moe", "moe_align_ref": "moe",
    "moe_grouped_gemm": "moe", "moe_grouped_gemm_ref": "moe", "fused_moe": "moe", "fused_moe_ref": "moe",
    "KernelConfig": "registry", "KernelSpec": "registry", "SearchSpace": "registry", "all_specs": "registry",
    "get_spec": "registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
