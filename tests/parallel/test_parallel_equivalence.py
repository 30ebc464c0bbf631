"""Tensor- and expert-parallel serving over 2 CPU processes (gloo) equals one process.

One launch of 2 ranks walks every case (presets x layouts) over the same world, so the
process start-up is paid once; the single-process reference is the ordinary
``LLMEngine`` with the stock forward pass on the same random checkpoint.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parallel_cases import CHANNEL_MESSAGES, engine_config, observe, run_cases, wrong_world
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.parallel.engine import PARALLEL_BUNDLE_DIR
from shapeshift.engine.parallel.process_group import launch

CASES = [
    ("tiny-llama", "tp2"),          # dense TP, untied head
    ("tiny-qwen3", "tp2"),          # q/k norm, tied embeddings, head_dim 32
    ("tiny-moe", "ep2"),            # experts split, attention replicated
    ("tiny-moe", "tp2-ep2"),        # attention TP + experts split
    ("tiny-moe", "tp2"),            # attention TP + each expert split in half
    ("tiny-llama", "dp2"),          # two independent replicas
]
LOGITS_ATOL = 2e-5  # fp32 partial sums in another order; logits here are O(0.1)


@pytest.fixture(scope="module")
def parallel_results() -> dict:
    ranks = launch(run_cases, 2, CASES, timeout_s=240)
    return {"rank0": ranks[0], "rank1": ranks[1]}


@pytest.fixture(scope="module")
def references() -> dict:
    return {model: observe(LLMEngine(engine_config(model))) for model in {m for m, _ in CASES}}


def _key(model: str, layout: str) -> str:
    from shapeshift.engine.parallel.layout import ParallelLayout

    return f"{model}/{ParallelLayout.parse(layout).name}"


@pytest.mark.parametrize("model,layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_parallel_matches_single_process(parallel_results, references, model, layout):
    ref = references[model]
    drivers = [parallel_results["rank0"][_key(model, layout)]]
    if layout.startswith("dp"):
        drivers.append(parallel_results["rank1"][_key(model, layout)])  # rank 1 drives its own replica
    else:
        follower = parallel_results["rank1"][_key(model, layout)]
        assert follower["follower_steps"] > 3, "the follower must have run the driver's steps"
    for got in drivers:
        assert got["forward_pass"] == "parallel"
        logits = torch.from_numpy(np.asarray(got["logits"]))
        assert logits.shape == ref["logits"].shape
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, ref["logits"], atol=LOGITS_ATOL, rtol=0)
        assert got["tokens"] == ref["tokens"]
        for lp, lp_ref in zip(got["logprobs"], ref["logprobs"]):
            np.testing.assert_allclose(lp, lp_ref, atol=1e-4, rtol=0)


def test_kv_cache_holds_only_local_kv_heads(parallel_results):
    # tiny-llama: 2 KV heads; tp=2 -> one per rank; dp=2 -> both on each replica.
    assert parallel_results["rank0"][_key("tiny-llama", "tp2")]["kv_heads_per_rank"] == 1
    assert parallel_results["rank1"][_key("tiny-llama", "tp2")]["kv_heads_per_rank"] == 1
    assert parallel_results["rank0"][_key("tiny-llama", "dp2")]["kv_heads_per_rank"] == 2
    assert parallel_results["rank0"][_key("tiny-moe", "ep2")]["kv_heads_per_rank"] == 2  # attention replicated


def test_parallel_bundle_single_process_equals_stock(references):
    cfg = engine_config("tiny-moe")
    cfg.forward_pass = str(PARALLEL_BUNDLE_DIR)
    engine = LLMEngine(cfg)
    assert engine.forward_pass_name == "parallel"
    got = observe(engine)
    torch.testing.assert_close(got["logits"], references["tiny-moe"]["logits"], atol=1e-6, rtol=0)
    assert got["tokens"] == references["tiny-moe"]["tokens"]


def test_launch_reports_a_rank_failure_with_its_cause():
    with pytest.raises(RuntimeError, match=r"layout tp4-ep1-dp1-pp1 needs 4 processes, 2 were started"):
        launch(wrong_world, 2, timeout_s=120)


def test_control_channel_carries_small_and_oversized_messages(parallel_results):
    assert parallel_results["rank1"]["channel"] == CHANNEL_MESSAGES


@pytest.mark.parametrize("layout,kept", [("tp2", False), ("dp2", True)])
def test_tensor_parallel_turns_the_fused_layer_kernels_off(layout, kept):
    """Under tp > 1 the all-reduces sit between a layer's projections, so the pass builds without
    the layer tail and the whole-layer kernel (same recipe); without tensor parallelism it keeps
    both. Real 2-rank gloo world, construction only."""
    from parallel_cases import fused_layer_kernels
    from shapeshift.engine.forward_pass.recipes import NAMED_RECIPES

    recipe = {**NAMED_RECIPES["fast"], "fuse_rotary_into_attention": True, "fuse_attention_into_layer": True}
    ranks = launch(fused_layer_kernels, 2, layout, recipe, timeout_s=240)
    assert ranks == [{"layer_tail": kept, "whole_layer": kept}] * 2
