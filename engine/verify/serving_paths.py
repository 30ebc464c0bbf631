"""coverage.padded_batches and coverage.block_pool: the shapes of steps, and the places in the KV
pool, that serving reaches and the other gates' drivers do not.

Every other gate builds exact steps: a batch of n rows, block tables as wide as the widest
sequence, host copies of the lengths, blocks from a pool of about a hundred. Serving differs in
two ways a candidate can be wrong about:

- **Graph replays.** On CUDA a decode batch of n sequences replays the graph of the smallest
  bucket holding it (engine/core/runner.py; mixed steps likewise with mixed_cuda_graphs,
  engine/core/mixed_graphs.py): the rows past n are padding (their token is written
  to the cache's null slot, one token of context, a block-table row left from an earlier step),
  every block table is max_model_len wide, and the context carries no host copies. A pass that
  maps the null slot onto a live block, or takes another path when padding is present, is exact
  on every verified step and wrong on served ones.
- **The whole pool.** The engine's block manager hands out any of its blocks (thousands on a
  GPU); a pass that narrows block ids (a compact table) or treats high ids differently is exact on
  a verification pool that never reaches them.

Data flow:
  coverage.padded_batches: for batch sizes between the graph buckets (and one bucket exactly):
    prompts -> both passes prefill them eagerly (one at a time), then decode in graph-shaped steps
    with the same padding (PagedDriver.graph_decode_step, a shared seed) -> compare() the real
    rows; then a decode row, a prefill and a prefill chunk in two steps shaped as a mixed-step
    graph replays them (PagedDriver.graph_mixed_step: padding tokens, a row with no tokens) ->
    compare(). After every candidate step the KV pool is diffed against a copy taken before it: a
    slot written outside the step's own slots (and the null block) fails the gate, whatever the
    logits say.
  coverage.block_pool: a driver with as many blocks as the serving engine's pool
    (GateSettings.pool_blocks, capped at pool_bytes_max: the evidence says when) -> sequences
    placed on block ids across the whole range (the last block, block 0, the middle, the rest drawn)
    -> both passes decode them -> compare().
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from shapeshift.engine.core.kv_cache import bytes_per_token
from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare
from shapeshift.engine.verify.isolated import CandidateDied, CandidateError

# Graph buckets assumed where the settings name none (a CPU deployment replays no graphs): the
# smallest defaults, so a pass is never verified without padded steps at all.
FALLBACK_BUCKETS = (1, 2, 4, 8)
MAX_PADDED_SHAPES = 6  # (batch, bucket) pairs checked: the smallest four and the largest two
DECODE_STEPS = 3


def padded_shapes(buckets: tuple[int, ...]) -> list[tuple[int, int]]:
    """(batch size, bucket) pairs: for each bucket, the sizes just above the bucket below it and
    just under it (the most and the least padding), plus the smallest bucket above 1 exactly."""
    sizes = sorted({b for b in buckets if b >= 1}) or list(FALLBACK_BUCKETS)
    pairs: set[tuple[int, int]] = set()
    below = 0
    for b in sizes:
        pairs |= {(n, b) for n in (below + 1, b - 1) if below < n < b}
        below = b
    exact = next((b for b in sizes if b > 1), None)
    if exact is not None:
        pairs.add((exact, exact))
    ordered = sorted(pairs, key=lambda p: (p[1], p[0]))
    if len(ordered) > MAX_PADDED_SHAPES:
        ordered = ordered[:MAX_PADDED_SHAPES - 2] + ordered[-2:]
    return ordered


def _snapshot(driver: PagedDriver) -> list[torch.Tensor]:
    return [t.clone() for t in list(driver.kv.k) + list(driver.kv.v)]


def _foreign_writes(driver: PagedDriver, before: list[torch.Tensor], allowed: set[int]) -> list[int]:
    """Slots of live blocks (the null block aside) that changed since ``before`` and are not in
    ``allowed``."""
    bs, null = driver.block_size, driver.kv.null_block
    changed: set[int] = set()
    for old, new in zip(before, list(driver.kv.k) + list(driver.kv.v)):
        diff = (old != new).flatten(2).any(dim=-1)  # [num_blocks + 1, block_size]
        diff[null] = False
        for block, offset in diff.nonzero().tolist():
            changed.add(block * bs + offset)
    return sorted(changed - allowed)


def _require_own_writes(driver: PagedDriver, before: list[torch.Tensor], allowed: set[int], n: int, bucket: int,
                        step: Any) -> None:
    foreign = _foreign_writes(driver, before, allowed)
    if foreign:
        raise GateFailure(f"a step of {n} sequences in bucket {bucket} wrote KV slots that are not its own",
                          batch_size=n, bucket=bucket, step=step, foreign_slots=foreign[:8], foreign_count=len(foreign))


def _step_slots(seqs: list[Seq], num_new: list[int], bs: int) -> set[int]:
    return {s.blocks[p // bs] * bs + p % bs for s, n in zip(seqs, num_new)
            for p in range(s.num_computed, s.num_computed + n)}


def gate_padded_batches(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    bs = s.block_size
    width = math.ceil(s.max_model_len / bs)
    checked: list[list[int]] = []
    for n, bucket in padded_shapes(tuple(s.graph_buckets)):
        prompts = [ctx.prompt(ctx.rng.randint(2, 24)) for _ in range(n)]
        plan = ctx.rng.getrandbits(31)
        runs: dict[str, list[torch.Tensor]] = {}
        forced: list[list[int]] = [[] for _ in range(n)]
        for label, fp in (("reference", ctx.reference), ("candidate", ctx.candidate)):
            d = ctx.driver()
            seqs = [Seq(list(p)) for p in prompts]
            watch = label == "candidate"
            rows = []
            for seq in seqs:  # prefills run eagerly in serving (and coverage.shapes batches them): one each
                d.allocate(seq, len(seq.tokens))
                allowed = _step_slots([seq], [len(seq.tokens)], bs)
                before = _snapshot(d) if watch else None
                rows.append(d.step(fp, [seq])[0])
                if watch:
                    _require_own_writes(d, before, allowed, n, bucket, "prefill")
            logits = torch.stack(rows)
            out = [logits]
            for k in range(DECODE_STEPS - 1):
                if k and watch:
                    _require_own_writes(d, before, allowed, n, bucket, f"decode {k - 1}")
                for i, seq in enumerate(seqs):
                    if label == "reference":
                        forced[i].append(int(logits[i].argmax()))
                    seq.tokens.append(forced[i][k])
                for seq in seqs:
                    d.allocate(seq, seq.num_computed + 1)
                allowed = _step_slots(seqs, [1] * n, bs)
                before = _snapshot(d) if watch else None
                logits = d.graph_decode_step(fp, seqs, bucket, width, random.Random(plan + k))
                out.append(logits)
            if watch:
                _require_own_writes(d, before, allowed, n, bucket, f"decode {DECODE_STEPS - 2}")
            runs[label] = out
        ev = compare(runs["reference"], runs["candidate"], ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            raise GateFailure(f"a graph-shaped step of {n} sequences in bucket {bucket} differs", batch_size=n,
                              bucket=bucket, **ev)
        checked.append([n, bucket])
    mixed = _padded_mixed_step(ctx, width)
    return {"batch_in_bucket": checked, "table_width": width, "mixed_step": mixed,
            "buckets_from": "settings" if s.graph_buckets else f"fallback {list(FALLBACK_BUCKETS)}"}


def _padded_mixed_step(ctx: GateContext, width: int) -> dict[str, Any]:
    """A decode row, a prefill and a prefill chunk in one step shaped as a mixed-step graph
    replays it (PagedDriver.graph_mixed_step: padding tokens on the null slot, a row with no
    tokens, tables ``width`` wide, no host copies), on one schedule for both passes, then another
    (two decodes and the chunk's rest); the KV pool diffed around the candidate's steps. A pass
    that raises there is not judged on it: the engine runs its mixed steps eagerly then."""
    s = ctx.settings
    bs = s.block_size
    donor = ctx.prompt(bs + ctx.rng.randint(1, bs - 1))
    fresh = ctx.prompt(ctx.rng.randint(2, bs))
    chunked = ctx.prompt(2 * bs + 5)
    chunk = bs + 1
    news = [1, len(fresh), chunk]
    tokens = -(-(sum(news) + 3) // bs) * bs  # the bucket: tokens rounded up past the step's own
    runs: dict[str, list[torch.Tensor]] = {}
    forced: list[int] = []
    for label, fp in (("reference", ctx.reference), ("candidate", ctx.candidate)):
        try:
            runs[label] = _mixed_run(ctx, label, fp, donor, fresh, chunked, news, tokens, width, forced)
        except CandidateDied:
            raise
        except (CandidateError, RuntimeError, ValueError, TypeError, IndexError) as exc:
            # The engine tries a pass on a static mixed step before it captures any and runs its mixed
            # steps eagerly when the pass fails there (engine/core/mixed_step_graphs.py): not served so.
            return {"skipped": f"the {label} fails a graph-shaped mixed step, which the engine then runs "
                               f"eagerly: {type(exc).__name__}: {str(exc)[:300]}"}
    ev = compare(runs["reference"], runs["candidate"], ctx.tol, s.top_k_compare)
    if not ev["ok"]:
        raise GateFailure("a mixed step shaped as a mixed-step graph replays it differs", tokens_bucket=tokens, **ev)
    return {"tokens_bucket": tokens, "rows_bucket": 4, "new_tokens": [news, [1, 1, len(chunked) - chunk]]}


def _mixed_run(ctx: GateContext, label: str, fp: Any, donor: list[int], fresh: list[int], chunked: list[int],
               news: list[int], tokens: int, width: int, forced: list[int]) -> list[torch.Tensor]:
    s = ctx.settings
    bs = s.block_size
    d = ctx.driver()
    watch = label == "candidate"
    a, b, c = Seq(list(donor)), Seq(list(fresh)), Seq(list(chunked))
    out = [d.step(fp, [a])]
    if label == "reference":
        forced.append(int(out[0][0].argmax()))
    a.tokens.append(forced[0])
    seqs = [a, b, c]
    for seq, k in zip(seqs, news):
        d.allocate(seq, seq.num_computed + k)
    allowed = _step_slots(seqs, news, bs)
    before = _snapshot(d) if watch else None
    out.append(d.graph_mixed_step(fp, seqs, news, tokens=tokens, rows=len(seqs) + 1, width=width)[:2])
    if watch:
        _require_own_writes(d, before, allowed, len(seqs), tokens, "mixed")
    if label == "reference":
        forced += [int(out[1][0].argmax()), int(out[1][1].argmax())]
    a.tokens.append(forced[1])
    b.tokens.append(forced[2])
    rest = len(c.tokens) - c.num_computed  # the chunk's remainder, then decodes
    news2 = [1, 1, rest]
    for seq, k in zip(seqs, news2):
        d.allocate(seq, seq.num_computed + k)
    allowed = _step_slots(seqs, news2, bs)
    before = _snapshot(d) if watch else None
    out.append(d.graph_mixed_step(fp, seqs, news2, tokens=tokens, rows=len(seqs) + 1, width=width))
    if watch:
        _require_own_writes(d, before, allowed, len(seqs), tokens, "mixed")
    return out


def pool_size(ctx: GateContext) -> tuple[int, int]:
    """(the serving pool's blocks, the blocks this gate's drivers get): the pool, or as much of it
    as pool_bytes_max holds, never fewer than num_blocks."""
    s = ctx.settings
    pool = max(s.pool_blocks or s.num_blocks, s.num_blocks)
    per_block = bytes_per_token(ctx.model_config, ctx.dtype) * s.block_size
    return pool, max(s.num_blocks, min(pool, s.pool_bytes_max // per_block))


def gate_block_pool(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    bs, steps = s.block_size, 4
    pool, blocks = pool_size(ctx)
    prompts = [ctx.prompt(ctx.rng.randint(2 * bs + 1, 3 * bs)) for _ in range(4)]
    need = sum(-(-(len(p) + steps) // bs) for p in prompts)
    fixed = list(dict.fromkeys([blocks - 1, 0, blocks // 2]))
    rest = ctx.rng.sample([b for b in range(blocks) if b not in set(fixed)], need - len(fixed))
    order = fixed + rest
    ctx.rng.shuffle(order)
    d_ref, d_cand = ctx.driver(blocks), ctx.driver(blocks)
    d_ref.place(order)
    d_cand.place(order)
    tok, ref = d_ref.greedy(ctx.reference, [Seq(list(p)) for p in prompts], steps)
    _, cand = d_cand.greedy(ctx.candidate, [Seq(list(p)) for p in prompts], steps, forced=tok)
    ev = compare(ref, cand, ctx.tol, s.top_k_compare)
    evidence = {"pool_blocks": pool, "blocks": blocks, "capped": blocks < pool, "highest_block": max(order),
                "blocks_used": len(order)}
    if not ev["ok"]:
        raise GateFailure(f"sequences on blocks up to {max(order)} of a {blocks}-block pool differ", **evidence, **ev)
    return evidence
