"""ModelRunner: turns a scheduled batch into tensors, runs the forward pass, samples.

Data flow: ``ScheduledBatch`` -> ``prepare_prefill`` (any mix of prefill chunks and
decodes; eager) or ``prepare_decode`` (one token per sequence) -> token ids [T],
positions [T], ``AttentionContext`` -> ``forward_pass.forward`` -> float32 logits [B, V]
-> ``sample`` for the sequences that reach their last known token -> ``RunnerOutput``.

On CUDA, decode batches replay CUDA graphs captured per (batch bucket, KV width bucket):
static input buffers sized for the largest bucket, captured from the largest to the
smallest in one shared memory pool after a warm-up run; padded rows write their KV into
the cache's null block. The KV width (blocks read per sequence) is fixed per graph
because the torch attention reads a fixed-shape window; a few widths keep short
contexts from paying for max_model_len. Each graph also takes the greedy argmax of its
logits into a static token buffer, so an all-greedy batch (no logprobs) copies only B token
ids to the host (the step's one sync) and launches nothing outside the graph. Prefill, mixed
batches and batches above the largest bucket run eagerly; on the CPU everything runs eagerly.

Multi-step decode (``run_decode_steps``, EngineConfig.decode_steps): for an all-greedy decode
batch the engine may ask for k steps at once. The runner replays the same graph k times
back to back: before replay j (j >= 1) it copies that step's positions, slots and context
lengths from a device staging buffer (filled with one host->device copy for all k steps)
and the previous replay's argmax tokens into the input ids, all device-side; the host reads
the k x B tokens once at the end. The GPU then waits for the host once per k steps instead of
once per step, which is what bounds batch-1 decode once the kernels are fast. Batch buckets up
to EngineConfig.chunk_graph_max_batch also get a graph of a whole k-step chunk: its steps read
their staging rows and the previous step's tokens where they lie, so a chunk is one launch with
no copies between steps (chunks of another length replay the one-step graph as above).
With EngineConfig.multi_step_sampling, unseeded sampled rows join multi-step decode: after each
replay engine/core/device_sampling.py draws the step's tokens on the device (per-row
temperature, top-k, top-p copied once a chunk; seeds drawn per row and step) into the static
token buffer the next replay reads, so the host still waits once per k steps.

Mixed steps (EngineConfig.mixed_cuda_graphs): a batch that is not decode-only replays the graph
of the cheapest (tokens, seqs) bucket holding it (engine/core/mixed_graphs.py), over static
buffers of its own sized for the largest bucket and KV width max_model_len (the varlen
attention reads only each sequence's context, so the width costs no work); its contexts carry
no host copies, which routes attention to the graphable varlen path (engine/core/attention.py).
Every mixed step's (seqs, tokens) is counted in ``mixed_step_shapes`` whether or not a graph
ran it, so a table fitted to the traffic (mixed_graphs.choose_buckets) can be captured later.
"""

from __future__ import annotations

import logging
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from shapeshift.engine.core.attention import AttentionContext
from shapeshift.engine.core.device_sampling import ChunkSampler
from shapeshift.engine.core.config import EngineConfig, ModelConfig
from shapeshift.engine.core.kv_cache import KVCache
from shapeshift.engine.core.mixed_graphs import MixedBucket, MixedBuckets, step_shape
from shapeshift.engine.core.mixed_step_graphs import CapturedGraph, MixedStepGraphs
from shapeshift.engine.core.sampling import sample
from shapeshift.engine.core.scheduler import RunnerOutput, ScheduledBatch

log = logging.getLogger(__name__)


@dataclass
class DecodeChunk:
    """k greedy decode steps launched on the device and not yet read by the host.

    ``tokens()`` waits for them (on CUDA, for the chunk's own device->host copy only, so a
    chunk launched after this one keeps the GPU busy meanwhile) and returns [k][n]."""

    k: int
    n: int
    host_tokens: torch.Tensor  # [>= k, >= n] int64, pinned on CUDA; filled by an async copy
    done: Any = None  # torch.cuda.Event recorded after that copy (None: already complete)

    def tokens(self) -> list[list[int]]:
        if self.done is not None:
            self.done.synchronize()
        return self.host_tokens[:self.k, :self.n].tolist()


