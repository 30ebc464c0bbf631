"""What each rank runs in the multi-process parallel tests (importable by spawned children).

Data flow: the test process calls ``launch(run_cases, 2, cases)``; every rank walks the
same list of (preset, layout) cases over one gloo world, creating that layout's groups,
building a ``ParallelLLMEngine`` and either driving it (the replica's rank 0: prompt
logits, then a greedy batch) or following; each driver returns its observations.
"""

from __future__ import annotations

from typing import Any

from shapeshift.engine.core.config import EngineConfig
from shapeshift.engine.parallel.engine import ControlChannel, ParallelLLMEngine, SeqStep, StepMessage
from shapeshift.engine.parallel.layout import ParallelLayout
from shapeshift.engine.parallel.process_group import init_parallel
from shapeshift.engine.core.sampling import SamplingParams

# Chunked prefill (budget 16 < the first prompt), mixed prefill+decode steps, and decode
# batches shrinking 3 -> 2 -> 1 (MoE: the dense-expert and the gather paths both run).
PROMPTS = [list(range(3, 25)), list(range(40, 50)), [7, 8, 9]]
MAX_TOKENS = [3, 5, 7]
LOGITS_PROMPT = list(range(1, 20))


def engine_config(model: str, device: str = "cpu") -> EngineConfig:
    # float32 on CUDA too (TF32 is off by default for matmuls), so tolerances stay tight;
    # on CUDA the decode steps replay CUDA graphs that contain the collectives.
    return EngineConfig(model=model, device=device, dtype="float32", max_model_len=128, max_num_seqs=4,
                        max_num_batched_tokens=16, num_kv_blocks=32)


def observe(engine: Any) -> dict[str, Any]:
    """Prompt logits [T, V], greedy tokens and their logprobs of PROMPTS."""
    logits = engine.prompt_logits(LOGITS_PROMPT)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=True) for m in MAX_TOKENS]
    ids = [f"case-{i}" for i in range(len(PROMPTS))]
    for rid, prompt, p in zip(ids, PROMPTS, params):
        engine.add_request(rid, prompt, p)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id].extend(out.logprobs or [])
            if out.finished:
                tokens[out.request_id] = out.output_token_ids
    return {"logits": logits, "tokens": [tokens[r] for r in ids], "logprobs": [logprobs[r] for r in ids]}


def run_cases(rank: int, world_size: int, cases: list[tuple[str, str]], device: str = "cpu") -> dict[str, Any]:
    results: dict[str, Any] = {"channel": channel_roundtrip(rank, world_size, device)}
    for model, layout_name in cases:
        layout = ParallelLayout.parse(layout_name)
        state = init_parallel(layout, rank, world_size, device=None if device == "cuda" else "cpu")
        engine = ParallelLLMEngine(engine_config(model, device), state)
        key = f"{model}/{layout.name}"
        if engine.is_driver:
            try:
                results[key] = {**observe(engine), "coords": state.coords.__dict__,
                                "kv_heads_per_rank": engine.kv_cache.k[0].shape[2],
                                "forward_pass": engine.stats().forward_pass_name,
                                "cuda_graphs": len(engine.runner.graphs)}
            finally:
                engine.shutdown()
        else:
            results[key] = {"follower_steps": engine.follow(), "kv_heads_per_rank": engine.kv_cache.k[0].shape[2]}
    return results


def wrong_world(rank: int, world_size: int) -> None:
    init_parallel(ParallelLayout(tp=4), rank, world_size)


CHANNEL_MESSAGES = [
    StepMessage("run", [SeqStep(start=5, tokens=[9], num_tokens=6, block_table=[3])]),
    # Larger than the channel's buffer: takes the second-broadcast path.
    StepMessage("run", [SeqStep(start=0, tokens=list(range(40_000)), num_tokens=40_000, block_table=list(range(2500)))]),
    StepMessage("stop", []),
]


def channel_roundtrip(rank: int, world_size: int, device: str) -> list[Any] | None:
    """The driver sends CHANNEL_MESSAGES; the follower returns what it received."""
    state = init_parallel(ParallelLayout(tp=2), rank, world_size, device=None if device == "cuda" else "cpu")
    channel = ControlChannel(state)
    if state.is_driver:
        for message in CHANNEL_MESSAGES:
            channel.send(message)
        return None
    return [channel.receive() for _ in CHANNEL_MESSAGES]


def fused_layer_kernels(rank: int, world_size: int, layout_name: str, recipe: dict[str, Any]) -> dict[str, bool]:
    """Build this rank's parallel forward pass with ``recipe`` (tiny Llama, its shard of the
    weights) and say which batch-1 layer kernels it kept: the layer tail and the whole-layer
    kernel run a layer's projections without the all-reduces between them."""
    import torch

    from shapeshift.engine.core.config import ModelConfig
    from shapeshift.engine.forward_passes.parallel.forward import ParallelForwardPass
    from shapeshift.engine.models.loader import random_weights
    from shapeshift.engine.parallel.sharding import shard_weights
    from shapeshift.engine.models.presets import PRESETS

    layout = ParallelLayout.parse(layout_name)
    state = init_parallel(layout, rank, world_size, device="cpu")
    cfg = ModelConfig.from_hf(PRESETS["tiny-llama"].hf_config)
    weights = shard_weights(random_weights(cfg, seed=1, dtype=torch.float32, device="cpu"), cfg, layout, state.coords)
    fp = ParallelForwardPass(cfg, weights, recipe)
    return {"layer_tail": fp._layer_tail is not None, "whole_layer": fp._whole_layer is not None}
