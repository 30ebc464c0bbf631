"""Anti-cheat gates: the candidate computes its answers, leaves its inputs alone and is physically possible.

Data flow: GateContext + the references engine/verify/anticheat.py captured before any
candidate ran -> anti_cheat.fresh_inputs (reused input buffers with new contents),
anti_cheat.poisoned_outputs (returned logits are never changed or reused), anti_cheat.inputs_unchanged
(inputs, context and shared weights), anti_cheat.no_patching (no replaced function, no stray
thread), anti_cheat.speed_of_light (not faster than bytes/bandwidth or FLOPs/peak) -> evidence.
"""

from __future__ import annotations

from typing import Any

import torch

from shapeshift.engine.verify import anticheat  # first: captures clocks and function identities before any candidate
from shapeshift.engine.forward_pass.weights_guard import fingerprint_diff, weights_fingerprint
from shapeshift.engine.forward_pass.paged_driver import Seq
from shapeshift.engine.verify.context import GateContext, GateFailure, compare


def gate_fresh_inputs(ctx: GateContext) -> dict[str, Any]:
    """Same token at the same position after different contexts; input buffers reused in place."""
    bs = ctx.settings.block_size
    d_ref, d_cand = ctx.driver(), ctx.driver()
    token = ctx.prompt(1)[0]
    n = bs + 3
    ids_buf = pos_buf = None
    mismatches = []
    for trial in range(3):
        context = ctx.prompt(n)
        outs = []
        for d, fp in ((d_ref, ctx.reference), (d_cand, ctx.candidate)):
            seq = Seq(list(context) + [token])
            d.step(fp, [seq], [n])
            input_ids, positions, actx = d.build_step([seq], [1])
            if fp is ctx.candidate:
                # Reuse one storage for every trial: a cache keyed by address sees "the same input".
                if ids_buf is None:
                    ids_buf, pos_buf = input_ids.clone(), positions.clone()
                ids_buf.copy_(input_ids)
                pos_buf.copy_(positions)
                input_ids, positions = ids_buf, pos_buf
            outs.append(fp.forward(input_ids, positions, actx, d.kv).float().clone())
            d.release(seq)
        ev = compare([outs[0]], [outs[1]], ctx.tol, ctx.settings.top_k_compare)
        if not ev["ok"]:
            mismatches.append({"trial": trial, **ev})
    if mismatches:
        raise GateFailure("outputs repeat earlier answers instead of following new inputs", mismatches=mismatches)
    return {"trials": 3, "same_token_position": True, "reused_input_storage": True}


