"""Scheduler.schedule/postprocess give what the plain per-token code gives.

``ReferenceScheduler`` is the straightforward form of the two (every check done through
BlockManager's methods and Sequence's properties, the whole output list copied into each
RequestOutput, text decoded twice per token by the tokenizer). Both schedulers run the
same random workloads (preemption, chunked prefill, prefix caching on and off, stop
strings, stop token ids, eos, logprobs, length limits, aborts) with the same scripted
model, a stand-in named as such, and must agree on every batch, every RequestOutput
field and every sequence's final state.
"""

from __future__ import annotations

import random

import pytest

from engine_factories import make_scheduler
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.scheduler import RequestOutput, RunnerOutput, ScheduledBatch, Scheduler
from shapeshift.engine.core.sequence import Sequence, SequenceStatus
from shapeshift.engine.models.tokenizer import Tokenizer
from test_detokenizer import DecodeTwiceDetokenizer

TEXT = "Hello w\u00f6rld, caf\u00e9 \u2603 \U0001f600 STOP ends; xyz and more text \u4e2d\u6587 ".encode()
EOS = 256  # <|endoftext|> of the byte-level tokenizer


class ReferenceScheduler(Scheduler):
    def add(self, seq: Sequence) -> None:
        seq.detokenizer = DecodeTwiceDetokenizer(self.tokenizer, seq.prompt_token_ids)
        super().add(seq)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        # Admission (Scheduler._admit_waiting) is shared: the running part is what changed.
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not bm.can_append(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.append_slots(seq, num_new)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        return budget

    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput | None) -> list[RequestOutput]:
        outputs = []
        for i, seq in enumerate(batch.seqs):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += batch.num_new_tokens[i]
            self.block_manager.commit(seq)
            token = output.token_ids[i] if output is not None else None
            if token is None:
                continue
            seq.token_ids.append(token)
            logprob = None
            if seq.params.logprobs and output.logprobs is not None:
                logprob = output.logprobs[i]
                seq.logprobs.append(logprob)
            delta = self._reference_text_and_stop(seq, token)
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self._finish(seq, seq.finish_reason)
            outputs.append(RequestOutput(
                request_id=seq.request_id, new_token_ids=[token], output_token_ids=seq.output_token_ids,
                text_delta=delta, finished=seq.is_finished, finish_reason=seq.finish_reason,
                num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
                logprobs=None if logprob is None else [logprob]))
        return outputs

    def _reference_text_and_stop(self, seq: Sequence, token: int) -> str:
        params = seq.params
        stop_by_token = (token in params.stop_token_ids
                         or (not params.ignore_eos and token in self.eos_token_ids))
        if seq.detokenizer is not None and not stop_by_token:
            old_len = len(seq.text)
            seq.text += seq.detokenizer.step([token])
            if params.stop:
                start = max(0, old_len - max(len(s) for s in params.stop) + 1)
                found = [idx for idx in (seq.text.find(s, start) for s in params.stop) if idx >= 0]
                if found:
                    seq.text = seq.text[:min(found)]
                    seq.finish_reason = "stop"
        if seq.finish_reason is None:
            if stop_by_token:
                seq.finish_reason = "stop"
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                seq.finish_reason = "length"
        if seq.finish_reason is not None:
            end = len(seq.text)
        else:
            holdback = max((len(s) for s in params.stop), default=1) - 1
            end = max(seq.num_text_emitted, len(seq.text) - holdback)
        delta = seq.text[seq.num_text_emitted:end]
        seq.num_text_emitted = end
        return delta


def scripted_token(history: list[int]) -> int:
    """The model's stand-in: mostly the next byte of TEXT, sometimes eos, a stop token id
    (7) or an id past the vocabulary; a fixed function of the history."""
    rng = random.Random(hash(tuple(history)))
    roll = rng.random()
    if roll < 0.02:
        return EOS
    if roll < 0.04:
        return 7
    if roll < 0.06:
        return 300
    return TEXT[(len(history) + rng.randrange(3)) % len(TEXT)]


