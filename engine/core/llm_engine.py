"""LLMEngine: the synchronous engine the server, the bench and the compile loop drive.

Data flow: ``EngineConfig`` -> loader (weights once, tokenizer, ModelConfig) -> forward
pass built from a bundle over those weights -> preallocated ``KVCache`` ->
``BlockManager`` + ``Scheduler`` + ``ModelRunner`` (CUDA graphs captured on CUDA).
Requests enter with ``add_request``; each ``step()`` is
``batch = scheduler.schedule(); out = runner.run(batch); scheduler.postprocess(batch, out)``
and returns one ``RequestOutput`` per request that produced a token or finished.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from shapeshift.engine.core.block_manager import BlockManager
from shapeshift.engine.core.config import EngineConfig, ModelConfig
from shapeshift.engine.forward_pass.identity import ActiveForwardPass
from shapeshift.engine.forward_pass.importer import LoadedBundle, build_forward_pass, load_bundle
from shapeshift.engine.forward_pass.kv_layout import KVContext
from shapeshift.engine.core.kv_cache import KVCache, choose_num_blocks
from shapeshift.engine.models.loader import TORCH_DTYPES, LoadedModel, load_model
from shapeshift.engine.core.runner import DecodeChunk, ModelRunner
from shapeshift.engine.core.sampling import SamplingParams, SequenceHistory
from shapeshift.engine.core.scheduler import RequestOutput, RunnerOutput, ScheduledBatch, Scheduler
from shapeshift.engine.core.sequence import Sequence, SequenceStatus

__all__ = ["LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "EngineStats",
           "InvalidRequestError", "PromptTooLongError"]


class InvalidRequestError(ValueError):
    """A request the engine cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    pass


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    batch_size_last_step: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_free_blocks: int
    forward_pass_name: str
    num_preemptions: int = 0
    num_kv_blocks: int = 0
    # Overlapped decode chains (EngineConfig.overlap_decode), cumulative: see LLMEngine.decode_chains.
    decode_chains: dict[str, int] = field(default_factory=dict)
    # Forward-pass swaps by what became of the KV cache: (outcome, reason) -> count, cumulative.
    kv_swaps: dict[tuple[str, str], int] = field(default_factory=dict)


@dataclass
class _InflightChunk:
    """Decode steps of ``batch`` launched on the device and not yet post-processed."""

    batch: ScheduledBatch
    k: int
    handle: DecodeChunk


# LLMEngine.decode_chains' keys, all counted from zero (cumulative, like the prefix-cache counters):
#   chains / chunks / steps: chains started, chunks launched in them, decode steps in those chunks;
#   kept_past_finish: chunks chained onto one in flight without some of its rows (a row finished
#     or was aborted; EngineConfig.chain_across_finishes);
#   kept_past_admission / admitted_in_chain: chunks chained with requests admitted between two
#     chunks (their prompts run there), and how many (EngineConfig.chain_across_admissions);
#   end.<why>: chains ended, by why the next chunk was not chained: finish (a row finished or has
#     no token left to compute), admission (a request waits that cannot join the chain), kv (no room for the next chunk's
#     slots), drain (the engine read the chunk early: runtime settings, a new forward pass,
#     prompt logprobs), other;
#   single.<why>: with decode_steps > 1, steps that ran one at a time: prefill (the batch holds a
#     prefill chunk), admission (a decode batch while a request waits), other (no graph for the
#     batch size, logprobs or seeded sampling, no KV room for two steps).
DECODE_CHAIN_KEYS = ("chains", "chunks", "steps", "kept_past_finish", "kept_past_admission", "admitted_in_chain",
                     "end.finish", "end.admission", "end.kv",
                     "end.drain", "end.other", "single.prefill", "single.admission", "single.other")