def gate_poisoned_outputs(ctx: GateContext) -> dict[str, Any]:
    s = ctx.settings
    prompts = [ctx.prompt() for _ in range(3)]
    d_ref, d = ctx.driver(), ctx.driver()
    ref_seqs, seqs = [Seq(list(p)) for p in prompts], [Seq(list(p)) for p in prompts]
    r = d_ref.step(ctx.reference, ref_seqs)
    out = d.step(ctx.candidate, seqs)
    problems = []
    for step in range(s.steps // 2):
        nxt = r.argmax(-1).tolist()
        for q, t in zip(ref_seqs, nxt):
            q.tokens.append(t)
        for q, t in zip(seqs, nxt):
            q.tokens.append(t)
        kept = out.detach().clone()
        prev = out
        r = d_ref.step(ctx.reference, ref_seqs, [1] * len(ref_seqs))
        out = d.step(ctx.candidate, seqs, [1] * len(seqs))
        if not torch.equal(prev, kept):
            problems.append({"step": step, "problem": "an earlier output changed after it was returned"})
        prev.fill_(float("nan"))  # poison: the harness owns returned outputs
        ev = compare([r], [out], ctx.tol, s.top_k_compare)
        if not ev["ok"]:
            problems.append({"step": step, "problem": "output differs after the previous one was poisoned", **ev})
        if problems:
            break
    if problems:
        raise GateFailure("outputs alias or reuse earlier buffers", problems=problems)
    return {"steps": s.steps // 2, "poisoned_previous_outputs": True}


def gate_inputs_unchanged(ctx: GateContext, weights_before: dict[str, tuple], by_content: bool = False
                          ) -> dict[str, Any]:
    """``by_content``: compare the weights' contents only (the candidate's process maps a copy at
    other addresses); the weights its process replaced in its dict are what it reports."""
    d = ctx.driver()
    seqs = [Seq(ctx.prompt()) for _ in range(3)]
    changed = []
    for decode in (False, True):
        if decode:
            for q in seqs:
                q.tokens.append(ctx.prompt(1)[0])
        num_new = [1] * len(seqs) if decode else None
        if num_new is None:
            num_new = [len(q.tokens) - q.num_computed for q in seqs]
        input_ids, positions, actx = d.build_step(seqs, num_new)
        before = {"input_ids": input_ids.clone(), "positions": positions.clone(),
                  **{f"ctx.{k}": v.clone() for k, v in vars(actx).items() if isinstance(v, torch.Tensor)}}
        ctx.candidate.forward(input_ids, positions, actx, d.kv)
        after = {"input_ids": input_ids, "positions": positions,
                 **{f"ctx.{k}": v for k, v in vars(actx).items() if isinstance(v, torch.Tensor)}}
        changed += [f"{'decode' if decode else 'prefill'}:{k}" for k in before if not torch.equal(before[k], after[k])]
        for q, n in zip(seqs, num_new):
            q.num_computed += n
    after = weights_fingerprint(ctx.weights)
    if by_content:
        weights_changed = fingerprint_diff({k: v[1:] for k, v in weights_before.items()},
                                           {k: v[1:] for k, v in after.items()})
    else:
        weights_changed = fingerprint_diff(weights_before, after)
    observe = getattr(ctx.candidate, "observe", None)
    replaced = observe().get("replaced_weights", []) if callable(observe) else []
    weights_changed = sorted(set(weights_changed) | {f"replaced:{n}" for n in replaced})
    if changed or weights_changed:
        raise GateFailure("the candidate modified its inputs or the shared weights", inputs=changed,
                          weights=weights_changed[:8])
    return {"checked": ["input_ids", "positions", "attention context", f"{len(weights_before)} weight tensors"]}


def gate_no_patching(threads_before: set[int], candidate_process: Any = None) -> dict[str, Any]:
    """This process's references and threads, and (``candidate_process``) what the candidate left
    in its own process: a pass that patches clocks or starts threads there would do so where it
    is measured and served."""
    patched = anticheat.patched_functions()
    threads = anticheat.foreign_threads(threads_before)
    restored = anticheat.restore_patched() if patched else []
    if candidate_process is not None:
        seen = candidate_process.observe()
        patched += seen.get("patched", [])
        threads += seen.get("threads", [])
    if patched or threads:
        raise GateFailure("the candidate replaced functions the harness relies on or started threads",
                          patched=patched, restored=restored, threads=threads)
    return {"references_checked": len(anticheat._REFERENCE),
            "candidate_process_checked": candidate_process is not None}


def gate_speed_of_light(ctx: GateContext) -> dict[str, Any]:
    hw = anticheat.detect_hardware(ctx.device)
    batch = 4
    d = ctx.driver()
    seqs = [Seq(ctx.prompt(24)) for _ in range(batch)]
    d.step(ctx.candidate, seqs)
    for q in seqs:
        q.tokens.append(ctx.prompt(1)[0])
    input_ids, positions, actx = d.build_step(seqs, [1] * batch)

    def one_step() -> Any:
        return ctx.candidate.forward(input_ids, positions, actx, d.kv)

    seconds, _ = anticheat.timed(one_step, ctx.device)
    ev: dict[str, Any] = {}
    inside = getattr(ctx.candidate, "seconds", None)
    if isinstance(inside, list) and len(inside) >= 5:
        # Timed here, the step includes the trip to the candidate's process; timed there, it is the
        # step alone. The faster one is held to the bound: a clock the candidate slowed there only
        # makes it look faster, never slower.
        process_s = sorted(inside[-5:])[2]
        ev = {"round_trip_s": seconds, "candidate_process_s": process_s}
        seconds = min(seconds, process_s)
    bound = anticheat.decode_step_lower_bound_s(ctx.model_config, ctx.weights, ctx.dtype, batch, 25, hw)
    ev = {"hardware": hw.name, "measured_s": seconds, **ev, **bound}
    if seconds < bound["bound_s"]:
        raise GateFailure("measured faster than physically possible", **ev)
    return ev


def check_speed_of_light(measured_s: float, bound: dict[str, float]) -> bool:
    """True when a measurement is physically possible (used by the compile loop on its own timings)."""
    return measured_s >= bound["bound_s"]
