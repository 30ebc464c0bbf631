"""Scheduler: budgets, chunked prefill, preemption and resume, stop conditions, text.

The model is replaced by ``scripted_next_token`` (a fixed function of the token
history), so these tests check scheduling alone; model-in-the-loop preemption tests are
in test_llm_engine.py.
"""

from __future__ import annotations

from engine_factories import make_requests, make_scheduler, run_scheduler
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.sequence import Sequence
from shapeshift.engine.models.tokenizer import Tokenizer


def final_tokens(outputs) -> dict[str, list[int]]:
    return {rid: outs[-1].output_token_ids for rid, outs in outputs.items()}


def test_token_budget_and_max_num_seqs_are_respected_and_prefill_is_chunked():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=6, num_blocks=64)
    outputs, batches = run_scheduler(sched, make_requests([13, 3, 4], max_tokens=5))
    for ids, num_new, _ in batches:
        assert sum(num_new) <= 6 and len(ids) <= 2
    # The 13-token prompt is computed in chunks of at most 6.
    chunks = [n[ids.index("r0")] for ids, n, _ in batches if "r0" in ids]
    assert chunks[:3] == [6, 6, 1]
    assert all(len(o[-1].output_token_ids) == 5 and o[-1].finish_reason == "length" for o in outputs.values())
    # r2 waits until a slot frees up.
    first_r2 = next(i for i, (ids, _, _) in enumerate(batches) if "r2" in ids)
    assert first_r2 > 0 and all("r2" not in ids for ids, _, _ in batches[:first_r2])


def test_chunking_and_batching_do_not_change_tokens():
    reference, _ = run_scheduler(make_scheduler(max_num_seqs=1, max_num_batched_tokens=128, num_blocks=64),
                                 make_requests([13, 3, 9], max_tokens=6))
    chunked, _ = run_scheduler(make_scheduler(max_num_seqs=3, max_num_batched_tokens=4, num_blocks=64),
                               make_requests([13, 3, 9], max_tokens=6))
    assert final_tokens(chunked) == final_tokens(reference)


def test_preemption_when_blocks_run_out_and_resume_gives_same_tokens():
    roomy, _ = run_scheduler(make_scheduler(num_blocks=64), make_requests([6, 7, 5, 6], max_tokens=12))
    # 10 blocks of 4 tokens cannot hold four sequences of ~18 tokens (20 blocks).
    tight = make_scheduler(num_blocks=10, max_num_batched_tokens=32)
    outputs, batches = run_scheduler(tight, make_requests([6, 7, 5, 6], max_tokens=12))
    preempted = [p for _, _, ps in batches for p in ps]
    assert preempted, "expected preemptions with 10 blocks"
    assert tight.num_preemptions == len(preempted)
    assert final_tokens(outputs) == final_tokens(roomy)
    assert tight.block_manager.num_free_blocks == 10  # everything returned
    # Each token is reported exactly once, even across recomputation.
    for rid, outs in outputs.items():
        streamed = [t for o in outs for t in o.new_token_ids]
        assert streamed == outs[-1].output_token_ids


def test_repeated_prompt_hits_prefix_cache_and_skips_compute():
    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    first = make_requests([10], max_tokens=2, id_prefix="a")
    run_scheduler(sched, first)
    second = make_requests([10], max_tokens=2, id_prefix="b")
    outputs, batches = run_scheduler(sched, second)
    assert batches[0][1] == [2]  # 8 of 10 prompt tokens came from the cache
    assert outputs["b0"][-1].num_cached_tokens == 8
    assert sched.block_manager.prefix_cache_hit_tokens == 8
    assert sched.block_manager.prefix_cache_queried_tokens == 20


def test_max_tokens_eos_and_stop_token_ids():
    eos = 999
    fixed = lambda toks: 50 if len(toks) < 8 else eos  # noqa: E731
    sched = make_scheduler(eos_token_ids=[eos])
    seqs = [
        Sequence("eos", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0)),
        Sequence("ignore", [1, 2, 3], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)),
        Sequence("stop-id", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[50])),
    ]
    outputs, _ = run_scheduler(sched, seqs, next_token=fixed)
    assert outputs["eos"][-1].output_token_ids == [50] * 5 + [eos]
    assert outputs["eos"][-1].finish_reason == "stop"
    assert outputs["ignore"][-1].output_token_ids == [50] * 5 + [eos, eos]
    assert outputs["ignore"][-1].finish_reason == "length"
    assert outputs["stop-id"][-1].output_token_ids == [50] and outputs["stop-id"][-1].finish_reason == "stop"


def test_max_model_len_caps_generation():
    sched = make_scheduler(max_model_len=12, num_blocks=64)
    outputs, _ = run_scheduler(sched, make_requests([5], max_tokens=100))
    out = outputs["r0"][-1]
    assert len(out.output_token_ids) == 7 and out.finish_reason == "length"


def byte_script(text: str, prompt_len: int):
    data = text.encode()
    return lambda toks: data[len(toks) - prompt_len] if len(toks) - prompt_len < len(data) else 65


def test_stop_string_is_never_streamed_and_text_is_truncated():
    tok = Tokenizer.byte_level()
    prompt = tok.encode("Q: ")
    sched = make_scheduler(tokenizer=tok, num_blocks=64)
    seq = Sequence("s", prompt, SamplingParams(max_tokens=50, temperature=0, stop=["STOP", "never"]))
    outputs, _ = run_scheduler(sched, [seq], next_token=byte_script("Hello wor\u00e9ld ST STOP tail", len(prompt)))
    outs = outputs["s"]
    streamed = "".join(o.text_delta for o in outs)
    assert streamed == "Hello wor\u00e9ld ST "
    assert all("STOP" not in o.text_delta for o in outs)
    assert outs[-1].output_token_ids[-1] == ord("P")  # the token completing the stop string ends it
    assert outs[-1].finish_reason == "stop"
    # "ST " was held back while it could still become "STOP".
    assert any(o.text_delta == "" for o in outs[:-1])


def test_text_without_stop_strings_streams_every_character_once():
    tok = Tokenizer.byte_level()
    prompt = tok.encode("x")
    sched = make_scheduler(tokenizer=tok, num_blocks=64)
    text = "na\u00efve caf\u00e9 \u2603!"
    n = len(text.encode())
    seq = Sequence("s", prompt, SamplingParams(max_tokens=n, temperature=0))
    outputs, _ = run_scheduler(sched, [seq], next_token=byte_script(text, len(prompt)))
    assert "".join(o.text_delta for o in outputs["s"]) == text
    assert all("\ufffd" not in o.text_delta for o in outputs["s"])


def test_abort_frees_blocks():
    sched = make_scheduler(num_blocks=16)
    seqs = make_requests([9, 9], max_tokens=50)
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert len(batch.seqs) == 2
    assert sched.abort("r0") is seqs[0] and seqs[0].finish_reason == "abort"
    assert sched.abort("missing") is None
    # The aborted sequence is skipped by postprocess; the other continues.
    from shapeshift.engine.core.scheduler import RunnerOutput

    outs = sched.postprocess(batch, RunnerOutput(token_ids=[1, 2]))
    assert [o.request_id for o in outs] == ["r1"]
    sched.abort("r1")
    assert sched.block_manager.num_free_blocks == 16 and not sched.has_unfinished()
