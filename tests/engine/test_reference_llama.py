"""The engine against Hugging Face transformers on the same random dense checkpoints.

Covers Llama (llama3 rope scaling), tied embeddings, Qwen2 (qkv bias), Qwen3 (q/k norm):
prompt logits through the paged cache, greedy tokens and decode-step logprobs, with
prompts batched together, chunked by a small token budget and spanning several blocks.
"""

from __future__ import annotations

import pytest
import torch

from engine_factories import VOCAB, hf_greedy, make_engine, make_hf_checkpoint
from shapeshift.engine.core.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [
    [5],
    [17, 33, 2, 90, 101],
    [int(x) for x in torch.randint(3, VOCAB, (13,), generator=torch.Generator().manual_seed(1))],
    [int(x) for x in torch.randint(3, VOCAB, (29,), generator=torch.Generator().manual_seed(2))],
]
NEW_TOKENS = 12
LOGIT_ATOL = 2e-4


def check_against_hf(kind: str, tmp_path, **engine_overrides) -> None:
    model = make_hf_checkpoint(kind, tmp_path / kind)
    engine = make_engine(tmp_path / kind, **engine_overrides)

    # 1. Prompt logits at every position, through the paged cache.
    for prompt in PROMPTS:
        ours = engine.prompt_logits(prompt)
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(ours, ref, atol=LOGIT_ATOL, rtol=1e-4)

    # 2. All prompts in one engine run: greedy tokens and decode logprobs match HF.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{i}", prompt, params)
    outputs: dict[str, list] = {f"p{i}": [] for i in range(len(PROMPTS))}
    batch_sizes = []
    while engine.has_unfinished_requests():
        step_out = engine.step()
        batch_sizes.append(engine.stats().batch_size_last_step)
        for o in step_out:
            outputs[o.request_id].append(o)
    assert max(batch_sizes) == len(PROMPTS), "prompts were never batched together"
    for i, prompt in enumerate(PROMPTS):
        ref_tokens, ref_logits = hf_greedy(model, prompt, NEW_TOKENS)
        final = outputs[f"p{i}"][-1]
        assert final.finished and final.finish_reason == "length"
        assert final.output_token_ids == ref_tokens, f"prompt {i} (len {len(prompt)}) diverged from HF"
        ours_lp = torch.tensor([lp for o in outputs[f"p{i}"] for lp in o.logprobs])
        ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, torch.tensor(ref_tokens)[:, None])[:, 0]
        torch.testing.assert_close(ours_lp, ref_lp, atol=LOGIT_ATOL, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen2", "qwen3"])
def test_dense_matches_hf(kind, tmp_path):
    check_against_hf(kind, tmp_path)


def test_chunked_prefill_small_budget_matches_hf(tmp_path):
    # 8 tokens per step: the 29-token prompt is computed in chunks while others decode.
    check_against_hf("llama", tmp_path, max_num_batched_tokens=8, max_num_seqs=4, block_size=2)


def test_prefix_cache_hit_gives_same_tokens(tmp_path):
    make_hf_checkpoint("qwen3", tmp_path / "m")
    engine = make_engine(tmp_path / "m", block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = PROMPTS[3]
    first = engine.generate([prompt], params)[0]
    hits_before = engine.stats().prefix_cache_hit_tokens
    second = engine.generate([prompt], params)[0]
    hit_tokens = engine.stats().prefix_cache_hit_tokens - hits_before
    assert hit_tokens == (len(prompt) - 1) // 4 * 4  # every full block but the last token's
    assert second == first


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projection_recipe_matches_hf(kind, tmp_path):
    check_against_hf(kind, tmp_path, forward_pass_recipe={"fuse_qkv": True, "fuse_gate_up": True})


def test_unknown_recipe_knob_is_rejected(tmp_path):
    make_hf_checkpoint("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="fuse_everything"):
        make_engine(tmp_path / "m", forward_pass_recipe={"fuse_everything": True})


def test_one_token_prefill_chunks_next_to_decodes_match_hf(tmp_path):
    # A budget equal to max_num_seqs leaves single-token prefill chunks beside decodes:
    # such a batch has one new token per sequence but is not a pure decode batch.
    check_against_hf("qwen2", tmp_path, max_num_batched_tokens=4, max_num_seqs=4, block_size=2)
