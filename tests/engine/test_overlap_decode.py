"""Overlapped multi-step decode (EngineConfig.overlap_decode): the next chunk of decode steps
is launched before the host reads the one in flight. The tokens, finish reasons, prefix cache
and KV accounting must be exactly those of one step at a time, whatever stops, arrives,
aborts or reconfigures the engine while a chunk is in flight.

The graph path runs on the CPU through the runner's emulation (tests/engine/
test_multi_step_decode.py explains it); the CUDA case at the end uses real graphs, events and
pinned buffers.
"""

from __future__ import annotations

import pytest
import torch

from test_multi_step_decode import PROMPTS, graph_engine, run
from shapeshift.engine.core.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


def overlapped(k: int = 4, **overrides):
    return graph_engine(decode_steps=k, overlap_decode=True, **overrides)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-moe"])
@pytest.mark.parametrize("k", [2, 4, 8])
def test_chained_chunks_give_the_tokens_of_single_steps(preset, k):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    want, want_reasons, _, _ = run(graph_engine(preset), PROMPTS, params)
    engine = graph_engine(preset, decode_steps=k, overlap_decode=True)
    chained = []
    real_launch = engine.runner.launch_decode_steps

    def launch(batch, steps, ahead=0):
        chained.append(ahead)
        return real_launch(batch, steps, ahead=ahead)

    engine.runner.launch_decode_steps = launch
    got, reasons, widest, _ = run(engine, PROMPTS, params)
    assert got == want and reasons == want_reasons
    assert widest == k and any(a > 0 for a in chained)  # chunks really were chained onto chunks in flight
    assert not engine.has_unfinished_requests() and engine._inflight is None
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks  # every slot came back


def test_a_stop_inside_a_chunk_discards_the_chained_one():
    reference, _, _, _ = run(graph_engine(), PROMPTS[:3], GREEDY)
    stop = reference[0][5]  # request 0's 6th token: inside its second chunk of 4
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want, want_reasons, _, _ = run(graph_engine(), PROMPTS[:3], params)
    engine = overlapped(4)
    got, reasons, _, _ = run(engine, PROMPTS[:3], params)
    assert got == want and reasons == want_reasons and reasons[0] == "stop"
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks
    # Alone, the request shows the discarded chunk: the overlapped engine replayed the steps
    # chained after the stop, which multi-step decode without overlap never launches.
    plain, alone = graph_engine(decode_steps=4), overlapped(4)
    want_alone, _, _, _ = run(plain, PROMPTS[:1], params)
    got_alone, _, _, _ = run(alone, PROMPTS[:1], params)
    assert got_alone == want_alone == [got[0]]
    assert alone.runner.num_graph_replays > plain.runner.num_graph_replays
    assert alone.stats().num_free_blocks == alone.block_manager.num_blocks


def test_discarded_chained_steps_leave_nothing_in_the_prefix_cache():
    """The chunk chained after a stop wrote KV past the stop; a request sharing the prompt
    must still decode exactly as on a fresh engine."""
    fresh, _, _, _ = run(graph_engine(), [PROMPTS[1]], GREEDY)
    engine = overlapped(4)
    stop = fresh[0][2]
    run(engine, [PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]))
    hits = engine.block_manager.prefix_cache_hit_tokens
    again, _, _, _ = run(engine, [PROMPTS[1]], GREEDY)
    assert engine.block_manager.prefix_cache_hit_tokens > hits and again == fresh


def test_arrivals_aborts_and_reconfiguration_while_a_chunk_is_in_flight():
    want, _, _, _ = run(graph_engine(), PROMPTS, GREEDY)
    engine = overlapped(4)
    for i in range(3):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 3:  # arrivals while a chunk is in flight: admitted once it is read
            assert engine._inflight is not None
            for i in range(3, 6):
                engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
        if steps == 6:
            engine.abort_request("r5")
        if steps == 8:  # a runtime change reads the chunk in flight first; its tokens still go out
            engine.set_runtime_settings({"decode_steps": 2})
            assert engine._inflight is None
        for o in engine.step():
            if o.finished:
                outputs[o.request_id], reasons[o.request_id] = o.output_token_ids, o.finish_reason
    assert reasons["r5"] == "abort"
    for i in range(5):
        assert outputs[f"r{i}"] == want[i] and reasons[f"r{i}"] == "length"
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


def test_a_new_forward_pass_waits_for_the_chunk_in_flight():
    want, _, _, _ = run(graph_engine(), PROMPTS[:2], GREEDY)
    engine = overlapped(4)
    for i in range(2):
        engine.add_request(f"r{i}", PROMPTS[i], GREEDY)
    engine.step()
    engine.step()
    assert engine._inflight is not None
    engine.set_forward_pass(engine.bundle)  # the same pass, re-captured: the chunk is read first
    assert engine._inflight is None and engine._drained_outputs
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.output_token_ids
    assert [outputs["r0"], outputs["r1"]] == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real graphs, events, pinned buffers)")
@pytest.mark.parametrize("chunk_graphs", [0, 8])
def test_chained_chunks_on_cuda_graphs_give_the_tokens_of_single_steps(chunk_graphs):
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    def cuda_engine(**knobs):
        return LLMEngine(EngineConfig(model="tiny-llama", device="cuda", dtype="float32", max_num_seqs=8,
                                      max_model_len=64, block_size=4, **knobs))

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    want, _, _, _ = run(cuda_engine(), PROMPTS, params)
    engine = cuda_engine(decode_steps=4, overlap_decode=True, chunk_graph_max_batch=chunk_graphs)
    assert engine.runner.graphs
    got, _, widest, _ = run(engine, PROMPTS, params)
    assert got == want and widest == 4
    assert (engine.runner.num_chunk_replays > 0) == bool(chunk_graphs)
