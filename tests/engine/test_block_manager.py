"""BlockManager: prefix hits (in tokens), reference counts, LRU eviction, tags."""

from __future__ import annotations

from engine_factories import make_requests
from shapeshift.engine.core.block_manager import BlockManager
from shapeshift.engine.core.sampling import SamplingParams
from shapeshift.engine.core.sequence import Sequence


def seq_of(tokens: list[int], rid: str = "s") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), params=SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` and pretend the step computed all its tokens."""
    cached = bm.num_cached_tokens(seq)
    assert bm.can_allocate(seq, seq.num_tokens - cached)
    bm.allocate(seq, seq.num_tokens - cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def test_prefix_hits_are_counted_in_tokens_and_share_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    a = seq_of(prefix + [1, 2], "a")
    compute_all(bm, a)
    assert (bm.prefix_cache_queried_tokens, bm.prefix_cache_hit_tokens) == (12, 0)
    b = seq_of(prefix + [7, 8, 9], "b")
    compute_all(bm, b)
    assert bm.prefix_cache_queried_tokens == 12 + 13
    assert bm.prefix_cache_hit_tokens == 8  # the two full shared blocks, counted in tokens
    assert b.num_cached_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    bm.deallocate(a)
    assert [bm.blocks[i].ref_count for i in b.block_table[:2]] == [1, 1]
    shared = b.block_table[:2]
    bm.deallocate(b)
    assert all(bm.blocks[i].ref_count == 0 for i in shared)
    assert bm.num_free_blocks == 16
    # Freed blocks keep their content: a third request still hits them.
    c = seq_of(prefix + [5], "c")
    compute_all(bm, c)
    assert c.num_cached_tokens == 8 and c.block_table[:2] == shared


def test_hit_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute_all(bm, seq_of(list(range(8)), "a"))
    again = seq_of(list(range(8)), "b")
    assert bm.num_cached_tokens(again) == 4  # not 8: the step must produce logits
    bm.allocate(again, 4)
    assert again.num_computed_tokens == 4 and len(again.block_table) == 2


def test_uncached_free_blocks_are_used_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = seq_of([1, 2, 3, 4], "a")
    compute_all(bm, a)
    bm.deallocate(a)  # 2 cached free blocks, 4 never-used blocks
    b = seq_of([9, 9, 9, 9, 9, 9, 9], "b")  # needs 4 blocks
    compute_all(bm, b)
    assert bm.num_evictions == 0
    assert bm.num_cached_tokens(seq_of([1, 2, 3, 4, 5], "probe")) == 4


def test_lru_eviction_takes_the_least_recently_freed_blocks_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, mid, new = seq_of([1, 1, 1, 1], "old"), seq_of([2, 2, 2, 2], "mid"), seq_of([3, 3, 3, 3], "new")
    for s in (old, mid, new):
        compute_all(bm, s)  # 6 blocks, all full and hashed
    for s in (old, mid, new):
        bm.deallocate(s)
    assert bm.num_free_blocks == 6 and len(bm.free_cached) == 6
    fresh = seq_of([7, 7, 7, 7, 7], "fresh")  # 3 blocks: evicts "old" (2 blocks) and one of "mid"
    compute_all(bm, fresh)
    assert bm.num_evictions == 3
    probe = lambda toks: bm.num_cached_tokens(seq_of(toks + [0], "p"))  # noqa: E731
    assert probe([1, 1, 1, 1]) == 0
    # mid's tail block was freed before its head (tail-first), so the head survives.
    assert probe([2, 2, 2, 2]) == 2
    assert probe([3, 3, 3, 3]) == 4


def test_revived_cached_blocks_count_against_free_space():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq_of([5, 6, 7, 8], "a")
    compute_all(bm, a)
    bm.deallocate(a)  # 2 cached free + 2 fresh
    b = seq_of([5, 6, 7, 8, 1, 2, 3], "b")  # hits 2 blocks (revived), needs 2 more
    assert bm.can_allocate(b, 3)
    c = seq_of([5, 6, 7, 8, 1, 2, 3, 4, 5], "c")  # hits 2, needs 3 more: 5 > 4
    assert not bm.can_allocate(c, 5)


def test_append_slots_and_can_append_follow_block_boundaries():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = seq_of([1, 2, 3], "s")
    bm.allocate(s, 3)
    assert len(s.block_table) == 1
    s.num_computed_tokens = 3
    assert bm.can_append(s, 1)
    bm.append_slot(s)  # token 4 still fits block 0
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    bm.append_slot(s)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    assert bm.can_append(s, 4) and not bm.can_append(s, 5)


def test_tag_change_invalidates_hits_and_prefix_caching_can_be_off():
    bm = BlockManager(num_blocks=8, block_size=2, tag="fp-a")
    a = seq_of([1, 2, 3, 4, 5], "a")
    compute_all(bm, a)
    assert bm.num_cached_tokens(seq_of([1, 2, 3, 4, 5], "x")) == 4
    bm.set_tag("fp-b")
    assert bm.num_cached_tokens(seq_of([1, 2, 3, 4, 5], "x")) == 0
    off = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    compute_all(off, seq_of([1, 2, 3, 4, 5], "a"))
    b = seq_of([1, 2, 3, 4, 5], "b")
    compute_all(off, b)
    assert off.prefix_cache_hit_tokens == 0 and b.num_cached_tokens == 0


def chain_tokens(bm: BlockManager, chain: list[int]) -> list[int]:
    return [t for b in chain for t in bm.blocks[b].token_ids]


def test_cached_chains_are_prefixes_a_lookup_hits_and_forget_cut_ones():
    """What the hot-swap KV check continues: each chain is the first blocks of a cached prefix,
    exactly the blocks a request with its tokens would hit; a prefix whose parent was evicted
    is left out; distinct first blocks come before more chains from the same first block."""
    bm = BlockManager(num_blocks=32, block_size=2)
    a = seq_of(list(range(10)) + [99], "a")  # 5 full blocks
    b = seq_of([0, 1, 2, 3, 50, 51, 52, 53, 99], "b")  # a's first 2 blocks, then 2 of its own
    c = seq_of([90, 91, 92, 93, 94, 95, 99], "c")  # 3 blocks of its own, registered last
    for seq in (a, b, c):
        compute_all(bm, seq)
    chains = bm.cached_chains(3, max_blocks=3)
    assert chains[:2] == [c.block_table[:3], b.block_table[:3]]  # the latest registered first, distinct firsts
    assert chains[2][0] == c.block_table[0] and len(chains) == 3
    for chain in chains:
        assert bm.lookup(seq_of(chain_tokens(bm, chain) + [7], "probe")) == chain
    tables = {seq.request_id: list(seq.block_table) for seq in (a, b, c)}
    for seq in (a, b, c):
        bm.deallocate(seq)
    # a's second block evicted: a's and b's later blocks are unreachable, a's first is still a prefix
    cut = tables["a"][1]
    bm.free_cached.move_to_end(cut, last=False)
    bm.free_uncached.clear()
    bm._take_free_block()
    assert bm.blocks[cut].hash is None
    chains = bm.cached_chains(8, max_blocks=3)
    assert chains and all(cut not in chain for chain in chains)
    assert sorted(map(tuple, chains)) == sorted({tuple(tables["a"][:1]), tuple(tables["c"][:3]),
                                                 tuple(tables["c"][:2]), tuple(tables["c"][:1])})
    for chain in chains:
        assert bm.lookup(seq_of(chain_tokens(bm, chain) + [7], "probe")) == chain
    bm.flush()
    assert bm.cached_chains(3, max_blocks=3) == [] and bm.num_cached_tokens(seq_of(list(range(10)), "x")) == 0


def test_cached_chains_of_a_long_prompt_start_at_its_first_block():
    bm = BlockManager(num_blocks=520, block_size=4)
    long = seq_of(list(range(2048)) + [1], "long")  # 512 full blocks
    compute_all(bm, long)
    assert bm.cached_chains(3, max_blocks=4) == [long.block_table[:4]]  # the 64 scanned blocks share one prefix


def test_factories_give_distinct_prompts():
    seqs = make_requests([3, 5], prefix=[1, 2])
    assert seqs[0].prompt_token_ids[:2] == seqs[1].prompt_token_ids[:2] == [1, 2]
    assert seqs[0].prompt_token_ids[2:] != seqs[1].prompt_token_ids[2:5]
