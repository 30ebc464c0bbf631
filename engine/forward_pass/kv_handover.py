"""Keep or flush the KV cache when one forward pass replaces another in a running engine.

The cache may outlive the outgoing pass only if the incoming one reads what the outgoing one
wrote exactly as it reads its own writes. Data flow, on the engine thread inside the swap's
pause (decode steps in flight already drained):

    outgoing identity, incoming identity (their resolved KV layouts and tags, kv_layout.py)
      --tags differ--> flush: layout_changed (the fields that differ) / layout_undeclared
      --equal tags--> probes: up to ``probes`` cached prefixes of the engine's own cache
          (BlockManager.cached_chains: full blocks the outgoing pass wrote, at most
          ``max_prefix_blocks`` each), topped up with synthetic ones (random prompts the
          outgoing pass prefills into a private PagedDriver) when the cache holds fewer
        hit:  the incoming pass computes a short tail after each prefix, reading the prefix's
              blocks in place; the tail's K/V go to that cache's null block, which no request
              reads (tails alternate between ``tail_tokens`` tokens, a prefill, and one, a decode
              step, the two ways served requests continue a cached prefix)
        miss: the incoming pass prefills prefix + tail from scratch on a private PagedDriver
      --hit logits vs miss logits, the verifier's comparison within its bounds (tolerances.compare,
        TOLERANCES of the engine's dtype: top-k logprobs, logits relative to their spread, no
        clear argmax flip)-->
        kept (verified) | flushed (check_failed; check_error when the incoming pass raised)

Only the tail slots of null blocks are written, so the check changes nothing a request can see.
The swap (swap.py) counts the decision in ``LLMEngine.kv_swaps`` ((outcome, reason) -> count),
which the server exports as shapeshift_kv_swaps_total.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from shapeshift.engine.contracts.metric_names import (KV_SWAP_CHECK_ERROR, KV_SWAP_CHECK_FAILED, KV_SWAP_FLUSHED,
                                                      KV_SWAP_KEPT, KV_SWAP_LAYOUT_CHANGED, KV_SWAP_LAYOUT_UNDECLARED,
                                                      KV_SWAP_VERIFIED)
from shapeshift.engine.forward_pass.kv_layout import layout_diff


@dataclass
class KVCheckSettings:
    probes: int = 3  # prefixes continued by the incoming pass
    max_prefix_blocks: int = 4  # blocks of each prefix it reads (from the first block on)
    tail_tokens: int = 4  # tokens of a prefill tail (the other tails are one decode token)
    top_k: int = 8  # logprobs compared: the miss's top-k
    tolerance: tuple[float, float, float] | None = None  # None: TOLERANCES[engine dtype]


@dataclass
class KVDecision:
    outcome: str  # KV_SWAP_KEPT | KV_SWAP_FLUSHED
    reason: str  # KV_SWAP_REASONS
    detail: str
    seconds: float = 0.0  # time the decision took (the check's cost inside the pause)
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def kept(self) -> bool:
        return self.outcome == KV_SWAP_KEPT

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "reason": self.reason, "detail": self.detail,
                "checkSeconds": round(self.seconds, 4), "evidence": dict(self.evidence)}


def decide(engine: Any, outgoing: Any, outgoing_fp: Any, incoming: Any, incoming_fp: Any,
           settings: KVCheckSettings | None = None) -> KVDecision:
    """What becomes of ``engine``'s KV cache when ``incoming`` (an ActiveForwardPass, built as
    ``incoming_fp``) replaces ``outgoing`` (``outgoing_fp``). Changes nothing of the engine."""
    s = settings or KVCheckSettings()
    t0 = time.perf_counter()
    cached_tag = engine.block_manager.tag
    if incoming.cache_format != cached_tag:
        undeclared = outgoing.kv_layout is None or incoming.kv_layout is None
        changes = layout_diff(outgoing.kv_layout, incoming.kv_layout) or [f"tag: {cached_tag} -> {incoming.cache_format}"]
        return KVDecision(KV_SWAP_FLUSHED, KV_SWAP_LAYOUT_UNDECLARED if undeclared else KV_SWAP_LAYOUT_CHANGED,
                          "KV layouts differ (" + "; ".join(changes) + ")", time.perf_counter() - t0,
                          {"from": cached_tag, "to": incoming.cache_format})
    try:
        evidence = check_prefix_hits(engine, outgoing_fp, incoming_fp, s)
    except Exception as exc:  # noqa: BLE001 - whatever the incoming pass raises, the cache is not trusted to it
        return KVDecision(KV_SWAP_FLUSHED, KV_SWAP_CHECK_ERROR,
                          f"the incoming pass failed continuing cached prefixes: {type(exc).__name__}: {exc}",
                          time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    evidence["seconds"] = round(seconds, 4)
    summary = (f"{evidence['probes']} prefixes ({evidence['cached']} cached, {evidence['synthetic']} synthetic, "
               f"{evidence['prefix_tokens']} tokens): max logprob diff {evidence['max_logprob_diff']:.3g} "
               f"(bound {evidence['tolerance'][0]:g}), max relative logit diff {evidence['max_rel_logit_diff']:.3g} "
               f"(bound {evidence['tolerance'][1]:g}), {evidence['flips']} argmax flips")
    if evidence["ok"]:
        return KVDecision(KV_SWAP_KEPT, KV_SWAP_VERIFIED, f"prefix hits equal a miss: {summary}", seconds, evidence)
    what = "non-finite logits" if not evidence["finite"] else summary
    return KVDecision(KV_SWAP_FLUSHED, KV_SWAP_CHECK_FAILED,
                      f"the incoming pass reads blocks the outgoing pass wrote differently from a miss: {what}",
                      seconds, evidence)


@dataclass
class _Probe:
    cache: Any  # the KVCache holding the prefix's blocks
    blocks: list[int]  # the prefix's blocks, first block first
    tokens: list[int]  # the prefix's tokens (len(blocks) * block_size)
    source: str  # "cached" (the engine's cache) or "synthetic"


def check_prefix_hits(engine: Any, writer: Any, reader: Any, s: KVCheckSettings) -> dict[str, Any]:
    """``reader`` continuing prefixes ``writer`` wrote (hits) vs prefilling them itself (misses)."""
    import torch

    from shapeshift.engine.forward_pass.paged_driver import PagedDriver, Seq, step_inputs
    from shapeshift.engine.forward_pass.tolerances import PRECISION_FACTOR, TOLERANCES, compare

    bm, kv, cfg = engine.block_manager, engine.kv_cache, engine.model_config
    bs = kv.block_size
    seed = int.from_bytes(os.urandom(4), "little")
    with torch.inference_mode():
        probes = [_Probe(kv, chain, [t for b in chain for t in bm.blocks[b].token_ids], "cached")
                  for chain in bm.cached_chains(s.probes, s.max_prefix_blocks)]
        missing = s.probes - len(probes)
        if missing > 0:  # too little cached: the outgoing pass writes prefixes of its own
            gen = torch.Generator().manual_seed(seed)
            sizes = [1 + i % min(2, s.max_prefix_blocks) for i in range(missing)]
            driver = PagedDriver(cfg, engine.dtype, engine.device, num_blocks=sum(sizes), block_size=bs, seed=seed)
            seqs = [Seq(torch.randint(0, cfg.vocab_size, (n * bs,), generator=gen).tolist()) for n in sizes]
            driver.step(writer, seqs)
            probes += [_Probe(driver.kv, list(q.blocks), list(q.tokens), "synthetic") for q in seqs]
        tails = [p.tokens[:1 if i % 2 else min(s.tail_tokens, bs)] for i, p in enumerate(probes)]

        def continued(prefixes: list[_Probe]) -> Any:
            """The reader's logits for each tail after its prefix, read from the prefix's blocks."""
            rows = []
            for probe, tail in zip(prefixes, tails):
                seq = Seq(probe.tokens + tail, blocks=probe.blocks + [probe.cache.null_block],
                          num_computed=len(probe.tokens))
                ids, positions, ctx = step_inputs([seq], [len(tail)], bs, probe.cache.null_block, engine.device)
                rows.append(reader.forward(ids, positions, ctx, probe.cache).float())
            return torch.cat(rows)  # [P, V]

        hit = continued(probes)
        full = [p.tokens + t for p, t in zip(probes, tails)]
        fresh = PagedDriver(cfg, engine.dtype, engine.device, num_blocks=sum(-(-len(f) // bs) for f in full),
                            block_size=bs, seed=seed + 1)
        miss = fresh.step(reader, [Seq(list(f)) for f in full]).float()  # [P, V]
        tol = s.tolerance or TOLERANCES.get(engine.dtype, (0.1, 5e-2, 0.1))
        floor: dict[str, Any] = {}
        if s.tolerance is None and engine.dtype != torch.float32:
            # Half precision: the reader continuing prefixes it wrote itself (a hit on its own
            # blocks) differs from its miss by the rounding of another schedule alone; a hit on
            # the outgoing pass's blocks may differ by PRECISION_FACTOR times that, as the
            # verifier calibrates its bounds (tolerances.py). On an H200 in bf16 the fixed table
            # flushed 27 of 62 swaps between passes of the same code (relative logit 0.051-0.136
            # against 0.05, logprob at most 0.076 against 0.1, no argmax flip).
            own = PagedDriver(cfg, engine.dtype, engine.device, num_blocks=sum(len(p.blocks) for p in probes),
                              block_size=bs, seed=seed + 2)
            seqs = [Seq(list(p.tokens)) for p in probes]
            own.step(reader, seqs)
            self_hit = continued([_Probe(own.kv, list(q.blocks), list(q.tokens), "own") for q in seqs])
            noise = compare([miss], [self_hit], (float("inf"), float("inf"), tol[2]), s.top_k)
            floor = {"self_max_logprob_diff": noise["max_logprob_diff"],
                     "self_max_rel_logit_diff": noise["max_rel_logit_diff"]}
            tol = (max(tol[0], PRECISION_FACTOR * noise["max_logprob_diff"]),
                   max(tol[1], PRECISION_FACTOR * noise["max_rel_logit_diff"]), tol[2])
        evidence = compare([miss], [hit], tol, s.top_k)
    return {**evidence, **floor, "probes": len(probes), "cached": sum(p.source == "cached" for p in probes),
            "synthetic": sum(p.source == "synthetic" for p in probes),
            "prefix_tokens": sum(len(p.tokens) for p in probes), "tail_tokens": [len(t) for t in tails],
            "seed": seed, "tolerance": list(tol)}
