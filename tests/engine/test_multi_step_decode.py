"""Multi-step decode (EngineConfig.decode_steps): k greedy steps back to back on the device
give exactly the tokens of one step at a time, stop where a one-step engine stops, fall
back to single steps when they must, and leave the KV cache as a one-step engine does.

The graph path runs on the CPU through the runner's emulation (the same static buffers,
padding and KV widths as CUDA graphs, replayed eagerly), so these run in CI; the CUDA
graphs themselves are exercised by hack/bench_decode.py --decode-steps on a GPU.
"""

from __future__ import annotations

import pytest

from engine_factories import make_engine
from shapeshift.engine.core.sampling import SamplingParams

PROMPTS = [[3 + (7 * i + j) % 250 for j in range(n)] for i, n in enumerate([9, 14, 5, 11, 7, 12])]
SETTINGS = dict(max_num_seqs=8, max_model_len=64, block_size=4, cuda_graph_batch_sizes=[1, 2, 4, 8],
                cuda_graph_context_lens=[16, 32])


def graph_engine(preset: str = "tiny-llama", **overrides):
    engine = make_engine(preset, **{**SETTINGS, **overrides})
    engine.runner.emulate_graphs = True
    engine.runner.capture_cudagraphs()
    return engine


def run(engine, prompts, params):
    """generate(), plus the most tokens any one RequestOutput carried and the engine steps taken."""
    ids = [f"r{i}" for i in range(len(prompts))]
    params = params if isinstance(params, list) else [params] * len(prompts)
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    outputs, reasons, widest, steps = {}, {}, 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            widest = max(widest, len(o.new_token_ids))
            if o.new_token_ids:  # a burst's tokens are the newest of the request's output, in order
                assert o.output_token_ids[-len(o.new_token_ids):] == o.new_token_ids
            if o.finished:
                outputs[o.request_id], reasons[o.request_id] = o.output_token_ids, o.finish_reason
    return [outputs[r] for r in ids], [reasons[r] for r in ids], widest, steps


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("k", [4, 8])
def test_k_steps_give_the_tokens_of_single_steps(preset, k):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    single = graph_engine(preset)
    multi = graph_engine(preset, decode_steps=k)
    want, want_reasons, one, single_steps = run(single, PROMPTS, params)
    got, reasons, widest, multi_steps = run(multi, PROMPTS, params)
    assert got == want and reasons == want_reasons == ["length"] * len(PROMPTS)
    assert one == 1 and widest == k  # bursts of k tokens happened, never more than k
    assert multi_steps < single_steps / 2
    assert multi.runner.num_graph_replays == single.runner.num_graph_replays  # same work, fewer host round trips
    assert multi.stats().num_free_blocks == single.stats().num_free_blocks == multi.block_manager.num_blocks


def test_a_stop_token_inside_a_burst_ends_the_request_there():
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    reference, _, _, _ = run(graph_engine(), PROMPTS[:3], greedy)
    # Stop on the 6th token request 0 produces: inside the second burst of 4.
    stop = reference[0][5]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want, want_reasons, _, _ = run(graph_engine(), PROMPTS[:3], params)
    multi = graph_engine(decode_steps=4)
    got, reasons, widest, _ = run(multi, PROMPTS[:3], params)
    assert got == want and reasons == want_reasons
    assert reasons[0] == "stop" and got[0] == reference[0][:got[0].index(stop) + 1] and len(got[0]) <= 6
    assert widest == 4
    assert multi.stats().num_free_blocks == multi.block_manager.num_blocks  # the extra steps' slots came back


