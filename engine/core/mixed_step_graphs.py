"""Mixed prefill/decode steps replayed from CUDA graphs: the part of ModelRunner that
captures one graph per (tokens, seqs) bucket and replays a mixed step through it.

Data flow: EngineConfig.mixed_cuda_graphs + the bucket table (engine/core/mixed_graphs.py:
defaults, fitting, the static inputs' layout) -> ``capture_mixed_graphs`` (static packs,
warm-up, capture largest first in the decode graphs' pool) -> per mixed step
``_replay_mixed`` (fill the pinned packs, copy, replay) -> float32 logits [n, V].
Why a graphable varlen attention rather than piecewise graphs: docs/serving-performance.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shapeshift.engine.core.attention import AttentionContext
from shapeshift.engine.core.mixed_graphs import (MixedBucket, MixedBuckets, MixedHostInputs, default_buckets,
                                                 fill_mixed_inputs, parse_buckets)
from shapeshift.engine.core.scheduler import ScheduledBatch

log = logging.getLogger("shapeshift.engine.core.runner")


@dataclass
class CapturedGraph:
    replay: Callable[[], Any]  # CUDAGraph.replay, or an eager stand-in when emulating on the CPU
    batch_size: int
    width: int  # KV blocks read per sequence


class MixedStepGraphs:
    """Mixed-step graph capture and replay over ModelRunner's state (config, device, forward
    pass, KV cache, the decode graphs' pool and capture stream)."""

    # ------------------------------------------------------------------ mixed-step graphs
    def mixed_graphs_supported(self) -> str | None:
        """Why mixed steps cannot replay graphs here (None: they can)."""
        if not self.config.mixed_cuda_graphs:
            return "EngineConfig.mixed_cuda_graphs is off"
        if self.config.enforce_eager or (self.device.type != "cuda" and not self.emulate_graphs):
            return "graphs are off (enforce_eager, or not on CUDA)"
        if self.model_config.family != "llama":
            return f"the {self.model_config.family} prefill path is not capturable (host-side expert routing)"
        if not self.graphs:
            return "no decode graphs were captured (their pool and stream are shared)"
        return None

    @torch.inference_mode()
    def capture_mixed_graphs(self, buckets: MixedBuckets | None = None) -> None:
        """(Re)capture one graph per mixed-step bucket: ``buckets``, else EngineConfig's table,
        else mixed_graphs.default_buckets. Largest first, in the decode graphs' pool. A forward
        pass whose mixed step cannot run without host values fails its warm-up: mixed steps then
        stay eager, with a warning naming the error."""
        self.mixed_graphs.clear()
        self.mixed_buckets = None
        why_not = self.mixed_graphs_supported()
        if why_not is not None:
            if self.config.mixed_cuda_graphs:
                log.info("mixed steps run eagerly: %s", why_not)
            return
        cfg = self.config
        if buckets is None:
            buckets = (parse_buckets(cfg.mixed_graph_buckets) if cfg.mixed_graph_buckets else
                       default_buckets(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.graph_batch_sizes))
        T, B, W = buckets.max_tokens, buckets.max_seqs, self.max_blocks_per_seq
        dev, capture = self.device, self.device.type == "cuda"
        # Two packs as for decode: int64 (ids, positions, slots | last-token rows), int32
        # (cumulative query lengths | context lengths | block tables); one copy each a step.
        self._mixed64 = torch.zeros(3 * T + B, dtype=torch.int64, device=dev)
        self._mixed32 = torch.zeros(2 * B + 1 + B * W, dtype=torch.int32, device=dev)
        self._mixed64_host = torch.zeros(self._mixed64.shape, dtype=torch.int64)
        self._mixed32_host = torch.zeros(self._mixed32.shape, dtype=torch.int32)
        if capture:
            self._mixed64_host = self._mixed64_host.pin_memory()
            self._mixed32_host = self._mixed32_host.pin_memory()

        def views(p64: Any, p32: Any) -> dict[str, Any]:
            return {"input_ids": p64[:T], "positions": p64[T:2 * T], "slot_mapping": p64[2 * T:3 * T],
                    "last_token_indices": p64[3 * T:], "query_start_loc": p32[:B + 1],
                    "context_lens": p32[B + 1:2 * B + 1], "block_tables": p32[2 * B + 1:].reshape(B, W)}

        m = views(self._mixed64, self._mixed32)
        self._mixed_host = MixedHostInputs(**views(self._mixed64_host.numpy(), self._mixed32_host.numpy()))
        # An all-padding step for the warm-ups: no sequence, every token to the null slot.
        fill_mixed_inputs(self._mixed_host, MixedBucket(T, B), [], [], self.block_size, self.kv_cache.null_slot)
        self._mixed64.copy_(self._mixed64_host)
        self._mixed32.copy_(self._mixed32_host)
        self._mixed_logits = torch.zeros(B, self.model_config.vocab_size, dtype=torch.float32, device=dev)
        capture_stream = self._capture_stream
        if capture and capture_stream is None:
            capture_stream = self._capture_stream = torch.cuda.Stream(dev)
        graphs: dict[MixedBucket, CapturedGraph] = {}
        for bucket in buckets.largest_first():
            t, b = bucket.tokens, bucket.seqs
            ctx = AttentionContext(
                is_prefill=True, slot_mapping=m["slot_mapping"][:t], block_tables=m["block_tables"][:b],
                context_lens=m["context_lens"][:b], query_start_loc=m["query_start_loc"][:b + 1],
                max_query_len=t, max_context_len=W * self.block_size, last_token_indices=m["last_token_indices"][:b])

            def run_mixed(t: int = t, b: int = b, ctx: AttentionContext = ctx) -> None:
                logits = self.forward_pass.forward(m["input_ids"][:t], m["positions"][:t], ctx, self.kv_cache)
                self._mixed_logits[:b].copy_(logits)  # one static output for all buckets ([b, V] float32)

            try:
                if capture:
                    with torch.cuda.stream(capture_stream):
                        run_mixed()  # warm-up: lazy initialisation stays out of the capture
                    torch.cuda.synchronize(dev)
                else:
                    run_mixed()
            except Exception as exc:  # noqa: BLE001 - any failure means: this pass's mixed step is not static
                log.warning("mixed steps run eagerly: the forward pass failed a static mixed step of %s: %s: %s",
                            bucket, type(exc).__name__, exc)
                return
            if not capture:
                graphs[bucket] = CapturedGraph(run_mixed, b, W)
                continue
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._graph_pool, stream=capture_stream):
                    run_mixed()
            except RuntimeError as exc:  # a host sync or a CPU tensor inside the step: not capturable
                torch.cuda.synchronize(dev)
                log.warning("mixed steps run eagerly: capturing the mixed step of %s failed: %s", bucket, exc)
                return
            if self._graph_pool is None:
                self._graph_pool = graph.pool()
            graphs[bucket] = CapturedGraph(graph.replay, b, W)
            torch.cuda.synchronize(dev)
        self.mixed_graphs = graphs
        self.mixed_buckets = buckets

    def _replay_mixed(self, batch: ScheduledBatch, bucket: MixedBucket) -> torch.Tensor:
        """A mixed step through its bucket's graph -> float32 logits [n, V] (a view of the static
        output: read before the next replay)."""
        if self._mixed_inputs_consumed is not None:
            # A step whose rows all stopped mid-prompt sampled nothing, hence never synced:
            # its copies must have read the pinned packs before they are rewritten.
            self._mixed_inputs_consumed.synchronize()
        fill_mixed_inputs(self._mixed_host, bucket, batch.seqs, batch.num_new_tokens, self.block_size,
                          self.kv_cache.null_slot)
        self._mixed64.copy_(self._mixed64_host, non_blocking=True)
        self._mixed32.copy_(self._mixed32_host, non_blocking=True)
        if self.device.type == "cuda":
            self._mixed_inputs_consumed = torch.cuda.Event()
            self._mixed_inputs_consumed.record()
        self.mixed_graphs[bucket].replay()
        self.num_mixed_replays += 1
        return self._mixed_logits[:len(batch.seqs)]
