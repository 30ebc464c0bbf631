"""coverage.concurrent_calls: calls that interleave or overlap give what sequential calls give.

A served pass is not always called by one caller at a time: a hot reload's smoke check runs the
incumbent pass in a thread of its own (engine/forward_pass/swap.py) while the engine's loop keeps
serving with it, and two engines over one loaded pass interleave their steps. Every other gate
calls the candidate once at a time, each request group to the end before the next. A pass that
keeps per-call state where every caller shares it (a module-level buffer, an attribute of the
pass) is right on those and wrong for a caller whose call another one overlapped.

Data flow: two request groups of the same shape (same batch size and block-table width,
different context lengths) -> the reference decodes each alone -> the candidate decodes both,
teacher-forced on the reference's tokens, on two drivers (two KV caches): interleaved (A's step,
then B's, one call at a time) and overlapping (each step of A and of B at the same time, in two
threads of the candidate's process released together) -> compare() per group and mode -> evidence.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from shapeshift.engine.forward_pass.paged_driver import Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare
from shapeshift.engine.verify.isolated import IsolatedCandidate

MODES = ("interleaved", "overlapping")


def forward_concurrently(fp: Any, calls: list[tuple[Any, ...]]) -> list[Any]:
    """Every (input_ids, positions, ctx, kv_cache) call at the same time: in the candidate's own
    process when it has one, else in threads here, released together at a barrier."""
    if isinstance(fp, IsolatedCandidate):
        return fp.forward_concurrently(calls)
    start = threading.Barrier(len(calls))
    outs: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        with torch.inference_mode():
            try:
                start.wait()
                outs[i] = fp.forward(*calls[i])
            except BaseException as exc:  # noqa: BLE001 - raised below, in the gate's thread
                errors.append(exc)
                start.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


def gate_concurrent_calls(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    bs, batch, steps = s.block_size, 3, 4
    # Two blocks a sequence for every step: the same block-table width in both groups.
    groups = [[ctx.prompt(ctx.rng.randint(bs + 1, 2 * bs - steps)) for _ in range(batch)] for _ in range(2)]
    reference = [ctx.driver().greedy(ctx.reference, [Seq(list(p)) for p in g], steps) for g in groups]
    evidence: dict[str, Any] = {"groups": [[len(p) for p in g] for g in groups], "steps": steps}
    for mode in MODES:
        drivers = [ctx.driver(), ctx.driver()]
        seqs = [[Seq(list(p)) for p in g] for g in groups]
        logits: list[list[torch.Tensor]] = [[], []]
        for k in range(steps):
            if k:
                for g, (tokens, _) in enumerate(reference):
                    for q, t in zip(seqs[g], tokens):
                        q.tokens.append(t[k - 1])
            num_new = [[len(q.tokens) - q.num_computed for q in group] for group in seqs]
            calls = [(*d.build_step(group, n), d.kv) for d, group, n in zip(drivers, seqs, num_new)]
            if mode == "interleaved":
                outs = [ctx.candidate.forward(*c) for c in calls]
            else:
                outs = forward_concurrently(ctx.candidate, calls)
            for g, (group, n) in enumerate(zip(seqs, num_new)):
                for q, m in zip(group, n):
                    q.num_computed += m
                logits[g].append(outs[g])
        for g, (_, ref_logits) in enumerate(reference):
            ev = compare(ref_logits, logits[g], ctx.tol, s.top_k_compare)
            if not ev["ok"]:
                raise GateFailure(f"{mode} calls differ from sequential ones", mode=mode, group=g, **evidence, **ev)
            evidence[f"{mode}_max_logprob_diff"] = max(evidence.get(f"{mode}_max_logprob_diff", 0.0),
                                                       ev["max_logprob_diff"])
    return evidence