class LLMEngine:
    # Bundle folder served when EngineConfig.forward_pass is unset (None: the stock pass).
    default_bundle_dir: Path | None = None
    # EngineConfig fields that may change between two steps (set_runtime_settings).
    RUNTIME_SETTINGS = ("decode_steps", "overlap_decode", "max_num_seqs", "max_num_batched_tokens")

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.resolved_device())
        self.dtype = TORCH_DTYPES[config.resolved_dtype()]
        torch.manual_seed(config.seed)  # unseeded sampling draws from the global generator
        loaded = self._load_model(config)
        self.model_name = loaded.name
        self.model_config: ModelConfig = loaded.model_config
        self.weights = loaded.weights
        self.tokenizer = loaded.tokenizer
        if config.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings="
                f"{self.model_config.max_position_embeddings}; lower max_model_len")
        # A local bundle is trusted as the engine is: its files are hashed as they are (the stock
        # pass's committed manifest is checked, with a warning when it is stale).
        self.bundle: LoadedBundle = load_bundle(config.forward_pass or self.default_bundle_dir,
                                                config.forward_pass_recipe, ignore_manifest=True)
        self.forward_pass = build_forward_pass(self.bundle, self.model_config, self.weights)
        self._set_active(ActiveForwardPass.of(self.bundle, kv=self.kv_context()))
        kv_config = self._kv_cache_model_config()
        num_blocks = self._agree_on_num_blocks(choose_num_blocks(kv_config, config, self.dtype, self.device))
        self.kv_cache = KVCache.allocate(kv_config, num_blocks, config.block_size, self.dtype, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          tag=self.active_forward_pass.cache_format)
        eos = sorted(set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids))
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, tokenizer=self.tokenizer, eos_token_ids=eos)
        self.runner = ModelRunner(self.model_config, config, self.forward_pass, self.kv_cache, self.device)
        self.runner.capture_cudagraphs()
        self._requests: dict[str, Sequence] = {}
        self._abort_outputs: list[RequestOutput] = []
        self._batch_size_last_step = 0
        # A chunk of decode steps launched and not yet read (EngineConfig.overlap_decode).
        self._inflight: _InflightChunk | None = None
        self._drained_outputs: list[RequestOutput] = []
        # How overlapped decode chains start, run and end (DECODE_CHAIN_KEYS).
        self.decode_chains: Counter[str] = Counter({key: 0 for key in DECODE_CHAIN_KEYS})
        # Forward-pass swaps by what became of the KV cache, (outcome, reason) -> count, cumulative:
        # counted by the hot-reload manager (forward_pass/kv_handover.py), exported by the server.
        self.kv_swaps: Counter[tuple[str, str]] = Counter()

    # ------------------------------------------------------------------ construction hooks
    # (ParallelLLMEngine shards the weights and sizes a per-rank KV cache through these.)
    def _load_model(self, config: EngineConfig) -> LoadedModel:
        return load_model(config)

    def _kv_cache_model_config(self) -> ModelConfig:
        """The config whose KV heads and layers the cache holds."""
        return self.model_config

    def _agree_on_num_blocks(self, num_blocks: int) -> int:
        return num_blocks

    def kv_context(self) -> KVContext:
        """What this engine fixes of every pass's KV layout: the cache's KV geometry, block size, dtype."""
        return KVContext.of(self._kv_cache_model_config(), self.config.block_size, self.dtype)

    @property
    def active_forward_pass(self) -> ActiveForwardPass:
        """What runs now: name, digest, KV format, source, recipe, the rollout's resource name."""
        return self._active_forward_pass

    def _set_active(self, identity: ActiveForwardPass) -> None:
        self._active_forward_pass = identity  # the one place the active pass's identity is set

    @property
    def forward_pass_name(self) -> str:
        return self.active_forward_pass.name

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight", "request_id")
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: give at least one token", "prompt")
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_token_ids)} tokens; this model serves at most "
                f"{self.config.max_model_len} tokens including output, so the prompt must be shorter "
                f"than {self.config.max_model_len}", "prompt")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        elif params.has_processors:
            # A generator keeps the row on the host sampler, the only one that runs processors.
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(torch.randint(0, 2**62, ()).item()))
        if params.needs_history:
            params = dataclasses.replace(params)  # the history is this sequence's own
        seq = Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                       generator=generator)
        if params.needs_history:
            params.history = SequenceHistory(seq.token_ids, seq.num_prompt_tokens, self.scheduler.eos_token_ids)
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return
        self._requests.pop(request_id, None)
        self._abort_outputs.append(RequestOutput(
            request_id=request_id, new_token_ids=[], output_token_ids=seq.output_token_ids, text_delta="",
            finished=True, finish_reason="abort", num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens, logprobs=None))

    def has_unfinished_requests(self) -> bool:
        # A chunk in flight (or its drained outputs) still has tokens to hand out or discard.
        return self._inflight is not None or bool(self._drained_outputs) or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        outputs = self._drained_outputs
        self._drained_outputs = []
        if self._inflight is not None:
            outputs += self._advance_inflight()
        if self._inflight is None and not outputs:
            batch = self.scheduler.schedule()
            k = self._decode_lookahead(batch)
            if k > 1 and self.config.overlap_decode:
                steps = self._row_steps(batch.seqs, ahead=0, k=k)
                self._inflight = _InflightChunk(batch, k, self.runner.launch_decode_steps(batch, k, steps=steps))
                self._count_chunk(k, start=True)
                outputs = self._advance_inflight()
            elif k > 1:
                outputs = self._decode_steps(batch, k)
            else:
                if self.config.decode_steps > 1 and not batch.is_empty:
                    why = ("prefill" if not batch.is_decode else "admission" if self.scheduler.waiting else "other")
                    self.decode_chains["single." + why] += 1
                out = self.runner.run(batch) if not batch.is_empty else None
                outputs = self.scheduler.postprocess(batch, out)
            self._batch_size_last_step = len(batch.seqs)
        for o in outputs:
            if o.finished:
                self._requests.pop(o.request_id, None)
        if self._abort_outputs:
            outputs = self._abort_outputs + outputs
            self._abort_outputs = []
        return outputs

    def set_runtime_settings(self, settings: dict[str, Any]) -> None:
        """Change RUNTIME_SETTINGS between two steps: decode steps per host round trip, and the
        scheduler's batch width and token budget (checked as EngineConfig checks them). The
        one-step CUDA graphs stay as captured (a batch wider than the largest captured bucket
        decodes eagerly); the whole-chunk graphs are captured again for a new decode_steps."""
        unknown = sorted(set(settings) - set(self.RUNTIME_SETTINGS))
        if unknown:
            raise ValueError(f"engine settings {unknown} cannot change while the engine runs "
                             f"(only {list(self.RUNTIME_SETTINGS)} can)")
        dataclasses.replace(self.config, **settings)  # validation only: raises on a bad combination
        self.drain_inflight()
        steps_before = self.config.decode_steps
        for name, value in settings.items():
            setattr(self.config, name, value)  # in place: the runner and servers hold this object
            if hasattr(self.scheduler, name):
                setattr(self.scheduler, name, value)
        if self.config.decode_steps != steps_before and self.config.chunk_graph_max_batch:
            self.runner.recapture_chunk_graphs()  # whole-chunk graphs hold one chunk length

    def _decode_lookahead(self, batch: ScheduledBatch) -> int:
        """How many decode steps to run at once for ``batch`` (1: the ordinary step).

        k > 1 only when config.decode_steps allows it, the batch is all decodes replaying a
        graph, every sequence may decode on the device (runner.can_decode_steps: greedy, or
        unseeded sampled with multi_step_sampling; no logprobs), nobody waits for admission (a
        waiting request would otherwise wait k steps), and the KV cache has room for k new
        tokens per sequence (per sequence, as many as it may still produce: _reserve_steps).
        No row's real tokens pass its max_tokens or max_model_len. Reserves the slots.
        """
        if self.config.decode_steps <= 1 or not batch.is_decode or batch.preempted or self.scheduler.waiting:
            return 1
        if not self.runner.can_replay(len(batch.seqs)):
            return 1
        if not self.runner.can_decode_steps(batch.seqs):
            return 1
        return self._reserve_steps(batch.seqs, ahead=0, least=2) or 1

    def _tokens_left(self, seq: Sequence, ahead: int) -> int:
        """Tokens ``seq`` may still produce after the ``ahead`` it has in flight (max_tokens, max_model_len)."""
        return min(seq.params.max_tokens - seq.num_output_tokens, self.config.max_model_len - seq.num_tokens) - ahead

    @staticmethod
    def _per_row(ahead: int | list[int], seqs: list[Sequence]) -> list[int]:
        return list(ahead) if isinstance(ahead, list) else [ahead] * len(seqs)

    def _row_steps(self, seqs: list[Sequence], ahead: int | list[int], k: int) -> list[int]:
        """Per sequence, the steps of a k-step chunk that compute its real tokens (1..k);
        ``ahead``: the tokens in flight, for all or per sequence."""
        return [max(1, min(k, self._tokens_left(seq, a))) for seq, a in zip(seqs, self._per_row(ahead, seqs))]

    def _reserve_steps(self, seqs: list[Sequence], ahead: int | list[int], least: int) -> int:
        """The next chunk's length for ``seqs``, after the ``ahead`` steps each has in flight,
        with their KV slots reserved: at most config.decode_steps. With
        chain_across_finishes, as long as the longest-lived row needs (a row stops writing KV
        past its last token, _row_steps); otherwise never past any row's max_tokens or
        max_model_len. 0 (nothing reserved) when fewer than ``least`` steps fit or the KV cache
        lacks room for them."""
        aheads = self._per_row(ahead, seqs)
        left = [self._tokens_left(seq, a) for seq, a in zip(seqs, aheads)]
        k = min(self.config.decode_steps, max(left) if self.config.chain_across_finishes else min(left))
        if k < least:
            return 0
        bm = self.block_manager
        steps = self._row_steps(seqs, aheads, k)
        # Tokens each block table must cover: a decoding row's computed ones (num_tokens - 1), those
        # in flight and the chunk's; a prompt still running (ahead 1: its first token is drawn
        # on the device) the same count, its prompt computed by then.
        cover = [seq.num_tokens - 1 + a + n for seq, a, n in zip(seqs, aheads, steps)]
        needed = sum(bm.blocks_needed(c) - len(seq.block_table) for seq, c in zip(seqs, cover))
        if needed > bm.num_free_blocks:
            return 0
        for seq, c in zip(seqs, cover):
            bm.append_slots(seq, c - seq.num_computed_tokens)
        return k

    def _decode_steps(self, batch: ScheduledBatch, k: int) -> list[RequestOutput]:
        """Run k decode steps on the device, then postprocess them in order (stops apply per
        token); one RequestOutput per request carrying all its new tokens."""
        steps = self._row_steps(batch.seqs, ahead=0, k=k)
        return self._postprocess_rows(batch, self.runner.run_decode_steps(batch, k, steps=steps))

    def _advance_inflight(self) -> list[RequestOutput]:
        """Chain the next chunk of decode steps onto the one in flight when the batch allows it
        (see _chain_lookahead), then read and post-process the one in flight: the host's work
        on chunk j overlaps the GPU's on chunk j+1. Requests admitted into the chain have their
        prompts run between the two chunks (launch_prefill); their first tokens are read and
        post-processed after chunk j's."""
        chunk = self._inflight
        batch, src_rows, k, ahead, prompts = self._chain_lookahead(chunk)
        self._inflight = None
        prefill = None
        if k:
            if prompts is not None:
                prefill = self.runner.launch_prefill(prompts)
                self.decode_chains["kept_past_admission"] += 1
                self.decode_chains["admitted_in_chain"] += len(prompts.seqs)
            steps = self._row_steps(batch.seqs, ahead=ahead, k=k)
            self._inflight = _InflightChunk(batch, k, self.runner.launch_decode_steps(
                batch, k, ahead=ahead, steps=steps, src_rows=src_rows, joined=prefill))
            self._count_chunk(k)
        outputs = self._postprocess_rows(chunk.batch, chunk.handle.tokens())
        if prefill is not None:
            outputs += self.scheduler.postprocess(prompts, RunnerOutput(token_ids=prefill.tokens()[0]))
        return outputs

    def _chain_lookahead(self, chunk: "_InflightChunk"
                         ) -> tuple[ScheduledBatch, list[int] | None, int, int | list[int], ScheduledBatch | None]:
        """The chunk to chain onto ``chunk`` before reading it: (its batch, the rows of
        ``chunk`` they are or None for the same rows, its steps, each row's tokens in flight,
        the prompts to run before it or None), the slots reserved; k = 0: none (the chain ends;
        read the chunk and go back to scheduling; counted by why). As _decode_lookahead, counted
        from where the chunk leaves each sequence, while no running sequence is outside the
        batch. With chain_across_finishes, rows that finished (or will have, with the chunk in
        flight) leave the batch and the others go on; otherwise the batch must stay as it is
        and nobody may wait. With chain_across_admissions too, waiting requests whose whole
        prompt fits a step join it (_admit_into_chain); others end it."""
        seqs = chunk.batch.seqs
        why = None
        waiting = bool(self.scheduler.waiting)
        across_finishes = self.config.chain_across_finishes
        if not self.config.overlap_decode:
            why = "other"
        elif waiting and not (across_finishes and self.config.chain_across_admissions):
            why = "admission"
        running = [s.status is SequenceStatus.RUNNING for s in seqs]
        if why is None and sum(running) != len(self.scheduler.running):
            why = "other"  # a running sequence outside this batch (it would wait on the chain)
        batch, src_rows, ahead, prompts = chunk.batch, None, chunk.k, None
        if why is None and across_finishes:
            live = [i for i, (s, r) in enumerate(zip(seqs, running)) if r and self._tokens_left(s, chunk.k) > 0]
            joining: list[int] = []
            if waiting:
                prompts = self._admit_into_chain(len(live))
                if prompts is None:
                    why = "admission"
                else:
                    joining = [j for j, s in enumerate(prompts.seqs) if self._tokens_left(s, 1) > 0]
            if why is None and not live and not joining:
                why = "finish" if prompts is None else "other"  # every newcomer ends with its first token
            elif why is None and (len(live) < len(seqs) or prompts is not None):
                src_rows = live + [-1 - j for j in joining]
                batch = ScheduledBatch(seqs=[seqs[i] for i in live] + [prompts.seqs[j] for j in joining],
                                       num_new_tokens=[1] * len(src_rows))
                if prompts is not None:
                    ahead = [chunk.k] * len(live) + [1] * len(joining)
        elif why is None and not all(running):
            why = "finish"
        k = self._reserve_steps(batch.seqs, ahead=ahead, least=1) if why is None else 0
        if why is None and not k:
            why = "finish" if min(self._tokens_left(s, a) for s, a in zip(batch.seqs, self._per_row(ahead, batch.seqs))
                                  ) <= 0 else "kv"
        if why is not None:
            self.decode_chains["end." + why] += 1
            prompts = None  # admitted, if at all, with their blocks: the next schedule() runs their prompts
        elif src_rows is not None and len([r for r in src_rows if r >= 0]) < len(seqs):
            self.decode_chains["kept_past_finish"] += 1
        return batch, src_rows, k, ahead, prompts

    def _admit_into_chain(self, num_rows: int) -> ScheduledBatch | None:
        """Admit waiting requests into the chain (None: the first one waiting cannot join, so the
        chain ends for it): greedy ones without logprobs (their first token is the argmax on the
        device, runner.launch_prefill) whose whole prompt fits a step, as many as the largest
        decode graph and max_num_seqs leave room for beside ``num_rows`` rows."""
        room = max(0, self.runner.graph_batch_sizes[-1] - num_rows) if self.runner.graph_batch_sizes else 0
        prompts = self.scheduler.admit_prompts(room, lambda s: s.params.greedy and self.runner.can_decode_steps([s]))
        return prompts if prompts.seqs else None

    def _count_chunk(self, k: int, start: bool = False) -> None:
        self.decode_chains["chains"] += start
        self.decode_chains["chunks"] += 1
        self.decode_chains["steps"] += k

    def drain_inflight(self) -> None:
        """Read and post-process a chunk in flight now (before anything else uses the runner);
        its outputs go out with the next step."""
        if self._inflight is not None:
            chunk, self._inflight = self._inflight, None
            self.decode_chains["end.drain"] += 1
            self._drained_outputs += self._postprocess_rows(chunk.batch, chunk.handle.tokens())

    def _postprocess_rows(self, batch: ScheduledBatch, rows: list[list[int]]) -> list[RequestOutput]:
        """Post-process k rows of greedy tokens [k][n] in order (stops apply per token); one
        RequestOutput per request carrying all its new tokens."""
        merged: dict[str, RequestOutput] = {}
        for row in rows:
            for o in self.scheduler.postprocess(batch, RunnerOutput(token_ids=list(row))):
                prev = merged.get(o.request_id)
                if prev is None:
                    merged[o.request_id] = o
                    continue
                prev.new_token_ids = prev.new_token_ids + o.new_token_ids
                prev.text_delta += o.text_delta
                prev.output_token_ids = o.output_token_ids
                prev.finished, prev.finish_reason = o.finished, o.finish_reason
                prev.num_cached_tokens = o.num_cached_tokens
        return list(merged.values())

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[list[int]]:
        """Run prompts to completion together; returns each one's output token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        results: dict[str, list[int]] = {}
        while len(results) < len(ids):
            for o in self.step():
                if o.finished and o.request_id in ids:
                    results[o.request_id] = o.output_token_ids
        return [results[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            batch_size_last_step=self._batch_size_last_step,
            prefix_cache_queried_tokens=self.block_manager.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=self.block_manager.prefix_cache_hit_tokens,
            num_free_blocks=self.block_manager.num_free_blocks, forward_pass_name=self.forward_pass_name,
            num_preemptions=self.scheduler.num_preemptions, num_kv_blocks=self.block_manager.num_blocks,
            decode_chains=dict(self.decode_chains), kv_swaps=dict(self.kv_swaps))

    # ------------------------------------------------------------------ verification helpers
    def prompt_logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] for every prompt position, computed through the paged cache
        (blocks are borrowed and returned; prefix-cache counters are not touched)."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("prompt_logits needs an idle engine (no requests in flight)")
        seq = Sequence(request_id="__prompt_logits__", prompt_token_ids=list(prompt_token_ids),
                       params=SamplingParams(max_tokens=1))
        bm = self.block_manager
        if not bm.can_append(seq, seq.num_tokens):
            raise RuntimeError(f"prompt of {seq.num_tokens} tokens does not fit the KV cache")
        bm.append_slots(seq, seq.num_tokens)
        try:
            batch = ScheduledBatch(seqs=[seq], num_new_tokens=[seq.num_tokens])
            return self.runner.prompt_logits(batch)
        finally:
            bm.deallocate(seq)

    def prompt_logprobs(self, prompt_token_ids: list[int], top_n: int = 0
                        ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """Per prompt position, the logprob of that token given the ones before it and the
        ``top_n`` most likely tokens there [(id, logprob)]; None at position 0 (nothing
        precedes it). For ``echo`` with logprobs. Runs between two steps with requests in
        flight: the prompt takes KV blocks of its own for eager prefill chunks of at most
        max_num_batched_tokens (so the logits held at once are [chunk, V], not [T, V]) and
        returns them."""
        self.drain_inflight()
        seq = Sequence(request_id="__prompt_logprobs__", prompt_token_ids=list(prompt_token_ids),
                       params=SamplingParams(max_tokens=1))
        bm = self.block_manager
        if not bm.can_append(seq, seq.num_tokens):
            raise InvalidRequestError(f"the KV cache has no room now for the {seq.num_tokens} prompt tokens "
                                      "whose logprobs were asked for (echo with logprobs); retry later", "echo")
        bm.append_slots(seq, seq.num_tokens)
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None]
        targets = torch.tensor(prompt_token_ids[1:] + [0], dtype=torch.int64)  # next token of each position
        chunk = self.config.max_num_batched_tokens
        try:
            with torch.inference_mode():
                for start in range(0, seq.num_tokens, chunk):
                    n = min(chunk, seq.num_tokens - start)
                    seq.num_computed_tokens = start
                    batch = ScheduledBatch(seqs=[seq], num_new_tokens=[n])
                    logprobs = torch.log_softmax(self.runner.prompt_logits(batch).float(), dim=-1)  # [n, V]
                    if start + n == seq.num_tokens:
                        logprobs, n = logprobs[:-1], n - 1  # the last position predicts no prompt token
                    ids = targets[start:start + n].to(logprobs.device)
                    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1).tolist()  # [n]
                    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
                    if top_n:
                        values, top_ids = logprobs.topk(top_n, dim=-1)  # [n, top_n]
                        tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
                    out += list(zip(chosen, tops))
        finally:
            bm.deallocate(seq)
        return out

    # ------------------------------------------------------------------ hot swap
    def set_forward_pass(self, bundle: LoadedBundle, forward_pass: Any | None = None) -> None:
        """Swap the forward pass (built over the same weights) and re-capture graphs.

        Call between steps. Blocks cached under another KV format stop matching.
        """
        fp = forward_pass if forward_pass is not None else build_forward_pass(bundle, self.model_config, self.weights)
        self.install_forward_pass(bundle, fp, ActiveForwardPass.of(bundle, kv=self.kv_context()))

    def install_forward_pass(self, bundle: LoadedBundle, forward_pass: Any, identity: ActiveForwardPass, *,
                             runner: ModelRunner | None = None) -> None:
        """Make ``forward_pass`` (built from ``bundle``) the one that runs, known as ``identity``.

        Call between steps: decode steps in flight finish on the pass that launched them.
        ``runner``: one with the pass's graphs already captured (hot reload's off-path
        capture); otherwise the current runner re-captures. KV blocks cached under another
        format stop matching.
        """
        self.drain_inflight()
        if runner is not None:
            self.runner = runner
        else:
            self.runner.forward_pass = forward_pass
            self.runner.capture_cudagraphs()
        self.bundle, self.forward_pass = bundle, forward_pass
        self.block_manager.set_tag(identity.cache_format)
        self._set_active(identity)

    def name_forward_pass(self, resource: str | None) -> None:
        """The active pass is known as ForwardPass ``resource`` (a rollout named it)."""
        self._set_active(self.active_forward_pass.named(resource))

    def load_forward_pass(self, path: str | Path, recipe_override: dict[str, Any] | None = None) -> None:
        self.set_forward_pass(load_bundle(path, recipe_override, ignore_manifest=True))

