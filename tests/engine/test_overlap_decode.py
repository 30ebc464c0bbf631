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

    def launch(batch, k, ahead=0, **options):
        chained.append(ahead)
        return real_launch(batch, k, ahead=ahead, **options)

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
    want, _, _, _ = run(cuda_engine(decode_steps=1), PROMPTS, params)  # single steps (CUDA's default is 8)
    engine = cuda_engine(decode_steps=4, overlap_decode=True, chunk_graph_max_batch=chunk_graphs)
    assert engine.runner.graphs
    got, _, widest, _ = run(engine, PROMPTS, params)
    assert got == want and widest == 4
    assert (engine.runner.num_chunk_replays > 0) == bool(chunk_graphs)


def stream(engine, prompts, params, arrivals=None):
    """Every RequestOutput of each request, in order; asserts no output follows a finished one.
    ``arrivals``: {step: [(request index, ...)]}, requests added at that step (else all at once)."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    arrivals = arrivals or {0: list(range(len(prompts)))}
    got: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(f"r{i}", prompts[i], params[i])
        step += 1
        for o in engine.step():
            assert not (got[o.request_id] and got[o.request_id][-1].finished), "output after a finish"
            got[o.request_id].append(o)
    return [got[f"r{i}"] for i in range(len(prompts))]


def final(outs):
    """(output tokens, text, finish reason), checking the streamed pieces add up to them."""
    last = outs[-1]
    assert last.finished and [t for o in outs for t in o.new_token_ids] == last.output_token_ids
    return last.output_token_ids, "".join(o.text_delta for o in outs), last.finish_reason


@pytest.mark.parametrize("k", [4, 8])
def test_a_chain_runs_on_across_finishes_with_the_tokens_of_single_steps(k):
    """Lengths that end at different steps, a stop token inside a chunk and a stop string: one
    chain from the first decode to the last finish, rows leaving it as they end; every token,
    text piece and finish reason as with single steps, and nothing streamed after a finish."""
    reference = [final(o) for o in stream(graph_engine(), PROMPTS, GREEDY)]
    stop_token = reference[1][0][6]  # request 1's 7th token: inside its second chunk
    stop_text = reference[2][1][9:12]  # three characters of request 2's text
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    params[1] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token])
    params[2] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop_text])
    want = [final(o) for o in stream(graph_engine(), PROMPTS, params)]
    assert want[1][2] == want[2][2] == "stop" and len(want[2][0]) < 30
    engine = overlapped(k)
    got = [final(o) for o in stream(engine, PROMPTS, params)]
    assert got == want
    chains = engine.stats().decode_chains
    assert chains["chains"] == 1 and chains["end.finish"] == 1 and chains["kept_past_finish"] >= 4
    assert sum(v for key, v in chains.items() if key.startswith("end.")) == 1
    assert chains["single.prefill"] >= 1 and chains["steps"] >= 39  # the longest request's 39 decode steps
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks
    # As before chain_across_finishes: the same outputs, a chain ended at every finish.
    before = overlapped(k, chain_across_finishes=False)
    assert [final(o) for o in stream(before, PROMPTS, params)] == want
    ends = before.stats().decode_chains
    assert ends["chains"] > 3 and ends["end.finish"] == ends["chains"] and ends["kept_past_finish"] == 0


def test_a_chunk_is_as_long_as_its_longest_lived_row():
    """A row with fewer tokens left than the chunk computes only those (its later steps write
    the null slot, and only its real steps' KV slots are reserved); the chunk does not shrink
    to it."""
    engine = overlapped(8)
    writes = []
    real_launch = engine.runner.launch_decode_steps

    def launch(batch, k, ahead=0, steps=None, **options):
        steps_or_k = list(steps) if steps else [k] * len(batch.seqs)
        writes.append((k, steps_or_k))
        bm = engine.block_manager  # the block tables cover each row's real steps, no more
        assert [len(s.block_table) for s in batch.seqs] == [
            bm.blocks_needed(s.num_computed_tokens + ahead + n) for s, n in zip(batch.seqs, steps_or_k)]
        return real_launch(batch, k, ahead=ahead, steps=steps, **options)

    engine.runner.launch_decode_steps = launch
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 30)]
    want = [final(o) for o in stream(graph_engine(), PROMPTS[:2], params)]
    got = [final(o) for o in stream(engine, PROMPTS[:2], params)]
    assert got == want
    assert writes[0] == (8, [3, 8])  # request 0's 3 decode steps in a chunk of 8, not a chunk of 3
    assert all(len(steps) == 1 for _, steps in writes[1:])  # request 1 alone after that
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("join", [True, False])
def test_arrivals_join_a_running_chain_or_end_it(join):
    """Requests arriving while a chain runs: with chain_across_admissions their prompts run
    between two chunks and they join the chain (one chain for the whole run); without, each
    arrival ends the chain, its prefill runs as a single step and a new chain starts. The
    tokens, text and finish reasons are those of single steps either way."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 17, 24, 1, 20)]
    arrivals = {0: [0, 1], 4: [2], 6: [3], 9: [4]}
    want = [final(o) for o in stream(graph_engine(), PROMPTS[:5], params, arrivals=arrivals)]
    engine = overlapped(4, chain_across_admissions=join)
    got = [final(o) for o in stream(engine, PROMPTS[:5], params, arrivals=arrivals)]
    assert got == want
    chains = engine.stats().decode_chains
    if join:  # request 3 (max_tokens 1) ends with its first token and never takes a decode row
        assert chains["chains"] == 1 and chains["end.admission"] == 0 and chains["end.finish"] == 1
        assert chains["kept_past_admission"] == 3 and chains["admitted_in_chain"] == 3
        assert chains["single.prefill"] == 1  # only the first two prompts, before the chain
    else:
        # (an arrival during a prefill step finds no chain to end)
        assert chains["end.admission"] >= 2 and chains["kept_past_admission"] == 0
        assert chains["chains"] == chains["end.admission"] + chains["end.finish"] and chains["single.prefill"] >= 4
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


def test_arrivals_that_cannot_join_end_the_chain():
    """A sampled arrival, one with logprobs and one whose prompt is longer than a step's token
    budget end the chain (their first tokens need the host); a greedy one queued behind them
    waits its turn. Tokens of greedy requests and every finish as with single steps."""
    long_prompt = [3 + (5 * j) % 250 for j in range(40)]
    prompts = [PROMPTS[0], PROMPTS[1], long_prompt, PROMPTS[2], PROMPTS[3]]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    params = [greedy, greedy, greedy, SamplingParams(max_tokens=6, temperature=0.8, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)]
    arrivals = {0: [0, 1], 3: [2], 6: [3], 9: [4]}
    want = [final(o) for o in stream(graph_engine(max_num_batched_tokens=32), prompts, params, arrivals=arrivals)]
    engine = overlapped(4, max_num_batched_tokens=32)
    got = [final(o) for o in stream(engine, prompts, params, arrivals=arrivals)]
    assert [g for i, g in enumerate(got) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    assert len(got[3][0]) == 6 and got[3][2] == "length"
    chains = engine.stats().decode_chains
    assert chains["end.admission"] >= 2 and chains["admitted_in_chain"] == 0 and chains["kept_past_admission"] == 0
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


def test_greedy_rows_keep_their_tokens_while_sampled_rows_leave_the_chain():
    """Sampled rows (drawn on the device) that finish early leave a chain whose other rows are
    greedy: the device-side gather hands every remaining row its own last token."""
    sampled = SamplingParams(max_tokens=5, temperature=0.9, top_p=0.9, ignore_eos=True)
    params = [GREEDY, sampled, GREEDY, sampled, sampled, GREEDY]
    want = [final(o) for o in stream(graph_engine(), PROMPTS, params)]
    engine = overlapped(4)
    got = [final(o) for o in stream(engine, PROMPTS, params)]
    for i, p in enumerate(params):
        if p.greedy:
            assert got[i] == want[i]
        else:
            assert len(got[i][0]) == 5 and got[i][2] == "length"
    assert engine.stats().decode_chains["kept_past_finish"] >= 1
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real graphs, events, pinned buffers)")
@pytest.mark.parametrize("chunk_graphs", [0, 8])
def test_a_chain_across_finishes_on_cuda_graphs_gives_the_tokens_of_single_steps(chunk_graphs):
    """Real graphs, asynchronous chunks: rows that stop inside a chunk in flight, end at their
    max_tokens or finish as sampled rows leave the chain; greedy rows' tokens and text, and a
    second round on the freed (and prefix-cached) blocks, as with single steps."""
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    def cuda_engine(**knobs):
        return LLMEngine(EngineConfig(model="tiny-llama", device="cuda", dtype="float32", max_num_seqs=8,
                                      max_model_len=64, block_size=4, **knobs))

    reference = [final(o) for o in stream(cuda_engine(decode_steps=1), PROMPTS, GREEDY)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 9, 14, 20, 27, 40)]
    params[1] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[reference[1][0][6]])
    params[2] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[reference[2][1][9:12]])
    params[3] = SamplingParams(max_tokens=7, temperature=0.9, top_p=0.9, ignore_eos=True)
    single = cuda_engine(decode_steps=1)
    want = [final(o) for o in stream(single, PROMPTS, params)]
    want_again = [final(o) for o in stream(single, PROMPTS, GREEDY)]
    engine = cuda_engine(decode_steps=4, overlap_decode=True, chunk_graph_max_batch=chunk_graphs)
    got = [final(o) for o in stream(engine, PROMPTS, params)]
    assert [g for i, g in enumerate(got) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    assert len(got[3][0]) == 7
    assert [final(o) for o in stream(engine, PROMPTS, GREEDY)] == want_again
    chains = engine.stats().decode_chains
    assert chains["kept_past_finish"] >= 4 and chains["end.finish"] == 2
    assert (engine.runner.num_chunk_replays > 0) == bool(chunk_graphs)
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (real graphs, events, pinned buffers)")
def test_arrivals_join_a_chain_on_cuda_graphs_with_the_tokens_of_single_steps():
    """Prompts run between two chunks in flight on the real graphs (mixed-step graph, device
    argmax, the next chunk's step 0 gathering it): tokens and finishes as with single steps."""
    from shapeshift.engine.core.config import EngineConfig
    from shapeshift.engine.core.llm_engine import LLMEngine

    def cuda_engine(**knobs):
        return LLMEngine(EngineConfig(model="tiny-llama", device="cuda", dtype="float32", max_num_seqs=8,
                                      max_model_len=64, block_size=4, **knobs))

    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 17, 24, 1, 20, 30)]
    arrivals = {0: [0, 1], 3: [2], 4: [3], 6: [4, 5]}
    want = [final(o) for o in stream(cuda_engine(decode_steps=1), PROMPTS, params, arrivals=arrivals)]
    engine = cuda_engine(decode_steps=4, overlap_decode=True)
    got = [final(o) for o in stream(engine, PROMPTS, params, arrivals=arrivals)]
    assert got == want
    chains = engine.stats().decode_chains
    assert chains["admitted_in_chain"] >= 3 and chains["end.admission"] == 0
    assert engine.runner.num_mixed_replays > 0
    assert engine.stats().num_free_blocks == engine.block_manager.num_blocks
