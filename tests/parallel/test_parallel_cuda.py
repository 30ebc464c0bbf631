"""Tensor- and expert-parallel serving on 2 GPUs (NCCL, CUDA graphs holding the collectives)
equals one GPU. Skips without 2 CUDA devices; run on a multi-GPU host:

    PYTHONSAFEPATH=1 pytest tests/parallel/test_parallel_cuda.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from parallel_cases import engine_config, observe, run_cases
from shapeshift.engine.core.llm_engine import LLMEngine
from shapeshift.engine.parallel.layout import ParallelLayout
from shapeshift.engine.parallel.process_group import launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 CUDA devices")

CASES = [("tiny-llama", "tp2"), ("tiny-qwen3", "tp2"), ("tiny-moe", "ep2"), ("tiny-moe", "tp2-ep2"),
         ("tiny-moe", "tp2")]


@pytest.fixture(scope="module")
def parallel_results() -> dict:
    return launch(run_cases, 2, CASES, "cuda", timeout_s=600, threads_per_process=0)[0]


@pytest.mark.parametrize("model,layout", CASES, ids=[f"{m}-{lay}" for m, lay in CASES])
def test_parallel_on_gpus_matches_one_gpu(parallel_results, model, layout):
    ref = observe(LLMEngine(engine_config(model, "cuda")))
    got = parallel_results[f"{model}/{ParallelLayout.parse(layout).name}"]
    assert got["cuda_graphs"] > 0, "decode must have replayed CUDA graphs with the collectives inside"
    torch.testing.assert_close(torch.from_numpy(np.asarray(got["logits"])), ref["logits"].cpu(), atol=1e-4, rtol=0)
    assert got["tokens"] == ref["tokens"]
    for lp, lp_ref in zip(got["logprobs"], ref["logprobs"]):
        np.testing.assert_allclose(lp, lp_ref, atol=1e-3, rtol=0)