def make_workload(rng: random.Random, n: int) -> list[Sequence]:
    seqs = []
    shared = [rng.randrange(32, 127) for _ in range(rng.randint(0, 9))]
    for i in range(n):
        prompt = shared + [rng.randrange(0, 256) for _ in range(rng.randint(1, 14))]
        stop = rng.choice([[], [], ["STOP"], ["xyz", "caf"], ["\u2603"], ["ld, c", "o"]])
        params = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, stop=stop,
                                stop_token_ids=rng.choice([[], [7]]), ignore_eos=rng.random() < 0.5,
                                logprobs=rng.random() < 0.3)
        seqs.append(Sequence(f"r{i}", prompt, params))
    return seqs


def run_side_by_side(seed: int) -> None:
    rng = random.Random(seed)
    # A lone sequence of max_model_len tokens always fits (24 blocks of 2 at least), so
    # preemption makes progress; several together often do not.
    settings = dict(num_blocks=rng.choice([24, 32, 64]), block_size=rng.choice([2, 4]),
                    max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([8, 16, 64]),
                    max_model_len=rng.choice([30, 48]), enable_prefix_caching=rng.random() < 0.5,
                    eos_token_ids=[EOS], tokenizer=Tokenizer.byte_level())
    fast, reference = make_scheduler(**settings), make_scheduler(**settings)
    reference.__class__ = ReferenceScheduler
    n = rng.randint(1, 8)
    fast_seqs, reference_seqs = make_workload(random.Random(seed), n), make_workload(random.Random(seed), n)
    for f, r in zip(fast_seqs, reference_seqs):
        fast.add(f)
        reference.add(r)
    abort_at = {rng.randrange(60): f"r{rng.randrange(n)}" for _ in range(rng.randint(0, 2))}
    for step in range(1000):
        if not reference.has_unfinished():
            break
        if step in abort_at:
            assert (fast.abort(abort_at[step]) is None) == (reference.abort(abort_at[step]) is None)
        got, want = fast.schedule(), reference.schedule()
        ids = lambda seqs: [s.request_id for s in seqs]  # noqa: E731
        assert (ids(got.seqs), got.num_new_tokens, ids(got.preempted)) == \
            (ids(want.seqs), want.num_new_tokens, ids(want.preempted)), (seed, step)
        tokens = [scripted_token(s.token_ids) if want.samples(i) else None for i, s in enumerate(want.seqs)]
        logprobs = [None if t is None else -0.01 * t for t in tokens]
        assert fast.postprocess(got, RunnerOutput(list(tokens), list(logprobs))) == \
            reference.postprocess(want, RunnerOutput(list(tokens), list(logprobs))), (seed, step)
    else:
        raise AssertionError(f"seed {seed}: did not finish")
    assert not fast.has_unfinished()
    for f, r in zip(fast_seqs, reference_seqs):
        assert (f.token_ids, f.text, f.num_text_emitted, f.finish_reason, f.logprobs, f.num_preemptions) == \
            (r.token_ids, r.text, r.num_text_emitted, r.finish_reason, r.logprobs, r.num_preemptions), seed
    assert fast.block_manager.hash_to_block == reference.block_manager.hash_to_block
    assert fast.block_manager.num_free_blocks == reference.block_manager.num_free_blocks


@pytest.mark.parametrize("seeds", [range(0, 100), range(100, 200)], ids=["seeds-0-99", "seeds-100-199"])
def test_schedule_and_postprocess_match_the_reference(seeds):
    for seed in seeds:
        run_side_by_side(seed)


def test_output_token_ids_is_the_list_at_the_step_when_read_later():
    sched = make_scheduler(num_blocks=64, tokenizer=Tokenizer.byte_level())
    seq = Sequence("s", [72, 105], SamplingParams(max_tokens=6, temperature=0.0))
    sched.add(seq)
    outs = []
    for token in [65, 66, 67, 68, 69, 70]:
        batch = sched.schedule()
        outs += sched.postprocess(batch, RunnerOutput(token_ids=[token]))
    assert [o.output_token_ids for o in outs] == [[65, 66, 67, 68, 69, 70][:k] for k in range(1, 7)]
    assert all(type(o.output_token_ids) is list for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "length" and outs[0].text_delta == "A"
    outs[0].output_token_ids = [1]  # assignable, as the multi-step merge does
    assert outs[0].output_token_ids == [1]
    assert outs[1] == RequestOutput("s", [66], [65, 66], "B", False, None, 2, 0) != outs[2]
    assert repr(outs[1]).startswith("RequestOutput(request_id='s', new_token_ids=[66], output_token_ids=[65, 66]")
