"""LLMEngine on the tiny random presets: preemption with a real model, seeded sampling
independent of batch mates, request validation, abort, stats."""

from __future__ import annotations

import pytest

from engine_factories import make_engine
from shapeshift.engine.core.llm_engine import InvalidRequestError, PromptTooLongError
from shapeshift.engine.core.sampling import SamplingParams

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate([9, 14, 5, 11, 7, 12])]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3", "tiny-moe"])
def test_preemption_resume_gives_same_tokens_as_uninterrupted_run(preset):
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=20, temperature=0.9, top_k=50, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    roomy = make_engine(preset, max_num_seqs=6, max_model_len=64, block_size=4)
    # 16 blocks of 4 tokens: room for one full max_model_len sequence, not for six of ~30 tokens.
    tight = make_engine(preset, max_num_seqs=6, max_model_len=64, block_size=4, num_kv_blocks=16,
                        max_num_batched_tokens=16)
    assert roomy.generate(PROMPTS, greedy) == tight.generate(PROMPTS, greedy)
    assert roomy.generate(PROMPTS, seeded) == tight.generate(PROMPTS, seeded)
    assert tight.stats().num_preemptions > 0
    assert tight.stats().num_free_blocks == 16


def test_seeded_sampling_does_not_depend_on_batch_mates():
    engine = make_engine("tiny-llama", max_num_seqs=8)
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    alone = engine.generate([PROMPTS[0]], params)[0]
    mates = [SamplingParams(max_tokens=n, temperature=1.3, top_p=0.8, ignore_eos=True) for n in (5, 30, 12)]
    together = engine.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]],
                               [mates[0], params, mates[1], mates[2]])
    assert together[1] == alone
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=1.0, seed=8,
                                                              ignore_eos=True))[0]
    assert other_seed != alone  # the seed matters (24 tokens from a 512-token vocabulary)


def test_request_validation_names_the_problem():
    engine = make_engine("tiny-llama", max_model_len=32)
    with pytest.raises(PromptTooLongError, match="32") as exc:
        engine.add_request("long", list(range(3, 40)), SamplingParams())
    assert exc.value.param == "prompt" and isinstance(exc.value, ValueError)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        engine.add_request("oov", [1, 100000], SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already"):
        engine.add_request("dup", [1, 2], SamplingParams())
    for field, kwargs in [("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -1}),
                          ("top_p", {"top_p": 0.0}), ("top_k", {"top_k": -2}), ("seed", {"seed": -1})]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_abort_stats_and_text():
    engine = make_engine("tiny-llama")
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    first = engine.step()
    assert {o.request_id for o in first} == {"a", "b"}
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.batch_size_last_step) == (2, 0, 2)
    assert stats.forward_pass_name == "stock"
    engine.abort_request("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        outs += engine.step()
    b_final = [o for o in outs if o.request_id == "b"][-1]
    assert b_final.finish_reason == "length" and len(b_final.output_token_ids) == 3
    assert engine.stats().num_free_blocks == engine.stats().num_kv_blocks


def test_num_layers_override_loads_fewer_layers():
    engine = make_engine("tiny-moe", num_layers_override=1)
    assert engine.model_config.num_hidden_layers == 1
    assert not any(k.startswith("model.layers.1.") for k in engine.weights)
    assert len(engine.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))[0]) == 4


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
def test_static_decode_buffers_match_eager(preset):
    """The CUDA-graph decode path (static buffers, padded rows writing to the null block,
    fixed KV widths) run eagerly on the CPU gives the same tokens as plain eager decode."""
    settings = dict(max_num_seqs=6, max_model_len=64, block_size=4, cuda_graph_batch_sizes=[1, 2, 4],
                    cuda_graph_context_lens=[16, 32])
    eager = make_engine(preset, **settings)
    static = make_engine(preset, **settings)
    static.runner.emulate_graphs = True
    static.runner.capture_cudagraphs()
    assert sorted(static.runner.graphs) == [(b, w) for b in (1, 2, 4) for w in (4, 8, 16)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    assert static.generate(PROMPTS, params) == eager.generate(PROMPTS, params)
    assert static.runner.num_graph_replays > 0
    assert eager.runner.num_graph_replays == 0
