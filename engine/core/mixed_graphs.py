"""Mixed prefill/decode steps for CUDA graphs: the bucket table and each step's static inputs.

Data flow: a ``ScheduledBatch`` that is not decode-only (a prefill chunk beside decodes, or
prompts alone) -> ``MixedBuckets.bucket_for(num_seqs, num_tokens)`` (the smallest captured
(tokens, seqs) bucket holding it) -> ``fill_mixed_inputs`` writes the step's token ids,
positions, KV slots, cumulative query lengths, context lengths, block tables and the row of
each sequence's last token into host arrays of the bucket's fixed sizes -> the runner copies
them into its static buffers and replays the bucket's graph (engine/core/runner.py) ->
logits [seqs, V] of which the first len(batch.seqs) rows are real.

Padding: tokens past the batch's own write to the cache's null slot and belong to no
sequence (query_start_loc stays at the batch's token count for the padded sequences, whose
context length is 0), so attention gives them nothing to read and they touch no live KV.

The bucket table comes from the step shapes a replay observed (``choose_buckets`` over a
histogram of (num_seqs, num_tokens), e.g. ``ModelRunner.mixed_step_shapes``) or, before
any traffic, from ``default_buckets``. Nothing here needs torch or a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

# Token counts of the default ladder: doubling with a midpoint, so a step's tokens are padded by
# at most half (past 32 tokens). Chat steps at concurrency 32 are mostly a short prefix-cache miss
# beside ~31 decodes (32-64 tokens) or a prompt chunk filling the token budget.
DEFAULT_TOKEN_LADDER = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                        6144, 8192)


@dataclass(frozen=True, order=True)
class MixedBucket:
    tokens: int  # new tokens the graph computes (T, padded)
    seqs: int  # sequences it holds (rows of its logits, B, padded)

    def holds(self, num_seqs: int, num_tokens: int) -> bool:
        return num_seqs <= self.seqs and num_tokens <= self.tokens

    @property
    def cost(self) -> int:
        """Padded work of a step in this bucket, in token rows: every token goes through the
        layers, and each sequence's last token through the lm_head too (about one more layer's
        weight read at these sizes), so a row of logits is counted as one more token."""
        return self.tokens + self.seqs


@dataclass(frozen=True)
class MixedBuckets:
    """The captured buckets; a step goes to the cheapest one that holds it."""

    buckets: tuple[MixedBucket, ...]

    def __post_init__(self) -> None:
        for b in self.buckets:
            if b.tokens <= 0 or b.seqs <= 0 or b.seqs > b.tokens:
                raise ValueError(f"mixed graph bucket {b} needs 0 < seqs <= tokens (every sequence computes a token)")
        object.__setattr__(self, "buckets", tuple(sorted(set(self.buckets), key=lambda b: (b.cost, b))))

    def bucket_for(self, num_seqs: int, num_tokens: int) -> MixedBucket | None:
        """The cheapest bucket holding a step of ``num_seqs`` sequences and ``num_tokens`` new
        tokens, or None (the step runs eagerly)."""
        for b in self.buckets:  # sorted by cost: the first that holds it is the cheapest
            if b.holds(num_seqs, num_tokens):
                return b
        return None

    @property
    def max_tokens(self) -> int:
        return max((b.tokens for b in self.buckets), default=0)

    @property
    def max_seqs(self) -> int:
        return max((b.seqs for b in self.buckets), default=0)

    def largest_first(self) -> list[MixedBucket]:
        """Capture order: the largest first, so smaller graphs reuse its pool memory."""
        return sorted(self.buckets, key=lambda b: (b.tokens, b.seqs), reverse=True)

    def as_pairs(self) -> list[list[int]]:
        return [[b.tokens, b.seqs] for b in sorted(self.buckets)]


def _token_ladder(max_tokens: int) -> list[int]:
    ladder = [t for t in DEFAULT_TOKEN_LADDER if t < max_tokens]
    return ladder + [max_tokens]


def _seq_ladder(batch_sizes: Iterable[int], max_seqs: int) -> list[int]:
    """Sequence buckets: the largest and every second decode batch size below it. Padded
    sequences cost little (their tokens are padding already counted; their lm_head rows ride
    on a weight read that is the same for 16 or 64 rows), so a coarse ladder suffices."""
    sizes = sorted({s for s in batch_sizes if s < max_seqs}, reverse=True)
    return sorted(set(sizes[::2]) | {max_seqs})


def default_buckets(max_tokens: int, max_seqs: int, batch_sizes: Iterable[int]) -> MixedBuckets:
    """The table used before any traffic was observed: every token count of the ladder up to
    the token budget, each with the sequence buckets that fit under it (at most one sequence
    per token). For the default engine (budget 2048, 64 sequences, decode buckets 1..64:
    sequence buckets 2, 8, 32, 64) that is 52 graphs."""
    seq_sizes = _seq_ladder(batch_sizes, max_seqs)
    full = MixedBucket(max(max_tokens, max_seqs), max_seqs)
    return MixedBuckets(tuple([MixedBucket(t, s) for t in _token_ladder(max_tokens) for s in seq_sizes if s <= t]
                              + [full]))


def choose_buckets(shapes: Mapping[tuple[int, int], int], max_tokens: int, max_seqs: int,
                   batch_sizes: Iterable[int], max_graphs: int = 24) -> MixedBuckets:
    """Buckets fitted to an observed histogram {(num_seqs, num_tokens): steps}.

    Candidates are the default table's buckets; the full bucket (max_tokens, max_seqs) is
    always kept so every step has a home. Then, greedily, the candidate that saves the most
    padded work over the histogram (MixedBucket.cost, weighted by step counts) joins, until
    ``max_graphs`` or no candidate saves anything. Greedy selection under a set-cover-like
    cost is not optimal in general; with a few dozen candidates it is within a few percent of
    the best table in the cases tests/engine/test_mixed_graphs.py checks by brute force."""
    if max_graphs < 1:
        raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
    full = MixedBucket(max(max_tokens, max_seqs), max_seqs)
    candidates = [b for b in default_buckets(max_tokens, max_seqs, batch_sizes).buckets if b != full]
    observed = [(n, t, c) for (n, t), c in shapes.items() if c > 0 and n <= full.seqs and t <= full.tokens]
    best = [full.cost] * len(observed)  # each shape's cost under the table so far
    chosen = [full]
    while len(chosen) < max_graphs and candidates:
        gains = []
        for b in candidates:
            gain = sum(c * (best[i] - b.cost) for i, (n, t, c) in enumerate(observed)
                       if b.holds(n, t) and b.cost < best[i])
            gains.append(gain)
        top = max(range(len(candidates)), key=lambda i: (gains[i], -candidates[i].cost))
        if gains[top] <= 0:
            break
        b = candidates.pop(top)
        chosen.append(b)
        best = [min(best[i], b.cost) if b.holds(n, t) else best[i] for i, (n, t, _) in enumerate(observed)]
    return MixedBuckets(tuple(chosen))


def padded_cost(buckets: MixedBuckets, shapes: Mapping[tuple[int, int], int]) -> tuple[int, int]:
    """(padded work, real work) of a histogram under ``buckets``, both in MixedBucket.cost
    units; steps no bucket holds count at their real size (they run eagerly)."""
    padded = real = 0
    for (n, t), c in shapes.items():
        b = buckets.bucket_for(n, t)
        real += c * (t + n)
        padded += c * (b.cost if b is not None else t + n)
    return padded, real


@dataclass
class MixedHostInputs:
    """Host arrays of one mixed step at its bucket's sizes (views into the runner's pinned
    packs on CUDA). Filled by fill_mixed_inputs; the names match the static device buffers."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    context_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, W] int32
    last_token_indices: np.ndarray  # [B] int64

    @classmethod
    def zeros(cls, tokens: int, seqs: int, width: int) -> MixedHostInputs:
        return cls(input_ids=np.zeros(tokens, np.int64), positions=np.zeros(tokens, np.int64),
                   slot_mapping=np.zeros(tokens, np.int64), query_start_loc=np.zeros(seqs + 1, np.int32),
                   context_lens=np.zeros(seqs, np.int32), block_tables=np.zeros((seqs, width), np.int32),
                   last_token_indices=np.zeros(seqs, np.int64))


