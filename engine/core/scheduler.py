"""Continuous batching with chunked prefill and preemption by recompute.

Data flow per step: ``schedule()`` picks, under a token budget, (1) the running
sequences in admission order, one decode token or the next prefill chunk each,
preempting from the back of the running list when KV blocks run out, then (2) waiting
sequences (prefix-cache lookup, first chunk) while the budget, ``max_num_seqs`` and the
free blocks allow -> ``ScheduledBatch`` -> the runner computes logits and samples for
sequences whose chunk reaches their last known token -> ``postprocess`` advances
``num_computed_tokens``, commits full blocks to the prefix cache, appends sampled
tokens, detokenizes, applies stop conditions and returns ``RequestOutput``s.

A preempted sequence loses its blocks and is recomputed from its prompt plus the
tokens it already generated; its generator is untouched (one draw per sampled token),
so greedy and seeded requests resume with the same tokens.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shapeshift.engine.core.block_manager import BlockManager
from shapeshift.engine.core.sequence import Sequence, SequenceStatus
from shapeshift.engine.models.tokenizer import IncrementalDetokenizer


class RequestOutput:
    """One request's news from one step.

    ``output_token_ids`` is the request's whole output so far. Copying it every step would
    cost O(output length) per token, so the scheduler hands over the sequence's token list
    and the length it had (``_token_source``, ``_num_tokens``); the copy is made on first
    read, and since a sequence's token list only grows, it equals a copy made at the step.
    """

    __slots__ = ("request_id", "new_token_ids", "_output_token_ids", "text_delta", "finished", "finish_reason",
                 "num_prompt_tokens", "num_cached_tokens", "logprobs", "_token_source", "_num_tokens")

    def __init__(self, request_id: str, new_token_ids: list[int], output_token_ids: list[int] | None,
                 text_delta: str, finished: bool, finish_reason: str | None,  # "stop" | "length" | "abort" | None
                 num_prompt_tokens: int, num_cached_tokens: int,
                 logprobs: list[float] | None = None) -> None:  # logprobs of new_token_ids when requested
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self._output_token_ids = output_token_ids
        self.text_delta = text_delta
        self.finished = finished
        self.finish_reason = finish_reason
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = num_cached_tokens
        self.logprobs = logprobs
        self._token_source: list[int] | None = None
        self._num_tokens = 0

    @property
    def output_token_ids(self) -> list[int]:
        ids = self._output_token_ids
        if ids is None and self._token_source is not None:
            ids = self._output_token_ids = self._token_source[self.num_prompt_tokens:self._num_tokens]
            self._token_source = None
        return ids

    @output_token_ids.setter
    def output_token_ids(self, ids: list[int]) -> None:
        self._output_token_ids = ids
        self._token_source = None

    _FIELDS = ("request_id", "new_token_ids", "output_token_ids", "text_delta", "finished", "finish_reason",
               "num_prompt_tokens", "num_cached_tokens", "logprobs")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(getattr(self, name) == getattr(other, name) for name in self._FIELDS)

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value (as a dataclass)

    def __repr__(self) -> str:
        return f"RequestOutput({', '.join(f'{name}={getattr(self, name)!r}' for name in self._FIELDS)})"


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # per sequence, this step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode(self) -> bool:
        """Every sequence computes exactly its last token (the CUDA-graph case). A
        one-token chunk from the middle of a prompt does not count: the decode path
        feeds each sequence's last token at its last position."""
        return bool(self.seqs) and all(
            n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens
            for seq, n in zip(self.seqs, self.num_new_tokens))

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """Does sequence i reach its last known token this step (so it samples one)?"""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens


@dataclass
class RunnerOutput:
    token_ids: list[int | None]  # per batch sequence; None where it does not sample
    logprobs: list[float | None] | None = None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, tokenizer: Any = None, eos_token_ids: list[int] | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids or [])
        if tokenizer is not None and hasattr(tokenizer, "byte_decoding_table"):
            tokenizer.byte_decoding_table()  # built now rather than on the first request
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if self.tokenizer is not None and seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self._finish(seq, "abort")
                return seq
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self._finish(seq, "abort")
                return seq
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Every running sequence's next tokens into ``batch`` while the budget lasts,
        preempting from the back when KV blocks run out; returns the budget left."""
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            # Most steps fit in the last block; only a sequence that needs a new block can
            # run short (can_append / append_slots do nothing more otherwise).
            if bm.blocks_needed(seq.num_computed_tokens + num_new) > len(seq.block_table):
                while not bm.can_append(seq, num_new):
                    victim = self.running.pop()  # the most recently admitted goes first
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

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        """Waiting sequences into ``batch`` in order while the budget, the batch width and
        the KV cache allow. Only when nothing was preempted: a preemption means memory is
        short, and admitting would only preempt again next step."""
        bm = self.block_manager
        while (self.waiting and budget > 0 and not batch.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hits = bm.lookup(seq)  # prefix-cache blocks, hashed once for the three uses below
            num_new = min(seq.num_tokens - len(hits) * bm.block_size, budget)
            if not bm.can_allocate(seq, num_new, hits):
                break
            self._admit(seq, num_new, hits, batch)
            budget -= num_new

    def admit_prompts(self, max_seqs: int, joins: Any) -> ScheduledBatch:
        """Waiting sequences, in order, whose whole prompt (past a prefix-cache hit) fits one
        step's token budget, while ``joins(seq)`` allows them, at most ``max_seqs`` of them and
        within max_num_seqs and the free KV blocks: admitted (RUNNING, prompt blocks allocated)
        and returned as a batch of their prompts (LLMEngine: a prefill between two chunks of a
        decode chain)."""
        batch = ScheduledBatch()
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        while self.waiting and len(batch.seqs) < max_seqs and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not joins(seq):
                break
            hits = bm.lookup(seq)
            num_new = seq.num_tokens - len(hits) * bm.block_size
            if num_new > budget or not bm.can_allocate(seq, num_new, hits):
                break
            self._admit(seq, num_new, hits, batch)
            budget -= num_new
        return batch

    def _admit(self, seq: Sequence, num_new: int, hits: Any, batch: ScheduledBatch) -> None:
        """The first waiting sequence, running from now: its blocks for ``num_new`` tokens past
        the prefix-cache ``hits`` allocated, and its tokens in ``batch``."""
        self.block_manager.allocate(seq, num_new, hits)
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ postprocess
    def postprocess(self, batch: ScheduledBatch, output: RunnerOutput | None) -> list[RequestOutput]:
        # The per-token host work of every step at large batches: locals instead of repeated
        # attribute and property lookups, and nothing in it costs more than O(1) per token
        # (see RequestOutput and IncrementalDetokenizer).
        outputs: list[RequestOutput] = []
        bm = self.block_manager
        block_size = bm.block_size
        token_ids = output.token_ids if output is not None else None
        logprobs = output.logprobs if output is not None else None
        running = SequenceStatus.RUNNING
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            if seq.status is not running:
                continue  # aborted between schedule and postprocess
            computed = seq.num_computed_tokens + num_new
            seq.num_computed_tokens = computed
            if computed >= (len(seq.block_hashes) + 1) * block_size:
                bm.commit(seq)  # a block filled up (commit has nothing to do otherwise)
            if token_ids is None:
                continue
            token = token_ids[i]
            if token is None:
                continue
            seq.token_ids.append(token)
            logprob = None
            if logprobs is not None and seq.params.logprobs:
                logprob = logprobs[i]
                seq.logprobs.append(logprob)
            delta = self._append_text_and_check_stop(seq, token)
            if seq.finish_reason is not None:
                self.running.remove(seq)
                self._finish(seq, seq.finish_reason)
            out = RequestOutput(seq.request_id, [token], None, delta, seq.status is SequenceStatus.FINISHED,
                                seq.finish_reason, len(seq.prompt_token_ids), seq.num_cached_tokens,
                                None if logprob is None else [logprob])
            out._token_source = seq.token_ids  # output_token_ids: copied on first read
            out._num_tokens = len(seq.token_ids)
            outputs.append(out)
        return outputs

    def _append_text_and_check_stop(self, seq: Sequence, token: int) -> str:
        """Update the sequence's text and finish_reason; return the text to emit now."""
        params = seq.params
        stop = params.stop
        stop_by_token = (token in params.stop_token_ids
                         or (not params.ignore_eos and token in self.eos_token_ids))
        piece = ""
        if seq.detokenizer is not None and not stop_by_token:
            piece = seq.detokenizer.step_one(token)
        text = ""
        if not stop:
            if piece:
                seq.append_text(piece)
        else:
            text = seq.text
            if piece:
                # Only a stop string reaching into the new piece can be new: the last
                # step's search covered the rest (and, with an empty piece, everything).
                start = max(0, len(text) - max(map(len, stop)) + 1)
                text += piece
                found = [idx for idx in (text.find(s, start) for s in stop) if idx >= 0]
                if found:
                    text = text[:min(found)]
                    seq.finish_reason = "stop"
                seq.text = text
        if seq.finish_reason is None:
            if stop_by_token:
                seq.finish_reason = "stop"
            else:
                num_tokens = len(seq.token_ids)
                if num_tokens - len(seq.prompt_token_ids) >= params.max_tokens or num_tokens >= self.max_model_len:
                    seq.finish_reason = "length"
        if not stop:
            # Nothing is held back without stop strings: every step emits all its text.
            seq.num_text_emitted += len(piece)
            return piece
        if seq.finish_reason is not None:
            end = len(text)
        else:
            # Hold back a possible beginning of a stop string until it is decided.
            end = max(seq.num_text_emitted, len(text) - max(map(len, stop)) + 1)
        delta = text[seq.num_text_emitted:end]
        seq.num_text_emitted = end
        return delta

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if seq.block_table:
            self.block_manager.deallocate(seq)
