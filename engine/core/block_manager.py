"""KV-cache block allocation with prefix caching.

Data flow: the scheduler asks ``can_allocate/allocate`` when it admits a sequence
(prefix-cache lookup over the sequence's FULL blocks, then fresh blocks for the chunk
it will compute), ``can_append/append_slots`` for the next tokens of a running
sequence, ``commit`` after a step wrote KV (newly full blocks get their hash and become
shareable), and ``deallocate`` when a sequence finishes or is preempted.

A full block's hash chains its parent's hash, its token ids and the cache tag
(forward-pass cache format), so a hit means "same tokens, same prefix, same KV
format". Blocks are reference counted; a block whose count drops to zero keeps its
hash and waits in an LRU list of cached free blocks, to be reused on a hit or evicted
(oldest first) when fresh blocks run out. Blocks that never got a hash are handed out
before any cached block is evicted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from shapeshift.engine.core.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: int | None = None  # hash of the block before it in its sequence (None: the first)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tag: str = "") -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"BlockManager needs num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tag = tag
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_uncached: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_hash(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids, self.tag))

    def lookup(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``'s full blocks.

        At least one token is left uncached so the step computes logits for it. The result
        stays valid until blocks are allocated or freed: the scheduler looks up once and
        passes it to ``can_allocate`` and ``allocate`` (hashing a long prompt is not free).
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self.block_hash(parent, tokens)
            block_id = self.hash_to_block.get(h)
            # Token ids are compared too: a hash collision must never serve foreign KV.
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def num_cached_tokens(self, seq: Sequence) -> int:
        return len(self.lookup(seq)) * self.block_size

    # ------------------------------------------------------------------ admission
    def can_allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Can ``seq`` be admitted with its cached prefix (``hits``: from ``lookup``, else looked
        up here) plus ``num_new_tokens`` computed?"""
        if hits is None:
            hits = self.lookup(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # leave the free list
        fresh = self.blocks_needed(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return fresh + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> int:
        """Attach cached prefix blocks (``hits`` as for ``can_allocate``), then fresh blocks for
        ``num_new_tokens``; returns the number of cached tokens (the sequence's
        ``num_computed_tokens`` is set to it)."""
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        if hits is None:
            hits = self.lookup(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]  # revived from the cached free list
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        cached = len(hits) * self.block_size
        if seq.num_preemptions == 0:  # a resumed sequence is not a new query
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += cached
            seq.num_cached_tokens = cached
        seq.num_computed_tokens = cached
        self.append_slots(seq, num_new_tokens)
        return cached

    # ------------------------------------------------------------------ growth
    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Ensure the block table covers ``num_computed_tokens + num_new_tokens`` tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks for {seq.request_id}: need {needed}, {self.num_free_blocks} free "
                "(the scheduler must check can_append first)")
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def append_slot(self, seq: Sequence) -> None:
        self.append_slots(seq, 1)

    def _take_free_block(self) -> int:
        if self.free_uncached:
            block_id = self.free_uncached.popleft()
        else:
            block_id, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            block = self.blocks[block_id]
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
            self.num_evictions += 1
        self.blocks[block_id].ref_count = 1
        return block_id

    def commit(self, seq: Sequence) -> None:
        """Register blocks filled by computed tokens so later requests can share them."""
        num_full = seq.num_computed_tokens // self.block_size
        while len(seq.block_hashes) < num_full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self.block_hash(parent, tokens)
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids, block.parent = h, tokens, parent
                self.hash_to_block[h] = block.block_id
            # Else another sequence registered the same content first: keep ours private.

    # ------------------------------------------------------------------ release
    def deallocate(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Tail blocks are freed first so LRU eviction takes a
        sequence's tail before its (more shareable) head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} ref count below zero"
            if block.ref_count == 0:
                if block.hash is not None:
                    self.free_cached[block_id] = None
                else:
                    self.free_uncached.append(block_id)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def set_tag(self, tag: str) -> None:
        """A new KV format: cached blocks of the old one can no longer be hit."""
        if tag != self.tag:
            self.tag = tag
            self.flush()

    def flush(self) -> None:
        """Forget every cached block (the KV they hold is not to be served again); blocks in use
        stay with their sequences but are no longer shareable."""
        self.hash_to_block.clear()
        for block_id in list(self.free_cached):
            self.blocks[block_id].hash, self.blocks[block_id].token_ids = None, ()
            self.blocks[block_id].parent = None
            del self.free_cached[block_id]
            self.free_uncached.append(block_id)
        for block in self.blocks:
            if block.ref_count > 0:
                block.hash, block.token_ids, block.parent = None, (), None

    def cached_chains(self, limit: int, max_blocks: int, scan: int = 64) -> list[list[int]]:
        """Up to ``limit`` cached prefixes a request could hit now, as block ids from the first
        block on (at most ``max_blocks`` each), most recently registered first, distinct first
        blocks preferred; at most ``scan`` registered blocks are looked at."""
        chains: list[list[int]] = []
        firsts: set[int] = set()
        spare: list[list[int]] = []
        # block id -> the first blocks (at most max_blocks) of its chain, None where a parent was
        # evicted (no lookup reaches the block): each block is walked once, however many of the
        # scanned blocks sit on its chain (the latest registered are the tails of long prompts)
        heads: dict[int, list[int] | None] = {}
        for looked, block_id in enumerate(reversed(self.hash_to_block.values())):
            if looked >= scan or len(chains) >= limit:
                break
            path, head = [], None
            node: int | None = block_id
            while node is not None and node not in heads:
                path.append(node)
                parent = self.blocks[node].parent
                if parent is None:  # the first block of its sequence
                    head, node = [], None
                    break
                node = self.hash_to_block.get(parent)  # None: evicted, the chain is cut
            if node is not None:
                head = heads[node]
            for node in reversed(path):  # from the first block on
                if head is not None and len(head) < max_blocks:
                    head = head + [node]
                heads[node] = head
            chain = heads[block_id]
            if not chain:
                continue
            chain = list(chain)
            (spare if chain[0] in firsts else chains).append(chain)
            firsts.add(chain[0])
        for chain in spare:
            if len(chains) >= limit:
                break
            if chain not in chains:
                chains.append(chain)
        return chains
