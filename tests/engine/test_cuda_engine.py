"""CUDA-only engine checks: captured decode graphs agree with eager decode, bf16 agrees
with transformers, and the Llama-3.2-1B-shape preset runs through graphs. Skipped
without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine_factories import hf_greedy, make_engine, make_hf_checkpoint
from shapeshift.engine.core.sampling import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate([9, 14, 5, 11, 7, 12, 30])]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-moe"])
def test_cuda_graph_decode_equals_eager(preset):
    settings = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128, block_size=16,
                    cuda_graph_batch_sizes=[1, 2, 4, 8], cuda_graph_context_lens=[32, 128])
    graphs = make_engine(preset, **settings)
    eager = make_engine(preset, **settings, enforce_eager=True)
    assert graphs.runner.graphs and not eager.runner.graphs
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40, 60)]
    assert graphs.generate(PROMPTS, params) == eager.generate(PROMPTS, params)
    assert graphs.runner.num_graph_replays > 0
    # Re-capture (what a hot reload does) keeps the results.
    graphs.runner.capture_cudagraphs()
    assert graphs.generate(PROMPTS, params) == eager.generate(PROMPTS, params)


def test_moe_grouped_experts_agree_with_the_torch_experts():
    """moe_backend triton (kernels.moe's grouped GEMM, prefill and graph-captured decode) against the
    torch experts (per-expert loop in prefill, gather or dense in decode), float32: logits close,
    the same greedy tokens; and a bf16 engine of the MoE shape runs through its graphs with it."""
    settings = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=128, block_size=16,
                    cuda_graph_batch_sizes=[1, 2, 4, 8], cuda_graph_context_lens=[32, 128])
    torch_experts = make_engine("tiny-moe", **settings)
    grouped = make_engine("tiny-moe", **settings, forward_pass_recipe={"moe_backend": "triton"})
    assert grouped.forward_pass._fused_moe is not None and torch_experts.forward_pass._fused_moe is None
    for prompt in PROMPTS:
        torch.testing.assert_close(grouped.prompt_logits(prompt), torch_experts.prompt_logits(prompt),
                                   atol=2e-4, rtol=2e-4)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40, 60)]
    assert grouped.generate(PROMPTS, params) == torch_experts.generate(PROMPTS, params)
    assert grouped.runner.num_graph_replays > 0
    medium = make_engine("moe-medium-shape", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                         block_size=16, max_num_batched_tokens=512, num_kv_blocks=128,
                         forward_pass_recipe={"moe_backend": "triton"})
    out = medium.generate(PROMPTS[:4], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in out] == [16] * 4 and medium.runner.num_graph_replays >= 14


def test_bf16_logits_close_to_transformers(tmp_path):
    model = make_hf_checkpoint("llama", tmp_path / "m")
    engine = make_engine(tmp_path / "m", device="cuda", dtype="bfloat16")
    hf = model.to("cuda", torch.bfloat16)
    for prompt in PROMPTS[:3]:
        ours = engine.prompt_logits(prompt)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt], device="cuda")).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=0.15, rtol=0.05)
    out = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    ref_tokens, _ = hf_greedy(hf, PROMPTS[0], 8)
    assert out[:4] == ref_tokens[:4]  # bf16 may drift late on near-ties, not at once


def test_llama_3_2_1b_shape_runs_through_graphs():
    engine = make_engine("llama-3.2-1b-shape", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=256,
                         block_size=16, max_num_batched_tokens=512, num_kv_blocks=128)
    out = engine.generate(PROMPTS[:4], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [len(o) for o in out] == [16] * 4
    assert engine.runner.num_graph_replays >= 14
