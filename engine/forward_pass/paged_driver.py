"""A small paged driver that runs forward passes the way the engine's runner does.

The hot-reload smoke check runs a candidate beside the incumbent on a private KV cache,
off the serving path, and the verification gates need control the engine hides: which KV blocks a sequence
gets (to force reuse of another request's freed blocks), which blocks two sequences
share (prefix hits), what is in the cache before a step (poison), and which pass
writes the cache and which reads it (swap compatibility). This driver owns a
``KVCache`` and a free list and builds ``AttentionContext``s exactly as the contract
describes:

    Seq(tokens, blocks, num_computed) --step([seqs], passes)--> input_ids [T],
    positions [T], AttentionContext(slot_mapping [T], block_tables [B, W],
    context_lens [B], query_start_loc [B+1], last_token_indices [B]) -> fp.forward
    -> float32 logits [B, V]

Free and newly allocated blocks are filled with finite garbage ("poison"): a correct
pass writes every slot before reading it and masks everything past a sequence's
context, so poison never reaches its outputs; a pass that reads stale or foreign
slots is pulled away from the reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shapeshift.engine.core.attention import AttentionContext
from shapeshift.engine.core.config import ModelConfig
from shapeshift.engine.core.kv_cache import KVCache

POISON_SCALE = 50.0  # finite: masked slots see probability 0, and 0 * finite == 0


@dataclass
class Seq:
    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    shared_blocks: int = 0  # leading blocks borrowed from another sequence (not freed by this one)


DEFAULT_BLOCK_SIZE = 16  # tokens per KV block of a driver's cache


class PagedDriver:
    def __init__(self, model_config: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                 num_blocks: int = 64, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.device = torch.device(device)
        self.kv = KVCache.allocate(model_config, num_blocks, block_size, dtype, self.device)
        self.free: list[int] = list(range(num_blocks))  # LIFO: freed blocks are reused first
        self.gen = torch.Generator(device="cpu")
        self.gen.manual_seed(seed)
        self._poison_all()

    # ------------------------------------------------------------------ blocks
    def _poison_all(self) -> None:
        """Every block, the null block included: one draw per layer and tensor."""
        for layer in range(len(self.kv.k)):
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                garbage = torch.randn(cache.shape, generator=self.gen) * POISON_SCALE
                cache.copy_(garbage.to(cache.dtype))

    def place(self, blocks: list[int]) -> None:
        """Hand out these free block ids next, in this order (to put sequences anywhere in the pool)."""
        chosen = set(blocks)
        free = set(self.free)
        if len(chosen) != len(blocks) or not chosen <= free:
            raise ValueError("place() takes distinct free block ids")
        self.free = [b for b in self.free if b not in chosen] + list(reversed(blocks))
    def _poison(self, block: int) -> None:
        for layer in range(len(self.kv.k)):
            for cache in (self.kv.k[layer], self.kv.v[layer]):
                garbage = torch.randn(cache.shape[1:], generator=self.gen) * POISON_SCALE
                cache[block].copy_(garbage.to(cache.dtype))

    def allocate(self, seq: Seq, upto_tokens: int) -> None:
        need = math.ceil(upto_tokens / self.block_size)
        while len(seq.blocks) < need:
            if not self.free:
                raise RuntimeError("verification driver ran out of KV blocks; raise num_blocks")
            block = self.free.pop()
            self._poison(block)
            seq.blocks.append(block)

    def release(self, seq: Seq) -> None:
        for block in reversed(seq.blocks[seq.shared_blocks:]):
            self._poison(block)
            self.free.append(block)
        seq.blocks = seq.blocks[:seq.shared_blocks]

    def fork_prefix(self, parent: Seq, tokens: list[int], num_shared_blocks: int) -> Seq:
        """A new sequence whose first ``num_shared_blocks`` full blocks are the parent's (a prefix hit)."""
        assert tokens[:num_shared_blocks * self.block_size] == parent.tokens[:num_shared_blocks * self.block_size]
        assert parent.num_computed >= num_shared_blocks * self.block_size
        return Seq(tokens=list(tokens), blocks=list(parent.blocks[:num_shared_blocks]),
                   num_computed=num_shared_blocks * self.block_size, shared_blocks=num_shared_blocks)

    # ------------------------------------------------------------------ steps
    def build_step(self, seqs: list[Seq], num_new: list[int]) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
        for seq, n in zip(seqs, num_new):
            assert n >= 1 and seq.num_computed + n <= len(seq.tokens), "schedule beyond the known tokens"
            self.allocate(seq, seq.num_computed + n)
        return step_inputs(seqs, num_new, self.block_size, self.kv.null_block, self.device)

    def step(self, fp: Any, seqs: list[Seq], num_new: list[int] | None = None) -> torch.Tensor:
        """Run one step of ``fp`` over the next ``num_new`` tokens of each sequence (default: all).

        Returns float32 logits [B, V] of each sequence's last scheduled token.
        """
        if num_new is None:
            num_new = [len(s.tokens) - s.num_computed for s in seqs]
        input_ids, positions, ctx = self.build_step(seqs, num_new)
        logits = fp.forward(input_ids, positions, ctx, self.kv)
        for seq, n in zip(seqs, num_new):
            seq.num_computed += n
        return logits

    def graph_decode_step(self, fp: Any, seqs: list[Seq], bucket: int, width: int, fill: Any) -> torch.Tensor:
        """One decode step (the next token of each sequence) shaped as the engine's CUDA-graph
        replay of the bucket that holds the batch (engine/core/runner.py ``_copy_inputs``,
        ``_graph_context``): ``bucket`` rows, those past the batch padded (a token written to the
        null slot, one token of context, a block-table row left from an earlier step), block
        tables ``width`` blocks wide whose unused columns hold stale block ids, and no host copies
        of the lengths. ``fill`` (a random.Random) draws the padding, so two passes given equal
        ``fill`` see equal steps. Returns float32 logits [len(seqs), V] of the real rows."""
        n = len(seqs)
        if not 1 <= n <= bucket:
            raise ValueError(f"a batch of {n} does not fit bucket {bucket}")
        input_ids, positions, ctx = self.build_step(seqs, [1] * n)
        bs, pool = self.block_size, self.kv.num_blocks
        table = torch.tensor([[fill.randrange(pool) for _ in range(width)] for _ in range(bucket)], dtype=torch.int32)
        for i, seq in enumerate(seqs):
            if len(seq.blocks) > width:
                raise ValueError(f"a sequence of {len(seq.blocks)} blocks is wider than the graph's {width}")
            table[i, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        for row in range(n, bucket):  # a padded row keeps the table of a row served earlier
            table[row] = table[fill.randrange(n)]
        pad = bucket - n
        dev = self.device
        ids = torch.cat([input_ids, torch.tensor([fill.randrange(self.model_config.vocab_size) for _ in range(pad)],
                                                 dtype=torch.int64, device=dev)])
        pos = torch.cat([positions, torch.zeros(pad, dtype=torch.int64, device=dev)])
        slots = torch.cat([ctx.slot_mapping, torch.full((pad,), self.kv.null_slot, dtype=torch.int64, device=dev)])
        lens = torch.cat([ctx.context_lens, torch.ones(pad, dtype=torch.int32, device=dev)])
        graph_ctx = AttentionContext(
            is_prefill=False, slot_mapping=slots, block_tables=table.to(dev), context_lens=lens,
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=dev), max_query_len=1,
            max_context_len=width * bs, last_token_indices=torch.arange(bucket, dtype=torch.int64, device=dev))
        logits = fp.forward(ids, pos, graph_ctx, self.kv)
        for seq in seqs:
            seq.num_computed += 1
        return logits[:n]

    def graph_mixed_step(self, fp: Any, seqs: list[Seq], num_new: list[int], tokens: int, rows: int,
                         width: int) -> torch.Tensor:
        """One step of any mix (prefill chunks beside decodes) shaped as the engine's replay of a
        mixed-step graph of ``tokens`` x ``rows`` (engine/core/mixed_graphs.py
        ``fill_mixed_inputs``): tokens past the step's are padding (id 0, position 0, the null
        slot) and belong to no sequence, rows past the batch have no tokens and no context, block
        tables are ``width`` blocks wide and zero past each table, and no host copies. Returns
        float32 logits [len(seqs), V] of the real rows' last tokens."""
        n, total = len(seqs), sum(num_new)
        if n > rows or total > tokens:
            raise ValueError(f"a step of {n} sequences and {total} tokens does not fit ({tokens}, {rows})")
        input_ids, positions, ctx = self.build_step(seqs, num_new)
        dev, pad = self.device, tokens - total
        table = torch.zeros((rows, width), dtype=torch.int32)
        for i, seq in enumerate(seqs):
            if len(seq.blocks) > width:
                raise ValueError(f"a sequence of {len(seq.blocks)} blocks is wider than the graph's {width}")
            table[i, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
        qsl = ctx.query_start_loc.tolist() + [total] * (rows - n)
        last = ctx.last_token_indices.tolist() + [max(total - 1, 0)] * (rows - n)
        graph_ctx = AttentionContext(
            is_prefill=True,
            slot_mapping=torch.cat([ctx.slot_mapping, torch.full((pad,), self.kv.null_slot, dtype=torch.int64,
                                                                 device=dev)]),
            block_tables=table.to(dev),
            context_lens=torch.cat([ctx.context_lens, torch.zeros(rows - n, dtype=torch.int32, device=dev)]),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev), max_query_len=tokens,
            max_context_len=width * self.block_size,
            last_token_indices=torch.tensor(last, dtype=torch.int64, device=dev))
        ids = torch.cat([input_ids, torch.zeros(pad, dtype=torch.int64, device=dev)])
        pos = torch.cat([positions, torch.zeros(pad, dtype=torch.int64, device=dev)])
        logits = fp.forward(ids, pos, graph_ctx, self.kv)
        for seq, k in zip(seqs, num_new):
            seq.num_computed += k
        return logits[:n]

    def greedy(self, fp: Any, seqs: list[Seq], steps: int, decode_fp: Any | None = None,
               prefill_chunk: int | None = None, forced: list[list[int]] | None = None
               ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Prefill (optionally chunked) then ``steps`` greedy decode steps, all sequences batched.

        ``decode_fp`` runs the decode steps (default ``fp``): prefill with one pass and
        decode with another to check that they read each other's cache.
        ``forced``: feed these tokens instead of the argmax (teacher forcing), so two
        passes are compared on the same trajectory even after a near-tie flips a token.
        Returns (argmax tokens per sequence, logits [B, V] per decode position).
        """
        last: dict[int, torch.Tensor] = {}  # sequence index -> logits [V] after its prefill
        while any(s.num_computed < len(s.tokens) for s in seqs):
            pending = [i for i, s in enumerate(seqs) if s.num_computed < len(s.tokens)]
            left = [len(seqs[i].tokens) - seqs[i].num_computed for i in pending]
            num_new = left if prefill_chunk is None else [min(prefill_chunk, n) for n in left]
            logits = self.step(fp, [seqs[i] for i in pending], num_new)
            for row, i in enumerate(pending):
                if seqs[i].num_computed == len(seqs[i].tokens):
                    last[i] = logits[row]
        if len(last) != len(seqs):
            raise ValueError("greedy() needs sequences with at least one token not yet in the cache")
        current = torch.stack([last[i] for i in range(len(seqs))])  # [B, V]
        out: list[list[int]] = [[] for _ in seqs]
        logits_per_step = []
        for k in range(steps):
            logits_per_step.append(current)
            best = current.argmax(dim=-1).tolist()
            for i, s in enumerate(seqs):
                out[i].append(best[i])
                s.tokens.append(forced[i][k] if forced is not None else best[i])
            if k + 1 < steps:
                current = self.step(decode_fp or fp, seqs, [1] * len(seqs))
        return out, logits_per_step


def step_inputs(seqs: list[Seq], num_new: list[int], block_size: int, null_block: int, device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionContext]:
    """input_ids [T], positions [T] and the AttentionContext of one step over the next ``num_new``
    tokens of each sequence, whose blocks (``seq.blocks``) already cover them."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    qsl = [0]
    lens = []
    for seq, n in zip(seqs, num_new):
        assert n >= 1 and seq.num_computed + n <= len(seq.tokens), "schedule beyond the known tokens"
        end = seq.num_computed + n
        assert len(seq.blocks) * block_size >= end, "the sequence's blocks do not cover the step"
        for p in range(seq.num_computed, end):
            ids.append(seq.tokens[p])
            pos.append(p)
            slots.append(seq.blocks[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
        lens.append(end)
    width = max(len(s.blocks) for s in seqs)
    table = torch.full((len(seqs), width), null_block, dtype=torch.int32)
    for i, seq in enumerate(seqs):
        table[i, :len(seq.blocks)] = torch.tensor(seq.blocks, dtype=torch.int32)
    ctx = AttentionContext(
        is_prefill=any(n != 1 for n in num_new),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=table.to(device),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        max_query_len=max(num_new),
        max_context_len=max(lens),
        last_token_indices=torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=device),
        query_start_loc_cpu=list(qsl),
        context_lens_cpu=list(lens),
    )
    input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
    positions = torch.tensor(pos, dtype=torch.int64, device=device)
    return input_ids, positions, ctx