class ModelRunner(MixedStepGraphs):
    def __init__(self, model_config: ModelConfig, config: EngineConfig, forward_pass: Any, kv_cache: KVCache,
                 device: torch.device) -> None:
        self.model_config = model_config
        self.config = config
        self.forward_pass = forward_pass
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.max_blocks_per_seq = math.ceil(config.max_model_len / self.block_size)
        self.use_pinned = device.type == "cuda"
        self.graphs: dict[tuple[int, int], CapturedGraph] = {}
        self.graph_batch_sizes: list[int] = []
        self.graph_widths: list[int] = []
        self._static: dict[str, torch.Tensor] = {}
        self._graph_pool = None
        self._max_bs = 0
        self._staging_steps = 0  # decode steps the multi-step staging holds (sized on first use)
        self._graph_logits: dict[tuple[int, int], torch.Tensor] = {}  # each graph's logits output
        self._capture_stream: Any = None  # torch.cuda.Stream of this runner's graph captures (CUDA)
        # CUDA event recorded once a launched chunk's host->device input copies are done: the
        # pinned host buffers they read are not rewritten before it (see launch_decode_steps).
        self._inputs_consumed: Any = None
        self._chunk_parity = 0  # which of the two host token buffers the next chunk copies into
        # Tests set this to exercise the static-buffer decode path on the CPU: "graphs"
        # are then eager calls over the same static buffers, padding and widths.
        self.emulate_graphs = False
        self.num_graph_replays = 0  # decode steps run by graphs (a chunk graph counts its steps)
        # Whole-chunk graphs (EngineConfig.chunk_graph_max_batch) per (batch bucket, width), for
        # chunks of _chunk_steps steps, with their own staging and token rows (fixed addresses).
        self.chunk_graphs: dict[tuple[int, int], CapturedGraph] = {}
        self._chunk_steps = 0
        self.num_chunk_replays = 0
        # Mixed-step graphs per bucket (EngineConfig.mixed_cuda_graphs), their static inputs and
        # the histogram of every mixed step's (num_seqs, num_tokens).
        self.mixed_graphs: dict[MixedBucket, CapturedGraph] = {}
        self.mixed_buckets: MixedBuckets | None = None
        self.mixed_step_shapes: Counter[tuple[int, int]] = Counter()
        self.num_mixed_replays = 0
        self._mixed_inputs_consumed: Any = None  # as _inputs_consumed, for the mixed packs
        # Tokens of sampled multi-step chunks, drawn on the device (EngineConfig.multi_step_sampling).
        self._chunk_sampler = ChunkSampler(device, config.seed)

    # ------------------------------------------------------------------ host -> device
    def _to_device(self, data: list[int] | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.as_tensor(np.asarray(data), dtype=dtype)
        if self.use_pinned:
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ------------------------------------------------------------------ prepare
    def prepare_prefill(self, batch: ScheduledBatch, all_logits: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """Any mix of prefill chunks and decodes -> ids [T], positions [T], context.

        ``all_logits`` makes the context select every new token's row (prompt logits).
        """
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start = [0]
        context_lens: list[int] = []
        width = max(len(seq.block_table) for seq in batch.seqs)
        block_tables = np.zeros((len(batch.seqs), width), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            table = np.asarray(seq.block_table, dtype=np.int64)
            block_tables[i, :len(table)] = table
            # Whole prompt chunks at once (numpy), not a Python loop per token.
            pos = np.arange(start, start + n)  # [n]
            positions.append(pos)
            slots.append(self._slots(table, pos))
            query_start.append(query_start[-1] + n)
            context_lens.append(start + n)
        last = list(range(query_start[-1])) if all_logits else [q - 1 for q in query_start[1:]]
        ctx = AttentionContext(
            is_prefill=True,
            slot_mapping=self._to_device(np.concatenate(slots), torch.int64),
            block_tables=self._to_device(block_tables, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            query_start_loc=self._to_device(query_start, torch.int32),
            max_query_len=max(batch.num_new_tokens),
            max_context_len=max(context_lens),
            last_token_indices=self._to_device(last, torch.int64),
            query_start_loc_cpu=query_start,
            context_lens_cpu=context_lens,
        )
        return self._to_device(input_ids, torch.int64), self._to_device(np.concatenate(positions), torch.int64), ctx

    def _slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """KV-cache slots of ``positions`` of a sequence whose block table is ``table``."""
        bs = self.block_size
        return table[positions // bs] * bs + positions % bs

    def _decode_host_arrays(self, batch: ScheduledBatch, ahead: int | list[int] = 0
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
        """ids, positions, slots, context lengths and block tables of a decode step; ``ahead``:
        tokens every sequence (or each, a list) has on the device that the host has not read yet
        (positions start that much later; the ids are then stale and the caller takes them from
        the device)."""
        bs = self.block_size
        seqs = batch.seqs
        input_ids = np.fromiter((s.token_ids[-1] for s in seqs), dtype=np.int64, count=len(seqs))
        positions = np.fromiter((s.num_tokens - 1 for s in seqs), dtype=np.int64, count=len(seqs)) + np.asarray(ahead)
        tables = [s.block_table for s in seqs]
        slots = np.fromiter((t[p // bs] * bs + p % bs for t, p in zip(tables, positions.tolist())),
                            dtype=np.int64, count=len(seqs))
        return input_ids, positions, slots, positions.astype(np.int32) + 1, tables

    def prepare_decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        """One new token per sequence (eager decode: CPU, or above the largest graph)."""
        input_ids, positions, slots, context_lens, tables = self._decode_host_arrays(batch)
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            block_tables[i, :len(t)] = t
        n = len(tables)
        ctx = AttentionContext(
            is_prefill=False,
            slot_mapping=self._to_device(slots, torch.int64),
            block_tables=self._to_device(block_tables, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            max_query_len=1,
            max_context_len=int(context_lens.max()),
            last_token_indices=torch.arange(n, dtype=torch.int64, device=self.device),
        )
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), ctx

    # ------------------------------------------------------------------ run
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> RunnerOutput:
        if batch.is_decode:
            logits, greedy_tokens = self._run_decode(batch)
            if greedy_tokens is not None and all(s.params.greedy and not s.params.logprobs for s in batch.seqs):
                # The graph already took the argmax: one device->host copy of B token ids.
                return RunnerOutput(token_ids=greedy_tokens.tolist(), logprobs=None)
            sampling_rows = list(range(len(batch.seqs)))
        else:
            logits = self._mixed_step_logits(batch)
            sampling_rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        token_ids: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[float | None] | None = None
        if sampling_rows:
            if len(sampling_rows) < len(batch.seqs):
                logits = logits[self._to_device(sampling_rows, torch.int64)]
            seqs = [batch.seqs[i] for i in sampling_rows]
            want_logprobs = any(s.params.logprobs for s in seqs)
            tokens, lps = sample(logits, [s.params for s in seqs], [s.generator for s in seqs], want_logprobs)
            for row, tok in zip(sampling_rows, tokens):
                token_ids[row] = tok
            if lps is not None:
                logprobs = [None] * len(batch.seqs)
                for row, lp in zip(sampling_rows, lps):
                    logprobs[row] = lp
        return RunnerOutput(token_ids=token_ids, logprobs=logprobs)

    def _run_decode(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 logits [n, V], and the greedy tokens [n] when a graph computed them."""
        n = len(batch.seqs)
        if self.graphs and n <= self.graph_batch_sizes[-1]:
            needed_width = max(len(s.block_table) for s in batch.seqs)
            graph_bs = next(b for b in self.graph_batch_sizes if b >= n)
            width = next(w for w in self.graph_widths if w >= needed_width)
            logits = self._replay(batch, self.graphs[(graph_bs, width)])
            return logits, self._static["tokens"][:n]
        input_ids, positions, ctx = self.prepare_decode(batch)
        return self.forward_pass.forward(input_ids, positions, ctx, self.kv_cache), None

    def can_replay(self, batch_size: int) -> bool:
        """Would a decode batch of this size replay a captured graph?"""
        return bool(self.graphs) and batch_size <= self.graph_batch_sizes[-1]

    def can_decode_steps(self, seqs: list) -> bool:
        """May these sequences decode several steps on the device before the host reads them?
        Greedy rows always (no logprobs); sampled rows with EngineConfig.multi_step_sampling
        when unseeded (a seeded request's draws follow its own generator, on the host; so do
        rows with logits processors, which the engine gives a generator for that reason)."""
        sampled_ok = self.config.multi_step_sampling
        return all(not s.params.logprobs and (s.params.greedy or (sampled_ok and s.generator is None))
                   for s in seqs)

    @torch.inference_mode()
    def run_decode_steps(self, batch: ScheduledBatch, k: int, steps: list[int] | None = None) -> list[list[int]]:
        """k >= 2 decode steps of a decode batch that can_decode_steps, back to back on the device.

        The caller has reserved KV slots for k new tokens per sequence (block tables cover
        positions num_tokens-1 .. num_tokens+k-2). Returns the tokens, [k][n]: row j is what
        step j produced (greedy, or drawn on the device), fed to step j+1 as its input. One
        host sync, at the end. ``steps``: as launch_decode_steps'.
        """
        if k < 2:
            raise ValueError(f"run_decode_steps needs k >= 2 (k={k})")
        return self.launch_decode_steps(batch, k, steps=steps).tokens()

    @torch.inference_mode()
    def launch_decode_steps(self, batch: ScheduledBatch, k: int, ahead: int | list[int] = 0,
                            steps: list[int] | None = None, src_rows: list[int] | None = None,
                            joined: DecodeChunk | None = None) -> DecodeChunk:
        """Launch k >= 1 decode steps of a decode batch that can_decode_steps; returns before they run.

        ``ahead`` > 0 chains this chunk onto the previous one, still in flight: every sequence
        has ``ahead`` tokens on the device the host has not read, the last of which (the
        previous replay's argmax, still in the static token buffer) is step 0's input, and
        positions start ``ahead`` later. Nothing else may run on the runner between the two.
        ``src_rows``: row i of this chunk was row src_rows[i] of the previous one (rows that
        finished left the batch), or, where src_rows[i] = -1 - j, is the request whose prompt
        ``joined`` (launch_prefill, just before) ran as its row j: its step-0 token is the one
        drawn there, and its ``ahead`` (a list, per row) is 1; None: the same rows in order.
        ``steps``: per row, the steps (1..k) that compute its real tokens; a row's later steps
        write the cache's null slot at a context of one token (their tokens are garbage the
        host drops: the row ends with its last real one). None: k for every row.
        The caller has reserved KV slots through position num_tokens - 2 + ahead + steps[i].
        """
        n = len(batch.seqs)
        if k < 1 or np.any(np.asarray(ahead) < 0) or not self.can_replay(n):
            raise ValueError(f"launch_decode_steps needs k >= 1, ahead >= 0 and a captured graph for {n} rows "
                             f"(k={k}, ahead={ahead})")
        if src_rows is not None and not np.all(np.asarray(ahead) > 0):
            raise ValueError("launch_decode_steps: src_rows needs tokens in flight (ahead > 0)")
        needed_width = max(len(s.block_table) for s in batch.seqs)
        graph_bs = next(b for b in self.graph_batch_sizes if b >= n)
        width = next(w for w in self.graph_widths if w >= needed_width)
        g = self.graphs[(graph_bs, width)]
        sampled = not all(seq.params.greedy for seq in batch.seqs)
        # The whole-chunk graphs end each step in the greedy argmax: sampled chunks replay steps.
        chunk = self.chunk_graphs.get((graph_bs, width)) if k == self._chunk_steps and not sampled else None
        s, max_bs = self._static, self._max_bs
        self._ensure_step_staging(k)
        if self._inputs_consumed is not None:
            # The previous chunk's host->device copies read the pinned buffers rewritten below;
            # the GPU reaches them once the chunk before that one is done (already waited for).
            self._inputs_consumed.synchronize()
        if sampled:
            self._chunk_sampler.stage([seq.params for seq in batch.seqs], k)
        # Steps 1..k-1 advance every row by one position: positions, slots and context lengths
        # are known now (the tokens are not; they stay on the device).
        pos0 = np.fromiter((seq.num_tokens - 1 for seq in batch.seqs), dtype=np.int64, count=n) + np.asarray(ahead)
        pos = pos0[None, :] + np.arange(1, k, dtype=np.int64)[:, None]  # [k-1, n]
        dead = None  # [k-1, n]: steps past a row's last real token
        if steps is not None and min(steps) < k:
            dead = np.arange(1, k, dtype=np.int64)[:, None] >= np.asarray(steps, dtype=np.int64)[None, :]
            pos = np.where(dead, pos0[None, :], pos)  # a position the row's block table covers
        h64, h32 = self._stage_host64_np[:k - 1], self._stage_host32_np[:k - 1]
        h64[:, :n] = pos
        for i, seq in enumerate(batch.seqs):
            h64[:, max_bs + i] = self._slots(np.asarray(seq.block_table, dtype=np.int64), pos[:, i])
        h64[:, max_bs + n:max_bs + graph_bs] = self.kv_cache.null_slot  # padded rows
        h32[:, :n] = pos + 1
        h32[:, n:graph_bs] = 1
        if dead is not None:  # as padded rows: the null slot, one token of context
            h64[:, max_bs:max_bs + n][dead] = self.kv_cache.null_slot
            h32[:, :n][dead] = 1
        if chunk is not None:
            # One graph for the chunk: the staging of steps 1..k-1 goes straight to the buffers it
            # reads, step 0's inputs as for any replay, then one launch.
            self._chunk_stage64.copy_(self._stage_host64[:k - 1], non_blocking=True)
            self._chunk_stage32.copy_(self._stage_host32[:k - 1], non_blocking=True)
            self._copy_inputs(batch, chunk, ahead, src_rows, joined)
            self._record_inputs_consumed()
            chunk.replay()
            self.num_graph_replays += k
            self.num_chunk_replays += 1
            return self._read_back(self._chunk_tokens, k, n)
        # Step 0: the usual host -> device copies (ids from the device when chained), then the graph.
        logits = self._replay(batch, g, ahead=ahead, src_rows=src_rows, joined=joined)
        if sampled:
            self._chunk_sampler.sample(logits[:n], 0, s["tokens"][:n])
        out = self._step_tokens
        out[0, :n].copy_(s["tokens"][:n])
        if k > 1:
            self._stage64[:k - 1].copy_(self._stage_host64[:k - 1], non_blocking=True)
            self._stage32[:k - 1].copy_(self._stage_host32[:k - 1], non_blocking=True)
        self._record_inputs_consumed()
        for j in range(1, k):
            self._packed64[max_bs:].copy_(self._stage64[j - 1])  # positions, slots
            self._packed32[:max_bs].copy_(self._stage32[j - 1])  # context lengths
            s["input_ids"][:n].copy_(s["tokens"][:n])
            g.replay()
            self.num_graph_replays += 1
            if sampled:  # the graph's own logits (re-read: an emulated graph returns a new tensor)
                self._chunk_sampler.sample(self._graph_logits[(g.batch_size, g.width)][:n], j, s["tokens"][:n])
            out[j, :n].copy_(s["tokens"][:n])
        return self._read_back(out, k, n)

    def _mixed_step_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """The logits of a step with prompt tokens: a mixed-step graph's replay where a bucket
        holds the step's shape and every block table fits the graph, else the eager forward pass.
        Counts the shape either way (mixed_step_shapes: what graph buckets are chosen from)."""
        shape = step_shape(batch.num_new_tokens)
        self.mixed_step_shapes[shape] += 1
        bucket = self.mixed_buckets.bucket_for(*shape) if self.mixed_graphs else None
        if bucket is not None and max(len(seq.block_table) for seq in batch.seqs) <= self.max_blocks_per_seq:
            return self._replay_mixed(batch, bucket)
        input_ids, positions, ctx = self.prepare_prefill(batch)
        return self.forward_pass.forward(input_ids, positions, ctx, self.kv_cache)

    @torch.inference_mode()
    def launch_prefill(self, batch: ScheduledBatch) -> DecodeChunk:
        """Whole prompts (every row reaches its last token: batch.samples) whose next token is the
        greedy argmax, launched without waiting: the tokens stay on the device (the next chunk's
        launch_decode_steps gathers them, ``joined``) and come to the host with tokens() -> [1][n].
        The step replays a mixed-step graph where a bucket holds it, as run() does."""
        n = len(batch.seqs)
        if not all(batch.samples(i) and batch.seqs[i].params.greedy for i in range(n)):
            raise ValueError("launch_prefill needs whole prompts of greedy requests")
        logits = self._mixed_step_logits(batch)
        if getattr(self, "_prefill_tokens", None) is None or len(self._prefill_tokens) < self._max_bs:
            self._prefill_tokens = torch.zeros(self._max_bs, dtype=torch.int64, device=self.device)
            self._prefill_tokens_host = torch.zeros(1, self._max_bs, dtype=torch.int64)
            if self.use_pinned:
                self._prefill_tokens_host = self._prefill_tokens_host.pin_memory()
        self._prefill_tokens[n:].zero_()
        self._greedy_argmax(logits[:n], self._prefill_tokens[:n])
        self._prefill_tokens_host[0].copy_(self._prefill_tokens, non_blocking=True)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return DecodeChunk(k=1, n=n, host_tokens=self._prefill_tokens_host, done=done)

    def _record_inputs_consumed(self) -> None:
        """Mark the point after this chunk's host->device copies (see _inputs_consumed)."""
        if self.device.type == "cuda":
            self._inputs_consumed = torch.cuda.Event()
            self._inputs_consumed.record()

    def _read_back(self, out: torch.Tensor, k: int, n: int) -> DecodeChunk:
        """The chunk's token rows out[:k] copied to a pinned host buffer without waiting."""
        host = self._step_tokens_host[self._chunk_parity]
        self._chunk_parity ^= 1  # the next chunk copies into the other buffer while this one is read
        host[:k].copy_(out[:k], non_blocking=True)  # whole rows: a contiguous copy stays asynchronous
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return DecodeChunk(k=k, n=n, host_tokens=host, done=done)

    def _ensure_step_staging(self, k: int) -> None:
        """Device and (pinned) host staging for k-1 extra steps, and the [k, max_bs] token rows;
        kept until a larger k or a new graph capture (whose max_bs it follows) needs new ones."""
        if self._staging_steps >= k:
            return
        max_bs, dev = self._max_bs, self.device
        rows = max(k - 1, 1)
        self._stage64 = torch.zeros(rows, 2 * max_bs, dtype=torch.int64, device=dev)  # positions | slots
        self._stage32 = torch.zeros(rows, max_bs, dtype=torch.int32, device=dev)  # context lengths
        self._stage_host64 = torch.zeros(self._stage64.shape, dtype=torch.int64)
        self._stage_host32 = torch.zeros(self._stage32.shape, dtype=torch.int32)
        if self.use_pinned:
            self._stage_host64 = self._stage_host64.pin_memory()
            self._stage_host32 = self._stage_host32.pin_memory()
        self._stage_host64_np = self._stage_host64.numpy()
        self._stage_host32_np = self._stage_host32.numpy()
        self._step_tokens = torch.zeros(k, max_bs, dtype=torch.int64, device=dev)
        # Two host copies of the token rows: a chained chunk fills one while the host reads the other.
        self._step_tokens_host = [torch.zeros(k, max_bs, dtype=torch.int64) for _ in range(2)]
        if self.use_pinned:
            self._step_tokens_host = [t.pin_memory() for t in self._step_tokens_host]
        self._staging_steps = k

    @torch.inference_mode()
    def prompt_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """float32 logits [T, V] of every new token of a (prefill) batch."""
        input_ids, positions, ctx = self.prepare_prefill(batch, all_logits=True)
        return self.forward_pass.forward(input_ids, positions, ctx, self.kv_cache)

    # ------------------------------------------------------------------ CUDA graphs
    def _replay(self, batch: ScheduledBatch, g: CapturedGraph, ahead: int | list[int] = 0,
                src_rows: list[int] | None = None, joined: DecodeChunk | None = None) -> torch.Tensor:
        self._copy_inputs(batch, g, ahead, src_rows, joined)
        g.replay()
        self.num_graph_replays += 1
        return self._graph_logits[(g.batch_size, g.width)][:len(batch.seqs)]

    def _copy_inputs(self, batch: ScheduledBatch, g: CapturedGraph, ahead: int | list[int] = 0,
                     src_rows: list[int] | None = None, joined: DecodeChunk | None = None) -> None:
        """A replay's inputs into the static buffers: host arrays through the pinned packs, and
        when chained (``ahead``) the token ids from the device's last argmax (its rows
        ``src_rows`` when the batch lost rows; see launch_decode_steps)."""
        n = len(batch.seqs)
        input_ids, positions, slots, context_lens, tables = self._decode_host_arrays(batch, ahead)
        host = self._static_host
        host["input_ids"][:n] = input_ids
        host["positions"][:n] = positions
        host["slot_mapping"][:n] = slots
        host["slot_mapping"][n:g.batch_size] = self.kv_cache.null_slot  # padded rows write to the null block
        host["context_lens"][:n] = context_lens
        host["context_lens"][n:g.batch_size] = 1
        bt = host["block_tables"]
        for i, t in enumerate(tables):
            bt[i, :len(t)] = t
        # Two host->device copies per step: the int64 pack (ids, positions, slots) whole,
        # the int32 pack (context lens, then block-table rows) up to the last live row.
        self._packed64.copy_(self._packed64_host, non_blocking=True)
        end = self._max_bs + n * self.max_blocks_per_seq
        self._packed32[:end].copy_(self._packed32_host[:end], non_blocking=True)
        if src_rows is None and np.any(np.asarray(ahead)):
            self._static["input_ids"][:n].copy_(self._static["tokens"][:n])  # the chained chunk's last tokens
        elif src_rows is not None:  # a gather on the device: the rows still running, from where the
            source = self._static["tokens"]  # last chunk left them, and the prompts' first tokens
            if joined is not None:
                source = torch.cat((source, self._prefill_tokens))
            rows = self._to_device([r if r >= 0 else self._max_bs - 1 - r for r in src_rows], torch.int64)
            self._static["input_ids"][:n].copy_(source.index_select(0, rows))

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """(Re)capture decode graphs for every (batch bucket, width bucket), then the whole-chunk
        and the mixed-step graphs; CUDA only (or emulated)."""
        self.graphs.clear()
        self.mixed_graphs.clear()
        self.mixed_buckets = None
        self.chunk_graphs.clear()  # captured again below, after the one-step graphs (if any are)
        self._chunk_steps = 0
        self._graph_pool = None
        self.graph_batch_sizes, self.graph_widths = [], []
        capture = self.device.type == "cuda"
        if (not capture and not self.emulate_graphs) or self.config.enforce_eager:
            return
        sizes = sorted(self.config.cuda_graph_batch_sizes or [])
        if not sizes:
            return
        widths = sorted({math.ceil(n / self.block_size) for n in self.config.cuda_graph_context_lens or []}
                        | {self.max_blocks_per_seq})
        max_bs = sizes[-1]
        dev = self.device
        width_max = self.max_blocks_per_seq
        # Inputs live in two packed buffers (one per dtype) so a step needs two copies;
        # the named static tensors are fixed views into them.
        self._max_bs = max_bs
        self._staging_steps = 0  # the multi-step staging follows max_bs: sized anew on first use
        self._packed64 = torch.zeros(3 * max_bs, dtype=torch.int64, device=dev)
        self._packed32 = torch.zeros(max_bs + max_bs * width_max, dtype=torch.int32, device=dev)
        self._packed64_host = torch.zeros(self._packed64.shape, dtype=torch.int64)
        self._packed32_host = torch.zeros(self._packed32.shape, dtype=torch.int32)
        if capture:
            self._packed64_host = self._packed64_host.pin_memory()
            self._packed32_host = self._packed32_host.pin_memory()

        def views(p64: torch.Tensor, p32: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"input_ids": p64[:max_bs], "positions": p64[max_bs:2 * max_bs],
                    "slot_mapping": p64[2 * max_bs:], "context_lens": p32[:max_bs],
                    "block_tables": p32[max_bs:].view(max_bs, width_max)}

        self._static = views(self._packed64, self._packed32)
        self._static["slot_mapping"].fill_(self.kv_cache.null_slot)
        self._static["context_lens"].fill_(1)
        self._static.update({
            "query_start_loc": torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            "last_token_indices": torch.arange(max_bs, dtype=torch.int64, device=dev),
            "tokens": torch.zeros(max_bs, dtype=torch.int64, device=dev),  # greedy argmax of the logits
        })
        self._graph_logits.clear()
        self._static_host = {k: v.numpy() for k, v in views(self._packed64_host, self._packed32_host).items()}
        s = self._static
        greedy_argmax = _graph_argmax(capture)
        if capture:
            torch.cuda.synchronize(dev)
            # This runner's own capture stream: another runner capturing at the same time (hot
            # reload's off-path capture) never shares per-stream kernel state with it.
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(dev)
            capture_stream = self._capture_stream
        for width in reversed(widths):
            for bs in reversed(sizes):
                ctx = self._graph_context(bs, width, s["slot_mapping"][:bs], s["context_lens"][:bs])

                def run_static(bs: int = bs, width: int = width, ctx: AttentionContext = ctx) -> None:
                    logits = self.forward_pass.forward(s["input_ids"][:bs], s["positions"][:bs], ctx, self.kv_cache)
                    # The graph's own output: its address is fixed once captured (the reference kept
                    # here keeps the pool from handing it to another graph), so replays need no
                    # copy into a static logits buffer ([B, V] float32: ~47 us a step at B=128).
                    self._graph_logits[(bs, width)] = logits
                    # Greedy tokens inside the graph (first index of the max, as sampling's argmax).
                    greedy_argmax(logits, s["tokens"][:bs])

                if not capture:
                    self.graphs[(bs, width)] = CapturedGraph(run_static, bs, width)
                    continue
                # Warm-up outside the graph, on the stream the capture will use: lazy
                # initialisation (cuBLAS handles, Triton autotuning, the split-K GEMVs' tile
                # counters, which are kept per stream) must not happen during capture.
                with torch.cuda.stream(capture_stream):
                    run_static()
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph_pool, stream=capture_stream):
                    run_static()
                if self._graph_pool is None:
                    self._graph_pool = graph.pool()
                self.graphs[(bs, width)] = CapturedGraph(graph.replay, bs, width)
                torch.cuda.synchronize(dev)
        self.graph_batch_sizes = sizes
        self.graph_widths = widths
        self._greedy_argmax = greedy_argmax
        self._capture_chunk_graphs()
        self.capture_mixed_graphs()

    def _graph_context(self, bs: int, width: int, slots: torch.Tensor, lens: torch.Tensor) -> AttentionContext:
        """A captured decode step's context: ``bs`` rows of the static block tables, ``width``
        blocks wide, with these slots and context lengths (static, or a chunk's staging row)."""
        s = self._static
        return AttentionContext(
            is_prefill=False, slot_mapping=slots, block_tables=s["block_tables"][:bs, :width], context_lens=lens,
            query_start_loc=s["query_start_loc"][:bs + 1], max_query_len=1, max_context_len=width * self.block_size,
            last_token_indices=s["last_token_indices"][:bs])

    @torch.inference_mode()
    def recapture_chunk_graphs(self) -> None:
        """Capture the whole-chunk graphs again for the current decode_steps (the one-step graphs
        stay); the engine calls it when decode_steps changes at run time."""
        if not self.graphs:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._capture_chunk_graphs()

    def _capture_chunk_graphs(self) -> None:
        """Whole-chunk graphs (EngineConfig.chunk_graph_max_batch) for chunks of decode_steps
        steps, per (batch bucket <= that size, width). Step 0 reads the static inputs, as the
        one-step graphs do; step j >= 1 reads row j-1 of the chunk's own staging (positions |
        slots, context lengths) and step j-1's argmax as its token ids; every step's argmax
        goes to its row of the chunk's token rows, and the last one to the static tokens too
        (the next chained chunk's step 0 reads them there). Nothing is copied between steps."""
        self.chunk_graphs.clear()
        self._chunk_steps = 0
        k = self.config.decode_steps
        sizes = [bs for bs in self.graph_batch_sizes if bs <= self.config.chunk_graph_max_batch]
        if k < 2 or not sizes:
            return
        s, max_bs, dev = self._static, self._max_bs, self.device
        greedy_argmax, capture_stream = self._greedy_argmax, self._capture_stream if dev.type == "cuda" else None
        # Padded rows and the warm-up write to the null slot, as the one-step graphs' buffers do.
        self._chunk_stage64 = torch.zeros(k - 1, 2 * max_bs, dtype=torch.int64, device=dev)  # positions | slots
        self._chunk_stage64[:, max_bs:] = self.kv_cache.null_slot
        self._chunk_stage32 = torch.ones(k - 1, max_bs, dtype=torch.int32, device=dev)  # context lengths
        self._chunk_tokens = torch.zeros(k, max_bs, dtype=torch.int64, device=dev)
        for width in reversed(self.graph_widths):
            for bs in reversed(sizes):
                contexts = [self._graph_context(bs, width, s["slot_mapping"][:bs], s["context_lens"][:bs])] + [
                    self._graph_context(bs, width, self._chunk_stage64[j, max_bs:max_bs + bs], self._chunk_stage32[j, :bs])
                    for j in range(k - 1)]

                def run_chunk(bs: int = bs, contexts: list[AttentionContext] = contexts) -> None:
                    for j, ctx in enumerate(contexts):
                        ids = s["input_ids"][:bs] if j == 0 else self._chunk_tokens[j - 1, :bs]
                        positions = s["positions"][:bs] if j == 0 else self._chunk_stage64[j - 1, :bs]
                        logits = self.forward_pass.forward(ids, positions, ctx, self.kv_cache)
                        greedy_argmax(logits, self._chunk_tokens[j, :bs])
                    s["tokens"][:bs].copy_(self._chunk_tokens[len(contexts) - 1, :bs])

                if capture_stream is None:  # emulated on the CPU
                    self.chunk_graphs[(bs, width)] = CapturedGraph(run_chunk, bs, width)
                    continue
                with torch.cuda.stream(capture_stream):
                    run_chunk()  # warm-up: writes only the null slot
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph_pool, stream=capture_stream):
                    run_chunk()
                self.chunk_graphs[(bs, width)] = CapturedGraph(graph.replay, bs, width)
                torch.cuda.synchronize(dev)
        self._chunk_steps = k


def _graph_argmax(on_cuda: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The greedy argmax a decode graph ends with: logits [B, V] float32 -> tokens [B] int64.

    On CUDA, kernels.argmax.argmax: the vocabulary split over ~2 programs per SM and merged
    (torch.argmax reduces each 128K-logit row in one block: 27.5 us a step at batch 1 on an
    H200 against the kernel's ~4 us). Both return the first index of the maximum. Elsewhere,
    when Triton is missing, or with SHAPESHIFT_GRAPH_ARGMAX=torch (to measure the difference),
    torch.argmax.
    """
    if on_cuda and os.environ.get("SHAPESHIFT_GRAPH_ARGMAX", "triton") != "torch":
        try:
            from shapeshift.kernels.argmax import argmax
        except ImportError:
            pass
        else:
            return lambda logits, out: argmax(logits, out=out)
    return lambda logits, out: torch.argmax(logits, dim=-1, out=out)