def test_discarded_steps_leave_nothing_behind_in_the_prefix_cache():
    """A request that stops inside a burst wrote KV for tokens that never existed; a later
    request sharing its prompt must still decode exactly as on a fresh engine."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fresh, _, _, _ = run(graph_engine(), [PROMPTS[1]], greedy)
    multi = graph_engine(decode_steps=8)
    stop = fresh[0][2]
    run(multi, [PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))
    hits_before = multi.block_manager.prefix_cache_hit_tokens
    again, _, _, _ = run(multi, [PROMPTS[1]], greedy)
    assert multi.block_manager.prefix_cache_hit_tokens > hits_before  # the prompt's blocks were reused
    assert again == fresh


def test_single_steps_when_multi_step_does_not_apply():
    # Sampling (not greedy): every output carries one token.
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=11 + i, ignore_eos=True) for i in range(3)]
    want, _, _, _ = run(graph_engine(), PROMPTS[:3], sampled)
    got, _, widest, _ = run(graph_engine(decode_steps=8), PROMPTS[:3], sampled)
    assert got == want and widest == 1
    # Requests waiting for admission (batch width 2, six requests): no bursts while they wait,
    # bursts once the queue is empty; the tokens are those of single steps either way.
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want, _, _, _ = run(graph_engine(max_num_seqs=2), PROMPTS, greedy)
    engine = graph_engine(max_num_seqs=2, decode_steps=8)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"q{i}", prompt, greedy)
    widths_while_waiting, widths_after = set(), set()
    outputs = {}
    while engine.has_unfinished_requests():
        waiting = bool(engine.scheduler.waiting)
        for o in engine.step():
            (widths_while_waiting if waiting else widths_after).add(len(o.new_token_ids))
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
    assert [outputs[f"q{i}"] for i in range(len(PROMPTS))] == want
    assert widths_while_waiting == {1} and max(widths_after) == 8
    # A KV cache too small for k more tokens per sequence: single steps, same tokens.
    tight = graph_engine(decode_steps=8, num_kv_blocks=16, max_num_batched_tokens=16)
    want, _, _, _ = run(graph_engine(), PROMPTS[:4], greedy)
    got, _, _, _ = run(tight, PROMPTS[:4], greedy)
    assert got == want


@pytest.mark.parametrize("overlap", [False, True])
def test_whole_chunk_graphs_give_the_tokens_of_single_steps(overlap):
    """With chunk graphs for every bucket, a chunk of k steps is one replay of a graph whose
    steps read their staging and the previous step's tokens themselves; the tokens, the stop
    reasons and the freed KV are those of single steps. Chunks of another length (a request's
    last) take the one-step graph."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    want, want_reasons, _, _ = run(graph_engine(), PROMPTS, params)
    engine = graph_engine(decode_steps=4, overlap_decode=overlap, chunk_graph_max_batch=8)
    assert set(engine.runner.chunk_graphs) == set(engine.runner.graphs)
    got, reasons, widest, _ = run(engine, PROMPTS, params)
    assert got == want and reasons == want_reasons and widest == 4
    runner = engine.runner
    assert runner.num_chunk_replays > 0
    assert runner.num_graph_replays > 4 * runner.num_chunk_replays  # some chunks were shorter than 4
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


def test_whole_chunk_graphs_only_up_to_their_batch_size_and_chunk_length():
    engine = graph_engine(decode_steps=4, chunk_graph_max_batch=2)  # the buckets of 1 and 2 sequences
    assert 4 in engine.runner.graph_batch_sizes  # a bucket left to the one-step graph
    assert sorted(engine.runner.chunk_graphs) == [(b, w) for b in (1, 2) for w in engine.runner.graph_widths]
    default = graph_engine(decode_steps=4)  # default: every bucket up to 16 sequences
    assert sorted(default.runner.chunk_graphs) == [(b, w) for b in default.runner.graph_batch_sizes if b <= 16
                                                   for w in default.runner.graph_widths]
    assert not graph_engine(decode_steps=4, chunk_graph_max_batch=0).runner.chunk_graphs
    assert not graph_engine(decode_steps=1).runner.chunk_graphs  # no chunks to capture
    # decode_steps changed at run time: the chunk graphs are captured again for the new length
    # (19 decode steps: 8 + 8 in chunk graphs, then 3 through the one-step graph).
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want, _, _, _ = run(graph_engine(), PROMPTS[:1], greedy)
    engine.set_runtime_settings({"decode_steps": 8})
    assert engine.runner._chunk_steps == 8
    got, _, widest, _ = run(engine, PROMPTS[:1], greedy)
    assert got == want and widest == 8 and engine.runner.num_chunk_replays == 2
    engine.runner.num_chunk_replays = 0
    engine.set_runtime_settings({"decode_steps": 4})
    want, _, _, _ = run(graph_engine(), PROMPTS[1:2], greedy)  # a prompt not in the prefix cache
    got, _, widest, _ = run(engine, PROMPTS[1:2], greedy)
    assert got == want and widest == 4 and engine.runner.num_chunk_replays == 4  # 19 decode steps: 4 x 4 + 3
    from shapeshift.engine.core.config import EngineConfig

    with pytest.raises(ValueError, match="chunk_graph_max_batch"):
        EngineConfig(chunk_graph_max_batch=-1)


def test_decode_steps_must_be_positive():
    from shapeshift.engine.core.config import EngineConfig

    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (real graph replays)")
@pytest.mark.parametrize("chunk_graphs", [0, 8])
def test_k_steps_on_cuda_graphs_give_the_tokens_of_single_steps(chunk_graphs):
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    def cuda_engine(k: int):
        return LLMEngine(EngineConfig(model="tiny-llama", device="cuda", dtype="float32", max_num_seqs=8,
                                      max_model_len=64, block_size=4, decode_steps=k,
                                      chunk_graph_max_batch=chunk_graphs))

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    single, multi = cuda_engine(1), cuda_engine(8)
    assert multi.runner.graphs
    want, _, _, _ = run(single, PROMPTS, params)
    got, _, widest, _ = run(multi, PROMPTS, params)
    assert got == want and widest == 8
    assert (multi.runner.num_chunk_replays > 0) == bool(chunk_graphs)