def fill_mixed_inputs(host: MixedHostInputs, bucket: MixedBucket, seqs: list, num_new_tokens: list[int],
                      block_size: int, null_slot: int) -> int:
    """Write a step of ``seqs`` (each computing ``num_new_tokens[i]`` tokens from its
    num_computed_tokens on) into the first bucket.tokens / bucket.seqs entries of ``host``;
    returns the number of real tokens. Every entry up to the bucket's size is written, so
    nothing of an earlier step leaks into this one; the block-table rows past each table's
    length are zero (attention masks them by context length)."""
    n, total = len(seqs), sum(num_new_tokens)
    if not bucket.holds(n, total):
        raise ValueError(f"a step of {n} sequences and {total} tokens does not fit bucket {bucket}")
    T, B = bucket.tokens, bucket.seqs
    width = host.block_tables.shape[1]
    qsl = host.query_start_loc
    qsl[0] = 0
    bt = host.block_tables
    bt[:B] = 0
    at = 0
    for i, (seq, num) in enumerate(zip(seqs, num_new_tokens)):
        start = seq.num_computed_tokens
        table = np.asarray(seq.block_table, dtype=np.int64)
        if len(table) > width:
            raise ValueError(f"sequence {seq.request_id} has {len(table)} KV blocks, more than the graphs' {width}")
        pos = np.arange(start, start + num, dtype=np.int64)  # [num]
        host.input_ids[at:at + num] = seq.token_ids[start:start + num]
        host.positions[at:at + num] = pos
        host.slot_mapping[at:at + num] = table[pos // block_size] * block_size + pos % block_size
        bt[i, :len(table)] = table
        at += num
        qsl[i + 1] = at
        host.context_lens[i] = start + num
        host.last_token_indices[i] = at - 1
    # Padding: tokens with no sequence (null slot, position 0), sequences with no tokens.
    host.input_ids[at:T] = 0
    host.positions[at:T] = 0
    host.slot_mapping[at:T] = null_slot
    qsl[n + 1:B + 1] = at
    host.context_lens[n:B] = 0
    host.last_token_indices[n:B] = max(at - 1, 0)
    return at


def step_shape(num_new_tokens: list[int]) -> tuple[int, int]:
    """The histogram key of a step: (num_seqs, num_tokens)."""
    return len(num_new_tokens), sum(num_new_tokens)


def parse_buckets(pairs: Iterable[Iterable[int]]) -> MixedBuckets:
    """[[tokens, seqs], ...] (EngineConfig.mixed_graph_buckets) -> MixedBuckets."""
    buckets = []
    for pair in pairs:
        tokens, seqs = (int(x) for x in pair)
        buckets.append(MixedBucket(tokens, seqs))
    return MixedBuckets(tuple(buckets))


__all__ = ["MixedBucket", "MixedBuckets", "MixedHostInputs", "default_buckets", "choose_buckets", "padded_cost",
           "fill_mixed_inputs", "step_shape", "parse_buckets", "DEFAULT_TOKEN_LADDER"]
