"""Anti-cheat checks: the captured references a candidate could patch, and the speed of light.

The references (clocks, synchronisation, comparison and math functions) are captured by
``shapeshift.engine.forward_pass.patch_guard`` before any candidate is imported; this module
re-exports them for the gates and times with the captured clock, so a patched
``time.perf_counter`` cannot shorten a measurement.

The speed-of-light bound turns a measured decode step into evidence: a step cannot
move its weights and KV through memory faster than the device's peak bandwidth, nor
do its FLOPs faster than its peak throughput. A candidate reported faster than that
is measuring something other than real work.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from shapeshift.engine.forward_pass.patch_guard import (_REFERENCE, PATCH_TARGETS, TENSOR_METHODS, _cuda_synchronize,  # noqa: F401
                                                        patched_functions, perf_counter, restore_patched)

# The verifier's own modules. A process that measures candidates in itself (the compile worker
# hot-reloads each one it measures) captures them with patch_guard.capture_harness before any
# candidate loads, and checks and puts them back after every measurement: a candidate must not
# widen the tolerances, lower the measured-output thresholds or replace verify_candidate there.
HARNESS_MODULES = (
    "shapeshift.engine.verify", "shapeshift.engine.verify.gates", "shapeshift.engine.verify.outputs",
    "shapeshift.engine.verify.kv_isolation", "shapeshift.engine.verify.anti_cheat_gates",
    "shapeshift.engine.verify.context", "shapeshift.engine.verify.agreement", "shapeshift.engine.verify.report",
    "shapeshift.engine.verify.anticheat", "shapeshift.engine.verify.measured", "shapeshift.engine.verify.isolated",
    "shapeshift.engine.verify.selftest", "shapeshift.engine.verify.sampling_gate",
    "shapeshift.engine.verify.concurrency", "shapeshift.engine.forward_pass.tolerances",
    "shapeshift.engine.forward_pass.weights_guard", "shapeshift.engine.forward_pass.patch_guard",
)

def foreign_threads(before: set[int]) -> list[str]:
    """Threads started since ``before`` (thread idents) that are not the harness's own
    (deadline.HARNESS_THREADS, by identity: a name proves nothing)."""
    from shapeshift.engine.forward_pass.deadline import HARNESS_THREADS

    own = set(HARNESS_THREADS)
    return sorted(t.name for t in threading.enumerate() if t.ident not in before and t not in own)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        _cuda_synchronize(device)


def timed(fn: Any, device: torch.device, repeats: int = 5) -> tuple[float, Any]:
    """Median wall seconds of ``fn()`` with device synchronisation, on the captured clock."""
    samples = []
    result = None
    for _ in range(repeats):
        synchronize(device)
        t0 = perf_counter()
        result = fn()
        synchronize(device)
        samples.append(perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2], result


# ------------------------------------------------------------------ speed of light


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    memory_bytes_per_s: float  # peak DRAM/HBM bandwidth
    flops_per_s: dict[str, float]  # dtype -> peak dense FLOP/s
    cache_bytes: float  # last-level cache: weights smaller than this may never touch DRAM


HARDWARE = {
    "h200": HardwareSpec("NVIDIA H200", 4.8e12, {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}, 60e6),
    "h100": HardwareSpec("NVIDIA H100", 3.35e12, {"bfloat16": 989e12, "float16": 989e12, "float32": 494e12}, 50e6),
    "b200": HardwareSpec("NVIDIA B200", 8.0e12, {"bfloat16": 2.25e15, "float16": 2.25e15, "float32": 1.1e15}, 126e6),
    "a100": HardwareSpec("NVIDIA A100", 2.0e12, {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12}, 40e6),
    # Deliberately generous for any CPU this runs on: the bound must never reject honest work.
    "cpu": HardwareSpec("CPU (generous bound)", 1.0e12, {"bfloat16": 20e12, "float16": 20e12, "float32": 20e12}, 1e9),
    "unknown-gpu": HardwareSpec("unknown GPU (generous bound)", 10e12,
                                {"bfloat16": 5e15, "float16": 5e15, "float32": 5e15}, 256e6),
}


def detect_hardware(device: torch.device) -> HardwareSpec:
    if device.type != "cuda":
        return HARDWARE["cpu"]
    name = torch.cuda.get_device_name(device).lower()
    for key in ("h200", "h100", "b200", "a100"):
        if key in name:
            return HARDWARE[key]
    return HARDWARE["unknown-gpu"]


def decode_step_lower_bound_s(model_config: Any, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                              batch_size: int, context_len: int, hw: HardwareSpec) -> dict[str, float]:
    """The least time one decode step of ``batch_size`` sequences can take on ``hw``.

    bytes: every non-embedding weight read once (the embedding contributes B rows;
    a tied head is read in full) plus each sequence's K/V; FLOPs: 2 per weight per
    token plus attention (4 * context * heads * head_dim per token and layer).
    """
    embed = weights["model.embed_tokens.weight"]
    elem = embed.element_size()
    weight_bytes = sum(t.numel() * t.element_size() for n, t in weights.items() if n != "model.embed_tokens.weight")
    head_params = embed.numel() if model_config.tie_word_embeddings else 0
    weight_bytes += head_params * elem + batch_size * embed.shape[1] * elem
    params = sum(t.numel() for n, t in weights.items() if n != "model.embed_tokens.weight") + head_params
    if model_config.family == "moe":  # only the routed experts are read (upper-bounded below by top-k share)
        expert = sum(t.numel() for n, t in weights.items() if ".mlp.experts." in n)
        active = expert * min(1.0, batch_size * model_config.num_experts_per_tok / model_config.num_experts)
        params = params - expert + active
        weight_bytes = weight_bytes - expert * elem + active * elem
    layers, kv_heads, hd = model_config.num_hidden_layers, model_config.num_key_value_heads, model_config.head_dim
    kv_bytes = batch_size * context_len * layers * 2 * kv_heads * hd * elem
    flops = 2 * params * batch_size + batch_size * layers * 4 * context_len * model_config.num_attention_heads * hd
    dram_bytes = (weight_bytes + kv_bytes) if weight_bytes + kv_bytes > hw.cache_bytes else 0.0
    peak_flops = hw.flops_per_s.get(str(dtype).replace("torch.", ""), max(hw.flops_per_s.values()))
    memory_s = dram_bytes / hw.memory_bytes_per_s
    compute_s = flops / peak_flops
    return {"bytes": float(weight_bytes + kv_bytes), "flops": float(flops), "memory_s": memory_s,
            "compute_s": compute_s, "bound_s": max(memory_s, compute_s)}
