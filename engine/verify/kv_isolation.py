"""KV-cache gates: no contamination between requests through the paged cache.

Data flow: GateContext -> kv.prefix_hit_equals_miss (a prefix-cache hit == computed fresh),
kv.batched_equals_alone (outputs do not depend on batch mates), kv.canary_isolation (a secret
in one request never reaches another, next to it or in blocks it freed), kv.swap_compatibility
(same declared cache format -> each pass reads the other's cache) -> evidence.
"""

from __future__ import annotations

from typing import Any

from shapeshift.engine.forward_pass.paged_driver import Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare, require


def gate_prefix_hit(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    bs = s.block_size
    evidence = []
    for _ in range(2):
        shared = ctx.prompt(bs * ctx.rng.randint(1, 3))
        tail = ctx.prompt(ctx.rng.randint(1, bs + 3))
        full = shared + tail
        # miss: the whole prompt computed fresh by the candidate
        miss_driver = ctx.driver()
        miss_tokens, miss_logits = miss_driver.greedy(ctx.candidate, [Seq(list(full))], s.steps // 2)
        # hit: another request computed the shared prefix; this one only computes its tail
        hit_driver = ctx.driver()
        donor = Seq(list(shared) + ctx.prompt(3))
        hit_driver.step(ctx.candidate, [donor])
        child = hit_driver.fork_prefix(donor, full, len(shared) // bs)
        _, hit_logits = hit_driver.greedy(ctx.candidate, [child], s.steps // 2, forced=miss_tokens)
        ev = compare(miss_logits, hit_logits, ctx.tol, s.top_k_compare)
        ev["shared_tokens"] = len(shared)
        evidence.append(require(ev, "a prefix-cache hit changes the outputs"))
    return {"cases": evidence}


def gate_batched_alone(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(4)]
    d = ctx.driver()
    tokens_b, logits_b = d.greedy(ctx.candidate, [Seq(list(p)) for p in prompts], s.steps // 2)
    cases = []
    for i, p in enumerate(prompts):
        alone = ctx.driver()
        _, logits_a = alone.greedy(ctx.candidate, [Seq(list(p))], s.steps // 2, forced=[tokens_b[i]])
        ev = compare([x[i:i + 1] for x in logits_b], logits_a, ctx.tol, s.top_k_compare)
        cases.append(require(ev, f"sequence {i} differs batched vs alone"))
    return {"sequences": len(prompts), "max_logprob_diff": max(c["max_logprob_diff"] for c in cases)}


def gate_canary(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    canary = ctx.prompt(12, text=False)  # the secret: a random 12-token string
    victim = ctx.prompt()
    steps = s.steps // 2
    # 1. victim next to a canary-carrying neighbour vs next to a plain neighbour
    d1 = ctx.driver()
    carrier = Seq(ctx.prompt(5) + canary + ctx.prompt(5))
    v1 = Seq(list(victim))
    tok1, log1 = d1.greedy(ctx.candidate, [carrier, v1], steps)
    d2 = ctx.driver()
    plain = Seq(ctx.prompt(len(carrier.tokens)))
    _, log2 = d2.greedy(ctx.candidate, [plain, Seq(list(victim))], steps, forced=[tok1[1], tok1[1]])
    neighbour = compare([x[1:2] for x in log1], [x[1:2] for x in log2], ctx.tol, s.top_k_compare)
    require(neighbour, "a request's outputs depend on its neighbour's prompt")
    # 2. victim in blocks just freed by the canary carrier vs in never-used blocks
    d3 = ctx.driver()
    holder = Seq(ctx.prompt(3) + canary + ctx.prompt(20))
    d3.greedy(ctx.candidate, [holder], 2)
    freed = list(holder.blocks)
    d3.release(holder)
    v3 = Seq(list(victim))
    tok3, log3 = d3.greedy(ctx.candidate, [v3], steps)
    reused = sorted(set(freed) & set(v3.blocks))
    d4 = ctx.driver()
    _, log4 = d4.greedy(ctx.reference, [Seq(list(victim))], steps, forced=[tok3[0]])
    reuse = compare(log4, log3, ctx.tol, s.top_k_compare)
    reuse["reused_blocks"] = reused
    require(reuse, "a request in freed blocks sees the previous request's KV")
    # 3. the canary never shows up in the victim's generated tokens
    generated = tok1[1] + tok3[0]
    n = 4
    grams = {tuple(canary[i:i + n]) for i in range(len(canary) - n + 1)}
    leaked = [tuple(generated[i:i + n]) for i in range(len(generated) - n + 1) if tuple(generated[i:i + n]) in grams]
    if leaked:
        raise GateFailure("canary tokens appear in another request's output", leaked=leaked[:3])
    return {"neighbour_max_logprob_diff": neighbour["max_logprob_diff"], "reused_blocks": reused,
            "reuse_max_logprob_diff": reuse["max_logprob_diff"], "canary_ngrams_in_output": 0}


def gate_swap(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    if ctx.candidate_cache_format != ctx.reference_cache_format:
        return {"cache_formats": [ctx.reference_cache_format, ctx.candidate_cache_format],
                "policy": "formats differ: the engine flushes the old pass's KV blocks on swap"}
    prompts = [ctx.prompt() for _ in range(3)]
    steps = s.steps // 2
    d_ref = ctx.driver()
    tok_ref, log_ref = d_ref.greedy(ctx.reference, [Seq(list(p)) for p in prompts], steps)
    results = {}
    for label, writer, reader in (("candidate_writes_reference_reads", ctx.candidate, ctx.reference),
                                  ("reference_writes_candidate_reads", ctx.reference, ctx.candidate)):
        d = ctx.driver()
        _, log_mix = d.greedy(writer, [Seq(list(p)) for p in prompts], steps, decode_fp=reader, forced=tok_ref)
        # The first logits come from the writer's prefill; compare the decode steps only.
        ev = compare(log_ref[1:], log_mix[1:], ctx.tol, s.top_k_compare)
        results[label] = require(ev, f"declared the same cache format but {label.replace('_', ' ')} differs")
    return {"cache_format": ctx.candidate_cache_format, **results}
